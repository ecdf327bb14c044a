"""OAuth 2.1 for remote upstreams: discovery, registration, login, refresh, revocation."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from typing import NamedTuple

from coffer_src.digests import same_secret, sha256, token_urlsafe
from coffer_src.errors import CofferError, CofferException
from coffer_src.jsonrpc import LATEST_PROTOCOL_VERSION, decode_json, encode_line
from coffer_src.names import is_loopback_url, origin_text, same_origin, url_origin
from coffer_src.terminal import _UNPRINTABLE_RE, ServerLog, printable, redact
from coffer_src.transport.http import (
    _METADATA_BYTES,
    OAUTH_SECRET_PREFIX,
    HttpReply,
    _close_reply,
    _reply_text,
    initialize_or_stream,
    remote_http,
)
from coffer_src.transport.stdio import UpstreamFailure

oauth_log = logging.getLogger(__name__)


def _require_secure(url, what: str) -> str:
    """An OAuth endpoint must be https (OAuth 2.1 §1.5); plain http only on this machine, for development.  It is
    printed to the user, so it must hold no control characters or spaces."""
    if isinstance(url, str) and (_UNPRINTABLE_RE.search(url) or any(c.isspace() for c in url)):
        raise OAuthFailure(f"{what} holds control characters or spaces: refused")
    if url_origin(url) is None:
        raise OAuthFailure(f"{what} is not an http(s) URL: {printable(str(url))[:200]}")
    if urllib.parse.urlsplit(url).fragment:
        raise OAuthFailure(f"{what} has a #fragment, which OAuth forbids: {printable(url)[:200]}")
    if url_origin(url)[0] != "https" and not is_loopback_url(url):
        raise OAuthFailure(f"{what} is plain http on another machine ({origin_text(url)}); "
                           "refusing to send credentials there unencrypted")
    return url


def authorized_exchange(name: str, auth, method: str, url: str, *, headers: dict, body: bytes | None = None,
                        timeout: float, max_bytes: int = _METADATA_BYTES, stream: bool = False) -> HttpReply:
    """One exchange with a remote upstream, carrying its OAuth token when it has one: refreshed before expiry,
    and once more (then retried once) when the server answers 401.  Raises NeedsLogin when only a person can
    fix it.  Without ``auth`` (the server has a configured Authorization header) a 401 is returned as is."""
    for attempt in (1, 2):
        sent = dict(headers)
        if auth is not None:
            sent.update(auth.headers_for(url))
        reply = remote_http(method, url, headers=sent, body=body, timeout=timeout, max_bytes=max_bytes,
                            stream=stream)
        if auth is None or reply.status not in (401, 403):
            return reply
        challenges = parse_www_authenticate(reply.headers.get("www-authenticate"))
        bearer = challenges.get("bearer")
        if reply.status == 403:
            if bearer is not None and bearer.get("error") == "insufficient_scope":
                scope = printable(bearer.get("scope", ""))[:200]
                raise NeedsLogin(name, f"it asks for more permissions{f' (scope {scope})' if scope else ''}; "
                                       f"add --scope to `coffer auth {name}`")
            return reply
        if challenges and bearer is None:
            schemes = ", ".join(sorted(challenges))[:100]
            raise UpstreamFailure(f"HTTP 401: '{name}' asks for {schemes} credentials, not an OAuth login; "
                                  "give them with --header")
        if attempt == 2:
            raise NeedsLogin(name, "it refused a freshly refreshed token")
        auth.unauthorized(bearer or {}, sent.get("Authorization"))  # returns only when a new token is ready
    raise AssertionError("unreachable")


# -- OAuth: discovery ------------------------------------------------------------------------------------------
# MCP 2025-11-25 basic/authorization: 401 + WWW-Authenticate → protected resource metadata (RFC 9728) →
# authorization server metadata (RFC 8414 / OpenID discovery) → client identity → authorization code + PKCE.

class OAuthFailure(CofferError):
    """A login that cannot proceed; says why in terms the user can act on."""


class NeedsLogin(UpstreamFailure):
    """A remote server needs a person to log in.  Permanent until `coffer auth NAME` runs: never retried, and
    never answered by opening a browser from `coffer serve`."""

    permanent = True

    def __init__(self, server: str, why: str = ""):
        self.server = server
        super().__init__(f"'{server}' needs login: run `coffer auth {server}`" + (f" ({why})" if why else ""),
                         permanent=True)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_CHALLENGE_PART_RE = re.compile(rf'\s*,?\s*({_TOKEN})(?:\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*))?')


def parse_www_authenticate(value) -> dict[str, dict[str, str]]:
    """{scheme (lower case): {param (lower case): value}} from a WWW-Authenticate header (RFC 9110 §11.6.1).
    Unparseable parts are skipped; the header is cut at 8 KiB."""
    challenges: dict[str, dict[str, str]] = {}
    if not isinstance(value, str):
        return challenges
    text, position, current = value[:8192], 0, None
    while position < len(text):
        match = _CHALLENGE_PART_RE.match(text, position)
        if not match or match.end() == position:
            position += 1
            continue
        position = match.end()
        token, raw = match.group(1), match.group(2)
        if raw is None:
            current = challenges.setdefault(token.lower(), {})
        elif current is not None and token.lower() not in current:
            if raw.startswith('"'):
                raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
            current[token.lower()] = raw
    return challenges


def canonical_resource(url: str) -> str:
    """RFC 8707 form of a server URL: lower-case scheme and host, no fragment, no lone trailing slash."""
    parts = urllib.parse.urlsplit(url)
    path = "" if parts.path == "/" else parts.path
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, ""))


def resource_matches(server_url: str, resource) -> bool:
    """Whether protected resource metadata naming ``resource`` may speak for ``server_url`` (RFC 9728 §3.3):
    the same origin, and the resource's path is the server's path or a whole-segment prefix of it (a server at
    /mcp may be covered by a resource naming the origin)."""
    if not isinstance(resource, str) or not same_origin(server_url, resource):
        return False
    resource_parts = urllib.parse.urlsplit(resource)
    if resource_parts.fragment:
        return False
    server_path = urllib.parse.urlsplit(server_url).path.rstrip("/") + "/"
    return server_path.startswith(resource_parts.path.rstrip("/") + "/")


def _str_list(value, limit: int = 100) -> list[str] | None:
    if not isinstance(value, list):
        return None
    return [item for item in value[:limit] if isinstance(item, str) and 0 < len(item) <= 2048]


def _json_object(reply: HttpReply, what: str) -> dict:
    try:
        document = decode_json(reply.body)
    except ValueError as exc:
        raise OAuthFailure(f"{what} is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise OAuthFailure(f"{what} is not a JSON object")
    return document


class ResourceMetadata(NamedTuple):
    """RFC 9728 protected resource metadata, as far as Coffer uses it."""
    resource: str
    authorization_servers: list[str]
    scopes_supported: list[str] | None
    source: str


class AuthServerMetadata(NamedTuple):
    """RFC 8414 / OpenID Provider metadata, as far as Coffer uses it."""
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    registration_endpoint: str | None = None
    revocation_endpoint: str | None = None
    token_auth_methods: list[str] | None = None
    client_id_metadata_documents: bool = False
    iss_parameter: bool = False


def _first_metadata(urls: list[str], what: str) -> tuple[str, dict] | None:
    """The first of ``urls`` that serves a metadata document, as (its URL, the JSON object); None when none does.
    A URL that does not answer 200 is not there, so the next well-known URL is tried; one that does must hold a
    JSON object (``what`` names it in the error)."""
    for url in urls:
        reply = remote_http("GET", url, timeout=15.0, headers={"Accept": "application/json",
                                                               "MCP-Protocol-Version": LATEST_PROTOCOL_VERSION})
        if reply.status == 200:
            return url, _json_object(reply, f"{what} at {url}")
    return None


def discover_resource_metadata(server_url: str, bearer: dict) -> ResourceMetadata | None:
    """The server's protected resource metadata: the URL its 401 named, else the two well-known URLs (path
    first).  A document whose ``resource`` is not this server is refused outright, never skipped over."""
    origin = origin_text(server_url)
    path = urllib.parse.urlsplit(server_url).path.rstrip("/")
    candidates = [bearer["resource_metadata"]] if bearer.get("resource_metadata") else []
    if path:
        candidates.append(f"{origin}/.well-known/oauth-protected-resource{path}")
    candidates.append(f"{origin}/.well-known/oauth-protected-resource")
    for url in candidates:
        if url_origin(url) is None:
            raise OAuthFailure(f"the server's 401 names resource metadata at a non-http URL: {printable(url)[:200]}")
    found = _first_metadata(candidates, "the protected resource metadata")
    if found is None:
        return None
    url, document = found
    resource = document.get("resource")
    if not resource_matches(server_url, resource):
        raise OAuthFailure(f"the protected resource metadata at {url} is for "
                           f"{printable(str(resource))[:200]!r}, not for {server_url}: refused (RFC 9728 §3.3); "
                           "a token obtained through it could be meant for another server")
    servers = _str_list(document.get("authorization_servers")) or []
    if not servers:
        raise OAuthFailure(f"the protected resource metadata at {url} names no authorization server")
    return ResourceMetadata(resource, servers, _str_list(document.get("scopes_supported")), url)


def authorization_server_metadata_urls(issuer: str) -> list[str]:
    """Where an issuer's metadata may be, in the order MCP 2025-11-25 prescribes (RFC 8414 path insertion,
    then OpenID Connect discovery with path insertion, then with path appending)."""
    origin = origin_text(issuer)
    path = urllib.parse.urlsplit(issuer).path.rstrip("/")
    if path:
        return [f"{origin}/.well-known/oauth-authorization-server{path}",
                f"{origin}/.well-known/openid-configuration{path}",
                f"{origin}{path}/.well-known/openid-configuration"]
    return [f"{origin}/.well-known/oauth-authorization-server", f"{origin}/.well-known/openid-configuration"]


def _issuers_match(a: str, b: str) -> bool:
    """RFC 8414 §3.3 string comparison, a root issuer's trailing slash aside."""
    return a == b or (a.rstrip("/") == b.rstrip("/") and urllib.parse.urlsplit(a).path in ("", "/"))


