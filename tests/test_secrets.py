"""Secrets: ${VAR} references resolved at spawn time, the secret store, literal values moved out of the vault, and
redaction everywhere Coffer prints or writes (class 3 of issue 15).  Everything goes through the real CLI and the
real ``coffer serve``."""

import json
import re
import uuid
from pathlib import Path

import pytest

from coffer_src.errors import CofferError
from coffer_src.secret_store import expand_vars, parse_env_assignment

from conftest import (
    FAKE,
    HOSTILE,
    PY,
    call_msg,
    cli,
    is_tool_error,
    no_traceback,
    quick_restarts,
    secret_set,
    server_status,
    servers,
    text_of,
    tool_names,
    wait_log,
    wait_until,
)
from hostile_http import HostileHttp, mcp

# -- ${VAR} references -------------------------------------------------------------------------------------------------

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


# -- the secret store --------------------------------------------------------------------------------------------------

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


# -- literals are moved into the store ---------------------------------------------------------------------------------

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


def test_credentials_in_a_server_url_are_not_stored_or_printed(home):
    """--env and --header literals go to the secret store; a URL's userinfo or api_key is stored and printed."""
    cli("add", "hosted", "--transport", "http", "--url", "https://user:s3cr3t-pass@127.0.0.1:9/mcp")
    listing = cli("list").stdout
    vault_bytes = b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("coffer.db"))
    assert "s3cr3t-pass" not in listing
    assert b"s3cr3t-pass" not in vault_bytes


def test_a_refused_add_changes_no_secret(home):
    """cmd_add moves literals into the secret store before Vault.add_server validates anything: a refused
    `add --replace` still swaps the running server's key, and a refused plain `add` leaves a numbered twin."""
    cli("add", "t", "--env", "API_KEY=old-key-value", "--", *FAKE)
    before = (home / "secrets.json").read_text()
    refused = cli("add", "t", "--replace", "--env", "API_KEY=new-key-value", "--timeout", "-5", "--", *FAKE,
                  check=False)
    assert refused.returncode == 1
    refused = cli("add", "t", "--env", "API_KEY=third-value", "--", *FAKE, check=False)
    assert refused.returncode == 1
    assert (home / "secrets.json").read_text() == before


def test_add_help_says_that_arguments_are_visible_in_ps(home):
    help_text = cli("add", "--help").stdout
    assert re.search(r"\bps\b", help_text), "the --help of add must warn that ${VAR} in arguments shows in ps"
    assert "--inherit-env" in help_text and "secret" in help_text.lower()


# -- redaction ---------------------------------------------------------------------------------------------------------

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
    rows = wait_until(lambda: (rows := servers())["leaky"]["status"] == rows["snoop"]["status"] == "failed" and rows,
                      timeout=30, interval=0.1, what="leaky and snoop to fail")
    gw.close()
    assert "TOKEN=***" in rows["leaky"]["detail"], rows["leaky"]
    assert "***" in rows["snoop"]["detail"] and "lying around" in rows["snoop"]["detail"], rows["snoop"]
    shown = cli("list")
    for value in (referenced, unrelated):
        assert value not in json.dumps(rows) and value not in shown.stdout + shown.stderr
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


@pytest.mark.parametrize("secret", ['quo"ted-secret-value', "line-one-secret\nline-two-secret",
                                    "back\\slash-secret-value"])
def test_json_output_redacts_secrets_that_json_escapes(home, secret):
    """say_json redacts after encoding: a stored secret holding ", \\ or a newline (a PEM key) is printed as its
    JSON escape and escapes redaction in every --json output."""
    cli("secret", "set", "KEY", input=secret)
    cli("add", "t", "--", *FAKE)
    result = cli("call", "t__echo", json.dumps({"text": f"the key is {secret}"}))
    assert secret not in json.loads(result.stdout)["content"][0]["text"]
    assert "***" in result.stdout


def test_a_secret_in_a_command_argument_is_redacted_like_any_expanded_reference(home):
    """_make_transport registers what env/headers/url references expand to, but not the command's arguments."""
    secret = "hunter2-argument-secret"
    cli("add", "leaky", "--", PY, "-c",
        "import sys; sys.stderr.write('bad token ' + sys.argv[1] + chr(10)); sys.exit(3)", "${LEAKY_TOKEN}")
    result = cli("tools", check=False, env={"LEAKY_TOKEN": secret})
    listing = cli("list")
    vault_bytes = b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("coffer.db"))
    assert secret not in result.stdout + result.stderr + listing.stdout
    assert secret.encode() not in vault_bytes


def test_no_secret_or_call_data_reaches_the_disk(home, raw_gateway):
    secret = "sekret-" + uuid.uuid4().hex
    marker = "MRK" + uuid.uuid4().hex[:12]
    cli("config", "discovery_timeout", "2")
    cli("config", "max_restarts", "2")
    quick_restarts()
    cli("add", "leaky", "--env", "TOKEN=${SECRET}", "--", *FAKE, "--stderr-env", "TOKEN")
    cli("add", "doomed", "--env", "TOKEN=${SECRET}", "--", *FAKE, "--stderr-env", "TOKEN", "--exit-at-start")
    gw = raw_gateway(env={"SECRET": secret})
    gw.initialize(capabilities={"sampling": {}})
    assert "leaky__echo" in tool_names(gw.request("tools/list"))

    reply = gw.request("tools/call", {"name": "leaky__echo", "arguments": {"text": f"{marker}-arg-echo",
                                                                          "extra": f"{marker}-extra"}})
    assert text_of(reply) == f"{marker}-arg-echo"
    reply = gw.request("tools/call", {"name": "leaky__fail", "arguments": {"why": f"{marker}-arg-fail"}})
    assert is_tool_error(reply)
    reply = gw.request("tools/call", {"name": "leaky__slow", "arguments": {"seconds": 0.1, "note": marker},
                                      "_meta": {"progressToken": f"{marker}-token"}})
    assert not is_tool_error(reply)
    gw.send(call_msg("sample", "leaky__sample", {"prompt": f"{marker}-prompt"}))
    request = gw.wait_for(lambda g: next((r for r in g.requests if r["method"] == "sampling/createMessage"), None))
    assert f"{marker}-prompt" in json.dumps(request)
    gw.send({"jsonrpc": "2.0", "id": request["id"], "result": {
        "role": "assistant", "model": "test", "content": {"type": "text", "text": f"{marker}-model-answer"}}})
    assert text_of(gw.wait_response("sample")) == f"{marker}-model-answer"
    reply = gw.request("tools/call", {"name": "leaky__nope", "arguments": {"text": marker}})
    assert "error" in reply

    wait_until(lambda: server_status("doomed")["status"] == "failed", timeout=15, what="doomed to fail")
    wait_log(lambda rows: sum(r["capability"].startswith("leaky__") for r in rows) >= 5)

    def scan():
        hits = []
        for path in Path(home).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                for needle in (secret, marker):
                    if needle.encode() in data:
                        hits.append((path.name, needle))
        return hits

    assert (Path(home) / "coffer.db").exists()
    assert scan() == [], "while serving"
    detail = server_status("doomed")["detail"] or ""
    assert secret not in detail and "TOKEN=***" in detail, detail  # the leak was redacted, not just absent
    gw.close()
    assert scan() == [], "after shutdown"
    assert secret not in gw.stderr_text(), "the gateway's stderr shows an upstream's secret unredacted"
