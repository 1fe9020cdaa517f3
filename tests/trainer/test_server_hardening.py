"""`twin serve` under hostile or broken input: failed adapter loads, resource limits, malformed
bodies, stalled connections, the API key and the adapter root (see docs/security.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("peft")

from trainer.serving.api import ServeLimits, ServerError
from trainer.serving.completions import CompletionServer
from trainer.serving.http import exposure_warnings, make_http_server
from trainer.serving.process import ServerProcess
from trainer.tiny import build_tiny

PROMPT = [1, 447, 201, 361, 223, 404, 223, 67, 2, 201, 1, 399, 201]
GREEDY = {
    "prompt": PROMPT,
    "max_tokens": 6,
    "logprobs": 0,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny()


def _make_adapter(tiny_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA adapter with random B (``init_lora_weights: false`` in its config)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    _make_adapter(tiny_dir, root / "good", seed=1)
    # peft builds the LoRA layers (random B: init_lora_weights is false), then fails on the weights
    shutil.copytree(root / "good", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not a safetensors file" * 4)
    return root


def _core(tiny_dir: Path, **kwargs: Any) -> CompletionServer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return CompletionServer(
        model, AutoTokenizer.from_pretrained(tiny_dir), model_name="tiny", **kwargs
    )


def _logprobs(core: CompletionServer, model: str = "tiny") -> list[float]:
    return core.completions({**GREEDY, "model": model})["choices"][0]["logprobs"]["token_logprobs"]


# -- 7: a failed adapter load leaves the server as it was ------------------------------------------
def test_failed_first_adapter_load_leaves_base_logprobs_bit_identical(
    tiny_dir: Path, adapter_dir: Path
) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    core = _core(tiny_dir)
    try:
        before, models = _logprobs(core), core.models()["data"]
        with pytest.raises(ServerError) as info:
            core.load_lora_adapter(
                {"lora_name": "broken", "lora_path": str(adapter_dir / "corrupt")}
            )
        assert info.value.code == 500
        assert _logprobs(core) == before  # bit-identical, not approximately
        assert core.models()["data"] == models
        assert not any(isinstance(m, BaseTunerLayer) for m in core.model.modules())
        # and the server still loads a good adapter afterwards
        core.load_lora_adapter({"lora_name": "good", "lora_path": str(adapter_dir / "good")})
        assert _logprobs(core, "good") != before
        assert _logprobs(core) == before
    finally:
        core.close()


def test_failed_later_adapter_load_leaves_base_and_loaded_adapters_bit_identical(
    tiny_dir: Path, adapter_dir: Path
) -> None:
    core = _core(tiny_dir)
    try:
        core.load_lora_adapter({"lora_name": "good", "lora_path": str(adapter_dir / "good")})
        base, good = _logprobs(core), _logprobs(core, "good")
        slots = list(core.slots.peft.peft_config)
        for attempt in range(2):
            with pytest.raises(ServerError):
                core.load_lora_adapter(
                    {"lora_name": f"broken{attempt}", "lora_path": str(adapter_dir / "corrupt")}
                )
        assert _logprobs(core) == base and _logprobs(core, "good") == good
        assert list(core.slots.peft.peft_config) == slots  # no half-built adapter left in the model
        assert [m["id"] for m in core.models()["data"]] == ["tiny", "good"]
    finally:
        core.close()


# -- the HTTP server -----------------------------------------------------------------------------
LIMITS = ServeLimits(read_timeout=2.0, http_threads=4, max_connections=64)


@pytest.fixture(scope="module")
def served_http(tiny_dir: Path, adapter_dir: Path) -> Iterator[tuple[str, CompletionServer, Any]]:
    core = _core(tiny_dir, limits=LIMITS, adapter_root=adapter_dir)
    httpd = make_http_server(core, "127.0.0.1", 0, api_key="s3cret-key")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", core, httpd
    httpd.shutdown()
    httpd.server_close()
    core.close()


@pytest.fixture(scope="module")
def served(served_http: tuple[str, CompletionServer, Any]) -> tuple[str, CompletionServer]:
    return served_http[0], served_http[1]


AUTH = {"Authorization": "Bearer s3cret-key"}


def _raw(url: str, request: bytes, timeout: float = 20.0) -> tuple[int, bytes]:
    """Send raw bytes, read the answer until the server closes or it is complete; (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _post(url: str, body: bytes, headers: str = "") -> tuple[int, bytes]:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret-key\r\n"
        f"Content-Type: application/json\r\nConnection: close\r\n{headers}"
    )
    if "Content-Length" not in headers:
        head += f"Content-Length: {len(body)}\r\n"
    return _raw(url, head.encode() + b"\r\n" + body)