def discover_authorization_server(issuer: str) -> AuthServerMetadata:
    _require_secure(issuer, "the authorization server")
    urls = authorization_server_metadata_urls(issuer)
    found = _first_metadata(urls, "the authorization server metadata")
    if found is None:
        raise OAuthFailure(f"no authorization server metadata at {' or '.join(urls)}")
    url, document = found
    if not isinstance(document.get("issuer"), str) or not _issuers_match(document["issuer"], issuer):
        raise OAuthFailure(f"the metadata at {url} is for issuer {printable(str(document.get('issuer')))[:200]!r}"
                           f", not {issuer}: refused (RFC 8414 §3.3)")
    methods = _str_list(document.get("code_challenge_methods_supported")) or []
    if "S256" not in methods:
        raise OAuthFailure(f"the authorization server {issuer} does not offer PKCE with S256: refused "
                           "(MCP requires it to protect the authorization code)")
    endpoints = {}
    for key in ("authorization_endpoint", "token_endpoint", "registration_endpoint", "revocation_endpoint"):
        value = document.get(key)
        if value is not None:
            endpoints[key] = _require_secure(value, f"the {key.replace('_', ' ')}")
    if "authorization_endpoint" not in endpoints or "token_endpoint" not in endpoints:
        raise OAuthFailure(f"the metadata at {url} lacks an authorization or token endpoint")
    return AuthServerMetadata(
        issuer=issuer, token_auth_methods=_str_list(document.get("token_endpoint_auth_methods_supported")),
        client_id_metadata_documents=document.get("client_id_metadata_document_supported") is True,
        iss_parameter=document.get("authorization_response_iss_parameter_supported") is True, **endpoints)


