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


class EmbeddingRanker:
    """coffer's semantic ranking, alone ("semantic") or fused with BM25 ("hybrid"), against a real endpoint.

    Tool texts are embedded once at build time and query texts once in ``prepare`` (both through
    coffer.Embedder, the client the gateway uses), so per-query latency is the ranking work alone; the
    embedder's own time is reported by the benchmark, not here.
    """

    def __init__(self, tools, embedder, mode: str):
        import coffer
        self.coffer, self.mode, self.embedder = coffer, mode, embedder
        self.lexical = coffer.SearchIndex(tools)
        try:
            vectors = embedder.embed([coffer.embedding_text(t) for t in tools], 600.0)
        except coffer.EmbedderError as exc:
            raise RankerUnavailable(f"embedder failed: {exc}") from exc
        self.semantic = coffer.SemanticIndex(self.lexical.tools, vectors)
        self.query_vectors: dict[str, list[float]] = {}

    def prepare(self, queries: list[str]) -> None:
        missing = [q for q in dict.fromkeys(queries) if q not in self.query_vectors]
        if missing:
            self.query_vectors.update(zip(missing, self.embedder.embed(missing, 600.0)))

    def search(self, query: str, top_k: int = 10):
        if query not in self.query_vectors:
            self.prepare([query])
        tools = self.lexical.tools
        semantic = self.semantic.rank(self.query_vectors[query], 50 if self.mode == "hybrid" else top_k)
        if self.mode == "semantic":
            return [(tools[doc], score) for doc, score in semantic[:top_k]]
        lexical = self.lexical.rank(query, 50)
        return [(tools[doc], score) for doc, score in self.coffer.fuse(lexical, semantic, top_k)]


def embedder_factories(url: str, model: str, api: str) -> dict[str, Callable[[list[dict]], object]]:
    """The "semantic" and "hybrid" rankers for an embeddings endpoint (OpenAI-compatible or Ollama)."""
    import coffer
    embedder = coffer.Embedder(url, model, api)
    return {mode: (lambda tools, mode=mode: EmbeddingRanker(tools, embedder, mode)) for mode in ("semantic", "hybrid")}


def available_rankers(embedder_url: str | None = None, embedder_model: str = "all-MiniLM-L6-v2",
                      embedder_api: str = "openai") -> dict[str, Callable[[list[dict]], object]]:
    """Ranker name -> factory, in table order; coffer first since it is the one gated."""
    rankers: dict[str, Callable[[list[dict]], object]] = {
        "coffer": coffer_factory,
        "rank_bm25": RankBM25Index,
        "bm25s": BM25SIndex,
    }
    if embedder_url:
        rankers.update(embedder_factories(embedder_url, embedder_model, embedder_api))
    return rankers
