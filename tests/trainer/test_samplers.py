"""Samplers: HFSampler logprobs equal a teacher-forced forward pass; seeds; ServerSampler over
MockTransport."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from trainer.models import load_model
from trainer.samplers import HFSampler, Sample, Sampler, SamplerError, ServerSampler
from twin.errors import ConfigError


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _prompt(tok, text: str) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_logprobs_match_teacher_forcing(tiny, temperature: float) -> None:
    model, tok = tiny
    prompts = [_prompt(tok, "Say red."), _prompt(tok, "The word is a dog, a long prompt here.")]
    samples = HFSampler(model, tok).sample(
        prompts, max_new_tokens=12, temperature=temperature, seed=3
    )
    assert len(samples) == 2
    for prompt, s in zip(prompts, samples):
        assert len(s.ids) == len(s.logprobs) > 0
        ids = torch.tensor([prompt + s.ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, -1).gather(
            -1, torch.tensor(s.ids)[:, None]
        )[:, 0]
        assert torch.allclose(expected, torch.tensor(s.logprobs), atol=1e-5), (expected, s.logprobs)


def test_hf_seeded_and_leaves_global_rng(tiny) -> None:
    model, tok = tiny
    sampler = HFSampler(model, tok)
    prompts = [_prompt(tok, "Say red.")] * 4
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = sampler.sample(prompts, max_new_tokens=8, seed=5)
    assert torch.equal(before, torch.get_rng_state())
    b = sampler.sample(prompts, max_new_tokens=8, seed=5)
    c = sampler.sample(prompts, max_new_tokens=8, seed=6)
    assert [s.ids for s in a] == [s.ids for s in b]
    assert [s.ids for s in a] != [s.ids for s in c]
    assert len({tuple(s.ids) for s in a}) > 1, "rows of one batch must differ"


def test_hf_stops_at_stop_id_and_keeps_it(tiny) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Say red.")
    # make every token a stop token: each sample is one token long and ends with its stop id
    stop = list(range(len(tok)))
    (s,) = HFSampler(model, tok).sample([prompt], max_new_tokens=8, stop_ids=stop, seed=0)
    assert len(s.ids) == 1 and s.finish_reason == "stop"
    (s,) = HFSampler(model, tok).sample([prompt], max_new_tokens=5, stop_ids=[10**6], seed=0)
    assert len(s.ids) == 5 and s.finish_reason == "length"


def test_samplers_satisfy_protocol(tiny) -> None:
    model, tok = tiny
    assert isinstance(HFSampler(model, tok), Sampler)
    assert isinstance(ServerSampler("http://x", "m"), Sampler)


def _vllm_handler(seen: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        seen.append(body)
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            ids = [prompt[-1] + 1, prompt[-1] + 2, 99]
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "token_ids": ids,
                    "prompt_token_ids": prompt,
                    "logprobs": {
                        "token_logprobs": [-0.5, -0.25, -0.125],
                        "tokens": [f"token_id:{t}" for t in ids],
                    },
                    "finish_reason": "stop",
                }
            )
        return httpx.Response(
            200, json={"id": "c", "object": "text_completion", "choices": choices}
        )

    return handler


def test_server_sampler_batched_request() -> None:
    seen: list[dict] = []
    sampler = ServerSampler(
        "http://sampler:8000", "policy@3", transport=httpx.MockTransport(_vllm_handler(seen))
    )
    out = sampler.sample([[1, 2], [5]], max_new_tokens=7, temperature=0.9, stop_ids=[99])
    assert out == [
        Sample([3, 4, 99], [-0.5, -0.25, -0.125], "stop"),
        Sample([6, 7, 99], [-0.5, -0.25, -0.125], "stop"),
    ]
    (body,) = seen
    assert body["model"] == "policy@3" and body["prompt"] == [[1, 2], [5]]
    assert body["max_tokens"] == 7 and body["temperature"] == 0.9 and body["stop_token_ids"] == [99]
    assert body["logprobs"] == 1 and body["return_token_ids"] and body["return_tokens_as_token_ids"]


def test_server_sampler_seed_gives_each_prompt_its_own_request() -> None:
    seen: list[dict] = []
    sampler = ServerSampler(
        "http://sampler:8000/v1", "m", transport=httpx.MockTransport(_vllm_handler(seen))
    )
    out = sampler.sample([[1], [1], [1]], max_new_tokens=3, seed=4)
    assert [s.ids for s in out] == [[2, 3, 99]] * 3
    assert len(seen) == 3 and len({b["seed"] for b in seen}) == 3
    again: list[dict] = []
    ServerSampler(
        "http://sampler:8000", "m", transport=httpx.MockTransport(_vllm_handler(again))
    ).sample([[1], [1], [1]], max_new_tokens=3, seed=4)
    assert sorted(b["seed"] for b in again) == sorted(b["seed"] for b in seen)


def test_a_server_that_seeds_rows_itself_gets_a_seeded_lot_as_one_request() -> None:
    seen: list[dict] = []
    transport = httpx.MockTransport(_vllm_handler(seen))
    sampler = ServerSampler("http://s", "m", transport=transport, per_row_seeds=True)
    out = sampler.sample([[1], [1], [5]], max_new_tokens=3, seed=4)
    assert [s.ids for s in out] == [[2, 3, 99], [2, 3, 99], [6, 7, 99]]
    (body,) = seen
    assert body["prompt"] == [[1], [1], [5]] and body["max_tokens"] == 3
    again: list[dict] = []
    ServerSampler(
        "http://s", "m", transport=httpx.MockTransport(_vllm_handler(again)), per_row_seeds=True
    ).sample([[1], [1], [5]], max_new_tokens=3, seed=4)
    assert again[0]["seed"] == body["seed"]
    seen.clear()  # per-prompt limits cannot share one request's max_tokens: one request per prompt
    sampler.sample([[1], [5]], max_new_tokens=[2, 3], seed=4)
    assert sorted(b["max_tokens"] for b in seen) == [2, 3]


def test_server_sampler_cuts_after_stop_id() -> None:
    sampler = ServerSampler("http://s", "m", transport=httpx.MockTransport(_vllm_handler([])))
    (s,) = sampler.sample([[10]], max_new_tokens=3, stop_ids=[12])
    assert s.ids == [11, 12] and s.logprobs == [-0.5, -0.25] and s.finish_reason == "stop"


def test_server_sampler_errors_are_clear() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(SamplerError, match="unreachable"):
        ServerSampler("http://s", "m", transport=httpx.MockTransport(down)).sample(
            [[1]], max_new_tokens=2
        )

    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": "adapter policy@9 not found"})

    with pytest.raises(SamplerError, match="HTTP 404.*policy@9"):
        ServerSampler("http://s", "policy@9", transport=httpx.MockTransport(not_found)).sample(
            [[1]], max_new_tokens=2
        )

    def no_ids(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "hi", "logprobs": None}]})

    with pytest.raises(SamplerError, match="return_token_ids"):
        ServerSampler("http://s", "m", transport=httpx.MockTransport(no_ids)).sample(
            [[1]], max_new_tokens=2
        )


# -- prefix cache (HFSampler(prefix_cache=True), trainer/serving/kvcache.py) -----------------------
def _teacher_forced(model, prompt: list[int], ids: list[int], temperature: float):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(ids)[:, None])[
        :, 0
    ], logits.argmax(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_prefix_cache_matches_teacher_forcing_over_turns(tiny, temperature: float) -> None:
    """Cached multi-turn sampling: logprobs (and greedy ids) are the
    model's on the full sequence."""
    model, tok = tiny
    sampler = HFSampler(model, tok, prefix_cache=True)
    shared = _prompt(tok, "A long shared system prompt, the same for every episode in the batch.")
    # rows with a shared prefix, different lengths, and one unrelated row (left padding)
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared + [11], [3, 4, 5]]
    stops = [tok.eos_token_id, 12, 13]  # some rows stop early: the batch is compacted
    for turn in range(3):
        samples = sampler.sample(
            prompts, max_new_tokens=9, temperature=temperature, stop_ids=stops, seed=turn
        )
        for prompt, s in zip(prompts, samples):
            expected, argmax = _teacher_forced(model, prompt, s.ids, temperature)
            assert torch.allclose(expected, torch.tensor(s.logprobs), atol=1e-4), (
                turn,
                expected,
                s.logprobs,
            )
            if temperature == 0:
                assert argmax.tolist() == s.ids
        prompts = [p + s.ids + [20 + turn, 21] for p, s in zip(prompts, samples)]
    store = sampler.store
    assert store.hits > store.misses, "later turns must prefill only their new tokens"
    assert 1 <= len(store) <= 5  # one entry per row (older turns superseded) + the shared prefix