def _strict_json(raw: bytes) -> Any:
    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(raw, parse_constant=no_constants)


def _ok(**body: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **body}).encode()


MALFORMED = {
    "n over max_n": _ok(n=2000, max_tokens=0),
    "max_tokens over the cap": _ok(max_tokens=LIMITS.max_tokens + 1, prompt=[1]),
    "too many prompts": _ok(prompt=[[1, 2]] * (LIMITS.max_prompts + 1), max_tokens=0),
    "rows over max_rows": _ok(prompt=[[1, 2]] * 8, n=200, max_tokens=0),
    "prompt over max_prompt_tokens": _ok(prompt=[1] * (LIMITS.max_prompt_tokens + 1), max_tokens=0),
    "NaN temperature": _ok().replace(b'"max_tokens": 1', b'"max_tokens": 1, "temperature": NaN'),
    "infinite temperature": _ok().replace(
        b'"max_tokens": 1', b'"max_tokens": 1, "temperature": Infinity'
    ),
    "negative temperature": _ok(temperature=-0.5),
    "NaN top_p": _ok().replace(b'"max_tokens": 1', b'"max_tokens": 1, "top_p": NaN'),
    "seed 2**70": _ok(seed=2**70),
    "seed a bool": _ok(seed=True),
    "model a list": _ok(model=["tiny"]),
    "logprobs over the cap": _ok(logprobs=LIMITS.max_logprobs + 1),
    "invalid UTF-8": b'{"model": "tiny", "prompt": "caf\xe9\xff", "max_tokens": 1}',
    "deeply nested JSON": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a JSON number too long for Python": b'{"prompt": [1], "seed": ' + b"9" * 5000 + b"}",
    "not an object": b"[1, 2, 3]",
    "no prompt": b'{"model": "tiny", "max_tokens": 1}',
    "prompt null": b'{"prompt": null}',
    "prompt of nested lists": _ok(prompt=[[[1, 2]]]),
    "bool token ids": _ok(prompt=[True, False]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_limits_and_malformed_bodies_are_400_with_a_json_reason(
    served: tuple[str, CompletionServer], case: str
) -> None:
    url, _ = served
    status, body = _post(url, MALFORMED[case])
    assert status == 400, (case, body[:300])
    error = _strict_json(body)["error"]
    assert error["type"] == "BadRequestError" and error["message"], error


@pytest.mark.parametrize("length", ["abc", "-5", "1e3", "0x10"])
def test_a_bad_content_length_is_400(served: tuple[str, CompletionServer], length: str) -> None:
    status, body = _post(served[0], _ok(), headers=f"Content-Length: {length}\r\n")
    assert status == 400, body
    assert "Content-Length" in _strict_json(body)["error"]["message"]


def test_a_body_over_the_size_limit_is_refused_unread(tiny_dir: Path) -> None:
    core = _core(tiny_dir, limits=ServeLimits(max_body_bytes=4096))
    httpd = make_http_server(core, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        status, body = _raw(
            url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{"
        )
        assert status == 413 and "at most 4096" in _strict_json(body)["error"]["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        core.close()


def test_valid_requests_still_answer_strict_json(served: tuple[str, CompletionServer]) -> None:
    # top-p removes tokens (-inf logprobs): the answer must still be JSON (vLLM's -9999 floor)
    status, body = _post(
        served[0], _ok(max_tokens=3, top_p=0.05, logprobs=5, seed=2, temperature=2.0)
    )
    assert status == 200, body
    choice = _strict_json(body)["choices"][0]
    assert all(v >= -9999.0 for top in choice["logprobs"]["top_logprobs"] for v in top.values())


def test_stalled_connections_time_out_and_hold_a_bounded_number_of_threads(
    served_http: tuple[str, CompletionServer, Any], wait_until: Callable[..., None]
) -> None:
    """A body shorter than its Content-Length once held a thread forever, one thread per
    connection."""
    url, _, httpd = served_http
    host, port = url.removeprefix("http://").split(":")
    # earlier tests' idle connections close within the read timeout: count from none open
    wait_until(lambda: httpd.open_connections == 0, "earlier connections are closed")
    before = threading.active_count()
    stalled = []
    for _ in range(20):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret-key\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        stalled.append(s)
    try:
        # the thread count means something only once the server holds every stalled connection
        wait_until(lambda: httpd.open_connections >= 20, "the server accepts all 20")
        assert threading.active_count() - before <= LIMITS.http_threads
        # every stalled connection is answered (408) and closed by the server, none left hanging
        for s in stalled:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
    finally:
        for s in stalled:
            s.close()
    status, _ = _post(url, _ok())
    assert status == 200


def test_connections_over_the_cap_get_503(tiny_dir: Path, wait_until: Callable[..., None]) -> None:
    core = _core(tiny_dir, limits=ServeLimits(read_timeout=5.0, http_threads=2, max_connections=3))
    httpd = make_http_server(core, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    held = [
        socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=10)
        for _ in range(3)
    ]
    try:
        wait_until(lambda: httpd.open_connections == 3, "the server holds the 3 connections")
        status, body = _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (
            status == 503 and "too many open connections" in _strict_json(body)["error"]["message"]
        )
    finally:
        for s in held:
            s.close()
        httpd.shutdown()
        httpd.server_close()
        core.close()


# -- 9: API key and adapter root ------------------------------------------------------------------
def test_api_key_is_required_on_v1_routes_but_not_on_health(
    served: tuple[str, CompletionServer],
) -> None:
    url, _ = served
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-key"},
        {"Authorization": "Basic s3cret-key"},
    ):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", headers
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers
        )
        assert r.status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


def test_trainer_clients_send_the_key_from_the_environment(
    served: tuple[str, CompletionServer], adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.samplers import ServerSampler
    from trainer.weight_sync import AdapterClient

    url, _ = served
    monkeypatch.setenv("TWINRL_API_KEY", "s3cret-key")
    AdapterClient(url).load("policy@1", adapter_dir / "good")
    samples = ServerSampler(url, "policy@1").sample([PROMPT], max_new_tokens=2, seed=0)
    assert len(samples[0].ids) == 2
    AdapterClient(url).unload("policy@1")
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]] == ["tiny"]


def test_adapter_root_refuses_paths_outside_it_and_models_hide_paths(
    served: tuple[str, CompletionServer], adapter_dir: Path, tmp_path: Path
) -> None:
    url, _ = served
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dir / "good", outside)
    link = adapter_dir / "link-out"
    link.symlink_to(outside, target_is_directory=True)
    load = f"{url}/v1/load_lora_adapter"
    try:
        for path in (outside, link, adapter_dir / ".." / tmp_path.name / "outside", Path("/etc")):
            r = httpx.post(load, json={"lora_name": "x", "lora_path": str(path)}, headers=AUTH)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["type"] == "PermissionDeniedError"
        r = httpx.post(
            load, json={"lora_name": "inside", "lora_path": str(adapter_dir / "good")}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        models = httpx.get(f"{url}/v1/models", headers=AUTH).text
        assert str(adapter_dir) not in models and "good" not in models
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "inside"}, headers=AUTH)
    finally:
        link.unlink()


