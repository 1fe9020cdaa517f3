"""The rollout kit replays a recorded judge: rollout files with judge terms pass offline."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rewards import Reward, TermError
from rewards._submission import submission_trajectory
from rewards.judge import Judge, judge_override
from rewards.judge_terms import rubric_term, score_episodes
from rewards.testing import check_rollout_file, run_rollout_file
from rewards.testing.judge_replay import (
    RecordedJudge,
    RecordingJudge,
    export_recording,
    load_recording,
)
from twin import Case
from twin.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


class _Judge(BaseHTTPRequestHandler):
    calls = 0

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).calls += 1
        agent_reason = (
            body["messages"][-1]["content"].split("Agent's reason:", 1)[-1].split("\n")[0]
        )
        score = 5 if "taken down" in agent_reason else 2
        data = json.dumps({"choices": [{"message": {"content": f"SCORE: {score}"}}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    _Judge.calls = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_shipped_judge_rollout_file_passes_offline() -> None:
    outcomes = check_rollout_file(ROOT / "data/rollouts/catalog-judge.rollouts.yaml")
    assert [o.result.components["reason_cites"] for o in outcomes] == [1.0, 0.25, 0.0]


CASE = {
    "truth": {
        "category_id": "aa-5-2",
        "attributes": {},
        "verdict": "counterfeit",
        "reason": "seller was taken down for counterfeit Nikey before",
        "signals": ["seller_taken_down_for_this_brand"],
        "entities": {"brands": ["Nikey"], "sellers": ["Zen"]},
    },
}
SUBMITS = {"cites": "Zen was taken down for Nikey fakes", "vague": "looks off"}


def _rollout_file(path: Path, judge_section: str, answers: dict[str, str] | None = None) -> Path:
    cases = []
    for name, reason in SUBMITS.items():
        case = {
            "name": name,
            **CASE,
            "expect": {"components": {"reason_cites": 1.0 if name == "cites" else 0.25}},
            "submit": {
                "category_id": "aa-5-2",
                "attributes": {},
                "verdict": "counterfeit",
                "reason": reason,
            },
        }
        if answers and name in answers:
            case["judge_answers"] = [answers[name]]
        cases.append(case)
    text = (
        f"twin: CatalogJudge\nconfig: {{reason_judge: "
        f"'openai:judge'}}\n{judge_section}\ncases: {json.dumps(cases)}\n"
    )
    path.write_text(text)
    return path


def test_a_recording_made_against_a_live_judge_replays_with_the_judge_gone(
    judge_url, tmp_path
) -> None:
    from envs.catalog.reason_judge import reason_judge_reward

    live = Judge("openai:judge", base_url=judge_url, cache_dir=tmp_path / "cache")
    reward = reason_judge_reward(live)
    case = Case(twin="CatalogJudge", split="test", index=0, task={}, truth=CASE["truth"])
    episodes = [
        (
            submission_trajectory(
                case,
                {"category_id": "aa-5-2", "attributes": {}, "verdict": "counterfeit", "reason": r},
            ),
            case,
        )
        for r in SUBMITS.values()
    ]
    recorder = RecordingJudge(live)
    with judge_override(recorder):
        live_values = [r.components["reason_cites"] for r in score_episodes(reward, episodes)]
    assert live_values == [1.0, 0.25] and _Judge.calls == 2
    recorder.save(tmp_path / "judge.answers.json")
    assert export_recording(tmp_path / "cache", tmp_path / "exported.json") == 2
    assert load_recording(tmp_path / "exported.json") == load_recording(
        tmp_path / "judge.answers.json"
    )

    path = _rollout_file(tmp_path / "j.rollouts.yaml", "judge: {recording: judge.answers.json}")
    outcomes = run_rollout_file(path)  # the server is still up: count that it is not asked
    assert all(o.passed for o in outcomes), [o.describe() for o in outcomes]
    assert _Judge.calls == 2


def test_a_request_without_a_recorded_answer_fails_and_names_it(tmp_path) -> None:
    path = _rollout_file(
        tmp_path / "j.rollouts.yaml", "judge: {answers: {}}", {"cites": "SCORE: 5"}
    )
    cites, vague = run_rollout_file(path)
    assert cites.passed
    assert not vague.passed and "no recorded judge answer for request" in vague.error
    assert "Agent's reason: looks off" in vague.error or "prompt starts" in vague.error


def test_a_malformed_recorded_answer_fails_like_a_live_one(tmp_path) -> None:
    path = _rollout_file(
        tmp_path / "j.rollouts.yaml", "", {"cites": "fine by me", "vague": "SCORE: 2"}
    )
    cites, vague = run_rollout_file(path)
    assert "malformed" in cites.error and vague.passed


def test_recordings_are_validated(tmp_path) -> None:
    (tmp_path / "bad.yaml").write_text("answers: [1, 2]\n")
    with pytest.raises(ConfigError, match="must map prompt keys"):
        load_recording(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_recording(tmp_path / "missing.yaml")
    path = _rollout_file(tmp_path / "j.rollouts.yaml", "judge: {recording: nope.json, extra: 1}")
    (outcome,) = run_rollout_file(path)
    assert "judge.extra" in outcome.error


def test_recorded_judge_answers_in_order_then_refuses() -> None:
    judge = RecordedJudge(in_order=["SCORE: 4"])
    term_ = rubric_term("q", Judge("openai:x", cache_dir=None), "Good?")
    case = Case(twin="T", split="test", index=0, task={}, truth={})
    traj = submission_trajectory(case, {"a": 1})
    other = submission_trajectory(case, {"a": 2})
    with judge_override(judge):
        assert Reward({term_: 1.0})(traj, case).total == 0.75
        assert Reward({term_: 1.0})(traj, case).total == 0.75  # the same request: the same answer
        with pytest.raises(TermError, match="no recorded judge answer"):
            Reward({term_: 1.0})(other, case)
