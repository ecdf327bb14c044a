"""Performance benchmarks for Coffer: what does putting a gateway between an agent and its servers cost?

Run from the repository root::

    python -m evals.bench                 # full run, a few minutes on 2 cores
    python -m evals.bench --quick         # small sizes, about a minute, no FastMCP, for smoke tests
    python -m evals.bench --json          # everything machine-readable on stdout (tables go to stderr)

Every number is relative to a baseline measured in the same run, on the same machine, by the same client (the
official MCP Python SDK), so machine speed cancels out and the ratios travel:

1. call overhead   one tool call at a time, direct to the upstream vs through ``coffer serve`` (and FastMCP),
                   interleaved in batches so drift (thermal, noisy neighbours) hits every path alike;
1b. modern path    the same for MCP 2026-07-28: an SDK 2.x server that speaks only that revision, reached by a
                   2026-07-28 client directly, through Coffer, and by a handshake-era client through Coffer (the
                   cross-era bridge); plus a multi-round-trip (elicitation) call on each path;
2. throughput      32 and 256 calls in flight over one client session;
3. startup         spawn + initialize + a tools/list holding every upstream's tools, for 1, 4 and 8 real
                   upstreams, against the slowest of those upstreams started alone;
4. search          ``SearchIndex`` build time and query latency in-process for 100 .. 30k tools, the
                   end-to-end ``coffer__search_tools`` latency through the gateway, and the gateway's RSS
                   holding a ~1k-tool catalogue;
5. knowledge       ``coffer__ask`` over 10k generated Markdown passages: index time and ask latency in-process
                   (``KnowledgeBase``) and through ``coffer serve``, for both engines (SQLite FTS5, and Coffer's own
                   BM25F as a Python without FTS5 runs it);
6. peer            FastMCP's multi-server proxy fronting the same upstreams, in rows 1-3;
7. service         the shared service behind a plain `coffer serve` (evals/bench_service.py): the relay hop
                   against `serve --standalone`, four sessions sharing eight upstreams, memory.

Rows 1-5 measure `coffer serve --standalone` (the gateway in the client's own process), as earlier rounds did.

Targets are printed as PASS/MISS next to the numbers; a miss never changes the exit status, because a benchmark
on a loaded CI runner is evidence, not a verdict.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import anyio

from evals.run import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
COFFER = str(ROOT / "coffer.py")
PY = sys.executable
FAKE_SERVER = str(ROOT / "tests" / "fixtures" / "fake_server.py")
#: Searches that warm the commonest terms before a first pass is timed, in-process and through the gateway alike.
FIRST_PASS_WARMUP = 20
CATALOG_SERVER = str(ROOT / "evals" / "fixtures" / "catalog_server.py")
FASTMCP_PROXY = str(ROOT / "evals" / "fixtures" / "fastmcp_proxy.py")
RELAY = str(ROOT / "evals" / "fixtures" / "passthrough_relay.py")
PROFILED_COFFER = str(ROOT / "evals" / "fixtures" / "profiled_coffer.py")
MODERN_ONLY = str(ROOT / "tests" / "fixtures" / "modern_only.py")  # SDK 2.x, answers initialize with -32022
MODERN = "2026-07-28"  # the stateless revision; an SDK client in this mode sends no initialize
NODE_MODULES = ROOT / ".ci" / "node_modules" / "@modelcontextprotocol"
EVERYTHING_JS = NODE_MODULES / "server-everything" / "dist" / "index.js"
MEMORY_JS = NODE_MODULES / "server-memory" / "dist" / "index.js"
PROJECT_CATALOG = ROOT / "evals" / "data" / "catalog.jsonl"
PROJECT_QUERIES = ROOT / "evals" / "data" / "queries.jsonl"
SHARED_EVALS = ROOT.parent / "shared" / "evals"
ASK_CORPUS = ROOT / "evals" / "ask_data" / "corpus"            # pinned docs (click, flask): the word statistics
ASK_QUESTIONS = ROOT / "evals" / "ask_data" / "questions.jsonl"  # 269 questions people wrote about those docs

# How the benchmarks start the gateway.  "installed" is what `pip install`/`uvx coffer` gives: the module
# imported from compiled bytecode.  "script" is `python coffer.py serve` (a vendored copy), which Python
# recompiles at every start; it is measured for memory only, next to the installed form.
SERVE_ARGS = {
    "installed": ["-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import coffer; sys.exit(coffer.main())",
                  "serve"],
    "script": [COFFER, "serve"],
    # The gateway as it runs on a Python whose sqlite3 lacks FTS5 (the knowledge base then keeps Coffer's own
    # BM25F index in memory): the same module with its FTS5 probe answered "no", as tests/test_knowledge.py does.
    "no-fts5": ["-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import coffer; "
                      "coffer._FTS5_AVAILABLE = False; sys.exit(coffer.main())", "serve"],
}
# How to find each form's process in /proc.
SERVE_NEEDLE = {"installed": "import coffer", "script": "coffer.py serve", "no-fts5": "import coffer"}


def ensure_bytecode() -> None:
    """Compile coffer.py into __pycache__ as `pip install` does at install time (editable installs and
    PYTHONDONTWRITEBYTECODE leave none), so the installed form really starts from bytecode."""
    import py_compile
    py_compile.compile(COFFER, doraise=True)


sys.path.insert(0, str(ROOT))
# Rows 1-5 run the gateway in the client's process; section 7 sets the mode per path.
os.environ.setdefault("COFFER_SERVE_MODE", "standalone")
import coffer  # noqa: E402  (the module under test lives at the repository root, not in a package)

# Targets: (key in results, label, comparison, threshold).  Evaluated after the run, printed PASS/MISS.
TARGETS = [
    ("call.max_added_p50_ms", "added median latency per call (worst tool)", "<=", 0.25),
    ("throughput.ratio_32", "throughput at 32 in flight vs direct (worst tool)", ">=", 0.85),
    ("modern.added_p50_ms", "added median latency, 2026-07-28 client and upstream", "<=", 0.25),
    ("modern.bridge_added_p50_ms", "  the same, handshake-era client bridged to it", "<=", 0.25),
    ("startup.excess_ms_8", "startup with 8 upstreams minus slowest single", "<=", 50.0),
    ("startup.live_excess_ms_8", "  the same, first session (serve --live)", "<=", 50.0),
    ("search.p50_ms_1000", "search p50 at 1k tools (in-process)", "<=", 1.0),
    ("search.p50_ms_10000", "search p50 at 10k tools (in-process)", "<=", 1.0),
    ("search.p95_ms_10000", "  its p95", "<=", 3.0),
    ("search.p50_ms_30000", "search p50 at 30k tools (in-process)", "<=", 3.0),
    ("search.gw_excess_ms_1000", "search via coffer serve at 1k, first pass, minus in-process and ping", "<=", 0.5),
    ("search.gw_repeat_excess_ms_1000", "  the same, repeated queries", "<=", 0.5),
    ("search.gw_excess_ms_10000", "search via coffer serve at 10k, first pass, minus in-process and ping", "<=",
     0.5),
    ("search.gw_repeat_excess_ms_10000", "  the same, repeated queries", "<=", 0.5),
    ("search.raw_excess_ms_10000", "  first pass with a raw JSON client (Coffer's part alone)", "<=", 0.5),
    ("search.raw_repeat_excess_ms_10000", "  the same, repeated queries", "<=", 0.5),
    ("search.build_ms_10000", "index build at 10k distinct tools (cold caches)", "<=", 300.0),
    ("rss.idle_mb", "idle RSS of coffer serve at ~1k tools", "<=", 40.0),
    ("knowledge.fts5.index_s", "knowledge: index 10k passages, fts5 (s)", "<=", 10.0),
    ("knowledge.bm25f.index_s", "knowledge: index 10k passages, bm25f (s)", "<=", 10.0),
    ("knowledge.fts5.p50_ms", "coffer__ask p50 at 10k passages, fts5 (in-process)", "<=", 20.0),
    ("knowledge.bm25f.p50_ms", "coffer__ask p50 at 10k passages, bm25f (in-process)", "<=", 20.0),
    ("knowledge.fts5.gw_p50_ms", "  the same through coffer serve, fts5", "<=", 20.0),
    ("knowledge.bm25f.gw_p50_ms", "  the same through coffer serve, bm25f", "<=", 20.0),
]


# ------------------------------------------------------------------------------------------------- output

def log(message: str) -> None:
    """Progress goes to stderr so ``--json`` keeps stdout clean."""
    print(message, file=sys.stderr, flush=True)


class Report:
    """Collects tables (for people) and a nested dict (for machines) as the benchmarks run."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.data: dict = {}
        self.tables: list[str] = []

    def table(self, title: str, headers: list[str], rows: list[list], note: str | None = None) -> None:
        cells = [[_cell(v) for v in row] for row in rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
        lines = [f"\n== {title}", "  ".join(h.ljust(w) for h, w in zip(headers, widths)),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) for r in cells]
        if note:
            lines.append(note)
        text = "\n".join(lines)
        self.tables.append(text)
        print(text, file=sys.stderr if self.as_json else sys.stdout, flush=True)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return False


