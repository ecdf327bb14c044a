"""The classes of request tool search still lost (issue 27), each on catalogues written for these tests.

Each test states the principle of its fix as a user would notice it; the catalogues (tests/search_catalogues.py)
merge realistic servers to 200+ tools where a class shows only at that size."""

import pytest
import search_catalogues as sc

from coffer_src.search.index import SearchIndex
from coffer_src.search.text import inflection_stem, tokenize


def names(hits):
    return [tool["name"] for tool, _ in hits]


@pytest.fixture(scope="module")
def catalogue():
    return SearchIndex(sc.merged())


# ---------------------------------------------------------------- class 4: plural acronyms


@pytest.mark.parametrize("text, expected", [
    ("PDFs", ["pdf"]),
    ("URLs", ["url"]),
    ("IDs", ["id"]),
    ("getURLsFromPage", ["get", "url", "pag"]),
    ("merge these PDFs", ["merg", "pdf"]),
    ("HTTPServer", ["http"]),                 # capitals then a capitalised word: still two words
])
def test_capitals_with_a_final_s_are_one_word_its_singular(text, expected):
    assert tokenize(text) == expected


def test_a_plural_acronym_does_not_reach_a_tool_named_after_a_fragment_of_it(catalogue):
    # "URLs" once split into "ur" + "ls", and "ls" is the name of a shell tool.
    top = names(catalogue.search("collect all the URLs on this page", 5))
    assert "shell__ls" not in top and "scraper__extract_links" in top[:2]
    assert names(catalogue.search("merge these PDFs into one", 1)) == ["pdf__merge_pdfs"]


# ---------------------------------------------------------------- class 3: an argument kind no tool accepts


def test_an_argument_kind_no_tool_accepts_is_read_as_a_word():
    # Any 2-5 capitals may be a ticker; where no tool takes a ticker symbol, "KQL" is the request's rarest word.
    index = SearchIndex(sc.merged(sc.FINANCE))
    assert names(index.search("run this KQL query over area path Web", 1)) == ["monitor__kusto_query"]
    # ...while where a tool does take one, a ticker is still an argument for it
    with_quotes = SearchIndex(sc.merged())
    assert {"symbol"} == set(with_quotes.search("NVDA right now", 1)[0][0]["inputSchema"]["properties"])


# ---------------------------------------------------------------- class 2: a synonym line reached through a stem


@pytest.mark.parametrize("query", [
    "show the size of the file located at ./data/x.csv",
    "how big is the file located in ./data",
    "what's the size of the document located at ~/notes/todo.md",
])
def test_a_word_expands_only_the_synonym_lines_that_list_one_of_its_inflections(catalogue, query):
    # "located" and "location" share a stem; only "location" is on the line of maps, places and addresses.
    top = names(catalogue.search(query, 5))
    assert not [name for name in top if name.startswith("maps__")], top


def test_inflections_of_a_listed_word_still_expand_its_line():
    assert inflection_stem("located") == inflection_stem("locate") != inflection_stem(
        "location") == inflection_stem("locations")
    index = SearchIndex(sc.MAPS + sc.FILESYSTEM)
    assert names(index.search("locations of the nearest charging stations", 1))[0].startswith("maps__")


# ---------------------------------------------------------------- class 5: what a new user typed


@pytest.mark.parametrize("query, expected", [
    ("open a pull request", "github__create_pull_request"),        # to open a pull request is to create one
    ("open PR", "github__create_pull_request"),
    ("open a ticket in Jira for the login bug", "jira__jira_create_issue"),
    ("file a bug about the crash on startup", "jira__jira_create_issue"),
    ("open a new tab", "playwright__browser_tab_new"),
    # ...while "open" of an existing thing, or as a state, keeps its meaning
    ("list the open issues labeled bug", "github__list_issues"),
])
def test_a_verb_means_what_its_object_makes_it_mean(catalogue, query, expected):
    assert names(catalogue.search(query, 1)) == [expected]


def test_open_issue_by_number_reads_it_rather_than_creating_one(catalogue):
    assert "github__create_issue" not in names(catalogue.search("open issue #42", 3))


@pytest.mark.parametrize("query", ["今何時", "今何時ですか", "東京は今何時", "現在の時刻", "现在几点", "지금 몇시야"])
def test_asking_the_time_in_japanese_chinese_or_korean_gets_the_current_time(catalogue, query):
    assert names(catalogue.search(query, 1)) == ["time__get_current_time"]


# ---------------------------------------------------------------- class 1: a narrow tool vetoes general search


def web_tools(index):
    return {tool["name"] for tool in index.tools if tool["name"] in sc.web_search_tools() or any(
        tool["name"].startswith(f"{server}__") for server in ("serper", "bing", "searxng"))}


@pytest.mark.parametrize("query", [
    "find the latest news on glacier melt in Norway",      # a headline tool matches "latest news", takes no topic
    "latest headlines on the battery industry",
    "recent news about the chip shortage",
])
def test_a_tool_that_cannot_take_the_subject_does_not_outvote_general_search(catalogue, query):
    assert names(catalogue.search(query, 1))[0] in web_tools(catalogue)


