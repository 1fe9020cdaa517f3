"""One decode path (trainer/serving/engine.py): the sampler server, the in-process HFSampler and
``hf:`` policies sample the same tokens for the same request."""

from __future__ import annotations

import pytest
import torch

from trainer.hf_policy import HFPolicy
from trainer.models import load_model
from trainer.samplers import HFSampler
from trainer.serving.completions import CompletionServer
from trainer.serving.engine import Engine, Row


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny", "float32")


def _prompt(tok, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(ids["input_ids"])


def _three_users(
    model, tok, prompt: list[int], *, temperature: float, seed: int
) -> list[tuple[list, list]]:
    """The same request through the server, the sampler and a policy: (ids, logprobs) of each."""
    eos = tok.eos_token_id
    server = CompletionServer(model, tok, model_name="tiny")
    try:
        body = {
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": temperature,
            "seed": seed,
            "ignore_eos": True,
            "stop_token_ids": [eos],
            "logprobs": 0,
            "return_token_ids": True,
        }
        choice = server.completions(body)["choices"][0]
    finally:
        server.close()
    (sample,) = HFSampler(model, tok).sample(
        [prompt], max_new_tokens=10, temperature=temperature, stop_ids=[eos], row_seeds=[seed]
    )
    policy = HFPolicy(model, tok, temperature=temperature, max_new_tokens=10, prefix_cache=True)
    (turn,) = policy.sample_batch([prompt], seeds=[seed])
    return [
        (choice["token_ids"], choice["logprobs"]["token_logprobs"]),
        (sample.ids, sample.logprobs),
        (turn.ids, turn.logprobs),
    ]


def test_server_sampler_and_policy_give_the_same_greedy_tokens(tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Name a colour and a number.")
    (server, sampler, policy) = _three_users(model, tok, prompt, temperature=0.0, seed=0)
    assert server[0] == sampler[0] == policy[0]
    assert len(server[0]) >= 2
    assert server[1] == pytest.approx(sampler[1], abs=1e-5) and sampler[1] == pytest.approx(
        policy[1], abs=1e-5
    )
    # and greedy is the argmax of a teacher-forced pass over the same tokens
    with torch.no_grad():
        logits = model(torch.tensor([prompt + server[0]])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == server[0]


def test_a_seeded_request_samples_the_same_tokens_in_all_three(tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Say red.")
    runs = _three_users(model, tok, prompt, temperature=1.0, seed=1234)
    assert runs[0][0] == runs[1][0] == runs[2][0]
    other = _three_users(model, tok, prompt, temperature=1.0, seed=99)
    assert other[0][0] != runs[0][0]


def test_prompt_logprobs_and_shared_prefill_rows_are_the_model_s(tiny) -> None:
    """Rows with prompt logprobs take every prompt position's logits; repeated prompts keep their
    own samples after a shared prefill."""
    model, tok = tiny
    engine = Engine(model.eval(), pad_id=tok.pad_token_id or tok.eos_token_id)
    prompt = _prompt(tok, "A prompt scored token by token.")
    scored = Row(prompt=prompt, max_tokens=0, prompt_logprobs=2)
    engine.decode([scored])
    with torch.no_grad():
        lps = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    assert scored.finish_reason == "length" and scored.ids == []
    expected = lps.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert [v for v, _, _ in scored.prompt_lps] == pytest.approx(expected, abs=1e-5)
    assert all(len(top) == 2 and rank >= 1 for _, rank, top in scored.prompt_lps)
    group = [
        Row(prompt=prompt, max_tokens=6, generator=torch.Generator().manual_seed(i))
        for i in range(4)
    ]
    engine.decode(group)
    assert len({tuple(r.ids) for r in group}) > 1  # one prefill, four samples
    alone = Row(prompt=prompt, max_tokens=6, generator=torch.Generator().manual_seed(2))
    engine.decode([alone])
    assert alone.ids == group[2].ids


def test_eager_and_sdpa_attention_sample_the_same(tiny) -> None:
    """The engine's mask is boolean for SDPA and additive for eager attention: the same tokens,
    with left padding and a row whose padding queries see nothing else."""
    from transformers import AutoModelForCausalLM

    from trainer.tiny import build_tiny

    _, tok = tiny
    runs = []
    for attention in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(
            build_tiny(), dtype=torch.float32, attn_implementation=attention
        )
        engine = Engine(model.eval(), pad_id=tok.pad_token_id or tok.eos_token_id)
        rows = [
            Row(prompt=p, max_tokens=6, temperature=0.0)
            for p in (_prompt(tok, "A longer prompt here."), [5, 6])
        ]
        engine.decode(rows)
        assert not any(torch.isnan(torch.tensor(r.token_logprobs)).any() for r in rows)
        runs.append([(r.ids, r.token_logprobs) for r in rows])
    for (ids_a, lps_a), (ids_b, lps_b) in zip(*runs, strict=True):
        assert ids_a == ids_b and lps_a == pytest.approx(lps_b, abs=1e-5)
