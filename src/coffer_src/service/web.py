"""Web: the page's own loopback listener in the service: login, cookie, CSRF, CSP.

`coffer open` asks the service (over its private channel, so only this user can) for a one-time login link; the
service starts this listener on 127.0.0.1 at its first request and keeps it while it runs.  The link sets an
HttpOnly, SameSite=Strict session cookie and hands the page a CSRF key it keeps in its origin's storage; every API
request then needs both (the cookie alone, which a browser also sends to other ports of the same host, reads
nothing), every change also a same-origin Origin, and every request a Host that is a loopback name (a DNS
rebinding site cannot pass).  Every response carries a Content-Security-Policy that allows this origin's own
scripts and styles and nothing else, so the page works air-gapped and runs no injected code.  The page's files are
source files under service/web/, embedded in coffer.py by the generator.  Every string an API answer carries goes
through the secret redactor on its way out.

Threads and locks: ThreadingHTTPServer runs a daemon thread per connection; each calls WebViews (its lock) or
ActivityLog (its lock).  ``WebAccess.lock`` guards the login tokens and sessions and is a leaf.
"""

from __future__ import annotations

import functools
import hmac
import html
import json
import logging
import secrets
import threading
import time
from typing import Callable, NamedTuple
from urllib.parse import parse_qsl, urlsplit

from coffer_src.digests import sha256
from coffer_src.errors import CofferError, CofferException
from coffer_src.resources import package_data
from coffer_src.service.web_activity import ActivityLog
from coffer_src.service.web_views import WebViews
from coffer_src.terminal import redact
from coffer_src.threads import start_thread

web_log = logging.getLogger(__name__)

#: How long a login link works (once).
WEB_LOGIN_SECONDS = 300.0
#: Signed-in browsers kept at once (the oldest goes first), and how long one unused stays signed in.
WEB_SESSIONS_MAX = 16
WEB_SESSION_IDLE_SECONDS = 12 * 3600.0
#: A page that made a request this recently keeps the service from its idle exit.
WEB_ACTIVE_SECONDS = 120.0
WEB_BODY_MAX = 64 << 10
WEB_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WEB_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
WEB_HEADERS = (("Content-Security-Policy", WEB_CSP), ("X-Content-Type-Options", "nosniff"),
               ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
               ("Cross-Origin-Opener-Policy", "same-origin"), ("Cross-Origin-Resource-Policy", "same-origin"))
WEB_KEY_HEADER = "X-Coffer-Token"

# The page's files, embedded by the generator; served under a name that holds a digest of their content, so a
# browser keeps them until Coffer changes.
_WEB_FILES = {
    "app.css": ("text/css; charset=utf-8", package_data("service/web/app.css")),
    "app.js": ("text/javascript; charset=utf-8", package_data("service/web/app.js")),
    "charts.js": ("text/javascript; charset=utf-8", package_data("service/web/charts.js")),
    "views.js": ("text/javascript; charset=utf-8", package_data("service/web/views.js")),
    "login.js": ("text/javascript; charset=utf-8", package_data("service/web/login.js")),
    "icon.svg": ("image/svg+xml", package_data("service/web/icon.svg")),
}
_WEB_PAGE = package_data("service/web/index.html")
_WEB_MESSAGE = package_data("service/web/message.html")
_WEB_LOGIN = package_data("service/web/login.html")


def _asset_name(name: str, text: str) -> str:
    stem, _, extension = name.rpartition(".")
    return f"{stem}.{sha256(text.encode()).hexdigest()[:12]}.{extension}"


@functools.cache
def web_assets() -> tuple[dict[str, tuple[str, bytes]], dict[str, str]]:
    """The page's files by their served name (type, bytes), and each file's path: made when the page is first
    served, not by every process that loads Coffer."""
    assets = {_asset_name(name, text): (kind, text.encode()) for name, (kind, text) in _WEB_FILES.items()}
    paths = {name: "/static/" + _asset_name(name, text) for name, (_, text) in _WEB_FILES.items()}
    return assets, paths


def _fill(template: str, **values: str) -> str:
    """The page's templates hold {{name}} for an asset's path and {{key}} for values (escaped here)."""
    for name, path in web_assets()[1].items():
        template = template.replace("{{" + name + "}}", path)
    for key, value in values.items():
        template = template.replace("{{" + key + "}}", html.escape(value, quote=True))
    return template


def redacted(value):
    """``value`` with every string passed through the secret redactor (keys too): what an answer may carry."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redacted(key) if isinstance(key, str) else key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item) for item in value]
    return value


def loopback_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback (with a port): a DNS-rebinding page names its own."""
    name, sep, port = host.rpartition(":")
    return bool(sep) and port.isdigit() and name.lower() in WEB_LOOPBACK_NAMES


