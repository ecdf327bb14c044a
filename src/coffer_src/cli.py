"""Command line: coffer's commands."""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import shlex
import shutil
import sqlite3
import sys
import tempfile
from datetime import datetime, timedelta, timezone

from coffer_src import __version__
from coffer_src.clients.doctor import _command_text, print_doctor, run_doctor, show_server
from coffer_src.clients.files import ClientContext, ConfigProblem
from coffer_src.clients.move_in import (
    CLIENTS,
    ClientFile,
    EditResult,
    FileProblem,
    ImportPlan,
    apply_import,
    client_files,
    coffer_launch_command,
    detect_file,
    install_client,
    plan_import,
    uninstall_client,
)
from coffer_src.errors import CofferError, NotListedYet, VaultError
from coffer_src.gateway.builtins import (
    CLIENT_FAMILIES,
    client_family,
)
from coffer_src.jsonrpc import decode_json
from coffer_src.knowledge_commands import add_knowledge_commands, vault_audit
from coffer_src.names import (
    SEARCH_TOOL,
    SEPARATOR,
    SERVER_NAME_RULE,
    check_remote_url,
    check_server_name,
    did_you_mean,
    exposed_names,
    is_loopback_url,
    origin_text,
    url_origin,
)
from coffer_src.oauth import (
    oauth_secret_name,
)
from coffer_src.probe import GatewayClient, ProbeResult, ServerProbe
from coffer_src.profile_commands import add_profile_commands, client_listing, effective_tools, print_overrides
from coffer_src.profiles import ProfileStore
from coffer_src.remote_commands import (
    add_auth_command,
    add_remote_arguments,
    remote_add_options,
    report_remote_added,
)
from coffer_src.search.feedback import evaluate_feedback, labelled_searches
from coffer_src.search.preference import SearchPreference
from coffer_src.search.semantic import Embedder
from coffer_src.secret_store import (
    SECRET_MAX_CHARS,
    SecretStore,
    parse_env_assignment,
    plan_argument_literals,
    plan_literals,
    plan_url_literals,
    references,
    save_secrets,
)
from coffer_src.service.commands import (
    add_service_commands,
    flush_service_log,
    open_service_session,
    service_running,
    service_tools,
)
from coffer_src.service.web import attach_web
from coffer_src.settings import listed_settings, unknown_setting
from coffer_src.terminal import ServerLog, _print_table, clip, configure_logging, printable, redact, say, say_json
from coffer_src.transport.stdio import UpstreamFailure
from coffer_src.upstream.supervisor import failure_fix
from coffer_src.vault import Vault, _state, coffer_home, setting_key
from coffer_src.vault_rows import SHARING_MODES

cli_log = logging.getLogger(__name__)


def print_import_plan(plan: ImportPlan, dry_run: bool) -> None:
    home = os.path.expanduser("~")
    short = lambda path: path.replace(home, "~", 1) if path.startswith(home + os.sep) else path  # noqa: E731
    for problem in plan.problems:
        if problem.reason == "no such file":
            say(f"! nothing imported from {short(problem.path)}: there is no such file")
        else:
            say(f"! {problem.client if problem.client != '?' else 'not imported'}: {short(problem.path)} "
                f"{problem.reason}; the file is left as it is")
    for planned in plan.added:
        server = planned.server
        target = server.url if server.kind != "stdio" else " ".join(shlex.quote(p) for p in planned.command)
        verb = "replace" if planned.overwrite else "add"
        say(f"+ {verb} {planned.name} ({server.kind}) from {server.client} {short(server.path)}: {target}")
        if planned.renamed_because:
            say(f"    {planned.renamed_because}")
        if planned.secrets:
            say(f"    literal values moved to Coffer's secret store as: {', '.join(sorted(planned.secrets))}")
        for note in server.notes:
            say(f"    note: {note}")
    for skipped in plan.skipped:
        say(f"- skip {skipped.name} from {skipped.client} {short(skipped.path)}: {skipped.reason}")
    if not plan.files_read and not plan.problems:
        say("no MCP client configs found (looked for: " + ", ".join(CLIENTS) + ")")
    elif not plan.added and not plan.problems:
        say("nothing to import")
    elif dry_run:
        say(f"dry run: {len(plan.added)} server(s) would be imported; nothing was changed")


# -- commands -------------------------------------------------------------------------------------------------

def import_sources(sources: list[str], ctx: ClientContext) -> tuple[list[ClientFile], list[FileProblem]]:
    """Client names and file paths -> the files to read; a path that cannot be told apart is a FileProblem."""
    files: list[ClientFile] = []
    problems: list[FileProblem] = []
    for source in sources or CLIENTS:
        if source in CLIENTS:
            files.extend(client_files(source, ctx))
        elif os.path.sep in source or os.path.exists(source) or source.endswith((".json", ".toml")):
            try:
                files.extend(detect_file(source, ctx))
            except ConfigProblem as exc:
                problems.append(FileProblem("?", os.path.abspath(source), str(exc)))
        else:
            raise CofferError(f"unknown source {source!r}: give a client ({', '.join(CLIENTS)}) or a file path")
    return files, problems


