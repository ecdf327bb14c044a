"""The upstream layer's contracts, in process: the events an Upstream sends and who implements them, the one place
an upstream's status is recorded, the restart backoff setting, the one probe for which HTTP transport a server
speaks, and log lines that name their server."""

import http.server
import inspect
import logging
import os
import sqlite3
import sys
import threading
import time
import types

import pytest
from conftest import FAKE

from coffer_src.errors import VaultError
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.instances import PrivateEvents
from coffer_src.probe import GatewayClient, ServerProbe
from coffer_src.terminal import ServerLog
from coffer_src.transport.http import HttpReply, initialize_or_stream
from coffer_src.transport.remote import HttpTransport
from coffer_src.transport.stdio import StdioTransport
from coffer_src.upstream.supervisor import Upstream, UpstreamEvents, record_upstream_status
from coffer_src.vault import DEFAULTS

EVENTS = ("on_ready", "on_down", "on_list_changed", "on_notification", "on_request")


class Events:
    """An owner that notes what it is told."""

    def __init__(self):
        self.failed = threading.Event()
        self.ready = threading.Event()

    def on_ready(self, upstream):
        self.ready.set()

    def on_down(self, upstream):
        if upstream.state == "failed":
            self.failed.set()

    def on_list_changed(self, upstream, kind, items, notify):
        pass

    def on_notification(self, upstream, message):
        pass

    def on_request(self, upstream, message):
        pass


def stdio_config(name, argv):
    return {"name": name, "transport": "stdio", "command": argv, "env": {}, "headers": {}, "cwd": None,
            "inherit_env": ["*"]}


# -- the events interface --------------------------------------------------------------------------------------

def test_the_events_protocol_names_what_an_upstream_sends():
    declared = {name for name, _ in inspect.getmembers(UpstreamEvents, inspect.isfunction) if name.startswith("on_")}
    assert declared == set(EVENTS)


@pytest.mark.parametrize("implementer", [Hub, PrivateEvents, ServerProbe, GatewayClient], ids=lambda cls: cls.__name__)
def test_every_owner_of_upstreams_implements_every_event_with_its_parameters(implementer):
    for name in EVENTS:
        expected = list(inspect.signature(getattr(UpstreamEvents, name)).parameters)
        method = getattr(implementer, name, None)
        assert method is not None, f"{implementer.__name__} does not handle {name}"
        assert list(inspect.signature(method).parameters) == expected, f"{implementer.__name__}.{name}"


# -- one record_status -----------------------------------------------------------------------------------------

class FakeVault:
    def __init__(self, error=None):
        self.rows, self.error = [], error

    def record_status(self, name, status, detail, capabilities=None):
        if self.error:
            raise self.error
        self.rows.append((name, status, detail, capabilities))


def fake_upstream(**fields):
    values = {"name": "srv", "server_info": {"name": "srv-impl", "version": "1.2"}, "capabilities": {"tools": {}},
              "lists": {"tool": {"a": {}, "b": {}}, "prompt": {}}, "last_error": None, "state": "ready"}
    values.update(fields)
    values["log"] = ServerLog(logging.getLogger("test.upstream"), values["name"])
    return types.SimpleNamespace(**values)


def test_a_ready_status_says_who_the_server_is_and_what_it_offers():
    vault = FakeVault()
    record_upstream_status(vault, threading.Lock(), fake_upstream(), "ready")
    assert vault.rows == [("srv", "ready", "srv-impl 1.2: 2 tools", {"tools": {}})]


def test_a_down_status_says_the_last_error_and_keeps_the_capabilities():
    vault = FakeVault()
    record_upstream_status(vault, threading.Lock(), fake_upstream(state="failed", last_error="exited with code 3"),
                           "failed")
    assert vault.rows == [("srv", "failed", "exited with code 3", None)]


def test_a_vault_that_cannot_be_written_costs_a_warning_not_the_caller(caplog):
    vault = FakeVault(VaultError.wrap(sqlite3.OperationalError("database is locked"), "/home/u/.coffer/coffer.db"))
    with caplog.at_level(logging.WARNING):
        record_upstream_status(vault, threading.Lock(), fake_upstream(), "ready")
    assert "[srv] could not record status: the vault /home/u/.coffer/coffer.db: database is locked" in caplog.text


# -- the restart backoff ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, expected", [({"restart_backoff": 0.25}, [0.25, 0.5, 1.0]),
                                                ({}, [0.5, 1.0, 2.0])], ids=["set", "default"])
