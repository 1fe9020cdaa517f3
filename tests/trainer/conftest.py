"""Fixtures shared by the trainer tests: GRPO-shaped batches, the tiny model made trainable, and the
fakes the async trainer is built with (a stub learner, a mock sampler server, an in-memory
rollout side)."""

from __future__ import annotations

import json
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from trainer.learner import TrainBatch, build_lora_model
from trainer.models import load_model


def _wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.01)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """``wait_until(condition, what, timeout=30.0)``: poll until ``condition()`` holds; an
    AssertionError naming ``what`` when it does not within ``timeout`` seconds. Tests wait on the
    state they assert about, never on a fixed sleep (a slow host would skip the check)."""
    return _wait_until


def make_grouped_batch(seed: int = 1, groups: int = 3, group_size: int = 4) -> TrainBatch:
    """GRPO-shaped rows: a prompt per group, completions of varied length, some multi-turn."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(5, 700, (n,), generator=g).tolist()

    ids, masks, lps, adv = [], [], [], []
    for grp in range(groups):
        prompt = rand(20 + 7 * grp)
        for k in range(group_size):
            first = rand(3 + (5 * k + grp) % 9)
            tool, second = (rand(4), rand(2)) if k % 2 else ([], [])
            ids.append(prompt + first + tool + second)
            mask = [0] * len(prompt) + [1] * len(first) + [0] * len(tool) + [1] * len(second)
            masks.append(mask)
            lps.append([-6.0 if m else 0.0 for m in mask])
            adv.append(float(k) - 1.5)
    solo = list(range(10, 40))  # a row with a prompt of its own
    ids.append(solo)
    masks.append([0] * 25 + [1] * 5)
    lps.append([-6.0 if m else 0.0 for m in masks[-1]])
    adv.append(0.7)
    return TrainBatch(ids, masks, lps, adv)


def make_trainable_tiny(lora: bool) -> Any:
    """The tiny model with a LoRA adapter on q/v, or with every weight trainable."""
    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    if lora:
        return build_lora_model(
            model, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        )
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def check_greedy_turns(
    model: Any, tok: Any, prompts: list[list[int]], results: list[list[int]], max_new_tokens: int
) -> None:
    """Two greedy turns through ``HFSampler(prefix_cache=True)``, each row's next prompt adding
    its sample and its ``results`` entry; every sampled token must be the argmax of, and its
    logprob within 1e-4 of, an uncached teacher-forced forward pass."""
    from trainer.samplers import HFSampler

    sampler = HFSampler(model, tok, prefix_cache=True)
    for _ in range(2):
        samples = sampler.sample(
            prompts, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=[5], seed=0
        )
        for prompt, s in zip(prompts, samples, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + s.ids])).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.ids)[:, None])
            assert logits.argmax(-1).tolist() == s.ids
            assert torch.allclose(torch.tensor(s.logprobs), want[:, 0], atol=1e-4)
        prompts = [p + s.ids + r for p, s, r in zip(prompts, samples, results, strict=True)]


def sample_turns(
    sampler: Any,
    prompts: list[list[int]],
    results: list[list[int]],
    max_new_tokens: list[int],
    temperature: float = 1.0,
) -> list[list[Any]]:
    """Three turns of a batch of episodes, seeded per turn: each row's next prompt is its prompt,
    its sample and its ``results`` entry (a tool result of the row's own length)."""
    out = []
    for turn in range(3):
        samples = sampler.sample(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=[5, 6],
            seed=turn,
        )  # fmt: skip
        out.append(samples)
        prompts = [p + s.ids + r for p, s, r in zip(prompts, samples, results, strict=True)]
    return out


@pytest.fixture(scope="session")
def turns() -> Callable[..., list[list[Any]]]:
    """:func:`sample_turns`, as a fixture."""
    return sample_turns


@pytest.fixture(scope="session")
def greedy_turns() -> Callable[..., None]:
    """:func:`check_greedy_turns`, as a fixture."""
    return check_greedy_turns


@pytest.fixture(scope="session")
def grouped_batch() -> Callable[..., TrainBatch]:
    """:func:`make_grouped_batch`: ``grouped_batch(seed=1, groups=3, group_size=4)``."""
    return make_grouped_batch


@pytest.fixture(scope="session")
def trainable_tiny() -> Callable[[bool], Any]:
    """:func:`make_trainable_tiny`: ``trainable_tiny(lora)``, a fresh model each call."""
    return make_trainable_tiny


# -- fakes of the async trainer's collaborators ----------------------------------------------------
class StubLearner:
    """A learner that counts updates, saves empty adapters and scores every token -0.75.

    The mock sampler scores -0.5, so a probe's mismatch is 0.25. ``step_hook`` runs inside each
    update (tests use it to interleave events with learning).
    """

    temperature = 1.0

    def __init__(self, step_hook: Callable[[int], None] | None = None) -> None:
        self.steps = 0
        self.version = 0
        self.saved: list[Path] = []
        self.step_hook = step_hook

    def step(self, batch: Any) -> dict[str, float]:
        assert len(batch) == 2
        if self.step_hook is not None:
            self.step_hook(self.steps)
        self.steps += 1
        self.version += 1
        return {"losses/loss": 0.5, "perf/learner_s": 0.01}

    def save_adapter(self, path: Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text("{}")
        self.saved.append(path)
        return path

    def logprobs(self, batch: Any) -> list[list[float]]:
        return [[0.0] + [-0.75] * (len(batch.input_ids[0]) - 1)]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.version = int(state["steps"]), int(state["version"])


class MockSamplerServer:
    """A sampler server behind an ``httpx.MockTransport``: loads adapters (after ``load_delay`` s),
    serves only loaded ones (404 otherwise, as vLLM and twin serve do), answers probes with -0.5 per
    token, and ``/health`` while ``server`` (a :class:`FakeManagedServer`) is up.

    ``refuse``: the adapter whose load fails (HTTP 400; or, with ``server``, the server dies during
    that load, once). ``hold``: ``{adapter name: event}``, a probe of that adapter waits for the
    event (at most 10 s) and records in ``released`` whether it came.
    """

    def __init__(self, *, load_delay: float = 0.0, refuse: str | None = None, server: Any = None,
                 hold: dict[str, threading.Event] | None = None) -> None:  # fmt: skip
        self.loaded: set[str] = set()
        self.load_delay, self.refuse, self.server = load_delay, refuse, server
        self.hold = hold or {}
        self.released: list[bool] = []
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.probes: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        up = self.server is None or self.server.up
        if path.endswith("/health"):
            if not up:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, text="ok")
        body = json.loads(request.content or b"{}")
        if path.endswith("/load_lora_adapter"):
            name = body["lora_name"]
            self.loads.append(name)
            time.sleep(self.load_delay)
            if name == self.refuse:
                if self.server is not None:  # the server dies during this load (once)
                    self.server.up, self.refuse = False, None
                    raise httpx.ConnectError("connection refused", request=request)
                return httpx.Response(400, text=f"cannot load {name}: rank 64 > --max-lora-rank 16")
            self.loaded.add(name)
            return httpx.Response(200, text="Success")
        if path.endswith("/unload_lora_adapter"):
            self.unloads.append(body["lora_name"])
            return httpx.Response(200, text="Success")
        if body["model"] not in self.loaded:
            return httpx.Response(404, json={"error": f"model {body['model']} not found"})
        if body["model"] in self.hold:
            self.released.append(self.hold[body["model"]].wait(timeout=10))
        self.probes.append(body["model"])
        ids = body["prompt"]
        scored = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in ids[1:]]
        choice = {
            "index": 0,
            "token_ids": [7],
            "prompt_logprobs": scored,
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"model": body["model"], "choices": [choice]})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


