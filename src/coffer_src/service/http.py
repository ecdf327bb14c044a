"""Service HTTP: the Streamable HTTP endpoint /mcp, both eras, for clients with tokens.

`coffer service start --http 127.0.0.1:PORT` (or the service_http setting) makes the service also answer
Streamable HTTP.  Every request needs ``Authorization: Bearer <token>`` of a client named with `coffer token add`;
``Host`` must name this endpoint and ``Origin``, when present, must be its own or one the user allowed (no DNS
rebinding, no page of another site); no CORS headers unless the user allowed an origin.

Each HTTP client session is a ``ClientSession`` of the service's hub, named by its token, so everything a stdio
client gets (shared upstreams, the catalogue, search, sharing modes) an HTTP client gets too:

- handshake era (2025-11-25 and earlier): ``initialize`` opens a session whose ``Mcp-Session-Id`` every later
  request carries; it ends with DELETE, or after http_session_idle seconds unused, or when its token is removed.
  A request's answer (and what the upstream sends while serving it: sampling, elicitation, roots, progress)
  goes on that POST's response, as JSON or as an SSE stream; the rest on the session's GET stream.
- 2026-07-28: every request is self-contained; its headers must mirror its body (MCP-Protocol-Version, Mcp-Method,
  Mcp-Name, Mcp-Param-*).  The requests of one token share one session (so an input_required round resumes where
  it was asked); closing a response stream cancels its request; subscriptions/listen is a response stream.

Coffer gives every request an id of its own before the session sees it (and every progress token a token of its
own), so two HTTP clients, or one reusing ids, can never receive each other's answers.
"""

from __future__ import annotations

import collections
import ipaddress
import itertools
import logging
import os
import secrets
import socket
import threading
import time

from coffer_src.errors import CofferError
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LOG_LEVELS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    PROTOCOL_VERSIONS,
    EncodeError,
    RpcError,
    decode_json,
    encode_line,
    rpc_error,
    rpc_result,
    valid_request_id,
    wire_log,
    wire_text,
)
from coffer_src.modern import (
    HANDSHAKE_ONLY_METHODS,
    META_CLIENT_CAPABILITIES,
    META_LOG_LEVEL,
    META_PROTOCOL_VERSION,
    META_SUBSCRIPTION_ID,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    MODERN_PROTOCOL_VERSIONS,
    UNSUPPORTED_PROTOCOL_VERSION,
    is_enveloped,
    parse_envelope,
)
from coffer_src.names import SEPARATOR
from coffer_src.service.http_wire import (
    SSE_KEEPALIVE,
    ClientGone,
    HostRule,
    HttpConnection,
    HttpProblem,
    HttpRequest,
    decode_header_value,
    header_value_ok,
    parameter_header_problem,
    sse_event,
)
from coffer_src.service.tokens import TokenHolder, TokenStore
from coffer_src.settings import HTTP_ADDRESS_RE
from coffer_src.threads import start_thread

http_log = logging.getLogger(__name__)

MAX_HTTP_CONNECTIONS = 64
MAX_HTTP_SESSIONS = 64
#: Bytes of messages an HTTP response may hold unsent (a client that stops reading loses that response).
MAX_UNSENT_BYTES = 64 << 20
#: Messages kept for a handshake-era session's GET stream while it has none open.
MAX_BACKLOG = 256
#: Seconds between keep-alive comments on a quiet SSE stream (a response waiting long commits to SSE for them).
KEEPALIVE_SECONDS = 15.0
#: Seconds between checks that a waiting client is still there.
POLL_SECONDS = 0.5
HEADER_MISMATCH = -32020
#: The HTTP status of a 2026-07-28 error answered as JSON (Streamable HTTP 2026-07-28, "Request Metadata").
ERROR_STATUS = {PARSE_ERROR: 400, INVALID_REQUEST: 400, INVALID_PARAMS: 400, HEADER_MISMATCH: 400,
                MISSING_REQUIRED_CLIENT_CAPABILITY: 400, UNSUPPORTED_PROTOCOL_VERSION: 400, METHOD_NOT_FOUND: 404}
NAME_PARAMS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
ROUTING_HEADERS = ("mcp-protocol-version", "mcp-method", "mcp-name")
SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache, no-transform"),
               ("X-Accel-Buffering", "no")]
JSON_HEADERS = [("Content-Type", "application/json")]


