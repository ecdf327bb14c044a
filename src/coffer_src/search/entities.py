"""Search entities: typed values in a query, matched to what parameters accept."""

from __future__ import annotations

import re
from typing import NamedTuple

from coffer_src.search.lexicon import EQUIVALENCE_LINES
from coffer_src.search.text import inflection_stem, split_words, stem

# ---- typed entities in a query, matched against what a tool's parameters accept

class EntityKind(NamedTuple):
    """One kind of argument an agent writes into a request (a path, a URL, a ticket key, ...): how to spot it
    in a query, and the parameter-name stems / schema formats of the tools that take it.  A weak cue is a
    parameter name that may take it (a file's "name"): it counts half, as a cue in a description does."""

    name: str
    pattern: re.Pattern
    cues: frozenset
    formats: frozenset = frozenset()
    weak_cues: frozenset = frozenset()


def _kind(name: str, pattern: str, cues: str, formats: str = "", flags: int = 0, weak: str = "") -> EntityKind:
    return EntityKind(name, re.compile(pattern, flags), frozenset(stem(w) for w in cues.split()),
                      frozenset(formats.split()), frozenset(stem(w) for w in weak.split()))


# Files that hold text (source, markup, data, logs) are written by writing text; the others (documents, images,
# archives, recordings) are made by a tool of their format.
_TEXT_EXTENSIONS = ("py|js|mjs|ts|tsx|jsx|md|txt|json|jsonl|ya?ml|toml|csv|tsv|svg|html?|css|xml|log|sh|ini|cfg|conf|"
                    "sql|rs|go|java|kt|c|cpp|h|rb|php|ipynb")
_FILE_EXTENSIONS = _TEXT_EXTENSIONS + "|pdf|png|jpe?g|gif|webp|docx?|xlsx?|pptx?|zip|tar|gz|wav|mp3|mp4|mov|db|sqlite"
_TEXT_FILE_RE = re.compile(rf"\.(?:{_TEXT_EXTENSIONS})[.)!?:]*$", re.IGNORECASE)
_COMMON_ACRONYMS = frozenset("""
I A OK AI API APIS URL URI SQL PR PRS CSV PDF JSON HTML CSS HTTP HTTPS UTC GMT EU US USA UK ID IDS CLI UI UX DB
FAQ TODO README LGTM ETA PM AM CEO CTO HR QA CI CD VM OS IO IP DNS SSH SSL TLS AWS GCP SDK MCP LLM GPT PNG JPG
SVG XML YAML YML MD TXT RSS ASAP FYI DM DMS NEW GET PUT POST OR AND NOT IN ON AT TO IS BY IT BE
""".split())

