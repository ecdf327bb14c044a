"""The vault: coffer.db under COFFER_HOME in WAL mode, its schema upgraded in place, its audit trail and retention;
private files whatever the umask; a vault shared by gateways and the CLI, locked by another process, damaged,
empty or read-only (classes 3 and 17 of issue 15).  Damage is done with sqlite3 directly, as a crash or a
careless edit would."""

import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from coffer_src.invocations import InvocationLog
from coffer_src.vault import Vault
from coffer_src.vault_schema import SCHEMA

from conftest import (
    COFFER,
    FAKE,
    POSIX,
    call_msg,
    cli,
    coffer_cmd,
    is_tool_error,
    log_rows,
    no_traceback,
    posix_only,
    secret_set,
    text_of,
    tool_names,
)


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


# -- shared and busy ---------------------------------------------------------------------------------------------------

def test_two_gateways_and_cli_share_the_vault(home, raw_gateway):
    cli("add", "a", "--", *FAKE)
    cli("add", "c", "--", *FAKE)
    gateways = {"client-one": raw_gateway(), "client-two": raw_gateway()}
    for name, gw in gateways.items():
        gw.initialize(name=name)
        assert "a__echo" in tool_names(gw.request("tools/list"))

    stop = threading.Event()
    cli_failures = []
    cli_runs = [0]
    churned = threading.Condition()

    def churn(commands):
        i = 0
        while not stop.is_set():
            proc = cli(*commands[i % len(commands)], check=False)
            if proc.returncode != 0:
                cli_failures.append(proc.stderr)
            with churned:
                cli_runs[0] += 1
                churned.notify_all()
            i += 1

    churners = [threading.Thread(target=churn, args=(commands,), daemon=True) for commands in (
        [("disable", "c"), ("config", "call_timeout", "100"), ("enable", "c"), ("config", "call_timeout", "120")],
        [("disable", "a__fail"), ("config", "discovery_timeout", "4"), ("enable", "a__fail"),
         ("config", "discovery_timeout", "5")])]
    for churner in churners:
        churner.start()
    per_client = 200
    replies = {name: [] for name in gateways}
    rounds_without_cli = []

    def drive(name, gw):
        for round_ in range(per_client // 10):
            with churned:
                before = cli_runs[0]
            ids = [f"{name}-{round_}-{k}" for k in range(10)]
            gw.send_raw(b"".join((json.dumps(call_msg(i, "a__echo", {"text": i})) + "\n").encode() for i in ids))
            for i in ids:
                replies[name].append((i, gw.wait_response(i, timeout=30)))
            # The next round starts only once another CLI command has finished writing the vault, so the calls
            # and the CLI's writes interleave however fast or busy the machine is.
            with churned:
                if not churned.wait_for(lambda: cli_runs[0] > before, timeout=60):
                    rounds_without_cli.append((name, round_))

    drivers = [threading.Thread(target=drive, args=item) for item in gateways.items()]
    for thread in drivers:
        thread.start()
    for thread in drivers:
        thread.join(300)
    stop.set()
    for churner in churners:
        churner.join(60)
    assert not rounds_without_cli, f"no CLI command finished during these rounds of calls: {rounds_without_cli}"

    for name, gw in gateways.items():
        assert len(replies[name]) == per_client
        for msg_id, reply in replies[name]:
            assert not is_tool_error(reply) and text_of(reply) == msg_id, reply
        with gw.cond:
            everything = json.dumps([gw.responses, gw.notifications, gw.requests])
        assert "database is locked" not in everything
    assert not cli_failures, cli_failures[:3]
    for gw in gateways.values():
        gw.close()  # flushes the invocation log
        assert gw.proc.returncode == 0
    rows = log_rows()
    for name in gateways:
        mine = [r for r in rows if r["client"] == name and r["capability"] == "a__echo"]
        assert len(mine) == per_client, f"{name}: {len(mine)} rows for {per_client} calls"
        assert all(r["status"] == "ok" for r in mine)


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


# -- permissions -------------------------------------------------------------------------------------------------------

AS_ROOT = POSIX and os.geteuid() == 0
NOBODY = 65534
PERMISSION_NOTICE = re.compile(r"perm|chmod|0o?600|0o?700|readable|private", re.I)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def cli_with_umask(umask, *args, stdin=None, env=None):
    """The CLI started under a given umask (a careless shell profile), optionally fed on stdin."""
    return subprocess.run(coffer_cmd(*args), input=stdin, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, preexec_fn=lambda: os.umask(umask))


@posix_only
def test_the_home_and_every_vault_file_are_private_even_under_umask_0(home, watched_gateway):
    added = cli_with_umask(0, "add", "up", "--", *FAKE)
    assert added.returncode == 0, added.stderr
    assert mode(home) == 0o700, oct(mode(home))
    assert mode(home / "coffer.db") == 0o600, oct(mode(home / "coffer.db"))
    stored = cli_with_umask(0, "secret", "set", "SOME_TOKEN", stdin="value-123\n")
    assert stored.returncode == 0, stored.stderr
    assert mode(home / "secrets.json") == 0o600, oct(mode(home / "secrets.json"))
    gw = watched_gateway()
    gw.initialize()
    gw.request("tools/call", {"name": "up__echo", "arguments": {"text": "x"}})
    for name in ("coffer.db", "coffer.db-wal", "coffer.db-shm"):
        if (home / name).exists():  # WAL files exist while a gateway runs
            assert mode(home / name) == 0o600, f"{name} is {oct(mode(home / name))}"


@posix_only
def test_loose_permissions_are_tightened_on_open_with_a_notice(home):
    cli("add", "up", "--", *FAKE)
    os.chmod(home, 0o755)
    os.chmod(home / "coffer.db", 0o644)
    listed = cli("list")
    assert mode(home) == 0o700 and mode(home / "coffer.db") == 0o600
    assert PERMISSION_NOTICE.search(listed.stderr), f"no notice on stderr: {listed.stderr!r}"
    assert "up" in listed.stdout
    again = cli("list")
    assert not PERMISSION_NOTICE.search(again.stderr), "the notice should come once, when something was fixed"


@pytest.mark.skipif(not AS_ROOT, reason="needs root to act as a second local user (nobody)")
def test_a_second_local_user_cannot_read_the_vault_or_the_secrets(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="coffer-2nd-user-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # the way to the vault is open; only the vault's own permissions protect it
        home = base / "home"
        monkeypatch.setenv("COFFER_HOME", str(home))
        secret = "sk-" + uuid.uuid4().hex
        cli("add", "up", "--env", f"API_KEY={secret}", "--", *FAKE)
        secret_set("OTHER_TOKEN", "other-" + uuid.uuid4().hex)

        def as_nobody(*argv):
            return subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=base,
                                  preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))

        for target in (home / "coffer.db", home / "secrets.json"):
            assert target.exists()
            read = as_nobody("cat", str(target))
            assert read.returncode != 0 and secret not in read.stdout, f"nobody could read {target.name}"
        listing = as_nobody("ls", str(home))
        assert listing.returncode != 0, f"nobody could list the vault: {listing.stdout}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- a damaged vault ---------------------------------------------------------------------------------------------------

