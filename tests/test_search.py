"""The BM25F ranker behind coffer__search_tools: tokenizer, stemmer, field weights, determinism, CJK, clamping."""

import gc
import random
import threading

import pytest

from coffer_src.search import index as search_index
from coffer_src.search import text as search_text
from coffer_src.search.entities import query_entities
from coffer_src.search.index import SearchIndex
from coffer_src.search.semantic import fuse
from coffer_src.search.text import stem, tokenize


def tool(name, description="", **properties):
    return {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                               for k, v in properties.items()}}}


def names(hits):
    return [t["name"] for t, _ in hits]


@pytest.mark.parametrize("text, expected", [
    ("createIssue", ["creat", "issu"]),
    ("create_pull-request", ["creat", "pull", "request"]),
    ("files.list", ["fil", "list"]),
    ("getHTTPResponse", ["get", "http", "respons"]),
    ("Ｆｕｌｌｗｉｄｔｈ ＡＰＩ", ["fullwidth", "api"]),      # NFKC
    ("convert mp3 to base64 in 2024", ["convert", "mp3", "base64", "2024"]),   # numbers kept, stop words gone
])
def test_tokenizer_splits_identifiers_normalises_and_drops_stop_words(text, expected):
    assert tokenize(text) == expected


def test_stemmer_folds_the_forms_an_agent_uses_onto_the_forms_a_tool_uses():
    for group in (["create", "creates", "created", "creating"], ["list", "lists", "listed", "listing"],
                  ["query", "queries"], ["message", "messages"], ["translate", "translation"],
                  ["running", "run", "runs"]):
        assert len({stem(word) for word in group}) == 1, group
    assert stem("need") == "need" and stem("status") == "status"


def test_cjk_text_becomes_bigrams_so_chinese_and_japanese_queries_match():
    assert tokenize("搜索关键词") == ["搜索", "索关", "关键", "键词"]
    index = SearchIndex([
        tool("bing__bing_search", "使用必应搜索指定的关键词，并返回搜索结果列表"),
        tool("fs__read_file", "Read a file from disk"),
    ])
    assert names(index.search("搜索结果", 1)) == ["bing__bing_search"]
    # a Japanese query reaches an English tool through the built-in lexicon
    assert names(index.search("ファイルを読む", 1)) == ["fs__read_file"]


def test_name_tokens_outweigh_the_same_word_in_a_description():
    index = SearchIndex([
        tool("a__delete_branch", "Remove things from the repository"),
        tool("b__prune", "Delete a branch from the repository"),
    ])
    assert names(index.search("delete branch", 2)) == ["a__delete_branch", "b__prune"]


def test_parameter_names_and_enums_are_searchable():
    index = SearchIndex([
        {"name": "w__forecast", "description": "Weather outlook",
         "inputSchema": {"type": "object", "properties": {"units": {"type": "string", "enum": ["celsius"]}}}},
        tool("x__other", "Something unrelated"),
    ])
    assert names(index.search("celsius", 5)) == ["w__forecast"]


def test_equivalent_verbs_match_at_lower_weight_than_the_exact_word():
    index = SearchIndex([tool("a__remove_user", "Remove a user"), tool("b__delete_user", "Delete a user")])
    hits = index.search("delete user", 2)
    assert names(hits) == ["b__delete_user", "a__remove_user"] and hits[0][1] > hits[1][1] > 0


def test_ranking_is_deterministic_ties_broken_by_name_and_zero_scores_dropped():
    tools = [tool(f"s__same_{i}", "identical description") for i in range(10)] + [tool("z__zzz", "nothing")]
    shuffled = tools[:]
    random.Random(7).shuffle(shuffled)
    first = SearchIndex(tools).search("identical description", 20)
    second = SearchIndex(shuffled).search("identical description", 20)
    assert names(first) == names(second) == sorted(f"s__same_{i}" for i in range(10))
    assert "z__zzz" not in names(first)
    assert SearchIndex(tools).search("xylophone", 5) == []


def test_top_k_is_clamped_to_one_through_twenty():
    index = SearchIndex([tool(f"s__t{i}", "common word") for i in range(30)])
    assert len(index.search("common", 0)) == 1
    assert len(index.search("common", 500)) == 20


