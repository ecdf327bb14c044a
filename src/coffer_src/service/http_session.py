"""Service HTTP session: an HTTP client's session; which response each message goes to.

An ``HttpClient`` is the stream of a ``ClientSession`` of the service's hub (gateway/session.py accepts any object
with ``send``, ``flush`` and ``gone``).  Every request the client sends gets an id (and every progress token a
token) of Coffer's own before the session sees it, so an answer, a progress notification or a listen frame goes
to exactly the HTTP response of the request it belongs to, with the client's own id put back, and two clients
(or one reusing ids) never receive each other's messages.  What belongs to no request goes to the handshake-era
session's GET stream (kept for it, bounded, while none is open); a 2026-07-28 client hears nothing it did not
ask for on a request.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LOG_LEVELS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    EncodeError,
    decode_json,
    encode_line,
    rpc_error,
    rpc_result,
    valid_request_id,
    wire_log,
    wire_text,
)
from coffer_src.modern import (
    META_LOG_LEVEL,
    META_SUBSCRIPTION_ID,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from coffer_src.names import SEPARATOR
from coffer_src.service.http_wire import (
    SSE_KEEPALIVE,
    ClientGone,
    HttpConnection,
    HttpProblem,
    HttpRequest,
    sse_event,
)
from coffer_src.service.tokens import TokenHolder

http_session_log = logging.getLogger(__name__)

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
SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache, no-transform"),
               ("X-Accel-Buffering", "no")]
JSON_HEADERS = [("Content-Type", "application/json")]


def _client_id_key(msg_id) -> str:
    return f"{type(msg_id).__name__}:{msg_id}"


class NamedSession(ClientSession):
    """A ClientSession named by the token its client presented: that name, not what the client says of itself,
    is the client in the invocation log, `coffer status` and client-aware listing."""

    def __init__(self, hub: Hub, stream, name: str, profile: str | None = None):
        self._token_name = name
        super().__init__(hub, stream=stream, profile=profile)

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


def _stream_what_was_held(conn: HttpConnection, headers: list[tuple[str, str]], held: list[bytes]) -> list[bytes]:
    """Turn a response that was going to be one JSON body into an SSE stream: start it, send the answers held
    back so far, first; what is held from now on is nothing (the returned empty list)."""
    conn.start_stream(200, [*headers, *SSE_HEADERS])
    for answered in held:
        conn.send_chunk(sse_event(answered))
    return []


class HttpClient:
    """One HTTP client session and where each message its ClientSession sends goes.  It is that session's
    stream (``send``, ``flush``, ``gone``): ``send`` runs on whichever thread delivers (the connection's, an
    upstream reader, a worker) and never blocks on the client.

    ``dispatching`` makes the session read one message at a time, as a stdio session's one reader thread does
    (HTTP lets a client send requests concurrently); it is held only while a message is handed over, never while
    an answer is awaited, and is taken before any lock of the session or the hub.  ``lock`` guards the routing
    records and every Exchange of this client; it is innermost (it may be taken under ``dispatching``, the hub's
    ``_rebuild_lock`` and the endpoint's ``lock``, and nothing is called while it is held but Exchange.push)."""

    def __init__(self, endpoint, holder: TokenHolder, era: str, session_id: str | None = None,
                 profile: str | None = None):
        self.endpoint = endpoint
        self.holder = holder
        self.profile = profile           # /mcp/p/<profile>: the requests of this session come there, no others
        self.era = era                   # "handshake" (Mcp-Session-Id) or "modern" (one per token)
        self.session_id = session_id
        self.lock = threading.Lock()
        self.dispatching = threading.Lock()
        self.exchanges: dict[str, Exchange] = {}   # by the id Coffer gave a request
        self.client_ids: dict[str, str] = {}       # handshake era: the client's id -> Coffer's (cancellations)
        self.progress: dict[str, Exchange] = {}    # by the progress token Coffer gave a request
        self.get_stream: Exchange | None = None
        self.backlog: collections.deque[bytes] = collections.deque()
        self.ended = False
        self.last_used = time.monotonic()
        self._ids = itertools.count(1)
        self.session = NamedSession(endpoint.hub, self, holder.name, profile)

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
                http_session_log.warning("dropped a message to an HTTP client that cannot be encoded: %s", exc)
                return
            http_session_log.warning("a reply could not be encoded (%s); the client gets an error instead", exc)
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
        with self.dispatching:
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
            if established:
                try:
                    self.endpoint.register(self)  # raises when the sessions are at their limit
                except HttpProblem:
                    self.end()
                    raise
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
        held: list[bytes] = []
        last_write = time.monotonic()
        try:
            if streaming:
                conn.start_stream(200, [*headers, *SSE_HEADERS])
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
                        streaming, held = True, _stream_what_was_held(conn, headers, held)
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
                        streaming, held = True, _stream_what_was_held(conn, headers, held)
                    conn.send_chunk(SSE_KEEPALIVE)
                    last_write = time.monotonic()
        except ClientGone:
            conn.keep_alive = False
            raise
        finally:
            if not exchange.closed:  # the client left, or a failure here: its requests are not waited on
                self.left(exchange)

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
            http_session_log.warning("an HTTP client (%s) left %d MB of answers unread: its response is cut",
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
        if self.era == "modern" and pending:
            with self.dispatching:
                for internal in pending:
                    self.session.dispatch({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                           "params": {"requestId": internal,
                                                      "reason": "the client closed the response stream"}})

    def _close(self, exchange: Exchange) -> None:
        """Forget an exchange (caller holds the lock)."""
        exchange.closed = True
        self.last_used = time.monotonic()  # an open stream was use: the idle time starts when it ends
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
