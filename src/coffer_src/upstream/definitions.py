"""Upstream definitions: the checks every tool, prompt and resource passes."""

from __future__ import annotations

import itertools

from coffer_src.errors import CofferException
from coffer_src.jsonrpc import UPSTREAM_ERROR, dumps, rpc_error, walked_items
from coffer_src.terminal import printable
from coffer_src.transport.http import valid_header_name
from coffer_src.vault import storable
from coffer_src.vault_rows import definition_without_controls

# -- what an upstream may say, checked at the boundary -------------------------------------------------------
# An upstream is code nobody here wrote.  Its definitions are validated before they reach the catalogue (one bad
# tool must not make a client reject the whole list), its replies are rebuilt as well-formed JSON-RPC, and only
# the requests and notifications the protocol defines are relayed to the client.

SERVER_REQUEST_NEEDS = {"sampling/createMessage": "sampling", "elicitation/create": "elicitation",
                        "roots/list": "roots"}
RELAYED_NOTIFICATIONS = frozenset({"notifications/message", "notifications/progress", "notifications/cancelled",
                                   "notifications/resources/updated", "notifications/elicitation/complete"})
LIST_CHANGED = {"notifications/tools/list_changed": ("tool",), "notifications/prompts/list_changed": ("prompt",),
                "notifications/resources/list_changed": ("resource", "template")}
MAX_DEFINITION_BYTES = 1 << 20
MAX_DESCRIPTION_CHARS = 32_768
MAX_NAME_CHARS = 1024
_ANNOTATION_HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
_IDENTIFIER = {"tool": "name", "prompt": "name", "resource": "uri", "template": "uriTemplate"}


class Rejected(CofferException, ValueError):
    """A definition that cannot be repaired safely: it is dropped, with a warning and an audit row."""


def _clean_strings(value, depth: int = 0):
    """``value`` with every lone surrogate replaced (so it can be stored and relayed), at most 64 levels deep.
    A dict or list with nothing to replace is returned itself, not copied: a catalogue's definitions are then
    the objects its listing was parsed into, not a second set of them (the caller copies what it changes)."""
    if depth > 64:
        raise Rejected("nested more than 64 levels deep")
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        cleaned = None
        for i, (key, item) in enumerate(value.items()):
            new_key, new_item = storable(key), _clean_strings(item, depth + 1)
            if cleaned is None and (new_key is not key or new_item is not item):
                cleaned = dict(itertools.islice(value.items(), i))
            if cleaned is not None:
                cleaned[new_key] = new_item
        return value if cleaned is None else cleaned
    if isinstance(value, list):
        return walked_items(value, _clean_strings, depth)
    return value


HEADER_TYPES = ("string", "integer", "boolean")   # what an x-mcp-header may mark (a value with one spelling)


def header_parameters(tool: dict) -> dict[str, str]:
    """{argument: header name} of a tool's top-level arguments marked ``x-mcp-header`` (MCP 2026-07-28: a client
    mirrors their values into Mcp-Param-<Name> headers).  Rejected when a mark is invalid -- empty, not an HTTP
    token, used twice (case-insensitively), or on an argument that is not a string, integer or boolean -- since
    the spec has a client exclude such a tool rather than guess."""
    schema = tool.get("inputSchema")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    found: dict[str, str] = {}
    seen: set[str] = set()
    for argument, prop in (properties.items() if isinstance(properties, dict) else ()):
        if not isinstance(prop, dict) or "x-mcp-header" not in prop:
            continue
        name = prop["x-mcp-header"]
        if not valid_header_name(name):
            raise Rejected(f"its argument {printable(str(argument))[:60]!r} has an invalid x-mcp-header")
        if name.lower() in seen:
            raise Rejected(f"two of its arguments name the x-mcp-header {name!r}")
        if prop.get("type") not in HEADER_TYPES:
            raise Rejected(f"its x-mcp-header {name!r} marks an argument that is not a string, integer or boolean")
        seen.add(name.lower())
        found[argument] = name
    return found


