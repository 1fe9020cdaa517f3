"""Rollout-side sharing within a GRPO group: one prefill per distinct prompt, one prompt render.

Both are pure speed-ups: the samples, logprobs and token records must be those of the unshared
path.
"""

from __future__ import annotations

import functools

import pytest
import torch

from trainer.episodes import RolloutSettings, collect_groups, episode_tokens
from trainer.models import load_model
from trainer.renderer import Renderer
from trainer.samplers import HFSampler
from twin.registry import make_twin


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts: list[list[int]] = []
    for k in range(3):
        prompt = torch.randint(5, 700, (40 + 5 * k,), generator=g).tolist()
        prompts += [prompt] * 4  # a group repeats its prompt
    return prompts + [list(range(5, 25))]  # and a prompt of its own, shorter (left padding)


def test_shared_prefill_samples_what_the_unshared_path_samples(tiny, monkeypatch) -> None:
    model, tok = tiny
    prompts = _prompts()
    calls: list[int] = []
    forward = type(model).forward

    @functools.wraps(forward)
    def counting(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0])
        return forward(self, *args, **kwargs)

    runs = {}
    for share in (False, True):
        sampler = HFSampler(model, tok)
        sampler.share_prefill = share
        calls.clear()
        monkeypatch.setattr(type(model), "forward", counting)
        runs[share] = sampler.sample(prompts, max_new_tokens=6, temperature=1.0, seed=11)
        monkeypatch.setattr(type(model), "forward", forward)
        if share:  # the prefill: one row per distinct prompt, then every row decodes
            assert calls[0] == 4 and calls[1] == len(prompts)
        else:
            assert calls[0] == len(prompts)
    for a, b in zip(runs[False], runs[True]):
        assert a.ids == b.ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # and the logprobs are the model's: teacher-forced check of one row
    row, prompt = runs[True][0], prompts[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + row.ids])).logits[0, :-1].float(), -1)
    want = logp[len(prompt) - 1 :].gather(-1, torch.tensor(row.ids)[:, None])[:, 0]
    assert torch.allclose(want, torch.tensor(row.logprobs), atol=1e-5)


def test_distinct_prompts_prefill_every_row(tiny, monkeypatch) -> None:
    model, tok = tiny
    rows: list[int] = []
    forward = type(model).forward

    @functools.wraps(forward)
    def counting(self, *args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    HFSampler(model, tok).sample([[1, 2, 3], [4, 5, 6]], max_new_tokens=2, seed=0)
    assert rows[0] == 2  # nothing shared: no separate prefill


def test_group_episodes_fork_one_rendered_prompt(tiny) -> None:
    model, tok = tiny
    twin = make_twin("Toy", max_turns=2)
    starts: list[int] = []

    class CountingRenderer(Renderer):
        def start(self, messages):  # type: ignore[no-untyped-def]
            starts.append(1)
            return super().start(messages)

    class NoFork(CountingRenderer):
        fork = property()  # hasattr(renderer, "fork") is False: every episode renders its prompt

        def __getattribute__(self, name):  # type: ignore[no-untyped-def]
            if name == "fork":
                raise AttributeError(name)
            return super().__getattribute__(name)

    records = {}
    for cls in (NoFork, CountingRenderer):
        starts.clear()
        groups = collect_groups(
            twin,
            [("train", 0), ("train", 1)],
            HFSampler(model, tok),
            lambda tools, c=cls: c(tok, tools),
            group_size=3,
            settings=RolloutSettings(max_new_tokens=8, max_episode_tokens=600),
            seed=0,
        )
        records[cls] = (len(starts), [episode_tokens(t) for g in groups for t in g.trajectories],
                        [t.messages for g in groups for t in g.trajectories])  # fmt: skip
    assert records[NoFork][0] == 6 and records[CountingRenderer][0] == 2
    assert records[NoFork][1] == records[CountingRenderer][1]
    assert records[NoFork][2] == records[CountingRenderer][2]


def test_fork_is_independent(tiny) -> None:
    _, tok = tiny
    twin = make_twin("Toy")
    a = Renderer(tok, twin.tool_schemas)
    a.start(twin.prompt(twin.case("train", 0)))
    b = a.fork()
    a.add_completion([5, 6, tok.eos_token_id], [-1.0, -1.0, -1.0])
    assert len(b.ids) == len(a.ids) - 3 and len(b.messages) == len(a.messages) - 1
    assert b.token_turns() != a.token_turns()
