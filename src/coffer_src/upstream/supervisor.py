"""Upstream supervisor: one server's connection, requests, lists and restarts."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from coffer_src import __version__
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    LATEST_PROTOCOL_VERSION,
    METHOD_NOT_FOUND,
    EncodeError,
    request_id_in,
    rpc_error,
    rpc_result,
    valid_request_id,
    wire_log,
    wire_text,
)
from coffer_src.modern import (
    ENVELOPE_KEYS,
    META_SERVER_INFO,
    MODERN_PROTOCOL_VERSIONS,
    UNSUPPORTED_PROTOCOL_VERSION,
    DiscoverVerdict,
    Envelope,
    classify_discover_reply,
    stamp_envelope,
    strip_envelope,
)
from coffer_src.names import REMOTE_TRANSPORTS
from coffer_src.secret_store import SecretStore, expand_vars, resolution_digest, upstream_environment
from coffer_src.terminal import log, printable, redact
from coffer_src.threads import backoff_delay, start_thread
from coffer_src.transport.remote import make_remote_transport
from coffer_src.transport.stdio import StdioTransport, Transport, UpstreamFailure
from coffer_src.upstream.definitions import (
    _IDENTIFIER,
    LIST_CHANGED,
    RELAYED_NOTIFICATIONS,
    SERVER_REQUEST_NEEDS,
    Rejected,
    _clean_strings,
    check_definition,
    normalized_reply,
)
from coffer_src.vault import CAPABILITY_KINDS, storable


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
    RESTART_CEILING = 30.0  # the longest wait between two starts of a crash-looping server

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
        Restarts wait by the one backoff rule (threads.backoff_delay) from the hidden setting restart_backoff
        (tests shorten it), doubling to 30 s; max_restarts in a row, or at once if retrying cannot help, mark the
        server failed.  (None, 0, []) if the upstream was stopped meanwhile."""
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
            base = float(self.settings.get("restart_backoff", 0.5))
            return give_up, backoff_delay(self.failures - 1, base, self.RESTART_CEILING), backlog

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
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("coffer -> %s: %s", self.name, wire_text(message))
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
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("%s -> coffer: %s", self.name, wire_text(message))
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
