"""Gateway era bridge: multi-round-trip requests and listen streams across eras.

An upstream may need the client mid-call (sampling, elicitation, roots).  A handshake-era upstream asks with a
request of its own; a 2026-07-28 upstream answers ``input_required`` and expects the call retried with the
answers.  A handshake-era client is asked with real requests; a 2026-07-28 client can only be asked in the answer
to one of its calls, and answers by retrying it.  This module bridges each combination, and holds a 2026-07-28
client's listen streams (``subscriptions/listen``), its only way to hear of list changes and resource updates.
"""

from __future__ import annotations

import threading
import time

from coffer_src.gateway.calls import CallState, ForwardedCall, Question
from coffer_src.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, RpcError, rpc_error, valid_request_id
from coffer_src.modern import (
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    ListenFilter,
    RequestClaims,
    RequestStateSealer,
    listen_frame,
    missing_capability,
    parse_input_required,
    parse_listen_filter,
)
from coffer_src.terminal import printable
from coffer_src.threads import backoff_delay
from coffer_src.upstream.definitions import SERVER_REQUEST_NEEDS
from coffer_src.upstream.supervisor import Upstream

#: input_required rounds Coffer drives for a handshake-era client before it gives up on the call.
MAX_INPUT_ROUNDS = 10
#: Questions an upstream may park with no call to carry them yet, per upstream.
MAX_ORPHAN_QUESTIONS = 8