# -- OAuth: the saved login ------------------------------------------------------------------------------------

class OAuthGrant(NamedTuple):
    """A server's saved login: tokens and what is needed to refresh them.  Lives in the SecretStore under
    oauth.<server> as one JSON text, never in coffer.db, logs or output."""
    server_url: str
    resource: str
    issuer: str
    token_endpoint: str
    client_id: str
    client_auth: str                        # none, client_secret_basic or client_secret_post
    client_source: str                      # pre-registered, metadata-document or registered
    access_token: str
    token_type: str = "Bearer"
    refresh_token: str | None = None
    client_secret: str | None = None        # only for a client Coffer registered itself
    client_secret_env: str | None = None    # a pre-registered client's secret: the variable holding it
    redirect_uri: str | None = None
    revocation_endpoint: str | None = None
    scope: str | None = None
    expires_at: float | None = None
    lifetime: float | None = None
    obtained_at: float = 0.0

    def secret_values(self) -> list[str]:
        return [v for v in (self.access_token, self.refresh_token, self.client_secret) if v]

    def refresh_due(self, now: float) -> bool:
        """Refresh a little before expiry: a tenth of the lifetime, between 1 s and 60 s."""
        if self.expires_at is None:
            return False
        return now >= self.expires_at - min(60.0, max(1.0, 0.1 * (self.lifetime or 0.0)))

    def to_text(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> OAuthGrant:
        data = decode_json(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        known = set(cls._fields)
        values = {key: value for key, value in data.items() if key in known}
        for key, value in values.items():
            if key in ("expires_at", "lifetime", "obtained_at"):
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"{key} is not a number")
            elif value is not None and (not isinstance(value, str) or len(value) > 65536):
                raise ValueError(f"{key} is not text")
        grant = cls(**values)
        for key in ("server_url", "resource", "token_endpoint", "client_id", "access_token"):
            if not getattr(grant, key):
                raise ValueError(f"{key} is missing")
        return grant


def oauth_secret_name(server: str) -> str:
    return OAUTH_SECRET_PREFIX + server


class TokenEndpointError(CofferException):
    """The token endpoint said no; ``error`` is its OAuth error code (invalid_grant, ...) when it gave one."""

    def __init__(self, error: str, text: str):
        super().__init__(text)
        self.error = error


def _client_authenticated(form: dict, client_id: str, client_auth: str, client_secret: str | None
                          ) -> tuple[dict, bytes]:
    """(headers, body) of a form POST to a token or revocation endpoint, with the client's own authentication
    (RFC 6749 §2.3): Basic, or the secret in the body, or none for a public client."""
    form = dict(form, client_id=client_id)  # in the body even with Basic: many servers (the MCP SDK's) want it
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if client_auth == "client_secret_basic" and client_secret:
        pair = f"{urllib.parse.quote(client_id, safe='')}:{urllib.parse.quote(client_secret, safe='')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    elif client_auth == "client_secret_post" and client_secret:
        form["client_secret"] = client_secret
    return headers, urllib.parse.urlencode({k: v for k, v in form.items() if v is not None}).encode("ascii")


def token_request(token_endpoint: str, form: dict, client_id: str, client_auth: str,
                  client_secret: str | None) -> dict:
    """POST to the token endpoint (RFC 6749 §3.2) with the client's own authentication; returns the validated
    token response.  Only ever carries a code or a refresh token: never a bearer token."""
    _require_secure(token_endpoint, "the token endpoint")
    headers, body = _client_authenticated(form, client_id, client_auth, client_secret)
    headers["Accept"] = "application/json"
    try:
        reply = remote_http("POST", token_endpoint, headers=headers, body=body, timeout=30.0)
    except UpstreamFailure as exc:
        raise TokenEndpointError("", str(exc)) from None
    try:
        document = decode_json(reply.body)
    except ValueError:
        document = None
    if reply.status != 200:
        error = document.get("error") if isinstance(document, dict) else None
        error = error if isinstance(error, str) and len(error) < 100 else ""
        detail = document.get("error_description") if isinstance(document, dict) else None
        detail = printable(redact(detail))[:200] if isinstance(detail, str) else _reply_text(reply)
        raise TokenEndpointError(error, f"the token endpoint answered HTTP {reply.status}"
                                        f"{f' {error}' if error else ''}{f': {detail}' if detail else ''}")
    if not isinstance(document, dict):
        raise TokenEndpointError("", "the token endpoint answered with something other than a JSON object")
    access = document.get("access_token")
    if not isinstance(access, str) or not 0 < len(access) <= 16384 or any(c in access for c in "\r\n"):
        raise TokenEndpointError("", "the token endpoint sent no usable access_token")
    token_type = document.get("token_type")
    if not isinstance(token_type, str) or token_type.lower() != "bearer":
        raise TokenEndpointError("", f"the token endpoint sent a {printable(str(token_type))[:40]!r} token; "
                                     "Coffer sends Bearer tokens only")
    refresh = document.get("refresh_token")
    expires_in = document.get("expires_in")
    scope = document.get("scope")
    redact.add(access, refresh if isinstance(refresh, str) else None)
    return {"access_token": access,
            "refresh_token": refresh if isinstance(refresh, str) and 0 < len(refresh) <= 16384 else None,
            "expires_in": float(expires_in) if isinstance(expires_in, (int, float)) and not isinstance(
                expires_in, bool) and 0 < expires_in < 10 * 365 * 86400 else None,
            "scope": scope if isinstance(scope, str) and len(scope) <= 4096 else None}


def _apply_tokens(grant: OAuthGrant, tokens: dict, now: float) -> OAuthGrant:
    """The grant after a token response: a refresh response may omit the refresh token (not rotated) and the
    scope (unchanged), RFC 6749 §6."""
    lifetime = tokens["expires_in"]
    return grant._replace(access_token=tokens["access_token"], refresh_token=tokens["refresh_token"] or
                          grant.refresh_token, scope=tokens["scope"] or grant.scope, lifetime=lifetime,
                          expires_at=now + lifetime if lifetime else None, obtained_at=now)


class OAuthCredentials:
    """The bearer token of one remote upstream: read from the secret store, refreshed shortly before it expires
    and when the server answers 401, forgotten when the authorization server says invalid_grant.  Never opens a
    browser: whatever needs a person raises NeedsLogin.  The token goes only to the server's own origin.

    Threads: any HTTP worker thread of the upstream.  One lock (``_lock``) serialises reading the saved login and
    refreshing it, so requests that find the token due together cause one refresh; it is held across the token
    request on purpose (the others wait for its result instead of spending a single-use refresh token again).
    Inside it only the SecretStore's and the Redactor's own locks are taken; ``_warned`` is written under it.
    Other processes (a second `coffer serve`, `coffer auth`) share the store: before refreshing, and before giving
    up on invalid_grant, the store is read again in case one of them already refreshed (refresh tokens may be
    single-use).
    """

    def __init__(self, server: str, url: str, store):
        self.server, self.url, self.store = server, url, store
        self.log = ServerLog(oauth_log, server)
        self._lock = threading.Lock()
        self._warned: str | None = None

    def _load(self) -> OAuthGrant | None:
        text = self.store.get(oauth_secret_name(self.server))
        if text is None:
            return None
        try:
            grant = OAuthGrant.from_text(text)
        except (ValueError, TypeError) as exc:
            self._warn_once(f"the saved login is damaged ({exc}); run `coffer auth {self.server}`")
            return None
        redact.add(*grant.secret_values())
        if not (same_origin(grant.server_url, self.url) and resource_matches(self.url, grant.resource)):
            self._warn_once(f"the saved login is for {origin_text(grant.server_url)}, not this server's URL; "
                            "it is not sent")
            return None
        return grant

    def _warn_once(self, text: str) -> None:
        if self._warned != text:
            self._warned = text
            self.log.warning("%s", text)

    def headers_for(self, url: str) -> dict:
        """The Authorization header for a request to ``url``: none for another origin, none before a login."""
        if not same_origin(url, self.url):
            return {}
        with self._lock:
            grant = self._load()
            if grant is None:
                return {}
            if grant.refresh_due(time.time()):
                try:
                    grant = self._refresh(grant)
                except UpstreamFailure as exc:
                    if isinstance(exc, NeedsLogin) or time.time() >= (grant.expires_at or 0):
                        raise
                    self.log.warning("could not refresh the login yet: %s", exc)
        return {"Authorization": f"Bearer {grant.access_token}"}

    def unauthorized(self, bearer: dict, sent_authorization: str | None) -> None:
        """The server answered 401 to ``sent_authorization``: returns when a newer token is ready to retry with,
        raises NeedsLogin (no login, or the authorization server refused it) or UpstreamFailure (unreachable)."""
        with self._lock:
            grant = self._load()
            if grant is None:
                raise NeedsLogin(self.server)
            if sent_authorization != f"Bearer {grant.access_token}":
                return  # another thread or process has refreshed meanwhile
            self._refresh(grant)

    def _refresh(self, grant: OAuthGrant) -> OAuthGrant:
        latest = self._load()
        if latest is not None and latest.access_token != grant.access_token and not latest.refresh_due(time.time()):
            return latest
        if not grant.refresh_token:
            raise NeedsLogin(self.server, "its login expired and the authorization server gave no refresh token")
        secret = grant_client_secret(grant, self.store)
        try:
            tokens = token_request(grant.token_endpoint, {"grant_type": "refresh_token",
                                                          "refresh_token": grant.refresh_token,
                                                          "resource": grant.resource},
                                   grant.client_id, grant.client_auth, secret)
        except TokenEndpointError as exc:
            if exc.error in ("invalid_grant", "invalid_client", "unauthorized_client"):
                latest = self._load()
                if latest is not None and latest.refresh_token != grant.refresh_token:
                    return latest  # rotated by another process between our read and our request
                self.store.delete(oauth_secret_name(self.server))
                self.log.warning("the authorization server refused the saved login (%s); it was forgotten", exc.error)
                raise NeedsLogin(self.server, f"the authorization server refused its saved login ({exc.error})") \
                    from None
            raise UpstreamFailure(f"could not refresh the login of '{self.server}': {exc}") from None
        grant = _apply_tokens(grant, tokens, time.time())
        self.store.set(oauth_secret_name(self.server), grant.to_text())
        self.log.info("refreshed its OAuth token")
        return grant


def resolve_client_secret(variable: str | None, store) -> str | None:
    """A pre-registered client's secret, from the variable the user named (environment first, then the secret
    store, like ${NAME}).  Coffer stores the variable's name, never the value."""
    if not variable:
        return None
    value = os.environ.get(variable)
    if value is None and store is not None:
        value = store.get(variable)
    if value:
        redact.add(value)
    return value or None


def grant_client_secret(grant: OAuthGrant, store) -> str | None:
    if grant.client_source == "registered":
        return grant.client_secret
    return resolve_client_secret(grant.client_secret_env, store)


# -- OAuth: the login (only ever from `coffer auth`) ---------------------------------------------------------

class ClientIdentity(NamedTuple):
    client_id: str
    client_secret: str | None
    client_auth: str
    source: str             # pre-registered, metadata-document or registered


def _client_auth_method(methods: list[str] | None, has_secret: bool) -> str:
    if not has_secret:
        return "none"
    if methods is None or "client_secret_basic" in methods:  # RFC 8414: the default when unlisted
        return "client_secret_basic"
    if "client_secret_post" in methods:
        return "client_secret_post"
    raise OAuthFailure("the authorization server accepts neither client_secret_basic nor client_secret_post "
                       f"(it lists {', '.join(methods)[:200]})")


def choose_client(server: str, metadata: AuthServerMetadata, oauth: dict, store, settings: dict,
                  redirect_uri: str, scope: str | None, previous: OAuthGrant | None) -> ClientIdentity:
    """Who Coffer is to this authorization server, in the order MCP 2025-11-25 gives: the client the user
    pre-registered (--oauth-client-id), a Client ID Metadata Document when the server supports them, Dynamic
    Client Registration (RFC 7591), else an error saying how to pre-register."""
    if oauth.get("client_id"):
        variable = oauth.get("client_secret_env")
        secret = resolve_client_secret(variable, store)
        if variable and not secret:
            raise OAuthFailure(f"{variable} (named by --oauth-client-secret-env) is not set in the environment "
                               "or the secret store")
        return ClientIdentity(oauth["client_id"], secret, _client_auth_method(metadata.token_auth_methods,
                                                                              bool(secret)), "pre-registered")
    document_url = settings.get("oauth_client_metadata_url") or ""
    if metadata.client_id_metadata_documents and document_url:
        parts = urllib.parse.urlsplit(document_url)
        if parts.path in ("", "/") or (parts.scheme != "https" and not is_loopback_url(document_url)):
            raise OAuthFailure("the oauth_client_metadata_url setting must be an https URL with a path")
        return ClientIdentity(document_url, None, "none", "metadata-document")
    if metadata.registration_endpoint:
        if (previous is not None and previous.client_source == "registered" and previous.issuer == metadata.issuer
                and previous.redirect_uri == redirect_uri):
            return ClientIdentity(previous.client_id, previous.client_secret, previous.client_auth, "registered")
        return register_client(metadata, redirect_uri, scope)
    raise OAuthFailure(f"the authorization server {metadata.issuer} lets no client register itself: register "
                       f"an OAuth app with the provider (redirect URI http://127.0.0.1/callback), then run "
                       f"`coffer auth {server} --oauth-client-id ID [--oauth-client-secret-env VAR]`")


def register_client(metadata: AuthServerMetadata, redirect_uri: str, scope: str | None) -> ClientIdentity:
    """Dynamic Client Registration (RFC 7591) as a public client: Coffer keeps no secret it does not need."""
    request = {"client_name": "Coffer", "redirect_uris": [redirect_uri],
               "grant_types": ["authorization_code", "refresh_token"],
               "response_types": ["code"], "token_endpoint_auth_method": "none"}
    if scope:
        request["scope"] = scope
    reply = remote_http("POST", metadata.registration_endpoint, body=encode_line(request), timeout=30.0,
                        headers={"Content-Type": "application/json", "Accept": "application/json"})
    if reply.status not in (200, 201):
        raise OAuthFailure(f"client registration at {metadata.registration_endpoint} failed: HTTP {reply.status}"
                           f" {_reply_text(reply)}")
    document = _json_object(reply, "the client registration reply")
    client_id, secret = document.get("client_id"), document.get("client_secret")
    if not isinstance(client_id, str) or not 0 < len(client_id) <= 2048:
        raise OAuthFailure("the client registration reply holds no client_id")
    secret = secret if isinstance(secret, str) and 0 < len(secret) <= 4096 else None
    method = document.get("token_endpoint_auth_method") or ("client_secret_basic" if secret else "none")
    if method not in ("none", "client_secret_basic", "client_secret_post") or (method != "none" and not secret):
        raise OAuthFailure(f"the authorization server registered Coffer for {printable(str(method))[:60]!r} "
                           "client authentication, which Coffer cannot do")
    redact.add(secret)
    return ClientIdentity(client_id, secret, method, "registered")


class LoopbackReceiver:
    """Receives the authorization response on http://127.0.0.1:<port>/callback (RFC 8252 §7.3), once.

    Threads: the listener thread coffer-oauth-callback serves requests; coffer-oauth-paste may deliver a pasted
    address; ``wait`` runs on the CLI's thread.  ``_lock`` (a leaf) makes the first answer the one kept.  A
    request that is not the callback gets a 404; the page the browser shows repeats nothing from the request.
    """

    def __init__(self, port: int = 0):
        import http.server

        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server interface
                path, _, query = self.path.partition("?")
                if path != "/callback" or len(query) > 16384:
                    self.send_error(404)
                    return
                params = {k: v[0] for k, v in urllib.parse.parse_qs(query, max_num_fields=20).items()}
                if not ({"code", "error", "state"} & params.keys()):
                    self.send_error(400)
                    return
                receiver.deliver(params)
                page = (b"<!doctype html><title>Coffer</title><p>Coffer received the answer of the authorization "
                        b"server. You can close this tab and return to the terminal.</p>")
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):  # the request line holds the code: it must not reach stderr
                pass

        self._server = http.server.HTTPServer(("127.0.0.1", port), Handler)
        self.redirect_uri = f"http://127.0.0.1:{self._server.server_address[1]}/callback"
        self._result: dict | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="coffer-oauth-callback", daemon=True).start()

    def deliver(self, params: dict) -> None:
        with self._lock:
            if self._result is None:
                self._result = params
                self._done.set()

    def wait(self, timeout: float) -> dict | None:
        self._done.wait(timeout)
        return self._result

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _open_receiver(previous: OAuthGrant | None) -> LoopbackReceiver:
    """Listen on the port a registered client's redirect URI names when it is free, so the registration can be
    reused; else on any free port."""
    if previous is not None and previous.client_source == "registered" and previous.redirect_uri:
        try:
            return LoopbackReceiver(urllib.parse.urlsplit(previous.redirect_uri).port or 0)
        except (OSError, ValueError):
            pass
    return LoopbackReceiver(0)


