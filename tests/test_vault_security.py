"""The vault and the secret store under attack (issue 15, classes 3 and 17): file permissions, a second local user,
literal secrets, redaction, and a damaged or read-only coffer.db.  Everything goes through the real CLI and the
real ``coffer serve``; damage is done with sqlite3 directly, as a crash or a careless edit would."""

import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import COFFER, FAKE, HOSTILE, PY, ROOT, cli

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from hostile_http import HostileHttp, mcp  # noqa: E402

POSIX = os.name == "posix"
posix_only = pytest.mark.skipif(not POSIX, reason="POSIX permission bits")
AS_ROOT = POSIX and os.geteuid() == 0
NOBODY = 65534
PERMISSION_NOTICE = re.compile(r"perm|chmod|0o?600|0o?700|readable|private", re.I)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def cli_with_umask(umask, *args, stdin=None, env=None):
    """The CLI started under a given umask (a careless shell profile), optionally fed on stdin."""
    return subprocess.run([PY, COFFER, *args], input=stdin, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, preexec_fn=lambda: os.umask(umask))


def secret_set(name, value, env=None):
    proc = subprocess.run([PY, COFFER, "secret", "set", name], input=value + "\n", capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"coffer secret set failed ({proc.returncode}): {proc.stderr}"
    return proc


def vault_bytes(home) -> dict:
    """Every file of the vault except the secret store itself."""
    return {p.name: p.read_bytes() for p in Path(home).iterdir() if p.is_file() and p.name != "secrets.json"}


def holding(home, needle: str) -> list[str]:
    return [name for name, data in vault_bytes(home).items() if needle.encode() in data]


def env_via_gateway(watched_gateway, server, env=None):
    # The upstream's environment comes back in a tool result, where Coffer redacts known secrets by default
    # (issue 23): these tests look at what the upstream got, so the server's output is passed unredacted.
    cli("config", f"redact.{server}", "off")
    gw = watched_gateway(env=env)
    gw.initialize()
    reply = gw.request("tools/call", {"name": f"{server}__env", "arguments": {}})
    gw.close()
    return json.loads(reply["result"]["content"][0]["text"]), gw


def no_traceback(*procs):
    for proc in procs:
        text = proc if isinstance(proc, str) else proc.stdout + proc.stderr
        assert "Traceback" not in text, text[-3000:]


# -- class 3: permissions ---------------------------------------------------------------------------------------

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
            return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                  preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))

        for target in (home / "coffer.db", home / "secrets.json"):
            assert target.exists()
            read = as_nobody("cat", str(target))
            assert read.returncode != 0 and secret not in read.stdout, f"nobody could read {target.name}"
        listing = as_nobody("ls", str(home))
        assert listing.returncode != 0, f"nobody could list the vault: {listing.stdout}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- class 3: the secret store ---------------------------------------------------------------------------------

def test_secret_set_list_rm_keep_values_out_of_the_vault_and_the_output(home):
    value = "ghp_" + uuid.uuid4().hex
    stored = secret_set("GH_TOKEN", value)
    assert value not in stored.stdout + stored.stderr
    listed = cli("secret", "list")
    assert "GH_TOKEN" in listed.stdout and value not in listed.stdout + listed.stderr
    assert value in (home / "secrets.json").read_text()
    assert not holding(home, value), "a secret value reached coffer.db"
    removed = cli("secret", "rm", "GH_TOKEN")
    no_traceback(removed)
    assert "GH_TOKEN" not in cli("secret", "list").stdout
    assert value not in (home / "secrets.json").read_text()
    missing = cli("secret", "rm", "GH_TOKEN", check=False)
    no_traceback(missing)


def test_a_stored_secret_resolves_for_an_upstream_and_the_environment_wins(home, watched_gateway):
    stored = "store-" + uuid.uuid4().hex
    secret_set("UP_TOKEN", stored)
    cli("add", "s", "--env", "TOKEN=${UP_TOKEN}", "--", *HOSTILE, "--name", "s")
    env, _ = env_via_gateway(watched_gateway, "s")
    assert env.get("TOKEN") == stored
    env, _ = env_via_gateway(watched_gateway, "s", env={"UP_TOKEN": "from-the-environment"})
    assert env.get("TOKEN") == "from-the-environment"


