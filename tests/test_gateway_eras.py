"""MCP 2026-07-28 on both sides of Coffer (issue 12): every client era against every upstream era.

The official SDK 2.x client connects in each of its three modes - ``"auto"`` (probe ``server/discover``, fall back
to ``initialize``), ``"legacy"`` (the 2025-11-25 handshake) and ``"2026-07-28"`` (the stateless per-request
envelope, no probe) - to ``coffer serve`` in front of one upstream of each era:

- ``everything``: the Node reference server, handshake era only;
- ``dual``: an SDK 2.x server that serves both eras (tests/fixtures/modern_dual.py);
- ``only``: an SDK 2.x server that refuses ``initialize`` with -32022 (tests/fixtures/modern_only.py).

In every combination the client must see what a user would: the upstream's tools listed under ``<server>__``,
a call with progress, a list change announced and then listed, a cancelled call stopped upstream, and tools
that need the client mid-call (sampling, elicitation, roots) answered through the client's own callbacks -
as real server->client requests for a handshake-era client, as ``input_required`` rounds for a modern one.

The direct-path tests connect the same client straight to the two fixtures (no Coffer): they prove that the
fixtures and the scenarios are right, so a failure through Coffer is Coffer's.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("mcp_types", reason="needs the MCP Python SDK 2.x (mcp>=2.3)")

import anyio  # noqa: E402
import mcp_types as types  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.subscriptions import ResourcesListChanged, ToolsListChanged  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS  # noqa: E402

from coffer_src.gateway.hub import Hub
from coffer_src.gateway.session import ClientSession
from coffer_src.modern import META_CLIENT_CAPABILITIES, modern_error
from coffer_src.vault import Vault

from conftest import (  # noqa: E402
    PY,
    ROOT,
    ROOT_URI,
    SAMPLED_TEXT,
    answer_elicitation,
    answer_roots,
    answer_sampling,
    async_wait_until,
    cli,
    everything_cmd,
    gateway_params,
    needs_node,
    text_of,
)

try:
    BaseExceptionGroup
except NameError:  # Python 3.10: anyio depends on the backport
    from exceptiongroup import BaseExceptionGroup

MODERN = "2026-07-28"
MODES = ("auto", "legacy", MODERN)
FIXTURES = ROOT / "tests" / "fixtures"
CASE_TIMEOUT = 120.0      # seconds one scenario may take end to end (server starts included) before it fails
EVENT_TIMEOUT = 30.0      # seconds to wait for something the upstream does in the background


# ----------------------------------------------------------------------------------------------- the upstreams

@dataclass(frozen=True)
class Call:
    tool: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ListChange:
    """A call that makes the upstream add one item, and where that item then shows up."""

    call: Call
    kind: str          # "tools" or "resources": which list changes
    item: str          # the upstream's own tool name, or the new resource's URI


@dataclass(frozen=True)
class Upstream:
    """One upstream server under test: how to start it and which of its tools exercise each behaviour."""

    key: str                            # the name Coffer registers it under (the tools' "<key>__" prefix)
    era: str                            # "handshake", "dual" or "modern": what it speaks
    command: tuple[str, ...]
    leaves_markers: bool                # writes slow-started / slow-cancelled / slow-finished files
    listed: tuple[str, ...]             # tools a client must see (every client here declares every capability)
    echo: Call
    echo_text: str
    progress: Call
    progress_steps: int
    slow: Call
    mid_call: dict                      # "sampling" | "elicitation" | "roots" -> (Call, text the result must hold)
    make_list_change: Callable[[str], ListChange]


def _everything_list_change(token: str) -> ListChange:
    # gzip-file-as-resource registers a session resource, which makes the server announce a resource list change;
    # a data: URI keeps it off the network.
    name = f"{token}.gz"
    return ListChange(Call("gzip-file-as-resource", {"name": name, "data": "data:text/plain;base64,aGVsbG8=",
                                                     "outputType": "resourceLink"}),
                      "resources", f"demo://resource/session/{name}")


def _fixture_list_change(token: str) -> ListChange:
    return ListChange(Call("add_tool", {"name": token}), "tools", token)


_FIXTURE_TOOLS = ("echo", "count", "add_tool", "slow", "ask_sampling", "ask_elicitation", "ask_roots")
_FIXTURE_MID_CALL = {
    "sampling": (Call("ask_sampling", {"prompt": "What is the answer?"}), f"the client's model said: {SAMPLED_TEXT}"),
    "elicitation": (Call("ask_elicitation"), "hello Ada"),
    "roots": (Call("ask_roots"), f"roots: {ROOT_URI}"),
}

UPSTREAMS = {
    "everything": Upstream(
        key="everything", era="handshake", command=tuple(everything_cmd()), leaves_markers=False,
        listed=("echo", "get-sum", "trigger-long-running-operation", "gzip-file-as-resource",
                "trigger-sampling-request", "trigger-elicitation-request", "get-roots-list"),
        echo=Call("echo", {"message": "coffer-modern-echo"}), echo_text="Echo: coffer-modern-echo",
        progress=Call("trigger-long-running-operation", {"duration": 1, "steps": 4}), progress_steps=4,
        slow=Call("trigger-long-running-operation", {"duration": 60, "steps": 120}),
        mid_call={
            "sampling": (Call("trigger-sampling-request", {"prompt": "hello", "maxTokens": 5}), SAMPLED_TEXT),
            "elicitation": (Call("trigger-elicitation-request"), "- Name: Ada"),
            "roots": (Call("get-roots-list"), "coffer-project"),
        },
        make_list_change=_everything_list_change),
    "dual": Upstream(
        key="dual", era="dual", command=(PY, str(FIXTURES / "modern_dual.py")), leaves_markers=True,
        listed=_FIXTURE_TOOLS, echo=Call("echo", {"message": "coffer-modern-echo"}),
        echo_text="echo: coffer-modern-echo", progress=Call("count", {"steps": 4}), progress_steps=4,
        slow=Call("slow", {"seconds": 60}), mid_call=_FIXTURE_MID_CALL, make_list_change=_fixture_list_change),
    "only": Upstream(
        key="only", era="modern", command=(PY, str(FIXTURES / "modern_only.py")), leaves_markers=True,
        listed=_FIXTURE_TOOLS + ("primes",), echo=Call("echo", {"message": "coffer-modern-echo"}),
        echo_text="echo: coffer-modern-echo", progress=Call("count", {"steps": 4}), progress_steps=4,
        slow=Call("slow", {"seconds": 60}), mid_call=_FIXTURE_MID_CALL, make_list_change=_fixture_list_change),
}

UPSTREAM_PARAMS = [pytest.param("everything", marks=needs_node), "dual", "only"]


# ----------------------------------------------------------------------------------------------- the paths

@dataclass
class Target:
    """Where the client connects: ``coffer serve`` (tools named ``<server>__<tool>``) or the upstream itself."""

    label: str
    params: StdioServerParameters
    prefix: str
    stderr_path: Path
    state_dir: Path
    via_coffer: bool

    def name(self, tool: str) -> str:
        return self.prefix + tool

    def marker(self, name: str) -> bool:
        return (self.state_dir / name).exists()

    def diagnosis(self) -> str:
        """What the gateway (or server) said, for a failure message."""
        lines = []
        if self.via_coffer:
            listing = cli("list", "--json", check=False)
            try:
                for server in json.loads(listing.stdout)["servers"]:
                    lines.append(f"coffer list: {server['name']} is {server['status']!r}"
                                 + (f": {server['detail']}" if server.get("detail") else ""))
            except (ValueError, KeyError, TypeError):
                lines.append(f"coffer list --json failed: {listing.stderr.strip()[-500:]}")
        try:
            tail = self.stderr_path.read_text(encoding="utf-8", errors="replace").splitlines()[-12:]
        except OSError:
            tail = []
        if tail:
            lines.append(f"{self.label} stderr (last lines):")
            lines += [f"    {line[:300]}" for line in tail]
        return ("\n" + "\n".join(lines)) if lines else ""


@pytest.fixture
def through_coffer(home, tmp_path):
    """Register one upstream in a fresh COFFER_HOME and return the path through ``coffer serve``."""
    def make(upstream: Upstream) -> Target:
        state = tmp_path / "fixture-state"
        flags = [f"--env=MODERN_FIXTURE_STATE={state}"] if upstream.leaves_markers else []
        cli("add", upstream.key, *flags, "--", *upstream.command)
        # A Python SDK server takes seconds to import on a loaded machine: let the first list wait for it rather
        # than answer without its tools (the default budget is 5 s).
        cli("config", "discovery_timeout", "60")
        params = gateway_params()
        return Target("coffer", params, f"{upstream.key}__", tmp_path / "coffer-stderr.log", state, True)
    return make


def direct(upstream: Upstream, tmp_path: Path) -> Target:
    state = tmp_path / "fixture-state"
    params = StdioServerParameters(command=upstream.command[0], args=list(upstream.command[1:]),
                                   env={**os.environ, "MODERN_FIXTURE_STATE": str(state)})
    return Target("direct", params, "", tmp_path / "server-stderr.log", state, False)


# ----------------------------------------------------------------------------------------------- the client

class Session:
    """One connected SDK client plus what it has been told: the scenarios' shared handle."""

    def __init__(self, client: Client, target: Target, upstream: Upstream, mode: str, notices: list):
        self.client, self.target, self.upstream, self.mode = client, target, upstream, mode
        self.notices = notices          # every server notification the client surfaced, in order
        self.doing = "connecting"

    @property
    def modern(self) -> bool:
        return self.client.protocol_version == MODERN

    def step(self, what: str) -> None:
        self.doing = what

    async def call(self, call: Call, **kwargs) -> types.CallToolResult:
        self.step(f"calling {self.target.name(call.tool)}({json.dumps(call.arguments)})")
        return await self.client.call_tool(self.target.name(call.tool), call.arguments, **kwargs)


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside the task-group wrappers anyio and the SDK add."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, MCPError):
        data = f" data={json.dumps(exc.data)[:300]}" if exc.data is not None else ""
        return f"the server answered JSON-RPC error {exc.code}: {exc.message}{data}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, AssertionError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def run_case(target: Target, upstream: Upstream, mode: str, scenario, expect_era: bool = True) -> None:
    """Connect the SDK client in ``mode`` to ``target`` and run ``scenario(session)``; any failure becomes one
    AssertionError naming the combination, the step that failed, the error and what the gateway logged."""
    label = f"[{mode} client -> {target.label} -> {upstream.key} ({upstream.era} upstream)]"
    progress = {"session": None}

    async def main():
        notices: list = []

        async def on_message(message):
            if isinstance(message, types.ServerNotification):
                notices.append(message)

        with anyio.fail_after(CASE_TIMEOUT):
            with open(target.stderr_path, "a", encoding="utf-8") as errlog:
                client = Client(stdio_client(target.params, errlog=errlog), mode=mode,
                                client_info=types.Implementation(name="modern-e2e", version="1"),
                                sampling_callback=answer_sampling, elicitation_callback=answer_elicitation,
                                list_roots_callback=answer_roots, message_handler=on_message,
                                read_timeout_seconds=60)
                async with client:
                    session = Session(client, target, upstream, mode, notices)
                    progress["session"] = session
                    if expect_era:
                        session.step("checking the negotiated protocol era")
                        check_era(session)
                    await scenario(session)

    try:
        anyio.run(main)
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its context
        session = progress["session"]
        doing = session.doing if session else "connecting (the client's handshake or discover probe)"
        raise AssertionError(f"{label} failed while {doing}: {_describe(_leaf(exc))}{target.diagnosis()}") \
            from exc