def cmd_import(vault, args) -> int:
    ctx = ClientContext.current()
    store = vault.secrets
    files, problems = import_sources(args.sources, ctx)
    plan = plan_import(vault, store, files, ctx, overwrite=args.overwrite)
    plan.problems[:0] = problems
    if not args.dry_run and plan.added:
        apply_import(vault, store, plan)
    if args.json:
        say_json(plan.as_json())
    else:
        print_import_plan(plan, args.dry_run)
        if plan.added and not args.dry_run:
            say(f"imported {len(plan.added)} server(s); next: coffer install CLIENT --replace, then coffer doctor")
    return 1 if plan.problems and args.sources and not plan.added and not plan.skipped else 0


def _print_edit(result: EditResult, verb: str, dry_run: bool) -> None:
    if not result.changed:
        say(f"{result.client}: {result.path} already as wanted; nothing changed")
        return
    prefix = "dry run: would " if dry_run else ""
    say(f"{prefix}{verb} {result.client}: {result.path}")
    if result.removed:
        say(f"  {'would remove' if dry_run else 'removed'} (now served through Coffer): {', '.join(result.removed)}")
    for moved in result.renamed:
        say(f"  names moved: {moved}")
    for note in result.notes:
        say(f"  note: {note}")
    if result.restored:
        say(f"  {'would put back' if dry_run else 'put back'}: {', '.join(result.restored)}")
    for name, why in result.kept_out:
        say(f"  not put back: {name} ({why}); its entry stays in {result.stash}")
    if result.backup:
        say(f"  backup: {result.backup}")
    if result.stash and result.removed and not dry_run:
        say(f"  the removed entries are kept (private, 0600) in {result.stash}; coffer uninstall "
              f"{result.client} puts them back")


def cmd_install(vault, args) -> int:
    if args.profile is not None:
        ProfileStore(vault).profile(args.profile)  # an unknown profile would leave the client with no tools
    result = install_client(vault, vault.secrets, args.client, ClientContext.current(), project=args.project,
                            replace=args.replace, dry_run=args.dry_run, profile=args.profile)
    _print_edit(result, "install Coffer into" if args.dry_run else "installed Coffer into", args.dry_run)
    if result.changed and not args.dry_run:
        say(f"  restart {args.client} to load it")
    command = coffer_launch_command()[0]
    if re.search(r"[\\/](archive-v\d+|\.?cache[\\/]uv)[\\/]", command):
        say(f"  note: {command} lives in uv's cache, which uv may prune; for a lasting entry run "
              "'uv tool install coffer-mcp' (or pipx install coffer-mcp), then coffer install again")
    return 0


def cmd_uninstall(vault, args) -> int:
    result = uninstall_client(vault, vault.secrets, args.client, ClientContext.current(), project=args.project,
                              dry_run=args.dry_run)
    _print_edit(result, "remove Coffer from" if args.dry_run else "removed Coffer from", args.dry_run)
    return 0


def cmd_doctor(vault, args, probe=None) -> int:
    report = run_doctor(vault, vault.secrets, ClientContext.current(), probe)
    if args.json:
        say_json(report)
    else:
        print_doctor(report)
    return 0 if report["ok"] else 1


def cmd_show(vault, args) -> int:
    shown = show_server(vault, args.name)
    if args.json:
        say_json(shown)
        return 0
    target = shown["url"] if shown["transport"] != "stdio" else " ".join(shlex.quote(p) for p in shown["command"])
    say(f"{shown['name']} ({shown['transport']}): {target}")
    for label, values in (("env", shown["env"]), ("header", shown["headers"])):
        for key, value in values.items():
            say(f"  {label} {key}={value}")
    if shown["cwd"]:
        say(f"  cwd {shown['cwd']}")
    say(f"  enabled: {'yes' if shown['enabled'] else 'no'}; new capabilities: {shown['policy']}"
          + (f"; timeout {shown['timeout']} s" if shown["timeout"] else ""))
    detail = f" ({shown['status_detail']})" if shown["status_detail"] else ""
    since = f" since {shown['status_at']}" if shown["status_at"] else ""
    say(f"  status: {shown['status']}{since}{detail}")
    reason = f" ({shown['sharing_reason']})" if shown.get("sharing_reason") else ""
    say(f"  sharing: {shown['sharing']}{reason}" + (" -- one instance per client session"
                                                    if shown["sharing"] == "per-client" else ""))
    if shown["capabilities"]:
        say()
        _print_table([[c["kind"], c["name"], c["state"]] for c in shown["capabilities"]], ["KIND", "NAME", "STATE"])
    else:
        say("  no capabilities seen yet (coffer tools starts it)")
    if shown["overrides"]:
        say()
        print_overrides(shown["overrides"])
    return 0


