"""A ranker that learns from its user (issue 27), the optional part: with search_feedback on, the tools this user
picked for similar searches are lifted, by a bounded, smoothed factor, among the ranker's own candidates; the
explanation shows it; `coffer config search_preference off` turns it off; with no labelled search nothing changes."""

import json
import os
import sqlite3
import time
from pathlib import Path

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from search_catalogues import merged

from coffer_src.search.feedback import LabelledSearch, evaluate_feedback, feedback_recorder
from coffer_src.search.index import SearchIndex
from coffer_src.search.preference import (
    PREFERENCE_CAP,
    SearchPreference,
    active_preference,
    explain_preferred,
    learnt_from,
    preferred_search,
    search_preference,
)
from coffer_src.vault import Vault, utcnow

from conftest import COFFER, FAKE, PY, cli

CATALOGUE = merged()
INDEX = SearchIndex(CATALOGUE)


def names(hits):
    return [tool["name"] for tool, _ in hits]


def test_with_no_labelled_search_every_ranking_is_the_rankers_own():
    assert len(CATALOGUE) >= 200
    queries = [tool["description"] for tool in CATALOGUE] + ["create an issue", "send an email to my boss", "hi"]
    empty = SearchPreference()
    unrelated = learnt_from([("play some jazz music", "spotify__play")] * 3)  # similar to none of the queries
    for query in queries:
        ranked = INDEX.search(query, 10)
        assert preferred_search(INDEX, None, query, 10, None) == (ranked, "bm25", None, {})
        assert preferred_search(INDEX, None, query, 10, empty) == (ranked, "bm25", None, {})
        if "music" not in query.lower() and "play" not in query.lower():
            assert preferred_search(INDEX, None, query, 10, unrelated)[0] == ranked, query


def test_off_unless_search_feedback_and_search_preference_are_on(home):
    vault = Vault(home)
    try:
        path = vault.path
        assert active_preference(vault.settings(), path) is None                  # search_feedback is off by default
        on = {**vault.settings(), "search_feedback": "on"}
        assert on["search_preference"] == "on" and active_preference(on, path) is not None
        assert active_preference({**on, "search_preference": "off"}, path) is None
    finally:
        vault.close()


def test_what_the_feedbacks_retention_prunes_is_forgotten_too(home):
    vault = Vault(home)
    try:
        settings = {**vault.settings(), "search_feedback": "on", "retention_invocations_days": 30}
        preference = active_preference(settings, vault.path)
        preference.learn("create an issue", "github__create_issue", when=time.time() - 31 * 86400)
        preference.learn("create a new issue", "github__create_issue")
        assert active_preference(settings, vault.path) is preference and len(preference) == 1
    finally:
        vault.close()


def test_a_repeated_pick_lifts_that_tool_for_a_similar_request_and_not_for_an_unrelated_one():
    assert names(INDEX.search("create an issue", 5))[:2] == ["jira__jira_create_issue", "github__create_issue"]
    preference = learnt_from([("create an issue", "github__create_issue"),
                              ("create a new issue", "github__create_issue"),
                              ("create an issue please", "github__create_issue")])
    hits, ranker, _, lifts = preferred_search(INDEX, None, "please create an issue", 5, preference)
    assert names(hits)[0] == "github__create_issue" and ranker == "bm25"
    assert set(lifts) == {"github__create_issue"} and lifts["github__create_issue"].picks == 3
    assert 1.0 < lifts["github__create_issue"].factor < PREFERENCE_CAP
    lift = lifts["github__create_issue"]
    assert {tool["name"]: score for tool, score in hits}["github__create_issue"] == round(lift.base * lift.factor, 4)
    for unrelated in ("send an email to my boss", "read the file", "what's the weather tomorrow"):
        assert preferred_search(INDEX, None, unrelated, 5, preference) == (INDEX.search(unrelated, 5), "bm25", None,
                                                                          {})


def test_one_pick_lifts_less_than_several_and_disagreeing_picks_less_again():
    one = learnt_from([("create an issue", "github__create_issue")]).lifts("create an issue")
    three = learnt_from([("create an issue", "github__create_issue")] * 3).lifts("create an issue")
    split = learnt_from([("create an issue", "github__create_issue")] * 3
                        + [("create an issue", "jira__jira_create_issue")] * 3).lifts("create an issue")
    assert 1.0 < one["github__create_issue"][0] < three["github__create_issue"][0] < PREFERENCE_CAP
    assert split["github__create_issue"][0] < three["github__create_issue"][0]


def test_the_lift_is_bounded_a_clearly_better_tool_stays_ahead_however_often_another_was_picked():
    query = "send an email to my boss"
    ranked = INDEX.search(query, 10)
    scores = {tool["name"]: score for tool, score in ranked}
    assert scores["gmail__send_email"] > PREFERENCE_CAP * scores["gmail__draft_email"]
    preference = learnt_from([(query, "gmail__draft_email")] * 500)
    hits, _, _, lifts = preferred_search(INDEX, None, query, 10, preference)
    assert names(hits)[0] == "gmail__send_email"
    assert names(hits).index("gmail__draft_email") < names(ranked).index("gmail__draft_email")  # it did move up
    assert lifts["gmail__draft_email"].factor < PREFERENCE_CAP


