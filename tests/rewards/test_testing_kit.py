"""The rollout-file kit: loading, scoring, the CLI table and exit code, and the pytest plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envs.catalog.reward import make_catalog_reward
from rewards import testing
from rewards.testing import (
    cli_main,
    load_rollout_file,
    register_reward,
    run_rollout_file,
    unregister_reward,
)
from twin.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
IDS = {"aa", "aa-1", "aa-1-2", "aa-5", "aa-5-1", "aa-5-2", "el", "el-1", "el-1-1"}

GOOD = """
twin: KitCatalog
cases:
  - name: gold
    truth: {category_id: aa-5-1, attributes: {color: Black}, verdict: ok, signals: []}
    submit: {category_id: aa-5-1, attributes: {color: " black"}, verdict: ok, reason: fine}
    expect: {total: max, components: {category: 1, attributes: 1, policy: 1}}
  - name: miss with two bad calls
    truth: {category_id: aa-5-1, attributes: {}, verdict: counterfeit, signals: []}
    submit: {category_id: aa-5-2, attributes: {}, verdict: ok, reason: ""}
    invalid_calls: 2
    expect: {total: "0.3*2/3 + 0.3 - 0.4 - 0.02", components: {policy: -1, penalty: 0.02}}
  - name: no submit
    truth: {category_id: aa-5-1, attributes: {}, verdict: ok, signals: []}
    submit: null
    expect: {total: -0.4}
"""

WRONG = """
twin: KitCatalog
cases:
  - name: right
    truth: {category_id: aa-5-1, attributes: {}, verdict: ok, signals: []}
    submit: {category_id: aa-5-1, attributes: {}, verdict: ok, reason: ""}
    expect: {total: 1.0}
  - name: wrongly expects a false alarm to be free
    truth: {category_id: aa-5-1, attributes: {}, verdict: ok, signals: []}
    submit: {category_id: aa-5-1, attributes: {}, verdict: counterfeit, reason: ""}
    expect: {total: 1.0, components: {policy: 1}}
