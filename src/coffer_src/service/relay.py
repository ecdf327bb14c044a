"""Relay: `coffer serve` as a thin pipe between one client and the shared service.

The relay copies the client's bytes to the service and the service's bytes to the client.  It reads of them only
what it needs to keep the client's session alive across a service that dies or hands over to a newer version:
the id and method of each client request (to fail the ones in flight when the service dies), the lines that set
the session up (initialize, notifications/initialized, logging/setLevel, resources/subscribe, listen streams:
replayed to a new service under ids of the relay's own, their answers swallowed), and the id at the head of each
answer from the service (whose encoder writes ``{"jsonrpc":"2.0","id":...`` first, see ``answered_id``).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from typing import Callable

from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    encode_line,
    request_id_in,
    request_ids_in_unreadable,
    rpc_error,
    valid_request_id,
)
from coffer_src.service.channel import (
    PIPES_SUPPORTED,
    ChannelError,
    StartLock,
    connect,
    control,
    send_session_pipes,
)

relay_log = logging.getLogger(__name__)

#: A client line longer than this is passed on without being parsed (its id is read from its head).
PARSE_LIMIT = 1 << 20
#: Client requests whose lines set the session up: replayed, in order, to a service the relay re-attaches to.
SETUP_METHODS = ("initialize", "logging/setLevel", "resources/subscribe", "resources/unsubscribe")
_ANSWER_HEAD = b'{"jsonrpc":"2.0","id":'
#: How the service's own lines to the relay begin (a handover notice).
_CONTROL_HEAD = b'{"coffer"'
_DECODER = json.JSONDecoder()


def answered_id(line: bytes):
    """The id a service line answers, or None when it is not an answer (a notification, a request to the client,
    an error with a null id).  The service writes every answer as {"jsonrpc":"2.0","id":<id>,"result"|"error":...}
    so this reads a few bytes, never the result."""
    if not line.startswith(_ANSWER_HEAD):
        return None
    text = line[len(_ANSWER_HEAD):len(_ANSWER_HEAD) + 600].decode("utf-8", "replace")
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    rest = text[end:end + 9]
    if not (rest.startswith(',"result"') or rest.startswith(',"error"')) or not valid_request_id(value):
        return None
    return value


class StandaloneWanted(Exception):  # noqa: N818 - a decision, not a failure: the caller serves in-process
    """The user's serve_mode setting says standalone: this `coffer serve` runs the gateway itself."""


class Attachment:
    """One connection to a service: its socket (and the session's pipes, when the service took them: see
    service/channel.py) and the client requests it has not answered yet.  OSError from the constructor when the
    service went away before it had its pipes."""

    def __init__(self, conn: socket.socket, hello: dict):
        self.conn = conn
        self.hello = hello
        # Ids are keys as they are: valid_request_id admits only str and int (no bool, no float), which never
        # compare equal across types.
        self.pending: set[str | int] = set()     # ids of client requests sent on this connection, unanswered
        self.swallow: set[str | int] = set()     # ids of replayed requests whose answers the client must not see
        self.partial = b""
        self.initial = hello.pop("_rest", b"")   # service bytes that came with its hello
        self.draining = False                    # handed over: answers only, no new requests
        self.pipes: tuple[int, int] | None = None  # (to the service, from it)
        if hello.get("pipes") is True and PIPES_SUPPORTED:
            try:
                self.pipes = send_session_pipes(conn)
            except OSError:
                conn.close()
                raise

    def fileno(self):
        """What the relay's selector waits on for the service's bytes."""
        return self.pipes[1] if self.pipes else self.conn

    def send(self, data: bytes) -> None:
        if self.pipes is None:
            self.conn.sendall(data)
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self.pipes[0], view):]

    def recv(self, size: int) -> bytes:
        try:
            return os.read(self.pipes[1], size) if self.pipes else self.conn.recv(size)
        except OSError:
            return b""

    def close(self) -> None:
        if self.pipes is not None:
            for fd in self.pipes:
                os.close(fd)
            self.pipes = None
        self.conn.close()


