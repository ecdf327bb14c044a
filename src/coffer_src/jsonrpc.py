"""JSON-RPC at the boundary: strict JSON, bounded line reading, protocol errors."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from typing import NamedTuple

from coffer_src.errors import CofferException

#: Newest first.  A client asking for one of these gets it echoed; anything else is offered the newest.
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
LATEST_PROTOCOL_VERSION = PROTOCOL_VERSIONS[0]

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
UPSTREAM_ERROR = -32003  # implementation-defined range: the upstream could not be reached or answered badly
REQUEST_TIMEOUT = -32001


# -- JSON at the boundary ------------------------------------------------------------------------------------
# One encoder for every message: json.dumps with non-default options builds a new one per call.
# allow_nan=False: NaN and Infinity are not JSON, and a client that cannot parse a line never sees its answer.
dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def json_number(value) -> str:
    """What ``dumps`` writes for ``value``, a number: a finite float's repr without the encoder's set-up."""
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)  # what the encoder itself writes for a float
    return dumps(value)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_decode = json.JSONDecoder(parse_float=_finite_float, parse_constant=_reject_constant).decode


MAX_JSON_DEPTH = 100  # deeper than a client's own parser follows (the MCP Python SDK gives up near 128)
_JSON_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(data: bytes) -> int:
    """How deep a JSON text nests (strings ignored).  Only called on texts with many brackets: the strings are
    cut out and the brackets counted at C speed, then walked."""
    depth = deepest = 0
    for byte in _JSON_STRING_RE.sub(b"", data).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in (91, 123) else -1
        deepest = max(deepest, depth)
    return deepest


def decode_json(data):
    """Parse one JSON text that came from outside; anything but plain JSON raises ValueError.

    That covers invalid UTF-8, NaN/Infinity and out-of-range numbers (which would be re-encoded as text no peer can
    parse), and nesting deeper than the interpreter can follow (a 2 KB line of brackets raises RecursionError,
    which must cost one message, never the reader thread).
    """
    try:
        if isinstance(data, (bytes, bytearray)):
            if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and nesting_depth(data) > MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
            data = data.decode("utf-8")
        return _decode(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None



def walked_items(items: list, walk, depth: int) -> list:
    """[walk(item, depth + 1) for item in items], or ``items`` itself when ``walk`` gives every item back as it was
    (the same object): a walker of a JSON tree copies only the arrays it alters, so what it leaves is still
    shared with whoever parsed it."""
    changed = None
    for i, item in enumerate(items):
        new_item = walk(item, depth + 1)
        if changed is None and new_item is not item:
            changed = items[:i]
        if changed is not None:
            changed.append(new_item)
    return items if changed is None else changed

_lenient_decode = json.JSONDecoder().decode


def request_ids_in_unreadable(data) -> list:
    """The ids of the requests in a message decode_json refused that is JSON all the same once its bytes are taken
    as they are (invalid UTF-8 inside a string, NaN, an out-of-range number), so each of them can be answered with
    a parse error under its own id instead of an id nobody waits for.  [] when nothing can be read."""
    if not isinstance(data, (bytes, bytearray)) or (
            data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and nesting_depth(data) > MAX_JSON_DEPTH):
        return []
    try:
        message = _lenient_decode(bytes(data).decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return []
    return [item["id"] for item in (message if isinstance(message, list) else [message])
            if isinstance(item, dict) and isinstance(item.get("method"), str) and "id" in item
            and valid_request_id(item["id"])]


class EncodeError(CofferException, ValueError):
    """A message Coffer cannot write as JSON (nested too deeply to encode, or holding a non-JSON value)."""


class EncodedResult(dict):
    """A result that carries its own JSON text (``json``, exactly what ``dumps`` makes of it), made by whoever
    built the result for less than encoding it again: coffer__search_tools's reply repeats its payload as text
    and its tools' definitions are encoded once per catalogue.  ``encode_line`` writes that text instead of
    encoding the dict.  Any change to the dict itself drops the text; what it holds is never changed (a result
    is built for one reply, and shaping it for a client copies it)."""

    __slots__ = ("json",)

    def __init__(self, result: dict, json_text: str):
        super().__init__(result)
        self.json: str | None = json_text

    def __setitem__(self, key, value):
        self.json = None
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.json = None
        super().__delitem__(key)

    def __ior__(self, other):
        self.json = None
        return super().__ior__(other)

    def clear(self):
        self.json = None
        super().clear()

    def pop(self, *args):
        self.json = None
        return super().pop(*args)

    def popitem(self):
        self.json = None
        return super().popitem()

    def setdefault(self, key, default=None):
        self.json = None
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self.json = None
        super().update(*args, **kwargs)


def encode_line(message) -> bytes:
    """One JSON-RPC message as a newline-terminated UTF-8 line.

    A lone surrogate (legal in a JSON text as an escape, impossible in UTF-8) is written back as its \\uXXXX escape,
    so the peer decodes exactly the string Coffer was given instead of Coffer dying in the write.  A reply whose
    result is an EncodedResult (its last key, as rpc_result puts it) is written with the result's own text.
    """
    try:
        result = message.get("result") if isinstance(message, dict) else None
        if type(result) is EncodedResult and result.json is not None and next(reversed(message)) == "result":
            text = dumps({**message, "result": None})[:-5] + result.json + "}"  # "result":null} -> its text
        else:
            text = dumps(message)
    except (ValueError, TypeError, RecursionError) as exc:
        raise EncodeError(f"cannot encode a message: {exc.__class__.__name__}") from None
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (text + "\n").encode("utf-8", "backslashreplace")


_REQUEST_ID_RE = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"(?:[^"\\]|\\.){0,512}")')


def request_id_in(head: bytes):
    """The JSON-RPC id near the start of a message too large to parse, so its sender still gets an answer."""
    match = _REQUEST_ID_RE.search(head)
    if not match:
        return None
    try:
        value = decode_json(match.group(1))
    except ValueError:
        return None
    return value if valid_request_id(value) else None


def valid_request_id(value) -> bool:
    """The one rule for request ids, from clients and upstreams alike: a string or an integer, bounded."""
    if isinstance(value, str):
        return len(value) <= 512
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63


class OversizedLine(NamedTuple):
    """A line longer than max_message_bytes, skipped without being held: its head, to find an id in, and size."""
    head: bytes
    size: int


def read_line_bursts(read, size: int = 1 << 16, max_line: int = 0):
    """Yield, per system call, the list of complete lines that arrived together (without their newlines).

    ``read(size)`` must return what is available now (one ``os.read``), b"" at EOF.  An unterminated last
    line is yielded at EOF like any other.  With ``max_line``, a longer line is yielded as an OversizedLine and
    its bytes are dropped as they arrive, so a 400 MB line costs at most ``max_line`` of memory.
    """
    partial: list[bytes] = []
    held = 0
    skipping: OversizedLine | None = None
    while True:
        chunk = read(size)
        if not chunk:
            if skipping is not None:
                yield [skipping]
            elif partial:
                yield [b"".join(partial)]
            return
        if b"\n" not in chunk:
            if skipping is not None:
                skipping = skipping._replace(size=skipping.size + len(chunk))
                continue
            partial.append(chunk)
            held += len(chunk)
            if max_line and held > max_line:
                skipping = OversizedLine(b"".join(partial)[:4096], held)
                partial, held = [], 0
            continue
        lines: list = chunk.split(b"\n")
        tail = lines.pop()
        if skipping is not None:
            lines[0] = skipping._replace(size=skipping.size + len(lines[0]))
            skipping = None
        elif partial:
            partial.append(lines[0])
            lines[0] = b"".join(partial)
            partial = []
        held = 0
        if tail:
            partial.append(tail)
            held = len(tail)
        if max_line:
            lines = [OversizedLine(line[:4096], len(line)) if isinstance(line, bytes) and len(line) > max_line
                     else line for line in lines]
        yield lines
        lines = None  # not kept while the next read waits: a 10k-tool listing is one line of megabytes


# Messages that arrive together are answered together: while a reader thread handles one burst of lines, a
# writer may hold its output and write it once at the end, so a busy client gets its replies in one write
# (and parses them in one read) instead of one system call each.
_burst = threading.local()


def handle_burst(lines: list, handle) -> None:
    _burst.flushes = flushes = {}
    try:
        for line in lines:
            handle(line)
    finally:
        _burst.flushes = None
        for flush in flushes.values():
            flush()


def defer_to_burst_end(key, flush) -> bool:
    """Ask for ``flush()`` when the current thread's burst ends; False when no burst is being handled."""
    flushes = getattr(_burst, "flushes", None)
    if flushes is None:
        return False
    flushes[key] = flush
    return True


