"""Rollouts: real TwinEnv episodes, token-exact records, batched sampler calls, budgets."""

from __future__ import annotations

import pytest
import torch

from envs.toy.twin import ideal_call
from trainer.episodes import RolloutSettings, collect_groups, episode_tokens
from trainer.models import load_model
from trainer.renderer import Renderer
from trainer.samplers import HFSampler, Sample
from twin.registry import make_twin


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


class ScriptedSampler:
    """Answers each prompt with the ids of a fixed text (then eos); counts calls."""

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok, self.texts, self.calls = tok, texts, []

    def sample(
        self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=None, seed=None
    ):
        self.calls.append(len(prompts))
        out = []
        for _ in prompts:
            text = self.texts[(len(self.calls) - 1) % len(self.texts)]
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            ids = ids[:max_new_tokens]
            out.append(Sample(ids, [-1.0] * len(ids), "stop"))
        return out


def test_groups_are_scored_and_token_exact(tiny) -> None:
    model, tok = tiny
    twin = make_twin("Toy", max_turns=2)
    groups = collect_groups(
        twin,
        [("train", 0), ("train", 1)],
        HFSampler(model, tok),
        lambda tools: Renderer(tok, tools),
        group_size=3,
        settings=RolloutSettings(max_new_tokens=8, max_episode_tokens=600),
        seed=0,
    )
    assert [g.case_id for g in groups] == ["Toy/train/0", "Toy/train/1"]
    for g in groups:
        assert len(g.trajectories) == 3
        for t in g.trajectories:
            assert t.reward is not None and t.token_turns
            ids, mask, lps = episode_tokens(t)
            assert len(ids) == len(mask) == len(lps) == t.info["episode_tokens"]
            assert (
                sum(mask)
                == t.completion_tokens
                == sum(len(x.completion_ids) for x in t.token_turns)
            )
            assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
            assert all(lp < 0.0 for lp, m in zip(lps, mask) if m)
            # the first assistant turn in the chat is exactly the decoded sampled ids (minus eos)
            first = t.token_turns[0].completion_ids
            body = first[:-1] if first and first[-1] == tok.eos_token_id else first
            assert t.messages[2]["content"] == tok.decode(body, skip_special_tokens=False)


def test_multi_turn_loss_mask_excludes_tool_results(tiny) -> None:
    _, tok = tiny
    twin = make_twin("Toy", max_turns=3)
    wrong = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    case = twin.case("train", 0)
    sampler = ScriptedSampler(tok, [wrong, ideal_call(case.truth["answer"])])
    (group,) = collect_groups(
        twin,
        [("train", 0)],
        sampler,
        lambda tools: Renderer(tok, tools),
        group_size=2,
        settings=RolloutSettings(max_new_tokens=64, max_episode_tokens=2000),
        seed=0,
    )
    assert sampler.calls == [2, 2], "both episodes' turns go to the sampler together"
    for t in group.trajectories:
        assert t.num_turns == 2 and t.terminated and t.reward == pytest.approx(1.0 - 0.5, abs=0.5)
        ids, mask, _ = episode_tokens(t)
        text_masked = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
        text_sampled = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert "unknown tool" in text_masked and "unknown tool" not in text_sampled
        assert "lookup" in text_sampled and "submit" in text_sampled
        assert t.calls[0].ok is False and t.calls[1].ok is True


def test_episode_token_budget_cuts_and_scores(tiny) -> None:
    _, tok = tiny
    twin = make_twin("Toy", max_turns=5)
    sampler = ScriptedSampler(tok, ["no call here at all"])
    (group,) = collect_groups(
        twin,
        [("train", 0)],
        sampler,
        lambda tools: Renderer(tok, tools),
        group_size=1,
        settings=RolloutSettings(max_new_tokens=64, max_episode_tokens=330),
        seed=0,
    )
    (t,) = group.trajectories
    assert t.info["overlong"] and t.truncated and t.reward is not None
    assert t.num_turns < 5, "the token budget, not the turn budget, ended the episode"
    # No turn starts past the budget: only the last turn (its sample plus the reply it got) may
    # cross it.
    last = t.token_turns[-1]
    before_last = t.info["episode_tokens"] - len(last.completion_ids) - len(last.prompt_ids)
    assert before_last < 330 <= t.info["episode_tokens"]


