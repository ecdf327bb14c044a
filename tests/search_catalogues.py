"""Catalogues for the search tests: servers written for these tests in the style of published MCP servers (their
tool names, terse or chatty descriptions, parameter schemas), merged the way a user's gateway merges them.

A class of ranking error often shows only in a catalogue of realistic size (a lift that fires too often is
invisible among 7 tools), so ``merged(...)`` builds catalogues of 200+ tools from these servers.  A parameter is
written ``name="KIND:description"``: s string, i integer, n number, b boolean, a array of strings, u a string
of format uri, e a string enum ``e:one|two|three:description``, o an object."""

from __future__ import annotations


def _schema(kind_text: str) -> dict:
    kind, _, text = kind_text.partition(":")
    if kind == "e":
        values, _, text = text.partition(":")
        return {"type": "string", "enum": values.split("|"), "description": text}
    schema = {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
              "b": {"type": "boolean"}, "a": {"type": "array", "items": {"type": "string"}},
              "u": {"type": "string", "format": "uri"}, "o": {"type": "object"}}[kind]
    return dict(schema, description=text) if text else dict(schema)


def server(name: str, *tools: tuple) -> list[dict]:
    """A server's tools, each ``(tool_name, description, {parameter: KIND:description})``, named server__tool."""
    listed = []
    for tool, description, params in tools:
        schema = {"type": "object", "properties": {key: _schema(value.removeprefix("!")) for key, value in
                                                   params.items()}}
        required = [key for key, value in params.items() if value.startswith("!")]
        if required:
            schema["required"] = required
        listed.append({"name": f"{name}__{tool}", "description": description, "inputSchema": schema})
    return listed


def t(tool_name: str, description: str, /, **params: str) -> tuple:
    return (tool_name, description, params)


OWNER, REPO = "s:Repository owner (user or organization)", "s:Repository name"

