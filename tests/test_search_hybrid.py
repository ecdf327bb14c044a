"""Hybrid search never below lexical (issue 27): what the embedder is given to read, and when it is not asked.

An in-process embedder stands in for the endpoint (the HTTP plumbing is tests/test_semantic.py's); the quality
check with a real model is `python -m evals.run --embedder URL`."""

import hashlib
import time

import pytest
import search_catalogues as sc

from coffer_src.search.index import SearchIndex
from coffer_src.search.semantic import Embedder, SemanticRanker, _unit
from coffer_src.search.text import tokenize


class RecordingEmbedder(Embedder):
    """Deterministic bag-of-words vectors; remembers every text it was asked to embed."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9/v1", "stub")
        self.texts = []

    def embed(self, texts, timeout):
        self.texts.extend(texts)
        vectors = []
        for text in texts:
            vector = [0.0] * 64
            for word in tokenize(text) or ["empty"]:
                vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1.0
            vectors.append(_unit(vector))
        return vectors


@pytest.fixture
def ranker(tmp_path):
    tools = sc.merged()
    lexical = SearchIndex(tools)
    embedder = RecordingEmbedder()
    semantic = SemanticRanker(embedder, str(tmp_path / "coffer.db"), query_timeout=5.0)
    semantic.refresh(lexical.tools)
    deadline = time.monotonic() + 30
    while semantic.index is None and time.monotonic() < deadline:  # the worker thread embeds the catalogue
        time.sleep(0.01)
    assert semantic.index is not None
    embedder.texts.clear()
    yield lexical, semantic, embedder
    semantic.close()


def test_the_embedder_reads_the_english_words_coffer_found_in_a_foreign_request(ranker):
    lexical, semantic, embedder = ranker
    hits, used, _ = semantic.search(lexical, "東京の現在時刻を教えて", 5)
    assert used == "hybrid"
    [text] = embedder.texts
    assert text.startswith("東京の現在時刻を教えて")
    assert {"current", "time"} <= set(text.replace("(", " ").replace(")", " ").split())
    semantic.search(lexical, "what time is it in Tokyo", 5)
    assert embedder.texts[-1] == "what time is it in Tokyo"       # nothing to add to an English request


@pytest.mark.parametrize("query", ["OPS-1234", "AAPL", "https://example.com/pricing", "./src/app.py"])
def test_a_request_that_is_nothing_but_arguments_is_answered_by_bm25_without_asking_the_embedder(ranker, query):
    # A sentence model reads only the argument's text ("pricing" -> price tools); the lexical ranker matches the
    # argument to the parameters that take it.
    lexical, semantic, embedder = ranker
    hits, used, note = semantic.search(lexical, query, 5)
    assert (used, note, embedder.texts) == ("bm25", None, [])
    assert [tool["name"] for tool, _ in hits] == [tool["name"] for tool, _ in lexical.search(query, 5)]


def test_a_request_with_words_besides_its_arguments_is_still_hybrid(ranker):
    lexical, semantic, embedder = ranker
    _, used, _ = semantic.search(lexical, "links on https://news.ycombinator.com", 5)
    assert used == "hybrid" and embedder.texts == ["links on https://news.ycombinator.com"]


def test_an_argument_kind_no_tool_takes_is_a_word_the_embedder_reads():
    index = SearchIndex(sc.merged(sc.FINANCE))  # no tool takes a ticker: "KQL" is a word, not an argument
    assert not index.reading("KQL").only_arguments
    assert SearchIndex(sc.merged()).reading("KQL").only_arguments
