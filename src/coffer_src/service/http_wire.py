"""Service HTTP wire: bounded HTTP/1.1 with deadlines, JSON and SSE, MCP header rules.

Everything a client sends is hostile input: a request head is bounded in bytes and lines and must arrive within
``timeout`` of its first byte; a body is bounded by max_message_bytes, may pause at most ``timeout`` and must
average MIN_BODY_RATE; a connection idle between requests for ``timeout`` is closed, and so is one whose client
leaves a write unread for a few times ``timeout``.  So a client that sends nothing, a byte now and then
(slowloris), or reads nothing, costs one connection slot for a bounded time.  The header rules of
Streamable HTTP (Host and Origin against DNS rebinding, the 2026-07-28 request headers that mirror the body)
are checked here, before a message reaches a session.
"""

from __future__ import annotations

import base64
import binascii
import http
import ipaddress
import re
import select
import socket
import time
from urllib.parse import urlsplit

from coffer_src.errors import CofferException
from coffer_src.jsonrpc import INVALID_REQUEST

MAX_HEAD_BYTES = 32 << 10
MAX_HEADER_LINES = 100
#: Bytes per second a body must average once its first ``timeout`` has passed.
MIN_BODY_RATE = 64 << 10
#: A write to a client may block this many times ``timeout`` (then the client that stopped reading loses its
#: connection: a thread is never held by it for longer).
WRITE_TIMEOUT_FACTOR = 3
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
_FIELD_NAME_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_FIELD_VALUE_RE = re.compile(r"^[\t\x20-\x7e]*$")
_REQUEST_LINE_RE = re.compile(rb"^([A-Z]{1,16}) (\S{1,8192}) HTTP/(1\.[01])$")
_B64_SENTINEL_RE = re.compile(r"^=\?base64\?(.*)\?=$", re.S)


class HttpProblem(CofferException):
    """A request the endpoint refuses at the HTTP level: its status, a message for the JSON-RPC error body, and
    whether the connection must close (its bytes can no longer be trusted to frame the next request)."""

    def __init__(self, status: int, message: str, close: bool = False, code: int = INVALID_REQUEST,
                 headers: tuple = (), msg_id=None, data=None):
        super().__init__(message)
        self.status, self.message, self.close, self.code, self.headers = status, message, close, code, headers
        self.msg_id, self.data = msg_id, data


class ClientGone(CofferException):
    """The client closed its end, or sent nothing within its time."""


class ClientStalled(ClientGone):
    """The client left what was written to it unread for too long."""


class HttpRequest:
    """One request: method, path, version, headers (names lower-cased, values without surrounding whitespace,
    in order, duplicates kept) and, once read, the body."""

    __slots__ = ("method", "target", "path", "version", "headers", "body", "body_read")

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]]):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.path = target.partition("?")[0]
        self.body = b""
        self.body_read = False

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key == name), None)

    def count(self, name: str) -> int:
        return sum(1 for key, _ in self.headers if key == name)

    def accepts(self, media: str) -> bool:
        """Whether the Accept header lists ``media`` (or its wildcards); no Accept header accepts anything."""
        accept = self.header("accept")
        if accept is None:
            return True
        kind = media.partition("/")[0]
        for item in accept.split(","):
            value, _, params = item.strip().lower().partition(";")
            if re.search(r"(?:^|;)\s*q=0(?:\.0*)?\s*(?:;|$)", params):
                continue
            if value.strip() in (media, f"{kind}/*", "*/*"):
                return True
        return False


