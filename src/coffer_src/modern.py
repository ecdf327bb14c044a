"""MCP 2026-07-28, the stateless era: envelope, result shapes, listen, requestState."""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from typing import NamedTuple

from coffer_src import __version__
from coffer_src.digests import hmac_sha256, same_secret, sha256
from coffer_src.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    LOG_LEVELS,
    PROTOCOL_VERSIONS,
    EncodedResult,
    RpcError,
    dumps,
)

modern_log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------------------
# 1b. MCP 2026-07-28, the stateless era: the per-request envelope, result shapes, listen filters, requestState
#
# A 2026-07-28 request carries its protocol version, client identity and capabilities in params._meta; every
# result carries resultType; list results carry cache hints; change notifications travel only on
# subscriptions/listen streams; a server asks the client for input by answering input_required and reading the
# answers from the retry.  These helpers hold the wire rules so the gateway and the upstream code can stay about
# routing.  All of them treat their input as hostile and never keep state.

MODERN_PROTOCOL_VERSIONS = ("2026-07-28",)
META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
META_SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
ENVELOPE_KEYS = (META_PROTOCOL_VERSION, META_CLIENT_INFO, META_CLIENT_CAPABILITIES, META_LOG_LEVEL)

MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022

INPUT_REQUIRED_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})
CACHEABLE_METHODS = frozenset({"server/discover", "tools/list", "prompts/list", "resources/list",
                               "resources/templates/list", "resources/read"})
MODERN_CLIENT_METHODS = frozenset({"server/discover", "subscriptions/listen", "tools/list", "tools/call",
                                   "prompts/list", "prompts/get", "resources/list", "resources/templates/list",
                                   "resources/read", "completion/complete"})
HANDSHAKE_ONLY_METHODS = frozenset({"initialize", "ping", "logging/setLevel", "resources/subscribe",
                                    "resources/unsubscribe"})
INPUT_REQUEST_METHODS = frozenset({"sampling/createMessage", "elicitation/create", "roots/list"})

MAX_TTL_MS = 24 * 60 * 60 * 1000        # the SDK client caps any ttlMs at a day; so do we
MAX_REQUEST_STATE = 256 * 1024          # an upstream's sealed state rides inside ours: far above what SDKs seal
MAX_INPUT_REQUESTS = 32
MAX_LISTEN_URIS = 256
MAX_URI_LENGTH = 2048
_SCHEMA_WALK_LIMIT = 20_000             # schema nodes visited when rewriting $refs (a hostile schema costs this)


class Envelope(NamedTuple):
    """The 2026-07-28 per-request fields of one client request (params._meta)."""
    protocol_version: str
    client_capabilities: dict
    client_info: dict | None
    log_level: str | None


def is_enveloped(params) -> bool:
    """Whether a request claims the modern era: the protocol-version key alone is the signal, so a half-built
    envelope still routes modern and gets the error that names what is missing."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and META_PROTOCOL_VERSION in meta


def parse_envelope(params) -> Envelope:
    """Validate the envelope the way the spec orders it: shape and required keys (-32602), then the version
    (-32022 naming what Coffer speaks).  clientInfo is display-only: a malformed one reads as absent."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict):
        raise RpcError(INVALID_PARAMS, f"params._meta must be an object carrying the required "
                                       f"'{META_PROTOCOL_VERSION}' and '{META_CLIENT_CAPABILITIES}' envelope keys")
    missing = [key for key in (META_PROTOCOL_VERSION, META_CLIENT_CAPABILITIES) if key not in meta]
    if missing:
        raise RpcError(INVALID_PARAMS, f"params._meta is missing the required envelope key(s): {', '.join(missing)}")
    version = meta[META_PROTOCOL_VERSION]
    if not isinstance(version, str):
        raise RpcError(INVALID_PARAMS, "the protocol-version envelope value must be a string")
    if version not in MODERN_PROTOCOL_VERSIONS:
        raise RpcError(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                       {"supported": list(MODERN_PROTOCOL_VERSIONS), "requested": version[:100]})
    capabilities = meta[META_CLIENT_CAPABILITIES]
    if not isinstance(capabilities, dict):
        raise RpcError(INVALID_PARAMS, f"'{META_CLIENT_CAPABILITIES}' must be an object")
    level = meta.get(META_LOG_LEVEL)
    if level is not None and level not in LOG_LEVELS:
        raise RpcError(INVALID_PARAMS, f"'{META_LOG_LEVEL}' must be one of {', '.join(LOG_LEVELS)}")
    info = meta.get(META_CLIENT_INFO)
    return Envelope(version, capabilities, info if isinstance(info, dict) else None, level)


