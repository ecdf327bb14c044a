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


# -- 12-15. install --replace, renames, Claude Code's local scope, project files ------------------------------------

@pytest.fixture
def machine(tmp_path):
    """A user's machine: HOME, the client config dirs and COFFER_HOME inside tmp, a project directory to work in."""
    home, project = tmp_path / "home", tmp_path / "work" / "project"
    project.mkdir(parents=True)
    (home / ".config").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "USERPROFILE": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "APPDATA": str(home / "AppData" / "Roaming"), "CODEX_HOME": str(home / ".codex"),
           "COFFER_HOME": str(tmp_path / "coffer-home")}
    env.pop("FLATPAK_XDG_CONFIG_HOME", None)

    def run(*args, check=True, cwd=project):
        proc = subprocess.run([PY, COFFER, *args], capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"coffer {' '.join(args)} exited {proc.returncode}: {proc.stderr}{proc.stdout}")
        return proc

    class Machine:
        pass

    m = Machine()
    m.home, m.project, m.env, m.run, m.coffer_home = home, project, env, run, tmp_path / "coffer-home"
    return m


def write_json(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))
    return path


def test_install_replace_recognises_every_server_imported_from_that_file(machine):
    vscode = write_json(machine.project / ".vscode" / "mcp.json", {
        "inputs": [{"type": "promptString", "id": "api-token", "description": "token", "password": True}],
        "servers": {"memory": {"type": "stdio", "command": PY, "args": ["-c", "pass"],
                               "env": {"MEMORY_FILE_PATH": str(machine.project / "memory.jsonl"),
                                       "API_TOKEN": "${input:api-token}"}},
                    "tokened": {"type": "stdio", "command": PY, "args": ["-c", "pass", "--token", "ghp_" + "x1Y2" * 8],
                                "env": {"SECRET_KEY": "sk-" + "Lm4Nb5Vc6" * 3}}}})
    imported = machine.run("import", "vscode")
    assert "${API_TOKEN}" in imported.stdout  # the input is now a reference the user sets, as the plan says:
    subprocess.run([PY, COFFER, "secret", "set", "API_TOKEN"], input="tok-" + "9" * 20, text=True, check=True,
                   env=machine.env, capture_output=True)
    machine.run("install", "vscode", "--project")
    again = machine.run("install", "vscode", "--project")
    assert "already as wanted" in again.stdout
    replaced = machine.run("install", "vscode", "--project", "--replace")
    assert "already as wanted" not in replaced.stdout, replaced.stdout
    servers = json.loads(vscode.read_text())["servers"]
    assert set(servers) == {"coffer"}, servers


def test_install_replace_says_which_tool_names_moved_when_import_renamed_a_server(machine):
    write_json(machine.home / ".config" / "Claude" / "claude_desktop_config.json", {"mcpServers": {
        "filesystem": {"command": PY, "args": ["-c", "pass", "/home/me/a"]}}})
    cursor = write_json(machine.home / ".cursor" / "mcp.json", {"mcpServers": {
        "filesystem": {"command": PY, "args": ["-c", "pass", "/home/me/b"]}}})
    imported = machine.run("import", "claude-desktop", "cursor")
    assert "filesystem-2" in imported.stdout
    out = machine.run("install", "cursor", "--replace").stdout
    assert set(json.loads(cursor.read_text())["mcpServers"]) == {"coffer"}
    assert "filesystem is served as filesystem-2" in out, out
    assert "filesystem-2__" in out and "filesystem__<tool> now reaches another server" in out, out


def test_claude_code_local_scope_is_replaced_doctor_says_so_and_its_fix_works(machine, tmp_path):
    project = str(machine.project)
    claude = write_json(machine.home / ".claude.json", {"numStartups": 3, "mcpServers": {}, "projects": {
        project: {"mcpServers": {"local-a": {"type": "stdio", "command": PY, "args": ["-c", "pass", "local"]}}}}})
    machine.run("import", "claude-code")
    machine.run("install", "claude-code")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("# Deploys\nWe deploy on Tuesdays.\n")
    machine.run("knowledge", "add", str(notes))
    (notes / "a.md").unlink()
    notes.rmdir()
    doctor = machine.run("doctor", check=False)
    assert "local scope" in doctor.stdout and "also runs, and Coffer serves: local-a" in doctor.stdout, doctor.stdout
    report = json.loads(machine.run("doctor", "--json", check=False).stdout)
    local = next(c for c in report["clients"] if c["scope"] == "local")
    assert local["duplicates"] == ["local-a"]
    fix = local["problems"][0]["fix"]
    assert fix.endswith("coffer install claude-code --replace") and project in fix
    knowledge = report["knowledge"]
    assert any("is gone" in p["problem"] for p in knowledge["problems"]), knowledge
    assert "knowledge" in doctor.stdout and "is gone" in doctor.stdout
    machine.run("install", "claude-code", "--replace", cwd=project)   # the suggested fix, run where it says
    assert json.loads(claude.read_text())["projects"][project]["mcpServers"] == {}
    after = json.loads(machine.run("doctor", "--json", check=False).stdout)
    assert not [c for c in after["clients"] if c["duplicates"]], after["clients"]
    machine.run("uninstall", "claude-code", cwd=project)   # and uninstall puts it back
    assert "local-a" in json.loads(claude.read_text())["projects"][project]["mcpServers"]


