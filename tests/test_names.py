"""Unit-level behaviour of the pieces a user relies on: naming, version negotiation, ${VAR} expansion, the vault
and the CLI's error handling, and the JSON-RPC edge cases of ``coffer serve``."""

import json
import re
import sqlite3

import pytest

from coffer_src.errors import CofferError
from coffer_src.jsonrpc import defer_to_burst_end, handle_burst, negotiate_version, read_line_bursts
from coffer_src.names import check_server_name, expose_name
from coffer_src.secret_store import expand_vars, parse_env_assignment
from coffer_src.vault import SCHEMA, Vault

from conftest import FAKE, cli


# -- naming ------------------------------------------------------------------------------------------------
def test_short_names_are_server_double_underscore_name():
    assert expose_name("time", "get_current_time") == "time__get_current_time"


def test_long_or_illegal_names_are_shortened_stably_readably_and_distinctly():
    long_name = "list_all_repository_collaborators_with_permissions_and_teams"
    exposed = expose_name("github", long_name)
    assert len(exposed) <= 48 and re.fullmatch(r"[a-zA-Z0-9_-]+", exposed)
    assert exposed.startswith("github__list_all_repository")
    assert exposed == expose_name("github", long_name)  # stable across runs
    other = expose_name("github", long_name + "_v2")
    assert other != exposed
    dotted = expose_name("aws", "s3.get_object")
    assert re.fullmatch(r"aws__s3_get_object_[0-9a-f]{6}", dotted)
    assert expose_name("aws", "s3_get_object") != dotted  # a legal twin keeps its plain name
    assert len(expose_name("x" * 24, "y" * 64, 34)) <= 34


@pytest.mark.parametrize("name", ["", "has space", "a__b", "x" * 25, "coffer", "COFFER", "tool/slash"])
def test_bad_server_names_are_refused(name):
    with pytest.raises(CofferError):
        check_server_name(name)


# -- protocol versions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("requested", ["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"])
def test_supported_versions_are_echoed(requested):
    assert negotiate_version(requested) == requested


@pytest.mark.parametrize("requested", ["2023-01-01", "2026-07-28", None, 5])
def test_unknown_versions_get_the_latest(requested):
    assert negotiate_version(requested) == "2025-11-25"


# -- ${VAR} expansion ---------------------------------------------------------------------------------------
def test_expansion_reads_the_environment_at_spawn_time():
    env = {"TOKEN": "s3cret", "EMPTY": ""}
    assert expand_vars("Bearer ${TOKEN}", env) == "Bearer s3cret"
    assert expand_vars("${MISSING:-fallback}/${EMPTY:-dflt}", env) == "fallback/dflt"
    missing = []
    assert expand_vars("a${NOPE}b", env, missing) == "ab" and missing == ["NOPE"]
    assert expand_vars("$TOKEN stays literal", env) == "$TOKEN stays literal"


def test_env_assignments_are_validated():
    assert parse_env_assignment("A=b=c") == ("A", "b=c")
    for bad in ("NOEQUALS", "=x", "1A=x", "A-B=x"):
        with pytest.raises(CofferError):
            parse_env_assignment(bad)


