"""One Coffer per user: `coffer serve` relays to the user's shared service.  Real clients (the MCP SDK and raw
JSON-RPC), real relay and service processes, a real Unix socket; upstream processes are counted by the spawn log
each fake server writes at start."""

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client

from conftest import (
    FAKE,
    RawGateway,
    alive,
    call_msg,
    cli,
    coffer_cmd,
    gateway_params,
    serve_a_newer_build,
    service_pid,
    stop_service,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the service tests use POSIX process control")


@pytest.fixture
def service_home(home, monkeypatch):
    """A COFFER_HOME whose `coffer serve` relays to a shared service; the service is stopped afterwards."""
    monkeypatch.setenv("COFFER_SERVE_MODE", "service")
    home.mkdir(parents=True, exist_ok=True)
    yield home
    stop_service(home)


def spawns(path):
    return path.read_text().split() if path.exists() else []


def status(home):
    return json.loads(cli("status", "--json").stdout)


def relay_params():
    return gateway_params()  # a plain `coffer serve`: in service mode, the relay


def test_clients_of_both_eras_share_one_process_per_upstream(service_home, tmp_path):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    results = {}

    async def session(mode, name, attached, leave):
        async with Client(relay_params(), mode=mode, client_info=types.Implementation(name=name, version="7")) \
                as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            reply = await client.call_tool("a__echo", {"text": name})
            results[name] = (tools, text_of(reply))
            attached.set()
            await leave.wait()

    async def main():
        events = [anyio.Event() for _ in range(4)]
        leave = anyio.Event()
        async with anyio.create_task_group() as group:
            for i, mode in enumerate(("legacy", "legacy", "2026-07-28", "2026-07-28")):
                group.start_soon(session, mode, f"agent-{i}", events[i], leave)
            for event in events:
                await event.wait()
            results["status"] = await anyio.to_thread.run_sync(status, service_home)
            leave.set()

    anyio.run(main)
    for i in range(4):
        tools, echoed = results[f"agent-{i}"]
        assert "a__echo" in tools and echoed == f"agent-{i}"
    assert len(spawns(log)) == 1, "four sessions must share one upstream process"
    state = results["status"]
    assert state["service"]["pid"] == service_pid(service_home)
    assert sorted(s["client"] for s in state["sessions"]) == [f"agent-{i}" for i in range(4)]
    assert sorted(s["era"] for s in state["sessions"]) == ["handshake", "handshake", "modern", "modern"]
    assert all(s["calls"] == 1 and s["version"] == "7" for s in state["sessions"])
    upstream = next(u for u in state["upstreams"] if u["name"] == "a")
    assert upstream["sharing"] == "shared" and upstream["state"] == "ready" and upstream["sessions"] == 4
    assert upstream["pid"] == int(spawns(log)[0]) and upstream["last_call"]


def test_five_simultaneous_first_starts_end_up_with_one_service(service_home, tmp_path, raw_gateway):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    gateways = [raw_gateway() for _ in range(5)]
    for i, gw in enumerate(gateways):
        gw.initialize(name=f"c{i}")
    for i, gw in enumerate(gateways):
        assert gw.request("tools/call", {"name": "a__echo", "arguments": {"text": str(i)}})["result"][
            "content"][0]["text"] == str(i)
    services = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_service_of(p, service_home)]
    assert len(services) == 1, services
    assert len(spawns(log)) == 1


def _is_service_of(proc: Path, home) -> bool:
    try:
        cmdline = (proc / "cmdline").read_bytes()
        environ = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"'service', 'run'" in cmdline and f"COFFER_HOME={home}".encode() in environ


