"""Service channel: the private local link between `coffer serve` and the service.

POSIX: a Unix socket in COFFER_HOME (0700), itself 0600, and on Linux the peer's uid checked on every connection;
a COFFER_HOME whose path is too long for a socket address gets its socket in a private folder of the user's own
under the temporary directory instead.  Windows: loopback TCP on a port the OS picks, and a secret per start that
the connecting side must send first; both are in COFFER_HOME/service.json, which only the user can read.

Every connection starts with one JSON line each way (the hello), then carries what its kind says: "session" is
a client's MCP stream, byte for byte (its hello may name the client's "profile"; the service refuses one it does
not know with "refused": "profile"); "control" is one request and one reply (status, tools, stop, handover).
Where descriptors can be passed (POSIX), a session's hello offers "pipes" and a service that takes them says so in
its own: the relay then sends two pipes of its making (one byte carrying them, SCM_RIGHTS) and the stream runs
over those instead of the socket, since a pipe wakes the process at its other end more cheaply than a socket does.
The socket stays open beside them for the life of the session.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import sys
import tempfile
import time
from typing import NamedTuple

from coffer_src.digests import same_secret, sha256, token_urlsafe
from coffer_src.errors import CofferError
from coffer_src.secret_store import private_temporary_file

channel_log = logging.getLogger(__name__)

#: What a hello line may hold at most: more is not a hello.
MAX_HELLO_BYTES = 16 << 10
#: Whether a session's stream may run over pipes passed on the socket (see the module's docstring).
PIPES_SUPPORTED = os.name == "posix" and hasattr(socket, "send_fds") and hasattr(socket, "recv_fds")
_PIPES_BYTE = b"P"
PIPE_BUFFER_BYTES = 1 << 20  # Linux's default limit for an unprivileged process (/proc/sys/fs/pipe-max-size)
#: A socket path longer than this does not fit a sockaddr_un on every POSIX system (macOS allows 104 bytes).
MAX_SOCKET_PATH = 100
SERVICE_FILE = "service.json"
START_LOCK = "service.lock"


class ChannelError(CofferError):
    """The service could not be reached, or what answered was not a Coffer service of this user."""


class Address(NamedTuple):
    """Where the service listens: a Unix socket ``path``, or (Windows) loopback ``port`` with its ``secret``."""
    path: str | None = None
    port: int | None = None
    secret: str | None = None


def uses_unix_sockets() -> bool:
    return hasattr(socket, "AF_UNIX") and os.name == "posix"


def socket_path(home: str) -> str:
    """The service's socket for this COFFER_HOME: inside it when the path fits, else in a folder of the user's
    own under the temporary directory, named after the home (so two homes never share a service)."""
    inside = os.path.join(home, "service.sock")
    if len(inside.encode()) <= MAX_SOCKET_PATH:
        return inside
    digest = sha256(os.path.realpath(home).encode()).hexdigest()[:24]
    return os.path.join(private_runtime_dir(), f"{digest}.sock")


def private_runtime_dir() -> str:
    """/tmp/coffer-<uid>, created 0700 and checked: ours, a real folder (not a link), closed to others."""
    path = os.path.join(tempfile.gettempdir(), f"coffer-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ChannelError(f"{path} is not a private folder of this user; remove it, or set a shorter COFFER_HOME")
    return path


def service_file(home: str) -> str:
    return os.path.join(home, SERVICE_FILE)


def read_service_file(home: str) -> dict | None:
    """What the running service wrote about itself (pid, version, address), or None.  Never trusted alone: the
    caller still checks that the address answers as a Coffer service of this user."""
    path = service_file(home)
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_HELLO_BYTES:
            return None
        if os.name == "posix" and (info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077):
            return None
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_service_file(home: str, data: dict) -> None:
    """Write service.json 0600, atomically (a reader sees the old file or the new one, never half)."""
    path = service_file(home)
    fd, temporary = private_temporary_file(home, ".service-", ".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            if os.name == "posix":
                os.fchmod(handle.fileno(), 0o600)
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def remove_service_file(home: str, pid: int) -> None:
    """Remove service.json if it is still this process's (a successor may have written its own)."""
    data = read_service_file(home)
    if data is not None and data.get("pid") == pid:
        try:
            os.unlink(service_file(home))
        except OSError:
            pass


