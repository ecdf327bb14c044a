"""Search index: the BM25F ranker behind coffer__search_tools.

Tool catalogues are small documents with a few strong fields: the name says what a tool does, the description
says how, parameters say on what.  BM25F scores each field with its own weight and length normalisation.  Queries
are phrased by an agent mid-task, so the tokenizer splits identifiers (createIssue, create_issue, create-issue), a
light stemmer folds morphology, a small vocabulary of tool-domain equivalences (create/add/new, delete/remove, ...)
matches at reduced weight, and a small cross-lingual lexicon (search/words/) lets common words of eight languages
reach English tools.

Threads and locks: a SearchIndex is built on one thread and then searched from many at once, without a lock.
What it fills in lazily (postings and idf, exact-word splits, surface words, entity tools, phrase partners, the
web-search tools) is a pure function of the immutable build, written by single dict or list stores, so two
threads filling one entry store the same value; ``postings`` stores a term's idf and naming tools before its
postings, so a thread that finds the postings finds them.  CollectorPause's lock is a leaf: nothing is taken
while it is held (a caller may hold its own lock around a build, as the catalogue does).  The text analysis
underneath is lock-free (search/text.py)."""

from __future__ import annotations

import collections
import gc
import heapq
import itertools
import math
import operator
import threading
from typing import NamedTuple

from coffer_src.jsonrpc import TOP_K_DEFAULT
from coffer_src.names import SEPARATOR
from coffer_src.search.entities import (
    _FRAMING_WORDS,
    _FREE_TEXT_PARAMETERS,
    _INFO_CUES,
    _INFO_MODIFIERS,
    _QUESTION_STARTS,
    _WEB_WORDS,
    ENTITY_KINDS,
    EntityKind,
    QueryEntity,
    query_entities,
    writes_text_file,
)
from coffer_src.search.lexicon import _ABBREVIATION_WORDS, EQUIVALENCE_WEIGHT, STOP_WORDS, TRANSLATION_WEIGHT
from coffer_src.search.text import (
    EQUIVALENCES,
    ToolTexts,
    _collect_parameters,
    analyse_texts,
    bounded_query,
    bounded_top_k,
    document_surface_words,
    inflection_stem,
    singular,
    split_words,
    stem,
    surface_word_sets,
    translated_words,
    verb_senses,
)

# BM25's term-frequency saturation: one constant for tool search and the knowledge base.
BM25_K1 = 1.2


def bm25_idf(documents: int, holders: float) -> float:
    """The one BM25 idf, in the form that is never negative: log(1 + (N - df + 0.5) / (df + 0.5)) for a term
    held by ``holders`` of ``documents`` documents; 0.0 for an empty collection."""
    if not documents:
        return 0.0
    return math.log(1.0 + (documents - holders + 0.5) / (holders + 0.5))


class CollectorPause:
    """Pauses Python's cyclic garbage collector around an index build.  A build allocates hundreds of thousands
    of small objects, none of them in cycles, and every collection those allocations trigger walks every live
    object, the catalogue included: in a big build, a large share of the time.  Reference counting still frees
    what the build drops.  Builds on several threads share one pause; the collector runs again when the last ends, and
    only if it was running when the first began (an application that disabled it keeps it disabled).  Its lock
    is a leaf: nothing else is taken while it is held."""

    _lock = threading.Lock()
    _depth = 0
    _resume = False

    def __enter__(self) -> None:
        with CollectorPause._lock:
            if CollectorPause._depth == 0:
                CollectorPause._resume = gc.isenabled()
                gc.disable()
            CollectorPause._depth += 1

    def __exit__(self, *exc_info) -> None:
        with CollectorPause._lock:
            CollectorPause._depth -= 1
            if CollectorPause._depth == 0 and CollectorPause._resume:
                if gc.get_freeze_count() == 0:
                    # What the builds made lives as long as their indexes and holds no cycles: move it to the
                    # oldest generation (freeze, then unfreeze, moves lists and walks nothing) rather than let
                    # the first allocation after enable() walk every object as a young one.  Skipped if the
                    # application froze objects itself: unfreeze would undo that.
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()


_NO_POSTINGS: tuple[list[int], list[float]] = ([], [])
_TEXT_OF = operator.attrgetter("text")