def check_era(s: Session) -> None:
    version = s.client.protocol_version
    if s.mode == "legacy":
        assert version in HANDSHAKE_PROTOCOL_VERSIONS, f"a legacy-mode client negotiated {version!r}"
    elif s.mode == "auto":
        assert version == MODERN, (
            f"the auto-mode client probed server/discover and settled on {version!r}: "
            + ("Coffer must answer server/discover as a 2026-07-28 server (issue 12)" if s.target.via_coffer
               else "the fixture should have answered server/discover"))
        if s.target.via_coffer:
            info = s.client.server_info
            assert info is not None and info.name == "coffer", \
                f"server/discover's _meta io.modelcontextprotocol/serverInfo should name coffer, got {info}"
            assert "coffer__search_tools" in (s.client.instructions or ""), \
                f"server/discover should carry Coffer's instructions, got {s.client.instructions!r}"
    else:
        assert version == MODERN


# ----------------------------------------------------------------------------------------------- scenarios

async def scenario_listing(s: Session) -> None:
    s.step("listing tools")
    names = [tool.name for tool in (await s.client.list_tools()).tools]
    missing = [s.target.name(tool) for tool in s.upstream.listed if s.target.name(tool) not in names]
    assert not missing, f"{missing} are not listed; the client saw {sorted(names)}"
    if s.target.via_coffer:
        assert "coffer__search_tools" in names
    result = await s.call(s.upstream.echo)
    assert not result.is_error and s.upstream.echo_text in text_of(result), f"unexpected result {result}"


