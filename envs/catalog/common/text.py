"""What the store's rules of every catalog version read from a listing's own words: its text,
the model numbers and batch codes it states, and the names it says the item copies (each
version brings its own copy wording and stop words)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "BATCH_RE",
    "MODEL_RE",
    "copied_names",
    "drop_possessives",
    "listing_text",
    "names_value",
    "stated_batches",
    "stated_models",
]

#: A model number (``AB-1234``, ``XYZ-120C``).
MODEL_RE = re.compile(r"\b[A-Z]{2,3}-\d{3,5}[A-Z]?\b")
#: A batch or lot code with its label (``batch no. L1940-941``); group 1 is the code.
BATCH_RE = re.compile(
    r"\b(?:batch|lot)\s*(?:no\.?|code|number|#)?\s*:?\s*([A-Z]\d{3,5}-\d{2,4})\b", re.IGNORECASE
)


def listing_text(listing: Mapping[str, Any]) -> str:
    """Title, description and item specifics as one text."""
    specifics: Mapping[str, Any] = listing.get("specifics") or {}
    return " ".join(
        [
            str(listing.get("title", "")),
            str(listing.get("description", "")),
            *(f"{k}: {v}." for k, v in specifics.items()),
        ]
    )


def stated_models(text: str) -> set[str]:
    """Model numbers written in the listing."""
    return set(MODEL_RE.findall(text))


def stated_batches(text: str) -> set[str]:
    """Batch or lot codes written in the listing."""
    return {b.upper() for b in BATCH_RE.findall(text)}


def copied_names(pattern: re.Pattern[str], stop: Collection[str], text: str) -> list[str]:
    """The names ``text`` presents the item as a copy of: group 1 of each ``pattern`` match, cut
    where the sentence's own words resume (the first word in ``stop``), without repeats."""
    out: list[str] = []
    for m in pattern.finditer(text):
        words = m.group(1).strip().split()
        cut = next((i for i, w in enumerate(words) if w.lower() in stop), len(words))
        name = " ".join(words[:cut]).strip(" '\"")
        if name and name not in out:
            out.append(name)
    return out


def drop_possessives(text: str) -> str:
    """``text`` in lower case without possessive endings (``"Kids' Bags"`` -> ``"kids bags"``)."""
    return re.sub(r"'s?\b", "", text.lower())


def names_value(value: str, text: str) -> bool:
    """Whether ``text`` (already :func:`drop_possessives`'d) names ``value`` as a whole word."""
    return (
        re.search(r"(?<![a-z0-9])" + re.escape(drop_possessives(value)) + r"(?![a-z0-9])", text)
        is not None
    )
