"""Listing text of catalog v2: many seller voices over a grammar of sentence parts.

A description is a handful of sentences (an opener, facts about the item, shipping, returns,
sometimes a condition, a discount, a size, a closer), each composed from independent parts, then
written in one of several voices: plain, terse, spammy, bullet list, all caps, typo-prone,
non-native phrasing, emoji-heavy. Units are written several ways (``12 in``, ``12"``,
``30 cm``). Tokens the store's rules read (condition words, model numbers, batch codes, brand
names) are never altered by a voice. Pools come from ``data/catalog-listings/voices-v2.yaml``.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Any

import yaml

from twin.resources import data_path

__all__ = ["VOICES", "Writer", "pools", "sentences"]

VOICES: tuple[str, ...] = (
    "plain",
    "terse",
    "spammy",
    "bullets",
    "caps",
    "typos",
    "non_native",
    "emoji",
)
_VOICE_WEIGHTS = (0.26, 0.14, 0.1, 0.12, 0.06, 0.12, 0.12, 0.08)
_PROTECTED = re.compile(
    r"(open[- ]box|refurbished|pre-owned|ex-display|clearance|used|batch|lot|"
    r"[A-Z]{2,3}-\d{3,5}[A-Z]?|[A-Z]\d{3,5}-\d{2,4}|really|works|doubles|"
    r"inspired by|dupe of|copy of|replica of|compatible)",
    re.IGNORECASE,
)


@lru_cache(maxsize=1)
def pools() -> dict[str, Any]:
    """``data/catalog-listings/voices-v2.yaml``, loaded once."""
    with open(data_path("catalog-listings", "voices-v2.yaml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


_CUE = re.compile(r"\b(?:really|works as|doubles as)\b", re.IGNORECASE)


def sentences(text: str) -> list[str]:
    """A description cut into sentences (``.``, ``!``, ``?``, bullets and bars end one)."""
    parts = re.split(r"(?<=[.!?])\s+|\s*[•|]\s*|\s+-\s+(?=[A-Za-z])|\n+", text)
    return [p.strip() for p in parts if p and p.strip(" .!?-")]


class Writer:
    """Writes one listing's text from a seeded rng.

    Args:
        rng: The case's generator.
        protect: Strings no voice may alter (brand text, item type, attribute values).
    """

    def __init__(self, rng: random.Random, protect: list[str]) -> None:
        self.rng = rng
        self.p = pools()
        self.voice = rng.choices(VOICES, weights=_VOICE_WEIGHTS)[0]
        self.protect = [x for x in protect if x]

    def pick(self, key: str) -> str:
        return self.rng.choice(self.p[key])

    # -- sentence parts ------------------------------------------------------------------------
    def opener(self, brand: str, item: str) -> str:
        rng = self.rng
        ref = rng.choice(self.p["item_refs"]).format(brand=brand or "our", item=item)
        return f"{self.pick('open_verbs')} {ref} {self.pick('open_quals')}".strip()

    def shipping(self) -> str:
        rng = self.rng
        when = self.pick("ship_when").format(n=rng.randint(1, 5))
        return f"{self.pick('ship_verbs')} {when} {self.pick('ship_extras')}".strip()

    def returns(self) -> str:
        frame = self.pick("returns")
        days = self.rng.choice([7, 14, 30, 30, 60, 90])
        return f"{frame.format(n=days)} {self.pick('returns_tails')}".strip()

    def closer(self) -> str:
        return self.pick("closers")

    def feature(self, attr: tuple[str, str] | None) -> str:
        rng = self.rng
        if attr and rng.random() < 0.5:
            name, value = attr
            return self.pick("value_frames").format(
                name=name, lname=name.lower(), value=value, extra=self.pick("feature_bits")
            )
        return f"{self.pick('feature_bits')} {self.pick('feature_tails')}".strip()

    def size(self) -> str:
        rng = self.rng
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        unit = rng.choice(["in", "inch", "inches", '"', "cm", "mm", " cm", " in"])
        w = rng.choice(
            [
                f"{rng.randint(1, 30)} lb",
                f"{rng.randint(1, 30)}lbs",
                f"{rng.randint(100, 9000)} g",
                f"{rng.uniform(0.2, 12):.1f} kg",
                f"{rng.randint(2, 40)} oz",
            ]
        )
        return self.pick("size_frames").format(
            a=a, b=b, unit=unit.strip() if unit != '"' else '"', w=w
        )

    def condition(self, word: str) -> str:
        return self.pick("condition_frames").format(
            cond=word, detail=self.pick("condition_details")
        )

    def discount(self, percent: int) -> str:
        frame = self.pick("discount_frames").format(p=percent)
        return f"{frame} {self.pick('discount_tails')}".strip()

    # -- voices --------------------------------------------------------------------------------
    def render(self, parts: list[str]) -> str:
        """The sentences in this writer's voice, as one description."""
        rng, v = self.rng, self.voice
        parts = [s.strip() for s in parts if s and s.strip()]
        # a sentence that says what the item really is keeps its full stop: the item's name
        # ends there
        parts = [
            s
            if s[-1] in ".!?:"
            else s + ("." if _CUE.search(s) else rng.choice([".", ".", ".", "!", ""]))
            for s in parts
        ]
        if v == "terse":
            parts = [self._terse(s) for s in parts]
            return rng.choice([" ", ". ", " / "]).join(
                p if _CUE.search(p) else p.rstrip(".") for p in parts
            )
        if v == "spammy":
            parts = [self._spam(s) for s in parts]
            return " ".join(parts)
        if v == "bullets":
            mark = rng.choice(["• ", "- ", "* ", "| ", "> "])
            return " ".join(mark + (p if _CUE.search(p) else p.rstrip(".")) for p in parts)
        if v == "caps":
            return " ".join(self._upper(p) for p in parts)
        if v == "typos":
            return " ".join(self._typos(p) for p in parts)
        if v == "non_native":
            return " ".join(self._non_native(p) for p in parts)
        if v == "emoji":
            return " ".join(
                p + (" " + self.pick("emoji") if rng.random() < 0.6 else "") for p in parts
            )
        return " ".join(parts)

    def title(self, brand: str, item: str, values: list[str]) -> str:
        rng = self.rng
        bits = ([brand] if brand and rng.random() < 0.8 else []) + values[:2] + [item]
        if rng.random() < 0.3:
            rng.shuffle(bits)
        text = self.pick("title_prefixes") + " ".join(bits) + self.pick("title_suffixes")
        if self.voice in ("caps", "spammy") and rng.random() < 0.6:
            text = self._upper(text)
        return re.sub(r"\s+", " ", text).strip()

    def _guarded(self, text: str, fn: Any) -> str:
        """Apply ``fn`` to the words of ``text`` that hold no protected string."""
        keep = [x for x in self.protect if x in text]
        out = []
        for word in text.split(" "):
            if (
                _PROTECTED.search(word)
                or any(word and word in k for k in keep)
                or any(k in word for k in keep)
            ):
                out.append(word)
            else:
                out.append(fn(word))
        return " ".join(out)

    def _upper(self, text: str) -> str:
        return self._guarded(text, str.upper)

    def _terse(self, text: str) -> str:
        words = [
            w
            for w in text.split(" ")
            if w.lower()
            not in {"the", "a", "an", "this", "our", "we", "is", "are", "will", "be", "it", "of"}
        ]
        return " ".join(words).lower() if self.rng.random() < 0.5 else " ".join(words)

    def _spam(self, text: str) -> str:
        rng = self.rng
        if rng.random() < 0.4:
            text = self._upper(text)
        ends = (
            ["!!", "!!!", "!"] if _CUE.search(text) else ["!!", "!!!", " !!", "!", " ***", " <<<"]
        )
        return (
            text.rstrip(".")
            + rng.choice(ends)
            + (" " + self.pick("spam_bits") if rng.random() < 0.35 else "")
        )

    def _typos(self, text: str) -> str:
        rng = self.rng

        def typo(word: str) -> str:
            if len(word) < 4 or not word.isalpha() or rng.random() > 0.18:
                return word
            i = rng.randrange(1, len(word) - 1)
            op = rng.random()
            if op < 0.4:
                return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
            if op < 0.7:
                return word[:i] + word[i + 1 :]
            return word[:i] + word[i] + word[i:]

        return self._guarded(text, typo)

    def _non_native(self, text: str) -> str:
        rng = self.rng
        words = [
            w
            for w in text.split(" ")
            if not (w.lower() in {"the", "a", "an"} and rng.random() < 0.7)
        ]
        text = " ".join(words)
        if rng.random() < 0.35:
            text = text.rstrip(".!") + ", " + self.pick("non_native_bits")
        return text