def test_a_crash_loop_waits_by_the_restart_backoff_setting(monkeypatch, settings, expected):
    delays = []
    schedule = Upstream._schedule_start

    def record_then_start_now(self, delay):
        delays.append(delay)
        schedule(self, 0.0)

    monkeypatch.setattr(Upstream, "_schedule_start", record_then_start_now)
    values = {key: value for key, value in DEFAULTS.items() if key != "restart_backoff"}
    events = Events()
    upstream = Upstream(stdio_config("crashy", [sys.executable, "-c", "import sys; sys.exit(3)"]),
                        dict(values, max_restarts=4, **settings), events)
    upstream.start()
    try:
        assert events.failed.wait(60), upstream.last_error
        assert delays == expected
        assert "exited with code 3" in upstream.last_error
    finally:
        upstream.stop()


# -- which transport a server speaks -----------------------------------------------------------------------------

class Exchanges:
    """remote_http's signature, answering POST and GET with the statuses given."""

    def __init__(self, post, get=200):
        self.statuses, self.asked = {"POST": post, "GET": get}, []

    def __call__(self, method, url, *, headers, body=None, timeout, stream=False):
        self.asked.append(method)
        return HttpReply(self.statuses[method], {}, b"", url)


@pytest.mark.parametrize("post, asked", [(200, ["POST"]), (202, ["POST"]), (401, ["POST"]), (500, ["POST"]),
                                         (400, ["POST", "GET"]), (404, ["POST", "GET"]), (405, ["POST", "GET"])])
def test_only_an_answer_meaning_no_streamable_http_falls_back_to_an_event_stream(post, asked):
    exchange = Exchanges(post)
    posted, stream = initialize_or_stream(exchange, "https://example.test/mcp", {}, 5.0)
    assert exchange.asked == asked
    assert posted.status == post and (stream is None) == (asked == ["POST"])
    assert posted.ok == (200 <= post < 300)


# -- log lines name their server -------------------------------------------------------------------------------

def test_a_transport_names_its_server_in_what_it_logs(caplog):
    closed = threading.Event()
    transport = StdioTransport("noisy", [sys.executable, "-c", "print('not json', flush=True)"], dict(os.environ),
                               None, lambda message: None, closed.set, lambda line: None)
    with caplog.at_level(logging.WARNING):
        transport.start()
        assert closed.wait(30)
    transport.close(0.5)
    lines = [record for record in caplog.records if "non-JSON" in record.getMessage()]
    assert lines and lines[0].getMessage().startswith("[noisy] skipped a non-JSON line on stdout")
    assert lines[0].name.endswith("transport.stdio"), "each module logs through its own logger"


def test_a_listen_stream_that_cannot_be_opened_is_retried_not_a_crash():
    """A modern server whose connection refuses the subscriptions/listen request at once: the stream counts as
    ended (and is reopened later), instead of the start failing on an internal error."""
    events = Events()
    upstream = Upstream(stdio_config("modern", FAKE), dict(DEFAULTS), events)

    class Refusing:
        def send(self, message):
            return False

        def exit_detail(self):
            return None

        def close(self, grace=2.0):
            pass

    upstream.transport, upstream.state = Refusing(), "ready"
    upstream.capabilities = {"tools": {"listChanged": True}}
    try:
        upstream.listing.listen()
        assert upstream.listing.listen_id is None
    finally:
        upstream.stop()


def test_a_session_the_server_expired_lets_its_worker_threads_go():
    """An HTTP session that expires (404 to a request that carries it) ends the connection; closing it afterwards
    must still end the transport's worker threads, or every expiry would leave a pool of idle threads behind."""

    class Expired(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server interface
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Expired)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ended = threading.Event()

    def on_close():
        transport.close(0.5)  # as the Upstream does when its connection ends
        ended.set()

    transport = HttpTransport("expiring", f"http://127.0.0.1:{server.server_address[1]}/mcp", {},
                              lambda message: None, on_close, 5.0, on_failure=lambda request_id, text: None)
    transport.session_id = "s-1"
    try:
        assert transport.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert ended.wait(30), "the expired session did not end the connection"
        assert transport.close_reason == "expired its HTTP session"
        assert not transport.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})

        def workers():
            return [t.name for t in threading.enumerate() if t.name.startswith("coffer-expiring-")]

        deadline = time.monotonic() + 30
        while workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not workers(), f"left behind: {workers()}"
    finally:
        server.shutdown()
        server.server_close()
