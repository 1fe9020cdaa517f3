"""Trajectory datasets: the episodes of any policy, as rows a supervised trainer can read.

``twin collect`` runs a policy through :func:`twin.evaluation.evaluate` (so the episodes are in
the run store too) and writes what it kept to a folder::

    <out>/episodes.jsonl   one JSON row per episode (the exact messages: what the trainer reads)
    <out>/hf/              the same rows as datasets.Dataset.save_to_disk (needs `datasets`)
    <out>/dataset.json     what was collected: twin, policy, split, run id, counts, min_reward

A row::

    {"messages": [...], "tools": [...], "reward": 1.0, "components": {...},
     "twin": "Returns", "case_id": "Returns/train/3", "split": "train", "index": 3,
     "case_kind": "within_window", "policy": "oracle", "run_id": 12, "num_turns": 2,
     "terminated": true, "truncated": false, "invalid_calls": 0}

``messages`` is the whole chat (prompt, assistant turns with their tool calls, tool results) in
OpenAI format, ``tools`` the twin's function schemas: rendering the row with a chat template gives
the episode's tokens. In the Hugging Face copy ``messages``, ``tools`` and ``components`` are JSON
text: Arrow gives every dict of a column the union of all their keys (a tool schema would gain
``null`` properties of the other tools'), which would change what a template renders.
:func:`read_dataset` reads either form back into the same rows.

::

    from twin.evaluation.collect import collect, read_dataset
    result = collect(twin, policy, [("train", i) for i in range(64)], out="runs/datasets/returns",
                     store=RunStore(), min_reward=0.9)
    rows = read_dataset(result.out)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.core import Twin
from twin.errors import ConfigError
from twin.protocols import Policy
from twin.rollout import CaseRef
from twin.store import RunStore
from twin.trajectory import Trajectory

__all__ = [
    "DATASET_JSONL",
    "HF_DIR",
    "META_FILE",
    "CollectResult",
    "collect",
    "default_out",
    "export_run",
    "read_dataset",
    "trajectory_row",
    "write_dataset",
]

#: File of the JSONL rows inside a dataset folder.
DATASET_JSONL = "episodes.jsonl"
#: Folder of the Hugging Face ``save_to_disk`` copy inside a dataset folder.
HF_DIR = "hf"
#: What was collected (twin, policy, split, run id, counts).
META_FILE = "dataset.json"
#: Columns stored as JSON text in the Hugging Face copy (see the module docstring).
JSON_COLUMNS = ("messages", "tools", "components")
#: How to get the Hugging Face copy when ``datasets`` is missing.
HF_HINT = (
    "pip install 'twinrl[integrations]' (the `datasets` package) to also write the Hugging Face "
    "format"
)


@dataclass
class CollectResult:
    """What :func:`collect` and :func:`export_run` wrote.

    Attributes:
        out: The dataset folder.
        rows: Rows written.
        episodes: Episodes looked at.
        dropped_reward: Episodes under ``min_reward`` (or unscored while one was given).
        dropped_failed: Episodes that ended with an error (never written).
        run_id: The run the episodes are stored under.
        jsonl: The JSONL file.
        hf: The Hugging Face folder, or None when ``datasets`` is not installed.
        note: Why there is no Hugging Face copy (None when there is one).
        summary: The evaluation's summary (:func:`collect` only).
    """

    out: Path
    rows: int
    episodes: int
    dropped_reward: int
    dropped_failed: int
    run_id: int | None
    jsonl: Path
    hf: Path | None = None
    note: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def trajectory_row(
    t: Trajectory, tools: Sequence[dict[str, Any]], *, run_id: int | None
) -> dict[str, Any]:
    """One dataset row of an episode (see the module docstring for the fields)."""
    return {
        "messages": [dict(m) for m in t.messages],
        "tools": [dict(s) for s in tools],
        "reward": t.reward,
        "components": dict(t.components),
        "twin": t.twin,
        "case_id": t.case_id,
        "split": t.split,
        "index": t.index,
        "case_kind": t.case_kind,
        "policy": t.policy,
        "run_id": run_id,
        "num_turns": t.num_turns,
        "terminated": t.terminated,
        "truncated": t.truncated,
        "invalid_calls": t.invalid_calls,
    }


def _select(
    trajectories: Iterable[Trajectory],
    tools: Sequence[dict[str, Any]],
    run_id: int | None,
    min_reward: float | None,
) -> tuple[list[dict[str, Any]], int, int, int]:
    rows: list[dict[str, Any]] = []
    seen = low = failed = 0
    for t in trajectories:
        seen += 1
        if t.info.get("error"):  # a failed episode is a partial one: nothing to imitate
            failed += 1
            continue
        if min_reward is not None and (t.reward is None or t.reward < min_reward):
            low += 1
            continue
        rows.append(trajectory_row(t, tools, run_id=run_id))
    return rows, seen, low, failed


def write_dataset(
    rows: Sequence[dict[str, Any]], out: str | Path, meta: dict[str, Any] | None = None
) -> tuple[Path, Path | None, str | None]:
    """Write rows as ``episodes.jsonl`` and (with ``datasets`` installed) a ``save_to_disk`` copy.

    Args:
        rows: Dataset rows (:func:`trajectory_row`).
        out: The folder (created; an earlier dataset there is replaced).
        meta: Written as ``dataset.json`` with the row count.

    Returns:
        ``(jsonl path, Hugging Face folder or None, why there is none or None)``.

    Raises:
        ConfigError: ``out`` is a file.
    """
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"--out {str(folder)!r} is a file; give a folder (it is created if missing)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / DATASET_JSONL
    tmp = jsonl.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    tmp.replace(jsonl)
    (folder / META_FILE).write_text(
        json.dumps({**(meta or {}), "rows": len(rows)}, indent=1, default=str) + "\n"
    )
    try:
        import datasets
    except ImportError:
        return jsonl, None, HF_HINT
    hf_rows = [
        {k: (json.dumps(v, ensure_ascii=False) if k in JSON_COLUMNS else v) for k, v in r.items()}
        for r in rows
    ]
    if not hf_rows:
        return jsonl, None, "no rows to write in the Hugging Face format"
    import shutil

    hf = folder / HF_DIR
    shutil.rmtree(hf, ignore_errors=True)
    quiet = datasets.is_progress_bar_enabled()
    if quiet:  # a save of a few rows needs no progress bar
        datasets.disable_progress_bars()
    try:
        datasets.Dataset.from_list(hf_rows).save_to_disk(str(hf))
    finally:
        if quiet:
            datasets.enable_progress_bars()
    return jsonl, hf, None


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key in JSON_COLUMNS:
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out


def read_dataset(path: str | Path, *, min_reward: float | None = None) -> list[dict[str, Any]]:
    """The rows of a dataset: a folder written by :func:`write_dataset`, its ``episodes.jsonl``,
    any JSONL file of rows, or a folder written by ``datasets.Dataset.save_to_disk``.

    Args:
        path: Where the dataset is.
        min_reward: Keep only rows whose reward is at least this.

    Raises:
        ConfigError: nothing readable there, or a row without ``messages``.
    """
    p = Path(path).expanduser()
    if p.is_dir() and (p / DATASET_JSONL).is_file():
        p = p / DATASET_JSONL
    rows: list[dict[str, Any]]
    if p.is_file():
        rows = []
        with p.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(_decode_row(json.loads(line)))
                except ValueError as exc:
                    raise ConfigError(f"dataset {str(p)!r} line {n}: not JSON ({exc})") from None
    elif p.is_dir() and ((p / "dataset_info.json").is_file() or (p / HF_DIR).is_dir()):
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                f"dataset {str(p)!r} is in the Hugging Face format; {HF_HINT}"
            ) from None
        hf = p if (p / "dataset_info.json").is_file() else p / HF_DIR
        rows = [_decode_row(dict(r)) for r in datasets.load_from_disk(str(hf))]
    else:
        raise ConfigError(
            f"dataset {str(path)!r} not found: give a folder written by `twin collect`, a JSONL "
            "file of "
            "rows, or a folder saved with datasets.Dataset.save_to_disk"
        )
    for n, row in enumerate(rows):
        if not isinstance(row.get("messages"), list):
            raise ConfigError(
                f"dataset {str(p)!r} row {n}: no 'messages' list; rows come from `twin collect`"
            )
    if min_reward is not None:
        rows = [r for r in rows if r.get("reward") is not None and float(r["reward"]) >= min_reward]
    return rows


def default_out(twin: str, policy: str, split: str, run_id: int | None) -> Path:
    """``runs/datasets/<twin>-<policy>-<split>[-run<id>]`` with the policy spec made file-safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", policy).strip("_") or "policy"
    suffix = f"-run{run_id}" if run_id is not None else ""
    return Path("runs") / "datasets" / f"{twin.lower()}-{safe[:60]}-{split}{suffix}"