def _add(scores: dict[int, float], ids: list[int], values: list[float], weight: float,
         strength_first: bool = True) -> None:
    """scores[i] += value * weight for each id i and its value (weight * value if not ``strength_first``: the
    same product, in the order the caller's formula writes it).  A plain dict and get() cost less per posting
    than a defaultdict's +=, or than chaining map/zip in C."""
    get = scores.get
    if strength_first:
        for doc_id, value in zip(ids, values):
            scores[doc_id] = get(doc_id, 0.0) + value * weight
    else:
        for doc_id, value in zip(ids, values):
            scores[doc_id] = get(doc_id, 0.0) + weight * value


def _best_with_server_boost(scores: dict[int, float], server_of: list[int], rank_of: list[int], boost: float,
                            limit: int) -> list[tuple[int, float]]:
    """The best ``limit`` (doc id, score + boost x the best score of its server) of the tools scoring above zero,
    best first, ties broken by name (``rank_of``); tools with no server (-1) get no boost.

    Only the few tools that can make the list are looked at in Python: one scoring below the limit-th best score
    minus the largest boost any tool gets ends below ``limit`` tools however its server is boosted; and a server
    holding such a candidate has its best tool among the candidates (it scores at least as much)."""
    if not scores:
        return []
    values = list(scores.values())
    largest = max(values)
    kth = heapq.nlargest(limit, values)[-1] if len(values) > limit else min(values)
    cutoff = kth - boost * largest
    cutoff -= 1e-9 * (abs(cutoff) + largest)  # no rounding can drop a tool that belongs
    ids = list(scores)
    candidates = list(itertools.compress(ids, map(operator.ge, values, itertools.repeat(cutoff))))
    server_best = {-1: 0.0}
    for doc_id in candidates:
        score, server = scores[doc_id], server_of[doc_id]
        if server >= 0 and score > server_best.get(server, 0.0):
            server_best[server] = score
    ranked = sorted((-(scores[doc_id] + boost * server_best[server_of[doc_id]]), rank_of[doc_id], doc_id)
                    for doc_id in candidates if scores[doc_id] > 0.0)
    return [(doc_id, -negative) for negative, _, doc_id in ranked[:limit]]


class QueryReading(NamedTuple):
    """See SearchIndex.reading."""

    translations: tuple[str, ...]
    only_arguments: bool


# Entity kinds that name one existing thing: "open PR #42" reads it, "open a PR" creates one.
_IDENTIFYING_KINDS = frozenset(("number_ref", "issue_key", "url", "sha"))


# Keys of a parameter's schema that make it a choice the caller can make without being told anything (a default,
# listed values): such a parameter does not ask the request for a subject.
_CHOICE_KEYS = frozenset(("enum", "const", "anyOf", "oneOf", "default"))
# The parameter-name cues of every typed argument kind: a parameter so named takes one identified thing.
_ENTITY_CUES = frozenset(itertools.chain.from_iterable(kind.cues for kind in ENTITY_KINDS))


class QueryPlan(NamedTuple):
    """What one query asks for.  own: its stems -> (weight, their surface words); other: stems it implies
    (translations, the question cue, equivalents) -> weight; entities: the typed arguments in it; need: the
    stems of what it asks for (its words outside entities, their translations and equivalents: a URL that holds
    "news" is not a request for news); subject: those stems, without equivalents, that are not framing words (the
    news, the latest, a search verb: see _FRAMING_WORDS)."""

    own: dict[str, tuple[float, set]]
    other: dict[str, float]
    entities: list[QueryEntity]
    need: frozenset
    subject: frozenset


