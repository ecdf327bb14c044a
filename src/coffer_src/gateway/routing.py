"""Gateway routing: a session's calls to upstreams, from the request to the answer.

The hot path of a proxied ``tools/call`` is here: a dictionary look-up in the catalogue, one record of the call
in flight, the request to the upstream under its own id, and the answer sent straight back from the upstream's
reader thread.
"""

from __future__ import annotations

import time

from coffer_src.catalogue import Route
from coffer_src.gateway.calls import CallState, ForwardedCall, Reply, Waiting
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    LOG_LEVELS,
    REQUEST_TIMEOUT,
    UPSTREAM_ERROR,
    RpcError,
    rpc_error,
    tool_error_result,
    valid_request_id,
)
from coffer_src.modern import INPUT_REQUIRED_METHODS
from coffer_src.names import ASK_TOOL, REMEMBER_TOOL, SEARCH_TOOL, SEPARATOR
from coffer_src.search.feedback import feedback_recorder
from coffer_src.settings import redacts_output
from coffer_src.upstream.supervisor import Ticket, Upstream, failure_fix


def require_str(params: dict, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise RpcError(INVALID_PARAMS, f"'{key}' must be a non-empty string")
    return value


class CallRouter:
    """One session's requests to upstreams: which upstream owns a name, the calls in flight, their answers.

    ``inflight`` (calls by the client's request id) and ``subscriptions`` (per server, the original URIs this
    client subscribed to) are guarded by the session's lock.  Answers arrive on upstream reader threads; requests
    on the client's reader thread or a worker.
    """

    def __init__(self, session):
        self.session = session
        self.hub = session.hub
        self.inflight: dict[object, ForwardedCall] = {}
        self.subscriptions: dict[str, set[str]] = {}
        self.calls_made = 0    # requests this session has sent upstream (`coffer status`)
        self.called: set[str] = set()   # the upstreams it has sent them to

    def record(self, server: str, capability: str, kind: str, started: float, outcome: str,
               detail: str | None = None) -> None:
        """One row of the invocation log for this session's client and profile (never arguments or results)."""
        self.hub.log.record(self.session.client_name, server, capability, kind, started, outcome, detail,
                            self.session.view.name)

    # -- the requests ----------------------------------------------------------------------------------------
    def tools_call(self, msg_id, params):
        started = time.monotonic()
        name = require_str(params, "name")
        arguments = params.get("arguments")
        if arguments is not None and not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, "'arguments' must be an object")
        session = self.session
        if name == SEARCH_TOOL:
            # A search may wait for its embedding, or build the index on its first use: off the reader thread.
            background = self.hub.semantic is not None or not session.catalogue.index_ready
            return session.after_discovery(msg_id, lambda: session.tools.search(arguments or {}, started),
                                           background=background, kind="tool")
        if session.client_era == "modern" and "requestState" in params:
            return session.bridge.resume(msg_id, "tools/call", params, started)
        if name in (ASK_TOOL, REMEMBER_TOOL) and any(t["name"] == name for t in session.view.knowledge_tools):
            work = (lambda: session.tools.ask(arguments or {}, started, params)) if name == ASK_TOOL else (
                lambda: session.tools.remember(arguments or {}, started))
            self.hub.workers.submit(session.answer, msg_id, "tools/call", work, owner=session)
            return None
        if name in (ASK_TOOL, REMEMBER_TOOL) and not any(t["name"] == name for t in self.hub.knowledge_tools):
            # Coffer's own tool, turned off: say how to turn it on (one the client's profile leaves out is refused
            # below, naming the profile)
            self.record("coffer", name, "tool", started, "error", "turned off")
            return tool_error_result(
                f"{name} is off: memory is off in Coffer; the user can turn it on with `coffer config memory on`"
                if name == REMEMBER_TOOL else
                f"{name} has nothing to search yet: the user can add a folder of notes with `coffer knowledge add "
                "PATH`, or turn memory on with `coffer config memory on`")
        return self._route_named(msg_id, params, name, "tool", "tools/call", started)

    def prompts_get(self, msg_id, params):
        started = time.monotonic()
        if self.session.client_era == "modern" and "requestState" in params:
            require_str(params, "name")
            return self.session.bridge.resume(msg_id, "prompts/get", params, started)
        return self._route_named(msg_id, params, require_str(params, "name"), "prompt", "prompts/get", started)

    def _route_named(self, msg_id, params, name: str, kind: str, method: str, started: float,
                     retried: bool = False):
        """Send a tool call or prompt fetch to the upstream that owns ``name``, under its original name, with the
        arguments the user fixed for it (profiles.py)."""
        catalogue = self.session.catalogue
        route = (catalogue.tool_routes if kind == "tool" else catalogue.prompt_routes).get(name)
        if route is None:
            if name in catalogue.disabled or name in catalogue.quarantined:
                self._deny(name, kind, started)
            self._refuse(catalogue.refusal(name, kind), name, kind, started)
            retry = None if retried else (
                lambda: self._route_named(msg_id, params, name, kind, method, started, True))
            return self._unknown(msg_id, name, kind, started, retry)
        upstream, original = route
        if kind == "tool" and self.hub.settings["search_feedback"] == "on":  # labels the session's last search
            feedback_recorder(self.hub.vault.path).called(self.session, name)
        sent, (params, refused) = params, catalogue.with_fixed(name, params) if kind == "tool" else (params, None)
        if refused:
            self.record(upstream.name, name, kind, started, "denied", refused)
            return tool_error_result(f"coffer: {refused}")
        self.forward(msg_id, upstream, method, {**params, "name": original}, name, kind, started, sent)
        return None

    def resource_route(self, uri: str, started: float, log_kind):
        catalogue = self.session.catalogue
        if uri in catalogue.disabled or uri in catalogue.quarantined:
            self._deny(uri, "resource", started)
        route = catalogue.route_resource(uri)
        if route is None:
            self._refuse(catalogue.refusal(uri, "resource"), uri, "resource", started)
            blocked = next((text for regex, text in catalogue.blocked_templates if regex.match(uri)), None)
            if blocked is not None:
                self._deny(blocked, "resource", started)
            if log_kind:
                self.record("", uri, log_kind, started, "error", "unknown resource")
            raise RpcError(INVALID_PARAMS, f"Unknown resource: {uri}", {"uri": uri})
        return route

    def resources_read(self, msg_id, params):
        started = time.monotonic()
        uri = require_str(params, "uri")
        if self.session.client_era == "modern" and "requestState" in params:
            return self.session.bridge.resume(msg_id, "resources/read", params, started)

        def work():
            route = self.resource_route(uri, started, "resource")
            upstream, original = route
            # A templated URI carries the caller's values; the log keeps only what identifies the capability.
            catalogue = self.session.catalogue
            capability = uri if uri in catalogue.resource_routes else catalogue.template_of(route)
            self.forward(msg_id, upstream, "resources/read", {**params, "uri": original}, capability,
                         "resource", started, params)

        return self.session.after_discovery(msg_id, work, method="resources/read")

    def subscription(self, method: str):
        def handler(msg_id, params):
            uri = require_str(params, "uri")

            def work():  # once the upstream that may own the URI has started, as resources/read waits
                upstream, original = self.resource_route(uri, time.monotonic(), None)
                with self.session.lock:  # remembered so a restarted upstream is subscribed again
                    subscribed = self.subscriptions.setdefault(upstream.name, set())
                    subscribed.add(original) if method == "resources/subscribe" else subscribed.discard(original)
                if upstream.era == "modern":
                    return {}  # a 2026-07-28 server has no resources/subscribe (updates need a listen stream)
                if method == "resources/unsubscribe" and self.hub.subscribed_elsewhere(self.session, upstream,
                                                                                       original):
                    return {}  # another client still wants its updates
                self.forward(msg_id, upstream, method, {**params, "uri": original}, uri, None, time.monotonic())
                return None

            return self.session.after_discovery(msg_id, work, method=method)
        return handler

    def complete(self, msg_id, params):
        ref = params.get("ref")
        if not isinstance(ref, dict):
            raise RpcError(INVALID_PARAMS, "'ref' must be an object")
        if ref.get("type") not in ("ref/prompt", "ref/resource"):
            raise RpcError(INVALID_PARAMS, "ref.type must be 'ref/prompt' or 'ref/resource'")
        key = "name" if ref["type"] == "ref/prompt" else "uri"
        target = ref.get(key)
        if not isinstance(target, str):
            raise RpcError(INVALID_PARAMS, f"ref.{key} must be a string")

        def work():  # once the upstream that may own the target has started
            catalogue = self.session.catalogue
            if key == "name":
                route = catalogue.prompt_routes.get(target)
            else:
                route = catalogue.template_by_text.get(target) or catalogue.route_resource(target)
            if route is None:
                raise RpcError(INVALID_PARAMS, f"Unknown completion target: {target}")
            upstream, original = route
            if "completions" not in upstream.capabilities:
                return {"completion": {"values": [], "hasMore": False}}
            self.forward(msg_id, upstream, "completion/complete", {**params, "ref": {**ref, key: original}},
                         target, None, time.monotonic())
            return None

        return self.session.after_discovery(msg_id, work, kind="prompt" if key == "name" else None,
                                            method="completion/complete")

    def _deny(self, capability: str, kind: str, started: float):
        """A disabled or quarantined capability: logged as denied, and an error that says what the user can do."""
        capability = self.session.catalogue.aliases.get(capability, capability)  # the name the user's commands take
        server = capability.partition(SEPARATOR)[0] if kind in ("tool", "prompt") else ""
        if capability in self.session.catalogue.quarantined:
            self.record(server, capability, kind, started, "denied", "definition changed; awaiting approval")
            raise RpcError(INVALID_PARAMS, f"{kind} {capability!r} changed its definition since it was approved, so "
                                           f"Coffer holds it back; the user can review the change and allow it "
                                           f"with `coffer approve {capability}`")
        self.record(server, capability, kind, started, "denied", f"{kind} is disabled")
        raise RpcError(INVALID_PARAMS, f"{kind} {capability!r} is disabled in Coffer "
                                       f"(run `coffer enable {capability}` to allow it)")

    def _refuse(self, refusal: str | None, name: str, kind: str, started: float) -> None:
        """A known name this client may not use (outside its profile, or held back by an override that no longer
        fits): logged as denied, and the error says why."""
        if refusal is not None:
            self.record(name.partition(SEPARATOR)[0] if kind in ("tool", "prompt") else "", name, kind, started,
                        "denied", refusal[:200])
            raise RpcError(INVALID_PARAMS, refusal)

    def _unknown(self, msg_id, name: str, kind: str, started: float, retry):
        """An unknown name: wait out discovery if its server is still starting, else a readable error."""
        server = name.partition(SEPARATOR)[0]
        discovering = self.session.discovering()
        if retry is not None and server in discovering:
            # A call names its server: it waits for that server's start (bounded like the start itself), not
            # just the lists' discovery budget; answering "unknown tool" for a tool that is on its way is wrong.
            upstream = self.session.upstream_named(server)
            deadline = started + (upstream.call_timeout if upstream else float(self.hub.settings["call_timeout"]))
            if time.monotonic() < deadline:
                method = "tools/call" if kind == "tool" else "prompts/get"
                self.session.wait_for_server(Waiting(msg_id, retry, None, method, server, deadline))
                return None
        if retry is None and server in discovering:
            waited = time.monotonic() - started
            self.record(server, name, kind, started, "timeout", "server still starting")
            raise RpcError(REQUEST_TIMEOUT, f"upstream '{server}' was not ready within {waited:.0f}s; {name} "
                                            f"is answered once it has started")
        upstream = self.session.upstream_named(server)
        if upstream is not None and upstream.state == "failed":
            # A tool the client was shown, of a server that failed: say why and what fixes it, as `coffer list`
            # does; "unknown tool, search for it" would send the agent looking for something that is not there.
            detail = upstream.last_error or "no reason given"
            self.record(server, name, kind, started, "error", "server failed")
            raise RpcError(INVALID_PARAMS, f"{kind} {name} is unavailable: its server {server!r} failed to start "
                                           f"({detail[:500]}); the user can fix it: {failure_fix(server, detail)}")
        if server in self.hub.disabled_servers:
            self.record(server, name, kind, started, "denied", "server is disabled")
            raise RpcError(INVALID_PARAMS, f"{kind} {name!r} belongs to server {server!r}, which is disabled in Coffer "
                                           f"(run `coffer enable {server}` to allow it)")
        self.record(server if server in self.hub.upstreams else "", name, kind, started, "error", f"unknown {kind}")
        hint = f"; call {SEARCH_TOOL} to find tools" if kind == "tool" else ""
        raise RpcError(INVALID_PARAMS, f"Unknown {kind}: {name}{hint}")

    # -- a call in flight ------------------------------------------------------------------------------------
    def forward(self, msg_id, upstream: Upstream, method: str, params: dict, capability: str, kind: str | None,
                started: float, client_params: dict | None = None) -> None:
        """Send a client request upstream under the upstream's own id; its answer goes straight to the client
        (``deliver``).  ``params`` are the upstream's (its own names); ``client_params`` what the client sent."""
        session = self.session
        upstream = session.instance_of(upstream)
        call = ForwardedCall(upstream, method, capability, kind, started, msg_id,
                             client_params if client_params is not None else params, params)
        meta = params.get("_meta")
        if isinstance(meta, dict) and valid_request_id(meta.get("progressToken")):
            session.bridge.track_progress(call, params, meta)
        self.calls_made += 1
        self.called.add(upstream.name)
        upstream.last_call = time.time()
        if session.client_era == "modern" and method in INPUT_REQUIRED_METHODS:
            if session.bridge.carry_orphans(call):
                return  # parked: questions the upstream asked earlier go to the client first
        self.send(call)

    def send(self, call: ForwardedCall) -> None:
        """Send the call itself upstream; from now on its answer may arrive on the upstream's reader thread."""
        session = self.session
        call.sent = True

        def on_reply(response, failure, text):
            reply = Reply(response, failure, text)
            with session.lock:
                if call.state is CallState.PARKED:   # the client's retry will take this answer
                    call.held = reply
                    return
                if call.state is CallState.DONE:     # cancelled: nobody waits for it
                    return
                msg_id, call.state = call.msg_id, CallState.DONE
                if self.inflight.get(msg_id) is call:
                    del self.inflight[msg_id]
                session.bridge.call_finished(call)
            self.deliver(call, msg_id, reply)

        # In flight before it is sent: the upstream may ask the client something (sampling, elicitation) the
        # moment it reads the call, and that question needs this call to carry it to a 2026-07-28 client.
        call.ticket = Ticket()
        with session.lock:
            if call.state is CallState.ANSWERING:
                self.inflight[call.msg_id] = call
        if call.upstream.request(call.method, call.upstream_params, on_reply, ticket=call.ticket,
                                 envelope=session.envelope_for(call)) is None:
            return  # failed at once: on_reply has answered and cleared it
        with session.lock:
            parked = call.state is CallState.PARKED
        if parked:  # a question went out before the request had its id: pause its timeout now
            call.upstream.hold(call.ticket)

    def deliver(self, call: ForwardedCall, msg_id, reply: Reply) -> None:
        """An upstream's answer to ``call``, to the client request ``msg_id``: logged (who/when/how long/outcome,
        queued before the client sees it, so the log's order is the order of causes), shaped for the client's era;
        an input_required answer from a 2026-07-28 upstream is bridged instead."""
        session, upstream, method = self.session, call.upstream, call.method
        verbatim = not redacts_output(self.hub.settings, upstream.name)
        response = reply.response
        if response is None:
            if call.kind:
                self.record(upstream.name, call.capability, call.kind, call.started, reply.failure, reply.text[:200])
            if method == "tools/call":
                session.respond(msg_id, method, tool_error_result(f"coffer: {reply.text}"))
            else:
                session.send(rpc_error(msg_id, REQUEST_TIMEOUT if reply.failure == "timeout" else UPSTREAM_ERROR,
                                       reply.text))
            return
        result = response.get("result")
        if result is not None and result.get("resultType") == "input_required" and method in INPUT_REQUIRED_METHODS:
            session.bridge.input_required(call, msg_id, result)
            return
        if method == "tools/call" and result is not None and not isinstance(result.get("content"), list):
            result["content"] = []  # required by every client's schema; a bad one would fail the whole reply
        if call.kind:
            if "error" in response:
                self.record(upstream.name, call.capability, call.kind, call.started, "error",
                            f"upstream returned JSON-RPC error {response['error']['code']}")
            elif method == "tools/call" and result.get("isError") is True:
                self.record(upstream.name, call.capability, call.kind, call.started, "error", "tool reported isError")
            else:
                self.record(upstream.name, call.capability, call.kind, call.started, "ok")
        if result is None:
            response["id"] = msg_id  # a fresh, normalized reply (see normalized_reply): Coffer's to change
            session.send(response, verbatim)
        else:
            session.respond(msg_id, method, result, call.capability in session.catalogue.wrapped_outputs, verbatim)

    def fail(self, call: ForwardedCall, msg_id, text: str) -> None:
        """Answer ``msg_id`` for ``call`` with Coffer's own failure (the upstream never answered usefully)."""
        if call.kind:
            self.record(call.upstream.name, call.capability, call.kind, call.started, "error", text[:200])
        if call.method == "tools/call":
            self.session.respond(msg_id, call.method, tool_error_result(f"coffer: {text}"))
        else:
            self.session.send(rpc_error(msg_id, INTERNAL_ERROR, text))

    def cancel(self, request_id, reason: str) -> None:
        """The client cancelled ``request_id``: stop it upstream (logged once, if it was still running there)."""
        session = self.session
        with session.lock:
            call = self.inflight.pop(request_id, None)
            if call is not None:
                call.state = CallState.DONE
                session.bridge.call_finished(call, cancelled=True)
        if call is not None and call.upstream.cancel(call.ticket, reason):
            self.record(call.upstream.name, call.capability, call.kind, call.started, "cancelled",
                        "cancelled by the client")

    def cancel_all(self, reason: str) -> None:
        """The client went away: every call it had in flight is cancelled upstream."""
        with self.session.lock:
            calls, self.inflight = list(self.inflight.values()), {}
            for call in calls:
                call.state = CallState.DONE
        for call in calls:
            call.upstream.cancel(call.ticket, reason)

    # -- what the session asks about its calls ---------------------------------------------------------------
    def used(self, upstream: Upstream) -> bool:
        """Whether this session has called ``upstream`` (`coffer status`: how many sessions use a server)."""
        return upstream.name in self.called

    def oldest_to(self, upstream: Upstream) -> float | None:
        with self.session.lock:
            return min((call.started for call in self.inflight.values() if call.upstream is upstream), default=None)

    def carriers(self, upstream: Upstream) -> list[ForwardedCall]:
        """Calls to ``upstream`` whose client request could carry a question back (caller holds the lock)."""
        return [call for call in self.inflight.values() if call.upstream is upstream
                and call.state is CallState.ANSWERING and call.method in INPUT_REQUIRED_METHODS]

    def log_floor(self, upstream: Upstream) -> str | None:
        """The lowest logging level a 2026-07-28 client's calls in flight to ``upstream`` asked for (logLevel)."""
        with self.session.lock:
            asked = [call.log_level for call in self.inflight.values() if call.upstream is upstream and call.log_level]
        return min(asked, key=LOG_LEVELS.index) if asked else None

    def subscribed(self, upstream: Upstream, uri: str) -> bool:
        with self.session.lock:
            return uri in self.subscriptions.get(upstream.name, ())

    def subscribe_upstream(self, route: Route, on: bool) -> None:
        """Have an upstream send resources/updated for a URI (handshake-era servers only: a 2026-07-28 server
        would need a listen stream of its own for resources, which Coffer does not open yet)."""
        upstream, original = route
        with self.session.lock:
            subscribed = self.subscriptions.setdefault(upstream.name, set())
            was = original in subscribed
            subscribed.add(original) if on else subscribed.discard(original)
        if was != on and upstream.era != "modern" and upstream.state == "ready":
            upstream.request("resources/subscribe" if on else "resources/unsubscribe", {"uri": original},
                             lambda *a: None)

    def resubscribe(self, upstream: Upstream) -> None:
        """A restarted upstream forgot what this client subscribed to: subscribe again."""
        with self.session.lock:
            uris = sorted(self.subscriptions.get(upstream.name, ()))
        for uri in uris if upstream.era != "modern" else ():
            upstream.request("resources/subscribe", {"uri": uri}, lambda *a: None)