def test_a_killed_service_fails_the_calls_in_flight_and_the_session_goes_on(service_home, tmp_path, raw_gateway):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    gw = raw_gateway()
    gw.initialize()
    assert gw.request("tools/list")["result"]["tools"]
    first = service_pid(service_home)
    gw.send(call_msg("slow", "a__slow", {"seconds": 30}))
    wait_until(lambda: any(s["calls"] for s in status(service_home)["sessions"]), what="the call to be in flight")
    os.kill(first, signal.SIGKILL)
    failed = gw.wait_response("slow", timeout=30)
    assert "service stopped" in failed["error"]["message"]
    again = gw.request("tools/call", {"name": "a__echo", "arguments": {"text": "still here"}}, timeout=60)
    assert again["result"]["content"][0]["text"] == "still here"
    assert service_pid(service_home) not in (None, first)
    with gw.cond:
        assert any(n["method"] == "notifications/tools/list_changed" for n in gw.notifications)
    assert not alive(int(spawns(log)[0])), "the dead service's upstream is not left behind"


def test_a_client_gone_mid_call_costs_only_its_own_calls(service_home, tmp_path):
    received = tmp_path / "received"
    cli("add", "a", "--", *FAKE, "--recv-log", str(received))
    leaving, staying = RawGateway(), RawGateway()
    try:
        for gw in (leaving, staying):
            gw.initialize()
        leaving.send(call_msg("mine", "a__slow", {"seconds": 30}))
        wait_until(lambda: received.exists() and "a__slow" not in received.read_text() and
                   '"slow"' in received.read_text(), what="the slow call to reach the server")
        leaving.proc.kill()
        leaving.proc.wait()
        wait_until(lambda: "notifications/cancelled" in received.read_text(), what="the call to be cancelled")
        answer = staying.request("tools/call", {"name": "a__echo", "arguments": {"text": "fine"}})
        assert answer["result"]["content"][0]["text"] == "fine"
    finally:
        leaving.close()
        staying.close()


def test_sampling_reaches_the_calling_client_only(service_home, tmp_path):
    """A shared server that asks a client something depends on its client: the question goes to the one client
    whose call it serves, and from then on every client gets an instance of its own."""
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    asked = {"one": 0, "two": 0}

    def model(name):
        async def sampling(ctx, params):
            asked[name] += 1
            return types.CreateMessageResult(role="assistant", model="m",
                                             content=types.TextContent(type="text", text=f"answer of {name}"))
        return sampling

    answers = {}

    async def session(name, go, done):
        async with Client(relay_params(), mode="legacy", sampling_callback=model(name),
                          client_info=types.Implementation(name=name, version="1")) as client:
            await client.list_tools()
            await go.wait()
            answers[name] = text_of(await client.call_tool("a__sample", {"prompt": "hi"}))
            done.set()

    async def main():
        go_one, go_two, one_done, two_done = anyio.Event(), anyio.Event(), anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(session, "one", go_one, one_done)
            group.start_soon(session, "two", go_two, two_done)
            go_one.set()
            await one_done.wait()
            go_two.set()
            await two_done.wait()

    anyio.run(main)
    assert answers == {"one": "answer of one", "two": "answer of two"}
    assert asked == {"one": 1, "two": 1}
    shown = cli("show", "a").stdout
    assert "per-client" in shown and "sampling" in shown