def test_prefix_cache_row_seeds_do_not_depend_on_the_batch(tiny) -> None:
    model, tok = tiny
    prompts = [_prompt(tok, "Say red."), _prompt(tok, "Say blue, then green.")]
    alone = HFSampler(model, tok, prefix_cache=True).sample(
        prompts[:1], max_new_tokens=8, row_seeds=[42]
    )
    both = HFSampler(model, tok, prefix_cache=True).sample(
        prompts, max_new_tokens=8, row_seeds=[42, 7]
    )
    assert alone[0].ids == both[0].ids
    again = HFSampler(model, tok, prefix_cache=True).sample(
        prompts, max_new_tokens=8, row_seeds=[42, 8]
    )
    assert again[0].ids == both[0].ids
    with pytest.raises(Exception, match="row_seeds"):
        HFSampler(model, tok, prefix_cache=True).sample(prompts, max_new_tokens=2, row_seeds=[1])


def test_prefix_store_is_bounded_and_supersedes(tiny) -> None:
    from trainer.serving.kvcache import KVEntry, PrefixStore

    t = torch.zeros(1, 10, 2)
    store = PrefixStore(max_bytes=3 * 2 * t.numel() * 4)  # room for three one-layer entries
    store.add(KVEntry([1, 2], [t], [t], shared=True))
    store.add(KVEntry([1, 2, 3], [t], [t]))
    store.add(KVEntry([1, 2, 3, 4], [t], [t]))  # supersedes [1, 2, 3], keeps the shared one
    assert [e.ids for e in store.entries] == [[1, 2], [1, 2, 3, 4]]
    entry, n = store.best([1, 2, 3, 4, 5], limit=4)
    assert entry.ids == [1, 2, 3, 4] and n == 4
    assert store.best([1, 2, 3, 4], limit=3)[1] == 3  # a prompt that is a prefix of an entry
    assert store.best([9], limit=1) == (None, 0)
    store.add(KVEntry([5], [t], [t]))
    store.add(KVEntry([6], [t], [t]))
    assert len(store) == 3 and store.nbytes <= store.max_bytes


