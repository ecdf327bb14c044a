"""Routing between clients and upstreams: ids that never mix, server-to-client requests under Coffer's own ids,
resources and templates of several servers, roots and capabilities passed up, calls that wait for a starting
server, and what an upstream may (and may not) send to the client."""

import json
import sys
import threading
import time
import uuid

import pytest

from conftest import (
    FAKE,
    add_hostile,
    call_msg,
    call_tool,
    cli,
    everything_cmd,
    healthy,
    is_tool_error,
    linux_only,
    needs_node,
    open_session,
    proc_status,
    received,
    rss_kb,
    text_of,
    tool_names,
)


def test_ids_from_upstreams_and_client_never_mix(home, raw_gateway):
    """Two upstreams each number their requests from 1; the client uses string and integer ids."""
    cli("add", "a", "--", *FAKE, "--tools", "echo")
    cli("add", "b", "--", *FAKE, "--tools", "echo")
    gw = raw_gateway()
    gw.initialize()
    ids = ["x", 7, "7", 8]
    for i, msg_id in enumerate(ids):
        gw.send({"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                 "params": {"name": f"{'ab'[i % 2]}__echo", "arguments": {"text": f"reply-{i}"}}})
    for i, msg_id in enumerate(ids):
        result = gw.wait_response(msg_id)["result"]
        assert result["content"][0]["text"] == f"reply-{i}"


def test_load_concurrent_calls_match_and_memory_stays_flat(home, raw_gateway):
    for name in ("s1", "s2", "s3"):
        cli("add", name, "--", *FAKE)
    gw = raw_gateway()
    gw.initialize()
    tools = tool_names(gw.request("tools/list"))
    assert {"s1__echo", "s2__echo", "s3__echo"} <= set(tools)

    run = uuid.uuid4().hex[:8]
    expected = {f"load-{i}": f"payload {i} {run} to s{i % 3 + 1}" for i in range(1000)}
    batch = b"".join((json.dumps(call_msg(msg_id, f"s{i % 3 + 1}__echo", {"text": text})) + "\n").encode()
                     for i, (msg_id, text) in enumerate(expected.items()))
    gw.send_raw(batch)
    for msg_id, text in expected.items():
        reply = gw.wait_response(msg_id, timeout=60)
        assert not is_tool_error(reply) and text_of(reply) == text, (msg_id, reply)
    with gw.cond:
        extra = {k: v for k, v in gw.responses.items() if v}
    assert not extra, f"unexpected extra responses: {list(extra)[:5]}"

    pid = gw.proc.pid
    rss_at = {}
    for i in range(10_000):
        reply = gw.request("tools/call", {"name": f"s{i % 3 + 1}__echo", "arguments": {"text": f"seq {i}"}})
        assert text_of(reply) == f"seq {i}", reply
        if i + 1 in (2_000, 10_000):
            rss_at[i + 1] = rss_kb(pid)
    if sys.platform.startswith("linux") and rss_at[2_000] is not None:
        growth_mb = (rss_at[10_000] - rss_at[2_000]) / 1024
        assert growth_mb < 30, f"RSS grew {growth_mb:.1f} MB between call 2,000 and 10,000"


def test_server_to_client_requests_are_relayed_under_coffers_own_ids(home, raw_gateway):
    cli("add", "s", "--", *FAKE, "--tools", "sample")
    gw = raw_gateway()
    gw.initialize(capabilities={"sampling": {}})
    gw.send({"jsonrpc": "2.0", "id": 50, "method": "tools/call",
             "params": {"name": "s__sample", "arguments": {"prompt": "hi"}}})
    request = gw.wait_for(lambda g: g.requests and g.requests[0])
    assert request["method"] == "sampling/createMessage" and str(request["id"]).startswith("coffer-")
    gw.send({"jsonrpc": "2.0", "id": request["id"], "result": {
        "role": "assistant", "model": "m", "content": {"type": "text", "text": "the model says hi"}}})
    assert gw.wait_response(50)["result"]["content"][0]["text"] == "the model says hi"


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


def test_a_disabled_servers_tool_gets_an_actionable_error(home, raw_gateway):
    cli("add", "s", "--", *FAKE, "--tools", "echo")
    cli("tools")
    cli("disable", "s")
    gw = raw_gateway()
    gw.initialize()
    reply = gw.request("tools/call", {"name": "s__echo", "arguments": {"text": "x"}})
    assert reply["error"]["code"] == -32602 and "coffer enable s" in reply["error"]["message"]


# -- resources and templates -------------------------------------------------------------------------------------------

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


def test_a_catch_all_template_does_not_hijack_a_more_specific_one(home, watched_gateway):
    add_hostile("catchall", "templates", extra=("--templates", "{anything},file:///{path}"))
    add_hostile("weather", "templates", extra=("--templates", "weather://{city}/forecast,file:///etc/{name}"))
    add_hostile("good")
    gw = open_session(watched_gateway)
    gw.request("resources/templates/list")

    def reader(uri):
        reply = gw.request("resources/read", {"uri": uri})
        assert "result" in reply, reply
        return reply["result"]["contents"][0]["text"].split(" read ")[0]

    assert reader("weather://paris/forecast") == "weather"
    assert reader("file:///etc/hosts") == "weather"
    assert reader("file:///home/ada/notes.txt") == "catchall"
    assert reader("something-else") == "catchall"
    subscribed = gw.request("resources/subscribe", {"uri": "weather://oslo/forecast"})
    assert subscribed["result"].get("_meta", {}).get("server") == "weather", subscribed
    healthy(gw)


# -- calls to a server that is still starting --------------------------------------------------------------------------

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


@linux_only
def test_thousands_of_requests_waiting_for_a_starting_server_do_not_cost_a_thread_each(home, watched_gateway,
                                                                                         tmp_path):
    gate = tmp_path / "slowstart.gate"
    cli("config", "discovery_timeout", "4")
    cli("add", "slowstart", "--", *FAKE, "--start-gate", str(gate))
    gw = watched_gateway()
    gw.initialize()
    lines = []
    for i in range(5_000):
        method, params = [("tools/list", {}), ("resources/list", {}), ("prompts/list", {}),
                          ("resources/templates/list", {}),
                          ("tools/call", {"name": "slowstart__nothing", "arguments": {}})][i % 5]
        lines.append(json.dumps({"jsonrpc": "2.0", "id": f"w{i}", "method": method, "params": params}) + "\n")
    threads = []
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            count = proc_status(gw.proc.pid, "Threads")
            if count:
                threads.append(count)
            time.sleep(0.02)  # a sampling period while the requests wait

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gw.send_raw("".join(lines).encode())
    # A ping read after the 5,000 lines is answered at once: by then every one of them is waiting for slowstart.
    assert gw.request("ping", timeout=60)["result"] == {}
    waiting = proc_status(gw.proc.pid, "Threads")
    assert not any(gw.responses.get(json.dumps(f"w{i}")) for i in range(4, 5_000, 5)), "a call did not wait"
    gate.touch()  # slowstart finishes starting: everything waiting is answered
    gw.wait_for(lambda g: all(g.responses.get(json.dumps(f"w{i}")) for i in range(5_000)), timeout=120)
    sampling.set()
    sampler.join(5)
    threads.append(waiting)
    assert max(threads) < 200, f"{max(threads)} threads while 5,000 requests waited"
    assert gw.request("ping")["result"] == {}
    assert "Traceback" not in gw.stderr_text()


# -- what an upstream may send to the client ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["evil/steal", "tools/call", "resources/read"])
def test_undefined_server_requests_are_refused_not_relayed(home, watched_gateway, method):
    add_hostile("h", "ask")
    add_hostile("good")
    gw = open_session(watched_gateway, capabilities={"sampling": {}, "roots": {}, "elicitation": {}})
    reply = call_tool(gw, "h__ask", {"method": method})
    assert text_of(reply).startswith("error"), reply
    assert not [r for r in gw.requests if r["method"] == method], "the upstream's request reached the client"
    healthy(gw)


def test_a_flood_of_server_requests_is_bounded(home, watched_gateway):
    """Each relayed sampling request may cost the user a model call: an upstream must not be able to queue
    thousands of them on the client (nor grow the gateway's table of open requests without bound)."""
    add_hostile("h", "ask")
    add_hostile("good")
    gw = open_session(watched_gateway, capabilities={"sampling": {}})
    assert text_of(call_tool(gw, "h__ask_many", {"method": "sampling/createMessage", "count": 5000})) == "asked 5000"
    healthy(gw)  # later replies: every request the upstream sent before its answer has been relayed or refused
    relayed = sum(1 for r in gw.requests if r["method"] == "sampling/createMessage")
    assert relayed <= 1000, f"{relayed} of 5,000 sampling requests were relayed to the client at once"


def notify(gw, server, method, count=1, params=None):
    return call_tool(gw, f"{server}__notify", {"method": method, "count": count, "params": params or {}})


def test_only_protocol_notifications_are_relayed(home, watched_gateway):
    add_hostile("h", "notify")
    add_hostile("good")
    gw = open_session(watched_gateway)
    gw.request("logging/setLevel", {"level": "debug"})
    notify(gw, "h", "notifications/evil", 3, {"x": 1})
    notify(gw, "h", "x-vendor/surprise", 3)
    notify(gw, "h", "notifications/initialized")
    notify(gw, "h", "notifications/message", 1, {"level": "error", "logger": "t", "data": "a real log line"})
    gw.wait_for(lambda g: any(n["method"] == "notifications/message" for n in g.notifications), timeout=10)
    methods = {n["method"] for n in gw.notifications}
    assert not methods & {"notifications/evil", "x-vendor/surprise", "notifications/initialized"}, methods
    healthy(gw)


def test_progress_is_relayed_only_from_the_upstream_that_owns_the_token(home, watched_gateway):
    cli("add", "victim", "--", *FAKE)
    add_hostile("h", "notify")
    add_hostile("good")
    gw = open_session(watched_gateway)
    gw.send({"jsonrpc": "2.0", "id": "victim-call", "method": "tools/call", "params": {
        "name": "victim__slow", "arguments": {"seconds": 2, "progress_every": 0.3},
        "_meta": {"progressToken": "victim-token"}}})
    gw.wait_for(lambda g: any(n["method"] == "notifications/progress" for n in g.notifications))  # it is running
    for token in ("victim-token", "nobody-token", 1):
        notify(gw, "h", "notifications/progress", 20, {"progressToken": token, "progress": 999,
                                                        "message": "forged"})
    assert text_of(gw.wait_response("victim-call", timeout=30)) == "slept 2.0"
    progress = [n for n in gw.notifications if n["method"] == "notifications/progress"]
    assert any(n["params"]["progressToken"] == "victim-token" and n["params"]["progress"] != 999
               for n in progress), "the genuine progress was lost"
    forged = [n for n in progress if n["params"].get("message") == "forged" or n["params"]["progress"] == 999]
    assert not forged, f"{len(forged)} forged progress notifications reached the client"
    healthy(gw)


def test_the_clients_log_level_is_respected(home, watched_gateway):
    add_hostile("h", "notify")
    add_hostile("good")
    gw = open_session(watched_gateway)
    assert gw.request("logging/setLevel", {"level": "error"})["result"] == {}
    notify(gw, "h", "notifications/message", 10, {"level": "debug", "logger": "t", "data": "chatter"})
    notify(gw, "h", "notifications/message", 10, {"level": "info", "logger": "t", "data": "chatter"})
    notify(gw, "h", "notifications/message", 1, {"level": "critical", "logger": "t", "data": "it broke"})
    gw.wait_for(lambda g: any(n["method"] == "notifications/message" for n in g.notifications), timeout=10)
    assert gw.request("ping")["result"] == {}  # a later reply: whatever h sent before has been relayed by now
    logged = [n["params"]["data"] for n in gw.notifications if n["method"] == "notifications/message"
              and n["params"].get("data") in ("chatter", "it broke")]
    assert logged == ["it broke"], logged
    healthy(gw)


@linux_only
def test_a_log_flood_is_rate_limited_and_other_servers_keep_answering(home, watched_gateway):
    add_hostile("h", "notify")
    add_hostile("good")
    gw = open_session(watched_gateway, rss_ceiling_mb=400)
    gw.request("logging/setLevel", {"level": "debug"})
    gw.send({"jsonrpc": "2.0", "id": "flood", "method": "tools/call",
             "params": {"name": "h__flood", "arguments": {"count": 200_000, "level": "info"}}})
    healthy(gw)  # while the flood runs
    assert text_of(gw.wait_response("flood", timeout=180)) == "flooded 200000"
    relayed = sum(1 for n in gw.notifications if n["method"] == "notifications/message")
    assert relayed <= 20_000, f"{relayed} of 200,000 flooded log messages were relayed"
    healthy(gw)
