"""Kill after a checkpoint, --resume: the next steps' metrics match an uninterrupted run."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from envs.toy import ToyTwin
from envs.toy.twin import closeness, prefix
from rewards import Reward
from trainer.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    prepare_output_dir,
    restore_rng,
)
from trainer.config import load_recipe
from trainer.metrics import read_metrics
from trainer.sync_trainer import SyncTrainer
from twin.errors import ConfigError
from twin.registry import register, registry


class DenseToyTwin(ToyTwin):
    """The toy with a dense reward: random text already gets varied
    rewards, so every step updates."""

    name = "DenseToy"
    reward = Reward({closeness: 0.8, prefix: 0.2}, name="dense_toy")


if "twin/DenseToy-v0" not in registry:
    register(DenseToyTwin)

# Timings differ run to run; everything else must match.
VOLATILE = ("perf/",)


def _cfg(out, steps: int, lora: bool):
    return load_recipe(
        "toy-cpu",
        [
            f"train.output_dir={out}",
            "twin.name=DenseToy",
            "sampler.length_curriculum=none",
            f"train.steps={steps}",
            "train.checkpoint_every=2",
            "train.store=false",
            "algorithm.group_size=4",
            "algorithm.groups_per_step=2",
            "sampler.max_new_tokens=6",
            f"lora.enabled={str(lora).lower()}",
            "optim.lr=1e-2",
            "optim.mini_batches=2",  # optimizer state and clipping both matter
        ],
    )


def _run(cfg, resume: bool = False) -> list[dict]:
    recipe = SyncTrainer(cfg, resume=resume)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_matches_uninterrupted(tmp_path, lora: bool) -> None:
    full = _run(_cfg(tmp_path / "a", 4, lora))
    assert len(full) == 4

    _run(_cfg(tmp_path / "b", 2, lora))  # "killed" right after the step-2 checkpoint
    assert latest_checkpoint(tmp_path / "b").name == "step-000002"
    # the killed run had also logged a step after its checkpoint: resume must drop it
    with open(tmp_path / "b" / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 2, "rewards/total": -1.0}) + "\n")
    resumed = _run(_cfg(tmp_path / "b", 4, lora), resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2, 3]
    for a, b in zip(full, resumed):
        a, b = _stable(a), _stable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), (a["step"], k, a[k], b[k])
    # every step updated the policy (so optimizer state and weights were really restored)
    assert all(r["policy/grad_norm"] > 0 for r in full)


def test_fresh_run_refuses_old_checkpoints_unless_overwrite(tmp_path) -> None:
    _run(_cfg(tmp_path / "c", 2, False))
    first = latest_checkpoint(tmp_path / "c")
    assert first is not None
    with pytest.raises(
        ConfigError,
        match=r"already holds checkpoints \(latest: step-000002\).*--resume.*--overwrite",
    ):
        SyncTrainer(_cfg(tmp_path / "c", 1, False)).setup()
    assert latest_checkpoint(tmp_path / "c") == first  # nothing was deleted
    recipe = SyncTrainer(_cfg(tmp_path / "c", 1, False), overwrite=True)
    recipe.setup()
    recipe.cleanup()
    assert latest_checkpoint(tmp_path / "c") is None


@pytest.mark.parametrize("runner", ["sync", "async"])
def test_both_runners_refuse_to_start_over_checkpoints(tmp_path, runner: str) -> None:
    from trainer.async_trainer import AsyncTrainer

    cfg = load_recipe(
        "toy-cpu", [f"train.output_dir={tmp_path}", "lora.enabled=true", "train.store=false"]
    )
    checkpoint = tmp_path / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"from an earlier run")
    cls = SyncTrainer if runner == "sync" else AsyncTrainer
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        cls(cfg).setup()  # refused before any model, worker or server is started
    assert (checkpoint / "trainer_state.pt").read_bytes() == b"from an earlier run"


def test_output_dir_that_is_a_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"train\.output_dir .*out' is a file"):
        prepare_output_dir(tmp_path / "out", resume=False, overwrite=True)


class _Payload:
    """What a hostile trainer_state.pt could hold: unpickling it would create a file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_resume_never_unpickles_objects(tmp_path) -> None:
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    target = tmp_path / "pwned"
    torch.save({"step": 1, "rng": _Payload(str(target))}, checkpoint / "trainer_state.pt")
    with pytest.raises(ConfigError, match=r"unsafe \(pickle\) loading"):
        load_checkpoint(checkpoint)
    assert not target.exists()
    # a checkpoint of an older twinrl (numpy's RNG state as an array) is refused the same way
    torch.save(
        {"step": 1, "rng": {"numpy": np.random.get_state()}}, checkpoint / "trainer_state.pt"
    )
    with pytest.raises(ConfigError, match="older twinrl"):
        load_checkpoint(checkpoint)


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path) -> None:
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    np.random.standard_normal()  # numpy caches a gaussian: that state must survive too
    state = capture_rng()
    torch.save(state, tmp_path / "rng.pt")
    expected = (np.random.standard_normal(3).tolist(), random.random(), torch.rand(2).tolist())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (
        np.random.standard_normal(3).tolist(),
        random.random(),
        torch.rand(2).tolist(),
    ) == expected