class FakeManagedServer:
    """A managed sampler server's interface (start / stop / alive / log), with no process."""

    url = "http://sampler"
    process = None

    def __init__(self, log_path: Path, *, stays_dead: bool = False, log: str = "") -> None:
        self.log_path = log_path
        self.up = not stays_dead
        self.stays_dead = stays_dead
        self.starts = 0
        self.log = log

    def alive(self) -> bool:
        return self.up

    def start(self) -> FakeManagedServer:
        self.starts += 1
        self.up = not self.stays_dead
        return self

    def stop(self) -> None:
        self.up = False

    def log_tail(self, lines: int = 40) -> str:
        return self.log


class InMemoryRollout:
    """A rollout launcher with no worker process: the lots given (or put later) on an in-memory
    queue.

    Attributes:
        side: The :class:`trainer.async_trainer.RolloutSide` handed to the trainer (after setup).
    """

    def __init__(self, lots: list[Any] = (), *, events: list[Any] = (), server: Any = None) -> None:  # type: ignore[assignment]
        self.lots, self.events, self.server = list(lots), list(events), server
        self.side: Any = None

    def __call__(self, trainer: Any) -> Any:
        from trainer.async_trainer import RolloutSide
        from trainer.workers import SharedState

        shared = SharedState(multiprocessing.get_context("spawn"))
        shared.update(published=-1, claimed=trainer.step, consumed=trainer.lots_used)
        lots: queue.Queue[Any] = queue.Queue()
        for lot in self.lots:
            lots.put(lot)
        events: queue.Queue[Any] = queue.Queue()
        for event in self.events:
            events.put(event)
        self.side = RolloutSide(
            shared=shared, lots=lots, events=events, base_url="http://sampler", server=self.server
        )
        return self.side


