"""Doctor: what is wrong with a user's setup, and the command that fixes it."""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import sqlite3
import stat
import sys
import threading
from typing import Callable, NamedTuple

from coffer_src.clients.files import ClientContext, ConfigProblem
from coffer_src.clients.move_in import (
    CLIENT_TOOL_NAME_LIMITS,
    CLIENTS,
    COFFER_ENTRY,
    GUI_CLIENTS,
    GUI_PATH,
    SECRET_SET_HINT,
    client_files,
    load_client_file,
    registered_in_coffer,
)
from coffer_src.errors import CofferError
from coffer_src.names import NAME_MAX_LENGTH_MIN
from coffer_src.probe import ServerProbe
from coffer_src.profiles import KnownCatalogue, override_report, profiles_report
from coffer_src.secret_store import ENV_REF_RE, expand_vars, references
from coffer_src.service.commands import service_tools
from coffer_src.terminal import ServerLog, looks_secret, say
from coffer_src.vault import PRIVATE_FILES, _state
from coffer_src.vault_schema import MIGRATIONS, SCHEMA_PARTS

doctor_log = logging.getLogger(__name__)

# -- doctor ---------------------------------------------------------------------------------------------------

def _problem(problem: str, fix: str, severity: str = "error") -> dict:
    return {"problem": problem, "fix": fix, "severity": severity}


def client_report(vault, store, ctx: ClientContext) -> list[dict]:
    reports = []
    for client in CLIENTS:
        files = client_files(client, ctx)
        user_install = False  # Claude Code's local scope runs beside the user scope's entries
        for file in files:
            exists = os.path.exists(file.path)
            if file.scope != "user" and not exists:
                continue
            report = {"client": client, "path": file.path, "scope": file.scope, "found": exists,
                      "installed": False, "duplicates": [], "problems": []}
            try:
                document, servers = load_client_file(file) if exists else (None, {})
            except ConfigProblem as exc:
                report["problems"].append(_problem(f"{file.path}: {exc}",
                                                   "fix the file by hand; coffer leaves it as it is"))
                reports.append(report)
                continue
            if file.scope == "local" and not servers:
                continue
            report["installed"] = COFFER_ENTRY in servers
            if file.scope == "user":
                user_install = report["installed"]
            duplicates = registered_in_coffer(vault, store, file, servers, ctx)
            report["duplicates"] = sorted(duplicates)
            beside = report["installed"] or (file.scope == "local" and user_install)
            if beside and duplicates:
                if file.scope == "local":   # keyed by the project's directory: the install must run there
                    fix = f"cd {shlex.quote(file.project_root or ctx.cwd)} && coffer install {client} --replace"
                else:
                    fix = f"coffer install {client}{' --project' if file.scope == 'project' else ''} --replace"
                where = f" (its local scope for {file.project_root})" if file.scope == "local" else ""
                report["problems"].append(_problem(
                    f"{client}{where} runs {', '.join(sorted(duplicates))} beside Coffer, so the agent sees them "
                    "twice", fix, "warning"))
            reports.append(report)
    return reports


