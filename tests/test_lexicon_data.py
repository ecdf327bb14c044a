"""The search word lists (src/coffer_src/search/words/*.txt) checked as data: well-formed lines, no key listed
twice, keys written as the analyser yields them, and every target an index term.

Definitions the checks rely on (the same words as the files' headers):

- a *key* is what a table is looked up by: it must be written as the analyser yields it from a text (NFKC-normalised,
  lowercase) and be something the analyser can yield at all: one word (``split_words(key) == [key]``) or, in the
  multilingual lexicon, a run of CJK characters (such keys match anywhere inside a longer run);
- a *target* word W is an *index term* for an analyser when that analyser, reading W in a text, keeps it as exactly
  one term, the term the table contributes for it: ``tokenize(W) == [stem(W)]`` for tool search,
  ``knowledge_terms(W) == (stem(W),)`` for the knowledge base.  A stop word, two words glued by punctuation or a
  camel-case word fails this: a translation to it could never meet the word in a tool's or a document's text.
  Abbreviations and equivalences serve tool search only, so their words must be tool-search index terms; the
  multilingual lexicon and the German verbs serve both, so a target must be an index term for one of them
  (サーバー = server: "server" is a tool-search stop word, and a word documentation needs).
"""

import re
import unicodedata
from pathlib import Path

import pytest

from coffer_src.search import lexicon
from coffer_src.search.text import (
    ABBREVIATIONS,
    EQUIVALENCES,
    inflection_stem,
    knowledge_terms,
    split_words,
    stem,
    tokenize,
)

WORDS_DIR = Path(lexicon.__file__).resolve().parent / "words"
LEXICON_SOURCE = Path(lexicon.__file__).read_text(encoding="utf-8")
CJK_KEY_RE = re.compile(r"[\u3041-\u3096\u309d-\u309f\u30a1-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                        r"\uac00-\ud7a3\uf900-\ufaff]+")   # search/text.py: _CJK_WORD_RE

# file name (or pattern) -> its kind: a list of words, a KEY = WORD... table, groups of words, irregular forms
KINDS = {
    "stop_words.txt": "words",
    "knowledge_keeps.txt": "words",
    "german_particles.txt": "words",
    "irregular.txt": "irregular",
    "equivalences.txt": "groups",
    "abbreviations.txt": "table",
    "german_separable_verbs.txt": "table",
    "verb_senses.txt": "senses",
}
LEXICON_FILES = sorted(p.name for p in WORDS_DIR.glob("lexicon_*.txt"))
# Which analyser must keep a target as an index term (see the module docstring).
TOOL_SEARCH_ONLY = {"abbreviations.txt", "equivalences.txt", "verb_senses.txt"}


def kind_of(name: str) -> str:
    return "table" if name.startswith("lexicon_") else KINDS[name]


def normal(text: str) -> bool:
    return unicodedata.normalize("NFKC", text).lower() == text


def tool_search_term(word: str) -> bool:
    return tokenize(word) == [stem(word)]


def knowledge_term(word: str) -> bool:
    return knowledge_terms(word) == (stem(word),)


def is_word(word: str) -> bool:
    """The analyser's splitter yields ``word`` from a text, as itself and whole."""
    return split_words(word) == [word]


def parse(name: str, text: str) -> tuple[list[tuple[int, str, tuple[str, ...]]], list[str]]:
    """(line, key, words) of each entry of a word file, and the problems of its form.  For a list of words the
    key is the word and words is empty; for a group, the key is the group's first word and words all of them."""
    problems, entries = [], []
    if not text.endswith("\n"):
        problems.append(f"{name}: the last line has no newline")
    kind = kind_of(name)
    for number, entry in lexicon.word_file_entries(text):
        where = f"{name}:{number}"
        if kind == "words":
            if len(entry.split()) != 1 or "=" in entry:
                problems.append(f"{where}: one word a line, not {entry!r}")
                continue
            entries.append((number, entry, ()))
        elif kind == "groups":
            words = tuple(entry.split())
            if "=" in entry or len(words) < 2:
                problems.append(f"{where}: a group is two or more words separated by spaces, not {entry!r}")
                continue
            entries.append((number, words[0], words))
        elif kind == "senses":  # VERB OBJECT [OBJECT ...] = MEANING [MEANING ...]: the key is the whole left side
            key, sep, rest = entry.partition("=")
            key, words = " ".join(key.split()), tuple(key.split()[1:]) + tuple(rest.split())
            if not sep or "=" in rest or len(key.split()) < 2 or not rest.split():
                problems.append(f"{where}: a sense is VERB OBJECT [OBJECT ...] = MEANING [MEANING ...], not {entry!r}")
                continue
            entries.append((number, key, words))
        else:
            key, sep, rest = entry.partition("=")
            key, words = key.strip(), tuple(rest.split())
            if not sep or "=" in rest or not key or len(key.split()) != 1 or not words:
                problems.append(f"{where}: an entry is KEY = WORD [WORD ...], not {entry!r}")
                continue
            if kind == "irregular" and len(words) != 1:
                problems.append(f"{where}: an irregular form stands for one word, not {rest.strip()!r}")
                continue
            entries.append((number, key, words))
    return entries, problems


