"""Profiles and overrides: what each agent sees; tools renamed, given fixed arguments.

A profile is what one kind of agent sees: the servers, tools, prompts and resources its patterns include (minus
what they exclude), how its tools are listed (expose), the tools always listed (pin), and the knowledge sources
coffer__ask searches for it.  A client uses one with `coffer serve --profile NAME`; with none it sees everything.

An override changes one tool for every client (global) or inside one profile: a new name (an alias; the original
name stays routable), a new description, annotations, and fixed arguments -- parameters the user gave a value,
removed from the schema a client sees, filled in on every call, refused when a client sends one.  An override is
checked against the tool's definition when it is set and again whenever its upstream lists the tool: one that no
longer fits (a fixed parameter gone, a value the new schema refuses) is never applied blindly.  The tool is held
back until the user fixes or clears the override (a fixed argument is often a restriction, such as an owner or a
read-only flag: listing the tool without it would lift the restriction), and `coffer show` and `coffer doctor`
say why.  Global overrides apply in the hub's catalogue (catalogue.py), so search indexes aliases and new
descriptions; a profile's filter and its own overrides apply in each session's view (gateway/view.py).
"""

from __future__ import annotations

import collections
import fnmatch
import json
import logging
import re
import sqlite3
from typing import NamedTuple

from coffer_src.digests import sha256
from coffer_src.errors import CofferError
from coffer_src.jsonrpc import dumps
from coffer_src.names import (
    EXPOSED_NAME_RE,
    MEMORY_SOURCE,
    QUALIFIED_URI_RE,
    REMEMBER_TOOL,
    RESERVED_SERVER,
    SEPARATOR,
    did_you_mean,
    exposed_names,
)
from coffer_src.settings import check_setting
from coffer_src.terminal import clip, printable
from coffer_src.vault import _at_the_vault_boundary, utcnow

profiles_log = logging.getLogger(__name__)

PROFILE_NAME_MAX = 32
PROFILE_NAME_RULE = f"1-{PROFILE_NAME_MAX} letters, digits, '-' or '_', starting with a letter or digit"
PROFILE_NAME_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{PROFILE_NAME_MAX - 1}}}$")
PATTERN_MAX_CHARS = 300
PATTERNS_MAX = 200              # patterns (or pins, or sources) in one list of a profile
GLOB_CHARS = frozenset("*?[")
ANNOTATION_KEYS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
ALL_KNOWLEDGE = "*"             # --knowledge '*': every knowledge source, memory included
DESCRIPTION_MAX_CHARS = 10_000
FIXED_MAX = 64                  # fixed arguments of one tool
FIXED_VALUE_MAX_CHARS = 64 << 10


def check_profile_name(name) -> str:
    if not isinstance(name, str) or not PROFILE_NAME_RE.match(name):
        raise CofferError(f"invalid profile name {printable(str(name))[:80]!r}: use {PROFILE_NAME_RULE}")
    return name


def _check_pattern(pattern, what: str) -> str:
    if not isinstance(pattern, str) or not pattern or len(pattern) > PATTERN_MAX_CHARS or \
            any(c.isspace() or not c.isprintable() for c in pattern):
        raise CofferError(f"bad {what} {clip(printable(str(pattern)), 80)!r}: a server, tool, prompt or resource name "
                          f"or a glob (github__*), at most {PATTERN_MAX_CHARS} characters, no spaces")
    return pattern


def is_glob(pattern: str) -> bool:
    return any(c in GLOB_CHARS for c in pattern)


