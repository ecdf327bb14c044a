"""Gateway behaviour a user notices beyond the happy path: colliding resource URIs, paginated upstreams,
retention, and a busy vault that must never slow or fail a call."""

import io
import json
import sqlite3
import textwrap
import threading
import time

from coffer_src.gateway.session import Gateway
from coffer_src.modern import META_CLIENT_CAPABILITIES
from coffer_src.vault import InvocationLog, Vault

from conftest import FAKE, PY, cli, everything_cmd, list_changed_count, needs_node, received, text_of, tool_names


@needs_node
def test_two_servers_publishing_the_same_uri_stay_separately_readable(home, raw_gateway):
    cli("add", "e1", "--", *everything_cmd())
    cli("add", "e2", "--", *everything_cmd())
    gw = raw_gateway()
    gw.initialize()
    uris = [r["uri"] for r in gw.request("resources/list")["result"]["resources"]]
    doc = "demo://resource/static/document/features.md"
    assert f"coffer+e1:{doc}" in uris and f"coffer+e2:{doc}" in uris and doc not in uris
    for uri in (f"coffer+e1:{doc}", f"coffer+e2:{doc}", doc):   # the bare URI (as embedded in results) works too
        contents = gw.request("resources/read", {"uri": uri})["result"]["contents"]
        assert contents and contents[0]["uri"] == doc
    templates = [t["uriTemplate"] for t in gw.request("resources/templates/list")["result"]["resourceTemplates"]]
    assert any(t.startswith("coffer+e2:demo://resource/dynamic/text/") for t in templates)
    read = gw.request("resources/read", {"uri": "coffer+e2:demo://resource/dynamic/text/3"})
    assert "result" in read
    assert gw.request("resources/read", {"uri": "nowhere://x"})["error"]["code"] == -32602


PAGED_SERVER = textwrap.dedent('''
    import json, sys
    pages = {None: ("p2", ["a", "b"]), "p2": ("p3", ["c"]), "p3": ("p2", ["d"])}   # p3 points back: a loop
    for line in sys.stdin:
        msg = json.loads(line)
        if "id" not in msg:
            continue
        if msg["method"] == "initialize":
            result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "p"}}
        elif msg["method"] == "tools/list":
            cursor = (msg.get("params") or {}).get("cursor")
            nxt, names = pages[cursor]
            result = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in names], "nextCursor": nxt}
        else:
            result = {}
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
''')


def test_every_upstream_page_is_followed_and_a_repeated_cursor_stops(home, tmp_path, raw_gateway):
    script = tmp_path / "paged.py"
    script.write_text(PAGED_SERVER)
    cli("add", "paged", "--", PY, str(script))
    gw = raw_gateway()
    gw.initialize()
    names = [t["name"] for t in gw.request("tools/list")["result"]["tools"]]
    assert names == ["coffer__search_tools", "paged__a", "paged__b", "paged__c", "paged__d"]
    assert any("repeated cursor" in line for line in gw.stderr_lines)


def test_old_rows_are_pruned_when_serve_starts(home, raw_gateway):
    cli("add", "fx", "--", *FAKE, "--tools", "echo")
    cli("config", "retention_invocations_days", "1")
    db = sqlite3.connect(home / "coffer.db")
    with db:
        db.execute("INSERT INTO invocations(ts, client, server, capability, kind, duration_ms, status) "
                   "VALUES ('2020-01-01T00:00:00.000Z', 'old', 'fx', 'fx__echo', 'tool', 1, 'ok')")
        db.execute("INSERT INTO audit(ts, actor, action) VALUES ('2020-01-01T00:00:00.000Z', 'cli', 'ancient')")
    gw = raw_gateway()
    gw.initialize()
    gw.close()
    assert db.execute("SELECT count(*) FROM invocations WHERE client='old'").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM audit WHERE action='ancient'").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM audit WHERE action='add'").fetchone()[0] == 1


def test_a_locked_vault_never_holds_up_or_fails_a_call_and_nothing_is_lost(home, raw_gateway):
    cli("add", "fx", "--", *FAKE, "--tools", "echo")
    gw = raw_gateway()
    gw.initialize()
    assert gw.request("tools/list")["result"]["tools"]
    locker = sqlite3.connect(home / "coffer.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")       # another process holds the write lock for a while
    try:
        for i in range(20):
            reply = gw.request("tools/call", {"name": "fx__echo", "arguments": {"text": f"t{i}"}}, timeout=5)
            assert reply["result"]["content"][0]["text"] == f"t{i}"
    finally:
        # The lock is held a while longer than the calls took: the invocation log's writer (which batches for
        # FLUSH_INTERVAL after a call) meets it too, and must keep its rows rather than lose them.
        time.sleep(2 * InvocationLog.FLUSH_INTERVAL)
        locker.execute("ROLLBACK")
        locker.close()
    gw.close()
    rows = json.loads(cli("log", "--json", "--limit", "100").stdout)["invocations"]
    assert sum(1 for r in rows if r["capability"] == "fx__echo" and r["status"] == "ok") == 20


