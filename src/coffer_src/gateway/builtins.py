"""Gateway built-ins: Coffer's own tools and client-aware listing."""

from __future__ import annotations

from dataclasses import dataclass

from coffer_src.jsonrpc import INVALID_PARAMS, RpcError
from coffer_src.names import ASK_TOOL, REMEMBER_TOOL, SEARCH_TOOL, SEPARATOR

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
            "tools": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "inputSchema": {"type": "object"}, "score": {"type": "number"}}}},
            "total_searched": {"type": "integer"},
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
                "source": {"type": "string"}, "path": {"type": "string"}, "heading": {"type": "string"},
                "lines": {"type": "array", "items": {"type": "integer"}}, "text": {"type": "string"},
                "score": {"type": "number"}}}},
            "total_searched": {"type": "integer"},
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


def _require_str(params: dict, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise RpcError(INVALID_PARAMS, f"'{key}' must be a non-empty string")
    return value


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


def expose_mode(settings: dict, family: str | None) -> str:
    """all, search or budget:N for this client: its own expose.<family> setting, else the global one; auto means
    a budget of the client's known cap, else all."""
    value = (settings.get(f"expose.{family}") if family else None) or settings["expose"]
    if value == "auto":
        cap = CLIENT_TOOL_CAPS.get(family or "")
        return f"budget:{cap}" if cap else "all"
    return value


def budget_tools(tools: list[dict], cap: int, usage: dict[str, int]) -> list[dict]:
    """At most ``cap - 1`` tools (coffer__search_tools takes the last place), in catalogue order: first the most
    used tool of each server (so every server stays visible), then the most used of the rest over the last 90
    days; ties go to catalogue order, so the same inputs always give the same list."""
    room = cap - 1
    if len(tools) <= room:
        return tools
    order = {id(tool): i for i, tool in enumerate(tools)}
    key = lambda tool: (-usage.get(tool["name"], 0), order[id(tool)])  # noqa: E731
    best_of_server: dict[str, dict] = {}
    for tool in sorted(tools, key=key):
        best_of_server.setdefault(tool["name"].partition(SEPARATOR)[0], tool)
    chosen = sorted(best_of_server.values(), key=key)[:room]
    picked = {id(tool) for tool in chosen}
    chosen += [tool for tool in sorted(tools, key=key) if id(tool) not in picked][:room - len(chosen)]
    return sorted(chosen, key=lambda tool: order[id(tool)])


@dataclass
class Question:
    """A request an upstream asked the client mid-call, parked for a 2026-07-28 client (which answers it by
    retrying the call with inputResponses)."""
    upstream_id: object
    method: str
    params: dict
    asked: bool = False     # already sent to the client in an input_required result
