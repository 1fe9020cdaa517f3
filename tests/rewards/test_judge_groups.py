"""RULER-style group terms inside a twin's reward: deferred at an episode's end, scored with the
group by the trainer's collection and by ``twin eval``-style evaluation."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest

from rewards import Reward
from rewards._terms import TermError
from rewards.judge import JudgeAnswer
from rewards.judge_terms import group_term
from twin.env import TwinEnv
from twin.evaluation import evaluate
from twin.policies import make_policy
from twin.registry import make_twin

_ATTEMPT = re.compile(
    r"=== Attempt ([A-Z]) ===\n(.*?)(?=\n\n=== Attempt|\n\nScore every)", re.DOTALL
)


def _score_of(body: str) -> int:
    """The fake judge's preference: a fixed function of what it reads (ties possible)."""
    return int(hashlib.sha256(body.encode()).hexdigest(), 16) % 11


class RankingJudge:
    """A stand-in judge: scores each attempt of a group request with :func:`_score_of`."""

    spec = "fake-ranker"

    def __init__(self) -> None:
        self.steps = 0
        self.requests = 0

    def new_step(self) -> None:
        self.steps += 1

    def ask_many(self, requests: Any, parse: Any = None) -> list[JudgeAnswer]:
        out = []
        for messages in requests:
            self.requests += 1
            text = messages[-1]["content"]
            scores = {lab: _score_of(body) for lab, body in _ATTEMPT.findall(text)}
            key = hashlib.sha256(text.encode()).hexdigest()
            out.append(
                JudgeAnswer(
                    key=key,
                    prompt_key=key,
                    text=json.dumps({"scores": scores}),
                    cached=False,
                    judge=self.spec,
                )
            )
        return out


def _toy_with_group_term(judge: RankingJudge, **config: Any) -> Any:
    twin = make_twin("Toy", **config)
    twin.reward = Reward({group_term("ranked", judge, "Which attempt is best?"): 1.0})
    return twin


def _assert_ranked_by_the_judge(trajectories: list[Any]) -> bool:
    """Every episode is group-scored, and its reward orders as the judge's scores do; True when
    the judge told at least two episodes apart (so the check had something to compare)."""
    scores = []
    for t in trajectories:
        assert "deferred" not in t.info
        record = t.info["judge"]["ranked"]
        scores.append(record["scores"][record["label"]])
        assert t.components["ranked"] == t.reward
        assert not any("deferred" in n for n in t.reward_notes)
    for a, sa in zip(trajectories, scores):
        for b, sb in zip(trajectories, scores):
            if sa > sb:
                assert a.reward > b.reward
            elif sa == sb:
                assert a.reward == b.reward
    return len(set(scores)) > 1


def test_an_episode_end_defers_the_group_term_and_a_lone_call_still_refuses() -> None:
    judge = RankingJudge()
    twin = _toy_with_group_term(judge, max_turns=1)
    env = TwinEnv(twin)
    env.reset(options={"split": "train", "index": 0})
    _, reward, _, _, info = env.step("no call at all")
    assert reward == 0.0 and info["reward"]["components"]["ranked"] == 0.0
    assert info["trajectory"].info["deferred"]["terms"] == ["ranked"]
    assert any("deferred until the episode's group is scored" in n for n in info["reward"]["notes"])
    assert judge.requests == 0
    with pytest.raises(TermError, match="against its group"):
        twin.score(info["trajectory"], env.case)


def test_collect_groups_scores_each_group_with_the_judge_once_per_step() -> None:
    torch = pytest.importorskip("torch")
    from trainer.episodes import RolloutSettings, collect_groups
    from trainer.models import load_model
    from trainer.renderer import Renderer
    from trainer.samplers import HFSampler

    torch.set_num_threads(1)
    model, tok = load_model("tiny")
    judge = RankingJudge()
    twin = _toy_with_group_term(judge, max_turns=1)
    settings = RolloutSettings(max_new_tokens=12, max_episode_tokens=600)
    groups = collect_groups(
        twin,
        [("train", 0), ("train", 1)],
        HFSampler(model, tok),
        lambda tools: Renderer(tok, tools),
        group_size=4,
        settings=settings,
        seed=0,
    )
    assert judge.steps == 1 and judge.requests == 2  # one budget step, one request per group
    told_apart = [_assert_ranked_by_the_judge(g.trajectories) for g in groups]
    assert any(told_apart)
    collect_groups(
        twin,
        [("train", 2)],
        HFSampler(model, tok),
        lambda tools: Renderer(tok, tools),
        group_size=2,
        settings=settings,
        seed=1,
        new_judge_step=False,
    )
    assert judge.steps == 1 and judge.requests == 3  # a refill round stays in its step


