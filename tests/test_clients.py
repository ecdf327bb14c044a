"""Moving in (issue 11): a temporary HOME and project holding real config files of every client Coffer knows,
then ``coffer import``, ``install``/``uninstall``, ``doctor`` and ``show`` as a user runs them, and finally the
official SDK client driving ``coffer serve`` exactly as a client's installed entry starts it.

Every CLI run is a subprocess with HOME, XDG_CONFIG_HOME, APPDATA, CODEX_HOME and COFFER_HOME inside tmp, so
nothing of the machine's own clients is read or written.
"""

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coffer_src.clients import files
from coffer_src.clients.files import ClientContext, ConfigProblem, JsonDocument, TomlSubset, load_toml, read_config_text
from coffer_src.clients.move_in import client_files

from conftest import FAKE, PY, TIME_SERVER, coffer_cmd, write

DESKTOP_SECRET = "sk-desktop-literal-1234"
TEAM_SECRET = "Bearer team-literal-token-5678"
CODEX_ORG = "acme-org-literal-9012"
LONG_TOOL = "summarise_every_open_pull_request_for_the_release"  # 49 characters


@pytest.fixture
def world(tmp_path):
    """A user's machine: a home with every client's config, a project directory, an empty Coffer vault."""
    home, project = tmp_path / "home", tmp_path / "work" / "project"
    config, codex_home = home / ".config", home / "codex-home"
    project.mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "USERPROFILE": str(home), "XDG_CONFIG_HOME": str(config),
           "APPDATA": str(home / "AppData" / "Roaming"), "CODEX_HOME": str(codex_home),
           "COFFER_HOME": str(tmp_path / "coffer-home")}
    for variable in ("API_TOKEN", "CURSOR_TOKEN", "WS_TOKEN", "CODEX_TOKEN", "CODEX_KEY", "GEM_KEY", "VS_TOKEN",
                     "FLATPAK_XDG_CONFIG_HOME"):
        env.pop(variable, None)
    time_entry = {"command": PY, "args": TIME_SERVER[1:]}
    echo = {"command": PY, "args": [FAKE[1], "--name", "desktop-echo"], "env": {"API_KEY": DESKTOP_SECRET}}
    files = {}
    files["claude-desktop"] = write(config / "Claude" / "claude_desktop_config.json", json.dumps(
        {"globalShortcut": "Ctrl+Space", "mcpServers": {"time": time_entry, "my_server": echo}}, indent=2))
    files["claude-code"] = write(home / ".claude.json", json.dumps({
        "numStartups": 42, "theme": "dark",
        "mcpServers": {
            "time": {"type": "stdio", **time_entry, "env": {}},
            "remote-sse": {"type": "sse", "url": "https://sse.example.invalid/sse",
                           "headers": {"X-Api-Key": "${API_TOKEN}"}}},
        "projects": {str(project): {"allowedTools": [], "mcpServers": {
            "local-echo": {"type": "stdio", "command": PY,
                           "args": [FAKE[1], "--name", "local", "--tools", f"echo,{LONG_TOOL}"]}}},
                     "/somewhere/else": {"mcpServers": {"elsewhere": {"command": "true"}}}}}, indent=2))
    files["claude-code-project"] = write(project / ".mcp.json", json.dumps({"mcpServers": {
        "team-docs": {"type": "http", "url": "https://docs.example.invalid/mcp",
                      "headers": {"Authorization": TEAM_SECRET}}}}, indent=2))
    files["cursor"] = write(home / ".cursor" / "mcp.json", """{
  // Cursor's file, with a comment and a trailing comma
  "mcpServers": {
    "time": {"command": "%s", "args": ["-m", "mcp_server_time"]},
    "cursor-remote": {"url": "https://cursor.example.invalid/mcp",
                      "headers": {"Authorization": "Bearer ${env:CURSOR_TOKEN}"}},
  }
}
""" % PY.replace("\\", "\\\\"))
    files["cursor-project"] = write(project / ".cursor" / "mcp.json", '{"mcpServers": {"half": {"command": ')
    files["vscode"] = write(config / "Code" / "User" / "mcp.json", json.dumps({
        "inputs": [{"type": "promptString", "id": "vs-token", "description": "token", "password": True}],
        "servers": {"vs-echo": {"type": "stdio", "command": PY, "args": [FAKE[1], "--name", "vs"],
                                "env": {"TOKEN": "${input:vs-token}"}}}}, indent=2))
    files["vscode-project"] = write(project / ".vscode" / "mcp.json", json.dumps({
        "servers": {"proj_tool": {"type": "stdio", "command": "node",
                                  "args": ["${workspaceFolder}/tools/server.js"]}}}, indent=2))
    files["windsurf"] = write(home / ".codeium" / "windsurf" / "mcp_config.json", json.dumps({"mcpServers": {
        "windsurf-remote": {"serverUrl": "https://ws.example.invalid/mcp",
                            "headers": {"Authorization": "Bearer ${env:WS_TOKEN}"}},
        "my_server": echo, "off": {"command": "true", "disabled": True}}}, indent=2))
    files["zed"] = write(config / "zed" / "settings.json", """// Zed settings
{
  "theme": "One Dark", // the user's choice
  "context_servers": {
    "zed-time": {"source": "custom", "command": "%s", "args": ["-m", "mcp_server_time"],},
    "zed-ext": {"source": "extension", "settings": {}},
    "zed-old": {"command": {"path": "uvx", "args": ["mcp-server-fetch"], "env": {}}, "settings": {}},
  },
}
""" % PY.replace("\\", "\\\\"))
    files["codex"] = write(codex_home / "config.toml", f"""model = "o3"  # kept as it is

[mcp_servers.codex_http]
url = "https://codex.example.invalid/mcp"
bearer_token_env_var = "CODEX_TOKEN"
http_headers = {{ "X-Org" = "{CODEX_ORG}" }}
env_http_headers = {{ "X-Key" = "CODEX_KEY" }}

[mcp_servers.codex-echo]
command = {json.dumps(PY)}
args = [{json.dumps(FAKE[1])}, "--name", "codex"]
env_vars = ["LANG"]

[mcp_servers.codex-echo.env]
MODE = "quiet"

[profiles.fast]
model = "o4-mini"
""")
    files["gemini"] = write(home / ".gemini" / "settings.json", json.dumps({"theme": "GitHub", "mcpServers": {
        "gem-http": {"httpUrl": "https://gem.example.invalid/mcp"},
        "gem-sse": {"url": "https://gem.example.invalid/sse"},
        "gem-env": {"command": PY, "args": [FAKE[1], "--name", "gem"], "env": {"K": "$GEM_KEY"}}}}, indent=2))

    def run(*args, check=True, cwd=project):
        proc = subprocess.run(coffer_cmd(*args), capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"coffer {' '.join(args)} exited {proc.returncode}: {proc.stderr}{proc.stdout}")
        return proc

    class World:
        pass

    w = World()
    w.home, w.project, w.env, w.files, w.run = home, project, env, files, run
    w.coffer_home = Path(env["COFFER_HOME"])
    return w


