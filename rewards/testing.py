"""Unit-test rewards against hand-written rollouts, before spending a GPU hour.

A rollout file (``*.rollouts.yaml``) names a twin and lists cases::

    twin: Catalog                 # resolved with twin.registry.make_twin
    tolerance: 1.0e-6             # optional, per file (a case may set its own)
    cases:
      - name: gold                # the oracle's answer must score the maximum
        truth: {category_id: aa-1, attributes: {color: red}, verdict: ok, signals: []}
        submit: {category_id: aa-1, attributes: {color: Red}, verdict: ok, reason: looks fine}
        expect: {total: 1.0, components: {category: 1, attributes: 1, policy: 1}}
      - name: miss, two bad calls
        truth: {category_id: aa-1, attributes: {}, verdict: counterfeit, signals: [typosquat]}
        submit: {category_id: aa-1, attributes: {}, verdict: ok, reason: ""}
        invalid_calls: 2
        expect: {total: "0.3 + 0.3 - 0.4 - 0.02", components: {policy: -1, penalty: 0.02}}
      - name: no submit
        truth: {category_id: aa-1, attributes: {}, verdict: ok, signals: []}
        submit: null
        expect: {total: -0.4}

A case gives either ``submit`` (the terminal call's arguments, or null for "never submitted")
with an optional ``invalid_calls: N``, or ``turns``: the assistant turns (raw text or message
dicts) replayed through the real environment (``case: {split, index}`` picks the case the
episode runs on; the file's ``truth`` replaces that case's truth when scoring; without a
``truth`` the case's own is used). Expected values are numbers or arithmetic such as ``"5/7"``;
``total: max`` means the reward's upper bound; ``expect: 0.2`` is short for ``{total: 0.2}``.

A file's ``reward: module:attr`` is imported only from the reward library (``rewards``) and
the packages of registered twins (built in, or installed through the ``twin.envs`` entry
points): a rollout file is data, and naming any module would let it run any code. Other modules
need an explicit ``allow_import=True`` (``twin reward test --allow-import``,
``pytest --rollouts-allow-import``).

Run ``twin reward test FILE...`` (:func:`cli_main`), or ``pytest FILE...`` (the plugin in
:mod:`rewards.pytest_plugin` collects each case as a test item).
"""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import json
import math
import operator
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rewards._reward import Reward, RewardResult
from rewards.properties import (
    PropertyReport,
    catalog_mistakes,
    catalog_oracle,
    check_reward_properties,
    submission_trajectory,
)
from twin.cases import Case
from twin.errors import ConfigError, TwinError, UnknownTwinError
from twin.trajectory import Trajectory

__all__ = [
    "CaseOutcome",
    "Expect",
    "PropertyReport",
    "catalog_mistakes",
    "catalog_oracle",
    "check_reward_properties",
    "RolloutCase",
    "RolloutFile",
    "Scorer",
    "check_rollout_file",
    "cli_main",
    "clear_cache",
    "load_rollout_file",
    "register_reward",
    "render_outcomes",
    "resolve_scorer",
    "run_rollout_file",
    "score_case",
    "trusted_reward_packages",
    "unregister_reward",
]

#: A scorer: ``scorer(trajectory, case) -> RewardResult``.
Scorer = Callable[[Trajectory, Case], Any]

DEFAULT_TOLERANCE = 1e-6


# -- safe arithmetic for expected values -------------------------------------------------------
_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


#: Longest arithmetic text of an expected value (deeper or longer text is not a reward value).
MAX_ARITH_CHARS = 200


