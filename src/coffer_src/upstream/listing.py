"""Upstream lists: what one server offers, fetched page by page and kept current."""

from __future__ import annotations

import logging
import threading

from coffer_src.terminal import ServerLog, printable
from coffer_src.threads import Backoff, start_thread
from coffer_src.transport.stdio import UpstreamFailure
from coffer_src.upstream.definitions import _IDENTIFIER, Rejected, check_definition
from coffer_src.vault import CAPABILITY_KINDS, storable

listing_log = logging.getLogger(__name__)

# kind -> (the list method, the result's key, the capability a server must announce to be asked)
LIST_METHODS = {"tool": ("tools/list", "tools", "tools"), "prompt": ("prompts/list", "prompts", "prompts"),
                "resource": ("resources/list", "resources", "resources"),
                "template": ("resources/templates/list", "resourceTemplates", "resources")}


class UpstreamLists:
    """The lists of one upstream (``lists``: kind -> {identifier: checked definition}, in the server's order;
    ``rejected``: kind -> {identifier: why} of the last fetch) and how they are kept current: a refresh fetches
    every page within max_list_pages and max_list_items and hands the result to the events' on_list_changed; a
    list_changed notification asks for a refresh on a helper thread, one pass at a time per kind; a 2026-07-28
    server, which has no list_changed, gets a subscriptions/listen stream instead, reopened with backoff when it
    ends.  ``remembered`` holds what the vault knew of the lists before this session's first start (the catalogue
    lists it until the server is ready); each kind's entry becomes the live list once one is fetched.

    Threads: the Upstream's start thread fetches every list once (``refresh``) and opens the listen stream; a
    coffer-<name>-refresh thread per kind runs the passes list_changed asks for; the listen stream's end is
    handled on whichever transport thread ends it, its reopening on a timer thread.  ``_refresh_again``,
    ``_listen_id`` and ``_listen_backoff`` are guarded by the Upstream's lock.  ``lists[kind]`` and
    ``rejected[kind]`` are replaced whole, never changed in place, so a reader without a lock sees the old list or
    the new one.  The start's own fetch and a pass asked for by a list_changed that came during discovery may
    overlap, so the older of the two lists can land last; the server's next list_changed corrects it.
    """

    def __init__(self, upstream):
        self.upstream = upstream  # supervisor.Upstream: its call(), lock, state, capabilities and events
        self.log = ServerLog(listing_log, upstream.name)
        self.lists: dict[str, dict] = {kind: {} for kind in CAPABILITY_KINDS}
        self.rejected: dict[str, dict[str, str]] = {}
        self.remembered: dict[str, dict] = {}
        self._refresh_again: dict[str, bool] = {}  # kind -> refreshing now; True: list_changed came meanwhile
        self._listen_id: int | None = None          # Coffer's subscriptions/listen on a modern server
        self._listen_backoff = Backoff(1.0, 30.0)

    # -- fetching ------------------------------------------------------------------------------------------
    def refresh(self, kind: str, notify: bool = True) -> None:
        """Fetch one list (every page, within the caps) and hand it to the events' on_list_changed.  With
        ``notify`` (a change while running) a failure is a warning; without (discovery) it raises."""
        up = self.upstream
        _, key, capability = LIST_METHODS[kind]
        rejected: dict[str, str] = {}
        if capability not in up.capabilities:
            items = {}
        else:
            try:
                items, rejected = self._fetch_all(kind)
            except UpstreamFailure as exc:
                if notify:
                    self.log.warning("could not refresh %s: %s", key, exc)
                    return
                raise
        if kind in self.remembered:
            # What the server lists now is what the vault will remember of it: one copy of each definition is
            # kept, the remembered one where the server lists it unchanged (allocated first, it sits among the
            # other long-lived objects; the fresh copy goes with the rest of the listing's garbage).
            remembered = self.remembered[kind]
            items = {ident: old if (old := remembered.get(ident)) == definition else definition
                     for ident, definition in items.items()}
            self.remembered = {**self.remembered, kind: items}  # replaced whole: the old dict may be shared
        self.lists[kind] = items
        self.rejected[kind] = rejected
        up.events.on_list_changed(up, kind, items, notify)

    def refresh_soon(self, kind: str) -> None:
        """Refresh one list on a helper thread, one at a time per kind: a list_changed that arrives during a
        refresh asks for one more pass, so a chatty server costs a couple of fetches, not a thread each, and
        an older list can never land after a newer one."""
        lock = self.upstream.lock
        with lock:
            if kind in self._refresh_again:
                self._refresh_again[kind] = True
                return
            self._refresh_again[kind] = False

        def run():
            while True:
                try:
                    self.refresh(kind)
                except Exception:  # noqa: BLE001 - the pass is lost, not the ability to refresh again
                    self.log.exception("error refreshing its %ss", kind)
                with lock:
                    if not self._refresh_again[kind]:
                        del self._refresh_again[kind]
                        return
                    self._refresh_again[kind] = False

        start_thread(run, f"coffer-{self.upstream.name}-refresh")

    def _fetch_all(self, kind: str) -> tuple[dict, dict]:
        """{identifier: checked definition} and {identifier: why rejected} of one list, following pagination
        for at most max_list_pages pages and keeping at most max_list_items items."""
        up = self.upstream
        method, key, _ = LIST_METHODS[kind]
        id_field = _IDENTIFIER[kind]
        max_pages, max_items = int(up.settings["max_list_pages"]), int(up.settings["max_list_items"])
        items: dict[str, dict] = {}
        rejected: dict[str, str] = {}
        cursor, seen = None, set()
        for _page in range(max_pages):
            result = up.call(method, {"cursor": cursor} if cursor else {}, up.settings["init_timeout"])
            listed = result.get(key) if isinstance(result, dict) else None
            if not isinstance(result, dict) or (listed is not None and not isinstance(listed, list)):
                raise UpstreamFailure(f"{method} returned something that is not a list of {key}")
            for item in listed or []:
                try:
                    definition = check_definition(kind, item)
                except Rejected as exc:
                    ident = item.get(id_field) if isinstance(item, dict) else None
                    rejected[storable(str(ident))[:200]] = str(exc)
                    continue
                if len(items) >= max_items:
                    self.log.warning("lists more than %d %s; only the first %d are used (max_list_items)",
                                     max_items, key, max_items)
                    cursor = None
                    break
                items.setdefault(definition[id_field], definition)
            else:
                cursor = result.get("nextCursor")
            if not cursor:
                break
            if not isinstance(cursor, str) or len(cursor) > 4096 or cursor in seen:
                self.log.warning("%s gave an unusable or repeated cursor; stopping pagination", method)
                break
            seen.add(cursor)
        else:
            self.log.warning("%s: stopped after %d pages (max_list_pages)", method, max_pages)
        if rejected:
            sample = "; ".join(f"{printable(name)[:60]}: {why}" for name, why in list(rejected.items())[:3])
            self.log.warning("dropped %d %s it listed that cannot be used (%s)", len(rejected), key, sample)
        return items, rejected

    # -- the 2026-07-28 listen stream ----------------------------------------------------------------------
    def listen(self) -> None:
        """Open a subscriptions/listen stream for the lists a modern server announces changes of: its events
        refresh them as list_changed did in the handshake era.  Reopened (with backoff) whenever it ends."""
        up = self.upstream
        wanted = {key: True for key, capability in (("toolsListChanged", "tools"), ("promptsListChanged", "prompts"),
                                                     ("resourcesListChanged", "resources"))
                  if isinstance(up.capabilities.get(capability), dict)
                  and up.capabilities[capability].get("listChanged")}
        if not wanted or up.state == "stopped":
            return
        generation = up.generation
        request_id = None  # until the send returns (a send that fails at once ends the stream before that)

        def ended(response, failure, text):
            with up.lock:
                if self._listen_id == request_id:
                    self._listen_id = None
                alive = up.state == "ready" and up.generation == generation
                delay = self._listen_backoff.next_delay() if alive else 0.0
            if not alive:
                return
            self.log.debug("its subscriptions/listen stream ended (%s); reopening in %gs",
                           text or "ended by the server", delay)

            def reopen():
                if up.state == "ready" and up.generation == generation:
                    for kind in CAPABILITY_KINDS:  # nothing is replayed: what changed meanwhile is refetched
                        self.refresh_soon(kind)
                    self.listen()

            timer = threading.Timer(delay, reopen)
            timer.daemon = True
            timer.start()

        request_id = up.requests.send("subscriptions/listen", {"notifications": wanted}, ended, 0)
        with up.lock:
            self._listen_id = request_id

    @property
    def listen_id(self) -> int | None:
        """The request id of the open listen stream, if one is open."""
        with self.upstream.lock:
            return self._listen_id

    def listen_acknowledged(self) -> None:
        """The server confirmed the stream: the next time it ends, reopening waits the shortest time again."""
        with self.upstream.lock:
            self._listen_backoff.reset()