class Profile(NamedTuple):
    """What one kind of agent sees.  A capability is in the profile when an include pattern matches one of its
    names (its server's name, the name it is exposed under, its alias, its URI) and no exclude pattern matches any
    of them: an alias never lets an excluded tool back in."""
    name: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    expose: str | None = None        # all | search | budget:N for its clients; None: the usual expose settings
    pin: tuple[str, ...] = ()        # tools always listed, whatever expose says
    knowledge: tuple[str, ...] = ()  # knowledge sources coffer__ask searches ('memory', '*'); none: no coffer__ask

    def sees(self, *names) -> bool:
        names = [name for name in names if name]
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.include for name in names) and not \
            any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude for name in names)

    def definition(self) -> dict:
        return {"include": list(self.include), "exclude": list(self.exclude), "expose": self.expose,
                "pin": list(self.pin), "knowledge": list(self.knowledge)}

    def knowledge_tools(self, tools: list[dict]) -> list[dict]:
        """Of Coffer's knowledge ``tools``, the ones this profile's clients get: coffer__ask when it names
        knowledge sources, coffer__remember when they include memory."""
        memory = MEMORY_SOURCE in self.knowledge or ALL_KNOWLEDGE in self.knowledge
        return [tool for tool in tools if self.knowledge and (tool["name"] != REMEMBER_TOOL or memory)]

    @classmethod
    def from_definition(cls, name: str, definition) -> Profile:
        """A profile as stored (ValueError when it does not parse: a damaged row)."""
        if not isinstance(definition, dict):
            raise ValueError("not a JSON object")
        lists = {}
        for key in ("include", "exclude", "pin", "knowledge"):
            value = definition.get(key) or []
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise ValueError(f"{key} is not a list of names")
            lists[key] = tuple(value)
        expose = definition.get("expose")
        if expose is not None and not isinstance(expose, str):
            raise ValueError("expose is not text")
        return cls(name, expose=expose, **lists)

    @property
    def digest(self) -> str:
        """Changes whenever what the profile lists could change (the view's fingerprint includes it)."""
        return sha256(json.dumps(self.definition(), sort_keys=True).encode()).hexdigest()[:16]

    def knowledge_sources(self, asked):
        """The sources a coffer__ask of this profile searches: ``asked`` (None: every one it may), within its own."""
        if ALL_KNOWLEDGE in self.knowledge:
            return asked
        if asked is None:
            return list(self.knowledge)
        outside = [source for source in asked if source not in self.knowledge]
        if outside:
            raise CofferError(f"knowledge source {clip(printable(outside[0]), 80)!r} is not in profile {self.name!r} "
                              f"(it searches: {', '.join(self.knowledge)})")
        return asked


def new_profile(name, include, exclude=(), expose=None, pin=(), knowledge=()) -> Profile:
    """A profile from the command line, each part checked on its own (check_profile checks it against what Coffer
    knows); CofferError says what is wrong."""
    check_profile_name(name)
    include = tuple(dict.fromkeys(_check_pattern(p, "--include pattern") for p in include or ()))
    exclude = tuple(dict.fromkeys(_check_pattern(p, "--exclude pattern") for p in exclude or ()))
    pin = tuple(dict.fromkeys(_check_pattern(p, "--pin") for p in pin or ()))
    knowledge = tuple(dict.fromkeys(_check_pattern(p, "--knowledge source") for p in knowledge or ()))
    if not include:
        raise CofferError("a profile needs at least one --include PATTERN (a server, a tool, or a glob such as "
                          "github__*)")
    if max(len(include), len(exclude), len(pin), len(knowledge)) > PATTERNS_MAX:
        raise CofferError(f"at most {PATTERNS_MAX} patterns, pins or sources each")
    if expose is not None:
        expose = check_setting("expose", expose)
    return Profile(name, include, exclude, expose, pin, knowledge)


# -- overrides ----------------------------------------------------------------------------------------------------

class Override(NamedTuple):
    """One tool's override, for every client (``profile`` None) or inside one profile.  ``tool`` is the upstream's
    own name, so an override survives a change of the exposed name (name_max_length, a server renamed by import);
    ``damaged`` holds why a stored row did not parse (the tool is then held back, never listed unrestricted)."""
    server: str
    tool: str
    profile: str | None = None
    name: str | None = None          # the alias clients see instead of the exposed name
    description: str | None = None
    annotations: dict = {}           # noqa: RUF012 - never changed in place: replaced whole
    fixed: dict = {}                 # noqa: RUF012
    damaged: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.server, self.tool

    @property
    def changes(self) -> list[str]:
        """What it overrides: some of name, description, annotations, fixed."""
        return [key for key, value in (("name", self.name), ("description", self.description),
                                       ("annotations", self.annotations), ("fixed", self.fixed))
                if value not in (None, {})]

    def over(self, base: Override | None) -> Override:
        """This profile override on top of the global one: each part it sets wins, annotations and fixed arguments
        are merged (a profile can fix one more argument without repeating the global ones)."""
        if base is None:
            return self
        return self._replace(name=self.name or base.name,
                             description=self.description if self.description is not None else base.description,
                             annotations={**base.annotations, **self.annotations}, fixed={**base.fixed, **self.fixed},
                             damaged=self.damaged or base.damaged)

    def definition(self) -> dict:
        return {key: getattr(self, key) for key in self.changes}

    @classmethod
    def from_row(cls, profile: str, server: str, tool: str, text: str) -> Override:
        """An override as stored; a row that does not parse is kept, marked ``damaged``."""
        try:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            name, description = value.get("name"), value.get("description")
            annotations, fixed = value.get("annotations") or {}, value.get("fixed") or {}
            if (name is not None and not isinstance(name, str)) or (description is not None and
                                                                    not isinstance(description, str)):
                raise ValueError("name or description is not text")
            if not isinstance(annotations, dict) or not all(isinstance(v, bool) for v in annotations.values()):
                raise ValueError("annotations are not true/false values")
            if not isinstance(fixed, dict):
                raise ValueError("fixed is not an object")
            return cls(server, tool, profile or None, name, description, annotations, fixed)
        except (ValueError, TypeError) as exc:
            return cls(server, tool, profile or None, damaged=str(exc)[:200])


