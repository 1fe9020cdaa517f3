"""Case mixes: which kind each case of a split is, drawn in seeded, shuffled cycles.

Both catalog versions plant kinds the same way; they differ in their kinds, the cycle length and
the seed salt (so v1 never shares a kind order with v0)::

    KINDS_V0 = KindMix(KINDS, cycle=50, salt="kinds")
    KINDS_V0.validate({"clean": 3, "counterfeit_price": 1})          # normalised to sum 1
    KINDS_V0.kind_for("Catalog", 0, "test", 7, mix)                  # the same on every machine

Stratifying by cycle (rather than drawing each case's kind independently) guarantees that every
kind of the mix appears in any split of at least one cycle's length.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from functools import lru_cache

from twin.cases import stable_seed
from twin.errors import ConfigError

__all__ = ["KindMix"]


@lru_cache(maxsize=64)
def _slots(
    kinds: tuple[str, ...], cycle: int, mix_items: tuple[tuple[str, float], ...]
) -> tuple[str, ...]:
    """One cycle of kinds: largest-remainder counts over ``cycle`` slots, each kind at least
    once."""
    raw = {k: w * cycle for k, w in mix_items}
    counts = {k: max(1, int(v)) for k, v in raw.items()}
    left = cycle - sum(counts.values())
    for k in sorted(raw, key=lambda k: (-(raw[k] - int(raw[k])), kinds.index(k)))[: max(left, 0)]:
        counts[k] += 1
    return tuple(k for k in kinds if k in counts for _ in range(counts[k]))


@lru_cache(maxsize=4096)
def _order(
    kinds: tuple[str, ...],
    cycle: int,
    salt: str,
    twin: str,
    seed: int,
    split: str,
    n: int,
    mix_items: tuple,
) -> tuple[str, ...]:
    order = list(_slots(kinds, cycle, mix_items))
    random.Random(stable_seed(twin, seed, split, salt, n)).shuffle(order)
    return tuple(order)


class KindMix:
    """A catalog version's case kinds and how a mix of them is laid over a split.

    Args:
        kinds: Every kind, in a fixed order (ties in the slot counts go to the earlier one).
        cycle: Slots per cycle.
        salt: Mixed into the seed of each cycle's shuffle.
    """

    def __init__(self, kinds: tuple[str, ...], cycle: int, salt: str) -> None:
        self.kinds = tuple(kinds)
        self.cycle = cycle
        self.salt = salt

    def validate(self, mix: Mapping[str, float]) -> dict[str, float]:
        """Check a case mix and return it normalised to sum 1.

        Raises:
            ConfigError: an unknown kind, a negative share, or no positive share at all.
        """
        unknown = sorted(set(mix) - set(self.kinds))
        if unknown:
            raise ConfigError(
                f"case_mix: unknown case kinds {unknown}; known kinds: {', '.join(self.kinds)}"
            )
        bad = {k: v for k, v in mix.items() if not v >= 0}
        if bad:
            raise ConfigError(f"case_mix: shares must be >= 0, got {bad}")
        total = float(sum(mix.values()))
        if total <= 0:
            raise ConfigError(
                f"case_mix: at least one kind needs a positive share, got {dict(mix)}"
            )
        return {k: float(mix[k]) / total for k in self.kinds if mix.get(k, 0) > 0}

    def kind_for(
        self, twin: str, seed: int, split: str, index: int, mix: Mapping[str, float]
    ) -> str:
        """The kind of case ``(split, index)``: a seeded shuffle of the mix in cycles of slots."""
        items = tuple(sorted(self.validate(mix).items()))
        slots = _slots(self.kinds, self.cycle, items)
        order = _order(
            self.kinds, self.cycle, self.salt, twin, seed, split, index // len(slots), items
        )
        return order[index % len(slots)]