def damage(home, sql, params=()):
    db = sqlite3.connect(home / "coffer.db")
    with db:
        db.execute(sql, params)
    db.close()


BAD_ROWS = {
    "command-not-json": ("UPDATE servers SET command='not json' WHERE name='bad'", "stdio"),
    "command-numbers": ("UPDATE servers SET command='[1, 2]' WHERE name='bad'", "stdio"),
    "env-not-json": ("UPDATE servers SET env='garbage' WHERE name='bad'", "stdio"),
    "headers-not-json": ("UPDATE servers SET headers='garbage' WHERE name='bad'", "http"),
    "capabilities-not-json": ("UPDATE servers SET capabilities='{{{' WHERE name='bad'", "stdio"),
    "timeout-text": ("UPDATE servers SET timeout='soon' WHERE name='bad'", "stdio"),
}


@pytest.mark.parametrize("damage_name", sorted(BAD_ROWS))
def test_a_bad_server_row_disables_only_that_server(home, watched_gateway, damage_name):
    sql, transport = BAD_ROWS[damage_name]
    cli("add", "good", "--", *FAKE)
    if transport == "http":
        cli("add", "bad", "--url", "http://127.0.0.1:9/mcp")
    else:
        cli("add", "bad", "--", *FAKE)
    damage(home, sql)
    listed = cli("list", check=False)
    no_traceback(listed)
    assert listed.returncode == 0 and "good" in listed.stdout, listed.stdout + listed.stderr
    assert "bad" in listed.stdout + listed.stderr, "the damaged server is not mentioned"
    as_json = cli("list", "--json", check=False)
    no_traceback(as_json)
    assert "good" in [s["name"] for s in json.loads(as_json.stdout)["servers"]]
    gw = watched_gateway()
    init = gw.initialize()
    assert "result" in init, init
    assert "good__echo" in [t["name"] for t in gw.request("tools/list")["result"]["tools"]]
    reply = gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "served"}})
    assert reply["result"]["content"][0]["text"] == "served"
    gw.close()
    no_traceback(gw.stderr_text())


