"""Shortcut and held-out audits of the catalog twin (the figures in ``envs/catalog/README.md``).

- :func:`bow_audit`: how well a bag-of-words classifier trained on the train split's prompts
  predicts the verdict of test prompts, against the majority rate. A twin whose verdict is in the
  words (v0) scores far above the majority; v1's verdicts live in the tools.
- :func:`entity_overlap`: the world entities (brands, sellers, recall notices) of the test
  split's listings that also appear in train listings.

Run ``python -m envs.catalog.audit [--version 1] [--taxonomy PATH]``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from typing import Any

import numpy as np

__all__ = ["bow_audit", "entity_overlap", "main"]

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def _prompt_text(twin: Any, split: str, index: int) -> tuple[str, str]:
    case = twin.case(split, index)
    user = next(m["content"] for m in twin.prompt(case) if m["role"] == "user")
    return user, str(case.truth["verdict"])


def _features(texts: list[str], vocab: dict[str, int]) -> np.ndarray:
    x = np.zeros((len(texts), len(vocab)), dtype=np.float32)
    for i, text in enumerate(texts):
        for tok in set(_TOKEN.findall(text.lower())):
            j = vocab.get(tok)
            if j is not None:
                x[i, j] = 1.0
    return x


def bow_audit(
    twin: Any, train_cases: int = 3000, test_split: str = "test", epochs: int = 200, seed: int = 0
) -> dict[str, Any]:
    """Train bag-of-words verdict classifiers on train prompts, score them on ``test_split``.

    Two classifiers, the better one reported: multinomial naive Bayes and L2 logistic regression
    (full-batch gradient descent) over binary word features (words seen in >= 2 train prompts).

    Returns:
        ``accuracy`` (the better classifier's), ``naive_bayes``, ``logistic``, ``majority_rate``
        (share of the test split's most common verdict), ``margin`` (accuracy - majority rate),
        ``train_cases``, ``test_cases``.
    """
    n_train = min(train_cases, twin.num_cases("train"))
    train = [_prompt_text(twin, "train", i) for i in range(n_train)]
    test = [_prompt_text(twin, test_split, i) for i in range(twin.num_cases(test_split))]
    df = Counter(tok for text, _ in train for tok in set(_TOKEN.findall(text.lower())))
    vocab = {tok: j for j, tok in enumerate(sorted(t for t, c in df.items() if c >= 2))}
    labels = sorted({y for _, y in train} | {y for _, y in test})
    ytr = np.array([labels.index(y) for _, y in train])
    yte = np.array([labels.index(y) for _, y in test])
    xtr, xte = _features([t for t, _ in train], vocab), _features([t for t, _ in test], vocab)
    # naive Bayes (Laplace smoothing)
    logp = []
    for k in range(len(labels)):
        rows = xtr[ytr == k]
        counts = rows.sum(axis=0) + 1.0
        logp.append(
            (np.log(counts / counts.sum()), np.log((len(rows) + 1) / (len(ytr) + len(labels))))
        )
    nb_scores = np.stack([xte @ lp + prior for lp, prior in logp], axis=1)
    nb_acc = float((nb_scores.argmax(axis=1) == yte).mean())
    # logistic regression
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.01, (xtr.shape[1], len(labels))).astype(np.float32)
    b = np.zeros(len(labels), dtype=np.float32)
    onehot = np.eye(len(labels), dtype=np.float32)[ytr]
    for _ in range(epochs):
        z = xtr @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(ytr)
        w -= 0.5 * (xtr.T @ g + 1e-3 * w)
        b -= 0.5 * g.sum(axis=0)
    lr_acc = float(((xte @ w + b).argmax(axis=1) == yte).mean())
    majority = max(Counter(yte.tolist()).values()) / len(yte)
    acc = max(nb_acc, lr_acc)
    return {
        "accuracy": round(acc, 3),
        "naive_bayes": round(nb_acc, 3),
        "logistic": round(lr_acc, 3),
        "majority_rate": round(majority, 3),
        "margin": round(acc - majority, 3),
        "train_cases": n_train,
        "test_cases": len(yte),
    }


def entity_overlap(twin: Any, test_split: str = "test") -> dict[str, dict[str, int]]:
    """For each entity kind: how many of ``test_split``'s entities, and how many also in train."""
    test = twin.world_entities(test_split)
    train = twin.world_entities("train")
    return {k: {"test": len(v), "in_train": len(v & train.get(k, set()))} for k, v in test.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the bag-of-words audit and the entity overlap for one catalog version."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--taxonomy", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-cases", type=int, default=3000)
    args = ap.parse_args(argv)
    from envs.catalog import CatalogTwin, CatalogTwinV1

    cls = CatalogTwinV1 if args.version == 1 else CatalogTwin
    twin = cls(seed=args.seed, taxonomy_path=args.taxonomy)
    print("bag-of-words verdict audit:", bow_audit(twin, train_cases=args.train_cases))
    if args.version == 1:
        print("test entities also in train:", entity_overlap(twin))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