@pytest.mark.parametrize("query, expected", [
    ("latest headlines", "bugle__get_news"),                                  # no subject: only framing
    ("latest headlines from the Daily Bugle", "bugle__get_news"),             # names the tool's server
    ("latest version of the requests package", "registry__get_latest_version"),   # named for the subject
    ("what are analysts saying about AMZN's latest earnings", "brokerage__get_earnings"),   # takes the ticker
    ("show recent commits", "git__"),                                         # holds the whole subject
])
def test_a_tool_that_takes_or_covers_the_subject_keeps_its_place(catalogue, query, expected):
    assert names(catalogue.search(query, 1))[0].startswith(expected)


@pytest.mark.parametrize("query", ["latest news", "what's in the news", "show me the news"])
def test_a_request_for_the_news_in_general_is_not_answered_by_news_about_one_stock(query):
    # No subject, so no feed is outvoted; but a tool that must be told which stock cannot answer it either.
    index = SearchIndex(sc.merged(*sc.NARROW_NEWS) + sc.STOCK_NEWS)
    assert len(index.tools) >= 200
    top = names(index.search(query, 5))
    assert top[0] in web_tools(index) and "markets__get_news" in top, top


@pytest.mark.parametrize("query", ["latest news on AAPL", "any recent news about TSLA"])
def test_news_about_one_stock_answers_a_request_that_names_the_stock(query):
    index = SearchIndex(sc.merged(*sc.NARROW_NEWS) + sc.STOCK_NEWS)
    assert names(index.search(query, 1)) == ["markets__get_news"]


@pytest.mark.parametrize("query", ["latest news", "the latest headlines today"])
def test_a_request_for_the_news_in_general_keeps_a_news_feed_first(query):
    index = SearchIndex(sc.merged() + sc.STOCK_NEWS)
    assert names(index.search(query, 1)) == ["bugle__get_news"]


@pytest.mark.parametrize("query", ["what's the big news in AI today", "major AI news today",
                                   "tell me the current news in AI"])
def test_words_that_say_now_or_what_matters_are_not_the_subject(query):
    # The subject is AI, which the technology feed covers: it keeps its place ahead of general web search.
    index = SearchIndex(sc.merged() + sc.STOCK_NEWS + sc.TECH_FEED)
    assert names(index.search(query, 1)) == ["techwire__get_tech_news"]


def test_the_lift_goes_to_the_best_web_search_tools_not_to_all_of_them():
    tools = sc.merged() + [tool for group in sc.MORE_WEB_SEARCH for tool in group]
    index = SearchIndex(tools)
    top = names(index.search("find the latest news on glacier melt in Norway", 5))
    web = web_tools(index)
    assert len(web) >= 6 and top[0] in web
    # two lifted, from two search engines; the headline tool that matched the request still shows
    assert "bugle__get_news" in top, top
    lifted = [name for name in top if name in web]
    assert len({name.partition("__")[0] for name in lifted[:2]}) == 2, top


def test_where_no_tool_declares_parameters_a_tool_named_for_the_request_keeps_its_place():
    # Nothing tells which tool takes a topic: the narrow tool named for "news" keeps the first place, as before.
    bare = [{"name": tool["name"], "description": tool["description"]} for tool in sc.merged()]
    index = SearchIndex(bare)
    assert names(index.search("find the latest news on glacier melt in Norway", 1)) == ["bugle__get_news"]


# ---------------------------------------------------------------- a text file the request saves to is written


@pytest.mark.parametrize("query, first_step", [
    ("summarize the open issues in octo/app and save the summary to /tmp/issues.md", "github__"),
    ("get the weather forecast for Oslo and save it as forecast.txt", "weather__get_forecast"),
    ("list the running pods and store the list in pods.json", "kubernetes__"),
    ("fetch https://example.com/docs and save it to ./docs/page.html", "scraper__fetch"),
    ("Find the latest news on battery recycling. Save a short report to /root/notes/battery.md", "brave__"),
])
def test_saving_to_a_text_file_is_a_step_for_the_tool_that_writes_files(catalogue, query, first_step):
    # "save" stands for "write" only a little, so tools named for saving a page as PDF outranked the file writer,
    # the one tool that can do the request's last step.  The request's first step stays in view.
    top = names(catalogue.search(query, 5))
    assert "filesystem__write_file" in top and any(name.startswith(first_step) for name in top), top


@pytest.mark.parametrize("query, expected", [
    ("save a screenshot of the page to /tmp/shot.png", "playwright__browser_take_screenshot"),
    ("merge a.pdf and b.pdf and save the result as c.pdf", "pdf__merge_pdfs"),
    ("read the notes I saved in notes.txt", "filesystem__read_file"),
])
def test_an_image_a_document_or_a_file_that_exists_is_not_one_to_write(catalogue, query, expected):
    # An image or a PDF is made and saved by a tool of its format, not written as text; and a file the user tells
    # of ("the notes I saved") is read.
    top = names(catalogue.search(query, 5))
    assert expected in top[:2] and "filesystem__write_file" not in top, top
