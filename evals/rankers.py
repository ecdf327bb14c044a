"""Rankers compared by the eval run, all behind one tiny interface.

A ranker factory takes the tool list and returns an index with ``search(query, top_k) -> [(tool, score)]``,
best first, zero scores dropped -- the same contract as ``coffer.SearchIndex``. Comparators (rank_bm25,
bm25s) are dev/test-only dependencies: they are imported lazily and a missing one raises
``RankerUnavailable`` so the run can print a note and carry on. A later semantic ranker (``--embedder``)
slots in as one more factory in ``available_rankers``.
"""

from __future__ import annotations

from typing import Callable

Hit = tuple  # (tool_dict, score_float)


class RankerUnavailable(Exception):
    """A ranker cannot run here (package not installed, or not implemented yet)."""


def tool_text(tool: dict) -> str:
    """The "name description" text the BM25 comparators index (no schema, as their usual setup)."""
    return f"{tool.get('name', '')} {tool.get('description') or ''}"


def _top_hits(tools: list[dict], scores, top_k: int) -> list[Hit]:
    """Best-first (tool, score) pairs with positive score; stable on ties (catalogue order)."""
    order = sorted(range(len(tools)), key=lambda i: -float(scores[i]))
    return [(tools[i], float(scores[i])) for i in order[:top_k] if float(scores[i]) > 0.0]


class RankBM25Index:
    """BM25Okapi from rank_bm25 on lowercased whitespace tokens of "name description"."""

    def __init__(self, tools: list[dict]):
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as exc:
            raise RankerUnavailable("rank_bm25 is not installed (pip install rank-bm25)") from exc
        self.tools = tools
        self.bm25 = BM25Okapi([tool_text(t).lower().split() or [""] for t in tools])

    def search(self, query: str, top_k: int = 10) -> list[Hit]:
        tokens = query.lower().split()
        if not tokens:
            return []
        return _top_hits(self.tools, self.bm25.get_scores(tokens), top_k)


class BM25SIndex:
    """bm25s with its default tokenizer (lowercase, \\w\\w+ tokens, English stopwords), stemming off."""

    def __init__(self, tools: list[dict]):
        try:
            import bm25s
        except ImportError as exc:
            raise RankerUnavailable("bm25s is not installed (pip install bm25s)") from exc
        self._bm25s = bm25s
        self.tools = tools
        corpus = bm25s.tokenize([tool_text(t) for t in tools], stemmer=None, show_progress=False)
        self.model = bm25s.BM25()
        self.model.index(corpus, show_progress=False)
        self.vocab = set(self.model.vocab_dict)

    def search(self, query: str, top_k: int = 10) -> list[Hit]:
        tokens = self._bm25s.tokenize([query], stemmer=None, return_ids=False, show_progress=False)[0]
        tokens = [t for t in tokens if t in self.vocab]
        if not tokens:
            return []
        return _top_hits(self.tools, self.model.get_scores(tokens), top_k)


def coffer_factory(tools: list[dict]):
    """coffer.SearchIndex, the ranker under test (the repo root is put on sys.path by evals.run)."""
    try:
        import coffer
    except ImportError as exc:
        raise RankerUnavailable(f"coffer could not be imported: {exc}") from exc
    if not hasattr(coffer, "SearchIndex"):
        raise RankerUnavailable("coffer.SearchIndex does not exist yet")
    return coffer.SearchIndex(tools)


def embedder_factory(url: str) -> Callable[[list[dict]], object]:
    """Placeholder for semantic ranking against an embedding endpoint (a later issue implements it)."""

    def build(tools: list[dict]):
        raise RankerUnavailable(f"embedder ranker ({url}) is not implemented yet")

    return build


def available_rankers(embedder_url: str | None = None) -> dict[str, Callable[[list[dict]], object]]:
    """Ranker name -> factory, in table order; coffer first since it is the one gated."""
    rankers: dict[str, Callable[[list[dict]], object]] = {
        "coffer": coffer_factory,
        "rank_bm25": RankBM25Index,
        "bm25s": BM25SIndex,
    }
    if embedder_url:
        rankers["embedder"] = embedder_factory(embedder_url)
    return rankers
