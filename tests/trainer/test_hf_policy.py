"""`hf:` policies: a local model acting in a twin through the trainer's renderer and sampler."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from trainer.hf_policy import HFPolicy, parse_hf_spec
from twin.errors import ConfigError
from twin.registry import make_twin
from twin.rollout import run_episodes

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    }
]
OPENING = [
    {"role": "system", "content": "You are a helpful assistant. Use the tools."},
    {"role": "user", "content": "Say the word red."},
]


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return HFPolicy.from_spec("hf:tiny,max_new_tokens=12,temperature=1.0,seed=3")


def test_spec_options_are_typed_and_checked() -> None:
    assert parse_hf_spec("hf:smollm2") == ("smollm2", {})
    model, options = parse_hf_spec("hf:/m/x,temperature=0.2,max_new_tokens=64,adapter=/a")
    assert model == "/m/x" and options == {
        "temperature": 0.2,
        "max_new_tokens": 64,
        "adapter": "/a",
    }
    with pytest.raises(ConfigError, match="temperature"):
        parse_hf_spec("hf:tiny,temprature=0.2")
    with pytest.raises(ConfigError, match="int"):
        parse_hf_spec("hf:tiny,max_new_tokens=lots")
    with pytest.raises(ConfigError, match="hf:smollm2"):
        parse_hf_spec("openai:gpt")


def test_act_returns_an_assistant_message_from_the_sampled_tokens(policy: HFPolicy) -> None:
    actor = policy.for_episode("case#0")
    message = asyncio.run(actor.act(OPENING, TOOLS))
    assert message["role"] == "assistant"
    (turn,) = actor.token_turns
    assert 1 <= len(turn.completion_ids) <= 12
    assert len(turn.logprobs) == len(turn.completion_ids)
    # The message is the decoded sample (minus the end-of-turn token).
    body = [t for t in turn.completion_ids if t != policy.tokenizer.eos_token_id]
    text = policy.tokenizer.decode(body, skip_special_tokens=False)
    shown = message.get("content", "")
    assert shown == text or message.get("tool_calls")
    # The sampler's logprobs are the model's at T=1 on the exact sequence it continued.
    prompt = policy.renderer(TOOLS).start(OPENING)
    ids = torch.tensor([prompt + turn.completion_ids])
    with torch.no_grad():
        lps = torch.log_softmax(policy.model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    expected = lps.gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0].tolist()
    assert turn.logprobs == pytest.approx(expected, abs=1e-4)


def test_later_turns_extend_the_same_token_sequence(policy: HFPolicy) -> None:
    actor = policy.for_episode("case#1")
    first = asyncio.run(actor.act(OPENING, TOOLS))
    conversation = [
        *OPENING,
        first,
        {"role": "user", "content": "Your last turn had no tool call. Call submit."},
    ]
    asyncio.run(actor.act(conversation, TOOLS))
    turns = actor.token_turns
    assert len(turns) == 2
    # One sequence: the opening prompt, the first sample exactly as sampled, the new messages'
    # ids, the second sample. Nothing earlier was re-tokenized.
    episode = actor._renderer.episode()
    prompt = policy.renderer(TOOLS).start(OPENING)
    assert episode.input_ids[: episode.prompt_len] == prompt
    (a, b), (c, d) = episode.turn_spans
    assert a == len(prompt)
    assert episode.input_ids[a:b] == turns[0].completion_ids
    assert episode.input_ids[b:c] == turns[1].prompt_ids
    assert episode.input_ids[c:d] == turns[1].completion_ids
    assert episode.loss_mask == [0] * a + [1] * (b - a) + [0] * (c - b) + [1] * (d - c)


def test_concurrent_episodes_are_sampled_in_one_batch(policy: HFPolicy) -> None:
    before = policy._batches

    async def many() -> list[dict]:
        actors = [policy.for_episode(f"case#{i}") for i in range(5)]
        return await asyncio.gather(*(a.act(OPENING, TOOLS) for a in actors))

    messages = asyncio.run(many())
    assert len(messages) == 5
    assert policy._batches - before == 1


def test_a_parsed_tool_call_becomes_tool_calls(policy: HFPolicy) -> None:
    """Force the sample to be a well-formed call: the message carries parsed tool_calls."""
    text = '<tool_call>\n{"name": "submit", "arguments": {"answer": "red"}}\n</tool_call>'
    ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.tokenizer.eos_token_id]

    class Fixed:
        def sample(self, prompts, **kwargs):
            from trainer.samplers import Sample

            return [Sample(list(ids), [0.0] * len(ids), "stop") for _ in prompts]

    fixed = HFPolicy(policy.model, policy.tokenizer, name="fixed")
    fixed.sampler = Fixed()
    message = asyncio.run(fixed.act(OPENING, TOOLS))
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "submit"
    assert json.loads(call["function"]["arguments"]) == {"answer": "red"}


def test_runs_episodes_in_a_twin(policy: HFPolicy) -> None:
    toy = make_twin("toy")
    groups = run_episodes(toy, policy, [("test", 0), ("test", 1)], progress=False)
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 2
    assert all("error" not in t.info for t in trajectories), [t.info for t in trajectories]
    assert all(t.reward is not None and t.policy.startswith("hf:tiny") for t in trajectories)


def test_later_turns_reuse_the_cache_and_keep_exact_logprobs(policy: HFPolicy) -> None:
    """Turn 2 prefills only its new messages; its logprobs are still the model's on the whole
    episode."""
    store = policy.sampler.store
    assert store is not None, "hf: policies cache keys/values by default"
    actor = policy.for_episode("case#cache")
    first = asyncio.run(actor.act(OPENING, TOOLS))
    misses = store.misses
    conversation = [*OPENING, first, {"role": "user", "content": "No tool call. Call submit."}]
    asyncio.run(actor.act(conversation, TOOLS))
    episode = actor._renderer.episode()
    (_, b), (c, d) = episode.turn_spans
    # new: the last sampled id of turn 1 (sampled, never fed) and the tokens after it
    assert store.misses - misses == c - b + 1
    ids = torch.tensor([episode.input_ids])
    with torch.no_grad():
        lps = torch.log_softmax(policy.model(ids).logits[0, c - 1 : d - 1].float(), -1)
    expected = lps.gather(1, ids[0, c:d, None])[:, 0].tolist()
    assert actor.token_turns[1].logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_and_uncached_specs(policy: HFPolicy) -> None:
    greedy = HFPolicy(policy.model, policy.tokenizer, temperature=0.0, max_new_tokens=6)
    a = asyncio.run(greedy.for_episode("x#0").act(OPENING, TOOLS))
    b = asyncio.run(greedy.for_episode("y#0").act(OPENING, TOOLS))
    assert a == b  # greedy: the seed does not matter
    uncached = HFPolicy.from_spec("hf:tiny,prefix_cache=0,max_new_tokens=4")
    assert uncached.sampler.store is None
    assert asyncio.run(uncached.act(OPENING, TOOLS))["role"] == "assistant"
    # greedy without the cache: the same engine, the same message as with it
    greedy_uncached = HFPolicy(
        policy.model, policy.tokenizer, temperature=0.0, max_new_tokens=6, prefix_cache=False
    )
    assert asyncio.run(greedy_uncached.for_episode("z#0").act(OPENING, TOOLS)) == a
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        HFPolicy(policy.model, policy.tokenizer, temperature=-0.5)


def test_an_autocast_spec_stores_linear_weights_in_bf16_and_samples_the_same() -> None:
    """Rounding the linear weights once gives the numbers autocast gives by rounding them on
    every call: the same ids and the same logprobs, greedy and sampled."""
    loaded = HFPolicy.from_spec("hf:tiny")  # fp32 weights, autocast rounds them per call
    cast = HFPolicy.from_spec("hf:tiny,autocast=bfloat16")
    linears = [m for m in cast.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    embedding = cast.model.get_input_embeddings().weight
    assert embedding.dtype == torch.float32  # a tied head got its own copy: the table is as loaded
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    prompts = [
        policy_ids(loaded, OPENING),
        policy_ids(loaded, [*OPENING, {"role": "user", "content": "Now call submit."}]),
    ]
    for temperature in (0.0, 1.0):
        options = {"temperature": temperature, "max_new_tokens": 10, "autocast": "bfloat16"}
        ref = HFPolicy(loaded.model, loaded.tokenizer, **options).sample_batch(prompts, [1, 2])
        got = HFPolicy(cast.model, cast.tokenizer, **options).sample_batch(prompts, [1, 2])
        assert [s.ids for s in got] == [s.ids for s in ref]
        assert [s.logprobs for s in got] == [s.logprobs for s in ref]
    with pytest.raises(ConfigError, match="model.autocast 'int8'"):  # checked before any cast
        HFPolicy.from_spec("hf:tiny,autocast=int8")


def policy_ids(policy: HFPolicy, messages: list[dict]) -> list[int]:
    renderer = policy.renderer(TOOLS)
    renderer.start(messages)
    return list(renderer.ids)
