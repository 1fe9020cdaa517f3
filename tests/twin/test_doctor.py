"""``twin check`` (twin.doctor): it runs on every registered twin, and every check can fail.

A small refund desk (:class:`Desk`) passes every check; each subclass plants one defect of the
kinds issue #12 found in the catalog twin (the prompt names the label, a tool returns the truth,
cases that change between processes, a constant answer that scores as well as the reference,
a kind the oracle cannot solve, test cases that reuse train entities, a first tool output that
gives the answer away) and the test asserts that the right check, and only it, fails.
"""

from __future__ import annotations

import json
import random
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from typer.testing import CliRunner

import twin
from twin.core import Twin
from twin.doctor import Report, doctor
from twin.doctor.audit import bag_of_words_audit, scan_leaks
from twin.doctor.report import DEFAULT_THRESHOLDS, parse_threshold, thresholds_for
from twin.errors import ConfigError
from twin.tools import tool
from twinrl_cli import app


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Twins that cache their world on disk write it under a tmp dir, never ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINRL_CACHE", str(tmp_path_factory.mktemp("twinrl-cache")))
        yield


# -- a clean twin and its defective variants ---------------------------------------------------
@dataclass
class Result:
    total: float
    components: dict[str, float] = field(default_factory=dict)
    weighted: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def desk_reward(trajectory: Any, case: Any) -> Result:
    """1 for the right decision."""
    ok = float((trajectory.submission or {}).get("decision") == case.truth["decision"])
    return Result(ok, {"correct": ok}, {"correct": ok})


def _call(name: str, args: dict[str, Any], turn: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"c{turn}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ],
    }


class Rules:
    """Looks the order up, refunds within 30 days: the reference (and oracle) of :class:`Desk`."""

    name = "rules"
    first_tool = "lookup_order"

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        oid = next(m["content"] for m in messages if m["role"] == "user").split()[-1].rstrip(".")
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns == 0:
            return _call(self.first_tool, {"order_id": oid}, 0)
        looked = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        days = next((r["days"] for r in looked if isinstance(r, dict) and "days" in r), None)
        if days is None:
            return _call("lookup_order", {"order_id": oid}, turns)
        return _call(
            "decide", {"order_id": oid, "decision": "refund" if days <= 30 else "deny"}, turns
        )


class Desk(Twin):
    """Refund within 30 days, else deny. Train and test cases use separate orders."""

    name = "DoctorDesk"
    splits = {"train": 400, "test": 100}
    reward = staticmethod(desk_reward)
    # lookup_order is meant to reveal the days the decision follows from
    check_thresholds = {"first_output_margin": 1.0}

    def build_world(self) -> dict[str, Any]:
        rng = random.Random(7)
        return {
            f"O-{k}": {
                "order_id": f"O-{k}",
                "days": rng.choice([rng.randint(1, 30), rng.randint(31, 90)]),
            }
            for k in range(200)
        }

    def pool(self, split: str, decision: str) -> list[str]:
        ids = [f"O-{k}" for k in (range(150) if split == "train" else range(150, 200))]
        return [o for o in ids if (self.world[o]["days"] <= 30) == (decision == "refund")]

    def pick(self, rng: random.Random, pool: list[str], split: str, index: int) -> str:
        return rng.choice(pool)

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        decision = "refund" if index % 2 == 0 else "deny"
        oid = self.pick(rng, self.pool(split, decision), split, index)
        return decision, {"order_id": oid}, {"decision": decision}

    def prompt(self, case: Any) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": "Refund within 30 days of delivery, else deny."},
            {"role": "user", "content": f"Please refund order {case.task['order_id']}."},
        ]

    @tool
    def lookup_order(self, order_id: str, world: dict) -> dict:
        """Look an order up.

        Args:
            order_id: The order id.
        """
        return world.get(order_id) or {"error": "no such order"}

    @tool(terminal=True)
    def decide(self, order_id: str, decision: Literal["refund", "deny"]) -> dict:
        """Decide; ends the episode.

        Args:
            order_id: The order.
            decision: refund or deny.
        """
        return {"recorded": decision}

    def reference_policies(self) -> dict[str, Any]:
        return {"rules": Rules()}

    def oracle_policy(self) -> Any:
        return Rules()

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]]:
        count = min(limit or self.num_cases(split), self.num_cases(split))
        return {"orders": {self.case(split, i).task["order_id"] for i in range(count)}}


