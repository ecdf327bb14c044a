"""evals/ask.py's reading-budget recall and plain chunking: what the comparison with plain BM25 rests on."""

from evals import ask


def ref(path, first, last):
    return ask.PassageRef(path, first, last, "")


def test_recall_at_a_reading_budget_reads_passages_in_rank_order_and_cuts_the_last_one():
    ranked = [ref("a.md", 1, 60), ref("b.md", 1, 60), ref("c.md", 1, 10)]
    read = ask.within_budget(ranked, 100)
    assert [(p.path, p.first, p.last) for p in read] == [("a.md", 1, 60), ("b.md", 1, 40)]
    inside = [[{"path": "b.md", "lines": [30, 35]}]]
    beyond = [[{"path": "b.md", "lines": [45, 50]}]]
    assert ask.score_question(ranked, inside, [1.0])["recall@100l"] == 1.0
    assert ask.score_question(ranked, beyond, [1.0])["recall@100l"] == 0.0
    assert ask.score_question(ranked, beyond, [1.0])["recall@5"] == 1.0   # what recall@k credits a long passage


def test_plain_chunks_cover_every_line_of_every_file_in_40_line_pieces(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("\n".join(f"line {i}" for i in range(1, 101)) + "\n")
    chunks = ask.plain_chunks(tmp_path)
    assert [(c.path, c.lines) for c in chunks] == [("docs/x.md", (1, 40)), ("docs/x.md", (41, 80)),
                                                  ("docs/x.md", (81, 100))]
    assert chunks[1].text.splitlines()[0] == "line 41"
