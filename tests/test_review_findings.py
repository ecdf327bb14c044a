"""Review of the issue-15/13/11 rewrite: each test shows one bug found by reading, against real components (the
real CLI and `coffer serve`, the fixture server, stdlib HTTP servers on loopback).  Every test here fails on the
commit it was written against and passes once the finding is fixed.  Timeouts bound the wait for an answer; no
test asserts a duration."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coffer_src.jsonrpc import METHOD_NOT_FOUND, rpc_error
from coffer_src.threads import WorkerPool
from coffer_src.transport.http import read_sse_events
from coffer_src.upstream.supervisor import Upstream
from coffer_src.vault import DEFAULTS

from conftest import FAKE, PY, alive, cli, coffer_cmd, linux_only, received, rss_kb, text_of, wait_until

# -- helpers ---------------------------------------------------------------------------------------------------

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


# -- a Streamable HTTP server on loopback (stdlib), misbehaving on demand -----------------------------------------

class StubState:
    def __init__(self):
        self.echo_arrived = threading.Event()
        self.get_streams_open = 0
        self.get_streams_closed = threading.Event()


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    TOOLS = [{"name": n, "inputSchema": {"type": "object"}} for n in ("echo", "slow", "html", "cut")]

    def log_message(self, *args):
        pass

    def _reply(self, status, body: bytes, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Mcp-Session-Id", "session-1")
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self):  # noqa: N802 - a server may refuse to let the client end its session (MCP allows 405)
        self._reply(405, b"", "text/plain")

    def do_GET(self):  # noqa: N802 - the optional server stream: open until the client goes away
        state = self.server.state
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        state.get_streams_open += 1
        try:
            while True:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            state.get_streams_closed.set()

    def do_POST(self):  # noqa: N802
        state = self.server.state
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        method, msg_id = message.get("method"), message.get("id")
        if msg_id is None:
            return self._reply(202, b"", "text/plain")

        def answer(result):
            self._reply(200, json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}).encode())

        if method == "initialize":
            return answer({"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                           "serverInfo": {"name": "stub", "version": "1"}})
        if method == "tools/list":
            return answer({"tools": self.TOOLS})
        name = message["params"]["name"]
        if name == "echo":
            state.echo_arrived.set()
            return answer({"content": [{"type": "text", "text": "echo"}]})
        if name == "slow":  # finishes as soon as a concurrent echo call reaches the server (or after 8 s)
            seen = state.echo_arrived.wait(8)
            return answer({"content": [{"type": "text", "text": f"echo arrived meanwhile: {seen}"}]})
        if name == "html":  # a login page or proxy in front of the server answers instead of it
            return self._reply(200, b"<html><body>Please sign in</body></html>", "text/html")
        if name == "cut":  # an SSE response that ends before the server sent the reply
            return self._reply(200, b": working\n\n", "text/event-stream")
        return self._reply(404, b"", "text/plain")


@pytest.fixture
def http_stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    server.daemon_threads = True
    server.state = StubState()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/mcp"
    yield server
    server.shutdown()
    server.server_close()


def http_config(name, url):
    return {"name": name, "transport": "http", "url": url, "env": {}, "headers": {}, "cwd": None, "inherit_env": []}


# -- 1. concurrency ------------------------------------------------------------------------------------------------

def test_worker_pool_runs_a_second_job_while_the_first_is_busy():
    """WorkerPool.submit counts an idle worker as free even after an earlier submit already claimed it, so two
    jobs submitted back to back share one thread: the second waits behind the first although `size` allows more."""
    pool = WorkerPool("review-pool", 4)
    warmed = threading.Event()
    pool.submit(warmed.set)  # one worker now exists and goes idle
    assert warmed.wait(5)
    wait_until(lambda: pool._busy == 0, what="the first worker to be idle again")
    released, finished, seen = threading.Event(), threading.Event(), {}

    def first():
        seen["released"] = released.wait(5)
        finished.set()

    pool.submit(first)
    pool.submit(released.set)
    assert finished.wait(10)
    assert seen["released"] is True, "the second job only ran after the first one gave up waiting for it"


def test_a_slow_call_to_an_http_upstream_does_not_hold_up_the_next_call(http_stub):
    """A user-visible regression from 983013a (one thread per POST): calls to one HTTP server run one at a time."""
    upstream, ticker = start_upstream(http_config("stub", http_stub.url), call_timeout=30.0, init_timeout=10.0)
    try:
        slow, slow_done = call_upstream(upstream, "slow")
        echo, echo_done = call_upstream(upstream, "echo")
        assert slow_done.wait(20) and echo_done.wait(20)
        assert text_of(slow["response"]) == "echo arrived meanwhile: True"
    finally:
        ticker.stop.set()
        upstream.stop()


class DiesRightAfterDiscovery:
    """Upstream.lock, except that the server is killed between the end of discovery (its closed-generation check)
    and the moment `_start` takes the lock to mark it ready: the window in which a crash is never noticed."""

    def __init__(self, upstream):
        self.inner, self.upstream, self.start_entries = threading.RLock(), upstream, 0

    def __enter__(self):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "_start":
            self.start_entries += 1
            if self.start_entries == 2:  # the second `with self.lock` in _start sets state = "ready"
                up = self.upstream
                os.kill(up.transport.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while up._closed_generation != up.generation and time.monotonic() < deadline:
                    time.sleep(0.01)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def test_a_server_that_dies_just_after_discovery_is_restarted_not_left_ready_and_dead():
    events = Events()
    upstream = Upstream(stdio_config("fragile", FAKE), dict(DEFAULTS, call_timeout=5.0, init_timeout=10.0), events)
    upstream.lock = DiesRightAfterDiscovery(upstream)
    upstream.start()
    ticker = Ticker(upstream)
    try:
        assert events.ready.wait(20)
        deadline = time.monotonic() + 20
        answer = {}
        while time.monotonic() < deadline:  # calls get a real answer once the server is back
            box, done = call_upstream(upstream, "echo", {"text": "still there?"})
            assert done.wait(15)
            answer = box
            if box["response"] is not None:
                break
        assert answer.get("response") is not None, f"every call fails, nothing restarts it: {answer.get('text')}"
        assert text_of(answer["response"]) == "still there?"
    finally:
        ticker.stop.set()
        upstream.stop()


SETSID_SERVER = """
import os, runpy, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
fake = sys.argv[2]
sys.argv = [fake]
runpy.run_path(fake)["main"]()
time.sleep(1.5)  # a server that takes a moment to exit after its stdin closes
"""


@linux_only
def test_a_client_that_vanishes_with_a_call_in_flight_still_gets_every_upstream_session_ended(home, tmp_path):
    """The client closes both pipes while a call runs: stdin EOF starts shutdown, the in-flight call's error hits
    EPIPE, and the client-gone handler os._exit()s while shutdown is still ending the other upstreams."""
    script, pid_file = tmp_path / "setsid_server.py", tmp_path / "grandchild.pid"
    recv_log = tmp_path / "busy.recv"
    script.write_text(SETSID_SERVER)
    cli("add", "busy", "--", *FAKE, "--recv-log", str(recv_log))
    cli("add", "daemonizing", "--", PY, str(script), str(pid_file), FAKE[1])
    gateway = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    grandchild = None
    try:
        def send(message):
            gateway.stdin.write((json.dumps(message) + "\n").encode())
            gateway.stdin.flush()

        def receive(msg_id):
            while True:
                message = json.loads(gateway.stdout.readline())
                if message.get("id") == msg_id:
                    return message

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        receive(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        receive(2)
        grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), what="the grandchild"))
        send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "busy__slow",
                                                                            "arguments": {"seconds": 30}}})
        wait_until(lambda: any(m.get("method") == "tools/call" for m in received(recv_log)),
                   what="the call to be running upstream")
        gateway.stdout.close()
        gateway.stdin.close()
        gateway.wait(30)
        wait_until(lambda: not alive(grandchild), timeout=10,
                   what="the upstream's setsid grandchild to end with Coffer")
    finally:
        if gateway.poll() is None:
            gateway.kill()
        if grandchild and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# -- 2. hostile or broken upstreams --------------------------------------------------------------------------------

@pytest.mark.parametrize("tool", ["html", "cut"])
def test_an_http_reply_that_cannot_hold_the_answer_fails_the_call_at_once(http_stub, tool):
    """200 text/html (a sign-in page or proxy), or an SSE response that ends without the reply: Coffer knows
    there will be no answer, yet the call waits for call_timeout (here 300 s; the test waits 20)."""
    upstream, ticker = start_upstream(http_config("stub", http_stub.url), call_timeout=300.0, init_timeout=10.0)
    try:
        box, done = call_upstream(upstream, tool)
        assert done.wait(20), "no answer: the call waits for call_timeout"
        assert box["response"] is None and box["failure"] == "error"
    finally:
        ticker.stop.set()
        upstream.stop()


def test_stopping_an_http_upstream_ends_its_server_stream_and_threads(http_stub):
    """close() sends DELETE (which a server may refuse) but never ends the GET stream it opened, so every stop or
    restart leaves a connection and its reader thread behind, plus the pool's idle POST workers."""
    upstream, ticker = start_upstream(http_config("leaky", http_stub.url), call_timeout=30.0, init_timeout=10.0)
    ticker.stop.set()
    wait_until(lambda: http_stub.state.get_streams_open, timeout=10, what="the server stream to open")
    assert http_stub.state.get_streams_open == 1
    upstream.stop()
    assert http_stub.state.get_streams_closed.wait(10), "the server stream is still open after stop()"

    def left():
        return [t.name for t in threading.enumerate() if t.name.startswith("coffer-leaky-")]

    try:
        wait_until(lambda: not left(), timeout=10, what="the stopped upstream's threads to end")
    except AssertionError:
        raise AssertionError(f"threads left behind by a stopped upstream: {left()}") from None