def annotation_key(text: str) -> str:
    """readOnlyHint from readOnlyHint, readOnly or read-only (what --annotation accepts)."""
    wanted = re.sub(r"[-_]", "", text).lower()
    for key in ANNOTATION_KEYS:
        if wanted in (key.lower(), key[:-len("Hint")].lower()):
            return key
    raise CofferError(f"unknown annotation {clip(printable(text), 60)!r}: use {', '.join(ANNOTATION_KEYS)}")


def parse_annotation(item: str) -> tuple[str, bool | None]:
    """--annotation KEY=BOOL (KEY= clears it): (the MCP annotation name, its value or None)."""
    key, sep, value = item.partition("=")
    if not sep or value.strip().lower() not in ("true", "false", ""):
        raise CofferError(f"bad --annotation {clip(printable(item), 80)!r}: expected KEY=true or KEY=false "
                          f"(KEY= removes it)")
    value = value.strip().lower()
    return annotation_key(key.strip()), None if value == "" else value == "true"


def parse_fixed(item: str) -> tuple[str, object]:
    """--fix PARAM=JSON: the parameter and its value (a bare word that is not JSON is taken as a string)."""
    param, sep, text = item.partition("=")
    if not sep or not param.strip():
        raise CofferError(f"bad --fix {clip(printable(item), 80)!r}: expected PARAM=VALUE, the value as JSON "
                          "(\"text\", 3, true, [1, 2], {...}); a bare word is taken as a string")
    try:
        value = json.loads(text)
    except ValueError:
        if not text or text.strip() != text or text[:1] in "[{\"":
            raise CofferError(f"bad --fix {param.strip()}: {clip(printable(text), 80)!r} is not JSON; quote a string "
                              "('--fix owner=\"my-org\"')") from None
        value = text
    if len(dumps(value)) > FIXED_VALUE_MAX_CHARS:
        raise CofferError(f"--fix {param.strip()}: the value is larger than {FIXED_VALUE_MAX_CHARS} characters")
    return param.strip(), value


def check_alias(alias, server: str, max_length: int) -> str:
    """A name a tool of ``server`` may be listed under: legal for every client and within name_max_length (room
    for a client's own prefix within 64); ``<prefix>__`` only with its own server's prefix, so an alias can never
    pass for another server's tool (or one of Coffer's own)."""
    if not isinstance(alias, str) or not EXPOSED_NAME_RE.match(alias) or len(alias) > max_length:
        raise CofferError(f"bad --name {clip(printable(str(alias)), 80)!r}: use 1-{max_length} letters, digits, "
                          "'_' or '-' (name_max_length leaves room for the client's own prefix)")
    prefix, sep, _ = alias.partition(SEPARATOR)
    if sep and prefix != server:
        raise CofferError(f"bad --name {alias!r}: a name holding '{SEPARATOR}' must start with its own server's "
                          f"prefix, {server}{SEPARATOR} (names of other servers and {RESERVED_SERVER}{SEPARATOR} "
                          "are theirs)")
    return alias


# -- checking a value against the JSON Schema subset tool schemas use ------------------------------------------------

def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _is_type(value, kind: str) -> bool:
    actual = _json_kind(value)
    if kind == "number":
        return actual in ("integer", "number")
    if kind == "integer":
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    return actual == kind


