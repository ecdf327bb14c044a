"""Moving in: import from the MCP clients a user has, and install Coffer into them.

Every client config is someone else's file: it is read with size and depth bounds and never trusted, and it is
only rewritten by a minimal text splice (comments, order and formatting survive), after a timestamped backup, and
only when re-reading the result gives exactly the intended structure.  Everything here runs on the CLI's thread."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import urllib.parse
from datetime import datetime
from typing import NamedTuple

from coffer_src.clients.files import (
    ClientContext,
    ConfigProblem,
    JsonDocument,
    TomlDocument,
    _json_type,
    _lookup,
    append_toml,
    load_toml,
    read_config_text,
    render_toml_server,
)
from coffer_src.digests import sha256
from coffer_src.errors import CofferError
from coffer_src.names import ENV_KEY_RE, ENV_NAME_PATTERN, RESERVED_SERVER, SERVER_NAME_MAX, SERVER_NAME_RULE
from coffer_src.secret_store import (
    ENV_REF_RE,
    plan_argument_literals,
    plan_literals,
    plan_url_literals,
    write_private_file,
)
from coffer_src.vault import utcnow

CLIENTS = ("claude-desktop", "claude-code", "cursor", "vscode", "windsurf", "zed", "codex", "gemini")


MAX_CONFIG_SERVERS = 1000     # per file; more is not a config a person wrote
GUI_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"   # what launchd / a desktop session gives an app started from the dock
COFFER_ENTRY = RESERVED_SERVER               # the name Coffer's own entry has in every client
#: client -> (max tool-name length, what the client puts in front of Coffer's exposed names)
CLIENT_TOOL_NAME_LIMITS = {"claude-code": (64, "mcp__coffer__"), "codex": (64, "mcp__coffer__"),
                           "cursor": (60, "coffer"), "gemini": (63, "mcp_coffer_")}
#: clients that are usually started from a desktop launcher, with a minimal PATH
GUI_CLIENTS = ("claude-desktop", "cursor", "vscode", "windsurf", "zed")


# -- records -------------------------------------------------------------------------------------------------

class ClientFile(NamedTuple):
    """Where one client keeps MCP servers: a file, the key path of the servers map inside it, its format."""
    client: str
    path: str
    scope: str                 # "user", "project" or "local" (Claude Code's per-project entry in ~/.claude.json)
    container: tuple           # key path of the servers map, e.g. ("mcpServers",) or ("projects", "/p", "mcpServers")
    fmt: str                   # "json", "jsonc" (comments and trailing commas allowed) or "toml"
    project_root: str | None = None


class ImportedServer:
    """One server entry from a client config, normalised to Coffer's shapes and ${NAME} references.

    Literal env/header values are still in ``env``/``headers``; the plan moves them to the SecretStore.
    Built and read by the CLI thread only, like every record in this section.
    """

    def __init__(self, name: str, client: str, path: str, kind: str, command: list | None = None,
                 env: dict | None = None, cwd: str | None = None, url: str | None = None,
                 headers: dict | None = None, notes: list | None = None, needs: list | None = None):
        self.name = name                   # as the client calls it
        self.client = client
        self.path = path
        self.kind = kind                   # "stdio", "http" or "sse"
        self.command = command
        self.env = {} if env is None else env
        self.cwd = cwd
        self.url = url
        self.headers = {} if headers is None else headers
        self.notes = [] if notes is None else notes
        self.needs = [] if needs is None else needs  # ${NAME}s the user must still provide

    def identity(self) -> tuple:
        """Same command+args+env, or same url: the same server, whichever client lists it."""
        if self.kind == "stdio":
            return ("stdio", tuple(self.command), tuple(sorted(self.env.items())))
        return ("remote", self.url)


class PlannedServer:
    """A server the import will write: its legal Coffer name and its env/headers with secrets as ${NAME}."""

    def __init__(self, server: ImportedServer, name: str, renamed_because: str | None = None,
                 overwrite: bool = False, env: dict | None = None, headers: dict | None = None,
                 command: list | None = None, secrets: dict | None = None):
        self.server = server
        self.name = name                                     # the legal Coffer name
        self.renamed_because = renamed_because
        self.overwrite = overwrite
        self.env = {} if env is None else env                # with secrets replaced by ${NAME}
        self.headers = {} if headers is None else headers
        self.command = command                               # argv with secret-looking arguments as ${NAME}
        self.secrets = {} if secrets is None else secrets    # NAME -> value (never printed)


class SkippedServer(NamedTuple):
    """A client entry the import leaves out, and why (said to the user as is)."""
    name: str
    client: str
    path: str
    reason: str


class FileProblem(NamedTuple):
    """A whole config file that could not be read, and why; the file itself is left untouched."""
    client: str
    path: str
    reason: str


class ImportPlan:
    """What ``coffer import`` will do (or, with --dry-run, would do); apply_import carries it out."""

    def __init__(self, added: list | None = None, skipped: list | None = None, problems: list | None = None,
                 files_read: list | None = None):
        self.added = [] if added is None else added                  # PlannedServer
        self.skipped = [] if skipped is None else skipped            # SkippedServer
        self.problems = [] if problems is None else problems         # FileProblem
        self.files_read = [] if files_read is None else files_read   # ClientFile

    @property
    def secrets_moved(self) -> list:
        return sorted({name for planned in self.added for name in planned.secrets})

    def as_json(self) -> dict:
        return {
            "added": [{"name": p.name, "source": p.server.client, "path": p.server.path, "kind": p.server.kind,
                       **({"renamed_from": p.server.name} if p.renamed_because else {}),
                       **({"overwrite": True} if p.overwrite else {}),
                       **({"needs": p.server.needs} if p.server.needs else {})} for p in self.added],
            "skipped": [{"name": s.name, "source": s.client, "path": s.path, "reason": s.reason}
                        for s in self.skipped],
            "secrets_moved": self.secrets_moved,
            "errors": [{"source": p.client, "path": p.path, "reason": p.reason} for p in self.problems],
        }


def client_files(client: str, ctx: ClientContext, project: bool | None = None) -> list[ClientFile]:
    """The files ``client`` reads servers from: user scope first, then the current project's.

    ``project`` None gives both, True only the project's, False only the user's.
    """
    home, cwd = ctx.home, ctx.cwd
    user: list[ClientFile] = []
    proj: list[ClientFile] = []
    servers = ("mcpServers",)
    if client == "claude-desktop":
        user.append(ClientFile(client, os.path.join(ctx.app_config_dir(), "Claude", "claude_desktop_config.json"),
                               "user", servers, "json"))
    elif client == "claude-code":
        user.append(ClientFile(client, os.path.join(home, ".claude.json"), "user", servers, "json"))
        for key in dict.fromkeys((cwd, os.path.realpath(cwd))):
            proj.append(ClientFile(client, os.path.join(home, ".claude.json"), "local",
                                   ("projects", key, "mcpServers"), "json", cwd))
        proj.append(ClientFile(client, os.path.join(cwd, ".mcp.json"), "project", servers, "json", cwd))
    elif client == "cursor":
        user.append(ClientFile(client, os.path.join(home, ".cursor", "mcp.json"), "user", servers, "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".cursor", "mcp.json"), "project", servers, "jsonc", cwd))
    elif client == "vscode":
        base = ctx.app_config_dir() if ctx.platform in ("win32", "darwin") else \
            (ctx.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"))
        user.append(ClientFile(client, os.path.join(base, "Code", "User", "mcp.json"), "user", ("servers",), "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".vscode", "mcp.json"), "project", ("servers",), "jsonc",
                               cwd))
    elif client == "windsurf":
        user.append(ClientFile(client, os.path.join(home, ".codeium", "windsurf", "mcp_config.json"), "user",
                               servers, "jsonc"))
    elif client == "zed":
        if ctx.platform == "win32":
            base = os.path.join(ctx.app_config_dir(), "Zed")
        elif ctx.platform == "darwin":
            base = os.path.join(home, ".config", "zed")
        else:
            base = os.path.join(ctx.environ.get("FLATPAK_XDG_CONFIG_HOME") or ctx.app_config_dir(), "zed")
        user.append(ClientFile(client, os.path.join(base, "settings.json"), "user", ("context_servers",), "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".zed", "settings.json"), "project", ("context_servers",),
                               "jsonc", cwd))
    elif client == "codex":
        codex_home = ctx.environ.get("CODEX_HOME") or os.path.join(home, ".codex")
        user.append(ClientFile(client, os.path.join(codex_home, "config.toml"), "user", ("mcp_servers",), "toml"))
        proj.append(ClientFile(client, os.path.join(cwd, ".codex", "config.toml"), "project", ("mcp_servers",),
                               "toml", cwd))
    elif client == "gemini":
        user.append(ClientFile(client, os.path.join(home, ".gemini", "settings.json"), "user", servers, "jsonc"))
        proj.append(ClientFile(client, os.path.join(cwd, ".gemini", "settings.json"), "project", servers, "jsonc",
                               cwd))
    else:
        raise CofferError(f"unknown client {client!r}; known: {', '.join(CLIENTS)}")
    if os.path.realpath(cwd) == os.path.realpath(home):  # the home directory is no project
        proj = [f for f in proj if f.scope == "local"]
    return user if project is False else proj if project else user + proj


def detect_file(path: str, ctx: ClientContext) -> list[ClientFile]:
    """A SOURCE given as a path: which client's format it is, told by its name and its shape."""
    path = os.path.abspath(os.path.expanduser(path))
    text = read_config_text(path)
    if text is None:
        raise ConfigProblem("no such file")
    base = os.path.basename(path).lower()
    parent = os.path.basename(os.path.dirname(path)).lower()
    if base.endswith(".toml"):
        return [ClientFile("codex", path, "user", ("mcp_servers",), "toml")]
    value = JsonDocument(text, jsonc=True).value
    root = os.path.dirname(os.path.dirname(path))
    if isinstance(value.get("context_servers"), dict):
        return [ClientFile("zed", path, "user", ("context_servers",), "jsonc")]
    if isinstance(value.get("servers"), dict):
        return [ClientFile("vscode", path, "user", ("servers",), "jsonc", root)]
    if isinstance(value.get("mcp"), dict) and isinstance(value["mcp"].get("servers"), dict):
        return [ClientFile("vscode", path, "user", ("mcp", "servers"), "jsonc", root)]  # VS Code settings.json
    if base == ".claude.json" or isinstance(value.get("projects"), dict):
        found = [ClientFile("claude-code", path, "user", ("mcpServers",), "json")]
        for key in dict.fromkeys((ctx.cwd, os.path.realpath(ctx.cwd))):
            found.append(ClientFile("claude-code", path, "local", ("projects", key, "mcpServers"), "json", ctx.cwd))
        return found
    if "mcpServers" in value:
        client = ("claude-desktop" if base == "claude_desktop_config.json" else
                  "windsurf" if base == "mcp_config.json" else
                  "gemini" if parent == ".gemini" else
                  "cursor" if parent == ".cursor" else
                  "claude-code" if base == ".mcp.json" else "mcp-json")
        return [ClientFile(client, path, "user", ("mcpServers",), "jsonc", os.path.dirname(path))]
    raise ConfigProblem("no MCP servers map in it (looked for mcpServers, servers, context_servers, mcp_servers)")


