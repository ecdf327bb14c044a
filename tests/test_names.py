"""Exposed names: ``<server>__<tool>``, shortened stably and readably when too long or illegal, never colliding,
never handed from one tool to another; and the server names the CLI accepts."""

import hashlib
import json
import re

import pytest

from coffer_src.errors import CofferError
from coffer_src.names import check_server_name, expose_name

from conftest import add_hostile, call_tool, cli, open_session, text_of, tool_names


def test_short_names_are_server_double_underscore_name():
    assert expose_name("time", "get_current_time") == "time__get_current_time"


def test_long_or_illegal_names_are_shortened_stably_readably_and_distinctly():
    long_name = "list_all_repository_collaborators_with_permissions_and_teams"
    exposed = expose_name("github", long_name)
    assert len(exposed) <= 48 and re.fullmatch(r"[a-zA-Z0-9_-]+", exposed)
    assert exposed.startswith("github__list_all_repository")
    assert exposed == expose_name("github", long_name)  # stable across runs
    other = expose_name("github", long_name + "_v2")
    assert other != exposed
    dotted = expose_name("aws", "s3.get_object")
    assert re.fullmatch(r"aws__s3_get_object_[0-9a-f]{6}", dotted)
    assert expose_name("aws", "s3_get_object") != dotted  # a legal twin keeps its plain name
    assert len(expose_name("x" * 24, "y" * 64, 34)) <= 34


@pytest.mark.parametrize("name", ["", "has space", "a__b", "x" * 25, "coffer", "COFFER", "tool/slash"])
def test_bad_server_names_are_refused(name):
    with pytest.raises(CofferError):
        check_server_name(name)


# -- names shortened by the gateway never collide ----------------------------------------------------------------------

def colliding_long_names():
    """Two long names whose SHA-256 share their first 24 bits, found by brute force (deterministic)."""
    prefix = "an_extremely_long_tool_name_that_a_gateway_must_shorten_number_"
    seen = {}
    for i in range(2_000_000):
        name = f"{prefix}{i}"
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        if digest in seen:
            return [seen[digest], name]
        seen[digest] = name
    raise AssertionError("no collision found")


def called_names(gw, server="h"):
    """exposed name -> the upstream tool it reaches (the fixture answers "called <name>"), from the server's live
    list: the echo call waits until it has started, so the remembered list of its last start is replaced."""
    assert text_of(call_tool(gw, f"{server}__echo", {"text": "up"})) == "up"
    mapping = {}
    for name in tool_names(gw.request("tools/list")):
        if name.startswith(f"{server}__") and name not in (f"{server}__echo", f"{server}__env", f"{server}__crash"):
            reply = call_tool(gw, name)
            mapping[name] = text_of(reply).removeprefix("called ") if "result" in reply else None
    return mapping


def test_shortened_names_never_collide_and_every_cli_target_is_what_the_client_sees(home, tmp_path,
                                                                                      watched_gateway):
    names_file = tmp_path / "names.json"
    pair = colliding_long_names()
    third = "another_extremely_long_tool_name_that_will_surely_be_shortened_too"
    names_file.write_text(json.dumps(pair + [third]))
    add_hostile("h", "collide", extra=("--names-file", str(names_file)))
    add_hostile("good")
    gw = open_session(watched_gateway)
    seen = called_names(gw)
    assert sorted(seen.values()) == sorted(pair + [third]), seen
    shortened_third = next(exposed for exposed, original in seen.items() if original == third)
    gw.close()

    # an upstream tool literally named like another's shortened form must not hide it either
    literal = shortened_third.removeprefix("h__")
    names_file.write_text(json.dumps(pair + [third, literal]))
    gw = open_session(watched_gateway)
    seen = called_names(gw)
    assert sorted(seen.values()) == sorted(pair + [third, literal]), seen
    assert len(seen) == 4
    gw.close()

    # `coffer disable X` disables exactly the tool the client sees as X
    victim = next(exposed for exposed, original in seen.items() if original == literal)
    cli("disable", victim)
    gw = open_session(watched_gateway)
    after = called_names(gw)
    assert sorted(after.values()) == sorted(pair + [third]), after
    refused = call_tool(gw, victim)
    assert "error" in refused and "disabled" in refused["error"]["message"], refused


def test_a_new_tool_never_takes_over_an_exposed_name_already_given_to_another(home, tmp_path, watched_gateway):
    """A client (and the agent's memory) holds the names it was shown.  When an upstream later adds a tool whose
    literal name equals another tool's shortened name, the established name must keep reaching the established
    tool; the newcomer is the one that gets a longer name.  Otherwise a call made under the old name - even one
    routed from the remembered list while the server starts - silently runs a different tool."""
    names_file = tmp_path / "names.json"
    third = "another_extremely_long_tool_name_that_will_surely_be_shortened_too"
    names_file.write_text(json.dumps([third]))
    add_hostile("h", "collide", extra=("--names-file", str(names_file)))
    gw = open_session(watched_gateway)
    established = next(exposed for exposed, original in called_names(gw).items() if original == third)
    gw.close()
    names_file.write_text(json.dumps([third, established.removeprefix("h__")]))
    gw = open_session(watched_gateway)
    reply = call_tool(gw, established)  # routed once h has started and listed the newcomer
    assert text_of(reply) == f"called {third}", f"{established} now reaches another tool: {reply}"
    seen = called_names(gw)
    assert sorted(seen.values()) == sorted([third, established.removeprefix("h__")]), seen  # neither is hidden
    assert seen[established] == third, f"{established} reached {third} at first, now {seen[established]}"
