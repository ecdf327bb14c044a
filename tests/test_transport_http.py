"""Every HTTP exchange Coffer makes (remote upstreams, OAuth, the embedder) goes through one redirect-safe,
bounded client: against real local HTTP(S) servers (tests/fixtures/hostile_http.py) that redirect, misbehave and
record every request, so a test can prove which credentials reached which origin; the SSE reader; a Streamable
HTTP upstream run in-process; threads, deadlines and permanent failures."""

import io
import json
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coffer_src.jsonrpc import request_id_in
from coffer_src.transport.http import read_sse_events

import hostile_http
from conftest import (
    FAKE,
    call_upstream,
    cli,
    healthy,
    http_config,
    linux_only,
    proc_status,
    quick_restarts,
    server_status,
    servers,
    start_upstream,
    text_of,
    wait_for_status,
    wait_until,
)
from hostile_http import HostileHttp, embeddings, mcp, redirect, status

TOKEN, API_KEY = "tok-5ecret-aa11", "key-5ecret-bb22"
SECRET_ENV = {"REMOTE_TOKEN": TOKEN, "REMOTE_KEY": API_KEY}
CREDENTIAL_HEADERS = ("--header", "Authorization=Bearer ${REMOTE_TOKEN}", "--header", "X-Api-Key=${REMOTE_KEY}")


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    """The user's shell has the tokens: `coffer add` (which may probe the URL) and the gateway both see them."""
    for key, value in SECRET_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def origins():
    servers = []

    def make(cert=None):
        server = HostileHttp(cert)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    made = hostile_http.self_signed_cert(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("no openssl CLI to make a certificate")
    return made


def leaks(server):
    """Requests that reached ``server`` carrying a credential or a session id."""
    found = []
    for request in server.seen():
        carried = [name for name in ("authorization", "x-api-key", "mcp-session-id") if name in request.headers]
        if carried or TOKEN in json.dumps(request.headers) or API_KEY in json.dumps(request.headers):
            found.append((request.method, request.path, carried))
    return found


def started(watched_gateway, env=None, **kwargs):
    if "good" not in servers():
        cli("add", "good", "--", *FAKE)
    gw = watched_gateway(env={**SECRET_ENV, **(env or {})}, **kwargs)
    gw.initialize()
    gw.send({"jsonrpc": "2.0", "id": "first-list", "method": "tools/list"})
    gw.wait_for(lambda g: g.responses.get('"first-list"') or g.proc.poll() is not None, timeout=60)
    return gw


def settled_with_a_redirect_error(name):
    """The upstream is reported failed (a refused redirect is not retried) and says it was a redirect: from then on
    nothing more is sent on its behalf."""
    status_row = wait_for_status(name, "failed")
    assert "redirect" in (status_row["detail"] or "").lower(), status_row
    return status_row


def wait_logged(gw, text, what):
    """Wait until the gateway's stderr says ``text``: the proof that what it logs about has happened."""
    try:
        gw.wait_for(lambda g: text in g.stderr_text() or g.proc.poll() is not None, timeout=30)
    except TimeoutError:
        pass
    assert text in gw.stderr_text(), f"the gateway never logged {what}: {gw.stderr_text()[-2000:]}"


# -- the SSE reader and a Streamable HTTP upstream, in-process ---------------------------------------------------------

def test_sse_reader_keeps_memory_bounded_and_reports_oversized_events():
    huge_line = b"data: " + b'{"jsonrpc":"2.0","id":7,"result":{"x":"' + b"a" * 300_000 + b'"}}\n\n'
    many_lines = b"".join(b"data: " + b"b" * 1000 + b"\n" for _ in range(500)) + b"\n"
    stream = io.BytesIO(b": keepalive\n\nevent: endpoint\ndata: /message?s=1\r\n\r\n" + huge_line + many_lines
                        + b'data: {"jsonrpc":"2.0","method":"ok"}\n\n' + b"data: unfinished")
    events = list(read_sse_events(stream.readline, 10_000))
    assert [e.kind for e in events] == ["endpoint", "message", "message", "message"]
    assert events[0].data == b"/message?s=1"
    assert events[1].oversized > 300_000 and len(events[1].data) <= 4096
    assert request_id_in(events[1].data) == 7  # the oversized answer can still be failed by id
    assert events[2].oversized > 10_000 and len(events[2].data) <= 4096
    assert json.loads(events[3].data) == {"jsonrpc": "2.0", "method": "ok"}  # and the stream goes on


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


# -- redirects never carry credentials to another origin ---------------------------------------------------------------

def test_a_cross_origin_redirect_of_a_post_never_carries_credentials(home, origins, watched_gateway):
    elsewhere = origins()
    elsewhere.routes["/mcp"] = mcp("elsewhere")
    here = origins()
    cli("config", "max_restarts", "2")
    quick_restarts()
    for code in (301, 302, 303, 307, 308):
        here.routes[f"/r{code}"] = redirect(code, elsewhere.url("/mcp"))
        cli("add", f"r{code}", "--url", here.url(f"/r{code}"), *CREDENTIAL_HEADERS)
    # initialize answered here, the session's later requests redirected away (with the session id)
    here.routes["/later"] = mcp("here", redirect_after_init=(307, elsewhere.url("/mcp")))
    cli("add", "later", "--url", here.url("/later"), *CREDENTIAL_HEADERS)
    gw = started(watched_gateway)
    wait_until(lambda: all(len(here.seen(path=f"/r{code}")) >= 1 for code in (301, 302, 303, 307, 308))
               and here.seen("POST", "/later"), what="every upstream to be tried")
    for code in (301, 302, 303, 307, 308):
        assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in here.seen(path=f"/r{code}"))
    healthy(gw)
    for name in ("r301", "r302", "r303", "r307", "r308", "later"):  # every redirect met and refused
        settled_with_a_redirect_error(name)
    assert not leaks(elsewhere), f"credentials reached another origin: {leaks(elsewhere)}"