# ------------------------------------------------------------------ per-prompt budgets
def test_hf_per_prompt_budgets_cut_each_row(tiny) -> None:
    model, tok = tiny
    prompts = [_prompt(tok, "Say red."), _prompt(tok, "Say blue.")]
    never = [10**6]  # no stop id: every row runs to its limit
    wide = HFSampler(model, tok).sample(prompts, max_new_tokens=8, stop_ids=never, seed=5)
    each = HFSampler(model, tok).sample(prompts, max_new_tokens=[3, 8], stop_ids=never, seed=5)
    assert (each[0].ids, each[0].finish_reason) == (wide[0].ids[:3], "length")
    assert each[0].logprobs == pytest.approx(wide[0].logprobs[:3], abs=1e-5)
    # row 1 decodes alone once row 0 is done: the same tokens, logprobs up to float round-off
    assert (each[1].ids, each[1].finish_reason) == (wide[1].ids, wide[1].finish_reason)
    assert each[1].logprobs == pytest.approx(wide[1].logprobs, abs=1e-5)


def test_server_sampler_sends_each_prompt_its_own_budget() -> None:
    seen: list[dict] = []
    sampler = ServerSampler("http://s", "m", transport=httpx.MockTransport(_vllm_handler(seen)))
    out = sampler.sample([[1], [2], [3]], max_new_tokens=[4, 9, 4], stop_ids=[99], seed=1)
    assert sorted((b["prompt"][0][0], b["max_tokens"]) for b in seen) == [(1, 4), (2, 9), (3, 4)]
    assert [s.ids[0] for s in out] == [2, 3, 4]
    seen.clear()  # unseeded: one request per distinct budget, answers back in prompt order
    out = sampler.sample([[1], [2], [3]], max_new_tokens=[4, 9, 4], stop_ids=[99])
    assert sorted((b["max_tokens"], b["prompt"]) for b in seen) == [(4, [[1], [3]]), (9, [[2]])]
    assert [s.ids[0] for s in out] == [2, 3, 4]


def test_budget_list_must_match_the_prompts() -> None:
    from twin.errors import ConfigError

    sampler = ServerSampler("http://s", "m", transport=httpx.MockTransport(_vllm_handler([])))
    with pytest.raises(ConfigError, match="2 limits for 3 prompts"):
        sampler.sample([[1], [2], [3]], max_new_tokens=[4, 4])
    with pytest.raises(ConfigError, match="must be >= 0, got -1 for prompt 1"):
        sampler.sample([[1], [2]], max_new_tokens=[4, -1])


