"""The shared service over Streamable HTTP (issue 22, "Other agents over HTTP" and "Security"): the real MCP SDK
client in both protocol eras through a real service and real upstreams, and raw HTTP for what a hostile client
sends (no token, another Host or Origin, oversized or malformed bodies, a client that sends nothing)."""

import base64
import http.client
import json
import os
import socket
import subprocess
import time
from types import SimpleNamespace

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from coffer_src.service.http_wire import HostRule, decode_header_value, parameter_header_problem

from conftest import (
    COFFER,
    FAKE,
    NODE_MODULES,
    PY,
    ROOT,
    cli,
    everything_cmd,
    needs_node,
    serve_a_newer_build,
    service_pid,
    stop_service,
    wait_until,
)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the service tests use POSIX process control")

MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}}


# -- the service and its endpoint -------------------------------------------------------------------------------
def add_token(name):
    return cli("token", "add", name).stdout.strip()


def service_status():
    return json.loads(cli("status", "--json").stdout)


@pytest.fixture
def endpoint(home, monkeypatch):
    """A running service with an HTTP endpoint on a free loopback port, and a token named "agent"."""
    monkeypatch.setenv("COFFER_SERVE_MODE", "service")
    home.mkdir(parents=True, exist_ok=True)

    def start(address="127.0.0.1:0", **settings):
        for key, value in settings.items():
            cli("config", key, str(value))
        out = cli("service", "start", "--http", address).stdout
        http = service_status()["service"]["http"]
        port = int(http["url"].rsplit(":", 1)[1].split("/")[0])
        return SimpleNamespace(url=http["url"], port=port, out=out, loopback=http["loopback"])

    token = add_token("agent")
    state = SimpleNamespace(start=start, token=token, home=home)
    yield state
    stop_service(home)


def spawns(path):
    return path.read_text().split() if path.exists() else []


def text_of(result):
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


def sdk_client(url, token, mode, name, http, **kwargs):
    return Client(streamable_http_client(url, http_client=http), mode=mode,
                  client_info=types.Implementation(name=name, version="7"), **kwargs)


def bearer(token):
    return create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})


# -- raw HTTP ---------------------------------------------------------------------------------------------------
class Reply(SimpleNamespace):
    def json(self):
        return json.loads(self.body)


