"""Knowledge ranking: BM25F over passages (in memory or FTS5 re-scored), hybrid fusion.

The read side of the knowledge base.  A PassageRanker answers a question from a snapshot of the passage tables:
with the 'bm25f' engine the snapshot holds Coffer's own in-memory index (PassageIndex); with 'fts5' an FTS5 table
over the same analysed terms finds candidates on disk and BM25F re-scores them exactly as PassageIndex would, so
both engines rank alike (evals/ask.py measures both; a test checks it).  With an embedder, PassageVectors embeds
the passages on its own thread (cached in the embeddings table by model and text hash, like tool vectors) and
fuses the semantic ranking with the lexical one; any embedder failure answers lexically.

Threads and locks: searches run on any thread at once, each reading through its own SQLite connection (the
``reader`` callable the knowledge base passes in).  PassageRanker's snapshot lock lets one thread rebuild the
snapshot while the others answer from the previous one; the snapshot itself is an immutable tuple, replaced by one
assignment and read without the lock.  While it is held, the calling thread may open its reader connection, which
takes the knowledge base's ``_readers_lock`` (a leaf).  PassageVectors' embed lock lets its worker thread and
``ensure`` embed one at a time, for a whole round: embedder requests (which register the API key with the
redactor, under the redactor's lock) and writes to the embeddings table through the round's own connection.
The vectors it guards are touched only under it; the semantic index it publishes (passage ids with a
SemanticIndex) is immutable, replaced by one assignment and read by searches without the lock.  Nothing in the
knowledge modules takes either lock while holding another lock."""

from __future__ import annotations

import array
import collections
import heapq
import logging
import sqlite3
import threading
from typing import NamedTuple

from coffer_src.search.index import BM25_K1, bm25_idf
from coffer_src.search.lexicon import TRANSLATION_WEIGHT
from coffer_src.search.semantic import (
    KNOWLEDGE_HYBRID_ALPHA,
    Embedder,
    EmbedderError,
    EmbeddingWorker,
    SemanticIndex,
    fuse,
    text_hash,
)
from coffer_src.search.text import knowledge_terms, translations
from coffer_src.vault import _Transaction, connect_vault_db, utcnow
from coffer_src.vault_schema import EMBEDDING_SCHEMA

knowledge_ranking_log = logging.getLogger(__name__)

# Lexical and semantic candidates fused in hybrid mode (and the least the lexical ranking is asked for).
KNOWLEDGE_CANDIDATES = 50


class PassageIndex:
    """Coffer's own BM25F over passages (heading, body and path fields), used where sqlite3 lacks FTS5.

    Immutable once built: searches on any thread read it while a rebuild makes a new one.  Postings are compact
    arrays (8 bytes a posting), with the BM25 weight of each (term, passage) computed once at build time.
    """

    FIELDS = (("heading", 2.0, 0.5), ("body", 1.0, 0.75), ("path", 0.7, 0.3))

    def __init__(self, rows):
        """``rows``: (passage id, source, heading terms, body terms, path terms), terms space-joined."""
        self.ids: list[int] = []
        self.sources: list[str] = []
        fields_per_doc = []
        for passage_id, source, heading, body, path in rows:
            self.ids.append(passage_id)
            self.sources.append(source)
            fields_per_doc.append((heading.split(), body.split(), path.split()))
        n = len(self.ids)
        averages = [(sum(len(doc[f]) for doc in fields_per_doc) / n if n else 0.0) or 1.0
                    for f in range(len(self.FIELDS))]
        raw: dict[str, tuple[array.array, array.array]] = {}
        for doc_id, doc in enumerate(fields_per_doc):
            tf: dict[str, float] = {}
            for f, (_, weight, b) in enumerate(self.FIELDS):
                terms = doc[f]
                if terms:
                    norm = weight / (1.0 - b + b * len(terms) / averages[f])
                    for term in terms:
                        tf[term] = tf.get(term, 0.0) + norm
            for term, value in tf.items():
                posting = raw.get(term)
                if posting is None:
                    posting = raw[term] = (array.array("i"), array.array("f"))
                posting[0].append(doc_id)
                posting[1].append(value)
        k1 = BM25_K1
        for term, (docs, values) in raw.items():
            idf = bm25_idf(n, len(docs))
            for k, value in enumerate(values):
                values[k] = idf * value / (k1 + value)
        self.postings = raw
        self.count = n

    def document_frequency(self, term: str) -> int:
        posting = self.postings.get(term)
        return len(posting[0]) if posting else 0

    def rank(self, weights: dict[str, float], limit: int, sources: frozenset | None = None):
        """Best ``limit`` (passage id, score), best first."""
        scores: dict[int, float] = collections.defaultdict(float)
        for term, weight in weights.items():
            posting = self.postings.get(term)
            if posting:
                for doc_id, value in zip(*posting):
                    scores[doc_id] += weight * value
        if sources is not None:
            scores = {d: s for d, s in scores.items() if self.sources[d] in sources}
        best = heapq.nlargest(limit, scores.items(), key=lambda item: (item[1], -item[0]))
        return [(self.ids[doc_id], score) for doc_id, score in best if score > 0.0]