def pct(values: list[float], p: float) -> float:
    """Percentile by linear interpolation between closest ranks (p in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------------- servers

@dataclass
class Upstream:
    """A real MCP server the benchmarks put behind the gateways: how to spawn it, and what to call on it."""

    name: str
    kind: str
    command: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def params(self):
        from mcp.client.stdio import StdioServerParameters
        return StdioServerParameters(command=self.command, args=self.args, env={**os.environ, **self.env})

    def relayed(self):
        """The same server behind passthrough_relay.py: one process hop that parses nothing."""
        from mcp.client.stdio import StdioServerParameters
        return StdioServerParameters(command=PY, args=[RELAY, self.command, *self.args],
                                     env={**os.environ, **self.env})


def node_available() -> bool:
    return bool(shutil.which("node")) and EVERYTHING_JS.exists() and MEMORY_JS.exists()


def make_upstream(kind: str, name: str, workdir: Path) -> Upstream:
    if kind == "time":
        return Upstream(name, kind, PY, ["-m", "mcp_server_time"])
    if kind == "fx":
        return Upstream(name, kind, PY, [FAKE_SERVER, "--tools", "echo"])
    if kind == "modern":
        return Upstream(name, kind, PY, [MODERN_ONLY])
    if kind == "everything":
        return Upstream(name, kind, "node", [str(EVERYTHING_JS), "stdio"])
    if kind == "memory":
        return Upstream(name, kind, "node", [str(MEMORY_JS)], {"MEMORY_FILE_PATH": str(workdir / f"{name}.jsonl")})
    raise ValueError(kind)


# The tool each benchmark calls on an upstream kind: cheap, deterministic, no side effects.
CALL_TARGETS = {"time": ("get_current_time", {"timezone": "UTC"}), "fx": ("echo", {"text": "hello"}),
                "modern": ("echo", {"message": "hello"})}
# A call that needs the client mid-call: on 2026-07-28 an input_required result and a retry carrying the answer
# (multi round-trip), on the handshake era a real elicitation request from the server.
MRTR_TARGET = ("ask_elicitation", {})


@dataclass
class Path_:
    """One way for the client to reach the upstreams: directly, through Coffer, or through FastMCP."""

    label: str
    params: object                  # StdioServerParameters
    prefix: str | None              # how the gateway names tools: "<server>__", "<server>_", or None (direct)
    slow: bool = False              # FastMCP's default proxy spawns every upstream per request
    mode: str = "legacy"            # the SDK client's protocol mode: "legacy" (initialize) or MODERN
    elicitation: bool = False       # the client declares elicitation (and answers it), for MRTR_TARGET


class Gateways:
    """Builds the gateway processes' configuration (a COFFER_HOME, a FastMCP config file) for a set of upstreams."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.errlog = open(workdir / "stderr.log", "a", encoding="utf-8")  # noqa: SIM115 - lives as long as we do
        self._count = 0

    def coffer(self, upstreams: list[Upstream], settings: dict | None = None, form: str = "installed",
               label: str = "coffer", mode: str = "legacy", elicitation: bool = False) -> Path_:
        from mcp.client.stdio import StdioServerParameters
        self._count += 1
        home = self.workdir / f"coffer-home-{self._count}"
        env = {**os.environ, "COFFER_HOME": str(home)}
        for up in upstreams:
            flags = [f"--env={k}={v}" for k, v in up.env.items()]
            coffer_cli(["add", up.name, *flags, "--", up.command, *up.args], env)
        # Wait for every upstream on the first tools/list (the default 5 s budget would cut startup short on a
        # loaded 2-core runner and make the startup numbers measure the budget instead of the servers).
        for key, value in {"discovery_timeout": "60", **(settings or {})}.items():
            coffer_cli(["config", key, str(value)], env)
        return Path_(label, StdioServerParameters(command=PY, args=SERVE_ARGS[form], env=env), "__", mode=mode,
                     elicitation=elicitation)

    def fastmcp(self, upstreams: list[Upstream], shared: bool) -> Path_:
        from mcp.client.stdio import StdioServerParameters
        self._count += 1
        config = {"mcpServers": {up.name: {"command": up.command, "args": up.args, "env": up.env}
                                 for up in upstreams}}
        path = self.workdir / f"fastmcp-{self._count}.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        env = {**os.environ, "FASTMCP_LOG_LEVEL": "WARNING"}
        args = [FASTMCP_PROXY, str(path)] + (["--shared"] if shared else [])
        label = "fastmcp-shared" if shared else "fastmcp-default"
        return Path_(label, StdioServerParameters(command=PY, args=args, env=env), "_", slow=not shared)


def _run(argv: list[str], env: dict) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:4])} failed: {proc.stderr.strip()}")


def coffer_cli(argv: list[str], env: dict) -> None:
    """One ``coffer`` CLI command, started as installed (from bytecode: ~0.14 s instead of ~0.33 s for the
    script form, which recompiles the module; the bench runs dozens of these while setting up)."""
    _run([PY, *SERVE_ARGS["installed"][:2], *argv], env)


def fastmcp_problem() -> str | None:
    """Why FastMCP cannot be benchmarked here, or None when it can."""
    try:
        import fastmcp  # noqa: F401
        from fastmcp.server import create_proxy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip the peer rows"
        return f"fastmcp is not importable ({exc.__class__.__name__}: {exc}); pip install fastmcp"
    return None


async def accept_elicitation(context, params):
    """The user of the benchmark client: accepts every elicitation with the name the fixture asks for."""
    import mcp_types
    return mcp_types.ElicitResult(action="accept", content={"name": "Ada"})


@contextlib.asynccontextmanager
async def connect(params, errlog, mode: str = "legacy", elicitation: bool = False):
    """An SDK client session over stdio with the server's stderr kept out of the report.

    ``mode``: "legacy" opens the handshake era (initialize); MODERN sends every request with the 2026-07-28
    envelope and no handshake.  ``cache=None``: the SDK's response cache would otherwise answer repeated list
    requests itself (it caches modern list results for their ttlMs).  ``elicitation``: declare the capability
    and accept every request (the MRTR rows).
    """
    from mcp import Client
    from mcp.client.stdio import stdio_client
    extra = {"elicitation_callback": accept_elicitation} if elicitation else {}
    async with Client(stdio_client(params, errlog=errlog), mode=mode, cache=None,
                      read_timeout_seconds=300, **extra) as client:
        yield client


def resolve_tool(names: list[str], server: str, tool: str, prefix: str | None) -> str:
    """The name a path exposes ``server``'s ``tool`` under (FastMCP leaves a lone server's names unprefixed)."""
    candidates = [tool] if prefix is None else [f"{server}{prefix}{tool}", tool]
    for candidate in candidates:
        if candidate in names:
            return candidate
    raise RuntimeError(f"{tool!r} of {server!r} not listed; saw {sorted(names)[:10]}")


# ------------------------------------------------------------------------------------------------- 1. latency

async def open_session(stack, path, upstream, tool, errlog):
    """Connect one path's client and find what the tool is called on that path (listing the tools also
    gives the SDK client the output schemas it validates results against, so no call re-lists them)."""
    client = await stack.enter_async_context(connect(path.params, errlog, path.mode, path.elicitation))
    names = [t.name for t in (await client.list_tools()).tools]
    return client, names, resolve_tool(names, upstream.name, tool, path.prefix)


class LatencyPlan(NamedTuple):
    """One tool to time on every path: what to call, and how many calls per path (``slow_n`` on slow paths)."""

    tool: str
    arguments: dict
    n: int
    slow_n: int


async def bench_latency(paths: list[Path_], upstream: Upstream, n: int, slow_n: int, batch: int, warmup: int,
                        errlog) -> dict:
    """Sequential calls to the upstream kind's CALL_TARGETS tool on every path (see bench_latency_plans)."""
    tool, arguments = CALL_TARGETS[upstream.kind]
    return (await bench_latency_plans(paths, upstream, [LatencyPlan(tool, arguments, n, slow_n)], batch, warmup,
                                      errlog))[0]


async def bench_latency_plans(paths: list[Path_], upstream: Upstream, plans: list[LatencyPlan], batch: int,
                              warmup: int, errlog) -> list[dict]:
    """Per plan, sequential calls of its tool on every path over the same sessions (opened once), interleaved:
    round r runs one batch per path, in an order rotated by r, so slow drift and ordering effects are shared
    instead of landing on one path.

    Also the CPU each ``coffer serve`` used per call it forwarded (``_cpu_us_per_call``, by path label): its
    process is found as the one that appeared while that path connected."""
    results = []
    async with contextlib.AsyncExitStack() as stack:
        sessions, gateway_pid = [], {}
        for path in paths:
            before = set(children_matching(os.getpid(), SERVE_NEEDLE["installed"]))
            client, names, _ = await open_session(stack, path, upstream, plans[0].tool, errlog)
            started = set(children_matching(os.getpid(), SERVE_NEEDLE["installed"])) - before
            if len(started) == 1:
                gateway_pid[path.label] = started.pop()
            sessions.append((path, client, names))
        for plan in plans:
            samples: dict = {p.label: [] for p in paths}
            timed = []
            for path, client, names in sessions:
                name = resolve_tool(names, upstream.name, plan.tool, path.prefix)
                quota = plan.slow_n if path.slow else plan.n
                for _ in range(min(warmup, quota)):
                    result = await client.call_tool(name, plan.arguments)
                    if result.is_error:
                        raise RuntimeError(f"{path.label}: {name} failed: {result.content}")
                timed.append((path, client, name, quota))
            rounds = max(1, math.ceil(plan.n / batch))
            cpu_before = {label: cpu_seconds(pid) for label, pid in gateway_pid.items()}
            for r in range(rounds):
                for i in range(len(timed)):
                    path, client, name, quota = timed[(i + r) % len(timed)]
                    got = samples[path.label]
                    size = min(math.ceil(quota / rounds), quota - len(got))
                    for _ in range(size):
                        t0 = time.perf_counter()
                        result = await client.call_tool(name, plan.arguments)
                        got.append(time.perf_counter() - t0)
                        if result.is_error:
                            raise RuntimeError(f"{path.label}: {name} failed: {result.content}")
            # Coffer's CPU per forwarded call (idle ticking while other paths run is included: an upper bound).
            samples["_cpu_us_per_call"] = {
                label: (cpu_seconds(pid) - cpu_before[label]) / len(samples[label]) * 1e6
                for label, pid in gateway_pid.items() if cpu_before[label] is not None and samples[label]}
            results.append(samples)
    return results


