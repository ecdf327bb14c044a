"""Replay of the search preference (coffer.SearchPreference) on generated usage: does learning from a user's
earlier picks help their later searches, and how much does it hurt when some picks were wrong?

Run from the repo root::

    python -m evals.preference                    # every dev set, the shipped constants: with vs without
    python -m evals.preference --set bfcl --json  # one set, machine-readable
    python -m evals.preference --sweep            # the grid the constants were chosen on (cap, similarity,
                                                  # smoothing, candidates), means over the sets
    python -m evals.preference --wrong 0.5        # a user whose picks are wrong half the time
    python -m evals.preference --embedder URL     # the hybrid ranker's answers instead (evals.embed_server)

Generated usage (seeded, so every run gives the same numbers): each query of a set, and one variant of each (a
few words dropped and two neighbours swapped: the same need said again another way), in a shuffled order.  A
simulated user picks the query's labelled tool, except that a share of picks (``--wrong``, 0.2) is another tool
from the top 5 of the ranker's answer.  Replay: each search is ranked by the ranker alone and with the
preference taught only the searches before it (never itself or a later one), and both are scored against the
query's label (recall@1/5, MRR@10, nDCG@10, evals.metrics); ``worse`` counts the searches whose nDCG@10 dropped,
``worse_after_wrong`` those among them where a wrong earlier pick was lifted.  The picks come from the ranker's
own answer, so every configuration of a sweep replays the same usage.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from evals import metrics, run  # noqa: E402
from evals.rankers import EmbeddingRanker, make_embedder  # noqa: E402

DEPTH = 50          # how deep each search's answer is kept for the replay (the largest depth swept)
SEED = 27
SCORED = ("recall@1", "recall@5", "mrr@10", "ndcg@10")
GRID = {"cap": (1.15, 1.25, 1.35, 1.5), "similarity": (0.3, 0.4, 0.5, 0.6, 0.7), "smoothing": (0.5, 1.0, 2.0),
        "candidates": (10, 20, 30, 50)}


def variant(query: str, rng: random.Random) -> str:
    """The same need said again: about a fifth of the words dropped (two at least kept), two neighbours swapped."""
    words = query.split()
    if len(words) <= 2:
        return query
    kept = [word for word in words if rng.random() >= 0.2] or words[:2]
    if len(kept) < 2:
        kept = words[:2]
    if len(kept) > 2:
        at = rng.randrange(len(kept) - 1)
        kept[at], kept[at + 1] = kept[at + 1], kept[at]
    return " ".join(kept)


def usage(evalset, deep, wrong: float, seed: int = SEED) -> list[dict]:
    """The generated searches of one set, in order: query, groups, the ranker's answer (``deep(query)``, DEPTH
    deep), the pick and whether it was wrong."""
    rng = random.Random(f"{seed}:{evalset.name}")
    events = []
    for row in evalset.queries:
        groups = metrics.query_groups(row)
        if not groups:
            continue
        label = sorted(groups[0])[0]
        events.append((row["query"], groups, label))
        events.append((variant(row["query"], rng), groups, label))
    rng.shuffle(events)
    if hasattr(deep, "prepare"):  # a hybrid ranker embeds every query at once
        deep.prepare([query for query, _, _ in events])
    out = []
    for query, groups, label in events:
        hits = deep(query)
        names = [tool["name"] for tool, _ in hits]
        relevant_names = set().union(*groups)
        pick, is_wrong = label, False
        if rng.random() < wrong:
            others = [name for name in names[:5] if name not in relevant_names]
            if others:
                pick, is_wrong = rng.choice(others), True
        out.append({"query": query, "groups": groups, "hits": hits, "pick": pick, "wrong": is_wrong,
                    "base": metrics.score_query(names[:10], groups)})
    return out


def replay(coffer, events: list[dict], **knobs) -> dict:
    """With vs without the preference over ``events``, the preference taught each pick after its search."""
    preference = coffer.SearchPreference(**knobs)
    base, preferred, worse, better, worse_after_wrong = [], [], 0, 0, 0
    wrong_picks: set[str] = set()
    for event in events:
        hits, lifted = preference.rerank(event["hits"], event["query"], 10)
        scores = metrics.score_query([tool["name"] for tool, _ in hits], event["groups"])
        base.append(event["base"])
        preferred.append(scores)
        if scores["ndcg@10"] < event["base"]["ndcg@10"] - 1e-9:
            worse += 1
            worse_after_wrong += any(name in wrong_picks for name in lifted)
        elif scores["ndcg@10"] > event["base"]["ndcg@10"] + 1e-9:
            better += 1
        preference.learn(event["query"], event["pick"])
        if event["wrong"]:
            wrong_picks.add(event["pick"])
    mean_base, mean_pref = metrics.mean_scores(base), metrics.mean_scores(preferred)
    return {"searches": len(events), "wrong_picks": sum(e["wrong"] for e in events),
            "without": {m: round(mean_base[m], 4) for m in SCORED},
            "with": {m: round(mean_pref[m], 4) for m in SCORED},
            "better": better, "worse": worse, "worse_after_wrong": worse_after_wrong}


def load_sets(names: list[str] | None):
    args = run.parse_args(["--set", *names] if names else [])
    found, notes = run.discover_sets(args)
    for note in notes:
        print(note, file=sys.stderr)
    return [run.load_set(name, catalog, queries) for name, catalog, queries in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", help="only this set (repeatable)")
    parser.add_argument("--wrong", type=float, default=0.2, help="share of the simulated user's picks that are wrong")
    parser.add_argument("--sweep", action="store_true", help="the grid of constants, means over the sets")
    parser.add_argument("--grid", help="narrow the sweep, e.g. 'cap=1.25,1.5;candidates=30'")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--embedder", metavar="URL", help="replay the hybrid ranker instead, with this "
                        "OpenAI-compatible endpoint (e.g. python -m evals.embed_server --port 0)")
    parser.add_argument("--embedder-model", default="all-MiniLM-L6-v2")
    args = parser.parse_args(argv)
    import coffer
    replays = []
    for evalset in load_sets(args.set):
        if args.embedder:
            hybrid = EmbeddingRanker(evalset.tools, make_embedder(args.embedder, args.embedder_model, "openai"),
                                     "hybrid")

            def deep(query, hybrid=hybrid):
                return [(tool, round(score, 4)) for tool, score in hybrid.search(query, DEPTH)]
            deep.prepare = hybrid.prepare
        else:
            index = coffer.SearchIndex(evalset.tools)

            def deep(query, index=index):
                return [(index.tools[doc], round(score, 4)) for doc, score in index.rank(query, DEPTH)]
        replays.append((evalset.name, usage(evalset, deep, args.wrong)))
    if args.sweep:
        rows = []
        grid = dict(GRID)
        for part in (args.grid or "").split(";"):
            if part.strip():
                knob, _, values = part.partition("=")
                grid[knob.strip()] = tuple(float(v) if "." in v else int(v) for v in values.split(","))
        for cap, similarity, smoothing, candidates in itertools.product(*grid.values()):
            knobs = {"cap": cap, "similarity": similarity, "smoothing": smoothing, "candidates": candidates}
            results = [replay(coffer, events, **knobs) for _, events in replays]
            n = len(results)
            rows.append({**knobs,
                         "d_ndcg": round(sum(r["with"]["ndcg@10"] - r["without"]["ndcg@10"] for r in results) / n, 4),
                         "d_r1": round(sum(r["with"]["recall@1"] - r["without"]["recall@1"] for r in results) / n, 4),
                         "min_d_ndcg": round(min(r["with"]["ndcg@10"] - r["without"]["ndcg@10"] for r in results), 4),
                         "worse": sum(r["worse"] for r in results), "better": sum(r["better"] for r in results),
                         "after_wrong": sum(r["worse_after_wrong"] for r in results)})
        rows.sort(key=lambda r: -r["d_ndcg"])
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"{'cap':>5} {'sim':>4} {'k':>4} {'cand':>4} {'dNDCG':>7} {'dR@1':>7} {'minD':>7} {'better':>6} "
                  f"{'worse':>6} {'after a wrong pick':>18}")
            for r in rows:
                print(f"{r['cap']:>5} {r['similarity']:>4} {r['smoothing']:>4} {r['candidates']:>4} "
                      f"{r['d_ndcg']:>+7.4f} {r['d_r1']:>+7.4f} {r['min_d_ndcg']:>+7.4f} {r['better']:>6} "
                      f"{r['worse']:>6} {r['after_wrong']:>18}")
        return 0
    report = {name: replay(coffer, events) for name, events in replays}
    if args.json:
        print(json.dumps({"wrong": args.wrong, "seed": SEED, "sets": report}, indent=1))
        return 0
    ranker = "hybrid" if args.embedder else "lexical"
    print(f"replay ({ranker}), {args.wrong:.0%} of picks wrong; cap {coffer.PREFERENCE_CAP}, similarity "
          f"{coffer.PREFERENCE_SIMILARITY}, smoothing {coffer.PREFERENCE_SMOOTHING}, candidates "
          f"{coffer.PREFERENCE_CANDIDATES}")
    head = f"{'set':<16}{'searches':>9}" + "".join(f"{m + ' w/o':>14}{'with':>8}" for m in SCORED)
    print(head + f"{'better':>8}{'worse':>7}{'of them after a wrong pick':>28}")
    for name, r in report.items():
        cells = "".join(f"{r['without'][m]:>14.4f}{r['with'][m]:>8.4f}" for m in SCORED)
        print(f"{name:<16}{r['searches']:>9}{cells}{r['better']:>8}{r['worse']:>7}{r['worse_after_wrong']:>28}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