@pytest.mark.parametrize(
    ("host", "key", "root", "warned"),
    [
        ("127.0.0.1", None, None, 0),
        ("localhost", None, None, 0),
        ("::1", None, None, 0),
        ("0.0.0.0", None, None, 2),
        ("0.0.0.0", "k", None, 1),
        ("10.1.2.3", "k", "/srv/adapters", 0),
        ("myhost.example", None, "/srv/adapters", 1),
    ],
)
def test_binding_a_non_loopback_address_without_key_or_root_warns(
    host: str, key: str | None, root: str | None, warned: int
) -> None:
    assert len(exposure_warnings(host, key, root)) == warned


def test_server_process_passes_key_in_the_environment_and_the_root(tmp_path: Path) -> None:
    proc = ServerProcess("tiny", api_key="k1", adapter_root=tmp_path / "run" / ".." / "run")
    command = proc.command()
    assert "k1" not in command  # arguments show in ps; the key travels in the environment
    assert command[command.index("--adapter-root") + 1] == str((tmp_path / "run").resolve())
    assert proc.environment()["TWINRL_API_KEY"] == "k1"


def test_serve_options_are_validated_with_a_clear_error() -> None:
    from trainer.serving.cli import serve as main
    from twin.errors import ConfigError

    with pytest.raises(ConfigError, match="max_n"):
        main("tiny", max_n=0)
    with pytest.raises(ConfigError, match="max_tokns.*--max-tokens"):
        main("tiny", max_tokns=5)


