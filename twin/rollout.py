"""Rollouts: run policies against a twin concurrently, and measure them.

One process runs thousands of episodes at once: every episode is a coroutine that awaits its
policy (an HTTP model server, a local sampler, a script) and steps its own :class:`TwinEnv`;
a semaphore bounds how many are live. Tools that block (``Twin.blocking_tools``) run in a
thread pool so the event loop never waits on them::

    cases = [("test", i) for i in range(50)]
    groups = run_episodes(twin, RandomPolicy(seed=0), cases, group_size=4)
    print(summarize(groups, success=success_fn(twin)))

Metrics: :func:`pass_at_k` (the unbiased estimator of Chen et al., 2021: the chance that at
least one of k samples succeeds) and :func:`pass_hat_k` (tau-bench's pass^k: the chance that all
k succeed), both from n samples of which c succeeded; :func:`summarize` reports them beside the
mean reward, every reward component and per-case-kind figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from twin.protocols import Policy, policy_for_episode
from twin.trajectory import Group, Trajectory

if TYPE_CHECKING:
    from twin.core import Twin
    from twin.env import TwinEnv

__all__ = [
    "Group",
    "Trajectory",
    "arun_episodes",
    "error_reasons",
    "max_reward",
    "pass_at_k",
    "pass_hat_k",
    "progress_bar",
    "run_episodes",
    "storable",
    "success_fn",
    "summarize",
]

CaseRef = tuple[str, int]
OnGroup = Callable[[Group], Any]

#: Extra turns allowed past ``max_turns`` before the runner gives up on an env that never ends.
_TURN_SLACK = 4
#: Seconds between refreshes of the progress bar's live figures.
_PROGRESS_TICK_S = 1.0
#: Characters of an error message kept in a summary's reason table.
_REASON_CHARS = 160


# -- runner ------------------------------------------------------------------------------------
async def arun_episodes(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    *,
    group_size: int = 1,
    concurrency: int = 64,
    progress: bool = True,
    on_group: OnGroup | None = None,
) -> list[Group]:
    """Run ``group_size`` episodes of ``policy`` on every case, at most ``concurrency`` at once.

    Args:
        twin: The :class:`twin.core.Twin` (one instance; its world is shared by all episodes).
        policy: The policy; if it has ``for_episode(key)``, each episode acts through
            ``policy.for_episode("<case id>#<k>")``.
        cases: ``(split, index)`` pairs.
        group_size: Episodes per case (a GRPO group; k of pass@k goes up to it).
        concurrency: Most episodes in flight.
        progress: Show a progress bar on stderr.
        on_group: Called with each :class:`Group` as soon as its episodes are done (a plain
            function or a coroutine function), e.g. to write it to the run store.

    Returns:
        One group per case, in the order of ``cases``; trajectories in episode order. An episode
        whose policy (or env) raised keeps its partial trajectory, unscored (``reward`` None),
        with the error in ``info["error"]`` (``"Type: message"``), ``info["error_type"]``,
        ``info["error_turn"]`` (the 1-based turn it failed on) and, when the exception has a
        ``hint`` (what to change), ``info["error_hint"]``; the other episodes are not affected.
        So is an episode whose trajectory cannot be stored as JSON (say, the model wrote a lone
        surrogate): its strings are made storable and it is recorded as errored.

    The progress bar shows episodes done and, live, turns done, errors and what the policy
    reports through an optional ``progress() -> dict`` (the ``openai:`` policy: requests in
    flight, tokens received, retries).
    """
    from twin.env import TwinEnv  # the env imports the registry; keep `import twin.rollout` light

    cases = _checked_cases(twin, cases, group_size, concurrency)
    blocking = twin.blocking_tools
    max_turns = twin.config.max_turns + _TURN_SLACK
    semaphore = asyncio.Semaphore(concurrency)
    pool: list[TwinEnv] = []
    results: list[list[Trajectory | None]] = [[None] * group_size for _ in cases]
    remaining = [group_size] * len(cases)
    desc = f"{twin.name} x {policy.name}"
    bar = progress_bar(len(cases) * group_size, enabled=progress, desc=desc)
    counts = {"turns": 0, "errors": 0}

    def refresh() -> None:
        if bar is not None:
            bar.set_postfix(_progress_figures(counts, policy), refresh=True)

    async def episode(ci: int, k: int) -> None:
        split, index = cases[ci]
        async with semaphore:
            # Envs are reused (reset gives each episode a fresh Trajectory): at most
            # `concurrency` of them are ever built.
            env = pool.pop() if pool else TwinEnv(twin)
            try:
                traj = await _run_one(env, policy, split, index, k, blocking, max_turns, counts)
            finally:
                pool.append(env)
        if "error" in traj.info:
            counts["errors"] += 1
        results[ci][k] = traj
        if bar is not None:
            bar.update(1)
            refresh()
        remaining[ci] -= 1
        if remaining[ci] == 0 and on_group is not None:
            outcome = on_group(_group(results[ci]))
            if inspect.isawaitable(outcome):
                await outcome

    async with _ticking(bar, refresh):
        await asyncio.gather(
            *(episode(ci, k) for ci in range(len(cases)) for k in range(group_size))
        )
    return [_group(trajs) for trajs in results]


def _checked_cases(
    twin: Twin, cases: Sequence[CaseRef], group_size: int, concurrency: int
) -> list[CaseRef]:
    """The cases as ``(str, int)`` pairs; fails fast (CaseError) before any episode starts."""
    if group_size < 1 or concurrency < 1:
        raise ValueError(
            f"group_size and concurrency must be >= 1, got {group_size} and {concurrency}"
        )
    cases = [(str(split), int(index)) for split, index in cases]
    for split, index in cases:
        twin.case(split, index)
    return cases


@contextlib.asynccontextmanager
async def _ticking(bar: Any, refresh: Callable[[], None]) -> AsyncIterator[None]:
    """Refresh the progress bar every tick while the block runs, then close it."""

    async def ticker() -> None:
        # Between episode ends (minutes apart on a slow server) the bar still moves.
        while True:
            await asyncio.sleep(_PROGRESS_TICK_S)
            refresh()

    tick = asyncio.ensure_future(ticker()) if bar is not None else None
    try:
        yield
    finally:
        if tick is not None:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
        if bar is not None:
            bar.close()


def _progress_figures(counts: dict[str, int], policy: Policy) -> dict[str, Any]:
    figures: dict[str, Any] = {"turns": counts["turns"]}
    report = getattr(policy, "progress", None)
    if callable(report):
        try:
            figures.update(report())
        except Exception:  # noqa: BLE001, S110 - a progress figure is never worth an episode
            pass
    if counts["errors"]:
        figures["errors"] = counts["errors"]
    return figures


def run_episodes(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    *,
    group_size: int = 1,
    concurrency: int = 64,
    progress: bool = True,
    on_group: OnGroup | None = None,
) -> list[Group]:
    """Synchronous :func:`arun_episodes` (runs its own event loop; not from inside one)."""
    return asyncio.run(
        arun_episodes(
            twin,
            policy,
            cases,
            group_size=group_size,
            concurrency=concurrency,
            progress=progress,
            on_group=on_group,
        )
    )


async def _run_one(
    env: TwinEnv,
    policy: Policy,
    split: str,
    index: int,
    k: int,
    blocking: bool,
    max_turns: int,
    counts: dict[str, int] | None = None,
) -> Trajectory:
    start = time.perf_counter()
    policy_s = env_s = 0.0
    actor = policy
    info: dict[str, Any] = {}
    error: str | None = None
    failure: dict[str, Any] = {}
    turn = 0
    was_reset = False
    try:
        t0 = time.perf_counter()
        _, info = env.reset(options={"split": split, "index": index})
        was_reset = True
        env_s += time.perf_counter() - t0
        tools = info["tools"]
        actor = policy_for_episode(policy, f"{info['case_id']}#{k}")
        # `turn` outlives the loop: an exception reports the turn it failed on
        for turn in range(1, max_turns + 1):  # noqa: B007
            t0 = time.perf_counter()
            message = await actor.act(env.messages, tools)
            t1 = time.perf_counter()
            if blocking:
                _, _, terminated, truncated, info = await asyncio.to_thread(env.step, message)
            else:
                _, _, terminated, truncated, info = env.step(message)
            policy_s += t1 - t0
            env_s += time.perf_counter() - t1
            if counts is not None:
                counts["turns"] += 1
            if terminated or truncated:
                break
        else:
            error = f"RuntimeError: the env did not end the episode within {max_turns} turns"
            failure = {"error_type": "RuntimeError", "error_turn": max_turns}
    except Exception as exc:  # one failing episode must not take the others down
        error, failure = _describe(exc, turn)
    traj: Trajectory | None = info.get("trajectory") if error is None else None
    if traj is None:
        # A pooled env still holds its previous episode until a reset succeeds.
        traj = _partial_trajectory(env if was_reset else None, _twin_name(env), split, index)
        traj.reward = None
    traj.policy = getattr(actor, "name", "") or policy.name
    traj.timings.update({"policy": policy_s, "env": env_s, "total": time.perf_counter() - start})
    if error is not None:
        traj.info["error"] = error
        traj.info.update(failure)
    return storable(traj)


def _describe(exc: BaseException, turn: int) -> tuple[str, dict[str, Any]]:
    """``"Type: message"`` and the structured fields of a failed episode."""
    name = type(exc).__name__
    message = str(exc).strip()
    failure: dict[str, Any] = {"error_type": name, "error_turn": turn}
    cause = getattr(exc, "cause", None)
    if not isinstance(cause, str) and exc.__cause__ is not None:
        cause = type(exc.__cause__).__name__
    if isinstance(cause, str) and cause:
        failure["error_cause"] = cause
    hint = getattr(exc, "hint", None)
    if isinstance(hint, str) and hint:
        failure["error_hint"] = hint
    return (f"{name}: {message}" if message else name), failure


def storable(traj: Trajectory) -> Trajectory:
    """``traj`` if it serializes to JSON, else a copy whose strings are made encodable, marked
    as an error (the run store and every JSON consumer need UTF-8; a lone surrogate such as
    ``"\\ud800"`` from a model's output is not)."""
    try:
        traj.model_dump_json()
        return traj
    except Exception as exc:  # noqa: BLE001 - pydantic wraps the UnicodeEncodeError
        reason = str(exc).splitlines()[0]
    data = _encodable(traj.model_dump(mode="python"))
    fixed = Trajectory.model_validate(data)
    fixed.reward = None
    if "error" not in fixed.info:
        fixed.info["error"] = (
            f"UnserializableTrajectory: the episode's text cannot be stored as JSON ({reason}); "
            "offending characters are kept as backslash escapes"
        )
        fixed.info["error_type"] = "UnserializableTrajectory"
        fixed.info["error_turn"] = fixed.num_turns
    return fixed


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encodable(v) for v in value]
    return value


