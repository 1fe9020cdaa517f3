"""The built-in completions server (`twin serve`) speaks vLLM's API over loopback, with the tiny
model."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("peft")

from trainer.serving.completions import CompletionServer
from trainer.serving.http import make_http_server
from trainer.serving.process import ServerProcess
from trainer.tiny import build_tiny


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny()


@pytest.fixture(scope="module")
def base(tiny_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)


def _make_adapter(
    tiny_dir: Path,
    out: Path,
    seed: int,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj"),
) -> Path:
    """A LoRA adapter with random (non-zero) B, so it changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [_make_adapter(tiny_dir, root / f"v{i}", seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def server(tiny_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    core = CompletionServer(
        model, AutoTokenizer.from_pretrained(tiny_dir), model_name="tiny", max_loras=2
    )
    httpd = make_http_server(core, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{httpd.server_address[1]}", timeout=60)
    yield client
    client.close()
    httpd.shutdown()
    httpd.server_close()
    core.close()


PROMPT = [1, 447, 201, 361, 223, 404, 223, 67, 2, 201, 1, 399, 201]


def _complete(client: httpx.Client, **body) -> dict:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "logprobs": 0,
        "return_token_ids": True,
        **body,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _teacher_forced(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return [float(lps[i, t]) for i, t in enumerate(completion)]


def test_health_and_models(server: httpx.Client) -> None:
    assert server.get("/health").status_code == 200
    models = server.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny"


def test_token_ids_in_and_out_in_vllm_format(server: httpx.Client) -> None:
    out = _complete(server, ignore_eos=True, seed=3)
    (choice,) = out["choices"]
    assert choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == 8
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert out["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 8,
        "total_tokens": len(PROMPT) + 8,
        "prompt_tokens_details": None,
    }
    # Same seed -> same ids.
    again = _complete(server, ignore_eos=True, seed=3)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_logprobs_equal_a_teacher_forced_forward_pass(server: httpx.Client, base) -> None:
    model, _ = base
    prompts = [PROMPT, PROMPT[:5], [1, 399, 201]]  # ragged: left padding must not change anything
    out = _complete(server, prompt=prompts, max_tokens=12, ignore_eos=True, seed=0)
    assert len(out["choices"]) == 3
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        expected = _teacher_forced(model, prompt, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-5)


def test_repeated_prompts_share_one_prefill_and_keep_their_own_samples(
    server: httpx.Client, base
) -> None:
    # A GRPO group: each prompt G times (and n > 1); the server prefills each distinct prompt once.
    model, _ = base
    prompts = [PROMPT, PROMPT[:5], PROMPT, PROMPT[:5], PROMPT]
    out = _complete(server, prompt=prompts, n=2, max_tokens=10, ignore_eos=True, seed=3)
    choices = out["choices"]
    assert len(choices) == 10
    for i, choice in enumerate(choices):
        expected = _teacher_forced(model, prompts[i // 2], choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-5)
    samples = {tuple(c["token_ids"]) for c in choices}
    assert len(samples) >= 8  # rows of one prompt draw their own tokens, not copies of one
    again = _complete(server, prompt=prompts, n=2, max_tokens=10, ignore_eos=True, seed=3)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in choices]


def test_temperature_logprobs_are_processed(server: httpx.Client, base) -> None:
    model, _ = base
    out = _complete(server, temperature=0.5, ignore_eos=True, seed=1)
    choice = out["choices"][0]
    ids = torch.tensor([PROMPT + choice["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1] / 0.5
    expected = [
        float(v)
        for v in torch.log_softmax(logits, -1).gather(
            1, torch.tensor(choice["token_ids"])[:, None]
        )[:, 0]
    ]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-5)


def test_greedy_text_prompt_and_n(server: httpx.Client, base) -> None:
    _, tok = base
    out = _complete(
        server, prompt="the answer is", temperature=0.0, n=2, max_tokens=4, ignore_eos=True
    )
    first, second = out["choices"]
    assert first["prompt_token_ids"] == tok("the answer is")["input_ids"]
    assert first["token_ids"] == second["token_ids"]  # greedy is deterministic
    assert [c["index"] for c in out["choices"]] == [0, 1]


def test_stop_token_ids_end_with_stop(server: httpx.Client) -> None:
    free = _complete(server, ignore_eos=True, seed=5, max_tokens=6)["choices"][0]["token_ids"]
    stop = free[2]
    out = _complete(server, ignore_eos=True, seed=5, max_tokens=6, stop_token_ids=[stop])[
        "choices"
    ][0]
    assert out["token_ids"] == free[: free.index(stop) + 1]
    assert out["finish_reason"] == "stop"
    assert out["stop_reason"] == stop


def test_adapter_load_use_unload(
    server: httpx.Client, adapters: list[Path], tiny_dir: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = server.post(
        "/v1/load_lora_adapter", json={"lora_name": "policy@1", "lora_path": str(adapters[0])}
    )
    assert r.status_code == 200, r.text
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny", "policy@1"]
    base_out = _complete(server, ignore_eos=True, seed=7)["choices"][0]
    lora_out = _complete(server, model="policy@1", ignore_eos=True, seed=7)["choices"][0]
    assert lora_out["logprobs"]["token_logprobs"] != pytest.approx(
        base_out["logprobs"]["token_logprobs"], abs=1e-3
    )
    # The server's logprobs on the adapter equal peft's teacher-forced ones.
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), adapters[0]
    )
    expected = _teacher_forced(ref.eval(), PROMPT, lora_out["token_ids"])
    assert lora_out["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-5)
    # And the base model is untouched after serving the adapter.
    assert (
        _complete(server, ignore_eos=True, seed=7)["choices"][0]["token_ids"]
        == base_out["token_ids"]
    )

    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "policy@1"})
    assert r.status_code == 200, r.text
    r = server.post(
        "/v1/completions", json={"model": "policy@1", "prompt": PROMPT, "max_tokens": 2}
    )
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError"


def test_vllm_status_codes(server: httpx.Client, adapters: list[Path], tmp_path: Path) -> None:
    load = "/v1/load_lora_adapter"
    assert (
        server.post(load, json={"lora_name": "codes@1", "lora_path": str(adapters[1])}).status_code
        == 200
    )
    assert (
        server.post(load, json={"lora_name": "codes@1", "lora_path": str(adapters[1])}).status_code
        == 400
    )
    inplace = {"lora_name": "codes@1", "lora_path": str(adapters[2]), "load_inplace": True}
    assert server.post(load, json=inplace).status_code == 200
    assert (
        server.post(load, json={"lora_name": "codes@2", "lora_path": str(tmp_path)}).status_code
        == 404
    )
    assert server.post(load, json={"lora_name": "codes@3"}).status_code == 400
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    assert (
        server.post("/v1/completions", json={"model": "nope", "prompt": PROMPT}).status_code == 404
    )
    assert (
        server.post("/v1/completions", json={"model": "tiny", "prompt": {"a": 1}}).status_code
        == 400
    )
    assert (
        server.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True}
        ).status_code
        == 400
    )
    assert server.post("/v1/completions", content=b"{not json").status_code == 400
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "codes@1"}).status_code == 200


def test_inplace_reload_changes_outputs_and_more_adapters_than_max_loras(
    server: httpx.Client, adapters: list[Path]
) -> None:
    load = "/v1/load_lora_adapter"
    outs = {}
    for i, path in enumerate(
        adapters
    ):  # 3 adapters, max_loras=2: the oldest is evicted and reloaded
        assert (
            server.post(load, json={"lora_name": f"many@{i}", "lora_path": str(path)}).status_code
            == 200
        )
    for i in range(3):
        outs[i] = _complete(server, model=f"many@{i}", ignore_eos=True, seed=2)["choices"][0][
            "logprobs"
        ]["token_logprobs"]
    again = _complete(server, model="many@0", ignore_eos=True, seed=2)["choices"][0]["logprobs"][
        "token_logprobs"
    ]
    assert again == pytest.approx(outs[0], abs=1e-6)
    assert outs[0] != pytest.approx(outs[1], abs=1e-3)
    # load_inplace swaps the weights behind the same name.
    r = server.post(
        load, json={"lora_name": "many@0", "lora_path": str(adapters[1]), "load_inplace": True}
    )
    assert r.status_code == 200
    swapped = _complete(server, model="many@0", ignore_eos=True, seed=2)["choices"][0]["logprobs"][
        "token_logprobs"
    ]
    assert swapped == pytest.approx(outs[1], abs=1e-6)
    for i in range(3):
        server.post("/v1/unload_lora_adapter", json={"lora_name": f"many@{i}"})


def test_concurrent_requests_are_batched_and_match_serial(server: httpx.Client) -> None:
    serial = [
        _complete(server, ignore_eos=True, seed=s)["choices"][0]["token_ids"] for s in range(4)
    ]
    results: dict[int, list[int]] = {}

    def call(s: int) -> None:
        results[s] = _complete(server, ignore_eos=True, seed=s)["choices"][0]["token_ids"]

    threads = [threading.Thread(target=call, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[s] for s in range(4)] == serial


def test_request_finishes_on_its_adapter_when_unloaded_meanwhile(
    tiny_dir: Path, adapters: list[Path], base, wait_until: Callable[..., None]
) -> None:
    """A queued request keeps the adapter version it resolved on arrival."""
    from transformers import AutoModelForCausalLM

    _, tok = base
    core = CompletionServer(
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), tok, model_name="tiny"
    )
    try:
        core.load_lora_adapter({"lora_name": "policy@1", "lora_path": str(adapters[0])})
        expected = core.completions(
            {
                "model": "policy@1",
                "prompt": PROMPT,
                "max_tokens": 4,
                "seed": 1,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        )["choices"][0]["token_ids"]
        # Hold the model so the next request waits in the queue, unload meanwhile, release.
        version = core.slots.adapters["policy@1"]
        core._model_lock.acquire()
        box: dict = {}
        t = threading.Thread(
            target=lambda: box.update(
                core.completions(
                    {
                        "model": "policy@1",
                        "prompt": PROMPT,
                        "max_tokens": 4,
                        "seed": 1,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                )
            )
        )
        t.start()
        wait_until(lambda: version.pending > 0, "the request holds its adapter version")
        threading.Thread(target=core.unload_lora_adapter, args=({"lora_name": "policy@1"},)).start()
        core._model_lock.release()
        t.join(30)
        assert box["choices"][0]["token_ids"] == expected
        assert box["model"] == "policy@1"
    finally:
        core.close()


def test_server_process_starts_and_stops(tiny_dir: Path) -> None:
    with ServerProcess(
        str(tiny_dir), served_model_name="tiny", threads=1, startup_timeout=120
    ) as proc:
        assert proc.healthy()
        r = httpx.post(
            f"{proc.base_url}/completions",
            json={
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 3,
                "return_token_ids": True,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["token_ids"]) == 3
    assert not proc.alive()


@pytest.mark.slow
def test_server_process_reports_log_tail_on_failure(tmp_path: Path) -> None:
    proc = ServerProcess(str(tmp_path / "missing-model"), threads=1, startup_timeout=60)
    with pytest.raises(Exception, match="exited with code") as info:
        proc.start()
    assert "missing-model" in str(info.value)
    assert "config.json" in str(info.value)  # the loader's ConfigError reached the log tail


def test_the_trainer_server_sampler_reads_our_responses(server: httpx.Client, base) -> None:
    """trainer.samplers.ServerSampler (written for vLLM) works against twin serve unchanged."""
    from trainer import samplers

    model, _ = base
    sampler = samplers.ServerSampler(str(server.base_url), "tiny")
    samples = sampler.sample([PROMPT, PROMPT[:4]], max_new_tokens=6, temperature=1.0, seed=11)
    assert len(samples) == 2
    for prompt, s in zip([PROMPT, PROMPT[:4]], samples, strict=True):
        assert 1 <= len(s.ids) <= 6 and len(s.logprobs) == len(s.ids)
        assert s.logprobs == pytest.approx(_teacher_forced(model, prompt, s.ids), abs=1e-5)


def test_top_p_keeps_the_smallest_top_set_reaching_p() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from trainer.serving.engine import top_p_filter

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.floats(-20, 20), min_size=1, max_size=30), st.floats(0.01, 1.0))
    def check(values: list[float], top_p: float) -> None:
        logits = torch.tensor(values, dtype=torch.float64)
        kept = torch.isfinite(top_p_filter(logits, top_p))
        probs = torch.softmax(logits, -1)
        assert kept.any()
        assert float(probs[kept].sum()) >= min(top_p, 1.0) - 1e-9
        # every kept token is at least as likely as every dropped one
        if (~kept).any():
            assert float(probs[kept].min()) >= float(probs[~kept].max()) - 1e-12
        # minimal: dropping the least likely kept token would fall below top_p
        if kept.sum() > 1:
            assert float(probs[kept].sum() - probs[kept].min()) < top_p + 1e-9

    check()


def test_clients_share_one_tls_context(
    server: httpx.Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # httpx loads the CA bundle into a new SSL context for every client it makes without one
    # (~70 ms of CPU); the sampling calls, adapter loads and probes of a training step must not.
    import ssl

    from trainer.samplers import ServerSampler
    from trainer.weight_sync import AdapterClient
    from trainer.workers import ModelCheckTransport, _batched_sampler
    from twin.policies.http import tls_context

    assert tls_context() is tls_context() and tls_context().verify_mode == ssl.CERT_REQUIRED
    url = str(server.base_url)
    plain, checked = (
        ServerSampler(url, "tiny"),
        ServerSampler(url, "tiny", transport=ModelCheckTransport()),
    )
    batched = _batched_sampler(url)
    batched.model_name = "tiny"
    adapters = AdapterClient(url)
    loads: list[object] = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args or kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    for seed in range(3):
        for sampler in (plain, checked, batched):
            assert len(sampler.sample([PROMPT, PROMPT], max_new_tokens=2, seed=seed)) == 2
        with pytest.raises(
            Exception, match="missing"
        ):  # a refused load still goes through a client
            adapters.load(f"missing{seed}", tmp_path / "missing")
    assert loads == []


def test_trainer_cycle_reuses_adapter_slots_and_serves_each_version_exactly(
    tiny_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    # What the async trainer does every step: load policy@<v+1>, sample, unload policy@<v-1>. The
    # server copies each new adapter into a freed slot of the same shape instead of building new
    # LoRA modules; every version must still be served with its own weights.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    core = CompletionServer(
        model, AutoTokenizer.from_pretrained(tiny_dir), model_name="tiny", max_loras=2
    )
    other = _make_adapter(
        tiny_dir, tmp_path / "r8", 8, rank=8, targets=("q_proj", "v_proj")
    )  # no slot fits it
    sequence = [adapters[0], adapters[1], adapters[2], other, adapters[0], adapters[1]]
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "seed": 5,
    }
    in_place: list[tuple[str, bool]] = []
    copy = core.slots._load_into_free_slot

    def recorded(version: Any) -> bool:
        in_place.append((version.name, copy(version)))
        return in_place[-1][1]

    core.slots._load_into_free_slot = recorded  # type: ignore[method-assign]
    try:
        for v, path in enumerate(sequence):
            core.load_lora_adapter({"lora_name": f"policy@{v}", "lora_path": str(path)})
            out = core.completions({**body, "model": f"policy@{v}"})["choices"][0]
            ref = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), path
            )
            expected = _teacher_forced(ref.eval(), PROMPT, out["token_ids"])
            assert out["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-5), (
                f"policy@{v} from {path.name}"
            )
            if v >= 1:
                core.unload_lora_adapter({"lora_name": f"policy@{v - 1}"})
        # policy@0 wraps the model and @1 finds no free slot; @2, @4 and @5 are copied into freed
        # slots; @3 has another rank and gets its own
        assert [name for name, done in in_place if done] == ["policy@2", "policy@4", "policy@5"], (
            in_place
        )
        reused = [
            k for k in core.slots.peft.peft_config
        ]  # slots in the model: reused, not one per version
        assert len(reused) <= 2 + 2, reused  # max_loras resident + the kept free slots
        assert (
            len(core.slots.resident) == 1
            and next(iter(core.slots.resident.values())).name == "policy@5"
        )
    finally:
        core.close()
