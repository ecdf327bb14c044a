"""Settings: what `coffer config` knows, with their defaults, checks and hidden keys."""

from __future__ import annotations

import math
import re

from coffer_src.errors import CofferError
from coffer_src.names import NAME_MAX_LENGTH, NAME_MAX_LENGTH_MIN, did_you_mean

DEFAULTS = {
    "oauth_client_metadata_url": "",  # https URL of Coffer's OAuth Client ID Metadata Document, where hosted
    "name_max_length": NAME_MAX_LENGTH,
    "discovery_timeout": 5.0,       # seconds a list request waits for a starting upstream
    "call_timeout": 120.0,          # seconds a request may go without a reply or progress
    "init_timeout": 60.0,           # seconds an upstream may take to answer initialize
    "max_restarts": 5,              # consecutive failed starts before an upstream is marked failed
    "retention_invocations_days": 30,
    "retention_audit_days": 365,
    "expose": "auto",               # auto | all | search | budget:N (see expose_mode); expose.<client> overrides
    "embedder_url": "",             # e.g. http://127.0.0.1:11434/v1 (OpenAI-compatible) or an Ollama base URL
    "embedder_model": "",
    "embedder_api": "openai",       # "openai" (POST {url}/embeddings) or "ollama" (POST {url}/api/embed)
    "embedder_key_env": "",         # name of the environment variable holding the API key (never the key)
    "embedder_timeout": 1.0,        # seconds a query may wait for its embedding before BM25 answers alone
    "max_message_bytes": 64 << 20,  # a longer line, HTTP body or SSE event fails that message, not the gateway
    "max_list_pages": 100,          # pages Coffer follows when an upstream paginates one list
    "max_list_items": 10_000,       # tools (prompts, resources...) kept per list per upstream
    "list_page_size": 1000,         # items per page of a list a client gets; more follow with nextCursor
    "probe_timeout": 10.0,          # seconds a new server has to answer server/discover before initialize is tried
    "mrtr_ttl": 300.0,              # seconds a 2026-07-28 client has to answer a question an upstream asked mid-call
    "memory": "off",                # on: coffer__remember keeps notes agents want kept, coffer__ask finds them
    "ask_synthesis": "on",          # on: coffer__ask may ask the client's own model (sampling) for an answer
    "search_feedback": "off",       # on: keep each tool search and the tool then called, for `coffer eval`
    "search_preference": "on",      # on: with search_feedback on, lift the tools picked for similar searches
    "serve_mode": "service",        # service: `coffer serve` relays to the user's shared service; standalone: not
    "service_idle_exit": 600.0,     # seconds the service stays up with no client attached
    "upstream_idle_stop": "off",    # off, or seconds a shared upstream may go without a call before it is stopped
    "restart_backoff": 0.5,         # seconds before a crashed upstream's first restart; doubles per failure
    "service_http": "",             # HOST:PORT: the service also serves Streamable HTTP at http://HOST:PORT/mcp
    "service_http_origins": "",     # browser origins (space-separated) allowed to call that endpoint: CORS
    "http_read_timeout": 10.0,      # seconds an HTTP client may send nothing mid-request, or between requests
    "http_session_idle": 3600.0,    # seconds an HTTP session may go unused before it ends
    "redact": "on",                 # known secret values in what goes to a client become ***; redact.<server> off
}
#: Settings `coffer config KEY VALUE` changes and `coffer config KEY` shows, but the listings (`coffer config`,
#: --json, "known: ...") leave out: knobs for tests and diagnosis that a user has no reason to turn.
HIDDEN_SETTINGS = frozenset({"restart_backoff", "http_read_timeout", "http_session_idle"})


def listed_settings(settings: dict) -> dict:
    """``settings`` without the hidden ones: what `coffer config` lists (a per-client expose.<client> is never
    hidden)."""
    return {key: value for key, value in settings.items() if key not in HIDDEN_SETTINGS}


EXPOSE_RE = re.compile(r"^(auto|all|search|budget:([2-9]|[1-9][0-9]{1,3}))$")
#: A setting for one client (expose.cursor) or one server (redact.vault): the global one unless it is set.
PER_KEY_SETTING_RE = re.compile(r"^(expose|redact)\.([A-Za-z0-9-]{1,32})$")
HTTP_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})$")
HTTP_ORIGIN_RE = re.compile(r"^https?://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?$")


def unknown_setting(key: str) -> str:
    """The message for a setting name Coffer does not know: the listed ones, and the nearest."""
    listed = sorted(listed_settings(DEFAULTS))
    return (f"unknown setting {key!r}{did_you_mean(key, listed)}; known: {', '.join(listed)}, expose.<client>, "
            "redact.<server>")


def redacts_output(settings: dict, server: str) -> bool:
    """Whether known secret values are redacted from what ``server`` sends a client (redact, redact.<server>)."""
    return (settings.get(f"redact.{server}") or settings["redact"]) == "on"


def _positive_number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def check_setting(key: str, raw):
    """A setting's value from the CLI (text) or the vault (JSON), converted and range-checked, or CofferError.
    ``key`` is a DEFAULTS key (vault.setting_key maps expose.<client> to expose, redact.<server> to redact)."""
    default = DEFAULTS[key]
    kind = type(default)
    if isinstance(raw, bool) or (not isinstance(raw, (str, int, float)) or
                                 (kind is str and not isinstance(raw, str))):
        raise CofferError(f"setting {key} needs a {kind.__name__}, got {raw!r}")
    try:
        value = kind(raw)
    except (ValueError, OverflowError):
        raise CofferError(f"setting {key} needs a {kind.__name__}, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CofferError(f"setting {key} needs a finite number")
    if key == "name_max_length" and not NAME_MAX_LENGTH_MIN <= value <= 64:
        raise CofferError(f"name_max_length must be between {NAME_MAX_LENGTH_MIN} and 64")
    if key == "expose" and not EXPOSE_RE.match(value):
        raise CofferError("expose must be auto, all, search or budget:N (N at least 2)")
    if key == "embedder_api" and value not in ("openai", "ollama"):
        raise CofferError("embedder_api must be 'openai' or 'ollama'")
    if key in ("memory", "ask_synthesis", "search_feedback", "search_preference", "redact") and \
            value not in ("on", "off"):
        raise CofferError(f"{key} must be on or off")
    if key == "serve_mode" and value not in ("service", "standalone"):
        raise CofferError("serve_mode must be service or standalone")
    if key == "upstream_idle_stop" and value != "off" and not _positive_number(value):
        raise CofferError("upstream_idle_stop must be off or a number of seconds")
    if key == "service_http" and value and not (HTTP_ADDRESS_RE.match(value) and
                                                int(HTTP_ADDRESS_RE.match(value).group(2)) <= 65535):
        raise CofferError("service_http must be HOST:PORT (e.g. 127.0.0.1:8765), or '' for none")
    if key == "service_http_origins" and not all(HTTP_ORIGIN_RE.match(o) for o in value.split()):
        raise CofferError("service_http_origins must be origins like http://localhost:5173, separated by spaces")
    if key == "max_message_bytes" and value < 4096:
        raise CofferError("max_message_bytes must be at least 4096")
    if isinstance(value, (int, float)) and value <= 0:
        raise CofferError(f"{key} must be positive")
    return value
