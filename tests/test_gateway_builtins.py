"""Coffer's own tools: coffer__search_tools, coffer__ask and coffer__remember (issue 14) end to end with the
official SDK client (the user's folder is a real folder, memory a real note, the client's model a callback), and
the tool budget a client that caps its list gets."""

import json
import os
import sys
import time
import uuid
from pathlib import Path

import anyio
import mcp_types as types
import pytest

from conftest import FAKE, cli, sdk_session, tool_names


def test_search_tool_contract_through_the_gateway(raw_gateway, home):
    """Through `coffer serve`: structuredContent plus a JSON text block, bad arguments as isError results."""
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    gw = raw_gateway()
    gw.initialize()

    def search(arguments):
        return gw.request("tools/call", {"name": "coffer__search_tools", "arguments": arguments})["result"]

    result = search({"query": "echo the text back", "top_k": 2})
    payload = result["structuredContent"]
    assert json.loads(result["content"][0]["text"]) == payload
    assert payload["total_searched"] == 3 and payload["tools"][0]["name"] == "fx__echo"
    assert set(payload["tools"][0]) == {"name", "description", "inputSchema", "score"}
    assert len(search({"query": "echo", "top_k": 5.0})["structuredContent"]["tools"]) >= 1
    for bad in ({"query": ""}, {"query": 3}, {"query": "x", "top_k": "5"}, {"query": "x", "top_k": 2.5},
                {"query": "x", "top_k": True}, {}):
        assert search(bad).get("isError") is True, bad


def test_a_2026_client_gets_the_same_search_reply_with_its_era_fields(raw_gateway, home):
    """A 2026-07-28 client's search reply is the payload a handshake-era client gets, plus resultType and Coffer's
    serverInfo; the reply is written from the search's own encoded text, and that text must be the same message
    its dict would make."""
    from coffer_src.gateway.builtins import search_tools_result
    from coffer_src.jsonrpc import EncodedResult, dumps, encode_line, rpc_result
    from coffer_src.modern import META_SERVER_INFO, shape_modern_result

    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    envelope = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
                "io.modelcontextprotocol/clientInfo": {"name": "modern-client", "version": "1"}}
    gw = raw_gateway()
    gw.request("server/discover", {"_meta": envelope})
    result = gw.request("tools/call", {"name": "coffer__search_tools", "_meta": envelope,
                                       "arguments": {"query": "echo the text back", "top_k": 2}})["result"]
    assert result["resultType"] == "complete" and result["_meta"][META_SERVER_INFO]["name"] == "coffer"
    payload = result["structuredContent"]
    assert json.loads(result["content"][0]["text"]) == payload and payload["tools"][0]["name"] == "fx__echo"

    tool = {"name": "fx__echo", "description": 'say "hi" \\ \u2028', "inputSchema": {"type": "object"}}
    built = search_tools_result([{**tool, "score": 1.5}], [dumps({**tool, "score": 1.5})], 3, "bm25")
    shaped = shape_modern_result("tools/call", built)
    assert type(shaped) is EncodedResult and shaped.json is not None  # written from its text
    assert encode_line(rpc_result(7, shaped)) == encode_line(rpc_result(7, dict(shaped)))
    assert dict(shaped) == shape_modern_result("tools/call", dict(built))


@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
def test_a_secret_in_a_tool_definition_is_redacted_from_every_search_reply(raw_gateway, home, era):
    """An upstream whose tool description holds a stored secret (one JSON escapes, too): the search reply, its
    structured payload and its text block alike, carries *** in its place, in either era."""
    import subprocess
    secret = 'sk-"quoted\\' + uuid.uuid4().hex
    subprocess.run([sys.executable, str(Path(__file__).parent.parent / "coffer.py"), "secret", "set", "FX_API_KEY"],
                   input=secret, text=True, check=True, capture_output=True)
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow", "--schema-tag", f"(token {secret})")
    envelope = {"io.modelcontextprotocol/protocolVersion": era, "io.modelcontextprotocol/clientCapabilities": {},
                "io.modelcontextprotocol/clientInfo": {"name": "c", "version": "1"}}
    gw = raw_gateway()
    if era == "2026-07-28":
        gw.request("server/discover", {"_meta": envelope})
    else:
        gw.initialize()
    reply = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": "echo the text"},
                                      **({"_meta": envelope} if era == "2026-07-28" else {})})
    result = reply["result"]
    shown = [tool["description"] for tool in result["structuredContent"]["tools"] if tool["name"] == "fx__echo"]
    texts = [tool["description"] for tool in json.loads(result["content"][0]["text"])["tools"]
             if tool["name"] == "fx__echo"]
    assert shown == texts and "(token ***)" in shown[0], shown

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, (dict, list)):
            for item in (value.items() if isinstance(value, dict) else value):
                yield from strings(item)
    assert not any(secret in text for text in strings([reply, json.loads(result["content"][0]["text"])]))


