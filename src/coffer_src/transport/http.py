"""HTTP plumbing: redirect-safe requests, origins, bounded bodies, SSE event streams."""

from __future__ import annotations

import base64
import re
from typing import NamedTuple

from coffer_src import __version__
from coffer_src.jsonrpc import LATEST_PROTOCOL_VERSION, decode_json, encode_line
from coffer_src.modern import META_PROTOCOL_VERSION, MODERN_PROTOCOL_VERSIONS, Envelope, stamp_envelope
from coffer_src.names import origin_text, same_origin, url_origin
from coffer_src.terminal import printable, redact
from coffer_src.transport.stdio import UpstreamFailure

OAUTH_SECRET_PREFIX = "oauth."          # SecretStore name of a server's saved login: oauth.<server>
MAX_REDIRECTS = 3
_ERROR_BODY_BYTES = 64 << 10            # how much of an error reply is read, for its message
_METADATA_BYTES = 1 << 20               # OAuth metadata, registration and token replies
_SSE_PIECE = 64 << 10                   # a stream is read in pieces of at most this, whatever its line lengths
_SESSION_ID_RE = re.compile(r"^[\x21-\x7e]{1,1024}$")


class HttpReply(NamedTuple):
    """One HTTP exchange's answer.  ``stream`` is the still-open response when a streamed 2xx was asked for (the
    caller reads and closes it); otherwise ``body`` holds the body (an error body cut at 64 KiB)."""
    status: int
    headers: dict           # lower-case name -> value; repeated headers joined with ", "
    body: bytes
    url: str                # where the answer came from, after same-origin redirects
    stream: object = None

    @property
    def ok(self) -> bool:
        """A 2xx: the one test of success for an MCP endpoint (the OAuth endpoints name their exact codes)."""
        return 200 <= self.status < 300


class OriginRefused(UpstreamFailure):
    """A redirect or an SSE endpoint that would carry credentials to another origin.  Permanent: retrying would
    only ask the same server to send them there again."""

    permanent = True


_http_opener = None


def stream_errors() -> tuple:
    """What reading a broken HTTP stream raises (http.client's IncompleteRead is neither OSError nor ValueError)."""
    import http.client
    return OSError, ValueError, http.client.HTTPException


def _header_dict(message) -> dict:
    headers: dict[str, str] = {}
    for name, value in (message.items() if message is not None else ()):
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def remote_http(method: str, url: str, *, headers=None, body: bytes | None = None, timeout: float = 30.0,
                max_bytes: int = _METADATA_BYTES, stream: bool = False) -> HttpReply:
    """Every HTTP exchange Coffer makes (remote upstreams, OAuth, the embedder), with urllib.

    Any status comes back as an HttpReply; what prevents an answer (unreachable, a body over ``max_bytes``)
    raises UpstreamFailure.  Redirects are decided here, not by urllib (which re-sends every header, Authorization
    included, to whatever host a redirect names, https->http included): a redirect is followed — with the same
    method and body, the only meaning an MCP endpoint that moved can have — only within the configured origin and
    at most MAX_REDIRECTS times; any other raises OriginRefused.
    """
    global _http_opener
    import http.client  # noqa: E401 - lazily: a gateway of stdio servers never pays for the HTTP stack
    import urllib.error
    import urllib.request
    if _http_opener is None:
        class _Decline(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None  # a 3xx then surfaces as HTTPError, and remote_http decides

        _http_opener = urllib.request.build_opener(_Decline)
    if url_origin(url) is None:
        raise UpstreamFailure(f"unsupported URL {printable(str(url))[:200]!r}", permanent=True)
    sent = {"User-Agent": f"coffer/{__version__}", **(headers or {})}
    where = origin_text(url)
    for _ in range(MAX_REDIRECTS + 1):
        request = urllib.request.Request(url, data=body, headers=sent, method=method)
        try:
            response = _http_opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            location = exc.headers.get("Location") if exc.headers is not None else None
            if exc.code in (301, 302, 303, 307, 308):
                exc.close()
                target = urllib.parse.urljoin(url, location or "")
                if not location or not same_origin(target, url):
                    raise OriginRefused(f"{where} redirected to {origin_text(target)} (HTTP {exc.code}): refused, "
                                        "credentials never leave the configured origin; register the URL it "
                                        "redirects to instead") from None
                url = target
                continue
            try:
                data = exc.read(_ERROR_BODY_BYTES) or b""
            except (OSError, ValueError, http.client.HTTPException):
                data = b""
            finally:
                exc.close()
            return HttpReply(exc.code, _header_dict(exc.headers), data, url)
        except urllib.error.URLError as exc:
            raise UpstreamFailure(f"cannot reach {where}: {printable(str(getattr(exc, 'reason', exc)))[:200]}") \
                from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise UpstreamFailure(f"cannot reach {where}: {exc.__class__.__name__}: {printable(str(exc))[:200]}") \
                from None
        reply = HttpReply(response.status, _header_dict(response.headers), b"", url, response)
        if stream:
            return reply
        try:
            data = response.read(max_bytes + 1)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise UpstreamFailure(f"{where} broke off its reply: {exc.__class__.__name__}") from None
        finally:
            response.close()
        if len(data) > max_bytes:
            raise UpstreamFailure(f"{where} sent a reply larger than {max_bytes} bytes")
        return reply._replace(body=data, stream=None)
    raise OriginRefused(f"{where} redirected more than {MAX_REDIRECTS} times")


def _stream_socket(response):
    """The socket under a streamed urllib response (CPython's layout), or None: only to shut it down from another
    thread (closing the response there would wait for the reader's lock) and to tune keepalive."""
    raw = getattr(getattr(response, "fp", None), "raw", None)
    return getattr(raw, "_sock", None)


def settle_stream(response) -> None:
    """A stream that may stay silent for hours: no read timeout, TCP keepalive so a dead peer is noticed."""
    import socket

    sock = _stream_socket(response)
    if sock is None:
        return
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 15), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:
        pass


