"""OAuth-protected remote servers (issue 13): a real authorization server and protected MCP server built on the
official SDK's server-side auth (fixtures/oauth_server.py), the official SDK client in front of `coffer serve`,
and a stand-in browser (fixtures/fake_browser.py) that follows the authorization redirect the way a browser does
after "Allow"; plus the parsing a user never sees, on hostile and edge input."""

import contextlib
import json
import os
import stat
import subprocess
import threading
import urllib.request
import uuid
from pathlib import Path

import anyio
import pytest

from coffer_src.oauth import authorization_server_metadata_urls, parse_www_authenticate, resource_matches

from conftest import PY, ROOT, Transcript, call_until_ok, cli, server_status, text_of, through_gateway, wait_for_status

OAUTH_SERVER = ROOT / "tests" / "fixtures" / "oauth_server.py"
FAKE_BROWSER = ROOT / "tests" / "fixtures" / "fake_browser.py"


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


def secrets_file(home: Path) -> dict:
    path = home / "secrets.json"
    return json.loads(path.read_text()) if path.exists() else {}


def assert_nothing_leaks(home: Path, tmp_path: Path, transcript: Transcript, values) -> None:
    """No token, code or client secret in any byte Coffer wrote outside its secret store, or printed."""
    values = [v.encode() for v in values if len(v) >= 8]
    assert values
    places = [(str(p), p.read_bytes()) for p in home.rglob("*")
              if p.is_file() and not p.name.startswith("secrets.json")]
    places += [(str(p), p.read_bytes()) for p in tmp_path.glob("serve-*.log")]
    places += [(f"cli output {i}", text.encode()) for i, text in enumerate(transcript.texts)]
    assert any(name.endswith("coffer.db") for name, _ in places)
    for name, data in places:
        for value in values:
            assert value not in data, f"a secret value reached {name}"


# -- parsing, on hostile and edge input --------------------------------------------------------------------------------

def test_www_authenticate_parsing_finds_the_bearer_challenge_among_others():
    parsed = parse_www_authenticate(
        'Basic realm="x", Bearer error="invalid_token", resource_metadata="https://a.example/.well-known/'
        'oauth-protected-resource/mcp", scope="files:read files:write", error_description="a \\"quoted\\" word"')
    assert parsed["basic"] == {"realm": "x"}
    assert parsed["bearer"]["resource_metadata"] == "https://a.example/.well-known/oauth-protected-resource/mcp"
    assert parsed["bearer"]["scope"] == "files:read files:write"
    assert parsed["bearer"]["error_description"] == 'a "quoted" word'
    assert parse_www_authenticate("Bearer") == {"bearer": {}}
    assert parse_www_authenticate(None) == {}
    assert parse_www_authenticate('Bearer scope="' + "x" * 100_000) is not None  # bounded, no crash


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
    assert resource_matches("https://mcp.example.com/mcp", resource) is matches


def test_authorization_server_metadata_is_looked_for_in_the_order_the_spec_gives():
    assert authorization_server_metadata_urls("https://auth.example.com/tenant1") == [
        "https://auth.example.com/.well-known/oauth-authorization-server/tenant1",
        "https://auth.example.com/.well-known/openid-configuration/tenant1",
        "https://auth.example.com/tenant1/.well-known/openid-configuration"]
    assert authorization_server_metadata_urls("https://auth.example.com") == [
        "https://auth.example.com/.well-known/oauth-authorization-server",
        "https://auth.example.com/.well-known/openid-configuration"]


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


# -- logging in, refreshing, logging out -------------------------------------------------------------------------------

def test_oauth_login_then_calls_refresh_before_expiry_and_on_401_and_no_token_leaks(home, tmp_path, transcript):
    with oauth_server(tmp_path, "--token-lifetime", "2") as info:
        added = transcript.cli("add", "prot", "--url", info["mcp"])
        assert "prot needs a login: run `coffer auth prot`" in added.stdout

        assert "run `coffer auth prot`" in server_status("prot")["detail"]  # `list` says so from the start

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
        row = server_status("prot")
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
            await anyio.sleep(2.5)  # the access token expires (a real clock: Coffer refreshes by expires_in)
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
            row = await anyio.to_thread.run_sync(wait_for_status, "prot", "failed")
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
        transport = server_status("osse")

        async def body(client):
            return await client.call_tool("osse__echo", {"message": "over sse"})

        result = through_gateway(tmp_path, body)
        state = control(info, "/state")
    assert "osse needs a login" in added.stdout
    assert transport["transport"] == "sse"
    assert text_of(result) == "protected echo: over sse"
    assert state["bearer_at_authorization_server"] == []
    assert_nothing_leaks(home, tmp_path, transcript, state["issued"])
