"""Service commands: `coffer serve` (relay or standalone), `coffer service`, `status`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from coffer_src import __version__
from coffer_src.errors import CofferError
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.resources import own_command
from coffer_src.service.channel import (
    ChannelError,
    StartLock,
    control,
    detached_popen_options,
    process_alive,
    read_service_file,
)
from coffer_src.service.http import HttpEndpoint, parse_http_address
from coffer_src.service.relay import Relay
from coffer_src.service.server import build_id, run_service
from coffer_src.service.tokens import TokenStore, check_token_name
from coffer_src.terminal import _print_table, say, say_json
from coffer_src.vault import Vault

commands_log = logging.getLogger(__name__)

#: Set to "standalone" (or "service") to override the serve_mode setting for one process tree: sandboxes, CI.
SERVE_MODE_ENV = "COFFER_SERVE_MODE"


def serve_mode(vault: Vault, args) -> str:
    if args.standalone or args.only or args.live:
        return "standalone"  # `coffer call` and probes run their own gateway, as does whoever asks for one
    override = os.environ.get(SERVE_MODE_ENV, "").strip().lower()
    if override in ("standalone", "service"):
        return override
    return str(vault.settings().get("serve_mode", "service"))


def cmd_serve(vault: Vault, args) -> int:
    if serve_mode(vault, args) == "standalone":
        return serve_standalone(vault, args)
    home = vault.home
    vault.close()  # the relay needs none of it; the service has its own connection
    relay = Relay(home, __version__, build_id(), lambda: spawn_service(home))
    try:
        return relay.run()
    except ChannelError as exc:
        raise CofferError(str(exc)) from None


def serve_standalone(vault: Vault, args) -> int:
    """Today's `coffer serve`: the gateway in this process, for this one client (the same session code as the
    service runs)."""
    vault.actor = "gateway"

    def client_gone():
        hub.shutdown()
        os._exit(0)  # the main thread is blocked reading a client that will never write again

    hub = Hub(vault, remember=not args.live, only=args.only)
    session = ClientSession(hub, on_client_gone=client_gone)

    def on_signal(signum, frame):
        if not hub.stopping:  # a second signal must not interrupt the shutdown itself
            raise SystemExit(0)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_signal)
    try:
        if sys.stdin.isatty() and sys.stderr.isatty():
            commands_log.info("coffer serve speaks MCP on stdin/stdout and waits for a client; an agent starts it "
                              "itself (e.g. `claude mcp add coffer -- coffer serve`). Ctrl-C to quit.")
        hub.start()
        session.serve(sys.stdin.buffer)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        hub.shutdown()
    return 0


def spawn_service(home: str, http: str | None = None) -> None:
    """Start the service in the background: detached from the caller's terminal and process group, its output
    in its own log (COFFER_HOME/logs/service.log), nothing of the caller's stdin or stdout."""
    extra = ("--http", http) if http else ()
    subprocess.Popen(own_command("service", "run", *extra), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, cwd=home, env={**os.environ, "COFFER_HOME": home}, close_fds=True,
                     **detached_popen_options())


def service_running(home: str) -> dict | None:
    answer = control(home, {"op": "status"})
    return answer.get("status") if answer and isinstance(answer.get("status"), dict) else None


def stop_service(home: str, timeout: float = 15.0) -> bool:
    """Ask the running service to stop and wait until it has; False when none was running."""
    info = read_service_file(home) or {}
    if control(home, {"op": "stop"}) is None:
        return False
    pid = info.get("pid") if isinstance(info.get("pid"), int) else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if control(home, {"op": "status"}) is None and (pid is None or not process_alive(pid)):
            return True
        time.sleep(0.05)
    raise CofferError(f"the service did not stop within {timeout:g}s")


def start_service(home: str, timeout: float = 15.0, http: str | None = None) -> dict:
    with StartLock(home):
        status = service_running(home)
        if status is None:
            spawn_service(home, http)
            deadline = time.monotonic() + timeout
            while status is None and time.monotonic() < deadline:
                time.sleep(0.05)
                status = service_running(home)
    if status is None:
        raise CofferError(f"the service did not start within {timeout:g}s; see "
                          f"{os.path.join(home, 'logs', 'service.log')}")
    return status


def http_endpoint(service, address: str) -> HttpEndpoint:
    return HttpEndpoint(service, address)