class PromptLeak(Desk):
    name = "DoctorPromptLeak"

    def prompt(self, case: Any) -> list[dict[str, Any]]:
        messages = super().prompt(case)
        messages[1]["content"] = f"(triage: {case.truth['decision']}) " + messages[1]["content"]
        return messages


class ToolLeak(Desk):
    name = "DoctorToolLeak"

    @tool
    def lookup_order(self, order_id: str, world: dict) -> dict:
        """Look an order up.

        Args:
            order_id: The order id.
        """
        order = world.get(order_id) or {}
        return {**order, "decision": "refund" if order.get("days", 99) <= 30 else "deny"}


class Nondeterministic(Desk):
    name = "DoctorNondeterministic"

    def pick(self, rng: random.Random, pool: list[str], split: str, index: int) -> str:
        return random.choice(pool)  # the global generator: another instance draws another order


class ConstantWins(Desk):
    name = "DoctorConstantWins"

    @staticmethod
    def reward(trajectory: Any, case: Any) -> Result:  # type: ignore[override]
        decision = (trajectory.submission or {}).get("decision")
        ok = float(decision in (case.truth["decision"], "deny"))  # a deny is never wrong
        return Result(ok, {"correct": ok}, {"correct": ok})


class Unsolvable(Desk):
    name = "DoctorUnsolvable"

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        if index % 3 == 2:  # the truth contradicts the order the tools show
            return (
                "mislabelled",
                {"order_id": rng.choice(self.pool(split, "deny"))},
                {"decision": "refund"},
            )
        return super().make_case(rng, split, index)


class SharedWorld(Desk):
    name = "DoctorSharedWorld"

    def pool(self, split: str, decision: str) -> list[str]:
        return [o for o in self.world if (self.world[o]["days"] <= 30) == (decision == "refund")][
            :20
        ]


class MoodRules(Rules):
    first_tool = "customer_mood"


class FirstOutputLeak(Desk):
    name = "DoctorFirstOutputLeak"
    check_thresholds: dict[str, float] = {}

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        kind, task, truth = super().make_case(rng, split, index)
        return kind, {**task, "mood": "cheerful" if kind == "refund" else "grumpy"}, truth

    @tool
    def customer_mood(self, order_id: str, task: dict) -> dict:
        """How the customer feels.

        Args:
            order_id: The order id.
        """
        return {"mood": task["mood"]}

    def reference_policies(self) -> dict[str, Any]:
        return {"rules": MoodRules()}


class BrokenHook(Desk):
    name = "DoctorBrokenHook"

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]]:
        raise RuntimeError("hook bug")


def quick(cls: type[Twin], **kwargs: Any) -> Report:
    """The doctor without the slow contract and fresh-process checks."""
    return doctor(cls(), contract=False, subprocess_check=False, **kwargs)


def failing(report: Report) -> set[tuple[str, str]]:
    return {(r.check, r.name) for r in report.failures()}


# -- the clean twin passes; each defect fails its own check -------------------------------------
def test_clean_twin_passes_every_check() -> None:
    report = doctor(Desk(), subprocess_check=False)
    report.assert_ok()
    assert {r.check for r in report.rows} == {
        "contract",
        "determinism",
        "solvable",
        "reference",
        "degenerate",
        "truth",
        "shortcut",
        "overlap",
    }
    assert not [r for r in report.rows if r.status != "pass"], report.to_markdown()
    assert {r.name for r in report.rows if r.check == "degenerate"} == {
        "constant decision=refund",
        "constant decision=deny",
        "no tool calls",
        "random",
    }