def _same(a, b) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def schema_problem(value, schema, where: str, depth: int = 0) -> str | None:
    """Why ``value`` does not fit ``schema``, or None: type, const, enum, bounds, lengths, pattern, items,
    properties, required, additionalProperties, anyOf/oneOf/allOf.  What it cannot judge ($ref, formats) it
    accepts: the upstream checks the call itself."""
    if isinstance(schema, bool):
        return None if schema else f"{where} is not accepted at all"
    if not isinstance(schema, dict) or depth > 32:
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if isinstance(kinds, list) and kinds and not any(isinstance(k, str) and _is_type(value, k) for k in kinds):
        return f"{where} must be {' or '.join(map(str, kinds))}, not {_json_kind(value)}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{where} must be {clip(dumps(schema['const']), 80)}"
    if isinstance(schema.get("enum"), list) and not any(_same(value, item) for item in schema["enum"]):
        return f"{where} must be one of {clip(', '.join(dumps(item) for item in schema['enum']), 200)}"
    if _json_kind(value) in ("integer", "number"):
        for key, fails in (("minimum", lambda b: value < b), ("maximum", lambda b: value > b),
                           ("exclusiveMinimum", lambda b: value <= b), ("exclusiveMaximum", lambda b: value >= b)):
            bound = schema.get(key)
            if _json_kind(bound) in ("integer", "number") and fails(bound):
                return f"{where} must be {key.replace('exclusive', 'over the ').replace('imum', '').lower()} {bound}"
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            return f"{where} must be at least {schema['minLength']} characters"
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            return f"{where} must be at most {schema['maxLength']} characters"
        if isinstance(schema.get("pattern"), str):
            try:
                if re.search(schema["pattern"], value) is None:
                    return f"{where} must match {clip(schema['pattern'], 80)}"
            except re.error:
                pass  # a pattern Python cannot read: the upstream judges
    if isinstance(value, list):
        if isinstance(schema.get("minItems"), int) and len(value) < schema["minItems"]:
            return f"{where} must hold at least {schema['minItems']} items"
        if isinstance(schema.get("maxItems"), int) and len(value) > schema["maxItems"]:
            return f"{where} must hold at most {schema['maxItems']} items"
        for i, item in enumerate(value):
            problem = schema_problem(item, schema.get("items"), f"{where}[{i}]", depth + 1)
            if problem:
                return problem
    if isinstance(value, dict):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required") or [] if isinstance(schema.get("required"), list) else []:
            if key not in value:
                return f"{where}.{key} is required"
        for key, item in value.items():
            if key in properties:
                problem = schema_problem(item, properties[key], f"{where}.{key}", depth + 1)
            elif schema.get("additionalProperties") is False:
                problem = f"{where}.{key} is not a property it takes"
            else:
                problem = schema_problem(item, schema.get("additionalProperties"), f"{where}.{key}", depth + 1)
            if problem:
                return problem
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            problems = [schema_problem(value, option, where, depth + 1) for option in options]
            if all(problems):
                return problems[0]
    for option in schema.get("allOf") or [] if isinstance(schema.get("allOf"), list) else []:
        problem = schema_problem(value, option, where, depth + 1)
        if problem:
            return problem
    return None


def override_problem(override: Override, tool: dict) -> str | None:
    """Why ``override`` does not fit ``tool`` (the definition its upstream lists), or None."""
    if override.damaged:
        return f"its override in coffer.db is damaged ({override.damaged})"
    if not override.fixed:
        return None
    schema = tool.get("inputSchema")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    for param, value in override.fixed.items():
        if param not in properties:
            takes = ", ".join(sorted(map(str, properties))) or "none"
            return f"it has no parameter {clip(printable(param), 60)!r} to fix (its parameters: {clip(takes, 300)})"
        problem = schema_problem(value, properties[param], param)
        if problem:
            return f"the fixed value does not fit: {problem}"
    return None


def overridden_tool(tool: dict, override: Override) -> dict:
    """The tool as clients see it with ``override`` applied (which must fit: override_problem)."""
    entry = dict(tool)
    if override.name:
        entry["name"] = override.name
    if override.description is not None:
        entry["description"] = override.description
    if override.annotations:
        annotations = tool.get("annotations") if isinstance(tool.get("annotations"), dict) else {}
        entry["annotations"] = {**annotations, **override.annotations}
    if override.fixed:
        schema = dict(tool["inputSchema"])
        schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in override.fixed}
        if isinstance(schema.get("required"), list):
            required = [name for name in schema["required"] if name not in override.fixed]
            if required:
                schema["required"] = required
            else:
                del schema["required"]
        entry["inputSchema"] = schema
    return entry


class Overridden(NamedTuple):
    """A list of tools with overrides (and a profile's filter) applied."""
    tools: list[dict]               # as listed, in the order given
    aliases: dict[str, str]         # alias -> the name the tool had before
    fixed: dict[str, dict]          # listed name and name before -> its fixed arguments
    held: dict[str, str]            # name (and alias) -> why its override does not fit: the tool is not listed
    notes: dict[str, str]           # name -> what of its override is not applied (an alias already taken)