class KnowledgeHit(NamedTuple):
    """One retrieved passage, as coffer__ask returns it."""

    source: str
    path: str
    heading: str
    lines: tuple[int, int]
    text: str
    score: float

    def to_dict(self) -> dict:
        return {"source": self.source, "path": self.path, "heading": self.heading, "lines": list(self.lines),
                "text": self.text, "score": self.score}


class KnowledgeAnswer(NamedTuple):
    passages: list[KnowledgeHit]
    total_searched: int
    ranker: str            # 'fts5', 'bm25f', or either with '+hybrid'
    note: str | None       # why a fallback happened (embedder down, vectors not ready)


class _Snapshot(NamedTuple):
    generation: int
    counts: dict               # source -> passages
    lexical: PassageIndex | None     # the in-memory index (engine 'bm25f' only)
    averages: tuple            # average field lengths in terms (heading, body, path), for re-scoring FTS5 hits


_FTS5_AVAILABLE: bool | None = None


def fts5_available() -> bool:
    """Whether this interpreter's sqlite3 was built with FTS5 (checked once)."""
    global _FTS5_AVAILABLE
    if _FTS5_AVAILABLE is None:
        try:
            probe = sqlite3.connect(":memory:")
            probe.execute("CREATE VIRTUAL TABLE probe USING fts5(x)")
            probe.close()
            _FTS5_AVAILABLE = True
        except sqlite3.Error:
            _FTS5_AVAILABLE = False
    return _FTS5_AVAILABLE


def passage_embedding_text(heading: str, text: str) -> str:
    return f"{heading}\n{text}"[:2000] if heading else text[:2000]


def knowledge_generation(db) -> int:
    """The passage tables' generation: every write that changes passages bumps it."""
    return db.execute("SELECT value FROM knowledge_meta WHERE key='generation'").fetchone()[0]