def cmd_service(vault: Vault, args) -> int:
    home = vault.home
    if args.http:
        parse_http_address(args.http)  # a bad address is the user's to fix now, not a line in the service's log
    if args.action == "run":
        vault.close()
        return run_service(home, http_endpoint, args.http)
    if args.action == "stop":
        say("stopped the Coffer service" if stop_service(home) else "no Coffer service was running")
        return 0
    if args.action == "restart":
        stop_service(home)
    status = start_service(home, http=args.http)
    say(f"the Coffer service runs (pid {status['service']['pid']}, version {status['service']['version']})")
    http = status["service"].get("http")
    if args.http and http is None:
        answer = control(home, {"op": "http", "address": args.http}) or {}
        if answer.get("error"):
            raise CofferError(answer["error"])
        http = answer.get("http")
    if http is None and args.http:
        raise CofferError(f"the service did not serve HTTP at {args.http}; see {os.path.join(home, 'logs')}")
    if http is not None:
        say_http(http)
    return 0


def say_http(http: dict) -> None:
    say(f"Streamable HTTP: {http['url']} (clients need a token: coffer token add NAME)")
    if not http.get("loopback"):
        say("WARNING: that address is reachable from other machines; anyone who can reach it and holds a token "
            "can use every tool Coffer serves, over unencrypted HTTP")


def cmd_token(vault: Vault, args) -> int:
    """`coffer token add NAME | list | rm NAME`: the named bearer tokens of HTTP clients."""
    store = TokenStore(vault.home)
    try:
        if args.action == "list":
            rows = store.rows()
            if args.json:
                say_json(rows)
            elif not rows:
                say("no HTTP client tokens (coffer token add NAME makes one)")
            else:
                _print_table([[r["name"], r["created"], r["last_used"] or "never"] for r in rows],
                             ["NAME", "CREATED", "LAST USED"])
            return 0
        if not args.name:
            raise CofferError(f"coffer token {args.action} needs a NAME")
        check_token_name(args.name)
        if args.action == "add":
            token = store.add(args.name)
            vault.audit("token-add", args.name)
            # Printed as it is (say() would redact it): this is the one time anyone sees it.
            print(token)
            print(f"coffer: the token for {args.name}, shown this once: its client sends it as the header "
                  "'Authorization: Bearer <token>'", file=sys.stderr)
            return 0
        if not store.remove(args.name):
            raise CofferError(f"no token named {args.name!r}")
        vault.audit("token-rm", args.name)
        say(f"removed the token {args.name}: its HTTP sessions end")
        return 0
    finally:
        store.close()


def cmd_status(vault: Vault, args) -> int:
    status = service_running(vault.home) or {"service": None, "sessions": [], "upstreams": []}
    if args.json:
        say_json(status)
        return 0
    service = status["service"]
    if service is None:
        say("no Coffer service is running (it starts with the first `coffer serve`)")
        return 0
    say(f"service: pid {service['pid']}, version {service['version']}, up {service['uptime_s']:.0f}s, "
        f"{service['rss_mb']} MB")
    if service.get("http"):
        say_http(service["http"])
    say(f"sessions: {len(status['sessions'])}")
    for session in status["sessions"]:
        over = " over HTTP" if session.get("transport") == "http" else ""
        say(f"  {session['client']} {session.get('version') or ''} ({session.get('era') or 'starting'}{over}) "
            f"since {session['since']}: {session['calls']} calls")
    say(f"upstreams: {len(status['upstreams'])}")
    for upstream in status["upstreams"]:
        memory = f", {upstream['rss_mb']} MB" if upstream.get("rss_mb") is not None else ""
        say(f"  {upstream['name']}: {upstream['state']} ({upstream['sharing']}), pid {upstream.get('pid') or '-'}"
            f"{memory}, {upstream['sessions']} sessions, last call {upstream.get('last_call') or 'never'}")
    return 0


def add_service_commands(command) -> None:
    p = command("serve", cmd_serve, "speak MCP on stdio for one client (what an agent's config runs): a thin relay "
                                    "to the user's shared Coffer service, started if none runs")
    p.add_argument("--standalone", action="store_true",
                   help="run the gateway in this process for this client alone (sandboxes, CI, one-shot use); "
                        "also the serve_mode setting, or COFFER_SERVE_MODE=standalone")
    p.add_argument("--live", action="store_true",
                   help="(standalone) list only what started servers offer now; by default a server still "
                        "starting is listed as it was at its last start, and a change is announced when it is up")
    p.add_argument("--only", action="append", metavar="SERVER", help=argparse.SUPPRESS)
    p = command("service", cmd_service, "the user's shared Coffer service: start, stop, restart (or run it in the "
                                        "foreground)")
    p.add_argument("action", choices=("start", "stop", "restart", "run"))
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve Streamable HTTP at http://HOST:PORT/mcp for clients with a token (coffer token "
                        "add NAME); loopback unless you name another address; the service_http setting makes it "
                        "permanent")
    p = command("token", cmd_token, "bearer tokens of HTTP clients: add NAME (shown once), list, rm NAME")
    p.add_argument("action", choices=("add", "list", "rm"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p = command("status", cmd_status, "the service, the sessions attached to it and each upstream")
    p.add_argument("--json", action="store_true")