def add_client_commands(command) -> None:
    """Wire import/install/uninstall/doctor/show into build_parser (``command`` is its local helper)."""
    p = command("import", cmd_import, "import the MCP servers of your clients (Claude, Cursor, VS Code, ...)")
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help=f"a client ({', '.join(CLIENTS)}) or a config file; default: every client found")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace a different server of the same name")
    for name, handler, text in (("install", cmd_install, "add Coffer to a client's config, as 'coffer'"),
                                ("uninstall", cmd_uninstall, "remove Coffer from a client's config and put back "
                                                             "what install --replace took out")):
        p = command(name, handler, text)
        p.add_argument("client", choices=CLIENTS)
        p.add_argument("--project", action="store_true", help="the current project's config, not the user's")
        p.add_argument("--dry-run", action="store_true")
        if name == "install":
            p.add_argument("--replace", action="store_true",
                           help="also remove the servers Coffer now serves from that client's config")
            p.add_argument("--profile", metavar="NAME", help="the client sees only this profile (coffer profile)")
    p = command("doctor", cmd_doctor, "check every server, client config and the vault; exit 1 if a server is broken")
    p.add_argument("--json", action="store_true")
    p = command("show", cmd_show, "a server's definition (secrets as references), status and capabilities")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")


def cmd_add(vault: Vault, args) -> int:
    env = dict(parse_env_assignment(item) for item in args.env)
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", key.strip()):
            raise CofferError(f"bad --header {item!r}: expected NAME=VALUE with NAME a valid HTTP header name")
        if any(c in value for c in "\r\n\x00"):
            raise CofferError(f"bad --header {key}: the value holds a line break")
        headers[key.strip()] = value
    if args.url:
        check_remote_url(args.url)
        if env:
            raise CofferError("--env is for servers Coffer starts; a remote server (--url) takes --header")
        if args.inherit_env:
            raise CofferError("--inherit-env is for servers Coffer starts, not for --url")
    elif headers:
        raise CofferError("--header is for remote servers (--url); a server Coffer starts takes --env")
    check_server_name(args.name)
    if vault.read_only:
        vault.transaction()  # says the vault is read-only, before any secret is stored
    planned: dict[str, str] = {}
    env, _ = plan_literals(args.name, env, vault.secrets, overwrite=args.replace, planned=planned)
    headers, _ = plan_literals(args.name, headers, vault.secrets, header=True, overwrite=args.replace,
                               planned=planned)
    url = plan_url_literals(args.name, args.url, vault.secrets, args.replace, planned)[0] if args.url else None
    in_env = set(planned)
    command = plan_argument_literals(args.name, args.command, vault.secrets, args.replace, planned)[0] \
        if args.command else None
    in_arguments = [name for name in planned if name not in in_env]
    earlier = vault.add_server(args.name, command=command, url=url, env=env, headers=headers,
                               cwd=args.cwd, policy=args.policy, timeout=args.timeout,
                               inherit_env=args.inherit_env, replace=args.replace, **remote_add_options(args))
    save_secrets(vault.secrets, planned)  # only now: a refused definition leaves the store as it was
    moved = list(planned)
    if earlier:
        say(f"kept the earlier choices for {earlier} of {args.name}'s tools, prompts and resources "
            "(coffer show / coffer enable to change them)")
    if moved:
        say(f"moved {len(moved)} secret-looking value(s) into Coffer's secret store: "
            f"{', '.join('${' + name + '}' for name in moved)} (coffer secret list)")
    if in_arguments:
        ServerLog(cli_log, args.name).warning(
            "%s came from its command's arguments: Coffer passes %s back as an argument when it starts the server, "
            "where other local users can read it (ps); prefer --env if the server takes it from its environment",
            ", ".join("${" + name + "}" for name in in_arguments), "it" if len(in_arguments) == 1 else "them")
    say(f"added {args.name}: {_command_text(vault.server(args.name))}")
    if args.url:
        if url_origin(args.url) and url_origin(args.url)[0] == "http" and not is_loopback_url(args.url) and headers:
            ServerLog(cli_log, args.name).warning(
                "its headers (credentials?) will cross the network unencrypted over plain http to %s; use https if "
                "the server offers it", origin_text(args.url))
        report_remote_added(vault, args.name, vault.secrets)
    elif args.command and not shutil.which(args.command[0]) and not os.path.dirname(args.command[0]):
        ServerLog(cli_log, args.name).warning(
            "%r is not on PATH here; the server will fail to start until it is installed", args.command[0])
    return 0


def cmd_remove(vault: Vault, args) -> int:
    server = vault.server(args.name) if args.name in {s["name"] for s in vault.servers()} else None
    vault.remove_server(args.name)
    vault.secrets.delete(oauth_secret_name(args.name))  # a login belongs to that server only
    say(f"removed {args.name}")
    stored = set(vault.secrets.names())
    left = sorted({name for name, _ in references(server) if name in stored}) if server and \
        not server.get("damaged") else []
    if left:
        used = {name for other in vault.servers() if not other.get("damaged") for name, _ in references(other)}
        shared = [name for name in left if name in used]
        say(f"its secrets stay in the store: {', '.join(left)}"
            + (f" ({', '.join(shared)} still used by another server)" if shared else "")
            + "; coffer secret rm NAME removes one")
    return 0


