"""Checks the eval metrics on tiny hand-made rankings, so a wrong number in the eval table is never the harness's fault."""

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
