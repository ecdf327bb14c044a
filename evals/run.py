"""Tool-retrieval eval suite: how well does coffer.SearchIndex find the right tool for an agent's query?

Run from the repo root::

    python -m evals.run                       # all sets, all rankers, table + regression gate (exit 1 on regression)
    python -m evals.run --no-gate             # same, never fails on metrics
    python -m evals.run --json [PATH]         # machine-readable results (stdout when no PATH), table suppressed
    python -m evals.run --update-baselines    # record coffer's current metrics as the new baselines
    python -m evals.run --catalog C.jsonl --queries Q.jsonl [--name NAME]   # one external set only
    python -m evals.run --set project --rankers coffer,bm25s

Sets: ``project`` (evals/data, written by this project: an aggregated catalogue of real-world-style MCP
servers and agent-phrased queries tagged by style) plus every ``<repo>/../shared/evals/<name>/`` folder holding
``catalog.jsonl`` + ``queries.jsonl`` (read in place, never copied into the repo). A set whose files are
absent is skipped, not failed. Catalogue lines are tool dicts ``{"name","description","inputSchema",...}``;
query lines are ``{"query","relevant":[...],"groups"?:[[...],...],"style"?}`` (style defaults to "all").

Rankers run side by side on identical input: ``coffer`` (under test), and the lexical comparators
``rank_bm25`` and ``bm25s`` (see evals.rankers); a missing comparator is noted and skipped.

Metrics (defined precisely in evals.metrics): recall@1/5/10, MRR@10 and nDCG@10 over groups of
interchangeable tools, plus per-query search latency p50/p95 and index build time in milliseconds.

Gate: ``evals/baselines/<set>.json`` holds coffer's recall@1, recall@5, MRR@10 and nDCG@10 for that set and a
tolerance (absolute). A metric more than its tolerance below baseline is a regression; the run prints each and
exits 1. Latency is reported but never gated: it depends on the machine, not on the code alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from evals import metrics  # noqa: E402  (needs the path above when run as a script)
from evals.rankers import RankerUnavailable, available_rankers  # noqa: E402

PROJECT_DIR = REPO_ROOT / "evals" / "data"
SETS_DIR = REPO_ROOT / "evals" / "sets"  # further dev sets built by evals/build_sets.py from pinned public packages
SHARED_DIR = REPO_ROOT.parent / "shared" / "evals"
BASELINE_DIR = REPO_ROOT / "evals" / "baselines"
GATED_METRICS = ("recall@1", "recall@5", "mrr@10", "ndcg@10")
DEFAULT_TOLERANCE = 0.02
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
    head = f"{'set':<14}{'ranker':<11}{'n':>6} " + " ".join(f"{c:>8}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for entry in report:
        for name, res in entry["rankers"].items():
            prefix = f"{entry['set']:<14}{name:<11}"
            if "error" in res:
                lines.append(f"{prefix}{'':>6}  skipped: {res['error']}")
                continue
            o = res["overall"]
            timing = [f"{res['p50_ms']:.3f}", f"{res['p95_ms']:.3f}", f"{res['build_ms']:.1f}"]
            lines.append(f"{prefix}{o['n_queries']:>6} " + " ".join(f"{c:>8}" for c in metric_cells(o) + timing))
        lines.append(delta_line(entry))
    for entry in report:
        if entry["set"] == "project":
            lines += ["", style_table(entry)]
    return "\n".join(line for line in lines if line is not None)


def delta_line(entry: dict) -> str | None:
    """coffer minus bm25s (and coffer / bm25s) on each quality metric, when both ran."""
    rankers = entry["rankers"]
    mine, ref = rankers.get("coffer", {}), rankers.get("bm25s", {})
    if "overall" not in mine or "overall" not in ref:
        return None
    parts = []
    for metric, label in zip(metrics.METRIC_NAMES, COLUMNS):
        a, b = mine["overall"][metric], ref["overall"][metric]
        ratio = f"x{a / b:.2f}" if b else "x-"
        parts.append(f"{label} {a - b:+.3f} ({ratio})")
    return f"{'':<14}{'vs bm25s':<11}  " + "  ".join(parts)


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


# ---------------------------------------------------------------- gate


def baseline_path(set_name: str) -> Path:
    return BASELINE_DIR / f"{set_name}.json"


def check_gate(entry: dict, evalset: EvalSet) -> tuple[list[str], list[str]]:
    """(regressions, notes) for coffer on one set against its stored baseline."""
    path = baseline_path(entry["set"])
    if not path.is_file():
        return [], [f"set {entry['set']}: no baseline at {path.relative_to(REPO_ROOT)} (run --update-baselines)"]
    coffer = entry["rankers"].get("coffer", {})
    if "overall" not in coffer:
        return [f"set {entry['set']}: coffer did not run ({coffer.get('error', 'not selected')})"], []
    baseline = json.loads(path.read_text(encoding="utf-8"))
    notes = []
    if baseline.get("data_sha256") != evalset.fingerprint:
        notes.append(f"set {entry['set']}: data changed since the baseline was taken; "
                     "if intended, refresh it with --update-baselines")
    failures = []
    for metric, expected in baseline["metrics"].items():
        tolerance = baseline.get("tolerance", DEFAULT_TOLERANCE)
        got = coffer["overall"][metric]
        if got < expected - tolerance - 1e-9:
            failures.append(f"set {entry['set']}: coffer {metric} {got:.4f} < baseline {expected:.4f} "
                            f"- tolerance {tolerance}")
    return failures, notes


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
    return f"set {entry['set']}: baseline written to {path.relative_to(REPO_ROOT)}"


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--catalog", help="run only this external catalogue (JSONL of tools)")
    p.add_argument("--queries", help="queries JSONL for --catalog")
    p.add_argument("--name", help="set name for --catalog (default: its folder name)")
    p.add_argument("--set", action="append", help="only this set (repeatable): project, livemcpbench, ...")
    p.add_argument("--rankers", help="comma-separated subset of rankers (default: all available)")
    p.add_argument("--embedder", metavar="URL",
                   help="add 'semantic' and 'hybrid' rankers using this embeddings endpoint (e.g. "
                        "http://127.0.0.1:8000/v1, or an Ollama base URL with --embedder-api ollama)")
    p.add_argument("--embedder-model", default="all-MiniLM-L6-v2", help="model name sent to the endpoint")
    p.add_argument("--embedder-api", default="openai", choices=("openai", "ollama"))
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON results (stdout if no PATH)")
    gate = p.add_mutually_exclusive_group()
    gate.add_argument("--gate", dest="gate", action="store_true", default=True, help="check baselines (default)")
    gate.add_argument("--no-gate", dest="gate", action="store_false", help="report only, never fail on metrics")
    gate.add_argument("--update-baselines", action="store_true", help="rewrite evals/baselines/<set>.json")
    return p.parse_args(argv)


def select_rankers(args: argparse.Namespace) -> dict:
    rankers = available_rankers(args.embedder, args.embedder_model, args.embedder_api)
    if not args.rankers:
        return rankers
    wanted = [r.strip() for r in args.rankers.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in rankers]
    if unknown:
        raise SystemExit(f"unknown ranker(s) {unknown}; known: {list(rankers)}")
    return {r: rankers[r] for r in wanted}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rankers = select_rankers(args)
    to_run, notes = discover_sets(args)
    report, evalsets = [], {}
    for name, catalog, queries in to_run:
        evalset = load_set(name, catalog, queries)
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
            f, n = check_gate(entry, evalsets[entry["set"]])
            failures += f
            notes += n

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
    if args.json != "-":
        print(format_table(report), file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    if args.gate and not args.update_baselines:
        verdict = "FAILED" if failures else "passed"
        for failure in failures:
            print(f"REGRESSION: {failure}", file=out)
        print(f"gate {verdict} ({len(report)} set(s))", file=out)


if __name__ == "__main__":
    sys.exit(main())