def knowledge_report(vault, settings: dict) -> dict:
    """The knowledge sources and memory, read without opening the knowledge base (a doctor changes nothing)."""
    problems, sources = [], []
    memory = settings.get("memory", "off")
    try:
        tables = vault.table_columns()
        rows = vault.db.execute("SELECT name, root, kind, indexed_at FROM knowledge_sources ORDER BY name").fetchall() \
            if "knowledge_sources" in tables else []
        counts = dict(vault.db.execute("SELECT source, count(*) FROM knowledge_passages GROUP BY source").fetchall()) \
            if "knowledge_passages" in tables else {}
    except (CofferError, sqlite3.Error) as exc:
        return {"ok": False, "memory": memory, "sources": [], "problems": [_problem(
            f"the knowledge sources cannot be read: {exc}", "coffer doctor --json shows the vault's state")]}
    for row in rows:
        name, root, kind = row["name"], row["root"], row["kind"]
        passages = counts.get(name, 0)
        sources.append({"name": name, "root": root, "kind": kind, "passages": passages,
                        "indexed_at": row["indexed_at"]})
        if kind == "memory":
            continue
        if not os.path.isdir(root):
            problems.append(_problem(f"knowledge source {name}: its folder {root} is gone",
                                     f"restore it, or: coffer knowledge remove {name}"))
        elif not os.access(root, os.R_OK | os.X_OK):
            problems.append(_problem(f"knowledge source {name}: its folder {root} cannot be read",
                                     f"chmod u+rx {shlex.quote(root)}"))
        elif not row["indexed_at"]:
            problems.append(_problem(f"knowledge source {name} was never indexed",
                                     f"coffer knowledge reindex {name}", "warning"))
        elif not passages:
            problems.append(_problem(f"knowledge source {name} holds no passages (no file matched its globs)",
                                     f"coffer knowledge remove {name} && coffer knowledge add {shlex.quote(root)} "
                                     "--glob '**/*.md'", "warning"))
    memory_dir = os.path.join(vault.home, "memory")
    if memory == "on" and os.path.isdir(memory_dir) and not os.access(memory_dir, os.W_OK | os.X_OK):
        problems.append(_problem(f"memory is on but {memory_dir} cannot be written: coffer__remember fails",
                                 f"chmod u+rwx {shlex.quote(memory_dir)}"))
    return {"ok": not any(p["severity"] == "error" for p in problems), "memory": memory, "sources": sources,
            "problems": problems}


def server_report(vault, store, server: dict, installed_clients: set, probe, settings: dict) -> dict:
    problems = []
    name = server["name"]
    if server.get("damaged"):   # the lead's Vault marks a row it could not decode (and disables it)
        return {"name": name, "ok": False, "enabled": False, "tools": 0, "problems": [_problem(
            f"its definition in coffer.db is damaged: {server['damaged']}",
            f"coffer remove {name}, then add or import it again")]}
    if not server.get("enabled", True):
        return {"name": name, "ok": True, "enabled": False, "problems": [], "tools": 0}
    missing = sorted({ref for ref, has_default in references(server)
                      if not has_default and ref not in os.environ and store.get(ref) is None})
    for ref in missing:
        problems.append(_problem(f"${{{ref}}} is not set (neither in the environment nor in the secret store)",
                                 SECRET_SET_HINT.format(name=ref)))
    gui_installed = sorted(installed_clients & set(GUI_CLIENTS))
    if server["transport"] == "stdio" and server.get("command"):
        program = expand_vars(server["command"][0], environ={**{n: store.get(n) or "" for n in store.names()},
                                                             **os.environ})
        on_path = shutil.which(program)
        if not on_path:
            problems.append(_problem(f"command {program!r} is not found on PATH",
                                     f"install it, or register it with its absolute path: coffer remove {name} "
                                     f"&& coffer add {name} -- /absolute/path/to/{os.path.basename(program)} ..."))
        elif not os.path.isabs(program) and not shutil.which(program, path=GUI_PATH):
            fix = (f"register it with its absolute path: coffer remove {name} && coffer add {name} -- "
                   f"{on_path} {' '.join(shlex.quote(a) for a in server['command'][1:])}".rstrip())
            where = f" ({', '.join(gui_installed)} start Coffer that way)" if gui_installed else ""
            problems.append(_problem(f"command {program!r} is on your shell's PATH ({on_path}) but not on the "
                                     f"minimal PATH desktop apps get ({GUI_PATH}){where}", fix,
                                     "error" if gui_installed else "warning"))
    tools: list = []
    if not any(p["severity"] == "error" for p in problems):
        ok, tools, error = probe(server)
        tools = [str(t) for t in tools or []]
        if not ok:
            problems.append(_problem(f"did not start and list its tools within {settings['init_timeout']} s: "
                                     f"{error}", f"run it by hand to see why: {_command_text(server)}"))
    for client in sorted(installed_clients):
        if client not in CLIENT_TOOL_NAME_LIMITS:
            continue
        limit, prefix = CLIENT_TOOL_NAME_LIMITS[client]
        too_long = [t for t in tools if len(prefix) + len(t) > limit]
        if too_long:
            fitting = max(NAME_MAX_LENGTH_MIN, limit - len(prefix))
            problems.append(_problem(
                f"{len(too_long)} tool name(s) exceed {client}'s {limit}-character limit with {prefix!r} in front "
                f"(e.g. {too_long[0]})", f"coffer config name_max_length {fitting}", "warning"))
    return {"name": name, "ok": not any(p["severity"] == "error" for p in problems), "enabled": True,
            "problems": problems, "tools": len(tools)}


