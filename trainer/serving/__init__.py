"""Serving on its own: the sampler server ``twin serve`` and the decoding engine the trainer shares.

By layer, each importing only those below it:

- ``engine.py``: batched decoding, the one path of the server, :class:`trainer.samplers.HFSampler`
  and ``hf:`` policies, over the KV buffers and prefix store of ``kvcache.py``;
- ``lora.py``: LoRA adapter slots (load, unload, activate; a failed load changes nothing);
- ``api.py``: the API contract (errors, resource limits, request bodies);
- ``completions.py``: the completions server (request queue, batching worker, vLLM's answers);
- ``http.py``: the HTTP layer and its hardening (API key, body, connection and time limits);
- ``process.py``: a server in a child process (``twin serve`` and the vLLM launcher ``trainer/vllm.py``);
- ``cli.py`` / ``__main__.py``: the entry point, ``serve(...)`` and ``python -m trainer.serving``.

Nothing is imported here, so ``import trainer.serving.process`` does not load torch.
"""
