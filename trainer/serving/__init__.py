"""Serving on its own: the sampler server ``twin serve`` and the decoding engine the trainer shares.

By layer, each module importing only those above it here:

- ``api.py``: the API contract (errors, resource limits, request bodies);
- ``kvcache.py``: the engine's KV buffers and the prefix store;
- ``engine.py``: batched decoding, the one path of the server, :class:`trainer.samplers.HFSampler`
  and ``hf:`` policies;
- ``lora.py``: LoRA adapter slots (load, unload, activate; a failed load changes nothing);
- ``completions.py``: the completions server (request queue, batching worker, vLLM's answers);
- ``http.py``: the HTTP layer and its hardening (API key, body, connection and time limits);
- ``process.py``: a server in a child process (``twin serve`` and the vLLM launcher
``trainer/vllm.py``);
- ``cli.py`` / ``__main__.py``: the entry point, ``serve(...)`` and ``python -m trainer.serving``.

Nothing is imported here, so ``import trainer.serving.process`` does not load torch.
"""