def test_a_roots_asking_server_runs_per_client_with_each_clients_roots(service_home, tmp_path):
    log = tmp_path / "spawns"
    cli("add", "fs", "--", *FAKE, "--ask-roots", "--tools", "roots", "--spawn-log", str(log))
    roots_of = {}

    def roots(name):
        async def list_roots(ctx):
            return types.ListRootsResult(roots=[types.Root(uri=f"file:///work/{name}", name=name)])
        return list_roots

    async def session(name, ready, leave):
        async with Client(relay_params(), mode="legacy", list_roots_callback=roots(name),
                          client_info=types.Implementation(name=name, version="1")) as client:
            await client.list_tools()
            roots_of[name] = json.loads(text_of(await client.call_tool("fs__roots", {})))
            ready.set()
            await leave.wait()

    async def main():
        ready = [anyio.Event(), anyio.Event()]
        leave = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(session, "alpha", ready[0], leave)
            group.start_soon(session, "beta", ready[1], leave)
            for event in ready:
                await event.wait()
            roots_of["status"] = await anyio.to_thread.run_sync(status, service_home)
            leave.set()

    anyio.run(main)
    assert [r["uri"] for r in roots_of["alpha"]["roots"]] == ["file:///work/alpha"]
    assert [r["uri"] for r in roots_of["beta"]["roots"]] == ["file:///work/beta"]
    assert len(spawns(log)) == 3, "the first, shared instance, then one for each client"
    upstream = next(u for u in roots_of["status"]["upstreams"] if u["name"] == "fs")
    assert upstream["sharing"] == "per-client" and upstream["sessions"] == 2
    shown = cli("show", "fs").stdout
    assert "per-client" in shown and "roots" in shown
    audit = cli("audit", "--json").stdout
    assert "per-client" in audit


def test_another_local_user_cannot_reach_the_service(service_home, raw_gateway):
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    cli("add", "a", "--", *FAKE)
    gw = raw_gateway()
    gw.initialize()
    path = json.loads((service_home / "service.json").read_text())["path"]
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert (os.stat(os.path.dirname(path)).st_mode & 0o777) == 0o700
    probe = ("import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print(type(e).__name__)\nelse:\n"
             "    print('connected')\n")
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no interpreter outside root's folders for uid nobody to run")
    nobody = subprocess.run([python, "-c", probe, path], capture_output=True, text=True, timeout=30,
                            user="nobody", cwd="/", env={})
    assert nobody.stdout.strip() == "PermissionError", nobody.stdout + nobody.stderr


def test_a_stale_socket_from_a_crashed_service_is_replaced(service_home, raw_gateway):
    cli("add", "a", "--", *FAKE)
    gw = raw_gateway()
    gw.initialize()
    dead = service_pid(service_home)
    gw.close()
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: not alive(dead), what="the service to die")
    assert (service_home / "service.sock").exists()  # left behind by the kill
    again = raw_gateway()
    again.initialize()
    assert again.request("tools/call", {"name": "a__echo", "arguments": {"text": "x"}})["result"]
    assert service_pid(service_home) != dead


def test_an_idle_service_exits_and_status_says_so(service_home, raw_gateway):
    cli("config", "service_idle_exit", "1")
    gw = raw_gateway()
    gw.initialize()
    pid = service_pid(service_home)
    assert status(service_home)["service"]["pid"] == pid
    gw.close()
    wait_until(lambda: not alive(pid), timeout=30, what="the idle service to exit")
    assert status(service_home) == {"service": None, "sessions": [], "upstreams": []}
    assert not (service_home / "service.json").exists()


def test_standalone_runs_no_service(service_home):
    cli("add", "a", "--", *FAKE)
    proc = subprocess.Popen(coffer_cmd("serve", "--standalone"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        proc.stdin.write((json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}})
            + "\n" + json.dumps(call_msg(2, "a__echo", {"text": "in-process"})) + "\n").encode())
        proc.stdin.flush()
        replies = {}
        while 2 not in replies:
            message = json.loads(proc.stdout.readline())
            replies[message.get("id")] = message
        assert replies[2]["result"]["content"][0]["text"] == "in-process", replies
        assert service_pid(service_home) is None and status(service_home)["service"] is None
    finally:
        proc.kill()
        proc.wait()


def test_the_service_log_holds_no_secret(service_home, raw_gateway):
    secret = "sk-test-" + "Zq9" * 10
    cli("secret", "set", "API_TOKEN", input=secret + "\n")
    cli("add", "a", "--env", "API_TOKEN=${API_TOKEN}", "--", *FAKE, "--stderr-env", "API_TOKEN")
    gw = raw_gateway()
    gw.initialize()
    assert gw.request("tools/call", {"name": "a__echo", "arguments": {"text": "x"}})["result"]
    logged = (service_home / "logs" / "service.log").read_text()
    assert "API_TOKEN=***" in logged and secret not in logged
    assert (os.stat(service_home / "logs" / "service.log").st_mode & 0o777) == 0o600