def test_a_stored_secret_resolves_in_a_remote_header(home, watched_gateway):
    stored = "hdr-" + uuid.uuid4().hex
    secret_set("REMOTE_TOKEN", stored)
    server = HostileHttp()
    try:
        server.routes["/mcp"] = mcp("remote")
        cli("add", "remote", "--url", server.url("/mcp"), "--header", "Authorization=Bearer ${REMOTE_TOKEN}")
        gw = watched_gateway()
        gw.initialize()
        reply = gw.request("tools/call", {"name": "remote__echo", "arguments": {"text": "hi"}})
        assert reply["result"]["content"][0]["text"] == "remote: hi"
        assert all(r.headers.get("authorization") == f"Bearer {stored}" for r in server.seen("POST"))
    finally:
        server.close()


def test_a_literal_env_value_is_moved_into_the_store(home, watched_gateway):
    literal = "sk-literal-" + uuid.uuid4().hex
    added = cli("add", "s", "--env", f"API_KEY={literal}", "--", *HOSTILE, "--name", "s")
    assert literal not in added.stdout + added.stderr, "the notice must not print the secret"
    assert (added.stdout + added.stderr).strip(), "no notice that the value was moved into the secret store"
    assert not holding(home, literal), "a literal secret was written to the vault"
    assert cli("secret", "list").stdout.strip(), "the moved secret is not listed"
    for args in (("list",), ("list", "--json"), ("audit",), ("audit", "--json")):
        shown = cli(*args)
        assert literal not in shown.stdout + shown.stderr, f"`coffer {' '.join(args)}` shows the secret"
    env, gw = env_via_gateway(watched_gateway, "s")
    assert env.get("API_KEY") == literal, "the upstream no longer gets its value"
    assert not holding(home, literal)
    assert literal not in gw.stderr_text()


def test_a_literal_header_value_is_moved_into_the_store(home, watched_gateway):
    literal = "Bearer lit-" + uuid.uuid4().hex
    server = HostileHttp()
    try:
        server.routes["/mcp"] = mcp("remote")
        added = cli("add", "remote", "--url", server.url("/mcp"), "--header", f"Authorization={literal}")
        assert literal not in added.stdout + added.stderr
        assert not holding(home, literal.split()[1])
        gw = watched_gateway()
        gw.initialize()
        reply = gw.request("tools/call", {"name": "remote__echo", "arguments": {"text": "hi"}})
        assert reply["result"]["content"][0]["text"] == "remote: hi"
        assert all(r.headers.get("authorization") == literal for r in server.seen("POST"))
        gw.close()
        assert not holding(home, literal.split()[1])
    finally:
        server.close()


def test_ordinary_settings_moved_into_the_store_do_not_corrupt_the_output(home, watched_gateway):
    """Every literal --env value is moved into the store, settings included; redacting such short ordinary values
    (true, enabled, info) must not mangle what Coffer prints, least of all its JSON."""
    cli("add", "s", "--env", "DEBUG=true", "--env", "MODE=enabled", "--env", "LEVEL=info",
                "--", *HOSTILE, "--name", "s")
    env, gw = env_via_gateway(watched_gateway, "s")
    assert (env.get("DEBUG"), env.get("MODE"), env.get("LEVEL")) == ("true", "enabled", "info")
    servers = json.loads(cli("list", "--json").stdout)["servers"]  # must still be JSON
    row = next(s for s in servers if s["name"] == "s")
    assert row["enabled"] is True and row["policy"] == "enabled", row
    assert "***" not in cli("list").stdout and "***" not in cli("audit").stdout
    assert "***" not in json.dumps(json.loads(cli("log", "--json").stdout))
    assert cli("secret", "list").stdout.strip()  # they were moved (fails where literals stay in coffer.db)