CODE_HOST = server(
    "github",
    t("create_issue", "Create a new issue in a GitHub repository", owner=OWNER, repo=REPO, title="s:Issue title",
      body="s:Issue body content", labels="a:Labels to apply", assignees="a:Usernames to assign"),
    t("get_issue", "Get details of a specific issue in a GitHub repository", owner=OWNER, repo=REPO,
      issue_number="i:The number of the issue"),
    t("list_issues", "List issues in a GitHub repository with filtering options", owner=OWNER, repo=REPO,
      state="e:open|closed|all:Filter by state", labels="a:Filter by labels", sort="e:created|updated|comments:",
      since="s:Only issues updated after this ISO 8601 date"),
    t("update_issue", "Update an existing issue in a GitHub repository", owner=OWNER, repo=REPO,
      issue_number="i:Issue number to update", title="s:New title", body="s:New description",
      state="e:open|closed:New state"),
    t("add_issue_comment", "Add a comment to an existing issue", owner=OWNER, repo=REPO,
      issue_number="i:Issue number to comment on", body="s:Comment text"),
    t("search_issues", "Search for issues and pull requests across GitHub repositories",
      q="s:Search query using GitHub issues search syntax", sort="s:Sort field", order="e:asc|desc:"),
    t("create_pull_request", "Create a new pull request in a GitHub repository", owner=OWNER, repo=REPO,
      title="s:PR title", body="s:PR description", head="s:The name of the branch where your changes are "
      "implemented", base="s:The name of the branch you want the changes pulled into", draft="b:Create as draft"),
    t("get_pull_request", "Get details of a specific pull request", owner=OWNER, repo=REPO,
      pull_number="i:Pull request number"),
    t("list_pull_requests", "List and filter repository pull requests", owner=OWNER, repo=REPO,
      state="e:open|closed|all:Filter by state", head="s:Filter by head user/org and branch",
      base="s:Filter by base branch"),
    t("merge_pull_request", "Merge a pull request. The pull request must be open and mergeable.", owner=OWNER,
      repo=REPO, pull_number="i:Pull request number", merge_method="e:merge|squash|rebase:Merge method to use",
      commit_title="s:Title for the automatic commit message"),
    t("update_pull_request_branch", "Update a pull request branch with the latest changes from the base branch",
      owner=OWNER, repo=REPO, pull_number="i:Pull request number"),
    t("get_pull_request_files", "Get the list of files changed in a pull request", owner=OWNER, repo=REPO,
      pull_number="i:Pull request number"),
    t("get_pull_request_status", "Get the combined status of all status checks for a pull request", owner=OWNER,
      repo=REPO, pull_number="i:Pull request number"),
    t("create_pull_request_review", "Create a review on a pull request", owner=OWNER, repo=REPO,
      pull_number="i:Pull request number", body="s:Review comment text", event="e:APPROVE|REQUEST_CHANGES|COMMENT:"),
    t("get_pull_request_comments", "Get the review comments on a pull request", owner=OWNER, repo=REPO,
      pull_number="i:Pull request number"),
    t("create_repository", "Create a new GitHub repository in your account", name="s:Repository name",
      description="s:Repository description", private="b:Whether the repository should be private"),
    t("fork_repository", "Fork a GitHub repository to your account or specified organization", owner=OWNER,
      repo=REPO, organization="s:Optional: organization to fork to"),
    t("search_repositories", "Search for GitHub repositories", query="s:Search query (see GitHub search syntax)",
      page="i:Page number for pagination"),
    t("get_file_contents", "Get the contents of a file or directory from a GitHub repository", owner=OWNER,
      repo=REPO, path="s:Path to the file or directory", branch="s:Branch to get contents from"),
    t("create_or_update_file", "Create or update a single file in a GitHub repository", owner=OWNER, repo=REPO,
      path="s:Path where to create/update the file", content="s:Content of the file", message="s:Commit message",
      branch="s:Branch to create/update the file in"),
    t("push_files", "Push multiple files to a GitHub repository in a single commit", owner=OWNER, repo=REPO,
      branch="s:Branch to push to", files="a:Array of files to push", message="s:Commit message"),
    t("create_branch", "Create a new branch in a GitHub repository", owner=OWNER, repo=REPO,
      branch="s:Name for the new branch", from_branch="s:Optional: source branch to create from"),
    t("list_commits", "Get list of commits of a branch in a GitHub repository", owner=OWNER, repo=REPO,
      sha="s:Branch name or commit SHA"),
    t("search_code", "Search for code across GitHub repositories", q="s:Search query using GitHub code search"),
    t("search_users", "Search for users on GitHub", q="s:Search query using GitHub users search syntax"),
    t("list_releases", "List the releases of a repository", owner=OWNER, repo=REPO),
    t("create_release", "Create a release for a tag", owner=OWNER, repo=REPO, tag_name="s:The name of the tag",
      name="s:Release title", body="s:Release notes"),
)

FILESYSTEM = server(
    "filesystem",
    t("read_file", "Read the complete contents of a file from the file system. Handles various text encodings and "
      "provides detailed error messages if the file cannot be read. Only works within allowed directories.",
      path="s:"),
    t("read_multiple_files", "Read the contents of multiple files simultaneously. More efficient than reading "
      "files one by one when you need to analyze or compare multiple files.", paths="a:"),
    t("write_file", "Create a new file or completely overwrite an existing file with new content. Use with "
      "caution as it will overwrite existing files without warning.", path="s:", content="s:"),
    t("edit_file", "Make line-based edits to a text file. Each edit replaces exact line sequences with new "
      "content. Returns a git-style diff showing the changes made.", path="s:", edits="a:", dryRun="b:"),
    t("create_directory", "Create a new directory or ensure a directory exists. Can create multiple nested "
      "directories in one operation.", path="s:"),
    t("list_directory", "Get a detailed listing of all files and directories in a specified path. Results "
      "clearly distinguish between files and directories with [FILE] and [DIR] prefixes.", path="s:"),
    t("directory_tree", "Get a recursive tree view of files and directories as a JSON structure.", path="s:"),
    t("move_file", "Move or rename files and directories. Can move files between directories and rename them in "
      "a single operation.", source="s:", destination="s:"),
    t("search_files", "Recursively search for files and directories matching a pattern. Searches through all "
      "subdirectories from the starting path.", path="s:", pattern="s:", excludePatterns="a:"),
    t("get_file_info", "Retrieve detailed metadata about a file or directory. Returns comprehensive information "
      "including size, creation time, last modified time, permissions, and type.", path="s:"),
    t("list_allowed_directories", "Returns the list of directories that this server is allowed to access."),
)

