"""Gateway calls: named records of what a client session has in flight through Coffer.

Every record here belongs to one client session and is guarded by that session's lock (``ClientSession.lock``);
a field read or written without it says why in a comment.
"""

from __future__ import annotations

import enum
import threading
from typing import Callable, NamedTuple

from coffer_src.jsonrpc import LOG_LEVELS
from coffer_src.modern import META_CLIENT_CAPABILITIES, META_LOG_LEVEL
from coffer_src.upstream.supervisor import Ticket, Upstream


class Reply(NamedTuple):
    """An upstream's answer to one forwarded request, as ``Upstream.request`` reports it: the normalized JSON-RPC
    reply, or no ``response`` and a ``failure`` ("timeout" or "error") with the ``text`` the client is told."""
    response: dict | None
    failure: str | None
    text: str | None


class CallState(enum.Enum):
    """Where a forwarded call stands, from the client's side.

    ANSWERING: a client request (``ForwardedCall.msg_id``) waits for the upstream's answer.
    PARKED: the upstream asked the client something mid-call; a 2026-07-28 client answers by retrying the call, so
        until that retry the call has no client request, and an upstream answer arriving meanwhile is ``held``.
    DONE: answered, failed or cancelled; an answer that still arrives is dropped.
    """
    ANSWERING = "answering"
    PARKED = "parked"
    DONE = "done"


class Question:
    """A request an upstream asked the client mid-call, parked for a 2026-07-28 client (which answers it by
    retrying the call with inputResponses).  ``asked``: already sent to the client in an input_required result."""

    def __init__(self, upstream_id: object, method: str, params: dict, asked: bool = False):
        self.upstream_id, self.method, self.params, self.asked = upstream_id, method, params, asked


class ForwardedCall:
    """A client request Coffer sent to an upstream, until its answer reaches the client.

    ``msg_id`` is the client request that will receive the answer while the call is ANSWERING: the original one
    or, after the upstream asked the client something mid-call, the retry that answered it.  ``sent`` is False
    while questions the upstream asked before the call could carry them are answered first.
    """

    def __init__(self, upstream: Upstream, method: str, capability: str, kind: str | None, started: float,
                 msg_id: object, client_params: dict, upstream_params: dict,
                 state: CallState = CallState.ANSWERING, ticket: Ticket | None = None, held: Reply | None = None,
                 exchange: str | None = None, questions: dict[str, Question] | None = None,
                 parked_until: float = 0.0, rounds: int = 0, progress_token: object = None, sent: bool = False):
        self.upstream = upstream
        self.method = method
        self.capability = capability
        self.kind = kind
        self.started = started
        self.msg_id = msg_id
        self.client_params = client_params      # as the client sent them: what a sealed requestState is bound to
        self.upstream_params = upstream_params  # as sent upstream (original name), for a multi-round-trip retry
        self.state = state
        self.ticket = ticket
        self.held = held                        # the upstream's answer, arrived while PARKED
        self.exchange = exchange                # id in the session's parked exchanges while questions are out
        self.questions: dict[str, Question] = {} if questions is None else questions
        self.parked_until = parked_until
        self.rounds = rounds                    # input_required rounds driven for a handshake-era client
        self.progress_token = progress_token    # Coffer's own token upstream (2026-07-28 client), mapped to the
                                                # current client request's token
        self.sent = sent                        # the call itself has gone upstream

    @property
    def log_level(self) -> str | None:
        meta = self.client_params.get("_meta")
        level = meta.get(META_LOG_LEVEL) if isinstance(meta, dict) else None
        return level if level in LOG_LEVELS else None

    @property
    def capabilities(self) -> dict:
        meta = self.client_params.get("_meta")
        caps = meta.get(META_CLIENT_CAPABILITIES) if isinstance(meta, dict) else None
        return caps if isinstance(caps, dict) else {}

    def answer_to(self, msg_id) -> None:
        """The call answers ``msg_id`` now (the first request, or a retry that answered its questions)."""
        self.msg_id, self.state = msg_id, CallState.ANSWERING

    def park(self) -> None:
        """A question is out with the client: no client request waits for this call until the retry."""
        self.msg_id, self.state = None, CallState.PARKED


class RelayedRequest(NamedTuple):
    """A server->client request Coffer relayed under an id of its own: where the client's answer goes back to."""
    upstream: Upstream
    generation: int
    upstream_id: object


class Waiting(NamedTuple):
    """A client request that waits, with no thread, for starting upstreams (at most until the discovery deadline)
    or, with ``server``, for that one upstream's start (at most until its own ``deadline``)."""
    msg_id: object
    work: Callable
    kind: str | None
    method: str
    server: str | None = None
    deadline: float = 0.0


class OwnRequest:
    """A request Coffer itself sent the client (sampling for coffer__ask): ``done`` is set when ``reply`` (the
    normalized answer) has arrived; ``callback(reply)``, if any, then runs on the client reader thread."""

    def __init__(self, callback: Callable[[dict], None] | None = None, done: threading.Event | None = None,
                 reply: dict | None = None):
        self.callback = callback
        self.done = threading.Event() if done is None else done
        self.reply = reply
