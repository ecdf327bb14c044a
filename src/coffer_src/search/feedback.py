"""Search feedback: searches, their answers, the tool then called (for coffer eval).

Nothing is kept unless the user says ``coffer config search_feedback on``.  Then each coffer__search_tools query
(secrets redacted), the tool names it returned and the ranker that answered, and the first upstream tool the same
session calls after it (an implicit label: the tool the agent wanted) go into coffer.db's search_feedback table
(its schema is vault.py's), pruned with the invocation log's retention.  None of it leaves the machine.
``evaluate_feedback`` scores the current ranker on the labelled searches, lexical and hybrid side by side.

Threads and locks: one FeedbackRecorder serves every session of a process (feedback_recorder); its lock guards
its connection and each session's last search, and is a leaf: nothing else is taken while it is held (a label's
listeners, search/preference.py's model, are called after it is released).  A write
waits at most BUSY_TIMEOUT_MS for a locked vault and is then dropped, with one warning: a search or a call never
waits long on feedback."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from typing import Callable, NamedTuple

from coffer_src.search.index import SearchIndex
from coffer_src.search.semantic import Embedder, EmbedderError, SemanticRanker
from coffer_src.search.text import SEARCH_QUERY_MAX_CHARS
from coffer_src.terminal import redact
from coffer_src.vault import Vault, connect_vault_db, storable, utcnow
from coffer_src.vault_rows import vault_json

feedback_log = logging.getLogger(__name__)

FEEDBACK_TOP = 10  # how deep `coffer eval` looks for the chosen tool (MRR@10)


class FeedbackRecorder:
    """Writes the search_feedback rows of one coffer.db: ``searched`` after a coffer__search_tools answer,
    ``called`` when a session calls an upstream tool (it labels that session's last search, once)."""

    BUSY_TIMEOUT_MS = 250

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> its last (key, query)
        self._warned = False
        self._listeners: list[Callable[[str, str, str], None]] = []  # appended once each, read without the lock

    def listen(self, listener: Callable[[str, str, str], None]) -> None:
        """Call ``listener(query, tool, key)`` for each search this recorder labels from now on (after the label
        is written, outside the lock)."""
        self._listeners.append(listener)

    def _write(self, sql: str, args: tuple) -> bool:
        """One statement in its own transaction; False (and one warning per process) if it could not be written.
        The caller holds the lock."""
        try:
            if self._db is None:
                self._db = connect_vault_db(self.path)
                self._db.execute(f"PRAGMA busy_timeout={self.BUSY_TIMEOUT_MS}")
            self._db.execute(sql, args)
            return True
        except sqlite3.Error as exc:
            if not self._warned:
                self._warned = True
                feedback_log.warning("search feedback not recorded (%s); searches are answered as usual", exc)
            return False

    def searched(self, session, client: str, query: str, ranker: str, names: list[str]) -> None:
        key = os.urandom(16).hex()
        kept = storable(redact(query))[:SEARCH_QUERY_MAX_CHARS]
        row = (key, utcnow(), storable(redact(client))[:64], kept, ranker, vault_json(names))
        with self._lock:
            if self._write("INSERT INTO search_feedback(key, ts, client, query, ranker, returned) "
                           "VALUES (?, ?, ?, ?, ?, ?)", row):
                self._last[session] = (key, kept)

    def called(self, session, tool: str) -> None:
        with self._lock:
            last = self._last.pop(session, None)
            labelled = last is not None and self._write(
                "UPDATE search_feedback SET chosen=?, chosen_ts=? WHERE key=? AND chosen IS NULL",
                (tool, utcnow(), last[0]))
        if labelled:
            for listener in tuple(self._listeners):
                listener(last[1], tool, last[0])


_RECORDERS: dict[str, FeedbackRecorder] = {}
_RECORDERS_LOCK = threading.Lock()  # a leaf


def feedback_recorder(path: str) -> FeedbackRecorder:
    """The process's recorder for the coffer.db at ``path``."""
    with _RECORDERS_LOCK:
        recorder = _RECORDERS.get(path)
        if recorder is None:
            recorder = _RECORDERS[path] = FeedbackRecorder(path)
        return recorder


class LabelledSearch(NamedTuple):
    """A recorded search whose session then called a tool."""

    ts: str
    query: str
    returned: list[str]
    chosen: str


def labelled_searches(vault: Vault) -> tuple[list[LabelledSearch], int]:
    """The labelled searches in the vault, oldest first, and how many searches it holds in all."""
    rows = vault.db.execute("SELECT ts, query, returned, chosen FROM search_feedback ORDER BY id").fetchall()
    labelled = []
    for row in rows:
        if row["chosen"]:
            try:
                returned = [str(name) for name in json.loads(row["returned"])]
            except (ValueError, TypeError):
                returned = []
            labelled.append(LabelledSearch(row["ts"], row["query"], returned, row["chosen"]))
    return labelled, len(rows)


def _ranker_scores(ranks: list[int | None]) -> dict:
    """recall@1, recall@5 and MRR@10 of the 1-based ranks at which the chosen tool came (None: not in the top)."""
    n = len(ranks) or 1
    return {"recall@1": sum(rank == 1 for rank in ranks) / n,
            "recall@5": sum(rank is not None and rank <= 5 for rank in ranks) / n,
            "mrr@10": sum(1.0 / rank for rank in ranks if rank) / n}


def _rank_of(name: str, ranked: list[str]) -> int | None:
    return ranked.index(name) + 1 if name in ranked[:FEEDBACK_TOP] else None


def evaluate_feedback(tools: list[dict], searches: list[LabelledSearch], embedder: Embedder | None = None,
                      db_path: str | None = None, timeout: float = 60.0, preference=None) -> dict:
    """How the current ranker does on the user's own labelled searches: for ``lexical`` (and ``hybrid`` with an
    embedder, through the gateway's own SemanticRanker, its vector cache in ``db_path``), recall@1/5 and MRR@10
    of the tool each search's session then called, and the searches that missed (not in the top 5).  ``then``
    is what the recorded answers held.  A search whose chosen tool is no longer in ``tools`` is skipped.

    ``preference``, a callable making an empty search/preference.py SearchPreference, adds each ranker with the
    user's picks (``lexical+preference``...), replayed: each search is ranked with what only the searches before
    it taught (every earlier labelled search, one whose tool is gone too), never itself or a later one."""
    names = {tool.get("name") for tool in tools}
    usable = [search for search in searches if search.chosen in names]
    report = {"labelled": len(searches), "scored": len(usable), "skipped": len(searches) - len(usable),
              "tools": len(tools), "rankers": {}}
    index = SearchIndex(tools)
    depth = max(FEEDBACK_TOP, preference().candidates if preference is not None else 0)
    rankers = {"lexical": lambda query: [(index.tools[doc], round(score, 4))
                                         for doc, score in index.rank(query, depth)]}
    semantic = None
    if embedder is not None and db_path is not None:
        try:  # an endpoint that is down is said at once, not after waiting for the catalogue's vectors
            embedder.embed(["probe"], min(timeout, 10.0))
        except EmbedderError as exc:
            report["note"] = f"hybrid not scored: the embedder is unavailable ({exc})"
            embedder = None
    if embedder is not None and db_path is not None:
        semantic = SemanticRanker(embedder, db_path, query_timeout=timeout, build_timeout=timeout)
        semantic.refresh(index.tools)
        deadline = time.monotonic() + timeout
        while semantic.index is None and time.monotonic() < deadline:  # the embedding thread embeds the catalogue
            time.sleep(0.05)
        notes = []

        def hybrid(query):
            hits, _, note = semantic.search(index, query, depth)
            if note:
                notes.append(note)
            return hits
        rankers["hybrid"] = hybrid
    try:
        for label, ranked_for in rankers.items():
            ranks, missed, preferred = [], [], []
            learner = preference() if preference is not None else None
            for search in searches:
                if search.chosen in names:
                    hits = ranked_for(search.query)
                    ranked = [tool["name"] for tool, _ in hits[:FEEDBACK_TOP]]
                    rank = _rank_of(search.chosen, ranked)
                    ranks.append(rank)
                    if rank is None or rank > 5:
                        missed.append({"query": search.query, "chosen": search.chosen, "rank": rank,
                                       "top": ranked[:3]})
                    if learner is not None:
                        lifted, _ = learner.rerank(hits, search.query, FEEDBACK_TOP)
                        preferred.append(_rank_of(search.chosen, [tool["name"] for tool, _ in lifted]))
                if learner is not None:
                    learner.learn(search.query, search.chosen)
            report["rankers"][label] = {**_ranker_scores(ranks), "missed": missed}
            if learner is not None:
                report["rankers"][f"{label}+preference"] = _ranker_scores(preferred)
        report["rankers"]["then"] = _ranker_scores([_rank_of(search.chosen, search.returned) for search in usable])
        if semantic is not None and notes:
            report["note"] = f"hybrid answered some searches by BM25: {notes[-1]}"
    finally:
        if semantic is not None:
            semantic.close()
    return report