def check_definition(kind: str, item) -> dict:
    """A tool, prompt, resource or template an upstream listed, repaired where that is safe, else Rejected.

    Repaired: a missing inputSchema (an object schema), a schema without "type", optional fields of the wrong type
    (dropped), over-long descriptions (cut), lone surrogates in text (replaced), control characters in names, titles
    and descriptions (removed; an identifier holding one is rejected).  Rejected: no usable identifier,
    an inputSchema that is not an object schema, a definition over 1 MiB or nested over 64 levels.
    """
    if not isinstance(item, dict):
        raise Rejected("not a JSON object")
    key = _IDENTIFIER[kind]
    ident = item.get(key)
    if not isinstance(ident, str) or not ident.strip():
        raise Rejected(f"no {key}")
    if len(ident) > (MAX_NAME_CHARS if key == "name" else 8 * MAX_NAME_CHARS) or not ident.isprintable():
        raise Rejected(f"its {key} is too long or holds control characters")
    try:
        if len(dumps(item)) > MAX_DEFINITION_BYTES:
            raise Rejected(f"larger than {MAX_DEFINITION_BYTES} bytes")
    except (ValueError, TypeError, RecursionError) as exc:
        raise Rejected(f"not plain JSON ({exc.__class__.__name__})") from None
    item = dict(_clean_strings(item))  # its own top level: changed below; what it shares is not
    for text_field in ("title", "description", "mimeType"):
        if text_field in item and not isinstance(item[text_field], str):
            del item[text_field]
    if isinstance(item.get("description"), str) and len(item["description"]) > MAX_DESCRIPTION_CHARS:
        item["description"] = item["description"][:MAX_DESCRIPTION_CHARS] + " [cut by coffer]"
    for dict_field in ("_meta", "annotations", "execution"):
        if dict_field in item and not isinstance(item[dict_field], dict):
            del item[dict_field]
    if "icons" in item and not (isinstance(item["icons"], list) and all(
            isinstance(icon, dict) and isinstance(icon.get("src"), str) for icon in item["icons"])):
        del item["icons"]
    if kind == "tool":
        schema = item.get("inputSchema")
        if schema is None:
            item["inputSchema"] = {"type": "object"}
        elif not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise Rejected("its inputSchema is not a JSON object schema")
        else:
            if "properties" in schema and not isinstance(schema["properties"], dict):
                raise Rejected("its inputSchema properties are not an object")
            if "required" in schema and not (isinstance(schema["required"], list) and
                                             all(isinstance(r, str) for r in schema["required"])):
                schema = {k: v for k, v in schema.items() if k != "required"}
            item["inputSchema"] = schema if "type" in schema else {"type": "object", **schema}
            header_parameters(item)  # an invalid x-mcp-header mark is refused (2026-07-28 server/tools)
        if "outputSchema" in item and not isinstance(item["outputSchema"], (dict, bool)):
            del item["outputSchema"]  # not a JSON Schema at all (2026-07-28 allows any schema; the catalogue wraps
            # a non-object one for a handshake-era client)
        annotations = item.get("annotations")
        if isinstance(annotations, dict):
            item["annotations"] = {k: v for k, v in annotations.items()
                                   if not ((k in _ANNOTATION_HINTS and not isinstance(v, bool)) or
                                           (k == "title" and not isinstance(v, str)))}
    elif kind == "prompt":
        arguments = item.get("arguments")
        if arguments is not None:
            if not isinstance(arguments, list):
                del item["arguments"]
            else:
                item["arguments"] = [
                    {k: v for k, v in argument.items() if not (k == "required" and not isinstance(v, bool))
                     and not (k in ("description", "title") and not isinstance(v, str))}
                    for argument in arguments if isinstance(argument, dict) and isinstance(argument.get("name"), str)]
    else:
        if not isinstance(item.get("name"), str):
            item["name"] = ident
        if "size" in item and not (isinstance(item["size"], int) and not isinstance(item["size"], bool)
                                   and item["size"] >= 0):
            del item["size"]
    return definition_without_controls(kind, item)


def normalized_reply(message: dict) -> dict:
    """An upstream's reply as well-formed JSON-RPC: exactly one of ``result`` (an object) or ``error`` ({code: int,
    message: str}).  Anything else (an error that is a string, both members, no jsonrpc...) becomes an error that
    says so, so a client is never handed a reply it cannot parse and wait forever."""
    msg_id = message.get("id")
    has_result, has_error = "result" in message, "error" in message
    if has_result and not has_error:
        if isinstance(message["result"], dict):
            return {"jsonrpc": "2.0", "id": msg_id, "result": message["result"]}
        return rpc_error(msg_id, UPSTREAM_ERROR, "the upstream returned a result that is not an object")
    if has_error and not has_result:
        error = message["error"]
        if isinstance(error, dict) and isinstance(error.get("code"), int) and not isinstance(error["code"], bool) \
                and isinstance(error.get("message"), str):
            return rpc_error(msg_id, error["code"], error["message"][:4000], error.get("data"))
        text = error.get("message") if isinstance(error, dict) else error
        detail = f": {printable(text)[:200]}" if isinstance(text, str) and text else ""
        return rpc_error(msg_id, UPSTREAM_ERROR, f"the upstream returned a malformed error{detail}")
    return rpc_error(msg_id, UPSTREAM_ERROR, "the upstream returned a malformed reply (both result and error)"
                     if has_result else "the upstream returned a malformed reply (neither result nor error)")
