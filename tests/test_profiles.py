"""Profiles and tool overrides (issue 24), end to end: the MCP SDK as the client, `coffer serve` (standalone, or
relaying to the shared service) in the middle, real servers behind it (mcp-server-time, the fake server, and
server-everything where Node is present).  What an agent sees and can call is what is asserted."""

import json
import os
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from conftest import COFFER, FAKE, PY, TIME_SERVER, cli, everything_cmd, needs_node, wait_until

TIMEOUT = 120


def gateway(profile=None):
    return StdioServerParameters(command=PY, args=[COFFER, "serve", *(["--profile", profile] if profile else [])],
                                 env=dict(os.environ))


def names(listed) -> set[str]:
    return {tool.name for tool in listed.tools}


def text_of(result) -> str:
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


def cli_json(*args):
    return json.loads(cli(*args, "--json").stdout)


async def connect(stack: AsyncExitStack, profile=None, name="agent", mode="legacy", notices=None) -> Client:
    async def on_message(message):
        if notices is not None and isinstance(message, types.ServerNotification):
            notices.append(message)

    return await stack.enter_async_context(Client(gateway(profile), mode=mode, message_handler=on_message,
                                                  client_info=types.Implementation(name=name, version="1"),
                                                  read_timeout_seconds=60))


def run(body):
    async def main():
        with anyio.fail_after(TIMEOUT):
            async with AsyncExitStack() as stack:
                return await body(stack)
    return anyio.run(main)


async def refused(call) -> str:
    """The message of the JSON-RPC error a call is refused with."""
    with pytest.raises(MCPError) as caught:
        await call
    return str(caught.value)


@pytest.fixture
def servers(home, tmp_path):
    """`a` (the fake server, logging what it receives) and `time` (mcp-server-time), each listed once."""
    recv = tmp_path / "received.jsonl"
    cli("add", "a", "--", *FAKE, "--recv-log", str(recv))
    cli("add", "time", "--", *TIME_SERVER)
    cli("tools")  # what each lists is now known: profiles and overrides are checked against it
    return recv


@pytest.fixture
def service_mode(monkeypatch):
    """`coffer serve` relays to one shared service (stopped afterwards)."""
    monkeypatch.setenv("COFFER_SERVE_MODE", "service")
    yield
    cli("service", "stop", check=False, timeout=60)


