"""``check_twin``: what Gymnasium's ``check_env`` is for envs, for twins.

Run it in your twin's tests (``check_twin(MyTwin())``); twinrl's own suite runs it over every
registered twin. It checks that:

* the twin sets ``name``, ``version`` and ``splits`` and has tools, one of them terminal;
* every tool schema is a valid OpenAI function schema that hides the injected parameters;
* cases are deterministic: a fresh instance builds the same bytes for the same (split, index);
* the prompt is valid chat, and neither the reset observation nor its ``info`` carries the truth;
* the env answers junk with messages, and ``gymnasium.utils.env_checker.check_env`` passes.

Import it as ``twin.check_twin``, or from :mod:`twin.doctor` beside the doctor, which runs this
check first.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from twin.core import Twin
from twin.errors import TwinError
from twin.tools import INJECTED

__all__ = ["TwinCheckError", "check_twin"]

_INFO_KEYS = {"tools", "case_id", "split", "index"}


class TwinCheckError(TwinError, AssertionError):
    """A twin failed :func:`check_twin`; the message says which check and how to fix it."""


def _fail(twin: Twin, what: str) -> TwinCheckError:
    return TwinCheckError(f"check_twin({twin.name}): {what}")


def check_twin(twin_or_id: Twin | str, *, cases: int = 5, env_check: bool = True) -> None:
    """Check a twin (or a registered id) against the twin contracts (docs/architecture.md).

    Args:
        twin_or_id: A :class:`twin.core.Twin` instance, or an id / name for :func:`twin.make_twin`.
        cases: How many cases of each split to build and compare.
        env_check: Also run Gymnasium's ``check_env`` on a :class:`twin.env.TwinEnv` of it.

    Raises:
        TwinCheckError: the first check that fails, with what to fix.
    """
    from twin.registry import make_twin

    twin = make_twin(twin_or_id) if isinstance(twin_or_id, str) else twin_or_id
    _check_class(twin)
    _check_schemas(twin)
    _check_cases(twin, cases)
    _check_env(twin)
    if env_check:
        _check_gymnasium(twin)


def _check_class(twin: Twin) -> None:
    """Name, version and splits set; tools, one of them terminal."""
    cls = type(twin)
    for attr in ("name", "version", "splits"):
        if not hasattr(cls, attr):
            raise _fail(twin, f"set the class attribute {attr!r}")
    if not isinstance(cls.version, int) or cls.version < 0:
        raise _fail(twin, f"version must be an int >= 0, got {cls.version!r}")
    if not twin.tools:
        raise _fail(twin, "the twin has no tools; mark methods with @tool")
    if not any(t.terminal for t in twin.tools):
        raise _fail(
            twin, "no terminal tool; mark the one that ends an episode @tool(terminal=True)"
        )


def _check_schemas(twin: Twin) -> None:
    """Unique tool names; valid OpenAI function schemas that hide the injected parameters."""
    names = [t.name for t in twin.tools]
    if len(set(names)) != len(names):
        raise _fail(twin, f"tool names must be unique, got {names}")
    for t in twin.tools:
        fn = t.schema.get("function", {})
        params = fn.get("parameters", {})
        if (
            t.schema.get("type") != "function"
            or fn.get("name") != t.name
            or not fn.get("description")
        ):
            raise _fail(
                twin, f"tool {t.name!r}: schema needs type 'function', its name, a description"
            )
        if params.get("type") != "object" or not isinstance(params.get("properties"), dict):
            raise _fail(twin, f"tool {t.name!r}: parameters must be a JSON-schema object")
        leaked = INJECTED & set(params["properties"])
        if leaked:
            raise _fail(
                twin, f"tool {t.name!r}: injected parameters {sorted(leaked)} in the schema"
            )
        try:
            json.dumps(t.schema)
        except (TypeError, ValueError) as exc:
            raise _fail(twin, f"tool {t.name!r}: schema is not JSON ({exc})") from None


def _check_cases(twin: Twin, cases: int) -> None:
    """Deterministic cases and prompts, valid chat, no truth in the prompt."""
    from twin.spaces import ChatMessages

    cls = type(twin)
    fresh = cls(**twin.config.model_dump())
    space = ChatMessages()
    for split in twin.splits:
        for index in range(min(cases, twin.num_cases(split))):
            case = twin.case(split, index)
            again = fresh.case(split, index)
            if case.canonical_json() != again.canonical_json():
                raise _fail(
                    twin,
                    f"case ({split!r}, {index}) differs between two instances; draw everything "
                    "from the rng make_case receives (never from hash(), time or global random)",
                )
            try:
                case.canonical_json()
            except (TypeError, ValueError) as exc:
                raise _fail(twin, f"case ({split!r}, {index}) is not JSON ({exc})") from None
            prompt = twin.prompt(case)
            if not prompt or not space.contains(prompt):
                raise _fail(twin, f"prompt of ({split!r}, {index}) is not a list of chat messages")
            if json.dumps(twin.prompt(case)) != json.dumps(fresh.prompt(again)):
                raise _fail(twin, f"prompt of ({split!r}, {index}) is not deterministic")
            _check_no_truth(twin, case.truth, prompt, where=f"prompt of ({split!r}, {index})")


def _check_env(twin: Twin) -> None:
    """The reset carries no truth and has the documented info; junk is answered with errors."""
    from twin.env import TwinEnv

    env = TwinEnv(twin)
    split = next(iter(twin.splits))
    obs, info = env.reset(options={"split": split, "index": 0})
    if set(info) != _INFO_KEYS:
        raise _fail(twin, f"reset info keys must be {sorted(_INFO_KEYS)}, got {sorted(info)}")
    _check_no_truth(twin, env.case.truth, [obs, info], where="reset observation and info")  # type: ignore[union-attr]
    for junk in ("", "no call here", "<tool_call>{oops</tool_call>", {"role": "assistant"}, 42):
        try:
            out = env.step(junk)
        except Exception as exc:
            raise _fail(twin, f"step({junk!r}) raised {type(exc).__name__}: {exc}") from exc
        if not out[0] or not out[4]["errors"]:
            raise _fail(twin, f"step({junk!r}) did not answer with an error message")
        if out[2] or out[3]:
            env.reset(options={"split": split, "index": 0})


def _check_gymnasium(twin: Twin) -> None:
    """Gymnasium's ``check_env`` on a :class:`twin.env.TwinEnv` of the twin."""
    from gymnasium.utils.env_checker import check_env

    from twin.env import TwinEnv

    cls = type(twin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Gymnasium's checker rejects an env that truncates after one step; single-turn twins
        # (max_turns=1) are legitimate, so check them with a budget of two turns.
        roomy = twin
        if twin.config.max_turns < 2:
            roomy = cls(**{**twin.config.model_dump(), "max_turns": 2})
        try:
            check_env(TwinEnv(roomy), skip_render_check=True)
        except AssertionError as exc:
            raise _fail(twin, f"gymnasium check_env: {exc}") from exc


def _has_key(data: Any, key: str) -> bool:
    if isinstance(data, dict):
        return key in data or any(_has_key(v, key) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_has_key(v, key) for v in data)
    return False


def _check_no_truth(twin: Twin, truth: dict[str, Any], visible: Any, where: str) -> None:
    # Only unambiguous leaks: single truth values ("ok", "refund") may rightly appear in a prompt.
    if _has_key(visible, "truth"):
        raise _fail(twin, f"{where} has a 'truth' key; the truth is for the reward only")
    if len(truth) < 2:
        return
    text = json.dumps(visible, ensure_ascii=False, default=str)
    for blob in (
        json.dumps(truth, ensure_ascii=False, default=str),
        json.dumps(truth, sort_keys=True, ensure_ascii=False, default=str),
        str(truth),
    ):
        if blob in text or json.dumps(blob, ensure_ascii=False)[1:-1] in text:
            raise _fail(twin, f"{where} contains the case's whole truth {blob}")
