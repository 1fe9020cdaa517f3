"""The catalog's optional judge term (envs/catalog/reason_judge.py): off by default, on through
the twin's options, end to end with a fake judge server (`twin eval`; the recipe, slow)."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from envs.catalog import CatalogTwinV1
from envs.catalog.reason_judge import CatalogJudgeTwin, render_reason
from rewards.judge_terms import RubricTerm
from twin.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


class _Judge(BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = body["messages"][-1]["content"]
        type(self).requests.append(text)
        reason = text.split("Agent's reason:", 1)[-1].split("\n")[0].lower()
        evidence = text.split("Involved:", 1)[-1].split("\n")[0].lower()
        names = [w.strip('",[]{}:') for w in evidence.split() if len(w.strip('",[]{}:')) > 3]
        cited = any(n in reason for n in names if n not in ("brands", "sellers", "recalls"))
        data = json.dumps(
            {"choices": [{"message": {"content": f"SCORE: {5 if cited else 1}"}}]}
        ).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.daemon_threads = True
    _Judge.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_off_by_default_it_is_catalog_v1() -> None:
    plain, v1 = CatalogJudgeTwin(), CatalogTwinV1()
    assert plain.judge is None and plain.reward.weights == v1.reward.weights
    assert plain.world_key() == v1.world_key()  # the judge options never change the world
    assert plain.reward.bounds == v1.reward.bounds and plain.tool_schemas == v1.tool_schemas


def test_on_it_adds_the_term_and_keeps_the_maximum(tmp_path) -> None:
    on = CatalogJudgeTwin(
        reason_judge="openai:judge", reason_judge_weight=0.2, reason_judge_cache_dir=str(tmp_path)
    )
    weights = on.reward.weights
    assert weights["reason_cites"] == 0.2
    assert weights["policy"] == pytest.approx(0.8 * CatalogTwinV1().reward.weights["policy"])
    assert on.reward.bounds[1] == CatalogTwinV1().reward.bounds[1] == 1.0
    assert isinstance(on.reward.terms[-1], RubricTerm)
    with pytest.raises(ConfigError, match="reason_judge_weight"):
        CatalogJudgeTwin(reason_judge="openai:judge", reason_judge_weight=1.5)


def test_the_judge_reads_the_deciding_evidence_and_the_reason() -> None:
    twin = CatalogJudgeTwin()
    case = twin.case("test", 0)
    episode = SimpleNamespace(submission={"verdict": "ok", "reason": "all fine"})
    text = render_reason(episode, case)
    assert f"Evidence that decided it: {case.truth['reason']}" in text
    assert "Agent's reason: all fine" in text and case.truth["category_id"] not in text


def test_twin_eval_with_the_judge_on_against_a_fake_judge(judge_url, tmp_path, monkeypatch) -> None:
    from twinrl_cli import app

    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path / "cache"))
    args = [
        "eval",
        "CatalogJudge",
        "--policy",
        "careful",
        "--episodes",
        "6",
        "--no-progress",
        "--store",
        str(tmp_path / "runs.db"),
        "--set",
        "reason_judge=openai:judge",
        "--set",
        f"reason_judge_base_url={judge_url}",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "reason_cites" in out and len(_Judge.requests) == 6
    again = CliRunner().invoke(app, args)  # the same episodes: every answer comes from the cache
    assert again.exit_code == 0 and len(_Judge.requests) == 6
    from twin.store import RunStore

    store = RunStore(tmp_path / "runs.db")
    first = store.runs()[-1]
    episodes = list(store.episodes(first.id))
    assert all("reason_cites" in t.components for t in episodes)
    assert all(
        any("reason_cites: judge openai:judge said" in n for n in t.reward_notes) for t in episodes
    )
    assert all(t.info["judge"]["reason_cites"]["answer"].startswith("SCORE:") for t in episodes)
    store.close()


@pytest.mark.slow
def test_the_judge_recipe_trains_end_to_end_with_a_fake_judge(
    judge_url, tmp_path, monkeypatch
) -> None:
    from rich.console import Console

    from trainer.cli import train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "store.db"))
    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path / "cache"))
    buffer = io.StringIO()
    code = train(
        str(ROOT / "data/recipes/catalog-judge-tiny-cpu.yaml"),
        [f"train.output_dir={tmp_path / 'run'}", f"twin.config.reason_judge_base_url={judge_url}"],
        False,
        console=Console(file=buffer, width=120),
    )
    assert code == 0, buffer.getvalue()
    history = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(history) == 2 and all("rewards/reason_cites" in h for h in history)
