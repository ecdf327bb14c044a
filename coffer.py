#!/usr/bin/env python3
"""Coffer: a local-first MCP gateway.

Register your MCP servers once; every agent (Claude Code, Codex, Cursor, Claude Desktop) runs one entry,
``coffer serve``, and sees every upstream's tools, resources and prompts, namespaced ``<server>__<tool>``.
``coffer__search_tools`` finds the right tool by intent when the catalogue is too large to read.

One module, standard library only.  Sections, in the order data flows through them:

    1. protocol constants and small helpers
    2. naming (exposed names, resource URIs) and ${VAR} expansion
    3. vault: coffer.db (servers, capability choices, invocation and audit logs)
    4. transports (stdio subprocess, Streamable HTTP) and the upstream supervisor
    5. catalogue: the merged, namespaced, filtered view of all upstreams
    6. search: the BM25F ranker behind coffer__search_tools
    7. gateway session: the MCP server a client talks to
    8. command line
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import heapq
import json
import math
import os
import queue
import re
import select
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import unicodedata
from datetime import datetime, timedelta, timezone

__version__ = "0.1.0"

# ============================================================================================================
# 1. Protocol constants and small helpers
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
SERVER_NAME_RE = re.compile(r"^[a-zA-Z0-9-]{1,24}$")
EXPOSED_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
QUALIFIED_URI_RE = re.compile(r"^coffer\+([a-zA-Z0-9-]{1,24}):(.+)$", re.S)

DEFAULTS = {
    "name_max_length": 48,          # leaves room for a client prefix such as mcp__<key>__ within 64
    "discovery_timeout": 5.0,       # seconds a list request waits for a starting upstream
    "call_timeout": 120.0,          # seconds a request may go without a reply or progress
    "init_timeout": 60.0,           # seconds an upstream may take to answer initialize
    "max_restarts": 5,              # consecutive failed starts before an upstream is marked failed
    "retention_invocations_days": 30,
    "retention_audit_days": 365,
    "expose": "all",                # "all": full catalogue plus search; "search": only coffer__search_tools
    "embedder_url": "",             # e.g. http://127.0.0.1:11434/v1 (OpenAI-compatible) or an Ollama base URL
    "embedder_model": "",
    "embedder_api": "openai",       # "openai" (POST {url}/embeddings) or "ollama" (POST {url}/api/embed)
    "embedder_key_env": "",         # name of the environment variable holding the API key (never the key)
    "embedder_timeout": 1.0,        # seconds a query may wait for its embedding before BM25 answers alone
}

INSTRUCTIONS = (
    "Coffer is a gateway: the tools, prompts and resources of several MCP servers appear here, named "
    "<server>__<name>. When you are unsure which tool fits, call coffer__search_tools with what you want to do "
    "in plain words (e.g. 'create a GitHub issue'); it returns the best-matching real tools with their input "
    "schemas, which you then call by name."
)


# One encoder for every message: json.dumps with non-default options builds a new one per call (~2 us a hop).
dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def utcnow() -> str:
    return iso_timestamp(time.time())


def iso_timestamp(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def read_line_bursts(read, size: int = 1 << 16):
    """Yield, per system call, the list of complete lines that arrived together (without their newlines).

    ``read(size)`` must return what is available now (one ``os.read``), b"" at EOF.  An unterminated last
    line is yielded at EOF like any other.
    """
    partial: list[bytes] = []
    while True:
        chunk = read(size)
        if not chunk:
            if partial:
                yield [b"".join(partial)]
            return
        if b"\n" not in chunk:
            partial.append(chunk)
            continue
        lines = chunk.split(b"\n")
        if partial:
            partial.append(lines[0])
            lines[0] = b"".join(partial)
            partial = []
        tail = lines.pop()
        if tail:
            partial.append(tail)
        yield lines


# Messages that arrive together are answered together: while a reader thread handles one burst of lines, a
# writer may hold its output and write it once at the end, so a busy client gets its replies in one write
# (and parses them in one read) instead of one system call each.
_burst = threading.local()


def handle_burst(lines: list[bytes], handle) -> None:
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


def warn(message: str) -> None:
    """Every diagnostic goes to stderr: stdout belongs to the JSON-RPC stream."""
    try:
        sys.stderr.write(f"coffer: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class CofferError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits 1."""


class NotListedYet(CofferError):
    """A capability name on a registered server that Coffer has not seen listed (yet)."""


def negotiate_version(requested) -> str:
    return requested if requested in PROTOCOL_VERSIONS else LATEST_PROTOCOL_VERSION


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


def valid_request_id(value) -> bool:
    return (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))) and (
        len(value) <= 512 if isinstance(value, str) else abs(value) < 2**63
    )


# ============================================================================================================
# 2. Naming and ${VAR} expansion
# ============================================================================================================


def check_server_name(name: str) -> str:
    if not isinstance(name, str) or not SERVER_NAME_RE.match(name):
        raise CofferError(f"invalid server name {name!r}: use 1-24 letters, digits or '-'")
    if name.lower() == RESERVED_SERVER:
        raise CofferError(f"server name {name!r} is reserved for Coffer's own tools")
    return name


def expose_name(server: str, name: str, max_length: int = DEFAULTS["name_max_length"]) -> str:
    """``<server>__<name>``, shortened stably when too long or not a legal MCP tool name.

    The shortened form keeps the readable start of the name and appends six hex digits of its hash, so the same
    upstream name always maps to the same exposed name across restarts and machines.
    """
    full = f"{server}{SEPARATOR}{name}"
    if len(full) <= max_length and EXPOSED_NAME_RE.match(full):
        return full
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:6]
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    room = max(1, max_length - len(server) - len(SEPARATOR) - 7)
    return f"{server}{SEPARATOR}{safe[:room].rstrip('_') or 'x'}_{digest}"


def qualify_uri(server: str, uri: str) -> str:
    """The exposed form of a resource URI that two upstreams both publish."""
    return f"coffer+{server}:{uri}"


_ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_vars(value: str, environ=None, missing=None) -> str:
    """Expand ``${VAR}`` and ``${VAR:-default}`` from the gateway's environment at spawn time.

    Values are stored unexpanded, so a secret only ever exists in the gateway's and the upstream's memory.
    Names of unset variables without a default are appended to ``missing``.
    """
    environ = os.environ if environ is None else environ

    def replace(match):
        name, default = match.group(1), match.group(2)
        current = environ.get(name)
        if current is None or (current == "" and default is not None):
            if default is None and missing is not None:
                missing.append(name)
            return default or ""
        return current

    return _ENV_REF_RE.sub(replace, value)


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
    transport TEXT NOT NULL,                 -- 'stdio' or 'http'
    command TEXT,                            -- JSON argv, unexpanded
    url TEXT,
    env TEXT NOT NULL DEFAULT '{}',          -- JSON, unexpanded (${VAR} references, never secrets)
    headers TEXT NOT NULL DEFAULT '{}',      -- JSON, unexpanded
    cwd TEXT,
    enabled INTEGER NOT NULL DEFAULT 1,
    policy TEXT NOT NULL DEFAULT 'enabled',  -- what a capability seen for the first time gets
    timeout REAL,                            -- per-call timeout in seconds; NULL = the global default
    position INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    status TEXT, status_detail TEXT, status_at TEXT,
    capabilities TEXT                        -- JSON: what the server advertised at its last initialize
);
CREATE TABLE IF NOT EXISTS capabilities (
    server TEXT NOT NULL,
    kind TEXT NOT NULL,                      -- tool, prompt, resource, template
    name TEXT NOT NULL,                      -- the upstream's own name or URI
    enabled INTEGER NOT NULL,
    present INTEGER NOT NULL DEFAULT 1,      -- 0 once the upstream stops listing it; the choice is kept
    fingerprint TEXT,
    definition TEXT,                         -- last advertised definition (schemas, never call data)
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
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

CAPABILITY_KINDS = ("tool", "prompt", "resource", "template")


def coffer_home() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("COFFER_HOME") or os.path.join("~", ".coffer")))


def fingerprint(definition: dict) -> str:
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode("utf-8")).hexdigest()[:16]