def raw(port, method="POST", body=None, headers=None, token=None, host=None, read=True, path="/mcp"):
    """One request on a fresh connection, exactly as given (Host and all); the reply, or the open response."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host if host is not None else f'127.0.0.1:{port}'}"]
    fields = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if token:
        fields["Authorization"] = f"Bearer {token}"
    fields.update(headers or {})
    lines += [f"{k}: {v}" for k, v in fields.items() if v is not None]
    if (data or method == "POST") and "Content-Length" not in fields:
        lines.append(f"Content-Length: {len(data)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    response = http.client.HTTPResponse(sock)
    response.begin()
    if not read:
        return response, sock
    payload = response.read()
    sock.close()
    return Reply(status=response.status, headers={k.lower(): v for k, v in response.getheaders()}, body=payload)


def modern_headers(method, name=None, version=MODERN):
    headers = {"MCP-Protocol-Version": version, "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def modern(method, params=None, msg_id=1):
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": {**(params or {}), "_meta": META}}


def sse_messages(body: bytes):
    return [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]


def next_frame(stream, timeout=30.0):
    """The next JSON-RPC message on an open SSE response (keep-alive comments skipped; a stream that stays
    quiet for ``timeout`` fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        assert line, "the stream ended"
        if line.startswith(b"data:"):
            return json.loads(line[5:])
    raise TimeoutError("no message on the stream")


def initialize(port, token, name="raw", path="/mcp"):
    reply = raw(port, body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": name, "version": "1"}}},
        token=token, path=path)
    assert reply.status == 200, reply
    session = reply.headers["mcp-session-id"]
    assert raw(port, body={"jsonrpc": "2.0", "method": "notifications/initialized"}, token=token,
               headers={"Mcp-Session-Id": session}, path=path).status == 202
    return session


def answer_of(reply, msg_id):
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        return next(m for m in sse_messages(reply.body) if m.get("id") == msg_id)
    return reply.json()


# -- real clients, real upstreams -------------------------------------------------------------------------------
def test_sdk_clients_of_both_eras_call_a_real_upstream_over_http(endpoint, tmp_path):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    ep = endpoint.start()
    assert ep.loopback and ep.url.startswith("http://127.0.0.1:") and "127.0.0.1" in ep.out
    results = {}

    async def session(mode, name, ready, leave):
        progress = []

        async def on_progress(value, total, message):
            progress.append(value)

        async with bearer(endpoint.token) as http, sdk_client(ep.url, endpoint.token, mode, name, http) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            echoed = text_of(await client.call_tool("a__echo", {"text": f"via {mode}"}))
            slow = await client.call_tool("a__slow", {"seconds": 0.3, "progress_every": 0.05},
                                          progress_callback=on_progress)
            results[mode] = (tools, echoed, bool(progress), slow.is_error)
            ready.set()
            await leave.wait()

    async def main():
        ready = [anyio.Event(), anyio.Event()]
        leave = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(session, "legacy", "claude-ish", ready[0], leave)
            group.start_soon(session, MODERN, "cursor-ish", ready[1], leave)
            for event in ready:
                await event.wait()
            results["status"] = await anyio.to_thread.run_sync(service_status)
            leave.set()

    anyio.run(main)
    for mode in ("legacy", MODERN):
        tools, echoed, progressed, failed = results[mode]
        assert "a__echo" in tools and echoed == f"via {mode}" and progressed and not failed
    assert len(spawns(log)) == 1
    sessions = [s for s in results["status"]["sessions"] if s["transport"] == "http"]
    assert sorted(s["era"] for s in sessions) == ["handshake", "modern"]
    assert {s["client"] for s in sessions} == {"agent"}, "the token's name is the client, not its clientInfo"
    assert all(s["calls"] == 2 for s in sessions)
    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    assert {row["client"] for row in rows if row["capability"] == "a__echo"} == {"agent"}


def test_a_profile_path_shows_an_http_client_only_that_profiles_tools(endpoint):
    cli("add", "a", "--", *FAKE, "--tools", "echo,fail")
    cli("add", "b", "--", *FAKE, "--tools", "echo")
    cli("profile", "add", "coding", "--include", "a")
    ep = endpoint.start()
    results = {}

    async def session(mode, url):
        async with bearer(endpoint.token) as http, sdk_client(url, endpoint.token, mode, "x", http) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            echoed = text_of(await client.call_tool("a__echo", {"text": "in"}))
            try:
                outside = await client.call_tool("b__echo", {"text": "out"})
                outside = text_of(outside) if outside.is_error else "answered"
            except MCPError as exc:
                outside = str(exc)
            results[(mode, url)] = (tools, echoed, outside)

    async def main():
        for mode in ("legacy", MODERN):
            await session(mode, ep.url + "/p/coding")
            await session(mode, ep.url)

    anyio.run(main)
    for mode in ("legacy", MODERN):
        tools, echoed, outside = results[(mode, ep.url + "/p/coding")]
        assert "a__echo" in tools and not any(name.startswith("b__") for name in tools) and echoed == "in"
        assert "profile 'coding'" in outside, outside
        tools, _, outside = results[(mode, ep.url)]
        assert {"a__echo", "b__echo"} <= tools and outside == "answered"  # the plain endpoint sees everything
    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    assert {row["profile"] for row in rows if row["capability"] == "a__echo"} == {"coding", None}
    unknown = raw(ep.port, body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}},
        token=endpoint.token, path="/mcp/p/codeing")
    assert unknown.status == 404 and b"coding" in unknown.body, "an unknown profile is refused, naming the close one"
    assert raw(ep.port, body={}, token=endpoint.token, path="/mcp/p/../mcp").status == 404
    scoped = initialize(ep.port, endpoint.token, path="/mcp/p/coding")
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    assert raw(ep.port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": scoped},
               path="/mcp/p/coding").status == 200
    assert raw(ep.port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": scoped}).status == 404, \
        "a profile's session is not reachable at the endpoint that sees everything"


def test_two_http_clients_and_a_stdio_relay_share_one_upstream_process(endpoint, tmp_path):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    second = add_token("second")
    ep = endpoint.start()
    answers = {}

    async def over_http(token, mode, ready, leave):
        async with bearer(token) as http, sdk_client(ep.url, token, mode, "x", http) as client:
            answers[token] = text_of(await client.call_tool("a__echo", {"text": token[-6:]}))
            ready.set()
            await leave.wait()

    async def over_stdio(ready, leave):
        params = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
        async with Client(params, mode="legacy", client_info=types.Implementation(name="relay", version="1")) \
                as client:
            answers["stdio"] = text_of(await client.call_tool("a__echo", {"text": "stdio"}))
            ready.set()
            await leave.wait()

    async def main():
        ready = [anyio.Event() for _ in range(3)]
        leave = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(over_http, endpoint.token, "legacy", ready[0], leave)
            group.start_soon(over_http, second, MODERN, ready[1], leave)
            group.start_soon(over_stdio, ready[2], leave)
            for event in ready:
                await event.wait()
            answers["status"] = await anyio.to_thread.run_sync(service_status)
            leave.set()

    anyio.run(main)
    assert answers[endpoint.token] == endpoint.token[-6:] and answers[second] == second[-6:]
    assert answers["stdio"] == "stdio"
    assert len(spawns(log)) == 1, "two HTTP clients and a stdio relay share one upstream process"
    upstream = next(u for u in answers["status"]["upstreams"] if u["name"] == "a")
    assert upstream["sessions"] == 3
    clients = sorted((s["client"], s["transport"]) for s in answers["status"]["sessions"])
    assert clients == [("agent", "http"), ("relay", "stdio"), ("second", "http")]


@needs_node
def test_server_everything_answers_http_clients_of_both_eras(endpoint):
    cli("add", "everything", "--", *everything_cmd())
    ep = endpoint.start()
    echoed = {}

    async def main():
        for mode in ("legacy", MODERN):
            async with bearer(endpoint.token) as http, sdk_client(ep.url, endpoint.token, mode, "e", http) as client:
                names = [t.name for t in (await client.list_tools()).tools]
                assert "everything__echo" in names
                echoed[mode] = text_of(await client.call_tool("everything__echo", {"message": mode}))

    anyio.run(main)
    assert all(mode in echoed[mode] for mode in ("legacy", MODERN)), echoed


@needs_node
def test_the_typescript_sdk_client_works_over_http(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start()
    sdk = NODE_MODULES / "sdk" / "dist" / "esm"
    if not sdk.exists():
        pytest.skip("the TypeScript MCP SDK is not installed (.ci/run installs it)")
    proc = subprocess.run(["node", str(ROOT / "tests" / "fixtures" / "ts_http_client.mjs"), str(sdk), ep.url,
                           endpoint.token], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["session"] and seen["version"] == "2025-11-25"
    assert "a__echo" in seen["tools"] and seen["echo"] == "from ts"
    assert seen["progress"] > 0 and seen["sample"] == "the TypeScript model says hi"


def test_sampling_reaches_the_http_client_that_called_in_both_eras(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start()
    asked = []

    async def sampling(ctx, params):
        asked.append(params.messages[0].content.text)
        return types.CreateMessageResult(role="assistant", model="m",
                                         content=types.TextContent(type="text", text="the model says hi"))

    async def main():
        answers = {}
        for mode in ("legacy", MODERN):
            async with bearer(endpoint.token) as http, sdk_client(ep.url, endpoint.token, mode, "s", http,
                                                                  sampling_callback=sampling) as client:
                answers[mode] = text_of(await client.call_tool("a__sample", {"prompt": f"from {mode}"}))
        return answers

    answers = anyio.run(main)
    assert answers == {"legacy": "the model says hi", MODERN: "the model says hi"}
    assert asked == ["from legacy", f"from {MODERN}"]


# -- tokens ------------------------------------------------------------------------------------------------------
def test_a_request_without_a_valid_token_is_refused(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start()
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": f"Basic {endpoint.token}"},
                    {"Authorization": f"Bearer {endpoint.token}x"}, {"Authorization": "Bearer " + "A" * 5000}):
        reply = raw(ep.port, body=body, headers=headers)
        assert reply.status == 401, (headers, reply)
        assert reply.headers["www-authenticate"].startswith("Bearer")
        assert reply.json()["error"]["code"] and "id" in reply.json()
    session = initialize(ep.port, endpoint.token)
    listed = raw(ep.port, body={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, token=endpoint.token,
                 headers={"Mcp-Session-Id": session})
    assert listed.status == 200
    assert "removed" in cli("token", "rm", "agent").stdout
    refused = raw(ep.port, body={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, token=endpoint.token,
                  headers={"Mcp-Session-Id": session})
    assert refused.status == 401
    again = add_token("agent")  # the same name, a new token: the old token's session is not its
    wait_until(lambda: raw(ep.port, body={"jsonrpc": "2.0", "id": 4, "method": "tools/list"}, token=again,
                           headers={"Mcp-Session-Id": session}).status == 404, what="the old session to end")

    async def sdk_with_a_wrong_token():
        async with bearer("coffer_not-a-token") as http, sdk_client(ep.url, "x", "legacy", "x", http) as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 varies with its version
        anyio.run(sdk_with_a_wrong_token)


def test_a_token_is_shown_once_and_stored_only_as_a_hash(endpoint):
    ep = endpoint.start()
    initialize(ep.port, endpoint.token)
    listing = cli("token", "list").stdout + cli("token", "list", "--json").stdout
    assert "agent" in listing and endpoint.token not in listing
    secret_part = endpoint.token.removeprefix("coffer_").encode()
    for path in endpoint.home.rglob("*"):
        if path.is_file():
            assert secret_part not in path.read_bytes(), f"{path} holds the token"
    rows = json.loads(cli("token", "list", "--json").stdout)
    assert rows[0]["name"] == "agent" and rows[0]["last_used"]
    assert cli("token", "add", "agent", check=False).returncode == 1, "a name is one token"
    assert cli("token", "add", "bad name", check=False).returncode == 1


# -- Host, Origin, CORS ------------------------------------------------------------------------------------------
def test_another_host_or_origin_is_refused_and_no_cors_unless_configured(endpoint):
    ep = endpoint.start()
    body = {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": META}}
    headers = modern_headers("server/discover")
    for host in ("evil.example.com", f"evil.example.com:{ep.port}", f"localhost:{ep.port + 1}", "", "10.1.2.3"):
        reply = raw(ep.port, body=body, headers=headers, token=endpoint.token, host=host)
        assert reply.status == 421, (host, reply)
    for origin in ("http://evil.example.com", f"http://evil.example.com:{ep.port}", "null",
                   f"http://localhost:{ep.port + 1}", f"file://localhost:{ep.port}"):
        reply = raw(ep.port, body=body, headers={**headers, "Origin": origin}, token=endpoint.token)
        assert reply.status == 403, (origin, reply)
        assert reply.json()["error"]["code"] and reply.json()["id"] is None
    for host, origin in ((f"localhost:{ep.port}", f"http://localhost:{ep.port}"), ("localhost", None),
                         (f"127.0.0.1:{ep.port}", f"http://127.0.0.1:{ep.port}"), (f"[::1]:{ep.port}", None)):
        reply = raw(ep.port, body=body, headers={**headers, "Origin": origin}, token=endpoint.token, host=host)
        assert reply.status == 200, (host, reply)
        assert not any(k.startswith("access-control") for k in reply.headers)
    preflight = raw(ep.port, "OPTIONS", headers={"Origin": "http://localhost:5173"})
    assert preflight.status == 403 and not any(k.startswith("access-control") for k in preflight.headers)


def test_an_allowed_origin_gets_cors_and_still_needs_a_token(endpoint):
    ep = endpoint.start(service_http_origins="http://localhost:5173")
    page = "http://localhost:5173"
    preflight = raw(ep.port, "OPTIONS", headers={"Origin": page, "Access-Control-Request-Method": "POST"})
    assert preflight.status == 204 and preflight.headers["access-control-allow-origin"] == page
    body = {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": META}}
    refused = raw(ep.port, body=body, headers={**modern_headers("server/discover"), "Origin": page})
    assert refused.status == 401 and refused.headers["access-control-allow-origin"] == page
    allowed = raw(ep.port, body=body, headers={**modern_headers("server/discover"), "Origin": page},
                  token=endpoint.token)
    assert allowed.status == 200 and allowed.json()["result"]["supportedVersions"] == [MODERN]


def test_another_address_than_loopback_is_said_loudly(endpoint):
    ep = endpoint.start("0.0.0.0:0")
    assert not ep.loopback and "WARNING" in ep.out and "other machines" in ep.out
    assert "other machines" in cli("status").stdout
    log = (endpoint.home / "logs" / "service.log").read_text()
    assert "REACHABLE FROM OTHER MACHINES" in log
    reply = raw(ep.port, body=modern("server/discover"), headers=modern_headers("server/discover"),
                token=endpoint.token, host=f"192.0.2.7:{ep.port}")
    assert reply.status == 200, "an IP literal cannot be a rebound name"
    rebound = raw(ep.port, body=modern("server/discover"), headers=modern_headers("server/discover"),
                  token=endpoint.token, host=f"attacker.example:{ep.port}")
    assert rebound.status == 421


# -- hostile input ------------------------------------------------------------------------------------------------
def test_malformed_and_oversized_requests_fail_alone(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start(max_message_bytes=65536)
    token = endpoint.token
    session = initialize(ep.port, token)
    in_session = {"Mcp-Session-Id": session}
    bad = raw(ep.port, body=b'{"jsonrpc": "2.0", "id": 1, "method": ', token=token, headers=in_session)
    assert bad.status == 400 and bad.json()["error"]["code"] == -32700 and bad.json()["id"] is None
    deep = raw(ep.port, body=b"[" * 5000 + b"]" * 5000, token=token, headers=in_session)
    assert deep.status == 400 and deep.json()["error"]["code"] == -32700
    nan = raw(ep.port, body=b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}', token=token,
              headers=in_session)
    assert nan.status == 400 and nan.json()["error"]["code"] == -32700
    big = raw(ep.port, body=b"x" * 70000, token=token, headers=in_session)
    assert big.status == 413 and big.headers.get("connection") == "close"
    response, sock = raw(ep.port, body=b"", token=token, read=False,
                         headers={**in_session, "Content-Length": str(10 ** 12)})
    assert response.status == 413
    sock.close()
    wrong_type = raw(ep.port, body={"jsonrpc": "2.0", "id": 1, "method": "ping"}, token=token,
                     headers={**in_session, "Content-Type": "text/plain"})
    assert wrong_type.status == 415
    many = raw(ep.port, body={"jsonrpc": "2.0", "id": 1, "method": "ping"}, token=token,
               headers={**in_session, **{f"X-Field-{i}": "v" for i in range(150)}})
    assert many.status == 431
    huge = raw(ep.port, body={"jsonrpc": "2.0", "id": 1, "method": "ping"}, token=token,
               headers={**in_session, "X-Huge": "v" * 40000})
    assert huge.status == 431
    batch = raw(ep.port, body=[{"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
        "name": "a__echo", "arguments": {"text": str(i)}}} for i in range(5)], token=token, headers=in_session)
    assert batch.status == 200
    answers = batch.json() if batch.headers["content-type"] == "application/json" else sse_messages(batch.body)
    assert sorted(a["id"] for a in answers) == list(range(5))
    assert all(a["result"]["content"][0]["text"] == str(a["id"]) for a in answers)
    not_rpc = raw(ep.port, body={"hello": "world"}, token=token, headers=in_session)
    assert not_rpc.status == 400 and not_rpc.json()["error"]["code"] == -32600
    modern_batch = raw(ep.port, body=[modern("tools/list")], token=token, headers=modern_headers("tools/list"))
    assert modern_batch.status == 400 and modern_batch.json()["error"]["code"] == -32600
    still = raw(ep.port, body={"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
        "name": "a__echo", "arguments": {"text": "fine"}}}, token=token, headers=in_session)
    assert answer_of(still, 9)["result"]["content"][0]["text"] == "fine"


def test_a_client_that_sends_nothing_is_dropped(endpoint):
    ep = endpoint.start(http_read_timeout=1)
    silent = socket.create_connection(("127.0.0.1", ep.port), timeout=60)
    trickle = socket.create_connection(("127.0.0.1", ep.port), timeout=60)
    trickle.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    body = socket.create_connection(("127.0.0.1", ep.port), timeout=60)
    body.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{ep.port}\r\nAuthorization: Bearer {endpoint.token}\r\n"
                 "Content-Type: application/json\r\nAccept: application/json\r\nContent-Length: 100\r\n\r\n{"
                 .encode())
    for _ in range(3):
        try:
            trickle.sendall(b"X-Slow: 1\r\n")
        except OSError:
            break
        reply = raw(ep.port, body=modern("server/discover"), headers=modern_headers("server/discover"),
                    token=endpoint.token)
        assert reply.status == 200, "others are served while the slow clients wait"
    assert read_to_end(silent) == b"", "a connection that sends nothing is closed, unanswered"
    assert read_to_end(trickle).startswith(b"HTTP/1.1 408"), "a head that trickles in is cut off"
    assert read_to_end(body).startswith(b"HTTP/1.1 408"), "a body that stops coming is cut off"


def read_to_end(sock):
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_client_that_reads_nothing_loses_its_connection_and_nobody_else_waits(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start(http_read_timeout=1)
    size = 16 * 1024 * 1024
    call = modern("tools/call", {"name": "a__big", "arguments": {"mb": 16}}, msg_id=1)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", ep.port))
    data = json.dumps(call).encode()
    stalled.sendall("\r\n".join([
        "POST /mcp HTTP/1.1", f"Host: 127.0.0.1:{ep.port}", f"Authorization: Bearer {endpoint.token}",
        "Content-Type: application/json", "Accept: application/json",
        *(f"{k}: {v}" for k, v in modern_headers("tools/call", "a__big").items()),
        f"Content-Length: {len(data)}", "", ""]).encode() + data)
    log = endpoint.home / "logs" / "service.log"
    wait_until(lambda: "stopped reading" in log.read_text(), timeout=60, what="the stalled client to be dropped")
    reply = raw(ep.port, body=modern("server/discover"), headers=modern_headers("server/discover"),
                token=endpoint.token)
    assert reply.status == 200, "the others are served"
    stalled.settimeout(30)
    assert len(read_to_end(stalled)) < size, "the connection was closed before the whole answer was written"


def test_connections_and_sessions_are_bounded(endpoint):
    ep = endpoint.start(http_read_timeout=60)
    idle = [socket.create_connection(("127.0.0.1", ep.port), timeout=30) for _ in range(64)]
    try:
        extra = socket.create_connection(("127.0.0.1", ep.port), timeout=30)
        assert extra.recv(100).startswith(b"HTTP/1.1 503")
        extra.close()
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: raw(ep.port, body=modern("server/discover"), headers=modern_headers("server/discover"),
                           token=endpoint.token).status == 200, what="the slots to free up")
    sessions = [initialize(ep.port, endpoint.token) for _ in range(64)]
    full = raw(ep.port, body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}},
        token=endpoint.token)
    assert full.status == 503 and "mcp-session-id" not in full.headers
    assert raw(ep.port, "DELETE", token=endpoint.token, headers={"Mcp-Session-Id": sessions[0]}).status == 200
    assert initialize(ep.port, endpoint.token)


def test_no_secret_in_any_response_or_log(endpoint):
    subprocess.run([PY, COFFER, "secret", "set", "API_TOKEN"], input="sk-very-secret-value-123\n", text=True,
                   check=True, capture_output=True)
    cli("add", "a", "--env", "API_TOKEN=${API_TOKEN}", "--", *FAKE, "--stderr-env", "API_TOKEN")
    ep = endpoint.start()
    session = initialize(ep.port, endpoint.token)
    replies = [raw(ep.port, body={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "a__echo", "arguments": {"text": "x"}}}, token=endpoint.token, headers={"Mcp-Session-Id": session}),
        raw(ep.port, body={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, token=endpoint.token + "z",
            headers={"Mcp-Session-Id": session}),
        raw(ep.port, body=b"{", token=endpoint.token, headers={"Mcp-Session-Id": session})]
    log = (endpoint.home / "logs" / "service.log").read_text()
    for secret in (endpoint.token, endpoint.token.removeprefix("coffer_"), "sk-very-secret-value-123"):
        assert secret not in log
        for reply in replies:
            assert secret.encode() not in reply.body


# -- the two eras' rules -----------------------------------------------------------------------------------------
def test_a_handshake_session_lives_from_initialize_to_delete(endpoint):
    cli("add", "a", "--", *FAKE)
    other = add_token("other")
    ep = endpoint.start()
    session = initialize(ep.port, endpoint.token)
    assert all(0x21 <= ord(c) <= 0x7E for c in session) and len(session) >= 16
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "a__echo",
                                                                           "arguments": {"text": "one"}}}
    assert raw(ep.port, body=call, token=endpoint.token).status == 400, "no session: initialize first"
    assert raw(ep.port, body=call, token=endpoint.token, headers={"Mcp-Session-Id": "made-up"}).status == 404
    assert raw(ep.port, body=call, token=other, headers={"Mcp-Session-Id": session}).status == 404, \
        "another token's session does not exist for it"
    reply = raw(ep.port, body=call, token=endpoint.token, headers={"Mcp-Session-Id": session,
                                                                   "MCP-Protocol-Version": "2025-11-25"})
    assert answer_of(reply, 7)["result"]["content"][0]["text"] == "one"
    assert raw(ep.port, "GET", token=endpoint.token, headers={"Mcp-Session-Id": session,
                                                              "Accept": "application/json"}).status == 406
    assert raw(ep.port, "DELETE", token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 200
    assert raw(ep.port, body=call, token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 404
    assert raw(ep.port, "DELETE", token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 404
    assert raw(ep.port, "PUT", token=endpoint.token).status == 405


def test_an_unused_handshake_session_expires(endpoint):
    ep = endpoint.start(http_session_idle=1)
    session = initialize(ep.port, endpoint.token)
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    assert raw(ep.port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 200
    wait_until(lambda: not [s for s in service_status()["sessions"] if s["transport"] == "http"],
               what="the session to expire")  # (asking the session itself would be using it)
    assert raw(ep.port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 404


def test_the_setting_makes_an_auto_started_service_listen_and_start_adds_http_to_a_running_one(endpoint):
    cli("add", "a", "--", *FAKE)
    assert cli("service", "start", "--http", "nowhere", check=False).returncode == 1
    assert cli("config", "service_http", "not an address", check=False).returncode == 1
    cli("service", "start")
    assert service_status()["service"]["http"] is None
    out = cli("service", "start", "--http", "127.0.0.1:0").stdout
    http = service_status()["service"]["http"]
    assert http["url"] in out, "a running service starts serving HTTP when asked"
    cli("service", "stop")
    cli("config", "service_http", "127.0.0.1:0")

    async def relay_then_http():
        params = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
        async with Client(params, mode="legacy") as relay:
            await relay.list_tools()
            url = (await anyio.to_thread.run_sync(service_status))["service"]["http"]["url"]
            async with bearer(endpoint.token) as http, sdk_client(url, endpoint.token, MODERN, "m", http) as client:
                return text_of(await client.call_tool("a__echo", {"text": "auto"}))

    assert anyio.run(relay_then_http) == "auto"


def test_a_newer_coffer_takes_over_the_http_address(endpoint, tmp_path):
    cli("add", "a", "--", *FAKE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli("config", "service_http", f"127.0.0.1:{port}")
    cli("service", "start")
    first = service_pid(endpoint.home)
    session = initialize(port, endpoint.token)
    new = serve_a_newer_build(tmp_path / "newer")
    try:
        wait_until(lambda: service_pid(endpoint.home) not in (None, first), what="the new service")
        status = service_status()
        assert status["service"]["pid"] != first and status["service"]["http"]["url"].endswith(f":{port}/mcp")
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        assert raw(port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": session}).status == 404, \
            "the old service's session is not the new one's: the client starts another"
        again = initialize(port, endpoint.token)
        assert raw(port, body=ping, token=endpoint.token, headers={"Mcp-Session-Id": again}).status == 200
    finally:
        new.kill()
        new.wait()


def test_the_get_stream_carries_list_changes_to_a_handshake_session(endpoint):
    cli("add", "a", "--", *FAKE, "--tools", "echo,churn")
    ep = endpoint.start()
    session = initialize(ep.port, endpoint.token)
    assert raw(ep.port, body={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, token=endpoint.token,
               headers={"Mcp-Session-Id": session}).status == 200
    stream, sock = raw(ep.port, "GET", token=endpoint.token, read=False,
                       headers={"Mcp-Session-Id": session, "Accept": "text/event-stream", "Content-Type": None})
    assert stream.status == 200 and stream.getheader("content-type") == "text/event-stream"
    churn = raw(ep.port, body={"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "a__churn", "arguments": {"count": 1}}}, token=endpoint.token, headers={"Mcp-Session-Id": session})
    assert churn.status == 200
    frame = next_frame(stream)
    while frame.get("method") != "notifications/tools/list_changed":
        frame = next_frame(stream)
    sock.close()


def test_2026_requests_must_carry_headers_that_match_the_body(endpoint):
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start()
    token = endpoint.token
    call = modern("tools/call", {"name": "a__echo", "arguments": {"text": "x"}}, msg_id=5)

    def send(body, headers):
        return raw(ep.port, body=body, headers=headers, token=token)

    ok = send(call, modern_headers("tools/call", "a__echo"))
    assert ok.status == 200 and answer_of(ok, 5)["result"]["content"][0]["text"] == "x"
    encoded = "=?base64?" + base64.b64encode(b"a__echo").decode() + "?="
    assert answer_of(send(call, modern_headers("tools/call", encoded)), 5)["result"]["resultType"] == "complete"
    padded = send(call, {**modern_headers("tools/call"), "Mcp-Name": "  a__echo  "})
    assert padded.status == 200, "whitespace around a header value is not part of it"
    for headers in (modern_headers("tools/call"), modern_headers("tools/call", "a__other"),
                    modern_headers("tools/list", "a__echo"), modern_headers("TOOLS/CALL", "a__echo"),
                    {"Mcp-Method": "tools/call", "Mcp-Name": "a__echo"},
                    modern_headers("tools/call", "=?base64?!!!?=")):
        reply = send(call, headers)
        assert reply.status == 400 and reply.json()["error"]["code"] == -32020, (headers, reply)
        assert reply.json()["id"] == 5
    unsupported = send({**call, "params": {**call["params"], "_meta": {**META, META_VERSION: "1999-01-01"}}},
                       modern_headers("tools/call", "a__echo", version="1999-01-01"))
    assert unsupported.status == 400 and unsupported.json()["error"]["code"] == -32022
    assert unsupported.json()["error"]["data"]["supported"] == [MODERN]
    mismatch = send({**call, "params": {**call["params"], "_meta": {**META, META_VERSION: "1999-01-01"}}},
                    modern_headers("tools/call", "a__echo"))
    assert mismatch.status == 400 and mismatch.json()["error"]["code"] == -32020
    no_meta = send({"jsonrpc": "2.0", "id": 6, "method": "server/discover", "params": {}},
                   modern_headers("server/discover"))
    assert no_meta.status == 400 and no_meta.json()["error"]["code"] == -32602 and no_meta.json()["id"] == 6
    for method in ("initialize", "ping", "logging/setLevel", "nope/nope"):
        gone = send(modern(method, msg_id=8), modern_headers(method))
        assert gone.status == 404 and gone.json()["error"]["code"] == -32601 and gone.json()["id"] == 8, method
    assert send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}},
                modern_headers("notifications/cancelled")).status == 202
    assert raw(ep.port, "GET", token=token, headers=modern_headers("x")).status == 405
    assert raw(ep.port, "DELETE", token=token, headers=modern_headers("x")).status == 405


META_VERSION = "io.modelcontextprotocol/protocolVersion"


def test_closing_a_2026_response_stream_cancels_its_call(endpoint, tmp_path):
    received = tmp_path / "received"
    cli("add", "a", "--", *FAKE, "--recv-log", str(received))
    ep = endpoint.start()
    call = modern("tools/call", {"name": "a__slow", "arguments": {"seconds": 30}}, msg_id="long")
    sock = _send_only(ep.port, call, endpoint.token, modern_headers("tools/call", "a__slow"))
    wait_until(lambda: received.exists() and '"slow"' in received.read_text(), what="the call to reach the server")
    sock.close()
    wait_until(lambda: "notifications/cancelled" in received.read_text(), what="the cancellation upstream")


def test_a_handshake_client_cancels_by_notification_under_its_own_id(endpoint, tmp_path):
    received = tmp_path / "received"
    cli("add", "a", "--", *FAKE, "--recv-log", str(received))
    ep = endpoint.start()
    session = initialize(ep.port, endpoint.token)
    in_session = {"Mcp-Session-Id": session}
    call = {"jsonrpc": "2.0", "id": "mine-7", "method": "tools/call", "params": {"name": "a__slow",
                                                                                  "arguments": {"seconds": 30}}}
    sock = _send_only(ep.port, call, endpoint.token, in_session)
    wait_until(lambda: received.exists() and '"slow"' in received.read_text(), what="the call to reach the server")
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "mine-7"}}
    assert raw(ep.port, body=cancel, token=endpoint.token, headers=in_session).status == 202
    wait_until(lambda: "notifications/cancelled" in received.read_text(), what="the cancellation upstream")
    sock.close()


def _send_only(port, body, token, headers):
    """Send a POST and leave its response unread (a request still in flight)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall("\r\n".join([
        "POST /mcp HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {token}",
        "Content-Type: application/json", "Accept: application/json, text/event-stream",
        *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {len(data)}", "", ""]).encode() + data)
    return sock


def test_a_2026_listen_stream_hears_list_changes_under_its_own_id(endpoint):
    cli("add", "a", "--", *FAKE, "--tools", "echo,churn")
    ep = endpoint.start()
    listen = modern("subscriptions/listen", {"notifications": {"toolsListChanged": True}}, msg_id="sub-1")
    stream, sock = raw(ep.port, body=listen, headers=modern_headers("subscriptions/listen"),
                       token=endpoint.token, read=False)
    assert stream.status == 200 and stream.getheader("content-type") == "text/event-stream"
    frames = [next_frame(stream)]
    assert frames[0]["method"] == "notifications/subscriptions/acknowledged"
    assert frames[0]["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "sub-1"
    churn = raw(ep.port, body=modern("tools/call", {"name": "a__churn", "arguments": {"count": 1}}, msg_id="sub-1"),
                headers=modern_headers("tools/call", "a__churn"), token=endpoint.token)
    assert churn.status == 200, "another request may reuse an id: it is its own request"
    frame = next_frame(stream)
    while frame.get("method") != "notifications/tools/list_changed":
        frame = next_frame(stream)
    assert frame["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "sub-1"
    sock.close()


def test_a_tool_that_cannot_send_a_token_reaches_the_endpoint_through_the_bearer_proxy(endpoint):
    """tests/fixtures/bearer_proxy.py is how the official conformance runner (which sends no Authorization)
    is pointed at the endpoint: it adds the token and keeps the Host and Origin checks meaningful."""
    cli("add", "a", "--", *FAKE)
    ep = endpoint.start()
    proxy = subprocess.Popen([PY, str(ROOT / "tests" / "fixtures" / "bearer_proxy.py"), "--target",
                              f"127.0.0.1:{ep.port}", "--token", endpoint.token], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proxy.stdout.readline().split()[1])
        discover = modern("server/discover")
        headers = modern_headers("server/discover")
        assert raw(port, body=discover, headers=headers, host=f"localhost:{port}").status == 200
        assert raw(port, body=discover, headers={**headers, "Origin": f"http://localhost:{port}"}).status == 200
        assert raw(port, body=discover, headers=headers, host="evil.example.com").status == 421
        assert raw(port, body=discover, headers={**headers, "Origin": "http://evil.example.com"}).status == 403

        async def main():
            async with create_mcp_http_client() as http, \
                    sdk_client(f"http://localhost:{port}/mcp", None, "legacy", "conformance", http) as client:
                return text_of(await client.call_tool("a__echo", {"text": "proxied"}))

        assert anyio.run(main) == "proxied"
    finally:
        proxy.kill()
        proxy.wait()


# -- the header rules, one by one ------------------------------------------------------------------------------
def test_host_and_origin_rules():
    loopback = HostRule("127.0.0.1", 8765, [])
    for host in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "localhost", "LOCALHOST:8765", "127.0.0.2:8765"):
        assert loopback.host_ok(host), host
    for host in ("127.0.0.1:8766", "evil.example:8765", "localhost.evil.example:8765", "10.0.0.1:8765", "",
                 "127.0.0.1:8765:1", "user@127.0.0.1:8765", "127.0.0.1 :8765", None):
        assert not loopback.host_ok(host), host
    assert loopback.origin_ok("http://localhost:8765") and loopback.origin_ok("http://127.0.0.1:8765")
    for origin in ("null", "http://localhost", "https://localhost:8765/x", "http://evil.example:8765",
                   "http://user@localhost:8765", "chrome-extension://abc", "http://localhost:8765?x"):
        assert not loopback.origin_ok(origin), origin
    assert not loopback.cors("http://localhost:8765"), "no CORS for anything the user did not allow"
    everywhere = HostRule("0.0.0.0", 443, ["https://app.example"])
    assert everywhere.host_ok("192.0.2.1") and everywhere.host_ok("[2001:db8::1]:443")
    assert not everywhere.host_ok("app.example"), "a DNS name can be rebound: only IP literals and localhost"
    assert everywhere.origin_ok("https://app.example") and everywhere.cors("https://app.example")
    assert everywhere.origin_ok("https://192.0.2.1")


def test_mirrored_parameter_headers_must_match_the_arguments():
    schema = {"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "count": {"type": "integer", "x-mcp-header": "Count"},
        "nested": {"type": "object", "properties": {"flag": {"type": "boolean", "x-mcp-header": "Flag"}}},
        "query": {"type": "string"}}}
    args = {"region": "us-west1", "count": 42, "nested": {"flag": True}, "query": "select"}
    good = [("mcp-param-region", "us-west1"), ("mcp-param-count", "42.0"), ("mcp-param-flag", "true")]
    assert parameter_header_problem(schema, args, good) is None
    encoded = [("mcp-param-region", "=?base64?dXMtd2VzdDE=?="), *good[1:]]
    assert parameter_header_problem(schema, args, encoded) is None
    for headers in (good[1:], [("mcp-param-region", "eu-west1"), *good[1:]],
                    [("mcp-param-region", "=?base64?dXMtd2!!?="), *good[1:]],
                    [*good, ("mcp-param-region", "us-west1")], [("mcp-param-region", "us-west1\x01"), *good[1:]]):
        assert parameter_header_problem(schema, args, headers) is not None, headers
    assert parameter_header_problem(schema, {"count": 42, "nested": {"flag": True}}, good) is not None, \
        "a header whose argument is absent is refused"
    assert parameter_header_problem(schema, {"region": None, "count": 42, "nested": {"flag": True}}, good[1:]) \
        is None, "a null argument is an absent one"
    assert decode_header_value("=?base64?SGVsbG8sIOS4lueVjA==?=") == "Hello, \u4e16\u754c"
    assert decode_header_value("=?base64?literal") == "=?base64?literal"
    assert decode_header_value("=?base64?%%%?=") is None
