"""Remote upstreams as users meet them (issue 13): legacy HTTP+SSE servers, transport auto-detection, and
OAuth-protected servers.

Real components throughout: the published server-everything in `sse` and `streamableHttp` modes, a real OAuth
authorization server and protected MCP server built on the official SDK's server-side auth
(fixtures/oauth_server.py), the official SDK client in front of `coffer serve`, and a stand-in browser
(fixtures/fake_browser.py) that follows the authorization redirect the way a browser does after "Allow".
"""

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

import coffer
from conftest import COFFER, EVERYTHING_JS, PY, ROOT, TIME_SERVER, cli, needs_node

OAUTH_SERVER = ROOT / "tests" / "fixtures" / "oauth_server.py"
FAKE_BROWSER = ROOT / "tests" / "fixtures" / "fake_browser.py"


# -- helpers ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Everything:
    """server-everything over HTTP (mode 'sse' or 'streamableHttp') on a fixed loopback port."""

    def __init__(self, mode: str):
        self.mode, self.port = mode, free_port()
        self.path = "/sse" if mode == "sse" else "/mcp"
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def start(self) -> None:
        self.proc = subprocess.Popen(["node", str(EVERYTHING_JS), self.mode], env={**os.environ, "PORT": str(self.port)},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


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


@contextlib.contextmanager
def oauth_server(tmp_path, *args):
    """fixtures/oauth_server.py in a subprocess; yields what it printed: mcp, issuer, control, client_metadata."""
    log = open(tmp_path / f"oauth-server-{uuid.uuid4().hex[:6]}.log", "w")
    proc = subprocess.Popen([PY, str(OAUTH_SERVER), *args], stdout=subprocess.PIPE, stderr=log, text=True)
    box = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(30)
    try:
        assert box.get("line"), f"the OAuth fixture did not start: {(tmp_path / log.name).read_text()[-2000:]}"
        yield json.loads(box["line"])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def control(info, path: str, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(info["control"] + path, data=data, method="POST" if data is not None or
                                     path != "/state" else "GET", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def browser_env(tmp_path, mode: str = "follow") -> dict:
    """BROWSER for Python's webbrowser module: a one-line wrapper running fixtures/fake_browser.py."""
    wrapper = tmp_path / "browser.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{PY}" "{FAKE_BROWSER}" "$@"\n')
    wrapper.chmod(0o755)
    return {"BROWSER": str(wrapper), "FAKE_BROWSER_MODE": mode, "FAKE_BROWSER_LOG": str(tmp_path / "browser.log")}


def through_gateway(tmp_path, body, **client_kwargs):
    """Run ``body(client)`` with the official SDK client connected to `coffer serve`; the gateway's stderr goes
    to a file under tmp_path (scanned for tokens)."""
    async def main():
        with open(tmp_path / f"serve-{uuid.uuid4().hex[:6]}.log", "w") as errlog:
            params = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
            async with Client(stdio_client(params, errlog=errlog),
                              client_info=types.Implementation(name="remote-test", version="1"),
                              **client_kwargs) as client:
                return await body(client)
    return anyio.run(main)


def text_of(result) -> str:
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


async def call_until_ok(client, name, arguments, timeout=30.0):
    """Call a tool until it succeeds: a server that reconnects, or restarts after a login, answers errors (or is
    briefly not listed) until it is back.  Returns the successful result; the last failure after ``timeout``."""
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


def server_row(name: str, status: str | None = None, timeout: float = 15.0) -> dict:
    """The server as `coffer list --json` shows it; with ``status``, once it has that status (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = json.loads(cli("list", "--json").stdout)["servers"]
        row = next(row for row in rows if row["name"] == name)
        if status is None or row["status"] == status or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


def secrets_file(home: Path) -> dict:
    path = home / "secrets.json"
    return json.loads(path.read_text()) if path.exists() else {}


def assert_nothing_leaks(home: Path, tmp_path: Path, transcript: Transcript, values) -> None:
    """No token, code or client secret in any byte Coffer wrote outside its secret store, or printed."""
    values = [v.encode() for v in values if len(v) >= 8]
    assert values
    places = [(str(p), p.read_bytes()) for p in home.rglob("*") if p.is_file() and not p.name.startswith("secrets.json")]
    places += [(str(p), p.read_bytes()) for p in tmp_path.glob("serve-*.log")]
    places += [(f"cli output {i}", text.encode()) for i, text in enumerate(transcript.texts)]
    assert any(name.endswith("coffer.db") for name, _ in places)
    for name, data in places:
        for value in values:
            assert value not in data, f"a secret value reached {name}"


# -- the parts a user never sees, on hostile and edge input ---------------------------------------------------

def test_www_authenticate_parsing_finds_the_bearer_challenge_among_others():
    parsed = coffer.parse_www_authenticate(
        'Basic realm="x", Bearer error="invalid_token", resource_metadata="https://a.example/.well-known/'
        'oauth-protected-resource/mcp", scope="files:read files:write", error_description="a \\"quoted\\" word"')
    assert parsed["basic"] == {"realm": "x"}
    assert parsed["bearer"]["resource_metadata"] == "https://a.example/.well-known/oauth-protected-resource/mcp"
    assert parsed["bearer"]["scope"] == "files:read files:write"
    assert parsed["bearer"]["error_description"] == 'a "quoted" word'
    assert coffer.parse_www_authenticate("Bearer") == {"bearer": {}}
    assert coffer.parse_www_authenticate(None) == {}
    assert coffer.parse_www_authenticate('Bearer scope="' + "x" * 100_000) is not None  # bounded, no crash


@pytest.mark.parametrize("resource, matches", [
    ("https://mcp.example.com/mcp", True),
    ("https://MCP.example.com:443/mcp/", True),
    ("https://mcp.example.com", True),            # the origin covers every path on it
    ("https://mcp.example.com/mc", False),        # a prefix of a segment is not a parent
    ("https://mcp.example.com/mcp/sub", False),
    ("https://other.example.com/mcp", False),
    ("http://mcp.example.com/mcp", False),        # another scheme is another origin
    ("https://mcp.example.com:8443/mcp", False),
    ("https://mcp.example.com/mcp#frag", False),
    (None, False),
])
def test_protected_resource_metadata_must_name_this_server(resource, matches):
    assert coffer.resource_matches("https://mcp.example.com/mcp", resource) is matches


def test_authorization_server_metadata_is_looked_for_in_the_order_the_spec_gives():
    assert coffer.authorization_server_metadata_urls("https://auth.example.com/tenant1") == [
        "https://auth.example.com/.well-known/oauth-authorization-server/tenant1",
        "https://auth.example.com/.well-known/openid-configuration/tenant1",
        "https://auth.example.com/tenant1/.well-known/openid-configuration"]
    assert coffer.authorization_server_metadata_urls("https://auth.example.com") == [
        "https://auth.example.com/.well-known/oauth-authorization-server",
        "https://auth.example.com/.well-known/openid-configuration"]


def test_sse_reader_keeps_memory_bounded_and_reports_oversized_events():
    huge_line = b"data: " + b'{"jsonrpc":"2.0","id":7,"result":{"x":"' + b"a" * 300_000 + b'"}}\n\n'
    many_lines = b"".join(b"data: " + b"b" * 1000 + b"\n" for _ in range(500)) + b"\n"
    stream = io.BytesIO(b": keepalive\n\nevent: endpoint\ndata: /message?s=1\r\n\r\n" + huge_line + many_lines
                        + b'data: {"jsonrpc":"2.0","method":"ok"}\n\n' + b"data: unfinished")
    events = list(coffer.read_sse_events(stream.readline, 10_000))
    assert [e.kind for e in events] == ["endpoint", "message", "message", "message"]
    assert events[0].data == b"/message?s=1"
    assert events[1].oversized > 300_000 and len(events[1].data) <= 4096
    assert coffer.request_id_in(events[1].data) == 7  # the oversized answer can still be failed by id
    assert events[2].oversized > 10_000 and len(events[2].data) <= 4096
    assert json.loads(events[3].data) == {"jsonrpc": "2.0", "method": "ok"}  # and the stream goes on


# -- legacy HTTP+SSE and auto-detection --------------------------------------------------------------------------

@pytest.fixture
def http_everything():
    servers = {"sse": Everything("sse"), "http": Everything("streamableHttp")}
    yield servers
    for server in servers.values():
        server.stop()


@needs_node
def test_auto_detects_each_transport_and_aggregates_them_beside_stdio(home, tmp_path, http_everything):
    added_sse = cli("add", "evsse", "--url", http_everything["sse"].url).stdout
    added_http = cli("add", "evhttp", "--url", http_everything["http"].url).stdout
    cli("add", "time", "--", *TIME_SERVER)
    assert "HTTP+SSE" in added_sse and "Streamable HTTP" in added_http
    assert {s["name"]: s["transport"] for s in json.loads(cli("list", "--json").stdout)["servers"]} == {
        "evsse": "sse", "evhttp": "http", "time": "stdio"}

    async def body(client):
        tools = {t.name for t in (await client.list_tools()).tools}
        progress = []

        async def on_progress(value, total, message):
            progress.append(value)

        long = await client.call_tool("evsse__trigger-long-running-operation", {"duration": 1, "steps": 4},
                                      progress_callback=on_progress)
        echoes = [text_of(await client.call_tool(f"{name}__echo", {"message": f"via {name}"}))
                  for name in ("evsse", "evhttp")]
        clock = await client.call_tool("time__get_current_time", {"timezone": "UTC"})
        return tools, progress, long, echoes, clock

    tools, progress, long, echoes, clock = through_gateway(tmp_path, body)
    assert {"evsse__echo", "evhttp__echo", "time__get_current_time", "evsse__get-sum"} <= tools
    assert not long.is_error and "Long running operation completed" in text_of(long)
    assert progress == [1, 2, 3, 4]
    assert echoes == ["Echo: via evsse", "Echo: via evhttp"]
    assert not clock.is_error and "UTC" in text_of(clock)


@needs_node
def test_a_dropped_sse_stream_fails_the_call_in_flight_clearly_and_reconnects(home, tmp_path):
    server = Everything("sse")
    try:
        cli("add", "evsse", "--url", server.url, "--transport", "sse")
        cli("config", "max_restarts", "30")  # the server is down for a moment: keep trying meanwhile

        async def body(client):
            before = await client.call_tool("evsse__echo", {"message": "before"})
            progress, box = [], {}

            async def long_call():
                async def on_progress(value, total, message):
                    progress.append(value)
                box["long"] = await client.call_tool("evsse__trigger-long-running-operation",
                                                     {"duration": 30, "steps": 30}, progress_callback=on_progress)

            async with anyio.create_task_group() as group:
                group.start_soon(long_call)
                with anyio.fail_after(20):
                    while not progress:
                        await anyio.sleep(0.05)
                await anyio.to_thread.run_sync(server.restart)  # the stream drops mid-call
            after = await call_until_ok(client, "evsse__echo", {"message": "after"})
            return before, box["long"], progress, after

        before, long, progress, after = through_gateway(tmp_path, body)
    finally:
        server.stop()
    assert text_of(before) == "Echo: before"
    assert long.is_error and 0 < len(progress) < 30
    assert "SSE stream" in text_of(long) and "not retried" in text_of(long)
    assert text_of(after) == "Echo: after" and not after.is_error
    assert server_row("evsse", "ready")["status"] == "ready"


class _HostileSse(BaseHTTPRequestHandler):
    """An SSE server whose endpoint event points at another origin."""

    def do_POST(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"event: endpoint\ndata: {self.server.endpoint}\n\n".encode())
        self.wfile.flush()
        time.sleep(1)

    def log_message(self, *args):
        pass


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.server.seen.append(dict(self.headers))
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args):
        pass


def test_an_sse_endpoint_on_another_origin_is_refused_and_gets_no_credentials(home, tmp_path, transcript):
    elsewhere = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    elsewhere.seen = []
    hostile = ThreadingHTTPServer(("127.0.0.1", 0), _HostileSse)
    hostile.endpoint = f"http://localhost:{elsewhere.server_address[1]}/message?sessionId=1"
    for server in (elsewhere, hostile):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{hostile.server_address[1]}/sse"
    env = {"EVIL_KEY": "sk-test-0123456789abcdef"}
    try:
        added = transcript.cli("add", "evil", "--url", url, "--header", "X-Api-Key=${EVIL_KEY}", env=env)
        transcript.cli("add", "evil2", "--url", url, "--transport", "sse", "--header", "X-Api-Key=${EVIL_KEY}",
                       env=env)
        listed = transcript.cli("tools", env=env, check=False)
        row = server_row("evil2")
    finally:
        hostile.shutdown()
        elsewhere.shutdown()
    assert "refused" in added.stdout and "credentials never leave the configured origin" in added.stdout
    assert row["status"] == "failed" and "refused" in row["detail"]
    assert listed.returncode == 1 and "evil2 did not start" in listed.stderr
    assert elsewhere.seen == []
    assert all("sk-test-0123456789abcdef" not in text for text in transcript.texts)


class _Redirecting(BaseHTTPRequestHandler):
    """Sends every request elsewhere: POST with a 307 (which keeps method, body and, in a careless client, the
    credentials), GET with a 302."""

    def _redirect(self, code):
        self.send_response(code)
        self.send_header("Location", self.server.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        self._redirect(307)

    def do_GET(self):  # noqa: N802
        self._redirect(302)

    def log_message(self, *args):
        pass


def test_a_redirect_to_another_origin_is_refused_and_the_credentials_stay_home(home, tmp_path, transcript):
    elsewhere = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    elsewhere.seen = []
    redirecting = ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    redirecting.target = f"http://localhost:{elsewhere.server_address[1]}"
    for server in (elsewhere, redirecting):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{redirecting.server_address[1]}/mcp"
    env = {"REDIR_KEY": "sk-redirect-0123456789"}
    try:
        added = transcript.cli("add", "redir", "--url", url, "--header", "Authorization=Bearer ${REDIR_KEY}", env=env)
        transcript.cli("add", "redir2", "--url", url, "--transport", "http", "--header",
                       "Authorization=Bearer ${REDIR_KEY}", env=env)
        listed = transcript.cli("tools", env=env, check=False)
        row = server_row("redir2")
    finally:
        redirecting.shutdown()
        elsewhere.shutdown()
    assert "refused, credentials never leave the configured origin" in added.stdout
    assert row["status"] == "failed" and "redirected to http://localhost" in row["detail"]
    assert listed.returncode == 1 and "redir2 did not start" in listed.stderr
    assert elsewhere.seen == []
    assert all("sk-redirect-0123456789" not in text for text in transcript.texts)


# -- OAuth --------------------------------------------------------------------------------------------------------

def test_oauth_login_then_calls_refresh_before_expiry_and_on_401_and_no_token_leaks(home, tmp_path, transcript):
    with oauth_server(tmp_path, "--token-lifetime", "3") as info:
        added = transcript.cli("add", "prot", "--url", info["mcp"])
        assert "prot needs a login: run `coffer auth prot`" in added.stdout

        assert "run `coffer auth prot`" in server_row("prot")["detail"]  # `list` says so from the start

        async def before_login(client):
            listed = {t.name for t in (await client.list_tools()).tools}
            # A server that failed at its last start is not waited for (issue 23): wait here for this session's
            # one attempt to be logged, so the count below sees it.
            with anyio.fail_after(30):
                while "start failed" not in "".join(p.read_text() for p in tmp_path.glob("serve-*.log")):
                    await anyio.sleep(0.1)
            return client.instructions, listed

        instructions, tools = through_gateway(tmp_path, before_login)
        assert "coffer auth NAME): prot." in instructions
        assert not any(name.startswith("prot__") for name in tools)
        row = server_row("prot")
        assert row["status"] == "failed" and "run `coffer auth prot`" in row["detail"]
        serve_log = "".join(p.read_text() for p in tmp_path.glob("serve-*.log"))
        assert serve_log.count("start failed") == 1  # a login is not retried: retrying cannot fix it

        login = transcript.cli("auth", "prot", env=browser_env(tmp_path))
        assert "logged in to prot (scopes: mcp:tools)" in login.stdout
        assert (tmp_path / "browser.log").read_text().startswith(info["issuer"] + "/authorize?")
        assert "oauth.prot" in secrets_file(home)
        if os.name == "posix":
            assert stat.S_IMODE((home / "secrets.json").stat().st_mode) == 0o600

        async def body(client):
            who = json.loads(text_of(await client.call_tool("prot__whoami", {})))
            refused_before = len(control(info, "/state")["unauthorized"])
            await anyio.sleep(3.5)  # the access token expires
            after_expiry = await client.call_tool("prot__echo", {"message": "after expiry"})
            state = control(info, "/state")
            refreshed, refused_at_expiry = state["refreshes"], len(state["unauthorized"]) - refused_before
            control(info, "/expire-access-tokens", {})  # the server stops accepting it before Coffer expects
            after_401 = await client.call_tool("prot__echo", {"message": "after a 401"})
            return who, after_expiry, refreshed, refused_at_expiry, after_401

        who, after_expiry, refreshed, refused_at_expiry, after_401 = through_gateway(tmp_path, body)
        state = control(info, "/state")
        logout = transcript.cli("auth", "prot", "--logout")
        revoked = control(info, "/state")["revoked"]

    assert who["resource"] == info["mcp"] and who["scopes"] == ["mcp:tools"]
    assert text_of(after_expiry) == "protected echo: after expiry" and refreshed >= 1
    assert refused_at_expiry == 0  # refreshed before it expired: the server never had to refuse it
    assert text_of(after_401) == "protected echo: after a 401" and state["refreshes"] > refreshed
    assert state["unauthorized"][-1].startswith("POST")  # that refusal, answered by refreshing and retrying
    assert [a["resource"] for a in state["authorize"]] == [info["mcp"]]            # RFC 8707, both legs
    assert {t["resource"] for t in state["token"]} == {info["mcp"]}
    assert state["registered"] and state["registered"][0]["auth_method"] == "none"  # a public client (DCR)
    assert state["bearer_at_authorization_server"] == []  # tokens go to the resource's origin only
    assert "logged out of prot (revoked at the authorization server)" in logout.stdout and revoked
    assert "oauth.prot" not in secrets_file(home)
    assert_nothing_leaks(home, tmp_path, transcript, state["issued"])


def test_a_refused_refresh_asks_for_coffer_auth_and_a_new_login_brings_the_server_back(home, tmp_path, transcript):
    with oauth_server(tmp_path) as info:
        transcript.cli("add", "prot", "--url", info["mcp"])
        transcript.cli("auth", "prot", env=browser_env(tmp_path))

        async def body(client):
            first = await client.call_tool("prot__echo", {"message": "one"})
            control(info, "/config", {"refuse_refresh": True})
            control(info, "/expire-access-tokens", {})
            refused = await client.call_tool("prot__echo", {"message": "two"})
            forgotten = "oauth.prot" not in secrets_file(home)
            row = await anyio.to_thread.run_sync(server_row, "prot", "failed")
            control(info, "/config", {"refuse_refresh": False})
            await anyio.to_thread.run_sync(lambda: transcript.cli("auth", "prot", env=browser_env(tmp_path)))
            back = await call_until_ok(client, "prot__echo", {"message": "three"})
            return first, refused, forgotten, row, back

        first, refused, forgotten, row, back = through_gateway(tmp_path, body)
        issued = control(info, "/state")["issued"]
    assert text_of(first) == "protected echo: one"
    assert refused.is_error and "'prot' needs login: run `coffer auth prot`" in text_of(refused)
    assert "invalid_grant" in text_of(refused)
    assert forgotten
    assert row["status"] == "failed" and "run `coffer auth prot`" in row["detail"]
    assert text_of(back) == "protected echo: three"  # the running gateway picked up the new login
    assert_nothing_leaks(home, tmp_path, transcript, issued)


def test_resource_metadata_naming_another_server_is_refused_before_any_browser_opens(home, tmp_path, transcript):
    with oauth_server(tmp_path, "--prm-resource", "https://elsewhere.example/mcp") as info:
        transcript.cli("add", "prot", "--url", info["mcp"])
        login = transcript.cli("auth", "prot", check=False, env=browser_env(tmp_path))
        state = control(info, "/state")
    assert login.returncode == 1
    assert "https://elsewhere.example/mcp" in login.stderr and "refused (RFC 9728" in login.stderr
    assert not (tmp_path / "browser.log").exists() and state["authorize"] == [] and state["registered"] == []
    assert "oauth.prot" not in secrets_file(home)


def test_an_answer_with_another_state_is_refused_and_its_code_never_used(home, tmp_path, transcript):
    with oauth_server(tmp_path) as info:
        transcript.cli("add", "prot", "--url", info["mcp"])
        login = transcript.cli("auth", "prot", "--timeout", "20", check=False,
                               env=browser_env(tmp_path, "tamper-state"))
        state = control(info, "/state")
    assert login.returncode == 1 and "different state" in login.stderr
    assert len(state["authorize"]) == 1 and state["token"] == []  # the code was issued, never exchanged
    assert "oauth.prot" not in secrets_file(home)
    assert_nothing_leaks(home, tmp_path, transcript, state["issued"])


def test_client_identity_pre_registered_then_metadata_document_else_a_clear_error(home, tmp_path, transcript):
    secret = "pre-registered-secret-value-42"
    with oauth_server(tmp_path, "--no-dcr", "--client-id", "coffer-test", "--client-secret", secret) as info:
        transcript.cli("add", "pre", "--url", info["mcp"], "--oauth-client-id", "coffer-test",
                       "--oauth-client-secret-env", "PRE_SECRET")
        login = transcript.cli("auth", "pre", env={**browser_env(tmp_path), "PRE_SECRET": secret})
        pre_state = control(info, "/state")
    with oauth_server(tmp_path, "--no-dcr", "--cimd") as cimd_info:
        transcript.cli("config", "oauth_client_metadata_url", cimd_info["client_metadata"])
        transcript.cli("add", "cimd", "--url", cimd_info["mcp"])
        transcript.cli("auth", "cimd", env=browser_env(tmp_path))
        cimd_state = control(cimd_info, "/state")

        async def body(client):
            return json.loads(text_of(await client.call_tool("cimd__whoami", {})))

        who = through_gateway(tmp_path, body)
    with oauth_server(tmp_path, "--no-dcr") as info:
        transcript.cli("add", "none", "--url", info["mcp"])
        refused = transcript.cli("auth", "none", check=False, env=browser_env(tmp_path))

    assert "logged in to pre" in login.stdout
    assert [a["client_id"] for a in pre_state["authorize"]] == ["coffer-test"]
    assert [t["basic_auth"] for t in pre_state["token"]] == [True]  # its secret, as client_secret_basic
    assert pre_state["registered"] == []
    assert [a["client_id"] for a in cimd_state["authorize"]] == [cimd_info["client_metadata"]]
    assert cimd_state["cimd_fetches"] and cimd_state["registered"] == []
    assert who["client_id"] == cimd_info["client_metadata"]
    assert refused.returncode == 1 and "--oauth-client-id" in refused.stderr
    vault_bytes = (home / "coffer.db").read_bytes() + b"".join(
        p.read_bytes() for p in home.glob("coffer.db-*"))
    assert b"PRE_SECRET" in vault_bytes and secret.encode() not in vault_bytes  # the variable's name, never its value
    assert_nothing_leaks(home, tmp_path, transcript, pre_state["issued"] + cimd_state["issued"] + [secret])


def test_oauth_over_the_legacy_sse_transport(home, tmp_path, transcript):
    with oauth_server(tmp_path, "--transport", "sse") as info:
        added = transcript.cli("add", "osse", "--url", info["mcp"])
        transcript.cli("auth", "osse", env=browser_env(tmp_path))
        transport = server_row("osse")

        async def body(client):
            return await client.call_tool("osse__echo", {"message": "over sse"})

        result = through_gateway(tmp_path, body)
        state = control(info, "/state")
    assert "osse needs a login" in added.stdout
    assert transport["transport"] == "sse"
    assert text_of(result) == "protected echo: over sse"
    assert state["bearer_at_authorization_server"] == []
    assert_nothing_leaks(home, tmp_path, transcript, state["issued"])
