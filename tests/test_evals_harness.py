"""Checks the eval metrics on tiny hand-made rankings, so a wrong number in the eval table is never the harness's
fault."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root, for `pytest` run from anywhere


from evals import metrics  # noqa: E402
from evals.run import main  # noqa: E402


def groups(*gs):
    return [set(g) for g in gs]


def test_query_groups_single_need_is_one_group():
    q = {"query": "web search", "relevant": ["brave__search", "tavily__search"]}
    assert metrics.query_groups(q) == [{"brave__search", "tavily__search"}]


def test_query_groups_uses_explicit_groups():
    q = {"query": "x", "relevant": ["a", "b", "c"], "groups": [["a"], ["b", "c"]]}
    assert metrics.query_groups(q) == [{"a"}, {"b", "c"}]


def test_recall_single_need_is_hit_at_k():
    g = groups({"a", "b"})
    assert metrics.recall_at_k(["x", "b", "a"], g, 1) == 0.0
    assert metrics.recall_at_k(["x", "b", "a"], g, 2) == 1.0


def test_recall_with_groups_counts_satisfied_groups():
    g = groups({"a"}, {"b", "c"}, {"d"})
    ranked = ["c", "x", "a", "y", "z", "d"]
    assert metrics.recall_at_k(ranked, g, 1) == pytest.approx(1 / 3)
    assert metrics.recall_at_k(ranked, g, 5) == pytest.approx(2 / 3)
    assert metrics.recall_at_k(ranked, g, 10) == 1.0


def test_mrr_first_hit_at_rank_three():
    assert metrics.mrr_at_k(["x", "y", "a", "b"], groups({"a"}, {"b"}), 10) == pytest.approx(1 / 3)


def test_mrr_zero_when_outside_cutoff():
    ranked = [f"t{i}" for i in range(10)] + ["a"]
    assert metrics.mrr_at_k(ranked, groups({"a"}), 10) == 0.0


def test_ndcg_perfect_ranking_is_one():
    assert metrics.ndcg_at_k(["a", "b", "c"], groups({"a"}, {"b"}, {"c"}), 10) == pytest.approx(1.0)


def test_ndcg_duplicate_member_of_satisfied_group_gains_nothing():
    # "b" repeats group 1's need, so group 2 ("c") is only met at rank 3.
    got = metrics.ndcg_at_k(["a", "b", "c"], groups({"a", "b"}, {"c"}), 10)
    ideal = 1 + 1 / math.log2(3)
    assert got == pytest.approx((1 + 1 / math.log2(4)) / ideal)


def test_ndcg_single_hit_at_rank_two():
    assert metrics.ndcg_at_k(["x", "a"], groups({"a"}), 10) == pytest.approx(1 / math.log2(3))


def test_empty_ranking_scores_zero():
    scores = metrics.score_query([], groups({"a"}))
    assert all(v == 0.0 for v in scores.values())


def test_percentile_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 95) == 5.0


def test_run_on_tiny_external_set(tmp_path, capsys):
    catalog = tmp_path / "catalog.jsonl"
    queries = tmp_path / "queries.jsonl"
    catalog.write_text('{"name": "weather__get_forecast", "description": "Get weather forecast", "inputSchema": {}}\n'
                       '{"name": "git__git_commit", "description": "Record changes", "inputSchema": {}}\n')
    queries.write_text('{"query": "weather forecast", "relevant": ["weather__get_forecast"]}\n')
    code = main(["--catalog", str(catalog), "--queries", str(queries), "--name", "tiny",
                 "--rankers", "rank_bm25", "--no-gate"])
    assert code == 0
    assert "tiny" in capsys.readouterr().out


# ---------------------------------------------------------------- the plain BM25F reference and the gate rules

from evals import run as eval_run  # noqa: E402
from evals.rankers import PlainBM25F  # noqa: E402

TINY_CATALOG = (
    '{"name": "weather__get_forecast", "description": "Get the weather forecast for a city", "inputSchema": '
    '{"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}}}\n'
    '{"name": "git__git_commit", "description": "Record changes to the repository", "inputSchema": {}}\n'
    '{"name": "fs__read_file", "description": "Read a file from disk", "inputSchema": '
    '{"type": "object", "properties": {"path": {"type": "string"}}}}\n')
TINY_QUERIES = ('{"query": "weather forecast for Paris", "relevant": ["weather__get_forecast"]}\n'
                '{"query": "commit the changes", "relevant": ["git__git_commit"]}\n')


def tiny_set(tmp_path):
    catalog, queries = tmp_path / "catalog.jsonl", tmp_path / "queries.jsonl"
    catalog.write_text(TINY_CATALOG, encoding="utf-8")
    queries.write_text(TINY_QUERIES, encoding="utf-8")
    return ["--catalog", str(catalog), "--queries", str(queries), "--name", "tiny"]


@pytest.fixture
def isolated_sets(tmp_path, monkeypatch):
    """Empty data folders and a private baseline folder, so no repo set or ../shared set leaks in."""
    for attr in ("PROJECT_DIR", "SETS_DIR", "SHARED_DIR", "BASELINE_DIR"):
        folder = tmp_path / attr.lower()
        folder.mkdir()
        monkeypatch.setattr(eval_run, attr, folder)
    return tmp_path


def test_plain_bm25f_weighs_names_triple_and_does_not_stem():
    tools = [{"name": "a__notes", "description": "keep text", "inputSchema": {}},
             {"name": "b__keep", "description": "notes about notes", "inputSchema": {}},
             {"name": "c__file_reader", "description": "opens a file", "inputSchema": {}}]
    index = PlainBM25F(tools)
    assert [t["name"] for t, _ in index.search("notes", 3)] == ["a__notes", "b__keep"]
    assert index.search("files", 3) == []          # no stemming: "files" is not "file"
    assert [t["name"] for t, _ in index.search("reader", 3)] == ["c__file_reader"]   # identifiers are split


def test_a_set_with_data_but_no_baseline_fails_the_gate_unless_allowed(isolated_sets, capsys):
    args = tiny_set(isolated_sets) + ["--rankers", "coffer"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "has data but no baseline" in out and "gate FAILED" in out and "tiny" in out
    assert main(args + ["--allow-missing-sets"]) == 0
    assert "gate passed for coffer on 1 set(s): tiny" in capsys.readouterr().out


def test_a_set_with_a_baseline_but_no_data_fails_the_gate(isolated_sets, capsys):
    (eval_run.BASELINE_DIR / "ghost.json").write_text(json.dumps(
        {"set": "ghost", "metrics": {"ndcg@10": 0.5}, "tolerance": 0.02}), encoding="utf-8")
    (eval_run.PROJECT_DIR / "catalog.jsonl").write_text(TINY_CATALOG, encoding="utf-8")
    (eval_run.PROJECT_DIR / "queries.jsonl").write_text(TINY_QUERIES, encoding="utf-8")
    assert main(["--rankers", "coffer", "--update-baselines"]) == 0      # project gets its baseline
    capsys.readouterr()
    assert main(["--rankers", "coffer"]) == 1
    out = capsys.readouterr().out
    assert "set ghost: has a baseline but no data" in out
    assert "on 1 set(s): project" in out
    assert main(["--rankers", "coffer", "--allow-missing-sets"]) == 0


def test_no_set_at_all_never_passes(isolated_sets, capsys):
    assert main(["--rankers", "coffer"]) == 1
    assert "no set ran" in capsys.readouterr().out


BAD_DRAFT = '''
class SearchIndex:
    """A ranker that finds nothing: the gate must catch it against the plain reference."""
    def __init__(self, tools):
        self.tools = tools
    def search(self, query, top_k=5):
        return []
'''


def test_a_draft_that_loses_to_plain_bm25f_fails_the_gate_and_compare_shows_the_delta(isolated_sets, capsys):
    draft = isolated_sets / "draft.py"
    draft.write_text(BAD_DRAFT, encoding="utf-8")
    args = tiny_set(isolated_sets) + ["--rankers", "coffer", "--allow-missing-sets", "--draft", str(draft)]
    assert main(args + ["--gate-ranker", "draft", "--compare", "coffer"]) == 1
    out = capsys.readouterr().out
    assert "draft nDCG@10 0.0000 loses to plain bm25f" in out
    compare = out[out.index("compare:"):]
    assert "tiny" in compare and "-1.000/-1.000!" in compare      # the draft's per-set delta to coffer
    assert main(args) == 0                                           # coffer itself is still fine


def test_a_variant_overrides_one_knob_of_the_draft(isolated_sets, capsys):
    draft = isolated_sets / "draft.py"
    draft.write_text("class SearchIndex(SearchIndex):\n    ENABLED = True\n"
                     "    def search(self, query, top_k=5):\n"
                     "        return super().search(query, top_k) if self.ENABLED else []\n", encoding="utf-8")
    args = tiny_set(isolated_sets) + ["--rankers", "coffer", "--no-gate", "--draft", str(draft),
                                      "--variant", "off:SearchIndex.ENABLED=False", "--json", "-"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    rankers = doc["sets"][0]["rankers"]
    assert rankers["draft"]["overall"]["ndcg@10"] == rankers["coffer"]["overall"]["ndcg@10"] > 0
    assert rankers["off"]["overall"]["ndcg@10"] == 0.0
