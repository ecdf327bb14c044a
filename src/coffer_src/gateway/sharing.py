"""Gateway sharing: a server runs once for all, once per client, or not while unused.

In the shared service a server runs once for every client session unless its answers depend on its client (it
asked one for its roots, its model or its user: then one instance per client) or it has gone unused for
upstream_idle_stop seconds (then none, until the next call).  For both, the catalogue keeps listing what the
server offered, from a placeholder.  ``Sharing`` makes those switches for the hub; it changes the hub's
``upstreams``, ``per_client`` and ``dormant`` under the hub's lock, replacing each whole (see Hub).
"""

from __future__ import annotations

import logging
import sys
import time

from coffer_src.errors import CofferError
from coffer_src.terminal import ServerLog
from coffer_src.threads import start_thread
from coffer_src.upstream.supervisor import Upstream

sharing_log = logging.getLogger(__name__)

_LIBC_TRIM = None


def return_freed_memory() -> None:
    """Hand the heap a catalogue build freed back to the operating system (glibc keeps it, by default, for the
    process's next allocation; the service lives for hours between builds).  Elsewhere a no-op."""
    global _LIBC_TRIM
    if _LIBC_TRIM is None:
        _LIBC_TRIM = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                _LIBC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                pass
    if _LIBC_TRIM:
        _LIBC_TRIM(0)


class RememberedServer:
    """A server with no instance running in the hub: what the catalogue lists for it, from its lists remembered
    at its last start, until an instance is asked for."""

    per_client = False   # True: each client session runs an instance of its own (PerClientServer)
    dormant = False      # True: stopped for want of calls; the hub starts it again on the next one
    spawns = 0
    ready_at = 0.0
    generation = 0

    def __init__(self, config: dict, remembered: dict):
        self.config = config
        self.name: str = config["name"]
        self.remembered = remembered
        self.lists = {kind: {} for kind in ("tool", "prompt", "resource", "template")}
        self.era = config.get("era")
        self.capabilities = config.get("capabilities") or {}
        self.state = "idle"

    def learn(self, lists: dict) -> bool:
        """An instance listed these: remember them for every session's catalogue.  True if they changed."""
        kept = {kind: items for kind, items in lists.items() if kind in ("tool", "prompt") and items}
        changed = kept != self.remembered
        self.remembered = kept
        return changed


class PerClientServer(RememberedServer):
    """A server that runs one instance per client session; a session starts its own on first use."""

    per_client = True


class DormantServer(RememberedServer):
    """A shared server stopped after upstream_idle_stop seconds without a call; its tools stay listed, and the
    next call starts it again (and waits for it, as a call to a starting server does)."""

    dormant = True


class Sharing:
    """The hub's switches between sharing modes (see the module's docstring).  Stateless: the state is the hub's."""

    def __init__(self, hub):
        self.hub = hub

    def stop_idle(self) -> None:
        """Stop each shared upstream that has had no call for upstream_idle_stop seconds (and has nothing in
        flight); what it listed stays in the catalogue."""
        hub = self.hub
        limit = str(hub.settings.get("upstream_idle_stop", "off"))
        if not hub.shared or limit == "off":
            return
        now = time.time()
        for name, upstream in hub.upstreams.items():
            last = max(getattr(upstream, "last_call", None) or 0.0, getattr(upstream, "idle_since", None) or now)
            if upstream.state != "ready" or now - last < float(limit) or not upstream.requests.idle():
                continue
            with hub.lock:
                if hub.upstreams.get(name) is not upstream:
                    continue
                placeholder = DormantServer(hub.configs.get(name) or upstream.config,
                                            {kind: items for kind, items in upstream.lists.items()
                                             if kind in ("tool", "prompt") and items})
                hub.upstreams = {key: up for key, up in hub.upstreams.items() if key != name}
                hub.dormant = {**hub.dormant, name: placeholder}
            ServerLog(sharing_log, name).info("stopped after %gs without a call; the next call starts it again",
                                              float(limit))
            start_thread(upstream.stop, f"coffer-{name}-stop")
            hub.rebuild()

    def wake(self, name: str) -> Upstream | None:
        """Start a dormant server again for a call (the call waits for its start); the running upstream."""
        hub = self.hub
        with hub.lock:
            placeholder = hub.dormant.get(name)
            if placeholder is None:
                return hub.upstreams.get(name)
            hub.dormant = {key: p for key, p in hub.dormant.items() if key != name}
            hub.remembered[name] = placeholder.remembered
        hub._add_upstream(placeholder.config)
        hub.rebuild()
        return hub.upstreams.get(name)

    def retired(self, upstream: Upstream) -> bool:
        """A shared instance switched to per-client, still finishing its calls: what it lists now is what every
        client's own instance will list, so the catalogue learns it from here (no client has to start one
        just to find out); nothing else it does concerns the hub any more."""
        hub = self.hub
        placeholder = hub.per_client.get(upstream.name)
        if placeholder is None or hub.upstreams.get(upstream.name) is upstream:
            return False
        if upstream.ready_at and placeholder.learn(upstream.lists):
            hub.rebuild()
        return True

    def make_per_client(self, name: str, reason: str) -> None:
        """Switch a shared server to one instance per client: recorded (and shown by `coffer show`), its shared
        instance stopped once its calls are answered; the next call of each session starts that session's own."""
        hub = self.hub
        with hub.lock:
            upstream = hub.upstreams.get(name)
            config = hub.configs.get(name)
            if upstream is None or config is None:
                return  # already switched (a retiring instance may ask again), or gone
            config = hub.configs[name] = {**config, "sharing": "per-client", "sharing_reason": reason}
            hub.upstreams = {key: up for key, up in hub.upstreams.items() if key != name}
            lists = {kind: items for kind, items in upstream.lists.items() if kind in ("tool", "prompt") and items}
            placeholder = PerClientServer(config, lists or upstream.remembered)
            hub.per_client = {**hub.per_client, name: placeholder}
        ServerLog(sharing_log, name).info("runs once per client from now on: %s", reason)
        if not placeholder.remembered:  # nothing known of it yet: each client's own instance will say what it offers
            for session in hub.sessions:
                if session.initialized:
                    session.instance_of(placeholder)
        try:
            with hub.vault_lock:
                hub.vault.set_sharing(name, "per-client", reason)
        except CofferError as exc:
            ServerLog(sharing_log, name).warning("could not record that it runs per client: %s", exc)
        start_thread(self._retire, f"coffer-{name}-retire", upstream)
        hub.rebuild()

    def _retire(self, upstream: Upstream) -> None:
        """Stop a shared instance that was switched to per-client once nothing is waiting on it (bounded)."""
        hub = self.hub
        deadline = time.monotonic() + upstream.call_timeout
        while time.monotonic() < deadline and any(s.oldest_call_to(upstream) is not None for s in hub.sessions):
            if hub._stopping.wait(0.2):
                break
        upstream.stop()