EXPECTED_IMPORT = {"time", "my-server", "local-echo", "team-docs", "cursor-remote", "vs-echo", "proj-tool",
                   "windsurf-remote", "zed-old", "codex-http", "codex-echo", "gem-http", "gem-env"}
SSE_ENTRIES = {"remote-sse", "gem-sse"}


def expected_import():
    return EXPECTED_IMPORT | SSE_ENTRIES


def import_json(world, *extra):
    return json.loads(world.run("import", "--json", *extra).stdout)


def vault_servers(world):
    return {s["name"]: s for s in json.loads(world.run("list", "--json").stdout)["servers"]}


def test_dry_run_plans_every_client_and_changes_nothing(world):
    plan = import_json(world, "--dry-run")
    added = {entry["name"]: entry for entry in plan["added"]}
    assert set(added) == expected_import()
    skipped = {(s["name"], s["source"]): s["reason"] for s in plan["skipped"]}
    assert {added[n]["kind"] for n in SSE_ENTRIES} == {"sse"}
    assert {added[n]["kind"] for n in ("team-docs", "cursor-remote", "windsurf-remote", "codex-http",
                                       "gem-http")} == {"http"}
    assert added["my-server"]["renamed_from"] == "my_server" and added["proj-tool"]["renamed_from"] == "proj_tool"
    assert added["local-echo"]["source"] == "claude-code" and added["zed-old"]["source"] == "zed"
    assert added["vs-echo"]["needs"] == ["VS_TOKEN"]
    # The same server in several clients is imported once, and the plan says which copy was kept.
    assert "same server as 'time' from claude-desktop" in skipped[("time", "claude-code")]
    assert "same server as 'time'" in skipped[("time", "cursor")]
    assert "same server as 'time'" in skipped[("zed-time", "zed")]
    assert "same server as 'my-server'" in skipped[("my-server", "windsurf")]
    assert "Zed extension" in skipped[("zed-ext", "zed")]
    assert skipped[("off", "windsurf")] == "disabled in windsurf"
    assert ("elsewhere", "claude-code") not in skipped  # another project's local servers are not this one's
    errors = {e["path"]: e["reason"] for e in plan["errors"]}
    assert "not valid JSON" in errors[str(world.files["cursor-project"])]
    # only what looks like a credential moves (issue 23): an org id and MODE=quiet stay readable where they are
    assert set(plan["secrets_moved"]) == {"MY_SERVER_API_KEY", "TEAM_DOCS_AUTHORIZATION"}
    assert vault_servers(world) == {}
    assert not (world.coffer_home / "secrets.json").exists()


