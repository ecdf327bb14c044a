"""Vault: coffer.db: servers, choices, settings; reading the invocation and audit logs."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import shlex
import sqlite3
import stat
import time
import types
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

from coffer_src.errors import CofferError, NotListedYet, VaultError
from coffer_src.names import (
    QUALIFIED_URI_RE,
    REMOTE_TRANSPORTS,
    SEPARATOR,
    check_remote_url,
    check_server_name,
    did_you_mean,
    exposed_names,
    qualify_uri,
)
from coffer_src.secret_store import SecretStore
from coffer_src.settings import DEFAULTS, PER_KEY_SETTING_RE, check_setting, unknown_setting
from coffer_src.terminal import ServerLog, redact
from coffer_src.vault_rows import (
    SHARING_MODES,
    definition_diff,
    definition_without_controls,
    fingerprint,
    server_row,
    vault_json,
)
from coffer_src.vault_schema import MIGRATIONS, SCHEMA, SCHEMA_TRIGGERS

vault_log = logging.getLogger(__name__)


def utcnow() -> str:
    return iso_timestamp(time.time())


def iso_timestamp(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


CAPABILITY_KINDS = ("tool", "prompt", "resource", "template")
VAULT_BUSY_TIMEOUT_MS = 10_000  # how long a write waits for another process's (a CLI command, an import)
VAULT_CACHE_KIB = 512  # SQLite page cache per vault connection (SQLite's default is 2 MB)
PRIVATE_FILES = ("coffer.db", "coffer.db-wal", "coffer.db-shm", "secrets.json")


def coffer_home() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("COFFER_HOME") or os.path.join("~", ".coffer")))


def storable(text):
    """Text for a vault column or a log: lone surrogates replaced, so SQLite's UTF-8 encoding cannot fail."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def connect_vault_db(path: str, uri: bool = False) -> sqlite3.Connection:
    """A connection to coffer.db as every part of Coffer opens one (the vault, the logs, the knowledge base, the
    caches): rows by name, autocommit, a busy timeout, WAL, a small page cache."""
    db = sqlite3.connect(path, timeout=VAULT_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False,
                         uri=uri)
    db.row_factory = sqlite3.Row
    db.execute(f"PRAGMA busy_timeout={VAULT_BUSY_TIMEOUT_MS}")
    # The vault's rows are few and read in full: a small page cache is enough, and a long-running service
    # holds several connections for hours.
    db.execute(f"PRAGMA cache_size=-{VAULT_CACHE_KIB}")
    if not uri:
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            pass  # another process is switching it right now (WAL is persistent), or the file is read-only
        db.execute("PRAGMA synchronous=NORMAL")
    return db


def cannot_write(exc: sqlite3.Error) -> bool:
    """Whether a SQLite error says the file cannot be written here (a read-only vault)."""
    text = str(exc).lower()
    return "readonly" in text or "read-only" in text or "unable to open" in text


#: --kind NAME in `coffer audit` also covers these actions.
AUDIT_ACTION_GROUPS = {"add": ("add", "import", "import-overwrite")}


def _audit_filter(since: str | None, action: str | None, server: str | None) -> tuple[str, list]:
    """The WHERE clause and its arguments of Vault.audit_rows and audit_count."""
    where, args = [], []
    if since:
        where.append("ts >= ?")
        args.append(since)
    if action:
        actions = AUDIT_ACTION_GROUPS.get(action, (action,))
        where.append("(" + " OR ".join("action = ? OR action LIKE ?" for _ in actions) + ")")
        for name in actions:
            args += [name, name.replace("%", "") + "-%"]
    if server:  # ('_' is LIKE's any-character: the separator is escaped)
        where.append("(target = ? OR target LIKE ? ESCAPE '!' OR target LIKE ? ESCAPE '!' OR target LIKE ?"
                     " ESCAPE '!')")
        args += [server, f"{server}:%", f"{server}{SEPARATOR.replace('_', '!_')}%", f"coffer+{server}:%"]
    return (" WHERE " + " AND ".join(where) if where else ""), args


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


