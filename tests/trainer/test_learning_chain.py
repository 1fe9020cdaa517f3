"""scripts/learning_smollm2.py picks up where it stopped: a finished stage is skipped, a stopped
SFT or GRPO run continues from its newest checkpoint, and --chain expert points every stage at
the compact teacher's recipes and folders."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def chain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "learning_smollm2", ROOT / "scripts" / "learning_smollm2.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.use_chain("expert")
    monkeypatch.setattr(module, "RUN_DIR", tmp_path)
    ran: list[list[str]] = []
    monkeypatch.setattr(module, "run", lambda cmd, stdout_path=None: ran.append(cmd))
    module.ran = ran
    return module


def _save(out: Path, step: int, state: dict[str, Any]) -> None:
    import torch

    from trainer.checkpoint import save_checkpoint

    class _Learner:
        def save_adapter(self, path: Path) -> None:
            path.mkdir(parents=True)

        def state_dict(self) -> dict[str, Any]:
            return {"weights": {"w": torch.zeros(1)}}

    save_checkpoint(out, step, learner=_Learner(), state=state, recipe_yaml="seed: 0\n")


ARGS = SimpleNamespace(sft_epochs=1, sft_batch_size=8, sft_eval_cases=0, store=Path("store.db"))


def test_expert_chain_uses_the_compact_teacher_and_its_recipes(chain: Any) -> None:
    assert chain.TEACHER["policy"] == "compact" and chain.MAX_NEW_TOKENS == 192
    assert chain.SFT_RECIPE.endswith("catalog-smollm2-expert-sft-cpu.yaml")
    assert chain.data_dir().name == "data-compact"
    chain.train("sft", ARGS)
    (cmd,) = chain.ran
    assert cmd[1:3] == ["sft", chain.SFT_RECIPE] and "--resume" not in cmd
    assert f"data.paths=[{chain.RUN_DIR / 'data-compact'}]" in cmd


def test_a_stopped_sft_run_resumes_and_a_finished_one_is_skipped(chain: Any) -> None:
    out = chain.RUN_DIR / "sft"
    _save(out, 10, {"total_steps": 45})
    assert not chain.sft_finished(out)
    chain.train("sft", ARGS)
    assert chain.ran[-1][-1] != "--resume" and "--resume" in chain.ran[-1]
    _save(out, 45, {"total_steps": 45})
    assert chain.sft_finished(out)
    assert chain.train("sft", ARGS) is False and len(chain.ran) == 1  # skipped
    _save(out, 50, {"total_steps": 50, "stopped_early": False})
    _save(out, 51, {"total_steps": 60, "stopped_early": True})
    assert chain.sft_finished(out)  # early stopping ends the stage


def test_a_stopped_grpo_run_continues_to_its_length(chain: Any) -> None:
    _save(chain.RUN_DIR / "grpo", 3, {})
    args = SimpleNamespace(**vars(ARGS), grpo_eval_at=[], grpo_steps=8)
    assert chain.train_grpo(args) is True
    (cmd,) = chain.ran
    assert "--resume" in cmd and "train.steps=8" in cmd