@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_a_credential_inside_a_url_is_kept_out_of_the_vault_and_the_output(home, watched_gateway, where):
    """Hosted MCP servers often take their key in the URL (?api_key=...) or as user:password@; such a literal is
    a secret like a header value is."""
    secret = "urlsecret" + uuid.uuid4().hex[:12]
    server = HostileHttp()
    try:
        server.routes["/mcp"] = mcp("remote")
        url = (server.url("/mcp") + f"?api_key={secret}" if where == "query"
               else server.url("/mcp").replace("://", f"://user:{secret}@"))
        added = cli("add", "remote", "--url", url)
        assert secret not in added.stdout + added.stderr
        assert not holding(home, secret), "a credential in a URL was written to the vault"
        for args in (("list",), ("list", "--json"), ("audit",)):
            shown = cli(*args)
            assert secret not in shown.stdout + shown.stderr, f"`coffer {' '.join(args)}` shows it"
        if where == "query":  # the server still gets its key
            gw = watched_gateway()
            gw.initialize()
            reply = gw.request("tools/call", {"name": "remote__echo", "arguments": {"text": "hi"}})
            assert reply["result"]["content"][0]["text"] == "remote: hi", reply
            assert all(secret in r.path for r in server.seen("POST"))
            gw.close()
            assert not holding(home, secret) and secret not in gw.stderr_text()
    finally:
        server.close()


def test_store_secrets_are_redacted_from_status_stderr_and_the_vault(home, watched_gateway, tmp_path):
    referenced = "ref-" + uuid.uuid4().hex
    unrelated = "unrel-" + uuid.uuid4().hex
    secret_set("LEAKY_TOKEN", referenced)
    secret_set("UNRELATED_TOKEN", unrelated)
    leak_file = tmp_path / "leak.txt"
    leak_file.write_text(f"found {unrelated} lying around\n")
    cli("config", "max_restarts", "1")
    cli("add", "leaky", "--env", "TOKEN=${LEAKY_TOKEN}", "--", *FAKE, "--stderr-env", "TOKEN", "--exit-at-start")
    cli("add", "snoop", "--", "/bin/sh", "-c", f"cat {leak_file} >&2; exit 3")
    cli("add", "good", "--", *FAKE)
    gw = watched_gateway()
    gw.initialize()
    gw.request("tools/list")
    reply = gw.request("tools/call", {"name": "good__echo", "arguments": {"text": "fine"}})
    assert reply["result"]["content"][0]["text"] == "fine"
    servers = {}

    def both_failed():
        servers.update({s["name"]: s for s in json.loads(cli("list", "--json").stdout)["servers"]})
        return servers["leaky"]["status"] == "failed" and servers["snoop"]["status"] == "failed"

    deadline = time.monotonic() + 30
    while not both_failed():
        assert time.monotonic() < deadline, servers
        time.sleep(0.2)
    gw.close()
    assert "TOKEN=***" in servers["leaky"]["detail"], servers["leaky"]
    assert "***" in servers["snoop"]["detail"] and "lying around" in servers["snoop"]["detail"], servers["snoop"]
    shown = cli("list")
    for value in (referenced, unrelated):
        assert value not in json.dumps(servers) and value not in shown.stdout + shown.stderr
        assert value not in gw.stderr_text(), "the gateway's stderr shows a secret"
        assert not holding(home, value), "a secret reached the vault"


def test_debug_tracing_never_prints_a_secret(home, watched_gateway):
    value = "trace-" + uuid.uuid4().hex
    secret_set("TRACE_TOKEN", value)
    cli("add", "s", "--env", "TOKEN=${TRACE_TOKEN}", "--", *HOSTILE, "--name", "s")
    env, gw = env_via_gateway(watched_gateway, "s", env={"COFFER_LOG": "debug"})
    assert env.get("TOKEN") == value  # the value went through the gateway in a tool result...
    assert gw.stderr_text().strip(), "COFFER_LOG=debug traced nothing"
    assert value not in gw.stderr_text(), "...but must not be printed by the trace"


def test_add_help_says_that_arguments_are_visible_in_ps(home):
    help_text = cli("add", "--help").stdout
    assert re.search(r"\bps\b", help_text), "the --help of add must warn that ${VAR} in arguments shows in ps"
    assert "--inherit-env" in help_text and "secret" in help_text.lower()


# -- class 17: a damaged vault ------------------------------------------------------------------------------------

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
                                   capture_output=True, timeout=30,
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

        def as_nobody(*args):
            return subprocess.run([python, COFFER, *args], capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "COFFER_HOME": str(home), "HOME": str(base)},
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
