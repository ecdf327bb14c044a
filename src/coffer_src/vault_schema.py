"""Vault schema: every table of coffer.db, whoever writes it; migrations and repairs.

The tables are created by their owners (a Vault the servers, choices, settings and logs; a KnowledgeBase its
index; the caches theirs); `coffer doctor` checks each part and says how to repair a damaged one.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# -- the schema: every table Coffer keeps in coffer.db, whoever writes it --------------------------------------


def change_triggers(table: str, events: tuple[str, ...] = ("INSERT", "UPDATE", "DELETE")) -> str:
    """Triggers bumping config_changes.generation on each of ``events`` on ``table``: a running gateway re-reads
    what it serves from when the generation moves, not on every commit (its own logs commit several times a
    second).  Triggers live in coffer.db, so every writer fires them, an older Coffer or a sqlite3 shell too."""
    return "".join(f"CREATE TRIGGER IF NOT EXISTS {table}_{event.lower()}_changes AFTER {event} ON {table} "
                   "BEGIN UPDATE config_changes SET generation = generation + 1; END;\n" for event in events)


SERVERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS servers (
    name TEXT PRIMARY KEY,
    transport TEXT NOT NULL,                 -- 'stdio'; remote: 'http', 'sse', or 'auto' (not yet detected)
    command TEXT,                            -- JSON argv, unexpanded
    url TEXT,
    env TEXT NOT NULL DEFAULT '{}',          -- JSON, unexpanded: ${VAR} references, literal values never
    headers TEXT NOT NULL DEFAULT '{}',      -- JSON, unexpanded, like env
    cwd TEXT,
    enabled INTEGER NOT NULL DEFAULT 1,
    policy TEXT NOT NULL DEFAULT 'enabled',  -- what a capability seen for the first time gets
    timeout REAL,                            -- per-call timeout in seconds; NULL = the global default
    position INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    status TEXT, status_detail TEXT, status_at TEXT,
    capabilities TEXT,                       -- JSON: what the server advertised at its last initialize
    inherit_env TEXT NOT NULL DEFAULT '[]',  -- JSON: names of Coffer's environment variables it also gets
    updates TEXT NOT NULL DEFAULT 'pin',     -- 'pin': a changed definition waits for `coffer approve`; 'trust'
    oauth TEXT,                              -- JSON: OAuth client settings (client_id, client_secret_env, login_at);
                                             -- names and a time only: tokens live in the secret store
    era TEXT,                                -- 'handshake' or 'modern' (MCP 2026-07-28) at its last start; NULL: probe
    sharing TEXT NOT NULL DEFAULT 'shared',  -- the service runs one instance for every client, or 'per-client'
    sharing_reason TEXT                      -- why it runs per client: the user's choice, or what Coffer saw
);
CREATE TABLE IF NOT EXISTS capabilities (
    server TEXT NOT NULL,
    kind TEXT NOT NULL,                      -- tool, prompt, resource, template
    name TEXT NOT NULL,                      -- the upstream's own name or URI
    enabled INTEGER NOT NULL,
    present INTEGER NOT NULL DEFAULT 1,      -- 0 once the upstream stops listing it; the choice is kept
    fingerprint TEXT,                        -- of the definition the upstream lists now
    definition TEXT,                         -- last advertised definition (schemas, never call data)
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    approved TEXT,                           -- fingerprint the user accepted; differs from fingerprint = quarantined
    approved_definition TEXT,                -- that definition, for the diff `coffer approve` shows
    PRIMARY KEY (server, kind, name)
);
CREATE TABLE IF NOT EXISTS profiles (        -- what one kind of agent sees (profiles.py): `coffer profile`
    name TEXT PRIMARY KEY,
    definition TEXT NOT NULL,                -- JSON: include, exclude, expose, pin, knowledge
    created_at TEXT NOT NULL, updated_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS overrides (       -- a tool renamed, redescribed, annotated or given fixed arguments
    profile TEXT NOT NULL DEFAULT '',        -- '' for every client, else the profile it applies in
    server TEXT NOT NULL,
    tool TEXT NOT NULL,                      -- the upstream's own name: an override survives renames of the prefix
    override TEXT NOT NULL,                  -- JSON: name, description, annotations, fixed
    updated_at TEXT NOT NULL,
    PRIMARY KEY (profile, server, tool)
);
CREATE TABLE IF NOT EXISTS config_changes (  -- one row: bumped by the triggers below, read by a running gateway
    one INTEGER PRIMARY KEY CHECK (one = 1), generation INTEGER NOT NULL);
INSERT OR IGNORE INTO config_changes VALUES (1, 0);
""" + "".join(change_triggers(table) for table in ("settings", "servers", "capabilities", "profiles", "overrides"))
LOGS_SCHEMA = """
CREATE TABLE IF NOT EXISTS invocations (
    id INTEGER PRIMARY KEY,
    ts TEXT NOT NULL, client TEXT, server TEXT, capability TEXT, kind TEXT,
    duration_ms REAL, status TEXT NOT NULL, error TEXT,
    profile TEXT                             -- the profile the client's session used (NULL: none)
);
CREATE INDEX IF NOT EXISTS invocations_ts ON invocations(ts);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    ts TEXT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT, detail TEXT
);
CREATE INDEX IF NOT EXISTS audit_ts ON audit(ts);
CREATE TABLE IF NOT EXISTS search_feedback (  -- only while `coffer config search_feedback on` (search/feedback.py)
    id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, ts TEXT NOT NULL, client TEXT,
    query TEXT NOT NULL, ranker TEXT NOT NULL,   -- the query as searched, secrets redacted; 'hybrid' or 'bm25'
    returned TEXT NOT NULL,                      -- JSON: the tool names returned, best first
    chosen TEXT, chosen_ts TEXT                  -- the first tool the same session called after it, and when
);
CREATE INDEX IF NOT EXISTS search_feedback_ts ON search_feedback(ts);
""" + change_triggers("audit", ("INSERT",))  # a change outside coffer.db (a secret) is audited: a gateway re-resolves
SCHEMA = SERVERS_SCHEMA + LOGS_SCHEMA  # what every Vault creates on open
SCHEMA_TRIGGERS = frozenset(re.findall(r"CREATE TRIGGER IF NOT EXISTS (\w+)", SCHEMA))
# The knowledge base (knowledge/base.py) keeps its sources, files and passages here, its embedding cache too.
KNOWLEDGE_SOURCES_SCHEMA = """
CREATE TABLE IF NOT EXISTS knowledge_sources (
    name TEXT PRIMARY KEY,
    root TEXT NOT NULL,                      -- absolute path as the user gave it (memory: COFFER_HOME/memory)
    globs TEXT NOT NULL,                     -- JSON list of glob patterns, relative to root
    kind TEXT NOT NULL DEFAULT 'folder',     -- 'folder' or 'memory'
    created_at TEXT NOT NULL,
    indexed_at TEXT,
    last_stats TEXT                          -- JSON of the last ReindexStats (counts only, never text)
);
"""
KNOWLEDGE_INDEX_SCHEMA = """
CREATE TABLE IF NOT EXISTS knowledge_files (
    id INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    path TEXT NOT NULL,                      -- relative to the source root, '/'-separated
    mtime_ns INTEGER NOT NULL, size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,                    -- '' when never read (over the size bound)
    skipped TEXT,                            -- why it has no passages (binary, too large, unreadable), or NULL
    indexed_at TEXT NOT NULL,
    UNIQUE (source, path)
);
CREATE TABLE IF NOT EXISTS knowledge_passages (
    id INTEGER PRIMARY KEY,
    file_id INTEGER NOT NULL,
    source TEXT NOT NULL, path TEXT NOT NULL,
    heading TEXT NOT NULL,                   -- heading path, 'Title > Section > Subsection'
    first_line INTEGER NOT NULL, last_line INTEGER NOT NULL,
    text TEXT NOT NULL,
    heading_terms TEXT NOT NULL, body_terms TEXT NOT NULL, path_terms TEXT NOT NULL  -- analysed, space-joined
);
CREATE INDEX IF NOT EXISTS knowledge_passages_file ON knowledge_passages(file_id);
CREATE INDEX IF NOT EXISTS knowledge_passages_source ON knowledge_passages(source);
CREATE TABLE IF NOT EXISTS knowledge_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO knowledge_meta(key, value) VALUES ('generation', 0), ('fts_synced', 1);
"""
KNOWLEDGE_SCHEMA = KNOWLEDGE_SOURCES_SCHEMA + KNOWLEDGE_INDEX_SCHEMA  # what a KnowledgeBase creates on open
# The FTS5 table holds Coffer's analysed terms, not the raw text: FTS5's own tokenizer then only splits on the
# spaces, and both ranking paths agree on what a term is.  rowid = knowledge_passages.id.
KNOWLEDGE_FTS_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts USING fts5(
    heading, body, path, source UNINDEXED, tokenize = 'unicode61 remove_diacritics 0');
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts_vocab USING fts5vocab(knowledge_fts, 'row');
CREATE VIRTUAL TABLE IF NOT EXISTS knowledge_fts_columns USING fts5vocab(knowledge_fts, 'col');
"""
# Vectors of tool descriptions and passages, by embedding model and text (search/semantic.py, knowledge).
EMBEDDING_SCHEMA = """
CREATE TABLE IF NOT EXISTS embeddings (
    model TEXT NOT NULL, text_hash TEXT NOT NULL, dim INTEGER NOT NULL, vector BLOB NOT NULL, created_at TEXT,
    PRIMARY KEY (model, text_hash)
);
"""
CLIENT_TOKENS_SCHEMA = """
CREATE TABLE IF NOT EXISTS client_tokens (   -- HTTP clients: HMAC-SHA256(salt, token), never the token itself
    name TEXT PRIMARY KEY, salt TEXT NOT NULL, digest TEXT NOT NULL, created TEXT NOT NULL, last_used TEXT);