def cmd_list(vault: Vault, args) -> int:
    counts = collections.Counter(row["server"] for row in vault.capabilities()
                                 if row["kind"] == "tool" and row["present"] and row["enabled"])
    held = collections.Counter(row["server"] for row in vault.pending_approvals())
    servers = [{"name": s["name"], "transport": s["transport"], "command": _command_text(s),
                "enabled": s["enabled"], "policy": s["policy"], "updates": s["updates"],
                "status": "damaged" if s["damaged"] else (s["status"] or "never started"),
                "detail": s["damaged"] or s["status_detail"], "since": s["status_at"],
                "tools": counts.get(s["name"], 0),
                "awaiting_approval": held.get(s["name"], 0)}
               for s in vault.servers()]
    live = {u["name"]: u for u in (service_running(vault.home) or {}).get("upstreams", [])}
    for server in servers:  # what the running service sees now, over what was recorded last
        if server["name"] in live and server["status"] != "damaged":
            server["status"] = live[server["name"]]["state"]
    if args.json:
        say_json({"servers": servers})
    elif not servers:
        say("no servers yet: coffer add NAME -- COMMAND [ARGS...]")
    else:
        _print_table([[s["name"], "yes" if s["enabled"] else "no", s["status"], s["tools"], s["command"]]
                      for s in servers], ["NAME", "ENABLED", "STATUS", "TOOLS", "COMMAND"])
        for s in servers:
            if s["status"] in ("failed", "damaged") and s["detail"]:
                say(f"\n{s['name']} {s['status']}: {s['detail']}")
                if s["status"] == "failed":
                    say(f"  fix: {failure_fix(s['name'], s['detail'])}")
            if s["awaiting_approval"]:
                say(f"\n{s['name']}: {s['awaiting_approval']} changed definition(s) held back until you run "
                    f"`coffer approve {s['name']}`")
    return 0


def cached_tools(vault: Vault) -> list[dict]:
    """The tools the last session saw, as a client would see them: enabled, approved, of enabled servers."""
    max_length = vault.setting("name_max_length")
    servers = {s["name"]: s for s in vault.servers()}
    by_server: dict[str, list[dict]] = collections.defaultdict(list)
    for row in vault.capabilities():
        if row["kind"] == "tool" and row["present"] and row["server"] in servers:
            by_server[row["server"]].append(row)
    tools = []
    seniority = vault.seniority()
    for server, rows in sorted(by_server.items(), key=lambda item: list(servers).index(item[0])):  # as registered
        if not servers[server]["enabled"]:
            continue
        ranks = seniority.get((server, "tool")) or {}
        rows.sort(key=lambda row: ranks.get(row["name"], len(ranks)))  # the order a client lists them in
        names = exposed_names(server, [row["name"] for row in rows], max_length, ranks)
        for row in rows:
            state = _state(row)
            try:
                definition = json.loads(row["definition"] or "{}")
            except ValueError:
                continue
            if state.usable and isinstance(definition, dict):
                tools.append(dict(definition, name=names[row["name"]]))
    return tools


def cmd_tools(vault: Vault, args) -> int:
    """The catalogue as a client sees it: every server started (at most init_timeout each, one progress line per
    server on a terminal), or with --cached what the last session saw.  Exit 1 if a server failed."""
    failed = []
    family = client_family(args.client) if args.client else None
    if args.client and family is None:
        known = sorted({family for _, family in CLIENT_FAMILIES})
        raise CofferError(f"unknown client {args.client!r}{did_you_mean(args.client.lower(), known)}; known: "
                          f"{', '.join(known)}")
    running = None if args.cached else service_tools(vault.home, args.profile)
    if args.cached:
        tools = cached_tools(vault)
    elif running is not None:  # the running service's catalogue: no server is started for this
        tools = [tool for server in running.values() for tool in server["tools"]]
        failed = [ProbeResult(name, server["state"], server["error"], [], 0.0) for name, server in running.items()
                  if server["state"] == "failed"]
    else:
        interactive = sys.stderr.isatty()

        def progress(result: ProbeResult) -> None:
            if interactive:
                what = f"{len(result.tools)} tools" if result.state == "ready" else result.state
                print(printable(f"  {result.name}: {what} ({result.seconds:g}s)"), file=sys.stderr)

        def waiting(names: list[str], seconds: float) -> None:
            print(printable(f"coffer: still waiting for {', '.join(names)} ({seconds:.0f}s of "
                            f"{vault.settings()['init_timeout']:g}s)"), file=sys.stderr, flush=True)

        results = ServerProbe(vault, progress=progress, waiting=waiting).run()
        tools = [tool for result in results for tool in result.tools]
        failed = [result for result in results if result.state != "ready"]
    # (a running service has applied the overrides and the profile itself)
    tools, overridden = effective_tools(vault, tools, args.profile, applied=running is not None)
    tools = client_listing(vault, tools, args.profile, family, overridden)
    if args.json:
        say_json({"tools": tools, "failed": [{"server": r.name, "state": r.state, "reason": r.detail}
                                             for r in failed], **({"overridden": overridden} if overridden else {})})
    else:
        for tool in tools:
            description = (tool.get("description") or "").strip().splitlines()
            changed = overridden.get(tool["name"])
            note = f"  [overridden: {', '.join(changed['overridden'])}]" if changed else ""
            say(f"{tool['name']:<48}  {clip(description[0], 100) if description else ''}{note}")
    for result in failed:
        print(printable(redact(f"coffer: {result.name} {'did not start' if result.state == 'failed' else result.state}"
                               f": {result.detail or 'no reason given'}")), file=sys.stderr)
    return 1 if failed else 0


