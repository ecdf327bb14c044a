"""Section 7 of evals.bench: the shared service (issue 22).

What a plain `coffer serve` costs now that it relays to the user's service, measured against `coffer serve
--standalone` (the gateway in the relay's own process) in the same run:

7a. call overhead    one call at a time through relay + service vs standalone, fixture echo tool;
7b. throughput       32 and 256 calls in flight over one session, service vs standalone;
7c. sharing          four SDK sessions (two handshake-era, two 2026-07-28) over eight stdio upstreams: upstream
                     processes (one each, not four), the fourth session's first tools/list and first call once the
                     upstreams are warm (against a direct call to the same server), every process's memory;
7d. idle memory      the service holding a ~1k-tool catalogue, and one relay.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import anyio

from evals.bench import (
    CATALOG_SERVER,
    COFFER,
    MODERN,
    PY,
    RELAY,
    Path_,
    Upstream,
    base_catalog,
    bench_latency,
    bench_throughput,
    coffer_cli,
    connect,
    latency_rows,
    log,
    make_upstream,
    pct,
    proc_status,
    startup_sets,
    synth_catalog,
)

TARGETS = [
    ("service.added_p50_ms", "relay + service vs standalone, added median per call", "<=", 0.10),
    ("service.throughput_ratio_32", "  throughput at 32 in flight vs standalone", ">=", 0.90),
    ("service.throughput_ratio_256", "  throughput at 256 in flight vs standalone", ">=", 0.90),
    ("service.upstream_processes_ratio", "four sessions: processes per shared upstream", "<=", 1.0),
    ("service.fourth_list_ms", "  the fourth session's first complete tools/list (warm)", "<=", 50.0),
    ("service.fourth_call_excess_ms", "  its first call minus a direct session's first call", "<=", 5.0),
    ("service.relay_rss_mb", "  RSS of one relay (worst of four)", "<=", 25.0),
    ("service.idle_rss_mb_1000", "idle RSS of the service at ~1k tools", "<=", 30.0),
]

SERVE = ["-c", "import sys; sys.path.insert(0, {root!r}); import coffer; sys.exit(coffer.main())", "serve"]


def serve_params(home: Path, mode: str):
    """`coffer serve` from bytecode in ``mode`` ("service": the relay; "standalone": the gateway in-process)."""
    from mcp.client.stdio import StdioServerParameters
    args = [SERVE[0], SERVE[1].format(root=str(Path(COFFER).parent)), SERVE[2]]
    env = {**os.environ, "COFFER_HOME": str(home), "COFFER_SERVE_MODE": mode}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the service is started from bytecode, as an installed one is
    return StdioServerParameters(command=PY, args=args, env=env)


def floor_params(home: Path):
    """`coffer serve --standalone` behind passthrough_relay.py (a relay that copies lines and parses nothing): what
    any process hop in Python costs on this machine, measured beside the relay's own hop."""
    params = serve_params(home, "standalone")
    return type(params)(command=PY, args=[RELAY, params.command, *params.args], env=params.env)


def make_home(workdir: Path, name: str, upstreams: list[Upstream], settings: dict | None = None) -> Path:
    home = workdir / name
    env = {**os.environ, "COFFER_HOME": str(home)}
    for up in upstreams:
        coffer_cli(["add", up.name, *[f"--env={k}={v}" for k, v in up.env.items()], "--", up.command, *up.args],
                   env)
    for key, value in {"discovery_timeout": "60", **(settings or {})}.items():
        coffer_cli(["config", key, str(value)], env)
    return home


