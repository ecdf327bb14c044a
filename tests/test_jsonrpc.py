"""JSON-RPC between a client and ``coffer serve``: protocol versions, line framing, errors for bad input, and every
line a hostile client can write - each must get an answer (or be a notification), and the gateway must keep
serving, stay small and never print a traceback.  Lines are written by hand: a JSON library would refuse to
produce most of them."""

import json
import random
import subprocess
import threading
import time

import pytest

from coffer_src.jsonrpc import (
    EncodedResult,
    defer_to_burst_end,
    dumps,
    encode_line,
    handle_burst,
    json_number,
    negotiate_version,
    read_line_bursts,
    rpc_result,
)

from conftest import FAKE, cli, coffer_cmd, healthy, linux_only, proc_status, received, rss_kb, wait_until

# -- protocol versions and framing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("requested", ["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"])
def test_supported_versions_are_echoed(requested):
    assert negotiate_version(requested) == requested


@pytest.mark.parametrize("requested", ["2023-01-01", "2026-07-28", None, 5])
def test_unknown_versions_get_the_latest(requested):
    assert negotiate_version(requested) == "2025-11-25"


def test_older_protocol_versions_are_accepted(raw_gateway):
    gw = raw_gateway()
    assert gw.initialize(version="2024-11-05")["result"]["protocolVersion"] == "2024-11-05"


def test_line_bursts_rebuild_every_line_whatever_the_read_boundaries():
    """Upstream replies are split into lines from raw reads: a line may straddle reads (a 200 KB reply spans
    several), several may share one, and the last may lack its newline."""
    lines = [b'{"id":1}', b"", b'{"big":"' + b"x" * 200_000 + b'"}', b'{"id":2}\r', b'{"id":3}', b"tail"]
    stream = b"\n".join(lines)
    rng = random.Random(5)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), 40))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        reads = iter(chunks + [b""])
        got = [line for burst in read_line_bursts(lambda size: next(reads)) for line in burst]
        assert got == lines
    reads = iter([b'{"a":1}\n{"b":2}\n{"c"', b':3}\n', b""])
    assert list(read_line_bursts(lambda size: next(reads))) == [[b'{"a":1}', b'{"b":2}'], [b'{"c":3}']]


def test_output_held_during_a_burst_is_written_once_at_its_end_even_on_error():
    written = []

    def handle(line):
        if line == b"boom":
            raise RuntimeError("a handler failed mid-burst")
        assert defer_to_burst_end("client", lambda: written.append("flush"))
        written.append(line)

    with pytest.raises(RuntimeError):
        handle_burst([b"1", b"2", b"boom"], handle)
    assert written == [b"1", b"2", "flush"]  # one flush, after the burst, despite the error
    assert defer_to_burst_end("client", lambda: None) is False  # outside a burst: write at once


# -- errors for bad input, and the session goes on ---------------------------------------------------------------------

def test_a_result_that_carries_its_json_is_written_as_its_dict_would_be_and_a_change_to_it_is_written():
    value = {"content": [{"type": "text", "text": 'say "hi" \\ \u2028 na\u00efve'}], "structuredContent": {"n": 1.5}}
    for msg_id in (1, "a\"b", None):
        assert encode_line(rpc_result(msg_id, EncodedResult(value, dumps(value)))) == \
            encode_line(rpc_result(msg_id, value))
    for change in (lambda r: r.update(isError=True), lambda r: r.__setitem__("isError", True),
                   lambda r: r.setdefault("isError", True), lambda r: r.pop("structuredContent")):
        result = EncodedResult(value, dumps(value))
        change(result)
        assert json.loads(encode_line(rpc_result(1, result)))["result"] == dict(result) != value
    for number in (0.1, 3.9687, -0.0, 1e300, 5e-324, 7, True):
        assert json_number(number) == dumps(number)


