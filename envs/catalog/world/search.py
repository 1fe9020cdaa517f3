"""Taxonomy search: a tantivy BM25 index over category names, full paths and synonyms.

The index is built once next to the world's DuckDB file and reopened from disk on warm loads.
Queries never reach tantivy's query language: the text is cut into alphanumeric words first, so
any input (quotes, colons, brackets, emoji) is safe, and junk that has no words returns ``[]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tantivy

from twin.errors import ToolError

__all__ = ["TaxonomyIndex", "build_index", "query_words"]

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_FIELDS = ["name", "synonyms", "full_name"]
# a hit on the node's own name matters most, then a synonym, then an ancestor's name
_BOOSTS = {"name": 3.0, "synonyms": 3.0, "full_name": 1.0}
# words that carry no meaning in a category search (and would match every "X and Y" name)
_STOP = frozenset("a an and or not the for of with in on to by from at as is it its".split())
_MAX_WORD = 40
_MAX_WORDS = 32
MAX_LIMIT = 100
_CACHE_SIZE = 16_384


def query_words(query: str) -> list[str]:
    """The lower-cased words of ``query`` that the index is asked for (at most 32)."""
    words = [w[:_MAX_WORD] for w in _WORD.findall(str(query).lower())]
    kept = [w for w in words if w not in _STOP]
    return (kept or words)[:_MAX_WORDS]


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field("ord", stored=True, indexed=False)
    for name in _FIELDS:
        builder.add_text_field(name, stored=False, tokenizer_name="en_stem")
    return builder.build()


def build_index(path: Path, rows: Iterable[tuple[str, str, str, tuple[str, ...]]]) -> None:
    """Write the index for ``rows`` of ``(id, name, full_name, synonyms)`` into folder ``path``.

    Documents are added in ``rows`` order by one writer thread in one commit, so the index is a
    single segment whose document ids are the row positions (what :class:`TaxonomyIndex` reads).
    """
    path.mkdir(parents=True, exist_ok=True)
    index = tantivy.Index(_schema(), path=str(path), reuse=False)
    writer = index.writer(heap_size=64_000_000, num_threads=1)
    for ord_, (_, name, full_name, synonyms) in enumerate(rows):
        writer.add_document(
            tantivy.Document(
                ord=ord_, name=name, full_name=full_name, synonyms=" ; ".join(synonyms)
            )
        )
    writer.commit()
    writer.wait_merging_threads()


class TaxonomyIndex:
    """A read-only searcher over a built index; one searcher is reused for every query.

    Args:
        path: The index folder written by :func:`build_index`.
        rows: The same ``(id, name, full_name)`` rows, in the same order, as were indexed.
    """

    __slots__ = ("_index", "_searcher", "_rows", "_by_doc", "_name_lower", "_cache", "_words")

    def __init__(self, path: Path, rows: list[tuple[str, str, str]]) -> None:
        self._index = tantivy.Index.open(str(path))
        self._searcher = self._index.searcher()
        self._rows = rows
        # one segment: doc ids are insertion positions, no stored-field read per hit
        self._by_doc = self._searcher.num_segments == 1
        self._name_lower = [r[1].lower() for r in rows]
        # GRPO groups replay one case many times: remember recent answers (bounded)
        self._cache: dict[tuple[str, int], tuple[tuple[str, str, str, float], ...]] = {}
        # one parsed (analysed, boosted, multi-field) query per word: the taxonomy's vocabulary
        # is small, so a query is an OR of cached parts instead of a fresh parse
        self._words: dict[str, tantivy.Query] = {}
        if self._searcher.num_docs != len(rows):
            raise ValueError(
                f"taxonomy index at {path} has {self._searcher.num_docs} documents but the world "
                f"has {len(rows)} categories; delete the cache folder to rebuild it"
            )

    def search(self, query: str, limit: int = 10) -> list[dict[str, Any]]:
        """Hits for ``query``, best first: ``{"id", "name", "full_name", "score"}``.

        An exact (case-insensitive) match of a category's own name is ranked first.

        Raises:
            ToolError: ``limit`` is not an integer between 1 and 100.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ToolError(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
        key = (str(query), limit)
        found = self._cache.get(key)
        if found is None:
            found = self._search(str(query), limit)
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = found
        return [{"id": i, "name": n, "full_name": f, "score": s} for i, n, f, s in found]

    def _search(self, query: str, limit: int) -> tuple[tuple[str, str, str, float], ...]:
        words = query_words(query)
        if not words:
            return ()
        parts = []
        for word in dict.fromkeys(words):
            part = self._words.get(word)
            if part is None:
                if len(self._words) >= _CACHE_SIZE:
                    self._words.clear()
                part = self._words[word] = self._index.parse_query(
                    word, _FIELDS, field_boosts=_BOOSTS
                )
            parts.append((tantivy.Occur.Should, part))
        parsed = parts[0][1] if len(parts) == 1 else tantivy.Query.boolean_query(parts)
        # fetch a few extra so that an exact name match just below the cut can move up
        hits = self._searcher.search(parsed, limit + 5, count=False).hits
        if not hits:
            # nothing matched exactly: forgive one typo in the longer words ("headphnes")
            long_words = [w for w in words if len(w) >= 5]
            if long_words:
                fuzzy = self._index.parse_query(
                    " ".join(long_words),
                    ["name", "synonyms"],
                    field_boosts=_BOOSTS,
                    fuzzy_fields={"name": (False, 1, True), "synonyms": (False, 1, True)},
                )
                hits = self._searcher.search(fuzzy, limit, count=False).hits
        wanted = " ".join(str(query).lower().split())
        out = []
        for score, address in hits:
            ord_ = address.doc if self._by_doc else self._searcher.doc(address)["ord"][0]
            cid, name, full_name = self._rows[ord_]
            exact = self._name_lower[ord_] == wanted
            out.append((not exact, -score, cid, name, full_name, score))
        out.sort(key=lambda t: (t[0], t[1], t[2]))
        return tuple(
            (cid, name, full_name, round(float(score), 4))
            for _, _, cid, name, full_name, score in out[:limit]
        )
