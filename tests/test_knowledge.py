"""Knowledge sources and memory (issue 14): splitting, incremental indexing, both storage engines, memory notes,
hostile files, and search finding the passage a user would want.

Everything runs on real files in tmp_path and a real coffer.db; the embedder tests talk to a real loopback HTTP
server.
"""

import hashlib
import json
import math
import os
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from coffer_src.errors import CofferError
from coffer_src.knowledge import ranking
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.knowledge.documents import KnowledgeLimits, split_passages
from coffer_src.knowledge.ranking import fts5_available
from coffer_src.search.semantic import Embedder

from conftest import POSIX, wait_until, write

ENGINES = ["bm25f"] + (["fts5"] if fts5_available() else [])


def kb_for(tmp_path, engine="bm25f", **kwargs):
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    return KnowledgeBase(str(home / "coffer.db"), str(home), engine=engine, **kwargs)


def bump_mtime(path: Path) -> None:
    """A new mtime even on filesystems with coarse timestamps."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


@pytest.fixture
def docs(tmp_path):
    root = tmp_path / "docs"
    write(root / "deploy.md", "# Deploying\n\nRun the app behind nginx with gunicorn workers.\n\n"
                              "## Rollback\n\nTo roll back, redeploy the previous tag with `make rollback`.\n")
    write(root / "guide" / "setup.rst", "Setup\n=====\n\nInstall the package with pip.\n\n"
                                        "Database\n--------\n\nThe database lives in PostgreSQL 16.\n")
    write(root / "notes.txt", "The office wifi password rotates every Monday.\n")
    return root


# ------------------------------------------------------------------------------------------------------------
# Splitting
# ------------------------------------------------------------------------------------------------------------

def test_markdown_passages_follow_headings_and_keep_code_blocks_whole():
    text = ("---\ntitle: ignored front matter\n---\n# Guide\n\nIntro paragraph.\n\n## Install\n\nRun this:\n\n"
            "```bash\n# not a heading\npip install thing\n\npip install other\n```\n\nSetext Title\n------------\n\n"
            "Under setext.\n")
    passages = split_passages(text, "markdown")
    lines = text.split("\n")
    for passage in passages:   # each passage is exactly its line range
        assert passage.text == "\n".join(lines[passage.first_line - 1:passage.last_line])
    by_heading = {p.heading: p for p in passages}
    assert set(by_heading) == {"Guide", "Guide > Install", "Guide > Setext Title"}
    install = by_heading["Guide > Install"]
    assert "# not a heading" in install.text and "pip install other" in install.text
    assert "ignored front matter" not in "".join(p.text for p in passages)


def test_rst_sections_levels_literal_blocks_and_directives():
    text = ("=====\nTitle\n=====\n\nIntro.\n\nFirst\n-----\n\nExample::\n\n    code line one\n\n"
            "    code line two\n\nDeeper\n~~~~~~\n\n.. note::\n\n   A note body\n\n   with two paragraphs.\n\n"
            "Second\n------\n\nMore text.\n")
    passages = split_passages(text, "rst")
    headings = [p.heading for p in passages]
    assert headings == ["Title", "Title > First", "Title > First > Deeper", "Title > Second"]
    first = passages[1]
    assert "code line one" in first.text and "code line two" in first.text
    assert "with two paragraphs." in passages[2].text


def test_passages_are_bounded_even_for_one_huge_line():
    limits = KnowledgeLimits(passage_chars=200, passage_max_chars=500)
    text = "# Big\n\n" + "word " * 2_000 + "\n\n" + "\n\n".join(f"paragraph {i} " * 5 for i in range(50))
    passages = split_passages(text, "markdown", limits)
    assert passages and all(len(p.text) <= 500 for p in passages)
    assert all(p.first_line <= p.last_line for p in passages)
    assert any("paragraph 49" in p.text for p in passages)
    hostile = split_passages("# " + "h" * 100_000 + "\n\nbody text\n", "markdown", limits)
    assert any("body text" in p.text for p in hostile)
    assert all(len(p.text) <= 500 and len(p.heading) <= 600 for p in hostile)


# ------------------------------------------------------------------------------------------------------------
# Indexing and search, on both engines
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_search_finds_the_passage_with_file_heading_and_lines(tmp_path, docs, engine):
    kb = kb_for(tmp_path, engine)
    stats = kb.add_source(str(docs), name="team")
    assert (stats.source, stats.files_added, stats.files_seen) == ("team", 3, 3)
    hit = kb.search("how do I roll back a deploy", top_k=3)[0]
    assert (hit.source, hit.path, hit.heading) == ("team", "deploy.md", "Deploying > Rollback")
    assert "make rollback" in hit.text and hit.lines[0] <= 5 <= hit.lines[1]
    assert kb.search("which database version", 1)[0].path == "guide/setup.rst"
    answer = kb.ask("wifi password", top_k=2)
    assert answer.total_searched == 5 and answer.passages[0].path == "notes.txt"
    assert answer.ranker == engine
    kb.close()


def test_both_engines_rank_the_eval_corpus_identically(tmp_path):
    if len(ENGINES) < 2:
        pytest.skip("this sqlite3 has no FTS5")
    corpus = Path(__file__).resolve().parent.parent / "evals" / "ask_data" / "corpus" / "click"
    kbs = {engine: kb_for(tmp_path / engine, engine) for engine in ENGINES}
    for kb in kbs.values():
        kb.add_source(str(corpus), name="click")
    for question in ("How do I count how many times -v was given?", "prompt for a password twice",
                     "testing a command with CliRunner", "UnicodeEncodeError on Windows"):
        ranked = {engine: [(h.path, h.lines) for h in kb.search(question, 5)] for engine, kb in kbs.items()}
        assert ranked["fts5"] == ranked["bm25f"], question
        assert ranked["fts5"], question


@pytest.mark.parametrize("engine", ENGINES)
def test_reindex_reads_only_changed_files(tmp_path, docs, engine):
    kb = kb_for(tmp_path, engine)
    kb.add_source(str(docs), name="team")
    untouched_before = [h for h in kb.passages() if h.path == "notes.txt"]
    again = kb.reindex("team")[0]
    assert (again.files_read, again.files_unchanged, again.passages_added) == (0, 3, 0)

    bump_mtime(docs / "notes.txt")   # touched, same bytes: read and hashed, not re-split
    touched = kb.reindex("team")[0]
    assert (touched.files_read, touched.files_changed, touched.passages_added) == (1, 0, 0)

    write(docs / "deploy.md", "# Deploying\n\nWe now deploy with blue-green switching on Kubernetes.\n")
    bump_mtime(docs / "deploy.md")
    (docs / "guide" / "setup.rst").unlink()
    write(docs / "new.md", "# Oncall\n\nThe pager rotation changes on Fridays.\n")
    changed = kb.reindex("team")[0]
    assert (changed.files_read, changed.files_changed, changed.files_added, changed.files_removed) == (2, 1, 1, 1)
    assert kb.search("blue-green kubernetes", 1)[0].path == "deploy.md"
    assert all("make rollback" not in h.text for h in kb.passages())
    assert all(h.path != "guide/setup.rst" for h in kb.passages())
    assert kb.search("pager rotation", 1)[0].path == "new.md"
    assert [h for h in kb.passages() if h.path == "notes.txt"] == untouched_before
    kb.close()


def test_changed_sees_edits_new_and_deleted_files_without_reading(tmp_path, docs):
    kb = kb_for(tmp_path)
    kb.add_source(str(docs), name="team")
    assert kb.changed() is False
    write(docs / "notes.txt", "The wifi password now rotates daily.\n")
    bump_mtime(docs / "notes.txt")
    assert kb.changed() is True
    kb.reindex()
    assert kb.changed() is False
    (docs / "notes.txt").unlink()
    assert kb.changed() is True
    kb.reindex()
    write(docs / "extra.md", "# Extra\n")
    assert kb.changed() is True
    kb.close()


def test_a_missing_root_keeps_its_index_until_it_is_back(tmp_path, docs):
    kb = kb_for(tmp_path)
    kb.add_source(str(docs), name="team")
    parked = docs.rename(tmp_path / "parked")   # like an unmounted drive
    stats = kb.reindex("team")[0]
    assert stats.files_removed == 0 and any(reason.startswith("root unreadable") for reason in stats.skipped)
    assert kb.changed() is False and kb.search("wifi password", 1)[0].path == "notes.txt"
    parked.rename(docs)
    (docs / "notes.txt").unlink()
    assert kb.changed() is True and kb.reindex("team")[0].files_removed == 1
    kb.close()


def test_watcher_picks_up_an_edit_without_a_restart(tmp_path, docs):
    kb = kb_for(tmp_path)
    kb.add_source(str(docs), name="team")
    kb.start_watcher(interval=0.1)
    write(docs / "notes.txt", "Lunch is served at noon in the atrium.\n")
    bump_mtime(docs / "notes.txt")
    wait_until(lambda: (hits := kb.search("where is lunch served", 1)) and "atrium" in hits[0].text, timeout=10,
               what="the watcher to reindex the edited file")
    kb.close()


def test_another_process_sees_the_index_and_a_python_without_fts5_keeps_it_consistent(tmp_path, docs, monkeypatch):
    if "fts5" not in ENGINES:
        pytest.skip("this sqlite3 has no FTS5")
    first = kb_for(tmp_path, "fts5")
    first.add_source(str(docs), name="team")
    first.close()
    # An interpreter without FTS5 opens the same vault: it indexes with its own engine and marks FTS stale.
    monkeypatch.setattr(ranking, "_FTS5_AVAILABLE", False)
    plain = kb_for(tmp_path, "auto")
    assert plain.engine == "bm25f"
    write(docs / "new.md", "# Parking\n\nVisitors park in lot C.\n")
    plain.reindex("team")
    assert plain.search("where do visitors park", 1)[0].path == "new.md"
    plain.close()
    monkeypatch.setattr(ranking, "_FTS5_AVAILABLE", True)
    again = kb_for(tmp_path, "fts5")   # rebuilds the stale FTS table on open
    assert again.search("where do visitors park", 1)[0].path == "new.md"
    again.close()


def test_sources_filter_list_and_remove(tmp_path, docs):
    kb = kb_for(tmp_path)
    other = tmp_path / "other"
    write(other / "a.md", "# Nginx\n\nOur nginx config lives in /etc/nginx/sites.\n")
    kb.add_source(str(docs), name="team")
    kb.add_source(str(other))
    assert {(s.name, s.files) for s in kb.sources()} == {("team", 3), ("other", 1)}
    assert {h.source for h in kb.search("nginx", 5)} == {"team", "other"}
    assert {h.source for h in kb.search("nginx", 5, sources=["other"])} == {"other"}
    with pytest.raises(CofferError, match="unknown knowledge source"):
        kb.search("nginx", sources=["nope"])
    with pytest.raises(CofferError, match="already exists"):
        kb.add_source(str(other), name="OTHER")
    kb.remove_source("other")
    assert [s.name for s in kb.sources()] == ["team"]
    assert {h.source for h in kb.search("nginx", 5)} == {"team"}
    kb.close()


def test_searches_on_threads_while_a_writer_reindexes(tmp_path, docs):
    kb = kb_for(tmp_path)
    kb.add_source(str(docs), name="team")
    errors, stop = [], threading.Event()

    def searcher():
        while not stop.is_set():
            try:
                kb.search("deploy rollback", 3)
            except Exception as exc:  # noqa: BLE001 - the test collects whatever goes wrong
                errors.append(exc)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for thread in threads:
        thread.start()
    for i in range(15):
        write(docs / f"gen{i}.md", f"# Generated {i}\n\nDeploy note number {i}.\n")
        kb.reindex("team")
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors
    assert kb.search("deploy note number 14", 1)[0].path == "gen14.md"
    kb.close()


# ------------------------------------------------------------------------------------------------------------
# Walking: ignore rules and hostile trees
# ------------------------------------------------------------------------------------------------------------

def test_gitignore_hidden_files_and_globs(tmp_path):
    root = tmp_path / "repo"
    write(root / ".gitignore", "build/\n*.log.md\n/secret.md\n!keep.log.md\n# comment\n")
    write(root / "readme.md", "# Readme\n\nvisible alpha\n")
    write(root / "build" / "out.md", "ignored beta\n")
    write(root / "debug.log.md", "ignored gamma\n")
    write(root / "keep.log.md", "kept delta\n")
    write(root / "secret.md", "ignored epsilon\n")
    write(root / "sub" / "secret.md", "kept zeta (the rule is anchored)\n")
    write(root / ".hidden" / "x.md", "ignored eta\n")
    write(root / ".dot.md", "ignored theta\n")
    write(root / "code.py", "ignored iota\n")
    write(root / "sub" / ".gitignore", "local.md\n")
    write(root / "sub" / "local.md", "ignored kappa\n")
    kb = kb_for(tmp_path)
    kb.add_source(str(root), name="repo")
    paths = {h.path for h in kb.passages()}
    assert paths == {"readme.md", "keep.log.md", "sub/secret.md"}
    kb.close()
    only_rst = kb_for(tmp_path / "second")
    write(root / "doc.rst", "Title\n=====\n\nlambda\n")
    only_rst.add_source(str(root), name="rst", globs=["**/*.rst"])
    assert {h.path for h in only_rst.passages()} == {"doc.rst"}
    only_rst.close()


def test_hostile_files_are_skipped_or_bounded(tmp_path):
    root = tmp_path / "hostile"
    write(root / "ok.md", "# Fine\n\nordinary words here\n")
    (root / "binary.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00junk" * 100)
    (root / "latin1.md").write_bytes("# Caf\xe9\n\nthe menu lists cr\xeape and fondue\n".encode("latin-1"))
    with open(root / "huge.md", "wb") as handle:   # 50 MB, sparse: costs no disk
        handle.truncate(50 << 20)
    deep = root
    for level in range(40):
        deep = deep / f"d{level}"
    write(deep / "deep.md", "too deep to reach\n")
    if POSIX:
        write(tmp_path / "outside" / "secret.md", "outside the root\n")
        os.symlink(tmp_path / "outside", root / "link-out")
        os.symlink(tmp_path / "outside" / "secret.md", root / "file-link.md")
        os.symlink(root, root / "loop")
        write(root / "bad\nname.md", "control character in the name\n")
        write(root / "esc\x1b[31m.md", "escape sequence in the name\n")
        os.mkfifo(root / "pipe.md")   # never opened: reading it would block forever
    kb = kb_for(tmp_path)
    stats = kb.add_source(str(root), name="hostile")
    paths = {h.path for h in kb.passages()}
    assert paths == {"ok.md", "latin1.md"}
    assert "fondue" in kb.search("fondue", 1)[0].text
    assert stats.skipped.get("binary") == 1 and stats.skipped.get("too large") == 1
    assert stats.skipped.get("too deep", 0) >= 1
    if POSIX:
        assert stats.skipped.get("symlink outside the root") == 2
        assert stats.skipped.get("bad file name") == 2
    assert stats.files_read == 3   # ok, latin1, binary: the 50 MB file is never read
    again = kb.reindex("hostile")[0]
    assert again.files_read == 0 and kb.changed() is False   # skipped files are remembered, not re-read
    kb.close()


def test_walk_limits_bound_a_huge_tree(tmp_path, caplog):
    root = tmp_path / "many"
    for i in range(300):
        write(root / f"f{i:04d}.md", f"file number {i}\n")
    kb = kb_for(tmp_path, limits=KnowledgeLimits(max_files=100))
    with caplog.at_level("WARNING", logger="coffer_src"):
        stats = kb.add_source(str(root), name="many")
    assert stats.files_seen == 100 and stats.skipped.get("over the walk limits") == 1
    assert any("walk limits" in record.getMessage() for record in caplog.records)
    kb.close()


# ------------------------------------------------------------------------------------------------------------
# Memory notes
# ------------------------------------------------------------------------------------------------------------

def test_remember_writes_a_private_markdown_note_that_search_finds(tmp_path):
    kb = kb_for(tmp_path)
    note_id = kb.remember("The staging database password is in the team vault under 'stg-db'.",
                          tags=["staging", "db"], client="claude-code\n\x1b[2J")
    path = tmp_path / "home" / "memory" / f"{note_id}.md"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\n") and f"id: {note_id}" in text and 'tags: ["staging", "db"]' in text
    assert "\x1b" not in text and text.count("\n---\n") == 1   # the client name cannot break the front matter
    if POSIX:
        assert (path.stat().st_mode & 0o777) == 0o600
        assert ((tmp_path / "home" / "memory").stat().st_mode & 0o777) == 0o700
    hit = kb.search("where is the staging db password", 1)[0]
    assert hit.source == "memory" and "team vault" in hit.text and "staging" in hit.heading
    note = kb.memory(note_id)
    assert note.tags == ("staging", "db") and note.client.startswith("claude-code") and "stg-db" in note.text
    assert [n.id for n in kb.memories()] == [note_id]
    kb.memory_enabled = False   # memory off: notes stay out of unfiltered searches
    assert all(h.source != "memory" for h in kb.search("staging db password", 5))
    assert kb.search("staging db password", 5, sources=["memory"])
    assert kb.forget(note_id) is True and kb.forget(note_id) is False
    assert not path.exists() and kb.search("staging db password", 5, sources=["memory"]) == []
    kb.close()


def test_memory_rejects_bad_input_and_path_tricks(tmp_path):
    kb = kb_for(tmp_path)
    for bad in ("", "   ", "x" * 20_000):
        with pytest.raises(CofferError):
            kb.remember(bad)
    with pytest.raises(CofferError, match="tags"):
        kb.remember("fine", tags=["has space"])
    for bad_id in ("../coffer", "20260101T000000Z-abc123/../../x", "nope"):
        with pytest.raises(CofferError, match="bad memory id"):
            kb.memory(bad_id)
        with pytest.raises(CofferError, match="bad memory id"):
            kb.forget(bad_id)
    with pytest.raises(CofferError, match="reserved"):
        kb.add_source(str(tmp_path), name="memory")
    kb.close()


def test_a_hand_edited_note_is_reindexed(tmp_path):
    kb = kb_for(tmp_path)
    note_id = kb.remember("Standup moved to 9:30.", tags=["team"])
    path = tmp_path / "home" / "memory" / f"{note_id}.md"
    path.write_text(path.read_text(encoding="utf-8").replace("9:30", "10:15 in room Aurora"), encoding="utf-8")
    bump_mtime(path)
    assert kb.changed()
    kb.reindex()
    assert "Aurora" in kb.search("standup room", 1)[0].text
    kb.close()


# ------------------------------------------------------------------------------------------------------------
# Hybrid ranking with an embedder, and the fallback when it fails
# ------------------------------------------------------------------------------------------------------------

class _Embeddings(BaseHTTPRequestHandler):
    """OpenAI-style /embeddings: hashed bag-of-words vectors, plus 'holiday' and 'vacation' made synonyms."""

    requests = 0
    texts = 0

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests += 1
        type(self).texts += len(body["input"])
        data = [{"index": i, "embedding": _vector(text)} for i, text in enumerate(body["input"])]
        payload = json.dumps({"data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _vector(text: str) -> list[float]:
    vector = [0.0] * 64
    for word in text.lower().replace("?", " ").replace(".", " ").split():
        word = "vacation" if word in ("holiday", "holidays", "vacations") else word
        vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


@pytest.fixture
def embed_server():
    _Embeddings.requests = _Embeddings.texts = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Embeddings)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hybrid_uses_cached_passage_vectors(tmp_path, docs, embed_server):
    write(docs / "hr.md", "# Leave\n\nEach employee gets 30 vacation days per year.\n")
    embedder = Embedder(embed_server, "toy")
    kb = kb_for(tmp_path, embedder=embedder)
    kb.add_source(str(docs), name="team")
    kb.ensure_vectors()
    embedded = _Embeddings.texts
    answer = kb.ask("how many holiday days do I get", 2)
    assert answer.ranker.endswith("+hybrid") and answer.note is None
    assert answer.passages[0].path == "hr.md"
    kb.close()
    with sqlite3.connect(tmp_path / "home" / "coffer.db") as db:
        cached = db.execute("SELECT count(*) FROM embeddings WHERE model=?", (embedder.cache_key,)).fetchone()[0]
    assert cached == len(list(kb_for(tmp_path).passages()))
    again = kb_for(tmp_path, embedder=embedder)
    again.ensure_vectors()
    assert _Embeddings.texts == embedded + 1   # only the question of the first ask: passages came from the cache
    again.close()


def test_embedder_failure_falls_back_to_lexical(tmp_path, docs):
    dead = Embedder("http://127.0.0.1:9", "toy")   # discard port: refused
    kb = kb_for(tmp_path, embedder=dead, query_timeout=0.5)
    kb.add_source(str(docs), name="team")
    answer = kb.ask("roll back a deploy", 1)
    assert answer.passages[0].heading == "Deploying > Rollback"
    assert answer.ranker == "bm25f" and answer.note
    kb.close()
