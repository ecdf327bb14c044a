"""Gateway built-ins: Coffer's own tools (search, ask, remember), client-aware listing."""

from __future__ import annotations

import itertools
import os
import time
from typing import Callable

from coffer_src.errors import CofferError
from coffer_src.jsonrpc import EncodedResult, dumps, json_number, tool_error_result
from coffer_src.modern import META_CLIENT_CAPABILITIES, RequestClaims, shape_handshake_tool
from coffer_src.names import ASK_TOOL, REMEMBER_TOOL, RESERVED_SERVER, SEARCH_TOOL, SEPARATOR
from coffer_src.search.feedback import feedback_recorder
from coffer_src.search.preference import active_preference, preferred_search
from coffer_src.search.text import bounded_top_k
from coffer_src.terminal import redact

INSTRUCTIONS = (
    "Coffer is a gateway: the tools, prompts and resources of several MCP servers appear here, named "
    "<server>__<name>. When you are unsure which tool fits, call coffer__search_tools with what you want to do "
    "in plain words (e.g. 'create a GitHub issue'); it returns the best-matching real tools with their input "
    "schemas, which you then call by name."
)



SEARCH_TOOL_DEFINITION = {
    "name": SEARCH_TOOL,
    "title": "Search tools",
    "description": (
        "Find the right tool among every connected MCP server by describing what you want to do. Returns the "
        "best-matching tools with their full input schemas; call them by the returned name."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What you want to do, in plain words."},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "How many tools to return (1-20)."},
        },
        "required": ["query"],
    },
    "outputSchema": {
        "type": "object",
        "properties": {
            # Each item is said in words and only its keys are checked: the catalogue already holds every field
            # to its type, and a client that validates results (the Python SDK does, on every search) pays for every
            # nested keyword of every item returned.
            "tools": {"type": "array", "items": {
                "type": "object", "required": ["name", "inputSchema", "score"],
                "description": "A tool exactly as tools/list shows it (name, inputSchema and, when it has them, "
                               "title, description, outputSchema, annotations), plus 'score', its relevance to "
                               "the query (a number; higher is better)."}},
            "total_searched": {"type": "integer"},
            "ranker": {"type": "string"},
        },
        "required": ["tools", "total_searched"],
    },
    "annotations": {"readOnlyHint": True, "openWorldHint": False},
}

ASK_TOOL_DEFINITION = {
    "name": ASK_TOOL,
    "title": "Ask the user's notes and docs",
    "description": (
        "Search the user's own documents and remembered facts (the folders and notes they keep in Coffer) and get "
        "the passages that answer a question, each with its file, heading and line numbers; when the client can, "
        "also a short answer citing them. Use it before asking the user something they may have written down."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "question": {"type": "string", "description": "What you want to know, in plain words."},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "How many passages to return (1-20)."},
            "sources": {"type": "array", "items": {"type": "string"},
                        "description": "Only these knowledge sources (names from the user's setup; 'memory' for "
                                       "remembered facts)."},
        },
        "required": ["question"],
    },
    "outputSchema": {
        "type": "object",
        "properties": {
            "passages": {"type": "array", "items": {"type": "object", "properties": {
                "source": {"type": "string"}, "path": {"type": "string"}, "file": {"type": "string"},
                "heading": {"type": "string"}, "lines": {"type": "array", "items": {"type": "integer"}},
                "text": {"type": "string"}, "score": {"type": "number"}}}},
            "total_searched": {"type": "integer"},
            "ranker": {"type": "string"},
            "answer": {"type": "string"},
        },
        "required": ["passages", "total_searched"],
    },
    "annotations": {"readOnlyHint": True, "openWorldHint": False},
}

REMEMBER_TOOL_DEFINITION = {
    "name": REMEMBER_TOOL,
    "title": "Remember a fact for every agent",
    "description": (
        "Keep a fact the user (or you) want every agent to know later -- a decision, a preference, a convention, "
        "where something lives. It is stored as a small note in the user's Coffer, which they can read and edit, "
        "and coffer__ask finds it. Keep it short and self-contained; never store secrets."),
    "inputSchema": {
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": "The fact, in one or a few sentences."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "A few words to file it under."},
        },
        "required": ["text"],
    },
    "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False,
                    "openWorldHint": False},
}

ASK_SAMPLING_BUDGET = 30.0  # seconds coffer__ask may spend on the client's model, both calls together

CLIENT_SIDE_CAPABILITIES = ("sampling", "elicitation", "roots")