def test_a_redirect_of_the_sse_stream_never_carries_credentials(home, origins, watched_gateway):
    elsewhere = origins()
    elsewhere.routes["/mcp"] = mcp("elsewhere")
    here = origins()
    for code in (307, 308):
        here.routes[f"/s{code}"] = mcp("here", sse_get=redirect(code, elsewhere.url("/mcp")))
        cli("add", f"s{code}", "--url", here.url(f"/s{code}"), *CREDENTIAL_HEADERS)
    gw = started(watched_gateway, env={"COFFER_LOG": "debug"})  # the refused stream is a debug line
    wait_until(lambda: all(here.seen("GET", f"/s{code}") for code in (307, 308)), what="the SSE GETs")
    for name in ("s307", "s308"):  # each stream's redirect met and refused
        gw.wait_for(lambda g, name=name: any(f"[{name}]" in line and "redirected to" in line
                                             for line in g.stderr_lines))
    healthy(gw)
    assert not leaks(elsewhere), f"the SSE stream's credentials reached another origin: {leaks(elsewhere)}"
    reply = gw.request("tools/call", {"name": "s307__echo", "arguments": {"text": "posts still work"}})
    assert reply["result"]["content"][0]["text"] == "here: posts still work"


def test_an_https_to_http_redirect_is_refused(home, origins, watched_gateway, cert):
    cleartext = origins()
    cleartext.routes["/mcp"] = mcp("cleartext")
    secure = origins(cert)
    secure.routes["/mcp"] = redirect(302, cleartext.url("/mcp"))
    secure.routes["/ok"] = mcp("secure")
    cli("config", "max_restarts", "2")
    quick_restarts()
    cli("add", "down", "--url", secure.url("/mcp"), *CREDENTIAL_HEADERS)
    cli("add", "tls", "--url", secure.url("/ok"), *CREDENTIAL_HEADERS)
    gw = started(watched_gateway, env={"SSL_CERT_FILE": cert[0]})
    reply = gw.request("tools/call", {"name": "tls__echo", "arguments": {"text": "over tls"}})
    assert reply["result"]["content"][0]["text"] == "secure: over tls", "the HTTPS upstream itself must work"
    wait_until(lambda: secure.seen("POST", "/mcp"), what="the redirecting upstream to be tried")
    healthy(gw)
    settled_with_a_redirect_error("down")  # the downgrade met and refused
    assert not cleartext.seen(), f"a downgrade was followed: {[(r.method, r.path) for r in cleartext.seen()]}"


