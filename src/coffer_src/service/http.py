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

Which response each message of a session goes to is service/http_session.py's; the bytes on the wire and the
header rules are service/http_wire.py's; this module admits requests and applies each era's rules.
"""

from __future__ import annotations

import ipaddress
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
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    PROTOCOL_VERSIONS,
    RpcError,
    decode_json,
    encode_line,
    rpc_error,
    valid_request_id,
)
from coffer_src.modern import (
    HANDSHAKE_ONLY_METHODS,
    META_CLIENT_CAPABILITIES,
    META_PROTOCOL_VERSION,
    MODERN_PROTOCOL_VERSIONS,
    UNSUPPORTED_PROTOCOL_VERSION,
    is_enveloped,
    parse_envelope,
)
from coffer_src.profiles import PROFILE_NAME_RE
from coffer_src.service.http_session import ERROR_STATUS, HEADER_MISMATCH, JSON_HEADERS, HttpClient
from coffer_src.service.http_wire import (
    ClientGone,
    ClientStalled,
    HostRule,
    HttpConnection,
    HttpProblem,
    HttpRequest,
    decode_header_value,
    header_value_ok,
    parameter_header_problem,
)
from coffer_src.service.tokens import TokenHolder, TokenStore
from coffer_src.settings import HTTP_ADDRESS_RE
from coffer_src.threads import start_thread

http_log = logging.getLogger(__name__)

MAX_HTTP_CONNECTIONS = 64
MAX_HTTP_SESSIONS = 64
NAME_PARAMS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
ROUTING_HEADERS = ("mcp-protocol-version", "mcp-method", "mcp-name")


def parse_http_address(text: str) -> tuple[str, int]:
    """(host, port) of ``--http``: HOST:PORT, [IPv6]:PORT, or a bare PORT (loopback).  Port 0 picks a free one."""
    text = str(text).strip()
    if text.isdigit():
        text = f"127.0.0.1:{text}"
    match = HTTP_ADDRESS_RE.match(text)
    if not match or int(match.group(2)) > 65535:
        raise CofferError(f"bad HTTP address {text!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    return match.group(1).strip("[]"), int(match.group(2))


def _http_error(status: int, message: str, msg_id=None, code: int = INVALID_REQUEST, data=None) -> HttpProblem:
    """A refusal answered with a JSON-RPC error for the request's id."""
    return HttpProblem(status, message, code=code, msg_id=msg_id, data=data)


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
        self.modern: dict[str, HttpClient] = {}       # 2026-07-28, by token digest (and /p/<profile>)
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
            # close() alone leaves the port listening while the accept thread is blocked in accept(); shutdown
            # wakes it (Linux), so the successor can bind at once.
            for release in (lambda: listener.shutdown(socket.SHUT_RDWR), listener.close):
                try:
                    release()
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

    def register(self, client: HttpClient) -> None:
        """A handshake-era session that initialized: findable by its id from now on (503 at the limit)."""
        with self.lock:
            full = len(self.sessions) >= MAX_HTTP_SESSIONS or self.stopping.is_set()
            if not full:
                self.sessions[client.session_id] = client
        if full:
            raise HttpProblem(503, f"Service Unavailable: {MAX_HTTP_SESSIONS} HTTP sessions are open; end one "
                                   "(DELETE) or wait for an idle one to expire")
        http_log.info("HTTP client %s: session started (handshake era)", client.holder.name)

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
        except ClientStalled as exc:
            http_log.warning("an HTTP client stopped reading (%s): its connection is closed", exc)
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
        profile_in_path(request.path)  # 404 for any other path
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
        if client is None or client.holder.digest != holder.digest or client.ended or \
                client.profile != profile_in_path(request.path):
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
            client = HttpClient(self, holder, "handshake", secrets.token_urlsafe(24), self._profile(request))
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
        try:
            self._modern_client(holder, self._profile(request)).post(conn, request, [message], False, headers)
        except HttpProblem as problem:
            if problem.status != 404:
                raise
            # the token's session ended (idle, just now) between finding it and using it: a new one serves
            self._modern_client(holder, self._profile(request)).post(conn, request, [message], False, headers)

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

    def _profile(self, request: HttpRequest) -> str | None:
        """The profile a request's path names (/mcp/p/NAME; None for /mcp), once the service knows it: 404 for
        one that does not exist."""
        profile = profile_in_path(request.path)
        refusal = self.service.profile_refusal(profile)
        if refusal is not None:
            raise HttpProblem(404, f"Not Found: {refusal}"[:300])
        return profile

    def _modern_client(self, holder: TokenHolder, profile: str | None) -> HttpClient:
        key = holder.digest if profile is None else f"{holder.digest}/p/{profile}"
        with self.lock:
            client = self.modern.get(key)
            if client is not None and not client.ended:
                return client
        client = HttpClient(self, holder, "modern", profile=profile)
        with self.lock:
            existing = self.modern.get(key)
            if existing is not None and not existing.ended:
                fresh, client = client, existing
            else:
                self.modern[key] = client
                fresh = None
        if fresh is not None:
            fresh.end()  # another request of this token made the session first
        return client


#: The MCP endpoint, for every tool (/mcp) or for the clients of one profile (/mcp/p/NAME).
_PROFILE_PATH = "/mcp/p/"


def profile_in_path(path: str) -> str | None:
    """The profile an endpoint path names (None for /mcp); HttpProblem 404 for a path that is neither."""
    if path == "/mcp":
        return None
    name = path[len(_PROFILE_PATH):] if path.startswith(_PROFILE_PATH) else ""
    if not PROFILE_NAME_RE.match(name):
        raise HttpProblem(404, "Not Found: the MCP endpoint is /mcp (or /mcp/p/PROFILE for one profile's tools)")
    return name


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