# -- client-aware listing ---------------------------------------------------------------------------------------
# Some clients show only so many tools (Cursor about 40, Windsurf 100, VS Code 128) and drop the rest in an order
# nobody chose; Claude Code searches its tools itself and wants them all.  With expose "auto" (the default) a
# client known to cap gets, when the catalogue is larger, a budget of the tools most likely wanted; every tool
# stays callable by name and findable with coffer__search_tools.

CLIENT_FAMILIES = (("claude-code", "claude-code"), ("cursor", "cursor"), ("windsurf", "windsurf"),
                   ("codeium", "windsurf"), ("visual studio code", "vscode"), ("vscode", "vscode"),
                   ("codex", "codex"), ("gemini", "gemini"), ("zed", "zed"), ("claude", "claude-desktop"))
CLIENT_TOOL_CAPS = {"cursor": 40, "windsurf": 100, "vscode": 128}


def client_family(client_name: str) -> str | None:
    """The client a clientInfo.name belongs to (its settings key: expose.<family>), or None."""
    name = client_name.lower()
    return next((family for needle, family in CLIENT_FAMILIES if needle in name), None)


def client_instructions(note: str, catalogue_size: int, listed: int, page_size: int, knowledge_tools: list[dict],
                        login: list[str], failed: list[str]) -> str:
    """What a client's model reads about Coffer (initialize's instructions): how to find tools, ``note`` (its
    profile), how many of the ``catalogue_size`` tools are not among the ``listed`` or past the first page, its
    knowledge tools, and the servers waiting for a ``login`` or ``failed`` at their last start."""
    instructions = INSTRUCTIONS + note
    unlisted = catalogue_size + 1 + len(knowledge_tools) - listed
    if unlisted > 0:
        instructions += (f" To fit this client, {unlisted} tools are not listed; every one is still callable "
                         f"by name and {SEARCH_TOOL} finds them.")
    later = listed - page_size
    if later > 0:
        instructions += (f" tools/list has more than one page: {later} tools follow its first page (nextCursor);"
                         f" every one is callable by name and {SEARCH_TOOL} finds them.")
    if knowledge_tools:
        instructions += (f" {ASK_TOOL} searches the user's own notes and docs"
                         + (f", and {REMEMBER_TOOL} keeps a fact for every agent" if len(knowledge_tools) > 1
                            else "") + ".")
    if login:
        instructions += (" Waiting for the user to log in (in a terminal: coffer auth NAME): "
                         + ", ".join(login)[:200] + ".")
    if failed:
        instructions += " Failed at their last start: " + ", ".join(failed)[:200] + "."
    return instructions[:800]


def knowledge_tools_for(has_sources: bool, memory: bool) -> list[dict]:
    """Coffer's knowledge tools a client is shown: coffer__ask once there is something to ask (a source, or memory
    on), coffer__remember while memory is on."""
    return ([ASK_TOOL_DEFINITION] if has_sources or memory else []) + ([REMEMBER_TOOL_DEFINITION] if memory else [])


def tools_for_client(tools: list[dict], knowledge_tools: list[dict], mode: str, usage: dict[str, int],
                     pinned: Callable[[list[dict], list[dict]], list[dict]] | None = None) -> list[dict]:
    """What a client is shown, for an expose ``mode`` (expose_mode): Coffer's own tools first, then the catalogue,
    within the budget, plus what ``pinned(listed, tools)`` adds (a profile's pinned tools).  The one rule for the
    gateway's tools/list and `coffer tools --client/--profile`."""
    builtins = [SEARCH_TOOL_DEFINITION] + knowledge_tools
    listed = [] if mode == "search" else tools
    if mode.startswith("budget:"):
        listed = budget_tools(tools, int(mode.partition(":")[2]) - len(builtins) + 1, usage)
    return builtins + (listed if pinned is None else pinned(listed, tools))


def expose_mode(settings: dict, family: str | None) -> str:
    """all, search or budget:N for this client: its own expose.<family> setting, else the global one; auto means
    a budget of the client's known cap, else all."""
    value = (settings.get(f"expose.{family}") if family else None) or settings["expose"]
    if value == "auto":
        cap = CLIENT_TOOL_CAPS.get(family or "")
        return f"budget:{cap}" if cap else "all"
    return value


def _caution(tool: dict) -> int:
    """0 for a tool its annotations say only reads, 2 for one that may destroy, 1 otherwise: what a budget picks
    first among tools used alike (a listed read-only tool is the safe way to show a server exists)."""
    annotations = tool.get("annotations") if isinstance(tool.get("annotations"), dict) else {}
    if annotations.get("readOnlyHint") is True:
        return 0
    return 2 if annotations.get("destructiveHint") is not False else 1


