"""A small CART decision tree (Gini, numeric features, depth-limited), for ``twin check``'s
question: how close does a tree on tool-output features come to the ceiling?"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

__all__ = ["DecisionTree"]


class DecisionTree:
    """Greedy CART classifier.

    Args:
        max_depth: Deepest split level (depth 3: at most 8 leaves).
        min_leaf: Fewest training rows in a leaf.
        bins: Candidate thresholds per feature (quantiles of the node's values).
    """

    def __init__(self, max_depth: int, min_leaf: int = 5, bins: int = 32) -> None:
        self.max_depth, self.min_leaf, self.bins = max_depth, min_leaf, bins
        self.root: Any = None

    def fit(self, x: np.ndarray, y: list[str]) -> DecisionTree:
        """Fit on rows ``x`` (n x features) and labels ``y``."""
        self.classes = sorted(set(y))
        yi = np.array([self.classes.index(v) for v in y])
        self.root = self._grow(np.asarray(x, dtype=float), yi, 0)
        return self

    def _leaf(self, y: np.ndarray) -> tuple[str, int]:
        return ("leaf", int(Counter(y.tolist()).most_common(1)[0][0]))

    def _grow(self, x: np.ndarray, y: np.ndarray, depth: int) -> Any:
        if depth >= self.max_depth or len(set(y.tolist())) == 1 or len(y) < 2 * self.min_leaf:
            return self._leaf(y)
        best = None
        k = len(self.classes)
        for f in range(x.shape[1]):
            col = x[:, f]
            cuts = np.unique(np.quantile(col, np.linspace(0, 1, self.bins + 2)[1:-1]))
            for c in cuts:
                left = col <= c
                nl = int(left.sum())
                if nl < self.min_leaf or len(y) - nl < self.min_leaf:
                    continue
                gl = 1 - ((np.bincount(y[left], minlength=k) / nl) ** 2).sum()
                gr = 1 - ((np.bincount(y[~left], minlength=k) / (len(y) - nl)) ** 2).sum()
                score = nl * gl + (len(y) - nl) * gr
                if best is None or score < best[0]:
                    best = (score, f, float(c), left)
        if best is None:
            return self._leaf(y)
        _, f, c, left = best
        return (
            "split",
            f,
            c,
            self._grow(x[left], y[left], depth + 1),
            self._grow(x[~left], y[~left], depth + 1),
        )

    def predict(self, x: np.ndarray) -> list[str]:
        """The predicted label of every row."""
        out = []
        for row in np.asarray(x, dtype=float):
            node = self.root
            while node[0] == "split":
                node = node[3] if row[node[1]] <= node[2] else node[4]
            out.append(self.classes[node[1]])
        return out