def test_a_same_origin_redirect_is_followed_and_a_loop_is_not(home, origins, watched_gateway):
    here = origins()
    here.routes["/mcp"] = mcp("here")
    here.routes["/old"] = redirect(307, here.url("/mcp"))
    here.routes["/moved"] = redirect(308, "/mcp")  # relative Location
    here.routes["/loop"] = redirect(307, here.url("/loop"))
    cli("config", "max_restarts", "2")
    quick_restarts()
    for name in ("old", "moved", "loop"):
        cli("add", name, "--url", here.url(f"/{name}"), *CREDENTIAL_HEADERS)
    gw = started(watched_gateway)
    for name in ("old", "moved"):
        reply = gw.request("tools/call", {"name": f"{name}__echo", "arguments": {"text": "followed"}})
        assert reply.get("result", {}).get("content", [{}])[0].get("text") == "here: followed", reply
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in here.seen("POST", "/mcp"))
    settled_with_a_redirect_error("loop")
    healthy(gw)


def test_the_embedder_never_sends_its_key_to_another_origin(home, origins, watched_gateway):
    elsewhere = origins()
    elsewhere.routes["/v1/embeddings"] = embeddings()
    here = origins()
    here.routes["/v1/embeddings"] = redirect(302, elsewhere.url("/v1/embeddings"))
    cli("config", "embedder_url", here.url("/v1"))
    cli("config", "embedder_model", "test")
    cli("config", "embedder_key_env", "EMBED_KEY")
    gw = started(watched_gateway, env={"EMBED_KEY": TOKEN})
    reply = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": "echo some text"}})
    assert "result" in reply
    wait_until(lambda: here.seen("POST", "/v1/embeddings"), what="the embedder to be used")
    assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in here.seen("POST", "/v1/embeddings"))
    wait_logged(gw, "redirected to", "the embedder's refused redirect")
    healthy(gw)
    assert not leaks(elsewhere), f"the embedder's key reached another origin: {leaks(elsewhere)}"


def test_adding_credentials_over_plain_http_to_a_remote_host_warns_once(home):
    plain = cli("add", "plain", "--url", "http://mcp.example.com/mcp", "--header",
                "Authorization=Bearer ${REMOTE_TOKEN}")
    assert "http" in plain.stderr.lower() and plain.stderr.strip(), "no warning about credentials over plain http"
    assert len([line for line in plain.stderr.splitlines() if line.strip()]) == 1, plain.stderr
    for name, url in (("tls", "https://mcp.example.com/mcp"), ("loop4", "http://127.0.0.1:9/mcp"),
                      ("local", "http://localhost:9/mcp"), ("loop6", "http://[::1]:9/mcp")):
        quiet = cli("add", name, "--url", url, "--header", "Authorization=Bearer ${REMOTE_TOKEN}")
        assert quiet.stderr.strip() == "", f"{url}: {quiet.stderr}"
    assert cli("list").stderr.strip() == "", "the warning belongs to `add`, once"


# -- threads, deadlines and bounded bodies -----------------------------------------------------------------------------