@pytest.mark.skipif(os.name != "posix", reason="child process with a loopback port")
def test_trainer_started_server_with_key_and_root_serves_its_clients(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.samplers import ServerSampler
    from trainer.weight_sync import AdapterClient

    run = tmp_path / "run"
    adapter = _make_adapter(tiny_dir, run / "adapters" / "policy@1", seed=3)
    monkeypatch.setenv("TWINRL_API_KEY", "child-key")
    with ServerProcess(
        str(tiny_dir), served_model_name="tiny", threads=1, adapter_root=run
    ) as proc:
        assert proc.healthy()  # /health needs no key
        assert httpx.get(f"{proc.base_url}/models").status_code == 401
        AdapterClient(proc.base_url).load("policy@1", adapter)
        assert (
            len(ServerSampler(proc.base_url, "policy@1").sample([PROMPT], max_new_tokens=2, seed=0))
            == 1
        )


# -- 8: scheduling --------------------------------------------------------------------------------
def test_a_large_request_is_chunked_so_a_small_one_behind_it_finishes_first(
    tiny_dir: Path, wait_until: Callable[..., None]
) -> None:
    """Requests take turns in chunks of max_batch_rows rows; a chunked request keeps its seeded
    samples."""
    core = _core(tiny_dir, max_batch_rows=4)
    big = {
        "prompt": [PROMPT, PROMPT[:5], PROMPT[:7], PROMPT[:9]],
        "n": 4,
        "max_tokens": 5,
        "seed": 9,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    small = {
        "prompt": PROMPT[:3],
        "max_tokens": 2,
        "seed": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        finished: list[str] = []
        results: dict[str, Any] = {}

        def call(name: str, body: dict[str, Any]) -> None:
            results[name] = core.completions(body)
            finished.append(name)

        core._model_lock.acquire()  # hold the worker so both requests are queued before it runs
        threads = [threading.Thread(target=call, args=("big", big))]
        threads[0].start()
        wait_until(lambda: core._queue, "the big request is queued")
        threads.append(threading.Thread(target=call, args=("small", small)))
        threads[1].start()
        wait_until(lambda: any(r.rows == 1 for r in list(core._queue)), "the small one is queued")
        core._model_lock.release()
        for t in threads:
            t.join(60)
        assert finished == ["small", "big"]
        chunked = [c["token_ids"] for c in results["big"]["choices"]]
        assert len(chunked) == 16 and [c["index"] for c in results["big"]["choices"]] == list(
            range(16)
        )
    finally:
        core.close()
    whole = _core(tiny_dir, max_batch_rows=64)
    try:
        assert [c["token_ids"] for c in whole.completions(big)["choices"]] == chunked
    finally:
        whole.close()


# -- malformed input that once answered 500 -------------------------------------------------------
def test_a_prompt_with_a_lone_surrogate_is_400(served: tuple[str, CompletionServer]) -> None:
    for prompt in ('"a\\ud800b"', '["ok", "\\udfff"]'):
        status, body = _post(
            served[0], b'{"model": "tiny", "max_tokens": 1, "prompt": ' + prompt.encode() + b"}"
        )
        assert status == 400, body[:300]
        assert "lone surrogate" in _strict_json(body)["error"]["message"]


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1e-39}, {"temperature": 1e-30, "top_p": 0.5}, {"top_p": 1e-46}]
)
def test_vanishing_temperature_or_top_p_with_logprobs_answer_finite_json(
    served: tuple[str, CompletionServer], sampling: dict[str, float]
) -> None:
    status, body = _post(served[0], _ok(max_tokens=3, logprobs=3, seed=1, **sampling))
    assert status == 200, body[:300]
    choice = _strict_json(body)["choices"][0]  # strict: NaN or Infinity would raise
    assert all(-9999.0 <= v <= 0.0 for v in choice["logprobs"]["token_logprobs"])


def test_bad_adapter_paths_are_400_and_linked_files_outside_the_root_403(
    served: tuple[str, CompletionServer], adapter_dir: Path, tmp_path: Path
) -> None:
    url, _ = served
    load = f"{url}/v1/load_lora_adapter"
    for path in (
        str(adapter_dir / "go\x00od"),
        str(adapter_dir / ("n" * 300)),
        str(adapter_dir / ("n" * 300) / "x"),
    ):
        r = httpx.post(load, json={"lora_name": "x", "lora_path": path}, headers=AUTH)
        assert r.status_code == 400, (path[-40:], r.text)
        assert r.json()["error"]["type"] == "BadRequestError"
    # a folder inside the root whose weights file links to a file outside it
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dir / "good", outside)
    linked = adapter_dir / "linked-weights"
    linked.mkdir()
    try:
        shutil.copy(adapter_dir / "good" / "adapter_config.json", linked / "adapter_config.json")
        (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
        r = httpx.post(load, json={"lora_name": "linked", "lora_path": str(linked)}, headers=AUTH)
        assert r.status_code == 403, r.text
        assert "adapter_model.safetensors" in r.json()["error"]["message"]
        assert "linked" not in [
            m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
        ]
    finally:
        shutil.rmtree(linked)
