"""A twin inside TRL: ``GRPOTrainer(environment_factory=...)`` trains on the Returns twin (CPU,
tiny model)."""

from __future__ import annotations

import json

import pytest
from transformers.utils import get_json_schema

from integrations.trl import (
    prepare_tokenizer,
    trl_dataset,
    trl_environment,
    trl_reward_funcs,
    trl_rows,
)
from twin.evaluation import evaluate
from twin.policies import ReplayPolicy
from twin.registry import make_twin

pytest.importorskip("trl", reason="TRL is not installed: pip install 'twinrl[trl]'")


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
    tokenizer = prepare_tokenizer(tokenizer)  # a ChatML template TRL does not know by name
    reward_funcs, weights = trl_reward_funcs(twin)
    term_names = [f.__name__ for f in reward_funcs]  # TRL appends get_reward to the list
    for p in model.parameters():
        p.requires_grad_(True)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        max_tool_calling_iterations=2,
        learning_rate=1e-3,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=False,
        shuffle_dataset=False,
        reward_weights=weights,
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=trl_dataset(twin, split="train", n=8),
        processing_class=tokenizer,
        environment_factory=ReturnsEnv,
        reward_funcs=reward_funcs,
    )
    trainer.train()

    logs = [r for r in trainer.state.log_history if "rewards/ReturnsEnv/mean" in r]
    assert len(logs) == 2 and len(episodes) == 8
    for step, log in enumerate(logs):
        batch = episodes[4 * step : 4 * step + 4]
        assert log["rewards/ReturnsEnv/mean"] == pytest.approx(sum(r for *_, r in batch) / 4)
        assert log["reward"] == pytest.approx(log["rewards/ReturnsEnv/mean"])  # terms weigh 0
        terms = sum(log[f"rewards/{name}/mean"] for name in term_names)
        assert terms == pytest.approx(log["rewards/ReturnsEnv/mean"])  # one column per term
    seen = set()
    for traj, case, reward in episodes:
        assert reward == _expected_reward(twin, traj, case)  # the twin's reward of the same episode
        seen.add((traj.split, traj.index))
    assert seen <= {("train", i) for i in range(8)} and len(seen) >= 2


def test_term_functions_hold_each_terms_share_of_the_reward():
    twin = make_twin("Returns")
    funcs, weights = trl_reward_funcs(twin)
    assert weights == [0.0] * len(funcs) and {"correct_decision", "invalid_calls"} <= {
        f.__name__ for f in funcs
    }
    env = trl_environment(twin)()
    env.reset(**trl_rows(twin, split="test", indices=[0])[0])
    env.lookup_order(order_id="R-10273")
    env.decide(order_id="R-10273", decision="refund", amount=72.0, reason="ok")
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "decide"}}]}
    ]
    values = [f(completions=[completion], environments=[env, object()]) for f in funcs]
    assert all(v[1] is None for v in values)  # not an environment of this twin
    assert sum(v[0] for v in values) == pytest.approx(env.get_reward())


def test_a_rollout_ending_in_text_scores_as_twin_eval_scores_that_turn():
    """TRL ends a rollout at a turn without a call and never tells the environment; the term
    functions hand it that turn, so the episode is the one twin eval plays (was 0.0 vs -0.02)."""
    twin = make_twin("Returns", max_turns=1)
    text = "A refund seems right to me."
    env = trl_environment(twin)()
    env.reset(**trl_rows(twin, split="test", indices=[3])[0])
    funcs, _ = trl_reward_funcs(twin)
    for f in funcs:  # TRL calls the reward functions before the environment's get_reward
        f(completions=[[{"role": "assistant", "content": text}]], environments=[env])
    evaluated = evaluate(twin, ReplayPolicy([text]), [("test", 3)], progress=False)
    (episode,) = evaluated.groups[0].trajectories
    assert env.get_reward() == pytest.approx(episode.reward) and episode.reward < 0
    assert env.trajectory.invalid_calls == episode.invalid_calls == 1


def test_prepare_tokenizer_sets_a_tool_call_parser_trl_would_not():
    from trl import chat_template_utils as ctu

    from trainer.models import load_model

    _model, tokenizer = load_model("tiny", "float32", device="cpu")
    tokenizer.response_template = tokenizer.response_schema = None
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        ctu.add_response_schema(tokenizer)
    prepare_tokenizer(tokenizer)
    assert tokenizer.response_template or tokenizer.response_schema
    tokenizer.response_template = tokenizer.response_schema = None
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="response_template"):
        prepare_tokenizer(tokenizer)
