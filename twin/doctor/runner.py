"""``twin check TWIN``: a doctor that proves a twin has no shortcuts (``twin.doctor.doctor``).

:func:`twin.contract.check_twin` checks the contract (schemas, prompts, the env); the doctor also
plays the twin and asks whether it can be solved, and only the right way:

* **contract**: :func:`twin.contract.check_twin` passes;
* **determinism**: a fresh process builds the same case bytes and prompts (SHA-256 compared);
* **truth**: no prompt, non-terminal tool output or non-terminal ``info`` carries a truth
  string of its own case more often than it carries it for other cases
  (:func:`twin.doctor.audit.scan_leaks`; the strings come from :meth:`Twin.truth_fields`);
* **solvable**: the oracle (:meth:`Twin.oracle_policy`) reaches the maximum reward on every
  case of every kind it plays;
* **degenerate**: every constant answer of the terminal tool (each enum / Literal value, put
  into the best reference policy's answers), no tool calls, a random policy and the twin's own
  :meth:`Twin.degenerate_policies` each score at least ``degenerate_gap`` below the best
  reference policy (:meth:`Twin.reference_policies`; the oracle when there is none);
* **shortcut**: a bag-of-words classifier trained on train-split prompts, scored on test-split
  prompts, predicts :meth:`Twin.case_label` at most ``shortcut_margin`` above the majority
  rate; the same on the reference policy's first tool output;
* **overlap**: the share of each kind of test-split world entity (:meth:`Twin.world_entities`)
  also used by train-split cases stays under ``split_overlap``;
* **the twin's own rows**: :meth:`Twin.extra_checks` (``extra_checks(cases)``) returns more rows
  (dicts of :meth:`twin.doctor.report.Report.add`'s arguments: check, name, status, figure,
  threshold, note, value), each with its own threshold (``twin/Catalog-v2``: cheap policies,
  decision trees, held-out tactics, text templates, realism, base rates, natural-mix costs).

Thresholds: :data:`twin.doctor.report.DEFAULT_THRESHOLDS`, the twin's ``check_thresholds``,
then the caller's. In a test::

    from twin.doctor import doctor
    doctor("Returns").assert_ok()
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping

from twin.contract import check_twin
from twin.core import Twin
from twin.doctor.checks import Doctor
from twin.doctor.play import guard
from twin.doctor.report import CheckRow, Report, thresholds_for
from twin.errors import ConfigError

__all__ = ["CheckRow", "Report", "case_digest", "doctor"]

_NOT_IMPORTABLE = 3  # exit status of the fresh process when it cannot import the twin class
_SUBPROCESS = """
import importlib, json, sys
from twin.doctor import case_digest
try:
    obj = importlib.import_module(sys.argv[1])
    for part in sys.argv[2].split("."):
        obj = getattr(obj, part)
