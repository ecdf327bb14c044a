"""Shared helpers: an isolated COFFER_HOME per test, the CLI as a subprocess, the real reference servers, and a
raw JSON-RPC client for protocol-level checks the SDK would hide."""

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The suite drives the gateway in-process (`coffer serve --standalone`), as the existing tests always have; the
# shared service behind a plain `coffer serve` is tested in tests/test_service.py, which sets this to "service".
os.environ.setdefault("COFFER_SERVE_MODE", "standalone")
COFFER = str(ROOT / "coffer.py")
PY = sys.executable
FAKE = [PY, str(ROOT / "tests" / "fixtures" / "fake_server.py")]
HOSTILE = [PY, str(ROOT / "tests" / "fixtures" / "hostile_server.py")]
NODE_MODULES = ROOT / ".ci" / "node_modules" / "@modelcontextprotocol"
EVERYTHING_JS = NODE_MODULES / "server-everything" / "dist" / "index.js"
MEMORY_JS = NODE_MODULES / "server-memory" / "dist" / "index.js"
TIME_SERVER = [PY, "-m", "mcp_server_time"]

needs_node = pytest.mark.skipif(not (shutil.which("node") and EVERYTHING_JS.exists() and MEMORY_JS.exists()),
                                reason="Node reference servers not installed (.ci/run installs them)")


def rss_kb(pid):
    """Resident memory of a process in kB, from /proc (None where there is no /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_status(pid, key="VmRSS"):
    """One numeric field of /proc/PID/status (kB for memory fields, a count for Threads); None without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def everything_cmd():
    return ["node", str(EVERYTHING_JS), "stdio"]


def memory_cmd(path):
    return ["node", str(MEMORY_JS)], {"MEMORY_FILE_PATH": str(path)}


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "coffer-home"
    monkeypatch.setenv("COFFER_HOME", str(path))
    return path


def cli(*args, check=True, env=None, timeout=120):
    """Run the coffer CLI as a user would; returns the CompletedProcess."""
    proc = subprocess.run([PY, COFFER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"coffer {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


class RawGateway:
    """``coffer serve`` driven with hand-written JSON-RPC lines."""

    def __init__(self, env=None):
        self.proc = subprocess.Popen([PY, COFFER, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
        self.messages = queue.Queue()
        self.responses = {}
        self.notifications = []
        self.requests = []
        self.cond = threading.Condition()
        self.stderr_lines = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self._next = 0

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "method" in msg and "id" in msg:
                    self.requests.append(msg)
                elif "method" in msg:
                    self.notifications.append(msg)
                else:
                    self.responses.setdefault(json.dumps(msg.get("id")), []).append(msg)
                self.cond.notify_all()

    def _read_err(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line.decode("utf-8", "replace"))

    def send_raw(self, data: bytes):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, obj):
        self.send_raw((json.dumps(obj) + "\n").encode())

    def wait_response(self, msg_id, timeout=30):
        key = json.dumps(msg_id)
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.responses.get(key):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no response to {msg_id!r}; stderr: {''.join(self.stderr_lines)[-2000:]}")
                self.cond.wait(remaining)
            return self.responses[key].pop(0)

    def wait_for(self, predicate, timeout=30):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = predicate(self)
                if found:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("condition not met")
                self.cond.wait(remaining)

    def request(self, method, params=None, timeout=30):
        self._next += 1
        msg_id = self._next
        msg = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return self.wait_response(msg_id, timeout)

    def initialize(self, capabilities=None, version="2025-11-25", name="raw-test"):
        response = self.request("initialize", {"protocolVersion": version, "capabilities": capabilities or {},
                                               "clientInfo": {"name": name, "version": "1"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return response

    def close(self, timeout=10):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def raw_gateway(home):
    gateways = []

    def start(env=None):
        gateway = RawGateway(env)
        gateways.append(gateway)
        return gateway

    yield start
    for gateway in gateways:
        gateway.close()


class WatchedGateway(RawGateway):
    """A RawGateway for hostile tests: a line that is not strict JSON is kept in ``bad_lines`` instead of killing
    the reader, and with ``rss_ceiling_mb`` a watchdog kills the gateway the moment its RSS passes the ceiling
    (``over_ceiling`` then holds the RSS seen), so a regression costs the shared machine nothing."""

    def __init__(self, env=None, rss_ceiling_mb=None):
        self.bad_lines = []
        self.over_ceiling = None
        super().__init__(env)
        if rss_ceiling_mb:
            threading.Thread(target=self._watch_rss, args=(rss_ceiling_mb * 1024,), daemon=True).start()

    def _read(self):
        def strict(name):
            raise ValueError(f"non-standard JSON constant {name}")

        for line in self.proc.stdout:
            try:
                msg = json.loads(line, parse_constant=strict)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError:
                with self.cond:
                    self.bad_lines.append(line[:200])
                    self.cond.notify_all()
                continue
            with self.cond:
                if "method" in msg and "id" in msg:
                    self.requests.append(msg)
                elif "method" in msg:
                    self.notifications.append(msg)
                else:
                    self.responses.setdefault(json.dumps(msg.get("id")), []).append(msg)
                self.cond.notify_all()

    def _watch_rss(self, ceiling_kb):
        while self.proc.poll() is None:
            rss = proc_status(self.proc.pid)
            if rss is not None and rss > ceiling_kb:
                self.over_ceiling = rss
                self.proc.kill()
                return
            time.sleep(0.02)

    def stderr_text(self):
        return "".join(self.stderr_lines)


@pytest.fixture
def watched_gateway(home):
    gateways = []

    def start(env=None, rss_ceiling_mb=None):
        gateway = WatchedGateway(env, rss_ceiling_mb)
        gateways.append(gateway)
        return gateway

    yield start
    for gateway in gateways:
        gateway.close()
