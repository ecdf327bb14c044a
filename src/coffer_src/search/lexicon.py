"""Search lexicon: stop words, equivalences, abbreviations, the multilingual lexicon.

The word lists are data files in search/words/ (each says its format at its top; tests/test_lexicon_data.py
checks them), read here once at import.  In coffer.py their text is inlined by the generator.  The tables never
change after import, so any thread reads them."""

from __future__ import annotations

import re
import unicodedata

from coffer_src.resources import package_data

_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")


def word_file_entries(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each entry of a word file: every line that is neither blank nor a comment."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")]


def word_file_words(text: str) -> list[str]:
    """The words of a one-word-a-line file, in order."""
    return [entry for _, entry in word_file_entries(text)]


def word_file_table(text: str) -> dict[str, tuple[str, ...]]:
    """A ``KEY = WORD [WORD ...]`` file as {key: words}, in file order; keys NFKC-normalised and lowercased as the
    analyser's words are (the validator requires the file to say them so already)."""
    table = {}
    for _, entry in word_file_entries(text):
        key, _, words = entry.partition("=")
        table[unicodedata.normalize("NFKC", key.strip()).lower()] = tuple(words.split())
    return table


STOP_WORDS = frozenset(word_file_words(package_data("search/words/stop_words.txt")))
# Tool-search stop words minus the words that carry meaning in documentation ("development server", "--help").
KNOWLEDGE_STOP_WORDS = STOP_WORDS - frozenset(word_file_words(package_data("search/words/knowledge_keeps.txt")))

_IRREGULAR = {word: terms[0] for word, terms in word_file_table(package_data("search/words/irregular.txt")).items()}
EQUIVALENCE_LINES = [tuple(entry.split())
                     for _, entry in word_file_entries(package_data("search/words/equivalences.txt"))]
# Shorthand an agent writes for words a tool's description spells out ("open a PR" = pull request): in a query
# they also count as the full words, at TRANSLATION_WEIGHT.
_ABBREVIATION_WORDS = word_file_table(package_data("search/words/abbreviations.txt"))

# Verbs whose meaning depends on their object: (verb, objects, meanings) of each line ("open a pull request" is
# to create one).
_VERB_SENSE_LINES = [(key.split()[0], tuple(key.split()[1:]), tuple(meanings.split()))
                     for _, entry in word_file_entries(package_data("search/words/verb_senses.txt"))
                     for key, _, meanings in (entry.partition("="),)]

EQUIVALENCE_WEIGHT = 0.35
TRANSLATION_WEIGHT = 0.8

# Common tool-domain words in other languages, mapped to English index terms: one table, one file a language.
# CJK keys match as substrings.
LEXICON = {
    **word_file_table(package_data("search/words/lexicon_zh.txt")),
    **word_file_table(package_data("search/words/lexicon_ja.txt")),
    **word_file_table(package_data("search/words/lexicon_ko.txt")),
    **word_file_table(package_data("search/words/lexicon_es.txt")),
    **word_file_table(package_data("search/words/lexicon_de.txt")),
    **word_file_table(package_data("search/words/lexicon_fr.txt")),
    **word_file_table(package_data("search/words/lexicon_pt.txt")),
    **word_file_table(package_data("search/words/lexicon_it.txt")),
}
_LEXICON_ENDINGS = frozenset(key[-3:] for key in LEXICON if len(key) >= 3)  # a compound ends in a lexicon word

# German separable verbs: "Lade die Datei hoch" is hochladen (upload) with the particle at the clause's end.
# Listed as infinitives; translations() rejoins a particle with an inflected verb form anywhere in the query.
SEPARABLE_VERBS = word_file_table(package_data("search/words/german_separable_verbs.txt"))
_GERMAN_PARTICLES = tuple(word_file_words(package_data("search/words/german_particles.txt")))
_GERMAN_PARTICLE_SET = frozenset(_GERMAN_PARTICLES)

# The CJK keys of the lexicon by their first two characters (a one-character key by its one): a text's CJK runs
# need testing only against the keys that start with one of their characters or character pairs.
_LEXICON_CJK: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
for _key, _english in LEXICON.items():
    if _CJK_RE.search(_key):
        _LEXICON_CJK.setdefault(_key[:2], []).append((_key, _english))
del _key, _english
