"""Search preference: a bounded lift for the tools a user picked for similar requests.

Only while search_feedback is on (and search_preference, on by default, is not turned off) and only from the
labelled searches it recorded: for a new query, the past labelled queries similar to it (an idf-weighted cosine
over the search analyser's stems, ``tokenize``, at least PREFERENCE_SIMILARITY) vote, each with its similarity,
for the tool its session then called.  A tool's lift is a factor on the score the ranker gave it::

    1 + (PREFERENCE_CAP - 1) * votes(tool) / (all votes + PREFERENCE_SMOOTHING)

so it grows with the number and closeness of the similar picks, shrinks when they disagree, and never reaches
the cap: a tool the ranker scored below 1/PREFERENCE_CAP of another cannot pass it, however often it was picked.
The lift only re-orders the ranker's own best PREFERENCE_CANDIDATES tools (it makes no candidate of its own),
never touches Coffer's own coffer__ tools, and a picked tool that is gone does nothing.  With no similar
labelled search the ranker's answer is returned as it is, through the same call.  The constants were chosen by
replay on generated usage, where a share of the picks is wrong (``python -m evals.preference``; ``--sweep`` shows
the grid): a larger cap or less smoothing helped more when the picks were right and hurt more when they were not.

The model lives in memory: built once per process from the newest PREFERENCE_MEMORY labelled rows of coffer.db
(search_preference()) and then taught in place by FeedbackRecorder.called (its listener), so a search reads no
SQLite.  ``coffer eval`` replays it (each labelled search ranked with what the searches before it taught).

Threads and locks: a SearchPreference's ``_lock`` guards its entries and is a leaf.  _PREFERENCES_LOCK guards
the per-path registry; while it is held the model is loaded (taking the model's lock) and registered with the
feedback recorder (whose listeners list needs no lock); nothing takes _PREFERENCES_LOCK while holding another.
The recorder calls its listeners after releasing its own lock, so that lock stays a leaf."""

from __future__ import annotations

import heapq
import logging
import math
import sqlite3
import threading
import time
from datetime import datetime
from typing import Iterable, NamedTuple

from coffer_src.names import RESERVED_SERVER, SEPARATOR
from coffer_src.search.explain import explain_search, search_like_an_agent
from coffer_src.search.feedback import FeedbackRecorder, feedback_recorder
from coffer_src.search.index import SearchIndex
from coffer_src.search.semantic import SemanticRanker
from coffer_src.search.text import bounded_query, tokenize
from coffer_src.vault import connect_vault_db

preference_log = logging.getLogger(__name__)

#: The largest factor a preference puts on a tool's score (never reached: see the smoothing).
PREFERENCE_CAP = 1.35
#: How similar (idf-weighted cosine of the analysed terms) a past query must be to the new one to vote.
PREFERENCE_SIMILARITY = 0.5
#: Pseudo-votes against every tool: a single similar pick gives a small lift, repeated ones approach the cap.
PREFERENCE_SMOOTHING = 1.0
#: How deep in the ranker's answer the preference may pick tools to lift.
PREFERENCE_CANDIDATES = 30
#: The newest labelled searches the model keeps.
PREFERENCE_MEMORY = 2000

_OWN_PREFIX = RESERVED_SERVER + SEPARATOR


class Lift(NamedTuple):
    """What the preference did to one tool's score."""

    factor: float
    picks: int      # the similar past searches for which the user picked this tool
    base: float     # the ranker's own score

    def describe(self) -> str:
        return f"picked by you for {self.picks} similar search{'' if self.picks == 1 else 'es'}: ×{self.factor:.2f}"


