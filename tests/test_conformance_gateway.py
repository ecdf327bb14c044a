"""The gateway's own protocol fixes found by the MCP conformance suite (issue 26, items 1, 2, 3 and 7).

Each test drives ``coffer serve`` with hand-written JSON-RPC (conftest.RawGateway) in front of
tests/fixtures/conformance_upstream.py, a stdlib server whose start can be delayed and which records what it is
sent.
"""

import json

from conftest import PY, ROOT, cli

UPSTREAM = [PY, str(ROOT / "tests" / "fixtures" / "conformance_upstream.py")]
MODERN = "2026-07-28"
WATCHED = "test://watched-resource"


def envelope(capabilities: dict, name: str = "modern-client") -> dict:
    return {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": capabilities,
            "io.modelcontextprotocol/clientInfo": {"name": name, "version": "1"}}


def test_subscribe_unsubscribe_and_template_completion_wait_for_a_starting_upstream(raw_gateway):
    """Item 1: as resources/read does, these wait for the server that may own the URI instead of answering
    "Unknown resource" while it starts."""
    cli("add", "up", "--", *UPSTREAM, "--start-delay", "1.5")
    cli("config", "discovery_timeout", "60")  # a slow machine's start still ends inside the wait
    gw = raw_gateway()
    gw.initialize()
    subscribed = gw.request("resources/subscribe", {"uri": WATCHED})
    completed = gw.request("completion/complete", {
        "ref": {"type": "ref/resource", "uri": "test://template/{id}/data"}, "argument": {"name": "id", "value": "al"}})
    unsubscribed = gw.request("resources/unsubscribe", {"uri": WATCHED})
    assert subscribed.get("result") == {}, subscribed
    assert completed.get("result", {}).get("completion", {}).get("values") == ["alpha"], completed
    assert unsubscribed.get("result") == {}, unsubscribed


def test_initialize_on_a_2026_connection_is_method_not_found(raw_gateway):
    """Item 2: 2026-07-28 removed initialize, so on a connection in that era it is -32601, not -32022 (which
    would tell the client to retry the same thing with another version)."""
    cli("add", "up", "--", *UPSTREAM)
    gw = raw_gateway()
    discovered = gw.request("server/discover", {"_meta": envelope({})})
    assert MODERN in discovered["result"]["supportedVersions"]
    refused = gw.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                        "clientInfo": {"name": "late", "version": "1"}})
    assert refused["error"]["code"] == -32601, refused


def test_each_2026_request_carries_its_own_envelope_upstream(raw_gateway, tmp_path):
    """Item 3: a 2026-07-28 upstream is told, on each request, what that request's client declared -- not what
    the connection's first request said."""
    log = tmp_path / "received.jsonl"
    cli("add", "up", "--", *UPSTREAM, "--modern", "--recv-log", str(log))
    gw = raw_gateway()
    gw.request("server/discover", {"_meta": envelope({"sampling": {}}, "first")})
    gw.request("tools/list", {"_meta": envelope({"sampling": {}}, "first")})
    with_sampling = gw.request("tools/call", {"name": "up__echo", "arguments": {"text": "one"},
                                              "_meta": envelope({"sampling": {}}, "first")})
    without = gw.request("tools/call", {"name": "up__echo", "arguments": {"text": "two"},
                                        "_meta": envelope({"elicitation": {}}, "second")})
    assert "error" not in with_sampling and "error" not in without, (with_sampling, without)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    calls = {c["params"]["arguments"]["text"]: c["params"]["_meta"] for c in calls if c["method"] == "tools/call"}
    assert calls["one"]["io.modelcontextprotocol/clientCapabilities"] == {"sampling": {}}
    assert calls["one"]["io.modelcontextprotocol/clientInfo"]["name"] == "first"
    assert calls["two"]["io.modelcontextprotocol/clientCapabilities"] == {"elicitation": {}}
    assert calls["two"]["io.modelcontextprotocol/clientInfo"]["name"] == "second"


def test_coffers_unknown_resource_error_names_the_uri(raw_gateway):
    """Item 7: Coffer's own "Unknown resource" error says which URI in data.uri, as the specification asks."""
    cli("add", "up", "--", *UPSTREAM)
    gw = raw_gateway()
    gw.initialize()
    missing = "test://nonexistent-resource-for-conformance-testing"
    refused = gw.request("resources/read", {"uri": missing})
    assert refused["error"]["code"] == -32602, refused
    assert refused["error"].get("data", {}).get("uri") == missing, refused
