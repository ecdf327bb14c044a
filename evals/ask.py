"""Knowledge-retrieval eval (coffer__ask): does coffer.KnowledgeBase find the passage that answers a question?

Run from the repo root::

    python -m evals.ask                          # table: Coffer (both lexical engines) vs comparators
    python -m evals.ask --gate                   # exit 1 if Coffer's default engine loses to any comparator
    python -m evals.ask --json [PATH]            # machine-readable results (stdout when no PATH)
    python -m evals.ask --embedder URL [--embedder-model M] [--embedder-api openai|ollama]   # adds hybrid rows
    python -m evals.ask --draft /work/drafts/knowledge/section_knowledge.py   # until KnowledgeBase is in coffer.py

Corpus: ``evals/ask_data/corpus`` (click 8.5.1 Markdown + flask 3.1.3 reStructuredText docs, pinned, see
SOURCE.md).  Questions: ``evals/ask_data/questions.jsonl``, written for this project, each labelled with the
answering location(s) as file + line range.  Coffer indexes the corpus as one source; every comparator indexes
exactly the passages Coffer produced (heading path + text), so only ranking differs.

Rankers: ``coffer-fts5`` and ``coffer-bm25f`` (both storage paths; the default engine, FTS5 when this sqlite3
has it, is marked and gated), ``hybrid`` (with --embedder: the default engine fused with the embedder's
ranking), and the comparators ``rank_bm25``
(BM25Okapi on lowercased \\w+ tokens), ``bm25s`` (its default tokenizer and English stop words) and
``sqlite-fts5`` (SQLite FTS5 bm25() with the porter tokenizer, the question's words OR-ed).

Every comparator also runs on its own plain chunking (``rank_bm25/40l``, ``bm25s/40l``, ``sqlite-fts5/40l``):
each file cut into 40-line chunks, as a user would index documentation without Coffer.  Its nDCG ideal is the
best of its own chunks.

Metrics, with a passage relevant to a labelled need when its line range overlaps one of the need's locations:

* recall@5  - fraction of the question's needs met by a passage in the top 5 (hit@5 for one-need questions);
* MRR@10    - 1 / rank of the first passage meeting any need;
* nDCG@10   - graded by overlap: a passage's gain is the largest fraction of a labelled location it covers;
  the ideal ranking is the corpus' best passages by that gain;
* R@100L, R@200L - recall at a reading budget: the needs met by the first 100 (200) lines of text returned,
  passages read in rank order, the last one cut at the budget.  recall@k rewards bigger passages (five 40-line
  chunks are 200 lines); at a fixed budget, passage size is paid for.

Gate (--gate): Coffer's default engine must be at least as good as every comparator on recall@5, MRR@10 and
nDCG@10 -- any comparator strictly better on any of them fails the run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DATA_DIR = REPO_ROOT / "evals" / "ask_data"
CORPUS_DIR = DATA_DIR / "corpus"
QUESTIONS = DATA_DIR / "questions.jsonl"
GATED = ("recall@5", "mrr@10", "ndcg@10")
BUDGETS = (100, 200)  # lines of text read, for recall at a reading budget
METRICS = ("recall@1", "recall@5", "mrr@10", "ndcg@10") + tuple(f"recall@{b}l" for b in BUDGETS)
CHUNK_LINES = 40  # the plain chunking of the comparators' own rows
STYLES = ("howto", "factual", "paraphrase", "keyword", "error", "multi")
COMPARATORS = ("rank_bm25", "bm25s", "sqlite-fts5")
TOP_K = 10
_WORD_RE = re.compile(r"\w+")


class RankerUnavailable(Exception):
    """A ranker cannot run here (package missing, no FTS5, embedder down)."""


# ------------------------------------------------------------------------------------------------------------
# Loading Coffer (integrated, or coffer.py + the draft section)
# ------------------------------------------------------------------------------------------------------------

def load_coffer(draft: Path | None):
    """The coffer module; with ``draft``, coffer.py with the draft section appended (registered as 'coffer', so
    everything importing coffer in this process sees the same module)."""
    if draft is None:
        import coffer
        if not hasattr(coffer, "KnowledgeBase"):
            raise SystemExit("coffer.KnowledgeBase does not exist yet; pass --draft PATH to evaluate the draft")
        return coffer
    source = (REPO_ROOT / "coffer.py").read_text(encoding="utf-8")
    shim = "" if re.search(r"^log = logging\.getLogger", source, re.M) else \
        'import logging\nlog = logging.getLogger("coffer")\n'
    module = types.ModuleType("coffer")
    module.__file__ = str(REPO_ROOT / "coffer.py")
    sys.modules["coffer"] = module
    code = compile(source + "\n" + shim + Path(draft).read_text(encoding="utf-8"), str(draft), "exec")
    exec(code, module.__dict__)
    return module


# ------------------------------------------------------------------------------------------------------------
# Data and metrics
# ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PassageRef:
    path: str
    first: int
    last: int
    text: str = field(compare=False, hash=False, repr=False)


def load_questions(path: Path = QUESTIONS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def overlap(passage: PassageRef, location: dict) -> int:
    if passage.path != location["path"]:
        return 0
    first, last = location["lines"]
    return max(0, min(passage.last, last) - max(passage.first, first) + 1)


def gain(passage: PassageRef, needs: list[list[dict]]) -> float:
    """Largest fraction of a labelled location that this passage covers (0..1)."""
    best = 0.0
    for need in needs:
        for location in need:
            covered = overlap(passage, location)
            if covered:
                first, last = location["lines"]
                best = max(best, covered / (last - first + 1))
    return best


def meets(passage: PassageRef, need: list[dict]) -> bool:
    return any(overlap(passage, location) for location in need)


def within_budget(ranked: list[PassageRef], budget: int) -> list[PassageRef]:
    """The passages a reader gets through in ``budget`` lines, in rank order, the last one cut at the budget."""
    read, left = [], budget
    for passage in ranked:
        if left <= 0:
            break
        lines = passage.last - passage.first + 1
        read.append(passage if lines <= left else PassageRef(passage.path, passage.first, passage.first + left - 1,
                                                             passage.text))
        left -= lines
    return read


def score_question(ranked: list[PassageRef], needs: list[list[dict]], ideal_gains: list[float]) -> dict:
    def recall(k):
        return sum(any(meets(p, need) for p in ranked[:k]) for need in needs) / len(needs)

    def recall_lines(budget):
        read = within_budget(ranked, budget)
        return sum(any(meets(p, need) for p in read) for need in needs) / len(needs)

    mrr = next((1.0 / rank for rank, p in enumerate(ranked[:10], 1) if any(meets(p, n) for n in needs)), 0.0)
    dcg = sum(gain(p, needs) / math.log2(rank + 1) for rank, p in enumerate(ranked[:10], 1))
    idcg = sum(g / math.log2(rank + 1) for rank, g in enumerate(ideal_gains[:10], 1))
    scores = {"recall@1": recall(1), "recall@5": recall(5), "mrr@10": mrr,
              "ndcg@10": min(1.0, dcg / idcg) if idcg else 0.0}
    scores.update((f"recall@{budget}l", recall_lines(budget)) for budget in BUDGETS)
    return scores


def mean(rows: list[dict]) -> dict:
    return {m: (sum(r[m] for r in rows) / len(rows) if rows else 0.0) for m in METRICS}


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100.0 * len(ordered)) - 1)]


# ------------------------------------------------------------------------------------------------------------
# Rankers: each is built on the passage list and answers search(question, k) -> [PassageRef]
# ------------------------------------------------------------------------------------------------------------

def comparator_text(passage) -> str:
    return f"{passage.heading}\n{passage.text}" if passage.heading else passage.text


@dataclass(frozen=True)
class PlainChunk:
    """A comparator's own passage: CHUNK_LINES lines of one file, as a user would cut documentation."""

    path: str
    lines: tuple[int, int]
    text: str
    heading: str = ""


