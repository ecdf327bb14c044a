"""Build the extra tool-retrieval dev sets under evals/sets/ from pinned public packages, byte for byte.

    python -m evals.build_sets                      # every set
    python -m evals.build_sets bfcl mcp-servers     # some sets
    python -m evals.build_sets --check              # rebuild into a temp folder and diff against the repo
    python -m evals.build_sets --cache DIR          # where packages are downloaded/installed (default: a temp dir)

Sets (each folder holds catalog.jsonl + queries.jsonl, the format evals.run reads, and a hand-written SOURCE.md):

* ``bfcl`` -- every function definition of the Berkeley Function Calling Leaderboard's single-turn categories
  (python simple/multiple/parallel/parallel-multiple and the user-contributed "live" ones) pooled into one
  catalogue; each question must find its ground-truth function(s) in the whole pool, not among the 2-4 candidates
  BFCL hands the model.  Source: PyPI ``bfcl-eval`` (Apache-2.0), pinned below with its wheel hash.
* ``bfcl-multiturn`` -- BFCL's eight multi-turn API suites (file system, math, messaging, posting, ticketing,
  trading, travel, vehicle) as eight servers ``<suite>__<function>``; each user turn is a query whose groups are
  the distinct functions its ground truth calls.  Same wheel.
* ``mcp-servers`` -- the catalogues real published MCP servers (npm and PyPI, pinned below) answer to tools/list
  through the official MCP SDK client, merged and namespaced ``<server>__<tool>``; the queries are hand-written
  for this project (see evals/sets/mcp-servers/SOURCE.md) and only normalised and checked here.

Every byte written depends only on the pinned inputs: lines keep a fixed order, JSON is written with fixed
separators, and nothing from the machine (paths, dates) enters the files.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SETS_DIR = REPO_ROOT / "evals" / "sets"
MCP_PINS = SETS_DIR / "mcp-servers"  # npm lock file and pip freezes of the servers dumped

BFCL_PACKAGE = "bfcl-eval==2026.3.23"
BFCL_WHEEL = "bfcl_eval-2026.3.23-py3-none-any.whl"
BFCL_WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"  # checked on download
BFCL_SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple",
                    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
# BFCL multi-turn class -> (func doc file, server name used in the catalogue)
BFCL_SUITES = {
    "GorillaFileSystem": ("gorilla_file_system.json", "filesystem"),
    "MathAPI": ("math_api.json", "math"),
    "MessageAPI": ("message_api.json", "messaging"),
    "TwitterAPI": ("posting_api.json", "twitter"),
    "TicketAPI": ("ticket_api.json", "ticketing"),
    "TradingBot": ("trading_bot.json", "trading"),
    "TravelAPI": ("travel_booking.json", "travel"),
    "VehicleControlAPI": ("vehicle_control.json", "vehicle"),
}

# Real MCP servers: catalogue name -> (npm package spec, script under node_modules + args, environment to start).
# Credentials are dummies: listing tools never calls the service behind a server.
NPM_SERVERS = {
    "everything": ("@modelcontextprotocol/server-everything@2026.8.31",
                   ["@modelcontextprotocol/server-everything/dist/index.js", "stdio"], {}),
    "memory": ("@modelcontextprotocol/server-memory@2026.8.31", ["@modelcontextprotocol/server-memory/dist/index.js"],
               {"MEMORY_FILE_PATH": "{tmp}/memory.jsonl"}),
    "filesystem": ("@modelcontextprotocol/server-filesystem@2026.8.31",
                   ["@modelcontextprotocol/server-filesystem/dist/index.js", "{tmp}"], {}),
    "github": ("@modelcontextprotocol/server-github@2025.4.8", ["@modelcontextprotocol/server-github/dist/index.js"],
               {"GITHUB_PERSONAL_ACCESS_TOKEN": "dummy"}),
    "gitlab": ("@modelcontextprotocol/server-gitlab@2025.4.25", ["@modelcontextprotocol/server-gitlab/dist/index.js"],
               {"GITLAB_PERSONAL_ACCESS_TOKEN": "dummy"}),
    "slack": ("@modelcontextprotocol/server-slack@2025.4.25", ["@modelcontextprotocol/server-slack/dist/index.js"],
              {"SLACK_BOT_TOKEN": "dummy", "SLACK_TEAM_ID": "T0"}),
    "brave-search": ("@modelcontextprotocol/server-brave-search@0.6.2",
                     ["@modelcontextprotocol/server-brave-search/dist/index.js"], {"BRAVE_API_KEY": "dummy"}),
    "google-maps": ("@modelcontextprotocol/server-google-maps@0.6.2",
                    ["@modelcontextprotocol/server-google-maps/dist/index.js"], {"GOOGLE_MAPS_API_KEY": "dummy"}),
    "postgres": ("@modelcontextprotocol/server-postgres@0.6.2",
                 ["@modelcontextprotocol/server-postgres/dist/index.js", "postgresql://127.0.0.1:9/none"], {}),
    "sequential-thinking": ("@modelcontextprotocol/server-sequential-thinking@2026.8.31",
                            ["@modelcontextprotocol/server-sequential-thinking/dist/index.js"], {}),
    "playwright": ("@playwright/mcp@0.0.83", ["@playwright/mcp/cli.js"], {}),
    "kubernetes": ("mcp-server-kubernetes@4.1.7", ["mcp-server-kubernetes/dist/index.js"], {}),
    "notion": ("@notionhq/notion-mcp-server@2.5.2", ["@notionhq/notion-mcp-server/bin/cli.mjs"],
               {"NOTION_TOKEN": "dummy"}),
    "tavily": ("tavily-mcp@0.2.22", ["tavily-mcp/build/index.js"], {"TAVILY_API_KEY": "dummy"}),
}
ATLASSIAN_MAIN = "import sys; from mcp_atlassian import main; sys.exit(main())"  # it has no __main__ module
PYPI_SERVERS = {  # name -> (venv group, python argv, env); evals/sets/mcp-servers/requirements-<group>.txt pins
    "fetch": ("core", ["-m", "mcp_server_fetch"], {}),
    "git": ("core", ["-m", "mcp_server_git"], {}),
    "time": ("core", ["-m", "mcp_server_time", "--local-timezone", "UTC"], {}),
    "atlassian": ("atlassian", ["-c", ATLASSIAN_MAIN],
                  {"JIRA_URL": "https://example.atlassian.net", "JIRA_USERNAME": "a@example.com",
                   "JIRA_API_TOKEN": "dummy", "CONFLUENCE_URL": "https://example.atlassian.net/wiki",
                   "CONFLUENCE_USERNAME": "a@example.com", "CONFLUENCE_API_TOKEN": "dummy"}),
    "yahoo-finance": ("yfinance", ["-m", "mcp_yahoo_finance"], {}),
}


# ---------------------------------------------------------------- writing


def dump_line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(dump_line(row) + "\n" for row in rows), encoding="utf-8")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- BFCL


def bfcl_wheel(cache: Path) -> zipfile.ZipFile:
    """The pinned bfcl-eval wheel (downloaded with pip, no dependencies), its hash checked."""
    wheel = cache / BFCL_WHEEL
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache),
                        BFCL_PACKAGE], check=True)
    digest = sha256(wheel)
    if digest != BFCL_WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest} is not the pinned {BFCL_WHEEL_SHA256}")
    return zipfile.ZipFile(wheel)


def read_zip_jsonl(wheel: zipfile.ZipFile, member: str) -> list[dict]:
    return [json.loads(line) for line in wheel.read(member).decode("utf-8").splitlines() if line.strip()]


_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def json_schema(node):
    """BFCL's parameter dialect (type "dict", "float", "tuple", "any") as JSON Schema, everything else kept."""
    if isinstance(node, list):
        return [json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str) and value in _BFCL_TYPES:
            if _BFCL_TYPES[value] is not None:
                out[key] = _BFCL_TYPES[value]
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        else:
            out[key] = json_schema(value)
    return out