def collect(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    *,
    out: str | Path | None = None,
    store: RunStore | None = None,
    min_reward: float | None = None,
    group_size: int = 1,
    concurrency: int = 64,
    policy_spec: str | None = None,
    config: dict[str, Any] | None = None,
    progress: bool = True,
) -> CollectResult:
    """Run ``policy`` on ``cases`` with :func:`twin.evaluation.evaluate` and write the episodes.

    Args:
        twin: The twin.
        policy: A :class:`twin.policies.Policy`.
        cases: ``(split, index)`` pairs.
        out: The dataset folder (default :func:`default_out`).
        store: The run store (the run is kind ``eval``); None stores nothing.
        min_reward: Keep only episodes with at least this reward.
        group_size: Episodes per case.
        concurrency: Most episodes in flight.
        policy_spec: The policy as the run and the rows record it (default ``policy.name``).
        config: The run's configuration.
        progress: Progress bar on stderr.
    """
    from twin.evaluation.runner import evaluate

    spec = policy_spec or policy.name
    result = evaluate(
        twin, policy, cases, group_size=group_size, concurrency=concurrency, store=store,
        policy_spec=spec, progress=progress,
        config={**(config or {}), "collect": True, "min_reward": min_reward},
    )  # fmt: skip
    trajectories = [t for g in result.groups for t in g.trajectories]
    rows, seen, low, failed = _select(trajectories, twin.tool_schemas, result.run_id, min_reward)
    split = cases[0][0] if cases else ""
    folder = Path(out) if out is not None else default_out(twin.name, spec, split, result.run_id)
    meta = {
        "twin": twin.name, "policy": spec, "split": split, "run_id": result.run_id,
        "min_reward": min_reward, "episodes": seen, "dropped_reward": low,
        "dropped_failed": failed, "store": result.summary.get("store"),
    }  # fmt: skip
    jsonl, hf, note = write_dataset(rows, folder, meta)
    return CollectResult(
        folder, len(rows), seen, low, failed, result.run_id, jsonl, hf, note, result.summary
    )


