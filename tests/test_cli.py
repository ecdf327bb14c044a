"""The command line as a new user meets it (issue 11): one clear line for every error, what add, tools, list, call,
audit and log say about servers and their failures, choices that survive a replace, no terminal escape
sequences from an upstream in any output, and coffer.py run as a vendored script."""

import json
import shutil
import subprocess

import pytest

from conftest import (
    COFFER,
    FAKE,
    PY,
    add_hostile,
    assert_no_control,
    call_tool,
    cli,
    open_session,
    text_of,
    wait_for_status,
)


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


def test_add_warns_about_a_missing_command_and_refuses_mismatched_options(home):
    proc = cli("add", "x", "--", "no-such-command-for-coffer")
    assert "not on PATH" in proc.stderr
    proc = cli("add", "y", "--header", "A=b", "--", *FAKE, check=False)
    assert proc.returncode == 1 and "--header is for remote servers" in proc.stderr
    proc = cli("add", "z", "--url", "ftp://example.com/mcp", check=False)
    assert proc.returncode == 1 and "invalid URL" in proc.stderr
    proc = cli("add", "w", "--url", "http://example.com/mcp", "--header", "Authorization=Bearer abcdef123")
    assert "plain http" in proc.stderr
    assert "abcdef123" not in proc.stdout + proc.stderr


def test_tools_waits_for_every_server_and_says_in_plain_words_which_failed(home):
    cli("add", "good", "--", *FAKE, "--tools", "echo")
    cli("add", "missing", "--", "no-such-command-for-coffer")
    cli("add", "crashy", "--", *FAKE, "--exit-at-start")
    proc = cli("tools", check=False)
    assert proc.returncode == 1
    assert "good__echo" in proc.stdout
    assert "missing did not start: command 'no-such-command-for-coffer' not found on PATH" in proc.stderr
    assert "crashy did not start: exited with code 3" in proc.stderr
    assert "refusing to start" in proc.stderr                     # the server's own last words
    assert "list_changed" not in proc.stderr and "Traceback" not in proc.stderr
    # coffer list now tells the truth about those attempts, not "never started"
    servers = {s["name"]: s for s in json.loads(cli("list", "--json").stdout)["servers"]}
    assert servers["good"]["status"] == "ready"
    assert servers["missing"]["status"] == "failed" and "not found on PATH" in servers["missing"]["detail"]
    assert servers["crashy"]["status"] == "failed" and "exited with code 3" in servers["crashy"]["detail"]


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


def test_replace_keeps_choices_and_remove_then_add_restores_them(home):
    cli("add", "s", "--", *FAKE, "--tools", "echo,fail")
    cli("tools")
    cli("disable", "s__fail")
    proc = cli("add", "s", "--replace", "--", *FAKE, "--tools", "echo,fail,slow")
    assert "kept the earlier choices" in proc.stdout
    listed = {t["name"] for t in json.loads(cli("tools", "--json").stdout)["tools"]}
    assert "s__slow" in listed and "s__echo" in listed and "s__fail" not in listed
    cli("remove", "s")
    proc = cli("disable", "s__echo", check=False)       # a removed server's tools are not targets any more
    assert proc.returncode == 1
    proc = cli("add", "s", "--", *FAKE, "--tools", "echo,fail")
    assert "kept the earlier choices" in proc.stdout
    listed = {t["name"] for t in json.loads(cli("tools", "--json").stdout)["tools"]}
    assert "s__echo" in listed and "s__fail" not in listed
    proc = cli("add", "s", "--", *FAKE, check=False)
    assert proc.returncode == 1 and "--replace" in proc.stderr


def test_unknown_targets_suggest_names_without_starting_servers(home, tmp_path):
    spawns = tmp_path / "spawns"
    cli("add", "s", "--", *FAKE, "--tools", "echo,fail", "--spawn-log", str(spawns))
    cli("tools")
    before = spawns.read_text()
    proc = cli("disable", "s__ecoh", check=False)
    assert proc.returncode == 1 and "did you mean s__echo" in proc.stderr
    assert spawns.read_text() == before
    proc = cli("config", "discovery_timout", "3", check=False)
    assert proc.returncode == 1 and "discovery_timeout" in proc.stderr