def bfcl_tool(function: dict, name: str | None = None) -> dict:
    return {"name": name or function["name"], "description": function.get("description", ""),
            "inputSchema": json_schema(function.get("parameters") or {"type": "object"})}


def last_user_text(turn: list[dict]) -> str:
    texts = [m["content"] for m in turn if m.get("role") == "user" and isinstance(m.get("content"), str)]
    return texts[-1].strip() if texts else ""


def called_names(ground_truth) -> list[str]:
    """Function names of a single-turn ground truth: a list of {name: {arg: [values]}} dicts."""
    names = []
    for call in ground_truth:
        for name in call:
            if name not in names:
                names.append(name)
    return names


def build_bfcl(cache: Path, out: Path) -> None:
    wheel = bfcl_wheel(cache)
    variants: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    first_seen: dict[str, int] = {}
    queries, seen_queries = [], set()
    for category in BFCL_SINGLE_TURN:
        entries = read_zip_jsonl(wheel, f"bfcl_eval/data/BFCL_v4_{category}.json")
        answers = {row["id"]: row["ground_truth"]
                   for row in read_zip_jsonl(wheel, f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json")}
        for entry in entries:
            for function in entry["function"]:
                variants[function["name"]][dump_line(function)] += 1
                first_seen.setdefault(function["name"], len(first_seen))
            text = last_user_text(entry["question"][0])
            names = called_names(answers[entry["id"]])
            if not text or not names or text in seen_queries:
                continue
            seen_queries.add(text)
            row = {"query": text, "relevant": names}
            if len(names) > 1:
                row["groups"] = [[name] for name in names]
            row["style"] = "live" if category.startswith("live") else "synthetic"
            queries.append(row)
    # A name defined differently by several entries is one tool: its most frequent definition (ties: the first
    # in sorted order), as a real catalogue holds one definition per name.
    tools = []
    for name in sorted(variants, key=first_seen.__getitem__):
        counts = variants[name]
        best = min(counts, key=lambda text: (-counts[text], text))
        tools.append(bfcl_tool(json.loads(best)))
    write_jsonl(out / "catalog.jsonl", tools)
    write_jsonl(out / "queries.jsonl", queries)


def build_bfcl_multiturn(cache: Path, out: Path) -> None:
    wheel = bfcl_wheel(cache)
    tools, server_of = [], {}
    for _cls, (doc, server) in BFCL_SUITES.items():
        for function in read_zip_jsonl(wheel, f"bfcl_eval/data/multi_turn_func_doc/{doc}"):
            full = f"{server}__{function['name']}"
            tools.append(bfcl_tool(function, full))
            server_of.setdefault(function["name"], {})[_cls] = full
    entries = read_zip_jsonl(wheel, "bfcl_eval/data/BFCL_v4_multi_turn_base.json")
    answers = {row["id"]: row["ground_truth"]
               for row in read_zip_jsonl(wheel, "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_base.json")}
    call_name = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
    queries, seen_queries = [], set()
    for entry in entries:
        classes = entry["involved_classes"]
        for turn, calls in zip(entry["question"], answers[entry["id"]]):
            text = last_user_text(turn)
            names = []
            for call in calls:
                match = call_name.match(call)
                if not match:
                    continue
                owners = server_of.get(match.group(1), {})
                full = next((owners[c] for c in classes if c in owners), None)
                if full and full not in names:
                    names.append(full)
            if not text or not names or text in seen_queries:
                continue
            seen_queries.add(text)
            row = {"query": text, "relevant": names}
            if len(names) > 1:
                row["groups"] = [[name] for name in names]
            row["style"] = "turn"
            queries.append(row)
    write_jsonl(out / "catalog.jsonl", tools)
    write_jsonl(out / "queries.jsonl", queries)


# ---------------------------------------------------------------- real MCP servers


def install_servers(cache: Path) -> tuple[Path, dict[str, Path]]:
    """The pinned trees: npm ci from the committed lock file (install scripts off, so no browser or binary is
    downloaded; listing tools needs none), and one venv per PyPI group from its committed pip freeze."""
    npm_dir = cache / "npm"
    npm_dir.mkdir(parents=True, exist_ok=True)
    for file in ("package.json", "package-lock.json"):
        shutil.copyfile(MCP_PINS / "npm" / file, npm_dir / file)
    subprocess.run(["npm", "ci", "--silent", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=npm_dir, check=True)
    venvs: dict[str, Path] = {}
    for group in sorted({group for group, _argv, _env in PYPI_SERVERS.values()}):
        venv = venvs[group] = cache / f"py-{group}"
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "-r",
                        str(MCP_PINS / f"requirements-{group}.txt")], check=True)
    return npm_dir / "node_modules", venvs


async def list_tools(command: str, args: list[str], env: dict[str, str]) -> list[dict]:
    """tools/list of one stdio server through the official MCP SDK client, every page."""
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=command, args=args, env={**os.environ, **env})
    tools, cursor = [], None
    async with Client(params) as client:
        while True:
            page = await client.list_tools(cursor=cursor) if cursor else await client.list_tools()
            for tool in page.tools:
                tools.append(tool.model_dump(mode="json", by_alias=True, exclude_none=True))
            cursor = getattr(page, "next_cursor", None) or getattr(page, "nextCursor", None)
            if not cursor:
                return tools


