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


def _episodes(sampler: HFSampler, prompts: list[list[int]], temperature: float) -> list[list]:
    """Three turns; each row's next prompt adds a 'tool result' of its own length."""
    results = [[31], [32] * 45, [33, 34], [35] * 90, [36] * 3]
    out = []
    for turn in range(3):
        samples = sampler.sample(
            prompts, max_new_tokens=[5, 8, 3, 8, 6][: len(prompts)], temperature=temperature,
            stop_ids=[5, 6], seed=turn,
        )  # fmt: skip
        out.append(samples)
        prompts = [p + s.ids + r for p, s, r in zip(prompts, samples, results, strict=False)]
    return out


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "per-row-attention"])
def test_ragged_prefill_samples_what_one_padded_batch_samples(
    tiny, cascade: bool, monkeypatch: pytest.MonkeyPatch
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
    got = _episodes(ragged, prompts, 1.0)
    assert sum(went_ragged) >= 2  # the first turn and at least one later one split
    want = _episodes(padded, prompts, 1.0)
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


def test_ragged_greedy_decoding_matches_a_teacher_forced_forward_pass(tiny) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(40, 400, (40,), generator=g).tolist()
    prompts = [shared + [12], shared + [14] * 70, shared + [15, 16, 17], shared + [18] * 75]
    sampler = HFSampler(model, tok, prefix_cache=True)
    for turn in range(2):
        samples = sampler.sample(prompts, max_new_tokens=5, temperature=0.0, stop_ids=[5], seed=0)
        for prompt, s in zip(prompts, samples, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + s.ids])).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.ids)[:, None])
            assert logits.argmax(-1).tolist() == s.ids
            assert torch.allclose(torch.tensor(s.logprobs), want[:, 0], atol=1e-4)
        prompts = [p + s.ids + [20 + turn] * (1 + 60 * (i % 2)) for i, (p, s) in enumerate(
            zip(prompts, samples, strict=True))]  # fmt: skip
