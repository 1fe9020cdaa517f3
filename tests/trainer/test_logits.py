"""Chunked logprobs (trainer/logits.py): the unchunked values and gradients, and a peak memory that
`twin plan` predicts (measured on CPU in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import load_recipe
from trainer.logits import chunked_logprobs, logit_peak_bytes
from trainer.plan import plan_recipe

ROOT = Path(__file__).resolve().parents[2]


def _reference(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, t: float):
    z = head(hidden).float() / t
    logp = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_equal_the_whole_matrix_values_and_gradients(
    chunk: int, entropy_grad: bool
) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 50, bias=False)
    hidden = torch.randn(11, 6, requires_grad=True)
    targets = torch.randint(50, (11,))
    weights = torch.randn(11)
    logp, ent = chunked_logprobs(
        hidden, head, targets, temperature=0.7, chunk=chunk, entropy=True, entropy_grad=entropy_grad
    )
    ref_lp, ref_ent = _reference(hidden, head, targets, 0.7)
    torch.testing.assert_close(logp, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-6)
    assert ent.requires_grad is entropy_grad

    loss = (logp * weights).sum() + (0.3 * ent.sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, [hidden, head.weight])
    ref_loss = (ref_lp * weights).sum() + (0.3 * ref_ent.sum() if entropy_grad else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, [hidden, head.weight])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_no_grad_and_empty_inputs() -> None:
    head = torch.nn.Linear(4, 9, bias=False)
    with torch.no_grad():
        logp, ent = chunked_logprobs(
            torch.randn(5, 4), head, torch.randint(9, (5,)), chunk=2, entropy=True
        )
    assert logp.shape == ent.shape == (5,) and not logp.requires_grad
    empty, none = chunked_logprobs(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and none is None


def test_the_scorer_computes_the_logits_one_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner's path (BatchScorer.forward) calls the output layer on at most ``logit_chunk``
    positions at once and gives the logprobs of one unchunked call."""
    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.learner import Learner, TrainBatch
    from trainer.models import load_model

    model, _ = load_model("tiny", "float32")
    ids = [[1] + list(range(5, 45)), [1] + list(range(7, 37))]
    mask = [[0] * 6 + [1] * (len(r) - 6) for r in ids]
    batch = TrainBatch(ids, mask, [[0.0] * len(r) for r in ids], [1.0, -1.0])
    head = model.get_output_embeddings()
    rows_seen: list[int] = []
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda x: (rows_seen.append(x.shape[0]), original(x))[1])
    whole = Learner(
        model,
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(logit_chunk_tokens=4096),
        shared_prefix=False,
    ).logprobs(batch)
    assert max(rows_seen) > 16
    rows_seen.clear()
    chunked = Learner(
        model,
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(logit_chunk_tokens=16),
        shared_prefix=False,
    ).logprobs(batch)
    assert rows_seen and max(rows_seen) <= 16
    for a, b in zip(whole, chunked):
        assert a == pytest.approx(b, abs=1e-5)


def _measure(tokens: int, vocab: int, chunk: int, dtype: str = "float32") -> int:
    code = (
        "import json, sys; from bench.memory import measure_logprob_peak; "
        f"print(json.dumps(measure_logprob_peak({tokens}, {vocab}, chunk={chunk}, "
        f"dtype={dtype!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measured_logprob_peak_agrees_with_twin_plan(tmp_path: Path, dtype: str) -> None:
    """4,096 positions of a 32,768-token vocabulary in chunks of 512: the measured peak is within
    15% of `twin plan`'s logits line (the whole matrix would be 8x the chunk's)."""
    vocab, tokens, chunk = 32768, 4096, 512
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = load_recipe({
        "twin": {"name": "Toy"}, "model": {"path": str(tmp_path), "dtype": dtype},
        "sampler": {"kind": "hf", "max_episode_tokens": tokens},
        "optim": {"micro_batch_tokens": tokens, "logit_chunk_tokens": chunk},
        "devices": {"rollout": "cpu", "learner": "cpu"},
    })  # fmt: skip
    (plan,) = plan_recipe(recipe)
    planned = next(c.bytes for c in plan.components if c.name == "learner logits")
    assert planned == logit_peak_bytes(tokens, vocab, chunk)
    measured = _measure(tokens, vocab, chunk, dtype)
    assert abs(measured - planned) <= 0.15 * planned, (measured, planned)