def budget_tools(tools: list[dict], cap: int, usage: dict[str, int]) -> list[dict]:
    """At most ``cap - 1`` tools (coffer__search_tools takes the last place), in catalogue order: first the most
    used tool of each server (so every server stays visible), then the most used of the rest over the last 90
    days; among tools used alike, read-only ones (annotations) before the rest and destructive ones last, then
    catalogue order, so the same inputs always give the same list."""
    room = cap - 1
    if len(tools) <= room:
        return tools
    order = {id(tool): i for i, tool in enumerate(tools)}
    key = lambda tool: (-usage.get(tool["name"], 0), _caution(tool), order[id(tool)])  # noqa: E731
    best_of_server: dict[str, dict] = {}
    for tool in sorted(tools, key=key):
        best_of_server.setdefault(tool["name"].partition(SEPARATOR)[0], tool)
    chosen = sorted(best_of_server.values(), key=key)[:room]
    picked = {id(tool) for tool in chosen}
    chosen += [tool for tool in sorted(tools, key=key) if id(tool) not in picked][:room - len(chosen)]
    return sorted(chosen, key=lambda tool: order[id(tool)])


def search_tools_result(tools: list[dict], encoded: list[str], total_searched: int, ranker: str) -> EncodedResult:
    """coffer__search_tools's result: the payload as structuredContent and, as JSON, in a text block.  ``encoded``
    is each of ``tools`` as JSON, so the payload is encoded once, from them, and the reply is written from that
    text (jsonrpc.EncodedResult): a search returns whole input schemas, several kilobytes of them.  The texts
    below spell out the dicts beside them, key for key."""
    payload = {"tools": tools, "total_searched": total_searched, "ranker": ranker}
    text = f'{{"tools":[{",".join(encoded)}],"total_searched":{dumps(total_searched)},"ranker":{dumps(ranker)}}}'
    return EncodedResult({"content": [{"type": "text", "text": text}], "structuredContent": payload},
                         f'{{"content":[{{"type":"text","text":{dumps(text)}}}],"structuredContent":{text}}}')