def catalogue_entry(server: str, tool: dict) -> dict:
    entry = {"name": f"{server}__{tool['name']}"}
    if tool.get("title"):
        entry["title"] = tool["title"]
    entry["description"] = tool.get("description") or ""
    entry["inputSchema"] = tool.get("inputSchema") or {"type": "object"}
    return entry


def build_mcp_servers(cache: Path, out: Path) -> None:
    node_modules, venvs = install_servers(cache)
    tmp = Path(tempfile.mkdtemp(prefix="coffer-sets-"))
    try:
        dumps: dict[str, list[dict]] = {}
        for name, (_spec, argv, env) in NPM_SERVERS.items():
            argv = [str(node_modules / argv[0])] + [a.replace("{tmp}", str(tmp)) for a in argv[1:]]
            env = {k: v.replace("{tmp}", str(tmp)) for k, v in env.items()}
            dumps[name] = asyncio.run(list_tools("node", argv, env))
        for name, (group, argv, env) in PYPI_SERVERS.items():
            argv = [a.replace("{tmp}", str(tmp)) for a in argv]
            # A fixed hash seed: a server that builds a default from a set (mcp-atlassian does) lists it in
            # the same order every run.
            env = {**env, "PYTHONHASHSEED": "0"}
            dumps[name] = asyncio.run(list_tools(str(venvs[group] / "bin" / "python"), argv, env))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tools = []
    for name in sorted(dumps):
        if not dumps[name]:
            raise SystemExit(f"server {name} listed no tools")
        tools += [catalogue_entry(name, tool) for tool in sorted(dumps[name], key=lambda t: t["name"])]
    write_jsonl(out / "catalog.jsonl", tools)
    normalise_queries(SETS_DIR / "mcp-servers" / "queries.jsonl", out / "queries.jsonl", tools)