def test_a_project_install_writes_a_portable_entry_and_keeps_backups_out_of_the_repository(machine, tmp_path):
    cursor = write_json(machine.project / ".cursor" / "mcp.json", {"mcpServers": {
        "team": {"command": "npx", "args": ["-y", "some-team-server"]}}})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "coffer").write_text(f"#!/bin/sh\nexec {PY} {COFFER} \"$@\"\n")
    (bin_dir / "coffer").chmod(0o755)
    machine.env["PATH"] = f"{bin_dir}{os.pathsep}{machine.env['PATH']}"
    out = machine.run("install", "cursor", "--project").stdout
    entry = json.loads(cursor.read_text())["mcpServers"]["coffer"]
    assert entry == {"command": "coffer", "args": ["serve"]}, entry   # no per-user path, no COFFER_HOME
    assert "COFFER_HOME" in out  # ...and it says why the user's own home is not written there
    in_repo = [p.name for p in machine.project.rglob("*") if "backup" in p.name]
    assert not in_repo, in_repo
    backup = [line.split("backup: ", 1)[1] for line in out.splitlines() if "backup: " in line][0]
    assert backup.startswith(str(machine.coffer_home)), backup
    # without a `coffer` on PATH the entry cannot be portable: it says why
    machine.env["PATH"] = os.pathsep.join(d for d in machine.env["PATH"].split(os.pathsep)[1:]
                                          if not os.path.exists(os.path.join(d, "coffer")))
    machine.run("uninstall", "cursor", "--project")
    out = machine.run("install", "cursor", "--project").stdout
    assert "not on PATH" in out and "pipx install coffer-mcp" in out, out


# -- 16. what a client really gets -----------------------------------------------------------------------------------

def test_tools_for_a_client_shows_what_it_gets_and_its_budget_picks_read_only_tools(home):
    cli("add", "h", "--", *HOSTILE, "--name", "h", "--mode", "annotated", "--count", "60")
    cli("config", "memory", "on")

    async def as_cursor(client):
        return [t.name for t in (await client.list_tools()).tools]

    async def body(client):
        return await as_cursor(client)

    cli("tools")  # once, so --cached has something
    cursor_gets = anyio.run(lambda: _listed_as("Cursor", body))
    assert "coffer__ask" in cursor_gets and "coffer__remember" in cursor_gets
    assert len(cursor_gets) <= 40
    assert "h__reader" in cursor_gets, "the budget's pick for a server is a write tool, not its read-only one"
    shown = json.loads(cli("tools", "--cached", "--client", "cursor", "--json").stdout)["tools"]
    assert [t["name"] for t in shown] == cursor_gets
    refused = cli("tools", "--cached", "--client", "crusor", check=False)
    assert refused.returncode != 0 and "did you mean cursor" in refused.stderr, refused.stderr


async def _listed_as(client_name, body):
    async with Client(gateway_params(), client_info=types.Implementation(name=client_name, version="1"),
                      mode="legacy") as client:
        return await body(client)


# -- 17. messages a person reads ---------------------------------------------------------------------------------------

def test_messages_say_what_a_person_needs(home, tmp_path):
    from fixtures.hostile_http import HostileHttp, status

    cli("add", "h", "--", *HOSTILE, "--name", "h")
    cli("tools")
    mistyped = cli("call", "h__ecoh", "{}", check=False)
    assert mistyped.returncode == 1
    assert "did you mean h__echo" in mistyped.stderr and "search_tools" not in mistyped.stderr, mistyped.stderr

    no_dashes = cli("add", "t", "uvx", "mcp-server-time", check=False)
    assert no_dashes.returncode == 2 and "put -- before the server's command" in no_dashes.stderr, no_dashes.stderr
    assert "coffer add t [options] -- uvx mcp-server-time" in no_dashes.stderr

    cli("config", "init_timeout", "8")
    cli("add", "slow", "--", *HOSTILE, "--name", "slow", "--wait-file", str(tmp_path / "never"))
    waited = cli("tools", check=False)
    assert "still waiting for slow" in waited.stderr, waited.stderr
    cli("remove", "slow")

    server = HostileHttp()
    try:
        server.routes["/mcp"] = status(401)
        added = cli("add", "k", "--url", server.url("/mcp"), "--header", "X-Api-Key=sk-" + "Wq1Er2Ty3" * 3)
        said = added.stdout + added.stderr
        assert "X-Api-Key" in said and "coffer auth k" in said, said
    finally:
        server.close()

    removed = cli("remove", "k")
    assert "K_X_API_KEY" in removed.stdout and "coffer secret rm" in removed.stdout, removed.stdout

    missing = cli("import", "/no/such/file", check=False)
    lines = [line for line in missing.stdout.splitlines() if line.strip()]
    assert lines == ["! nothing imported from /no/such/file: there is no such file"], missing.stdout