GIT = server(
    "git",
    t("git_status", "Shows the working tree status", repo_path="s:"),
    t("git_diff_unstaged", "Shows changes in the working directory that are not yet staged", repo_path="s:"),
    t("git_diff_staged", "Shows changes that are staged for commit", repo_path="s:"),
    t("git_diff", "Shows differences between branches or commits", repo_path="s:", target="s:"),
    t("git_commit", "Records changes to the repository", repo_path="s:", message="s:"),
    t("git_add", "Adds file contents to the staging area", repo_path="s:", files="a:"),
    t("git_reset", "Unstages all staged changes", repo_path="s:"),
    t("git_log", "Shows the commit logs", repo_path="s:", max_count="i:"),
    t("git_create_branch", "Creates a new branch from an optional base branch", repo_path="s:",
      branch_name="s:", base_branch="s:"),
    t("git_checkout", "Switches branches", repo_path="s:", branch_name="s:"),
    t("git_show", "Shows the contents of a commit", repo_path="s:", revision="s:"),
    t("git_init", "Initialize a new Git repository", repo_path="s:"),
)

WEB_SEARCH = (
    server("brave",
           t("brave_web_search", "Performs a web search using the Brave Search API, ideal for general queries, "
             "news, articles, and online content. Use this for broad information gathering, recent events, or "
             "when you need diverse web sources.", query="s:Search query (max 400 chars, 50 words)",
             count="i:Number of results (1-20, default 10)", offset="i:Pagination offset"),
           t("brave_local_search", "Searches for local businesses and places using Brave's Local Search API. Best "
             "for queries related to physical locations, businesses, restaurants, services.",
             query="s:Local search query (e.g. 'pizza near Central Park')", count="i:Number of results")),
    server("tavily",
           t("tavily_search", "A powerful web search tool that provides comprehensive, real-time results using "
             "Tavily's AI search engine. Returns relevant web content with customizable parameters.",
             query="s:Search query", search_depth="e:basic|advanced:The depth of the search",
             topic="e:general|news:The category of the search", days="i:Days back for news results",
             max_results="i:Maximum number of search results"),
           t("tavily_extract", "A powerful web content extraction tool that retrieves and processes raw content "
             "from specified URLs, ideal for data collection and content analysis.", urls="a:List of URLs")),
    server("exa",
           t("web_search_exa", "Search the web using Exa AI - performs real-time web searches and can scrape "
             "content from specific URLs.", query="s:Search query", numResults="i:Number of results"),
           t("research_paper_search", "Search across 100M+ research papers with full text access using Exa AI.",
             query="s:Research topic or keyword", numResults="i:"),
           t("company_research", "Research companies using Exa AI - finds comprehensive information about "
             "businesses, organizations, and corporations.", companyName="s:Name of the company to research")),
    server("ddg",
           t("search", "Search DuckDuckGo and return formatted results.", query="s:The search query string",
             max_results="i:Maximum number of results")),
)

NARROW_NEWS = (
    server("bugle",
           t("get_news", "Latest headlines from the Daily Bugle", limit="i:How many headlines", offset="i:Skip"),
           t("get_article", "Full text of one Daily Bugle article", article_id="s:The article's id")),
    server("hackernews",
           t("get_top_stories", "Get the current top stories on Hacker News", limit="i:Number of stories"),
           t("get_story", "Get one Hacker News story with its details", story_id="i:Story id"),
           t("get_comments", "Get the comment tree of a Hacker News story", story_id="i:Story id")),
)