def plain_chunks(corpus: Path = CORPUS_DIR, size: int = CHUNK_LINES) -> list[PlainChunk]:
    chunks = []
    for path in sorted(p for p in corpus.rglob("*") if p.is_file()):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        relative = path.relative_to(corpus).as_posix()
        for start in range(0, len(lines), size):
            text = "\n".join(lines[start:start + size])
            if text.strip():
                chunks.append(PlainChunk(relative, (start + 1, min(len(lines), start + size)), text))
    return chunks


class CofferRanker:
    """coffer.KnowledgeBase with a given engine / feedback / embedder, on its own vault in a temp folder."""

    def __init__(self, coffer, home: Path, engine: str, embedder=None):
        # Generous embedder time budgets: the eval measures ranking quality, and a CPU-only model on a busy
        # machine can take minutes for the corpus (the gateway's defaults are 120 s and 1 s).
        self.kb = coffer.KnowledgeBase(str(home / f"{engine}-{bool(embedder)}.db"), str(home), engine=engine,
                                       embedder=embedder, build_timeout=3600.0, query_timeout=120.0)
        started = time.perf_counter()
        self.stats = self.kb.add_source(str(CORPUS_DIR), name="docs")
        self.build_ms = (time.perf_counter() - started) * 1000.0
        self.note = None
        if embedder is not None:
            try:
                self.kb.ensure_vectors()
            except coffer.EmbedderError as exc:
                raise RankerUnavailable(f"embedder failed: {exc}") from exc

    def passages(self) -> list:
        return list(self.kb.passages())

    def search(self, question: str, k: int) -> list[PassageRef]:
        answer = self.kb.ask(question, k)
        if answer.note:
            self.note = answer.note
        return [PassageRef(hit.path, hit.lines[0], hit.lines[1], hit.text) for hit in answer.passages]


