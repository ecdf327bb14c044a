"""The page in a real browser: headless Chromium driven by Selenium against a real service, with real agents (the
MCP SDK over `coffer serve`) connected while the page changes things.  Every view loads with no console error and
is screenshotted (into the test's tmp folder, and into $COFFER_WEB_SCREENSHOTS when set: the README's come from
there); a tool disabled on the page reaches a connected agent as list_changed; a changed definition is shown with
its diff and approved; the activity chart's points are the log's; the search playground ranks as the agent's
coffer__search_tools does, with an embedder and without; a knowledge folder is added, reindexed and removed; the
first paint at 10,000 tools is measured and printed."""

import json
import os
import shutil
import time
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from test_semantic import Stub
from web_helpers import (
    SCREENSHOTS_ENV,
    fake_browser,
    require_browser,
    scratch_profile,
    start_chromium,
    ten_thousand_tools,
)

from conftest import COFFER, FAKE, PY, cli, stop_service, wait_until

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the service tests use POSIX process control")

VIEWS = ("servers", "catalogue", "changes", "activity", "search", "knowledge", "sessions")


@pytest.fixture(scope="module")
def chromium():
    require_browser()
    profile = scratch_profile()
    driver = start_chromium(profile)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(chromium):
    chromium.get_log("browser")   # start each test with an empty console
    yield chromium
    chromium.get("about:blank")


@pytest.fixture
def web_home(home, monkeypatch):
    monkeypatch.setenv("COFFER_SERVE_MODE", "service")
    home.mkdir(parents=True, exist_ok=True)
    yield home
    stop_service(home)


def sign_in(browser, tmp_path, fragment="servers"):
    """`coffer open` with a browser: it is handed the one-time link; the browser follows it and lands signed in."""
    env, opened = fake_browser(tmp_path)
    proc = cli("open", env=env, timeout=60)
    assert proc.stdout == "", "with a browser, nothing is printed on stdout"
    link = opened.read_text().split()[-1]
    browser.get(link)
    origin = link.split("/login")[0]
    wait(browser, lambda d: d.current_url.startswith(origin + "/") and "/login" not in d.current_url, "the sign-in")
    if fragment != "servers":
        browser.get(f"{origin}/#/{fragment}")
    return origin


def wait(browser, predicate, what, timeout=30):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout, poll_frequency=0.05).until(predicate)
    except Exception as exc:  # noqa: BLE001 - say what did not appear, with the page's console
        raise AssertionError(f"timed out waiting for {what}; console: {browser.get_log('browser')}") from exc


def css(browser, selector):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def shown(selector):
    return lambda d: css(d, selector)


