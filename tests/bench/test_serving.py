"""bench/serving.py: both HTTP stacks answer the same bytes for the same requests, and the
benchmark measures each (no timing asserted: the figures are for the report)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from bench.serving import BODY, FakeCore, asgi_app, main, measure
from trainer.serving.http import make_http_server
from twin.errors import ConfigError

pytest.importorskip("fastapi")


def _served(api_key: str | None):
    httpd = make_http_server(FakeCore(), "127.0.0.1", 0, api_key=api_key)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, httpx.Client(base_url=f"http://127.0.0.1:{httpd.server_address[1]}")


@pytest.mark.parametrize("api_key", [None, "k"])
def test_the_fastapi_candidate_answers_what_the_served_layer_answers(api_key: str | None) -> None:
    from fastapi.testclient import TestClient

    httpd, served = _served(api_key)
    candidate = TestClient(asgi_app(FakeCore(), api_key=api_key))
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        requests = [
            ("POST", "/v1/completions", BODY, auth),
            ("POST", "/v1/completions", {**BODY, "n": 0}, auth),  # invalid: 400 naming the field
            ("POST", "/v1/completions", [1, 2], auth),  # not an object
            ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, auth),
            ("GET", "/v1/models", None, auth),
            ("GET", "/health", None, {}),
            ("GET", "/v1/models", None, {"Authorization": "Bearer wrong"}),
        ]
        for method, path, body, headers in requests:
            a = served.request(method, path, json=body, headers=headers)
            b = candidate.request(method, path, json=body, headers=headers)
            assert a.status_code == b.status_code, (path, body, headers, a.text, b.text)
            if path == "/v1/models" and headers.get("Authorization") == "Bearer wrong":
                assert a.status_code == (401 if api_key else 200)
                continue  # the 401 texts differ in wording
            assert a.content == b.content or a.json() == b.json(), (path, a.text, b.text)
        answer = json.loads(served.post("/v1/completions", json=BODY, headers=auth).content)
        assert answer["choices"][0]["token_ids"] == [5, 6, 7, 8]
    finally:
        served.close()
        httpd.shutdown()
        httpd.server_close()


def test_the_benchmark_measures_each_stack_and_prints_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = main(("twin-serve", "fastapi"), clients=2, seconds=0.3, rounds=1)
    assert set(results) == {"twin-serve", "fastapi"}
    assert all(r.requests > 0 and r.requests_per_s > 0 and r.p50_ms > 0 for r in results.values())
    out = capsys.readouterr().out
    assert "req/s" in out and "vs twin-serve" in out


def test_the_benchmark_refuses_unknown_stacks_and_counts() -> None:
    with pytest.raises(ConfigError, match="stacks from"):
        measure(("nginx",))
    with pytest.raises(ConfigError, match="clients and rounds >= 1"):
        measure(("twin-serve",), clients=0)
