"""Gateway behaviour a user notices beyond the happy path: colliding resource URIs, paginated upstreams,
retention, and a busy vault that must never slow or fail a call."""

import json
import sqlite3
import textwrap
import time


from conftest import FAKE, PY, cli, everything_cmd, needs_node


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
        time.sleep(0.5)
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