def test_plain_dry_run_says_what_and_why_without_secrets(world):
    out = world.run("import", "--dry-run").stdout
    assert "renamed from 'my_server'" in out and "MY_SERVER_API_KEY" in out
    assert "not valid JSON" in out and "nothing was changed" in out
    assert DESKTOP_SECRET not in out and "team-literal-token" not in out


def test_import_moves_literals_to_the_secret_store_and_audits(world):
    plan = import_json(world)
    servers = vault_servers(world)
    assert set(servers) == expected_import()
    store_path = world.coffer_home / "secrets.json"
    store = json.loads(store_path.read_text())
    # the same rule as `coffer add`: of an Authorization header only the credential moves ("Bearer ${NAME}")
    assert store["MY_SERVER_API_KEY"] == DESKTOP_SECRET
    assert "Bearer " + store["TEAM_DOCS_AUTHORIZATION"] == TEAM_SECRET
    if os.name != "nt":
        assert stat.S_IMODE(store_path.stat().st_mode) == 0o600
    for path in world.coffer_home.glob("coffer.db*"):
        data = path.read_bytes()
        assert DESKTOP_SECRET.encode() not in data and b"team-literal-token" not in data
    shown = json.loads(world.run("show", "my-server", "--json").stdout)
    assert shown["env"] == {"API_KEY": "${MY_SERVER_API_KEY}"}
    codex_http = json.loads(world.run("show", "codex-http", "--json").stdout)
    assert codex_http["headers"] == {"Authorization": "Bearer ${CODEX_TOKEN}", "X-Org": CODEX_ORG,
                                     "X-Key": "${CODEX_KEY}"}
    assert json.loads(world.run("show", "codex-echo", "--json").stdout)["env"] == {
        "MODE": "quiet", "LANG": "${LANG}"}
    assert json.loads(world.run("show", "cursor-remote", "--json").stdout)["headers"] == {
        "Authorization": "Bearer ${CURSOR_TOKEN}"}
    assert json.loads(world.run("show", "gem-env", "--json").stdout)["env"] == {"K": "${GEM_KEY}"}
    assert json.loads(world.run("show", "proj-tool", "--json").stdout)["command"] == [
        "node", str(world.project / "tools" / "server.js")]
    audit = json.loads(world.run("audit", "--json", "--limit", "100").stdout)["audit"]
    assert {row["target"] for row in audit if row["action"] == "import"} == {a["name"] for a in plan["added"]}
    assert not any(DESKTOP_SECRET in json.dumps(row) for row in audit)

    again = import_json(world)
    assert again["added"] == [] and again["secrets_moved"] == []
    reasons = {(s["name"], s["source"]): s["reason"] for s in again["skipped"]}
    assert reasons[("my-server", "claude-desktop")] == "already in Coffer with the same definition"
    assert reasons[("time", "cursor")] == "already in Coffer with the same definition"


def test_a_changed_definition_is_skipped_unless_overwrite(world):
    world.run("import")
    desktop = json.loads(world.files["claude-desktop"].read_text())
    desktop["mcpServers"]["time"]["args"].append("--local-timezone=UTC")
    world.files["claude-desktop"].write_text(json.dumps(desktop))
    plan = import_json(world, "claude-desktop")
    assert plan["added"] == []
    assert "a different server named 'time' is already in Coffer" in \
        {s["name"]: s["reason"] for s in plan["skipped"]}["time"]
    plan = import_json(world, "claude-desktop", "--overwrite")
    assert [(a["name"], a.get("overwrite")) for a in plan["added"]] == [("time", True)]
    assert vault_servers(world)["time"]["command"].endswith("--local-timezone=UTC")