@linux_only
def test_slow_http_calls_cost_no_thread_each_and_never_hold_up_a_quick_call_or_a_cancellation(home, origins,
                                                                                              watched_gateway):
    """Bounding the threads that talk to one HTTP upstream (64 requests in flight; more wait their turn) must not
    queue a quick call behind a batch of long-running calls within that bound, nor a cancellation ever; and 200
    slow calls must not cost a thread each."""
    here = origins()
    here.routes["/mcp"] = mcp("here")
    cli("add", "remote", "--url", here.url("/mcp"))
    gw = started(watched_gateway)
    threads = []
    for i in range(40):
        gw.send({"jsonrpc": "2.0", "id": f"slow{i}", "method": "tools/call",
                 "params": {"name": "remote__slow", "arguments": {"seconds": 30}}})
    wait_until(lambda: len([r for r in here.seen("POST") if b'"slow"' in r.body]) >= 1, what="a slow call")
    threads.append(proc_status(gw.proc.pid, "Threads"))
    gw.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "slow0"}})
    try:
        quick = gw.request("tools/call", {"name": "remote__echo", "arguments": {"text": "quick"}}, timeout=20)
    except TimeoutError:
        pytest.fail("a quick call waited behind the slow calls to the same HTTP upstream")
    assert quick["result"]["content"][0]["text"] == "here: quick", quick
    with gw.cond:
        finished = [k for k in gw.responses if k.startswith('"slow')]
    assert not finished or finished == ['"slow0"'], "the quick call waited for the slow ones"
    wait_until(lambda: any(b"notifications/cancelled" in r.body for r in here.seen("POST")), timeout=10,
               what="the cancellation to reach the server while the slow calls run")
    for i in range(40, 200):
        gw.send({"jsonrpc": "2.0", "id": f"slow{i}", "method": "tools/call",
                 "params": {"name": "remote__slow", "arguments": {"seconds": 30}}})
    wait_until(lambda: len([r for r in here.seen("POST") if b'"slow"' in r.body]) >= 64, what="64 slow calls")
    threads.append(proc_status(gw.proc.pid, "Threads"))
    assert max(threads) < 120, f"{max(threads)} threads for 200 slow calls to one HTTP upstream"


def test_a_call_to_a_remembered_tool_of_a_remote_that_hangs_at_initialize_meets_call_timeout(home, origins,
                                                                                              watched_gateway):
    here = origins()
    serve = mcp("here")
    hanging, test_over = {"on": False}, threading.Event()

    def route(request):
        if hanging["on"] and b'"initialize"' in request.body:
            test_over.wait(90)  # accepts the connection, never answers in time
        return serve(request)

    here.routes["/mcp"] = route
    cli("add", "remote", "--url", here.url("/mcp"))
    cli("config", "call_timeout", "3")
    gw = started(watched_gateway)
    assert gw.request("tools/call", {"name": "remote__echo", "arguments": {"text": "x"}})["result"]
    gw.close()
    hanging["on"] = True
    gw = started(watched_gateway)
    gw.send({"jsonrpc": "2.0", "id": "call", "method": "tools/call",
             "params": {"name": "remote__echo", "arguments": {"text": "x"}}})
    try:
        reply = gw.wait_response("call", timeout=25)  # init_timeout is 60 s and there are 5 attempts
    except TimeoutError:
        pytest.fail("a call to a remote that hangs at initialize was not answered within call_timeout")
    finally:
        test_over.set()
    assert reply["result"].get("isError") is True, reply
    healthy(gw)