class PassageRanker:
    """The lexical ranking of passages for one engine ('fts5' or 'bm25f'), and the answer to a question (fused
    with ``vectors`` when the knowledge base has an embedder).  ``reader()`` is the calling thread's connection."""

    FTS_CANDIDATES = 100       # FTS5 hits re-scored by BM25F (a margin above what the eval needs)
    FTS_COMMON_SHARE = 0.2     # terms in more than this share of passages do not pick candidates (see lexical)

    def __init__(self, engine: str, reader, vectors: PassageVectors | None = None):
        self.engine, self._reader, self.vectors = engine, reader, vectors
        self._snapshot_lock = threading.Lock()
        self._snapshot: _Snapshot | None = None

    def refresh(self) -> _Snapshot:
        """Rebuild the snapshot if the tables changed.  One builder at a time; searches on other threads keep
        answering from the previous snapshot meanwhile (the FTS5 engine only reads counts; the in-memory engine
        builds its whole index)."""
        with self._snapshot_lock:
            db = self._reader()
            db.execute("BEGIN")   # one consistent read: the generation and the rows it describes
            try:
                generation = knowledge_generation(db)
                if self._snapshot is not None and self._snapshot.generation == generation:
                    return self._snapshot
                counts = dict(db.execute("SELECT source, count(*) FROM knowledge_passages GROUP BY source"))
                lexical, averages = None, (1.0, 1.0, 1.0)
                if self.engine == "bm25f":
                    lexical = PassageIndex(db.execute("SELECT id, source, heading_terms, body_terms, path_terms"
                                                      " FROM knowledge_passages ORDER BY id"))
                else:
                    total = sum(counts.values()) or 1
                    tokens = dict(db.execute("SELECT col, sum(cnt) FROM knowledge_fts_columns GROUP BY col"))
                    averages = tuple((tokens.get(column) or 0) / total or 1.0
                                     for column in ("heading", "body", "path"))
            finally:
                db.execute("COMMIT")
            self._snapshot = _Snapshot(generation, counts, lexical, averages)
            return self._snapshot

    def snapshot(self) -> _Snapshot:
        """The current snapshot, rebuilt first if the tables changed (unless another thread is rebuilding it)."""
        snapshot = self._snapshot
        if snapshot is not None and (snapshot.generation == knowledge_generation(self._reader())
                                     or self._snapshot_lock.locked()):
            return snapshot   # current, or a rebuild is under way on another thread: answer from this one
        return self.refresh()

    def answer(self, snapshot: _Snapshot, question: str, top_k: int, wanted: frozenset | None) -> KnowledgeAnswer:
        """The passages of the ``wanted`` sources (None: all) that best answer ``question``, best first."""
        total = sum(count for source, count in snapshot.counts.items() if wanted is None or source in wanted)
        if not question or not total:
            return KnowledgeAnswer([], total, self.engine, None)
        weights = self.query_weights(question)
        limit = max(top_k, KNOWLEDGE_CANDIDATES)
        lexical = self.lexical(snapshot, weights, limit, wanted) if weights else []
        ranker, note, ranked = self.engine, None, lexical[:top_k]
        if self.vectors is not None:
            ranked, ranker, note = self.vectors.hybrid(question, lexical, top_k, wanted, self.engine)
        return KnowledgeAnswer(self.hits(ranked), total, ranker, note)

    def query_weights(self, question: str) -> dict[str, float]:
        weights: dict[str, float] = {}
        for term in knowledge_terms(question):
            weights[term] = 1.0
        for term in translations(question):
            weights[term] = max(weights.get(term, 0.0), TRANSLATION_WEIGHT)
        return weights

    def lexical(self, snapshot: _Snapshot, weights: dict[str, float], limit: int, sources):
        if self.engine == "bm25f":
            return snapshot.lexical.rank(weights, limit, sources)
        # FTS5 finds the candidates (its bm25() is a sum of per-column BM25, close to but not BM25F); BM25F then
        # re-scores them exactly as PassageIndex would, so both engines rank alike.
        total = sum(snapshot.counts.values())
        frequencies = self._document_frequencies(snapshot, [term for term in weights if term])
        idf = {t: bm25_idf(total, df) for t, df in frequencies.items() if df}
        if not idf:
            return []
        # Candidates come from the terms that discriminate: a term in more than a tenth of the passages makes FTS5
        # score thousands of rows for little; it still counts when the candidates are re-scored.
        by_rarity = sorted(idf, key=lambda t: frequencies[t])
        probe = [t for t in by_rarity if frequencies[t] <= total * self.FTS_COMMON_SHARE] or by_rarity[:2]
        query = " OR ".join('"' + term.replace('"', '""') + '"' for term in probe)
        sql = "SELECT rowid FROM knowledge_fts WHERE knowledge_fts MATCH ?"
        args: list = [query]
        if sources is not None:
            sql += f" AND source IN ({','.join('?' * len(sources))})"
            args.extend(sorted(sources))
        # rank = bm25(2.0, 1.0, 0.7), configured in the table (KnowledgeBase._prepare_fts): ORDER BY rank then
        # takes FTS5's own sorted path, cheaper than ORDER BY bm25(...).
        sql += " ORDER BY rank LIMIT ?"
        args.append(max(limit, self.FTS_CANDIDATES))
        db = self._reader()
        try:
            candidates = [row[0] for row in db.execute(sql, args)]
        except sqlite3.OperationalError as exc:
            knowledge_ranking_log.warning("knowledge: full-text query failed (%s)", exc)
            return []
        if not candidates:
            return []
        rows = db.execute("SELECT id, heading_terms, body_terms, path_terms FROM knowledge_passages WHERE id IN"
                          f" ({','.join('?' * len(candidates))})", candidates).fetchall()
        fields = [(weight, b, average) for (_, weight, b), average in zip(PassageIndex.FIELDS, snapshot.averages)]
        needles = [(" " + term + " ", query_weight * idf[term]) for term, query_weight in weights.items()
                   if term in idf]
        k1 = BM25_K1
        scored = []
        for row in rows:
            # Terms are space-joined; with every space doubled, non-overlapping matches of " term " count every
            # occurrence (adjacent repeats included), and the counting runs in C.
            padded, norms = [], []
            for text, (weight, b, average) in zip(row[1:], fields):
                length = text.count(" ") + 1 if text else 0
                padded.append(" " + text.replace(" ", "  ") + " ")
                norms.append(weight / (1.0 - b + b * length / average))
            score = 0.0
            for needle, term_weight in needles:
                tf = norms[0] * padded[0].count(needle) + norms[1] * padded[1].count(needle) \
                    + norms[2] * padded[2].count(needle)
                if tf:
                    score += term_weight * tf / (k1 + tf)
            if score > 0.0:
                scored.append((row[0], score))
        return heapq.nlargest(limit, scored, key=lambda item: (item[1], -item[0]))

    def _document_frequencies(self, snapshot, terms: list[str]) -> dict[str, int]:
        if not terms:
            return {}
        if snapshot.lexical is not None:
            return {t: snapshot.lexical.document_frequency(t) for t in terms}
        found = {}
        for start in range(0, len(terms), 500):
            chunk = terms[start:start + 500]
            found.update(self._reader().execute(
                f"SELECT term, doc FROM knowledge_fts_vocab WHERE term IN ({','.join('?' * len(chunk))})",
                chunk).fetchall())
        return found

    def hits(self, ranked: list[tuple[int, float]]) -> list[KnowledgeHit]:
        if not ranked:
            return []
        rows = {row["id"]: row for row in self._reader().execute(
            "SELECT id, source, path, heading, first_line, last_line, text FROM knowledge_passages WHERE id IN"
            f" ({','.join('?' * len(ranked))})", [doc for doc, _ in ranked])}
        return [KnowledgeHit(row["source"], row["path"], row["heading"], (row["first_line"], row["last_line"]),
                             row["text"], round(score, 4))
                for doc, score in ranked if (row := rows.get(doc)) is not None]