def test_one_name_two_definitions_and_overwrite_in_the_same_run(world, tmp_path):
    world.run("add", "x", "--", "c")
    first = write(tmp_path / "a" / "mcp.json", json.dumps({"mcpServers": {"x": {"command": "a"}}}))
    second = write(tmp_path / "b" / "mcp.json", json.dumps({"mcpServers": {"x": {"command": "b"}}}))
    plan = import_json(world, str(first), str(second), "--overwrite")
    assert [(a["name"], a.get("overwrite", False)) for a in plan["added"]] == [("x", True), ("x-2", False)]
    servers = vault_servers(world)
    assert servers["x"]["command"] == "a" and servers["x-2"]["command"] == "b"


def test_sources_by_client_name_and_by_path_detected_by_shape(world, tmp_path):
    plan = import_json(world, "codex", "--dry-run")
    assert {a["name"] for a in plan["added"]} == {"codex-http", "codex-echo"}
    copy = write(tmp_path / "elsewhere" / "some-export.json", world.files["vscode"].read_text())
    plan = import_json(world, str(copy), "--dry-run")
    assert [(a["name"], a["source"]) for a in plan["added"]] == [("vs-echo", "vscode")]
    toml_copy = write(tmp_path / "elsewhere" / "codex.toml", world.files["codex"].read_text())
    assert {a["name"] for a in import_json(world, str(toml_copy), "--dry-run")["added"]} == {"codex-http",
                                                                                             "codex-echo"}
    bad = world.run("import", "no-such-client", check=False)
    assert bad.returncode == 1 and "unknown source" in bad.stderr and "Traceback" not in bad.stderr


def test_hostile_files_get_a_reason_each_and_never_a_traceback(world, tmp_path):
    hostile = {
        "binary.json": b'{"mcpServers": {"x": {"command": "\xff\xfe"}}}',
        "deep.json": b"[" * 200_000 + b"]" * 200_000,
        "deep-object.json": b'{"mcpServers": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
        "wrong-types.json": json.dumps({"mcpServers": {
            "a": {"command": 42}, "b": {"command": "x", "args": "not-a-list"}, "c": {"command": "x", "env": [1]},
            "d": {"url": "ftp://files.example/"}, "e": "just a string", "f": {}}}).encode(),
        "servers-array.json": json.dumps({"mcpServers": ["a", "b"]}).encode(),
        "bad.toml": b"[mcp_servers.x]\ncommand = \n",
        "nul.json": b"\x00" * 1000,
    }
    paths = []
    for name, data in hostile.items():
        path = tmp_path / "hostile" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        paths.append(str(path))
    proc = world.run("import", "--json", "--dry-run", *paths, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    plan = json.loads(proc.stdout)
    errors = {Path(e["path"]).name: e["reason"] for e in plan["errors"]}
    assert "UTF-8" in errors["binary.json"]
    assert "nested" in errors["deep.json"] and "nested" in errors["deep-object.json"]
    assert "not an object" in errors["servers-array.json"]
    assert "TOML" in errors["bad.toml"] and "nul.json" in errors
    reasons = {s["name"]: s["reason"] for s in plan["skipped"]}
    assert "command" in reasons["a"] and "args" in reasons["b"] and "env" in reasons["c"]
    assert "http(s)" in reasons["d"] and "not an object" in reasons["e"] and "neither" in reasons["f"]
    assert plan["added"] == []


def entry_of(path: Path, *keys):
    value = json.loads(path.read_text())
    for key in keys:
        value = value[key]
    return value


def backups(world, path: Path):
    """Backups of a client config: kept privately under COFFER_HOME, never beside the file (issue 23)."""
    assert not list(path.parent.glob(path.name + ".coffer-backup-*")), "a backup was left beside the file"
    digest = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]
    return sorted((world.coffer_home / "backups").glob(f"{path.name}-{digest}.coffer-backup-*"))


