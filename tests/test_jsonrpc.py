"""A hostile client against the real ``coffer serve`` (issue 15, classes 5, 7, 13, 14 and 16): every line it can
write must get an answer (or be a notification), and the gateway must keep serving, stay small and never print
a traceback.  Lines are written by hand: a JSON library would refuse to produce most of them."""

import json
import os
import subprocess
import threading
import time

import pytest

from conftest import FAKE, alive, cli, coffer_cmd, healthy, linux_only, pids_in, proc_status, received, wait_until


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


# -- class 5: one line must never kill the gateway -------------------------------------------------------------

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


# -- class 7: every element of a batch is answered ---------------------------------------------------------------

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


# -- class 13: a client's oversized line costs one error, not the gateway's memory ------------------------------

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


# -- class 14: waiting requests must not cost a thread each -----------------------------------------------------

@linux_only
def test_thousands_of_requests_waiting_for_a_starting_server_do_not_cost_a_thread_each(home, watched_gateway,
                                                                                         tmp_path):
    gate = tmp_path / "slowstart.gate"
    cli("config", "discovery_timeout", "4")
    cli("add", "slowstart", "--", *FAKE, "--start-gate", str(gate))
    gw = watched_gateway()
    gw.initialize()
    lines = []
    for i in range(5_000):
        method, params = [("tools/list", {}), ("resources/list", {}), ("prompts/list", {}),
                          ("resources/templates/list", {}),
                          ("tools/call", {"name": "slowstart__nothing", "arguments": {}})][i % 5]
        lines.append(json.dumps({"jsonrpc": "2.0", "id": f"w{i}", "method": method, "params": params}) + "\n")
    threads = []
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            count = proc_status(gw.proc.pid, "Threads")
            if count:
                threads.append(count)
            time.sleep(0.02)  # a sampling period while the requests wait

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gw.send_raw("".join(lines).encode())
    # A ping read after the 5,000 lines is answered at once: by then every one of them is waiting for slowstart.
    assert gw.request("ping", timeout=60)["result"] == {}
    waiting = proc_status(gw.proc.pid, "Threads")
    assert not any(gw.responses.get(json.dumps(f"w{i}")) for i in range(4, 5_000, 5)), "a call did not wait"
    gate.touch()  # slowstart finishes starting: everything waiting is answered
    gw.wait_for(lambda g: all(g.responses.get(json.dumps(f"w{i}")) for i in range(5_000)), timeout=120)
    sampling.set()
    sampler.join(5)
    threads.append(waiting)
    assert max(threads) < 200, f"{max(threads)} threads while 5,000 requests waited"
    assert gw.request("ping")["result"] == {}
    assert "Traceback" not in gw.stderr_text()


# -- class 16: a client that stops reading ------------------------------------------------------------------------

def test_a_client_that_closes_its_read_end_ends_the_session_cleanly(home, tmp_path):
    spawns = tmp_path / "spawns"
    cli("add", "up", "--", *FAKE, "--spawn-log", str(spawns))
    proc = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        def send(obj):
            proc.stdin.write((json.dumps(obj) + "\n").encode())
            proc.stdin.flush()

        def read_reply(msg_id):
            while True:
                message = json.loads(proc.stdout.readline())
                if message.get("id") == msg_id and "method" not in message:
                    return message

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "closer", "version": "1"}}})
        read_reply(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
              "params": {"name": "up__echo", "arguments": {"text": "warm"}}})
        assert read_reply(2)["result"]["content"][0]["text"] == "warm"
        send({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
              "params": {"name": "up__slow", "arguments": {"seconds": 120}}})
        proc.stdout.close()  # the client stops reading; its stdin (our writes) stays open
        try:
            for i in range(20):  # pings whose answers cannot be delivered, until the gateway notices
                send({"jsonrpc": "2.0", "id": 100 + i, "method": "ping"})
                try:
                    proc.wait(0.05)
                    break
                except subprocess.TimeoutExpired:
                    continue
        except BrokenPipeError:
            pass  # already gone: that is the point
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the gateway kept running after its client closed the read end of its stdout")
        stderr = proc.stderr.read().decode("utf-8", "replace")
        assert "Traceback" not in stderr, stderr[-3000:]
        pids = pids_in(spawns)
        wait_until(lambda: not any(alive(p) for p in pids), timeout=10, what="the upstream to end with the gateway")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

