"""Search explanation: why coffer__search_tools ranked each tool where it did.

The ranking is SearchIndex.rank (and, with an embedder, SemanticRanker.search) and nothing here changes it:
``explain_search`` asks the same ranker the same question an agent's coffer__search_tools asks, then replays
rank's arithmetic over the same index (its query plan, postings, weights and boosts), keeping every part of
every score, so a person can see which words matched which field and what each was worth.  Each explained hit
says whether the replay adds up to the ranker's own score (``exact``); the tests replay the dev sets' queries
and fail when rank changes in a way this replay does not follow, so the page never shows a stale explanation
as if it were the real one.  The user's own picks (search/preference.py), when they re-order the answer, are
one more part of a lifted tool's score: its factor, and the similar searches behind it.  Read-only, lock-free:
it reads the index the way concurrent searches do.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from coffer_src.names import SEPARATOR
from coffer_src.search.entities import _FRAMING_WORDS, _INFO_CUES, _QUESTION_STARTS
from coffer_src.search.index import SearchIndex
from coffer_src.search.lexicon import STOP_WORDS
from coffer_src.search.semantic import HYBRID_ALPHA, SemanticRanker
from coffer_src.search.text import (
    ABBREVIATIONS,
    EQUIVALENCES,
    bounded_query,
    bounded_top_k,
    split_words,
    translations,
)

#: What a field of the index is called on the page.
FIELD_LABELS = {"name": "name", "server": "server name", "title": "title", "description": "description",
                "params": "parameter names", "param_text": "parameter descriptions", "examples": "examples",
                "translated": "translated words"}
#: The largest difference between the replayed total and the ranker's score (rounded to 4 places) that still
#: counts as the same number.
EXACT_TOLERANCE = 1e-4


class Contribution(NamedTuple):
    """One part of a tool's score: a query term found in its fields, a boost, or the user's own picks."""

    kind: str                   # "term", "argument", "web", "server", "preference" (the user's picks)
    label: str                  # the index term, the argument kind, or what the boost is
    how: str                    # how the query led to it ("exact word", "same stem", "equivalent of create"...)
    words: tuple[str, ...]      # the query words behind it
    fields: dict                # field -> occurrences in this tool (terms only)
    points: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, "label": self.label, "how": self.how, "words": list(self.words),
                "fields": {FIELD_LABELS.get(k, k): v for k, v in self.fields.items()},
                "points": round(self.points, 4)}


def search_like_an_agent(index: SearchIndex, semantic: SemanticRanker | None, query: str, top_k: int):
    """(hits, ranker, note): exactly what coffer__search_tools computes for this query (BuiltinTools.search's
    dispatch): the hybrid ranker when an embedder is configured, which answers by BM25 with a note when it must."""
    if semantic is not None:
        return semantic.search(index, query, top_k)
    return index.search(query, top_k), "bm25", None


def explain_search(index: SearchIndex, semantic: SemanticRanker | None, query: str, top_k=None,
                   search=None) -> dict:
    """The ranking an agent gets for ``query`` and, for each tool in it, the parts of its score.  ``search``
    (index, semantic, query, top_k) -> (hits, ranker, note, lifts) is what answers the agent when it is not
    search_like_an_agent alone (search/preference.py's preferred_search): a tool in ``lifts`` (name -> its
    Lift: factor, picks, base) has the ranker's score ``base``, and the lift is a part of its own."""
    top_k = bounded_top_k(top_k)
    query = bounded_query(query)
    if search is None:
        hits, ranker, note = search_like_an_agent(index, semantic, query, top_k)
        lifts = {}
    else:
        hits, ranker, note, lifts = search(index, semantic, query, top_k)
    plan = index._query_plan(query)
    origins = term_origins(query, plan)
    parts = replay(index, query, plan, origins)
    doc_of = {id(tool): doc_id for doc_id, tool in enumerate(index.tools)}
    lexical, best = {}, 0.0
    if ranker == "hybrid":
        lexical = dict(index.rank(query, SemanticRanker.CANDIDATES))
        best = max(lexical.values(), default=0.0) or 1.0
    results = []
    for position, (tool, score) in enumerate(hits, 1):
        doc_id = doc_of.get(id(tool))
        found = parts.get(doc_id, []) if doc_id is not None else []
        total = sum(part.points for part in found)
        name = str(tool.get("name", ""))
        lift = lifts.get(name)
        base = score if lift is None else lift.base
        entry = {"rank": position, "name": name, "server": name.partition(SEPARATOR)[0] if SEPARATOR in name else "",
                 "description": tool.get("description") if isinstance(tool.get("description"), str) else "",
                 "score": score, "bm25": round(total, 4),
                 "matches": [part.to_dict() for part in sorted(found, key=lambda p: (p.kind != "term", -p.points))]}
        if ranker == "hybrid":
            share = HYBRID_ALPHA * lexical.get(doc_id, 0.0) / best
            entry["lexical_share"], entry["semantic_share"] = round(share, 4), round(base - share, 4)
            entry["exact"] = doc_id not in lexical or abs(lexical[doc_id] - total) <= EXACT_TOLERANCE
        else:
            entry["exact"] = abs(total - base) <= EXACT_TOLERANCE
        if lift is not None:  # the user's own picks: a factor on the ranker's score, shown as what it added
            entry["preference"] = {"factor": lift.factor, "picks": lift.picks, "ranker_score": base,
                                   "text": lift.describe()}
            entry["matches"].append(Contribution("preference", "your picks", lift.describe(), (), {},
                                                 score - base).to_dict())
        results.append(entry)
    return {"query": query, "top_k": top_k, "ranker": ranker, "note": note, "total_searched": len(index),
            "plan": plan_summary(plan, origins), "results": results}