"""
# Columns added after the first release: (table, column, declaration).  A vault written by an earlier Coffer gains
# them on open; an approved fingerprint of NULL means "accept what is listed next" (no quarantine on upgrade).
MIGRATIONS = (
    ("servers", "capabilities", "TEXT"),
    ("servers", "inherit_env", "TEXT NOT NULL DEFAULT '[]'"),
    ("servers", "updates", "TEXT NOT NULL DEFAULT 'pin'"),
    ("servers", "oauth", "TEXT"),
    ("servers", "era", "TEXT"),
    ("servers", "sharing", "TEXT NOT NULL DEFAULT 'shared'"),
    ("servers", "sharing_reason", "TEXT"),
    ("capabilities", "approved", "TEXT"),
    ("capabilities", "approved_definition", "TEXT"),
    ("invocations", "profile", "TEXT"),
)


class SchemaPart(NamedTuple):
    """One part of coffer.db's schema, as `coffer doctor` checks it and says how to repair it."""
    name: str           # what a user calls it
    script: str         # its CREATE statements
    optional: bool      # absent until first used: missing entirely is not a problem
    repair: str         # the fix for a damaged one ({path}: coffer.db; {drop}: a command that drops ``drops``)
    drops: str = ""     # the schema whose tables the repair drops (a derived index goes with its source tables)