def click(browser, selector, what=None):
    """Click what ``selector`` finds, again if a refresh of the page replaced it in between."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def attempt(driver):
        try:
            driver.find_element(By.CSS_SELECTOR, selector).click()
            return True
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    wait(browser, attempt, what or selector)


def console_errors(browser):
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(browser, tmp_path, name):
    folder = tmp_path / "screenshots"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.png"
    browser.save_screenshot(str(path))
    if os.environ.get(SCREENSHOTS_ENV):
        keep = Path(os.environ[SCREENSHOTS_ENV])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, keep / path.name)
    return path


def relay_params(profile=None):
    return StdioServerParameters(command=PY, args=[COFFER, "serve", *(["--profile", profile] if profile else [])],
                                 env=dict(os.environ))


def run_agent(steps, name="web-test-agent", profile=None):
    """Connect an SDK client through `coffer serve` (the relay to the service; ``profile``: as that profile's
    agent) and run ``steps(client, notices)``; browser work inside goes through anyio.to_thread.run_sync."""
    async def main():
        notices: list = []

        async def on_message(message):
            if isinstance(message, types.ServerNotification):
                notices.append(message)

        with anyio.fail_after(180):
            async with Client(relay_params(profile), mode="legacy", message_handler=on_message,
                              client_info=types.Implementation(name=name, version="3")) as client:
                await steps(client, notices)

    anyio.run(main)


async def wait_notice(notices, kind, since, timeout=15):
    with anyio.fail_after(timeout):
        while not any(isinstance(n, kind) for n in notices[since:]):
            await anyio.sleep(0.01)
    return time.monotonic()


def tool_names(result):
    return {tool.name for tool in result.tools}


def audit_rows():
    return json.loads(cli("audit", "--json", "--limit", "500").stdout)["audit"]


def say(capsys, text):
    with capsys.disabled():
        print(f"\n  {text}")


# -- every view ------------------------------------------------------------------------------------------------

def populate(tmp_path):
    """Something to look at: a working server used by an agent, one that fails (its error and fix), a changed
    definition waiting, knowledge notes, calls and failures in the log."""
    args = tmp_path / "a.args"
    args.write_text("")
    cli("config", "restart_backoff", "0.01")
    cli("add", "tracker", "--", *FAKE, "--args-file", str(args), "--tools", "echo,fail,slow,whoami")
    cli("add", "mail", "--", *FAKE, "--tools", "echo,fail", "--name", "mail")
    cli("add", "broken", "--", "no-such-mcp-server", "--stdio")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "deploy.md").write_text("# Deploying\n\nRun the release script, then tell the team in #releases.\n\n"
                                     "## Rollback\n\nRedeploy the previous tag.\n")
    (notes / "oncall.md").write_text("# On call\n\nPages go to the primary first.\n")
    return args, notes


def test_every_view_loads_without_a_console_error(web_home, browser, tmp_path):
    args, notes = populate(tmp_path)
    sign_in(browser, tmp_path)
    for _ in range(3):
        cli("call", "tracker__echo", '{"text": "hi"}')
    cli("call", "tracker__fail", "{}", check=False)
    cli("call", "mail__echo", '{"text": "hi"}')
    args.write_text("--schema-tag ' (now also posts to the team channel)'")

    async def steps(client, notices):
        await client.call_tool("tracker__echo", {"text": "from an agent"})

        def restart_tracker():
            from selenium.webdriver.common.by import By

            restart = "tr[data-server=tracker] button[title^='Start it again']"
            wait(browser, shown(restart), "the servers")
            click(browser, restart)
            wait(browser, lambda d: d.find_element(By.ID, "badge-changes").text == "1", "the changed definition")

        await anyio.to_thread.run_sync(restart_tracker)

        def tour():
            from selenium.webdriver.common.by import By

            marks = {"servers": "#servers-table tr[data-server=broken] .error-line",
                     "catalogue": "#catalogue-table tr[data-name=tracker__echo]",
                     "changes": ".change[data-target=tracker__echo] ins",
                     "activity": "svg[data-chart=calls] rect.bar",
                     "search": "#search-results li",
                     "knowledge": "#knowledge-table tr[data-source=notes]",
                     "sessions": "#sessions-table td"}
            for view in VIEWS:
                if view == "knowledge":
                    click(browser, "#nav a[data-view=knowledge]")
                    wait(browser, shown("#knowledge-add"), "the knowledge form")
                    browser.find_element(By.CSS_SELECTOR, "input[name=path]").send_keys(str(notes))
                    browser.find_element(By.ID, "knowledge-add").click()
                elif view == "search":
                    click(browser, "#nav a[data-view=search]")
                    box = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "main input[type=search]"),
                               "the search box")
                    box.send_keys("send the text back to me")
                else:
                    click(browser, f"#nav a[data-view={view}]")
                if view == "servers":
                    wait(browser, shown("#servers-table tr[data-server=broken]"), "the servers")
                    click(browser, "#servers-table tr[data-server=broken]")
                wait(browser, shown(marks[view]), f"the {view} view's data")
                time.sleep(0.3)  # let the last frame settle before the picture
                screenshot(browser, tmp_path, view)
            return console_errors(browser)

        errors = await anyio.to_thread.run_sync(tour)
        assert not errors, f"console errors: {errors}"

    run_agent(steps)
    assert sorted(p.name for p in (tmp_path / "screenshots").iterdir()) == sorted(f"{v}.png" for v in VIEWS)
    servers = {s["name"]: s for s in page_json(browser, "servers")["servers"]}
    assert servers["broken"]["state"] == "failed" and servers["broken"]["problems"], "a failed server shows its fix"


def page_json(browser, name):
    """An API answer read the way the page reads it: through the browser's own cookie and key."""
    script = ("const done = arguments[arguments.length - 1];"
              "fetch('/api/' + arguments[0], {headers: {'X-Coffer-Token': localStorage.getItem('coffer-key')}})"
              ".then(r => r.json()).then(done, e => done({error: String(e)}));")
    return browser.execute_async_script(script, name)