def term_origins(query: str, plan) -> dict[str, tuple[str, tuple[str, ...]]]:
    """term -> (how the query led to it, the query words behind it), for the terms the query implies."""
    words = [word for word in split_words(query) if word not in STOP_WORDS]
    origins: dict[str, tuple[str, tuple[str, ...]]] = {}
    for term, (_, surfaces) in plan.own.items():
        origins[term] = ("query word", tuple(sorted(surfaces)))
    for word in words:
        for term in translations(word):
            origins.setdefault(term, (f"translation of {word}", (word,)))
        for term in ABBREVIATIONS.get(word, ()):
            origins.setdefault(term, (f"expansion of {word}", (word,)))
    lowered = query.lower().replace("'", "").split()
    if lowered and lowered[0].strip("¿?") in _QUESTION_STARTS:
        origins.setdefault("current", (f"a question ({lowered[0]}...) asks for a current value", (lowered[0],)))
    for term in [*plan.own, *plan.other]:
        source = origins.get(term, ("related word", ()))
        for equivalent in EQUIVALENCES.get(term, ()):
            origins.setdefault(equivalent, (f"equivalent of {' '.join(source[1]) or term}", source[1]))
    return origins


def _fields(index: SearchIndex, doc_id: int, term: str) -> dict[str, int]:
    fields = index._doc_fields[doc_id]
    return {field: fields[position].count(term) for position, field in enumerate(index.FIELD_ORDER)
            if term in fields[position]}


