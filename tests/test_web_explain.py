"""search/explain: the search playground's explanation is the ranker's own arithmetic.  Its parts add up to the score
coffer__search_tools gives (over the dev sets' queries, so a change to SearchIndex.rank that the replay does not
follow fails here), and each part names the right words and fields."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root, for the dev sets in evals/

from coffer_src.search.explain import explain_search  # noqa: E402
from coffer_src.search.index import SearchIndex  # noqa: E402
from coffer_src.search.semantic import SemanticRanker  # noqa: E402
from evals import run  # noqa: E402

SAMPLE = 6   # every 6th query of each dev set: all of them take half a minute


def test_the_parts_add_up_to_the_rankers_score_on_the_dev_sets():
    sets, _ = run.discover_sets(run.parse_args([]))
    checked = 0
    for name, catalogue, queries in sets:
        loaded = run.load_set(name, catalogue, queries)
        index = SearchIndex(loaded.tools)
        for query in loaded.queries[::SAMPLE]:
            text = query["query"]
            explained = explain_search(index, None, text, 10)
            ranked = [(tool["name"], score) for tool, score in index.search(text, 10)]
            assert [(r["name"], r["score"]) for r in explained["results"]] == ranked, (name, text)
            for result in explained["results"]:
                assert result["exact"], (name, text, result["name"], result["score"], result["bm25"])
                checked += 1
    assert checked > 3000


def tool(name, description, **properties):
    return {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                             for k, v in properties.items()}}}


CATALOGUE = [
    tool("tracker__create_issue", "Create a new issue in a repository", title="The issue's title", repo="owner/name"),
    tool("tracker__list_issues", "List the issues of a repository", repo="owner/name"),
    tool("chat__post_message", "Post a message to a channel", channel="Channel name", text="What to say"),
    tool("files__read_file", "Read a file from disk", path="Path of the file to read"),
    tool("web__search", "Search the web for current information and news", query="What to look for"),
]


def parts(result, kind="term"):
    return {m["label"]: m for m in result["matches"] if m["kind"] == kind}


def test_each_part_names_its_words_fields_and_origin():
    index = SearchIndex(CATALOGUE)
    first = explain_search(index, None, "create an issue", 5)["results"][0]
    assert first["name"] == "tracker__create_issue" and first["exact"]
    terms = parts(first)
    assert terms["creat"]["how"] == "exact word" and terms["creat"]["words"] == ["create"]
    assert set(terms["creat"]["fields"]) == {"name", "description"}
    assert terms["issu"]["fields"]["name"] == 1 and "parameter descriptions" in terms["issu"]["fields"]
    assert parts(first, "server"), "the share of its server's best match is a part of its own"

    posted = explain_search(index, None, "send a message", 5)["results"][0]
    assert posted["name"] == "chat__post_message"
    related = [m for m in posted["matches"] if m["kind"] == "term" and m["how"].startswith("equivalent of")]
    assert any(m["label"] == "post" and m["words"] == ["send"] for m in related), posted["matches"]

    german = explain_search(index, None, "erstelle ein Ticket", 5)
    assert german["results"][0]["name"] == "tracker__create_issue"
    how = {m["label"]: m["how"] for m in german["results"][0]["matches"]}
    assert how["creat"].startswith("translation of erstelle"), how

    read = explain_search(index, None, "read ./src/main.py", 5)
    assert read["plan"]["arguments"] == ["path"]
    file_tool = next(r for r in read["results"] if r["name"] == "files__read_file")
    assert parts(file_tool, "argument")["path"]["words"] == ["./src/main.py"]


def test_with_an_embedder_the_shares_add_up_to_the_hybrid_score(tmp_path):
    class Embedder:
        cache_key = "test:letters"

        def embed(self, texts, timeout):
            vectors = []
            for text in texts:
                counts = [text.lower().count(c) + 0.01 for c in "abcdefghijklmnopqrstuvwxyz"]
                norm = sum(c * c for c in counts) ** 0.5
                vectors.append([c / norm for c in counts])
            return vectors

    ranker = SemanticRanker(Embedder(), str(tmp_path / "coffer.db"), query_timeout=5.0)
    try:
        index = SearchIndex(CATALOGUE)
        ranker.refresh(index.tools)
        ranker._worker.close()   # embed on this thread instead, so the test need not wait for the worker
        ranker._embed_catalogue()
        explained = explain_search(index, ranker, "post a note to the team channel", 5)
        assert explained["ranker"] == "hybrid"
        hits, _, _ = ranker.search(index, "post a note to the team channel", 5)
        assert [(r["name"], r["score"]) for r in explained["results"]] == [(t["name"], s) for t, s in hits]
        for result in explained["results"]:
            assert abs(result["lexical_share"] + result["semantic_share"] - result["score"]) < 2e-4, result
            assert result["exact"]
    finally:
        ranker.close()
