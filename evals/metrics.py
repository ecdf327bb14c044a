"""Retrieval metrics for the tool-retrieval evals, kept pure so tests can check them on hand-made rankings.

Every query is reduced to a list of *groups*; a group is one need of the query and is satisfied by any
one of its member tools (several servers often offer the same capability, e.g. brave vs tavily search):

* a query with ``"groups"`` (multi-step task) uses them as given;
* a query without ``"groups"`` is a single need: its whole ``"relevant"`` list is one group, because every
  tool listed there serves the query on its own and the agent only needs one of them.

Definitions, for a ranking ``ranked`` (tool names, best first) and a cut-off ``k``:

* recall@k  - fraction of groups with at least one member in the top k. For single-need queries this is
  hit@k (1.0 if any relevant tool is in the top k, else 0.0).
* MRR@k     - 1 / rank of the first tool that belongs to any group, 0.0 if none is in the top k.
* nDCG@k    - binary relevance where each group is one relevant item, credited at the rank of its
  first-ranked member (later members of an already-satisfied group gain nothing, as a duplicate tool
  adds nothing for the agent). DCG = sum over satisfied groups of 1/log2(rank + 1); the ideal DCG places
  min(#groups, k) distinct items at ranks 1..; the ratio is clamped to 1.0 (one tool listed in two
  groups could otherwise overshoot).

Averages over queries are plain means (macro), so a multi-step query weighs as much as a single one.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

CUTOFFS = (1, 5, 10)
METRIC_NAMES = ("recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10")


def query_groups(query: dict) -> list[set[str]]:
    """Return the needs of a query as sets of interchangeable tool names (see module docstring)."""
    groups = query.get("groups")
    if groups:
        return [set(g) for g in groups if g]
    relevant = query.get("relevant") or []
    return [set(relevant)] if relevant else []


def _group_first_ranks(ranked: Sequence[str], groups: list[set[str]], k: int) -> list[int | None]:
    """1-based rank of each group's first member within the top k, or None when the group is missed."""
    first: list[int | None] = [None] * len(groups)
    for rank, name in enumerate(ranked[:k], start=1):
        for i, group in enumerate(groups):
            if first[i] is None and name in group:
                first[i] = rank
    return first


def recall_at_k(ranked: Sequence[str], groups: list[set[str]], k: int) -> float:
    """Fraction of groups with at least one member in the top k."""
    if not groups:
        return 0.0
    hits = sum(r is not None for r in _group_first_ranks(ranked, groups, k))
    return hits / len(groups)


def mrr_at_k(ranked: Sequence[str], groups: list[set[str]], k: int = 10) -> float:
    """Reciprocal rank of the first tool belonging to any group, 0 when none is in the top k."""
    wanted = set().union(*groups) if groups else set()
    for rank, name in enumerate(ranked[:k], start=1):
        if name in wanted:
            return 1.0 / rank
    return 0.0


def ndcg_at_k(ranked: Sequence[str], groups: list[set[str]], k: int = 10) -> float:
    """Binary nDCG with each group counted once, at its first-ranked member."""
    if not groups:
        return 0.0
    dcg = sum(1.0 / math.log2(r + 1) for r in _group_first_ranks(ranked, groups, k) if r is not None)
    ideal = sum(1.0 / math.log2(r + 1) for r in range(1, min(len(groups), k) + 1))
    return min(1.0, dcg / ideal)


def score_query(ranked: Sequence[str], groups: list[set[str]]) -> dict[str, float]:
    """All per-query metrics named in METRIC_NAMES."""
    scores = {f"recall@{k}": recall_at_k(ranked, groups, k) for k in CUTOFFS}
    scores["mrr@10"] = mrr_at_k(ranked, groups, 10)
    scores["ndcg@10"] = ndcg_at_k(ranked, groups, 10)
    return scores


def mean_scores(per_query: Iterable[dict[str, float]]) -> dict[str, float]:
    """Macro average of per-query metric dicts; empty input gives zeros."""
    rows = list(per_query)
    if not rows:
        return {m: 0.0 for m in METRIC_NAMES}
    return {m: sum(r[m] for r in rows) / len(rows) for m in METRIC_NAMES}


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation), enough for latency p50/p95."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = max(0, math.ceil(pct / 100.0 * len(ordered)) - 1)
    return ordered[index]