_reported_problems: set[tuple] = set()


def apply_overrides(tools: list[dict], key_of, overrides: dict, taken, sees=None) -> Overridden:
    """``tools`` with ``overrides`` ((server, upstream name) -> Override) applied: ``key_of(name)`` gives a tool's
    key; an alias already in ``taken`` (every exposed name) or given to an earlier tool is not applied (noted);
    ``sees(server, name, alias)``, a profile's filter, keeps only what the profile includes."""
    listed, aliases, fixed, held, notes = [], {}, {}, {}, {}
    for tool in tools:
        name = tool["name"]
        key = key_of(name)
        override = overrides.get(key) if key is not None else None
        alias = override.name if override is not None else None
        if sees is not None and not sees(key[0] if key else name.partition(SEPARATOR)[0], name, alias):
            continue
        if override is None:
            listed.append(tool)
            continue
        problem = override_problem(override, tool)
        if problem:
            held[name] = problem
            if alias:
                held.setdefault(alias, problem)
            _report(key, override, f"{name} is held back: its override no longer fits ({problem}); `coffer show "
                                   f"{key[0]}` says more")
            continue
        if alias and (alias in taken or alias in aliases) and alias != name:
            notes[name] = f"the name {alias} is taken by another tool: listed as {name}"
            _report(key, override, f"override of {name}: {notes[name]}")
            override = override._replace(name=None)
        entry = overridden_tool(tool, override)
        listed.append(entry)
        if override.name and override.name != name:
            aliases[override.name] = name
        if override.fixed:
            fixed[name] = fixed[entry["name"]] = override.fixed
    return Overridden(listed, aliases, fixed, held, notes)


def _report(key, override: Override, text: str) -> None:
    """Log a problem of an override once per process (every catalogue rebuild meets it again)."""
    marker = (key, override.profile, text)
    if marker not in _reported_problems:
        _reported_problems.add(marker)
        profiles_log.warning("%s%s", f"profile {override.profile}: " if override.profile else "", text)


class OverrideEffects:
    """What overrides (and a profile) do to the requests a catalogue routes: fixed arguments filled in, tools whose
    override no longer fits refused with the reason.  Catalogue and a session's profile view both have it."""

    fixed: dict[str, dict] = {}      # noqa: RUF012 - instances replace these whole
    held: dict[str, str] = {}        # noqa: RUF012

    def with_fixed(self, name: str, params: dict) -> tuple[dict, str | None]:
        """(the params to send upstream, None), or (params, why they are refused): a client may not send a value
        for a fixed argument (silently overwriting it would hide that its call was not what it asked)."""
        fixed = self.fixed.get(name)
        if not fixed:
            return params, None
        arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
        sent = sorted(key for key in arguments if key in fixed)
        if sent:
            return params, (f"argument {clip(sent[0], 60)!r} of {name} is fixed by the user in Coffer and may not be "
                            f"sent; call {name} without it")
        return {**params, "arguments": {**arguments, **fixed}}, None

    def refusal(self, name: str, kind: str) -> str | None:
        """Why a request for ``name`` is refused although the name is known, or None."""
        if kind == "tool" and name in self.held:
            return (f"tool {name!r} is held back: the override the user set for it no longer fits its definition "
                    f"({self.held[name]}); the user can fix it with `coffer override {name} --fix ...` or remove it "
                    f"with `coffer override {name} --clear`")
        return None


# -- what Coffer knows, for checking a profile or an override before it is stored --------------------------------------

