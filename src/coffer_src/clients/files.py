"""Client config files: JSON with comments and a TOML subset, read and edited in place."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from typing import NamedTuple

from coffer_src.errors import CofferException

MAX_CONFIG_BYTES = 64 << 20   # ~/.claude.json keeps per-project history and grows to tens of MB on busy machines
MAX_CONFIG_DEPTH = 64


class ConfigProblem(CofferException):
    """A client config file that cannot be read or safely edited; the message is the per-file reason."""


# -- reading files --------------------------------------------------------------------------------------------

def read_config_text(path: str) -> str | None:
    """The file's text, None when it does not exist; ConfigProblem when it is not a readable UTF-8 file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigProblem(f"cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigProblem("not a regular file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigProblem(f"too large to be a config file ({info.st_size >> 20} MiB; limit "
                            f"{MAX_CONFIG_BYTES >> 20} MiB)")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigProblem(f"cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigProblem(f"too large to be a config file (limit {MAX_CONFIG_BYTES >> 20} MiB)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigProblem(f"not valid UTF-8 (byte {exc.start})") from None


def _line_col(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"line {line} column {offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"


class _ObjectSpan(NamedTuple):
    open: int                  # offset of "{"
    close: int                 # offset of "}"
    members: list              # [(key, key_start, value_start, value_end)] in file order


class JsonDocument:
    """A JSON (or JSONC: comments, trailing commas) text parsed with the offsets needed to edit it in place.

    Objects down to ``SPAN_DEPTH`` keep the offsets of their members; deeper values are parsed by the C
    decoder when they are plain JSON.  Only the CLI thread touches one.
    """

    SPAN_DEPTH = 4   # enough for projects[<cwd>].mcpServers.<name> in ~/.claude.json
    _NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")

    def __init__(self, text: str, jsonc: bool):
        self.text = text
        self.jsonc = jsonc
        self.objects: dict[tuple, _ObjectSpan] = {}
        self._raw_decode = json.JSONDecoder().raw_decode
        try:
            start = self._skip(0)
            if start >= len(text):
                raise ConfigProblem("empty file: expected a JSON object")
            self.value, end = self._value(start, (), 0)
            end = self._skip(end)
            if end != len(text):
                raise self._error(end, "unexpected text after the top-level value")
        except RecursionError:
            raise ConfigProblem(f"nested more than {MAX_CONFIG_DEPTH} levels deep") from None
        if not isinstance(self.value, dict):
            raise ConfigProblem(f"the top level is {_json_type(self.value)}, not an object")

    def _error(self, offset: int, what: str) -> ConfigProblem:
        return ConfigProblem(f"not valid {'JSON with comments' if self.jsonc else 'JSON'} at "
                             f"{_line_col(self.text, offset)}: {what}")

    def _skip(self, i: int) -> int:
        text, n = self.text, len(self.text)
        while i < n:
            c = text[i]
            if c in " \t\r\n":
                i += 1
            elif self.jsonc and text.startswith("//", i):
                j = text.find("\n", i)
                i = n if j < 0 else j + 1
            elif self.jsonc and text.startswith("/*", i):
                j = text.find("*/", i + 2)
                if j < 0:
                    raise self._error(i, "unterminated /* comment")
                i = j + 2
            else:
                break
        return i

    def _value(self, i: int, path: tuple, depth: int):
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigProblem(f"nested more than {MAX_CONFIG_DEPTH} levels deep")
        text = self.text
        if i >= len(text):
            raise self._error(i, "unexpected end of file")
        c = text[i]
        if c in "{[" and len(path) >= self.SPAN_DEPTH:
            try:  # plain JSON below the edited levels: let the C decoder do it
                return self._raw_decode(text, i)
            except ValueError:
                if not self.jsonc:
                    raise self._error(i, "malformed value") from None
        if c == "{":
            return self._object(i, path, depth)
        if c == "[":
            items, i = [], self._skip(i + 1)
            if i < len(text) and text[i] == "]":
                return items, i + 1
            while True:
                item, i = self._value(i, path + (len(items),), depth + 1)
                items.append(item)
                i = self._skip(i)
                if i < len(text) and text[i] == ",":
                    i = self._skip(i + 1)
                    if self.jsonc and i < len(text) and text[i] == "]":
                        return items, i + 1
                    continue
                if i < len(text) and text[i] == "]":
                    return items, i + 1
                raise self._error(i, "expected ',' or ']'")
        if c == '"':
            try:
                return json.decoder.scanstring(text, i + 1, True)
            except ValueError as exc:
                raise self._error(i, f"bad string ({str(exc).split(':')[0]})") from None
        for literal, value in (("true", True), ("false", False), ("null", None)):
            if text.startswith(literal, i):
                return value, i + len(literal)
        match = self._NUMBER_RE.match(text, i)
        if match:
            number = match.group(0)
            try:
                return (float(number) if any(ch in number for ch in ".eE") else int(number)), match.end()
            except ValueError:  # e.g. more digits than Python converts
                raise self._error(i, "number out of range") from None
        raise self._error(i, f"unexpected character {c!r}")

    def _object(self, i: int, path: tuple, depth: int):
        text, result, members, open_at = self.text, {}, [], i
        i = self._skip(i + 1)
        while True:
            if i < len(text) and text[i] == "}" and (not members or self.jsonc):
                break
            if i >= len(text) or text[i] != '"':
                raise self._error(i, "expected a quoted member name")
            key_start = i
            try:
                key, i = json.decoder.scanstring(text, i + 1, True)
            except ValueError:
                raise self._error(i, "bad member name") from None
            i = self._skip(i)
            if i >= len(text) or text[i] != ":":
                raise self._error(i, "expected ':'")
            value_start = self._skip(i + 1)
            value, i = self._value(value_start, path + (key,), depth + 1)
            result[key] = value
            members.append((key, key_start, value_start, i))
            i = self._skip(i)
            if i < len(text) and text[i] == ",":
                i = self._skip(i + 1)
                continue
            if i < len(text) and text[i] == "}":
                break
            raise self._error(i, "expected ',' or '}'")
        if len(path) < self.SPAN_DEPTH and all(isinstance(part, str) for part in path):
            self.objects[path] = _ObjectSpan(open_at, i, members)
        return result, i + 1

    # -- editing ---------------------------------------------------------------------------------------------
    def _indent_of(self, offset: int) -> str:
        """The whitespace before ``offset`` when it starts its line, else ''."""
        line_start = self.text.rfind("\n", 0, offset) + 1
        prefix = self.text[line_start:offset]
        return prefix if prefix.strip() == "" else ""

    def _line_indent(self, offset: int) -> str:
        line_start = self.text.rfind("\n", 0, offset) + 1
        line = self.text[line_start:offset]
        return line[:len(line) - len(line.lstrip(" \t"))]

    @staticmethod
    def _render(value, indent: str) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False).replace("\n", "\n" + indent)

    def with_member(self, path: tuple, key: str, value) -> str:
        """The text with ``path[key] = value``, creating missing objects on the way; everything else intact."""
        for cut in range(1, len(path) + 1):
            found, holder = _lookup(self.value, path[:cut])
            if found and not isinstance(holder, dict):
                raise ConfigProblem(f"{'.'.join(path[:cut])} is {_json_type(holder)}, not an object")
        span = self.objects.get(path)
        if span is None:
            for cut in range(len(path) - 1, -1, -1):
                if path[:cut] in self.objects:
                    nested = {key: value}
                    for part in reversed(path[cut + 1:]):
                        nested = {part: nested}
                    return self.with_member(path[:cut], path[cut], nested)
            raise ConfigProblem("the top level is not an object")
        for name, key_start, value_start, value_end in reversed(span.members):  # the last duplicate wins
            if name == key:
                indent = self._line_indent(key_start)
                return self.text[:value_start] + self._render(value, indent) + self.text[value_end:]
        if span.members:
            _, key_start, _, value_end = span.members[-1]
            indent = self._indent_of(key_start) or (self._line_indent(span.open) + "  ")
            member = f"{json.dumps(key, ensure_ascii=False)}: {self._render(value, indent)}"
            return self.text[:value_end] + ",\n" + indent + member + self.text[value_end:]
        outer = self._line_indent(span.open)
        indent = outer + "  "
        member = f"{json.dumps(key, ensure_ascii=False)}: {self._render(value, indent)}"
        return self.text[:span.open] + "{\n" + indent + member + "\n" + outer + "}" + self.text[span.close + 1:]

    def without_member(self, path: tuple, key: str) -> str:
        span = self.objects.get(path)
        if span is None:
            return self.text
        members = span.members
        for index, (name, key_start, _, value_end) in enumerate(members):
            if name != key:
                continue
            if index > 0:                     # drop ", <member>" after the previous member
                start = members[index - 1][3]
                return self.text[:start] + self.text[value_end:]
            if len(members) > 1:              # first of several: drop "<member>, " up to the next one
                return self.text[:key_start] + self.text[members[1][1]:]
            after = self._skip(value_end)
            if after < len(self.text) and self.text[after] == ",":
                value_end = after + 1         # a JSONC trailing comma after the only member
            return self.text[:key_start] + self.text[value_end:].lstrip(" \t")
        return self.text


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _lookup(value, path: tuple):
    """(found, value) at a key path of nested objects."""
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


# -- TOML (Codex) ---------------------------------------------------------------------------------------------

class TomlSubset:
    """A TOML reader for Python 3.10, where ``tomllib`` does not exist yet.

    It reads what config files use: comments, [tables], [[arrays of tables]], dotted and quoted keys, basic and
    literal strings (single- and multi-line), integers, floats, booleans, arrays, inline tables; dates are kept
    as their text.  Anything else is a ConfigProblem, never a wrong value.  Stateless between calls.
    """

    _BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
    _NUMBER = re.compile(r"[+-]?(?:0x[0-9A-Fa-f_]+|0o[0-7_]+|0b[01_]+|inf|nan|"
                         r"(?:\d[\d_]*)(?:\.\d[\d_]*)?(?:[eE][+-]?\d[\d_]*)?)")
    _DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})?)?|"
                       r"\d{2}:\d{2}:\d{2}(?:\.\d+)?")
    _ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\", "e": "\x1b"}

    def loads(self, text: str) -> dict:
        self.text, self.i = text, 0
        root: dict = {}
        current = root
        self._defined: set = set()
        while True:
            self._skip_blank_lines()
            if self.i >= len(text):
                return root
            if text.startswith("[[", self.i):
                self.i += 2
                path = self._key()
                self._expect("]]")
                parent = self._walk(root, path[:-1])
                array = parent.setdefault(path[-1], [])
                if not isinstance(array, list):
                    raise self._error(f"{'.'.join(path)} is already a value, not an array of tables")
                current = {}
                array.append(current)
            elif text[self.i] == "[":
                self.i += 1
                path = self._key()
                self._expect("]")
                if path in self._defined:
                    raise self._error(f"table [{'.'.join(path)}] defined twice")
                self._defined.add(path)
                current = self._walk(root, path)
            else:
                path = self._key()
                self._ws()
                self._expect("=")
                self._ws()
                value = self._value(0)
                holder = self._walk(current, path[:-1])
                if path[-1] in holder:
                    raise self._error(f"key {'.'.join(path)} defined twice")
                holder[path[-1]] = value
            self._end_of_line()

    def key_of(self, text: str) -> tuple:
        """The dotted key in a table header's text, e.g. ``mcp_servers."my server".env``."""
        self.text, self.i = text, 0
        key = self._key()
        self._ws()
        if self.i != len(text):
            raise self._error("unexpected text in a table header")
        return key

    def _error(self, what: str) -> ConfigProblem:
        return ConfigProblem(f"not valid TOML at {_line_col(self.text, self.i)}: {what}")

    def _ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1

    def _skip_blank_lines(self) -> None:
        while self.i < len(self.text):
            self._ws()
            if self.i < len(self.text) and self.text[self.i] == "#":
                self._comment()
            if self.i < len(self.text) and self.text[self.i] in "\r\n":
                self.i += 1
            else:
                return

    def _comment(self) -> None:
        end = self.text.find("\n", self.i)
        self.i = len(self.text) if end < 0 else end

    def _end_of_line(self) -> None:
        self._ws()
        if self.i < len(self.text) and self.text[self.i] == "#":
            self._comment()
        if self.text.startswith("\r\n", self.i):
            self.i += 2
        elif self.i < len(self.text) and self.text[self.i] == "\n":
            self.i += 1
        elif self.i < len(self.text):
            raise self._error("expected the end of the line")

    def _expect(self, token: str) -> None:
        self._ws()
        if not self.text.startswith(token, self.i):
            raise self._error(f"expected {token!r}")
        self.i += len(token)

    def _key(self) -> tuple:
        parts = []
        while True:
            self._ws()
            c = self.text[self.i:self.i + 1]
            if c == '"':
                parts.append(self._basic_string())
            elif c == "'":
                parts.append(self._literal_string())
            else:
                match = self._BARE_KEY.match(self.text, self.i)
                if not match:
                    raise self._error("expected a key")
                parts.append(match.group(0))
                self.i = match.end()
            self._ws()
            if self.text[self.i:self.i + 1] != ".":
                return tuple(parts)
            self.i += 1

    def _walk(self, table: dict, path: tuple) -> dict:
        for part in path:
            child = table.setdefault(part, {})
            if isinstance(child, list) and child and isinstance(child[-1], dict):
                child = child[-1]
            if not isinstance(child, dict):
                raise self._error(f"{part} is already a value, not a table")
            table = child
        return table

    def _value(self, depth: int):
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigProblem(f"nested more than {MAX_CONFIG_DEPTH} levels deep")
        text, i = self.text, self.i
        if text.startswith('"""', i):
            return self._multiline('"""')
        if text.startswith("'''", i):
            return self._multiline("'''")
        c = text[i:i + 1]
        if c == '"':
            return self._basic_string()
        if c == "'":
            return self._literal_string()
        if c == "[":
            self.i += 1
            items = []
            while True:
                self._skip_array_space()
                if self.text[self.i:self.i + 1] == "]":
                    self.i += 1
                    return items
                items.append(self._value(depth + 1))
                self._skip_array_space()
                c = self.text[self.i:self.i + 1]
                if c == ",":
                    self.i += 1
                elif c != "]":
                    raise self._error("expected ',' or ']' in an array")
        if c == "{":
            self.i += 1
            table: dict = {}
            self._ws()
            if self.text[self.i:self.i + 1] == "}":
                self.i += 1
                return table
            while True:
                path = self._key()
                self._expect("=")
                self._ws()
                value = self._value(depth + 1)
                holder = self._walk(table, path[:-1])
                if path[-1] in holder:
                    raise self._error(f"key {'.'.join(path)} defined twice")
                holder[path[-1]] = value
                self._ws()
                c = self.text[self.i:self.i + 1]
                self.i += 1
                if c == "}":
                    return table
                if c != ",":
                    raise self._error("expected ',' or '}' in an inline table")
        for literal, value in (("true", True), ("false", False)):
            if text.startswith(literal, i):
                self.i += len(literal)
                return value
        date = self._DATE.match(text, i)
        if date:
            self.i = date.end()
            return date.group(0)
        number = self._NUMBER.match(text, i)
        if number and number.group(0) not in ("+", "-"):
            self.i = number.end()
            raw = number.group(0).replace("_", "")
            try:
                if raw.lstrip("+-")[:2] in ("0x", "0o", "0b"):
                    sign = -1 if raw.startswith("-") else 1
                    return sign * int(raw.lstrip("+-"), 0)
                if any(ch in raw for ch in ".eE") or raw.lstrip("+-") in ("inf", "nan"):
                    return float(raw)
                return int(raw)
            except ValueError:
                raise self._error(f"bad number {number.group(0)!r}") from None
        raise self._error("expected a value")

    def _skip_array_space(self) -> None:
        while self.i < len(self.text):
            c = self.text[self.i]
            if c in " \t\r\n":
                self.i += 1
            elif c == "#":
                self._comment()
            else:
                return

    def _basic_string(self) -> str:
        self.i += 1
        out = []
        while True:
            if self.i >= len(self.text) or self.text[self.i] in "\r\n":
                raise self._error("unterminated string")
            c = self.text[self.i]
            if c == '"':
                self.i += 1
                return "".join(out)
            if c == "\\":
                out.append(self._escape())
            else:
                out.append(c)
                self.i += 1

    def _escape(self) -> str:
        code = self.text[self.i + 1:self.i + 2]
        if code in self._ESCAPES:
            self.i += 2
            return self._ESCAPES[code]
        if code in ("u", "U"):
            width = 4 if code == "u" else 8
            digits = self.text[self.i + 2:self.i + 2 + width]
            if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
                raise self._error("bad unicode escape")
            self.i += 2 + width
            try:
                return chr(int(digits, 16))
            except (ValueError, OverflowError):
                raise self._error("bad unicode escape") from None
        raise self._error(f"unknown escape \\{code}")

    def _literal_string(self) -> str:
        end = self.text.find("'", self.i + 1)
        newline = self.text.find("\n", self.i + 1)
        if end < 0 or (0 <= newline < end):
            raise self._error("unterminated literal string")
        value, self.i = self.text[self.i + 1:end], end + 1
        return value

    def _multiline(self, quote: str) -> str:
        self.i += 3
        if self.text.startswith("\r\n", self.i):
            self.i += 2
        elif self.text.startswith("\n", self.i):
            self.i += 1
        out = []
        while True:
            if self.i >= len(self.text):
                raise self._error("unterminated multi-line string")
            if self.text.startswith(quote, self.i):
                extra = 0  # up to two quotes right before the closing three belong to the string
                while extra < 2 and self.text.startswith(quote[0], self.i + 3 + extra):
                    extra += 1
                out.append(quote[0] * extra)
                self.i += 3 + extra
                return "".join(out)
            c = self.text[self.i]
            if quote == '"""' and c == "\\":
                rest = self.text[self.i + 1:]
                stripped = rest.lstrip(" \t")
                if stripped.startswith(("\n", "\r\n")):  # line-ending backslash: trim to the next text
                    self.i += 1
                    while self.i < len(self.text) and self.text[self.i] in " \t\r\n":
                        self.i += 1
                    continue
                out.append(self._escape())
                continue
            out.append(c)
            self.i += 1