class SearchPreference:
    """The labelled searches of one coffer.db (query terms and the tool picked), and the lift they give."""

    _SQUARES_LIMIT = 1 << 16  # memoised idf² of query words no entry has grow the memo until a label empties it

    def __init__(self, cap: float = PREFERENCE_CAP, similarity: float = PREFERENCE_SIMILARITY,
                 smoothing: float = PREFERENCE_SMOOTHING, candidates: int = PREFERENCE_CANDIDATES,
                 memory: int = PREFERENCE_MEMORY):
        self.cap, self.similarity, self.smoothing = cap, similarity, smoothing
        self.candidates, self.memory = candidates, memory
        self._lock = threading.Lock()
        self._entries: dict[int, tuple] = {}        # number -> (query terms, tool picked, when, feedback row key)
        self._postings: dict[str, set[int]] = {}              # term -> the entries whose query has it
        self._keys: set[str] = set()                # the feedback rows it holds (loading vs the listener)
        self._next = 0
        self._squares: dict[str, float] = {}  # term -> its idf², and entry -> its norm²: both for the entries
        self._norms: dict[int, float] = {}    # as they are, emptied when they change

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, query: str, chosen: str, key: str | None = None, when: float | None = None) -> None:
        """One labelled search: ``query`` led to a call of ``chosen`` (at ``when``, epoch seconds: now unless
        given).  A row already learnt (``key``) is not learnt twice; past ``memory`` entries the oldest is
        forgotten."""
        if not chosen or chosen.startswith(_OWN_PREFIX):
            return
        terms = frozenset(tokenize(bounded_query(query)))
        if not terms:
            return
        with self._lock:
            if key is not None:
                if key in self._keys:
                    return
                self._keys.add(key)
            number = self._next
            self._next += 1
            self._entries[number] = (terms, chosen, time.time() if when is None else when, key)
            self._squares.clear()
            self._norms.clear()
            for term in terms:
                self._postings.setdefault(term, set()).add(number)
            while len(self._entries) > self.memory:
                self._forget(next(iter(self._entries)))

    def expire(self, before: float) -> None:
        """Forget what was learnt before ``before`` (epoch seconds), as the vault's retention prunes its rows;
        entries are kept in the order learnt, which is the order of their searches but for a late label."""
        with self._lock:
            while self._entries:
                number = next(iter(self._entries))
                if self._entries[number][2] >= before:
                    break
                self._forget(number)

    def _forget(self, number: int) -> None:
        terms, _, _, key = self._entries.pop(number)
        self._keys.discard(key)
        self._squares.clear()
        self._norms.clear()
        for term in terms:
            holders = self._postings[term]
            holders.discard(number)
            if not holders:
                del self._postings[term]

    def load(self, path: str) -> None:
        """Learn the newest ``memory`` labelled searches of the coffer.db at ``path``, oldest first."""
        try:
            db = connect_vault_db(path)
            try:  # a search waits for this once: not long for a locked vault (then it learns from new labels only)
                db.execute(f"PRAGMA busy_timeout={FeedbackRecorder.BUSY_TIMEOUT_MS}")
                rows = db.execute("SELECT key, ts, query, chosen FROM search_feedback WHERE chosen IS NOT NULL "
                                  "ORDER BY id DESC LIMIT ?", (self.memory,)).fetchall()
            finally:
                db.close()
        except sqlite3.Error as exc:
            preference_log.warning("search preference: labelled searches not read (%s); searches are ranked "
                                   "without it", exc)
            return
        for row in reversed(rows):
            try:
                when = datetime.fromisoformat(row["ts"].replace("Z", "+00:00")).timestamp()
            except (ValueError, AttributeError):
                when = None
            self.learn(row["query"], row["chosen"], row["key"], when)

    def _squared_idf(self, term: str) -> float:
        """idf² of ``term`` over the entries as they are now (a term none has weighs most); memoised until the
        entries change.  The caller holds the lock."""
        value = self._squares.get(term)
        if value is None:
            if len(self._squares) >= self._SQUARES_LIMIT:
                self._squares.clear()
            idf = math.log(1.0 + len(self._entries) / (len(self._postings.get(term, ())) + 0.5))
            value = self._squares[term] = idf * idf
        return value

    def lifts(self, query: str) -> dict[str, tuple[float, int]]:
        """tool name -> (factor, picks) for the tools similar past searches picked; {} when none is similar."""
        terms = frozenset(tokenize(bounded_query(query)))
        if not terms or not self._entries:
            return {}
        votes: dict[str, float] = {}
        picks: dict[str, int] = {}
        with self._lock:
            weights = {term: self._squared_idf(term) for term in terms}
            norm = sum(weights.values())
            shared: dict[int, float] = {}
            for term, weight in weights.items():
                for number in self._postings.get(term, ()):
                    shared[number] = shared.get(number, 0.0) + weight
            # cosine >= s needs shared >= s * |query| * |past| >= s * |query| * sqrt(shared): most entries that
            # share only a common word fail this before their own norm is summed
            floor = self.similarity * self.similarity * norm
            for number, common in shared.items():
                if common < floor:
                    continue
                past, chosen, _, _ = self._entries[number]
                past_norm = self._norms.get(number)
                if past_norm is None:
                    past_norm = self._norms[number] = sum(map(self._squared_idf, past))
                similarity = common / math.sqrt(norm * past_norm)
                if similarity >= self.similarity:
                    votes[chosen] = votes.get(chosen, 0.0) + similarity
                    picks[chosen] = picks.get(chosen, 0) + 1
        total = sum(votes.values()) + self.smoothing
        return {tool: (1.0 + (self.cap - 1.0) * vote / total, picks[tool]) for tool, vote in votes.items()}

    def rerank(self, hits: list[tuple[dict, float]], query: str, top_k: int,
               lifts: dict[str, tuple[float, int]] | None = None) -> tuple[list[tuple[dict, float]], dict[str, Lift]]:
        """The best ``top_k`` of ``hits`` (the ranker's answer, best first, at least ``candidates`` deep when it
        has them) with the lifts of ``query``, and what was lifted (tool name -> Lift).  Only the first
        ``candidates`` may move; the order of the others, and of equal scores, is the ranker's."""
        lifts = self.lifts(query) if lifts is None else lifts
        moved: dict[str, Lift] = {}
        scored = []
        for position, (tool, score) in enumerate(hits):
            name = tool.get("name")
            lift = lifts.get(name) if position < self.candidates and isinstance(name, str) \
                and not name.startswith(_OWN_PREFIX) else None
            if lift is not None and score > 0:
                factor = round(lift[0], 4)
                moved[name] = Lift(factor, lift[1], score)
                score = round(score * factor, 4)
            scored.append((tool, score))
        if not moved:
            return hits[:top_k], {}
        best = [hit for _, hit in heapq.nsmallest(top_k, enumerate(scored), key=lambda item: (-item[1][1], item[0]))]
        return best, {tool["name"]: moved[tool["name"]] for tool, _ in best if tool.get("name") in moved}


