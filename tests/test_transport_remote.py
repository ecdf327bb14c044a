"""Remote upstreams as users meet them (issue 13): the published server-everything over the legacy HTTP+SSE
transport and over Streamable HTTP, told apart by auto-detection and aggregated beside stdio servers; a dropped
SSE stream; an SSE endpoint or a redirect that would take credentials to another origin."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest

from conftest import (
    TIME_SERVER,
    Everything,
    async_wait_until,
    call_until_ok,
    cli,
    needs_node,
    quick_restarts,
    server_status,
    text_of,
    through_gateway,
    wait_for_status,
)


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
        quick_restarts()

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
                assert await async_wait_until(lambda: progress, 20), "no progress from the long call"
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
    assert wait_for_status("evsse", "ready")


# -- credentials stay with the configured origin -----------------------------------------------------------------------

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
        row = server_status("evil2")
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
        row = server_status("redir2")
    finally:
        redirecting.shutdown()
        elsewhere.shutdown()
    assert "refused, credentials never leave the configured origin" in added.stdout
    assert row["status"] == "failed" and "redirected to http://localhost" in row["detail"]
    assert listed.returncode == 1 and "redir2 did not start" in listed.stderr
    assert elsewhere.seen == []
    assert all("sk-redirect-0123456789" not in text for text in transcript.texts)