# -- a change reaches the agents ---------------------------------------------------------------------------------

def test_a_tool_disabled_on_the_page_reaches_a_connected_agent(web_home, browser, tmp_path, capsys):
    cli("add", "a", "--", *FAKE)
    sign_in(browser, tmp_path, "catalogue?q=echo")
    timing = {}

    async def steps(client, notices):
        assert "a__echo" in tool_names(await client.list_tools())
        since = len(notices)

        def flip():
            from selenium.webdriver.common.by import By

            switch = "#catalogue-table tr[data-name=a__echo] button.switch"
            wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, switch).get_attribute("aria-checked") == "true",
                 "a__echo's switch, on")
            timing["clicked"] = time.monotonic()
            click(browser, switch)

        await anyio.to_thread.run_sync(flip)
        timing["told"] = await wait_notice(notices, types.ToolListChangedNotification, since)
        assert "a__echo" not in tool_names(await client.list_tools())
        assert "a__fail" in tool_names(await client.list_tools())

        def settled():
            from selenium.webdriver.common.by import By

            row = "#catalogue-table tr[data-name=a__echo]"
            wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} button.switch").get_attribute(
                "aria-checked") == "false" and "disabled" in d.find_element(By.CSS_SELECTOR, row).text,
                "the row to show the tool disabled")
            click(browser, f"{row} .cap-name")   # a row expands to its definition
            details = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#catalogue-table tr.details"),
                           "the tool's definition")
            assert "Echo the given text back" in details.text and "Parameters" in details.text, details.text
            assert details.find_element(By.CSS_SELECTOR, "td.mono").text == "text"
            return console_errors(browser)

        assert not await anyio.to_thread.run_sync(settled)

    run_agent(steps)
    row = [r for r in audit_rows() if r["action"] == "disable"][-1]
    assert (row["actor"], row["target"], row["detail"]) == ("web", "a__echo", "tool")
    say(capsys, f"web: a tool disabled on the page reached the connected agent as list_changed after "
                f"{(timing['told'] - timing['clicked']) * 1000:.0f} ms")


def test_a_changed_definition_is_shown_with_its_diff_and_approved(web_home, browser, tmp_path):
    args = tmp_path / "a.args"
    args.write_text("")
    cli("add", "a", "--", *FAKE, "--args-file", str(args))
    sign_in(browser, tmp_path)

    async def steps(client, notices):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["a__echo"].description == "Echo the given text back"
        args.write_text("--schema-tag ' and sends it to a webhook'")
        since = len(notices)

        def restart_and_review():
            from selenium.webdriver.common.by import By

            wait(browser, shown("#servers-table tr[data-server=a]"), "server a")
            click(browser, "tr[data-server=a] button[title^='Start it again']")
            wait(browser, lambda d: d.find_element(By.ID, "badge-changes").text == "1", "the changed-count badge")
            click(browser, "#nav a[data-view=changes]")
            card = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".change[data-target=a__echo]"),
                        "the changed definition")
            added = [e.text for e in card.find_elements(By.CSS_SELECTOR, ".words ins")]
            path = [e.text for e in card.find_elements(By.CSS_SELECTOR, ".field-change .path")]
            return added, path

        added, path = await anyio.to_thread.run_sync(restart_and_review)
        assert path == ["description"] and "".join(added).strip() == "and sends it to a webhook", (path, added)
        await wait_notice(notices, types.ToolListChangedNotification, since)
        assert "a__echo" not in tool_names(await client.list_tools()), "held back until approved"
        since = len(notices)

        def approve():
            from selenium.webdriver.common.by import By

            click(browser, ".change[data-target=a__echo] button.approve")
            wait(browser, lambda d: "Nothing is waiting" in d.find_element(By.ID, "main").text, "the empty list")
            return console_errors(browser)

        assert not await anyio.to_thread.run_sync(approve)
        await wait_notice(notices, types.ToolListChangedNotification, since)
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["a__echo"].description == "Echo the given text back and sends it to a webhook"

    run_agent(steps)
    rows = audit_rows()
    assert [(r["actor"], r["target"]) for r in rows if r["action"] == "approve"] == [("web", "a__echo")]
    assert [(r["actor"], r["target"]) for r in rows if r["action"] == "restart"] == [("web", "a")]