def preferred_search(index: SearchIndex, semantic: SemanticRanker | None, query: str, top_k: int,
                     preference: SearchPreference | None):
    """(hits, ranker, note, lifts): what coffer__search_tools answers ``query`` with: the ranker's answer
    (search_like_an_agent) and, when ``preference`` has similar labelled searches, re-ordered by it."""
    lifts = preference.lifts(query) if preference is not None else {}
    if not lifts:
        return (*search_like_an_agent(index, semantic, query, top_k), {})
    depth = max(top_k, preference.candidates)
    if semantic is None:  # index.search's answer, deeper than a top_k may ask for
        hits, ranker, note = [(index.tools[doc], round(score, 4)) for doc, score in index.rank(query, depth)], \
            "bm25", None
    else:  # as deep when it answers by BM25 instead (then up to TOP_K_MAX)
        hits, ranker, note = semantic.search(index, query, depth)
    hits, moved = preference.rerank(hits, query, top_k, lifts)
    return hits, ranker, note, moved


def explain_preferred(index: SearchIndex, semantic: SemanticRanker | None, query: str, top_k,
                      preference: SearchPreference | None) -> dict:
    """explain_search of what coffer__search_tools answers, the preference's part shown for each tool it lifted."""
    return explain_search(index, semantic, query, top_k,
                          lambda *args: preferred_search(*args, preference))


_PREFERENCES: dict[str, SearchPreference] = {}
_PREFERENCES_LOCK = threading.Lock()


def search_preference(path: str) -> SearchPreference:
    """The process's preference for the coffer.db at ``path``: loaded on first use, then taught by that
    coffer.db's feedback recorder each time a search is labelled."""
    preference = _PREFERENCES.get(path)  # a search's usual case: no lock
    if preference is not None:
        return preference
    recorder = feedback_recorder(path)
    with _PREFERENCES_LOCK:
        preference = _PREFERENCES.get(path)
        if preference is None:
            preference = SearchPreference()
            recorder.listen(preference.learn)  # before loading: a label of the meantime is learnt once (its key)
            preference.load(path)
            _PREFERENCES[path] = preference
        return preference


def active_preference(settings: dict, path: str) -> SearchPreference | None:
    """The preference a gateway's searches get: None unless search_feedback (which teaches it) and
    search_preference are on; what it learnt longer ago than the search feedback is kept
    (retention_invocations_days) forgotten."""
    if settings.get("search_feedback") != "on" or settings.get("search_preference") != "on":
        return None
    preference = search_preference(path)
    preference.expire(time.time() - float(settings.get("retention_invocations_days", 30)) * 86400.0)
    return preference


def learnt_from(searches: Iterable[tuple[str, str]], **knobs) -> SearchPreference:
    """A SearchPreference taught ``searches`` ((query, tool picked), oldest first)."""
    preference = SearchPreference(**knobs)
    for query, chosen in searches:
        preference.learn(query, chosen)
    return preference