BAD_NAMES = {"escape": "evil\x1b]52;c;eA==\x07", "separator": "good__echo", "empty": "", "long": "x" * 100,
             "reserved": "coffer", "space": "two words"}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_a_server_row_with_an_invalid_name_is_not_served(home, watched_gateway, case):
    """`coffer add` refuses these names; a damaged row holding one must not put illegal, escape-laden or
    colliding names (or tools inside Coffer's own coffer__ namespace) in front of a client."""
    cli("add", "good", "--", *FAKE)
    cli("add", "bad", "--", *FAKE)
    damage(home, "UPDATE servers SET name=? WHERE name='bad'", (BAD_NAMES[case],))
    listed = cli("list", check=False)
    no_traceback(listed)
    assert listed.returncode == 0 and "good" in listed.stdout
    assert "\x1b" not in listed.stdout + listed.stderr
    gw = watched_gateway()
    assert "result" in gw.initialize()
    names = [t["name"] for t in gw.request("tools/list")["result"]["tools"]]
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", n) for n in names), names
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(["coffer__search_tools"] + [f"good__{t}" for t in
                                                             ("echo", "slow", "crash", "big", "fail", "sample")]), names
    reply = gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "served"}})
    assert reply["result"]["content"][0]["text"] == "served"
    gw.close()
    no_traceback(gw.stderr_text())


BAD_SETTINGS = {  # key, stored JSON text
    "not-json": ("call_timeout", "not json"),
    "wrong-type": ("call_timeout", '"abc"'),
    "negative": ("call_timeout", "-5"),
    "null": ("discovery_timeout", "null"),
    "infinite": ("discovery_timeout", "1e999"),
    "out-of-range": ("name_max_length", "5"),
    "unknown-choice": ("expose", '"weird"'),
    "not-an-int": ("max_restarts", '"many"'),
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_a_bad_setting_falls_back_to_its_default_with_a_warning(home, watched_gateway, case):
    key, raw = BAD_SETTINGS[case]
    cli("add", "good", "--", *FAKE)
    default = cli("config", key).stdout.strip()  # "KEY = VALUE" as an untouched vault shows it
    damage(home, "INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)", (key, raw))
    config = cli("config", key, check=False)
    no_traceback(config)
    assert config.returncode == 0 and config.stdout.strip() == default, config.stdout + config.stderr
    assert key in config.stderr, f"no warning naming {key}: {config.stderr!r}"
    gw = watched_gateway()
    assert "result" in gw.initialize()
    reply = gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "served"}})
    assert reply["result"]["content"][0]["text"] == "served"
    gw.close()
    no_traceback(gw.stderr_text())


@pytest.mark.parametrize("definition", ["not json", '"a string"', "[1, 2]"])
def test_a_bad_remembered_definition_does_not_break_cached_tools(home, watched_gateway, definition):
    cli("add", "good", "--", *FAKE)
    gw = watched_gateway()
    gw.initialize()
    gw.request("tools/list")
    gw.close()
    damage(home, "UPDATE capabilities SET definition=? WHERE server='good' AND name='echo'", (definition,))
    cached = cli("tools", "--cached", check=False)
    no_traceback(cached)
    assert cached.returncode == 0 and "good__slow" in cached.stdout, cached.stdout + cached.stderr
    gw = watched_gateway()
    gw.initialize()
    reply = gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "served"}})
    assert reply["result"]["content"][0]["text"] == "served"
    gw.close()
    no_traceback(gw.stderr_text())