def _pkce_pair() -> tuple[str, str]:
    verifier = token_urlsafe(64)  # 86 characters of the unreserved set (RFC 7636 §4.1)
    challenge = base64.urlsafe_b64encode(sha256(verifier.encode("ascii")).digest()).rstrip(b"=")
    return verifier, challenge.decode("ascii")


def _read_pasted_callback(receiver: LoopbackReceiver, stdin) -> None:
    """For a browser on another machine: the address it ended on, pasted into the terminal, is the callback."""
    try:
        for line in stdin:
            line = line.strip()
            parts = urllib.parse.urlsplit(line)
            if parts.path.endswith("/callback") and parts.query:
                receiver.deliver({k: v[0] for k, v in urllib.parse.parse_qs(parts.query, max_num_fields=20).items()})
                return
    except (OSError, ValueError):
        pass


def login_challenge(name: str, url: str, headers: dict) -> dict[str, dict[str, str]]:
    """Ask the server, without a token, what it wants: its WWW-Authenticate challenges.  POST initialize first
    (Streamable HTTP); on 400/404/405 a GET (HTTP+SSE).  Raises OAuthFailure when it wants no login."""
    posted, stream = initialize_or_stream(remote_http, url, headers, 15.0)
    reply = stream or posted
    _close_reply(reply)
    if reply.status in (401, 403):
        return parse_www_authenticate(reply.headers.get("www-authenticate"))
    if reply.ok:
        raise OAuthFailure(f"'{name}' answered without asking for a login: nothing to do")
    raise OAuthFailure(f"'{name}' answered HTTP {reply.status} instead of asking for a login: {_reply_text(reply)}")


