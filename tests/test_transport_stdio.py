"""The stdio transport: whatever bytes an upstream writes (garbage, deep nesting, lone surrogates, malformed or
huge replies, escape sequences on stderr) and however slowly it reads, the gateway keeps its lines, its memory
and the other upstreams intact.  The upstreams are tests/fixtures/hostile_server.py (one ``--mode`` per
misbehaviour) and fake_server.py; a healthy neighbour proves the rest keeps working."""

import json
import threading

import anyio
import pytest

from conftest import (
    FAKE,
    PY,
    add_hostile,
    assert_no_control,
    call_msg,
    call_tool,
    call_upstream,
    cli,
    healthy,
    is_tool_error,
    linux_only,
    open_session,
    proc_status,
    sdk_session,
    start_upstream,
    stdio_config,
    text_of,
    tool_names,
    wait_for_status,
)

# -- what goes down the pipe -------------------------------------------------------------------------------------------

def test_a_request_bigger_than_the_pipe_and_the_calls_behind_it_arrive_whole_and_in_order(home, raw_gateway,
                                                                                         tmp_path):
    """A 3 MB argument fills the upstream's stdin pipe many times over: what does not fit is written later
    by another thread, and the small calls sent right behind it must neither overtake it nor be lost."""
    received = tmp_path / "received.jsonl"
    cli("add", "s", "--", *FAKE, "--tools", "echo", "--recv-log", str(received))
    gw = raw_gateway()
    gw.initialize()
    gw.request("tools/list")
    big = "".join(chr(0x41 + i % 26) for i in range(3 * 1024 * 1024))
    batch = [call_msg("big", "s__echo", {"text": big})]
    batch += [call_msg(f"small-{i}", "s__echo", {"text": f"small {i}"}) for i in range(50)]
    gw.send_raw(b"".join((json.dumps(m) + "\n").encode() for m in batch))
    assert text_of(gw.wait_response("big", timeout=60)) == big
    for i in range(50):
        assert text_of(gw.wait_response(f"small-{i}", timeout=60)) == f"small {i}"
    calls = [json.loads(line) for line in received.read_text().splitlines()]
    texts = [m["params"]["arguments"]["text"] for m in calls if m.get("method") == "tools/call"]
    assert texts == [big] + [f"small {i}" for i in range(50)]