def test_it_only_reorders_the_rankers_candidates_and_leaves_coffers_own_and_gone_tools_alone():
    query = "create an issue"
    ranked = INDEX.search(query, 20)
    assert "weather__get_forecast" not in [INDEX.tools[doc]["name"] for doc, _ in INDEX.rank(query, 50)]
    picks = [(query, "weather__get_forecast"), (query, "gone__tool"), (query, "coffer__ask")] * 5
    assert preferred_search(INDEX, None, query, 10, learnt_from(picks))[0] == INDEX.search(query, 10)
    far = names(ranked)[-1]      # the 20th: past the 5 candidates this preference may move
    assert preferred_search(INDEX, None, query, 20, learnt_from([(query, far)] * 5, candidates=5))[0] == ranked
    assert names(preferred_search(INDEX, None, query, 20, learnt_from([(query, far)] * 5))[0]).index(far) < 19
    own = SearchIndex([*CATALOGUE, {"name": "coffer__ask", "description": "Create an issue",
                                    "inputSchema": {"type": "object"}}])
    assert "coffer__ask" in names(own.search(query, 20))
    assert preferred_search(own, None, query, 20, learnt_from(picks))[0] == own.search(query, 20)


def test_the_explanation_shows_the_preference_and_agrees_with_the_ranking():
    preference = learnt_from([("create an issue", "github__create_issue")] * 3)
    query = "please create an issue"
    explained = explain_preferred(INDEX, None, query, 5, preference)
    hits = preferred_search(INDEX, None, query, 5, preference)[0]
    assert [(r["name"], r["score"]) for r in explained["results"]] == [(t["name"], s) for t, s in hits]
    first = explained["results"][0]
    assert first["name"] == "github__create_issue" and first["exact"]
    shown = [m for m in first["matches"] if m["kind"] == "preference"]
    assert len(shown) == 1 and shown[0]["how"].startswith("picked by you for 3 similar searches: ×1.")
    assert abs(first["preference"]["ranker_score"] + shown[0]["points"] - first["score"]) < 1e-3
    assert all("preference" not in r and r["exact"] for r in explained["results"][1:])
    plain = explain_preferred(INDEX, None, query, 5, None)
    assert plain == explain_preferred(INDEX, None, query, 5, SearchPreference())
    assert plain["results"][0]["name"] == "jira__jira_create_issue"


def test_the_model_is_bounded_and_learns_a_recorded_label_once():
    preference = SearchPreference(memory=3)
    for number in range(5):
        preference.learn(f"query {number} about issues", "github__create_issue", key=f"k{number}")
    preference.learn("query 4 about issues", "github__create_issue", key="k4")
    assert len(preference) == 3


def test_coffer_eval_replays_the_preference_from_earlier_searches_only():
    tools = CATALOGUE
    searches = [LabelledSearch("t", "create an issue", [], "github__create_issue"),
                LabelledSearch("t", "create a new issue", [], "github__create_issue"),
                LabelledSearch("t", "create an issue please", [], "github__create_issue")]
    report = evaluate_feedback(tools, searches, preference=SearchPreference)
    lexical, preferred = report["rankers"]["lexical"], report["rankers"]["lexical+preference"]
    assert lexical["recall@1"] == 0.0                    # the ranker alone puts jira's first every time
    assert abs(preferred["recall@1"] - 2 / 3) < 1e-9     # the first search had nothing before it to learn from
    assert evaluate_feedback(tools, searches[:1], preference=SearchPreference)["rankers"][
        "lexical+preference"]["recall@1"] == 0.0        # never from itself


def test_the_model_is_read_once_from_the_vault_and_taught_by_the_recorder(home):
    vault = Vault(home)
    try:
        with vault.transaction() as db:
            db.executemany("INSERT INTO search_feedback(key, ts, query, ranker, returned, chosen) "
                           "VALUES (?, ?, ?, 'bm25', '[]', ?)",
                           [("a", utcnow(), "create an issue", "github__create_issue"),
                            ("b", utcnow(), "unlabelled", None)])
        preference = search_preference(vault.path)
        assert len(preference) == 1 and search_preference(vault.path) is preference
        recorder = feedback_recorder(vault.path)
        session = type("Session", (), {})()
        recorder.searched(session, "agent", "create a new issue", "bm25", [])
        recorder.called(session, "github__create_issue")
        assert len(preference) == 2
        assert preference.lifts("create an issue")["github__create_issue"][1] == 2
    finally:
        vault.close()


def test_a_real_sdk_client_s_picks_change_a_later_searchs_order_until_turned_off(home):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,fail,big")
    cli("config", "search_feedback", "on")
    query = "give me text back as a result"

    async def session(picks: int) -> list[list[str]]:
        orders = []
        server = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
        async with Client(server, client_info=types.Implementation(name="preference-agent", version="1")) as client:
            for _ in range(picks + 1):
                found = await client.call_tool("coffer__search_tools", {"query": query})
                orders.append([tool["name"] for tool in found.structured_content["tools"]])
                if len(orders) <= picks:
                    called = await client.call_tool("fx__big", {"mb": 0})
                    assert not called.is_error
        return orders

    first = anyio.run(session, 1)
    assert first[0][:2] == ["fx__echo", "fx__big"]            # the ranker's own order
    assert first[1][0] == "fx__big"                           # after the user picked big for it, in the same process
    assert anyio.run(session, 0)[0][0] == "fx__big"           # a new process reads it from the vault
    db = sqlite3.connect(Path(home) / "coffer.db")
    assert [row[0] for row in db.execute("SELECT chosen FROM search_feedback ORDER BY id")] == ["fx__big", None, None]
    db.close()
    report = json.loads(cli("eval", "--json").stdout)
    assert report["rankers"]["lexical+preference"]["recall@1"] == 0.0 and report["search_preference"] == "on"
    cli("config", "search_preference", "off")
    assert anyio.run(session, 0)[0][:2] == ["fx__echo", "fx__big"]