class HttpConnection:
    """One client connection, on the thread that serves it: requests read, responses written."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock = sock
        self.timeout = timeout
        self.buffer = bytearray()
        self.keep_alive = True
        self.chunked = False   # the response being streamed uses chunked transfer coding

    # -- reading -------------------------------------------------------------------------------------------------
    def _recv(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ClientGone("the client took too long")
        self.sock.settimeout(min(remaining, self.timeout))
        try:
            data = self.sock.recv(1 << 16)
        except (socket.timeout, OSError):
            raise ClientGone("the client sent nothing in time") from None
        if not data:
            raise ClientGone("the client closed the connection")
        self.buffer += data

    def read_head(self) -> HttpRequest | None:
        """The next request's line and headers; None when the client closes or idles (between requests that is
        how a connection ends).  A head that is malformed, too large, or slower than ``timeout`` raises."""
        try:
            if not self.buffer:
                self._recv(time.monotonic() + self.timeout)
        except ClientGone:
            return None
        deadline = time.monotonic() + self.timeout
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise HttpProblem(431, "Request header fields too large", close=True)
            try:
                self._recv(deadline)
            except ClientGone:
                if self.buffer.strip():
                    raise HttpProblem(408, "the request head did not arrive in time", close=True) from None
                return None
        if end > MAX_HEAD_BYTES:
            raise HttpProblem(431, "Request header fields too large", close=True)
        head = bytes(self.buffer[:end])
        del self.buffer[:end + 4]
        lines = head.lstrip(b"\r\n").split(b"\r\n")
        match = _REQUEST_LINE_RE.match(lines[0])
        if not match:
            raise HttpProblem(400, "malformed request line", close=True)
        if len(lines) - 1 > MAX_HEADER_LINES:
            raise HttpProblem(431, f"more than {MAX_HEADER_LINES} header fields", close=True)
        headers = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not _FIELD_NAME_RE.match(name):
                raise HttpProblem(400, "malformed header field", close=True)  # obs-fold included (RFC 9112 5.2)
            text = value.decode("latin-1").strip(" \t")
            headers.append((name.decode("ascii").lower(), text))
        request = HttpRequest(match.group(1).decode(), match.group(2).decode("latin-1"), match.group(3).decode(),
                              headers)
        # HTTP/1.0 gets one request per connection: its responses are framed by closing it
        self.keep_alive = request.version == "1.1" and "close" not in (request.header("connection") or "").lower()
        return request

    def read_body(self, request: HttpRequest, limit: int) -> bytes:
        """The request's body (Content-Length or chunked), at most ``limit`` bytes; a larger one is refused
        before it is read (413, and the connection closes: its bytes are never read)."""
        request.body_read = True
        coding = request.header("transfer-encoding")
        lengths = {value for key, value in request.headers if key == "content-length"}
        if coding is not None:
            if lengths or coding.lower() != "chunked" or request.count("transfer-encoding") > 1:
                raise HttpProblem(400, "unsupported Transfer-Encoding", close=True)
            self._continue(request)
            return self._read_chunked(limit)
        if not lengths:
            return b""
        if len(lengths) > 1 or not all(part.strip().isdigit() for part in next(iter(lengths)).split(",")) or \
                len({part.strip() for part in next(iter(lengths)).split(",")}) > 1:
            raise HttpProblem(400, "malformed Content-Length", close=True)
        length = int(next(iter(lengths)).split(",")[0])
        if length > limit:
            raise HttpProblem(413, f"a body of {length} bytes is larger than max_message_bytes ({limit})",
                              close=True)
        self._continue(request)
        return self._read_exact(length)

    def _continue(self, request: HttpRequest) -> None:
        if (request.header("expect") or "").lower() == "100-continue" and request.version == "1.1":
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _body_deadline(self, length: int) -> float:
        return time.monotonic() + self.timeout + length / MIN_BODY_RATE

    def _read_exact(self, length: int) -> bytes:
        deadline = self._body_deadline(length)
        try:
            while len(self.buffer) < length:
                self._recv(deadline)
        except ClientGone:
            raise HttpProblem(408, "the request body did not arrive in time", close=True) from None
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    def _read_line(self, deadline: float) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 2]
                return line
            if len(self.buffer) > 4096:
                raise HttpProblem(400, "malformed chunked body", close=True)
            self._recv(deadline)

    def _read_chunked(self, limit: int) -> bytes:
        parts, total = [], 0
        deadline = self._body_deadline(limit)
        try:
            while True:
                size_text = self._read_line(deadline).partition(b";")[0].strip()
                if not size_text or len(size_text) > 16 or not re.fullmatch(rb"[0-9A-Fa-f]+", size_text):
                    raise HttpProblem(400, "malformed chunked body", close=True)
                size = int(size_text, 16)
                if size == 0:
                    while self._read_line(deadline):  # trailer fields, ignored
                        pass
                    return b"".join(parts)
                total += size
                if total > limit:
                    raise HttpProblem(413, f"a body larger than max_message_bytes ({limit})", close=True)
                while len(self.buffer) < size + 2:
                    self._recv(deadline)
                if self.buffer[size:size + 2] != b"\r\n":
                    raise HttpProblem(400, "malformed chunked body", close=True)
                parts.append(bytes(self.buffer[:size]))
                del self.buffer[:size + 2]
        except ClientGone:
            raise HttpProblem(408, "the request body did not arrive in time", close=True) from None

    def linger_close(self) -> None:
        """Close after refusing a request whose body was not read: stop writing, then read and drop what the
        client is still sending for a moment, so the refusal is not lost to a reset."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            drained = 0
            while drained < (1 << 20) and time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                drained += len(data)
        except OSError:
            pass

    def peer_closed(self) -> bool:
        """Whether the client has closed its end (checked without blocking and without consuming anything it
        sent meanwhile, such as its next request)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            return not self.sock.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True

    # -- writing -------------------------------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout * WRITE_TIMEOUT_FACTOR)
        try:
            self.sock.sendall(data)
        except socket.timeout:
            raise ClientStalled(f"the client read nothing for {self.timeout * WRITE_TIMEOUT_FACTOR:g}s") from None
        except OSError:
            raise ClientGone("the client closed the connection") from None

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if not self.keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send_response(self, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
        headers = [*headers, ("Content-Length", str(len(body)))]
        self._send(self._head(status, headers) + body)

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """An SSE response: chunked when the client speaks HTTP/1.1 (the connection stays usable), else until the
        connection closes."""
        self.chunked = self.keep_alive
        extra = [("Transfer-Encoding", "chunked")] if self.chunked else []
        self._send(self._head(status, [*headers, *extra]))

    def send_chunk(self, data: bytes) -> None:
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self._send(data)

    def end_stream(self) -> None:
        if self.chunked:
            self._send(b"0\r\n\r\n")
        else:
            self.keep_alive = False


def sse_event(data: bytes) -> bytes:
    """One JSON-RPC message as an SSE event (the JSON text never holds a raw line break)."""
    return b"event: message\ndata: " + data.rstrip(b"\n") + b"\n\n"


SSE_KEEPALIVE = b": keepalive\n\n"


# -- Host and Origin: no DNS rebinding, no page of another origin ------------------------------------------------
def split_host(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header or an origin's authority; a bracketed IPv6 literal keeps its brackets."""
    value = value.strip().lower()
    match = re.fullmatch(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::([0-9]{1,5}))?", value)
    if not match:
        return None
    return match.group(1), int(match.group(2)) if match.group(2) else None


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HostRule:
    """Which Host and Origin values name this endpoint.  Bound to loopback: the loopback names with its port.
    Bound elsewhere (the user named the address): also that address, and any IP literal when it listens on
    every interface.  A DNS name other than localhost is never accepted: DNS rebinding needs one."""

    def __init__(self, bound_host: str, port: int, origins: list[str]):
        self.port = port
        self.names = set(LOOPBACK_NAMES)
        host = bound_host.lower()
        self.names.add(f"[{host}]" if ":" in host and not host.startswith("[") else host)
        self.any_ip = host in ("0.0.0.0", "::", "[::]")
        self.origins = {origin.rstrip("/").lower() for origin in origins}

    def host_ok(self, value: str | None) -> bool:
        parsed = split_host(value) if value else None
        if parsed is None:
            return False
        host, port = parsed
        if port is not None and port != self.port:
            return False
        return host in self.names or (is_ip_literal(host) and (self.any_ip or is_loopback_host(host)))

    def origin_ok(self, value: str) -> bool:
        """An Origin header (present): one the user allowed (CORS), or this endpoint's own."""
        value = value.strip().lower()
        if value in self.origins:
            return True
        try:
            parts = urlsplit(value)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or parts.path or parts.query or parts.fragment or "@" in value:
            return False
        authority = split_host(parts.netloc)
        if authority is None:
            return False
        host, port = authority
        return (port or (443 if parts.scheme == "https" else 80)) == self.port and self.host_ok(parts.netloc)

    def cors(self, origin: str | None) -> bool:
        """Whether a request from ``origin`` gets CORS headers: only an origin the user configured."""
        return origin is not None and origin.strip().lower() in self.origins


