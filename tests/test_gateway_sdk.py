"""End to end: the official MCP Python SDK as the client, ``coffer serve`` in the middle, real published servers
(server-everything, server-memory, mcp-server-time) behind it.  What an agent sees is what is asserted."""

import json
import re
import uuid

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import (
    TIME_SERVER,
    Everything,
    answer_elicitation,
    answer_roots,
    answer_sampling,
    cli,
    everything_cmd,
    memory_cmd,
    needs_node,
    sdk_session,
    text_of,
)

pytestmark = needs_node


@pytest.fixture
def three_servers(home, tmp_path):
    cli("add", "time", "--", *TIME_SERVER)
    cli("add", "everything", "--", *everything_cmd())
    command, env = memory_cmd(tmp_path / "memory.jsonl")
    cli("add", "mem", *[f"--env={k}={v}" for k, v in env.items()], "--", *command)
    return home


def run(coro_fn, **client_kwargs):
    return sdk_session(coro_fn, name="e2e-agent", **client_kwargs)


def test_three_real_servers_are_aggregated_and_namespaced(three_servers):
    async def body(client):
        tools = [t.name for t in (await client.list_tools()).tools]
        prompts = [p.name for p in (await client.list_prompts()).prompts]
        resources = [r.uri for r in (await client.list_resources()).resources]
        templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
        return client.server_info.name, client.instructions, tools, prompts, resources, templates

    name, instructions, tools, prompts, resources, templates = run(body)
    assert name == "coffer"
    assert "coffer__search_tools" in instructions and len(instructions) <= 800
    for expected in ("coffer__search_tools", "time__get_current_time", "time__convert_time", "everything__echo",
                     "everything__get-sum", "mem__create_entities", "mem__read_graph"):
        assert expected in tools
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,48}", t) for t in tools)
    assert len(tools) == len(set(tools))
    assert "everything__simple-prompt" in prompts and "everything__completable-prompt" in prompts
    assert any(str(uri).startswith("demo://resource/static/") for uri in resources)
    assert "memory://knowledge-graph" not in templates  # a resource, never a template
    assert any("{resourceId}" in t for t in templates)


def test_calls_route_to_their_upstream_and_results_come_back_unchanged(three_servers):
    async def via_coffer(client):
        now = await client.call_tool("time__get_current_time", {"timezone": "UTC"})
        total = await client.call_tool("everything__get-sum", {"a": 2, "b": 40})
        structured = await client.call_tool("everything__get-structured-content", {"location": "New York"})
        await client.call_tool("mem__create_entities", {"entities": [
            {"name": "coffer-test-entity", "entityType": "thing", "observations": ["seen"]}]})
        graph = await client.call_tool("mem__read_graph", {})
        return now, total, structured, graph

    now, total, structured, graph = run(via_coffer)
    assert now.structured_content["timezone"] == "UTC" and not now.is_error
    assert "42" in text_of(total)
    assert structured.structured_content and "temperature" in json.dumps(structured.structured_content)
    assert "coffer-test-entity" in text_of(graph)

    async def direct():
        async with Client(StdioServerParameters(command=everything_cmd()[0], args=everything_cmd()[1:])) as c:
            return await c.call_tool("get-structured-content", {"location": "New York"})

    direct_result = anyio.run(direct)
    # Unchanged but for what MCP 2026-07-28 requires of every result: the serving server's identity in _meta.
    through = structured.model_dump()
    assert (through.pop("meta") or {}).get("io.modelcontextprotocol/serverInfo", {}).get("name") == "coffer"
    assert {k: v for k, v in direct_result.model_dump().items() if k != "meta"} == through


def test_sampling_elicitation_and_roots_are_relayed_to_the_client(three_servers):
    async def body(client):
        tools = [t.name for t in (await client.list_tools()).tools]
        sampled = await client.call_tool("everything__trigger-sampling-request", {"prompt": "hello", "maxTokens": 5})
        roots = await client.call_tool("everything__get-roots-list", {})
        elicited = await client.call_tool("everything__trigger-elicitation-request", {})
        return tools, sampled, roots, elicited

    tools, sampled, roots, elicited = run(body, sampling_callback=answer_sampling, list_roots_callback=answer_roots,
                                          elicitation_callback=answer_elicitation)
    # server-everything only offers these tools to clients that declared the capability: Coffer passed it up.
    assert "everything__trigger-sampling-request" in tools
    assert "relayed-by-the-client" in text_of(sampled)
    assert "coffer-project" in text_of(roots)
    assert "Ada" in text_of(elicited)


def test_progress_and_logging_flow_back_to_the_client(three_servers):
    progress, logs, log_arrived = [], [], []

    async def on_log(params):
        logs.append(params)
        for event in log_arrived:
            event.set()

    async def body(client):
        log_arrived.append(anyio.Event())
        await client.set_logging_level("debug")

        async def on_progress(value, total, message):
            progress.append(value)

        result = await client.call_tool("everything__trigger-long-running-operation", {"duration": 1, "steps": 4},
                                        progress_callback=on_progress)
        await client.call_tool("everything__toggle-simulated-logging", {})
        with anyio.fail_after(10):
            await log_arrived[0].wait()
        await client.call_tool("everything__toggle-simulated-logging", {})
        return result

    # logging/setLevel and logs sent between requests belong to the handshake era (2026-07-28 sends a request's
    # logs only while it runs, when it asked with logLevel), so this client speaks 2025-11-25.
    result = run(body, logging_callback=on_log, mode="legacy")
    assert not result.is_error
    assert len(progress) == 4 and progress == sorted(progress)
    assert logs and str(logs[0].logger).startswith("everything")