class KnownCatalogue(NamedTuple):
    """The names Coffer has seen listed (from the vault), the overrides and the knowledge sources."""
    servers: frozenset[str]
    tools: dict[str, tuple[str, str, dict]]     # exposed name -> (server, upstream name, definition)
    others: dict[str, str]                      # prompt names, resource URIs and templates -> server
    overrides: list[Override]
    sources: list[str]
    max_length: int

    @classmethod
    def of(cls, vault, store: ProfileStore | None = None) -> KnownCatalogue:
        store = store or ProfileStore(vault)
        max_length = vault.setting("name_max_length")
        servers = frozenset(server["name"] for server in vault.servers())
        rows = collections.defaultdict(list)
        others: dict[str, str] = {}
        for row in vault.capabilities():
            if not row["present"] or row["server"] not in servers:
                continue
            if row["kind"] in ("tool", "prompt"):
                rows[(row["server"], row["kind"])].append(row)
            else:
                others[row["name"]] = row["server"]
        tools = {}
        for (server, kind), items in rows.items():
            names = exposed_names(server, [row["name"] for row in items], max_length)
            for row in items:
                if kind == "prompt":
                    others[names[row["name"]]] = server
                    continue
                try:
                    definition = json.loads(row["definition"] or "{}")
                except ValueError:
                    definition = {}
                tools[names[row["name"]]] = (server, row["name"], definition if isinstance(definition, dict) else {})
        return cls(servers, tools, others, store.overrides(), store.knowledge_sources(), max_length)

    def exposed(self, server: str, tool: str) -> str | None:
        return next((name for name, (s, t, _) in self.tools.items() if (s, t) == (server, tool)), None)

    def aliases(self, profile: str | None = None) -> dict[str, tuple[str, str]]:
        """alias -> (server, tool) of the global overrides and, with ``profile``, that profile's."""
        return {o.name: o.key for o in self.overrides if o.name and o.profile in (None, profile)}

    def override(self, key, profile: str | None) -> Override | None:
        return next((o for o in self.overrides if o.key == key and o.profile == profile), None)

    def effective(self, key, profile: str | None) -> Override | None:
        """The override that applies to a tool inside ``profile`` (its own over the global one)."""
        own = self.override(key, profile) if profile else None
        base = self.override(key, None)
        return own.over(base) if own is not None else base

    def candidates(self) -> set[str]:
        return set(self.servers) | set(self.tools) | set(self.others) | {o.name for o in self.overrides if o.name}

    def resolve_tool(self, target: str, profile: str | None = None) -> tuple[str, str]:
        """(server, upstream name) of a tool named as a client sees it: its exposed name or an alias."""
        if target in self.tools:
            server, tool, _ = self.tools[target]
            return server, tool
        aliased = self.aliases(profile).get(target) or next(
            (o.key for o in self.overrides if o.name == target), None)
        if aliased is not None:
            return aliased
        raise CofferError(f"unknown tool {clip(printable(target), 100)!r}"
                          f"{did_you_mean(target, self.candidates())}; `coffer tools` lists them")


def _pattern_problem(pattern: str, what: str, known: KnownCatalogue) -> tuple[str | None, str | None]:
    """(a refusal, a warning) for one include or exclude pattern: a name that matches nothing is a typo (an
    --exclude typo would let in what the user meant to keep out); a glob over a registered server that matches
    nothing yet is fine (its server may not have started yet)."""
    names = known.candidates()
    if any(fnmatch.fnmatchcase(name, pattern) for name in names):
        return None, None
    server = pattern.partition(SEPARATOR)[0] if SEPARATOR in pattern else pattern
    if QUALIFIED_URI_RE.match(pattern) or ":" in pattern:
        return None, f"{what} {pattern} matches no resource Coffer has seen listed yet"
    if not is_glob(pattern) and server in known.servers and any(s == server for s, _, _ in known.tools.values()):
        listed = [name for name in names if name.startswith(server + SEPARATOR)]
        return f"{what} {pattern!r} matches nothing: {server} lists no such tool or prompt" \
               f"{did_you_mean(pattern, listed)}", None
    if not is_glob(server) and server not in known.servers:
        hint = did_you_mean(pattern if not is_glob(pattern) else server, names)
        return (f"{what} {pattern!r} matches nothing: no server, tool, prompt or resource of that name{hint}"
                if not is_glob(pattern) else f"{what} {pattern!r} matches nothing: no server named {server!r}{hint}"), \
            None
    return None, f"{what} {pattern} matches nothing Coffer has seen listed yet"


def check_profile(profile: Profile, known: KnownCatalogue) -> list[str]:
    """Refuse (CofferError) what cannot be meant; return warnings for what may match later."""
    warnings = []
    for what, patterns in (("--include", profile.include), ("--exclude", profile.exclude)):
        for pattern in patterns:
            refusal, warning = _pattern_problem(pattern, what, known)
            if refusal:
                raise CofferError(refusal)
            if warning:
                warnings.append(warning)
    aliases = known.aliases(profile.name)
    for pin in profile.pin:
        if pin in known.tools:
            server, tool, _ = known.tools[pin]
        elif pin in aliases:
            server, tool = aliases[pin]
        else:
            raise CofferError(f"--pin {pin!r}: no tool of that name{did_you_mean(pin, [*known.tools, *aliases])}")
        override = known.effective((server, tool), profile.name)
        if not profile.sees(server, known.exposed(server, tool), override.name if override else None):
            raise CofferError(f"--pin {pin!r} is outside the profile: no --include matches it, or an --exclude does")
    sources = [*known.sources, MEMORY_SOURCE, ALL_KNOWLEDGE]
    for source in profile.knowledge:
        if source not in sources:
            raise CofferError(f"--knowledge {source!r}: no knowledge source of that name{did_you_mean(source, sources)}"
                              f" (sources: {', '.join(sources[:-1])}; '*' for all)")
    return warnings


