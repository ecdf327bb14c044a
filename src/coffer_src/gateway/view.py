"""Gateway view: a session's part of the catalogue: all of it, or its profile's.

A session without a profile sees the hub's Catalogue (global overrides applied).  A session with one sees a
``ProfileCatalogue``: the same surface (lists, routes, search index, fingerprint), made from the hub's catalogue
by the profile's filter and with the profile's own overrides over the global ones.  One is built per profile
when a session first needs it after the catalogue or the profiles changed, and shared by that profile's
sessions (``Views``, owned by the hub).  A name the catalogue knows but the profile leaves out is refused with
an error naming the profile, never reported as unknown.
"""

from __future__ import annotations

import threading

from coffer_src.catalogue import Catalogue
from coffer_src.digests import sha256
from coffer_src.gateway.builtins import expose_mode
from coffer_src.names import ASK_TOOL, REMEMBER_TOOL, SEPARATOR
from coffer_src.profiles import Profile, ProfileStore, apply_overrides


class ProfileCatalogue(Catalogue):
    """A profile's view of a catalogue: what the profile includes, with its overrides (its own over the global
    ones, applied to the upstreams' definitions again, so a profile can change what a global override set).
    Immutable like the catalogue it was made from (``parent``)."""

    def __init__(self, parent: Catalogue, profile: Profile, overrides: dict):
        self.parent, self.profile, self.overrides = parent, profile, overrides
        sees = profile.sees
        base = self.base_routes = parent.base_routes
        done = apply_overrides(parent.base_tools,
                               lambda name: (base[name].upstream.name, base[name].name) if name in base else None,
                               overrides, set(base) | parent.disabled | parent.quarantined, sees)
        self.tools, self.aliases, self.fixed, self.held = done.tools, done.aliases, done.fixed, done.held
        self.tool_routes = {}
        for tool in self.tools:
            name = done.aliases.get(tool["name"], tool["name"])
            self.tool_routes[tool["name"]] = self.tool_routes[name] = base[name]
        self.prompts = [p for p in parent.prompts if sees(parent.prompt_routes[p["name"]].upstream.name, p["name"])]
        self.prompt_routes = {p["name"]: parent.prompt_routes[p["name"]] for p in self.prompts}
        self.resource_routes = {uri: route for uri, route in parent.resource_routes.items()
                                if sees(route.upstream.name, uri, route.name)}
        self.resources = [r for r in parent.resources if r["uri"] in self.resource_routes]
        self.template_by_text = {text: route for text, route in parent.template_by_text.items()
                                 if sees(route.upstream.name, text, route.name)}
        self.templates = [t for t in parent.templates if t["uriTemplate"] in self.template_by_text]
        self.template_routes = [t for t in parent.template_routes if sees(t.upstream.name, t.template)]
        # What is disabled or held back inside the profile keeps its own error; outside it, the profile's.
        prefix = lambda name: name.partition(SEPARATOR)[0] if SEPARATOR in name else None  # noqa: E731
        self.disabled = {name for name in parent.disabled if sees(prefix(name), name)}
        self.quarantined = {name for name in parent.quarantined if sees(prefix(name), name)}
        self.withheld = parent.withheld
        self._alias_withheld(overrides, sees)
        self.blocked_templates = [(regex, text) for regex, text in parent.blocked_templates if sees(text)]
        self.qualified = parent.qualified
        self.servers = frozenset(route.upstream.name for routes in (self.tool_routes, self.prompt_routes,
                                                                    self.resource_routes, self.template_by_text)
                                 for route in routes.values())
        self._shape_for_handshake()
        self._index = None
        self._index_lock = threading.Lock()
        self._fingerprint = None
        self._tool_json = ({}, {})

    def _fingerprints(self) -> dict:
        """The lists' fingerprints, the tools' also covering the profile's own settings (expose, pins, knowledge):
        a change to them changes what its clients are listed."""
        lists = super()._fingerprints()
        lists["tools"] = sha256(f"{lists['tools']}:{self.profile.digest}".encode()).hexdigest()
        return lists

    def refusal(self, name: str, kind: str) -> str | None:
        """Held back by an override, or known to Coffer but outside this profile: the error says which."""
        held = super().refusal(name, kind)
        if held is not None:
            return held
        parent = self.parent
        if kind == "tool":
            known = name in parent.base_routes or name in parent.tool_routes or name in (ASK_TOOL, REMEMBER_TOOL)
        elif kind == "prompt":
            known = name in parent.prompt_routes
        else:
            known = parent.route_resource(name) is not None
        if not (known or name in parent.disabled or name in parent.quarantined):
            return None
        return (f"{kind} {name!r} is not in this client's Coffer profile {self.profile.name!r}; the user decides "
                f"what a profile includes (`coffer profile show {self.profile.name}`)")