def latency_rows(tool_label: str, samples: dict, baseline: str = "direct") -> tuple[list[list], dict]:
    """Table rows and data for one tool's samples; added latency and ratios are against ``baseline``."""
    cpu = samples.pop("_cpu_us_per_call", None) or {}
    d50, d99 = pct(samples[baseline], 50) * 1000, pct(samples[baseline], 99) * 1000
    rows, data = [], {"coffer_cpu_us_per_call": cpu.get("coffer"), "cpu_us_per_call": cpu, "baseline": baseline}
    for label, values in samples.items():
        p50, p99 = pct(values, 50) * 1000, pct(values, 99) * 1000
        added = None if label == baseline else p50 - d50
        added_p99 = None if label == baseline else p99 - d99
        ratio = p50 / d50 if d50 else None
        rows.append([tool_label, label, len(values), p50, p99, added, added_p99, f"{ratio:.2f}x"])
        data[label] = {"n": len(values), "p50_ms": p50, "p99_ms": p99, "mean_ms": statistics.fmean(values) * 1000,
                       "added_p50_ms": added, "added_p99_ms": added_p99, "ratio_p50": ratio}
    return rows, data


# ------------------------------------------------------------------------------------------------- 2. throughput

async def run_inflight(client, name: str, arguments: dict, inflight: int, total: int) -> float:
    """Calls per second with ``inflight`` concurrent callers sharing one session until ``total`` calls are done."""
    remaining = total

    async def worker():
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            result = await client.call_tool(name, arguments)
            if result.is_error:
                raise RuntimeError(f"{name} failed under load: {result.content}")

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(inflight, total)):
            tg.start_soon(worker)
    return total / (time.perf_counter() - t0)


async def bench_throughput(paths: list[Path_], upstream: Upstream, levels: list[int], total: int, rounds: int,
                           errlog) -> dict:
    """Median calls/s per path and concurrency level over ``rounds`` alternating rounds.

    FastMCP's default proxy spawns every upstream per request, so it runs one round of exactly ``level`` calls
    at the lowest level only (at 256 in flight it would start hundreds of interpreters at once)."""
    tool, arguments = CALL_TARGETS[upstream.kind]
    rates: dict[str, dict[int, list[float]]] = {p.label: {lv: [] for lv in levels} for p in paths}
    async with contextlib.AsyncExitStack() as stack:
        sessions = []
        for path in paths:
            client, _, name = await open_session(stack, path, upstream, tool, errlog)
            await run_inflight(client, name, arguments, 8, 8 if path.slow else 64)  # warm up
            sessions.append((path, client, name))
        for r in range(rounds):
            for level in levels:
                for i in range(len(sessions)):
                    path, client, name = sessions[(i + r) % len(sessions)]
                    if path.slow:
                        if r == 0 and level == min(levels):
                            rates[path.label][level].append(await run_inflight(client, name, arguments, level, level))
                        continue
                    rates[path.label][level].append(
                        await run_inflight(client, name, arguments, level, max(total, 2 * level)))
    return {label: {lv: statistics.median(v) if v else None for lv, v in by.items()} for label, by in rates.items()}


# ------------------------------------------------------------------------------------------------- 3. startup

async def time_startup(params, expected_tools: int, extra: int, errlog, deadline_s: float = 120.0) -> float:
    """Seconds from spawn to a tools/list holding ``expected_tools`` upstream tools (+``extra`` of the gateway's)."""
    t0 = time.perf_counter()
    async with connect(params, errlog) as client:
        while True:
            tools = (await client.list_tools()).tools
            if len(tools) >= expected_tools + extra:
                elapsed = time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > deadline_s:
                raise RuntimeError(f"only {len(tools)} of {expected_tools + extra} tools after {deadline_s:g}s")
            await anyio.sleep(0.005)
    return elapsed


async def time_first_call(params, tool: str, arguments: dict, errlog) -> float:
    """Seconds from spawn to the first successful call of ``tool`` (the gateway may list it before its server
    is up; this is when the agent can actually use it)."""
    t0 = time.perf_counter()
    async with connect(params, errlog) as client:
        await client.list_tools()
        result = await client.call_tool(tool, arguments)
        if result.is_error:
            raise RuntimeError(f"{tool} failed at startup: {result.content}")
        return time.perf_counter() - t0


async def time_parallel_direct(upstreams: list[Upstream], counts: dict[str, int], errlog) -> float:
    """Seconds until every upstream, each spawned directly by its own client at the same moment, has listed its
    tools.  Not a target baseline, a diagnostic: on a 2-core machine N servers starting at once compete for the
    CPU, and this row separates that contention (paid with or without a gateway) from the gateway's own cost."""
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for up in upstreams:
            tg.start_soon(time_startup, up.params(), counts[up.kind], 0, errlog)
    return time.perf_counter() - t0


STARTUP_MIX = ["time", "everything", "memory", "fx"]


def startup_sets(workdir: Path, sizes: list[int]) -> dict[int, list[Upstream]]:
    """1 upstream: mcp-server-time; 4: time, everything, memory, fixture; 8: the four twice, names suffixed -2."""
    kinds = STARTUP_MIX if node_available() else ["time", "fx"]
    sets = {}
    for size in sizes:
        ups = []
        for i in range(size):
            kind = kinds[i % len(kinds)]
            copy = i // len(kinds)
            ups.append(make_upstream(kind, kind if copy == 0 else f"{kind}-{copy + 1}", workdir))
        sets[size] = ups
    return sets


async def bench_startup(gateways: Gateways, sets: dict[int, list[Upstream]], reps: int, peers: list[str],
                        errlog, warmup: bool = True) -> dict:
    """Median startup per gateway and set size, and per upstream kind started alone (the baseline).
    FastMCP rows are timed once (they take seconds and differ by seconds; repeats would dominate the run).

    One warm-up pass first, so every run sees a warm page cache (Node and Python imports) and none pays for
    first-touch disk reads."""
    kinds = {}
    for ups in sets.values():
        for up in ups:
            kinds.setdefault(up.kind, up)
    counts = {}
    for kind, up in kinds.items():
        async with connect(up.params(), errlog) as client:
            counts[kind] = len((await client.list_tools()).tools)
    configs = {}
    for size, ups in sets.items():
        remembered = gateways.coffer(ups)
        live = Path_("coffer --live", remembered.params.model_copy(
            update={"args": [*remembered.params.args, "--live"]}), "__")
        configs[size] = {"coffer": remembered, "coffer --live": live}
    for size, ups in sets.items():
        for peer in peers:
            configs[size][peer] = gateways.fastmcp(ups, shared=peer == "fastmcp-shared")
    direct: dict[str, list[float]] = {k: [] for k in kinds}
    via: dict[int, dict[str, list[float]]] = {
        s: {label: [] for label in ["direct-parallel", *configs[s], "coffer, first call"]} for s in sets}
    for rep in range(0 if warmup else 1, reps + 1):  # rep 0 is the warm-up
        for kind, up in kinds.items():
            t = await time_startup(up.params(), counts[kind], 0, errlog)
            if rep:
                direct[kind].append(t)
        for size, ups in sets.items():
            expected = sum(counts[up.kind] for up in ups)
            t = await time_parallel_direct(ups, counts, errlog)
            if rep:
                via[size]["direct-parallel"].append(t)
            for label, path in configs[size].items():
                if label.startswith("fastmcp") and (rep > 1 or (rep == 0 and size > min(sets))):
                    continue  # seconds per pass, and seconds slower than the rest: one timed pass suffices
                t = await time_startup(path.params, expected, 1 if label.startswith("coffer") else 0, errlog)
                if rep:
                    via[size][label].append(t)
            # mcp-server-time is the slowest to start (it imports the MCP SDK): its first call is the latest
            callable_ups = [up for up in ups if up.kind in CALL_TARGETS]
            if callable_ups:
                up = min(callable_ups, key=lambda u: u.kind != "time")
                tool, arguments = CALL_TARGETS[up.kind]
                t = await time_first_call(configs[size]["coffer"].params, f"{up.name}__{tool}", arguments, errlog)
                if rep:
                    via[size]["coffer, first call"].append(t)
    return {"direct": {k: statistics.median(v) for k, v in direct.items()},
            "direct_samples": direct, "counts": counts,
            "via": {s: {label: statistics.median(v) for label, v in by.items() if v} for s, by in via.items()},
            "via_samples": via}


# ------------------------------------------------------------------------------------------------- 4. search

