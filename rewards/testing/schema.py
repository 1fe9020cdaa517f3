"""The rollout file's format (``*.rollouts.yaml``): its models, expected values and loader.

Expected values are numbers or short arithmetic (``"0.3*2/3 + 0.3"``), evaluated by a small
interpreter that allows numbers, ``+ - * /`` and parentheses only: a rollout file is data, so
nothing in it may run code.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rewards.testing.judge_replay import JudgeReplaySpec
from twin.errors import ConfigError
from twin.yamlsafe import clip, load_yaml_file

__all__ = [
    "DEFAULT_TOLERANCE",
    "MAX_ARITH_CHARS",
    "CaseRef",
    "Expect",
    "RolloutCase",
    "RolloutFile",
    "load_rollout_file",
]

#: Absolute tolerance of a file's expected values unless it sets its own.
DEFAULT_TOLERANCE = 1e-6

# -- safe arithmetic for expected values ---------------------------------------------------------
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

    if len(text) > MAX_ARITH_CHARS:
        raise ValueError(
            f"expected a number or short arithmetic such as '5/7', got {len(text)} characters "
            f"({clip(repr(text), 60)}); at most {MAX_ARITH_CHARS} are read"
        )

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(
            f"only numbers, + - * / and parentheses are allowed, got {ast.dump(node)[:60]}"
        )

    try:
        result = ev(ast.parse(text.strip(), mode="eval"))
    except (
        SyntaxError,
        ValueError,
        ZeroDivisionError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as exc:
        why = {
            OverflowError: "a number too large for a float",
            RecursionError: "nested too deeply",
            MemoryError: "too large",
        }.get(type(exc), str(exc))
        raise ValueError(
            f"expected a number or arithmetic such as '5/7', got {text!r} ({why})"
        ) from None
    if not math.isfinite(result):
        raise ValueError(f"expected a finite number, {text!r} evaluates to {result}")
    return result


def _number(value: Any) -> float | str:
    if isinstance(value, str):
        if value.strip().lower() == "max":
            return "max"
        return _arith(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {clip(repr(value), 80)}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(
            f"expected a number a float can hold, got an integer of {len(str(value))} digits"
        ) from None
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
        return (
            {"total": data}
            if isinstance(data, (int, float, str)) and not isinstance(data, bool)
            else data
        )

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
        judge_answers: Recorded judge answers, in the order the case's judge terms ask
            (see :mod:`rewards.testing.judge_replay`).
    """

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False
    )  # `tolerance: .inf` would pass anything

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
    judge_answers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _submit_or_turns(cls, data: Any) -> Any:
        if isinstance(data, dict):
            has_submit, has_turns = "submit" in data, data.get("turns") is not None
            if has_submit == has_turns:
                raise ValueError(
                    "give exactly one of `submit:` (the terminal call's arguments; `submit: null` "
                    "for no submission) or `turns:` (assistant turns to replay)"
                )
            if data.get("truth") is None and data.get("case") is None:
                raise ValueError(
                    "give the case's `truth:` (or `case: {split, index}` to use that case's own "
                    "truth)"
                )
            if has_turns and data.get("invalid_calls"):
                raise ValueError(
                    "`invalid_calls` is counted by the environment for `turns` cases; remove it"
                )
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
        judge: Recorded judge answers for the reward's judge terms (see
            :mod:`rewards.testing.judge_replay`); None: judge terms ask their own judge.
        cases: The rollouts.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    twin: str
    description: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    reward: str | None = None
    tolerance: float = Field(DEFAULT_TOLERANCE, ge=0)
    judge: JudgeReplaySpec | None = None
    cases: list[RolloutCase] = Field(min_length=1)


def load_rollout_file(path: str | Path) -> RolloutFile:
    """Read and validate a rollout file.

    Raises:
        ConfigError: the file is missing, not YAML, or not in the rollout-file format; the message
            names the file, the case and the field.
    """
    p = Path(path)
    data = load_yaml_file(p, what="rollout file")  # bounded: no alias bombs, no binary files
    try:
        return RolloutFile.model_validate(data)
    except ValidationError as exc:
        problems = []
        errors = exc.errors(include_url=False)
        if len(errors) > 10:  # one bad list can fail per element: the first ten say what is wrong
            errors = [*errors[:10], {"loc": (), "msg": f"... and {len(errors) - 10} more problems"}]
        for e in errors:
            loc = list(e["loc"])
            if (
                len(loc) >= 2
                and loc[0] == "cases"
                and isinstance(loc[1], int)
                and isinstance(data, dict)
            ):
                try:
                    loc[1] = f"{loc[1]} ({data['cases'][loc[1]].get('name', '?')!r})"
                except (KeyError, IndexError, AttributeError, TypeError):
                    pass
            problems.append(f"{'.'.join(map(str, loc)) or '<file>'}: {clip(e['msg'], 300)}")
        raise ConfigError(
            f"rollout file {str(p)!r} is not valid:\n  "
            + "\n  ".join(problems)
            + "\n(see docs/rewards.md or rewards/testing/__init__.py for the format)"
        ) from None