class EraBridge:
    """One session's bridge between the protocol eras.

    Its records (``exchanges``: calls whose questions are out with the client, by exchange id; ``progress_calls``:
    Coffer's progress token upstream -> call; ``orphan_questions``: questions asked before any call could carry
    them, per upstream; ``listen_streams``: a 2026-07-28 client's open subscriptions/listen requests) are guarded
    by the session's lock.  The sealer signs the requestState a 2026-07-28 client must hand back unchanged.
    """

    def __init__(self, session):
        self.session = session
        self.hub = session.hub
        self.exchanges: dict[str, ForwardedCall] = {}
        self.progress_calls: dict[str, ForwardedCall] = {}
        self.orphan_questions: dict[str, list[Question]] = {}
        self.listen_streams: dict[object, ListenFilter] = {}
        self.sealer = RequestStateSealer(ttl=float(self.hub.settings["mrtr_ttl"]))

    # -- listen streams (2026-07-28 clients) -----------------------------------------------------------------
    def listen(self, msg_id, params):
        """subscriptions/listen: acknowledge what Coffer will deliver, then keep the stream open (never answered)
        until the client cancels it; list changes and resource updates go to every stream that asked."""
        session = self.session
        wanted = parse_listen_filter(params)
        offered = {kind for kind in ("tools", "prompts", "resources") if kind in session.advertised}
        resources = session.advertised.get("resources")
        honoured = wanted.honoured(offered, bool(isinstance(resources, dict) and resources.get("subscribe")))
        catalogue = session.catalogue
        routes = [(uri, catalogue.route_resource(uri)) for uri in honoured.uris]
        honoured = honoured._replace(uris=tuple(uri for uri, route in routes if route is not None))
        with session.lock:
            self.listen_streams[msg_id] = honoured
        session.send(listen_frame("notifications/subscriptions/acknowledged", msg_id,
                                  {"notifications": honoured.wire()}))
        for uri, route in routes:
            if route is not None:
                session.calls.subscribe_upstream(route, True)
        return None

    def end_listen(self, request_id) -> None:
        """The client cancelled a listen stream: unsubscribe what no other stream of its still wants."""
        session = self.session
        with session.lock:
            stream = self.listen_streams.pop(request_id, None)
            still = {uri for other in self.listen_streams.values() for uri in other.uris}
        if stream is None:
            return
        for uri in set(stream.uris) - still:
            route = session.catalogue.route_resource(uri)
            if route is not None:
                session.calls.subscribe_upstream(route, False)

    def announce(self, method: str, key: str, params: dict | None, uri: str | None) -> None:
        """A change notification for a 2026-07-28 client: one frame per listen stream that asked for it."""
        with self.session.lock:
            streams = [sid for sid, wanted in self.listen_streams.items()
                       if (uri in wanted.uris if uri is not None else wanted.wants(key))]
        for sid in streams:
            self.session.send(listen_frame(method, sid, params))

    # -- progress ---------------------------------------------------------------------------------------------
    def progress_for_client(self, params: dict) -> dict | None:
        """A progress notification as this client must see it: a 2026-07-28 call's progress carries Coffer's own
        token upstream (a retry is a new request with a new token), mapped back to the token of the request
        that now stands for the call; None when nobody is to see it."""
        token = params.get("progressToken")
        with self.session.lock:
            call = self.progress_calls.get(token) if isinstance(token, str) else None
            meta = call.client_params.get("_meta") if call is not None and call.state is CallState.ANSWERING \
                else None
        if call is None:
            return None  # not a token of this session's calls
        if not isinstance(meta, dict) or not valid_request_id(meta.get("progressToken")):
            return None  # detached while a question is out, or the current request asked for no progress
        return {**params, "progressToken": meta["progressToken"]}

    def call_finished(self, call: ForwardedCall, cancelled: bool = False) -> None:
        """Forget what the bridge kept for a call that is over (caller holds the session's lock)."""
        if cancelled:
            self._forget_progress(call)
            if call.exchange is not None:
                self.exchanges.pop(call.exchange, None)
        elif call.progress_token is not None and not call.exchange:
            self._forget_progress(call)

    def _forget_progress(self, call: ForwardedCall) -> None:
        if call.progress_token is not None:
            self.progress_calls.pop(call.progress_token, None)
            self.hub.forget_progress(call.progress_token)

    # -- a call, before it is sent ------------------------------------------------------------------------------
    def track_progress(self, call: ForwardedCall, params: dict, meta: dict) -> None:
        """The call's progress goes upstream under a token of Coffer's, mapped back to the token of the client
        request that stands for the call (a 2026-07-28 client's retry is a new request with a new token, and
        two clients' tokens may be the same)."""
        call.progress_token = self.hub.progress_token(self.session)
        with self.session.lock:
            self.progress_calls[call.progress_token] = call
        call.upstream_params = {**params, "_meta": {**meta, "progressToken": call.progress_token}}

    def carry_orphans(self, call: ForwardedCall) -> bool:
        """A 2026-07-28 client's call asks first the questions its upstream asked before any call could carry
        them.  True when the call was parked for them (it is sent once they are answered)."""
        session = self.session
        with session.lock:
            orphans = self.orphan_questions.pop(call.upstream.name, [])
            if orphans:  # the upstream asked before any call could carry the question: this one carries it first
                for question in orphans:
                    call.questions[session.new_id("coffer-")] = question
                session.calls.inflight[call.msg_id] = call
        if not orphans:
            return False
        self.ask_parked(call)
        return True

    # -- an upstream that needs the client mid-call -----------------------------------------------------------
    def input_required(self, call: ForwardedCall, msg_id, result: dict) -> None:
        """A 2026-07-28 upstream answered input_required.  A modern client gets it with the upstream's
        requestState sealed inside Coffer's own (so the retry reaches the same upstream, byte for byte); a
        handshake-era client has the questions asked as real requests, and Coffer retries for it."""
        session, calls = self.session, self.session.calls
        try:
            round_ = parse_input_required(result)
        except ValueError as exc:
            calls.fail(call, msg_id, f"the upstream asked for input in a way Coffer cannot relay: {exc}")
            return
        if session.client_era == "modern":
            sealed = self.sealer.seal(call.method, call.client_params,
                                      RequestClaims(upstream=call.upstream.name, upstream_state=round_.request_state))
            session.respond(msg_id, call.method, {**result, "requestState": sealed})
            return
        call.rounds += 1
        if call.rounds > MAX_INPUT_ROUNDS:
            calls.fail(call, msg_id, f"the upstream kept asking for input (more than {MAX_INPUT_ROUNDS} rounds)")
            return
        answers: dict = {}
        outstanding = set(round_.requests)

        def retry():
            params = {**call.upstream_params, "inputResponses": answers}
            if round_.request_state is not None:
                params["requestState"] = round_.request_state
            else:
                params.pop("requestState", None)
            with session.lock:
                call.upstream_params = params
                call.answer_to(msg_id)
            calls.send(call)

        if not outstanding:  # only a requestState: the server asks to be retried (load shedding)
            threading.Timer(backoff_delay(call.rounds, 0.05, 0.25), retry).start()
            return
        for key, request in round_.requests.items():
            need = SERVER_REQUEST_NEEDS[request["method"]]
            if need not in session.client_capabilities:
                calls.fail(call, msg_id, f"the upstream needs {need}, which this client did not declare")
                return

            def answered(reply, key=key):
                if "error" in reply or not isinstance(reply.get("result"), dict):
                    error = reply.get("error") or {}
                    calls.fail(call, msg_id, f"the client refused the upstream's question: "
                                             f"{printable(str(error.get('message', 'no answer')))[:200]}")
                    return
                with session.lock:
                    answers[key] = reply["result"]
                    outstanding.discard(key)
                    complete = not outstanding
                if complete:
                    retry()

            session.request_client_async(request["method"], request["params"], answered)

    def park(self, upstream: Upstream, message: dict) -> None:
        """A handshake-era upstream asks a 2026-07-28 client something (sampling, elicitation, roots) mid-call:
        the client can be asked only as the answer to one of its calls, so the oldest call in flight to that
        upstream answers input_required with the question and a sealed requestState; the upstream's request waits
        (its call's timeout paused) until the client retries with the answer, or mrtr_ttl passes."""
        session, calls = self.session, self.session.calls
        method, params = message["method"], message.get("params") if isinstance(message.get("params"), dict) else {}
        with session.lock:
            carriers = calls.carriers(upstream)
            detached = [c for c in self.exchanges.values() if c.upstream is upstream]
            carrier = min(carriers, key=lambda c: c.started) if carriers else (detached[0] if detached else None)
            if carrier is None:  # no call to carry it yet: the next call to this upstream will ask it first
                orphans = self.orphan_questions.setdefault(upstream.name, [])
                parked = len(orphans) < MAX_ORPHAN_QUESTIONS
                if parked:
                    orphans.append(Question(message["id"], method, params))
        if carrier is None:
            if not parked:
                upstream.respond(rpc_error(message["id"], INTERNAL_ERROR, "Coffer: too many questions are waiting "
                                           "for this 2026-07-28 client"))
            return
        need = missing_capability(method, params, carrier.capabilities)
        if need is not None:
            upstream.respond(rpc_error(message["id"], METHOD_NOT_FOUND, "the client does not support this request"))
            with session.lock:
                msg_id = carrier.msg_id
                if carrier.state is not CallState.ANSWERING or calls.inflight.get(msg_id) is not carrier:
                    return
                del calls.inflight[msg_id]
                carrier.state = CallState.DONE
            upstream.cancel(carrier.ticket, "the client cannot answer what the tool asked")
            if carrier.kind:
                calls.record(upstream.name, carrier.capability, carrier.kind, carrier.started, "error",
                             f"needs the client's {', '.join(need)}")
            session.send(rpc_error(msg_id, MISSING_REQUIRED_CLIENT_CAPABILITY, "the tool needs a client capability "
                                   "this request did not declare", {"requiredCapabilities": need}))
            return
        with session.lock:
            carrier.questions[session.new_id("coffer-")] = Question(message["id"], method, params)
        self.ask_parked(carrier)

    def ask_parked(self, call: ForwardedCall) -> None:
        """Answer the call's current client request with the questions not yet asked (if it has one waiting)."""
        session = self.session
        with session.lock:
            msg_id = call.msg_id
            fresh = {key: q for key, q in call.questions.items() if not q.asked}
            if call.state is not CallState.ANSWERING or not fresh:
                return
            for question in fresh.values():
                question.asked = True
            if session.calls.inflight.get(msg_id) is call:
                del session.calls.inflight[msg_id]
            call.park()
            if call.exchange is None:
                call.exchange = session.new_id("x")
            self.exchanges[call.exchange] = call
            call.parked_until = time.monotonic() + float(self.hub.settings["mrtr_ttl"])
        if call.sent:
            call.upstream.hold(call.ticket)
        state = self.sealer.seal(call.method, call.client_params, RequestClaims(exchange=call.exchange))
        session.respond(msg_id, call.method, {
            "resultType": "input_required", "requestState": state,
            "inputRequests": {key: {"method": q.method, **({"params": q.params} if q.params or q.method != "roots/list"
                                                            else {})} for key, q in fresh.items()}})

    def resume(self, msg_id, method: str, params: dict, started: float):
        """A 2026-07-28 client's retry carrying a requestState Coffer sealed: answers for a parked exchange, or
        an upstream's own state to hand back to it, byte for byte."""
        session, calls = self.session, self.session.calls
        claims = self.sealer.unseal_claims(params.get("requestState"), method, params)
        responses = params.get("inputResponses")
        if responses is not None and not isinstance(responses, dict):
            raise RpcError(INVALID_PARAMS, "'inputResponses' must be an object")
        responses = responses or {}
        if claims.is_ask_round and self.hub.knowledge is not None:  # coffer__ask's rounds with the client's model
            arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
            self.hub.workers.submit(session.answer, msg_id, method, lambda: session.tools.ask(
                arguments, started, params, claims, responses), owner=session)
            return None
        if claims.is_upstream_round:  # a 2026-07-28 upstream's own round: back to it, whatever the catalogue says
            upstream = session.upstream_named(claims.upstream)
            catalogue = session.catalogue
            route = (catalogue.tool_routes if method == "tools/call" else catalogue.prompt_routes).get(
                params.get("name")) if method != "resources/read" else catalogue.route_resource(params["uri"])
            if upstream is None or route is None or route.upstream.name != upstream.name:
                raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
            key = "uri" if method == "resources/read" else "name"
            upstream_params, refused = catalogue.with_fixed(params.get("name"), params) if method == "tools/call" \
                else (params, None)
            if refused:  # the round's retry carries what the client sent: the fixed arguments are filled in again
                raise RpcError(INVALID_PARAMS, refused)
            upstream_params = {k: v for k, v in upstream_params.items() if k != "requestState"}
            upstream_params[key] = route.name
            if claims.upstream_state is not None:
                upstream_params["requestState"] = claims.upstream_state
            calls.forward(msg_id, upstream, method, upstream_params, params.get(key), "tool" if method == "tools/call"
                          else "prompt" if method == "prompts/get" else "resource", started, params)
            return None
        with session.lock:
            call = self.exchanges.get(claims.exchange)
            if call is None or call.state is not CallState.PARKED:
                call = None
            else:
                answered = {key: q for key, q in call.questions.items() if q.asked and isinstance(
                    responses.get(key), dict)}
                for key in answered:
                    del call.questions[key]
                call.answer_to(msg_id)
                call.client_params = {**call.client_params, **{k: v for k, v in params.items() if k == "_meta"}}
                if not call.questions:
                    del self.exchanges[call.exchange]
                    call.exchange = None
                held, call.held = call.held, None
                if held is None:
                    calls.inflight[msg_id] = call
                else:
                    call.state = CallState.DONE
        if call is None:
            raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
        for key, question in answered.items():
            call.upstream.respond({"jsonrpc": "2.0", "id": question.upstream_id, "result": responses[key]})
        if not call.sent and not call.questions:
            calls.send(call)  # the questions that came first are answered: now the call itself
            return None
        call.upstream.release(call.ticket)
        if held is not None:
            calls.deliver(call, msg_id, held)
            return None
        for question in call.questions.values():
            question.asked = False  # not answered in this retry: ask again
        self.ask_parked(call)
        return None

    def expire(self, now: float) -> None:
        """A question nobody answered within mrtr_ttl: the upstream's call is cancelled and forgotten."""
        if not self.exchanges:  # read without the lock: an exchange parked just now expires at a later tick
            return
        with self.session.lock:
            stale = [call for call in self.exchanges.values() if call.parked_until <= now]
            for call in stale:
                del self.exchanges[call.exchange]
                self._forget_progress(call)
        for call in stale:
            for question in call.questions.values():
                call.upstream.respond(rpc_error(question.upstream_id, INTERNAL_ERROR, "the client never answered"))
            call.upstream.cancel(call.ticket, "the client never answered what the tool asked")
            if call.kind:
                self.session.calls.record(call.upstream.name, call.capability, call.kind, call.started, "cancelled",
                                          "the client never answered what the tool asked")
