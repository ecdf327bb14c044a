"""Gateway pages: long lists cut into pages, with cursors a client cannot forge.

A list longer than the ``list_page_size`` setting is answered one page at a time, each with a ``nextCursor``
(MCP pagination, the same in both eras).  A cursor says where the next page starts (an offset, and digests of the
item the previous page ended on and of the one after it, so a catalogue that changed between two pages is resumed
at the right item, neither skipping nor repeating one) and carries an HMAC under a key of this process: anything a
client made up, cut or took from another Coffer is refused with -32602, as the specification asks.  A cursor stays
good for as long as the process serves.  A client that never follows cursors gets the first page every time; the
rest stays callable by name and findable with coffer__search_tools (the instructions say so).
"""

from __future__ import annotations

import os

from coffer_src.digests import hmac_sha256, same_secret, sha256
from coffer_src.jsonrpc import INVALID_PARAMS, RpcError

#: What identifies an item of each list a client pages through.
PAGED_LISTS = {"tools": "name", "prompts": "name", "resources": "uri", "resourceTemplates": "uriTemplate"}
CURSOR_MAX_CHARS = 256
_PAGE_KEY = os.urandom(32)


def _digest(text) -> str:
    return sha256(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _signed(payload: str) -> str:
    return f"{payload}.{hmac_sha256(_PAGE_KEY, payload.encode('ascii')).hex()[:32]}"


def check_cursor(key: str, cursor) -> tuple[int, str, str] | None:
    """(offset, digests of the items before and at it) from a client's cursor for list ``key``; None for no
    cursor; RpcError (-32602) for anything Coffer did not hand out for that list."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or len(cursor) > CURSOR_MAX_CHARS or cursor.count(".") != 4:
        raise RpcError(INVALID_PARAMS, "Invalid params: not a cursor Coffer gave out")
    payload, _, mac = cursor.rpartition(".")
    if not same_secret(_signed(payload).encode("ascii", "replace"), cursor.encode("ascii", "replace")):
        raise RpcError(INVALID_PARAMS, "Invalid params: not a cursor Coffer gave out")
    listed, offset, before, at = payload.split(".")
    if listed != key:
        raise RpcError(INVALID_PARAMS, f"Invalid params: that cursor belongs to another list than {key}")
    return int(offset), before, at


def page_of(key: str, items: list, position: tuple[int, str, str] | None, page_size: int) -> dict:
    """{key: the page of ``items`` at ``position`` (check_cursor's), "nextCursor": ... when more follow}."""
    id_field = PAGED_LISTS[key]
    start = 0
    if position is not None:
        offset, before, at = position
        if 0 < offset <= len(items) and _digest(items[offset - 1].get(id_field)) == before:
            start = offset
        else:  # the list changed since that page: resume after the item it ended on, or at the one that followed
            digests = [_digest(item.get(id_field)) for item in items]
            start = (digests.index(before) + 1 if before in digests else
                     digests.index(at) if at in digests else min(offset, len(items)))
    end = start + max(1, page_size)
    result: dict = {key: items[start:end]}
    if end < len(items):
        result["nextCursor"] = _signed(f"{key}.{end}.{_digest(items[end - 1].get(id_field))}."
                                       f"{_digest(items[end].get(id_field))}")
    return result
