"""coffer__ask over notes in another language than the question (issue 27): the client's model is asked for
search queries in the notes' language, and shown headings of the notes to tell which that is.  The official SDK
client talks to ``coffer serve``; its model (sampling) is a callback that answers as a model would."""

import json
import os
import uuid

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import COFFER, PY, cli


@pytest.mark.parametrize("mode", ["auto", "legacy"])   # a 2026-07-28 client (input_required) and a handshake-era one
def test_the_rewrite_asks_for_queries_in_the_language_of_the_notes(home, tmp_path, mode):
    marker = "MRK" + uuid.uuid4().hex[:10]
    notes = tmp_path / "notizen"
    notes.mkdir()
    (notes / "buero.md").write_text(f"# Büro\n\n## Gastnetz\n\nDas Passwort für das Gastnetz lautet {marker}.\n\n"
                                    "## Drucker\n\nDer Drucker steht im zweiten Stock.\n", encoding="utf-8")
    cli("knowledge", "add", str(notes))
    prompts = []

    async def model(ctx, params):
        prompt = params.messages[0].content.text
        prompts.append(prompt)
        if "search queries" in prompt:   # a model that follows the instruction answers in German
            text = "Gastnetz Passwort" if "Gastnetz" in prompt or "Drucker" in prompt else "guest wifi password"
        else:
            text = "See [1]."
        return types.CreateMessageResult(role="assistant", model="test-model",
                                         content=types.TextContent(type="text", text=text))

    async def main():
        server = StdioServerParameters(command=PY, args=[COFFER, "serve"], env=dict(os.environ))
        async with Client(server, client_info=types.Implementation(name="ask-agent", version="1"),
                          sampling_callback=model, mode=mode) as client:
            result = await client.call_tool("coffer__ask", {"question": "what is the guest wifi password?"})
            return result.structured_content or json.loads(result.content[0].text)

    answer = anyio.run(main)
    rewrite = prompts[0]
    assert "language the notes are written in" in rewrite and ("Gastnetz" in rewrite or "Drucker" in rewrite)
    assert marker in answer["passages"][0]["text"]