def test_two_profiles_see_and_call_only_their_own_tools_while_a_client_without_one_sees_all(servers,
                                                                                           service_mode):
    cli("profile", "add", "coding", "--include", "a", "--exclude", "a__crash", "a__big")
    cli("profile", "add", "research", "--include", "time")
    seen = {}

    async def body(stack):
        coding = await connect(stack, "coding", "agent-coding")
        research = await connect(stack, "research", "agent-research", mode="2026-07-28")
        everything = await connect(stack, None, "agent-all")
        seen["instructions"] = coding.instructions
        seen["coding"] = names(await coding.list_tools())
        seen["research"] = names(await research.list_tools())
        seen["all"] = names(await everything.list_tools())
        seen["echo"] = text_of(await coding.call_tool("a__echo", {"text": "from coding"}))
        seen["time"] = (await research.call_tool("time__get_current_time", {"timezone": "UTC"})).structured_content
        seen["all calls"] = [text_of(await everything.call_tool("a__echo", {"text": "from all"})),
                             (await everything.call_tool("time__get_current_time",
                                                         {"timezone": "UTC"})).structured_content["timezone"]]
        seen["coding -> time"] = await refused(coding.call_tool("time__get_current_time", {"timezone": "UTC"}))
        seen["coding -> excluded"] = await refused(coding.call_tool("a__crash", {}))
        seen["research -> a"] = await refused(research.call_tool("a__echo", {"text": "x"}))
        search = {"query": "what time is it in a timezone", "top_k": 20}
        seen["coding search"] = (await coding.call_tool("coffer__search_tools", search)).structured_content
        seen["all search"] = (await everything.call_tool("coffer__search_tools", search)).structured_content
        seen["status"] = await anyio.to_thread.run_sync(lambda: cli_json("status"))

    run(body)
    assert seen["coding"] == {"coffer__search_tools", "a__echo", "a__slow", "a__fail", "a__sample"}
    assert "profile coding" in seen["instructions"]
    assert seen["research"] == {"coffer__search_tools", "time__get_current_time", "time__convert_time"}
    assert seen["all"] >= seen["coding"] | seen["research"] | {"a__crash", "a__big"}
    assert seen["echo"] == "from coding" and seen["time"]["timezone"] == "UTC"
    assert seen["all calls"] == ["from all", "UTC"]
    assert "profile 'coding'" in seen["coding -> time"] and "time__get_current_time" in seen["coding -> time"]
    assert "profile 'coding'" in seen["coding -> excluded"]
    assert "profile 'research'" in seen["research -> a"]
    assert {t["name"] for t in seen["coding search"]["tools"]} <= seen["coding"]
    assert seen["coding search"]["total_searched"] == len(seen["coding"]) - 1
    assert "time__get_current_time" in {t["name"] for t in seen["all search"]["tools"]}
    profiles = {s["client"]: s["profile"] for s in seen["status"]["sessions"]}
    assert profiles == {"agent-coding": "coding", "agent-research": "research", "agent-all": None}

    unknown = cli("serve", "--profile", "codng", check=False)  # the running service refuses it; the relay says so
    assert unknown.returncode == 1 and "unknown profile 'codng'; did you mean coding?" in unknown.stderr

    rows = wait_until(lambda: [r for r in cli_json("log")["invocations"] if r["client"] == "agent-coding"]
                      if len(cli_json("log")["invocations"]) >= 8 else None, what="the invocation log")
    assert {(r["capability"], r["status"], r["profile"]) for r in rows} >= {
        ("a__echo", "ok", "coding"), ("time__get_current_time", "denied", "coding"), ("a__crash", "denied", "coding"),
        ("coffer__search_tools", "ok", "coding")}
    assert all(r["profile"] is None for r in cli_json("log")["invocations"] if r["client"] == "agent-all")


def test_a_profile_change_reaches_a_live_session(servers):
    cli("profile", "add", "coding", "--include", "a")
    notices, seen = [], {}

    def changes():
        return sum(isinstance(n, types.ToolListChangedNotification) for n in notices)

    async def wait_for_change(since):
        with anyio.fail_after(30):
            while changes() <= since:
                await anyio.sleep(0.05)

    async def body(stack):
        client = await connect(stack, "coding", "agent-coding", notices=notices)
        seen["before"] = names(await client.list_tools())
        since = changes()
        await anyio.to_thread.run_sync(lambda: cli("profile", "add", "coding", "--replace", "--include", "a", "time",
                                                   "--exclude", "a__*"))
        await wait_for_change(since)
        seen["after"] = names(await client.list_tools())
        seen["call"] = (await client.call_tool("time__get_current_time", {"timezone": "UTC"})).structured_content
        seen["excluded now"] = await refused(client.call_tool("a__echo", {"text": "x"}))
        since = changes()
        await anyio.to_thread.run_sync(lambda: cli("profile", "rm", "coding"))
        await wait_for_change(since)
        seen["removed"] = names(await client.list_tools())
        seen["after removal"] = await refused(client.call_tool("time__get_current_time", {"timezone": "UTC"}))

    run(body)
    assert "a__echo" in seen["before"] and not any(n.startswith("time__") for n in seen["before"])
    assert seen["after"] == {"coffer__search_tools", "time__get_current_time", "time__convert_time"}
    assert seen["call"]["timezone"] == "UTC"
    assert "profile 'coding'" in seen["excluded now"]
    assert seen["removed"] == {"coffer__search_tools"}  # a client left on a removed profile sees nothing
    assert "profile 'coding'" in seen["after removal"]