# -- what is drawn is what the log says ---------------------------------------------------------------------------

def test_the_activity_charts_show_the_log(web_home, browser, tmp_path):
    cli("add", "a", "--", *FAKE)
    cli("service", "start")
    for _ in range(4):
        cli("call", "a__echo", '{"text": "hi"}')
    for _ in range(2):
        cli("call", "a__fail", "{}", check=False)
    log = json.loads(cli("log", "--json", "--limit", "1000").stdout)["invocations"]
    by_hour: dict = {}
    for row in log:
        hour = row["ts"][:13] + ":00:00Z"
        calls, failed = by_hour.get(hour, (0, 0))
        by_hour[hour] = (calls + 1, failed + (row["status"] not in ("ok", "cancelled")))
    assert sum(calls for calls, _ in by_hour.values()) == 6
    sign_in(browser, tmp_path, "activity")

    from selenium.webdriver.common.by import By

    wait(browser, shown("svg[data-chart=calls] rect.bar"), "the calls chart")
    drawn = {e.get_attribute("data-hour"): int(e.get_attribute("data-total"))
             for e in css(browser, "svg[data-chart=calls] rect.hit")}
    assert len(drawn) == 24
    assert {hour: total for hour, total in drawn.items() if total} == {h: c for h, (c, _) in by_hour.items()}
    bars = {(e.get_attribute("data-hour"), e.get_attribute("data-series")): int(e.get_attribute("data-value"))
            for e in css(browser, "svg[data-chart=calls] rect.bar")}
    assert bars == {(hour, "a"): calls for hour, (calls, _) in by_hour.items()}
    rates = {e.get_attribute("data-hour"): float(e.get_attribute("data-value"))
             for e in css(browser, "svg[data-chart=errors] rect.bar")}
    assert rates == {hour: round(failed / calls, 4) for hour, (calls, failed) in by_hour.items() if failed}
    durations = sorted(row["duration_ms"] for row in log)
    dots = [float(e.get_attribute("data-value")) for e in css(browser, "svg[data-chart=duration] circle.p95")]
    if len(by_hour) == 1:   # all six in one hour: its p95 is the log's own p95 (nearest rank: the 6th of 6)
        assert dots == [durations[-1]]
    row = browser.find_element(By.CSS_SELECTOR, "#activity-table tbody tr").text.split()
    assert row[:3] == ["a", "6", "2"], row
    click(browser, "button[data-range=week]")
    wait(browser, lambda d: len(css(d, "svg[data-chart=calls] rect.hit")) == 168, "the week's 168 hours")
    assert not console_errors(browser)


# -- the playground ranks as the agent's tool does ---------------------------------------------------------------

@pytest.mark.parametrize("embedder", [False, True], ids=["bm25", "with-embedder"])
def test_the_search_playground_agrees_with_coffer_search_tools(web_home, browser, tmp_path, embedder):
    stub = Stub() if embedder else None
    try:
        cli("add", "a", "--", *FAKE, "--tools", "echo,slow,crash,big,fail,whoami,roots")
        cli("add", "b", "--", *FAKE, "--tools", "echo,churn,sample", "--name", "b")
        if stub is not None:
            cli("config", "embedder_url", stub.url)
            cli("config", "embedder_model", "stub-model")
        query = "send the text back to me"
        answers = {}

        async def steps(client, notices):
            deadline = time.monotonic() + 30
            while True:
                result = await client.call_tool("coffer__search_tools", {"query": query, "top_k": 5})
                answers["agent"] = result.structured_content
                if answers["agent"]["ranker"] == ("hybrid" if embedder else "bm25") or time.monotonic() > deadline:
                    break
                await anyio.sleep(0.1)

        run_agent(steps)
        agent = answers["agent"]
        assert agent["ranker"] == ("hybrid" if embedder else "bm25")
        sign_in(browser, tmp_path, f"search?q={query.replace(' ', '%20')}")
        wait(browser, shown("#search-results li"), "the playground's ranking")
        shown_ranking = [(e.get_attribute("data-name"), float(e.get_attribute("data-score")))
                         for e in css(browser, "#search-results li")]
        assert shown_ranking == [(t["name"], t["score"]) for t in agent["tools"]]
        assert css(browser, "#ranker")[0].text == ("hybrid: BM25 + embeddings" if embedder else "BM25")
        first = css(browser, "#search-results li")[0].text
        assert "exact word" in first or "same stem" in first or "equivalent" in first, first
        assert "do not add up" not in browser.find_element("id", "main").text
        assert not console_errors(browser)
    finally:
        if stub is not None:
            stub.close()