def oauth_login(name: str, url: str, headers: dict, oauth: dict, store, settings: dict, *, out,
                open_browser=None, stdin=None, timeout: float = 300.0, scope: str | None = None) -> OAuthGrant:
    """The whole interactive login of one server; saves the grant under oauth.<name> and returns it.

    ``out`` gets what the user must read (the URL to open, never a token); ``open_browser(url)`` defaults to
    webbrowser.open; ``stdin``, when given, is read for a pasted callback address (headless use).
    """
    challenges = login_challenge(name, url, headers)
    if challenges and "bearer" not in challenges:
        raise OAuthFailure(f"'{name}' asks for {', '.join(sorted(challenges))[:100]} credentials, not an OAuth "
                           "login; give them with --header")
    bearer = challenges.get("bearer", {})
    resource_metadata = discover_resource_metadata(url, bearer)
    if resource_metadata is not None:
        issuer = resource_metadata.authorization_servers[0]  # RFC 9728 §7.6 leaves the choice to the client
        resource = canonical_resource(resource_metadata.resource)
    else:  # MCP 2025-03-26 servers: the authorization server is the MCP server's origin
        issuer, resource = origin_text(url), canonical_resource(url)
    metadata = discover_authorization_server(issuer)
    if scope is None:
        scope = bearer.get("scope") or (" ".join(resource_metadata.scopes_supported)
                                         if resource_metadata and resource_metadata.scopes_supported else None)
    key = oauth_secret_name(name)
    try:
        text = store.get(key)
        previous = OAuthGrant.from_text(text) if text else None
    except (ValueError, TypeError):
        previous = None
    receiver = _open_receiver(previous)
    try:
        client = choose_client(name, metadata, oauth, store, settings, receiver.redirect_uri, scope, previous)
        verifier, challenge = _pkce_pair()
        state = token_urlsafe(32)
        params = {"response_type": "code", "client_id": client.client_id, "redirect_uri": receiver.redirect_uri,
                  "code_challenge": challenge, "code_challenge_method": "S256", "state": state,
                  "resource": resource}
        if scope:
            params["scope"] = scope
        separator = "&" if urllib.parse.urlsplit(metadata.authorization_endpoint).query else "?"
        address = metadata.authorization_endpoint + separator + urllib.parse.urlencode(params)
        out.write(printable(f"Log in to {name} in your browser. If it does not open, visit:\n\n  {address}\n\n"
                  f"(waiting up to {timeout:g} s for the authorization server at {origin_text(address)}"))
        if stdin is not None:
            out.write("; if your browser runs on another machine, paste here the address it ends on")
            threading.Thread(target=_read_pasted_callback, args=(receiver, stdin), name="coffer-oauth-paste",
                             daemon=True).start()
        out.write(")\n")
        out.flush()
        if open_browser is None:
            import webbrowser
            open_browser = webbrowser.open
        try:
            open_browser(address)
        except Exception as exc:  # noqa: BLE001 - no browser here is fine: the address is printed
            oauth_log.debug("could not open a browser: %r", exc)
        answer = receiver.wait(timeout)
    finally:
        receiver.close()
    if answer is None:
        raise OAuthFailure(f"no answer from the browser within {timeout:g} s")
    if not same_secret(str(answer.get("state", "")).encode("utf-8", "replace"), state.encode("ascii")):
        raise OAuthFailure("the browser came back with a different state than this login sent: refused (it was "
                           "not the answer to this login; possibly a cross-site request forgery)")
    if answer.get("error"):
        detail = printable(str(answer.get("error_description", "")))[:200]
        raise OAuthFailure(f"the authorization server refused: {printable(answer['error'])[:60]}"
                           + (f": {detail}" if detail else ""))
    if "iss" in answer or metadata.iss_parameter:  # RFC 9207: the answer must come from the server we asked
        if not _issuers_match(str(answer.get("iss", "")), metadata.issuer):
            raise OAuthFailure("the authorization answer names another issuer than the server asked: refused")
    code = answer.get("code")
    if not isinstance(code, str) or not 0 < len(code) <= 4096:
        raise OAuthFailure("the authorization server sent no code")
    try:
        tokens = token_request(metadata.token_endpoint, {
            "grant_type": "authorization_code", "code": code, "redirect_uri": receiver.redirect_uri,
            "code_verifier": verifier, "resource": resource}, client.client_id, client.client_auth,
            client.client_secret)
    except TokenEndpointError as exc:
        raise OAuthFailure(f"could not get a token: {exc}") from None
    grant = _apply_tokens(OAuthGrant(
        server_url=url, resource=resource, issuer=metadata.issuer, token_endpoint=metadata.token_endpoint,
        client_id=client.client_id, client_auth=client.client_auth, client_source=client.source,
        access_token="", client_secret=client.client_secret if client.source == "registered" else None,
        client_secret_env=oauth.get("client_secret_env") if client.source == "pre-registered" else None,
        redirect_uri=receiver.redirect_uri, revocation_endpoint=metadata.revocation_endpoint, scope=scope),
        tokens, time.time())
    store.set(key, grant.to_text())
    return grant


def revoke_grant(grant: OAuthGrant, store) -> str:
    """Best effort RFC 7009 revocation of a saved login (the refresh token revokes the access token with it on
    most servers).  Returns what to tell the user."""
    if not grant.revocation_endpoint:
        return "the authorization server offers no revocation; the tokens expire on their own"
    secret = grant_client_secret(grant, store)
    token, hint = (grant.refresh_token, "refresh_token") if grant.refresh_token else (grant.access_token,
                                                                                      "access_token")
    try:
        token_request_revoke(grant.revocation_endpoint, token, hint, grant.client_id, grant.client_auth, secret)
    except (OAuthFailure, UpstreamFailure) as exc:
        return f"the authorization server could not be told ({exc})"
    return "revoked at the authorization server"


def token_request_revoke(endpoint, token, hint, client_id, client_auth, client_secret) -> None:
    _require_secure(endpoint, "the revocation endpoint")
    headers, body = _client_authenticated({"token": token, "token_type_hint": hint}, client_id, client_auth,
                                          client_secret)
    reply = remote_http("POST", endpoint, headers=headers, timeout=10.0, body=body)
    if reply.status != 200:
        raise OAuthFailure(f"HTTP {reply.status}")