ODD_SERVER = r"""
import json, sys
TOOLS = [
    {"name": "quote", "description": "Say \"hi\" back \\ with\u2028odd text, na\u00efve \u65e5\u672c",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string", "description": "tab\there"}}}},
    {"name": "scored", "score": "its own", "description": "Say hi with a score field of its own",
     "inputSchema": {"type": "object"}},
    {"name": "listing", "description": "Say hi as a list", "inputSchema": {"type": "object"},
     "outputSchema": {"type": "array", "items": {"type": "string"}}},
    {"name": "lone", "description": "Say hi \ud800 alone", "inputSchema": {"type": "object"}},
]
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg["method"] == "initialize":
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "odd", "version": "1"}}
    elif msg["method"] == "tools/list":
        result = {"tools": TOOLS}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"""


def test_search_results_are_the_tools_as_listed_and_their_text_is_that_json(home, raw_gateway, tmp_path):
    """The text block is, character for character, the compact JSON of structuredContent, whatever the tools'
    definitions hold (quotes, line separators, non-ASCII; a lone surrogate, which listing replaces); each tool is
    as tools/list shows it (a handshake-era client gets an array outputSchema wrapped), with its score -- which
    replaces a field of that name in its place -- and asking again gives the same reply."""
    server = tmp_path / "odd_server.py"
    server.write_text(ODD_SERVER)
    cli("add", "odd", "--", sys.executable, str(server))
    gw = raw_gateway()
    gw.initialize()
    listed = {tool["name"]: tool for tool in gw.request("tools/list")["result"]["tools"]}

    def search():
        return gw.request("tools/call", {"name": "coffer__search_tools",
                                         "arguments": {"query": "say hi", "top_k": 10}})["result"]

    result = search()
    payload = result["structuredContent"]
    assert result["content"][0]["text"] == json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    found = {tool["name"]: tool for tool in payload["tools"]}
    assert set(found) == {"odd__quote", "odd__scored", "odd__listing", "odd__lone"}
    for name, tool in found.items():
        assert isinstance(tool["score"], float) and tool["score"] > 0
        assert {k: v for k, v in tool.items() if k != "score"} == {k: v for k, v in listed[name].items()
                                                                   if k != "score"}
    assert list(found["odd__scored"]) == list(listed["odd__scored"])      # its own "score" key, in its place
    assert found["odd__listing"]["outputSchema"]["type"] == "object"      # wrapped, as tools/list shows it
    assert search() == result


# -- the tool budget ---------------------------------------------------------------------------------------------------

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


# -- coffer__ask and coffer__remember ----------------------------------------------------------------------------------

def run(body, name="ask-agent", **client_kwargs):
    return sdk_session(body, name=name, **client_kwargs)


def structured(result):
    return result.structured_content or json.loads(result.content[0].text)


def test_ask_and_remember_are_listed_only_when_there_is_something_to_ask(home, tmp_path):
    cli("add", "s", "--", *FAKE, "--tools", "echo")

    async def names(client):
        return [t.name for t in (await client.list_tools()).tools], client.instructions

    tools, instructions = run(names)
    assert "coffer__ask" not in tools and "coffer__remember" not in tools and "coffer__ask" not in instructions
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nSomething.\n")
    cli("knowledge", "add", str(docs))
    tools, instructions = run(names)
    assert "coffer__ask" in tools and "coffer__remember" not in tools and "coffer__ask" in instructions
    cli("config", "memory", "on")
    tools, _ = run(names)
    assert "coffer__remember" in tools

    async def search(client):  # built-in tools are never search results
        return structured(await client.call_tool("coffer__search_tools", {"query": "ask notes remember"}))
    assert all(not t["name"].startswith("coffer__") for t in run(search)["tools"])


def test_a_folder_is_searched_and_an_edit_is_seen_without_a_restart(home, tmp_path):
    docs = tmp_path / "handbook"
    docs.mkdir()
    (docs / "deploy.md").write_text("# Deploying\n\nShip a release with `make ship` from the main branch.\n\n"
                                    "## Rollback\n\nIf a release breaks, run `make undo VERSION=<tag>`.\n")
    (docs / "team.rst").write_text("Team\n====\n\nThe on-call rota lives in the wiki under Operations.\n")
    cli("knowledge", "add", str(docs), "--name", "handbook")

    async def body(client):
        first = structured(await client.call_tool("coffer__ask", {"question": "how do I undo a broken release?"}))
        (docs / "deploy.md").write_text("# Deploying\n\nShip a release with `make ship` from the main branch.\n\n"
                                        "## Rollback\n\nIf a release breaks, run `coffer-revert --to <tag>`.\n")
        deadline = time.monotonic() + 20
        while True:
            again = structured(await client.call_tool("coffer__ask", {"question": "what to run if a release breaks",
                                                                      "top_k": 1}))
            if "coffer-revert" in again["passages"][0]["text"] or time.monotonic() > deadline:
                return first, again
            await anyio.sleep(0.1)

    first, again = run(body)
    top = first["passages"][0]
    assert top["source"] == "handbook" and top["path"] == "deploy.md" and "make undo" in top["text"]
    assert top["heading"].endswith("Rollback") and top["lines"][0] >= 5
    assert first["total_searched"] >= 3 and "answer" not in first      # no sampling: passages only
    assert "coffer-revert" in again["passages"][0]["text"] and len(again["passages"]) == 1