def load_toml(text: str) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        return TomlSubset().loads(text)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigProblem(f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigProblem(f"nested more than {MAX_CONFIG_DEPTH} levels deep") from None


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's string escapes are all valid TOML escapes when non-ASCII stays raw."""
    return json.dumps(value, ensure_ascii=False)


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_string(key)


def render_toml_server(name: str, entry: dict) -> str:
    """``[mcp_servers.NAME]`` with scalar and list values, then its sub-tables (env, http_headers, ...)."""
    lines = [f"[mcp_servers.{toml_key(name)}]"]
    tables = []
    for key, value in entry.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list):
            lines.append(f"{toml_key(key)} = [{', '.join(toml_string(str(v)) for v in value)}]")
        elif isinstance(value, bool):
            lines.append(f"{toml_key(key)} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{toml_key(key)} = {value!r}")
        else:
            lines.append(f"{toml_key(key)} = {toml_string(str(value))}")
    for key, table in tables:
        lines.append("")
        lines.append(f"[mcp_servers.{toml_key(name)}.{toml_key(key)}]")
        lines.extend(f"{toml_key(k)} = {toml_string(str(v))}" for k, v in table.items())
    return "\n".join(lines) + "\n"


class TomlDocument:
    """A Codex config.toml: its parsed value and the line ranges of each ``[mcp_servers.NAME...]`` table.

    Tables are cut and appended as text so the rest of the file (comments included) stays byte-for-byte; a
    server defined another way (inline, dotted keys) is left alone and the edit is refused.  CLI thread only.
    """

    _HEADER = re.compile(r"^[ \t]*\[(?!\[)(.*)\][ \t]*(?:#.*)?$")

    def __init__(self, text: str):
        self.text = text
        self.value = load_toml(text)
        self.lines = text.splitlines(keepends=True)
        self.blocks: list[tuple[tuple, int, int]] = []   # (key path, first line, line after the last)
        headers = []
        quote = None
        for number, line in enumerate(self.lines):
            if quote is None:
                match = self._HEADER.match(line.rstrip("\r\n"))
                if match:
                    try:
                        headers.append((TomlSubset().key_of(match.group(1)), number))
                    except ConfigProblem:
                        headers.append(((), number))
            for token in ('"""', "'''"):  # a table header inside a multi-line string is text, not a header
                if line.count(token) % 2 == 1 and quote in (None, token):
                    quote = token if quote is None else None
        for index, (path, first) in enumerate(headers):
            last = headers[index + 1][1] if index + 1 < len(headers) else len(self.lines)
            self.blocks.append((path, first, last))

    def server_blocks(self, name: str) -> list[tuple[int, int]]:
        return [(first, last) for path, first, last in self.blocks if path[:2] == ("mcp_servers", name)]

    def server_text(self, name: str) -> str:
        return "".join("".join(self.lines[first:last]) for first, last in self.server_blocks(name))

    def without_server(self, name: str) -> str:
        drop = set()
        for first, last in self.server_blocks(name):
            drop.update(range(first, last))
        return "".join(line for number, line in enumerate(self.lines) if number not in drop)


def append_toml(text: str, block: str) -> str:
    """``block`` after one blank line, however many cut tables left behind."""
    text = text.rstrip("\r\n")
    return (text + "\n\n" if text.strip() else "") + block.strip("\r\n") + "\n"


# -- where each client keeps its servers ----------------------------------------------------------------------

class ClientContext(NamedTuple):
    """The user's home, the project directory and the environment the client files are looked up with."""
    home: str
    cwd: str
    environ: dict
    platform: str = sys.platform

    @classmethod
    def current(cls) -> "ClientContext":
        return cls(os.path.expanduser("~"), os.getcwd(), dict(os.environ))

    def app_config_dir(self) -> str:
        """%APPDATA% on Windows, ~/Library/Application Support on macOS, $XDG_CONFIG_HOME (~/.config) elsewhere."""
        if self.platform == "win32":
            return self.environ.get("APPDATA") or os.path.join(self.home, "AppData", "Roaming")
        if self.platform == "darwin":
            return os.path.join(self.home, "Library", "Application Support")
        return self.environ.get("XDG_CONFIG_HOME") or os.path.join(self.home, ".config")