async def scenario_progress(s: Session) -> None:
    seen: list[float] = []

    async def on_progress(progress, total, message):
        seen.append(progress)

    result = await s.call(s.upstream.progress, progress_callback=on_progress)
    assert not result.is_error, f"the call failed: {text_of(result)}"
    s.step("checking the progress notifications the client received")
    assert await async_wait_until(lambda: len(seen) >= s.upstream.progress_steps, 5.0), \
        f"expected {s.upstream.progress_steps} progress notifications, the client got {seen}"
    assert seen == sorted(seen), f"progress went backwards: {seen}"


LIST_CHANGED = (types.ToolListChangedNotification, types.PromptListChangedNotification,
                types.ResourceListChangedNotification, types.ResourceUpdatedNotification)


def _subscription_id(notice) -> object:
    params = notice.model_dump(by_alias=True, mode="json").get("params") or {}
    return (params.get("_meta") or {}).get("io.modelcontextprotocol/subscriptionId")


def _announced(s: Session, kind: str, since: int, events: list) -> int:
    """How many announcements of a ``kind`` list change the client has had since notice ``since``: events on its
    listen stream for a modern client, bare notifications for a handshake-era one."""
    if s.modern:
        event_type = ToolsListChanged if kind == "tools" else ResourcesListChanged
        return sum(isinstance(e, event_type) for e in events)
    wanted = types.ToolListChangedNotification if kind == "tools" else types.ResourceListChangedNotification
    return sum(isinstance(n, wanted) for n in s.notices[since:])


