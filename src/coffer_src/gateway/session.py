"""Gateway session: the MCP server one client talks to, over one connection.

A ``ClientSession`` owns one client's connection (a ``ClientStream``), its protocol state (era, capabilities,
identity, logging level), the requests it is waiting on, and what the upstreams asked it; everything shared
(upstreams, catalogue, indexes, logs) is the hub's.  Its work is split by responsibility: the session reads,
dispatches and lists; ``CallRouter`` (gateway/routing.py) sends calls upstream and their answers back;
``EraBridge`` (gateway/bridge.py) bridges the two protocol eras; ``BuiltinTools`` (gateway/builtins.py) answers
Coffer's own tools.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time

from coffer_src.gateway.bridge import EraBridge
from coffer_src.gateway.builtins import (
    CLIENT_SIDE_CAPABILITIES,
    BuiltinTools,
    client_family,
    client_instructions,
    tools_for_client,
)
from coffer_src.gateway.calls import OwnRequest, RelayedRequest, Waiting
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.instances import SessionInstances
from coffer_src.gateway.pages import check_cursor, page_of
from coffer_src.gateway.routing import CallRouter
from coffer_src.gateway.view import SessionView
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LATEST_PROTOCOL_VERSION,
    LOG_LEVELS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    EncodeError,
    OversizedLine,
    RpcError,
    decode_json,
    defer_to_burst_end,
    encode_line,
    handle_burst,
    negotiate_version,
    read_line_bursts,
    request_id_in,
    request_ids_in_unreadable,
    rpc_error,
    rpc_result,
    valid_request_id,
    wire_log,
    wire_text,
)
from coffer_src.modern import (
    META_CLIENT_INFO,
    MODERN_CLIENT_METHODS,
    MODERN_PROTOCOL_VERSIONS,
    Envelope,
    coffer_server_info,
    is_enveloped,
    modern_error,
    parse_envelope,
    shape_handshake_result,
    shape_modern_result,
)
from coffer_src.settings import redacts_output
from coffer_src.terminal import redact
from coffer_src.threads import start_thread
from coffer_src.upstream.definitions import SERVER_REQUEST_NEEDS, normalized_reply
from coffer_src.upstream.supervisor import Upstream
from coffer_src.vault import iso_timestamp

session_log = logging.getLogger(__name__)


class ClientStream:
    """The client's end of a session: newline-delimited JSON-RPC written to ``out`` (stdout, or a socket).

    Replies to one burst of requests are held and written once at its end (jsonrpc.handle_burst), or as soon as
    they pass FLUSH_BYTES.  The write happens under ``out_lock``, the innermost lock: nothing else is taken while
    it is held.  A client that stops reading makes that write block, on purpose: back-pressure, so the thread
    delivering to this client (its reader, an upstream's reader, a worker; for a list_changed, the thread
    rebuilding the catalogue, which holds the hub's ``_rebuild_lock`` meanwhile) waits instead of piling replies
    up in memory.  A failed write means the client is gone: ``on_gone`` runs once, and later writes are dropped.
    """

    FLUSH_BYTES = 1 << 20

    def __init__(self, out, on_gone):
        self.out = out
        self.out_lock = threading.Lock()
        self._unsent: list[bytes] = []
        self._unsent_bytes = 0
        self._on_gone = on_gone
        self._gone = threading.Event()

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    def send(self, message: dict) -> None:
        """Queue one message for the client (written at the end of the current burst, or now).  Never raises: a
        reply that cannot be encoded is replaced by an error reply to the same id."""
        try:
            data = encode_line(message)
        except EncodeError as exc:
            msg_id = message.get("id")
            if "method" in message or not valid_request_id(msg_id):
                session_log.warning("dropped a message to the client that cannot be encoded: %s", exc)
                return
            session_log.warning("a reply could not be encoded (%s); the client gets an error instead", exc)
            data = encode_line(rpc_error(msg_id, INTERNAL_ERROR, "Internal error: the reply is not encodable JSON"))
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("coffer -> client: %s", wire_text(data))
        with self.out_lock:
            self._unsent.append(data)
            self._unsent_bytes += len(data)
            full = self._unsent_bytes > self.FLUSH_BYTES  # a burst's replies are held, but not without bound
        if full or not defer_to_burst_end(self, self.flush):
            self.flush()

    def flush(self) -> None:
        with self.out_lock:
            if not self._unsent:
                return  # another thread's write took it along
            data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
            self._unsent.clear()
            self._unsent_bytes = 0
            if self._gone.is_set():
                return
            try:
                self.out.write(data)
                self.out.flush()
                return
            except (OSError, ValueError):
                self._gone.set()
        self._on_gone()


class ClientSession:
    """One client session: reads the client, answers what Coffer knows, routes the rest through the hub.

    Threads: the client's reader (``serve``) dispatches each message; the hub's upstream readers deliver their
    upstreams' answers, notifications and requests to it; the hub's ticker calls ``tick``; the hub's workers
    answer what waited.  ``lock`` (an RLock) guards this session's state: what it waits on (``_waiting``), what it
    relayed (``client_requests``, ``own_requests``) and its router's and bridge's records.  It may be taken under
    the hub's ``_rebuild_lock`` (a list change for a listen stream) and an HTTP client's ``dispatching``; the one
    lock taken under it is the hub's ``lock`` (forgetting a progress token); it is never held while sending to
    the client or calling an upstream (see Hub).
    """

    MAX_BATCH = 10_000     # messages in one JSON-RPC batch line (each costs ~100x its bytes once parsed)

    def __init__(self, hub: Hub, out=None, on_client_gone=None, stream=None, profile: str | None = None):
        """``out``: where the client's bytes go (stdout, a socket); or ``stream``: an object with ClientStream's
        surface (send(message), flush(), gone) that takes the messages themselves, such as an HTTP transport
        that answers each request on its own response.  ``profile``: the profile whose part of the catalogue
        this client sees (None: all of it)."""
        self.hub = hub
        self.view = SessionView(hub, profile)
        self.stream = stream if stream is not None else \
            ClientStream(out if out is not None else sys.stdout.buffer, self._lost_client)
        self.on_client_gone = on_client_gone
        self.lock = threading.RLock()
        self.initialized = False
        self.client_era: str | None = None    # "handshake" (initialize) or "modern" (2026-07-28), set by request 1
        self.client_capabilities: dict = {}
        self.client_info: dict = {}
        self.client_name = "unknown"
        self.protocol_version = LATEST_PROTOCOL_VERSION
        self.log_level = None
        self.advertised: dict = {}
        self.discovery_deadline = 0.0
        self._waiting: list[Waiting] = []
        self.client_requests: dict[str, RelayedRequest] = {}   # by the id Coffer gave the relayed request
        self.own_requests: dict[str, OwnRequest] = {}         # Coffer's own requests to the client
        self._ids = itertools.count(1)
        self.since = time.time()
        self.instances = SessionInstances(self)  # shared mode: its own instances of per-client servers
        self.calls = CallRouter(self)
        self.bridge = EraBridge(self)
        self.tools = BuiltinTools(self)
        self.handlers = {
            "initialize": self._initialize, "ping": lambda _id, _p: {},
            "tools/list": self._tools_list, "tools/call": self.calls.tools_call,
            "prompts/list": self._prompts_list, "prompts/get": self.calls.prompts_get,
            "resources/list": self._resources_list, "resources/templates/list": self._templates_list,
            "resources/read": self.calls.resources_read,
            "resources/subscribe": self.calls.subscription("resources/subscribe"),
            "resources/unsubscribe": self.calls.subscription("resources/unsubscribe"),
            "completion/complete": self.calls.complete,
            "logging/setLevel": self._set_level,
        }
        self.modern_handlers = {method: self.handlers[method] for method in MODERN_CLIENT_METHODS
                                if method in self.handlers}
        self.modern_handlers.update({"server/discover": self._discover, "subscriptions/listen": self.bridge.listen})
        hub.attach(self)

    @property
    def catalogue(self):
        """What this client sees and may call: the hub's catalogue, or its profile's view of it (gateway/view.py)."""
        return self.view.catalogue

    def use_profile(self, name: str | None) -> None:
        """See the catalogue through profile ``name`` from now on (None: all of it); a client already listing is
        told which lists changed.  (An HTTP endpoint may pick the profile after the session is made.)"""
        old, self.view = self.view, SessionView(self.hub, name)
        if self.initialized:
            before, after = old.catalogue.fingerprint(), self.view.catalogue.fingerprint()
            self.lists_changed([key for key in ("tools", "prompts", "resources") if before[key] != after[key]])

    def new_id(self, prefix: str) -> str:
        """An id Coffer gives something of this session's: a relayed request, a question, an exchange."""
        return f"{prefix}{next(self._ids)}"

    # -- the client stream ---------------------------------------------------------------------------------
    def send(self, message: dict, verbatim: bool = False) -> None:
        """Queue one message for the client, in its era's error shape, with every known secret value redacted --
        unless ``verbatim``: it comes from a server whose output the user chose to pass unredacted (redact.<server>
        off: a password manager's job is to return secrets)."""
        if self.client_era == "modern" and "error" in message:
            message = modern_error(message)
        if not verbatim:
            message = redact.scrub(message)
        self.stream.send(message)
        self.hub.return_memory_when_quiet()

    def _lost_client(self) -> None:
        """The client closed its end (EPIPE): nobody can read an answer any more, so stop working for it."""
        session_log.info("the client closed its end of the connection; stopping its calls")
        self.calls.cancel_all("the client went away")
        if self.on_client_gone is not None:
            start_thread(self.on_client_gone, "coffer-client-gone")

    def serve(self, stream) -> None:
        """Read the client until EOF.  Every line gets an answer or is a notification; nothing ends the session
        but the client closing its input (or a signal).  A line over max_message_bytes is answered with an error
        and skipped as it arrives, never held."""
        read = getattr(stream, "read1", None) or getattr(stream, "recv", None) or stream.read
        try:
            for lines in read_line_bursts(read, max_line=int(self.hub.settings["max_message_bytes"])):
                if self.stream.gone:
                    break
                handle_burst(lines, self.handle_line)
                del lines  # not kept while the next read waits (see read_line_bursts)
        finally:
            self.close()

    def close(self) -> None:
        """The client is gone: its calls are cancelled upstream, its own server instances stopped, and the hub
        forgets it (in-process, the hub itself stops next)."""
        self.hub.detach(self)
        self.calls.cancel_all("the client went away")
        self.instances.stop_all()

    def handle_line(self, line) -> None:
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("client -> coffer: %s", wire_text(line))
        if isinstance(line, OversizedLine):
            limit = int(self.hub.settings["max_message_bytes"])
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
            # Each request inside gets its answer under its own id (a client waits for that id, never for null).
            for msg_id in request_ids_in_unreadable(line) or [None]:
                self.send(rpc_error(msg_id, PARSE_ERROR, f"Parse error: {exc}"[:200]))
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
        self.answer(msg_id, method, lambda: handler(msg_id, params))

    def answer(self, msg_id, method: str, work) -> None:
        """Run ``work`` and send its result; errors become JSON-RPC errors.  None means "answered later"."""
        try:
            result = work()
        except RpcError as exc:
            self.send(rpc_error(msg_id, exc.code, exc.message, exc.data))
            return
        except Exception:  # noqa: BLE001 - a Coffer bug must cost one request, not the session
            session_log.exception("internal error in %s", method)
            self.send(rpc_error(msg_id, INTERNAL_ERROR, f"Internal error in {method}"))
            return
        if result is not None:
            self.respond(msg_id, method, result)

    def respond(self, msg_id, method: str, result: dict, wrapped: bool = False, verbatim: bool = False) -> None:
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
        self.send(rpc_result(msg_id, result), verbatim)

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
        self._begin(capabilities or {}, info)
        return {"protocolVersion": self.protocol_version, "capabilities": self.advertised,
                "serverInfo": coffer_server_info(), "instructions": self.instructions()}

    def _begin(self, capabilities: dict, client_info: dict) -> None:
        """What the client's first request starts, in either era: the hub's upstreams (they need the client's
        capabilities and identity) and the catalogue remembered from last time."""
        self.client_capabilities = capabilities
        self.client_info = client_info
        self.client_name = str(client_info.get("name") or "unknown")[:64]
        self.hub.vault.secrets.values()  # every stored value is known to the redactor before anything is sent
        self.discovery_deadline = time.monotonic() + float(self.hub.settings["discovery_timeout"])
        self.hub.begin(self)
        self.initialized = True
        self.advertised = self.hub.advertised_capabilities()
        for placeholder in list(self.hub.per_client.values()):
            if not placeholder.remembered:  # never seen: this client's own instance lists what it offers
                self.instance_of(placeholder)

    def instance_of(self, upstream):
        """The upstream a call of this session goes to (see SessionInstances.instance_of)."""
        return self.instances.instance_of(upstream)

    def upstream_named(self, name: str):
        return self.instances.named(name)

    def discovering(self, kind: str | None = None) -> list[str]:
        """Servers this session still waits for: the hub's starting upstreams, and its own instances of
        per-client servers until what they list is in the catalogue."""
        return self.hub.discovering(kind) + self.instances.starting(kind)

    def envelope_for(self, call) -> Envelope:
        """What a 2026-07-28 upstream is told of the client behind one request: a 2026-07-28 client's own envelope
        on that request; for a handshake-era client, what its initialize declared and its logging level."""
        if self.client_era == "modern":
            meta = call.client_params.get("_meta")
            meta = meta if isinstance(meta, dict) else {}
            info = meta.get(META_CLIENT_INFO)
            return Envelope(MODERN_PROTOCOL_VERSIONS[-1], call.capabilities, info if isinstance(info, dict) else None,
                            call.log_level)
        caps = {k: v for k, v in self.client_capabilities.items() if k in CLIENT_SIDE_CAPABILITIES}
        return Envelope(MODERN_PROTOCOL_VERSIONS[-1], caps, self.client_info or None, self.log_level)

    def instructions(self) -> str:
        """What the client's model reads about Coffer: how to find tools, what is unlisted, failing or waiting."""
        login, failed = self.hub.failed_servers()
        return client_instructions(self.view.note(), len(self.catalogue.tools), len(self.listed_tools()),
                                   int(self.hub.settings["list_page_size"]), self.view.knowledge_tools, login,
                                   failed)

    def _dispatch_modern(self, msg_id, method: str, params: dict) -> None:
        """One request of a 2026-07-28 client: the envelope checked in the spec's order, the session started by
        the first request, then the same handlers as the handshake era; results get their 2026 shape in send."""
        if method == "initialize":  # removed in 2026-07-28: "method not found", as for any method it lacks
            self.send(rpc_error(msg_id, METHOD_NOT_FOUND, "Method not found: initialize (this connection serves the "
                                "2026-07-28 protocol, which has no initialize handshake)"))
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
            self._begin(envelope.client_capabilities, envelope.client_info or {})
        self.answer(msg_id, method, lambda: handler(msg_id, params))

    def _discover(self, msg_id, params):
        return {"supportedVersions": list(MODERN_PROTOCOL_VERSIONS), "capabilities": self.advertised,
                "instructions": self.instructions()}

    def tick(self, now: float) -> None:
        """The hub's ticker: hand over requests whose wait is over, forget questions nobody answered."""
        self.release_waiting()
        self.bridge.expire(now)

    # -- lists ---------------------------------------------------------------------------------------------
    def lists_changed(self, keys: list[str]) -> None:
        """The hub swapped in a catalogue whose ``keys`` lists differ: tell the client, if it can hear of them
        (with a profile, of the lists its view changed: see SessionView.changed)."""
        keys = self.view.changed(keys)
        if not self.initialized:
            return
        for key in keys:
            if key in self.advertised:
                self.announce(f"notifications/{key}/list_changed", key)

    def announce(self, method: str, key: str, params: dict | None = None, uri: str | None = None) -> None:
        """A change notification in the client's era: bare for a handshake-era client; for a 2026-07-28 client one
        frame per listen stream that asked for it (never a bare one)."""
        if self.client_era != "modern":
            self.send({"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})})
            return
        self.bridge.announce(method, key, params, uri)

    def after_discovery(self, msg_id, work, background: bool = False, kind: str | None = None,
                        method: str = "tools/call") -> None:
        """Run ``work`` once every upstream has been discovered (or, for ``kind``, is remembered from its last
        start) or the discovery budget is spent.

        Answers at once when nothing is pending; otherwise the request waits in a list, costing no thread, and is
        answered by the worker pool when its upstreams are up or the deadline passes (``release_waiting``), so
        the client's other requests are never held up behind a slow server.  ``background`` work (a search that
        may take a while) always goes to the pool, off the client's reader thread.
        """
        if not self.discovering(kind) or time.monotonic() >= self.discovery_deadline:
            if not background:
                return work()
            self.hub.workers.submit(self.answer, msg_id, method, work, owner=self)
            return None
        with self.lock:
            self._waiting.append(Waiting(msg_id, work, kind, method))
        return None

    def wait_for_server(self, waiting: Waiting) -> None:
        """Park a request that names a server still starting until it is up (bounded by ``waiting.deadline``)."""
        with self.lock:
            self._waiting.append(waiting)

    def release_waiting(self) -> None:
        """Hand the waiting requests whose wait is over to the worker pool (from the ticker and upstream events)."""
        if not self._waiting:  # read without the lock: a request appended just now is seen by the next tick
            return
        now = time.monotonic()
        expired = now >= self.discovery_deadline
        discovering = self.discovering
        with self.lock:
            done, still = [], []
            for waiting in self._waiting:
                if waiting.server is not None:
                    over = now >= waiting.deadline or waiting.server not in discovering()
                else:
                    over = expired or not discovering(waiting.kind)
                (done if over else still).append(waiting)
            self._waiting = still
        if not done:
            return
        if expired:
            self.hub.report_missing(discovering())
        for waiting in done:
            self.hub.workers.submit(self.answer, waiting.msg_id, waiting.method, waiting.work, owner=self)

    def listed_tools(self) -> list[dict]:
        """The tools this client is shown (see expose_mode, and its profile's pins); the rest stay callable and
        searchable."""
        catalogue = self.catalogue
        tools = catalogue.tools if self.client_era == "modern" else catalogue.handshake_tools
        return tools_for_client(tools, self.view.knowledge_tools,
                                self.view.expose_mode(client_family(self.client_name)), self.hub.usage,
                                self.view.pinned)

    def _paged(self, msg_id, params, key: str, items, method: str, kind: str | None = None):
        """A list request: answered (after discovery) with the page its cursor points at (gateway/pages.py)."""
        position = check_cursor(key, params.get("cursor"))  # a bad cursor is refused at once, not after a wait
        return self.after_discovery(msg_id, lambda: page_of(key, items(), position,
                                                            int(self.hub.settings["list_page_size"])),
                                    kind=kind, method=method)

    def _tools_list(self, msg_id, params):
        return self._paged(msg_id, params, "tools", self.listed_tools, "tools/list", "tool")

    def _prompts_list(self, msg_id, params):
        return self._paged(msg_id, params, "prompts", lambda: self.catalogue.prompts, "prompts/list", "prompt")

    def _resources_list(self, msg_id, params):
        return self._paged(msg_id, params, "resources", lambda: self.catalogue.resources, "resources/list",
                           "resource")

    def _templates_list(self, msg_id, params):
        return self._paged(msg_id, params, "resourceTemplates", lambda: self.catalogue.templates,
                           "resources/templates/list", "template")

    # -- the client's logging level --------------------------------------------------------------------------
    def _set_level(self, msg_id, params):
        level = params.get("level")
        if level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, f"'level' must be one of {', '.join(LOG_LEVELS)}")
        self.log_level = level
        for upstream in list(self.hub.upstreams.values()):
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

    # -- what upstreams tell this session (the hub passes them on) -------------------------------------------
    def status(self) -> dict:
        """This session as `coffer status` shows it."""
        version = self.client_info.get("version")
        return {"client": self.client_name, "version": version if isinstance(version, str) else None,
                "era": self.client_era, "since": iso_timestamp(self.since), "calls": self.calls.calls_made,
                "profile": self.view.name}

    def upstream_ready(self, upstream: Upstream) -> None:
        """An upstream (re)started: give it this client's logging level and, after a restart, its subscriptions."""
        if self.log_level and "logging" in upstream.capabilities:
            self._level_for(upstream, self.log_level)
        if upstream.spawns > 1:
            self.calls.resubscribe(upstream)

    def upstream_down(self, upstream: Upstream) -> None:
        """What the dead process asked of the client can no longer be answered: withdraw it."""
        with self.lock:
            stale = [cid for cid, relayed in self.client_requests.items() if relayed.upstream is upstream]
            for cid in stale:
                del self.client_requests[cid]
        for cid in stale:
            self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": cid, "reason": f"upstream '{upstream.name}' went away"}})

    def oldest_call_to(self, upstream: Upstream) -> float | None:
        """When this session's oldest call in flight to ``upstream`` started (None: it has none)."""
        return self.calls.oldest_to(upstream)

    def upstream_notification(self, upstream: Upstream, message: dict) -> None:
        """Relay one of the notifications an upstream may send (see RELAYED_NOTIFICATIONS), as the client asked:
        log messages at or above its logging level, resource updates only for what it subscribed to; nothing of a
        server its profile leaves out."""
        if not self.initialized or not self.view.sees_server(upstream.name):
            return
        method = message["method"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if method == "notifications/progress":
            params = self.bridge.progress_for_client(params)
            if params is None:
                return
        if method == "notifications/message":
            level = params.get("level")
            floor = self.log_level
            if self.client_era == "modern":  # only requests that asked for logs (logLevel) may get them
                floor = self.calls.log_floor(upstream)
                if floor is None:
                    return
            if level not in LOG_LEVELS or (floor and LOG_LEVELS.index(level) < LOG_LEVELS.index(floor)):
                return
            logger = params.get("logger")
            params = {**params, "logger": f"{upstream.name}/{logger}"[:200] if isinstance(logger, str) and logger
                      else upstream.name}
        elif method == "notifications/resources/updated":
            uri = params.get("uri")
            if not (isinstance(uri, str) and self.calls.subscribed(upstream, uri)):
                return
            exposed = self.hub.catalogue.exposed_uri(upstream.name, uri)
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
        self.send({"jsonrpc": "2.0", "method": method, "params": params},
                  not redacts_output(self.hub.settings, upstream.name))

    def upstream_request(self, upstream: Upstream, message: dict) -> None:
        """A server->client request (sampling, elicitation, roots): relay it under an id of Coffer's own to a
        handshake-era client; park it as an input_required round for a 2026-07-28 client."""
        if self.client_era == "modern":
            self.bridge.park(upstream, message)
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
                ours = self.new_id("coffer-")
                self.client_requests[ours] = RelayedRequest(upstream, upstream.generation, message["id"])
        if crowded:  # a server asking faster than a person can answer: it waits, nothing piles up here
            upstream.respond(rpc_error(message["id"], INTERNAL_ERROR, "too many requests are waiting for the "
                                                                      "client's answer"))
            return
        relayed = {"jsonrpc": "2.0", "id": ours, "method": message["method"]}
        if isinstance(params, dict):
            relayed["params"] = params
        self.send(relayed, not redacts_output(self.hub.settings, upstream.name))

    # -- what the client sends that is not a request ----------------------------------------------------------
    def request_client_async(self, method: str, params: dict, callback=None) -> tuple[str, OwnRequest]:
        """Coffer's own request to the client; ``callback(reply)`` runs on the client reader thread when the
        normalized reply arrives.  Returns the id used and the record the reply lands in."""
        with self.lock:
            ours = self.new_id("coffer-own-")
            own = self.own_requests[ours] = OwnRequest(callback)
        self.send({"jsonrpc": "2.0", "id": ours, "method": method, "params": params})
        return ours, own

    def request_client(self, method: str, params: dict, timeout: float):
        """Coffer's own request to the client (sampling for coffer__ask), waited for on the calling worker
        thread; the result object, or None on an error, a refusal or ``timeout``."""
        if self.client_era == "modern":
            return None  # a 2026-07-28 client takes no requests: coffer__ask answers with passages only
        ours, own = self.request_client_async(method, params)
        if not own.done.wait(timeout):
            with self.lock:
                self.own_requests.pop(ours, None)
            self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": ours, "reason": "coffer__ask ran out of time"}})
            return None
        return own.reply.get("result")

    def _client_response(self, message: dict) -> None:
        with self.lock:
            own = self.own_requests.pop(message["id"], None)
            relayed = self.client_requests.pop(message["id"], None) if own is None else None
        if own is not None:
            own.reply = normalized_reply(message)
            own.done.set()
            if own.callback is not None:
                own.callback(own.reply)
            return
        if relayed is not None and relayed.upstream.generation == relayed.generation:
            # (a restarted server never asked this; its answer is dropped)
            answer = normalized_reply(message)
            answer["id"] = relayed.upstream_id
            relayed.upstream.respond(answer)

    def _client_notification(self, method: str, params: dict) -> None:
        if method == "notifications/cancelled":
            request_id = params.get("requestId")
            if not valid_request_id(request_id):
                return
            self.bridge.end_listen(request_id)
            reason = params.get("reason")
            self.calls.cancel(request_id, reason[:200] if isinstance(reason, str) and reason
                              else "cancelled by the client")
        elif method == "notifications/roots/list_changed":
            for upstream in list(self.hub.upstreams.values()):
                if upstream.state == "ready":
                    upstream.notify(method)
