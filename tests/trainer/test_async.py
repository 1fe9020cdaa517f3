"""The async trainer: the staleness gate, the queue protocol, the learner loop, and (slow) a real
run.

Fast tests drive the pieces without processes: the gate is checked by a random interleaving of
worker and learner actions (hypothesis), and :meth:`AsyncTrainer.train` runs on fakes given to its
constructor (``conftest.py``: lots on an in-memory queue, a stub learner, an ``httpx.MockTransport``
sampler). The slow test trains the toy twin with
the built-in server and the learner in separate processes, k = 0 and k = 1.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.async_trainer import AsyncTrainer
from trainer.config import load_recipe
from trainer.workers import SharedState, adapter_name
from twin.errors import ConfigError

from .conftest import TOY_LEARN_STEPS

CTX = multiprocessing.get_context("spawn")


# -- the staleness gate ----------------------------------------------------------------------------
def _simulate(
    k: int,
    choices: list[int],
    steps: int = 6,
    prefer: tuple[str, ...] = (),
    background_load: bool = False,
) -> dict[str, Any]:
    """Run worker/learner actions in the order ``choices`` (or the ``prefer`` order) picks.

    ``background_load``: a finished step only hands its adapter to the load thread, which
    publishes it later ("publish"); the learner hands over the next one only after that (k >= 1).
    """
    shared = SharedState(CTX)
    shared.update(published=0)
    produced = 0
    sampling: int | None = None  # version of the lot the worker is sampling
    q: list[int] = []  # versions of queued lots
    busy = False  # learner inside a step
    step = 0
    loading: int | None = None  # version handed to the load thread, not yet published
    seen: list[int] = []
    overlapped = False
    i = 0
    while step < steps:
        published, claimed, consumed, _, _ = shared.get()
        actions = []
        if sampling is None and shared.may_sample(produced, k):
            actions.append("start")
        if sampling is not None:
            actions.append("finish")
        if q and not busy:
            actions.append("take")
        if busy and loading is None:  # the learner waits for the previous load before its next sync
            actions.append("learn")
        if loading is not None:
            actions.append("publish")
        assert actions, f"deadlock at step {step}: queue {q}, sampling {sampling}, busy {busy}"
        if prefer:
            action = min(actions, key=prefer.index)
        else:
            action = actions[choices[i % len(choices)] % len(actions)]
        i += 1
        if action == "start":
            sampling = published
            overlapped |= busy
        elif action == "finish":
            q.append(sampling)  # type: ignore[arg-type]
            produced += 1
            sampling = None
        elif action == "take":
            version = q.pop(0)
            seen.append(step - version)
            shared.update(claimed=step + 1, consumed=consumed + 1)
            busy = True
        elif action == "publish":
            shared.update(published=loading)  # type: ignore[arg-type]
            loading = None
        else:
            step += 1
            if background_load:
                loading = step
            else:
                shared.update(published=step)
            busy = False
    return {"staleness": seen, "overlapped": overlapped}


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 3), choices=st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_gate_bounds_staleness_and_never_deadlocks(k: int, choices: list[int]) -> None:
    result = _simulate(k, choices)
    assert len(result["staleness"]) == 6
    assert all(0 <= s <= k for s in result["staleness"]), result
    if k == 0:  # the synchronous loop: never samples while the learner learns
        assert not result["overlapped"]
        assert result["staleness"] == [0] * 6


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 3), choices=st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_gate_with_background_loads_bounds_staleness_and_never_deadlocks(
    k: int, choices: list[int]
) -> None:
    # the worker samples with published versions only, and a version is published after its load
    result = _simulate(k, choices, background_load=True)
    assert len(result["staleness"]) == 6
    assert all(0 <= s <= k for s in result["staleness"]), result


def test_gate_lets_k1_overlap() -> None:
    # the learner takes a lot as soon as it is there; the worker then samples lot s+1 with
    # version s while the learner trains on lot s
    result = _simulate(1, [], prefer=("take", "start", "finish", "learn"))
    assert result["overlapped"]
    assert result["staleness"][1:] == [1] * 5


def test_gate_waits_until_first_adapter_is_published() -> None:
    shared = SharedState(CTX)
    assert not shared.may_sample(0, 3)
    shared.update(published=0)
    assert shared.may_sample(0, 0)
    shared.update(stop=1)
    assert not shared.may_sample(0, 3)


def test_adapter_names() -> None:
    assert adapter_name(0) == "policy@0"
    assert adapter_name(12) == "policy@12"


# -- the learner loop with fakes (conftest.py: a stub learner, a mock sampler, lots in memory) -----
def test_train_loop_drops_stale_lots_syncs_and_logs(tmp_path: Path, async_fakes: Any) -> None:
    lot = async_fakes.lot
    lots = [
        lot(0, 0),
        lot(1, 0),
        lot(2, 0),
        lot(3, 2),
        lot(4, 3),
    ]  # lot 2 would train at step 2: too old
    trainer, sampler, _ = async_fakes.trainer(tmp_path, 1, lots, steps=4)
    history = trainer.train()
    assert [r["async/staleness"] for r in history] == [0.0, 1.0, 0.0, 0.0]
    assert history[-1]["async/dropped_stale"] == 1.0
    assert history[-1]["async/staleness_hist"] == {"0": 3, "1": 1}
    assert trainer.learner.steps == 4
    assert sampler.loads == ["policy@0", "policy@1", "policy@2", "policy@3", "policy@4"]
    assert sampler.probes == sampler.loads  # each probe asks for the adapter just loaded
    # every adapter is checked once, reported in the step its check completed (at most one step
    # late), and the last record reports the final adapter's
    assert (
        sum(r["async/checks"] for r in history) == 5 and history[-1]["async/probe_version"] == 4.0
    )
    for r in history:
        assert (
            r["step"] - 1 <= r["async/probe_version"] <= r["policy/version"]
            or not r["async/checks"]
        )
        if r["async/checks"]:
            assert r["async/logprob_mismatch"] == pytest.approx(0.25)
        assert r["async/rollout_idle_frac"] == pytest.approx(0.25)
        assert 0.0 <= r["async/learner_idle_frac"] <= 1.0
        assert r["async/sync_s"] >= 0.0 and math.isfinite(r["rewards/total"])
    assert trainer.shared.get()[:3] == (4, 4, 5)  # published, claimed, consumed
    assert (
        trainer.shared.max_new_tokens() == trainer.max_new_tokens(4) >= 1
    )  # the curriculum reaches the worker
    # only the newest k + 2 adapters stay loaded and on disk
    trainer.stop_workers()
    assert sampler.unloads == ["policy@0", "policy@1"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [
        "policy@2",
        "policy@3",
        "policy@4",
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and "async/queue_depth" in json.loads(lines[0])
    assert (tmp_path / "checkpoints" / "step-000004").is_dir()  # the last step is checkpointed


def test_train_loop_k0_drops_any_lot_of_an_older_version(tmp_path: Path, async_fakes: Any) -> None:
    lot = async_fakes.lot
    trainer, _, _ = async_fakes.trainer(tmp_path, 0, [lot(0, 0), lot(1, 0), lot(2, 1)], steps=2)
    history = trainer.train()
    assert [r["async/staleness"] for r in history] == [0.0, 0.0]
    assert history[-1]["async/dropped_stale"] == 1.0


# -- weight sync off the learner's path (k >= 1) ---------------------------------------------------
def test_background_load_is_published_only_once_loaded_and_lots_name_loaded_adapters(
    tmp_path: Path, async_fakes: Any
) -> None:
    # A fake rollout worker samples as the real one does (the staleness gate, then the newest
    # published version) while each adapter load takes 50 ms: a version published before its
    # load ended would be sampled against an adapter the sampler does not have.
    sampler = async_fakes.Sampler(load_delay=0.05)
    steps = 6
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, [], steps=steps, sampler=sampler)
    tags: list[tuple[int, bool]] = []
    done = threading.Event()

    def worker() -> None:
        produced = 0
        while not done.is_set():
            if not trainer.shared.may_sample(produced, 1):
                time.sleep(0.001)
                continue
            version = trainer.shared.get()[0]
            tags.append((version, adapter_name(version) in sampler.loaded))
            time.sleep(0.01)  # sampling
            trainer.lots.put(async_fakes.lot(produced, version))
            produced += 1

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        history = trainer.train()
    finally:
        done.set()
        thread.join(timeout=5)
    assert len(history) == steps and len(tags) >= steps
    assert all(loaded for _, loaded in tags), tags
    assert [v for v, _ in tags] == sorted(v for v, _ in tags)  # versions only move forward
    assert max(r["async/staleness"] for r in history) <= 1.0
    assert trainer.shared.get()[0] == steps  # the last load ended before train() returned
    assert sampler.loads == [adapter_name(v) for v in range(steps + 1)]
    # every probe asked for its adapter after the load (an early one would 404 and log NaN)
    assert sampler.probes == [adapter_name(v) for v in range(steps + 1)]
    assert sum(r["async/checks"] for r in history) == steps + 1
    assert all(
        r["async/logprob_mismatch"] == pytest.approx(0.25) for r in history if r["async/checks"]
    )


def test_failed_background_load_raises_adapter_sync_error(tmp_path: Path, async_fakes: Any) -> None:
    from trainer.workers import AdapterSyncError

    lot = async_fakes.lot
    sampler = async_fakes.Sampler(
        load_delay=0.02, refuse="policy@2"
    )  # up (healthy), and still refuses
    lots = [lot(0, 0), lot(1, 0), lot(2, 1), lot(3, 2), lot(4, 3)]
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, lots, steps=5, sampler=sampler)
    with pytest.raises(
        AdapterSyncError, match=r"(?s)loading policy@2 in the background failed.*HTTP 400"
    ):
        trainer.train()
    assert trainer.shared.get()[0] == 1  # policy@2 was never published: no lot can carry it
    assert "policy@3" not in sampler.loads  # surfaced no later than the next sync
    assert trainer.learner.steps <= 3


def test_sampler_dying_during_a_background_load_is_restarted(
    tmp_path: Path, async_fakes: Any
) -> None:
    lot = async_fakes.lot
    server = async_fakes.Server(tmp_path / "sampler.log")
    sampler = async_fakes.Sampler(refuse="policy@2", server=server)
    lots = [lot(0, 0), lot(1, 0), lot(2, 1), lot(3, 2), lot(4, 3)]
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, lots, steps=4, sampler=sampler, server=server)
    history = trainer.train()
    assert (
        server.starts == 2 and history[-1]["async/sampler_restarts"] == 1.0
    )  # set-up, then one restart
    assert trainer.shared.get()[0] == 4 and "policy@4" in sampler.loaded
    assert trainer.shared.get()[3] == 1  # the worker was told to sample its lot again
    # the load of policy@2 died with the server; the restart's first load is the learner's current
    # version (policy@2 itself, or policy@3 when the failure surfaced a step later)
    died = sampler.loads.index("policy@2")
    assert sampler.loads[died + 1] in {"policy@2", "policy@3"}


def test_k0_loads_and_publishes_before_the_step_ends(tmp_path: Path, async_fakes: Any) -> None:
    # the synchronous order: sample -> learn -> load and publish -> sample with the new version
    lot = async_fakes.lot
    sampler = async_fakes.Sampler(load_delay=0.05)
    seen: list[tuple[int, int, bool]] = []
    trainer, _, _ = async_fakes.trainer(
        tmp_path,
        0,
        [lot(0, 0), lot(1, 1), lot(2, 2)],
        steps=3,
        sampler=sampler,
        on_step=lambda r: seen.append(
            (r["step"], trainer.shared.get()[0], adapter_name(r["step"] + 1) in sampler.loaded)
        ),
    )
    history = trainer.train()
    assert seen == [
        (0, 1, True),
        (1, 2, True),
        (2, 3, True),
    ]  # loaded and published within the step
    assert all(
        r["async/load_wait_s"] == 0.0 for r in history
    )  # nothing left to a background thread
    assert [r["async/staleness"] for r in history] == [0.0, 0.0, 0.0]


def test_check_every_probes_every_nth_version_and_the_last(
    tmp_path: Path, async_fakes: Any
) -> None:
    from trainer.config import AsyncConfig

    assert AsyncConfig().check_every == 1
    lot = async_fakes.lot
    trainer, sampler, _ = async_fakes.trainer(
        tmp_path,
        1,
        [lot(0, 0), lot(1, 0), lot(2, 1), lot(3, 2)],
        steps=4,
        overrides=["async.check_every=2"],
    )
    history = trainer.train()
    assert sampler.probes == ["policy@0", "policy@2", "policy@4"]
    assert (
        sum(r["async/checks"] for r in history) == 3 and history[-1]["async/probe_version"] == 4.0
    )
    assert any(
        math.isnan(r["async/logprob_mismatch"]) and r["async/probe_version"] == -1 for r in history
    )


def test_a_slow_check_does_not_hold_up_the_learner(tmp_path: Path, async_fakes: Any) -> None:
    # The check of policy@2 cannot finish before the learner has recorded step 2 (the sampler holds
    # it until then, as a long batch in flight would): a learner that waited for the check of its
    # lot's adapter would block in step 2 and the check would time out instead of being released.
    lot = async_fakes.lot
    release = threading.Event()
    sampler = async_fakes.Sampler(hold={"policy@2": release})

    def on_step(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            release.set()

    lots = [lot(0, 0), lot(1, 0), lot(2, 1), lot(3, 2), lot(4, 3)]
    trainer, _, _ = async_fakes.trainer(
        tmp_path, 1, lots, steps=5, sampler=sampler, on_step=on_step
    )
    history = trainer.train()
    assert sampler.released == [True]  # released by the learner's progress, not by the timeout
    assert sum(r["async/checks"] for r in history) == 6  # none lost
    assert all(
        r["async/logprob_mismatch"] == pytest.approx(0.25) for r in history if r["async/checks"]
    )
    by_step = {int(r["step"]): r for r in history}
    assert (
        by_step[2]["async/probe_version"] < 2 <= by_step[3]["async/probe_version"]
    )  # reported a step late


def test_worker_fatal_error_is_raised(tmp_path: Path, async_fakes: Any) -> None:
    from twin.errors import TwinError

    trainer, _, _ = async_fakes.trainer(
        tmp_path, 1, [], steps=1, events=[("fatal", "rollout worker failed: KeyError: 'boom'")]
    )
    with pytest.raises(TwinError, match="boom"):
        trainer.train()


def test_resume_restores_the_async_counters_from_the_shared_checkpoint_format(
    tmp_path: Path, async_fakes: Any
) -> None:
    # one checkpoint format: the runtime's state plus the async loop's counters (extra_state)
    lot = async_fakes.lot
    first, _, _ = async_fakes.trainer(
        tmp_path, 1, [lot(0, 0), lot(1, 0), lot(2, 0), lot(3, 2)], steps=3
    )
    first.train()
    first.stop_workers()
    again, sampler, rollout = async_fakes.trainer(
        tmp_path, 1, [lot(4, 3)], steps=4, overrides=["train.checkpoint_every=1"], setup=False
    )
    again.resume = True
    again.setup()
    assert (again.step, again.lots_used, again.dropped, dict(again.staleness_hist)) == (
        3,
        4,
        1,
        {0: 2, 1: 1},
    )
    assert again.learner.steps == 3  # the learner's state came back too
    assert rollout.side.shared.get()[1:3] == (
        3,
        4,
    )  # the worker resumes at the next lot (claimed, consumed)
    assert sampler.loads == ["policy@3"]  # the sampler starts on the restored version
    history = again.train()
    assert [r["step"] for r in history] == [0, 1, 2, 3]


def test_placement_reaches_the_sampler_server(tmp_path: Path) -> None:
    from trainer.weight_sync import make_sampler_server

    cfg = load_recipe("toy-cpu", [
        "lora.enabled=true", "devices.rollout=cuda:1", "devices.learner=cuda:0", "model.dtype=auto",
        f"train.output_dir={tmp_path}",
    ])  # fmt: skip
    argv = make_sampler_server(cfg, tmp_path).command()
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    cpu = load_recipe("toy-cpu", ["lora.enabled=true", f"train.output_dir={tmp_path}"])
    argv = make_sampler_server(cpu, tmp_path).command()
    assert (
        argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "float32"
    )
    vllm = load_recipe(
        "toy-cpu",
        [
            "lora.enabled=true",
            "sampler.kind=vllm",
            "devices.rollout=cuda:1",
            f"train.output_dir={tmp_path}",
        ],
    )
    server = make_sampler_server(vllm, tmp_path)
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "1"
    assert "--enable-lora" in server.command()


def test_bench_summary_measures_the_window_after_warmup() -> None:
    from bench.trainers import summarize_run

    history = [
        {
            "perf/step_s": 10.0,
            "perf/sampled_tokens": 100.0,
            "async/rollout_idle_s": 5.0,
            "async/rollout_wall_s": 10.0,
            "async/learner_idle_s": 8.0,
            "async/learner_wall_s": 10.0,
        },
        {
            "perf/step_s": 2.0,
            "perf/sampled_tokens": 100.0,
            "async/rollout_idle_s": 5.5,
            "async/rollout_wall_s": 12.0,
            "async/learner_idle_s": 8.0,
            "async/learner_wall_s": 12.0,
        },
        {
            "perf/step_s": 2.0,
            "perf/sampled_tokens": 100.0,
            "async/rollout_idle_s": 6.0,
            "async/rollout_wall_s": 14.0,
            "async/learner_idle_s": 9.0,
            "async/learner_wall_s": 14.0,
        },
    ]
    s = summarize_run(history, warmup=1)
    assert s["steps_per_s"] == pytest.approx(0.5) and s["tokens_per_s"] == pytest.approx(50.0)
    assert s["rollout_idle_frac"] == pytest.approx(0.25) and s[
        "learner_idle_frac"
    ] == pytest.approx(0.25)


def test_async_trainer_needs_lora() -> None:
    cfg = load_recipe("toy-cpu", ["async.max_staleness=1"])  # toy-cpu is full fine-tuning
    with pytest.raises(ConfigError, match="lora.enabled"):
        AsyncTrainer(cfg)


# -- a real run (processes, the built-in server) ---------------------------------------------------
@pytest.mark.slow
def test_k1_learns_the_toy_task_like_k0(toy_lora_local: Any) -> None:
    # The acceptance run: `twin serve`, the rollout worker and the learner in three processes train
    # the toy task with one version of staleness to the reward the synchronous order (k = 0, the
    # same code) reaches. A random tiny model starts at ~0.1; the right call for both words is 1.0.
    sync, overlapped = toy_lora_local(0), toy_lora_local(1)

    def late(h: list[dict[str, Any]], key: str = "rewards/total") -> float:
        return sum(r[key] for r in h[-5:]) / 5

    curves = {f"k{k}": " ".join(f"{r['rewards/total']:.2f}" for r in h[::5])
              for k, h in ((0, sync), (1, overlapped))}  # fmt: skip
    for h in (sync, overlapped):
        assert sum(r["rewards/total"] for r in h[:3]) / 3 < 0.2, curves  # it starts random
        assert late(h) > 0.8, curves
        assert h[-1]["rewards/correct"] > 0.6, curves  # reads the word, not one call for both
    assert abs(late(overlapped) - late(sync)) <= 0.1, curves
    assert {r["async/staleness"] for r in sync} == {0.0}
    assert sum(r["async/staleness"] for r in overlapped) / TOY_LEARN_STEPS > 0.5  # it did overlap
    for h in (sync, overlapped):  # every adapter checked once (NaN: no check completed that step)
        assert sum(r["async/checks"] for r in h) == TOY_LEARN_STEPS + 1, [
            r["async/probe_version"] for r in h
        ]
    for r in sync + overlapped:
        assert (
            not r["async/logprob_mismatch"] >= 1e-3
        )  # the sampler always ran the adapter just trained
