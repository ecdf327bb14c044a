"""The page's door: a one-time login link, an HttpOnly SameSite=Strict cookie, a CSRF key and a same-origin Origin
for every change, a loopback Host (no DNS rebinding), a strict Content-Security-Policy on every response, and no
secret value in anything it sends.  Raw HTTP against a real service, so no browser rule hides a hole."""

import json
import os
import re
import subprocess
import sys
import urllib.parse

import pytest
from web_helpers import Page, fake_browser, login_link

from conftest import COFFER, FAKE, PY, cli, stop_service, wait_until

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the service tests use POSIX process control")

SECRET = "web-s3cret-value-4f1c9d2e7a"          # in the secret store, referenced by a server's env
HEADER_SECRET = "hdr-l1teral-token-88e0c5b1f2"   # given literally to --header: moved to the store by `coffer add`


@pytest.fixture
def web_home(home, monkeypatch):
    monkeypatch.setenv("COFFER_SERVE_MODE", "service")
    home.mkdir(parents=True, exist_ok=True)
    yield home
    stop_service(home)


def secret_forms(value):
    """Every way a value could travel in a response: as is, JSON-escaped, URL-encoded."""
    return {value.encode(), json.dumps(value)[1:-1].encode(), urllib.parse.quote(value).encode()}


def test_only_a_login_link_opens_the_page_and_only_once(web_home, tmp_path):
    cli("add", "a", "--", *FAKE)
    env, opened = fake_browser(tmp_path)
    link = login_link(env=env)
    assert not opened.exists(), "--no-browser must open nothing"
    page = Page(link)

    status, headers, body = page.request("GET", "/")
    assert status == 401 and b"coffer open" in body, "no cookie: the page is refused"
    status, _, body = page.request("GET", "/api/servers")
    assert status == 401 and json.loads(body)["code"] == "signed-out"

    page.login()
    assert "HttpOnly" in page.set_cookie and "SameSite=Strict" in page.set_cookie and "Path=/" in page.set_cookie
    status, _, body = page.request("GET", "/", page.signed(key=False))
    assert status == 200 and b"<nav" in body
    status, data = page.get("servers")
    assert status == 200 and [s["name"] for s in data["servers"]] == ["a"]

    again = Page(link)
    status, headers, body = again.request("GET", urllib.parse.urlsplit(link).path + "?" +
                                          urllib.parse.urlsplit(link).query)
    assert status == 403 and "set-cookie" not in headers, "a login link works once"
    status, _, _ = again.request("GET", "/login?t=guessed-token-that-was-never-issued-123")
    assert status == 403

    # `coffer open` with a browser opens that browser at a fresh link, and prints none
    proc = cli("open", env=env, timeout=60)
    assert proc.stdout == "" and opened.read_text().startswith(f"{page.origin}/login?t=")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="elsewhere Python always finds the desktop's browser")
