"""The shipped 9B recipe leaves Qwen3 room to think before it acts."""

from __future__ import annotations

from pathlib import Path

from trainer.config import load_recipe
from trainer.plan import plan_recipe

RECIPE = Path(__file__).resolve().parents[2] / "data" / "recipes" / "catalog-9b-2x96gb.yaml"

#: Tokens a Qwen3-8B turn at T=1 takes to reason and then write its call, at the least.
THINKING_TURN = 4096


def test_a_turn_has_room_to_think_and_an_episode_several_turns() -> None:
    cfg = load_recipe(RECIPE)
    assert cfg.sampler.temperature == 1.0
    assert (cfg.model.template_kwargs or {}).get("enable_thinking", True), (
        "the recipe trains thinking"
    )
    assert cfg.sampler.max_new_tokens >= THINKING_TURN
    assert cfg.sampler.max_episode_tokens >= 4 * cfg.sampler.max_new_tokens
    # the overlong shaping acts within the budget, and one episode fits one micro-batch
    assert cfg.algorithm.overlong_buffer < cfg.sampler.max_episode_tokens
    assert cfg.optim.micro_batch_tokens >= cfg.sampler.max_episode_tokens


def test_the_longer_episodes_still_fit_two_96gb_gpus() -> None:
    plans = plan_recipe(load_recipe(RECIPE), gpu_memory_gb=96)
    assert [p.device for p in plans] == ["cuda:0", "cuda:1"]
    assert all(p.fits for p in plans), [(p.device, p.total / 1024**3) for p in plans]