class WebSession(NamedTuple):
    """A signed-in browser: its cookie value and the CSRF key its page sends with every API request."""
    cookie: str
    key: str
    created: float


class WebAccess:
    """One-time login tokens and signed-in browsers (see the module docstring); ``lock`` is a leaf."""

    def __init__(self):
        self.lock = threading.Lock()
        self._tokens: dict[str, float] = {}
        self._sessions: dict[str, WebSession] = {}
        self._seen: dict[str, float] = {}

    def issue(self) -> str:
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self.lock:
            self._tokens = {t: expiry for t, expiry in self._tokens.items() if expiry > now}
            self._tokens[token] = now + WEB_LOGIN_SECONDS
        return token

    def redeem(self, token: str) -> WebSession | None:
        """A new signed-in browser for an unused, unexpired login token (which is then spent), else None."""
        now = time.monotonic()
        with self.lock:
            match = next((t for t in self._tokens if hmac.compare_digest(t.encode(), token.encode())), None)
            if match is None:
                return None
            expiry = self._tokens.pop(match)
            if expiry < now:
                return None
            session = WebSession(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now)
            self._sessions[session.cookie] = session
            self._seen[session.cookie] = now
            while len(self._sessions) > WEB_SESSIONS_MAX:
                oldest = min(self._sessions.values(), key=lambda s: self._seen.get(s.cookie, s.created))
                self._sessions.pop(oldest.cookie)
                self._seen.pop(oldest.cookie, None)
            return session

    def find(self, cookie: str | None) -> WebSession | None:
        if not cookie:
            return None
        now = time.monotonic()
        with self.lock:
            session = self._sessions.get(cookie)
            if session is None:
                return None
            if now - self._seen.get(cookie, session.created) > WEB_SESSION_IDLE_SECONDS:
                self._sessions.pop(cookie)
                self._seen.pop(cookie, None)
                return None
            self._seen[cookie] = now
            return session


class WebRefusal(CofferException):
    """A request refused before it reached a view: its status, the text the page shows, and a short code."""

    def __init__(self, status: int, text: str, code: str):
        super().__init__(text)
        self.status, self.text, self.code = status, text, code


