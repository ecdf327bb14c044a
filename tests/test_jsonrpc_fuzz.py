"""Bad clients: random and adversarial JSON-RPC against ONE long-lived ``coffer serve``.

The oracle is the JSON-RPC contract, not Coffer's code: every request with a valid id (a string, or an integer
that fits in a signed 53-bit range) gets exactly one well-formed response with that id; anything unparseable or
invalid may get an error with id null; the gateway never dies and its memory stays bounded.
"""

import json
import os
import random
import sys
from collections import Counter

from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from conftest import FAKE, RawGateway, cli, rss_kb

SAFE_INT = 2**53 - 1
KNOWN_METHODS = ["ping", "initialize", "tools/list", "tools/call", "prompts/list", "prompts/get",
                 "resources/list", "resources/templates/list", "resources/read", "resources/subscribe",
                 "resources/unsubscribe", "completion/complete", "logging/setLevel"]
NOTIFICATIONS = ["notifications/initialized", "notifications/roots/list_changed", "notifications/progress",
                 "notifications/message", "notifications/whatever"]

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

valid_ids = (st.integers(-SAFE_INT, SAFE_INT) | st.text(max_size=40)
             | st.sampled_from([0, 1, -1, "", "dup", "dup", 7, SAFE_INT, "x" * 500]))
invalid_ids = (st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.none()
               | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
huge_ids = st.integers(2**64, 2**200) | st.integers(-2**200, -2**64) | st.text(min_size=600, max_size=2000)

tool_names = st.sampled_from(["up__echo", "up__fail", "up__sample", "up__nope", "coffer__search_tools", "", "up__",
                              "coffer__x", "__", "up__echo__echo"]) | st.text(max_size=30) | json_values
tool_params = st.fixed_dictionaries(
    {"name": tool_names},
    optional={"arguments": st.dictionaries(st.sampled_from(["text", "query", "top_k", "x"]), json_values, max_size=3)
              | json_values,
              "_meta": st.none() | json_values | st.fixed_dictionaries({"progressToken": json_values})})
other_params = st.dictionaries(st.sampled_from(["name", "uri", "ref", "level", "cursor", "capabilities",
                                                "protocolVersion", "clientInfo", "argument"]), json_values, max_size=4)
methods = st.sampled_from(KNOWN_METHODS) | st.text(max_size=20)


@st.composite
def requests(draw):
    method = draw(methods)
    message = {"jsonrpc": "2.0", "id": draw(valid_ids), "method": method}
    if draw(st.booleans()):
        message["params"] = draw(tool_params if method == "tools/call" else other_params)
    elif draw(st.integers(0, 9)) == 0:
        message["params"] = draw(json_values)  # often not an object
    return message


@st.composite
def malformed(draw):
    message = draw(requests())
    kind = draw(st.sampled_from(["bad-id", "huge-id", "no-jsonrpc", "bad-jsonrpc", "no-method", "bad-method",
                                 "null-id", "result-shaped", "junk-keys"]))
    if kind == "bad-id":
        message["id"] = draw(invalid_ids)
    elif kind == "huge-id":
        message["id"] = draw(huge_ids)
    elif kind == "no-jsonrpc":
        del message["jsonrpc"]
    elif kind == "bad-jsonrpc":
        message["jsonrpc"] = draw(st.sampled_from(["1.0", "2", 2.0, None, ["2.0"]]))
    elif kind == "no-method":
        del message["method"]
    elif kind == "bad-method":
        message["method"] = draw(json_values.filter(lambda v: not isinstance(v, str)))
    elif kind == "null-id":
        message["id"] = None
    elif kind == "result-shaped":
        del message["method"]
        message[draw(st.sampled_from(["result", "error"]))] = draw(json_values)
    else:
        message.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)))
    return message


notifications = st.builds(lambda m, p: {"jsonrpc": "2.0", "method": m, **({"params": p} if p is not None else {})},
                          st.sampled_from(NOTIFICATIONS) | st.text(max_size=20),
                          st.none() | other_params)
# cancellations aimed at ids this test never uses, so no expected response is legitimately suppressed
cancels = st.builds(lambda r: {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": r}},
                    st.text(max_size=10).map(lambda s: "never-used-" + s) | st.integers(10**15, 10**16))
elements = requests() | malformed() | notifications | cancels
batches = st.lists(elements, max_size=6)
non_json = st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" "))