FINANCE = server(
    "brokerage",
    t("get_quote", "Real-time quote for a stock: last price, bid, ask, volume", symbol="s:Ticker symbol"),
    t("get_symbol_digest", "One-page digest for a symbol: company news, latest analyst ratings, price changes over "
      "1D/5D/1M, and key statistics", symbol="s:Ticker symbol"),
    t("get_historical_prices", "Daily open, high, low, close and volume for a stock between two dates",
      symbol="s:Ticker symbol", start_date="s:Start date YYYY-MM-DD", end_date="s:End date YYYY-MM-DD"),
    t("get_company_profile", "Company profile: sector, industry, employees, headquarters, description",
      symbol="s:Ticker symbol"),
    t("get_earnings", "Quarterly earnings per share, estimates and surprises", symbol="s:Ticker symbol"),
    t("get_market_movers", "Top gainers, losers and most active stocks today",
      market="e:us|eu|asia:Market region"),
    t("get_crypto_price", "Current price of a cryptocurrency in a fiat currency", coin="s:Coin id, e.g. bitcoin",
      currency="s:Fiat currency code"),
    t("get_fx_rate", "Exchange rate between two currencies", base="s:Base currency", quote="s:Quote currency"),
)

CHAT = server(
    "slack",
    t("slack_list_channels", "List public channels in the workspace with pagination", limit="i:", cursor="s:"),
    t("slack_post_message", "Post a new message to a Slack channel", channel_id="s:The ID of the channel",
      text="s:The message text to post"),
    t("slack_reply_to_thread", "Reply to a specific message thread in Slack", channel_id="s:",
      thread_ts="s:The timestamp of the parent message", text="s:The reply text"),
    t("slack_add_reaction", "Add a reaction emoji to a message", channel_id="s:", timestamp="s:",
      reaction="s:The name of the emoji reaction (without ::)"),
    t("slack_get_channel_history", "Get recent messages from a channel", channel_id="s:", limit="i:"),
    t("slack_get_thread_replies", "Get all replies in a message thread", channel_id="s:", thread_ts="s:"),
    t("slack_get_users", "Get a list of all users in the workspace with their basic profile information",
      cursor="s:", limit="i:"),
    t("slack_get_user_profile", "Get detailed profile information for a specific user", user_id="s:"),
)

BROWSER = server(
    "playwright",
    t("browser_navigate", "Navigate to a URL", url="s:The URL to navigate to"),
    t("browser_navigate_back", "Go back to the previous page"),
    t("browser_snapshot", "Capture accessibility snapshot of the current page, this is better than screenshot"),
    t("browser_take_screenshot", "Take a screenshot of the current page. You can't perform actions based on the "
      "screenshot, use browser_snapshot for actions.", filename="s:File name to save the screenshot to",
      fullPage="b:"),
    t("browser_click", "Perform click on a web page", element="s:Human-readable element description",
      ref="s:Exact target element reference from the page snapshot"),
    t("browser_type", "Type text into editable element", element="s:", ref="s:", text="s:Text to type",
      submit="b:Whether to submit entered text (press Enter after)"),
    t("browser_select_option", "Select an option in a dropdown", element="s:", ref="s:", values="a:"),
    t("browser_hover", "Hover over element on page", element="s:", ref="s:"),
    t("browser_press_key", "Press a key on the keyboard", key="s:Name of the key to press, such as ArrowLeft"),
    t("browser_evaluate", "Evaluate JavaScript expression on page or element", function="s:"),
    t("browser_file_upload", "Upload one or multiple files", paths="a:The absolute paths to the files"),
    t("browser_handle_dialog", "Handle a dialog", accept="b:Whether to accept the dialog", promptText="s:"),
    t("browser_tab_list", "List browser tabs"),
    t("browser_tab_new", "Open a new tab", url="s:The URL to navigate to in the new tab"),
    t("browser_tab_close", "Close a tab", index="i:"),
    t("browser_pdf_save", "Save page as PDF", filename="s:"),
    t("browser_wait_for", "Wait for text to appear or disappear or a specified time to pass", time="n:",
      text="s:"),
    t("browser_network_requests", "Returns all network requests since loading the page"),
    t("browser_console_messages", "Returns all console messages"),
)

SCRAPER = server(
    "scraper",
    t("fetch", "Fetches a URL from the internet and optionally extracts its contents as markdown.",
      url="u:URL to fetch", max_length="i:Maximum number of characters to return", raw="b:"),
    t("extract_links", "Extract every hyperlink (href and anchor text) from a web page", url="u:Page to read"),
    t("extract_tables", "Extract the HTML tables of a page as CSV", url="u:Page to read"),
)

