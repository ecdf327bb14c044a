"""Gateway hub: what every client session shares (upstreams, catalogue, indexes, logs).

The hub owns the upstream pool, the merged catalogue and its search index, the semantic ranker, the knowledge
base and the invocation log; a ``ClientSession`` (gateway/session.py) owns one client's connection and protocol
state and reaches the shared part only through the hub.  ``coffer serve`` runs one hub and one session in one
process.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import threading
import time

from coffer_src.catalogue import Catalogue
from coffer_src.errors import CofferError
from coffer_src.gateway.builtins import CLIENT_SIDE_CAPABILITIES, knowledge_tools_for
from coffer_src.gateway.sharing import DormantServer, PerClientServer, Sharing, return_freed_memory
from coffer_src.gateway.view import Views
from coffer_src.invocations import InvocationLog
from coffer_src.jsonrpc import LATEST_PROTOCOL_VERSION, METHOD_NOT_FOUND, rpc_error
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.profiles import ProfileStore
from coffer_src.search.semantic import Embedder, SemanticRanker
from coffer_src.secret_store import resolution_digest
from coffer_src.terminal import ServerLog
from coffer_src.threads import WorkerPool, start_thread
from coffer_src.transport.stdio import StdioTransport, process_table
from coffer_src.upstream.supervisor import Upstream, record_upstream_status
from coffer_src.vault import CapabilityState, Vault, setting_key

hub_log = logging.getLogger(__name__)

#: What in a server's config makes a running upstream stale: a change to any of these restarts it.
RESTART_KEYS = ("transport", "command", "url", "env", "headers", "cwd", "timeout", "policy", "inherit_env", "oauth",
                "sharing")
#: What a shared upstream is told its client can do: everything a client may offer, since any session may call it;
#: a request it makes goes to the session whose call it serves, which answers or refuses for its own client.
SHARED_CLIENT_CAPABILITIES = {"sampling": {}, "elicitation": {}, "roots": {"listChanged": True}}


class Hub:
    """The upstreams, catalogue and indexes every client session of this process shares; the events of its
    upstreams come here (it implements upstream.supervisor.UpstreamEvents).

    Threads and what they own:
      - each upstream's reader delivers that upstream's events here (``on_ready``, ``on_down``, ``on_list_changed``
        and, for a session, ``on_notification`` and ``on_request``);
      - the ticker (``_tick``) expires timed-out requests, releases sessions' requests waiting for discovery,
        expires parked exchanges and applies vault edits;
      - the worker pool answers what waited (discovery, a search that may wait for its embedding, coffer__ask);
      - the invocation log writes on its own thread; the semantic ranker and the knowledge base run their own.
    Locks (the package docstring's Concurrency section has every lock of the program), never taken in the reverse
    order: ``_rebuild_lock`` (one catalogue build at a time; sessions are told of the change while it is held, so
    it may wait on a client stream's write) → the semantic ranker's lock, a session's ``lock``, a client stream's
    lock, and ``lock``.  A session's ``lock`` → ``lock`` (forgetting a progress token).  ``lock`` (the writers of
    ``upstreams``, ``per_client``, ``dormant``, ``sessions``, ``_catalogued`` and ``_progress``, and the rebuild
    counters) is a leaf.  ``vault_lock`` (the shared SQLite connection, and the writers of ``states``) → ``views.lock``
    (gateway/view.py: the profiles and overrides, reloaded under it), a leaf; ``vault_lock`` is held across the
    vault's writes, and the ticker takes it every second.  No Upstream's lock is taken under any of
    them.
    ``states``, ``upstreams``, ``sessions``, ``_catalogued`` and ``catalogue`` are replaced whole under their
    lock, never changed in place: a reader takes the current one with a plain attribute read and uses it without
    a lock, from any thread, whatever lock it already holds.
    """

    def __init__(self, vault: Vault, remember: bool = True, only=None, shared: bool = False):
        self.vault = vault
        self.shared = shared     # the user's service: sessions come and go; False: one client, in-process
        self.remember = remember
        self.only = set(only) if only else None  # serve just these servers (`coffer call` needs one)
        self.vault_lock = threading.Lock()
        self.lock = threading.RLock()
        self.settings = vault.settings()
        self.log = InvocationLog(vault.path)
        self.disabled_servers: set[str] = set()
        self.upstreams: dict[str, Upstream] = {}
        self.sharing = Sharing(self)
        self.per_client: dict[str, PerClientServer] = {}   # shared mode: servers each session runs its own of
        self.dormant: dict[str, DormantServer] = {}         # shared mode: servers stopped while unused
        self._progress: dict[str, object] = {}             # Coffer's progress token upstream -> its session
        self._progress_ids = itertools.count(1)
        self.configs: dict[str, dict] = {}
        self.remembered: dict[str, dict] = {}  # server -> kind -> {name: definition}, from the vault
        self.states = vault.capability_states()
        self.views = Views()   # profiles and overrides, and each profile's view of the catalogue (gateway/view.py)
        self.catalogue = Catalogue([], self.states, self.settings["name_max_length"])
        self._fingerprint = self.catalogue.fingerprint()
        self._rebuild_lock = threading.Lock()
        self._rebuilds_wanted = self._rebuilds_done = 0
        self._force_tools_notice = False
        self._catalogued: dict[str, float] = {}  # upstream name -> the ready_at whose lists the catalogue holds
        self.sessions: tuple = ()                # ClientSession, in the order they attached
        self.usage: dict[str, int] = {}          # calls per tool in the last 90 days, for budgeted lists
        self.workers = WorkerPool("coffer-work", 4)
        self.knowledge: KnowledgeBase | None = None    # opened once a source exists or memory is on
        self.knowledge_tools: list[dict] = []
        self._upstream_client: tuple[dict, dict | None, str] | None = None  # what upstreams are started with
        self._reported_missing = False
        self._trim_at: float | None = None  # shared mode: when the ticker returns freed memory (see below)
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._data_version = vault.data_version()
        self._config_generation = vault.config_generation()
        embedder = Embedder.from_settings(self.settings, vault.secrets)
        self.semantic = SemanticRanker(embedder, vault.path, float(self.settings["embedder_timeout"])) \
            if embedder else None

    # -- life ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Read what to serve from the vault and start the ticker (upstreams start with the first session)."""
        try:
            self.vault.prune()
        except CofferError as exc:  # a busy or read-only vault must not stop the session
            hub_log.warning("retention pruning skipped: %s", exc)
        self.configs = self._serving(self.vault.servers(), report=True)
        self.remembered = self.vault.remembered_lists() if self.remember else {}
        try:
            with self.vault_lock:
                self.views.load(ProfileStore(self.vault))
        except CofferError as exc:  # a profiled session then sees nothing until the next change is read
            hub_log.warning("profiles and overrides unavailable: %s", exc)
        self._update_knowledge()
        if self.shared:  # upstreams start with the service, not with a client: they are warm when one comes
            self._upstream_client = (SHARED_CLIENT_CAPABILITIES, None, LATEST_PROTOCOL_VERSION)
            self._load_usage()
            for config in self.configs.values():
                self._add_upstream(config)
            if any(up.remembered for up in self.upstreams.values()) or self.per_client:
                self.rebuild()
        start_thread(self._tick, "coffer-ticker")

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def attach(self, session) -> None:
        with self.lock:
            self.sessions = (*self.sessions, session)

    def detach(self, session) -> None:
        with self.lock:
            self.sessions = tuple(s for s in self.sessions if s is not session)

    def begin(self, session) -> None:
        """A session's first request: upstreams start now (they are told the client's capabilities and identity),
        the catalogue remembered from last time is listed at once, and the usage behind budgeted lists is read."""
        caps = {k: v for k, v in session.client_capabilities.items() if k in CLIENT_SIDE_CAPABILITIES}
        with self.lock:
            first = self._upstream_client is None
            if first:
                self._upstream_client = (caps, session.client_info or None, session.protocol_version)
        if not first:
            return
        self._load_usage()
        for config in self.configs.values():
            self._add_upstream(config)
        if any(up.remembered for up in self.upstreams.values()):
            self.rebuild()  # remembered tools are listable at once; before `initialized`, so no notification

    def _load_usage(self) -> None:
        try:
            with self.vault_lock:
                self.usage = self.vault.tool_usage()
        except CofferError as exc:
            hub_log.warning("tool usage unavailable (%s); a budgeted list falls back to catalogue order", exc)

    def shutdown(self) -> None:
        """Write the log, stop every upstream (and its descendants), the workers and the rankers' threads.  A
        second caller (the signal handler, the client-gone path) waits for the first to finish instead of cutting
        it short."""
        if self._stopping.is_set():
            self._stopped.wait(15.0)
            return
        self._stopping.set()
        try:
            # Rows first: a client that closes stdin usually kills its server a few seconds later.
            self.log.flush(3.0)
            threads = [start_thread(up.stop, f"coffer-{up.name}-stop") for up in self.upstreams.values()]
            for thread in threads:
                thread.join(6.0)
            self.workers.close()
            if self.semantic is not None:
                self.semantic.close()
            if self.knowledge is not None:
                self.knowledge.close()
            self.log.close()
        finally:
            self._stopped.set()

    # -- what is served ------------------------------------------------------------------------------------
    def _serving(self, servers: list[dict], report: bool = False) -> dict[str, dict]:
        """The configs this process runs: enabled, undamaged (and among --only); notes the disabled ones, so a
        call to their tools can say how to enable them."""
        configs = {}
        self.disabled_servers = {c["name"] for c in servers if not c["enabled"] and not c["damaged"]}
        for config in servers:
            if self.only is not None and config["name"] not in self.only:
                continue
            if config["damaged"]:
                if report:
                    hub_log.warning("server %s has a damaged definition in coffer.db (%s) and is not started; fix "
                                    "it with `coffer remove %s` and `coffer add` again", config["name"],
                                    config["damaged"], config["name"])
            elif config["enabled"]:
                configs[config["name"]] = config
        return configs

    def _update_knowledge(self) -> bool:
        """Open the knowledge base when a source exists or memory is on (its tools are listed only then);
        True when the tools a client is shown changed."""
        memory = self.settings["memory"] == "on"
        try:
            with self.vault_lock:
                has_sources = self.vault.has_knowledge_sources()
        except CofferError as exc:
            hub_log.warning("knowledge sources unavailable: %s", exc)
            has_sources = False
        if (has_sources or memory) and self.knowledge is None:
            try:
                self.knowledge = KnowledgeBase(self.vault.path, self.vault.home,
                                               embedder=Embedder.from_settings(self.settings, self.vault.secrets),
                                               query_timeout=float(self.settings["embedder_timeout"]))
                self.knowledge.start_watcher()
            except (sqlite3.Error, CofferError, OSError) as exc:
                hub_log.warning("knowledge and memory unavailable: %s", exc)
                self.knowledge = None
        if self.knowledge is not None:
            self.knowledge.memory_enabled = memory
        tools = knowledge_tools_for(has_sources, memory)
        changed = [t["name"] for t in tools] != [t["name"] for t in self.knowledge_tools]
        self.knowledge_tools = tools if self.knowledge is not None else []
        return changed

    def advertised_capabilities(self) -> dict:
        """The union of what the upstreams offered when they last started, every list with listChanged.

        Upstreams start only after a client's first request (they need its capabilities), so the union is taken
        from the vault; a server never seen yet could offer anything, so it counts as offering everything.
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

    def subscribed_elsewhere(self, session, upstream, uri: str) -> bool:
        """Whether a session other than ``session`` still wants resources/updated for ``uri`` of ``upstream``."""
        return any(other is not session and other.calls.subscribed(upstream, uri) for other in self.sessions)

    def failed_servers(self) -> tuple[list[str], list[str]]:
        """Servers that failed at their last start: (waiting for a login, failed otherwise)."""
        failed = [c["name"] for c in self.configs.values() if c.get("status") == "failed"]
        login = [name for name in failed if "needs login" in (self.configs[name].get("status_detail") or "")]
        return login, [name for name in failed if name not in login]

    def restart(self, name: str, config: dict) -> None:
        """Start a server afresh (`coffer` page's restart): the running instance leaves the pool and stops, a new
        one starts with its lists remembered (a client's list stays complete meanwhile)."""
        with self.lock:
            old = self.upstreams.get(name)
            if old is not None:
                self.upstreams = {key: up for key, up in self.upstreams.items() if key != name}
                lists = {kind: items for kind, items in old.lists.items() if kind in ("tool", "prompt") and items}
                self.remembered[name] = lists or old.remembered
        if old is not None:
            start_thread(old.stop, f"coffer-{name}-stop")
        self._add_upstream(config)
        self.rebuild()

    def _add_upstream(self, config: dict) -> None:
        caps, info, version = self._upstream_client or ({}, None, LATEST_PROTOCOL_VERSION)
        if self.shared and config.get("sharing") == "per-client":
            with self.lock:
                if config["name"] not in self.per_client:
                    placeholder = PerClientServer(config, self.remembered.pop(config["name"], {}))
                    self.per_client = {**self.per_client, config["name"]: placeholder}
            return
        with self.lock:  # a session's first request (client thread) and a vault reload (ticker) may both get here
            if config["name"] in self.upstreams:
                return
            upstream = Upstream(config, self.settings, self, caps, version, self.vault.secrets, info)
            upstream.remembered = self.remembered.pop(config["name"], {})  # only for its first start here
            self.upstreams = {**self.upstreams, config["name"]: upstream}
        upstream.start()

    # -- the ticker ----------------------------------------------------------------------------------------
    def _tick(self) -> None:
        last_reload = last_family = time.monotonic()
        while not self._stopping.wait(0.05):
            now = time.monotonic()
            for upstream in self.upstreams.values():
                try:
                    upstream.expire(now)
                except Exception:  # noqa: BLE001 - the ticker guards every timeout; it must not die
                    hub_log.exception("[%s] error while expiring requests", upstream.name)
            for session in self.sessions:
                try:
                    session.tick(now)
                except Exception:  # noqa: BLE001
                    hub_log.exception("error while answering waiting requests")
            if os.name == "posix" and now - last_family >= 5.0:
                last_family = now
                stdio = [up.transport for up in self.upstreams.values()
                         if isinstance(up.transport, StdioTransport) and up.state == "ready"]
                if stdio:
                    try:
                        table = process_table()
                        for transport in stdio:
                            transport.remember_family(table)
                    except Exception:  # noqa: BLE001 - bookkeeping for shutdown; never the ticker's death
                        hub_log.exception("could not read the process table")
            if self._trim_at is not None and now >= self._trim_at:
                self._trim_at = None
                return_freed_memory()
            if now - last_reload >= 1.0:
                last_reload = now
                try:
                    self.sharing.stop_idle()
                except Exception:  # noqa: BLE001 - the ticker also guards every timeout
                    hub_log.exception("could not stop an idle upstream")
                try:
                    self._reload_if_vault_changed()
                except Exception:  # noqa: BLE001 - the ticker also guards every timeout
                    hub_log.exception("could not apply vault changes")

    def _reload_if_vault_changed(self) -> None:
        """Apply `coffer enable/disable/approve/add/remove/config` made while this process runs."""
        with self.vault_lock:
            version = self.vault.data_version()
            if version == self._data_version:
                return
            self._data_version = version
            generation = self.vault.config_generation()
            unchanged = generation is not None and generation == self._config_generation
            self._config_generation = generation
        if unchanged:  # another connection committed to a log, the knowledge index or a cache
            if self._update_knowledge():  # a knowledge source added or removed (a cheap count)
                self._force_tools_notice = True
                self.rebuild()
            return
        with self.vault_lock:
            states = self.vault.capability_states()
            configs = self._serving(self.vault.servers())
            settings = self.vault.settings()
            views_changed = any(self.views.load(ProfileStore(self.vault)))  # profiles, overrides
            changed = states != self.states or views_changed
            self.states = states
        if self._update_knowledge():
            self._force_tools_notice = True
            changed = True
        if settings != self.settings:
            if any(settings.get(k) != self.settings.get(k) for k in set(settings) | set(self.settings)
                   if setting_key(k) == "expose"):
                self._force_tools_notice = True  # the same catalogue, listed differently
            self.settings.update(settings)  # the upstreams share this dict
            for upstream in self.upstreams.values():
                upstream.call_timeout = float(upstream.config.get("timeout") or settings["call_timeout"])
            changed = True
        if self._upstream_client is None:
            self.configs = configs
            return
        for name, upstream in self.upstreams.items():
            old, new = self.configs.get(name), configs.get(name)
            if new is None or any(old.get(k) != new.get(k) for k in RESTART_KEYS) or (
                    getattr(upstream, "resolved", None) not in (None, resolution_digest(new, self.vault.secrets))):
                with self.lock:
                    self.upstreams = {key: up for key, up in self.upstreams.items() if key != name}
                start_thread(upstream.stop, f"coffer-{name}-stop")
                changed = True
        for name, placeholder in self.per_client.items():
            old, new = self.configs.get(name), configs.get(name)
            if new is None or any(old.get(k) != new.get(k) for k in RESTART_KEYS):
                with self.lock:
                    self.per_client = {key: p for key, p in self.per_client.items() if key != name}
                for session in self.sessions:
                    session.instances.drop(name)
                changed = True
        for name, placeholder in self.dormant.items():
            old, new = self.configs.get(name), configs.get(name)
            if new is None or any(old.get(k) != new.get(k) for k in RESTART_KEYS):
                with self.lock:
                    self.dormant = {key: p for key, p in self.dormant.items() if key != name}
                changed = True
        self.configs = configs
        for name, config in configs.items():
            if name not in self.upstreams and name not in self.per_client and name not in self.dormant:
                self._add_upstream(config)
        if changed:
            self.rebuild()

    def wake(self, name: str) -> Upstream | None:
        return self.sharing.wake(name)

    def make_per_client(self, name: str, reason: str) -> None:
        self.sharing.make_per_client(name, reason)

    def _retired(self, upstream: Upstream) -> bool:
        return self.sharing.retired(upstream)

    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        try:
            with self.vault_lock:
                states = self.vault.sync_capabilities(upstream.name, kind, items, upstream.rejected.get(kind))
                self.states = {**self.states, **{(upstream.name, kind, name): state
                                                 for name, state in states.items()}}
        except CofferError as exc:
            ServerLog(hub_log, upstream.name).warning("could not record its %ss in the vault: %s", kind, exc)
            if upstream.config.get("policy") == "disabled":  # fail closed: unrecorded means not allowed
                with self.vault_lock:
                    self.states = {**{(upstream.name, kind, name): CapabilityState(False) for name in items},
                                   **self.states}
        if notify and not self._retired(upstream):
            self.rebuild()

    def on_ready(self, upstream: Upstream) -> None:
        if self._retired(upstream):
            return
        if getattr(upstream, "idle_since", None) is None:
            upstream.idle_since = time.time()  # see _stop_idle
        self._remember_transport(upstream)
        if upstream.era != upstream.config.get("era"):
            try:
                with self.vault_lock:
                    self.vault.record_era(upstream.name, upstream.era)
                upstream.config["era"] = upstream.era
            except CofferError as exc:
                ServerLog(hub_log, upstream.name).debug("could not remember its protocol era: %s", exc)
        self.record_status(upstream, "ready")
        for session in self.sessions:
            session.upstream_ready(upstream)
        try:
            self.rebuild(force=upstream.spawns > 1)
        finally:  # even a failed rebuild must not keep calls waiting for this upstream
            with self.lock:
                self._catalogued = {**self._catalogued, upstream.name: upstream.ready_at}
        for session in self.sessions:
            session.release_waiting()

    def _remember_transport(self, upstream: Upstream) -> None:
        """Transport auto found what the server speaks: write it down so the next start skips the probe.  The
        running config is updated too, so this process does not take the vault change for a new config."""
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
            except CofferError as exc:
                ServerLog(hub_log, upstream.name).warning("could not remember its transport: %s", exc)

    def on_down(self, upstream: Upstream) -> None:
        if self.per_client.get(upstream.name) is not None and self.upstreams.get(upstream.name) is not upstream:
            return  # a retired shared instance (see _retired) ending: its clients have their own
        for session in self.sessions:
            session.upstream_down(upstream)
        self.record_status(upstream, upstream.state)
        if upstream.state == "failed":
            self.rebuild()
        for session in self.sessions:
            session.release_waiting()

    def record_status(self, upstream: Upstream, status: str, detail: str | None = None) -> None:
        """What an upstream's start or end tells `coffer list`, `show` and the agent's instructions."""
        record_upstream_status(self.vault, self.vault_lock, upstream, status, detail)

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        """A notification an upstream may send (see RELAYED_NOTIFICATIONS) goes where it belongs: progress to the
        session whose call it reports on (by Coffer's own token), log messages and elicitation notices to the
        sessions with calls in flight to that upstream (when none has, every session, at its own level), the rest
        to every session, each relaying what concerns it."""
        method = message["method"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if method == "notifications/progress":
            session = self._progress.get(params.get("progressToken"))
            sessions = (session,) if session is not None else ()
        elif method in ("notifications/message", "notifications/elicitation/complete"):
            sessions = tuple(s for s in self.sessions if s.oldest_call_to(upstream) is not None) or self.sessions
        else:
            sessions = self.sessions
        for session in sessions:
            session.upstream_notification(upstream, message)

    def progress_token(self, session) -> str:
        """A progress token of Coffer's own for one call upstream: whichever session's call it is, its progress
        comes back to that session only (clients' own tokens may collide)."""
        token = f"coffer-progress-{next(self._progress_ids)}"
        with self.lock:
            self._progress = {**self._progress, token: session}
        return token

    def forget_progress(self, token) -> None:
        if token in self._progress:
            with self.lock:
                self._progress = {key: s for key, s in self._progress.items() if key != token}

    def on_request(self, upstream: Upstream, message: dict) -> None:
        """A server->client request (sampling, elicitation, roots) reaches the client whose call it serves.

        One client in-process: that client.  Shared: a server that asks the client anything depends on its client,
        so from now on it runs one instance per client (recorded, shown by `coffer show`); this request goes to
        the one session with calls in flight to it, and to none when there is no such call or more than one
        session has calls there (nothing on the wire says which call a request serves: guessing could hand one
        client's question to another)."""
        sessions = self.sessions
        calling = [s for s in sessions if s.oldest_call_to(upstream) is not None]
        if not self.shared:
            session = min(calling, key=lambda s: s.oldest_call_to(upstream)) if calling else \
                (sessions[0] if sessions else None)
        else:
            what = {"roots/list": "the client's roots", "sampling/createMessage": "the client's model (sampling)",
                    "elicitation/create": "the user (elicitation)"}.get(message["method"], message["method"])
            self.make_per_client(upstream.name, f"it asked {what}")
            session = calling[0] if len(calling) == 1 else None
        if session is None:
            upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "no client call of this server can take "
                                       "this request; Coffer runs this server once per client from now on"))
            return
        session.upstream_request(upstream, message)

    # -- the catalogue -------------------------------------------------------------------------------------
    def rebuild(self, force: bool = False) -> None:
        """Swap in a fresh catalogue (and search index); tell every session which lists changed.

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
            live = [up for up in self.upstreams.values() if up.state not in ("failed", "stopped")]
            live += [*self.per_client.values(), *self.dormant.values()]
            catalogue = Catalogue(live, self.states, self.settings["name_max_length"], self.views.global_overrides)
            old, new = self._fingerprint, catalogue.fingerprint()
            self.catalogue, self._fingerprint = catalogue, new
            if self.semantic is not None:
                self.semantic.refresh(catalogue.tools)
            changed = [key for key in ("tools", "prompts", "resources")
                       if old[key] != new[key] or (force and key == "tools")]
            for session in self.sessions:
                session.lists_changed(changed)
        self.return_memory_when_quiet()  # what the build and the listing it came from leave freed, once gone

    def return_memory_when_quiet(self) -> None:
        """Shared mode: have the ticker hand freed heap back to the operating system once half a second has
        passed without another call here.  A build, or an answer to a client (a first tools/list copies and
        encodes the whole catalogue), leaves memory freed that glibc would otherwise keep for hours; each call
        pushes the moment back, so a busy service trims in its pauses, not between requests.  Any thread; the
        ticker may miss a request that races its own trim, which then takes that memory along or leaves it to
        the next."""
        if self.shared:
            self._trim_at = time.monotonic() + 0.5

    def discovering(self, kind: str | None = None) -> list[str]:
        """Upstreams still starting; with ``kind`` (a list waiting), only those with no remembered list of that kind
        and that did not fail at their last start: a list never waits for a server that will most likely fail
        again (its tools are announced with list_changed if it comes up).  An upstream counts as started once its
        lists are in the catalogue (on_ready's rebuild), not when it turns ready: the ticker may release a
        waiting call in between, and it must find the upstream's tools."""
        catalogued = self._catalogued
        return [up.name for up in self.upstreams.values()
                if up.state not in ("failed", "stopped")
                and (not up.ready_at or catalogued.get(up.name) != up.ready_at)
                and not (kind and (kind in up.remembered or up.config.get("status") == "failed"))]

    def report_missing(self, missing: list[str]) -> None:
        """Say once per process which servers are still starting when a list stops waiting for them."""
        if missing and not self._reported_missing:
            self._reported_missing = True
            hub_log.warning("still starting after %gs: %s; their tools will be announced to the client when they "
                            "are up", self.settings["discovery_timeout"], ", ".join(missing))