@st.composite
def lines(draw):
    """(raw bytes of one line, list of JSON-able items it contains or None when it is not JSON)."""
    kind = draw(st.sampled_from(["one", "one", "one", "batch", "junk", "text"]))
    if kind == "one":
        return json.dumps(draw(elements)).encode()
    if kind == "batch":
        return json.dumps(draw(batches)).encode()
    if kind == "text":
        return draw(st.sampled_from([b"{", b"[", b"null", b"42", b'"s"', b"[]", b"[[]]", b"{}", b"NaN", b"1e999",
                                     b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}', b"\xef\xbb\xbf{}"]))
    return draw(non_json)


def valid_id(value):
    return isinstance(value, str) and len(value) <= 512 or (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) <= SAFE_INT)


def classify_ids(raw: bytes) -> tuple[list, list]:
    """(ids that must each get exactly one response, ids that may get one).

    A dict with a valid id is a request (must be answered, if only with Invalid Request) unless it has no method
    and carries result/error: then it is shaped like a response to the client side, and an answer is optional.
    """
    try:
        parsed = json.loads(raw)
    except ValueError:
        return [], []
    must, may = [], []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(item, dict) or "id" not in item or not valid_id(item["id"]):
            continue
        if item.get("method") is None and ("result" in item or "error" in item):
            may.append(item["id"])
        else:
            must.append(item["id"])
    return must, may


def well_formed(message) -> bool:
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or "id" not in message:
        return False
    if ("result" in message) == ("error" in message):
        return False
    if "error" in message:
        error = message["error"]
        return (isinstance(error, dict) and isinstance(error.get("code"), int)
                and isinstance(error.get("message"), str))
    return True


def fuzz_seed() -> int:
    """COFFER_FUZZ_SEED replays a run; otherwise a fresh seed, printed so that a failure can be replayed."""
    value = int(os.environ.get("COFFER_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"fuzz seed {value}: replay with COFFER_FUZZ_SEED={value} python -m pytest {__file__}")
    return value


def test_bad_clients_never_break_the_gateway(home):
    run_seed = fuzz_seed()
    cli("config", "discovery_timeout", "2")
    cli("config", "call_timeout", "5")
    cli("add", "up", "--", *FAKE)
    gw = RawGateway()
    expected = Counter()
    optional = Counter()
    sent_ids = set()
    sync = [0]

    def send(raw: bytes):
        gw.send_raw(raw + b"\n")
        must, may = classify_ids(raw)
        for msg_id in must:
            expected[json.dumps(msg_id)] += 1
        for msg_id in may:
            optional[json.dumps(msg_id)] += 1
        try:
            for item in (lambda p: p if isinstance(p, list) else [p])(json.loads(raw)):
                if isinstance(item, dict) and "id" in item:
                    sent_ids.add(json.dumps(item["id"]))
        except (ValueError, TypeError):
            pass

    def settle(timeout=10.0):
        """Wait until every expected response arrived (routed calls answer asynchronously)."""
        sync[0] += 1
        ping = f"\u2603sync-{sync[0]}"
        gw.send({"jsonrpc": "2.0", "id": ping, "method": "ping"})
        gw.wait_response(ping, timeout=timeout)

        def missing_now(g=gw):
            return {k: n - len(g.responses.get(k, [])) for k, n in expected.items() if len(g.responses.get(k, [])) < n}

        try:
            gw.wait_for(lambda g: not missing_now(g) or g.proc.poll() is not None, timeout=timeout)
        except TimeoutError:
            pass  # reported below, with what is missing
        with gw.cond:
            missing = missing_now()
        assert gw.proc.poll() is None, f"the gateway died; stderr: {''.join(gw.stderr_lines)[-2000:]}"
        with gw.cond:
            extra = {k: len(v) - expected[k] for k, v in gw.responses.items()
                     if k != "null" and len(v) > expected[k] + optional[k]}
            malformed_replies = [m for v in gw.responses.values() for m in v if not well_formed(m)]
            strangers = [k for k, v in gw.responses.items() if v and k != "null" and k not in sent_ids]
        for key, count in missing.items():  # blame this example only, not every later one
            expected[key] -= count
        for key, count in extra.items():
            expected[key] += count
        assert not missing, f"requests with valid ids got no response: {list(missing)[:5]}; " \
                            f"stderr: {''.join(gw.stderr_lines)[-1500:]}"
        assert not extra, f"requests answered more than once: {list(extra)[:5]}"
        assert not malformed_replies, malformed_replies[:3]
        assert not strangers, f"responses to ids never sent: {strangers[:5]}"

    try:
        # before initialize: everything but ping and initialize is refused, and nothing breaks
        for raw in [b'{"jsonrpc":"2.0","id":"pre-1","method":"tools/list"}',
                    b'{"jsonrpc":"2.0","id":"pre-2","method":"tools/call","params":{"name":"up__echo"}}',
                    b'{"jsonrpc":"2.0","id":"pre-3","method":"ping"}', b"not json at all",
                    b'[{"jsonrpc":"2.0","id":"pre-4","method":"resources/list"},{"jsonrpc":"2.0","method":"x"}]',
                    b'{"jsonrpc":"2.0","id":"pre-5","method":"initialize","params":[]}',
                    b'{"jsonrpc":"2.0","id":"pre-6","method":"initialize","params":{"capabilities":7}}']:
            send(raw)
        settle()
        assert "error" in gw.responses['"pre-1"'][0] and "error" in gw.responses['"pre-2"'][0]
        assert gw.responses['"pre-3"'][0]["result"] == {}
        assert gw.initialize()["result"]["serverInfo"]["name"] == "coffer"
        assert "up__echo" in [t["name"] for t in gw.request("tools/list")["result"]["tools"]]
        # oversized lines
        send(b"x" * (5 * 1024 * 1024))
        send(json.dumps({"jsonrpc": "2.0", "id": "big-echo", "method": "tools/call",
                         "params": {"name": "up__echo", "arguments": {"text": "y" * (2 * 1024 * 1024)}}}).encode())
        settle(30)
        assert len(gw.responses['"big-echo"'][0]["result"]["content"][0]["text"]) == 2 * 1024 * 1024

        pid = gw.proc.pid
        rss_before = rss_kb(pid)

        @seed(run_seed)
        @settings(max_examples=200, deadline=None, database=None, derandomize=False,
                  phases=[Phase.explicit, Phase.generate],  # no shrinking: the gateway is shared state
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(lines(), min_size=1, max_size=6))
        @example([b'{"jsonrpc":"2.0","id":"tok-list","method":"tools/call",'
                  b'"params":{"name":"up__echo","arguments":{"text":"t"},"_meta":{"progressToken":[1]}}}'])
        @example([b'{"jsonrpc":"2.0","id":"tok-str","method":"tools/call",'
                  b'"params":{"name":"up__slow","arguments":{"seconds":0.5},"_meta":{"progressToken":"p1"}}}',
                  b'{"jsonrpc":"2.0","id":"tok-list2","method":"tools/call",'
                  b'"params":{"name":"up__echo","arguments":{"text":"t"},"_meta":{"progressToken":{"a":1}}}}'])
        @example([b'{"jsonrpc":"2.0","id":"dup-a","method":"tools/call","params":{"name":"up__echo"}}',
                  b'{"jsonrpc":"2.0","id":"dup-a","method":"tools/call","params":{"name":"up__echo"}}',
                  b'[{"jsonrpc":"2.0","id":"dup-a","method":"ping"},{"jsonrpc":"2.0","id":"dup-a","method":"ping"}]'])
        def fuzz(batch):
            for raw in batch:
                send(raw)
            settle()

        try:
            fuzz()
        except BaseException as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"fuzz seed {run_seed}: replay with COFFER_FUZZ_SEED={run_seed}")
            raise

        # still a working gateway afterwards
        gw.send({"jsonrpc": "2.0", "id": "\u2603final", "method": "tools/call",
                 "params": {"name": "up__echo", "arguments": {"text": "still alive"}}})
        reply = gw.wait_response("\u2603final")
        assert reply["result"]["content"][0]["text"] == "still alive"
        if sys.platform.startswith("linux") and rss_before:
            growth_mb = (rss_kb(pid) - rss_before) / 1024
            assert growth_mb < 50, f"RSS grew {growth_mb:.1f} MB over the fuzz run"
    finally:
        gw.close()