def test_bad_input_gets_the_right_errors_and_the_session_survives(raw_gateway):
    gw = raw_gateway()
    gw.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert gw.wait_response(1)["error"]["code"] == -32600          # before initialize
    assert gw.initialize()["result"]["protocolVersion"] == "2025-11-25"
    gw.send_raw(b"{this is not json\n")
    assert gw.wait_response(None)["error"]["code"] == -32700
    gw.send({"jsonrpc": "2.0", "id": 2, "method": "no/such/method"})
    assert gw.wait_response(2)["error"]["code"] == -32601
    gw.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": 5}})
    assert gw.wait_response(3)["error"]["code"] == -32602
    gw.send({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": [1]})
    assert gw.wait_response(4)["error"]["code"] == -32602
    gw.send({"jsonrpc": "1.0", "id": 5, "method": "ping"})
    assert gw.wait_response(5)["error"]["code"] == -32600
    assert gw.request("ping")["result"] == {}
    tools = gw.request("tools/list")["result"]["tools"]
    assert [t["name"] for t in tools] == ["coffer__search_tools"]


def test_a_response_is_never_answered_even_with_a_null_id(home, raw_gateway):
    gw = raw_gateway()
    gw.initialize()
    gw.send({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "your parse error"}})
    gw.send({"jsonrpc": "2.0", "id": "never-asked", "result": {}})
    assert gw.request("ping")["result"] == {}
    assert json.dumps(None) not in gw.responses or not gw.responses[json.dumps(None)]


def total_responses(gw):
    with gw.cond:
        return sum(len(v) for v in gw.responses.values())


def wait_any_response(gw, before, timeout=20):
    """Wait until the gateway has sent at least one more response than ``before`` (or has died)."""
    try:
        gw.wait_for(lambda g: total_responses(g) > before or g.proc.poll() is not None, timeout=timeout)
    except TimeoutError:
        pass
    assert gw.proc.poll() is None, f"the gateway died ({gw.proc.returncode}): {gw.stderr_text()[-1500:]}"
    assert total_responses(gw) > before, "no answer"


def started(watched_gateway, capabilities=None, name="hostile-client", recv_log=None, **kwargs):
    cli("add", "up", "--", *FAKE, *(("--recv-log", str(recv_log)) if recv_log else ()))
    gw = watched_gateway(**kwargs)
    gw.initialize(capabilities=capabilities, name=name)
    gw.request("tools/list")
    return gw


# -- one line must never kill the gateway ------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [1_000, 100_000])
@pytest.mark.parametrize("shape", ["params", "bare"])
def test_a_deeply_nested_line_is_answered_and_the_gateway_keeps_serving(home, watched_gateway, depth, shape):
    gw = started(watched_gateway)
    nest = "[" * depth + "]" * depth
    before = total_responses(gw)
    if shape == "params":
        gw.send_raw(f'{{"jsonrpc":"2.0","id":"deep","method":"ping","params":{{"x":{nest}}}}}\n'.encode())
    else:
        gw.send_raw((nest + "\n").encode())
    wait_any_response(gw, before)
    healthy(gw, "up__echo")


# Each line holds a lone surrogate escape: legal JSON that Python decodes but cannot encode as UTF-8.
SURROGATE_REQUESTS = {
    "id": '{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}',
    "method": '{"jsonrpc":"2.0","id":"m","method":"tools/\\ud800"}',
    "tool_name": '{"jsonrpc":"2.0","id":"t","method":"tools/call","params":{"name":"up__\\ud800","arguments":{}}}',
    "prompt_name": '{"jsonrpc":"2.0","id":"p","method":"prompts/get","params":{"name":"up__\\udfff"}}',
    "resource_uri": '{"jsonrpc":"2.0","id":"r","method":"resources/read","params":{"uri":"file:///\\ud800"}}',
}


@pytest.mark.parametrize("where", sorted(SURROGATE_REQUESTS))
def test_a_lone_surrogate_in_a_request_is_answered_and_the_gateway_keeps_serving(home, watched_gateway, where):
    gw = started(watched_gateway)
    before = total_responses(gw)
    gw.send_raw((SURROGATE_REQUESTS[where] + "\n").encode())
    wait_any_response(gw, before)
    assert not gw.bad_lines, gw.bad_lines
    healthy(gw, "up__echo")


@pytest.mark.parametrize("where", ["progress_token", "arguments"])
def test_a_lone_surrogate_in_what_is_forwarded_still_reaches_the_upstream(home, watched_gateway, where):
    """What goes upstream is made encodable: the call is served, not turned into an internal error."""
    gw = started(watched_gateway)
    if where == "progress_token":
        line = ('{"jsonrpc":"2.0","id":"c","method":"tools/call","params":{"name":"up__echo",'
                '"arguments":{"text":"served"},"_meta":{"progressToken":"tok\\ud800"}}}')
    else:
        line = ('{"jsonrpc":"2.0","id":"c","method":"tools/call","params":{"name":"up__echo",'
                '"arguments":{"text":"served","\\udc00key":"a\\ud800b"}}}')
    gw.send_raw((line + "\n").encode())
    reply = gw.wait_response("c", timeout=30)
    assert "result" in reply and reply["result"]["content"][0]["text"] == "served", reply
    healthy(gw, "up__echo")


def test_a_lone_surrogate_in_a_cancellation_reason_does_not_kill_the_gateway(home, watched_gateway, tmp_path):
    recv_log = tmp_path / "up.recv"
    gw = started(watched_gateway, recv_log=recv_log)
    gw.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
             "params": {"name": "up__slow", "arguments": {"seconds": 20}}})
    # once the call is running upstream, the cancellation is forwarded with its reason
    wait_until(lambda: any(m.get("method") == "tools/call" for m in received(recv_log)),
               what="the call to reach the upstream")
    gw.send_raw(b'{"jsonrpc":"2.0","method":"notifications/cancelled",'
                b'"params":{"requestId":"slow","reason":"stop \\ud800 now"}}\n')
    healthy(gw, "up__echo")