def assert_no_bare_change_notifications(s: Session) -> None:
    """2026-07-28 delivers change notifications only on subscriptions/listen streams, tagged with the stream."""
    if not s.modern:
        return
    bare = [n.method for n in s.notices if isinstance(n, LIST_CHANGED) and _subscription_id(n) is None]
    assert not bare, (f"a 2026-07-28 client was sent change notifications outside any subscriptions/listen "
                      f"stream (no io.modelcontextprotocol/subscriptionId): {bare}")


async def _listed(s: Session, kind: str) -> list[str]:
    if kind == "tools":
        return [tool.name for tool in (await s.client.list_tools()).tools]
    return [str(resource.uri) for resource in (await s.client.list_resources()).resources]


async def _wait_for_listed_change(s: Session, change: ListChange, events: list, since: int) -> None:
    """Wait for an announcement, then list; repeat on each new announcement until the item is listed."""
    expected = s.target.name(change.item) if change.kind == "tools" else change.item
    deadline = time.monotonic() + EVENT_TIMEOUT
    handled = 0
    listed: list[str] = []
    while time.monotonic() < deadline:
        s.step(f"waiting for the client to be told the {change.kind} list changed")
        if not await async_wait_until(lambda: _announced(s, change.kind, since, events) > handled,
                                max(0.0, deadline - time.monotonic())):
            break
        handled = _announced(s, change.kind, since, events)
        s.step(f"listing {change.kind} after the announcement")
        listed = await _listed(s, change.kind)
        if expected in listed:
            return
    if handled == 0:
        how = "on its subscriptions/listen stream" if s.modern else "as notifications/" + change.kind + "/list_changed"
        raise AssertionError(f"no {change.kind} list change reached the client {how} within {EVENT_TIMEOUT:g} s")
    raise AssertionError(f"the client was told the {change.kind} list changed, but {expected!r} is not listed: "
                         f"{sorted(listed)}")