def test_prompt_that_names_the_label_fails_truth_and_shortcut() -> None:
    report = quick(PromptLeak)
    assert failing(report) == {("truth", "prompt"), ("shortcut", "prompt")}
    assert "'refund'" in report.row("truth", "prompt").note
    with pytest.raises(AssertionError, match="shortcut / prompt"):
        report.assert_ok()


def test_tool_that_returns_the_truth_fails_the_output_scan() -> None:
    report = quick(ToolLeak)
    assert ("truth", "tool outputs and info") in failing(report)
    assert report.row("truth", "prompt").status == "pass"


def test_cases_drawn_from_global_random_fail_determinism() -> None:
    report = quick(Nondeterministic)
    row = report.row("determinism")
    assert (row.status, row.name) == ("fail", "fresh instance")


def test_cases_that_differ_between_processes_fail_determinism(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # hash() of a string is salted per process: the same in a second instance, not in a new process
    (tmp_path / "doctor_hash_twin.py").write_text(
        textwrap.dedent("""
        from twin.core import Twin
        from twin.tools import tool

        class HashTwin(Twin):
            name = "DoctorHash"
            splits = {"train": 20, "test": 20}
            reward = None

            def make_case(self, rng, split, index):
                return "k", {"n": hash(f"{split}{index}") % 1000}, {"answer": "x"}

            def prompt(self, case):
                return [{"role": "user", "content": str(case.task["n"])}]

            @tool(terminal=True)
            def submit(self, answer: str) -> dict:
                \"\"\"Answer.

                Args:
                    answer: The answer.
                \"\"\"
                return {}
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from doctor_hash_twin import HashTwin  # type: ignore[import-not-found]

    from twin.doctor.runner import _check_determinism

    report = Report(twin="x")
    _check_determinism(HashTwin(), report, per_split=5, subprocess_check=True)
    assert [(r.name, r.status) for r in report.rows] == [("fresh process", "fail")]
    sys.modules.pop("doctor_hash_twin", None)


def test_a_class_a_fresh_process_cannot_import_only_warns() -> None:
    from twin.doctor.runner import _check_determinism

    class Local(Desk):  # defined in a function: no fresh process can import it
        name = "DoctorLocal"

    rows = []
    for twin_ in (Desk(), Local()):
        report = Report(twin="x")
        _check_determinism(twin_, report, per_split=3, subprocess_check=True)
        rows += report.rows
    assert [(r.name, r.status) for r in rows] == [
        ("fresh process", "pass"),
        ("fresh instance", "warn"),
    ]
    assert "checked in-process only" in rows[1].note


def test_constant_answer_as_good_as_the_reference_fails_degenerate() -> None:
    report = quick(ConstantWins)
    assert failing(report) == {("degenerate", "constant decision=deny")}
    assert report.row("degenerate", "constant decision=deny").value == pytest.approx(1.0)


def test_a_kind_the_oracle_cannot_solve_fails_solvable() -> None:
    report = quick(Unsolvable)
    row = report.row("solvable")
    assert row.status == "fail" and "mislabelled" in row.note
    assert report.details["oracle: worst reward per kind"]["mislabelled"] == 0.0


def test_test_cases_reusing_train_entities_fail_overlap() -> None:
    report = quick(SharedWorld)
    # the order ids of the prompts repeat across splits, so the prompt classifier memorises them
    assert failing(report) == {("overlap", "orders"), ("shortcut", "prompt")}
    assert report.row("overlap", "orders").value == 1.0


def test_first_tool_output_that_gives_the_answer_away_fails_shortcut() -> None:
    report = quick(FirstOutputLeak)
    assert failing(report) == {("shortcut", "first tool output")}


def test_a_hook_that_raises_fails_its_row_and_the_others_still_run() -> None:
    report = quick(BrokenHook)
    row = report.row("overlap")
    assert row.crashed and row.status == "fail" and "hook bug" in row.note
    assert report.row("shortcut", "prompt").status == "pass"


def test_thresholds_come_from_defaults_twin_and_caller() -> None:
    assert thresholds_for(Desk())["first_output_margin"] == 1.0
    assert thresholds_for(Desk(), {"first_output_margin": 0.3})["first_output_margin"] == 0.3
    assert thresholds_for(PromptLeak())["degenerate_gap"] == DEFAULT_THRESHOLDS["degenerate_gap"]
    # loosening a threshold turns a failure into a pass
    report = quick(ConstantWins, thresholds={"degenerate_gap": -0.5})
    assert report.ok
    with pytest.raises(ConfigError, match="unknown threshold"):
        thresholds_for(Desk(), {"nope": 1.0})
    assert parse_threshold("leak_margin=0.3") == ("leak_margin", 0.3)
    for bad in ("leak_margin", "nope=1", "leak_margin=x"):
        with pytest.raises(ConfigError):
            parse_threshold(bad)


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="no split 'dev'; splits: train, test"):
        doctor(Desk(), split_test="dev")
    with pytest.raises(ConfigError, match="cases must be >= 1"):
        doctor(Desk(), cases=0)


# -- the pieces ---------------------------------------------------------------------------------
def test_bag_of_words_finds_a_keyword_and_not_noise() -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(50)]
    labels = [rng.choice("ab") for _ in range(300)]
    keyed = [
        f"{' '.join(rng.sample(words, 5))} {'alpha' if lb == 'a' else 'beta'}" for lb in labels
    ]
    noise = [" ".join(rng.sample(words, 6)) for _ in labels]
    found = bag_of_words_audit(keyed[:200], labels[:200], keyed[200:], labels[200:])
    assert found.accuracy == 1.0 and found.margin > 0.4
    blind = bag_of_words_audit(noise[:200], labels[:200], noise[200:], labels[200:])
    assert abs(blind.margin) < 0.15


def test_leak_scan_ignores_text_every_case_shows() -> None:
    shared = "policy: refund within 30 days, else deny"
    samples = [(f"c{i}", {v}, f"{shared} order {i}") for i, v in enumerate(["refund", "deny"] * 5)]
    assert scan_leaks(samples, 0.5) == []
    leaky = [(sid, vals, text + f" status={next(iter(vals))}") for sid, vals, text in samples]
    assert {lk.value for lk in scan_leaks(leaky, 0.5)} == {"refund", "deny"}


def test_report_renders_markdown_json_and_terminal() -> None:
    report = quick(ConstantWins)
    md = report.to_markdown()
    assert "| degenerate | constant decision=deny | FAIL |" in md and "## Thresholds" in md
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["thresholds"]["degenerate_gap"] == 0.1
    from rich.console import Console

    console = Console(record=True, width=200)
    report.print(console)
    assert "FAIL" in console.export_text()


# -- every registered twin, and the command line -------------------------------------------------
@pytest.mark.parametrize("twin_id", [s.id for s in twin.list_twins()])
def test_doctor_runs_on_every_registered_twin(twin_id: str) -> None:
    # The fresh-process build is left out here (a catalog world takes ~15 s to build in a new
    # process); the tests above cover that check on small twins, `twin check` runs it.
    report = doctor(twin_id, cases=1, subprocess_check=False)
    assert not [r for r in report.rows if r.crashed], report.to_markdown()
    assert {r.check for r in report.rows} >= {
        "contract",
        "determinism",
        "solvable",
        "degenerate",
        "truth",
        "shortcut",
        "overlap",
    }
    for check in ("contract", "determinism"):
        assert report.row(check).status == "pass", report.to_markdown()
    assert report.row("degenerate", "no tool calls").status == "pass"


def test_cli_check_exit_codes_markdown_and_json(tmp_path: Any) -> None:
    runner = CliRunner()
    md = tmp_path / "toy.md"
    ok = runner.invoke(app, ["check", "toy", "--markdown", str(md)])
    assert ok.exit_code == 0, ok.output
    assert "twin check twin/Toy-v0" in md.read_text()
    failed = runner.invoke(app, ["check", "toy", "--json", "--threshold", "degenerate_gap=0.95"])
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)["ok"] is False
    bad = runner.invoke(app, ["check", "toy", "--threshold", "bogus=1"])
    assert bad.exit_code == 2 and "--threshold expects NAME=VALUE" in bad.output
