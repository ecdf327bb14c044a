"""Coffer: a local-first MCP gateway.

Register your MCP servers once; every agent (Claude Code, Codex, Cursor, Claude Desktop) runs one entry,
``coffer serve``, and sees every upstream's tools, resources and prompts, namespaced ``<server>__<tool>``.
``coffer__search_tools`` finds the right tool by intent when the catalogue is too large to read.

One module, standard library only.  It is generated from the package src/coffer_src/ by tools/amalgamate.py;
the modules below are in layer order: each uses only the standard library and the modules above it."""

__version__ = "0.1.0"