def check_override(override: Override, known: KnownCatalogue) -> None:
    """Refuse (CofferError) an override that cannot apply to its tool as the upstream lists it now."""
    if not override.changes:
        raise CofferError("nothing to override: give --name, --description, --annotation or --fix (or --clear)")
    exposed = known.exposed(*override.key)
    if exposed is None:
        raise CofferError(f"{override.server} does not list a tool {override.tool!r} now")
    definition = known.tools[exposed][2]
    if override.name:
        check_alias(override.name, override.server, known.max_length)
        owner = known.tools.get(override.name)
        clash = [o for o in known.overrides if o.name == override.name and o.key != override.key
                 and (override.profile is None or o.profile in (None, override.profile))]
        if owner is not None and (owner[0], owner[1]) != override.key:
            raise CofferError(f"--name {override.name!r} is the name of another tool already")
        if clash:
            other = known.exposed(*clash[0].key) or clash[0].tool
            where = f" in profile {clash[0].profile}" if clash[0].profile else ""
            raise CofferError(f"--name {override.name!r} is already the alias of {other}{where}")
    if override.description is not None and len(override.description) > DESCRIPTION_MAX_CHARS:
        raise CofferError(f"--description is longer than {DESCRIPTION_MAX_CHARS} characters")
    if len(override.fixed) > FIXED_MAX:
        raise CofferError(f"at most {FIXED_MAX} fixed arguments per tool")
    base = known.override(override.key, None) if override.profile else None
    problem = override_problem(override.over(base), definition)
    if problem:
        raise CofferError(f"{exposed}: {problem}")


def override_report(override: Override, known: KnownCatalogue) -> dict:
    """One override as `coffer show`, `coffer override` and `coffer doctor` report it: what it sets, whether it
    fits the tool as its upstream lists it now, and the tool as clients see it."""
    exposed = known.exposed(*override.key)
    effective = known.effective(override.key, override.profile) if override.profile else override
    report = {"tool": exposed or f"{override.server}{SEPARATOR}{override.tool}", "server": override.server,
              "upstream_name": override.tool, "profile": override.profile, **override.definition(), "fits": True,
              "problem": None, "effective": None}
    if exposed is None:
        report.update(fits=False, problem="its server does not list this tool now")
        return report
    problem = override_problem(effective, known.tools[exposed][2])
    if problem:
        report.update(fits=False, problem=problem)
    else:
        report["effective"] = overridden_tool(dict(known.tools[exposed][2], name=exposed), effective)
    return report


# -- storage ----------------------------------------------------------------------------------------------------------