def test_the_playground_shows_what_the_users_own_picks_did(web_home, browser, tmp_path):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,fail,big")
    cli("config", "search_feedback", "on")
    query = "give me text back as a result"
    answers = {}

    async def steps(client, notices):
        answers["before"] = (await client.call_tool("coffer__search_tools", {"query": query})).structured_content
        await client.call_tool("fx__big", {"mb": 0})                  # the agent picked big for this request
        answers["after"] = (await client.call_tool("coffer__search_tools", {"query": query})).structured_content

    run_agent(steps)
    assert [t["name"] for t in answers["before"]["tools"]][:2] == ["fx__echo", "fx__big"]
    assert answers["after"]["tools"][0]["name"] == "fx__big"
    sign_in(browser, tmp_path, f"search?q={query.replace(' ', '%20')}")
    wait(browser, shown("#search-results li"), "the playground's ranking")
    shown_ranking = [(e.get_attribute("data-name"), float(e.get_attribute("data-score")))
                     for e in css(browser, "#search-results li")]
    assert shown_ranking == [(t["name"], t["score"]) for t in answers["after"]["tools"]]
    first = css(browser, "#search-results li")[0].text
    assert "picked by you for 1 similar search: ×1." in first, first
    assert "do not add up" not in browser.find_element("id", "main").text
    assert not console_errors(browser)


def test_the_page_lists_each_profile_and_searches_as_its_agent_does(web_home, browser, tmp_path):
    """Sessions shows each profile (what it includes, its tools, the clients using it) and each session's profile;
    the playground, asked as a profile's agent, ranks that profile's tools under the names its agent sees."""
    cli("add", "a", "--", *FAKE, "--tools", "echo,slow,crash")
    cli("add", "b", "--", *FAKE, "--tools", "echo,fail", "--name", "b")
    cli("profile", "add", "only-b", "--include", "b")
    cli("override", "b__echo", "--profile", "only-b", "--name", "say_it_back")
    query = "send the text back to me"
    answers = {}

    async def steps(client, notices):
        answers["agent"] = (await client.call_tool("coffer__search_tools", {"query": query})).structured_content

        def look():
            sign_in(browser, tmp_path, "sessions")
            wait(browser, shown("#profiles-table tr[data-profile=only-b]"), "the profile")
            cells = [td.text for td in css(browser, "#profiles-table tr[data-profile=only-b] td")]
            sessions = [td.text for td in css(browser, "#sessions-table td")]
            browser.get(browser.current_url.split("#")[0] + f"#/search?q={query.replace(' ', '%20')}&profile=only-b")
            wait(browser, shown("#search-results li"), "the playground's ranking")
            ranking = [(e.get_attribute("data-name"), float(e.get_attribute("data-score")))
                       for e in css(browser, "#search-results li")]
            css(browser, "#search-profile")[0].find_element("css selector", "option[value='']").click()
            wait(browser, lambda d: "a__echo" in [e.get_attribute("data-name") for e in css(d, "#search-results li")],
                 "the ranking for an agent without a profile")
            errors = console_errors(browser)  # before the refused request below, which the console reports
            unknown = page_json(browser, "search?q=echo&profile=" + "x" * 5000)
            return cells, sessions, ranking, errors, unknown

        answers["page"] = await anyio.to_thread.run_sync(look)

    run_agent(steps, profile="only-b")
    cells, sessions, ranking, errors, unknown = answers["page"]
    assert unknown["error"].startswith("there is no profile named 'xxx") and len(unknown["error"]) < 200, unknown
    assert cells[0] == "only-b" and cells[1] == "b" and cells[3] == "2" and "web-test-agent" in cells[4], cells
    assert "only-b" in sessions, sessions
    agent = answers["agent"]["tools"]
    assert ranking == [(t["name"], t["score"]) for t in agent]
    assert "say_it_back" in [name for name, _ in ranking] and not any(n.startswith("a__") for n, _ in ranking)
    assert not errors, errors


