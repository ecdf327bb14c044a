"""Coffer as the client under test of the MCP conformance suite's client scenarios.

The suite starts a mock MCP server for a scenario and runs this script with the server's URL as its last
argument (MCP_CONFORMANCE_SCENARIO names the scenario, MCP_CONFORMANCE_PROTOCOL_VERSION the wire revision,
MCP_CONFORMANCE_CONTEXT what a scenario hands its client, such as a pre-registered OAuth client).  The client the
suite sees is Coffer itself: this script does what a user and an agent would do, nothing more --

1. ``coffer add conf --url URL`` in a private COFFER_HOME (with ``--oauth-client-id`` where the scenario
   pre-registered a client);
2. ``coffer auth conf`` for the authorization scenarios, with a stand-in browser that follows the authorization
   server's redirect, as a person clicking "Allow" would (tests/fixtures/fake_browser.py);
3. ``coffer serve --standalone``, spoken to over stdio as an agent would: the handshake (or, for 2026-07-28, the
   per-request envelope), tools/list, and a call of the scenario's tool, answering the questions Coffer relays
   (elicitation with the schema's defaults, sampling, roots).  A call that fails because the server wants a
   login, or a larger one, is followed by ``coffer auth conf`` and the call again, as the error tells the agent.

Stdlib only; it runs the generated coffer.py of this checkout with the interpreter that runs it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COFFER = [sys.executable, str(ROOT / "coffer.py")]
FAKE_BROWSER = ROOT / "tests" / "fixtures" / "fake_browser.py"
MODERN = "2026-07-28"
SERVER = "conf"
PREFIX = SERVER + "__"
CLIENT_INFO = {"name": "coffer-conformance-driver", "version": "1.0.0"}
CAPABILITIES = {"elicitation": {"form": {}}, "sampling": {}, "roots": {"listChanged": True}}
# The Client ID Metadata Document URL the suite's own reference client presents (the mock authorization server
# accepts any https URL with a path; nothing fetches it).
CIMD_URL = "https://conformance-test.local/client-metadata.json"
LOGIN_WORDS = ("coffer auth", "needs login")


def say(text: str) -> None:
    print(f"[driver] {text}", file=sys.stderr, flush=True)


def coffer(home: Path, *args: str, env: dict | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    proc = subprocess.run([*COFFER, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "COFFER_HOME": str(home), **(env or {})})
    say(f"coffer {' '.join(args)} -> {proc.returncode}: {(proc.stdout + proc.stderr).strip()[:800]}")
    return proc


def browser_env(home: Path) -> dict:
    wrapper = home.parent / "browser.sh"
    if not wrapper.exists():
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_BROWSER}" "$@"\n')
        wrapper.chmod(0o755)
    return {"BROWSER": str(wrapper)}


def apply_defaults(schema: dict, content: dict) -> dict:
    """What a person accepting a form sends: every field the schema gives a default keeps it, and a required one
    without a default gets a plain answer ("yes" to a confirmation)."""
    filled = dict(content)
    required = set(schema.get("required") or ())
    for key, prop in (schema.get("properties") or {}).items():
        if key in filled or not isinstance(prop, dict):
            continue
        if "default" in prop:
            filled[key] = prop["default"]
        elif key in required:
            filled[key] = {"boolean": True, "integer": 1, "number": 1}.get(prop.get("type"), "yes")
    return filled


def answer_question(method: str, params: dict) -> dict:
    if method == "elicitation/create":
        if params.get("mode") == "url":
            return {"action": "accept"}
        return {"action": "accept", "content": apply_defaults(params.get("requestedSchema") or {}, {})}
    if method == "sampling/createMessage":
        return {"role": "assistant", "content": {"type": "text", "text": "a sampled answer"}, "model": "driver",
                "stopReason": "endTurn"}
    if method == "roots/list":
        return {"roots": []}
    raise ValueError(method)


class Gateway:
    """``coffer serve --standalone`` over stdio, as an agent speaks to it."""

    def __init__(self, home: Path, version: str):
        self.version = version
        self.modern = version == MODERN
        self.proc = subprocess.Popen([*COFFER, "serve", "--standalone"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "COFFER_HOME": str(home)})
        self.replies: dict = {}
        self.cond = threading.Condition()
        self.ids = iter(range(1, 1 << 30))
        self.stderr: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _write(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "method" in message and "id" in message:  # Coffer relays a server's question
                try:
                    self._write({"jsonrpc": "2.0", "id": message["id"],
                                 "result": answer_question(message["method"], message.get("params") or {})})
                except ValueError:
                    self._write({"jsonrpc": "2.0", "id": message["id"],
                                 "error": {"code": -32601, "message": "Method not found"}})
                continue
            if "id" in message:
                with self.cond:
                    self.replies[message["id"]] = message
                    self.cond.notify_all()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            sys.stderr.write("[coffer] " + line.decode("utf-8", "replace"))

    def request(self, method: str, params: dict | None = None, timeout: float = 25.0) -> dict:
        msg_id = next(self.ids)
        params = dict(params or {})
        if self.modern:
            params["_meta"] = {**params.get("_meta", {}), "io.modelcontextprotocol/protocolVersion": MODERN,
                               "io.modelcontextprotocol/clientCapabilities": CAPABILITIES,
                               "io.modelcontextprotocol/clientInfo": CLIENT_INFO}
        self._write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        with self.cond:
            while msg_id not in self.replies:
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"no answer to {method}")
            reply = self.replies.pop(msg_id)
        say(f"{method} -> {json.dumps(reply)[:600]}")
        return reply

    def start(self) -> None:
        if self.modern:
            self.request("server/discover")
        else:
            self.request("initialize", {"protocolVersion": self.version, "capabilities": CAPABILITIES,
                                        "clientInfo": CLIENT_INFO})
            self._write({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, name: str, arguments: dict, before_retry=None) -> dict:
        """tools/call, answering a 2026-07-28 input_required round by retrying with the answers (``before_retry``
        runs between a round and its retry: another call in the meantime)."""
        params: dict = {"name": name, "arguments": arguments}
        for _ in range(8):
            reply = self.request("tools/call", params)
            result = reply.get("result") or {}
            if result.get("resultType") != "input_required":
                return reply
            if before_retry is not None:
                before_retry()
            answers = {key: answer_question(question["method"], question.get("params") or {})
                       for key, question in (result.get("inputRequests") or {}).items()}
            params = {"name": name, "arguments": arguments, "inputResponses": answers}
            if result.get("requestState") is not None:
                params["requestState"] = result["requestState"]
        return reply

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def needs_login(reply: dict) -> bool:
    text = json.dumps(reply.get("error") or (reply.get("result") or {}).get("content") or "")
    failed = "error" in reply or (reply.get("result") or {}).get("isError")
    return bool(failed) and any(word in text for word in LOGIN_WORDS)


def login(home: Path) -> bool:
    return coffer(home, "auth", SERVER, "--timeout", "20", env=browser_env(home), timeout=60).returncode == 0


def pick_tool(tools: list[dict], scenario: str) -> dict | None:
    upstream = [tool for tool in tools if tool["name"].startswith(PREFIX)]
    wanted = {"elicitation-sep1034-client-defaults": "test_client_elicitation_defaults",
              "json-schema-2020-12-preservation": "json_schema_echo"}.get(scenario)
    if wanted:
        return next((tool for tool in upstream if tool["name"] == PREFIX + wanted), None)
    return upstream[0] if upstream else None


def arguments_for(tool: dict, tools: list[dict], scenario: str) -> dict:
    if scenario == "json-schema-2020-12-preservation":
        focal = next((t for t in tools if t["name"] == PREFIX + "json_schema_2020_12_tool"), {})
        return {"schema": focal.get("inputSchema")}
    properties = (tool.get("inputSchema") or {}).get("properties") or {}
    if {"a", "b"} <= properties.keys():
        return {"a": 2, "b": 3}
    return {}


def run(url: str, scenario: str, version: str, context: dict, home: Path) -> int:
    add = ["add", SERVER, "--url", url]
    env = {}
    if context.get("client_id"):
        add += ["--oauth-client-id", context["client_id"]]
        if context.get("client_secret"):
            add += ["--oauth-client-secret-env", "CONF_CLIENT_SECRET"]
            env["CONF_CLIENT_SECRET"] = context["client_secret"]
            os.environ["CONF_CLIENT_SECRET"] = context["client_secret"]
    coffer(home, "config", "oauth_client_metadata_url", CIMD_URL)
    # The first tools/list waits for the server's start (a busy machine may take more than the default 5 s);
    # a server that fails, or needs a login, is answered for at once.
    coffer(home, "config", "discovery_timeout", "20")
    coffer(home, "add", *add[1:], env=env)
    if scenario.startswith("auth/"):
        status = coffer(home, "list", "--json")
        if "coffer auth" in status.stdout or "needs login" in status.stdout:
            if not login(home):
                return 1
    gateway = Gateway(home, version)
    try:
        gateway.start()
        tools = gateway.request("tools/list").get("result", {}).get("tools", [])
        if scenario in ("json-schema-ref-no-deref",):
            return 0
        if context.get("toolCalls"):  # the calls a scenario asks for, with its own arguments
            replies = [gateway.call(PREFIX + call["name"], call.get("arguments") or {})
                       for call in context["toolCalls"]]
            return 0 if all("result" in reply for reply in replies) else 1
        if scenario == "sep-2322-client-request-state":  # a call between a round and its retry must stay apart
            unrelated = lambda: gateway.call(PREFIX + "test_mrtr_unrelated", {})  # noqa: E731
            replies = [gateway.call(PREFIX + "test_mrtr_echo_state", {}, before_retry=unrelated),
                       gateway.call(PREFIX + "test_mrtr_no_state", {}),
                       gateway.call(PREFIX + "test_mrtr_no_result_type", {})]
            return 0 if all("result" in reply for reply in replies) else 1
        if scenario == "http-invalid-tool-headers":  # every tool Coffer lists: it must have refused the invalid ones
            replies = [gateway.call(tool["name"], {"region": "us-west1"}) for tool in tools
                       if tool["name"].startswith(PREFIX)]
            return 0 if replies and all("result" in reply for reply in replies) else 1
        logins = 0
        while True:
            tool = pick_tool(tools, scenario)
            if tool is None:
                if scenario.startswith("auth/") and logins < 2 and login(home):
                    logins += 1  # the server asked for the login only once it was listed
                    time.sleep(1.5)  # the gateway notices the new login within a second, and restarts it
                    tools = gateway.request("tools/list").get("result", {}).get("tools", [])
                    continue
                say(f"{SERVER} offers no tool to call")
                return 0
            reply = gateway.call(tool["name"], arguments_for(tool, tools, scenario))
            if needs_login(reply) and logins < 2:
                logins += 1
                if not login(home):
                    return 1
                time.sleep(1.5)
                tools = gateway.request("tools/list").get("result", {}).get("tools", [])
                continue
            return 0 if "result" in reply and not reply["result"].get("isError") else 1
    finally:
        gateway.close()


def main() -> int:
    url = sys.argv[-1]
    scenario = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
    version = os.environ.get("MCP_CONFORMANCE_PROTOCOL_VERSION", "2025-11-25")
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    base = Path(tempfile.mkdtemp(prefix="coffer-conformance-"))
    try:
        return run(url, scenario, version, context, base / "home")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
