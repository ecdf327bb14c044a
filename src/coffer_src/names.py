"""Names and addresses: server names, exposed names, qualified URIs, remote URLs."""

from __future__ import annotations

import difflib
import re
import urllib.parse

from coffer_src.digests import sha256
from coffer_src.errors import CofferError
from coffer_src.terminal import clip, printable

SEPARATOR = "__"
RESERVED_SERVER = "coffer"
SEARCH_TOOL = "coffer__search_tools"
ASK_TOOL = "coffer__ask"
REMEMBER_TOOL = "coffer__remember"
#: The knowledge source coffer__ask calls the facts coffer__remember kept (a folder may not take the name).
MEMORY_SOURCE = "memory"
# A server name is the prefix of every name a client sees (<server>__<tool>), so it is short and holds no '_':
# then no two servers' prefixes can collide.  These three say it once for every check, message and help text.
SERVER_NAME_MAX = 24
SERVER_NAME_RULE = f"1-{SERVER_NAME_MAX} letters, digits or '-'"
_SERVER_NAME_PATTERN = f"[a-zA-Z0-9-]{{1,{SERVER_NAME_MAX}}}"
SERVER_NAME_RE = re.compile(f"^{_SERVER_NAME_PATTERN}$")
EXPOSED_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: An environment variable's (and a ${NAME} reference's) name; secret_store builds the reference syntax from it.
ENV_NAME_PATTERN = "[A-Za-z_][A-Za-z0-9_]*"
ENV_KEY_RE = re.compile(f"^{ENV_NAME_PATTERN}$")
QUALIFIED_URI_RE = re.compile(rf"^coffer\+({_SERVER_NAME_PATTERN}):(.+)$", re.S)