# -- knowledge ---------------------------------------------------------------------------------------------------

def test_a_knowledge_folder_is_added_reindexed_and_removed(web_home, browser, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("# Release\n\nTag, build, publish.\n\n## Rollback\n\nRedeploy the last tag.\n")
    sign_in(browser, tmp_path, "knowledge")

    from selenium.webdriver.common.by import By

    wait(browser, shown("#knowledge-add"), "the knowledge form")
    browser.find_element(By.CSS_SELECTOR, "input[name=path]").send_keys(str(notes))
    browser.find_element(By.CSS_SELECTOR, "input[name=name]").send_keys("handbook")
    browser.find_element(By.ID, "knowledge-add").click()
    row = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#knowledge-table tr[data-source=handbook]"),
               "the new source")
    assert row.text.split()[:1] == ["handbook"] and str(notes) in row.text
    (notes / "b.md").write_text("# Contacts\n\nAsk the platform team.\n")
    click(browser, "#knowledge-table tr[data-source=handbook] td:last-child button:first-child")
    wait(browser, lambda d: "1 added" in d.find_element(By.ID, "toasts").text, "the reindex report")
    asked = []

    def remove(driver):   # the first click only arms the button: a removal asks once more
        from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

        try:
            button = driver.find_element(By.CSS_SELECTOR, "#knowledge-table tr[data-source=handbook] button.danger")
            armed = button.text == "Remove handbook?"
            button.click()
            asked.append(armed)
            return armed
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    wait(browser, remove, "the removal, confirmed")
    assert asked[0] is False and asked[-1] is True
    wait(browser, lambda d: not css(d, "#knowledge-table tr[data-source=handbook]"), "the source to go")
    assert not console_errors(browser)
    rows = [(r["actor"], r["action"], r["target"]) for r in audit_rows() if r["action"].startswith("knowledge")]
    assert rows == [("web", "knowledge-add", "handbook"), ("web", "knowledge-remove", "handbook")]


# -- fast at 10,000 tools ----------------------------------------------------------------------------------------

def test_the_first_paint_at_ten_thousand_tools(web_home, browser, tmp_path, capsys):
    cli("add", "many", "--", *ten_thousand_tools(tmp_path))
    origin = sign_in(browser, tmp_path)
    browser.get("about:blank")
    wait_until(lambda: json.loads(cli("list", "--json").stdout)["servers"][0]["tools"] == 10_000, timeout=120,
               interval=0.5, what="10,000 tools in the vault")
    figures = []
    for attempt in ("first load", "reload"):   # the first after the catalogue changed, then with it cached
        browser.get("about:blank")
        browser.get(f"{origin}/#/catalogue")
        wait(browser, lambda d: d.execute_script("return performance.getEntriesByName('coffer-ready').length"),
             "the catalogue's first page")
        figures.append((attempt, *browser.execute_script(
            "return [performance.getEntriesByName('first-contentful-paint')[0].startTime,"
            " performance.getEntriesByName('coffer-ready')[0].startTime]")))
    rows = css(browser, "#catalogue-table tbody tr")
    assert len(rows) == 100, "the catalogue shows a page, never 10,000 rows"
    assert "10,000 in all" in browser.find_element("id", "main").text
    assert not console_errors(browser)
    say(capsys, "web at 10,000 tools, catalogue view: " + "; ".join(
        f"{attempt}: first contentful paint {paint:.0f} ms, first page of tools shown {ready:.0f} ms"
        for attempt, paint, ready in figures) + " (target: first paint within 300 ms)")