def cmd_enable(vault: Vault, args, enabled: bool = True) -> int:
    try:
        what = vault.set_enabled(args.target, enabled)
    except NotListedYet as exc:
        # Probably a server added but never started: ask that one server what it offers, then try once more.
        ServerProbe(vault, [args.target.partition(SEPARATOR)[0]]).run()
        try:
            what = vault.set_enabled(args.target, enabled)
        except NotListedYet:
            raise CofferError(str(exc)) from None
    say(f"{'enabled' if enabled else 'disabled'} {what}")
    return 0


def cmd_approve(vault: Vault, args) -> int:
    if args.target is None:
        pending = vault.pending_approvals()
        if not pending:
            say("nothing is waiting for approval")
        for row in pending:
            say(f"{row['kind']} {row['server']}:{row['name']} changed since it was approved")
        return 0
    approved = vault.approve(args.target)
    if not approved:
        say(f"{args.target}: nothing is waiting for approval")
    for label, diff in approved:
        say(f"approved {label}; what changed:\n{diff or '(no visible difference)'}\n")
    return 0


def cmd_policy(vault: Vault, args) -> int:
    if args.policy in SHARING_MODES:
        vault.set_sharing(args.server, args.policy, "the user's choice" if args.policy == "per-client" else None)
        say(f"{args.server} runs once for every client" if args.policy == "shared" else
            f"{args.server} runs once per client session (each with its own client's roots and identity)")
        return 0
    vault.set_policy(args.server, args.policy)
    say({"enabled": f"new capabilities of {args.server} will be enabled",
         "disabled": f"new capabilities of {args.server} will be disabled",
         "trust-updates": f"changed definitions from {args.server} apply without approval",
         "pin-updates": f"changed definitions from {args.server} wait for `coffer approve`"}[args.policy])
    return 0


def cmd_secret(vault: Vault, args) -> int:
    store = vault.secrets
    if args.action == "list":
        names = store.names()
        if args.json:
            say_json({"secrets": names})
        else:
            say("\n".join(names) if names else "no secrets stored: coffer secret set NAME")
        return 0
    if not args.name:
        raise CofferError(f"coffer secret {args.action} needs a NAME")
    if args.action == "rm":
        if not store.delete(args.name):
            raise CofferError(f"no secret named {args.name!r}{did_you_mean(args.name, store.names())}")
        vault_audit(vault, "secret-remove", args.name)
        say(f"removed secret {args.name}")
        return 0
    if sys.stdin.isatty():
        import getpass
        value = getpass.getpass(f"value for {args.name} (not shown): ")
    else:
        value = sys.stdin.read(SECRET_MAX_CHARS + 1).rstrip("\r\n")
    if not value:
        raise CofferError("empty value: nothing stored")
    store.set(args.name, value)
    vault_audit(vault, "secret-set", args.name)
    say(f"stored secret {args.name}; refer to it as ${{{args.name}}} in --env or --header")
    return 0


def cmd_call(vault: Vault, args) -> int:
    try:
        arguments = decode_json(args.arguments) if args.arguments is not None else {}
    except ValueError as exc:
        raise CofferError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise CofferError("arguments must be a JSON object, e.g. '{\"timezone\": \"UTC\"}'")
    server = args.tool.partition(SEPARATOR)[0]
    session = open_service_session(vault.home)
    if session is not None:  # the running service: its servers are warm, nothing starts for this call
        try:
            answer = session.request("tools/call", {"name": args.tool, "arguments": arguments},
                                     float(vault.settings()["call_timeout"]) + 10)
        finally:
            session.close()
        if "error" in answer:
            raise _call_error(vault, args.tool, str(answer["error"].get("message") or answer["error"]))
        result = answer.get("result")
    else:
        with GatewayClient(vault, only=[server] if args.tool != SEARCH_TOOL else None) as client:
            try:
                result = client.call("tools/call", {"name": args.tool, "arguments": arguments})
            except UpstreamFailure as exc:
                raise _call_error(vault, args.tool, str(exc).replace("tools/call failed: ", "")) from None
    say_json(result)
    return 1 if isinstance(result, dict) and result.get("isError") else 0


