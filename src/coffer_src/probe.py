"""Probes: starting a server once to see what it offers, from the command line."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import NamedTuple

from coffer_src.errors import CofferError
from coffer_src.jsonrpc import LATEST_PROTOCOL_VERSION, METHOD_NOT_FOUND, rpc_error
from coffer_src.names import RESERVED_SERVER, exposed_names
from coffer_src.resources import own_command
from coffer_src.terminal import ServerLog, printable, redact
from coffer_src.threads import start_thread
from coffer_src.upstream.supervisor import Upstream, record_upstream_status
from coffer_src.vault import CapabilityState, Vault

probe_log = logging.getLogger(__name__)


class GatewayClient:
    """Talks to a ``coffer serve`` subprocess exactly as an agent would, for ``coffer call`` and ``coffer tools``.

    It is an Upstream whose server happens to be Coffer itself, so the CLI exercises the real gateway path; this
    object is that Upstream's events (UpstreamEvents).
    """

    def __init__(self, vault: Vault, only: list[str] | None = None):
        settings = dict(vault.settings())
        settings["init_timeout"] = float(settings["discovery_timeout"]) + float(settings["init_timeout"])
        settings["max_restarts"] = 1
        argv = ["serve", "--live"] + [arg for name in only or () for arg in ("--only", name)]
        config = {"name": RESERVED_SERVER, "transport": "stdio", "env": {"COFFER_HOME": vault.home},
                  "command": own_command(*argv), "headers": {}, "inherit_env": ["*"],
                  "era": "handshake"}
        self.ready = threading.Event()
        self.upstream = Upstream(config, settings, self, {}, LATEST_PROTOCOL_VERSION)
        self.upstream._on_stderr = lambda line: (sys.stderr.write(printable(redact(line)) + "\n"),
                                                 sys.stderr.flush())

    def __enter__(self):
        self.upstream.start()
        self.ready.wait(self.upstream.settings["init_timeout"] + 10)
        if self.upstream.state != "ready":
            raise CofferError(f"coffer serve did not start: {self.upstream.last_error}")
        return self

    def __exit__(self, *exc):
        self.upstream.stop()

    # UpstreamEvents: `coffer serve` started or not; nothing else it says matters to one call
    def on_ready(self, upstream: Upstream) -> None:
        self.ready.set()

    def on_down(self, upstream: Upstream) -> None:
        self.ready.set()

    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        pass

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        pass

    def on_request(self, upstream: Upstream, message: dict) -> None:
        upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "the coffer CLI cannot answer this"))

    def call(self, method: str, params: dict):
        return self.upstream.call(method, params)


class ProbeResult(NamedTuple):
    """What starting one server told: ``state`` is ready, failed or timed out; ``tools`` as a client sees them."""
    name: str
    state: str
    detail: str
    tools: list
    seconds: float


class ServerProbe:
    """Starts servers in this process, with no client attached, to see what they offer — for `coffer tools`,
    `coffer doctor`, and enabling a tool of a server never started.  What it learns is recorded in the vault as
    a gateway would record it (capabilities, status: record_upstream_status), so `coffer list` reports the last
    attempt of any command.  It is its upstreams' events (UpstreamEvents).

    Threads: each upstream's own; ``run`` waits on a condition the upstream events signal (``done``, which
    guards ``settled``).  ``vault_lock`` (a leaf, also taken under ``done``) guards the vault's connection, which
    every upstream's events use.
    """

    WAITING_EVERY = 3.0  # seconds between two `waiting` calls while servers are still starting

    def __init__(self, vault: Vault, names: list[str] | None = None, progress=None, waiting=None):
        """``progress(result)`` runs as each server settles; ``waiting(names, seconds)`` every WAITING_EVERY
        seconds while some have not (a person at a terminal wants to know what the command waits for)."""
        self.vault = vault
        self.waiting = waiting or (lambda names, seconds: None)
        self.settings = vault.settings()
        # A server that exits at once is tried twice here, not max_restarts times: a person is waiting.
        self.settings["max_restarts"] = min(2, int(self.settings["max_restarts"]))
        self.progress = progress or (lambda result: None)
        self.vault_lock = threading.Lock()
        self.done = threading.Condition()
        self.settled: dict[str, str] = {}  # name -> ready|failed, once its event is handled (guarded by done)
        servers = [s for s in vault.servers() if names is None or s["name"] in names]
        self.skipped = {s["name"]: s["damaged"] or "disabled" for s in servers if s["damaged"] or not s["enabled"]}
        self.upstreams = [Upstream(s, self.settings, self, {}, LATEST_PROTOCOL_VERSION, vault.secrets)
                          for s in servers if s["name"] not in self.skipped]

    def run(self, timeout: float | None = None) -> list[ProbeResult]:
        """Start every server at once and wait for each to be ready or failed, at most ``timeout`` (init_timeout)."""
        timeout = float(self.settings["init_timeout"]) if timeout is None else timeout
        started = time.monotonic()
        said = started
        finished: dict[str, ProbeResult] = {}
        for upstream in self.upstreams:
            upstream.start()
        try:
            with self.done:
                while len(finished) < len(self.upstreams):
                    for upstream in self.upstreams:
                        # The event, not upstream.state: the state flips before its event is recorded, and a
                        # command that finished in between would leave the vault saying "never started".
                        state = self.settled.get(upstream.name)
                        if upstream.name not in finished and state is not None:
                            finished[upstream.name] = self._result(upstream, state, started)
                            self.progress(finished[upstream.name])
                    now = time.monotonic()
                    remaining = started + timeout - now
                    if remaining <= 0 or len(finished) == len(self.upstreams):
                        break
                    if now - said >= self.WAITING_EVERY:
                        said = now
                        self.waiting([up.name for up in self.upstreams if up.name not in finished], now - started)
                    self.done.wait(min(remaining, 0.5))
            for upstream in self.upstreams:
                if upstream.name not in finished:
                    result = self._result(upstream, "timed out", started, f"did not answer within {timeout:g}s")
                    record_upstream_status(self.vault, self.vault_lock, upstream, "timed out", result.detail)
                    finished[upstream.name] = result
                    self.progress(result)
        finally:
            threads = [start_thread(up.stop, f"coffer-{up.name}-stop") for up in self.upstreams]
            for thread in threads:
                thread.join(5.0)
        return [finished[up.name] for up in self.upstreams]

    def _result(self, upstream: Upstream, state: str, started: float, detail: str | None = None) -> ProbeResult:
        tools = []
        if state == "ready":
            with self.vault_lock:
                states = self.vault.capability_states()
                seniority = self.vault.seniority().get((upstream.name, "tool"))
            names = exposed_names(upstream.name, upstream.lists["tool"], self.settings["name_max_length"], seniority)
            tools = [dict(definition, name=names[name]) for name, definition in upstream.lists["tool"].items()
                     if states.get((upstream.name, "tool", name), CapabilityState(True)).usable]
        return ProbeResult(upstream.name, state, detail or (upstream.last_error or ""), tools,
                           round(time.monotonic() - started, 2))

    # UpstreamEvents, recorded as the gateway records them
    def on_ready(self, upstream: Upstream) -> None:
        record_upstream_status(self.vault, self.vault_lock, upstream, "ready")
        self._settle(upstream, "ready")

    def on_down(self, upstream: Upstream) -> None:
        if upstream.state == "failed":
            record_upstream_status(self.vault, self.vault_lock, upstream, "failed")
            self._settle(upstream, "failed")

    def _settle(self, upstream, state: str) -> None:
        with self.done:
            self.settled.setdefault(upstream.name, state)
            self.done.notify_all()

    def on_list_changed(self, upstream: Upstream, kind: str, items: dict, notify: bool) -> None:
        try:
            with self.vault_lock:
                self.vault.sync_capabilities(upstream.name, kind, items, upstream.rejected.get(kind))
        except CofferError as exc:
            ServerLog(probe_log, upstream.name).warning("could not record its %ss: %s", kind, exc)

    def on_notification(self, upstream: Upstream, message: dict) -> None:
        pass

    def on_request(self, upstream: Upstream, message: dict) -> None:
        upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "no client is connected"))