def replay(index: SearchIndex, query: str, plan, origins: dict) -> dict[int, list[Contribution]]:
    """doc id -> the parts of its score, in SearchIndex.rank's order of summing (see rank for what each step
    means; the two must change together)."""
    parts: dict[int, list[Contribution]] = collections.defaultdict(list)
    scores: dict[int, float] = collections.defaultdict(float)
    own, other, entities = plan.own, plan.other, plan.entities
    exact_weight, stem_weight = index.SURFACE_WEIGHT + index.STEM_WEIGHT, index.STEM_WEIGHT

    def add(doc_id: int, part: Contribution) -> None:
        scores[doc_id] += part.points
        parts[doc_id].append(part)

    informational = bool(index._web_tools and index.WEB_SEARCH_WEIGHT and not _INFO_CUES.isdisjoint(plan.need))
    framing: dict[int, float] = collections.defaultdict(float)
    for term, (weight, surfaces) in own.items():
        ids, _ = index.postings(term)
        if not ids:
            continue
        idf = index._idf[term]
        stem_only = stem_weight * weight * (min(1.0, index._stem_cap / idf) if idf > 0 else 1.0)
        exact = exact_weight * weight
        exact_ids, exact_values, other_ids, other_values = index.split_postings(term, frozenset(surfaces))
        words = tuple(sorted(surfaces))
        note = "" if weight == 1.0 else f" (weight {weight:g})"
        for found_ids, values, how, factor in ((exact_ids, exact_values, "exact word", exact),
                                               (other_ids, other_values, "same stem", stem_only)):
            for doc_id, value in zip(found_ids, values):
                add(doc_id, Contribution("term", term, how + note, words, _fields(index, doc_id, term),
                                         value * factor))
                if informational and term in _FRAMING_WORDS:
                    framing[doc_id] += value * factor
    for term, weight in other.items():
        how, words = origins.get(term, ("related word", ()))
        ids, values = index.postings(term)
        for doc_id, value in zip(ids, values):
            add(doc_id, Contribution("term", term, f"{how} (weight {weight:g})", words,
                                     _fields(index, doc_id, term), value * (stem_weight * weight)))
    if entities and index.ENTITY_WEIGHT:
        for kind in {entity.kind.name: entity.kind for entity in entities}.values():
            accepting = index.entity_tools(kind)
            bonus = index.ENTITY_WEIGHT * index._virtual_idf(len(accepting))
            texts = tuple(query[e.start:e.end] for e in entities if e.kind.name == kind.name)
            how = f"takes a {kind.name} like the one in the request"
            if scores and len(accepting) > 4 * len(scores):
                strengths = index._entity_strengths(kind)
                for doc_id in list(scores):
                    strength = strengths.get(doc_id, 0.0)
                    if strength:
                        add(doc_id, Contribution("argument", kind.name, how, texts, {}, bonus * strength))
                continue
            for doc_id, strength in accepting:
                add(doc_id, Contribution("argument", kind.name, how, texts, {}, bonus * strength))
    if informational:
        best = max(scores, key=scores.__getitem__, default=None)
        if not index._outvotes_web_search(best, plan):
            lift = index.WEB_SEARCH_WEIGHT * index._virtual_idf(len(index._web_tools))
            for doc_id in index._best_web_tools(scores):
                add(doc_id, Contribution("web", "web search", "a request for general information", (), {}, lift))
                gap = max(0.0, framing.get(best, 0.0) - framing.get(doc_id, 0.0))
                if gap:
                    add(doc_id, Contribution("web", "framing words", "what the best tool scored by framing words "
                                             "(latest, news) alone", (), {}, gap))
    server_of = index._server_of
    server_best: dict[int, float] = {-1: 0.0}
    for doc_id, score in scores.items():
        server = server_of[doc_id]
        if server >= 0 and score > server_best.get(server, 0.0):
            server_best[server] = score
    for doc_id in list(scores):
        lift = index.SERVER_BOOST * server_best[server_of[doc_id]]
        if lift and scores[doc_id] > 0.0:
            parts[doc_id].append(Contribution("server", "same server", "a share of its server's best match", (),
                                              {}, lift))
    return {doc_id: found for doc_id, found in parts.items() if scores[doc_id] > 0.0}


def plan_summary(plan, origins: dict) -> dict:
    """How the query was read: its own words (and their weight), the words it implies, the arguments in it."""
    return {"words": [{"term": term, "words": sorted(surfaces), "weight": round(weight, 3)}
                      for term, (weight, surfaces) in plan.own.items()],
            "related": [{"term": term, "how": origins.get(term, ("related word", ()))[0], "weight": round(weight, 3)}
                        for term, weight in sorted(plan.other.items(), key=lambda item: -item[1])],
            "arguments": sorted({entity.kind.name for entity in plan.entities})}