def test_client_roots_changes_and_capabilities_reach_every_upstream(home, tmp_path, raw_gateway):
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for name, log in zip("ab", logs):
        cli("add", name, "--", *FAKE, "--tools", "echo", "--recv-log", str(log))
    gw = raw_gateway()
    gw.initialize(capabilities={"roots": {"listChanged": True}})
    assert len(gw.request("tools/list")["result"]["tools"]) == 3
    gw.send({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"})
    assert gw.request("ping")["result"] == {}
    gw.close()
    for log in logs:
        methods = [json.loads(line).get("method") for line in log.read_text().splitlines()]
        assert "notifications/roots/list_changed" in methods
        init = next(json.loads(line) for line in log.read_text().splitlines() if '"initialize"' in line)
        assert init["params"]["capabilities"] == {"roots": {"listChanged": True}}  # the client's, passed up


def test_advertised_capabilities_are_the_union_of_what_upstreams_offered(home, raw_gateway):
    cli("add", "fx", "--", *FAKE, "--tools", "echo")           # tools only
    first = raw_gateway()
    caps = first.initialize()["result"]["capabilities"]
    assert set(caps) >= {"tools", "prompts", "resources"}      # never seen yet: it might offer anything
    assert first.request("tools/list")["result"]["tools"]
    first.close()
    second = raw_gateway()
    assert second.initialize()["result"]["capabilities"] == {"tools": {"listChanged": True}}


def test_an_upstream_that_stops_reading_stalls_only_itself(home, raw_gateway):
    cli("add", "stuck", "--timeout", "2", "--", *FAKE, "--tools", "echo", "--stop-reading")
    cli("add", "ok", "--", *FAKE, "--tools", "echo")
    gw = raw_gateway()
    gw.initialize()
    assert len(gw.request("tools/list")["result"]["tools"]) == 3
    big = "x" * (2 * 1024 * 1024)                      # far more than a pipe buffer holds
    def flood():  # on a thread: if the gateway regressed to blocking, this write blocks, not the test
        for msg_id in (100, 101):
            gw.send({"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                     "params": {"name": "stuck__echo", "arguments": {"text": big}}})
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    flooder.join(20)  # the gateway read both calls (a gateway blocked on the stuck upstream never does)
    answers = {}

    def probe():
        answers["ok"] = gw.request("tools/call", {"name": "ok__echo", "arguments": {"text": "still here"}})
        answers["ping"] = gw.request("ping")

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    prober.join(20)
    if prober.is_alive():
        gw.proc.kill()  # a regression: the gateway stopped reading its client
    assert answers.get("ping", {}).get("result") == {}, "the gateway stalled behind the stuck upstream"
    assert answers["ok"]["result"]["content"][0]["text"] == "still here"
    timed_out = gw.wait_response(100, timeout=15)["result"]   # and the timeout still fires for the stuck one
    assert timed_out["isError"] and "did not answer" in timed_out["content"][0]["text"]


def test_a_server_that_crashes_past_max_restarts_is_reported_failed_and_removed(home, raw_gateway):
    cli("config", "max_restarts", "1")
    cli("add", "fragile", "--", *FAKE, "--tools", "echo,crash")
    gw = raw_gateway()
    gw.initialize()
    assert "fragile__crash" in tool_names(gw.request("tools/list"))
    before = list_changed_count(gw)
    crashed = gw.request("tools/call", {"name": "fragile__crash", "arguments": {}}, timeout=10)["result"]
    assert crashed["isError"]
    gw.wait_for(lambda g: list_changed_count(g) > before)
    assert [t["name"] for t in gw.request("tools/list")["result"]["tools"]] == ["coffer__search_tools"]
    after = gw.request("tools/call", {"name": "fragile__echo", "arguments": {"text": "x"}}, timeout=10)
    assert "error" in after
    gw.close()
    status = json.loads(cli("list", "--json").stdout)["servers"][0]
    assert status["status"] == "failed" and "exited" in status["detail"]


def test_a_response_is_never_answered_even_with_a_null_id(home, raw_gateway):
    gw = raw_gateway()
    gw.initialize()
    gw.send({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "your parse error"}})
    gw.send({"jsonrpc": "2.0", "id": "never-asked", "result": {}})
    assert gw.request("ping")["result"] == {}
    assert json.dumps(None) not in gw.responses or not gw.responses[json.dumps(None)]


def test_a_call_to_a_server_that_is_still_starting_waits_for_it_not_just_for_the_list_budget(home, raw_gateway,
                                                                                              tmp_path):
    """Nothing remembered yet and a server slower than discovery_timeout: the list answers without it, but a
    call naming its tool waits for that server (up to its own timeout) instead of calling the tool unknown;
    a server that never finishes starting is reported as such."""
    gate = tmp_path / "slow.gate"
    cli("config", "discovery_timeout", "0.5")
    cli("add", "slow", "--", *FAKE, "--start-gate", str(gate), "--tools", "echo")
    cli("add", "stuck", "--timeout", "2", "--", *FAKE, "--hang-initialize")
    gw = raw_gateway()
    gw.initialize()
    gw.send({"jsonrpc": "2.0", "id": "now", "method": "tools/call",
             "params": {"name": "slow__echo", "arguments": {"text": "worth the wait"}}})
    gw.send({"jsonrpc": "2.0", "id": "never", "method": "tools/call",
             "params": {"name": "stuck__echo", "arguments": {"text": "x"}}})
    assert "slow__echo" not in set(tool_names(gw.request("tools/list"))), "the list should not wait past its budget"
    never = gw.wait_response("never", timeout=15)
    assert "result" not in never, never
    assert "not ready" in never["error"]["message"] and "Unknown" not in never["error"]["message"], never
    assert not gw.responses.get('"now"'), "answered before its server could start"
    gate.touch()  # the slow server finishes starting
    reply = gw.wait_response("now", timeout=30)
    assert reply["result"]["content"][0]["text"] == "worth the wait", reply
    gw.send({"jsonrpc": "2.0", "id": "typo", "method": "tools/call", "params": {"name": "slow__ecko", "arguments": {}}})
    typo = gw.wait_response("typo", timeout=10)
    assert "Unknown tool: slow__ecko" in typo["error"]["message"], typo


def test_a_slow_server_is_listed_at_once_from_its_last_start_and_corrected_if_it_changed(home, raw_gateway,
                                                                                         tmp_path):
    """The first session waits for discovery; later ones answer tools/list from what the vault remembers
    (the server is still starting), a call waits for the server, and a changed or failed server is announced."""
    args, started = tmp_path / "slow.args", tmp_path / "slow.started"
    args.write_text("--tools echo")
    cli("add", "slow", "--", *FAKE, "--args-file", str(args), "--spawn-log", str(started))
    cli("config", "discovery_timeout", "30")
    cli("config", "max_restarts", "1")

    gw = raw_gateway()  # first session: nothing remembered, the list waits for the server
    gw.initialize()
    assert "slow__echo" in set(tool_names(gw.request("tools/list")))
    gw.close()

    started.unlink()
    args.write_text(f"--start-gate {tmp_path / 'gate-2'} --tools echo")
    gw = raw_gateway()
    gw.initialize()
    listed = set(tool_names(gw.request("tools/list")))
    assert not started.exists(), "the list should not have waited for the server"
    assert "slow__echo" in listed
    hits = json.loads(gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {
        "query": "echo text"}})["result"]["content"][0]["text"])["tools"]
    assert hits and hits[0]["name"] == "slow__echo"
    gw.send({"jsonrpc": "2.0", "id": "wait", "method": "tools/call",
             "params": {"name": "slow__echo", "arguments": {"text": "waited"}}})
    assert not started.exists()
    (tmp_path / "gate-2").touch()  # the server finishes starting; the call was waiting for it
    reply = gw.wait_response("wait")
    assert started.exists() and text_of(reply) == "waited"
    assert list_changed_count(gw) == 0  # it listed what was remembered: nothing to announce
    gw.close()

    # an upgrade while Coffer was not running
    args.write_text(f"--start-gate {tmp_path / 'gate-3'} --tools echo,fail")
    gw = raw_gateway()
    gw.initialize()
    assert "slow__echo" in set(tool_names(gw.request("tools/list")))
    (tmp_path / "gate-3").touch()
    gw.wait_for(list_changed_count)
    assert {"slow__echo", "slow__fail"} <= set(tool_names(gw.request("tools/list")))
    gw.close()

    args.write_text("--exit-at-start")  # remembered tools of a server that no longer starts are withdrawn
    gw = raw_gateway()
    gw.initialize()
    gw.request("tools/list")
    gw.wait_for(list_changed_count)
    assert not any(name.startswith("slow__") for name in set(tool_names(gw.request("tools/list"))))
    gw.close()


def test_coffer_tools_shows_what_servers_list_now_not_what_was_remembered(home, tmp_path):
    args = tmp_path / "up.args"
    args.write_text("--tools echo")
    cli("add", "up", "--", *FAKE, "--args-file", str(args))
    first = {t["name"] for t in json.loads(cli("tools", "--json").stdout)["tools"]}
    args.write_text("--tools echo,fail")
    cached = {t["name"] for t in json.loads(cli("tools", "--json", "--cached").stdout)["tools"]}
    live = {t["name"] for t in json.loads(cli("tools", "--json").stdout)["tools"]}
    assert "up__fail" not in first and "up__fail" not in cached
    assert {"up__echo", "up__fail"} <= live


def test_a_call_cancelled_while_its_server_starts_is_never_sent(home, raw_gateway, tmp_path):
    """With the catalogue remembered, a call can wait behind a starting server; if the client cancels it
    meanwhile, the server must never run it, and the client gets no answer for it."""
    args, recv_log, gate = tmp_path / "up.args", tmp_path / "received.jsonl", tmp_path / "up.gate"
    args.write_text("--tools echo")
    cli("add", "up", "--", *FAKE, "--args-file", str(args), "--recv-log", str(recv_log))
    gw = raw_gateway()
    gw.initialize()
    gw.request("tools/list")
    gw.close()

    recv_log.unlink()
    args.write_text(f"--tools echo --start-gate {gate}")
    gw = raw_gateway()
    gw.initialize()
    assert "up__echo" in set(tool_names(gw.request("tools/list")))
    for msg_id, text in (("doomed", "must not run"), ("kept", "runs")):
        gw.send({"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                 "params": {"name": "up__echo", "arguments": {"text": text}}})
    gw.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "doomed"}})
    assert gw.request("ping")["result"] == {}  # read after the cancellation: the gateway has seen it
    gate.touch()  # only now does the server finish starting
    assert text_of(gw.wait_response("kept")) == "runs"
    gw.request("ping")
    assert not gw.responses.get(json.dumps("doomed"))
    calls = [m for m in received(recv_log) if m.get("method") == "tools/call"]
    assert [m["params"]["arguments"]["text"] for m in calls] == ["runs"]
    gw.close()
    rows = json.loads(cli("log", "--json", "--limit", "10").stdout)["invocations"]
    assert any(r["capability"] == "up__echo" and r["status"] == "cancelled" for r in rows)


