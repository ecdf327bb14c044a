"""What the knowledge base's analyser keeps of a documentation question (issue 27): distinct technical terms stay
distinct, and the keywords that name programming constructs are words idf weighs, not stop words."""

from pathlib import Path

import pytest

from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.knowledge.ranking import fts5_available
from coffer_src.search.text import knowledge_terms, stem

ENGINES = ["bm25f"] + (["fts5"] if fts5_available() else [])


def ask(tmp_path, engine, files, question, k=3):
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    docs = tmp_path / "docs"
    for name, text in files.items():
        path = Path(docs / name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    kb = KnowledgeBase(str(home / "coffer.db"), str(home), engine=engine)
    try:
        kb.add_source(str(docs), name="docs")
        return [hit.heading for hit in kb.ask(question, k).passages]
    finally:
        kb.close()


@pytest.mark.parametrize("word, other", [("string", "str"), ("strings", "str"), ("spring", "spr"),
                                         ("shred", "shr")])
def test_ing_and_ed_are_stripped_only_when_a_vowel_remains(word, other):
    assert stem(word) != stem(other)
    assert stem("running") == stem("run") and stem("added") == stem("add")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rare_exact_term_does_not_share_its_weight_with_a_common_word(tmp_path, engine):
    files = {"types.md": "# Builtins\n\n## The str type\n\nCall str() on a value: str(x) gives the str of x, and "
                         "every str has methods.\n\n## The bytes type\n\nbytes hold raw data.\n",
             "text.md": "# Text\n\n## String interpolation\n\nA string with braces is filled in from the "
                        "arguments.\n"}
    assert ask(tmp_path, engine, files, "string", 1) == ["Text > String interpolation"]


@pytest.mark.parametrize("engine", ENGINES)
def test_programming_keywords_in_a_question_are_searched_for(tmp_path, engine):
    # "how does for...in differ from for...of?" was read as "differ" alone.
    files = {"loops.md": "# Loops\n\n## for...in\n\nThe for...in statement iterates over the enumerable property "
                         "names of an object: for (key in object).\n\n## for...of\n\nThe for...of statement "
                         "iterates over the values of an iterable: for (value of array).\n",
             "history.md": "# History\n\n## Versions\n\nThe versions differ in many small ways; the changelog says "
                           "how they differ.\n"}
    top = ask(tmp_path, engine, files, "how does for…in differ from for…of?", 2)
    assert "Loops > for...in" in top, top
    terms = knowledge_terms("where does let differ from var")
    assert stem("where") in terms and stem("let") in terms
