"""Search text analysis: tokens, stems, translations and the analysed texts of a tool.

Threads: the analysis runs on any thread at once (a catalogue's index build, the knowledge base's indexing, the
queries of worker threads) and takes no lock.  Its memos are the functools caches (thread-safe) and three dicts,
_TOKEN_STEMS, _TOKEN_SURFACES and _ANALYSED_TEXTS, whose every entry is a pure function of its key and which are
filled and emptied by single dict operations: a race computes an entry twice, or empties the dict under another thread,
which then recomputes what it looks up."""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import re
import unicodedata
from typing import Iterable, NamedTuple

from coffer_src.jsonrpc import TOP_K_DEFAULT, TOP_K_MAX
from coffer_src.search.lexicon import (
    _ABBREVIATION_WORDS,
    _CJK_RE,
    _GERMAN_PARTICLE_SET,
    _GERMAN_PARTICLES,
    _IRREGULAR,
    _LEXICON_CJK,
    _LEXICON_ENDINGS,
    _VERB_SENSE_LINES,
    EQUIVALENCE_LINES,
    KNOWLEDGE_STOP_WORDS,
    LEXICON,
    SEPARABLE_VERBS,
    STOP_WORDS,
)

SEARCH_QUERY_MAX_CHARS = 2_000


def bounded_top_k(value) -> int:
    """The one rule for a top_k argument: absent means 5; an integer (or integral float) is clamped to 1..20;
    anything else is a ValueError the caller turns into its own error."""
    if value is None:
        return TOP_K_DEFAULT
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"top_k must be an integer between 1 and {TOP_K_MAX}")
    return max(1, min(TOP_K_MAX, value))


def bounded_query(query: str) -> str:
    """The one rule for a search query's length: its first SEARCH_QUERY_MAX_CHARS characters.  An agent writes
    a sentence or two; the patterns that find paths and e-mail addresses in a query cost up to the square of
    its length, so a megabyte of "a.a.a." would hold a worker for an hour."""
    return query[:SEARCH_QUERY_MAX_CHARS]



_CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
# Capitals with a final "s" (PDFs, URLs, IDs) are the plural of an acronym: one word, its singular.  The camel-case
# rule alone would cut "PDFs" into "PD" + "Fs" and "URLs" into "UR" + "Ls" (and "ls" is a shell tool's name).
_PLURAL_ACRONYM_RE = re.compile(r"([A-Z]{2,})s(?![a-z])")
_WORD_RE = re.compile(r"[^\W_]+")