class _AsksAtOnce:
    """An upstream that asks the client for a sampling the instant it reads a call, before the gateway's
    send has even returned: the ordering a fast server and a busy gateway thread produce."""

    name, generation = "asker", 1

    def __init__(self):
        self.gateway = None
        self.answers = []

    def request(self, method, params, on_reply, timeout=None, ticket=None, **_):
        self.gateway.on_request(self, {"jsonrpc": "2.0", "id": 7, "method": "sampling/createMessage",
                                       "params": {"messages": [], "maxTokens": 5}})
        return ticket

    def hold(self, ticket):
        pass

    def respond(self, message):
        self.answers.append(message)


def test_a_question_asked_the_instant_a_call_arrives_reaches_a_2026_client(home):
    out = io.BytesIO()
    gateway = Gateway(Vault(str(home)), out=out)
    gateway.client_era = "modern"
    upstream = _AsksAtOnce()
    upstream.gateway = gateway
    params = {"name": "ask", "arguments": {},
              "_meta": {META_CLIENT_CAPABILITIES: {"sampling": {}}}}
    gateway._forward(41, upstream, "tools/call", dict(params), "asker__ask", "tool", time.monotonic(), params)
    gateway._write_unsent()
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    # Not parked as an orphan waiting for some later call (the upstream would time out after 60 s):
    # the call itself answers input_required with the upstream's question.
    assert [r.get("id") for r in replies] == [41], replies
    result = replies[0]["result"]
    assert result["resultType"] == "input_required"
    assert [q["method"] for q in result["inputRequests"].values()] == ["sampling/createMessage"]
    assert upstream.answers == []  # nothing refused on the client's behalf