class RankBM25Ranker:
    def __init__(self, passages):
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as exc:
            raise RankerUnavailable("rank_bm25 is not installed") from exc
        self.refs = [PassageRef(p.path, p.lines[0], p.lines[1], p.text) for p in passages]
        self.bm25 = BM25Okapi([_WORD_RE.findall(comparator_text(p).lower()) or [""] for p in passages])

    def search(self, question, k):
        tokens = _WORD_RE.findall(question.lower())
        if not tokens:
            return []
        scores = self.bm25.get_scores(tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
        return [self.refs[i] for i in order if scores[i] > 0]


class BM25SRanker:
    def __init__(self, passages):
        try:
            import bm25s
        except ImportError as exc:
            raise RankerUnavailable("bm25s is not installed") from exc
        self.bm25s = bm25s
        self.refs = [PassageRef(p.path, p.lines[0], p.lines[1], p.text) for p in passages]
        corpus = bm25s.tokenize([comparator_text(p) for p in passages], stopwords="en", show_progress=False)
        self.model = bm25s.BM25()
        self.model.index(corpus, show_progress=False)
        self.vocab = set(self.model.vocab_dict)

    def search(self, question, k):
        tokens = self.bm25s.tokenize([question], stopwords="en", return_ids=False, show_progress=False)[0]
        tokens = [t for t in tokens if t in self.vocab]
        if not tokens:
            return []
        scores = self.model.get_scores(tokens)
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:k]
        return [self.refs[i] for i in order if float(scores[i]) > 0]


class SqliteFtsRanker:
    """Plain SQLite FTS5 as a user would set it up: porter stemming, the question's words OR-ed, bm25()."""

    def __init__(self, passages):
        import sqlite3
        self.db = sqlite3.connect(":memory:")
        try:
            self.db.execute("CREATE VIRTUAL TABLE docs USING fts5(text, tokenize='porter unicode61')")
        except sqlite3.OperationalError as exc:
            raise RankerUnavailable(f"no FTS5 in this sqlite3: {exc}") from exc
        self.refs = [PassageRef(p.path, p.lines[0], p.lines[1], p.text) for p in passages]
        self.db.executemany("INSERT INTO docs(rowid, text) VALUES (?, ?)",
                            [(i, comparator_text(p)) for i, p in enumerate(passages)])

    def search(self, question, k):
        words = _WORD_RE.findall(question.lower())
        if not words:
            return []
        query = " OR ".join('"' + w.replace('"', '""') + '"' for w in words)
        rows = self.db.execute("SELECT rowid FROM docs WHERE docs MATCH ? ORDER BY bm25(docs) LIMIT ?", (query, k))
        return [self.refs[row[0]] for row in rows]