class Vault:
    """coffer.db: the registered servers, the user's choices, and the logs.

    Every change is one transaction.  Many processes share the file (several ``coffer serve`` plus the CLI), so
    it runs in WAL mode with a busy timeout, and writers keep their transactions short.
    """

    def __init__(self, home: str | None = None, actor: str = "cli"):
        self.home = home or coffer_home()
        os.makedirs(self.home, exist_ok=True)
        self.path = os.path.join(self.home, "coffer.db")
        self.actor = actor
        self.db = self._connect(self.path)
        with self.db:
            self.db.executescript(SCHEMA)
            columns = {row["name"] for row in self.db.execute("PRAGMA table_info(servers)")}
            if "capabilities" not in columns:  # a vault written by an earlier Coffer
                self.db.execute("ALTER TABLE servers ADD COLUMN capabilities TEXT")

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA busy_timeout=10000")
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            pass  # another process is switching it right now; WAL is persistent, so it is already set
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def transaction(self):
        return _Transaction(self.db)

    def close(self) -> None:
        self.db.close()

    # -- settings ------------------------------------------------------------------------------------------
    def setting(self, key: str):
        row = self.db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else DEFAULTS.get(key)

    def settings(self) -> dict:
        current = dict(DEFAULTS)
        for row in self.db.execute("SELECT key, value FROM settings"):
            current[row["key"]] = json.loads(row["value"])
        return current

    def set_setting(self, key: str, raw: str) -> None:
        if key not in DEFAULTS:
            raise CofferError(f"unknown setting {key!r}; known: {', '.join(sorted(DEFAULTS))}")
        value = _coerce_setting(key, raw)
        with self.transaction() as db:
            old = self.setting(key)
            db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)", (key, json.dumps(value)))
            self._audit(db, "config", key, f"{old!r} -> {value!r}")

    # -- servers -------------------------------------------------------------------------------------------
    def add_server(self, name, *, command=None, url=None, env=None, headers=None, cwd=None, policy="enabled",
                   timeout=None) -> None:
        check_server_name(name)
        if bool(command) == bool(url):
            raise CofferError("give either a command after '--' (stdio) or --url (Streamable HTTP)")
        if policy not in ("enabled", "disabled"):
            raise CofferError(f"bad policy {policy!r}: use 'enabled' or 'disabled'")
        if timeout is not None and not (timeout > 0):
            raise CofferError("--timeout must be a positive number of seconds")
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM servers WHERE lower(name)=lower(?)", (name,)).fetchone():
                raise CofferError(f"server {name!r} already exists; remove it first or pick another name")
            position = db.execute("SELECT coalesce(max(position), 0) + 1 FROM servers").fetchone()[0]
            db.execute(
                "INSERT INTO servers(name, transport, command, url, env, headers, cwd, policy, timeout, position,"
                " created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (name, "http" if url else "stdio", json.dumps(command) if command else None, url,
                 json.dumps(env or {}), json.dumps(headers or {}), cwd, policy, timeout, position, utcnow()))
            target = url or " ".join(shlex.quote(part) for part in command)
            self._audit(db, "add", name, target)

    def remove_server(self, name: str) -> None:
        with self.transaction() as db:
            self._require_server(db, name)
            db.execute("DELETE FROM servers WHERE name=?", (name,))
            db.execute("DELETE FROM capabilities WHERE server=?", (name,))
            self._audit(db, "remove", name, None)

    def servers(self) -> list[dict]:
        return [_server_row(row) for row in self.db.execute("SELECT * FROM servers ORDER BY position")]

    def server(self, name: str) -> dict:
        row = self.db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}")
        return _server_row(row)

    def set_policy(self, name: str, policy: str) -> None:
        if policy not in ("enabled", "disabled"):
            raise CofferError(f"bad policy {policy!r}: use 'enabled' or 'disabled'")
        with self.transaction() as db:
            old = self._require_server(db, name)["policy"]
            db.execute("UPDATE servers SET policy=? WHERE name=?", (policy, name))
            self._audit(db, "policy", name, f"{old} -> {policy}")

    def record_status(self, name: str, status: str, detail: str | None, capabilities: dict | None = None) -> None:
        with self.transaction() as db:
            db.execute("UPDATE servers SET status=?, status_detail=?, status_at=?,"
                       " capabilities=coalesce(?, capabilities) WHERE name=?",
                       (status, detail, utcnow(), dumps(capabilities) if capabilities is not None else None, name))

    @staticmethod
    def _require_server(db, name):
        row = db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}")
        return row

    # -- enable / disable ----------------------------------------------------------------------------------
    def set_enabled(self, target: str, enabled: bool) -> str:
        """Enable or disable a server (by name) or one capability (by exposed name, or resource URI)."""
        verb = "enable" if enabled else "disable"
        with self.transaction() as db:
            row = db.execute("SELECT name, enabled FROM servers WHERE name=?", (target,)).fetchone()
            if row:
                db.execute("UPDATE servers SET enabled=? WHERE name=?", (int(enabled), target))
                self._audit(db, verb, target, "server")
                return f"server {target}"
            server, kind, name = self._resolve_capability(db, target)
            db.execute("UPDATE capabilities SET enabled=? WHERE server=? AND kind=? AND name=?",
                       (int(enabled), server, kind, name))
            self._audit(db, verb, f"{server}{SEPARATOR}{name}" if kind in ("tool", "prompt") else target, kind)
            return f"{kind} {target}"

    def _resolve_capability(self, db, target: str):
        max_length = self.setting("name_max_length")
        qualified = QUALIFIED_URI_RE.match(target)
        if qualified:
            rows = db.execute("SELECT server, kind, name FROM capabilities WHERE server=? AND name=? AND kind IN"
                              " ('resource','template')", qualified.groups()).fetchall()
            if rows:
                return tuple(rows[0])
        server, sep, _ = target.partition(SEPARATOR)
        if sep:
            for row in db.execute("SELECT server, kind, name FROM capabilities WHERE server=? AND kind IN"
                                  " ('tool','prompt') ORDER BY kind DESC", (server,)):
                if target in (f"{server}{SEPARATOR}{row['name']}", expose_name(server, row["name"], max_length)):
                    return tuple(row)
        rows = db.execute("SELECT server, kind, name FROM capabilities WHERE name=? AND kind IN"
                          " ('resource','template')", (target,)).fetchall()
        if len(rows) == 1:
            return tuple(rows[0])
        if len(rows) > 1:
            servers = ", ".join(row["server"] for row in rows)
            raise CofferError(f"{target!r} is published by several servers ({servers}); "
                              f"use coffer+<server>:{target}")
        if sep and db.execute("SELECT 1 FROM servers WHERE name=?", (server,)).fetchone():
            raise NotListedYet(f"unknown target {target!r}: server {server!r} does not list it")
        raise CofferError(f"unknown target {target!r}: not a server, tool, prompt or resource Coffer knows")

    def sync_capabilities(self, server: str, kind: str, definitions: dict[str, dict]) -> dict[str, bool]:
        """Record what an upstream lists now; return {name: enabled}.

        New names follow the server's policy; names that vanish keep their row (and the user's choice) with
        present=0, so a choice survives an upstream upgrade that drops and later restores a tool.
        """
        now = utcnow()
        with self.transaction() as db:
            srv = db.execute("SELECT policy FROM servers WHERE name=?", (server,)).fetchone()
            default = 1 if (srv is None or srv["policy"] == "enabled") else 0
            known = {row["name"]: row for row in db.execute(
                "SELECT name, enabled, present, fingerprint FROM capabilities WHERE server=? AND kind=?",
                (server, kind))}
            for name, definition in definitions.items():
                fp = fingerprint(definition)
                row = known.get(name)
                text = dumps(definition)
                if row is None:
                    db.execute("INSERT OR IGNORE INTO capabilities(server, kind, name, enabled, present, fingerprint,"
                               " definition, first_seen, last_seen) VALUES (?,?,?,?,1,?,?,?,?)",
                               (server, kind, name, default, fp, text, now, now))
                    if srv is not None:
                        self._audit(db, "upstream-added", f"{server}:{name}",
                                    f"{kind}; {'enabled' if default else 'disabled'} by policy", actor="upstream")
                else:
                    if row["fingerprint"] != fp or not row["present"]:
                        self._audit(db, "upstream-changed" if row["present"] else "upstream-restored",
                                    f"{server}:{name}", kind, actor="upstream")
                    db.execute("UPDATE capabilities SET present=1, fingerprint=?, definition=?, last_seen=? WHERE"
                               " server=? AND kind=? AND name=?", (fp, text, now, server, kind, name))
            for name, row in known.items():
                if name not in definitions and row["present"]:
                    db.execute("UPDATE capabilities SET present=0 WHERE server=? AND kind=? AND name=?",
                               (server, kind, name))
                    self._audit(db, "upstream-removed", f"{server}:{name}", kind, actor="upstream")
            return {row["name"]: bool(row["enabled"]) for row in db.execute(
                "SELECT name, enabled FROM capabilities WHERE server=? AND kind=?", (server, kind))
                if row["name"] in definitions}

    def remembered_lists(self) -> dict[str, dict[str, dict[str, dict]]]:
        """server -> kind -> {name: definition}: the tools and prompts each server listed when last seen."""
        remembered: dict = {}
        for row in self.db.execute("SELECT server, kind, name, definition FROM capabilities WHERE present=1 AND"
                                   " kind IN ('tool', 'prompt') AND definition IS NOT NULL ORDER BY rowid"):
            try:
                definition = json.loads(row["definition"])
            except ValueError:
                continue
            remembered.setdefault(row["server"], {}).setdefault(row["kind"], {})[row["name"]] = definition
        return remembered

    def enabled_map(self) -> dict[tuple[str, str, str], bool]:
        return {(row["server"], row["kind"], row["name"]): bool(row["enabled"])
                for row in self.db.execute("SELECT server, kind, name, enabled FROM capabilities")}

    def capabilities(self, server: str | None = None) -> list[dict]:
        sql = "SELECT * FROM capabilities" + (" WHERE server=?" if server else "") + " ORDER BY server, kind, name"
        return [dict(row) for row in self.db.execute(sql, (server,) if server else ())]

    def data_version(self) -> int:
        """Changes whenever another connection commits: how a running gateway notices CLI edits cheaply."""
        return self.db.execute("PRAGMA data_version").fetchone()[0]

    # -- logs ----------------------------------------------------------------------------------------------
    def _audit(self, db, action: str, target, detail, actor: str | None = None) -> None:
        db.execute("INSERT INTO audit(ts, actor, action, target, detail) VALUES (?,?,?,?,?)",
                   (utcnow(), actor or self.actor, action, target, detail))

    def invocations(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT ts, client, server, capability, kind, duration_ms, status, error FROM"
                               " invocations ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(row) for row in reversed(rows)]

    def audit_rows(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT ts, actor, action, target, detail FROM audit ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
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
        return n_inv, n_aud


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT: take the write lock up front so a busy vault waits instead of failing late."""

    def __init__(self, db):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
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


def _server_row(row) -> dict:
    server = dict(row)
    server["command"] = json.loads(server["command"]) if server["command"] else None
    server["env"] = json.loads(server["env"] or "{}")
    server["headers"] = json.loads(server["headers"] or "{}")
    server["enabled"] = bool(server["enabled"])
    server["capabilities"] = json.loads(server["capabilities"]) if server.get("capabilities") else None
    return server


def _coerce_setting(key: str, raw: str):
    default = DEFAULTS[key]
    try:
        value = type(default)(raw)
    except ValueError:
        raise CofferError(f"setting {key} needs a {type(default).__name__}, got {raw!r}") from None
    if key == "name_max_length" and not 34 <= value <= 64:  # 24-char server + "__" + "x_" + hash
        raise CofferError("name_max_length must be between 34 and 64")
    if key == "expose" and value not in ("all", "search"):
        raise CofferError("expose must be 'all' or 'search'")
    if key == "embedder_api" and value not in ("openai", "ollama"):
        raise CofferError("embedder_api must be 'openai' or 'ollama'")
    if isinstance(value, (int, float)) and key != "expose" and value <= 0:
        raise CofferError(f"{key} must be positive")
    return value


class InvocationLog:
    """Writes invocation rows on its own thread, in batches, so no tool call ever waits on SQLite.

    If the vault is locked or read-only the rows are kept (up to a bound) and retried; a persistent failure is a
    stderr warning, never a failed call.
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
                                   " status, error) VALUES (?,?,?,?,?,?,?,?)",
                                   [(iso_timestamp(row[0]), *row[1:]) for row in pending])
                    db.execute("COMMIT")
                    pending.clear()
                    for waiter in waiters:
                        waiter.set()
                    waiters.clear()
                except sqlite3.Error as exc:
                    try:
                        if db is not None and db.in_transaction:
                            db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                    if not self._warned:
                        warn(f"invocation log not written yet ({exc}); will retry")
                        self._warned = True
                    del pending[:-self.MAX_BUFFER]
                    if self._stop.is_set():
                        warn(f"{len(pending)} invocation rows could not be written: {exc}")
                        break
                    time.sleep(0.5)
            if not pending:
                for waiter in waiters:
                    waiter.set()
                waiters.clear()
            if self._stop.is_set() and self.queue.empty() and not pending:
                break
        if db is not None:
            db.close()

# ============================================================================================================
# 4. Transports and the upstream supervisor
# ============================================================================================================


class StdioTransport:
    """An upstream MCP server as a subprocess speaking newline-delimited JSON-RPC on stdin/stdout.

    The child gets its own process group (POSIX) so shutdown can reach the whole tree (``npx`` and ``uvx``
    start grandchildren); if Coffer is killed outright, the children see stdin close and exit by themselves.
    """

    def __init__(self, name, argv, env, cwd, on_message, on_close, on_stderr):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.on_message, self.on_close, self.on_stderr = on_message, on_close, on_stderr
        self.proc: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._queued = 0          # messages handed to the writer thread and not yet written
        self._stdin_fd = None     # set when stdin is non-blocking (POSIX): send() may then write it directly
        self._close_lock = threading.Lock()
        self._closed = False
        self._close_signalled = False

    def start(self) -> None:
        if self._closed:
            raise UpstreamFailure("stopped before it started")
        argv = list(self.argv)
        resolved = shutil.which(argv[0], path=self.env.get("PATH"))
        if resolved:
            argv[0] = resolved  # Windows needs npx.cmd spelled out; elsewhere this is harmless
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
            raise UpstreamFailure(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        if os.name == "posix":
            os.set_blocking(self.proc.stdin.fileno(), False)
            self._stdin_fd = self.proc.stdin.fileno()
        self._reader = threading.Thread(target=self._read_stdout, name=f"coffer-{self.name}-out", daemon=True)
        self._reader.start()
        threading.Thread(target=self._read_stderr, name=f"coffer-{self.name}-err", daemon=True).start()
        threading.Thread(target=self._watch_exit, name=f"coffer-{self.name}-wait", daemon=True).start()
        threading.Thread(target=self._write_stdin, name=f"coffer-{self.name}-in", daemon=True).start()

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
        data = (dumps(message) + "\n").encode("utf-8")
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

        def handle(line: bytes) -> None:
            nonlocal skipped
            if not line.strip():
                return
            try:
                message = json.loads(line)
            except ValueError:  # UnicodeDecodeError included: invalid UTF-8 is skipped like any junk
                skipped += 1
                if skipped <= 20 or skipped % 1000 == 0:
                    warn(f"[{self.name}] skipped a non-JSON line on stdout ({len(line)} bytes; {skipped} so far)")
                return
            for item in (message if isinstance(message, list) else [message]):
                if isinstance(item, dict):
                    try:
                        self.on_message(item)
                    except Exception as exc:  # a bug in routing must not kill the reader
                        warn(f"[{self.name}] error handling a message: {exc!r}")

        try:
            for lines in read_line_bursts(self.proc.stdout.read):
                handle_burst(lines, handle)
        except (OSError, ValueError):
            pass
        self._signal_close()

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            self.on_stderr(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def close(self, grace: float = 2.0) -> None:
        """Close stdin, give the server ``grace`` seconds to exit, then terminate and kill its process group."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        proc = self.proc
        if proc is None:
            return
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
                alive = proc.poll() is None
                try:  # the group may outlive its leader: npx exits, the node server it started does not
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                if not alive:
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


class HttpTransport:
    """An upstream MCP server over Streamable HTTP, with urllib.

    Each outgoing message is one POST on a worker thread; the reply is either one JSON body or an SSE stream
    that may carry the server's own requests and notifications before the response.
    """

    def __init__(self, name, url, headers, on_message, on_close, timeout):
        self.name, self.url, self.headers = name, url, headers
        self.on_message, self.on_close = on_message, on_close
        self.timeout = timeout
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self._closed = False
        self._listening = False
        self.pid = None

    def start(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise UpstreamFailure(f"unsupported URL {self.url!r}")

    def send(self, message: dict) -> bool:
        if self._closed:
            return False
        threading.Thread(target=self._post, args=(message,), name=f"coffer-{self.name}-http", daemon=True).start()
        return True

    def _request_headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        headers.update(self.headers)
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        if self.protocol_version:
            headers["MCP-Protocol-Version"] = self.protocol_version
        return headers

    def _post(self, message: dict) -> None:
        import http.client, urllib.error, urllib.request  # noqa: E401 - lazily: they cost ~19 MB of RSS
        body = dumps(message).encode("utf-8")
        request = urllib.request.Request(self.url, data=body, headers=self._request_headers(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                session = response.headers.get("Mcp-Session-Id")
                if session and message.get("method") == "initialize":
                    self.session_id = session
                self._consume(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and self.session_id:
                warn(f"[{self.name}] HTTP session expired")
                self._closed = True
                self.on_close()
                return
            self._fail(message, f"HTTP {exc.code} {exc.reason}")
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            self._fail(message, f"cannot reach {self.name}: {getattr(exc, 'reason', exc)}")

    def _fail(self, message: dict, text: str) -> None:
        if "id" in message and "method" in message:
            self.on_message(rpc_error(message["id"], UPSTREAM_ERROR, text))

    def _consume(self, response) -> None:
        kind = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind == "application/json":
            data = response.read()
            if data.strip():
                payload = json.loads(data)
                for item in payload if isinstance(payload, list) else [payload]:
                    self._deliver(item)
        elif kind == "text/event-stream":
            data_lines: list[str] = []
            for raw in response:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data_lines.append(line[5:].lstrip(" "))
                elif not line and data_lines:
                    data = "\n".join(data_lines).strip()
                    data_lines = []
                    if not data:
                        continue  # a priming event (id only), sent so a client could resume the stream
                    try:
                        self._deliver(json.loads(data))
                    except ValueError:
                        warn(f"[{self.name}] skipped a non-JSON SSE event")

    def _deliver(self, item) -> None:
        if isinstance(item, dict):
            if isinstance(item.get("result"), dict) and "protocolVersion" in item["result"]:
                self.protocol_version = item["result"]["protocolVersion"]
                self._start_listening()
            self.on_message(item)

    def _start_listening(self) -> None:
        """Open the optional GET stream on which the server sends requests and notifications of its own."""
        if self._listening:
            return
        self._listening = True

        def listen():
            import urllib.error, urllib.request  # noqa: E401
            headers = self._request_headers()
            headers["Accept"] = "text/event-stream"
            time.sleep(0.05)  # after notifications/initialized has gone out
            try:
                request = urllib.request.Request(self.url, headers=headers, method="GET")
                with urllib.request.urlopen(request, timeout=3600) as response:
                    self._consume(response)
            except (urllib.error.URLError, OSError, ValueError):
                pass  # 405: this server has no stream; anything else: requests still work over POST

        threading.Thread(target=listen, name=f"coffer-{self.name}-sse", daemon=True).start()

    def close(self, grace: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.session_id:
            import urllib.error, urllib.request  # noqa: E401
            try:
                request = urllib.request.Request(self.url, headers=self._request_headers(), method="DELETE")
                urllib.request.urlopen(request, timeout=grace).close()
            except (urllib.error.URLError, OSError, ValueError):
                pass


class UpstreamFailure(Exception):
    """An upstream could not be started, initialized or reached."""


class Pending:
    """One request Coffer sent to an upstream and is waiting on."""

    __slots__ = ("method", "on_reply", "timeout", "deadline", "token")

    def __init__(self, method, on_reply, timeout, token):
        self.method, self.on_reply, self.timeout, self.token = method, on_reply, timeout, token
        self.deadline = time.monotonic() + timeout if timeout else None


class Ticket:
    """What ``Upstream.request`` hands back for ``cancel``: the upstream's request id once the request is sent;
    before that (queued behind a server that is still starting) cancelling it means it is never sent."""

    __slots__ = ("request_id", "cancelled")

    def __init__(self):
        self.request_id: int | None = None
        self.cancelled = False


class Upstream:
    """One registered server: its connection, its in-flight requests, its advertised lists, its restarts.

    States: idle → starting → ready; a crash goes to backoff and back to starting; too many consecutive failed
    starts go to failed; stopped is final.  Requests that arrive while starting wait in a backlog.
    """

    LIST_METHODS = {"tool": ("tools/list", "tools", "tools"), "prompt": ("prompts/list", "prompts", "prompts"),
                    "resource": ("resources/list", "resources", "resources"),
                    "template": ("resources/templates/list", "resourceTemplates", "resources")}
    QUICK_DEATH = 10.0  # a server that dies this soon after becoming ready counts as a failed start

    def __init__(self, config: dict, settings: dict, events, client_capabilities=None, protocol_version=None):
        self.config = config
        self.name: str = config["name"]
        self.settings = settings
        self.events = events  # the gateway: on_ready, on_down, on_list_changed, on_notification, on_request
        self.client_capabilities = client_capabilities or {}
        self.protocol_version = protocol_version or LATEST_PROTOCOL_VERSION
        self.call_timeout = float(config.get("timeout") or settings["call_timeout"])
        self.lock = threading.RLock()
        self.state = "idle"
        self.transport = None
        self.pending: dict[int, Pending] = {}
        self.by_token: dict = {}
        self.backlog: list = []
        self._next_id = 0
        self.failures = 0
        self.spawns = 0
        self.ready_at = 0.0
        self.last_error: str | None = None
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.secrets: list[str] = []
        self.server_info: dict = {}
        self.capabilities: dict = {}
        self.lists = {kind: {} for kind in CAPABILITY_KINDS}  # kind -> {name: definition}, in upstream order
        self.remembered: dict[str, dict] = {}  # kind -> what the vault holds from the last start (see Catalogue)
        self._refresh_again: dict[str, bool] = {}  # kind -> refreshing now; True: list_changed came meanwhile
        self.generation = 0
        self._closed_generation = -1
        self._timer: threading.Timer | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            if self.state in ("starting", "ready", "stopped"):
                return
            self.state = "starting"
            self.spawns += 1
        threading.Thread(target=self._start, name=f"coffer-{self.name}-start", daemon=True).start()

    def _make_transport(self):
        missing: list[str] = []
        cfg = self.config
        generation = self.generation + 1
        on_close = lambda: self._on_close(generation)  # noqa: E731 - a stale connection's close is ignored
        if cfg["transport"] == "http":
            headers = {k: expand_vars(v, missing=missing) for k, v in cfg["headers"].items()}
            self.secrets = [v for k, v in headers.items() if v != cfg["headers"][k] and len(v) >= 4]
            transport = HttpTransport(self.name, expand_vars(cfg["url"], missing=missing), headers,
                                      self._on_message, on_close,
                                      max(float(self.settings["init_timeout"]), self.call_timeout))
        else:
            env = dict(os.environ)
            extra = {k: expand_vars(v, missing=missing) for k, v in cfg["env"].items()}
            env.update(extra)
            self.secrets = [v for k, v in extra.items() if v != cfg["env"][k] and len(v) >= 4]
            argv = [expand_vars(arg, missing=missing) for arg in cfg["command"]]
            transport = StdioTransport(self.name, argv, env, cfg.get("cwd"), self._on_message, on_close,
                                       self._on_stderr)
        for name in sorted(set(missing)):
            warn(f"[{self.name}] ${{{name}}} is not set in Coffer's environment; using an empty value")
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
            result = self.call("initialize", {
                "protocolVersion": self.protocol_version,
                "capabilities": self.client_capabilities,
                "clientInfo": {"name": "coffer", "title": "Coffer MCP gateway", "version": __version__},
            }, self.settings["init_timeout"])
            if not isinstance(result, dict):
                raise UpstreamFailure("initialize returned no result object")
            self.notify("notifications/initialized")
            self.capabilities = result.get("capabilities") if isinstance(result.get("capabilities"), dict) else {}
            self.server_info = result.get("serverInfo") if isinstance(result.get("serverInfo"), dict) else {}
            for kind in CAPABILITY_KINDS:
                self.refresh(kind, notify=False)
            if self._closed_generation == self.generation:
                raise UpstreamFailure("the server exited during discovery")
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party server is a failed start
            self._start_failed(transport, exc)
            return
        with self.lock:
            if self.state == "stopped":
                threading.Thread(target=transport.close, daemon=True).start()
                return
            self.state = "ready"
            self.ready_at = time.monotonic()
            self.last_error = None
            backlog, self.backlog = self.backlog, []
        self.events.on_ready(self)
        for run in backlog:
            run()

    def _start_failed(self, transport, exc: Exception) -> None:
        text = str(exc) or exc.__class__.__name__
        if self.stderr_tail and "stderr:" not in text:
            text += " | stderr: " + " / ".join(list(self.stderr_tail)[-3:])
        with self.lock:
            if self.state == "stopped":
                return
            self.failures += 1
            self.last_error = self.redact(text)
            give_up = self.failures >= int(self.settings["max_restarts"])
            self.state = "failed" if give_up else "backoff"
            backlog = self.backlog if give_up else []
            if give_up:
                self.backlog = []
        if transport is not None:
            threading.Thread(target=transport.close, args=(0.5,), daemon=True).start()
        warn(f"[{self.name}] start failed ({self.failures}/{self.settings['max_restarts']}): {self.last_error}")
        if give_up:
            warn(f"[{self.name}] giving up after {self.failures} attempts; marked failed")
            self.events.on_down(self)
            for run in backlog:
                run()
        else:
            self._schedule_start(min(30.0, 0.5 * 2 ** (self.failures - 1)))

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
        code = None
        proc = getattr(transport, "proc", None)
        if proc is not None:
            try:
                code = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
        reason = f"upstream '{self.name}' " + (f"exited with code {code}" if code is not None else "closed its connection")
        # The old connection may have only closed stdout; make sure its process and pipes are gone too.
        threading.Thread(target=transport.close, args=(0.5,), daemon=True).start()
        for pending in orphaned:
            pending.on_reply(None, "error", reason)
        if state != "ready":
            return  # a start in progress notices through its initialize wait or its closed-generation check
        with self.lock:
            quick = time.monotonic() - self.ready_at < self.QUICK_DEATH
            self.failures = self.failures + 1 if quick else 0
            self.last_error = self.redact(reason)
            give_up = self.failures >= int(self.settings["max_restarts"])
            self.state = "failed" if give_up else "backoff"
            backlog = self.backlog if give_up else []
            if give_up:
                self.backlog = []
        warn(f"[{self.name}] {reason}; " + ("giving up, marked failed" if give_up else "restarting"))
        self.events.on_down(self)
        for run in backlog:
            run()
        if not give_up:
            self._schedule_start(0.0 if not quick else min(30.0, 0.5 * 2 ** (self.failures - 1)))

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
        for run in backlog:
            run()
        if transport is not None:
            transport.close()

    def _on_stderr(self, line: str) -> None:
        line = self.redact(line)
        self.stderr_tail.append(line[:500])
        warn(f"[{self.name}] {line[:2000]}")

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    # -- requests ------------------------------------------------------------------------------------------
    def request(self, method: str, params, on_reply, timeout: float | None = None, ticket: Ticket | None = None):
        """Send a request, or queue it while the server starts; ``on_reply(response, failure_status,
        failure_text)`` runs exactly once, unless the request is cancelled first.

        Returns a Ticket for ``cancel``, or None when the request failed at once (``on_reply`` has run).
        """
        timeout = self.call_timeout if timeout is None else timeout
        ticket = ticket or Ticket()
        with self.lock:
            if ticket.cancelled:
                return None  # cancelled while it waited in the backlog: never sent, never answered
            state = self.state
            if state in ("starting", "backoff", "idle"):
                self.backlog.append(lambda: self.request(method, params, on_reply, timeout, ticket))
                if state == "idle":
                    self.start()
                return ticket
            if state != "ready":
                detail = f": {self.last_error}" if self.last_error else ""
                on_reply(None, "error", f"upstream '{self.name}' is unavailable ({state}){detail}")
                return None
            ticket.request_id = self._send_request(method, params, on_reply, timeout)
            return ticket if ticket.request_id is not None else None

    def _send_request(self, method, params, on_reply, timeout):
        with self.lock:
            self._next_id += 1
            request_id = self._next_id
            token = None
            if isinstance(params, dict):
                meta = params.get("_meta")
                if isinstance(meta, dict) and "progressToken" in meta:
                    token = meta["progressToken"]
            if isinstance(token, bool) or not isinstance(token, (str, int)):
                token = None  # the spec allows only strings and integers; anything else cannot reset a timeout
            pending = Pending(method, on_reply, timeout, token)
            self.pending[request_id] = pending
            if token is not None:
                self.by_token[token] = pending
            transport = self.transport
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        if transport is None or not transport.send(message):
            self._finish(request_id)
            on_reply(None, "error", f"upstream '{self.name}' is not accepting input")
            return None
        return request_id

    def call(self, method: str, params=None, timeout: float | None = None):
        """Blocking request for Coffer's own use (initialize, discovery); returns the result or raises."""
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
        if "error" in box["response"]:
            error = box["response"]["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamFailure(f"{method} failed: {message}")
        return box["response"].get("result")

    def notify(self, method: str, params=None) -> None:
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        transport = self.transport
        if transport is not None:
            transport.send(message)

    def respond(self, message: dict) -> None:
        transport = self.transport
        if transport is not None:
            transport.send(message)

    def cancel(self, ticket: Ticket, reason: str = "cancelled by the client") -> bool:
        """Forget a request (a late reply is then dropped) and tell the upstream, with its own id; a request
        still queued is simply never sent.  False if it was already answered or cancelled."""
        with self.lock:
            if ticket.cancelled:
                return False
            ticket.cancelled = True
            request_id = ticket.request_id
        if request_id is None:
            return True
        if self._finish(request_id) is None:
            return False
        self.notify("notifications/cancelled", {"requestId": request_id, "reason": reason})
        return True

    def _finish(self, request_id):
        with self.lock:
            pending = self.pending.pop(request_id, None)
            if pending is not None and pending.token is not None and self.by_token.get(pending.token) is pending:
                del self.by_token[pending.token]
        return pending

    def expire(self, now: float) -> None:
        """Time out requests whose deadline passed (progress pushes a deadline back)."""
        if not self.pending:
            return
        with self.lock:
            expired = [rid for rid, p in self.pending.items() if p.deadline is not None and p.deadline <= now]
        for request_id in expired:
            pending = self._finish(request_id)
            if pending is not None:
                if pending.method != "initialize":  # the spec forbids cancelling initialize
                    self.notify("notifications/cancelled", {"requestId": request_id, "reason": "timed out"})
                pending.on_reply(None, "timeout",
                                 f"upstream '{self.name}' did not answer {pending.method} within {pending.timeout:g}s")

    # -- incoming ------------------------------------------------------------------------------------------
    def _on_message(self, message: dict) -> None:
        method = message.get("method")
        if method is None:
            if "id" not in message:
                return
            pending = self._finish(message["id"]) if isinstance(message["id"], int) else None
            if pending is None:
                return  # a late reply to a cancelled or timed-out request: dropped, delivered to nobody
            pending.on_reply(message, None, None)
            return
        if "id" in message:
            if method == "ping":
                self.respond(rpc_result(message["id"], {}))
            else:
                self.events.on_request(self, message)
            return
        if method == "notifications/progress":
            params = message.get("params") or {}
            token = params.get("progressToken") if isinstance(params, dict) else None
            pending = self.by_token.get(token) if isinstance(token, (str, int)) and not isinstance(token, bool) \
                else None
            if pending is not None and pending.timeout:
                pending.deadline = time.monotonic() + pending.timeout
        elif method in ("notifications/tools/list_changed", "notifications/prompts/list_changed",
                        "notifications/resources/list_changed"):
            kinds = {"tools": ("tool",), "prompts": ("prompt",), "resources": ("resource", "template")}
            for kind in kinds[method.split("/")[1]]:
                self._refresh_soon(kind)
            return
        self.events.on_notification(self, message)

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
                except Exception as exc:  # noqa: BLE001 - the pass is lost, not the ability to refresh again
                    warn(f"[{self.name}] error refreshing its {kind}s: {exc!r}")
                with self.lock:
                    if not self._refresh_again[kind]:
                        del self._refresh_again[kind]
                        return
                    self._refresh_again[kind] = False

        threading.Thread(target=run, name=f"coffer-{self.name}-refresh", daemon=True).start()

    def refresh(self, kind: str, notify: bool = True) -> None:
        """Fetch one list (every page) and hand it to the gateway."""
        method, key, capability = self.LIST_METHODS[kind]
        if capability not in self.capabilities:
            items = {}
        else:
            try:
                items = self._fetch_all(method, key, "uriTemplate" if kind == "template" else
                                        "uri" if kind == "resource" else "name")
            except UpstreamFailure as exc:
                if notify:
                    warn(f"[{self.name}] could not refresh {key}: {exc}")
                    return
                raise
        self.lists[kind] = items
        self.events.on_list_changed(self, kind, items, notify)

    def _fetch_all(self, method: str, key: str, id_field: str) -> dict:
        items: dict[str, dict] = {}
        cursor, seen = None, set()
        for _ in range(10_000):
            result = self.call(method, {"cursor": cursor} if cursor else {}, self.settings["init_timeout"])
            if not isinstance(result, dict):
                raise UpstreamFailure(f"{method} returned no result object")
            for item in result.get(key) or []:
                if isinstance(item, dict) and isinstance(item.get(id_field), str):
                    items.setdefault(item[id_field], item)
            cursor = result.get("nextCursor")
            if not cursor:
                break
            if cursor in seen:
                warn(f"[{self.name}] {method} repeated cursor {cursor!r}; stopping pagination")
                break
            seen.add(cursor)
        return items

# ============================================================================================================
# 5. Catalogue: the merged, namespaced, filtered view of every upstream
# ============================================================================================================


def template_regex(template: str):
    """A matcher for an RFC 6570 URI template: each {expression} matches one or more characters."""
    parts = re.split(r"(\{[^}]*\})", template)
    pattern = "".join("(.+?)" if part.startswith("{") and part.endswith("}") else re.escape(part) for part in parts)
    return re.compile(f"^{pattern}$", re.S)


class Catalogue:
    """An immutable snapshot of what the client may see and call, rebuilt whenever anything changes.

    The hot path only does dictionary look-ups here.  Resource URIs are exposed unchanged, so URIs embedded in
    tool results stay readable; a URI that two upstreams both publish is exposed as ``coffer+<server>:<uri>``
    once per server, and the bare URI routes to the first of them in registration order.
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

    def __init__(self, upstreams, enabled: dict, max_length: int):
        self.tools: list[dict] = []
        self.tool_routes: dict[str, tuple] = {}
        self.prompts: list[dict] = []
        self.prompt_routes: dict[str, tuple] = {}
        self.resources: list[dict] = []
        self.resource_routes: dict[str, tuple] = {}
        self.templates: list[dict] = []
        self.template_routes: list[tuple] = []   # (regex, upstream, template string)
        self.template_by_text: dict[str, tuple] = {}
        self.disabled: set[str] = set()
        self.qualified: dict[tuple[str, str], str] = {}  # (server, uri) -> exposed uri, for notifications
        uri_count = collections.Counter(uri for up in upstreams for uri in up.lists["resource"])
        tpl_count = collections.Counter(t for up in upstreams for t in up.lists["template"])
        offered = {up.name: self.lists_of(up) for up in upstreams}

        def allowed(up, kind, name, exposed):
            if enabled.get((up.name, kind, name), True):
                return True
            self.disabled.add(exposed)
            return False

        for up in upstreams:
            for kind, items, routes in (("tool", self.tools, self.tool_routes),
                                        ("prompt", self.prompts, self.prompt_routes)):
                for name, definition in offered[up.name][kind].items():
                    exposed = expose_name(up.name, name, max_length)
                    if exposed in routes or not allowed(up, kind, name, exposed):
                        continue
                    entry = dict(definition)
                    entry["name"] = exposed
                    items.append(entry)
                    routes[exposed] = (up, name)
            for uri, definition in up.lists["resource"].items():
                exposed = uri if uri_count[uri] == 1 else qualify_uri(up.name, uri)
                if not allowed(up, "resource", uri, exposed):
                    continue
                entry = dict(definition)
                entry["uri"] = exposed
                self.resources.append(entry)
                self.resource_routes[exposed] = (up, uri)
                self.resource_routes.setdefault(uri, (up, uri))
                if exposed != uri:
                    self.qualified[(up.name, uri)] = exposed
            for text, definition in up.lists["template"].items():
                exposed = text if tpl_count[text] == 1 else qualify_uri(up.name, text)
                if not allowed(up, "template", text, exposed):
                    continue
                entry = dict(definition)
                entry["uriTemplate"] = exposed
                self.templates.append(entry)
                self.template_routes.append((template_regex(text), up, text))
                self.template_by_text[exposed] = (up, text)
                self.template_by_text.setdefault(text, (up, text))
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

    def route_resource(self, uri: str):
        """(upstream, original uri) for a URI the client wants to read or subscribe to, or None."""
        route = self.resource_routes.get(uri)
        if route:
            return route
        qualified = QUALIFIED_URI_RE.match(uri)
        if qualified:
            server, original = qualified.groups()
            for regex, up, _ in self.template_routes:
                if up.name == server and regex.match(original):
                    return up, original
            return None
        for regex, up, _ in self.template_routes:
            if regex.match(uri):
                return up, uri
        return None

    def exposed_uri(self, server: str, uri: str) -> str:
        return self.qualified.get((server, uri), uri)

    def fingerprint(self) -> dict:
        """What the client sees, per list; comparing two of these tells which list_changed to send."""
        return {key: hashlib.sha256(dumps(items).encode("utf-8")).hexdigest()
                for key, items in (("tools", self.tools), ("prompts", self.prompts),
                                   ("resources", self.resources + self.templates))}


# ============================================================================================================
# 6. Search: a BM25F ranker over the tool catalogue
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

STOP_WORDS = frozenset("""
a about above after again all also am an and any are as at be been before being below between both but by can
could did do does doing down during each few for from further had has have having he her here hers him his how i
if in into is it its itself just let me more most my no nor not now of off on once only or other our ours out
over own please same she should so some such than that the their theirs them then there these they this those
through to too under until up very was we were what when where which while who whom why will with would you
your yours want need like using use via tool tools mcp server i'd i'm it's let's help could kindly
""".split())

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
"""


def _parse_lexicon(text: str) -> dict[str, tuple[str, ...]]:
    table = {}
    for pair in text.split():
        key, _, value = pair.partition("=")
        table[unicodedata.normalize("NFKC", key).lower()] = tuple(value.split("_"))
    return table


LEXICON = _parse_lexicon(_LEXICON)
_LEXICON_CJK = tuple((k, v) for k, v in LEXICON.items() if _CJK_RE.search(k))


def _words(text: str) -> list[str]:
    """NFKC, identifier splitting, lowercase; CJK runs become overlapping bigrams so substrings can match."""
    if text.isascii():  # the common case: NFKC is the identity and there is no CJK to split
        words = []
        for word in _WORD_RE.findall(text):
            if word.isupper() or word[1:].islower():   # "API", "Get", "mp3": no camelCase inside
                words.append(word.lower())
            else:
                words.extend(_CAMEL_RE.sub(" ", word).lower().split())
        return words
    text = _CAMEL_RE.sub(" ", unicodedata.normalize("NFKC", text)).lower()
    words = []
    for run in _WORD_RE.findall(text):
        if not _CJK_RE.search(run):
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


def tokenize(text: str) -> list[str]:
    """Index/query terms of a text: split, stop words dropped, stemmed."""
    return list(_cached_terms(text))


def _cached_terms(text: str) -> tuple[str, ...]:
    return _analysed(text)[0]


@functools.lru_cache(maxsize=1 << 15)  # a rebuild after one upstream changes re-tokenizes only new texts
def _analysed(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(index terms, English terms for its foreign tool-domain words) of one text, computed once per text."""
    words = _words(text)
    terms = tuple(stem(word) for word in words if word not in STOP_WORDS)
    if text.isascii():  # no CJK phrase can match: the lexicon's word look-up is all there is to do
        return terms, tuple(stem(english) for word in words for english in LEXICON.get(word, ()))
    return terms, tuple(translations(text))


def translations(text: str) -> list[str]:
    """English index terms for the foreign tool-domain words in ``text`` (see LEXICON)."""
    normal = unicodedata.normalize("NFKC", text).lower()
    found = [word for key, words in _LEXICON_CJK if key in normal for word in words] \
        if _CJK_RE.search(normal) else []
    found += [word for token in _WORD_RE.findall(normal) for word in LEXICON.get(token, ())]
    return [stem(word) for word in found]


def _build_equivalences() -> dict[str, tuple[str, ...]]:
    table: dict[str, set[str]] = collections.defaultdict(set)
    for line in _EQUIVALENCES.strip().splitlines():
        group = {stem(word) for word in line.split()}
        for term in group:
            table[term] |= group - {term}
    return {term: tuple(sorted(others)) for term, others in table.items()}


EQUIVALENCES = _build_equivalences()


def _schema_text(schema) -> tuple[str, str]:
    """(parameter names, parameter descriptions and enum values) of a JSON schema, nested properties included."""
    names, texts = [], []

    def walk(node, depth):
        if not isinstance(node, dict) or depth > 4:
            return
        properties = node.get("properties")
        if isinstance(properties, dict):
            for key, sub in properties.items():
                names.append(str(key))
                if isinstance(sub, dict):
                    if isinstance(sub.get("description"), str):
                        texts.append(sub["description"])
                    if isinstance(sub.get("enum"), list):
                        texts.extend(str(v) for v in sub["enum"][:50])
                    if "properties" in sub:  # most parameters are leaves: skip the call
                        walk(sub, depth + 1)
                    if isinstance(sub.get("items"), dict):
                        walk(sub["items"], depth + 1)

    walk(schema, 0)
    return " ".join(names), " ".join(texts)


class SearchIndex:
    """BM25F over a tool list.  Built once per catalogue change; a query is a few dictionary look-ups per term.

    ``search(query, top_k)`` returns ``[(tool, score)]``, best first, zero scores dropped, ties broken by name.
    """

    # field: (weight, length-normalisation b)
    FIELDS = {"name": (3.0, 0.5), "server": (1.5, 0.3), "title": (2.0, 0.5), "description": (0.8, 0.75),
              "params": (0.5, 0.5), "param_text": (0.5, 0.75), "translated": (0.8, 0.75)}
    K1 = 1.2
    # A tool whose server also holds the best match for the query is likelier to be wanted too (tasks span
    # several tools of one server): each tool gains this share of its server's best score.
    SERVER_BOOST = 0.2

    def __init__(self, tools: list[dict]):
        self.tools = tools  # a snapshot the caller does not change (the semantic ranker matches it by identity)
        fields_per_doc = [self._fields(tool) for tool in self.tools]
        n = len(self.tools)
        avg = {f: (sum(len(doc[f]) for doc in fields_per_doc) / n if n else 0.0) or 1.0 for f in self.FIELDS}
        fields = [(field, weight, b, avg[field]) for field, (weight, b) in self.FIELDS.items()]
        self._doc_terms: list[dict[str, float]] = []  # per tool: term -> field-weighted, length-normalised tf
        for doc in fields_per_doc:
            tf: dict[str, float] = {}
            for field, weight, b, average in fields:
                terms = doc[field]
                if terms:
                    norm = weight / (1.0 - b + b * len(terms) / average)
                    for term in terms:
                        tf[term] = tf.get(term, 0.0) + norm
            self._doc_terms.append(tf)
        self._vocabulary = set().union(*self._doc_terms)
        self._postings: dict[str, list[tuple[int, float]]] = {}
        order = sorted(range(n), key=lambda i: str(self.tools[i].get("name", "")))
        self._rank_of = [0] * n
        for rank, doc_id in enumerate(order):
            self._rank_of[doc_id] = rank
        servers: dict[str, int] = {}
        self._server_of = [servers.setdefault(str(tool.get("name", "")).partition(SEPARATOR)[0], len(servers))
                           if SEPARATOR in str(tool.get("name", "")) else -1 for tool in self.tools]

    @staticmethod
    def _fields(tool: dict) -> dict[str, list[str]]:
        name = str(tool.get("name") or "")
        server, sep, short = name.partition(SEPARATOR)
        if not sep:
            server, short = "", name
        description = tool.get("description") if isinstance(tool.get("description"), str) else ""
        title = tool.get("title") if isinstance(tool.get("title"), str) else ""
        annotations = tool.get("annotations") if isinstance(tool.get("annotations"), dict) else {}
        if not title and isinstance(annotations.get("title"), str):
            title = annotations["title"]
        param_names, param_text = _schema_text(tool.get("inputSchema"))
        (name, name_foreign), (title, title_foreign), (description, description_foreign) = \
            _analysed(short), _analysed(title), _analysed(description)
        return {"name": name, "server": _cached_terms(server), "title": title, "description": description,
                "params": _cached_terms(param_names), "param_text": _cached_terms(param_text),
                "translated": name_foreign + title_foreign + description_foreign}

    def __len__(self) -> int:
        return len(self.tools)

    def postings(self, term: str) -> list[tuple[int, float]]:
        """(doc id, BM25 weight) of every tool holding ``term``, built by the first query that uses the term:
        most of a catalogue's vocabulary is never searched for, so a rebuild does not pay for it."""
        found = self._postings.get(term)
        if found is None:
            if term not in self._vocabulary:
                return []
            pairs = [(doc_id, tf[term]) for doc_id, tf in enumerate(self._doc_terms) if term in tf]
            n, k1 = len(self._doc_terms), self.K1
            idf = math.log(1.0 + (n - len(pairs) + 0.5) / (len(pairs) + 0.5))
            found = self._postings[term] = [(doc_id, idf * value / (k1 + value)) for doc_id, value in pairs]
        return found

    def query_terms(self, query: str) -> dict[str, float]:
        """Query term -> weight: the query's own terms at 1, foreign-word translations and equivalents lower."""
        weights: dict[str, float] = {}
        own = tokenize(query)
        for term in own:
            weights[term] = 1.0
        for term in translations(query):
            weights[term] = max(weights.get(term, 0.0), TRANSLATION_WEIGHT)
        for term in list(weights):
            for other in EQUIVALENCES.get(term, ()):
                weights[other] = max(weights.get(other, 0.0), EQUIVALENCE_WEIGHT * weights[term])
        return weights

    def rank(self, query: str, limit: int) -> list[tuple[int, float]]:
        """The best ``limit`` (doc id, score) pairs, best first, zero scores dropped, ties broken by name."""
        scores: dict[int, float] = collections.defaultdict(float)
        for term, weight in self.query_terms(query).items():
            for doc_id, value in self.postings(term):
                scores[doc_id] += weight * value
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

    def search(self, query: str, top_k: int = 5) -> list[tuple[dict, float]]:
        top_k = max(1, min(20, int(top_k)))
        return [(self.tools[doc_id], round(score, 4)) for doc_id, score in self.rank(query, top_k)]

# ------------------------------------------------------------------------------------------------------------
# 6b. Semantic ranking (optional): an embeddings endpoint, a vector cache in the vault, hybrid fusion
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

    def __init__(self, url: str, model: str, api: str = "openai", key_env: str = "", batch_size: int = 64):
        if api not in ("openai", "ollama"):
            raise CofferError(f"embedder_api must be 'openai' or 'ollama', not {api!r}")
        self.url, self.model, self.api, self.key_env = url.rstrip("/"), model, api, key_env
        self.batch_size = batch_size

    @classmethod
    def from_settings(cls, settings: dict):
        url = os.environ.get("COFFER_EMBEDDER_URL", settings.get("embedder_url") or "")
        if not url:
            return None
        return cls(url, os.environ.get("COFFER_EMBEDDER_MODEL", settings.get("embedder_model") or ""),
                   os.environ.get("COFFER_EMBEDDER_API", settings.get("embedder_api") or "openai"),
                   os.environ.get("COFFER_EMBEDDER_KEY_ENV", settings.get("embedder_key_env") or ""))

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
        key = os.environ.get(self.key_env) if self.key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        import http.client, urllib.error, urllib.request  # noqa: E401 - lazily, only with an embedder
        request = urllib.request.Request(endpoint, data=dumps(body).encode("utf-8"), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=max(0.01, timeout)) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise EmbedderError(f"HTTP {exc.code} from {endpoint}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise EmbedderError("timed out" if "timed out" in str(reason) else f"unreachable: {reason!r}") from None
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


def fuse(lexical: list[tuple[int, float]], semantic: list[tuple[int, float]], top_k: int,
         alpha: float = HYBRID_ALPHA) -> list[tuple[int, float]]:
    """Calibrated score blending: BM25 scaled by its best score, cosine min-max scaled over its candidates.

    Measured against reciprocal-rank fusion on the three eval sets, blending won on all of them (metatool-dev
    nDCG@10 0.711 vs 0.671 for RRF k=60): a confident lexical match keeps its lead, a near-tie does not.
    """
    scores: dict[int, float] = collections.defaultdict(float)
    if lexical:
        best = lexical[0][1] or 1.0
        for doc_id, score in lexical:
            scores[doc_id] += alpha * score / best
    if semantic:
        high, low = semantic[0][1], semantic[-1][1]
        for doc_id, score in semantic:
            scaled = (score - low) / (high - low) if high > low else 1.0  # one candidate: full credit
            scores[doc_id] += (1.0 - alpha) * scaled
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
            warn(f"embedding cache unavailable: {exc}")

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
                    warn(f"embedder: tool vectors unavailable ({exc}); search uses BM25 until they are")
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
                warn(f"embedding cache not saved: {exc}")
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
        """Hybrid search, or BM25 with a note saying why not."""
        with self.lock:
            index = self.index if self._index_for is lexical_index.tools else None
        if index is None:
            warn("embedder: tool vectors not ready yet; this query is answered by BM25")
            return lexical_index.search(query, top_k), "bm25", "embedder: tool vectors not ready yet"
        try:
            query_vector = self.embedder.embed([query], self.query_timeout)[0]
        except EmbedderError as exc:
            warn(f"embedder fallback to BM25: {exc}")
            return lexical_index.search(query, top_k), "bm25", f"embedder fallback: {exc}"
        lexical = lexical_index.rank(query, self.CANDIDATES)
        try:
            semantic = index.rank(query_vector, self.CANDIDATES)
        except ValueError as exc:  # a query vector of another dimension: the endpoint's model changed
            warn(f"embedder fallback to BM25: {exc}")
            return lexical_index.search(query, top_k), "bm25", "embedder fallback: vector dimension changed"
        tools = lexical_index.tools
        return [(tools[doc], round(score, 4)) for doc, score in fuse(lexical, semantic, top_k)], "hybrid", None


# ============================================================================================================
# 7. Gateway session: the MCP server a client talks to
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

CLIENT_SIDE_CAPABILITIES = ("sampling", "elicitation", "roots")
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
SERVER_REQUEST_NEEDS = {"sampling/createMessage": "sampling", "elicitation/create": "elicitation",
                        "roots/list": "roots"}


class RpcError(Exception):
    def __init__(self, code: int, message: str, data=None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def _require_str(params: dict, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise RpcError(INVALID_PARAMS, f"'{key}' must be a non-empty string")
    return value


class Gateway:
    """One client session over stdio: answers locally what it can, routes everything else to an upstream.

    Threads: the caller's thread reads the client; one reader per upstream delivers replies straight to the
    client; a ticker enforces timeouts and notices vault edits; the invocation log writes on its own thread.
    """

    def __init__(self, vault: Vault, out=None, remember: bool = True):
        self.vault = vault
        self.remember = remember
        self.vault_lock = threading.Lock()
        self.settings = vault.settings()
        self.out = out if out is not None else sys.stdout.buffer
        self.out_lock = threading.Lock()
        self._unsent: list[bytes] = []
        self.log = InvocationLog(vault.path)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.upstreams: dict[str, Upstream] = {}
        self.configs: dict[str, dict] = {}
        self.remembered: dict[str, dict] = {}  # server -> kind -> {name: definition}, from the vault
        self.enabled = vault.enabled_map()
        self.catalogue = Catalogue([], self.enabled, self.settings["name_max_length"])
        self._fingerprint = self.catalogue.fingerprint()
        self._rebuild_lock = threading.Lock()
        self._rebuilds_wanted = self._rebuilds_done = 0
        self._force_tools_notice = False
        self.initialized = False
        self.client_capabilities: dict = {}
        self.client_name = "unknown"
        self.protocol_version = LATEST_PROTOCOL_VERSION
        self.log_level = None
        self.advertised: dict = {}
        self.subscriptions: dict[str, set[str]] = collections.defaultdict(set)  # server -> original URIs
        self.inflight: dict = {}          # client request id -> (upstream, Ticket, capability, kind, started)
        self.client_requests: dict = {}   # id Coffer gave a server->client request -> (upstream, upstream's id)
        self._client_request_seq = 0
        self.discovery_deadline = 0.0
        self._reported_missing = False
        self._stopping = threading.Event()
        self._data_version = vault.data_version()
        embedder = Embedder.from_settings(self.settings)
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

    # -- the client stream ---------------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        data = (dumps(message) + "\n").encode("utf-8")
        with self.out_lock:
            self._unsent.append(data)
        if not defer_to_burst_end(self, self._write_unsent):
            self._write_unsent()

    def _write_unsent(self) -> None:
        with self.out_lock:
            if not self._unsent:
                return  # another thread's write took it along
            data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
            self._unsent.clear()
            try:
                self.out.write(data)
                self.out.flush()
            except (OSError, ValueError):
                pass  # the client went away; stdin EOF ends the session

    def serve(self, stream) -> None:
        """Read the client until EOF.  Every line gets an answer or is a notification; nothing ends the session
        but the client closing stdin (or a signal)."""
        try:
            self.vault.prune()
        except sqlite3.Error as exc:  # a busy vault must not stop the agent's session from starting
            warn(f"retention pruning skipped: {exc}")
        for config in self.vault.servers():
            if config["enabled"]:
                self.configs[config["name"]] = config
        self.remembered = self.vault.remembered_lists() if self.remember else {}
        threading.Thread(target=self._tick, name="coffer-ticker", daemon=True).start()
        while True:
            line = stream.readline()
            if not line:
                break
            if line.strip():
                self.handle_line(line)

    def handle_line(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            self.send(rpc_error(None, PARSE_ERROR, "Parse error: not a JSON text"))
            return
        if isinstance(message, list):  # JSON-RPC batches (dropped by MCP 2025-06-18): answer each element
            if not message:
                self.send(rpc_error(None, INVALID_REQUEST, "Invalid Request: empty batch"))
            for item in message[:1000]:
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
        handler = self.handlers.get(method)
        if handler is None:
            self.send(rpc_error(msg_id, METHOD_NOT_FOUND, f"Method not found: {method}"))
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
        except Exception as exc:  # noqa: BLE001 - a Coffer bug must cost one request, not the session
            warn(f"internal error in {method}: {exc!r}")
            self.send(rpc_error(msg_id, INTERNAL_ERROR, f"Internal error in {method}"))
            return
        if result is not None:
            self.send(rpc_result(msg_id, result))

    # -- lifecycle -----------------------------------------------------------------------------------------
    def _initialize(self, msg_id, params):
        if self.initialized:
            raise RpcError(INVALID_REQUEST, "Invalid Request: already initialized")
        capabilities = params.get("capabilities")
        if capabilities is not None and not isinstance(capabilities, dict):
            raise RpcError(INVALID_PARAMS, "'capabilities' must be an object")
        self.protocol_version = negotiate_version(params.get("protocolVersion"))
        self.client_capabilities = capabilities or {}
        info = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else {}
        self.client_name = str(info.get("name") or "unknown")[:64]
        self.discovery_deadline = time.monotonic() + float(self.settings["discovery_timeout"])
        for config in self.configs.values():
            self._add_upstream(config)
        if any(up.remembered for up in list(self.upstreams.values())):
            self.rebuild()  # remembered tools are listable at once; before `initialized`, so no notification
        self.initialized = True
        instructions = INSTRUCTIONS
        failed = [c["name"] for c in self.configs.values() if c.get("status") == "failed"]
        if failed:
            instructions += " Failed at their last start: " + ", ".join(failed)[:200] + "."
        self.advertised = self._advertised_capabilities()
        return {
            "protocolVersion": self.protocol_version,
            "capabilities": self.advertised,
            "serverInfo": {"name": "coffer", "title": "Coffer MCP gateway", "version": __version__},
            "instructions": instructions[:800],
        }

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
            upstream = Upstream(config, self.settings, self, caps, self.protocol_version)
            upstream.remembered = self.remembered.pop(config["name"], {})  # only for the first start of a session
            self.upstreams[config["name"]] = upstream
        upstream.start()

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        # Rows first: a client that closes stdin usually kills its server a few seconds later.
        self.log.flush(3.0)
        threads = [threading.Thread(target=up.stop, daemon=True) for up in list(self.upstreams.values())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(6.0)
        self.log.close()

    def _tick(self) -> None:
        last_reload = time.monotonic()
        while not self._stopping.wait(0.05):
            now = time.monotonic()
            for upstream in list(self.upstreams.values()):
                try:
                    upstream.expire(now)
                except Exception as exc:  # noqa: BLE001 - the ticker guards every timeout; it must not die
                    warn(f"[{upstream.name}] error while expiring requests: {exc!r}")
            if now - last_reload >= 1.0:
                last_reload = now
                try:
                    self._reload_if_vault_changed()
                except Exception as exc:  # noqa: BLE001 - the ticker also guards every timeout
                    warn(f"could not apply vault changes: {exc!r}")

    def _reload_if_vault_changed(self) -> None:
        """Apply `coffer enable/disable/add/remove` made while this session runs."""
        with self.vault_lock:
            version = self.vault.data_version()
            if version == self._data_version:
                return
            self._data_version = version
            enabled = self.vault.enabled_map()
            configs = {c["name"]: c for c in self.vault.servers() if c["enabled"]}
            settings = self.vault.settings()
            changed = enabled != self.enabled
            self.enabled = enabled
        keys = ("transport", "command", "url", "env", "headers", "cwd", "timeout", "policy")
        if settings != self.settings:
            self.settings.update(settings)  # the upstreams share this dict
            for upstream in list(self.upstreams.values()):
                upstream.call_timeout = float(upstream.config.get("timeout") or settings["call_timeout"])
            changed = True
        if not self.initialized:
            self.configs = configs
            return
        for name, upstream in list(self.upstreams.items()):
            old, new = self.configs.get(name), configs.get(name)
            if new is None or any(old.get(k) != new.get(k) for k in keys):
                with self.lock:
                    del self.upstreams[name]
                threading.Thread(target=upstream.stop, daemon=True).start()
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
                states = self.vault.sync_capabilities(upstream.name, kind, items)
                for name, state in states.items():
                    self.enabled[(upstream.name, kind, name)] = state
        except sqlite3.Error as exc:
            warn(f"[{upstream.name}] could not record its {kind}s in the vault: {exc}")
            if upstream.config.get("policy") == "disabled":  # fail closed: unrecorded means not allowed
                with self.vault_lock:
                    for name in items:
                        self.enabled.setdefault((upstream.name, kind, name), False)
        if notify:
            self.rebuild()

    def on_ready(self, upstream: Upstream) -> None:
        counts = {kind: len(items) for kind, items in upstream.lists.items() if items}
        info = upstream.server_info
        who = f"{info.get('name', '?')} {info.get('version', '')}".strip() + ": " if info else ""
        self._record_status(upstream, "ready",
                            who + (", ".join(f"{n} {k}s" for k, n in counts.items()) or "no capabilities"),
                            upstream.capabilities)
        if self.log_level and "logging" in upstream.capabilities:
            upstream.request("logging/setLevel", {"level": self.log_level}, lambda *a: None)
        restarted = upstream.spawns > 1
        if restarted:
            with self.lock:
                uris = sorted(self.subscriptions.get(upstream.name, ()))
            for uri in uris:
                upstream.request("resources/subscribe", {"uri": uri}, lambda *a: None)
        self.rebuild(force=restarted)
        with self.changed:
            self.changed.notify_all()

    def on_down(self, upstream: Upstream) -> None:
        with self.lock:  # what the dead process asked of the client can no longer be answered
            stale = [cid for cid, (up, _, _) in self.client_requests.items() if up is upstream]
            for cid in stale:
                del self.client_requests[cid]
        for cid in stale:
            self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": cid, "reason": f"upstream '{upstream.name}' went away"}})
        detail = upstream.last_error or ""
        self._record_status(upstream, upstream.state, detail)
        if upstream.state == "failed":
            self.rebuild()
        with self.changed:
            self.changed.notify_all()

    def _record_status(self, upstream: Upstream, status: str, detail: str, capabilities=None) -> None:
        try:
            with self.vault_lock:
                self.vault.record_status(upstream.name, status, detail[:2000], capabilities)
        except sqlite3.Error as exc:
            warn(f"[{upstream.name}] could not record status: {exc}")

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        method = message["method"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if method == "notifications/message":
            params = dict(params)
            params["logger"] = f"{upstream.name}/{params['logger']}" if params.get("logger") else upstream.name
            message = {"jsonrpc": "2.0", "method": method, "params": params}
        elif method == "notifications/resources/updated" and isinstance(params.get("uri"), str):
            params = dict(params)
            params["uri"] = self.catalogue.exposed_uri(upstream.name, params["uri"])
            message = {"jsonrpc": "2.0", "method": method, "params": params}
        elif method == "notifications/cancelled":
            with self.lock:
                ours = next((cid for cid, (up, _, uid) in self.client_requests.items()
                             if up is upstream and uid == params.get("requestId")), None)
                if ours is None:
                    return
                del self.client_requests[ours]
            message = {"jsonrpc": "2.0", "method": method, "params": {**params, "requestId": ours}}
        if self.initialized:
            self.send(message)

    def on_request(self, upstream: Upstream, message: dict) -> None:
        """A server->client request (sampling, elicitation, roots): relay it under an id of Coffer's own."""
        needed = SERVER_REQUEST_NEEDS.get(message["method"])
        if needed and needed not in self.client_capabilities:
            upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND,
                                       f"the connected client does not support {needed}"))
            return
        with self.lock:
            self._client_request_seq += 1
            ours = f"coffer-{self._client_request_seq}"
            self.client_requests[ours] = (upstream, upstream.generation, message["id"])
        self.send({**message, "id": ours})

    def _client_response(self, message: dict) -> None:
        with self.lock:
            route = self.client_requests.pop(message["id"], None)
        if route is not None:
            upstream, generation, their_id = route
            if upstream.generation == generation:  # a restarted server never asked this; drop the answer
                upstream.respond({**message, "id": their_id})

    def _client_notification(self, method: str, params: dict) -> None:
        if method == "notifications/cancelled":
            request_id = params.get("requestId")
            with self.lock:
                entry = self.inflight.pop(request_id, None) if valid_request_id(request_id) else None
            if entry is not None:
                upstream, ticket, capability, kind, started = entry
                if upstream.cancel(ticket, str(params.get("reason") or "cancelled by the client")[:200]):
                    self.log.record(self.client_name, upstream.name, capability, kind, started, "cancelled",
                                    "cancelled by the client")
        elif method == "notifications/roots/list_changed":
            for upstream in list(self.upstreams.values()):
                if upstream.state == "ready":
                    upstream.notify(method, params or None)

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
            catalogue = Catalogue(live, self.enabled, self.settings["name_max_length"])
            old, new = self._fingerprint, catalogue.fingerprint()
            self.catalogue, self._fingerprint = catalogue, new
            if self.semantic is not None:
                self.semantic.refresh(catalogue.tools)
            if not self.initialized:
                return
            for key in ("tools", "prompts", "resources"):
                if key in self.advertised and (old[key] != new[key] or (force and key == "tools")):
                    self.send({"jsonrpc": "2.0", "method": f"notifications/{key}/list_changed"})

    def _discovering(self, kind: str | None = None) -> list[str]:
        """Upstreams still starting; with ``kind``, only those with no remembered list of that kind."""
        return [up.name for up in list(self.upstreams.values())
                if up.state not in ("failed", "stopped") and not up.ready_at
                and not (kind and kind in up.remembered)]

    def _after_discovery(self, msg_id, work, background: bool = False, kind: str | None = None) -> None:
        """Run ``work`` once every upstream has been discovered (or, for ``kind``, is remembered from its last
        start) or the discovery budget is spent.

        Answers at once when nothing is pending; otherwise waits on a helper thread, so the client's other
        requests (a ping, a call to a ready server) are not held up behind a slow server.
        """
        def finish():
            with self.changed:
                while self._discovering(kind) and time.monotonic() < self.discovery_deadline:
                    self.changed.wait(max(0.01, self.discovery_deadline - time.monotonic()))
            missing = self._discovering(kind)
            if missing and not self._reported_missing:
                self._reported_missing = True
                warn(f"still starting after {self.settings['discovery_timeout']:g}s: {', '.join(missing)}; "
                     "their tools will be announced with notifications/tools/list_changed")
            self._answer(msg_id, "a deferred request", work)

        if not background and (not self._discovering(kind) or time.monotonic() >= self.discovery_deadline):
            return work()
        threading.Thread(target=finish, name="coffer-discovery-wait", daemon=True).start()
        return None

    def _tools_list(self, msg_id, params):
        def work():
            catalogue = self.catalogue
            if self.settings["expose"] == "search":
                return {"tools": [SEARCH_TOOL_DEFINITION]}
            return {"tools": [SEARCH_TOOL_DEFINITION] + catalogue.tools}
        return self._after_discovery(msg_id, work, kind="tool")

    def _prompts_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"prompts": self.catalogue.prompts}, kind="prompt")

    def _resources_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"resources": self.catalogue.resources})

    def _templates_list(self, msg_id, params):
        return self._after_discovery(msg_id, lambda: {"resourceTemplates": self.catalogue.templates})

    # -- routed requests -----------------------------------------------------------------------------------
    def _forward(self, msg_id, upstream: Upstream, method: str, params: dict, capability: str, kind: str | None,
                 started: float) -> None:
        """Send a client request upstream under the upstream's own id; its reply goes straight to the client."""
        state = {"done": False}
        client = self.client_name

        def on_reply(response, failure, text):
            with self.lock:
                state["done"] = True
                entry = self.inflight.get(msg_id)
                if entry is not None and entry[0] is upstream and entry[1] is state.get("ticket"):
                    del self.inflight[msg_id]
            # The row is queued before the client sees the reply, so the log's order is the order of causes.
            if response is None:
                if kind:
                    self.log.record(client, upstream.name, capability, kind, started, failure, text[:200])
                if method == "tools/call":
                    self.send(rpc_result(msg_id, tool_error_result(f"coffer: {text}")))
                else:
                    code = REQUEST_TIMEOUT if failure == "timeout" else UPSTREAM_ERROR
                    self.send(rpc_error(msg_id, code, text))
                return
            if kind:
                error = response.get("error")
                if error is not None:
                    code = error.get("code") if isinstance(error, dict) else None
                    self.log.record(client, upstream.name, capability, kind, started, "error",
                                    f"upstream returned JSON-RPC error {code}")
                elif method == "tools/call" and isinstance(response.get("result"), dict) \
                        and response["result"].get("isError") is True:
                    self.log.record(client, upstream.name, capability, kind, started, "error",
                                    "tool reported isError")
                else:
                    self.log.record(client, upstream.name, capability, kind, started, "ok")
            response["id"] = msg_id
            self.send(response)

        ticket = upstream.request(method, params, on_reply)
        if ticket is not None:
            with self.lock:
                if not state["done"]:
                    state["ticket"] = ticket
                    self.inflight[msg_id] = (upstream, ticket, capability, kind, started)

    def _deny(self, capability: str, kind: str, started: float, what: str):
        server = capability.partition(SEPARATOR)[0] if kind != "resource" else ""
        self.log.record(self.client_name, server, capability, kind, started, "denied", f"{what} is disabled")
        raise RpcError(INVALID_PARAMS, f"{what} {capability!r} is disabled in Coffer "
                                       f"(run `coffer enable {capability}` to allow it)")

    def _unknown(self, msg_id, name: str, kind: str, started: float, retry):
        """An unknown name: wait out discovery if its server is still starting, else a readable error."""
        server = name.partition(SEPARATOR)[0]
        if retry is not None and server in self._discovering() and time.monotonic() < self.discovery_deadline:
            return self._after_discovery(msg_id, retry)
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
        return self._route_named(msg_id, params, name, "tool", "tools/call", started)

    def _prompts_get(self, msg_id, params):
        started = time.monotonic()
        return self._route_named(msg_id, params, _require_str(params, "name"), "prompt", "prompts/get", started)

    def _route_named(self, msg_id, params, name: str, kind: str, method: str, started: float,
                     retried: bool = False):
        """Send a tool call or prompt fetch to the upstream that owns ``name``, under its original name."""
        catalogue = self.catalogue
        route = (catalogue.tool_routes if kind == "tool" else catalogue.prompt_routes).get(name)
        if route is None:
            if name in catalogue.disabled:
                self._deny(name, kind, started, kind)
            retry = None if retried else (
                lambda: self._route_named(msg_id, params, name, kind, method, started, True))
            return self._unknown(msg_id, name, kind, started, retry)
        upstream, original = route
        self._forward(msg_id, upstream, method, {**params, "name": original}, name, kind, started)
        return None

    def _resource_route(self, uri: str, started: float, log_kind):
        catalogue = self.catalogue
        if uri in catalogue.disabled:
            self._deny(uri, "resource", started, "resource")
        route = catalogue.route_resource(uri)
        if route is None:
            if log_kind:
                self.log.record(self.client_name, "", uri, log_kind, started, "error", "unknown resource")
            raise RpcError(INVALID_PARAMS, f"Unknown resource: {uri}")
        return route

    def _resources_read(self, msg_id, params):
        started = time.monotonic()
        uri = _require_str(params, "uri")

        def work():
            upstream, original = self._resource_route(uri, started, "resource")
            # A templated URI carries the caller's values; the log keeps only what identifies the capability.
            listed = uri in self.catalogue.resource_routes
            capability = uri if listed else next(
                (text for regex, up, text in self.catalogue.template_routes if up is upstream and
                 regex.match(original)), "(template)")
            self._forward(msg_id, upstream, "resources/read", {**params, "uri": original}, capability,
                          "resource", started)

        return self._after_discovery(msg_id, work)

    def _subscription(self, method: str):
        def handler(msg_id, params):
            uri = _require_str(params, "uri")
            upstream, original = self._resource_route(uri, time.monotonic(), None)
            with self.lock:  # remembered so a restarted upstream is subscribed again
                subscribed = self.subscriptions[upstream.name]
                subscribed.add(original) if method == "resources/subscribe" else subscribed.discard(original)
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
                upstream.request("logging/setLevel", {"level": level}, lambda *a: None)
        return {}

    # -- built-in tools ------------------------------------------------------------------------------------
    def _search_tools(self, arguments: dict, started: float) -> dict:
        def fail(text):
            self.log.record(self.client_name, RESERVED_SERVER, SEARCH_TOOL, "tool", started, "error", text)
            return tool_error_result(text)

        query = arguments.get("query")
        top_k = arguments.get("top_k", 5)
        if not isinstance(query, str) or not query.strip():
            return fail("query must be a non-empty string")
        if isinstance(top_k, float) and top_k.is_integer():
            top_k = int(top_k)
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            return fail("top_k must be an integer between 1 and 20")
        index = self.catalogue.index
        top_k = max(1, min(20, top_k))
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

# ============================================================================================================
# 8. Command line
# ============================================================================================================


class GatewayClient:
    """Talks to a ``coffer serve`` subprocess exactly as an agent would, for ``coffer call`` and ``coffer tools``.

    It is an Upstream whose server happens to be Coffer itself, so the CLI exercises the real gateway path.
    """

    def __init__(self, vault: Vault):
        settings = dict(vault.settings())
        settings["init_timeout"] = float(settings["discovery_timeout"]) + float(settings["init_timeout"])
        settings["max_restarts"] = 1
        # Imported rather than run as a script, so Python uses the cached bytecode (compiling coffer.py costs
        # ~30 ms per start); sys.path is extended in-process so the upstreams' environment stays untouched.
        bootstrap = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                     "import coffer; sys.exit(coffer.main(['serve', '--live']))")
        config = {"name": RESERVED_SERVER, "transport": "stdio", "env": {"COFFER_HOME": vault.home},
                  "command": [sys.executable, "-c", bootstrap], "headers": {}}
        self.ready = threading.Event()
        self.upstream = Upstream(config, settings, self, {}, LATEST_PROTOCOL_VERSION)
        self.upstream._on_stderr = lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush())

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


def _print_table(rows: list[list[str]], headers: list[str]) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    for row in [headers] + rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def _command_text(server: dict) -> str:
    return server["url"] if server["transport"] == "http" else " ".join(shlex.quote(p) for p in server["command"])


def cmd_add(vault: Vault, args) -> int:
    env = dict(parse_env_assignment(item) for item in args.env)
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CofferError(f"bad --header {item!r}: expected NAME=VALUE")
        headers[key.strip()] = value
    vault.add_server(args.name, command=args.command or None, url=args.url, env=env, headers=headers,
                     cwd=args.cwd, policy=args.policy, timeout=args.timeout)
    print(f"added {args.name}: {_command_text(vault.server(args.name))}")
    return 0


def cmd_remove(vault: Vault, args) -> int:
    vault.remove_server(args.name)
    print(f"removed {args.name}")
    return 0


def cmd_list(vault: Vault, args) -> int:
    counts = collections.Counter(row["server"] for row in vault.capabilities()
                                 if row["kind"] == "tool" and row["present"] and row["enabled"])
    servers = [{"name": s["name"], "transport": s["transport"], "command": _command_text(s),
                "enabled": s["enabled"], "policy": s["policy"], "status": s["status"] or "never started",
                "detail": s["status_detail"], "since": s["status_at"], "tools": counts.get(s["name"], 0)}
               for s in vault.servers()]
    if args.json:
        print(json.dumps({"servers": servers}, indent=2, ensure_ascii=False))
    elif not servers:
        print("no servers yet: coffer add NAME -- COMMAND [ARGS...]")
    else:
        _print_table([[s["name"], "yes" if s["enabled"] else "no", s["status"], s["tools"], s["command"]]
                      for s in servers], ["NAME", "ENABLED", "STATUS", "TOOLS", "COMMAND"])
        for s in servers:
            if s["status"] == "failed" and s["detail"]:
                print(f"\n{s['name']} failed: {s['detail']}")
    return 0


def cmd_tools(vault: Vault, args) -> int:
    if args.cached:
        max_length = vault.setting("name_max_length")
        tools = [dict(json.loads(row["definition"]), name=expose_name(row["server"], row["name"], max_length))
                 for row in vault.capabilities() if row["kind"] == "tool" and row["present"] and row["enabled"]]
    else:
        with GatewayClient(vault) as client:
            tools = list(client.upstream.lists["tool"].values())
    if args.json:
        print(json.dumps({"tools": tools}, indent=2, ensure_ascii=False))
    else:
        for tool in tools:
            description = (tool.get("description") or "").strip().splitlines()
            print(f"{tool['name']:<48}  {description[0][:100] if description else ''}")
    return 0


def cmd_enable(vault: Vault, args, enabled: bool = True) -> int:
    try:
        what = vault.set_enabled(args.target, enabled)
    except NotListedYet:
        # Probably a server added but never started: ask it what it offers, then try once more.
        with GatewayClient(vault):
            pass
        what = vault.set_enabled(args.target, enabled)
    print(f"{'enabled' if enabled else 'disabled'} {what}")
    return 0


def cmd_policy(vault: Vault, args) -> int:
    vault.set_policy(args.server, args.policy)
    print(f"new capabilities of {args.server} will be {args.policy}")
    return 0


def cmd_call(vault: Vault, args) -> int:
    try:
        arguments = json.loads(args.arguments) if args.arguments is not None else {}
    except ValueError as exc:
        raise CofferError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise CofferError("arguments must be a JSON object, e.g. '{\"timezone\": \"UTC\"}'")
    with GatewayClient(vault) as client:
        try:
            result = client.call("tools/call", {"name": args.tool, "arguments": arguments})
        except UpstreamFailure as exc:
            raise CofferError(str(exc).replace("tools/call failed: ", "")) from None
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 1 if isinstance(result, dict) and result.get("isError") else 0


def cmd_log(vault: Vault, args) -> int:
    rows = vault.invocations(args.limit)
    if args.json:
        print(json.dumps({"invocations": rows}, indent=2, ensure_ascii=False))
    else:
        _print_table([[r["ts"], r["client"], r["capability"], r["kind"], f"{r['duration_ms']:.1f}ms", r["status"],
                       r["error"] or ""] for r in rows],
                     ["TIME", "CLIENT", "CAPABILITY", "KIND", "DURATION", "STATUS", "ERROR"])
    return 0


def cmd_audit(vault: Vault, args) -> int:
    rows = vault.audit_rows(args.limit)
    if args.json:
        print(json.dumps({"audit": rows}, indent=2, ensure_ascii=False))
    else:
        _print_table([[r["ts"], r["actor"], r["action"], r["target"] or "", r["detail"] or ""] for r in rows],
                     ["TIME", "ACTOR", "ACTION", "TARGET", "DETAIL"])
    return 0


def cmd_config(vault: Vault, args) -> int:
    if args.key and args.value is not None:
        vault.set_setting(args.key, args.value)
    settings = vault.settings()
    if args.key and args.key not in settings:
        raise CofferError(f"unknown setting {args.key!r}; known: {', '.join(sorted(DEFAULTS))}")
    for key in [args.key] if args.key else sorted(settings):
        print(f"{key} = {settings[key]}")
    return 0


def cmd_serve(vault: Vault, args) -> int:
    vault.actor = "gateway"
    gateway = Gateway(vault, remember=not args.live)

    def on_signal(signum, frame):
        if not gateway._stopping.is_set():  # a second signal must not interrupt the shutdown itself
            raise SystemExit(0)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_signal)
    try:
        gateway.serve(sys.stdin.buffer)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        gateway.shutdown()
    return 0


EPILOG = """
examples:
  coffer add time -- uvx mcp-server-time
  coffer add gh --env GITHUB_TOKEN='${GITHUB_TOKEN}' -- npx -y @modelcontextprotocol/server-github
  coffer add docs --url https://example.com/mcp --header 'Authorization=Bearer ${DOCS_TOKEN}'
  coffer list
  coffer tools
  coffer disable time__convert_time
  coffer call time__get_current_time '{"timezone": "UTC"}'
  coffer log --limit 20

agent configuration (Claude Code, Codex, Cursor, Claude Desktop): one stdio server whose command is
`coffer serve` (or `python /path/to/coffer.py serve`).

data: $COFFER_HOME (default ~/.coffer) holds coffer.db.  ${VAR} and ${VAR:-default} in --env, --header and the
command are stored as written and expanded from the gateway's environment when the server starts, so secrets
never reach the database.
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
                usage="coffer add NAME [--env KEY=VALUE]... [--timeout S] [--policy P] -- COMMAND [ARGS...]\n"
                      "       coffer add NAME --url URL [--header NAME=VALUE]...")
    p.add_argument("name", help="server name: 1-24 letters, digits or '-'; becomes the <server>__ prefix")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server; ${VAR} is expanded at start, never stored expanded")
    p.add_argument("--url", help="a remote server speaking MCP Streamable HTTP")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE", help="HTTP header (with --url)")
    p.add_argument("--cwd", help="working directory for the server process")
    p.add_argument("--timeout", type=float, help="per-call timeout in seconds (default: the call_timeout setting)")
    p.add_argument("--policy", default="enabled", choices=("enabled", "disabled"),
                   help="whether tools the server adds later start enabled (default) or disabled")
    p.set_defaults(command=[])
    command("remove", cmd_remove, "unregister a server").add_argument("name")
    p = command("list", cmd_list, "registered servers, their status and tool counts")
    p.add_argument("--json", action="store_true")
    p = command("tools", cmd_tools, "the aggregated tool catalogue, as a client sees it (starts every server)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cached", action="store_true", help="what the last session saw, without starting servers")
    command("enable", cmd_enable, "enable a server, tool, prompt or resource").add_argument("target")
    command("disable", lambda v, a: cmd_enable(v, a, False),
            "disable a server, tool, prompt or resource (kept across restarts and upgrades)").add_argument("target")
    p = command("policy", cmd_policy, "whether capabilities a server adds later start enabled or disabled")
    p.add_argument("server")
    p.add_argument("policy", choices=("enabled", "disabled"))
    p = command("call", cmd_call, "call one tool through the gateway and print its result (for scripts)")
    p.add_argument("tool")
    p.add_argument("arguments", nargs="?", help="a JSON object (default {})")
    for name, handler, text in (("log", cmd_log, "recent invocations (never arguments or results)"),
                                ("audit", cmd_audit, "every change to the vault, newest last")):
        p = command(name, handler, text)
        p.add_argument("--json", action="store_true")
        p.add_argument("--limit", type=int, default=50)
    p = command("config", cmd_config, "show or change a setting")
    p.add_argument("key", nargs="?")
    p.add_argument("value", nargs="?")
    p = command("serve", cmd_serve, "run the MCP gateway on stdio (what an agent's config runs)")
    p.add_argument("--live", action="store_true",
                   help="list only what started servers offer now; by default a server still starting is "
                        "listed as it was at its last start, and a change is announced when it is up")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    try:
        vault = Vault()
    except (sqlite3.Error, OSError) as exc:
        print(f"coffer: error: cannot open the vault under {coffer_home()}: {exc}", file=sys.stderr)
        return 1
    try:
        return args.handler(vault, args)
    except CofferError as exc:
        print(f"coffer: error: {exc}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:
        print(f"coffer: error: vault: {exc}", file=sys.stderr)
        return 1
    finally:
        vault.close()


if __name__ == "__main__":
    sys.exit(main())