def base_catalog() -> tuple[list[dict], list[str]]:
    """Every real tool catalogue at hand, deduplicated by name: the project's and the shared eval sets'."""
    sources = [PROJECT_CATALOG]
    if SHARED_EVALS.is_dir():
        sources += sorted(p for p in SHARED_EVALS.glob("*/catalog.jsonl") if p.is_file())
    tools, seen = [], set()
    for source in sources:
        for tool in read_jsonl(source):
            if tool.get("name") not in seen:
                seen.add(tool["name"])
                tools.append(tool)
    return tools, [str(s) for s in sources]


def synth_catalog(base: list[dict], size: int, distinct: bool = True) -> list[dict]:
    """``size`` tools: a fixed-seed sample of ``base`` when it is big enough, else copies of it with the server
    part renamed (``github-2__create_issue``) so names stay unique and each copy looks like another server.

    ``distinct``: every copy's texts differ from the original's (see ``varied_tool``), as in a real catalogue
    of that size; with exact copies the tokenizer's per-text cache analyses only ``len(base)`` texts, and an
    index build would look cheaper than it is."""
    if size <= len(base):
        return random.Random(0).sample(base, size)
    vocabulary = catalog_vocabulary(base) if distinct else None
    tools = []
    for copy in range(1, math.ceil(size / len(base)) + 1):
        for tool in base:
            if len(tools) == size:
                return tools
            name = tool["name"]
            if copy > 1:
                server, sep, short = name.partition("__")
                name = f"{server}-{copy}__{short}" if sep else f"{name}-{copy}"
                if vocabulary:
                    tools.append(varied_tool({**tool, "name": name}, vocabulary, random.Random(name)))
                    continue
            tools.append({**tool, "name": name})
    return tools


def catalog_vocabulary(base: list[dict]) -> tuple[list[str], list[int]]:
    """The words of the base catalogue's descriptions, with cumulative counts for drawing by frequency."""
    counts: collections.Counter = collections.Counter()
    for tool in base:
        counts.update(re.findall(r"[A-Za-z][A-Za-z0-9]+", str(tool.get("description") or "")))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked], list(itertools.accumulate(count for _, count in ranked))


def varied_tool(tool: dict, vocabulary: tuple[list[str], list[int]], rng: random.Random) -> dict:
    """Another server's version of ``tool``: about a third of the words of its description and parameter
    descriptions swapped for catalogue words drawn by frequency, and half the time one more word in its short
    name (``create_issue_comment``), so its texts are new to the tokenizer but keep realistic lengths and
    vocabulary."""
    words, cumulative = vocabulary

    def vary(text: str) -> str:
        tokens = text.split(" ")
        swaps = rng.choices(words, cum_weights=cumulative, k=len(tokens))
        return " ".join(swap if rng.random() < 0.33 else token for token, swap in zip(tokens, swaps))

    varied = {**tool, "description": vary(str(tool.get("description") or ""))}
    if rng.random() < 0.5:
        server, _, short = tool["name"].partition("__")
        varied["name"] = f"{server}__{short}_{rng.choices(words, cum_weights=cumulative)[0].lower()}"[:64]
    schema = tool.get("inputSchema")
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        properties = {key: ({**value, "description": vary(value["description"])}
                            if isinstance(value, dict) and isinstance(value.get("description"), str) else value)
                      for key, value in schema["properties"].items()}
        varied["inputSchema"] = {**schema, "properties": properties}
    return varied


def queries() -> list[str]:
    return [row["query"] for row in read_jsonl(PROJECT_QUERIES)]


def bench_search_inprocess(base: list[dict], sizes: list[int], n_queries: int, build_reps: int) -> dict:
    """Index build and per-query latency, in this process.  A cold build starts with the tokenizer's caches
    emptied (a gateway's first build): ``build_ms`` is the median of ``build_reps`` cold builds up to 10k tools
    (one above), since one sample on a shared machine says more about the minute than the code; the rebuild
    figure is the median of ``build_reps`` - 1 builds (at least one) with the caches warm (what a catalogue
    change costs when most texts were seen before).

    Beyond the base catalogue every tool's texts are distinct (``synth_catalog``); for those sizes up to 10k the
    cold build of exact copies is reported too (``build_copies_ms``, what earlier reports measured: the
    tokenizer then analyses only the base's texts)."""
    texts = queries()
    out = {}
    for size in sizes:
        copies_ms = None
        if len(base) < size <= 10_000:
            copies = synth_catalog(base, size, distinct=False)
            clear_term_caches()
            t0 = time.perf_counter()
            coffer.SearchIndex(copies)
            copies_ms = (time.perf_counter() - t0) * 1000
            del copies
        tools = synth_catalog(base, size)
        colds, index = [], None
        for _ in range(max(1, build_reps) if size <= 10_000 else 1):
            index = None  # a gateway's first build has no earlier index beside it
            clear_term_caches()
            t0 = time.perf_counter()
            index = coffer.SearchIndex(tools)
            colds.append(time.perf_counter() - t0)
        builds = [colds[-1]]
        for _ in range(max(1, build_reps - 1) if size <= 10_000 else 1):
            t0 = time.perf_counter()
            index = coffer.SearchIndex(tools)
            builds.append(time.perf_counter() - t0)
        for q in texts[:FIRST_PASS_WARMUP]:  # warm caches (stemmer memo, if any) before timing
            index.search(q, 5)
        lat = []
        for i in range(n_queries):
            q = texts[i % len(texts)]
            t0 = time.perf_counter()
            index.search(q, 5)
            lat.append(time.perf_counter() - t0)
        out[size] = {"build_ms": statistics.median(colds) * 1000, "cold_builds_ms": [c * 1000 for c in colds],
                     "rebuild_ms": statistics.median(builds[1:]) * 1000,
                     "build_copies_ms": copies_ms,
                     "p50_ms": pct(lat, 50) * 1000,
                     # each query once on a new index: what the gateway row's first pass measures too
                     "first_pass_p50_ms": pct(lat[FIRST_PASS_WARMUP:len(texts)], 50) * 1000,
                     "p95_ms": pct(lat, 95) * 1000, "queries": n_queries}
        log(f"  search in-process {size} tools: build {out[size]['build_ms']:.0f} ms, p50 {out[size]['p50_ms']:.3f} ms")
    return out


def proc_status(pid: int) -> dict[str, int] | None:
    """VmRSS/VmHWM of a process in kB from /proc, or None where there is no /proc (macOS, Windows)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in fh) if k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (10 ms resolution), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def children_matching(parent: int, needle: str) -> list[int]:
    """Pids of ``parent``'s children whose command line contains ``needle`` (the SDK does not expose its pids)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and needle in cmdline:
            found.append(int(entry))
    return found


async def bench_search_gateway(gateways: Gateways, base: list[dict], size: int, calls: int, measure_rss: bool,
                               errlog, form: str = "installed") -> dict:
    """``coffer__search_tools`` through ``coffer serve`` fronting one upstream that lists ``size`` tools.

    Each search is paired with a ``ping`` on the same session (interleaved), the cheapest round trip the
    gateway answers itself: search p50 minus ping p50 is the cost of searching as the client sees it.  With
    ``measure_rss``, the gateway's idle RSS is read after discovery settles and its peak after the load."""
    catalog_file = gateways.workdir / f"catalog-{size}.jsonl"
    with open(catalog_file, "w", encoding="utf-8") as fh:
        for tool in synth_catalog(base, size):
            fh.write(json.dumps(tool) + "\n")
    upstream = Upstream("cat", "catalog", PY, [CATALOG_SERVER, str(catalog_file)])
    path = gateways.coffer([upstream], form=form)
    texts = queries()
    out: dict = {"size": size}
    t0 = time.perf_counter()
    async with connect(path.params, errlog) as client:
        listed = len((await client.list_tools()).tools)
        out["ready_s"] = time.perf_counter() - t0
        out["listed"] = listed
        pids = children_matching(os.getpid(), SERVE_NEEDLE[form])
        if measure_rss and pids:
            await anyio.sleep(1.0)  # let the discovery burst settle; the invocation-log thread flushes
            gateway_pid = pids[0]
            upstream_pids = children_matching(gateway_pid, "catalog_server.py")
            out["idle"] = proc_status(gateway_pid)
            out["upstream_idle"] = proc_status(upstream_pids[0]) if upstream_pids else None
        search, ping, again = [], [], []
        warnings.filterwarnings("ignore", message="ping is removed")  # deprecated in modern mode; we use legacy
        # The first pass sends each query once (every term's first use); then the same queries again, as the
        # in-process figure's repeated queries do: the two p50s compare with in-process first-pass and p50.
        for i in range(2 * calls):
            t1 = time.perf_counter()
            await client.send_ping()
            t2 = time.perf_counter()
            result = await client.call_tool(coffer.SEARCH_TOOL, {"query": texts[i % calls % len(texts)],
                                                                 "top_k": 5})
            t3 = time.perf_counter()
            if result.is_error:
                raise RuntimeError(f"search failed: {result.content}")
            ping.append(t2 - t1)
            (search if i < calls else again).append(t3 - t2)
        if measure_rss and pids:
            out["peak"] = proc_status(pids[0])
    if calls:
        # The same window as the in-process first pass: each query's first use, after the first
        # FIRST_PASS_WARMUP queries warmed the commonest terms (there they are a warm-up pass, here the start).
        first = search[FIRST_PASS_WARMUP:] if len(search) > 2 * FIRST_PASS_WARMUP else search
        out.update({"calls": calls, "p50_ms": pct(first, 50) * 1000, "p95_ms": pct(search, 95) * 1000,
                    "repeat_p50_ms": pct(again, 50) * 1000, "ping_p50_ms": pct(ping, 50) * 1000})
        log(f"  search via gateway {size} tools: p50 {out['p50_ms']:.2f} ms first pass, {out['repeat_p50_ms']:.2f} ms "
            f"repeated (ping {out['ping_p50_ms']:.2f} ms)")
    return out