@dataclass
class Result:
    ranker: str
    build_ms: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    per_question: list[dict] = field(default_factory=list)
    error: str | None = None
    note: str | None = None

    def summary(self, style: str | None = None) -> dict:
        rows = [q["scores"] for q in self.per_question if style is None or q["style"] == style]
        out = mean(rows)
        out["n"] = len(rows)
        return out


def evaluate(name: str, ranker, questions: list[dict], ideal: dict[str, list[float]], build_ms: float) -> Result:
    result = Result(name, build_ms=build_ms)
    for question in questions:
        started = time.perf_counter()
        ranked = ranker.search(question["question"], TOP_K)
        result.latencies_ms.append((time.perf_counter() - started) * 1000.0)
        result.per_question.append({"id": question["id"], "style": question["style"],
                                    "scores": score_question(ranked, question["needs"], ideal[question["id"]]),
                                    "top": [f"{p.path}:{p.first}-{p.last}" for p in ranked[:3]]})
    result.note = getattr(ranker, "note", None)
    return result


def run(coffer, embedder_url: str | None = None, embedder_model: str = "all-MiniLM-L6-v2",
        embedder_api: str = "openai", progress=None) -> tuple[list[Result], str, int]:
    """All rankers on the corpus; returns (results, default engine name, passage count)."""
    questions = load_questions()
    results: list[Result] = []
    say = progress or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="coffer-ask-") as scratch:
        home = Path(scratch)
        engines = ["fts5", "bm25f"] if coffer.fts5_available() else ["bm25f"]
        default_engine = engines[0]
        built: dict[str, CofferRanker] = {}
        for engine in engines:
            say(f"indexing for coffer-{engine}")
            built[f"coffer-{engine}"] = CofferRanker(coffer, home, engine)
        passages = built[f"coffer-{default_engine}"].passages()
        ideal = {}
        refs = [PassageRef(p.path, p.lines[0], p.lines[1], p.text) for p in passages]
        for question in questions:
            ideal[question["id"]] = sorted((g for g in (gain(r, question["needs"]) for r in refs) if g), reverse=True)
        order = [f"coffer-{default_engine}"] + [n for n in built if n != f"coffer-{default_engine}"]
        for name in order:
            say(f"evaluating {name}")
            results.append(evaluate(name, built[name], questions, ideal, built[name].build_ms))
        if embedder_url:
            say("embedding the corpus for hybrid")
            try:
                embedder = coffer.Embedder(embedder_url, embedder_model, embedder_api)
                ranker = CofferRanker(coffer, home, default_engine, embedder)
                results.append(evaluate("hybrid", ranker, questions, ideal, ranker.build_ms))
            except RankerUnavailable as exc:
                results.append(Result("hybrid", error=str(exc)))
        chunks = plain_chunks()
        chunk_refs = [PassageRef(c.path, c.lines[0], c.lines[1], c.text) for c in chunks]
        chunk_ideal = {question["id"]: sorted((g for g in (gain(r, question["needs"]) for r in chunk_refs) if g),
                                              reverse=True) for question in questions}
        for name, factory in (("rank_bm25", RankBM25Ranker), ("bm25s", BM25SRanker),
                              ("sqlite-fts5", SqliteFtsRanker)):
            for label, units, best in ((name, passages, ideal), (f"{name}/{CHUNK_LINES}l", chunks, chunk_ideal)):
                say(f"evaluating {label}")
                try:
                    started = time.perf_counter()
                    ranker = factory(units)
                    build_ms = (time.perf_counter() - started) * 1000.0
                    results.append(evaluate(label, ranker, questions, best, build_ms))
                except RankerUnavailable as exc:
                    results.append(Result(label, error=str(exc)))
        for ranker in built.values():
            ranker.kb.close()
    return results, f"coffer-{default_engine}", len(passages)