DOCS = server(
    "notion",
    t("search", "Search pages and databases in the Notion workspace by title", query="s:Text to search for",
      filter="o:"),
    t("retrieve_page", "Retrieve a Notion page's properties", page_id="s:"),
    t("create_page", "Create a new page in Notion under a parent page or database", parent="o:",
      properties="o:", children="a:"),
    t("update_page", "Update a page's properties", page_id="s:", properties="o:"),
    t("query_database", "Query a Notion database with filters and sorts", database_id="s:", filter="o:",
      sorts="a:"),
    t("retrieve_block_children", "Retrieve the children blocks of a page or block", block_id="s:"),
    t("append_block_children", "Append new children blocks to a parent block", block_id="s:", children="a:"),
    t("create_comment", "Create a comment on a page or discussion", parent="o:", rich_text="a:"),
)

DATABASES = (
    server("postgres",
           t("query", "Run a read-only SQL query", sql="s:The SQL statement"),
           t("list_schemas", "List the schemas of the database"),
           t("list_tables", "List the tables of a schema", schema="s:"),
           t("describe_table", "Columns, types and indexes of a table", table="s:")),
    server("sqlite",
           t("read_query", "Execute a SELECT query on the SQLite database", query="s:SELECT SQL query to execute"),
           t("write_query", "Execute an INSERT, UPDATE, or DELETE query on the SQLite database",
             query="s:SQL query to execute"),
           t("create_table", "Create a new table in the SQLite database", query="s:CREATE TABLE SQL statement"),
           t("list_tables", "List all tables in the SQLite database"),
           t("append_insight", "Add a business insight to the memo", insight="s:Business insight discovered")),
)

MEMORY = server(
    "memory",
    t("create_entities", "Create multiple new entities in the knowledge graph", entities="a:"),
    t("create_relations", "Create multiple new relations between entities in the knowledge graph. Relations "
      "should be in active voice", relations="a:"),
    t("add_observations", "Add new observations to existing entities in the knowledge graph", observations="a:"),
    t("delete_entities", "Delete multiple entities and their associated relations from the knowledge graph",
      entityNames="a:"),
    t("delete_observations", "Delete specific observations from entities in the knowledge graph", deletions="a:"),
    t("delete_relations", "Delete multiple relations from the knowledge graph", relations="a:"),
    t("read_graph", "Read the entire knowledge graph"),
    t("search_nodes", "Search for nodes in the knowledge graph based on a query", query="s:The search query to "
      "match against entity names, types, and observation content"),
    t("open_nodes", "Open specific nodes in the knowledge graph by their names", names="a:"),
)

TIME = server(
    "time",
    t("get_current_time", "Get current time in a specific timezones",
      timezone="s:IANA timezone name (e.g., 'America/New_York', 'Europe/London'). Use 'UTC' as local timezone "
      "if no timezone provided by the user."),
    t("convert_time", "Convert time between timezones", source_timezone="s:Source IANA timezone name",
      time="s:Time to convert in 24-hour format (HH:MM)", target_timezone="s:Target IANA timezone name"),
)

WEATHER = server(
    "weather",
    t("get_forecast", "Get weather forecast for a location", latitude="n:Latitude of the location",
      longitude="n:Longitude of the location"),
    t("get_alerts", "Get weather alerts for a US state", state="s:Two-letter US state code (e.g. CA, NY)"),
    t("get_current_conditions", "Current temperature, wind and precipitation in a city", city="s:City name"),
)

MAPS = server(
    "maps",
    t("maps_geocode", "Convert an address into geographic coordinates", address="s:The address to geocode"),
    t("maps_reverse_geocode", "Convert coordinates into an address", latitude="n:", longitude="n:"),
    t("maps_search_places", "Search for places using Google Places API", query="s:Search query",
      location="o:Optional center point for the search", radius="n:Search radius in meters (max 50000)"),
    t("maps_place_details", "Get detailed information about a specific place", place_id="s:"),
    t("maps_distance_matrix", "Calculate travel distance and time for multiple origins and destinations",
      origins="a:", destinations="a:", mode="e:driving|walking|bicycling|transit:"),
    t("maps_elevation", "Get elevation data for locations on the earth", locations="a:"),
    t("maps_directions", "Get directions between two points", origin="s:", destination="s:",
      mode="e:driving|walking|bicycling|transit:"),
)

