"""Remote transports: Streamable HTTP, legacy HTTP+SSE, and which one a server speaks."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import urllib.parse
from typing import NamedTuple

from coffer_src.jsonrpc import UPSTREAM_ERROR, decode_json, encode_line, request_id_in, rpc_error
from coffer_src.names import origin_text, same_origin, url_origin
from coffer_src.oauth import OAuthCredentials, authorized_exchange
from coffer_src.terminal import ServerLog, printable
from coffer_src.threads import WorkerPool, start_thread
from coffer_src.transport.http import (
    _ERROR_BODY_BYTES,
    _SESSION_ID_RE,
    HttpReply,
    OriginRefused,
    SseCursor,
    SseEvent,
    _close_reply,
    _content_type,
    _messages_of,
    _reply_text,
    abort_stream,
    close_stream,
    discover_initialize_or_stream,
    message_version,
    read_sse_events,
    remote_http,
    settle_stream,
    standard_headers,
    stream_errors,
)
from coffer_src.transport.stdio import Transport, UpstreamFailure

remote_log = logging.getLogger(__name__)


def _end_http_session(url: str, headers: dict, auth, timeout: float) -> None:
    """DELETE a Streamable HTTP session (``headers`` carry its Mcp-Session-Id), as the spec asks of a client that
    is done with one.  Best effort: a server that cannot be told forgets the session on its own."""
    try:
        remote_http("DELETE", url, headers={**headers, **(auth.headers_for(url) if auth else {})}, timeout=timeout,
                    max_bytes=_ERROR_BODY_BYTES)
    except UpstreamFailure:
        pass


class HttpTransport(Transport):
    """An upstream MCP server over Streamable HTTP; every exchange goes through ``authorized_exchange``.

    Each outgoing message is one POST on a bounded worker pool; the reply is either one JSON body or an SSE stream
    that may carry the server's own requests and notifications before the response.  Bodies and events are bounded
    by max_message_bytes.  A request waits until the notifications sent before it have been delivered (so
    notifications/initialized arrives before the first list request), and one whose reply holds no answer fails at
    once -- unless the server closed an SSE stream that named event ids: that stream is resumed as the spec says
    (wait its ``retry``, GET with Last-Event-ID), a few times at most.  An error status whose JSON body answers the
    request is that request's answer (a 2026-07-28 server says -32022 or -32601 with a 400 or 404).  With ``auth``
    (OAuthCredentials) each request carries the server's bearer token, refreshed and retried once on 401.
    ``close`` ends the server's own stream, the streams of requests still waiting, and the pools' workers.

    Both eras: a message whose envelope names 2026-07-28 (and everything after the first one) goes with that
    revision's headers -- MCP-Protocol-Version, Mcp-Method, Mcp-Name, and Mcp-Param-<Name> for the tool arguments
    ``param_names(tool)`` (argument -> header name, from the tool's definition) marks -- and no session; a
    handshake-era message carries the session and the version its initialize agreed.

    Threads: ``send`` runs on any thread; each POST and the handling of its reply on a worker of the pool (so
    ``on_message`` runs on many threads at once); notifications on a pool of one, in order; the server's own GET
    stream on coffer-<name>-sse.  ``_lock`` (under it only the pools' own locks, leaves, are taken, by a submit)
    guards ``_closed``, ``_ended``, ``_released`` and ``_streams``: ``send`` queues a message only while the
    transport is open, so nothing is queued on a closed pool (where it would wait for its timeout); ``on_close`` and
    the release of the pools happen once each, also when the server ended the connection first; a notification keeps
    its place in line (the newest one's ``_delivered`` is the one a later request waits for); and every open reply
    stream is known, so ``close`` can end it.  ``session_id`` and ``protocol_version`` are written once, by the
    initialize reply, before any other request is sent (the Upstream waits for that reply); ``modern_version`` by
    the reply to the first 2026-07-28 request the server answered (the start thread's server/discover, before any
    other request); ``_listening`` only by the initialize reply's worker.
    """

    POOL_SIZE = 64  # requests in flight at once to one server; more wait their turn (notifications never do)
    RESUME_ATTEMPTS = 5  # reconnections of one request's closed SSE stream before it fails
    RESUME_DELAY = 1.0   # seconds before one, when the server named no retry

    speaks_discover = True

    def __init__(self, name, url, headers, on_message, on_close, timeout, on_unusable=None, max_body=64 << 20,
                 auth=None, on_failure=None, param_names=None):
        self.name, self.url, self.headers = name, url, headers
        self.on_message, self.on_close = on_message, on_close
        self.on_failure = on_failure or (lambda request_id, text: on_message(rpc_error(request_id, UPSTREAM_ERROR,
                                                                                      text)))
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.param_names = param_names or (lambda tool: None)
        self.timeout, self.max_body, self.auth = timeout, max_body, auth
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self.modern_version: str | None = None
        self.log = ServerLog(remote_log, name)
        self._lock = threading.Lock()
        self._closed = False        # no more messages: closed, or ended by the server
        self._ended = False         # ended by the server (its session expired, a login is needed): no DELETE
        self._released = False      # the pools and the stream are let go
        self._listening = False
        self._stream = None                      # the server's own GET stream, while open
        self._streams: set = set()               # the reply streams of requests, while read
        self._delivered: threading.Event | None = None   # the last notification's POST is done
        self._stopped = threading.Event()        # set by close: a resumption waiting its retry gives up
        self._pool = WorkerPool(f"coffer-{name}-http", self.POOL_SIZE)
        self._notices = WorkerPool(f"coffer-{name}-notify", 1)  # in order, never behind slow calls

    def start(self) -> None:
        if url_origin(self.url) is None:
            raise UpstreamFailure(f"invalid URL {printable(self.url)[:200]!r}", permanent=True)

    def send(self, message: dict) -> bool:
        if self._closed:
            return False
        body = encode_line(message)
        with self._lock:
            if self._closed:
                return False
            if "id" in message:
                self._pool.submit(self._post, message, body, self._delivered, None)
            else:  # the notification queued last is the one whose delivery later requests wait for
                delivered = self._delivered = threading.Event()
                self._notices.submit(self._post, message, body, None, delivered)
        return True

    def _end(self, reason: str) -> None:
        """The connection is over from the server's side: ``on_close`` once, with ``close_reason`` set (the
        Upstream then closes this transport, which lets its pools go)."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._ended = True
            self.close_reason = reason
        self.on_close()

    def _request_headers(self, message: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        headers.update(self.headers)
        version = message_version(message) if message is not None else None
        if version is None and self.protocol_version is None:
            version = self.modern_version
        if version is not None:  # 2026-07-28: stateless, every POST says what it is
            params = message.get("params") if message is not None else None
            tool = params.get("name") if message is not None and message.get("method") == "tools/call" and \
                isinstance(params, dict) else None
            headers.update(standard_headers(message or {}, version, self.param_names(tool) if tool else None))
            return headers
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        if self.protocol_version:
            headers["MCP-Protocol-Version"] = self.protocol_version
        return headers

    def _post(self, message: dict, body: bytes, after: threading.Event | None,
              delivered: threading.Event | None) -> None:
        if after is not None:
            after.wait(self.timeout)
        try:
            self._exchange(message, body)
        finally:
            if delivered is not None:
                delivered.set()

    def _exchange(self, message: dict, body: bytes) -> None:
        initializing = message.get("method") == "initialize"
        probing = initializing or message.get("method") == "server/discover"
        try:
            reply = authorized_exchange(self.name, self.auth, "POST", self.url, headers=self._request_headers(message),
                                        body=body, timeout=self.timeout, stream=True)
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
            if exc.permanent:
                self._fatal(exc, message)
            return
        if reply.status == 404 and self.session_id:
            _close_reply(reply)
            self.log.warning("HTTP session expired")
            self._end("expired its HTTP session")
            return
        if not reply.ok:
            if self._error_answer(reply, message.get("id")):
                return
            text = f"HTTP {reply.status}: {_reply_text(reply)}".rstrip(": ")
            if initializing and reply.status in (401, 403, 404, 405):
                hints = {401: " (it wants credentials: check --header)", 403: " (the credentials were refused)",
                         404: " (check the URL; an older HTTP+SSE server? add it with --transport sse)",
                         405: " (an older HTTP+SSE server? add it with --transport sse)"}
                self.fatal = UpstreamFailure(text + hints[reply.status], permanent=True)
                text = str(self.fatal)
            self._fail(message, text)
            return
        answered = "id" not in message
        cursor = SseCursor()
        if not self._track(reply.stream):
            _close_reply(reply)
            self._fail(message, "the connection was closed")
            return
        try:
            session = reply.headers.get("mcp-session-id")
            if session and initializing:
                if not _SESSION_ID_RE.match(session):
                    self.fatal = UpstreamFailure("the server sent an invalid Mcp-Session-Id", permanent=True)
                    self._fail(message, str(self.fatal))
                    return
                self.session_id = session
            try:
                answered = self._consume(reply, message.get("id"), cursor, message_version(message)) or answered
            except stream_errors():
                if cursor.last_id is None or probing:
                    raise
            if not answered and cursor.last_id is not None and not probing:
                answered = self._resume(message, cursor)
            if not answered:
                kind = _content_type(reply) or "no content type"
                text = f"the server's reply ({printable(kind)[:60]}) held no answer"
                if initializing and kind not in ("application/json", "text/event-stream"):
                    self.fatal = UpstreamFailure(f"{text}: not an MCP endpoint", permanent=True)
                self._fail(message, text)
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
        except stream_errors() as exc:
            self._fail(message, f"{self.name} broke off its reply: {exc.__class__.__name__}")
        finally:
            self._untrack(reply.stream)
            _close_reply(reply)

    def _track(self, stream) -> bool:
        with self._lock:
            if self._released:
                return False
            self._streams.add(stream)
        return True

    def _untrack(self, stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def _error_answer(self, reply: HttpReply, request_id) -> bool:
        """An error status whose JSON body is the JSON-RPC error answering ``request_id``: delivered as the answer
        (a 2026-07-28 server answers an unsupported version, a missing envelope or an unknown method this way)."""
        if request_id is None or _content_type(reply) != "application/json" or not reply.body.strip():
            return False
        try:
            payload = decode_json(reply.body)
        except ValueError:
            return False
        items = payload if isinstance(payload, list) else [payload]
        answer = next((item for item in items if isinstance(item, dict) and item.get("id") == request_id
                       and "method" not in item and isinstance(item.get("error"), dict)), None)
        if answer is None:
            return False
        self.on_message(answer)
        return True

    def _fatal(self, exc: UpstreamFailure, message: dict) -> None:
        """Retrying cannot fix this (a login only a person can give, an origin refused).  At start the Upstream
        reports it at once; once running, the connection ends so the server's status says so too (its restart
        then fails at once, for the same reason)."""
        self.fatal = exc
        if message.get("method") not in ("initialize", "server/discover"):
            self._end(str(exc))

    def _consume(self, reply: HttpReply, request_id=None, cursor: SseCursor | None = None,
                 version: str | None = None) -> bool:
        """Deliver what a reply holds; True when it held the answer to ``request_id`` (a request in the
        2026-07-28 ``version``, when it names one)."""
        answered = False
        kind = _content_type(reply)
        if kind == "application/json":
            data = reply.stream.read(self.max_body + 1)
            if len(data) > self.max_body:
                raise UpstreamFailure(f"a reply larger than max_message_bytes ({self.max_body} bytes)")
            if data.strip():
                for item in _messages_of(data, self.log, self.on_unusable):
                    answered = self._deliver(item, request_id, version) or answered
        elif kind == "text/event-stream":
            for event in read_sse_events(reply.stream.readline, self.max_body, cursor):
                if event.oversized:
                    self.on_unusable(event.data, f"an event of {event.oversized} bytes, more than "
                                                 f"max_message_bytes ({self.max_body})")
                    answered = answered or request_id_in(event.data) == request_id
                elif event.kind == "message":
                    for item in _messages_of(event.data, self.log, self.on_unusable):
                        answered = self._deliver(item, request_id, version) or answered
                if answered and request_id is not None:
                    break  # the answer ends the request's stream (a resumed GET stays open otherwise)
        return answered

    def _resume(self, message: dict, cursor: SseCursor) -> bool:
        """The server closed the request's SSE stream before the answer, having named event ids: reconnect the
        way the transport spec says -- wait the ``retry`` it last asked for, then GET with Last-Event-ID --
        until the answer arrives, at most RESUME_ATTEMPTS times.  True when it did."""
        request_id = message.get("id")
        for _ in range(self.RESUME_ATTEMPTS):
            if self._stopped.wait(self.RESUME_DELAY if cursor.retry is None else min(cursor.retry, self.timeout)):
                return False
            headers = self._request_headers()
            headers["Accept"] = "text/event-stream"
            headers.pop("Content-Type", None)
            headers["Last-Event-ID"] = cursor.last_id
            self.log.debug("resuming the stream of request %s after event %s", request_id, cursor.last_id)
            reply = authorized_exchange(self.name, self.auth, "GET", self.url, headers=headers, timeout=self.timeout,
                                        stream=True)
            if not reply.ok or _content_type(reply) != "text/event-stream" or not self._track(reply.stream):
                _close_reply(reply)
                raise UpstreamFailure(f"its stream closed before the answer and could not be resumed (GET answered "
                                      f"HTTP {reply.status})")
            try:
                if self._consume(reply, request_id, cursor, message_version(message)):
                    return True
            except stream_errors():
                pass  # a broken resumed stream is resumed again, as a closed one is
            finally:
                self._untrack(reply.stream)
                _close_reply(reply)
        return False

    def _deliver(self, item: dict, request_id=None, version: str | None = None) -> bool:
        is_answer = request_id is not None and item.get("id") == request_id and "method" not in item
        if is_answer and isinstance(item.get("result"), dict) and self.protocol_version is None and \
                self.modern_version is None:
            versions = item["result"].get("supportedVersions")
            if version is not None:
                if isinstance(versions, list) and version in versions:
                    self.modern_version = version  # a DiscoverResult naming it: the server's era
            elif isinstance(item["result"].get("protocolVersion"), str):
                self.protocol_version = item["result"]["protocolVersion"][:32]  # the initialize reply only
                self._start_listening()
        self.on_message(item)
        return is_answer

    def _start_listening(self) -> None:
        """Open the optional GET stream on which the server sends requests and notifications of its own."""
        if self._listening:
            return
        self._listening = True

        def listen():
            headers = self._request_headers()
            headers["Accept"] = "text/event-stream"
            if self._delivered is not None:
                self._delivered.wait(self.timeout)  # after notifications/initialized has gone out
            try:
                reply = authorized_exchange(self.name, self.auth, "GET", self.url, headers=headers,
                                            timeout=self.timeout, stream=True)
                if reply.ok and reply.stream is not None:
                    self._stream = reply.stream
                    settle_stream(reply.stream)
                    try:
                        if not self._closed:
                            self._consume(reply)
                    finally:
                        self._stream = None
                        _close_reply(reply)
                else:
                    _close_reply(reply)
            except (UpstreamFailure, *stream_errors()) as exc:
                self.log.debug("no server stream: %s", exc)  # 405: this server has none

        start_thread(listen, f"coffer-{self.name}-sse")

    def close(self, grace: float = 2.0) -> None:
        with self._lock:
            if self._released:
                return
            self._released = self._closed = True
            ended = self._ended
            streams, self._streams = list(self._streams), set()
        self._stopped.set()
        for stream in [self._stream, *streams]:
            if stream is not None:
                abort_stream(stream)
        self._pool.close()
        self._notices.close()
        if self.session_id and not ended:  # a session the server ended needs no DELETE
            _end_http_session(self.url, self._request_headers(), self.auth, grace)


# -- legacy HTTP+SSE --------------------------------------------------------------------------------------------

def checked_sse_endpoint(event: SseEvent, stream_url: str, configured_url: str) -> str:
    """The URL an HTTP+SSE stream's ``endpoint`` event names, if Coffer may POST to it: text, a URL, and on the
    configured origin (it receives the same credentials); else UpstreamFailure or OriginRefused."""
    try:
        text = event.data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UpstreamFailure("the SSE endpoint event is not UTF-8 text") from None
    if event.oversized or not text or len(text) > 4096 or not text.isprintable():
        raise UpstreamFailure("the SSE endpoint event does not hold a URL")
    endpoint = urllib.parse.urljoin(stream_url, text)
    if not same_origin(endpoint, configured_url):
        raise OriginRefused(f"the SSE stream named an endpoint on {origin_text(endpoint)}, not on "
                            f"{origin_text(configured_url)}: refused, credentials never leave the configured origin")
    return urllib.parse.urldefrag(endpoint)[0]


class SseTransport(Transport):
    """An upstream MCP server over the 2024-11-05 HTTP+SSE transport: one long GET stream carries everything the
    server says; everything Coffer says is POSTed to the endpoint the stream announced first, which must be on
    the configured origin (it receives the same credentials).

    Threads: ``start`` runs on the upstream's start thread (opens the stream, waits for the endpoint);
    coffer-<name>-sse reads the stream until it ends; coffer-<name>-post sends the POSTs one at a time, in the
    order ``send`` (any thread) queued them, so initialize, its notification and what follows keep their order.
    The transport defines no resumption: when the stream drops, the session is gone.  The transport then calls
    ``on_close`` once with ``close_reason`` set; the Upstream fails what was in flight (not retried: a tool call
    may have run) and starts a new session, and requests that arrive meanwhile wait for it.  ``_lock`` (a leaf)
    guards ``_closed`` and ``_close_signalled`` and orders ``send`` against ``close`` (nothing is queued behind the
    writer's end marker); ``endpoint`` moves only on the reader thread, and the writer reads whichever is current.
    """

    def __init__(self, name, url, headers, on_message, on_close, timeout, auth=None,
                 max_message_bytes: int = 64 << 20, on_failure=None, on_unusable=None):
        self.name, self.url, self.headers = name, url, dict(headers)
        self.on_message, self.on_close = on_message, on_close
        self.on_failure = on_failure or (lambda request_id, text: on_message(rpc_error(
            request_id, UPSTREAM_ERROR, f"'{name}': {text}")))
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.timeout = timeout
        self.auth = auth
        self.max_message_bytes = max_message_bytes
        self.endpoint: str | None = None
        self.close_reason: str | None = None
        self.fatal: UpstreamFailure | None = None  # a permanent failure met (a needed login, a refused origin)
        self.pid = None
        self.log = ServerLog(remote_log, name)
        self._stream = self._stream_url = None
        self._events = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._close_signalled = False

    def start(self) -> None:
        if url_origin(self.url) is None:
            raise UpstreamFailure(f"unsupported URL {self.url!r}")
        reply = authorized_exchange(self.name, self.auth, "GET", self.url, timeout=self.timeout, stream=True,
                                    headers={"Accept": "text/event-stream", "Cache-Control": "no-cache",
                                             **self.headers})
        if not reply.ok:
            _close_reply(reply)
            raise UpstreamFailure(f"GET {origin_text(self.url)} answered HTTP {reply.status}: {_reply_text(reply)}")
        if _content_type(reply) != "text/event-stream":
            _close_reply(reply)
            raise UpstreamFailure(f"{self.url} is not an SSE stream (Content-Type: "
                                  f"{printable(_content_type(reply))[:60] or 'none'})")
        self._stream, self._stream_url = reply.stream, reply.url
        readline = until_endpoint(reply.stream.readline, lambda: self.endpoint is not None, self.timeout, self.url)
        self._events = read_sse_events(readline, self.max_message_bytes)
        try:
            # The endpoint must come first, within the start timeout (the socket's timeout until settled).
            for event in self._events:
                if event.kind == "endpoint":
                    self.endpoint = self._checked_endpoint(event, reply.url)
                    break
                self.log.warning("ignored a %r event that came before the endpoint", event.kind)
        except UpstreamFailure:
            _close_reply(reply)
            raise
        except stream_errors() as exc:
            _close_reply(reply)
            raise UpstreamFailure(f"the SSE stream of {origin_text(self.url)} broke before announcing its "
                                  f"endpoint: {exc.__class__.__name__}") from None
        if self.endpoint is None:
            _close_reply(reply)
            raise UpstreamFailure(f"the SSE stream of {origin_text(self.url)} ended before announcing its endpoint")
        with self._lock:
            if self._closed:
                _close_reply(reply)
                raise UpstreamFailure("stopped while starting")
        settle_stream(reply.stream)
        start_thread(self._read, f"coffer-{self.name}-sse")
        start_thread(self._write, f"coffer-{self.name}-post")

    def _checked_endpoint(self, event: SseEvent, stream_url: str) -> str:
        return checked_sse_endpoint(event, stream_url, self.url)

    def send(self, message: dict) -> bool:
        with self._lock:
            if self._closed or self.endpoint is None:
                return False
            self._outbox.put(message)
        return True

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None or self._closed:
                return
            try:
                self._post(message)
            except Exception:  # noqa: BLE001 - one message is lost, not the writer
                self.log.exception("error sending a message")
                self._fail(message, "internal error while sending it")

    def _post(self, message: dict) -> None:
        try:
            body = encode_line(message)
        except ValueError as exc:
            self._fail(message, f"cannot encode the message: {exc}")
            return
        if len(body) > self.max_message_bytes:
            self._fail(message, f"message larger than {self.max_message_bytes} bytes")
            return
        try:
            reply = authorized_exchange(self.name, self.auth, "POST", self.endpoint, body=body,
                                        timeout=self.timeout, max_bytes=_ERROR_BODY_BYTES,
                                        headers={"Content-Type": "application/json", **self.headers})
        except UpstreamFailure as exc:
            self._fail(message, str(exc))
            if getattr(exc, "permanent", False):
                self.fatal = exc
                self._lost(str(exc), in_flight_note=False)
            return
        if reply.ok:
            return
        if reply.status in (404, 410):  # the server no longer knows this session (it restarted, or timed it out)
            self._fail(message, "the server forgot the SSE session")
            self._lost(f"lost its SSE session (POST answered HTTP {reply.status})")
            return
        self._fail(message, f"HTTP {reply.status}: {_reply_text(reply)}")

    def _read(self) -> None:
        reason = "ended its SSE stream"
        try:
            for event in self._events:
                if event.oversized:
                    self._oversized(event)
                elif event.kind == "message":
                    for item in _messages_of(event.data, self.log, self.on_unusable):
                        try:
                            self.on_message(item)
                        except Exception:  # noqa: BLE001 - a routing bug must not end the stream
                            self.log.exception("error handling a message")
                elif event.kind == "endpoint":
                    self.endpoint = self._checked_endpoint(event, self._stream_url)  # moves within the origin only
        except UpstreamFailure as exc:
            reason = str(exc)
        except stream_errors() as exc:
            reason = f"dropped its SSE stream ({exc.__class__.__name__})"
        finally:
            close_stream(self._stream)
        self._lost(reason)

    def _oversized(self, event: SseEvent) -> None:
        self.on_unusable(event.data, f"an event of {event.oversized} bytes, more than max_message_bytes "
                                     f"({self.max_message_bytes})")

    def _lost(self, reason: str, in_flight_note: bool = True) -> None:
        with self._lock:
            if self._closed or self._close_signalled:
                return
            self._close_signalled = True
            self._closed = True
            self.close_reason = reason + ("; calls in flight failed (not retried: a tool call may have run) and a "
                                          "new session starts" if in_flight_note else "")
        self._outbox.put(None)
        if self._stream is not None:
            abort_stream(self._stream)
        self.log.warning("%s", reason)
        self.on_close()

    def close(self, grace: float = 2.0) -> None:
        """End the session: the server sees its stream close.  (HTTP+SSE has no explicit session end.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._outbox.put(None)
        if self._stream is not None:
            abort_stream(self._stream)


# -- transport "auto": the spec's backwards-compatibility procedure --------------------------------------------

def until_endpoint(readline, announced, timeout: float, url: str):
    """``readline`` bounded until ``announced()``: a server must not trickle comments or other events forever
    (each within the socket timeout) instead of naming its endpoint; at most 1 MiB or ``timeout`` seconds."""
    deadline, seen = time.monotonic() + timeout, [0]

    def bounded(limit: int) -> bytes:
        line = readline(limit)
        if not announced():
            seen[0] += len(line)
            if seen[0] > 1 << 20 or time.monotonic() > deadline:
                raise UpstreamFailure(f"the SSE stream of {origin_text(url)} did not announce its endpoint within "
                                      f"{timeout:g} s")
        return line

    return bounded


class TransportProbe(NamedTuple):
    kind: str       # "http" or "sse"
    detail: str     # what answered, for the user


def probe_transport(name: str, url: str, headers: dict, auth=None, timeout: float = 10.0) -> TransportProbe:
    """Which transport ``url`` speaks: first a 2026-07-28 server/discover, whose DiscoverResult means Streamable
    HTTP in that revision; else the MCP 2025-11-25 backwards-compatibility procedure: POST an initialize; a 2xx
    means Streamable HTTP; a 400, 404 or 405 means try GET, and an SSE stream that opens with an ``endpoint``
    event means HTTP+SSE.  Raises NeedsLogin or UpstreamFailure (saying what each attempt got)."""
    if url_origin(url) is None:
        raise UpstreamFailure(f"unsupported URL {url!r}")
    probed = discover_initialize_or_stream(functools.partial(authorized_exchange, name, auth), url, headers,
                                           timeout)
    if probed.discovered is not None:
        return TransportProbe("http", "Streamable HTTP (MCP 2026-07-28)")
    reply, stream = probed.initialize or probed.discover, probed.stream
    if not reply.ok and probed.discover.status in (401, 403) and (stream is None or not stream.ok):
        if stream is not None:  # refused, and nothing else answered: the refusal is the answer (2026-07-28)
            _close_reply(stream)
        reply, stream = probed.discover, None
    if reply.ok:
        if _content_type(reply) not in ("application/json", "text/event-stream"):
            raise UpstreamFailure(f"{url} answered an MCP initialize with {printable(_content_type(reply))[:60]}"
                                  " content: not an MCP endpoint")
        session = reply.headers.get("mcp-session-id")
        if session and len(session) < 1024:  # the probe's session is not the one the transport will use
            _end_http_session(url, {**headers, "Mcp-Session-Id": session}, auth, min(timeout, 5.0))
        return TransportProbe("http", "Streamable HTTP")
    if stream is None:
        hint = {401: " (it wants credentials: check --header, or `coffer auth`)",
                403: " (the credentials were refused)"}.get(reply.status, "")
        raise UpstreamFailure(f"{url} answered an MCP initialize with HTTP {reply.status}: {_reply_text(reply)}"
                              f"{hint}", permanent=reply.status in (401, 403))
    post_status = reply.status
    try:
        if stream.ok and _content_type(stream) == "text/event-stream":
            for event in read_sse_events(until_endpoint(stream.stream.readline, lambda: False, timeout, url),
                                         64 << 10):
                if event.kind == "endpoint":
                    checked_sse_endpoint(event, stream.url, url)
                    return TransportProbe("sse", "HTTP+SSE (the 2024-11-05 transport)")
                break
        got = f"HTTP {stream.status} {printable(_content_type(stream))[:60]}".strip()
    except stream_errors() as exc:
        got = f"a broken stream ({exc.__class__.__name__})"
    finally:
        _close_reply(stream)
    raise UpstreamFailure(f"{url} speaks neither Streamable HTTP (POST initialize: HTTP {post_status}) nor "
                          f"HTTP+SSE (GET: {got}, no endpoint event): check the URL", permanent=True)


class AutoTransport(Transport):
    """Transport "auto": on start, ask the server which transport it speaks (probe_transport), then be that
    transport.  ``detected`` ('http' or 'sse') is what the gateway writes to the vault, so the next start goes
    straight to it.  Same surface and threads as the transport it becomes."""

    def __init__(self, name, url, headers, auth, timeout, make):
        self.name, self.url, self.headers, self.auth, self.timeout = name, url, headers, auth, timeout
        self.log = ServerLog(remote_log, name)
        self._make = make       # kind -> HttpTransport or SseTransport, with the upstream's callbacks
        self.detected: str | None = None
        self.inner = None
        self.pid = None
        self._closed = False

    def start(self) -> None:
        probe = probe_transport(self.name, self.url, self.headers, self.auth, self.timeout)
        if self._closed:
            raise UpstreamFailure("stopped while starting")
        self.detected = probe.kind
        self.log.info("speaks %s", probe.detail)
        self.inner = self._make(probe.kind)
        self.inner.start()
        if self._closed:  # stopped while the probe ran: do not leave the session open
            self.inner.close(0.5)

    def send(self, message: dict) -> bool:
        return self.inner is not None and self.inner.send(message)

    @property
    def speaks_discover(self) -> bool:
        return getattr(self.inner, "speaks_discover", False)

    @property
    def close_reason(self):
        return getattr(self.inner, "close_reason", None)

    @property
    def fatal(self):
        return getattr(self.inner, "fatal", None)

    def close(self, grace: float = 2.0) -> None:
        self._closed = True
        if self.inner is not None:
            self.inner.close(grace)


def make_remote_transport(name: str, kind: str, url: str, headers: dict, store, on_message, on_close,
                          timeout: float, max_message_bytes: int = 64 << 20, on_failure=None, on_unusable=None,
                          param_names=None):
    """The transport for a remote server (``kind`` is the vault's transport: auto, http or sse); ``param_names``
    (tool name -> {argument: header name}) is how a 2026-07-28 Streamable HTTP request finds the arguments its
    tool's definition mirrors into headers.

    OAuth applies unless the server is configured with its own Authorization header: that header is the user's
    choice of credentials and is sent as is (a 401 then reports that it was refused).
    """
    has_own_authorization = any(key.lower() == "authorization" for key in headers)
    auth = None if has_own_authorization or store is None else OAuthCredentials(name, url, store)

    def make(actual: str):
        if actual == "sse":
            return SseTransport(name, url, headers, on_message, on_close, timeout, auth, max_message_bytes,
                                on_failure, on_unusable)
        return HttpTransport(name, url, headers, on_message, on_close, timeout, on_unusable, max_message_bytes,
                             auth=auth, on_failure=on_failure, param_names=param_names)

    if kind == "auto":
        return AutoTransport(name, url, headers, auth, min(timeout, 30.0), make)
    return make(kind)