def test_scores_are_rounded_and_sorted():
    index = SearchIndex([tool("s__a", "alpha beta"), tool("s__b", "alpha"), tool("s__c", "beta gamma")])
    hits = index.search("alpha beta", 3)
    scores = [score for _, score in hits]
    assert scores == sorted(scores, reverse=True) and all(round(s, 4) == s for s in scores)


# ---------------------------------------------------------------- issue 10: failure classes, each on its own tools


def schema_tool(tool_name, description, **properties):
    """A tool whose parameters carry full JSON-schema dicts (descriptions, formats)."""
    return {"name": tool_name, "description": description,
            "inputSchema": {"type": "object", "properties": properties}}


def top(index, query, k=1):
    return names(index.search(query, k))


FILES_AND_PLACES = [
    schema_tool("files__read_file", "Read the complete contents of a file from disk",
                path={"type": "string", "description": "Path of the file"}),
    schema_tool("files__get_file_info", "Size, creation and modification timestamps and permissions of a file",
                path={"type": "string", "description": "Path of the file"}),
    schema_tool("places__geocode", "Turn a street address into a location: latitude and longitude of the location",
                address={"type": "string", "description": "Street address to look up"}),
    schema_tool("places__nearby", "Points of interest near a location, by category",
                location={"type": "string", "description": "Center location"},
                category={"type": "string", "description": "Kind of place"}),
    schema_tool("photos__set_exif", "Write EXIF metadata into an image: camera, size, timestamps, location",
                image={"type": "string", "description": "The image"}),
]


def test_a_word_that_only_shares_a_stem_does_not_outrank_the_words_the_request_is_about():
    index = SearchIndex(FILES_AND_PLACES)
    # "located" stems onto "location", a rare and so heavy term of the place tools
    assert top(index, "open the file located in the project folder") == ["files__read_file"]
    assert top(index, "show me the contents of the document located under ./lib/util.js") == ["files__read_file"]


def test_an_exact_word_outranks_a_word_that_only_shares_its_stem():
    index = SearchIndex([tool("a__creation_report", "Reports about creation dates"),
                                tool("b__create_note", "Create a note")])
    hits = index.search("create", 2)
    assert names(hits) == ["b__create_note", "a__creation_report"] and hits[0][1] > hits[1][1]


ENTITY_CATALOGUE = [
    schema_tool("browser__click", "Click on a web page element",
                selector={"type": "string", "description": "CSS selector of the element"}),
    schema_tool("browser__navigate", "Open a page in the browser", url={"type": "string", "format": "uri"}),
    schema_tool("notes__open_note", "Open a note by its title", title={"type": "string"}),
    schema_tool("files__read_text", "Read a text document", path={"type": "string", "description": "File path"}),
    schema_tool("tracker__get_ticket", "Details of one ticket",
                ticket_key={"type": "string", "description": "Key such as OPS-1"}),
    schema_tool("tracker__list_projects", "Every project in the tracker"),
    schema_tool("code__get_change_request", "One change request of a code host",
                owner={"type": "string"}, repo={"type": "string"}, number={"type": "integer"}),
    schema_tool("cluster__logs", "Container output of a workload",
                resourceType={"type": "string", "description": "deployment, pod, job"},
                name={"type": "string"}),
    schema_tool("market__quote", "Latest trade of a listed company", symbol={"type": "string"}),
    schema_tool("mail__send", "Send a message", to={"type": "string", "format": "email"},
                body={"type": "string"}),
    schema_tool("warehouse__run", "Run against the analytics warehouse", query={"type": "string"}),
    schema_tool("warehouse__describe", "Columns of one warehouse table", table={"type": "string"}),
    schema_tool("jobs__create", "Create a recurring job", command={"type": "string"},
                schedule={"type": "string", "description": "Cron expression"}),
    schema_tool("jobs__list", "Every recurring job and its last run"),
]