"""


@pytest.fixture(autouse=True)
def kit_reward():
    register_reward("KitCatalog", lambda: make_catalog_reward(IDS.__contains__), override=True)
    yield
    unregister_reward("KitCatalog")
    testing.clear_cache()


def write(tmp_path: Path, text: str, name: str = "x.rollouts.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_good_file_passes_and_prints_the_table(tmp_path, capsys):
    p = write(tmp_path, GOOD)
    assert cli_main([str(p)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "gold",
        "miss with two bad calls",
        "category",
        "attributes",
        "policy",
        "penalty",
        "3/3 rollouts pass",
    ):
        assert needle in out
    assert all(o.passed for o in run_rollout_file(p))


def test_wrong_expectation_exits_non_zero_and_shows_the_difference(tmp_path, capsys):
    p = write(tmp_path, WRONG)
    assert cli_main([str(p)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "1/2 rollouts pass" in out
    assert "total: expected 1, got 0.885714 (diff -0.114286)" in out
    assert "policy: expected 1, got 0.714286" in out


def test_glob_patterns_and_missing_files(tmp_path, capsys):
    write(tmp_path, GOOD, "a.rollouts.yaml")
    write(tmp_path, GOOD, "b.rollouts.yaml")
    assert cli_main([str(tmp_path / "*.rollouts.yaml")]) == 0
    assert "6/6 rollouts pass" in capsys.readouterr().out
    assert cli_main([str(tmp_path / "nothing*.yaml")]) == 2
    assert cli_main([]) == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("twin: X\ncases: []\n", "cases"),
        (
            "twin: X\ncases:\n  - {name: a, truth: {}, expect: {total: 1}}\n",
            "exactly one of `submit:`",
        ),
        (
            "twin: X\ncases:\n  - {name: a, truth: {}, submit: null, turns: [hi], expect: {total: "
            "1}}\n",
            "exactly one",
        ),
        (
            "twin: X\ncases:\n  - {name: a, truth: {}, submit: null, expect: {}}\n",
            "total and/or components",
        ),
        (
            "twin: X\ncases:\n  - {name: a, truth: {}, submit: null, expect: {total: 'import "
            "os'}}\n",
            "arithmetic",
        ),
        (
            "twin: X\ncases:\n  - {name: a, truth: {}, submit: null, expect: {total: 1}, typo: "
            "1}\n",
            r"cases.0 \('a'\).typo",
        ),
        ("twin: [unclosed\n", "not valid YAML"),
    ],
)
def test_invalid_files_say_what_is_wrong(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_rollout_file(write(tmp_path, text))


def test_an_invalid_file_fails_the_cli(tmp_path, capsys):
    assert cli_main([str(write(tmp_path, "twin: X\n"))]) == 1
    assert "ERROR" in capsys.readouterr().out


def test_unknown_twin_is_an_error_outcome(tmp_path):
    p = write(tmp_path, GOOD.replace("KitCatalog", "NoSuchTwinAnywhere"))
    outcomes = run_rollout_file(p)
    assert not outcomes[0].passed and "NoSuchTwinAnywhere" in (outcomes[0].error or "")


def test_a_term_that_raises_fails_the_case(tmp_path):
    # the truth lacks `verdict`: the policy term raises, and the case fails instead of scoring 0
    p = write(
        tmp_path,
        """
        twin: KitCatalog
        cases:
          - name: broken truth
            truth: {category_id: aa-5-1, attributes: {}}
            submit: {category_id: aa-5-1, attributes: {}, verdict: ok, reason: ""}
            expect: {total: 0.6}
        """,
    )
    (outcome,) = run_rollout_file(p)
    assert not outcome.passed and "TermError" in outcome.error and "policy" in outcome.error


def test_reward_entry_in_the_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "from envs.catalog.reward import make_catalog_reward\n"
        "def catalog():\n    return make_catalog_reward(lambda i: True)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write(tmp_path, GOOD.replace("twin: KitCatalog", "twin: Other\nreward: my_rewards:catalog"))
    refused = run_rollout_file(p)  # a module outside the reward library and the twins' packages
    assert all(
        "--allow-import" in (o.error or "") and "my_rewards" in (o.error or "") for o in refused
    )
    assert all(o.passed for o in run_rollout_file(p, allow_import=True))
    # the permission is checked each time, not cached with the scorer
    assert not any(o.passed for o in run_rollout_file(p))


def test_a_rollout_file_cannot_call_arbitrary_callables(tmp_path, monkeypatch, capsys):
    made = []
    monkeypatch.setattr("tempfile.mkdtemp", lambda *a, **k: made.append(1) or str(tmp_path))
    p = write(
        tmp_path, GOOD.replace("twin: KitCatalog", "twin: KitCatalog\nreward: 'tempfile:mkdtemp'")
    )
    assert cli_main([str(p)]) == 1
    assert made == []
    assert "allow-import" in capsys.readouterr().out


def test_rewards_of_registered_twins_load_without_the_flag(tmp_path):
    p = write(
        tmp_path,
        """
        twin: Other
        reward: envs.returns.twin:returns_reward
        cases:
          - name: right refund
            truth: {decision: refund, amount: 25.0, reason: changed_mind}
            task: {order_id: R-1}
            submit: {order_id: R-1, decision: refund, amount: 25.0, reason: policy}
            expect:
              total: 0.9
              components: {correct_decision: 1, correct_amount: 1, checked_order: 0}
        """,
    )
    (outcome,) = run_rollout_file(p)
    assert outcome.passed, outcome.describe()
    assert (
        "envs" in testing.trusted_reward_packages()
        and "rewards" in testing.trusted_reward_packages()
    )


BAD_FILES = {
    "binary.rollouts.yaml": bytes(range(256)) * 8,
    "deep.rollouts.yaml": GOOD.replace(
        "{total: -0.4}", "{total: '" + "*".join(["99"] * 2000) + "'}"
    ).encode(),
    "huge.rollouts.yaml": GOOD.replace("{total: -0.4}", "{total: " + "9" * 401 + "}").encode(),
    "huge-text.rollouts.yaml": GOOD.replace(
        "{total: -0.4}", "{total: '" + "9" * 401 + "'}"
    ).encode(),
    "inf.rollouts.yaml": GOOD.replace("{total: -0.4}", "{total: '1e308*10'}").encode(),
    "tolerance.rollouts.yaml": GOOD.replace(
        "twin: KitCatalog", "twin: KitCatalog\ntolerance: .inf"
    ).encode(),
}


def test_bad_files_are_per_file_errors_and_the_others_still_run(tmp_path, capsys):
    for name, data in BAD_FILES.items():
        (tmp_path / name).write_bytes(data)
    write(tmp_path, GOOD, "good.rollouts.yaml")
    names = sorted(BAD_FILES) + ["good.rollouts.yaml"]
    assert cli_main([str(tmp_path / n) for n in names]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    assert "3/9 rollouts pass" in out  # the good file's three cases; one error per bad file
    for name in BAD_FILES:
        (outcome,) = run_rollout_file(tmp_path / name)
        assert outcome.name == "<file>" and outcome.error and len(outcome.error) < 1500, (
            name,
            outcome,
        )
    assert "not UTF-8" in run_rollout_file(tmp_path / "binary.rollouts.yaml")[0].error
    assert "at most 200" in run_rollout_file(tmp_path / "deep.rollouts.yaml")[0].error
    assert "float can hold" in run_rollout_file(tmp_path / "huge.rollouts.yaml")[0].error
    assert "finite" in run_rollout_file(tmp_path / "inf.rollouts.yaml")[0].error
    assert "finite" in run_rollout_file(tmp_path / "tolerance.rollouts.yaml")[0].error


def test_the_shipped_rollouts_pass_against_the_catalog_reward():
    files = sorted(
        str(p)
        for p in (ROOT / "data" / "rollouts").glob("catalog-v0-*.rollouts.yaml")
        if "replay" not in p.name
    )
    cases = sum(len(load_rollout_file(f).cases) for f in files)
    assert cases >= 25
    for f in files:
        text = Path(f).read_text().replace("twin: Catalog-v0", "twin: KitCatalog")
        spec = testing.RolloutFile.model_validate(__import__("yaml").safe_load(text))
        for c in spec.cases:
            outcome = testing.score_case(spec, c, file=f)
            assert outcome.passed, outcome.describe()


def _run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "kit_rewards.py").write_text(
        "from envs.catalog.reward import make_catalog_reward\n"
        f"def catalog():\n    return make_catalog_reward({sorted(IDS)!r}.__contains__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pytest_plugin_collects_rollout_files(tmp_path):
    write(
        tmp_path,
        GOOD.replace("twin: KitCatalog", "twin: Catalog\nreward: kit_rewards:catalog"),
        "good.rollouts.yaml",
    )
    write(
        tmp_path,
        WRONG.replace("twin: KitCatalog", "twin: Catalog\nreward: kit_rewards:catalog"),
        "wrong.rollouts.yaml",
    )
    # one subprocess (pytest start-up is the slow part): every case is an item, one fails
    done = _run_pytest(
        tmp_path, "-rA", "--rollouts-allow-import", "good.rollouts.yaml", "wrong.rollouts.yaml"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 4 passed" in done.stdout
    assert "PASSED good.rollouts.yaml::gold" in done.stdout
    assert "FAILED wrong.rollouts.yaml::wrongly expects a false alarm to be free" in done.stdout
    assert "total: expected 1, got 0.885714" in done.stdout


RETURNS_CASE = """
twin: Other
reward: {spec}
cases:
  - name: right refund
    truth: {{decision: refund, amount: 25.0, reason: changed_mind}}
    task: {{order_id: R-1}}
    submit: {{order_id: R-1, decision: refund, amount: 25.0, reason: policy}}
    expect: {{total: 1.0}}
