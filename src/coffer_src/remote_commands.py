"""Remote commands: `coffer auth`, and what `coffer add --url` asks a remote server.

`coffer auth NAME` logs in (or --logout) with OAuth.

Nothing here is needed to serve: these run in the CLI, once, where a person can open a browser and read what a
server answered.
"""

from __future__ import annotations

import logging
import sys

from coffer_src.errors import CofferError
from coffer_src.names import ENV_KEY_RE, REMOTE_TRANSPORTS
from coffer_src.oauth import (
    NeedsLogin,
    OAuthCredentials,
    OAuthFailure,
    OAuthGrant,
    oauth_login,
    oauth_secret_name,
    revoke_grant,
)
from coffer_src.secret_store import expand_vars
from coffer_src.terminal import ServerLog, clip, printable, redact, say
from coffer_src.transport.remote import probe_transport
from coffer_src.transport.stdio import UpstreamFailure
from coffer_src.vault import Vault, utcnow

remote_commands_log = logging.getLogger(__name__)


def add_remote_arguments(p) -> None:
    """The `coffer add` options for remote servers (call from build_parser after --url/--header)."""
    p.add_argument("--transport", choices=REMOTE_TRANSPORTS, default=None,
                   help="with --url: auto (default) asks the server; http = Streamable HTTP; sse = the legacy "
                        "HTTP+SSE transport (2024-11-05)")
    p.add_argument("--oauth-client-id", metavar="ID",
                   help="with --url: an OAuth client you registered with the server's provider (else Coffer uses a "
                        "client metadata document or registers itself)")
    p.add_argument("--oauth-client-secret-env", metavar="VAR",
                   help="the variable (environment, then `coffer secret`) holding that client's secret; the secret "
                        "itself is never stored by Coffer")


def add_auth_command(command) -> None:
    """`coffer auth NAME [--logout]` (call from build_parser: ``add_auth_command(command)``)."""
    p = command("auth", cmd_auth, "log in to an OAuth-protected remote server in your browser (or --logout)")
    p.add_argument("name")
    p.add_argument("--logout", action="store_true", help="forget the saved login (and revoke it where possible)")
    p.add_argument("--scope", help="ask for these scopes (space-separated) instead of what the server suggests")
    p.add_argument("--oauth-client-id", metavar="ID", help="use (and remember) this pre-registered OAuth client")
    p.add_argument("--oauth-client-secret-env", metavar="VAR", help="the variable holding its secret")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the browser (default 300)")
    p.add_argument("--no-browser", action="store_true", help="only print the address to open")


def remote_add_options(args) -> dict:
    """What cmd_add passes to Vault.add_server for a remote server: transport and the OAuth client settings."""
    if not args.url:
        if args.transport or args.oauth_client_id or args.oauth_client_secret_env:
            raise CofferError("--transport and --oauth-* go with --url")
        return {}
    if args.oauth_client_secret_env and not ENV_KEY_RE.match(args.oauth_client_secret_env):
        raise CofferError("--oauth-client-secret-env takes a variable name, not a secret")
    if args.oauth_client_secret_env and not args.oauth_client_id:
        raise CofferError("--oauth-client-secret-env goes with --oauth-client-id")
    oauth = {key: value for key, value in (("client_id", args.oauth_client_id),
                                           ("client_secret_env", args.oauth_client_secret_env)) if value}
    return {"transport": args.transport or "auto", "oauth": oauth or None}


def report_remote_added(vault: Vault, name: str, store) -> None:
    """After `coffer add --url`: ask the server which transport it speaks (transport auto) and whether it needs
    a login, and say so.  Nothing here is fatal: an unreachable server is detected at its first start."""
    server = vault.server(name)
    if server["transport"] != "auto":
        return
    missing: list[str] = []
    url = expand_vars(server["url"], missing=missing, secrets=store)
    headers = {k: expand_vars(v, missing=missing, secrets=store) for k, v in server["headers"].items()}
    own_authorization = any(key.lower() == "authorization" for key in headers)
    auth = None if own_authorization else OAuthCredentials(name, url, store)
    try:
        probe = probe_transport(name, url, headers, auth, timeout=10.0)
    except NeedsLogin as exc:
        vault.record_status(name, "failed", str(exc))  # `list` and the agent's instructions say so at once
        say(str(exc) if headers else f"{name} needs a login: run `coffer auth {name}`")
        return
    except UpstreamFailure as exc:
        say(f"could not ask {name} which transport it speaks now ({clip(printable(redact(str(exc))), 300)}); "
              "it will be detected at its first start")
        return
    vault.set_transport(name, probe.kind)
    say(f"{name} speaks {probe.detail}")


def cmd_auth(vault: Vault, args) -> int:
    server = vault.server(args.name)
    if server["transport"] == "stdio":
        raise CofferError(f"{args.name} is a local (stdio) server: it takes credentials from --env, not a login")
    store = vault.secrets
    key = oauth_secret_name(args.name)
    if args.logout:
        text = store.get(key)
        if text is None:
            say(f"{args.name} had no saved login")
            return 0
        try:
            grant = OAuthGrant.from_text(text)
            redact.add(*grant.secret_values())
            outcome = revoke_grant(grant, store)
        except (ValueError, TypeError):
            outcome = "the saved login was damaged"
        store.delete(key)
        vault.set_oauth(args.name, dict(server.get("oauth") or {}, login_at=None))
        say(f"logged out of {args.name} ({outcome})")
        return 0
    missing: list[str] = []
    url = expand_vars(server["url"], missing=missing, secrets=store)
    headers = {k: expand_vars(v, missing=missing, secrets=store) for k, v in server["headers"].items()}
    if any(k.lower() == "authorization" for k in headers):
        raise CofferError(f"{args.name} is configured with its own Authorization header (--header); remove it "
                          "to log in with OAuth")
    oauth = dict(server.get("oauth") or {})
    if args.oauth_client_id:
        oauth["client_id"] = args.oauth_client_id
        oauth.pop("client_secret_env", None)
    if args.oauth_client_secret_env:
        if not ENV_KEY_RE.match(args.oauth_client_secret_env):
            raise CofferError("--oauth-client-secret-env takes a variable name, not a secret")
        oauth["client_secret_env"] = args.oauth_client_secret_env
    interactive = sys.stdin is not None and sys.stdin.isatty()
    try:
        grant = oauth_login(args.name, url, headers, oauth, store, vault.settings(), out=sys.stderr,
                            open_browser=(lambda address: False) if args.no_browser else None,
                            stdin=sys.stdin if interactive else None, timeout=args.timeout, scope=args.scope)
    except UpstreamFailure as exc:
        raise CofferError(f"login to {args.name} failed: {exc}") from None
    except OAuthFailure as exc:
        raise CofferError(f"login to {args.name} failed: {exc}") from None
    if server["transport"] == "auto":
        try:
            probe = probe_transport(args.name, url, headers, OAuthCredentials(args.name, url, store), 15.0)
            vault.set_transport(args.name, probe.kind)
        except UpstreamFailure as exc:
            ServerLog(remote_commands_log, args.name).warning(
                "logged in, but could not ask which transport it speaks: %s", exc)
    # Last, so a running gateway restarts the server once, with the new token (it compares the oauth column).
    vault.set_oauth(args.name, dict(oauth, login_at=utcnow()))
    vault.record_status(args.name, "logged in", "waiting for its next start")
    say(f"logged in to {args.name}" + (f" (scopes: {clip(printable(grant.scope), 300)})" if grant.scope else ""))
    return 0