def test_prompts_resources_and_completions_route_to_the_right_server(three_servers):
    async def body(client):
        prompt = await client.get_prompt("everything__args-prompt", {"city": "Paris"})
        static = await client.read_resource("demo://resource/static/document/features.md")
        dynamic = await client.read_resource("demo://resource/dynamic/text/7")
        graph = await client.read_resource("memory://knowledge-graph")
        completion = await client.complete(types.PromptReference(type="ref/prompt",
                                                                 name="everything__completable-prompt"),
                                           {"name": "department", "value": "Eng"})
        return prompt, static, dynamic, graph, completion

    prompt, static, dynamic, graph, completion = run(body)
    assert "Paris" in json.dumps(prompt.model_dump())
    assert static.contents and str(static.contents[0].uri) == "demo://resource/static/document/features.md"
    assert "7" in json.dumps(dynamic.model_dump())
    assert graph.contents
    assert completion.completion.values == ["Engineering"]


def test_unknown_and_disabled_tools_are_readable_errors_and_the_session_goes_on(three_servers):
    cli("disable", "everything__echo")

    async def body(client):
        tools = [t.name for t in (await client.list_tools()).tools]
        errors = []
        for name in ("everything__echo", "nobody__nothing"):
            try:
                await client.call_tool(name, {"message": "hi"})
            except Exception as exc:  # noqa: BLE001 - the SDK raises on JSON-RPC errors
                errors.append(str(exc))
        ok = await client.call_tool("everything__get-sum", {"a": 1, "b": 1})
        return tools, errors, ok

    tools, errors, ok = run(body)
    assert "everything__echo" not in tools
    assert "disabled" in errors[0] and "coffer enable everything__echo" in errors[0]
    assert "Unknown tool" in errors[1] and "coffer__search_tools" in errors[1]
    assert "2" in text_of(ok)
    statuses = {(r["capability"], r["status"]) for r in json.loads(cli("log", "--json").stdout)["invocations"]}
    assert ("everything__echo", "denied") in statuses


def test_search_tools_finds_real_tools_by_intent(three_servers):
    async def body(client):
        results = {}
        for query in ("what time is it in a timezone", "add facts to the knowledge graph",
                      "sum two numbers"):
            result = await client.call_tool("coffer__search_tools", {"query": query, "top_k": 3})
            results[query] = result.structured_content
        bad = await client.call_tool("coffer__search_tools", {"query": "x", "top_k": "five"})
        return results, bad

    results, bad = run(body)
    top = {q: [t["name"] for t in r["tools"]] for q, r in results.items()}
    assert "time__get_current_time" in top["what time is it in a timezone"]
    assert set(top["add facts to the knowledge graph"]) & {"mem__add_observations", "mem__create_entities"}
    assert top["sum two numbers"][0] == "everything__get-sum"
    first = results["sum two numbers"]["tools"][0]
    assert first["inputSchema"]["properties"].keys() >= {"a", "b"} and first["score"] > 0
    assert all(r["total_searched"] >= 20 for r in results.values())
    assert all(not t.startswith("coffer__") for names in top.values() for t in names)
    assert bad.is_error


def test_every_call_is_logged_and_no_argument_or_result_is_stored(three_servers):
    marker = f"marker-{uuid.uuid4().hex}"
    numeric_marker = str(10**14 + uuid.uuid4().int % 10**14)  # server-everything's template wants a number

    async def body(client):
        await client.call_tool("everything__echo", {"message": marker})
        await client.call_tool("mem__create_entities", {"entities": [
            {"name": marker, "entityType": marker, "observations": [marker]}]})
        await client.call_tool("mem__search_nodes", {"query": marker})
        await client.get_prompt("everything__args-prompt", {"city": marker})
        await client.read_resource(f"demo://resource/dynamic/text/{numeric_marker}")
        await client.call_tool("coffer__search_tools", {"query": marker})

    run(body)
    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    seen = [(r["client"], r["capability"], r["kind"], r["status"]) for r in rows]
    assert seen == [
        ("e2e-agent", "everything__echo", "tool", "ok"),
        ("e2e-agent", "mem__create_entities", "tool", "ok"),
        ("e2e-agent", "mem__search_nodes", "tool", "ok"),
        ("e2e-agent", "everything__args-prompt", "prompt", "ok"),
        ("e2e-agent", "demo://resource/dynamic/text/{resourceId}", "resource", "ok"),
        ("e2e-agent", "coffer__search_tools", "tool", "ok"),
    ]
    assert all(r["duration_ms"] >= 0 and r["ts"] for r in rows)
    for path in three_servers.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert marker.encode() not in data and numeric_marker.encode() not in data, f"{path.name} holds call data"


@pytest.fixture
def http_everything():
    """server-everything in its Streamable HTTP mode on a free local port."""
    server = Everything("streamableHttp")
    yield server.url
    server.stop()


def test_remote_streamable_http_upstream_is_aggregated_beside_stdio(home, http_everything):
    cli("add", "remote", "--url", http_everything, "--header", "X-Trace=${COFFER_TEST_TRACE:-none}")
    cli("add", "time", "--", *TIME_SERVER)

    async def body(client):
        tools = [t.name for t in (await client.list_tools()).tools]
        total = await client.call_tool("remote__get-sum", {"a": 20, "b": 22})

        progress = []

        async def on_progress(value, total_steps, message):
            progress.append(value)

        slow = await client.call_tool("remote__trigger-long-running-operation", {"duration": 1, "steps": 2},
                                      progress_callback=on_progress)
        return tools, total, slow, progress

    tools, total, slow, progress = run(body)
    assert "remote__get-sum" in tools and "time__get_current_time" in tools
    assert "42" in text_of(total)
    assert not slow.is_error and progress == [1, 2]
    assert json.loads(cli("list", "--json").stdout)["servers"][0]["status"] == "ready"