def abort_stream(response) -> None:
    """End a streamed response from any thread: its reader sees end of stream and closes it."""
    import socket

    sock = _stream_socket(response)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        else:
            response.close()
    except (OSError, ValueError):
        pass


def close_stream(stream) -> None:
    """Close a streamed response, whatever state its connection is in."""
    if stream is not None:
        try:
            stream.close()
        except (OSError, ValueError):
            pass


def _close_reply(reply: HttpReply) -> None:
    close_stream(reply.stream)


def _content_type(reply: HttpReply) -> str:
    return reply.headers.get("content-type", "").split(";")[0].strip().lower()


def _reply_text(reply: HttpReply, limit: int = 200) -> str:
    """An error body, as much as a person should see of it: printable, redacted, short."""
    text = reply.body[:limit * 4].decode("utf-8", "replace").strip()
    return printable(redact(" ".join(text.split())))[:limit]


# -- server-sent events ----------------------------------------------------------------------------------------

class SseEvent(NamedTuple):
    """One event of a text/event-stream.  ``oversized`` > 0: its data ran to that many bytes and was dropped;
    ``data`` then holds its first 4 KiB, enough to find a request id in."""
    kind: str
    data: bytes
    oversized: int = 0


class SseCursor:
    """Where a stream stands for resuming it (WHATWG HTML §9.2 "last event ID" and "reconnection time"): the id of
    the last event dispatched, even one with no data (a server's priming event), and the ``retry`` it asked for,
    in seconds.  Owned by the thread reading the stream."""

    __slots__ = ("last_id", "retry")

    def __init__(self):
        self.last_id: str | None = None
        self.retry: float | None = None


def _bounded_lines(readline, limit: int):
    """(line, length) per line of a stream; a line longer than ``limit`` keeps only its first pieces."""
    while True:
        piece = readline(_SSE_PIECE)
        if not piece:
            return
        if piece.endswith(b"\n"):
            yield piece, len(piece)
            continue
        parts, length = [piece], len(piece)
        while True:
            piece = readline(_SSE_PIECE)
            length += len(piece)
            if length <= limit + _SSE_PIECE:
                parts.append(piece)
            if not piece or piece.endswith(b"\n"):
                break
        yield b"".join(parts), length
        if not piece:
            return