def stamp_envelope(params, envelope: Envelope) -> dict:
    """Params for a modern upstream: the client's own _meta (progress token, trace context) with the envelope
    replaced by ``envelope`` - the client's identity and capabilities, never Coffer's own guesses."""
    params = dict(params) if isinstance(params, dict) else {}
    meta = params.get("_meta")
    meta = {k: v for k, v in meta.items() if k not in ENVELOPE_KEYS} if isinstance(meta, dict) else {}
    meta[META_PROTOCOL_VERSION] = MODERN_PROTOCOL_VERSIONS[-1]
    meta[META_CLIENT_CAPABILITIES] = envelope.client_capabilities
    if envelope.client_info is not None:
        meta[META_CLIENT_INFO] = envelope.client_info
    if envelope.log_level is not None:
        meta[META_LOG_LEVEL] = envelope.log_level
    params["_meta"] = meta
    return params


def strip_envelope(params) -> dict:
    """Params for a handshake upstream: the SDK's handshake loop refuses any request whose _meta carries the
    protocol-version key (-32600), and MRTR fields mean nothing there."""
    params = {k: v for k, v in params.items() if k not in ("inputResponses", "requestState")} \
        if isinstance(params, dict) else {}
    meta = params.get("_meta")
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in ENVELOPE_KEYS}
        if meta:
            params["_meta"] = meta
        else:
            del params["_meta"]
    return params


def coffer_server_info() -> dict:
    return {"name": "coffer", "title": "Coffer MCP gateway", "version": __version__}


def shape_modern_result(method: str, result, ttl_ms: int = 0, cache_scope: str = "private") -> dict:
    """A result as a 2026-07-28 client must receive it: resultType always, Coffer's serverInfo in _meta, and cache
    hints on complete results of the cacheable methods (an upstream's valid hints win over the defaults)."""
    if (type(result) is EncodedResult and result.json is not None and len(result) and "resultType" not in result
            and "_meta" not in result and method not in CACHEABLE_METHODS):
        # A result that carries its own text (coffer__search_tools's) keeps it: the keys added here go at the end
        # of the text as of the dict, so the reply is not encoded again.
        meta = {META_SERVER_INFO: coffer_server_info()}
        return EncodedResult({**result, "resultType": "complete", "_meta": meta},
                             f'{result.json[:-1]},"resultType":"complete","_meta":{dumps(meta)}}}')
    result = dict(result) if isinstance(result, dict) else {}
    kind = result.get("resultType")
    kind = "complete" if kind is None else kind  # a handshake upstream never sets it
    if kind == "input_required" and method in INPUT_REQUIRED_METHODS:
        result.pop("ttlMs", None)
        result.pop("cacheScope", None)  # interim results are never cacheable
    elif kind == "complete":
        result["resultType"] = "complete"
        if method in CACHEABLE_METHODS:
            ttl = result.get("ttlMs")
            valid = isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= 0 and ttl == ttl
            result["ttlMs"] = min(int(ttl), MAX_TTL_MS) if valid else ttl_ms
            if result.get("cacheScope") not in ("public", "private"):
                result["cacheScope"] = cache_scope
    else:
        # An extension's resultType (e.g. tasks) needs the extension advertised; Coffer advertises none.
        raise RpcError(INTERNAL_ERROR, f"the upstream answered {method} with resultType {str(kind)[:40]!r}, "
                                       "which Coffer does not bridge")
    meta = result.get("_meta")
    result["_meta"] = {**(meta if isinstance(meta, dict) else {}), META_SERVER_INFO: coffer_server_info()}
    return result


def shape_handshake_result(method: str, result, wrap_structured: bool = False) -> dict:
    """A complete result as a handshake-era client must receive it: no 2026 fields, and structuredContent an
    object (wrapped as {"result": value} when the tool's outputSchema was wrapped, or when it is not an object)."""
    result = dict(result) if isinstance(result, dict) else {}
    if result.get("resultType", "complete") != "complete":
        raise ValueError(f"not a complete result: resultType {result.get('resultType')!r}")
    for key in ("resultType", "ttlMs", "cacheScope"):
        result.pop(key, None)
    meta = result.get("_meta")
    if isinstance(meta, dict) and META_SERVER_INFO in meta:
        meta = {k: v for k, v in meta.items() if k != META_SERVER_INFO}
        if meta:
            result["_meta"] = meta
        else:
            del result["_meta"]
    if method == "tools/call" and "structuredContent" in result:
        value = result["structuredContent"]
        if wrap_structured or not (value is None or isinstance(value, dict)):
            result["structuredContent"] = {"result": value}
    return result