class Relay:
    """`coffer serve` attached to the service: the client's stdin and stdout on one side, the service on the other.

    One thread, the caller's, runs everything (a selector over the client's input and the service connections),
    except on Windows, where a pipe cannot be selected: a second thread reads the client there.
    """

    def __init__(self, home: str, version: str, build: str, start_service: Callable[[bool], None],
                 client_in=None, client_out=None, attach_timeout: float = 15.0, honour_setting: bool = True,
                 profile: str | None = None):
        self.home = home
        self.profile = profile                # the client's profile (`coffer serve --profile`), in every hello
        self.version, self.build = version, build
        self.start_service = start_service
        self.client_in = client_in if client_in is not None else os.fdopen(0, "rb", buffering=0, closefd=False)
        self.client_out = client_out if client_out is not None else os.fdopen(1, "wb", buffering=0, closefd=False)
        self.attach_timeout = attach_timeout
        self.honour_setting = honour_setting  # the serve_mode setting may send this serve standalone
        self.current: Attachment | None = None
        self.draining: list[Attachment] = []
        self.setup: list[dict] = []           # the client's session-setup requests, in order, for a replay
        self.initialized_line: bytes | None = None
        self.listens: dict[str | int, bytes] = {}  # open subscriptions/listen requests, by id
        self.client_partial = b""
        self.client_passing = False           # the client line being read is too long to parse: passed on as is
        self._replay_seq = 0
        self._out_lock = threading.Lock()

    # -- attaching ----------------------------------------------------------------------------------------------
    def _hello(self, handover: bool) -> dict:
        hello = {"coffer": 1, "kind": "session", "version": self.version, "build": self.build, "pid": os.getpid(),
                 "handover": handover, "pipes": PIPES_SUPPORTED}
        return {**hello, "profile": self.profile} if self.profile is not None else hello

    def _connect(self) -> tuple | None:
        """connect() with this relay's hello; ChannelError when the service refuses the session's profile (an
        unknown one: `coffer serve --profile` then fails with the service's words)."""
        connected = connect(self.home, self._hello(False))
        if connected is not None and connected[1].get("refused") == "profile":
            connected[0].close()
            raise ChannelError(str(connected[1].get("error") or "the service refused this profile"))
        return connected

    @staticmethod
    def _attached(conn: socket.socket, answer: dict) -> Attachment | None:
        """An attachment to the service that answered, or None when it went away before it had the pipes."""
        try:
            return Attachment(conn, answer)
        except OSError:
            return None

    def attach(self, first: bool) -> Attachment:
        """Connect to the service, starting it if none runs.  The first attach of a relay newer than (or
        different from) the running service asks that service to hand over, and starts one of its own."""
        deadline = time.monotonic() + self.attach_timeout
        connected = self._connect()
        if connected is not None:
            conn, answer = connected
            if first and self.honour_setting and answer.get("serve_mode") == "standalone":
                conn.close()
                raise StandaloneWanted()
            if not first or answer.get("build") == self.build:
                attachment = self._attached(conn, answer)
                if attachment is not None:
                    return attachment
            conn.close()
        with StartLock(self.home):
            connected = self._connect()
            if connected is not None:
                conn, answer = connected
                if not first or answer.get("build") == self.build:
                    attachment = self._attached(conn, answer)
                    if attachment is not None:
                        return attachment
                conn.close()
                relay_log.info("the running Coffer service is version %s; this is %s: it hands over",
                               answer.get("version"), self.version)
                control(self.home, {"op": "handover", "version": self.version, "build": self.build})
            self.start_service(first and self.honour_setting)
            while time.monotonic() < deadline:
                connected = self._connect()
                attachment = self._attached(*connected) if connected is not None else None
                if attachment is not None:
                    return attachment
                time.sleep(0.02)
        raise ChannelError(f"the Coffer service did not start within {self.attach_timeout:g}s (its log: "
                           f"{os.path.join(self.home, 'logs', 'service.log')}); `coffer serve --standalone` runs "
                           "without it")

    def _replay(self, attachment: Attachment) -> None:
        """A new service knows nothing of this session: send it what set the session up, under ids of the relay's
        own, and swallow the answers (the client has had them)."""
        lines = []
        for request in self.setup:
            self._replay_seq += 1
            replay_id = f"coffer-relay-{self._replay_seq}"
            attachment.swallow.add(replay_id)
            lines.append(encode_line({**request, "id": replay_id}))
            if request.get("method") == "initialize" and self.initialized_line is not None:
                lines.append(self.initialized_line)
        lines.extend(self.listens.values())
        attachment.pending.update(self.listens)
        if lines:
            attachment.send(b"".join(lines))

    # -- the client ---------------------------------------------------------------------------------------------
    def write_client(self, data: bytes) -> None:
        with self._out_lock:
            view = memoryview(data)
            while view:
                written = self.client_out.write(view)
                view = view[written or 0:]

    def _from_client(self, data: bytes) -> None:
        """Pass the client's bytes on, then note each complete line (the service has the request sooner, and its
        answer is read only after this returns); a line longer than PARSE_LIMIT is passed on as it arrives, its id
        read from its head."""
        out, seen = [], []
        while data:
            end = data.find(b"\n")
            if end < 0:
                if self.client_passing:
                    out.append(data)
                else:
                    self.client_partial += data
                    if len(self.client_partial) > PARSE_LIMIT:
                        seen.append((self.client_partial[:4096], False))
                        out.append(self.client_partial)
                        self.client_partial, self.client_passing = b"", True
                break
            piece, data = data[:end + 1], data[end + 1:]
            if self.client_passing:
                self.client_passing = False
            else:
                piece, self.client_partial = self.client_partial + piece, b""
                seen.append((piece[:-1], True))
            out.append(piece)
        if not out:
            return
        attachment = self.current
        try:
            attachment.send(b"".join(out))
            lost = False
        except OSError:
            lost = True
        for line, whole in seen:
            self._note_client_line(line, whole)
        if lost:
            self._service_lost(attachment)  # its requests (these among them) fail; the client may send them again

    def _note_client_line(self, line: bytes, whole: bool = True) -> None:
        """What of a client line the relay keeps: a request's id (and, for session setup, the request)."""
        if not line.strip():
            return
        if not whole or len(line) > PARSE_LIMIT:
            msg_id = request_id_in(line[:4096])
            if msg_id is not None and self.current is not None:
                self.current.pending.add(msg_id)
            return
        if b'"method"' not in line:
            return  # an answer to a request of the service's: nothing to keep
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # the service answers it with an error, under each request's own id
            if self.current is not None:
                for msg_id in request_ids_in_unreadable(line):
                    self.current.pending.add(msg_id)
            return
        for item in message if isinstance(message, list) else [message]:
            if not isinstance(item, dict):
                continue
            method, msg_id = item.get("method"), item.get("id")
            if not isinstance(method, str):
                continue
            if "id" in item and valid_request_id(msg_id):
                if self.current is not None:
                    self.current.pending.add(msg_id)
                if method in SETUP_METHODS:
                    self.setup.append(item)
                elif method == "subscriptions/listen":
                    self.listens[msg_id] = line + b"\n"
            elif method == "notifications/initialized":
                self.initialized_line = line + b"\n"
            elif method == "notifications/cancelled":
                params = item.get("params") if isinstance(item.get("params"), dict) else {}
                cancelled = params.get("requestId")
                if not valid_request_id(cancelled):
                    continue
                self.listens.pop(cancelled, None)
                for attachment in [self.current, *self.draining]:
                    if attachment is not None:
                        attachment.pending.discard(cancelled)

    # -- the service ----------------------------------------------------------------------------------------------
    def _from_service(self, attachment: Attachment, data: bytes) -> None:
        buffered = attachment.partial + data
        end = buffered.rfind(b"\n")
        if end < 0:
            attachment.partial = buffered
            return
        complete, attachment.partial = buffered[:end + 1], buffered[end + 1:]
        lines = complete.split(b"\n")
        lines.pop()
        if not attachment.swallow and _CONTROL_HEAD not in complete:
            # Nothing to hold back: the client has the bytes first, the bookkeeping comes after.
            self.write_client(complete)
            for line in lines:
                answered = answered_id(line)
                if answered is not None:
                    attachment.pending.discard(answered)
        else:
            out = []
            for line in lines:
                if line.startswith(_CONTROL_HEAD):
                    self._control_line(attachment, line)
                    continue
                answered = answered_id(line)
                if answered is not None:
                    attachment.pending.discard(answered)
                    if answered in attachment.swallow:
                        attachment.swallow.discard(answered)
                        continue
                out.append(line + b"\n")
            if out:
                self.write_client(b"".join(out))
        if attachment.draining and not attachment.pending:
            self._close(attachment)

    def _control_line(self, attachment: Attachment, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return
        if message.get("coffer") == "handover" and attachment is self.current:
            relay_log.info("the Coffer service hands over to a newer one; moving this session")
            attachment.draining = True
            self.draining.append(attachment)
            self.current = None
            self._adopt(self.attach(first=False))
            if not attachment.pending:
                self._close(attachment)

    def _close(self, attachment: Attachment) -> None:
        if attachment in self.draining:
            self.draining.remove(attachment)
        try:
            self.selector.unregister(attachment.fileno())
        except (KeyError, ValueError, AttributeError):
            pass
        attachment.close()

    def _service_lost(self, attachment: Attachment) -> None:
        """The service went away (killed, crashed): fail what it had in flight, start a new one, re-attach."""
        if attachment is not self.current:
            for msg_id in attachment.pending:
                self._fail_request(msg_id)
            self._close(attachment)
            return
        relay_log.warning("the Coffer service went away; starting it again")
        failed = [msg_id for msg_id in attachment.pending
                  if msg_id not in self.listens and msg_id not in attachment.swallow]
        self._close(attachment)
        for msg_id in failed:
            self._fail_request(msg_id)
        self.current = None
        self._adopt(self.attach(first=False))

    def _adopt(self, attachment: Attachment) -> None:
        """Make a new connection the current one: replay the session's setup, tell the client lists may differ."""
        self.current = attachment
        self.selector.register(attachment.fileno(), selectors.EVENT_READ, attachment)
        self._replay(attachment)
        self._notify_lists_changed()
        if attachment.initial:
            self._from_service(attachment, attachment.initial)

    def _fail_request(self, msg_id) -> None:
        self.write_client(encode_line(rpc_error(msg_id, INTERNAL_ERROR, "the Coffer service stopped while this "
                                                "request was in flight; it has been restarted: try again")))

    def _notify_lists_changed(self) -> None:
        """A new service may list something else: a handshake-era client hears it at once (a 2026-07-28 client
        hears it on its replayed listen streams)."""
        if self.initialized_line is None:
            return
        self.write_client(b"".join(encode_line({"jsonrpc": "2.0", "method": f"notifications/{kind}/list_changed"})
                                   for kind in ("tools", "prompts", "resources")))

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.selector = selectors.DefaultSelector()
        self.current = self.attach(first=True)
        self.selector.register(self.current.fileno(), selectors.EVENT_READ, self.current)
        if self.current.initial:
            self._from_service(self.current, self.current.initial)
        client_fd = self.client_in.fileno()
        threaded = os.name != "posix"
        if threaded:
            reader_sock, writer_sock = socket.socketpair()
            threading.Thread(target=self._pump_client, args=(writer_sock,), daemon=True,
                             name="coffer-relay-client").start()
            self.selector.register(reader_sock, selectors.EVENT_READ, "client")
        else:
            self.selector.register(client_fd, selectors.EVENT_READ, "client")
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.data == "client":
                        data = key.fileobj.recv(1 << 16) if threaded else os.read(client_fd, 1 << 16)
                        if not data:
                            return 0  # the client closed its end: the session is over
                        self._from_client(data)
                        continue
                    attachment = key.data
                    data = attachment.recv(1 << 16)
                    if data:
                        self._from_service(attachment, data)
                    else:
                        self._service_lost(attachment)
        except (BrokenPipeError, ConnectionResetError) as exc:
            relay_log.info("the client went away (%s)", exc.__class__.__name__)
            return 0
        finally:
            for attachment in [self.current, *self.draining]:
                if attachment is not None:
                    attachment.close()

    def _pump_client(self, sink: socket.socket) -> None:
        """Windows: the client's pipe cannot be selected, so a thread copies it into a socket that can."""
        try:
            while True:
                data = self.client_in.read(1 << 16)
                if not data:
                    break
                sink.sendall(data)
        finally:
            sink.close()
