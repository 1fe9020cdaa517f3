"""The rollout settings take the sampler server's context (``/v1/models`` ``max_model_len``), so a
server with a context shorter than ``sampler.max_episode_tokens`` is never asked for more."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import torch

from trainer.workers import sampler_context_length


def _models(payload: object, status: int = 200) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=payload))


def test_context_length_from_vllm_and_twin_serve_model_cards() -> None:
    vllm = {
        "object": "list",
        "data": [{"id": "base", "max_model_len": 2048}, {"id": "policy@0", "max_model_len": 2048}],
    }
    assert sampler_context_length("http://x:1/v1", transport=_models(vllm)) == 2048
    serve = {"object": "list", "data": [{"id": "tiny", "owned_by": "twinrl", "max_model_len": 300}]}
    assert sampler_context_length("http://x:1", transport=_models(serve)) == 300
    # a server that does not say, or cannot be asked: no limit beyond the episode budget
    assert sampler_context_length("http://x:1", transport=_models({"data": [{"id": "m"}]})) is None
    assert (
        sampler_context_length("http://x:1", transport=_models({"error": "no"}, status=500)) is None
    )
    assert sampler_context_length("http://x:1", transport=_models(["not", "a", "dict"])) is None


def test_sync_trainer_stops_episodes_at_a_short_server_context(tmp_path: Path) -> None:
    """``twin serve`` with a context a few tokens past the prompt: the episode ends overlong at the
    context instead of the server refusing the request (HTTP 400)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.config import load_recipe
    from trainer.renderer import Renderer
    from trainer.serving.completions import CompletionServer
    from trainer.serving.http import make_http_server
    from trainer.sync_trainer import SyncTrainer
    from trainer.tiny import build_tiny
    from twin.env import TwinEnv
    from twin.registry import make_twin

    tiny = build_tiny()
    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    cfg_probe = load_recipe("toy-cpu")
    obs, info = TwinEnv(make_twin(cfg_probe.twin.name, **cfg_probe.twin.config)).reset(
        options={"split": cfg_probe.twin.split, "index": 0}
    )
    context = len(Renderer(tokenizer, info["tools"]).start(obs)) + 3
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    core = CompletionServer(model, tokenizer, model_name="tiny", max_loras=2, max_model_len=context)
    httpd = make_http_server(core, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    cfg = load_recipe(
        "toy-cpu",
        [
            "model.path=tiny",
            "model.dtype=float32",
            "lora.enabled=true",
            "lora.rank=4",
            "lora.alpha=8",
            "sampler.kind=server",
            f"sampler.base_url=http://127.0.0.1:{httpd.server_address[1]}/v1",
            "sampler.max_new_tokens=32",
            "sampler.max_episode_tokens=512",
            "sampler.length_curriculum=none",
            "algorithm.group_size=2",
            "algorithm.groups_per_step=1",
            "algorithm.dynamic_sampling=false",
            "train.steps=1",
            "train.checkpoint_every=0",
            "train.store=false",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    recipe = SyncTrainer(cfg)
    try:
        recipe.setup()
        assert recipe.settings.context_length == context
        sample = recipe.collect(0)
    finally:
        recipe.cleanup()
        httpd.shutdown()
        httpd.server_close()
        core.close()
    trajs = [t for g in sample.kept_groups for t in g.trajectories]
    assert trajs and all(t.info["episode_tokens"] <= context for t in trajs)
    assert all(t.completion_tokens <= 3 for t in trajs)