def test_with_no_browser_found_the_address_is_printed(web_home):
    env = {k: v for k, v in os.environ.items() if k not in ("BROWSER", "DISPLAY", "WAYLAND_DISPLAY")}
    proc = subprocess.run([PY, COFFER, "open"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and re.fullmatch(r"http://127\.0\.0\.1:\d+/login\?t=\S+\n", proc.stdout), proc
    assert "no browser found" in proc.stderr
    assert Page(proc.stdout.strip()).login().get("overview")[0] == 200


def test_changes_need_the_key_the_origin_and_the_cookie(web_home):
    cli("add", "a", "--", *FAKE)
    page = Page(login_link()).login()
    wait_until(lambda: page.get("catalogue")[1]["total"] >= 6, what="a's tools in the catalogue")

    refused = {
        "no CSRF key": page.post("disable", {"target": "a__echo"}, key=False),
        "a wrong CSRF key": page.post("disable", {"target": "a__echo"}, key=False,
                                      extra={"X-Coffer-Token": "not-the-key"}),
        "another site's Origin": page.post("disable", {"target": "a__echo"}, origin="http://evil.example"),
        "another port's Origin": page.post("disable", {"target": "a__echo"}, origin="http://127.0.0.1:1"),
        "no Origin": page.post("disable", {"target": "a__echo"}, origin=False),
        "no cookie": page.post("disable", {"target": "a__echo"}, cookie=False),
        "a cross-site fetch": page.post("disable", {"target": "a__echo"}, extra={"Sec-Fetch-Site": "cross-site"}),
    }
    for why, (status, _) in refused.items():
        assert status in (401, 403), f"a change with {why} was not refused ({status})"
    status, _ = page.get("servers", key=False)
    assert status == 403, "a read without the key is refused too (a cookie alone reads nothing)"
    assert not [r for r in audit_rows() if r["action"] == "disable"], "a refused request changed something"
    rows = {r["name"]: r for r in page.get("catalogue")[1]["rows"]}
    assert rows["a__echo"]["enabled"]

    status, _, _ = page.request("POST", "/api/disable", page.signed({"Origin": page.origin,
                                                                      "Content-Type": "text/plain"}),
                                b'{"target": "a__echo"}')
    assert status == 415, "a form post (no JSON content type) is refused"
    status, _, _ = page.request("POST", "/api/disable", page.signed({"Origin": page.origin,
                                                                      "Content-Type": "application/json"}),
                                b" " * (70 << 10))
    assert status == 413

    status, answer = page.post("disable", {"target": "a__echo"})
    assert status == 200 and "disabled tool a__echo" in answer["message"]
    row = [r for r in audit_rows() if r["action"] == "disable"][-1]
    assert (row["actor"], row["target"], row["detail"]) == ("web", "a__echo", "tool"), "audited like the CLI's"


def test_a_foreign_host_is_refused_everywhere(web_home):
    cli("add", "a", "--", *FAKE)
    link = login_link()
    page = Page(link)
    query = urllib.parse.urlsplit(link)
    for path in ("/", "/api/servers", f"{query.path}?{query.query}", "/static/nothing.js"):
        for host in ("evil.example", f"evil.example:{page.port}", f"127.0.0.1.evil.example:{page.port}", ""):
            status, _, body = page.request("GET", path, host=host)
            assert status == 421, f"Host {host!r} for {path} answered {status}"
    page.login()  # the refused requests did not spend the one-time link
    status, _, _ = page.request("GET", "/api/servers", page.signed(), host=f"evil.example:{page.port}")
    assert status == 421, "even signed in, a DNS-rebinding Host is refused"
    status, data = page.get("overview")
    assert status == 200 and data["servers"] == 1


def test_every_response_is_locked_down_and_carries_no_secret(web_home, tmp_path):
    cli("config", "restart_backoff", "0.01")  # the leaky server fails its restarts at once
    subprocess.run([PY, COFFER, "secret", "set", "WEB_TOKEN"], input=SECRET, text=True, check=True,
                   capture_output=True)
    # A server that prints the secret on stderr and dies (its last error carries stderr), one that uses it
    # properly, and a remote one whose literal Authorization header went to the store.
    cli("add", "leaky", "--env", "WEB_TOKEN=${WEB_TOKEN}", "--", *FAKE, "--stderr-env", "WEB_TOKEN",
        "--exit-at-start")
    cli("add", "good", "--env", "WEB_TOKEN=${WEB_TOKEN}", "--", *FAKE, "--stderr-env", "WEB_TOKEN")
    cli("add", "remote", "--url", "http://127.0.0.1:9/mcp", "--transport", "http",
        "--header", f"Authorization=Bearer {HEADER_SECRET}")
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("# Notes\n\nNothing secret here.\n")
    page = Page(login_link()).login()
    wait_until(lambda: {s["name"]: s["state"] for s in page.get("servers")[1]["servers"]}.get("leaky") == "failed",
               what="the leaky server to fail")
    cli("call", "good__echo", '{"text": "hello"}')
    cli("call", "good__fail", "{}", check=False)
    status, _ = page.post("knowledge/add", {"path": str(folder), "name": "notes"})
    assert status == 200
    page.post("restart", {"server": "leaky"})
    servers = {s["name"]: s for s in page.get("servers")[1]["servers"]}
    assert "WEB_TOKEN=***" in (servers["leaky"]["error"] or ""), servers["leaky"]
    assert servers["good"]["env"] == {"WEB_TOKEN": "${WEB_TOKEN}"}, "a secret is shown as its reference"
    assert "WEB_TOKEN" in servers["good"]["secrets"] and not servers["good"]["secrets_missing"]
    assert "Bearer ${" in json.dumps(servers["remote"]["headers"])

    for name in ("overview", "servers", "catalogue", "changes", "activity", "knowledge", "sessions"):
        assert page.get(name)[0] == 200, name
    page.get("search?q=echo%20the%20token&top_k=20")
    page.get("activity?range=week&group=client")
    page.request("GET", "/")
    page.request("GET", "/nothing-here")
    page.request("GET", "/api/nothing", page.signed())
    page.request("DELETE", "/api/servers", page.signed())
    for asset in ("app.js", "views.js", "charts.js", "app.css"):
        path = next(p for p in _asset_paths(page) if asset.split(".")[0] in p and p.endswith(asset.split(".")[1]))
        assert page.request("GET", path)[0] == 200

    leaks = [(what, status) for what, status, headers, body in page.responses
             for value in (SECRET, HEADER_SECRET) for form in secret_forms(value) if form in body
             or any(form.decode() in v for v in headers.values())]
    assert not leaks, f"a secret value left the service in: {leaks}"
    for what, status, headers, body in page.responses:
        csp = headers.get("content-security-policy", "")
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, what
        assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp, what
        assert headers.get("x-content-type-options") == "nosniff", what
        assert headers.get("x-frame-options") == "DENY", what
        assert "python" not in headers.get("server", "").lower(), what


def _asset_paths(page):
    status, _, body = page.request("GET", "/", page.signed(key=False))
    return re.findall(r'(?:src|href)="(/static/[^"]+)"', body.decode())


def audit_rows():
    return json.loads(cli("audit", "--json", "--limit", "500").stdout)["audit"]