def vault_report(vault) -> dict:
    problems = []
    if os.name != "nt":  # the vault fixes these on open; what is left is what it could not fix
        for path, wanted in [(vault.home, "700")] + [(os.path.join(vault.home, f), "600") for f in PRIVATE_FILES]:
            if os.path.exists(path) and (mode := stat.S_IMODE(os.stat(path).st_mode)) & 0o077:
                problems.append(_problem(f"{path} is readable by others (mode {mode:o})", f"chmod {wanted} {path}"))
    try:
        problems += [_problem(found.problem, found.fix) for found in
                     schema_problems(vault.table_columns(), vault.path, vault.read_only)]
        damage = vault.integrity_problem()
        if damage is not None:
            problems.append(_problem(f"coffer.db is damaged: {damage}",
                                     f"restore {vault.path} from a backup, or move it away and re-import"))
    except CofferError as exc:
        problems.append(_problem(f"coffer.db cannot be checked: {exc}", f"look at {vault.path}"))
    return {"path": vault.home, "ok": not problems, "problems": problems}


# -- the schema: every table and column Coffer expects in coffer.db, and how to repair a damaged part -----------

class SchemaProblem(NamedTuple):
    """A part of coffer.db that is not as this Coffer expects, and the fix."""
    problem: str
    fix: str


class _ExpectedTable(NamedTuple):
    name: str
    columns: frozenset
    shadow: bool        # kept by a virtual table (FTS5's _data, _config...): dropped with it, never by name