ENTITY_KINDS = (
    _kind("url", r"\bhttps?://[^\s<>\"'`]+|\bwww\.[a-z0-9-]+\.[a-z]{2,}[^\s<>\"'`]*",
          "url uri link href website webpage endpoint", "uri url iri uri-reference"),
    _kind("email", r"\b[\w.+-]+@[\w-]+\.[\w.-]*[a-z]\b", "email mail recipient assignee", "email idn-email"),
    _kind("path", r"(?:^|(?<=[\s(\"'`=]))(?:~[/\\]|\.{1,2}[/\\]|/(?=[\w.-]+)|[A-Za-z]:\\)[^\s\"'`,;]*",
          "path file filename filepath directory dir folder source destination"),
    _kind("file", rf"(?:\b[\w.-]+/)*\b[\w-]+\.(?:{_FILE_EXTENSIONS})\b", "path file filename filepath",
          flags=re.IGNORECASE, weak="name"),
    _kind("selector", r"(?:^|(?<=\s))(?:\.[A-Za-z][\w-]*(?:\s*[>+~]\s*[\w.#-]+)*|[a-z]+\[[\w-]+(?:[~|^$*]?=[^\]]*)?\]"
          r"|[\w.#-]+\s*>\s*[\w.#-]+)", "selector element locator css xpath ref"),
    _kind("hash_name", r"(?:^|(?<=\s))#[A-Za-z][\w-]*", "selector element locator ref channel tag"),
    _kind("issue_key", r"\b[A-Z][A-Z0-9]{1,9}-\d+\b", "issue ticket issuekey issueidorkey"),
    _kind("k8s", r"\b(?:deploy|deployments?|po|pods?|svc|services?|cm|configmaps?|secrets?|ns|namespaces?|sts|"
          r"statefulsets?|ds|daemonsets?|jobs?|cronjobs?|ing|ingress|nodes?|pvc|rs)/[a-z0-9][\w.-]*",
          "resourcetype resource kind namespace pod deployment"),
    _kind("timezone", r"\b(?:Africa|America|Antarctica|Asia|Atlantic|Australia|Europe|Indian|Pacific|Etc)/[A-Z][\w+-]+",
          "timezone tz zone"),
    _kind("repo", r"(?:^|(?<=\s))[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?=#\d|[\s,.;:!?)]|$)", "repo repository owner"),
    _kind("number_ref", r"(?:^|(?<=[\s/\w]))#\d+\b", "number issue pull pr"),
    _kind("sql", r"\b(?:select\s.+?\sfrom|insert\s+into|update\s+\w+\s+set|delete\s+from"
                 r"|(?:create|alter|drop)\s+table)\b",
          "sql query statement", flags=re.IGNORECASE | re.DOTALL),
    _kind("cron", r"(?:^|(?<=\s))(?:[\d*/,-]+\s+){4}[\d*/,-]+(?=\s|$)", "cron schedule expression"),
    _kind("date", r"\b\d{4}-\d{2}-\d{2}\b", "date day start end since until", "date date-time"),
    _kind("clock", r"\b\d{1,2}:\d{2}\b", "time hour"),
    _kind("sha", r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", "sha commit revision ref hash"),
    _kind("ticker", r"\b[A-Z]{2,5}\b", "symbol ticker"),
)


class QueryEntity(NamedTuple):
    kind: EntityKind
    start: int
    end: int


def query_entities(query: str) -> list[QueryEntity]:
    """Typed entities in a query, leftmost first; a span claimed by one kind is not read again by a later one
    (so the path in a URL is the URL's, and "ABC-123" is a ticket key, not a ticker)."""
    found: list[QueryEntity] = []
    taken: list[tuple[int, int]] = []
    for kind in ENTITY_KINDS:
        for match in kind.pattern.finditer(query):
            start, end = match.span()
            if start == end or any(start < b and a < end for a, b in taken):
                continue
            if kind.name == "ticker" and match.group() in _COMMON_ACRONYMS:
                continue
            found.append(QueryEntity(kind, start, end))
            taken.append((start, end))
    if any(entity.kind.name == "sql" for entity in found):  # GROUP, WHERE, ORDER are its keywords, not tickers
        found = [entity for entity in found if entity.kind.name != "ticker"]
    return sorted(found, key=lambda e: e.start)


# A clause's end: a request's next step, whose verb does not reach back ("Read notes.md. Save a summary").
_CLAUSE_END_RE = re.compile(r"[.!?;](?:\s|$)")
# The verbs that put content into a file: the equivalence line of "write" (write, save, store, ...).
_WRITING_VERBS = frozenset(map(inflection_stem, next(group for group in EQUIVALENCE_LINES if "write" in group)))
# A verb with its subject said ("the notes I saved in notes.txt", "we've stored it in a.csv") tells what was done
# to a file that exists; the step a request asks for is said without one ("save it to notes.md").
_SUBJECT_PRONOUNS = frozenset("i we he she they".split())


def writes_text_file(query: str, entities: list[QueryEntity]) -> bool:
    """Whether the request writes text into a file it names: a path or file name with a text extension after a
    writing verb in the same clause ("save it to /root/notes/report.md", "store the count in a new file
    count.txt"), the verb not told of a file that exists ("the notes I saved in notes.txt").  A document, an
    image or an archive (.docx, .png, .zip) is not written as text: its format's own tools make and save it."""
    for entity in entities:
        if entity.kind.name not in ("path", "file") or not _TEXT_FILE_RE.search(query[entity.start:entity.end]):
            continue
        before = query[:entity.start]
        clause_start = max((match.end() for match in _CLAUSE_END_RE.finditer(before)), default=0)
        words = split_words(before[clause_start:])
        for position, word in enumerate(words):
            if inflection_stem(word) in _WRITING_VERBS and _SUBJECT_PRONOUNS.isdisjoint(
                    words[max(0, position - 2):position]):
                return True
    return False


# A general web-search tool (a search engine, not a search inside one product) and the words of a request
# for general information, which belongs to such a tool unless a narrower tool matches it clearly.
_WEB_WORDS = frozenset(stem(w) for w in "web internet online".split())
_INFO_CUES = frozenset(stem(w) for w in """news headlines headline latest recent trending information info
background facts article articles happened happening wikipedia""".split())
# Cues that only say "current": a tool whose name holds one of these (latest_version) is not named for the
# request's topic the way a news tool is named for "news".
_INFO_MODIFIERS = frozenset(stem(w) for w in "latest recent happened happening".split())
_QUESTION_STARTS = frozenset(("what", "whats", "which", "who", "when", "where", "wie", "was", "wann", "wo"))
# The words that frame a request for general information rather than name its subject: the cues above (but not
# a source the request names: "the Wikipedia article on X" is for a Wikipedia tool), the web itself, the verbs
# of looking something up ("find the latest news on glacier melt in Norway": the subject is glacier melt in Norway),
# and the words that say "now" or "what matters" as "latest" and "headlines" do ("the big news in AI today": the
# subject is AI).
_FRAMING_WORDS = (_INFO_CUES - {stem("wikipedia")}) | _WEB_WORDS | frozenset(stem(w) for w in """search find look
lookup get show tell give fetch research update updates story stories today tonight now current currently lately
top big biggest major important breaking""".split())
# Parameter names of a tool that looks up free text (a query, keywords, a topic): such a tool can take the subject
# of a request for information as its argument.
_FREE_TEXT_PARAMETERS = frozenset(stem(w) for w in "query q search keyword keywords term terms topic question prompt "
                                  "phrase".split())
