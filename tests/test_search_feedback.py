"""A ranker that learns from its user (issue 27): with `coffer config search_feedback on`, each coffer__search_tools
query (secrets redacted), what it returned, and the tool the same session then called are kept in the vault, under
the invocation log's retention; `coffer eval` scores the current ranker on them.  Off by default."""

import json
import os
import sqlite3
import subprocess
import uuid
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from coffer_src.vault import Vault, utcnow
from coffer_src.vault_schema import SCHEMA

from conftest import COFFER, FAKE, PY, ROOT, TIME_SERVER, cli


def feedback_rows(home):
    db = sqlite3.connect(Path(home) / "coffer.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in db.execute("SELECT * FROM search_feedback ORDER BY id")]
    finally:
        db.close()


def search_then_call(gw, query, tool, arguments):
    found = gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": query}})["result"]
    gw.request("tools/call", {"name": tool, "arguments": arguments})
    return [hit["name"] for hit in found["structuredContent"]["tools"]]


def test_nothing_is_recorded_until_the_user_turns_it_on(raw_gateway, home):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    gw = raw_gateway()
    gw.initialize()
    search_then_call(gw, "echo the text back", "fx__echo", {"text": "hi"})
    assert feedback_rows(home) == []
    assert "off" in cli("config", "search_feedback").stdout


def test_a_search_its_answer_and_the_tool_then_called_are_kept_with_secrets_redacted(raw_gateway, home):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    cli("config", "search_feedback", "on")
    secret = "sk-" + uuid.uuid4().hex
    subprocess.run([PY, COFFER, "secret", "set", "MY_TOKEN"], input=secret, text=True, check=True,
                   capture_output=True)
    gw = raw_gateway()
    gw.initialize()
    returned = search_then_call(gw, f"echo this back with token {secret}", "fx__echo", {"text": "hi"})
    gw.request("tools/call", {"name": "fx__echo", "arguments": {"text": "again"}})     # labels nothing more
    search_then_call(gw, "a slow call please", "fx__crash", {})                         # the agent chose otherwise
    rows = feedback_rows(home)
    assert [(row["chosen"], json.loads(row["returned"])[:1]) for row in rows] == [
        ("fx__echo", returned[:1]), ("fx__crash", ["fx__slow"])]
    assert secret not in rows[0]["query"] and "***" in rows[0]["query"]
    assert rows[0]["ranker"] == "bm25" and rows[0]["client"]
    database = b"".join(p.read_bytes() for p in Path(home).glob("coffer.db*"))
    assert secret.encode() not in database


def test_coffer_eval_scores_the_current_ranker_on_the_labelled_searches(raw_gateway, home):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    cli("config", "search_feedback", "on")
    gw = raw_gateway()
    gw.initialize()
    search_then_call(gw, "echo the text back", "fx__echo", {"text": "hi"})
    search_then_call(gw, "which tool fails on purpose", "fx__crash", {})
    gw.request("tools/call", {"name": "coffer__search_tools", "arguments": {"query": "unlabelled"}})
    gw.close()
    report = json.loads(cli("eval", "--json").stdout)
    assert (report["searches"], report["labelled"], report["scored"], report["skipped"]) == (3, 2, 2, 0)
    lexical = report["rankers"]["lexical"]
    assert lexical["recall@1"] >= 0.5 and set(lexical) == {"recall@1", "recall@5", "mrr@10", "missed"}
    assert all(miss["chosen"] == "fx__crash" for miss in lexical["missed"])
    assert "hybrid" not in report["rankers"]                                 # no embedder configured
    text = cli("eval").stdout
    assert "2 labelled searches" in text and "RECALL@5" in text
    # the same for a developer, beside the comparators: python -m evals.run --vault
    dev = subprocess.run([PY, "-m", "evals.run", "--vault", str(home), "--rankers", "coffer,coffer+preference,bm25f",
                          "--json", "-"], cwd=ROOT, capture_output=True, text=True, check=True)
    [entry] = json.loads(dev.stdout)["sets"]
    assert entry["set"] == "vault" and entry["n_queries"] == 2
    assert entry["rankers"]["coffer"]["overall"]["recall@5"] == lexical["recall@5"]
    replayed = report["rankers"]["lexical+preference"]
    assert entry["rankers"]["coffer+preference"]["overall"]["recall@1"] == replayed["recall@1"]
    assert entry["rankers"]["coffer+preference"]["overall"]["mrr@10"] == replayed["mrr@10"]


def test_coffer_eval_with_nothing_recorded_says_how_to_turn_it_on(home):
    out = cli("eval").stdout
    assert "coffer config search_feedback on" in out and "stays on this machine" in out


def test_an_older_vault_gains_the_feedback_table_and_keeps_it_under_the_logs_retention(home):
    Path(home).mkdir(parents=True, exist_ok=True)
    old = sqlite3.connect(Path(home) / "coffer.db")
    old.executescript(SCHEMA.split("CREATE TABLE IF NOT EXISTS search_feedback")[0])
    old.close()
    vault = Vault(home)
    with vault.transaction() as db:
        db.executemany("INSERT INTO search_feedback(key, ts, query, ranker, returned) VALUES (?, ?, 'q', 'bm25', '[]')",
                       [("old", "2020-01-01T00:00:00.000Z"), ("new", utcnow())])
    vault.prune()
    assert [row["key"] for row in vault.db.execute("SELECT key FROM search_feedback")] == ["new"]
    vault.close()


def test_a_real_sdk_client_searches_calls_and_then_coffer_eval_scores_it(home):
    cli("add", "time", "--", *TIME_SERVER)
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    cli("config", "search_feedback", "on")
    plan = [("what time is it in Tokyo", "time__get_current_time", {"timezone": "Asia/Tokyo"}),
            ("convert 09:30 from Chicago to Paris time", "time__convert_time",
             {"source_timezone": "America/Chicago", "time": "09:30", "target_timezone": "Europe/Paris"}),
            ("say hello back to me", "fx__echo", {"text": "hello"})]

    async def main():
        server = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
        async with Client(server, client_info=types.Implementation(name="feedback-agent", version="1")) as client:
            for query, tool, arguments in plan:
                found = await client.call_tool("coffer__search_tools", {"query": query})
                assert not found.is_error
                called = await client.call_tool(tool, arguments)
                assert not called.is_error

    anyio.run(main)
    rows = feedback_rows(home)
    assert [row["chosen"] for row in rows] == [tool for _, tool, _ in plan]
    assert all(row["client"] == "feedback-agent" for row in rows)
    report = json.loads(cli("eval", "--json").stdout)
    assert report["scored"] == 3 and report["rankers"]["lexical"]["recall@5"] == 1.0
    assert report["rankers"]["then"]["recall@5"] == 1.0


@pytest.mark.parametrize("value", ["maybe", "1"])
def test_search_feedback_is_on_or_off(home, value):
    result = cli("config", "search_feedback", value, check=False)
    assert result.returncode != 0 and "on or off" in result.stderr


class EmbeddingsStub:
    """An OpenAI-compatible /embeddings endpoint answering bag-of-words vectors (enough to rank by)."""

    def __init__(self):
        import hashlib
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        def vector(text):
            out = [0.0] * 32
            for word in text.lower().split():
                out[int(hashlib.md5(word.encode()).hexdigest(), 16) % 32] += 1.0
            return out

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                payload = json.dumps({"data": [{"index": i, "embedding": vector(t)}
                                               for i, t in enumerate(body["input"])]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_coffer_eval_puts_hybrid_beside_lexical_and_says_when_the_embedder_is_down(raw_gateway, home):
    cli("add", "fx", "--", *FAKE, "--tools", "echo,slow,crash")
    cli("config", "search_feedback", "on")
    gw = raw_gateway()
    gw.initialize()
    search_then_call(gw, "echo the text back", "fx__echo", {"text": "hi"})
    gw.close()
    stub = EmbeddingsStub()
    try:
        cli("config", "embedder_url", stub.url)
        report = json.loads(cli("eval", "--json").stdout)
        assert set(report["rankers"]) == {"lexical", "lexical+preference", "hybrid", "hybrid+preference", "then"}
        assert report["rankers"]["hybrid"]["recall@5"] == 1
    finally:
        stub.server.shutdown()
    cli("config", "embedder_url", "http://127.0.0.1:9/v1")                # nothing listens there
    report = json.loads(cli("eval", "--json").stdout)
    assert "hybrid" not in report["rankers"] and "hybrid+preference" not in report["rankers"]
    assert "unavailable" in report["note"]
