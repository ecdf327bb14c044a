"""Coffer as the client of remote servers: the fixes the MCP conformance suite's client scenarios asked for
(issue 26, items 4, 5 and 6, and the remote 2026-07-28 gap).

The servers are small stdlib HTTP servers in this process (MockMcp), each shaped like one of the suite's mock
servers: a Streamable HTTP server that closes a call's SSE stream early; an OAuth-protected one that lets
``initialize`` through and asks for a login (and later for more scope) on the requests after it; one that speaks
only 2026-07-28 and refuses any POST without that revision's headers.  Coffer runs as users run it: the CLI, with a
stand-in browser for ``coffer auth`` (fixtures/fake_browser.py).
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import PY, ROOT, cli

FAKE_BROWSER = ROOT / "tests" / "fixtures" / "fake_browser.py"
MODERN = "2026-07-28"


class MockMcp:
    """One loopback HTTP server playing an MCP server (and, with ``oauth``, its authorization server too).

    ``seen`` records every request: (HTTP method, path, headers as a dict with lower-case names, parsed JSON body
    or None).  ``mode``: "resume" (tools/call's SSE stream is closed after a priming event; the answer comes on
    the GET that resumes it), "modern" (2026-07-28 only: the revision's headers are required on every POST,
    initialize is refused), "oauth" (initialize is let through; tools/list needs a token with scope "read",
    tools/call one with "write" as well; with ``protect_all``, initialize too).  ``iss``: what the
    authorization response's iss says ("exact", or "slash" for the issuer with a trailing slash).
    """

    def __init__(self, mode: str, iss: str = "exact", protect_all: bool = False):
        self.mode, self.iss, self.protect_all = mode, iss, protect_all
        self.seen: list[tuple[str, str, dict, object]] = []
        self.registrations: list[dict] = []
        self.authorizations: list[dict] = []
        self.tokens: dict[str, str] = {}          # access token -> its scope
        self.pending_answer = None
        self.lock = threading.Lock()
        mock = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                mock.record(self, None)
                mock.get(self)

            def do_DELETE(self):  # noqa: N802
                mock.record(self, None)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = raw.decode()
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = dict(urllib.parse.parse_qsl(body))
                mock.record(self, parsed)
                mock.post(self, parsed)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = self.origin + "/mcp"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def record(self, handler, body):
        with self.lock:
            self.seen.append((handler.command, handler.path, {k.lower(): v for k, v in handler.headers.items()}, body))

    def posts(self, method=None):
        return [(headers, body) for verb, path, headers, body in self.seen
                if verb == "POST" and path == "/mcp" and isinstance(body, dict)
                and (method is None or body.get("method") == method)]

    # -- replies ------------------------------------------------------------------------------------------------
    @staticmethod
    def reply(handler, status: int, payload=None, headers: dict | None = None, kind="application/json"):
        data = b"" if payload is None else (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        if payload is not None:
            handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def get(self, handler):
        path = handler.path.partition("?")[0]
        if path == "/.well-known/oauth-protected-resource/mcp" and self.mode == "oauth":
            return self.reply(handler, 200, {"resource": self.url, "authorization_servers": [self.origin],
                                             "scopes_supported": ["read", "write"]})
        if path == "/.well-known/oauth-authorization-server" and self.mode == "oauth":
            return self.reply(handler, 200, {
                "issuer": self.origin, "authorization_endpoint": self.origin + "/authorize",
                "token_endpoint": self.origin + "/token", "registration_endpoint": self.origin + "/register",
                "code_challenge_methods_supported": ["S256"], "response_types_supported": ["code"],
                "authorization_response_iss_parameter_supported": True})
        if path == "/authorize":
            query = dict(urllib.parse.parse_qsl(handler.path.partition("?")[2]))
            self.authorizations.append(query)
            issuer = self.origin + ("/" if self.iss == "slash" else "")
            target = query["redirect_uri"] + "?" + urllib.parse.urlencode({
                "code": "code-" + query.get("scope", ""), "state": query["state"], "iss": issuer})
            return self.reply(handler, 302, headers={"Location": target})
        if path == "/mcp" and self.mode == "resume" and handler.headers.get("Last-Event-ID"):
            answer = self.pending_answer
            event = f"id: e2\nevent: message\ndata: {json.dumps(answer)}\n\n".encode()
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Content-Length", str(len(event)))
            handler.end_headers()
            handler.wfile.write(event)
            return None
        return self.reply(handler, 405, {"error": "no stream here"})

    def post(self, handler, body):
        path = handler.path
        if path == "/register":
            self.registrations.append(body)
            return self.reply(handler, 201, {"client_id": "client-" + secrets.token_hex(4),
                                             "token_endpoint_auth_method": "none", **body})
        if path == "/token":
            scope = body.get("code", "code-").removeprefix("code-")
            token = "tok-" + secrets.token_hex(8)
            self.tokens[token] = scope
            return self.reply(handler, 200, {"access_token": token, "token_type": "Bearer", "expires_in": 3600,
                                             "scope": scope})
        method, msg_id = body.get("method"), body.get("id")
        params = body.get("params") or {}
        if self.mode == "modern":
            return self.modern(handler, method, msg_id, params)
        if self.mode == "oauth" and (self.protect_all or method not in ("initialize", "notifications/initialized")):
            granted = self.tokens.get((handler.headers.get("Authorization") or "").removeprefix("Bearer "))
            needed = {"read", "write"} if method == "tools/call" else {"read"}
            challenge = f'Bearer resource_metadata="{self.origin}/.well-known/oauth-protected-resource/mcp"'
            if granted is None:
                return self.reply(handler, 401, {"error": "invalid_token"},
                                  {"WWW-Authenticate": challenge + ', scope="read"'})
            if not needed <= set(granted.split()):
                return self.reply(handler, 403, {"error": "insufficient_scope"},
                                  {"WWW-Authenticate": challenge + ', scope="write", error="insufficient_scope"'})
        if msg_id is None:
            return self.reply(handler, 202)
        session = {"Mcp-Session-Id": "session-1"}
        if method == "initialize":
            return self.reply(handler, 200, {"jsonrpc": "2.0", "id": msg_id, "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "mock", "version": "1"}}}, session)
        if method == "tools/list":
            return self.reply(handler, 200, {"jsonrpc": "2.0", "id": msg_id, "result": {"tools": [
                {"name": "echo", "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}]}},
                session)
        if method == "tools/call" and self.mode == "resume":
            self.pending_answer = {"jsonrpc": "2.0", "id": msg_id,
                                   "result": {"content": [{"type": "text", "text": "resumed"}]}}
            return self.reply(handler, 200, b"id: e1\nretry: 200\ndata: \n\n", session, "text/event-stream")
        if method == "tools/call":
            text = (params.get("arguments") or {}).get("text", "")
            return self.reply(handler, 200, {"jsonrpc": "2.0", "id": msg_id,
                                             "result": {"content": [{"type": "text", "text": text}]}}, session)
        return self.reply(handler, 200, {"jsonrpc": "2.0", "id": msg_id, "result": {}}, session)

    def modern(self, handler, method, msg_id, params):
        """A server that speaks only 2026-07-28 (as the suite's stateless mock): the headers first."""
        meta = params.get("_meta") or {}
        error = None
        if handler.headers.get("MCP-Protocol-Version") != MODERN:
            error = (-32020, "Missing MCP-Protocol-Version header")
        elif handler.headers.get("Mcp-Method") != method:
            error = (-32020, "Missing Mcp-Method header")
        elif method == "initialize":
            error = (-32601, "Method not found: initialize")
        elif meta.get("io.modelcontextprotocol/protocolVersion") != MODERN:
            error = (-32602, "missing _meta keys")
        if error is not None:
            return self.reply(handler, 400, {"jsonrpc": "2.0", "id": msg_id,
                                             "error": {"code": error[0], "message": error[1]}})
        if msg_id is None:
            return self.reply(handler, 202)
        if method == "server/discover":
            result = {"supportedVersions": [MODERN], "capabilities": {"tools": {}}, "ttlMs": 0,
                      "cacheScope": "private", "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "m",
                                                                                               "version": "1"}}}
        elif method == "tools/list":
            result = {"tools": [{"name": "echo", "inputSchema": {"type": "object", "properties": {
                "text": {"type": "string"}, "region": {"type": "string", "x-mcp-header": "Region"}}}},
                {"name": "bad", "inputSchema": {"type": "object", "properties": {
                    "data": {"type": "object", "x-mcp-header": "Data"}}}}], "ttlMs": 0, "cacheScope": "private"}
        elif method == "tools/call":
            result = {"content": [{"type": "text", "text": (params.get("arguments") or {}).get("text", "")}]}
        else:
            result = {}
        return self.reply(handler, 200, {"jsonrpc": "2.0", "id": msg_id, "result": {"resultType": "complete",
                                                                                     **result}})