def test_install_claude_code_replace_then_uninstall_restores(world):
    world.run("import")
    claude = world.files["claude-code"]
    original = json.loads(claude.read_text())
    out = world.run("install", "claude-code", "--replace").stdout
    assert "removed (now served through Coffer): remote-sse, time" in out
    after = json.loads(claude.read_text())
    entry = after["mcpServers"]["coffer"]
    assert entry["type"] == "stdio" and os.path.isabs(entry["command"]) and entry["args"][-1] == "serve"
    assert entry["env"] == {"COFFER_HOME": str(world.coffer_home)}
    assert set(after["mcpServers"]) == {"coffer"}
    # the local scope of this project runs beside the user scope: --replace covers it too (issue 23)
    assert "local-echo (local scope of" in out
    assert after["projects"][str(world.project)]["mcpServers"] == {}
    assert after["numStartups"] == 42
    assert after["projects"]["/somewhere/else"] == original["projects"]["/somewhere/else"]
    assert len(backups(world, claude)) == 1 and json.loads(backups(world, claude)[0].read_text()) == original
    stash = [line for line in out.splitlines() if "kept (private, 0600) in" in line][0].split(" in ")[1].split(";")[0]
    assert Path(stash).is_relative_to(world.coffer_home)
    if os.name != "nt":
        assert stat.S_IMODE(Path(stash).stat().st_mode) == 0o600

    own = {(x["name"], x["source"]): x["reason"] for x in import_json(world, "claude-code")["skipped"]}
    assert own[("coffer", "claude-code")] == "Coffer's own entry"
    second = world.run("install", "claude-code", "--replace").stdout
    assert "nothing changed" in second and len(backups(world, claude)) == 1
    assert json.loads(claude.read_text()) == after

    world.run("uninstall", "claude-code")
    restored = json.loads(claude.read_text())
    assert restored["mcpServers"] == original["mcpServers"] and restored["projects"] == original["projects"]
    assert not Path(stash).exists()
    assert "nothing changed" in world.run("uninstall", "claude-code").stdout


def test_install_keeps_comments_and_formats_of_every_client(world):
    world.run("import")
    for client in ("claude-desktop", "cursor", "vscode", "windsurf", "zed", "gemini", "codex"):
        first = world.run("install", client).stdout
        assert "installed Coffer into" in first and "backup:" in first, (client, first)
        assert "nothing changed" in world.run("install", client).stdout, client
    zed_text = world.files["zed"].read_text()
    assert "// the user's choice" in zed_text and "// Zed settings" in zed_text
    assert "zed-ext" in zed_text and '"source": "custom"' in zed_text
    assert "// Cursor's file" in world.files["cursor"].read_text()
    assert entry_of(world.files["vscode"], "servers", "coffer")["type"] == "stdio"
    assert entry_of(world.files["vscode"], "inputs")[0]["id"] == "vs-token"
    assert entry_of(world.files["claude-desktop"], "globalShortcut") == "Ctrl+Space"
    assert entry_of(world.files["gemini"], "mcpServers", "coffer")["args"][-1] == "serve"
    assert "coffer" in entry_of(world.files["windsurf"], "mcpServers")
    codex_text = world.files["codex"].read_text()
    assert codex_text.startswith('model = "o3"  # kept as it is') and "[profiles.fast]" in codex_text
    codex = load_toml(codex_text)  # tomllib, or on Python 3.10 Coffer's own reader (checked against tomllib)
    assert codex["mcp_servers"]["coffer"]["args"][-1] == "serve" and "codex-echo" in codex["mcp_servers"]
    assert codex["profiles"]["fast"]["model"] == "o4-mini"

    world.run("install", "codex", "--replace")
    codex = load_toml(world.files["codex"].read_text())
    assert set(codex["mcp_servers"]) == {"coffer"} and codex["model"] == "o3"
    world.run("uninstall", "codex")
    codex = load_toml(world.files["codex"].read_text())
    assert set(codex["mcp_servers"]) == {"codex_http", "codex-echo"}
    assert codex["mcp_servers"]["codex_http"]["http_headers"] == {"X-Org": CODEX_ORG}
    world.run("uninstall", "zed")
    assert "coffer" not in world.files["zed"].read_text() and "// the user's choice" in world.files["zed"].read_text()


def test_project_install_and_a_file_that_does_not_parse_is_never_rewritten(world):
    world.run("install", "vscode", "--project")
    assert entry_of(world.files["vscode-project"], "servers", "coffer")["command"]
    assert "proj_tool" in entry_of(world.files["vscode-project"], "servers")
    broken = world.files["cursor-project"].read_bytes()
    proc = world.run("install", "cursor", "--project", check=False)
    assert proc.returncode == 1 and "not rewritten" in proc.stderr and "Traceback" not in proc.stderr
    assert world.files["cursor-project"].read_bytes() == broken and not backups(world, world.files["cursor-project"])
    fresh = world.run("install", "claude-code", "--project", "--dry-run").stdout
    assert "dry run" in fresh and "coffer" not in json.dumps(entry_of(world.files["claude-code-project"],
                                                                       "mcpServers"))
    proc = world.run("install", "windsurf", "--project", check=False)
    assert proc.returncode == 1 and "no project config" in proc.stderr


