"""What the case generators of every catalog version forge: prices, model numbers, batch codes,
altered brand names, and where a seller states an attribute.

Every function draws from the ``rng`` it is given, so the same draw gives the same bytes.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

__all__ = [
    "HOMOGLYPHS",
    "LEET",
    "batch_code",
    "fmt_price",
    "lookalike",
    "model_number",
    "near_batch",
    "near_model",
    "state_value",
    "typosquat",
    "unaffected_batch",
]


#: Letters and the digits that imitate them in a typosquatted brand ("N1ke").
LEET = {"i": "1", "o": "0", "e": "3", "a": "4", "s": "5", "l": "1", "t": "7"}

#: Latin letters and the look-alikes from other scripts (Cyrillic, Greek) counterfeiters use.
HOMOGLYPHS: dict[str, str] = {
    "a": "\u0430",
    "c": "\u0441",
    "e": "\u0435",
    "i": "\u0456",
    "j": "\u0458",
    "o": "\u043e",
    "p": "\u0440",
    "s": "\u0455",
    "x": "\u0445",
    "y": "\u0443",
    "v": "\u03bd",
    "A": "\u0410",
    "B": "\u0412",
    "C": "\u0421",
    "E": "\u0415",
    "H": "\u041d",
    "I": "\u0406",
    "K": "\u041a",
    "M": "\u041c",
    "N": "\u039d",
    "O": "\u041e",
    "P": "\u0420",
    "T": "\u0422",
    "X": "\u0425",
    "Y": "\u03a5",
    "Z": "\u0396",
}


def fmt_price(rng: random.Random, value: float) -> float:
    value = max(value, 0.5)
    if value >= 20 and rng.random() < 0.5:  # retail-style .99 endings (rounded up: <= 5% off)
        return round(int(value) + 0.99, 2)
    return round(value, 2)


def model_number(rng: random.Random, avoid: frozenset[str]) -> str:
    for _ in range(20):
        letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(2, 3)))
        model = f"{letters}-{rng.randint(100, 9999)}"
        if model not in avoid:
            return model
    return f"ZZ-{rng.randint(10000, 99999)}"


def typosquat(rng: random.Random, name: str) -> str:
    """Alter a brand name the way counterfeiters dodge keyword takedowns ("Nikey", "N1ke")."""
    words = name.split(" ")
    pos = max(range(len(words)), key=lambda i: (len(words[i]), -i))  # alter the longest word
    word = words[pos]
    letters = [i for i, ch in enumerate(word) if ch.isalpha()]
    ops = ["leet", "double", "suffix", "swap", "drop", "vowel"]
    op = rng.choice(ops)
    if op == "leet":
        cands = [i for i in letters if word[i].lower() in LEET]
        if cands:
            i = rng.choice(cands)
            word = word[:i] + LEET[word[i].lower()] + word[i + 1 :]
        else:
            op = "suffix"
    if op == "double" and letters:
        i = rng.choice(letters)
        word = word[: i + 1] + word[i] + word[i + 1 :]
    elif op == "swap" and len(letters) >= 3:
        i = rng.choice(letters[1:-1])
        word = word[:i] + word[i + 1] + word[i] + word[i + 2 :] if i + 1 < len(word) else word + "e"
    elif op == "drop" and len(letters) >= 5:
        i = rng.choice(letters[1:])
        word = word[:i] + word[i + 1 :]
    elif op == "vowel":
        cands = [i for i in letters if word[i].lower() in "aeiou"]
        if cands:
            i = rng.choice(cands)
            repl = rng.choice([v for v in "aeiouy" if v != word[i].lower()])
            word = word[:i] + (repl.upper() if word[i].isupper() else repl) + word[i + 1 :]
        else:
            word += "z"
    elif op in ("suffix", "swap", "drop"):
        word += rng.choice(["y", "z", "e", "ey", "x"])
    words[pos] = word
    return " ".join(words)


def state_value(
    rng: random.Random,
    name: str,
    value: str,
    specifics: dict[str, str],
    desc: list[str],
    free_phrases: Sequence[str],
) -> None:
    """Write an attribute's value where a seller would: item specifics (70%), a plain
    ``name: value.`` sentence (15%) or a free phrase of the description (15%)."""
    roll = rng.random()
    if roll < 0.7:
        specifics[name] = value
    elif roll < 0.85:
        desc.append(f"{name}: {value}.")
    else:
        desc.append(rng.choice(free_phrases).format(value=value))


def batch_code(rng: random.Random) -> str:
    return f"L{rng.randint(1900, 2599)}-{rng.randint(100, 999)}"


def near_batch(rng: random.Random, batch: str) -> str:
    """A batch code next to ``batch`` (``L1940-941`` -> ``L1940-944``)."""
    m = re.match(r"^(.*?)(\d+)$", batch)
    if not m:
        return batch + "B"
    num = int(m.group(2)) + rng.choice([-3, -2, -1, 1, 2, 3])
    return f"{m.group(1)}{max(num, 0):0{len(m.group(2))}d}"


def unaffected_batch(rng: random.Random, batches: tuple[str, ...]) -> str:
    for _ in range(20):
        b = near_batch(rng, rng.choice(batches))
        if b not in batches:
            return b
    return batch_code(rng)


def near_model(rng: random.Random, model: str, avoid: frozenset[str]) -> str:
    """A model number one digit or suffix away from ``model`` that is not recalled."""
    for _ in range(20):
        m = re.match(r"^([A-Z]+-)(\d+)([A-Z]?)$", model)
        if not m:
            break
        head, digits, suffix = m.groups()
        roll = rng.random()
        if roll < 0.4 and len(digits) >= 2:
            i = rng.randrange(len(digits))
            digits = digits[:i] + str((int(digits[i]) + rng.randint(1, 9)) % 10) + digits[i + 1 :]
        elif roll < 0.7:
            suffix = rng.choice([c for c in "ABCDEFGHJKLMNPRSTUVWXYZ" if c != suffix])
        else:
            digits = digits[::-1] if digits[::-1] != digits else digits + "0"
        cand = head + digits + suffix
        if cand != model and cand not in avoid:
            return cand
    return model_number(rng, avoid)


def lookalike(rng: random.Random, name: str) -> str:
    """Alter ``name`` the way counterfeiters dodge keyword filters, often beyond one edit."""
    op = rng.choice(["homoglyph", "homoglyph", "spacing", "punct", "leet", "misspell", "combo"])
    text = name
    if op in ("homoglyph", "combo"):
        idx = [i for i, ch in enumerate(text) if ch in HOMOGLYPHS]
        for i in rng.sample(idx, min(len(idx), rng.randint(1, 2))):
            text = text[:i] + HOMOGLYPHS[text[i]] + text[i + 1 :]
    if op in ("spacing", "combo"):
        words = text.split(" ")
        if len(words) > 1 and rng.random() < 0.5:
            text = "".join(words)
        else:
            w = max(range(len(words)), key=lambda i: len(words[i]))
            word = words[w]
            if len(word) >= 4:
                cut = rng.randint(2, len(word) - 2)
                words[w] = word[:cut] + " " + word[cut:]
            text = " ".join(words)
    if op == "punct":
        pos = rng.randint(1, max(1, len(text) - 1))
        text = text[:pos] + rng.choice(["-", ".", "_", "'", "\u00b7"]) + text[pos:]
    if op == "leet":
        leet = {"o": "0", "i": "1", "e": "3", "a": "4", "s": "5", "l": "1"}
        idx = [i for i, ch in enumerate(text) if ch.lower() in leet]
        for i in rng.sample(idx, min(len(idx), rng.randint(1, 2))):
            text = text[:i] + leet[text[i].lower()] + text[i + 1 :]
    if op == "misspell":
        text = typosquat(rng, text)
        if rng.random() < 0.5:
            text = typosquat(rng, text)
    return text