def test_an_upstream_that_stops_reading_stalls_only_itself(home, raw_gateway):
    cli("add", "stuck", "--timeout", "2", "--", *FAKE, "--tools", "echo", "--stop-reading")
    cli("add", "ok", "--", *FAKE, "--tools", "echo")
    gw = raw_gateway()
    gw.initialize()
    assert len(gw.request("tools/list")["result"]["tools"]) == 3
    big = "x" * (2 * 1024 * 1024)                      # far more than a pipe buffer holds
    def flood():  # on a thread: if the gateway regressed to blocking, this write blocks, not the test
        for msg_id in (100, 101):
            gw.send({"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                     "params": {"name": "stuck__echo", "arguments": {"text": big}}})
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    flooder.join(20)  # the gateway read both calls (a gateway blocked on the stuck upstream never does)
    answers = {}

    def probe():
        answers["ok"] = gw.request("tools/call", {"name": "ok__echo", "arguments": {"text": "still here"}})
        answers["ping"] = gw.request("ping")

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    prober.join(20)
    if prober.is_alive():
        gw.proc.kill()  # a regression: the gateway stopped reading its client
    assert answers.get("ping", {}).get("result") == {}, "the gateway stalled behind the stuck upstream"
    assert answers["ok"]["result"]["content"][0]["text"] == "still here"
    timed_out = gw.wait_response(100, timeout=15)["result"]   # and the timeout still fires for the stuck one
    assert timed_out["isError"] and "did not answer" in timed_out["content"][0]["text"]


# -- what comes up the pipe --------------------------------------------------------------------------------------------

def test_garbage_lines_are_skipped_and_big_results_route(home, raw_gateway):
    cli("add", "junk", "--", *FAKE, "--garbage")
    gw = raw_gateway()
    gw.initialize()
    assert "junk__big" in tool_names(gw.request("tools/list"))

    gw.send(call_msg("big", "junk__big", {"mb": 10}))
    gw.send(call_msg("small", "junk__echo", {"text": "héllo"}))
    small = gw.wait_response("small", timeout=60)
    big = gw.wait_response("big", timeout=120)
    assert text_of(small) == "héllo" and not is_tool_error(small)
    assert not is_tool_error(big) and len(text_of(big)) == 10 * 1024 * 1024
    assert "skipped a non-JSON line" in gw.stderr_text()
    assert gw.request("ping")["result"] == {}


@pytest.mark.parametrize("where", ["before", "reply"])
def test_a_deeply_nested_upstream_line_does_not_silence_that_upstream(home, watched_gateway, where):
    add_hostile("h", "deep", opts=("--timeout", "5"))
    add_hostile("good")
    gw = open_session(watched_gateway)
    reply = call_tool(gw, "h__deep", {"where": where}, timeout=30)
    if where == "before":
        assert text_of(reply) == "after the deep line", reply
    else:
        assert "error" in reply or reply["result"].get("isError"), reply
    reply = call_tool(gw, "h__echo", {"text": "still alive"}, timeout=30)
    assert text_of(reply) == "still alive", reply
    healthy(gw)


DEEP_RESULT_SERVER = r"""
import json, sys
for raw in sys.stdin.buffer:
    message = json.loads(raw)
    msg_id, method = message.get("id"), message.get("method")
    if method == "initialize":
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "deep"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "deep", "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        depth = 100000  # legal JSON, too deep for Coffer to decode: the reader skips it
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"content":[],"x":%s%s}}\n'
                         % (msg_id, "[" * depth, "]" * depth))
        sys.stdout.flush()
        continue
    elif msg_id is not None:  # e.g. the server/discover probe: a handshake-era server does not know it
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id,
                                     "error": {"code": -32601, "message": "Method not found"}}) + "\n")
        sys.stdout.flush()
        continue
    else:
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n")
    sys.stdout.flush()
"""


def test_a_reply_too_deep_to_decode_fails_its_call_at_once(tmp_path):
    """An oversized reply fails the call it answers at once (request_id_in on its head); a reply that is skipped
    because it cannot be decoded is not matched to its call, which then waits for call_timeout."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP_RESULT_SERVER)
    upstream, ticker = start_upstream(stdio_config("deep", [PY, str(script)]), call_timeout=300.0,
                                      init_timeout=10.0)
    try:
        box, done = call_upstream(upstream, "deep")
        assert done.wait(20), "no answer: the call waits for call_timeout"
        assert box["response"] is None
    finally:
        ticker.stop.set()
        upstream.stop()


def test_a_result_nested_deeper_than_a_client_can_parse_still_gets_the_client_an_answer(home):
    """Python follows ~1,000 levels, the official SDK's parser far fewer: a reply Coffer can read but relays
    verbatim leaves the SDK's call waiting forever.  Deep nesting is bounded on the way out as on the way in."""
    add_hostile("h", "deep", opts=("--timeout", "10"))
    cli("add", "good", "--", *FAKE)

    async def body(client):
        try:
            with anyio.fail_after(20):
                result = await client.call_tool("h__deep", {"where": "nested", "depth": 300})
            outcome = "tool error" if result.is_error else "result"
        except TimeoutError:
            outcome = "hung"
        except Exception as exc:  # noqa: BLE001 - a clean protocol error is a fine outcome
            outcome = f"error {type(exc).__name__}"
        good = await client.call_tool("good__echo", {"text": "fine"})
        return outcome, good

    outcome, good = sdk_session(body, timeout=120)
    assert outcome != "hung", "the SDK client never got an answer it could parse"
    assert good.content[0].text == "fine"


def test_a_lone_surrogate_in_a_tool_result_or_error_is_answered(home, watched_gateway):
    add_hostile("h", "sur-result", opts=("--timeout", "60"))
    add_hostile("good")
    gw = open_session(watched_gateway)
    reply = call_tool(gw, "h__lone", timeout=20)
    assert text_of(reply).startswith("lone ") and text_of(reply).endswith(" surrogate"), reply
    reply = call_tool(gw, "h__lone_error", timeout=20)
    assert "error" in reply or reply["result"].get("isError"), reply
    assert not gw.bad_lines, gw.bad_lines
    healthy(gw)


@pytest.mark.parametrize("mode", ["sur-desc", "sur-name", "sur-info"])
def test_a_lone_surrogate_in_a_definition_does_not_stop_the_server(home, watched_gateway, mode):
    add_hostile("h", mode)
    add_hostile("good")
    gw = open_session(watched_gateway)
    assert text_of(call_tool(gw, "h__echo", {"text": "served"})) == "served"
    names = tool_names(gw.request("tools/list"))
    assert "h__echo" in names and "h__env" in names
    if mode == "sur-desc":
        assert "h__weird" in names
    assert not gw.bad_lines, gw.bad_lines
    healthy(gw)
    wait_for_status("h", "ready")


MALFORMED = ["err_string", "no_jsonrpc", "both", "err_code_string", "err_no_message", "result_number",
             "result_list", "result_null", "neither"]


def test_malformed_upstream_replies_reach_the_client_well_formed(home, watched_gateway):
    add_hostile("m", "malformed", opts=("--timeout", "10"))
    add_hostile("good")
    gw = open_session(watched_gateway)
    problems = []
    for name in MALFORMED:
        reply = call_tool(gw, f"m__{name}", timeout=30)
        ok = reply.get("jsonrpc") == "2.0" and (("result" in reply) != ("error" in reply))
        if ok and "error" in reply:
            error = reply["error"]
            ok = isinstance(error, dict) and isinstance(error.get("code"), int) and \
                isinstance(error.get("message"), str)
        if ok and "result" in reply:
            ok = isinstance(reply["result"], dict) and isinstance(reply["result"].get("content"), list)
        if not ok:
            problems.append((name, reply))
    assert not problems, problems
    healthy(gw)


def test_an_sdk_client_gets_an_answer_for_every_malformed_reply(home):
    add_hostile("m", "malformed", opts=("--timeout", "10"))
    cli("add", "good", "--", *FAKE)

    async def body(client):
        outcomes = {}
        for name in MALFORMED:
            try:
                with anyio.fail_after(20):
                    result = await client.call_tool(f"m__{name}", {})
                outcomes[name] = "result" if not result.is_error else "tool error"
            except TimeoutError:
                outcomes[name] = "hung"
            except Exception as exc:  # noqa: BLE001 - a clean protocol error is a fine outcome
                outcomes[name] = f"error {type(exc).__name__}"
        good = await client.call_tool("good__echo", {"text": "fine"})
        return outcomes, good

    outcomes, good = sdk_session(body, timeout=300)
    assert "hung" not in outcomes.values(), outcomes
    assert good.content[0].text == "fine"


@linux_only
@pytest.mark.parametrize("tool", ["huge", "huge_junk"])
def test_an_oversized_upstream_line_fails_alone_and_memory_stays_bounded(home, watched_gateway, tool):
    cli("config", "max_message_bytes", "1000000")
    add_hostile("h", "huge", opts=("--timeout", "30"))
    add_hostile("good")
    gw = open_session(watched_gateway, rss_ceiling_mb=250)
    baseline = proc_status(gw.proc.pid, "VmHWM")
    gw.send({"jsonrpc": "2.0", "id": "huge", "method": "tools/call",
             "params": {"name": f"h__{tool}", "arguments": {"mb": 400}}})
    try:
        gw.wait_for(lambda g: g.responses.get('"huge"') or g.proc.poll() is not None, timeout=120)
    except TimeoutError:
        pass
    if gw.over_ceiling:
        pytest.fail(f"a 400 MiB upstream line took the gateway's RSS to {gw.over_ceiling // 1024} MB (killed)")
    reply = gw.wait_response("huge", timeout=1)
    if tool == "huge":
        assert "error" in reply or reply["result"].get("isError"), str(reply)[:300]
    healthy(gw)
    assert proc_status(gw.proc.pid, "VmHWM") - baseline < 100 * 1024


def test_relayed_upstream_stderr_carries_no_escape_sequences(home, watched_gateway):
    add_hostile("p", "ansi")
    gw = open_session(watched_gateway)
    call_tool(gw, "p__echo", {"text": "x"})
    gw.close()
    assert "starting" in gw.stderr_text() and "done" in gw.stderr_text()
    assert_no_control(gw.stderr_text(), "the gateway's stderr")
