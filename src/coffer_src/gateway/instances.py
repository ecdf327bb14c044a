"""Gateway instances: a client session's own instances of servers run once per client.

In the shared service a server whose answers depend on its client runs one instance per client session (see
gateway/hub.py: PerClientServer).  A session starts its instance on first use, and its events concern that
session alone; what the instance lists is recorded for every session's catalogue, as a shared server's is.
"""

from __future__ import annotations

from coffer_src.gateway.builtins import CLIENT_SIDE_CAPABILITIES
from coffer_src.threads import start_thread
from coffer_src.upstream.supervisor import Upstream


class SessionInstances:
    """The per-client instances one session runs.  ``running`` (name -> Upstream) is written under the session's
    lock; ``listed`` (names whose lists are in the catalogue) is replaced whole, so it is read without one."""

    def __init__(self, session):
        self.session = session
        self.hub = session.hub
        self.running: dict[str, Upstream] = {}
        self.listed: frozenset[str] = frozenset()

    def instance_of(self, upstream):
        """The upstream a call of this session goes to: the shared one (a stopped idle one started again), or
        this session's own instance of a per-client server (started now if this is its first use; a call waits
        for its start)."""
        if getattr(upstream, "dormant", False):
            return self.hub.wake(upstream.name) or upstream
        if not getattr(upstream, "per_client", False):
            return upstream
        session = self.session
        with session.lock:
            instance = self.running.get(upstream.name)
            fresh = instance is None
            if fresh:
                caps = {k: v for k, v in session.client_capabilities.items() if k in CLIENT_SIDE_CAPABILITIES}
                instance = Upstream(upstream.config, self.hub.settings, PrivateEvents(session), caps,
                                    session.protocol_version, self.hub.vault.secrets, session.client_info or None)
                instance.remembered = upstream.remembered
                self.running[upstream.name] = instance
        if fresh:
            instance.start()
        return instance

    def named(self, name: str):
        return self.running.get(name) or self.hub.upstreams.get(name)

    def starting(self, kind: str | None = None) -> list[str]:
        """This session's instances that are up-and-coming: started, and their lists not yet in the catalogue."""
        return [name for name, instance in self.running.items()
                if instance.state not in ("failed", "stopped") and name not in self.listed
                and not (kind and kind in instance.remembered)]

    def now_listed(self, upstream: Upstream) -> None:
        """This session's instance of a per-client server is up and its lists are in the catalogue."""
        self.listed = self.listed | {upstream.name}
        self.session.release_waiting()

    def drop(self, name: str) -> None:
        """The server's config changed (or it was removed): stop this session's own instance of it."""
        with self.session.lock:
            instance = self.running.pop(name, None)
        if instance is not None:
            start_thread(instance.stop, f"coffer-{name}-stop")

    def stop_all(self) -> None:
        """The client left: its instances go with it."""
        with self.session.lock:
            running, self.running = list(self.running.values()), {}
        for upstream in running:
            start_thread(upstream.stop, f"coffer-{upstream.name}-stop")


class PrivateEvents:
    """The events of a session's own instance of a per-client server (upstream.supervisor.UpstreamEvents): its
    answers and questions concern that session alone; what it lists is recorded for every session's catalogue,
    as a shared server's is."""

    def __init__(self, session):
        self.session = session
        self.hub = session.hub

    def on_ready(self, upstream: Upstream) -> None:
        self.hub.record_status(upstream, "ready")
        self.session.upstream_ready(upstream)
        try:
            self._learn(upstream)
        finally:
            self.session.instances.now_listed(upstream)

    def on_down(self, upstream: Upstream) -> None:
        self.session.upstream_down(upstream)
        self.hub.record_status(upstream, upstream.state)
        self.session.release_waiting()

    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        self.hub.on_list_changed(upstream, kind, items, False)
        if notify:
            self._learn(upstream)

    def _learn(self, upstream: Upstream) -> None:
        placeholder = self.hub.per_client.get(upstream.name)
        if placeholder is not None and placeholder.learn(upstream.lists):
            self.hub.rebuild()

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        self.session.upstream_notification(upstream, message)

    def on_request(self, upstream: Upstream, message: dict) -> None:
        self.session.upstream_request(upstream, message)
