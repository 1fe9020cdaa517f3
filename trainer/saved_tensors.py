"""Count the bytes autograd keeps for backward: :func:`saved_bytes` and :func:`note_kept`.

Its own module because the learner reports a checkpoint's kept inputs here (:func:`note_kept`)
while :mod:`bench.memory`, which measures the learner, counts them; neither imports the other
for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SavedBytes", "note_kept", "saved_bytes"]

_ACTIVE: list[SavedBytes] = []


@dataclass
class SavedBytes:
    """Bytes of the distinct storages kept for backward while counting."""

    total: int = 0
    _keep: dict[int, Any] = field(default_factory=dict, repr=False)
    _excluded: set[int] = field(default_factory=set, repr=False)
    _inside: int = 0
    _within: bool = False

    def add(self, tensor: Any) -> None:
        """Count ``tensor``'s storage once (when inside a counted module, if any are given)."""
        if not isinstance(tensor, torch.Tensor) or (self._within and self._inside == 0):
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or key in self._keep or storage.nbytes() == 0:
            return
        self._keep[key] = storage  # held: a freed storage's address could come back
        self.total += storage.nbytes()


@contextlib.contextmanager
def saved_bytes(
    exclude: Iterable[torch.Tensor] = (), within: Iterable[torch.nn.Module] | None = None
) -> Iterator[SavedBytes]:
    """Count the bytes autograd keeps for backward inside the block.

    Args:
        exclude: Tensors not to count (the model's parameters: resident anyway).
        within: Count only while one of these modules runs (e.g. the decoder layers).

    Yields:
        A :class:`SavedBytes` whose ``total`` grows as tensors are saved.
    """
    counted = SavedBytes(_excluded={p.untyped_storage().data_ptr() for p in exclude})
    handles = []
    if within is not None:
        counted._within = True

        def enter(*_: Any) -> None:
            counted._inside += 1

        def leave(*_: Any) -> None:
            counted._inside -= 1

        for module in within:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        counted.add(t)
        return t

    _ACTIVE.append(counted)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counted
    finally:
        _ACTIVE.remove(counted)
        for h in handles:
            h.remove()


def note_kept(*tensors: Any) -> None:
    """Count tensors held outside autograd's saved tensors (a checkpoint's inputs)."""
    for counted in _ACTIVE:
        for t in tensors:
            counted.add(t)