def shape_handshake_tool(tool: dict) -> tuple[dict, bool]:
    """A tool definition a handshake-era client accepts, and whether its results must be wrapped: 2025-11-25 wants
    outputSchema rooted at type "object" (the Python SDK rejects the whole tools/list otherwise)."""
    schema = tool.get("outputSchema")
    if "outputSchema" not in tool or (isinstance(schema, dict) and schema.get("type") == "object"):
        return tool, False
    if not isinstance(schema, (dict, bool)):
        return {k: v for k, v in tool.items() if k != "outputSchema"}, False  # not a schema at all: drop it
    return {**tool, "outputSchema": wrap_output_schema(schema)}, True


def wrap_output_schema(schema) -> dict:
    """``{"type":"object","properties":{"result": schema},"required":["result"]}``, with $schema and the $defs
    hoisted to the new root and other local $refs re-pointed, so references still resolve."""
    if isinstance(schema, bool):
        return {"type": "object", "properties": {"result": schema}, "required": ["result"]}
    inner = dict(schema)
    root: dict = {"type": "object"}
    if "$schema" in inner:
        root["$schema"] = inner.pop("$schema")
    if "$id" not in inner:  # with its own $id the inner schema stays a resource of its own and its refs resolve
        for key in ("$defs", "definitions"):
            if key in inner:
                root[key] = inner.pop(key)
        inner = _repoint_refs(inner)
    root["properties"] = {"result": inner}
    root["required"] = ["result"]
    return root