def read_sse_events(readline, max_event_bytes: int, cursor: SseCursor | None = None):
    """Parse a text/event-stream (WHATWG HTML §9.2) from ``readline(limit)``.  Memory stays under about
    ``max_event_bytes`` whatever the server sends; an unfinished last event is dropped, as the standard says.
    Lines end with LF or CRLF (a lone CR is not treated as a line end).  With ``cursor``, the event ids and the
    ``retry`` the server sends are kept there, for resuming the stream."""
    kind, data, size, head = "", [], 0, b""
    event_id = cursor.last_id if cursor is not None else None
    for raw, length in _bounded_lines(readline, max_event_bytes):
        line = raw[:-1] if raw.endswith(b"\n") else raw
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            if cursor is not None:
                cursor.last_id = event_id  # set at every dispatch, an event without data included
            if head:
                yield SseEvent(kind or "message", head, size)
            elif data and (data[0] or len(data) > 1):  # an event with empty data is not dispatched
                yield SseEvent(kind or "message", b"\n".join(data))
            kind, data, size, head = "", [], 0, b""
            continue
        if line.startswith(b":"):
            continue  # a comment: servers send them to keep the connection open
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            # Each line costs bookkeeping whatever it holds, so each counts for more than its data: an event of a
            # million empty data lines must hit the limit long before it holds a gigabyte.
            size += (length if length > max_event_bytes else len(value)) + 128
            if size > max_event_bytes:
                head = head or (b"\n".join(data) + b"\n" + value)[:4096]
                data = []
            elif not head:
                data.append(value)
        elif name == b"event":
            kind = value[:64].decode("utf-8", "replace")
        elif name == b"id" and cursor is not None and b"\0" not in value and len(value) <= 1024:
            event_id = value.decode("utf-8", "replace")
        elif name == b"retry" and cursor is not None and value.isdigit() and len(value) <= 9:
            cursor.retry = int(value) / 1000.0
        # (The 2024-11-05 transport defines no resumption: for it, a drop is a new session.)


def _messages_of(data: bytes, server_log, on_unusable=None) -> list[dict]:
    """The JSON-RPC messages in one event or body (a message or a batch); junk is skipped with a warning (to
    ``server_log``, the transport's ServerLog), and ``on_unusable`` hears of it, so a request it answered fails at
    once instead of waiting for its timeout."""
    try:
        payload = decode_json(data)
    except ValueError as exc:
        server_log.warning("skipped an SSE event that is not JSON (%d bytes: %s)", len(data), exc)
        if on_unusable is not None:
            on_unusable(data[:4096], f"a reply Coffer cannot read ({exc})")
        return []
    items = payload if isinstance(payload, list) else [payload]
    return [item for item in items if isinstance(item, dict)]


# -- which transport a server speaks ------------------------------------------------------------------------

FALLBACK_TO_GET = (400, 404, 405)   # what an HTTP+SSE server answers a Streamable HTTP POST (MCP 2025-11-25)
_TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")   # an HTTP field name (RFC 9110 §5.1)
NAMED_METHODS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}


def _probe_initialize() -> bytes:
    return encode_line({"jsonrpc": "2.0", "id": "coffer-probe", "method": "initialize", "params": {
        "protocolVersion": LATEST_PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "coffer", "version": __version__}}})


def probe_discover_message() -> dict:
    """The server/discover Coffer asks first (2026-07-28), carrying the envelope a stateless server requires."""
    envelope = Envelope(MODERN_PROTOCOL_VERSIONS[-1], {}, {"name": "coffer", "version": __version__}, None)
    return {"jsonrpc": "2.0", "id": "coffer-probe", "method": "server/discover",
            "params": stamp_envelope({}, envelope)}


def message_version(message: dict) -> str | None:
    """The 2026-07-28 protocol version a message's envelope names, or None (a handshake-era message)."""
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    version = meta.get(META_PROTOCOL_VERSION) if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version in MODERN_PROTOCOL_VERSIONS else None


def header_value(value) -> str | None:
    """A JSON value as a 2026-07-28 header value (basic/transports "Value Encoding"): a string as it is when it is
    visible ASCII with inner spaces only, else ``=?base64?<UTF-8, base64>?=``; numbers and booleans as JSON writes
    them; None for anything a header cannot carry (null, objects, arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = encode_line(value).decode("ascii").strip()
    elif isinstance(value, str):
        text = value
    else:
        return None
    if text == text.strip(" ") and all(0x20 <= ord(c) <= 0x7e for c in text):
        return text
    return "=?base64?" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "?="


def valid_header_name(name) -> bool:
    """Whether an ``x-mcp-header`` annotation can name a header: a non-empty HTTP token."""
    return isinstance(name, str) and bool(_TOKEN_RE.match(name)) and len(name) <= 100


def standard_headers(message: dict, version: str | None, param_names: dict | None = None) -> dict:
    """The headers a 2026-07-28 client sends with a POST (basic/transports, "Standard MCP Request Headers"):
    MCP-Protocol-Version, Mcp-Method mirroring the method, Mcp-Name mirroring the name or URI a request acts on,
    and Mcp-Param-<Name> for each tool argument its definition marks with ``x-mcp-header`` (``param_names``:
    argument -> header name).  Empty for a handshake-era message (``version`` None)."""
    if version is None:
        return {}
    headers = {"MCP-Protocol-Version": version}
    method = message.get("method")
    if not isinstance(method, str):
        return headers
    headers["Mcp-Method"] = method if method.isascii() and method.isprintable() else header_value(method)
    params = message.get("params") if isinstance(message.get("params"), dict) else {}
    key = NAMED_METHODS.get(method)
    if key is not None and isinstance(params.get(key), str):
        headers["Mcp-Name"] = header_value(params[key])
    arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
    for argument, name in (param_names or {}).items():
        value = header_value(arguments.get(argument))
        if value is not None:
            headers[f"Mcp-Param-{name}"] = value
    return headers


def initialize_or_stream(exchange, url: str, headers: dict, timeout: float) -> tuple[HttpReply, HttpReply | None]:
    """The spec's backwards-compatibility probe, in one place: POST an initialize (Streamable HTTP); when that
    answers 400, 404 or 405, GET an event stream (HTTP+SSE).  ``exchange`` is remote_http or a function with its
    signature (one that adds the server's OAuth token).  Returns the POST's reply (closed) and the GET's (None when
    the POST's answer settled it), whose stream is open: the caller reads it and closes it."""
    posted = exchange("POST", url, body=_probe_initialize(), timeout=timeout, stream=True,
                      headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                               **headers})
    _close_reply(posted)
    if posted.status not in FALLBACK_TO_GET:
        return posted, None
    return posted, exchange("GET", url, timeout=timeout, stream=True, headers={"Accept": "text/event-stream",
                                                                               **headers})


