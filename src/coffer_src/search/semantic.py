"""Semantic ranking (optional): an embeddings endpoint, a vector cache, hybrid fusion.

Lexical matching cannot connect "let the team know the deploy finished" to slack__post_message.  When the user
configures an embeddings endpoint (any OpenAI-compatible /embeddings, or Ollama's /api/embed), tools are embedded
once, off the request path, and cached in coffer.db by model and text hash; a query is embedded under a short time
budget and the semantic ranking is fused with BM25.  Any failure answers with BM25 alone.

Threads and locks: an EmbeddingWorker's thread runs its ranker's embedding rounds, and nothing else does; the
query threads only read what a round published.  SemanticRanker.lock guards the catalogue to embed (``_tools``,
written by ``refresh`` on any thread) and the published index (``index`` with ``_index_for``, written by the
worker, read by ``search``); it is a leaf: nothing else is taken while it is held, and no embedder request or
database access happens under it.  The vector cache (``vectors``) belongs to the worker's thread once the
constructor has filled it.  ``_warned_not_ready`` is written by query threads without a lock: a race costs at most
a second warning."""

from __future__ import annotations

import array
import collections
import heapq
import logging
import math
import os
import sqlite3
import threading
import time

from coffer_src.digests import sha256
from coffer_src.errors import CofferError, CofferException
from coffer_src.jsonrpc import EncodeError, decode_json, encode_line
from coffer_src.names import SEPARATOR, origin_text
from coffer_src.search.index import QueryReading, SearchIndex
from coffer_src.search.text import bounded_query, split_words
from coffer_src.secret_store import SecretStore
from coffer_src.terminal import redact
from coffer_src.threads import Backoff, start_thread
from coffer_src.transport.http import remote_http
from coffer_src.transport.stdio import UpstreamFailure
from coffer_src.vault import _Transaction, connect_vault_db, utcnow
from coffer_src.vault_schema import EMBEDDING_SCHEMA

# The lexical share of the hybrid blend (see fuse), one for each kind of search.  Tool search: chosen on the
# tool-search eval sets (evals.run --embedder).  Documentation passages are long and a question's exact words
# matter, so the knowledge base gives the lexical ranking more weight: chosen on evals/ask.py, where tool search's
# share made the hybrid worse than lexical alone (evals.ask --embedder prints both).
HYBRID_ALPHA = 0.45
KNOWLEDGE_HYBRID_ALPHA = 0.75
# A failed embedding round is retried after EMBED_RETRY_BASE seconds, doubling up to EMBED_RETRY_CEILING.
EMBED_RETRY_BASE = 5.0
EMBED_RETRY_CEILING = 120.0

semantic_log = logging.getLogger(__name__)


class EmbedderError(CofferException):
    """The embeddings endpoint failed, timed out, or answered with something that is not embeddings."""


