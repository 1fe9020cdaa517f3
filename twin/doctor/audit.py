"""Statistics behind ``twin check``: the bag-of-words shortcut audit and the truth-leak scan.

Both are small and dependency-free beyond numpy:

* :func:`bag_of_words_audit`: a multinomial naive Bayes on binarised token counts, trained on
  one split's texts, scored on another's, against the rate of always answering the training
  split's majority class. A twin whose prompts give the answer away scores far above that rate.
* :func:`scan_leaks`: which truth strings show up in the visible text of the cases they belong
  to more often than in the text of cases they do not belong to (text every case shows, such as
  a policy that lists every verdict, cancels out).
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AuditResult", "Leak", "bag_of_words_audit", "label_like_values", "scan_leaks", "tokens"]

_TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> set[str]:
    """The distinct lower-case alphanumeric tokens of ``text``."""
    return set(_TOKEN.findall(text.lower()))


@dataclass
class AuditResult:
    """What the classifier scored on the test texts.

    Attributes:
        accuracy: Share of test texts whose label it predicted.
        majority: Share of test texts whose label is the training split's most common one.
        majority_label: That label.
        n_train: Training texts.
        n_test: Test texts.
        classes: Distinct training labels.
    """

    accuracy: float
    majority: float
    majority_label: str
    n_train: int
    n_test: int
    classes: int

    @property
    def margin(self) -> float:
        """How far the classifier beats the majority rate."""
        return self.accuracy - self.majority


def bag_of_words_audit(
    train_texts: Sequence[str],
    train_labels: Sequence[str],
    test_texts: Sequence[str],
    test_labels: Sequence[str],
    alpha: float = 1.0,
) -> AuditResult:
    """Train a naive Bayes on ``train_*`` and score it on ``test_*``.

    Raises:
        ValueError: empty or mismatched inputs.
    """
    import numpy as np

    if not train_texts or not test_texts:
        raise ValueError("bag_of_words_audit needs training and test texts")
    if len(train_texts) != len(train_labels) or len(test_texts) != len(test_labels):
        raise ValueError("bag_of_words_audit: one label per text")
    classes = sorted(set(train_labels))
    majority_label = Counter(train_labels).most_common(1)[0][0]
    majority = sum(label == majority_label for label in test_labels) / len(test_labels)
    train_tokens = [tokens(t) for t in train_texts]
    vocab = {w: i for i, w in enumerate(sorted(set().union(*train_tokens)))}
    x = np.zeros((len(train_texts), len(vocab)), dtype=np.float64)
    for row, toks in enumerate(train_tokens):
        x[row, [vocab[w] for w in toks]] = 1.0
    y = np.array([classes.index(label) for label in train_labels])
    counts = np.stack([x[y == c].sum(axis=0) for c in range(len(classes))]) + alpha
    log_likelihood = np.log(counts / counts.sum(axis=1, keepdims=True))
    log_prior = np.log(np.bincount(y, minlength=len(classes)) / len(y))
    xt = np.zeros((len(test_texts), len(vocab)), dtype=np.float64)
    for row, text in enumerate(test_texts):
        known = [vocab[w] for w in tokens(text) if w in vocab]
        xt[row, known] = 1.0
    predicted = np.argmax(xt @ log_likelihood.T + log_prior, axis=1)
    accuracy = float(np.mean([classes[p] == label for p, label in zip(predicted, test_labels)]))
    return AuditResult(
        accuracy, majority, majority_label, len(train_texts), len(test_texts), len(classes)
    )


def _leaves(value: Any, path: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item, f"{path}[]")
    elif isinstance(value, str):
        yield path, value


def label_like_values(
    truths: Sequence[dict[str, Any]], kinds: Sequence[str], tasks: Sequence[str], min_chars: int
) -> list[set[str]]:
    """Per case, the truth strings worth scanning for: answer classes, not case-specific facts.

    A truth field counts as an answer class when its values repeat across the cases (at most
    half as many distinct values as cases hold it); a case's kind always counts. Strings shorter
    than ``min_chars`` and strings its own task shows (the agent is meant to see those) are left
    out.

    Args:
        truths: Each case's truth.
        kinds: Each case's kind.
        tasks: Each case's task as JSON text.
        min_chars: Shortest string kept.
    """
    per_path: dict[str, list[str]] = {}
    leaves = [list(_leaves(t)) for t in truths]
    for case_leaves in leaves:
        for path, value in case_leaves:
            per_path.setdefault(path, []).append(value)
    categorical = {p for p, values in per_path.items() if len(set(values)) * 2 <= len(values)}
    out = []
    for case_leaves, kind, task in zip(leaves, kinds, tasks):
        keep = {v for p, v in case_leaves if p in categorical} | {kind}
        shown = task.lower()
        out.append({v for v in keep if len(v) >= min_chars and v.lower() not in shown})
    return out


@dataclass
class Leak:
    """A truth string the visible text gives away.

    Attributes:
        value: The string.
        margin: How much more often it shows in its own cases' samples than in the others':
            P(own count > other count) - P(own count < other count) over pairs of samples, in
            [-1, 1]; with presence alone, the difference of the two rates below.
        own_rate: Share of its own cases' samples whose visible text holds it.
        other_rate: Share of the other samples whose visible text holds it.
        own: Samples of its own cases.
        example: The id of one of its own samples that shows it most often.
    """

    value: str
    margin: float
    own_rate: float
    other_rate: float
    own: int
    example: str


def _dominance(own: list[int], other: list[int]) -> float:
    """P(a > b) - P(a < b) for a drawn from ``own`` and b from ``other``."""
    ranked = sorted(other)
    total = 0
    for a in own:
        below = bisect.bisect_left(ranked, a)
        above = len(ranked) - bisect.bisect_right(ranked, a)
        total += below - above
    return total / (len(own) * len(ranked))


def scan_leaks(samples: Sequence[tuple[str, set[str], str]], margin: float) -> list[Leak]:
    """Truth strings whose presence in visible text follows the truth, worst first.

    Occurrences are counted, so a label that every prompt's instructions mention but a leaky
    prompt names once more is still found; text every case shows cancels out.

    Args:
        samples: ``(sample id, the case's truth strings, the visible text)`` per sample (a
            prompt, or the non-terminal tool outputs and infos of one episode).
        margin: Least :attr:`Leak.margin` reported.
    """
    values = sorted(set().union(*(s[1] for s in samples))) if samples else []
    lowered = [(sid, {v.lower() for v in vals}, text.lower()) for sid, vals, text in samples]
    leaks = []
    for value in values:
        low = value.lower()
        pattern = re.compile(r"(?<![a-z0-9_])" + re.escape(low) + r"(?![a-z0-9_])")
        own: list[tuple[int, str]] = []
        other: list[int] = []
        for sid, vals, text in lowered:
            count = len(pattern.findall(text)) if low in text else 0  # substring test: fast path
            if low in vals:
                own.append((count, sid))
            else:
                other.append(count)
        if not own or not other:
            continue
        found = _dominance([c for c, _ in own], other)
        if found >= margin:
            leaks.append(
                Leak(
                    value,
                    found,
                    sum(c > 0 for c, _ in own) / len(own),
                    sum(c > 0 for c in other) / len(other),
                    len(own),
                    max(own)[1],
                )
            )
    return sorted(leaks, key=lambda lk: -lk.margin)