@pytest.fixture
def mock_server():
    servers = []

    def start(mode: str, **options) -> MockMcp:
        server = MockMcp(mode, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def browser(tmp_path: Path) -> dict:
    wrapper = tmp_path / "browser.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{PY}" "{FAKE_BROWSER}" "$@"\n')
    wrapper.chmod(0o755)
    return {"BROWSER": str(wrapper)}


def called_text(proc) -> str:
    result = json.loads(proc.stdout)
    return result["content"][0]["text"]


def test_a_post_stream_closed_early_is_resumed_with_last_event_id(home, mock_server):
    """Item 4: the server closes the call's SSE stream after a priming event (id and retry); Coffer waits, GETs
    with Last-Event-ID and takes the answer from that stream, instead of failing the call."""
    server = mock_server("resume")
    cli("add", "up", "--url", server.url, "--transport", "http")
    proc = cli("call", "up__echo", "{}")
    assert called_text(proc) == "resumed"
    resumed = [headers for verb, path, headers, _ in server.seen if verb == "GET" and "last-event-id" in headers]
    assert [headers["last-event-id"] for headers in resumed] == ["e1"]
    assert resumed[0].get("mcp-session-id") == "session-1"


def test_a_server_that_speaks_only_2026_over_http_is_usable(home, mock_server):
    """The gap: a 2026-07-28-only Streamable HTTP server (it refuses initialize and any POST without the
    revision's headers) is probed with server/discover first and spoken to in that revision: every POST names its
    version and method, a call names its tool and mirrors the argument marked x-mcp-header, and a tool whose
    x-mcp-header cannot be a header is refused."""
    server = mock_server("modern")
    added = cli("add", "up", "--url", server.url)
    assert "2026-07-28" in added.stdout + added.stderr
    proc = cli("call", "up__echo", json.dumps({"text": "hi", "region": "Hello, 世界"}))
    assert called_text(proc) == "hi"
    posts = server.posts()
    assert posts and not server.posts("initialize")
    for headers, body in posts:
        assert headers.get("mcp-protocol-version") == MODERN and headers.get("mcp-method") == body["method"], body
    (call_headers, _), = server.posts("tools/call")
    assert call_headers.get("mcp-name") == "echo"
    assert call_headers.get("mcp-param-region") == "=?base64?SGVsbG8sIOS4lueVjA==?="
    tools = json.loads(cli("tools", "--json").stdout)
    names = {tool["name"] for tool in tools.get("tools", tools if isinstance(tools, list) else [])}
    assert "up__echo" in names and "up__bad" not in names


def test_the_era_of_a_handshake_http_server_is_remembered(home, mock_server):
    """The gap, the other way: a handshake-era HTTP server is asked server/discover once; the answer is
    remembered, so the next start goes straight to initialize."""
    server = mock_server("resume")
    cli("add", "up", "--url", server.url, "--transport", "http")
    cli("call", "up__echo", "{}")
    cli("call", "up__echo", "{}")
    assert len(server.posts("server/discover")) == 1
    assert len(server.posts("initialize")) == 2


def test_coffer_auth_logs_in_where_the_login_is_asked_after_initialize(home, mock_server, tmp_path):
    """Item 5: the server lets initialize through and asks for a login only on tools/list; `coffer auth` finds
    the challenge there and logs in with the scope it names."""
    server = mock_server("oauth")
    cli("add", "up", "--url", server.url, "--transport", "http")
    cli("auth", "up", "--timeout", "30", env=browser(tmp_path))
    assert [a.get("scope") for a in server.authorizations] == ["read"]
    tools = cli("tools", "--json")
    assert "up__echo" in tools.stdout


def test_a_step_up_asks_for_the_new_scope_with_the_granted_one(home, mock_server, tmp_path):
    """Item 5: a call refused with 403 insufficient_scope says to log in again; the next `coffer auth` asks for
    the challenged scope together with what was granted (SEP-2350), and the call then works."""
    server = mock_server("oauth")
    cli("add", "up", "--url", server.url, "--transport", "http")
    cli("auth", "up", "--timeout", "30", env=browser(tmp_path))
    refused = cli("call", "up__echo", json.dumps({"text": "hi"}), check=False)
    assert refused.returncode != 0 and "coffer auth up" in refused.stdout + refused.stderr
    cli("auth", "up", "--timeout", "30", env=browser(tmp_path))
    assert set(server.authorizations[-1]["scope"].split()) == {"read", "write"}
    assert called_text(cli("call", "up__echo", json.dumps({"text": "hi"}))) == "hi"


def test_dynamic_client_registration_says_application_type_native(home, mock_server, tmp_path):
    """Item 6 (SEP-837): Coffer registers itself as a native application (a loopback redirect URI)."""
    server = mock_server("oauth", protect_all=True)
    cli("add", "up", "--url", server.url, "--transport", "http")
    cli("auth", "up", "--timeout", "30", env=browser(tmp_path))
    assert [r.get("application_type") for r in server.registrations] == ["native"]


def test_an_iss_that_differs_by_a_trailing_slash_is_refused(home, mock_server, tmp_path):
    """Item 6 (RFC 9207 §2.4): the authorization response's iss is compared exactly with the issuer; a trailing
    slash the metadata does not have is another issuer, and the login is refused before any token request."""
    server = mock_server("oauth", iss="slash", protect_all=True)
    cli("add", "up", "--url", server.url, "--transport", "http")
    refused = cli("auth", "up", "--timeout", "30", env=browser(tmp_path), check=False)
    assert refused.returncode != 0 and "issuer" in refused.stderr
    assert not [path for verb, path, _, _ in server.seen if path == "/token"]