def load_client_file(file: ClientFile, text: str | None = None):
    """(parsed document, servers map) of one file; ConfigProblem when it is unreadable or the map is no map."""
    text = read_config_text(file.path) if text is None else text
    if text is None:
        return None, {}
    document = TomlDocument(text) if file.fmt == "toml" else JsonDocument(text, jsonc=file.fmt == "jsonc")
    found, servers = _lookup(document.value, file.container)
    if not found or servers is None:
        return document, {}
    if not isinstance(servers, dict):
        raise ConfigProblem(f"{'.'.join(file.container)} is {_json_type(servers)}, not an object")
    if len(servers) > MAX_CONFIG_SERVERS:
        raise ConfigProblem(f"{len(servers)} servers in one file (limit {MAX_CONFIG_SERVERS})")
    return document, servers


# -- one client entry -> ImportedServer -----------------------------------------------------------------------

# Clients' reference syntaxes: ${env:X} and ${input:X} (VS Code), editor built-ins, Coffer's own ${NAME[:-default]},
# any other ${...}, and Gemini CLI's bare $NAME.
_CLIENT_REF_RE = re.compile(r"\$\{(env|input):([^}]*)\}|\$\{(userHome|workspaceFolder|workspaceFolderBasename|"
                            rf"pathSeparator|/)\}}|\$\{{({ENV_NAME_PATTERN})(:-[^}}]*)?\}}|\$\{{([^}}]*)\}}|"
                            rf"\$({ENV_NAME_PATTERN})")