def normalise_queries(source: Path, target: Path, tools: list[dict]) -> None:
    """Hand-written queries, re-serialised canonically; every label must name a tool of the catalogue."""
    known = {tool["name"] for tool in tools}
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    out, problems = [], []
    for row in rows:
        clean = {"query": row["query"], "relevant": row["relevant"]}
        if row.get("groups"):
            clean["groups"] = row["groups"]
        clean["style"] = row.get("style", "all")
        unknown = sorted({n for n in row["relevant"] + [n for g in row.get("groups", []) for n in g]} - known)
        if unknown:
            problems.append(f"{row['query'][:60]!r}: unknown {unknown}")
        out.append(clean)
    if problems:
        raise SystemExit("queries label tools that are not in the catalogue:\n  " + "\n  ".join(problems))
    write_jsonl(target, out)


# ---------------------------------------------------------------- CLI

BUILDERS = {"bfcl": build_bfcl, "bfcl-multiturn": build_bfcl_multiturn, "mcp-servers": build_mcp_servers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.build_sets", description=__doc__.split("\n\n")[0])
    p.add_argument("sets", nargs="*", help=f"which sets (default: all of {', '.join(BUILDERS)})")
    p.add_argument("--cache", help="download/install folder (default: a fresh temporary folder)")
    p.add_argument("--check", action="store_true", help="build into a temp folder and compare with evals/sets")
    args = p.parse_args(argv)
    names = args.sets or list(BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        raise SystemExit(f"unknown set(s) {unknown}; known: {list(BUILDERS)}")
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="coffer-sets-cache-"))
    cache.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in names:
        target = SETS_DIR / name
        out = Path(tempfile.mkdtemp(prefix=f"coffer-set-{name}-")) if args.check else target
        BUILDERS[name](cache, out)
        for file in ("catalog.jsonl", "queries.jsonl"):
            if args.check:
                same = (target / file).is_file() and filecmp.cmp(out / file, target / file, shallow=False)
                print(f"{name}/{file}: {'identical' if same else 'DIFFERS'}")
                status |= 0 if same else 1
            else:
                lines = sum(1 for _ in (out / file).open(encoding="utf-8"))
                print(f"{name}/{file}: {lines} lines, sha256 {sha256(out / file)[:16]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
