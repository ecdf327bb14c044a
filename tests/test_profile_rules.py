"""Profiles and overrides (issue 24), the rules themselves: schema checks of fixed values, what a profile sees,
how overrides change a catalogue and its routes, which list changes a profiled session is told of.  Unit tests of
the development package; the end-to-end behaviour is in test_profiles.py."""

import json
import time
from types import SimpleNamespace

import pytest

from coffer_src.catalogue import Catalogue
from coffer_src.errors import CofferError
from coffer_src.gateway.view import ProfileCatalogue, SessionView, Views
from coffer_src.profiles import (
    Override,
    Profile,
    ProfileStore,
    apply_overrides,
    check_alias,
    new_profile,
    override_problem,
    parse_annotation,
    parse_fixed,
    schema_problem,
)
from coffer_src.search.semantic import SemanticRanker
from coffer_src.vault import CapabilityState, Vault

ECHO = {"name": "echo", "description": "Echo", "inputSchema": {
    "type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
    "required": ["text"]}}
CLOCK = {"name": "now", "description": "The time", "inputSchema": {
    "type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "Asia/Tokyo"]}}}}


def upstream(name, tools=(), prompts=(), resources=()):
    lists = {"tool": {t["name"]: t for t in tools}, "prompt": {p["name"]: p for p in prompts},
             "resource": {r["uri"]: r for r in resources}, "template": {}}
    return SimpleNamespace(name=name, lists=lists, ready_at=1.0, remembered={})


def catalogue(overrides=None, states=None):
    ups = [upstream("a", [ECHO, {"name": "crash", "inputSchema": {"type": "object"}}],
                    prompts=[{"name": "greet"}], resources=[{"uri": "file:///a/readme.md", "name": "readme"}]),
           upstream("time", [CLOCK])]
    return Catalogue(ups, states or {}, 48, overrides)


@pytest.mark.parametrize(("value", "schema", "problem"), [
    ("x", {"type": "string"}, None),
    (3, {"type": "string"}, "p must be string, not integer"),
    (True, {"type": "integer"}, "p must be integer, not boolean"),
    (2.0, {"type": "integer"}, None),
    (0, {"type": "integer", "minimum": 1}, "p must be min 1"),
    ("Mars", {"enum": ["UTC", "Asia/Tokyo"]}, 'p must be one of "UTC", "Asia/Tokyo"'),
    (1, {"const": True}, "p must be true"),
    ("ab", {"type": "string", "pattern": "^a+$"}, "p must match ^a+$"),
    ([1, "x"], {"type": "array", "items": {"type": "integer"}}, "p[1] must be integer, not string"),
    ({"owner": 1}, {"type": "object", "properties": {"owner": {"type": "string"}}}, "p.owner must be string"),
    ({}, {"type": "object", "required": ["owner"]}, "p.owner is required"),
    ({"x": 1}, {"type": "object", "additionalProperties": False}, "p.x is not a property it takes"),
    (None, {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("x", {"$ref": "#/defs/unknown"}, None),  # what it cannot judge, the upstream judges
])
def test_fixed_values_are_checked_against_the_parameter_schema(value, schema, problem):
    found = schema_problem(value, schema, "p")
    assert (found is None) if problem is None else (found is not None and found.startswith(problem)), found


def test_command_line_values():
    assert parse_fixed('owner="my-org"') == ("owner", "my-org")
    assert parse_fixed("owner=my-org") == ("owner", "my-org")  # a bare word is a string
    assert parse_fixed("limit=5") == ("limit", 5) and parse_fixed("flags=[1, true]") == ("flags", [1, True])
    for bad in ("owner", "=1", "x={oops", "x= padded"):
        with pytest.raises(CofferError):
            parse_fixed(bad)
    assert parse_annotation("read-only=true") == ("readOnlyHint", True)
    assert parse_annotation("destructiveHint=false") == ("destructiveHint", False)
    assert parse_annotation("openWorld=") == ("openWorldHint", None)
    with pytest.raises(CofferError):
        parse_annotation("readOnly=yes")
    assert check_alias("clock", "time", 48) == "clock" and check_alias("time__clock", "time", 48)
    for alias in ("a__clock", "coffer__search_tools", "has space", "x" * 49, ""):
        with pytest.raises(CofferError):
            check_alias(alias, "time", 48)
    with pytest.raises(CofferError, match="at least one --include"):
        new_profile("p", [])
    with pytest.raises(CofferError, match="invalid profile name"):
        new_profile("-p", ["a"])


def test_an_exclude_wins_over_an_alias_and_an_include():
    profile = Profile("p", include=("a", "clock"), exclude=("a__crash", "time__*"))
    assert profile.sees("a", "a__echo")
    assert not profile.sees("a", "a__crash", "harmless")  # an alias cannot sneak an excluded tool back in
    assert not profile.sees("time", "time__now", "clock")
    assert not Profile("empty").sees("a", "a__echo")  # a profile that does not parse (or exists) sees nothing


def test_global_overrides_rename_redescribe_fix_and_hold_back_in_the_catalogue():
    overrides = {("a", "echo"): Override("a", "echo", name="say", description="Say it", fixed={"text": "hi"},
                                         annotations={"readOnlyHint": True}),
                 ("time", "now"): Override("time", "now", fixed={"timezone": "Mars"})}
    plain, changed = catalogue(), catalogue(overrides)
    assert [t["name"] for t in plain.tools] == ["a__echo", "a__crash", "time__now"]
    assert [t["name"] for t in changed.tools] == ["say", "a__crash"]
    say = changed.tools[0]
    assert say["description"] == "Say it" and say["annotations"] == {"readOnlyHint": True}
    assert say["inputSchema"] == {"type": "object", "properties": {"times": {"type": "integer", "minimum": 1}}}
    assert ECHO["inputSchema"]["required"] == ["text"]  # the upstream's definition is never changed in place
    assert changed.tool_routes["say"] == changed.tool_routes["a__echo"] == plain.tool_routes["a__echo"]
    assert "time__now" not in changed.tool_routes and "timezone must be one of" in changed.held["time__now"]
    assert "held back" in changed.refusal("time__now", "tool")
    params, refused = changed.with_fixed("say", {"name": "say", "arguments": {"times": 2}})
    assert refused is None and params["arguments"] == {"times": 2, "text": "hi"}
    assert changed.with_fixed("a__echo", {"arguments": {}})[0]["arguments"] == {"text": "hi"}
    _, refused = changed.with_fixed("say", {"arguments": {"text": "mine"}})
    assert "'text'" in refused and "fixed by the user" in refused
    assert plain.fingerprint() != changed.fingerprint()
    assert catalogue().fingerprint() == plain.fingerprint()  # no override: the very same catalogue


def test_an_alias_never_takes_a_name_already_given():
    taken = Override("a", "echo", name="time__now")
    done = apply_overrides([dict(ECHO, name="a__echo"), dict(CLOCK, name="time__now")],
                           lambda n: ("a", "echo") if n == "a__echo" else ("time", "now"), {("a", "echo"): taken},
                           {"a__echo", "time__now"})
    assert [t["name"] for t in done.tools] == ["a__echo", "time__now"] and "taken" in done.notes["a__echo"]


def test_a_disabled_or_quarantined_tool_called_by_its_alias_gets_its_own_error():
    overrides = {("a", "echo"): Override("a", "echo", name="say")}
    held = catalogue(overrides, {("a", "tool", "echo"): CapabilityState(True, quarantined=True)})
    assert "say" in held.quarantined and held.aliases["say"] == "a__echo" and "say" not in held.tool_routes


def test_a_profile_view_filters_lists_routes_and_search_and_names_itself_in_refusals():
    parent = catalogue({("a", "echo"): Override("a", "echo", name="say")})
    profile = Profile("coding", include=("a",), exclude=("a__crash",))
    own = {("a", "echo"): Override("a", "echo", "coding", description="Repeat").over(Override("a", "echo", name="say"))}
    view = ProfileCatalogue(parent, profile, own)
    assert [t["name"] for t in view.tools] == ["say"] and view.tools[0]["description"] == "Repeat"
    assert [p["name"] for p in view.prompts] == ["a__greet"] and [r["uri"] for r in view.resources] == [
        "file:///a/readme.md"]
    assert set(view.tool_routes) == {"say", "a__echo"} and len(view.index) == 1
    assert view.servers == {"a"}  # what time says in passing (its log messages) is not for this client
    assert "profile 'coding'" in view.refusal("time__now", "tool")
    assert "profile 'coding'" in view.refusal("a__crash", "tool")
    assert view.refusal("no__such", "tool") is None  # unknown stays unknown
    narrower = ProfileCatalogue(parent, Profile("coding", include=("a",), exclude=("a__*",)), own)
    assert narrower.tools == [] and narrower.fingerprint()["tools"] != view.fingerprint()["tools"]


def test_a_profiled_session_hears_of_its_own_changes_only():
    hub = SimpleNamespace(catalogue=catalogue(), views=Views(), knowledge_tools=[], settings={"expose": "all"})
    hub.views.profiles = {"research": Profile("research", include=("time",))}
    view = SessionView(hub, "research")
    assert [t["name"] for t in view.catalogue.tools] == ["time__now"]
    assert view.sees_server("time") and not view.sees_server("a") and SessionView(hub).sees_server("a")
    hub.catalogue = catalogue({("a", "echo"): Override("a", "echo", description="changed outside")})
    assert view.changed(["tools"]) == []  # a change outside the profile: not this client's business
    hub.catalogue = catalogue({("time", "now"): Override("time", "now", description="changed inside")})
    assert view.changed(["tools"]) == ["tools"]
    assert view.changed(["tools"]) == ["tools"]  # announced without a change (a restarted server): passed on
    hub.views.profiles = {"research": Profile("research", include=("time",), expose="search")}
    hub.views._views = {}
    assert view.changed([]) == ["tools"]  # the profile's own settings changed what it lists
    assert SessionView(hub).changed(["prompts"]) == ["prompts"]  # no profile: the hub's word


def test_a_damaged_override_holds_its_tool_back(tmp_path):
    vault = Vault(str(tmp_path / "home"))
    with vault.transaction() as db:
        db.execute("INSERT INTO overrides(profile, server, tool, override, updated_at) VALUES ('', 'a', 'echo', "
                   "'{not json', 'now')")
    overrides = {o.key: o for o in ProfileStore(vault).overrides()}
    assert overrides[("a", "echo")].damaged
    held = catalogue(overrides)
    assert "a__echo" not in held.tool_routes and "damaged" in held.held["a__echo"]
    assert override_problem(overrides[("a", "echo")], ECHO).startswith("its override in coffer.db is damaged")
    assert json.loads(json.dumps(Override("a", "echo", name="x").definition())) == {"name": "x"}
    vault.close()


def test_a_profile_view_is_ranked_with_the_vectors_its_tools_already_have(tmp_path):
    """Hybrid search inside a profile uses the catalogue's embedded vectors; a tool the profile redescribes has
    none yet, and its search says it answered with BM25 alone."""
    class Words:
        cache_key = "words-test"

        def embed(self, texts, timeout):
            vectors = []
            for text in texts:
                vector = [0.0] * 32
                for word in text.lower().split():
                    vector[sum(word.encode()) % 32] += 1.0
                vectors.append(vector)
            return vectors

    vault = Vault(str(tmp_path / "home"))
    ranker = SemanticRanker(Words(), vault.path, 1.0)
    try:
        parent = catalogue()
        ranker.refresh(parent.tools)
        deadline = time.monotonic() + 30
        while ranker.index is None and time.monotonic() < deadline:
            time.sleep(0.02)
        view = ProfileCatalogue(parent, Profile("p", include=("time",)), {})
        hits, ranker_used, note = ranker.search(view.index, "what time is it", 3)
        assert ranker_used == "hybrid" and [tool["name"] for tool, _ in hits] == ["time__now"] and note is None
        redescribed = ProfileCatalogue(parent, Profile("p", include=("time",)),
                                       {("time", "now"): Override("time", "now", "p", description="Clock reading")})
        hits, ranker_used, note = ranker.search(redescribed.index, "clock reading", 3)
        assert ranker_used == "bm25" and [tool["name"] for tool, _ in hits] == ["time__now"] and note
    finally:
        ranker.close()
        vault.close()
