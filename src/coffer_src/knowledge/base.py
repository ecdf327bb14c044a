"""Knowledge base: the user's documents and notes behind coffer__ask and __remember.

A knowledge source is a folder of Markdown / plain text / reStructuredText.  Files are split into passages along
headings and paragraphs (each passage knows its file, heading path and line range), stored in coffer.db
(knowledge_sources, knowledge_files, knowledge_passages) and ranked by BM25F over Coffer's own analysed terms
(identifier splitting, stemming; heading, body and path fields).  Where the interpreter's sqlite3 has FTS5, an
FTS5 table over those terms finds the candidates on disk and BM25F re-scores them (no index in memory, nothing to
rebuild when a file changes); otherwise an in-memory BM25F index over all passages answers.  Both engines give the
same ranking (evals/ask.py measures both; a test checks it).

Indexing is incremental: a file whose (mtime, size) did not change is not read; one whose sha256 did not change is
not re-split.  With an embedder configured, passage vectors are cached in the embeddings table (model + text hash)
like tool vectors and fused with the lexical ranking; any embedder failure answers lexically.  Memory notes are
small Markdown files with front matter under COFFER_HOME/memory/, indexed as the reserved source "memory"."""

from __future__ import annotations

import array
import collections
import heapq
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from typing import NamedTuple

from coffer_src.errors import CofferError
from coffer_src.jsonrpc import dumps
from coffer_src.knowledge.documents import (
    _CONTROL_CHARS_RE,
    KNOWLEDGE_DEFAULT_GLOBS,
    KNOWLEDGE_SOURCE_RE,
    MEMORY_ID_RE,
    MEMORY_SOURCE,
    MEMORY_TAG_RE,
    ROOT_UNREADABLE,
    FoundFile,
    KnowledgeLimits,
    Passage,
    document_kind,
    glob_regex,
    parse_front_matter,
    read_document,
    split_lines,
    split_passages,
    walk_source,
)
from coffer_src.search.index import BM25_K1, bm25_idf
from coffer_src.search.lexicon import TRANSLATION_WEIGHT
from coffer_src.search.semantic import (
    KNOWLEDGE_HYBRID_ALPHA,
    Embedder,
    EmbedderError,
    SemanticIndex,
    fuse,
    text_hash,
)
from coffer_src.search.text import knowledge_terms, translations
from coffer_src.terminal import log, redact
from coffer_src.vault import (
    EMBEDDING_SCHEMA,
    KNOWLEDGE_FTS_SCHEMA,
    KNOWLEDGE_SCHEMA,
    Vault,
    _Transaction,
    iso_timestamp,
    utcnow,
)


def _path_words(path: str) -> str:
    stem_part = path.rsplit(".", 1)[0] if "." in path.rsplit("/", 1)[-1] else path
    return " ".join(knowledge_terms(stem_part.replace("/", " ").replace("-", " ").replace("_", " ")))


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


class KnowledgeSource(NamedTuple):
    name: str
    root: str
    globs: tuple[str, ...]
    kind: str
    files: int
    passages: int
    indexed_at: str | None


class ReindexStats(NamedTuple):
    """What one reindex of one source did; counts only (the log may show it: no text, no question)."""

    source: str
    files_seen: int
    files_read: int          # files whose (mtime, size) changed, so their bytes were read and hashed
    files_added: int
    files_changed: int       # content changed: re-split and re-indexed
    files_removed: int
    files_unchanged: int
    passages_added: int
    passages_removed: int
    skipped: dict            # reason -> count (binary, too large, symlink outside the root, ...)
    seconds: float


class MemoryNote(NamedTuple):
    id: str
    time: str
    client: str
    tags: tuple[str, ...]
    text: str


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