def did_you_mean(target: str, names) -> str:
    """"; did you mean a or b?" naming the known names closest to a mistyped one, or "" when none is close."""
    close = difflib.get_close_matches(target, list(names), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_server_name(name: str) -> str:
    if not isinstance(name, str) or not SERVER_NAME_RE.match(name):
        raise CofferError(f"invalid server name {name!r}: use {SERVER_NAME_RULE}")
    if name.lower() == RESERVED_SERVER:
        raise CofferError(f"server name {name!r} is reserved for Coffer's own tools")
    return name


#: The default longest exposed name: room for a client prefix such as mcp__<key>__ within 64.
NAME_MAX_LENGTH = 48
_DIGEST_WIDTHS = (6, 8, 10, 12, 16, 24, 32, 64)
#: The shortest name_max_length: a longest server name, "__", one character, "_" and the shortest hash.
NAME_MAX_LENGTH_MIN = SERVER_NAME_MAX + len(SEPARATOR) + 2 + _DIGEST_WIDTHS[0]


def _natural_name(server: str, name: str, max_length: int) -> str | None:
    full = f"{server}{SEPARATOR}{name}"
    return full if len(full) <= max_length and EXPOSED_NAME_RE.match(full) else None


def _shortened_name(server: str, name: str, max_length: int, width: int, digest: str | None = None) -> str:
    digest = digest or sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    room = max(1, max_length - len(server) - len(SEPARATOR) - width - 1)
    return f"{server}{SEPARATOR}{safe[:room].rstrip('_') or 'x'}_{digest[:width]}"


def expose_name(server: str, name: str, max_length: int = NAME_MAX_LENGTH) -> str:
    """``<server>__<name>``, or — when that is too long or not a legal MCP tool name — a readable prefix plus six hex
    digits of the name's hash, stable across restarts and machines.  This is the name a tool gets when nothing
    collides with it; ``exposed_names`` decides for a whole list."""
    return _natural_name(server, name, max_length) or _shortened_name(server, name, max_length, 6)


def exposed_names(server: str, names, max_length: int, seniority: dict | None = None) -> dict[str, str]:
    """{upstream name: exposed name} for one server's tools (or prompts): distinct by construction, whatever the
    names, and stable: a name a client has been shown is never taken over by a tool that came later.

    Server names hold no '_', so ``<server>__`` prefixes never collide and only one server's own names can.  Names
    are placed oldest first (``seniority``: name -> rank, lower = seen earlier, as the vault's rows are ordered;
    names it does not hold come last, in the order given): each takes its own name when that fits and is free, else the
    shortest free form of a readable prefix plus 6, 8, 10... hex digits of its hash.  So when a newcomer's
    shortened name collides with an established one (a 24-bit collision is easy to make), or an upstream adds a
    tool literally named like another's shortened form, the newcomer is the one that gets a longer name.  No tool
    is ever hidden by another.
    """
    seniority = seniority or {}
    last = len(seniority)
    result: dict[str, str] = {}
    taken: set[str] = set()
    for name in sorted(names, key=lambda n: seniority.get(n, last)):  # stable: the rest keep the order given
        exposed = _natural_name(server, name, max_length)
        if exposed is None or exposed in taken:
            digest = sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
            exposed = next((form for form in (_shortened_name(server, name, max_length, width, digest)
                                              for width in _DIGEST_WIDTHS) if form not in taken), None)
            count = 2
            while exposed is None or exposed in taken:  # every hash width taken: only a name made to collide
                exposed = f"{_shortened_name(server, name, max_length, _DIGEST_WIDTHS[0], digest)}_{count}"
                count += 1
        result[name] = exposed
        taken.add(exposed)
    return result


def qualify_uri(server: str, uri: str) -> str:
    """The exposed form of a resource URI that two upstreams both publish."""
    return f"coffer+{server}:{uri}"


# -- remote servers: one door for every HTTP exchange, so credentials never leave their origin -----------------
# A remote server speaks Streamable HTTP (HttpTransport) or the 2024-11-05 HTTP+SSE transport (SseTransport);
# "auto" asks it which, following the spec's backwards-compatibility procedure, and the answer is remembered in
# the vault.  Any of them may be protected by OAuth: OAuthCredentials supplies and refreshes the bearer token, and
# `coffer auth NAME` (oauth_login) is the only place a browser opens.  The credential rule for all of it:
# configured headers and the bearer token go only to the configured URL's origin (scheme, host, port); a redirect,
# an SSE endpoint or a saved login that would take them elsewhere is refused.  The authorization server only ever
# gets what OAuth sends it (a code, a refresh token, Coffer's own client credentials), never a bearer token.

REMOTE_TRANSPORTS = ("auto", "http", "sse")


def is_success(status: int) -> bool:
    """Whether an HTTP status is a 2xx: the one test of an exchange that worked (here rather than in
    transport/http, so every layer that reads an HttpReply, OAuth included, can use it)."""
    return 200 <= status < 300


def url_origin(url) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, default port filled in; None for anything else."""
    if not isinstance(url, str) or len(url) > 8192:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


def same_origin(a, b) -> bool:
    origin = url_origin(a)
    return origin is not None and origin == url_origin(b)


def origin_text(url) -> str:
    origin = url_origin(url)
    if origin is None:
        return "an invalid URL"
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if port == (443 if scheme == "https" else 80) else f":{port}")


def is_loopback_url(url) -> bool:
    import ipaddress
    origin = url_origin(url)
    if origin is None:
        return False
    if origin[1] == "localhost":
        return True
    try:
        return ipaddress.ip_address(origin[1]).is_loopback
    except ValueError:
        return False


def check_remote_url(url: str) -> str:
    """A URL Coffer may connect to (http or https with a host), or CofferError saying what is wrong.  A URL that
    holds a ${VAR} reference is checked when it is expanded, at start."""
    if "${" in url:
        return url
    if url_origin(url) is None or any(c.isspace() for c in url):
        raise CofferError(f"invalid URL {clip(printable(url), 200)!r}: use http:// or https:// and a host name")
    return url