class BuiltinTools:
    """Coffer's own tools for one session: coffer__search_tools over the hub's catalogue, coffer__ask and
    coffer__remember over the hub's knowledge base.  Each runs on a worker thread, or on the client's reader
    thread when it is cheap; each logs who, when, how long and the outcome, never the words asked."""

    def __init__(self, session):
        self.session = session
        self.hub = session.hub

    def _record(self, tool: str, started: float, outcome: str, detail: str | None = None) -> None:
        self.hub.log.record(self.session.client_name, RESERVED_SERVER, tool, "tool", started, outcome, detail,
                            self.session.view.name)

    def search(self, arguments: dict, started: float) -> dict:
        def fail(text):
            self._record(SEARCH_TOOL, started, "error", text)
            return tool_error_result(text)

        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return fail("query must be a non-empty string")
        try:
            top_k = bounded_top_k(arguments.get("top_k"))
        except ValueError as exc:
            return fail(str(exc))
        catalogue = self.session.catalogue  # the client's profile's tools only, under their overridden names
        index = catalogue.index
        hits, ranker, note, _ = preferred_search(index, self.hub.semantic, query, top_k,
                                                 active_preference(self.hub.settings, self.hub.vault.path))
        # Each tool exactly as tools/list shows it to this client (a handshake-era client gets an outputSchema that
        # is not an object wrapped), plus its score; its JSON from the catalogue's memo, the score spliced in.
        handshake = self.session.client_era != "modern" and catalogue.handshake_tools is not catalogue.tools
        tools, encoded = [], []
        for tool, score in hits:
            shown = {**(shape_handshake_tool(tool)[0] if handshake else tool), "score": score}
            tools.append(shown)
            definition = catalogue.tool_json(tool, handshake)
            # (a tool's own "score" field is replaced in its place, as the dict above does; an empty definition
            # has no field to put the score after)
            encoded.append(dumps(shown) if "score" in tool or len(definition) < 3
                           else f'{definition[:-1]},"score":{json_number(score)}}}')
        self._record(SEARCH_TOOL, started, "ok", note)
        if self.hub.settings["search_feedback"] == "on":  # the user's own labels for `coffer eval`
            feedback_recorder(self.hub.vault.path).searched(self.session, self.session.client_name, query, ranker,
                                                            [tool["name"] for tool, _ in hits])
        return search_tools_result(tools, encoded, len(index), ranker)

    @staticmethod
    def _sampling_params(prompt: str, max_tokens: int) -> dict:
        return {"messages": [{"role": "user", "content": {"type": "text", "text": prompt}}], "maxTokens": max_tokens,
                "includeContext": "none",
                "systemPrompt": "You help a retrieval tool. Follow the instructions exactly and be brief."}

    @staticmethod
    def _sampled_text(result) -> str | None:
        """The text of a CreateMessageResult (a client's answer), or None."""
        content = result.get("content") if isinstance(result, dict) else None
        if isinstance(content, list):  # 2025-11-25 allows a list of content blocks
            content = next((c for c in content if isinstance(c, dict) and c.get("type") == "text"), None)
        text = content.get("text") if isinstance(content, dict) else None
        return text.strip()[:8000] if isinstance(text, str) and text.strip() else None

    def _sample_text(self, prompt: str, max_tokens: int, deadline: float) -> str | None:
        """One sampling/createMessage round trip to a handshake-era client's model: its text, or None."""
        remaining = deadline - time.monotonic()
        if remaining <= 1.0:
            return None
        return self._sampled_text(self.session.request_client("sampling/createMessage",
                                                      self._sampling_params(prompt, max_tokens), remaining))

    def _note_headings(self, hits, sources) -> list[str]:
        """Up to three headings of the user's notes (those of the passages found first, else the first indexed):
        they show the client's model which language the notes are written in."""
        passages = itertools.chain(hits, itertools.islice(self.hub.knowledge.passages(sources), 50))
        headings = dict.fromkeys(
            (hit.heading.rpartition(" > ")[2] or hit.text.strip().partition("\n")[0]).strip()[:80] for hit in passages)
        return [heading for heading in headings if heading][:3]

    @staticmethod
    def _rewrite_prompt(question: str, headings=()) -> str:
        """The rewrite into search queries, in the language the notes are written in: a question may come in
        another (``headings``: see _note_headings)."""
        shown = "; ".join(f'"{heading}"' for heading in headings)
        return ("Rewrite this question into at most three short search queries for a keyword search over the "
                "user's notes, one per line, nothing else. Write the queries in the language the notes are written "
                f"in, which may not be the question's{'; headings from the notes: ' + shown if shown else ''}."
                f"\n\nQuestion: {question[:2000]}")

    @staticmethod
    def _answer_prompt(question: str, hits) -> str:
        numbered = "\n\n".join(f"[{i}] {h.path} ({h.heading}):\n{h.text[:3000]}" for i, h in enumerate(hits, 1))
        return ("Answer the question using only the numbered passages below, citing them like [1]. If they do not "
                f"answer it, say so.\n\nQuestion: {question[:2000]}\n\nPassages:\n{numbered}")

    @staticmethod
    def _queries(rewritten: str | None) -> list[str]:
        lines = [line.strip(" -*0123456789.") for line in (rewritten or "").splitlines()]
        return [line[:300] for line in lines if line][:3]

    def ask(self, arguments: dict, started: float, params: dict | None = None, claims: RequestClaims | None = None,
            responses: dict | None = None) -> dict:
        """coffer__ask: the passages that answer a question; with the client's sampling (and ask_synthesis on), at
        most two calls to its model -- a rewrite into search queries, and an answer citing passage numbers --
        within ASK_SAMPLING_BUDGET.  A handshake-era client is asked with sampling requests; a 2026-07-28 client
        with input_required rounds (``claims`` sealed in a retry's requestState, ``responses`` its
        inputResponses).  The passages
        are returned whatever the model does.  The log gets who, when, how long and the outcome: never the
        question, a passage or the answer."""
        def fail(text):
            self._record(ASK_TOOL, started, "error", text)
            return tool_error_result(text)

        question = arguments.get("question")
        sources = arguments.get("sources")
        if not isinstance(question, str) or not question.strip():
            return fail("question must be a non-empty string")
        if sources is not None and not (isinstance(sources, list) and all(isinstance(x, str) for x in sources)):
            return fail("sources must be a list of source names")
        claims, responses = claims or RequestClaims(), responses or {}
        try:
            top_k = bounded_top_k(arguments.get("top_k"))
            sources = self.session.view.ask_sources(sources)  # within the client's profile
            answer = self.hub.knowledge.ask(question, top_k, sources)
            hits, notes = list(answer.passages), [answer.note] if answer.note else []
            queries = list(claims.queries)
            if claims.ask_stage == 1:
                queries = self._queries(self._sampled_text(responses.get("coffer-rewrite")))
            if queries:
                merged = {(h.source, h.path, tuple(h.lines)): h for h in hits}
                for query in queries:
                    for hit in self.hub.knowledge.ask(str(query), top_k, sources).passages:
                        key = (hit.source, hit.path, tuple(hit.lines))
                        if key not in merged or hit.score > merged[key].score:
                            merged[key] = hit
                hits = sorted(merged.values(), key=lambda h: -h.score)[:top_k]
        except (ValueError, CofferError) as exc:
            return fail(str(exc))
        synthesis = None
        wanted = self.hub.settings["ask_synthesis"] == "on" and bool(hits)
        # The rewrite may find what the question's own words did not (notes in another language than the
        # question): it is asked for even when they found nothing, if there is anything to search.
        rewrite = self.hub.settings["ask_synthesis"] == "on" and answer.total_searched > 0
        if self.session.client_era == "modern":
            meta = (params or {}).get("_meta") if isinstance((params or {}).get("_meta"), dict) else {}
            caps = meta.get(META_CLIENT_CAPABILITIES) if isinstance(meta.get(META_CLIENT_CAPABILITIES), dict) else {}
            first = claims.first_asked if claims.first_asked is not None else time.time()
            in_time = time.time() - first < ASK_SAMPLING_BUDGET
            if isinstance(caps.get("sampling"), dict) and in_time and (
                    claims.ask_stage is None and rewrite or claims.ask_stage == 1 and wanted):
                stage, prompt, tokens = ((1, self._rewrite_prompt(question, self._note_headings(hits, sources)), 200)
                                         if claims.ask_stage is None
                                         else (2, self._answer_prompt(question, hits), 600))
                key = "coffer-rewrite" if stage == 1 else "coffer-answer"
                state = self.session.bridge.sealer.seal("tools/call", params, RequestClaims(
                    ask_stage=stage, queries=tuple(queries), first_asked=int(first)))
                return {"resultType": "input_required", "requestState": state, "inputRequests": {
                    key: {"method": "sampling/createMessage", "params": self._sampling_params(prompt, tokens)}}}
            if claims.ask_stage == 2:
                synthesis = self._sampled_text(responses.get("coffer-answer"))
        elif rewrite and "sampling" in self.session.client_capabilities and not claims.is_ask_round:
            deadline = time.monotonic() + ASK_SAMPLING_BUDGET
            prompt = self._rewrite_prompt(question, self._note_headings(hits, sources))
            queries = self._queries(self._sample_text(prompt, 200, deadline))
            if queries:
                return self.ask(arguments, started, params,
                                RequestClaims(ask_stage=0, queries=tuple(queries), deadline=deadline))
            if wanted:
                synthesis = self._sample_text(self._answer_prompt(question, hits), 600, deadline)
        if claims.ask_stage == 0 and wanted:  # the handshake era's second step (after the rewrite)
            synthesis = self._sample_text(self._answer_prompt(question, hits), 600, claims.deadline)
        if wanted and synthesis is None and (claims.is_ask_round or "sampling" in self.session.client_capabilities):
            notes.append("no answer from the client's model; passages only")
        # Each passage with the absolute path of its file (an agent can open it), and which ranker answered, as
        # coffer__search_tools says.
        roots = {source.name: source.root for source in self.hub.knowledge.sources()}
        payload = {"passages": [{**hit.to_dict(), "file": os.path.join(roots.get(hit.source, ""), *hit.path.split("/"))}
                                for hit in hits],
                   "total_searched": answer.total_searched, "ranker": answer.ranker}
        if synthesis:
            payload["answer"] = synthesis
        self._record(ASK_TOOL, started, "ok", "; ".join(notes) or None)
        return {"content": [{"type": "text", "text": dumps(payload)}], "structuredContent": payload}

    def remember(self, arguments: dict, started: float) -> dict:
        text, tags = arguments.get("text"), arguments.get("tags") or []
        try:
            if not isinstance(text, str) or not text.strip():
                raise CofferError("text must be a non-empty string")
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise CofferError("tags must be a list of words")
            note_id = self.hub.knowledge.remember(redact(text), tags, client=self.session.client_name)
        except CofferError as exc:
            self._record(REMEMBER_TOOL, started, "error", str(exc))
            return tool_error_result(str(exc))
        self._record(REMEMBER_TOOL, started, "ok")
        payload = {"id": note_id, "stored": True}
        return {"content": [{"type": "text", "text": f"Remembered as {note_id}."}], "structuredContent": payload}