def _repoint_refs(schema):
    """Prefix local JSON-pointer $refs with /properties/result (except into the hoisted $defs); instance data
    (const, enum, default, examples) is copied untouched.  Bounded: a huge schema is left as it was."""
    budget = [_SCHEMA_WALK_LIMIT]

    def walk(node, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 64:
            raise OverflowError
        if isinstance(node, list):
            return [walk(item, depth + 1) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                pointer = value[1:]
                out[key] = value if pointer.startswith(("/$defs/", "/definitions/")) \
                    else "#/properties/result" + pointer
            elif key in ("const", "enum", "default", "examples"):
                out[key] = value
            else:
                out[key] = walk(value, depth + 1)
        return out

    try:
        return walk(schema, 0)
    except OverflowError:
        modern_log.warning("an outputSchema was too large to re-point its $refs; wrapped it unchanged")
        return schema


class ListenFilter(NamedTuple):
    """What one subscriptions/listen stream asked for (or, after ``honoured``, what it will get)."""
    tools: bool
    prompts: bool
    resources: bool
    uris: tuple[str, ...]

    def honoured(self, offered: set[str], can_subscribe: bool) -> ListenFilter:
        """The subset Coffer delivers: kinds it advertises (``offered`` ⊆ {"tools","prompts","resources"})."""
        return ListenFilter(self.tools and "tools" in offered, self.prompts and "prompts" in offered,
                            self.resources and "resources" in offered, self.uris if can_subscribe else ())

    def wire(self) -> dict:
        filt: dict = {}
        for flag, key in ((self.tools, "toolsListChanged"), (self.prompts, "promptsListChanged"),
                          (self.resources, "resourcesListChanged")):
            if flag:
                filt[key] = True
        if self.uris:
            filt["resourceSubscriptions"] = list(self.uris)
        return filt

    def wants(self, kind: str) -> bool:
        return {"tools": self.tools, "prompts": self.prompts, "resources": self.resources}.get(kind, False)


def parse_listen_filter(params) -> ListenFilter:
    notifications = params.get("notifications") if isinstance(params, dict) else None
    if not isinstance(notifications, dict):
        raise RpcError(INVALID_PARAMS, "'notifications' must be an object")
    flags = []
    for key in ("toolsListChanged", "promptsListChanged", "resourcesListChanged"):
        value = notifications.get(key)
        if value is not None and not isinstance(value, bool):
            raise RpcError(INVALID_PARAMS, f"notifications.{key} must be a boolean")
        flags.append(value is True)
    uris = notifications.get("resourceSubscriptions")
    if uris is None:
        uris = []
    if not isinstance(uris, list) or len(uris) > MAX_LISTEN_URIS or not all(
            isinstance(u, str) and 0 < len(u) <= MAX_URI_LENGTH for u in uris):
        raise RpcError(INVALID_PARAMS, f"notifications.resourceSubscriptions must be a list of at most "
                                       f"{MAX_LISTEN_URIS} URIs")
    return ListenFilter(*flags, tuple(dict.fromkeys(uris)))


def listen_frame(method: str, subscription_id, params: dict | None = None) -> dict:
    """A notification on a listen stream: tagged with the listen request's own JSON-RPC id."""
    params = dict(params or {})
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    params["_meta"] = {**meta, META_SUBSCRIPTION_ID: subscription_id}
    return {"jsonrpc": "2.0", "method": method, "params": params}


def missing_capability(method: str, params, capabilities) -> dict | None:
    """The requiredCapabilities a -32021 must name when ``capabilities`` (one request's envelope) cannot serve an
    upstream's ``method`` request, else None.  A bare ``elicitation: {}`` means form support (the pre-modes shape)."""
    caps = capabilities if isinstance(capabilities, dict) else {}
    params = params if isinstance(params, dict) else {}
    if method == "sampling/createMessage":
        sampling = caps.get("sampling")
        wants_tools = bool(params.get("tools")) or params.get("toolChoice") is not None
        if isinstance(sampling, dict) and (not wants_tools or isinstance(sampling.get("tools"), dict)):
            return None
        return {"sampling": {"tools": {}} if wants_tools else {}}
    if method == "elicitation/create":
        elicitation = caps.get("elicitation")
        if params.get("mode") == "url":
            return None if isinstance(elicitation, dict) and isinstance(elicitation.get("url"), dict) \
                else {"elicitation": {"url": {}}}
        if isinstance(elicitation, dict) and ("form" in elicitation or "url" not in elicitation):
            return None
        return {"elicitation": {"form": {}}}
    if method == "roots/list":
        return None if isinstance(caps.get("roots"), dict) else {"roots": {}}
    return None


class InputRound(NamedTuple):
    """One validated input_required result from a modern upstream."""
    requests: dict          # key -> {"method": ..., "params": {...}}
    request_state: str | None


def parse_input_required(result) -> InputRound:
    """Validate an upstream's input_required result before acting on it (ValueError says what is wrong)."""
    if not isinstance(result, dict) or result.get("resultType") != "input_required":
        raise ValueError("not an input_required result")
    raw = result.get("inputRequests")
    state = result.get("requestState")
    if raw is None and state is None:
        raise ValueError("input_required with neither inputRequests nor requestState")
    if state is not None and (not isinstance(state, str) or len(state) > MAX_REQUEST_STATE):
        raise ValueError("requestState must be a string of at most 256 KiB")
    requests: dict = {}
    if raw is not None:
        if not isinstance(raw, dict) or len(raw) > MAX_INPUT_REQUESTS:
            raise ValueError(f"inputRequests must be an object of at most {MAX_INPUT_REQUESTS} entries")
        for key, request in raw.items():
            if not (isinstance(key, str) and 0 < len(key) <= 256) or not isinstance(request, dict):
                raise ValueError("each inputRequests entry needs a short string key and an object")
            method, params = request.get("method"), request.get("params", {})
            if method not in INPUT_REQUEST_METHODS or not isinstance(params, dict):
                raise ValueError(f"inputRequests[{key[:40]!r}] is not sampling, elicitation or roots")
            requests[key] = {"method": method, "params": params}
    return InputRound(requests, state)


class DiscoverVerdict(NamedTuple):
    """What an upstream's answer to Coffer's server/discover probe says about its era."""
    era: str                # "modern", "handshake" or "incompatible"
    retry_discover: bool    # -32022 named a version we speak: ask once more before adopting it
    result: dict | None     # the DiscoverResult when era == "modern" and no retry is needed
    reason: str


def classify_discover_reply(response) -> DiscoverVerdict:
    """The spec's stdio probe (basic/transports/stdio.mdx "Backward Compatibility"): a DiscoverResult or a
    recognised modern error means modern; anything else - any other error, no answer, junk - means handshake.
    ``response`` is the JSON-RPC response dict, or None for a timeout."""
    if not isinstance(response, dict):
        return DiscoverVerdict("handshake", False, None, "no answer to server/discover")
    error = response.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        data = error.get("data") if isinstance(error, dict) else None
        supported = data.get("supported") if isinstance(data, dict) else None
        if code == UNSUPPORTED_PROTOCOL_VERSION and isinstance(supported, list):
            if any(v in MODERN_PROTOCOL_VERSIONS for v in supported):
                return DiscoverVerdict("modern", True, None, "server/discover asked for a version we speak")
            if not any(v in PROTOCOL_VERSIONS for v in supported):
                shown = ", ".join(str(v)[:20] for v in supported[:5])
                return DiscoverVerdict("incompatible", False, None,
                                       f"the server speaks only {shown}; Coffer speaks "
                                       f"{', '.join(MODERN_PROTOCOL_VERSIONS + PROTOCOL_VERSIONS)}")
        return DiscoverVerdict("handshake", False, None, f"server/discover answered error {code}")
    result = response.get("result")
    versions = result.get("supportedVersions") if isinstance(result, dict) else None
    if isinstance(versions, list) and any(v in MODERN_PROTOCOL_VERSIONS for v in versions) \
            and isinstance(result.get("capabilities"), dict):
        return DiscoverVerdict("modern", False, result, "server/discover answered")
    return DiscoverVerdict("handshake", False, None, "server/discover named no version Coffer speaks")


def _b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _b64u_decode(text: str) -> bytes:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64u(raw) != text:  # only the canonical encoding: one token, one spelling
        raise ValueError("non-canonical base64url")
    return raw


def modern_error(message: dict) -> dict:
    """An error reply as a 2026-07-28 client may receive it: the legacy-range codes Coffer and handshake upstreams
    use (-32001 timeout, -32003 unreachable, -32002 resource not found, -32042 URL elicitation) are replaced by the
    standard ones the 2026 spec allows, with what they meant in ``data``."""
    error = message.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    mapped = {-32001: (INTERNAL_ERROR, "upstream_timeout"), -32003: (INTERNAL_ERROR, "upstream_unavailable"),
              -32002: (INVALID_PARAMS, "resource_not_found"), -32042: (INTERNAL_ERROR, "url_elicitation_required")}
    if code not in mapped:
        return message
    new_code, meaning = mapped[code]
    data = error.get("data")
    # The upstream's own fields (a missing resource's uri) stay where a 2026-07-28 client looks for them.
    data = {**data, "coffer": meaning} if isinstance(data, dict) else \
        {"coffer": meaning, **({"detail": data} if data is not None else {})}
    return {**message, "error": {"code": new_code, "message": error.get("message", ""), "data": data}}


class RequestClaims(NamedTuple):
    """What Coffer seals into its own requestState, field by field.  Three kinds of round use it:

    - a 2026-07-28 upstream's own round: ``upstream`` (its name) and ``upstream_state`` (its requestState, handed
      back byte for byte; None when it sent none);
    - a parked exchange (a handshake-era upstream asked the client something mid-call): ``exchange``;
    - coffer__ask's rounds with the client's model: ``ask_stage`` (1 the rewrite, 2 the answer), ``queries`` and
      ``first_asked`` (epoch seconds of the first round, for the sampling budget).

    A handshake-era client's ask has its second step in process (``ask_stage`` 0, with ``deadline``, a monotonic
    time): that record is passed along, never sealed.  On the wire each field has a short key (``WIRE_KEYS``);
    ``to_wire``/``from_wire`` are the only places those keys are written or read, and the encoding is the one the
    gateway's dicts had, so a state sealed before this record existed unseals the same.
    """
    upstream: str | None = None
    upstream_state: str | None = None
    exchange: str | None = None
    ask_stage: int | None = None
    queries: tuple = ()
    first_asked: int | None = None
    deadline: float | None = None

    WIRE_KEYS = {"upstream": "s", "upstream_state": "u", "exchange": "x", "ask_stage": "ask", "queries": "q",
                 "first_asked": "t0", "deadline": "sync"}

    @property
    def is_upstream_round(self) -> bool:
        return self.upstream is not None

    @property
    def is_ask_round(self) -> bool:
        return self.ask_stage is not None

    def to_wire(self) -> dict:
        """The claims object as sealed: an upstream round carries "s" and "u" (null when the upstream sent no
        state), an ask round "ask", "q" and "t0", an exchange "x"; ``deadline`` never."""
        keys = self.WIRE_KEYS
        wire: dict = {}
        if self.upstream is not None:
            wire[keys["upstream"]] = self.upstream
            wire[keys["upstream_state"]] = self.upstream_state
        if self.exchange is not None:
            wire[keys["exchange"]] = self.exchange
        if self.ask_stage is not None:
            wire[keys["ask_stage"]] = self.ask_stage
            wire[keys["queries"]] = list(self.queries)
            wire[keys["first_asked"]] = self.first_asked
        return wire

    @classmethod
    def from_wire(cls, claims: dict) -> RequestClaims:
        """The record of an unsealed claims object (what unseal returns); a field of the wrong type reads as
        absent, as the gateway has always treated it."""
        keys = cls.WIRE_KEYS

        def field(name, kinds):
            value = claims.get(keys[name])
            return value if isinstance(value, kinds) and not isinstance(value, bool) else None

        queries = claims.get(keys["queries"])
        return cls(upstream=field("upstream", str), upstream_state=field("upstream_state", str),
                   exchange=field("exchange", str), ask_stage=field("ask_stage", int),
                   queries=tuple(queries) if isinstance(queries, list) else (),
                   first_asked=field("first_asked", (int, float)), deadline=field("deadline", (int, float)))


class RequestStateSealer:
    """Coffer's own requestState: a claims object, HMAC-SHA256 under a key that lives only in this process.

    The spec makes an echoed requestState attacker-controlled (basic/patterns/mrtr.mdx, server requirements 4-5):
    the seal gives integrity, ``exp`` a short life, and m/t/a bind it to the request it answers (method, the name
    or URI the client used, a digest of the arguments).  The key is the principal binding: each client session
    has a sealer (and key) of its own, so a state sealed for one client never unseals for another; a restart
    invalidates every state, as it must (the parked calls died with it).  Stateless and thread-safe: the client
    reader thread unseals, upstream reader threads seal.
    """

    PREFIX = "c1."
    _LABEL = b"coffer/request-state/v1\x00"

    def __init__(self, key: bytes | None = None, ttl: float = 300.0, clock=time.time):
        self._key = key if key is not None else os.urandom(32)
        self.ttl = float(ttl)
        self._clock = clock

    @staticmethod
    def binding(method: str, params) -> tuple[str, str]:
        """(target, arguments digest) of a request: the URI for resources/read, else the name."""
        params = params if isinstance(params, dict) else {}
        if method == "resources/read":
            target, arguments = params.get("uri"), {}
        else:
            target, arguments = params.get("name"), params.get("arguments") or {}
        canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return str(target)[:1024], _b64u(sha256(canonical.encode("ascii")).digest()[:16])

    def seal(self, method: str, params, claims: RequestClaims | dict) -> str:
        """A requestState for ``claims`` bound to this request (a plain dict is sealed as it is: the gateway's
        call sites until they build RequestClaims)."""
        if isinstance(claims, RequestClaims):
            claims = claims.to_wire()
        target, digest = self.binding(method, params)
        payload = {**claims, "v": 1, "m": method, "t": target, "a": digest, "exp": int(self._clock() + self.ttl)}
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        mac = hmac_sha256(self._key, self._LABEL + body)
        return f"{self.PREFIX}{_b64u(body)}.{_b64u(mac)}"

    def unseal(self, token, method: str, params) -> dict:
        """The claims of a state this process sealed for this very request, or -32602 (the SDK's words; the real
        reason goes to the log only)."""
        reason = None
        claims = None
        try:
            if not isinstance(token, str) or len(token) > MAX_REQUEST_STATE * 2 or not token.startswith(self.PREFIX):
                raise ValueError("malformed")
            body_text, _, mac_text = token[len(self.PREFIX):].partition(".")
            body, mac = _b64u_decode(body_text), _b64u_decode(mac_text)
            expected = hmac_sha256(self._key, self._LABEL + body)
            if not same_secret(mac, expected):
                raise ValueError("seal")
            claims = json.loads(body)
            if not isinstance(claims, dict) or claims.get("v") != 1:
                raise ValueError("malformed")
            exp = claims.get("exp")
            if not isinstance(exp, int) or isinstance(exp, bool) or not self._clock() < exp:
                raise ValueError("expired")
            if (claims.get("m"), claims.get("t"), claims.get("a")) != (method, *self.binding(method, params)):
                raise ValueError("bound to another request")
        except (ValueError, UnicodeDecodeError) as exc:  # json errors are ValueErrors too
            reason = str(exc) or "malformed"
        if reason is not None:
            modern_log.warning("requestState refused on %s: %s", method, reason)
            raise RpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})
        return claims

    def unseal_claims(self, token, method: str, params) -> RequestClaims:
        """``unseal``, read into a RequestClaims."""
        return RequestClaims.from_wire(self.unseal(token, method, params))