def test_episode_tokens_requires_token_turns() -> None:
    from twin.trajectory import Trajectory

    with pytest.raises(ValueError, match="token_turns"):
        episode_tokens(Trajectory(twin="Toy", case_id="Toy/train/0"))


# ------------------------------------------------------------------ per-request token budgets
CONTEXT = 374  # the case: a 358-token episode, max_new_tokens 64, a 374-token context


def _vllm_like(tok, seen: list[tuple[int, int]]):
    """A /v1/completions handler that, like vLLM, answers HTTP 400 when prompt + max_tokens
    exceeds the context. First turn: the "green" episode writes 60 tokens, the other one 1;
    later turns write max_tokens tokens without stopping."""
    import httpx

    filler = tok.encode("a", add_special_tokens=False)[0]
    green = tok.encode("green", add_special_tokens=False)[0]

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        choices = []
        for k, prompt in enumerate(body["prompt"]):
            seen.append((len(prompt), body["max_tokens"]))
            if len(prompt) + body["max_tokens"] > CONTEXT:
                return httpx.Response(
                    400,
                    json={
                        "error": {
                            "message": (
                                f"This model's maximum context length is {CONTEXT} tokens. "
                                f"However, you requested {len(prompt) + body['max_tokens']} tokens"
                            )
                        }
                    },
                )
            if len(prompt) == FIRST_PROMPT:
                ids = [filler] * (60 if green in prompt else 1) + [tok.eos_token_id]
            else:
                ids = [filler] * body["max_tokens"]
            choices.append(
                {
                    "index": k,
                    "token_ids": ids,
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-1.0] * len(ids)},
                }
            )
        return httpx.Response(200, json={"model": body["model"], "choices": choices})

    return handler


FIRST_PROMPT = 211  # the toy twin's opening on the tiny tokenizer (asserted in the test)


@pytest.mark.parametrize("client", ["server", "async-worker"])
def test_no_request_asks_for_more_than_the_context_left(tiny, client: str) -> None:
    import httpx

    from trainer.samplers import ServerSampler
    from trainer.workers import ModelCheckTransport, _batched_sampler

    _, tok = tiny
    seen: list[tuple[int, int]] = []
    mock = httpx.MockTransport(_vllm_like(tok, seen))
    if client == "server":
        sampler = ServerSampler("http://vllm:8000", "policy@0", transport=mock)
    else:  # the async trainer's rollout worker (one batched request per call to `twin serve`)
        sampler = _batched_sampler("http://serve:8000")
        sampler.transport = ModelCheckTransport(mock)
    twin = make_twin("Toy", max_turns=5)
    groups = collect_groups(
        twin,
        [("train", 0), ("train", 2)],
        sampler,
        lambda tools: Renderer(tok, tools),
        group_size=1,
        settings=RolloutSettings(max_new_tokens=64, max_episode_tokens=CONTEXT),
        seed=0,
    )
    assert seen[0][0] == FIRST_PROMPT
    # the second turn: the green episode holds 211 + 61 + 86 = 358 tokens, the other 299
    assert (358, CONTEXT - 358) in seen and (299, 64) in seen
    assert all(n + m <= CONTEXT for n, m in seen), seen
    ends = []
    for group in groups:  # both out of budget: overlong, scored, no error
        (t,) = group.trajectories
        assert t.info["overlong"] and t.truncated and t.reward is not None
        _, mask, _ = episode_tokens(t)
        ends.append(max(i for i, m in enumerate(mask) if m) + 1)  # end of the last sampled turn
    assert ends == [CONTEXT, 299 + 64]  # the green episode's last turn filled the context


def test_budget_is_the_least_of_turn_episode_and_context() -> None:
    s = RolloutSettings(max_new_tokens=64, max_episode_tokens=1000, context_length=374)
    assert s.token_limit == 374
    assert [s.budget(n) for n in (0, 310, 358, 374, 400)] == [64, 64, 16, 0, 0]
    assert RolloutSettings(max_new_tokens=64, max_episode_tokens=300).budget(250) == 50


