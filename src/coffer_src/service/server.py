"""Service: the user's one Coffer, shared by every client's `coffer serve`.

The service owns the hub (upstream processes, catalogue, indexes, knowledge base, logs); each connection on its
private channel is one client session, or one control request.  It starts on demand (a `coffer serve` finding
none), logs to a rotated file under COFFER_HOME, hands over to a newer Coffer without dropping a session, and
exits once no session has been attached for ``service_idle_exit`` seconds.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import Callable

from coffer_src import __version__
from coffer_src.errors import CofferError
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.gateway.sharing import return_freed_memory
from coffer_src.names import did_you_mean
from coffer_src.profiles import PROFILE_NAME_RE, ProfileStore
from coffer_src.service.channel import (
    PIPES_SUPPORTED,
    ChannelError,
    listen,
    peer_is_same_user,
    read_hello,
    receive_session_pipes,
    remove_service_file,
    secret_matches,
    send_line,
    write_service_file,
)
from coffer_src.terminal import printable, redact
from coffer_src.threads import start_thread
from coffer_src.transport.stdio import StdioTransport
from coffer_src.vault import Vault, iso_timestamp

service_log = logging.getLogger(__name__)

#: Bytes a session's client may leave unread before the service gives up on it (its session ends; its relay
#: re-attaches): a client that stops reading costs the service this much memory, never a stuck upstream.
MAX_UNREAD_BYTES = 64 << 20
MAX_CONNECTIONS = 256
DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
LOG_BYTES, LOG_BACKUPS = 2 << 20, 3


def build_id() -> str:
    """What tells two Coffers apart: the version and the code itself (two copies of one version may differ).  A
    checksum, not a digest: it tells builds apart, it guards nothing, and a relay need not load hashlib for it."""
    import sys
    import zlib
    module = sys.modules.get(ClientSession.__module__)
    path = getattr(module, "__file__", None)
    try:
        with open(path, "rb") as handle:
            code = handle.read()
        checksum = f"{zlib.crc32(code):08x}{len(code):x}"
    except (OSError, TypeError):
        checksum = "unknown"
    return f"{__version__}+{checksum}"


class SocketOutput:
    """A session's output to its relay: written at once when the socket takes it, else queued for a writer thread
    (so the upstream reader delivering an answer never waits on a client that is slow to read); past
    MAX_UNREAD_BYTES the client is given up on, and the write raises OSError (the session ends)."""

    def __init__(self, conn: socket.socket, name: str):
        self.conn = conn
        self.lock = threading.Lock()
        self.queue: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.closed = False
        self.wake = threading.Condition(self.lock)
        start_thread(self._drain, f"coffer-out-{name}")

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.closed:
                raise BrokenPipeError("the session's connection is closed")
            if not self.queue:
                try:
                    data = data[self._send_now(data):]
                except OSError:
                    self.closed = True
                    raise
                if not data:
                    return
            if self.queued + len(data) > MAX_UNREAD_BYTES:
                self.closed = True
                self._shutdown()
                raise BrokenPipeError("the client leaves its answers unread")
            self.queue.append(data)
            self.queued += len(data)
            self.wake.notify()

    def flush(self) -> None:
        pass

    def _send_now(self, data: bytes) -> int:
        """Send what the socket takes without waiting: MSG_DONTWAIT where there is one, else after select()."""
        if DONTWAIT:
            try:
                return self.conn.send(data, DONTWAIT)
            except BlockingIOError:
                return 0
        _, writable, _ = select.select([], [self.conn], [], 0)
        return self.conn.send(data) if writable else 0

    def _drain(self) -> None:
        try:
            self._drain_queue()
        finally:
            self._drained()

    def _drained(self) -> None:
        """The writer thread is done: nothing more is sent."""

    def _drain_queue(self) -> None:
        while True:
            with self.lock:
                while not self.queue and not self.closed:
                    self.wake.wait()
                if self.closed and not self.queue:
                    return
                # The chunk stays at the head of the queue until it is sent, so that a write() meanwhile queues
                # behind it instead of sending its bytes into the middle of this one.
                data = self.queue[0]
            try:
                self._send_all(data)
            except OSError:
                with self.lock:
                    self.closed = True
                    self.queue.clear()
                    self.queued = 0
                return
            with self.lock:
                self.queue.popleft()
                self.queued -= len(data)
            del data  # not held while this thread waits for the next chunk: an answer can be a whole catalogue

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.wake.notify()

    def _send_all(self, data: bytes) -> None:
        """Send all of ``data``, waiting for room (the writer thread's way)."""
        self.conn.sendall(data)

    def _shutdown(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class PipeOutput(SocketOutput):
    """A session's output to its relay over the pipe the relay passed (service/channel.py): the same queueing,
    over a descriptor made non-blocking so that a write takes what fits at once.  Giving up on the client closes
    the pipe: the relay reads its end, and ends the session's input from its side."""

    def __init__(self, fd: int, name: str):
        os.set_blocking(fd, False)
        self.fd = fd
        self.given_up = False
        super().__init__(None, name)

    def _send_now(self, data: bytes) -> int:
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0

    def _send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.given_up:
                raise BrokenPipeError("the client leaves its answers unread")
            _, writable, _ = select.select([], [self.fd], [], 0.5)
            if writable:
                view = view[self._send_now(view):]

    def _shutdown(self) -> None:
        # Only the writer thread closes the pipe (_drained), so no thread ever writes to a number reused meanwhile.
        self.given_up = True

    def _drained(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _RotatingLog(logging.FileHandler):
    """A log file that is renamed to .1 (an older .1 to .2, and so on up to ``backups``) before a record would
    take it to ``max_bytes``: what logging.handlers.RotatingFileHandler does, without importing that module,
    which brings pickle and socket handlers a long-running service never uses.  Records are written under the
    handler's lock (logging.Handler.handle), so a rotation is too."""

    def __init__(self, path: str, max_bytes: int, backups: int):
        super().__init__(path, mode="a", encoding="utf-8")
        self.max_bytes, self.backups = max_bytes, backups

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._full(record):
                self._rotate()
            super().emit(record)
        except Exception:  # noqa: BLE001 - logging's rule: a record that cannot be written is reported, not raised
            self.handleError(record)

    def _full(self, record: logging.LogRecord) -> bool:
        if os.path.exists(self.baseFilename) and not os.path.isfile(self.baseFilename):
            return False  # never rename what is not a regular file (a named pipe, /dev/null)
        if self.stream is None:
            self.stream = self._open()
        self.stream.seek(0, 2)
        return self.stream.tell() + len(self.format(record) + "\n") >= self.max_bytes

    def _rotate(self) -> None:
        if self.stream:
            self.stream.close()
            self.stream = None
        for i in range(self.backups - 1, 0, -1):
            older, newer = f"{self.baseFilename}.{i}", f"{self.baseFilename}.{i + 1}"
            if os.path.exists(older):
                if os.path.exists(newer):
                    os.remove(newer)
                os.rename(older, newer)
        first = self.baseFilename + ".1"
        if os.path.exists(first):
            os.remove(first)
        if os.path.exists(self.baseFilename):
            os.rename(self.baseFilename, first)
        self.stream = self._open()

    def _open(self):
        """The file as logging opens it, but created private (0600) whatever the umask: a new file after each
        rotation too."""
        if not os.path.exists(self.baseFilename):
            os.close(os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        return super()._open()


class _Redacted(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return printable(redact(super().format(record)))


def log_to_file(home: str) -> str:
    """The service's log: COFFER_HOME/logs/service.log, rotated, private, secrets redacted."""
    folder = os.path.join(home, "logs")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "service.log")
    handler = _RotatingLog(path, LOG_BYTES, LOG_BACKUPS)
    handler.setFormatter(_Redacted("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = (os.environ.get("COFFER_LOG") or "info").strip().upper()
    root.setLevel(getattr(logging, level) if level in ("DEBUG", "INFO", "WARNING", "ERROR") else logging.INFO)
    return path


class Service:
    """The service process: one hub, a listener, a thread per connection.

    Threads: the caller's runs the accept loop (and notices idleness, a stop and a handover); each connection has
    its reader thread (a session's dispatch, or one control request) and, for a session, a writer thread
    (SocketOutput); an HTTP endpoint (``endpoints``, made by ``endpoint_factory``) has its own; everything else
    is the hub's.  ``lock`` guards ``connections``, ``sessions``, ``endpoints`` and the handover state; it is a
    leaf (nothing is called while it is held).
    """

    def __init__(self, vault: Vault, endpoint_factory=None, http_address: str | None = None):
        self.vault = vault
        self.endpoint_factory = endpoint_factory   # (service, address) -> an HTTP endpoint (service/http.py)
        self.http_address = http_address           # `--http`, else the service_http setting
        self.endpoints: list = []
        self.home = vault.home
        self.started = time.time()
        self.build = build_id()
        self.lock = threading.Lock()
        self.sessions: dict[ClientSession, socket.socket] = {}
        self.connections = 0
        self.stopping = threading.Event()
        self.handing_over = False
        self.listener: socket.socket | None = None
        self.address = None
        self.idle_since = time.monotonic()
        self.hub = Hub(vault, shared=True)
        # What a later layer adds (the web page, service/web.py): more control ops by name (each called with the
        # request, on that connection's thread, returning the reply), what else keeps the service from exiting
        # idle, and what to close when it stops.
        self.controls: dict[str, Callable[[dict], dict]] = {}
        self.busy_checks: list[Callable[[], bool]] = []
        self.closers: list[Callable[[], None]] = []

    # -- life ------------------------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.listener, self.address = listen(self.home)
        except ChannelError as exc:
            service_log.info("not starting: %s", exc)
            return 0
        write_service_file(self.home, {"pid": os.getpid(), "version": __version__, "build": self.build,
                                       "started": self.started, "path": self.address.path,
                                       "port": self.address.port, "secret": self.address.secret})
        service_log.info("Coffer %s service started (pid %d)", __version__, os.getpid())
        for name in ("SIGTERM", "SIGHUP", "SIGINT"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), lambda *_: self.stopping.set())
        self.hub.start()
        return_freed_memory()  # what loading Coffer itself left behind (compiling coffer.py, when it had no bytecode)
        address = self.http_address or str(self.hub.settings.get("service_http") or "")
        if address:
            self.open_http(address)
        self.listener.settimeout(0.5)
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    self._check_idle()
                    continue
                except OSError:
                    if self.handing_over or self.stopping.is_set():
                        self._wait_for_sessions()
                        break
                    raise
                with self.lock:
                    if self.connections >= MAX_CONNECTIONS:
                        conn.close()
                        continue
                    self.connections += 1
                start_thread(self._connection, "coffer-connection", conn)
        finally:
            self._close_listener()
            remove_service_file(self.home, os.getpid())
            for endpoint in self.endpoints:
                endpoint.close()
            for close in self.closers:
                close()
            self.hub.shutdown()
            service_log.info("Coffer service stopped")
        return 0

    def open_http(self, address: str) -> str | None:
        """Also serve Streamable HTTP at ``address``; the reason when it cannot (the service goes on without)."""
        if self.endpoint_factory is None:
            return "this service cannot serve HTTP"
        try:
            endpoint = self.endpoint_factory(self, address)
            endpoint.start()
        except (OSError, CofferError) as exc:
            service_log.error("cannot serve HTTP at %s: %s", printable(address)[:100], exc)
            return f"cannot serve HTTP at {printable(address)[:100]}: {exc}"
        with self.lock:
            self.endpoints.append(endpoint)
        return None

    def _check_idle(self) -> None:
        with self.lock:
            busy = bool(self.sessions) or self.connections or any(e.busy() for e in self.endpoints)
        if busy or any(check() for check in self.busy_checks):
            self.idle_since = time.monotonic()
            return
        limit = float(self.hub.settings.get("service_idle_exit", 600.0))
        if limit > 0 and time.monotonic() - self.idle_since >= limit:
            service_log.info("no client for %gs: exiting", limit)
            self.stopping.set()

    def _wait_for_sessions(self) -> None:
        """After a handover: the old sessions finish their calls, then their relays leave; then this exits."""
        while not self.stopping.is_set():
            with self.lock:
                if not self.sessions:
                    return
            time.sleep(0.1)

    def _close_listener(self) -> None:
        """Stop listening and remove the socket, unless a successor has already put its own in its place."""
        listener, self.listener = self.listener, None
        if listener is None:
            return
        if self.address is not None and self.address.path:
            try:  # a successor binds only once this is gone (channel.listen), so the path is still ours
                os.unlink(self.address.path)
            except OSError:
                pass
        listener.close()

    # -- a connection ------------------------------------------------------------------------------------------------
    def _connection(self, conn: socket.socket) -> None:
        try:
            if not peer_is_same_user(conn):
                service_log.warning("refused a connection from another user")
                return
            try:
                hello = read_hello(conn)
            except ChannelError as exc:
                service_log.info("refused a connection: %s", exc)
                return
            if hello.get("coffer") != 1 or not secret_matches(hello, self.address):
                send_line(conn, {"coffer": 1, "error": "not a Coffer client of this service"})
                return
            kind = hello.get("kind")
            answer = {"coffer": 1, "version": __version__, "build": self.build, "pid": os.getpid(),
                      "serve_mode": self.hub.settings.get("serve_mode", "service")}
            if kind == "control":
                send_line(conn, {**answer, **self.control(hello)})
            elif kind == "session" and (refusal := self.profile_refusal(hello.get("profile"))):
                send_line(conn, {"coffer": 1, "error": refusal, "refused": "profile"})
            elif kind == "session" and not self.handing_over:
                pipes = PIPES_SUPPORTED and hello.get("pipes") is True
                send_line(conn, {**answer, "pipes": True} if pipes else answer)
                received = receive_session_pipes(conn) if pipes else None
                if not pipes or received is not None:  # a relay that sends no pipes after asking gets no session
                    self._session(conn, hello, received)
            else:
                send_line(conn, {"coffer": 1, "error": "this service is handing over to a newer one"})
        except OSError:
            pass
        except Exception:  # noqa: BLE001 - one connection's failure must not cost the service
            service_log.exception("error on a connection")
        finally:
            with self.lock:
                self.connections -= 1
            try:
                conn.close()
            except OSError:
                pass

    def profile_refusal(self, name) -> str | None:
        """Why a session may not use profile ``name`` (None: it may, or it asks for none).  A profile added a moment
        ago is waited for until the hub has read it (its ticker reads vault changes every second), so the
        client's first list is already the profile's."""
        if name is None:
            return None
        if not isinstance(name, str) or not PROFILE_NAME_RE.match(name):
            return "not a valid profile name"
        if name in self.hub.views.profiles:
            return None
        try:
            with self.hub.vault_lock:
                stored = ProfileStore(self.vault).profiles()
        except CofferError as exc:
            return f"profiles cannot be read: {exc}"
        if name not in stored:
            return f"unknown profile {name!r}{did_you_mean(name, stored)}; `coffer profile list` shows them"
        deadline = time.monotonic() + 5.0
        while name not in self.hub.views.profiles and time.monotonic() < deadline and not self.stopping.is_set():
            time.sleep(0.02)
        return None

    def _session(self, conn: socket.socket, hello: dict, pipes: tuple[int, int] | None = None) -> None:
        """Serve one client's session: over its pipes (read, write) when the relay passed them, else the socket."""
        name = str(hello.get("pid", "?"))
        if pipes is not None:
            output, source = PipeOutput(pipes[1], name), _PipeInput(pipes[0])
        else:
            output, source = SocketOutput(conn, name), _Prefixed(conn, hello.get("_rest", b""))
        session = ClientSession(self.hub, out=output, profile=hello.get("profile"))
        with self.lock:
            self.sessions[session] = conn
        try:
            session.serve(source)
        finally:
            if pipes is not None:
                os.close(pipes[0])
            output.close()
            with self.lock:
                self.sessions.pop(session, None)
                self.idle_since = time.monotonic()

    # -- control -----------------------------------------------------------------------------------------------------
    def control(self, request: dict) -> dict:
        op = request.get("op")
        if op == "status":
            return {"status": self.status()}
        if op == "tools":
            profile = request.get("profile")
            return {"tools": self.tools(profile if isinstance(profile, str) else None)}
        if op == "stop":
            self.stopping.set()
            return {"ok": True}
        if op == "handover":
            self.handover()
            return {"ok": True}
        if op == "flush_log":  # `coffer log` right after a call sees that call
            self.hub.log.flush(3.0)
            return {"ok": True}
        if op == "http":
            return self._control_http(request.get("address"))
        if op in self.controls:
            return self.controls[op](request)
        return {"error": f"unknown control request {printable(str(op))[:40]!r}"}

    def _control_http(self, address) -> dict:
        """`coffer service start --http ADDRESS` while the service runs: serve it now, unless it serves HTTP
        already (at one address at a time)."""
        if not isinstance(address, str) or not address or len(address) > 300:
            return {"error": "no HTTP address given"}
        with self.lock:
            serving = [endpoint.describe() for endpoint in self.endpoints]
        if serving:
            return {"ok": True, "http": serving[0]}
        problem = self.open_http(address)
        if problem is not None:
            return {"error": problem}
        return {"ok": True, "http": self.endpoints[0].describe()}

    def handover(self) -> None:
        """A newer Coffer takes over: stop listening (its socket is free for the successor), tell each session's
        relay to move new requests there, and finish the calls already here before exiting."""
        with self.lock:
            if self.handing_over:
                return
            self.handing_over = True
            sessions = list(self.sessions)
        self._close_listener()
        for endpoint in self.endpoints:  # the successor listens there now; HTTP clients start new sessions with it
            endpoint.close_listener()
        service_log.info("handing over to a newer Coffer; %d sessions move", len(sessions))
        for session in sessions:
            session.stream.send({"coffer": "handover"})

    def tools(self, profile: str | None = None) -> dict:
        """Every usable tool of the catalogue (or of ``profile``'s view of it) by server, as a client can call it,
        and each server's state: what `coffer tools`, `call` and `doctor` read from a running service instead of
        starting servers themselves."""
        catalogue = self.hub.catalogue if profile is None else self.hub.views.catalogue(profile, self.hub.catalogue)
        by_server: dict[str, list] = {}
        for tool in catalogue.tools:
            route = catalogue.tool_routes.get(tool["name"])
            if route is not None:
                by_server.setdefault(route.upstream.name, []).append(tool)
        servers = {}
        for name, config in self.hub.configs.items():
            upstream = self.hub.upstreams.get(name) or self.hub.per_client.get(name) or self.hub.dormant.get(name)
            state = getattr(upstream, "state", None) or config.get("status") or "not started"
            if getattr(upstream, "per_client", False) or getattr(upstream, "dormant", False):
                state = "ready"  # listed from its last start; a call starts an instance
            servers[name] = {"state": state, "error": getattr(upstream, "last_error", None) or "",
                             "tools": by_server.get(name, [])}
        return servers

    def status(self) -> dict:
        with self.lock:
            sessions = list(self.sessions)
        upstreams = []
        users: dict[str, int] = collections.Counter()
        every = [*sessions, *(client for endpoint in self.endpoints for client in endpoint.clients())]
        for session in every:
            for name in session.instances.running:
                users[name] += 1
        for upstream in self.hub.upstreams.values():
            users[upstream.name] = sum(1 for s in every if s.calls.used(upstream))
        for name, upstream in [*self.hub.upstreams.items(), *self.hub.per_client.items(), *self.hub.dormant.items()]:
            transport = getattr(upstream, "transport", None)
            pid = transport.pid if isinstance(transport, StdioTransport) else None
            last = getattr(upstream, "last_call", None)
            state = "stopped (idle)" if getattr(upstream, "dormant", False) else upstream.state
            upstreams.append({"name": name, "state": state, "pid": pid, "rss_mb": rss_mb(pid),
                              "sharing": "per-client" if getattr(upstream, "per_client", False) else "shared",
                              "sessions": users.get(name, 0), "last_call": iso_timestamp(last) if last else None})
        with self.lock:
            endpoints = list(self.endpoints)
        return {"service": {"pid": os.getpid(), "version": __version__, "uptime_s": round(time.time() -
                                                                                          self.started, 1),
                            "rss_mb": rss_mb(os.getpid()),
                            "http": endpoints[0].describe() if endpoints else None},
                "sessions": [{**session.status(), "transport": "stdio"} for session in sessions] +
                            [status for endpoint in endpoints for status in endpoint.statuses()],
                "upstreams": upstreams}


class _PipeInput:
    """The session's input over the pipe its relay passed: read as a stream until the relay closes its end."""

    def __init__(self, fd: int):
        self.fd = fd

    def recv(self, size: int) -> bytes:
        try:
            return os.read(self.fd, size)
        except OSError:
            return b""


class _Prefixed:
    """A socket read as a stream, starting with the bytes that came with the hello."""

    def __init__(self, conn: socket.socket, first: bytes):
        self.conn, self.first = conn, first

    def recv(self, size: int) -> bytes:
        if self.first:
            data, self.first = self.first, b""
            return data
        try:
            return self.conn.recv(size)
        except OSError:
            return b""


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MB (Linux: /proc; elsewhere None)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        return None
    return None


def run_service(home: str, extend: Callable[[Service], None] | None = None, endpoint_factory=None,
                http_address: str | None = None) -> int:
    """`coffer service run`: the service in this process, until it is stopped, idle or handed over; ``extend``
    adds what a later layer brings (cli passes the web page's attach_web)."""
    log_to_file(home)
    vault = Vault(home, actor="service")
    try:
        service = Service(vault, endpoint_factory, http_address)
        if extend is not None:
            extend(service)
        return service.run()
    finally:
        vault.close()