_REMOTE_TYPES = {"http": "http", "streamable-http": "http", "streamable_http": "http", "streamablehttp": "http",
                 "sse": "sse"}


def reference_name(text: str) -> str:
    """A legal ${NAME} for a client's input id or header name: GitHub token-1 -> GITHUB_TOKEN_1."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").upper() or "VALUE"
    return name if not name[0].isdigit() else "_" + name


def _rewrite_references(value: str, client: str, file: ClientFile, ctx: ClientContext, server: ImportedServer):
    """A client's reference syntaxes in one string, written as Coffer's ${NAME}."""

    def replace(match):
        scheme, argument, builtin, name, default, other, bare = match.groups()
        if scheme == "env":
            return "${" + reference_name(argument) + "}" if not ENV_KEY_RE.match(argument) else "${" + argument + "}"
        if scheme == "input":
            target = reference_name(argument)
            if target not in server.needs:
                server.needs.append(target)
                server.notes.append(f"VS Code input '{argument}' is now ${{{target}}}: set it in Coffer's "
                                    "secret store or the environment")
            return "${" + target + "}"
        if builtin == "userHome":
            return ctx.home
        if builtin in ("workspaceFolder", "workspaceFolderBasename"):
            root = file.project_root or ctx.cwd
            if file.project_root is None:
                server.notes.append(f"${{{builtin}}} resolved to the current directory {root}")
            return root if builtin == "workspaceFolder" else os.path.basename(root)
        if builtin:
            return os.sep
        if name:
            return match.group(0)  # already Coffer's syntax (Claude Code's, too)
        if other is not None:
            server.notes.append(f"${{{other}}} is not a reference Coffer can resolve; kept as text")
            return match.group(0)
        if bare and client == "gemini":  # only Gemini CLI expands $NAME; elsewhere it is literal text
            return "${" + bare + "}"
        return match.group(0)

    return _CLIENT_REF_RE.sub(replace, value)


def _string_map(raw, what: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigProblem(f"{what} is {_json_type(raw)}, not an object")
    result = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigProblem(f"{what}.{key} is {_json_type(value)}, not a string")
        result[str(key)] = value if isinstance(value, str) else str(value)
    return result


def entry_to_server(client: str, name: str, raw, file: ClientFile, ctx: ClientContext) -> ImportedServer:
    """One entry of a client's servers map; ConfigProblem (the skip reason) when it is not a usable server."""
    if not isinstance(raw, dict):
        raise ConfigProblem(f"the entry is {_json_type(raw)}, not an object")
    if raw.get("disabled") is True or raw.get("enabled") is False:
        raise ConfigProblem(f"disabled in {client}")
    server = ImportedServer(name=name, client=client, path=file.path, kind="stdio")
    command = raw.get("command")
    if client == "zed":
        if raw.get("source") == "extension" or (command is None and raw.get("url") is None):
            raise ConfigProblem("managed by a Zed extension; register its command with coffer add")
        if isinstance(command, dict):  # Zed's older shape: "command": {"path", "args", "env"}
            raw = {**raw, **{k: command.get(k) for k in ("args", "env")}}
            command = command.get("path")
    url = next((raw[key] for key in ("url", "serverUrl", "httpUrl") if raw.get(key) is not None), None)
    rewrite = lambda text: _rewrite_references(text, client, file, ctx, server)  # noqa: E731
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise ConfigProblem("command is not a non-empty string")
        args = raw.get("args", [])
        if args is None:
            args = []
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                                 for a in args):
            raise ConfigProblem("args is not a list of strings")
        server.command = [rewrite(command)] + [rewrite(str(a)) for a in args]
        server.env = {k: rewrite(v) for k, v in _string_map(raw.get("env"), "env").items()}
        forwarded = raw.get("env_vars") or []     # Codex: forward these from the environment as they are
        if not isinstance(forwarded, list) or not all(isinstance(v, str) and ENV_KEY_RE.match(v) for v in forwarded):
            raise ConfigProblem("env_vars is not a list of variable names")
        for variable in forwarded:
            server.env.setdefault(variable, "${" + variable + "}")
        cwd = raw.get("cwd")
        if cwd is not None:
            if not isinstance(cwd, str):
                raise ConfigProblem("cwd is not a string")
            cwd = os.path.expanduser(rewrite(cwd))
            server.cwd = cwd if os.path.isabs(cwd) else os.path.normpath(
                os.path.join(file.project_root or os.path.dirname(file.path), cwd))
        for key in ("envFile", "env_file"):
            if raw.get(key):
                server.notes.append(f"{key} {raw[key]!r} was not imported: put its values in Coffer's secret "
                                    "store or environment")
        return server
    if url is None:
        raise ConfigProblem("neither command nor url")
    if not isinstance(url, str) or not re.match(r"(?i)https?://[^\s/]", url):
        raise ConfigProblem("url is not an http(s) URL")
    server.url = rewrite(url)
    kind = str(raw.get("type") or raw.get("transport") or "").lower()
    if kind in _REMOTE_TYPES:
        server.kind = _REMOTE_TYPES[kind]
    elif kind and kind != "stdio":
        raise ConfigProblem(f"transport {kind!r} is not one Coffer speaks")
    elif raw.get("httpUrl") is not None or raw.get("serverUrl") is not None:
        server.kind = "http"
    elif client == "gemini":
        server.kind = "sse"     # Gemini CLI: url is SSE, httpUrl is Streamable HTTP
    else:
        try:
            path = urllib.parse.urlsplit(url).path
        except ValueError:
            path = ""
        server.kind = "sse" if path.rstrip("/").endswith("/sse") else "http"
    headers = {k: rewrite(v) for k, v in _string_map(raw.get("headers"), "headers").items()}
    headers.update({k: rewrite(v) for k, v in _string_map(raw.get("http_headers"), "http_headers").items()})
    for header, variable in _string_map(raw.get("env_http_headers"), "env_http_headers").items():
        headers[header] = "${" + (variable if ENV_KEY_RE.match(variable) else reference_name(variable)) + "}"
    token_variable = raw.get("bearer_token_env_var")
    if isinstance(token_variable, str) and ENV_KEY_RE.match(token_variable):
        headers["Authorization"] = "Bearer ${" + token_variable + "}"
    elif isinstance(raw.get("bearer_token"), str):   # Codex's older literal form
        headers["Authorization"] = "Bearer " + raw["bearer_token"]
    server.headers = headers
    return server


