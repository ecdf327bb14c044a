"""Tool-retrieval eval suite: how well does coffer.SearchIndex find the right tool for an agent's query?

Run from the repo root::

    python -m evals.run                       # all sets, all rankers, table + regression gate (exit 1 on regression)
    python -m evals.run --no-gate             # same, never fails on metrics
    python -m evals.run --json [PATH]         # machine-readable results (stdout when no PATH), table suppressed
    python -m evals.run --update-baselines    # record coffer's current metrics as the new baselines
    python -m evals.run --catalog C.jsonl --queries Q.jsonl [--name NAME]   # one external set only
    python -m evals.run --set project --rankers coffer,bm25s
    python -m evals.run --vault [COFFER_HOME]     # your own searches (search_feedback), as `coffer eval` does

Sets: ``project`` (evals/data, written by this project: an aggregated catalogue of real-world-style MCP
servers and agent-phrased queries tagged by style), every ``evals/sets/<name>/`` (built from pinned public
packages by ``python -m evals.build_sets``; see each SOURCE.md) and every ``<repo>/../shared/evals/<name>/``
folder holding ``catalog.jsonl`` + ``queries.jsonl`` (read in place, never copied into the repo). A set whose
files are absent is skipped (and fails the gate if it has a baseline, see below). Catalogue lines are tool dicts
``{"name","description","inputSchema",...}``; query lines are
``{"query","relevant":[...],"groups"?:[[...],...],"style"?}`` (style defaults to "all").

Rankers run side by side on identical input: ``coffer`` (under test), ``bm25f`` (the plain field-weighted
BM25 reference: name x3, description, parameters; no stemming, synonyms or boosts), and the lexical comparators
``rank_bm25`` and ``bm25s`` (see evals.rankers); a missing comparator is noted and skipped.

Measuring a change without editing coffer.py::

    python -m evals.run --draft D.py                 # + ranker "draft": D.py exec'd on top of coffer's namespace
    python -m evals.run --draft D.py --variant no-x:SearchIndex.X_WEIGHT=0   # + "no-x": the draft, one knob changed
    python -m evals.run --draft D.py --compare coffer      # per-set nDCG@10 / R@5 deltas of every ranker vs coffer
    python -m evals.run ... --holdout livemcpbench --holdout metatool-dev  # means over tuned vs held-out sets
    python -m evals.run ... --loso                   # leave-one-set-out: pick a ranker on the other sets, score it here
    python -m evals.run --draft D.py --gate-ranker draft   # gate the draft instead of coffer

With ``--embedder`` the draft also runs as ``draft-hybrid`` (its own ``fuse``) next to coffer's ``hybrid``.

Metrics (defined precisely in evals.metrics): recall@1/5/10, MRR@10 and nDCG@10 over groups of
interchangeable tools, plus per-query search latency p50/p95 and index build time in milliseconds.

Gate (for ``--gate-ranker``, default coffer), on every set that ran:

* ``evals/baselines/<set>.json`` holds recall@1, recall@5, MRR@10 and nDCG@10 and a tolerance (absolute); a
  metric more than its tolerance below baseline is a regression;
* nDCG@10 more than 0.01 below the plain ``bm25f`` reference fails (bm25f always runs when the gate is on);
* with ``--embedder``, the ranker's hybrid more than 0.01 nDCG@10 below its lexical ranking fails;
* the gate does not pass on nothing: a set with a baseline but no data (``../shared`` absent, say) or with data
  but no baseline fails the run, unless ``--allow-missing-sets``; the sets checked are printed.

Latency is reported but never gated: it depends on the machine, not on the code alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from evals import metrics  # noqa: E402  (needs the path above when run as a script)
from evals.rankers import (  # noqa: E402
    PreferenceReplay,
    RankerUnavailable,
    available_rankers,
    draft_factories,
    load_draft,
    make_embedder,
)

PROJECT_DIR = REPO_ROOT / "evals" / "data"
SETS_DIR = REPO_ROOT / "evals" / "sets"  # further dev sets built by evals/build_sets.py from pinned public packages
SHARED_DIR = REPO_ROOT.parent / "shared" / "evals"
BASELINE_DIR = REPO_ROOT / "evals" / "baselines"
GATED_METRICS = ("recall@1", "recall@5", "mrr@10", "ndcg@10")
DEFAULT_TOLERANCE = 0.02
REFERENCE_RANKER = "bm25f"
REFERENCE_MARGIN = 0.01  # nDCG@10 the gated ranker may lose to bm25f, and its hybrid to its lexical ranking
TOP_K = 10
STYLE_ORDER = ("task", "paraphrase", "keyword", "product", "non-english")


@dataclass
class EvalSet:
    """One catalogue plus its queries; fingerprint tells whether a baseline was taken on the same data."""

    name: str
    tools: list[dict]
    queries: list[dict]
    fingerprint: str


@dataclass
class RankerResult:
    """Everything one ranker produced on one set."""

    ranker: str
    build_ms: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    per_query: list[dict] = field(default_factory=list)
    error: str | None = None

    def summary(self, style: str | None = None) -> dict:
        rows = [q for q in self.per_query if style is None or q["style"] == style]
        out = metrics.mean_scores(q["scores"] for q in rows)
        out["n_queries"] = len(rows)
        return out


# ---------------------------------------------------------------- loading


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSON-lines file, skipping blank lines; errors name the line so data typos are easy to fix."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{path}:{lineno}: bad JSON: {exc}") from exc
    return rows


def load_set(name: str, catalog: Path, queries: Path) -> EvalSet:
    """Load a set and normalise queries (style default "all"; drop labels unknown to the catalogue, loudly)."""
    tools = read_jsonl(catalog)
    known = {t["name"] for t in tools}
    rows = read_jsonl(queries)
    for row in rows:
        row.setdefault("style", "all")
        missing = sorted({n for g in metrics.query_groups(row) for n in g} - known)
        if missing:
            print(f"warning: {name}: query {row['query'][:60]!r} labels unknown tools {missing}", file=sys.stderr)
    digest = hashlib.sha256(catalog.read_bytes() + b"\0" + queries.read_bytes()).hexdigest()[:16]
    return EvalSet(name, tools, rows, digest)


def vault_set(home: str) -> EvalSet:
    """The set 'vault': a user's labelled searches (coffer.labelled_searches) over the catalogue the last session
    saw (coffer.cached_tools); a search whose chosen tool is gone is left out."""
    import coffer
    home = home or coffer.coffer_home()
    if not (Path(home) / "coffer.db").is_file():
        raise SystemExit(f"--vault: no coffer.db in {home}")
    vault = coffer.Vault(home)
    try:
        tools = coffer.cached_tools(vault)
        searches, _ = coffer.labelled_searches(vault)
    finally:
        vault.close()
    names = {tool["name"] for tool in tools}
    queries = [{"query": s.query, "relevant": [s.chosen], "style": "all"} for s in searches if s.chosen in names]
    digest = hashlib.sha256(json.dumps([tools, queries], sort_keys=True).encode()).hexdigest()[:16]
    return EvalSet("vault", tools, queries, digest)


def discover_sets(args: argparse.Namespace) -> tuple[list[tuple[str, Path, Path]], list[str]]:
    """(name, catalog, queries) for every set to run, and notes about sets skipped for lack of data."""
    if args.catalog or args.queries:
        if not (args.catalog and args.queries):
            raise SystemExit("--catalog and --queries go together")
        catalog = Path(args.catalog)
        name = args.name or catalog.resolve().parent.name or "custom"
        return [(name, catalog, Path(args.queries))], []
    candidates = [("project", PROJECT_DIR)]
    if SETS_DIR.is_dir():
        candidates += [(d.name, d) for d in sorted(SETS_DIR.iterdir()) if d.is_dir()]
    if SHARED_DIR.is_dir():
        candidates += [(d.name, d) for d in sorted(SHARED_DIR.iterdir()) if d.is_dir()]
    found, skipped = [], []
    for name, folder in candidates:
        if args.set and name not in args.set:
            continue
        catalog, queries = folder / "catalog.jsonl", folder / "queries.jsonl"
        if catalog.is_file() and queries.is_file():
            found.append((name, catalog, queries))
        else:
            skipped.append(f"set {name}: no catalog.jsonl/queries.jsonl in {folder}, skipped")
    return found, skipped


# ---------------------------------------------------------------- evaluation


def run_ranker(name: str, factory, evalset: EvalSet) -> RankerResult:
    """Build the index once (timed), then search every query (each timed) and score its top 10."""
    result = RankerResult(name)
    try:
        started = time.perf_counter()
        index = factory(evalset.tools)
        result.build_ms = (time.perf_counter() - started) * 1000.0
    except RankerUnavailable as exc:
        result.error = str(exc)
        return result
    if hasattr(index, "prepare"):  # embed every query up front: latency below is ranking work only
        index.prepare([query["query"] for query in evalset.queries])
    for query in evalset.queries:
        started = time.perf_counter()
        hits = index.search(query["query"], top_k=TOP_K)
        result.latencies_ms.append((time.perf_counter() - started) * 1000.0)
        ranked = [tool["name"] for tool, _score in hits]
        groups = metrics.query_groups(query)
        result.per_query.append({
            "query": query["query"],
            "style": query["style"],
            "scores": metrics.score_query(ranked, groups),
            "top": ranked[:TOP_K],
        })
        spread = getattr(index, "spreads", {}).get(query["query"])
        if spread is not None:
            result.per_query[-1]["spread"] = round(spread, 4)
    return result


def result_json(result: RankerResult) -> dict:
    """A ranker's results as plain JSON: overall, per style, timings and per-query detail."""
    if result.error:
        return {"error": result.error}
    styles = ordered_styles(result.per_query)
    return {
        "overall": result.summary(),
        "by_style": {s: result.summary(s) for s in styles},
        "build_ms": round(result.build_ms, 3),
        "p50_ms": round(metrics.percentile(result.latencies_ms, 50), 4),
        "p95_ms": round(metrics.percentile(result.latencies_ms, 95), 4),
        "per_query": result.per_query,
    }


