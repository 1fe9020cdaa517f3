"""``backend: ray``: the coordinator's rules (no Ray needed) and the toy
LoRA acceptance run (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer.config import load_recipe
from trainer.ray_backend import _Coordinator
from trainer.workers import SharedState
from twin.errors import ConfigError

from .conftest import TOY_LEARN_SEED, TOY_LEARN_STEPS, toy_lora_trainer


def test_backend_is_local_unless_the_recipe_says_ray():
    assert load_recipe("toy-lora-cpu").backend == "local"
    cfg = load_recipe("toy-lora-cpu", ["backend=ray", "ray.rollout_workers=3", "ray.engines=2"])
    assert (cfg.backend, cfg.ray.rollout_workers, cfg.ray.engines) == ("ray", 3, 2)
    with pytest.raises(ConfigError, match="backend: Input should be 'local' or 'ray'"):
        load_recipe("toy-lora-cpu", ["backend=slurm"])
    with pytest.raises(ConfigError, match="rollout_workers"):
        load_recipe("toy-lora-cpu", ["backend=ray", "ray.rollout_workers=0"])
    assert load_recipe("toy-lora-cpu", ["backend=ray", "ray.learner=actor"]).ray.learner == "actor"
    with pytest.raises(ConfigError, match="learner: Input should be 'driver' or 'actor'"):
        load_recipe("toy-lora-cpu", ["backend=ray", "ray.learner=gpu0"])


@pytest.mark.parametrize("learner", ["driver", "actor"])
def test_an_external_sampler_is_refused_by_the_ray_backend(learner):
    from trainer.ray_backend import RayTrainer, RemoteLearner

    cfg = load_recipe("toy-lora-cpu", ["backend=ray", "sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1",
                                       f"ray.learner={learner}"])  # fmt: skip
    with pytest.raises(
        ConfigError, match="starts its own sampler engines; set sampler.kind to 'hf'"
    ):
        (RemoteLearner if learner == "actor" else RayTrainer)(cfg)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_claims_follow_the_local_staleness_rule(k):
    """N workers claiming lots see the rule one worker sees through SharedState.may_sample."""
    import multiprocessing

    local = SharedState(multiprocessing.get_context("spawn"))
    local.update(published=0, claimed=0, consumed=0)
    hub = _Coordinator(published=0, claimed=0, consumed=0, max_new_tokens=0, cursor=0)
    produced = 0
    for worker in range(k + 3):  # more workers than the rule lets sample
        expected = local.may_sample(produced, k)
        claim = hub.claim(worker, k)
        assert (claim is not None) == expected, (worker, claim)
        if claim is not None:
            assert claim == (produced, [])
            produced += 1
    assert produced == k + 1
    hub.update({"published": 1, "claimed": 1, "consumed": 1})  # the learner trained one lot
    assert hub.claim(99, k) == (produced, [])


def test_a_restarted_worker_gets_its_lot_and_cases_back():
    hub = _Coordinator(published=3, claimed=3, consumed=3, max_new_tokens=0, cursor=40)
    assert hub.claim(0, 1) == (3, [])
    assert hub.take_cases(0, 8) == 40
    assert hub.take_cases(0, 2) == 48
    assert hub.claim(1, 1) == (4, [])
    assert hub.take_cases(1, 8) == 50
    # worker 0 died before queueing lot 3: its new instance samples lot 3 on the same cases
    assert hub.claim(0, 1) == (3, [(40, 8), (48, 2)])
    assert hub.done(0) == 58
    hub.hello(0)
    hub.hello(1)
    hub.hello(0)  # Ray ran worker 0's constructor again
    assert hub.restarts() == {0: 1, 1: 0}
    hub.update({"stop": 1})
    assert hub.claim(0, 1) is None
    with pytest.raises(KeyError, match="unknown shared counter 'nope'"):
        hub.update({"nope": 1})


def test_a_claim_waits_in_the_coordinator_until_the_rule_allows_it():
    import asyncio

    hub = _Coordinator(published=0, claimed=0, consumed=0, max_new_tokens=0, cursor=0)
    assert asyncio.run(hub.claim_wait(0, 0, 0.05)) == (0, [])
    assert asyncio.run(hub.claim_wait(1, 0, 0.02)) is None  # one lot ahead at k = 0: wait

    async def learner_trains_then_claim() -> Any:
        async def train() -> None:
            await asyncio.sleep(0.01)
            hub.done(0)
            hub.update({"published": 1, "claimed": 1, "consumed": 1})

        _, claim = await asyncio.gather(train(), hub.claim_wait(1, 0, 5.0))
        return claim

    assert asyncio.run(learner_trains_then_claim()) == (1, [])


#: The Ray placement of the toy acceptance run: a local cluster of 2 CPUs, one engine actor, two
#: rollout worker actors.
RAY_SETS = (
    "backend=ray",
    "ray.rollout_workers=2",
    "ray.engines=1",
    "ray.worker_cpus=0.5",
    "ray.engine_cpus=1",
)


@pytest.mark.slow
def test_ray_backend_learns_the_toy_task_like_local_and_survives_a_killed_worker(
    tmp_path: Path, toy_lora_local: Any
) -> None:
    # The acceptance run: a local Ray cluster of 2 CPUs, one `twin serve` engine actor, two rollout
    # worker actors, the learner here; the toy LoRA recipe trains to the local backend's reward, and
    # a worker actor killed mid-run is restarted and resamples its lot.
    ray = pytest.importorskip("ray", reason="pip install 'twinrl[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    killed: list[int] = []

    def kill_one(trainer: Any, record: dict[str, Any]) -> None:
        if (
            record["step"] == 10 and not killed
        ):  # a worker busy in its loop, killed as a node loss would
            killed.append(record["step"])
            ray.kill(trainer.workers[0], no_restart=False)

    ray_trainer = toy_lora_trainer(tmp_path / "ray", 1, RAY_SETS)
    ray_trainer.on_step = lambda record: kill_one(ray_trainer, record)
    try:
        ray_trainer.setup()
        remote = ray_trainer.train()
    finally:
        ray_trainer.cleanup()
        ray.shutdown()
    local = toy_lora_local(1)  # the same recipe and seed with the local backend

    def late(h: list[dict[str, Any]]) -> float:
        return sum(r["rewards/total"] for r in h[-5:]) / 5

    curves = {
        name: " ".join(f"{r['rewards/total']:.2f}" for r in h[::5])
        for name, h in (("local", local), ("ray", remote))
    }
    assert len(remote) == TOY_LEARN_STEPS
    for h in (local, remote):
        assert sum(r["rewards/total"] for r in h[:3]) / 3 < 0.2, curves  # it starts random
        assert late(h) > 0.8, curves
    assert abs(late(remote) - late(local)) <= 0.1, curves
    assert killed and ray_trainer.worker_restarts == [1, 0], (ray_trainer.worker_restarts, curves)
    assert {r["async/staleness"] for r in remote} <= {0.0, 1.0}
    assert sum(r["async/checks"] for r in remote) == TOY_LEARN_STEPS + 1
    for r in remote:
        assert not r["async/logprob_mismatch"] >= 1e-3  # every engine ran the adapter just trained
    assert ray_trainer.adapters.sent_bytes > 0  # adapters went through the object store


@pytest.mark.slow
def test_a_killed_learner_actor_is_replaced_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    # ray.learner: actor: the learner (with its engines and workers) in a Ray actor; killed after
    # step 12, a new one continues from the step-10 checkpoint, as `twin train --resume` would.
    ray = pytest.importorskip("ray", reason="pip install 'twinrl[ray]'")
    from trainer.ray_backend import RemoteLearner

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = load_recipe(
        "toy-lora-cpu",
        [
            f"seed={TOY_LEARN_SEED}",
            "async.max_staleness=1",
            "train.steps=20",
            "train.checkpoint_every=5",
            f"train.output_dir={tmp_path / 'run'}",
            "train.store=false",
            "backend=ray",
            "ray.learner=actor",
            "ray.learner_cpus=0",
            "ray.rollout_workers=1",
            "ray.worker_cpus=0.5",
            "ray.engine_cpus=1",
        ],
    )
    seen: list[int] = []

    def kill_learner(record: dict[str, Any]) -> None:
        seen.append(record["step"])
        if record["step"] == 12 and trainer.learner_restarts == 0:
            ray.kill(trainer.actor, no_restart=True)

    trainer = RemoteLearner(cfg, on_step=kill_learner)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()
        ray.shutdown()
    assert trainer.learner_restarts == 1
    assert [r["step"] for r in history] == list(range(20))
    # the first learner's steps arrive in order (it may get past 12 before the kill lands), then the
    # second one's from the checkpoint it resumed from: every step seen, the last ones once
    assert seen[:13] == list(range(13)) and sorted(set(seen)) == list(range(20)) and seen[-1] == 19
    # The driver polls the actor's records each second, so the kill lands a few steps after 12.
    # When it lands past a checkpoint's next step, the new learner redoes the steps after that
    # checkpoint (one repeat, starting at a checkpoint step); when the last step done was the
    # checkpoint's own, it continues with the next one and nothing repeats.
    repeats = [i for i in range(1, len(seen)) if seen[i] <= seen[i - 1]]
    assert len(repeats) <= 1, seen
    if repeats:
        assert seen[repeats[0]] % 5 == 0, seen  # a checkpoint step (checkpoint_every 5)