DEEP_RESULT_SERVER = r"""
import json, sys
for raw in sys.stdin.buffer:
    message = json.loads(raw)
    msg_id, method = message.get("id"), message.get("method")
    if method == "initialize":
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "deep"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "deep", "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        depth = 100000  # legal JSON, too deep for Coffer to decode: the reader skips it
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"content":[],"x":%s%s}}\n'
                         % (msg_id, "[" * depth, "]" * depth))
        sys.stdout.flush()
        continue
    elif msg_id is not None:  # e.g. the server/discover probe: a handshake-era server does not know it
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id,
                                     "error": {"code": -32601, "message": "Method not found"}}) + "\n")
        sys.stdout.flush()
        continue
    else:
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n")
    sys.stdout.flush()
"""


def test_a_reply_too_deep_to_decode_fails_its_call_at_once(tmp_path):
    """An oversized reply fails the call it answers at once (request_id_in on its head); a reply that is skipped
    because it cannot be decoded is not matched to its call, which then waits for call_timeout."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP_RESULT_SERVER)
    upstream, ticker = start_upstream(stdio_config("deep", [PY, str(script)]), call_timeout=300.0,
                                      init_timeout=10.0)
    try:
        box, done = call_upstream(upstream, "deep")
        assert done.wait(20), "no answer: the call waits for call_timeout"
        assert box["response"] is None
    finally:
        ticker.stop.set()
        upstream.stop()


# -- 3. secrets and terminals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("secret", ['quo"ted-secret-value', "line-one-secret\nline-two-secret",
                                    "back\\slash-secret-value"])
def test_json_output_redacts_secrets_that_json_escapes(home, secret):
    """say_json redacts after encoding: a stored secret holding ", \\ or a newline (a PEM key) is printed as its
    JSON escape and escapes redaction in every --json output."""
    cli("secret", "set", "KEY", input=secret)
    cli("add", "t", "--", *FAKE)
    result = cli("call", "t__echo", json.dumps({"text": f"the key is {secret}"}))
    assert secret not in json.loads(result.stdout)["content"][0]["text"]
    assert "***" in result.stdout


def test_a_secret_in_a_command_argument_is_redacted_like_any_expanded_reference(home):
    """_make_transport registers what env/headers/url references expand to, but not the command's arguments."""
    secret = "hunter2-argument-secret"
    cli("add", "leaky", "--", PY, "-c",
        "import sys; sys.stderr.write('bad token ' + sys.argv[1] + chr(10)); sys.exit(3)", "${LEAKY_TOKEN}")
    result = cli("tools", check=False, env={"LEAKY_TOKEN": secret})
    listing = cli("list")
    vault_bytes = b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("coffer.db"))
    assert secret not in result.stdout + result.stderr + listing.stdout
    assert secret.encode() not in vault_bytes