def bench_search_gateway_raw(gateways: Gateways, base: list[dict], size: int, calls: int, errlog) -> dict:
    """The gateway row again, on a gateway of its own (so its first pass is a first pass too), with a client that
    only frames and parses JSON lines instead of the SDK's: what Coffer itself adds to a search beyond a ping,
    apart from what a client library spends on a reply of several kilobytes (parsing it into its models,
    checking it against the tool's outputSchema)."""
    catalog_file = gateways.workdir / f"catalog-{size}.jsonl"
    upstream = Upstream("cat", "catalog", PY, [CATALOG_SERVER, str(catalog_file)])
    path = gateways.coffer([upstream])
    proc = subprocess.Popen([path.params.command, *path.params.args], env=path.params.env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=errlog)
    ids = itertools.count(1)

    def request(method: str, params: dict | None = None) -> dict:
        msg_id = next(ids)
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method,
                                     **({"params": params} if params is not None else {})}).encode() + b"\n")
        proc.stdin.flush()
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"coffer serve ended during {method}")
            message = json.loads(line)
            if message.get("id") == msg_id:
                return message

    texts = queries()
    search, ping, again = [], [], []
    try:
        request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                               "clientInfo": {"name": "bench-raw", "version": "1"}})
        proc.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        proc.stdin.flush()
        request("tools/list")
        for i in range(2 * calls):
            t1 = time.perf_counter()
            request("ping")
            t2 = time.perf_counter()
            answer = request("tools/call", {"name": coffer.SEARCH_TOOL,
                                            "arguments": {"query": texts[i % calls % len(texts)], "top_k": 5}})
            t3 = time.perf_counter()
            if "result" not in answer or answer["result"].get("isError"):
                raise RuntimeError(f"search failed: {str(answer)[:300]}")
            ping.append(t2 - t1)
            (search if i < calls else again).append(t3 - t2)
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    first = search[FIRST_PASS_WARMUP:] if len(search) > 2 * FIRST_PASS_WARMUP else search
    out = {"calls": calls, "p50_ms": pct(first, 50) * 1000, "repeat_p50_ms": pct(again, 50) * 1000,
           "ping_p50_ms": pct(ping, 50) * 1000}
    log(f"  search via gateway {size} tools, raw JSON client: p50 {out['p50_ms']:.2f} ms first pass, "
        f"{out['repeat_p50_ms']:.2f} ms repeated (ping {out['ping_p50_ms']:.2f} ms)")
    return out

# ------------------------------------------------------------------------------------------------- 5. knowledge

def corpus_words() -> tuple[list[str], list[int]]:
    """The words of the pinned documentation corpus with their counts, most frequent first (ties by spelling):
    a unigram model of real technical prose, so generated passages have realistic term statistics (stop words,
    a long tail of rare terms, identifiers such as url_for) and the real questions hit them as they hit docs."""
    counts: collections.Counter = collections.Counter()
    for path in sorted(ASK_CORPUS.rglob("*")):
        if path.is_file():
            counts.update(re.findall(r"[A-Za-z][A-Za-z0-9_]{1,30}", path.read_text(encoding="utf-8",
                                                                                     errors="replace")))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked], [count for _, count in ranked]


def write_knowledge_corpus(folder: Path, passages: int, sections_per_file: int = 10, seed: int = 14) -> int:
    """Generate a deterministic Markdown tree of ``passages`` sections in 20 folders, ``sections_per_file``
    per file: a title, then '## ' sections of two paragraphs (every fourth with a fenced code block), each
    under Coffer's 1,500-character packing size, so each section becomes one passage.  Returns the file count."""
    words, counts = corpus_words()
    cumulative = list(itertools.accumulate(counts))
    rng = random.Random(seed)

    def draw(k: int) -> list[str]:
        return rng.choices(words, cum_weights=cumulative, k=k)

    def sentence() -> str:
        text = " ".join(draw(rng.randint(8, 16)))
        return text[0].upper() + text[1:] + "."

    files = math.ceil(passages / sections_per_file)
    for number in range(files):
        lines = [f"# {' '.join(draw(3)).title()}", ""]
        for section in range(min(sections_per_file, passages - number * sections_per_file)):
            lines += [f"## {' '.join(draw(rng.randint(2, 5))).capitalize()}", ""]
            for _ in range(2):
                lines += [" ".join(sentence() for _ in range(rng.randint(3, 4))), ""]
            if section % 4 == 3:
                lines += ["```python"] + [f"{a}.{b}({c}={d!r})" for a, b, c, d in
                                          (draw(4) for _ in range(rng.randint(2, 5)))] + ["```", ""]
        target = folder / f"part{number % 20:02d}" / f"doc{number:05d}.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines), encoding="utf-8")
    return files


def ask_questions() -> list[str]:
    return [row["question"] for row in read_jsonl(ASK_QUESTIONS)]


def clear_term_caches() -> None:
    """Empty the tokenizer's memo tables, so an index build pays what a fresh process pays."""
    coffer.forget_analysed_texts()


@contextlib.contextmanager
def fts5_probe(available: bool):
    """Run as a Python with (or without) FTS5 in its sqlite3 would (the module checks once and keeps the answer)."""
    saved = coffer._FTS5_AVAILABLE
    coffer._FTS5_AVAILABLE = None if available else False  # None: the module probes sqlite3 again
    try:
        yield
    finally:
        coffer._FTS5_AVAILABLE = saved


def bench_knowledge_inprocess(corpus: Path, db_path: Path, home: Path, engine: str, questions: list[str],
                              n_queries: int) -> dict:
    """Index ``corpus`` as one source with ``engine`` (cold caches), then time ``KnowledgeBase.ask`` (what
    coffer__ask calls) over the questions: the first ask of a freshly opened knowledge base (a gateway start:
    for bm25f it builds the in-memory index) and ``n_queries`` more, first uses of every term included."""
    clear_term_caches()
    with fts5_probe(engine == "fts5"):
        kb = coffer.KnowledgeBase(str(db_path), str(home), engine=engine)
        t0 = time.perf_counter()
        stats = kb.add_source(str(corpus), name="docs")
        index_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        unchanged = kb.changed()   # the serve watcher's poll: a stat per file, nothing read
        poll_ms = (time.perf_counter() - t0) * 1000
        kb.close()
        clear_term_caches()
        kb = coffer.KnowledgeBase(str(db_path), str(home), engine=engine)
        t0 = time.perf_counter()
        first = kb.ask(questions[0], 5)
        first_ms = (time.perf_counter() - t0) * 1000
        lat, empty = [], 0
        for i in range(n_queries):
            question = questions[i % len(questions)]
            t0 = time.perf_counter()
            answer = kb.ask(question, 5)
            lat.append(time.perf_counter() - t0)
            empty += not answer.passages
        kb.close()
    if unchanged:
        raise RuntimeError("knowledge: changed() right after indexing")
    out = {"engine": engine, "ranker": first.ranker, "files": stats.files_seen, "passages": stats.passages_added,
           "index_s": index_s, "watch_poll_ms": poll_ms, "first_ask_ms": first_ms, "queries": n_queries,
           "p50_ms": pct(lat, 50) * 1000, "p95_ms": pct(lat, 95) * 1000, "no_passage_share": empty / n_queries}
    log(f"  knowledge in-process {engine}: {out['passages']} passages indexed in {index_s:.2f} s, "
        f"ask p50 {out['p50_ms']:.2f} ms")
    return out


async def bench_knowledge_gateway(home: Path, engine: str, questions: list[str], calls: int, errlog) -> dict:
    """``coffer__ask`` through ``coffer serve`` (no upstream; the knowledge source set up in ``home``), each
    ask paired with a ``ping`` on the same session as in section 4.  The first ask pays the knowledge base's
    start (for bm25f, building its in-memory index) and is reported on its own; the serve watcher polls the
    folder every 2 s meanwhile, as it does for a user."""
    from mcp.client.stdio import StdioServerParameters
    form = "installed" if engine == "fts5" else "no-fts5"
    params = StdioServerParameters(command=PY, args=SERVE_ARGS[form], env={**os.environ, "COFFER_HOME": str(home)})
    out: dict = {"engine": engine}
    async with connect(params, errlog) as client:
        names = [t.name for t in (await client.list_tools()).tools]
        if coffer.ASK_TOOL not in names:
            raise RuntimeError(f"{coffer.ASK_TOOL} not listed by coffer serve: {names}")
        pids = children_matching(os.getpid(), SERVE_NEEDLE[form])
        t0 = time.perf_counter()
        result = await client.call_tool(coffer.ASK_TOOL, {"question": questions[0], "top_k": 5})
        out["first_ask_ms"] = (time.perf_counter() - t0) * 1000
        if result.is_error or not (result.structured_content or {}).get("passages"):
            raise RuntimeError(f"coffer__ask failed: {result.content}")
        out["total_searched"] = result.structured_content.get("total_searched")
        for question in questions[1:11]:  # warm up the session
            await client.call_tool(coffer.ASK_TOOL, {"question": question, "top_k": 5})
        warnings.filterwarnings("ignore", message="ping is removed")
        ask, ping = [], []
        for i in range(calls):
            t1 = time.perf_counter()
            await client.send_ping()
            t2 = time.perf_counter()
            result = await client.call_tool(coffer.ASK_TOOL, {"question": questions[i % len(questions)], "top_k": 5})
            t3 = time.perf_counter()
            if result.is_error:
                raise RuntimeError(f"coffer__ask failed: {result.content}")
            ping.append(t2 - t1)
            ask.append(t3 - t2)
        status = proc_status(pids[0]) if len(pids) == 1 else None
    out.update({"calls": calls, "p50_ms": pct(ask, 50) * 1000, "p95_ms": pct(ask, 95) * 1000,
                "ping_p50_ms": pct(ping, 50) * 1000,
                "rss_mb": status["VmRSS"] / 1024 if status else None,
                "peak_rss_mb": status["VmHWM"] / 1024 if status else None})
    log(f"  knowledge via gateway {engine}: ask p50 {out['p50_ms']:.2f} ms (ping {out['ping_p50_ms']:.2f} ms)")
    return out


