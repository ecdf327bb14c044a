"""Vault rows: a server's definition and a capability's pin, as coffer.db stores them."""

from __future__ import annotations

import difflib
import itertools
import json
import re

from coffer_src.digests import sha256
from coffer_src.jsonrpc import walked_items
from coffer_src.names import RESERVED_SERVER, SERVER_NAME_RE

TRANSPORTS = ("stdio", "http", "sse", "auto")
SHARING_MODES = ("shared", "per-client")


def vault_json(value) -> str:
    """JSON for a vault column: ASCII, so no string an upstream sent (a lone surrogate included) can fail the
    write, and it decodes back to exactly the same value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


# What a definition's pin covers: everything the model reads or the call depends on, not the volatile fields
# (a resource's size or modification time changes with its content, not with its meaning).
_UNPINNED_FIELDS = {"tool": ("_meta",), "prompt": ("_meta",), "resource": ("_meta", "size", "annotations"),
                    "template": ("_meta", "annotations")}


def fingerprint(definition: dict, kind: str = "tool") -> str:
    pinned = {k: v for k, v in definition.items() if k not in _UNPINNED_FIELDS.get(kind, ())}
    return sha256(json.dumps(pinned, sort_keys=True, ensure_ascii=True).encode("ascii")).hexdigest()[:16]


# C0 and C1 control characters but newline and tab: an ESC or an OSC 52 sequence in a description would be obeyed
# by the terminal of a client that prints it (a clipboard write, a retitled window), and no client needs them.
_CONTROLS_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_TEXT_KEYS = ("name", "title", "description")
_INSTANCE_KEYS = frozenset({"const", "enum", "default", "examples"})  # data in a schema: never rewritten


def without_controls(text: str) -> str:
    """``text`` without C0/C1 control characters (newlines and tabs kept)."""
    return _CONTROLS_RE.sub("", text) if _CONTROLS_RE.search(text) else text


def _schema_without_controls(node, depth: int = 0):
    """A JSON schema whose titles and descriptions hold no control characters (instance data left as it is).  A
    part with nothing to remove is returned itself, not copied (a caller that changes the result copies first)."""
    if depth > 64:
        return node
    if isinstance(node, list):
        return walked_items(node, _schema_without_controls, depth)
    if not isinstance(node, dict):
        return node
    cleaned = None
    for i, (key, value) in enumerate(node.items()):
        new_value = (without_controls(value) if key in ("title", "description") and isinstance(value, str) else
                     value if key in _INSTANCE_KEYS else _schema_without_controls(value, depth + 1))
        if cleaned is None and new_value is not value:
            cleaned = dict(itertools.islice(node.items(), i))
        if cleaned is not None:
            cleaned[key] = new_value
    return node if cleaned is None else cleaned


def definition_without_controls(kind: str, item: dict) -> dict:
    """A definition whose names, titles and descriptions (its schemas' too) hold no control characters; its
    identifier (a tool's or prompt's name, a resource's URI) is left alone: one holding a control is rejected."""
    item = dict(item)
    for key in _TEXT_KEYS:
        if isinstance(item.get(key), str) and not (key == "name" and kind in ("tool", "prompt")):
            item[key] = without_controls(item[key])
    annotations = item.get("annotations")
    if isinstance(annotations, dict) and isinstance(annotations.get("title"), str):
        item["annotations"] = {**annotations, "title": without_controls(annotations["title"])}
    for key in ("inputSchema", "outputSchema"):
        if isinstance(item.get(key), dict):
            item[key] = _schema_without_controls(item[key])
    if isinstance(item.get("arguments"), list):
        item["arguments"] = [{k: without_controls(v) if k in _TEXT_KEYS and isinstance(v, str) else v
                              for k, v in argument.items()} if isinstance(argument, dict) else argument
                             for argument in item["arguments"]]
    return item


def definition_diff(before: str | None, after: str | None) -> str:
    """A readable unified diff of two stored definitions (pretty JSON, keys sorted)."""
    def lines(text):
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            value = text
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    return "\n".join(difflib.unified_diff(lines(before), lines(after), "approved", "now listed", lineterm=""))


def _json_column(text, kind, default):
    if text in (None, ""):
        return default
    value = json.loads(text)
    if not isinstance(value, kind):
        raise ValueError(f"expected a JSON {kind.__name__}")
    return value


def server_row(row) -> dict:
    """A servers row as a dict; a row that does not parse is kept (so `list` and `remove` can see it) but marked
    ``damaged`` with the reason and never started."""
    server = dict(row)
    server.setdefault("inherit_env", "[]")
    server.setdefault("updates", "pin")
    server.setdefault("oauth", None)
    server.setdefault("era", None)
    if server["era"] not in (None, "handshake", "modern"):
        server["era"] = None
    if server.setdefault("sharing", "shared") not in SHARING_MODES:
        server["sharing"] = "shared"
    server.setdefault("sharing_reason", None)
    try:
        if not isinstance(server["name"], str) or not SERVER_NAME_RE.match(server["name"]) or \
                server["name"].lower() == RESERVED_SERVER:
            raise ValueError("its name is not a valid server name")
        command = _json_column(server["command"], list, None)
        if command is not None and not (command and all(isinstance(a, str) for a in command)):
            raise ValueError("command is not a list of strings")
        server["command"] = command
        for key in ("env", "headers"):
            server[key] = _json_column(server[key], dict, {})
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in server[key].items()):
                raise ValueError(f"{key} holds a value that is not text")
        server["inherit_env"] = [str(x) for x in _json_column(server["inherit_env"], list, [])]
        if server["transport"] not in TRANSPORTS:
            raise ValueError(f"unknown transport {server['transport']!r}")
        if (server["transport"] == "stdio") != bool(command) or (server["transport"] != "stdio"
                                                                and not isinstance(server["url"], str)):
            raise ValueError("neither a command nor a URL to reach it")
        if server["timeout"] is not None and not (isinstance(server["timeout"], (int, float))
                                                  and server["timeout"] > 0):
            raise ValueError("timeout is not a positive number")
        server["damaged"] = None
        server["enabled"] = bool(server["enabled"])
    except (ValueError, TypeError) as exc:
        server.update(damaged=str(exc)[:200], enabled=False, command=None, env={}, headers={}, inherit_env=[])
    for key in ("capabilities", "oauth"):
        try:
            server[key] = _json_column(server.get(key), dict, None)
        except (ValueError, TypeError):
            server[key] = None  # forgotten: as if never started, or never given OAuth settings
    return server