def test_the_service_log_rotates_keeping_its_last_backups(tmp_path, monkeypatch):
    """Past its size the service's log moves to service.log.1 (.1 to .2, ...); only LOG_BACKUPS old files stay,
    and no record is lost or reordered across them."""
    import logging
    import re
    import stat

    from coffer_src.service import server

    monkeypatch.setattr(server, "LOG_BYTES", 500)
    previous_umask = os.umask(0o022)  # what most users have: files 0644 unless made private
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        server.log_to_file(str(tmp_path))
        for n in range(60):
            logging.getLogger("coffer_src.test").info("record %03d %s", n, "x" * 40)
        root.handlers[0].close()
    finally:
        os.umask(previous_umask)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    logs = tmp_path / "logs"
    names = ["service.log.3", "service.log.2", "service.log.1", "service.log"]  # oldest first
    assert sorted(os.listdir(logs)) == sorted(names)
    assert all(os.path.getsize(logs / name) < 500 for name in names)
    kept = [int(n) for name in names for n in re.findall(r"record (\d+)", (logs / name).read_text())]
    assert kept == list(range(kept[0], 60)) and kept[0] > 0
    # each file is the user's alone, the ones opened after a rotation too, whatever the umask
    assert all(stat.S_IMODE(os.stat(logs / name).st_mode) == 0o600 for name in names)


def test_a_newer_coffer_takes_over_without_dropping_a_session(service_home, tmp_path):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    old = RawGateway()
    try:
        old.initialize(name="old-client")
        first_service = service_pid(service_home)
        stop, failures, answered = threading.Event(), [], []

        def load():
            i = 0
            while not stop.is_set():
                i += 1
                reply = old.request("tools/call", {"name": "a__echo", "arguments": {"text": str(i)}}, timeout=60)
                if reply.get("result", {}).get("content", [{}])[0].get("text") != str(i):
                    failures.append(reply)
                answered.append(i)

        worker = threading.Thread(target=load)
        worker.start()
        wait_until(lambda: len(answered) > 5, what="calls under way")
        new = None
        try:
            new = serve_a_newer_build(tmp_path / "newer")
            wait_until(lambda: service_pid(service_home) not in (None, first_service), what="the new service")
            wait_until(lambda: not alive(first_service), timeout=60, what="the old service to finish and exit")
            count = len(answered)
            wait_until(lambda: len(answered) > count + 5, what="calls after the handover")
        finally:
            stop.set()
            worker.join(60)
            if new is not None:
                new.kill()
                new.wait()
        assert failures == [], failures[:3]
    finally:
        old.close()


def test_an_idle_shared_upstream_is_stopped_listed_still_and_started_again_on_demand(service_home, tmp_path,
                                                                                    raw_gateway):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    cli("config", "upstream_idle_stop", "1")
    gw = raw_gateway()
    gw.initialize()
    assert gw.request("tools/call", {"name": "a__echo", "arguments": {"text": "one"}})["result"]
    first = int(spawns(log)[0])
    wait_until(lambda: not alive(first), what="the idle upstream to be stopped")
    upstream = next(u for u in status(service_home)["upstreams"] if u["name"] == "a")
    assert upstream["state"] == "stopped (idle)" and upstream["pid"] is None
    assert "a__echo" in [t["name"] for t in gw.request("tools/list")["result"]["tools"]]
    again = gw.request("tools/call", {"name": "a__echo", "arguments": {"text": "two"}}, timeout=60)
    assert again["result"]["content"][0]["text"] == "two"
    assert len(spawns(log)) == 2


