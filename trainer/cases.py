"""Which training cases a run visits, in which order: one seeded draw both loops share.

Position ``c`` of a run's case stream (the data cursor, saved in checkpoints) maps to a case by a
pure function of ``(seed, c)``, so a resumed run, the synchronous loop and the async rollout
worker all visit the same cases in the same order.

``balance="kind"`` deals positions round-robin over the case kinds (``Case.kind``): position
``c`` takes kind ``c % K`` and is that kind's ``c // K``-th case in the plain seeded order. Every
step then sees the kinds in equal shares, so the common push of an unlucky step (say, six of eight
prompts asking for the same answer) cannot drag the shared logits towards one answer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from twin.cases import stable_seed
from twin.core import Twin

__all__ = ["Balance", "draw_cases", "KIND_SCAN"]

#: How cases are spread over a run: ``none`` (the plain seeded draw) or ``kind`` (round-robin).
Balance = Literal["none", "kind"]

#: The kinds a balanced stream deals are those seen in this many first draws.
KIND_SCAN = 256


def _nth(seed: int, c: int, total: int) -> int:
    return stable_seed("cases", seed, c) % total


class _KindStream:
    """The plain seeded draw split by kind, extended lazily (a pure function of the seed)."""

    def __init__(self, twin: Twin, split: str, seed: int) -> None:
        self.twin, self.split, self.seed = twin, split, seed
        self.total = twin.num_cases(split)
        self.scanned = 0
        self.by_kind: dict[str, list[int]] = {}
        self._scan(min(KIND_SCAN, max(self.total, 1)))
        self.kinds = sorted(self.by_kind)

    def _scan(self, upto: int) -> None:
        while self.scanned < upto:
            index = _nth(self.seed, self.scanned, self.total)
            kind = self.twin.case(self.split, index).kind
            self.by_kind.setdefault(kind, []).append(index)
            self.scanned += 1

    def case(self, c: int) -> int:
        kind = self.kinds[c % len(self.kinds)]
        j = c // len(self.kinds)
        found = self.by_kind[kind]
        # Each kind was seen in the first scan, so it recurs; bound the scan all the same.
        limit = self.scanned + 1000 * KIND_SCAN
        while len(found) <= j and self.scanned < limit:
            self._scan(self.scanned + KIND_SCAN)
        return found[j % len(found)]


@lru_cache(maxsize=16)
def _stream(twin: Twin, split: str, seed: int) -> _KindStream:
    return _KindStream(twin, split, seed)


def draw_cases(
    twin: Twin, split: str, seed: int, start: int, n: int, *, balance: Balance = "none"
) -> list[tuple[str, int]]:
    """The cases at stream positions ``start .. start + n - 1``.

    Args:
        twin: The twin the cases come from.
        split: The split to draw from.
        seed: The run's seed.
        start: The data cursor (the first position to return).
        n: How many positions.
        balance: ``"none"`` or ``"kind"`` (see the module docstring).

    Returns:
        ``(split, index)`` pairs, the same on every machine for the same arguments.
    """
    total = twin.num_cases(split)
    if balance == "none":
        return [(split, _nth(seed, c, total)) for c in range(start, start + n)]
    if balance != "kind":
        raise ValueError(f"balance must be 'none' or 'kind', got {balance!r}")
    stream = _stream(twin, split, seed)
    return [(split, stream.case(c)) for c in range(start, start + n)]