async def scenario_list_change(s: Session) -> None:
    change = s.upstream.make_list_change("late_" + uuid.uuid4().hex[:8])
    s.step(f"listing {change.kind} before the change")
    await _listed(s, change.kind)
    since = len(s.notices)
    events: list = []
    if not s.modern:
        result = await s.call(change.call)
        assert not result.is_error, f"the call failed: {text_of(result)}"
        await _wait_for_listed_change(s, change, events, since)
        return
    s.step("opening a subscriptions/listen stream")
    async with s.client.listen(tools_list_changed=change.kind == "tools",
                               resources_list_changed=change.kind == "resources") as subscription:
        honored = subscription.honored.tools_list_changed if change.kind == "tools" \
            else subscription.honored.resources_list_changed
        assert honored, f"the listen acknowledgement did not honour {change.kind} changes: {subscription.honored}"

        async def collect():
            async for event in subscription:
                events.append(event)

        async with anyio.create_task_group() as group:
            group.start_soon(collect)
            result = await s.call(change.call)
            assert not result.is_error, f"the call failed: {text_of(result)}"
            await _wait_for_listed_change(s, change, events, since)
            group.cancel_scope.cancel()
    assert_no_bare_change_notifications(s)


async def scenario_cancellation(s: Session) -> None:
    seen: list[float] = []
    outcome: dict = {}

    async def on_progress(progress, total, message):
        seen.append(progress)

    async with anyio.create_task_group() as group:
        scope = anyio.CancelScope()

        async def slow_call():
            name = s.target.name(s.upstream.slow.tool)
            with scope:
                try:
                    outcome["result"] = await s.client.call_tool(name, s.upstream.slow.arguments,
                                                                 progress_callback=on_progress)
                except Exception as exc:  # noqa: BLE001 - say which call broke, not only what the test awaited
                    raise AssertionError(f"the slow call {name} failed before it could be cancelled: "
                                         f"{_describe(exc)}") from exc

        group.start_soon(slow_call)
        s.step("waiting for the slow call to be running upstream (its first progress or start marker)")
        started = await async_wait_until(lambda: bool(seen) or s.target.marker("slow-started"))
        assert started, "the slow call never started upstream: no progress reached the client and no start marker"
        s.step("cancelling the slow call")
        scope.cancel()
    assert "result" not in outcome, f"the cancelled call still completed: {outcome['result']}"
    if s.upstream.leaves_markers:
        s.step("waiting for the upstream to notice the cancellation")
        assert await async_wait_until(lambda: s.target.marker("slow-cancelled")), \
            "the upstream's slow tool was never cancelled (no slow-cancelled marker): notifications/cancelled " \
            "did not reach it"
        assert not s.target.marker("slow-finished")
    if s.target.via_coffer:
        s.step("waiting for `coffer log` to show the cancellation")
        exposed = s.target.name(s.upstream.slow.tool)

        def logged() -> bool:
            rows = json.loads(cli("log", "--json").stdout)["invocations"]
            return any(r["capability"] == exposed and r["status"] == "cancelled" for r in rows)

        assert await async_wait_until(logged, 10.0), f"`coffer log` has no cancelled row for {exposed}"
    s.step("calling again after the cancellation")
    result = await s.call(s.upstream.echo)
    assert s.upstream.echo_text in text_of(result), "the session did not survive the cancellation"


