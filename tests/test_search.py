"""The BM25F ranker behind coffer__search_tools: tokenizer, stemmer, field weights, determinism, CJK, clamping."""

import json
import random

import pytest

import coffer


def tool(name, description="", **properties):
    return {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                               for k, v in properties.items()}}}


def names(hits):
    return [t["name"] for t, _ in hits]


@pytest.mark.parametrize("text, expected", [
    ("createIssue", ["creat", "issu"]),
    ("create_pull-request", ["creat", "pull", "request"]),
    ("files.list", ["fil", "list"]),
    ("getHTTPResponse", ["get", "http", "respons"]),
    ("Ｆｕｌｌｗｉｄｔｈ ＡＰＩ", ["fullwidth", "api"]),      # NFKC
    ("convert mp3 to base64 in 2024", ["convert", "mp3", "base64", "2024"]),   # numbers kept, stop words gone
])
def test_tokenizer_splits_identifiers_normalises_and_drops_stop_words(text, expected):
    assert coffer.tokenize(text) == expected


def test_stemmer_folds_the_forms_an_agent_uses_onto_the_forms_a_tool_uses():
    for group in (["create", "creates", "created", "creating"], ["list", "lists", "listed", "listing"],
                  ["query", "queries"], ["message", "messages"], ["translate", "translation"],
                  ["running", "run", "runs"]):
        assert len({coffer.stem(word) for word in group}) == 1, group
    assert coffer.stem("need") == "need" and coffer.stem("status") == "status"


def test_cjk_text_becomes_bigrams_so_chinese_and_japanese_queries_match():
    assert coffer.tokenize("搜索关键词") == ["搜索", "索关", "关键", "键词"]
    index = coffer.SearchIndex([
        tool("bing__bing_search", "使用必应搜索指定的关键词，并返回搜索结果列表"),
        tool("fs__read_file", "Read a file from disk"),
    ])
    assert names(index.search("搜索结果", 1)) == ["bing__bing_search"]
    # a Japanese query reaches an English tool through the built-in lexicon
    assert names(index.search("ファイルを読む", 1)) == ["fs__read_file"]


def test_name_tokens_outweigh_the_same_word_in_a_description():
    index = coffer.SearchIndex([
        tool("a__delete_branch", "Remove things from the repository"),
        tool("b__prune", "Delete a branch from the repository"),
    ])
    assert names(index.search("delete branch", 2)) == ["a__delete_branch", "b__prune"]


def test_parameter_names_and_enums_are_searchable():
    index = coffer.SearchIndex([
        {"name": "w__forecast", "description": "Weather outlook",
         "inputSchema": {"type": "object", "properties": {"units": {"type": "string", "enum": ["celsius"]}}}},
        tool("x__other", "Something unrelated"),
    ])
    assert names(index.search("celsius", 5)) == ["w__forecast"]


def test_equivalent_verbs_match_at_lower_weight_than_the_exact_word():
    index = coffer.SearchIndex([tool("a__remove_user", "Remove a user"), tool("b__delete_user", "Delete a user")])
    hits = index.search("delete user", 2)
    assert names(hits) == ["b__delete_user", "a__remove_user"] and hits[0][1] > hits[1][1] > 0


def test_ranking_is_deterministic_ties_broken_by_name_and_zero_scores_dropped():
    tools = [tool(f"s__same_{i}", "identical description") for i in range(10)] + [tool("z__zzz", "nothing")]
    shuffled = tools[:]
    random.Random(7).shuffle(shuffled)
    first = coffer.SearchIndex(tools).search("identical description", 20)
    second = coffer.SearchIndex(shuffled).search("identical description", 20)
    assert names(first) == names(second) == sorted(f"s__same_{i}" for i in range(10))
    assert "z__zzz" not in names(first)
    assert coffer.SearchIndex(tools).search("xylophone", 5) == []


def test_top_k_is_clamped_to_one_through_twenty():
    index = coffer.SearchIndex([tool(f"s__t{i}", "common word") for i in range(30)])
    assert len(index.search("common", 0)) == 1
    assert len(index.search("common", 500)) == 20


def test_scores_are_rounded_and_sorted():
    index = coffer.SearchIndex([tool("s__a", "alpha beta"), tool("s__b", "alpha"), tool("s__c", "beta gamma")])
    hits = index.search("alpha beta", 3)
    scores = [score for _, score in hits]
    assert scores == sorted(scores, reverse=True) and all(round(s, 4) == s for s in scores)


def test_search_tool_contract_through_the_gateway(raw_gateway, home):
    """Through `coffer serve`: structuredContent plus a JSON text block, bad arguments as isError results."""
    from conftest import FAKE, cli
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    gw = raw_gateway()
    gw.initialize()

    def search(arguments):
        return gw.request("tools/call", {"name": "coffer__search_tools", "arguments": arguments})["result"]

    result = search({"query": "echo the text back", "top_k": 2})
    payload = result["structuredContent"]
    assert json.loads(result["content"][0]["text"]) == payload
    assert payload["total_searched"] == 3 and payload["tools"][0]["name"] == "fx__echo"
    assert set(payload["tools"][0]) == {"name", "description", "inputSchema", "score"}
    assert len(search({"query": "echo", "top_k": 5.0})["structuredContent"]["tools"]) >= 1
    for bad in ({"query": ""}, {"query": 3}, {"query": "x", "top_k": "5"}, {"query": "x", "top_k": 2.5},
                {"query": "x", "top_k": True}, {}):
        assert search(bad).get("isError") is True, bad
