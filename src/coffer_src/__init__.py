"""Coffer: a local-first MCP gateway.

Register your MCP servers once; every agent (Claude Code, Codex, Cursor, Claude Desktop) runs one entry,
``coffer serve``, and sees every upstream's tools, resources and prompts, namespaced ``<server>__<tool>``.
``coffer__search_tools`` finds the right tool by intent when the catalogue is too large to read.

One module, standard library only.  It is generated from the package src/coffer_src/ by tools/amalgamate.py;
the modules below are in layer order: each uses only the standard library and the modules above it.

Concurrency
-----------
Threads (all daemons), named as they show in a traceback, by who starts them:
- the main thread: `coffer serve --standalone` reads its client (ClientSession.serve); the service runs its accept
  loop (Service.run); the relay (`coffer serve` beside a service) its select loop; a CLI command its own work.
- the hub: coffer-ticker (Hub.start: request timeouts, waiting requests, idle stops, vault reloads when
  config_changes moved), coffer-work-1..4 (Hub.workers: requests that waited for discovery, searches off the
  reader, coffer__ask; the sessions take turns), coffer-log
  (InvocationLog: owns its connection), coffer-client-gone (ClientSession: a standalone shutdown).
- an upstream: coffer-<name>-start per start attempt (Upstream.start; discovery writes era, capabilities and
  server_info before the move to ready), a threading.Timer per restart (Upstream) and listen reopening
  (UpstreamLists), coffer-<name>-refresh (list passes), -close, -stop (hub, sharing, instances), -retire (Sharing);
  an EraBridge Timer retries a load-shed call.  Stdio (StdioTransport.start): -out (stdout: replies and events),
  -err, -wait (exit), -in (stdin writer).  Streamable HTTP (HttpTransport): -http-1..64 (a POST and its reply
  each), -notify-1 (notifications in order), -sse (the server's stream).  HTTP+SSE (SseTransport.start): -sse
  (the stream), -post (POSTs in order).
- search and knowledge: coffer-embedder and coffer-knowledge-embedder (EmbeddingWorker, made by SemanticRanker and
  PassageVectors: each owns its vector cache), coffer-knowledge-watcher (KnowledgeBase.start_watcher: reindexes).
- the service: coffer-connection per channel connection (Service.run: a session's reader, or one control request)
  and coffer-out-<pid> (SocketOutput: that session's writer); coffer-http-accept, coffer-http-housekeeping and
  coffer-http per connection, coffer-http-busy (HttpEndpoint); coffer-web and a thread per page request
  (WebServer.login_link, ThreadingHTTPServer).
- the CLI: coffer-oauth-callback and coffer-oauth-paste (a login), coffer-doctor-<name>, the threads of the
  upstreams a ServerProbe or GatewayClient starts; the relay's coffer-relay-client (Windows only).
Ownership: the hub's shared maps (upstreams, per_client, dormant, sessions, states, catalogue, _catalogued,
_progress) are replaced whole under their lock and read without one, from any thread; a session's records are its
lock's, an upstream's its lock's; the rest belongs to the lock named below or to the one thread that writes it.

Locks ("->": may be taken while holding it; a leaf takes no other lock of Coffer's; none is taken in reverse):
- terminal, threads: Redactor._lock: the secret values, written by add() (redact() reads them without it); a leaf.
  WorkerPool._lock: its counters; a leaf (the job queue is a SimpleQueue).
- secret store, vault, oauth: SecretStore._lock: the parsed file's cache; a leaf (file I/O outside it).  A Vault
  has no lock: its owner guards its connection (Hub.vault_lock, ServerProbe.vault_lock, WebViews.lock, the CLI's
  one thread).  OAuthCredentials._lock: read, refresh and write back one saved login, held across the token
  request on purpose -> SecretStore._lock, Redactor._lock.  LoopbackReceiver._lock: the first answer; a leaf.
- transports: StdioTransport._send_lock (what goes to stdin, in order; a write under it never blocks) and
  _close_lock (close and on_close once): leaves.  HttpTransport._lock (open/closed, open streams, the last
  notification) -> its pools' WorkerPool._lock.  SseTransport._lock (open/closed, send against close): a leaf.
- upstream: Upstream.lock (an RLock: request starts an idle server): state, transport, the request table, Tickets,
  the lists' bookkeeping; a leaf, never held while calling out.  TokenBucket._lock: a leaf.
- search: CollectorPause._lock (a class attribute): the collector's pause depth; a leaf.  SemanticRanker.lock: the
  tools to embed and the published index; a leaf, no embedder request or database access under it.
  FeedbackRecorder._lock: its connection and each session's last search; a leaf (a write waits BUSY_TIMEOUT_MS
  at most; its listeners are called after it is released).  _RECORDERS_LOCK: one recorder per coffer.db; a leaf.
  _PREFERENCES_LOCK (one SearchPreference per coffer.db, loaded under it from SQLite) -> SearchPreference._lock
  (its learnt searches; a leaf).
- catalogue: Catalogue._index_lock: the first search builds the index, once, holding it -> CollectorPause._lock;
  taken with no other lock held.  ProfileCatalogue._index_lock (gateway/view.py) follows the same rule.
- knowledge: KnowledgeBase._write_lock: the writer connection, one write transaction at a time (SQLite's write
  lock inside); no lock of Coffer's under it.  PassageRanker._snapshot_lock: one snapshot build ->
  KnowledgeBase._readers_lock (the reader connections; a leaf).  PassageVectors._embed_lock: one embedding round
  at a time, held across embedder requests and cache writes -> Redactor._lock.
- gateway: Hub._rebuild_lock: one catalogue build; sessions hear of it while it is held -> Hub.lock,
  SemanticRanker.lock, a session's lock, a client stream's lock.  ClientSession.lock (an RLock): what it waits on,
  relayed requests, calls in flight, the bridge's records -> Hub.lock (progress tokens); never held while sending
  or calling an upstream.  Hub.lock (an RLock): the shared maps' writers, the rebuild counters; a leaf.
  Hub.vault_lock: the hub's vault connection and the writers of states, held across vault writes (which may wait
  for SQLite's busy timeout) -> Views.lock (the profiles and overrides, reloaded under it; a leaf).
  ClientStream.out_lock: the held replies and the write to the client; a leaf, held across that write on purpose
  (back-pressure; a list_changed writes it under _rebuild_lock too).
- service: HttpClient.dispatching (one message handed to the session at a time, never held while an answer is
  awaited) is the outermost lock: -> whatever the session's handling takes.  HttpEndpoint.lock (sessions,
  connections) -> HttpClient.lock.  HttpClient.lock (each Exchange.cond wraps it): routing records, exchanges; a
  leaf.  Service.lock (connections, sessions, endpoints, handover), SocketOutput.lock (and its wake condition:
  the queue; its direct send does not wait where MSG_DONTWAIT exists), TokenStore.lock (its connection, held
  across its writes), WebAccess.lock, WebServer.lock, WebViews.lock (the page's vault connection, the catalogue
  snapshot), ActivityLog.lock, the relay's _out_lock (the client's stdout): leaves.  StartLock: a file lock
  across processes, so that simultaneous first starts make one service.
- CLI: ServerProbe.done (a condition: what settled) -> ServerProbe.vault_lock (its vault connection; a leaf).
Events are signals, not locks: Hub._stopping and _stopped, EmbeddingWorker's wake and stopping, KnowledgeBase's
_closed, the remote transports' _stopped and _delivered, InvocationLog's flush requests, replies' done events."""

__version__ = "0.1.0"