# The words of a text outside those scripts, and the runs of those scripts' word characters (as _WORD_RE would
# find them: not the kana middle dot, voicing marks or unassigned code points).
_NON_CJK_WORD_RE = re.compile(r"[^\W_\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
_CJK_WORD_RE = re.compile(r"[\u3041-\u3096\u309d-\u309f\u30a1-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                          r"\uac00-\ud7a3\uf900-\ufaff]+")


def _has_vowel(stem_: str) -> bool:
    """Porter's condition for stripping -ing and -ed: what remains holds a vowel (y after a consonant counts), so
    "string" and "spring" stay words instead of becoming "str" and "spr"."""
    return any(letter in "aeiou" for letter in stem_) or "y" in stem_[1:]


@functools.lru_cache(maxsize=1 << 17)  # catalogues repeat words heavily: many calls, few distinct words
def stem(word: str) -> str:
    """A light suffix stripper: plurals, -ing, -ed (when a vowel remains), -ation, final -e.  Consistency matters
    more than linguistics: the index and the query go through the same function."""
    if len(word) <= 3 or not word.isalpha():
        return word
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith(("xes", "ches", "shes", "zes")):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("ing") and len(word) >= 6 and _has_vowel(word[:-3]):
        word = word[:-3]
    elif word.endswith("ed") and not word.endswith("eed") and len(word) >= 5 and _has_vowel(word[:-2]):
        word = word[:-2]
    elif word.endswith("ation") and len(word) >= 8:
        word = word[:-3]
    if len(word) >= 4 and word[-1] == word[-2] and word[-1] not in "lsz":
        word = word[:-1]
    if word.endswith("e") and len(word) >= 4:
        word = word[:-1]
    return word


@functools.lru_cache(maxsize=1 << 16)
def singular(word: str) -> str:
    """The word with a plural ending removed and nothing else: "files" and "file" are the same word to a
    user, "location" and "located" are not (the stemmer folds those; see SearchIndex.STEM_WEIGHT)."""
    if len(word) <= 3 or not word.isalpha():
        return word
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("sses") or word.endswith(("xes", "ches", "shes", "zes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


# ASCII letters and digits kept, every other byte a space: bytes.translate + split is how an ASCII text (nearly
# every tool text) is cut into tokens, one pass in C, cheaper than a Unicode regex over the same characters.
_ASCII_TOKENS = bytes(c if c < 128 and chr(c).isalnum() else 32 for c in range(256))


@functools.lru_cache(maxsize=1 << 17)
def _token_words(token: str) -> tuple[str, ...]:
    """The lowercase words of one token (letters and digits): "API", "Get", "mp3" are one word, "getFileInfo" three."""
    if token.isupper() or token[1:].islower():
        return (token.lower(),)
    return tuple(_split_identifiers(token).lower().split())


def _split_identifiers(text: str) -> str:
    """``text`` with a space wherever an identifier's words meet (getFileInfo, HTTPServer, listPDFs)."""
    if "s" in text:
        text = _PLURAL_ACRONYM_RE.sub(r"\1 ", text)
    return _CAMEL_RE.sub(" ", text)


def split_words(text: str) -> list[str]:
    """NFKC, identifier splitting, lowercase; CJK runs become overlapping bigrams so substrings can match."""
    if text.isascii():  # the common case: NFKC is the identity and there is no CJK to split
        tokens = text.encode("ascii").translate(_ASCII_TOKENS).decode("ascii").split()
        return list(itertools.chain.from_iterable(map(_token_words, tokens)))
    text = unicodedata.normalize("NFKC", text)
    if not _CJK_RE.search(text):  # accents, dashes, curly quotes: the same words, found by the Unicode pattern
        return list(itertools.chain.from_iterable(map(_token_words, _WORD_RE.findall(text))))
    text = _split_identifiers(text).lower()
    words = []
    for run in _WORD_RE.findall(text):
        if run.isascii() or not _CJK_RE.search(run):
            words.append(run)
            continue
        position = 0
        for match in _CJK_RE.finditer(run):
            if match.start() > position:
                words.append(run[position:match.start()])
            chunk = match.group()
            words.extend([chunk] if len(chunk) == 1 else [chunk[i:i + 2] for i in range(len(chunk) - 1)])
            position = match.end()
        if position < len(run):
            words.append(run[position:])
    return words


class TextTerms(NamedTuple):
    """What one text contributes to the index: stems (the index terms, what ``tokenize`` returns), the English
    stems of its foreign tool-domain words, and the text itself (a tool's surface words are read from its texts
    together: surface_word_sets)."""

    stems: tuple[str, ...]
    foreign: tuple[str, ...]
    text: str


def tokenize(text: str) -> list[str]:
    """Index/query terms of a text: split, stop words dropped, stemmed."""
    return list(_analysed(text).stems)


def surface_words(text: str) -> tuple[str, ...]:
    """A text's words as written (lowercased, stop words dropped): a query compares them, plural-folded, so an
    exact word can outrank one that merely shares its stem."""
    return tuple(itertools.filterfalse(STOP_WORDS.__contains__, split_words(text)))


# Two stems no word can produce (analysis yields letters and digits only): _BATCH_SEPARATOR stands between
# the texts of a batch (see analyse_texts), _FOREIGN_MARK ends the stems of a token that holds a foreign
# tool-domain word (a lexicon word, or a compound of two), so a text needs translating exactly when one of its
# tokens carries the mark.
_BATCH_SEPARATOR = "\x01"
_FOREIGN_MARK = "\x02"


class _TokenMemo(dict):
    """token -> what one analysis makes of it, filled on first sight.  An index build analyses tens of thousands
    of texts whose words repeat: one dict look-up per token (in C, through map) is most of what it then does per
    word.  Emptied when it outgrows LIMIT, so a catalogue of random words cannot grow it without bound; a token
    looked up again is simply recomputed.  The batch separator stands for itself."""

    LIMIT = 1 << 17

    def __missing__(self, token: str) -> tuple[str, ...]:
        if len(self) >= self.LIMIT:
            self.clear()
        found = (_BATCH_SEPARATOR,) if token == _BATCH_SEPARATOR else self.analyse(token)
        self[token] = found
        return found

    def analyse(self, token: str) -> tuple[str, ...]:
        raise NotImplementedError


class _TokenStems(_TokenMemo):
    """token -> its index terms (identifier-split, lowercased, stop words dropped, stemmed)."""

    def analyse(self, token: str) -> tuple[str, ...]:
        words = _token_words(token)
        found = tuple(map(stem, itertools.filterfalse(STOP_WORDS.__contains__, words)))
        if not LEXICON.keys().isdisjoint(words) or any(map(_compound_terms, words)):  # Verzeichnisbaum too
            found += (_FOREIGN_MARK,)
        return found


_TOKEN_STEMS = _TokenStems()


class _TokenSurfaces(_TokenMemo):
    """token -> its surface words, plural-folded (``singular``), stop words dropped: what _TokenStems is to
    stems, for surface_word_sets."""

    def analyse(self, token: str) -> tuple[str, ...]:
        return tuple(map(singular, itertools.filterfalse(STOP_WORDS.__contains__, _token_words(token))))


_TOKEN_SURFACES = _TokenSurfaces()


def surface_word_sets(documents: Iterable[tuple[str, ...]]) -> list[frozenset | None]:
    """For each document (a tuple of texts), the set of its texts' surface words, plural-folded: ``singular`` of
    each of their ``surface_words``; None for a document with a text outside ASCII (read it with
    document_surface_words when needed: NFKC and CJK bigrams cost far more).  The ASCII documents (nearly all)
    are read as analyse_texts reads texts, in batches: one split of their joined texts and one pass of token
    look-ups, in C."""
    joined = list(map(" ".join, documents))  # ASCII texts: a space between them changes no token
    found: list[frozenset | None] = [None] * len(joined)
    batch = [i for i, text in enumerate(joined) if text.isascii() and _BATCH_SEPARATOR not in text]
    for start in range(0, len(batch), _BATCH_TEXTS):
        chunk = batch[start:start + _BATCH_TEXTS]
        text = f" {_BATCH_SEPARATOR} ".join(map(joined.__getitem__, chunk))
        tokens = text.encode("ascii").translate(_ASCII_BATCH_TOKENS).decode("ascii").split()
        words = tuple(itertools.chain.from_iterable(map(_TOKEN_SURFACES.__getitem__, tokens)))
        begin, cut = 0, words.index
        for i in chunk[:-1]:
            end = cut(_BATCH_SEPARATOR, begin)
            found[i] = frozenset(words[begin:end])
            begin = end + 1
        found[chunk[-1]] = frozenset(words[begin:])
    return found


def document_surface_words(texts: Iterable[str]) -> frozenset:
    """The surface words of these texts, plural-folded, as surface_word_sets gives them for one document."""
    return frozenset(map(singular, itertools.chain.from_iterable(map(surface_words, texts))))


class _AnalysedTexts(dict):
    """text -> its TextTerms, filled on first sight: a rebuild after one upstream changes analyses only the new
    texts.  Emptied when it outgrows LIMIT, as _TokenStems is."""

    LIMIT = 1 << 17

    def __missing__(self, text: str) -> TextTerms:
        if len(self) >= self.LIMIT:
            self.clear()
        found = self[text] = _analyse(text)
        return found

    def remember(self, found: dict[str, TextTerms]) -> None:
        if len(self) + len(found) > self.LIMIT:
            self.clear()
        if len(found) <= self.LIMIT:
            self.update(found)


_ANALYSED_TEXTS = _AnalysedTexts()


def _analysed(text: str) -> TextTerms:
    """Stems and foreign-word translations of one text, computed once per text."""
    return _ANALYSED_TEXTS[text]


def analyse_texts(texts: Iterable[str]) -> dict[str, TextTerms]:
    """TextTerms of each of ``texts``.  The ASCII texts not seen before (nearly all of a new catalogue's) are
    analysed as one batch: one split of their joined text and one pass of token look-ups, in C, instead of a
    few Python calls per text."""
    found: dict[str, TextTerms] = {}
    fresh = []
    known = _ANALYSED_TEXTS.get
    for text in dict.fromkeys(texts):
        terms = known(text)
        if terms is None:
            fresh.append(text)
        else:
            found[text] = terms
    batch = [text for text in fresh if text.isascii() and _BATCH_SEPARATOR not in text]
    new: dict[str, TextTerms] = {}
    for start in range(0, len(batch), _BATCH_TEXTS):
        chunk = batch[start:start + _BATCH_TEXTS]
        new.update(zip(chunk, _analyse_ascii_batch(chunk)))
    new.update((text, _analyse(text)) for text in fresh if text not in new)
    _ANALYSED_TEXTS.remember(new)
    found.update(new)
    return found


# Texts per batch: the batch's temporary strings then fit in memory the allocator has already touched (one
# batch of a whole large catalogue would page-fault its way through fresh memory).
_BATCH_TEXTS = 1024
# _ASCII_TOKENS, except that the batch separator stays itself.
_ASCII_BATCH_TOKENS = _ASCII_TOKENS[:1] + _BATCH_SEPARATOR.encode("ascii") + _ASCII_TOKENS[2:]


def _analyse_ascii_batch(texts: list[str]) -> list[TextTerms]:
    """_analyse of ASCII texts free of the separator, all at once: the stems of the joined texts, cut at the
    separators.  A text with a foreign word goes through _analyse for its translations."""
    if not texts:
        return []
    joined = f" {_BATCH_SEPARATOR} ".join(texts)
    tokens = joined.encode("ascii").translate(_ASCII_BATCH_TOKENS).decode("ascii").split()
    stems = tuple(itertools.chain.from_iterable(map(_TOKEN_STEMS.__getitem__, tokens)))
    per_text, start, cut = [], 0, stems.index
    for _ in range(len(texts) - 1):
        end = cut(_BATCH_SEPARATOR, start)
        per_text.append(stems[start:end])
        start = end + 1
    per_text.append(stems[start:])
    found = list(map(_new_text_terms, zip(per_text, itertools.repeat(()), texts)))
    if _FOREIGN_MARK in stems:  # rare: a text with a foreign word is analysed again, with its translations
        found = [_analyse(terms.text) if _FOREIGN_MARK in terms.stems else terms for terms in found]
    return found


# TextTerms from a (stems, foreign, text) tuple, as its own constructor makes it, without a Python call each.
_new_text_terms = functools.partial(tuple.__new__, TextTerms)


def _analyse(text: str) -> TextTerms:
    """_analysed, uncached.  The common path (ASCII) iterates in C over memoised tokens rather than word by word
    in Python."""
    if text.isascii():  # NFKC is the identity and no CJK phrase can match: word look-ups are all there is
        tokens = text.encode("ascii").translate(_ASCII_TOKENS).decode("ascii").split()
        stems = tuple(itertools.chain.from_iterable(map(_TOKEN_STEMS.__getitem__, tokens)))
        if _FOREIGN_MARK not in stems:
            return TextTerms(stems, (), text)
        raw = split_words(text)
        foreign = tuple(map(stem, _lexicon_words(raw) + _german_terms(raw)))  # split verbs too
        return TextTerms(_without_mark(stems), foreign, text)
    normal = unicodedata.normalize("NFKC", text)
    if not _CJK_RE.search(normal):  # accents, dashes, curly quotes: the same tokens, the same rule as ASCII text
        stems = tuple(itertools.chain.from_iterable(map(_TOKEN_STEMS.__getitem__, _WORD_RE.findall(normal))))
        if _FOREIGN_MARK not in stems:
            return TextTerms(stems, (), text)
        return TextTerms(_without_mark(stems), tuple(_translated(normal.lower())), text)
    # The words around CJK runs as in any text, then each run's bigrams (unstemmed); the CJK lexicon words in
    # the runs, and the other lexicon words if a word carries the mark (German verbs split over a clause are not
    # looked for in CJK text; a query is always read whole: translations).
    words = _NON_CJK_WORD_RE.findall(normal)
    runs = _CJK_WORD_RE.findall(normal)
    bigrams = list(itertools.chain.from_iterable(map(_cjk_bigrams, runs)))
    stems = tuple(itertools.chain(itertools.chain.from_iterable(map(_TOKEN_STEMS.__getitem__, words)), bigrams))
    found = _cjk_lexicon_words(runs, bigrams)
    if _FOREIGN_MARK in stems:
        stems = _without_mark(stems)
        found += _lexicon_words(" ".join(words).lower().split())
    return TextTerms(stems, tuple(map(stem, found)), text)


def _lexicon_words(words: Iterable[str]) -> list[str]:
    """The English words the lexicon gives for these (lowercased) words, in order."""
    return list(itertools.chain.from_iterable(map(LEXICON.get, words, itertools.repeat(()))))


def _without_mark(stems: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(filter(_FOREIGN_MARK.__ne__, stems)) if _FOREIGN_MARK in stems else stems


def _cjk_lexicon_words(runs: list[str], bigrams: Iterable[str]) -> list[str]:
    """The English words of the CJK lexicon keys inside these CJK runs, each key once (keys match as
    substrings: a run has no spaces between its words)."""
    joined = " ".join(runs)
    found: list[str] = []
    for start in sorted(_LEXICON_CJK.keys() & set(itertools.chain(joined, bigrams))):
        for key, english in _LEXICON_CJK[start]:
            if len(key) <= 2 or key in joined:
                found.extend(english)
    return found


def _cjk_bigrams(run: str) -> list[str]:
    """A CJK run as overlapping character pairs, so a phrase matches the words inside it; one character alone."""
    return list(map(operator.add, run, run[1:])) if len(run) > 1 else [run]


def forget_analysed_texts() -> None:
    """Empty every memo of the text analysis, as in a fresh process (benchmarks of a cold index build)."""
    for cached in (stem, singular, _token_words, _compound_terms, _separable_matches,
                   _word_terms):  # _word_terms: the knowledge section's, below
        cached.cache_clear()
    _TOKEN_STEMS.clear()
    _TOKEN_SURFACES.clear()
    _ANALYSED_TEXTS.clear()


def _german_terms(words: list[str]) -> list[str]:
    """English words for German separable verbs split over the clause ("lade ... hoch" = hochladen = upload)
    and for compounds of two lexicon words ("Verzeichnisbaum" = directory tree)."""
    found: list[str] = []
    particles = list(filter(_GERMAN_PARTICLE_SET.__contains__, words))
    if particles:  # "an", "um", "zu" are English words too: look the verbs up once, not once per particle
        verbs = [(verb, matches) for verb in words if len(verb) >= 3 for matches in (_separable_matches(verb),)
                 if matches]
        for particle in particles:
            for verb, matches in verbs:
                if verb != particle and particle in matches:
                    found.extend(matches[particle])
    found.extend(itertools.chain.from_iterable(map(_compound_terms, words)))
    return found


def _separable_index() -> dict[str, dict[str, tuple[str, ...]]]:
    """The rest of each separable verb after a particle it starts with -> {particle: English words}."""
    index: dict[str, dict[str, tuple[str, ...]]] = collections.defaultdict(dict)
    for verb, english in SEPARABLE_VERBS.items():
        for particle in _GERMAN_PARTICLES:
            if verb.startswith(particle) and len(verb) > len(particle):
                index[verb[len(particle):]][particle] = english
    return dict(index)


_SEPARABLE_REST = _separable_index()


@functools.lru_cache(maxsize=1 << 16)
def _separable_matches(verb: str) -> dict[str, tuple[str, ...]]:
    """particle -> English words of the separable verb that particle makes with this inflected form ("lade" +
    "hoch" = hochladen = upload); the first matching form wins, as a reader would try them."""
    matches: dict[str, tuple[str, ...]] = {}
    for form in (verb + "n", verb + "en", verb, verb[:-1] + "en", verb[:-2] + "en"):
        for particle, english in _SEPARABLE_REST.get(form, {}).items():
            matches.setdefault(particle, english)
    return matches


@functools.lru_cache(maxsize=1 << 16)  # long words repeat across a catalogue's descriptions; most are not compounds
def _compound_terms(word: str) -> tuple[str, ...]:
    """English words of a compound of two lexicon words ("Verzeichnisbaum" = directory tree), else ()."""
    if not 8 <= len(word) <= 40 or word[-3:] not in _LEXICON_ENDINGS or word in LEXICON or (
            word in SEPARABLE_VERBS or not word.isascii() and _CJK_RE.search(word)):
        return ()
    for cut in range(len(word) - 3, 2, -1):  # longest head first: "bildschirmfoto" = bildschirm + foto
        tail = word[cut:]
        if tail not in LEXICON:  # the cheap test first: most long words are not compounds at all
            continue
        head = word[:cut]
        heads = [head] + [head[:-len(link)] for link in ("s", "n", "en", "e") if head.endswith(link)]
        head_english = next((LEXICON[h] for h in heads if h in LEXICON), None)
        if head_english:
            return head_english + LEXICON[tail]
    return ()


def translations(text: str) -> list[str]:
    """English index terms for the foreign tool-domain words in ``text`` (see LEXICON, SEPARABLE_VERBS)."""
    return list(map(stem, translated_words(text)))


def translated_words(text: str) -> list[str]:
    """The English words (as the lexicon writes them) for the foreign tool-domain words in ``text``."""
    return _translated_words(unicodedata.normalize("NFKC", text).lower())


def _translated(normal: str) -> list[str]:
    """translations() of a text already NFKC-normalised and lowercased."""
    return list(map(stem, _translated_words(normal)))


def _translated_words(normal: str) -> list[str]:
    """translated_words() of a text already NFKC-normalised and lowercased: German split verbs and compounds too."""
    found = []
    if _CJK_RE.search(normal):
        runs = _CJK_WORD_RE.findall(normal)
        found = _cjk_lexicon_words(runs, itertools.chain.from_iterable(map(_cjk_bigrams, runs)))
    tokens = _NON_CJK_WORD_RE.findall(normal)  # a CJK key is found inside its run above, not again as a word
    return found + _lexicon_words(tokens) + _german_terms(tokens)


@functools.lru_cache(maxsize=1 << 14)
def inflection_stem(word: str) -> str:
    """The word without its inflectional endings (plural, -ed, -ing), but not its derivational ones: stem()
    folds "location" onto "locate", this keeps them apart ("located" -> "locat", "locations" -> "location")."""
    base = singular(word)
    return base if base.endswith("ation") and len(base) >= 8 else stem(word)


def _build_equivalences() -> dict[str, tuple[str, ...]]:
    """The inflection stem of each word a line lists -> the index terms of that line's other words.  A query word
    expands only the lines that list one of its inflections: "located" (locate) is not "location", though the
    two share a stem, so it does not reach the line of places and addresses."""
    table: dict[str, set[str]] = collections.defaultdict(set)
    for words in EQUIVALENCE_LINES:
        group = {stem(word) for word in words}
        for word in words:
            table[inflection_stem(word)] |= group - {stem(word)}
    return {key: tuple(sorted(others)) for key, others in table.items()}


EQUIVALENCES = _build_equivalences()
# The inflection stem of a verb -> (the stems of its objects, the words it then stands for) of each of its senses.
VERB_SENSES: dict[str, list[tuple[frozenset, tuple[str, ...]]]] = {}
for _verb, _objects, _meanings in _VERB_SENSE_LINES:
    VERB_SENSES.setdefault(inflection_stem(_verb), []).append((frozenset(map(stem, _objects)), _meanings))
del _verb, _objects, _meanings


# Words before an object that say it is a new one ("open *a* ticket": create one) or an existing one ("open *the*
# ticket": read it; "the open tickets": a state).
_INDEFINITE_WORDS = frozenset("a an another new one".split())
_DEFINITE_WORDS = frozenset("the this that these those my our your their its all any every each".split())


def verb_senses(words: list[str], identified: bool = False) -> dict[int, tuple[str, ...]]:
    """Position -> meaning words, for each verb among ``words`` (all of a request's words, stop words included)
    that one of its objects gives another sense (VERB_SENSES: "open" + "pull" = create).  The verb must be one:
    the object follows it after an indefinite word ("open a new pull request"), or right after it, written
    singular ("open PR"), unless the request identifies an existing one (``identified``: "open PR #42").  "The
    open issues" and "open issues in this repo" (plural, no article) say a state, not an act."""
    found = {}
    for position, word in enumerate(words):
        senses = VERB_SENSES.get(inflection_stem(word)) if word.isalpha() else None
        if not senses or (position and words[position - 1] in _DEFINITE_WORDS):
            continue
        after = position + 1
        indefinite = False
        while after < len(words) and words[after] in _INDEFINITE_WORDS:
            after, indefinite = after + 1, True
        objects_found = [w for w in words[after:after + 3] if w not in STOP_WORDS][:2]
        if not objects_found or not indefinite and (
                identified or words[after] != objects_found[0] or singular(objects_found[0]) != objects_found[0]):
            continue
        following = set(map(stem, objects_found))
        found.update((position, meanings) for objects, meanings in senses[::-1] if not objects.isdisjoint(following))
    return found


ABBREVIATIONS = {short: tuple(map(stem, words)) for short, words in _ABBREVIATION_WORDS.items()}


class ToolTexts(NamedTuple):
    """The searchable texts of one tool: its name without the server part, the server, title, description, and
    its parameters: their names, descriptions and enum values, the example clauses of those descriptions (kept
    apart: "e.g. 'Asia/Tokyo'" says what a value looks like, not what the tool is for), and the JSON-schema
    ``format`` values (uri, email, date-time, ...) that say what a parameter takes."""

    short: str
    server: str
    title: str
    description: str
    parameter_names: str
    parameter_texts: str
    examples: str
    formats: tuple[str, ...]


_EXAMPLE_RE = re.compile(r"\b(?:e\.g\.|for example)[^.;)\n]*", re.IGNORECASE)


def _collect_parameters(node, depth: int, names: list, texts: list, examples: list, formats: list) -> None:
    """Parameter names, descriptions/enums, example clauses and formats of a JSON schema's properties, nested
    ones included, depth first.  A function of its own, not a closure: a recursive closure is a reference
    cycle, garbage only the cyclic collector frees, and an index build walks one schema per tool."""
    if not isinstance(node, dict) or depth > 4:
        return
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return
    for key, sub in properties.items():
        names.append(str(key))
        if not isinstance(sub, dict):
            continue
        description = sub.get("description")
        if isinstance(description, str):
            description = description[:2000]
            if "e.g" in description or "xample" in description:
                found = _EXAMPLE_RE.findall(description)
                if found:
                    examples.extend(found)
                    description = _EXAMPLE_RE.sub(" ", description)
            texts.append(description)
        enum, schema_format, items = sub.get("enum"), sub.get("format"), sub.get("items")
        if isinstance(enum, list):
            texts.extend(map(str, enum[:50]))
        if isinstance(schema_format, str):
            formats.append(schema_format.lower())
        if "properties" in sub:  # most parameters are leaves: skip the call
            _collect_parameters(sub, depth + 1, names, texts, examples, formats)
        if isinstance(items, dict):
            _collect_parameters(items, depth + 1, names, texts, examples, formats)



def knowledge_terms(text: str) -> tuple[str, ...]:
    """Index/query terms of a passage or question: Coffer's word splitting and stemmer, documentation stop words."""
    if text.isascii():
        # split_words treats each ASCII word on its own, so a cache per distinct word gives the same terms for less
        # work (documents repeat their words, and indexing a source is mostly this function).
        return tuple(itertools.chain.from_iterable(map(_word_terms, _WORD_RE.findall(text))))
    return tuple(stem(word) for word in split_words(text) if word not in KNOWLEDGE_STOP_WORDS)


@functools.lru_cache(maxsize=1 << 17)
def _word_terms(word: str) -> tuple[str, ...]:
    return tuple(stem(part) for part in split_words(word) if part not in KNOWLEDGE_STOP_WORDS)