def _unit(vector) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Embedder:
    """A client for an embeddings endpoint, with urllib.  The API key is read from a named environment variable
    at call time and never stored."""

    MAX_REPLY_BYTES = 64 << 20

    def __init__(self, url: str, model: str, api: str = "openai", key_env: str = "", batch_size: int = 64):
        if api not in ("openai", "ollama"):
            raise CofferError(f"embedder_api must be 'openai' or 'ollama', not {api!r}")
        self.url, self.model, self.api, self.key_env = url.rstrip("/"), model, api, key_env
        self.batch_size = batch_size
        self.secrets: SecretStore | None = None

    @classmethod
    def from_settings(cls, settings: dict, secrets: SecretStore | None = None):
        url = os.environ.get("COFFER_EMBEDDER_URL", settings.get("embedder_url") or "")
        if not url:
            return None
        embedder = cls(url, os.environ.get("COFFER_EMBEDDER_MODEL", settings.get("embedder_model") or ""),
                       os.environ.get("COFFER_EMBEDDER_API", settings.get("embedder_api") or "openai"),
                       os.environ.get("COFFER_EMBEDDER_KEY_ENV", settings.get("embedder_key_env") or ""))
        embedder.secrets = secrets
        return embedder

    @property
    def cache_key(self) -> str:
        return f"{self.api}:{self.model}"

    def embed(self, texts: list[str], timeout: float) -> list[list[float]]:
        """Unit vectors for ``texts``, in order, batched; raises EmbedderError on any failure."""
        vectors: list[list[float]] = []
        deadline = time.monotonic() + timeout
        for start in range(0, len(texts), self.batch_size):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EmbedderError(f"timed out after {timeout:g}s")
            vectors.extend(self._request(texts[start:start + self.batch_size], remaining))
        return vectors

    def _request(self, batch: list[str], timeout: float) -> list[list[float]]:
        if self.api == "ollama":
            endpoint, body = f"{self.url}/api/embed", {"model": self.model, "input": batch}
        else:
            endpoint, body = f"{self.url}/embeddings", {"model": self.model, "input": batch}
        headers = {"Content-Type": "application/json"}
        key = None
        if self.key_env:  # the key by name: from the environment, else from the secret store
            key = os.environ.get(self.key_env) or (self.secrets.get(self.key_env) if self.secrets else None)
            redact.add(key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            reply = remote_http("POST", endpoint, headers=headers, body=encode_line(body),
                                timeout=max(0.01, timeout), max_bytes=self.MAX_REPLY_BYTES)
        except (UpstreamFailure, EncodeError) as exc:
            raise EmbedderError("timed out" if "timed out" in str(exc) else str(exc)) from None
        if reply.status != 200:
            raise EmbedderError(f"HTTP {reply.status} from {origin_text(endpoint)}")
        try:
            payload = decode_json(reply.body)
        except ValueError:
            raise EmbedderError("the reply is not JSON") from None
        try:
            if self.api == "ollama":
                raw = payload["embeddings"]
            else:
                raw = [item["embedding"] for item in sorted(payload["data"], key=lambda item: item["index"])]
            if len(raw) != len(batch) or not all(raw) or len({len(v) for v in raw}) != 1:
                raise ValueError
            return [_unit([float(x) for x in vector]) for vector in raw]
        except (KeyError, TypeError, ValueError):
            raise EmbedderError("the reply holds no usable embeddings") from None


def embedding_text(tool: dict) -> str:
    """What a tool is embedded as: its words and its description, like an agent would describe the task."""
    name = str(tool.get("name") or "")
    server, sep, short = name.partition(SEPARATOR)
    words = " ".join(split_words(short if sep else name))
    title = tool.get("title") if isinstance(tool.get("title"), str) else ""
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    prefix = f"{server} " if sep else ""
    return f"{prefix}{words}: {title + '. ' if title else ''}{description}"[:1000]


def embedding_query(query: str, reading: QueryReading) -> str:
    """What the embedder reads of a query: the query, and the English words Coffer's lexicon found for its foreign
    tool-domain words, so an English-only model reading a German or Chinese request sees what it asks for."""
    if not reading.translations:
        return query
    return f"{query} ({' '.join(dict.fromkeys(reading.translations))})"


def text_hash(text: str) -> str:
    return sha256(text.encode("utf-8")).hexdigest()[:32]


def _dot_products():
    """The fastest dot product available: numpy when installed, math.sumprod (3.12+), else a plain loop."""
    try:
        import numpy  # optional: only used when it happens to be installed
    except ImportError:
        numpy = None
    if numpy is not None:
        def rank_all(matrix, query):
            return (matrix @ numpy.asarray(query, dtype=numpy.float32)).tolist()
        return rank_all, lambda rows: numpy.asarray(rows, dtype=numpy.float32).reshape(len(rows), -1)
    sumprod = getattr(math, "sumprod", None)
    if sumprod is None:
        import operator
        def sumprod(a, b, _mul=operator.mul):
            return sum(map(_mul, a, b))
    return (lambda matrix, query: [sumprod(row, query) for row in matrix]), (lambda rows: rows)


class SemanticIndex:
    """Cosine similarity over pre-normalised tool vectors (missing vectors simply do not rank)."""

    def __init__(self, tools: list[dict], vectors: list):
        rank_all, to_matrix = _dot_products()
        self._rank_all = rank_all
        self.doc_ids = [i for i, vector in enumerate(vectors) if vector is not None]
        self.matrix = to_matrix([vectors[i] for i in self.doc_ids]) if self.doc_ids else None
        self.tools = tools

    def rank(self, query_vector, limit: int) -> list[tuple[int, float]]:
        if self.matrix is None:
            return []
        sims = self._rank_all(self.matrix, query_vector)
        best = heapq.nlargest(limit, range(len(sims)), key=sims.__getitem__)
        return [(self.doc_ids[i], float(sims[i])) for i in best]


# How far apart (in cosine) the semantic ranker's best and last candidates must be for it to get its full
# share.  A query the embedding model does not understand (a German or Chinese request to an English-only
# model, a domain it never saw) gives flat cosines; its vote then shrinks instead of dragging a correct
# lexical answer down.  Chosen on the dev sets, where English queries spread wider than the non-English ones an
# English-only model misreads (evals.run --embedder prints each set's median spread by query style).
SEMANTIC_FULL_SPREAD = 0.3


def fuse(lexical: list[tuple[int, float]], semantic: list[tuple[int, float]], top_k: int,
         alpha: float = HYBRID_ALPHA, full_spread: float = SEMANTIC_FULL_SPREAD) -> list[tuple[int, float]]:
    """Calibrated score blending, weighted per query by how sure the semantic ranker is.

    BM25 is scaled by its best score and the cosine min-max scaled over its candidates, as before; the semantic
    share (1 - alpha) is then multiplied by min(1, cosine spread / full_spread); ``full_spread=0`` turns that
    off (the fixed blend; knowledge search was tuned with it).  Chosen over the fixed blend on the dev sets
    (evals.run --embedder): it keeps non-English queries near their lexical ranking instead of below it.
    """
    scores: dict[int, float] = collections.defaultdict(float)
    if lexical:
        best = lexical[0][1] or 1.0
        for doc_id, score in lexical:
            scores[doc_id] += alpha * score / best
    if semantic:
        high, low = semantic[0][1], semantic[-1][1]
        trust = 1.0 if len(semantic) == 1 or full_spread <= 0 else min(1.0, max(0.0, high - low) / full_spread)
        for doc_id, score in semantic:
            scaled = (score - low) / (high - low) if high > low else 1.0  # one candidate: full credit
            scores[doc_id] += (1.0 - alpha) * trust * scaled
    return heapq.nsmallest(top_k, scores.items(), key=lambda item: (-item[1], item[0]))


def hybrid_rank(lexical_index: SearchIndex, semantic_index: SemanticIndex, query: str, query_vector, top_k: int,
                candidates: int = 50) -> list[tuple[int, float]]:
    """The hybrid ranking of ``query`` (read up to bounded_query's limit) whose embedding_query has the vector
    ``query_vector``: the best ``candidates`` of each ranker, fused.  Raises ValueError if the vector's dimension
    is not the index's."""
    lexical = lexical_index.rank(query, candidates)
    return fuse(lexical, semantic_index.rank(query_vector, candidates), top_k)


class EmbeddingWorker:
    """The daemon thread that embeds what a ranker lacks: it runs ``job`` each time it is woken (wakes that come
    while a round runs make one more round), retries a failed round after the backoff (threads.Backoff:
    EMBED_RETRY_BASE doubling to EMBED_RETRY_CEILING; the lexical ranking answers meanwhile), logs each new failure
    once with ``failure`` (a format with one %s), and ends on ``close``.

    ``wake`` and ``close`` may be called from any thread; ``job`` runs on the worker's thread only.  ``stopping``
    is set by ``close``: a long job checks it between chunks of work."""

    def __init__(self, name: str, job, failure: str, logger: logging.Logger):
        self._job, self._failure, self._log = job, failure, logger
        self._wanted = threading.Event()
        self.stopping = threading.Event()
        self._thread = start_thread(self._run, name)

    def wake(self) -> None:
        """Run the job (again) soon."""
        self._wanted.set()

    def close(self, timeout: float = 1.0) -> bool:
        """End the thread: a wait for the next round or retry ends at once; a round under way ends at its job's
        next check of ``stopping`` (an embedder request already sent is not cut short: it ends by its own
        timeout).  Waits up to ``timeout`` seconds; True when the thread has ended.  A thread still busy then is
        a daemon that ends by itself once its work returns."""
        self.stopping.set()
        self._wanted.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        backoff, last_error = Backoff(EMBED_RETRY_BASE, EMBED_RETRY_CEILING), None
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self.stopping.is_set():
                return
            try:
                self._job()
            except Exception as exc:  # noqa: BLE001 - the lexical ranking serves meanwhile; this thread must live on
                if self.stopping.is_set():
                    return
                if str(exc) != last_error:
                    self._log.warning(self._failure, exc)
                    last_error = str(exc)
                if self.stopping.wait(backoff.next_delay()):
                    return
                self._wanted.set()
                continue
            backoff.reset()
            last_error = None


class SemanticRanker:
    """Owns the embedder, the vector cache (memory + coffer.db) and the semantic index of the live catalogue.

    ``refresh(tools)`` is cheap and non-blocking: tools without a cached vector are embedded on a background
    thread (an EmbeddingWorker; ``close`` ends it).  ``search`` returns (hits, ranker, note): ``ranker`` is
    "hybrid" or "bm25"; ``note`` says why a fallback happened.  Threads and locks: see the module docstring.
    """

    CANDIDATES = 50

    def __init__(self, embedder: Embedder, db_path: str, query_timeout: float, build_timeout: float = 120.0):
        self.embedder, self.db_path = embedder, db_path
        self.query_timeout, self.build_timeout = query_timeout, build_timeout
        self.vectors: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.index: SemanticIndex | None = None
        self._index_for = None
        self._tools: list[dict] = []
        self._views: dict[int, tuple[list, SemanticIndex]] = {}  # id(tools) -> a profile view's index (guarded)
        self._warned_not_ready = False
        self._load_cache()
        self._worker = EmbeddingWorker("coffer-embedder", self._embed_catalogue,
                                       "embedder: tool vectors unavailable (%s); search uses BM25 until they are",
                                       semantic_log)

    def close(self, timeout: float = 1.0) -> bool:
        """End the embedding thread (see EmbeddingWorker.close); searches still answer, by BM25 once the tools
        change.  True when the thread has ended."""
        return self._worker.close(timeout)

    def _connect(self):
        db = connect_vault_db(self.db_path)
        db.executescript(EMBEDDING_SCHEMA)
        return db

    def _load_cache(self) -> None:
        try:
            db = self._connect()
            for row in db.execute("SELECT text_hash, vector FROM embeddings WHERE model=?", (self.embedder.cache_key,)):
                self.vectors[row["text_hash"]] = array.array("f", row["vector"]).tolist()
            db.close()
        except sqlite3.Error as exc:
            semantic_log.warning("embedding cache unavailable: %s", exc)

    def refresh(self, tools: list[dict]) -> None:
        with self.lock:
            self._tools = tools
        self._worker.wake()

    def _embed_catalogue(self) -> None:
        """One round on the worker's thread: index the latest catalogue and publish it, unless a newer one came
        meanwhile (the wake that brought it runs another round)."""
        with self.lock:
            tools = self._tools
        index = self._index(tools)
        with self.lock:
            if self._tools is tools:
                self.index, self._index_for = index, tools

    def _index(self, tools: list[dict]) -> SemanticIndex:
        """Embed what is not cached yet (saving it), then index the whole catalogue."""
        hashes = [text_hash(embedding_text(tool)) for tool in tools]
        missing = {h: embedding_text(tool) for h, tool in zip(hashes, tools) if h not in self.vectors}
        if missing:
            new = dict(zip(missing, self.embedder.embed(list(missing.values()), self.build_timeout)))
            self.vectors.update(new)
            try:
                db = self._connect()
                with _Transaction(db):
                    db.executemany("INSERT OR REPLACE INTO embeddings(model, text_hash, dim, vector, created_at)"
                                   " VALUES (?,?,?,?,?)",
                                   [(self.embedder.cache_key, h, len(v), array.array("f", v).tobytes(), utcnow())
                                    for h, v in new.items()])
                db.close()
            except sqlite3.Error as exc:
                semantic_log.warning("embedding cache not saved: %s", exc)
        vectors = [self.vectors.get(h) for h in hashes]
        dims = collections.Counter(len(v) for v in vectors if v)
        if len(dims) > 1:  # the model behind the name changed: keep the current dimension, re-embed the rest
            current = len(self.embedder.embed(["dimension probe"], self.build_timeout)[0])
            for h in hashes:
                if h in self.vectors and len(self.vectors[h]) != current:
                    del self.vectors[h]
            raise EmbedderError(f"cached vectors of another dimension than {current}; re-embedding")
        return SemanticIndex(tools, vectors)

    def _cached_index(self, tools: list[dict]) -> SemanticIndex | None:
        """A semantic index of another list than the catalogue's (a profile's view of it) from the vectors
        already embedded, or None while one is missing (its search is BM25's meanwhile)."""
        with self.lock:
            cached = self._views.get(id(tools))
        if cached is not None and cached[0] is tools:
            return cached[1]
        vectors = [self.vectors.get(text_hash(embedding_text(tool))) for tool in tools]
        if not vectors or any(vector is None for vector in vectors) or len({len(v) for v in vectors}) > 1:
            return None
        index = SemanticIndex(tools, vectors)
        with self.lock:
            if len(self._views) >= 32:
                self._views.clear()
            self._views[id(tools)] = (tools, index)
        return index

    def search(self, lexical_index: SearchIndex, query: str, top_k: int):
        """Hybrid search, or BM25 with a note saying why not; the embedder reads what the lexical ranker reads
        (embedding_query).  A request that is nothing but arguments ("AAPL", a URL alone) is answered by BM25
        without asking the embedder: a sentence model has no request to read in it, only the argument's text, and
        the lexical ranker matches arguments to the parameters that take them."""
        query = bounded_query(query)
        with self.lock:
            index = self.index if self._index_for is lexical_index.tools else None
            other = lexical_index.tools is not self._tools
        if index is None and other:
            index = self._cached_index(lexical_index.tools)
        if index is None:
            if not self._warned_not_ready:
                self._warned_not_ready = True
                semantic_log.warning("embedder: tool vectors not ready yet; queries are answered by BM25 until they "
                                     "are")
            return lexical_index.search(query, top_k), "bm25", "embedder: tool vectors not ready yet"
        reading = lexical_index.reading(query)
        if reading.only_arguments:
            return lexical_index.search(query, top_k), "bm25", None
        try:
            query_vector = self.embedder.embed([embedding_query(query, reading)], self.query_timeout)[0]
        except EmbedderError as exc:
            semantic_log.warning("embedder fallback to BM25: %s", exc)
            return lexical_index.search(query, top_k), "bm25", f"embedder fallback: {exc}"
        try:
            ranked = hybrid_rank(lexical_index, index, query, query_vector, top_k, self.CANDIDATES)
        except ValueError as exc:  # a query vector of another dimension: the endpoint's model changed
            semantic_log.warning("embedder fallback to BM25: %s", exc)
            return lexical_index.search(query, top_k), "bm25", "embedder fallback: vector dimension changed"
        tools = lexical_index.tools
        return [(tools[doc], round(score, 4)) for doc, score in ranked], "hybrid", None
