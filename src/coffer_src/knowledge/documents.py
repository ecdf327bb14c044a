"""Knowledge documents: passages split along headings, a folder walked, memory notes.

Everything here works on files and text only (no database, no shared state), so any thread may call it."""

from __future__ import annotations

import collections
import json
import os
import re
import stat
import time
from typing import NamedTuple

from coffer_src.digests import sha256, token_hex
from coffer_src.errors import CofferError
from coffer_src.vault import iso_timestamp

KNOWLEDGE_DEFAULT_GLOBS = ("*.md", "*.markdown", "*.txt", "*.rst")
KNOWLEDGE_SOURCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")
MEMORY_ID_RE = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$")
MEMORY_TAG_RE = re.compile(r"^[\w.-]{1,32}$")
# Folders that are never documentation and can hold huge trees; hidden folders (.git, .venv) are skipped anyway.
KNOWLEDGE_SKIP_DIRS = frozenset({"node_modules", "__pycache__", "site-packages"})


_CONTROL_CHARS_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
ROOT_UNREADABLE = "root unreadable"


class KnowledgeLimits(NamedTuple):
    """Bounds on what one source may cost; hostile or accidental trees (a home folder, a 50 MB log) stay cheap."""

    max_file_bytes: int = 4 << 20        # larger files are skipped, not truncated: half a document misleads
    max_files: int = 20_000              # matching files per source
    max_entries: int = 400_000           # directory entries looked at per walk (a bound on walk time)
    max_depth: int = 32
    max_passages_per_file: int = 2_000
    passage_chars: int = 1_500           # a passage closes once it holds this much and the next block would overflow
    passage_max_chars: int = 3_000       # hard bound; a longer block (code kept whole up to here) is cut by lines



class Passage(NamedTuple):
    """A piece of a file: the exact text of lines first_line..last_line (1-based, inclusive)."""

    heading: str
    first_line: int
    last_line: int
    text: str


class _Block(NamedTuple):
    kind: str          # 'heading', 'para' or 'code' (kept whole up to passage_max_chars)
    first: int         # 0-based line indexes, inclusive
    last: int
    level: int = 0
    title: str = ""


_MD_FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_MD_ATX_RE = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_MD_UNDERLINE_RE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_MD_BREAK_RE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_RST_ADORNMENT_RE = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}[ \t]*$")
_RST_DIRECTIVE_RE = re.compile(r"^([ \t]*)\.\.[ \t]+\S")
_LIST_ITEM_RE = re.compile(r"^ {0,3}(?:[-+*]|\d{1,9}[.)])[ \t]")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _markdown_blocks(lines: list[str]):
    n, i, para = len(lines), 0, None
    if n and lines[0].strip() == "---":  # front matter is metadata, not text
        for j in range(1, min(n, 200)):
            if lines[j].strip() in ("---", "..."):
                i = j + 1
                break
    while i < n:
        line = lines[i]
        fence = _MD_FENCE_RE.match(line)
        if fence:
            if para is not None:
                yield _Block("para", para, i - 1)
                para = None
            marker = fence.group(1)
            closing = re.compile(r"^ {0,3}" + re.escape(marker[0]) + "{" + str(len(marker)) + r",}[ \t]*$")
            j = i + 1
            while j < n and not closing.match(lines[j]):
                j += 1
            end = min(j, n - 1)
            yield _Block("code", i, end)
            i = end + 1
            continue
        atx = _MD_ATX_RE.match(line)
        if atx:
            if para is not None:
                yield _Block("para", para, i - 1)
                para = None
            yield _Block("heading", i, i, len(atx.group(1)), (atx.group(2) or "").strip())
            i += 1
            continue
        if not line.strip() or (para is None and _MD_BREAK_RE.match(line)):
            if para is not None:
                yield _Block("para", para, i - 1)
                para = None
            i += 1
            continue
        if (para is None and i + 1 < n and _MD_UNDERLINE_RE.match(lines[i + 1])
                and not _LIST_ITEM_RE.match(line) and _indent(line) < 4):
            yield _Block("heading", i, i + 1, 1 if lines[i + 1].strip()[0] == "=" else 2, line.strip())
            i += 2
            continue
        if para is None:
            para = i
        i += 1
    if para is not None:
        yield _Block("para", para, n - 1)


