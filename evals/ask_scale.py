"""Knowledge scale check: index ~10k passages and time search, without an embedder.

    python -m evals.ask_scale [--copies 12] [--draft PATH] [--json]

The eval corpus (about 840 passages) is copied ``--copies`` times into a temporary folder (each copy in its own
subfolder, so document frequencies grow as in a larger real corpus), indexed as one source by each storage
engine, then the eval's 269 questions are asked.  Targets from issue 14: 10k passages indexed in <= 10 s and a
search p50 <= 20 ms.  Also timed: a no-op reindex (every file unchanged: stat only), ``changed()`` (the watcher's
poll), and re-indexing after one file changed.  Numbers depend on the machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from evals import ask  # noqa: E402


def timed(function):
    started = time.perf_counter()
    value = function()
    return value, (time.perf_counter() - started) * 1000.0


def measure(coffer, engine: str, corpus: Path, home: Path, questions: list[str]) -> dict:
    kb = coffer.KnowledgeBase(str(home / f"{engine}.db"), str(home), engine=engine)
    stats, index_ms = timed(lambda: kb.add_source(str(corpus), name="scale"))
    _, first_search_ms = timed(lambda: kb.search(questions[0], 5))   # includes loading the in-memory index
    latencies = []
    for question in questions:
        _, ms = timed(lambda: kb.search(question, 5))
        latencies.append(ms)
    _, noop_ms = timed(lambda: kb.reindex("scale"))
    changed, changed_ms = timed(kb.changed)
    target = next(corpus.rglob("*.md"))
    target.write_text(target.read_text(encoding="utf-8") + "\n\nA late paragraph about zebra crossings.\n",
                      encoding="utf-8")
    _, one_file_ms = timed(lambda: kb.reindex("scale"))
    _, after_edit_ms = timed(lambda: kb.search("zebra crossings", 5))
    kb.close()
    return {"engine": engine, "files": stats.files_seen, "passages": stats.passages_added,
            "index_ms": round(index_ms), "search_p50_ms": round(ask.percentile(latencies, 50), 2),
            "search_p95_ms": round(ask.percentile(latencies, 95), 2), "first_search_ms": round(first_search_ms, 1),
            "noop_reindex_ms": round(noop_ms, 1), "changed_ms": round(changed_ms, 1), "changed": changed,
            "one_file_reindex_ms": round(one_file_ms, 1), "search_after_edit_ms": round(after_edit_ms, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=12)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    coffer = ask.load_coffer(args.draft)
    questions = [q["question"] for q in ask.load_questions()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="coffer-ask-scale-") as scratch:
        corpus = Path(scratch) / "corpus"
        for copy in range(args.copies):
            shutil.copytree(ask.CORPUS_DIR, corpus / f"copy{copy:02d}")
        engines = ["fts5", "bm25f"] if coffer.fts5_available() else ["bm25f"]
        for engine in engines:
            home = Path(scratch) / f"home-{engine}"
            os.makedirs(home)
            rows.append(measure(coffer, engine, corpus, home, questions))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    keys = list(rows[0])
    width = max(len(k) for k in keys)
    print(f"{'':<{width}}" + "".join(f"{row['engine']:>12}" for row in rows))
    for key in keys[1:]:
        print(f"{key:<{width}}" + "".join(f"{str(row[key]):>12}" for row in rows))
    print("\ntargets (issue 14): index 10k passages <= 10000 ms; search p50 <= 20 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