def test_a_fixed_argument_is_hidden_filled_in_on_every_call_and_refused_when_sent(servers):
    cli("override", "time__get_current_time", "--fix", 'timezone="Asia/Tokyo"')
    cli("override", "a__echo", "--fix", "text=fixed words")  # a bare word is a string
    seen = {}

    async def body(stack):
        for mode in ("legacy", "2026-07-28"):
            client = await connect(stack, None, f"agent-{mode}", mode=mode)
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            schema = tools["time__get_current_time"].input_schema
            seen[mode] = {
                "schema": schema,
                "echo schema": tools["a__echo"].input_schema,
                "time": (await client.call_tool("time__get_current_time", {})).structured_content,
                "echoes": [text_of(await client.call_tool("a__echo", {})) for _ in range(3)],
                "sent": await client.call_tool("time__get_current_time", {"timezone": "UTC"}),
                "sent echo": await client.call_tool("a__echo", {"text": "mine"}),
                "searched": (await client.call_tool("coffer__search_tools", {"query": "current time"}))
                .structured_content}

    run(body)
    received = [json.loads(line) for line in servers.read_text().splitlines()]
    echoes = [m["params"]["arguments"] for m in received if m.get("method") == "tools/call"]
    assert echoes == [{"text": "fixed words"}] * 6, "every call carries the fixed value, none the client's"
    for mode, got in seen.items():
        assert "timezone" not in got["schema"].get("properties", {}) and "timezone" not in got["schema"].get(
            "required", []), mode
        assert got["echo schema"]["properties"] == {}
        assert got["time"]["timezone"] == "Asia/Tokyo"
        assert got["echoes"] == ["fixed words"] * 3
        for refusal in (got["sent"], got["sent echo"]):
            assert refusal.is_error and "is fixed by the user" in text_of(refusal), mode
        assert "'timezone'" in text_of(got["sent"]) and "'text'" in text_of(got["sent echo"])
        found = {t["name"]: t for t in got["searched"]["tools"]}
        assert "timezone" not in found["time__get_current_time"]["inputSchema"].get("properties", {})
    denied = [r for r in cli_json("log")["invocations"] if r["status"] == "denied"]
    assert {r["capability"] for r in denied} == {"time__get_current_time", "a__echo"}


def test_an_alias_routes_and_is_found_by_search_the_original_name_still_routes(servers):
    cli("override", "time__get_current_time", "--name", "clock_now", "--description",
        "Read the wall clock of any city: the present hour and minute there",
        "--annotation", "readOnly=true", "--annotation", "openWorldHint=false")
    seen = {}

    async def body(stack):
        client = await connect(stack)
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        seen["listed"] = set(tools)
        seen["clock"] = tools["clock_now"]
        seen["by alias"] = (await client.call_tool("clock_now", {"timezone": "UTC"})).structured_content
        seen["by original"] = (await client.call_tool("time__get_current_time", {"timezone": "UTC"})
                               ).structured_content
        seen["search"] = (await client.call_tool("coffer__search_tools", {"query": "wall clock reading in a city"})
                          ).structured_content

    run(body)
    assert "clock_now" in seen["listed"] and "time__get_current_time" not in seen["listed"]
    assert seen["clock"].description.startswith("Read the wall clock")
    assert seen["clock"].annotations.read_only_hint is True and seen["clock"].annotations.open_world_hint is False
    assert seen["by alias"]["timezone"] == "UTC" and seen["by original"]["timezone"] == "UTC"
    assert seen["search"]["tools"][0]["name"] == "clock_now"
    called = json.loads(cli("call", "time__get_current_time", '{"timezone": "UTC"}').stdout)
    assert called["structuredContent"]["timezone"] == "UTC"  # the CLI calls it by its original name
    listed = cli_json("tools")
    assert listed["overridden"]["clock_now"] == {"name_of": "time__get_current_time",
                                                 "overridden": ["name", "description", "annotations"], "fixed": []}


def listed_once(profile=None) -> dict:
    async def body(stack):
        client = await connect(stack, profile)
        return {tool.name: tool for tool in (await client.list_tools()).tools}
    return run(body)


def call_once(name, arguments, profile=None):
    async def body(stack):
        client = await connect(stack, profile)
        try:
            return await client.call_tool(name, arguments)
        except MCPError as exc:
            return str(exc)
    return run(body)