@pytest.mark.parametrize("query, expected", [
    ("open ./docs/setup/README.md", "files__read_text"),                  # a path, not a note title
    ("open https://status.example.org/incidents", "browser__navigate"),   # a URL
    ("click .toolbar > button.save", "browser__click"),                   # a CSS selector
    ("OPS-4411 please", "tracker__get_ticket"),                          # a ticket key
    ("acme/widgets#42", "code__get_change_request"),                     # owner/repo#number
    ("deploy/checkout output", "cluster__logs"),                         # a k8s resource
    ("NVDA right now", "market__quote"),                                 # a ticker
    ("ping ops-oncall@example.com: disk full", "mail__send"),            # an email address
    ("open C:\\Users\\ana\\todo.txt", "files__read_text"),               # a Windows path
    ("open ~/reports/q3-summary", "files__read_text"),                   # a home-relative path
    ("SELECT region, sum(total) FROM orders GROUP BY region", "warehouse__run"),   # SQL, not the table tool
    ("every weekday: 30 6 * * 1-5 backup.sh", "jobs__create"),            # a cron expression
    ("show me what's inside src/lib/index.ts", "files__read_text"),       # a relative path with no ./
])
def test_arguments_in_the_request_pick_the_tool_whose_parameters_take_them(query, expected):
    assert top(SearchIndex(ENTITY_CATALOGUE), query) == [expected]


NEWS_AND_NARROW_TOOLS = [
    schema_tool("browser__navigate", "Navigate to a URL", url={"type": "string"}),
    schema_tool("packages__latest_version", "Latest published version of a package", package={"type": "string"}),
    schema_tool("search__web", "Search the web: pages, news and facts from the internet", q={"type": "string"}),
    schema_tool("chips__order_part", "Order an electronic part from the catalogue", part={"type": "string"}),
    schema_tool("files__list_recent", "List recently opened files", limit={"type": "integer"}),
    schema_tool("git__log", "Show recent commits in the repository", path={"type": "string"}),
    schema_tool("weather__forecast", "Weather forecast for a city", city={"type": "string"}),
]


@pytest.mark.parametrize("query, expected", [
    ("latest headlines on the battery industry", "search__web"),
    ("what's happening with interest rates this week", "search__web"),
    ("recent news about the chip shortage", "search__web"),
    ("what happened at the climate summit", "search__web"),
    ("latest on the merger between the two airlines", "search__web"),
    # ...while a request that names a narrow tool's subject still reaches it
    ("latest version of the left-pad package", "packages__latest_version"),
    ("list my recent files", "files__list_recent"),
    ("show recent commits", "git__log"),
    ("latest weather forecast for Paris", "weather__forecast"),
    # ...and words inside an argument are not the request: this URL holds "news", the request is to open it
    ("go to https://news.example.com/latest", "browser__navigate"),
])
def test_a_general_information_request_reaches_web_search_not_a_tool_sharing_one_word(query, expected):
    assert top(SearchIndex(NEWS_AND_NARROW_TOOLS), query) == [expected]


def test_what_is_left_of_a_contraction_matches_nothing():
    # "what's", "don't", "we've" split at the apostrophe: the "s", "t", "ve" left over are not words of the request.
    tools = [tool("people__get_profile", "Get a person's profile: the user's name, the team's roles, the org's plan"),
             tool("notes__read", "Read a note")]
    index = SearchIndex(tools)
    assert top(index, "what's in my note") == ["notes__read"]
    assert index.search("what's it", 3) == []


def test_common_interface_words_reach_tools_named_otherwise():
    tools = [tool("browser__handle_dialog", "Handle a dialog", accept="Whether to accept it"),
             tool("browser__click", "Perform click on a web page"),
             tool("maps__elevation", "Get elevation data for locations on the earth"),
             tool("maps__geocode", "Convert an address into coordinates"),
             tool("browser__close", "Close the page")]
    index = SearchIndex(tools)
    assert top(index, "dismiss the popup") == ["browser__handle_dialog"]
    assert top(index, "altitude of Denver") == ["maps__elevation"]
    assert top(index, "latitude and longitude of the station") == ["maps__geocode"]


def test_shorthand_in_a_request_counts_as_the_words_it_stands_for():
    tools = [tool("hub__create_pull_request", "Create a new pull request"),
             tool("hub__search_repositories", "Search for repositories"),
             tool("graph__open_nodes", "Open nodes of the knowledge graph by name"),
             tool("tables__query", "Query rows of one table", table={"type": "string"}),
             tool("tables__list_databases", "List the databases you can reach")]
    index = SearchIndex(tools)
    assert top(index, "open a PR from feature/login into main") == ["hub__create_pull_request"]
    assert top(index, "find repos about vector search") == ["hub__search_repositories"]
    assert top(index, "which dbs can I reach") == ["tables__list_databases"]