class PassageVectors:
    """Passage vectors for hybrid answers: embedded on an EmbeddingWorker's thread (``wake`` after passages
    change; ``close`` ends it) or at once by ``ensure``, cached in the embeddings table, and fused with the lexical
    ranking by ``hybrid``.  Threads and locks: see the module docstring."""

    EMBED_CHUNK = 256          # passages embedded (and saved) per embedder call

    def __init__(self, embedder: Embedder, db_path: str, reader, query_timeout: float, build_timeout: float,
                 background: bool = True):
        self.embedder, self.db_path, self._reader = embedder, db_path, reader
        self.query_timeout, self.build_timeout = query_timeout, build_timeout
        self._vectors: dict[str, array.array] = {}   # text hash -> vector, of current passages; under _embed_lock
        self._semantic: tuple[list[int], SemanticIndex] | None = None  # (passage id per row, index)
        self._embed_lock = threading.Lock()   # the worker thread and ensure embed one at a time
        try:
            db = connect_vault_db(self.db_path)
            db.executescript(EMBEDDING_SCHEMA)
            db.close()
        except sqlite3.Error as exc:
            knowledge_ranking_log.warning("knowledge: embedding cache unavailable: %s", exc)
        self._worker = EmbeddingWorker("coffer-knowledge-embedder", self._embed_missing,
                                       "knowledge: passage vectors unavailable (%s); answering lexically until "
                                       "they are", knowledge_ranking_log)
        self._background = background   # False: only ``ensure`` embeds (a CLI command, in the foreground)
        if background:
            self._worker.wake()

    def wake(self) -> None:
        """Passages changed: embed the new ones on the worker's thread."""
        if self._background:
            self._worker.wake()

    def close(self, timeout: float = 1.0) -> bool:
        """End the worker's thread (see EmbeddingWorker.close); True when it has ended."""
        return self._worker.close(timeout)

    def ensure(self, progress=None) -> None:
        """Embed what is missing now, on this thread (``progress(done, total)`` after each chunk); raises
        EmbedderError."""
        self._embed_missing(progress)

    def hybrid(self, question, lexical, top_k, wanted, engine):
        """(ranked, ranker, note): the lexical ranking fused with the semantic one, or the lexical alone with a
        note saying why."""
        semantic_state = self._semantic
        if semantic_state is None:
            return lexical[:top_k], engine, "embedder: passage vectors not ready yet"
        try:
            query_vector = self.embedder.embed([question], self.query_timeout)[0]
        except EmbedderError as exc:
            knowledge_ranking_log.warning("knowledge: embedder fallback to BM25: %s", exc)
            return lexical[:top_k], engine, f"embedder fallback: {exc}"
        ids, index = semantic_state
        try:
            semantic = index.rank(query_vector, KNOWLEDGE_CANDIDATES * (4 if wanted is not None else 1))
        except ValueError:
            return lexical[:top_k], engine, "embedder fallback: vector dimension changed"
        semantic = [(ids[row], score) for row, score in semantic]
        if wanted is not None:
            allowed = {row[0] for row in self._reader().execute(
                f"SELECT id FROM knowledge_passages WHERE source IN ({','.join('?' * len(wanted))}) AND id IN"
                f" ({','.join('?' * len(semantic))})", [*sorted(wanted), *(doc for doc, _ in semantic)])}
            semantic = [(doc, score) for doc, score in semantic if doc in allowed]
        semantic = semantic[:KNOWLEDGE_CANDIDATES]
        return fuse(lexical, semantic, top_k, KNOWLEDGE_HYBRID_ALPHA, full_spread=0), engine + "+hybrid", None

    def _embed_missing(self, progress=None) -> None:
        """Embed passages without a cached vector (saving them), then index every passage that has one."""
        with self._embed_lock:
            self._embed_missing_locked(progress or (lambda done, total: None))

    def _embed_missing_locked(self, progress) -> None:
        db = connect_vault_db(self.db_path)
        db.executescript(EMBEDDING_SCHEMA)
        try:
            rows = db.execute("SELECT id, heading, text FROM knowledge_passages ORDER BY id").fetchall()
            texts = {row["id"]: passage_embedding_text(row["heading"], row["text"]) for row in rows}
            hashes = {doc: text_hash(text) for doc, text in texts.items()}
            key = self.embedder.cache_key
            # Only the vectors of current passages stay in memory, as float32 arrays (4 bytes a dimension, a
            # fraction of what a list of Python floats takes).
            current = set(hashes.values())
            self._vectors = {h: v for h, v in self._vectors.items() if h in current}
            wanted = list(current - set(self._vectors))
            for start in range(0, len(wanted), 500):   # cached ones first: never re-embed what the vault has
                chunk = wanted[start:start + 500]
                for row in db.execute(f"SELECT text_hash, vector FROM embeddings WHERE model=? AND text_hash IN"
                                      f" ({','.join('?' * len(chunk))})", [key, *chunk]):
                    self._vectors[row["text_hash"]] = array.array("f", row["vector"])
            missing = {}
            for doc, digest in hashes.items():
                if digest not in self._vectors and digest not in missing:
                    missing[digest] = texts[doc]
            # In chunks, each saved as it arrives: a slow embedder that fails part way keeps what it did, and a
            # close() stops the work at the next chunk.
            pending = list(missing.items())
            for start in range(0, len(pending), self.EMBED_CHUNK):
                if self._worker.stopping.is_set():
                    return
                chunk = pending[start:start + self.EMBED_CHUNK]
                vectors = self.embedder.embed([text for _, text in chunk], self.build_timeout)
                new = {digest: array.array("f", vector) for (digest, _), vector in zip(chunk, vectors)}
                self._vectors.update(new)
                with _Transaction(db):
                    db.executemany("INSERT OR REPLACE INTO embeddings(model, text_hash, dim, vector, created_at)"
                                   " VALUES (?,?,?,?,?)",
                                   [(key, h, len(v), v.tobytes(), utcnow()) for h, v in new.items()])
                progress(min(start + self.EMBED_CHUNK, len(pending)), len(pending))
        finally:
            db.close()
        ids = [doc for doc in hashes if hashes[doc] in self._vectors]
        dims = collections.Counter(len(self._vectors[hashes[doc]]) for doc in ids)
        if len(dims) > 1:   # the model behind the name changed: drop the minority, re-embed next round
            keep = dims.most_common(1)[0][0]
            for digest in [h for h, v in self._vectors.items() if len(v) != keep]:
                del self._vectors[digest]
            raise EmbedderError("cached passage vectors of several dimensions; re-embedding")
        self._semantic = (ids, SemanticIndex([None] * len(ids), [self._vectors[hashes[doc]] for doc in ids]))