def _twin_name(env: TwinEnv) -> str:
    return str(getattr(env.twin, "name", "?"))


def _partial_trajectory(env: TwinEnv | None, name: str, split: str, index: int) -> Trajectory:
    traj = getattr(env, "trajectory", None) if env is not None else None
    if isinstance(traj, Trajectory):
        return traj.model_copy(deep=True)
    return Trajectory(twin=name, case_id=f"{name}/{split}/{index}", split=split, index=index)


def _group(trajs: Sequence[Trajectory | None]) -> Group:
    done = [t for t in trajs if t is not None]
    return Group(case_id=done[0].case_id if done else "", trajectories=done)


def progress_bar(total: int, *, enabled: bool, desc: str) -> Any:
    """A tqdm bar on stderr counting episodes (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="ep", dynamic_ncols=True, leave=False)


# -- metrics -----------------------------------------------------------------------------------
def _check_nck(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: ``1 - C(n-c, k) / C(n, k)``.

    The chance that at least one of k samples drawn without replacement succeeds (Chen et al.,
    2021, "Evaluating Large Language Models Trained on Code").

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    _check_nck(n, c, k)
    total = math.comb(n, k)
    # One division of exact integers: correctly rounded (1 - a/b would lose the last bit).
    return (total - math.comb(n - c, k)) / total


def pass_hat_k(n: int, c: int, k: int) -> float:
    """tau-bench's pass^k from n samples with c successes: ``C(c, k) / C(n, k)``.

    The chance that all of k samples drawn without replacement succeed: reliability, where
    pass@k measures capability.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    _check_nck(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def max_reward(twin: Twin) -> float:
    """The most an episode of ``twin`` can score: the reward's upper bound, else 1.0.

    Reads ``reward.bounds`` (``rewards.Reward``: term bounds within the clip), then
    ``reward.clip``, then a ``max_reward`` attribute of the reward or the twin.
    """
    reward = inspect.getattr_static(twin, "reward", None)
    for attr in ("bounds", "clip"):
        pair = getattr(reward, attr, None)
        if isinstance(pair, (tuple, list)) and len(pair) == 2 and _is_number(pair[1]):
            return float(pair[1])
    for owner in (reward, twin):
        value = getattr(owner, "max_reward", None)
        if _is_number(value):
            return float(value)
    return 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def success_fn(twin: Twin, threshold: float | None = None) -> Callable[[Trajectory], bool]:
    """How ``twin`` decides success: :meth:`Twin.success` where it answers, else a threshold.

    Args:
        twin: The twin.
        threshold: Success when ``reward >= threshold`` (the twin's own rule is not asked);
            default ``max_reward(twin) - 1e-6``.
    """
    if threshold is not None:
        return lambda t: t.reward is not None and t.reward >= threshold
    limit = max_reward(twin) - 1e-6

    def ok(t: Trajectory) -> bool:
        if t.reward is None:
            return False
        own = twin.success(t)
        return t.reward >= limit if own is None else bool(own)

    return ok


def summarize(
    groups: Iterable[Group],
    *,
    success: Callable[[Trajectory], bool] | None = None,
    success_threshold: float | None = None,
) -> dict[str, Any]:
    """Figures for a set of groups.

    Episodes whose policy raised (``info["error"]``) are counted under ``errors`` and left out
    of every other figure.

    Args:
        groups: Groups from :func:`run_episodes`.
        success: Decides a successful episode (see :func:`success_fn`); default
            ``reward >= success_threshold``.
        success_threshold: Used when ``success`` is None; default ``1.0 - 1e-6``.

    Returns:
        ``episodes``, ``errors``, ``groups``, ``group_size`` (smallest group), ``reward_mean``,
        ``reward_std`` (population), ``success_rate``, ``components`` (mean of each),
        ``pass@k`` and ``pass^k`` (``{"1": .., ..., str(group_size): ..}``, averaged over groups),
        ``mean_turns``, ``invalid_calls`` (mean per episode), ``invalid_calls_total``,
        ``terminated_rate``, ``truncated_rate``, ``by_kind`` (``{kind: {episodes, reward_mean,
        success_rate}}``), ``timings`` (mean seconds per episode of policy, env, total) and
        ``error_reasons`` (see :func:`error_reasons`).
    """
    if success is None:
        limit = 1.0 - 1e-6 if success_threshold is None else success_threshold
        success = lambda t: t.reward is not None and t.reward >= limit  # noqa: E731
    groups = list(groups)
    all_trajs = [t for g in groups for t in g.trajectories]
    trajs = [t for t in all_trajs if "error" not in t.info]
    rewards = [t.reward if t.reward is not None else 0.0 for t in trajs]
    ok = [bool(success(t)) for t in trajs]
    oks = {id(t): o for t, o in zip(trajs, ok, strict=True)}
    sizes = [sum(1 for t in g.trajectories if "error" not in t.info) for g in groups]
    sizes = [n for n in sizes if n > 0]
    kmax = min(sizes) if sizes else 0

    comp_values: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for name, value in t.components.items():
            comp_values[name].append(float(value))
    pass_at, pass_hat = _pass_figures(groups, oks, kmax)
    n = len(trajs)
    return {
        "episodes": n,
        "errors": len(all_trajs) - n,
        "groups": len(groups),
        "group_size": kmax,
        "reward_mean": _mean(rewards),
        "reward_std": statistics.pstdev(rewards) if n > 1 else 0.0,
        "success_rate": _mean([float(o) for o in ok]),
        "components": {name: _mean(v) for name, v in sorted(comp_values.items())},
        "pass@k": pass_at,
        "pass^k": pass_hat,
        "mean_turns": _mean([float(t.num_turns) for t in trajs]),
        "invalid_calls": _mean([float(t.invalid_calls) for t in trajs]),
        "invalid_calls_total": sum(t.invalid_calls for t in trajs),
        "terminated_rate": _mean([float(t.terminated) for t in trajs]),
        "truncated_rate": _mean([float(t.truncated) for t in trajs]),
        "by_kind": _by_kind(trajs, rewards, ok),
        "timings": {
            key: _mean([float(t.timings.get(key, 0.0)) for t in trajs])
            for key in ("policy", "env", "total")
        },
        "error_reasons": error_reasons(all_trajs),
    }


def _pass_figures(
    groups: list[Group], oks: dict[int, bool], kmax: int
) -> tuple[dict[str, float], dict[str, float]]:
    """pass@k and pass^k for k = 1..kmax, each averaged over the groups' error-free episodes."""
    pass_at: dict[str, float] = {}
    pass_hat: dict[str, float] = {}
    counts = []
    for g in groups:
        valid = [t for t in g.trajectories if "error" not in t.info]
        if valid:
            counts.append((len(valid), sum(oks[id(t)] for t in valid)))
    for k in range(1, kmax + 1):
        pass_at[str(k)] = _mean([pass_at_k(n, c, k) for n, c in counts])
        pass_hat[str(k)] = _mean([pass_hat_k(n, c, k) for n, c in counts])
    return pass_at, pass_hat


def _by_kind(
    trajs: list[Trajectory], rewards: list[float], ok: list[bool]
) -> dict[str, dict[str, Any]]:
    """Episodes, mean reward and success rate per case kind, kinds sorted."""
    by_kind: dict[str, dict[str, Any]] = {}
    kinds: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        kinds[t.case_kind].append(i)
    for kind in sorted(kinds):
        idx = kinds[kind]
        by_kind[kind] = {
            "episodes": len(idx),
            "reward_mean": _mean([rewards[i] for i in idx]),
            "success_rate": _mean([float(ok[i]) for i in idx]),
        }
    return by_kind


def error_reasons(trajectories: Iterable[Trajectory]) -> list[dict[str, Any]]:
    """Why episodes failed: one row per (exception class, message excerpt), most common first.

    Each row: ``type`` (the exception class, with its cause when it has one: ``PolicyError
    (ReadTimeout)``), ``message`` (the start of its message, without the class name),
    ``count``, ``turns`` (the sorted turns they failed on; 0 is the reset) and
    ``hint`` (what to change, when the exception said; else None).
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for t in trajectories:
        error = t.info.get("error")
        if error is None:
            continue
        text_ = str(error)
        kind = str(t.info.get("error_type") or text_.partition(":")[0])
        message = text_[len(kind) + 2 :] if text_.startswith(kind + ": ") else text_
        cause = t.info.get("error_cause")
        if isinstance(cause, str) and cause:
            kind = f"{kind} ({cause})"
        message = " ".join(message.split())
        if len(message) > _REASON_CHARS:
            message = message[: _REASON_CHARS - 3] + "..."
        row = rows.setdefault(
            (kind, message),
            {"type": kind, "message": message, "count": 0, "turns": [], "hint": None},
        )
        row["count"] += 1
        turn = t.info.get("error_turn")
        if isinstance(turn, int) and turn not in row["turns"]:
            row["turns"].append(turn)
        hint = t.info.get("error_hint")
        if row["hint"] is None and isinstance(hint, str):
            row["hint"] = hint
    out = sorted(rows.values(), key=lambda r: (-r["count"], r["type"], r["message"]))
    for row in out:
        row["turns"].sort()
    return out


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0