def test_one_servers_compound_name_word_does_not_take_over_a_request_about_something_else():
    hub = [tool(f"hub__{verb}_pull_request", f"{verb.capitalize()} a pull request in a repository")
           for verb in ("create", "get", "list", "merge", "update", "review")]
    index = SearchIndex(hub + [tool("wiki__get_block", "Retrieve one block of a wiki page"),
                                      tool("wiki__get_page", "Retrieve a whole wiki page")])
    assert top(index, "pull just one block out of the wiki page") == ["wiki__get_block"]
    assert top(index, "merge the pull request") == ["hub__merge_pull_request"]


TIME_TOOLS = [
    schema_tool("clock__get_current_time", "Get the current time in a timezone",
                timezone={"type": "string", "description": "IANA timezone name, for example 'Europe/Paris'"}),
    schema_tool("clock__convert_time", "Convert a time from one timezone to another",
                source_timezone={"type": "string", "description": "IANA name, for example 'America/Chicago'"},
                time={"type": "string", "description": "Time to convert, HH:MM"},
                target_timezone={"type": "string", "description": "IANA name, for example 'Asia/Tokyo'"}),
]


def test_asking_the_time_somewhere_gets_the_current_time_not_a_conversion():
    index = SearchIndex(TIME_TOOLS)
    assert top(index, "what time is it in Tokyo") == ["clock__get_current_time"]
    assert top(index, "convert 09:30 Chicago time to Tokyo time") == ["clock__convert_time"]


GERMAN_AND_CJK = [
    schema_tool("drive__upload", "Upload a file to the drive", path={"type": "string"}),
    schema_tool("drive__download", "Download a file from the drive", file_id={"type": "string"}),
    schema_tool("fs__create_directory", "Create a new directory", path={"type": "string"}),
    schema_tool("fs__directory_tree", "Recursive tree view of a directory", path={"type": "string"}),
    schema_tool("fs__delete_file", "Delete a file", path={"type": "string"}),
    schema_tool("cluster__scale", "Scale a deployment to a number of replicas",
                name={"type": "string"}, replicas={"type": "integer"}),
    schema_tool("cluster__get", "List resources of a kind", resourceType={"type": "string"}),
]


@pytest.mark.parametrize("query, expected", [
    ("Lade die Rechnung ./re-2024.pdf hoch", "drive__upload"),            # hochladen, split over the clause
    ("Lege bitte einen Ordner für die Belege an", "fs__create_directory"),  # anlegen
    ("Zeig mir den Verzeichnisbaum", "fs__directory_tree"),               # compound: Verzeichnis + Baum
    ("把 deployment checkout 扩容到 5 个副本", "cluster__scale"),          # Chinese around English identifiers
    ("README.md をアップロードして", "drive__upload"),                     # Japanese: katakana loanwords
    ("checkout を 5 レプリカにスケール", "cluster__scale"),
    ("report.pdf 파일을 업로드해줘", "drive__upload"),                      # Korean, particles attached
    ("디렉토리 트리 보여줘", "fs__directory_tree"),
    ("excluir o arquivo ./tmp/a.log", "fs__delete_file"),                # Portuguese
    ("carica report.pdf sul drive", "drive__upload"),                     # Italian
])
def test_non_english_requests_reach_english_tools(query, expected):
    assert top(SearchIndex(GERMAN_AND_CJK), query) == [expected]


GERMAN_TOOLS = [
    tool("ablage__hochladen", "Lade eine Datei in die Ablage hoch"),            # ASCII German, split verb
    tool("ablage__struktur", "Zeigt den Verzeichnisbaum der Ablage"),            # ASCII German, compound
    tool("ablage__loeschen", "Löscht eine Datei endgültig"),                     # accented German
    tool("drive__share", "Share a file with another user by email"),
    tool("drive__rename", "Rename a file in place"),
    tool("fs__read_file", "Read the complete contents of a file"),
    tool("fs__list_directory", "List the entries of one directory"),
]


@pytest.mark.parametrize("query, expected", [
    ("upload a file", "ablage__hochladen"),
    ("show me the tree", "ablage__struktur"),
])
def test_a_tool_described_in_german_is_found_by_an_english_request(query, expected):
    assert top(SearchIndex(GERMAN_TOOLS), query) == [expected]


