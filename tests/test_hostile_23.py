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

CONTROL_CHARS = [chr(c) for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0)]]


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