def service_pid(home: Path) -> int | None:
    try:
        return json.loads((home / "service.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def stop_service(home: Path) -> None:
    coffer_cli(["service", "stop"], {**os.environ, "COFFER_HOME": str(home)})


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def rss_mb(pid: int | None) -> float | None:
    status = proc_status(pid) if pid else None
    return round(status["VmRSS"] / 1024, 1) if status else None


def relay_pids(home: Path) -> list[int]:
    """The relays of this home: `coffer serve` processes (service mode) whose COFFER_HOME is ``home``."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"coffer.main()" in cmdline and b"serve" in cmdline and f"COFFER_HOME={home}".encode() in environ \
                and b"COFFER_SERVE_MODE=service" in environ:
            found.append(int(entry))
    return found


async def bench_service(args, report, workdir: Path, errlog) -> None:
    data = report.data.setdefault("service", {})
    fx = make_upstream("fx", "fx", workdir)
    home = make_home(workdir, "service-hop", [fx])
    paths = [Path_("standalone", serve_params(home, "standalone"), "__"),
             Path_("service", serve_params(home, "service"), "__"),
             Path_("hop floor", floor_params(home), "__")]
    try:
        log(f"[7a] relay + service vs standalone: {args.calls} calls per path")
        samples = await bench_latency(paths, fx, args.calls, args.calls, args.batch, min(50, args.calls // 10),
                                      errlog)
        rows, latency = latency_rows("fx.echo", samples, baseline="standalone")
        report.table("7a. call overhead of the relay hop (fixture echo; added vs standalone; the hop floor: standalone "
                     "behind a parse-nothing Python relay)",
                     ["tool", "path", "n", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "ratio"], rows)
        data["latency"] = latency
        data["added_p50_ms"] = latency["service"]["added_p50_ms"]
        levels = [int(x) for x in args.inflight.split(",")]
        log(f"[7b] throughput at {levels} in flight")
        rates = await bench_throughput(paths, fx, levels, args.throughput_calls, args.throughput_rounds, errlog)
        report.table("7b. throughput (calls/s), service vs standalone (and the hop floor's)",
                     ["in flight", "standalone", "service", "ratio", "hop floor", "its ratio"],
                     [[lv, rates["standalone"][lv], rates["service"][lv],
                       f"{rates['service'][lv] / rates['standalone'][lv]:.2f}x", rates["hop floor"][lv],
                       f"{rates['hop floor'][lv] / rates['standalone'][lv]:.2f}x"] for lv in levels])
        data["throughput"] = rates
        for lv in levels:
            data[f"throughput_ratio_{lv}"] = rates["service"][lv] / rates["standalone"][lv]
    finally:
        stop_service(home)
    await bench_sharing(data, report, workdir, errlog)
    await bench_idle_memory(data, report, workdir, errlog)


async def bench_sharing(data: dict, report, workdir: Path, errlog) -> None:
    upstreams = startup_sets(workdir, [8])[8]
    log(f"[7c] four sessions over {len(upstreams)} upstreams")
    home = make_home(workdir, "service-shared", upstreams)
    fx = next(up for up in upstreams if up.kind == "fx")
    params = serve_params(home, "service")
    try:
        async with contextlib.AsyncExitStack() as stack:
            first = []
            for mode in ("legacy", MODERN, MODERN):  # the fourth is handshake-era: its attach is timed apart
                client = await stack.enter_async_context(connect(params, errlog, mode))
                first.append(client)
            expected = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # warm: every upstream up and listed
                tools = [t.name for t in (await first[0].list_tools()).tools]
                ready = all(any(t.startswith(f"{up.name}__") for t in tools) for up in upstreams)
                if ready:
                    expected = len(tools)
                    break
                await anyio.sleep(0.1)
            fourths = []  # five fourth sessions in turn (medians kept): one sample says more about the machine
            for _ in range(5):
                fourth = raw_session(params.command, params.args, params.env)  # see RawSession
                attached, list_ms, tools_seen = fourth.start()
                fourths.append((attached, list_ms, fourth.call(f"{fx.name}__echo")))
                fourth.close()
                if tools_seen != expected:
                    raise RuntimeError(f"a fourth session saw {tools_seen} of {expected} tools")
            attached, list_ms, call_ms = (statistics.median(column) for column in zip(*fourths))
            service = service_pid(home)
            state = json.loads(subprocess.run([PY, COFFER, "status", "--json"], capture_output=True, text=True,
                                              env={**os.environ, "COFFER_HOME": str(home)}).stdout)
            shared = [u for u in state["upstreams"] if u["sharing"] == "shared"]
            per_client = [u for u in state["upstreams"] if u["sharing"] == "per-client"]
            upstream_procs = len({u["pid"] for u in shared if u["pid"]})
            private_procs = len(children(service)) - upstream_procs if service else None
            relays = relay_pids(home)
            relay_rss = [rss_mb(pid) for pid in relays]
            service_rss = rss_mb(service)
        direct_ms = []  # the same first call on a fresh direct session: what an agent's first call costs anyway
        for _ in range(5):
            direct = raw_session(fx.command, fx.args, {**os.environ, **fx.env})
            direct.start()
            direct_ms.append(direct.call("echo"))
            direct.close()
    finally:
        stop_service(home)
    direct_p50 = pct([x / 1000 for x in direct_ms], 50) * 1000
    relay_values = [r for r in relay_rss if r is not None]
    data.update({"upstreams": len(upstreams), "upstream_processes": upstream_procs,
                 "shared_upstreams": len(shared), "per_client_upstreams": [u["name"] for u in per_client],
                 "per_client_processes": private_procs,
                 "upstream_processes_ratio": upstream_procs / len(shared) if shared else None,
                 "fourth_attach_ms": attached, "fourth_list_ms": list_ms, "fourth_call_ms": call_ms,
                 "direct_first_call_ms": direct_p50, "fourth_call_excess_ms": call_ms - direct_p50,
                 "service_rss_mb": service_rss, "relays_rss_mb": relay_rss,
                 "relay_rss_mb": max(relay_values) if relay_values else None,
                 "total_rss_mb": (service_rss or 0) + sum(relay_values)})
    report.table("7c. four sessions (two handshake-era, two 2026-07-28) over eight stdio upstreams",
                 ["upstream processes", "4th: attach ms", "4th: tools/list ms", "4th: first call ms",
                  "direct first call ms", "service RSS MB", "relays RSS MB"],
                 [[f"{upstream_procs} for {len(shared)} shared", attached, list_ms, call_ms, direct_p50,
                   service_rss, ", ".join(str(r) for r in relay_rss)]],
                 f"Per client (each asked its client for roots): {', '.join(u['name'] for u in per_client) or 'none'}; "
                 f"their instances running: {private_procs}, started by a session's first call to them.  "
                 "Attach: the relay's start and initialize; tools/list and the first call are timed after it, with a "
                 "plain JSON-RPC client (RawSession), as is the direct first call.")


class RawSession:
    """A client that writes JSON-RPC lines and reads the answers itself: the fourth session's first call is timed
    with it, so the SDK client's own first-call work (it prepares each tool's result validation on first use,
    more for a long tool list) lands on neither side of the comparison."""

    def __init__(self, command: str, args: list[str], env: dict):
        self.proc = subprocess.Popen([command, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.next_id = 0

    def request(self, method: str, params: dict) -> tuple[dict, float]:
        self.next_id += 1
        t = time.perf_counter()
        self.proc.stdin.write((json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method,
                                           "params": params}) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            message = json.loads(self.proc.stdout.readline())
            if message.get("id") == self.next_id and "method" not in message:
                return message, (time.perf_counter() - t) * 1000

    def start(self) -> tuple[float, float, int]:
        """(ms from spawn to initialize answered, ms of the first tools/list, tools it listed)."""
        t0 = time.perf_counter()
        self.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                    "clientInfo": {"name": "bench", "version": "1"}})
        attached = (time.perf_counter() - t0) * 1000
        self.proc.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        self.proc.stdin.flush()
        listed, list_ms = self.request("tools/list", {})
        return attached, list_ms, len(listed["result"]["tools"])

    def call(self, name: str) -> float:
        answer, ms = self.request("tools/call", {"name": name, "arguments": {"text": "first"}})
        if "result" not in answer or answer["result"].get("isError"):
            raise RuntimeError(f"{name} failed: {answer}")
        return ms

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def raw_session(command: str, args: list[str], env: dict) -> RawSession:
    return RawSession(command, args, env)


async def bench_idle_memory(data: dict, report, workdir: Path, errlog) -> None:
    catalog_file = workdir / "service-catalog-1000.jsonl"
    with open(catalog_file, "w", encoding="utf-8") as fh:  # the catalogue section 4's RSS figure holds
        for tool in synth_catalog(base_catalog()[0], 1000):
            fh.write(json.dumps(tool) + "\n")
    catalog = Upstream("catalog", "catalog", PY, [CATALOG_SERVER, str(catalog_file)])
    log("[7d] the service idle at ~1k tools")
    home = make_home(workdir, "service-1k", [catalog])
    params = serve_params(home, "service")
    try:
        async with connect(params, errlog) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len((await client.list_tools()).tools) < 1000:
                await anyio.sleep(0.2)
            await anyio.sleep(1.0)  # let the start's garbage settle before reading the idle figure
            service = service_pid(home)
            idle = rss_mb(service)
            relay = max((rss_mb(pid) or 0 for pid in relay_pids(home)), default=None)
    finally:
        stop_service(home)
    data.update({"idle_rss_mb_1000": idle, "relay_idle_rss_mb": relay})
    report.table("7d. memory at ~1k tools", ["process", "RSS MB"],
                 [["service (idle, holding the catalogue)", idle], ["relay", relay]])


def median(values):
    return statistics.median(values) if values else None