# ------------------------------------------------------------ stop ids of the generation config
def test_a_generation_config_eos_ends_a_turn(tiny, tmp_path) -> None:
    # vLLM stops on generation_config.json's eos ids too (Qwen3: <|endoftext|> besides <|im_end|>);
    # a turn that ends on one must count as ended, not as cut off
    import json
    import shutil
    from types import SimpleNamespace

    from trainer.episodes import recipe_renderer_factory
    from trainer.models import resolve_model_path

    _, tok = tiny
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny"), folder)
    other_eos = tok.encode("a", add_special_tokens=False)[0]
    assert other_eos != tok.eos_token_id
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [tok.eos_token_id, other_eos]
    (folder / "generation_config.json").write_text(json.dumps(config))
    cfg = SimpleNamespace(
        model=SimpleNamespace(path=str(folder), chat_template=None, template_kwargs={})
    )

    asked: list[list[int]] = []

    class EndsOnTheOtherEos:
        def sample(
            self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=None, seed=None
        ):
            asked.append(sorted(stop_ids))
            ids = tok.encode("hi", add_special_tokens=False) + [other_eos]
            return [Sample(ids, [-1.0] * len(ids), "stop") for _ in prompts]

    twin = make_twin("Toy", max_turns=2)
    (group,) = collect_groups(
        twin,
        [("train", 0)],
        EndsOnTheOtherEos(),
        recipe_renderer_factory(cfg, tok),
        group_size=1,
        settings=RolloutSettings(max_new_tokens=8, max_episode_tokens=600),
        seed=0,
    )
    assert asked[0] == sorted([tok.eos_token_id, other_eos])
    (t,) = group.trajectories
    assert t.info["renderer"].get("unterminated", 0) == 0
    assert t.messages[2]["content"] == "hi"  # the stop id is not part of the message


# ------------------------------------------------------------------ episodes advance independently
def _two_speed_server(tok, log: list[tuple[str, int]]):
    """The first episode's first request is answered only once the other episode has asked for
    its second turn: episodes that advance in lockstep never get there (the request times out)."""
    import asyncio
    import json

    import httpx

    filler = tok.encode("a", add_special_tokens=False)[0]
    state: dict = {"slow": None, "event": None, "firsts": {}}

    async def handler(request: httpx.Request) -> httpx.Response:
        if state["event"] is None:
            state["event"] = asyncio.Event()
        body = json.loads(request.content)
        (prompt,) = body["prompt"]
        key = tuple(prompt[:FIRST_PROMPT])
        turn = state["firsts"].setdefault(key, 0)
        state["firsts"][key] += 1
        if state["slow"] is None:
            state["slow"] = key
        log.append(("slow" if key == state["slow"] else "fast", turn))
        if key == state["slow"] and turn == 0:
            try:
                await asyncio.wait_for(state["event"].wait(), 10)
            except asyncio.TimeoutError:
                return httpx.Response(
                    504, json={"error": "the other episode never asked for its next turn"}
                )
        elif key != state["slow"] and turn >= 1:
            state["event"].set()
        rng = body["seed"] % 5 + 1
        ids = [filler] * rng + [tok.eos_token_id]
        choice = {
            "index": 0,
            "token_ids": ids,
            "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-1.0] * len(ids)},
        }
        return httpx.Response(200, json={"model": body["model"], "choices": [choice]})

    return handler


def _collect_two(tok, log):
    import httpx

    from trainer.samplers import ServerSampler

    sampler = ServerSampler(
        "http://vllm:8000", "policy@0", transport=httpx.MockTransport(_two_speed_server(tok, log))
    )
    return collect_groups(
        make_twin("Toy", max_turns=3),
        [("train", 0), ("train", 2)],
        sampler,
        lambda tools: Renderer(tok, tools),
        group_size=1,
        settings=RolloutSettings(max_new_tokens=16, max_episode_tokens=2000),
        seed=7,
    )


def test_an_episode_asks_for_its_next_turn_without_waiting_for_the_others(tiny) -> None:
    _, tok = tiny
    log: list[tuple[str, int]] = []
    groups = _collect_two(tok, log)
    # the fast episode took its second turn while the slow one's first was still out
    assert log.index(("fast", 1)) < len(log) and ("slow", 1) in log
    assert log.index(("fast", 1)) < log.index(("slow", 1))
    for g in groups:
        (t,) = g.trajectories
        assert len(t.token_turns) == 3 and t.reward is not None
    # the samples do not depend on the order answers arrived in: seeds are per episode and turn
    again = _collect_two(tok, [])
    assert [[x.completion_ids for x in g.trajectories[0].token_turns] for g in groups] == [
        [x.completion_ids for x in g.trajectories[0].token_turns] for g in again
    ]