# ------------------------------------------------------------------------------------------------- profile

async def profile_gateway(gateways: Gateways, upstream: Upstream, calls: int, out: Path, errlog) -> str:
    """Run the call-overhead load (sequential calls, then 32 in flight) against a ``coffer serve`` profiled in
    every thread, and return the top of the merged profile, by cumulative and by own time."""
    import io
    import pstats

    from mcp.client.stdio import StdioServerParameters
    env = gateways.coffer([upstream]).params.env
    params = StdioServerParameters(command=PY, args=[PROFILED_COFFER, str(out), "serve"], env=env)
    tool, arguments = CALL_TARGETS[upstream.kind]
    async with connect(params, errlog) as client:
        names = [t.name for t in (await client.list_tools()).tools]
        name = resolve_tool(names, upstream.name, tool, "__")
        for _ in range(calls):
            await client.call_tool(name, arguments)
        await run_inflight(client, name, arguments, 32, calls)
    for _ in range(100):  # the shim writes the file as the process exits
        if out.exists():
            break
        await anyio.sleep(0.05)
    buffer = io.StringIO()
    stats = pstats.Stats(str(out), stream=buffer)
    stats.strip_dirs().sort_stats("cumulative").print_stats(r"coffer\.py", 25)  # Coffer's own functions
    stats.sort_stats("tottime").print_stats(20)  # everything, own time (blocking waits show up here too)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------- driver

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m evals.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (about a minute)")
    parser.add_argument("--json", action="store_true", help="print all results as JSON on stdout")
    parser.add_argument("--only", default="call,modern,throughput,startup,search,knowledge,service",
                        help="comma-separated sections to run (call, modern, throughput, startup, search, knowledge, "
                             "service)")
    parser.add_argument("--no-fastmcp", action="store_true", help="skip the FastMCP peer rows")
    parser.add_argument("--fastmcp", action="store_true",
                        help="with --quick: include FastMCP's shared proxy (left out by default: +~25 s)")
    parser.add_argument("--calls", type=int, help="sequential calls per path and tool (default 2000; quick 200)")
    parser.add_argument("--fastmcp-default-calls", type=int,
                        help="calls through FastMCP's default proxy, which spawns per request (default 10; quick 4)")
    parser.add_argument("--batch", type=int, default=100, help="calls per path per interleaved batch")
    parser.add_argument("--mrtr-calls", type=int, help="elicitation (multi round-trip) calls per path on the "
                                                       "modern path (default 500; quick 50)")
    parser.add_argument("--inflight", help="concurrency levels for throughput (default 32,256; quick 32)")
    parser.add_argument("--throughput-calls", type=int,
                        help="calls per throughput measurement, at least 2x the level (default 1000; quick 200)")
    parser.add_argument("--throughput-rounds", type=int, help="alternating rounds, median kept (default 2; quick 1)")
    parser.add_argument("--startup-sizes", default="1,4,8", help="numbers of upstreams for startup")
    parser.add_argument("--startup-reps", type=int,
                        help="startup repetitions after a warm-up pass, median kept (default 3; quick 1, no warm-up)")
    parser.add_argument("--search-sizes", help="catalogue sizes (default 100,1000,10000,30000)")
    parser.add_argument("--search-queries", type=int, help="timed in-process queries per size (default 2000)")
    parser.add_argument("--e2e-sizes", help="sizes searched through the gateway (default 1000,10000)")
    parser.add_argument("--e2e-calls", type=int, help="searches through the gateway per size (default 300)")
    parser.add_argument("--knowledge-passages", type=int, default=10_000,
                        help="generated passages for the knowledge section (default 10000)")
    parser.add_argument("--knowledge-queries", type=int, help="timed in-process asks per engine (default 2000; "
                                                              "quick 269, each question once)")
    parser.add_argument("--knowledge-calls", type=int, help="coffer__ask calls through the gateway per engine "
                                                            "(default 300; quick 50)")
    parser.add_argument("--profile", metavar="OUT.pstats",
                        help="also profile `coffer serve` (all threads) under the call load, print its top "
                             "functions and keep the pstats file")
    parser.add_argument("--profile-calls", type=int, default=2000, help="calls per phase of the profiled load")
    parser.add_argument("--build-reps", type=int, help="cold index builds per size up to 10k (median kept), "
                                                        "and one fewer warm rebuilds (default 3; quick 2)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"calls": 200 if quick else 2000, "mrtr_calls": 50 if quick else 500,
                "knowledge_queries": 269 if quick else 2000, "knowledge_calls": 50 if quick else 300,
                "fastmcp_default_calls": 4 if quick else 10,
                "throughput_calls": 200 if quick else 1000, "throughput_rounds": 1 if quick else 2,
                "startup_reps": 1 if quick else 3, "search_queries": 300 if quick else 2000,
                "e2e_calls": 100 if quick else 300, "build_reps": 2 if quick else 3,
                "search_sizes": "100,1000,10000" if quick else "100,1000,10000,30000",
                "e2e_sizes": "1000" if quick else "1000,10000", "inflight": "32" if quick else "32,256"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.startup_sizes = args.startup_sizes if "--startup-sizes" in (argv or sys.argv) else "1,4"
    args.sections = {s.strip() for s in args.only.split(",") if s.strip()}
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def run(args: argparse.Namespace, report: Report, workdir: Path) -> None:
    ensure_bytecode()
    gateways = Gateways(workdir)
    errlog = gateways.errlog
    peers: list[str] = []
    if args.quick and not args.fastmcp:
        # FastMCP's shared proxy takes ~3.4 s to start here and is spawned four times over the call and
        # throughput sections (and its startup rows take seconds each): a third of a quick run.
        report.data["fastmcp_skipped"] = "--quick (add --fastmcp for its shared-proxy rows)"
        log("FastMCP rows skipped in --quick (add --fastmcp to include the shared proxy)")
    elif not args.no_fastmcp:
        problem = fastmcp_problem()
        if problem:
            log(f"FastMCP rows skipped: {problem}")
            report.data["fastmcp_skipped"] = problem
        else:
            import fastmcp
            # --quick leaves out the default proxy: it spawns every upstream per request, seconds per row.
            peers = ["fastmcp-shared"] if args.quick else ["fastmcp-shared", "fastmcp-default"]
            report.data["fastmcp_version"] = fastmcp.__version__

    targets = [make_upstream("time", "time", workdir), make_upstream("fx", "fx", workdir)]
    timings = report.data.setdefault("section_seconds", {})
    clock = {"name": None, "t": time.perf_counter()}

    def mark(name: str | None) -> None:
        """Wall time per section, so a slow section is visible when tuning --quick."""
        now = time.perf_counter()
        if clock["name"]:
            timings[clock["name"]] = round(now - clock["t"], 1)
        clock.update(name=name, t=now)

    def paths_for(up: Upstream) -> list[Path_]:
        """Ways to reach ``up``: directly, through the relay floor, through Coffer (and the peers) fronting all
        the targets."""
        paths = [Path_("direct", up.params(), None), Path_("relay-floor", up.relayed(), None),
                 gateways.coffer(targets)]
        for peer in peers:
            paths.append(gateways.fastmcp(targets, shared=peer == "fastmcp-shared"))
        return paths

    async def guarded(name: str, coro_fn):
        """A peer that breaks mid-run costs its rows, not the benchmark: retry the section without it."""
        nonlocal peers
        try:
            return await coro_fn()
        except Exception as exc:  # noqa: BLE001
            if not peers:
                raise
            log(f"{name}: failed with FastMCP in the mix ({exc!r}); rerunning without FastMCP")
            report.data.setdefault("fastmcp_errors", []).append(f"{name}: {exc!r}")
            peers = []
            return await coro_fn()

    if "call" in args.sections:
        mark("call")
        log(f"[1] call overhead: {args.calls} calls per path per tool")
        rows, data = [], {}
        for up in targets:
            async def one(up=up):
                paths = paths_for(up)
                return await bench_latency(paths, up, args.calls, args.fastmcp_default_calls, args.batch,
                                           min(50, args.calls // 10), errlog)
            samples = await guarded("call", one)
            tool = f"{up.name}.{CALL_TARGETS[up.kind][0]}"
            r, d = latency_rows(tool, samples)
            rows += r
            data[tool] = d
        report.data["call"] = data
        cpu = ", ".join(f"{tool} {d['coffer_cpu_us_per_call']:.0f}" for tool, d in data.items()
                        if d.get("coffer_cpu_us_per_call") is not None)
        report.data["call"]["max_added_p50_ms"] = max(d["coffer"]["added_p50_ms"] for d in data.values())
        report.table("1. Call overhead (sequential calls, SDK client, interleaved batches)",
                     ["tool", "path", "n", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "p50 ratio"], rows,
                     "relay-floor: the same server behind a Python relay that copies lines and parses nothing "
                     "(evals/fixtures/passthrough_relay.py), the cost of the process hop alone."
                     + (f"\ncoffer serve CPU per forwarded call (us, from /proc, includes its idle ticker): {cpu}"
                        if cpu else ""))

    if "modern" in args.sections:
        mark("modern")
        modern = make_upstream("modern", "modern", workdir)
        log(f"[1b] modern path (MCP {MODERN}): {args.calls} echo calls, {args.mrtr_calls} elicitation calls per path")
        rows, data = [], {}
        paths = [Path_(f"direct ({MODERN})", modern.params(), None, mode=MODERN, elicitation=True),
                 Path_(f"relay-floor ({MODERN})", modern.relayed(), None, mode=MODERN, elicitation=True),
                 gateways.coffer([modern], label=f"coffer ({MODERN})", mode=MODERN, elicitation=True),
                 gateways.coffer([modern], label="coffer (legacy client)", elicitation=True)]
        plans = [LatencyPlan(*CALL_TARGETS["modern"], args.calls, args.calls),
                 LatencyPlan(*MRTR_TARGET, args.mrtr_calls, args.mrtr_calls)]
        results = await bench_latency_plans(paths, modern, plans, args.batch, min(50, max(5, args.calls // 10)),
                                            errlog)
        for plan, samples in zip(plans, results):
            tool = f"{modern.name}.{plan.tool}"
            r, d = latency_rows(tool, samples, baseline=paths[0].label)
            rows += r
            data[tool] = d
        echo, mrtr = data[f"modern.{CALL_TARGETS['modern'][0]}"], data[f"modern.{MRTR_TARGET[0]}"]
        data["added_p50_ms"] = echo[f"coffer ({MODERN})"]["added_p50_ms"]
        data["bridge_added_p50_ms"] = echo["coffer (legacy client)"]["added_p50_ms"]
        data["mrtr_added_p50_ms"] = mrtr[f"coffer ({MODERN})"]["added_p50_ms"]
        data["mrtr_bridge_added_p50_ms"] = mrtr["coffer (legacy client)"]["added_p50_ms"]
        # The hop alone costs what the relay floor shows; Coffer's own work is what it adds above that.
        data["above_relay_floor_ms"] = data["added_p50_ms"] - echo[f"relay-floor ({MODERN})"]["added_p50_ms"]
        report.data["modern"] = data
        cpu = "; ".join(f"{tool}: " + ", ".join(f"{label} {us:.0f}" for label, us in d["cpu_us_per_call"].items())
                        for tool, d in data.items() if isinstance(d, dict) and d.get("cpu_us_per_call"))
        report.table(f"1b. Modern path (MCP {MODERN}: tests/fixtures/modern_only.py, an SDK 2.x server that "
                     "refuses initialize)",
                     ["tool", "path", "n", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "p50 ratio"], rows,
                     f"added: vs direct ({MODERN}), a {MODERN} SDK client straight to the server. coffer "
                     f"(legacy client): a handshake-era client (initialize) through Coffer to the same {MODERN}-only "
                     "server, the cross-era bridge; its added figure also holds the two client modes' own "
                     f"difference.\n{MRTR_TARGET[0]}: one client call, a multi-round-trip on {MODERN} (the server "
                     "answers input_required, the client retries with the elicited answer: direct and through "
                     "Coffer, which forwards the round); for the legacy client Coffer turns the round into a real "
                     "elicitation request and retries the server itself."
                     + f"\ncoffer ({MODERN}) above the relay floor (echo, p50): {data['above_relay_floor_ms']:+.3f} ms"
                     + (f"\ncoffer serve CPU per forwarded call (us, from /proc, includes its idle ticker): {cpu}"
                        if cpu else ""))

    if "throughput" in args.sections:
        mark("throughput")
        levels = ints(args.inflight)
        log(f"[2] throughput: {levels} in flight, {args.throughput_calls} calls x {args.throughput_rounds} rounds")
        rows, data = [], {}
        for up in targets:
            async def one(up=up):
                paths = paths_for(up)
                return await bench_throughput(paths, up, levels, args.throughput_calls, args.throughput_rounds,
                                              errlog)
            rates = await guarded("throughput", one)
            tool = f"{up.name}.{CALL_TARGETS[up.kind][0]}"
            data[tool] = {}
            for level in levels:
                base = rates["direct"][level]
                for label, by in rates.items():
                    rate = by.get(level)
                    ratio = rate / base if rate and base else None
                    rows.append([tool, level, label, rate, f"{ratio:.2f}x" if ratio else None])
                    data[tool].setdefault(label, {})[str(level)] = {"calls_per_s": rate, "ratio": ratio}
        report.data["throughput"] = data
        if 32 in levels:
            report.data["throughput"]["ratio_32"] = min(d["coffer"]["32"]["ratio"] for d in data.values())
        report.table("2. Throughput (calls in flight over one session)",
                     ["tool", "in flight", "path", "calls/s", "vs direct"], rows,
                     "fastmcp-default: one round of exactly <in flight> calls, lowest level only "
                     "(it spawns every upstream per request)." if "fastmcp-default" in peers else None)

    if "startup" in args.sections:
        mark("startup")
        sizes = ints(args.startup_sizes)
        sets = startup_sets(workdir, sizes)
        log(f"[3] startup: {sizes} upstreams, {args.startup_reps} reps")
        res = await guarded("startup", lambda: bench_startup(gateways, sets, args.startup_reps, peers, errlog,
                                                                    warmup=not args.quick))
        rows = []
        data = {"direct_ms": {k: v * 1000 for k, v in res["direct"].items()}, "tools": res["counts"], "sets": {}}
        for size, ups in sets.items():
            slowest_kind = max({up.kind for up in ups}, key=lambda k: res["direct"][k])
            slowest = res["direct"][slowest_kind] * 1000
            entry = {"upstreams": [up.name for up in ups], "slowest_single": slowest_kind,
                     "slowest_single_ms": slowest}
            parallel = res["via"][size]["direct-parallel"] * 1000
            for label, t in res["via"][size].items():
                ms = t * 1000
                rows.append([size, label, ms, f"{slowest_kind} {slowest:.0f}", ms - slowest, f"{ms / slowest:.2f}x",
                             None if label == "direct-parallel" else ms - parallel])
                entry[label] = {"ms": ms, "excess_ms": ms - slowest, "ratio": ms / slowest,
                                "excess_vs_parallel_ms": ms - parallel}
            data["sets"][str(size)] = entry
            if size == 8:
                data["excess_ms_8"] = entry["coffer"]["excess_ms"]
                data["live_excess_ms_8"] = entry["coffer --live"]["excess_ms"]
        report.data["startup"] = data
        singles = ", ".join(f"{k} {v:.0f} ms ({res['counts'][k]} tools)" for k, v in data["direct_ms"].items())
        report.table("3. Startup (spawn -> initialize -> tools/list with every upstream's tools; median)",
                     ["upstreams", "path", "ms", "slowest single ms", "excess ms", "ratio", "vs parallel ms"],
                     rows, f"direct, each alone: {singles}\n"
                     "direct-parallel: every upstream spawned at once by its own SDK client, no gateway (the CPU "
                     "contention any gateway also pays); 'vs parallel' = path minus that.\n"
                     "coffer: a session after the first, which lists what the vault remembers while the servers "
                     "start (a call waits for its server); coffer, first call: spawn to the first answered call "
                     "of time.get_current_time through that session; coffer --live: waits for every server, as "
                     "the very first session does.")

    if "search" in args.sections:
        mark("search")
        base, sources = base_catalog()
        sizes = ints(args.search_sizes)
        log(f"[4] search: base catalogue {len(base)} tools from {len(sources)} files; sizes {sizes}")
        inproc = bench_search_inprocess(base, sizes, args.search_queries, args.build_reps)
        e2e, raw = {}, {}
        for size in ints(args.e2e_sizes):
            e2e[size] = await bench_search_gateway(gateways, base, size, args.e2e_calls, size == 1000, errlog)
            if args.e2e_calls:
                raw[size] = bench_search_gateway_raw(gateways, base, size, args.e2e_calls, errlog)
        rows = []
        for size in sorted(set(sizes) | set(e2e)):
            i, e = inproc.get(size, {}), e2e.get(size, {})
            rows.append([size, i.get("build_ms"), i.get("rebuild_ms"), i.get("build_copies_ms"), i.get("p50_ms"),
                         i.get("p95_ms"), i.get("first_pass_p50_ms"),
                         e.get("p50_ms"), e.get("repeat_p50_ms"), e.get("p95_ms"), e.get("ping_p50_ms"),
                         e.get("ready_s")])
        report.data["search"] = {"base_tools": len(base), "sources": sources, "queries": str(PROJECT_QUERIES),
                                 "in_process": {str(k): v for k, v in inproc.items()},
                                 "gateway": {str(k): v for k, v in e2e.items()},
                                 "gateway_raw_client": {str(k): v for k, v in raw.items()}}
        for size in (1000, 10000, 30000):
            if size in inproc:
                report.data["search"][f"p50_ms_{size}"] = inproc[size]["p50_ms"]
                report.data["search"][f"p95_ms_{size}"] = inproc[size]["p95_ms"]
                report.data["search"][f"build_ms_{size}"] = inproc[size]["build_ms"]
            if size in inproc and e2e.get(size, {}).get("calls"):
                # What searching through `coffer serve` adds beyond the search itself and a ping's round trip:
                # the first pass against the in-process first pass, the repeated queries against the p50.
                i, e = inproc[size], e2e[size]
                report.data["search"][f"gw_excess_ms_{size}"] = e["p50_ms"] - i["first_pass_p50_ms"] - e["ping_p50_ms"]
                report.data["search"][f"gw_repeat_excess_ms_{size}"] = (e["repeat_p50_ms"] - i["p50_ms"]
                                                                        - e["ping_p50_ms"])
                if size in raw:
                    r = raw[size]
                    report.data["search"][f"raw_excess_ms_{size}"] = (r["p50_ms"] - i["first_pass_p50_ms"]
                                                                      - r["ping_p50_ms"])
                    report.data["search"][f"raw_repeat_excess_ms_{size}"] = (r["repeat_p50_ms"] - i["p50_ms"]
                                                                             - r["ping_p50_ms"])
        report.table("4. Search (coffer__search_tools; top_k=5)",
                     ["tools", "build ms", "rebuild ms", "copies build ms", "p50 ms", "p95 ms", "1st-pass p50 ms",
                      "gw 1st-pass p50 ms", "gw repeat p50 ms", "gw p95 ms",
                      "gw ping p50 ms", "gw ready s"], rows,
                     f"catalogue: up to {len(base)} tools a sample of the real ones; beyond, copies under renamed "
                     "servers with a third of their description words swapped and half their names extended, so "
                     "every text is new to the tokenizer (distinct tools).\n"
                     "build: median of the cold builds (tokenizer caches emptied before each); rebuild: again with "
                     "the caches warm (a catalogue "
                     "change); copies build: the same size made of exact copies, cold (as earlier reports measured "
                     "it). p50/p95: SearchIndex.search in-process, first uses of a term included (postings "
                     "are built on demand); 1st-pass: each query once on a new index (every term's first use); gw: "
                     "the tool called through `coffer serve` (one upstream listing the catalogue), its first pass "
                     "(compare with 1st-pass) and the same queries again (compare with p50), with a ping on the "
                     "same session as the protocol baseline; ready: spawn to first tools/list.")
        rss = e2e.get(1000)
        if rss and rss.get("idle"):
            script = await bench_search_gateway(gateways, base, 1000, 0, True, errlog, form="script")
            mb = lambda status, key: status[key] / 1024 if status else None  # noqa: E731
            idle, peak, up = rss["idle"], rss.get("peak"), rss.get("upstream_idle")
            report.data["rss"] = {"tools": 1000, "idle_mb": mb(idle, "VmRSS"), "peak_mb": mb(peak, "VmHWM"),
                                  "script_idle_mb": mb(script.get("idle"), "VmRSS"),
                                  "upstream_idle_mb": mb(up, "VmRSS")}
            report.table("4b. Memory of `coffer serve` holding ~1k tools (from /proc)",
                         ["process", "idle RSS MB", "peak RSS MB (VmHWM)"],
                         [["coffer serve (installed: bytecode)", mb(idle, "VmRSS"), mb(peak, "VmHWM")],
                          ["python coffer.py serve (script)", mb(script.get("idle"), "VmRSS"),
                           mb(script.get("idle"), "VmHWM")],
                          ["catalog_server.py (same 1k tools, baseline)", mb(up, "VmRSS"), mb(up, "VmHWM")]],
                         "peak: after the search load (installed) or at idle (script, which runs no load); a "
                         "script is compiled at every start and keeps the compiler's memory.")
        elif 1000 in e2e:
            report.data["rss"] = {"skipped": "no /proc here (not Linux)"}
            log("RSS skipped: no /proc on this platform")
    if "knowledge" in args.sections:
        mark("knowledge")
        corpus = workdir / "knowledge-corpus"
        t0 = time.perf_counter()
        files = write_knowledge_corpus(corpus, args.knowledge_passages)
        generated_s = time.perf_counter() - t0
        questions = ask_questions()
        engines = ["fts5", "bm25f"] if coffer.fts5_available() else ["bm25f"]
        log(f"[5] knowledge: {args.knowledge_passages} passages in {files} generated files ({generated_s:.1f} s); "
            f"engines {engines}; {args.knowledge_queries} asks in-process, {args.knowledge_calls} via the gateway")
        data: dict = {"files": files, "requested_passages": args.knowledge_passages, "questions": str(ASK_QUESTIONS),
                      "vocabulary": str(ASK_CORPUS)}
        rows = []
        for engine in engines:
            home = workdir / f"knowledge-home-{engine}"
            coffer_cli(["config", "discovery_timeout", "60"], {**os.environ, "COFFER_HOME": str(home)})  # the vault
            inproc = bench_knowledge_inprocess(corpus, home / "coffer.db", home, engine, questions,
                                               args.knowledge_queries)
            gateway = await bench_knowledge_gateway(home, engine, questions, args.knowledge_calls, errlog)
            data[engine] = {**inproc, "gateway": gateway, "gw_p50_ms": gateway["p50_ms"],
                            "gw_p95_ms": gateway["p95_ms"]}
            rows.append([engine, inproc["passages"], inproc["files"], inproc["index_s"], inproc["first_ask_ms"],
                         inproc["p50_ms"], inproc["p95_ms"], gateway["first_ask_ms"], gateway["p50_ms"],
                         gateway["p95_ms"], gateway["ping_p50_ms"], gateway["peak_rss_mb"]])
        report.data["knowledge"] = data
        polls = ", ".join(f"{e} {data[e]['watch_poll_ms']:.0f} ms" for e in engines)
        report.table(f"5. Knowledge (coffer__ask, top_k=5, no embedder; {args.knowledge_passages} generated "
                     "passages)",
                     ["engine", "passages", "files", "index s", "first ask ms", "p50 ms", "p95 ms",
                      "gw first ms", "gw p50 ms", "gw p95 ms", "gw ping p50 ms", "gw peak RSS MB"], rows,
                     "corpus: generated Markdown (fixed seed), words drawn by their frequency in the pinned "
                     "click/flask docs (evals/ask_data/corpus); questions: the 269 written for those docs.\n"
                     "index: KnowledgeBase.add_source with cold term caches (walk, read, hash, split, analyse, "
                     "write; bm25f also builds its in-memory index). first ask: a freshly opened knowledge base "
                     "(bm25f builds its in-memory index there; a gateway's first coffer__ask pays it). p50/p95: "
                     "KnowledgeBase.ask in-process; gw: tools/call coffer__ask through `coffer serve` with the "
                     "official SDK client, a ping on the same session as the protocol baseline.\n"
                     "bm25f: the engine of a Python without FTS5 (the gateway started with its FTS5 probe answered "
                     f"no). Watcher poll (changed(), every 2 s in serve): {polls}.")

    if "service" in args.sections:
        mark("service")
        from evals.bench_service import bench_service
        await bench_service(args, report, workdir, errlog)

    if args.profile:
        mark("profile")
        out = Path(args.profile).resolve()
        out.unlink(missing_ok=True)
        log(f"[profile] coffer serve under {args.profile_calls} sequential + {args.profile_calls} concurrent calls")
        text = await profile_gateway(gateways, targets[1], args.profile_calls, out, errlog)
        report.data["profile"] = {"pstats": str(out), "top": text}
        print(f"\n== Profile of `coffer serve` (all threads; fx.echo load)\n{text}",
              file=sys.stderr if args.json else sys.stdout, flush=True)
    mark(None)
    log(f"section wall times (s): {timings}")


def evaluate_targets(report: Report, quick: bool = False) -> None:
    from evals.bench_service import TARGETS as SERVICE_TARGETS
    rows, verdicts = [], {}
    for key, label, op, threshold in TARGETS + SERVICE_TARGETS:
        value = report.data
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            verdict = "n/a"
        else:
            verdict = "PASS" if (value <= threshold if op == "<=" else value >= threshold) else "MISS"
        verdicts[key] = {"value": value, "target": f"{op} {threshold:g}", "verdict": verdict}
        rows.append([label, value, f"{op} {threshold:g}", verdict])
    report.data["targets"] = verdicts
    report.table("Targets (a MISS is reported, never fatal)", ["target", "value", "goal", "verdict"], rows,
                 "--quick: 200 calls and one round per figure, no FastMCP, a smoke test; its verdicts swing from "
                 "run to run (search p50s there include most terms' first use: 300 queries, nearly all distinct)."
                 if quick else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(args.json)
    report.data["env"] = {"python": platform.python_version(), "platform": platform.platform(),
                          "cpus": os.cpu_count(), "node": shutil.which("node") is not None and node_available(),
                          "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "sections"}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="coffer-bench-") as tmp:
        anyio.run(run, args, report, Path(tmp))
    evaluate_targets(report, args.quick)
    report.data["elapsed_s"] = time.perf_counter() - started
    log(f"\nbenchmark finished in {report.data['elapsed_s']:.0f} s")
    if args.json:
        print(json.dumps(report.data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    # Run as `python -m evals.bench`, this module is __main__; section 7 (evals/bench_service.py) imports its
    # helpers by name, which would load and run a second copy of it beside this one.
    sys.modules.setdefault("evals.bench", sys.modules[__name__])
    sys.exit(main())