def _rst_blocks(lines: list[str]):
    """Sections from over/underlined titles (levels in order of first appearance, as reST defines them);
    directives and '::' literal blocks are kept whole with their indented body, blank lines included."""
    styles: list[tuple[str, bool]] = []

    def level(style):
        if style not in styles:
            styles.append(style)
        return styles.index(style) + 1

    def indented_end(start: int, base: int) -> int:
        """Last line of the indented body after ``start`` (lines blank or indented deeper than ``base``)."""
        j = start + 1
        while j < n and (not lines[j].strip() or _indent(lines[j]) > base):
            j += 1
        end = j - 1
        while end > start and not lines[end].strip():
            end -= 1
        return end

    n, i, para = len(lines), 0, None
    while i < n:
        line = lines[i]
        stripped = line.strip()
        if para is None and stripped and _RST_ADORNMENT_RE.match(line) and i + 2 < n and lines[i + 1].strip() \
                and _RST_ADORNMENT_RE.match(lines[i + 2]) and lines[i + 2].strip()[0] == stripped[0]:
            yield _Block("heading", i, i + 2, level((stripped[0], True)), lines[i + 1].strip())
            i += 3
            continue
        if para is None and stripped and not line[0].isspace() and i + 1 < n \
                and _RST_ADORNMENT_RE.match(lines[i + 1]) and not _RST_ADORNMENT_RE.match(line) \
                and len(lines[i + 1].rstrip()) >= min(len(line.rstrip()), 3):
            yield _Block("heading", i, i + 1, level((lines[i + 1].strip()[0], False)), stripped)
            i += 2
            continue
        if not stripped:
            if para is not None:
                yield _Block("para", para, i - 1)
                if lines[i - 1].rstrip().endswith("::"):  # the literal block that follows belongs to it
                    end = indented_end(i - 1, _indent(lines[para]))
                    if end > i - 1:
                        yield _Block("code", i, end)
                        i = end + 1
                        para = None
                        continue
                para = None
            i += 1
            continue
        directive = _RST_DIRECTIVE_RE.match(line)
        if para is None and directive:
            end = indented_end(i, len(directive.group(1)))
            yield _Block("code", i, end)
            i = end + 1
            continue
        if para is None:
            para = i
        i += 1
    if para is not None:
        yield _Block("para", para, n - 1)


def _text_blocks(lines: list[str]):
    para = None
    for i, line in enumerate(lines):
        if line.strip():
            if para is None:
                para = i
        elif para is not None:
            yield _Block("para", para, i - 1)
            para = None
    if para is not None:
        yield _Block("para", para, len(lines) - 1)


def document_kind(path: str) -> str:
    """'markdown', 'rst' or 'text', from the file name."""
    lower = path.lower()
    if lower.endswith((".md", ".markdown", ".mdx")):
        return "markdown"
    if lower.endswith((".rst", ".rest")):
        return "rst"
    return "text"


def split_lines(text: str) -> list[str]:
    """Lines as an editor numbers them: \\r\\n, \\r and \\n end a line; nothing else does (str.splitlines would
    also break on form feeds and U+2028, shifting every line number after them)."""
    return re.split(r"\r\n|\r|\n", text)