def gate(results: list[Result], default: str) -> list[str]:
    """Failures: every (comparator, metric) where the comparator beats Coffer's default engine."""
    by_name = {r.ranker: r for r in results}
    mine = by_name[default].summary()
    failures = []
    for name in COMPARATORS:
        other = by_name.get(name)
        if other is None or other.error:
            continue
        theirs = other.summary()
        for metric in GATED:
            if theirs[metric] > mine[metric] + 1e-9:
                failures.append(f"{name} beats {default} on {metric}: {theirs[metric]:.3f} > {mine[metric]:.3f}")
    return failures


def render(results: list[Result], default: str, passages: int, questions: int) -> str:
    lines = [f"Knowledge retrieval: {questions} questions, {passages} passages (click 8.5.1 + flask 3.1.3 docs);"
             f" default engine = {default}; NAME/{CHUNK_LINES}l = the comparator on its own {CHUNK_LINES}-line chunks;"
             f" recall@Nl = recall in the first N lines returned", ""]
    header = f"{'ranker':<20}" + "".join(f"{m:>12}" for m in METRICS) + f"{'p50 ms':>9}{'p95 ms':>9}{'build ms':>10}"
    lines += [header, "-" * len(header)]
    for result in results:
        if result.error:
            lines.append(f"{result.ranker:<20}  unavailable: {result.error}")
            continue
        summary = result.summary()
        lines.append(f"{result.ranker + (' *' if result.ranker == default else ''):<20}"
                     + "".join(f"{summary[m]:>12.3f}" for m in METRICS)
                     + f"{percentile(result.latencies_ms, 50):>9.2f}{percentile(result.latencies_ms, 95):>9.2f}"
                     + f"{result.build_ms:>10.0f}" + (f"   ({result.note})" if result.note else ""))
    lines += ["", "* gated: Coffer's default engine, against each comparator on Coffer's passages. nDCG@10 by "
              "question style:", ""]
    names = [r.ranker for r in results if not r.error]
    lines.append(f"{'style':<12}{'n':>5}" + "".join(f"{n[:14]:>15}" for n in names))
    for style in STYLES:
        row = [r.summary(style) for r in results if not r.error]
        if row and row[0]["n"]:
            lines.append(f"{style:<12}{row[0]['n']:>5}" + "".join(f"{s['ndcg@10']:>15.3f}" for s in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", metavar="URL", help="OpenAI-compatible or Ollama embeddings endpoint")
    parser.add_argument("--embedder-model", default="all-MiniLM-L6-v2")
    parser.add_argument("--embedder-api", default="openai", choices=("openai", "ollama"))
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write results as JSON")
    parser.add_argument("--gate", action="store_true", help="exit 1 if a comparator beats Coffer's default")
    parser.add_argument("--draft", type=Path, help="load coffer.py plus this draft section")
    args = parser.parse_args(argv)
    coffer = load_coffer(args.draft)
    quiet = args.json == "-"
    results, default, passages = run(coffer, args.embedder, args.embedder_model, args.embedder_api,
                                     progress=None if quiet else (lambda m: print(f"  {m}...", file=sys.stderr)))
    questions = len(load_questions())
    failures = gate(results, default)
    if args.json:
        payload = {"default": default, "passages": passages, "questions": questions, "gate_failures": failures,
                   "results": [{"ranker": r.ranker, "error": r.error, "note": r.note, "build_ms": round(r.build_ms, 1),
                                "p50_ms": round(percentile(r.latencies_ms, 50), 3),
                                "p95_ms": round(percentile(r.latencies_ms, 95), 3),
                                "summary": r.summary() if not r.error else None,
                                "by_style": {s: r.summary(s) for s in STYLES} if not r.error else None}
                               for r in results]}
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n", encoding="utf-8")
    if not quiet:
        print(render(results, default, passages, questions))
        if failures:
            print("\nGATE: " + ("FAILED\n  " + "\n  ".join(failures) if args.gate else "would fail (not gating)\n  "
                                + "\n  ".join(failures)))
        elif args.gate:
            print(f"\nGATE: passed ({default} is at least as good as every comparator on {', '.join(GATED)})")
    return 1 if (args.gate and failures) else 0


if __name__ == "__main__":
    sys.exit(main())