def discover_answer(reply: HttpReply, max_bytes: int = _METADATA_BYTES) -> dict | None:
    """The result of a server/discover probe's streamed 2xx reply when it names a 2026-07-28 version Coffer
    speaks, else None.  Reads the JSON body, or the SSE stream until the answer; closes the reply."""
    try:
        kind = _content_type(reply)
        if kind == "application/json":
            items = [decode_json(reply.stream.read(max_bytes))]
        elif kind == "text/event-stream":
            items = []
            for event in read_sse_events(reply.stream.readline, max_bytes):
                if event.kind == "message" and not event.oversized:
                    items.append(decode_json(event.data))
                    if isinstance(items[-1], dict) and items[-1].get("id") == "coffer-probe":
                        break
        else:
            return None
    except (ValueError, *stream_errors()):
        return None
    finally:
        _close_reply(reply)
    for item in items:
        result = item.get("result") if isinstance(item, dict) and item.get("id") == "coffer-probe" else None
        versions = result.get("supportedVersions") if isinstance(result, dict) else None
        if isinstance(versions, list) and any(v in MODERN_PROTOCOL_VERSIONS for v in versions):
            return result
    return None


def _names_modern_version(reply: HttpReply) -> bool:
    """Whether an error reply is a -32022 whose ``supported`` versions include one Coffer speaks."""
    try:
        error = decode_json(reply.body).get("error") if reply.body.strip() else None
    except (ValueError, AttributeError):
        return False
    data = error.get("data") if isinstance(error, dict) and error.get("code") == -32022 else None
    supported = data.get("supported") if isinstance(data, dict) else None
    return isinstance(supported, list) and any(v in MODERN_PROTOCOL_VERSIONS for v in supported)


class ProbeReplies(NamedTuple):
    """What the transport probe got: ``discovered`` (a 2026-07-28 server's DiscoverResult) settles it; else the
    replies of server/discover, then initialize, then the GET (each None when an earlier answer settled it)."""
    discovered: dict | None
    discover: HttpReply
    initialize: HttpReply | None = None
    stream: HttpReply | None = None


def discover_initialize_or_stream(exchange, url: str, headers: dict, timeout: float) -> ProbeReplies:
    """The probe for a remote server, 2026-07-28 first as for a stdio one: POST server/discover with the headers
    that revision requires; a DiscoverResult naming a version Coffer speaks means a 2026-07-28 Streamable HTTP
    server; anything else -- a refusal included, which initialize then meets in its own words -- falls back to the
    2025-11-25 procedure (initialize_or_stream).  The GET's stream, when there is one, is open: the caller reads
    and closes it."""
    message = probe_discover_message()
    for _ in range(2):  # once more when a -32022 names the version asked (a server may refuse the first try)
        discover = exchange("POST", url, body=encode_line(message), timeout=timeout, stream=True, headers={
            "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
            **standard_headers(message, message_version(message)), **headers})
        if discover.ok:
            result = discover_answer(discover)
            if result is not None:
                return ProbeReplies(result, discover)
        _close_reply(discover)
        if not _names_modern_version(discover):
            break
    posted, stream = initialize_or_stream(exchange, url, headers, timeout)
    return ProbeReplies(None, discover, posted, stream)
