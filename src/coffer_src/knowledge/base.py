"""Knowledge base: the user's documents and notes behind coffer__ask and __remember.

A knowledge source is a folder of Markdown / plain text / reStructuredText.  Files are split into passages along
headings and paragraphs (each passage knows its file, heading path and line range), stored in coffer.db
(knowledge_sources, knowledge_files, knowledge_passages) with Coffer's own analysed terms (identifier splitting,
stemming; heading, body and path fields) and, where the interpreter's sqlite3 has FTS5, in an FTS5 table over
those terms.  Answering is knowledge/ranking.py's: BM25F over the passages, fused with passage vectors when an
embedder is configured.  Memory notes are small Markdown files with front matter under COFFER_HOME/memory/
(knowledge/documents.py: MemoryNotes), indexed as the reserved source "memory".

Indexing is incremental: a file whose (mtime, size) did not change is not read; one whose sha256 did not change is
not re-split.

Threads and locks: see KnowledgeBase."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
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
    ROOT_UNREADABLE,
    FoundFile,
    KnowledgeLimits,
    MemoryNote,
    MemoryNotes,
    Passage,
    document_kind,
    glob_regex,
    parse_front_matter,
    read_document,
    split_passages,
    walk_source,
)
from coffer_src.knowledge.ranking import (
    KnowledgeAnswer,
    KnowledgeHit,
    PassageRanker,
    PassageVectors,
    fts5_available,
    passage_embedding_text,
)
from coffer_src.names import MEMORY_SOURCE
from coffer_src.search.semantic import Embedder, text_hash
from coffer_src.search.text import knowledge_terms
from coffer_src.terminal import redact
from coffer_src.vault import _Transaction, connect_vault_db, utcnow
from coffer_src.vault_schema import KNOWLEDGE_FTS_SCHEMA, KNOWLEDGE_SCHEMA

knowledge_log = logging.getLogger(__name__)


def _path_words(path: str) -> str:
    stem_part = path.rsplit(".", 1)[0] if "." in path.rsplit("/", 1)[-1] else path
    return " ".join(knowledge_terms(stem_part.replace("/", " ").replace("-", " ").replace("_", " ")))


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


class KnowledgeBase:
    """Owns the knowledge tables of coffer.db and their connections, the sources and their indexing, the watcher,
    and the memory folder; answers through a PassageRanker (and PassageVectors with an embedder).

    Threads: ``search``/``ask``/``passages``/``sources``/``memories``/``memory``/``changed`` may run on any
    thread at once (each thread reads through its own SQLite connection, opened on its first read; WAL lets them
    read while a write is under way).  ``add_source``/``remove_source``/``reindex``/``remember``/``forget`` are
    writers: serialized by ``_write_lock`` in this process and by SQLite's write lock across processes; they may
    run on any thread (the watcher thread reindexes while worker threads search).  With an embedder, one worker
    thread embeds new passages.  ``close`` ends both threads and then closes every connection.

    Locks: ``_write_lock`` is held for each write transaction on the one writer connection (``_write_transaction``;
    SQLite's write lock is taken inside it) and while ``close`` closes that connection; no other of Coffer's locks
    is taken under it.  ``_readers_lock`` guards the list of reader connections and is a leaf, taken on a thread's
    first read, which may happen under the ranker's snapshot lock (knowledge/ranking.py says what its locks
    guard).  ``_closed`` and the threads' stop events are events, not locks.
    """

    MEMORY_MAX_CHARS = MemoryNotes.MAX_CHARS
    QUESTION_MAX_CHARS = 2_000

    def __init__(self, db_path: str, home: str, *, embedder: Embedder | None = None, engine: str = "auto",
                 query_timeout: float = 1.0, build_timeout: float = 120.0,
                 limits: KnowledgeLimits = KnowledgeLimits(), background_embedding: bool = True):
        if engine not in ("auto", "fts5", "bm25f"):
            raise CofferError(f"knowledge engine must be auto, fts5 or bm25f, not {engine!r}")
        if engine == "fts5" and not fts5_available():
            raise CofferError("this Python's sqlite3 has no FTS5; use engine 'bm25f'")
        self.db_path, self.home, self.limits = db_path, home, limits
        self.engine = "fts5" if engine == "fts5" or (engine == "auto" and fts5_available()) else "bm25f"
        self.memory_dir = os.path.join(home, "memory")
        self._notes = MemoryNotes(self.memory_dir, limits)
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer = connect_vault_db(db_path)
        self._writer.executescript(KNOWLEDGE_SCHEMA)
        if fts5_available():
            self._prepare_fts()
        self.embedder = embedder
        self._watcher: threading.Thread | None = None
        # Memory notes join searches without a 'sources' filter only when the user turned memory on (the gateway
        # sets this from 'coffer config memory'); an explicit sources=['memory'] always reaches them.
        self.memory_enabled = True
        # Last: the vectors' worker thread starts embedding at once.
        self._vectors = PassageVectors(embedder, db_path, self._reader, query_timeout, build_timeout,
                                       background_embedding) if embedder is not None else None
        self._ranking = PassageRanker(self.engine, self._reader, self._vectors)

    # -- connections ---------------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = connect_vault_db(self.db_path)
            with self._readers_lock:
                self._readers.append(db)
        return db

    def close(self, timeout: float = 1.0) -> bool:
        """End the watcher and the embedder's thread (waiting up to ``timeout`` seconds for each), then close every
        connection.  A reindex under way on the watcher stops at its next batch of files.  True when both threads
        have ended."""
        self._closed.set()
        ended = self._vectors.close(timeout) if self._vectors is not None else True
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout)
            ended = ended and not watcher.is_alive()
        with self._readers_lock:
            for db in self._readers:
                try:
                    db.close()
                except sqlite3.Error:
                    pass
            self._readers.clear()
        with self._write_lock:
            self._writer.close()
        return ended

    @contextlib.contextmanager
    def _write_transaction(self):
        """The writer connection in a write transaction, under _write_lock; a CofferError once closed (close
        sets ``_closed`` before it takes the lock to close the writer, so the check under the lock is exact)."""
        with self._write_lock:
            if self._closed.is_set():
                raise CofferError("the knowledge base is closed")
            with _Transaction(self._writer) as db:
                yield db

    def _prepare_fts(self) -> None:
        """Create the FTS5 tables, set their ranking, and rebuild them if a Python without FTS5 wrote passages
        since (it cannot update them)."""
        self._writer.executescript(KNOWLEDGE_FTS_SCHEMA)
        # The configured rank lets 'ORDER BY rank' take FTS5's own sorted path.  Stored in the table, so set once.
        rank = self._writer.execute("SELECT v FROM knowledge_fts_config WHERE k='rank'").fetchone()
        if not rank or rank[0] != "bm25(2.0, 1.0, 0.7)":
            with self._write_transaction() as db:
                db.execute("INSERT INTO knowledge_fts(knowledge_fts, rank) VALUES ('rank', 'bm25(2.0, 1.0, 0.7)')")
        row = self._writer.execute("SELECT value FROM knowledge_meta WHERE key='fts_synced'").fetchone()
        if row and row[0]:
            return
        with self._write_transaction() as db:
            db.execute("DELETE FROM knowledge_fts")
            db.execute("INSERT INTO knowledge_fts(rowid, heading, body, path, source) SELECT id, heading_terms,"
                       " body_terms, path_terms, source FROM knowledge_passages")
            db.execute("UPDATE knowledge_meta SET value=1 WHERE key='fts_synced'")
        knowledge_log.warning("knowledge: full-text index rebuilt (passages were written by a Python without FTS5)")

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
        with self._write_transaction() as db:
            if db.execute("SELECT 1 FROM knowledge_sources WHERE lower(name)=lower(?)", (name,)).fetchone():
                raise CofferError(f"knowledge source {name!r} already exists; remove it first or pick another name")
            db.execute("INSERT INTO knowledge_sources(name, root, globs, kind, created_at) VALUES (?,?,?,?,?)",
                       (name, root, dumps(list(globs)), "folder", utcnow()))
        return self.reindex(name)[0]

    def remove_source(self, name: str) -> None:
        if name == MEMORY_SOURCE:
            raise CofferError("memory notes are removed with 'coffer memory rm ID'")
        with self._write_transaction() as db:
            if not db.execute("SELECT 1 FROM knowledge_sources WHERE name=?", (name,)).fetchone():
                raise CofferError(f"unknown knowledge source {name!r}")
            self._delete_passages(db, "source=?", (name,))
            db.execute("DELETE FROM knowledge_files WHERE source=?", (name,))
            db.execute("DELETE FROM knowledge_sources WHERE name=?", (name,))
            self._bump(db)
        self._ranking.refresh()

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
        self._ranking.refresh()
        if self._vectors is not None:
            self._vectors.wake()
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
        with self._write_transaction() as db:
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
            knowledge_log.warning("knowledge: source %s is over the walk limits (%d files, %d entries); the rest is "
                                  "not indexed", name, self.limits.max_files, self.limits.max_entries)
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
        with self._write_transaction() as db:
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

        Cost: one directory listing per folder and one stat per matching file, no file is read (evals/bench.py
        prints what a poll takes).  ``start_watcher`` polls every 2 s and stretches the interval to 50x the last
        check, so polling keeps a core busy at most 1/51 of the time, however large the sources.
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
        """Poll for file changes on a daemon thread and reindex when there are some (serve calls this once;
        ``close`` ends the thread)."""
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
                    if self._closed.is_set():
                        return   # closed under a reindex: its connections are gone, and nothing is wrong
                    knowledge_log.exception("knowledge: watching for file changes failed")
                # Wait 50 times as long as the check took: polling keeps a core busy at most 1/51 of the time.
                wait = max(interval, 50.0 * (time.monotonic() - started))

        self._watcher = threading.Thread(target=watch, name="coffer-knowledge-watcher", daemon=True)
        self._watcher.start()

    # -- answering -----------------------------------------------------------------------------------------
    def passages(self, sources=None):
        """Every indexed passage (score 0), in id order: for listing, exporting and the evals' comparators."""
        self._ranking.snapshot()
        wanted = self._check_sources(sources)
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
        snapshot = self._ranking.snapshot()
        wanted = self._check_sources(sources)
        if wanted is None and not self.memory_enabled and snapshot.counts.get(MEMORY_SOURCE):
            wanted = frozenset(snapshot.counts) - {MEMORY_SOURCE}
        return self._ranking.answer(snapshot, question, top_k, wanted)

    def _check_sources(self, sources):
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

    def ensure_vectors(self, progress=None) -> None:
        """Embed what is missing now, on this thread (the background thread does the same on its own;
        ``progress(done, total)`` after each chunk); raises EmbedderError.  For callers that want hybrid answers at
        once: `coffer knowledge add` and `reindex`, evals, tests."""
        if self._vectors is None:
            raise CofferError("no embedder is configured")
        self._vectors.ensure(progress)

    def vector_counts(self) -> dict[str, int]:
        """source -> how many of its passages have a vector of the configured embedder ({} without one)."""
        if self._vectors is None:
            return {}
        db = self._reader()
        try:
            cached = {row[0] for row in db.execute("SELECT text_hash FROM embeddings WHERE model=?",
                                                   (self._vectors.embedder.cache_key,))}
        except sqlite3.Error:
            return {}
        counts: collections.Counter = collections.Counter()
        for row in db.execute("SELECT source, heading, text FROM knowledge_passages"):
            if text_hash(passage_embedding_text(row["heading"], row["text"])) in cached:
                counts[row["source"]] += 1
        return dict(counts)

    # -- memory --------------------------------------------------------------------------------------------
    def _ensure_memory_source(self) -> None:
        os.makedirs(self.memory_dir, mode=0o700, exist_ok=True)
        with self._write_transaction() as db:
            db.execute("INSERT OR IGNORE INTO knowledge_sources(name, root, globs, kind, created_at) VALUES"
                       " (?,?,?,?,?)", (MEMORY_SOURCE, self.memory_dir, dumps(["*.md"]), "memory", utcnow()))

    def remember(self, text: str, tags=(), client: str | None = None) -> str:
        """Write a memory note (a 0600 Markdown file with front matter) and index it; returns its id."""
        text, tags, client = self._notes.checked(text, tags, client)
        self._ensure_memory_source()
        note_id = self._notes.write(text, tags, client)
        self.reindex(MEMORY_SOURCE)
        return note_id

    def memory(self, note_id: str) -> MemoryNote:
        return self._notes.read(note_id)

    def memories(self) -> list[MemoryNote]:
        return self._notes.every()

    def forget(self, note_id: str) -> bool:
        if not self._notes.delete(note_id):
            return False
        self.reindex(MEMORY_SOURCE)
        return True