def test_an_override_survives_a_restart_and_an_upgrade_and_a_breaking_upgrade_is_reported(home, tmp_path):
    upgrade = tmp_path / "upgrade-args"
    upgrade.write_text("")
    cli("add", "a", "--", *FAKE, "--args-file", str(upgrade))
    cli("tools")
    cli("override", "a__echo", "--name", "say", "--fix", 'text="hello"')
    first = listed_once()
    assert "say" in first and "a__echo" not in first and first["say"].input_schema["properties"] == {}
    # A restart (a new gateway process) lists and calls it the same.
    assert text_of(call_once("say", {})) == "hello"

    # An upgrade the override still fits: a new description.  The drift quarantine holds it back as it always has;
    # once approved, the override applies to the new definition.
    upgrade.write_text("--schema-tag ' (v2)'")
    cli("tools")  # the upgraded server lists its new definition
    held = call_once("say", {})
    assert "changed its definition" in held and "coffer approve a__echo" in held
    cli("approve", "a__echo")
    after = listed_once()
    assert after["say"].description == "Echo the given text back (v2)" and after["say"].input_schema[
        "properties"] == {}
    assert text_of(call_once("say", {})) == "hello"
    assert cli_json("show", "a")["overrides"][0]["fits"] is True

    # An upgrade that breaks it: the fixed parameter is renamed.  Approved, the tool is held back, never listed
    # without its fixed argument; `show` and `doctor` say why and what to do.
    upgrade.write_text("--schema-tag ' (v3)' --echo-param message")
    cli("tools")
    cli("approve", "a__echo")
    broken = listed_once()
    assert "say" not in broken and "a__echo" not in broken
    for name in ("say", "a__echo"):
        refusal = call_once(name, {"message": "hi"})
        assert isinstance(refusal, str) and "held back" in refusal and "'text'" in refusal, refusal
    shown = cli_json("show", "a")["overrides"][0]
    assert shown["fits"] is False and "'text'" in shown["problem"] and "message" in shown["problem"]
    doctor = cli("doctor", "--json", check=False)
    assert doctor.returncode == 1
    problems = json.loads(doctor.stdout)["profiles"]["problems"]
    assert any("a__echo" in p["problem"] and "--clear" in p["fix"] for p in problems)
    assert "no longer fits" in cli("show", "a").stdout

    # The user fixes it: the override moves to the new parameter, and the tool is back under its alias.
    cli("override", "a__echo", "--unfix", "text", "--fix", 'message="hello again"')
    assert text_of(call_once("say", {})) == "hello again"
    assert cli_json("doctor")["profiles"]["ok"] is True


