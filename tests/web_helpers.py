"""What the web page's tests share: a service home, the one-time login done the way a browser does it, raw HTTP
for the security checks, and headless Chromium driven by Selenium for the browser tests."""

import http.client
import json
import os
import re
import shutil
import tempfile
import urllib.parse
from pathlib import Path

import pytest

from conftest import COFFER, PY, cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# The machine's closed network refuses Chromium's background connections; these keep it from trying.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1440,1000", "--lang=en-US")
SCREENSHOTS_ENV = "COFFER_WEB_SCREENSHOTS"   # a folder to copy each view's screenshot to (the README's come from here)


def browser_problem():
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM or not CHROMEDRIVER:
        return "Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; .ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]'; .ci/run does)"
    return None


def require_browser():
    """Skip where the browser is missing on a developer's machine; in CI (which installs it) that is a failure."""
    problem = browser_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the browser tests cannot run: {problem}")
        pytest.skip(problem)


def start_chromium(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def login_link(env=None) -> str:
    """`coffer open --no-browser`: the one-time address, printed on stdout (and nothing else there)."""
    out = cli("open", "--no-browser", env=env, timeout=60).stdout.strip()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/login\?t=[A-Za-z0-9_-]{20,}", out), out
    return out


def fake_browser(tmp_path) -> tuple[dict, Path]:
    """A BROWSER for Python's webbrowser that only writes down the address it was asked to open."""
    opened = tmp_path / "opened.txt"
    script = tmp_path / "browser.sh"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$1" >> {opened}\n')
    script.chmod(0o755)
    return {"BROWSER": str(script)}, opened


class Page:
    """Raw HTTP to the page's listener, as the security tests need it (no browser rules applied for us)."""

    def __init__(self, link: str):
        parts = urllib.parse.urlsplit(link)
        self.link, self.port = link, parts.port
        self.origin = f"http://127.0.0.1:{self.port}"
        self.cookie = self.key = None
        self.responses: list[tuple[str, int, dict, bytes]] = []   # everything received, for the byte scan

    def request(self, method, path, headers=None, body=None, host=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", host if host is not None else f"127.0.0.1:{self.port}")
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            if data is not None:
                conn.putheader("Content-Length", str(len(data)))
            conn.endheaders(data)
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        headers_seen = {k.lower(): v for k, v in response.getheaders()}
        self.responses.append((f"{method} {path}", response.status, headers_seen, payload))
        return response.status, headers_seen, payload

    def login(self):
        status, headers, body = self.request("GET", urllib.parse.urlsplit(self.link).path + "?" +
                                             urllib.parse.urlsplit(self.link).query)
        assert status == 200, (status, body[:300])
        self.set_cookie = headers["set-cookie"]
        self.cookie = self.set_cookie.split(";")[0]
        self.key = re.search(rb'name="coffer-key" content="([^"]+)"', body).group(1).decode()
        return self

    def signed(self, extra=None, key=True, cookie=True):
        headers = {}
        if cookie:
            headers["Cookie"] = self.cookie
        if key:
            headers["X-Coffer-Token"] = self.key
        headers.update(extra or {})
        return headers

    def get(self, name, **kwargs):
        status, headers, body = self.request("GET", f"/api/{name}", self.signed(**kwargs))
        return status, json.loads(body)

    def post(self, name, payload, origin=True, extra=None, **kwargs):
        extra = {"Content-Type": "application/json", **(extra or {})}
        if origin:
            extra["Origin"] = self.origin if origin is True else origin
        status, headers, body = self.request("POST", f"/api/{name}", self.signed(extra, **kwargs), payload)
        return status, json.loads(body)


def ten_thousand_tools(folder: Path, count: int = 10_000) -> list[str]:
    """A fake server's argument file listing ``count`` tools with varied names (verbs x nouns x a number)."""
    verbs = "create get list update delete search send sync archive export".split()
    nouns = "issue ticket file message event invoice user order report page".split()
    names = [f"{verbs[i % 10]}_{nouns[i // 10 % 10]}_{i:05d}" for i in range(count)]
    args = folder / "many.args"
    args.write_text("--tools " + ",".join(names))
    return [PY, str(Path(COFFER).parent / "tests" / "fixtures" / "fake_server.py"), "--args-file", str(args)]


def scratch_profile() -> Path:
    return Path(tempfile.mkdtemp(prefix="coffer-chromium-"))