class Views:
    """The profiles and overrides the hub serves (loaded from the vault at start and whenever it changes), and
    each profile's view of the current catalogue.  ``lock`` is a leaf: a view is built under it (from immutable
    snapshots only), so two sessions of one profile never build the same view twice."""

    def __init__(self):
        self.profiles: dict[str, Profile] = {}
        self.global_overrides: dict = {}                  # (server, tool) -> Override, for every client
        self._profile_overrides: dict[str, dict] = {}     # profile -> (server, tool) -> its own Override
        self._loaded = None
        self._views: dict[str, ProfileCatalogue] = {}
        self.lock = threading.Lock()

    def load(self, store: ProfileStore) -> tuple[bool, bool]:
        """Read the profiles and overrides (the caller holds the vault's lock): (whether the global overrides
        changed -- the catalogue must be rebuilt --, whether anything changed -- profiled sessions must look)."""
        profiles, overrides = store.profiles(), store.overrides()
        if (profiles, overrides) == self._loaded:
            return False, False
        global_overrides = {o.key: o for o in overrides if o.profile is None}
        own: dict[str, dict] = {}
        for override in overrides:
            if override.profile is not None:
                own.setdefault(override.profile, {})[override.key] = override
        changed = global_overrides != self.global_overrides
        with self.lock:
            self._loaded = (profiles, overrides)
            self.profiles, self.global_overrides, self._profile_overrides = profiles, global_overrides, own
            self._views = {}
        return changed, True

    def catalogue(self, name: str, parent: Catalogue) -> ProfileCatalogue:
        """Profile ``name``'s view of ``parent``: the profile's own overrides over the global ones ``parent`` was
        built with (so a view always agrees with its catalogue); a profile that does not exist sees nothing."""
        with self.lock:
            view = self._views.get(name)
            if view is None or view.parent is not parent:
                overrides = dict(parent.overrides)
                for key, override in self._profile_overrides.get(name, {}).items():
                    overrides[key] = override.over(parent.overrides.get(key))
                view = ProfileCatalogue(parent, self.profiles.get(name) or Profile(name), overrides)
                self._views[name] = view
            return view


class SessionView:
    """What one client session sees: the hub's catalogue, or (with ``name``, a profile) that profile's view; also
    the profile's knowledge tools, expose mode and pins.  ``changed`` is called under the hub's rebuild lock only."""

    def __init__(self, hub, name: str | None = None):
        self.hub = hub
        self.name = name
        self._seen = self._fingerprints() if name is not None else None

    @property
    def catalogue(self) -> Catalogue:
        hub = self.hub
        return hub.catalogue if self.name is None else hub.views.catalogue(self.name, hub.catalogue)

    @property
    def profile(self) -> Profile | None:
        return None if self.name is None else self.hub.views.profiles.get(self.name) or Profile(self.name)

    @property
    def knowledge_tools(self) -> list[dict]:
        """coffer__ask with a profile that names knowledge sources; coffer__remember when they include memory."""
        tools, profile = self.hub.knowledge_tools, self.profile
        return tools if profile is None else profile.knowledge_tools(tools)

    def expose_mode(self, family: str | None) -> str:
        """The profile's expose, else the client's own or the global setting (builtins.expose_mode)."""
        profile = self.profile
        if profile is not None and profile.expose:
            return expose_mode({"expose": profile.expose}, family)
        return expose_mode(self.hub.settings, family)

    def pinned(self, listed: list[dict], tools: list[dict]) -> list[dict]:
        """``listed`` (what expose chose of ``tools``) plus the profile's pinned tools, in catalogue order."""
        profile = self.profile
        if profile is None or not profile.pin or listed is tools:
            return listed
        aliases = self.catalogue.aliases
        pins = set(profile.pin)
        have = {id(tool) for tool in listed}
        return [tool for tool in tools if id(tool) in have or tool["name"] in pins
                or aliases.get(tool["name"]) in pins]

    def note(self) -> str:
        """What the client's model reads of its profile in the instructions (so it does not hunt for tools the
        user left out on purpose)."""
        if self.name is None:
            return ""
        if self.name not in self.hub.views.profiles:
            return f" Coffer profile {self.name} does not exist (any more): no tools are listed."
        return f" This client uses Coffer profile {self.name}: it sees the tools the user chose for it, no others."

    def sees_server(self, name: str) -> bool:
        """Whether this client sees anything of server ``name`` (what the server says in passing -- its log
        messages, say -- is for the clients that do)."""
        return self.name is None or name in self.catalogue.servers

    def ask_sources(self, sources):
        """The knowledge sources a coffer__ask may search (CofferError for one outside the profile)."""
        profile = self.profile
        return sources if profile is None else profile.knowledge_sources(sources)

    def _fingerprints(self) -> tuple[dict, dict]:
        return self.hub.catalogue.fingerprint(), self.catalogue.fingerprint()

    def changed(self, keys: list[str]) -> list[str]:
        """Which list_changed a rebuild (or a profile change) means for this session: without a profile, the hub's
        ``keys``; with one, the lists its view changed, and what the hub announced without a change (a restarted
        server), but not a change outside the profile."""
        if self.name is None:
            return keys
        before, now = self._seen, self._fingerprints()
        self._seen = now
        return [key for key in ("tools", "prompts", "resources")
                if now[1][key] != before[1][key] or (key in keys and now[0][key] == before[0][key])]
