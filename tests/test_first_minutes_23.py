"""Issue 23, the first ten minutes (items 8-19): what a new user ran into, each as they meet it -- the CLI as a
subprocess, the official MCP SDK client against the real ``coffer serve`` where a client is involved."""

import json
import os
import subprocess

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import COFFER, HOSTILE, PY, ROOT, cli


def gateway_params(env=None):
    return StdioServerParameters(command=PY, args=[COFFER, "serve"], env={**os.environ, **(env or {})})


def run(body, env=None, **client_kwargs):
    async def main():
        async with Client(gateway_params(env), client_info=types.Implementation(name="first-minutes", version="1"),
                          **client_kwargs) as client:
            return await body(client)
    return anyio.run(main)


def text_of(result):
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


def servers():
    return {s["name"]: s for s in json.loads(cli("list", "--json").stdout)["servers"]}


class ListChanges:
    """A message handler counting notifications/tools/list_changed, so a test can wait for the next one."""

    def __init__(self):
        self.count = 0

    async def __call__(self, message):
        if isinstance(message, types.ServerNotification) and \
                getattr(message.root if hasattr(message, "root") else message, "method", "") == \
                "notifications/tools/list_changed":
            self.count += 1
        elif getattr(message, "method", None) == "notifications/tools/list_changed":
            self.count += 1

    async def wait_beyond(self, seen, timeout=30):
        with anyio.fail_after(timeout):
            while self.count <= seen:
                await anyio.sleep(0.05)


# -- 9. a server that failed last time holds no list --------------------------------------------------------------

def test_a_server_that_failed_last_time_never_holds_the_first_list_and_is_announced_when_it_comes_up(home,
                                                                                                     tmp_path):
    cli("config", "discovery_timeout", "120")   # what a list would wait for it: far beyond the test's patience
    cli("config", "max_restarts", "1")
    args = tmp_path / "h.args"
    args.write_text("--mode exit")
    cli("add", "h", "--", *HOSTILE, "--name", "h", "--args-file", str(args))
    cli("add", "good", "--", *HOSTILE, "--name", "good")
    cli("tools", check=False)                   # the first run: h fails, good is remembered
    assert servers()["h"]["status"] == "failed"
    gate = tmp_path / "gate"
    args.write_text(f"--wait-file {gate}")      # fixed: it will come up, once the test lets it
    changes = ListChanges()

    async def body(client):
        with anyio.fail_after(20):
            first = [t.name for t in (await client.list_tools()).tools]
        seen = changes.count
        gate.write_text("go")
        await changes.wait_beyond(seen)
        return first, [t.name for t in (await client.list_tools()).tools]

    first, later = run(body, mode="legacy", message_handler=changes)
    assert "good__echo" in first and "h__echo" not in first
    assert "h__echo" in later, later


# -- 10. a failed server's tool says why, and what fixes it -------------------------------------------------------

def test_calling_a_listed_tool_of_a_failed_server_says_its_failure_and_the_fix(home, tmp_path):
    cli("config", "max_restarts", "1")
    args = tmp_path / "h.args"
    args.write_text("")
    cli("add", "h", "--", *HOSTILE, "--name", "h", "--args-file", str(args))
    cli("tools")                                # h worked once: its tools are remembered
    args.write_text("--mode exit")              # and now it fails at start
    changes = ListChanges()

    async def body(client):
        listed = [t.name for t in (await client.list_tools()).tools]
        with anyio.fail_after(30):
            while servers()["h"]["status"] != "failed":
                await anyio.sleep(0.1)
        try:
            result = await client.call_tool("h__echo", {"text": "x"})
            return listed, text_of(result)
        except Exception as exc:  # noqa: BLE001 - the SDK raises the JSON-RPC error
            return listed, str(exc)

    listed, answer = run(body, mode="legacy", message_handler=changes)
    assert "h__echo" in listed
    assert "search_tools" not in answer and "Unknown tool" not in answer, answer
    assert "failed" in answer and "boom" in answer, answer       # what went wrong (its stderr)...
    assert "coffer doctor" in answer, answer                     # ...and what to run about it
    listing = cli("list").stdout
    assert "fix: coffer doctor" in listing, listing


def test_a_server_whose_variable_is_unset_fails_at_once_saying_what_to_set(home, tmp_path):
    spawns = tmp_path / "spawns"
    cli("add", "h", "--env", "TOKEN=${COFFER_TEST_NEVER_SET}", "--",
        *HOSTILE, "--name", "h", "--spawn-log", str(spawns))
    env = {k: v for k, v in os.environ.items() if k != "COFFER_TEST_NEVER_SET"}
    proc = subprocess.run([PY, COFFER, "tools"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "set COFFER_TEST_NEVER_SET" in proc.stderr, proc.stderr
    assert "coffer secret set COFFER_TEST_NEVER_SET" in proc.stderr
    assert not spawns.exists(), "the server was started with an empty value"
    assert servers()["h"]["status"] == "failed"
    assert "fix: coffer secret set COFFER_TEST_NEVER_SET" in cli("list").stdout


# -- 11. only secret-looking values move; import warns about a missing command; --dry-run writes nothing ----------

API_KEY = "sk-" + "Rt5Yu6Io7" * 3


def test_import_moves_only_secret_looking_values_warns_about_commands_and_a_dry_run_writes_nothing(home, tmp_path):
    config = tmp_path / "claude_desktop_config.json"
    config.write_text(json.dumps({"mcpServers": {
        "memory": {"command": PY, "args": ["-c", "pass"],
                   "env": {"MEMORY_FILE_PATH": "/home/me/memory.jsonl", "MODE": "quiet", "API_KEY": API_KEY}},
        "gone": {"command": "no-such-command-for-coffer-23", "args": []}}}))
    dry = cli("import", str(config), "--dry-run")
    assert not home.exists(), f"--dry-run created {sorted(p.name for p in home.iterdir())}"
    assert "no-such-command-for-coffer-23" in dry.stdout and "not on PATH" in dry.stdout, dry.stdout
    assert "MEMORY_API_KEY" in dry.stdout and "MEMORY_MEMORY_FILE_PATH" not in dry.stdout
    cli("import", str(config))
    shown = json.loads(cli("show", "memory", "--json").stdout)
    assert shown["env"] == {"MEMORY_FILE_PATH": "/home/me/memory.jsonl", "MODE": "quiet",
                            "API_KEY": "${MEMORY_API_KEY}"}
    assert json.loads(cli("secret", "list", "--json").stdout)["secrets"] == ["MEMORY_API_KEY"]
    # `coffer add` by the same rule
    added = cli("add", "other", "--env", "DATA_DIR=/srv/data", "--env", f"SERVICE_TOKEN={API_KEY}x",
                "--", PY, "-c", "pass")
    assert "${OTHER_SERVICE_TOKEN}" in added.stdout and "DATA_DIR" not in added.stdout
    assert json.loads(cli("show", "other", "--json").stdout)["env"] == {
        "DATA_DIR": "/srv/data", "SERVICE_TOKEN": "${OTHER_SERVICE_TOKEN}"}
