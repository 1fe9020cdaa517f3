"""The checks of ``twin check`` that play the twin (see :mod:`twin.doctor` for what each proves)."""

from __future__ import annotations

import json
from typing import Any

from twin.core import Twin
from twin.doctor.audit import bag_of_words_audit, label_like_values, scan_leaks
from twin.doctor.play import (
    ConstantAnswerPolicy,
    NoToolsPolicy,
    _Run,
    as_policy,
    constant_answers,
    first_output,
    guard,
    play,
)
from twin.doctor.report import WARN_SHARE, Report
from twin.protocols import Policy

__all__ = ["Doctor"]

CaseRef = tuple[str, int]


class Doctor:
    """Runs the playing checks of one twin into ``report`` (:meth:`run`)."""

    def __init__(
        self,
        twin: Twin,
        report: Report,
        thresholds: dict[str, float],
        *,
        cases: int,
        split_train: str,
        split_test: str,
        n_train: int,
        n_test: int,
    ) -> None:
        self.twin, self.report, self.th = twin, report, thresholds
        self.cases, self.split_train, self.split_test = cases, split_train, split_test
        self.n_train, self.n_test = n_train, n_test
        self.runs: dict[str, _Run] = {}
        self.best_ref: tuple[str, Any] | None = None
        self.oracle: Any = None

    def run(self) -> None:
        """Every playing check, in report order; a check that raises becomes a failed row."""
        from twin.rollout import max_reward

        self.top = max_reward(self.twin)
        with guard(self.report, "solvable", "oracle"):
            self.refs = self.pick_cases()
            self.solvable()
        if not hasattr(self, "refs"):
            return
        with guard(self.report, "reference", "reference policies"):
            self.reference()
        with guard(self.report, "degenerate", "degenerate policies"):
            self.degenerate()
        with guard(self.report, "truth", "prompt"):
            self.audit_cases = [
                self.twin.case(self.split_train, i) for i in range(self.n_train)
            ] + [self.twin.case(self.split_test, i) for i in range(self.n_test)]
            self.truth_in_prompts()
        with guard(self.report, "shortcut", "prompt"):
            self.shortcut_prompt()
        with guard(self.report, "shortcut", "first tool output"):
            self.shortcut_first_output()
        with guard(self.report, "truth", "tool outputs and info"):
            self.truth_in_outputs()
        with guard(self.report, "overlap", "world entities"):
            self.overlap()
        with guard(self.report, "twin", "extra_checks"):
            for row in self.twin.extra_checks(self.cases):
                self.report.add(**row)

    # -- cases and policies --------------------------------------------------------------------
    def pick_cases(self) -> list[CaseRef]:
        """Up to ``cases`` test-split cases of every kind among the split's first
        ``250 * cases``."""
        limit = min(self.twin.num_cases(self.split_test), 250 * self.cases)
        by_kind: dict[str, list[int]] = {}
        for index in range(limit):
            kind = self.twin.case_kind(self.split_test, index)
            chosen = by_kind.setdefault(kind, [])
            if len(chosen) < self.cases:
                chosen.append(index)
        self.report.settings["kinds"] = len(by_kind)
        self.report.settings["played_cases"] = sum(map(len, by_kind.values()))
        return sorted((self.split_test, i) for chosen in by_kind.values() for i in chosen)

    def _play(self, name: str, policy: Policy) -> _Run:
        run = self.runs[name] = play(self.twin, policy, self.refs)
        return run

    # -- solvable ------------------------------------------------------------------------------
    def solvable(self) -> None:
        """The oracle reaches the maximum reward on every played case, per kind."""
        oracle = self.twin.oracle_policy()
        limit = self.top - self.th["oracle_tolerance"]
        rule = f"oracle >= {limit:.3f} on every case"
        if oracle is None:
            self.report.add(
                "solvable",
                "oracle",
                "warn",
                threshold=rule,
                note="no oracle_policy(): solvability not proven",
            )
            return
        self.oracle = as_policy(self.twin, oracle)
        run = self._play("oracle", self.oracle)
        per_kind: dict[str, float] = {}
        for ep in run.episodes:
            per_kind[ep.case.kind] = min(per_kind.get(ep.case.kind, self.top), ep.reward or 0.0)
        self.report.details["oracle: worst reward per kind"] = per_kind
        short = sorted(k for k, v in per_kind.items() if v < limit)
        worst = min(per_kind.values()) if per_kind else 0.0
        note = (
            f"below the maximum on: {', '.join(short)}"
            if short
            else f"{len(per_kind)} kinds, {len(run.episodes)} cases"
        )
        if run.errors:
            note += f"; {len(run.errors)} episode(s) failed: {run.errors[0]}"
        self.report.add(
            "solvable",
            "oracle",
            "fail" if short or run.errors else "pass",
            figure=f"worst {worst:.3f} (max {self.top:g})",
            threshold=rule,
            note=note,
            value=worst,
        )

    # -- reference and degenerate policies -----------------------------------------------------
    def reference(self) -> None:
        """Play every reference policy; the best one sets the bar of the degenerate policies."""
        refs = self.twin.reference_policies()
        means: dict[str, float] = {}
        for name, value in refs.items():
            policy = as_policy(self.twin, value)
            run = self._play(f"reference {name}", policy)
            means[name] = run.mean
            if self.best_ref is None or run.mean > means[self.best_ref[0]]:
                self.best_ref = (name, policy)
        if self.best_ref is None:
            bar = self.runs["oracle"].mean if "oracle" in self.runs else self.top
            who = "the oracle" if "oracle" in self.runs else "the maximum reward"
            self.bar = bar
            self.report.add(
                "reference",
                "none",
                "warn",
                figure=f"{bar:.3f}",
                note=f"no reference_policies(): degenerate policies are held against {who}",
            )
            return
        name, _ = self.best_ref
        self.bar = means[name]
        for ref, mean in means.items():
            errors = self.runs[f"reference {ref}"].errors
            self.report.add(
                "reference",
                ref,
                "warn" if errors else "pass",
                figure=f"{mean:.3f}",
                note=("best reference" if ref == name else "")
                + (f"; {len(errors)} failed episode(s): {errors[0]}" if errors else ""),
                value=mean,
            )

    def degenerate(self) -> None:
        """Constant answers, no tool calls, random and the twin's own shortcuts vs the bar."""
        from twin.policies import RandomPolicy

        policies: dict[str, Any] = {}
        base_name, base = self.best_ref if self.best_ref else ("oracle", self.oracle)
        for tool, arg, value in constant_answers(self.twin):
            if base is not None:
                policies[f"constant {arg}={value}"] = ConstantAnswerPolicy(base, tool, arg, value)
        policies["no tool calls"] = NoToolsPolicy()
        policies["random"] = RandomPolicy(seed=0)
        for name, value in self.twin.degenerate_policies().items():
            policies[name] = as_policy(self.twin, value)
        gap_min = self.th["degenerate_gap"]
        means = {}
        for name, policy in policies.items():
            run = self._play(f"degenerate {name}", policy)
            means[name] = run.mean
            gap = self.bar - run.mean
            note = (
                f"answers of {base_name}, this value forced" if name.startswith("constant ") else ""
            )
            if gap < gap_min:
                note = (note + "; " if note else "") + f"within {gap_min:g} of the best policy"
            self.report.add(
                "degenerate",
                name,
                "pass" if gap >= gap_min else "fail",
                figure=f"{run.mean:.3f} (gap {gap:+.3f})",
                threshold=f"gap >= {gap_min:g} below {self.bar:.3f}",
                note=note,
                value=run.mean,
            )
        self.report.details["mean reward per policy"] = {n: r.mean for n, r in self.runs.items()}

    # -- truth isolation -----------------------------------------------------------------------
    def _truth_strings(self, cases: list[Any]) -> list[set[str]]:
        explicit = [self.twin.truth_fields(c) for c in cases]
        derived = label_like_values(
            [c.truth for c in cases],
            [c.kind for c in cases],
            [json.dumps(c.task, default=str) for c in cases],
            int(self.th["truth_min_chars"]),
        )
        return [set(e) if e is not None else d for e, d in zip(explicit, derived)]

    def truth_in_prompts(self) -> None:
        """No prompt shows a truth string of its own case more than other cases' prompts do."""
        cases = self.audit_cases
        strings = self._truth_strings(cases)
        samples = [
            (c.id, s, json.dumps(self.twin.prompt(c), ensure_ascii=False))
            for c, s in zip(cases, strings)
        ]
        self._leak_row("prompt", samples)

    def truth_in_outputs(self) -> None:
        """No non-terminal tool output or info shows a truth string of its own case."""
        samples = []
        for name, run in self.runs.items():
            if name == "oracle":
                continue
            cases = [ep.case for ep in run.episodes]
            for ep, strings in zip(run.episodes, self._truth_strings(cases)):
                samples.append((f"{ep.case.id} ({name})", strings, ep.visible))
        samples += getattr(self, "first_samples", [])
        self._leak_row("tool outputs and info", samples)

    def _leak_row(self, name: str, samples: list[tuple[str, set[str], str]]) -> None:
        margin = self.th["leak_margin"]
        leaks = scan_leaks(samples, margin)
        scanned = len(set().union(*(s[1] for s in samples))) if samples else 0
        rule = f"own-vs-other dominance < {margin:g}"
        if leaks:
            worst = leaks[0]
            shown = ", ".join(
                f"{lk.value!r} ({lk.own_rate:.2f} vs {lk.other_rate:.2f})" for lk in leaks[:4]
            )
            self.report.add(
                "truth",
                name,
                "fail",
                figure=f"{len(leaks)} leak(s)",
                threshold=rule,
                note=f"{shown}; e.g. {worst.example}",
                value=worst.margin,
            )
        else:
            self.report.add(
                "truth",
                name,
                "pass",
                figure=f"0 of {scanned} strings",
                threshold=rule,
                note=f"{len(samples)} samples",
                value=0.0,
            )

    # -- shortcut audit ------------------------------------------------------------------------
    def _audit_row(
        self, name: str, train: list[tuple[str, str]], test: list[tuple[str, str]], margin: float
    ) -> None:
        rule = f"accuracy - majority <= {margin:g}"
        if len({label for _, label in train}) < 2 or not test:
            self.report.add(
                "shortcut",
                name,
                "pass",
                threshold=rule,
                note="fewer than two answer classes or no test texts: nothing to predict",
            )
            return
        res = bag_of_words_audit(
            [t for t, _ in train],
            [lb for _, lb in train],
            [t for t, _ in test],
            [lb for _, lb in test],
        )
        status = (
            "fail"
            if res.margin > margin
            else "warn"
            if res.margin > WARN_SHARE * margin
            else "pass"
        )
        self.report.add(
            "shortcut",
            name,
            status,
            figure=f"{res.accuracy:.3f} vs majority {res.majority:.3f}",
            threshold=rule,
            note=f"naive Bayes, {res.classes} classes, {res.n_train} train / {res.n_test} "
            "test texts" + ("; the text gives the answer away" if status == "fail" else ""),
            value=res.margin,
        )

    def shortcut_prompt(self) -> None:
        """Predict the label from the prompt (system messages left out: they are the same)."""
        texts = []
        for case in self.audit_cases:
            body = "\n".join(
                str(m.get("content") or "")
                for m in self.twin.prompt(case)
                if m.get("role") != "system"
            )
            texts.append((body, str(self.twin.case_label(case))))
        self._audit_row(
            "prompt", texts[: self.n_train], texts[self.n_train :], self.th["shortcut_margin"]
        )

    def shortcut_first_output(self) -> None:
        """Predict the label from the reference policy's first tool output."""
        name, policy = self.best_ref if self.best_ref else ("oracle", self.oracle)
        if policy is None:
            self.report.add(
                "shortcut",
                "first tool output",
                "warn",
                note="no reference or oracle policy to make a first tool call",
            )
            return
        refs = [(c.split, c.index) for c in self.audit_cases]
        outputs = first_output(self.twin, policy, refs)
        pairs = [
            (out, str(self.twin.case_label(c)), c) for out, c in zip(outputs, self.audit_cases)
        ]
        strings = self._truth_strings(self.audit_cases)
        self.first_samples = [
            (f"{c.id} (first output of {name})", s, out)
            for (out, _, c), s in zip(pairs, strings)
            if out is not None
        ]
        train = [(o, lb) for o, lb, c in pairs[: self.n_train] if o is not None]
        test = [(o, lb) for o, lb, c in pairs[self.n_train :] if o is not None]
        if not train or not test:
            self.report.add(
                "shortcut",
                "first tool output",
                "pass",
                note=f"{name}'s first turn calls no tool before the answer",
            )
            return
        self._audit_row("first tool output", train, test, self.th["first_output_margin"])
        self.report.rows[-1].note += f"; first turn of {name}"

    # -- split overlap -------------------------------------------------------------------------
    def overlap(self) -> None:
        """Share of each kind of test-split entity the train split's cases use too."""
        train = self.twin.world_entities(self.split_train, self.n_train)
        test = self.twin.world_entities(self.split_test, self.n_test)
        limit = self.th["split_overlap"]
        rule = f"share seen in {self.split_train} <= {limit:g}"
        if train is None or test is None:
            self.report.add(
                "overlap",
                "world entities",
                "warn",
                threshold=rule,
                note="no world_entities(): train/test overlap not measured",
            )
            return
        if not test:
            self.report.add(
                "overlap",
                "world entities",
                "pass",
                threshold=rule,
                note="the twin has no world entities",
            )
            return
        counts = {}
        for kind in sorted(test):
            seen, total = len(test[kind] & train.get(kind, set())), len(test[kind])
            share = seen / total if total else 0.0
            counts[kind] = f"{seen} of {total}"
            status = "fail" if share > limit else "warn" if share > WARN_SHARE * limit else "pass"
            self.report.add(
                "overlap",
                kind,
                status,
                figure=f"{share:.2f} ({seen} of {total})",
                threshold=rule,
                note="test cases reuse train entities: a policy can memorise them"
                if status == "fail"
                else "",
                value=share,
            )
        self.report.details["overlap: test entities seen in train"] = counts
