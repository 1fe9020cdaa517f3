"""A twin inside TRL: ``GRPOTrainer(environment_factory=...)`` trains on the Returns twin (CPU, tiny model)."""

from __future__ import annotations

import json

import pytest
from transformers.utils import get_json_schema

from integrations.trl import trl_dataset, trl_environment, trl_rows
from twin.registry import make_twin

pytest.importorskip("trl", reason="TRL is not installed: pip install 'twinrl[integrations]'")


def _expected_reward(twin, traj, case) -> float:
    """The twin's reward of an episode; one the rollout left unfinished counts as truncated."""
    if not (traj.terminated or traj.truncated):
        traj = traj.model_copy(update={"truncated": True})
    return float(twin.score(traj, case).total)


def test_methods_are_the_twins_tools_typed_and_documented():
    twin = make_twin("Returns")
    env = trl_environment(twin)()
    for tool in twin.tools:
        schema = get_json_schema(getattr(env, tool.name))["function"]
        want = tool.schema["function"]
        assert schema["name"] == want["name"] and schema["description"] == want["description"]
        assert schema["parameters"]["properties"].keys() == want["parameters"]["properties"].keys()
        assert set(schema["parameters"].get("required", [])) == set(want["parameters"]["required"])
        for name, prop in want["parameters"]["properties"].items():
            assert schema["parameters"]["properties"][name]["description"] == prop["description"]
            assert schema["parameters"]["properties"][name].get("enum") == prop.get("enum")
        # hidden arguments (task, world, state) never reach the schema the model sees
        assert not set(schema["parameters"]["properties"]) & {"task", "world", "state", "self"}


def test_reset_plays_the_rows_case_and_reward_is_the_twins():
    env = trl_environment("Returns")()
    row = trl_rows("Returns", split="test", indices=[0])[0]
    assert env.reset(**row) is None
    order = json.loads(env.lookup_order(order_id="R-10273"))
    assert order["order_id"] == "R-10273"
    assert "decision" in env.decide(order_id="R-10273", decision="refund", amount=72.0, reason="ok")
    traj = env.trajectory
    assert traj.terminated and (traj.split, traj.index) == ("test", 0)
    assert env.get_reward() == traj.reward == _expected_reward(env.twin, traj, env.episode.env.case)
    # the hidden argument `task` was injected: deciding on another order is refused by the tool
    env.reset(split="test", index=0)
    assert "another order" in env.decide(order_id="R-1", decision="deny", amount=0.0, reason="no")
    assert not env.trajectory.terminated


def test_grpo_trainer_two_steps_logs_the_twins_reward(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    from trainer.models import load_model

    twin = make_twin("Returns", max_turns=3)
    base = trl_environment(twin)
    episodes = []

    class ReturnsEnv(base):  # records every scored episode, as TRL scores it
        def get_reward(self) -> float:
            reward = super().get_reward()
            episodes.append((self.trajectory.model_copy(deep=True), self.episode.env.case, reward))
            return reward

    model, tokenizer = load_model("tiny", "float32", device="cpu")
    # the tiny model's template is ChatML with Qwen-style <tool_call> blocks: TRL's Qwen parser reads it
    from trl import chat_template_utils as ctu

    if getattr(ctu, "_SUPPORTS_RESPONSE_TEMPLATE", False):
        tokenizer.response_template = ctu.qwen3_template
    else:
        tokenizer.response_schema = ctu.qwen3_schema
    for p in model.parameters():
        p.requires_grad_(True)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, seed=0, max_steps=2,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=12,
        max_tool_calling_iterations=2, learning_rate=1e-3, beta=0.0, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, use_vllm=False, shuffle_dataset=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, args=args, train_dataset=trl_dataset(twin, split="train", n=8),
        processing_class=tokenizer, environment_factory=ReturnsEnv,
    )  # fmt: skip
    trainer.train()

    logs = [r for r in trainer.state.log_history if "rewards/ReturnsEnv/mean" in r]
    assert len(logs) == 2 and len(episodes) == 8
    for step, log in enumerate(logs):
        batch = episodes[4 * step : 4 * step + 4]
        assert log["rewards/ReturnsEnv/mean"] == pytest.approx(sum(r for *_, r in batch) / 4)
        assert log["reward"] == pytest.approx(log["rewards/ReturnsEnv/mean"])
    seen = set()
    for traj, case, reward in episodes:
        assert reward == _expected_reward(twin, traj, case)  # the twin's reward of the same episode
        seen.add((traj.split, traj.index))
    assert seen <= {("train", i) for i in range(8)} and len(seen) >= 2