class WebServer:
    """The page's listener for one service: started by the first login link, closed with the service."""

    def __init__(self, service):
        self.service = service
        self.access = WebAccess()
        self.activity: ActivityLog | None = None   # made with the listener: a service nobody opens pays nothing
        self.views: WebViews | None = None
        self.lock = threading.Lock()   # guards httpd, views and activity (made once); a leaf
        self.httpd = None  # a ThreadingHTTPServer (_web_classes) once the page is first asked for
        self.last_used = 0.0
        self.reads: dict[str, Callable[[dict], dict]] = {
            "overview": lambda q: self.views.overview(),
            "servers": lambda q: self.views.servers(),
            "catalogue": lambda q: self.views.catalogue(q),
            "capability": lambda q: self.views.capability(q),
            "changes": lambda q: self.views.changes(),
            "activity": lambda q: {**self.activity.report(q.get("range") or "day", q.get("group") or "server",
                                                          q.get("only") or None),
                                   "choices": self.activity.choices()},
            "search": lambda q: self.views.search(q.get("q", ""), q.get("top_k"), q.get("profile")),
            "knowledge": lambda q: self.views.knowledge(),
            "sessions": lambda q: self.views.sessions(),
        }
        self.changes: dict[str, Callable[[dict], dict]] = {
            "enable": lambda b: {"message": self.views.set_enabled(b.get("target"), True)},
            "disable": lambda b: {"message": self.views.set_enabled(b.get("target"), False)},
            "approve": lambda b: self.views.approve(b.get("target")),
            "restart": lambda b: {"message": self.views.restart(b.get("server"))},
            "knowledge/add": lambda b: {"message": self.views.knowledge_add(b.get("path"), b.get("name"),
                                                                            b.get("globs"))},
            "knowledge/remove": lambda b: {"message": self.views.knowledge_remove(b.get("name"))},
            "knowledge/reindex": lambda b: {"message": self.views.knowledge_reindex(b.get("name"))},
        }

    # -- life ------------------------------------------------------------------------------------------------
    def login_link(self, request: dict | None = None) -> dict:
        """The `web` control op: a one-time login link (the listener starts now if it has not yet)."""
        with self.lock:
            if self.httpd is None:
                self.activity = ActivityLog(self.service.vault.path)
                self.views = WebViews(self.service, self.activity)
                server_class, handler_class = _web_classes()
                self.httpd = server_class(("127.0.0.1", 0), handler_class)
                self.httpd.web = self
                start_thread(self.httpd.serve_forever, "coffer-web", 0.25)
                web_log.info("the page listens on http://127.0.0.1:%d/", self.port)
            port = self.port
        self.last_used = time.monotonic()
        return {"url": f"http://127.0.0.1:{port}/login?t={self.access.issue()}", "origin": f"http://127.0.0.1:{port}"}

    @property
    def port(self) -> int:
        return self.httpd.server_address[1] if self.httpd is not None else 0

    def busy(self) -> bool:
        """Whether a page used the service recently (it then does not exit idle under the user's eyes)."""
        return self.httpd is not None and time.monotonic() - self.last_used < WEB_ACTIVE_SECONDS

    def close(self) -> None:
        with self.lock:
            httpd, self.httpd = self.httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            self.activity.close()
            self.views.close()

    # -- requests --------------------------------------------------------------------------------------------
    def respond(self, handler, method: str) -> None:
        try:
            status, kind, body, headers = self._route(handler, method)
        except (OSError, ValueError):  # the browser went away mid-request, or sent a broken one
            handler.close_connection = True
            return
        except WebRefusal as refusal:
            if method != "GET":   # its body (if any) was not read: the connection cannot carry another request
                handler.close_connection = True
            if urlsplit(handler.path).path.startswith("/api/"):
                status, kind, body, headers = refusal.status, "application/json", {"error": refusal.text,
                                                                                   "code": refusal.code}, ()
            else:
                status, kind, body, headers = refusal.status, "text/html", self._message(
                    "Coffer", refusal.text), ()
        if kind == "application/json":
            body = json.dumps(redacted(body), ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
            kind = "application/json; charset=utf-8"
        elif isinstance(body, str):
            body = body.encode("utf-8", "replace")
            kind = f"{kind}; charset=utf-8" if "charset" not in kind else kind
        send_web_response(handler, status, kind, body, headers)

    def _message(self, title: str, text: str) -> str:
        return _fill(_WEB_MESSAGE, title=title, message=text)

    def _route(self, handler, method: str):
        host = handler.headers.get("Host") or ""
        if not loopback_host(host):
            raise WebRefusal(421, "Refused: this page answers only at a loopback address (127.0.0.1), and this "
                                  "request names another host.", "host")
        if method not in ("GET", "POST"):
            raise WebRefusal(405, "This page answers GET and POST only.", "method")
        url = urlsplit(handler.path)
        path = url.path
        if path.startswith("/static/") and method == "GET":
            asset = web_assets()[0].get(path[len("/static/"):])
            if asset is None:
                raise WebRefusal(404, "Not found.", "not-found")
            return 200, asset[0], asset[1], (("Cache-Control", "public, max-age=31536000, immutable"),)
        if path == "/favicon.ico" and method == "GET":
            assets, paths = web_assets()
            kind, data = assets[paths["icon.svg"][len("/static/"):]]
            return 200, kind, data, (("Cache-Control", "public, max-age=86400"),)
        if path == "/login" and method == "GET":
            return self._login(dict(parse_qsl(url.query)).get("t", ""))
        session = self.access.find(self._cookie(handler))
        if path in ("/", "/index.html") and method == "GET":
            if session is None:
                raise WebRefusal(401, "Not signed in. Run `coffer open` in a terminal: it opens this page with a "
                                      "one-time login link.", "signed-out")
            return 200, "text/html", _fill(_WEB_PAGE), ()
        if not path.startswith("/api/"):
            raise WebRefusal(404, "Not found.", "not-found")
        name = path[len("/api/"):]
        table = self.reads if method == "GET" else self.changes
        if name not in table:
            raise WebRefusal(404 if name not in self.reads and name not in self.changes else 405,
                             f"No {method} /api/{name} here.", "not-found")
        if session is None:
            raise WebRefusal(401, "Not signed in: run `coffer open` for a new login link.", "signed-out")
        offered = handler.headers.get(WEB_KEY_HEADER) or ""
        if not hmac.compare_digest(offered.encode("utf-8", "replace"), session.key.encode()):
            raise WebRefusal(403, "Refused: the request lacks this page's key (a request from another page?). "
                                  "Reload the page, or run `coffer open`.", "csrf")
        fetch_site = handler.headers.get("Sec-Fetch-Site")
        if fetch_site is not None and fetch_site not in ("same-origin", "none"):
            raise WebRefusal(403, "Refused: the request came from another site.", "cross-site")
        self.last_used = time.monotonic()
        if method == "GET":
            return self._answer(table[name], dict(parse_qsl(url.query)))
        if handler.headers.get("Origin") != f"http://{host}":
            raise WebRefusal(403, "Refused: a change must come from this page (its Origin is missing or another "
                                  "site's).", "origin")
        return self._answer(table[name], self._body(handler))

    def _answer(self, view: Callable[[dict], dict], argument: dict):
        try:
            return 200, "application/json", view(argument), ()
        except CofferError as exc:
            return 400, "application/json", {"error": str(exc)}, ()
        except Exception:  # noqa: BLE001 - one view's bug must not cost the service; the log has it
            web_log.exception("the page's request failed")
            return 500, "application/json", {"error": "internal error: see COFFER_HOME/logs/service.log"}, ()

    @staticmethod
    def _cookie(handler) -> str | None:
        raw = handler.headers.get("Cookie")
        if not raw:
            return None
        import http.cookies  # here: only the page reads cookies, and most services never serve it
        try:
            jar = http.cookies.SimpleCookie(raw)
        except http.cookies.CookieError:
            return None
        morsel = jar.get(_cookie_name(handler.server.server_address[1]))
        return morsel.value if morsel is not None else None

    @staticmethod
    def _body(handler) -> dict:
        if (handler.headers.get("Content-Type") or "").split(";")[0].strip().lower() != "application/json":
            raise WebRefusal(415, "A change is sent as JSON.", "content-type")
        try:
            length = int(handler.headers.get("Content-Length") or "")
        except ValueError:
            raise WebRefusal(411, "A change needs its length.", "length") from None
        if length < 0 or length > WEB_BODY_MAX:
            handler.close_connection = True
            raise WebRefusal(413, "That request is too large.", "too-large")
        try:
            body = json.loads(handler.rfile.read(length) or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise WebRefusal(400, "That request is not JSON.", "json") from None
        if not isinstance(body, dict):
            raise WebRefusal(400, "That request is not a JSON object.", "json")
        return body

    def _login(self, token: str):
        session = self.access.redeem(token) if token else None
        if session is None:
            raise WebRefusal(403, "This login link was already used or has expired. Run `coffer open` for a new "
                                  "one.", "login")
        cookie = f"{_cookie_name(self.port)}={session.cookie}; HttpOnly; SameSite=Strict; Path=/"
        page = _fill(_WEB_LOGIN, key=session.key)
        return 200, "text/html", page, (("Set-Cookie", cookie),)


def _cookie_name(port: int) -> str:
    """Cookies are not kept apart by port: each service's page has its own name, so two homes' pages (two
    services on two ports) never overwrite each other's sign-in."""
    return f"coffer_{port}"


def send_web_response(handler, status: int, kind: str, body: bytes,
                      headers=()) -> None:
    """Every response goes out here, with the page's security headers (the CSP above all)."""
    handler.send_response(status)
    names = {name.lower() for name, _ in headers}
    for name, value in WEB_HEADERS:
        handler.send_header(name, value)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    if "cache-control" not in names:
        handler.send_header("Cache-Control", "no-store")
    for name, value in headers:
        handler.send_header(name, value)
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


@functools.cache
def _web_classes() -> tuple[type, type]:
    """The page's server and request handler classes, made on first use: http.server brings email, mimetypes and
    ssl with it, which a relay and a service nobody opens the page of have no use for."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class WebHTTPServer(ThreadingHTTPServer):
        daemon_threads = True
        block_on_close = False
        web: WebServer

    class WebHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "Coffer"
        sys_version = ""
        timeout = 60  # an idle keep-alive connection is closed after this

        def do_GET(self):
            self.server.web.respond(self, "GET")

        def do_POST(self):
            self.server.web.respond(self, "POST")

        def _refuse_method(self):
            self.server.web.respond(self, self.command)

        do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

        def send_error(self, code, message=None, explain=None):
            """A request the parser refused (too long, malformed): still with the security headers."""
            self.close_connection = True
            text = html.escape(message or self.responses.get(code, ("Error",))[0])
            send_web_response(self, code, "text/plain; charset=utf-8", text.encode())

        def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
            web_log.debug("page: %s", format % args)

    return WebHTTPServer, WebHandler


def attach_web(service) -> None:
    """Give a service the page: the `web` control op (`coffer open` asks it for a login link), its activity
    keeping the service from its idle exit, and its listener closed with the service."""
    web = WebServer(service)
    service.controls["web"] = web.login_link
    service.busy_checks.append(web.busy)
    service.closers.append(web.close)