def test_credentials_in_a_server_url_are_not_stored_or_printed(home):
    """--env and --header literals go to the secret store; a URL's userinfo or api_key is stored and printed."""
    cli("add", "hosted", "--transport", "http", "--url", "https://user:s3cr3t-pass@127.0.0.1:9/mcp")
    listing = cli("list").stdout
    vault_bytes = b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("coffer.db"))
    assert "s3cr3t-pass" not in listing
    assert b"s3cr3t-pass" not in vault_bytes


HOSTILE_AS = r"""
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
EVIL = "\x1b]0;retitled\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J"
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, status, obj, headers=()):
        data = json.dumps(obj).encode()
        self.send_response(status)
        for k, v in headers: self.send_header(k, v)
        self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def origin(self): return "http://127.0.0.1:%d" % self.server.server_address[1]
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/register":
            return self.send(201, {"client_id": "c1"})
        challenge = 'Bearer resource_metadata="%s/.well-known/oauth-protected-resource/mcp"' % self.origin()
        self.send(401, {}, [("WWW-Authenticate", challenge)])
    def do_GET(self):
        o = self.origin()
        if self.path.startswith("/.well-known/oauth-protected-resource"):
            return self.send(200, {"resource": o + "/mcp", "authorization_servers": [o]})
        if self.path.startswith("/.well-known/oauth-authorization-server"):
            return self.send(200, {"issuer": o, "authorization_endpoint": o + "/authorize" + EVIL,
                                   "token_endpoint": o + "/token", "registration_endpoint": o + "/register",
                                   "code_challenge_methods_supported": ["S256"]})
        self.send(404, {})
server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def test_coffer_auth_prints_no_terminal_control_characters_from_the_authorization_server(home, tmp_path):
    """oauth_login writes the authorization URL (from remote metadata) to the terminal as is: OSC 0 retitles the
    window, OSC 52 writes the clipboard, CSI 2J clears the screen."""
    script = tmp_path / "hostile_as.py"
    script.write_text(HOSTILE_AS)
    server = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        cli("add", "evil", "--transport", "http", "--url", f"http://127.0.0.1:{port}/mcp")
        result = cli("auth", "evil", "--no-browser", "--timeout", "1", check=False)
        output = result.stdout + result.stderr
        assert "\x1b" not in output and "\x07" not in output
    finally:
        server.kill()
        server.wait(10)


# -- 4. memory bounds -------------------------------------------------------------------------------------------

def test_many_empty_data_lines_keep_the_sse_parser_within_its_limit():
    """read_sse_events counts an empty `data:` line as 1 byte, but it costs a list slot and, at dispatch,
    an 80-byte buffer in bytes.join: such lines never reach the limit, and take 15 times their size on the wire.
    The event is as many lines as fit the limit several times over, whatever the limit; a small one keeps the
    traced run short."""
    limit = 8 << 20
    lines = limit // 32

    class Stream:
        n = 0

        def readline(self, limit):
            self.n += 1
            return b"data:\n" if self.n <= lines else (b"\n" if self.n == lines + 1 else b"")

    tracemalloc.start()
    try:
        list(read_sse_events(Stream().readline, limit))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * lines * len(b"data:\n"), f"peak {peak >> 20} MiB for {lines * 6 >> 20} MiB on the wire"


@linux_only
def test_a_large_batch_from_the_client_keeps_the_gateway_memory_bounded(home):
    """A 3 MB batch of `{}` makes ~107 MB of error replies, all held until the burst ends, and ~400 MB RSS; at
    max_message_bytes (64 MiB) the same line costs gigabytes."""
    gateway = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    peak, stop, last_answered = [0], threading.Event(), threading.Event()

    def drain():  # reads everything; notes the answer to the ping sent after the batch
        tail = b""
        while chunk := gateway.stdout.read1(1 << 20):
            if b'"last"' in tail + chunk[:16] or b'"last"' in chunk:
                last_answered.set()
            tail = chunk[-16:]

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kb(gateway.pid) or 0)
            time.sleep(0.02)

    threading.Thread(target=drain, daemon=True).start()
    threading.Thread(target=watch, daemon=True).start()
    try:
        gateway.stdin.write(b"[" + b",".join([b"{}"] * 1_000_000) + b"]\n")
        gateway.stdin.write(b'{"jsonrpc":"2.0","id":"last","method":"ping"}\n')
        gateway.stdin.flush()
        # The ping is answered once the batch before it has been answered (or refused) in full.
        assert last_answered.wait(120) or peak[0] >= 250 * 1024, "the ping after the batch was never answered"
        assert peak[0] < 250 * 1024, f"gateway RSS peaked at {peak[0] >> 10} MB for a 3 MB line"
    finally:
        stop.set()
        gateway.kill()
        gateway.wait(10)


def test_a_refused_add_changes_no_secret(home):
    """cmd_add moves literals into the secret store before Vault.add_server validates anything: a refused
    `add --replace` still swaps the running server's key, and a refused plain `add` leaves a numbered twin."""
    cli("add", "t", "--env", "API_KEY=old-key-value", "--", *FAKE)
    before = (home / "secrets.json").read_text()
    refused = cli("add", "t", "--replace", "--env", "API_KEY=new-key-value", "--timeout", "-5", "--", *FAKE,
                  check=False)
    assert refused.returncode == 1
    refused = cli("add", "t", "--env", "API_KEY=third-value", "--", *FAKE, check=False)
    assert refused.returncode == 1
    assert (home / "secrets.json").read_text() == before
