"""The weight-sync check of the async trainer: learner and sampler score the same tokens.

After each sync the learner scores a fixed token sequence (the split's first case prompt,
:func:`probe_sequence`) with the weights it just published, and the sampler scores it with
``policy@<version>`` (``prompt_logprobs``); ``async/logprob_mismatch`` is the mean absolute
difference over the last :data:`PROBE_POSITIONS` positions. An adapter that never reached the
sampler shows as a large mismatch; a sampler that answered with another model is an
:class:`trainer.workers.AdapterSyncError`.

The learner's side runs on the caller's thread, between updates, so it sees exactly the weights of
the version; the sampler's side runs on a background thread (after the version's load, when that is
in flight), so a slow server does not hold up the next update.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx

from trainer.learner import TrainBatch
from trainer.protocols import PolicyLearner
from trainer.samplers import SamplerError
from trainer.serving.http import auth_headers
from trainer.workers import AdapterSyncError, adapter_name
from twin.core import Twin
from twin.policies.http import tls_context

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.config import Recipe

__all__ = ["PROBE_MAX_TOKENS", "PROBE_POSITIONS", "SyncProbe", "probe_sequence"]

log = logging.getLogger("twinrl.trainer.async")

#: Positions of the probe sequence whose logprobs are compared after each sync (the mismatch
#: metric).
PROBE_POSITIONS = 16
#: Longest probe sequence (the twin's first prompt, cut here).
PROBE_MAX_TOKENS = 512


def probe_sequence(twin: Twin, tokenizer: PreTrainedTokenizerBase, cfg: Recipe) -> list[int]:
    """The token sequence both sides score: the first prompt of the recipe's split, as the learner
    renders it."""
    from trainer.renderer import Renderer
    from twin.env import TwinEnv

    env = TwinEnv(twin)
    obs, info = env.reset(options={"split": cfg.twin.split, "index": 0})
    renderer = Renderer(tokenizer, info["tools"], chat_template=cfg.model.chat_template,
                        template_kwargs=cfg.model.template_kwargs)  # fmt: skip
    return list(renderer.start(obs))[:PROBE_MAX_TOKENS]


class SyncProbe:
    """Launches and collects the checks of published versions.

    Args:
        learner: Scores the sequence (``logprobs(TrainBatch)``, ``temperature``).
        ids: The probe sequence (:func:`probe_sequence`).
        root: ``() -> the sampler's root URL`` (it may move when a sampler restarts).
        transport: httpx transport of the sampler requests (tests pass ``httpx.MockTransport``).
    """

    def __init__(
        self,
        learner: PolicyLearner,
        ids: list[int],
        root: Callable[[], str],
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.learner = learner
        self.ids = list(ids)
        self.root = root
        self.transport = transport
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-sync-probe")
        self._running: list[
            tuple[int, Future[float]]
        ] = []  # (version, its sampler-side score), oldest first

    def launch(self, version: int, load: Future[float] | None = None) -> None:
        """Score the sequence with the learner now, and on the sampler once ``load`` (if any) is
        done.

        Both are raw logprobs (temperature 1), as ``prompt_logprobs`` are.
        """
        ids = self.ids
        if len(ids) < 2:
            return
        positions = list(range(max(1, len(ids) - PROBE_POSITIONS), len(ids)))
        batch = TrainBatch([ids], [[0] * len(ids)], [[0.0] * len(ids)], [0.0])
        temperature, self.learner.temperature = self.learner.temperature, 1.0
        try:
            row = self.learner.logprobs(batch)[0]
        finally:
            self.learner.temperature = temperature
        mine = [row[i] for i in positions]
        self._running.append(
            (version, self._pool.submit(self._after_load, load, version, positions, mine))
        )

    def _after_load(
        self, load: Future[float] | None, version: int, positions: list[int], mine: list[float]
    ) -> float:
        """:meth:`score` once the background load of ``version`` is done (NaN when it failed: that
        failure is the learner's to raise, not the probe's)."""
        if load is not None:
            try:
                load.result()
            except Exception:  # noqa: BLE001 - reported once, by the learner
                return float("nan")
        return self.score(version, positions, mine)

    def score(self, version: int, positions: list[int], mine: list[float]) -> float:
        """Mean |learner - sampler| logprob of the sequence at ``positions`` under adapter
        ``version``.

        Raises:
            SamplerError: the sampler could not be asked or refused.
            AdapterSyncError: the sampler answered with another model than ``policy@<version>``.
        """
        ids = self.ids
        name = adapter_name(version)
        body = {
            "model": name,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 1,
        }
        try:
            with httpx.Client(transport=self.transport, timeout=300, verify=tls_context(),
                              headers=auth_headers()) as client:  # fmt: skip
                response = client.post(f"{self.root()}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise SamplerError(
                f"sync probe of {name}: sampler unreachable ({type(exc).__name__}: {exc})"
            ) from exc
        if response.status_code != 200:
            raise SamplerError(
                f"sync probe of {name}: HTTP {response.status_code} {response.text[:300]}"
            )
        data = response.json()
        if data.get("model") != name:
            raise AdapterSyncError(
                f"the sampler answered a request for {name!r} with model {data.get('model')!r}: "
                "the adapter did "
                "not reach the sampler"
            )
        scored = data["choices"][0]["prompt_logprobs"]
        theirs = [float(scored[i][str(ids[i])]["logprob"]) for i in positions]
        return statistics.fmean(abs(a - b) for a, b in zip(mine, theirs))

    def collect(self, *, wait_below: int | None = None) -> tuple[float, int, int]:
        """The checks that completed since the last call, each reported once.

        Checks still running are left for a later call, except those of versions below
        ``wait_below``, which are waited for (None: wait for all). The train loop passes the
        step's own number, so a check is reported at most one step after its adapter's step and
        waits only when it took longer than a whole step.

        Returns:
            ``(worst mismatch, newest version checked, checks completed)``; ``(NaN, -1, 0)`` when
            none completed (a failed check counts, as NaN, and is logged).

        Raises:
            AdapterSyncError: the sampler answered a check with another model than the adapter.
        """
        done: list[tuple[int, float]] = []
        running: list[tuple[int, Future[float]]] = []
        for version, future in self._running:
            if wait_below is None or version < wait_below or future.done():
                done.append((version, self._value(version, future)))
            else:
                running.append((version, future))
        self._running = running
        if not done:
            return float("nan"), -1, 0
        finite = [m for _, m in done if math.isfinite(m)]
        return (max(finite) if finite else float("nan")), max(v for v, _ in done), len(done)

    @staticmethod
    def _value(version: int, future: Future[float]) -> float:
        try:
            return future.result(timeout=600)
        except AdapterSyncError:
            raise
        except (SamplerError, KeyError, IndexError, TypeError, ValueError, TimeoutError) as exc:
            log.warning("sync probe of %s failed: %s", adapter_name(version), exc)
            return float("nan")

    def close(self) -> None:
        """Stop the background thread (checks not started are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
