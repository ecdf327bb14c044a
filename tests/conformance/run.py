"""Runs the official MCP conformance suite against Coffer, in both roles, for each requirement set, and judges it.

    python tests/conformance/run.py --node NODE --cli PATH/TO/@modelcontextprotocol/conformance/dist/index.js
        [--role client|server|both] [--requirements 2025-11-25,2026-07-28] [--server-url URL] [--out DIR]

Client scenarios: Coffer is the client (tests/conformance/client_driver.py registers each scenario's mock server
as a Coffer upstream and speaks to ``coffer serve``).  Server scenarios: Coffer is the server, with
tests/conformance/upstream_server.py (the behaviour the suite expects of a server) registered as its upstream
``conf``; the suite speaks Streamable HTTP to Coffer's own endpoint -- the shared service's /mcp, with a token,
reached through server_bridge.py's token-adding forwarder -- when this Coffer has one (``--endpoint auto``), else
to server_bridge.py's test bridge (``coffer serve --standalone`` behind HTTP), or to ``--server-url``.

Each scenario runs on its own (the suite would start every client scenario at once, and a timing check such as
sse-retry's cannot be judged on a machine running thirty clients), at the revision's wire version, as
``--requirements`` would.  The verdict: every scored scenario passes, except the failures listed in
tests/conformance/expected-failures.txt, each with its reason; a listed failure that no longer happens is an error
too (the list, and the README's results, must stay true).  Scenarios a revision runs without scoring (extensions,
later additions, pending ones) are reported, never judged.  Exit status 1 on anything unexpected.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DRIVER = HERE / "client_driver.py"
EXPECTED = HERE / "expected-failures.txt"
REVISIONS = ("2025-11-25", "2026-07-28")


def requirement_set(node: str, cli: str, revision: str) -> dict:
    """{"server": [...], "client": [...], "unscored": {(role, scenario): reason}} from `conformance list`."""
    text = subprocess.run([node, cli, "list", "--requirements", revision], capture_output=True, text=True,
                          check=True).stdout
    found: dict = {"server": [], "client": [], "unscored": {}}
    section, reason = None, None
    for line in text.splitlines():
        if line.startswith("Server scenarios"):
            section = "server"
        elif line.startswith("Client scenarios"):
            section = "client"
        elif line.startswith("Run and reported"):
            section = "unscored"
        elif section in ("server", "client") and line.startswith("  - "):
            found[section].append(line[4:].strip())
        elif section == "unscored" and re.match(r"^  \S.*\(\d+\):$", line):
            reason = line.strip().split(" (")[0]
        elif section == "unscored" and (match := re.match(r"^    - (\S+) \[(client|server)\]$", line)):
            found["unscored"][(match.group(2), match.group(1))] = reason
    if not found["server"] and not found["client"]:
        raise SystemExit(f"could not read the {revision} requirement set:\n{text}")
    return found


def load_expected() -> dict:
    """(role, revision, scenario) -> {check id or "*": reason} from expected-failures.txt."""
    expected: dict = {}
    for number, line in enumerate(EXPECTED.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 3)
        if len(parts) < 4 or parts[0] not in ("client", "server"):
            raise SystemExit(f"{EXPECTED.name}:{number}: expected 'role revision scenario[:check] reason'")
        role, revision, target, reason = parts
        scenario, _, check = target.partition(":")
        for rev in (REVISIONS if revision == "*" else (revision,)):
            expected.setdefault((role, rev, scenario), {})[check or "*"] = reason
    return expected


def run_scenario(node: str, cli: str, role: str, revision: str, scenario: str, out: Path, server_url: str | None,
                 timeout_ms: int) -> list[dict]:
    """Run one scenario; its checks (a failure to run is one FAILURE check)."""
    where = out / role / revision / scenario.replace("/", "_")
    where.mkdir(parents=True, exist_ok=True)
    if role == "client":
        command = ["client", "--command", f"{sys.executable} {DRIVER}", "--timeout", str(timeout_ms)]
    else:
        command = ["server", "--url", server_url]
    argv = [node, cli, *command, "--scenario", scenario, "--spec-version", revision, "--force", "-o", str(where)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_ms / 1000 + 120)
    (where / "runner-output.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    results = sorted(where.rglob("checks.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        return [{"id": scenario, "status": "FAILURE", "errorMessage": f"the suite wrote no result "
                                                                    f"(exit {proc.returncode}): {proc.stderr[-500:]}"}]
    return json.loads(results[-1].read_text())


def judge(checks: list[dict], expected: dict | None) -> tuple[str, list[str], list[str]]:
    """("pass" | "expected" | "FAIL", unexpected failures, stale expectations) of one scenario's checks."""
    failing = {}
    for check in checks:
        if check.get("status") == "FAILURE":
            failing.setdefault(check["id"], check.get("errorMessage") or check.get("description") or "")
    expected = expected or {}
    if "*" in expected:
        return ("expected", [], []) if failing else ("FAIL", [], ["the whole scenario is listed, and it passes"])
    unexpected = [f"{cid}: {text[:300]}" for cid, text in failing.items() if cid not in expected]
    stale = [f"{cid} is listed, and passes" for cid in expected if cid not in failing]
    if unexpected or stale:
        return "FAIL", unexpected, stale
    return ("expected" if failing else "pass"), [], []


