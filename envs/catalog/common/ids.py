"""Listing ids every catalog version shows the agent: opaque, keyed, the same on every machine."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache

__all__ = ["find_listing_id", "listing_id"]


@lru_cache(maxsize=16)
def _id_key(twin: str, seed: int) -> bytes:
    return hashlib.sha256(f"{twin}\x1f{seed}\x1flisting-id-key".encode()).digest()


def listing_id(twin: str, seed: int, split: str, index: int) -> str:
    """The listing id shown to the agent for case ``(split, index)``: ``LST-`` and 12 letters
    and digits of a keyed BLAKE2b hash of the case's address.

    The id is opaque: it tells the agent nothing about the split, the index or (through the
    kind schedule, a public function of both) the case's kind, yet the same seed gives the same
    ids on every machine. Only the twin maps an id back (``case_of_listing``).
    """
    digest = hashlib.blake2b(
        f"{split}\x1f{index}".encode(), key=_id_key(twin, seed), digest_size=10
    ).digest()
    return "LST-" + base64.b32encode(digest).decode()[:12]


_LISTING_RE = re.compile(r"LST-[A-Z2-7]{12}")


def find_listing_id(text: str) -> str | None:
    """The first listing id in ``text`` (None when there is none)."""
    match = _LISTING_RE.search(text)
    return match.group(0) if match else None
