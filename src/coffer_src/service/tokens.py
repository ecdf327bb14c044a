"""Service tokens: named bearer tokens of HTTP clients, stored only as keyed hashes.

`coffer token add NAME` makes a token, shows it once and keeps HMAC-SHA256(salt, token) with a random salt of
the token's own; a request's token is checked against every stored digest in constant time, so neither a
stored row nor the time a check takes tells anything about a token.  The name is the client's name in the
invocation log and `coffer status`.  The schema is the vault's (vault.CLIENT_TOKENS_SCHEMA); like the knowledge
tables it is created on first use, on a connection of this module's own (the service checks tokens from many
threads at once).
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from typing import NamedTuple

from coffer_src.digests import hmac_sha256, same_secret, token_hex, token_urlsafe
from coffer_src.errors import CofferError, VaultError
from coffer_src.vault import VAULT_BUSY_TIMEOUT_MS, _Transaction, cannot_write, connect_vault_db, utcnow
from coffer_src.vault_schema import CLIENT_TOKENS_SCHEMA

TOKEN_PREFIX = "coffer_"
TOKEN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: A presented token longer than this is not one of ours: refused unhashed.
MAX_TOKEN_LENGTH = 200
#: How often a token's last use is written (a write per request would make every request wait on the vault).
TOUCH_INTERVAL = 60.0
TOUCH_BUSY_TIMEOUT_MS = 50


class TokenHolder(NamedTuple):
    """Who presented a valid token: its name and its digest (the identity a session is bound to, so a token
    removed and added again under the same name does not inherit the old one's sessions)."""
    name: str
    digest: str


def token_digest(salt: str, token: str) -> str:
    return hmac_sha256(bytes.fromhex(salt), token.encode("utf-8", "surrogatepass")).hex()


def check_token_name(name: str) -> str:
    if not isinstance(name, str) or not TOKEN_NAME_RE.match(name):
        raise CofferError(f"bad token name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                          "or digit")
    return name


class TokenStore:
    """The client_tokens table.  ``lock`` serializes this store's one connection (a leaf: nothing else is taken
    while it is held).  Every sqlite3 error leaves as a VaultError."""

    def __init__(self, home: str):
        self.path = os.path.join(home, "coffer.db")
        self.lock = threading.Lock()
        self._touched: dict[str, float] = {}
        try:
            self.db = connect_vault_db(self.path)
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc
        self._ready = False

    def _table(self) -> None:
        """Create the table on first use (a read-only vault reads as having no tokens)."""
        if self._ready:
            return
        try:
            self.db.executescript(CLIENT_TOKENS_SCHEMA)
        except sqlite3.OperationalError as exc:
            if not cannot_write(exc):
                raise
        self._ready = True

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def add(self, name: str) -> str:
        """A new token for ``name``: returned once, never stored."""
        check_token_name(name)
        token = TOKEN_PREFIX + token_urlsafe(32)
        salt = token_hex(16)
        try:
            with self.lock:
                self._table()
                with _Transaction(self.db) as db:
                    if db.execute("SELECT 1 FROM client_tokens WHERE name=?", (name,)).fetchone():
                        raise CofferError(f"a token named {name!r} exists; remove it first (coffer token rm {name})")
                    db.execute("INSERT INTO client_tokens(name, salt, digest, created) VALUES (?,?,?,?)",
                               (name, salt, token_digest(salt, token), utcnow()))
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc
        return token

    def remove(self, name: str) -> bool:
        try:
            with self.lock:
                self._table()
                with _Transaction(self.db) as db:
                    return db.execute("DELETE FROM client_tokens WHERE name=?", (name,)).rowcount > 0
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc

    def rows(self) -> list[dict]:
        """Each token's name, when it was made and last used: never the token, nor its digest."""
        return [{"name": row["name"], "created": row["created"], "last_used": row["last_used"]}
                for row in self._select("SELECT name, created, last_used FROM client_tokens ORDER BY name")]

    def digests(self) -> set[str]:
        """The digests of the tokens that exist now (what sessions are bound to)."""
        return {row["digest"] for row in self._select("SELECT digest FROM client_tokens")}

    def verify(self, presented) -> TokenHolder | None:
        """The holder of a presented token, or None.  Every stored digest is computed and compared (constant
        time, no early exit), so a check costs the same whichever row matches, or none."""
        if not isinstance(presented, str) or not presented or len(presented) > MAX_TOKEN_LENGTH:
            return None
        found = None
        for row in self._select("SELECT name, salt, digest FROM client_tokens"):
            try:
                candidate = token_digest(row["salt"], presented)
            except ValueError:
                continue  # a damaged row costs only itself
            if same_secret(candidate.encode(), str(row["digest"]).encode("utf-8", "surrogatepass")):
                found = TokenHolder(row["name"], row["digest"])
        if found is not None:
            self._touch(found.name)
        return found

    def _select(self, sql: str) -> list:
        try:
            with self.lock:
                self._table()
                return self.db.execute(sql).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise VaultError.wrap(exc, self.path) from exc
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc

    def _touch(self, name: str) -> None:
        now = time.monotonic()
        if now - self._touched.get(name, -TOUCH_INTERVAL) < TOUCH_INTERVAL:
            return
        self._touched[name] = now
        try:
            with self.lock:
                # The request waits on this write, and so does every other token check (the lock): a vault
                # another process holds busy skips the update instead of waiting out the usual busy timeout.
                self.db.execute(f"PRAGMA busy_timeout={TOUCH_BUSY_TIMEOUT_MS}")
                try:
                    with _Transaction(self.db) as db:
                        db.execute("UPDATE client_tokens SET last_used=? WHERE name=?", (utcnow(), name))
                finally:
                    self.db.execute(f"PRAGMA busy_timeout={VAULT_BUSY_TIMEOUT_MS}")
        except (sqlite3.Error, VaultError):
            pass  # a busy or read-only vault: the last use is a convenience, never a reason to refuse a client