#: The wire trace, apart from the diagnostics: every message in and out, at debug level (COFFER_LOG=debug).
#: Callers test ``wire_log.isEnabledFor(logging.DEBUG)`` first, so a message is never rendered for nobody.
wire_log = logging.getLogger("coffer.wire")


def wire_text(message) -> str:
    """A message as the wire trace shows it: cut to 2,000 characters (the log's formatter redacts secrets)."""
    if isinstance(message, OversizedLine):
        return f"(a line of {message.size} bytes)"
    if isinstance(message, (bytes, bytearray)):
        text = bytes(message[:2000]).decode("utf-8", "replace").rstrip("\n")
    else:
        try:
            text = dumps(message)[:2000]
        except (ValueError, TypeError, RecursionError):
            text = "(not encodable)"
    return text


TOP_K_DEFAULT, TOP_K_MAX = 5, 20


def negotiate_version(requested) -> str:
    return requested if requested in PROTOCOL_VERSIONS else LATEST_PROTOCOL_VERSION


class RpcError(CofferException):
    """A JSON-RPC error to answer a request with (its code, message and optional data)."""

    def __init__(self, code: int, message: str, data=None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def rpc_error(msg_id, code: int, message: str, data=None) -> dict:
    error = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": msg_id, "error": error}


def rpc_result(msg_id, result) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "result": result}


def tool_error_result(text: str) -> dict:
    """An error an agent reads as a tool result (isError) rather than a protocol failure."""
    return {"content": [{"type": "text", "text": text}], "isError": True}


LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