# -- import: plan, then apply ---------------------------------------------------------------------------------

SECRET_SET_HINT = "coffer secret set {name}"   # the command that stores one secret (issue 15's CLI)


def _resolved(value: str, store) -> str:
    """``value`` with each ${NAME} the secret store holds (and has no default) replaced by what it stands for:
    a definition Coffer keeps and the client entry it came from then read alike, whichever of them holds the
    literal and whichever the reference."""
    if "${" not in value:
        return value

    def stored(match):
        held = store.get(match.group(1)) if match.group(2) is None else None
        return held if held is not None else match.group(0)

    return ENV_REF_RE.sub(stored, value)


def resolved_identity(identity: tuple, store) -> tuple:
    """An identity (ImportedServer.identity) with the secret store's references resolved, for comparing."""
    if identity[0] == "stdio":
        return ("stdio", tuple(_resolved(a, store) for a in identity[1]),
                tuple(sorted((k, _resolved(v, store)) for k, v in identity[2])))
    return ("remote", _resolved(identity[1] or "", store))


def coffer_identity(server: dict, store) -> tuple:
    """ImportedServer.identity() of a server already in the vault, its secret references resolved."""
    if server["transport"] == "stdio":
        identity = ("stdio", tuple(server.get("command") or ()), tuple(sorted((server.get("env") or {}).items())))
    else:
        identity = ("remote", server.get("url"))
    return resolved_identity(identity, store)


