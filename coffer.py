#!/usr/bin/env python3
"""Coffer: a local-first MCP gateway.

Register your MCP servers once; every agent (Claude Code, Codex, Cursor, Claude Desktop) runs one entry,
``coffer serve``, and sees every upstream's tools, resources and prompts, namespaced ``<server>__<tool>``.
``coffer__search_tools`` finds the right tool by intent when the catalogue is too large to read.

One module, standard library only.  Sections, in the order data flows through them:

    1. protocol: constants, JSON at the boundary, logging that is safe for a terminal
    2. names and secrets: exposed names, ${VAR} references, the secret store, an upstream's environment
    3. vault: coffer.db (servers, capability choices and pins, invocation and audit logs)
    4. transports: stdio subprocess, Streamable HTTP (redirect-safe)
    5. upstream supervisor: one server's connection, requests, lists and restarts; boundary checks
    6. catalogue: the merged, namespaced, filtered view of all upstreams
    7. search: the BM25F ranker behind coffer__search_tools (7b: optional semantic ranking)
    8. knowledge and memory: the user's documents and notes behind coffer__ask and coffer__remember
    9. gateway session: the MCP server a client talks to
   10. client configs: import from, install into and diagnose the MCP clients a user has
   11. command line
"""

from __future__ import annotations

import argparse
import array
import base64
import collections
import contextlib
import dataclasses
import difflib
import errno
import functools
import gc
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import math
import operator
import os
import queue
import re
import secrets
import select
import shlex
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import urllib.parse  # loaded by the interpreter's own start-up anyway
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable, NamedTuple

__version__ = "0.1.0"

# ============================================================================================================
# 1. Protocol: constants, JSON at the boundary, terminal-safe logging
# ============================================================================================================

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

SEPARATOR = "__"
RESERVED_SERVER = "coffer"
SEARCH_TOOL = "coffer__search_tools"
ASK_TOOL = "coffer__ask"
REMEMBER_TOOL = "coffer__remember"
SERVER_NAME_RE = re.compile(r"^[a-zA-Z0-9-]{1,24}$")
EXPOSED_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
QUALIFIED_URI_RE = re.compile(r"^coffer\+([a-zA-Z0-9-]{1,24}):(.+)$", re.S)

DEFAULTS = {
    "oauth_client_metadata_url": "",  # https URL of Coffer's OAuth Client ID Metadata Document, where hosted
    "name_max_length": 48,          # leaves room for a client prefix such as mcp__<key>__ within 64
    "discovery_timeout": 5.0,       # seconds a list request waits for a starting upstream
    "call_timeout": 120.0,          # seconds a request may go without a reply or progress
    "init_timeout": 60.0,           # seconds an upstream may take to answer initialize
    "max_restarts": 5,              # consecutive failed starts before an upstream is marked failed
    "retention_invocations_days": 30,
    "retention_audit_days": 365,
    "expose": "auto",               # auto | all | search | budget:N (see expose_mode); expose.<client> overrides
    "embedder_url": "",             # e.g. http://127.0.0.1:11434/v1 (OpenAI-compatible) or an Ollama base URL
    "embedder_model": "",
    "embedder_api": "openai",       # "openai" (POST {url}/embeddings) or "ollama" (POST {url}/api/embed)
    "embedder_key_env": "",         # name of the environment variable holding the API key (never the key)
    "embedder_timeout": 1.0,        # seconds a query may wait for its embedding before BM25 answers alone
    "max_message_bytes": 64 << 20,  # a longer line, HTTP body or SSE event fails that message, not the gateway
    "max_list_pages": 100,          # pages Coffer follows when an upstream paginates one list
    "max_list_items": 10_000,       # tools (prompts, resources...) kept per list per upstream
    "probe_timeout": 10.0,          # seconds a new server has to answer server/discover before initialize is tried
    "mrtr_ttl": 300.0,              # seconds a 2026-07-28 client has to answer a question an upstream asked mid-call
    "memory": "off",                # on: coffer__remember keeps notes agents want kept, coffer__ask finds them
    "ask_synthesis": "on",          # on: coffer__ask may ask the client's own model (sampling) for an answer
}

INSTRUCTIONS = (
    "Coffer is a gateway: the tools, prompts and resources of several MCP servers appear here, named "
    "<server>__<name>. When you are unsure which tool fits, call coffer__search_tools with what you want to do "
    "in plain words (e.g. 'create a GitHub issue'); it returns the best-matching real tools with their input "
    "schemas, which you then call by name."
)


def utcnow() -> str:
    return iso_timestamp(time.time())


def iso_timestamp(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


# -- JSON at the boundary ------------------------------------------------------------------------------------
# One encoder for every message: json.dumps with non-default options builds a new one per call (~2 us a hop).
# allow_nan=False: NaN and Infinity are not JSON, and a client that cannot parse a line never sees its answer.
dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


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


class EncodeError(ValueError):
    """A message Coffer cannot write as JSON (nested too deeply to encode, or holding a non-JSON value)."""


def encode_line(message) -> bytes:
    """One JSON-RPC message as a newline-terminated UTF-8 line.

    A lone surrogate (legal in a JSON text as an escape, impossible in UTF-8) is written back as its \\uXXXX escape,
    so the peer decodes exactly the string Coffer was given instead of Coffer dying in the write.
    """
    try:
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


# -- what reaches a terminal or a log --------------------------------------------------------------------------
# Every diagnostic goes to stderr through the "coffer" logger: stdout belongs to the JSON-RPC stream.  Text an
# upstream wrote (its stderr, tool descriptions, error messages) passes through printable() before a terminal sees
# it, and every known secret value is replaced by *** before anything is printed, logged or stored.
log = logging.getLogger("coffer")

_UNPRINTABLE_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _visible(match) -> str:
    char = match.group()
    return "\ufffd" if "\ud800" <= char <= "\udfff" else f"\\x{ord(char):02x}"


def printable(text) -> str:
    """``text`` made safe for a terminal: C0/C1 control characters (ESC, BEL, CR, OSC 52 clipboard writes...) shown
    as visible \\xNN, lone surrogates as U+FFFD; newlines and tabs stay."""
    text = str(text)
    return _UNPRINTABLE_RE.sub(_visible, text) if _UNPRINTABLE_RE.search(text) else text


_JSON_UNSAFE_RE = re.compile("[\x7f-\x9f\ud800-\udfff\u2028\u2029]")


def terminal_json(value) -> str:
    """Pretty JSON for a terminal: json escapes C0 itself; DEL, C1 and lone surrogates are escaped here too."""
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return _JSON_UNSAFE_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class Redactor:
    """Every secret value this process knows: the secret store's values and what ${VAR} references expanded to.

    ``redact(text)`` replaces each with *** — applied to every log record, to stored stderr and status details, and
    to CLI output.  Values shorter than MIN_LENGTH are not redacted (they would blank out ordinary words).
    """

    MIN_LENGTH = 4

    def __init__(self):
        self._values: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def add(self, *values) -> None:
        """Register values, with the forms JSON and repr() give them (a secret holding a quote, a backslash or a
        newline is printed escaped by --json output and %r log arguments)."""
        forms = set()
        for value in values:
            if isinstance(value, str) and len(value) >= self.MIN_LENGTH:
                forms.update({value, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1],
                              repr(value)[1:-1]})
        fresh = forms - set(self._values)
        if fresh:
            with self._lock:  # longest first, so a secret containing another is replaced whole
                self._values = tuple(sorted(set(self._values) | fresh, key=len, reverse=True))

    def add_named(self, pairs) -> None:
        """Register (name, value) pairs from the secret store or expanded ${NAME} references: a value counts as a
        secret when its name says so (KEY, TOKEN, SECRET, PASSWORD, AUTH...) or it looks like a credential.  So a
        setting that went to the store as a literal (MODE=enabled, DEBUG=true) is not blanked out of every line
        Coffer prints."""
        self.add(*(value for name, value in pairs if isinstance(value, str) and looks_secret(name, value)))

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, "***")
        return text


redact = Redactor()

_SECRET_NAME_RE = re.compile(r"(?i)key|token|secret|passw|pwd|auth|cred|cookie|session|private|signature|bearer")
_TOKEN_PREFIXES = ("sk-", "pk-", "ghp_", "gho_", "ghs_", "ghu_", "github_pat_", "xox", "glpat-", "AKIA", "ASIA",
                   "AIza", "ya29.", "eyJ", "shpat_", "sq0", "rk_", "whsec_", "npm_", "pypi-")


def looks_secret(name: str, value: str) -> bool:
    """Whether a named value is a credential: by its name, or by its shape (a known token prefix, or a long
    mixed string that is not a path or an address)."""
    if _SECRET_NAME_RE.search(name or ""):
        return True
    if len(value) < 8 or any(c.isspace() for c in value):
        return False
    if value.startswith(_TOKEN_PREFIXES):
        return True
    mixed = sum(any(test(c) for c in value) for test in (str.islower, str.isupper, str.isdigit)) >= 2
    return len(value) >= 16 and mixed and not value.startswith(("/", "~", ".", "http://", "https://", "file:"))


class _TerminalFormatter(logging.Formatter):
    """``coffer: message``, redacted and printable; a traceback when COFFER_LOG=debug or stderr is not a terminal
    (a client's log file), else one line naming the exception, so a user never faces a traceback."""

    def __init__(self, tracebacks: bool):
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        text = f"coffer: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            if self.tracebacks:
                text += "\n" + self.formatException(record.exc_info)
            else:
                exc = record.exc_info[1]
                text += f" [{exc.__class__.__name__}: {exc}; COFFER_LOG=debug shows the traceback]"
        return printable(redact(text))


def configure_logging(default: str = "info") -> None:
    """Log to stderr at COFFER_LOG's level (debug traces every message), else at ``default``: info for
    `serve` (whose stderr is the client's log of it), warning for commands a person reads.  Idempotent."""
    if getattr(log, "_coffer_configured", False):
        return
    level = (os.environ.get("COFFER_LOG") or default).strip().upper()
    log.setLevel(getattr(logging, level) if level in ("DEBUG", "INFO", "WARNING", "ERROR") else logging.INFO)
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TerminalFormatter(tracebacks=log.level <= logging.DEBUG or not tty))
    log.addHandler(handler)
    log.propagate = False
    log._coffer_configured = True

    def excepthook(args):  # a thread that dies says so, with its traceback, through the same redaction
        if args.exc_type is not SystemExit:
            log.error("thread %s died", getattr(args.thread, "name", "?"),
                      exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = excepthook


def _trace(message) -> str:
    """A message as COFFER_LOG=debug shows it: cut to 2,000 characters (the log's formatter redacts secrets)."""
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


def start_thread(target, name: str, *args) -> threading.Thread:
    """A daemon thread whose unexpected death is logged with its traceback instead of vanishing."""
    def run():
        try:
            target(*args)
        except Exception:  # noqa: BLE001 - the thread is lost, the reason must not be
            log.exception("internal error in thread %s", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class CofferError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits 1."""


class NotListedYet(CofferError):
    """A capability name on a registered server that Coffer has not seen listed (yet)."""


TOP_K_DEFAULT, TOP_K_MAX = 5, 20
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


def negotiate_version(requested) -> str:
    return requested if requested in PROTOCOL_VERSIONS else LATEST_PROTOCOL_VERSION


class RpcError(Exception):
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


# ------------------------------------------------------------------------------------------------------------
# 1b. MCP 2026-07-28, the stateless era: the per-request envelope, result shapes, listen filters, requestState
#
# A 2026-07-28 request carries its protocol version, client identity and capabilities in params._meta; every
# result carries resultType; list results carry cache hints; change notifications travel only on
# subscriptions/listen streams; a server asks the client for input by answering input_required and reading the
# answers from the retry.  These helpers hold the wire rules so the gateway and the upstream code can stay about
# routing.  All of them treat their input as hostile and never keep state.

MODERN_PROTOCOL_VERSIONS = ("2026-07-28",)
META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
META_SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
ENVELOPE_KEYS = (META_PROTOCOL_VERSION, META_CLIENT_INFO, META_CLIENT_CAPABILITIES, META_LOG_LEVEL)

MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022

INPUT_REQUIRED_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})
CACHEABLE_METHODS = frozenset({"server/discover", "tools/list", "prompts/list", "resources/list",
                               "resources/templates/list", "resources/read"})
MODERN_CLIENT_METHODS = frozenset({"server/discover", "subscriptions/listen", "tools/list", "tools/call",
                                   "prompts/list", "prompts/get", "resources/list", "resources/templates/list",
                                   "resources/read", "completion/complete"})
HANDSHAKE_ONLY_METHODS = frozenset({"initialize", "ping", "logging/setLevel", "resources/subscribe",
                                    "resources/unsubscribe"})
INPUT_REQUEST_METHODS = frozenset({"sampling/createMessage", "elicitation/create", "roots/list"})

MAX_TTL_MS = 24 * 60 * 60 * 1000        # the SDK client caps any ttlMs at a day; so do we
MAX_REQUEST_STATE = 256 * 1024          # an upstream's sealed state rides inside ours; the SDK's are ~0.5 kB
MAX_INPUT_REQUESTS = 32
MAX_LISTEN_URIS = 256
MAX_URI_LENGTH = 2048
_SCHEMA_WALK_LIMIT = 20_000             # schema nodes visited when rewriting $refs (a hostile schema costs this)


class Envelope(NamedTuple):
    """The 2026-07-28 per-request fields of one client request (params._meta)."""
    protocol_version: str
    client_capabilities: dict
    client_info: dict | None
    log_level: str | None


def is_enveloped(params) -> bool:
    """Whether a request claims the modern era: the protocol-version key alone is the signal, so a half-built
    envelope still routes modern and gets the error that names what is missing."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and META_PROTOCOL_VERSION in meta


def parse_envelope(params) -> Envelope:
    """Validate the envelope the way the spec orders it: shape and required keys (-32602), then the version
    (-32022 naming what Coffer speaks).  clientInfo is display-only: a malformed one reads as absent."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict):
        raise RpcError(INVALID_PARAMS, f"params._meta must be an object carrying the required "
                                       f"'{META_PROTOCOL_VERSION}' and '{META_CLIENT_CAPABILITIES}' envelope keys")
    missing = [key for key in (META_PROTOCOL_VERSION, META_CLIENT_CAPABILITIES) if key not in meta]
    if missing:
        raise RpcError(INVALID_PARAMS, f"params._meta is missing the required envelope key(s): {', '.join(missing)}")
    version = meta[META_PROTOCOL_VERSION]
    if not isinstance(version, str):
        raise RpcError(INVALID_PARAMS, "the protocol-version envelope value must be a string")
    if version not in MODERN_PROTOCOL_VERSIONS:
        raise RpcError(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                       {"supported": list(MODERN_PROTOCOL_VERSIONS), "requested": version[:100]})
    capabilities = meta[META_CLIENT_CAPABILITIES]
    if not isinstance(capabilities, dict):
        raise RpcError(INVALID_PARAMS, f"'{META_CLIENT_CAPABILITIES}' must be an object")
    level = meta.get(META_LOG_LEVEL)
    if level is not None and level not in LOG_LEVELS:
        raise RpcError(INVALID_PARAMS, f"'{META_LOG_LEVEL}' must be one of {', '.join(LOG_LEVELS)}")
    info = meta.get(META_CLIENT_INFO)
    return Envelope(version, capabilities, info if isinstance(info, dict) else None, level)


def stamp_envelope(params, envelope: Envelope) -> dict:
    """Params for a modern upstream: the client's own _meta (progress token, trace context) with the envelope
    replaced by ``envelope`` - the client's identity and capabilities, never Coffer's own guesses."""
    params = dict(params) if isinstance(params, dict) else {}
    meta = params.get("_meta")
    meta = {k: v for k, v in meta.items() if k not in ENVELOPE_KEYS} if isinstance(meta, dict) else {}
    meta[META_PROTOCOL_VERSION] = MODERN_PROTOCOL_VERSIONS[-1]
    meta[META_CLIENT_CAPABILITIES] = envelope.client_capabilities
    if envelope.client_info is not None:
        meta[META_CLIENT_INFO] = envelope.client_info
    if envelope.log_level is not None:
        meta[META_LOG_LEVEL] = envelope.log_level
    params["_meta"] = meta
    return params


def strip_envelope(params) -> dict:
    """Params for a handshake upstream: the SDK's handshake loop refuses any request whose _meta carries the
    protocol-version key (-32600), and MRTR fields mean nothing there."""
    params = {k: v for k, v in params.items() if k not in ("inputResponses", "requestState")} \
        if isinstance(params, dict) else {}
    meta = params.get("_meta")
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in ENVELOPE_KEYS}
        if meta:
            params["_meta"] = meta
        else:
            del params["_meta"]
    return params


def coffer_server_info() -> dict:
    return {"name": "coffer", "title": "Coffer MCP gateway", "version": __version__}


def shape_modern_result(method: str, result, ttl_ms: int = 0, cache_scope: str = "private") -> dict:
    """A result as a 2026-07-28 client must receive it: resultType always, Coffer's serverInfo in _meta, and cache
    hints on complete results of the cacheable methods (an upstream's valid hints win over the defaults)."""
    result = dict(result) if isinstance(result, dict) else {}
    kind = result.get("resultType")
    kind = "complete" if kind is None else kind  # a handshake upstream never sets it
    if kind == "input_required" and method in INPUT_REQUIRED_METHODS:
        result.pop("ttlMs", None)
        result.pop("cacheScope", None)  # interim results are never cacheable
    elif kind == "complete":
        result["resultType"] = "complete"
        if method in CACHEABLE_METHODS:
            ttl = result.get("ttlMs")
            valid = isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= 0 and ttl == ttl
            result["ttlMs"] = min(int(ttl), MAX_TTL_MS) if valid else ttl_ms
            if result.get("cacheScope") not in ("public", "private"):
                result["cacheScope"] = cache_scope
    else:
        # An extension's resultType (e.g. tasks) needs the extension advertised; Coffer advertises none.
        raise RpcError(INTERNAL_ERROR, f"the upstream answered {method} with resultType {str(kind)[:40]!r}, "
                                       "which Coffer does not bridge")
    meta = result.get("_meta")
    result["_meta"] = {**(meta if isinstance(meta, dict) else {}), META_SERVER_INFO: coffer_server_info()}
    return result


def shape_handshake_result(method: str, result, wrap_structured: bool = False) -> dict:
    """A complete result as a handshake-era client must receive it: no 2026 fields, and structuredContent an
    object (wrapped as {"result": value} when the tool's outputSchema was wrapped, or when it is not an object)."""
    result = dict(result) if isinstance(result, dict) else {}
    if result.get("resultType", "complete") != "complete":
        raise ValueError(f"not a complete result: resultType {result.get('resultType')!r}")
    for key in ("resultType", "ttlMs", "cacheScope"):
        result.pop(key, None)
    meta = result.get("_meta")
    if isinstance(meta, dict) and META_SERVER_INFO in meta:
        meta = {k: v for k, v in meta.items() if k != META_SERVER_INFO}
        if meta:
            result["_meta"] = meta
        else:
            del result["_meta"]
    if method == "tools/call" and "structuredContent" in result:
        value = result["structuredContent"]
        if wrap_structured or not (value is None or isinstance(value, dict)):
            result["structuredContent"] = {"result": value}
    return result


def shape_handshake_tool(tool: dict) -> tuple[dict, bool]:
    """A tool definition a handshake-era client accepts, and whether its results must be wrapped: 2025-11-25 wants
    outputSchema rooted at type "object" (the Python SDK rejects the whole tools/list otherwise)."""
    schema = tool.get("outputSchema")
    if "outputSchema" not in tool or (isinstance(schema, dict) and schema.get("type") == "object"):
        return tool, False
    if not isinstance(schema, (dict, bool)):
        return {k: v for k, v in tool.items() if k != "outputSchema"}, False  # not a schema at all: drop it
    return {**tool, "outputSchema": wrap_output_schema(schema)}, True


def wrap_output_schema(schema) -> dict:
    """``{"type":"object","properties":{"result": schema},"required":["result"]}``, with $schema and the $defs
    hoisted to the new root and other local $refs re-pointed, so references still resolve."""
    if isinstance(schema, bool):
        return {"type": "object", "properties": {"result": schema}, "required": ["result"]}
    inner = dict(schema)
    root: dict = {"type": "object"}
    if "$schema" in inner:
        root["$schema"] = inner.pop("$schema")
    if "$id" not in inner:  # with its own $id the inner schema stays a resource of its own and its refs resolve
        for key in ("$defs", "definitions"):
            if key in inner:
                root[key] = inner.pop(key)
        inner = _repoint_refs(inner)
    root["properties"] = {"result": inner}
    root["required"] = ["result"]
    return root


def _repoint_refs(schema):
    """Prefix local JSON-pointer $refs with /properties/result (except into the hoisted $defs); instance data
    (const, enum, default, examples) is copied untouched.  Bounded: a huge schema is left as it was."""
    budget = [_SCHEMA_WALK_LIMIT]

    def walk(node, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 64:
            raise OverflowError
        if isinstance(node, list):
            return [walk(item, depth + 1) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                pointer = value[1:]
                out[key] = value if pointer.startswith(("/$defs/", "/definitions/")) \
                    else "#/properties/result" + pointer
            elif key in ("const", "enum", "default", "examples"):
                out[key] = value
            else:
                out[key] = walk(value, depth + 1)
        return out

    try:
        return walk(schema, 0)
    except OverflowError:
        log.warning("an outputSchema was too large to re-point its $refs; wrapped it unchanged")
        return schema


class ListenFilter(NamedTuple):
    """What one subscriptions/listen stream asked for (or, after ``honoured``, what it will get)."""
    tools: bool
    prompts: bool
    resources: bool
    uris: tuple[str, ...]

    def honoured(self, offered: set[str], can_subscribe: bool) -> ListenFilter:
        """The subset Coffer delivers: kinds it advertises (``offered`` ⊆ {"tools","prompts","resources"})."""
        return ListenFilter(self.tools and "tools" in offered, self.prompts and "prompts" in offered,
                            self.resources and "resources" in offered, self.uris if can_subscribe else ())

    def wire(self) -> dict:
        filt: dict = {}
        for flag, key in ((self.tools, "toolsListChanged"), (self.prompts, "promptsListChanged"),
                          (self.resources, "resourcesListChanged")):
            if flag:
                filt[key] = True
        if self.uris:
            filt["resourceSubscriptions"] = list(self.uris)
        return filt

    def wants(self, kind: str) -> bool:
        return {"tools": self.tools, "prompts": self.prompts, "resources": self.resources}.get(kind, False)


def parse_listen_filter(params) -> ListenFilter:
    notifications = params.get("notifications") if isinstance(params, dict) else None
    if not isinstance(notifications, dict):
        raise RpcError(INVALID_PARAMS, "'notifications' must be an object")
    flags = []
    for key in ("toolsListChanged", "promptsListChanged", "resourcesListChanged"):
        value = notifications.get(key)
        if value is not None and not isinstance(value, bool):
            raise RpcError(INVALID_PARAMS, f"notifications.{key} must be a boolean")
        flags.append(value is True)
    uris = notifications.get("resourceSubscriptions")
    if uris is None:
        uris = []
    if not isinstance(uris, list) or len(uris) > MAX_LISTEN_URIS or not all(
            isinstance(u, str) and 0 < len(u) <= MAX_URI_LENGTH for u in uris):
        raise RpcError(INVALID_PARAMS, f"notifications.resourceSubscriptions must be a list of at most "
                                       f"{MAX_LISTEN_URIS} URIs")
    return ListenFilter(*flags, tuple(dict.fromkeys(uris)))


def listen_frame(method: str, subscription_id, params: dict | None = None) -> dict:
    """A notification on a listen stream: tagged with the listen request's own JSON-RPC id."""
    params = dict(params or {})
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    params["_meta"] = {**meta, META_SUBSCRIPTION_ID: subscription_id}
    return {"jsonrpc": "2.0", "method": method, "params": params}


def missing_capability(method: str, params, capabilities) -> dict | None:
    """The requiredCapabilities a -32021 must name when ``capabilities`` (one request's envelope) cannot serve an
    upstream's ``method`` request, else None.  A bare ``elicitation: {}`` means form support (the pre-modes shape)."""
    caps = capabilities if isinstance(capabilities, dict) else {}
    params = params if isinstance(params, dict) else {}
    if method == "sampling/createMessage":
        sampling = caps.get("sampling")
        wants_tools = bool(params.get("tools")) or params.get("toolChoice") is not None
        if isinstance(sampling, dict) and (not wants_tools or isinstance(sampling.get("tools"), dict)):
            return None
        return {"sampling": {"tools": {}} if wants_tools else {}}
    if method == "elicitation/create":
        elicitation = caps.get("elicitation")
        if params.get("mode") == "url":
            return None if isinstance(elicitation, dict) and isinstance(elicitation.get("url"), dict) \
                else {"elicitation": {"url": {}}}
        if isinstance(elicitation, dict) and ("form" in elicitation or "url" not in elicitation):
            return None
        return {"elicitation": {"form": {}}}
    if method == "roots/list":
        return None if isinstance(caps.get("roots"), dict) else {"roots": {}}
    return None


class InputRound(NamedTuple):
    """One validated input_required result from a modern upstream."""
    requests: dict          # key -> {"method": ..., "params": {...}}
    request_state: str | None


def parse_input_required(result) -> InputRound:
    """Validate an upstream's input_required result before acting on it (ValueError says what is wrong)."""
    if not isinstance(result, dict) or result.get("resultType") != "input_required":
        raise ValueError("not an input_required result")
    raw = result.get("inputRequests")
    state = result.get("requestState")
    if raw is None and state is None:
        raise ValueError("input_required with neither inputRequests nor requestState")
    if state is not None and (not isinstance(state, str) or len(state) > MAX_REQUEST_STATE):
        raise ValueError("requestState must be a string of at most 256 KiB")
    requests: dict = {}
    if raw is not None:
        if not isinstance(raw, dict) or len(raw) > MAX_INPUT_REQUESTS:
            raise ValueError(f"inputRequests must be an object of at most {MAX_INPUT_REQUESTS} entries")
        for key, request in raw.items():
            if not (isinstance(key, str) and 0 < len(key) <= 256) or not isinstance(request, dict):
                raise ValueError("each inputRequests entry needs a short string key and an object")
            method, params = request.get("method"), request.get("params", {})
            if method not in INPUT_REQUEST_METHODS or not isinstance(params, dict):
                raise ValueError(f"inputRequests[{key[:40]!r}] is not sampling, elicitation or roots")
            requests[key] = {"method": method, "params": params}
    return InputRound(requests, state)


class DiscoverVerdict(NamedTuple):
    """What an upstream's answer to Coffer's server/discover probe says about its era."""
    era: str                # "modern", "handshake" or "incompatible"
    retry_discover: bool    # -32022 named a version we speak: ask once more before adopting it
    result: dict | None     # the DiscoverResult when era == "modern" and no retry is needed
    reason: str


def classify_discover_reply(response) -> DiscoverVerdict:
    """The spec's stdio probe (basic/transports/stdio.mdx "Backward Compatibility"): a DiscoverResult or a
    recognised modern error means modern; anything else - any other error, no answer, junk - means handshake.
    ``response`` is the JSON-RPC response dict, or None for a timeout."""
    if not isinstance(response, dict):
        return DiscoverVerdict("handshake", False, None, "no answer to server/discover")
    error = response.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        data = error.get("data") if isinstance(error, dict) else None
        supported = data.get("supported") if isinstance(data, dict) else None
        if code == UNSUPPORTED_PROTOCOL_VERSION and isinstance(supported, list):
            if any(v in MODERN_PROTOCOL_VERSIONS for v in supported):
                return DiscoverVerdict("modern", True, None, "server/discover asked for a version we speak")
            if not any(v in PROTOCOL_VERSIONS for v in supported):
                shown = ", ".join(str(v)[:20] for v in supported[:5])
                return DiscoverVerdict("incompatible", False, None,
                                       f"the server speaks only {shown}; Coffer speaks "
                                       f"{', '.join(MODERN_PROTOCOL_VERSIONS + PROTOCOL_VERSIONS)}")
        return DiscoverVerdict("handshake", False, None, f"server/discover answered error {code}")
    result = response.get("result")
    versions = result.get("supportedVersions") if isinstance(result, dict) else None
    if isinstance(versions, list) and any(v in MODERN_PROTOCOL_VERSIONS for v in versions) \
            and isinstance(result.get("capabilities"), dict):
        return DiscoverVerdict("modern", False, result, "server/discover answered")
    return DiscoverVerdict("handshake", False, None, "server/discover named no version Coffer speaks")


def _b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _b64u_decode(text: str) -> bytes:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64u(raw) != text:  # only the canonical encoding: one token, one spelling
        raise ValueError("non-canonical base64url")
    return raw


def modern_error(message: dict) -> dict:
    """An error reply as a 2026-07-28 client may receive it: the legacy-range codes Coffer and handshake upstreams
    use (-32001 timeout, -32003 unreachable, -32002 resource not found, -32042 URL elicitation) are replaced by the
    standard ones the 2026 spec allows, with what they meant in ``data``."""
    error = message.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    mapped = {-32001: (INTERNAL_ERROR, "upstream_timeout"), -32003: (INTERNAL_ERROR, "upstream_unavailable"),
              -32002: (INVALID_PARAMS, "resource_not_found"), -32042: (INTERNAL_ERROR, "url_elicitation_required")}
    if code not in mapped:
        return message
    new_code, meaning = mapped[code]
    data = error.get("data")
    return {**message, "error": {"code": new_code, "message": error.get("message", ""),
                                 "data": {"coffer": meaning, **({"detail": data} if data is not None else {})}}}


class RequestStateSealer:
    """Coffer's own requestState: a claims object, HMAC-SHA256 under a key that lives only in this process.

    The spec makes an echoed requestState attacker-controlled (basic/patterns/mrtr.mdx, server requirements 4-5):
    the seal gives integrity, ``exp`` a short life, and m/t/a bind it to the request it answers (method, the name
    or URI the client used, a digest of the arguments).  One ``coffer serve`` serves one client, so the process
    key is the principal binding; a restart invalidates every state, as it must (the parked calls died with it).
    Stateless and thread-safe: the client reader thread unseals, upstream reader threads seal.
    """

    PREFIX = "c1."
    _LABEL = b"coffer/request-state/v1\x00"

    def __init__(self, key: bytes | None = None, ttl: float = 300.0, clock=time.time):
        self._key = key if key is not None else os.urandom(32)
        self.ttl = float(ttl)
        self._clock = clock

    @staticmethod
    def binding(method: str, params) -> tuple[str, str]:
        """(target, arguments digest) of a request: the URI for resources/read, else the name."""
        params = params if isinstance(params, dict) else {}
        if method == "resources/read":
            target, arguments = params.get("uri"), {}
        else:
            target, arguments = params.get("name"), params.get("arguments") or {}
        canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return str(target)[:1024], _b64u(hashlib.sha256(canonical.encode("ascii")).digest()[:16])

    def seal(self, method: str, params, claims: dict) -> str:
        target, digest = self.binding(method, params)
        payload = {**claims, "v": 1, "m": method, "t": target, "a": digest, "exp": int(self._clock() + self.ttl)}
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        mac = hmac.new(self._key, self._LABEL + body, hashlib.sha256).digest()
        return f"{self.PREFIX}{_b64u(body)}.{_b64u(mac)}"

    def unseal(self, token, method: str, params) -> dict:
        """The claims of a state this process sealed for this very request, or -32602 (the SDK's words; the real
        reason goes to the log only)."""
        reason = None
        claims = None
        try:
            if not isinstance(token, str) or len(token) > MAX_REQUEST_STATE * 2 or not token.startswith(self.PREFIX):
                raise ValueError("malformed")
            body_text, _, mac_text = token[len(self.PREFIX):].partition(".")
            body, mac = _b64u_decode(body_text), _b64u_decode(mac_text)
            expected = hmac.new(self._key, self._LABEL + body, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, expected):
                raise ValueError("seal")
            claims = json.loads(body)
            if not isinstance(claims, dict) or claims.get("v") != 1:
                raise ValueError("malformed")
            exp = claims.get("exp")
            if not isinstance(exp, int) or isinstance(exp, bool) or not self._clock() < exp:
                raise ValueError("expired")
            if (claims.get("m"), claims.get("t"), claims.get("a")) != (method, *self.binding(method, params)):
                raise ValueError("bound to another request")
        except (ValueError, UnicodeDecodeError) as exc:  # json errors are ValueErrors too
            reason = str(exc) or "malformed"
        if reason is not None:
            log.warning("requestState refused on %s: %s", method, reason)
            raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
        return claims


# ============================================================================================================
# 2. Names and secrets: exposed names, ${VAR} references, the secret store, an upstream's environment
# ============================================================================================================


def check_server_name(name: str) -> str:
    if not isinstance(name, str) or not SERVER_NAME_RE.match(name):
        raise CofferError(f"invalid server name {name!r}: use 1-24 letters, digits or '-'")
    if name.lower() == RESERVED_SERVER:
        raise CofferError(f"server name {name!r} is reserved for Coffer's own tools")
    return name


_DIGEST_WIDTHS = (6, 8, 10, 12, 16, 24, 32, 64)


def _natural_name(server: str, name: str, max_length: int) -> str | None:
    full = f"{server}{SEPARATOR}{name}"
    return full if len(full) <= max_length and EXPOSED_NAME_RE.match(full) else None


def _shortened_name(server: str, name: str, max_length: int, width: int) -> str:
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:width]
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    room = max(1, max_length - len(server) - len(SEPARATOR) - width - 1)
    return f"{server}{SEPARATOR}{safe[:room].rstrip('_') or 'x'}_{digest}"


def expose_name(server: str, name: str, max_length: int = DEFAULTS["name_max_length"]) -> str:
    """``<server>__<name>``, or — when that is too long or not a legal MCP tool name — a readable prefix plus six hex
    digits of the name's hash, stable across restarts and machines.  This is the name a tool gets when nothing
    collides with it; ``exposed_names`` decides for a whole list."""
    return _natural_name(server, name, max_length) or _shortened_name(server, name, max_length, 6)


def exposed_names(server: str, names, max_length: int) -> dict[str, str]:
    """{upstream name: exposed name} for one server's tools (or prompts), collision-free by construction.

    Server names hold no '_', so ``<server>__`` prefixes never collide and only one server's own names can.
    The result depends only on the set of names, and an established name is never taken over: first every name
    that must be shortened gets its six-digit form (in sorted order); then a name that fits keeps itself unless
    one of those took it (a tool literally named like another's shortened form is itself shortened); every name
    still unplaced takes the shortest longer hash that is free.  No tool is ever hidden by another.
    """
    result: dict[str, str] = {}
    taken: set[str] = set()
    natural = {name: _natural_name(server, name, max_length) for name in names}
    pending = []
    for name in sorted(n for n, full in natural.items() if full is None):
        exposed = _shortened_name(server, name, max_length, _DIGEST_WIDTHS[0])
        if exposed in taken:
            pending.append(name)
        else:
            result[name] = exposed
            taken.add(exposed)
    for name, full in natural.items():
        if full is not None:
            if full in taken:
                pending.append(name)
            else:
                result[name] = full
                taken.add(full)
    for name in sorted(pending):
        for width in _DIGEST_WIDTHS[1:]:
            exposed = _shortened_name(server, name, max_length, width)
            if exposed not in taken:
                break
        result[name] = exposed
        taken.add(exposed)
    return result


def qualify_uri(server: str, uri: str) -> str:
    """The exposed form of a resource URI that two upstreams both publish."""
    return f"coffer+{server}:{uri}"


# -- ${VAR} references and the secret store ------------------------------------------------------------------

_ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
SECRET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")


def expand_vars(value: str, environ=None, missing=None, secrets: SecretStore | None = None,
                substituted: list | None = None) -> str:
    """Expand ``${VAR}`` and ``${VAR:-default}``: from the environment first, then from the secret store.

    Values are stored unexpanded, so a secret only ever exists in the gateway's and the upstream's memory.
    Names found nowhere (and without a default) are appended to ``missing``; the values put in place of a
    reference, as (name, value), to ``substituted`` (what may then need redacting wherever it shows up).
    """
    environ = os.environ if environ is None else environ

    def replace(match):
        name, default = match.group(1), match.group(2)
        current = environ.get(name)
        if current is None and secrets is not None:
            current = secrets.get(name)
        if current is None or (current == "" and default is not None):
            if default is None and missing is not None:
                missing.append(name)
            return default or ""
        if substituted is not None:
            substituted.append((name, current))
        return current

    return _ENV_REF_RE.sub(replace, value)


class SecretStore:
    """Named secret values, in COFFER_HOME/secrets.json (0600 inside the 0700 home), never in coffer.db.

    Why a file rather than an OS keychain: none is reachable from the standard library on all three systems
    (macOS needs the `security` tool, Windows DPAPI needs ctypes, Linux's Secret Service needs a D-Bus session that
    a headless or SSH agent host usually lacks), and the agent host must work air-gapped and unattended.  A private
    file is what ssh, aws and gh use; it is as safe as the user's account.

    Any thread, any process: a read re-parses the file only when its mtime or size changed; a write replaces it
    atomically (write a private temporary file, then rename), so no reader ever sees half of it.  Every value read
    is registered with the redactor, so it never reaches a log or the terminal.
    """

    MAX_BYTES = 1 << 20

    def __init__(self, home: str):
        self.path = os.path.join(home, "secrets.json")
        self._values: dict[str, str] = {}
        self._stamp = None
        self._problem: str | None = None
        self._lock = threading.Lock()

    def _read(self) -> dict[str, str]:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CofferError(f"cannot read the secret store {self.path}: {exc.strerror or exc}") from None
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        with self._lock:
            if stamp == self._stamp:
                if self._problem:
                    raise CofferError(self._problem)
                return self._values
        problem, values = None, {}
        try:
            if info.st_size > self.MAX_BYTES:
                raise ValueError(f"larger than {self.MAX_BYTES} bytes")
            with open(self.path, "rb") as handle:
                data = decode_json(handle.read(self.MAX_BYTES + 1))
            if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in data.items()):
                raise ValueError("not an object of names to text values")
            values = data
        except (OSError, ValueError) as exc:
            problem = f"the secret store {self.path} is damaged ({exc}); fix or remove it"
        redact.add_named(values.items())
        with self._lock:
            self._values, self._stamp, self._problem = values, stamp, problem
        if problem:
            raise CofferError(problem)
        return values

    def get(self, name: str) -> str | None:
        """The value, or None when absent (a damaged store is logged once and treated as empty)."""
        try:
            return self._read().get(name)
        except CofferError as exc:
            if self._problem != getattr(self, "_reported", None):
                self._reported = self._problem
                log.warning("%s", exc)
            return None

    def names(self) -> list[str]:
        return sorted(self._read())

    def values(self) -> list[str]:
        try:
            return list(self._read().values())
        except CofferError:
            return []

    def set(self, name: str, value: str) -> None:
        if not SECRET_NAME_RE.match(name or ""):
            raise CofferError(f"invalid secret name {name!r}: use letters, digits and _ (start with a letter)")
        if not isinstance(value, str) or "\x00" in value or len(value) > 64 << 10:
            raise CofferError("a secret value must be text without NUL bytes, at most 64 KiB")
        values = dict(self._read())
        values[name] = value
        self._write(values)

    def delete(self, name: str) -> bool:
        values = dict(self._read())
        if values.pop(name, None) is None:
            return False
        self._write(values)
        return True

    def _write(self, values: dict[str, str]) -> None:
        temporary = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(json.dumps(values, indent=1, sort_keys=True).encode("utf-8"))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except OSError as exc:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise CofferError(f"cannot write the secret store {self.path}: {exc.strerror or exc}") from None
        redact.add_named(values.items())
        with self._lock:
            self._stamp = None  # re-read on next use, whoever wrote last


_AUTH_SCHEME_RE = re.compile(r"^(Bearer|Basic|Token|Bot|Digest)\s+(\S.*)$", re.I | re.S)


def secret_name_for(server: str, key: str) -> str:
    """The store name a literal value of ``key`` gets: ``<SERVER>_<KEY>`` (GITHUB_TOKEN of server github stays
    GITHUB_TOKEN), a legal ${NAME}."""
    prefix = re.sub(r"[^A-Z0-9]+", "_", server.upper()).strip("_")
    key = re.sub(r"[^A-Z0-9]+", "_", key.upper()).strip("_") or "VALUE"
    name = key if key.startswith(prefix + "_") else f"{prefix}_{key}"
    return name if not name[0].isdigit() else f"S_{name}"


def plan_literals(server: str, values: dict[str, str], secrets: SecretStore, header: bool = False,
                  overwrite: bool = False, planned: dict | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The one rule for literal --env/--header values (add, import): each goes to the secret store and the
    definition keeps a ${NAME} reference.  Returns (the mapping with references, {name: value} to store), and
    writes nothing: the caller stores them only once the definition is accepted (``save_secrets``).

    Any value that holds no ${...} reference counts as literal: Coffer cannot tell a token from a setting, and a
    setting in the store costs nothing.  For an Authorization-style header only the credential moves
    ("Bearer ${NAME}"), so the stored definition still reads as what it is.  A name already holding another
    value gets a numbered twin, unless ``overwrite`` (the server's definition is being replaced).  ``planned``
    shares names across calls of one run (an import of many servers).
    """
    planned = {} if planned is None else planned
    result, mine = {}, {}
    for key, value in values.items():
        if value == "" or _ENV_REF_RE.search(value):
            result[key] = value
            continue
        scheme, credential = "", value
        match = _AUTH_SCHEME_RE.match(value) if header else None
        if match:
            scheme, credential = match.group(1) + " ", match.group(2)
        base = secret_name_for(server, key)
        name, n = base, 1
        while True:
            held = planned.get(name)
            held = secrets.get(name) if held is None else held
            if held is None or held == credential or (overwrite and name not in planned):
                break
            n += 1
            name = f"{base}_{n}"
        planned[name] = mine[name] = credential
        result[key] = f"{scheme}${{{name}}}"
    return result, mine


_SECRET_QUERY_RE = re.compile(r"(?i)^(?:.*[_-])?(?:key|token|secret|password|passwd|pwd|auth|signature|sig|"
                              r"credential|apikey|access[_-]?token)$")


def plan_url_literals(server: str, url: str, secrets: SecretStore, overwrite: bool = False,
                      planned: dict | None = None) -> tuple[str, dict[str, str]]:
    """A URL with its credentials moved to the store like --env values: the password of user:password@ and query
    parameters named like keys and tokens (?api_key=...) become ${NAME} references."""
    parts = urllib.parse.urlsplit(url)
    moved: dict[str, str] = {}
    netloc = parts.netloc
    if parts.password and "${" not in parts.password:
        refs, found = plan_literals(server, {"URL_PASSWORD": parts.password}, secrets, overwrite=overwrite,
                                    planned=planned)
        moved.update(found)
        netloc = netloc.replace(":" + parts.password + "@", ":" + refs["URL_PASSWORD"] + "@", 1)
    query = []
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY_RE.match(key) and value and "${" not in value:
            refs, found = plan_literals(server, {f"URL_{key}": value}, secrets, overwrite=overwrite, planned=planned)
            moved.update(found)
            value = refs[f"URL_{key}"]
        query.append(f"{urllib.parse.quote(key, safe='')}={value if '${' in value else urllib.parse.quote(value)}")
    if not moved:
        return url, moved
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "&".join(query), parts.fragment)), moved


def save_secrets(secrets: SecretStore, values: dict[str, str]) -> None:
    for name, value in values.items():
        if secrets.get(name) != value:
            secrets.set(name, value)


def resolution_digest(config: dict, secrets: SecretStore | None) -> str:
    """A digest of what a server's ${NAME} references resolve to now: when `coffer secret set` changes one, a
    running gateway restarts that server with the new value (and only that server)."""
    texts = [config.get("url") or "", config.get("cwd") or "", *(config.get("command") or ()),
             *(config.get("env") or {}).values(), *(config.get("headers") or {}).values()]
    names = sorted({match.group(1) for text in texts for match in _ENV_REF_RE.finditer(text)})
    values = [f"{name}={os.environ[name] if name in os.environ else (secrets.get(name) if secrets else None)}"
              for name in names]
    return hashlib.sha256("\0".join(values).encode("utf-8", "surrogatepass")).hexdigest()


# -- an upstream's environment -------------------------------------------------------------------------------
# A stdio upstream gets what a program needs to run and to reach the user's package registry through the
# user's proxy and certificates, plus its own --env; never the rest of Coffer's environment, where other
# servers' tokens and the user's cloud keys live.  --inherit-env NAME (or '*') passes more, explicitly.

SAFE_ENV_NAMES = frozenset("""
PATH HOME USER LOGNAME USERNAME SHELL TERM COLORTERM LANG LANGUAGE TZ TMPDIR TMP TEMP PWD
HTTP_PROXY HTTPS_PROXY NO_PROXY ALL_PROXY FTP_PROXY SSL_CERT_FILE SSL_CERT_DIR REQUESTS_CA_BUNDLE CURL_CA_BUNDLE
NODE_EXTRA_CA_CERTS GIT_SSL_CAINFO JAVA_HOME GOPATH GOROOT GOPROXY CARGO_HOME RUSTUP_HOME DENO_DIR BUN_INSTALL
PNPM_HOME COREPACK_HOME
SYSTEMROOT SYSTEMDRIVE WINDIR COMSPEC PATHEXT APPDATA LOCALAPPDATA PROGRAMDATA PROGRAMFILES PROGRAMFILES(X86)
PROGRAMW6432 COMMONPROGRAMFILES COMMONPROGRAMFILES(X86) USERPROFILE HOMEDRIVE HOMEPATH PUBLIC ALLUSERSPROFILE
NUMBER_OF_PROCESSORS PROCESSOR_ARCHITECTURE OS __CF_USER_TEXT_ENCODING
""".split())
SAFE_ENV_PREFIXES = ("LC_", "NPM_CONFIG_", "PIP_", "UV_", "PIPX_", "PYENV_", "NVM_", "VOLTA_", "XDG_")


def upstream_environment(own: dict[str, str], inherit=(), environ=None) -> dict[str, str]:
    """The environment a stdio upstream starts with: the safe subset of ``environ``, what ``inherit`` names (or
    all of it for '*'), then the server's own --env on top."""
    environ = os.environ if environ is None else environ
    wanted = {name.upper() for name in inherit}
    everything = "*" in wanted
    env = {key: value for key, value in environ.items()
           if everything or key.upper() in SAFE_ENV_NAMES or key.upper().startswith(SAFE_ENV_PREFIXES)
           or key.upper() in wanted}
    env.update(own)
    return env


def parse_env_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not ENV_KEY_RE.match(key):
        raise CofferError(f"bad --env {text!r}: expected KEY=VALUE with KEY a valid variable name")
    return key, value


# ============================================================================================================
# 3. Vault: coffer.db
# ============================================================================================================

SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS servers (
    name TEXT PRIMARY KEY,
    transport TEXT NOT NULL,                 -- 'stdio'; remote: 'http', 'sse', or 'auto' (not yet detected)
    command TEXT,                            -- JSON argv, unexpanded
    url TEXT,
    env TEXT NOT NULL DEFAULT '{}',          -- JSON, unexpanded: ${VAR} references, literal values never
    headers TEXT NOT NULL DEFAULT '{}',      -- JSON, unexpanded, like env
    cwd TEXT,
    enabled INTEGER NOT NULL DEFAULT 1,
    policy TEXT NOT NULL DEFAULT 'enabled',  -- what a capability seen for the first time gets
    timeout REAL,                            -- per-call timeout in seconds; NULL = the global default
    position INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    status TEXT, status_detail TEXT, status_at TEXT,
    capabilities TEXT,                       -- JSON: what the server advertised at its last initialize
    inherit_env TEXT NOT NULL DEFAULT '[]',  -- JSON: names of Coffer's environment variables it also gets
    updates TEXT NOT NULL DEFAULT 'pin',     -- 'pin': a changed definition waits for `coffer approve`; 'trust'
    oauth TEXT,                              -- JSON: OAuth client settings (client_id, client_secret_env, login_at);
                                             -- names and a time only: tokens live in the secret store
    era TEXT                                 -- 'handshake' or 'modern' (MCP 2026-07-28) at its last start; NULL: probe
);
CREATE TABLE IF NOT EXISTS capabilities (
    server TEXT NOT NULL,
    kind TEXT NOT NULL,                      -- tool, prompt, resource, template
    name TEXT NOT NULL,                      -- the upstream's own name or URI
    enabled INTEGER NOT NULL,
    present INTEGER NOT NULL DEFAULT 1,      -- 0 once the upstream stops listing it; the choice is kept
    fingerprint TEXT,                        -- of the definition the upstream lists now
    definition TEXT,                         -- last advertised definition (schemas, never call data)
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    approved TEXT,                           -- fingerprint the user accepted; differs from fingerprint = quarantined
    approved_definition TEXT,                -- that definition, for the diff `coffer approve` shows
    PRIMARY KEY (server, kind, name)
);
CREATE TABLE IF NOT EXISTS invocations (
    id INTEGER PRIMARY KEY,
    ts TEXT NOT NULL, client TEXT, server TEXT, capability TEXT, kind TEXT,
    duration_ms REAL, status TEXT NOT NULL, error TEXT
);
CREATE INDEX IF NOT EXISTS invocations_ts ON invocations(ts);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    ts TEXT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT, detail TEXT
);
CREATE INDEX IF NOT EXISTS audit_ts ON audit(ts);
"""
# Columns added after the first release: (table, column, declaration).  A vault written by an earlier Coffer gains
# them on open; an approved fingerprint of NULL means "accept what is listed next" (no quarantine on upgrade).
MIGRATIONS = (
    ("servers", "capabilities", "TEXT"),
    ("servers", "inherit_env", "TEXT NOT NULL DEFAULT '[]'"),
    ("servers", "updates", "TEXT NOT NULL DEFAULT 'pin'"),
    ("servers", "oauth", "TEXT"),
    ("servers", "era", "TEXT"),
    ("capabilities", "approved", "TEXT"),
    ("capabilities", "approved_definition", "TEXT"),
)

CAPABILITY_KINDS = ("tool", "prompt", "resource", "template")
TRANSPORTS = ("stdio", "http", "sse", "auto")
PRIVATE_FILES = ("coffer.db", "coffer.db-wal", "coffer.db-shm", "secrets.json")


def coffer_home() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("COFFER_HOME") or os.path.join("~", ".coffer")))


def vault_json(value) -> str:
    """JSON for a vault column: ASCII, so no string an upstream sent (a lone surrogate included) can fail the
    write, and it decodes back to exactly the same value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def storable(text):
    """Text for a vault column or a log: lone surrogates replaced, so SQLite's UTF-8 encoding cannot fail."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


# What a definition's pin covers: everything the model reads or the call depends on, not the volatile fields
# (a resource's size or modification time changes with its content, not with its meaning).
_UNPINNED_FIELDS = {"tool": ("_meta",), "prompt": ("_meta",), "resource": ("_meta", "size", "annotations"),
                    "template": ("_meta", "annotations")}


def fingerprint(definition: dict, kind: str = "tool") -> str:
    pinned = {k: v for k, v in definition.items() if k not in _UNPINNED_FIELDS.get(kind, ())}
    return hashlib.sha256(json.dumps(pinned, sort_keys=True, ensure_ascii=True).encode("ascii")).hexdigest()[:16]


class CapabilityState(NamedTuple):
    """The user's standing choice for one capability: enabled or not, and quarantined when its definition changed
    since the user (or the first listing) accepted it."""
    enabled: bool
    quarantined: bool = False

    @property
    def usable(self) -> bool:
        return self.enabled and not self.quarantined


def _private_path(path: str, directory: bool) -> str | None:
    """Make ``path`` accessible to its owner only; a notice when it was not (POSIX; Windows ACLs are left alone)."""
    if os.name != "posix":
        return None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    if not mode & 0o077:
        return None
    wanted = 0o700 if directory else mode & 0o600
    try:
        os.chmod(path, wanted)
    except OSError as exc:
        return f"{path} is readable by other users (mode {mode:04o}) and could not be fixed: {exc.strerror}"
    return f"{path} was readable by other users (mode {mode:04o}); now {wanted:04o}"


_reported_settings: set[str] = set()


class Vault:
    """coffer.db: the registered servers, the user's choices, and the logs.

    Every change is one transaction.  Many processes share the file (several ``coffer serve`` plus the CLI), so
    it runs in WAL mode with a busy timeout, and writers keep their transactions short.  COFFER_HOME is 0700 and
    every file in it 0600; looser permissions are fixed on open, with a notice.  A vault that cannot be written
    (a read-only file or directory) opens read-only: reading commands work, changing ones say why they cannot.
    One damaged row costs that row only: a server whose definition does not parse is reported and not started,
    a setting that does not parse falls back to its default with a warning.
    """

    def __init__(self, home: str | None = None, actor: str = "cli"):
        self.home = home or coffer_home()
        self.actor = actor
        self.read_only = False
        if not os.path.isdir(self.home):
            try:
                os.makedirs(self.home, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise CofferError(f"cannot create {self.home}: {exc.strerror or exc}") from None
        self.path = os.path.join(self.home, "coffer.db")
        self.secrets = SecretStore(self.home)
        was_empty = os.path.isfile(self.path) and os.path.getsize(self.path) == 0
        if not os.path.exists(self.path):
            try:  # created private from the start; SQLite gives -wal and -shm the same mode
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError:
                pass  # a race with another process, or a read-only home: connecting says which
        try:
            self.db = self._connect(self.path)
            self._migrate()
        except sqlite3.OperationalError as exc:
            if not self._cannot_write(exc):
                raise
            self._open_read_only(exc)
        for notice in filter(None, [_private_path(self.home, True)] +
                             [_private_path(os.path.join(self.home, name), False) for name in PRIVATE_FILES]):
            log.warning("%s", notice)
        if was_empty:
            log.warning("coffer.db in %s was EMPTY (0 bytes): it now holds a new, empty vault. Your servers, "
                        "choices and logs are gone unless you restore the file from a backup.", self.home)
        self.secrets.values()  # registers the stored secrets with the redactor before anything is printed

    @staticmethod
    def _connect(path: str, uri: bool = False) -> sqlite3.Connection:
        db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False, uri=uri)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA busy_timeout=10000")
        if not uri:
            try:
                db.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:
                pass  # another process is switching it right now (WAL is persistent), or the file is read-only
            db.execute("PRAGMA synchronous=NORMAL")
        return db

    @staticmethod
    def _cannot_write(exc: sqlite3.Error) -> bool:
        text = str(exc).lower()
        return "readonly" in text or "read-only" in text or "unable to open" in text

    def _migrate(self) -> None:
        tables = {row["name"] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [(t, c, d) for t, c, d in MIGRATIONS if t in tables and c not in
                   {row["name"] for row in self.db.execute(f"PRAGMA table_info({t})")}]
        if tables >= {"settings", "servers", "capabilities", "invocations", "audit"} and not missing:
            return  # nothing to write: a read-only vault opens without a write
        script = SCHEMA + "".join(f"ALTER TABLE {t} ADD COLUMN {c} {d};\n" for t, c, d in missing)
        try:
            self.db.executescript(f"BEGIN IMMEDIATE;\n{script}COMMIT;")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def _open_read_only(self, cause: sqlite3.Error) -> None:
        location = "file:" + self.path.replace("?", "%3f").replace("#", "%23")
        last = cause
        for suffix in ("?mode=ro", "?immutable=1"):  # immutable: a read-only directory where -shm cannot exist
            try:
                self.db = self._connect(location + suffix, uri=True)
                self.db.execute("SELECT count(*) FROM servers").fetchone()
                break
            except sqlite3.Error as exc:
                last = exc
        else:
            raise CofferError(f"cannot open the vault {self.path}: {last}") from None
        self.read_only = True
        log.warning("the vault %s is read-only (%s): commands that only read work, changes are refused",
                    self.path, cause)

    def transaction(self):
        if self.read_only:
            raise CofferError(f"the vault {self.path} is read-only: this command would change it")
        return _Transaction(self.db)

    def close(self) -> None:
        self.db.close()

    # -- settings ------------------------------------------------------------------------------------------
    def setting(self, key: str):
        return self.settings().get(key, DEFAULTS.get(key))

    def settings(self) -> dict:
        """Every setting; a stored value that does not parse or is out of range counts as the default (warned
        once per process), so a damaged row can never stop the gateway."""
        current = dict(DEFAULTS)
        for row in self.db.execute("SELECT key, value FROM settings"):
            key = row["key"]
            if setting_key(key) not in DEFAULTS:
                continue  # written by a newer Coffer
            try:
                current[key] = _checked_setting(key, json.loads(row["value"]))
            except (ValueError, TypeError, CofferError) as exc:
                if key not in _reported_settings:
                    _reported_settings.add(key)
                    log.warning("setting %s in coffer.db is damaged (%s); using the default %r "
                                "(fix: coffer config %s VALUE)", key, exc, DEFAULTS[setting_key(key)], key)
        return current

    def set_setting(self, key: str, raw: str) -> None:
        """Change a setting; for a per-client one (expose.cursor), an empty value removes the override."""
        if setting_key(key) not in DEFAULTS:
            raise CofferError(f"unknown setting {key!r}{_did_you_mean(key, DEFAULTS)}; known: "
                              f"{', '.join(sorted(DEFAULTS))}, expose.<client>")
        with self.transaction() as db:
            old = self.setting(key)
            if key != setting_key(key) and raw == "":
                db.execute("DELETE FROM settings WHERE key=?", (key,))
                self._audit(db, "config", key, f"{old!r} -> (the global expose)")
                return
            value = _checked_setting(key, raw)
            db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)", (key, json.dumps(value)))
            self._audit(db, "config", key, f"{old!r} -> {value!r}")

    def tool_usage(self, days: int = 90) -> dict[str, int]:
        """Calls per exposed tool name in the last ``days`` (from the invocation log): what budgets keep."""
        since = (datetime.now(timezone.utc) - timedelta(days=days)).isoformat().replace("+00:00", "Z")
        return {row["capability"]: row["n"] for row in self.db.execute(
            "SELECT capability, count(*) AS n FROM invocations WHERE kind='tool' AND ts >= ? GROUP BY capability",
            (since,))}

    # -- servers -------------------------------------------------------------------------------------------
    def add_server(self, name, *, command=None, url=None, env=None, headers=None, cwd=None, policy=None,
                   timeout=None, inherit_env=None, transport=None, oauth=None, replace: bool = False) -> int:
        """Register a server, or with ``replace`` change an existing one's definition (its capability choices
        stay).  Returns how many earlier choices apply: those of the server being replaced, or — after `remove`
        and `add` of the same name — the ones kept from before the removal (for the audit retention period)."""
        with self.transaction() as db:
            return self.put_server(db, name, command=command, url=url, env=env, headers=headers, cwd=cwd,
                                   policy=policy, timeout=timeout, inherit_env=inherit_env, transport=transport,
                                   oauth=oauth, replace=replace)

    def put_server(self, db, name, *, command=None, url=None, env=None, headers=None, cwd=None, policy=None,
                   timeout=None, inherit_env=None, transport=None, oauth=None, replace: bool = False,
                   action: str | None = None, detail: str | None = None) -> int:
        """``add_server`` inside a transaction the caller holds (an import writes many servers in one); the one
        place a servers row is written.  Values must already be references, never literal secrets."""
        check_server_name(name)
        if bool(command) == bool(url):
            raise CofferError("give either a command after '--' (stdio) or --url (Streamable HTTP)")
        if policy not in (None, "enabled", "disabled"):
            raise CofferError(f"bad policy {policy!r}: use 'enabled' or 'disabled'")
        if timeout is not None and not (timeout > 0):
            raise CofferError("--timeout must be a positive number of seconds")
        transport = transport or ("auto" if url else "stdio")
        if transport not in (REMOTE_TRANSPORTS if url else ("stdio",)):
            raise CofferError(f"bad transport {transport!r} for a {'remote' if url else 'local'} server")
        if url:
            check_remote_url(url)
        definition = (transport, vault_json(command) if command else None, url, vault_json(env or {}),
                      vault_json(headers or {}), cwd, timeout, vault_json(list(inherit_env or [])),
                      vault_json(oauth) if oauth else None)
        target = url or " ".join(shlex.quote(part) for part in command)
        existing = db.execute("SELECT name FROM servers WHERE lower(name)=lower(?)", (name,)).fetchone()
        if existing and not (replace and existing["name"] == name):
            raise CofferError(f"server {existing['name']!r} already exists; `coffer add {name} ... --replace` "
                              f"changes its definition and keeps its choices")
        if existing:
            db.execute("UPDATE servers SET transport=?, command=?, url=?, env=?, headers=?, cwd=?, timeout=?,"
                       " inherit_env=?, oauth=?, policy=coalesce(?, policy), status=NULL, status_detail=NULL,"
                       " status_at=NULL WHERE name=?", (*definition, policy, name))
        else:
            position = db.execute("SELECT coalesce(max(position), 0) + 1 FROM servers").fetchone()[0]
            db.execute(
                "INSERT INTO servers(transport, command, url, env, headers, cwd, timeout, inherit_env, oauth, name,"
                " policy, position, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (*definition, name, policy or "enabled", position, utcnow()))
        self._audit(db, action or ("replace" if existing else "add"), name, detail or target)
        return db.execute("SELECT count(*) FROM capabilities WHERE server=?", (name,)).fetchone()[0]

    def remove_server(self, name: str) -> None:
        """Unregister a server.  Its capability choices are kept (not listed, not callable) until the audit
        retention period ends, so adding the same name again restores them."""
        with self.transaction() as db:
            self._require_server(db, name)
            db.execute("DELETE FROM servers WHERE name=?", (name,))
            db.execute("UPDATE capabilities SET present=0 WHERE server=?", (name,))
            self._audit(db, "remove", name, None)

    def servers(self) -> list[dict]:
        """Every registered server; one whose row is damaged carries ``damaged`` (the reason) and is disabled."""
        return [_server_row(row) for row in self.db.execute("SELECT * FROM servers ORDER BY position, name")]

    def server(self, name: str) -> dict:
        row = self.db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}{_did_you_mean(name, self._all_names())}")
        return _server_row(row)

    def set_transport(self, name: str, transport: str) -> None:
        """Remember which transport a remote server turned out to speak (transport auto)."""
        if transport not in REMOTE_TRANSPORTS:
            raise CofferError(f"bad transport {transport!r}")
        with self.transaction() as db:
            old = self._require_server(db, name)["transport"]
            if old == transport or old == "stdio":
                return
            db.execute("UPDATE servers SET transport=? WHERE name=?", (transport, name))
            self._audit(db, "transport", name, f"{old} -> {transport}")

    def record_era(self, name: str, era: str | None) -> None:
        """Which protocol era a server spoke at its last start, so the next start skips the probe (no audit row:
        it is an observation, not a change of the user's)."""
        with self.transaction() as db:
            db.execute("UPDATE servers SET era=? WHERE name=?", (era, name))

    def set_oauth(self, name: str, oauth: dict | None) -> None:
        """A remote server's OAuth client settings (never a secret: a client secret is named by variable)."""
        with self.transaction() as db:
            self._require_server(db, name)
            db.execute("UPDATE servers SET oauth=? WHERE name=?", (vault_json(oauth) if oauth else None, name))
            self._audit(db, "oauth", name, "logged in" if (oauth or {}).get("login_at") else "login settings")

    def set_policy(self, name: str, policy: str) -> None:
        """enabled|disabled: what capabilities the server adds later start as; trust-updates|pin-updates: whether a
        changed definition applies at once or waits for `coffer approve`."""
        column, value = {"enabled": ("policy", "enabled"), "disabled": ("policy", "disabled"),
                         "trust-updates": ("updates", "trust"), "pin-updates": ("updates", "pin")}.get(
            policy, (None, None))
        if column is None:
            raise CofferError(f"bad policy {policy!r}: use enabled, disabled, trust-updates or pin-updates")
        with self.transaction() as db:
            old = self._require_server(db, name)[column]
            db.execute(f"UPDATE servers SET {column}=? WHERE name=?", (value, name))
            if value == "trust":  # what waits for approval now is trusted too
                db.execute("UPDATE capabilities SET approved=fingerprint, approved_definition=definition"
                           " WHERE server=? AND approved IS NOT fingerprint", (name,))
            self._audit(db, "policy", name, f"{column}: {old} -> {value}")

    def record_status(self, name: str, status: str, detail: str | None, capabilities: dict | None = None) -> None:
        with self.transaction() as db:
            db.execute("UPDATE servers SET status=?, status_detail=?, status_at=?,"
                       " capabilities=coalesce(?, capabilities) WHERE name=?",
                       (status, storable(redact(detail)) if detail else detail, utcnow(),
                        vault_json(capabilities) if capabilities is not None else None, name))

    def _require_server(self, db, name):
        row = db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}{_did_you_mean(name, self._all_names(db))}")
        return row

    # -- targets: what a CLI argument names, exactly as a client sees it ------------------------------------
    def _all_names(self, db=None) -> list[str]:
        db = db or self.db
        max_length = self.setting("name_max_length")
        names = [row["name"] for row in db.execute("SELECT name FROM servers")]
        listed: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        for row in db.execute("SELECT server, kind, name FROM capabilities WHERE present=1 AND server IN"
                              " (SELECT name FROM servers)"):
            if row["kind"] in ("tool", "prompt"):
                listed[(row["server"], row["kind"])].append(row["name"])
            else:
                names.append(row["name"])
        for (server, _), items in listed.items():
            names.extend(exposed_names(server, items, max_length).values())
        return names

    def resolve(self, target: str, db=None) -> tuple[str, str, str]:
        """(server, kind, upstream name) of a tool/prompt by the exact name a client sees, or of a resource or
        template by its URI (``coffer+<server>:<uri>`` when two servers publish it).  ``tool:`` or ``prompt:``
        in front picks the kind when a tool and a prompt share a name."""
        db = db or self.db
        max_length = self.setting("name_max_length")
        kinds = ("tool", "prompt")
        for prefix in kinds:
            if target.startswith(prefix + ":"):
                kinds, target = (prefix,), target[len(prefix) + 1:]
        qualified = QUALIFIED_URI_RE.match(target)
        if qualified:
            rows = db.execute("SELECT server, kind, name FROM capabilities WHERE server=? AND name=? AND kind IN"
                              " ('resource','template')", qualified.groups()).fetchall()
            if rows:
                return tuple(rows[0])
        server, sep, _ = target.partition(SEPARATOR)
        registered = db.execute("SELECT 1 FROM servers WHERE name=?", (server,)).fetchone() is not None
        if sep and registered:
            found = []
            for kind in kinds:
                rows = db.execute("SELECT name, present FROM capabilities WHERE server=? AND kind=?",
                                  (server, kind)).fetchall()
                listed = exposed_names(server, [row["name"] for row in rows if row["present"]], max_length)
                names = [name for name, exposed in listed.items() if exposed == target] or [
                    row["name"] for row in rows if not row["present"] and f"{server}{SEPARATOR}{row['name']}" == target]
                found += [(server, kind, name) for name in names]
            if len(found) > 1:
                raise CofferError(f"{target!r} is both a tool and a prompt: write tool:{target} or prompt:{target}")
            if found:
                return found[0]
        rows = db.execute("SELECT server, kind, name FROM capabilities WHERE name=? AND kind IN"
                          " ('resource','template') AND server IN (SELECT name FROM servers)", (target,)).fetchall()
        if len(rows) == 1:
            return tuple(rows[0])
        if len(rows) > 1:
            servers = ", ".join(row["server"] for row in rows)
            raise CofferError(f"{target!r} is published by several servers ({servers}); "
                              f"use coffer+<server>:{target}")
        hint = _did_you_mean(target, self._all_names(db))
        if sep and registered and not db.execute("SELECT 1 FROM capabilities WHERE server=?", (server,)).fetchone():
            raise NotListedYet(f"unknown target {target!r}: server {server!r} does not list it{hint}")
        raise CofferError(f"unknown target {target!r}: not a server, tool, prompt or resource Coffer knows{hint}")

    # -- enable / disable / approve ------------------------------------------------------------------------
    def set_enabled(self, target: str, enabled: bool) -> str:
        """Enable or disable a server (by name) or one capability (by exposed name, or resource URI)."""
        verb = "enable" if enabled else "disable"
        with self.transaction() as db:
            row = db.execute("SELECT name, enabled FROM servers WHERE name=?", (target,)).fetchone()
            if row:
                db.execute("UPDATE servers SET enabled=? WHERE name=?", (int(enabled), target))
                self._audit(db, verb, target, "server")
                return f"server {target}"
            server, kind, name = self.resolve(target, db)
            db.execute("UPDATE capabilities SET enabled=? WHERE server=? AND kind=? AND name=?",
                       (int(enabled), server, kind, name))
            self._audit(db, verb, target if kind in ("tool", "prompt") else f"{server}:{name}", kind)
            return f"{kind} {target}" + (f" ({server}:{name})" if kind in ("tool", "prompt") and
                                         target != f"{server}{SEPARATOR}{name}" else "")

    def pending_approvals(self, server: str | None = None) -> list[dict]:
        sql = ("SELECT * FROM capabilities WHERE present=1 AND approved IS NOT NULL AND approved != fingerprint"
               + (" AND server=?" if server else "") + " ORDER BY server, kind, name")
        return [dict(row) for row in self.db.execute(sql, (server,) if server else ())]

    def approve(self, target: str) -> list[tuple[str, str]]:
        """Accept the current definition of a quarantined capability (or of every one of a server's); returns
        [(label, diff)] of what was approved."""
        max_length = self.setting("name_max_length")
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM servers WHERE name=?", (target,)).fetchone():
                rows = db.execute("SELECT * FROM capabilities WHERE server=? AND present=1 AND approved IS NOT NULL"
                                  " AND approved != fingerprint ORDER BY kind, name", (target,)).fetchall()
            else:
                server, kind, name = self.resolve(target, db)
                rows = db.execute("SELECT * FROM capabilities WHERE server=? AND kind=? AND name=? AND approved IS"
                                  " NOT NULL AND approved != fingerprint", (server, kind, name)).fetchall()
            approved = []
            for row in rows:
                label = (exposed_names(row["server"], [row["name"]], max_length)[row["name"]]
                         if row["kind"] in ("tool", "prompt") else row["name"])
                approved.append((f"{row['kind']} {label}", definition_diff(row["approved_definition"],
                                                                          row["definition"])))
                db.execute("UPDATE capabilities SET approved=fingerprint, approved_definition=definition WHERE"
                           " server=? AND kind=? AND name=?", (row["server"], row["kind"], row["name"]))
                self._audit(db, "approve", f"{row['server']}:{row['name']}", row["kind"])
            return approved

    def sync_capabilities(self, server: str, kind: str, definitions: dict[str, dict],
                          rejected: dict[str, str] | None = None) -> dict[str, CapabilityState]:
        """Record what an upstream lists now; return {name: CapabilityState} for those names.

        New names follow the server's policy and are pinned as they are; a name whose definition differs from
        the pinned one is quarantined until `coffer approve` (or pinned again at once under trust-updates).  Names
        that vanish keep their row (and the user's choice) with present=0, so a choice survives an upgrade that
        drops and later restores a tool.  ``rejected`` (name -> why) are definitions dropped at the boundary.
        """
        now = utcnow()
        max_length = self.setting("name_max_length")
        with self.transaction() as db:
            srv = db.execute("SELECT policy, updates FROM servers WHERE name=?", (server,)).fetchone()
            default = 1 if (srv is None or srv["policy"] == "enabled") else 0
            trusting = srv is not None and srv["updates"] == "trust"
            known = {row["name"]: row for row in db.execute(
                "SELECT name, enabled, present, fingerprint, approved FROM capabilities WHERE server=? AND kind=?",
                (server, kind))}
            labels = exposed_names(server, definitions, max_length) if kind in ("tool", "prompt") else {}
            for name, definition in definitions.items():
                fp, text = fingerprint(definition, kind), vault_json(definition)
                row = known.get(name)
                if row is None:
                    db.execute("INSERT OR IGNORE INTO capabilities(server, kind, name, enabled, present, fingerprint,"
                               " definition, first_seen, last_seen, approved, approved_definition)"
                               " VALUES (?,?,?,?,1,?,?,?,?,?,?)",
                               (server, kind, name, default, fp, text, now, now, fp, text))
                    if srv is not None:
                        self._audit(db, "upstream-added", f"{server}:{name}",
                                    f"{kind}; {'enabled' if default else 'disabled'} by policy", actor="upstream")
                    continue
                approved = row["approved"]
                if approved is None or trusting:
                    approved_sql = "approved=?, approved_definition=?,"
                    approved_args = (fp, text)
                    if approved is not None and approved != fp:
                        self._audit(db, "upstream-changed", f"{server}:{name}", f"{kind}; trusted (trust-updates)",
                                    actor="upstream")
                else:
                    approved_sql, approved_args = "", ()
                    if fp != row["fingerprint"] and fp != approved:
                        label = labels.get(name, name)
                        self._audit(db, "upstream-changed", f"{server}:{name}",
                                    f"{kind}; quarantined until `coffer approve {label}`", actor="upstream")
                        log.warning("[%s] %s %s changed its definition since it was approved; it is hidden until "
                                    "you review it with `coffer approve %s`", server, kind, label, label)
                if not row["present"]:
                    self._audit(db, "upstream-restored", f"{server}:{name}", kind, actor="upstream")
                db.execute(f"UPDATE capabilities SET present=1, fingerprint=?, definition=?, {approved_sql}"
                           " last_seen=? WHERE server=? AND kind=? AND name=?",
                           (fp, text, *approved_args, now, server, kind, name))
            for name, row in known.items():
                if name not in definitions and row["present"]:
                    db.execute("UPDATE capabilities SET present=0 WHERE server=? AND kind=? AND name=?",
                               (server, kind, name))
                    self._audit(db, "upstream-removed", f"{server}:{name}", kind, actor="upstream")
            for name, why in (rejected or {}).items():
                self._audit(db, "upstream-rejected", f"{server}:{storable(name)[:200]}", f"{kind}; {why}",
                            actor="upstream")
            return {row["name"]: _state(row) for row in db.execute(
                "SELECT name, enabled, fingerprint, approved FROM capabilities WHERE server=? AND kind=?",
                (server, kind)) if row["name"] in definitions}

    def remembered_lists(self) -> dict[str, dict[str, dict[str, dict]]]:
        """server -> kind -> {name: definition}: the tools and prompts each server listed when last seen."""
        remembered: dict = {}
        for row in self.db.execute("SELECT server, kind, name, definition FROM capabilities WHERE present=1 AND"
                                   " kind IN ('tool', 'prompt') AND definition IS NOT NULL ORDER BY rowid"):
            try:
                definition = json.loads(row["definition"])
            except ValueError:
                continue
            if isinstance(definition, dict):
                remembered.setdefault(row["server"], {}).setdefault(row["kind"], {})[row["name"]] = definition
        return remembered

    def capability_states(self) -> dict[tuple[str, str, str], CapabilityState]:
        return {(row["server"], row["kind"], row["name"]): _state(row)
                for row in self.db.execute("SELECT server, kind, name, enabled, fingerprint, approved"
                                           " FROM capabilities")}

    def capabilities(self, server: str | None = None) -> list[dict]:
        sql = "SELECT * FROM capabilities" + (" WHERE server=?" if server else "") + " ORDER BY server, kind, name"
        return [dict(row) for row in self.db.execute(sql, (server,) if server else ())]

    def data_version(self) -> int:
        """Changes whenever another connection commits: how a running gateway notices CLI edits cheaply."""
        return self.db.execute("PRAGMA data_version").fetchone()[0]

    # -- logs ----------------------------------------------------------------------------------------------
    def _audit(self, db, action: str, target, detail, actor: str | None = None) -> None:
        db.execute("INSERT INTO audit(ts, actor, action, target, detail) VALUES (?,?,?,?,?)",
                   (utcnow(), actor or self.actor, action, storable(target), storable(detail)))

    def invocations(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT ts, client, server, capability, kind, duration_ms, status, error FROM"
                               " invocations ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(row) for row in reversed(rows)]

    def audit_rows(self, limit: int = 50, since: str | None = None, action: str | None = None,
                   server: str | None = None) -> list[dict]:
        """The newest ``limit`` audit rows, oldest first; ``since`` an ISO date or time, ``action`` an action
        name or its prefix (``upstream`` matches upstream-added, -changed...), ``server`` a server's rows."""
        where, args = [], []
        if since:
            where.append("ts >= ?")
            args.append(since)
        if action:
            where.append("(action = ? OR action LIKE ?)")
            args += [action, action.replace("%", "") + "-%"]
        if server:
            where.append("(target = ? OR target LIKE ? OR target LIKE ?)")
            args += [server, f"{server}:%", f"{server}{SEPARATOR}%"]
        sql = ("SELECT ts, actor, action, target, detail FROM audit" + (" WHERE " + " AND ".join(where) if where
                                                                         else "") + " ORDER BY id DESC LIMIT ?")
        rows = self.db.execute(sql, (*args, limit)).fetchall()
        return [dict(row) for row in reversed(rows)]

    def prune(self) -> tuple[int, int]:
        """Apply retention.  Runs when ``serve`` starts, so a long-lived vault never grows without bound."""
        settings = self.settings()
        now = datetime.now(timezone.utc)
        cut_inv = (now - timedelta(days=float(settings["retention_invocations_days"]))).isoformat()
        cut_aud = (now - timedelta(days=float(settings["retention_audit_days"]))).isoformat()
        with self.transaction() as db:
            n_inv = db.execute("DELETE FROM invocations WHERE ts < ?", (cut_inv.replace("+00:00", "Z"),)).rowcount
            n_aud = db.execute("DELETE FROM audit WHERE ts < ?", (cut_aud.replace("+00:00", "Z"),)).rowcount
            db.execute("DELETE FROM capabilities WHERE last_seen < ? AND server NOT IN (SELECT name FROM servers)",
                       (cut_aud.replace("+00:00", "Z"),))  # choices of servers removed long ago
        return n_inv, n_aud


def _state(row) -> CapabilityState:
    return CapabilityState(bool(row["enabled"]), row["approved"] is not None and row["approved"] != row["fingerprint"])


def definition_diff(before: str | None, after: str | None) -> str:
    """A readable unified diff of two stored definitions (pretty JSON, keys sorted)."""
    def lines(text):
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            value = text
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    return "\n".join(difflib.unified_diff(lines(before), lines(after), "approved", "now listed", lineterm=""))


def _did_you_mean(target: str, names) -> str:
    close = difflib.get_close_matches(target, list(names), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT: take the write lock up front so a busy vault waits instead of failing late."""

    def __init__(self, db):
        self.db = db

    def __enter__(self):
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if Vault._cannot_write(exc):
                raise CofferError(f"the vault cannot be written ({exc}): this command would change it") from None
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return False
            except sqlite3.Error:
                self.db.execute("ROLLBACK")
                raise
        self.db.execute("ROLLBACK")
        return False


def _json_column(text, kind, default):
    if text in (None, ""):
        return default
    value = json.loads(text)
    if not isinstance(value, kind):
        raise ValueError(f"expected a JSON {kind.__name__}")
    return value


def _server_row(row) -> dict:
    """A servers row as a dict; a row that does not parse is kept (so `list` and `remove` can see it) but marked
    ``damaged`` with the reason and never started."""
    server = dict(row)
    server.setdefault("inherit_env", "[]")
    server.setdefault("updates", "pin")
    server.setdefault("oauth", None)
    server.setdefault("era", None)
    if server["era"] not in (None, "handshake", "modern"):
        server["era"] = None
    try:
        if not isinstance(server["name"], str) or not SERVER_NAME_RE.match(server["name"]) or \
                server["name"].lower() == RESERVED_SERVER:
            raise ValueError("its name is not a valid server name")
        command = _json_column(server["command"], list, None)
        if command is not None and not (command and all(isinstance(a, str) for a in command)):
            raise ValueError("command is not a list of strings")
        server["command"] = command
        for key in ("env", "headers"):
            server[key] = _json_column(server[key], dict, {})
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in server[key].items()):
                raise ValueError(f"{key} holds a value that is not text")
        server["inherit_env"] = [str(x) for x in _json_column(server["inherit_env"], list, [])]
        if server["transport"] not in TRANSPORTS:
            raise ValueError(f"unknown transport {server['transport']!r}")
        if (server["transport"] == "stdio") != bool(command) or (server["transport"] != "stdio"
                                                                and not isinstance(server["url"], str)):
            raise ValueError("neither a command nor a URL to reach it")
        if server["timeout"] is not None and not (isinstance(server["timeout"], (int, float))
                                                  and server["timeout"] > 0):
            raise ValueError("timeout is not a positive number")
        server["damaged"] = None
        server["enabled"] = bool(server["enabled"])
    except (ValueError, TypeError) as exc:
        server.update(damaged=str(exc)[:200], enabled=False, command=None, env={}, headers={}, inherit_env=[])
    for key in ("capabilities", "oauth"):
        try:
            server[key] = _json_column(server.get(key), dict, None)
        except (ValueError, TypeError):
            server[key] = None  # forgotten: as if never started, or never given OAuth settings
    return server


EXPOSE_RE = re.compile(r"^(auto|all|search|budget:([2-9]|[1-9][0-9]{1,3}))$")
PER_CLIENT_SETTING_RE = re.compile(r"^expose\.([a-z0-9-]{1,32})$")


def setting_key(key: str) -> str:
    """The DEFAULTS entry a setting name is checked against: expose.<client> is an expose setting."""
    return "expose" if PER_CLIENT_SETTING_RE.match(key) else key


def _checked_setting(key: str, raw):
    """A setting's value from the CLI (text) or the vault (JSON), converted and range-checked, or CofferError."""
    key = setting_key(key)
    default = DEFAULTS[key]
    kind = type(default)
    if isinstance(raw, bool) or (not isinstance(raw, (str, int, float)) or
                                 (kind is str and not isinstance(raw, str))):
        raise CofferError(f"setting {key} needs a {kind.__name__}, got {raw!r}")
    try:
        value = kind(raw)
    except (ValueError, OverflowError):
        raise CofferError(f"setting {key} needs a {kind.__name__}, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CofferError(f"setting {key} needs a finite number")
    if key == "name_max_length" and not 34 <= value <= 64:  # 24-char server + "__" + "x_" + hash
        raise CofferError("name_max_length must be between 34 and 64")
    if key == "expose" and not EXPOSE_RE.match(value):
        raise CofferError("expose must be auto, all, search or budget:N (N at least 2)")
    if key == "embedder_api" and value not in ("openai", "ollama"):
        raise CofferError("embedder_api must be 'openai' or 'ollama'")
    if key in ("memory", "ask_synthesis") and value not in ("on", "off"):
        raise CofferError(f"{key} must be on or off")
    if key == "max_message_bytes" and value < 4096:
        raise CofferError("max_message_bytes must be at least 4096")
    if isinstance(value, (int, float)) and value <= 0:
        raise CofferError(f"{key} must be positive")
    return value


class InvocationLog:
    """Writes invocation rows on its own thread, in batches, so no tool call ever waits on SQLite.

    If the vault is locked or read-only the rows are kept (up to a bound) and retried; a persistent failure is a
    warning, never a failed call.  Every text is made storable first (a client name holding a lone surrogate must
    not stop the logging of everything after it), and the thread survives any error in a batch: the batch is
    reported and dropped, the log goes on.
    """

    FLUSH_INTERVAL = 0.2
    MAX_BUFFER = 50_000

    def __init__(self, path: str):
        self.path = path
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="coffer-log", daemon=True)
        self._thread.start()

    def record(self, client, server, capability, kind, started: float, status: str, error: str | None = None):
        duration = round((time.monotonic() - started) * 1000.0, 3)
        self.queue.put((time.time(), client, server, capability, kind, duration, status, error))  # ts: see _run

    def flush(self, timeout: float = 5.0) -> None:
        """Write everything recorded so far before returning (used first thing at shutdown)."""
        written = threading.Event()
        self.queue.put(written)
        written.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.queue.put(None)
        self._thread.join(timeout)

    @staticmethod
    def _row(item: tuple) -> tuple:
        ts, *rest = item
        return (iso_timestamp(ts), *(storable(redact(v))[:500] if isinstance(v, str) else v for v in rest))

    def _run(self) -> None:
        db = None
        pending: list[tuple] = []
        waiters: list[threading.Event] = []
        while True:
            try:
                item = self.queue.get(timeout=self.FLUSH_INTERVAL if pending else None)
                if isinstance(item, threading.Event):
                    waiters.append(item)
                elif item is not None:
                    pending.append(item)
                    # Let the rest of this burst arrive: one commit per interval, not one per call.
                    self._stop.wait(self.FLUSH_INTERVAL)
                while len(pending) < 10_000:
                    item = self.queue.get_nowait()
                    if isinstance(item, threading.Event):
                        waiters.append(item)
                    elif item is not None:
                        pending.append(item)
            except queue.Empty:
                pass
            if pending:
                try:
                    if db is None:
                        db = Vault._connect(self.path)
                    db.execute("BEGIN IMMEDIATE")
                    db.executemany("INSERT INTO invocations(ts, client, server, capability, kind, duration_ms,"
                                   " status, error) VALUES (?,?,?,?,?,?,?,?)", [self._row(row) for row in pending])
                    db.execute("COMMIT")
                    pending.clear()
                except sqlite3.Error as exc:
                    self._rollback(db)
                    if not self._warned:
                        log.warning("invocation log not written yet (%s); will retry", exc)
                        self._warned = True
                    del pending[:-self.MAX_BUFFER]
                    if self._stop.is_set():
                        log.warning("%d invocation rows could not be written: %s", len(pending), exc)
                        break
                    time.sleep(0.5)
                except Exception:  # noqa: BLE001 - a bad row costs its batch, never the log itself
                    self._rollback(db)
                    log.exception("invocation log: dropped a batch of %d rows it could not write", len(pending))
                    pending.clear()
            if not pending:
                for waiter in waiters:
                    waiter.set()
                waiters.clear()
            if self._stop.is_set() and self.queue.empty() and not pending:
                break
        if db is not None:
            db.close()

    @staticmethod
    def _rollback(db) -> None:
        try:
            if db is not None and db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error:
            pass


# ============================================================================================================
# 4. Transports: how Coffer reaches an upstream (stdio subprocess, Streamable HTTP, HTTP+SSE, OAuth)
# ============================================================================================================


class UpstreamFailure(Exception):
    """An upstream could not be started, initialized or reached.

    ``permanent``: retrying cannot help (a command that is not installed, a URL that is not a URL, HTTP 401/403/404),
    so the server is marked failed at once with the real reason instead of being retried into the same wall.
    """

    permanent = False

    def __init__(self, message: str, permanent: bool | None = None):
        super().__init__(message)
        if permanent is not None:
            self.permanent = permanent


class Transport:
    """What the upstream supervisor needs from a connection.

    Callbacks run on the transport's own threads: ``on_message(dict)`` for each message, ``on_close()`` once when
    the connection ends, ``on_unusable(head, why)`` for a message that cannot be used (over max_message_bytes, not
    JSON, nested too deeply) so the request it answers can fail at once, ``on_failure(request_id, text)`` for a
    request that never got through (remote transports), and ``on_stderr(line)`` for a subprocess's diagnostics.  ``send`` returns False when the connection no longer
    accepts input and raises EncodeError for a message that cannot be written.  ``fatal`` is set when the
    connection failed in a way retrying cannot fix; ``close_reason`` says, once it ended, what ended it.
    """

    pid = None
    fatal: UpstreamFailure | None = None
    close_reason: str | None = None

    def start(self) -> None:
        raise NotImplementedError

    def send(self, message: dict) -> bool:
        raise NotImplementedError

    def close(self, grace: float = 2.0) -> None:
        raise NotImplementedError

    def exit_detail(self) -> str | None:
        """Why the connection ended, in the user's terms (e.g. "exited with code 3"), once it has."""
        return None

    def _fail(self, message: dict, text: str) -> None:
        """A request that never got its answer through: a failure of the connection (``on_failure``), so a tool
        call reads it as a tool error, not as an error the server itself returned."""
        if "id" in message and "method" in message:
            self.on_failure(message["id"], text)


class WorkerPool:
    """At most ``size`` daemon threads running submitted jobs in arrival order; idle threads wait for more.

    Used where work would otherwise cost a thread each (HTTP requests to one upstream, requests that wait for a
    starting server): a burst of 5,000 is 5,000 queued jobs, not 5,000 threads.  A job's exception is logged with
    its traceback and costs that job only.
    """

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._waiting = 0   # jobs submitted and not yet taken by a worker
        self._busy = 0      # workers running a job
        self._closed = False

    def submit(self, job, *args) -> None:
        """Queue ``job(*args)``; a new worker starts when every worker is taken and the pool is below its size."""
        with self._lock:
            if self._closed:
                return
            self._waiting += 1
            spawn = self._waiting + self._busy > self._threads and self._threads < self.size
            if spawn:
                self._threads += 1
            number = self._threads
        self._jobs.put((job, args))
        if spawn:
            threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()

    def close(self) -> None:
        """Let every worker finish its job and end; later submits are dropped."""
        with self._lock:
            self._closed, threads = True, self._threads
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, args = item
            with self._lock:
                self._waiting -= 1
                self._busy += 1
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - one job's failure must not take the worker with it
                log.exception("internal error in %s", self.name)
            finally:
                with self._lock:
                    self._busy -= 1


class ProcessInfo(NamedTuple):
    parent: int
    started: str  # when it started (Linux: clock ticks since boot; else ps's start time): tells a reused pid apart


def process_table() -> dict[int, ProcessInfo]:
    """Every process's parent and start time (POSIX; {} where it cannot be read)."""
    table: dict[int, ProcessInfo] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    data = handle.read(4096)
                fields = data[data.rindex(b")") + 2:].split()
                table[int(entry)] = ProcessInfo(int(fields[1]), fields[19].decode("ascii"))
            except (OSError, ValueError, IndexError):
                continue
        return table
    try:
        listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,lstart="], capture_output=True, text=True,
                                 timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in listing.splitlines():
        fields = line.split(None, 2)
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
            table[int(fields[0])] = ProcessInfo(int(fields[1]), fields[2].strip())
    return table


def _descendants(pid: int, table: dict[int, ProcessInfo] | None = None) -> dict[int, str]:
    """{pid: start time} of every live process descended from ``pid``, in any session or process group (POSIX).

    A server's ``setsid`` grandchild leaves its process group, so killing the group misses it; its ancestry
    does not change while its parent lives, which is why it is read before closing anything, and remembered
    while the server runs (StdioTransport.remember_family): once its parent has died it is re-parented to init.
    """
    table = process_table() if table is None else table
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, info in table.items():
        children[info.parent].append(child)
    found, frontier = {}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found[child] = table[child].started
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


class StdioTransport(Transport):
    """An upstream MCP server as a subprocess speaking newline-delimited JSON-RPC on stdin/stdout.

    The child gets its own process group (POSIX) so shutdown can reach the whole tree (``npx`` and ``uvx`` start
    grandchildren), and shutdown also ends descendants that left the group (a ``setsid`` daemon).  If Coffer is
    killed outright, the children see stdin close and exit by themselves.  Threads: one reader each for stdout and
    stderr, one that notices the exit, one writer for what ``send`` could not write at once.
    """

    def __init__(self, name, argv, env, cwd, on_message, on_close, on_stderr, on_unusable=None, max_line=0):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.on_message, self.on_close, self.on_stderr = on_message, on_close, on_stderr
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.max_line = max_line
        self.proc: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._queued = 0          # messages handed to the writer thread and not yet written
        self._stdin_fd = None     # set when stdin is non-blocking (POSIX): send() may then write it directly
        self._close_lock = threading.Lock()
        self._closed = False
        self._close_signalled = False
        self._stderr_reader: threading.Thread | None = None
        self._family: dict[int, str] = {}   # descendants seen while it ran, so close ends them even after a crash

    def start(self) -> None:
        if self._closed:
            raise UpstreamFailure("stopped before it started")
        argv = list(self.argv)
        resolved = shutil.which(argv[0], path=self.env.get("PATH"))
        if resolved:
            argv[0] = resolved  # Windows needs npx.cmd spelled out; elsewhere this is harmless
        elif not os.path.dirname(argv[0]):
            raise UpstreamFailure(f"command {argv[0]!r} not found on PATH", permanent=True)
        if self.cwd and not os.path.isdir(self.cwd):
            raise UpstreamFailure(f"working directory {self.cwd!r} does not exist", permanent=True)
        kwargs = {}
        if os.name == "posix":
            kwargs["start_new_session"] = True
        else:
            kwargs["creationflags"] = getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=self.env, cwd=self.cwd or None, bufsize=0,
                                         **kwargs)
        except OSError as exc:
            transient = exc.errno in (errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE)
            raise UpstreamFailure(f"cannot start {argv[0]!r}: {exc.strerror or exc}", permanent=not transient) \
                from None
        if os.name == "posix":
            os.set_blocking(self.proc.stdin.fileno(), False)
            self._stdin_fd = self.proc.stdin.fileno()
        # stderr first: a server that dies at once is reported with its last words (exit_detail joins this)
        self._stderr_reader = threading.Thread(target=self._read_stderr, name=f"coffer-{self.name}-err",
                                               daemon=True)
        self._stderr_reader.start()
        self._reader = threading.Thread(target=self._read_stdout, name=f"coffer-{self.name}-out", daemon=True)
        self._reader.start()
        start_thread(self._watch_exit, f"coffer-{self.name}-wait")
        start_thread(self._write_stdin, f"coffer-{self.name}-in")

    def remember_family(self, table: dict[int, ProcessInfo] | None = None) -> None:
        """Note the server's descendants now (the gateway's ticker calls this every few seconds): a helper it
        daemonized is ended with it even if the server itself crashes first."""
        proc = self.proc
        if os.name == "posix" and proc is not None and proc.poll() is None and not self._closed:
            self._family.update(_descendants(proc.pid, table))

    def _write_stdin(self) -> None:
        """Write what ``send`` could not: a server that stops reading must stall only itself, never the
        client's reader or the timeout ticker.  Whatever queued up meanwhile goes out in one write."""
        stdin, outbox = self.proc.stdin, self._outbox
        closing = False
        while not closing:
            batch = [outbox.get()]
            while not outbox.empty() and len(batch) < 256:
                batch.append(outbox.get_nowait())
            count = len(batch)
            if None in batch:
                closing = True
                batch = batch[:batch.index(None)]
            try:
                if batch:
                    self._write_all(stdin, b"".join(batch))
            except (OSError, ValueError):
                break  # the server is gone; its reader sees EOF and reports it
            with self._send_lock:
                self._queued -= count
        try:
            stdin.close()
        except OSError:
            pass

    def _watch_exit(self) -> None:
        """Notice the server's exit even if a grandchild (npx, uvx, sh -c) keeps its stdout open."""
        self.proc.wait()
        self._reader.join(0.5)
        if not self._reader.is_alive() or self._closed:
            return
        if os.name == "posix":
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the leftovers of the dead server; the pipe then ends
            except (ProcessLookupError, PermissionError):
                pass
            self._reader.join(2.0)
        if self._reader.is_alive():
            self._signal_close()

    def _signal_close(self) -> None:
        with self._close_lock:
            if self._close_signalled:
                return
            self._close_signalled = True
        self.on_close()

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def exit_detail(self) -> str | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            code = proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return None
        if self._stderr_reader is not None and self._stderr_reader.ident is not None:
            self._stderr_reader.join(0.5)  # its last words are usually the reason
        return f"exited with code {code}"

    def _write_all(self, stdin, data: bytes) -> None:
        if self._stdin_fd is None:
            stdin.write(data)  # a blocking pipe (Windows): write() returns when all of it is written
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._stdin_fd, view):]
            except BlockingIOError:
                select.select([], [self._stdin_fd], [], 1.0)  # the server is busy; wait until it reads

    def send(self, message: dict) -> bool:
        if self._closed or self.proc is None or self.proc.poll() is not None:
            return False
        data = encode_line(message)
        with self._send_lock:
            if self._queued == 0 and self._stdin_fd is not None:
                # The common case: the pipe has room and nothing is queued ahead, so write it here and spare
                # the writer thread a wake-up; whatever does not fit is queued behind, in order.
                try:
                    data = data[os.write(self._stdin_fd, data):]
                except BlockingIOError:
                    pass
                except OSError:
                    return False
                if not data:
                    return True
            self._queued += 1
            self._outbox.put(data)
        return True

    def _read_stdout(self) -> None:
        # stdout is unbuffered (bufsize=0): each read returns what has arrived, so a reply burst is one call.
        skipped = 0

        def handle(line) -> None:
            nonlocal skipped
            if isinstance(line, OversizedLine):
                self.on_unusable(line.head, f"a message of {line.size} bytes, more than max_message_bytes "
                                            f"({self.max_line})")
                return
            if not line.strip():
                return
            try:
                message = decode_json(line)
            except ValueError as exc:  # invalid UTF-8, NaN, nested too deeply...: skipped like any junk
                skipped += 1
                if skipped <= 20 or skipped % 1000 == 0:
                    log.warning("[%s] skipped a non-JSON line on stdout (%d bytes; %d so far)",
                                self.name, len(line), skipped)
                self.on_unusable(line[:4096], f"a reply Coffer cannot read ({exc})")
                return
            for item in (message if isinstance(message, list) else [message]):
                if isinstance(item, dict):
                    try:
                        self.on_message(item)
                    except Exception:  # noqa: BLE001 - a bug in routing costs one message, not the reader
                        log.exception("[%s] internal error handling a message", self.name)

        try:
            for lines in read_line_bursts(self.proc.stdout.read, max_line=self.max_line):
                handle_burst(lines, handle)
        except (OSError, ValueError):
            pass
        except Exception:  # noqa: BLE001 - the connection is lost either way; say why, then restart it
            log.exception("[%s] internal error reading stdout", self.name)
        finally:
            self._signal_close()

    def _read_stderr(self) -> None:
        try:
            for lines in read_line_bursts(self.proc.stderr.read, max_line=8192):
                for line in lines:
                    raw = line.head if isinstance(line, OversizedLine) else line
                    self.on_stderr(raw.decode("utf-8", "replace").rstrip("\r"))
        except (OSError, ValueError):
            pass  # the pipe closed under us at shutdown
        except Exception:  # noqa: BLE001
            log.exception("[%s] internal error reading stderr", self.name)

    def close(self, grace: float = 2.0) -> None:
        """Close stdin, give the server ``grace`` seconds to exit, then terminate and kill its process group and
        every descendant found before closing (including those in other sessions)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        proc = self.proc
        if proc is None:
            return
        family: dict[int, str] = {}
        if os.name == "posix":
            table = process_table()
            family = {pid: started for pid, started in self._family.items()  # still the same processes
                      if table.get(pid) is not None and table[pid].started == started}
            if proc.poll() is None:
                family.update(_descendants(proc.pid, table))
        with self._send_lock:
            self._queued += 1
            self._outbox.put(None)  # the writer flushes what is queued, then closes stdin
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        if os.name != "posix":
            if proc.poll() is None:  # no process groups to signal: taskkill /T takes the whole tree
                subprocess.run(["taskkill", "/T", "/F", "/PID", str(proc.pid)], capture_output=True, check=False)
                proc.kill()
        else:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                leader_alive = proc.poll() is None
                try:  # the group may outlive its leader: npx exits, the node server it started does not
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                for pid in family:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                if not leader_alive and not any(_alive(pid) for pid in family):
                    break
                try:
                    proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
        for stream in (proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass


# -- remote servers: one door for every HTTP exchange, so credentials never leave their origin -----------------
# A remote server speaks Streamable HTTP (HttpTransport) or the 2024-11-05 HTTP+SSE transport (SseTransport);
# "auto" asks it which, following the spec's backwards-compatibility procedure, and the answer is remembered in
# the vault.  Any of them may be protected by OAuth: OAuthCredentials supplies and refreshes the bearer token, and
# `coffer auth NAME` (oauth_login) is the only place a browser opens.  The credential rule for all of it:
# configured headers and the bearer token go only to the configured URL's origin (scheme, host, port); a redirect,
# an SSE endpoint or a saved login that would take them elsewhere is refused.  The authorization server only ever
# gets what OAuth sends it (a code, a refresh token, Coffer's own client credentials), never a bearer token.

REMOTE_TRANSPORTS = ("auto", "http", "sse")
OAUTH_SECRET_PREFIX = "oauth."          # SecretStore name of a server's saved login: oauth.<server>
MAX_REDIRECTS = 3
_ERROR_BODY_BYTES = 64 << 10            # how much of an error reply is read, for its message
_METADATA_BYTES = 1 << 20               # OAuth metadata, registration and token replies
_SSE_PIECE = 64 << 10                   # a stream is read in pieces of at most this, whatever its line lengths
_SESSION_ID_RE = re.compile(r"^[\x21-\x7e]{1,1024}$")


def url_origin(url) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, default port filled in; None for anything else."""
    if not isinstance(url, str) or len(url) > 8192:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


def same_origin(a, b) -> bool:
    origin = url_origin(a)
    return origin is not None and origin == url_origin(b)


def origin_text(url) -> str:
    origin = url_origin(url)
    if origin is None:
        return "an invalid URL"
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if port == (443 if scheme == "https" else 80) else f":{port}")


def is_loopback_url(url) -> bool:
    import ipaddress
    origin = url_origin(url)
    if origin is None:
        return False
    if origin[1] == "localhost":
        return True
    try:
        return ipaddress.ip_address(origin[1]).is_loopback
    except ValueError:
        return False


def _require_secure(url, what: str) -> str:
    """An OAuth endpoint must be https (OAuth 2.1 §1.5); plain http only on this machine, for development.  It is
    printed to the user, so it must hold no control characters or spaces."""
    if isinstance(url, str) and (_UNPRINTABLE_RE.search(url) or any(c.isspace() for c in url)):
        raise OAuthFailure(f"{what} holds control characters or spaces: refused")
    if url_origin(url) is None:
        raise OAuthFailure(f"{what} is not an http(s) URL: {printable(str(url))[:200]}")
    if urllib.parse.urlsplit(url).fragment:
        raise OAuthFailure(f"{what} has a #fragment, which OAuth forbids: {printable(url)[:200]}")
    if url_origin(url)[0] != "https" and not is_loopback_url(url):
        raise OAuthFailure(f"{what} is plain http on another machine ({origin_text(url)}); "
                           "refusing to send credentials there unencrypted")
    return url


def check_remote_url(url: str) -> str:
    """A URL Coffer may connect to (http or https with a host), or CofferError saying what is wrong.  A URL that
    holds a ${VAR} reference is checked when it is expanded, at start."""
    if "${" in url:
        return url
    if url_origin(url) is None or any(c.isspace() for c in url):
        raise CofferError(f"invalid URL {printable(url)[:200]!r}: use http:// or https:// and a host name")
    return url


class HttpReply(NamedTuple):
    """One HTTP exchange's answer.  ``stream`` is the still-open response when a streamed 2xx was asked for (the
    caller reads and closes it); otherwise ``body`` holds the body (an error body cut at 64 KiB)."""
    status: int
    headers: dict           # lower-case name -> value; repeated headers joined with ", "
    body: bytes
    url: str                # where the answer came from, after same-origin redirects
    stream: object = None


class OriginRefused(UpstreamFailure):
    """A redirect or an SSE endpoint that would carry credentials to another origin.  Permanent: retrying would
    only ask the same server to send them there again."""

    permanent = True


_http_opener = None


def stream_errors() -> tuple:
    """What reading a broken HTTP stream raises (http.client's IncompleteRead is neither OSError nor ValueError)."""
    import http.client
    return OSError, ValueError, http.client.HTTPException


def _header_dict(message) -> dict:
    headers: dict[str, str] = {}
    for name, value in (message.items() if message is not None else ()):
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def remote_http(method: str, url: str, *, headers=None, body: bytes | None = None, timeout: float = 30.0,
                max_bytes: int = _METADATA_BYTES, stream: bool = False) -> HttpReply:
    """Every HTTP exchange Coffer makes (remote upstreams, OAuth, the embedder), with urllib.

    Any status comes back as an HttpReply; what prevents an answer (unreachable, a body over ``max_bytes``)
    raises UpstreamFailure.  Redirects are decided here, not by urllib (which re-sends every header, Authorization
    included, to whatever host a redirect names, https->http included): a redirect is followed — with the same
    method and body, the only meaning an MCP endpoint that moved can have — only within the configured origin and
    at most MAX_REDIRECTS times; any other raises OriginRefused.
    """
    global _http_opener
    import http.client, urllib.error, urllib.request  # noqa: E401 - lazily: ~19 MB of RSS
    if _http_opener is None:
        class _Decline(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None  # a 3xx then surfaces as HTTPError, and remote_http decides

        _http_opener = urllib.request.build_opener(_Decline)
    if url_origin(url) is None:
        raise UpstreamFailure(f"unsupported URL {printable(str(url))[:200]!r}", permanent=True)
    sent = {"User-Agent": f"coffer/{__version__}", **(headers or {})}
    where = origin_text(url)
    for _ in range(MAX_REDIRECTS + 1):
        request = urllib.request.Request(url, data=body, headers=sent, method=method)
        try:
            response = _http_opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            location = exc.headers.get("Location") if exc.headers is not None else None
            if exc.code in (301, 302, 303, 307, 308):
                exc.close()
                target = urllib.parse.urljoin(url, location or "")
                if not location or not same_origin(target, url):
                    raise OriginRefused(f"{where} redirected to {origin_text(target)} (HTTP {exc.code}): refused, "
                                        "credentials never leave the configured origin; register the URL it "
                                        "redirects to instead") from None
                url = target
                continue
            try:
                data = exc.read(_ERROR_BODY_BYTES) or b""
            except (OSError, ValueError, http.client.HTTPException):
                data = b""
            finally:
                exc.close()
            return HttpReply(exc.code, _header_dict(exc.headers), data, url)
        except urllib.error.URLError as exc:
            raise UpstreamFailure(f"cannot reach {where}: {printable(str(getattr(exc, 'reason', exc)))[:200]}") \
                from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise UpstreamFailure(f"cannot reach {where}: {exc.__class__.__name__}: {printable(str(exc))[:200]}") \
                from None
        reply = HttpReply(response.status, _header_dict(response.headers), b"", url, response)
        if stream:
            return reply
        try:
            data = response.read(max_bytes + 1)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise UpstreamFailure(f"{where} broke off its reply: {exc.__class__.__name__}") from None
        finally:
            response.close()
        if len(data) > max_bytes:
            raise UpstreamFailure(f"{where} sent a reply larger than {max_bytes} bytes")
        return reply._replace(body=data, stream=None)
    raise OriginRefused(f"{where} redirected more than {MAX_REDIRECTS} times")


def _stream_socket(response):
    """The socket under a streamed urllib response (CPython's layout), or None: only to shut it down from another
    thread (closing the response there would wait for the reader's lock) and to tune keepalive."""
    raw = getattr(getattr(response, "fp", None), "raw", None)
    return getattr(raw, "_sock", None)


def settle_stream(response) -> None:
    """A stream that may stay silent for hours: no read timeout, TCP keepalive so a dead peer is noticed."""
    import socket

    sock = _stream_socket(response)
    if sock is None:
        return
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 15), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:
        pass


def abort_stream(response) -> None:
    """End a streamed response from any thread: its reader sees end of stream and closes it."""
    import socket

    sock = _stream_socket(response)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        else:
            response.close()
    except (OSError, ValueError):
        pass


def _close_reply(reply: HttpReply) -> None:
    if reply.stream is not None:
        try:
            reply.stream.close()
        except (OSError, ValueError):
            pass


def _content_type(reply: HttpReply) -> str:
    return reply.headers.get("content-type", "").split(";")[0].strip().lower()


def _reply_text(reply: HttpReply, limit: int = 200) -> str:
    """An error body, as much as a person should see of it: printable, redacted, short."""
    text = reply.body[:limit * 4].decode("utf-8", "replace").strip()
    return printable(redact(" ".join(text.split())))[:limit]


def authorized_exchange(name: str, auth, method: str, url: str, *, headers: dict, body: bytes | None = None,
                        timeout: float, max_bytes: int = _METADATA_BYTES, stream: bool = False) -> HttpReply:
    """One exchange with a remote upstream, carrying its OAuth token when it has one: refreshed before expiry,
    and once more (then retried once) when the server answers 401.  Raises NeedsLogin when only a person can
    fix it.  Without ``auth`` (the server has a configured Authorization header) a 401 is returned as is."""
    for attempt in (1, 2):
        sent = dict(headers)
        if auth is not None:
            sent.update(auth.headers_for(url))
        reply = remote_http(method, url, headers=sent, body=body, timeout=timeout, max_bytes=max_bytes,
                            stream=stream)
        if auth is None or reply.status not in (401, 403):
            return reply
        challenges = parse_www_authenticate(reply.headers.get("www-authenticate"))
        bearer = challenges.get("bearer")
        if reply.status == 403:
            if bearer is not None and bearer.get("error") == "insufficient_scope":
                scope = printable(bearer.get("scope", ""))[:200]
                raise NeedsLogin(name, f"it asks for more permissions{f' (scope {scope})' if scope else ''}; "
                                       f"add --scope to `coffer auth {name}`")
            return reply
        if challenges and bearer is None:
            schemes = ", ".join(sorted(challenges))[:100]
            raise UpstreamFailure(f"HTTP 401: '{name}' asks for {schemes} credentials, not an OAuth login; "
                                  "give them with --header")
        if attempt == 2:
            raise NeedsLogin(name, "it refused a freshly refreshed token")
        auth.unauthorized(bearer or {}, sent.get("Authorization"))  # returns only when a new token is ready
    raise AssertionError("unreachable")



# -- server-sent events ----------------------------------------------------------------------------------------

class SseEvent(NamedTuple):
    """One event of a text/event-stream.  ``oversized`` > 0: its data ran to that many bytes and was dropped;
    ``data`` then holds its first 4 KiB, enough to find a request id in."""
    kind: str
    data: bytes
    oversized: int = 0


def _bounded_lines(readline, limit: int):
    """(line, length) per line of a stream; a line longer than ``limit`` keeps only its first pieces."""
    while True:
        piece = readline(_SSE_PIECE)
        if not piece:
            return
        if piece.endswith(b"\n"):
            yield piece, len(piece)
            continue
        parts, length = [piece], len(piece)
        while True:
            piece = readline(_SSE_PIECE)
            length += len(piece)
            if length <= limit + _SSE_PIECE:
                parts.append(piece)
            if not piece or piece.endswith(b"\n"):
                break
        yield b"".join(parts), length
        if not piece:
            return


def read_sse_events(readline, max_event_bytes: int):
    """Parse a text/event-stream (WHATWG HTML §9.2) from ``readline(limit)``.  Memory stays under about
    ``max_event_bytes`` whatever the server sends; an unfinished last event is dropped, as the standard says.
    Lines end with LF or CRLF (a lone CR is not treated as a line end)."""
    kind, data, size, head = "", [], 0, b""
    for raw, length in _bounded_lines(readline, max_event_bytes):
        line = raw[:-1] if raw.endswith(b"\n") else raw
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            if head:
                yield SseEvent(kind or "message", head, size)
            elif data and (data[0] or len(data) > 1):  # an event with empty data is not dispatched
                yield SseEvent(kind or "message", b"\n".join(data))
            kind, data, size, head = "", [], 0, b""
            continue
        if line.startswith(b":"):
            continue  # a comment: servers send them to keep the connection open
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            # Each line costs ~100 bytes of bookkeeping, whatever it holds: an event of a million empty data
            # lines must hit the limit long before it holds a gigabyte.
            size += (length if length > max_event_bytes else len(value)) + 128
            if size > max_event_bytes:
                head = head or (b"\n".join(data) + b"\n" + value)[:4096]
                data = []
            elif not head:
                data.append(value)
        elif name == b"event":
            kind = value[:64].decode("utf-8", "replace")
        # id and retry serve resumption, which the 2024-11-05 transport does not define: a drop is a new session.


def _messages_of(data: bytes, name: str, on_unusable=None) -> list[dict]:
    """The JSON-RPC messages in one event or body (a message or a batch); junk is skipped with a warning, and
    ``on_unusable`` hears of it, so a request it answered fails at once instead of waiting for its timeout."""
    try:
        payload = decode_json(data)
    except ValueError as exc:
        log.warning("[%s] skipped an SSE event that is not JSON (%d bytes: %s)", name, len(data), exc)
        if on_unusable is not None:
            on_unusable(data[:4096], f"a reply Coffer cannot read ({exc})")
        return []
    items = payload if isinstance(payload, list) else [payload]
    return [item for item in items if isinstance(item, dict)]


class HttpTransport(Transport):
    """An upstream MCP server over Streamable HTTP; every exchange goes through ``authorized_exchange``.

    Each outgoing message is one POST on a bounded worker pool; the reply is either one JSON body or an SSE stream
    that may carry the server's own requests and notifications before the response.  Bodies and events are bounded
    by max_message_bytes.  A request waits until the notifications sent before it have been delivered (so
    notifications/initialized arrives before the first list request), and one whose reply holds no answer fails at
    once.  With ``auth`` (OAuthCredentials) each request carries the server's bearer token, refreshed and retried
    once on 401.  ``close`` ends the server's own stream and the pool's workers.
    """

    POOL_SIZE = 64  # requests in flight at once to one server; more wait their turn (notifications never do)

    def __init__(self, name, url, headers, on_message, on_close, timeout, on_unusable=None, max_body=64 << 20,
                 auth=None, on_failure=None):
        self.name, self.url, self.headers = name, url, headers
        self.on_message, self.on_close = on_message, on_close
        self.on_failure = on_failure or (lambda request_id, text: on_message(rpc_error(request_id, UPSTREAM_ERROR,
                                                                                      text)))
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.timeout, self.max_body, self.auth = timeout, max_body, auth
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self._closed = False
        self._listening = False
        self._stream = None                      # the server's own GET stream, while open
        self._delivered: threading.Event | None = None   # the last notification's POST is done
        self._pool = WorkerPool(f"coffer-{name}-http", self.POOL_SIZE)
        self._notices = WorkerPool(f"coffer-{name}-notify", 1)  # in order, never behind slow calls

    def start(self) -> None:
        if url_origin(self.url) is None:
            raise UpstreamFailure(f"invalid URL {printable(self.url)[:200]!r}", permanent=True)

    def send(self, message: dict) -> bool:
        if self._closed:
            return False
        body = encode_line(message)
        if "id" in message:
            self._pool.submit(self._post, message, body, self._delivered, None)
        else:
            delivered = self._delivered = threading.Event()
            self._notices.submit(self._post, message, body, None, delivered)
        return True

    def _request_headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        headers.update(self.headers)
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        if self.protocol_version:
            headers["MCP-Protocol-Version"] = self.protocol_version
        return headers

    def _post(self, message: dict, body: bytes, after: threading.Event | None,
              delivered: threading.Event | None) -> None:
        if after is not None:
            after.wait(self.timeout)
        try:
            self._exchange(message, body)
        finally:
            if delivered is not None:
                delivered.set()

    def _exchange(self, message: dict, body: bytes) -> None:
        initializing = message.get("method") == "initialize"
        try:
            reply = authorized_exchange(self.name, self.auth, "POST", self.url, headers=self._request_headers(),
                                        body=body, timeout=self.timeout, stream=True)
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
            if exc.permanent:
                self._fatal(exc, message)
            return
        if reply.status == 404 and self.session_id:
            _close_reply(reply)
            log.warning("[%s] HTTP session expired", self.name)
            self._closed = True
            self.close_reason = "expired its HTTP session"
            self.on_close()
            return
        if not 200 <= reply.status < 300:
            text = f"HTTP {reply.status}: {_reply_text(reply)}".rstrip(": ")
            if initializing and reply.status in (401, 403, 404, 405):
                hints = {401: " (it wants credentials: check --header)", 403: " (the credentials were refused)",
                         404: " (check the URL; an older HTTP+SSE server? add it with --transport sse)",
                         405: " (an older HTTP+SSE server? add it with --transport sse)"}
                self.fatal = UpstreamFailure(text + hints[reply.status], permanent=True)
                text = str(self.fatal)
            self._fail(message, text)
            return
        answered = "id" not in message
        try:
            session = reply.headers.get("mcp-session-id")
            if session and initializing:
                if not _SESSION_ID_RE.match(session):
                    self.fatal = UpstreamFailure("the server sent an invalid Mcp-Session-Id", permanent=True)
                    self._fail(message, str(self.fatal))
                    return
                self.session_id = session
            answered = self._consume(reply, message.get("id")) or answered
            if not answered:
                kind = _content_type(reply) or "no content type"
                text = f"the server's reply ({printable(kind)[:60]}) held no answer"
                if initializing and kind not in ("application/json", "text/event-stream"):
                    self.fatal = UpstreamFailure(f"{text}: not an MCP endpoint", permanent=True)
                self._fail(message, text)
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
        except stream_errors() as exc:
            self._fail(message, f"{self.name} broke off its reply: {exc.__class__.__name__}")
        finally:
            _close_reply(reply)

    def _fatal(self, exc: UpstreamFailure, message: dict) -> None:
        """Retrying cannot fix this (a login only a person can give, an origin refused).  At start the Upstream
        reports it at once; once running, the connection ends so the server's status says so too (its restart
        then fails at once, for the same reason)."""
        self.fatal = exc
        if message.get("method") != "initialize" and not self._closed:
            self._closed = True
            self.close_reason = str(exc)
            self.on_close()

    def _consume(self, reply: HttpReply, request_id=None) -> bool:
        """Deliver what a reply holds; True when it held the answer to ``request_id``."""
        answered = False
        kind = _content_type(reply)
        if kind == "application/json":
            data = reply.stream.read(self.max_body + 1)
            if len(data) > self.max_body:
                raise UpstreamFailure(f"a reply larger than max_message_bytes ({self.max_body} bytes)")
            if data.strip():
                for item in _messages_of(data, self.name, self.on_unusable):
                    answered = self._deliver(item, request_id) or answered
        elif kind == "text/event-stream":
            for event in read_sse_events(reply.stream.readline, self.max_body):
                if event.oversized:
                    self.on_unusable(event.data, f"an event of {event.oversized} bytes, more than "
                                                 f"max_message_bytes ({self.max_body})")
                    answered = answered or request_id_in(event.data) == request_id
                elif event.kind == "message":
                    for item in _messages_of(event.data, self.name, self.on_unusable):
                        answered = self._deliver(item, request_id) or answered
        return answered

    def _deliver(self, item: dict, request_id=None) -> bool:
        is_answer = request_id is not None and item.get("id") == request_id and "method" not in item
        if is_answer and isinstance(item.get("result"), dict) and self.protocol_version is None and \
                isinstance(item["result"].get("protocolVersion"), str):
            self.protocol_version = item["result"]["protocolVersion"][:32]  # the initialize reply only
            self._start_listening()
        self.on_message(item)
        return is_answer

    def _start_listening(self) -> None:
        """Open the optional GET stream on which the server sends requests and notifications of its own."""
        if self._listening:
            return
        self._listening = True

        def listen():
            headers = self._request_headers()
            headers["Accept"] = "text/event-stream"
            if self._delivered is not None:
                self._delivered.wait(self.timeout)  # after notifications/initialized has gone out
            try:
                reply = authorized_exchange(self.name, self.auth, "GET", self.url, headers=headers,
                                            timeout=self.timeout, stream=True)
                if 200 <= reply.status < 300 and reply.stream is not None:
                    self._stream = reply.stream
                    settle_stream(reply.stream)
                    try:
                        if not self._closed:
                            self._consume(reply)
                    finally:
                        self._stream = None
                        _close_reply(reply)
                else:
                    _close_reply(reply)
            except (UpstreamFailure, *stream_errors()) as exc:
                log.debug("[%s] no server stream: %s", self.name, exc)  # 405: this server has none

        start_thread(listen, f"coffer-{self.name}-sse")

    def close(self, grace: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        stream = self._stream
        if stream is not None:
            abort_stream(stream)
        self._pool.close()
        self._notices.close()
        if self.session_id:
            try:
                headers = {**self._request_headers(), **(self.auth.headers_for(self.url) if self.auth else {})}
                remote_http("DELETE", self.url, headers=headers, timeout=grace, max_bytes=_ERROR_BODY_BYTES)
            except UpstreamFailure:
                pass


# -- legacy HTTP+SSE --------------------------------------------------------------------------------------------

def checked_sse_endpoint(event: SseEvent, stream_url: str, configured_url: str) -> str:
    """The URL an HTTP+SSE stream's ``endpoint`` event names, if Coffer may POST to it: text, a URL, and on the
    configured origin (it receives the same credentials); else UpstreamFailure or OriginRefused."""
    try:
        text = event.data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UpstreamFailure("the SSE endpoint event is not UTF-8 text") from None
    if event.oversized or not text or len(text) > 4096 or not text.isprintable():
        raise UpstreamFailure("the SSE endpoint event does not hold a URL")
    endpoint = urllib.parse.urljoin(stream_url, text)
    if not same_origin(endpoint, configured_url):
        raise OriginRefused(f"the SSE stream named an endpoint on {origin_text(endpoint)}, not on "
                            f"{origin_text(configured_url)}: refused, credentials never leave the configured origin")
    return urllib.parse.urldefrag(endpoint)[0]


class SseTransport(Transport):
    """An upstream MCP server over the 2024-11-05 HTTP+SSE transport: one long GET stream carries everything the
    server says; everything Coffer says is POSTed to the endpoint the stream announced first, which must be on
    the configured origin (it receives the same credentials).

    Threads: ``start`` runs on the upstream's start thread (opens the stream, waits for the endpoint);
    coffer-<name>-sse reads the stream until it ends; coffer-<name>-post sends the POSTs one at a time, in the
    order ``send`` (any thread) queued them, so initialize, its notification and what follows keep their order.
    The transport defines no resumption: when the stream drops, the session is gone.  The transport then calls
    ``on_close`` once with ``close_reason`` set; the Upstream fails what was in flight (not retried: a tool call
    may have run) and starts a new session, and requests that arrive meanwhile wait for it.
    """

    def __init__(self, name, url, headers, on_message, on_close, timeout, auth=None,
                 max_message_bytes: int = 64 << 20, on_failure=None, on_unusable=None):
        self.name, self.url, self.headers = name, url, dict(headers)
        self.on_message, self.on_close = on_message, on_close
        self.on_failure = on_failure or (lambda request_id, text: on_message(rpc_error(
            request_id, UPSTREAM_ERROR, f"'{name}': {text}")))
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.timeout = timeout
        self.auth = auth
        self.max_message_bytes = max_message_bytes
        self.endpoint: str | None = None
        self.close_reason: str | None = None
        self.fatal: UpstreamFailure | None = None  # a permanent failure met (a needed login, a refused origin)
        self.pid = None
        self._stream = self._stream_url = None
        self._events = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._close_signalled = False

    def start(self) -> None:
        if url_origin(self.url) is None:
            raise UpstreamFailure(f"unsupported URL {self.url!r}")
        reply = authorized_exchange(self.name, self.auth, "GET", self.url, timeout=self.timeout, stream=True,
                                    headers={"Accept": "text/event-stream", "Cache-Control": "no-cache",
                                             **self.headers})
        if not 200 <= reply.status < 300:
            _close_reply(reply)
            raise UpstreamFailure(f"GET {origin_text(self.url)} answered HTTP {reply.status}: {_reply_text(reply)}")
        if _content_type(reply) != "text/event-stream":
            _close_reply(reply)
            raise UpstreamFailure(f"{self.url} is not an SSE stream (Content-Type: "
                                  f"{printable(_content_type(reply))[:60] or 'none'})")
        self._stream, self._stream_url = reply.stream, reply.url
        readline = until_endpoint(reply.stream.readline, lambda: self.endpoint is not None, self.timeout, self.url)
        self._events = read_sse_events(readline, self.max_message_bytes)
        try:
            # The endpoint must come first, within the start timeout (the socket's timeout until settled).
            for event in self._events:
                if event.kind == "endpoint":
                    self.endpoint = self._checked_endpoint(event, reply.url)
                    break
                log.warning("[%s] ignored a %r event that came before the endpoint", self.name, event.kind)
        except UpstreamFailure:
            _close_reply(reply)
            raise
        except stream_errors() as exc:
            _close_reply(reply)
            raise UpstreamFailure(f"the SSE stream of {origin_text(self.url)} broke before announcing its "
                                  f"endpoint: {exc.__class__.__name__}") from None
        if self.endpoint is None:
            _close_reply(reply)
            raise UpstreamFailure(f"the SSE stream of {origin_text(self.url)} ended before announcing its endpoint")
        with self._lock:
            if self._closed:
                _close_reply(reply)
                raise UpstreamFailure("stopped while starting")
        settle_stream(reply.stream)
        start_thread(self._read, f"coffer-{self.name}-sse")
        start_thread(self._write, f"coffer-{self.name}-post")

    def _checked_endpoint(self, event: SseEvent, stream_url: str) -> str:
        return checked_sse_endpoint(event, stream_url, self.url)

    def send(self, message: dict) -> bool:
        with self._lock:
            if self._closed or self.endpoint is None:
                return False
            self._outbox.put(message)
        return True

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None or self._closed:
                return
            try:
                self._post(message)
            except Exception:  # noqa: BLE001 - one message is lost, not the writer
                log.exception("[%s] error sending a message", self.name)
                self._fail(message, "internal error while sending it")

    def _post(self, message: dict) -> None:
        try:
            body = encode_line(message)
        except ValueError as exc:
            self._fail(message, f"cannot encode the message: {exc}")
            return
        if len(body) > self.max_message_bytes:
            self._fail(message, f"message larger than {self.max_message_bytes} bytes")
            return
        try:
            reply = authorized_exchange(self.name, self.auth, "POST", self.endpoint, body=body,
                                        timeout=self.timeout, max_bytes=_ERROR_BODY_BYTES,
                                        headers={"Content-Type": "application/json", **self.headers})
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
            if getattr(exc, "permanent", False):
                self.fatal = exc
                self._lost(str(exc), in_flight_note=False)
            return
        if 200 <= reply.status < 300:
            return
        if reply.status in (404, 410):  # the server no longer knows this session (it restarted, or timed it out)
            self._fail(message, "the server forgot the SSE session")
            self._lost(f"lost its SSE session (POST answered HTTP {reply.status})")
            return
        self._fail(message, f"HTTP {reply.status}: {_reply_text(reply)}")

    def _read(self) -> None:
        reason = "ended its SSE stream"
        try:
            for event in self._events:
                if event.oversized:
                    self._oversized(event)
                elif event.kind == "message":
                    for item in _messages_of(event.data, self.name, self.on_unusable):
                        try:
                            self.on_message(item)
                        except Exception:  # noqa: BLE001 - a routing bug must not end the stream
                            log.exception("[%s] error handling a message", self.name)
                elif event.kind == "endpoint":
                    self.endpoint = self._checked_endpoint(event, self._stream_url)  # moves within the origin only
        except UpstreamFailure as exc:
            reason = str(exc)
        except stream_errors() as exc:
            reason = f"dropped its SSE stream ({exc.__class__.__name__})"
        finally:
            try:
                self._stream.close()
            except (OSError, ValueError):
                pass
        self._lost(reason)

    def _oversized(self, event: SseEvent) -> None:
        self.on_unusable(event.data, f"an event of {event.oversized} bytes, more than max_message_bytes "
                                     f"({self.max_message_bytes})")

    def _lost(self, reason: str, in_flight_note: bool = True) -> None:
        with self._lock:
            if self._closed or self._close_signalled:
                return
            self._close_signalled = True
            self._closed = True
            self.close_reason = reason + ("; calls in flight failed (not retried: a tool call may have run) and a "
                                          "new session starts" if in_flight_note else "")
        self._outbox.put(None)
        if self._stream is not None:
            abort_stream(self._stream)
        log.warning("[%s] %s", self.name, reason)
        self.on_close()

    def close(self, grace: float = 2.0) -> None:
        """End the session: the server sees its stream close.  (HTTP+SSE has no explicit session end.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._outbox.put(None)
        if self._stream is not None:
            abort_stream(self._stream)


# -- transport "auto": the spec's backwards-compatibility procedure --------------------------------------------

def until_endpoint(readline, announced, timeout: float, url: str):
    """``readline`` bounded until ``announced()``: a server must not trickle comments or other events forever
    (each within the socket timeout) instead of naming its endpoint; at most 1 MiB or ``timeout`` seconds."""
    deadline, seen = time.monotonic() + timeout, [0]

    def bounded(limit: int) -> bytes:
        line = readline(limit)
        if not announced():
            seen[0] += len(line)
            if seen[0] > 1 << 20 or time.monotonic() > deadline:
                raise UpstreamFailure(f"the SSE stream of {origin_text(url)} did not announce its endpoint within "
                                      f"{timeout:g} s")
        return line

    return bounded


class TransportProbe(NamedTuple):
    kind: str       # "http" or "sse"
    detail: str     # what answered, for the user


def _probe_initialize() -> bytes:
    return encode_line({"jsonrpc": "2.0", "id": "coffer-probe", "method": "initialize", "params": {
        "protocolVersion": LATEST_PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "coffer", "version": __version__}}})


def probe_transport(name: str, url: str, headers: dict, auth=None, timeout: float = 10.0) -> TransportProbe:
    """Which transport ``url`` speaks (MCP 2025-11-25 transports, backwards compatibility): POST an initialize;
    a 2xx means Streamable HTTP; a 400, 404 or 405 means try GET, and an SSE stream that opens with an
    ``endpoint`` event means HTTP+SSE.  Raises NeedsLogin or UpstreamFailure (saying what each attempt got)."""
    if url_origin(url) is None:
        raise UpstreamFailure(f"unsupported URL {url!r}")
    reply = authorized_exchange(name, auth, "POST", url, body=_probe_initialize(), timeout=timeout, stream=True,
                                headers={"Content-Type": "application/json",
                                         "Accept": "application/json, text/event-stream", **headers})
    _close_reply(reply)
    if 200 <= reply.status < 300:
        if _content_type(reply) not in ("application/json", "text/event-stream"):
            raise UpstreamFailure(f"{url} answered an MCP initialize with {printable(_content_type(reply))[:60]}"
                                  " content: not an MCP endpoint")
        session = reply.headers.get("mcp-session-id")
        if session and len(session) < 1024:  # the probe's session is not the one the transport will use
            try:
                remote_http("DELETE", url, timeout=min(timeout, 5.0), max_bytes=_ERROR_BODY_BYTES,
                            headers={**headers, **(auth.headers_for(url) if auth else {}),
                                     "Mcp-Session-Id": session})
            except UpstreamFailure:
                pass
        return TransportProbe("http", "Streamable HTTP")
    if reply.status not in (400, 404, 405):
        hint = {401: " (it wants credentials: check --header, or `coffer auth`)",
                403: " (the credentials were refused)"}.get(reply.status, "")
        raise UpstreamFailure(f"{url} answered an MCP initialize with HTTP {reply.status}: {_reply_text(reply)}"
                              f"{hint}", permanent=reply.status in (401, 403))
    post_status = reply.status
    stream = authorized_exchange(name, auth, "GET", url, timeout=timeout, stream=True,
                                 headers={"Accept": "text/event-stream", **headers})
    try:
        if 200 <= stream.status < 300 and _content_type(stream) == "text/event-stream":
            for event in read_sse_events(until_endpoint(stream.stream.readline, lambda: False, timeout, url),
                                         64 << 10):
                if event.kind == "endpoint":
                    checked_sse_endpoint(event, stream.url, url)
                    return TransportProbe("sse", "HTTP+SSE (the 2024-11-05 transport)")
                break
        got = f"HTTP {stream.status} {printable(_content_type(stream))[:60]}".strip()
    except stream_errors() as exc:
        got = f"a broken stream ({exc.__class__.__name__})"
    finally:
        _close_reply(stream)
    raise UpstreamFailure(f"{url} speaks neither Streamable HTTP (POST initialize: HTTP {post_status}) nor "
                          f"HTTP+SSE (GET: {got}, no endpoint event): check the URL", permanent=True)


class AutoTransport(Transport):
    """Transport "auto": on start, ask the server which transport it speaks (probe_transport), then be that
    transport.  ``detected`` ('http' or 'sse') is what the gateway writes to the vault, so the next start goes
    straight to it.  Same surface and threads as the transport it becomes."""

    def __init__(self, name, url, headers, auth, timeout, make):
        self.name, self.url, self.headers, self.auth, self.timeout = name, url, headers, auth, timeout
        self._make = make       # kind -> HttpTransport or SseTransport, with the upstream's callbacks
        self.detected: str | None = None
        self.inner = None
        self.pid = None
        self._closed = False

    def start(self) -> None:
        probe = probe_transport(self.name, self.url, self.headers, self.auth, self.timeout)
        if self._closed:
            raise UpstreamFailure("stopped while starting")
        self.detected = probe.kind
        log.info("[%s] speaks %s", self.name, probe.detail)
        self.inner = self._make(probe.kind)
        self.inner.start()
        if self._closed:  # stopped while the probe ran: do not leave the session open
            self.inner.close(0.5)

    def send(self, message: dict) -> bool:
        return self.inner is not None and self.inner.send(message)

    @property
    def close_reason(self):
        return getattr(self.inner, "close_reason", None)

    @property
    def fatal(self):
        return getattr(self.inner, "fatal", None)

    def close(self, grace: float = 2.0) -> None:
        self._closed = True
        if self.inner is not None:
            self.inner.close(grace)


def make_remote_transport(name: str, kind: str, url: str, headers: dict, store, on_message, on_close,
                          timeout: float, max_message_bytes: int = 64 << 20, on_failure=None, on_unusable=None):
    """The transport for a remote server (``kind`` is the vault's transport: auto, http or sse).

    OAuth applies unless the server is configured with its own Authorization header: that header is the user's
    choice of credentials and is sent as is (a 401 then reports that it was refused).
    """
    has_own_authorization = any(key.lower() == "authorization" for key in headers)
    auth = None if has_own_authorization or store is None else OAuthCredentials(name, url, store)

    def make(actual: str):
        if actual == "sse":
            return SseTransport(name, url, headers, on_message, on_close, timeout, auth, max_message_bytes,
                                on_failure, on_unusable)
        return HttpTransport(name, url, headers, on_message, on_close, timeout, on_unusable, max_message_bytes,
                             auth=auth, on_failure=on_failure)

    if kind == "auto":
        return AutoTransport(name, url, headers, auth, min(timeout, 30.0), make)
    return make(kind)


# -- OAuth: discovery ------------------------------------------------------------------------------------------
# MCP 2025-11-25 basic/authorization: 401 + WWW-Authenticate → protected resource metadata (RFC 9728) →
# authorization server metadata (RFC 8414 / OpenID discovery) → client identity → authorization code + PKCE.

class OAuthFailure(CofferError):
    """A login that cannot proceed; says why in terms the user can act on."""


class NeedsLogin(UpstreamFailure):
    """A remote server needs a person to log in.  Permanent until `coffer auth NAME` runs: never retried, and
    never answered by opening a browser from `coffer serve`."""

    permanent = True

    def __init__(self, server: str, why: str = ""):
        self.server = server
        super().__init__(f"'{server}' needs login: run `coffer auth {server}`" + (f" ({why})" if why else ""),
                         permanent=True)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_CHALLENGE_PART_RE = re.compile(rf'\s*,?\s*({_TOKEN})(?:\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*))?')


def parse_www_authenticate(value) -> dict[str, dict[str, str]]:
    """{scheme (lower case): {param (lower case): value}} from a WWW-Authenticate header (RFC 9110 §11.6.1).
    Unparseable parts are skipped; the header is cut at 8 KiB."""
    challenges: dict[str, dict[str, str]] = {}
    if not isinstance(value, str):
        return challenges
    text, position, current = value[:8192], 0, None
    while position < len(text):
        match = _CHALLENGE_PART_RE.match(text, position)
        if not match or match.end() == position:
            position += 1
            continue
        position = match.end()
        token, raw = match.group(1), match.group(2)
        if raw is None:
            current = challenges.setdefault(token.lower(), {})
        elif current is not None and token.lower() not in current:
            if raw.startswith('"'):
                raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
            current[token.lower()] = raw
    return challenges


def canonical_resource(url: str) -> str:
    """RFC 8707 form of a server URL: lower-case scheme and host, no fragment, no lone trailing slash."""
    parts = urllib.parse.urlsplit(url)
    path = "" if parts.path == "/" else parts.path
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, ""))


def resource_matches(server_url: str, resource) -> bool:
    """Whether protected resource metadata naming ``resource`` may speak for ``server_url`` (RFC 9728 §3.3):
    the same origin, and the resource's path is the server's path or a whole-segment prefix of it (a server at
    /mcp may be covered by a resource naming the origin)."""
    if not isinstance(resource, str) or not same_origin(server_url, resource):
        return False
    resource_parts = urllib.parse.urlsplit(resource)
    if resource_parts.fragment:
        return False
    server_path = urllib.parse.urlsplit(server_url).path.rstrip("/") + "/"
    return server_path.startswith(resource_parts.path.rstrip("/") + "/")


def _str_list(value, limit: int = 100) -> list[str] | None:
    if not isinstance(value, list):
        return None
    return [item for item in value[:limit] if isinstance(item, str) and 0 < len(item) <= 2048]


def _json_object(reply: HttpReply, what: str) -> dict:
    try:
        document = decode_json(reply.body)
    except ValueError as exc:
        raise OAuthFailure(f"{what} is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise OAuthFailure(f"{what} is not a JSON object")
    return document


class ResourceMetadata(NamedTuple):
    """RFC 9728 protected resource metadata, as far as Coffer uses it."""
    resource: str
    authorization_servers: list[str]
    scopes_supported: list[str] | None
    source: str


class AuthServerMetadata(NamedTuple):
    """RFC 8414 / OpenID Provider metadata, as far as Coffer uses it."""
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    registration_endpoint: str | None = None
    revocation_endpoint: str | None = None
    token_auth_methods: list[str] | None = None
    client_id_metadata_documents: bool = False
    iss_parameter: bool = False


def _metadata_get(url: str) -> HttpReply | None:
    """GET one metadata document; None when it is not there (so the next well-known URL is tried)."""
    reply = remote_http("GET", url, timeout=15.0, headers={"Accept": "application/json",
                                                           "MCP-Protocol-Version": LATEST_PROTOCOL_VERSION})
    return reply if reply.status == 200 else None


def discover_resource_metadata(server_url: str, bearer: dict) -> ResourceMetadata | None:
    """The server's protected resource metadata: the URL its 401 named, else the two well-known URLs (path
    first).  A document whose ``resource`` is not this server is refused outright, never skipped over."""
    origin = origin_text(server_url)
    path = urllib.parse.urlsplit(server_url).path.rstrip("/")
    candidates = [bearer["resource_metadata"]] if bearer.get("resource_metadata") else []
    if path:
        candidates.append(f"{origin}/.well-known/oauth-protected-resource{path}")
    candidates.append(f"{origin}/.well-known/oauth-protected-resource")
    for url in candidates:
        if url_origin(url) is None:
            raise OAuthFailure(f"the server's 401 names resource metadata at a non-http URL: {printable(url)[:200]}")
        reply = _metadata_get(url)
        if reply is None:
            continue
        document = _json_object(reply, f"the protected resource metadata at {url}")
        resource = document.get("resource")
        if not resource_matches(server_url, resource):
            raise OAuthFailure(f"the protected resource metadata at {url} is for "
                               f"{printable(str(resource))[:200]!r}, not for {server_url}: refused (RFC 9728 §3.3); "
                               "a token obtained through it could be meant for another server")
        servers = _str_list(document.get("authorization_servers")) or []
        if not servers:
            raise OAuthFailure(f"the protected resource metadata at {url} names no authorization server")
        return ResourceMetadata(resource, servers, _str_list(document.get("scopes_supported")), url)
    return None


def authorization_server_metadata_urls(issuer: str) -> list[str]:
    """Where an issuer's metadata may be, in the order MCP 2025-11-25 prescribes (RFC 8414 path insertion,
    then OpenID Connect discovery with path insertion, then with path appending)."""
    origin = origin_text(issuer)
    path = urllib.parse.urlsplit(issuer).path.rstrip("/")
    if path:
        return [f"{origin}/.well-known/oauth-authorization-server{path}",
                f"{origin}/.well-known/openid-configuration{path}",
                f"{origin}{path}/.well-known/openid-configuration"]
    return [f"{origin}/.well-known/oauth-authorization-server", f"{origin}/.well-known/openid-configuration"]


def _issuers_match(a: str, b: str) -> bool:
    """RFC 8414 §3.3 string comparison, a root issuer's trailing slash aside."""
    return a == b or (a.rstrip("/") == b.rstrip("/") and urllib.parse.urlsplit(a).path in ("", "/"))


def discover_authorization_server(issuer: str) -> AuthServerMetadata:
    _require_secure(issuer, "the authorization server")
    for url in authorization_server_metadata_urls(issuer):
        reply = _metadata_get(url)
        if reply is None:
            continue
        document = _json_object(reply, f"the authorization server metadata at {url}")
        if not isinstance(document.get("issuer"), str) or not _issuers_match(document["issuer"], issuer):
            raise OAuthFailure(f"the metadata at {url} is for issuer {printable(str(document.get('issuer')))[:200]!r}"
                               f", not {issuer}: refused (RFC 8414 §3.3)")
        methods = _str_list(document.get("code_challenge_methods_supported")) or []
        if "S256" not in methods:
            raise OAuthFailure(f"the authorization server {issuer} does not offer PKCE with S256: refused "
                               "(MCP requires it to protect the authorization code)")
        endpoints = {}
        for key in ("authorization_endpoint", "token_endpoint", "registration_endpoint", "revocation_endpoint"):
            value = document.get(key)
            if value is not None:
                endpoints[key] = _require_secure(value, f"the {key.replace('_', ' ')}")
        if "authorization_endpoint" not in endpoints or "token_endpoint" not in endpoints:
            raise OAuthFailure(f"the metadata at {url} lacks an authorization or token endpoint")
        return AuthServerMetadata(
            issuer=issuer, token_auth_methods=_str_list(document.get("token_endpoint_auth_methods_supported")),
            client_id_metadata_documents=document.get("client_id_metadata_document_supported") is True,
            iss_parameter=document.get("authorization_response_iss_parameter_supported") is True, **endpoints)
    raise OAuthFailure(f"no authorization server metadata at {' or '.join(authorization_server_metadata_urls(issuer))}")


# -- OAuth: the saved login ------------------------------------------------------------------------------------

class OAuthGrant(NamedTuple):
    """A server's saved login: tokens and what is needed to refresh them.  Lives in the SecretStore under
    oauth.<server> as one JSON text, never in coffer.db, logs or output."""
    server_url: str
    resource: str
    issuer: str
    token_endpoint: str
    client_id: str
    client_auth: str                        # none, client_secret_basic or client_secret_post
    client_source: str                      # pre-registered, metadata-document or registered
    access_token: str
    token_type: str = "Bearer"
    refresh_token: str | None = None
    client_secret: str | None = None        # only for a client Coffer registered itself
    client_secret_env: str | None = None    # a pre-registered client's secret: the variable holding it
    redirect_uri: str | None = None
    revocation_endpoint: str | None = None
    scope: str | None = None
    expires_at: float | None = None
    lifetime: float | None = None
    obtained_at: float = 0.0

    def secret_values(self) -> list[str]:
        return [v for v in (self.access_token, self.refresh_token, self.client_secret) if v]

    def refresh_due(self, now: float) -> bool:
        """Refresh a little before expiry: a tenth of the lifetime, between 1 s and 60 s."""
        if self.expires_at is None:
            return False
        return now >= self.expires_at - min(60.0, max(1.0, 0.1 * (self.lifetime or 0.0)))

    def to_text(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> OAuthGrant:
        data = decode_json(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        known = set(cls._fields)
        values = {key: value for key, value in data.items() if key in known}
        for key, value in values.items():
            if key in ("expires_at", "lifetime", "obtained_at"):
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"{key} is not a number")
            elif value is not None and (not isinstance(value, str) or len(value) > 65536):
                raise ValueError(f"{key} is not text")
        grant = cls(**values)
        for key in ("server_url", "resource", "token_endpoint", "client_id", "access_token"):
            if not getattr(grant, key):
                raise ValueError(f"{key} is missing")
        return grant


def oauth_secret_name(server: str) -> str:
    return OAUTH_SECRET_PREFIX + server


class TokenEndpointError(Exception):
    """The token endpoint said no; ``error`` is its OAuth error code (invalid_grant, ...) when it gave one."""

    def __init__(self, error: str, text: str):
        super().__init__(text)
        self.error = error


def _client_authenticated(form: dict, client_id: str, client_auth: str, client_secret: str | None
                          ) -> tuple[dict, bytes]:
    """(headers, body) of a form POST to a token or revocation endpoint, with the client's own authentication
    (RFC 6749 §2.3): Basic, or the secret in the body, or none for a public client."""
    form = dict(form, client_id=client_id)  # in the body even with Basic: many servers (the MCP SDK's) want it
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if client_auth == "client_secret_basic" and client_secret:
        pair = f"{urllib.parse.quote(client_id, safe='')}:{urllib.parse.quote(client_secret, safe='')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    elif client_auth == "client_secret_post" and client_secret:
        form["client_secret"] = client_secret
    return headers, urllib.parse.urlencode({k: v for k, v in form.items() if v is not None}).encode("ascii")


def token_request(token_endpoint: str, form: dict, client_id: str, client_auth: str,
                  client_secret: str | None) -> dict:
    """POST to the token endpoint (RFC 6749 §3.2) with the client's own authentication; returns the validated
    token response.  Only ever carries a code or a refresh token: never a bearer token."""
    _require_secure(token_endpoint, "the token endpoint")
    headers, body = _client_authenticated(form, client_id, client_auth, client_secret)
    headers["Accept"] = "application/json"
    try:
        reply = remote_http("POST", token_endpoint, headers=headers, body=body, timeout=30.0)
    except UpstreamFailure as exc:
        raise TokenEndpointError("", str(exc)) from None
    try:
        document = decode_json(reply.body)
    except ValueError:
        document = None
    if reply.status != 200:
        error = document.get("error") if isinstance(document, dict) else None
        error = error if isinstance(error, str) and len(error) < 100 else ""
        detail = document.get("error_description") if isinstance(document, dict) else None
        detail = printable(redact(detail))[:200] if isinstance(detail, str) else _reply_text(reply)
        raise TokenEndpointError(error, f"the token endpoint answered HTTP {reply.status}"
                                        f"{f' {error}' if error else ''}{f': {detail}' if detail else ''}")
    if not isinstance(document, dict):
        raise TokenEndpointError("", "the token endpoint answered with something other than a JSON object")
    access = document.get("access_token")
    if not isinstance(access, str) or not 0 < len(access) <= 16384 or any(c in access for c in "\r\n"):
        raise TokenEndpointError("", "the token endpoint sent no usable access_token")
    token_type = document.get("token_type")
    if not isinstance(token_type, str) or token_type.lower() != "bearer":
        raise TokenEndpointError("", f"the token endpoint sent a {printable(str(token_type))[:40]!r} token; "
                                     "Coffer sends Bearer tokens only")
    refresh = document.get("refresh_token")
    expires_in = document.get("expires_in")
    scope = document.get("scope")
    redact.add(access, refresh if isinstance(refresh, str) else None)
    return {"access_token": access,
            "refresh_token": refresh if isinstance(refresh, str) and 0 < len(refresh) <= 16384 else None,
            "expires_in": float(expires_in) if isinstance(expires_in, (int, float)) and not isinstance(
                expires_in, bool) and 0 < expires_in < 10 * 365 * 86400 else None,
            "scope": scope if isinstance(scope, str) and len(scope) <= 4096 else None}


def _apply_tokens(grant: OAuthGrant, tokens: dict, now: float) -> OAuthGrant:
    """The grant after a token response: a refresh response may omit the refresh token (not rotated) and the
    scope (unchanged), RFC 6749 §6."""
    lifetime = tokens["expires_in"]
    return grant._replace(access_token=tokens["access_token"], refresh_token=tokens["refresh_token"] or
                          grant.refresh_token, scope=tokens["scope"] or grant.scope, lifetime=lifetime,
                          expires_at=now + lifetime if lifetime else None, obtained_at=now)


class OAuthCredentials:
    """The bearer token of one remote upstream: read from the secret store, refreshed shortly before it expires
    and when the server answers 401, forgotten when the authorization server says invalid_grant.  Never opens a
    browser: whatever needs a person raises NeedsLogin.  The token goes only to the server's own origin.

    Threads: any HTTP worker thread of the upstream.  One lock serialises the refresh, so requests that find the
    token due together cause one refresh.  Other processes (a second `coffer serve`, `coffer auth`) share the
    store: before refreshing, and before giving up on invalid_grant, the store is read again in case one of them
    already refreshed (refresh tokens may be single-use).
    """

    def __init__(self, server: str, url: str, store):
        self.server, self.url, self.store = server, url, store
        self._lock = threading.Lock()
        self._warned: str | None = None

    def _load(self) -> OAuthGrant | None:
        text = self.store.get(oauth_secret_name(self.server))
        if text is None:
            return None
        try:
            grant = OAuthGrant.from_text(text)
        except (ValueError, TypeError) as exc:
            self._warn_once(f"the saved login is damaged ({exc}); run `coffer auth {self.server}`")
            return None
        redact.add(*grant.secret_values())
        if not (same_origin(grant.server_url, self.url) and resource_matches(self.url, grant.resource)):
            self._warn_once(f"the saved login is for {origin_text(grant.server_url)}, not this server's URL; "
                            "it is not sent")
            return None
        return grant

    def _warn_once(self, text: str) -> None:
        if self._warned != text:
            self._warned = text
            log.warning("[%s] %s", self.server, text)

    def headers_for(self, url: str) -> dict:
        """The Authorization header for a request to ``url``: none for another origin, none before a login."""
        if not same_origin(url, self.url):
            return {}
        with self._lock:
            grant = self._load()
            if grant is None:
                return {}
            if grant.refresh_due(time.time()):
                try:
                    grant = self._refresh(grant)
                except UpstreamFailure as exc:
                    if isinstance(exc, NeedsLogin) or time.time() >= (grant.expires_at or 0):
                        raise
                    log.warning("[%s] could not refresh the login yet: %s", self.server, exc)
        return {"Authorization": f"Bearer {grant.access_token}"}

    def unauthorized(self, bearer: dict, sent_authorization: str | None) -> None:
        """The server answered 401 to ``sent_authorization``: returns when a newer token is ready to retry with,
        raises NeedsLogin (no login, or the authorization server refused it) or UpstreamFailure (unreachable)."""
        with self._lock:
            grant = self._load()
            if grant is None:
                raise NeedsLogin(self.server)
            if sent_authorization != f"Bearer {grant.access_token}":
                return  # another thread or process has refreshed meanwhile
            self._refresh(grant)

    def _refresh(self, grant: OAuthGrant) -> OAuthGrant:
        latest = self._load()
        if latest is not None and latest.access_token != grant.access_token and not latest.refresh_due(time.time()):
            return latest
        if not grant.refresh_token:
            raise NeedsLogin(self.server, "its login expired and the authorization server gave no refresh token")
        secret = grant_client_secret(grant, self.store)
        try:
            tokens = token_request(grant.token_endpoint, {"grant_type": "refresh_token",
                                                          "refresh_token": grant.refresh_token,
                                                          "resource": grant.resource},
                                   grant.client_id, grant.client_auth, secret)
        except TokenEndpointError as exc:
            if exc.error in ("invalid_grant", "invalid_client", "unauthorized_client"):
                latest = self._load()
                if latest is not None and latest.refresh_token != grant.refresh_token:
                    return latest  # rotated by another process between our read and our request
                self.store.delete(oauth_secret_name(self.server))
                log.warning("[%s] the authorization server refused the saved login (%s); it was forgotten",
                            self.server, exc.error)
                raise NeedsLogin(self.server, f"the authorization server refused its saved login ({exc.error})") \
                    from None
            raise UpstreamFailure(f"could not refresh the login of '{self.server}': {exc}") from None
        grant = _apply_tokens(grant, tokens, time.time())
        self.store.set(oauth_secret_name(self.server), grant.to_text())
        log.info("[%s] refreshed its OAuth token", self.server)
        return grant


def resolve_client_secret(variable: str | None, store) -> str | None:
    """A pre-registered client's secret, from the variable the user named (environment first, then the secret
    store, like ${NAME}).  Coffer stores the variable's name, never the value."""
    if not variable:
        return None
    value = os.environ.get(variable)
    if value is None and store is not None:
        value = store.get(variable)
    if value:
        redact.add(value)
    return value or None


def grant_client_secret(grant: OAuthGrant, store) -> str | None:
    if grant.client_source == "registered":
        return grant.client_secret
    return resolve_client_secret(grant.client_secret_env, store)


# -- OAuth: the login (only ever from `coffer auth`) ---------------------------------------------------------

class ClientIdentity(NamedTuple):
    client_id: str
    client_secret: str | None
    client_auth: str
    source: str             # pre-registered, metadata-document or registered


def _client_auth_method(methods: list[str] | None, has_secret: bool) -> str:
    if not has_secret:
        return "none"
    if methods is None or "client_secret_basic" in methods:  # RFC 8414: the default when unlisted
        return "client_secret_basic"
    if "client_secret_post" in methods:
        return "client_secret_post"
    raise OAuthFailure("the authorization server accepts neither client_secret_basic nor client_secret_post "
                       f"(it lists {', '.join(methods)[:200]})")


def choose_client(server: str, metadata: AuthServerMetadata, oauth: dict, store, settings: dict,
                  redirect_uri: str, scope: str | None, previous: OAuthGrant | None) -> ClientIdentity:
    """Who Coffer is to this authorization server, in the order MCP 2025-11-25 gives: the client the user
    pre-registered (--oauth-client-id), a Client ID Metadata Document when the server supports them, Dynamic
    Client Registration (RFC 7591), else an error saying how to pre-register."""
    if oauth.get("client_id"):
        variable = oauth.get("client_secret_env")
        secret = resolve_client_secret(variable, store)
        if variable and not secret:
            raise OAuthFailure(f"{variable} (named by --oauth-client-secret-env) is not set in the environment "
                               "or the secret store")
        return ClientIdentity(oauth["client_id"], secret, _client_auth_method(metadata.token_auth_methods,
                                                                              bool(secret)), "pre-registered")
    document_url = settings.get("oauth_client_metadata_url") or ""
    if metadata.client_id_metadata_documents and document_url:
        parts = urllib.parse.urlsplit(document_url)
        if parts.path in ("", "/") or (parts.scheme != "https" and not is_loopback_url(document_url)):
            raise OAuthFailure("the oauth_client_metadata_url setting must be an https URL with a path")
        return ClientIdentity(document_url, None, "none", "metadata-document")
    if metadata.registration_endpoint:
        if (previous is not None and previous.client_source == "registered" and previous.issuer == metadata.issuer
                and previous.redirect_uri == redirect_uri):
            return ClientIdentity(previous.client_id, previous.client_secret, previous.client_auth, "registered")
        return register_client(metadata, redirect_uri, scope)
    raise OAuthFailure(f"the authorization server {metadata.issuer} lets no client register itself: register "
                       f"an OAuth app with the provider (redirect URI http://127.0.0.1/callback), then run "
                       f"`coffer auth {server} --oauth-client-id ID [--oauth-client-secret-env VAR]`")


def register_client(metadata: AuthServerMetadata, redirect_uri: str, scope: str | None) -> ClientIdentity:
    """Dynamic Client Registration (RFC 7591) as a public client: Coffer keeps no secret it does not need."""
    request = {"client_name": "Coffer", "redirect_uris": [redirect_uri], "grant_types": ["authorization_code", "refresh_token"],
               "response_types": ["code"], "token_endpoint_auth_method": "none"}
    if scope:
        request["scope"] = scope
    reply = remote_http("POST", metadata.registration_endpoint, body=encode_line(request), timeout=30.0,
                        headers={"Content-Type": "application/json", "Accept": "application/json"})
    if reply.status not in (200, 201):
        raise OAuthFailure(f"client registration at {metadata.registration_endpoint} failed: HTTP {reply.status}"
                           f" {_reply_text(reply)}")
    document = _json_object(reply, "the client registration reply")
    client_id, secret = document.get("client_id"), document.get("client_secret")
    if not isinstance(client_id, str) or not 0 < len(client_id) <= 2048:
        raise OAuthFailure("the client registration reply holds no client_id")
    secret = secret if isinstance(secret, str) and 0 < len(secret) <= 4096 else None
    method = document.get("token_endpoint_auth_method") or ("client_secret_basic" if secret else "none")
    if method not in ("none", "client_secret_basic", "client_secret_post") or (method != "none" and not secret):
        raise OAuthFailure(f"the authorization server registered Coffer for {printable(str(method))[:60]!r} "
                           "client authentication, which Coffer cannot do")
    redact.add(secret)
    return ClientIdentity(client_id, secret, method, "registered")


class LoopbackReceiver:
    """Receives the authorization response on http://127.0.0.1:<port>/callback (RFC 8252 §7.3), once.

    Threads: the listener thread coffer-oauth-callback serves requests; ``wait`` runs on the CLI's thread.  A
    request that is not the callback gets a 404; the page the browser shows repeats nothing from the request.
    """

    def __init__(self, port: int = 0):
        import http.server

        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server interface
                path, _, query = self.path.partition("?")
                if path != "/callback" or len(query) > 16384:
                    self.send_error(404)
                    return
                params = {k: v[0] for k, v in urllib.parse.parse_qs(query, max_num_fields=20).items()}
                if not ({"code", "error", "state"} & params.keys()):
                    self.send_error(400)
                    return
                receiver.deliver(params)
                page = (b"<!doctype html><title>Coffer</title><p>Coffer received the answer of the authorization "
                        b"server. You can close this tab and return to the terminal.</p>")
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):  # the request line holds the code: it must not reach stderr
                pass

        self._server = http.server.HTTPServer(("127.0.0.1", port), Handler)
        self.redirect_uri = f"http://127.0.0.1:{self._server.server_address[1]}/callback"
        self._result: dict | None = None
        self._done = threading.Event()
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="coffer-oauth-callback", daemon=True).start()

    def deliver(self, params: dict) -> None:
        if self._result is None:
            self._result = params
            self._done.set()

    def wait(self, timeout: float) -> dict | None:
        self._done.wait(timeout)
        return self._result

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _open_receiver(previous: OAuthGrant | None) -> LoopbackReceiver:
    """Listen on the port a registered client's redirect URI names when it is free, so the registration can be
    reused; else on any free port."""
    if previous is not None and previous.client_source == "registered" and previous.redirect_uri:
        try:
            return LoopbackReceiver(urllib.parse.urlsplit(previous.redirect_uri).port or 0)
        except (OSError, ValueError):
            pass
    return LoopbackReceiver(0)


def _pkce_pair() -> tuple[str, str]:
    import base64
    import secrets

    verifier = secrets.token_urlsafe(64)  # 86 characters of the unreserved set (RFC 7636 §4.1)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=")
    return verifier, challenge.decode("ascii")


def _read_pasted_callback(receiver: LoopbackReceiver, stdin) -> None:
    """For a browser on another machine: the address it ended on, pasted into the terminal, is the callback."""
    try:
        for line in stdin:
            line = line.strip()
            parts = urllib.parse.urlsplit(line)
            if parts.path.endswith("/callback") and parts.query:
                receiver.deliver({k: v[0] for k, v in urllib.parse.parse_qs(parts.query, max_num_fields=20).items()})
                return
    except (OSError, ValueError):
        pass


def login_challenge(name: str, url: str, headers: dict) -> dict[str, dict[str, str]]:
    """Ask the server, without a token, what it wants: its WWW-Authenticate challenges.  POST initialize first
    (Streamable HTTP); on 400/404/405 a GET (HTTP+SSE).  Raises OAuthFailure when it wants no login."""
    reply = remote_http("POST", url, body=_probe_initialize(), timeout=15.0, stream=True,
                        headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                                 **headers})
    _close_reply(reply)
    if reply.status in (400, 404, 405):
        reply = remote_http("GET", url, timeout=15.0, stream=True, headers={"Accept": "text/event-stream",
                                                                           **headers})
        _close_reply(reply)
    if reply.status in (401, 403):
        return parse_www_authenticate(reply.headers.get("www-authenticate"))
    if 200 <= reply.status < 300:
        raise OAuthFailure(f"'{name}' answered without asking for a login: nothing to do")
    raise OAuthFailure(f"'{name}' answered HTTP {reply.status} instead of asking for a login: {_reply_text(reply)}")


def oauth_login(name: str, url: str, headers: dict, oauth: dict, store, settings: dict, *, out,
                open_browser=None, stdin=None, timeout: float = 300.0, scope: str | None = None) -> OAuthGrant:
    """The whole interactive login of one server; saves the grant under oauth.<name> and returns it.

    ``out`` gets what the user must read (the URL to open, never a token); ``open_browser(url)`` defaults to
    webbrowser.open; ``stdin``, when given, is read for a pasted callback address (headless use).
    """
    import hmac
    import secrets

    challenges = login_challenge(name, url, headers)
    if challenges and "bearer" not in challenges:
        raise OAuthFailure(f"'{name}' asks for {', '.join(sorted(challenges))[:100]} credentials, not an OAuth "
                           "login; give them with --header")
    bearer = challenges.get("bearer", {})
    resource_metadata = discover_resource_metadata(url, bearer)
    if resource_metadata is not None:
        issuer = resource_metadata.authorization_servers[0]  # RFC 9728 §7.6 leaves the choice to the client
        resource = canonical_resource(resource_metadata.resource)
    else:  # MCP 2025-03-26 servers: the authorization server is the MCP server's origin
        issuer, resource = origin_text(url), canonical_resource(url)
    metadata = discover_authorization_server(issuer)
    if scope is None:
        scope = bearer.get("scope") or (" ".join(resource_metadata.scopes_supported)
                                         if resource_metadata and resource_metadata.scopes_supported else None)
    key = oauth_secret_name(name)
    try:
        text = store.get(key)
        previous = OAuthGrant.from_text(text) if text else None
    except (ValueError, TypeError):
        previous = None
    receiver = _open_receiver(previous)
    try:
        client = choose_client(name, metadata, oauth, store, settings, receiver.redirect_uri, scope, previous)
        verifier, challenge = _pkce_pair()
        state = secrets.token_urlsafe(32)
        params = {"response_type": "code", "client_id": client.client_id, "redirect_uri": receiver.redirect_uri,
                  "code_challenge": challenge, "code_challenge_method": "S256", "state": state,
                  "resource": resource}
        if scope:
            params["scope"] = scope
        separator = "&" if urllib.parse.urlsplit(metadata.authorization_endpoint).query else "?"
        address = metadata.authorization_endpoint + separator + urllib.parse.urlencode(params)
        out.write(printable(f"Log in to {name} in your browser. If it does not open, visit:\n\n  {address}\n\n"
                  f"(waiting up to {timeout:g} s for the authorization server at {origin_text(address)}"))
        if stdin is not None:
            out.write("; if your browser runs on another machine, paste here the address it ends on")
            threading.Thread(target=_read_pasted_callback, args=(receiver, stdin), name="coffer-oauth-paste",
                             daemon=True).start()
        out.write(")\n")
        out.flush()
        if open_browser is None:
            import webbrowser
            open_browser = webbrowser.open
        try:
            open_browser(address)
        except Exception as exc:  # noqa: BLE001 - no browser here is fine: the address is printed
            log.debug("could not open a browser: %r", exc)
        answer = receiver.wait(timeout)
    finally:
        receiver.close()
    if answer is None:
        raise OAuthFailure(f"no answer from the browser within {timeout:g} s")
    if not hmac.compare_digest(str(answer.get("state", "")).encode("utf-8", "replace"), state.encode("ascii")):
        raise OAuthFailure("the browser came back with a different state than this login sent: refused (it was "
                           "not the answer to this login; possibly a cross-site request forgery)")
    if answer.get("error"):
        detail = printable(str(answer.get("error_description", "")))[:200]
        raise OAuthFailure(f"the authorization server refused: {printable(answer['error'])[:60]}"
                           + (f": {detail}" if detail else ""))
    if "iss" in answer or metadata.iss_parameter:  # RFC 9207: the answer must come from the server we asked
        if not _issuers_match(str(answer.get("iss", "")), metadata.issuer):
            raise OAuthFailure("the authorization answer names another issuer than the server asked: refused")
    code = answer.get("code")
    if not isinstance(code, str) or not 0 < len(code) <= 4096:
        raise OAuthFailure("the authorization server sent no code")
    try:
        tokens = token_request(metadata.token_endpoint, {
            "grant_type": "authorization_code", "code": code, "redirect_uri": receiver.redirect_uri,
            "code_verifier": verifier, "resource": resource}, client.client_id, client.client_auth,
            client.client_secret)
    except TokenEndpointError as exc:
        raise OAuthFailure(f"could not get a token: {exc}") from None
    grant = _apply_tokens(OAuthGrant(
        server_url=url, resource=resource, issuer=metadata.issuer, token_endpoint=metadata.token_endpoint,
        client_id=client.client_id, client_auth=client.client_auth, client_source=client.source,
        access_token="", client_secret=client.client_secret if client.source == "registered" else None,
        client_secret_env=oauth.get("client_secret_env") if client.source == "pre-registered" else None,
        redirect_uri=receiver.redirect_uri, revocation_endpoint=metadata.revocation_endpoint, scope=scope),
        tokens, time.time())
    store.set(key, grant.to_text())
    return grant


def revoke_grant(grant: OAuthGrant, store) -> str:
    """Best effort RFC 7009 revocation of a saved login (the refresh token revokes the access token with it on
    most servers).  Returns what to tell the user."""
    if not grant.revocation_endpoint:
        return "the authorization server offers no revocation; the tokens expire on their own"
    secret = grant_client_secret(grant, store)
    token, hint = (grant.refresh_token, "refresh_token") if grant.refresh_token else (grant.access_token,
                                                                                      "access_token")
    try:
        token_request_revoke(grant.revocation_endpoint, token, hint, grant.client_id, grant.client_auth, secret)
    except (OAuthFailure, UpstreamFailure) as exc:
        return f"the authorization server could not be told ({exc})"
    return "revoked at the authorization server"


def token_request_revoke(endpoint, token, hint, client_id, client_auth, client_secret) -> None:
    _require_secure(endpoint, "the revocation endpoint")
    headers, body = _client_authenticated({"token": token, "token_type_hint": hint}, client_id, client_auth,
                                          client_secret)
    reply = remote_http("POST", endpoint, headers=headers, timeout=10.0, body=body)
    if reply.status != 200:
        raise OAuthFailure(f"HTTP {reply.status}")


# ============================================================================================================
# 5. Upstream supervisor: one registered server's connection, requests, lists and restarts
# ============================================================================================================

# -- what an upstream may say, checked at the boundary -------------------------------------------------------
# An upstream is code nobody here wrote.  Its definitions are validated before they reach the catalogue (one bad
# tool must not make a client reject the whole list), its replies are rebuilt as well-formed JSON-RPC, and only
# the requests and notifications the protocol defines are relayed to the client.

SERVER_REQUEST_NEEDS = {"sampling/createMessage": "sampling", "elicitation/create": "elicitation",
                        "roots/list": "roots"}
RELAYED_NOTIFICATIONS = frozenset({"notifications/message", "notifications/progress", "notifications/cancelled",
                                   "notifications/resources/updated", "notifications/elicitation/complete"})
LIST_CHANGED = {"notifications/tools/list_changed": ("tool",), "notifications/prompts/list_changed": ("prompt",),
                "notifications/resources/list_changed": ("resource", "template")}
MAX_DEFINITION_BYTES = 1 << 20
MAX_DESCRIPTION_CHARS = 32_768
MAX_NAME_CHARS = 1024
_ANNOTATION_HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
_IDENTIFIER = {"tool": "name", "prompt": "name", "resource": "uri", "template": "uriTemplate"}


class Rejected(ValueError):
    """A definition that cannot be repaired safely: it is dropped, with a warning and an audit row."""


def _clean_strings(value, depth: int = 0):
    """``value`` with every lone surrogate replaced (so it can be stored and relayed), at most 64 levels deep."""
    if depth > 64:
        raise Rejected("nested more than 64 levels deep")
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable(k): _clean_strings(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_strings(v, depth + 1) for v in value]
    return value


def check_definition(kind: str, item) -> dict:
    """A tool, prompt, resource or template an upstream listed, repaired where that is safe, else Rejected.

    Repaired: a missing inputSchema (an object schema), a schema without "type", optional fields of the wrong type
    (dropped), over-long descriptions (cut), lone surrogates in text (replaced).  Rejected: no usable identifier,
    an inputSchema that is not an object schema, a definition over 1 MiB or nested over 64 levels.
    """
    if not isinstance(item, dict):
        raise Rejected("not a JSON object")
    key = _IDENTIFIER[kind]
    ident = item.get(key)
    if not isinstance(ident, str) or not ident.strip():
        raise Rejected(f"no {key}")
    if len(ident) > (MAX_NAME_CHARS if key == "name" else 8 * MAX_NAME_CHARS) or not ident.isprintable():
        raise Rejected(f"its {key} is too long or holds control characters")
    try:
        if len(dumps(item)) > MAX_DEFINITION_BYTES:
            raise Rejected(f"larger than {MAX_DEFINITION_BYTES} bytes")
    except (ValueError, TypeError, RecursionError) as exc:
        raise Rejected(f"not plain JSON ({exc.__class__.__name__})") from None
    item = _clean_strings(item)
    for text_field in ("title", "description", "mimeType"):
        if text_field in item and not isinstance(item[text_field], str):
            del item[text_field]
    if isinstance(item.get("description"), str) and len(item["description"]) > MAX_DESCRIPTION_CHARS:
        item["description"] = item["description"][:MAX_DESCRIPTION_CHARS] + " [cut by coffer]"
    for dict_field in ("_meta", "annotations", "execution"):
        if dict_field in item and not isinstance(item[dict_field], dict):
            del item[dict_field]
    if "icons" in item and not (isinstance(item["icons"], list) and all(
            isinstance(icon, dict) and isinstance(icon.get("src"), str) for icon in item["icons"])):
        del item["icons"]
    if kind == "tool":
        schema = item.get("inputSchema")
        if schema is None:
            item["inputSchema"] = {"type": "object"}
        elif not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise Rejected("its inputSchema is not a JSON object schema")
        else:
            if "properties" in schema and not isinstance(schema["properties"], dict):
                raise Rejected("its inputSchema properties are not an object")
            if "required" in schema and not (isinstance(schema["required"], list) and
                                             all(isinstance(r, str) for r in schema["required"])):
                schema = {k: v for k, v in schema.items() if k != "required"}
            item["inputSchema"] = schema if "type" in schema else {"type": "object", **schema}
        if "outputSchema" in item and not isinstance(item["outputSchema"], (dict, bool)):
            del item["outputSchema"]  # not a JSON Schema at all (2026-07-28 allows any schema; the catalogue wraps
            # a non-object one for a handshake-era client)
        annotations = item.get("annotations")
        if isinstance(annotations, dict):
            item["annotations"] = {k: v for k, v in annotations.items()
                                   if not ((k in _ANNOTATION_HINTS and not isinstance(v, bool)) or
                                           (k == "title" and not isinstance(v, str)))}
    elif kind == "prompt":
        arguments = item.get("arguments")
        if arguments is not None:
            if not isinstance(arguments, list):
                del item["arguments"]
            else:
                item["arguments"] = [
                    {k: v for k, v in argument.items() if not (k == "required" and not isinstance(v, bool))
                     and not (k in ("description", "title") and not isinstance(v, str))}
                    for argument in arguments if isinstance(argument, dict) and isinstance(argument.get("name"), str)]
    else:
        if not isinstance(item.get("name"), str):
            item["name"] = ident
        if "size" in item and not (isinstance(item["size"], int) and not isinstance(item["size"], bool)
                                   and item["size"] >= 0):
            del item["size"]
    return item


def normalized_reply(message: dict) -> dict:
    """An upstream's reply as well-formed JSON-RPC: exactly one of ``result`` (an object) or ``error`` ({code: int,
    message: str}).  Anything else (an error that is a string, both members, no jsonrpc...) becomes an error that
    says so, so a client is never handed a reply it cannot parse and wait forever."""
    msg_id = message.get("id")
    has_result, has_error = "result" in message, "error" in message
    if has_result and not has_error:
        if isinstance(message["result"], dict):
            return {"jsonrpc": "2.0", "id": msg_id, "result": message["result"]}
        return rpc_error(msg_id, UPSTREAM_ERROR, "the upstream returned a result that is not an object")
    if has_error and not has_result:
        error = message["error"]
        if isinstance(error, dict) and isinstance(error.get("code"), int) and not isinstance(error["code"], bool) \
                and isinstance(error.get("message"), str):
            return rpc_error(msg_id, error["code"], error["message"][:4000], error.get("data"))
        text = error.get("message") if isinstance(error, dict) else error
        detail = f": {printable(text)[:200]}" if isinstance(text, str) and text else ""
        return rpc_error(msg_id, UPSTREAM_ERROR, f"the upstream returned a malformed error{detail}")
    return rpc_error(msg_id, UPSTREAM_ERROR, "the upstream returned a malformed reply (both result and error)"
                     if has_result else "the upstream returned a malformed reply (neither result nor error)")


class TokenBucket:
    """``rate`` events a second with bursts of ``burst``: how a flood from one upstream is cut to size without
    slowing anyone else.  Not thread-safe on its own; each upstream's reader is its only caller."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.dropped = 0
        self.reported = 0.0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.dropped += 1
        return False

    def report_due(self, every: float = 10.0) -> int:
        """How many were dropped since the last report, once ``every`` seconds (0 otherwise)."""
        now = time.monotonic()
        if not self.dropped or now - self.reported < every:
            return 0
        dropped, self.dropped, self.reported = self.dropped, 0, now
        return dropped


# -- in-flight records ---------------------------------------------------------------------------------------

class Pending:
    """One request Coffer sent to an upstream and is waiting on.  ``timeout`` is how long it may go without a
    reply or progress; ``deadline`` when it times out (progress pushes it back)."""

    __slots__ = ("method", "on_reply", "timeout", "deadline", "token")

    def __init__(self, method, on_reply, timeout, token, deadline=None):
        self.method, self.on_reply, self.timeout, self.token = method, on_reply, timeout, token
        self.deadline = deadline if deadline is not None else (time.monotonic() + timeout if timeout else None)


class Ticket:
    """What ``Upstream.request`` hands back for ``cancel``: the upstream's request id once the request is sent;
    before that (queued behind a server that is still starting) cancelling it means it is never sent."""

    __slots__ = ("request_id", "cancelled")

    def __init__(self):
        self.request_id: int | None = None
        self.cancelled = False


@dataclass
class QueuedRequest:
    """A request waiting for its server to be ready.  Its deadline started when it was asked for: waiting for a
    slow or failing server counts against the caller's call_timeout."""
    method: str
    params: object
    on_reply: Callable
    timeout: float
    ticket: Ticket
    deadline: float | None
    envelope: Envelope | None = None


class Upstream:
    """One registered server: its connection, its in-flight requests, its advertised lists, its restarts.

    States: idle → starting → ready; a crash goes to backoff and back to starting; too many consecutive failed
    starts (or one failure that retrying cannot fix) go to failed; stopped is final.  Requests that arrive while
    starting wait in a backlog, each with its own deadline.

    Threads: the transport's reader runs ``_on_message`` and the ``on_reply`` callbacks of replies; one thread per
    start attempt runs ``_start``; one thread per list kind refreshes; the gateway's ticker calls ``expire``; any
    thread may call ``request``, ``cancel``, ``notify``.  ``self.lock`` guards state, pending, by_token, backlog and
    the failure count.  It is never held while calling out (``on_reply``, the gateway's events, a transport send),
    so the lock order is simply: Gateway.lock may be held when taking Upstream.lock, never the reverse.
    """

    LIST_METHODS = {"tool": ("tools/list", "tools", "tools"), "prompt": ("prompts/list", "prompts", "prompts"),
                    "resource": ("resources/list", "resources", "resources"),
                    "template": ("resources/templates/list", "resourceTemplates", "resources")}
    QUICK_DEATH = 10.0  # a server that dies this soon after becoming ready counts as a failed start

    def __init__(self, config: dict, settings: dict, events, client_capabilities=None, protocol_version=None,
                 secrets: SecretStore | None = None, client_info: dict | None = None):
        self.config = config
        self.name: str = config["name"]
        self.settings = settings
        self.events = events  # the gateway: on_ready, on_down, on_list_changed, on_notification, on_request
        self.secrets = secrets
        self.client_capabilities = client_capabilities or {}
        self.protocol_version = protocol_version or LATEST_PROTOCOL_VERSION
        self.call_timeout = float(config.get("timeout") or settings["call_timeout"])
        self.lock = threading.RLock()
        self.state = "idle"
        self.transport: Transport | None = None
        self.pending: dict[int, Pending] = {}
        self.by_token: dict = {}
        self.backlog: list[QueuedRequest] = []
        self._next_id = 0
        self.failures = 0
        self.spawns = 0
        self.ready_at = 0.0
        self.last_error: str | None = None
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.resolved: str | None = None  # what its ${NAME} references resolved to at the last start (digest)
        self.server_info: dict = {}
        self.capabilities: dict = {}
        self.lists = {kind: {} for kind in CAPABILITY_KINDS}  # kind -> {name: definition}, in upstream order
        self.rejected: dict[str, dict[str, str]] = {}  # kind -> {name: why} of the last fetch
        self.remembered: dict[str, dict] = {}  # kind -> what the vault holds from the last start (see Catalogue)
        self._refresh_again: dict[str, bool] = {}  # kind -> refreshing now; True: list_changed came meanwhile
        self.generation = 0
        self._closed_generation = -1
        self._timer: threading.Timer | None = None
        # The era this server speaks: remembered from its last start (None: probe with server/discover).  A modern
        # (2026-07-28) server gets the client's own envelope on every request: its identity and capabilities.
        self.era: str | None = config.get("era")
        self.envelope = Envelope(MODERN_PROTOCOL_VERSIONS[-1], self.client_capabilities,
                                 client_info or {"name": "coffer", "version": __version__}, None)
        self._listen_id: int | None = None          # Coffer's subscriptions/listen on a modern server
        self._listen_backoff = 1.0
        self._relayed = TokenBucket(rate=200.0, burst=1000.0)   # notifications relayed to the client
        self._stderr_relayed = TokenBucket(rate=50.0, burst=200.0)
        self._asked = TokenBucket(rate=5.0, burst=20.0)   # sampling/elicitation/roots requests for the client

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            if self.state in ("starting", "ready", "stopped"):
                return
            self.state = "starting"
            self.spawns += 1
        start_thread(self._start, f"coffer-{self.name}-start")

    def _make_transport(self) -> Transport:
        missing: list[str] = []
        cfg = self.config
        self.resolved = resolution_digest(cfg, self.secrets)
        generation = self.generation + 1
        on_close = lambda: self._on_close(generation)  # noqa: E731 - a stale connection's close is ignored

        def on_message(message: dict) -> None:  # nor is what an old connection still says after a restart
            if self.generation == generation:
                self._on_message(message)

        limit = int(self.settings["max_message_bytes"])

        def expand(value: str) -> str:
            substituted: list[str] = []
            expanded = expand_vars(value, missing=missing, secrets=self.secrets, substituted=substituted)
            redact.add_named(substituted)  # what a reference expanded to is a secret wherever it shows up
            return expanded

        if cfg["transport"] in REMOTE_TRANSPORTS:
            headers = {k: expand(v) for k, v in cfg["headers"].items()}
            transport = make_remote_transport(self.name, cfg["transport"], expand(cfg["url"]), headers, self.secrets,
                                              on_message, on_close,
                                              max(float(self.settings["init_timeout"]), self.call_timeout), limit,
                                              on_failure=self._fail_request, on_unusable=self._on_unusable)
        else:
            own = {k: expand(v) for k, v in cfg["env"].items()}
            env = upstream_environment(own, cfg.get("inherit_env") or ())
            argv = [expand(arg) for arg in cfg["command"]]
            transport = StdioTransport(self.name, argv, env, cfg.get("cwd"), on_message, on_close,
                                       self._on_stderr, self._on_unusable, limit)
        for name in sorted(set(missing)):
            log.warning("[%s] ${%s} is set neither in Coffer's environment nor in its secret store; using an empty "
                        "value (coffer secret set %s)", self.name, name, name)
        return transport

    def _start(self) -> None:
        transport = None
        self.stderr_tail.clear()  # what a failed start reports must be this attempt's own output
        try:
            transport = self._make_transport()
            with self.lock:
                if self.state == "stopped":
                    return
                self.transport = transport
                self.generation += 1
            transport.start()
            self._open_session(isinstance(transport, StdioTransport))
            for kind in CAPABILITY_KINDS:
                self.refresh(kind, notify=False)
            if self._closed_generation == self.generation:
                raise UpstreamFailure("the server exited during discovery")
            if self.era == "modern":
                self._listen()
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party server is a failed start
            self._start_failed(transport, exc)
            return
        with self.lock:
            if self.state == "stopped":
                start_thread(transport.close, f"coffer-{self.name}-close")
                return
            died = self._closed_generation == self.generation  # between the check above and now
            if not died:
                self.state = "ready"
                self.ready_at = time.monotonic()
                self.last_error = None
                backlog, self.backlog = self.backlog, []
        if died:
            self._start_failed(transport, UpstreamFailure("the server exited during discovery"))
            return
        if isinstance(transport, StdioTransport):
            transport.remember_family()
        self.events.on_ready(self)
        self._run_backlog(backlog)

    def _open_session(self, stdio: bool) -> None:
        """Begin the session the way the spec's stdio compatibility rule says: server/discover first (unless the
        vault remembers a handshake-era server); a DiscoverResult or a recognised modern error means 2026-07-28,
        anything else -- another error, silence, junk -- means initialize.  A remote server speaks the handshake era
        here.  Sets era, capabilities and server_info, or raises UpstreamFailure."""
        if stdio and self.era != "handshake":
            verdict = self._discover()
            if verdict.era == "modern":
                self._adopt_modern(verdict.result)
                return
            if self._closed_generation == self.generation:
                self.era = "handshake"  # it died on server/discover: its next start goes straight to initialize
                raise UpstreamFailure("exited when asked server/discover")
        response = self.call_raw("initialize", {
            "protocolVersion": self.protocol_version, "capabilities": self.client_capabilities,
            "clientInfo": {"name": "coffer", "title": "Coffer MCP gateway", "version": __version__},
        }, self.settings["init_timeout"])
        error = response.get("error")
        if error is not None:
            data = error.get("data") if isinstance(error.get("data"), dict) else {}
            if stdio and error["code"] == UNSUPPORTED_PROTOCOL_VERSION and any(
                    v in MODERN_PROTOCOL_VERSIONS for v in (data.get("supported") or []) if isinstance(v, str)):
                verdict = self._discover()  # a server that speaks only 2026-07-28 (or was locked so by our probe)
                if verdict.era == "modern":
                    self._adopt_modern(verdict.result)
                    return
            raise UpstreamFailure(f"initialize failed: {printable(error['message'])[:300]}")
        result = response["result"]
        self.era = "handshake"
        self.notify("notifications/initialized")
        self.capabilities = result.get("capabilities") if isinstance(result.get("capabilities"), dict) else {}
        info = result.get("serverInfo")
        self.server_info = _clean_strings(info) if isinstance(info, dict) else {}

    def _discover(self) -> DiscoverVerdict:
        """Ask server/discover (and once more if it names a version Coffer speaks in a -32022)."""
        for _ in range(2):
            try:
                response = self.call_raw("server/discover", stamp_envelope({}, self.envelope),
                                         float(self.settings["probe_timeout"]))
            except UpstreamFailure as exc:
                return DiscoverVerdict("handshake", False, None, str(exc))
            verdict = classify_discover_reply(response)
            if verdict.era == "incompatible":
                raise UpstreamFailure(verdict.reason, permanent=True)
            if not verdict.retry_discover:
                return verdict
        return DiscoverVerdict("handshake", False, None, "server/discover kept naming other versions")

    def _adopt_modern(self, result: dict) -> None:
        self.era = "modern"
        self.capabilities = result["capabilities"]
        meta = result.get("_meta") if isinstance(result.get("_meta"), dict) else {}
        info = meta.get(META_SERVER_INFO)
        self.server_info = _clean_strings(info) if isinstance(info, dict) else {}

    def _listen(self) -> None:
        """Open a subscriptions/listen stream for the lists a modern server announces changes of: its events
        refresh them as list_changed did in the handshake era.  Reopened (with backoff) whenever it ends."""
        wanted = {key: True for key, capability in (("toolsListChanged", "tools"), ("promptsListChanged", "prompts"),
                                                     ("resourcesListChanged", "resources"))
                  if isinstance(self.capabilities.get(capability), dict)
                  and self.capabilities[capability].get("listChanged")}
        if not wanted or self.state == "stopped":
            return
        generation = self.generation

        def ended(response, failure, text):
            with self.lock:
                if self._listen_id == request_id:
                    self._listen_id = None
                alive = self.state == "ready" and self.generation == generation
            if not alive:
                return
            delay, self._listen_backoff = self._listen_backoff, min(30.0, self._listen_backoff * 2)
            log.debug("[%s] its subscriptions/listen stream ended (%s); reopening in %gs", self.name,
                      text or "ended by the server", delay)

            def reopen():
                if self.state == "ready" and self.generation == generation:
                    for kind in CAPABILITY_KINDS:  # nothing is replayed: what changed meanwhile is refetched
                        self._refresh_soon(kind)
                    self._listen()

            timer = threading.Timer(delay, reopen)
            timer.daemon = True
            timer.start()

        request_id = self._send_request("subscriptions/listen", {"notifications": wanted}, ended, 0)
        with self.lock:
            self._listen_id = request_id

    def _start_failed(self, transport: Transport | None, exc: Exception) -> None:
        if not isinstance(exc, (UpstreamFailure, OSError, ValueError)):
            log.exception("[%s] internal error while starting", self.name)
        text = str(exc) or exc.__class__.__name__
        permanent = getattr(exc, "permanent", False)
        if transport is not None:
            if transport.fatal:
                text, permanent = str(transport.fatal), True
            elif self._closed_generation == self.generation or "not accepting input" in text:
                text = f"{transport.exit_detail() or 'closed its connection'} before it answered initialize"
        if self.stderr_tail and "stderr:" not in text:
            text += " | stderr: " + " / ".join(list(self.stderr_tail)[-3:])
        give_up, delay, backlog = self._count_failure(text, permanent)
        if give_up is None:
            return  # stopped meanwhile
        if transport is not None:
            start_thread(transport.close, f"coffer-{self.name}-close", 0.5)
        log.log(logging.WARNING if give_up else logging.INFO, "[%s] start failed%s: %s", self.name,
                "" if permanent else f" ({self.failures}/{self.settings['max_restarts']})", self.last_error)
        self._after_failure(give_up, delay, backlog)

    def _count_failure(self, reason: str, permanent: bool):
        """Record a failed start or a quick death: (give up?, seconds before the next attempt, backlog to fail).
        The one place the backoff rule lives: 0.5 s doubling to 30 s, max_restarts in a row, or at once if
        retrying cannot help.  (None, 0, []) if the upstream was stopped meanwhile."""
        with self.lock:
            if self.state == "stopped":
                return None, 0.0, []
            self.failures += 1
            self.last_error = redact(reason)
            give_up = permanent or self.failures >= int(self.settings["max_restarts"])
            self.state = "failed" if give_up else "backoff"
            backlog = self.backlog if give_up else []
            if give_up:
                self.backlog = []
            return give_up, min(30.0, 0.5 * 2 ** (self.failures - 1)), backlog

    def _after_failure(self, give_up: bool, delay: float, backlog: list[QueuedRequest]) -> None:
        if give_up:
            log.info("[%s] marked failed", self.name)
            self.events.on_down(self)
            self._run_backlog(backlog)
        else:
            self._schedule_start(delay)

    def _schedule_start(self, delay: float) -> None:
        def fire():
            with self.lock:
                if self.state != "backoff":
                    return
                self.state = "idle"
            self.start()

        with self.lock:
            if self._timer:
                self._timer.cancel()
            if delay <= 0:
                self._timer = None
            else:
                self._timer = threading.Timer(delay, fire)
                self._timer.daemon = True
                self._timer.start()
                return
        fire()

    def _on_close(self, generation: int) -> None:
        """The connection ended: fail what is in flight now, then respawn (with backoff if it keeps dying)."""
        with self.lock:
            if generation != self.generation:
                return
            self._closed_generation = generation
            state, transport = self.state, self.transport
            orphaned = self._take_pending()
            if state == "ready":
                self.state = "backoff"  # from now on a request waits for the restart instead of failing
        reason = (f"upstream '{self.name}' "
                  f"{transport.close_reason or transport.exit_detail() or 'closed its connection'}")
        # The old connection may have only closed stdout; make sure its process and pipes are gone too.
        start_thread(transport.close, f"coffer-{self.name}-close", 0.5)
        for pending in orphaned:
            pending.on_reply(None, "error", reason)
        if state != "ready":
            return  # a start in progress notices through its initialize wait or its closed-generation check
        quick = time.monotonic() - self.ready_at < self.QUICK_DEATH
        if quick:
            give_up, delay, backlog = self._count_failure(reason, False)
            if give_up is None:
                return
        else:
            with self.lock:
                if self.state == "stopped":
                    return
                self.failures, self.last_error, self.state = 0, redact(reason), "backoff"
            give_up, delay, backlog = False, 0.0, []
        log.warning("[%s] %s; %s", self.name, reason, "giving up, marked failed" if give_up else "restarting")
        self.events.on_down(self)
        if give_up:
            self._run_backlog(backlog)
        else:
            self._schedule_start(delay if quick else 0.0)

    def _take_pending(self) -> list[Pending]:
        orphaned = list(self.pending.values())
        self.pending.clear()
        self.by_token.clear()
        return orphaned

    def stop(self) -> None:
        with self.lock:
            self.state = "stopped"
            if self._timer:
                self._timer.cancel()
            transport, orphaned = self.transport, self._take_pending()
            backlog, self.backlog = self.backlog, []
        for pending in orphaned:
            pending.on_reply(None, "error", f"upstream '{self.name}' is shutting down")
        self._run_backlog(backlog)
        if transport is not None:
            transport.close()

    def _on_stderr(self, line: str) -> None:
        line = redact(line)
        self.stderr_tail.append(line[:500])
        if self._stderr_relayed.take():
            log.info("[%s] %s", self.name, line[:2000])
        elif dropped := self._stderr_relayed.report_due():
            log.warning("[%s] wrote too much on stderr; %d lines not shown", self.name, dropped)

    # -- requests ------------------------------------------------------------------------------------------
    def request(self, method: str, params, on_reply, timeout: float | None = None, ticket: Ticket | None = None,
                deadline: float | None = None, envelope: Envelope | None = None):
        """Send a request, or queue it while the server starts; ``on_reply(response, failure_status,
        failure_text)`` runs exactly once, unless the request is cancelled first.

        Returns a Ticket for ``cancel``, or None when the request failed at once (``on_reply`` has run).
        """
        timeout = self.call_timeout if timeout is None else timeout
        ticket = ticket or Ticket()
        if deadline is None and timeout:
            deadline = time.monotonic() + timeout
        with self.lock:
            if ticket.cancelled:
                return None  # cancelled while it waited in the backlog: never sent, never answered
            state = self.state
            if state in ("starting", "backoff", "idle"):
                self.backlog.append(QueuedRequest(method, params, on_reply, timeout, ticket, deadline, envelope))
                if state == "idle":
                    self.start()
                return ticket
            unavailable = state != "ready"
        if unavailable:
            detail = f": {self.last_error}" if self.last_error else ""
            on_reply(None, "error", f"upstream '{self.name}' is unavailable ({state}){detail}")
            return None
        queued = QueuedRequest(method, params, on_reply, timeout, ticket, deadline, envelope)
        request_id = self._send_request(method, params, on_reply, timeout, deadline, queued, envelope)
        with self.lock:
            ticket.request_id = request_id
            raced = ticket.cancelled and request_id is not None  # cancelled while it was being sent
        if raced and self._finish(request_id) is not None:
            self.notify("notifications/cancelled", {"requestId": request_id, "reason": "cancelled by the client"})
            return None
        return ticket if request_id is not None or queued in self.backlog else None

    def _run_backlog(self, backlog: list[QueuedRequest]) -> None:
        for queued in backlog:
            self.request(queued.method, queued.params, queued.on_reply, queued.timeout, queued.ticket,
                         queued.deadline, queued.envelope)

    def _send_request(self, method, params, on_reply, timeout, deadline=None, requeue: QueuedRequest | None = None,
                      envelope: Envelope | None = None):
        """Register and send one request; its id, or None when it failed (``on_reply`` has run) — or, with
        ``requeue``, when the connection had just died unnoticed and the request now waits for the restart."""
        with self.lock:
            self._next_id += 1
            request_id = self._next_id
            token = None
            if isinstance(params, dict):
                meta = params.get("_meta")
                if isinstance(meta, dict) and "progressToken" in meta:
                    token = meta["progressToken"]
            if not valid_request_id(token):
                token = None  # the spec allows only strings and integers; anything else cannot reset a timeout
            pending = Pending(method, on_reply, timeout, token, deadline)
            self.pending[request_id] = pending
            if token is not None:
                self.by_token[token] = pending
            transport = self.transport
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        params = self.prepare(method, params, envelope)
        if params is not None:
            message["params"] = params
        if log.isEnabledFor(logging.DEBUG):
            log.debug("coffer -> %s: %s", self.name, _trace(message))
        try:
            sent = transport is not None and transport.send(message)
        except EncodeError as exc:
            self._finish(request_id)
            on_reply(None, "error", f"the request could not be sent: {exc}")
            return None
        if sent:
            return request_id
        self._finish(request_id)
        if requeue is not None:
            with self.lock:
                if self.state in ("ready", "backoff", "starting"):  # its close is on its way: wait for the restart
                    self.backlog.append(requeue)
                    return None
        on_reply(None, "error", f"upstream '{self.name}' "
                                f"{(transport and transport.exit_detail()) or 'is not accepting input'}")
        return None

    def call_raw(self, method: str, params=None, timeout: float | None = None) -> dict:
        """Blocking request for Coffer's own use (initialize, discovery): the normalized reply, result or error;
        UpstreamFailure when none came (timeout, the connection ended)."""
        done = threading.Event()
        box = {}

        def on_reply(response, failure, text):
            box["response"], box["failure"], box["text"] = response, failure, text
            done.set()

        timeout = self.call_timeout if timeout is None else timeout
        self._send_request(method, params, on_reply, timeout)
        done.wait(timeout + 5.0)
        if not done.is_set():
            raise UpstreamFailure(f"{method} timed out after {timeout:g}s")
        if box["response"] is None:
            raise UpstreamFailure(f"{method}: {box['text']}")
        return box["response"]

    def call(self, method: str, params=None, timeout: float | None = None):
        """call_raw, for a result: an error reply raises UpstreamFailure."""
        response = self.call_raw(method, params, timeout)
        if "error" in response:
            raise UpstreamFailure(f"{method} failed: {printable(response['error']['message'])[:300]}")
        return response["result"]

    def prepare(self, method: str, params, envelope: Envelope | None = None):
        """Params as this server's era needs them: a modern server gets the client's envelope (``envelope``, else
        the one the session started with); a handshake server gets none, and no multi-round-trip fields."""
        if method in ("initialize", "server/discover"):
            return params
        if self.era == "modern":
            return stamp_envelope(params, envelope or self.envelope)
        if isinstance(params, dict) and ("requestState" in params or "inputResponses" in params or (
                isinstance(params.get("_meta"), dict) and any(k in params["_meta"] for k in ENVELOPE_KEYS))):
            return strip_envelope(params)
        return params

    def notify(self, method: str, params=None) -> None:
        if self.era == "modern" and method != "notifications/cancelled":
            return  # the only client notification of 2026-07-28 (initialized, roots and progress are gone)
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.respond(message)

    def respond(self, message: dict) -> None:
        transport = self.transport
        if transport is not None:
            try:
                transport.send(message)
            except EncodeError as exc:
                log.warning("[%s] could not relay a message: %s", self.name, exc)

    def cancel(self, ticket: Ticket | None, reason: str = "cancelled by the client") -> bool:
        """Forget a request (a late reply is then dropped) and tell the upstream, with its own id; a request
        still queued is simply never sent.  False if it was already answered or cancelled (or never sent)."""
        if ticket is None:
            return False
        with self.lock:
            if ticket.cancelled:
                return False
            ticket.cancelled = True
            request_id = ticket.request_id
            if request_id is None:
                self.backlog = [queued for queued in self.backlog if queued.ticket is not ticket]
                return True
        if self._finish(request_id) is None:
            return False
        self.notify("notifications/cancelled", {"requestId": request_id, "reason": reason})
        return True

    def _fail_request(self, request_id, text: str) -> None:
        """A remote transport could not get a request through or its answer back: the caller hears a failure of
        the connection (a tool call reads it as a tool error), not an error the server itself returned."""
        pending = self._finish(request_id) if isinstance(request_id, int) else None
        if pending is not None:
            pending.on_reply(None, "error", text if f"'{self.name}'" in text else f"upstream '{self.name}': {text}")

    def hold(self, ticket: Ticket | None) -> None:
        """Pause a request's timeout while the client is asked something for it (a person may be answering)."""
        with self.lock:
            pending = self.pending.get(ticket.request_id) if ticket is not None else None
            if pending is not None:
                pending.deadline = None

    def release(self, ticket: Ticket | None) -> None:
        with self.lock:
            pending = self.pending.get(ticket.request_id) if ticket is not None else None
            if pending is not None and pending.timeout:
                pending.deadline = time.monotonic() + pending.timeout

    def _finish(self, request_id):
        with self.lock:
            pending = self.pending.pop(request_id, None)
            if pending is not None and pending.token is not None and self.by_token.get(pending.token) is pending:
                del self.by_token[pending.token]
        return pending

    def expire(self, now: float) -> None:
        """Time out requests whose deadline passed (progress pushes a deadline back), queued ones included."""
        if not self.pending and not self.backlog:
            return
        with self.lock:
            expired = [rid for rid, p in self.pending.items() if p.deadline is not None and p.deadline <= now]
            waited = [queued for queued in self.backlog if queued.deadline is not None and queued.deadline <= now]
            if waited:
                self.backlog = [queued for queued in self.backlog if queued not in waited]
        for queued in waited:
            detail = f" (last error: {self.last_error})" if self.last_error else ""
            queued.on_reply(None, "timeout", f"upstream '{self.name}' was not ready within {queued.timeout:g}s"
                                             f"{detail}")
        for request_id in expired:
            pending = self._finish(request_id)
            if pending is not None:
                if pending.method != "initialize":  # the spec forbids cancelling initialize
                    self.notify("notifications/cancelled", {"requestId": request_id, "reason": "timed out"})
                pending.on_reply(None, "timeout",
                                 f"upstream '{self.name}' did not answer {pending.method} within {pending.timeout:g}s")

    # -- incoming ------------------------------------------------------------------------------------------
    def _on_message(self, message: dict) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s -> coffer: %s", self.name, _trace(message))
        method = message.get("method")
        if method is None:
            msg_id = message.get("id")
            pending = self._finish(msg_id) if isinstance(msg_id, int) and not isinstance(msg_id, bool) else None
            if pending is not None:  # else a late reply to a cancelled or timed-out request: delivered to nobody
                pending.on_reply(normalized_reply(message), None, None)
            return
        if not isinstance(method, str):
            return
        if "id" in message:
            if not valid_request_id(message["id"]):
                return
            if method == "ping":
                self.respond(rpc_result(message["id"], {}))
            elif method in SERVER_REQUEST_NEEDS:
                if self._asked.take():  # each may cost the user a model call or a question: a flood is refused
                    self.events.on_request(self, message)
                else:
                    self.respond(rpc_error(message["id"], INTERNAL_ERROR, "too many requests for the client"))
                    if dropped := self._asked.report_due():
                        log.warning("[%s] is flooding the client with requests; %d refused", self.name, dropped)
            else:
                self.respond(rpc_error(message["id"], METHOD_NOT_FOUND, f"Method not found: {method[:100]}"))
            return
        if method in LIST_CHANGED:
            for kind in LIST_CHANGED[method]:
                self._refresh_soon(kind)
            return
        if method == "notifications/subscriptions/acknowledged":
            self._listen_backoff = 1.0
            return
        if method == "notifications/cancelled" and self.era == "modern":
            params = message.get("params") if isinstance(message.get("params"), dict) else {}
            if params.get("requestId") == self._listen_id and self._listen_id is not None:
                pending = self._finish(self._listen_id)  # the server ended our listen stream
                if pending is not None:
                    pending.on_reply(None, "error", "the server ended the stream")
            return
        if method not in RELAYED_NOTIFICATIONS:
            log.debug("[%s] dropped a notification the protocol does not define: %.100s", self.name, method)
            return
        if method == "notifications/progress":
            params = message.get("params")
            token = params.get("progressToken") if isinstance(params, dict) else None
            pending = self.by_token.get(token) if valid_request_id(token) else None
            if pending is None:
                return  # progress for a request this upstream was never given: not its to report
            if pending.timeout:
                pending.deadline = time.monotonic() + pending.timeout
        if self._relayed.take():
            self.events.on_notification(self, message)
        elif dropped := self._relayed.report_due():
            log.warning("[%s] is flooding notifications; %d dropped", self.name, dropped)

    def _on_unusable(self, head: bytes, why: str) -> None:
        """A message Coffer could not use was skipped (``why``: too large, not JSON, nested too deeply): the one
        rule for all of them is that the request it answers, if its head names one, fails at once."""
        request_id = request_id_in(head)
        pending = self._finish(request_id) if isinstance(request_id, int) else None
        if pending is not None:
            text = f"upstream '{self.name}' sent {why}"
            log.warning("[%s] %s", self.name, text)
            pending.on_reply(None, "error", text)
        elif "max_message_bytes" in why:
            log.warning("[%s] skipped %s", self.name, why)

    def _refresh_soon(self, kind: str) -> None:
        """Refresh one list on a helper thread, one at a time per kind: a list_changed that arrives during a
        refresh asks for one more pass, so a chatty server costs a couple of fetches, not a thread each, and
        an older list can never land after a newer one."""
        with self.lock:
            if kind in self._refresh_again:
                self._refresh_again[kind] = True
                return
            self._refresh_again[kind] = False

        def run():
            while True:
                try:
                    self.refresh(kind)
                except Exception:  # noqa: BLE001 - the pass is lost, not the ability to refresh again
                    log.exception("[%s] error refreshing its %ss", self.name, kind)
                with self.lock:
                    if not self._refresh_again[kind]:
                        del self._refresh_again[kind]
                        return
                    self._refresh_again[kind] = False

        start_thread(run, f"coffer-{self.name}-refresh")

    def refresh(self, kind: str, notify: bool = True) -> None:
        """Fetch one list (every page, within the caps) and hand it to the gateway."""
        method, key, capability = self.LIST_METHODS[kind]
        rejected: dict[str, str] = {}
        if capability not in self.capabilities:
            items = {}
        else:
            try:
                items, rejected = self._fetch_all(kind)
            except UpstreamFailure as exc:
                if notify:
                    log.warning("[%s] could not refresh %s: %s", self.name, key, exc)
                    return
                raise
        self.lists[kind] = items
        self.rejected[kind] = rejected
        self.events.on_list_changed(self, kind, items, notify)

    def _fetch_all(self, kind: str) -> tuple[dict, dict]:
        """{identifier: checked definition} and {identifier: why rejected} of one list, following pagination
        for at most max_list_pages pages and keeping at most max_list_items items."""
        method, key, _ = self.LIST_METHODS[kind]
        id_field = _IDENTIFIER[kind]
        max_pages, max_items = int(self.settings["max_list_pages"]), int(self.settings["max_list_items"])
        items: dict[str, dict] = {}
        rejected: dict[str, str] = {}
        cursor, seen = None, set()
        for page in range(max_pages):
            result = self.call(method, {"cursor": cursor} if cursor else {}, self.settings["init_timeout"])
            listed = result.get(key) if isinstance(result, dict) else None
            if not isinstance(result, dict) or (listed is not None and not isinstance(listed, list)):
                raise UpstreamFailure(f"{method} returned something that is not a list of {key}")
            for item in listed or []:
                try:
                    definition = check_definition(kind, item)
                except Rejected as exc:
                    ident = item.get(id_field) if isinstance(item, dict) else None
                    rejected[storable(str(ident))[:200]] = str(exc)
                    continue
                if len(items) >= max_items:
                    log.warning("[%s] lists more than %d %s; only the first %d are used (max_list_items)",
                                self.name, max_items, key, max_items)
                    cursor = None
                    break
                items.setdefault(definition[id_field], definition)
            else:
                cursor = result.get("nextCursor")
            if not cursor:
                break
            if not isinstance(cursor, str) or len(cursor) > 4096 or cursor in seen:
                log.warning("[%s] %s gave an unusable or repeated cursor; stopping pagination", self.name, method)
                break
            seen.add(cursor)
        else:
            log.warning("[%s] %s: stopped after %d pages (max_list_pages)", self.name, method, max_pages)
        if rejected:
            sample = "; ".join(f"{printable(name)[:60]}: {why}" for name, why in list(rejected.items())[:3])
            log.warning("[%s] dropped %d %s it listed that cannot be used (%s)", self.name, len(rejected), key, sample)
        return items, rejected


# ============================================================================================================
# 6. Catalogue: the merged, namespaced, filtered view of every upstream
# ============================================================================================================


class Route(NamedTuple):
    """Where an exposed name or URI goes: the upstream, and the name or URI it knows the capability by."""
    upstream: Upstream
    name: str


class TemplateRoute(NamedTuple):
    regex: re.Pattern
    upstream: Upstream
    template: str
    literal: int  # literal characters in the template: the more, the more specific


def template_regex(template: str) -> re.Pattern:
    """A matcher for an RFC 6570 URI template: each {expression} matches one or more characters."""
    parts = re.split(r"(\{[^}]*\})", template)
    pattern = "".join("(.+?)" if part.startswith("{") and part.endswith("}") else re.escape(part) for part in parts)
    return re.compile(f"^{pattern}$", re.S)


def template_literal_length(template: str) -> int:
    return len(re.sub(r"\{[^}]*\}", "", template))


class Catalogue:
    """An immutable snapshot of what the client may see and call, rebuilt whenever anything changes.

    The hot path only does dictionary look-ups here.  Resource URIs are exposed unchanged, so URIs embedded in
    tool results stay readable; a URI that two upstreams both publish is exposed as ``coffer+<server>:<uri>``
    once per server, and the bare URI routes to the first of them in registration order.  A URI that matches
    several templates is read through the most specific one: the template with the most literal characters
    (ties: registration order), so a catch-all ``{anything}`` can never capture reads meant for another server.
    Disabled and quarantined capabilities are left out, and remembered so a call to one gets the right error.
    """

    @staticmethod
    def lists_of(up) -> dict[str, dict]:
        """What an upstream offers: its live lists once it has started, before that what it listed last time.

        Remembering means a client's first tools/list is complete at once instead of waiting for (or, past the
        discovery budget, missing) a slow server; a call to a remembered tool waits for its server to start,
        and a server that lists something different after all gets a list_changed notification.
        """
        if up.ready_at or not up.remembered:
            return up.lists
        return {**up.lists, **up.remembered}

    def __init__(self, upstreams, states: dict, max_length: int):
        self.tools: list[dict] = []
        self.tool_routes: dict[str, Route] = {}
        self.prompts: list[dict] = []
        self.prompt_routes: dict[str, Route] = {}
        self.resources: list[dict] = []
        self.resource_routes: dict[str, Route] = {}
        self.templates: list[dict] = []
        self.template_routes: list[TemplateRoute] = []
        self.template_by_text: dict[str, Route] = {}
        self.disabled: set[str] = set()
        self.quarantined: set[str] = set()
        self.blocked_templates: list[tuple[re.Pattern, str]] = []  # disabled or quarantined: (matcher, exposed)
        self.qualified: dict[tuple[str, str], str] = {}  # (server, uri) -> exposed uri, for notifications
        uri_count = collections.Counter(uri for up in upstreams for uri in up.lists["resource"])
        tpl_count = collections.Counter(t for up in upstreams for t in up.lists["template"])
        usual = CapabilityState(True)

        def allowed(up, kind, name, exposed):
            state = states.get((up.name, kind, name), usual)
            if state.usable:
                return True
            (self.disabled if not state.enabled else self.quarantined).add(exposed)
            return False

        for up in upstreams:
            offered = self.lists_of(up)
            for kind, items, routes in (("tool", self.tools, self.tool_routes),
                                        ("prompt", self.prompts, self.prompt_routes)):
                names = exposed_names(up.name, offered[kind], max_length)
                for name, definition in offered[kind].items():
                    exposed = names[name]
                    if not allowed(up, kind, name, exposed):
                        continue
                    entry = dict(definition)
                    entry["name"] = exposed
                    items.append(entry)
                    routes[exposed] = Route(up, name)
            for uri, definition in up.lists["resource"].items():
                exposed = uri if uri_count[uri] == 1 else qualify_uri(up.name, uri)
                if not allowed(up, "resource", uri, exposed):
                    continue
                entry = dict(definition)
                entry["uri"] = exposed
                self.resources.append(entry)
                self.resource_routes[exposed] = Route(up, uri)
                self.resource_routes.setdefault(uri, Route(up, uri))
                if exposed != uri:
                    self.qualified[(up.name, uri)] = exposed
            for text, definition in up.lists["template"].items():
                exposed = text if tpl_count[text] == 1 else qualify_uri(up.name, text)
                if not allowed(up, "template", text, exposed):
                    self.blocked_templates.append((template_regex(text), exposed))
                    continue
                entry = dict(definition)
                entry["uriTemplate"] = exposed
                self.templates.append(entry)
                self.template_routes.append(TemplateRoute(template_regex(text), up, text,
                                                          template_literal_length(text)))
                self.template_by_text[exposed] = Route(up, text)
                self.template_by_text.setdefault(text, Route(up, text))
        self.template_routes.sort(key=lambda route: -route.literal)  # stable: ties keep registration order
        # What a handshake-era (2025) client accepts: an outputSchema rooted at an object.  A 2026-07-28 upstream may
        # declare any schema; such a tool is listed with its schema wrapped as {"result": ...}, and its results'
        # structuredContent is wrapped the same way (wrapped_outputs).
        self.wrapped_outputs: set[str] = set()
        self.handshake_tools = self.tools
        if any("outputSchema" in tool and not (isinstance(tool["outputSchema"], dict)
                                               and tool["outputSchema"].get("type") == "object")
               for tool in self.tools):
            self.handshake_tools = []
            for tool in self.tools:
                shaped, wrapped = shape_handshake_tool(tool)
                self.handshake_tools.append(shaped)
                if wrapped:
                    self.wrapped_outputs.add(tool["name"])
        self._index: SearchIndex | None = None
        self._index_lock = threading.Lock()

    @property
    def index(self) -> SearchIndex:
        """The search index, built by the first search rather than by every rebuild: a session that never
        searches never pays for it, and a catalogue change is announced without waiting for it."""
        if self._index is None:
            with self._index_lock:
                if self._index is None:
                    self._index = SearchIndex(self.tools)
        return self._index

    def route_resource(self, uri: str) -> Route | None:
        """Where a URI the client wants to read or subscribe to goes, or None."""
        route = self.resource_routes.get(uri)
        if route:
            return route
        qualified = QUALIFIED_URI_RE.match(uri)
        server, original = qualified.groups() if qualified else (None, uri)
        for template in self.template_routes:
            if (server is None or template.upstream.name == server) and template.regex.match(original):
                return Route(template.upstream, original)
        return None

    def template_of(self, route: Route) -> str:
        """The template a templated read went through (logged instead of the URI, which carries call data)."""
        return next((t.template for t in self.template_routes if t.upstream is route.upstream and
                     t.regex.match(route.name)), "(template)")

    def exposed_uri(self, server: str, uri: str) -> str:
        return self.qualified.get((server, uri), uri)

    def fingerprint(self) -> dict:
        """What the client sees, per list; comparing two of these tells which list_changed to send."""
        return {key: hashlib.sha256(dumps(items).encode("utf-8", "surrogatepass")).hexdigest()
                for key, items in (("tools", self.tools), ("prompts", self.prompts),
                                   ("resources", self.resources + self.templates))}


# ============================================================================================================
# 7. Search: a BM25F ranker over the tool catalogue
# ============================================================================================================
#
# Tool catalogues are small documents with a few strong fields: the name says what a tool does, the
# description says how, parameters say on what.  BM25F scores each field with its own weight and length
# normalisation.  Queries are phrased by an agent mid-task, so the tokenizer splits identifiers
# (createIssue, create_issue, create-issue), a light stemmer folds morphology, a small vocabulary of
# tool-domain equivalences (create/add/new, delete/remove, ...) matches at reduced weight, and a small
# cross-lingual lexicon lets common Chinese, Japanese, Spanish, German and French words reach English tools.

_CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD_RE = re.compile(r"[^\W_]+")
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
# The words of a text outside those scripts, and the runs of those scripts' word characters (as _WORD_RE would
# find them: not the kana middle dot, voicing marks or unassigned code points).
_NON_CJK_WORD_RE = re.compile(r"[^\W_\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
_CJK_WORD_RE = re.compile(r"[\u3041-\u3096\u309d-\u309f\u30a1-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                          r"\uac00-\ud7a3\uf900-\ufaff]+")

STOP_WORDS = frozenset("""
a about above after again all also am an and any are as at be been before being below between both but by can
could did do does doing down during each few for from further had has have having he her here hers him his how i
if in into is it its itself just let me more most my no nor not now of off on once only or other our ours out
over own please same she should so some such than that the their theirs them then there these they this those
through to too under until up very was we were what when where which while who whom why will with would you
your yours want need like using use via tool tools mcp server help could kindly
s t d m ll re ve don doesn didn isn aren wasn weren haven hasn hadn couldn shouldn wouldn
""".split())  # the last line: what is left of "what's", "don't", "I'd", "we've" once the apostrophe splits them

_IRREGULAR = {"children": "child", "people": "person", "men": "man", "women": "woman", "data": "data",
              "analyses": "analysis", "indices": "index", "media": "media", "news": "news", "status": "status",
              "bus": "bus", "gas": "gas", "alias": "alias", "canvas": "canvas", "https": "http"}


@functools.lru_cache(maxsize=1 << 17)  # catalogues repeat words heavily: 350k calls, ~20k distinct at 10k tools
def stem(word: str) -> str:
    """A light suffix stripper: plurals, -ing, -ed, -ation, final -e.  Consistency matters more than linguistics:
    the index and the query go through the same function."""
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
    if word.endswith("ing") and len(word) >= 6:
        word = word[:-3]
    elif word.endswith("ed") and not word.endswith("eed") and len(word) >= 5:
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


_EQUIVALENCES = """
create new add make generate insert build compose
delete remove drop erase destroy trash purge
list enumerate show browse all
search find query lookup look locate discover seek
send post notify message publish tell dm announce
fetch get read retrieve load obtain open view
update edit modify change patch set rename alter
screenshot capture snapshot screen
run execute exec invoke launch start trigger
stop kill terminate halt cancel abort
write save store put persist
upload attach
download save
file document doc
directory folder dir
issue ticket bug task
pull merge pr
email mail gmail inbox
chat conversation channel slack
web internet online website site page url link
image picture photo img
translate translation language
weather forecast temperature
time timezone clock date
calendar event meeting schedule appointment
repo repository project
user person member people account profile
navigate go visit browse
click press tap
remember memory recall note knowledge
sql database db table
convert transform export
summarize summary tldr digest
price cost quote
stock share ticker market
map location place address geocode direction route
video youtube movie
song music track playlist
deploy release ship
error exception crash failure
comment reply review
dialog popup modal
coordinates latitude longitude
elevation altitude height
"""
# Shorthand an agent writes for words a tool's description spells out ("open a PR" = pull request): in a query
# they also count as the full words, at TRANSLATION_WEIGHT.
_ABBREVIATIONS = """
pr=pull_request prs=pull_request mr=merge_request mrs=merge_request k8s=kubernetes gh=github
repo=repository repos=repository env=environment envs=environment config=configuration configs=configuration
cfg=configuration msg=message msgs=message db=database dbs=database dir=directory dirs=directory
docs=documentation auth=authentication info=information dm=direct_message dms=direct_message org=organization
orgs=organization pkg=package pkgs=package deps=dependency img=image imgs=image pic=picture pics=picture
vid=video vids=video addr=address stats=statistics tz=timezone calc=calculate txn=transaction
txns=transaction perf=performance prod=production dev=development
"""

EQUIVALENCE_WEIGHT = 0.35
TRANSLATION_WEIGHT = 0.8

# Common tool-domain words in other languages, mapped to English index terms.  CJK keys match as substrings.
_LEXICON = """
搜索=search 查找=find 查询=query 检索=search 天气=weather 文件=file 读取=read 创建=create 新建=create
删除=delete 发送=send 消息=message 邮件=email 翻译=translate 图片=image 图像=image 截图=screenshot
网页=web_page 网站=website 日历=calendar 时间=time 时区=timezone 股票=stock 股价=stock_price 价格=price
地图=map 地址=address 位置=location 问题=issue 仓库=repository 数据库=database 列出=list 列表=list
下载=download 上传=upload 运行=run 执行=execute 视频=video 音乐=music 笔记=note 任务=task 会议=meeting
提交=commit 代码=code 目录=directory 文件夹=folder 用户=user 评论=comment 合并=merge 分支=branch
总结=summarize 摘要=summary 转换=convert 生成=generate 图表=chart 新闻=news 热搜=trending 热门=trending
记忆=memory 浏览器=browser 点击=click 导航=navigate 链接=link 表格=table 文档=document 写入=write
保存=save 编辑=edit 修改=update 更新=update 获取=get 汇率=exchange_rate 货币=currency 航班=flight
酒店=hotel 天=day 排行=rank 论文=paper 数学=math 计算=calculate 音频=audio 语音=speech 识别=recognize
検索=search 天気=weather ファイル=file 作成=create 削除=delete 送信=send メッセージ=message メール=email
翻訳=translate 画像=image 写真=photo スクリーンショット=screenshot 予定=event カレンダー=calendar
時刻=time 時間=time 株価=stock_price 地図=map 一覧=list リポジトリ=repository データベース=database
読み込=read 読む=read 書き込=write 保存=save 更新=update 取得=get 課題=issue イシュー=issue 会議=meeting
ブラウザ=browser クリック=click ページ=page ニュース=news 動画=video 音楽=music 要約=summarize 変換=convert
buscar=search busca=search crear=create crea=create borrar=delete eliminar=delete elimina=delete enviar=send
envía=send envia=send mensaje=message correo=email archivo=file archivos=file fichero=file clima=weather
tiempo=weather traducir=translate traduce=translate imagen=image captura=screenshot calendario=calendar
evento=event reunión=meeting leer=read lee=read escribir=write escribe=write listar=list lista=list
precio=price acciones=stock carpeta=folder página=page pagina=page noticias=news tarea=task hora=time
suchen=search suche=search erstellen=create erstelle=create löschen=delete lösche=delete senden=send
sende=send nachricht=message datei=file dateien=file wetter=weather übersetzen=translate übersetze=translate
bild=image bildschirmfoto=screenshot kalender=calendar termin=event lesen=read lies=read schreiben=write
liste=list auflisten=list preis=price aktie=stock aktienkurs=stock_price ordner=folder seite=page
nachrichten=news aufgabe=task uhrzeit=time zeit=time besprechung=meeting
rechercher=search chercher=search cherche=search créer=create crée=create supprimer=delete supprime=delete
envoyer=send envoie=send fichier=file fichiers=file météo=weather traduire=translate traduis=translate
calendrier=calendar événement=event lire=read écrire=write lister=list prix=price dossier=folder
actualités=news tâche=task heure=time réunion=meeting courriel=email
ファイル一覧=file_list 現在=current 时刻=time 時刻=time 几点=time 现在=current 当前=current 最新=latest
最近=recent 状态=status 状態=status 差异=diff 差分=diff 分支=branch ブランチ=branch 扩容=scale 副本=replica
配当=dividend 分红=dividend 股息=dividend 详细=detail 详情=detail 詳細=detail 频道=channel チャンネル=channel
打开=open 開いて=open 开=open 按钮=button ボタン=button 页面=page 内容=content 表=table 提交记录=commit_log
日志=log ログ=log 作成して=create 読んで=read 表示=show 显示=show 查看=view 一覧を=list 取得して=get
数据=data 节点=node 命名空间=namespace 部署=deploy 容器=container 镜像=image 端口=port 转发=forward
aktuell=current aktuelle=current aktuellen=current aktueller=current jetzt=current gerade=current spät=time
uhr=time verzeichnis=directory verzeichnisse=directory baum=tree aktien=stock kurs=price kurse=price
informationen=information bildschirm=screen foto=photo
routen=route routenplanung=directions planung=plan dividende=dividend dividenden=dividend
historie=history verlauf=history anmelde=login anmeldung=login knopf=button schaltfläche=button
protokoll=log protokolle=log kanal=channel kanäle=channel adresse=address koordinaten=coordinates
projekt=project änderung=change änderungen=change zweig=branch
letzte=last letzten=latest neueste=latest neuigkeiten=news schlagzeilen=headlines neu=new neuen=new neuer=new
neues=new tabelle=table zeile=row spalte=column benutzer=user nutzer=user konto=account passwort=password
rechnung=invoice zahlung=payment bestellung=order kunde=customer kunden=customer kommentar=comment
kommentare=comment antwort=reply antworte=reply größe=size grösse=size inhalt=content inhalte=content
wiederherstellen=restore speichere=save speichern=save öffne=open öffnen=open verschiebe=move verschieben=move
umbenennen=rename benenne=rename kopiere=copy kopieren=copy vergleiche=compare vergleichen=compare
zusammenfassung=summary fasse=summarize erkläre=explain übersicht=overview abhängigkeiten=dependencies
datenbank=database abfrage=query tabellen=table zeitzone=timezone stadt=city wo=location entfernung=distance
höhe=elevation ort=place orte=place
アップロード=upload ダウンロード=download ディレクトリ=directory フォルダ=folder フォルダー=folder ツリー=tree
スケール=scale レプリカ=replica デプロイ=deploy コンテナ=container イメージ=image ポッド=pod ノード=node
ユーザー=user ユーザ=user アカウント=account パスワード=password プロジェクト=project タスク=task チケット=ticket
コメント=comment プルリクエスト=pull_request マージ=merge コミット=commit タグ=tag リリース=release ビルド=build
エラー=error バグ=bug ドキュメント=document テーブル=table クエリ=query スキーマ=schema レコード=record
スプレッドシート=spreadsheet シート=sheet グラフ=chart チャート=chart レポート=report リンク=link ウェブ=web
サイト=website タブ=tab フォーム=form テキスト=text ノート=note メモ=note メモリ=memory スレッド=thread イベント=event
スケジュール=schedule リマインダー=reminder タイムゾーン=timezone コード=code スクリプト=script コマンド=command
ターミナル=terminal プロセス=process サーバー=server サーバ=server ポート=port キャッシュ=cache
バックアップ=backup インストール=install パッケージ=package バージョン=version ステータス=status
ログイン=login トークン=token インボイス=invoice カスタマー=customer 天気予報=weather_forecast 価格=price
株式=stock 編集=edit 実行=run 返信=reply 移動=move 複製=copy コピー=copy 名前変更=rename
比較=compare 説明=explain 開く=open 追加=add 支払い=payment 請求書=invoice 顧客=customer 注文=order
파일=file 폴더=folder 디렉토리=directory 디렉터리=directory 트리=tree 검색=search 찾기=find 찾아=find
생성=create 만들=create 만드=create 삭제=delete 지워=delete 지우=delete 전송=send 보내=send 메시지=message 메일=email
번역=translate 이미지=image 사진=photo 스크린샷=screenshot 웹=web 페이지=page 캘린더=calendar 일정=event
시간=time 날씨=weather 주가=stock_price 주식=stock 가격=price 지도=map 주소=address 위치=location 이슈=issue
저장소=repository 리포지토리=repository 데이터베이스=database 목록=list 다운로드=download 업로드=upload
실행=run 동영상=video 음악=music 노트=note 메모=note 메모리=memory 작업=task 회의=meeting 커밋=commit 코드=code
사용자=user 댓글=comment 병합=merge 브랜치=branch 요약=summarize 변환=convert 차트=chart 뉴스=news
브라우저=browser 클릭=click 링크=link 테이블=table 문서=document 저장=save 편집=edit 수정=update
업데이트=update 조회=view 열어=open 열기=open 읽어=read 읽기=read 로그=log 채널=channel 버튼=button
배포=deploy 컨테이너=container 노드=node 포트=port 상태=status 현재=current 최신=latest 최근=recent
환율=exchange_rate 항공편=flight 호텔=hotel 결제=payment 청구서=invoice 고객=customer 주문=order
스케일=scale 복제본=replica 레플리카=replica
arquivo=file arquivos=file criar=create excluir=delete apagar=delete pesquisar=search procurar=search
previsão=forecast mensagem=message mensagens=message usuário=user repositório=repository baixar=download
tarefa=task tarefas=task reunião=meeting comentário=comment traduzir=translate imagem=image
endereço=address localização=location notícias=news preço=price planilha=spreadsheet resumir=summarize
cartella=folder cercare=search creare=create eliminare=delete
inviare=send invia=send messaggio=message messaggi=message utente=user immagine=image indirizzo=address
notizie=news prezzo=price riunione=meeting commento=comment tradurre=translate traduci=translate
scaricare=download scarica=download caricare=upload carica=upload riassumere=summarize riassumi=summarize
meteo=weather previsioni=forecast
"""


def _parse_lexicon(text: str) -> dict[str, tuple[str, ...]]:
    table = {}
    for pair in text.split():
        key, _, value = pair.partition("=")
        table[unicodedata.normalize("NFKC", key).lower()] = tuple(value.split("_"))
    return table



# German separable verbs: "Lade die Datei hoch" is hochladen (upload) with the particle at the clause's end.
# Listed as infinitives; translations() rejoins a particle with an inflected verb form anywhere in the query.
_SEPARABLE_VERBS = """
hochladen=upload herunterladen=download runterladen=download anlegen=create hinzufügen=add anzeigen=show
ansehen=view anschauen=view abrufen=fetch aufrufen=open umrechnen=convert umwandeln=convert auflisten=list
ausführen=run einfügen=insert eintragen=add zurücksetzen=reset einloggen=login anmelden=login abmelden=logout
aufnehmen=record abschicken=send absenden=send weiterleiten=forward zusammenfassen=summarize
nachschlagen=lookup nachsehen=check herausfinden=find zusammenführen=merge festlegen=set einstellen=set
abbrechen=cancel anhalten=stop ausschalten=disable einschalten=enable abspielen=play aufzeichnen=record
hochskalieren=scale_up herunterfahren=shutdown neustarten=restart zurückrollen=rollback zurückgehen=back
ausfüllen=fill auswählen=select anklicken=click weiterschicken=forward umbenennen=rename
"""
_GERMAN_PARTICLES = ("hoch", "herunter", "runter", "an", "ab", "auf", "aus", "ein", "hinzu", "um", "zu",
                     "zurück", "weiter", "nach", "heraus", "zusammen", "fest", "neu")
_GERMAN_PARTICLE_SET = frozenset(_GERMAN_PARTICLES)

LEXICON = _parse_lexicon(_LEXICON)
_LEXICON_ENDINGS = frozenset(key[-3:] for key in LEXICON if len(key) >= 3)  # a compound ends in a lexicon word
SEPARABLE_VERBS = _parse_lexicon(_SEPARABLE_VERBS)
# The CJK keys of the lexicon by their first two characters (a one-character key by its one): a text's CJK runs
# need testing only against the keys that start with one of their characters or character pairs.
_LEXICON_CJK: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
for _key, _english in LEXICON.items():
    if _CJK_RE.search(_key):
        _LEXICON_CJK.setdefault(_key[:2], []).append((_key, _english))
del _key, _english


# ASCII letters and digits kept, every other byte a space: bytes.translate + split is how an ASCII text (nearly
# every tool text) is cut into tokens, several times faster than a Unicode regex over the same characters.
_ASCII_TOKENS = bytes(c if c < 128 and chr(c).isalnum() else 32 for c in range(256))


@functools.lru_cache(maxsize=1 << 17)
def _token_words(token: str) -> tuple[str, ...]:
    """The lowercase words of one token (letters and digits): "API", "Get", "mp3" are one word, "getFileInfo" three."""
    if token.isupper() or token[1:].islower():
        return (token.lower(),)
    return tuple(_CAMEL_RE.sub(" ", token).lower().split())


def _words(text: str) -> list[str]:
    """NFKC, identifier splitting, lowercase; CJK runs become overlapping bigrams so substrings can match."""
    if text.isascii():  # the common case: NFKC is the identity and there is no CJK to split
        tokens = text.encode("ascii").translate(_ASCII_TOKENS).decode("ascii").split()
        return list(itertools.chain.from_iterable(map(_token_words, tokens)))
    text = unicodedata.normalize("NFKC", text)
    if not _CJK_RE.search(text):  # accents, dashes, curly quotes: the same words, found by the Unicode pattern
        return list(itertools.chain.from_iterable(map(_token_words, _WORD_RE.findall(text))))
    text = _CAMEL_RE.sub(" ", text).lower()
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
    stems of its foreign tool-domain words, and the text itself (its surface words, ``surface_words``, are
    needed only when a query compares exact words, so they are derived then, not at build time)."""

    stems: tuple[str, ...]
    foreign: tuple[str, ...]
    text: str


def tokenize(text: str) -> list[str]:
    """Index/query terms of a text: split, stop words dropped, stemmed."""
    return list(_analysed(text).stems)


def surface_words(text: str) -> tuple[str, ...]:
    """A text's words as written (lowercased, stop words dropped): a query compares them, plural-folded, so an
    exact word can outrank one that merely shares its stem."""
    return tuple(itertools.filterfalse(STOP_WORDS.__contains__, _words(text)))


# Two stems no word can produce (analysis yields letters and digits only): _BATCH_SEPARATOR stands between
# the texts of a batch (see analyse_texts), _FOREIGN_MARK ends the stems of a token that holds a foreign
# tool-domain word (a lexicon word, or a compound of two), so a text needs translating exactly when one of its
# tokens carries the mark.
_BATCH_SEPARATOR = "\x01"
_FOREIGN_MARK = "\x02"


class _TokenStems(dict):
    """token -> its index terms (identifier-split, lowercased, stop words dropped, stemmed), filled on first
    sight.  An index build analyses tens of thousands of texts whose words repeat: one dict look-up per token
    (in C, through map) is most of what it then does per word.  Emptied when it outgrows LIMIT, so a catalogue
    of random words cannot grow it without bound; a token looked up again is simply recomputed."""

    LIMIT = 1 << 17

    def __missing__(self, token: str) -> tuple[str, ...]:
        if len(self) >= self.LIMIT:
            self.clear()
        if token == _BATCH_SEPARATOR:
            found: tuple[str, ...] = (_BATCH_SEPARATOR,)
        else:
            words = _token_words(token)
            found = tuple(map(stem, itertools.filterfalse(STOP_WORDS.__contains__, words)))
            if not LEXICON.keys().isdisjoint(words) or any(map(_compound_terms, words)):  # Verzeichnisbaum too
                found += (_FOREIGN_MARK,)
        self[token] = found
        return found


_TOKEN_STEMS = _TokenStems()


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
# batch of a whole 10k-tool catalogue page-faults its way through ~30 MB).
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
        raw = _words(text)
        foreign = tuple(map(stem, _lexicon_words(raw)))
        return TextTerms(_without_mark(stems), foreign + tuple(_german_terms(raw)), text)  # split verbs too
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
    _ANALYSED_TEXTS.clear()


def _german_terms(words: list[str]) -> list[str]:
    """English stems for German separable verbs split over the clause ("lade ... hoch" = hochladen = upload)
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
    """particle -> English stems of the separable verb that particle makes with this inflected form ("lade" +
    "hoch" = hochladen = upload); the first matching form wins, as a reader would try them."""
    matches: dict[str, tuple[str, ...]] = {}
    for form in (verb + "n", verb + "en", verb, verb[:-1] + "en", verb[:-2] + "en"):
        for particle, english in _SEPARABLE_REST.get(form, {}).items():
            matches.setdefault(particle, tuple(stem(word) for word in english))
    return matches


@functools.lru_cache(maxsize=1 << 16)  # long words repeat across a catalogue's descriptions; most are not compounds
def _compound_terms(word: str) -> tuple[str, ...]:
    """English stems of a compound of two lexicon words ("Verzeichnisbaum" = directory tree), else ()."""
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
            return tuple(stem(w) for w in head_english + LEXICON[tail])
    return ()


def translations(text: str) -> list[str]:
    """English index terms for the foreign tool-domain words in ``text`` (see LEXICON, SEPARABLE_VERBS)."""
    return _translated(unicodedata.normalize("NFKC", text).lower())


def _translated(normal: str, german: bool = True) -> list[str]:
    """translations() of a text already NFKC-normalised and lowercased; ``german``: German split verbs and
    compounds too."""
    found = []
    if _CJK_RE.search(normal):
        runs = _CJK_WORD_RE.findall(normal)
        found = _cjk_lexicon_words(runs, itertools.chain.from_iterable(map(_cjk_bigrams, runs)))
    tokens = _NON_CJK_WORD_RE.findall(normal)  # a CJK key is found inside its run above, not again as a word
    found += _lexicon_words(tokens)
    found = [stem(word) for word in found]
    return found + _german_terms(tokens) if german else found


def _build_equivalences() -> dict[str, tuple[str, ...]]:
    table: dict[str, set[str]] = collections.defaultdict(set)
    for line in _EQUIVALENCES.strip().splitlines():
        group = {stem(word) for word in line.split()}
        for term in group:
            table[term] |= group - {term}
    return {term: tuple(sorted(others)) for term, others in table.items()}


EQUIVALENCES = _build_equivalences()
ABBREVIATIONS = {short: tuple(map(stem, words)) for short, words in _parse_lexicon(_ABBREVIATIONS).items()}


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


_FILE_EXTENSIONS = ("py|js|mjs|ts|tsx|jsx|md|txt|json|jsonl|ya?ml|toml|csv|tsv|pdf|png|jpe?g|gif|svg|webp|html?|"
                    "css|xml|log|sh|ini|cfg|conf|docx?|xlsx?|pptx?|zip|tar|gz|sql|rs|go|java|kt|c|cpp|h|rb|php|"
                    "ipynb|wav|mp3|mp4|mov|db|sqlite")
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
    _kind("sql", r"\b(?:select\s.+?\sfrom|insert\s+into|update\s+\w+\s+set|delete\s+from|(?:create|alter|drop)\s+table)\b",
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


# A general web-search tool (a search engine, not a search inside one product) and the words of a request
# for general information, which belongs to such a tool unless a narrower tool matches it clearly.
_WEB_WORDS = frozenset(stem(w) for w in "web internet online".split())
_INFO_CUES = frozenset(stem(w) for w in """news headlines headline latest recent trending information info
background facts article articles happened happening wikipedia""".split())
# Cues that only say "current": a tool whose name holds one of these (latest_version) is not named for the
# request's topic the way a news tool is named for "news".
_INFO_MODIFIERS = frozenset(stem(w) for w in "latest recent happened happening".split())
_QUESTION_STARTS = frozenset(("what", "whats", "which", "who", "when", "where", "wie", "was", "wann", "wo"))


class CollectorPause:
    """Pauses Python's cyclic garbage collector around an index build.  A build allocates hundreds of thousands
    of small objects, none of them in cycles, and every collection those allocations trigger walks every live
    object, the catalogue included: nearly half of a 10k-tool build.  Reference counting still frees what the
    build drops.  Builds on several threads share one pause; the collector runs again when the last ends, and
    only if it was running when the first began (an application that disabled it keeps it disabled).  Its lock
    is a leaf: nothing else is taken while it is held."""

    _lock = threading.Lock()
    _depth = 0
    _resume = False

    def __enter__(self) -> None:
        with CollectorPause._lock:
            if CollectorPause._depth == 0:
                CollectorPause._resume = gc.isenabled()
                gc.disable()
            CollectorPause._depth += 1

    def __exit__(self, *exc_info) -> None:
        with CollectorPause._lock:
            CollectorPause._depth -= 1
            if CollectorPause._depth == 0 and CollectorPause._resume:
                if gc.get_freeze_count() == 0:
                    # What the builds made lives as long as their indexes and holds no cycles: move it to the
                    # oldest generation (freeze, then unfreeze, moves lists and walks nothing) rather than let
                    # the first allocation after enable() walk every object as a young one.  Skipped if the
                    # application froze objects itself: unfreeze would undo that.
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()


class QueryPlan(NamedTuple):
    """What one query asks for.  own: its stems -> (weight, their surface words); other: stems it implies
    (translations, the question cue, equivalents) -> weight; entities: the typed arguments in it; need: the
    stems of what it asks for (its words outside entities, their translations and equivalents: a URL that holds
    "news" is not a request for news)."""

    own: dict[str, tuple[float, set]]
    other: dict[str, float]
    entities: list[QueryEntity]
    need: frozenset


class SearchIndex:
    """BM25F over a tool list.  Built once per catalogue change; a query is a few dictionary look-ups per term.

    ``search(query, top_k)`` returns ``[(tool, score)]``, best first, zero scores dropped, ties broken by name.
    Immutable after construction except for the lazily filled posting/entity caches; the gateway builds one per
    catalogue and searches it from its request threads (cache fills are idempotent dict writes).
    """

    # field: (weight, length-normalisation b)
    FIELDS = {"name": (3.0, 0.5), "server": (1.5, 0.3), "title": (2.0, 0.5), "description": (0.8, 0.75),
              "params": (0.5, 0.5), "param_text": (0.5, 0.75), "examples": (0.3, 0.75), "translated": (0.8, 0.75)}
    K1 = 1.2
    # A tool whose server also holds the best match for the query is likelier to be wanted too (tasks span
    # several tools of one server): each tool gains this share of its server's best score.
    SERVER_BOOST = 0.2
    # An exact word scores SURFACE_WEIGHT + STEM_WEIGHT, a word that only shares the stem STEM_WEIGHT, and a
    # stem-only match counts its idf at most up to the idf of a term in STEM_ONLY_IDF_CAP of the tools: a rare
    # stem ("located" ~ "location") must not outweigh the request's real words.
    SURFACE_WEIGHT = 0.3
    STEM_WEIGHT = 0.7
    STEM_ONLY_IDF_CAP = 0.01
    # Typed entities (a path, a URL, a ticket key, ...) favour tools whose parameters take them: each kind in
    # the query scores like a query word held by the tools that accept it (weight x its idf; a parameter-name
    # cue counts fully, a cue in a parameter description half).
    ENTITY_WEIGHT = 0.5
    ENTITY_WORD_WEIGHT = 0.6  # words inside an entity ("main" in ./src/main.py) are arguments, not the need
    # A request for general information scores general web-search tools like a query word of this weight.
    WEB_SEARCH_WEIGHT = 1.0
    WEB_MAX_MATCHED = 1  # ... unless the best tool matches more of the request's own words than this
    # A question ("what time is it in Tokyo") asks for a current value: "current" joins at this weight.
    QUESTION_WEIGHT = 0.7
    # A name word bound to a partner in (nearly) every tool name that holds it ("pull" in pull_request) means
    # little alone: without its partner in the query it counts this share.
    PHRASE_ALONE_WEIGHT = 0.4
    PHRASE_MIN_TOOLS = 3

    # A tool's fields in _doc_fields, in this order.
    FIELD_ORDER = ("name", "server", "title", "description", "params", "param_text", "examples", "translated")

    def __init__(self, tools: list[dict]):
        self.tools = tools  # a snapshot the caller does not change (the semantic ranker matches it by identity)
        with CollectorPause():
            self._build()

    def _build(self) -> None:
        n = len(self.tools)
        # Column by column (every tool's name, then every description, ...), in C where it can be: one batch
        # analyses the catalogue's texts, and a tool's fields are zipped from the columns.
        columns = list(zip(*map(self._tool_texts, self.tools))) or [()] * len(ToolTexts._fields)
        analysed = analyse_texts(itertools.chain.from_iterable(columns[:-1]))
        short, server, title, description, names, params, examples = (
            list(map(analysed.__getitem__, column)) for column in columns[:-1])
        stems, foreign = operator.attrgetter("stems"), operator.attrgetter("foreign")
        translated = map(operator.add, map(operator.add, map(foreign, short), map(foreign, title)),
                         map(foreign, description))
        # Per tool, its terms field by field (FIELD_ORDER): term frequencies are counted from these when a query
        # first uses a term (see postings), so the build does no per-term work in Python.
        self._doc_fields = list(zip(map(stems, short), map(stems, server), map(stems, title),
                                    map(stems, description), map(stems, names), map(stems, params),
                                    map(stems, examples), translated))
        # What queries need beyond BM25 (surface words, parameter words) is derived from these on first use.
        self._texts = list(zip(short, title, description, names, params, columns[-1]))
        self._doc_sets = list(map(frozenset, map(itertools.chain.from_iterable, self._doc_fields)))
        self._vocabulary = frozenset().union(*self._doc_sets)
        # A field's average length over the tools that have it: over all tools, a field few of them fill (a
        # title, translations) would look far longer than average wherever it occurs and weigh next to nothing.
        self._field_params = []
        for position, field in enumerate(self.FIELD_ORDER):
            weight, b = self.FIELDS[field]
            lengths = list(filter(None, map(len, map(operator.itemgetter(position), self._doc_fields))))
            self._field_params.append((weight, b, sum(lengths) / len(lengths) if lengths else 1.0))
        self._postings: dict[str, list[tuple[int, float]]] = {}
        self._idf: dict[str, float] = {}
        full_names = [str(tool.get("name", "")) for tool in self.tools]
        self._rank_of = [0] * n
        for rank, doc_id in enumerate(sorted(range(n), key=full_names.__getitem__)):
            self._rank_of[doc_id] = rank
        servers: dict[str, int] = {}
        self._server_of = [servers.setdefault(name.partition(SEPARATOR)[0], len(servers)) if SEPARATOR in name
                           else -1 for name in full_names]
        self._surfaces: list[frozenset | None] = [None] * n
        self._exact: dict[tuple[str, frozenset], frozenset] = {}
        self._entity_tools: dict[str, list[tuple[int, float]]] = {}
        self._entity_strength_maps: dict[str, dict[int, float]] = {}
        self._web_tools_found: list[int] | None = None
        self._partners: dict[str, str | None] = {}
        self._stem_cap = math.log(1.0 + (n - max(1.0, self.STEM_ONLY_IDF_CAP * n) + 0.5)
                                  / (max(1.0, self.STEM_ONLY_IDF_CAP * n) + 0.5)) if n else 0.0

    @staticmethod
    def _tool_texts(tool: dict) -> ToolTexts:
        name = tool.get("name")
        name = name if isinstance(name, str) else str(name or "")
        server, sep, short = name.partition(SEPARATOR)
        if not sep:
            server, short = "", name
        description = tool.get("description")
        if not isinstance(description, str):
            description = ""
        title = tool.get("title")
        if not title or not isinstance(title, str):  # else the title its annotations give, if any
            annotations = tool.get("annotations")
            title = annotations.get("title") if isinstance(annotations, dict) else ""
            title = title if isinstance(title, str) else ""
        names: list[str] = []
        texts: list[str] = []
        examples: list[str] = []
        formats: list[str] = []
        _collect_parameters(tool.get("inputSchema"), 0, names, texts, examples, formats)
        return ToolTexts(short, server, title, description, " ".join(names), " ".join(texts), " ".join(examples),
                         tuple(formats))

    @property
    def _web_tools(self) -> list[int]:
        """Ids of the general web-search tools (search__web, brave_web_search), found on first use."""
        found = self._web_tools_found
        if found is None:
            found = self._web_tools_found = [
                doc_id for doc_id, (name, server, _, description, *_) in enumerate(self._doc_fields)
                if ("search" in name or "search" in server)
                and not (_WEB_WORDS.isdisjoint(name) and _WEB_WORDS.isdisjoint(description))]
        return found

    def phrase_partner(self, term: str) -> str | None:
        """The one word ``term`` sits next to in >= 90% of the (>= PHRASE_MIN_TOOLS) tool names holding it
        ("pull" -> "request"), else None.  Such a word alone in a query is weak evidence for those tools.
        Computed from the term's postings on first use."""
        if term in self._partners:
            return self._partners[term]
        holders, pairs = 0, {}
        for doc_id, _ in self.postings(term):
            words = self._texts[doc_id][0].stems
            if term not in words:
                continue
            holders += 1
            for i, word in enumerate(words):
                if word == term:
                    for neighbour in {words[j] for j in (i - 1, i + 1) if 0 <= j < len(words)} - {term}:
                        pairs[neighbour] = pairs.get(neighbour, 0) + 1
        partner = None
        if holders >= self.PHRASE_MIN_TOOLS and pairs:
            best = max(sorted(pairs), key=pairs.__getitem__)
            if pairs[best] >= 0.9 * holders:
                partner = best
        self._partners[term] = partner
        return partner

    def __len__(self) -> int:
        return len(self.tools)

    def postings(self, term: str) -> list[tuple[int, float]]:
        """(doc id, BM25 weight) of every tool holding ``term``, built by the first query that uses the term:
        most of a catalogue's vocabulary is never searched for, so a build does not pay for it."""
        found = self._postings.get(term)
        if found is None:
            if term not in self._vocabulary:
                return []
            holders = list(itertools.compress(range(len(self._doc_sets)),
                                              map(operator.contains, self._doc_sets, itertools.repeat(term))))
            n, k1 = len(self._doc_sets), self.K1
            idf = math.log(1.0 + (n - len(holders) + 0.5) / (len(holders) + 0.5))
            # Field-weighted, length-normalised term frequency, a field at a time: the term is counted in every
            # holder's field in C, and Python arithmetic runs only where it occurs.
            fields = list(map(self._doc_fields.__getitem__, holders))
            tf = [0.0] * len(holders)
            for position, (weight, b, average) in enumerate(self._field_params):
                column = list(map(operator.itemgetter(position), fields))
                counts = list(map(tuple.count, column, itertools.repeat(term)))
                for i in itertools.compress(range(len(counts)), counts):
                    tf[i] += counts[i] * weight / (1.0 - b + b * len(column[i]) / average)
            found = [(doc_id, idf * value / (k1 + value)) for doc_id, value in zip(holders, tf)]
            self._idf[term] = idf
            self._postings[term] = found
        return found

    def exact_docs(self, term: str, surfaces: frozenset) -> frozenset:
        """Ids of the tools holding ``term`` that also hold one of these exact (plural-folded) words; computed
        from the term's postings on first use, so it costs what the postings cost."""
        key = (term, surfaces)
        found = self._exact.get(key)
        if found is None:
            found = self._exact[key] = frozenset(doc_id for doc_id, _ in self.postings(term)
                                                 if not surfaces.isdisjoint(self._doc_surfaces(doc_id)))
        return found

    def _doc_surfaces(self, doc_id: int) -> frozenset:
        found = self._surfaces[doc_id]
        if found is None:
            found = self._surfaces[doc_id] = frozenset(
                singular(word) for terms in self._texts[doc_id][:5] for word in surface_words(terms.text))
        return found

    def _virtual_idf(self, holders: int) -> float:
        """The idf a query term would have if exactly ``holders`` tools held it: an entity kind or the
        general-information need is scored like one more query word, so it weighs less in a long request."""
        n = len(self.tools)
        return math.log(1.0 + (n - holders + 0.5) / (holders + 0.5)) if n else 0.0

    def entity_tools(self, kind: EntityKind) -> list[tuple[int, float]]:
        """(doc id, strength) of the tools whose parameters take ``kind``: 1.0 by a parameter name or format,
        0.5 by a parameter description or a weak cue; computed on first use of the kind."""
        found = self._entity_tools.get(kind.name)
        if found is None:
            cues, formats, weak = kind.cues, kind.formats, kind.weak_cues
            found = []
            for doc_id, (*_, names, words, doc_formats) in enumerate(self._texts):
                if not cues.isdisjoint(names.stems) or not formats.isdisjoint(doc_formats):
                    found.append((doc_id, 1.0))
                elif not cues.isdisjoint(words.stems) or not weak.isdisjoint(names.stems):
                    found.append((doc_id, 0.5))
            self._entity_tools[kind.name] = found
        return found

    def _entity_strengths(self, kind: EntityKind) -> dict[int, float]:
        found = self._entity_strength_maps.get(kind.name)
        if found is None:
            found = self._entity_strength_maps[kind.name] = dict(self.entity_tools(kind))
        return found

    def _query_plan(self, query: str) -> QueryPlan:
        """What ``query`` asks for (see QueryPlan): its own words, what they imply, its arguments, its need."""
        entities = query_entities(query) if self.ENTITY_WEIGHT or self.ENTITY_WORD_WEIGHT != 1.0 else []
        inside, outside, rest_text = set(), set(), query
        if entities:
            rest, last = [], 0
            for entity in entities:
                inside.update(_words(query[entity.start:entity.end]))
                rest.append(query[last:entity.start])
                last = entity.end
            rest.append(query[last:])
            rest_text = " ".join(rest)
            outside = set(_words(rest_text))
        own: dict[str, tuple[float, set]] = {}
        words = [word for word in _words(query) if word not in STOP_WORDS]
        present = {stem(word) for word in words}
        for word in words:
            weight = self.ENTITY_WORD_WEIGHT if word in inside and word not in outside else 1.0
            term = stem(word)
            partner = self.phrase_partner(term) if self.PHRASE_ALONE_WEIGHT != 1.0 else None
            if partner is not None and partner not in present:
                weight *= self.PHRASE_ALONE_WEIGHT
            previous, surfaces = own.get(term, (0.0, set()))
            surfaces.add(singular(word))
            own[term] = (max(previous, weight), surfaces)
        other: dict[str, float] = {}
        translated = translations(rest_text)  # an entity's words are arguments: they are not translated either
        translated += itertools.chain.from_iterable(
            ABBREVIATIONS.get(word, ()) for word in words if word not in inside or word in outside)
        for term in translated:
            other[term] = max(other.get(term, 0.0), TRANSLATION_WEIGHT)
        lowered = query.lower().replace("'", "").split()
        if self.QUESTION_WEIGHT and lowered and lowered[0].strip("¿?") in _QUESTION_STARTS:
            other["current"] = max(other.get("current", 0.0), self.QUESTION_WEIGHT)
        for term, weight in [(t, w) for t, (w, _) in own.items()] + list(other.items()):
            for equivalent in EQUIVALENCES.get(term, ()):
                other[equivalent] = max(other.get(equivalent, 0.0), EQUIVALENCE_WEIGHT * weight)
        for term in own:
            other.pop(term, None)
        need = {stem(word) for word in words if word not in inside or word in outside}.union(translated)
        need.update(*map(EQUIVALENCES.get, list(need), itertools.repeat(())))
        return QueryPlan(own, other, entities, frozenset(need))

    def rank(self, query: str, limit: int) -> list[tuple[int, float]]:
        """The best ``limit`` (doc id, score) pairs, best first, zero scores dropped, ties broken by name; a
        query is read up to bounded_query's limit."""
        plan = self._query_plan(bounded_query(query))
        own, other, entities = plan.own, plan.other, plan.entities
        scores: dict[int, float] = collections.defaultdict(float)
        exact_weight, stem_weight = self.SURFACE_WEIGHT + self.STEM_WEIGHT, self.STEM_WEIGHT
        for term, (weight, surfaces) in own.items():
            hits = self.postings(term)
            if not hits:
                continue
            idf = self._idf[term]
            stem_only = stem_weight * weight * (min(1.0, self._stem_cap / idf) if idf > 0 else 1.0)
            exact = exact_weight * weight
            exact_docs = self.exact_docs(term, frozenset(surfaces))
            for doc_id, value in hits:
                scores[doc_id] += value * (exact if doc_id in exact_docs else stem_only)
        for term, weight in other.items():
            for doc_id, value in self.postings(term):
                scores[doc_id] += stem_weight * weight * value
        if entities and self.ENTITY_WEIGHT:
            for kind in {entity.kind.name: entity.kind for entity in entities}.values():
                accepting = self.entity_tools(kind)
                bonus = self.ENTITY_WEIGHT * self._virtual_idf(len(accepting))
                if scores and len(accepting) > 4 * len(scores):
                    # A kind most tools accept (a path in a big catalogue) only re-orders what matched.
                    strengths = self._entity_strengths(kind)
                    for doc_id in list(scores):
                        scores[doc_id] += bonus * strengths.get(doc_id, 0.0)
                    continue
                for doc_id, strength in accepting:
                    scores[doc_id] += bonus * strength
        if self._web_tools and self.WEB_SEARCH_WEIGHT and not _INFO_CUES.isdisjoint(plan.need):
            # Only when the best tool matches at most one of the request's words, and not by its name: a narrow
            # tool named for the topic (a news tool for "news") or matching more keeps its place; one that
            # shares an incidental word of its description ("latest" in a version tool's) does not.
            best_doc = max(scores, key=scores.__getitem__, default=None)
            matched = 0 if best_doc is None else sum(term in self._doc_sets[best_doc] for term in own)
            named = best_doc is not None and not (set(own) - _INFO_MODIFIERS).isdisjoint(self._texts[best_doc][0].stems)
            if matched <= self.WEB_MAX_MATCHED and not named:
                lift = self.WEB_SEARCH_WEIGHT * self._virtual_idf(len(self._web_tools))
                for doc_id in self._web_tools:
                    scores[doc_id] += lift
        server_of, rank_of = self._server_of, self._rank_of
        server_best: dict[int, float] = {-1: 0.0}  # -1: tools with no server prefix get no boost
        for doc_id, score in scores.items():
            server = server_of[doc_id]
            if server >= 0 and score > server_best.get(server, 0.0):
                server_best[server] = score
        boost = self.SERVER_BOOST
        ranked = ((-(score + boost * server_best[server_of[doc_id]]), rank_of[doc_id], doc_id)
                  for doc_id, score in scores.items() if score > 0.0)
        return [(doc_id, -neg) for neg, _, doc_id in heapq.nsmallest(limit, ranked)]

    def search(self, query: str, top_k: int = TOP_K_DEFAULT) -> list[tuple[dict, float]]:
        top_k = bounded_top_k(top_k)
        return [(self.tools[doc_id], round(score, 4)) for doc_id, score in self.rank(query, top_k)]

# ------------------------------------------------------------------------------------------------------------
# 7b. Semantic ranking (optional): an embeddings endpoint, a vector cache in the vault, hybrid fusion
# ------------------------------------------------------------------------------------------------------------
#
# Lexical matching cannot connect "let the team know the deploy finished" to slack__post_message.  When the
# user configures an embeddings endpoint (any OpenAI-compatible /embeddings, or Ollama's /api/embed), tools are
# embedded once, off the request path, and cached in coffer.db by model and text hash; a query is embedded under
# a short time budget and the semantic ranking is fused with BM25.  Any failure answers with BM25 alone.

EMBEDDING_SCHEMA = """
CREATE TABLE IF NOT EXISTS embeddings (
    model TEXT NOT NULL, text_hash TEXT NOT NULL, dim INTEGER NOT NULL, vector BLOB NOT NULL, created_at TEXT,
    PRIMARY KEY (model, text_hash)
);
"""
HYBRID_ALPHA = 0.45  # share of the lexical score in the hybrid blend (chosen on the eval sets; see fuse)


class EmbedderError(Exception):
    """The embeddings endpoint failed, timed out, or answered with something that is not embeddings."""


def _unit(vector) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Embedder:
    """A client for an embeddings endpoint, with urllib.  The API key is read from a named environment variable
    at call time and never stored."""

    MAX_REPLY_BYTES = 64 << 20

    def __init__(self, url: str, model: str, api: str = "openai", key_env: str = "", batch_size: int = 64):
        if api not in ("openai", "ollama"):
            raise CofferError(f"embedder_api must be 'openai' or 'ollama', not {api!r}")
        self.url, self.model, self.api, self.key_env = url.rstrip("/"), model, api, key_env
        self.batch_size = batch_size
        self.secrets: SecretStore | None = None

    @classmethod
    def from_settings(cls, settings: dict, secrets: SecretStore | None = None):
        url = os.environ.get("COFFER_EMBEDDER_URL", settings.get("embedder_url") or "")
        if not url:
            return None
        embedder = cls(url, os.environ.get("COFFER_EMBEDDER_MODEL", settings.get("embedder_model") or ""),
                       os.environ.get("COFFER_EMBEDDER_API", settings.get("embedder_api") or "openai"),
                       os.environ.get("COFFER_EMBEDDER_KEY_ENV", settings.get("embedder_key_env") or ""))
        embedder.secrets = secrets
        return embedder

    @property
    def cache_key(self) -> str:
        return f"{self.api}:{self.model}"

    def embed(self, texts: list[str], timeout: float) -> list[list[float]]:
        """Unit vectors for ``texts``, in order, batched; raises EmbedderError on any failure."""
        vectors: list[list[float]] = []
        deadline = time.monotonic() + timeout
        for start in range(0, len(texts), self.batch_size):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EmbedderError(f"timed out after {timeout:g}s")
            vectors.extend(self._request(texts[start:start + self.batch_size], remaining))
        return vectors

    def _request(self, batch: list[str], timeout: float) -> list[list[float]]:
        if self.api == "ollama":
            endpoint, body = f"{self.url}/api/embed", {"model": self.model, "input": batch}
        else:
            endpoint, body = f"{self.url}/embeddings", {"model": self.model, "input": batch}
        headers = {"Content-Type": "application/json"}
        key = None
        if self.key_env:  # the key by name: from the environment, else from the secret store
            key = os.environ.get(self.key_env) or (self.secrets.get(self.key_env) if self.secrets else None)
            redact.add(key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            reply = remote_http("POST", endpoint, headers=headers, body=encode_line(body),
                                timeout=max(0.01, timeout), max_bytes=self.MAX_REPLY_BYTES)
        except (UpstreamFailure, EncodeError) as exc:
            raise EmbedderError("timed out" if "timed out" in str(exc) else str(exc)) from None
        if reply.status != 200:
            raise EmbedderError(f"HTTP {reply.status} from {origin_text(endpoint)}")
        try:
            payload = decode_json(reply.body)
        except ValueError:
            raise EmbedderError("the reply is not JSON") from None
        try:
            if self.api == "ollama":
                raw = payload["embeddings"]
            else:
                raw = [item["embedding"] for item in sorted(payload["data"], key=lambda item: item["index"])]
            if len(raw) != len(batch) or not all(raw) or len({len(v) for v in raw}) != 1:
                raise ValueError
            return [_unit([float(x) for x in vector]) for vector in raw]
        except (KeyError, TypeError, ValueError):
            raise EmbedderError("the reply holds no usable embeddings") from None


def embedding_text(tool: dict) -> str:
    """What a tool is embedded as: its words and its description, like an agent would describe the task."""
    name = str(tool.get("name") or "")
    server, sep, short = name.partition(SEPARATOR)
    words = " ".join(_words(short if sep else name))
    title = tool.get("title") if isinstance(tool.get("title"), str) else ""
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    prefix = f"{server} " if sep else ""
    return f"{prefix}{words}: {title + '. ' if title else ''}{description}"[:1000]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _dot_products():
    """The fastest dot product available: numpy when installed, math.sumprod (3.12+), else a plain loop."""
    try:
        import numpy  # optional: only used when it happens to be installed
    except ImportError:
        numpy = None
    if numpy is not None:
        def rank_all(matrix, query):
            return (matrix @ numpy.asarray(query, dtype=numpy.float32)).tolist()
        return rank_all, lambda rows: numpy.asarray(rows, dtype=numpy.float32).reshape(len(rows), -1)
    sumprod = getattr(math, "sumprod", None)
    if sumprod is None:
        import operator
        def sumprod(a, b, _mul=operator.mul):
            return sum(map(_mul, a, b))
    return (lambda matrix, query: [sumprod(row, query) for row in matrix]), (lambda rows: rows)


class SemanticIndex:
    """Cosine similarity over pre-normalised tool vectors (missing vectors simply do not rank)."""

    def __init__(self, tools: list[dict], vectors: list):
        rank_all, to_matrix = _dot_products()
        self._rank_all = rank_all
        self.doc_ids = [i for i, vector in enumerate(vectors) if vector is not None]
        self.matrix = to_matrix([vectors[i] for i in self.doc_ids]) if self.doc_ids else None
        self.tools = tools

    def rank(self, query_vector, limit: int) -> list[tuple[int, float]]:
        if self.matrix is None:
            return []
        sims = self._rank_all(self.matrix, query_vector)
        best = heapq.nlargest(limit, range(len(sims)), key=sims.__getitem__)
        return [(self.doc_ids[i], float(sims[i])) for i in best]


# How far apart (in cosine) the semantic ranker's best and last candidates must be for it to get its full
# share.  A query the embedding model does not understand (a German or Chinese request to an English-only
# model, a domain it never saw) gives flat cosines; its vote then shrinks instead of dragging a correct
# lexical answer down.  Chosen on the dev sets: median spreads there are 0.24-0.37 for English queries and
# 0.13-0.16 for the non-English ones an English-only model misreads.
SEMANTIC_FULL_SPREAD = 0.3


def fuse(lexical: list[tuple[int, float]], semantic: list[tuple[int, float]], top_k: int,
         alpha: float = HYBRID_ALPHA, full_spread: float = SEMANTIC_FULL_SPREAD) -> list[tuple[int, float]]:
    """Calibrated score blending, weighted per query by how sure the semantic ranker is.

    BM25 is scaled by its best score and the cosine min-max scaled over its candidates, as before; the semantic
    share (1 - alpha) is then multiplied by min(1, cosine spread / full_spread); ``full_spread=0`` turns that
    off (the fixed blend measured before; knowledge search was tuned with it).  On the six dev sets
    this beat the fixed blend on five of six dev sets (nDCG@10 +0.006 to +0.022; metatool-dev -0.007) and
    keeps non-English queries near their lexical ranking instead of 0.03-0.14 below it.
    """
    scores: dict[int, float] = collections.defaultdict(float)
    if lexical:
        best = lexical[0][1] or 1.0
        for doc_id, score in lexical:
            scores[doc_id] += alpha * score / best
    if semantic:
        high, low = semantic[0][1], semantic[-1][1]
        trust = 1.0 if len(semantic) == 1 or full_spread <= 0 else min(1.0, max(0.0, high - low) / full_spread)
        for doc_id, score in semantic:
            scaled = (score - low) / (high - low) if high > low else 1.0  # one candidate: full credit
            scores[doc_id] += (1.0 - alpha) * trust * scaled
    return heapq.nsmallest(top_k, scores.items(), key=lambda item: (-item[1], item[0]))


class SemanticRanker:
    """Owns the embedder, the vector cache (memory + coffer.db) and the semantic index of the live catalogue.

    ``refresh(tools)`` is cheap and non-blocking: tools without a cached vector are embedded on a background
    thread.  ``search`` returns (hits, ranker, note): ``ranker`` is "hybrid" or "bm25"; ``note`` says why a
    fallback happened.
    """

    CANDIDATES = 50

    def __init__(self, embedder: Embedder, db_path: str, query_timeout: float, build_timeout: float = 120.0):
        self.embedder, self.db_path = embedder, db_path
        self.query_timeout, self.build_timeout = query_timeout, build_timeout
        self.vectors: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.index: SemanticIndex | None = None
        self._index_for = None
        self._wanted = threading.Event()
        self._tools: list[dict] = []
        self._warned_not_ready = False
        self._load_cache()
        threading.Thread(target=self._embed_loop, name="coffer-embedder", daemon=True).start()

    def _connect(self):
        db = Vault._connect(self.db_path)
        db.executescript(EMBEDDING_SCHEMA)
        return db

    def _load_cache(self) -> None:
        import array
        try:
            db = self._connect()
            for row in db.execute("SELECT text_hash, vector FROM embeddings WHERE model=?", (self.embedder.cache_key,)):
                self.vectors[row["text_hash"]] = array.array("f", row["vector"]).tolist()
            db.close()
        except sqlite3.Error as exc:
            log.warning("embedding cache unavailable: %s", exc)

    def refresh(self, tools: list[dict]) -> None:
        with self.lock:
            self._tools = tools
        self._wanted.set()

    def _embed_loop(self) -> None:
        delay, last_error = 5.0, None
        while True:
            self._wanted.wait()
            self._wanted.clear()
            with self.lock:
                tools = self._tools
            try:
                index = self._index(tools)
            except Exception as exc:  # noqa: BLE001 - BM25 serves meanwhile; this thread must live on
                if str(exc) != last_error:
                    log.warning("embedder: tool vectors unavailable (%s); search uses BM25 until they are", exc)
                    last_error = str(exc)
                time.sleep(delay)
                delay = min(delay * 2, 120.0)
                self._wanted.set()
                continue
            delay, last_error = 5.0, None
            with self.lock:
                if self._tools is tools:
                    self.index, self._index_for = index, tools

    def _index(self, tools: list[dict]) -> SemanticIndex:
        """Embed what is not cached yet (saving it), then index the whole catalogue."""
        import array
        hashes = [text_hash(embedding_text(tool)) for tool in tools]
        missing = {h: embedding_text(tool) for h, tool in zip(hashes, tools) if h not in self.vectors}
        if missing:
            new = dict(zip(missing, self.embedder.embed(list(missing.values()), self.build_timeout)))
            self.vectors.update(new)
            try:
                db = self._connect()
                with _Transaction(db):
                    db.executemany("INSERT OR REPLACE INTO embeddings(model, text_hash, dim, vector, created_at)"
                                   " VALUES (?,?,?,?,?)",
                                   [(self.embedder.cache_key, h, len(v), array.array("f", v).tobytes(), utcnow())
                                    for h, v in new.items()])
                db.close()
            except sqlite3.Error as exc:
                log.warning("embedding cache not saved: %s", exc)
        vectors = [self.vectors.get(h) for h in hashes]
        dims = collections.Counter(len(v) for v in vectors if v)
        if len(dims) > 1:  # the model behind the name changed: keep the current dimension, re-embed the rest
            current = len(self.embedder.embed(["dimension probe"], self.build_timeout)[0])
            for h in hashes:
                if h in self.vectors and len(self.vectors[h]) != current:
                    del self.vectors[h]
            raise EmbedderError(f"cached vectors of another dimension than {current}; re-embedding")
        return SemanticIndex(tools, vectors)

    def search(self, lexical_index: SearchIndex, query: str, top_k: int):
        """Hybrid search, or BM25 with a note saying why not; the embedder reads what the lexical ranker reads."""
        query = bounded_query(query)
        with self.lock:
            index = self.index if self._index_for is lexical_index.tools else None
        if index is None:
            if not self._warned_not_ready:
                self._warned_not_ready = True
                log.warning("embedder: tool vectors not ready yet; queries are answered by BM25 until they are")
            return lexical_index.search(query, top_k), "bm25", "embedder: tool vectors not ready yet"
        try:
            query_vector = self.embedder.embed([query], self.query_timeout)[0]
        except EmbedderError as exc:
            log.warning("embedder fallback to BM25: %s", exc)
            return lexical_index.search(query, top_k), "bm25", f"embedder fallback: {exc}"
        lexical = lexical_index.rank(query, self.CANDIDATES)
        try:
            semantic = index.rank(query_vector, self.CANDIDATES)
        except ValueError as exc:  # a query vector of another dimension: the endpoint's model changed
            log.warning("embedder fallback to BM25: %s", exc)
            return lexical_index.search(query, top_k), "bm25", "embedder fallback: vector dimension changed"
        tools = lexical_index.tools
        return [(tools[doc], round(score, 4)) for doc, score in fuse(lexical, semantic, top_k)], "hybrid", None


# ============================================================================================================
# 8. Knowledge and memory: the user's documents and notes, one retrieval call away (coffer__ask / __remember)
# ============================================================================================================
#
# A knowledge source is a folder of Markdown / plain text / reStructuredText.  Files are split into passages
# along headings and paragraphs (each passage knows its file, heading path and line range), stored in coffer.db
# (knowledge_sources, knowledge_files, knowledge_passages) and ranked by BM25F over Coffer's own analysed terms
# (identifier splitting, stemming; heading, body and path fields).  Where the interpreter's sqlite3 has FTS5, an
# FTS5 table over those terms finds the candidates on disk and BM25F re-scores them (no index in memory, nothing
# to rebuild when a file changes); otherwise an in-memory BM25F index over all passages answers.  Both engines
# give the same ranking (evals/ask.py measures both; a test checks it).  Pseudo-relevance feedback was tried and
# dropped: on the eval it moved recall@5 by +0.01 at best on one engine and lowered it on the other.
#
# Indexing is incremental: a file whose (mtime, size) did not change is not read; one whose sha256 did not change
# is not re-split.  With an embedder configured, passage vectors are cached in the embeddings table (model + text
# hash) like tool vectors and fused with the lexical ranking; any embedder failure answers lexically.  Memory
# notes are small Markdown files with front matter under COFFER_HOME/memory/, indexed as the reserved source
# "memory".


KNOWLEDGE_SCHEMA = """
CREATE TABLE IF NOT EXISTS knowledge_sources (
    name TEXT PRIMARY KEY,
    root TEXT NOT NULL,                      -- absolute path as the user gave it (memory: COFFER_HOME/memory)
    globs TEXT NOT NULL,                     -- JSON list of glob patterns, relative to root
    kind TEXT NOT NULL DEFAULT 'folder',     -- 'folder' or 'memory'
    created_at TEXT NOT NULL,
    indexed_at TEXT,
    last_stats TEXT                          -- JSON of the last ReindexStats (counts only, never text)
);
CREATE TABLE IF NOT EXISTS knowledge_files (
    id INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    path TEXT NOT NULL,                      -- relative to the source root, '/'-separated
    mtime_ns INTEGER NOT NULL, size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,                    -- '' when never read (over the size bound)
    skipped TEXT,                            -- why it has no passages (binary, too large, unreadable), or NULL
    indexed_at TEXT NOT NULL,
    UNIQUE (source, path)
);
CREATE TABLE IF NOT EXISTS knowledge_passages (
    id INTEGER PRIMARY KEY,
    file_id INTEGER NOT NULL,
    source TEXT NOT NULL, path TEXT NOT NULL,
    heading TEXT NOT NULL,                   -- heading path, 'Title > Section > Subsection'
    first_line INTEGER NOT NULL, last_line INTEGER NOT NULL,
    text TEXT NOT NULL,
    heading_terms TEXT NOT NULL, body_terms TEXT NOT NULL, path_terms TEXT NOT NULL  -- analysed, space-joined
);
CREATE INDEX IF NOT EXISTS knowledge_passages_file ON knowledge_passages(file_id);
CREATE INDEX IF NOT EXISTS knowledge_passages_source ON knowledge_passages(source);
CREATE TABLE IF NOT EXISTS knowledge_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO knowledge_meta(key, value) VALUES ('generation', 0), ('fts_synced', 1);
"""
# The FTS5 table holds Coffer's analysed terms, not the raw text: FTS5's own tokenizer then only splits on the
# spaces, and both ranking paths agree on what a term is.  rowid = knowledge_passages.id.
KNOWLEDGE_FTS_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts USING fts5(
    heading, body, path, source UNINDEXED, tokenize = 'unicode61 remove_diacritics 0');
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts_vocab USING fts5vocab(knowledge_fts, 'row');
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts_columns USING fts5vocab(knowledge_fts, 'col');
"""

KNOWLEDGE_DEFAULT_GLOBS = ("*.md", "*.markdown", "*.txt", "*.rst")
MEMORY_SOURCE = "memory"
KNOWLEDGE_SOURCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")
MEMORY_ID_RE = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$")
MEMORY_TAG_RE = re.compile(r"^[\w.-]{1,32}$")
# Folders that are never documentation and can hold huge trees; hidden folders (.git, .venv) are skipped anyway.
KNOWLEDGE_SKIP_DIRS = frozenset({"node_modules", "__pycache__", "site-packages"})
# Tool-search stop words minus the words that carry meaning in documentation ("development server", "--help").
KNOWLEDGE_STOP_WORDS = STOP_WORDS - {"server", "help", "tool", "tools", "mcp"}
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


# ------------------------------------------------------------------------------------------------------------
# Splitting: Markdown, reStructuredText and plain text into passages along headings and paragraphs
# ------------------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------------------
# Walking a source folder: globs, .gitignore, hidden files, symlinks, bounds
# ------------------------------------------------------------------------------------------------------------

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
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > limits.max_file_bytes:
        return None, digest, "too large"
    if b"\x00" in data[:8192]:
        return None, digest, "binary"
    text = data.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text, digest, ""


# ------------------------------------------------------------------------------------------------------------
# Analysis and ranking
# ------------------------------------------------------------------------------------------------------------

def knowledge_terms(text: str) -> tuple[str, ...]:
    """Index/query terms of a passage or question: Coffer's word splitting and stemmer, documentation stop words."""
    if text.isascii():
        # _words treats each ASCII word on its own, so a cache per distinct word gives the same terms ~4x faster
        # (documents repeat their words; indexing 10k passages is mostly this function).
        return tuple(itertools.chain.from_iterable(map(_word_terms, _WORD_RE.findall(text))))
    return tuple(stem(word) for word in _words(text) if word not in KNOWLEDGE_STOP_WORDS)


@functools.lru_cache(maxsize=1 << 17)
def _word_terms(word: str) -> tuple[str, ...]:
    return tuple(stem(part) for part in _words(word) if part not in KNOWLEDGE_STOP_WORDS)


def _path_words(path: str) -> str:
    stem_part = path.rsplit(".", 1)[0] if "." in path.rsplit("/", 1)[-1] else path
    return " ".join(knowledge_terms(stem_part.replace("/", " ").replace("-", " ").replace("_", " ")))


class PassageIndex:
    """Coffer's own BM25F over passages (heading, body and path fields), used where sqlite3 lacks FTS5.

    Immutable once built: searches on any thread read it while a rebuild makes a new one.  Postings are compact
    arrays (8 bytes a posting), with the BM25 weight of each (term, passage) computed once at build time.
    """

    FIELDS = (("heading", 2.0, 0.5), ("body", 1.0, 0.75), ("path", 0.7, 0.3))
    K1 = 1.2

    def __init__(self, rows):
        """``rows``: (passage id, source, heading terms, body terms, path terms), terms space-joined."""
        self.ids: list[int] = []
        self.sources: list[str] = []
        fields_per_doc = []
        for passage_id, source, heading, body, path in rows:
            self.ids.append(passage_id)
            self.sources.append(source)
            fields_per_doc.append((heading.split(), body.split(), path.split()))
        n = len(self.ids)
        averages = [(sum(len(doc[f]) for doc in fields_per_doc) / n if n else 0.0) or 1.0
                    for f in range(len(self.FIELDS))]
        raw: dict[str, tuple[array.array, array.array]] = {}
        for doc_id, doc in enumerate(fields_per_doc):
            tf: dict[str, float] = {}
            for f, (_, weight, b) in enumerate(self.FIELDS):
                terms = doc[f]
                if terms:
                    norm = weight / (1.0 - b + b * len(terms) / averages[f])
                    for term in terms:
                        tf[term] = tf.get(term, 0.0) + norm
            for term, value in tf.items():
                posting = raw.get(term)
                if posting is None:
                    posting = raw[term] = (array.array("i"), array.array("f"))
                posting[0].append(doc_id)
                posting[1].append(value)
        k1 = self.K1
        for term, (docs, values) in raw.items():
            idf = math.log(1.0 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            for k, value in enumerate(values):
                values[k] = idf * value / (k1 + value)
        self.postings = raw
        self.count = n

    def document_frequency(self, term: str) -> int:
        posting = self.postings.get(term)
        return len(posting[0]) if posting else 0

    def rank(self, weights: dict[str, float], limit: int, sources: frozenset | None = None):
        """Best ``limit`` (passage id, score), best first."""
        scores: dict[int, float] = collections.defaultdict(float)
        for term, weight in weights.items():
            posting = self.postings.get(term)
            if posting:
                for doc_id, value in zip(*posting):
                    scores[doc_id] += weight * value
        if sources is not None:
            scores = {d: s for d, s in scores.items() if self.sources[d] in sources}
        best = heapq.nlargest(limit, scores.items(), key=lambda item: (item[1], -item[0]))
        return [(self.ids[doc_id], score) for doc_id, score in best if score > 0.0]


class KnowledgeHit(NamedTuple):
    """One retrieved passage, as coffer__ask returns it."""

    source: str
    path: str
    heading: str
    lines: tuple[int, int]
    text: str
    score: float

    def to_dict(self) -> dict:
        return {"source": self.source, "path": self.path, "heading": self.heading, "lines": list(self.lines),
                "text": self.text, "score": self.score}


class KnowledgeAnswer(NamedTuple):
    passages: list[KnowledgeHit]
    total_searched: int
    ranker: str            # 'fts5', 'bm25f', or either with '+hybrid'
    note: str | None       # why a fallback happened (embedder down, vectors not ready)


class KnowledgeSource(NamedTuple):
    name: str
    root: str
    globs: tuple[str, ...]
    kind: str
    files: int
    passages: int
    indexed_at: str | None


class ReindexStats(NamedTuple):
    """What one reindex of one source did; counts only (the log may show it: no text, no question)."""

    source: str
    files_seen: int
    files_read: int          # files whose (mtime, size) changed, so their bytes were read and hashed
    files_added: int
    files_changed: int       # content changed: re-split and re-indexed
    files_removed: int
    files_unchanged: int
    passages_added: int
    passages_removed: int
    skipped: dict            # reason -> count (binary, too large, symlink outside the root, ...)
    seconds: float


class MemoryNote(NamedTuple):
    id: str
    time: str
    client: str
    tags: tuple[str, ...]
    text: str


class _Snapshot(NamedTuple):
    generation: int
    counts: dict               # source -> passages
    lexical: PassageIndex | None     # the in-memory index (engine 'bm25f' only)
    averages: tuple            # average field lengths in terms (heading, body, path), for re-scoring FTS5 hits


_FTS5_AVAILABLE: bool | None = None


def fts5_available() -> bool:
    """Whether this interpreter's sqlite3 was built with FTS5 (checked once)."""
    global _FTS5_AVAILABLE
    if _FTS5_AVAILABLE is None:
        try:
            probe = sqlite3.connect(":memory:")
            probe.execute("CREATE VIRTUAL TABLE probe USING fts5(x)")
            probe.close()
            _FTS5_AVAILABLE = True
        except sqlite3.Error:
            _FTS5_AVAILABLE = False
    return _FTS5_AVAILABLE


def passage_embedding_text(heading: str, text: str) -> str:
    return f"{heading}\n{text}"[:2000] if heading else text[:2000]


class KnowledgeBase:
    """Owns the knowledge tables of coffer.db, the memory folder, and the in-memory indexes over them.

    Threads: ``search``/``ask``/``sources``/``memories``/``memory``/``changed`` may run on any thread at once
    (each thread reads through its own SQLite connection; WAL lets them read while a write is under way).
    ``add_source``/``remove_source``/``reindex``/``remember``/``forget`` are writers: serialized by a lock in this
    process and by SQLite's write lock across processes; they may run on any thread (the gateway's watcher
    thread reindexes while worker threads search).  With an embedder, one daemon thread embeds new passages.
    """

    FTS_CANDIDATES = 100       # FTS5 hits re-scored by BM25F (50 gave the same eval results; 100 is margin)
    FTS_COMMON_SHARE = 0.2     # terms in more than this share of passages do not pick candidates (see _lexical)
    CANDIDATES = 50            # lexical and semantic candidates fused in hybrid mode
    EMBED_CHUNK = 256          # passages embedded (and saved) per embedder call
    # Lexical share of the hybrid blend.  Documentation passages are long and the question's exact words matter;
    # on evals/ask.py with all-MiniLM-L6-v2, 0.7-0.8 was a plateau (nDCG@10 0.860 against 0.838 lexical) while
    # tool search's 0.45 made the hybrid worse than lexical alone (0.821).
    HYBRID_ALPHA = 0.75
    MEMORY_MAX_CHARS = 16_000
    QUESTION_MAX_CHARS = 2_000

    def __init__(self, db_path: str, home: str, *, embedder: "Embedder | None" = None, engine: str = "auto",
                 query_timeout: float = 1.0, build_timeout: float = 120.0,
                 limits: KnowledgeLimits = KnowledgeLimits()):
        if engine not in ("auto", "fts5", "bm25f"):
            raise CofferError(f"knowledge engine must be auto, fts5 or bm25f, not {engine!r}")
        if engine == "fts5" and not fts5_available():
            raise CofferError("this Python's sqlite3 has no FTS5; use engine 'bm25f'")
        self.db_path, self.home, self.limits = db_path, home, limits
        self.engine = "fts5" if engine == "fts5" or (engine == "auto" and fts5_available()) else "bm25f"
        self.memory_dir = os.path.join(home, "memory")
        self._write_lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer = Vault._connect(db_path)
        self._writer.executescript(KNOWLEDGE_SCHEMA)
        if fts5_available():
            self._prepare_fts()
        self.embedder, self.query_timeout, self.build_timeout = embedder, query_timeout, build_timeout
        self._vectors: dict[str, list[float]] = {}
        self._semantic: tuple[list[int], SemanticIndex] | None = None  # (passage id per row, index)
        self._embed_wanted = threading.Event()
        self._embed_lock = threading.Lock()   # the background thread and ensure_vectors embed one at a time
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        # Memory notes join searches without a 'sources' filter only when the user turned memory on (the gateway
        # sets this from 'coffer config memory'); an explicit sources=['memory'] always reaches them.
        self.memory_enabled = True
        if embedder is not None:
            self._ensure_embedding_table()
            self._embed_wanted.set()
            threading.Thread(target=self._embed_loop, name="coffer-knowledge-embedder", daemon=True).start()

    # -- connections ---------------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = Vault._connect(self.db_path)
            with self._readers_lock:
                self._readers.append(db)
        return db

    def close(self) -> None:
        self._closed.set()
        self._embed_wanted.set()
        with self._readers_lock:
            for db in self._readers:
                try:
                    db.close()
                except sqlite3.Error:
                    pass
            self._readers.clear()
        with self._write_lock:
            self._writer.close()

    def _generation(self, db) -> int:
        return db.execute("SELECT value FROM knowledge_meta WHERE key='generation'").fetchone()[0]

    def _prepare_fts(self) -> None:
        """Create the FTS5 tables, set their ranking, and rebuild them if a Python without FTS5 wrote passages
        since (it cannot update them)."""
        self._writer.executescript(KNOWLEDGE_FTS_SCHEMA)
        # The configured rank lets 'ORDER BY rank' take FTS5's own sorted path.  Stored in the table, so set once.
        rank = self._writer.execute("SELECT v FROM knowledge_fts_config WHERE k='rank'").fetchone()
        if not rank or rank[0] != "bm25(2.0, 1.0, 0.7)":
            with self._write_lock, _Transaction(self._writer) as db:
                db.execute("INSERT INTO knowledge_fts(knowledge_fts, rank) VALUES ('rank', 'bm25(2.0, 1.0, 0.7)')")
        row = self._writer.execute("SELECT value FROM knowledge_meta WHERE key='fts_synced'").fetchone()
        if row and row[0]:
            return
        with self._write_lock, _Transaction(self._writer) as db:
            db.execute("DELETE FROM knowledge_fts")
            db.execute("INSERT INTO knowledge_fts(rowid, heading, body, path, source) SELECT id, heading_terms,"
                       " body_terms, path_terms, source FROM knowledge_passages")
            db.execute("UPDATE knowledge_meta SET value=1 WHERE key='fts_synced'")
        log.warning("knowledge: full-text index rebuilt (passages were written by a Python without FTS5)")

    # -- sources -------------------------------------------------------------------------------------------
    def add_source(self, path: str, name: str | None = None, globs=None) -> ReindexStats:
        """Register a folder (or one file) and index it; the stats name the source."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise CofferError("give the path of a folder to add")
        root = os.path.abspath(os.path.expanduser(path))
        if not os.path.exists(root):
            raise CofferError(f"{root} does not exist")
        if name is None:
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(root.rstrip(os.sep)) or "docs").strip("-.")[:48]
            name = name if name and KNOWLEDGE_SOURCE_RE.match(name) else "docs"
        if not isinstance(name, str) or not KNOWLEDGE_SOURCE_RE.match(name):
            raise CofferError(f"bad source name {name!r}: use letters, digits, '.', '_' or '-' (at most 48)")
        if name.lower() == MEMORY_SOURCE:
            raise CofferError(f"{MEMORY_SOURCE!r} is reserved for memory notes (coffer memory ...)")
        globs = tuple(globs) if globs else KNOWLEDGE_DEFAULT_GLOBS
        if len(globs) > 32 or not all(isinstance(g, str) and g and len(g) <= 200 and "\x00" not in g for g in globs):
            raise CofferError("globs must be at most 32 non-empty patterns of at most 200 characters")
        for pattern in globs:
            try:
                glob_regex(pattern)
            except re.error as exc:
                raise CofferError(f"bad glob {pattern!r}: {exc}") from None
        with self._write_lock, _Transaction(self._writer) as db:
            if db.execute("SELECT 1 FROM knowledge_sources WHERE lower(name)=lower(?)", (name,)).fetchone():
                raise CofferError(f"knowledge source {name!r} already exists; remove it first or pick another name")
            db.execute("INSERT INTO knowledge_sources(name, root, globs, kind, created_at) VALUES (?,?,?,?,?)",
                       (name, root, dumps(list(globs)), "folder", utcnow()))
        return self.reindex(name)[0]

    def remove_source(self, name: str) -> None:
        if name == MEMORY_SOURCE:
            raise CofferError("memory notes are removed with 'coffer memory rm ID'")
        with self._write_lock, _Transaction(self._writer) as db:
            if not db.execute("SELECT 1 FROM knowledge_sources WHERE name=?", (name,)).fetchone():
                raise CofferError(f"unknown knowledge source {name!r}")
            self._delete_passages(db, "source=?", (name,))
            db.execute("DELETE FROM knowledge_files WHERE source=?", (name,))
            db.execute("DELETE FROM knowledge_sources WHERE name=?", (name,))
            self._bump(db)
        self._refresh_snapshot()

    def sources(self) -> list[KnowledgeSource]:
        db = self._reader()
        files = dict(db.execute("SELECT source, count(*) FROM knowledge_files GROUP BY source").fetchall())
        passages = dict(db.execute("SELECT source, count(*) FROM knowledge_passages GROUP BY source").fetchall())
        return [KnowledgeSource(row["name"], row["root"], tuple(json.loads(row["globs"])), row["kind"],
                                files.get(row["name"], 0), passages.get(row["name"], 0), row["indexed_at"])
                for row in db.execute("SELECT * FROM knowledge_sources ORDER BY name")]

    def _source_rows(self, db, name: str | None):
        rows = db.execute("SELECT * FROM knowledge_sources" + (" WHERE name=?" if name else "") + " ORDER BY name",
                          (name,) if name else ()).fetchall()
        if name and not rows:
            raise CofferError(f"unknown knowledge source {name!r}")
        return rows

    # -- indexing ------------------------------------------------------------------------------------------
    def _bump(self, db) -> None:
        db.execute("UPDATE knowledge_meta SET value=value+1 WHERE key='generation'")

    def _delete_passages(self, db, where: str, args: tuple) -> int:
        if fts5_available():
            db.execute(f"DELETE FROM knowledge_fts WHERE rowid IN (SELECT id FROM knowledge_passages WHERE {where})",
                       args)
        else:
            db.execute("UPDATE knowledge_meta SET value=0 WHERE key='fts_synced'")
        return db.execute(f"DELETE FROM knowledge_passages WHERE {where}", args).rowcount

    def reindex(self, name: str | None = None) -> list[ReindexStats]:
        """Bring one source (or all) up to date with its files; only changed files are read and re-split."""
        rows = self._source_rows(self._reader(), name)
        stats = [self._reindex_source(row) for row in rows]
        self._refresh_snapshot()
        if self.embedder is not None:
            self._embed_wanted.set()
        return stats

    def _reindex_source(self, source) -> ReindexStats:
        started = time.monotonic()
        name, kind = source["name"], source["kind"]
        skipped: collections.Counter = collections.Counter()
        found = walk_source(source["root"], tuple(json.loads(source["globs"])), self.limits, skipped)
        stored = {row["path"]: row for row in self._reader().execute(
            "SELECT id, path, mtime_ns, size, sha256, skipped FROM knowledge_files WHERE source=?", (name,))}
        counts: collections.Counter = collections.Counter()
        # (file, sha256, passages or None, why it has none): None without a reason = same content, new stat.
        pending: list[tuple[FoundFile, str, list[Passage] | None, str | None]] = []
        for found_file in found:
            row = stored.get(found_file.path)
            if row is not None and (row["mtime_ns"], row["size"]) == (found_file.mtime_ns, found_file.size):
                counts["unchanged"] += 1
                if row["skipped"]:
                    skipped[row["skipped"]] += 1
                continue
            if found_file.size > self.limits.max_file_bytes:
                text, digest, why_not = None, "", "too large"   # never read: a 50 MB log costs one stat
            else:
                text, digest, why_not = read_document(found_file.absolute, self.limits)
                counts["read"] += 1
            if text is None:
                skipped[why_not] += 1
                pending.append((found_file, digest, None, why_not))
            elif row is not None and row["sha256"] == digest and not row["skipped"]:
                counts["unchanged"] += 1        # touched, not changed: keep its passages
                pending.append((found_file, digest, None, None))
            else:
                counts["changed" if row is not None else "added"] += 1
                pending.append((found_file, digest, self._split(kind, found_file.path, text), None))
            if len(pending) >= 200:   # write in batches: short write transactions, bounded memory
                self._write_files(name, pending, counts)
                pending = []
        if pending:
            self._write_files(name, pending, counts)
        present = {f.path for f in found}
        # A folder that is gone for now (an unmounted drive, a renamed parent) keeps its index until it is back.
        root_missing = any(reason.startswith(ROOT_UNREADABLE) for reason in skipped)
        gone = [] if root_missing else [row for path, row in stored.items() if path not in present]
        with self._write_lock, _Transaction(self._writer) as db:
            for row in gone:
                counts["passages_removed"] += self._delete_passages(db, "file_id=?", (row["id"],))
                db.execute("DELETE FROM knowledge_files WHERE id=?", (row["id"],))
            if gone:
                self._bump(db)
            result = ReindexStats(name, len(found), counts["read"], counts["added"], counts["changed"], len(gone),
                                  counts["unchanged"], counts["passages_added"], counts["passages_removed"],
                                  dict(skipped), round(time.monotonic() - started, 3))
            db.execute("UPDATE knowledge_sources SET indexed_at=?, last_stats=? WHERE name=?",
                       (utcnow(), dumps(result._asdict()), name))
        if skipped.get("over the walk limits"):
            log.warning("knowledge: source %s is over the walk limits (%d files, %d entries); the rest is not "
                        "indexed", name, self.limits.max_files, self.limits.max_entries)
        return result

    def _split(self, kind: str, path: str, text: str) -> list[Passage]:
        text = redact(_CONTROL_CHARS_RE.sub("\ufffd", text))  # a known secret in a document stays out of coffer.db
        if kind != "memory":
            return split_passages(text, document_kind(path), self.limits)
        fields, body_start = parse_front_matter(text)
        tags = fields.get("tags") if isinstance(fields.get("tags"), list) else []
        heading = "memory" + (": " + ", ".join(str(t) for t in tags[:16]) if tags else "")
        return [p._replace(heading=heading) for p in split_passages(text, "markdown", self.limits)
                if p.last_line > body_start]

    def _write_files(self, name: str, pending, counts: collections.Counter) -> None:
        now = utcnow()
        with self._write_lock, _Transaction(self._writer) as db:
            for found_file, digest, passages, why_not in pending:
                row = db.execute("SELECT id, sha256, skipped FROM knowledge_files WHERE source=? AND path=?",
                                 (name, found_file.path)).fetchone()
                same = row is not None and row["sha256"] == digest and not row["skipped"]
                if row is not None and ((passages is None and why_not is None) or (same and passages is not None)):
                    # Same content (or another process indexed it meanwhile): remember the new stat only.
                    db.execute("UPDATE knowledge_files SET mtime_ns=?, size=? WHERE id=?",
                               (found_file.mtime_ns, found_file.size, row["id"]))
                    continue
                if row is not None:
                    counts["passages_removed"] += self._delete_passages(db, "file_id=?", (row["id"],))
                    db.execute("UPDATE knowledge_files SET mtime_ns=?, size=?, sha256=?, skipped=?, indexed_at=?"
                               " WHERE id=?", (found_file.mtime_ns, found_file.size, digest, why_not, now, row["id"]))
                    file_id = row["id"]
                else:
                    file_id = db.execute("INSERT INTO knowledge_files(source, path, mtime_ns, size, sha256, skipped,"
                                         " indexed_at) VALUES (?,?,?,?,?,?,?)",
                                         (name, found_file.path, found_file.mtime_ns, found_file.size, digest,
                                          why_not, now)).lastrowid
                if not passages:
                    continue
                path_terms = _path_words(found_file.path)
                rows = [(file_id, name, found_file.path, p.heading, p.first_line, p.last_line, p.text,
                         " ".join(knowledge_terms(p.heading)), " ".join(knowledge_terms(p.text)), path_terms)
                        for p in passages]
                db.executemany(
                    "INSERT INTO knowledge_passages(file_id, source, path, heading, first_line, last_line, text,"
                    " heading_terms, body_terms, path_terms) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
                counts["passages_added"] += len(rows)
                if fts5_available():
                    db.execute("INSERT INTO knowledge_fts(rowid, heading, body, path, source) SELECT id,"
                               " heading_terms, body_terms, path_terms, source FROM knowledge_passages WHERE"
                               " file_id=?", (file_id,))
                else:
                    db.execute("UPDATE knowledge_meta SET value=0 WHERE key='fts_synced'")
            self._bump(db)

    def changed(self) -> bool:
        """Whether any source's files differ from the index (added, removed, or a new mtime/size).

        Cost: one directory listing per folder and one stat per matching file, no file is read -- measured 25 ms
        for 1,368 files and 0.5 s for 20,000 (the per-source cap) on a busy 2-core machine.  ``start_watcher``
        polls every 2 s and stretches the interval to 50x the last check, so polling stays under ~2% of a core.
        """
        db = self._reader()
        for source in self._source_rows(db, None):
            skipped: collections.Counter = collections.Counter()
            found = walk_source(source["root"], tuple(json.loads(source["globs"])), self.limits, skipped)
            if any(reason.startswith(ROOT_UNREADABLE) for reason in skipped):
                continue   # nothing to compare with; reindex would keep the index as it is
            stored = {row[0]: (row[1], row[2]) for row in db.execute(
                "SELECT path, mtime_ns, size FROM knowledge_files WHERE source=?", (source["name"],))}
            if stored != {f.path: (f.mtime_ns, f.size) for f in found}:
                return True
        return False

    def start_watcher(self, interval: float = 2.0) -> None:
        """Poll for file changes on a daemon thread and reindex when there are some (serve calls this once)."""
        if self._watcher is not None:
            return

        def watch():
            wait = interval
            while not self._closed.wait(wait):
                started = time.monotonic()
                try:
                    if self.changed():
                        self.reindex()
                except Exception:  # noqa: BLE001 - a bad folder must not end the watcher
                    log.exception("knowledge: watching for file changes failed")
                # Keep polling under ~2% of a core even for a huge source.
                wait = max(interval, 50.0 * (time.monotonic() - started))

        self._watcher = threading.Thread(target=watch, name="coffer-knowledge-watcher", daemon=True)
        self._watcher.start()

    # -- search --------------------------------------------------------------------------------------------
    def _refresh_snapshot(self) -> _Snapshot:
        """Rebuild the snapshot if the tables changed.  One builder at a time; searches on other threads keep
        answering from the previous snapshot meanwhile (building the in-memory BM25F index of 10k passages takes
        about a second; the FTS5 engine only reads counts)."""
        with self._snapshot_lock:
            db = self._reader()
            db.execute("BEGIN")   # one consistent read: the generation and the rows it describes
            try:
                generation = self._generation(db)
                if self._snapshot is not None and self._snapshot.generation == generation:
                    return self._snapshot
                counts = dict(db.execute("SELECT source, count(*) FROM knowledge_passages GROUP BY source"))
                lexical, averages = None, (1.0, 1.0, 1.0)
                if self.engine == "bm25f":
                    lexical = PassageIndex(db.execute("SELECT id, source, heading_terms, body_terms, path_terms"
                                                      " FROM knowledge_passages ORDER BY id"))
                else:
                    total = sum(counts.values()) or 1
                    tokens = dict(db.execute("SELECT col, sum(cnt) FROM knowledge_fts_columns GROUP BY col"))
                    averages = tuple((tokens.get(column) or 0) / total or 1.0
                                     for column in ("heading", "body", "path"))
            finally:
                db.execute("COMMIT")
            self._snapshot = _Snapshot(generation, counts, lexical, averages)
            return self._snapshot

    def _current_snapshot(self) -> _Snapshot:
        snapshot = self._snapshot
        if snapshot is not None and (snapshot.generation == self._generation(self._reader())
                                     or self._snapshot_lock.locked()):
            return snapshot   # current, or a rebuild is under way on another thread: answer from this one
        return self._refresh_snapshot()

    def query_weights(self, question: str) -> dict[str, float]:
        weights: dict[str, float] = {}
        for term in knowledge_terms(question):
            weights[term] = 1.0
        for term in translations(question):
            weights[term] = max(weights.get(term, 0.0), TRANSLATION_WEIGHT)
        return weights

    def _lexical(self, snapshot: _Snapshot, weights: dict[str, float], limit: int, sources):
        if self.engine == "bm25f":
            return snapshot.lexical.rank(weights, limit, sources)
        # FTS5 finds the candidates (its bm25() is a sum of per-column BM25, close to but not BM25F); BM25F then
        # re-scores them exactly as PassageIndex would, so both engines rank alike.
        total = sum(snapshot.counts.values())
        frequencies = self._document_frequencies(snapshot, [term for term in weights if term])
        idf = {t: math.log(1.0 + (total - df + 0.5) / (df + 0.5)) for t, df in frequencies.items() if df}
        if not idf:
            return []
        # Candidates come from the terms that discriminate: a term in more than a tenth of the passages makes FTS5
        # score thousands of rows for little; it still counts when the candidates are re-scored.
        by_rarity = sorted(idf, key=lambda t: frequencies[t])
        probe = [t for t in by_rarity if frequencies[t] <= total * self.FTS_COMMON_SHARE] or by_rarity[:2]
        query = " OR ".join('"' + term.replace('"', '""') + '"' for term in probe)
        sql = "SELECT rowid FROM knowledge_fts WHERE knowledge_fts MATCH ?"
        args: list = [query]
        if sources is not None:
            sql += f" AND source IN ({','.join('?' * len(sources))})"
            args.extend(sorted(sources))
        sql += " ORDER BY rank LIMIT ?"   # rank = bm25(2.0, 1.0, 0.7), set in _prepare_fts: ~2x faster than bm25()
        args.append(max(limit, self.FTS_CANDIDATES))
        db = self._reader()
        try:
            candidates = [row[0] for row in db.execute(sql, args)]
        except sqlite3.OperationalError as exc:
            log.warning("knowledge: full-text query failed (%s)", exc)
            return []
        if not candidates:
            return []
        rows = db.execute("SELECT id, heading_terms, body_terms, path_terms FROM knowledge_passages WHERE id IN"
                          f" ({','.join('?' * len(candidates))})", candidates).fetchall()
        fields = [(weight, b, average) for (_, weight, b), average in zip(PassageIndex.FIELDS, snapshot.averages)]
        needles = [(" " + term + " ", query_weight * idf[term]) for term, query_weight in weights.items()
                   if term in idf]
        k1 = PassageIndex.K1
        scored = []
        for row in rows:
            # Terms are space-joined; with every space doubled, non-overlapping matches of " term " count every
            # occurrence (adjacent repeats included), and the counting runs in C.
            padded, norms = [], []
            for text, (weight, b, average) in zip(row[1:], fields):
                length = text.count(" ") + 1 if text else 0
                padded.append(" " + text.replace(" ", "  ") + " ")
                norms.append(weight / (1.0 - b + b * length / average))
            score = 0.0
            for needle, term_weight in needles:
                tf = norms[0] * padded[0].count(needle) + norms[1] * padded[1].count(needle) \
                    + norms[2] * padded[2].count(needle)
                if tf:
                    score += term_weight * tf / (k1 + tf)
            if score > 0.0:
                scored.append((row[0], score))
        return heapq.nlargest(limit, scored, key=lambda item: (item[1], -item[0]))

    def _document_frequencies(self, snapshot, terms: list[str]) -> dict[str, int]:
        if not terms:
            return {}
        if snapshot.lexical is not None:
            return {t: snapshot.lexical.document_frequency(t) for t in terms}
        found = {}
        for start in range(0, len(terms), 500):
            chunk = terms[start:start + 500]
            found.update(self._reader().execute(
                f"SELECT term, doc FROM knowledge_fts_vocab WHERE term IN ({','.join('?' * len(chunk))})",
                chunk).fetchall())
        return found

    def passages(self, sources=None):
        """Every indexed passage (score 0), in id order: for listing, exporting and the evals' comparators."""
        snapshot = self._current_snapshot()
        wanted = self._check_sources(snapshot, sources)
        for row in self._reader().execute("SELECT source, path, heading, first_line, last_line, text FROM"
                                          " knowledge_passages ORDER BY id"):
            if wanted is None or row["source"] in wanted:
                yield KnowledgeHit(row["source"], row["path"], row["heading"], (row["first_line"], row["last_line"]),
                                   row["text"], 0.0)

    def search(self, question: str, top_k: int = 5, sources=None) -> list[KnowledgeHit]:
        return self.ask(question, top_k, sources).passages

    def ask(self, question: str, top_k: int = 5, sources=None) -> KnowledgeAnswer:
        """The passages that best answer ``question``, best first; never raises for an embedder problem."""
        if not isinstance(question, str):
            raise CofferError("question must be a string")
        question = question.strip()[:self.QUESTION_MAX_CHARS]
        try:
            top_k = max(1, min(20, int(top_k)))
        except (TypeError, ValueError):
            raise CofferError("top_k must be an integer from 1 to 20") from None
        snapshot = self._current_snapshot()
        wanted = self._check_sources(snapshot, sources)
        if wanted is None and not self.memory_enabled and snapshot.counts.get(MEMORY_SOURCE):
            wanted = frozenset(snapshot.counts) - {MEMORY_SOURCE}
        total = sum(count for source, count in snapshot.counts.items() if wanted is None or source in wanted)
        if not question or not total:
            return KnowledgeAnswer([], total, self.engine, None)
        weights = self.query_weights(question)
        limit = max(top_k, self.CANDIDATES)
        lexical = self._lexical(snapshot, weights, limit, wanted) if weights else []
        ranker, note, ranked = self.engine, None, lexical[:top_k]
        if self.embedder is not None:
            ranked, ranker, note = self._hybrid(question, lexical, top_k, wanted)
        return KnowledgeAnswer(self._hits(ranked), total, ranker, note)

    def _check_sources(self, snapshot, sources):
        if sources is None:
            return None
        if isinstance(sources, str):
            sources = [sources]
        if not isinstance(sources, (list, tuple)) or len(sources) > 100 or \
                not all(isinstance(s, str) for s in sources):
            raise CofferError("sources must be a list of knowledge source names")
        known = {row[0] for row in self._reader().execute("SELECT name FROM knowledge_sources")}
        unknown = [s for s in sources if s not in known]
        if unknown:
            raise CofferError(f"unknown knowledge source {unknown[0]!r}; known: {', '.join(sorted(known)) or 'none'}")
        return frozenset(sources)

    def _hits(self, ranked: list[tuple[int, float]]) -> list[KnowledgeHit]:
        if not ranked:
            return []
        rows = {row["id"]: row for row in self._reader().execute(
            "SELECT id, source, path, heading, first_line, last_line, text FROM knowledge_passages WHERE id IN"
            f" ({','.join('?' * len(ranked))})", [doc for doc, _ in ranked])}
        return [KnowledgeHit(row["source"], row["path"], row["heading"], (row["first_line"], row["last_line"]),
                             row["text"], round(score, 4))
                for doc, score in ranked if (row := rows.get(doc)) is not None]

    # -- hybrid (optional embedder) ------------------------------------------------------------------------
    def _hybrid(self, question, lexical, top_k, wanted):
        semantic_state = self._semantic
        if semantic_state is None:
            return lexical[:top_k], self.engine, "embedder: passage vectors not ready yet"
        try:
            query_vector = self.embedder.embed([question], self.query_timeout)[0]
        except EmbedderError as exc:
            log.warning("knowledge: embedder fallback to BM25: %s", exc)
            return lexical[:top_k], self.engine, f"embedder fallback: {exc}"
        ids, index = semantic_state
        try:
            semantic = index.rank(query_vector, self.CANDIDATES * (4 if wanted is not None else 1))
        except ValueError:
            return lexical[:top_k], self.engine, "embedder fallback: vector dimension changed"
        semantic = [(ids[row], score) for row, score in semantic]
        if wanted is not None:
            allowed = {row[0] for row in self._reader().execute(
                f"SELECT id FROM knowledge_passages WHERE source IN ({','.join('?' * len(wanted))}) AND id IN"
                f" ({','.join('?' * len(semantic))})", [*sorted(wanted), *(doc for doc, _ in semantic)])}
            semantic = [(doc, score) for doc, score in semantic if doc in allowed]
        semantic = semantic[:self.CANDIDATES]
        return fuse(lexical, semantic, top_k, self.HYBRID_ALPHA, full_spread=0), self.engine + "+hybrid", None

    def _ensure_embedding_table(self) -> None:
        try:
            db = Vault._connect(self.db_path)
            db.executescript(EMBEDDING_SCHEMA)
            db.close()
        except sqlite3.Error as exc:
            log.warning("knowledge: embedding cache unavailable: %s", exc)

    def _embed_loop(self) -> None:
        delay, last_error = 5.0, None
        while True:
            self._embed_wanted.wait()
            self._embed_wanted.clear()
            if self._closed.is_set():
                return
            try:
                self._embed_missing()
            except Exception as exc:  # noqa: BLE001 - lexical search serves meanwhile; this thread must live on
                if str(exc) != last_error:
                    log.warning("knowledge: passage vectors unavailable (%s); answering lexically until they are",
                                exc)
                    last_error = str(exc)
                if self._closed.wait(delay):
                    return
                delay = min(delay * 2, 120.0)
                self._embed_wanted.set()
                continue
            delay, last_error = 5.0, None

    def ensure_vectors(self) -> None:
        """Embed what is missing now, on this thread (the background thread does the same on its own); raises
        EmbedderError.  For callers that want hybrid answers at once: evals, tests, ``coffer knowledge reindex``."""
        if self.embedder is None:
            raise CofferError("no embedder is configured")
        self._embed_missing()

    def _embed_missing(self) -> None:
        """Embed passages without a cached vector (saving them), then index every passage that has one."""
        with self._embed_lock:
            self._embed_missing_locked()

    def _embed_missing_locked(self) -> None:
        db = Vault._connect(self.db_path)
        db.executescript(EMBEDDING_SCHEMA)
        try:
            rows = db.execute("SELECT id, heading, text FROM knowledge_passages ORDER BY id").fetchall()
            texts = {row["id"]: passage_embedding_text(row["heading"], row["text"]) for row in rows}
            hashes = {doc: text_hash(text) for doc, text in texts.items()}
            key = self.embedder.cache_key
            # Only the vectors of current passages stay in memory, as float32 arrays (1.5 kB each at 384
            # dimensions, against ~12 kB as lists of floats).
            current = set(hashes.values())
            self._vectors = {h: v for h, v in self._vectors.items() if h in current}
            wanted = list(current - set(self._vectors))
            for start in range(0, len(wanted), 500):   # cached ones first: never re-embed what the vault has
                chunk = wanted[start:start + 500]
                for row in db.execute(f"SELECT text_hash, vector FROM embeddings WHERE model=? AND text_hash IN"
                                      f" ({','.join('?' * len(chunk))})", [key, *chunk]):
                    self._vectors[row["text_hash"]] = array.array("f", row["vector"])
            missing = {}
            for doc, digest in hashes.items():
                if digest not in self._vectors and digest not in missing:
                    missing[digest] = texts[doc]
            # In chunks, each saved as it arrives: a slow embedder that fails part way keeps what it did.
            pending = list(missing.items())
            for start in range(0, len(pending), self.EMBED_CHUNK):
                chunk = pending[start:start + self.EMBED_CHUNK]
                vectors = self.embedder.embed([text for _, text in chunk], self.build_timeout)
                new = {digest: array.array("f", vector) for (digest, _), vector in zip(chunk, vectors)}
                self._vectors.update(new)
                with _Transaction(db):
                    db.executemany("INSERT OR REPLACE INTO embeddings(model, text_hash, dim, vector, created_at)"
                                   " VALUES (?,?,?,?,?)",
                                   [(key, h, len(v), v.tobytes(), utcnow()) for h, v in new.items()])
        finally:
            db.close()
        ids = [doc for doc in hashes if hashes[doc] in self._vectors]
        dims = collections.Counter(len(self._vectors[hashes[doc]]) for doc in ids)
        if len(dims) > 1:   # the model behind the name changed: drop the minority, re-embed next round
            keep = dims.most_common(1)[0][0]
            for digest in [h for h, v in self._vectors.items() if len(v) != keep]:
                del self._vectors[digest]
            raise EmbedderError("cached passage vectors of several dimensions; re-embedding")
        self._semantic = (ids, SemanticIndex([None] * len(ids), [self._vectors[hashes[doc]] for doc in ids]))

    # -- memory --------------------------------------------------------------------------------------------
    def _ensure_memory_source(self) -> None:
        os.makedirs(self.memory_dir, mode=0o700, exist_ok=True)
        with self._write_lock, _Transaction(self._writer) as db:
            db.execute("INSERT OR IGNORE INTO knowledge_sources(name, root, globs, kind, created_at) VALUES"
                       " (?,?,?,?,?)", (MEMORY_SOURCE, self.memory_dir, dumps(["*.md"]), "memory", utcnow()))

    def remember(self, text: str, tags=(), client: str | None = None) -> str:
        """Write a memory note (a 0600 Markdown file with front matter) and index it; returns its id."""
        if not isinstance(text, str) or not text.strip():
            raise CofferError("a memory needs some text")
        if len(text) > self.MEMORY_MAX_CHARS:
            raise CofferError(f"a memory holds at most {self.MEMORY_MAX_CHARS} characters")
        if isinstance(tags, str):
            tags = [tags]
        if not isinstance(tags, (list, tuple)) or len(tags) > 16 or \
                not all(isinstance(t, str) and MEMORY_TAG_RE.match(t) for t in tags):
            raise CofferError("tags must be at most 16 words of letters, digits, '.', '_' or '-' (32 characters)")
        client = _CONTROL_CHARS_RE.sub("", str(client or "unknown")).replace("\n", " ").replace("\r", " ")[:100]
        self._ensure_memory_source()
        now = time.time()
        note_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)
        body = text.replace("\r\n", "\n").strip("\n")
        content = (f"---\nid: {note_id}\ntime: {iso_timestamp(now)}\nclient: {json.dumps(client)}\n"
                   f"tags: {json.dumps(list(tags))}\n---\n{body}\n")
        path = os.path.join(self.memory_dir, note_id + ".md")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(content)
        self.reindex(MEMORY_SOURCE)
        return note_id

    def _note_path(self, note_id: str) -> str:
        if not isinstance(note_id, str) or not MEMORY_ID_RE.match(note_id):
            raise CofferError(f"bad memory id {note_id!r}")
        return os.path.join(self.memory_dir, note_id + ".md")

    def memory(self, note_id: str) -> MemoryNote:
        path = self._note_path(note_id)
        if not os.path.isfile(path):
            raise CofferError(f"unknown memory {note_id!r}")
        text, _, why_not = read_document(path, self.limits)
        if text is None:
            raise CofferError(f"memory {note_id!r} is {why_not}")
        fields, body_start = parse_front_matter(text)
        tags = fields.get("tags") if isinstance(fields.get("tags"), list) else []
        return MemoryNote(note_id, str(fields.get("time", "")), str(fields.get("client", "")),
                          tuple(str(t) for t in tags), "\n".join(split_lines(text)[body_start:]).strip("\n"))

    def memories(self) -> list[MemoryNote]:
        try:
            names = sorted(os.listdir(self.memory_dir))
        except OSError:
            return []
        notes = []
        for name in names:
            note_id = name[:-3]
            if name.endswith(".md") and MEMORY_ID_RE.match(note_id):
                try:
                    notes.append(self.memory(note_id))
                except CofferError:
                    continue
        return notes

    def forget(self, note_id: str) -> bool:
        path = self._note_path(note_id)
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        self.reindex(MEMORY_SOURCE)
        return True


# ============================================================================================================
# 9. Gateway session: the MCP server a client talks to
# ============================================================================================================

SEARCH_TOOL_DEFINITION = {
    "name": SEARCH_TOOL,
    "title": "Search tools",
    "description": (
        "Find the right tool among every connected MCP server by describing what you want to do. Returns the "
        "best-matching tools with their full input schemas; call them by the returned name."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What you want to do, in plain words."},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "How many tools to return (1-20)."},
        },
        "required": ["query"],
    },
    "outputSchema": {
        "type": "object",
        "properties": {
            "tools": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "inputSchema": {"type": "object"}, "score": {"type": "number"}}}},
            "total_searched": {"type": "integer"},
        },
        "required": ["tools", "total_searched"],
    },
    "annotations": {"readOnlyHint": True, "openWorldHint": False},
}

ASK_TOOL_DEFINITION = {
    "name": ASK_TOOL,
    "title": "Ask the user's notes and docs",
    "description": (
        "Search the user's own documents and remembered facts (the folders and notes they keep in Coffer) and get "
        "the passages that answer a question, each with its file, heading and line numbers; when the client can, "
        "also a short answer citing them. Use it before asking the user something they may have written down."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "question": {"type": "string", "description": "What you want to know, in plain words."},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "How many passages to return (1-20)."},
            "sources": {"type": "array", "items": {"type": "string"},
                        "description": "Only these knowledge sources (names from the user's setup; 'memory' for "
                                       "remembered facts)."},
        },
        "required": ["question"],
    },
    "outputSchema": {
        "type": "object",
        "properties": {
            "passages": {"type": "array", "items": {"type": "object", "properties": {
                "source": {"type": "string"}, "path": {"type": "string"}, "heading": {"type": "string"},
                "lines": {"type": "array", "items": {"type": "integer"}}, "text": {"type": "string"},
                "score": {"type": "number"}}}},
            "total_searched": {"type": "integer"},
            "answer": {"type": "string"},
        },
        "required": ["passages", "total_searched"],
    },
    "annotations": {"readOnlyHint": True, "openWorldHint": False},
}

REMEMBER_TOOL_DEFINITION = {
    "name": REMEMBER_TOOL,
    "title": "Remember a fact for every agent",
    "description": (
        "Keep a fact the user (or you) want every agent to know later -- a decision, a preference, a convention, "
        "where something lives. It is stored as a small note in the user's Coffer, which they can read and edit, "
        "and coffer__ask finds it. Keep it short and self-contained; never store secrets."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": "The fact, in one or a few sentences."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "A few words to file it under."},
        },
        "required": ["text"],
    },
    "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False,
                    "openWorldHint": False},
}

ASK_SAMPLING_BUDGET = 30.0  # seconds coffer__ask may spend on the client's model, both calls together

CLIENT_SIDE_CAPABILITIES = ("sampling", "elicitation", "roots")
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


def _require_str(params: dict, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise RpcError(INVALID_PARAMS, f"'{key}' must be a non-empty string")
    return value


# -- client-aware listing ---------------------------------------------------------------------------------------
# Some clients show only so many tools (Cursor about 40, Windsurf 100, VS Code 128) and drop the rest in an order
# nobody chose; Claude Code searches its tools itself and wants them all.  With expose "auto" (the default) a
# client known to cap gets, when the catalogue is larger, a budget of the tools most likely wanted; every tool
# stays callable by name and findable with coffer__search_tools.

CLIENT_FAMILIES = (("claude-code", "claude-code"), ("cursor", "cursor"), ("windsurf", "windsurf"),
                   ("codeium", "windsurf"), ("visual studio code", "vscode"), ("vscode", "vscode"),
                   ("codex", "codex"), ("gemini", "gemini"), ("zed", "zed"), ("claude", "claude-desktop"))
CLIENT_TOOL_CAPS = {"cursor": 40, "windsurf": 100, "vscode": 128}


def client_family(client_name: str) -> str | None:
    """The client a clientInfo.name belongs to (its settings key: expose.<family>), or None."""
    name = client_name.lower()
    return next((family for needle, family in CLIENT_FAMILIES if needle in name), None)


def expose_mode(settings: dict, family: str | None) -> str:
    """all, search or budget:N for this client: its own expose.<family> setting, else the global one; auto means
    a budget of the client's known cap, else all."""
    value = (settings.get(f"expose.{family}") if family else None) or settings["expose"]
    if value == "auto":
        cap = CLIENT_TOOL_CAPS.get(family or "")
        return f"budget:{cap}" if cap else "all"
    return value


def budget_tools(tools: list[dict], cap: int, usage: dict[str, int]) -> list[dict]:
    """At most ``cap - 1`` tools (coffer__search_tools takes the last place), in catalogue order: first the most
    used tool of each server (so every server stays visible), then the most used of the rest over the last 90
    days; ties go to catalogue order, so the same inputs always give the same list."""
    room = cap - 1
    if len(tools) <= room:
        return tools
    order = {id(tool): i for i, tool in enumerate(tools)}
    key = lambda tool: (-usage.get(tool["name"], 0), order[id(tool)])  # noqa: E731
    best_of_server: dict[str, dict] = {}
    for tool in sorted(tools, key=key):
        best_of_server.setdefault(tool["name"].partition(SEPARATOR)[0], tool)
    chosen = sorted(best_of_server.values(), key=key)[:room]
    picked = {id(tool) for tool in chosen}
    chosen += [tool for tool in sorted(tools, key=key) if id(tool) not in picked][:room - len(chosen)]
    return sorted(chosen, key=lambda tool: order[id(tool)])


@dataclass
class Question:
    """A request an upstream asked the client mid-call, parked for a 2026-07-28 client (which answers it by
    retrying the call with inputResponses)."""
    upstream_id: object
    method: str
    params: dict
    asked: bool = False     # already sent to the client in an input_required result


@dataclass
class ForwardedCall:
    """A client request Coffer sent to an upstream, until its answer reaches the client.

    ``msg_id`` is the client request that will receive the answer: the original one or, after the upstream asked the
    client something mid-call (a 2026-07-28 client answers by retrying), the retry; None while a question is out
    with the client.  A reply that arrives then is ``held`` for the retry.  Guarded by Gateway.lock.
    """
    upstream: Upstream
    method: str
    capability: str
    kind: str | None
    started: float
    msg_id: object
    client_params: dict                   # as the client sent them: what a sealed requestState is bound to
    upstream_params: dict                 # as sent upstream (original name), for a multi-round-trip retry
    ticket: Ticket | None = None
    done: bool = False
    held: tuple | None = None
    exchange: str | None = None           # id in Gateway.exchanges while questions are parked
    questions: dict = dataclasses.field(default_factory=dict)   # key -> Question
    parked_until: float = 0.0
    rounds: int = 0                       # input_required rounds driven for a handshake-era client
    progress_token: object = None         # Coffer's own token upstream (2026-07-28 client), mapped to the current
    sent: bool = False                    # request's token; False while questions precede the call itself

    @property
    def log_level(self) -> str | None:
        meta = self.client_params.get("_meta")
        level = meta.get(META_LOG_LEVEL) if isinstance(meta, dict) else None
        return level if level in LOG_LEVELS else None

    @property
    def capabilities(self) -> dict:
        meta = self.client_params.get("_meta")
        caps = meta.get(META_CLIENT_CAPABILITIES) if isinstance(meta, dict) else None
        return caps if isinstance(caps, dict) else {}


class RelayedRequest(NamedTuple):
    """A server->client request Coffer relayed under an id of its own: where the client's answer goes back to."""
    upstream: Upstream
    generation: int
    upstream_id: object


class Waiting(NamedTuple):
    """A client request that waits, with no thread, for starting upstreams (at most until the discovery deadline)
    or, with ``server``, for that one upstream's start (at most until its own ``deadline``)."""
    msg_id: object
    work: Callable
    kind: str | None
    method: str
    server: str | None = None
    deadline: float = 0.0


class Gateway:
    """One client session over stdio: answers locally what it can, routes everything else to an upstream.

    Threads and what they own:
      - the caller's thread reads the client (``serve``) and dispatches each message;
      - each upstream's reader delivers that upstream's replies straight to the client (``send``);
      - the ticker (``_tick``) expires timed-out requests, releases requests waiting for discovery and notices
        vault edits;
      - a small worker pool answers what waited (discovery, a search waiting for its embedding);
      - the invocation log writes on its own thread.
    Locks, always taken in this order and never the reverse: ``_rebuild_lock`` (one catalogue build at a time; it
    sends list_changed while held) → ``vault_lock`` (the shared SQLite connection) → ``lock`` (upstreams, in-flight
    and relayed requests, parked exchanges, listen streams, waiting requests, subscriptions) → an Upstream's lock →
    ``out_lock`` (the client's stdout, innermost: nothing is called while holding it).
    """

    FLUSH_BYTES = 1 << 20  # replies held for the end of a burst are written once they pass this
    MAX_BATCH = 10_000     # messages in one JSON-RPC batch line (each costs ~100x its bytes once parsed)

    def __init__(self, vault: Vault, out=None, remember: bool = True, on_client_gone=None, only=None):
        self.vault = vault
        self.remember = remember
        self.only = set(only) if only else None  # serve just these servers (`coffer call` needs one)
        self.disabled_servers: set[str] = set()
        self.vault_lock = threading.Lock()
        self.settings = vault.settings()
        self.out = out if out is not None else sys.stdout.buffer
        self.out_lock = threading.Lock()
        self._unsent: list[bytes] = []
        self._unsent_bytes = 0
        self.on_client_gone = on_client_gone
        self._client_gone = threading.Event()
        self.log = InvocationLog(vault.path)
        self.lock = threading.RLock()
        self.upstreams: dict[str, Upstream] = {}
        self.configs: dict[str, dict] = {}
        self.remembered: dict[str, dict] = {}  # server -> kind -> {name: definition}, from the vault
        self.states = vault.capability_states()
        self.catalogue = Catalogue([], self.states, self.settings["name_max_length"])
        self._fingerprint = self.catalogue.fingerprint()
        self._rebuild_lock = threading.Lock()
        self._rebuilds_wanted = self._rebuilds_done = 0
        self._force_tools_notice = False
        self.initialized = False
        self.client_capabilities: dict = {}
        self.client_name = "unknown"
        self.usage: dict[str, int] = {}  # calls per tool in the last 90 days, for budgeted lists
        self.protocol_version = LATEST_PROTOCOL_VERSION
        self.log_level = None
        self.advertised: dict = {}
        self.subscriptions: dict[str, set[str]] = collections.defaultdict(set)  # server -> original URIs
        self.inflight: dict[object, ForwardedCall] = {}        # by the client's request id
        self.client_era: str | None = None    # "handshake" (initialize) or "modern" (2026-07-28), set by request 1
        self.client_info: dict = {}
        self.listen_streams: dict[object, ListenFilter] = {}   # a 2026-07-28 client's open subscriptions/listen
        self.exchanges: dict[str, ForwardedCall] = {}          # calls whose upstream asked the client something
        self.progress_calls: dict[str, ForwardedCall] = {}     # Coffer's progress token -> call (2026-07-28 client)
        self.orphan_questions: dict[str, list[Question]] = collections.defaultdict(list)  # asked with no call
        self.sealer = RequestStateSealer(ttl=float(self.settings["mrtr_ttl"]))
        self.client_requests: dict[str, RelayedRequest] = {}   # by the id Coffer gave the relayed request
        self._client_request_seq = 0
        self._waiting: list[Waiting] = []
        self._catalogued: dict[str, float] = {}  # upstream name -> the ready_at whose lists the catalogue holds
        self.workers = WorkerPool("coffer-work", 4)
        self.knowledge: KnowledgeBase | None = None    # opened once a source exists or memory is on
        self.own_requests: dict[str, dict] = {}       # Coffer's own requests to the client (sampling for ask)
        self.knowledge_tools: list[dict] = []
        self.discovery_deadline = 0.0
        self._reported_missing = False
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._data_version = vault.data_version()
        embedder = Embedder.from_settings(self.settings, vault.secrets)
        self.semantic = SemanticRanker(embedder, vault.path, float(self.settings["embedder_timeout"])) \
            if embedder else None
        self.handlers = {
            "initialize": self._initialize, "ping": lambda _id, _p: {},
            "tools/list": self._tools_list, "tools/call": self._tools_call,
            "prompts/list": self._prompts_list, "prompts/get": self._prompts_get,
            "resources/list": self._resources_list, "resources/templates/list": self._templates_list,
            "resources/read": self._resources_read,
            "resources/subscribe": self._subscription("resources/subscribe"),
            "resources/unsubscribe": self._subscription("resources/unsubscribe"),
            "completion/complete": self._complete,
            "logging/setLevel": self._set_level,
        }
        self.modern_handlers = {method: self.handlers[method] for method in MODERN_CLIENT_METHODS
                                if method in self.handlers}
        self.modern_handlers.update({"server/discover": self._discover, "subscriptions/listen": self._listen})

    # -- the client stream ---------------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        """Queue one message for the client (written at the end of the current burst, or now).  Never raises: a
        reply that cannot be encoded is replaced by an error reply to the same id."""
        if self.client_era == "modern" and "error" in message:
            message = modern_error(message)
        try:
            data = encode_line(message)
        except EncodeError as exc:
            msg_id = message.get("id")
            if "method" in message or not valid_request_id(msg_id):
                log.warning("dropped a message to the client that cannot be encoded: %s", exc)
                return
            log.warning("a reply could not be encoded (%s); the client gets an error instead", exc)
            data = encode_line(rpc_error(msg_id, INTERNAL_ERROR, "Internal error: the reply is not encodable JSON"))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("coffer -> client: %s", _trace(data))
        with self.out_lock:
            self._unsent.append(data)
            self._unsent_bytes += len(data)
            full = self._unsent_bytes > self.FLUSH_BYTES  # a burst's replies are held, but not without bound
        if full or not defer_to_burst_end(self, self._write_unsent):
            self._write_unsent()

    def _write_unsent(self) -> None:
        with self.out_lock:
            if not self._unsent:
                return  # another thread's write took it along
            data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
            self._unsent.clear()
            self._unsent_bytes = 0
            if self._client_gone.is_set():
                return
            try:
                self.out.write(data)
                self.out.flush()
                return
            except (OSError, ValueError):
                self._client_gone.set()
        self._lost_client()

    def _lost_client(self) -> None:
        """The client closed its end (EPIPE): nobody can read an answer any more, so stop working for it."""
        log.info("the client closed its end of the connection; stopping its calls")
        with self.lock:
            inflight, self.inflight = list(self.inflight.values()), {}
        for entry in inflight:
            entry.upstream.cancel(entry.ticket, "the client went away")
        if self.on_client_gone is not None:
            start_thread(self.on_client_gone, "coffer-client-gone")

    def serve(self, stream) -> None:
        """Read the client until EOF.  Every line gets an answer or is a notification; nothing ends the session
        but the client closing stdin (or a signal).  A line over max_message_bytes is answered with an error
        and skipped as it arrives, never held."""
        try:
            self.vault.prune()
        except (sqlite3.Error, CofferError) as exc:  # a busy or read-only vault must not stop the session
            log.warning("retention pruning skipped: %s", exc)
        self.configs = self._serving(self.vault.servers(), report=True)
        self.remembered = self.vault.remembered_lists() if self.remember else {}
        self._update_knowledge()
        start_thread(self._tick, "coffer-ticker")
        read = getattr(stream, "read1", stream.read)
        for lines in read_line_bursts(read, max_line=int(self.settings["max_message_bytes"])):
            if self._client_gone.is_set():
                break
            handle_burst(lines, self.handle_line)

    def _serving(self, servers: list[dict], report: bool = False) -> dict[str, dict]:
        """The configs this session runs: enabled, undamaged (and among --only); notes the disabled ones, so a
        call to their tools can say how to enable them."""
        configs = {}
        self.disabled_servers = {c["name"] for c in servers if not c["enabled"] and not c["damaged"]}
        for config in servers:
            if self.only is not None and config["name"] not in self.only:
                continue
            if config["damaged"]:
                if report:
                    log.warning("server %s has a damaged definition in coffer.db (%s) and is not started; fix it "
                                "with `coffer remove %s` and `coffer add` again", config["name"], config["damaged"],
                                config["name"])
            elif config["enabled"]:
                configs[config["name"]] = config
        return configs

    def _update_knowledge(self) -> bool:
        """Open the knowledge base when a source exists or memory is on (its tools are listed only then);
        True when the tools a client is shown changed."""
        memory = self.settings["memory"] == "on"
        try:
            with self.vault_lock:
                row = self.vault.db.execute("SELECT count(*) FROM knowledge_sources WHERE kind='folder'").fetchone()
            has_sources = bool(row and row[0])
        except sqlite3.Error:
            has_sources = False  # no knowledge table yet: nothing was ever added
        if (has_sources or memory) and self.knowledge is None:
            try:
                self.knowledge = KnowledgeBase(self.vault.path, self.vault.home,
                                               embedder=Embedder.from_settings(self.settings, self.vault.secrets),
                                               query_timeout=float(self.settings["embedder_timeout"]))
                self.knowledge.start_watcher()
            except (sqlite3.Error, CofferError, OSError) as exc:
                log.warning("knowledge and memory unavailable: %s", exc)
                self.knowledge = None
        if self.knowledge is not None:
            self.knowledge.memory_enabled = memory
        tools = ([ASK_TOOL_DEFINITION] if has_sources or memory else []) + ([REMEMBER_TOOL_DEFINITION] if memory
                                                                            else [])
        changed = [t["name"] for t in tools] != [t["name"] for t in self.knowledge_tools]
        self.knowledge_tools = tools if self.knowledge is not None else []
        return changed

    def handle_line(self, line) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("client -> coffer: %s", _trace(line))
        if isinstance(line, OversizedLine):
            limit = int(self.settings["max_message_bytes"])
            self.send(rpc_error(request_id_in(line.head), INVALID_REQUEST,
                                f"Invalid Request: a message of {line.size} bytes is larger than max_message_bytes "
                                f"({limit})"))
            return
        if not line.strip():
            return
        if line.lstrip()[:1] == b"[" and line.count(b"{") > self.MAX_BATCH:
            self.send(rpc_error(None, INVALID_REQUEST, f"Invalid Request: a batch of more than {self.MAX_BATCH} "
                                                       "messages is refused unread"))
            return
        try:
            message = decode_json(line)
        except ValueError as exc:
            self.send(rpc_error(None, PARSE_ERROR, f"Parse error: {exc}"[:200]))
            return
        if isinstance(message, list):  # JSON-RPC batches (dropped by MCP 2025-06-18): answer each element
            if not message:
                self.send(rpc_error(None, INVALID_REQUEST, "Invalid Request: empty batch"))
            for item in message:
                self.dispatch(item)
            return
        self.dispatch(message)

    def dispatch(self, message) -> None:
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            msg_id = message.get("id") if isinstance(message, dict) else None
            self.send(rpc_error(msg_id if valid_request_id(msg_id) else None, INVALID_REQUEST,
                                "Invalid Request: expected a JSON-RPC 2.0 object"))
            return
        method = message.get("method")
        has_id = "id" in message
        msg_id = message.get("id")
        if method is None and ("result" in message or "error" in message):
            if valid_request_id(msg_id):
                self._client_response(message)
            return  # JSON-RPC never answers a response, even a malformed one
        if has_id and not valid_request_id(msg_id):
            self.send(rpc_error(None, INVALID_REQUEST, "Invalid Request: id must be a string or an integer"))
            return
        if method is None:
            if has_id:
                self.send(rpc_error(msg_id, INVALID_REQUEST, "Invalid Request: no method"))
            return
        if not isinstance(method, str):
            if has_id:
                self.send(rpc_error(msg_id, INVALID_REQUEST, "Invalid Request: method must be a string"))
            return
        params = message.get("params")
        if params is not None and not isinstance(params, dict):
            if has_id:
                self.send(rpc_error(msg_id, INVALID_PARAMS, "Invalid params: params must be an object"))
            return
        params = params or {}
        if not has_id:
            self._client_notification(method, params)
            return
        if self.client_era is None and (method == "server/discover" or is_enveloped(params)):
            self.client_era = "modern"  # the spec's rule: the first request decides, once per connection
        if self.client_era == "modern":
            self._dispatch_modern(msg_id, method, params)
            return
        if is_enveloped(params):
            self.send(rpc_error(msg_id, INVALID_REQUEST, "this connection serves the handshake protocol era; "
                                "requests carrying the 2026-07-28 envelope are not accepted on it"))
            return
        handler = self.handlers.get(method)
        if handler is None:
            self.send(rpc_error(msg_id, METHOD_NOT_FOUND, f"Method not found: {method[:200]}"))
            return
        if not self.initialized and method not in ("initialize", "ping"):
            self.send(rpc_error(msg_id, INVALID_REQUEST, "Invalid Request: send initialize first"))
            return
        self._answer(msg_id, method, lambda: handler(msg_id, params))

    def _answer(self, msg_id, method: str, work) -> None:
        """Run ``work`` and send its result; errors become JSON-RPC errors.  None means "answered later"."""
        try:
            result = work()
        except RpcError as exc:
            self.send(rpc_error(msg_id, exc.code, exc.message, exc.data))
            return
        except Exception:  # noqa: BLE001 - a Coffer bug must cost one request, not the session
            log.exception("internal error in %s", method)
            self.send(rpc_error(msg_id, INTERNAL_ERROR, f"Internal error in {method}"))
            return
        if result is not None:
            self._respond(msg_id, method, result)

    def _respond(self, msg_id, method: str, result: dict, wrapped: bool = False) -> None:
        """Send a result in the client's era: a 2026-07-28 client gets resultType, Coffer's serverInfo and cache
        hints; a handshake-era client never sees 2026 fields, and gets non-object structuredContent wrapped (a
        2025 client rejects anything else), as it got the tool's outputSchema wrapped (``wrapped``)."""
        if self.client_era == "modern":
            try:
                result = shape_modern_result(method, result)
            except RpcError as exc:
                self.send(rpc_error(msg_id, exc.code, exc.message, exc.data))
                return
        elif wrapped or "resultType" in result or (method == "tools/call" and "structuredContent" in result and
                                                   not isinstance(result["structuredContent"], dict)):
            try:
                result = shape_handshake_result(method, result, wrapped)
            except ValueError as exc:
                self.send(rpc_error(msg_id, INTERNAL_ERROR, f"the upstream's answer cannot be bridged: {exc}"))
                return
        self.send(rpc_result(msg_id, result))


    # -- lifecycle -----------------------------------------------------------------------------------------
    def _initialize(self, msg_id, params):
        """The handshake era's session start (2025-11-25 and earlier)."""
        if self.initialized:
            raise RpcError(INVALID_REQUEST, "Invalid Request: already initialized")
        capabilities = params.get("capabilities")
        if capabilities is not None and not isinstance(capabilities, dict):
            raise RpcError(INVALID_PARAMS, "'capabilities' must be an object")
        self.protocol_version = negotiate_version(params.get("protocolVersion"))
        info = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else {}
        self.client_era = "handshake"
        self._begin_session(capabilities or {}, info)
        return {"protocolVersion": self.protocol_version, "capabilities": self.advertised,
                "serverInfo": coffer_server_info(), "instructions": self.instructions()}

    def _begin_session(self, capabilities: dict, client_info: dict) -> None:
        """What the client's first request starts, in either era: its upstreams (they need the client's
        capabilities and identity), the catalogue remembered from last time, the usage behind budgeted lists."""
        self.client_capabilities = capabilities
        self.client_info = client_info
        self.client_name = str(client_info.get("name") or "unknown")[:64]
        try:
            with self.vault_lock:
                self.usage = self.vault.tool_usage()
        except sqlite3.Error as exc:
            log.warning("tool usage unavailable (%s); a budgeted list falls back to catalogue order", exc)
        self.discovery_deadline = time.monotonic() + float(self.settings["discovery_timeout"])
        for config in self.configs.values():
            self._add_upstream(config)
        if any(up.remembered for up in list(self.upstreams.values())):
            self.rebuild()  # remembered tools are listable at once; before `initialized`, so no notification
        self.initialized = True
        self.advertised = self._advertised_capabilities()

    def instructions(self) -> str:
        """What the client's model reads about Coffer: how to find tools, what is unlisted, failing or waiting."""
        instructions = INSTRUCTIONS
        unlisted = len(self.catalogue.tools) + 1 + len(self.knowledge_tools) - len(self.listed_tools())
        if unlisted > 0:
            instructions += (f" To fit this client, {unlisted} tools are not listed; every one is still callable "
                             f"by name and {SEARCH_TOOL} finds them.")
        if self.knowledge_tools:
            instructions += (f" {ASK_TOOL} searches the user's own notes and docs"
                             + (f", and {REMEMBER_TOOL} keeps a fact for every agent" if len(self.knowledge_tools) > 1
                                else "") + ".")
        failed = [c["name"] for c in self.configs.values() if c.get("status") == "failed"]
        login = [name for name in failed if "needs login" in (self.configs[name].get("status_detail") or "")]
        if login:
            instructions += (" Waiting for the user to log in (in a terminal: coffer auth NAME): "
                             + ", ".join(login)[:200] + ".")
        failed = [name for name in failed if name not in login]
        if failed:
            instructions += " Failed at their last start: " + ", ".join(failed)[:200] + "."
        return instructions[:800]

    # -- the 2026-07-28 era (stateless: every request carries its envelope) ----------------------------------
    def _dispatch_modern(self, msg_id, method: str, params: dict) -> None:
        """One request of a 2026-07-28 client: the envelope checked in the spec's order, the session started by
        the first request, then the same handlers as the handshake era; results get their 2026 shape in send."""
        if method == "initialize":
            version = params.get("protocolVersion")
            self.send(rpc_error(msg_id, UNSUPPORTED_PROTOCOL_VERSION, "this connection serves the 2026-07-28 protocol;"
                                " the initialize handshake is not accepted", {
                                    "supported": list(MODERN_PROTOCOL_VERSIONS),
                                    "requested": version[:100] if isinstance(version, str) else ""}))
            return
        try:
            envelope = parse_envelope(params)
        except RpcError as exc:
            self.send(rpc_error(msg_id, exc.code, exc.message, exc.data))
            return
        handler = self.modern_handlers.get(method)
        if handler is None:
            self.send(rpc_error(msg_id, METHOD_NOT_FOUND, f"Method not found: {method[:200]}"))
            return
        if not self.initialized:
            self.protocol_version = MODERN_PROTOCOL_VERSIONS[-1]
            self._begin_session(envelope.client_capabilities, envelope.client_info or {})
        self._answer(msg_id, method, lambda: handler(msg_id, params))

    def _discover(self, msg_id, params):
        return {"supportedVersions": list(MODERN_PROTOCOL_VERSIONS), "capabilities": self.advertised,
                "instructions": self.instructions()}

    def _listen(self, msg_id, params):
        """subscriptions/listen: acknowledge what Coffer will deliver, then keep the stream open (never answered)
        until the client cancels it; list changes and resource updates go to every stream that asked."""
        wanted = parse_listen_filter(params)
        offered = {kind for kind in ("tools", "prompts", "resources") if kind in self.advertised}
        resources = self.advertised.get("resources")
        honoured = wanted.honoured(offered, bool(isinstance(resources, dict) and resources.get("subscribe")))
        routes = [(uri, self.catalogue.route_resource(uri)) for uri in honoured.uris]
        honoured = honoured._replace(uris=tuple(uri for uri, route in routes if route is not None))
        with self.lock:
            self.listen_streams[msg_id] = honoured
        self.send(listen_frame("notifications/subscriptions/acknowledged", msg_id,
                               {"notifications": honoured.wire()}))
        for uri, route in routes:
            if route is not None:
                self._subscribe_upstream(route, True)
        return None

    def _subscribe_upstream(self, route: Route, on: bool) -> None:
        """Have an upstream send resources/updated for a URI (handshake-era servers only: a 2026-07-28 server
        would need a listen stream of its own for resources, which Coffer does not open yet)."""
        upstream, original = route
        with self.lock:
            subscribed = self.subscriptions[upstream.name]
            was = original in subscribed
            subscribed.add(original) if on else subscribed.discard(original)
        if was != on and upstream.era != "modern" and upstream.state == "ready":
            upstream.request("resources/subscribe" if on else "resources/unsubscribe", {"uri": original},
                             lambda *a: None)

    def _advertised_capabilities(self) -> dict:
        """The union of what the upstreams offered when they last started, every list with listChanged.

        Upstreams start only now, after the client's initialize (they need its capabilities), so the union is
        taken from the vault; a server never seen yet could offer anything, so it counts as offering everything.
        """
        known = [c.get("capabilities") for c in self.configs.values()]
        if any(caps is None for caps in known):
            known.append({"prompts": {}, "resources": {"subscribe": True}, "completions": {}, "logging": {}})
        advertised: dict = {"tools": {"listChanged": True}}
        for caps in known:
            for key in ("prompts", "resources", "completions", "logging"):
                if isinstance(caps, dict) and key in caps:
                    advertised.setdefault(key, {})
        for key in ("prompts", "resources"):
            if key in advertised:
                advertised[key]["listChanged"] = True
        if any(isinstance(c, dict) and isinstance(c.get("resources"), dict) and c["resources"].get("subscribe")
               for c in known):
            advertised["resources"]["subscribe"] = True
        return advertised

    def _add_upstream(self, config: dict) -> None:
        caps = {k: v for k, v in self.client_capabilities.items() if k in CLIENT_SIDE_CAPABILITIES}
        with self.lock:  # initialize (client thread) and a vault reload (ticker) may both get here
            if config["name"] in self.upstreams:
                return
            upstream = Upstream(config, self.settings, self, caps, self.protocol_version, self.vault.secrets,
                                self.client_info or None)
            upstream.remembered = self.remembered.pop(config["name"], {})  # only for the first start of a session
            self.upstreams[config["name"]] = upstream
        upstream.start()

    def shutdown(self) -> None:
        """Write the log, stop every upstream (and its descendants).  A second caller (the signal handler, the
        client-gone path) waits for the first to finish instead of cutting it short."""
        if self._stopping.is_set():
            self._stopped.wait(15.0)
            return
        self._stopping.set()
        try:
            # Rows first: a client that closes stdin usually kills its server a few seconds later.
            self.log.flush(3.0)
            threads = [start_thread(up.stop, f"coffer-{up.name}-stop") for up in list(self.upstreams.values())]
            for thread in threads:
                thread.join(6.0)
            if self.knowledge is not None:
                self.knowledge.close()
            self.log.close()
        finally:
            self._stopped.set()

    def _tick(self) -> None:
        last_reload = last_family = time.monotonic()
        while not self._stopping.wait(0.05):
            now = time.monotonic()
            for upstream in list(self.upstreams.values()):
                try:
                    upstream.expire(now)
                except Exception:  # noqa: BLE001 - the ticker guards every timeout; it must not die
                    log.exception("[%s] error while expiring requests", upstream.name)
            try:
                self._release_waiting()
                if self.exchanges:
                    self._expire_exchanges(now)
            except Exception:  # noqa: BLE001
                log.exception("error while answering waiting requests")
            if os.name == "posix" and now - last_family >= 5.0:
                last_family = now
                stdio = [up.transport for up in list(self.upstreams.values())
                         if isinstance(up.transport, StdioTransport) and up.state == "ready"]
                if stdio:
                    try:
                        table = process_table()
                        for transport in stdio:
                            transport.remember_family(table)
                    except Exception:  # noqa: BLE001 - bookkeeping for shutdown; never the ticker's death
                        log.exception("could not read the process table")
            if now - last_reload >= 1.0:
                last_reload = now
                try:
                    self._reload_if_vault_changed()
                except Exception:  # noqa: BLE001 - the ticker also guards every timeout
                    log.exception("could not apply vault changes")

    def _reload_if_vault_changed(self) -> None:
        """Apply `coffer enable/disable/approve/add/remove/config` made while this session runs."""
        with self.vault_lock:
            version = self.vault.data_version()
            if version == self._data_version:
                return
            self._data_version = version
            states = self.vault.capability_states()
            configs = self._serving(self.vault.servers())
            settings = self.vault.settings()
            changed = states != self.states
            self.states = states
        if self._update_knowledge():
            self._force_tools_notice = True
            changed = True
        keys = ("transport", "command", "url", "env", "headers", "cwd", "timeout", "policy", "inherit_env", "oauth")
        if settings != self.settings:
            if any(settings.get(k) != self.settings.get(k) for k in set(settings) | set(self.settings)
                   if setting_key(k) == "expose"):
                self._force_tools_notice = True  # the same catalogue, listed differently
            self.settings.update(settings)  # the upstreams share this dict
            for upstream in list(self.upstreams.values()):
                upstream.call_timeout = float(upstream.config.get("timeout") or settings["call_timeout"])
            changed = True
        if not self.initialized:
            self.configs = configs
            return
        for name, upstream in list(self.upstreams.items()):
            old, new = self.configs.get(name), configs.get(name)
            if new is None or any(old.get(k) != new.get(k) for k in keys) or (
                    getattr(upstream, "resolved", None) not in (None, resolution_digest(new, self.vault.secrets))):
                with self.lock:
                    del self.upstreams[name]
                start_thread(upstream.stop, f"coffer-{name}-stop")
                changed = True
        self.configs = configs
        for name, config in configs.items():
            if name not in self.upstreams:
                self._add_upstream(config)
        if changed:
            self.rebuild()

    # -- events from upstreams -----------------------------------------------------------------------------
    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        try:
            with self.vault_lock:
                states = self.vault.sync_capabilities(upstream.name, kind, items, upstream.rejected.get(kind))
                for name, state in states.items():
                    self.states[(upstream.name, kind, name)] = state
        except (sqlite3.Error, CofferError) as exc:
            log.warning("[%s] could not record its %ss in the vault: %s", upstream.name, kind, exc)
            if upstream.config.get("policy") == "disabled":  # fail closed: unrecorded means not allowed
                with self.vault_lock:
                    for name in items:
                        self.states.setdefault((upstream.name, kind, name), CapabilityState(False))
        if notify:
            self.rebuild()

    def on_ready(self, upstream: Upstream) -> None:
        self._remember_transport(upstream)
        if upstream.era != upstream.config.get("era"):
            try:
                with self.vault_lock:
                    self.vault.record_era(upstream.name, upstream.era)
                upstream.config["era"] = upstream.era
            except (sqlite3.Error, CofferError) as exc:
                log.debug("[%s] could not remember its protocol era: %s", upstream.name, exc)
        counts = {kind: len(items) for kind, items in upstream.lists.items() if items}
        info = upstream.server_info
        who = f"{info.get('name', '?')} {info.get('version', '')}".strip() + ": " if info else ""
        self._record_status(upstream, "ready",
                            who + (", ".join(f"{n} {k}s" for k, n in counts.items()) or "no capabilities"),
                            upstream.capabilities)
        if self.log_level and "logging" in upstream.capabilities:
            self._level_for(upstream, self.log_level)
        restarted = upstream.spawns > 1
        if restarted:
            with self.lock:
                uris = sorted(self.subscriptions.get(upstream.name, ()))
            for uri in uris if upstream.era != "modern" else ():
                upstream.request("resources/subscribe", {"uri": uri}, lambda *a: None)
        try:
            self.rebuild(force=restarted)
        finally:  # even a failed rebuild must not keep calls waiting for this upstream
            self._catalogued[upstream.name] = upstream.ready_at
        self._release_waiting()

    def _remember_transport(self, upstream: Upstream) -> None:
        """Transport auto found what the server speaks: write it down so the next start skips the probe.  The
        running config is updated too, so this gateway does not take the vault change for a new config."""
        detected = getattr(upstream.transport, "detected", None)
        if not detected or upstream.config.get("transport") != "auto":
            return
        with self.vault_lock:  # the running config first, so the reload never takes our own write for an edit
            upstream.config["transport"] = detected
            config = self.configs.get(upstream.name)
            if config is not None:
                config["transport"] = detected
            try:
                self.vault.set_transport(upstream.name, detected)
            except (sqlite3.Error, CofferError) as exc:
                log.warning("[%s] could not remember its transport: %s", upstream.name, exc)

    def on_down(self, upstream: Upstream) -> None:
        with self.lock:  # what the dead process asked of the client can no longer be answered
            stale = [cid for cid, relayed in self.client_requests.items() if relayed.upstream is upstream]
            for cid in stale:
                del self.client_requests[cid]
        for cid in stale:
            self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": cid, "reason": f"upstream '{upstream.name}' went away"}})
        self._record_status(upstream, upstream.state, upstream.last_error or "")
        if upstream.state == "failed":
            self.rebuild()
        self._release_waiting()

    def _record_status(self, upstream: Upstream, status: str, detail: str, capabilities=None) -> None:
        try:
            with self.vault_lock:
                self.vault.record_status(upstream.name, status, detail[:2000], capabilities)
        except (sqlite3.Error, CofferError) as exc:
            log.warning("[%s] could not record status: %s", upstream.name, exc)

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        """Relay one of the notifications an upstream may send (see RELAYED_NOTIFICATIONS), as the client asked:
        log messages at or above its logging level, resource updates only for what it subscribed to."""
        if not self.initialized:
            return
        method = message["method"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if method == "notifications/progress" and self.progress_calls:
            token = params.get("progressToken")
            with self.lock:
                call = self.progress_calls.get(token) if isinstance(token, str) else None
                meta = call.client_params.get("_meta") if call is not None and call.msg_id is not None else None
            if call is not None:
                if not isinstance(meta, dict) or not valid_request_id(meta.get("progressToken")):
                    return  # detached while a question is out, or the current request asked for no progress
                params = {**params, "progressToken": meta["progressToken"]}
        if method == "notifications/message":
            level = params.get("level")
            floor = self.log_level
            if self.client_era == "modern":  # only requests that asked for logs (logLevel) may get them
                with self.lock:
                    asked = [call.log_level for call in self.inflight.values()
                             if call.upstream is upstream and call.log_level]
                floor = min(asked, key=LOG_LEVELS.index) if asked else None
                if floor is None:
                    return
            if level not in LOG_LEVELS or (floor and LOG_LEVELS.index(level) < LOG_LEVELS.index(floor)):
                return
            logger = params.get("logger")
            params = {**params, "logger": f"{upstream.name}/{logger}"[:200] if isinstance(logger, str) and logger
                      else upstream.name}
        elif method == "notifications/resources/updated":
            uri = params.get("uri")
            with self.lock:
                subscribed = isinstance(uri, str) and uri in self.subscriptions.get(upstream.name, ())
            if not subscribed:
                return
            exposed = self.catalogue.exposed_uri(upstream.name, uri)
            self.announce(method, "resources", {**params, "uri": exposed}, uri=exposed)
            return
        elif method == "notifications/cancelled":
            with self.lock:
                ours = next((cid for cid, relayed in self.client_requests.items()
                             if relayed.upstream is upstream and relayed.upstream_id == params.get("requestId")),
                            None)
                if ours is None:
                    return
                del self.client_requests[ours]
            params = {**params, "requestId": ours}
        elif method == "notifications/elicitation/complete" and ("elicitation" not in self.client_capabilities
                                                                 or self.client_era == "modern"):
            return
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def on_request(self, upstream: Upstream, message: dict) -> None:
        """A server->client request (sampling, elicitation, roots): relay it under an id of Coffer's own to a
        handshake-era client; park it as an input_required round for a 2026-07-28 client."""
        if self.client_era == "modern":
            self._park(upstream, message)
            return
        needed = SERVER_REQUEST_NEEDS[message["method"]]
        if needed not in self.client_capabilities:
            upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND,
                                       f"the connected client does not support {needed}"))
            return
        params = message.get("params")
        with self.lock:
            crowded = sum(1 for relayed in self.client_requests.values() if relayed.upstream is upstream) >= 64
            if not crowded:
                self._client_request_seq += 1
                ours = f"coffer-{self._client_request_seq}"
                self.client_requests[ours] = RelayedRequest(upstream, upstream.generation, message["id"])
        if crowded:  # a server asking faster than a person can answer: it waits, nothing piles up here
            upstream.respond(rpc_error(message["id"], INTERNAL_ERROR, "too many requests are waiting for the "
                                                                      "client's answer"))
            return
        relayed = {"jsonrpc": "2.0", "id": ours, "method": message["method"]}
        if isinstance(params, dict):
            relayed["params"] = params
        self.send(relayed)

    def _client_response(self, message: dict) -> None:
        with self.lock:
            own = self.own_requests.pop(message["id"], None)
            relayed = self.client_requests.pop(message["id"], None) if own is None else None
        if own is not None:
            own["reply"] = normalized_reply(message)
            own["done"].set()
            if own.get("callback") is not None:
                own["callback"](own["reply"])
            return
        if relayed is not None and relayed.upstream.generation == relayed.generation:
            # (a restarted server never asked this; its answer is dropped)
            answer = normalized_reply(message)
            answer["id"] = relayed.upstream_id
            relayed.upstream.respond(answer)

    def _client_notification(self, method: str, params: dict) -> None:
        if method == "notifications/cancelled":
            request_id = params.get("requestId")
            with self.lock:
                entry = self.inflight.pop(request_id, None) if valid_request_id(request_id) else None
                stream = self.listen_streams.pop(request_id, None) if valid_request_id(request_id) else None
                if entry is not None:
                    entry.done = True
                    self.progress_calls.pop(entry.progress_token, None)
                    if entry.exchange is not None:
                        self.exchanges.pop(entry.exchange, None)
            if stream is not None:
                still = {uri for other in list(self.listen_streams.values()) for uri in other.uris}
                for uri in set(stream.uris) - still:
                    route = self.catalogue.route_resource(uri)
                    if route is not None:
                        self._subscribe_upstream(route, False)
            if entry is not None:
                reason = params.get("reason")
                if entry.upstream.cancel(entry.ticket, reason[:200] if isinstance(reason, str) and reason
                                         else "cancelled by the client"):
                    self.log.record(self.client_name, entry.upstream.name, entry.capability, entry.kind,
                                    entry.started, "cancelled", "cancelled by the client")
        elif method == "notifications/roots/list_changed":
            for upstream in list(self.upstreams.values()):
                if upstream.state == "ready":
                    upstream.notify(method)

    # -- the catalogue -------------------------------------------------------------------------------------
    def rebuild(self, force: bool = False) -> None:
        """Swap in a fresh catalogue (and search index); tell the client which lists changed.

        Concurrent requests coalesce: when several upstreams come up at once, a caller whose request is covered
        by a build that started after it returns as soon as that build is done, instead of building again.
        """
        with self.lock:
            self._rebuilds_wanted += 1
            wanted = self._rebuilds_wanted
            self._force_tools_notice = self._force_tools_notice or force
        with self._rebuild_lock:
            if self._rebuilds_done >= wanted:
                return
            with self.lock:
                self._rebuilds_done = self._rebuilds_wanted
                force, self._force_tools_notice = self._force_tools_notice, False
            live = [up for up in list(self.upstreams.values()) if up.state not in ("failed", "stopped")]
            catalogue = Catalogue(live, self.states, self.settings["name_max_length"])
            old, new = self._fingerprint, catalogue.fingerprint()
            self.catalogue, self._fingerprint = catalogue, new
            if self.semantic is not None:
                self.semantic.refresh(catalogue.tools)
            if not self.initialized:
                return
            for key in ("tools", "prompts", "resources"):
                if key in self.advertised and (old[key] != new[key] or (force and key == "tools")):
                    self.announce(f"notifications/{key}/list_changed", key)

    def announce(self, method: str, key: str, params: dict | None = None, uri: str | None = None) -> None:
        """A change notification in the client's era: bare for a handshake-era client; for a 2026-07-28 client one
        frame per listen stream that asked for it, tagged with that stream (never a bare one)."""
        if self.client_era != "modern":
            self.send({"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})})
            return
        with self.lock:
            streams = [sid for sid, wanted in self.listen_streams.items()
                       if (uri in wanted.uris if uri is not None else wanted.wants(key))]
        for sid in streams:
            self.send(listen_frame(method, sid, params))

    def _discovering(self, kind: str | None = None) -> list[str]:
        """Upstreams still starting; with ``kind``, only those with no remembered list of that kind.  An upstream
        counts as started once its lists are in the catalogue (on_ready's rebuild), not when it turns ready:
        the ticker may release a waiting call in between, and it must find the upstream's tools."""
        return [up.name for up in list(self.upstreams.values())
                if up.state not in ("failed", "stopped")
                and (not up.ready_at or self._catalogued.get(up.name) != up.ready_at)
                and not (kind and kind in up.remembered)]

    def _after_discovery(self, msg_id, work, background: bool = False, kind: str | None = None,
                         method: str = "tools/call") -> None:
        """Run ``work`` once every upstream has been discovered (or, for ``kind``, is remembered from its last
        start) or the discovery budget is spent.

        Answers at once when nothing is pending; otherwise the request waits in a list, costing no thread, and is
        answered by the worker pool when its upstreams are up or the deadline passes (``_release_waiting``), so
        the client's other requests are never held up behind a slow server.  ``background`` work (a search that
        may wait for its embedding) always goes to the pool, off the client's reader thread.
        """
        if not self._discovering(kind) or time.monotonic() >= self.discovery_deadline:
            if not background:
                return work()
            self.workers.submit(self._answer, msg_id, method, work)
            return None
        with self.lock:
            self._waiting.append(Waiting(msg_id, work, kind, method))
        return None

    def _release_waiting(self) -> None:
        """Hand the waiting requests whose wait is over to the worker pool (from the ticker and upstream events)."""
        if not self._waiting:
            return
        now = time.monotonic()
        expired = now >= self.discovery_deadline
        with self.lock:
            done, still = [], []
            for waiting in self._waiting:
                if waiting.server is not None:
                    over = now >= waiting.deadline or waiting.server not in self._discovering()
                else:
                    over = expired or not self._discovering(waiting.kind)
                (done if over else still).append(waiting)
            self._waiting = still
        if not done:
            return
        missing = self._discovering() if expired else []
        if missing and not self._reported_missing:
            self._reported_missing = True
            log.warning("still starting after %gs: %s; their tools will be announced to the client when they are "
                        "up", self.settings["discovery_timeout"], ", ".join(missing))
        for waiting in done:
            self.workers.submit(self._answer, waiting.msg_id, waiting.method, waiting.work)

    def listed_tools(self) -> list[dict]:
        """The tools this client is shown (see expose_mode); the rest stay callable and searchable."""
        tools = self.catalogue.tools if self.client_era == "modern" else self.catalogue.handshake_tools
        builtins = [SEARCH_TOOL_DEFINITION] + self.knowledge_tools
        mode = expose_mode(self.settings, client_family(self.client_name))
        if mode == "search":
            return builtins
        if mode.startswith("budget:"):
            tools = budget_tools(tools, int(mode.partition(":")[2]) - len(builtins) + 1, self.usage)
        return builtins + tools

    def _tools_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"tools": self.listed_tools()}, kind="tool", method="tools/list")

    def _prompts_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"prompts": self.catalogue.prompts}, kind="prompt",
                                     method="prompts/list")

    def _resources_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"resources": self.catalogue.resources},
                                     method="resources/list")

    def _templates_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"resourceTemplates": self.catalogue.templates},
                                     method="resources/templates/list")

    # -- routed requests -----------------------------------------------------------------------------------
    def _forward(self, msg_id, upstream: Upstream, method: str, params: dict, capability: str, kind: str | None,
                 started: float, client_params: dict | None = None) -> None:
        """Send a client request upstream under the upstream's own id; its reply goes straight to the client
        (``_deliver``).  ``params`` are the upstream's (its own names); ``client_params`` what the client sent."""
        call = ForwardedCall(upstream, method, capability, kind, started, msg_id,
                             client_params if client_params is not None else params, params)
        if self.client_era == "modern" and method in INPUT_REQUIRED_METHODS:
            # A retry is a new request with a new progress token: upstream the call keeps one token of Coffer's,
            # and its progress goes to whichever client request currently stands for the call.
            meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
            if valid_request_id(meta.get("progressToken")):
                with self.lock:
                    self._client_request_seq += 1
                    call.progress_token = f"coffer-progress-{self._client_request_seq}"
                    self.progress_calls[call.progress_token] = call
                call.upstream_params = {**params, "_meta": {**meta, "progressToken": call.progress_token}}
            with self.lock:
                orphans = self.orphan_questions.pop(upstream.name, [])
            if orphans:  # the upstream asked before any call could carry the question: this one carries it first
                with self.lock:
                    for question in orphans:
                        self._client_request_seq += 1
                        call.questions[f"coffer-{self._client_request_seq}"] = question
                    self.inflight[msg_id] = call
                self._ask_parked(call)
                return
        self._send_call(call)

    def _send_call(self, call: ForwardedCall) -> None:
        call.sent = True

        def on_reply(response, failure, text):
            with self.lock:
                if call.msg_id is None:   # a question is out with the client: the retry will take this reply
                    call.held = (response, failure, text)
                    return
                msg_id, call.done = call.msg_id, True
                if self.inflight.get(msg_id) is call:
                    del self.inflight[msg_id]
                if call.progress_token is not None and not call.exchange:
                    self.progress_calls.pop(call.progress_token, None)
            self._deliver(call, msg_id, response, failure, text)

        # In flight before it is sent: the upstream may ask the client something (sampling, elicitation) the
        # moment it reads the call, and that question needs this call to carry it to a 2026-07-28 client.
        call.ticket = Ticket()
        with self.lock:
            if call.msg_id is not None:
                self.inflight[call.msg_id] = call
        if call.upstream.request(call.method, call.upstream_params, on_reply, ticket=call.ticket) is None:
            return  # failed at once: on_reply has answered and cleared it
        with self.lock:
            parked = call.msg_id is None and not call.done
        if parked:  # a question went out before the request had its id: pause its timeout now
            call.upstream.hold(call.ticket)

    def _deliver(self, call: ForwardedCall, msg_id, response, failure, text) -> None:
        """An upstream's answer to ``call``, to the client request ``msg_id``: logged (who/when/how long/outcome,
        queued before the client sees it, so the log's order is the order of causes), shaped for the client's era;
        an input_required answer from a 2026-07-28 upstream is bridged instead."""
        client, upstream, method = self.client_name, call.upstream, call.method
        if response is None:
            if call.kind:
                self.log.record(client, upstream.name, call.capability, call.kind, call.started, failure, text[:200])
            if method == "tools/call":
                self._respond(msg_id, method, tool_error_result(f"coffer: {text}"))
            else:
                self.send(rpc_error(msg_id, REQUEST_TIMEOUT if failure == "timeout" else UPSTREAM_ERROR, text))
            return
        result = response.get("result")
        if result is not None and result.get("resultType") == "input_required" and method in INPUT_REQUIRED_METHODS:
            self._input_required(call, msg_id, result)
            return
        if method == "tools/call" and result is not None and not isinstance(result.get("content"), list):
            result["content"] = []  # required by every client's schema; a bad one would fail the whole reply
        if call.kind:
            if "error" in response:
                self.log.record(client, upstream.name, call.capability, call.kind, call.started, "error",
                                f"upstream returned JSON-RPC error {response['error']['code']}")
            elif method == "tools/call" and result.get("isError") is True:
                self.log.record(client, upstream.name, call.capability, call.kind, call.started, "error",
                                "tool reported isError")
            else:
                self.log.record(client, upstream.name, call.capability, call.kind, call.started, "ok")
        if result is None:
            response["id"] = msg_id  # a fresh, normalized reply (see normalized_reply): Coffer's to change
            self.send(response)
        else:
            self._respond(msg_id, method, result, call.capability in self.catalogue.wrapped_outputs)

    # -- multi-round-trip requests: an upstream that needs the client mid-call ------------------------------
    def _input_required(self, call: ForwardedCall, msg_id, result: dict) -> None:
        """A 2026-07-28 upstream answered input_required.  A modern client gets it with the upstream's
        requestState sealed inside Coffer's own (so the retry reaches the same upstream, byte for byte); a
        handshake-era client has the questions asked as real requests, and Coffer retries for it."""
        try:
            round_ = parse_input_required(result)
        except ValueError as exc:
            self._fail_call(call, msg_id, f"the upstream asked for input in a way Coffer cannot relay: {exc}")
            return
        if self.client_era == "modern":
            sealed = self.sealer.seal(call.method, call.client_params,
                                      {"s": call.upstream.name, "u": round_.request_state})
            self._respond(msg_id, call.method, {**result, "requestState": sealed})
            return
        call.rounds += 1
        if call.rounds > 10:
            self._fail_call(call, msg_id, "the upstream kept asking for input (more than 10 rounds)")
            return
        answers: dict = {}
        outstanding = set(round_.requests)

        def retry():
            params = {**call.upstream_params, "inputResponses": answers}
            if round_.request_state is not None:
                params["requestState"] = round_.request_state
            else:
                params.pop("requestState", None)
            with self.lock:
                call.upstream_params, call.msg_id, call.done = params, msg_id, False
            self._send_call(call)

        if not outstanding:  # only a requestState: the server asks to be retried (load shedding)
            threading.Timer(min(0.25, 0.05 * 2 ** call.rounds), retry).start()
            return
        for key, request in round_.requests.items():
            need = SERVER_REQUEST_NEEDS[request["method"]]
            if need not in self.client_capabilities:
                self._fail_call(call, msg_id, f"the upstream needs {need}, which this client did not declare")
                return

            def answered(reply, key=key):
                if "error" in reply or not isinstance(reply.get("result"), dict):
                    error = reply.get("error") or {}
                    self._fail_call(call, msg_id, f"the client refused the upstream's question: "
                                                  f"{printable(str(error.get('message', 'no answer')))[:200]}")
                    return
                with self.lock:
                    answers[key] = reply["result"]
                    outstanding.discard(key)
                    complete = not outstanding
                if complete:
                    retry()

            self.request_client_async(request["method"], request["params"], answered)

    def _fail_call(self, call: ForwardedCall, msg_id, text: str) -> None:
        if call.kind:
            self.log.record(self.client_name, call.upstream.name, call.capability, call.kind, call.started, "error",
                            text[:200])
        if call.method == "tools/call":
            self._respond(msg_id, call.method, tool_error_result(f"coffer: {text}"))
        else:
            self.send(rpc_error(msg_id, INTERNAL_ERROR, text))

    def _park(self, upstream: Upstream, message: dict) -> None:
        """A handshake-era upstream asks a 2026-07-28 client something (sampling, elicitation, roots) mid-call:
        the client can be asked only as the answer to one of its calls, so the oldest call in flight to that
        upstream answers input_required with the question and a sealed requestState; the upstream's request waits
        (its call's timeout paused) until the client retries with the answer, or mrtr_ttl passes."""
        method, params = message["method"], message.get("params") if isinstance(message.get("params"), dict) else {}
        with self.lock:
            carriers = [c for c in self.inflight.values() if c.upstream is upstream and c.msg_id is not None
                        and c.method in INPUT_REQUIRED_METHODS]
            detached = [c for c in self.exchanges.values() if c.upstream is upstream]
            carrier = min(carriers, key=lambda c: c.started) if carriers else (detached[0] if detached else None)
        if carrier is None:  # no call to carry it yet: the next call to this upstream will ask it first
            with self.lock:
                orphans = self.orphan_questions[upstream.name]
                if len(orphans) < 8:
                    orphans.append(Question(message["id"], method, params))
                    return
            upstream.respond(rpc_error(message["id"], INTERNAL_ERROR, "Coffer: too many questions are waiting for "
                                       "this 2026-07-28 client"))
            return
        need = missing_capability(method, params, carrier.capabilities)
        if need is not None:
            upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "the client does not support this request"))
            with self.lock:
                msg_id = carrier.msg_id
                if msg_id is None or self.inflight.get(msg_id) is not carrier:
                    return
                del self.inflight[msg_id]
                carrier.done = True
            upstream.cancel(carrier.ticket, "the client cannot answer what the tool asked")
            if carrier.kind:
                self.log.record(self.client_name, upstream.name, carrier.capability, carrier.kind, carrier.started,
                                "error", f"needs the client's {', '.join(need)}")
            self.send(rpc_error(msg_id, MISSING_REQUIRED_CLIENT_CAPABILITY, "the tool needs a client capability "
                                "this request did not declare", {"requiredCapabilities": need}))
            return
        with self.lock:
            self._client_request_seq += 1
            carrier.questions[f"coffer-{self._client_request_seq}"] = Question(message["id"], method, params)
        self._ask_parked(carrier)

    def _ask_parked(self, call: ForwardedCall) -> None:
        """Answer the call's current client request with the questions not yet asked (if it has one waiting)."""
        with self.lock:
            msg_id = call.msg_id
            fresh = {key: q for key, q in call.questions.items() if not q.asked}
            if msg_id is None or not fresh:
                return
            for question in fresh.values():
                question.asked = True
            if self.inflight.get(msg_id) is call:
                del self.inflight[msg_id]
            call.msg_id = None
            if call.exchange is None:
                self._client_request_seq += 1
                call.exchange = f"x{self._client_request_seq}"
            self.exchanges[call.exchange] = call
            call.parked_until = time.monotonic() + float(self.settings["mrtr_ttl"])
        if call.sent:
            call.upstream.hold(call.ticket)
        state = self.sealer.seal(call.method, call.client_params, {"x": call.exchange})
        self._respond(msg_id, call.method, {
            "resultType": "input_required", "requestState": state,
            "inputRequests": {key: {"method": q.method, **({"params": q.params} if q.params or q.method != "roots/list"
                                                            else {})} for key, q in fresh.items()}})

    def _resume(self, msg_id, method: str, params: dict, started: float):
        """A 2026-07-28 client's retry carrying a requestState Coffer sealed: answers for a parked exchange, or
        an upstream's own state to hand back to it, byte for byte."""
        claims = self.sealer.unseal(params.get("requestState"), method, params)
        responses = params.get("inputResponses")
        if responses is not None and not isinstance(responses, dict):
            raise RpcError(INVALID_PARAMS, "'inputResponses' must be an object")
        responses = responses or {}
        if "ask" in claims and self.knowledge is not None:  # coffer__ask's own rounds with the client's model
            arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
            self.workers.submit(self._answer, msg_id, method, lambda: self._ask(
                arguments, started, params, {"claims": claims, "responses": responses}))
            return None
        if "s" in claims:  # a 2026-07-28 upstream's own round: back to it, whatever the catalogue says now
            upstream = self.upstreams.get(claims["s"])
            route = (self.catalogue.tool_routes if method == "tools/call" else self.catalogue.prompt_routes).get(
                params.get("name")) if method != "resources/read" else self.catalogue.route_resource(params["uri"])
            if upstream is None or route is None or route.upstream is not upstream:
                raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
            key = "uri" if method == "resources/read" else "name"
            upstream_params = {k: v for k, v in params.items() if k != "requestState"}
            upstream_params[key] = route.name
            if claims.get("u") is not None:
                upstream_params["requestState"] = claims["u"]
            self._forward(msg_id, upstream, method, upstream_params, params.get(key), "tool" if method == "tools/call"
                          else "prompt" if method == "prompts/get" else "resource", started, params)
            return None
        with self.lock:
            call = self.exchanges.get(claims.get("x"))
            if call is None or call.msg_id is not None:
                call = None
            else:
                answered = {key: q for key, q in call.questions.items() if q.asked and isinstance(
                    responses.get(key), dict)}
                for key in answered:
                    del call.questions[key]
                call.msg_id, call.client_params = msg_id, {**call.client_params, **{
                    k: v for k, v in params.items() if k == "_meta"}}
                if not call.questions:
                    del self.exchanges[call.exchange]
                    call.exchange = None
                held, call.held = call.held, None
                if held is None:
                    self.inflight[msg_id] = call
                else:
                    call.done = True
        if call is None:
            raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
        for key, question in answered.items():
            call.upstream.respond({"jsonrpc": "2.0", "id": question.upstream_id, "result": responses[key]})
        if not call.sent and not call.questions:
            self._send_call(call)  # the questions that came first are answered: now the call itself
            return None
        call.upstream.release(call.ticket)
        if held is not None:
            self._deliver(call, msg_id, *held)
            return None
        for question in call.questions.values():
            question.asked = False  # not answered in this retry: ask again
        self._ask_parked(call)
        return None

    def _expire_exchanges(self, now: float) -> None:
        """A question nobody answered within mrtr_ttl: the upstream's call is cancelled and forgotten."""
        with self.lock:
            stale = [call for call in self.exchanges.values() if call.parked_until <= now]
            for call in stale:
                del self.exchanges[call.exchange]
        for call in stale:
            self.progress_calls.pop(call.progress_token, None)
            for question in call.questions.values():
                call.upstream.respond(rpc_error(question.upstream_id, INTERNAL_ERROR, "the client never answered"))
            call.upstream.cancel(call.ticket, "the client never answered what the tool asked")
            if call.kind:
                self.log.record(self.client_name, call.upstream.name, call.capability, call.kind, call.started,
                                "cancelled", "the client never answered what the tool asked")

    def _deny(self, capability: str, kind: str, started: float):
        """A disabled or quarantined capability: logged as denied, and an error that says what the user can do."""
        server = capability.partition(SEPARATOR)[0] if kind in ("tool", "prompt") else ""
        if capability in self.catalogue.quarantined:
            self.log.record(self.client_name, server, capability, kind, started, "denied",
                            "definition changed; awaiting approval")
            raise RpcError(INVALID_PARAMS, f"{kind} {capability!r} changed its definition since it was approved, so "
                                           f"Coffer holds it back; the user can review the change and allow it "
                                           f"with `coffer approve {capability}`")
        self.log.record(self.client_name, server, capability, kind, started, "denied", f"{kind} is disabled")
        raise RpcError(INVALID_PARAMS, f"{kind} {capability!r} is disabled in Coffer "
                                       f"(run `coffer enable {capability}` to allow it)")

    def _unknown(self, msg_id, name: str, kind: str, started: float, retry):
        """An unknown name: wait out discovery if its server is still starting, else a readable error."""
        server = name.partition(SEPARATOR)[0]
        if retry is not None and server in self._discovering():
            # A call names its server: it waits for that server's start (bounded like the start itself), not
            # just the lists' discovery budget; answering "unknown tool" for a tool that is on its way is wrong.
            upstream = self.upstreams.get(server)
            deadline = started + (upstream.call_timeout if upstream else float(self.settings["call_timeout"]))
            if time.monotonic() < deadline:
                method = "tools/call" if kind == "tool" else "prompts/get"
                with self.lock:
                    self._waiting.append(Waiting(msg_id, retry, None, method, server, deadline))
                return None
        if retry is None and server in self._discovering():
            waited = time.monotonic() - started
            self.log.record(self.client_name, server, name, kind, started, "timeout", "server still starting")
            raise RpcError(REQUEST_TIMEOUT, f"upstream '{server}' was not ready within {waited:.0f}s; {name} "
                                            f"is answered once it has started")
        if server in self.disabled_servers:
            self.log.record(self.client_name, server, name, kind, started, "denied", "server is disabled")
            raise RpcError(INVALID_PARAMS, f"{kind} {name!r} belongs to server {server!r}, which is disabled in Coffer "
                                           f"(run `coffer enable {server}` to allow it)")
        self.log.record(self.client_name, server if server in self.upstreams else "", name, kind, started,
                        "error", f"unknown {kind}")
        hint = f"; call {SEARCH_TOOL} to find tools" if kind == "tool" else ""
        raise RpcError(INVALID_PARAMS, f"Unknown {kind}: {name}{hint}")

    def _tools_call(self, msg_id, params):
        started = time.monotonic()
        name = _require_str(params, "name")
        arguments = params.get("arguments")
        if arguments is not None and not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, "'arguments' must be an object")
        if name == SEARCH_TOOL:
            # With an embedder a query may wait up to embedder_timeout: answer it off the client's reader thread.
            return self._after_discovery(msg_id, lambda: self._search_tools(arguments or {}, started),
                                         background=self.semantic is not None, kind="tool")
        if self.client_era == "modern" and "requestState" in params:
            return self._resume(msg_id, "tools/call", params, started)
        if name in (ASK_TOOL, REMEMBER_TOOL) and any(t["name"] == name for t in self.knowledge_tools):
            work = (lambda: self._ask(arguments or {}, started, params)) if name == ASK_TOOL else (
                lambda: self._remember(arguments or {}, started))
            self.workers.submit(self._answer, msg_id, "tools/call", work)
            return None
        return self._route_named(msg_id, params, name, "tool", "tools/call", started)

    def _prompts_get(self, msg_id, params):
        started = time.monotonic()
        if self.client_era == "modern" and "requestState" in params:
            _require_str(params, "name")
            return self._resume(msg_id, "prompts/get", params, started)
        return self._route_named(msg_id, params, _require_str(params, "name"), "prompt", "prompts/get", started)

    def _route_named(self, msg_id, params, name: str, kind: str, method: str, started: float,
                     retried: bool = False):
        """Send a tool call or prompt fetch to the upstream that owns ``name``, under its original name."""
        catalogue = self.catalogue
        route = (catalogue.tool_routes if kind == "tool" else catalogue.prompt_routes).get(name)
        if route is None:
            if name in catalogue.disabled or name in catalogue.quarantined:
                self._deny(name, kind, started)
            retry = None if retried else (
                lambda: self._route_named(msg_id, params, name, kind, method, started, True))
            return self._unknown(msg_id, name, kind, started, retry)
        upstream, original = route
        self._forward(msg_id, upstream, method, {**params, "name": original}, name, kind, started, params)
        return None

    def _resource_route(self, uri: str, started: float, log_kind):
        catalogue = self.catalogue
        if uri in catalogue.disabled or uri in catalogue.quarantined:
            self._deny(uri, "resource", started)
        route = catalogue.route_resource(uri)
        if route is None:
            blocked = next((text for regex, text in catalogue.blocked_templates if regex.match(uri)), None)
            if blocked is not None:
                self._deny(blocked, "resource", started)
            if log_kind:
                self.log.record(self.client_name, "", uri, log_kind, started, "error", "unknown resource")
            raise RpcError(INVALID_PARAMS, f"Unknown resource: {uri}")
        return route

    def _resources_read(self, msg_id, params):
        started = time.monotonic()
        uri = _require_str(params, "uri")
        if self.client_era == "modern" and "requestState" in params:
            return self._resume(msg_id, "resources/read", params, started)

        def work():
            route = self._resource_route(uri, started, "resource")
            upstream, original = route
            # A templated URI carries the caller's values; the log keeps only what identifies the capability.
            capability = uri if uri in self.catalogue.resource_routes else self.catalogue.template_of(route)
            self._forward(msg_id, upstream, "resources/read", {**params, "uri": original}, capability,
                          "resource", started, params)

        return self._after_discovery(msg_id, work, method="resources/read")

    def _subscription(self, method: str):
        def handler(msg_id, params):
            uri = _require_str(params, "uri")
            upstream, original = self._resource_route(uri, time.monotonic(), None)
            with self.lock:  # remembered so a restarted upstream is subscribed again
                subscribed = self.subscriptions[upstream.name]
                subscribed.add(original) if method == "resources/subscribe" else subscribed.discard(original)
            if upstream.era == "modern":
                return {}  # a 2026-07-28 server has no resources/subscribe (updates need a listen stream of its own)
            self._forward(msg_id, upstream, method, {**params, "uri": original}, uri, None, time.monotonic())
        return handler

    def _complete(self, msg_id, params):
        ref = params.get("ref")
        if not isinstance(ref, dict):
            raise RpcError(INVALID_PARAMS, "'ref' must be an object")
        catalogue = self.catalogue
        if ref.get("type") not in ("ref/prompt", "ref/resource"):
            raise RpcError(INVALID_PARAMS, "ref.type must be 'ref/prompt' or 'ref/resource'")
        key = "name" if ref["type"] == "ref/prompt" else "uri"
        target = ref.get(key)
        if not isinstance(target, str):
            raise RpcError(INVALID_PARAMS, f"ref.{key} must be a string")
        if key == "name":
            route = catalogue.prompt_routes.get(target)
        else:
            route = catalogue.template_by_text.get(target) or catalogue.route_resource(target)
        if route is None:
            raise RpcError(INVALID_PARAMS, f"Unknown completion target: {ref.get(key)}")
        upstream, original = route
        if "completions" not in upstream.capabilities:
            return {"completion": {"values": [], "hasMore": False}}
        self._forward(msg_id, upstream, "completion/complete", {**params, "ref": {**ref, key: original}},
                      str(ref.get(key)), None, time.monotonic())
        return None

    def _set_level(self, msg_id, params):
        level = params.get("level")
        if level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, f"'level' must be one of {', '.join(LOG_LEVELS)}")
        self.log_level = level
        for upstream in list(self.upstreams.values()):
            if upstream.state == "ready" and "logging" in upstream.capabilities:
                self._level_for(upstream, level)
        return {}

    @staticmethod
    def _level_for(upstream: Upstream, level: str) -> None:
        """A handshake-era client's logging level: logging/setLevel to a handshake server, the envelope's logLevel
        on every request to a 2026-07-28 one (which has no setLevel)."""
        if upstream.era == "modern":
            upstream.envelope = upstream.envelope._replace(log_level=level)
        else:
            upstream.request("logging/setLevel", {"level": level}, lambda *a: None)

    # -- built-in tools ------------------------------------------------------------------------------------
    def _search_tools(self, arguments: dict, started: float) -> dict:
        def fail(text):
            self.log.record(self.client_name, RESERVED_SERVER, SEARCH_TOOL, "tool", started, "error", text)
            return tool_error_result(text)

        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return fail("query must be a non-empty string")
        try:
            top_k = bounded_top_k(arguments.get("top_k"))
        except ValueError as exc:
            return fail(str(exc))
        index = self.catalogue.index
        if self.semantic is not None:
            hits, ranker, note = self.semantic.search(index, query, top_k)
        else:
            hits, ranker, note = index.search(query, top_k), "bm25", None
        payload = {
            "tools": [{"name": tool["name"], "description": tool.get("description") or "",
                       "inputSchema": tool.get("inputSchema") or {"type": "object"}, "score": score}
                      for tool, score in hits],
            "total_searched": len(index),
            "ranker": ranker,
        }
        self.log.record(self.client_name, RESERVED_SERVER, SEARCH_TOOL, "tool", started, "ok", note)
        return {"content": [{"type": "text", "text": dumps(payload)}], "structuredContent": payload}

    def request_client_async(self, method: str, params: dict, callback=None) -> tuple[str, dict]:
        """Coffer's own request to the client; ``callback(reply)`` runs on the client reader thread when the
        normalized reply arrives.  Returns (the id used, the box the reply lands in)."""
        with self.lock:
            self._client_request_seq += 1
            ours = f"coffer-own-{self._client_request_seq}"
            box = self.own_requests[ours] = {"done": threading.Event(), "reply": None, "callback": callback}
        self.send({"jsonrpc": "2.0", "id": ours, "method": method, "params": params})
        return ours, box

    def request_client(self, method: str, params: dict, timeout: float):
        """Coffer's own request to the client (sampling for coffer__ask), waited for on the calling worker
        thread; the result object, or None on an error, a refusal or ``timeout``."""
        if self.client_era == "modern":
            return None  # a 2026-07-28 client takes no requests: coffer__ask answers with passages only
        ours, box = self.request_client_async(method, params)
        if not box["done"].wait(timeout):
            with self.lock:
                self.own_requests.pop(ours, None)
            self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": ours, "reason": "coffer__ask ran out of time"}})
            return None
        return box["reply"].get("result")

    @staticmethod
    def _sampling_params(prompt: str, max_tokens: int) -> dict:
        return {"messages": [{"role": "user", "content": {"type": "text", "text": prompt}}], "maxTokens": max_tokens,
                "includeContext": "none",
                "systemPrompt": "You help a retrieval tool. Follow the instructions exactly and be brief."}

    @staticmethod
    def _sampled_text(result) -> str | None:
        """The text of a CreateMessageResult (a client's answer), or None."""
        content = result.get("content") if isinstance(result, dict) else None
        if isinstance(content, list):  # 2025-11-25 allows a list of content blocks
            content = next((c for c in content if isinstance(c, dict) and c.get("type") == "text"), None)
        text = content.get("text") if isinstance(content, dict) else None
        return text.strip()[:8000] if isinstance(text, str) and text.strip() else None

    def _sample_text(self, prompt: str, max_tokens: int, deadline: float) -> str | None:
        """One sampling/createMessage round trip to a handshake-era client's model: its text, or None."""
        remaining = deadline - time.monotonic()
        if remaining <= 1.0:
            return None
        return self._sampled_text(self.request_client("sampling/createMessage",
                                                      self._sampling_params(prompt, max_tokens), remaining))

    @staticmethod
    def _rewrite_prompt(question: str) -> str:
        return ("Rewrite this question into at most three short search queries for a keyword search over the "
                f"user's notes, one per line, nothing else.\n\nQuestion: {question[:2000]}")

    @staticmethod
    def _answer_prompt(question: str, hits) -> str:
        numbered = "\n\n".join(f"[{i}] {h.path} ({h.heading}):\n{h.text[:3000]}" for i, h in enumerate(hits, 1))
        return ("Answer the question using only the numbered passages below, citing them like [1]. If they do not "
                f"answer it, say so.\n\nQuestion: {question[:2000]}\n\nPassages:\n{numbered}")

    @staticmethod
    def _queries(rewritten: str | None) -> list[str]:
        lines = [line.strip(" -*0123456789.") for line in (rewritten or "").splitlines()]
        return [line[:300] for line in lines if line][:3]

    def _ask(self, arguments: dict, started: float, params: dict | None = None, round_: dict | None = None) -> dict:
        """coffer__ask: the passages that answer a question; with the client's sampling (and ask_synthesis on), at
        most two calls to its model -- a rewrite into search queries, and an answer citing passage numbers --
        within ASK_SAMPLING_BUDGET.  A handshake-era client is asked with sampling requests; a 2026-07-28 client
        with input_required rounds (``round_``: the sealed claims and the inputResponses of a retry).  The passages
        are returned whatever the model does.  The log gets who, when, how long and the outcome: never the
        question, a passage or the answer."""
        def fail(text):
            self.log.record(self.client_name, RESERVED_SERVER, ASK_TOOL, "tool", started, "error", text)
            return tool_error_result(text)

        question = arguments.get("question")
        sources = arguments.get("sources")
        if not isinstance(question, str) or not question.strip():
            return fail("question must be a non-empty string")
        if sources is not None and not (isinstance(sources, list) and all(isinstance(x, str) for x in sources)):
            return fail("sources must be a list of source names")
        claims, responses = (round_ or {}).get("claims") or {}, (round_ or {}).get("responses") or {}
        try:
            top_k = bounded_top_k(arguments.get("top_k"))
            answer = self.knowledge.ask(question, top_k, sources)
            hits, notes = list(answer.passages), [answer.note] if answer.note else []
            queries = claims.get("q") if isinstance(claims.get("q"), list) else []
            if claims.get("ask") == 1:
                queries = self._queries(self._sampled_text(responses.get("coffer-rewrite")))
            if queries:
                merged = {(h.source, h.path, tuple(h.lines)): h for h in hits}
                for query in queries:
                    for hit in self.knowledge.ask(str(query), top_k, sources).passages:
                        key = (hit.source, hit.path, tuple(hit.lines))
                        if key not in merged or hit.score > merged[key].score:
                            merged[key] = hit
                hits = sorted(merged.values(), key=lambda h: -h.score)[:top_k]
        except (ValueError, CofferError) as exc:
            return fail(str(exc))
        synthesis = None
        wanted = self.settings["ask_synthesis"] == "on" and bool(hits)
        if self.client_era == "modern":
            meta = (params or {}).get("_meta") if isinstance((params or {}).get("_meta"), dict) else {}
            caps = meta.get(META_CLIENT_CAPABILITIES) if isinstance(meta.get(META_CLIENT_CAPABILITIES), dict) else {}
            first = claims.get("t0", time.time())
            in_time = time.time() - first < ASK_SAMPLING_BUDGET
            if wanted and isinstance(caps.get("sampling"), dict) and in_time and claims.get("ask") in (None, 1):
                stage, prompt, tokens = ((1, self._rewrite_prompt(question), 200) if claims.get("ask") is None
                                         else (2, self._answer_prompt(question, hits), 600))
                key = "coffer-rewrite" if stage == 1 else "coffer-answer"
                state = self.sealer.seal("tools/call", params, {"ask": stage, "q": queries, "t0": int(first)})
                return {"resultType": "input_required", "requestState": state, "inputRequests": {
                    key: {"method": "sampling/createMessage", "params": self._sampling_params(prompt, tokens)}}}
            if claims.get("ask") == 2:
                synthesis = self._sampled_text(responses.get("coffer-answer"))
        elif wanted and "sampling" in self.client_capabilities and not claims:
            deadline = time.monotonic() + ASK_SAMPLING_BUDGET
            queries = self._queries(self._sample_text(self._rewrite_prompt(question), 200, deadline))
            if queries:
                return self._ask(arguments, started, params, {"claims": {"ask": 0, "q": queries, "sync": deadline}})
            synthesis = self._sample_text(self._answer_prompt(question, hits), 600, deadline)
        if claims.get("ask") == 0:  # the handshake era's second step (after the rewrite)
            synthesis = self._sample_text(self._answer_prompt(question, hits), 600, claims["sync"])
        if wanted and synthesis is None and (claims or "sampling" in self.client_capabilities):
            notes.append("no answer from the client's model; passages only")
        payload = {"passages": [hit.to_dict() for hit in hits], "total_searched": answer.total_searched}
        if synthesis:
            payload["answer"] = synthesis
        self.log.record(self.client_name, RESERVED_SERVER, ASK_TOOL, "tool", started, "ok",
                        "; ".join(notes) or None)
        return {"content": [{"type": "text", "text": dumps(payload)}], "structuredContent": payload}

    def _remember(self, arguments: dict, started: float) -> dict:
        text, tags = arguments.get("text"), arguments.get("tags") or []
        try:
            if not isinstance(text, str) or not text.strip():
                raise CofferError("text must be a non-empty string")
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise CofferError("tags must be a list of words")
            note_id = self.knowledge.remember(redact(text), tags, client=self.client_name)
        except CofferError as exc:
            self.log.record(self.client_name, RESERVED_SERVER, REMEMBER_TOOL, "tool", started, "error", str(exc))
            return tool_error_result(str(exc))
        self.log.record(self.client_name, RESERVED_SERVER, REMEMBER_TOOL, "tool", started, "ok")
        payload = {"id": note_id, "stored": True}
        return {"content": [{"type": "text", "text": f"Remembered as {note_id}."}], "structuredContent": payload}


# ============================================================================================================
# 10. Client configs: move in from the MCP clients a user already has, install Coffer into them, diagnose
# ============================================================================================================
#
#
# Every client config is someone else's file: it is read with size and depth bounds and never trusted, and it
# is only rewritten by a minimal text splice (comments, order and formatting survive), after a timestamped
# backup, and only when re-reading the result gives exactly the intended structure.  Everything here runs on
# the CLI's thread.

CLIENTS = ("claude-desktop", "claude-code", "cursor", "vscode", "windsurf", "zed", "codex", "gemini")
MAX_CONFIG_BYTES = 64 << 20   # ~/.claude.json keeps per-project history and grows to tens of MB on busy machines
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_SERVERS = 1000     # per file; more is not a config a person wrote
GUI_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"   # what launchd / a desktop session gives an app started from the dock
COFFER_ENTRY = RESERVED_SERVER               # the name Coffer's own entry has in every client
#: client -> (max tool-name length, what the client puts in front of Coffer's exposed names)
CLIENT_TOOL_NAME_LIMITS = {"claude-code": (64, "mcp__coffer__"), "codex": (64, "mcp__coffer__"),
                           "cursor": (60, "coffer"), "gemini": (63, "mcp_coffer_")}
#: clients that are usually started from a desktop launcher, with a minimal PATH
GUI_CLIENTS = ("claude-desktop", "cursor", "vscode", "windsurf", "zed")


class ConfigProblem(Exception):
    """A client config file that cannot be read or safely edited; the message is the per-file reason."""


# -- records -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ClientFile:
    """Where one client keeps MCP servers: a file, the key path of the servers map inside it, its format."""
    client: str
    path: str
    scope: str                 # "user", "project" or "local" (Claude Code's per-project entry in ~/.claude.json)
    container: tuple           # key path of the servers map, e.g. ("mcpServers",) or ("projects", "/p", "mcpServers")
    fmt: str                   # "json", "jsonc" (comments and trailing commas allowed) or "toml"
    project_root: str | None = None


@dataclasses.dataclass
class ImportedServer:
    """One server entry from a client config, normalised to Coffer's shapes and ${NAME} references.

    Literal env/header values are still in ``env``/``headers``; the plan moves them to the SecretStore.
    Built and read by the CLI thread only, like every record in this section.
    """
    name: str                  # as the client calls it
    client: str
    path: str
    kind: str                  # "stdio", "http" or "sse"
    command: list | None = None
    env: dict = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    needs: list = dataclasses.field(default_factory=list)   # ${NAME}s the user must still provide

    def identity(self) -> tuple:
        """Same command+args+env, or same url: the same server, whichever client lists it."""
        if self.kind == "stdio":
            return ("stdio", tuple(self.command), tuple(sorted(self.env.items())))
        return ("remote", self.url)


@dataclasses.dataclass
class PlannedServer:
    """A server the import will write: its legal Coffer name and its env/headers with secrets as ${NAME}."""
    server: ImportedServer
    name: str                              # the legal Coffer name
    renamed_because: str | None = None
    overwrite: bool = False
    env: dict = dataclasses.field(default_factory=dict)        # with secrets replaced by ${NAME}
    headers: dict = dataclasses.field(default_factory=dict)
    secrets: dict = dataclasses.field(default_factory=dict)    # NAME -> value (never printed)


@dataclasses.dataclass
class SkippedServer:
    """A client entry the import leaves out, and why (said to the user as is)."""
    name: str
    client: str
    path: str
    reason: str


@dataclasses.dataclass
class FileProblem:
    """A whole config file that could not be read, and why; the file itself is left untouched."""
    client: str
    path: str
    reason: str


@dataclasses.dataclass
class ImportPlan:
    """What ``coffer import`` will do (or, with --dry-run, would do); apply_import carries it out."""
    added: list = dataclasses.field(default_factory=list)       # PlannedServer
    skipped: list = dataclasses.field(default_factory=list)     # SkippedServer
    problems: list = dataclasses.field(default_factory=list)    # FileProblem
    files_read: list = dataclasses.field(default_factory=list)  # ClientFile

    @property
    def secrets_moved(self) -> list:
        return sorted({name for planned in self.added for name in planned.secrets})

    def as_json(self) -> dict:
        return {
            "added": [{"name": p.name, "source": p.server.client, "path": p.server.path, "kind": p.server.kind,
                       **({"renamed_from": p.server.name} if p.renamed_because else {}),
                       **({"overwrite": True} if p.overwrite else {}),
                       **({"needs": p.server.needs} if p.server.needs else {})} for p in self.added],
            "skipped": [{"name": s.name, "source": s.client, "path": s.path, "reason": s.reason}
                        for s in self.skipped],
            "secrets_moved": self.secrets_moved,
            "errors": [{"source": p.client, "path": p.path, "reason": p.reason} for p in self.problems],
        }


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


@dataclasses.dataclass
class _ObjectSpan:
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

@dataclasses.dataclass(frozen=True)
class ClientContext:
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


def client_files(client: str, ctx: ClientContext, project: bool | None = None) -> list[ClientFile]:
    """The files ``client`` reads servers from: user scope first, then the current project's.

    ``project`` None gives both, True only the project's, False only the user's.
    """
    home, cwd = ctx.home, ctx.cwd
    user: list[ClientFile] = []
    proj: list[ClientFile] = []
    servers = ("mcpServers",)
    if client == "claude-desktop":
        user.append(ClientFile(client, os.path.join(ctx.app_config_dir(), "Claude", "claude_desktop_config.json"),
                               "user", servers, "json"))
    elif client == "claude-code":
        user.append(ClientFile(client, os.path.join(home, ".claude.json"), "user", servers, "json"))
        for key in dict.fromkeys((cwd, os.path.realpath(cwd))):
            proj.append(ClientFile(client, os.path.join(home, ".claude.json"), "local",
                                   ("projects", key, "mcpServers"), "json", cwd))
        proj.append(ClientFile(client, os.path.join(cwd, ".mcp.json"), "project", servers, "json", cwd))
    elif client == "cursor":
        user.append(ClientFile(client, os.path.join(home, ".cursor", "mcp.json"), "user", servers, "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".cursor", "mcp.json"), "project", servers, "jsonc", cwd))
    elif client == "vscode":
        base = ctx.app_config_dir() if ctx.platform in ("win32", "darwin") else \
            (ctx.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"))
        user.append(ClientFile(client, os.path.join(base, "Code", "User", "mcp.json"), "user", ("servers",), "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".vscode", "mcp.json"), "project", ("servers",), "jsonc",
                               cwd))
    elif client == "windsurf":
        user.append(ClientFile(client, os.path.join(home, ".codeium", "windsurf", "mcp_config.json"), "user",
                               servers, "jsonc"))
    elif client == "zed":
        if ctx.platform == "win32":
            base = os.path.join(ctx.app_config_dir(), "Zed")
        elif ctx.platform == "darwin":
            base = os.path.join(home, ".config", "zed")
        else:
            base = os.path.join(ctx.environ.get("FLATPAK_XDG_CONFIG_HOME") or ctx.app_config_dir(), "zed")
        user.append(ClientFile(client, os.path.join(base, "settings.json"), "user", ("context_servers",), "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".zed", "settings.json"), "project", ("context_servers",),
                               "jsonc", cwd))
    elif client == "codex":
        codex_home = ctx.environ.get("CODEX_HOME") or os.path.join(home, ".codex")
        user.append(ClientFile(client, os.path.join(codex_home, "config.toml"), "user", ("mcp_servers",), "toml"))
        proj.append(ClientFile(client, os.path.join(cwd, ".codex", "config.toml"), "project", ("mcp_servers",),
                               "toml", cwd))
    elif client == "gemini":
        user.append(ClientFile(client, os.path.join(home, ".gemini", "settings.json"), "user", servers, "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".gemini", "settings.json"), "project", servers, "jsonc",
                               cwd))
    else:
        raise CofferError(f"unknown client {client!r}; known: {', '.join(CLIENTS)}")
    if os.path.realpath(cwd) == os.path.realpath(home):  # the home directory is no project
        proj = [f for f in proj if f.scope == "local"]
    return user if project is False else proj if project else user + proj


def detect_file(path: str, ctx: ClientContext) -> list[ClientFile]:
    """A SOURCE given as a path: which client's format it is, told by its name and its shape."""
    path = os.path.abspath(os.path.expanduser(path))
    text = read_config_text(path)
    if text is None:
        raise ConfigProblem("no such file")
    base = os.path.basename(path).lower()
    parent = os.path.basename(os.path.dirname(path)).lower()
    if base.endswith(".toml"):
        return [ClientFile("codex", path, "user", ("mcp_servers",), "toml")]
    value = JsonDocument(text, jsonc=True).value
    root = os.path.dirname(os.path.dirname(path))
    if isinstance(value.get("context_servers"), dict):
        return [ClientFile("zed", path, "user", ("context_servers",), "jsonc")]
    if isinstance(value.get("servers"), dict):
        return [ClientFile("vscode", path, "user", ("servers",), "jsonc", root)]
    if isinstance(value.get("mcp"), dict) and isinstance(value["mcp"].get("servers"), dict):
        return [ClientFile("vscode", path, "user", ("mcp", "servers"), "jsonc", root)]  # VS Code settings.json
    if base == ".claude.json" or isinstance(value.get("projects"), dict):
        found = [ClientFile("claude-code", path, "user", ("mcpServers",), "json")]
        for key in dict.fromkeys((ctx.cwd, os.path.realpath(ctx.cwd))):
            found.append(ClientFile("claude-code", path, "local", ("projects", key, "mcpServers"), "json", ctx.cwd))
        return found
    if "mcpServers" in value:
        client = ("claude-desktop" if base == "claude_desktop_config.json" else
                  "windsurf" if base == "mcp_config.json" else
                  "gemini" if parent == ".gemini" else
                  "cursor" if parent == ".cursor" else
                  "claude-code" if base == ".mcp.json" else "mcp-json")
        return [ClientFile(client, path, "user", ("mcpServers",), "jsonc", os.path.dirname(path))]
    raise ConfigProblem("no MCP servers map in it (looked for mcpServers, servers, context_servers, mcp_servers)")


def load_client_file(file: ClientFile, text: str | None = None):
    """(parsed document, servers map) of one file; ConfigProblem when it is unreadable or the map is no map."""
    text = read_config_text(file.path) if text is None else text
    if text is None:
        return None, {}
    document = TomlDocument(text) if file.fmt == "toml" else JsonDocument(text, jsonc=file.fmt == "jsonc")
    found, servers = _lookup(document.value, file.container)
    if not found or servers is None:
        return document, {}
    if not isinstance(servers, dict):
        raise ConfigProblem(f"{'.'.join(file.container)} is {_json_type(servers)}, not an object")
    if len(servers) > MAX_CONFIG_SERVERS:
        raise ConfigProblem(f"{len(servers)} servers in one file (limit {MAX_CONFIG_SERVERS})")
    return document, servers


# -- one client entry -> ImportedServer -----------------------------------------------------------------------

_CLIENT_REF_RE = re.compile(r"\$\{(env|input):([^}]*)\}|\$\{(userHome|workspaceFolder|workspaceFolderBasename|"
                            r"pathSeparator|/)\}|\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}|\$\{([^}]*)\}|"
                            r"\$([A-Za-z_][A-Za-z0-9_]*)")
_REMOTE_TYPES = {"http": "http", "streamable-http": "http", "streamable_http": "http", "streamablehttp": "http",
                 "sse": "sse"}


def reference_name(text: str) -> str:
    """A legal ${NAME} for a client's input id or header name: GitHub token-1 -> GITHUB_TOKEN_1."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").upper() or "VALUE"
    return name if not name[0].isdigit() else "_" + name


def _rewrite_references(value: str, client: str, file: ClientFile, ctx: ClientContext, server: ImportedServer):
    """A client's reference syntaxes in one string, written as Coffer's ${NAME}."""

    def replace(match):
        scheme, argument, builtin, name, default, other, bare = match.groups()
        if scheme == "env":
            return "${" + reference_name(argument) + "}" if not ENV_KEY_RE.match(argument) else "${" + argument + "}"
        if scheme == "input":
            target = reference_name(argument)
            if target not in server.needs:
                server.needs.append(target)
                server.notes.append(f"VS Code input '{argument}' is now ${{{target}}}: set it in Coffer's "
                                    "secret store or the environment")
            return "${" + target + "}"
        if builtin == "userHome":
            return ctx.home
        if builtin in ("workspaceFolder", "workspaceFolderBasename"):
            root = file.project_root or ctx.cwd
            if file.project_root is None:
                server.notes.append(f"${{{builtin}}} resolved to the current directory {root}")
            return root if builtin == "workspaceFolder" else os.path.basename(root)
        if builtin:
            return os.sep
        if name:
            return match.group(0)  # already Coffer's syntax (Claude Code's, too)
        if other is not None:
            server.notes.append(f"${{{other}}} is not a reference Coffer can resolve; kept as text")
            return match.group(0)
        if bare and client == "gemini":  # only Gemini CLI expands $NAME; elsewhere it is literal text
            return "${" + bare + "}"
        return match.group(0)

    return _CLIENT_REF_RE.sub(replace, value)


def _string_map(raw, what: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigProblem(f"{what} is {_json_type(raw)}, not an object")
    result = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigProblem(f"{what}.{key} is {_json_type(value)}, not a string")
        result[str(key)] = value if isinstance(value, str) else str(value)
    return result


def entry_to_server(client: str, name: str, raw, file: ClientFile, ctx: ClientContext) -> ImportedServer:
    """One entry of a client's servers map; ConfigProblem (the skip reason) when it is not a usable server."""
    if not isinstance(raw, dict):
        raise ConfigProblem(f"the entry is {_json_type(raw)}, not an object")
    if raw.get("disabled") is True or raw.get("enabled") is False:
        raise ConfigProblem(f"disabled in {client}")
    server = ImportedServer(name=name, client=client, path=file.path, kind="stdio")
    command = raw.get("command")
    if client == "zed":
        if raw.get("source") == "extension" or (command is None and raw.get("url") is None):
            raise ConfigProblem("managed by a Zed extension; register its command with coffer add")
        if isinstance(command, dict):  # Zed's older shape: "command": {"path", "args", "env"}
            raw = {**raw, **{k: command.get(k) for k in ("args", "env")}}
            command = command.get("path")
    url = next((raw[key] for key in ("url", "serverUrl", "httpUrl") if raw.get(key) is not None), None)
    rewrite = lambda text: _rewrite_references(text, client, file, ctx, server)  # noqa: E731
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise ConfigProblem("command is not a non-empty string")
        args = raw.get("args", [])
        if args is None:
            args = []
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                                 for a in args):
            raise ConfigProblem("args is not a list of strings")
        server.command = [rewrite(command)] + [rewrite(str(a)) for a in args]
        server.env = {k: rewrite(v) for k, v in _string_map(raw.get("env"), "env").items()}
        forwarded = raw.get("env_vars") or []     # Codex: forward these from the environment as they are
        if not isinstance(forwarded, list) or not all(isinstance(v, str) and ENV_KEY_RE.match(v) for v in forwarded):
            raise ConfigProblem("env_vars is not a list of variable names")
        for variable in forwarded:
            server.env.setdefault(variable, "${" + variable + "}")
        cwd = raw.get("cwd")
        if cwd is not None:
            if not isinstance(cwd, str):
                raise ConfigProblem("cwd is not a string")
            cwd = os.path.expanduser(rewrite(cwd))
            server.cwd = cwd if os.path.isabs(cwd) else os.path.normpath(
                os.path.join(file.project_root or os.path.dirname(file.path), cwd))
        for key in ("envFile", "env_file"):
            if raw.get(key):
                server.notes.append(f"{key} {raw[key]!r} was not imported: put its values in Coffer's secret "
                                    "store or environment")
        return server
    if url is None:
        raise ConfigProblem("neither command nor url")
    if not isinstance(url, str) or not re.match(r"(?i)https?://[^\s/]", url):
        raise ConfigProblem("url is not an http(s) URL")
    server.url = rewrite(url)
    kind = str(raw.get("type") or raw.get("transport") or "").lower()
    if kind in _REMOTE_TYPES:
        server.kind = _REMOTE_TYPES[kind]
    elif kind and kind != "stdio":
        raise ConfigProblem(f"transport {kind!r} is not one Coffer speaks")
    elif raw.get("httpUrl") is not None or raw.get("serverUrl") is not None:
        server.kind = "http"
    elif client == "gemini":
        server.kind = "sse"     # Gemini CLI: url is SSE, httpUrl is Streamable HTTP
    else:
        try:
            path = urllib.parse.urlsplit(url).path
        except ValueError:
            path = ""
        server.kind = "sse" if path.rstrip("/").endswith("/sse") else "http"
    headers = {k: rewrite(v) for k, v in _string_map(raw.get("headers"), "headers").items()}
    headers.update({k: rewrite(v) for k, v in _string_map(raw.get("http_headers"), "http_headers").items()})
    for header, variable in _string_map(raw.get("env_http_headers"), "env_http_headers").items():
        headers[header] = "${" + (variable if ENV_KEY_RE.match(variable) else reference_name(variable)) + "}"
    token_variable = raw.get("bearer_token_env_var")
    if isinstance(token_variable, str) and ENV_KEY_RE.match(token_variable):
        headers["Authorization"] = "Bearer ${" + token_variable + "}"
    elif isinstance(raw.get("bearer_token"), str):   # Codex's older literal form
        headers["Authorization"] = "Bearer " + raw["bearer_token"]
    server.headers = headers
    return server


# -- import: plan, then apply ---------------------------------------------------------------------------------

_WHOLE_REF_RE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
SECRET_SET_HINT = "coffer secret set {name}"   # the command that stores one secret (issue 15's CLI)


def _resolve_whole_reference(value: str, store) -> str:
    """A value that is exactly one ${NAME} kept in the secret store, as the value it stands for."""
    match = _WHOLE_REF_RE.match(value)
    if match:
        stored = store.get(match.group(1))
        if stored is not None:
            return stored
    return value


def coffer_identity(server: dict, store) -> tuple:
    """ImportedServer.identity() of a server already in the vault, its secret references resolved."""
    if server["transport"] == "stdio":
        env = {k: _resolve_whole_reference(v, store) for k, v in (server.get("env") or {}).items()}
        return ("stdio", tuple(server.get("command") or ()), tuple(sorted(env.items())))
    return ("remote", server.get("url"))


def same_definition(server: dict, imported: ImportedServer, store) -> bool:
    if coffer_identity(server, store) != imported.identity():
        return False
    if imported.kind == "stdio":
        return (server.get("cwd") or None) == imported.cwd
    headers = {k: _resolve_whole_reference(v, store) for k, v in (server.get("headers") or {}).items()}
    return server["transport"] == imported.kind and headers == imported.headers


def legal_server_name(raw: str) -> tuple[str, str | None]:
    """(a name Coffer accepts, why it differs from ``raw`` or None)."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", str(raw)).strip("-") or "server"
    name = name[:24].rstrip("-")
    if name.lower() == RESERVED_SERVER:
        name = f"{name}-server"
    if name == raw:
        return name, None
    why = ("'coffer' is reserved for Coffer's own tools" if str(raw).lower() == RESERVED_SERVER else
           "Coffer names are 1-24 letters, digits or '-'")
    return name, f"renamed from {raw!r}: {why}"


def _numbered(name: str, n: int) -> str:
    suffix = f"-{n}"
    return name[:24 - len(suffix)].rstrip("-") + suffix


def _move_secrets(planned: PlannedServer, store, planned_secrets: dict) -> None:
    """Every literal env/header value (and a URL's credentials) goes to the secret store, by the same rule as
    `coffer add` (plan_literals); the definition keeps a ${NAME} for it."""
    server = planned.server
    planned.env, found_env = plan_literals(planned.name, server.env, store, planned=planned_secrets)
    planned.headers, found_headers = plan_literals(planned.name, server.headers, store, header=True,
                                                   planned=planned_secrets)
    found_url = {}
    if server.url:
        server.url, found_url = plan_url_literals(planned.name, server.url, store, planned=planned_secrets)
    planned.secrets.update({**found_env, **found_headers, **found_url})


def plan_import(vault, store, files: list[ClientFile], ctx: ClientContext, overwrite: bool = False) -> ImportPlan:
    plan = ImportPlan()
    existing = {s["name"].lower(): s for s in vault.servers()}
    existing_ids = {coffer_identity(s, store): s["name"] for s in existing.values()}
    seen: dict[tuple, str] = {}                  # identity -> "name from client (path)" in this run
    planned_names: set[str] = set()
    planned_secrets: dict[str, str] = {}
    done_files: set = set()
    for file in files:
        if (file.path, file.container) in done_files:
            continue
        done_files.add((file.path, file.container))
        try:
            document, servers = load_client_file(file)
        except ConfigProblem as exc:
            if not any(p.path == file.path for p in plan.problems):
                plan.problems.append(FileProblem(file.client, file.path, str(exc)))
            continue
        if document is None:
            continue
        plan.files_read.append(file)
        for raw_name, raw in servers.items():
            def skip(reason, name=raw_name):
                plan.skipped.append(SkippedServer(str(name), file.client, file.path, reason))

            if raw_name == COFFER_ENTRY and isinstance(raw, dict) and "serve" in json.dumps(raw):
                skip("Coffer's own entry")
                continue
            try:
                server = entry_to_server(file.client, raw_name, raw, file, ctx)
            except ConfigProblem as exc:
                skip(str(exc))
                continue
            name, renamed_because = legal_server_name(raw_name)
            identity = server.identity()
            current = existing.get(name.lower())
            if current is not None and same_definition(current, server, store):
                skip("already in Coffer with the same definition", name)
                seen.setdefault(identity, f"{name!r} in Coffer")
                continue
            if identity in existing_ids:
                skip(f"already in Coffer as {existing_ids[identity]!r}", name)
                continue
            if identity in seen:
                skip(f"same server as {seen[identity]}", name)
                continue
            if current is not None and not overwrite:
                skip(f"a different server named {name!r} is already in Coffer (--overwrite replaces it)", name)
                continue
            if name.lower() in planned_names:
                n = 2
                while _numbered(name, n).lower() in planned_names or _numbered(name, n).lower() in existing:
                    n += 1
                renamed_because = (renamed_because or f"renamed from {raw_name!r}") + \
                    f"; {name!r} is taken by another server in this import"
                name = _numbered(name, n)
                current = None   # the new name is free in Coffer: an insert, never an overwrite
            planned = PlannedServer(server, name, renamed_because, overwrite=current is not None)
            _move_secrets(planned, store, planned_secrets)
            plan.added.append(planned)
            planned_names.add(name.lower())
            seen[identity] = f"{name!r} from {file.client} ({file.path})"
    return plan


def apply_import(vault, store, plan: ImportPlan) -> None:
    """Secrets first (a failed transaction leaves only unused store entries), then every server in one transaction."""
    for planned in plan.added:
        for name, value in planned.secrets.items():
            if store.get(name) != value:
                store.set(name, value)
    with vault.transaction() as db:
        for planned in plan.added:
            server = planned.server
            detail = f"{server.kind} from {server.client} {server.path}"
            if planned.secrets:
                detail += f"; secrets to the store: {', '.join(sorted(planned.secrets))}"
            vault.put_server(db, planned.name, command=server.command, url=server.url, env=planned.env,
                             headers=planned.headers, cwd=server.cwd, transport=server.kind,
                             replace=planned.overwrite, action="import-overwrite" if planned.overwrite else "import",
                             detail=detail)


def print_import_plan(plan: ImportPlan, dry_run: bool) -> None:
    home = os.path.expanduser("~")
    short = lambda path: path.replace(home, "~", 1) if path.startswith(home + os.sep) else path  # noqa: E731
    for problem in plan.problems:
        say(f"! {problem.client}: {short(problem.path)}: {problem.reason} (file left as it is)")
    for planned in plan.added:
        server = planned.server
        target = server.url if server.kind != "stdio" else " ".join(shlex.quote(p) for p in server.command)
        verb = "replace" if planned.overwrite else "add"
        say(f"+ {verb} {planned.name} ({server.kind}) from {server.client} {short(server.path)}: {target}")
        if planned.renamed_because:
            say(f"    {planned.renamed_because}")
        if planned.secrets:
            say(f"    literal values moved to Coffer's secret store as: {', '.join(sorted(planned.secrets))}")
        for note in server.notes:
            say(f"    note: {note}")
    for skipped in plan.skipped:
        say(f"- skip {skipped.name} from {skipped.client} {short(skipped.path)}: {skipped.reason}")
    if not plan.files_read and not plan.problems:
        say("no MCP client configs found (looked for: " + ", ".join(CLIENTS) + ")")
    elif not plan.added:
        say("nothing to import")
    elif dry_run:
        say(f"dry run: {len(plan.added)} server(s) would be imported; nothing was changed")


# -- install / uninstall --------------------------------------------------------------------------------------

def coffer_launch_command() -> list[str]:
    """An absolute argv that starts ``coffer serve`` even under a GUI app's minimal PATH.

    The installed ``coffer`` script when this module is the one it runs (both inside this interpreter's prefix),
    otherwise this interpreter and this file, which is also right for a checkout or an editable install.
    """
    module = os.path.realpath(os.path.abspath(__file__))
    prefix = os.path.realpath(sys.prefix)
    if module.startswith(prefix + os.sep):   # running as an installed package, not from a checkout
        for script in (shutil.which("coffer"), sys.argv[0] if sys.argv else None):  # argv[0]: e.g. uvx coffer-mcp
            if not script or not os.path.isfile(script):
                continue
            script = os.path.abspath(script)
            try:
                with open(script, "rb") as handle:
                    head = handle.read(4096)
            except OSError:
                continue
            if os.path.realpath(script).startswith(prefix + os.sep) and (b"from coffer import main" in head
                                                                         or script.lower().endswith(".exe")):
                return [script, "serve"]
    return [os.path.abspath(sys.executable), module, "serve"]  # not realpath: a venv's python is its own


def coffer_entry(client: str, vault) -> dict:
    argv = coffer_launch_command()
    entry: dict = {"command": argv[0], "args": argv[1:]}
    if os.environ.get("COFFER_HOME"):   # a non-default vault: the client must start Coffer on the same one
        entry["env"] = {"COFFER_HOME": vault.home}
    if client in ("claude-code", "vscode"):
        entry = {"type": "stdio", **entry}
    elif client == "zed":
        entry = {"source": "custom", **entry}
    return entry


def install_target(client: str, ctx: ClientContext, project: bool) -> ClientFile:
    files = [f for f in client_files(client, ctx, project=project) if f.scope != "local"]
    if not files:
        raise CofferError(f"{client} has no {'project' if project else 'user'} config file Coffer can write")
    return files[0]


def stash_path(vault, file: ClientFile) -> str:
    digest = hashlib.sha256(f"{file.path}\0{'/'.join(file.container)}".encode()).hexdigest()[:12]
    return os.path.join(vault.home, "replaced", f"{file.client}-{digest}.json")


def _read_stash(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            stash = json.load(handle)
        return stash if isinstance(stash, dict) and isinstance(stash.get("entries"), dict) else {"entries": {}}
    except (OSError, ValueError):
        return {"entries": {}}


def _write_private(path: str, data: str) -> None:
    """Write a file only the user can read (0600 in a 0700 directory), atomically."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.name != "nt":
        os.chmod(directory, 0o700)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".coffer-")
    try:
        if os.name != "nt":
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_config_file(path: str, text: str) -> str | None:
    """Back up ``path`` next to itself, then replace it atomically (through a symlink, keeping its mode)."""
    target = os.path.realpath(path)
    backup = None
    mode = 0o600
    if os.path.exists(target):
        mode = stat.S_IMODE(os.stat(target).st_mode)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        backup, n = f"{path}.coffer-backup-{stamp}", 1
        while os.path.exists(backup):
            n += 1
            backup = f"{path}.coffer-backup-{stamp}-{n}"
        shutil.copy2(target, backup)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".coffer-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if os.name != "nt":
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return backup


@dataclasses.dataclass
class EditResult:
    """What install/uninstall did (or would do) to one client config file."""
    client: str
    path: str
    changed: bool
    text: str = ""
    backup: str | None = None
    removed: list = dataclasses.field(default_factory=list)      # servers --replace took out
    restored: list = dataclasses.field(default_factory=list)     # servers uninstall put back
    kept_out: list = dataclasses.field(default_factory=list)     # (name, why) uninstall could not put back
    stash: str | None = None


def _toml_block(name: str, entry: dict) -> str:
    """A stashed entry is kept as its original TOML text; a new one is rendered."""
    return entry["toml"] if set(entry) == {"toml"} else render_toml_server(name, entry)


def _edit_servers(file: ClientFile, text: str | None, put: dict, drop: list) -> tuple[str, dict]:
    """(new text, servers map after the edit): ``put`` entries set, ``drop`` names removed; verified by re-reading."""
    if text is None:
        value: dict = {}
        holder = value
        for part in file.container:
            holder = holder.setdefault(part, {})
        holder.update(put)
        if file.fmt == "toml":
            return "\n".join(_toml_block(name, entry) for name, entry in put.items()), dict(put)
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n", dict(put)
    document, servers = load_client_file(file, text)
    expected_value = json.loads(json.dumps(document.value, default=str))
    expected = _lookup(expected_value, file.container)[1]
    if expected is None:                       # the servers map does not exist yet: it will
        expected = expected_value
        for part in file.container:
            if not isinstance(expected.get(part), dict):
                expected[part] = {}
            expected = expected[part]
    for name in drop:
        expected.pop(name, None)
    new_text = text
    if file.fmt == "toml":
        for name in list(drop) + [n for n in put]:
            new_text = TomlDocument(new_text).without_server(name)
        for name, entry in put.items():
            block = _toml_block(name, entry)
            new_text = append_toml(new_text, block)
            expected[name] = load_toml(block).get("mcp_servers", {}).get(name, entry)
        result = TomlDocument(new_text).value
    else:
        for name in drop:
            new_text = JsonDocument(new_text, jsonc=file.fmt == "jsonc").without_member(file.container, name)
        for name, entry in put.items():
            new_text = JsonDocument(new_text, jsonc=file.fmt == "jsonc").with_member(file.container, name, entry)
            expected[name] = entry
        result = JsonDocument(new_text, jsonc=file.fmt == "jsonc").value
    if json.loads(json.dumps(result, default=str)) != expected_value:
        raise ConfigProblem("Coffer could not edit it safely (an entry is defined in a way it does not rewrite); "
                            "edit it by hand")
    return new_text, _lookup(result, file.container)[1] or {}


def registered_in_coffer(vault, store, file: ClientFile, servers: dict, ctx: ClientContext) -> dict:
    """{client entry name: Coffer server name} for the entries of ``servers`` that Coffer already serves."""
    identities = {coffer_identity(s, store): s["name"] for s in vault.servers()}
    found = {}
    for name, raw in servers.items():
        if name == COFFER_ENTRY:
            continue
        try:
            identity = entry_to_server(file.client, name, raw, file, ctx).identity()
        except ConfigProblem:
            continue
        if identity in identities:
            found[name] = identities[identity]
    return found


def install_client(vault, store, client: str, ctx: ClientContext, project: bool = False, replace: bool = False,
                   dry_run: bool = False) -> EditResult:
    file = install_target(client, ctx, project)
    try:
        text = read_config_text(file.path)
        document, servers = load_client_file(file, text) if text is not None else (None, {})
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    entry = coffer_entry(client, vault)
    current = servers.get(COFFER_ENTRY)
    put = {} if current == entry else {COFFER_ENTRY: entry}
    removed = registered_in_coffer(vault, store, file, servers, ctx) if replace else {}
    result = EditResult(client, file.path, changed=bool(put or removed), removed=sorted(removed))
    if not result.changed:
        return result
    try:
        result.text, _ = _edit_servers(file, text, put, list(removed))
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    if dry_run:
        return result
    if removed:
        # The removed entries may hold literal secrets: they go to a private file, never to coffer.db.
        result.stash = stash_path(vault, file)
        stash = _read_stash(result.stash)
        for name in removed:
            stash["entries"][name] = ({"toml": document.server_text(name)} if file.fmt == "toml"
                                      else servers[name])
        stash.update(client=client, path=file.path, container=list(file.container), saved_at=utcnow())
        _write_private(result.stash, json.dumps(stash, indent=2, ensure_ascii=False))
    result.backup = write_config_file(file.path, result.text)
    return result


def uninstall_client(vault, store, client: str, ctx: ClientContext, project: bool = False,
                     dry_run: bool = False) -> EditResult:
    file = install_target(client, ctx, project)
    try:
        text = read_config_text(file.path)
        document, servers = load_client_file(file, text) if text is not None else (None, {})
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    result = EditResult(client, file.path, changed=False, stash=stash_path(vault, file))
    stash = _read_stash(result.stash)
    drop = [COFFER_ENTRY] if COFFER_ENTRY in servers else []
    put = {}
    for name, entry in stash["entries"].items():
        if name in servers:
            result.kept_out.append((name, "an entry of that name is in the file again"))
        elif isinstance(entry, dict):
            put[name] = entry
            result.restored.append(name)
    result.changed = bool(drop or put)
    if result.changed:
        try:
            result.text, _ = _edit_servers(file, text, put, drop)
        except ConfigProblem as exc:
            raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    if dry_run:
        return result
    if result.changed:
        result.backup = write_config_file(file.path, result.text)
    if os.path.exists(result.stash):
        remaining = {name: entry for name, entry in stash["entries"].items()
                     if name not in result.restored and name not in dict(result.kept_out)}
        if remaining:
            stash["entries"] = remaining
            _write_private(result.stash, json.dumps(stash, indent=2, ensure_ascii=False))
        else:
            os.unlink(result.stash)
    return result


# -- doctor ---------------------------------------------------------------------------------------------------

def _references(server: dict) -> list[tuple[str, bool]]:
    """(NAME, has a default) for every ${NAME} in what Coffer expands when it starts the server."""
    texts = list(server.get("command") or []) + [server.get("url") or "", server.get("cwd") or ""]
    texts += list((server.get("env") or {}).values()) + list((server.get("headers") or {}).values())
    return [(m.group(1), m.group(2) is not None) for text in texts for m in _ENV_REF_RE.finditer(text or "")]


def _problem(problem: str, fix: str, severity: str = "error") -> dict:
    return {"problem": problem, "fix": fix, "severity": severity}


def client_report(vault, store, ctx: ClientContext) -> list[dict]:
    reports = []
    for client in CLIENTS:
        for file in client_files(client, ctx):
            exists = os.path.exists(file.path)
            if file.scope != "user" and not exists:
                continue
            report = {"client": client, "path": file.path, "scope": file.scope, "found": exists,
                      "installed": False, "duplicates": [], "problems": []}
            try:
                document, servers = load_client_file(file) if exists else (None, {})
            except ConfigProblem as exc:
                report["problems"].append(_problem(f"{file.path}: {exc}",
                                                   "fix the file by hand; coffer leaves it as it is"))
                reports.append(report)
                continue
            if file.scope == "local" and not servers:
                continue
            report["installed"] = COFFER_ENTRY in servers
            duplicates = registered_in_coffer(vault, store, file, servers, ctx)
            report["duplicates"] = sorted(duplicates)
            if report["installed"] and duplicates:
                flag = " --project" if file.scope == "project" else ""
                report["problems"].append(_problem(
                    f"{client} runs {', '.join(sorted(duplicates))} beside Coffer, so the agent sees them twice",
                    f"coffer install {client}{flag} --replace", "warning"))
            reports.append(report)
    return reports


def server_report(vault, store, server: dict, installed_clients: set, probe, settings: dict) -> dict:
    problems = []
    name = server["name"]
    if server.get("damaged"):   # the lead's Vault marks a row it could not decode (and disables it)
        return {"name": name, "ok": False, "enabled": False, "tools": 0, "problems": [_problem(
            f"its definition in coffer.db is damaged: {server['damaged']}",
            f"coffer remove {name}, then add or import it again")]}
    if not server.get("enabled", True):
        return {"name": name, "ok": True, "enabled": False, "problems": [], "tools": 0}
    missing = sorted({ref for ref, has_default in _references(server)
                      if not has_default and ref not in os.environ and store.get(ref) is None})
    for ref in missing:
        problems.append(_problem(f"${{{ref}}} is not set (neither in the environment nor in the secret store)",
                                 SECRET_SET_HINT.format(name=ref)))
    gui_installed = sorted(installed_clients & set(GUI_CLIENTS))
    if server["transport"] == "stdio" and server.get("command"):
        program = expand_vars(server["command"][0], environ={**{n: store.get(n) or "" for n in store.names()},
                                                             **os.environ})
        on_path = shutil.which(program)
        if not on_path:
            problems.append(_problem(f"command {program!r} is not found on PATH",
                                     f"install it, or register it with its absolute path: coffer remove {name} "
                                     f"&& coffer add {name} -- /absolute/path/to/{os.path.basename(program)} ..."))
        elif not os.path.isabs(program) and not shutil.which(program, path=GUI_PATH):
            fix = (f"register it with its absolute path: coffer remove {name} && coffer add {name} -- "
                   f"{on_path} {' '.join(shlex.quote(a) for a in server['command'][1:])}".rstrip())
            where = f" ({', '.join(gui_installed)} start Coffer that way)" if gui_installed else ""
            problems.append(_problem(f"command {program!r} is on your shell's PATH ({on_path}) but not on the "
                                     f"minimal PATH desktop apps get ({GUI_PATH}){where}", fix,
                                     "error" if gui_installed else "warning"))
    tools: list = []
    if not any(p["severity"] == "error" for p in problems):
        ok, tools, error = probe(server)
        tools = [str(t) for t in tools or []]
        if not ok:
            problems.append(_problem(f"did not start and list its tools within {settings['init_timeout']} s: "
                                     f"{error}", f"run it by hand to see why: {_command_text(server)}"))
    for client in sorted(installed_clients):
        if client not in CLIENT_TOOL_NAME_LIMITS:
            continue
        limit, prefix = CLIENT_TOOL_NAME_LIMITS[client]
        too_long = [t for t in tools if len(prefix) + len(t) > limit]
        if too_long:
            problems.append(_problem(
                f"{len(too_long)} tool name(s) exceed {client}'s {limit}-character limit with {prefix!r} in front "
                f"(e.g. {too_long[0]})", f"coffer config name_max_length {max(34, limit - len(prefix))}", "warning"))
    return {"name": name, "ok": not any(p["severity"] == "error" for p in problems), "enabled": True,
            "problems": problems, "tools": len(tools)}


def vault_report(vault) -> dict:
    problems = []
    if os.name != "nt":  # the vault fixes these on open; what is left is what it could not fix
        for path, wanted in [(vault.home, "700")] + [(os.path.join(vault.home, f), "600") for f in PRIVATE_FILES]:
            if os.path.exists(path) and (mode := stat.S_IMODE(os.stat(path).st_mode)) & 0o077:
                problems.append(_problem(f"{path} is readable by others (mode {mode:o})", f"chmod {wanted} {path}"))
    try:
        wanted = sqlite3.connect(":memory:")
        wanted.executescript(SCHEMA)
        for (table,) in wanted.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
            expected = {row[1] for row in wanted.execute(f"PRAGMA table_info({table})")}
            actual = {row[1] for row in vault.db.execute(f"PRAGMA table_info({table})")}
            if expected - actual:
                problems.append(_problem(f"table {table} lacks {', '.join(sorted(expected - actual))}",
                                         "run any coffer command with this version to upgrade the vault"))
        wanted.close()
        check = vault.db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            problems.append(_problem(f"coffer.db is damaged: {check}",
                                     f"restore {vault.path} from a backup, or move it away and re-import"))
    except sqlite3.Error as exc:
        problems.append(_problem(f"coffer.db cannot be checked: {exc}", f"look at {vault.path}"))
    return {"path": vault.home, "ok": not problems, "problems": problems}


def probe_all(vault) -> Callable:
    """probe(server) -> (ok, exposed tool names, error), from one ServerProbe that starts every server at once."""
    results = {result.name: result for result in ServerProbe(vault).run()}

    def probe(server):
        result = results.get(server["name"])
        if result is None:
            return False, [], "not started (disabled or damaged)"
        return result.state == "ready", [tool["name"] for tool in result.tools], result.detail or result.state
    return probe


def run_doctor(vault, store, ctx: ClientContext, probe=None) -> dict:
    settings = vault.settings()
    probe = probe or probe_all(vault)
    clients = client_report(vault, store, ctx)
    installed = {c["client"] for c in clients if c["installed"]}
    servers = vault.servers()
    reports: list = [None] * len(servers)

    def check(index, server):
        try:
            reports[index] = server_report(vault, store, server, installed, probe, settings)
        except Exception as exc:  # noqa: BLE001 - one server's odd state must not hide the others' report
            log.exception("doctor: checking %s failed", server["name"])
            reports[index] = {"name": server["name"], "ok": False, "enabled": server.get("enabled", True),
                              "tools": 0, "problems": [_problem(f"could not be checked: {exc}", "coffer list")]}

    threads = [threading.Thread(target=check, args=(i, s), name=f"coffer-doctor-{s['name']}", daemon=True)
               for i, s in enumerate(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    vault_state = vault_report(vault)
    return {"ok": all(r["ok"] for r in reports) and vault_state["ok"], "servers": reports, "clients": clients,
            "vault": vault_state}


def print_doctor(report: dict) -> None:
    marks = {True: "ok ", False: "!! "}
    say("servers:")
    if not report["servers"]:
        say("  none registered: coffer import (from your clients) or coffer add NAME -- COMMAND")
    for server in report["servers"]:
        state = "disabled" if not server.get("enabled", True) else f"{server['tools']} tools"
        say(f"  {marks[server['ok']]}{server['name']} ({state})")
        for problem in server["problems"]:
            say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    say("clients:")
    for client in report["clients"]:
        state = ("Coffer installed" if client["installed"] else "Coffer not installed") if client["found"] \
            else "no config"
        say(f"  {client['client']:<15} {state:<21} {client['path']}")
        for problem in client["problems"]:
            say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    vault_state = report["vault"]
    say(f"vault: {vault_state['path']} {'ok' if vault_state['ok'] else ''}".rstrip())
    for problem in vault_state["problems"]:
        say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")


# -- show -----------------------------------------------------------------------------------------------------

def _shown(value: str) -> str:
    """A stored env/header value as ``coffer show`` prints it: references as written, literals never."""
    return value if (not value or _ENV_REF_RE.search(value)) else f"<literal, {len(value)} characters>"


def show_server(vault, name: str) -> dict:
    server = vault.server(name)
    capabilities = [{"kind": row["kind"], "name": row["name"],
                     "state": ("enabled" if row["enabled"] else "disabled")
                     + (", changed: waiting for coffer approve" if _state(row).quarantined else "")
                     + ("" if row["present"] else ", no longer listed")}
                    for row in vault.capabilities(name)]
    return {"name": server["name"], "transport": server["transport"], "command": server.get("command"),
            "url": server.get("url"), "cwd": server.get("cwd"),
            "env": {k: _shown(v) for k, v in (server.get("env") or {}).items()},
            "headers": {k: _shown(v) for k, v in (server.get("headers") or {}).items()},
            "enabled": server["enabled"], "policy": server["policy"], "timeout": server.get("timeout"),
            "status": server.get("status") or "never started", "status_detail": server.get("status_detail"),
            "status_at": server.get("status_at"), "capabilities": capabilities}


# -- commands -------------------------------------------------------------------------------------------------

def import_sources(sources: list[str], ctx: ClientContext) -> tuple[list[ClientFile], list[FileProblem]]:
    """Client names and file paths -> the files to read; a path that cannot be told apart is a FileProblem."""
    files: list[ClientFile] = []
    problems: list[FileProblem] = []
    for source in sources or CLIENTS:
        if source in CLIENTS:
            files.extend(client_files(source, ctx))
        elif os.path.sep in source or os.path.exists(source) or source.endswith((".json", ".toml")):
            try:
                files.extend(detect_file(source, ctx))
            except ConfigProblem as exc:
                problems.append(FileProblem("?", os.path.abspath(source), str(exc)))
        else:
            raise CofferError(f"unknown source {source!r}: give a client ({', '.join(CLIENTS)}) or a file path")
    return files, problems


def cmd_import(vault, args) -> int:
    ctx = ClientContext.current()
    store = vault.secrets
    files, problems = import_sources(args.sources, ctx)
    plan = plan_import(vault, store, files, ctx, overwrite=args.overwrite)
    plan.problems[:0] = problems
    if not args.dry_run and plan.added:
        apply_import(vault, store, plan)
    if args.json:
        say_json(plan.as_json())
    else:
        print_import_plan(plan, args.dry_run)
        if plan.added and not args.dry_run:
            say(f"imported {len(plan.added)} server(s); next: coffer install CLIENT --replace, then coffer doctor")
    return 1 if plan.problems and args.sources and not plan.added and not plan.skipped else 0


def _print_edit(result: EditResult, verb: str, dry_run: bool) -> None:
    if not result.changed:
        say(f"{result.client}: {result.path} already as wanted; nothing changed")
        return
    prefix = "dry run: would " if dry_run else ""
    say(f"{prefix}{verb} {result.client}: {result.path}")
    if result.removed:
        say(f"  {'would remove' if dry_run else 'removed'} (now served through Coffer): {', '.join(result.removed)}")
    if result.restored:
        say(f"  {'would put back' if dry_run else 'put back'}: {', '.join(result.restored)}")
    for name, why in result.kept_out:
        say(f"  not put back: {name} ({why}); its entry stays in {result.stash}")
    if result.backup:
        say(f"  backup: {result.backup}")
    if result.stash and result.removed and not dry_run:
        say(f"  the removed entries are kept (private, 0600) in {result.stash}; coffer uninstall "
              f"{result.client} puts them back")


def cmd_install(vault, args) -> int:
    result = install_client(vault, vault.secrets, args.client, ClientContext.current(), project=args.project,
                            replace=args.replace, dry_run=args.dry_run)
    _print_edit(result, "install Coffer into" if args.dry_run else "installed Coffer into", args.dry_run)
    if result.changed and not args.dry_run:
        say(f"  restart {args.client} to load it")
    command = coffer_launch_command()[0]
    if re.search(r"[\\/](archive-v\d+|\.?cache[\\/]uv)[\\/]", command):
        say(f"  note: {command} lives in uv's cache, which uv may prune; for a lasting entry run "
              "'uv tool install coffer-mcp' (or pipx install coffer-mcp), then coffer install again")
    return 0


def cmd_uninstall(vault, args) -> int:
    result = uninstall_client(vault, vault.secrets, args.client, ClientContext.current(), project=args.project,
                              dry_run=args.dry_run)
    _print_edit(result, "remove Coffer from" if args.dry_run else "removed Coffer from", args.dry_run)
    return 0


def cmd_doctor(vault, args, probe=None) -> int:
    report = run_doctor(vault, vault.secrets, ClientContext.current(), probe)
    if args.json:
        say_json(report)
    else:
        print_doctor(report)
    return 0 if report["ok"] else 1


def cmd_show(vault, args) -> int:
    shown = show_server(vault, args.name)
    if args.json:
        say_json(shown)
        return 0
    target = shown["url"] if shown["transport"] != "stdio" else " ".join(shlex.quote(p) for p in shown["command"])
    say(f"{shown['name']} ({shown['transport']}): {target}")
    for label, values in (("env", shown["env"]), ("header", shown["headers"])):
        for key, value in values.items():
            say(f"  {label} {key}={value}")
    if shown["cwd"]:
        say(f"  cwd {shown['cwd']}")
    say(f"  enabled: {'yes' if shown['enabled'] else 'no'}; new capabilities: {shown['policy']}"
          + (f"; timeout {shown['timeout']} s" if shown["timeout"] else ""))
    detail = f" ({shown['status_detail']})" if shown["status_detail"] else ""
    since = f" since {shown['status_at']}" if shown["status_at"] else ""
    say(f"  status: {shown['status']}{since}{detail}")
    if shown["capabilities"]:
        say()
        _print_table([[c["kind"], c["name"], c["state"]] for c in shown["capabilities"]], ["KIND", "NAME", "STATE"])
    else:
        say("  no capabilities seen yet (coffer tools starts it)")
    return 0


def add_client_commands(command) -> None:
    """Wire import/install/uninstall/doctor/show into build_parser (``command`` is its local helper)."""
    p = command("import", cmd_import, "import the MCP servers of your clients (Claude, Cursor, VS Code, ...)")
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help=f"a client ({', '.join(CLIENTS)}) or a config file; default: every client found")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace a different server of the same name")
    for name, handler, text in (("install", cmd_install, "add Coffer to a client's config, as 'coffer'"),
                                ("uninstall", cmd_uninstall, "remove Coffer from a client's config and put back "
                                                             "what install --replace took out")):
        p = command(name, handler, text)
        p.add_argument("client", choices=CLIENTS)
        p.add_argument("--project", action="store_true", help="the current project's config, not the user's")
        p.add_argument("--dry-run", action="store_true")
        if name == "install":
            p.add_argument("--replace", action="store_true",
                           help="also remove the servers Coffer now serves from that client's config")
    p = command("doctor", cmd_doctor, "check every server, client config and the vault; exit 1 if a server is broken")
    p.add_argument("--json", action="store_true")
    p = command("show", cmd_show, "a server's definition (secrets as references), status and capabilities")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")


# ============================================================================================================
# 11. Command line
# ============================================================================================================


class GatewayClient:
    """Talks to a ``coffer serve`` subprocess exactly as an agent would, for ``coffer call`` and ``coffer tools``.

    It is an Upstream whose server happens to be Coffer itself, so the CLI exercises the real gateway path.
    """

    def __init__(self, vault: Vault, only: list[str] | None = None):
        settings = dict(vault.settings())
        settings["init_timeout"] = float(settings["discovery_timeout"]) + float(settings["init_timeout"])
        settings["max_restarts"] = 1
        argv = ["serve", "--live"] + [arg for name in only or () for arg in ("--only", name)]
        # Imported rather than run as a script, so Python uses the cached bytecode (compiling coffer.py costs
        # ~30 ms per start); sys.path is extended in-process so the upstreams' environment stays untouched.
        bootstrap = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                     f"import coffer; sys.exit(coffer.main({argv!r}))")
        config = {"name": RESERVED_SERVER, "transport": "stdio", "env": {"COFFER_HOME": vault.home},
                  "command": [sys.executable, "-c", bootstrap], "headers": {}, "inherit_env": ["*"],
                  "era": "handshake"}
        self.ready = threading.Event()
        self.upstream = Upstream(config, settings, self, {}, LATEST_PROTOCOL_VERSION)
        self.upstream._on_stderr = lambda line: (sys.stderr.write(printable(redact(line)) + "\n"),
                                                 sys.stderr.flush())

    def __enter__(self):
        self.upstream.start()
        self.ready.wait(self.upstream.settings["init_timeout"] + 10)
        if self.upstream.state != "ready":
            raise CofferError(f"coffer serve did not start: {self.upstream.last_error}")
        return self

    def __exit__(self, *exc):
        self.upstream.stop()

    # events
    def on_ready(self, upstream):
        self.ready.set()

    def on_down(self, upstream):
        self.ready.set()

    def on_list_changed(self, upstream, kind, items, notify):
        pass

    def on_notification(self, upstream, message):
        pass

    def on_request(self, upstream, message):
        upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "the coffer CLI cannot answer this"))

    def call(self, method: str, params: dict):
        return self.upstream.call(method, params)


class ProbeResult(NamedTuple):
    """What starting one server told: ``state`` is ready, failed or timed out; ``tools`` as a client sees them."""
    name: str
    state: str
    detail: str
    tools: list
    seconds: float


class ServerProbe:
    """Starts servers in this process, with no client attached, to see what they offer — for `coffer tools`,
    `coffer doctor`, and enabling a tool of a server never started.  What it learns is recorded in the vault as
    a gateway would record it (capabilities, status), so `coffer list` reports the last attempt of any command.

    Threads: each upstream's own; ``run`` waits on a condition the upstream events signal.
    """

    def __init__(self, vault: Vault, names: list[str] | None = None, progress=None):
        self.vault = vault
        self.settings = vault.settings()
        # A server that exits at once is tried twice here, not max_restarts times: a person is waiting.
        self.settings["max_restarts"] = min(2, int(self.settings["max_restarts"]))
        self.progress = progress or (lambda result: None)
        self.vault_lock = threading.Lock()
        self.done = threading.Condition()
        self.settled: dict[str, str] = {}  # name -> ready|failed, once its event is handled (guarded by done)
        servers = [s for s in vault.servers() if names is None or s["name"] in names]
        self.skipped = {s["name"]: s["damaged"] or "disabled" for s in servers if s["damaged"] or not s["enabled"]}
        self.upstreams = [Upstream(s, self.settings, self, {}, LATEST_PROTOCOL_VERSION, vault.secrets)
                          for s in servers if s["name"] not in self.skipped]

    def run(self, timeout: float | None = None) -> list[ProbeResult]:
        """Start every server at once and wait for each to be ready or failed, at most ``timeout`` (init_timeout)."""
        timeout = float(self.settings["init_timeout"]) if timeout is None else timeout
        started = time.monotonic()
        finished: dict[str, ProbeResult] = {}
        for upstream in self.upstreams:
            upstream.start()
        try:
            with self.done:
                while len(finished) < len(self.upstreams):
                    for upstream in self.upstreams:
                        # The event, not upstream.state: the state flips before its event is recorded, and a
                        # command that finished in between would leave the vault saying "never started".
                        state = self.settled.get(upstream.name)
                        if upstream.name not in finished and state is not None:
                            finished[upstream.name] = self._result(upstream, state, started)
                            self.progress(finished[upstream.name])
                    remaining = started + timeout - time.monotonic()
                    if remaining <= 0 or len(finished) == len(self.upstreams):
                        break
                    self.done.wait(min(remaining, 0.5))
            for upstream in self.upstreams:
                if upstream.name not in finished:
                    result = self._result(upstream, "timed out", started, f"did not answer within {timeout:g}s")
                    self._record(upstream, "timed out", result.detail)
                    finished[upstream.name] = result
                    self.progress(result)
        finally:
            threads = [start_thread(up.stop, f"coffer-{up.name}-stop") for up in self.upstreams]
            for thread in threads:
                thread.join(5.0)
        return [finished[up.name] for up in self.upstreams]

    def _result(self, upstream: Upstream, state: str, started: float, detail: str | None = None) -> ProbeResult:
        tools = []
        if state == "ready":
            with self.vault_lock:
                states = self.vault.capability_states()
            names = exposed_names(upstream.name, upstream.lists["tool"], self.settings["name_max_length"])
            tools = [dict(definition, name=names[name]) for name, definition in upstream.lists["tool"].items()
                     if states.get((upstream.name, "tool", name), CapabilityState(True)).usable]
        return ProbeResult(upstream.name, state, detail or (upstream.last_error or ""), tools,
                           round(time.monotonic() - started, 2))

    def _record(self, upstream: Upstream, status: str, detail: str, capabilities=None) -> None:
        try:
            with self.vault_lock:
                self.vault.record_status(upstream.name, status, detail[:2000], capabilities)
        except (sqlite3.Error, CofferError) as exc:
            log.warning("[%s] could not record status: %s", upstream.name, exc)

    # events, as an Upstream sends them to its gateway
    def on_ready(self, upstream):
        counts = ", ".join(f"{len(items)} {kind}s" for kind, items in upstream.lists.items() if items)
        self._record(upstream, "ready", counts or "no capabilities", upstream.capabilities)
        self._settle(upstream, "ready")

    def on_down(self, upstream):
        if upstream.state == "failed":
            self._record(upstream, "failed", upstream.last_error or "")
            self._settle(upstream, "failed")

    def _settle(self, upstream, state: str) -> None:
        with self.done:
            self.settled.setdefault(upstream.name, state)
            self.done.notify_all()

    def on_list_changed(self, upstream, kind, items, notify):
        try:
            with self.vault_lock:
                self.vault.sync_capabilities(upstream.name, kind, items, upstream.rejected.get(kind))
        except (sqlite3.Error, CofferError) as exc:
            log.warning("[%s] could not record its %ss: %s", upstream.name, kind, exc)

    def on_notification(self, upstream, message):
        pass

    def on_request(self, upstream, message):
        upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "no client is connected"))


def say(text="") -> None:
    """Print for a human: known secrets redacted, terminal control characters made visible."""
    print(printable(redact(str(text))))


def say_json(value) -> None:
    print(redact(terminal_json(value)))


def _print_table(rows: list[list], headers: list[str]) -> None:
    cells = [[printable(redact(str(cell))).replace("\n", " ") for cell in row] for row in [headers] + rows]
    widths = [max(len(cell) for cell in column) for column in zip(*cells)]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _command_text(server: dict) -> str:
    if server.get("damaged"):
        return "(damaged definition)"
    if server["transport"] == "stdio":
        return " ".join(shlex.quote(p) for p in server["command"])
    return server["url"] + (f" ({server['transport']})" if server["transport"] != "http" else "")


def cmd_add(vault: Vault, args) -> int:
    env = dict(parse_env_assignment(item) for item in args.env)
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", key.strip()):
            raise CofferError(f"bad --header {item!r}: expected NAME=VALUE with NAME a valid HTTP header name")
        if any(c in value for c in "\r\n\x00"):
            raise CofferError(f"bad --header {key}: the value holds a line break")
        headers[key.strip()] = value
    if args.url:
        check_remote_url(args.url)
        if env:
            raise CofferError("--env is for servers Coffer starts; a remote server (--url) takes --header")
        if args.inherit_env:
            raise CofferError("--inherit-env is for servers Coffer starts, not for --url")
    elif headers:
        raise CofferError("--header is for remote servers (--url); a server Coffer starts takes --env")
    check_server_name(args.name)
    if vault.read_only:
        vault.transaction()  # says the vault is read-only, before any secret is stored
    planned: dict[str, str] = {}
    env, _ = plan_literals(args.name, env, vault.secrets, overwrite=args.replace, planned=planned)
    headers, _ = plan_literals(args.name, headers, vault.secrets, header=True, overwrite=args.replace,
                               planned=planned)
    url = plan_url_literals(args.name, args.url, vault.secrets, args.replace, planned)[0] if args.url else None
    earlier = vault.add_server(args.name, command=args.command or None, url=url, env=env, headers=headers,
                               cwd=args.cwd, policy=args.policy, timeout=args.timeout,
                               inherit_env=args.inherit_env, replace=args.replace, **remote_add_options(args))
    save_secrets(vault.secrets, planned)  # only now: a refused definition leaves the store as it was
    moved = list(planned)
    if earlier:
        say(f"kept the earlier choices for {earlier} of {args.name}'s tools, prompts and resources "
            "(coffer show / coffer enable to change them)")
    if moved:
        say(f"moved {len(moved)} literal value(s) into Coffer's secret store: "
            f"{', '.join('${' + name + '}' for name in moved)} (coffer secret list)")
    say(f"added {args.name}: {_command_text(vault.server(args.name))}")
    if args.url:
        if url_origin(args.url) and url_origin(args.url)[0] == "http" and not is_loopback_url(args.url) and headers:
            log.warning("%s: its headers (credentials?) will cross the network unencrypted over plain http to %s; "
                        "use https if the server offers it", args.name, origin_text(args.url))
        report_remote_added(vault, args.name, vault.secrets)
    elif args.command and not shutil.which(args.command[0]) and not os.path.dirname(args.command[0]):
        log.warning("%s: %r is not on PATH here; the server will fail to start until it is installed",
                    args.name, args.command[0])
    return 0


def cmd_remove(vault: Vault, args) -> int:
    vault.remove_server(args.name)
    vault.secrets.delete(oauth_secret_name(args.name))  # a login belongs to that server only
    say(f"removed {args.name}")
    return 0


def cmd_list(vault: Vault, args) -> int:
    counts = collections.Counter(row["server"] for row in vault.capabilities()
                                 if row["kind"] == "tool" and row["present"] and row["enabled"])
    held = collections.Counter(row["server"] for row in vault.pending_approvals())
    servers = [{"name": s["name"], "transport": s["transport"], "command": _command_text(s),
                "enabled": s["enabled"], "policy": s["policy"], "updates": s["updates"],
                "status": "damaged" if s["damaged"] else (s["status"] or "never started"),
                "detail": s["damaged"] or s["status_detail"], "since": s["status_at"], "tools": counts.get(s["name"], 0),
                "awaiting_approval": held.get(s["name"], 0)}
               for s in vault.servers()]
    if args.json:
        say_json({"servers": servers})
    elif not servers:
        say("no servers yet: coffer add NAME -- COMMAND [ARGS...]")
    else:
        _print_table([[s["name"], "yes" if s["enabled"] else "no", s["status"], s["tools"], s["command"]]
                      for s in servers], ["NAME", "ENABLED", "STATUS", "TOOLS", "COMMAND"])
        for s in servers:
            if s["status"] in ("failed", "damaged") and s["detail"]:
                say(f"\n{s['name']} {s['status']}: {s['detail']}")
            if s["awaiting_approval"]:
                say(f"\n{s['name']}: {s['awaiting_approval']} changed definition(s) held back until you run "
                    f"`coffer approve {s['name']}`")
    return 0


def cached_tools(vault: Vault) -> list[dict]:
    """The tools the last session saw, as a client would see them: enabled, approved, of enabled servers."""
    max_length = vault.setting("name_max_length")
    servers = {s["name"]: s for s in vault.servers()}
    by_server: dict[str, list[dict]] = collections.defaultdict(list)
    for row in vault.capabilities():
        if row["kind"] == "tool" and row["present"] and row["server"] in servers:
            by_server[row["server"]].append(row)
    tools = []
    for server, rows in by_server.items():
        if not servers[server]["enabled"]:
            continue
        names = exposed_names(server, [row["name"] for row in rows], max_length)
        for row in rows:
            state = _state(row)
            try:
                definition = json.loads(row["definition"] or "{}")
            except ValueError:
                continue
            if state.usable and isinstance(definition, dict):
                tools.append(dict(definition, name=names[row["name"]]))
    return tools


def cmd_tools(vault: Vault, args) -> int:
    """The catalogue as a client sees it: every server started (at most init_timeout each, one progress line per
    server on a terminal), or with --cached what the last session saw.  Exit 1 if a server failed."""
    failed = []
    if args.cached:
        tools = cached_tools(vault)
    else:
        interactive = sys.stderr.isatty()

        def progress(result: ProbeResult) -> None:
            if interactive:
                what = f"{len(result.tools)} tools" if result.state == "ready" else result.state
                print(printable(f"  {result.name}: {what} ({result.seconds:g}s)"), file=sys.stderr)

        results = ServerProbe(vault, progress=progress).run()
        tools = [tool for result in results for tool in result.tools]
        failed = [result for result in results if result.state != "ready"]
    mode = expose_mode(vault.settings(), client_family(args.client or ""))
    if mode.startswith("budget:"):
        tools = budget_tools(tools, int(mode.partition(":")[2]), vault.tool_usage())
    tools = [SEARCH_TOOL_DEFINITION] + (tools if mode != "search" else [])
    if args.json:
        say_json({"tools": tools, "failed": [{"server": r.name, "state": r.state, "reason": r.detail}
                                             for r in failed]})
    else:
        for tool in tools:
            description = (tool.get("description") or "").strip().splitlines()
            say(f"{tool['name']:<48}  {description[0][:100] if description else ''}")
    for result in failed:
        print(printable(redact(f"coffer: {result.name} {'did not start' if result.state == 'failed' else result.state}"
                               f": {result.detail or 'no reason given'}")), file=sys.stderr)
    return 1 if failed else 0


def cmd_enable(vault: Vault, args, enabled: bool = True) -> int:
    try:
        what = vault.set_enabled(args.target, enabled)
    except NotListedYet as exc:
        # Probably a server added but never started: ask that one server what it offers, then try once more.
        ServerProbe(vault, [args.target.partition(SEPARATOR)[0]]).run()
        try:
            what = vault.set_enabled(args.target, enabled)
        except NotListedYet:
            raise CofferError(str(exc)) from None
    say(f"{'enabled' if enabled else 'disabled'} {what}")
    return 0


def cmd_approve(vault: Vault, args) -> int:
    if args.target is None:
        pending = vault.pending_approvals()
        if not pending:
            say("nothing is waiting for approval")
        for row in pending:
            say(f"{row['kind']} {row['server']}:{row['name']} changed since it was approved")
        return 0
    approved = vault.approve(args.target)
    if not approved:
        say(f"{args.target}: nothing is waiting for approval")
    for label, diff in approved:
        say(f"approved {label}; what changed:\n{diff or '(no visible difference)'}\n")
    return 0


def cmd_policy(vault: Vault, args) -> int:
    vault.set_policy(args.server, args.policy)
    say({"enabled": f"new capabilities of {args.server} will be enabled",
         "disabled": f"new capabilities of {args.server} will be disabled",
         "trust-updates": f"changed definitions from {args.server} apply without approval",
         "pin-updates": f"changed definitions from {args.server} wait for `coffer approve`"}[args.policy])
    return 0


def cmd_secret(vault: Vault, args) -> int:
    store = vault.secrets
    if args.action == "list":
        names = store.names()
        if args.json:
            say_json({"secrets": names})
        else:
            say("\n".join(names) if names else "no secrets stored: coffer secret set NAME")
        return 0
    if not args.name:
        raise CofferError(f"coffer secret {args.action} needs a NAME")
    if args.action == "rm":
        if not store.delete(args.name):
            raise CofferError(f"no secret named {args.name!r}{_did_you_mean(args.name, store.names())}")
        vault_audit(vault, "secret-remove", args.name)
        say(f"removed secret {args.name}")
        return 0
    if sys.stdin.isatty():
        import getpass
        value = getpass.getpass(f"value for {args.name} (not shown): ")
    else:
        value = sys.stdin.read((64 << 10) + 1).rstrip("\r\n")
    if not value:
        raise CofferError("empty value: nothing stored")
    store.set(args.name, value)
    vault_audit(vault, "secret-set", args.name)
    say(f"stored secret {args.name}; refer to it as ${{{args.name}}} in --env or --header")
    return 0


def vault_audit(vault: Vault, action: str, target: str, detail: str | None = None) -> None:
    """An audit row for a change made outside coffer.db (the secret store): the name, never the value."""
    try:
        with vault.transaction() as db:
            vault._audit(db, action, target, detail)
    except CofferError:
        pass  # a read-only vault cannot record it; the change itself was made


def cmd_call(vault: Vault, args) -> int:
    try:
        arguments = decode_json(args.arguments) if args.arguments is not None else {}
    except ValueError as exc:
        raise CofferError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise CofferError("arguments must be a JSON object, e.g. '{\"timezone\": \"UTC\"}'")
    server = args.tool.partition(SEPARATOR)[0]
    with GatewayClient(vault, only=[server] if args.tool != SEARCH_TOOL else None) as client:
        try:
            result = client.call("tools/call", {"name": args.tool, "arguments": arguments})
        except UpstreamFailure as exc:
            raise CofferError(str(exc).replace("tools/call failed: ", "")) from None
    say_json(result)
    return 1 if isinstance(result, dict) and result.get("isError") else 0


def _ms(value) -> str:
    return f"{value:.1f}ms" if isinstance(value, (int, float)) else str(value)


def cmd_log(vault: Vault, args) -> int:
    rows = vault.invocations(args.limit)
    if args.json:
        say_json({"invocations": rows})
    else:
        _print_table([[r["ts"], r["client"], r["server"] or "", r["capability"], r["kind"], _ms(r["duration_ms"]),
                       r["status"], r["error"] or ""] for r in rows],
                     ["TIME", "CLIENT", "SERVER", "CAPABILITY", "KIND", "DURATION", "STATUS", "ERROR"])
    return 0


def cmd_audit(vault: Vault, args) -> int:
    since = args.since
    if since:
        try:
            since = datetime.fromisoformat(since.replace("Z", "+00:00")).astimezone(timezone.utc).isoformat(
                timespec="milliseconds").replace("+00:00", "Z") if "T" in since or " " in since else \
                datetime.fromisoformat(since).date().isoformat()
        except ValueError:
            raise CofferError(f"--since {since!r}: use a date like 2026-11-30 or a time like 2026-11-30T12:00") \
                from None
    rows = vault.audit_rows(args.limit, since, args.kind, args.server)
    if args.json:
        say_json({"audit": rows})
    else:
        _print_table([[r["ts"], r["actor"], r["action"], r["target"] or "", r["detail"] or ""] for r in rows],
                     ["TIME", "ACTOR", "ACTION", "TARGET", "DETAIL"])
    return 0


def cmd_config(vault: Vault, args) -> int:
    if args.key and args.value is not None:
        vault.set_setting(args.key, args.value)
    settings = vault.settings()
    if args.key and args.key not in settings:
        if setting_key(args.key) != args.key:
            settings[args.key] = f"(not set: the global expose, {settings['expose']})"
        else:
            raise CofferError(f"unknown setting {args.key!r}{_did_you_mean(args.key, DEFAULTS)}; "
                              f"known: {', '.join(sorted(DEFAULTS))}")
    if args.json:
        say_json({args.key: settings[args.key]} if args.key else settings)
        return 0
    for key in [args.key] if args.key else sorted(settings):
        say(f"{key} = {settings[key]}")
    return 0


def add_remote_arguments(p) -> None:
    """The `coffer add` options for remote servers (call from build_parser after --url/--header)."""
    p.add_argument("--transport", choices=REMOTE_TRANSPORTS, default=None,
                   help="with --url: auto (default) asks the server; http = Streamable HTTP; sse = the legacy "
                        "HTTP+SSE transport (2024-11-05)")
    p.add_argument("--oauth-client-id", metavar="ID",
                   help="with --url: an OAuth client you registered with the server's provider (else Coffer uses a "
                        "client metadata document or registers itself)")
    p.add_argument("--oauth-client-secret-env", metavar="VAR",
                   help="the variable (environment, then `coffer secret`) holding that client's secret; the secret "
                        "itself is never stored by Coffer")


def add_auth_command(command) -> None:
    """`coffer auth NAME [--logout]` (call from build_parser: ``add_auth_command(command)``)."""
    p = command("auth", cmd_auth, "log in to an OAuth-protected remote server in your browser (or --logout)")
    p.add_argument("name")
    p.add_argument("--logout", action="store_true", help="forget the saved login (and revoke it where possible)")
    p.add_argument("--scope", help="ask for these scopes (space-separated) instead of what the server suggests")
    p.add_argument("--oauth-client-id", metavar="ID", help="use (and remember) this pre-registered OAuth client")
    p.add_argument("--oauth-client-secret-env", metavar="VAR", help="the variable holding its secret")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the browser (default 300)")
    p.add_argument("--no-browser", action="store_true", help="only print the address to open")


def remote_add_options(args) -> dict:
    """What cmd_add passes to Vault.add_server for a remote server: transport and the OAuth client settings."""
    if not args.url:
        if args.transport or args.oauth_client_id or args.oauth_client_secret_env:
            raise CofferError("--transport and --oauth-* go with --url")
        return {}
    if args.oauth_client_secret_env and not ENV_KEY_RE.match(args.oauth_client_secret_env):
        raise CofferError("--oauth-client-secret-env takes a variable name, not a secret")
    if args.oauth_client_secret_env and not args.oauth_client_id:
        raise CofferError("--oauth-client-secret-env goes with --oauth-client-id")
    oauth = {key: value for key, value in (("client_id", args.oauth_client_id),
                                           ("client_secret_env", args.oauth_client_secret_env)) if value}
    return {"transport": args.transport or "auto", "oauth": oauth or None}


def report_remote_added(vault: Vault, name: str, store) -> None:
    """After `coffer add --url`: ask the server which transport it speaks (transport auto) and whether it needs
    a login, and say so.  Nothing here is fatal: an unreachable server is detected at its first start."""
    server = vault.server(name)
    if server["transport"] != "auto":
        return
    missing: list[str] = []
    url = expand_vars(server["url"], missing=missing, secrets=store)
    headers = {k: expand_vars(v, missing=missing, secrets=store) for k, v in server["headers"].items()}
    own_authorization = any(key.lower() == "authorization" for key in headers)
    auth = None if own_authorization else OAuthCredentials(name, url, store)
    try:
        probe = probe_transport(name, url, headers, auth, timeout=10.0)
    except NeedsLogin as exc:
        vault.record_status(name, "failed", str(exc))  # `list` and the agent's instructions say so at once
        say(f"{name} needs a login: run `coffer auth {name}`")
        return
    except UpstreamFailure as exc:
        say(f"could not ask {name} which transport it speaks now ({printable(redact(str(exc)))[:300]}); "
              "it will be detected at its first start")
        return
    vault.set_transport(name, probe.kind)
    say(f"{name} speaks {probe.detail}")


def cmd_auth(vault: Vault, args) -> int:
    server = vault.server(args.name)
    if server["transport"] == "stdio":
        raise CofferError(f"{args.name} is a local (stdio) server: it takes credentials from --env, not a login")
    store = vault.secrets
    key = oauth_secret_name(args.name)
    if args.logout:
        text = store.get(key)
        if text is None:
            say(f"{args.name} had no saved login")
            return 0
        try:
            grant = OAuthGrant.from_text(text)
            redact.add(*grant.secret_values())
            outcome = revoke_grant(grant, store)
        except (ValueError, TypeError):
            outcome = "the saved login was damaged"
        store.delete(key)
        vault.set_oauth(args.name, dict(server.get("oauth") or {}, login_at=None))
        say(f"logged out of {args.name} ({outcome})")
        return 0
    missing: list[str] = []
    url = expand_vars(server["url"], missing=missing, secrets=store)
    headers = {k: expand_vars(v, missing=missing, secrets=store) for k, v in server["headers"].items()}
    if any(k.lower() == "authorization" for k in headers):
        raise CofferError(f"{args.name} is configured with its own Authorization header (--header); remove it "
                          "to log in with OAuth")
    oauth = dict(server.get("oauth") or {})
    if args.oauth_client_id:
        oauth["client_id"] = args.oauth_client_id
        oauth.pop("client_secret_env", None)
    if args.oauth_client_secret_env:
        if not ENV_KEY_RE.match(args.oauth_client_secret_env):
            raise CofferError("--oauth-client-secret-env takes a variable name, not a secret")
        oauth["client_secret_env"] = args.oauth_client_secret_env
    interactive = sys.stdin is not None and sys.stdin.isatty()
    try:
        grant = oauth_login(args.name, url, headers, oauth, store, vault.settings(), out=sys.stderr,
                            open_browser=(lambda address: False) if args.no_browser else None,
                            stdin=sys.stdin if interactive else None, timeout=args.timeout, scope=args.scope)
    except UpstreamFailure as exc:
        raise CofferError(f"login to {args.name} failed: {exc}") from None
    except OAuthFailure as exc:
        raise CofferError(f"login to {args.name} failed: {exc}") from None
    if server["transport"] == "auto":
        try:
            probe = probe_transport(args.name, url, headers, OAuthCredentials(args.name, url, store), 15.0)
            vault.set_transport(args.name, probe.kind)
        except UpstreamFailure as exc:
            log.warning("[%s] logged in, but could not ask which transport it speaks: %s", args.name, exc)
    # Last, so a running gateway restarts the server once, with the new token (it compares the oauth column).
    vault.set_oauth(args.name, dict(oauth, login_at=utcnow()))
    vault.record_status(args.name, "logged in", "waiting for its next start")
    say(f"logged in to {args.name}" + (f" (scopes: {printable(grant.scope)[:300]})" if grant.scope else ""))
    return 0


def open_knowledge(vault: Vault) -> KnowledgeBase:
    """The knowledge base for a CLI command: no embedder (a running gateway embeds in the background)."""
    return KnowledgeBase(vault.path, vault.home)


def cmd_knowledge(vault: Vault, args) -> int:
    if vault.read_only and args.action != "list":
        vault.transaction()  # says why
    kb = open_knowledge(vault)
    try:
        if args.action == "add":
            if not args.target:
                raise CofferError("coffer knowledge add PATH [--name NAME] [--glob PATTERN]...")
            stats = kb.add_source(args.target, args.name, args.glob or None)
            vault_audit(vault, "knowledge-add", stats.source, os.path.abspath(os.path.expanduser(args.target)))
            say(f"added knowledge source {stats.source}: {stats.passages_added} passages from {stats.files_seen} files"
                + (f" (skipped: {', '.join(f'{n} {why}' for why, n in stats.skipped.items())})" if stats.skipped
                   else ""))
            if vault.setting("memory") != "on":
                say("agents find it with coffer__ask (memory notes too, after: coffer config memory on)")
        elif args.action == "remove":
            if not args.target:
                raise CofferError("coffer knowledge remove NAME")
            kb.remove_source(args.target)
            vault_audit(vault, "knowledge-remove", args.target)
            say(f"removed knowledge source {args.target}")
        elif args.action == "reindex":
            for stats in kb.reindex(args.target):
                say(f"{stats.source}: {stats.files_seen} files, {stats.files_added} added, {stats.files_changed} "
                    f"changed, {stats.files_removed} removed, {stats.files_unchanged} unchanged ({stats.seconds:g}s)")
        else:
            rows = [source._asdict() for source in kb.sources()]
            if args.json:
                say_json({"sources": rows})
            elif not rows:
                say("no knowledge sources yet: coffer knowledge add PATH")
            else:
                _print_table([[r["name"], r["files"], r["passages"], r["indexed_at"] or "", r["root"]] for r in rows],
                             ["NAME", "FILES", "PASSAGES", "INDEXED", "ROOT"])
    finally:
        kb.close()
    return 0


def cmd_memory(vault: Vault, args) -> int:
    if vault.read_only and args.action == "rm":
        vault.transaction()
    kb = open_knowledge(vault)
    try:
        if args.action == "list":
            notes = kb.memories()
            if args.json:
                say_json({"memories": [note._asdict() for note in notes]})
            elif not notes:
                say("no memories yet" + ("" if vault.setting("memory") == "on" else
                                         " (agents can keep some after: coffer config memory on)"))
            else:
                _print_table([[n.id, n.time, n.client, ",".join(n.tags), n.text.splitlines()[0][:60]
                               if n.text else ""] for n in notes], ["ID", "CREATED", "CLIENT", "TAGS", "TEXT"])
            return 0
        if not args.id:
            raise CofferError(f"coffer memory {args.action} ID (coffer memory list shows them)")
        if args.action == "show":
            note = kb.memory(args.id)
            say_json(note._asdict()) if args.json else say(note.text)
        elif not kb.forget(args.id):
            raise CofferError(f"no memory {args.id!r}")
        else:
            vault_audit(vault, "memory-remove", args.id)
            say(f"forgot {args.id}")
    finally:
        kb.close()
    return 0


def cmd_serve(vault: Vault, args) -> int:
    vault.actor = "gateway"

    def client_gone():
        gateway.shutdown()
        os._exit(0)  # the main thread is blocked reading a client that will never write again

    gateway = Gateway(vault, remember=not args.live, on_client_gone=client_gone, only=args.only)

    def on_signal(signum, frame):
        if not gateway._stopping.is_set():  # a second signal must not interrupt the shutdown itself
            raise SystemExit(0)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_signal)
    try:
        if sys.stdin.isatty() and sys.stderr.isatty():
            log.info("coffer serve speaks MCP on stdin/stdout and waits for a client; an agent starts it itself "
                     "(e.g. `claude mcp add coffer -- coffer serve`). Ctrl-C to quit.")
        gateway.serve(sys.stdin.buffer)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        gateway.shutdown()
    return 0


EPILOG = """
examples:
  coffer add time -- uvx mcp-server-time
  coffer secret set GITHUB_TOKEN          (asks for the value; or pipe it in)
  coffer add gh --env GITHUB_TOKEN='${GITHUB_TOKEN}' -- npx -y @modelcontextprotocol/server-github
  coffer add docs --url https://example.com/mcp --header 'Authorization=Bearer ${DOCS_TOKEN}'
  coffer add linear --url https://mcp.linear.app/sse && coffer auth linear
  coffer list
  coffer tools
  coffer disable time__convert_time
  coffer call time__get_current_time '{"timezone": "UTC"}'
  coffer log --limit 20

agent configuration (Claude Code, Codex, Cursor, Claude Desktop): one stdio server whose command is
`coffer serve` (or `python /path/to/coffer.py serve`).

data: $COFFER_HOME (default ~/.coffer, private: 0700) holds coffer.db and secrets.json.  ${VAR} and
${VAR:-default} in --env, --header, the URL and the command are stored as written and resolved when the server
starts: from Coffer's environment first, then from its secret store (coffer secret set).  A literal value given
to --env or --header is moved into the secret store and replaced by a reference, so no secret reaches coffer.db.
Prefer --env over command arguments for secrets: arguments are visible to every local user in `ps`.
A server started by Coffer sees only a minimal environment (PATH, HOME, locale, proxy and certificate settings,
package-manager settings) plus its own --env; --inherit-env NAME passes more.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coffer", description="Coffer: register MCP servers once, use them from every agent.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"coffer {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    def command(name, handler, help_text, **kwargs):
        p = sub.add_parser(name, help=help_text, description=help_text, **kwargs)
        p.set_defaults(handler=handler)
        return p

    p = command("add", cmd_add, "register an upstream server: NAME [options] -- COMMAND [ARGS...], or --url URL",
                usage="coffer add NAME [--env KEY=VALUE]... [--inherit-env NAME]... [--timeout S] [--policy P] "
                      "-- COMMAND [ARGS...]\n       coffer add NAME --url URL [--header NAME=VALUE]...",
                epilog="Secrets: write --env KEY='${NAME}' and keep the value in the environment or in `coffer "
                       "secret set NAME`; a literal value is moved into the secret store for you.  ${VAR} in the "
                       "command's arguments works too, but arguments are visible to other local users in `ps`: "
                       "prefer --env.")
    p.add_argument("name", help="server name: 1-24 letters, digits or '-'; becomes the <server>__ prefix")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server; ${VAR} is resolved at start, a literal value goes to the "
                        "secret store")
    p.add_argument("--inherit-env", action="append", default=[], metavar="NAME",
                   help="also pass this variable of Coffer's own environment ('*': all of it)")
    p.add_argument("--url", help="a remote server (Streamable HTTP or the legacy HTTP+SSE transport)")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="HTTP header (with --url); a literal value goes to the secret store")
    add_remote_arguments(p)
    p.add_argument("--cwd", help="working directory for the server process")
    p.add_argument("--timeout", type=float, help="per-call timeout in seconds (default: the call_timeout setting)")
    p.add_argument("--policy", choices=("enabled", "disabled"),
                   help="whether tools the server adds later start enabled (default) or disabled")
    p.add_argument("--replace", action="store_true",
                   help="change the definition of a server already registered, keeping its choices")
    p.set_defaults(command=[])
    command("remove", cmd_remove, "unregister a server").add_argument("name")
    add_auth_command(command)
    p = command("list", cmd_list, "registered servers, their status and tool counts")
    p.add_argument("--json", action="store_true")
    p = command("tools", cmd_tools, "the aggregated tool catalogue, as a client sees it (starts every server)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cached", action="store_true", help="what the last session saw, without starting servers")
    p.add_argument("--client", metavar="NAME", help="as this client is shown it (cursor, windsurf, vscode, ...)")
    command("enable", cmd_enable, "enable a server, tool, prompt or resource").add_argument("target")
    command("disable", lambda v, a: cmd_enable(v, a, False),
            "disable a server, tool, prompt or resource (kept across restarts and upgrades)").add_argument("target")
    p = command("approve", cmd_approve, "accept a changed tool/prompt/resource definition after reading the diff "
                                        "(a server name approves all of its changes; no target lists them)")
    p.add_argument("target", nargs="?")
    p = command("policy", cmd_policy, "what a server's new capabilities start as (enabled|disabled), and whether "
                                      "its changed definitions apply at once (trust-updates) or wait for `coffer "
                                      "approve` (pin-updates, the default)")
    p.add_argument("server")
    p.add_argument("policy", choices=("enabled", "disabled", "trust-updates", "pin-updates"))
    p = command("secret", cmd_secret, "the secret store: set NAME (prompted, or from stdin), list, rm NAME")
    p.add_argument("action", choices=("set", "list", "rm"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p = command("knowledge", cmd_knowledge, "folders of notes and docs agents search with coffer__ask: "
                                            "add PATH [--name N] [--glob G]..., list, remove NAME, reindex [NAME]")
    p.add_argument("action", choices=("add", "list", "remove", "reindex"))
    p.add_argument("target", nargs="?", metavar="PATH|NAME")
    p.add_argument("--name", help="the source's name (default: the folder's name)")
    p.add_argument("--glob", action="append", metavar="PATTERN",
                   help=f"which files (default: {' '.join(KNOWLEDGE_DEFAULT_GLOBS)}); repeatable")
    p.add_argument("--json", action="store_true")
    p = command("memory", cmd_memory, "facts agents kept with coffer__remember (coffer config memory on): "
                                      "list, show ID, rm ID")
    p.add_argument("action", choices=("list", "show", "rm"))
    p.add_argument("id", nargs="?")
    p.add_argument("--json", action="store_true")
    p = command("call", cmd_call, "call one tool through the gateway and print its result (for scripts)")
    p.add_argument("tool")
    p.add_argument("arguments", nargs="?", help="a JSON object (default {})")
    for name, handler, text in (("log", cmd_log, "recent invocations (never arguments or results)"),
                                ("audit", cmd_audit, "every change to the vault, newest last")):
        p = command(name, handler, text)
        p.add_argument("--json", action="store_true")
        p.add_argument("--limit", type=int, default=50)
    p.add_argument("--since", metavar="DATE", help="only rows from this date or time on (2026-11-30[T12:00])")
    p.add_argument("--kind", metavar="ACTION", help="only this action (add, disable, approve, upstream, ...)")
    p.add_argument("--server", metavar="NAME", help="only rows about this server")
    p = command("config", cmd_config, "show or change a setting")
    p.add_argument("key", nargs="?")
    p.add_argument("value", nargs="?")
    p.add_argument("--json", action="store_true")
    p = command("serve", cmd_serve, "run the MCP gateway on stdio (what an agent's config runs)")
    p.add_argument("--live", action="store_true",
                   help="list only what started servers offer now; by default a server still starting is "
                        "listed as it was at its last start, and a change is announced when it is up")
    p.add_argument("--only", action="append", metavar="SERVER", help=argparse.SUPPRESS)
    add_client_commands(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging("info" if argv[:1] == ["serve"] else "warning")
    trailing: list[str] = []
    if argv[:1] == ["add"] and "--" in argv:
        split = argv.index("--")
        argv, trailing = argv[:split], argv[split + 1:]
        if not trailing:
            print("coffer: error: nothing after '--': give the command that starts the server", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    if trailing:
        args.command = trailing
    if getattr(args, "limit", 1) is not None and getattr(args, "limit", 1) < 1:
        parser.error("--limit must be at least 1")
    vault = None
    try:
        vault = Vault()
        return args.handler(vault, args)
    except KeyboardInterrupt:
        print("coffer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `coffer ... | head`: the reader had enough
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except CofferError as exc:
        print(printable(redact(f"coffer: error: {exc}")), file=sys.stderr)
        return 1
    except sqlite3.Error as exc:
        where = f" under {coffer_home()}" if vault is None else ""
        print(printable(redact(f"coffer: error: the vault{where}: {exc}")), file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - a bug: one line for the user, the traceback with COFFER_LOG=debug
        log.exception("internal error")
        return 1
    finally:
        if vault is not None:
            vault.close()


if __name__ == "__main__":
    sys.exit(main())
