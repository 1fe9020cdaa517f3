"""Faults of the async trainer: a failed adapter load, a model mismatch, a dying sampler, a killed
learner.

The fast tests need no processes (``httpx.MockTransport``, an in-process server thread). The slow
ones run the real thing: the sampler server is SIGKILLed mid-run and must be restarted with the
current adapter; the learner process is SIGKILLed after a checkpoint and ``resume`` continues.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainer.async_trainer import AsyncTrainer, guarded_command
from trainer.probe import SyncProbe, probe_sequence
from trainer.samplers import ServerSampler
from trainer.weight_sync import AdapterClient
from trainer.workers import AdapterSyncError, ModelCheckTransport

ROOT = Path(__file__).resolve().parents[2]


# -- adapter loading and the model check -----------------------------------------------------------
def _answer(code: int, text: str = "") -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(code, text=text))


@pytest.mark.parametrize("code", [400, 404, 500])
def test_refused_adapter_load_raises(code: int) -> None:
    client = AdapterClient("http://sampler:8000/v1", transport=_answer(code, "No adapter found"))
    with pytest.raises(
        AdapterSyncError, match=rf"refused adapter policy@3 from /x/policy@3: HTTP {code}"
    ):
        client.load("policy@3", "/x/policy@3")


def test_unreachable_sampler_on_load_raises() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(AdapterSyncError, match="unreachable"):
        AdapterClient("http://sampler:8000", transport=httpx.MockTransport(down)).load(
            "policy@1", "/x"
        )


def test_successful_load_posts_the_adapter_and_returns_seconds() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, text="Success")

    seconds = AdapterClient("http://sampler:8000/v1", transport=httpx.MockTransport(handler)).load(
        "policy@1", "/x"
    )
    assert isinstance(seconds, float) and seconds >= 0.0
    assert seen == [("/v1/load_lora_adapter", {"lora_name": "policy@1", "lora_path": "/x"})]


def _completions(model_in_answer: str | None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        choice = {
            "index": 0,
            "token_ids": [5],
            "logprobs": {"token_logprobs": [-1.0]},
            "finish_reason": "length",
        }
        return httpx.Response(
            200, json={"model": model_in_answer or body["model"], "choices": [choice]}
        )

    return httpx.MockTransport(handler)


def test_answer_from_another_model_is_an_error_not_a_fallback() -> None:
    sampler = ServerSampler(
        "http://sampler", "policy@3", transport=ModelCheckTransport(_completions("base"))
    )
    with pytest.raises(AdapterSyncError, match=r"'policy@3' with model 'base'"):
        sampler.sample([[1, 2]], max_new_tokens=1, seed=0)


def test_answer_from_the_asked_model_passes_and_transport_is_reusable() -> None:
    sampler = ServerSampler(
        "http://sampler", "policy@3", transport=ModelCheckTransport(_completions(None))
    )
    for seed in (0, 1):  # each call runs its own event loop and closes the client
        assert [s.ids for s in sampler.sample([[1, 2], [3]], max_new_tokens=1, seed=seed)] == [
            [5],
            [5],
        ]


def test_sampler_error_while_server_is_up_is_raised(tmp_path: Path, async_fakes: Any) -> None:
    # the worker's sampler failed and the server answers /health: a real error, not a restart
    event = ("sampler_error", 0, "sampler server answered HTTP 404 for model 'policy@2'")
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, [], steps=1, events=[event])
    with pytest.raises(AdapterSyncError, match="while the server is up.*policy@2"):
        trainer.train()
    assert trainer.restarts == 0


def test_a_sampler_that_keeps_dying_fails_the_run(tmp_path: Path, async_fakes: Any) -> None:
    from trainer.async_trainer import MAX_RESTARTS_WITHOUT_PROGRESS, SamplerDiedError

    log = "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    server = async_fakes.Server(tmp_path / "vllm.log", log=log)
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, [], steps=1, server=server)
    server.stays_dead, server.up = True, False  # it served set-up, then dies whenever started
    with pytest.raises(SamplerDiedError, match=r"(?s)without a training step.*head_dim=16"):
        trainer.train()
    assert trainer.restarts == MAX_RESTARTS_WITHOUT_PROGRESS  # it tried, then gave up
    assert server.starts == 1 + MAX_RESTARTS_WITHOUT_PROGRESS


# -- against the real built-in server (in-process thread) ------------------------------------------
@pytest.fixture(scope="module")
def live_server() -> Iterator[str]:
    from trainer.models import load_model
    from trainer.serving.completions import CompletionServer
    from trainer.serving.http import make_http_server

    model, tokenizer = load_model("tiny", "float32")
    core = CompletionServer(model, tokenizer, model_name="base")
    httpd = make_http_server(core, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    core.close()


def test_real_server_refuses_a_missing_adapter(live_server: str, tmp_path: Path) -> None:
    with pytest.raises(AdapterSyncError, match="HTTP 404"):
        AdapterClient(live_server).load("policy@1", tmp_path / "nothing-here")


def test_real_server_unknown_adapter_is_an_error(live_server: str) -> None:
    from trainer.samplers import SamplerError

    sampler = ServerSampler(live_server, "policy@9", transport=ModelCheckTransport())
    with pytest.raises(SamplerError, match="404"):
        sampler.sample([[1, 2, 3]], max_new_tokens=2, seed=0)


def test_probe_tells_a_synced_adapter_from_one_that_never_arrived(
    live_server: str, tmp_path: Path
) -> None:
    import torch

    from trainer.config import load_recipe
    from trainer.learner import Learner, build_lora_model
    from trainer.models import load_model
    from twin.registry import make_twin

    cfg = load_recipe("toy-cpu", ["lora.enabled=true", f"train.output_dir={tmp_path}"])
    model, tokenizer = load_model("tiny", "float32")
    model = build_lora_model(model, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # a trained-looking adapter (B = 0 would equal the base model)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    learner = Learner(model, algorithm=cfg.algorithm, optim=cfg.optim)
    probe = SyncProbe(
        learner, probe_sequence(make_twin("Toy"), tokenizer, cfg), lambda: live_server
    )
    AdapterClient(live_server).load("policy@7", learner.save_adapter(tmp_path / "policy@7"))
    probe.launch(7)
    synced, version, _ = probe.collect()
    assert version == 7 and synced < 1e-4
    with torch.no_grad():  # the learner moves on; the sampler never gets the new weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.0)
    probe.launch(7)
    stale, _, _ = probe.collect()
    probe.close()
    assert stale > 100 * max(synced, 1e-6) and stale > 1e-3, (synced, stale)
    print(f"probe mismatch: synced {synced:.2e}, adapter not synced {stale:.2e}")


# -- a learner that dies takes its sampler with it -------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_guarded_child_dies_with_its_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        from trainer.workers import guarded_command
        child = subprocess.Popen(guarded_command([sys.executable, "-c",
            "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(60)"]))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the guarded child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the guarded child outlived its parent"
        time.sleep(0.05)


def test_guarded_command_runs_the_command() -> None:
    out = subprocess.run(
        guarded_command([sys.executable, "-c", "print('hi')"]), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "hi"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# -- slow: the real processes ----------------------------------------------------------------------
def _overrides(tmp_path: Path, steps: int, **extra: Any) -> list[str]:
    items = {
        "lora.enabled": "true",
        "async.max_staleness": 1,
        "train.steps": steps,
        "train.checkpoint_every": 2,
        "train.output_dir": str(tmp_path / "run"),
        "train.store": "false",
        "algorithm.groups_per_step": 2,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


@pytest.mark.slow
def test_sampler_killed_mid_run_is_restarted_with_the_adapter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from trainer.config import load_recipe

    cfg = load_recipe("toy-cpu", _overrides(tmp_path, 6))
    killed: list[int] = []

    def kill_at_step_2(record: dict[str, Any]) -> None:
        if record["step"] == 1 and not killed:
            killed.append(trainer.server.process.pid)
            os.kill(trainer.server.process.pid, signal.SIGKILL)

    trainer = AsyncTrainer(cfg, on_step=kill_at_step_2)
    caplog.set_level(logging.WARNING, logger="twinrl.trainer.async")
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()
    assert killed and trainer.server.process.pid != killed[0]
    assert [r["step"] for r in history] == list(range(6))
    assert history[-1]["async/sampler_restarts"] == 1.0
    assert "failed" in caplog.text and "restarting it and reloading policy@" in caplog.text
    # after the restart the sampler runs the adapter the learner has: the probe agrees (NaN: no
    # check completed in that step; each adapter's is reported once, at most a step late)
    assert sum(r["async/checks"] for r in history) >= 7
    for r in history:
        assert not r["async/logprob_mismatch"] >= 1e-3, r


@pytest.mark.slow
def test_killed_learner_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    from trainer.config import load_recipe
    from trainer.metrics import read_metrics
    from twin.store import RunStore

    store = tmp_path / "store.db"
    env = {**os.environ, "TWINRL_STORE": str(store), "PYTHONPATH": str(ROOT)}
    overrides = _overrides(tmp_path, 6, **{"train.store": "true"})
    script = textwrap.dedent(f"""
        from trainer.config import load_recipe
        from trainer.async_trainer import AsyncTrainer
        if __name__ == "__main__":
            t = AsyncTrainer(load_recipe("toy-cpu", {overrides!r}))
            t.setup()
            t.train()
    """)
    (tmp_path / "run_learner.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run_learner.py")], cwd=ROOT, env=env)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    try:
        while not (latest.exists() and latest.read_text().strip() >= "step-000002"):
            assert proc.poll() is None, "the learner exited before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    before = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(before) >= 2

    os.environ["TWINRL_STORE"] = str(store)
    try:
        trainer = AsyncTrainer(load_recipe("toy-cpu", overrides), resume=True)
        trainer.setup()
        start = trainer.step
        history = trainer.train()
        trainer.cleanup()
    finally:
        del os.environ["TWINRL_STORE"]
    assert start >= 2 and start % 2 == 0
    assert [r["step"] for r in history] == list(range(6))
    assert history[:start] == before[:start]  # what was logged before the checkpoint is kept
    with RunStore(store) as runs:
        (run,) = runs.runs()
        assert run.status == "finished"
        for step in range(6):  # the killed learner's episodes are still there, the rest were added
            assert len(runs.episodes(run.id, step=step)) >= 16, step