"""


def test_a_rollout_file_names_rewards_only_and_calls_nothing_else(tmp_path, monkeypatch, capsys):
    """`reward: envs.catalog.demo:main` once ran the whole demo; `...audit:main` exited the run."""
    import envs.catalog.demo
    import envs.returns.twin as returns_module
    import rewards._terms

    calls = []

    def recorder(*args, **kwargs):
        calls.append(args)
        return returns_module.returns_reward

    monkeypatch.setattr(envs.catalog.demo, "main", recorder)
    monkeypatch.setattr(rewards._terms, "check_name", recorder)
    monkeypatch.setattr(returns_module, "undeclared_factory", recorder, raising=False)
    refused = {
        "envs.catalog.demo:main": "function",  # zero arguments: was called as a factory
        "rewards._terms:check_name": "function",  # two arguments: was called as a scorer
        "envs.returns.twin:undeclared_factory": "function",
        "rewards:Reward": "class",  # a class is callable too
        "envs.returns.twin:SUCCESS_THRESHOLD": "float",
    }
    monkeypatch.setattr(returns_module, "SUCCESS_THRESHOLD", 0.5, raising=False)
    files = []
    for i, spec in enumerate(refused):
        files.append(write(tmp_path, RETURNS_CASE.format(spec=spec), f"r{i}.rollouts.yaml"))
        (outcome,) = run_rollout_file(files[-1])
        assert not outcome.passed and "not a Reward, a term or a reward factory" in outcome.error, (
            spec,
            outcome,
        )
        assert refused[spec] in outcome.error
    assert calls == []
    # the CLI reports every file and its summary; nothing exits the run
    assert cli_main([str(f) for f in files]) == 1
    assert f"0/{len(files)} rollouts pass" in capsys.readouterr().out
    assert calls == []


def test_a_term_and_a_declared_factory_are_rewards(tmp_path, monkeypatch):
    import envs.returns.twin as returns_module
    from rewards import term

    @term(low=0.0, high=1.0)
    def refunded(trajectory, case):
        """1 when the submission refunds."""
        return 1.0

    made = []

    def make_reward():
        made.append(1)
        return returns_module.returns_reward

    monkeypatch.setattr(returns_module, "refunded", refunded, raising=False)
    monkeypatch.setattr(returns_module, "make_reward", make_reward, raising=False)
    monkeypatch.setattr(returns_module, "__reward_factories__", ("make_reward",), raising=False)
    (outcome,) = run_rollout_file(
        write(tmp_path, RETURNS_CASE.format(spec="envs.returns.twin:refunded"))
    )
    assert outcome.passed, outcome.describe()
    assert outcome.result.components == {"refunded": 1.0}
    path = write(
        tmp_path,
        RETURNS_CASE.format(spec="envs.returns.twin:make_reward").replace(
            "total: 1.0", "total: 0.9"
        ),
    )
    (outcome,) = run_rollout_file(path)
    assert outcome.passed, outcome.describe()
    assert made == [1]


def test_the_report_survives_surrogates_escapes_and_huge_names(tmp_path):
    """A lone surrogate in a case name crashed the report; ANSI escapes reached the terminal."""
    good = write(tmp_path, GOOD, "good.rollouts.yaml")
    odd = write(
        tmp_path,
        GOOD.replace("name: gold", 'name: "gold \\ud800"').replace(
            "name: no submit", 'name: "\\e[31mred\\e[0m [bold]markup[/bold]"'
        ),
        "odd.rollouts.yaml",
    )
    huge = write(
        tmp_path, GOOD.replace("twin: KitCatalog", "twin: " + "T" * 200_000), "huge.rollouts.yaml"
    )
    code = (
        "import sys; from rewards.testing import cli_main, register_reward\n"
        "from envs.catalog.reward import make_catalog_reward\n"
        f"register_reward('KitCatalog', lambda: make_catalog_reward({sorted(IDS)!r}.__contains__), "
        "override=True)\nsys.exit(cli_main(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(odd), str(huge), str(good)],
        capture_output=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    out = run.stdout.decode("utf-8")
    assert run.returncode == 1, run.stderr.decode()[-2000:]
    assert "Traceback" not in out + run.stderr.decode()
    assert "\x1b" not in out and "\\x1b[31mred" in out and "[bold]markup[/bold]" in out
    assert "gold ?" in out
    assert len(run.stdout) < 30_000  # the 200,000-character twin name is cut
    assert (
        "6/9 rollouts pass" in out
    )  # every file's results: the odd file's 3 and the good file's 3 pass
