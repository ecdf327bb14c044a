"""Catalogue: the merged, namespaced, filtered view of every upstream."""

from __future__ import annotations

import collections
import re
import threading
from typing import NamedTuple

from coffer_src.digests import sha256
from coffer_src.jsonrpc import dumps
from coffer_src.modern import shape_handshake_tool
from coffer_src.names import QUALIFIED_URI_RE, exposed_names, qualify_uri
from coffer_src.profiles import OverrideEffects, apply_overrides
from coffer_src.search.index import SearchIndex
from coffer_src.upstream.supervisor import Upstream
from coffer_src.vault import CapabilityState


class Route(NamedTuple):
    """Where an exposed name or URI goes: the upstream, and the name or URI it knows the capability by."""
    upstream: Upstream
    name: str


class TemplateRoute(NamedTuple):
    regex: re.Pattern
    upstream: Upstream
    template: str
    literal: int  # literal characters in the template: the more, the more specific


def template_regex(template: str) -> re.Pattern:
    """A matcher for an RFC 6570 URI template: each {expression} matches one or more characters."""
    parts = re.split(r"(\{[^}]*\})", template)
    pattern = "".join("(.+?)" if part.startswith("{") and part.endswith("}") else re.escape(part) for part in parts)
    return re.compile(f"^{pattern}$", re.S)


def template_literal_length(template: str) -> int:
    return len(re.sub(r"\{[^}]*\}", "", template))