_KNOWLEDGE_REBUILD = "drop the index, then rebuild it from your folders with coffer knowledge reindex: {drop}"
SCHEMA_PARTS = (
    SchemaPart("the servers, choices and settings", SERVERS_SCHEMA, False,
               "restore {path} from a backup, or move it away and register your servers again (coffer import)"),
    SchemaPart("the invocation and audit logs", LOGS_SCHEMA, False,
               "drop the damaged logs (the next coffer command creates them again, empty): {drop}", LOGS_SCHEMA),
    SchemaPart("the knowledge sources", KNOWLEDGE_SOURCES_SCHEMA, True,
               "restore {path} from a backup, or drop the knowledge tables and add your folders again (coffer "
               "knowledge add PATH): {drop}", KNOWLEDGE_SCHEMA + KNOWLEDGE_FTS_SCHEMA),
    SchemaPart("the knowledge index", KNOWLEDGE_INDEX_SCHEMA, True, _KNOWLEDGE_REBUILD,
               KNOWLEDGE_INDEX_SCHEMA + KNOWLEDGE_FTS_SCHEMA),
    SchemaPart("the knowledge full-text index", KNOWLEDGE_FTS_SCHEMA, True, _KNOWLEDGE_REBUILD,
               KNOWLEDGE_INDEX_SCHEMA + KNOWLEDGE_FTS_SCHEMA),
    SchemaPart("the embedding cache", EMBEDDING_SCHEMA, True,
               "drop the cache (vectors are computed again when needed): {drop}", EMBEDDING_SCHEMA),
    SchemaPart("the HTTP client tokens", CLIENT_TOKENS_SCHEMA, True,
               "drop them, then give each HTTP client a new one (coffer token add NAME): {drop}", CLIENT_TOKENS_SCHEMA),
)