def test_the_cli_uses_the_running_service_and_starts_no_server(service_home, tmp_path, raw_gateway):
    log = tmp_path / "spawns"
    cli("add", "a", "--", *FAKE, "--spawn-log", str(log))
    gw = raw_gateway()
    gw.initialize()
    assert gw.request("tools/list")["result"]["tools"]
    assert len(spawns(log)) == 1
    called = json.loads(cli("call", "a__echo", '{"text": "via the service"}').stdout)
    assert called["content"][0]["text"] == "via the service"
    tools = json.loads(cli("tools", "--json").stdout)["tools"]
    assert "a__echo" in [t["name"] for t in tools]
    listed = json.loads(cli("list", "--json").stdout)["servers"]
    assert [(s["name"], s["status"]) for s in listed] == [("a", "ready")]
    cli("doctor", "--json", check=False)
    assert len(spawns(log)) == 1, "the CLI started a server of its own instead of asking the service"
    sessions = status(service_home)["sessions"]
    assert [s["client"] for s in sessions] == ["raw-test"]  # the CLI's own session has ended


@pytest.mark.parametrize("channel", ["socket", "pipe"])
def test_answers_queued_for_a_slow_relay_arrive_whole_and_never_interleaved(channel):
    """A relay that reads slowly: the service's output queues some answers while it sends others, from several
    threads at once; every line must still arrive intact (a write must never cut into a chunk being sent), over
    the socket and over the pipe a relay passes alike."""
    import socket
    import time

    from coffer_src.service.server import PipeOutput, SocketOutput

    if channel == "socket":
        service_end, relay_end = socket.socketpair()
        output = SocketOutput(service_end, "test")
        read_some = relay_end.recv
    else:
        relay_fd, service_fd = os.pipe()
        output = PipeOutput(service_fd, "test")

        def read_some(size):
            return os.read(relay_fd, size)
    lines = [(json.dumps({"id": n, "text": chr(65 + n % 26) * 300_000}) + "\n").encode() for n in range(40)]
    received: list[bytes] = []

    def slow_reader():
        data = bytearray()
        while data.count(b"\n") < len(lines):
            time.sleep(0.0005)  # a slow client: the channel fills, and room opens a little at a time
            chunk = read_some(16384)
            if not chunk:
                break
            data += chunk
        received.extend(bytes(data).splitlines(keepends=True))

    reader = threading.Thread(target=slow_reader)
    reader.start()
    def writer(part):
        for line in lines[part::4]:
            output.write(line)
            time.sleep(0.003)  # answers come one by one: the queue empties, and a write finds a chunk mid-send

    writers = [threading.Thread(target=writer, args=(part,)) for part in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    reader.join(120)
    output.close()
    if channel == "socket":
        service_end.close()
        relay_end.close()
    else:
        assert read_some(1 << 16) == b"", "the writer thread keeps its end open after the session closed it"
        os.close(relay_fd)
    assert sorted(received) == sorted(lines)


def test_a_session_offered_bad_pipes_gets_none_and_the_service_goes_on(service_home, raw_gateway):
    """A relay may pass the session's stream as two pipes (POSIX).  What arrives on the socket is hostile input:
    descriptors that are not pipes, the wrong way round, too many or none end that connection, every descriptor
    received is closed again (none leaks into the service), and the next client is served; a relay that offers
    no pipes is served over the socket itself."""
    import socket

    from coffer_src.service.channel import PIPES_SUPPORTED, connect

    if not PIPES_SUPPORTED or not os.path.isdir("/proc"):
        pytest.skip("no descriptor passing here, or no /proc to count the service's descriptors")
    cli("add", "a", "--", *FAKE)
    gw = raw_gateway()
    gw.initialize()  # starts the service
    pid = service_pid(service_home)

    def open_fds():
        return len(os.listdir(f"/proc/{pid}/fd"))

    hello = {"coffer": 1, "kind": "session", "version": "0", "build": "x", "pid": os.getpid(), "handover": False,
             "pipes": True}
    baseline = open_fds()
    file_fd = os.open(os.devnull, os.O_RDONLY)
    read_end, write_end = os.pipe()
    offers = [[file_fd, write_end],            # not a pipe
              [write_end, read_end],           # the wrong way round
              [read_end, write_end, file_fd],  # one too many
              []]                              # none at all
    for fds in offers:
        conn, answer = connect(str(service_home), dict(hello))
        assert answer.get("pipes") is True
        if fds:
            socket.send_fds(conn, [b"P"], fds)
        else:
            conn.sendall(b"P")
        conn.settimeout(10)
        assert conn.recv(1) == b"", "the service kept a session whose pipes it should have refused"
        conn.close()
    for fd in (file_fd, read_end, write_end):
        os.close(fd)
    wait_until(lambda: open_fds() <= baseline, what="every descriptor the service was sent to be closed again")
    assert "still here" in text_of(gw.request("tools/call", {"name": "a__echo", "arguments": {"text": "still here"}}))
    # A relay that cannot pass descriptors (Windows) offers none, and its session runs over the socket itself.
    conn, answer = connect(str(service_home), {**hello, "pipes": False})
    assert "pipes" not in answer
    conn.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "socket", "version": "1"}}})
        .encode() + b"\n" + json.dumps(call_msg(2, "a__echo", {"text": "over the socket"})).encode() + b"\n")
    conn.settimeout(30)
    data = b""
    while data.count(b"\n") < 2:
        chunk = conn.recv(1 << 16)
        assert chunk, "the service closed a session that offered no pipes"
        data += chunk
    replies = {reply["id"]: reply for reply in map(json.loads, data.splitlines())}
    assert "over the socket" in text_of(replies[2])
    conn.close()