def start_bridge(home: Path, revision: str, unprefixed: bool = False) -> tuple[subprocess.Popen, str]:
    """The test bridge: `coffer serve --standalone` behind HTTP, with the upstream in the revision's era."""
    shutil.rmtree(home, ignore_errors=True)  # a fresh Coffer for every run
    home.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(HERE / "server_bridge.py"), "--home", str(home),
            "--era", "modern" if revision == "2026-07-28" else "handshake"]
    log = open(home.parent / f"{home.name}.log", "w")  # noqa: SIM115 - the bridge writes to it while it runs
    proc = subprocess.Popen(argv + (["--unprefixed"] if unprefixed else []), stdout=subprocess.PIPE,
                            stderr=log, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("http"):
        proc.kill()
        raise SystemExit(f"the server bridge did not start: {line!r}")
    return proc, line


def coffer_has_endpoint() -> bool:
    """Whether this checkout's Coffer serves Streamable HTTP itself (the shared service's /mcp, with tokens)."""
    return subprocess.run([sys.executable, str(ROOT / "coffer.py"), "token", "--help"], capture_output=True,
                          env={**os.environ, "COFFER_HOME": tempfile.gettempdir() + "/coffer-none"}).returncode == 0


class ServiceEndpoint:
    """Coffer's own endpoint: a shared service with Streamable HTTP on a free loopback port, the upstream
    registered, a token for the suite, and the token-adding forwarder of server_bridge.py in front (the suite
    cannot send an Authorization header).  ``url`` is the forwarder's."""

    def __init__(self, home: Path, revision: str):
        import socket

        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        self.env = {**os.environ, "COFFER_HOME": str(home), "COFFER_SERVE_MODE": "service"}
        era = "modern" if revision == "2026-07-28" else "handshake"
        self.coffer("add", "conf", "--", sys.executable, str(HERE / "upstream_server.py"), "--era", era)
        self.coffer("config", "discovery_timeout", "30")
        token = self.coffer("token", "add", "conformance").stdout.split()[0]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.coffer("service", "start", "--http", f"127.0.0.1:{port}")
        log = open(home.parent / f"{home.name}-forward.log", "w")  # noqa: SIM115 - written while it runs
        self.forwarder = subprocess.Popen(
            [sys.executable, str(HERE / "server_bridge.py"), "--forward", f"http://127.0.0.1:{port}/mcp",
             "--token-env", "CONFORMANCE_TOKEN"], stdout=subprocess.PIPE, stderr=log, text=True,
            env={**self.env, "CONFORMANCE_TOKEN": token})
        self.url = self.forwarder.stdout.readline().strip()

    def coffer(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "coffer.py"), *args], env=self.env, check=True,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)

    def terminate(self) -> None:
        stop(self.forwarder)
        subprocess.run([sys.executable, str(ROOT / "coffer.py"), "service", "stop"], env=self.env,
                       capture_output=True, timeout=60)

    def wait(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        pass


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default=shutil.which("node") or "node")
    parser.add_argument("--cli", required=True, help="the suite's dist/index.js")
    parser.add_argument("--role", choices=("client", "server", "both"), default="both")
    parser.add_argument("--requirements", default=",".join(REVISIONS))
    parser.add_argument("--server-url", help="Coffer's Streamable HTTP endpoint (default: start the test bridge)")
    parser.add_argument("--scenario", action="append", help="only these scenarios (repeatable)")
    parser.add_argument("--out", help="where the suite's results go (default: a temporary folder, removed)")
    parser.add_argument("--timeout", type=int, default=90_000, help="ms a client scenario may take")
    parser.add_argument("--extensions", action="store_true",
                        help="also run the unscored extension scenarios (client credentials, DPoP, tasks...)")
    parser.add_argument("--quiet", action="store_true", help="print only what did not pass, and the summary")
    parser.add_argument("--endpoint", choices=("auto", "service", "bridge"), default="auto",
                        help="server scenarios: Coffer's own HTTP endpoint (service), the test bridge, or the "
                             "endpoint when this Coffer has one (auto)")
    args = parser.parse_args()
    endpoint = args.endpoint
    if endpoint == "auto":
        endpoint = "service" if "server" in (args.role, "both") and coffer_has_endpoint() else "bridge"
    started = time.monotonic()
    expected = load_expected()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="coffer-conformance-"))
    roles = ("client", "server") if args.role == "both" else (args.role,)
    rows, problems, used = [], [], set()
    bridge = None
    try:
        for revision in args.requirements.split(","):
            wanted = requirement_set(args.node, args.cli, revision)
            for role in roles:
                server_url = args.server_url
                if role == "server" and not server_url and endpoint == "service":
                    bridge = ServiceEndpoint(out / f"service-{revision}", revision)
                    server_url = bridge.url
                elif role == "server" and not server_url:
                    bridge, server_url = start_bridge(out / f"bridge-{revision}", revision)
                prefixed = []
                unscored = [s for (r, s), why in wanted["unscored"].items()
                            if r == role and (args.extensions or why != "extension")]
                for scenario in wanted[role] + unscored:
                    if args.scenario and scenario not in args.scenario:
                        continue
                    began = time.monotonic()
                    checks = run_scenario(args.node, args.cli, role, revision, scenario, out, server_url,
                                          args.timeout)
                    key = (role, revision, scenario)
                    scored = scenario in wanted[role]
                    verdict, unexpected, stale = judge(checks, expected.get(key) if scored else None)
                    if scored:
                        used.add(key)
                        if verdict == "expected" and any(why.startswith("prefix")
                                                         for why in expected[key].values()):
                            prefixed.append(scenario)
                    elif verdict == "FAIL":
                        verdict = "unscored-fail"  # reported, never judged
                    warnings = sorted({c["id"] for c in checks if c.get("status") == "WARNING"})
                    rows.append((role, revision, scenario, scored, verdict, time.monotonic() - began, warnings))
                    label = "" if scored else f" [not scored: {wanted['unscored'][(role, scenario)]}]"
                    why = " -- " + "; ".join(sorted(set(expected[key].values()))) if verdict == "expected" else ""
                    note = f" (warnings: {', '.join(warnings)})" if warnings else ""
                    if not args.quiet or verdict not in ("pass", "expected") or warnings:
                        print(f"{verdict:>13}  {role} {revision} {scenario}{label}{why}{note}  "
                              f"({time.monotonic() - began:.1f} s)", flush=True)
                    if scored and verdict == "FAIL":
                        for text in unexpected + stale:
                            print(f"{'':>15}{text}", flush=True)
                            problems.append(f"{role} {revision} {scenario}: {text}")
                stop(bridge)
                bridge = None
                if prefixed:  # each "prefix" failure must pass once the prefix is taken away
                    bridge, plain_url = start_bridge(out / f"bridge-{revision}-unprefixed", revision, True)
                    for scenario in prefixed:
                        checks = run_scenario(args.node, args.cli, "server", f"{revision}", scenario,
                                              out / "unprefixed", plain_url, args.timeout)
                        verdict, unexpected, _ = judge(checks, None)
                        if not args.quiet or verdict != "pass":
                            print(f"{'unprefixed ' + verdict:>17}  server {revision} {scenario}", flush=True)
                        if verdict != "pass":
                            for text in unexpected:
                                print(f"{'':>19}{text}", flush=True)
                            problems.append(f"server {revision} {scenario}: listed as failing only because of "
                                            f"the prefix, but fails without it too ({'; '.join(unexpected)[:300]})")
                    stop(bridge)
                    bridge = None
    finally:
        stop(bridge)
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    if not args.scenario:
        for key in sorted(set(expected) - used):
            if key[0] in roles and key[1] in args.requirements.split(","):
                problems.append(f"{' '.join(key)}: listed in {EXPECTED.name} but not a scored scenario that ran")
    scored_rows = [row for row in rows if row[3]]
    good = {f"{row[0]} {row[1]} {row[2]}" for row in scored_rows if row[4] in ("pass", "expected")}
    passed = sum(1 for row in scored_rows if row[4] == "pass")
    listed = sum(1 for row in scored_rows if row[4] == "expected")
    print(f"\n{len(scored_rows)} scored scenarios: {passed} pass, {listed} fail only for the documented reasons "
          f"(tests/conformance/expected-failures.txt); {len(rows) - len(scored_rows)} unscored run; "
          f"{time.monotonic() - started:.0f} s")
    for problem in problems:
        print(f"  {problem}")
    failed = {problem.split(":")[0] for problem in problems}  # "role revision scenario"
    print(f"conformance: {passed + listed - len(failed & good)} passed, {len(failed)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