def _call_error(vault: Vault, tool: str, message: str) -> CofferError:
    """A failed `coffer call` for a person: a mistyped name gets the names it may have meant (the gateway's advice
    to call coffer__search_tools is for agents)."""
    if message.startswith("Unknown tool"):
        names = [t["name"] for t in cached_tools(vault)] + [SEARCH_TOOL]
        return CofferError(f"unknown tool {tool!r}{did_you_mean(tool, names)} (coffer tools lists them)")
    return CofferError(printable(message))


def _ms(value) -> str:
    return f"{value:.1f}ms" if isinstance(value, (int, float)) else str(value)


def cmd_log(vault: Vault, args) -> int:
    flush_service_log(vault.home)
    rows = vault.invocations(args.limit)
    if args.json:
        say_json({"invocations": rows})
    else:
        client = lambda r: f"{r['client']} ({r['profile']})" if r.get("profile") else r["client"]  # noqa: E731
        _print_table([[r["ts"], client(r), r["server"] or "", r["capability"], r["kind"], _ms(r["duration_ms"]),
                       r["status"], r["error"] or ""] for r in rows],
                     ["TIME", "CLIENT", "SERVER", "CAPABILITY", "KIND", "DURATION", "STATUS", "ERROR"])
    return 0


_RELATIVE_SINCE_RE = re.compile(r"^(\d{1,5})\s*(m|min|h|d|w)$")


def audit_since(text: str) -> str:
    """--since as the audit's timestamps: a date, a time, today, yesterday, or a span back from now (30m, 24h,
    7d, 2w)."""
    now = datetime.now(timezone.utc)
    word = text.strip().lower()
    local_midnight = datetime.now().replace(hour=0, minute=0, second=0, microsecond=0).astimezone(timezone.utc)
    relative = _RELATIVE_SINCE_RE.match(word)
    try:
        if word in ("today", "yesterday"):
            moment = local_midnight - timedelta(days=1 if word == "yesterday" else 0)
        elif relative:
            unit = {"m": "minutes", "min": "minutes", "h": "hours", "d": "days", "w": "weeks"}[relative.group(2)]
            moment = now - timedelta(**{unit: int(relative.group(1))})
        elif "T" in text or " " in text.strip():
            moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00")).astimezone(timezone.utc)
        else:
            return datetime.fromisoformat(text.strip()).date().isoformat()
    except (ValueError, OverflowError):
        raise CofferError(f"--since {text!r}: use a date (2026-11-30), a time (2026-11-30T12:00), today, yesterday "
                          "or a span such as 24h or 7d") from None
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def cmd_audit(vault: Vault, args) -> int:
    since = audit_since(args.since) if args.since else None
    rows = vault.audit_rows(args.limit, since, args.kind, args.server)
    total = vault.audit_count(since, args.kind, args.server)
    if args.json:
        say_json({"audit": rows, "total": total})
    else:
        _print_table([[r["ts"], r["actor"], r["action"], r["target"] or "", clip(r["detail"] or "", 400)]
                      for r in rows], ["TIME", "ACTOR", "ACTION", "TARGET", "DETAIL"])
        if total > len(rows):
            say(f"showing the newest {len(rows)} of {total} rows (--limit N shows more)")
    return 0


def cmd_eval(vault: Vault, args) -> int:
    """Score the current ranker on the user's own labelled searches (search_feedback): recall@1/5 and MRR@10,
    lexical and, with an embedder configured, hybrid, each also with the user's picks (search_preference,
    replayed: each search ranked with what the searches before it taught); and the searches that missed."""
    searches, total = labelled_searches(vault)
    embedder = Embedder.from_settings(vault.settings(), vault.secrets)
    report = {"searches": total, **evaluate_feedback(cached_tools(vault), searches, embedder, vault.path,
                                                     preference=SearchPreference)} \
        if searches else {"searches": total, "labelled": 0, "scored": 0, "rankers": {}}
    report["search_feedback"] = vault.setting("search_feedback")
    report["search_preference"] = vault.setting("search_preference")
    if args.json:
        say_json(report)
        return 0
    if not report["scored"]:
        say(f"No labelled searches to score ({total} recorded; a search is labelled by the tool the same session "
            f"calls next).  Turn recording on with `coffer config search_feedback on` (it is "
            f"{report['search_feedback']}); it stays on this machine.")
        return 0
    rankers = report["rankers"]
    say(f"{report['scored']} labelled searches scored against the current catalogue ({report['tools']} tools); "
        f"{report['skipped']} skipped (their tool is gone).")
    _print_table([[name, f"{r['recall@1']:.3f}", f"{r['recall@5']:.3f}", f"{r['mrr@10']:.3f}"]
                  for name, r in rankers.items()], ["RANKER", "RECALL@1", "RECALL@5", "MRR@10"])
    say(f"+preference: with the tools you picked for similar searches, each search learning only from those "
        f"before it (search_preference is {report['search_preference']}).")
    if report.get("note"):
        say(report["note"])
    for name in ("lexical", "hybrid"):
        for miss in rankers.get(name, {}).get("missed", []):
            where = f"rank {miss['rank']}" if miss["rank"] else "not in the top 10"
            say(clip(f"{name} missed: {miss['query']!r} -> {miss['chosen']} ({where}); top: "
                     f"{', '.join(miss['top']) or 'nothing'}", 200))
    return 0