def split_passages(text: str, kind: str, limits: KnowledgeLimits = KnowledgeLimits()) -> list[Passage]:
    """Passages of a document, in order.  A passage never crosses a heading; paragraphs are packed up to about
    ``limits.passage_chars``; a code block or directive stays whole up to ``limits.passage_max_chars``."""
    lines = split_lines(text)
    blocks = {"markdown": _markdown_blocks, "rst": _rst_blocks}.get(kind, _text_blocks)(lines)
    passages: list[Passage] = []
    stack: list[tuple[int, str]] = []
    current: list[_Block] = []
    size = 0

    def emit(first: int, last: int, heading: str, text: str | None = None) -> None:
        if len(passages) < limits.max_passages_per_file:
            text = text if text is not None else "\n".join(lines[first:last + 1])
            # Only a pathological heading line (megabytes on one line) can push a passage past the bound here.
            passages.append(Passage(heading, first + 1, last + 1, text[:limits.passage_max_chars]))

    def flush() -> None:
        nonlocal current, size
        body = [block for block in current if block.kind != "heading"]
        if body:
            heading = current[0]
            heading_size = sum(len(lines[k]) + 1 for k in range(heading.first, heading.last + 1))
            # The heading line opens its first passage, unless it is absurdly long (then the path says it all).
            first = heading.first if heading_size <= limits.passage_max_chars // 4 else body[0].first
            emit(first, current[-1].last, heading_path)
        current, size = [], 0

    heading_path = ""
    for block in blocks:
        if len(passages) >= limits.max_passages_per_file:
            break
        if block.kind == "heading":
            flush()
            while stack and stack[-1][0] >= block.level:
                stack.pop()
            stack.append((block.level, block.title[:200]))
            heading_path = " > ".join(title for _, title in stack if title)[:600]
            current = [block]
            continue
        block_size = sum(len(lines[k]) + 1 for k in range(block.first, block.last + 1))
        has_body = any(b.kind != "heading" for b in current)
        if has_body and size + block_size > limits.passage_chars:
            flush()
        if block_size <= limits.passage_max_chars:
            current.append(block)
            size += block_size
            continue
        # Too big to keep whole: cut by lines (one over-long line by characters), the pending heading first.
        start = current[0].first if current and len(lines[current[0].first]) <= limits.passage_max_chars // 4 \
            else block.first
        current, size = [], 0
        chunk_first, chunk_size = start, 0
        for k in range(block.first, block.last + 1):
            line_size = len(lines[k]) + 1
            if chunk_size and chunk_size + line_size > limits.passage_max_chars:
                emit(chunk_first, k - 1, heading_path)
                chunk_first, chunk_size = k, 0
            if line_size > limits.passage_max_chars:
                for offset in range(0, len(lines[k]), limits.passage_max_chars):
                    emit(k, k, heading_path, lines[k][offset:offset + limits.passage_max_chars])
                chunk_first, chunk_size = k + 1, 0
                continue
            chunk_size += line_size
        if chunk_size:
            emit(chunk_first, block.last, heading_path)
    flush()
    return passages


def parse_front_matter(text: str) -> tuple[dict, int]:
    """(fields, index of the first body line) of a '---' front matter block; the small YAML subset memory notes
    use (``key: value``, values as JSON or bare words, ``[a, b]`` lists).  Unparseable lines are ignored: a
    human may have edited the file."""
    lines = split_lines(text)
    if not lines or lines[0].strip() != "---":
        return {}, 0
    fields: dict = {}
    for j in range(1, min(len(lines), 200)):
        line = lines[j]
        if line.strip() in ("---", "..."):
            return fields, j + 1
        key, sep, raw = line.partition(":")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        try:
            value = json.loads(raw)
        except ValueError:
            value = [item.strip().strip("'\"") for item in raw[1:-1].split(",") if item.strip()] \
                if raw.startswith("[") and raw.endswith("]") else raw
        fields[key.strip().lower()] = value
    return {}, 0



def glob_regex(pattern: str, ignore_case: bool = True) -> re.Pattern:
    """A glob as a regex on '/'-separated relative paths: ``*`` and ``?`` stay within a path segment, ``**``
    crosses segments, ``[...]`` is a character class.  A pattern without '/' matches the name in any folder."""
    anchored = "/" in pattern.rstrip("/")
    pattern = pattern.strip("/")
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end == -1:
                out.append(r"\[")
                i += 1
            else:
                body = pattern[i + 1:end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body[:1] in "!^" else body) + "]")
                i = end + 1
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile(("" if anchored else "(?:.*/)?") + "".join(out) + r"\Z",
                      (re.IGNORECASE if ignore_case else 0) | re.DOTALL)


class _IgnoreRule(NamedTuple):
    regex: re.Pattern
    negated: bool
    dir_only: bool


def parse_gitignore(text: str) -> list[_IgnoreRule]:
    """The common .gitignore subset: comments, blank lines, ``!`` negation, trailing ``/`` (folders only), a
    leading or inner ``/`` anchoring to the .gitignore's folder, ``*``, ``?``, ``**``, ``[...]``, ``\\`` escapes."""
    rules = []
    for raw in split_lines(text)[:5_000]:
        line = raw.rstrip()
        if raw.endswith("\\ "):          # an escaped trailing space is part of the pattern
            line += " "
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        if negated:
            line = line[1:]
        elif line.startswith("\\"):     # \! and \# stand for themselves
            line = line[1:] if line[1:2] in ("!", "#") else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        try:
            regex = glob_regex(("/" + line.lstrip("/")) if anchored else line, ignore_case=False)
        except re.error:
            continue
        rules.append(_IgnoreRule(regex, negated, dir_only))
    return rules