CLUSTER = server(
    "kubernetes",
    t("kubectl_get", "Get or list Kubernetes resources by resource type, name, and optionally namespace",
      resourceType="s:Type of resource to get (e.g., pods, deployments, services)", name="s:",
      namespace="s:", output="e:json|yaml|wide|name:"),
    t("kubectl_describe", "Describe Kubernetes resources by resource type, name, and optionally namespace",
      resourceType="s:", name="s:", namespace="s:"),
    t("kubectl_logs", "Get logs from Kubernetes resources like pods, deployments, or jobs", resourceType="s:",
      name="s:", namespace="s:", tail="i:", since="s:"),
    t("kubectl_apply", "Apply a YAML manifest to the Kubernetes cluster", manifest="s:YAML manifest",
      namespace="s:"),
    t("kubectl_delete", "Delete Kubernetes resources by resource type, name, labels, or from a manifest file",
      resourceType="s:", name="s:", namespace="s:"),
    t("kubectl_scale", "Scale a Kubernetes deployment", name="s:", namespace="s:", replicas="i:"),
    t("kubectl_rollout", "Manage the rollout of a resource (e.g., deployment, daemonset, statefulset)",
      subCommand="e:history|pause|restart|resume|status|undo:", resourceType="s:", name="s:"),
    t("port_forward", "Forward a local port to a port on a Kubernetes resource", resourceType="s:",
      resourceName="s:", localPort="i:", targetPort="i:"),
    t("kubectl_context", "Manage Kubernetes contexts - list, get, or set the current context",
      operation="e:list|get|set:", name="s:"),
    t("exec_in_pod", "Execute a command in a Kubernetes pod or container", name="s:", command="s:",
      namespace="s:"),
)

CONTAINERS = server(
    "docker",
    t("list_containers", "List all Docker containers", all="b:Show all containers (default shows just running)"),
    t("run_container", "Create and start a new container from an image", image="s:", name="s:", ports="o:",
      environment="o:"),
    t("stop_container", "Stop a running container", container_id="s:"),
    t("fetch_container_logs", "Fetch the logs of a container", container_id="s:", tail="i:"),
    t("pull_image", "Pull an image from a registry", repository="s:", tag="s:"),
    t("list_images", "List the images on the Docker host"),
)

TRACKER = server(
    "jira",
    t("jira_create_issue", "Create a new Jira issue with optional Epic link or parent for subtasks",
      project_key="s:The JIRA project key (e.g. 'PROJ')", summary="s:Summary/title of the issue",
      issue_type="s:Issue type (e.g. 'Task', 'Bug', 'Story')", description="s:"),
    t("jira_search", "Search Jira issues using JQL (Jira Query Language)",
      jql="s:JQL query string (e.g. 'project = PROJ AND status = \"In Progress\"')", limit="i:"),
    t("jira_get_issue", "Get details of a specific Jira issue including its Epic links and relationship "
      "information", issue_key="s:Jira issue key (e.g., 'PROJ-123')"),
    t("jira_transition_issue", "Transition a Jira issue to a new status", issue_key="s:", transition_id="s:"),
    t("jira_add_comment", "Add a comment to a Jira issue", issue_key="s:", comment="s:Comment text in Markdown"),
    t("jira_get_all_projects", "Get all Jira projects accessible to the current user"),
    t("jira_get_sprint_issues", "Get jira issues from sprint", sprint_id="s:"),
    t("jira_update_issue", "Update an existing Jira issue including changing status, adding Epic links, updating "
      "fields", issue_key="s:", fields="o:"),
)

