"""Upstream requests: what Coffer asked a server and waits on, or waits to send."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from coffer_src.jsonrpc import EncodeError, valid_request_id, wire_log, wire_text
from coffer_src.modern import Envelope
from coffer_src.transport.stdio import UpstreamFailure
from coffer_src.upstream.definitions import normalized_reply


class Pending:
    """One request Coffer sent to an upstream and is waiting on.  ``timeout`` is how long it may go without a
    reply or progress; ``deadline`` when it times out (progress pushes it back; None: never, or held)."""

    __slots__ = ("method", "on_reply", "timeout", "deadline", "token")

    def __init__(self, method, on_reply, timeout, token, deadline=None):
        self.method, self.on_reply, self.timeout, self.token = method, on_reply, timeout, token
        self.deadline = deadline if deadline is not None else (time.monotonic() + timeout if timeout else None)


class QueuedRequest:
    """A request waiting for its server to be ready.  Its deadline started when it was asked for: waiting for a
    slow or failing server counts against the caller's call_timeout.  ``ticket`` is the caller's handle
    (supervisor.Ticket), by which a queued request is found and cancelled."""

    __slots__ = ("method", "params", "on_reply", "timeout", "ticket", "deadline", "envelope")

    def __init__(self, method: str, params: object, on_reply: Callable, timeout: float, ticket: object,
                 deadline: float | None, envelope: Envelope | None = None):
        self.method, self.params, self.on_reply, self.timeout = method, params, on_reply, timeout
        self.ticket, self.deadline, self.envelope = ticket, deadline, envelope


class RequestTable:
    """The requests of one upstream, from asking to answer: ``pending`` (sent, by Coffer's own request id, so a
    client's ids never reach a server), ``by_token`` (the same, by the progress token the caller gave, so progress
    pushes a deadline back) and ``backlog`` (asked while the server starts; sent when it is ready, failed when it
    fails).  Each request's ``on_reply(response, failure_status, failure_text)`` runs exactly once -- the answer,
    a failure, a timeout -- unless it is cancelled first.  A Ticket (supervisor.py) is the caller's handle on one.

    Threads: any thread asks, cancels, holds and releases; replies and failures come on the transport's threads;
    the gateway's ticker runs ``expire``.  The table has no lock of its own: it uses its Upstream's
    (``upstream.lock``), which also guards the state its decisions depend on (queue or send, fail or requeue) and
    every Ticket's fields.  ``take_all`` and ``take_backlog`` are for the Upstream's lifecycle, which calls them
    with that lock held; every other method takes it itself, never while it calls out (``on_reply``, a send, a
    notification).  ``idle`` reads without it, for the ticker's fast path.
    """

    def __init__(self, upstream):
        self.upstream = upstream  # supervisor.Upstream: its lock, state, transport, era (prepare) and notify
        self.pending: dict[int, Pending] = {}
        self.by_token: dict = {}
        self.backlog: list[QueuedRequest] = []
        self._next_id = 0

    # -- asking ------------------------------------------------------------------------------------------------
    def submit(self, method: str, params, on_reply, timeout: float, ticket, deadline: float | None = None,
               envelope: Envelope | None = None):
        """Send a request, or queue it while the server starts (an idle server is started).  ``ticket`` when it
        was sent or queued; None when it failed at once (``on_reply`` has run) or was cancelled meanwhile."""
        up = self.upstream
        if deadline is None and timeout:
            deadline = time.monotonic() + timeout
        with up.lock:
            if ticket.cancelled:
                return None  # cancelled while it waited in the backlog: never sent, never answered
            state = up.state
            if state in ("starting", "backoff", "idle"):
                self.backlog.append(QueuedRequest(method, params, on_reply, timeout, ticket, deadline, envelope))
                if state == "idle":
                    up.start()
                return ticket
            unavailable = state != "ready"
        if unavailable:
            detail = f": {up.last_error}" if up.last_error else ""
            on_reply(None, "error", f"upstream '{up.name}' is unavailable ({state}){detail}")
            return None
        queued = QueuedRequest(method, params, on_reply, timeout, ticket, deadline, envelope)
        request_id = self.send(method, params, on_reply, timeout, deadline, queued, envelope)
        with up.lock:
            ticket.request_id = request_id
            raced = ticket.cancelled and request_id is not None  # cancelled while it was being sent
            requeued = request_id is None and queued in self.backlog  # by identity (eq=False)
        if raced and self.finish(request_id) is not None:
            up.notify("notifications/cancelled", {"requestId": request_id, "reason": "cancelled by the client"})
            return None
        return ticket if request_id is not None or requeued else None

    def run_backlog(self, backlog: list[QueuedRequest]) -> None:
        """Ask again what waited for the server (taken by ``take_backlog``): sent if it is ready, else failed."""
        for queued in backlog:
            self.submit(queued.method, queued.params, queued.on_reply, queued.timeout, queued.ticket,
                        queued.deadline, queued.envelope)

    def send(self, method: str, params, on_reply, timeout: float, deadline: float | None = None,
             requeue: QueuedRequest | None = None, envelope: Envelope | None = None) -> int | None:
        """Register and send one request, whatever the state (Coffer's own requests during a start come here
        directly; a client's through ``submit``); its id, or None when it failed (``on_reply`` has run) — or, with
        ``requeue``, when the connection had just died unnoticed and the request now waits for the restart."""
        up = self.upstream
        with up.lock:
            request_id = self._register(method, params, on_reply, timeout, deadline)
            transport = up.transport
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        params = up.prepare(method, params, envelope)
        if params is not None:
            message["params"] = params
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("coffer -> %s: %s", up.name, wire_text(message))
        try:
            sent = transport is not None and transport.send(message)
        except EncodeError as exc:
            self.finish(request_id)
            on_reply(None, "error", f"the request could not be sent: {exc}")
            return None
        if sent:
            return request_id
        self.finish(request_id)
        if requeue is not None:
            with up.lock:
                if up.state in ("ready", "backoff", "starting"):  # its close is on its way: wait for the restart
                    self.backlog.append(requeue)
                    return None
        on_reply(None, "error", f"upstream '{up.name}' "
                                f"{(transport and transport.exit_detail()) or 'is not accepting input'}")
        return None

    def call_raw(self, method: str, params, timeout: float) -> dict:
        """A blocking request for Coffer's own use (initialize, discovery): the normalized reply, result or error;
        UpstreamFailure when none came (timeout, the connection ended)."""
        done = threading.Event()
        box = {}

        def on_reply(response, failure, text):
            box["response"], box["failure"], box["text"] = response, failure, text
            done.set()

        self.send(method, params, on_reply, timeout)
        done.wait(timeout + 5.0)
        if not done.is_set():
            raise UpstreamFailure(f"{method} timed out after {timeout:g}s")
        if box["response"] is None:
            raise UpstreamFailure(f"{method}: {box['text']}")
        return box["response"]

    def _register(self, method: str, params, on_reply, timeout, deadline) -> int:
        """A new request id, now pending (the lock held); its progress token (params' _meta.progressToken) is
        indexed when the spec allows it (a string or an integer: nothing else can push a deadline back)."""
        self._next_id += 1
        request_id = self._next_id
        token = None
        if isinstance(params, dict):
            meta = params.get("_meta")
            if isinstance(meta, dict) and "progressToken" in meta:
                token = meta["progressToken"]
        if not valid_request_id(token):
            token = None
        pending = Pending(method, on_reply, timeout, token, deadline)
        self.pending[request_id] = pending
        if token is not None:
            self.by_token[token] = pending
        return request_id

    # -- answers -----------------------------------------------------------------------------------------------
    def finish(self, request_id) -> Pending | None:
        """Forget a request (answered, failed, cancelled or timed out): its Pending, or None if it was not."""
        with self.upstream.lock:
            pending = self.pending.pop(request_id, None)
            if pending is not None and pending.token is not None and self.by_token.get(pending.token) is pending:
                del self.by_token[pending.token]
        return pending

    def answer(self, message: dict) -> None:
        """A reply from the server: to its request's ``on_reply``, rebuilt as well-formed JSON-RPC.  A late reply
        to a cancelled or timed-out request (or one to nothing Coffer asked) is delivered to nobody."""
        msg_id = message.get("id")
        pending = self.finish(msg_id) if isinstance(msg_id, int) and not isinstance(msg_id, bool) else None
        if pending is not None:
            pending.on_reply(normalized_reply(message), None, None)

    def fail(self, request_id, text: str) -> bool:
        """The request ``request_id`` failed without an answer from the server: ``on_reply`` hears ``text`` as an
        error.  False when no such request is pending."""
        pending = self.finish(request_id) if isinstance(request_id, int) else None
        if pending is None:
            return False
        pending.on_reply(None, "error", text)
        return True

    def progressed(self, token) -> bool:
        """Progress came for ``token``: push its request's deadline back.  False when no request of this upstream
        carries that token (the progress is not this upstream's to report)."""
        if not valid_request_id(token):
            return False
        with self.upstream.lock:
            pending = self.by_token.get(token)
            if pending is not None and pending.timeout:
                pending.deadline = time.monotonic() + pending.timeout
        return pending is not None

    # -- the caller's handle -----------------------------------------------------------------------------------
    def cancel(self, ticket, reason: str) -> bool:
        """Forget a request (a late reply is then dropped) and tell the upstream, with its own id; a request
        still queued is simply never sent.  False if it was already answered or cancelled (or never sent)."""
        up = self.upstream
        with up.lock:
            if ticket.cancelled:
                return False
            ticket.cancelled = True
            request_id = ticket.request_id
            if request_id is None:
                self.backlog = [queued for queued in self.backlog if queued.ticket is not ticket]
                return True
        if self.finish(request_id) is None:
            return False
        up.notify("notifications/cancelled", {"requestId": request_id, "reason": reason})
        return True

    def hold(self, ticket) -> None:
        """No deadline while the client is asked something for this request (a person may be answering)."""
        with self.upstream.lock:
            pending = self.pending.get(ticket.request_id)
            if pending is not None:
                pending.deadline = None

    def release(self, ticket) -> None:
        """The client answered: the request's timeout runs again, from now."""
        with self.upstream.lock:
            pending = self.pending.get(ticket.request_id)
            if pending is not None and pending.timeout:
                pending.deadline = time.monotonic() + pending.timeout

    # -- timeouts ----------------------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing pending, nothing queued.  Read without the lock (two truth tests): a request added meanwhile
        is seen by the ticker's next round."""
        return not self.pending and not self.backlog

    def expire(self, now: float) -> None:
        """Time out requests whose deadline passed (progress pushes a deadline back), queued ones included."""
        up = self.upstream
        if self.idle():
            return
        with up.lock:
            expired = [rid for rid, pending in self.pending.items()
                       if pending.deadline is not None and pending.deadline <= now]
            waited = [queued for queued in self.backlog if queued.deadline is not None and queued.deadline <= now]
            if waited:
                self.backlog = [queued for queued in self.backlog if queued not in waited]
        for queued in waited:
            detail = f" (last error: {up.last_error})" if up.last_error else ""
            queued.on_reply(None, "timeout", f"upstream '{up.name}' was not ready within {queued.timeout:g}s"
                                             f"{detail}")
        for request_id in expired:
            pending = self.finish(request_id)  # unless answered meanwhile: then its answer stands
            if pending is not None:
                if pending.method != "initialize":  # the spec forbids cancelling initialize
                    up.notify("notifications/cancelled", {"requestId": request_id, "reason": "timed out"})
                pending.on_reply(None, "timeout",
                                 f"upstream '{up.name}' did not answer {pending.method} within {pending.timeout:g}s")

    # -- for the lifecycle, under the Upstream's lock -------------------------------------------------------------
    def take_all(self) -> list[Pending]:
        """Every pending request, forgotten: the connection they were sent on is gone (the caller fails them)."""
        orphaned = list(self.pending.values())
        self.pending.clear()
        self.by_token.clear()
        return orphaned

    def take_backlog(self) -> list[QueuedRequest]:
        """Every queued request, in arrival order, now the caller's: for ``run_backlog``."""
        backlog, self.backlog = self.backlog, []
        return backlog