def _at_the_vault_boundary(cls):
    """Class decorator: every public method of ``cls`` (and its constructor) raises VaultError where SQLite raised.
    The one place sqlite3 errors are translated; private helpers and other modules' own connections stay raw."""
    def guarded(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                raise VaultError.wrap(exc, getattr(self, "path", "coffer.db")) from exc
        return call

    for name, member in list(vars(cls).items()):
        if (name == "__init__" or not name.startswith("_")) and isinstance(member, types.FunctionType):
            setattr(cls, name, guarded(member))
    return cls


@_at_the_vault_boundary
class Vault:
    """coffer.db: the registered servers, the user's choices, and the logs.

    Every change is one transaction.  Many processes share the file (several ``coffer serve`` plus the CLI), so
    it runs in WAL mode with a busy timeout, and writers keep their transactions short.  COFFER_HOME is 0700 and
    every file in it 0600; looser permissions are fixed on open, with a notice.  A vault that cannot be written
    (a read-only file or directory) opens read-only: reading commands work, changing ones say why they cannot.
    One damaged row costs that row only: a server whose definition does not parse is reported and not started,
    a setting that does not parse falls back to its default with a warning.  What SQLite raises under a public
    method (or inside ``with vault.transaction()``) reaches the caller as a VaultError, a CofferError.
    """

    AUDIT_EACH_ADDED = 20          # more capabilities added at once than this are audited in one row
    AUDIT_NAMES_CHARS = 64 << 10   # the names such a row lists, at most

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
            self.db = connect_vault_db(self.path)
            self._migrate()
        except sqlite3.OperationalError as exc:
            if not cannot_write(exc):
                raise
            self._open_read_only(exc)
        for notice in filter(None, [_private_path(self.home, True)] +
                             [_private_path(os.path.join(self.home, name), False) for name in PRIVATE_FILES]):
            vault_log.warning("%s", notice)
        if was_empty:
            vault_log.warning("coffer.db in %s was EMPTY (0 bytes): it now holds a new, empty vault. Your servers, "
                              "choices and logs are gone unless you restore the file from a backup.", self.home)
        self.secrets.values()  # registers the stored secrets with the redactor before anything is printed

    def _migrate(self) -> None:
        tables = {row["name"] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [(t, c, d) for t, c, d in MIGRATIONS if t in tables and c not in
                   {row["name"] for row in self.db.execute(f"PRAGMA table_info({t})")}]
        required = {"settings", "servers", "capabilities", "profiles", "overrides", "invocations", "audit",
                    "search_feedback", "config_changes"}
        triggers = {row["name"] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
        if tables >= required and triggers >= SCHEMA_TRIGGERS and not missing:
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
                self.db = connect_vault_db(location + suffix, uri=True)
                self.db.execute("SELECT count(*) FROM servers").fetchone()
                break
            except sqlite3.Error as exc:
                last = exc
        else:
            raise VaultError(f"cannot open the vault {self.path}: {last}") from None
        self.read_only = True
        vault_log.warning("the vault %s is read-only (%s): commands that only read work, changes are refused",
                          self.path, cause)

    def transaction(self):
        """``with vault.transaction() as db:`` one write transaction; what SQLite raises inside is a VaultError."""
        if self.read_only:
            raise VaultError(f"the vault {self.path} is read-only: this command would change it")
        return _VaultTransaction(self.db, self.path)

    def close(self) -> None:
        self.db.close()

    # -- health: what `coffer doctor` checks -------------------------------------------------------------------
    def table_columns(self) -> dict[str, set[str]]:
        """Every table in coffer.db (virtual ones and FTS5's own included) and its columns."""
        columns = {}
        for (table,) in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
            try:
                columns[table] = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            except sqlite3.OperationalError:
                columns[table] = set()  # a virtual table of a module this Python lacks (FTS5): unreadable here
        return columns

    def integrity_problem(self) -> str | None:
        """What SQLite's quick check finds wrong in coffer.db's pages, or None."""
        check = self.db.execute("PRAGMA quick_check").fetchone()[0]
        return None if check == "ok" else check

    def has_knowledge_sources(self) -> bool:
        """Whether a folder was ever added as a knowledge source (no knowledge table yet: none was)."""
        try:
            row = self.db.execute("SELECT count(*) FROM knowledge_sources WHERE kind='folder'").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return False
            raise
        return bool(row and row[0])

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
                current[key] = check_setting(setting_key(key), json.loads(row["value"]))
            except (ValueError, TypeError, CofferError) as exc:
                if key not in _reported_settings:
                    _reported_settings.add(key)
                    vault_log.warning("setting %s in coffer.db is damaged (%s); using the default %r "
                                      "(fix: coffer config %s VALUE)", key, exc, DEFAULTS[setting_key(key)], key)
        return current

    def set_setting(self, key: str, raw: str) -> None:
        """Change a setting; for a per-client or per-server one (expose.cursor, redact.vault), an empty value removes
        the override."""
        if setting_key(key) not in DEFAULTS:
            raise CofferError(unknown_setting(key))
        with self.transaction() as db:
            old = self.setting(key)
            if key != setting_key(key) and raw == "":
                db.execute("DELETE FROM settings WHERE key=?", (key,))
                self._audit(db, "config", key, f"{old!r} -> (the global {setting_key(key)})")
                return
            value = check_setting(setting_key(key), raw)
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
        return [server_row(row) for row in self.db.execute("SELECT * FROM servers ORDER BY position, name")]

    def server(self, name: str) -> dict:
        row = self.db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}{did_you_mean(name, self._all_names())}")
        return server_row(row)

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

    def set_sharing(self, name: str, sharing: str, reason: str | None = None) -> None:
        """shared: the service runs one instance of the server for every client; per-client: one per client
        session (a server whose answers depend on its client).  ``reason`` says why (shown by `coffer show`)."""
        if sharing not in SHARING_MODES:
            raise CofferError(f"bad sharing mode {sharing!r}: use shared or per-client")
        with self.transaction() as db:
            old = self._require_server(db, name)["sharing"]
            db.execute("UPDATE servers SET sharing=?, sharing_reason=? WHERE name=?", (sharing, reason, name))
            if old != sharing:
                self._audit(db, "sharing", name, f"{old} -> {sharing}" + (f": {reason}" if reason else ""))

    def record_status(self, name: str, status: str, detail: str | None, capabilities: dict | None = None) -> None:
        with self.transaction() as db:
            db.execute("UPDATE servers SET status=?, status_detail=?, status_at=?,"
                       " capabilities=coalesce(?, capabilities) WHERE name=?",
                       (status, storable(redact(detail)) if detail else detail, utcnow(),
                        vault_json(capabilities) if capabilities is not None else None, name))

    def _require_server(self, db, name):
        row = db.execute("SELECT * FROM servers WHERE name=?", (name,)).fetchone()
        if not row:
            raise CofferError(f"unknown server {name!r}{did_you_mean(name, self._all_names(db))}")
        return row

    # -- targets: what a CLI argument names, exactly as a client sees it ------------------------------------
    def _all_names(self, db=None) -> list[str]:
        db = db or self.db
        max_length = self.setting("name_max_length")
        names = [row["name"] for row in db.execute("SELECT name FROM servers")]
        listed: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        for row in db.execute("SELECT server, kind, name FROM capabilities WHERE present=1 AND server IN"
                              " (SELECT name FROM servers) ORDER BY rowid"):
            if row["kind"] in ("tool", "prompt"):
                listed[(row["server"], row["kind"])].append(row["name"])
            else:
                names.append(row["name"])
        for (server, _), items in listed.items():
            names.extend(exposed_names(server, items, max_length, {n: i for i, n in enumerate(items)}).values())
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
                rows = db.execute("SELECT name, present FROM capabilities WHERE server=? AND kind=? ORDER BY rowid",
                                  (server, kind)).fetchall()
                present = [row["name"] for row in rows if row["present"]]
                listed = exposed_names(server, present, max_length, {n: i for i, n in enumerate(present)})
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
        hint = did_you_mean(target, self._all_names(db))
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
            self._audit(db, verb, target if kind in ("tool", "prompt") else qualify_uri(server, name), kind)
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
                label = (self._exposed(db, row["server"], row["kind"], max_length).get(row["name"], row["name"])
                         if row["kind"] in ("tool", "prompt") else row["name"])
                approved.append((f"{row['kind']} {label}", definition_diff(row["approved_definition"],
                                                                          row["definition"])))
                db.execute("UPDATE capabilities SET approved=fingerprint, approved_definition=definition WHERE"
                           " server=? AND kind=? AND name=?", (row["server"], row["kind"], row["name"]))
                self._audit(db, "approve", label if row["kind"] in ("tool", "prompt")
                            else qualify_uri(row["server"], row["name"]), row["kind"])
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
                "SELECT name, enabled, present, fingerprint, approved, approved_definition FROM capabilities"
                " WHERE server=? AND kind=?", (server, kind))}
            seniority = self._seniority(db, server, kind)
            labels = exposed_names(server, definitions, max_length, seniority) if kind in ("tool", "prompt") else {}
            before = self._exposed(db, server, kind, max_length) if kind in ("tool", "prompt") else {}

            def target(name: str) -> str:
                """How the audit names a capability: as a client and the CLI do (server__tool, a resource's
                coffer+server:uri), so a row's target is something `coffer enable/disable` takes."""
                if kind in ("tool", "prompt"):
                    return labels.get(name) or before.get(name) or f"{server}{SEPARATOR}{name}"
                return qualify_uri(server, name)

            added = [name for name in definitions if name not in known]
            # A server's first catalogue (or any large addition) is one row with the count and the names, not a
            # row per tool: an upstream listing 10,000 tools must not flood the audit log.
            one_row = len(added) > 1 and (not known or len(added) > self.AUDIT_EACH_ADDED)
            if srv is not None and one_row:
                self._audit(db, "upstream-added", server, _added_detail(kind, added, default, first=not known),
                            actor="upstream")
            for name, definition in definitions.items():
                fp, text = fingerprint(definition, kind), vault_json(definition)
                row = known.get(name)
                if row is None:
                    db.execute("INSERT OR IGNORE INTO capabilities(server, kind, name, enabled, present, fingerprint,"
                               " definition, first_seen, last_seen, approved, approved_definition)"
                               " VALUES (?,?,?,?,1,?,?,?,?,?,?)",
                               (server, kind, name, default, fp, text, now, now, fp, text))
                    if srv is not None and not one_row:
                        self._audit(db, "upstream-added", target(name),
                                    f"{kind}; {'enabled' if default else 'disabled'} by policy", actor="upstream")
                    continue
                approved = row["approved"]
                if approved is not None and approved != fp and _only_controls_removed(row["approved_definition"],
                                                                                      kind, fp):
                    approved = None  # what was approved, as Coffer now shows it: not a change to review
                if approved is None or trusting:
                    approved_sql = "approved=?, approved_definition=?,"
                    approved_args = (fp, text)
                    if approved is not None and approved != fp:
                        self._audit(db, "upstream-changed", target(name), f"{kind}; trusted (trust-updates)",
                                    actor="upstream")
                else:
                    approved_sql, approved_args = "", ()
                    if fp != row["fingerprint"] and fp != approved:
                        label = labels.get(name, name)
                        self._audit(db, "upstream-changed", target(name),
                                    f"{kind}; quarantined until `coffer approve {label}`", actor="upstream")
                        ServerLog(vault_log, server).warning(
                            "%s %s changed its definition since it was approved; it is hidden until you review it "
                            "with `coffer approve %s`", kind, label, label)
                if not row["present"]:
                    self._audit(db, "upstream-restored", target(name), kind, actor="upstream")
                db.execute(f"UPDATE capabilities SET present=1, fingerprint=?, definition=?, {approved_sql}"
                           " last_seen=? WHERE server=? AND kind=? AND name=?",
                           (fp, text, *approved_args, now, server, kind, name))
            for name, row in known.items():
                if name not in definitions and row["present"]:
                    db.execute("UPDATE capabilities SET present=0 WHERE server=? AND kind=? AND name=?",
                               (server, kind, name))
                    self._audit(db, "upstream-removed", target(name), kind, actor="upstream")
            for name, why in (rejected or {}).items():
                self._audit(db, "upstream-rejected", f"{server}{SEPARATOR}{storable(name)[:200]}", f"{kind}; {why}",
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
        """Every capability's state, oldest first (the order exposed names are given in: see seniority)."""
        return {(row["server"], row["kind"], row["name"]): _state(row)
                for row in self.db.execute("SELECT server, kind, name, enabled, fingerprint, approved"
                                           " FROM capabilities ORDER BY rowid")}

    @staticmethod
    def _seniority(db, server: str, kind: str) -> dict[str, int]:
        """name -> rank of one server's tools (or prompts) by when Coffer first saw them (exposed_names)."""
        return {row["name"]: i for i, row in enumerate(db.execute(
            "SELECT name FROM capabilities WHERE server=? AND kind=? ORDER BY rowid", (server, kind)))}

    def _exposed(self, db, server: str, kind: str, max_length: int) -> dict[str, str]:
        """{name: exposed name} of the tools (or prompts) a server lists now, as the catalogue names them."""
        rows = db.execute("SELECT name FROM capabilities WHERE server=? AND kind=? AND present=1 ORDER BY rowid",
                          (server, kind)).fetchall()
        present = [row["name"] for row in rows]
        return exposed_names(server, present, max_length, {name: i for i, name in enumerate(present)})

    def seniority(self) -> dict[tuple[str, str], dict[str, int]]:
        """(server, kind) -> {name: rank by first sight}: what exposed_names needs, for every server at once."""
        ranks: dict[tuple[str, str], dict[str, int]] = {}
        for row in self.db.execute("SELECT server, kind, name FROM capabilities ORDER BY rowid"):
            names = ranks.setdefault((row["server"], row["kind"]), {})
            names[row["name"]] = len(names)
        return ranks

    def capabilities(self, server: str | None = None) -> list[dict]:
        sql = "SELECT * FROM capabilities" + (" WHERE server=?" if server else "") + " ORDER BY server, kind, name"
        return [dict(row) for row in self.db.execute(sql, (server,) if server else ())]

    def data_version(self) -> int:
        """Changes whenever another connection commits: how a running gateway notices CLI edits cheaply."""
        return self.db.execute("PRAGMA data_version").fetchone()[0]

    def config_generation(self) -> int | None:
        """Moves whenever what a gateway serves from changes (vault_schema.change_triggers), whoever wrote it; None
        on a vault without the counter (read-only, from an earlier Coffer): then every commit may be a change."""
        try:
            row = self.db.execute("SELECT generation FROM config_changes").fetchone()
        except sqlite3.OperationalError:
            return None
        return row[0] if row else None

    # -- logs ----------------------------------------------------------------------------------------------
    def audit(self, action: str, target: str, detail: str | None = None) -> None:
        """An audit row for a change made outside coffer.db (the secret store, a knowledge folder): names, never
        a secret value."""
        with self.transaction() as db:
            self._audit(db, action, target, detail)

    def _audit(self, db, action: str, target, detail, actor: str | None = None) -> None:
        db.execute("INSERT INTO audit(ts, actor, action, target, detail) VALUES (?,?,?,?,?)",
                   (utcnow(), actor or self.actor, action, storable(target), storable(detail)))

    def invocations(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute(f"SELECT {', '.join(Invocation._fields)} FROM invocations ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [dict(row) for row in reversed(rows)]

    #: ``--kind`` words that stand for more than their own action: an import adds servers too.
    def audit_rows(self, limit: int = 50, since: str | None = None, action: str | None = None,
                   server: str | None = None) -> list[dict]:
        """The newest ``limit`` audit rows, oldest first; ``since`` an ISO date or time, ``action`` an action
        name or its prefix (``upstream`` matches upstream-added, -changed...; ``add`` imports too), ``server`` a
        server's rows."""
        where, args = _audit_filter(since, action, server)
        rows = self.db.execute(f"SELECT ts, actor, action, target, detail FROM audit{where} ORDER BY id DESC LIMIT ?",
                               (*args, limit)).fetchall()
        return [dict(row) for row in reversed(rows)]

    def audit_count(self, since: str | None = None, action: str | None = None, server: str | None = None) -> int:
        """How many audit rows audit_rows would show without its limit."""
        where, args = _audit_filter(since, action, server)
        return self.db.execute(f"SELECT count(*) FROM audit{where}", args).fetchone()[0]

    def prune(self) -> tuple[int, int]:
        """Apply retention.  Runs when ``serve`` starts, so a long-lived vault never grows without bound."""
        settings = self.settings()
        now = datetime.now(timezone.utc)
        cut_inv = (now - timedelta(days=float(settings["retention_invocations_days"]))).isoformat()
        cut_aud = (now - timedelta(days=float(settings["retention_audit_days"]))).isoformat()
        with self.transaction() as db:
            n_inv = db.execute("DELETE FROM invocations WHERE ts < ?", (cut_inv.replace("+00:00", "Z"),)).rowcount
            db.execute("DELETE FROM search_feedback WHERE ts < ?", (cut_inv.replace("+00:00", "Z"),))
            n_aud = db.execute("DELETE FROM audit WHERE ts < ?", (cut_aud.replace("+00:00", "Z"),)).rowcount
            db.execute("DELETE FROM capabilities WHERE last_seen < ? AND server NOT IN (SELECT name FROM servers)",
                       (cut_aud.replace("+00:00", "Z"),))  # choices of servers removed long ago
        return n_inv, n_aud


def _added_detail(kind: str, names: list[str], enabled: int, first: bool) -> str:
    """The detail of one audit row for many capabilities added at once: what, how many, the policy, the names."""
    shown, size = [], 0
    for name in names:
        size += len(name) + 2
        if size > Vault.AUDIT_NAMES_CHARS:
            break
        shown.append(name)
    more = f" (and {len(names) - len(shown)} more)" if len(shown) < len(names) else ""
    return (f"{'first catalogue: ' if first else ''}{len(names)} {kind}s, {'enabled' if enabled else 'disabled'} "
            f"by policy: {', '.join(shown)}{more}")


def _only_controls_removed(approved_definition: str | None, kind: str, fp: str) -> bool:
    """Whether the approved definition, with its control characters removed as Coffer now removes them at the
    boundary, is the one listed now (a pin made before that rule must not hold the capability back)."""
    try:
        approved = json.loads(approved_definition) if approved_definition else None
    except ValueError:
        return False
    return isinstance(approved, dict) and fingerprint(definition_without_controls(kind, approved), kind) == fp


def _state(row) -> CapabilityState:
    return CapabilityState(bool(row["enabled"]), row["approved"] is not None and row["approved"] != row["fingerprint"])


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT: take the write lock up front so a busy vault waits instead of failing late.
    On any connection to coffer.db (other modules' own too): SQLite's errors pass through as they are."""

    def __init__(self, db):
        self.db = db

    def __enter__(self):
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if cannot_write(exc):
                raise VaultError(f"the vault cannot be written ({exc}): this command would change it") from None
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


class _VaultTransaction(_Transaction):
    """A Vault's own transaction: a sqlite3.Error raised inside the block, or by BEGIN, COMMIT or ROLLBACK, leaves
    it as a VaultError."""

    def __init__(self, db, path: str):
        super().__init__(db)
        self.path = path

    def __enter__(self):
        try:
            return super().__enter__()
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc

    def __exit__(self, exc_type, exc, tb):
        try:
            super().__exit__(exc_type, exc, tb)
        except sqlite3.Error as error:
            raise VaultError.wrap(error, self.path) from error
        if isinstance(exc, sqlite3.Error):
            raise VaultError.wrap(exc, self.path) from exc
        return False


def setting_key(key: str) -> str:
    """The DEFAULTS entry a setting name is checked against: expose.<client> is an expose setting, redact.<server>
    a redact setting."""
    match = PER_KEY_SETTING_RE.match(key)
    return match.group(1) if match else key


class Invocation(NamedTuple):
    """One row of the invocation log as recorded: who called what, how long it took, how it ended.  The fields
    are the invocations columns; ``ts`` stays epoch seconds until ``row()`` formats it on the writer thread, so
    recording costs a caller nothing but a queue put."""
    ts: float
    client: str | None
    server: str | None
    capability: str | None
    kind: str | None
    duration_ms: float
    status: str
    error: str | None
    profile: str | None = None   # the client session's profile (see profiles.py); None: no profile

    def row(self) -> tuple:
        """The values as written: the time as ISO text, every text redacted, storable and cut to 500 characters."""
        return (iso_timestamp(self.ts),
                *(storable(redact(value))[:500] if isinstance(value, str) else value for value in self[1:]))
