"""How ``coffer serve`` begins and ends: what it says when started by hand, a client that stops reading or
vanishes, kill -9 and SIGTERM, and no upstream (nor an upstream's daemonized child) left running afterwards."""

import json
import os
import signal
import subprocess

import pytest

from conftest import (
    FAKE,
    PY,
    RawGateway,
    add_hostile,
    alive,
    call_msg,
    call_tool,
    cli,
    coffer_cmd,
    linux_only,
    open_session,
    pids_in,
    posix_only,
    quick_restarts,
    received,
    text_of,
    wait_until,
)


@posix_only
def test_serve_by_hand_says_what_it_is(home):
    controller, terminal = os.openpty()
    proc = subprocess.Popen(coffer_cmd("serve"), stdin=terminal, stdout=subprocess.PIPE, stderr=terminal)
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


# -- a client that goes away -------------------------------------------------------------------------------------------

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


SETSID_SERVER = """
import os, runpy, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
fake = sys.argv[2]
sys.argv = [fake]
runpy.run_path(fake)["main"]()
time.sleep(1.5)  # a server that takes a moment to exit after its stdin closes
"""


@linux_only
def test_a_client_that_vanishes_with_a_call_in_flight_still_gets_every_upstream_session_ended(home, tmp_path):
    """The client closes both pipes while a call runs: stdin EOF starts shutdown, the in-flight call's error hits
    EPIPE, and the client-gone handler os._exit()s while shutdown is still ending the other upstreams."""
    script, pid_file = tmp_path / "setsid_server.py", tmp_path / "grandchild.pid"
    recv_log = tmp_path / "busy.recv"
    script.write_text(SETSID_SERVER)
    cli("add", "busy", "--", *FAKE, "--recv-log", str(recv_log))
    cli("add", "daemonizing", "--", PY, str(script), str(pid_file), FAKE[1])
    gateway = subprocess.Popen(coffer_cmd("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    grandchild = None
    try:
        def send(message):
            gateway.stdin.write((json.dumps(message) + "\n").encode())
            gateway.stdin.flush()

        def receive(msg_id):
            while True:
                message = json.loads(gateway.stdout.readline())
                if message.get("id") == msg_id:
                    return message

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        receive(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        receive(2)
        grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), what="the grandchild"))
        send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "busy__slow",
                                                                            "arguments": {"seconds": 30}}})
        wait_until(lambda: any(m.get("method") == "tools/call" for m in received(recv_log)),
                   what="the call to be running upstream")
        gateway.stdout.close()
        gateway.stdin.close()
        gateway.wait(30)
        wait_until(lambda: not alive(grandchild), timeout=10,
                   what="the upstream's setsid grandchild to end with Coffer")
    finally:
        if gateway.poll() is None:
            gateway.kill()
        if grandchild and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# -- signals leave no orphans ------------------------------------------------------------------------------------------

def _start_with_upstreams(tmp_path, tag):
    logs, recv_log = [tmp_path / f"{tag}-{i}.pids" for i in range(3)], tmp_path / f"{tag}-a.recv"
    cli("config", "discovery_timeout", "1")
    cli("add", f"{tag}-a", "--", *FAKE, "--spawn-log", str(logs[0]), "--recv-log", str(recv_log))
    cli("add", f"{tag}-b", "--", *FAKE, "--spawn-log", str(logs[1]))
    cli("add", f"{tag}-c", "--", *FAKE, "--spawn-log", str(logs[2]), "--hang-initialize")
    gw = RawGateway()
    gw.initialize()
    gw.request("tools/list")
    gw.send(call_msg("busy", f"{tag}-a__slow", {"seconds": 30}))  # one call in flight
    pids = wait_until(lambda: len(p := [pid for log in logs for pid in pids_in(log)]) == 3 and p,
                      what="three upstream pids")
    wait_until(lambda: any(m.get("method") == "tools/call" for m in received(recv_log)),
               what="the call to be running upstream")
    assert all(alive(pid) for pid in pids)
    return gw, pids


def _reap(gw, pids):
    """Whatever a failed assertion left running: the upstreams, then the gateway."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    gw.close()


@posix_only
def test_kill_9_of_the_gateway_leaves_no_orphans(home, tmp_path):
    gw, pids = _start_with_upstreams(tmp_path, "k")
    try:
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(5)
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=5.0, interval=0.05,
                   what=f"upstreams {pids} to exit after kill -9 of the gateway")
    finally:
        _reap(gw, pids)


@posix_only
def test_sigterm_shuts_down_every_upstream(home, tmp_path):
    gw, pids = _start_with_upstreams(tmp_path, "t")
    try:
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=2.0, interval=0.05,
                   what=f"upstreams {pids} to be gone after a clean shutdown")
    finally:
        _reap(gw, pids)


@posix_only
@pytest.mark.parametrize("how", ["stdin-eof", "sigterm"])
def test_an_upstreams_setsid_child_does_not_outlive_the_gateway(home, tmp_path, watched_gateway, how):
    pid_file = tmp_path / "child.pid"
    add_hostile("s", "setsid-child", extra=("--pid-file", str(pid_file)))
    gw = open_session(watched_gateway)
    assert text_of(call_tool(gw, "s__echo", {"text": "up"})) == "up"
    child = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), what="the child pid"))
    assert alive(child)
    try:
        if how == "sigterm":
            gw.proc.send_signal(signal.SIGTERM)
        gw.close()
        wait_until(lambda: not alive(child), timeout=15, what=f"the setsid child {child} to be ended")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


@posix_only
def test_the_setsid_child_of_an_upstream_that_crashed_does_not_outlive_the_gateway(home, tmp_path,
                                                                                   watched_gateway):
    """A server that daemonizes a helper and later crashes: the helper is re-parented away from the dead server,
    so finding it at shutdown needs Coffer to have kept track of it (e.g. as a child subreaper on Linux)."""
    pid_file = tmp_path / "children.pid"
    quick_restarts()
    add_hostile("s", "setsid-child", extra=("--pid-file", str(pid_file)))
    gw = open_session(watched_gateway)
    assert text_of(call_tool(gw, "s__echo", {"text": "first"})) == "first"
    call_tool(gw, "s__crash")
    assert text_of(call_tool(gw, "s__echo", {"text": "second"}, timeout=60)) == "second"
    children = [int(p) for p in wait_until(lambda: len(pid_file.read_text().split()) >= 2 and
                                           pid_file.read_text().split(), what="two children")]
    try:
        gw.close()
        wait_until(lambda: not any(alive(pid) for pid in children), timeout=15,
                   what=f"the setsid children {children} to be ended")
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