# -- the 2026-07-28 request headers: they mirror the body, and must match it -------------------------------------
def header_value_ok(value: str) -> bool:
    return bool(_FIELD_VALUE_RE.match(value))


def decode_header_value(value: str | None) -> str | None:
    """A mirrored header's value: base64 between =?base64? and ?= (strictly decoded; None when it is not valid
    base64 or UTF-8), else the value itself."""
    if value is None:
        return None
    match = _B64_SENTINEL_RE.match(value)
    if not match:
        return value
    try:
        return base64.b64decode(match.group(1), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _rendered(value) -> str | None:
    """A tool argument as a client mirrors it into a header (None: not mirrorable)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return None


def _header_matches(value, decoded: str, kind) -> bool:
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool) and \
            re.fullmatch(r"-?[0-9]+(\.0+)?", decoded):
        return int(decoded.partition(".")[0]) == value
    return decoded == _rendered(value)


def annotated_parameters(schema, path: tuple = (), found: list | None = None, budget: list | None = None) -> list:
    """(path, header token, property type) of every property an input schema marks with x-mcp-header, following
    ``properties`` chains (bounded: a hostile schema costs at most a few thousand steps)."""
    found = [] if found is None else found
    budget = [2000] if budget is None else budget
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return found
    for key, prop in properties.items():
        budget[0] -= 1
        if budget[0] < 0 or not isinstance(prop, dict):
            continue
        token = prop.get("x-mcp-header")
        if isinstance(token, str) and token and _FIELD_NAME_RE.match(token.encode("ascii", "replace")):
            found.append(((*path, key), token, prop.get("type")))
        annotated_parameters(prop, (*path, key), found, budget)
    return found


def parameter_header_problem(schema, arguments, headers: list[tuple[str, str]]) -> str | None:
    """Why a tools/call's Mcp-Param-* headers disagree with its arguments (None: they agree).  Each annotated
    argument that is present must come with its header, equal after decoding; an absent one with none."""
    arguments = arguments if isinstance(arguments, dict) else {}
    for path, token, kind in annotated_parameters(schema):
        name = f"mcp-param-{token.lower()}"
        values = [value for key, value in headers if key == name]
        node = arguments
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        rendered = _rendered(node) if node is not None else None
        if len(values) > 1:
            return f"Mcp-Param-{token} appears more than once"
        if rendered is None:
            if values:
                return f"Mcp-Param-{token} is present but the argument is not"
            continue
        if not values:
            return f"Mcp-Param-{token} is missing"
        if not header_value_ok(values[0]):
            return f"Mcp-Param-{token} holds characters a header may not"
        decoded = decode_header_value(values[0])
        if decoded is None or not _header_matches(node, decoded, kind):
            return f"Mcp-Param-{token} does not match the argument {'.'.join(path)!r}"
    return None
