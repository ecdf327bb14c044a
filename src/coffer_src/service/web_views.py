"""Web views: what the page shows and changes (from the service; written like the CLI).
changes it makes, read from the running service and written like the CLI writes them.

Reads come from the service as it runs (the hub's upstreams, catalogue and search index, its sessions) and from
coffer.db through a vault connection of the page's own (actor "web"): every change the page makes is one of the
vault's own transactions, audited like the CLI's, and the hub, which notices every other connection's commits
within a second (Hub._reload_if_vault_changed), applies it and tells the agents, exactly as after a CLI command.
Nothing here returns a secret's value: server definitions keep their ${NAME} references, literals are never shown,
and the secret store is read for names only (the web layer redacts every string it sends on top).

Threads and locks: the web server calls in on one thread per request.  ``lock`` guards the vault connection and
the catalogue snapshot; it is a leaf (nothing else is taken while it is held: the hub and the knowledge base are
called outside it).  The hub's state is read the way its own readers do (whole attributes, replaced not changed).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import sqlite3
import threading
import time

from coffer_src import __version__
from coffer_src.clients.doctor import _command_text, server_report, shown_value
from coffer_src.errors import CofferError, NotListedYet, VaultError
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.knowledge.ranking import passage_embedding_text
from coffer_src.names import SEPARATOR, exposed_names, qualify_uri
from coffer_src.search.preference import active_preference, explain_preferred
from coffer_src.search.semantic import Embedder, text_hash
from coffer_src.search.text import bounded_top_k
from coffer_src.secret_store import references
from coffer_src.service.server import rss_mb
from coffer_src.service.web_activity import ActivityLog
from coffer_src.transport.stdio import StdioTransport
from coffer_src.vault import Vault
from coffer_src.vault_rows import definition_diff

#: Rows of the catalogue one page request returns at most (the page shows a page of them, never 10,000).
CATALOGUE_PAGE_MAX = 500
CATALOGUE_KINDS = {"tool": ("tool",), "prompt": ("prompt",), "resource": ("resource", "template")}
CATALOGUE_STATES = ("enabled", "disabled", "changed", "server off", "gone")
#: How much of one changed text the readable diff compares word by word (a hostile upstream may send megabytes).
DIFF_TEXT_MAX = 20_000


def _first_line(text, limit: int = 240) -> str:
    if not isinstance(text, str):
        return ""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit - 1] + "…"


def word_diff(before: str, after: str) -> list[list[str]]:
    """[op, text] runs turning ``before`` into ``after`` word by word: "=" kept, "-" removed, "+" added."""
    old, new = re.split(r"(\s+)", before[:DIFF_TEXT_MAX]), re.split(r"(\s+)", after[:DIFF_TEXT_MAX])
    runs: list[list[str]] = []

    def put(op: str, text: str) -> None:
        if not text:
            return
        if runs and runs[-1][0] == op:
            runs[-1][1] += text
        else:
            runs.append([op, text])

    for tag, a1, a2, b1, b2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            put("=", "".join(old[a1:a2]))
        else:
            put("-", "".join(old[a1:a2]))
            put("+", "".join(new[b1:b2]))
    return runs


def _brief_json(value) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= DIFF_TEXT_MAX else text[:DIFF_TEXT_MAX] + "\n…"


def field_changes(before, after, path: str = "") -> list[dict]:
    """What changed between two definitions, field by field (dotted paths): added, removed, or changed (a text
    with its word diff, anything else before and after as JSON)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found: list[dict] = []
        for key in sorted(set(before) | set(after), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in before:
                found.append({"path": where, "change": "added", "after": _brief_json(after[key])})
            elif key not in after:
                found.append({"path": where, "change": "removed", "before": _brief_json(before[key])})
            elif before[key] != after[key]:
                found += field_changes(before[key], after[key], where)
        return found
    if isinstance(before, str) and isinstance(after, str):
        return [{"path": path or "(definition)", "change": "changed", "words": word_diff(before, after)}]
    return [{"path": path or "(definition)", "change": "changed", "before": _brief_json(before),
             "after": _brief_json(after)}]


def _loads(text):
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def error_fixes(name: str, error: str | None) -> list[dict]:
    """The fix an upstream's last error itself points to (a login, a missing program), for the page."""
    text = (error or "").lower()
    if "needs login" in text or "401" in text or "unauthorized" in text:
        return [{"problem": "the server wants a login", "fix": f"coffer auth {name}", "severity": "error"}]
    if "not found" in text and ("command" in text or "no such file" in text):
        return [{"problem": "its program was not found", "fix": f"coffer show {name}, then install the program or "
                 f"register it with an absolute path (coffer add {name} --replace -- /path/to/program ...)",
                 "severity": "error"}]
    return []


def profiles_view(hub, sessions) -> list[dict]:
    """Every profile: what it includes and leaves out, how many tools its clients see now (its view of the hub's
    catalogue, as a session of it gets), and which of the connected ``sessions`` use it."""
    views, catalogue = hub.views, hub.catalogue
    using: dict[str, set] = {}
    for session in sessions:
        if session.view.name is not None:
            using.setdefault(session.view.name, set()).add(session.client_name)
    return [{"name": name, "include": list(profile.include), "exclude": list(profile.exclude),
             "expose": profile.expose, "tools": len(views.catalogue(name, catalogue).tools),
             "clients": sorted(using.get(name, ()))}
            for name, profile in sorted(views.profiles.items())]


class WebViews:
    """The page's data and actions over one running service (see the module docstring)."""

    def __init__(self, service, activity: ActivityLog, vault: Vault | None = None):
        self.service = service
        self.hub = service.hub
        self.activity = activity
        self.vault = vault or Vault(service.home, actor="web")
        self.lock = threading.Lock()
        self._catalogue: tuple | None = None     # (signature, rows, servers)
        self._vectors: tuple | None = None       # (key, {source: ready})
        self._restarts = 0

    def close(self) -> None:
        with self.lock:
            self.vault.close()

    # -- reading coffer.db ---------------------------------------------------------------------------------
    def _rows(self, sql: str, args: tuple = ()) -> list:
        """A read the vault has no method for (counts, signatures), with SQLite's errors as VaultErrors."""
        try:
            return self.vault.db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            if "no such table" in str(exc):
                return []
            raise VaultError.wrap(exc, self.vault.path) from exc

    def _signature(self) -> tuple:
        """Cheap to read, and different whenever a capability, a server or the name length changes."""
        caps = self._rows("SELECT count(*), total(enabled * rowid), total(present * rowid), total((approved IS"
                          " fingerprint) * rowid), max(last_seen), total(length(fingerprint) * rowid) FROM"
                          " capabilities")
        servers = self._rows("SELECT group_concat(name || ':' || enabled || ':' || position, ',') FROM servers")
        return (tuple(caps[0]) if caps else (), tuple(servers[0]) if servers else (),
                self.vault.setting("name_max_length"))

    def _capability_rows(self) -> list[tuple]:
        """(server, kind, name, enabled, present, quarantined, definition text) of every capability: only the
        columns the list needs (not the approved definitions the Changed view reads)."""
        return self._rows("SELECT server, kind, name, enabled, present, approved IS NOT NULL AND approved !="
                          " fingerprint, definition FROM capabilities ORDER BY server, kind, rowid")

    def catalogue_rows(self) -> tuple[list[dict], list[dict]]:
        """Every capability of every registered server as the page lists it, and the servers in their order;
        rebuilt only when the vault's capabilities or servers changed."""
        with self.lock:
            signature = self._signature()
            if self._catalogue is not None and self._catalogue[0] == signature:
                return self._catalogue[1], self._catalogue[2]
            servers = self.vault.servers()
            capabilities = self._capability_rows()
            max_length = self.vault.setting("name_max_length")
        order = {server["name"]: position for position, server in enumerate(servers)}
        enabled = {server["name"]: server["enabled"] for server in servers}
        by_key: dict[tuple[str, str], list[tuple]] = {}
        for row in capabilities:
            if row[0] in order:
                by_key.setdefault((row[0], row[1]), []).append(row)
        rows = []
        for (server, kind), items in sorted(by_key.items(), key=lambda item: (order[item[0][0]], item[0][1])):
            exposed = exposed_names(server, [r[2] for r in items if r[4]], max_length) \
                if kind in ("tool", "prompt") else {}
            for _, _, upstream, on, present, quarantined, text in items:
                definition = _loads(text)
                definition = definition if isinstance(definition, dict) else {}
                if kind in ("tool", "prompt"):
                    name = exposed.get(upstream) or f"{server}{SEPARATOR}{upstream}"
                else:
                    name = upstream
                state = ("gone" if not present else "server off" if not enabled[server] else
                         "changed" if quarantined else "enabled" if on else "disabled")
                rows.append({"server": server, "kind": kind, "name": name, "upstream": upstream,
                             "title": _first_line(definition.get("title"), 120),
                             "description": _first_line(definition.get("description")), "state": state,
                             "enabled": bool(on), "target": name if kind in ("tool", "prompt")
                             else qualify_uri(server, upstream)})
        names = {}
        for row in rows:
            if row["kind"] in ("tool", "prompt"):
                names.setdefault(row["name"], set()).add(row["kind"])
        for row in rows:  # a tool and a prompt of the same name: the target says which (as `coffer enable` wants)
            if row["kind"] in ("tool", "prompt") and len(names[row["name"]]) > 1:
                row["target"] = f"{row['kind']}:{row['name']}"
            row["_text"] = f"{row['name']} {row['title']} {row['description']}".lower()
        listed = [{"name": server["name"], "enabled": server["enabled"]} for server in servers]
        with self.lock:
            self._catalogue = (signature, rows, listed)
        return rows, listed

    def catalogue(self, query: dict) -> dict:
        """One page of the catalogue: filtered by server, kind, state and words, with the counts for the sidebar."""
        rows, servers = self.catalogue_rows()
        server, kind = query.get("server") or None, query.get("kind") or None
        state, words = query.get("state") or None, (query.get("q") or "").lower().split()
        try:
            offset = max(0, int(query.get("offset") or 0))
            limit = max(1, min(CATALOGUE_PAGE_MAX, int(query.get("limit") or 100)))
        except ValueError:
            raise CofferError("offset and limit must be whole numbers") from None
        kinds = CATALOGUE_KINDS.get(kind) if kind else None
        counts: dict[str, dict[str, int]] = {s["name"]: {"total": 0} for s in servers}
        matched = []
        for row in rows:
            if kinds is not None and row["kind"] not in kinds:
                continue
            if words and not all(word in row["_text"] for word in words):
                continue
            tally = counts[row["server"]]
            tally["total"] += 1
            tally[row["state"]] = tally.get(row["state"], 0) + 1
            if (server is None or row["server"] == server) and (state is None or row["state"] == state):
                matched.append(row)
        return {"total": len(rows), "matched": len(matched), "offset": offset, "limit": limit,
                "rows": [{k: v for k, v in row.items() if not k.startswith("_")}
                         for row in matched[offset:offset + limit]],
                "servers": [{**s, "counts": counts[s["name"]]} for s in servers]}

    def capability(self, query: dict) -> dict:
        """One capability's whole definition as its server lists it now (what a row of the catalogue expands to),
        and when Coffer first and last saw it."""
        server, kind, name = query.get("server"), query.get("kind"), query.get("name")
        if not all(isinstance(v, str) and v for v in (server, kind, name)):
            raise CofferError("say which capability: server, kind and name")
        with self.lock:
            rows = self._rows("SELECT definition, first_seen, last_seen FROM capabilities WHERE server=? AND kind=?"
                              " AND name=?", (server, kind, name))
        if not rows:
            raise CofferError(f"{server} lists no {kind} {name!r}")
        definition = _loads(rows[0][0])
        return {"server": server, "kind": kind, "name": name, "first_seen": rows[0][1], "last_seen": rows[0][2],
                "definition": definition if isinstance(definition, dict) else {}}

    # -- servers -------------------------------------------------------------------------------------------
    def _live(self, name: str):
        hub = self.hub
        return hub.upstreams.get(name) or hub.per_client.get(name) or hub.dormant.get(name)

    def servers(self) -> dict:
        """Every registered server: its definition (secrets as references), live state, process, memory, sharing,
        the sessions using it, its capabilities' states, and its last error with the fix."""
        with self.lock:
            configs = self.vault.servers()
            stored = set(self.vault.secrets.names())
            settings = self.vault.settings()
        rows, _ = self.catalogue_rows()
        tally: dict[str, dict[str, int]] = {}
        for row in rows:
            counts = tally.setdefault(row["server"], {})
            key = f"{row['kind']}s" if row["kind"] != "template" else "resources"
            counts[key] = counts.get(key, 0) + (row["state"] != "gone")
            counts[row["state"]] = counts.get(row["state"], 0) + 1
        users = self._users()
        last_calls = self.activity.last_calls()
        result = []
        for config in configs:
            name = config["name"]
            upstream = self._live(name) if config["enabled"] else None
            transport = getattr(upstream, "transport", None)
            pid = transport.pid if isinstance(transport, StdioTransport) and upstream.state == "ready" else None
            if config.get("damaged"):
                state = "damaged"
            elif not config["enabled"]:
                state = "disabled"
            elif upstream is None:
                state = config.get("status") or "not started"
            elif getattr(upstream, "dormant", False):
                state = "stopped (idle)"
            elif getattr(upstream, "per_client", False):
                state = "per client"
            else:
                state = upstream.state
            error = (getattr(upstream, "last_error", None) or
                     (config.get("status_detail") if config.get("status") == "failed" else None))
            report = server_report(self.vault, self.vault.secrets, config, set(),
                                   lambda _s: (state != "failed", [], error or state), settings)
            problems = [p for p in report["problems"] if state == "failed" or "did not start" not in p["problem"]]
            if state == "failed" and not any(p["severity"] == "error" for p in problems):
                problems = error_fixes(name, error) + problems   # what the error itself points to
            result.append({
                "name": name, "transport": config["transport"], "command": _command_text(config),
                "enabled": config["enabled"], "state": state, "pid": pid, "rss_mb": rss_mb(pid),
                "sharing": config.get("sharing", "shared"), "sharing_reason": config.get("sharing_reason"),
                "policy": config.get("policy"), "updates": config.get("updates"),
                "sessions": users.get(name, 0), "instances": self._instances(name),
                "last_call": last_calls.get(name),
                "status_at": config.get("status_at"), "error": error, "problems": problems,
                "stderr": list(getattr(upstream, "stderr_tail", ()))[-5:] if state in ("failed", "backoff") else [],
                "env": {k: shown_value(k, v) for k, v in (config.get("env") or {}).items()},
                "headers": {k: shown_value(k, v) for k, v in (config.get("headers") or {}).items()},
                "secrets": sorted({ref for ref, _ in references(config)}),
                "secrets_missing": sorted({ref for ref, has_default in references(config)
                                           if not has_default and ref not in stored and ref not in os.environ}),
                "counts": tally.get(name, {}), "damaged": config.get("damaged")})
        return {"servers": result}

    def _users(self) -> dict[str, int]:
        """Sessions using each server: those that called its shared instance, or run an instance of their own."""
        users: dict[str, int] = {}
        sessions = self._sessions()
        for session in sessions:
            for name in session.instances.running:
                users[name] = users.get(name, 0) + 1
        for upstream in self.hub.upstreams.values():
            users[upstream.name] = sum(1 for s in sessions if s.calls.used(upstream))
        return users

    def _instances(self, name: str) -> list[dict]:
        """A per-client server's instances, one per session running it: their state, process and memory."""
        found = []
        for session in self._sessions():
            instance = session.instances.running.get(name)
            if instance is not None:
                transport = instance.transport
                pid = transport.pid if isinstance(transport, StdioTransport) and instance.state == "ready" else None
                found.append({"client": session.client_name, "state": instance.state, "pid": pid,
                              "rss_mb": rss_mb(pid)})
        return found

    def _sessions(self) -> list:
        with self.service.lock:
            return list(self.service.sessions)

    def overview(self) -> dict:
        """The header: the service, and the counts the navigation shows."""
        service = self.service
        with self.lock:
            pending = len(self.vault.pending_approvals())
            configs = self.vault.servers()
        failed = sum(1 for c in configs if c["enabled"] and getattr(self._live(c["name"]), "state", None) == "failed")
        return {"service": {"pid": os.getpid(), "version": __version__,
                            "uptime_s": round(time.time() - service.started, 1), "rss_mb": rss_mb(os.getpid()),
                            "home": service.home},
                "servers": len(configs), "failed": failed, "tools": len(self.hub.catalogue.tools),
                "changed": pending, "sessions": len(self._sessions())}

    # -- changed definitions -------------------------------------------------------------------------------
    def changes(self) -> dict:
        """Each definition held back since it changed upstream, with what changed (field by field and as the
        unified diff `coffer approve` prints) and the target that approves it."""
        with self.lock:
            pending = self.vault.pending_approvals()
            max_length = self.vault.setting("name_max_length")
            changed_at = {row["target"]: row["ts"] for row in
                          self.vault.audit_rows(5000, action="upstream-changed")}
        rows, _ = self.catalogue_rows()
        targets = {(row["server"], row["kind"], row["upstream"]): row["target"] for row in rows}
        items = []
        for row in pending:
            server, kind, upstream_name = row["server"], row["kind"], row["name"]
            label = (exposed_names(server, [upstream_name], max_length)[upstream_name]
                     if kind in ("tool", "prompt") else upstream_name)
            before, after = _loads(row["approved_definition"]), _loads(row["definition"])
            items.append({"server": server, "kind": kind, "name": label, "upstream": upstream_name,
                          "target": targets.get((server, kind, upstream_name), label),
                          "enabled": bool(row["enabled"]), "changed_at": changed_at.get(f"{server}:{upstream_name}"),
                          "first_seen": row["first_seen"], "changes": field_changes(before, after),
                          "diff": definition_diff(row["approved_definition"], row["definition"])})
        return {"changes": items}

    # -- actions: each one vault transaction, audited as actor "web" ----------------------------------------
    def _forget_catalogue(self) -> None:
        self._catalogue = None

    def set_enabled(self, target: str, enabled: bool) -> str:
        if not isinstance(target, str) or not target:
            raise CofferError("say what to enable or disable")
        with self.lock:
            try:
                what = self.vault.set_enabled(target, enabled)
            except NotListedYet as exc:
                raise CofferError(str(exc)) from None
            self._forget_catalogue()
        return f"{'enabled' if enabled else 'disabled'} {what}"

    def approve(self, target: str) -> dict:
        if not isinstance(target, str) or not target:
            raise CofferError("say what to approve")
        with self.lock:
            approved = self.vault.approve(target)
            self._forget_catalogue()
        if not approved:
            return {"message": f"{target}: nothing is waiting for approval", "approved": []}
        return {"message": f"approved {', '.join(label for label, _ in approved)}",
                "approved": [{"label": label, "diff": diff} for label, diff in approved]}

    def restart(self, name: str) -> str:
        """Start a server again from scratch: a fresh instance (its calls in flight fail), the catalogue keeping
        its tools listed meanwhile; a per-client server's instances stop and each client's next call starts its
        own; one stopped while idle starts now.  Audited (restart)."""
        hub = self.hub
        config = hub.configs.get(name)
        if config is None:
            with self.lock:
                server = self.vault.server(name)
            raise CofferError(f"{name} is disabled: enable it first" if not server["enabled"] else
                              f"{name} cannot start: {server.get('damaged') or 'it is not served'}")
        if name in hub.dormant:
            hub.wake(name)
            outcome = f"started {name}"
        elif name in hub.per_client:
            for session in list(hub.sessions):
                session.instances.drop(name)
            outcome = f"stopped every client's instance of {name}; each client's next call starts a new one"
        else:
            self._replace_upstream(name, config)
            outcome = f"restarting {name}"
        with self.lock:
            self.vault.audit("restart", name, "from the web page")
        return outcome

    def _replace_upstream(self, name: str, config: dict) -> None:
        self.hub.restart(name, config)

    # -- search --------------------------------------------------------------------------------------------
    def search(self, query: str, top_k, profile=None) -> dict:
        """coffer__search_tools' ranking for ``query``, as an agent gets it (an agent of ``profile``: that
        profile's tools, under the names its clients see), with the parts of every score."""
        if not isinstance(query, str) or not query.strip():
            raise CofferError("type what you want to do")
        try:
            top_k = bounded_top_k(int(top_k) if isinstance(top_k, str) and top_k.isdigit() else top_k)
        except ValueError as exc:
            raise CofferError(str(exc)) from None
        catalogue = self.hub.catalogue
        if profile:
            if not isinstance(profile, str) or profile not in self.hub.views.profiles:
                raise CofferError(f"there is no profile named {str(profile)[:80]!r}")
            catalogue = self.hub.views.catalogue(profile, catalogue)
        result = explain_preferred(catalogue.index, self.hub.semantic, query, top_k,
                                   active_preference(self.hub.settings, self.hub.vault.path))
        result["embedder"] = self.hub.semantic is not None
        result["profile"] = profile or None
        return result

    # -- knowledge -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _knowledge(self):
        """The service's knowledge base, or (none open yet: no source, memory off) one for this request only."""
        kb = self.hub.knowledge
        if kb is not None:
            yield kb
            return
        kb = KnowledgeBase(self.vault.path, self.vault.home)
        try:
            yield kb
        finally:
            kb.close()

    def knowledge(self) -> dict:
        """Every knowledge source: files, passages, vectors ready (with an embedder), last indexed, what the last
        indexing skipped; and whether memory and an embedder are on."""
        with self.lock:
            settings = self.vault.settings()
            has_sources = self.vault.has_knowledge_sources()
            stats = {row[0]: _loads(row[1]) for row in self._rows("SELECT name, last_stats FROM knowledge_sources")}
        embedder = Embedder.from_settings(settings)
        result = {"memory": settings.get("memory") == "on", "embedder": embedder.cache_key if embedder else None,
                  "sources": []}
        if not has_sources and self.hub.knowledge is None and not stats:
            return result
        with self._knowledge() as kb:
            sources = kb.sources()
        ready = self._vectors_ready(embedder.cache_key) if embedder else {}
        for source in sources:
            last = stats.get(source.name) if isinstance(stats.get(source.name), dict) else {}
            result["sources"].append({"name": source.name, "root": source.root, "globs": list(source.globs),
                                      "kind": source.kind, "files": source.files, "passages": source.passages,
                                      "indexed_at": source.indexed_at, "skipped": last.get("skipped") or {},
                                      "vectors": ready.get(source.name, 0) if embedder else None})
        return result

    def _vectors_ready(self, model: str) -> dict[str, int]:
        """source -> passages whose vector is in the embedding cache (what hybrid answers can use); recounted
        only when the passages or the cache change."""
        with self.lock:
            generation = self._rows("SELECT value FROM knowledge_meta WHERE key='generation'")
            cached = self._rows("SELECT count(*) FROM embeddings WHERE model=?", (model,))
            key = (model, generation[0][0] if generation else 0, cached[0][0] if cached else 0)
            if self._vectors is not None and self._vectors[0] == key:
                return self._vectors[1]
            hashes = {row[0] for row in self._rows("SELECT text_hash FROM embeddings WHERE model=?", (model,))}
            ready: dict[str, int] = {}
            for source, heading, text in self._rows("SELECT source, heading, text FROM knowledge_passages"):
                if text_hash(passage_embedding_text(heading, text)) in hashes:
                    ready[source] = ready.get(source, 0) + 1
            self._vectors = (key, ready)
            return ready

    def knowledge_add(self, path: str, name: str | None, globs) -> str:
        if not isinstance(path, str) or not path.strip():
            raise CofferError("give the path of a folder to add")
        if globs is not None and not (isinstance(globs, list) and all(isinstance(g, str) for g in globs)):
            raise CofferError("globs must be a list of patterns")
        with self._knowledge() as kb:
            stats = kb.add_source(path.strip(), name or None, [g for g in globs or [] if g.strip()] or None)
        with self.lock:
            self.vault.audit("knowledge-add", stats.source, os.path.abspath(os.path.expanduser(path.strip())))
        skipped = ", ".join(f"{n} {why}" for why, n in stats.skipped.items())
        return (f"added {stats.source}: {stats.passages_added} passages from {stats.files_seen} files"
                + (f" (skipped: {skipped})" if skipped else ""))

    def knowledge_remove(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise CofferError("say which source to remove")
        with self._knowledge() as kb:
            kb.remove_source(name)
        with self.lock:
            self.vault.audit("knowledge-remove", name)
        return f"removed knowledge source {name}"

    def knowledge_reindex(self, name: str | None) -> str:
        with self._knowledge() as kb:
            done = kb.reindex(name or None)
        return "; ".join(f"{s.source}: {s.files_added} added, {s.files_changed} changed, {s.files_removed} removed, "
                         f"{s.files_unchanged} unchanged" for s in done) or "nothing to reindex"

    # -- sessions ------------------------------------------------------------------------------------------
    def sessions(self) -> dict:
        """The connected clients (what `coffer status` lists, with the servers each has used) and the profiles."""
        found, sessions = [], self._sessions()
        for session in sessions:
            used = {up.name for up in self.hub.upstreams.values() if session.calls.used(up)}
            used |= set(session.instances.running)
            found.append({**session.status(), "servers": sorted(used),
                          "own_instances": sorted(session.instances.running)})
        return {"sessions": found, "profiles": profiles_view(self.hub, sessions)}