DEVOPS = server(
    "ado",
    t("wit_get_work_item", "Get a single work item by ID", id="i:The ID of the work item", project="s:"),
    t("wit_create_work_item", "Create a new work item in a project", project="s:", workItemType="s:",
      fields="o:"),
    t("wit_my_work_items", "Retrieve a list of work items relevant to the authenticated user", project="s:"),
    t("wit_list_backlogs", "Retrieve a list of backlogs for a given project and team", project="s:", team="s:"),
    t("work_list_team_iterations", "Retrieve a list of iterations for a specific team in a project",
      project="s:", team="s:"),
    t("core_list_projects", "Retrieve a list of projects in your Azure DevOps organization"),
    t("build_get_builds", "Retrieves a list of builds for a given project", project="s:", definitions="a:"),
    t("build_run_build", "Triggers a new build for a specified definition", project="s:", definitionId="i:"),
    t("repo_list_pull_requests_by_repo", "Retrieve a list of pull requests for a given repository",
      repositoryId="s:", status="e:active|completed|abandoned|all:"),
    t("search_workitem", "Get work item search results for a given search text", searchText="s:",
      project="a:", areaPath="a:Filter by area paths", workItemType="a:"),
)

LOGS = server(
    "monitor",
    t("kusto_query", "Execute a KQL query against an Azure Data Explorer cluster", cluster="s:Cluster URI",
      database="s:Database name", query="s:The KQL query text"),
    t("logs_list_workspaces", "List the Log Analytics workspaces of a subscription", subscription="s:"),
    t("metrics_list", "List the metric definitions available for a resource", resource="s:"),
)

MAIL = server(
    "gmail",
    t("send_email", "Sends a new email", to="a:List of recipient email addresses", subject="s:", body="s:",
      cc="a:"),
    t("draft_email", "Draft a new email", to="a:", subject="s:", body="s:"),
    t("read_email", "Retrieves the content of a specific email", messageId="s:"),
    t("search_emails", "Searches for emails using Gmail search syntax", query="s:Gmail search query",
      maxResults="i:"),
    t("modify_email", "Modifies email labels (move to different folders)", messageId="s:", addLabelIds="a:",
      removeLabelIds="a:"),
    t("list_email_labels", "Retrieves all available Gmail labels"),
)

CALENDAR = server(
    "calendar",
    t("list_events", "List events from a calendar within a time range", calendarId="s:", timeMin="s:",
      timeMax="s:"),
    t("create_event", "Create a new calendar event", summary="s:", start="s:", end="s:", attendees="a:"),
    t("update_event", "Update an existing calendar event", eventId="s:", summary="s:", start="s:", end="s:"),
    t("delete_event", "Delete a calendar event", eventId="s:"),
    t("find_free_time", "Find free slots across calendars", timeMin="s:", timeMax="s:", duration="i:minutes"),
)

DRIVE = server(
    "gdrive",
    t("gdrive_search", "Search for files in Google Drive", query="s:Search query"),
    t("gdrive_read_file", "Read contents of a file from Google Drive", fileId="s:"),
    t("gdrive_upload_file", "Upload a local file to Google Drive", path="s:", folderId="s:"),
    t("gdrive_share_file", "Share a Drive file with a user by email", fileId="s:", email="s:", role="e:reader|"
      "commenter|writer:"),
    t("gsheets_update_cell", "Update a cell value in a Google Spreadsheet", fileId="s:", range="s:",
      value="s:"),
)

PDF = server(
    "pdf",
    t("merge_pdfs", "Merge several PDF files into one document", inputs="a:Paths of the input files",
      output="s:Path of the merged file"),
    t("split_pdf", "Split a PDF into one file per page range", input="s:", ranges="a:"),
    t("extract_text", "Extract the text of a PDF document, page by page", input="s:"),
    t("pdf_to_images", "Render the pages of a PDF as PNG images", input="s:", dpi="i:"),
)

SHELL = server(
    "shell",
    t("run_command", "Run a shell command and return its output", command="s:", cwd="s:"),
    t("ls", "List directory contents, like ls -la", path="s:"),
    t("which", "Locate a program on the PATH", program="s:"),
)

ERRORS = server(
    "sentry",
    t("get_sentry_issue", "Retrieve and analyze a Sentry issue by ID or URL", issue_id_or_url="s:"),
    t("list_project_issues", "List the unresolved issues of a Sentry project", project_slug="s:"),
    t("search_events", "Search error events of an organization", query="s:Sentry search query"),
)

