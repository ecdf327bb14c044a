"""Invocation log: who called what, when, how long, how it ended; never arguments.

Rows are queued by the caller (a tool call never waits on SQLite) and written in batches on the log's own
thread, to the invocations table of coffer.db (its schema is the vault's).
"""

from __future__ import annotations

import enum
import logging
import queue
import sqlite3
import threading
import time
from typing import NamedTuple

from coffer_src.errors import VaultError
from coffer_src.vault import Invocation, connect_vault_db

invocations_log = logging.getLogger(__name__)


class _FlushRequest(NamedTuple):
    """Queued by InvocationLog.flush behind the rows it waits for; ``written`` is set once they are."""
    written: threading.Event


class _LogSignal(enum.Enum):
    CLOSE = "close"  # queued by InvocationLog.close: wakes the writer, which ends once nothing is pending


class InvocationLog:
    """Writes invocation rows on its own thread, in batches, so no tool call ever waits on SQLite.

    If the vault is locked or read-only the rows are kept (up to a bound) and retried; a persistent failure is a
    warning, never a failed call.  Every text is made storable first (a client name holding a lone surrogate must
    not stop the logging of everything after it), and the thread survives any error in a batch: the batch is
    reported and dropped, the log goes on.  Its queue carries Invocation rows, _FlushRequest and _LogSignal.
    """

    FLUSH_INTERVAL = 0.2
    MAX_BUFFER = 50_000
    _INSERT = (f"INSERT INTO invocations({', '.join(Invocation._fields)}) "
               f"VALUES ({', '.join('?' * len(Invocation._fields))})")

    def __init__(self, path: str):
        self.path = path
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="coffer-log", daemon=True)
        self._thread.start()

    def record(self, client, server, capability, kind, started: float, status: str, error: str | None = None,
               profile: str | None = None):
        """Queue one row; ``profile`` is the profile the client's session uses (None: it sees everything)."""
        duration = round((time.monotonic() - started) * 1000.0, 3)
        self.queue.put(Invocation(time.time(), client, server, capability, kind, duration, status, error, profile))

    def flush(self, timeout: float = 5.0) -> None:
        """Write everything recorded so far before returning (used first thing at shutdown)."""
        request = _FlushRequest(threading.Event())
        self.queue.put(request)
        request.written.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.queue.put(_LogSignal.CLOSE)
        self._thread.join(timeout)

    def _run(self) -> None:
        db = None
        pending: list[Invocation] = []
        waiters: list[threading.Event] = []

        def take(item) -> None:
            if isinstance(item, _FlushRequest):
                waiters.append(item.written)
            elif isinstance(item, Invocation):
                pending.append(item)

        while True:
            try:
                item = self.queue.get(timeout=self.FLUSH_INTERVAL if pending else None)
                take(item)
                if isinstance(item, Invocation):
                    # Let the rest of this burst arrive: one commit per interval, not one per call.
                    self._stop.wait(self.FLUSH_INTERVAL)
                while len(pending) < 10_000:
                    take(self.queue.get_nowait())
            except queue.Empty:
                pass
            if pending:
                try:
                    if db is None:
                        db = connect_vault_db(self.path)
                    db.execute("BEGIN IMMEDIATE")
                    db.executemany(self._INSERT, [invocation.row() for invocation in pending])
                    db.execute("COMMIT")
                    pending.clear()
                except sqlite3.Error as exc:
                    self._rollback(db)
                    problem = VaultError.wrap(exc, self.path)
                    if not self._warned:
                        invocations_log.warning("invocation log not written yet (%s); will retry", problem)
                        self._warned = True
                    del pending[:-self.MAX_BUFFER]
                    if self._stop.is_set():
                        invocations_log.warning("%d invocation rows could not be written: %s", len(pending), problem)
                        break
                    time.sleep(0.5)
                except Exception:  # noqa: BLE001 - a bad row costs its batch, never the log itself
                    self._rollback(db)
                    invocations_log.exception("invocation log: dropped a batch of %d rows it could not write",
                                        len(pending))
                    pending.clear()
            if not pending:
                for waiter in waiters:
                    waiter.set()
                waiters.clear()
            if self._stop.is_set() and self.queue.empty() and not pending:
                break
        if db is not None:
            db.close()

    @staticmethod
    def _rollback(db) -> None:
        try:
            if db is not None and db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error:
            pass