# -- the service's side -----------------------------------------------------------------------------------------
def listen(home: str) -> tuple[socket.socket, Address]:
    """Bind the service's listening socket, recovering from a stale one left by a crashed service (only when
    nothing answers on it and it is this user's socket).  Raises ChannelError when a live service holds it."""
    if not uses_unix_sockets():
        server = socket.create_server(("127.0.0.1", 0))
        return server, Address(port=server.getsockname()[1], secret=token_urlsafe(32))
    path = socket_path(home)
    if os.path.lexists(path):
        info = os.lstat(path)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            raise ChannelError(f"{path} exists and is not a socket of this user: refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
            raise ChannelError("another Coffer service is already listening for this COFFER_HOME")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: its service died without cleaning up
        except socket.timeout:
            raise ChannelError("another Coffer service holds this COFFER_HOME's socket and does not answer") \
                from None
        finally:
            probe.close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is created 0600; its folder is 0700 anyway
    try:
        server.bind(path)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    server.listen(64)
    return server, Address(path=path)


def peer_is_same_user(conn: socket.socket) -> bool:
    """Linux: the connecting process runs as this user (SO_PEERCRED).  Elsewhere the socket's 0700 folder (POSIX)
    or the secret (Windows) is the check, and this says True."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or conn.family != getattr(socket, "AF_UNIX", None):
        return True
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return False
    return uid == os.getuid()


def read_hello(conn: socket.socket, timeout: float = 5.0) -> dict:
    """The first line of a connection, as a JSON object; ChannelError if it is not one (too long, not JSON,
    not in time)."""
    conn.settimeout(timeout)
    data = b""
    try:
        while b"\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                raise ChannelError("the connection closed before its hello")
            data += chunk
            if len(data) > MAX_HELLO_BYTES:
                raise ChannelError("the hello is too long")
    except socket.timeout:
        raise ChannelError("no hello in time") from None
    finally:
        conn.settimeout(None)
    line, _, rest = data.partition(b"\n")
    try:
        hello = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ChannelError("the hello is not JSON") from None
    if not isinstance(hello, dict):
        raise ChannelError("the hello is not a JSON object")
    hello["_rest"] = rest  # bytes that followed the hello in the same read: the session's first
    return hello


def secret_matches(hello: dict, address: Address) -> bool:
    """Windows: the connection proved it read service.json.  POSIX: nothing to prove (see peer_is_same_user)."""
    if address.secret is None:
        return True
    offered = hello.get("secret")
    return isinstance(offered, str) and same_secret(offered.encode(), address.secret.encode())


def send_line(conn: socket.socket, value: dict) -> None:
    conn.sendall(json.dumps(value, separators=(",", ":")).encode() + b"\n")


# -- the connecting side ----------------------------------------------------------------------------------------
def service_address(home: str) -> Address | None:
    """Where this COFFER_HOME's service should be, if it can be running at all."""
    if uses_unix_sockets():
        path = socket_path(home)
        try:
            info = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            channel_log.warning("%s is not a socket of this user; not connecting to it", path)
            return None
        return Address(path=path)
    data = read_service_file(home)
    if not data or not isinstance(data.get("port"), int) or not isinstance(data.get("secret"), str):
        return None
    return Address(port=data["port"], secret=data["secret"])


def connect(home: str, hello: dict, timeout: float = 5.0) -> tuple[socket.socket, dict] | None:
    """Connect to this COFFER_HOME's service and exchange hellos: (the socket, the service's hello), or None when
    no service answers.  ChannelError when something answers that is not a Coffer service."""
    address = service_address(home)
    if address is None:
        return None
    try:
        if address.path is not None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout)
            conn.connect(address.path)
        else:
            conn = socket.create_connection(("127.0.0.1", address.port), timeout=timeout)
            hello = {**hello, "secret": address.secret}
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout, OSError):
        return None
    try:
        send_line(conn, hello)
        answer = read_hello(conn, timeout)
    except (OSError, ChannelError):
        conn.close()
        return None
    if answer.get("coffer") != 1:
        conn.close()
        raise ChannelError("what answered on the service's address is not a Coffer service")
    conn.settimeout(None)
    return conn, answer


