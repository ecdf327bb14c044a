"""Service commands: `coffer serve` (relay or standalone), `coffer service`, `status`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from coffer_src import __version__
from coffer_src.errors import CofferError
from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.jsonrpc import LATEST_PROTOCOL_VERSION, METHOD_NOT_FOUND, decode_json, encode_line, rpc_error
from coffer_src.resources import own_command
from coffer_src.service.channel import (
    ChannelError,
    StartLock,
    connect,
    control,
    detached_popen_options,
    process_alive,
    read_service_file,
)
from coffer_src.service.http import HttpEndpoint, parse_http_address
from coffer_src.service.relay import Relay, StandaloneWanted
from coffer_src.service.server import build_id, run_service
from coffer_src.service.tokens import TokenStore, check_token_name
from coffer_src.terminal import _print_table, say, say_json
from coffer_src.vault import Vault, coffer_home

commands_log = logging.getLogger(__name__)

#: Set to "standalone" (or "service") to override the serve_mode setting for one process tree: sandboxes, CI.
SERVE_MODE_ENV = "COFFER_SERVE_MODE"


def forced_mode(args) -> str | None:
    """standalone or service when the command line or COFFER_SERVE_MODE decides; None: the serve_mode setting."""
    if args.standalone or args.only or args.live:
        return "standalone"  # `coffer call` and probes run their own gateway, as does whoever asks for one
    override = os.environ.get(SERVE_MODE_ENV, "").strip().lower()
    return override if override in ("standalone", "service") else None


def cmd_serve(vault: Vault | None, args) -> int:
    """`coffer serve`.  The relay opens no vault when a service runs (its hello carries the serve_mode setting):
    an agent's every session then starts with as little as it can."""
    home = vault.home if vault is not None else coffer_home()
    mode = forced_mode(args)
    if mode == "standalone":
        return serve_standalone(vault or Vault(home), args)

    def start(check_setting: bool) -> None:
        if check_setting:
            with contextlib.closing(Vault(home)) as settings_vault:
                if settings_vault.settings().get("serve_mode") == "standalone":
                    raise StandaloneWanted()
        spawn_service(home)

    relay = Relay(home, __version__, build_id(), start, honour_setting=mode is None)
    try:
        return relay.run()
    except StandaloneWanted:
        return serve_standalone(vault or Vault(home), args)
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
    # glibc gives every thread that allocates an arena of its own; a service with a thread per upstream and per
    # client would keep many half-empty ones resident.  Two suffice (other C libraries ignore the variable).
    env = {**os.environ, "COFFER_HOME": home, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    subprocess.Popen(own_command("service", "run", *extra), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, cwd=home, env=env, close_fds=True, **detached_popen_options())


class ServiceSession:
    """The CLI as one more client of a running service (`coffer call`): no server is started for it."""

    def __init__(self, conn):
        self.conn = conn
        self.reader = conn.makefile("rb")
        self.next_id = 0

    def request(self, method: str, params: dict, timeout: float | None = None) -> dict:
        """Send a request and wait for its answer; a request of the service meanwhile is refused, a notification
        skipped.  Returns the JSON-RPC answer."""
        self.next_id += 1
        msg_id = self.next_id
        self.conn.settimeout(timeout)
        self.conn.sendall(encode_line({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}))
        while True:
            line = self.reader.readline(MAX_CLI_ANSWER)
            if not line:
                raise CofferError("the Coffer service closed the connection")
            message = decode_json(line)
            if not isinstance(message, dict):
                continue
            if message.get("id") == msg_id and "method" not in message:
                return message
            if "method" in message and "id" in message:
                self.conn.sendall(encode_line(rpc_error(message["id"], METHOD_NOT_FOUND,
                                                        "the coffer CLI cannot answer this")))

    def close(self) -> None:
        self.reader.close()
        self.conn.close()


#: The largest answer the CLI reads from the service in one line.
MAX_CLI_ANSWER = 256 << 20


def open_service_session(home: str) -> ServiceSession | None:
    """A session with the running service, initialized, or None when no service runs."""
    connected = connect(home, {"coffer": 1, "kind": "session", "version": __version__, "pid": os.getpid()})
    if connected is None:
        return None
    session = ServiceSession(connected[0])
    answer = session.request("initialize", {"protocolVersion": LATEST_PROTOCOL_VERSION, "capabilities": {},
                                            "clientInfo": {"name": "coffer-cli", "version": __version__}}, 30)
    if "result" not in answer:
        session.close()
        return None
    session.conn.sendall(encode_line({"jsonrpc": "2.0", "method": "notifications/initialized"}))
    return session


def service_tools(home: str) -> dict | None:
    """server -> {state, error, tools} from the running service, or None when none runs."""
    answer = control(home, {"op": "tools"}, timeout=30)
    return answer.get("tools") if answer and isinstance(answer.get("tools"), dict) else None


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
        return run_service(home, getattr(args, "extend_service", None), http_endpoint, args.http)
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


#: Browsers that run in the terminal: webbrowser picks them on a machine without a display, and the page needs
#: JavaScript, so for `coffer open` they count as no browser at all.
CONSOLE_BROWSERS = frozenset({"www-browser", "links", "links2", "elinks", "lynx", "w3m"})


def open_in_browser(url: str) -> bool:
    """Open ``url`` in the user's graphical browser; False when there is none (or it refused)."""
    import webbrowser
    try:
        browser = webbrowser.get()
    except webbrowser.Error:
        return False
    if isinstance(browser, webbrowser.GenericBrowser) and os.path.basename(browser.name) in CONSOLE_BROWSERS:
        return False
    try:
        return bool(browser.open(url))
    except Exception as exc:  # noqa: BLE001 - a broken browser setup is "no browser": the address is printed
        commands_log.debug("could not open a browser: %r", exc)
        return False


def cmd_open(vault: Vault, args) -> int:
    """`coffer open`: the page in the browser, through a one-time login link from the service (started if none
    runs).  With --no-browser, or no browser found, the link is printed on stdout and nothing is opened."""
    home = vault.home
    vault.close()
    start_service(home)
    answer = control(home, {"op": "web"}, timeout=30)
    if answer is None:
        raise CofferError("the Coffer service stopped before it answered; run `coffer open` again")
    if not isinstance(answer.get("url"), str):
        if "unknown control request" in str(answer.get("error", "")):
            raise CofferError("the running Coffer service is an older version without the page; "
                              "`coffer service restart` starts this one")
        raise CofferError(f"the Coffer service could not open the page: {answer.get('error') or 'no address'}")
    url = answer["url"]
    if not args.no_browser and open_in_browser(url):
        print(f"opened Coffer in your browser ({answer.get('origin') or 'loopback'}); the login link works once",
              file=sys.stderr)
        return 0
    if not args.no_browser:
        print("no browser found here: open this address (it works once, for 5 minutes):", file=sys.stderr)
    print(url, flush=True)
    return 0


def add_service_commands(command, extend_service: Callable | None = None) -> None:
    """Wire serve, service, status and open into build_parser; ``extend_service`` is given to run_service by
    `coffer service run` (cli passes the web page's attach_web)."""
    p = command("serve", cmd_serve, "speak MCP on stdio for one client (what an agent's config runs): a thin relay "
                                    "to the user's shared Coffer service, started if none runs")
    p.set_defaults(opens_vault=False)  # cmd_serve opens it only if it needs it
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
    p.set_defaults(extend_service=extend_service)
    p = command("token", cmd_token, "bearer tokens of HTTP clients: add NAME (shown once), list, rm NAME")
    p.add_argument("action", choices=("add", "list", "rm"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p = command("open", cmd_open, "see and steer Coffer in your browser: servers, catalogue, changed definitions, "
                                  "activity, search, knowledge, sessions (starts the service if none runs)")
    p.add_argument("--no-browser", action="store_true",
                   help="only print the one-time login address (on stdout); open nothing")
    p = command("status", cmd_status, "the service, the sessions attached to it and each upstream")
    p.add_argument("--json", action="store_true")