def test_memory_from_one_session_is_found_by_another_and_is_a_private_note(home, tmp_path):
    cli("config", "memory", "on")
    fact = f"The staging database runs on host db-stage-{uuid.uuid4().hex[:6]}."

    async def keep(client):
        return await client.call_tool("coffer__remember", {"text": fact, "tags": ["infra"]})

    kept = run(keep, name="claude-code")
    assert not kept.is_error
    notes = list((Path(home) / "memory").glob("*.md"))
    assert len(notes) == 1
    note = notes[0].read_text()
    assert fact in note and "claude-code" in note and "infra" in note
    if os.name == "posix":
        assert oct(notes[0].stat().st_mode & 0o777) == "0o600"

    async def ask(client):
        return structured(await client.call_tool("coffer__ask", {"question": "where is the staging database?"}))

    found = run(ask, name="cursor")
    assert fact in found["passages"][0]["text"] and found["passages"][0]["source"] == "memory"
    listed = json.loads(cli("memory", "list", "--json").stdout)["memories"]
    assert [m["text"].strip() for m in listed] == [fact]
    cli("memory", "rm", listed[0]["id"])
    assert not list((Path(home) / "memory").glob("*.md"))


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_a_client_with_sampling_gets_an_answer_and_the_log_keeps_no_words(home, tmp_path, mode):
    marker = "MRK" + uuid.uuid4().hex[:10]
    docs = tmp_path / "notes"
    docs.mkdir()
    (docs / "wifi.md").write_text(f"# Office wifi\n\nThe guest network password is {marker}-pw.\n")
    cli("knowledge", "add", str(docs))
    prompts = []

    async def model(ctx, params):
        prompt = params.messages[0].content.text
        prompts.append(prompt)
        reply = "guest wifi password" if "search queries" in prompt else f"It is {marker}-pw [1]."
        return types.CreateMessageResult(role="assistant", model="test-model",
                                         content=types.TextContent(type="text", text=reply))

    async def body(client):
        return structured(await client.call_tool("coffer__ask", {"question": f"what is the wifi password {marker}?"}))

    answered = run(body, sampling_callback=model, mode=mode)
    assert answered["answer"] == f"It is {marker}-pw [1]." and len(prompts) == 2
    assert f"{marker}-pw" in answered["passages"][0]["text"]

    async def plain(client):
        return structured(await client.call_tool("coffer__ask", {"question": "wifi password"}))
    assert "answer" not in run(plain, mode=mode)                        # no sampling declared: no answer

    cli("config", "ask_synthesis", "off")
    answered = run(body, sampling_callback=model, mode=mode)
    assert "answer" not in answered and len(prompts) == 2               # switched off: the model is not asked

    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    asks = [r for r in rows if r["capability"] == "coffer__ask"]
    assert len(asks) == 3 and all(r["status"] == "ok" for r in asks)
    database = (Path(home) / "coffer.db").read_bytes() + b"".join(
        p.read_bytes() for p in Path(home).glob("coffer.db-*"))
    assert b"what is the wifi password" not in database and b"It is " + marker.encode() not in database


def test_a_model_that_fails_still_gets_the_passages(home, tmp_path):
    docs = tmp_path / "notes"
    docs.mkdir()
    (docs / "a.md").write_text("# Coffee\n\nThe coffee machine is descaled on Fridays.\n")
    cli("knowledge", "add", str(docs))

    async def broken(ctx, params):
        return types.ErrorData(code=-32603, message="model unavailable")

    async def body(client):
        return structured(await client.call_tool("coffer__ask", {"question": "when is the coffee machine descaled?"}))

    # A handshake-era client answers the sampling request with an error and still gets the passages.  (A
    # 2026-07-28 client's SDK gives up on the whole call when its own model fails an input_required round: that
    # client never retries, so there is nothing left for Coffer to answer.)
    answered = run(body, sampling_callback=broken, mode="legacy")
    assert "Fridays" in answered["passages"][0]["text"] and "answer" not in answered