def _arith(text: str) -> float:
    """Evaluate ``"0.3*0.5 + 2/7"``: numbers, + - * /, parentheses; nothing else.

    The text is at most :data:`MAX_ARITH_CHARS` characters and the result must be a finite
    float: anything else (a 2,000-term product that would exhaust the parser's recursion, a
    401-digit literal that overflows a float) is a ``ValueError`` that names the problem.
    """
    from twin.yamlsafe import clip

    if len(text) > MAX_ARITH_CHARS:
        raise ValueError(
            f"expected a number or short arithmetic such as '5/7', got {len(text)} characters "
            f"({clip(repr(text), 60)}); at most {MAX_ARITH_CHARS} are read"
        )

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, got {ast.dump(node)[:60]}")

    try:
        result = ev(ast.parse(text.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError) as exc:
        why = {OverflowError: "a number too large for a float", RecursionError: "nested too deeply",
               MemoryError: "too large"}.get(type(exc), str(exc))
        raise ValueError(f"expected a number or arithmetic such as '5/7', got {text!r} ({why})") from None
    if not math.isfinite(result):
        raise ValueError(f"expected a finite number, {text!r} evaluates to {result}")
    return result


def _number(value: Any) -> float | str:
    if isinstance(value, str):
        if value.strip().lower() == "max":
            return "max"
        return _arith(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        from twin.yamlsafe import clip

        raise ValueError(f"expected a number, got {clip(repr(value), 80)}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"expected a number a float can hold, got an integer of {len(str(value))} digits") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {number}")
    return number


# -- file model --------------------------------------------------------------------------------
class Expect(BaseModel):
    """What a case must score.

    Attributes:
        total: The expected total (a number, arithmetic text, or ``"max"``).
        components: Expected values of named components (a subset is fine).
    """

    model_config = ConfigDict(extra="forbid")

    total: float | str | None = None
    components: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, data: Any) -> Any:
        # `expect: 0.2` is short for `expect: {total: 0.2}`
        return {"total": data} if isinstance(data, (int, float, str)) and not isinstance(data, bool) else data

    @field_validator("total", mode="before")
    @classmethod
    def _total(cls, v: Any) -> Any:
        return None if v is None else _number(v)

    @field_validator("components", mode="before")
    @classmethod
    def _components(cls, v: Any) -> Any:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"components must be a mapping of name -> value, got {v!r}")
        out = {}
        for k, x in v.items():
            n = _number(x)
            if n == "max":
                raise ValueError(f"component {k!r}: 'max' is only allowed for total")
            out[str(k)] = n
        return out

    @model_validator(mode="after")
    def _something(self) -> Expect:
        if self.total is None and not self.components:
            raise ValueError("expect needs a total and/or components")
        return self


class CaseRef(BaseModel):
    """Which case of the twin an episode runs on (``turns`` cases)."""

    model_config = ConfigDict(extra="forbid")
    split: str = "test"
    index: int = Field(0, ge=0)


class RolloutCase(BaseModel):
    """One hand-written rollout.

    Attributes:
        name: What it checks (shown in the table and as the pytest id).
        truth: The case's hidden truth, in the twin's format (default: the truth of ``case``).
        description: Free text (ignored).
        notes: Free text (ignored).
        kind: Planted case type (optional).
        task: The case's task for shorthand cases (optional; rarely needed by a reward).
        submit: The terminal call's arguments, or None for an episode with no valid submit.
        turns: Assistant turns to replay through the environment instead of ``submit``.
        invalid_calls: Invalid calls of a shorthand case.
        num_turns: Assistant turns of a shorthand case (default: invalid_calls + 1 with a submit).
        completion_tokens: Generated tokens of a shorthand case (for overlong penalties).
        case: The twin case a ``turns`` episode runs on.
        expect: The expected total and/or components.
        tolerance: Absolute tolerance (default: the file's).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `tolerance: .inf` would pass anything

    name: str
    truth: dict[str, Any] | None = None
    description: str | None = None
    notes: str | None = None
    kind: str = "default"
    task: dict[str, Any] = Field(default_factory=dict)
    submit: dict[str, Any] | None = None
    turns: list[str | dict[str, Any]] | None = None
    invalid_calls: int = Field(0, ge=0)
    num_turns: int | None = Field(None, ge=0)
    completion_tokens: int = Field(0, ge=0)
    case: CaseRef | None = None
    expect: Expect
    tolerance: float | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _submit_or_turns(cls, data: Any) -> Any:
        if isinstance(data, dict):
            has_submit, has_turns = "submit" in data, data.get("turns") is not None
            if has_submit == has_turns:
                raise ValueError(
                    "give exactly one of `submit:` (the terminal call's arguments; `submit: null` for "
                    "no submission) or `turns:` (assistant turns to replay)"
                )
            if data.get("truth") is None and data.get("case") is None:
                raise ValueError("give the case's `truth:` (or `case: {split, index}` to use that case's own truth)")
            if has_turns and data.get("invalid_calls"):
                raise ValueError("`invalid_calls` is counted by the environment for `turns` cases; remove it")
        return data


class RolloutFile(BaseModel):
    """A ``*.rollouts.yaml`` file.

    Attributes:
        twin: Twin name or id (``Catalog``, ``twin/Catalog-v0``).
        description: Free text (ignored).
        config: Twin config options (e.g. ``{seed: 0}``).
        reward: Optional ``module:attr`` of a reward (or a zero-argument factory of one) to use
            instead of the twin's own.
        tolerance: Default absolute tolerance of the file's cases.
        cases: The rollouts.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    twin: str
    description: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    reward: str | None = None
    tolerance: float = Field(DEFAULT_TOLERANCE, ge=0)
    cases: list[RolloutCase] = Field(min_length=1)


