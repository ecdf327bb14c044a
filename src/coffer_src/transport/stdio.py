"""Stdio transport: an upstream as a subprocess, and the transport interface."""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import select
import shutil
import signal
import subprocess
import threading
from typing import NamedTuple

from coffer_src.errors import CofferException
from coffer_src.jsonrpc import OversizedLine, decode_json, encode_line, handle_burst, read_line_bursts
from coffer_src.terminal import ServerLog
from coffer_src.threads import start_thread

stdio_log = logging.getLogger(__name__)


class UpstreamFailure(CofferException):
    """An upstream could not be started, initialized or reached.

    ``permanent``: retrying cannot help (a command that is not installed, a URL that is not a URL, HTTP 401/403/404),
    so the server is marked failed at once with the real reason instead of being retried into the same wall.
    """

    permanent = False

    def __init__(self, message: str, permanent: bool | None = None):
        super().__init__(message)
        if permanent is not None:
            self.permanent = permanent


class Transport:
    """What the upstream supervisor needs from a connection.

    Callbacks run on the transport's own threads: ``on_message(dict)`` for each message, ``on_close()`` once when
    the connection ends, ``on_unusable(head, why)`` for a message that cannot be used (over max_message_bytes, not
    JSON, nested too deeply) so the request it answers can fail at once, ``on_failure(request_id, text)`` for a
    request that never got through (remote transports), and ``on_stderr(line)`` for a subprocess's diagnostics.
    ``send`` returns False when the connection no longer accepts input and raises EncodeError for a message that
    cannot be written.  ``fatal`` is set when the
    connection failed in a way retrying cannot fix; ``close_reason`` says, once it ended, what ended it.
    """

    pid = None
    fatal: UpstreamFailure | None = None
    close_reason: str | None = None
    speaks_discover = False     # a 2026-07-28 server may be behind it: ask server/discover before initialize

    def start(self) -> None:
        raise NotImplementedError

    def send(self, message: dict) -> bool:
        raise NotImplementedError

    def close(self, grace: float = 2.0) -> None:
        raise NotImplementedError

    def exit_detail(self) -> str | None:
        """Why the connection ended, in the user's terms (e.g. "exited with code 3"), once it has."""
        return None

    def _fail(self, message: dict, text: str) -> None:
        """A request that never got its answer through: a failure of the connection (``on_failure``), so a tool
        call reads it as a tool error, not as an error the server itself returned."""
        if "id" in message and "method" in message:
            self.on_failure(message["id"], text)


class ProcessInfo(NamedTuple):
    parent: int
    started: str  # when it started (Linux: clock ticks since boot; else ps's start time): tells a reused pid apart


def process_table() -> dict[int, ProcessInfo]:
    """Every process's parent and start time (POSIX; {} where it cannot be read)."""
    table: dict[int, ProcessInfo] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    data = handle.read(4096)
                fields = data[data.rindex(b")") + 2:].split()
                table[int(entry)] = ProcessInfo(int(fields[1]), fields[19].decode("ascii"))
            except (OSError, ValueError, IndexError):
                continue
        return table
    try:
        listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,lstart="], capture_output=True, text=True,
                                 timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in listing.splitlines():
        fields = line.split(None, 2)
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
            table[int(fields[0])] = ProcessInfo(int(fields[1]), fields[2].strip())
    return table


def _descendants(pid: int, table: dict[int, ProcessInfo] | None = None) -> dict[int, str]:
    """{pid: start time} of every live process descended from ``pid``, in any session or process group (POSIX).

    A server's ``setsid`` grandchild leaves its process group, so killing the group misses it; its ancestry
    does not change while its parent lives, which is why it is read before closing anything, and remembered
    while the server runs (StdioTransport.remember_family): once its parent has died it is re-parented to init.
    """
    table = process_table() if table is None else table
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, info in table.items():
        children[info.parent].append(child)
    found, frontier = {}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found[child] = table[child].started
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


