"""Rankers compared by the eval run, all behind one tiny interface.

A ranker factory takes the tool list and returns an index with ``search(query, top_k) -> [(tool, score)]``,
best first, zero scores dropped -- the same contract as ``coffer.SearchIndex``. ``bm25f`` is the plain
field-weighted reference the gate compares coffer with (pure Python, always available). Comparators (rank_bm25,
bm25s) are dev/test-only dependencies: they are imported lazily and a missing one raises
``RankerUnavailable`` so the run can print a note and carry on. A later semantic ranker (``--embedder``)
slots in as one more factory in ``available_rankers``.
"""

from __future__ import annotations

import ast
import math
import re
import types
from pathlib import Path
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


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_TOKEN = re.compile(r"[^\W_]+")


def plain_tokens(text: str) -> list[str]:
    """Identifier-split, lowercased word tokens: no stemming, no stop words, no synonyms."""
    return _TOKEN.findall(_CAMEL.sub(" ", text).lower())


def _parameter_text(schema, depth: int = 0) -> list[str]:
    """Parameter names and descriptions of a JSON schema, nested properties included."""
    out: list[str] = []
    if not isinstance(schema, dict) or depth > 4:
        return out
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for key, sub in properties.items():
            out.append(str(key))
            if isinstance(sub, dict):
                if isinstance(sub.get("description"), str):
                    out.append(sub["description"])
                out += _parameter_text(sub, depth + 1)
                out += _parameter_text(sub.get("items"), depth + 1)
    return out