def load_rollout_file(path: str | Path) -> RolloutFile:
    """Read and validate a rollout file.

    Raises:
        ConfigError: the file is missing, not YAML, or not in the format above; the message
            names the file, the case and the field.
    """
    from twin.yamlsafe import load_yaml_file

    p = Path(path)
    data = load_yaml_file(p, what="rollout file")  # bounded: no alias bombs, no binary files
    try:
        return RolloutFile.model_validate(data)
    except ValidationError as exc:
        from twin.yamlsafe import clip

        problems = []
        errors = exc.errors(include_url=False)
        if len(errors) > 10:  # one bad list can fail per element: the first ten say what is wrong
            errors = [*errors[:10], {"loc": (), "msg": f"... and {len(errors) - 10} more problems"}]
        for e in errors:
            loc = list(e["loc"])
            if len(loc) >= 2 and loc[0] == "cases" and isinstance(loc[1], int) and isinstance(data, dict):
                try:
                    loc[1] = f"{loc[1]} ({data['cases'][loc[1]].get('name', '?')!r})"
                except (KeyError, IndexError, AttributeError, TypeError):
                    pass
            problems.append(f"{'.'.join(map(str, loc)) or '<file>'}: {clip(e['msg'], 300)}")
        raise ConfigError(
            f"rollout file {str(p)!r} is not valid:\n  " + "\n  ".join(problems)
            + "\n(see rewards.testing's docstring for the format)"
        ) from None


# -- resolving the reward ----------------------------------------------------------------------
_REGISTERED: dict[str, tuple[Callable[[], Scorer], bool]] = {}
_TWINS: dict[tuple[str, str], Any] = {}
_SCORERS: dict[tuple[str, str, str], Scorer] = {}
_LOCK = threading.RLock()


def register_reward(twin: str, factory: Callable[[], Scorer], *, override: bool = False) -> None:
    """Register a reward for a twin name, used when the twin itself cannot be made.

    Args:
        twin: Twin name as rollout files write it (case-insensitive).
        factory: Zero-argument callable returning a scorer (a ``Reward`` or any
            ``(trajectory, case) -> RewardResult``).
        override: Prefer this reward even when the twin can be made (tests use it).
    """
    with _LOCK:
        _REGISTERED[twin.lower()] = (factory, override)
        for key in [k for k in _SCORERS if k[0] == twin.lower()]:
            del _SCORERS[key]


def unregister_reward(twin: str) -> None:
    """Remove a reward registered with :func:`register_reward` (no error if there is none)."""
    with _LOCK:
        _REGISTERED.pop(twin.lower(), None)
        for key in [k for k in _SCORERS if k[0] == twin.lower()]:
            del _SCORERS[key]


def clear_cache() -> None:
    """Forget cached twins and scorers (and nothing else)."""
    with _LOCK:
        _TWINS.clear()
        _SCORERS.clear()


def _make_twin(name: str, config: dict[str, Any]) -> Any:
    """One twin per (name, config) per process: building a world may take seconds."""
    key = (name.lower(), json.dumps(config, sort_keys=True))
    with _LOCK:
        if key not in _TWINS:
            try:
                from twin.registry import make_twin
            except ImportError as exc:  # the registry is optional for shorthand cases
                raise UnknownTwinError(f"twin {name!r}: twin.registry is not available ({exc})") from None
            _TWINS[key] = make_twin(name, **config)
        return _TWINS[key]