def send_session_pipes(conn: socket.socket) -> tuple[int, int]:
    """The relay's side: make the session's two pipes, pass the service its ends, keep ours: (the end to write
    the client's bytes to, the end to read the service's from).  OSError if the service is gone meanwhile."""
    to_service_read, to_service_write = os.pipe()
    from_service_read, from_service_write = os.pipe()
    for fd in (to_service_write, from_service_write):
        _widen_pipe(fd)
    try:
        socket.send_fds(conn, [_PIPES_BYTE], [to_service_read, from_service_write])
    except OSError:
        for fd in (to_service_write, from_service_read):
            os.close(fd)
        raise
    finally:
        os.close(to_service_read)  # the service's ends: its copies are the only ones now, so each side sees
        os.close(from_service_write)  # EOF (or EPIPE) when the other goes
    return to_service_write, from_service_read


def _widen_pipe(fd: int) -> None:
    """Where the system allows it (Linux), give the pipe a buffer like a socket's: a catalogue of megabytes then
    crosses in a few wakeups instead of one per 64 KB.  Best effort: a smaller pipe still works."""
    import fcntl  # POSIX only, as the pipes are
    size_op = getattr(fcntl, "F_SETPIPE_SZ", None)
    if size_op is not None:
        try:
            fcntl.fcntl(fd, size_op, PIPE_BUFFER_BYTES)
        except OSError:
            pass


def receive_session_pipes(conn: socket.socket, timeout: float = 5.0) -> tuple[int, int] | None:
    """The service's side: the two pipes a relay passes after the hellos, checked (a pipe each, the first open
    for reading, the second for writing): (read the client's bytes here, write the answers there), or None with
    every descriptor received closed again."""
    conn.settimeout(timeout)
    try:  # room for more than two, so that a third is seen (and refused), not dropped by the kernel unseen
        message, fds, flags, _ = socket.recv_fds(conn, 1, 8)
    except (OSError, ValueError):
        return None
    finally:
        conn.settimeout(None)
    wanted = (os.O_RDONLY, os.O_WRONLY)
    try:
        usable = message == _PIPES_BYTE and len(fds) == 2 and not flags & getattr(socket, "MSG_CTRUNC", 0) and all(
            stat.S_ISFIFO(os.fstat(fd).st_mode) and _pipe_access_mode(fd) == mode for fd, mode in zip(fds, wanted))
    except OSError:
        usable = False
    if usable:
        for fd in fds:
            os.set_inheritable(fd, False)  # recvmsg gives them without close-on-exec: no upstream may inherit one
        return fds[0], fds[1]
    for fd in fds:
        os.close(fd)
    return None


def _pipe_access_mode(fd: int) -> int:
    """How ``fd`` was opened: os.O_RDONLY, os.O_WRONLY or os.O_RDWR."""
    import fcntl  # POSIX only, as the pipes are
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


def control(home: str, request: dict, timeout: float = 10.0) -> dict | None:
    """One control request to the running service and its reply, or None when no service runs."""
    connected = connect(home, {"coffer": 1, "kind": "control", **request}, timeout)
    if connected is None:
        return None
    conn, answer = connected
    conn.close()
    return answer


class StartLock:
    """An exclusive lock on COFFER_HOME/service.lock, so that simultaneous first starts make one service."""

    def __init__(self, home: str):
        self.path = os.path.join(home, START_LOCK)
        self.handle = None

    def __enter__(self):
        self.handle = open(self.path, "a+b")  # noqa: SIM115 - held for the with block
        if os.name == "posix":
            os.fchmod(self.handle.fileno(), 0o600)
            import fcntl
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX)
        else:
            import msvcrt
            while True:
                try:
                    msvcrt.locking(self.handle.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        try:
            if os.name == "posix":
                import fcntl
                fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
            else:
                import msvcrt
                self.handle.seek(0)
                msvcrt.locking(self.handle.fileno(), msvcrt.LK_UNLCK, 1)
        finally:
            self.handle.close()


def process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if os.name != "posix":
        return True  # no cheap portable check; the address answering is what counts
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def detached_popen_options() -> dict:
    """How to start the service so that it outlives the `coffer serve` that started it and is no part of the
    client's process group (a client that kills its group must not kill the user's service)."""
    if os.name == "posix":
        return {"start_new_session": True}
    flags = getattr(sys.modules["subprocess"], "DETACHED_PROCESS", 0x8) | \
        getattr(sys.modules["subprocess"], "CREATE_NEW_PROCESS_GROUP", 0x200)
    return {"creationflags": flags}
