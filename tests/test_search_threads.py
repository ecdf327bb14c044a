"""The background threads of search and knowledge: the semantic ranker's embedder, the knowledge base's embedder
and watcher.  Each ends when its owner is closed, also while it waits out a retry backoff; a failed embedding
round is retried and then published.

The retry backoff is made an hour long where a test closes a thread during it: a close that did not cut the wait
short would leave the thread alive when close() gives up waiting, so the test fails instead of merely taking
longer."""

import threading

import pytest

from coffer_src.errors import CofferError
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.search import semantic
from coffer_src.search.index import SearchIndex
from coffer_src.search.semantic import EmbedderError, SemanticRanker

TOOLS = [{"name": "files__read_file", "description": "Read a file from disk"},
         {"name": "chat__post_message", "description": "Post a message to a channel"}]


class FakeEmbedder:
    """An embedder that fails its first ``failures`` calls, then answers with a vector per text; ``calls`` counts
    the calls and ``called`` is set by each."""

    cache_key = "fake:test"

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0
        self.called = threading.Event()
        self.answered = threading.Event()

    def embed(self, texts, timeout):
        self.calls += 1
        self.called.set()
        if self.calls <= self.failures:
            raise EmbedderError("the endpoint is down")
        self.answered.set()
        return [[1.0, float(len(text) % 7), 0.5] for text in texts]


def new_threads(before):
    return [thread for thread in threading.enumerate() if thread not in before]


@pytest.fixture
def long_backoff(monkeypatch):
    monkeypatch.setattr(semantic, "EMBED_RETRY_BASE", 3600.0)
    monkeypatch.setattr(semantic, "EMBED_RETRY_CEILING", 3600.0)


def test_closing_the_semantic_ranker_ends_its_thread_while_it_waits_to_retry(tmp_path, long_backoff):
    before = set(threading.enumerate())
    embedder = FakeEmbedder(failures=1_000)
    ranker = SemanticRanker(embedder, str(tmp_path / "coffer.db"), query_timeout=1.0)
    threads = new_threads(before)
    assert [thread.name for thread in threads] == ["coffer-embedder"]
    ranker.refresh(TOOLS)
    assert embedder.called.wait(30), "the embedder thread never tried"
    assert ranker.close(timeout=30)
    assert not threads[0].is_alive()
    # searches still answer, lexically
    index = SearchIndex(TOOLS)
    hits, ranker_name, note = ranker.search(index, "read a file", 1)
    assert ranker_name == "bm25" and hits[0][0]["name"] == "files__read_file" and note


def test_a_failed_embedding_round_is_retried_and_its_vectors_then_serve_hybrid_search(tmp_path, monkeypatch):
    monkeypatch.setattr(semantic, "EMBED_RETRY_BASE", 0.01)
    embedder = FakeEmbedder(failures=2)
    ranker = SemanticRanker(embedder, str(tmp_path / "coffer.db"), query_timeout=5.0)
    index = SearchIndex(TOOLS)
    ranker.refresh(index.tools)
    assert embedder.answered.wait(30), "the failed round was never retried"
    # close() returns once the thread has ended, and the thread ends only after the round under way published
    assert ranker.close(timeout=30)
    assert embedder.calls == 3
    hits, ranker_name, note = ranker.search(index, "read a file", 2)
    assert (ranker_name, note) == ("hybrid", None)
    assert {tool["name"] for tool, _ in hits} == {tool["name"] for tool in TOOLS}


def test_closing_the_knowledge_base_ends_its_embedder_and_its_watcher(tmp_path, long_backoff):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# Install\n\nRun the installer.\n", encoding="utf-8")
    home = tmp_path / "home"
    home.mkdir()
    before = set(threading.enumerate())
    embedder = FakeEmbedder(failures=1_000)
    kb = KnowledgeBase(str(home / "coffer.db"), str(home), engine="bm25f", embedder=embedder)
    kb.add_source(str(docs), name="docs")        # new passages: the embedder's next round fails, then waits
    kb.start_watcher(interval=3600.0)
    threads = new_threads(before)
    assert sorted(thread.name for thread in threads) == ["coffer-knowledge-embedder", "coffer-knowledge-watcher"]
    assert embedder.called.wait(30), "the embedder thread never tried"
    assert kb.search("installer")[0].path == "guide.md"   # answered lexically meanwhile
    assert kb.close(timeout=30)
    assert [thread.name for thread in threads if thread.is_alive()] == []


def test_a_closed_knowledge_base_refuses_to_write(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    kb = KnowledgeBase(str(home / "coffer.db"), str(home), engine="bm25f")
    assert kb.close()
    with pytest.raises(CofferError, match="closed"):
        kb.remember("the build needs Python 3.11")