@_at_the_vault_boundary
class ProfileStore:
    """The profiles and overrides tables of coffer.db (their schema is the vault's): one transaction per change,
    each audited.  A vault too old to have the tables (opened read-only) has no profiles."""

    def __init__(self, vault):
        self.vault = vault
        self.path = vault.path

    def _rows(self, sql: str, args=()) -> list:
        try:
            return self.vault.db.execute(sql, args).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise

    def profiles(self) -> dict[str, Profile]:
        """Every profile by name; a damaged row is a profile that sees nothing (its clients see no tools rather
        than every tool), reported once."""
        found = {}
        for row in self._rows("SELECT name, definition FROM profiles ORDER BY name"):
            try:
                found[row["name"]] = Profile.from_definition(row["name"], json.loads(row["definition"]))
            except (ValueError, TypeError) as exc:
                found[row["name"]] = Profile(row["name"])
                _report(("profile", row["name"]), Override("", "", row["name"]),
                        f"its definition in coffer.db is damaged ({exc}); its clients see no tools until `coffer "
                        f"profile add {row['name']} --replace ...`")
        return found

    def profile(self, name: str) -> Profile:
        profiles = self.profiles()
        if name not in profiles:
            raise CofferError(f"unknown profile {clip(printable(str(name)), 80)!r}{did_you_mean(str(name), profiles)}"
                              f"; `coffer profile list` shows them")
        return profiles[name]

    def put_profile(self, profile: Profile, replace: bool) -> bool:
        """Store a profile (checked by the caller); True if it replaced one."""
        with self.vault.transaction() as db:
            row = db.execute("SELECT name FROM profiles WHERE name=?", (profile.name,)).fetchone()
            if row and not replace:
                raise CofferError(f"profile {profile.name!r} exists; `coffer profile add {profile.name} ... "
                                  "--replace` changes it")
            now = utcnow()
            db.execute("INSERT INTO profiles(name, definition, created_at, updated_at) VALUES (?,?,?,?) ON CONFLICT"
                       "(name) DO UPDATE SET definition=excluded.definition, updated_at=excluded.updated_at",
                       (profile.name, json.dumps(profile.definition()), now, now))
            self.vault._audit(db, "profile-replace" if row else "profile-add", profile.name,
                              clip(json.dumps(profile.definition()), 500))
            return bool(row)

    def remove_profile(self, name: str) -> int:
        """Remove a profile and its overrides; how many overrides went with it."""
        with self.vault.transaction() as db:
            if db.execute("DELETE FROM profiles WHERE name=?", (name,)).rowcount == 0:
                raise CofferError(f"unknown profile {clip(printable(name), 80)!r}")
            gone = db.execute("DELETE FROM overrides WHERE profile=?", (name,)).rowcount
            self.vault._audit(db, "profile-remove", name, f"{gone} overrides removed with it" if gone else None)
            return gone

    def overrides(self) -> list[Override]:
        return [Override.from_row(row["profile"], row["server"], row["tool"], row["override"])
                for row in self._rows("SELECT profile, server, tool, override FROM overrides ORDER BY rowid")]

    def put_override(self, override: Override) -> None:
        with self.vault.transaction() as db:
            if override.profile and not db.execute("SELECT 1 FROM profiles WHERE name=?",
                                                   (override.profile,)).fetchone():
                raise CofferError(f"unknown profile {override.profile!r}")
            db.execute("INSERT INTO overrides(profile, server, tool, override, updated_at) VALUES (?,?,?,?,?) ON"
                       " CONFLICT(profile, server, tool) DO UPDATE SET override=excluded.override,"
                       " updated_at=excluded.updated_at",
                       (override.profile or "", override.server, override.tool,
                        json.dumps(override.definition()), utcnow()))
            self.vault._audit(db, "override", f"{override.server}:{override.tool}",
                              (f"profile {override.profile}: " if override.profile else "")
                              + ", ".join(override.changes))

    def clear_override(self, server: str, tool: str, profile: str | None) -> bool:
        with self.vault.transaction() as db:
            gone = db.execute("DELETE FROM overrides WHERE profile=? AND server=? AND tool=?",
                              (profile or "", server, tool)).rowcount
            if gone:
                self.vault._audit(db, "override-clear", f"{server}:{tool}",
                                  f"profile {profile}" if profile else None)
            return bool(gone)

    def knowledge_sources(self) -> list[str]:
        return [row["name"] for row in self._rows("SELECT name FROM knowledge_sources WHERE kind='folder'"
                                                   " ORDER BY name")]


def profiles_report(vault) -> dict:
    """What `coffer doctor` says of profiles and overrides: an override that no longer fits its tool is an error
    (the tool is held back), a pattern that matches nothing a warning."""
    store = ProfileStore(vault)
    known = KnownCatalogue.of(vault, store)
    problems = []
    for override in known.overrides:
        report = override_report(override, known)
        if report["fits"]:
            continue
        scope = f" --profile {override.profile}" if override.profile else ""
        where = f" in profile {override.profile}" if override.profile else ""
        problems.append({"problem": f"the override of {report['tool']}{where} no longer fits: {report['problem']}; "
                                    "the tool is held back",
                         "fix": f"coffer override {report['tool']}{scope} --fix PARAM=VALUE (or --unfix PARAM), or "
                                f"coffer override {report['tool']}{scope} --clear", "severity": "error"})
    for profile in store.profiles().values():
        for what, patterns in (("--include", profile.include), ("--exclude", profile.exclude)):
            for pattern in patterns:
                refusal, warning = _pattern_problem(pattern, what, known)
                if refusal or warning:
                    problems.append({"problem": f"profile {profile.name}: {refusal or warning}",
                                     "fix": f"coffer profile add {profile.name} --replace ... (coffer profile show "
                                            f"{profile.name})", "severity": "warning"})
    return {"ok": not any(p["severity"] == "error" for p in problems), "problems": problems}