def scenario_mid_call(need: str):
    async def scenario(s: Session) -> None:
        call, expected = s.upstream.mid_call[need]
        result = await s.call(call)
        assert not result.is_error, f"the tool reported an error: {text_of(result)}"
        assert expected in text_of(result), f"expected {expected!r} in the result, got {text_of(result)!r}"
    scenario.__name__ = f"scenario_{need}"
    return scenario


async def scenario_array_structured_content(s: Session) -> None:
    result = await s.call(Call("primes", {"n": 5}))
    assert not result.is_error, f"the tool reported an error: {text_of(result)}"
    primes = [2, 3, 5, 7, 11]
    if s.modern:
        assert result.structured_content == primes, f"structuredContent changed: {result.structured_content}"
    else:
        # 2025-11-25 allows only an object here; the SDK client would reject anything else before this line.
        assert isinstance(result.structured_content, dict), result.structured_content
        assert primes in list(result.structured_content.values()), \
            f"the array should be wrapped in an object, got {result.structured_content}"
    assert str(primes) in text_of(result)


# ----------------------------------------------------------------------------------------------- through Coffer

matrix = pytest.mark.parametrize("mode", MODES)
upstreams = pytest.mark.parametrize("upstream_key", UPSTREAM_PARAMS)


@matrix
@upstreams
def test_upstream_tools_are_listed_and_callable(through_coffer, upstream_key, mode):
    upstream = UPSTREAMS[upstream_key]
    run_case(through_coffer(upstream), upstream, mode, scenario_listing)


@matrix
@upstreams
def test_a_call_reports_progress(through_coffer, upstream_key, mode):
    upstream = UPSTREAMS[upstream_key]
    run_case(through_coffer(upstream), upstream, mode, scenario_progress)


@matrix
@upstreams
def test_a_list_change_reaches_the_client(through_coffer, upstream_key, mode):
    upstream = UPSTREAMS[upstream_key]
    run_case(through_coffer(upstream), upstream, mode, scenario_list_change)


@matrix
@upstreams
def test_cancelling_a_call_stops_it_upstream(through_coffer, upstream_key, mode):
    upstream = UPSTREAMS[upstream_key]
    run_case(through_coffer(upstream), upstream, mode, scenario_cancellation)


@matrix
@upstreams
@pytest.mark.parametrize("need", ["sampling", "elicitation", "roots"])
def test_a_tool_that_needs_the_client_mid_call(through_coffer, upstream_key, mode, need):
    upstream = UPSTREAMS[upstream_key]
    run_case(through_coffer(upstream), upstream, mode, scenario_mid_call(need))


@matrix
def test_array_structured_content_is_valid_in_every_era(through_coffer, mode):
    upstream = UPSTREAMS["only"]
    run_case(through_coffer(upstream), upstream, mode, scenario_array_structured_content)


# ----------------------------------------------------------------------------------------------- direct path