def test_a_lone_surrogate_in_the_clients_answer_to_a_server_request_is_relayed(home, watched_gateway):
    gw = started(watched_gateway, capabilities={"sampling": {}})
    gw.send({"jsonrpc": "2.0", "id": "s", "method": "tools/call",
             "params": {"name": "up__sample", "arguments": {"prompt": "hi"}}})
    request = gw.wait_for(lambda g: next((r for r in g.requests if r["method"] == "sampling/createMessage"), None))
    answer = ('{"jsonrpc":"2.0","id":%s,"result":{"role":"assistant","model":"m",'
              '"content":{"type":"text","text":"model \\ud800 says"}}}' % json.dumps(request["id"]))
    gw.send_raw((answer + "\n").encode())
    reply = gw.wait_response("s", timeout=30)
    text = reply["result"]["content"][0]["text"]
    assert text.startswith("model ") and text.endswith(" says"), reply
    healthy(gw, "up__echo")


def test_a_lone_surrogate_in_the_client_name_does_not_stop_the_invocation_log(home, watched_gateway):
    gw = started(watched_gateway, name="agent \ud800 x")
    for i in range(3):
        reply = gw.request("tools/call", {"name": "up__echo", "arguments": {"text": f"call {i}"}})
        assert reply["result"]["content"][0]["text"] == f"call {i}"
    gw.request("tools/call", {"name": "up__nope", "arguments": {}})
    gw.close()
    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    assert sum(r["capability"] == "up__echo" for r in rows) == 3, rows
    assert any(r["capability"] == "up__nope" for r in rows), rows
    assert all(r["client"] and r["client"].startswith("agent ") for r in rows), rows
    assert "Traceback" not in gw.stderr_text(), gw.stderr_text()[-3000:]


# -- batches and oversized lines cost one error, not the gateway's memory ----------------------------------------------