def _run_twin_config(config: dict[str, Any]) -> dict[str, Any]:
    # eval runs keep the twin's options as twin_config; training runs store the recipe
    if isinstance(config.get("twin_config"), dict):
        return dict(config["twin_config"])
    twin_section = config.get("twin")
    if isinstance(twin_section, dict) and isinstance(twin_section.get("config"), dict):
        return dict(twin_section["config"])
    return {}


def export_run(
    store: RunStore,
    run_id: int,
    *,
    out: str | Path | None = None,
    min_reward: float | None = None,
    twin: Twin | None = None,
) -> CollectResult:
    """Write the episodes of a stored run (any kind) as a dataset.

    Args:
        store: The run store.
        run_id: The run.
        out: The dataset folder (default :func:`default_out`).
        min_reward: Keep only episodes with at least this reward.
        twin: The twin whose tool schemas the rows carry (default: made from the run's twin
            name and options).

    Raises:
        RunNotFoundError: no such run.
    """
    info = store.run(run_id)
    if twin is None:
        from twin.registry import make_twin

        twin = make_twin(info.twin, **_run_twin_config(info.config or {}))
    trajectories = store.episodes(run_id)
    rows, seen, low, failed = _select(trajectories, twin.tool_schemas, run_id, min_reward)
    splits = sorted({r["split"] for r in rows}) or sorted({t.split for t in trajectories})
    split = "+".join(splits) or "none"
    folder = Path(out) if out is not None else default_out(info.twin, info.policy, split, run_id)
    meta = {
        "twin": info.twin, "policy": info.policy, "split": split, "run_id": run_id,
        "run_kind": info.kind, "min_reward": min_reward, "episodes": seen, "dropped_reward": low,
        "dropped_failed": failed, "store": store.url,
    }  # fmt: skip
    jsonl, hf, note = write_dataset(rows, folder, meta)
    return CollectResult(folder, len(rows), seen, low, failed, run_id, jsonl, hf, note)