# -- the vault ---------------------------------------------------------------------------------------------
def test_vault_stores_env_unexpanded_and_audits_every_change(home, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-store-me")
    cli("add", "gh", "--env", "GITHUB_TOKEN=${SECRET_TOKEN}", "--timeout", "30", "--", "npx", "-y", "server-gh")
    cli("policy", "gh", "disabled")
    cli("disable", "gh")
    cli("config", "retention_invocations_days", "7")
    cli("remove", "gh")
    raw = b"".join(p.read_bytes() for p in home.iterdir() if p.is_file())
    assert b"do-not-store-me" not in raw
    actions = [(r["action"], r["target"]) for r in json.loads(cli("audit", "--json").stdout)["audit"]]
    assert actions == [("add", "gh"), ("policy", "gh"), ("disable", "gh"),
                       ("config", "retention_invocations_days"), ("remove", "gh")]


def test_vault_file_is_sqlite_in_wal_mode_under_coffer_home(home):
    cli("add", "t", "--", "echo")
    db = sqlite3.connect(home / "coffer.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    row = db.execute("SELECT command, env FROM servers WHERE name='t'").fetchone()
    assert json.loads(row[0]) == ["echo"] and json.loads(row[1]) == {}


def test_capability_choices_survive_disappearance_and_follow_policy(home):
    vault = Vault(str(home))
    vault.add_server("s", command=["x"])
    tool = {"name": "a", "inputSchema": {"type": "object"}}
    def enabled(states):
        return {name: state.enabled for name, state in states.items()}

    assert enabled(vault.sync_capabilities("s", "tool", {"a": tool})) == {"a": True}
    vault.set_enabled("s__a", False)
    assert vault.sync_capabilities("s", "tool", {}) == {}            # the upstream dropped it
    vault.set_policy("s", "disabled")
    states = vault.sync_capabilities("s", "tool", {"a": tool, "b": {"name": "b"}})
    assert enabled(states) == {"a": False, "b": False}               # choice kept; new one follows policy
    actions = [r["action"] for r in vault.audit_rows(100)]
    assert "upstream-removed" in actions and "upstream-restored" in actions


@pytest.mark.parametrize("args, message", [
    (["add", "bad name", "--", "x"], "invalid server name"),
    (["add", "coffer", "--", "x"], "reserved"),
    (["add", "ok", "--env", "NOPE", "--", "x"], "bad --env"),
    (["add", "ok"], "give either a command"),
    (["remove", "ghost"], "unknown server"),
    (["disable", "ghost__tool"], "unknown target"),
    (["enable", "nothing"], "unknown target"),
    (["config", "nonsense", "1"], "unknown setting"),
    (["config", "name_max_length", "7"], "between 34 and 64"),
    (["call", "x__y", "{not json"], "not valid JSON"),
    (["call", "x__y", "[1, 2]"], "must be a JSON object"),
])
def test_cli_errors_are_one_clear_line_with_nonzero_exit(home, args, message):
    proc = cli(*args, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_duplicate_add_is_refused_and_changes_nothing(home):
    cli("add", "t", "--", "first")
    proc = cli("add", "t", "--", "second", check=False)
    assert proc.returncode == 1 and "already exists" in proc.stderr
    servers = json.loads(cli("list", "--json").stdout)["servers"]
    assert [(s["name"], s["command"]) for s in servers] == [("t", "first")]


# -- JSON-RPC edge cases of `coffer serve` ----------------------------------------------------------------
def test_bad_input_gets_the_right_errors_and_the_session_survives(raw_gateway):
    gw = raw_gateway()
    gw.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert gw.wait_response(1)["error"]["code"] == -32600          # before initialize
    assert gw.initialize()["result"]["protocolVersion"] == "2025-11-25"
    gw.send_raw(b"{this is not json\n")
    assert gw.wait_response(None)["error"]["code"] == -32700
    gw.send({"jsonrpc": "2.0", "id": 2, "method": "no/such/method"})
    assert gw.wait_response(2)["error"]["code"] == -32601
    gw.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": 5}})
    assert gw.wait_response(3)["error"]["code"] == -32602
    gw.send({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": [1]})
    assert gw.wait_response(4)["error"]["code"] == -32602
    gw.send({"jsonrpc": "1.0", "id": 5, "method": "ping"})
    assert gw.wait_response(5)["error"]["code"] == -32600
    assert gw.request("ping")["result"] == {}
    tools = gw.request("tools/list")["result"]["tools"]
    assert [t["name"] for t in tools] == ["coffer__search_tools"]


def test_older_protocol_versions_are_accepted(raw_gateway):
    gw = raw_gateway()
    assert gw.initialize(version="2024-11-05")["result"]["protocolVersion"] == "2024-11-05"


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


def test_a_vault_from_before_the_capabilities_column_is_upgraded_in_place(home):
    home.mkdir(parents=True)
    old = sqlite3.connect(home / "coffer.db")
    without_column = SCHEMA.replace(",\n    capabilities TEXT", "")
    old.executescript(without_column.split("CREATE TABLE IF NOT EXISTS capabilities")[0])
    old.execute("INSERT INTO servers(name, transport, command, position, created_at) "
                "VALUES ('t', 'stdio', '[\"x\"]', 1, 'then')")
    old.commit()
    old.close()
    servers = json.loads(cli("list", "--json").stdout)["servers"]
    assert [s["name"] for s in servers] == ["t"]
    vault = Vault(str(home))
    vault.record_status("t", "ready", "ok", {"tools": {}})
    assert vault.server("t")["capabilities"] == {"tools": {}}


def test_line_bursts_rebuild_every_line_whatever_the_read_boundaries():
    """Upstream replies are split into lines from raw reads: a line may straddle reads (a 200 KB reply spans
    several), several may share one, and the last may lack its newline."""
    import random
    lines = [b'{"id":1}', b"", b'{"big":"' + b"x" * 200_000 + b'"}', b'{"id":2}\r', b'{"id":3}', b"tail"]
    stream = b"\n".join(lines)
    rng = random.Random(5)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), 40))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        reads = iter(chunks + [b""])
        got = [line for burst in read_line_bursts(lambda size: next(reads)) for line in burst]
        assert got == lines
    reads = iter([b'{"a":1}\n{"b":2}\n{"c"', b':3}\n', b""])
    assert list(read_line_bursts(lambda size: next(reads))) == [[b'{"a":1}', b'{"b":2}'], [b'{"c":3}']]


def test_output_held_during_a_burst_is_written_once_at_its_end_even_on_error():
    written = []

    def handle(line):
        if line == b"boom":
            raise RuntimeError("a handler failed mid-burst")
        assert defer_to_burst_end("client", lambda: written.append("flush"))
        written.append(line)

    with pytest.raises(RuntimeError):
        handle_burst([b"1", b"2", b"boom"], handle)
    assert written == [b"1", b"2", "flush"]  # one flush, after the burst, despite the error
    assert defer_to_burst_end("client", lambda: None) is False  # outside a burst: write at once
