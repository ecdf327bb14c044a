"""Upstream supervisor: one server's connection and restarts; what others call on it."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Protocol

from coffer_src import __version__
from coffer_src.errors import CofferError
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
from coffer_src.terminal import ServerLog, printable, redact
from coffer_src.threads import backoff_delay, start_thread
from coffer_src.transport.remote import make_remote_transport
from coffer_src.transport.stdio import StdioTransport, Transport, UpstreamFailure
from coffer_src.upstream.definitions import (
    LIST_CHANGED,
    RELAYED_NOTIFICATIONS,
    SERVER_REQUEST_NEEDS,
    _clean_strings,
)
from coffer_src.upstream.listing import UpstreamLists
from coffer_src.upstream.requests import QueuedRequest, RequestTable
from coffer_src.vault import CAPABILITY_KINDS, Vault

supervisor_log = logging.getLogger(__name__)


class TokenBucket:
    """``rate`` events a second with bursts of ``burst``: how a flood from one upstream is cut to size without
    slowing anyone else.  Thread-safe (``_lock``, a leaf): a remote server's replies are handled on several HTTP
    worker threads at once, so its messages may be counted concurrently."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.dropped = 0
        self.reported = 0.0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
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
        with self._lock:
            now = time.monotonic()
            if not self.dropped or now - self.reported < every:
                return 0
            dropped, self.dropped, self.reported = self.dropped, 0, now
            return dropped


class Ticket:
    """What ``Upstream.request`` hands back for ``cancel``, ``hold`` and ``release``: the upstream's request id
    once the request is sent; before that (queued behind a server that is still starting) cancelling it means it
    is never sent.  Both fields are guarded by the Upstream's lock."""

    __slots__ = ("request_id", "cancelled")

    def __init__(self):
        self.request_id: int | None = None
        self.cancelled = False


class UpstreamEvents(Protocol):
    """What an Upstream tells its owner.  Each call comes from one of the upstream's own threads (see Upstream),
    never under its lock, and must not block for long: it may be the reader of the server's replies.

    Its implementers: the gateway's hub (gateway/hub.py: keeps the catalogue and the vault, passes each client
    session what concerns it) and gateway/instances.PrivateEvents (a client session's own instance of a server that
    runs once per client), probe.ServerProbe (starts servers for the CLI and records what they offer) and
    probe.GatewayClient (the CLI's connection to a `coffer serve` it runs as an upstream).  Status goes to the
    vault through record_upstream_status, whoever the owner is.
    """

    def on_ready(self, upstream: Upstream) -> None:
        """Started (or restarted) and discovered: era, capabilities, server_info and every list are set."""

    def on_down(self, upstream: Upstream) -> None:
        """Its connection ended, or it was marked failed: ``state`` is backoff (a restart follows) or failed, and
        ``last_error`` says why.  What it was asked and had not answered has failed already."""

    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        """One list was fetched: ``items`` {identifier: definition}.  ``notify`` is False during a start (on_ready
        follows) and True for a change while it runs."""

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        """A notification the client may be shown (definitions.RELAYED_NOTIFICATIONS), within the relay's rate."""

    def on_request(self, upstream: Upstream, message: dict) -> None:
        """A request for the client (sampling, elicitation, roots), within its rate: the owner answers it, now
        or later, with ``upstream.respond``."""