class SearchIndex:
    """BM25F over a tool list.  Built once per catalogue change; a query is a few dictionary look-ups per term.

    ``search(query, top_k)`` returns ``[(tool, score)]``, best first, zero scores dropped, ties broken by name.
    Immutable after construction except for the lazily filled posting/entity caches; the gateway builds one per
    catalogue and searches it from its request threads (cache fills are idempotent dict writes).
    """

    # field: (weight, length-normalisation b)
    FIELDS = {"name": (3.0, 0.5), "server": (1.5, 0.3), "title": (2.0, 0.5), "description": (0.8, 0.75),
              "params": (0.5, 0.5), "param_text": (0.5, 0.75), "examples": (0.3, 0.75), "translated": (0.8, 0.75)}
    # A tool whose server also holds the best match for the query is likelier to be wanted too (tasks span
    # several tools of one server): each tool gains this share of its server's best score.
    SERVER_BOOST = 0.2
    # An exact word scores SURFACE_WEIGHT + STEM_WEIGHT, a word that only shares the stem STEM_WEIGHT, and a
    # stem-only match counts its idf at most up to the idf of a term in STEM_ONLY_IDF_CAP of the tools: a rare
    # stem ("located" ~ "location") must not outweigh the request's real words.
    SURFACE_WEIGHT = 0.3
    STEM_WEIGHT = 0.7
    STEM_ONLY_IDF_CAP = 0.01
    # Typed entities (a path, a URL, a ticket key, ...) favour tools whose parameters take them: each kind in
    # the query scores like a query word held by the tools that accept it (weight x its idf; a parameter-name
    # cue counts fully, a cue in a parameter description half).
    ENTITY_WEIGHT = 0.5
    ENTITY_WORD_WEIGHT = 0.6  # words inside an entity ("main" in ./src/main.py) are arguments, not the need
    # A request for general information scores general web-search tools like a query word of this weight.
    WEB_SEARCH_WEIGHT = 1.0
    WEB_MAX_MATCHED = 1  # ... unless the best tool matches more of the request's own words than this
    WEB_LIFTED = 2  # the web-search tools lifted, the best first: the others keep their places
    # A question ("what time is it in Tokyo") asks for a current value: "current" joins at this weight.
    QUESTION_WEIGHT = 0.7
    # A name word bound to a partner in (nearly) every tool name that holds it ("pull" in pull_request) means
    # little alone: without its partner in the query it counts this share.
    PHRASE_ALONE_WEIGHT = 0.4
    PHRASE_MIN_TOOLS = 3

    # A tool's fields in _doc_fields, in this order.
    FIELD_ORDER = ("name", "server", "title", "description", "params", "param_text", "examples", "translated")

    def __init__(self, tools: list[dict]):
        self.tools = tools  # a snapshot the caller does not change (the semantic ranker matches it by identity)
        with CollectorPause():
            self._build()

    def _build(self) -> None:
        n = len(self.tools)
        # Column by column (every tool's name, then every description, ...), in C where it can be: one batch
        # analyses the catalogue's texts, and a tool's fields are zipped from the columns.
        columns = list(zip(*map(self._tool_texts, self.tools))) or [()] * len(ToolTexts._fields)
        analysed = analyse_texts(itertools.chain.from_iterable(columns[:-1]))
        short, server, title, description, names, params, examples = (
            list(map(analysed.__getitem__, column)) for column in columns[:-1])
        stems, foreign = operator.attrgetter("stems"), operator.attrgetter("foreign")
        translated = map(operator.add, map(operator.add, map(foreign, short), map(foreign, title)),
                         map(foreign, description))
        # Per tool, its terms field by field (FIELD_ORDER): term frequencies are counted from these when a query
        # first uses a term (see postings), so the build does no per-term work in Python.
        self._doc_fields = list(zip(map(stems, short), map(stems, server), map(stems, title),
                                    map(stems, description), map(stems, names), map(stems, params),
                                    map(stems, examples), translated))
        # What queries need beyond BM25 (surface words, parameter words) is derived from these on first use.
        self._texts = list(zip(short, title, description, names, params, columns[-1]))
        self._doc_sets = list(map(frozenset, map(itertools.chain.from_iterable, self._doc_fields)))
        # term -> the tools holding it, ascending: a query's first use of a term then counts its frequencies in
        # those tools only, instead of testing every tool of a big catalogue for it.
        holders: dict[str, list[int]] = collections.defaultdict(list)
        for doc_id, terms in enumerate(self._doc_sets):
            for term in terms:
                holders[term].append(doc_id)
        self._holders = dict(holders)
        self._surfaces: list[frozenset | None] = [None] * n  # each tool's surface words, read on first use
        # A field's average length over the tools that have it: over all tools, a field few of them fill (a
        # title, translations) would look far longer than average wherever it occurs and weigh next to nothing.
        self._field_params = []
        for position, field in enumerate(self.FIELD_ORDER):
            weight, b = self.FIELDS[field]
            lengths = list(filter(None, map(len, map(operator.itemgetter(position), self._doc_fields))))
            self._field_params.append((weight, b, sum(lengths) / len(lengths) if lengths else 1.0))
        self._postings: dict[str, tuple[list[int], list[float]]] = {}
        self._idf: dict[str, float] = {}
        self._name_holders: dict[str, list[int]] = {}  # term -> the tools whose name holds it, with its postings
        full_names = [str(tool.get("name", "")) for tool in self.tools]
        self._rank_of = [0] * n
        for rank, doc_id in enumerate(sorted(range(n), key=full_names.__getitem__)):
            self._rank_of[doc_id] = rank
        servers: dict[str, int] = {}
        self._server_of = [servers.setdefault(name.partition(SEPARATOR)[0], len(servers)) if SEPARATOR in name
                           else -1 for name in full_names]
        self._exact: dict[tuple[str, frozenset], tuple[list, list, list, list]] = {}
        self._entity_tools: dict[str, list[tuple[int, float]]] = {}
        self._entity_strength_maps: dict[str, dict[int, float]] = {}
        self._entity_column_lists: dict[str, tuple[list[int], list[float]]] = {}
        self._format_docs: list[int] | None = None  # the tools declaring a parameter format, found on first use
        self._web_tools_found: list[int] | None = None
        self._web_named: frozenset = frozenset()  # the web tools named for the web, found with them
        self._declares_parameters = any(columns[4])  # a parameter name anywhere in the catalogue
        self._partners: dict[str, str | None] = {}
        self._stem_cap = bm25_idf(n, max(1.0, self.STEM_ONLY_IDF_CAP * n))

    @staticmethod
    def _tool_texts(tool: dict) -> ToolTexts:
        name = tool.get("name")
        name = name if isinstance(name, str) else str(name or "")
        server, sep, short = name.partition(SEPARATOR)
        if not sep:
            server, short = "", name
        description = tool.get("description")
        if not isinstance(description, str):
            description = ""
        title = tool.get("title")
        if not title or not isinstance(title, str):  # else the title its annotations give, if any
            annotations = tool.get("annotations")
            title = annotations.get("title") if isinstance(annotations, dict) else ""
            title = title if isinstance(title, str) else ""
        names: list[str] = []
        texts: list[str] = []
        examples: list[str] = []
        formats: list[str] = []
        _collect_parameters(tool.get("inputSchema"), 0, names, texts, examples, formats)
        return ToolTexts(short, server, title, description, " ".join(names), " ".join(texts), " ".join(examples),
                         tuple(formats))

    @property
    def _web_tools(self) -> list[int]:
        """Ids of the general web-search tools (search__web, brave_web_search), found on first use."""
        found = self._web_tools_found
        if found is None:
            found = [doc_id for doc_id, (name, server, _, description, *_) in enumerate(self._doc_fields)
                     if ("search" in name or "search" in server)
                     and not (_WEB_WORDS.isdisjoint(name) and _WEB_WORDS.isdisjoint(description))]
            self._web_named = frozenset(doc_id for doc_id in found
                                        if not _WEB_WORDS.isdisjoint(self._doc_fields[doc_id][0]))
            self._web_tools_found = found
        return found

    def _best_web_tools(self, scores: dict[int, float]) -> list[int]:
        """The WEB_LIFTED web-search tools a request for general information lifts: one a server (two tools of
        one search engine are one choice), the better scoring first; at equal scores a tool named for the web
        (brave_web_search) before one that mentions it (a local search that falls back to the web), then by name."""
        web_named = self._web_named
        chosen, servers = [], set()
        for doc_id in sorted(self._web_tools, key=lambda doc_id: (
                -scores.get(doc_id, 0.0), doc_id not in web_named, self._rank_of[doc_id])):
            server = self._server_of[doc_id]
            if server < 0 or server not in servers:
                chosen.append(doc_id)
                servers.add(server)
                if len(chosen) == self.WEB_LIFTED:
                    break
        return chosen

    def phrase_partner(self, term: str) -> str | None:
        """The one word ``term`` sits next to in >= 90% of the (>= PHRASE_MIN_TOOLS) tool names holding it
        ("pull" -> "request"), else None.  Such a word alone in a query is weak evidence for those tools.
        Computed from the term's postings on first use."""
        if term in self._partners:
            return self._partners[term]
        self.postings(term)
        named = self._name_holders.get(term, ())
        holders, pairs = len(named), {}
        for doc_id in named:
            words = self._texts[doc_id][0].stems
            for i, word in enumerate(words):
                if word == term:
                    for neighbour in {words[j] for j in (i - 1, i + 1) if 0 <= j < len(words)} - {term}:
                        pairs[neighbour] = pairs.get(neighbour, 0) + 1
        partner = None
        if holders >= self.PHRASE_MIN_TOOLS and pairs:
            best = max(sorted(pairs), key=pairs.__getitem__)
            if pairs[best] >= 0.9 * holders:
                partner = best
        self._partners[term] = partner
        return partner

    def __len__(self) -> int:
        return len(self.tools)

    def postings(self, term: str) -> tuple[list[int], list[float]]:
        """The ids of the tools holding ``term`` (ascending) and their BM25 weights, two columns, built by the
        first query that uses the term: most of a catalogue's vocabulary is never searched for, so a build does
        not pay for it."""
        found = self._postings.get(term)
        if found is None:
            holders = self._holders.get(term)
            if holders is None:
                return _NO_POSTINGS
            idf, k1 = bm25_idf(len(self._doc_sets), len(holders)), BM25_K1
            # Field-weighted, length-normalised term frequency, a field at a time: the term is counted in every
            # holder's field in C, and Python arithmetic runs only where it occurs.
            fields = list(map(self._doc_fields.__getitem__, holders))
            tf = [0.0] * len(holders)
            for position, (weight, b, average) in enumerate(self._field_params):
                column = list(map(operator.itemgetter(position), fields))
                counts = list(map(tuple.count, column, itertools.repeat(term)))
                if position == 0:  # the tools naming it, for phrase_partner
                    self._name_holders[term] = list(itertools.compress(holders, counts))
                for i in itertools.compress(range(len(counts)), counts):
                    tf[i] += counts[i] * weight / (1.0 - b + b * len(column[i]) / average)
            found = (holders, [idf * value / (k1 + value) for value in tf])
            self._idf[term] = idf
            self._postings[term] = found
        return found

    def split_postings(self, term: str, surfaces: frozenset) -> tuple[list[int], list[float], list[int], list[float]]:
        """The term's postings (ids, weights) in two parts: the tools that also hold one of these exact
        (plural-folded) words, and the others; computed from the term's postings on first use.  The holders whose
        surface words no query has needed yet are read together, in C (surface_word_sets), and kept: a common
        term's first use reads thousands of tools."""
        key = (term, surfaces)
        found = self._exact.get(key)
        if found is None:
            ids, weights = self.postings(term)
            sets = self._surfaces
            unread = list(itertools.compress(ids, map(operator.is_, map(sets.__getitem__, ids),
                                                     itertools.repeat(None))))
            if unread:
                texts = [tuple(map(_TEXT_OF, self._texts[doc_id][:5])) for doc_id in unread]
                for doc_id, words, doc_texts in zip(unread, surface_word_sets(texts), texts):
                    sets[doc_id] = document_surface_words(doc_texts) if words is None else words
            others = list(map(surfaces.isdisjoint, map(sets.__getitem__, ids)))
            exact = list(map(operator.not_, others))
            found = self._exact[key] = (list(itertools.compress(ids, exact)), list(itertools.compress(weights, exact)),
                                        list(itertools.compress(ids, others)),
                                        list(itertools.compress(weights, others)))
        return found

    def _virtual_idf(self, holders: int) -> float:
        """The idf a query term would have if exactly ``holders`` tools held it: an entity kind or the
        general-information need is scored like one more query word, so it weighs less in a long request."""
        return bm25_idf(len(self.tools), holders)

    def entity_tools(self, kind: EntityKind) -> list[tuple[int, float]]:
        """(doc id, strength) of the tools whose parameters take ``kind``: 1.0 by a parameter name or format,
        0.5 by a parameter description or a weak cue; computed on first use of the kind."""
        found = self._entity_tools.get(kind.name)
        if found is None:
            cues, formats, weak = kind.cues, kind.formats, kind.weak_cues
            # Only a tool holding a cue (or a weak one) somewhere, or declaring a format, can take the kind.
            if self._format_docs is None:
                self._format_docs = [doc_id for doc_id, texts in enumerate(self._texts) if texts[5]]
            candidates = set(self._format_docs if formats else ()).union(
                *(self._holders.get(cue, ()) for cue in itertools.chain(cues, weak)))
            found = []
            for doc_id in sorted(candidates):
                *_, names, words, doc_formats = self._texts[doc_id]
                if not cues.isdisjoint(names.stems) or not formats.isdisjoint(doc_formats):
                    found.append((doc_id, 1.0))
                elif not cues.isdisjoint(words.stems) or not weak.isdisjoint(names.stems):
                    found.append((doc_id, 0.5))
            self._entity_tools[kind.name] = found
        return found

    def _entity_columns(self, kind: EntityKind) -> tuple[list[int], list[float]]:
        found = self._entity_column_lists.get(kind.name)
        if found is None:
            accepting = self.entity_tools(kind)
            found = self._entity_column_lists[kind.name] = ([doc_id for doc_id, _ in accepting],
                                                            [strength for _, strength in accepting])
        return found

    def _entity_strengths(self, kind: EntityKind) -> dict[int, float]:
        found = self._entity_strength_maps.get(kind.name)
        if found is None:
            found = self._entity_strength_maps[kind.name] = dict(self.entity_tools(kind))
        return found

    def _query_plan(self, query: str) -> QueryPlan:
        """What ``query`` asks for (see QueryPlan): its own words, what they imply, its arguments, its need."""
        entities = query_entities(query) if self.ENTITY_WEIGHT or self.ENTITY_WORD_WEIGHT != 1.0 else []
        # A kind no tool of this catalogue accepts is not an argument here: "KQL" is not a ticker where no tool
        # takes one, and its words are the request's own (often its rarest, most decisive word).
        entities = [entity for entity in entities if self.entity_tools(entity.kind)]
        inside, outside, rest_text = set(), set(), query
        if entities:
            rest, last = [], 0
            for entity in entities:
                inside.update(split_words(query[entity.start:entity.end]))
                rest.append(query[last:entity.start])
                last = entity.end
            rest.append(query[last:])
            rest_text = " ".join(rest)
            outside = set(split_words(rest_text))
        own: dict[str, tuple[float, set]] = {}
        every_word = split_words(query)
        words = [word for word in every_word if word not in STOP_WORDS]
        present = {stem(word) for word in words}
        # A verb its object gives another sense ("open" a pull request: create) stands for that sense's words, as
        # if the request said them; its own form then counts as an equivalent does, and its equivalence lines
        # ("open" a file: read) not at all.
        senses = {}
        sensed = verb_senses(every_word, any(entity.kind.name in _IDENTIFYING_KINDS for entity in entities))
        if sensed:
            kept = [position for position, word in enumerate(every_word) if word not in STOP_WORDS]
            senses = {index: sensed[position] for index, position in enumerate(kept) if position in sensed}
        for position, word in enumerate(words):
            weight = self.ENTITY_WORD_WEIGHT if word in inside and word not in outside else 1.0
            if position in senses:
                weight *= EQUIVALENCE_WEIGHT
            term = stem(word)
            partner = self.phrase_partner(term) if self.PHRASE_ALONE_WEIGHT != 1.0 else None
            if partner is not None and partner not in present:
                weight *= self.PHRASE_ALONE_WEIGHT
            previous, surfaces = own.get(term, (0.0, set()))
            surfaces.add(singular(word))
            own[term] = (max(previous, weight), surfaces)
        # A text file the request saves to ("save it to /root/notes/report.md") is written: a tool that writes
        # files is one of its steps, as if it said "write", however it says it ("save" keeps its own weight: a
        # tool named for saving is still what it asks).
        written = ("write",) if writes_text_file(query, entities) else ()
        for word in itertools.chain(itertools.chain.from_iterable(senses.values()), written):
            previous, surfaces = own.get(stem(word), (0.0, set()))
            surfaces.add(word)
            own[stem(word)] = (1.0, surfaces)
        other: dict[str, float] = {}
        # The English words the request implies: translations (an entity's words are arguments: they are not
        # translated either) and what its shorthand stands for.
        implied = translated_words(rest_text)
        implied += itertools.chain.from_iterable(
            _ABBREVIATION_WORDS.get(word, ()) for word in words if word not in inside or word in outside)
        translated = list(map(stem, implied))
        for term in translated:
            other[term] = max(other.get(term, 0.0), TRANSLATION_WEIGHT)
        expanding = [(word, own[stem(word)][0]) for position, word in enumerate(words) if position not in senses]
        expanding += [(word, 1.0) for word in itertools.chain(itertools.chain.from_iterable(senses.values()), written)]
        expanding += [(word, TRANSLATION_WEIGHT) for word in implied]
        lowered = query.lower().replace("'", "").split()
        if self.QUESTION_WEIGHT and lowered and lowered[0].strip("¿?") in _QUESTION_STARTS:
            other["current"] = max(other.get("current", 0.0), self.QUESTION_WEIGHT)
            expanding.append(("current", other["current"]))
        # Equivalents by each word's inflections (see EQUIVALENCES), weighted by the word's own term
        for word, weight in expanding:
            for equivalent in EQUIVALENCES.get(inflection_stem(word), ()):
                other[equivalent] = max(other.get(equivalent, 0.0), EQUIVALENCE_WEIGHT * weight)
        for term in own:
            other.pop(term, None)
        needed = [word for word in words if word not in inside or word in outside] + implied
        need = set(map(stem, needed))
        subject = frozenset(need - _FRAMING_WORDS)
        need.update(*map(EQUIVALENCES.get, map(inflection_stem, needed), itertools.repeat(())))
        return QueryPlan(own, other, entities, frozenset(need), subject)

    def _outvotes_web_search(self, doc_id: int | None, plan: QueryPlan) -> bool:
        """Whether the best-scoring tool keeps its place ahead of general web search for a request for general
        information.  It must match more than one of the request's words, or by its name (a news tool for
        "news"; one that shares an incidental word of its description, "latest" in a version tool's, does not);
        and, where the catalogue declares parameters and the request has a subject, it must be able to take the
        subject as an argument (a free-text parameter, or a parameter for an argument the request holds) or cover
        the subject itself (its name holds a subject word, or it holds two, or the one there is).  A headline tool
        that takes only a page size matches "latest news" but cannot be asked about glacier melt in Norway."""
        if doc_id is None:
            return False
        names = self._texts[doc_id][0].stems
        if sum(term in self._doc_sets[doc_id] for term in plan.own) <= self.WEB_MAX_MATCHED and (
                (set(plan.own) - _INFO_MODIFIERS).isdisjoint(names)):
            return False
        if not self._declares_parameters:
            return True
        if not (plan.subject or plan.entities):
            # A request with no subject ("what happened in the news today") is what a feed serves, but not a tool
            # that must be told what about (news for a stock symbol): the request gives it nothing to ask.
            return not self._demands_a_subject(doc_id)
        if not _FREE_TEXT_PARAMETERS.isdisjoint(self._texts[doc_id][3].stems) or any(
                self._entity_strengths(entity.kind).get(doc_id) for entity in plan.entities):
            return True
        fields = self._doc_fields[doc_id]
        if not plan.subject.isdisjoint(itertools.chain(names, fields[1], fields[2])):  # name, server, title
            return True
        return len(plan.subject & self._doc_sets[doc_id]) >= min(2, len(plan.subject))

    def _demands_a_subject(self, doc_id: int) -> bool:
        """Whether a tool must be told which one thing it is about: it requires a parameter named for a typed
        argument (a stock symbol, a path, a repository, an issue: see ENTITY_KINDS) that is neither free text nor
        a choice among listed values nor has a default.  News for a stock symbol is not a news feed."""
        schema = self.tools[doc_id].get("inputSchema")
        if not isinstance(schema, dict):
            return False
        properties, required = schema.get("properties"), schema.get("required")
        if not isinstance(properties, dict) or not isinstance(required, list):
            return False
        for name in required:
            parameter = properties.get(name) if isinstance(name, str) else None
            if not isinstance(parameter, dict) or not _CHOICE_KEYS.isdisjoint(parameter):
                continue
            terms = {stem(word) for word in split_words(name)}
            if _FREE_TEXT_PARAMETERS.isdisjoint(terms) and not _ENTITY_CUES.isdisjoint(terms):
                return True
        return False

    def reading(self, query: str) -> QueryReading:
        """What the lexical ranker read in ``query`` that an embedder may need: the English words of its foreign
        tool-domain words, and whether the request is nothing but arguments ("AAPL", "OPS-1234", a URL alone):
        all its words inside the entities this catalogue's tools accept."""
        query = bounded_query(query)
        plan = self._query_plan(query)
        only_arguments = False
        if plan.entities:
            rest, last = [], 0
            for entity in plan.entities:
                rest.append(query[last:entity.start])
                last = entity.end
            rest.append(query[last:])
            only_arguments = all(word in STOP_WORDS for word in split_words(" ".join(rest)))
        return QueryReading(tuple(translated_words(query)), only_arguments)

    def rank(self, query: str, limit: int) -> list[tuple[int, float]]:
        """The best ``limit`` (doc id, score) pairs, best first, zero scores dropped, ties broken by name; a
        query is read up to bounded_query's limit."""
        plan = self._query_plan(bounded_query(query))
        own, other, entities = plan.own, plan.other, plan.entities
        # Every contribution is added a term at a time in C (_add): a query touches thousands of postings in a
        # big catalogue.  Each tool's sum is the same float, added in the same order, as one addition per posting.
        scores: dict[int, float] = {}
        exact_weight, stem_weight = self.SURFACE_WEIGHT + self.STEM_WEIGHT, self.STEM_WEIGHT
        informational = bool(self._web_tools and self.WEB_SEARCH_WEIGHT and not _INFO_CUES.isdisjoint(plan.need))
        framing: dict[int, float] = {}  # what each tool scored by framing words
        for term, (weight, surfaces) in own.items():
            ids, _ = self.postings(term)
            if not ids:
                continue
            idf = self._idf[term]
            stem_only = stem_weight * weight * (min(1.0, self._stem_cap / idf) if idf > 0 else 1.0)
            exact = exact_weight * weight
            exact_ids, exact_values, other_ids, other_values = self.split_postings(term, frozenset(surfaces))
            _add(scores, exact_ids, exact_values, exact)
            _add(scores, other_ids, other_values, stem_only)
            if informational and term in _FRAMING_WORDS:
                _add(framing, exact_ids, exact_values, exact)
                _add(framing, other_ids, other_values, stem_only)
        for term, weight in other.items():
            ids, values = self.postings(term)
            _add(scores, ids, values, stem_weight * weight)
        if entities and self.ENTITY_WEIGHT:
            for kind in {entity.kind.name: entity.kind for entity in entities}.values():
                accepting = self.entity_tools(kind)
                bonus = self.ENTITY_WEIGHT * self._virtual_idf(len(accepting))
                if scores and len(accepting) > 4 * len(scores):
                    # A kind most tools accept (a path in a big catalogue) only re-orders what matched.
                    matched = list(scores)
                    _add(scores, matched, list(map(self._entity_strengths(kind).get, matched,
                                                   itertools.repeat(0.0))), bonus, strength_first=False)
                    continue
                ids, strengths = self._entity_columns(kind)
                _add(scores, ids, strengths, bonus, strength_first=False)
        server_of, rank_of = self._server_of, self._rank_of
        if informational:
            best = max(scores, key=scores.__getitem__, default=None)
            if not self._outvotes_web_search(best, plan):
                # The general-information need scores like one more query word; and the framing words ("latest",
                # "news") are not evidence for the narrow tool over general search: what the best tool scored by
                # them, a lifted web-search tool scores too.
                lift = self.WEB_SEARCH_WEIGHT * self._virtual_idf(len(self._web_tools))
                for doc_id in self._best_web_tools(scores):
                    scores[doc_id] = scores.get(doc_id, 0.0) + (
                        lift + max(0.0, framing.get(best, 0.0) - framing.get(doc_id, 0.0)))
        return _best_with_server_boost(scores, server_of, rank_of, self.SERVER_BOOST, limit)

    def search(self, query: str, top_k: int = TOP_K_DEFAULT) -> list[tuple[dict, float]]:
        top_k = bounded_top_k(top_k)
        return [(self.tools[doc_id], round(score, 4)) for doc_id, score in self.rank(query, top_k)]