def cmd_config(vault: Vault, args) -> int:
    """Show every listed setting, or one by name (a hidden one too), or change one."""
    if args.key and args.value is not None:
        vault.set_setting(args.key, args.value)
    settings = vault.settings()
    if args.key and args.key not in settings:
        if setting_key(args.key) != args.key:
            settings[args.key] = f"(not set: the global {setting_key(args.key)}, {settings[setting_key(args.key)]})"
        else:
            raise CofferError(unknown_setting(args.key))
    if not args.key:
        settings = listed_settings(settings)
    if args.json:
        say_json({args.key: settings[args.key]} if args.key else settings)
        return 0
    for key in [args.key] if args.key else sorted(settings):
        say(f"{key} = {settings[key]}")
    return 0


EPILOG = """
examples:
  coffer add time -- uvx mcp-server-time
  coffer secret set GITHUB_TOKEN          (asks for the value; or pipe it in)
  coffer add gh --env GITHUB_TOKEN='${GITHUB_TOKEN}' -- npx -y @modelcontextprotocol/server-github
  coffer add docs --url https://example.com/mcp --header 'Authorization=Bearer ${DOCS_TOKEN}'
  coffer add linear --url https://mcp.linear.app/sse && coffer auth linear
  coffer list
  coffer tools
  coffer disable time__convert_time
  coffer call time__get_current_time '{"timezone": "UTC"}'
  coffer log --limit 20

agent configuration (Claude Code, Codex, Cursor, Claude Desktop): one stdio server whose command is
`coffer serve` (or `python /path/to/coffer.py serve`).

data: $COFFER_HOME (default ~/.coffer, private: 0700) holds coffer.db and secrets.json.  ${VAR} and
${VAR:-default} in --env, --header, the URL and the command are stored as written and resolved when the server
starts: from Coffer's environment first, then from its secret store (coffer secret set).  A literal value given
to --env or --header is moved into the secret store and replaced by a reference, so no secret reaches coffer.db.
Prefer --env over command arguments for secrets: arguments are visible to every local user in `ps`.
A server started by Coffer sees only a minimal environment (PATH, HOME, locale, proxy and certificate settings,
package-manager settings) plus its own --env; --inherit-env NAME passes more.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coffer", description="Coffer: register MCP servers once, use them from every agent.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"coffer {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    def command(name, handler, help_text, **kwargs):
        p = sub.add_parser(name, help=help_text, description=help_text, **kwargs)
        p.set_defaults(handler=handler)
        return p

    p = command("add", cmd_add, "register an upstream server: NAME [options] -- COMMAND [ARGS...], or --url URL",
                usage="coffer add NAME [--env KEY=VALUE]... [--inherit-env NAME]... [--timeout S] [--policy P] "
                      "-- COMMAND [ARGS...]\n       coffer add NAME --url URL [--header NAME=VALUE]...",
                epilog="Secrets: write --env KEY='${NAME}' and keep the value in the environment or in `coffer "
                       "secret set NAME`; a literal value is moved into the secret store for you.  ${VAR} in the "
                       "command's arguments works too, but arguments are visible to other local users in `ps`: "
                       "prefer --env.")
    p.add_argument("name", help=f"server name: {SERVER_NAME_RULE}; becomes the <server>__ prefix")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server; ${VAR} is resolved at start, a literal value goes to the "
                        "secret store")
    p.add_argument("--inherit-env", action="append", default=[], metavar="NAME",
                   help="also pass this variable of Coffer's own environment ('*': all of it)")
    p.add_argument("--url", help="a remote server (Streamable HTTP or the legacy HTTP+SSE transport)")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="HTTP header (with --url); a literal value goes to the secret store")
    add_remote_arguments(p)
    p.add_argument("--cwd", help="working directory for the server process")
    p.add_argument("--timeout", type=float, help="per-call timeout in seconds (default: the call_timeout setting)")
    p.add_argument("--policy", choices=("enabled", "disabled"),
                   help="whether tools the server adds later start enabled (default) or disabled")
    p.add_argument("--replace", action="store_true",
                   help="change the definition of a server already registered, keeping its choices")
    p.set_defaults(command=[])
    command("remove", cmd_remove, "unregister a server").add_argument("name")
    add_auth_command(command)
    p = command("list", cmd_list, "registered servers, their status and tool counts")
    p.add_argument("--json", action="store_true")
    p = command("tools", cmd_tools, "the aggregated tool catalogue, as a client sees it (starts every server)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cached", action="store_true", help="what the last session saw, without starting servers")
    p.add_argument("--client", metavar="NAME", help="as this client is shown it (cursor, windsurf, vscode, ...)")
    p.add_argument("--profile", metavar="NAME", help="as a client of this profile sees it (coffer profile)")
    command("enable", cmd_enable, "enable a server, tool, prompt or resource").add_argument("target")
    command("disable", lambda v, a: cmd_enable(v, a, False),
            "disable a server, tool, prompt or resource (kept across restarts and upgrades)").add_argument("target")
    p = command("approve", cmd_approve, "accept a changed tool/prompt/resource definition after reading the diff "
                                        "(a server name approves all of its changes; no target lists them)")
    p.add_argument("target", nargs="?")
    p = command("policy", cmd_policy, "what a server's new capabilities start as (enabled|disabled), whether "
                                      "its changed definitions apply at once (trust-updates) or wait for `coffer "
                                      "approve` (pin-updates, the default), and whether the service runs it once "
                                      "for every client (shared, the default) or once per client (per-client)")
    p.add_argument("server")
    p.add_argument("policy", choices=("enabled", "disabled", "trust-updates", "pin-updates", *SHARING_MODES))
    p = command("secret", cmd_secret, "the secret store: set NAME (prompted, or from stdin), list, rm NAME")
    p.add_argument("action", choices=("set", "list", "rm"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    add_knowledge_commands(command)
    p = command("call", cmd_call, "call one tool through the gateway and print its result (for scripts)")
    p.add_argument("tool")
    p.add_argument("arguments", nargs="?", help="a JSON object (default {})")
    for name, handler, text in (("log", cmd_log, "recent invocations (never arguments or results)"),
                                ("audit", cmd_audit, "every change to the vault, newest last")):
        p = command(name, handler, text)
        p.add_argument("--json", action="store_true")
        p.add_argument("--limit", type=int, default=50)
    p.add_argument("--since", metavar="WHEN", help="only rows from then on: a date or time (2026-11-30[T12:00]), "
                                                   "today, yesterday, or a span such as 24h or 7d")
    p.add_argument("--kind", metavar="ACTION", help="only this action (add, which covers imports; disable, approve, "
                                                    "upstream, ...)")
    p.add_argument("--server", metavar="NAME", help="only rows about this server")
    command("eval", cmd_eval, "score tool search on your own searches (coffer config search_feedback on): "
                              "recall and MRR, lexical and hybrid, and the searches that missed"
            ).add_argument("--json", action="store_true")
    p = command("config", cmd_config, "show or change a setting")
    p.add_argument("key", nargs="?")
    p.add_argument("value", nargs="?")
    p.add_argument("--json", action="store_true")
    add_service_commands(command, extend_service=attach_web)
    add_client_commands(command)
    add_profile_commands(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging("info" if argv[:1] == ["serve"] else "warning")
    trailing: list[str] = []
    if argv[:1] == ["add"] and "--" not in argv and "--url" not in argv and not {"-h", "--help"} & set(argv):
        _, extra = build_parser().parse_known_args(argv)
        if extra:  # `coffer add time uvx mcp-server-time`: argparse would only say "unrecognized arguments"
            name = argv[1] if len(argv) > 1 else "NAME"
            print(printable(f"coffer: error: put -- before the server's command: coffer add {name} [options] -- "
                            f"{' '.join(extra)}"), file=sys.stderr)
            return 2
    if argv[:1] == ["add"] and "--" in argv:
        split = argv.index("--")
        argv, trailing = argv[:split], argv[split + 1:]
        if not trailing:
            print("coffer: error: nothing after '--': give the command that starts the server", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    if trailing:
        args.command = trailing
    if getattr(args, "limit", 1) is not None and getattr(args, "limit", 1) < 1:
        parser.error("--limit must be at least 1")
    del parser  # every subcommand's parser: a relay or a service runs for hours without needing them
    vault = scratch = None
    try:
        if getattr(args, "dry_run", False) and not os.path.exists(os.path.join(coffer_home(), "coffer.db")):
            # A dry run writes nothing, not even the vault it would plan against: an empty one, out of the way.
            scratch = tempfile.TemporaryDirectory(prefix="coffer-dry-run-")
            vault = Vault(scratch.name)
            vault.home, vault.secrets = coffer_home(), SecretStore(coffer_home())
        else:
            vault = Vault() if getattr(args, "opens_vault", True) else None
        return args.handler(vault, args)
    except KeyboardInterrupt:
        print("coffer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `coffer ... | head`: the reader had enough
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except CofferError as exc:
        print(printable(redact(f"coffer: error: {exc}")), file=sys.stderr)
        return 1
    except sqlite3.Error as exc:  # the knowledge base's own connections to coffer.db; the Vault's are VaultErrors
        problem = VaultError.wrap(exc, vault.path if vault is not None else os.path.join(coffer_home(), "coffer.db"))
        print(printable(redact(f"coffer: error: {problem}")), file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - a bug: one line for the user, the traceback with COFFER_LOG=debug
        cli_log.exception("internal error")
        return 1
    finally:
        if vault is not None:
            vault.close()
        if scratch is not None:
            scratch.cleanup()


if __name__ == "__main__":
    sys.exit(main())