def test_a_zero_byte_vault_is_reported_loudly(home, watched_gateway):
    home.mkdir(parents=True)
    (home / "coffer.db").write_bytes(b"")
    listed = cli("list", check=False)
    no_traceback(listed)
    assert re.search(r"empty|0 bytes|zero", listed.stderr, re.I), f"nothing said about it: {listed.stderr!r}"
    for name in ("coffer.db", "coffer.db-wal", "coffer.db-shm"):  # the same damage, met first by `serve`
        if (home / name).exists():
            (home / name).unlink()
    (home / "coffer.db").write_bytes(b"")
    gw = watched_gateway()
    gw.proc.stdin.close()
    gw.proc.wait(30)
    assert re.search(r"empty|0 bytes|zero", gw.stderr_text(), re.I), gw.stderr_text()
    no_traceback(gw.stderr_text())


def _python_for_nobody():
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(candidate):
            continue
        try:
            probe = subprocess.run([candidate, "-c", "import sqlite3, sys; assert sys.version_info >= (3, 10)"],
                                   capture_output=True, timeout=30, cwd="/",
                                   preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))
        except OSError:
            continue  # e.g. an interpreter under /root
        if probe.returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(not AS_ROOT, reason="needs root to hand the vault to a user who cannot write it")
def test_a_read_only_vault_still_serves_read_only_commands(watched_gateway, monkeypatch):
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter the nobody user can run")
    base = Path(tempfile.mkdtemp(prefix="coffer-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        home = base / "home"
        monkeypatch.setenv("COFFER_HOME", str(home))
        cli("add", "good", "--", *FAKE)
        gw = watched_gateway()
        gw.initialize()
        gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "logged"}})
        gw.close()
        for path in [home, *home.iterdir()]:
            os.chown(path, NOBODY, NOBODY)
            os.chmod(path, 0o500 if path.is_dir() else 0o400)
        # The checkout may sit where nobody cannot read (a private temporary folder): nobody runs a vendored copy.
        vendored = base / "coffer.py"
        shutil.copyfile(COFFER, vendored)
        os.chmod(vendored, 0o644)

        def as_nobody(*args):
            return subprocess.run([python, str(vendored), *args], capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "COFFER_HOME": str(home), "HOME": str(base)}, cwd=base,
                                  preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))

        listed = as_nobody("list")
        assert listed.returncode == 0 and "good" in listed.stdout, listed.stdout + listed.stderr
        cached = as_nobody("tools", "--cached")
        assert cached.returncode == 0 and "good__echo" in cached.stdout, cached.stdout + cached.stderr
        log = as_nobody("log")
        assert log.returncode == 0 and "good__echo" in log.stdout, log.stdout + log.stderr
        no_traceback(listed, cached, log)
        assert not mode(home / "coffer.db") & 0o222, "Coffer made a read-only vault writable"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_running_gateway_rereads_the_vault_on_changes_not_on_its_own_logs(home):
    """The hub polls coffer.db once a second.  Its own invocation log, the search feedback and token use commit
    several times a second under load: those must not make it re-read every server, capability and profile; a
    change by another process (the CLI, the page, an older Coffer, a sqlite3 shell) must, and so must an audited
    change outside coffer.db such as a secret."""
    from coffer_src.gateway.hub import Hub

    hub = Hub(Vault(str(home)))
    reads = []
    real_states = hub.vault.capability_states
    hub.vault.capability_states = lambda: reads.append(1) or real_states()
    log = InvocationLog(hub.vault.path)
    for n in range(3):
        log.record("client", "srv", f"tool{n}", "tool", time.monotonic(), "ok")
        log.flush()
        hub._reload_if_vault_changed()
    assert reads == []
    other = Vault(str(home))
    other.set_setting("call_timeout", "42")
    hub._reload_if_vault_changed()
    assert len(reads) == 1 and float(hub.settings["call_timeout"]) == 42
    shell = sqlite3.connect(hub.vault.path)  # a writer that knows nothing of Coffer's code
    shell.execute("INSERT INTO servers(name, transport, command, position, created_at) "
                  "VALUES ('raw', 'stdio', '[\"true\"]', 9, '2026-01-01')")
    shell.commit()
    hub._reload_if_vault_changed()
    assert len(reads) == 2 and "raw" in hub.configs
    other.audit("secret-set", "TOKEN")
    hub._reload_if_vault_changed()
    assert len(reads) == 3
    shell.close()
    other.close()
    log.close()