def _ignored(rule_sets: list[tuple[str, list[_IgnoreRule]]], relative: str, is_dir: bool) -> bool:
    """Git semantics: rules from the root .gitignore down, the last matching rule wins."""
    ignored = False
    for base, rules in rule_sets:
        if base and not relative.startswith(base + "/"):
            continue
        inner = relative[len(base) + 1:] if base else relative
        for rule in rules:
            if (not rule.dir_only or is_dir) and rule.regex.match(inner):
                ignored = not rule.negated
    return ignored


class FoundFile(NamedTuple):
    path: str            # relative to the source root, '/'-separated
    absolute: str
    mtime_ns: int
    size: int


def _bad_name(name: str) -> bool:
    """Names with control characters (a newline, an escape sequence) or bytes that are not text."""
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:   # undecodable bytes arrive as surrogates (PEP 383)
        return True
    return False


def walk_source(root: str, globs, limits: KnowledgeLimits, skipped: collections.Counter) -> list[FoundFile]:
    """The files of a source that match its globs, sorted by path.  Hidden entries, .gitignored entries, bad
    names and symlinks leaving the root are skipped (counted in ``skipped`` by reason); symlink loops are cut by
    remembering each folder's (device, inode); the walk stops at the limits with a warning."""
    try:
        root_real = os.path.realpath(root)
        root_stat = os.stat(root_real)
    except OSError as exc:
        skipped[f"{ROOT_UNREADABLE}: {exc.strerror or exc}"] += 1
        return []
    if stat.S_ISREG(root_stat.st_mode):   # a single file given as the source
        return [FoundFile(os.path.basename(root_real), root_real, root_stat.st_mtime_ns, root_stat.st_size)]
    matchers = [glob_regex(g) for g in globs]
    found: list[FoundFile] = []
    seen_dirs = {(root_stat.st_dev, root_stat.st_ino)}
    stack: list[tuple[str, str, int, list]] = [(root_real, "", 0, [])]
    entries = 0
    while stack:
        folder, relative_folder, depth, rule_sets = stack.pop()
        rule_sets = list(rule_sets)
        gitignore = os.path.join(folder, ".gitignore")
        try:
            if os.path.isfile(gitignore) and os.path.getsize(gitignore) <= 256 << 10:
                with open(gitignore, encoding="utf-8", errors="replace") as handle:
                    rule_sets.append((relative_folder, parse_gitignore(handle.read())))
        except OSError:
            pass
        try:
            with os.scandir(folder) as iterator:
                children = sorted(iterator, key=lambda entry: entry.name)
        except OSError:
            skipped["unreadable folder"] += 1
            continue
        for entry in children:
            entries += 1
            if entries > limits.max_entries or len(found) >= limits.max_files:
                skipped["over the walk limits"] += 1   # reindex warns; changed() polls quietly
                return sorted(found)
            name = entry.name
            if name.startswith("."):
                continue
            if _bad_name(name):
                skipped["bad file name"] += 1
                continue
            relative = f"{relative_folder}/{name}" if relative_folder else name
            try:
                is_link = entry.is_symlink()
                info = entry.stat()  # follows symlinks
            except OSError:
                skipped["unreadable"] += 1
                continue
            is_dir = stat.S_ISDIR(info.st_mode)
            if _ignored(rule_sets, relative, is_dir):
                continue
            if is_link:
                target = os.path.realpath(entry.path)
                try:
                    inside = os.path.commonpath([root_real, target]) == root_real
                except ValueError:   # another drive (Windows)
                    inside = False
                if not inside:
                    skipped["symlink outside the root"] += 1
                    continue
            if is_dir:
                if name in KNOWLEDGE_SKIP_DIRS:
                    continue
                key = (info.st_dev, info.st_ino)
                if key in seen_dirs:
                    skipped["symlink loop"] += 1
                    continue
                if depth + 1 > limits.max_depth:
                    skipped["too deep"] += 1
                    continue
                seen_dirs.add(key)
                stack.append((entry.path, relative, depth + 1, rule_sets))
            elif stat.S_ISREG(info.st_mode) and any(m.match(relative) for m in matchers):
                found.append(FoundFile(relative, entry.path, info.st_mtime_ns, info.st_size))
    return sorted(found)