# -- every sampling field is stated; enough requests in flight -----------------------------------
@pytest.mark.parametrize("seed, per_row", [(None, False), (4, False), (4, True)])
def test_every_request_states_top_k_and_the_neutral_sampling_fields(seed, per_row) -> None:
    # vLLM fills an omitted field from generation_config.json (Qwen3-8B: top_k 20), so a request
    # without top_k would sample from 20 tokens while the learner scores the full softmax
    seen: list[dict] = []
    sampler = ServerSampler(
        "http://s", "m", transport=httpx.MockTransport(_vllm_handler(seen)), per_row_seeds=per_row
    )
    sampler.sample([[1], [1]], max_new_tokens=3, seed=seed)
    assert seen
    for body in seen:
        assert body["top_k"] == -1 and body["top_p"] == 1.0 and body["temperature"] == 1.0
        assert body["min_p"] == 0.0 and body["repetition_penalty"] == 1.0
        assert body["presence_penalty"] == 0.0 and body["frequency_penalty"] == 0.0


def test_top_k_zero_and_minus_one_both_mean_the_whole_vocabulary() -> None:
    for given in (None, 0, -1):
        seen: list[dict] = []
        ServerSampler(
            "http://s", "m", transport=httpx.MockTransport(_vllm_handler(seen)), top_k=given
        ).sample([[1]], max_new_tokens=2)
        assert seen[0]["top_k"] == -1
    seen = []
    ServerSampler(
        "http://s", "m", transport=httpx.MockTransport(_vllm_handler(seen)), top_k=5
    ).sample([[1]], max_new_tokens=2)
    assert seen[0]["top_k"] == 5
    with pytest.raises(ConfigError, match="top_k must be -1 or 0"):
        ServerSampler("http://s", "m", top_k=-2)


def test_a_large_lot_keeps_about_256_requests_in_flight() -> None:
    import asyncio

    state = {"open": 0, "peak": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        state["open"] += 1
        state["peak"] = max(state["peak"], state["open"])
        await asyncio.sleep(0.02)
        state["open"] -= 1
        body = json.loads(request.content)
        choice = {
            "index": 0,
            "token_ids": [7],
            "logprobs": {"token_logprobs": [-0.1]},
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"choices": [choice] * len(body["prompt"])})

    out = ServerSampler("http://s", "m", transport=httpx.MockTransport(handler)).sample(
        [[1]] * 300, max_new_tokens=1, seed=0
    )
    assert len(out) == 300
    assert state["peak"] == 256


def test_a_real_connection_pool_does_not_cap_requests_in_flight_at_httpx_default() -> None:
    # httpx pools at most 100 connections unless told otherwise; count what reaches a socket
    import asyncio
    import threading

    from trainer.workers import ModelCheckTransport

    state = {"open": 0, "peak": 0}
    ready = threading.Event()
    port: list[int] = []
    loop = asyncio.new_event_loop()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            await reader.readexactly(length)
            state["open"] += 1
            state["peak"] = max(state["peak"], state["open"])
            await asyncio.sleep(0.3)
            state["open"] -= 1
            choice = {
                "index": 0,
                "token_ids": [7],
                "logprobs": {"token_logprobs": [-0.1]},
                "finish_reason": "length",
            }
            data = json.dumps({"model": "m", "choices": [choice]}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % len(data)
                + data
            )
            await writer.drain()

    stop: list[asyncio.Event] = []

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=512)
        port.append(server.sockets[0].getsockname()[1])
        stop.append(asyncio.Event())
        ready.set()
        await stop[0].wait()
        server.close()
        await server.wait_closed()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    url = f"http://127.0.0.1:{port[0]}"
    for transport in (None, ModelCheckTransport()):
        state["peak"] = 0
        out = ServerSampler(url, "m", transport=transport).sample(
            [[1]] * 160, max_new_tokens=1, seed=0
        )
        assert len(out) == 160
        assert state["peak"] > 100, (transport, state["peak"])
    loop.call_soon_threadsafe(stop[0].set)
    thread.join(10)


def test_turn_stop_ids_add_the_generation_config_eos_ids(tmp_path) -> None:
    from types import SimpleNamespace

    from trainer.samplers import turn_stop_ids

    tok = SimpleNamespace(eos_token_id=151645)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert turn_stop_ids(tok, tmp_path) == [151645, 151643]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 128008}))
    assert turn_stop_ids(tok, tmp_path) == [151645, 128008]
    assert turn_stop_ids(tok, tmp_path / "missing") == [151645] == turn_stop_ids(tok)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json is not a JSON object"):
        turn_stop_ids(tok, tmp_path)
    with pytest.raises(ConfigError, match="names an eos token"):
        turn_stop_ids(SimpleNamespace(eos_token_id=None), None)