def same_definition(server: dict, imported: ImportedServer, store) -> bool:
    if coffer_identity(server, store) != resolved_identity(imported.identity(), store):
        return False
    if imported.kind == "stdio":
        return (server.get("cwd") or None) == imported.cwd
    headers = {k: _resolved(v, store) for k, v in (server.get("headers") or {}).items()}
    return server["transport"] == imported.kind and headers == {k: _resolved(v, store)
                                                                 for k, v in imported.headers.items()}


def legal_server_name(raw: str) -> tuple[str, str | None]:
    """(a name Coffer accepts, why it differs from ``raw`` or None)."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", str(raw)).strip("-") or "server"
    name = name[:SERVER_NAME_MAX].rstrip("-")
    if name.lower() == RESERVED_SERVER:
        name = f"{name}-server"
    if name == raw:
        return name, None
    why = ("'coffer' is reserved for Coffer's own tools" if str(raw).lower() == RESERVED_SERVER else
           f"Coffer names are {SERVER_NAME_RULE}")
    return name, f"renamed from {raw!r}: {why}"


def _numbered(name: str, n: int) -> str:
    suffix = f"-{n}"
    return name[:SERVER_NAME_MAX - len(suffix)].rstrip("-") + suffix


def _move_secrets(planned: PlannedServer, store, planned_secrets: dict) -> None:
    """Every secret-looking env/header value and command argument (and a URL's credentials) goes to the secret
    store, by the same rule as `coffer add` (plan_literals, plan_argument_literals); the definition keeps a
    ${NAME} for it.  Paths, modes and other settings stay as they are."""
    server = planned.server
    planned.env, found_env = plan_literals(planned.name, server.env, store, planned=planned_secrets)
    planned.headers, found_headers = plan_literals(planned.name, server.headers, store, header=True,
                                                   planned=planned_secrets)
    found_args: dict = {}
    if server.command:
        planned.command, found_args = plan_argument_literals(planned.name, server.command, store,
                                                             planned=planned_secrets)
    if found_args:
        server.notes.append(f"{', '.join('${' + n + '}' for n in found_args)} came from its arguments, where other "
                            "local users can read it while it runs (ps): prefer its environment if it takes one")
    found_url = {}
    if server.url:
        server.url, found_url = plan_url_literals(planned.name, server.url, store, planned=planned_secrets)
    planned.secrets.update({**found_env, **found_headers, **found_args, **found_url})


def plan_import(vault, store, files: list[ClientFile], ctx: ClientContext, overwrite: bool = False) -> ImportPlan:
    plan = ImportPlan()
    existing = {s["name"].lower(): s for s in vault.servers()}
    existing_ids = {coffer_identity(s, store): s["name"] for s in existing.values()}
    on_path: dict[str, bool] = {}
    seen: dict[tuple, str] = {}                  # identity -> "name from client (path)" in this run
    planned_names: set[str] = set()
    planned_secrets: dict[str, str] = {}
    done_files: set = set()
    for file in files:
        if (file.path, file.container) in done_files:
            continue
        done_files.add((file.path, file.container))
        try:
            document, servers = load_client_file(file)
        except ConfigProblem as exc:
            if not any(p.path == file.path for p in plan.problems):
                plan.problems.append(FileProblem(file.client, file.path, str(exc)))
            continue
        if document is None:
            continue
        plan.files_read.append(file)
        for raw_name, raw in servers.items():
            def skip(reason, name=raw_name):
                plan.skipped.append(SkippedServer(str(name), file.client, file.path, reason))

            if raw_name == COFFER_ENTRY and isinstance(raw, dict) and "serve" in json.dumps(raw):
                skip("Coffer's own entry")
                continue
            try:
                server = entry_to_server(file.client, raw_name, raw, file, ctx)
            except ConfigProblem as exc:
                skip(str(exc))
                continue
            name, renamed_because = legal_server_name(raw_name)
            identity = resolved_identity(server.identity(), store)
            current = existing.get(name.lower())
            if current is not None and same_definition(current, server, store):
                skip("already in Coffer with the same definition", name)
                seen.setdefault(identity, f"{name!r} in Coffer")
                continue
            if identity in existing_ids:
                skip(f"already in Coffer as {existing_ids[identity]!r}", name)
                continue
            if identity in seen:
                skip(f"same server as {seen[identity]}", name)
                continue
            if current is not None and not overwrite:
                skip(f"a different server named {name!r} is already in Coffer (--overwrite replaces it)", name)
                continue
            if name.lower() in planned_names:
                n = 2
                while _numbered(name, n).lower() in planned_names or _numbered(name, n).lower() in existing:
                    n += 1
                renamed_because = (renamed_because or f"renamed from {raw_name!r}") + \
                    f"; {name!r} is taken by another server in this import"
                name = _numbered(name, n)
                current = None   # the new name is free in Coffer: an insert, never an overwrite
            planned = PlannedServer(server, name, renamed_because, overwrite=current is not None,
                                    command=server.command)
            _move_secrets(planned, store, planned_secrets)
            program = (server.command or [""])[0]
            if program and not os.path.dirname(program):
                found = on_path.setdefault(program, shutil.which(program) is not None)
                if not found:  # as `coffer add` says it
                    server.notes.append(f"{program!r} is not on PATH here; the server will fail to start until it "
                                        "is installed")
            plan.added.append(planned)
            planned_names.add(name.lower())
            seen[identity] = f"{name!r} from {file.client} ({file.path})"
    return plan


def apply_import(vault, store, plan: ImportPlan) -> None:
    """Secrets first (a failed transaction leaves only unused store entries), then every server in one transaction."""
    for planned in plan.added:
        for name, value in planned.secrets.items():
            if store.get(name) != value:
                store.set(name, value)
    with vault.transaction() as db:
        for planned in plan.added:
            server = planned.server
            detail = f"{server.kind} from {server.client} {server.path}"
            if planned.secrets:
                detail += f"; secrets to the store: {', '.join(sorted(planned.secrets))}"
            vault.put_server(db, planned.name, command=planned.command, url=server.url, env=planned.env,
                             headers=planned.headers, cwd=server.cwd, transport=server.kind,
                             replace=planned.overwrite, action="import-overwrite" if planned.overwrite else "import",
                             detail=detail)


# -- install / uninstall --------------------------------------------------------------------------------------

def coffer_launch_command() -> list[str]:
    """An absolute argv that starts ``coffer serve`` even under a GUI app's minimal PATH.

    The installed ``coffer`` script when this module is the one it runs (both inside this interpreter's prefix),
    otherwise this interpreter and this file, which is also right for a checkout or an editable install.
    """
    module = os.path.realpath(os.path.abspath(__file__))
    prefix = os.path.realpath(sys.prefix)
    if module.startswith(prefix + os.sep):   # running as an installed package, not from a checkout
        for script in (shutil.which("coffer"), sys.argv[0] if sys.argv else None):  # argv[0]: e.g. uvx coffer-mcp
            if not script or not os.path.isfile(script):
                continue
            script = os.path.abspath(script)
            try:
                with open(script, "rb") as handle:
                    head = handle.read(4096)
            except OSError:
                continue
            if os.path.realpath(script).startswith(prefix + os.sep) and (b"from coffer import main" in head
                                                                         or script.lower().endswith(".exe")):
                return [script, "serve"]
    return [os.path.abspath(sys.executable), module, "serve"]  # not realpath: a venv's python is its own


def coffer_entry(client: str, vault, project: bool = False, profile: str | None = None) -> tuple[dict, list[str]]:
    """Coffer's entry for a client's config (with ``profile``: ``coffer serve --profile NAME``, that profile's part
    only), and what the user should know about it.

    A user's own file gets an absolute command (desktop apps start servers with a minimal PATH) and, with a
    non-default COFFER_HOME, that home.  A project's file is shared (teams commit it): it gets the portable
    ``coffer serve`` and no per-user path or home -- unless no ``coffer`` is on PATH, when it gets this machine's
    path and the note says why."""
    notes = []
    suffix = ["--profile", profile] if profile else []
    argv = coffer_launch_command() + suffix
    if project and shutil.which("coffer"):
        argv = ["coffer", "serve", *suffix]
        notes.append("a project file is shared, so the entry is the portable `coffer serve` (a client started "
                     "from a desktop launcher may not find `coffer` on its PATH: then use the user-scope install)")
    elif project:
        notes.append(f"`coffer` is not on PATH here, so the project file holds this machine's path to it "
                     f"({argv[0]}); install Coffer as a command (pipx install coffer-mcp) for an entry that works "
                     "for everyone")
    entry: dict = {"command": argv[0], "args": argv[1:]}
    if os.environ.get("COFFER_HOME") and project:
        notes.append(f"COFFER_HOME ({vault.home}) is yours alone, so it is not written into a shared file: set it "
                     "in the client's environment, or use the user-scope install")
    elif os.environ.get("COFFER_HOME"):   # a non-default vault: the client must start Coffer on the same one
        entry["env"] = {"COFFER_HOME": vault.home}
    if client in ("claude-code", "vscode"):
        entry = {"type": "stdio", **entry}
    elif client == "zed":
        entry = {"source": "custom", **entry}
    return entry, notes


def install_target(client: str, ctx: ClientContext, project: bool) -> ClientFile:
    files = [f for f in client_files(client, ctx, project=project) if f.scope != "local"]
    if not files:
        raise CofferError(f"{client} has no {'project' if project else 'user'} config file Coffer can write")
    return files[0]


def stash_path(vault, file: ClientFile) -> str:
    digest = sha256(f"{file.path}\0{'/'.join(file.container)}".encode()).hexdigest()[:12]
    return os.path.join(vault.home, "replaced", f"{file.client}-{digest}.json")


def _read_stash(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            stash = json.load(handle)
        return stash if isinstance(stash, dict) and isinstance(stash.get("entries"), dict) else {"entries": {}}
    except (OSError, ValueError):
        return {"entries": {}}


def _write_private(path: str, data: str) -> None:
    """Write a file only the user can read (0600 in a 0700 directory), atomically."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.name != "nt":
        os.chmod(directory, 0o700)
    write_private_file(path, data.encode("utf-8"))


def write_config_file(path: str, text: str, backups: str) -> str | None:
    """Back up ``path`` (privately, into the directory ``backups`` under COFFER_HOME: never beside a file a team
    commits), then replace it atomically (through a symlink, keeping its mode)."""
    target = os.path.realpath(path)
    backup = None
    mode = 0o600
    if os.path.exists(target):
        mode = stat.S_IMODE(os.stat(target).st_mode)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        digest = sha256(target.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        base = os.path.join(backups, f"{os.path.basename(path)}-{digest}.coffer-backup-{stamp}")
        backup, n = base, 1
        while os.path.exists(backup):
            n += 1
            backup = f"{base}-{n}"
        with open(target, "rb") as handle:
            original = handle.read()
        os.makedirs(backups, mode=0o700, exist_ok=True)
        write_private_file(backup, original)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    write_private_file(target, text.encode("utf-8"), mode)
    return backup


class EditResult:
    """What install/uninstall did (or would do) to one client config file."""

    def __init__(self, client: str, path: str, changed: bool, text: str = "", backup: str | None = None,
                 removed: list | None = None, restored: list | None = None, kept_out: list | None = None,
                 stash: str | None = None, renamed: list | None = None, notes: list | None = None):
        self.client = client
        self.path = path
        self.changed = changed
        self.text = text
        self.backup = backup
        self.removed = [] if removed is None else removed        # servers --replace took out
        self.restored = [] if restored is None else restored     # servers uninstall put back
        self.kept_out = [] if kept_out is None else kept_out     # (name, why) uninstall could not put back
        self.stash = stash
        self.renamed = [] if renamed is None else renamed        # what a --replace moved: sentences for the user
        self.notes = [] if notes is None else notes              # what the user should know about the entry


def _toml_block(name: str, entry: dict) -> str:
    """A stashed entry is kept as its original TOML text; a new one is rendered."""
    return entry["toml"] if set(entry) == {"toml"} else render_toml_server(name, entry)


def _edit_servers(file: ClientFile, text: str | None, put: dict, drop: list) -> tuple[str, dict]:
    """(new text, servers map after the edit): ``put`` entries set, ``drop`` names removed; verified by re-reading."""
    if text is None:
        value: dict = {}
        holder = value
        for part in file.container:
            holder = holder.setdefault(part, {})
        holder.update(put)
        if file.fmt == "toml":
            return "\n".join(_toml_block(name, entry) for name, entry in put.items()), dict(put)
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n", dict(put)
    document, servers = load_client_file(file, text)
    expected_value = json.loads(json.dumps(document.value, default=str))
    expected = _lookup(expected_value, file.container)[1]
    if expected is None:                       # the servers map does not exist yet: it will
        expected = expected_value
        for part in file.container:
            if not isinstance(expected.get(part), dict):
                expected[part] = {}
            expected = expected[part]
    for name in drop:
        expected.pop(name, None)
    new_text = text
    if file.fmt == "toml":
        for name in list(drop) + [n for n in put]:
            new_text = TomlDocument(new_text).without_server(name)
        for name, entry in put.items():
            block = _toml_block(name, entry)
            new_text = append_toml(new_text, block)
            expected[name] = load_toml(block).get("mcp_servers", {}).get(name, entry)
        result = TomlDocument(new_text).value
    else:
        for name in drop:
            new_text = JsonDocument(new_text, jsonc=file.fmt == "jsonc").without_member(file.container, name)
        for name, entry in put.items():
            new_text = JsonDocument(new_text, jsonc=file.fmt == "jsonc").with_member(file.container, name, entry)
            expected[name] = entry
        result = JsonDocument(new_text, jsonc=file.fmt == "jsonc").value
    if json.loads(json.dumps(result, default=str)) != expected_value:
        raise ConfigProblem("Coffer could not edit it safely (an entry is defined in a way it does not rewrite); "
                            "edit it by hand")
    return new_text, _lookup(result, file.container)[1] or {}


def registered_in_coffer(vault, store, file: ClientFile, servers: dict, ctx: ClientContext) -> dict:
    """{client entry name: Coffer server name} for the entries of ``servers`` that Coffer already serves."""
    identities = {coffer_identity(s, store): s["name"] for s in vault.servers()}
    found = {}
    for name, raw in servers.items():
        if name == COFFER_ENTRY:
            continue
        try:
            identity = resolved_identity(entry_to_server(file.client, name, raw, file, ctx).identity(), store)
        except ConfigProblem:
            continue
        if identity in identities:
            found[name] = identities[identity]
    return found


def _local_scopes(client: str, file: ClientFile, ctx: ClientContext) -> list[ClientFile]:
    """Claude Code's local scope for the current project (projects[<dir>].mcpServers in the user's own file): what
    a user-scope install --replace and uninstall cover too, since that client runs those servers beside Coffer."""
    if client != "claude-code" or file.scope != "user":
        return []
    return [f for f in client_files(client, ctx, project=True) if f.scope == "local" and f.path == file.path]


def _moved_names(vault, removed: dict) -> list[str]:
    """Sentences for the entries --replace takes out that Coffer serves under another name: the agent's tool names
    change, and the old prefix may now reach a different server."""
    names = {s["name"] for s in vault.servers()}
    moved = []
    for entry, served in sorted(removed.items()):
        if entry == served:
            continue
        text = f"{entry} is served as {served}: its tools are now {served}__<tool>"
        legal = legal_server_name(entry)[0]
        if legal != served and legal in names:
            text += f", and {legal}__<tool> now reaches another server ({legal}, imported from another client)"
        moved.append(text)
    return moved


def _stash_removed(vault, file: ClientFile, document, servers: dict, names, client: str) -> str:
    """Keep the entries --replace takes out (they may hold literal secrets) in a private file, never coffer.db."""
    path = stash_path(vault, file)
    stash = _read_stash(path)
    for name in names:
        stash["entries"][name] = {"toml": document.server_text(name)} if file.fmt == "toml" else servers[name]
    stash.update(client=client, path=file.path, container=list(file.container), saved_at=utcnow())
    _write_private(path, json.dumps(stash, indent=2, ensure_ascii=False))
    return path


def install_client(vault, store, client: str, ctx: ClientContext, project: bool = False, replace: bool = False,
                   dry_run: bool = False, profile: str | None = None) -> EditResult:
    file = install_target(client, ctx, project)
    try:
        text = read_config_text(file.path)
        document, servers = load_client_file(file, text) if text is not None else (None, {})
        local = []   # (ClientFile, its servers, {entry: Coffer name}) of the local scope --replace covers too
        for scope in (_local_scopes(client, file, ctx) if replace and text is not None else []):
            scope_servers = load_client_file(scope, text)[1]
            found = registered_in_coffer(vault, store, scope, scope_servers, ctx)
            if found:
                local.append((scope, scope_servers, found))
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    entry, notes = coffer_entry(client, vault, project, profile)
    current = servers.get(COFFER_ENTRY)
    put = {} if current == entry else {COFFER_ENTRY: entry}
    removed = registered_in_coffer(vault, store, file, servers, ctx) if replace else {}
    result = EditResult(client, file.path, changed=bool(put or removed or local), removed=sorted(removed),
                        notes=notes if put else [])
    for scope, _, found in local:
        result.removed += [f"{name} (local scope of {scope.project_root})" for name in sorted(found)]
    result.renamed = _moved_names(vault, {**removed, **{k: v for _, _, found in local for k, v in found.items()}})
    if not result.changed:
        return result
    try:
        result.text, _ = _edit_servers(file, text, put, list(removed))
        for scope, _, found in local:
            result.text, _ = _edit_servers(scope, result.text, {}, list(found))
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    if dry_run:
        return result
    if removed:
        result.stash = _stash_removed(vault, file, document, servers, removed, client)
    for scope, scope_servers, found in local:
        stashed = _stash_removed(vault, scope, document, scope_servers, found, client)
        result.stash = result.stash or stashed
    result.backup = write_config_file(file.path, result.text, os.path.join(vault.home, "backups"))
    return result


def uninstall_client(vault, store, client: str, ctx: ClientContext, project: bool = False,
                     dry_run: bool = False) -> EditResult:
    file = install_target(client, ctx, project)
    try:
        text = read_config_text(file.path)
        document, servers = load_client_file(file, text) if text is not None else (None, {})
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    result = EditResult(client, file.path, changed=False, stash=stash_path(vault, file))
    drop = [COFFER_ENTRY] if COFFER_ENTRY in servers else []
    scopes = [(file, servers, drop)]
    try:
        for scope in (_local_scopes(client, file, ctx) if text is not None else []):
            if os.path.exists(stash_path(vault, scope)):
                scopes.append((scope, load_client_file(scope, text)[1], []))
    except ConfigProblem as exc:
        raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    edits = []   # (scope, what to put back, stash, names restored)
    for scope, scope_servers, scope_drop in scopes:
        stash = _read_stash(stash_path(vault, scope))
        put, restored = {}, []
        for name, entry in stash["entries"].items():
            if name in scope_servers:
                result.kept_out.append((name, "an entry of that name is in the file again"))
            elif isinstance(entry, dict):
                put[name] = entry
                restored.append(name)
        result.restored += restored if scope is file else [f"{n} (local scope of {scope.project_root})"
                                                            for n in restored]
        edits.append((scope, put, scope_drop, stash, restored))
    result.changed = any(put or scope_drop for _, put, scope_drop, _, _ in edits)
    if result.changed:
        try:
            result.text = text
            for scope, put, scope_drop, _, _ in edits:
                if put or scope_drop:
                    result.text, _ = _edit_servers(scope, result.text, put, scope_drop)
        except ConfigProblem as exc:
            raise CofferError(f"{file.path}: {exc}; not rewritten") from None
    if dry_run:
        return result
    if result.changed:
        result.backup = write_config_file(file.path, result.text, os.path.join(vault.home, "backups"))
    kept_out = dict(result.kept_out)
    for scope, _, _, stash, restored in edits:
        path = stash_path(vault, scope)
        if os.path.exists(path):
            remaining = {name: entry for name, entry in stash["entries"].items()
                         if name not in restored and name not in kept_out}
            if remaining:
                stash["entries"] = remaining
                _write_private(path, json.dumps(stash, indent=2, ensure_ascii=False))
            else:
                os.unlink(path)
    return result