def test_a_catalogue_of_random_words_cannot_grow_the_tokenizer_tables_without_bound(monkeypatch):
    monkeypatch.setattr(search_text._TokenStems, "LIMIT", 500)
    rng = random.Random(7)
    junk = [tool(f"junk__t{i}", " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=9))
                                         for _ in range(20))) for i in range(200)]
    index = SearchIndex(junk + GERMAN_TOOLS)     # 4,000 distinct words through a 500-word table
    assert len(search_text._TOKEN_STEMS) <= 500
    assert top(index, "upload") == ["ablage__hochladen"]       # its translation survived the table's wipes
    assert tokenize("Creating issues") == ["creat", "issu"]


def test_every_tool_keeps_its_own_words_whatever_its_neighbours_hold():
    # An index build analyses a catalogue's texts together; no text, however odd, may shift words between tools.
    odd = ["", "   ", "\x01", "a\x01b \x02 c", "ABC-123\x00", "Lade die Datei hoch", "读取文件 readFile",
           "Löscht eine Datei", "no words at all: !!!", "\x02\x02"]
    tools = []
    for i in range(60):
        tools.append(tool(f"s__tool{i}", f"zq{i}x unique marker {odd[i % len(odd)]}", arg=odd[(i + 3) % len(odd)]))
    index = SearchIndex(tools)
    for i in range(60):
        assert top(index, f"zq{i}x") == [f"s__tool{i}"]
    german = [name for name in names(index.search("upload", 20))]
    assert german and all(int(name[len("s__tool"):]) % len(odd) == 5 for name in german)


def test_a_tools_exact_words_are_its_own_whatever_its_neighbours_hold():
    # A word's first use reads the surface words of every tool holding it at once (ASCII tools as one batch, the
    # others one by one); the tool that says "located" must still outrank its twin that says "location", next to
    # any odd text.
    odd = ["", "   ", "\x01", "a\x01b \x02 c", "ABC-123\x00", "Lade die Datei hoch", "读取文件 readFile",
           "Löscht eine Datei", "no words at all: !!!", "\x02\x02", "PDFs and URLs"]
    tools = []
    for pair in range(40):
        text = odd[pair % len(odd)]
        for word in ("located", "location"):
            tools.append(tool(f"s__{word}{pair}", f"shows where it is {word} {text}", arg=odd[(pair + 3) % len(odd)]))
    index = SearchIndex(tools)
    order = [index.tools[doc_id]["name"] for doc_id, _ in index.rank("located", len(tools))]
    assert len(order) == len(tools)
    for pair in range(40):
        assert order.index(f"s__located{pair}") < order.index(f"s__location{pair}"), pair


def test_an_index_build_leaves_the_garbage_collector_as_it_found_it():
    # The build pauses the collector; an application embedding coffer must find it as it left it.
    catalogue = [tool(f"s__t{i}", f"tool number {i} reads files") for i in range(200)]
    assert gc.isenabled()
    threads = [threading.Thread(target=SearchIndex, args=(catalogue,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    SearchIndex(catalogue)
    for thread in threads:
        thread.join()
    assert gc.isenabled()
    gc.disable()
    try:
        SearchIndex(catalogue)
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        SearchIndex(catalogue)
        assert gc.get_freeze_count() >= frozen and gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_huge_query_is_read_from_its_first_2000_characters(monkeypatch):
    # The path and e-mail patterns cost up to the square of a query's length: a hostile client's megabyte of
    # "a.a.a." must not hold a worker thread for an hour.  The query is read up to 2,000 characters.
    seen = []
    monkeypatch.setattr(search_index, "query_entities", lambda query: seen.append(len(query)) or query_entities(query))
    index = SearchIndex(FILES_AND_PLACES)
    huge = "read the complete contents of ./notes/todo.txt " + "a." * 30_000
    assert top(index, huge, 3) == top(index, huge[:2000], 3) != []
    assert seen and max(seen) <= 2000


def test_fusion_lets_a_confident_embedder_decide_but_not_a_confused_one():
    confident_lexical = [(0, 10.0), (1, 2.0)]
    flat = [(1, 0.26), (2, 0.25), (3, 0.22), (0, 0.17)]         # cosines of a query the model does not understand
    assert fuse(confident_lexical, flat, 2)[0][0] == 0
    close_lexical = [(0, 10.0), (1, 9.0)]
    sharp = [(1, 0.78), (2, 0.41), (3, 0.30), (0, 0.22)]        # a clear semantic winner
    assert fuse(close_lexical, sharp, 2)[0][0] == 1