DIRECT_SCENARIOS = [scenario_listing, scenario_progress, scenario_list_change, scenario_cancellation,
                    scenario_mid_call("sampling"), scenario_mid_call("elicitation"), scenario_mid_call("roots")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("upstream_key", ["dual", "only"])
def test_direct_to_the_fixture(tmp_path, upstream_key, mode):
    """The SDK client straight to each fixture, every scenario in one session: proves fixtures and scenarios."""
    upstream = UPSTREAMS[upstream_key]
    target = direct(upstream, tmp_path)
    if upstream_key == "only" and mode == "legacy":
        async def handshake():
            with anyio.fail_after(CASE_TIMEOUT):
                with open(target.stderr_path, "a", encoding="utf-8") as errlog:
                    async with Client(stdio_client(target.params, errlog=errlog), mode="legacy"):
                        pass

        with pytest.raises(Exception) as caught:
            anyio.run(handshake)
        error = _leaf(caught.value)
        assert isinstance(error, MCPError) and error.code == -32022, _describe(error)
        assert error.data["supported"] == [MODERN] and error.data["requested"] in HANDSHAKE_PROTOCOL_VERSIONS
        return

    async def everything(s: Session) -> None:
        for scenario in DIRECT_SCENARIOS:
            await scenario(s)
        if upstream_key == "only":
            await scenario_array_structured_content(s)

    run_case(target, upstream, mode, everything)


# -- the bridge, in-process --------------------------------------------------------------------------------------------

class _AsksAtOnce:
    """An upstream that asks the client for a sampling the instant it reads a call, before the gateway's
    send has even returned: the ordering a fast server and a busy gateway thread produce."""

    name, generation = "asker", 1

    def __init__(self):
        self.gateway = None
        self.answers = []

    def request(self, method, params, on_reply, timeout=None, ticket=None, **_):
        self.gateway.on_request(self, {"jsonrpc": "2.0", "id": 7, "method": "sampling/createMessage",
                                       "params": {"messages": [], "maxTokens": 5}})
        return ticket

    def hold(self, ticket):
        pass

    def respond(self, message):
        self.answers.append(message)


def test_a_question_asked_the_instant_a_call_arrives_reaches_a_2026_client(home):
    out = io.BytesIO()
    hub = Hub(Vault(str(home)))
    session = ClientSession(hub, out=out)
    session.client_era = "modern"
    upstream = _AsksAtOnce()
    upstream.gateway = hub
    params = {"name": "ask", "arguments": {},
              "_meta": {META_CLIENT_CAPABILITIES: {"sampling": {}}}}
    session.calls.forward(41, upstream, "tools/call", dict(params), "asker__ask", "tool", time.monotonic(), params)
    session.stream.flush()
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    # Not parked as an orphan waiting for some later call (the upstream would time out after 60 s):
    # the call itself answers input_required with the upstream's question.
    assert [r.get("id") for r in replies] == [41], replies
    result = replies[0]["result"]
    assert result["resultType"] == "input_required"
    assert [q["method"] for q in result["inputRequests"].values()] == ["sampling/createMessage"]
    assert upstream.answers == []  # nothing refused on the client's behalf


def test_a_modern_client_finds_the_missing_resource_uri_where_the_specification_puts_it():
    """A handshake-era upstream's -32002 "resource not found" reaches a 2026-07-28 client as -32602; the uri the
    upstream named stays in data.uri (not buried under another key), and a non-object data is kept too."""
    uri = "file:///gone.txt"
    mapped = modern_error({"jsonrpc": "2.0", "id": 4, "error": {"code": -32002, "message": "Resource not found",
                                                                "data": {"uri": uri}}})
    assert mapped["error"]["code"] == -32602 and mapped["error"]["data"]["uri"] == uri, mapped
    assert mapped["error"]["data"]["coffer"] == "resource_not_found"
    plain = modern_error({"jsonrpc": "2.0", "id": 5, "error": {"code": -32001, "message": "timed out", "data": "30s"}})
    assert plain["error"]["data"] == {"coffer": "upstream_timeout", "detail": "30s"}, plain