def trusted_reward_packages() -> list[str]:
    """The packages a rollout file's ``reward: module:attr`` may import from by default: the
    reward library and the package of every registered twin (entry-point plugins included)."""
    packages = {"rewards"}
    try:
        from twin.registry import registry
    except ImportError:  # the registry is optional for shorthand cases
        registry = {}
    for spec in registry.values():
        module = spec.entry_point.partition(":")[0]
        packages.add(module.rpartition(".")[0] or module)
    return sorted(packages)


def _check_import_allowed(spec: str, allow_import: bool) -> None:
    module = spec.partition(":")[0].strip()
    if allow_import or not module:
        return
    trusted = trusted_reward_packages()
    if any(module == p or module.startswith(p + ".") for p in trusted):
        return
    raise ConfigError(
        f"reward {spec!r}: a rollout file may only name rewards of the reward library or of registered "
        f"twins (modules under {', '.join(trusted)}); importing {module!r} would run its code. If you "
        "trust the file, run `twin reward test --allow-import` (Python: allow_import=True; pytest: "
        "--rollouts-allow-import)"
    )


def _import_reward(spec: str) -> Scorer:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"reward must be 'module:attr', got {spec!r}")
    try:
        obj: Any = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward {spec!r} could not be imported: {exc}") from None
    if isinstance(obj, Reward):
        return obj
    if callable(obj):
        params = [
            p for p in inspect.signature(obj).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return obj() if not params else obj
    raise ConfigError(f"reward {spec!r} is {obj!r}, not a Reward, scorer or factory")


def resolve_scorer(
    twin: str, config: dict[str, Any] | None = None, reward: str | None = None, *, allow_import: bool = False
) -> Scorer:
    """The scorer rollout files for ``twin`` are checked against.

    Order: the file's ``reward:`` entry; a reward registered with ``override=True``; the twin
    made through ``twin.registry.make_twin`` (its ``score``); a registered reward.

    Args:
        twin: The twin's name or id.
        config: The twin's config.
        reward: ``module:attr`` of a reward (or of a zero-argument factory of one).
        allow_import: Import ``reward`` from any module; by default only from
            :func:`trusted_reward_packages`.

    Raises:
        UnknownTwinError: nothing could be resolved; the message says what was tried.
        ConfigError: ``reward`` is outside the trusted packages and ``allow_import`` is false.
    """
    if reward:
        _check_import_allowed(reward, allow_import)  # before the cache: a trusted caller's import is no licence
    config = dict(config or {})
    key = (twin.lower(), json.dumps(config, sort_keys=True), reward or "")
    with _LOCK:
        if key in _SCORERS:
            return _SCORERS[key]
        registered = _REGISTERED.get(twin.lower())
        scorer: Scorer | None = None
        if reward:
            scorer = _import_reward(reward)
        elif registered is not None and registered[1]:
            scorer = registered[0]()
        else:
            try:
                scorer = _make_twin(twin, config).score
            except (UnknownTwinError, ImportError) as exc:
                if registered is None:
                    raise UnknownTwinError(
                        f"no reward for twin {twin!r}: {exc}; register one with "
                        "rewards.testing.register_reward or give `reward: module:attr` in the file"
                    ) from None
                scorer = registered[0]()
        _SCORERS[key] = scorer
        return scorer


def _reward_bounds(scorer: Scorer) -> tuple[float, float] | None:
    if isinstance(scorer, Reward):
        return scorer.bounds
    owner = getattr(scorer, "__self__", None)  # a twin's bound `score`
    if owner is not None:
        r = inspect.getattr_static(owner, "reward", None)
        if isinstance(r, staticmethod):
            r = r.__func__
        if isinstance(r, Reward):
            return r.bounds
    return None


# -- scoring -----------------------------------------------------------------------------------
class CaseOutcome(BaseModel):
    """The result of checking one rollout case.

    Attributes:
        file: The rollout file.
        name: The case's name.
        result: The reward result (None when scoring failed).
        expected: The expected total and components, resolved to numbers.
        mismatches: ``(what, expected, got)`` for every value outside the tolerance.
        error: The error, when scoring failed.
        tolerance: The tolerance used.
    """

    file: str
    name: str
    result: RewardResult | None = None
    expected: dict[str, float] = Field(default_factory=dict)
    mismatches: list[tuple[str, float, float | None]] = Field(default_factory=list)
    error: str | None = None
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def passed(self) -> bool:
        """No error and no mismatch."""
        return self.error is None and not self.mismatches

    def describe(self) -> str:
        """Expected vs got, one line per mismatch, then the breakdown."""
        if self.error:
            return f"{self.file} :: {self.name}: ERROR {self.error}"
        lines = [f"{self.file} :: {self.name}:"]
        for what, exp, got in self.mismatches:
            if got is None:
                have = ", ".join(self.result.components) if self.result else ""
                got_txt = f"no such component (the reward reports: {have})"
            else:
                got_txt = f"{got:.6g} (diff {got - exp:+.6g})"
            lines.append(f"  {what}: expected {exp:.6g}, got {got_txt} (tolerance {self.tolerance:g})")
        if self.result is not None:
            lines.append("  " + self.result.explain().replace("\n", "\n  "))
        return "\n".join(lines)


def _replay(f: RolloutFile, c: RolloutCase) -> tuple[Trajectory, Case]:
    from twin.env import TwinEnv

    tw = _make_twin(f.twin, f.config)
    ref = c.case or CaseRef()
    env = TwinEnv(tw)
    env.reset(options={"split": ref.split, "index": ref.index})
    for turn in c.turns or []:
        _, _, terminated, truncated, _ = env.step(turn)
        if terminated or truncated:
            break
    trajectory = env.trajectory
    if trajectory is None:  # pragma: no cover - the env always has one after reset
        raise TwinError("the environment returned no trajectory")
    base = env.case
    truth = c.truth if c.truth is not None else base.truth
    kind = c.kind if c.truth is not None or c.kind != "default" else base.kind
    case = Case(twin=base.twin, split=base.split, index=base.index, kind=kind, task=base.task, truth=truth)
    return trajectory, case


def score_case(f: RolloutFile, c: RolloutCase, *, file: str = "<memory>", allow_import: bool = False) -> CaseOutcome:
    """Score one case of a rollout file and compare it with its expectations.

    Never raises for a broken reward: the error is recorded in the outcome (and fails it).

    Args:
        f: The rollout file.
        c: One of its cases.
        file: The file's name in the outcome.
        allow_import: Let the file's ``reward:`` import any module (see :func:`resolve_scorer`).
    """
    tol = c.tolerance if c.tolerance is not None else f.tolerance
    out = CaseOutcome(file=file, name=c.name, tolerance=tol)
    try:
        scorer = resolve_scorer(f.twin, f.config, f.reward, allow_import=allow_import)
        if c.turns is not None:
            trajectory, case = _replay(f, c)
        else:
            ref = c.case or CaseRef()
            if c.truth is None:  # the twin's own case
                case = _make_twin(f.twin, f.config).case(ref.split, ref.index)
            else:
                case = Case(twin=f.twin, split=ref.split, index=ref.index, kind=c.kind, task=c.task, truth=c.truth)
            trajectory = submission_trajectory(
                case, c.submit, invalid_calls=c.invalid_calls, num_turns=c.num_turns, policy="rollout-file",
                twin=f.twin, case_kind=c.kind, completion_tokens=c.completion_tokens,
            )
        raw = scorer(trajectory, case)
        result = raw if isinstance(raw, RewardResult) else RewardResult.model_validate(raw, from_attributes=True)
    except Exception as exc:  # report, do not crash the whole run
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.result = result
    expected_total = c.expect.total
    if expected_total == "max":
        bounds = _reward_bounds(scorer)
        if bounds is None:
            out.error = "expect total: max needs a Reward whose bounds are known"
            return out
        expected_total = bounds[1]
    if expected_total is not None:
        out.expected["total"] = float(expected_total)
        if not math.isclose(result.total, float(expected_total), rel_tol=0.0, abs_tol=tol):
            out.mismatches.append(("total", float(expected_total), result.total))
    for name, exp in c.expect.components.items():
        out.expected[name] = float(exp)
        got = result.components.get(name)
        if got is None or not math.isclose(got, float(exp), rel_tol=0.0, abs_tol=tol):
            out.mismatches.append((name, float(exp), got))
    return out


def run_rollout_file(path: str | Path, *, allow_import: bool = False) -> list[CaseOutcome]:
    """Check every case of a rollout file (a file that cannot be loaded gives one failed outcome).

    Args:
        path: The rollout file.
        allow_import: Let the file's ``reward:`` import any module (see :func:`resolve_scorer`).
    """
    try:
        f = load_rollout_file(path)
    except ConfigError as exc:
        return [CaseOutcome(file=str(path), name="<file>", error=str(exc))]
    except Exception as exc:  # noqa: BLE001 - one unreadable file must not stop the others
        return [CaseOutcome(file=str(path), name="<file>", error=f"{type(exc).__name__}: {exc}")]
    return [score_case(f, c, file=str(path), allow_import=allow_import) for c in f.cases]


def check_rollout_file(path: str | Path, *, allow_import: bool = False) -> list[CaseOutcome]:
    """Like :func:`run_rollout_file` but raise ``AssertionError`` listing every failed case."""
    outcomes = run_rollout_file(path, allow_import=allow_import)
    failed = [o for o in outcomes if not o.passed]
    if failed:
        raise AssertionError("\n\n".join(o.describe() for o in failed))
    return outcomes


# -- the command line --------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def render_outcomes(outcomes: Sequence[CaseOutcome], console: Any = None) -> None:
    """Print one rich table per file: each case's components, total, expected total, verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    by_file: dict[str, list[CaseOutcome]] = {}
    for o in outcomes:
        by_file.setdefault(o.file, []).append(o)
    for file, outs in by_file.items():
        names: list[str] = []
        for o in outs:
            for n in (o.result.components if o.result else {}):
                if n not in names:
                    names.append(n)
        table = Table(title=file, show_lines=False)
        table.add_column("case", overflow="fold")
        for n in names:
            table.add_column(n, justify="right")
        table.add_column("total", justify="right")
        table.add_column("expected", justify="right")
        table.add_column("", justify="center")
        for o in outs:
            comps = o.result.components if o.result else {}
            cells = []
            bad = {m[0] for m in o.mismatches}
            for n in names:
                txt = _fmt(comps.get(n))
                if n in bad:
                    txt = f"[red]{txt} (want {_fmt(o.expected.get(n))})[/red]"
                cells.append(txt)
            total = _fmt(o.result.total) if o.result else ""
            if "total" in bad:
                total = f"[red]{total}[/red]"
            status = "[green]pass[/green]" if o.passed else ("[red]ERROR[/red]" if o.error else "[red]FAIL[/red]")
            table.add_row(o.name, *cells, total, _fmt(o.expected.get("total")), status)
        console.print(table)
    failed = [o for o in outcomes if not o.passed]
    for o in failed:
        console.print(o.describe(), markup=False, highlight=False)
    n = len(outcomes)
    msg = f"{n - len(failed)}/{n} rollouts pass"
    console.print(f"[red]{msg}[/red]" if failed else f"[green]{msg}[/green]")


def cli_main(files: list[str], allow_import: bool = False) -> int:
    """``twin reward test FILE...``: check rollout files, print the tables.

    Args:
        files: Rollout files (glob patterns are expanded when the shell did not).
        allow_import: Let the files' ``reward: module:attr`` import any module (``--allow-import``).

    Returns:
        0 when every case passes, 1 when any case fails or errors, 2 when no file was given
        or found.
    """
    from rich.console import Console

    import sys

    # Off a terminal rich assumes 80 columns, which truncates the component headers.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    paths: list[str] = []
    for f in files:
        matches = sorted(glob.glob(f)) if any(ch in f for ch in "*?[") else [f]
        if not matches:
            console.print(f"[red]no file matches {f!r}[/red]")
            return 2
        paths.extend(matches)
    if not paths:
        console.print("[red]give one or more *.rollouts.yaml files[/red]")
        return 2
    outcomes: list[CaseOutcome] = []
    for p in paths:
        outcomes.extend(run_rollout_file(p, allow_import=allow_import))
    render_outcomes(outcomes, console)
    return 0 if all(o.passed for o in outcomes) else 1