def problems_of(name: str, text: str, stop_words=lexicon.STOP_WORDS) -> list[str]:
    """Everything wrong with one word file on its own (duplicates across the lexicon files: lexicon_problems)."""
    entries, problems = parse(name, text)
    kind = kind_of(name)
    seen: dict[str, int] = {}
    for number, key, words in entries:
        where = f"{name}:{number}"
        for word in (key, *words):
            if not normal(word):
                problems.append(f"{where}: {word!r} is not NFKC-normalised and lowercase "
                                f"({unicodedata.normalize('NFKC', word).lower()!r})")
        if kind == "groups":
            doubled = sorted({w for w in words if words.count(w) > 1})
            if doubled:
                problems.append(f"{where}: {', '.join(doubled)} twice in one group")
        elif key in seen:
            problems.append(f"{where}: {key!r} is listed twice (first at line {seen[key]})")
        seen.setdefault(key, number)
        if kind == "words" or kind == "groups":
            for word in (words or (key,)):
                if not is_word(word):
                    problems.append(f"{where}: {word!r} is not one word as the analyser splits text "
                                    f"({split_words(word)})")
        elif kind == "senses":
            if not is_word(key.split()[0]):
                problems.append(f"{where}: the verb {key.split()[0]!r} is not one word as the analyser splits text")
        elif kind == "irregular":
            target = words[0]
            if not (len(key) > 3 and key.isalpha()):
                problems.append(f"{where}: stem() never looks up {key!r} (three letters or fewer, or not letters)")
            elif tokenize(key) != [target] or tokenize(target) != [target]:
                problems.append(f"{where}: {key!r} must index as {target!r}, and {target!r} as itself "
                                f"({tokenize(key)}, {tokenize(target)})")
        else:
            cjk = bool(CJK_KEY_RE.fullmatch(key))
            if not cjk and not is_word(key):
                problems.append(f"{where}: the key {key!r} is neither one word nor a CJK run ({split_words(key)})")
            if cjk and not name.startswith("lexicon_"):
                problems.append(f"{where}: a CJK key matches only in the multilingual lexicon")
            if name == "abbreviations.txt" and key in stop_words:
                problems.append(f"{where}: {key!r} is a stop word, dropped before it could be looked up")
        if kind in ("table", "groups", "senses"):
            for word in words:
                ok = tool_search_term(word) if name in TOOL_SEARCH_ONLY else (
                    tool_search_term(word) or knowledge_term(word))
                if not ok:
                    problems.append(f"{where}: {word!r} is not an index term (tool search: {tokenize(word)}, "
                                    f"documents: {list(knowledge_terms(word))}; the table would give "
                                    f"{stem(word)!r})")
    return problems


def read(name: str) -> str:
    return (WORDS_DIR / name).read_bytes().decode("utf-8")


def lexicon_problems(files: dict[str, str]) -> list[str]:
    """Keys listed in two lexicon files: the lexicon is one table, the later would silently replace the first."""
    problems, first = [], {}
    for name, text in files.items():
        entries, _ = parse(name, text)
        for number, key, _ in entries:
            if key in first and first[key][0] != name:
                problems.append(f"{name}:{number}: {key!r} is already listed in {first[key][0]}:{first[key][1]}")
            first.setdefault(key, (name, number))
    return problems


# ------------------------------------------------------------------------------------------------------------


def test_every_word_file_is_read_by_the_lexicon_module_and_every_read_file_exists():
    on_disk = {p.name for p in WORDS_DIR.glob("*") if p.is_file()}
    read_by_code = set(re.findall(r'package_data\("search/words/([^"]+)"\)', LEXICON_SOURCE))
    assert on_disk == read_by_code
    assert on_disk == set(KINDS) | set(LEXICON_FILES)
    assert len(LEXICON_FILES) == 8   # zh ja ko es de fr pt it


@pytest.mark.parametrize("name", sorted(KINDS) + LEXICON_FILES)
def test_a_word_file_is_well_formed_normalised_without_duplicates_and_its_targets_are_index_terms(name):
    assert problems_of(name, read(name)) == []


def test_no_key_is_listed_in_two_lexicon_files():
    assert lexicon_problems({name: read(name) for name in LEXICON_FILES}) == []


def test_the_word_lists_relate_as_their_headers_say():
    keeps = set(lexicon.word_file_words(read("knowledge_keeps.txt")))
    assert keeps and keeps <= lexicon.STOP_WORDS
    assert lexicon.KNOWLEDGE_STOP_WORDS == lexicon.STOP_WORDS - keeps
    particles = lexicon.word_file_words(read("german_particles.txt"))
    for verb, english in lexicon.SEPARABLE_VERBS.items():
        # a verb no particle starts is never rejoined; listed in the lexicon too, it must say the same there
        assert any(verb.startswith(p) and len(verb) > len(p) for p in particles), verb
        assert lexicon.LEXICON.get(verb, english) == english, verb