# -- weights are never deleted by surprise; a damaged checkpoint; one run per folder ---------------
@pytest.mark.parametrize("resume", [False, True], ids=["plain", "resume"])
def test_a_folder_with_weights_but_no_trainer_state_is_kept(tmp_path, resume: bool) -> None:
    """Stripping trainer_state.pt to save space, then running again, once wiped the adapters."""
    adapter = tmp_path / "checkpoints" / "step-000010" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"trained weights")
    with pytest.raises(
        ConfigError, match=r"holds weights \(step-000010\).*not deleted.*--overwrite"
    ):
        prepare_output_dir(tmp_path, resume=resume, overwrite=False)
    assert (adapter / "adapter_model.safetensors").read_bytes() == b"trained weights"
    assert prepare_output_dir(tmp_path, resume=resume, overwrite=True) is None  # said so: deleted
    assert not adapter.exists()


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog) -> None:
    _run(_cfg(tmp_path / "d", 4, True))  # checkpoints at steps 2 and 4
    latest = latest_checkpoint(tmp_path / "d")
    assert latest is not None and latest.name == "step-000004"
    state = latest / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a disk that filled up
    recipe = SyncTrainer(_cfg(tmp_path / "d", 6, True), resume=True)
    with caplog.at_level("WARNING", logger="twinrl.checkpoint"):
        recipe.setup()
    try:
        assert recipe.step == 2
        assert "step-000004" in caplog.text and "trying the one before it" in caplog.text
    finally:
        recipe.cleanup()


def test_no_readable_checkpoint_is_a_one_line_error(tmp_path) -> None:
    from trainer.checkpoint import load_resumable

    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(
        ConfigError,
        match=r"no checkpoint .* can be read \(step-000004: .*; step-000002: .*--overwrite",
    ) as info:
        load_resumable(tmp_path, tmp_path / "checkpoints" / "step-000004")
    assert "\n" not in str(info.value)


def test_two_runs_cannot_share_an_output_folder(tmp_path) -> None:
    import subprocess
    import sys

    from trainer.checkpoint import unlock_output_dir

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from trainer.checkpoint import lock_output_dir as lock; "
            f"lock({str(tmp_path)!r}); print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            ConfigError, match=rf"in use by another training run \(pid {holder.pid};"
        ):
            prepare_output_dir(tmp_path, resume=False, overwrite=True)
        with pytest.raises(ConfigError, match="in use by another training run"):
            SyncTrainer(_cfg(tmp_path, 1, True)).setup()  # refused before the model loads
    finally:
        holder.communicate("", timeout=30)  # the holder exits: the OS drops its lock
    assert prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    unlock_output_dir(tmp_path)


def test_a_refused_run_leaves_the_folder_unlocked(tmp_path) -> None:
    import subprocess
    import sys

    checkpoint = tmp_path / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"from an earlier run")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        prepare_output_dir(tmp_path, resume=False, overwrite=False)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from trainer.checkpoint import lock_output_dir; lock_output_dir({str(tmp_path)!r})",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode == 0, other.stderr[-1000:]