@linux_only
@pytest.mark.parametrize("kind", ["json", "sse-event", "sse-lines"])
def test_an_oversized_http_reply_fails_that_upstream_and_memory_stays_bounded(home, origins, watched_gateway, kind):
    cli("config", "max_message_bytes", "1000000")
    cli("config", "max_restarts", "2")
    quick_restarts()
    here = origins()
    here.routes["/mcp"] = mcp("here", huge_list=(kind, 400))
    cli("add", "huge", "--url", here.url("/mcp"))
    gw = started(watched_gateway, rss_ceiling_mb=250)
    baseline = proc_status(gw.proc.pid, "VmHWM")
    wait_until(lambda: gw.proc.poll() is not None or server_status("huge")["status"] in ("failed", "backoff"),
               timeout=120, interval=0.2, what="the oversized list to be refused (or the gateway killed)")
    if gw.over_ceiling:
        pytest.fail(f"a 400 MiB HTTP reply ({kind}) took the gateway's RSS to {gw.over_ceiling // 1024} MB")
    healthy(gw)
    assert proc_status(gw.proc.pid, "VmHWM") - baseline < 100 * 1024
    said = (server_status("huge")["detail"] or "") + gw.stderr_text()
    assert any(word in said.lower() for word in ("max_message_bytes", "too large", "limit", "exceed")), said[-1000:]


@linux_only
def test_an_oversized_embedder_reply_is_bounded(home, origins, watched_gateway):
    cli("config", "max_message_bytes", "1000000")
    here = origins()
    here.routes["/v1/embeddings"] = embeddings(huge_mib=400)
    cli("config", "embedder_url", here.url("/v1"))
    cli("config", "embedder_model", "test")
    gw = started(watched_gateway, rss_ceiling_mb=250)
    reply = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": "echo text"}})
    assert "result" in reply
    # The tool vectors are embedded in the background: wait until the gateway has read (and refused) the huge
    # reply, or has been killed for its RSS.
    gw.wait_for(lambda g: g.proc.poll() is not None or "tool vectors unavailable" in g.stderr_text(), timeout=60)
    if gw.over_ceiling:
        pytest.fail(f"a 400 MiB embeddings reply took the gateway's RSS to {gw.over_ceiling // 1024} MB")
    assert "larger than" in gw.stderr_text(), gw.stderr_text()[-2000:]
    healthy(gw)


# -- permanent failures fail at once -----------------------------------------------------------------------------------

def initialize_posts(server, path):
    return [r for r in server.seen("POST", path) if b'"initialize"' in r.body]


@pytest.mark.parametrize("code", [401, 403, 404])
def test_a_permanent_http_status_fails_at_once_with_the_status(home, origins, watched_gateway, code):
    here = origins()
    here.routes["/mcp"] = status(code)
    here.routes["/flaky"] = status(503)
    quick_restarts()  # the 503 is retried sooner
    cli("add", "denied", "--url", here.url("/mcp"), *CREDENTIAL_HEADERS)
    cli("add", "flaky", "--url", here.url("/flaky"))
    probed = len(initialize_posts(here, "/mcp"))  # `coffer add` may have tried it once already
    gw = started(watched_gateway)
    failed = wait_for_status("denied", "failed")
    assert str(code) in (failed["detail"] or ""), failed
    wait_until(lambda: len(initialize_posts(here, "/flaky")) >= 2, what="a 503 to be retried")
    assert len(initialize_posts(here, "/mcp")) - probed == 1, f"HTTP {code} was retried by the gateway"
    reply = gw.request("tools/call", {"name": "denied__echo", "arguments": {}})
    assert "error" in reply or reply["result"].get("isError")
    healthy(gw)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/mcp", "ftp://example.com/mcp", "not a url"])
def test_an_invalid_url_is_refused_at_add_or_fails_at_once(home, watched_gateway, url):
    added = cli("add", "bad", "--url", url, check=False)
    assert "Traceback" not in added.stderr
    if added.returncode != 0:
        assert added.stderr.strip().count("\n") == 0 and "bad" not in cli("list").stdout
        return
    gw = started(watched_gateway)
    wait_for_status("bad", "failed")
    healthy(gw)
    attempts = sum(1 for line in gw.stderr_lines if "[bad]" in line and "fail" in line.lower())
    assert attempts <= 2, f"an invalid URL was retried ({attempts} failure lines)"