def read_document(absolute: str, limits: KnowledgeLimits) -> tuple[str | None, str, str]:
    """(text or None, sha256, why not): binary files and files over the size bound give None."""
    try:
        with open(absolute, "rb") as handle:
            data = handle.read(limits.max_file_bytes + 1)
    except OSError as exc:
        return None, "", f"unreadable ({exc.strerror or exc})"
    digest = sha256(data).hexdigest()
    if len(data) > limits.max_file_bytes:
        return None, digest, "too large"
    if b"\x00" in data[:8192]:
        return None, digest, "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        # Not UTF-8: an older editor's Windows-1252 or Latin-1 (which decodes any byte), rather than a file full of
        # replacement characters that no question can match.
        try:
            text = data.decode("cp1252")
        except UnicodeDecodeError:
            text = data.decode("latin-1")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text, digest, ""


class MemoryNote(NamedTuple):
    id: str
    time: str
    client: str
    tags: tuple[str, ...]
    text: str


class MemoryNotes:
    """The memory folder (COFFER_HOME/memory/): one 0600 Markdown file with front matter a note, named by its id.
    Files only: the knowledge base indexes the folder as the reserved source "memory"."""

    MAX_CHARS = 16_000

    def __init__(self, folder: str, limits: KnowledgeLimits):
        self.folder, self.limits = folder, limits

    @classmethod
    def checked(cls, text, tags, client) -> tuple[str, list[str], str]:
        """(text, tags, client) of a note to write, or a CofferError saying what is wrong with them."""
        if not isinstance(text, str) or not text.strip():
            raise CofferError("a memory needs some text")
        if len(text) > cls.MAX_CHARS:
            raise CofferError(f"a memory holds at most {cls.MAX_CHARS} characters")
        if isinstance(tags, str):
            tags = [tags]
        if not isinstance(tags, (list, tuple)) or len(tags) > 16 or \
                not all(isinstance(t, str) and MEMORY_TAG_RE.match(t) for t in tags):
            raise CofferError("tags must be at most 16 words of letters, digits, '.', '_' or '-' (32 characters)")
        client = _CONTROL_CHARS_RE.sub("", str(client or "unknown")).replace("\n", " ").replace("\r", " ")[:100]
        return text, list(tags), client

    def write(self, text: str, tags: list[str], client: str) -> str:
        """Write a note checked by ``checked`` as a new file; returns its id."""
        now = time.time()
        note_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + token_hex(3)
        body = text.replace("\r\n", "\n").strip("\n")
        content = (f"---\nid: {note_id}\ntime: {iso_timestamp(now)}\nclient: {json.dumps(client)}\n"
                   f"tags: {json.dumps(list(tags))}\n---\n{body}\n")
        path = os.path.join(self.folder, note_id + ".md")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(content)
        return note_id

    def path(self, note_id: str) -> str:
        if not isinstance(note_id, str) or not MEMORY_ID_RE.match(note_id):
            raise CofferError(f"bad memory id {note_id!r}")
        return os.path.join(self.folder, note_id + ".md")

    def read(self, note_id: str) -> MemoryNote:
        path = self.path(note_id)
        if not os.path.isfile(path):
            raise CofferError(f"unknown memory {note_id!r}")
        text, _, why_not = read_document(path, self.limits)
        if text is None:
            raise CofferError(f"memory {note_id!r} is {why_not}")
        fields, body_start = parse_front_matter(text)
        tags = fields.get("tags") if isinstance(fields.get("tags"), list) else []
        return MemoryNote(note_id, str(fields.get("time", "")), str(fields.get("client", "")),
                          tuple(str(t) for t in tags), "\n".join(split_lines(text)[body_start:]).strip("\n"))

    def every(self) -> list[MemoryNote]:
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return []
        notes = []
        for name in names:
            note_id = name[:-3]
            if name.endswith(".md") and MEMORY_ID_RE.match(note_id):
                try:
                    notes.append(self.read(note_id))
                except CofferError:
                    continue
        return notes

    def delete(self, note_id: str) -> bool:
        """Remove a note's file; False if there was none."""
        try:
            os.remove(self.path(note_id))
        except FileNotFoundError:
            return False
        return True