def parse_http_address(text: str) -> tuple[str, int]:
    """(host, port) of ``--http``: HOST:PORT, [IPv6]:PORT, or a bare PORT (loopback).  Port 0 picks a free one."""
    text = str(text).strip()
    if text.isdigit():
        text = f"127.0.0.1:{text}"
    match = HTTP_ADDRESS_RE.match(text)
    if not match or int(match.group(2)) > 65535:
        raise CofferError(f"bad HTTP address {text!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    return match.group(1).strip("[]"), int(match.group(2))


def _client_id_key(msg_id) -> str:
    return f"{type(msg_id).__name__}:{msg_id}"


def _http_error(status: int, message: str, msg_id=None, code: int = INVALID_REQUEST, data=None) -> HttpProblem:
    """A refusal answered with a JSON-RPC error for the request's id."""
    return HttpProblem(status, message, code=code, msg_id=msg_id, data=data)


class NamedSession(ClientSession):
    """A ClientSession named by the token its client presented: that name, not what the client says of itself,
    is the client in the invocation log, `coffer status` and client-aware listing."""

    def __init__(self, hub: Hub, stream, name: str):
        self._token_name = name
        super().__init__(hub, stream=stream)

    @property
    def client_name(self) -> str:
        return self._token_name

    @client_name.setter
    def client_name(self, value) -> None:
        pass  # the token names the client; clientInfo.name stays in client_info


class Exchange:
    """What one HTTP response carries: the answers to one POST's requests and what relates to them, a listen
    stream (2026-07-28), or a session's GET stream (handshake era).  Its fields are guarded by its client's lock
    (``cond`` wraps that lock); the connection thread that owns the response drains ``items``."""

    def __init__(self, client: HttpClient, kind: str, sse: bool, json: bool):
        self.client = client
        self.kind = kind                 # "post", "listen" or "get"
        self.cond = threading.Condition(client.lock)
        self.sse, self.json = sse, json
        self.items: collections.deque[tuple[bytes, bool]] = collections.deque()   # (message, is an answer)
        self.unsent = 0
        self.ids: dict[str, object] = {}      # Coffer's id -> the client's, for the requests still unanswered
        self.tokens: dict[str, object] = {}   # Coffer's progress token -> the client's
        self.expected = 0                     # answers this response waits for
        self.answered = 0
        self.closed = False                   # nothing more goes here (the client left, or the session ended)
        self.overflowed = False
        self.started = time.monotonic()
        self.server: str | None = None        # the upstream a tools/call or prompts/get names (its log lines)
        self.log_level: str | None = None     # the logLevel a 2026-07-28 request asked for

    def push(self, data: bytes, answer: bool) -> None:
        """Queue a message for the response (caller holds the client's lock)."""
        if self.closed:
            return
        if self.unsent + len(data) > MAX_UNSENT_BYTES:
            self.closed = self.overflowed = True
        else:
            self.items.append((data, answer))
            self.unsent += len(data)
            if answer:
                self.answered += 1
        self.cond.notify_all()

    def wants_log(self, server: str, level: str) -> bool:
        return (self.sse and self.log_level is not None and self.server == server and level in LOG_LEVELS
                and LOG_LEVELS.index(level) >= LOG_LEVELS.index(self.log_level))


class HttpClient:
    """One HTTP client session and where each message its ClientSession sends goes.  It is that session's
    stream (``send``, ``flush``, ``gone``): ``send`` runs on whichever thread delivers (the connection's, an
    upstream reader, a worker) and never blocks on the client.

    ``lock`` guards the routing records and every Exchange of this client; it is innermost (taken after the
    session's and the hub's locks, and nothing is called while it is held but Exchange.push)."""

    def __init__(self, endpoint: HttpEndpoint, holder: TokenHolder, era: str, session_id: str | None = None):
        self.endpoint = endpoint
        self.holder = holder
        self.era = era                   # "handshake" (Mcp-Session-Id) or "modern" (one per token)
        self.session_id = session_id
        self.lock = threading.Lock()
        self.exchanges: dict[str, Exchange] = {}   # by the id Coffer gave a request
        self.client_ids: dict[str, str] = {}       # handshake era: the client's id -> Coffer's (cancellations)
        self.progress: dict[str, Exchange] = {}    # by the progress token Coffer gave a request
        self.get_stream: Exchange | None = None
        self.backlog: collections.deque[bytes] = collections.deque()
        self.ended = False
        self.last_used = time.monotonic()
        self._ids = itertools.count(1)
        self.session = NamedSession(endpoint.hub, self, holder.name)

    # -- the session's stream -------------------------------------------------------------------------------------
    @property
    def gone(self) -> bool:
        return self.ended

    def flush(self) -> None:
        pass

    def send(self, message: dict) -> None:
        """Route one message of the session to the response it belongs to (dropped when it belongs nowhere: the
        client that would read it has gone)."""
        with self.lock:
            target = self._route(message)
        if target is None:
            return
        exchange, message, answer = target
        try:
            data = encode_line(message)
        except EncodeError as exc:
            if not answer:
                http_log.warning("dropped a message to an HTTP client that cannot be encoded: %s", exc)
                return
            http_log.warning("a reply could not be encoded (%s); the client gets an error instead", exc)
            data = encode_line(rpc_error(message.get("id"), INTERNAL_ERROR, "Internal error: the reply is not "
                                                                               "encodable JSON"))
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("coffer -> http client %s: %s", self.holder.name, wire_text(data))
        with self.lock:
            if exchange is None or exchange.kind == "get":  # the GET stream open now, else its backlog
                exchange = self.get_stream
                if exchange is None:
                    self.backlog.append(data)
                    while len(self.backlog) > MAX_BACKLOG:
                        self.backlog.popleft()
                    return
            exchange.push(data, answer)

    def _route(self, message: dict):
        """(exchange, the message as the client must see it, whether it is an answer), or None to drop it;
        exchange None: the GET stream (or its backlog).  Caller holds the lock."""
        if "method" not in message:
            internal = message.get("id")
            exchange = self.exchanges.pop(internal, None) if isinstance(internal, str) else None
            if exchange is None:
                return None
            original = exchange.ids.pop(internal)
            self.client_ids.pop(_client_id_key(original), None)
            return exchange, {**message, "id": original}, True
        method = message["method"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if method == "notifications/progress":
            token = params.get("progressToken")
            exchange = self.progress.get(token) if isinstance(token, str) else None
            if exchange is None or not exchange.sse:
                return None
            return exchange, {**message, "params": {**params, "progressToken": exchange.tokens[token]}}, False
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        subscription = meta.get(META_SUBSCRIPTION_ID)
        if subscription is not None:
            exchange = self.exchanges.get(subscription) if isinstance(subscription, str) else None
            if exchange is None or exchange.kind != "listen":
                return None
            meta = {**meta, META_SUBSCRIPTION_ID: exchange.ids.get(subscription)}
            return exchange, {**message, "params": {**params, "_meta": meta}}, False
        if self.era == "modern":
            if method != "notifications/message":
                return None  # a 2026-07-28 client hears nothing that no request of its asked for
            logger = params.get("logger")
            server = logger.partition("/")[0] if isinstance(logger, str) else None
            exchange = self._oldest(lambda e: e.wants_log(server, params.get("level")))
            return (exchange, message, False) if exchange is not None else None
        if "id" in message or method == "notifications/cancelled":  # about a call: its response stream first
            exchange = self._oldest(lambda e: e.kind == "post" and e.sse) or self.get_stream
        elif method == "notifications/message":
            exchange = self.get_stream or self._oldest(lambda e: e.kind == "post" and e.sse)
        else:
            exchange = self.get_stream
        return exchange, message, False

    def _oldest(self, wanted) -> Exchange | None:
        open_ = {id(e): e for e in self.exchanges.values() if not e.closed and wanted(e)}
        return min(open_.values(), key=lambda e: e.started) if open_ else None

    # -- a POST --------------------------------------------------------------------------------------------------
    def post(self, conn: HttpConnection, request: HttpRequest, messages: list[dict], batch: bool,
             headers: list[tuple[str, str]], opening: bool = False) -> bool:
        """Hand a POST's messages to the session and answer it: 202 for notifications and responses, else the
        answers (JSON, or an SSE stream once something else must go first or the wait is long).  With
        ``opening`` (an initialize without a session), True when the session was established."""
        sse, json_ok = request.accepts("text/event-stream"), request.accepts("application/json")
        requests = [m for m in messages if "method" in m and "id" in m]
        listen = self.era == "modern" and messages[0].get("method") == "subscriptions/listen"
        with self.lock:
            if self.ended:
                raise HttpProblem(404, "Session not found")
            self.last_used = time.monotonic()
            exchange = Exchange(self, "listen" if listen else "post", sse, json_ok) if requests else None
            rewritten = [self._adopt(message, exchange) for message in messages]
        for message in rewritten:
            if wire_log.isEnabledFor(logging.DEBUG):
                wire_log.debug("http client %s -> coffer: %s", self.holder.name, wire_text(message))
            self.session.dispatch(message)
        if exchange is None:
            conn.send_response(202, headers)
            return False
        established = False
        if opening:
            with self.lock:
                first = exchange.items[0][0] if exchange.items else b""
            try:
                established = "result" in decode_json(first)
            except ValueError:
                established = False
            if established and not self.endpoint.register(self):
                self.end()
                raise HttpProblem(503, f"Service Unavailable: {MAX_HTTP_SESSIONS} HTTP sessions are open; end one "
                                       "(DELETE) or wait for an idle one to expire")
            if established:
                headers = [*headers, ("Mcp-Session-Id", self.session_id)]
        try:
            self.respond(conn, exchange, headers, batch)
        finally:
            if opening and not established:
                self.end()
        return established

    def _adopt(self, message: dict, exchange: Exchange | None) -> dict:
        """A client message as the session sees it: a request under an id (and progress token) of Coffer's own;
        a handshake-era cancellation naming that id.  Caller holds the lock."""
        if "method" in message and "id" in message and exchange is not None:
            internal = f"http-{next(self._ids)}"
            exchange.ids[internal] = message["id"]
            exchange.expected += 1
            self.exchanges[internal] = exchange
            if self.era == "handshake":
                self.client_ids[_client_id_key(message["id"])] = internal
            params = message.get("params")
            if isinstance(params, dict):
                meta = params.get("_meta")
                if isinstance(meta, dict) and valid_request_id(meta.get("progressToken")):
                    token = f"http-progress-{next(self._ids)}"
                    exchange.tokens[token] = meta["progressToken"]
                    self.progress[token] = exchange
                    params = {**params, "_meta": {**meta, "progressToken": token}}
                name = params.get("name")
                if message["method"] in ("tools/call", "prompts/get") and isinstance(name, str):
                    exchange.server = name.partition(SEPARATOR)[0]
                level = meta.get(META_LOG_LEVEL) if isinstance(meta, dict) else None
                exchange.log_level = level if level in LOG_LEVELS else exchange.log_level
                message = {**message, "params": params}
            return {**message, "id": internal}
        if message.get("method") == "notifications/cancelled" and isinstance(message.get("params"), dict):
            internal = self.client_ids.get(_client_id_key(message["params"].get("requestId")))
            if internal is not None:
                return {**message, "params": {**message["params"], "requestId": internal}}
        return message

    def respond(self, conn: HttpConnection, exchange: Exchange, headers: list[tuple[str, str]],
                batch: bool = False) -> None:
        """Write what the exchange carries until it is complete, the client leaves or the session ends: one JSON
        answer (or a batch's array) when nothing else needs to go first, else an SSE stream."""
        streaming = exchange.kind == "get"
        if streaming:
            conn.start_stream(200, [*headers, *SSE_HEADERS])
        held: list[bytes] = []
        last_write = time.monotonic()
        try:
            while True:
                with exchange.cond:
                    if not exchange.items and not exchange.closed:
                        exchange.cond.wait(POLL_SECONDS)
                    items = list(exchange.items)
                    exchange.items.clear()
                    exchange.unsent = 0
                    complete = exchange.kind != "get" and exchange.answered >= exchange.expected
                    closed = exchange.closed
                for data, answer in items:
                    if not streaming and answer and exchange.json:
                        held.append(data)
                        continue
                    if not answer and not exchange.sse:
                        continue  # a client that takes JSON only hears the answers alone
                    if not streaming:
                        streaming = True
                        conn.start_stream(200, [*headers, *SSE_HEADERS])
                        for answered in held:
                            conn.send_chunk(sse_event(answered))
                        held = []
                    conn.send_chunk(sse_event(data))
                    last_write = time.monotonic()
                if complete:
                    self._finish(conn, exchange, headers, held, batch, streaming)
                    return
                if closed:
                    self._cut(conn, exchange, headers, streaming)
                    return
                if items:
                    continue
                if conn.peer_closed():
                    raise ClientGone("the client closed its end")
                if exchange.sse and time.monotonic() - last_write >= KEEPALIVE_SECONDS:
                    if not streaming:
                        streaming = True
                        conn.start_stream(200, [*headers, *SSE_HEADERS])
                        for answered in held:
                            conn.send_chunk(sse_event(answered))
                        held = []
                    conn.send_chunk(SSE_KEEPALIVE)
                    last_write = time.monotonic()
        except ClientGone:
            self.left(exchange)
            conn.keep_alive = False
            raise

    def _finish(self, conn, exchange: Exchange, headers, held: list[bytes], batch: bool, streaming: bool) -> None:
        with self.lock:
            self._close(exchange)
        if streaming:
            conn.end_stream()
            return
        if batch:
            body = b"[" + b",".join(data.rstrip(b"\n") for data in held) + b"]"
            conn.send_response(200, [*headers, *JSON_HEADERS], body)
            return
        body = held[0].rstrip(b"\n") if held else b""
        status = 200
        if self.era == "modern" and body[:200].find(b'"error"') >= 0:
            try:
                status = ERROR_STATUS.get(decode_json(body)["error"]["code"], 200)
            except (ValueError, KeyError, TypeError):
                status = 200
        conn.send_response(status, [*headers, *JSON_HEADERS], body)

    def _cut(self, conn, exchange: Exchange, headers, streaming: bool) -> None:
        """The exchange ended before it was complete: the session ended, or the client stopped reading."""
        if exchange.overflowed:
            http_log.warning("an HTTP client (%s) left %d MB of answers unread: its response is cut",
                             self.holder.name, MAX_UNSENT_BYTES >> 20)
            self.left(exchange)
            conn.keep_alive = False
        if streaming:
            if exchange.kind == "listen" and not exchange.overflowed:
                for original in exchange.ids.values():  # a graceful end, as the spec asks of the server
                    conn.send_chunk(sse_event(encode_line(rpc_result(original, {
                        "resultType": "complete", "_meta": {META_SUBSCRIPTION_ID: original}}))))
            conn.end_stream()
            return
        pending = list(exchange.ids.values())
        body = encode_line(rpc_error(pending[0] if len(pending) == 1 else None, INVALID_REQUEST,
                                     "the session ended before this request was answered")).rstrip(b"\n")
        conn.send_response(404, [*headers, *JSON_HEADERS], body)

    def left(self, exchange: Exchange) -> None:
        """The client closed a response before it was complete.  2026-07-28: that cancels its requests (and a
        listen stream ends); the handshake era cancels nothing (the spec says so), its answers are dropped."""
        with self.lock:
            pending = list(exchange.ids)
            self._close(exchange)
        if self.era == "modern":
            for internal in pending:
                self.session.dispatch({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                       "params": {"requestId": internal,
                                                  "reason": "the client closed the response stream"}})

    def _close(self, exchange: Exchange) -> None:
        """Forget an exchange (caller holds the lock)."""
        exchange.closed = True
        for internal in exchange.ids:
            self.exchanges.pop(internal, None)
        for original in exchange.ids.values():
            self.client_ids.pop(_client_id_key(original), None)
        for token in exchange.tokens:
            self.progress.pop(token, None)
        if self.get_stream is exchange:
            self.get_stream = None
        exchange.cond.notify_all()

    # -- the GET stream (handshake era) ---------------------------------------------------------------------------
    def stream(self, conn: HttpConnection, headers: list[tuple[str, str]]) -> None:
        """The session's stream for what relates to no request of the client's (list changes, resource
        updates, and questions asked while no request of its is open).  A new GET replaces an older one."""
        with self.lock:
            if self.ended:
                raise HttpProblem(404, "Session not found")
            if self.get_stream is not None:
                self._close(self.get_stream)
            exchange = self.get_stream = Exchange(self, "get", True, False)
            for data in self.backlog:
                exchange.push(data, False)
            self.backlog.clear()
            self.last_used = time.monotonic()
        self.respond(conn, exchange, headers)

    # -- life -------------------------------------------------------------------------------------------------
    def busy(self) -> bool:
        with self.lock:
            return bool(self.exchanges) or self.get_stream is not None

    def end(self) -> None:
        """The session is over (DELETE, idle, its token removed, the service stopping): every open response
        ends, and the ClientSession closes (its calls are cancelled upstream)."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            exchanges = {id(e): e for e in self.exchanges.values()}
            if self.get_stream is not None:
                exchanges[id(self.get_stream)] = self.get_stream
            for exchange in exchanges.values():
                self._close(exchange)
        self.session.close()

    def status(self) -> dict:
        return {**self.session.status(), "transport": "http"}


class HttpEndpoint:
    """The listener, its connections and the HTTP client sessions.

    Threads: ``_accept`` takes connections (at most MAX_HTTP_CONNECTIONS at once, each served by a thread of its
    own that reads its requests and writes their responses); ``_housekeeping`` ends idle sessions and those
    whose token was removed.  ``lock`` guards ``sessions``, ``modern`` and ``connections``; it may be taken
    before a client's lock, never after it.
    """

    def __init__(self, service, address: str):
        self.service = service
        self.hub: Hub = service.hub
        self.home = service.home
        self.host, self.port = parse_http_address(address)
        self.tokens = TokenStore(self.home)
        self.lock = threading.Lock()
        self.sessions: dict[str, HttpClient] = {}     # handshake era, by Mcp-Session-Id
        self.modern: dict[str, HttpClient] = {}       # 2026-07-28, by token digest
        self.connections = 0
        self.listener: socket.socket | None = None
        self.stopping = threading.Event()
        self.rule: HostRule | None = None
        self.loopback = True
        self._schemas: tuple = (None, {})

    # -- life -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Listen; a loud warning when the address is reachable from other machines."""
        family, kind, proto, _, sockaddr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        if os.name == "posix":  # a successor (a handover) binds while old connections linger in TIME_WAIT
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(sockaddr)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self.listener = listener
        bound = listener.getsockname()
        self.port = bound[1]
        try:
            self.loopback = ipaddress.ip_address(bound[0]).is_loopback
        except ValueError:
            self.loopback = False
        origins = str(self.hub.settings.get("service_http_origins") or "").split()
        self.rule = HostRule(self.host, self.port, origins)
        if self.loopback:
            http_log.info("serving Streamable HTTP at %s (this machine only; bearer tokens required)", self.url)
        else:
            http_log.warning("SERVING STREAMABLE HTTP AT %s, REACHABLE FROM OTHER MACHINES: anyone who can reach "
                             "this address and holds a token (coffer token list) can use every tool Coffer serves; "
                             "the traffic is not encrypted", self.url)
        if origins:
            http_log.warning("browser pages of %s may call the HTTP endpoint (CORS)", ", ".join(origins))
        start_thread(self._accept, "coffer-http-accept")
        start_thread(self._housekeeping, "coffer-http-housekeeping")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/mcp"

    def describe(self) -> dict:
        return {"url": self.url, "loopback": self.loopback}

    def close_listener(self) -> None:
        """Stop taking connections (a handover: the successor binds the address); open ones finish."""
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.close()
            except OSError:
                pass

    def close(self) -> None:
        self.stopping.set()
        self.close_listener()
        with self.lock:
            clients = [*self.sessions.values(), *self.modern.values()]
            self.sessions, self.modern = {}, {}
        for client in clients:
            client.end()
        self.tokens.close()

    def busy(self) -> bool:
        """Listening keeps the service up: an HTTP client may come at any time, and cannot start it."""
        return self.listener is not None

    def clients(self) -> list[ClientSession]:
        with self.lock:
            return [client.session for client in [*self.sessions.values(), *self.modern.values()]]

    def statuses(self) -> list[dict]:
        with self.lock:
            clients = [*self.sessions.values(), *self.modern.values()]
        return [client.status() for client in clients if client.session.initialized]

    def register(self, client: HttpClient) -> bool:
        """A handshake-era session that initialized: findable by its id from now on (False: the limit)."""
        with self.lock:
            if len(self.sessions) >= MAX_HTTP_SESSIONS or self.stopping.is_set():
                return False
            self.sessions[client.session_id] = client
        http_log.info("HTTP client %s: session started (handshake era)", client.holder.name)
        return True

    def _housekeeping(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                digests = self.tokens.digests()
            except Exception:  # noqa: BLE001 - a busy vault: try again next time
                continue
            idle = float(self.hub.settings.get("http_session_idle", 3600.0))
            now = time.monotonic()
            with self.lock:
                stale = [(key, client) for key, client in [*self.sessions.items(), *self.modern.items()]
                         if client.holder.digest not in digests or client.ended or
                         (now - client.last_used > (idle if client.era == "handshake" else
                                                    max(idle, float(self.hub.settings["mrtr_ttl"])))
                          and not client.busy())]
                for key, client in stale:
                    self.sessions.pop(key, None) if client.era == "handshake" else self.modern.pop(key, None)
            for _, client in stale:
                if client.holder.digest not in digests:
                    http_log.info("HTTP client %s: its token was removed; its session ends", client.holder.name)
                client.end()

    # -- connections ------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.stopping.is_set():
            listener = self.listener
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except OSError:
                if self.listener is None or self.stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            with self.lock:
                full = self.connections >= MAX_HTTP_CONNECTIONS
                if not full:
                    self.connections += 1
            if full:
                start_thread(self._refuse_busy, "coffer-http-busy", sock)
                continue
            start_thread(self._connection, "coffer-http", sock)

    @staticmethod
    def _refuse_busy(sock: socket.socket) -> None:
        try:
            sock.settimeout(2.0)
            sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
        except OSError:
            pass
        finally:
            sock.close()

    def _connection(self, sock: socket.socket) -> None:
        conn = HttpConnection(sock, float(self.hub.settings.get("http_read_timeout", 10.0)))
        try:
            while not self.stopping.is_set():
                try:
                    request = conn.read_head()
                except HttpProblem as problem:
                    self._refuse(conn, problem, [])
                    break
                if request is None:
                    break
                self._request(conn, request)
                if not conn.keep_alive:
                    break
        except ClientGone:
            pass
        except Exception:  # noqa: BLE001 - one connection's failure must not cost the service
            http_log.exception("error on an HTTP connection")
        finally:
            with self.lock:
                self.connections -= 1
            try:
                sock.close()
            except OSError:
                pass

    def _refuse(self, conn: HttpConnection, problem: HttpProblem, headers: list, unread_body: bool = False) -> None:
        """Answer a refused request: its status, and a JSON-RPC error with no id (or the request's)."""
        body = encode_line(rpc_error(problem.msg_id, problem.code, problem.message, problem.data)).rstrip(b"\n")
        if problem.close or unread_body:
            conn.keep_alive = False
        try:
            conn.send_response(problem.status, [*headers, *problem.headers, *JSON_HEADERS], body)
        except ClientGone:
            return
        if problem.close or unread_body:
            conn.linger_close()

    def _request(self, conn: HttpConnection, request: HttpRequest) -> None:
        headers: list[tuple[str, str]] = []
        has_body = request.header("content-length") not in (None, "0") or bool(request.header("transfer-encoding"))
        try:
            holder = self._admit(request, headers)
            if request.method == "OPTIONS":
                conn.keep_alive = conn.keep_alive and not has_body
                return self._preflight(conn, request, headers)
            if holder is None:
                raise HttpProblem(401, "Unauthorized: send Authorization: Bearer <token> with a token from "
                                       "`coffer token add NAME`",
                                  headers=(("WWW-Authenticate", 'Bearer realm="coffer"'),))
            if request.method == "POST":
                return self._post(conn, request, holder, headers)
            if has_body:
                raise HttpProblem(400, f"{request.method} takes no body", close=True)
            if request.method == "GET":
                return self._get(conn, request, holder, headers)
            if request.method == "DELETE":
                return self._delete(conn, request, holder, headers)
            raise HttpProblem(405, "Method Not Allowed", headers=(("Allow", "GET, POST, DELETE"),))
        except HttpProblem as problem:
            self._refuse(conn, problem, headers, unread_body=has_body and not request.body_read)

    def _admit(self, request: HttpRequest, headers: list) -> TokenHolder | None:
        """Host, Origin and path, then the token: DNS rebinding and other sites' pages are refused before the
        token is even looked at."""
        rule = self.rule
        if request.count("host") != 1 or not rule.host_ok(request.header("host")):
            http_log.info("refused an HTTP request for another host (%.80s)", request.header("host"))
            raise HttpProblem(421, "Misdirected Request: the Host header does not name this endpoint")
        origin = request.header("origin")
        if origin is not None and (request.count("origin") > 1 or not rule.origin_ok(origin)):
            http_log.info("refused an HTTP request from a page of %.80s", origin)
            raise HttpProblem(403, "Forbidden: requests from this origin are not allowed")
        if rule.cors(origin):
            headers += [("Access-Control-Allow-Origin", origin.strip()), ("Vary", "Origin"),
                        ("Access-Control-Expose-Headers", "Mcp-Session-Id, WWW-Authenticate")]
        if request.path != "/mcp":
            raise HttpProblem(404, "Not Found: the MCP endpoint is /mcp")
        if request.method == "OPTIONS":
            return None
        authorization = request.header("authorization") or ""
        scheme, _, token = authorization.partition(" ")
        if request.count("authorization") != 1 or scheme.lower() != "bearer":
            return None
        holder = self.tokens.verify(token.strip())
        if holder is None:
            http_log.info("refused an HTTP request with an unknown or removed token")
        return holder

    def _preflight(self, conn: HttpConnection, request: HttpRequest, headers: list) -> None:
        if not self.rule.cors(request.header("origin")):
            raise HttpProblem(405, "Method Not Allowed", headers=(("Allow", "GET, POST, DELETE"),))
        conn.send_response(204, [*headers, ("Access-Control-Allow-Methods", "GET, POST, DELETE"),
                                 ("Access-Control-Allow-Headers", "Authorization, Content-Type, Accept, "
                                  "Mcp-Session-Id, MCP-Protocol-Version, Mcp-Method, Mcp-Name, Last-Event-ID"),
                                 ("Access-Control-Max-Age", "600")])

    @staticmethod
    def _is_modern(request: HttpRequest, message=None) -> bool:
        """The era a request speaks: a 2026-07-28 (or unknown) MCP-Protocol-Version header, or with no header
        and no session, a body carrying the 2026-07-28 envelope."""
        version = request.header("mcp-protocol-version")
        if version is not None:
            return version not in PROTOCOL_VERSIONS
        return (request.header("mcp-session-id") is None and isinstance(message, dict)
                and is_enveloped(message.get("params")))

    def _client(self, request: HttpRequest, holder: TokenHolder) -> HttpClient:
        session_id = request.header("mcp-session-id")
        if session_id is None:
            raise HttpProblem(400, "Bad Request: no Mcp-Session-Id header (initialize opens a session)")
        with self.lock:
            client = self.sessions.get(session_id)
        if client is None or client.holder.digest != holder.digest or client.ended:
            raise HttpProblem(404, "Session not found")  # another token's session does not exist for this one
        return client

    def _get(self, conn, request, holder, headers) -> None:
        if self._is_modern(request):
            raise HttpProblem(405, "Method Not Allowed: 2026-07-28 has no GET stream", headers=(("Allow", "POST"),))
        if not request.accepts("text/event-stream"):
            raise HttpProblem(406, "Not Acceptable: the GET stream is text/event-stream")
        self._client(request, holder).stream(conn, headers)

    def _delete(self, conn, request, holder, headers) -> None:
        if self._is_modern(request):
            raise HttpProblem(405, "Method Not Allowed: 2026-07-28 has no sessions", headers=(("Allow", "POST"),))
        client = self._client(request, holder)
        with self.lock:
            self.sessions.pop(client.session_id, None)
        client.end()
        http_log.info("HTTP client %s: session ended by the client", holder.name)
        conn.send_response(200, headers)

    # -- POST -------------------------------------------------------------------------------------------------
    def _post(self, conn, request, holder, headers) -> None:
        media = (request.header("content-type") or "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise HttpProblem(415, "Unsupported Media Type: the body must be application/json")
        if not (request.accepts("application/json") or request.accepts("text/event-stream")):
            raise HttpProblem(406, "Not Acceptable: accept application/json and text/event-stream")
        request.body = conn.read_body(request, int(self.hub.settings["max_message_bytes"]))
        try:
            message = decode_json(request.body)
        except ValueError as exc:
            raise HttpProblem(400, f"Parse error: {exc}"[:200], code=PARSE_ERROR) from None
        if self._is_modern(request, message):
            return self._post_modern(conn, request, holder, headers, message)
        return self._post_handshake(conn, request, holder, headers, message)

    def _post_handshake(self, conn, request, holder, headers, message) -> None:
        batch = isinstance(message, list)
        items = message if batch else [message]
        if batch and not items:
            raise HttpProblem(400, "Invalid Request: empty batch")
        if len(items) > ClientSession.MAX_BATCH:
            raise HttpProblem(400, f"Invalid Request: a batch of more than {ClientSession.MAX_BATCH} messages")
        for item in items:
            _check_message(item)
        if request.header("mcp-session-id") is None:
            first = items[0]
            if batch or first.get("method") != "initialize" or "id" not in first:
                raise _http_error(400, "Bad Request: no Mcp-Session-Id header (initialize opens a session)",
                                  first.get("id") if valid_request_id(first.get("id")) else None)
            with self.lock:
                full = len(self.sessions) >= MAX_HTTP_SESSIONS
            if full:
                raise HttpProblem(503, f"Service Unavailable: {MAX_HTTP_SESSIONS} HTTP sessions are open; end one "
                                       "(DELETE) or wait for an idle one to expire")
            client = HttpClient(self, holder, "handshake", secrets.token_urlsafe(24))
            client.post(conn, request, items, False, headers, opening=True)
            return
        if any(item.get("method") == "initialize" for item in items):
            raise _http_error(400, "Invalid Request: this session is initialized; initialize without "
                                   "Mcp-Session-Id opens another", items[0].get("id"))
        self._client(request, holder).post(conn, request, items, batch, headers)

    def _post_modern(self, conn, request, holder, headers, message) -> None:
        """One 2026-07-28 request, checked the way the transport orders it: the body's shape, the envelope's
        presence (-32602), the headers that mirror the body (-32020), the version (-32022); then the method."""
        if not isinstance(message, dict) or not isinstance(message.get("method"), str) or \
                message.get("jsonrpc") != "2.0":
            raise HttpProblem(400, "Invalid Request: the body must be one JSON-RPC request or notification")
        if "id" not in message:
            version = request.header("mcp-protocol-version")
            if version not in MODERN_PROTOCOL_VERSIONS:
                raise _http_error(400, "Unsupported protocol version", code=UNSUPPORTED_PROTOCOL_VERSION,
                                  data={"supported": list(MODERN_PROTOCOL_VERSIONS),
                                        "requested": str(version)[:100]})
            conn.send_response(202, headers)  # 2026-07-28 has no client notification on HTTP (cancel = close)
            return
        msg_id, method = message["id"], message["method"]
        if not valid_request_id(msg_id):
            raise HttpProblem(400, "Invalid Request: id must be a string or an integer")
        params = message.get("params", {})
        if not isinstance(params, dict):
            raise _http_error(400, "Invalid params: params must be an object", msg_id, INVALID_PARAMS)
        meta = params.get("_meta")
        if not isinstance(meta, dict) or META_PROTOCOL_VERSION not in meta or META_CLIENT_CAPABILITIES not in meta:
            try:
                parse_envelope(params)
            except RpcError as exc:
                raise _http_error(400, exc.message, msg_id, exc.code) from None
        problem = self._header_problem(request, message, params, meta)
        if problem is not None:
            raise _http_error(400, f"Header mismatch: {problem}", msg_id, HEADER_MISMATCH)
        try:
            parse_envelope(params)
        except RpcError as exc:
            raise _http_error(ERROR_STATUS.get(exc.code, 400), exc.message, msg_id, exc.code, exc.data) from None
        if method in HANDSHAKE_ONLY_METHODS:
            raise _http_error(404, f"Method not found: {method} (2026-07-28 has no {method}; supported: "
                                   f"{', '.join(MODERN_PROTOCOL_VERSIONS)} per request, or "
                                   f"{', '.join(PROTOCOL_VERSIONS)} after initialize)", msg_id, METHOD_NOT_FOUND)
        if method == "subscriptions/listen" and not request.accepts("text/event-stream"):
            raise HttpProblem(406, "Not Acceptable: a listen stream is text/event-stream")
        self._modern_client(holder).post(conn, request, [message], False, headers)

    def _header_problem(self, request: HttpRequest, message: dict, params: dict, meta: dict) -> str | None:
        for name in ROUTING_HEADERS:
            if request.count(name) > 1:
                return f"{name} appears more than once"
        for name in (*ROUTING_HEADERS, *(key for key, _ in request.headers if key.startswith("mcp-param-"))):
            value = request.header(name)
            if value is not None and not header_value_ok(value):
                return f"{name} holds characters a header may not"
        if request.header("mcp-protocol-version") != meta.get(META_PROTOCOL_VERSION):
            return "MCP-Protocol-Version does not match the request's protocol version"
        method = message["method"]
        if request.header("mcp-method") != method:
            return "Mcp-Method does not match the request's method"
        key = NAME_PARAMS.get(method)
        if key is not None and params.get(key) is not None:
            if decode_header_value(request.header("mcp-name")) != params.get(key):
                return f"Mcp-Name does not match the request's {key}"
        if method == "tools/call" and isinstance(params.get("name"), str):
            schema = self._input_schema(params["name"])
            if schema is not None:
                return parameter_header_problem(schema, params.get("arguments"), request.headers)
        return None

    def _input_schema(self, name: str):
        """A listed tool's input schema (looked up by name in the current catalogue)."""
        catalogue = self.hub.catalogue
        cached, schemas = self._schemas
        if cached is not catalogue:
            schemas = {tool.get("name"): tool.get("inputSchema") for tool in catalogue.tools}
            self._schemas = (catalogue, schemas)
        return schemas.get(name)

    def _modern_client(self, holder: TokenHolder) -> HttpClient:
        with self.lock:
            client = self.modern.get(holder.digest)
            if client is not None and not client.ended:
                return client
        client = HttpClient(self, holder, "modern")
        with self.lock:
            existing = self.modern.get(holder.digest)
            if existing is not None and not existing.ended:
                fresh, client = client, existing
            else:
                self.modern[holder.digest] = client
                fresh = None
        if fresh is not None:
            fresh.end()  # another request of this token made the session first
        return client


def _check_message(item) -> None:
    """A handshake-era POST's message: a JSON-RPC 2.0 request, notification or response, or a 400."""
    msg_id = item.get("id") if isinstance(item, dict) else None
    msg_id = msg_id if valid_request_id(msg_id) else None
    if not isinstance(item, dict) or item.get("jsonrpc") != "2.0":
        raise _http_error(400, "Invalid Request: expected a JSON-RPC 2.0 object", msg_id)
    if "id" in item and not valid_request_id(item["id"]):
        raise HttpProblem(400, "Invalid Request: id must be a string or an integer")
    if "method" in item:
        if not isinstance(item["method"], str):
            raise _http_error(400, "Invalid Request: method must be a string", msg_id)
        if item.get("params") is not None and not isinstance(item["params"], dict):
            raise _http_error(400, "Invalid params: params must be an object", msg_id, INVALID_PARAMS)
    elif not ("result" in item or "error" in item) or "id" not in item:
        raise _http_error(400, "Invalid Request: not a request, notification or response", msg_id)