def test_call_starts_only_the_server_it_needs(home, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    cli("add", "one", "--", *FAKE, "--tools", "echo", "--spawn-log", str(one))
    cli("add", "two", "--", *FAKE, "--tools", "echo", "--spawn-log", str(two))
    proc = cli("call", "one__echo", '{"text": "hi"}')
    assert json.loads(proc.stdout)["content"][0]["text"] == "hi"
    assert one.exists() and not two.exists()


def test_audit_filters_and_the_log_names_the_server(home):
    cli("add", "a", "--", *FAKE, "--tools", "echo")
    cli("add", "b", "--", *FAKE, "--tools", "echo")
    cli("call", "a__echo", '{"text": "x"}')
    rows = json.loads(cli("audit", "--json", "--server", "a").stdout)["audit"]
    assert rows and all(r["target"].startswith("a") for r in rows)
    upstream = json.loads(cli("audit", "--json", "--kind", "upstream").stdout)["audit"]
    assert upstream and all(r["action"].startswith("upstream-") for r in upstream)
    assert json.loads(cli("audit", "--json", "--since", "2999-01-01").stdout)["audit"] == []
    assert cli("audit", "--since", "someday", check=False).returncode == 1  # (yesterday is understood: issue 23)
    assert "SERVER" in cli("log").stdout.splitlines()[0]
    settings = json.loads(cli("config", "--json").stdout)
    assert settings["call_timeout"] == 120.0


# -- no terminal control characters from an upstream -------------------------------------------------------------------

def test_tool_listings_on_a_terminal_carry_no_escape_sequences(home, watched_gateway):
    add_hostile("p", "ansi")
    gw = open_session(watched_gateway)
    gw.close()
    cached = cli("tools", "--cached")
    live = cli("tools")
    for label, proc in (("tools --cached", cached), ("tools", live)):
        assert "Looks harmless" in proc.stdout, proc.stdout
        assert_no_control(proc.stdout, f"`coffer {label}` stdout")
        assert_no_control(proc.stderr, f"`coffer {label}` stderr")


def test_audit_log_and_list_output_carry_no_escape_sequences(home, watched_gateway):
    cli("config", "max_restarts", "1")
    add_hostile("p", "ansi")
    add_hostile("x", "ansi", "exit")
    add_hostile("good")
    gw = open_session(watched_gateway)
    call_tool(gw, "p__echo", {"text": "x"})
    call_tool(gw, "p__\x1b]52;c;cHduZWQ=\x07")
    wait_for_status("x", "failed")
    gw.close()
    audit = cli("audit", "--limit", "1000")
    assert "evil" in audit.stdout  # the tool with an escape in its name was recorded...
    assert_no_control(audit.stdout, "`coffer audit`")  # ...and printed harmlessly
    log = cli("log", "--limit", "1000")
    assert "p__" in log.stdout
    assert_no_control(log.stdout, "`coffer log`")
    listing = cli("list")
    assert "boom" in listing.stdout or "boom" in listing.stderr
    assert_no_control(listing.stdout + listing.stderr, "`coffer list`")


# -- a vendored copy ---------------------------------------------------------------------------------------------------

def test_a_vendored_copy_runs_as_a_script(home, tmp_path):
    """coffer.py copied into a project and run as `python3 coffer.py`: compiled from source at each start, with no
    package around it (the rest of the tests run it the way an installed copy runs, from bytecode)."""
    vendored = tmp_path / "project" / "vendor" / "coffer.py"
    vendored.parent.mkdir(parents=True)
    shutil.copyfile(COFFER, vendored)

    def run(*args, **kwargs):
        return subprocess.run([PY, str(vendored), *args], capture_output=True, text=True, timeout=60,
                              cwd=vendored.parent.parent, **kwargs)

    assert run("--version").stdout.startswith("coffer ")
    assert run("add", "s", "--", *FAKE, "--tools", "echo").returncode == 0
    assert [s["name"] for s in json.loads(run("list", "--json").stdout)["servers"]] == ["s"]
    serve = subprocess.Popen([PY, str(vendored), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=vendored.parent.parent)
    try:
        def ask(message):
            serve.stdin.write(json.dumps(message) + "\n")
            serve.stdin.flush()
            while True:
                reply = json.loads(serve.stdout.readline())
                if reply.get("id") == message["id"]:
                    return reply

        init = ask({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert init["result"]["serverInfo"]["name"] == "coffer"
        serve.stdin.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}) + "\n")
        reply = ask({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"name": "s__echo", "arguments": {"text": "from a vendored copy"}}})
        assert text_of(reply) == "from a vendored copy"
    finally:
        serve.stdin.close()
        assert serve.wait(30) == 0