def ordered_styles(per_query: list[dict]) -> list[str]:
    present = {q["style"] for q in per_query}
    return [s for s in STYLE_ORDER if s in present] + sorted(present - set(STYLE_ORDER))


# ---------------------------------------------------------------- reporting

COLUMNS = ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "p50ms", "p95ms", "build_ms")


def metric_cells(summary: dict) -> list[str]:
    return [f"{summary[m]:.3f}" for m in metrics.METRIC_NAMES]


def format_table(report: list[dict]) -> str:
    """Set x ranker rows, per-style rows on the project set, and coffer's delta/ratio vs bm25s."""
    head = f"{'set':<16}{'ranker':<11}{'n':>6} " + " ".join(f"{c:>8}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for entry in report:
        for name, res in entry["rankers"].items():
            prefix = f"{entry['set']:<16}{name:<11}"
            if "error" in res:
                lines.append(f"{prefix}{'':>6}  skipped: {res['error']}")
                continue
            o = res["overall"]
            timing = [f"{res['p50_ms']:.3f}", f"{res['p95_ms']:.3f}", f"{res['build_ms']:.1f}"]
            lines.append(f"{prefix}{o['n_queries']:>6} " + " ".join(f"{c:>8}" for c in metric_cells(o) + timing))
        lines.append(delta_line(entry))
        lines += spread_lines(entry)
    for entry in report:
        if entry["set"] == "project":
            lines += ["", style_table(entry)]
    return "\n".join(line for line in lines if line is not None)


def delta_line(entry: dict) -> str | None:
    """coffer minus the bm25f reference (bm25s if it did not run), and the ratio, on each quality metric."""
    rankers = entry["rankers"]
    ref_name = REFERENCE_RANKER if "overall" in rankers.get(REFERENCE_RANKER, {}) else "bm25s"
    mine, ref = rankers.get("coffer", {}), rankers.get(ref_name, {})
    if "overall" not in mine or "overall" not in ref:
        return None
    parts = []
    for metric, label in zip(metrics.METRIC_NAMES, COLUMNS):
        a, b = mine["overall"][metric], ref["overall"][metric]
        ratio = f"x{a / b:.2f}" if b else "x-"
        parts.append(f"{label} {a - b:+.3f} ({ratio})")
    return f"{'':<16}{'vs ' + ref_name:<11}  " + "  ".join(parts)


def spread_lines(entry: dict) -> list[str]:
    """For each hybrid ranker: the median cosine spread of its semantic candidates by query style.  fuse gives
    the semantic ranking its full share from a spread of SEMANTIC_FULL_SPREAD on, and less below (a query the
    model does not understand gives flat cosines): these medians are what that constant was chosen from."""
    lines = []
    for name, res in entry["rankers"].items():
        spreads: dict[str, list[float]] = {}
        for row in res.get("per_query", ()):
            if "spread" in row:
                spreads.setdefault(row["style"], []).append(row["spread"])
        if spreads:
            cells = ", ".join(f"{style} {statistics.median(values):.2f}"
                              for style in ordered_styles(res["per_query"]) if (values := spreads.get(style)))
            lines.append(f"{'':<16}{name:<11}  median cosine spread of the semantic candidates: {cells}")
    return lines


def style_table(entry: dict) -> str:
    """Per query style, every ranker that ran on the project set (coffer first)."""
    lines = ["project set by query style", f"{'style':<14}{'ranker':<11}{'n':>6} "
             + " ".join(f"{c:>8}" for c in COLUMNS[:5])]
    ran = {n: r for n, r in entry["rankers"].items() if "by_style" in r}
    styles = next(iter(ran.values()))["by_style"].keys() if ran else []
    for style in styles:
        for name, res in ran.items():
            s = res["by_style"][style]
            lines.append(f"{style:<14}{name:<11}{s['n_queries']:>6} " + " ".join(f"{c:>8}" for c in metric_cells(s)))
    return "\n".join(lines)


# ---------------------------------------------------------------- comparing rankers set by set


def ndcg_r5(res: dict) -> tuple[float, float] | None:
    return (res["overall"]["ndcg@10"], res["overall"]["recall@5"]) if "overall" in res else None


def compare_table(report: list[dict], base: str, holdout: list[str]) -> str:
    """nDCG@10 / R@5 of ``base`` and every other ranker's delta to it, per set, then means over tuned and
    held-out sets: the one view in which an idea is judged (it must not lose > 0.01 nDCG@10 on any set)."""
    others = [r for r in dict.fromkeys(r for e in report for r in e["rankers"]) if r != base]
    width = max([17] + [len(r) + 3 for r in others])
    lines = [f"compare: nDCG@10 / R@5 of {base}, and each ranker's delta to it "
             f"(* held out: {', '.join(holdout) or 'none'})",
             f"{'set':<16}{base:>{width}}" + "".join(f"{r:>{width}}" for r in others)]
    sums: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for entry in report:
        mine = ndcg_r5(entry["rankers"].get(base, {}))
        label = entry["set"] + (" *" if entry["set"] in holdout else "")
        if mine is None:
            lines.append(f"{label:<16}{'-':>{width}}")
            continue
        row = f"{label:<16}{f'{mine[0]:.3f}/{mine[1]:.3f}':>{width}}"
        group = "held-out" if entry["set"] in holdout else "tuned"
        sums.setdefault((group, base), []).append(mine)
        for other in others:
            theirs = ndcg_r5(entry["rankers"].get(other, {}))
            if theirs is None:
                row += f"{'-':>{width}}"
                continue
            delta = (theirs[0] - mine[0], theirs[1] - mine[1])
            sums.setdefault((group, other), []).append(delta)
            flag = "!" if delta[0] < -REFERENCE_MARGIN - 1e-9 else " "
            row += f"{f'{delta[0]:+.3f}/{delta[1]:+.3f}{flag}':>{width}}"
        lines.append(row)
    for group in ("tuned", "held-out"):
        if (group, base) not in sums:
            continue
        row = f"{'mean ' + group:<16}"
        for ranker in [base] + others:
            values = sums.get((group, ranker))
            if not values:
                row += f"{'-':>{width}}"
                continue
            a = sum(v[0] for v in values) / len(values)
            b = sum(v[1] for v in values) / len(values)
            row += f"{(f'{a:.3f}/{b:.3f}' if ranker == base else f'{a:+.3f}/{b:+.3f} '):>{width}}"
        lines.append(row)
    lines.append("(! = loses more than 0.01 nDCG@10 to the base on that set)")
    return "\n".join(lines)


def loso_table(report: list[dict], base: str) -> str:
    """Leave-one-set-out: for each set, the ranker with the best mean nDCG@10 on the *other* sets is chosen,
    then scored on this set against ``base`` -- an honest estimate of how a tuning choice transfers."""
    rankers = [r for r in dict.fromkeys(r for e in report for r in e["rankers"])
               if all("overall" in e["rankers"].get(r, {}) for e in report)]
    lines = [f"leave-one-set-out: chosen on the other sets, scored on this one (nDCG@10 vs {base})"]
    if len(report) < 2 or base not in rankers:
        return "\n".join(lines + ["(needs two or more sets on which every ranker ran)"])
    score = {(e["set"], r): e["rankers"][r]["overall"]["ndcg@10"] for e in report for r in rankers}
    total = 0.0
    for entry in report:
        others = [e["set"] for e in report if e is not entry]
        chosen = max(rankers, key=lambda r: (sum(score[(s, r)] for s in others), r == base))
        delta = score[(entry["set"], chosen)] - score[(entry["set"], base)]
        total += delta
        lines.append(f"{entry['set']:<16}chosen {chosen:<22} {score[(entry['set'], chosen)]:.3f}  "
                     f"{base} {score[(entry['set'], base)]:.3f}  delta {delta:+.3f}")
    lines.append(f"{'mean delta':<16}{total / len(report):+.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- gate


def shown(path: Path) -> str:
    """A path relative to the repo when it is inside it (short messages), else as it is."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def baseline_path(set_name: str) -> Path:
    return BASELINE_DIR / f"{set_name}.json"


def partner_hybrid(ranker: str) -> str:
    """The hybrid ranker that fuses ``ranker``'s lexical ranking (coffer -> hybrid, draft -> draft-hybrid)."""
    return "hybrid" if ranker == "coffer" else f"{ranker}-hybrid"


def check_gate(entry: dict, evalset: EvalSet, ranker: str = "coffer") -> tuple[list[str], list[str]]:
    """(failures, notes) for ``ranker`` on one set: its baseline, the bm25f reference, its hybrid."""
    name = entry["set"]
    results = entry["rankers"]
    mine = results.get(ranker, {})
    if "overall" not in mine:
        return [f"set {name}: {ranker} did not run ({mine.get('error', 'not selected')})"], []
    failures, notes = [], []
    path = baseline_path(name)
    if path.is_file():
        baseline = json.loads(path.read_text(encoding="utf-8"))
        if baseline.get("data_sha256") != evalset.fingerprint:
            notes.append(f"set {name}: data changed since the baseline was taken; "
                         "if intended, refresh it with --update-baselines")
        tolerance = baseline.get("tolerance", DEFAULT_TOLERANCE)
        for metric, expected in baseline["metrics"].items():
            got = mine["overall"][metric]
            if got < expected - tolerance - 1e-9:
                failures.append(f"set {name}: {ranker} {metric} {got:.4f} < baseline {expected:.4f} "
                                f"- tolerance {tolerance}")
    reference = results.get(REFERENCE_RANKER, {})
    if "overall" in reference:
        got, ref = mine["overall"]["ndcg@10"], reference["overall"]["ndcg@10"]
        if got < ref - REFERENCE_MARGIN - 1e-9:
            failures.append(f"set {name}: {ranker} nDCG@10 {got:.4f} loses to plain {REFERENCE_RANKER} {ref:.4f} "
                            f"by more than {REFERENCE_MARGIN}")
    else:
        failures.append(f"set {name}: the {REFERENCE_RANKER} reference did not run "
                        f"({reference.get('error', 'not selected')})")
    hybrid = results.get(partner_hybrid(ranker), {})
    if "overall" in hybrid:
        got, lexical = hybrid["overall"]["ndcg@10"], mine["overall"]["ndcg@10"]
        if got < lexical - REFERENCE_MARGIN - 1e-9:
            failures.append(f"set {name}: {partner_hybrid(ranker)} nDCG@10 {got:.4f} loses to {ranker} lexical "
                            f"{lexical:.4f} by more than {REFERENCE_MARGIN}")
    return failures, notes


def coverage_problems(ran: list[str], args: argparse.Namespace) -> list[str]:
    """Sets the gate would silently skip: a baseline without data, or data without a baseline."""
    problems = []
    wanted = set(args.set) if args.set else None
    if not (args.catalog or args.queries):
        for path in sorted(BASELINE_DIR.glob("*.json")):
            name = path.stem
            if name not in ran and (wanted is None or name in wanted):
                problems.append(f"set {name}: has a baseline but no data was found "
                                f"(looked in {shown(PROJECT_DIR)}, "
                                f"{shown(SETS_DIR)}, {SHARED_DIR})")
    for name in ran:
        if not baseline_path(name).is_file():
            problems.append(f"set {name}: has data but no baseline at "
                            f"{shown(baseline_path(name))} (run --update-baselines)")
    return problems


def write_baseline(entry: dict, evalset: EvalSet) -> str:
    """Record coffer's current gated metrics for a set, keeping a hand-tuned tolerance if there is one."""
    coffer = entry["rankers"].get("coffer", {})
    if "overall" not in coffer:
        return f"set {entry['set']}: coffer did not run, baseline not written"
    path = baseline_path(entry["set"])
    tolerance = DEFAULT_TOLERANCE
    if path.is_file():
        tolerance = json.loads(path.read_text(encoding="utf-8")).get("tolerance", DEFAULT_TOLERANCE)
    doc = {
        "set": entry["set"],
        "ranker": "coffer",
        "tolerance": tolerance,
        "metrics": {m: round(coffer["overall"][m], 4) for m in GATED_METRICS},
        "n_tools": len(evalset.tools),
        "n_queries": len(evalset.queries),
        "data_sha256": evalset.fingerprint,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return f"set {entry['set']}: baseline written to {shown(path)}"


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--catalog", help="run only this external catalogue (JSONL of tools)")
    p.add_argument("--queries", help="queries JSONL for --catalog")
    p.add_argument("--name", help="set name for --catalog (default: its folder name)")
    p.add_argument("--set", action="append", help="only this set (repeatable): project, livemcpbench, ...")
    p.add_argument("--vault", nargs="?", const="", metavar="COFFER_HOME",
                   help="only the set 'vault': the labelled searches recorded with search_feedback on, over the "
                        "catalogue the last session saw (default $COFFER_HOME or ~/.coffer), with the ranker "
                        "coffer+preference (the user's picks replayed, as `coffer eval` does); never gated")
    p.add_argument("--rankers", help="comma-separated subset of rankers (default: all available)")
    p.add_argument("--embedder", metavar="URL",
                   help="add 'semantic' and 'hybrid' rankers using this embeddings endpoint (e.g. "
                        "http://127.0.0.1:8000/v1, or an Ollama base URL with --embedder-api ollama)")
    p.add_argument("--embedder-model", default="all-MiniLM-L6-v2", help="model name sent to the endpoint")
    p.add_argument("--embedder-api", default="openai", choices=("openai", "ollama"))
    p.add_argument("--embed-cache", metavar="PATH", help="keep embeddings in PATH between runs (a dev cache)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON results (stdout if no PATH)")
    p.add_argument("--draft", metavar="PATH", help="add ranker 'draft': PATH exec'd on top of coffer's namespace "
                   "(a drop-in section for coffer.py); with --embedder also 'draft-hybrid'")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDE[;OVERRIDE]",
                   help="add ranker NAME: the draft with overrides such as SearchIndex.SERVER_BOOST=0.0 (repeatable)")
    p.add_argument("--compare", metavar="BASE", help="print every ranker's per-set nDCG@10/R@5 delta to BASE")
    p.add_argument("--holdout", action="append", default=[], metavar="SET",
                   help="mark SET as held out (not tuned on): --compare reports tuned and held-out means apart")
    p.add_argument("--loso", action="store_true", help="leave-one-set-out table (base: --compare, or coffer)")
    p.add_argument("--gate-ranker", default="coffer", help="ranker the gate checks (default coffer)")
    p.add_argument("--ask", action="store_true",
                   help="the knowledge retrieval eval instead (coffer__ask vs rank_bm25, bm25s, SQLite FTS5; see "
                        "evals/ask.py), gated: Coffer's default must beat every comparator")
    p.add_argument("--quiet", action="store_true", help="print the table only when the gate fails (for CI)")
    p.add_argument("--allow-missing-sets", action="store_true",
                   help="a set with a baseline but no data, or data but no baseline, is a note, not a failure")
    gate = p.add_mutually_exclusive_group()
    gate.add_argument("--gate", dest="gate", action="store_true", default=True, help="check baselines (default)")
    gate.add_argument("--no-gate", dest="gate", action="store_false", help="report only, never fail on metrics")
    gate.add_argument("--update-baselines", action="store_true", help="rewrite evals/baselines/<set>.json")
    return p.parse_args(argv)


def select_rankers(args: argparse.Namespace, replayed: EvalSet | None = None) -> dict:
    """The rankers to run; with ``replayed`` (the set 'vault', a user's searches in the order they were made),
    also coffer+preference: the user's picks, each search learning only from those before it."""
    embedder = make_embedder(args.embedder, args.embedder_model, args.embedder_api, args.embed_cache) \
        if args.embedder else None
    rankers = available_rankers(None)
    if replayed is not None:
        rankers["coffer+preference"] = lambda tools: PreferenceReplay(tools, replayed.queries)
    if embedder is not None:
        from evals.rankers import EmbeddingRanker
        rankers.update({mode: (lambda tools, mode=mode: EmbeddingRanker(tools, embedder, mode))
                        for mode in ("semantic", "hybrid")})
    if args.variant and not args.draft:
        raise SystemExit("--variant needs --draft")
    drafted: list[str] = []  # rankers the user asked for by --draft/--variant: always run
    if args.draft:
        factories = draft_factories("draft", load_draft(args.draft), embedder)
        for spec in args.variant:
            name, sep, overrides = spec.partition(":")
            if not sep or not name:
                raise SystemExit(f"--variant {spec!r} is not NAME:OVERRIDE[;OVERRIDE]")
            module = load_draft(args.draft, [o for o in overrides.split(";") if o.strip()])
            factories.update(draft_factories(name, module, embedder))
        rankers.update(factories)
        drafted = list(factories)
    if args.rankers:
        wanted = [r.strip() for r in args.rankers.split(",") if r.strip()]
        unknown = [r for r in wanted if r not in rankers]
        if unknown:
            raise SystemExit(f"unknown ranker(s) {unknown}; known: {list(rankers)}")
        wanted += [r for r in drafted if r not in wanted]
        if args.gate and not args.update_baselines:  # the gate needs its ranker, the reference and the hybrid
            for needed in (args.gate_ranker, REFERENCE_RANKER, partner_hybrid(args.gate_ranker)):
                if needed in rankers and needed not in wanted:
                    wanted.append(needed)
        rankers = {r: rankers[r] for r in wanted}
    return rankers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ask:
        from evals import ask
        forwarded = ["--gate"] + (["--embedder", args.embedder] if args.embedder else []) + (
            ["--json", args.json] if args.json else [])
        return ask.main(forwarded)
    if args.vault is not None:
        mine = vault_set(args.vault)
        rankers = select_rankers(args, mine)
        args.gate, loaded, notes = False, [mine], []
    else:
        rankers = select_rankers(args)
        to_run, notes = discover_sets(args)
        loaded = (load_set(name, catalog, queries) for name, catalog, queries in to_run)
    report, evalsets = [], {}
    for evalset in loaded:
        name = evalset.name
        evalsets[name] = evalset
        results = {r: result_json(run_ranker(r, f, evalset)) for r, f in rankers.items()}
        report.append({"set": name, "n_tools": len(evalset.tools), "n_queries": len(evalset.queries),
                       "data_sha256": evalset.fingerprint, "rankers": results})
        notes += [f"set {name}: {r} skipped: {res['error']}" for r, res in results.items() if "error" in res]

    failures: list[str] = []
    if args.update_baselines:
        notes += [write_baseline(entry, evalsets[entry["set"]]) for entry in report]
    elif args.gate:
        for entry in report:
            f, n = check_gate(entry, evalsets[entry["set"]], args.gate_ranker)
            failures += f
            notes += n
        missing = coverage_problems([entry["set"] for entry in report], args)
        if args.allow_missing_sets:
            notes += [f"{problem} (allowed by --allow-missing-sets)" for problem in missing]
        else:
            failures += missing
        if not report:
            failures.append("no set ran: the gate has nothing to check")

    emit(args, report, notes, failures)
    return 1 if failures else 0


def emit(args: argparse.Namespace, report: list[dict], notes: list[str], failures: list[str]) -> None:
    """Table on stdout (or JSON with --json); notes and regressions always readable on stderr/stdout."""
    if args.json:
        doc = {"sets": report, "notes": notes, "gate": {"enabled": bool(args.gate and not args.update_baselines),
                                                        "ok": not failures, "regressions": failures}}
        text = json.dumps(doc, indent=1, ensure_ascii=False)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n", encoding="utf-8")
    out = sys.stderr if args.json == "-" else sys.stdout
    if args.json != "-" and not (args.quiet and not failures):
        print(format_table(report), file=out)
        if args.compare or args.loso:
            base = args.compare or "coffer"
            if args.compare:
                print("\n" + compare_table(report, base, args.holdout), file=out)
            if args.loso:
                print("\n" + loso_table(report, base), file=out)
    for note in notes if not (args.quiet and not failures) else ():
        print(f"note: {note}", file=out)
    if args.gate and not args.update_baselines:
        verdict = "FAILED" if failures else "passed"
        for failure in failures:
            print(f"REGRESSION: {failure}", file=out)
        checked = ", ".join(entry["set"] for entry in report) or "none"
        print(f"gate {verdict} for {args.gate_ranker} on {len(report)} set(s): {checked}", file=out)


if __name__ == "__main__":
    sys.exit(main())