class Catalogue(OverrideEffects):
    """An immutable snapshot of what the client may see and call, rebuilt whenever anything changes.

    The hot path only does dictionary look-ups here.  Resource URIs are exposed unchanged, so URIs embedded in
    tool results stay readable; a URI that two upstreams both publish is exposed as ``coffer+<server>:<uri>``
    once per server, and the bare URI routes to the first of them in registration order.  A URI that matches
    several templates is read through the most specific one: the template with the most literal characters
    (ties: registration order), so a catch-all ``{anything}`` can never capture reads meant for another server.
    Disabled and quarantined capabilities are left out, and remembered so a call to one gets the right error.
    The global overrides (profiles.py) apply here, so every client and the search index see a tool's alias and
    new description; its original name stays routable.  A session with a profile sees a ProfileCatalogue
    (gateway/view.py) made from this one.
    """

    @staticmethod
    def lists_of(up) -> dict[str, dict]:
        """What an upstream offers: its live lists once it has started, before that what it listed last time.

        Remembering means a client's first tools/list is complete at once instead of waiting for (or, past the
        discovery budget, missing) a slow server; a call to a remembered tool waits for its server to start,
        and a server that lists something different after all gets a list_changed notification.
        """
        if up.ready_at or not up.remembered:
            return up.lists
        return {**up.lists, **up.remembered}

    def __init__(self, upstreams, states: dict, max_length: int, overrides: dict | None = None):
        self.tools: list[dict] = []
        self.tool_routes: dict[str, Route] = {}
        self.prompts: list[dict] = []
        self.prompt_routes: dict[str, Route] = {}
        self.resources: list[dict] = []
        self.resource_routes: dict[str, Route] = {}
        self.templates: list[dict] = []
        self.template_routes: list[TemplateRoute] = []
        self.template_by_text: dict[str, Route] = {}
        self.disabled: set[str] = set()
        self.quarantined: set[str] = set()
        self.blocked_templates: list[tuple[re.Pattern, str]] = []  # disabled or quarantined: (matcher, exposed)
        self.qualified: dict[tuple[str, str], str] = {}  # (server, uri) -> exposed uri, for notifications
        self.withheld: dict[tuple[str, str], str] = {}   # (server, tool) -> exposed: disabled, quarantined tools
        uri_count = collections.Counter(uri for up in upstreams for uri in up.lists["resource"])
        tpl_count = collections.Counter(t for up in upstreams for t in up.lists["template"])
        usual = CapabilityState(True)
        seniority: dict[tuple[str, str], dict[str, int]] = {}  # (server, kind) -> {name: rank}: states are oldest first
        for server, kind, name in states:
            if kind in ("tool", "prompt"):
                ranks = seniority.setdefault((server, kind), {})
                ranks[name] = len(ranks)

        def allowed(up, kind, name, exposed):
            state = states.get((up.name, kind, name), usual)
            if state.usable:
                return True
            (self.disabled if not state.enabled else self.quarantined).add(exposed)
            if kind == "tool":
                self.withheld[(up.name, name)] = exposed
            return False

        for up in upstreams:
            offered = self.lists_of(up)
            for kind, items, routes in (("tool", self.tools, self.tool_routes),
                                        ("prompt", self.prompts, self.prompt_routes)):
                names = exposed_names(up.name, offered[kind], max_length, seniority.get((up.name, kind)))
                for name, definition in offered[kind].items():
                    exposed = names[name]
                    if not allowed(up, kind, name, exposed):
                        continue
                    entry = dict(definition)
                    entry["name"] = exposed
                    items.append(entry)
                    routes[exposed] = Route(up, name)
            for uri, definition in up.lists["resource"].items():
                exposed = uri if uri_count[uri] == 1 else qualify_uri(up.name, uri)
                if not allowed(up, "resource", uri, exposed):
                    continue
                entry = dict(definition)
                entry["uri"] = exposed
                self.resources.append(entry)
                self.resource_routes[exposed] = Route(up, uri)
                self.resource_routes.setdefault(uri, Route(up, uri))
                if exposed != uri:
                    self.qualified[(up.name, uri)] = exposed
            for text, definition in up.lists["template"].items():
                exposed = text if tpl_count[text] == 1 else qualify_uri(up.name, text)
                if not allowed(up, "template", text, exposed):
                    self.blocked_templates.append((template_regex(text), exposed))
                    continue
                entry = dict(definition)
                entry["uriTemplate"] = exposed
                self.templates.append(entry)
                self.template_routes.append(TemplateRoute(template_regex(text), up, text,
                                                          template_literal_length(text)))
                self.template_by_text[exposed] = Route(up, text)
                self.template_by_text.setdefault(text, Route(up, text))
        self.template_routes.sort(key=lambda route: -route.literal)  # stable: ties keep registration order
        self.base_tools, self.base_routes = self.tools, self.tool_routes  # before overrides (ProfileCatalogue)
        self.aliases: dict[str, str] = {}         # alias -> the exposed name it stands for
        self.overrides = overrides or {}           # (server, tool) -> the global Override applied here
        if overrides:
            self._override(overrides)
        self._shape_for_handshake()
        self._index: SearchIndex | None = None
        self._index_lock = threading.Lock()
        self._fingerprint: dict | None = None
        self._tool_json: tuple[dict, dict] = ({}, {})  # see tool_json

    def _override(self, overrides: dict) -> None:
        """Apply the global overrides: a tool is listed under its alias (both names route to it), with its new
        description, annotations and schema; one whose override no longer fits is held back (``held``)."""
        base = self.base_routes = dict(self.tool_routes)
        done = apply_overrides(self.tools, lambda name: (base[name].upstream.name, base[name].name), overrides,
                               set(base) | self.disabled | self.quarantined)
        self.tools, self.aliases, self.fixed, self.held = done.tools, done.aliases, done.fixed, done.held
        for name in done.held:
            self.tool_routes.pop(name, None)
        for alias, name in done.aliases.items():
            self.tool_routes[alias] = base[name]
        self._alias_withheld(overrides)

    def _alias_withheld(self, overrides: dict, sees=None) -> None:
        """A disabled or quarantined tool called by its alias gets the error its own name gets (``aliases`` says
        which name the user's command takes)."""
        for key, exposed in self.withheld.items():
            override = overrides.get(key)
            if override is not None and override.name and (sees is None or sees(key[0], exposed, override.name)):
                (self.disabled if exposed in self.disabled else self.quarantined).add(override.name)
                self.aliases.setdefault(override.name, exposed)

    def _shape_for_handshake(self) -> None:
        """What a handshake-era (2025) client accepts: an outputSchema rooted at an object.  A 2026-07-28 upstream
        may declare any schema; such a tool is listed with its schema wrapped as {"result": ...}, and its results'
        structuredContent is wrapped the same way (wrapped_outputs, by every name the tool is called by)."""
        self.wrapped_outputs: set[str] = set()
        self.handshake_tools = self.tools
        if any("outputSchema" in tool and not (isinstance(tool["outputSchema"], dict)
                                               and tool["outputSchema"].get("type") == "object")
               for tool in self.tools):
            self.handshake_tools = []
            for tool in self.tools:
                shaped, wrapped = shape_handshake_tool(tool)
                self.handshake_tools.append(shaped)
                if wrapped:
                    self.wrapped_outputs.add(tool["name"])
                    if tool["name"] in self.aliases:
                        self.wrapped_outputs.add(self.aliases[tool["name"]])

    @property
    def index(self) -> SearchIndex:
        """The search index, built by the first search rather than by every rebuild: a session that never
        searches never pays for it, and a catalogue change is announced without waiting for it."""
        if self._index is None:
            with self._index_lock:
                if self._index is None:
                    self._index = SearchIndex(self.tools)
        return self._index

    TOOL_JSON_MEMO = 1024  # definitions a catalogue keeps encoded; the memo is emptied when it is full

    def tool_json(self, tool: dict, handshake: bool) -> str:
        """``tool`` (one of ``tools``) as JSON, as a handshake-era client (``handshake``: shaped by
        shape_handshake_tool) or a 2026-07-28 one is shown it.  Searches return the same definitions again and
        again, so each is encoded once per catalogue.  The memo holds the tool itself beside its text, so the id
        it is kept under cannot be another object's while it is there.  Any thread may call it: an entry is a
        pure function of its key, and two threads encoding the same tool store the same text."""
        memo = self._tool_json[handshake]
        entry = memo.get(id(tool))
        if entry is not None and entry[0] is tool:
            return entry[1]
        text = dumps(shape_handshake_tool(tool)[0] if handshake else tool)
        if len(memo) >= self.TOOL_JSON_MEMO:
            memo.clear()
        memo[id(tool)] = (tool, text)
        return text

    @property
    def index_ready(self) -> bool:
        """Whether the search index is built (a search then costs little and needs no thread of its own)."""
        return self._index is not None

    def route_resource(self, uri: str) -> Route | None:
        """Where a URI the client wants to read or subscribe to goes, or None."""
        route = self.resource_routes.get(uri)
        if route:
            return route
        qualified = QUALIFIED_URI_RE.match(uri)
        server, original = qualified.groups() if qualified else (None, uri)
        for template in self.template_routes:
            if (server is None or template.upstream.name == server) and template.regex.match(original):
                return Route(template.upstream, original)
        return None

    def template_of(self, route: Route) -> str:
        """The template a templated read went through (logged instead of the URI, which carries call data)."""
        return next((t.template for t in self.template_routes if t.upstream is route.upstream and
                     t.regex.match(route.name)), "(template)")

    def exposed_uri(self, server: str, uri: str) -> str:
        return self.qualified.get((server, uri), uri)

    def fingerprint(self) -> dict:
        """What the client sees, per list; comparing two of these tells which list_changed to send.  Computed once
        (the hub and every profile's sessions compare it)."""
        if self._fingerprint is None:
            self._fingerprint = self._fingerprints()
        return self._fingerprint

    def _fingerprints(self) -> dict:
        return {key: sha256(dumps(items).encode("utf-8", "surrogatepass")).hexdigest()
                for key, items in (("tools", self.tools), ("prompts", self.prompts),
                                   ("resources", self.resources + self.templates))}