class KnowledgeBase:
    """Owns the knowledge tables of coffer.db, the memory folder, and the in-memory indexes over them.

    Threads: ``search``/``ask``/``sources``/``memories``/``memory``/``changed`` may run on any thread at once
    (each thread reads through its own SQLite connection; WAL lets them read while a write is under way).
    ``add_source``/``remove_source``/``reindex``/``remember``/``forget`` are writers: serialized by a lock in this
    process and by SQLite's write lock across processes; they may run on any thread (the gateway's watcher
    thread reindexes while worker threads search).  With an embedder, one daemon thread embeds new passages.
    """

    FTS_CANDIDATES = 100       # FTS5 hits re-scored by BM25F (50 gave the same eval results; 100 is margin)
    FTS_COMMON_SHARE = 0.2     # terms in more than this share of passages do not pick candidates (see _lexical)
    CANDIDATES = 50            # lexical and semantic candidates fused in hybrid mode
    EMBED_CHUNK = 256          # passages embedded (and saved) per embedder call
    MEMORY_MAX_CHARS = 16_000
    QUESTION_MAX_CHARS = 2_000

    def __init__(self, db_path: str, home: str, *, embedder: Embedder | None = None, engine: str = "auto",
                 query_timeout: float = 1.0, build_timeout: float = 120.0,
                 limits: KnowledgeLimits = KnowledgeLimits()):
        if engine not in ("auto", "fts5", "bm25f"):
            raise CofferError(f"knowledge engine must be auto, fts5 or bm25f, not {engine!r}")
        if engine == "fts5" and not fts5_available():
            raise CofferError("this Python's sqlite3 has no FTS5; use engine 'bm25f'")
        self.db_path, self.home, self.limits = db_path, home, limits
        self.engine = "fts5" if engine == "fts5" or (engine == "auto" and fts5_available()) else "bm25f"
        self.memory_dir = os.path.join(home, "memory")
        self._write_lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer = Vault._connect(db_path)
        self._writer.executescript(KNOWLEDGE_SCHEMA)
        if fts5_available():
            self._prepare_fts()
        self.embedder, self.query_timeout, self.build_timeout = embedder, query_timeout, build_timeout
        self._vectors: dict[str, list[float]] = {}
        self._semantic: tuple[list[int], SemanticIndex] | None = None  # (passage id per row, index)
        self._embed_wanted = threading.Event()
        self._embed_lock = threading.Lock()   # the background thread and ensure_vectors embed one at a time
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        # Memory notes join searches without a 'sources' filter only when the user turned memory on (the gateway
        # sets this from 'coffer config memory'); an explicit sources=['memory'] always reaches them.
        self.memory_enabled = True
        if embedder is not None:
            self._ensure_embedding_table()
            self._embed_wanted.set()
            threading.Thread(target=self._embed_loop, name="coffer-knowledge-embedder", daemon=True).start()

    # -- connections ---------------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = Vault._connect(self.db_path)
            with self._readers_lock:
                self._readers.append(db)
        return db

    def close(self) -> None:
        self._closed.set()
        self._embed_wanted.set()
        with self._readers_lock:
            for db in self._readers:
                try:
                    db.close()
                except sqlite3.Error:
                    pass
            self._readers.clear()
        with self._write_lock:
            self._writer.close()

    def _generation(self, db) -> int:
        return db.execute("SELECT value FROM knowledge_meta WHERE key='generation'").fetchone()[0]

    def _prepare_fts(self) -> None:
        """Create the FTS5 tables, set their ranking, and rebuild them if a Python without FTS5 wrote passages
        since (it cannot update them)."""
        self._writer.executescript(KNOWLEDGE_FTS_SCHEMA)
        # The configured rank lets 'ORDER BY rank' take FTS5's own sorted path.  Stored in the table, so set once.
        rank = self._writer.execute("SELECT v FROM knowledge_fts_config WHERE k='rank'").fetchone()
        if not rank or rank[0] != "bm25(2.0, 1.0, 0.7)":
            with self._write_lock, _Transaction(self._writer) as db:
                db.execute("INSERT INTO knowledge_fts(knowledge_fts, rank) VALUES ('rank', 'bm25(2.0, 1.0, 0.7)')")
        row = self._writer.execute("SELECT value FROM knowledge_meta WHERE key='fts_synced'").fetchone()
        if row and row[0]:
            return
        with self._write_lock, _Transaction(self._writer) as db:
            db.execute("DELETE FROM knowledge_fts")
            db.execute("INSERT INTO knowledge_fts(rowid, heading, body, path, source) SELECT id, heading_terms,"
                       " body_terms, path_terms, source FROM knowledge_passages")
            db.execute("UPDATE knowledge_meta SET value=1 WHERE key='fts_synced'")
        log.warning("knowledge: full-text index rebuilt (passages were written by a Python without FTS5)")

    # -- sources -------------------------------------------------------------------------------------------
    def add_source(self, path: str, name: str | None = None, globs=None) -> ReindexStats:
        """Register a folder (or one file) and index it; the stats name the source."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise CofferError("give the path of a folder to add")
        root = os.path.abspath(os.path.expanduser(path))
        if not os.path.exists(root):
            raise CofferError(f"{root} does not exist")
        if name is None:
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(root.rstrip(os.sep)) or "docs").strip("-.")[:48]
            name = name if name and KNOWLEDGE_SOURCE_RE.match(name) else "docs"
        if not isinstance(name, str) or not KNOWLEDGE_SOURCE_RE.match(name):
            raise CofferError(f"bad source name {name!r}: use letters, digits, '.', '_' or '-' (at most 48)")
        if name.lower() == MEMORY_SOURCE:
            raise CofferError(f"{MEMORY_SOURCE!r} is reserved for memory notes (coffer memory ...)")
        globs = tuple(globs) if globs else KNOWLEDGE_DEFAULT_GLOBS
        if len(globs) > 32 or not all(isinstance(g, str) and g and len(g) <= 200 and "\x00" not in g for g in globs):
            raise CofferError("globs must be at most 32 non-empty patterns of at most 200 characters")
        for pattern in globs:
            try:
                glob_regex(pattern)
            except re.error as exc:
                raise CofferError(f"bad glob {pattern!r}: {exc}") from None
        with self._write_lock, _Transaction(self._writer) as db:
            if db.execute("SELECT 1 FROM knowledge_sources WHERE lower(name)=lower(?)", (name,)).fetchone():
                raise CofferError(f"knowledge source {name!r} already exists; remove it first or pick another name")
            db.execute("INSERT INTO knowledge_sources(name, root, globs, kind, created_at) VALUES (?,?,?,?,?)",
                       (name, root, dumps(list(globs)), "folder", utcnow()))
        return self.reindex(name)[0]

    def remove_source(self, name: str) -> None:
        if name == MEMORY_SOURCE:
            raise CofferError("memory notes are removed with 'coffer memory rm ID'")
        with self._write_lock, _Transaction(self._writer) as db:
            if not db.execute("SELECT 1 FROM knowledge_sources WHERE name=?", (name,)).fetchone():
                raise CofferError(f"unknown knowledge source {name!r}")
            self._delete_passages(db, "source=?", (name,))
            db.execute("DELETE FROM knowledge_files WHERE source=?", (name,))
            db.execute("DELETE FROM knowledge_sources WHERE name=?", (name,))
            self._bump(db)
        self._refresh_snapshot()

    def sources(self) -> list[KnowledgeSource]:
        db = self._reader()
        files = dict(db.execute("SELECT source, count(*) FROM knowledge_files GROUP BY source").fetchall())
        passages = dict(db.execute("SELECT source, count(*) FROM knowledge_passages GROUP BY source").fetchall())
        return [KnowledgeSource(row["name"], row["root"], tuple(json.loads(row["globs"])), row["kind"],
                                files.get(row["name"], 0), passages.get(row["name"], 0), row["indexed_at"])
                for row in db.execute("SELECT * FROM knowledge_sources ORDER BY name")]

    def _source_rows(self, db, name: str | None):
        rows = db.execute("SELECT * FROM knowledge_sources" + (" WHERE name=?" if name else "") + " ORDER BY name",
                          (name,) if name else ()).fetchall()
        if name and not rows:
            raise CofferError(f"unknown knowledge source {name!r}")
        return rows

    # -- indexing ------------------------------------------------------------------------------------------
    def _bump(self, db) -> None:
        db.execute("UPDATE knowledge_meta SET value=value+1 WHERE key='generation'")

    def _delete_passages(self, db, where: str, args: tuple) -> int:
        if fts5_available():
            db.execute(f"DELETE FROM knowledge_fts WHERE rowid IN (SELECT id FROM knowledge_passages WHERE {where})",
                       args)
        else:
            db.execute("UPDATE knowledge_meta SET value=0 WHERE key='fts_synced'")
        return db.execute(f"DELETE FROM knowledge_passages WHERE {where}", args).rowcount

    def reindex(self, name: str | None = None) -> list[ReindexStats]:
        """Bring one source (or all) up to date with its files; only changed files are read and re-split."""
        rows = self._source_rows(self._reader(), name)
        stats = [self._reindex_source(row) for row in rows]
        self._refresh_snapshot()
        if self.embedder is not None:
            self._embed_wanted.set()
        return stats

    def _reindex_source(self, source) -> ReindexStats:
        started = time.monotonic()
        name, kind = source["name"], source["kind"]
        skipped: collections.Counter = collections.Counter()
        found = walk_source(source["root"], tuple(json.loads(source["globs"])), self.limits, skipped)
        stored = {row["path"]: row for row in self._reader().execute(
            "SELECT id, path, mtime_ns, size, sha256, skipped FROM knowledge_files WHERE source=?", (name,))}
        counts: collections.Counter = collections.Counter()
        # (file, sha256, passages or None, why it has none): None without a reason = same content, new stat.
        pending: list[tuple[FoundFile, str, list[Passage] | None, str | None]] = []
        for found_file in found:
            row = stored.get(found_file.path)
            if row is not None and (row["mtime_ns"], row["size"]) == (found_file.mtime_ns, found_file.size):
                counts["unchanged"] += 1
                if row["skipped"]:
                    skipped[row["skipped"]] += 1
                continue
            if found_file.size > self.limits.max_file_bytes:
                text, digest, why_not = None, "", "too large"   # never read: a 50 MB log costs one stat
            else:
                text, digest, why_not = read_document(found_file.absolute, self.limits)
                counts["read"] += 1
            if text is None:
                skipped[why_not] += 1
                pending.append((found_file, digest, None, why_not))
            elif row is not None and row["sha256"] == digest and not row["skipped"]:
                counts["unchanged"] += 1        # touched, not changed: keep its passages
                pending.append((found_file, digest, None, None))
            else:
                counts["changed" if row is not None else "added"] += 1
                pending.append((found_file, digest, self._split(kind, found_file.path, text), None))
            if len(pending) >= 200:   # write in batches: short write transactions, bounded memory
                self._write_files(name, pending, counts)
                pending = []
        if pending:
            self._write_files(name, pending, counts)
        present = {f.path for f in found}
        # A folder that is gone for now (an unmounted drive, a renamed parent) keeps its index until it is back.
        root_missing = any(reason.startswith(ROOT_UNREADABLE) for reason in skipped)
        gone = [] if root_missing else [row for path, row in stored.items() if path not in present]
        with self._write_lock, _Transaction(self._writer) as db:
            for row in gone:
                counts["passages_removed"] += self._delete_passages(db, "file_id=?", (row["id"],))
                db.execute("DELETE FROM knowledge_files WHERE id=?", (row["id"],))
            if gone:
                self._bump(db)
            result = ReindexStats(name, len(found), counts["read"], counts["added"], counts["changed"], len(gone),
                                  counts["unchanged"], counts["passages_added"], counts["passages_removed"],
                                  dict(skipped), round(time.monotonic() - started, 3))
            db.execute("UPDATE knowledge_sources SET indexed_at=?, last_stats=? WHERE name=?",
                       (utcnow(), dumps(result._asdict()), name))
        if skipped.get("over the walk limits"):
            log.warning("knowledge: source %s is over the walk limits (%d files, %d entries); the rest is not "
                        "indexed", name, self.limits.max_files, self.limits.max_entries)
        return result

    def _split(self, kind: str, path: str, text: str) -> list[Passage]:
        text = redact(_CONTROL_CHARS_RE.sub("\ufffd", text))  # a known secret in a document stays out of coffer.db
        if kind != "memory":
            return split_passages(text, document_kind(path), self.limits)
        fields, body_start = parse_front_matter(text)
        tags = fields.get("tags") if isinstance(fields.get("tags"), list) else []
        heading = "memory" + (": " + ", ".join(str(t) for t in tags[:16]) if tags else "")
        return [p._replace(heading=heading) for p in split_passages(text, "markdown", self.limits)
                if p.last_line > body_start]

    def _write_files(self, name: str, pending, counts: collections.Counter) -> None:
        now = utcnow()
        with self._write_lock, _Transaction(self._writer) as db:
            for found_file, digest, passages, why_not in pending:
                row = db.execute("SELECT id, sha256, skipped FROM knowledge_files WHERE source=? AND path=?",
                                 (name, found_file.path)).fetchone()
                same = row is not None and row["sha256"] == digest and not row["skipped"]
                if row is not None and ((passages is None and why_not is None) or (same and passages is not None)):
                    # Same content (or another process indexed it meanwhile): remember the new stat only.
                    db.execute("UPDATE knowledge_files SET mtime_ns=?, size=? WHERE id=?",
                               (found_file.mtime_ns, found_file.size, row["id"]))
                    continue
                if row is not None:
                    counts["passages_removed"] += self._delete_passages(db, "file_id=?", (row["id"],))
                    db.execute("UPDATE knowledge_files SET mtime_ns=?, size=?, sha256=?, skipped=?, indexed_at=?"
                               " WHERE id=?", (found_file.mtime_ns, found_file.size, digest, why_not, now, row["id"]))
                    file_id = row["id"]
                else:
                    file_id = db.execute("INSERT INTO knowledge_files(source, path, mtime_ns, size, sha256, skipped,"
                                         " indexed_at) VALUES (?,?,?,?,?,?,?)",
                                         (name, found_file.path, found_file.mtime_ns, found_file.size, digest,
                                          why_not, now)).lastrowid
                if not passages:
                    continue
                path_terms = _path_words(found_file.path)
                rows = [(file_id, name, found_file.path, p.heading, p.first_line, p.last_line, p.text,
                         " ".join(knowledge_terms(p.heading)), " ".join(knowledge_terms(p.text)), path_terms)
                        for p in passages]
                db.executemany(
                    "INSERT INTO knowledge_passages(file_id, source, path, heading, first_line, last_line, text,"
                    " heading_terms, body_terms, path_terms) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
                counts["passages_added"] += len(rows)
                if fts5_available():
                    db.execute("INSERT INTO knowledge_fts(rowid, heading, body, path, source) SELECT id,"
                               " heading_terms, body_terms, path_terms, source FROM knowledge_passages WHERE"
                               " file_id=?", (file_id,))
                else:
                    db.execute("UPDATE knowledge_meta SET value=0 WHERE key='fts_synced'")
            self._bump(db)

    def changed(self) -> bool:
        """Whether any source's files differ from the index (added, removed, or a new mtime/size).

        Cost: one directory listing per folder and one stat per matching file, no file is read -- measured 25 ms
        for 1,368 files and 0.5 s for 20,000 (the per-source cap) on a busy 2-core machine.  ``start_watcher``
        polls every 2 s and stretches the interval to 50x the last check, so polling stays under ~2% of a core.
        """
        db = self._reader()
        for source in self._source_rows(db, None):
            skipped: collections.Counter = collections.Counter()
            found = walk_source(source["root"], tuple(json.loads(source["globs"])), self.limits, skipped)
            if any(reason.startswith(ROOT_UNREADABLE) for reason in skipped):
                continue   # nothing to compare with; reindex would keep the index as it is
            stored = {row[0]: (row[1], row[2]) for row in db.execute(
                "SELECT path, mtime_ns, size FROM knowledge_files WHERE source=?", (source["name"],))}
            if stored != {f.path: (f.mtime_ns, f.size) for f in found}:
                return True
        return False

    def start_watcher(self, interval: float = 2.0) -> None:
        """Poll for file changes on a daemon thread and reindex when there are some (serve calls this once)."""
        if self._watcher is not None:
            return

        def watch():
            wait = interval
            while not self._closed.wait(wait):
                started = time.monotonic()
                try:
                    if self.changed():
                        self.reindex()
                except Exception:  # noqa: BLE001 - a bad folder must not end the watcher
                    log.exception("knowledge: watching for file changes failed")
                # Keep polling under ~2% of a core even for a huge source.
                wait = max(interval, 50.0 * (time.monotonic() - started))

        self._watcher = threading.Thread(target=watch, name="coffer-knowledge-watcher", daemon=True)
        self._watcher.start()

    # -- search --------------------------------------------------------------------------------------------
    def _refresh_snapshot(self) -> _Snapshot:
        """Rebuild the snapshot if the tables changed.  One builder at a time; searches on other threads keep
        answering from the previous snapshot meanwhile (building the in-memory BM25F index of 10k passages takes
        about a second; the FTS5 engine only reads counts)."""
        with self._snapshot_lock:
            db = self._reader()
            db.execute("BEGIN")   # one consistent read: the generation and the rows it describes
            try:
                generation = self._generation(db)
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

    def _current_snapshot(self) -> _Snapshot:
        snapshot = self._snapshot
        if snapshot is not None and (snapshot.generation == self._generation(self._reader())
                                     or self._snapshot_lock.locked()):
            return snapshot   # current, or a rebuild is under way on another thread: answer from this one
        return self._refresh_snapshot()

    def query_weights(self, question: str) -> dict[str, float]:
        weights: dict[str, float] = {}
        for term in knowledge_terms(question):
            weights[term] = 1.0
        for term in translations(question):
            weights[term] = max(weights.get(term, 0.0), TRANSLATION_WEIGHT)
        return weights

    def _lexical(self, snapshot: _Snapshot, weights: dict[str, float], limit: int, sources):
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
        sql += " ORDER BY rank LIMIT ?"   # rank = bm25(2.0, 1.0, 0.7), set in _prepare_fts: ~2x faster than bm25()
        args.append(max(limit, self.FTS_CANDIDATES))
        db = self._reader()
        try:
            candidates = [row[0] for row in db.execute(sql, args)]
        except sqlite3.OperationalError as exc:
            log.warning("knowledge: full-text query failed (%s)", exc)
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

    def passages(self, sources=None):
        """Every indexed passage (score 0), in id order: for listing, exporting and the evals' comparators."""
        snapshot = self._current_snapshot()
        wanted = self._check_sources(snapshot, sources)
        for row in self._reader().execute("SELECT source, path, heading, first_line, last_line, text FROM"
                                          " knowledge_passages ORDER BY id"):
            if wanted is None or row["source"] in wanted:
                yield KnowledgeHit(row["source"], row["path"], row["heading"], (row["first_line"], row["last_line"]),
                                   row["text"], 0.0)

    def search(self, question: str, top_k: int = 5, sources=None) -> list[KnowledgeHit]:
        return self.ask(question, top_k, sources).passages

    def ask(self, question: str, top_k: int = 5, sources=None) -> KnowledgeAnswer:
        """The passages that best answer ``question``, best first; never raises for an embedder problem."""
        if not isinstance(question, str):
            raise CofferError("question must be a string")
        question = question.strip()[:self.QUESTION_MAX_CHARS]
        try:
            top_k = max(1, min(20, int(top_k)))
        except (TypeError, ValueError):
            raise CofferError("top_k must be an integer from 1 to 20") from None
        snapshot = self._current_snapshot()
        wanted = self._check_sources(snapshot, sources)
        if wanted is None and not self.memory_enabled and snapshot.counts.get(MEMORY_SOURCE):
            wanted = frozenset(snapshot.counts) - {MEMORY_SOURCE}
        total = sum(count for source, count in snapshot.counts.items() if wanted is None or source in wanted)
        if not question or not total:
            return KnowledgeAnswer([], total, self.engine, None)
        weights = self.query_weights(question)
        limit = max(top_k, self.CANDIDATES)
        lexical = self._lexical(snapshot, weights, limit, wanted) if weights else []
        ranker, note, ranked = self.engine, None, lexical[:top_k]
        if self.embedder is not None:
            ranked, ranker, note = self._hybrid(question, lexical, top_k, wanted)
        return KnowledgeAnswer(self._hits(ranked), total, ranker, note)

    def _check_sources(self, snapshot, sources):
        if sources is None:
            return None
        if isinstance(sources, str):
            sources = [sources]
        if not isinstance(sources, (list, tuple)) or len(sources) > 100 or \
                not all(isinstance(s, str) for s in sources):
            raise CofferError("sources must be a list of knowledge source names")
        known = {row[0] for row in self._reader().execute("SELECT name FROM knowledge_sources")}
        unknown = [s for s in sources if s not in known]
        if unknown:
            raise CofferError(f"unknown knowledge source {unknown[0]!r}; known: {', '.join(sorted(known)) or 'none'}")
        return frozenset(sources)

    def _hits(self, ranked: list[tuple[int, float]]) -> list[KnowledgeHit]:
        if not ranked:
            return []
        rows = {row["id"]: row for row in self._reader().execute(
            "SELECT id, source, path, heading, first_line, last_line, text FROM knowledge_passages WHERE id IN"
            f" ({','.join('?' * len(ranked))})", [doc for doc, _ in ranked])}
        return [KnowledgeHit(row["source"], row["path"], row["heading"], (row["first_line"], row["last_line"]),
                             row["text"], round(score, 4))
                for doc, score in ranked if (row := rows.get(doc)) is not None]

    # -- hybrid (optional embedder) ------------------------------------------------------------------------
    def _hybrid(self, question, lexical, top_k, wanted):
        semantic_state = self._semantic
        if semantic_state is None:
            return lexical[:top_k], self.engine, "embedder: passage vectors not ready yet"
        try:
            query_vector = self.embedder.embed([question], self.query_timeout)[0]
        except EmbedderError as exc:
            log.warning("knowledge: embedder fallback to BM25: %s", exc)
            return lexical[:top_k], self.engine, f"embedder fallback: {exc}"
        ids, index = semantic_state
        try:
            semantic = index.rank(query_vector, self.CANDIDATES * (4 if wanted is not None else 1))
        except ValueError:
            return lexical[:top_k], self.engine, "embedder fallback: vector dimension changed"
        semantic = [(ids[row], score) for row, score in semantic]
        if wanted is not None:
            allowed = {row[0] for row in self._reader().execute(
                f"SELECT id FROM knowledge_passages WHERE source IN ({','.join('?' * len(wanted))}) AND id IN"
                f" ({','.join('?' * len(semantic))})", [*sorted(wanted), *(doc for doc, _ in semantic)])}
            semantic = [(doc, score) for doc, score in semantic if doc in allowed]
        semantic = semantic[:self.CANDIDATES]
        return fuse(lexical, semantic, top_k, KNOWLEDGE_HYBRID_ALPHA, full_spread=0), self.engine + "+hybrid", None

    def _ensure_embedding_table(self) -> None:
        try:
            db = Vault._connect(self.db_path)
            db.executescript(EMBEDDING_SCHEMA)
            db.close()
        except sqlite3.Error as exc:
            log.warning("knowledge: embedding cache unavailable: %s", exc)

    def _embed_loop(self) -> None:
        delay, last_error = 5.0, None
        while True:
            self._embed_wanted.wait()
            self._embed_wanted.clear()
            if self._closed.is_set():
                return
            try:
                self._embed_missing()
            except Exception as exc:  # noqa: BLE001 - lexical search serves meanwhile; this thread must live on
                if str(exc) != last_error:
                    log.warning("knowledge: passage vectors unavailable (%s); answering lexically until they are",
                                exc)
                    last_error = str(exc)
                if self._closed.wait(delay):
                    return
                delay = min(delay * 2, 120.0)
                self._embed_wanted.set()
                continue
            delay, last_error = 5.0, None

    def ensure_vectors(self) -> None:
        """Embed what is missing now, on this thread (the background thread does the same on its own); raises
        EmbedderError.  For callers that want hybrid answers at once: evals, tests, ``coffer knowledge reindex``."""
        if self.embedder is None:
            raise CofferError("no embedder is configured")
        self._embed_missing()

    def _embed_missing(self) -> None:
        """Embed passages without a cached vector (saving them), then index every passage that has one."""
        with self._embed_lock:
            self._embed_missing_locked()

    def _embed_missing_locked(self) -> None:
        db = Vault._connect(self.db_path)
        db.executescript(EMBEDDING_SCHEMA)
        try:
            rows = db.execute("SELECT id, heading, text FROM knowledge_passages ORDER BY id").fetchall()
            texts = {row["id"]: passage_embedding_text(row["heading"], row["text"]) for row in rows}
            hashes = {doc: text_hash(text) for doc, text in texts.items()}
            key = self.embedder.cache_key
            # Only the vectors of current passages stay in memory, as float32 arrays (1.5 kB each at 384
            # dimensions, against ~12 kB as lists of floats).
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
            # In chunks, each saved as it arrives: a slow embedder that fails part way keeps what it did.
            pending = list(missing.items())
            for start in range(0, len(pending), self.EMBED_CHUNK):
                chunk = pending[start:start + self.EMBED_CHUNK]
                vectors = self.embedder.embed([text for _, text in chunk], self.build_timeout)
                new = {digest: array.array("f", vector) for (digest, _), vector in zip(chunk, vectors)}
                self._vectors.update(new)
                with _Transaction(db):
                    db.executemany("INSERT OR REPLACE INTO embeddings(model, text_hash, dim, vector, created_at)"
                                   " VALUES (?,?,?,?,?)",
                                   [(key, h, len(v), v.tobytes(), utcnow()) for h, v in new.items()])
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

    # -- memory --------------------------------------------------------------------------------------------
    def _ensure_memory_source(self) -> None:
        os.makedirs(self.memory_dir, mode=0o700, exist_ok=True)
        with self._write_lock, _Transaction(self._writer) as db:
            db.execute("INSERT OR IGNORE INTO knowledge_sources(name, root, globs, kind, created_at) VALUES"
                       " (?,?,?,?,?)", (MEMORY_SOURCE, self.memory_dir, dumps(["*.md"]), "memory", utcnow()))

    def remember(self, text: str, tags=(), client: str | None = None) -> str:
        """Write a memory note (a 0600 Markdown file with front matter) and index it; returns its id."""
        if not isinstance(text, str) or not text.strip():
            raise CofferError("a memory needs some text")
        if len(text) > self.MEMORY_MAX_CHARS:
            raise CofferError(f"a memory holds at most {self.MEMORY_MAX_CHARS} characters")
        if isinstance(tags, str):
            tags = [tags]
        if not isinstance(tags, (list, tuple)) or len(tags) > 16 or \
                not all(isinstance(t, str) and MEMORY_TAG_RE.match(t) for t in tags):
            raise CofferError("tags must be at most 16 words of letters, digits, '.', '_' or '-' (32 characters)")
        client = _CONTROL_CHARS_RE.sub("", str(client or "unknown")).replace("\n", " ").replace("\r", " ")[:100]
        self._ensure_memory_source()
        now = time.time()
        note_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)
        body = text.replace("\r\n", "\n").strip("\n")
        content = (f"---\nid: {note_id}\ntime: {iso_timestamp(now)}\nclient: {json.dumps(client)}\n"
                   f"tags: {json.dumps(list(tags))}\n---\n{body}\n")
        path = os.path.join(self.memory_dir, note_id + ".md")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(content)
        self.reindex(MEMORY_SOURCE)
        return note_id

    def _note_path(self, note_id: str) -> str:
        if not isinstance(note_id, str) or not MEMORY_ID_RE.match(note_id):
            raise CofferError(f"bad memory id {note_id!r}")
        return os.path.join(self.memory_dir, note_id + ".md")

    def memory(self, note_id: str) -> MemoryNote:
        path = self._note_path(note_id)
        if not os.path.isfile(path):
            raise CofferError(f"unknown memory {note_id!r}")
        text, _, why_not = read_document(path, self.limits)
        if text is None:
            raise CofferError(f"memory {note_id!r} is {why_not}")
        fields, body_start = parse_front_matter(text)
        tags = fields.get("tags") if isinstance(fields.get("tags"), list) else []
        return MemoryNote(note_id, str(fields.get("time", "")), str(fields.get("client", "")),
                          tuple(str(t) for t in tags), "\n".join(split_lines(text)[body_start:]).strip("\n"))

    def memories(self) -> list[MemoryNote]:
        try:
            names = sorted(os.listdir(self.memory_dir))
        except OSError:
            return []
        notes = []
        for name in names:
            note_id = name[:-3]
            if name.endswith(".md") and MEMORY_ID_RE.match(note_id):
                try:
                    notes.append(self.memory(note_id))
                except CofferError:
                    continue
        return notes

    def forget(self, note_id: str) -> bool:
        path = self._note_path(note_id)
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        self.reindex(MEMORY_SOURCE)
        return True