class PlainBM25F:
    """The reference every ranker must beat: textbook BM25F over name (x3), description and parameters.

    Nothing a tuned ranker would add: identifier-split lowercase tokens, no stemming, stop words, synonyms,
    translations or boosts.  Per field: tf normalised by that field's length (b = 0.75), weighted, summed,
    then saturated once (k1 = 1.2) and multiplied by the term's idf.
    """

    FIELDS = (("name", 3.0), ("description", 1.0), ("parameters", 1.0))
    K1, B = 1.2, 0.75

    def __init__(self, tools: list[dict]):
        self.tools = tools
        docs = [{"name": plain_tokens(str(t.get("name") or "")),
                 "description": plain_tokens(t.get("description") if isinstance(t.get("description"), str) else ""),
                 "parameters": plain_tokens(" ".join(_parameter_text(t.get("inputSchema"))))} for t in tools]
        n = len(docs) or 1
        avg = {f: (sum(len(d[f]) for d in docs) / n) or 1.0 for f, _ in self.FIELDS}
        self.postings: dict[str, list[tuple[int, float]]] = {}
        for doc_id, doc in enumerate(docs):
            tf: dict[str, float] = {}
            for field, weight in self.FIELDS:
                norm = weight / (1.0 - self.B + self.B * len(doc[field]) / avg[field])
                for term in doc[field]:
                    tf[term] = tf.get(term, 0.0) + norm
            for term, value in tf.items():
                self.postings.setdefault(term, []).append((doc_id, value))
        self.idf = {t: math.log(1.0 + (len(docs) - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def search(self, query: str, top_k: int = 10) -> list[Hit]:
        scores = [0.0] * len(self.tools)
        for term in set(plain_tokens(query)):
            idf = self.idf.get(term, 0.0)
            for doc_id, value in self.postings.get(term, ()):
                scores[doc_id] += idf * value / (self.K1 + value)
        return _top_hits(self.tools, scores, top_k)


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


class PreferenceReplay:
    """coffer.SearchIndex with the user's picks (search/preference.py), replayed in the order the searches were
    recorded: each search is ranked with what only the searches before it taught, then teaches its own pick,
    as `coffer eval`'s +preference rows are.  ``labelled`` are the set's rows, searched in their order."""

    def __init__(self, tools: list[dict], labelled: list[dict]):
        import coffer
        self.index = coffer.SearchIndex(tools)
        self.preference = coffer.SearchPreference()
        self.labelled = iter(labelled)

    def search(self, query: str, top_k: int):
        row = next(self.labelled)
        if row["query"] != query:
            raise RuntimeError("PreferenceReplay must search the set's queries in their order")
        depth = max(top_k, self.preference.candidates)
        hits = [(self.index.tools[doc], round(score, 4)) for doc, score in self.index.rank(query, depth)]
        lifted, _ = self.preference.rerank(hits, query, top_k)
        self.preference.learn(query, row["relevant"][0])
        return lifted


class EmbeddingRanker:
    """coffer's semantic ranking, alone ("semantic") or fused with BM25 ("hybrid"), against a real endpoint.

    Tool texts are embedded once at build time and query texts once in ``prepare`` (both through
    coffer.Embedder, the client the gateway uses), so per-query latency is the ranking work alone; the
    embedder's own time is reported by the benchmark, not here.
    """

    def __init__(self, tools, embedder, mode: str, module=None):
        if module is None:
            import coffer as module
        coffer = module
        self.coffer, self.mode, self.embedder = coffer, mode, embedder
        self.lexical = coffer.SearchIndex(tools)
        try:
            vectors = embedder.embed([coffer.embedding_text(t) for t in tools], 600.0)
        except coffer.EmbedderError as exc:
            raise RankerUnavailable(f"embedder failed: {exc}") from exc
        self.semantic = coffer.SemanticIndex(self.lexical.tools, vectors)
        self.query_vectors: dict[str, list[float]] = {}
        # query -> cosine spread (best minus last) of its semantic candidates, which fuse weighs the semantic
        # vote by (SEMANTIC_FULL_SPREAD); the report prints its median by query style
        self.spreads: dict[str, float] = {}

    def _embedded(self, query: str) -> str:
        """The text the gateway's embedder reads for ``query`` (coffer.embedding_query), where coffer has it."""
        if not hasattr(self.coffer, "embedding_query"):
            return query
        return self.coffer.embedding_query(self.coffer.bounded_query(query), self.lexical.reading(query))

    def prepare(self, queries: list[str]) -> None:
        missing = [q for q in dict.fromkeys(queries) if q not in self.query_vectors]
        if missing:
            self.query_vectors.update(zip(missing, self.embedder.embed(list(map(self._embedded, missing)), 600.0)))

    def search(self, query: str, top_k: int = 10):
        if query not in self.query_vectors:
            self.prepare([query])
        tools = self.lexical.tools
        semantic = self.semantic.rank(self.query_vectors[query], 50 if self.mode == "hybrid" else top_k)
        if self.mode == "semantic":
            return [(tools[doc], score) for doc, score in semantic[:top_k]]
        if hasattr(self.coffer, "hybrid_rank"):  # as coffer's SemanticRanker.search does
            if self.lexical.reading(query).only_arguments:
                return self.lexical.search(query, top_k)
            self.spreads[query] = semantic[0][1] - semantic[-1][1] if semantic else 0.0
            ranked = self.coffer.hybrid_rank(self.lexical, self.semantic, self.coffer.bounded_query(query),
                                             self.query_vectors[query], top_k)
            return [(tools[doc], score) for doc, score in ranked]
        self.spreads[query] = semantic[0][1] - semantic[-1][1] if semantic else 0.0
        lexical = self.lexical.rank(query, 50)
        return [(tools[doc], score) for doc, score in self.coffer.fuse(lexical, semantic, top_k)]


class CachedEmbedder:
    """coffer.Embedder with a memo: coffer's and a draft's hybrid rankers embed the same texts once, and with
    ``path`` the vectors persist between runs (float32, base64, keyed by model and text hash; a dev cache)."""

    def __init__(self, embedder, path: str | None = None):
        self.embedder, self.memo, self.path = embedder, {}, Path(path) if path else None
        self.stored: dict[str, str] = {}
        if self.path and self.path.is_file():
            import json
            self.stored = json.loads(self.path.read_text(encoding="utf-8"))

    def _key(self, text: str) -> str:
        import hashlib
        return hashlib.sha256(f"{self.embedder.cache_key}\0{text}".encode("utf-8")).hexdigest()[:32]

    def embed(self, texts: list[str], timeout: float) -> list[list[float]]:
        import array
        import base64
        for text in dict.fromkeys(texts):
            if text not in self.memo and self._key(text) in self.stored:
                self.memo[text] = array.array("f", base64.b64decode(self.stored[self._key(text)])).tolist()
        missing = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if missing:
            vectors = self.embedder.embed(missing, timeout)
            self.memo.update(zip(missing, vectors))
            if self.path:
                import json
                for text, vector in zip(missing, vectors):
                    self.stored[self._key(text)] = base64.b64encode(array.array("f", vector).tobytes()).decode()
                self.path.write_text(json.dumps(self.stored), encoding="utf-8")
        return [self.memo[t] for t in texts]


def make_embedder(url: str, model: str, api: str, cache_path: str | None = None) -> CachedEmbedder:
    import coffer
    return CachedEmbedder(coffer.Embedder(url, model, api), cache_path)


def embedder_factories(url: str, model: str, api: str) -> dict[str, Callable[[list[dict]], object]]:
    """The "semantic" and "hybrid" rankers for an embeddings endpoint (OpenAI-compatible or Ollama)."""
    embedder = make_embedder(url, model, api)
    return {mode: (lambda tools, mode=mode: EmbeddingRanker(tools, embedder, mode)) for mode in ("semantic", "hybrid")}


# ---------------------------------------------------------------- draft rankers (never edit coffer.py to measure)


def load_draft(path: str | Path, overrides: list[str] = ()) -> types.ModuleType:
    """coffer's namespace with a draft section executed on top of it, then ``overrides`` applied.

    The draft is pasted-in code for coffer.py (e.g. a new section 6): executing it in a copy of coffer's
    globals lets it use every helper coffer has, and the names it defines (SearchIndex, fuse, ...) shadow
    coffer's in this copy only.  An override is ``DOTTED.NAME=PYTHON_LITERAL`` (e.g. ``SearchIndex.SERVER_BOOST=0.0``),
    so one draft can be measured with one idea switched off at a time.
    """
    import coffer
    path = Path(path)
    module = types.ModuleType(f"coffer_draft_{path.stem}")
    module.__dict__.update({k: v for k, v in vars(coffer).items() if not k.startswith("__")})
    module.__file__ = str(path)
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)  # noqa: S102 - dev tool
    for override in overrides:
        target, sep, literal = override.partition("=")
        if not sep:
            raise SystemExit(f"override {override!r} is not NAME=VALUE")
        *owners, attribute = target.strip().split(".")
        holder = module
        for owner in owners:
            holder = getattr(holder, owner)
        if not hasattr(holder, attribute):
            raise SystemExit(f"override {override!r}: the draft has no {target.strip()}")
        setattr(holder, attribute, ast.literal_eval(literal.strip()))
    return module


def draft_factories(name: str, module: types.ModuleType, embedder=None) -> dict[str, Callable[[list[dict]], object]]:
    """``name`` (the draft's lexical SearchIndex) and, with an embedder, ``name-hybrid`` (its fuse)."""
    factories: dict[str, Callable[[list[dict]], object]] = {name: lambda tools: module.SearchIndex(tools)}
    if embedder is not None:
        factories[f"{name}-hybrid"] = lambda tools: EmbeddingRanker(tools, embedder, "hybrid", module)
    return factories


def available_rankers(embedder_url: str | None = None, embedder_model: str = "all-MiniLM-L6-v2",
                      embedder_api: str = "openai") -> dict[str, Callable[[list[dict]], object]]:
    """Ranker name -> factory, in table order; coffer first since it is the one gated."""
    rankers: dict[str, Callable[[list[dict]], object]] = {
        "coffer": coffer_factory,
        "bm25f": PlainBM25F,
        "rank_bm25": RankBM25Index,
        "bm25s": BM25SIndex,
    }
    if embedder_url:
        rankers.update(embedder_factories(embedder_url, embedder_model, embedder_api))
    return rankers