class StdioTransport(Transport):
    """An upstream MCP server as a subprocess speaking newline-delimited JSON-RPC on stdin/stdout.

    The child gets its own process group (POSIX) so shutdown can reach the whole tree (``npx`` and ``uvx`` start
    grandchildren), and shutdown also ends descendants that left the group (a ``setsid`` daemon).  If Coffer is
    killed outright, the children see stdin close and exit by themselves.

    Threads: one reader each for stdout (it runs ``on_message`` and ``on_unusable``) and stderr (``on_stderr``),
    one that notices the exit, one writer for what ``send`` could not write at once; ``send`` and ``close`` run on
    any thread.  Two locks, both leaves: ``_send_lock`` guards ``_queued`` and the order of what goes to stdin (a
    direct write only when nothing is queued ahead; ``close``'s end marker after every message ``send`` accepted,
    since ``send`` checks ``_closed`` again under it); ``_close_lock`` makes ``close`` and ``on_close`` happen
    once.  ``_family`` is updated by the start thread and the gateway's ticker and read by ``close`` through a
    copy (``dict()`` of a dict is atomic under the GIL); a descendant missed by that race is found by ``close``'s
    own look at the process table.
    """

    speaks_discover = True

    def __init__(self, name, argv, env, cwd, on_message, on_close, on_stderr, on_unusable=None, max_line=0):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.on_message, self.on_close, self.on_stderr = on_message, on_close, on_stderr
        self.on_unusable = on_unusable or (lambda head, why: None)
        self.max_line = max_line
        self.log = ServerLog(stdio_log, name)
        self.proc: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._queued = 0          # messages handed to the writer thread and not yet written
        self._stdin_fd = None     # set when stdin is non-blocking (POSIX): send() may then write it directly
        self._close_lock = threading.Lock()
        self._closed = False
        self._close_signalled = False
        self._stderr_reader: threading.Thread | None = None
        self._family: dict[int, str] = {}   # descendants seen while it ran, so close ends them even after a crash

    def start(self) -> None:
        if self._closed:
            raise UpstreamFailure("stopped before it started")
        argv = list(self.argv)
        resolved = shutil.which(argv[0], path=self.env.get("PATH"))
        if resolved:
            argv[0] = resolved  # Windows needs npx.cmd spelled out; elsewhere this is harmless
        elif not os.path.dirname(argv[0]):
            raise UpstreamFailure(f"command {argv[0]!r} not found on PATH", permanent=True)
        if self.cwd and not os.path.isdir(self.cwd):
            raise UpstreamFailure(f"working directory {self.cwd!r} does not exist", permanent=True)
        kwargs = {}
        if os.name == "posix":
            kwargs["start_new_session"] = True
        else:
            kwargs["creationflags"] = getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=self.env, cwd=self.cwd or None, bufsize=0,
                                         **kwargs)
        except OSError as exc:
            transient = exc.errno in (errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE)
            raise UpstreamFailure(f"cannot start {argv[0]!r}: {exc.strerror or exc}", permanent=not transient) \
                from None
        if os.name == "posix":
            os.set_blocking(self.proc.stdin.fileno(), False)
            self._stdin_fd = self.proc.stdin.fileno()
        # stderr first: a server that dies at once is reported with its last words (exit_detail joins this)
        self._stderr_reader = threading.Thread(target=self._read_stderr, name=f"coffer-{self.name}-err",
                                               daemon=True)
        self._stderr_reader.start()
        self._reader = threading.Thread(target=self._read_stdout, name=f"coffer-{self.name}-out", daemon=True)
        self._reader.start()
        start_thread(self._watch_exit, f"coffer-{self.name}-wait")
        start_thread(self._write_stdin, f"coffer-{self.name}-in")

    def remember_family(self, table: dict[int, ProcessInfo] | None = None) -> None:
        """Note the server's descendants now (the gateway's ticker calls this every few seconds): a helper it
        daemonized is ended with it even if the server itself crashes first."""
        proc = self.proc
        if os.name == "posix" and proc is not None and proc.poll() is None and not self._closed:
            self._family.update(_descendants(proc.pid, table))

    def _write_stdin(self) -> None:
        """Write what ``send`` could not: a server that stops reading must stall only itself, never the
        client's reader or the timeout ticker.  Whatever queued up meanwhile goes out in one write."""
        stdin, outbox = self.proc.stdin, self._outbox
        closing = False
        while not closing:
            batch = [outbox.get()]
            while not outbox.empty() and len(batch) < 256:
                batch.append(outbox.get_nowait())
            count = len(batch)
            if None in batch:
                closing = True
                batch = batch[:batch.index(None)]
            try:
                if batch:
                    self._write_all(stdin, b"".join(batch))
            except (OSError, ValueError):
                break  # the server is gone; its reader sees EOF and reports it
            with self._send_lock:
                self._queued -= count
        try:
            stdin.close()
        except OSError:
            pass

    def _watch_exit(self) -> None:
        """Notice the server's exit even if a grandchild (npx, uvx, sh -c) keeps its stdout open."""
        self.proc.wait()
        self._reader.join(0.5)
        if not self._reader.is_alive() or self._closed:
            return
        if os.name == "posix":
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the leftovers of the dead server; the pipe then ends
            except (ProcessLookupError, PermissionError):
                pass
            self._reader.join(2.0)
        if self._reader.is_alive():
            self._signal_close()

    def _signal_close(self) -> None:
        with self._close_lock:
            if self._close_signalled:
                return
            self._close_signalled = True
        self.on_close()

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def exit_detail(self) -> str | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            code = proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return None
        if self._stderr_reader is not None and self._stderr_reader.ident is not None:
            self._stderr_reader.join(0.5)  # its last words are usually the reason
        return f"exited with code {code}"

    def _write_all(self, stdin, data: bytes) -> None:
        if self._stdin_fd is None:
            stdin.write(data)  # a blocking pipe (Windows): write() returns when all of it is written
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._stdin_fd, view):]
            except BlockingIOError:
                select.select([], [self._stdin_fd], [], 1.0)  # the server is busy; wait until it reads

    def send(self, message: dict) -> bool:
        if self._closed or self.proc is None or self.proc.poll() is not None:
            return False
        data = encode_line(message)
        with self._send_lock:
            if self._closed:  # close's end marker may be queued already: what follows it is never written
                return False
            if self._queued == 0 and self._stdin_fd is not None:
                # The common case: the pipe has room and nothing is queued ahead, so write it here and spare
                # the writer thread a wake-up; whatever does not fit is queued behind, in order.
                try:
                    data = data[os.write(self._stdin_fd, data):]
                except BlockingIOError:
                    pass
                except OSError:
                    return False
                if not data:
                    return True
            self._queued += 1
            self._outbox.put(data)
        return True

    def _read_stdout(self) -> None:
        # stdout is unbuffered (bufsize=0): each read returns what has arrived, so a reply burst is one call.
        skipped = 0

        def handle(line) -> None:
            nonlocal skipped
            if isinstance(line, OversizedLine):
                self.on_unusable(line.head, f"a message of {line.size} bytes, more than max_message_bytes "
                                            f"({self.max_line})")
                return
            if not line.strip():
                return
            try:
                message = decode_json(line)
            except ValueError as exc:  # invalid UTF-8, NaN, nested too deeply...: skipped like any junk
                skipped += 1
                if skipped <= 20 or skipped % 1000 == 0:
                    self.log.warning("skipped a non-JSON line on stdout (%d bytes; %d so far)", len(line), skipped)
                self.on_unusable(line[:4096], f"a reply Coffer cannot read ({exc})")
                return
            for item in (message if isinstance(message, list) else [message]):
                if isinstance(item, dict):
                    try:
                        self.on_message(item)
                    except Exception:  # noqa: BLE001 - a bug in routing costs one message, not the reader
                        self.log.exception("internal error handling a message")

        try:
            for lines in read_line_bursts(self.proc.stdout.read, max_line=self.max_line):
                handle_burst(lines, handle)
                del lines  # not kept while the next read waits (see read_line_bursts)
        except (OSError, ValueError):
            pass
        except Exception:  # noqa: BLE001 - the connection is lost either way; say why, then restart it
            self.log.exception("internal error reading stdout")
        finally:
            self._signal_close()

    def _read_stderr(self) -> None:
        try:
            for lines in read_line_bursts(self.proc.stderr.read, max_line=8192):
                for line in lines:
                    raw = line.head if isinstance(line, OversizedLine) else line
                    self.on_stderr(raw.decode("utf-8", "replace").rstrip("\r"))
        except (OSError, ValueError):
            pass  # the pipe closed under us at shutdown
        except Exception:  # noqa: BLE001
            self.log.exception("internal error reading stderr")

    def close(self, grace: float = 2.0) -> None:
        """Close stdin, give the server ``grace`` seconds to exit, then terminate and kill its process group and
        every descendant found before closing (including those in other sessions)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        proc = self.proc
        if proc is None:
            return
        family: dict[int, str] = {}
        if os.name == "posix":
            table = process_table()
            family = {pid: started for pid, started in dict(self._family).items()  # still the same processes
                      if table.get(pid) is not None and table[pid].started == started}
            if proc.poll() is None:
                family.update(_descendants(proc.pid, table))
        with self._send_lock:
            self._queued += 1
            self._outbox.put(None)  # the writer flushes what is queued, then closes stdin
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        if os.name != "posix":
            if proc.poll() is None:  # no process groups to signal: taskkill /T takes the whole tree
                subprocess.run(["taskkill", "/T", "/F", "/PID", str(proc.pid)], capture_output=True, check=False)
                proc.kill()
        else:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                leader_alive = proc.poll() is None
                try:  # the group may outlive its leader: npx exits, the node server it started does not
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                for pid in family:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                if not leader_alive and not any(_alive(pid) for pid in family):
                    break
                try:
                    proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
        for stream in (proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
