"""``check_twin``: what Gymnasium's ``check_env`` is for envs, for twins.

Run it in your twin's tests (``check_twin(MyTwin())``); twinrl's own suite runs it over every
registered twin. It checks that:

* the twin sets ``name``, ``version`` and ``splits`` and has tools, one of them terminal;
* every tool schema is a valid OpenAI function schema that hides the injected parameters;
* cases are deterministic: a fresh instance builds the same bytes for the same (split, index);
* the prompt is valid chat, and neither the reset observation nor its ``info`` carries the truth;
* the env answers junk with messages, and ``gymnasium.utils.env_checker.check_env`` passes.

:func:`doctor` (``twin check TWIN``, :mod:`twin.doctor`) goes further: it plays the twin and
reports whether it is solvable and free of shortcuts (``doctor("Returns").assert_ok()``).
"""

from __future__ import annotations

from twin.contract import TwinCheckError, check_twin
from twin.doctor import doctor
from twin.doctor_report import CheckRow, Report

__all__ = ["CheckRow", "Report", "TwinCheckError", "check_twin", "doctor"]