def test_bad_profiles_and_overrides_are_refused_with_clear_errors_and_change_nothing(servers, tmp_path):
    cli("profile", "add", "coding", "--include", "a")
    before = (cli_json("profile", "list"), cli_json("override"), cli_json("audit")["audit"])
    refusals = {
        ("profile", "add", "bad name!", "--include", "a"): "invalid profile name",
        ("profile", "add", "p1"): "at least one --include",
        ("profile", "add", "p1", "--include", "githb"): "matches nothing",
        ("profile", "add", "p1", "--include", "a", "--exclude", "a__ech"): "did you mean a__echo",
        ("profile", "add", "p1", "--include", "nosuch__*"): "no server named 'nosuch'",
        ("profile", "add", "p1", "--include", "a", "--pin", "time__get_current_time"): "outside the profile",
        ("profile", "add", "p1", "--include", "a", "--pin", "a__nope"): "no tool of that name",
        ("profile", "add", "p1", "--include", "a", "--knowledge", "notes"): "no knowledge source",
        ("profile", "add", "p1", "--include", "a", "--expose", "sometimes"): "expose must be",
        ("profile", "add", "coding", "--include", "time"): "--replace",
        ("profile", "show", "nope"): "unknown profile",
        ("profile", "rm", "nope"): "unknown profile",
        ("override", "a__nope", "--name", "x"): "unknown tool",
        ("override", "a__echo"): None,  # shows (no override): not a change, not an error
        ("override", "a__echo", "--fix", "nope=1"): "has no parameter 'nope'",
        ("override", "a__echo", "--fix", "text=3"): "text must be string, not integer",
        ("override", "a__echo", "--fix", "text={bad"): "not JSON",
        ("override", "a__echo", "--name", "a__slow"): "name of another tool",
        ("override", "a__echo", "--name", "time__echo"): "own server's prefix",
        ("override", "a__echo", "--name", "x" * 80): "bad --name",
        ("override", "a__echo", "--annotation", "loud=true"): "unknown annotation",
        ("override", "a__echo", "--annotation", "readOnly=maybe"): "expected KEY=true",
        ("override", "a__echo", "--profile", "nope", "--name", "x"): "unknown profile",
        ("override", "a__echo", "--unfix", "text"): "it is not fixed",
        ("override", "a__echo", "--clear"): "has no override",
        ("override", "a__echo", "--name", "x", "--clear"): "give it alone",
        ("install", "claude-code", "--profile", "nope"): "unknown profile",
        ("serve", "--profile", "nope"): "unknown profile",
    }
    for args, expected in refusals.items():
        proc = cli(*args, check=False)
        if expected is None:
            assert proc.returncode == 0, proc.stderr
            continue
        assert proc.returncode == 1 and expected in proc.stderr, (args, proc.stderr)
        assert proc.stderr.startswith("coffer: error:") and "Traceback" not in proc.stderr
    cli("override", "time__get_current_time", "--name", "now")
    taken = cli("override", "a__echo", "--name", "now", check=False)
    assert taken.returncode == 1 and "already the alias of time__get_current_time" in taken.stderr
    cli("override", "time__get_current_time", "--clear")
    after = (cli_json("profile", "list"), cli_json("override"), cli_json("audit")["audit"])
    assert after[0] == before[0] and after[1] == before[1]
    assert [r["action"] for r in after[2][len(before[2]):]] == ["override", "override-clear"]


def test_json_everywhere_and_an_install_entry_for_a_profile(servers, tmp_path):
    cli("profile", "add", "coding", "--include", "a", "--pin", "a__echo", "--expose", "search")
    added = cli_json("profile", "add", "research", "--include", "time", "time__*")
    assert added == {"profile": {"name": "research", "include": ["time", "time__*"], "exclude": [], "expose": None,
                                 "pin": [], "knowledge": []}, "replaced": False, "warnings": []}
    assert [p["name"] for p in cli_json("profile", "list")["profiles"]] == ["coding", "research"]
    override = cli_json("override", "a__echo", "--profile", "coding", "--description", "Say it back")
    assert override["profile"] == "coding" and override["effective"]["description"] == "Say it back"
    shown = cli_json("profile", "show", "coding")
    assert shown["tools"] == ["a__big", "a__crash", "a__echo", "a__fail", "a__sample", "a__slow"]
    assert shown["overrides"][0]["description"] == "Say it back"
    listed = cli_json("tools", "--cached", "--profile", "coding")
    assert [t["name"] for t in listed["tools"]] == ["coffer__search_tools", "a__echo"]  # expose search, a pin
    assert cli_json("override")["overrides"][0]["tool"] == "a__echo"

    # Expose search, but a pin is always listed; the profile's own description is what its client sees.
    tools = listed_once("coding")
    assert set(tools) == {"coffer__search_tools", "a__echo"} and tools["a__echo"].description == "Say it back"
    assert listed_once()["a__echo"].description == "Echo the given text back"  # not outside the profile

    home = tmp_path / "user-home"
    home.mkdir()
    cli("install", "claude-code", "--profile", "coding", env={"HOME": str(home), "USERPROFILE": str(home)})
    entry = json.loads((home / ".claude.json").read_text())["mcpServers"]["coffer"]
    assert entry["args"][-3:] == ["serve", "--profile", "coding"]
    removed = cli_json("profile", "rm", "coding")
    assert removed == {"removed": "coding", "overrides_removed": 1}


