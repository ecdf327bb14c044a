"""A Streamable HTTP front for ``coffer serve --standalone``, for the conformance suite's server scenarios until
the shared service's own HTTP endpoint is on main.  Test tooling only: not part of Coffer.

    server_bridge.py --home DIR [--era handshake|modern] [--unprefixed] [--port N]
    server_bridge.py --forward URL --token-env VAR [--port N]

It registers tests/conformance/upstream_server.py (in ``--era``) as Coffer's upstream ``conf`` in the COFFER_HOME
``--home``, listens on 127.0.0.1 and prints its URL (``http://127.0.0.1:PORT/mcp``) as its first line.

The HTTP side, kept to what the transport specification asks of a server: a POST of ``initialize`` starts a
session (its own ``coffer serve`` process, named by Mcp-Session-Id); a POST carrying the 2026-07-28 envelope goes
to the one stateless session (its own process too), after the revision's header checks; a request is answered on
its own SSE stream, which carries what Coffer says meanwhile (progress, log messages, its questions to the client)
before the answer; notifications and responses are accepted with 202; GET opens a session's stream for what
belongs to no request; DELETE ends a session; a Host or Origin that is not this machine is refused (DNS
rebinding).  Ids are renumbered per session, so two clients' ids never meet in one process.

``--forward`` is for Coffer's own endpoint instead (the service's ``/mcp``): it only adds the bearer token the
suite cannot send (see make_forwarder).

``--unprefixed`` is the diagnostic run: tool and prompt names lose Coffer's ``conf__`` prefix on the way out and
get it back on the way in, so a scenario that fails only because of the prefix passes through it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
COFFER = [sys.executable, str(ROOT / "coffer.py")]
PREFIX = "conf__"
MODERN = "2026-07-28"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"


class Session:
    """One ``coffer serve --standalone`` process and what waits on it.

    ``pending``: bridge id -> (client id, queue of messages for that request's stream, progress token);
    ``stream``: the GET stream's queue, if open.  Guarded by ``lock``; the reader thread routes Coffer's output."""

    def __init__(self, home: Path, unprefixed: bool):
        self.unprefixed = unprefixed
        self.proc = subprocess.Popen([*COFFER, "serve", "--standalone"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, "COFFER_HOME": str(home)})
        self.lock = threading.Lock()
        self.pending: dict[str, tuple] = {}
        self.stream: queue.Queue | None = None
        self.ids = itertools.count(1)
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, message: dict) -> None:
        data = (json.dumps(self.inward(message)) + "\n").encode()
        with self.lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def request(self, message: dict) -> queue.Queue:
        """Send a client request under a bridge id; the queue gets what Coffer says for it, its answer last."""
        ours = f"b{next(self.ids)}"
        meta = (message.get("params") or {}).get("_meta") or {}
        box: queue.Queue = queue.Queue()
        with self.lock:
            self.pending[ours] = (message["id"], box, meta.get("progressToken"))
        self.send({**message, "id": ours})
        return box

    def forget(self, box: queue.Queue) -> None:
        with self.lock:
            for ours, (_, known, _) in list(self.pending.items()):
                if known is box:
                    del self.pending[ours]

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = self.outward(json.loads(line))
            except ValueError:
                continue
            self.route(message)
        with self.lock:
            boxes = [box for _, box, _ in self.pending.values()] + ([self.stream] if self.stream else [])
        for box in boxes:
            box.put(None)

    def route(self, message: dict) -> None:
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        with self.lock:
            if "method" not in message:  # an answer: to the request it answers, under the client's id
                entry = self.pending.pop(message.get("id"), None)
                if entry is not None:
                    entry[1].put({**message, "id": entry[0]})
                return
            target = None
            subscription = (params.get("_meta") or {}).get(META_SUBSCRIPTION)
            if subscription in self.pending:
                client_id, target, _ = self.pending[subscription]
                message = {**message, "params": {**params, "_meta": {**params["_meta"],
                                                                     META_SUBSCRIPTION: client_id}}}
            elif "progressToken" in params:
                target = next((box for _, box, token in self.pending.values()
                               if token == params["progressToken"]), None)
            if target is None and "id" not in message and self.stream is not None \
                    and message.get("method") == "notifications/resources/updated":
                target = self.stream
            if target is None and self.pending:
                target = list(self.pending.values())[-1][1]
            if target is None:
                target = self.stream
        if target is not None:
            target.put(message)

    # -- the diagnostic renaming ----------------------------------------------------------------------------------
    def inward(self, message: dict) -> dict:
        params = message.get("params")
        if not self.unprefixed or not isinstance(params, dict):
            return message
        method = message.get("method")
        if method in ("tools/call", "prompts/get") and isinstance(params.get("name"), str) \
                and not params["name"].startswith("coffer__"):
            return {**message, "params": {**params, "name": PREFIX + params["name"]}}
        ref = params.get("ref")
        if method == "completion/complete" and isinstance(ref, dict) and ref.get("type") == "ref/prompt":
            return {**message, "params": {**params, "ref": {**ref, "name": PREFIX + str(ref.get("name"))}}}
        return message

    def outward(self, message: dict) -> dict:
        result = message.get("result")
        if not self.unprefixed or not isinstance(result, dict):
            return message
        for key in ("tools", "prompts"):
            if isinstance(result.get(key), list):
                result[key] = [{**item, "name": item["name"][len(PREFIX):]} for item in result[key]
                               if item.get("name", "").startswith(PREFIX)]
        return message

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class Bridge:
    def __init__(self, home: Path, unprefixed: bool):
        self.home, self.unprefixed = home, unprefixed
        self.sessions: dict[str, Session] = {}
        self.stateless: Session | None = None
        self.lock = threading.Lock()

    def new_session(self) -> tuple[str, Session]:
        session_id = secrets.token_hex(16)
        session = Session(self.home, self.unprefixed)
        with self.lock:
            self.sessions[session_id] = session
        return session_id, session

    def stateless_session(self) -> Session:
        with self.lock:
            if self.stateless is None:
                self.stateless = Session(self.home, self.unprefixed)
            return self.stateless


def make_handler(bridge: Bridge, port: int):
    allowed_hosts = {f"127.0.0.1:{port}", f"localhost:{port}"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            if os.environ.get("BRIDGE_LOG"):
                super().log_message(*args)

        def refuse(self, status: int, code: int | None = None, message: str = "", msg_id=None) -> None:
            body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code or -32600,
                                                                          "message": message}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")  # a refused request's body may be unread
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def local(self) -> bool:
            """DNS rebinding: only this machine's names, in Host and (when sent) Origin."""
            origin = self.headers.get("Origin")
            return self.headers.get("Host") in allowed_hosts and (
                origin is None or origin.split("://", 1)[-1] in allowed_hosts)

        def session(self) -> Session | None:
            return bridge.sessions.get(self.headers.get("Mcp-Session-Id") or "")

        def do_GET(self):  # noqa: N802
            if not self.local():
                return self.refuse(403, -32600, "Forbidden: Host or Origin is not this machine")
            session = self.session()
            if session is None:
                return self.refuse(405 if not self.headers.get("Mcp-Session-Id") else 404, -32600,
                                   "no stream without a session")
            box: queue.Queue = queue.Queue()
            with session.lock:
                session.stream = box
            self.start_stream()
            try:
                while True:
                    message = box.get()
                    if message is None or not self.event(message):
                        return
            finally:
                with session.lock:
                    if session.stream is box:
                        session.stream = None

        def do_DELETE(self):  # noqa: N802
            if not self.local():
                return self.refuse(403, -32600, "Forbidden")
            session_id = self.headers.get("Mcp-Session-Id") or ""
            with bridge.lock:
                session = bridge.sessions.pop(session_id, None)
            if session is None:
                return self.refuse(404, -32600, "Session not found")
            threading.Thread(target=session.close, daemon=True).start()
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):  # noqa: N802
            if not self.local():
                return self.refuse(403, -32600, "Forbidden: Host or Origin is not this machine")
            try:
                message = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError:
                return self.refuse(400, -32700, "Parse error")
            if not isinstance(message, dict):
                return self.refuse(400, -32600, "one JSON-RPC message per POST")
            params = message.get("params") if isinstance(message.get("params"), dict) else {}
            meta_version = (params.get("_meta") or {}).get(META_VERSION)
            header_version = self.headers.get("MCP-Protocol-Version")
            session_id = None
            if message.get("method") == "initialize" and not self.headers.get("Mcp-Session-Id") \
                    and meta_version is None:
                session_id, session = bridge.new_session()
            elif meta_version is not None or header_version == MODERN:
                if header_version is None:
                    return self.refuse(400, -32020, "Missing MCP-Protocol-Version header", message.get("id"))
                if meta_version is not None and header_version != meta_version:
                    return self.refuse(400, -32020, "MCP-Protocol-Version header does not match _meta",
                                       message.get("id"))
                method = message.get("method")
                if method is not None and self.headers.get("Mcp-Method") not in (None, method):
                    return self.refuse(400, -32020, "Mcp-Method header does not match the body", message.get("id"))
                session = bridge.stateless_session()
            else:
                session = self.session()
                if session is None:
                    if self.headers.get("Mcp-Session-Id"):
                        return self.refuse(404, -32001, "Session not found", message.get("id"))
                    return self.refuse(400, -32000, "Bad Request: no valid session", message.get("id"))
            if "method" not in message or "id" not in message:  # a notification or the client's answer
                session.send(message)
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            box = session.request(message)
            try:
                item = box.get()
                if item is not None and "method" not in item and session is bridge.stateless:
                    return self.answer(item)  # 2026-07-28: the status tells what kind of answer it is
                self.start_stream(session_id)
                while True:
                    if item is None or not self.event(item) or "method" not in item:
                        return None
                    item = box.get()
            finally:
                session.forget(box)

        def answer(self, message: dict) -> None:
            """A 2026-07-28 answer as one JSON body, its HTTP status saying what kind of error it is (basic/
            transports: 400 for an invalid envelope, version or capability, 404 for a method not found)."""
            code = (message.get("error") or {}).get("code")
            status = {-32601: 404, -32602: 400, -32020: 400, -32021: 400, -32022: 400}.get(code, 200)
            body = json.dumps(message).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def start_stream(self, session_id: str | None = None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            if session_id:
                self.send_header("Mcp-Session-Id", session_id)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")  # a stream is one response per connection
            self.end_headers()
            self.close_connection = True

        def event(self, message: dict) -> bool:
            data = f"event: message\ndata: {json.dumps(message)}\n\n".encode()
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                if "method" not in message:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                return True
            except OSError:
                return False

    return Handler


def make_forwarder(target: str, token: str, port: int):
    """A Streamable HTTP endpoint that needs a bearer token (Coffer's own, `coffer token add`), reached by a
    suite that cannot send one: each request goes on with ``Authorization`` added and this address's Host and
    Origin spelled as the endpoint's (any other Host or Origin goes on as it came, for the endpoint to judge);
    each response comes back as it streams."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(target)
    ours = {f"127.0.0.1:{port}", f"localhost:{port}"}

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def relay(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "origin", "connection", "content-length", "authorization")}
            host = self.headers.get("Host", "")
            headers["Host"] = parts.netloc if host in ours else host
            origin = self.headers.get("Origin")
            if origin is not None:
                headers["Origin"] = f"{parts.scheme}://{parts.netloc}" if origin.split("://", 1)[-1] in ours \
                    else origin
            headers["Authorization"] = f"Bearer {token}"
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
            try:
                connection.request(self.command, parts.path or "/", body=body or None, headers=headers)
                reply = connection.getresponse()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                while True:
                    piece = reply.read1(65536)
                    if not piece:
                        break
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True
            finally:
                connection.close()

        do_GET = do_POST = do_DELETE = relay  # noqa: N815

    return Forward


def forward_main(args) -> int:
    token = os.environ.get(args.token_env or "", "")
    server = ThreadingHTTPServer(("127.0.0.1", args.port), None)
    server.RequestHandlerClass = make_forwarder(args.forward, token, server.server_address[1])
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}/mcp", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home")
    parser.add_argument("--era", choices=("handshake", "modern"), default="handshake")
    parser.add_argument("--unprefixed", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--forward", metavar="URL", help="instead: forward to Coffer's own endpoint at URL")
    parser.add_argument("--token-env", metavar="VAR", help="with --forward: the variable holding its token")
    args = parser.parse_args()
    if args.forward:
        return forward_main(args)
    home = Path(args.home)
    env = {**os.environ, "COFFER_HOME": str(home)}
    for command in (["add", "conf", "--", sys.executable, str(HERE / "upstream_server.py"), "--era", args.era],
                    ["config", "discovery_timeout", "30"]):
        subprocess.run([*COFFER, *command], env=env, check=True, capture_output=True)
    bridge = Bridge(home, args.unprefixed)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), None)
    server.RequestHandlerClass = make_handler(bridge, server.server_address[1])
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}/mcp", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        for session in list(bridge.sessions.values()) + ([bridge.stateless] if bridge.stateless else []):
            session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
