"""Gateway session: the MCP server a client talks to."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from coffer_src.catalogue import Catalogue, Route
from coffer_src.errors import CofferError
from coffer_src.gateway.builtins import (
    ASK_SAMPLING_BUDGET,
    ASK_TOOL_DEFINITION,
    CLIENT_SIDE_CAPABILITIES,
    INSTRUCTIONS,
    REMEMBER_TOOL_DEFINITION,
    SEARCH_TOOL_DEFINITION,
    Question,
    _require_str,
    budget_tools,
    client_family,
    expose_mode,
)
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LATEST_PROTOCOL_VERSION,
    LOG_LEVELS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    UPSTREAM_ERROR,
    EncodeError,
    OversizedLine,
    RpcError,
    decode_json,
    defer_to_burst_end,
    dumps,
    encode_line,
    handle_burst,
    negotiate_version,
    read_line_bursts,
    request_id_in,
    rpc_error,
    rpc_result,
    tool_error_result,
    valid_request_id,
    wire_log,
    wire_text,
)
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.modern import (
    INPUT_REQUIRED_METHODS,
    META_CLIENT_CAPABILITIES,
    META_LOG_LEVEL,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    MODERN_CLIENT_METHODS,
    MODERN_PROTOCOL_VERSIONS,
    UNSUPPORTED_PROTOCOL_VERSION,
    ListenFilter,
    RequestStateSealer,
    coffer_server_info,
    is_enveloped,
    listen_frame,
    missing_capability,
    modern_error,
    parse_envelope,
    parse_input_required,
    parse_listen_filter,
    shape_handshake_result,
    shape_modern_result,
)
from coffer_src.names import ASK_TOOL, REMEMBER_TOOL, RESERVED_SERVER, SEARCH_TOOL, SEPARATOR
from coffer_src.search.semantic import Embedder, SemanticRanker
from coffer_src.search.text import bounded_top_k
from coffer_src.secret_store import resolution_digest
from coffer_src.terminal import log, printable, redact
from coffer_src.threads import WorkerPool, start_thread
from coffer_src.transport.stdio import StdioTransport, process_table
from coffer_src.upstream.definitions import SERVER_REQUEST_NEEDS, normalized_reply
from coffer_src.upstream.supervisor import Ticket, Upstream
from coffer_src.vault import CapabilityState, InvocationLog, Vault, setting_key


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
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("coffer -> client: %s", wire_text(data))
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
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("client -> coffer: %s", wire_text(line))
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