class Upstream:
    """One registered server: its connection and restarts (here), its requests (``requests``, a RequestTable)
    and its lists (``listing``, an UpstreamLists).  What it has to say goes to ``events`` (UpstreamEvents).

    States: idle → starting → ready; a crash goes to backoff and back to starting; too many consecutive failed
    starts (or one failure that retrying cannot fix) go to failed; stopped is final.  Requests that arrive while
    starting wait in a backlog, each with its own deadline.  The surface others use: ``start``, ``stop``,
    ``request``, ``cancel``, ``hold``, ``release``, ``call``, ``notify``, ``respond``, ``expire``; and to read,
    ``state``, ``era``, ``capabilities``, ``server_info``, ``lists``, ``rejected``, ``last_error``.

    Threads.  What the server says arrives on the transport's threads: ``_on_message`` (and so each reply's
    ``on_reply``), ``_on_unusable`` and ``_on_close`` run on the stdio reader, the SSE reader or, for Streamable
    HTTP, the worker that made the POST (several at once); ``_fail_request`` on an HTTP worker; ``_on_stderr`` on
    the stderr reader.  One thread per start attempt runs ``_start`` (discovery included); a timer thread starts
    the next attempt after a failure; list refreshes and the listen stream run as UpstreamLists says; the
    gateway's ticker calls ``expire``; any thread may call the rest.

    Locks.  ``lock`` (an RLock: ``request`` starts an idle server while holding it) guards ``state``,
    ``transport`` and ``generation`` (replaced together), ``_closed_generation``, ``failures``, ``spawns``,
    ``ready_at``, ``last_error`` (written), ``_timer``, every Ticket's fields, the request table and the lists'
    bookkeeping (UpstreamLists).  It is never held while calling out (``on_reply``, the events, a transport's
    start, send or close: those run on threads of their own or after it is released); the only lock taken inside
    it is the Redactor's (``redact``), a leaf.  Lock order: the gateway's lock may be held when taking it, never
    the reverse.  The other locks of this layer are leaves, each guarding its own object: TokenBucket's,
    StdioTransport's ``_send_lock`` and ``_close_lock``, HttpTransport's and SseTransport's ``_lock``,
    LoopbackReceiver's, and OAuthCredentials' ``_lock`` (held across a token refresh: it is taken by a
    transport's start, sends and close, never under this lock).

    Read without the lock, on purpose (one reference each, read whole under the GIL):
    - ``state``, ``generation``, ``transport``, ``last_error`` where a stale value is harmless: a message for a
      connection that just ended is refused by it and the request fails or waits for the restart; the checks that
      decide something (``_start``'s closed-generation check, the move to ready) are repeated under the lock.
    - ``era``, ``capabilities``, ``server_info``, ``resolved``: written only by the start thread (``resolved`` in
      ``_make_transport``, the rest in ``_open_session``) before the move to ready, which the lock publishes;
      client requests wait in the backlog until then.
    - ``spawns``, ``ready_at``, ``failures``: read by the owner in its events, and in log lines.
    - the request table's ``idle`` (the ticker's fast path): a request added meanwhile is seen on its next round.
    - ``call_timeout`` and ``settings`` (shared with the gateway, which updates them on a vault change),
      ``config`` (the gateway writes the detected era and transport back into it), ``stderr_tail`` (a deque: its
      append, clear and copy are atomic).
    """

    QUICK_DEATH = 10.0  # a server that dies this soon after becoming ready counts as a failed start
    RESTART_CEILING = 30.0  # the longest wait between two starts of a crash-looping server

    def __init__(self, config: dict, settings: dict, events: UpstreamEvents, client_capabilities=None,
                 protocol_version=None, secrets: SecretStore | None = None, client_info: dict | None = None):
        self.config = config
        self.name: str = config["name"]
        self.log = ServerLog(supervisor_log, self.name)
        self.settings = settings
        self.events = events
        self.secrets = secrets
        self.client_capabilities = client_capabilities or {}
        self.protocol_version = protocol_version or LATEST_PROTOCOL_VERSION
        self.call_timeout = float(config.get("timeout") or settings["call_timeout"])
        self.lock = threading.RLock()
        self.state = "idle"
        self.transport: Transport | None = None
        self.requests = RequestTable(self)
        self.listing = UpstreamLists(self)
        self.failures = 0
        self.spawns = 0
        self.ready_at = 0.0
        self.last_error: str | None = None
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.resolved: str | None = None  # what its ${NAME} references resolved to at the last start (digest)
        self.server_info: dict = {}
        self.capabilities: dict = {}
        self.generation = 0
        self._closed_generation = -1
        self._timer: threading.Timer | None = None
        # The era this server speaks: remembered from its last start (None: probe with server/discover).  A modern
        # (2026-07-28) server gets the client's own envelope on every request: its identity and capabilities.
        self.era: str | None = config.get("era")
        self.envelope = Envelope(MODERN_PROTOCOL_VERSIONS[-1], self.client_capabilities,
                                 client_info or {"name": "coffer", "version": __version__}, None)
        self._relayed = TokenBucket(rate=200.0, burst=1000.0)   # notifications relayed to the client
        self._stderr_relayed = TokenBucket(rate=50.0, burst=200.0)
        self._asked = TokenBucket(rate=5.0, burst=20.0)   # sampling/elicitation/roots requests for the client

    @property
    def lists(self) -> dict[str, dict]:
        """kind -> {identifier: definition}, in the server's order (see UpstreamLists)."""
        return self.listing.lists

    @property
    def rejected(self) -> dict[str, dict[str, str]]:
        """kind -> {identifier: why} of the last fetch."""
        return self.listing.rejected

    @property
    def remembered(self) -> dict[str, dict]:
        """kind -> what the vault held from the last start, listed until this one is ready (see Catalogue)."""
        return self.listing.remembered

    @remembered.setter
    def remembered(self, value: dict[str, dict]) -> None:
        self.listing.remembered = value

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
        generation = self.generation + 1  # what _start makes it next: only the start thread changes it
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
            self.log.warning("${%s} is set neither in Coffer's environment nor in its secret store; using an empty "
                             "value (coffer secret set %s)", name, name)
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
                self.listing.refresh(kind, notify=False)
            if self._closed_generation == self.generation:
                raise UpstreamFailure("the server exited during discovery")
            if self.era == "modern":
                self.listing.listen()
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
                backlog = self.requests.take_backlog()
        if died:
            self._start_failed(transport, UpstreamFailure("the server exited during discovery"))
            return
        if isinstance(transport, StdioTransport):
            transport.remember_family()
        self.events.on_ready(self)
        self.requests.run_backlog(backlog)

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

    def _start_failed(self, transport: Transport | None, exc: Exception) -> None:
        if not isinstance(exc, (UpstreamFailure, OSError, ValueError)):
            self.log.exception("internal error while starting")
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
        self.log.log(logging.WARNING if give_up else logging.INFO, "start failed%s: %s",
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
            backlog = self.requests.take_backlog() if give_up else []
            base = float(self.settings.get("restart_backoff", 0.5))
            return give_up, backoff_delay(self.failures - 1, base, self.RESTART_CEILING), backlog

    def _after_failure(self, give_up: bool, delay: float, backlog: list[QueuedRequest]) -> None:
        if give_up:
            self.log.info("marked failed")
            self.events.on_down(self)
            self.requests.run_backlog(backlog)
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
            orphaned = self.requests.take_all()
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
        self.log.warning("%s; %s", reason, "giving up, marked failed" if give_up else "restarting")
        self.events.on_down(self)
        if give_up:
            self.requests.run_backlog(backlog)
        else:
            self._schedule_start(delay if quick else 0.0)

    def stop(self) -> None:
        with self.lock:
            self.state = "stopped"
            if self._timer:
                self._timer.cancel()
            transport, orphaned = self.transport, self.requests.take_all()
            backlog = self.requests.take_backlog()
        for pending in orphaned:
            pending.on_reply(None, "error", f"upstream '{self.name}' is shutting down")
        self.requests.run_backlog(backlog)
        if transport is not None:
            transport.close()

    def _on_stderr(self, line: str) -> None:
        line = redact(line)
        self.stderr_tail.append(line[:500])
        if self._stderr_relayed.take():
            self.log.info("%s", line[:2000])
        elif dropped := self._stderr_relayed.report_due():
            self.log.warning("wrote too much on stderr; %d lines not shown", dropped)

    # -- requests (the RequestTable does the work) ------------------------------------------------------------
    def request(self, method: str, params, on_reply, timeout: float | None = None, ticket: Ticket | None = None,
                deadline: float | None = None, envelope: Envelope | None = None):
        """Send a request, or queue it while the server starts; ``on_reply(response, failure_status,
        failure_text)`` runs exactly once, unless the request is cancelled first.

        Returns a Ticket for ``cancel``, or None when the request failed at once (``on_reply`` has run).
        """
        return self.requests.submit(method, params, on_reply, self.call_timeout if timeout is None else timeout,
                                    ticket or Ticket(), deadline, envelope)

    def call_raw(self, method: str, params=None, timeout: float | None = None) -> dict:
        """Blocking request for Coffer's own use (initialize, discovery): the normalized reply, result or error;
        UpstreamFailure when none came (timeout, the connection ended)."""
        return self.requests.call_raw(method, params, self.call_timeout if timeout is None else timeout)

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
                self.log.warning("could not relay a message: %s", exc)

    def cancel(self, ticket: Ticket | None, reason: str = "cancelled by the client") -> bool:
        """Forget a request (a late reply is then dropped) and tell the upstream, with its own id; a request
        still queued is simply never sent.  False if it was already answered or cancelled (or never sent)."""
        return ticket is not None and self.requests.cancel(ticket, reason)

    def hold(self, ticket: Ticket | None) -> None:
        """Pause a request's timeout while the client is asked something for it (a person may be answering)."""
        if ticket is not None:
            self.requests.hold(ticket)

    def release(self, ticket: Ticket | None) -> None:
        """The client answered: the request's timeout runs again, from now."""
        if ticket is not None:
            self.requests.release(ticket)

    def expire(self, now: float) -> None:
        """Time out requests whose deadline passed (progress pushes a deadline back), queued ones included."""
        self.requests.expire(now)

    def _fail_request(self, request_id, text: str) -> None:
        """A remote transport could not get a request through or its answer back: the caller hears a failure of
        the connection (a tool call reads it as a tool error), not an error the server itself returned."""
        self.requests.fail(request_id, text if f"'{self.name}'" in text else f"upstream '{self.name}': {text}")

    # -- incoming ------------------------------------------------------------------------------------------
    def _on_message(self, message: dict) -> None:
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("%s -> coffer: %s", self.name, wire_text(message))
        method = message.get("method")
        if method is None:
            self.requests.answer(message)
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
                        self.log.warning("is flooding the client with requests; %d refused", dropped)
            else:
                self.respond(rpc_error(message["id"], METHOD_NOT_FOUND, f"Method not found: {method[:100]}"))
            return
        if method in LIST_CHANGED:
            for kind in LIST_CHANGED[method]:
                self.listing.refresh_soon(kind)
            return
        if method == "notifications/subscriptions/acknowledged":
            self.listing.listen_acknowledged()
            return
        if method == "notifications/cancelled" and self.era == "modern":
            params = message.get("params") if isinstance(message.get("params"), dict) else {}
            listen_id = self.listing.listen_id
            if listen_id is not None and params.get("requestId") == listen_id:
                self.requests.fail(listen_id, "the server ended the stream")  # our listen stream
            return
        if method not in RELAYED_NOTIFICATIONS:
            self.log.debug("dropped a notification the protocol does not define: %.100s", method)
            return
        if method == "notifications/progress":
            params = message.get("params")
            token = params.get("progressToken") if isinstance(params, dict) else None
            if not self.requests.progressed(token):
                return  # progress for a request this upstream was never given: not its to report
        if self._relayed.take():
            self.events.on_notification(self, message)
        elif dropped := self._relayed.report_due():
            self.log.warning("is flooding notifications; %d dropped", dropped)

    def _on_unusable(self, head: bytes, why: str) -> None:
        """A message Coffer could not use was skipped (``why``: too large, not JSON, nested too deeply): the one
        rule for all of them is that the request it answers, if its head names one, fails at once."""
        text = f"upstream '{self.name}' sent {why}"
        if self.requests.fail(request_id_in(head), text):
            self.log.warning("%s", text)
        elif "max_message_bytes" in why:
            self.log.warning("skipped %s", why)


def record_upstream_status(vault: Vault, vault_lock, upstream: Upstream, status: str, detail: str | None = None
                           ) -> None:
    """The one place an upstream's status reaches the vault (what `coffer list` and `show`, doctor and the agent's
    instructions report), for the gateway and the probes alike.  "ready" says who the server is and what it
    offers, and keeps its capabilities; any other status says ``detail``, else the upstream's last error.
    ``vault_lock`` is the lock the caller guards its vault connection with.  A vault that cannot be written costs
    a warning, never the caller: this runs on the upstream's threads, inside its events."""
    capabilities = None
    if status == "ready" and detail is None:
        info = upstream.server_info
        who = f"{info.get('name', '?')} {info.get('version', '')}".strip() + ": " if info else ""
        counts = ", ".join(f"{len(items)} {kind}s" for kind, items in upstream.lists.items() if items)
        detail, capabilities = who + (counts or "no capabilities"), upstream.capabilities
    try:
        with vault_lock:
            vault.record_status(upstream.name, status, (detail or upstream.last_error or "")[:2000], capabilities)
    except CofferError as exc:
        upstream.log.warning("could not record status: %s", exc)