def make_lot(index: int, version: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> Any:
    """A lot of one two-episode group sampled by ``version`` (its rewards differ: it is kept)."""
    from trainer.workers import Lot
    from twin.trajectory import Group, TokenTurn, Trajectory

    trajs = []
    for r in rewards:
        turn = TokenTurn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.5, -0.25])
        trajs.append(
            Trajectory(
                twin="Toy",
                case_id="Toy/train/0",
                reward=r,
                components={"correct": r},
                token_turns=[turn],
                completion_tokens=2,
                num_turns=1,
                info={"shaped_reward": r, "episode_tokens": 5},
            )
        )
    group = Group(case_id="Toy/train/0", trajectories=trajs, policy_version=version)
    return Lot(
        index=index,
        version=version,
        cursor=index + 1,
        groups=[group.model_dump_json()],
        kept=[0],
        stats={
            "batch/groups": 1.0,
            "rollout_s": 0.5,
            "sampled_tokens": 4.0,
            "worker_idle_s": 0.25,
            "worker_wall_s": 1.0,
        },
    )


def make_async_trainer(
    tmp_path: Path,
    k: int,
    lots: list[Any],
    steps: int,
    *,
    sampler: MockSamplerServer | None = None,
    server: Any = None,
    events: list[Any] = (),
    overrides: list[str] = (),  # type: ignore[assignment]
    on_step: Callable[[dict[str, Any]], None] | None = None,
    learner: Any = None,
    setup: bool = True,
) -> tuple[Any, MockSamplerServer, InMemoryRollout]:
    """An :class:`trainer.async_trainer.AsyncTrainer` of the toy recipe
    built with fakes (set up)."""
    from trainer.async_trainer import AsyncTrainer
    from trainer.config import load_recipe

    cfg = load_recipe(
        "toy-cpu",
        [
            "lora.enabled=true",
            f"async.max_staleness={k}",
            f"train.steps={steps}",
            "train.checkpoint_every=0",
            f"train.output_dir={tmp_path}",
            "train.store=false",
            "train.log=[jsonl]",
            *overrides,
        ],
    )
    sampler = sampler or MockSamplerServer(server=server)
    rollout = InMemoryRollout(lots, events=events, server=server)
    trainer = AsyncTrainer(
        cfg,
        learner=learner or StubLearner(),
        launcher=rollout,
        transport=sampler.transport(),
        on_step=on_step,
    )
    if setup:
        trainer.setup()
    return trainer, sampler, rollout


@pytest.fixture
def async_fakes() -> Any:
    """The async trainer's fakes: ``async_fakes.trainer(...)`` (:func:`make_async_trainer`),
    ``.lot``, ``.Sampler``, ``.Server``, ``.Learner``."""
    from types import SimpleNamespace

    made: list[Any] = []

    def trainer(*args: Any, **kwargs: Any) -> tuple[Any, MockSamplerServer, InMemoryRollout]:
        result = make_async_trainer(*args, **kwargs)
        made.append(result[0])
        return result

    yield SimpleNamespace(
        trainer=trainer,
        lot=make_lot,
        Sampler=MockSamplerServer,
        Server=FakeManagedServer,
        Learner=StubLearner,
    )
    for t in made:  # the load / probe threads
        t.stop_workers()


#: The toy LoRA learning runs (the async and the Ray acceptance tests): toy-lora-cpu.yaml's seed 2
#: crosses 0.8 at step ~80 at k = 0 and k = 1 alike; 110 steps leave a margin.
TOY_LEARN_SEED = 2
TOY_LEARN_STEPS = 110


def toy_lora_trainer(output_dir: Path, k: int, sets: tuple[str, ...] = ()) -> Any:
    """The trainer of toy-lora-cpu.yaml (seed 2, :data:`TOY_LEARN_STEPS` steps, staleness ``k``)
    into ``output_dir``: the local backend's, or the Ray backend's where ``sets`` say
    ``backend=ray``. Not set up: the caller runs ``setup``, ``train`` and ``cleanup``."""
    from trainer.async_trainer import AsyncTrainer
    from trainer.config import load_recipe

    cfg = load_recipe(
        "toy-lora-cpu",
        [
            f"seed={TOY_LEARN_SEED}",
            f"async.max_staleness={k}",
            f"train.steps={TOY_LEARN_STEPS}",
            "train.checkpoint_every=0",
            f"train.output_dir={output_dir}",
            "train.store=false",
            *sets,
        ],
    )
    if cfg.backend == "ray":
        from trainer.ray_backend import RayTrainer

        return RayTrainer(cfg)
    return AsyncTrainer(cfg)


@pytest.fixture(scope="session")
def toy_lora_local(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[Any]]:
    """``toy_lora_local(k)``: the history of the local toy LoRA run at staleness ``k``, trained
    once per session: the async test compares k = 1 with k = 0, and the Ray test compares its run
    with the same local k = 1 run, so the slow suite trains it once."""
    histories: dict[int, list[Any]] = {}

    def history(k: int) -> list[Any]:
        if k not in histories:
            trainer = toy_lora_trainer(tmp_path_factory.mktemp(f"toy-lora-k{k}"), k)
            try:
                trainer.setup()
                histories[k] = trainer.train()
            finally:
                trainer.cleanup()
        return histories[k]

    return history