def test_a_lost_service_fails_exactly_the_requests_it_left_unanswered(tmp_path):
    """The relay notes each request after passing it on; when the service goes, the client gets an error for
    each request still in flight (ids 1 and "1" are different requests), none for one answered or cancelled,
    and a cancel naming no valid id changes nothing."""
    import io
    import selectors
    import socket

    from coffer_src.service.relay import Attachment, Relay

    answers = io.BytesIO()
    relay = Relay(str(tmp_path), "v", "b", lambda first: None, client_in=io.BytesIO(), client_out=answers)
    relay.selector = selectors.DefaultSelector()
    ours, theirs = socket.socketpair()
    relay.current = Attachment(ours, {})
    requests = [call_msg(msg_id, "a__echo", {"text": "x"}) for msg_id in (1, "1", 2, 3)]
    relay._from_client(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
    assert theirs.recv(1 << 16).count(b"\n") == 4  # passed on whole, before any bookkeeping
    relay._from_client(b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":true}}\n'
                       b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3}}\n')
    deep = b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":' + b"[" * 50_000 + b"]" * 50_000 + b"}\n"
    passed = bytearray()

    def service_reads():
        while not passed.endswith(deep):
            chunk = theirs.recv(1 << 20)
            if not chunk:
                return
            passed.extend(chunk)

    reader = threading.Thread(target=service_reads, daemon=True)
    reader.start()
    relay._from_client(deep)  # too deep to parse: passed on for the service to refuse, the relay lives on
    reader.join(10)
    assert bytes(passed).count(b"\n") == 3 and passed.endswith(deep)
    relay._from_service(relay.current, b'{"jsonrpc":"2.0","id":"1","result":{"content":[]}}\n{"jsonrpc":"2.0",')
    replacement, _ = socket.socketpair()
    relay.attach = lambda first: Attachment(replacement, {})
    relay._service_lost(relay.current)
    seen = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert [m["id"] for m in seen if "result" in m] == ["1"]
    assert sorted(m["id"] for m in seen if "error" in m) == [1, 2]
    assert all("restarted" in m["error"]["message"] for m in seen if "error" in m)
