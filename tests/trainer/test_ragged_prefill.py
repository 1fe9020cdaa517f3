"""Ragged prefill (trainer/serving/kvcache.py): rows whose new suffixes differ in length are
prefilled in passes of similar lengths, and sample what one padded batch samples."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import trainer.serving.engine as engine_module
from trainer.models import load_model
from trainer.samplers import HFSampler
from trainer.serving.kvcache import plan_buckets


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _cost(passes: list[list[int]], lengths: list[int], pass_tokens: int) -> int:
    return sum(len(p) * max(lengths[i] for i in p) + pass_tokens for p in passes)


def _partitions(items: list[int]):
    """Every way to split ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in _partitions(rest):
        for k in range(len(smaller)):
            yield smaller[:k] + [[first, *smaller[k]]] + smaller[k + 1 :]
        yield [[first], *smaller]


def test_the_plan_is_the_cheapest_split_of_the_rows() -> None:
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.choice([1, 2, 5, 40, 41, 300, 560]) for _ in range(rng.randint(1, 6))]
        pass_tokens = rng.choice([0, 16, 200])
        plan = plan_buckets(lengths, pass_tokens)
        assert sorted(itertools.chain(*plan)) == list(range(len(lengths)))  # each row once
        cheapest = min(
            _cost(p, lengths, pass_tokens) for p in _partitions(list(range(len(lengths))))
        )
        assert _cost(plan, lengths, pass_tokens) == cheapest, (lengths, pass_tokens, plan)


def test_similar_lengths_stay_one_pass_and_far_apart_ones_split() -> None:
    assert plan_buckets([300, 310, 305, 298]) == [[3, 0, 2, 1]]
    assert plan_buckets([65, 559, 70, 1, 540]) == [[3], [0, 2], [4, 1]]
    assert plan_buckets([]) == []


def _spy_passes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, per engine prefill, whether it went ragged."""
    calls: list[bool] = []
    original = engine_module.prefill_ragged

    def spied(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(engine_module, "prefill_ragged", spied)
    return calls


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "per-row-attention"])
def test_ragged_prefill_samples_what_one_padded_batch_samples(
    tiny, turns, cascade: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(40, 400, (60,), generator=g).tolist()
    # a repeated prompt (a GRPO group), a prompt that is another's prefix, very different lengths
    prompts = [shared + [7] * 50, shared + [8], shared + [7] * 50, shared + [9] * 120, shared]
    ragged = HFSampler(model, tok, prefix_cache=True)
    padded = HFSampler(model, tok, prefix_cache=True)
    for sampler in (ragged, padded):
        sampler.engine.cascade = cascade
    padded.engine.ragged = False
    went_ragged = _spy_passes(monkeypatch)
    results = [[31], [32] * 45, [33, 34], [35] * 90, [36] * 3]  # tool results of its own length
    lengths = [5, 8, 3, 8, 6]
    got = turns(ragged, prompts, results, lengths)
    assert sum(went_ragged) >= 2  # the first turn and at least one later one split
    want = turns(padded, prompts, results, lengths)
    for turn_got, turn_want in zip(got, want, strict=True):
        for a, b in zip(turn_got, turn_want, strict=True):
            assert a.ids == b.ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    # the store is left as one batch leaves it: the same entries, hits and misses
    assert (ragged.store.hits, ragged.store.misses) == (padded.store.hits, padded.store.misses)
    assert sorted(e.ids for e in ragged.store.entries) == sorted(
        e.ids for e in padded.store.entries
    )
    for a, b in zip(
        sorted(ragged.store.entries, key=lambda e: e.ids),
        sorted(padded.store.entries, key=lambda e: e.ids),
        strict=True,
    ):
        assert torch.allclose(a.values[-1].float(), b.values[-1].float(), atol=1e-4)


def test_ragged_greedy_decoding_matches_a_teacher_forced_forward_pass(tiny, greedy_turns) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(40, 400, (40,), generator=g).tolist()
    prompts = [shared + [12], shared + [14] * 70, shared + [15, 16, 17], shared + [18] * 75]
    results = [[20], [21] * 61, [22], [23] * 61]  # the next turn is ragged too
    greedy_turns(model, tok, prompts, results, max_new_tokens=5)


def test_the_engine_s_charge_per_pass_reaches_the_planner(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = tiny
    prompts = [[40] * 30 + [8], [40] * 30 + [9] * 200]  # 1 and 200 new tokens after the prefix
    went_ragged = _spy_passes(monkeypatch)
    sampler = HFSampler(model, tok)
    sampler.sample(prompts, max_new_tokens=2, temperature=0.0)
    sampler.engine.pass_tokens = 10**6  # no split can pay for itself
    sampler.sample(prompts, max_new_tokens=2, temperature=0.0)
    assert went_ragged == [True, False]