def test_doctor_reports_servers_clients_and_exits_1_when_one_is_broken(world):
    world.run("import")
    world.run("config", "init_timeout", "10")
    world.run("config", "name_max_length", "64")  # past what Claude Code allows once mcp__coffer__ is in front
    world.run("install", "claude-code")
    for name in {"team-docs", "cursor-remote", "windsurf-remote", "zed-old", "codex-http", "gem-http", "vs-echo",
                 "codex-echo"} | SSE_ENTRIES:
        world.run("remove", name)
    proc = world.run("doctor", "--json", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    servers = {s["name"]: s for s in report["servers"]}
    assert servers["time"]["ok"] and servers["time"]["problems"] == []
    assert servers["my-server"]["ok"]  # its secret resolves from the store
    gem = servers["gem-env"]
    assert not gem["ok"] and any("${GEM_KEY}" in p["problem"] and "GEM_KEY" in p["fix"] for p in gem["problems"])
    tool = servers["proj-tool"]
    assert not tool["ok"] and tool["problems"][0]["problem"]
    long_names = [p for p in servers["local-echo"]["problems"] if "claude-code" in p["problem"]]
    assert servers["local-echo"]["ok"] and long_names and "name_max_length 51" in long_names[0]["fix"]
    clients = {(c["client"], c["path"], c["scope"]): c for c in report["clients"]}
    claude = clients[("claude-code", str(world.files["claude-code"]), "user")]
    assert claude["installed"] and "time" in claude["duplicates"]
    assert any("--replace" in p["fix"] for p in claude["problems"])
    assert clients[("cursor", str(world.files["cursor"]), "user")]["installed"] is False
    local = clients[("claude-code", str(world.files["claude-code"]), "local")]
    assert local["duplicates"] == ["local-echo"] and not local["installed"]
    assert any("not valid JSON" in p["problem"] for c in report["clients"] for p in c["problems"])
    text = world.run("doctor", check=False)
    assert text.returncode == 1 and "fix: " in text.stdout and "Traceback" not in text.stderr


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes and PATH")
def test_doctor_flags_a_command_a_desktop_app_cannot_find_and_an_open_vault(world, tmp_path):
    bin_dir = tmp_path / "user-bin"
    launcher = write(bin_dir / "my-mcp", f"#!/bin/sh\nexec {PY} {FAKE[1]} \"$@\"\n")
    launcher.chmod(0o755)
    world.env["PATH"] = f"{bin_dir}{os.pathsep}{world.env['PATH']}"
    world.run("add", "shell-only", "--", "my-mcp", "--name", "shell-only")
    world.run("install", "claude-code")
    report = json.loads(world.run("doctor", "--json", check=False).stdout)
    problem = {s["name"]: s for s in report["servers"]}["shell-only"]["problems"][0]
    assert problem["severity"] == "warning" and "minimal PATH" in problem["problem"]
    assert str(launcher) in problem["fix"]
    world.run("install", "claude-desktop")  # a GUI client now starts Coffer with that PATH: the server is broken
    proc = world.run("doctor", "--json", check=False)
    report = json.loads(proc.stdout)
    shell_only = {s["name"]: s for s in report["servers"]}["shell-only"]
    assert proc.returncode == 1 and not shell_only["ok"] and "claude-desktop" in shell_only["problems"][0]["problem"]

    for path in [world.coffer_home, *world.coffer_home.glob("coffer.db*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert json.loads(world.run("doctor", "--json", check=False).stdout)["vault"]["problems"] == []
    world.coffer_home.chmod(0o755)
    vault = json.loads(world.run("doctor", "--json", check=False).stdout)["vault"]
    if stat.S_IMODE(world.coffer_home.stat().st_mode) == 0o755:  # (a Coffer that repairs it on open is fine too)
        assert not vault["ok"] and vault["problems"][0]["fix"] == f"chmod 700 {world.coffer_home}"
    else:
        assert stat.S_IMODE(world.coffer_home.stat().st_mode) == 0o700 and vault["ok"]


def test_show_prints_definition_status_and_capabilities(world):
    world.run("import", "claude-desktop")
    world.run("call", "my-server__echo", '{"text": "hi"}')
    out = world.run("show", "my-server").stdout
    assert "API_KEY=${MY_SERVER_API_KEY}" in out and DESKTOP_SECRET not in out
    assert "status: ready" in out or "status:" in out
    assert "tool" in out and "echo" in out and "enabled" in out
    world.run("disable", "my-server__echo")
    shown = json.loads(world.run("show", "my-server", "--json").stdout)
    assert {c["name"]: c["state"] for c in shown["capabilities"] if c["kind"] == "tool"}["echo"] == "disabled"
    missing = world.run("show", "nope", check=False)
    assert missing.returncode == 1 and "unknown server" in missing.stderr


def test_the_installed_entry_serves_an_imported_server_to_the_sdk_client(world):
    anyio = pytest.importorskip("anyio")
    mcp = pytest.importorskip("mcp")
    from mcp.client.stdio import StdioServerParameters

    world.run("import", "claude-desktop")
    world.run("install", "claude-code", "--replace")
    entry = entry_of(world.files["claude-code"], "mcpServers", "coffer")
    env = {**world.env, **entry.get("env", {}), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}  # a GUI app's PATH
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=env,
                                   cwd=str(world.project))

    async def session():
        async with mcp.Client(params) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            now = await client.call_tool("time__get_current_time", {"timezone": "UTC"})
            echoed = await client.call_tool("my-server__echo", {"text": "moved in"})
            return tools, now, echoed

    tools, now, echoed = anyio.run(session)
    assert {"time__get_current_time", "my-server__echo", "coffer__search_tools"} <= set(tools)
    assert now.structured_content["timezone"] == "UTC" and not now.is_error
    assert "moved in" in "".join(getattr(block, "text", "") for block in echoed.content)


# -- the parsers on their own (the TOML reader is what Python 3.10 uses) ------------------------------------

TOML_SAMPLES = [  # (text, what it holds: the same as tomllib reads, checked below where tomllib exists)
    ('a = "x"\n[mcp_servers.one]\ncommand = "npx"\nargs = ["-y", \'lit\\eral\', "esc\\"aped\\u00e9"]\n',
     {"a": "x", "mcp_servers": {"one": {"command": "npx", "args": ["-y", "lit\\eral", 'esc"aped\u00e9']}}}),
    ('[mcp_servers."name with space".env]\nK = "v" # comment\n\n[mcp_servers.two]\nurl = "https://x/y"\n'
     'http_headers = { "X-A" = "1", B = \'2\' }\nenabled = false\nstartup_timeout_sec = 20\nretries = 0x1F\n',
     {"mcp_servers": {"name with space": {"env": {"K": "v"}},
                      "two": {"url": "https://x/y", "http_headers": {"X-A": "1", "B": "2"}, "enabled": False,
                              "startup_timeout_sec": 20, "retries": 31}}}),
    ('multi = """\nline one\nline "two" \\\n   joined"""\nlit = \'\'\'raw \\n kept\'\'\'\n'
     'arr = [\n  1,\n  2.5, # note\n  -3e2,\n]\nflag = true\n',
     {"multi": 'line one\nline "two" joined', "lit": "raw \\n kept", "arr": [1, 2.5, -300.0], "flag": True}),
    ('[[profiles]]\nname = "a"\n[[profiles]]\nname = "b"\n[a.b.c]\nd.e = "f"\n',
     {"profiles": [{"name": "a"}, {"name": "b"}], "a": {"b": {"c": {"d": {"e": "f"}}}}}),
]
TOML_REFUSED = ['a = \n', '[t]\n[t]\n', 'a = "unterminated\n', 'a = 1\na = 2\n', 'a = [1, 2\n', 'a = "\\q"\n',
                "[" * 100 + "\n", "a = " + "[" * 200 + "]" * 200 + "\n"]


def test_toml_subset_reads_what_tomllib_reads():
    for text, expected in TOML_SAMPLES:
        assert TomlSubset().loads(text) == expected, text
    assert TomlSubset().loads("when = 1979-05-27T07:32:00Z\n") == {"when": "1979-05-27T07:32:00Z"}


def test_the_expected_toml_values_are_what_tomllib_reads():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+: the samples above mean what TOML says they mean
    for text, expected in TOML_SAMPLES:
        assert tomllib.loads(text) == expected, text


def test_toml_subset_refuses_what_it_cannot_read_with_a_reason():
    for bad in TOML_REFUSED:
        with pytest.raises(ConfigProblem):
            TomlSubset().loads(bad)


def test_without_tomllib_config_files_are_read_by_the_subset(monkeypatch):
    """The path every Codex config.toml takes on Python 3.10 (there by nature, elsewhere by hiding tomllib)."""
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` now raises ImportError
    for text, expected in TOML_SAMPLES:
        assert load_toml(text) == expected, text
    for bad in TOML_REFUSED:
        with pytest.raises(ConfigProblem):
            load_toml(bad)


def test_jsonc_edits_touch_only_what_they_change():
    text = '// top\n{\n  "keep": [1, 2], /* inline */\n  "servers": {\n    "a": {"command": "x"}, // a\n  },\n}\n'
    document = JsonDocument(text, jsonc=True)
    added = JsonDocument(document.with_member(("servers",), "coffer", {"command": "/c"}), jsonc=True)
    assert added.value == {"keep": [1, 2], "servers": {"a": {"command": "x"}, "coffer": {"command": "/c"}}}
    assert "// top" in added.text and "/* inline */" in added.text and "// a" in added.text
    removed = JsonDocument(added.without_member(("servers",), "a"), jsonc=True)
    assert removed.value["servers"] == {"coffer": {"command": "/c"}} and "/* inline */" in removed.text
    created = JsonDocument(JsonDocument('{"x": 1}', jsonc=False).with_member(
        ("projects", "/p", "mcpServers"), "coffer", {"command": "/c"}), jsonc=False)
    assert created.value == {"x": 1, "projects": {"/p": {"mcpServers": {"coffer": {"command": "/c"}}}}}
    json.loads(created.text)  # still strict JSON
    with pytest.raises(ConfigProblem):
        JsonDocument('{"servers": "text"}', jsonc=False).with_member(("servers",), "coffer", {})


def test_each_client_is_looked_up_where_it_lives_on_each_os():
    home, cwd = os.path.join(os.sep, "u"), os.path.join(os.sep, "p")
    windows = ClientContext(home, cwd, {"APPDATA": os.path.join(home, "Roaming")}, "win32")
    mac = ClientContext(home, cwd, {"XDG_CONFIG_HOME": "/ignored"}, "darwin")
    linux = ClientContext(home, cwd, {"XDG_CONFIG_HOME": os.path.join(home, "xdg"),
                                      "CODEX_HOME": os.path.join(home, "cx")}, "linux")

    def user_path(client, ctx):
        return client_files(client, ctx, project=False)[0].path

    support = os.path.join(home, "Library", "Application Support")
    assert user_path("claude-desktop", windows) == os.path.join(home, "Roaming", "Claude",
                                                                "claude_desktop_config.json")
    assert user_path("claude-desktop", mac) == os.path.join(support, "Claude", "claude_desktop_config.json")
    assert user_path("claude-desktop", linux) == os.path.join(home, "xdg", "Claude", "claude_desktop_config.json")
    assert user_path("vscode", windows) == os.path.join(home, "Roaming", "Code", "User", "mcp.json")
    assert user_path("vscode", mac) == os.path.join(support, "Code", "User", "mcp.json")
    assert user_path("vscode", linux) == os.path.join(home, "xdg", "Code", "User", "mcp.json")
    assert user_path("zed", windows) == os.path.join(home, "Roaming", "Zed", "settings.json")
    assert user_path("zed", mac) == os.path.join(home, ".config", "zed", "settings.json")
    assert user_path("codex", linux) == os.path.join(home, "cx", "config.toml")
    assert user_path("codex", mac) == os.path.join(home, ".codex", "config.toml")
    assert user_path("windsurf", windows) == os.path.join(home, ".codeium", "windsurf", "mcp_config.json")
    claude = client_files("claude-code", linux)
    assert [(f.scope, f.container) for f in claude] == [("user", ("mcpServers",)),
                                                        ("local", ("projects", cwd, "mcpServers")),
                                                        ("project", ("mcpServers",))]


def test_a_huge_config_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_CONFIG_BYTES", 1024)
    big = tmp_path / "mcp.json"
    big.write_text(json.dumps({"mcpServers": {}, "pad": "x" * 4096}))
    with pytest.raises(ConfigProblem, match="too large"):
        read_config_text(str(big))
    with pytest.raises(ConfigProblem, match="not a regular file"):
        read_config_text(str(tmp_path))
    assert read_config_text(str(tmp_path / "absent.json")) is None