@pytest.mark.parametrize("size", [1_005, 3_000])
def test_every_request_in_a_large_batch_is_answered(home, watched_gateway, size):
    gw = started(watched_gateway)
    batch = [{"jsonrpc": "2.0", "id": f"b{i}", "method": "ping"} for i in range(size)]
    batch.insert(500, {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"})  # never answered
    gw.send(batch)
    gw.wait_for(lambda g: all(g.responses.get(json.dumps(f"b{i}")) for i in range(size)), timeout=60)
    for i in (0, 999, 1000, size - 1):
        response = gw.responses[json.dumps(f"b{i}")][0]
        assert "result" in response or "error" in response
    healthy(gw, "up__echo")


@linux_only
def test_a_large_batch_from_the_client_keeps_the_gateway_memory_bounded(home):
    """A 3 MB batch of `{}` makes ~107 MB of error replies, all held until the burst ends, and ~400 MB RSS; at
    max_message_bytes (64 MiB) the same line costs gigabytes."""
    gateway = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    peak, stop, last_answered = [0], threading.Event(), threading.Event()

    def drain():  # reads everything; notes the answer to the ping sent after the batch
        tail = b""
        while chunk := gateway.stdout.read1(1 << 20):
            if b'"last"' in tail + chunk[:16] or b'"last"' in chunk:
                last_answered.set()
            tail = chunk[-16:]

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kb(gateway.pid) or 0)
            time.sleep(0.02)

    threading.Thread(target=drain, daemon=True).start()
    threading.Thread(target=watch, daemon=True).start()
    try:
        gateway.stdin.write(b"[" + b",".join([b"{}"] * 1_000_000) + b"]\n")
        gateway.stdin.write(b'{"jsonrpc":"2.0","id":"last","method":"ping"}\n')
        gateway.stdin.flush()
        # The ping is answered once the batch before it has been answered (or refused) in full.
        assert last_answered.wait(120) or peak[0] >= 250 * 1024, "the ping after the batch was never answered"
        assert peak[0] < 250 * 1024, f"gateway RSS peaked at {peak[0] >> 10} MB for a 3 MB line"
    finally:
        stop.set()
        gateway.kill()
        gateway.wait(10)


@linux_only
@pytest.mark.parametrize("id_position", ["first", "last"])
def test_an_oversized_client_line_fails_alone_and_memory_stays_bounded(home, watched_gateway, id_position):
    cli("config", "max_message_bytes", "1000000")
    gw = started(watched_gateway, rss_ceiling_mb=200)
    baseline = proc_status(gw.proc.pid, "VmHWM")
    chunk = b"A" * (1 << 20)
    head = b'{"jsonrpc":"2.0","id":"big","method":"tools/call","params":{"name":"up__echo","arguments":{"text":"'
    if id_position == "last":
        head = b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"up__echo","arguments":{"text":"'
    tail = b'"}}}\n' if id_position == "first" else b'"}},"id":"big"}\n'
    gw.send_raw(head)
    for _ in range(100):  # 100 MiB in one line
        if gw.proc.poll() is not None:
            break
        try:
            gw.send_raw(chunk)
        except BrokenPipeError:
            break
    try:
        gw.send_raw(tail + b'{"jsonrpc":"2.0","id":"after","method":"ping"}\n')
        gw.wait_for(lambda g: g.responses.get('"after"') or g.proc.poll() is not None, timeout=60)
    except (BrokenPipeError, TimeoutError):
        pass
    if gw.over_ceiling:
        pytest.fail(f"a 100 MiB line took the gateway's RSS to {gw.over_ceiling // 1024} MB (killed)")
    assert gw.wait_response("after", timeout=1)["result"] == {}
    if id_position == "first":  # the id is readable from the head of the line: that request gets its error
        big = gw.wait_response("big", timeout=10)
        assert "error" in big or big.get("result", {}).get("isError") is True, str(big)[:500]
    else:
        with gw.cond:
            assert any("error" in r for r in gw.responses.get("null", [])), "the oversized line got no answer"
    peak = proc_status(gw.proc.pid, "VmHWM")
    assert peak - baseline < 60 * 1024, f"peak RSS grew by {(peak - baseline) // 1024} MB for a 1 MB limit"
    # a message under the limit still works, and so does everything else
    reply = gw.request("tools/call", {"name": "up__echo", "arguments": {"text": "y" * 500_000}}, timeout=30)
    assert reply["result"]["content"][0]["text"] == "y" * 500_000
    healthy(gw, "up__echo")