except (ImportError, AttributeError) as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(3)
print(case_digest(obj(**json.loads(sys.argv[3])), int(sys.argv[4])))
"""


def case_digest(twin: Twin, per_split: int) -> str:
    """SHA-256 of the first ``per_split`` cases of every split and their prompts."""
    digest = hashlib.sha256()
    for split in twin.splits:
        for index in range(min(per_split, twin.num_cases(split))):
            case = twin.case(split, index)
            digest.update(case.canonical_json().encode())
            digest.update(json.dumps(twin.prompt(case), sort_keys=True, default=str).encode())
    return digest.hexdigest()


def doctor(
    twin_or_id: Twin | str,
    *,
    cases: int = 2,
    split_train: str = "train",
    split_test: str = "test",
    thresholds: Mapping[str, float] | None = None,
    contract: bool = True,
    subprocess_check: bool = True,
) -> Report:
    """Run every check on a twin and return the report (it never raises on a failed check).

    Args:
        twin_or_id: A twin, or a registered id / name.
        cases: Cases of each kind played per policy (test split); the shortcut audit reads
            ``100 * cases`` train and ``50 * cases`` test prompts.
        split_train: Split the classifier trains on (and overlap's reference).
        split_test: Split the policies play and the classifier is scored on.
        thresholds: Overrides of the thresholds (names: ``DEFAULT_THRESHOLDS``).
        contract: Also run :func:`twin.contract.check_twin` (with Gymnasium's ``check_env``).
        subprocess_check: Build cases in a fresh process for the determinism check.

    Raises:
        ConfigError: an unknown split or threshold, or ``cases < 1``.
    """
    from twin.registry import make_twin

    twin = make_twin(twin_or_id) if isinstance(twin_or_id, str) else twin_or_id
    if cases < 1:
        raise ConfigError(f"cases must be >= 1, got {cases}")
    for split in (split_train, split_test):
        if split not in twin.splits:
            raise ConfigError(
                f"{twin.name} has no split {split!r}; splits: {', '.join(twin.splits)}"
            )
    th = thresholds_for(twin, thresholds)
    n_train = min(100 * cases, twin.num_cases(split_train))
    n_test = min(50 * cases, twin.num_cases(split_test))
    report = Report(
        twin=f"twin/{twin.name}-v{twin.version}",
        thresholds=th,
        settings={
            "cases_per_kind": cases,
            "split_train": split_train,
            "split_test": split_test,
            "audit_train": n_train,
            "audit_test": n_test,
            "seed": twin.config.seed,
        },
    )
    if contract:
        with guard(report, "contract", "check_twin"):
            try:
                check_twin(twin, cases=min(cases, 3))
                report.add(
                    "contract", "check_twin", "pass", note="schemas, prompts, env, check_env"
                )
            except AssertionError as exc:
                report.add("contract", "check_twin", "fail", note=str(exc))
    with guard(report, "determinism", "fresh process"):
        _check_determinism(twin, report, per_split=max(3, cases), subprocess_check=subprocess_check)
    Doctor(
        twin,
        report,
        th,
        cases=cases,
        split_train=split_train,
        split_test=split_test,
        n_train=n_train,
        n_test=n_test,
    ).run()
    return report


def _digest_in_fresh_process(twin: Twin, per_split: int) -> subprocess.CompletedProcess[str]:
    """:func:`case_digest` of the same class and config, computed by a new Python process."""
    cls = type(twin)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # a new hash() salt
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    config = json.dumps(twin.config.model_dump(mode="json"))
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _SUBPROCESS,
            cls.__module__,
            cls.__qualname__,
            config,
            str(per_split),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def _check_determinism(twin: Twin, report: Report, per_split: int, subprocess_check: bool) -> None:
    here = case_digest(twin, per_split)
    fresh = case_digest(type(twin)(**twin.config.model_dump()), per_split)
    if here != fresh:
        report.add(
            "determinism",
            "fresh instance",
            "fail",
            figure="digests differ",
            threshold="same bytes",
            note="cases or prompts differ between two instances: draw "
            "everything from make_case's rng (never time, global random or hash())",
        )
        return
    cls = type(twin)
    if not subprocess_check:
        report.add(
            "determinism",
            "fresh instance",
            "pass",
            figure=here[:12],
            threshold="same bytes",
            note="fresh process not checked (subprocess_check=False)",
        )
        return
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        report.add(
            "determinism",
            "fresh instance",
            "warn",
            figure=here[:12],
            threshold="same bytes",
            note=f"{cls.__qualname__} cannot be imported by a fresh process; checked in-process "
            "only",
        )
        return
    proc = _digest_in_fresh_process(twin, per_split)
    if proc.returncode == _NOT_IMPORTABLE:
        report.add(
            "determinism",
            "fresh instance",
            "warn",
            figure=here[:12],
            threshold="same bytes",
            note=f"a fresh process cannot import {cls.__module__}.{cls.__qualname__} "
            f"({proc.stderr.strip()[-200:]}); checked in-process only",
        )
        return
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        report.add("determinism", "fresh process", "fail", note=f"the fresh process failed: {tail}")
        return
    there = proc.stdout.strip()
    status = "pass" if there == here else "fail"
    report.add(
        "determinism",
        "fresh process",
        status,
        figure=f"{here[:12]} vs {there[:12]}",
        threshold="same bytes",
        note=""
        if status == "pass"
        else "a fresh process builds other cases: hash(), set order, time or global random?",
    )