PAYMENTS = server(
    "stripe",
    t("create_customer", "Create a customer in Stripe", name="s:", email="s:"),
    t("list_customers", "Fetch a list of customers from Stripe", email="s:", limit="i:"),
    t("create_product", "Create a product in Stripe", name="s:", description="s:"),
    t("create_price", "Create a price for a product in Stripe", product="s:", unit_amount="i:", currency="s:"),
    t("create_payment_link", "Create a payment link in Stripe", price="s:", quantity="i:"),
    t("create_invoice", "Create an invoice in Stripe", customer="s:", days_until_due="i:"),
    t("create_refund", "Refund a payment intent in Stripe", payment_intent="s:", amount="i:"),
    t("retrieve_balance", "Retrieve the balance from Stripe"),
)

MUSIC = server(
    "spotify",
    t("search_tracks", "Search Spotify for tracks, albums or artists", query="s:",
      type="e:track|album|artist|playlist:"),
    t("play", "Start or resume playback", uri="s:Spotify URI of the item to play"),
    t("pause", "Pause playback"),
    t("skip_to_next", "Skip to the next track"),
    t("get_now_playing", "Get the currently playing track"),
    t("add_to_queue", "Add a track to the playback queue", uri="s:"),
)

TASKS = server(
    "todoist",
    t("create_task", "Create one or more tasks in Todoist", content="s:", due_string="s:", priority="i:"),
    t("get_tasks", "Get a list of tasks from Todoist with various filters", filter="s:", project_id="s:"),
    t("update_task", "Update an existing task found by a name search", task_name="s:", content="s:",
      due_string="s:"),
    t("complete_task", "Mark a task as complete", task_name="s:"),
    t("delete_task", "Delete a task found by a name search", task_name="s:"),
)

PACKAGES = server(
    "registry",
    t("get_latest_version", "Latest published version of a package on PyPI or npm", package="s:",
      ecosystem="e:pypi|npm:"),
    t("get_package_info", "Metadata of a package: summary, license, homepage, dependencies", package="s:",
      ecosystem="e:pypi|npm:"),
    t("list_vulnerabilities", "Known vulnerabilities of a package version", package="s:", version="s:"),
)

ALL_SERVERS = (CODE_HOST + FILESYSTEM + GIT + [tool for group in WEB_SEARCH for tool in group]
               + [tool for group in NARROW_NEWS for tool in group] + FINANCE + CHAT + BROWSER + SCRAPER + DOCS
               + [tool for group in DATABASES for tool in group] + MEMORY + TIME + WEATHER + MAPS + CLUSTER
               + CONTAINERS + TRACKER + DEVOPS + LOGS + MAIL + CALENDAR + DRIVE + PDF + SHELL + ERRORS + PAYMENTS
               + MUSIC + TASKS + PACKAGES)


def merged(*exclude: list[dict]) -> list[dict]:
    """Every server above except those given (e.g. a catalogue with no finance server)."""
    dropped = {tool["name"] for group in exclude for tool in group}
    return [tool for tool in ALL_SERVERS if tool["name"] not in dropped]


def web_search_tools() -> set[str]:
    return {tool["name"] for group in WEB_SEARCH for tool in group if "search" in tool["name"]}


MORE_WEB_SEARCH = (
    server("serper",
           t("google_search", "Search the web with Google and return organic results, news and answer boxes",
             q="s:Search query", gl="s:Country code", num="i:Number of results")),
    server("bing",
           t("bing_web_search", "Search the internet with Bing", query="s:", count="i:"),
           t("bing_news_search", "Search news articles on the web with Bing", query="s:",
             freshness="e:Day|Week|Month:")),
    server("searxng",
           t("searxng_web_search", "Search the web through a SearXNG instance", query="s:", pageno="i:")),
)


# A news tool about one stock (it must be given a symbol) and a feed of technology headlines that covers AI: the
# first cannot answer a request for the news in general, the second is what "the big news in AI today" asks for.
STOCK_NEWS = server("markets",
                    t("get_news", "Get news for a given stock symbol.", symbol="!s:Stock symbol"),
                    t("get_stock_price", "Current price of a stock", symbol="!s:Stock symbol"))
TECH_FEED = server("techwire",
                   t("get_tech_news",
                     "Latest technology news from TechWire: software, cloud computing, AI and startups",
                     region="e:us|eu|asia:Edition"))
