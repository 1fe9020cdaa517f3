"""Cascade attention (trainer/serving/cascade.py): a batch's shared prefix attended once for every
row gives the attention, logprobs and samples of the plain per-row path."""

from __future__ import annotations

import pytest
import torch

import trainer.serving.cascade as cascade_module
from trainer.models import load_model
from trainer.samplers import HFSampler
from trainer.serving.cascade import attend_with_prefix, cascade_forward


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _reference(query, key, value, allowed, prefix_key, prefix_value, scaling):
    """Softmax attention over [prefix | own keys], GQA by repeating the kv heads."""
    b, hq = query.shape[:2]
    g = hq // key.shape[1]
    k = torch.cat([prefix_key.expand(b, *prefix_key.shape), key], dim=2).repeat_interleave(g, 1)
    v = torch.cat([prefix_value.expand(b, *prefix_value.shape), value], 2).repeat_interleave(g, 1)
    seen = torch.ones(*allowed.shape[:3], prefix_key.shape[1], dtype=torch.bool)
    mask = torch.cat([seen, allowed], dim=-1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-kernel", "products"])
@pytest.mark.parametrize("q", [1, 5])
def test_attention_over_a_shared_prefix_equals_attention_over_the_concatenation(
    q: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fused:  # the path of other devices, or of a torch without the CPU kernel
        monkeypatch.setattr(cascade_module, "_CPU_FLASH", None)
    g = torch.Generator().manual_seed(0)
    b, hkv, groups, d, m, n = 3, 2, 3, 8, 40, 12
    query = torch.randn(b, hkv * groups, q, d, generator=g)
    key, value = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    prefix_key = torch.randn(hkv, m, d, generator=g)
    prefix_value = torch.randn(hkv, m, d, generator=g)
    allowed = torch.rand(b, 1, q, n, generator=g) > 0.4
    allowed[..., -1] = True  # every query sees at least its own column
    got = attend_with_prefix(query, key, value, allowed, prefix_key, prefix_value, d**-0.5)
    want = _reference(query, key, value, allowed, prefix_key, prefix_value, d**-0.5)
    assert got.shape == (b, q, hkv * groups, d)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # chunked over query rows (a long prefill) gives the same numbers
    small = cascade_module._MAX_SCORES
    cascade_module._MAX_SCORES = 64
    try:
        chunked = attend_with_prefix(query, key, value, allowed, prefix_key, prefix_value, d**-0.5)
    finally:
        cascade_module._MAX_SCORES = small
    assert torch.allclose(chunked, got, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-kernel", "products"])
def test_attention_over_a_shared_prefix_under_bf16_autocast_stays_near_float32(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fused:
        monkeypatch.setattr(cascade_module, "_CPU_FLASH", None)
    g = torch.Generator().manual_seed(3)
    b, hkv, groups, d, m, n, q = 4, 3, 3, 64, 300, 50, 1  # SmolLM2's heads, a decode step
    query = torch.randn(b, hkv * groups, q, d, generator=g)
    key, value = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    prefix_key = torch.randn(hkv, m, d, generator=g)
    prefix_value = torch.randn(hkv, m, d, generator=g)
    allowed = torch.ones(b, 1, q, n, dtype=torch.bool)
    want = _reference(query, key, value, allowed, prefix_key, prefix_value, d**-0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend_with_prefix(
            query.bfloat16(), key.bfloat16(), value.bfloat16(), allowed,
            prefix_key.bfloat16(), prefix_value.bfloat16(), d**-0.5,
        )  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) < 0.02


def _count_cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = cascade_module.attend_with_prefix

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "attend_with_prefix", counted)
    return calls


def test_cascade_decoding_matches_the_per_row_path_over_turns(
    tiny, turns, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(40, 400, (70,), generator=g).tolist()  # a system prompt
    # a GRPO-like batch: two distinct prompts, one repeated, rows of different lengths
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared + [7, 8, 9], shared + [11], shared]
    calls = _count_cascade_calls(monkeypatch)
    on = HFSampler(model, tok, prefix_cache=True)
    off = HFSampler(model, tok, prefix_cache=True)
    off.engine.cascade = False
    on.engine.ragged = off.engine.ragged = False  # one prefill pass, counted below
    results, lengths = [[30, 31]] * len(prompts), [6, 9, 4, 9, 7]
    got, want = turns(on, prompts, results, lengths), turns(off, prompts, results, lengths)
    assert len(calls) > 0 and calls[0] == len(prompts) - 1  # the repeated prompt prefilled once
    tol = 1e-4
    for turn_got, turn_want in zip(got, want, strict=True):
        for a, b in zip(turn_got, turn_want, strict=True):
            assert a.ids == b.ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=tol)
    assert on.store.hits == off.store.hits  # later turns reuse what earlier turns stored
    # the stored rows hold the whole sequence: the prefix is put back in front of each row
    assert sorted(len(e.ids) for e in on.store.entries) == sorted(
        len(e.ids) for e in off.store.entries
    )
    by_ids = sorted(on.store.entries, key=lambda e: e.ids)
    for e_on, e_off in zip(by_ids, sorted(off.store.entries, key=lambda e: e.ids), strict=True):
        assert e_on.ids == e_off.ids
        assert torch.allclose(e_on.keys[0].float(), e_off.keys[0].float(), atol=tol)


def test_cascade_greedy_decoding_matches_a_teacher_forced_forward_pass(tiny, greedy_turns) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(40, 400, (50,), generator=g).tolist()
    prompts = [shared + [12, 13], shared + [14] * 7, shared + [15, 16, 17]]
    greedy_turns(model, tok, prompts, [[20], [20], [20]], max_new_tokens=6)


def test_the_model_keeps_its_own_attention_outside_the_engine(tiny) -> None:
    model, _ = tiny
    before = model.config._attn_implementation
    with cascade_forward(model):
        assert model.config._attn_implementation == cascade_module.NAME
        with pytest.raises(RuntimeError, match="cascade_forward"):
            model(torch.tensor([[3, 4, 5]]))  # no prefix passed: refused, not silently wrong
    assert model.config._attn_implementation == before


@pytest.mark.parametrize(
    "setting",
    [{"sliding_window": 16, "use_sliding_window": True}, {"attn_logit_softcapping": 50.0},
     {"layer_types": ["sliding_attention", "full_attention"]}],
)  # fmt: skip
def test_models_whose_attention_is_not_plain_softmax_decode_without_cascade(setting) -> None:
    from trainer.serving.engine import Engine

    model, _ = load_model("tiny")
    assert Engine(model, pad_id=0).cascade  # on by default on CPU
    assert not Engine(model, pad_id=0, cascade=False).cascade
    for key, value in setting.items():
        setattr(model.config, key, value)
    assert not Engine(model, pad_id=0).cascade


def _stored(model, ids: list[int], *, shared: bool = False):
    """The keys/values of ``ids`` as the engine stores them after a turn."""
    from trainer.models import cache_keyword
    from trainer.serving.kvcache import PrefixStore, build_batch

    batch, feed, pos, new = build_batch(model, PrefixStore(), [ids], [0], 0, cache_keyword(model))
    batch.forward(feed, pos, new)
    entry = batch.take_row(0, [0])
    entry.shared = shared
    return entry


def test_a_stored_entry_longer_than_the_rows_own_caches_is_not_taken_as_their_shared_prefix(
    tiny,
) -> None:
    # The batch's rows share 70 tokens, but what the store holds for them covers only the first
    # 50 (the system prompt); another episode's entry covers all 70 and then goes its own way.
    # The prefix attended once must be what every row has cached, not that entry's 70 tokens: a
    # longer one fed the rows' tokens 50-69 twice, or with room 0 failed to fit the buffer.
    from trainer.models import cache_keyword
    from trainer.serving.kvcache import PrefixStore, build_batch

    model, _ = tiny
    g = torch.Generator().manual_seed(4)
    system = torch.randint(40, 400, (50,), generator=g).tolist()
    common = system + torch.randint(40, 400, (20,), generator=g).tolist()
    other = common + [5, 6, 7, 8]  # an earlier episode's turn, not a prefix of either row
    prompts = [common + [9, 10, 11], common + [12] * 9]
    for room in (0, 4):
        store = PrefixStore()
        store.add(_stored(model, system, shared=True))
        store.add(_stored(model, other))
        batch, feed, pos, new = build_batch(
            model, store, prompts, [len(p) - 1 for p in prompts], room, cache_keyword(model),
            cascade=True,
        )  # fmt: skip
        got = batch.forward(feed, pos, new)
        for b, p in enumerate(prompts):
            want = model(torch.tensor([p])).logits[0, -1].float()
            assert torch.allclose(got[b], want, atol=1e-4), (room, b, (got[b] - want).abs().max())