def test_grouped_evaluation_scores_each_group_with_its_judge(tmp_path) -> None:
    from twin.store import RunStore

    judge = RankingJudge()
    twin = _toy_with_group_term(judge)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    result = evaluate(
        twin,
        make_policy("random", twin),
        [("test", i) for i in range(3)],
        group_size=4,
        store=store,
        progress=False,
    )
    assert judge.requests == 3 and result.summary["errors"] == 0
    told_apart = [_assert_ranked_by_the_judge(g.trajectories) for g in result.groups]
    assert any(told_apart)
    stored = store.episodes(result.run_id)  # the store keeps the group-scored episodes
    assert sorted(t.reward for t in stored) == sorted(
        t.reward for g in result.groups for t in g.trajectories
    )
    assert all("deferred" not in t.info and "ranked" in t.info["judge"] for t in stored)


def test_a_failing_group_judge_marks_its_episodes_failed_in_evaluation() -> None:
    class Broken(RankingJudge):
        def ask_many(self, requests: Any, parse: Any = None) -> list[JudgeAnswer]:
            raise RuntimeError("judge server down")

    twin = _toy_with_group_term(Broken())
    result = evaluate(
        twin, make_policy("random", twin), [("test", 0)], group_size=2, progress=False
    )
    assert result.summary["errors"] == 2
    for t in result.groups[0].trajectories:
        assert t.reward is None and t.info["error"] == "RuntimeError: judge server down"


def test_a_grpo_step_trains_on_the_group_scored_rewards(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from trainer.config import load_recipe
    from trainer.episodes import rollout_settings, sample_step
    from trainer.renderer import Renderer
    from trainer.runtime import build_learner, learn_from_groups, make_batch
    from trainer.samplers import HFSampler

    cfg = load_recipe(
        "toy-cpu",
        [
            f"train.output_dir={tmp_path}",
            "algorithm.group_size=4",
            "algorithm.groups_per_step=2",
            "algorithm.dynamic_sampling=false",
            "sampler.max_new_tokens=12",
        ],
    )
    learner, tok = build_learner(cfg, "tiny", temperature=cfg.sampler.temperature)
    judge = RankingJudge()
    twin = _toy_with_group_term(judge, max_turns=1)
    step = sample_step(
        cfg,
        twin,
        lambda n: [("train", i) for i in range(n)],
        HFSampler(learner.model, tok),
        lambda tools: Renderer(tok, tools),
        rollout_settings(cfg),
        seed_key=("test",),
        policy_version=0,
    )
    assert judge.steps == 1 and judge.requests == 2
    groups = step.kept_groups
    assert any(_assert_ranked_by_the_judge(g.trajectories) for g in groups)
    for g in groups:  # the shaped rewards the advantages use are the group-scored ones
        assert [t.info["shaped_reward"] for t in g.trajectories] == pytest.approx(
            [t.reward for t in g.trajectories]
        )
    batch = make_batch(groups, cfg.algorithm.advantage)
    rows = [t for g in groups for t in g.trajectories if t.token_turns]
    for a, ta in zip(batch.advantages, rows):
        for b, tb in zip(batch.advantages, rows):
            if ta.case_id == tb.case_id and ta.reward > tb.reward:
                assert a > b  # the judge's preferred attempt is pushed up within its group
    before = [p.detach().clone() for p in learner.model.parameters() if p.requires_grad]
    update = learn_from_groups(
        learner, groups, step.groups, advantage=cfg.algorithm.advantage, step=0
    )
    after = [p for p in learner.model.parameters() if p.requires_grad]
    assert update.learn and any(
        not torch.equal(x, y) for x, y in zip(before, after)
    )  # one GRPO update