# -- 18. coffer audit --------------------------------------------------------------------------------------------------

def test_audit_counts_what_it_hides_names_tools_as_clients_do_and_understands_kinds_and_spans(home, tmp_path):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"imported": {"command": PY, "args": ["-c", "pass"]}}}))
    cli("import", str(config))
    cli("add", "h", "--", *HOSTILE, "--name", "h")
    cli("tools", check=False)  # (imported is no MCP server: it fails, h lists its tools)
    cli("disable", "h__echo")
    out = cli("audit", "--limit", "3").stdout
    assert "showing the newest 3 of" in out, out[-300:]
    rows = json.loads(cli("audit", "--json", "--limit", "1000").stdout)["audit"]
    targets = {row["target"] for row in rows if row["action"] in ("upstream-added", "disable")}
    assert "h__echo" in targets and not any(":" in target for target in targets), targets
    added = json.loads(cli("audit", "--json", "--kind", "add").stdout)["audit"]
    assert {row["target"] for row in added} >= {"h", "imported"}, added
    for span in ("yesterday", "7d", "24h", "today"):
        recent = json.loads(cli("audit", "--json", "--limit", "1000", "--since", span).stdout)["audit"]
        assert len(recent) == len(rows), span
    assert json.loads(cli("audit", "--json", "--since", "2999-01-01").stdout)["audit"] == []


# -- 19. knowledge and memory -----------------------------------------------------------------------------------------

def test_knowledge_and_memory_answer_a_new_user_well(home, tmp_path):
    from fixtures.hostile_http import HostileHttp, embeddings

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "desserts.txt").write_bytes("Crème brûlée is served on Fridays at the café.\n".encode("latin-1"))
    (notes / "deploys.md").write_text("# Deploys\n\nWe deploy on Tuesdays, never on Fridays.\n")
    server = HostileHttp()
    try:
        server.routes["/v1/embeddings"] = embeddings(dim=8)
        cli("config", "embedder_url", server.url("/v1"))
        cli("config", "embedder_model", "test-embed")
        added = cli("knowledge", "add", str(notes), "--glob", "*.md", "--glob", "*.txt")
        assert server.seen("POST"), "knowledge add did not embed the passages"
        assert "embedded" in added.stdout, added.stdout
        listed = json.loads(cli("knowledge", "list", "--json").stdout)["sources"]
        assert [(s["passages"], s["vectors"]) for s in listed] == [(2, 2)], listed
        cli("config", "embedder_url", "")
    finally:
        server.close()

    async def body(client):
        asked = await client.call_tool("coffer__ask", {"question": "When is crème brûlée served?"})
        remembered = await client.call_tool("coffer__remember", {"text": "We deploy on Tuesdays."})
        return asked, remembered

    asked, remembered = run(body, mode="legacy")
    answer = asked.structured_content
    assert answer["ranker"], answer
    first = answer["passages"][0]
    assert "Crème brûlée" in first["text"] and "\ufffd" not in first["text"], first  # Latin-1, decoded
    assert os.path.isabs(first["file"]) and open(first["file"], "rb").read().startswith(b"Cr")
    assert remembered.is_error and "coffer config memory on" in text_of(remembered), text_of(remembered)
    readme = (ROOT / "README.md").read_text()
    assert "## Knowledge and memory" in readme
    section = readme.split("## Knowledge and memory", 1)[1].split("\n## ", 1)[0]
    for needed in ("coffer knowledge add", "coffer__ask", "coffer config memory on", "coffer__remember",
                   "embedder"):
        assert needed in section, needed


# -- 8. an install line that works today, and a release ready for PyPI ----------------------------------------------

def test_the_first_install_line_works_today_and_a_tag_releases_to_pypi():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = install.split("```sh", 1)[1].split("```", 1)[0]
    first = next(line for line in block.splitlines() if line.strip())
    assert "coffer-mcp" not in first.split("#")[0], f"the first install line needs PyPI: {first}"
    assert "pipx install ./coffer" in first or "coffer.py" in first, first
    assert "python3 coffer/coffer.py --version" in block
    version = subprocess.run([PY, COFFER, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("coffer ")  # what the release checks its tag against
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    for step in ('tags: ["v*"]', "tools/amalgamate.py --check", "python -m build", "twine check",
                 "pypa/gh-action-pypi-publish", "id-token: write", '"coffer ${GITHUB_REF_NAME#v}"'):
        assert step in workflow, step
