"""Issue 23, hostile input: what an attacker still got through (items 1-7), each against the real ``coffer serve``:
the official MCP SDK client where a client is involved, raw JSON-RPC lines where the SDK would hide the bytes."""

import hashlib
import json
import os

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import COFFER, HOSTILE, PY, cli

CONTROL_CHARS = frozenset(chr(c) for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0)])


def add_hostile(name, *modes, opts=(), extra=()):
    cli("add", name, *opts, "--", *HOSTILE, "--mode", ",".join(modes) or "none", "--name", name, *extra)


def gateway_params(env=None):
    return StdioServerParameters(command=PY, args=[COFFER, "serve"], env={**os.environ, **(env or {})})


def run(body, env=None, **client_kwargs):
    async def main():
        async with Client(gateway_params(env), client_info=types.Implementation(name="hostile-23", version="1"),
                          **client_kwargs) as client:
            return await body(client)
    return anyio.run(main)


def text_of(result):
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


async def all_tools(client):
    """Every tool, following nextCursor as a careful client does."""
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


# -- 1. a request that is never answered ---------------------------------------------------------------------------

def test_a_request_with_bytes_that_are_not_utf8_is_answered_under_its_own_id(home, raw_gateway):
    add_hostile("h")
    gw = raw_gateway()
    gw.initialize()
    head = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"h__echo","arguments":{"text":"a'
    gw.send_raw(head + b"\xed\xa0\x80" + b'b"}}}\n')   # an encoded surrogate: valid JSON, invalid UTF-8
    reply = gw.wait_response(7, timeout=20)
    assert reply["error"]["code"] == -32700, reply
    # a batch: every request in it is answered under its id, the notification in it is not
    gw.send_raw(b'[{"jsonrpc":"2.0","id":"a","method":"ping","params":{"x":"\xff"}},'
                b'{"jsonrpc":"2.0","method":"notifications/x"},{"jsonrpc":"2.0","id":"b","method":"ping"}]\n')
    assert gw.wait_response("a", timeout=20)["error"]["code"] == -32700
    assert gw.wait_response("b", timeout=20)["error"]["code"] == -32700
    # NaN is not JSON either: the same
    gw.send_raw(b'{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"h__echo","arguments":{"n":NaN}}}\n')
    assert gw.wait_response(8, timeout=20)["error"]["code"] == -32700
    assert gw.request("tools/call", {"name": "h__echo", "arguments": {"text": "still here"}}
                      )["result"]["content"][0]["text"] == "still here"


# -- 4 and 5. search returns what tools/list shows; no control character from an upstream reaches a client ---------

LISTED_FIELDS = ("name", "title", "description", "inputSchema", "outputSchema", "annotations")


def strings_in(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


def assert_no_controls(value, where):
    found = {c for text in strings_in(value) for c in text if c in CONTROL_CHARS}
    assert not found, f"{where} carries control characters {sorted(map(repr, found))}: {str(value)[:400]}"


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
def test_search_returns_exactly_the_definitions_tools_list_shows(home, mode):
    add_hostile("h", "shapes")

    async def body(client):
        listed = {t.name: t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in await all_tools(client)}
        found = await client.call_tool("coffer__search_tools", {"query": "list of numbers listy", "top_k": 3})
        listy = await client.call_tool("h__listy", {"n": 2})
        return listed, found, listy

    listed, found, listy = run(body, mode=mode)
    assert not found.is_error, text_of(found)
    hits = {t["name"]: t for t in found.structured_content["tools"]}
    assert "h__listy" in hits, hits.keys()
    shown, searched = listed["h__listy"], hits["h__listy"]
    assert {k: searched.get(k) for k in LISTED_FIELDS} == {k: shown.get(k) for k in LISTED_FIELDS}
    assert isinstance(searched["score"], (int, float))
    if mode == "legacy":  # a handshake-era client gets the array schema wrapped, in the list and in search alike
        assert searched["outputSchema"]["type"] == "object" and "result" in searched["outputSchema"]["properties"]
        assert listy.structured_content == {"result": [1, 2]}
    else:
        assert searched["outputSchema"]["type"] == "array"


def test_control_characters_never_reach_the_client_in_names_titles_or_descriptions(home):
    add_hostile("h", "shapes", "ansi")

    async def body(client):
        tools = await all_tools(client)
        prompts = (await client.list_prompts()).prompts
        resources = (await client.list_resources()).resources
        found = await client.call_tool("coffer__search_tools", {"query": "harmless list numbers painted", "top_k": 20})
        return tools, prompts, resources, found

    tools, prompts, resources, found = run(body, mode="legacy")
    names = [t.name for t in tools]
    assert "h__listy" in names and "h__painted" in names, names
    for label, items in (("tools/list", tools), ("prompts/list", prompts), ("resources/list", resources)):
        assert_no_controls([i.model_dump(mode="json", by_alias=True, exclude_none=True) for i in items], label)
    assert_no_controls(found.structured_content, "coffer__search_tools")
    listy = next(t for t in tools if t.name == "h__listy")
    assert "second line\twith a tab" in listy.description and "\n" in listy.description  # newline and tab stay
    assert "\r" not in listy.description and "pwned-title" in listy.title  # the text stays, the escapes go
    prompt = next(p for p in prompts if p.name == "h__shaped_prompt")
    assert prompt.arguments[0].name == "who" and "\x1b" not in prompt.arguments[0].description


# -- 3. no tool silently hidden, whatever the collisions ----------------------------------------------------------

PREFIX = ("a_tool_name_that_an_upstream_made_long_on_purpose_" * 10)[:480]


def colliding_pair(prefix=PREFIX):
    """Two names sharing ``prefix`` whose shortened forms collide (the same 24-bit hash prefix), the later-sorted
    one first: (older, newer) with newer < older, so a rule that places names in sorted order gives the newcomer
    the established name."""
    seen = {}
    for i in range(5_000_000):
        name = f"{prefix}{i}"
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        if digest in seen:
            first, second = seen[digest], name
            return (max(first, second), min(first, second))
        seen[digest] = name
    raise AssertionError("no collision found")


def called(client_result):
    return text_of(client_result).removeprefix("called ")


def test_a_colliding_newcomer_never_takes_an_established_name_and_no_tool_is_hidden(home, tmp_path):
    older, newer = colliding_pair()
    crowd = [f"{PREFIX}crowd{i}" for i in range(1500)]  # many long names that share the prefix, too
    names_file = tmp_path / "names.json"
    names_file.write_text(json.dumps([older] + crowd))
    add_hostile("h", "collide", extra=("--names-file", str(names_file)))

    async def first(client):
        await client.call_tool("h__echo", {"text": "up"})  # h has started: its live list is the catalogue
        return {t.name for t in await all_tools(client)}

    before = run(first)

    async def find_older(client):
        for name in sorted(n for n in before if n.startswith("h__a_tool")):
            if called(await client.call_tool(name, {})) == older:
                return name
        raise AssertionError("the older tool is not listed")

    established = run(find_older)
    names_file.write_text(json.dumps([newer, older] + crowd))  # the newcomer: listed first, sorted first

    async def second(client):
        assert text_of(await client.call_tool("h__echo", {"text": "up"})) == "up"
        tools = [t.name for t in await all_tools(client)]
        reached = {name: called(await client.call_tool(name, {})) for name in tools
                   if name.startswith("h__a_tool")}
        return tools, reached

    tools, reached = run(second)
    assert len(tools) == len(set(tools)), "two tools share an exposed name"
    assert reached[established] == older, f"{established} was {older[-12:]}, now reaches {reached[established][-12:]}"
    assert sorted(reached.values()) == sorted([older, newer] + crowd), "a tool is hidden"
    assert all(len(name) <= 48 for name in tools), [name for name in tools if len(name) > 48]


# -- 2. a catalogue too big for one message --------------------------------------------------------------------------

def audit_rows(*args):
    return json.loads(cli("audit", "--json", "--limit", "100000", *args).stdout)["audit"]


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
def test_a_huge_catalogue_is_paginated_in_both_eras_and_audited_in_one_row(home, mode):
    add_hostile("h", "many", extra=("--count", "9997"))  # with echo, env and crash: 10,000 tools

    async def body(client):
        await client.call_tool("h__echo", {"text": "up"})
        first = await client.list_tools()
        every = await all_tools(client)
        last = await client.call_tool("h__many_9996", {})
        return first, every, last

    first, every, last = run(body, mode=mode)
    assert first.next_cursor, "10,000 tools came in one unpaginated message"
    assert len(first.tools) <= 1000
    names = [t.name for t in every]
    assert len(names) == len(set(names)) == 10_001  # every tool once, and coffer__search_tools
    assert names[0] == "coffer__search_tools"  # a client that reads only the first page still finds the rest
    assert text_of(last) == "called many_9996"
    added = [row for row in audit_rows("--server", "h") if row["action"] == "upstream-added"]
    assert len(added) == 1, f"{len(added)} upstream-added rows for one server's first catalogue"
    assert "10000 tools" in added[0]["detail"] and "many_0" in added[0]["detail"]


def test_a_client_that_ignores_cursors_is_served_and_forged_cursors_are_refused(home, raw_gateway):
    cli("config", "list_page_size", "50")
    add_hostile("h", "many", extra=("--count", "197"))
    gw = raw_gateway()
    init = gw.initialize()
    gw.request("tools/call", {"name": "h__echo", "arguments": {"text": "up"}})
    first = gw.request("tools/list")["result"]
    again = gw.request("tools/list")["result"]
    assert [t["name"] for t in first["tools"]] == [t["name"] for t in again["tools"]]  # no cursor: page 1, always
    assert len(first["tools"]) == 50 and first["nextCursor"]
    # a tool on a later page is callable by name, and search finds it
    reply = gw.request("tools/call", {"name": "h__many_190", "arguments": {}})
    assert reply["result"]["content"][0]["text"] == "called many_190"
    found = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": "generated tool 190"}})
    assert "h__many_190" in [t["name"] for t in found["result"]["structuredContent"]["tools"]]
    # the instructions a client reads at initialize (remembered catalogue or not) name the search tool
    assert "coffer__search_tools" in init["result"]["instructions"]
    cursor = first["nextCursor"]
    offset_forged = cursor.split(".")
    offset_forged[1] = "150"
    for forged in ("not-a-cursor", cursor + "x", cursor[:-1] + ("0" if cursor[-1] != "0" else "1"),
                   ".".join(offset_forged), "x" * 1_000_000, 12, {"offset": 1}, cursor.replace("tools", "prompts")):
        reply = gw.request("tools/list", {"cursor": forged})
        assert reply.get("error", {}).get("code") == -32602, (str(forged)[:80], reply)
    reply = gw.request("prompts/list", {"cursor": cursor})  # a tools cursor is no prompts cursor
    assert reply["error"]["code"] == -32602
    # the real cursor still works after all that, and the pages add up to the whole list
    names, cursor = [t["name"] for t in first["tools"]], first["nextCursor"]
    while cursor:
        page = gw.request("tools/list", {"cursor": cursor})["result"]
        names += [t["name"] for t in page["tools"]]
        cursor = page.get("nextCursor")
    assert len(names) == len(set(names)) == 201
    other = raw_gateway()  # another Coffer process: its cursors are not this one's
    other.initialize()
    assert other.request("tools/list", {"cursor": first["nextCursor"]})["error"]["code"] == -32602


def test_a_page_cursor_resumes_after_its_item_when_the_list_changed_meanwhile():
    from coffer_src.gateway.pages import check_cursor, page_of

    items = [{"name": f"t{i}"} for i in range(10)]
    first = page_of("tools", items, None, 4)
    assert [t["name"] for t in first["tools"]] == ["t0", "t1", "t2", "t3"]
    position = check_cursor("tools", first["nextCursor"])
    changed = [{"name": "new"}] + [t for t in items if t["name"] != "t1"]   # one added before, one removed
    second = page_of("tools", changed, position, 4)
    assert [t["name"] for t in second["tools"]] == ["t4", "t5", "t6", "t7"]  # nothing repeated, nothing skipped
    gone = [t for t in items if t["name"] != "t3"]  # the item the page ended on is gone: continue at its place
    assert [t["name"] for t in page_of("tools", gone, position, 4)["tools"]] == ["t4", "t5", "t6", "t7"]


# -- 6. a token reaches the agent --------------------------------------------------------------------------------------

GITHUB_TOKEN = "ghp_" + "A1b2C3d4" * 4          # given literally to --env: moved to the store, resolved at start
DEPLOY_KEY = "dk_" + "Qw3Er4Ty5" * 3            # a ${DEPLOY_KEY} resolved from Coffer's own environment
STORED_ONLY = "sk-live-" + "Zz9Yy8Xx7" * 3      # in the store, used by no server


def secret_set(name, value):
    import subprocess
    subprocess.run([PY, COFFER, "secret", "set", name], input=value, text=True, check=True, capture_output=True)


def test_known_secret_values_never_reach_the_client_unless_the_server_opts_out(home):
    cli("add", "h", "--env", f"GITHUB_TOKEN={GITHUB_TOKEN}", "--env", "DEPLOY_KEY=${DEPLOY_KEY}", "--",
        *HOSTILE, "--mode", "leak", "--name", "h")
    secret_set("OTHER_API_KEY", STORED_ONLY)
    env = {"DEPLOY_KEY": DEPLOY_KEY}
    logs = []

    async def on_log(params):
        logs.append(params)

    async def body(client):
        await client.set_logging_level("debug")
        seen = {}
        for how in ("result", "split", "log", "escaped"):
            seen[how] = text_of(await client.call_tool("h__leak", {"var": "GITHUB_TOKEN", "how": how}))
        seen["env"] = text_of(await client.call_tool("h__env", {}))
        seen["deploy"] = text_of(await client.call_tool("h__leak", {"var": "DEPLOY_KEY"}))
        seen["echo"] = text_of(await client.call_tool("h__echo", {"text": f"stored: {STORED_ONLY}"}))
        try:
            await client.call_tool("h__leak", {"var": "GITHUB_TOKEN", "how": "error"})
            seen["error"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the SDK raises the JSON-RPC error
            seen["error"] = f"{exc} {getattr(getattr(exc, 'error', None), 'data', '')}"
        return seen

    seen = run(body, env=env, mode="legacy", logging_callback=on_log)
    everything = json.dumps(seen) + json.dumps([log.model_dump(mode="json") for log in logs])
    for secret in (GITHUB_TOKEN, DEPLOY_KEY, STORED_ONLY, GITHUB_TOKEN[:len(GITHUB_TOKEN) // 2]):
        assert secret not in everything, f"{secret[:8]}... reached the client: {everything[:600]}"
    assert seen["result"] == seen["escaped"] == "the value is ***" and seen["split"] == "the value is ***."
    assert "***" in seen["env"] and "***" in seen["error"] and seen["echo"] == "stored: ***"
    assert any("***" in json.dumps(log.data) for log in logs), logs

    cli("config", "redact.h", "off")  # a server whose job is to return secrets

    async def opted_out(client):
        return text_of(await client.call_tool("h__leak", {"var": "GITHUB_TOKEN"}))

    assert run(opted_out, env=env) == f"the value is {GITHUB_TOKEN}"


# -- 7. tokens in command arguments ------------------------------------------------------------------------------------

ARG_TOKEN = "ghp_" + "Zq8Wx7Ev6" * 4


def vault_bytes(home):
    return b"".join(path.read_bytes() for path in home.glob("coffer.db*"))


def test_a_token_in_command_arguments_moves_to_the_store_and_is_never_printed(home, tmp_path):
    added = cli("add", "x", "--", *HOSTILE, "--mode", "argv", "--name", "x", "--token", ARG_TOKEN)
    said = added.stdout + added.stderr
    assert ARG_TOKEN not in said
    assert "${X_TOKEN}" in said and "ps" in said and "--env" in said, said  # where it went, and the warning
    for args in (("list",), ("list", "--json"), ("show", "x"), ("show", "x", "--json"), ("audit",),
                 ("audit", "--json")):
        shown = cli(*args)
        assert ARG_TOKEN not in shown.stdout + shown.stderr, f"`coffer {' '.join(args)}` shows the token"
    assert ARG_TOKEN.encode() not in vault_bytes(home)
    cli("config", "redact.x", "off")  # to see exactly what the server was started with

    async def body(client):
        return json.loads(text_of(await client.call_tool("x__argv", {})))

    assert run(body)[-2:] == ["--token", ARG_TOKEN]  # the server still gets it, as an argument
    cli("remove", "x")
    assert ARG_TOKEN.encode() not in vault_bytes(home)

    # an imported entry with a token in its args: the same, and the plan never prints it
    config = tmp_path / "claude_desktop_config.json"
    config.write_text(json.dumps({"mcpServers": {"gh": {"command": "docker", "args": [
        "run", "-i", "--rm", "-e", f"GITHUB_PERSONAL_ACCESS_TOKEN={ARG_TOKEN}", "ghcr.io/github/github-mcp-server"]}}}))
    for extra in (("--dry-run",), ("--dry-run", "--json"), ()):
        planned = cli("import", str(config), *extra)
        assert ARG_TOKEN not in planned.stdout + planned.stderr
    assert "GH_GITHUB_PERSONAL_ACCESS_TOKEN" in planned.stdout and "ps" in planned.stdout, planned.stdout
    assert ARG_TOKEN.encode() not in vault_bytes(home)
    shown = json.loads(cli("show", "gh", "--json").stdout)
    assert "GITHUB_PERSONAL_ACCESS_TOKEN=${GH_GITHUB_PERSONAL_ACCESS_TOKEN}" in shown["command"]
