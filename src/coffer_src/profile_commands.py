"""Profile commands: `coffer profile`, `coffer override`; their part in `coffer tools`.

Every change is checked against what Coffer has seen the servers list (profiles.check_profile, check_override)
before anything is stored: a refused profile or override changes nothing.  A running gateway (the service, or a
`coffer serve --standalone`) notices the change within a second and tells its clients which lists changed.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from coffer_src.catalogue import Catalogue
from coffer_src.errors import CofferError
from coffer_src.gateway.builtins import expose_mode, knowledge_tools_for, tools_for_client
from coffer_src.gateway.view import Views
from coffer_src.names import SEPARATOR
from coffer_src.probe import ServerProbe
from coffer_src.profiles import (
    KnownCatalogue,
    Override,
    ProfileStore,
    check_override,
    check_profile,
    new_profile,
    override_report,
    parse_annotation,
    parse_fixed,
)
from coffer_src.terminal import _print_table, clip, printable, say, say_json


class _Listed(NamedTuple):
    """A server as the vault last saw it listed: what a Catalogue needs of an upstream, with no process."""
    name: str
    lists: dict
    ready_at: float = 1.0
    remembered: dict = {}  # noqa: RUF012 - never changed


def offline_catalogue(vault, profile: str | None = None, store: ProfileStore | None = None) -> Catalogue:
    """The catalogue a client would see now (with ``profile``, that profile's view), made from what the vault
    recorded of each enabled server's last listing: the gateway's own rules, without starting anything."""
    store = store or ProfileStore(vault)
    views = Views()
    views.load(store)
    enabled = [s["name"] for s in vault.servers() if s["enabled"] and not s["damaged"]]
    lists = {name: {kind: {} for kind in ("tool", "prompt", "resource", "template")} for name in enabled}
    for row in vault.capabilities():
        if row["present"] and row["server"] in lists and row["definition"]:
            try:
                definition = json.loads(row["definition"])
            except ValueError:
                continue
            if isinstance(definition, dict):
                lists[row["server"]][row["kind"]][row["name"]] = definition
    catalogue = Catalogue([_Listed(name, lists[name]) for name in enabled], vault.capability_states(),
                          vault.setting("name_max_length"), views.global_overrides)
    return catalogue if profile is None else views.catalogue(profile, catalogue)


def overridden_tools(known: KnownCatalogue, profile: str | None = None) -> dict[str, dict]:
    """listed name -> what was overridden of it (for `coffer tools`): the name it stands for, the parts changed,
    the fixed parameters."""
    shown = {}
    for key in {o.key for o in known.overrides if o.profile in (None, profile)}:
        override = known.effective(key, profile)
        exposed = known.exposed(*key)
        if override is None or exposed is None:
            continue
        shown[override.name or exposed] = {"name_of": exposed if override.name else None,
                                           "overridden": override.changes, "fixed": sorted(override.fixed)}
    return shown


def effective_tools(vault, tools: list[dict], profile: str | None, applied: bool = False) -> tuple[list[dict], dict]:
    """`coffer tools`: ``tools`` (as servers list them now, by exposed name) as a client sees them with the
    overrides (and ``profile``) applied, and what was overridden.  With no override and no profile, ``tools``
    as they are; ``applied``: they are already as a client sees them (a running service's)."""
    store = ProfileStore(vault)
    known = KnownCatalogue.of(vault, store)
    if profile is not None:
        store.profile(profile)  # CofferError for an unknown one
    if applied or (profile is None and not known.overrides):
        return tools, overridden_tools(known, profile) if known.overrides else {}
    view = offline_catalogue(vault, profile, store)
    effective = {view.aliases.get(tool["name"], tool["name"]): tool for tool in view.tools}
    return [effective[tool["name"]] for tool in tools if tool["name"] in effective], overridden_tools(known, profile)


def client_listing(vault, tools: list[dict], profile: str | None, family: str | None, overridden: dict) -> list:
    """What `coffer tools` lists: what a client of ``family`` on ``profile`` is shown of ``tools`` (its expose
    mode -- the profile's, else its own or the global setting -- Coffer's own tools, and the profile's pins), by
    the gateway's one rule (builtins.tools_for_client)."""
    chosen = ProfileStore(vault).profile(profile) if profile else None
    settings = vault.settings()
    knowledge = knowledge_tools_for(vault.has_knowledge_sources(), settings["memory"] == "on")
    mode = expose_mode({"expose": chosen.expose} if chosen and chosen.expose else settings, family)
    pinned = None
    if chosen is not None:
        knowledge = chosen.knowledge_tools(knowledge)
        if chosen.pin:
            pins = set(chosen.pin)

            def pinned(listed: list[dict], every: list[dict]) -> list[dict]:
                have = {id(tool) for tool in listed}
                return [tool for tool in every if id(tool) in have or tool["name"] in pins
                        or (overridden.get(tool["name"]) or {}).get("name_of") in pins]
    return tools_for_client(tools, knowledge, mode, vault.tool_usage(), pinned)


# -- coffer profile ---------------------------------------------------------------------------------------------------

def _profile_json(profile, store_overrides: list[Override], known: KnownCatalogue) -> dict:
    return {"name": profile.name, **profile.definition(),
            "overrides": [override_report(o, known) for o in store_overrides if o.profile == profile.name]}


def cmd_profile(vault, args) -> int:
    store = ProfileStore(vault)
    if args.action == "list":
        profiles = store.profiles()
        overrides = store.overrides()
        rows = [{"name": p.name, **p.definition(), "overrides": sum(1 for o in overrides if o.profile == p.name)}
                for p in profiles.values()]
        if args.json:
            say_json({"profiles": rows})
        elif not rows:
            say("no profiles yet: coffer profile add NAME --include PATTERN...")
        else:
            _print_table([[r["name"], " ".join(r["include"]), " ".join(r["exclude"]) or "-", r["expose"] or "-",
                           r["overrides"]] for r in rows], ["NAME", "INCLUDE", "EXCLUDE", "EXPOSE", "OVERRIDES"])
        return 0
    if not args.name:
        raise CofferError(f"coffer profile {args.action} needs a NAME")
    if args.action == "add":
        profile = new_profile(args.name, args.include, args.exclude, args.expose, args.pin, args.knowledge)
        warnings = check_profile(profile, KnownCatalogue.of(vault, store))
        replaced = store.put_profile(profile, args.replace)
        if args.json:
            say_json({"profile": {"name": profile.name, **profile.definition()}, "replaced": replaced,
                      "warnings": warnings})
        else:
            for warning in warnings:
                say(f"note: {warning}")
            say(f"{'changed' if replaced else 'added'} profile {profile.name}; a client uses it with `coffer serve "
                f"--profile {profile.name}` (coffer install CLIENT --profile {profile.name} writes that)")
        return 0
    if args.action == "rm":
        gone = store.remove_profile(args.name)
        if args.json:
            say_json({"removed": args.name, "overrides_removed": gone})
        else:
            say(f"removed profile {args.name}" + (f" and its {gone} override(s)" if gone else "") +
                "; a client still started with it sees no tools until its entry changes")
        return 0
    profile = store.profile(args.name)
    known = KnownCatalogue.of(vault, store)
    view = offline_catalogue(vault, profile.name, store)
    shown = {**_profile_json(profile, known.overrides, known),
             "tools": [tool["name"] for tool in view.tools], "prompts": [p["name"] for p in view.prompts],
             "resources": [r["uri"] for r in view.resources] + [t["uriTemplate"] for t in view.templates],
             "held": view.held}
    if args.json:
        say_json(shown)
        return 0
    say(f"profile {profile.name}")
    for key in ("include", "exclude", "pin", "knowledge"):
        if shown[key]:
            say(f"  {key}: {' '.join(shown[key])}")
    say(f"  expose: {profile.expose or '(the usual expose settings)'}")
    say(f"  sees now: {len(shown['tools'])} tools, {len(shown['prompts'])} prompts, "
        f"{len(shown['resources'])} resources and templates (as the servers last listed them)")
    for name in shown["tools"]:
        say(f"    {name}")
    for name, why in view.held.items():
        say(f"    {name}: held back, its override no longer fits ({why})")
    print_overrides(shown["overrides"])
    return 0


# -- coffer override --------------------------------------------------------------------------------------------------

def print_overrides(reports: list[dict]) -> None:
    for report in reports:
        scope = f"profile {report['profile']}" if report["profile"] else "every client"
        parts = []
        if report.get("name"):
            parts.append(f"named {report['name']}")
        if report.get("description") is not None:
            parts.append(f"description {clip(printable(report['description']), 60)!r}")
        if report.get("annotations"):
            parts.append("annotations " + ", ".join(f"{k}={str(v).lower()}" for k, v in report["annotations"].items()))
        if report.get("fixed"):
            parts.append("fixed " + ", ".join(f"{k}={clip(json.dumps(v), 40)}" for k, v in report["fixed"].items()))
        say(f"  override of {report['tool']} ({scope}): {'; '.join(parts) or 'nothing'}")
        if not report["fits"]:
            say(f"    !! no longer fits: {report['problem']}; the tool is held back until the override is fixed "
                f"or cleared")


def _resolve(vault, store: ProfileStore, target: str, profile: str | None) -> tuple[KnownCatalogue, tuple[str, str]]:
    """What Coffer knows and the (server, upstream name) of the tool ``target`` names; a tool of a server that
    was never started is looked up by starting that server once (as `coffer enable` does)."""
    known = KnownCatalogue.of(vault, store)
    try:
        return known, known.resolve_tool(target, profile)
    except CofferError:
        server = target.partition(SEPARATOR)[0]
        if SEPARATOR not in target or server not in known.servers or any(s == server for s, _, _ in
                                                                          known.tools.values()):
            raise
    ServerProbe(vault, [server]).run()
    known = KnownCatalogue.of(vault, store)
    return known, known.resolve_tool(target, profile)


def cmd_override(vault, args) -> int:
    store = ProfileStore(vault)
    if args.profile is not None:
        store.profile(args.profile)
    changing = args.clear or args.name is not None or args.description is not None or args.annotation or \
        args.fix or args.unfix
    if args.tool is None:
        if changing:
            raise CofferError("coffer override TOOL ... (which tool?)")
        known = KnownCatalogue.of(vault, store)
        reports = [override_report(o, known) for o in known.overrides
                   if args.profile is None or o.profile == args.profile]
        if args.json:
            say_json({"overrides": reports})
        elif not reports:
            say("no overrides yet: coffer override TOOL --name ALIAS | --description TEXT | --fix PARAM=VALUE ...")
        else:
            print_overrides(reports)
        return 0
    known, key = _resolve(vault, store, args.tool, args.profile)
    current = known.override(key, args.profile)
    if not changing:
        reports = [override_report(o, known) for o in known.overrides if o.key == key]
        if args.json:
            say_json({"overrides": reports})
        elif not reports:
            say(f"{args.tool} has no override")
        else:
            print_overrides(reports)
        return 0
    if args.clear:
        if args.name is not None or args.description is not None or args.annotation or args.fix or args.unfix:
            raise CofferError("--clear removes the whole override; give it alone")
        if not store.clear_override(*key, args.profile):
            raise CofferError(f"{args.tool} has no override{' in profile ' + args.profile if args.profile else ''}")
        if args.json:
            say_json({"cleared": known.exposed(*key) or args.tool, "profile": args.profile})
        else:
            say(f"cleared the override of {known.exposed(*key) or args.tool}"
                + (f" in profile {args.profile}" if args.profile else ""))
        return 0
    override = _changed(current or Override(*key, profile=args.profile), args)
    if not override.changes:
        store.clear_override(*key, args.profile)
        say_json({"cleared": known.exposed(*key), "profile": args.profile}) if args.json else \
            say(f"nothing is overridden of {known.exposed(*key)} any more: override removed")
        return 0
    check_override(override, known)
    store.put_override(override)
    report = override_report(override, KnownCatalogue.of(vault, store))
    if args.json:
        say_json(report)
    else:
        print_overrides([report])
        effective = report["effective"] or {}
        say(f"  clients{' of profile ' + args.profile if args.profile else ''} see it as {effective.get('name')}; "
            "running gateways apply it within a second")
    return 0


def _changed(override: Override, args) -> Override:
    """``override`` with what the command line sets: an empty --name or --description removes that part,
    KEY= an annotation, --unfix a fixed argument."""
    if override.damaged:
        override = Override(override.server, override.tool, override.profile)  # rewritten whole from here
    annotations, fixed = dict(override.annotations), dict(override.fixed)
    for item in args.annotation:
        key, value = parse_annotation(item)
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
    for item in args.fix:
        param, value = parse_fixed(item)
        fixed[param] = value
    for param in args.unfix:
        if param not in fixed:
            raise CofferError(f"--unfix {param!r}: it is not fixed (fixed: {', '.join(fixed) or 'nothing'})")
        del fixed[param]
    name = override.name if args.name is None else (args.name or None)
    description = override.description if args.description is None else (args.description or None)
    return override._replace(name=name, description=description, annotations=annotations, fixed=fixed)


def add_profile_commands(command) -> None:
    """`coffer profile ...` and `coffer override ...` (call from build_parser with its local helper)."""
    p = command("profile", cmd_profile, "what each agent sees: add NAME --include PATTERN... [--exclude PATTERN...] "
                                        "[--expose MODE] [--pin TOOL...] [--knowledge SOURCE...] [--replace], "
                                        "list, show NAME, rm NAME")
    p.add_argument("action", choices=("add", "list", "show", "rm"))
    p.add_argument("name", nargs="?")
    p.add_argument("--include", nargs="+", default=[], metavar="PATTERN",
                   help="servers, tools, prompts or resources it sees: names or globs (github, github__*, time)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN", help="what it never sees, even if included")
    p.add_argument("--expose", metavar="MODE", help="all, search or budget:N for its clients (default: the expose "
                                                   "settings)")
    p.add_argument("--pin", nargs="+", default=[], metavar="TOOL", help="tools always listed, whatever expose says")
    p.add_argument("--knowledge", nargs="+", default=[], metavar="SOURCE",
                   help="knowledge sources its coffer__ask searches ('memory' for remembered facts, '*' for all); "
                        "none: no coffer__ask")
    p.add_argument("--replace", action="store_true", help="change an existing profile")
    p.add_argument("--json", action="store_true")
    p = command("override", cmd_override, "change a tool for every client or one profile: a new name, description, "
                                          "annotations, fixed arguments (no TOOL: list every override)")
    p.add_argument("tool", nargs="?", metavar="TOOL")
    p.add_argument("--profile", metavar="NAME", help="only inside this profile (default: for every client)")
    p.add_argument("--name", metavar="ALIAS", help="the name clients see (the original stays callable); '' removes it")
    p.add_argument("--description", metavar="TEXT", help="the description clients see; '' removes it")
    p.add_argument("--annotation", action="append", default=[], metavar="KEY=BOOL",
                   help="readOnlyHint, destructiveHint, idempotentHint or openWorldHint (KEY= removes it)")
    p.add_argument("--fix", action="append", default=[], metavar="PARAM=JSON",
                   help="give a parameter a value: hidden from clients, filled in on every call, refused if sent")
    p.add_argument("--unfix", action="append", default=[], metavar="PARAM", help="stop fixing a parameter")
    p.add_argument("--clear", action="store_true", help="remove the override")
    p.add_argument("--json", action="store_true")