@functools.lru_cache(maxsize=None)
def _expected_tables(script: str) -> tuple[_ExpectedTable, ...] | None:
    """Every table ``script`` creates, in creation order; None when this Python's SQLite cannot create them (no
    FTS5: then they cannot be checked either)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(script)
        rows = db.execute("SELECT name, sql FROM sqlite_master WHERE type='table' ORDER BY rowid").fetchall()
        virtual = tuple(f"{name}_" for name, sql in rows if sql.startswith("CREATE VIRTUAL"))
        return tuple(_ExpectedTable(name, frozenset(row[1] for row in db.execute(f"PRAGMA table_info({name})")),
                                    not sql.startswith("CREATE VIRTUAL") and name.startswith(virtual))
                     for name, sql in rows)
    except sqlite3.OperationalError:
        return None
    finally:
        db.close()


def drop_command(path: str, script: str) -> str:
    """A command dropping the tables ``script`` creates from coffer.db, with this Python (no sqlite3 tool needed);
    later tables first, since a vocabulary table reads the full-text table it was created on."""
    tables = [table.name for table in reversed(_expected_tables(script) or ()) if not table.shadow]
    statements = " ".join(f"DROP TABLE IF EXISTS {name};" for name in tables)
    return (f"{shlex.quote(sys.executable)} -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).executescript("
            f"sys.argv[2])' {shlex.quote(path)} {shlex.quote(statements)}")


def schema_problems(tables: dict[str, set[str]], path: str, read_only: bool) -> list[SchemaProblem]:
    """Every table and column of vault.SCHEMA_PARTS missing from ``tables`` (Vault.table_columns), with the fix
    for each part.  A part not used yet (no table of it at all) is fine; so is a column a newer Coffer added."""
    problems = []
    for part in SCHEMA_PARTS:
        expected = _expected_tables(part.script)
        if expected is None or (part.optional and not tables.keys() & {table.name for table in expected}):
            continue
        found, upgrade = [], True  # upgrade: what a writable open adds (a missing table, a migrated column)
        for table in expected:
            if table.name not in tables:
                found.append(f"table {table.name} is missing")
                continue
            lacking = table.columns - tables[table.name]
            if lacking:
                found.append(f"table {table.name} lacks {', '.join(sorted(lacking))}")
                upgrade = upgrade and lacking <= {column for name, column, _ in MIGRATIONS if name == table.name}
        if not found:
            continue
        if read_only and upgrade and not part.optional:
            fix = f"make {path} writable, then run any coffer command: it adds what this version needs"
        else:
            fix = part.repair.format(path=path, drop=drop_command(path, part.drops) if part.drops else "")
        problems.append(SchemaProblem(f"{part.name} in coffer.db: {'; '.join(found)}", fix))
    return problems


def probe_all(vault) -> Callable:
    """probe(server) -> (ok, exposed tool names, error): what the running service sees, or else what one
    ServerProbe that starts every server at once finds."""
    running = service_tools(vault.home)
    if running is not None:
        def probe_live(server):
            live = running.get(server["name"])
            if live is None:
                return False, [], "not started (disabled or damaged)"
            return live["state"] == "ready", [tool["name"] for tool in live["tools"]], live["error"] or live["state"]
        return probe_live
    results = {result.name: result for result in ServerProbe(vault).run()}

    def probe(server):
        result = results.get(server["name"])
        if result is None:
            return False, [], "not started (disabled or damaged)"
        return result.state == "ready", [tool["name"] for tool in result.tools], result.detail or result.state
    return probe


def run_doctor(vault, store, ctx: ClientContext, probe=None) -> dict:
    try:
        settings, servers = vault.settings(), vault.servers()
    except CofferError as exc:  # a damaged vault: say what is wrong with it and the fix; nothing else can be checked
        vault_state = vault_report(vault)
        if vault_state["ok"]:
            vault_state = {**vault_state, "ok": False, "problems": [_problem(
                f"coffer.db cannot be read: {exc}", "do what the error says, then run coffer doctor again")]}
        return {"ok": False, "servers": [], "clients": [], "vault": vault_state}
    probe = probe or probe_all(vault)
    clients = client_report(vault, store, ctx)
    installed = {c["client"] for c in clients if c["installed"]}
    reports: list = [None] * len(servers)

    def check(index, server):
        try:
            reports[index] = server_report(vault, store, server, installed, probe, settings)
        except Exception as exc:  # noqa: BLE001 - one server's odd state must not hide the others' report
            ServerLog(doctor_log, server["name"]).exception("doctor could not check it")
            reports[index] = {"name": server["name"], "ok": False, "enabled": server.get("enabled", True),
                              "tools": 0, "problems": [_problem(f"could not be checked: {exc}", "coffer list")]}

    threads = [threading.Thread(target=check, args=(i, s), name=f"coffer-doctor-{s['name']}", daemon=True)
               for i, s in enumerate(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    vault_state = vault_report(vault)
    knowledge = knowledge_report(vault, settings)
    try:
        profiles = profiles_report(vault)
    except CofferError as exc:
        profiles = {"ok": False, "problems": [_problem(f"profiles and overrides cannot be read: {exc}",
                                                       "coffer doctor says what is wrong with the vault")]}
    return {"ok": all(r["ok"] for r in reports) and vault_state["ok"] and knowledge["ok"] and profiles["ok"],
            "servers": reports, "clients": clients, "knowledge": knowledge, "vault": vault_state, "profiles": profiles}


def print_doctor(report: dict) -> None:
    marks = {True: "ok ", False: "!! "}
    say("servers:")
    if not report["servers"]:
        say("  none registered: coffer import (from your clients) or coffer add NAME -- COMMAND")
    for server in report["servers"]:
        state = "disabled" if not server.get("enabled", True) else f"{server['tools']} tools"
        say(f"  {marks[server['ok']]}{server['name']} ({state})")
        for problem in server["problems"]:
            say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    say("clients:")
    for client in report["clients"]:
        state = ("Coffer installed" if client["installed"] else "Coffer not installed") if client["found"] \
            else "no config"
        say(f"  {client['client']:<15} {state:<21} {client['path']} ({client['scope']} scope)")
        if client["duplicates"]:
            say(f"      also runs, and Coffer serves: {', '.join(client['duplicates'])}")
        for problem in client["problems"]:
            say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    knowledge = report.get("knowledge")
    if knowledge is not None:
        say(f"knowledge: memory {knowledge['memory']}" + ("" if knowledge["sources"] else
                                                          "; no sources (coffer knowledge add PATH)"))
        for source in knowledge["sources"]:
            say(f"  {source['name']:<15} {source['passages']} passages  {source['root']}")
        for problem in knowledge["problems"]:
            say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    vault_state = report["vault"]
    say(f"vault: {vault_state['path']} {'ok' if vault_state['ok'] else ''}".rstrip())
    for problem in vault_state["problems"]:
        say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")
    profiles = report.get("profiles") or {"problems": []}
    if profiles["problems"]:
        say("profiles and overrides:")
    for problem in profiles["problems"]:
        say(f"      {problem['severity']}: {problem['problem']}\n      fix: {problem['fix']}")


# -- show -----------------------------------------------------------------------------------------------------

def shown_value(key: str, value: str) -> str:
    """A stored env/header value as ``coffer show`` prints it: references and plain settings (a path, a mode) as
    written, a literal that looks like a credential never."""
    if not value or ENV_REF_RE.search(value) or not looks_secret(key, value):
        return value
    return f"<literal, {len(value)} characters>"


def show_server(vault, name: str) -> dict:
    server = vault.server(name)
    capabilities = [{"kind": row["kind"], "name": row["name"],
                     "state": ("enabled" if row["enabled"] else "disabled")
                     + (", changed: waiting for coffer approve" if _state(row).quarantined else "")
                     + ("" if row["present"] else ", no longer listed")}
                    for row in vault.capabilities(name)]
    return {"name": server["name"], "transport": server["transport"], "command": server.get("command"),
            "url": server.get("url"), "cwd": server.get("cwd"),
            "env": {k: shown_value(k, v) for k, v in (server.get("env") or {}).items()},
            "headers": {k: shown_value(k, v) for k, v in (server.get("headers") or {}).items()},
            "enabled": server["enabled"], "policy": server["policy"], "timeout": server.get("timeout"),
            "status": server.get("status") or "never started", "status_detail": server.get("status_detail"),
            "status_at": server.get("status_at"), "sharing": server.get("sharing", "shared"),
            "sharing_reason": server.get("sharing_reason"), "capabilities": capabilities,
            "overrides": server_overrides(vault, name)}


def server_overrides(vault, name: str) -> list[dict]:
    """The overrides of a server's tools as `coffer show` reports them: what each sets, whether it still fits,
    the tool as clients see it."""
    known = KnownCatalogue.of(vault)
    return [override_report(override, known) for override in known.overrides if override.server == name]


def _command_text(server: dict) -> str:
    if server.get("damaged"):
        return "(damaged definition)"
    if server["transport"] == "stdio":
        return " ".join(shlex.quote(p) for p in server["command"])
    return server["url"] + (f" ({server['transport']})" if server["transport"] != "http" else "")
