"""The vLLM launcher builds the right command line and environment; start/stop with a stub server."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.config import load_recipe
from trainer.vllm import VLLMServer, vllm_lora_rank
from twin.errors import ConfigError, TwinError

RECIPE = {
    "seed": 3,
    "twin": {"name": "Catalog"},
    "model": {"path": "tiny", "dtype": "bfloat16"},
    "lora": {"rank": 64},
    "sampler": {"kind": "vllm", "temperature": 0.8, "max_episode_tokens": 8192},
    "devices": {"rollout": "cuda:0", "learner": "cuda:1"},
}


def _fake_venv(tmp_path: Path, behaviour: str = "ok") -> Path:
    """A folder with bin/python that runs a stub server (or fails) and records argv and env."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stub = tmp_path / "stub.py"
    stub.write_text(
        textwrap.dedent(f"""
        import json, os, sys, time
        from http.server import BaseHTTPRequestHandler, HTTPServer
        argv = sys.argv[1:]
        json.dump({{"argv": argv, "env": dict(os.environ)}}, open({str(tmp_path / "seen.json")!r}, "w"))
        print("INFO stub vllm starting", flush=True)
        if {behaviour!r} == "crash":
            print("ValueError: max_lora_rank too small", flush=True)
            sys.exit(3)
        if {behaviour!r} == "hang":
            time.sleep(60)
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
    """)
    )
    python = venv / "bin" / "python"
    python.write_text(
        f"#!/bin/sh\n# ignore '-m module' and run the stub\nshift 2\nexec {sys.executable} {stub} \"$@\"\n"
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return venv


def test_lora_rank_rounds_up_to_a_value_vllm_accepts() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 100, 512)] == [1, 8, 8, 16, 64, 128, 512]
    with pytest.raises(ConfigError, match="512"):
        vllm_lora_rank(513)


def test_command_line_and_environment_from_a_recipe(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("")
    server = VLLMServer.from_recipe(
        load_recipe(RECIPE),
        model="/models/qwen3-8b",
        python=venv,
        port=8123,
        gpu_memory_utilization=0.85,
    )
    argv = server.command()
    assert argv[:3] == [str(venv / "bin" / "vllm"), "serve", "/models/qwen3-8b"]
    assert "--enable-lora" in argv
    pairs = {
        a: argv[i + 1]
        for i, a in enumerate(argv[:-1])
        if a.startswith("--") and not argv[i + 1].startswith("--")
    }
    assert pairs["--port"] == "8123"
    assert pairs["--served-model-name"] == "policy"
    assert pairs["--max-lora-rank"] == "64"
    assert pairs["--max-loras"] == "2"
    assert pairs["--dtype"] == "bfloat16"
    assert pairs["--max-model-len"] == "8192"
    assert pairs["--logprobs-mode"] == "processed_logprobs"  # temperature 0.8
    assert pairs["--gpu-memory-utilization"] == "0.85"
    assert pairs["--seed"] == "3"
    env = server.environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_cpu_uses_the_module_entrypoint_and_raw_logprobs_at_t1(tmp_path: Path) -> None:
    server = VLLMServer(
        "/m",
        python=tmp_path / "py",
        device="cpu",
        dtype="float32",
        temperature=1.0,
        cpu_kv_cache_gib=2,
    )
    argv = server.command()
    assert argv[:5] == [
        str(tmp_path / "py"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
    ]
    assert "--logprobs-mode" not in argv  # raw (vLLM's default) equals processed at T=1, top_p=1
    assert "--gpu-memory-utilization" not in argv
    env = server.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert (
        VLLMServer("/m", python="py", device="cuda:1").environment()["CUDA_VISIBLE_DEVICES"] == "1"
    )
    assert "--logprobs-mode" in VLLMServer("/m", python="py", top_p=0.9).command()


def test_bad_arguments_say_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="python="):
        VLLMServer("/m", python=None)
    with pytest.raises(ConfigError, match="cpu"):
        VLLMServer("/m", python="py", device="tpu")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VLLMServer("/m", python="py", gpu_memory_utilization=1.5)


def test_start_waits_for_health_and_stop_ends_it(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    server = VLLMServer(
        "/m",
        python=venv,
        device="cpu",
        entrypoint="module",
        startup_timeout=30,
        log_path=tmp_path / "vllm.log",
    )
    with server:
        assert server.healthy()
        seen = json.loads((tmp_path / "seen.json").read_text())
        assert seen["argv"][seen["argv"].index("--port") + 1] == str(server.port)
        assert seen["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    assert not server.alive()
    assert "stub vllm starting" in server.log_tail()


def test_a_crash_at_start_raises_with_the_log_tail(tmp_path: Path) -> None:
    server = VLLMServer(
        "/m", python=_fake_venv(tmp_path, "crash"), device="cpu", startup_timeout=30
    )
    with pytest.raises(TwinError, match="exited with code 3") as info:
        server.start()
    assert "max_lora_rank too small" in str(info.value)


def test_a_server_that_never_gets_healthy_times_out_with_the_log_tail(tmp_path: Path) -> None:
    server = VLLMServer("/m", python=_fake_venv(tmp_path, "hang"), device="cpu", startup_timeout=2)
    with pytest.raises(TwinError, match="did not answer") as info:
        server.start()
    assert "stub vllm starting" in str(info.value)
    assert not server.alive()


@pytest.mark.integration
def test_vllm_cpu_serves_the_tiny_model_and_hot_loads_an_adapter(tmp_path: Path) -> None:
    """Against a real vllm-cpu (``$TWINRL_VLLM_PYTHON`` or ``.venv-vllm``): flags, status codes,
    and sampler logprobs equal to transformers + peft on the same tokens."""
    import os

    import httpx
    import torch

    venv = Path(os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm"))
    if not (venv.is_file() or (venv / "bin" / "python").exists()):
        pytest.skip(f"no vLLM environment at {venv}; set TWINRL_VLLM_PYTHON")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.tiny import build_tiny

    tiny = build_tiny()
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    server = VLLMServer(
        tiny, python=venv, device="cpu", dtype="float32", max_model_len=1024, max_lora_rank=8,
        served_model_name="tiny", startup_timeout=600, log_path=tmp_path / "vllm.log",
    )  # fmt: skip
    prompt = [1, 447, 201, 361, 223, 404, 223, 67, 2, 201, 1, 399, 201]
    with server, httpx.Client(base_url=server.url, timeout=120) as client:
        load = {"lora_name": "policy@1", "lora_path": str(tmp_path / "adapter")}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 400
        bad = {"lora_name": "policy@2", "lora_path": str(tmp_path / "nope")}
        assert client.post("/v1/load_lora_adapter", json=bad).status_code in (400, 404)
        body = {
            "model": "policy@1", "prompt": prompt, "max_tokens": 8, "logprobs": 1, "seed": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True,
        }  # fmt: skip
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        lps = torch.log_softmax(ref(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    expected = lps.gather(1, torch.tensor(choice["token_ids"])[:, None])[:, 0].tolist()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
