"""The first ten minutes of a new user (issue 11): what the CLI says and does around adding, listing, calling and
changing servers, and how many tools each kind of client is shown."""

import json
import os

from conftest import FAKE, PY, cli


def tool_names(response):
    return [t["name"] for t in response["result"]["tools"]]


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


def test_a_command_not_found_fails_at_once_instead_of_five_retries(home, raw_gateway):
    cli("config", "discovery_timeout", "30")
    cli("add", "missing", "--", "no-such-command-for-coffer")
    cli("add", "good", "--", *FAKE, "--tools", "echo")
    gw = raw_gateway()
    gw.initialize()
    names = tool_names(gw.request("tools/list", timeout=10))   # answered without waiting out 30 s of retries
    assert "good__echo" in names
    reply = gw.request("tools/call", {"name": "missing__anything", "arguments": {}})
    assert reply["error"]["code"] == -32602


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


def test_a_disabled_servers_tool_gets_an_actionable_error(home, raw_gateway):
    cli("add", "s", "--", *FAKE, "--tools", "echo")
    cli("tools")
    cli("disable", "s")
    gw = raw_gateway()
    gw.initialize()
    reply = gw.request("tools/call", {"name": "s__echo", "arguments": {"text": "x"}})
    assert reply["error"]["code"] == -32602 and "coffer enable s" in reply["error"]["message"]


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


def test_clients_with_tool_caps_get_a_budget_and_every_tool_stays_callable(home, raw_gateway):
    for n in range(6):
        cli("add", f"s{n}", "--", *FAKE, "--tools", "echo,slow,fail,big,crash,sample")
    cli("tools")                                          # 36 tools, remembered for the next sessions
    cursor = raw_gateway()
    init = cursor.initialize(name="cursor-vscode")
    listed = tool_names(cursor.request("tools/list"))
    assert len(listed) == 36 + 1                           # under Cursor's cap of 40: everything
    cursor.close()

    cli("config", "expose.cursor", "budget:10")
    for _ in range(3):
        cli("call", "s4__fail", check=False)              # used the most: kept in the budget
    cursor = raw_gateway()
    init = cursor.initialize(name="cursor-vscode")
    listed = tool_names(cursor.request("tools/list"))
    assert len(listed) == 10 and listed[0] == "coffer__search_tools"
    assert {name.split("__")[0] for name in listed[1:]} == {f"s{n}" for n in range(6)}   # every server visible
    assert "s4__fail" in listed
    assert "27 tools are not listed" in init["result"]["instructions"]
    reply = cursor.request("tools/call", {"name": "s0__echo", "arguments": {"text": "unlisted"}})
    assert reply["result"]["content"][0]["text"] == "unlisted"
    again = raw_gateway()
    again.initialize(name="cursor-vscode")
    assert tool_names(again.request("tools/list")) == listed   # deterministic

    claude = raw_gateway()
    claude.initialize(name="claude-code")
    assert len(tool_names(claude.request("tools/list"))) == 37


def test_changing_expose_is_announced_with_list_changed(home, raw_gateway):
    cli("add", "s", "--", *FAKE, "--tools", "echo")
    cli("tools")
    gw = raw_gateway()
    gw.initialize()
    assert "s__echo" in tool_names(gw.request("tools/list"))
    gw.request("ping")
    before = sum(n["method"] == "notifications/tools/list_changed" for n in gw.notifications)
    cli("config", "expose", "search")
    gw.wait_for(lambda g: sum(n["method"] == "notifications/tools/list_changed" for n in g.notifications) > before,
                timeout=10)
    assert tool_names(gw.request("tools/list")) == ["coffer__search_tools"]


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


def test_serve_by_hand_says_what_it_is(home):
    import subprocess
    if not hasattr(os, "openpty"):
        return
    controller, terminal = os.openpty()
    proc = subprocess.Popen([PY, "-c", "import sys, coffer; sys.exit(coffer.main(['serve']))"],
                            stdin=terminal, stdout=subprocess.PIPE, stderr=terminal,
                            cwd=os.path.dirname(FAKE[1]) + "/../..")
    try:
        seen = b""
        while b"speaks MCP" not in seen:
            chunk = os.read(controller, 4096)
            assert chunk, seen
            seen += chunk
        assert b"claude mcp add coffer" in seen
    finally:
        proc.kill()
        proc.wait()
        os.close(controller)
        os.close(terminal)


def test_a_probe_finishes_only_after_it_has_recorded_what_it_saw(home, monkeypatch):
    # The status write is what `coffer list` reads later. Slow it down so a probe that returned as soon as the
    # server looked ready would leave the vault saying "never started".
    import time

    import coffer
    cli("add", "good", "--", *FAKE, "--tools", "echo")
    cli("add", "crashy", "--", *FAKE, "--exit-at-start")
    record = coffer.Vault.record_status

    def slow_record(self, *args, **kwargs):
        time.sleep(0.4)
        return record(self, *args, **kwargs)

    monkeypatch.setattr(coffer.Vault, "record_status", slow_record)
    vault = coffer.Vault(str(home))
    results = {r.name: r.state for r in coffer.ServerProbe(vault).run(timeout=30)}
    assert results == {"good": "ready", "crashy": "failed"}
    statuses = {s["name"]: s["status"] for s in vault.servers()}
    assert statuses == {"good": "ready", "crashy": "failed"}