def test_the_tables_hold_exactly_what_the_files_say():
    merged = {}
    for name in LEXICON_FILES:
        merged.update(lexicon.word_file_table(read(name)))
    assert lexicon.LEXICON == merged
    assert sum(len(lexicon.word_file_entries(read(name))) for name in LEXICON_FILES) == len(lexicon.LEXICON)
    assert lexicon.STOP_WORDS == frozenset(lexicon.word_file_words(read("stop_words.txt")))
    assert len(lexicon.word_file_words(read("stop_words.txt"))) == len(lexicon.STOP_WORDS)
    assert set(ABBREVIATIONS) == set(lexicon.word_file_table(read("abbreviations.txt")))
    assert ABBREVIATIONS["pr"] == (stem("pull"), stem("request"))
    groups = [line.split() for _, line in lexicon.word_file_entries(read("equivalences.txt"))]
    assert set(EQUIVALENCES) == {inflection_stem(word) for group in groups for word in group}
    assert lexicon._IRREGULAR == {k: v[0] for k, v in lexicon.word_file_table(read("irregular.txt")).items()}


# The checks themselves: each catches what it is for (else the tests above could not fail).

@pytest.mark.parametrize("name, text, expected", [
    ("lexicon_zh.txt", "搜索 = search\n查找 = find\n搜索 = search\n", "'搜索' is listed twice (first at line 1)"),
    ("lexicon_de.txt", "Datei = file\n", "'Datei' is not NFKC-normalised and lowercase ('datei')"),
    ("lexicon_ja.txt", "ﾌｧｲﾙ = file\n", "is not NFKC-normalised and lowercase ('ファイル')"),
    ("lexicon_es.txt", "archivo = the\n", "'the' is not an index term"),
    ("lexicon_es.txt", "archivo = file_name\n", "'file_name' is not an index term"),
    ("lexicon_es.txt", "archivo = fileName\n", "'fileName' is not NFKC-normalised and lowercase"),
    ("lexicon_fr.txt", "fichier file\n", "an entry is KEY = WORD [WORD ...]"),
    ("lexicon_fr.txt", "fichier =\n", "an entry is KEY = WORD [WORD ...]"),
    ("lexicon_fr.txt", "mot de passe = password\n", "an entry is KEY = WORD [WORD ...]"),
    ("lexicon_fr.txt", "e-mail = email\n", "neither one word nor a CJK run"),
    ("lexicon_fr.txt", "fichier = file", "the last line has no newline"),
    ("abbreviations.txt", "up = upload\n", "'up' is a stop word"),
    ("abbreviations.txt", "srv = server\n", "'server' is not an index term"),
    ("abbreviations.txt", "文件 = file\n", "a CJK key matches only in the multilingual lexicon"),
    ("equivalences.txt", "list show all\n", "'all' is not an index term"),
    ("equivalences.txt", "list show list\n", "list twice in one group"),
    ("equivalences.txt", "list\n", "a group is two or more words"),
    ("irregular.txt", "men = man\n", "stem() never looks up 'men'"),
    ("irregular.txt", "geese = goose geese\n", "an irregular form stands for one word"),
    ("irregular.txt", "geese = gooses\n", "'geese' must index as 'gooses'"),
    ("stop_words.txt", "the\nthe\n", "'the' is listed twice"),
    ("stop_words.txt", "don't\n", "one word as the analyser splits text"),
    ("stop_words.txt", "a b\n", "one word a line"),
    ("german_separable_verbs.txt", "hochskalieren = scale up\n", "'up' is not an index term"),
])
def test_the_validator_reports_each_kind_of_mistake(name, text, expected):
    found = problems_of(name, text)
    assert any(expected in problem for problem in found), found


def test_the_validator_reports_a_key_listed_in_two_lexicon_files():
    found = lexicon_problems({"lexicon_zh.txt": "保存 = save\n", "lexicon_ja.txt": "# a comment\n保存 = save\n"})
    assert found == ["lexicon_ja.txt:2: '保存' is already listed in lexicon_zh.txt:1"]


def test_a_server_target_serves_documents_though_tool_search_drops_the_word():
    # サーバー = server is valid only by the knowledge analyser: the rule is "one of the analysers reading it"
    assert not tool_search_term("server") and knowledge_term("server")
    assert problems_of("lexicon_ja.txt", "サーバー = server\n") == []
    assert problems_of("abbreviations.txt", "srv = server\n") != []


@pytest.mark.parametrize("text, expected", [
    ("open pull = create\n", None),
    ("open = create\n", "a sense is VERB OBJECT"),
    ("open pull =\n", "a sense is VERB OBJECT"),
    ("open the = create\n", "'the' is not an index term"),
])
def test_a_verb_sense_line_names_a_verb_its_objects_and_its_meaning(text, expected):
    problems = problems_of("verb_senses.txt", text)
    assert (problems == []) if expected is None else any(expected in problem for problem in problems), problems