def test_knowledge_sources_are_included_per_profile(servers, tmp_path):
    for name, text in (("notes", "The deploy key rotates every Tuesday."), ("secret", "The vault code is 4711.")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "fact.md").write_text(f"# Fact\n\n{text}\n")
        cli("knowledge", "add", str(folder), "--name", name)
    cli("profile", "add", "reader", "--include", "time", "--knowledge", "notes")
    cli("profile", "add", "plain", "--include", "time")
    seen = {}

    async def body(stack):
        reader = await connect(stack, "reader")
        plain = await connect(stack, "plain")
        seen["reader tools"] = names(await reader.list_tools())
        seen["plain tools"] = names(await plain.list_tools())
        answer = await reader.call_tool("coffer__ask", {"question": "when does the key rotate or what is the code"})
        seen["passages"] = {p["source"] for p in answer.structured_content["passages"]}
        seen["outside"] = await reader.call_tool("coffer__ask", {"question": "code", "sources": ["secret"]})
        seen["plain ask"] = await refused(plain.call_tool("coffer__ask", {"question": "code"}))

    run(body)
    assert "coffer__ask" in seen["reader tools"] and "coffer__remember" not in seen["reader tools"]
    assert "coffer__ask" not in seen["plain tools"]
    assert seen["passages"] == {"notes"}
    assert seen["outside"].is_error and "'secret' is not in profile 'reader'" in text_of(seen["outside"])
    assert "profile 'plain'" in seen["plain ask"]


@needs_node
def test_prompts_and_resources_follow_the_profile_with_server_everything(home):
    cli("add", "everything", "--", *everything_cmd())
    cli("tools")
    cli("profile", "add", "demo", "--include", "everything__echo", "everything__simple-prompt",
        "demo://resource/static/document/a*")
    seen = {}

    async def body(stack):
        demo = await connect(stack, "demo")
        everything = await connect(stack)
        seen["tools"] = names(await demo.list_tools())
        seen["prompts"] = {p.name for p in (await demo.list_prompts()).prompts}
        seen["resources"] = {str(r.uri) for r in (await demo.list_resources()).resources}
        seen["all resources"] = {str(r.uri) for r in (await everything.list_resources()).resources}
        seen["prompt"] = await demo.get_prompt("everything__simple-prompt")
        inside = sorted(seen["resources"])[0]
        seen["read"] = await demo.read_resource(inside)
        outside = sorted(seen["all resources"] - seen["resources"])[0]
        seen["read outside"] = await refused(demo.read_resource(outside))
        seen["template outside"] = await refused(demo.read_resource("demo://resource/dynamic/text/1"))
        seen["prompt outside"] = await refused(demo.get_prompt("everything__args-prompt", {"city": "Paris"}))

    run(body)
    assert seen["tools"] == {"coffer__search_tools", "everything__echo"}
    assert seen["prompts"] == {"everything__simple-prompt"}
    assert seen["resources"] and all(uri.startswith("demo://resource/static/document/a") for uri in seen["resources"])
    assert seen["all resources"] > seen["resources"]
    assert seen["prompt"].messages and seen["read"].contents
    for key in ("read outside", "template outside", "prompt outside"):
        assert "profile 'demo'" in seen[key], seen[key]


def test_profiles_and_overrides_survive_in_the_vault_across_processes(servers):
    """Stored once, read by every later process: the CLI and a fresh gateway see the same."""
    cli("profile", "add", "coding", "--include", "a", "--exclude", "a__crash")
    cli("override", "a__echo", "--profile", "coding", "--name", "repeat", "--fix", "text=ok")
    assert "repeat" in listed_once("coding") and "repeat" not in listed_once()
    assert text_of(call_once("repeat", {}, "coding")) == "ok"
    db = Path(os.environ["COFFER_HOME"]) / "coffer.db"
    assert db.exists()
    rows = cli_json("override")["overrides"]
    assert rows == [{"tool": "a__echo", "server": "a", "upstream_name": "echo", "profile": "coding",
                     "name": "repeat", "fixed": {"text": "ok"}, "fits": True, "problem": None,
                     "effective": rows[0]["effective"]}]
    assert rows[0]["effective"]["name"] == "repeat" and rows[0]["effective"]["inputSchema"]["properties"] == {}
