"""Threads: named daemon threads that never die silently, and a small worker pool."""

from __future__ import annotations

import logging
import queue
import threading

threads_log = logging.getLogger(__name__)


def start_thread(target, name: str, *args) -> threading.Thread:
    """A daemon thread whose unexpected death is logged with its traceback instead of vanishing."""
    def run():
        try:
            target(*args)
        except Exception:  # noqa: BLE001 - the thread is lost, the reason must not be
            threads_log.exception("internal error in thread %s", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class WorkerPool:
    """At most ``size`` daemon threads running submitted jobs in arrival order; idle threads wait for more.

    Used where work would otherwise cost a thread each (HTTP requests to one upstream, requests that wait for a
    starting server): a burst of 5,000 is 5,000 queued jobs, not 5,000 threads.  A job's exception is logged with
    its traceback and costs that job only.
    """

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._waiting = 0   # jobs submitted and not yet taken by a worker
        self._busy = 0      # workers running a job
        self._closed = False

    def submit(self, job, *args) -> None:
        """Queue ``job(*args)``; a new worker starts when every worker is taken and the pool is below its size."""
        with self._lock:
            if self._closed:
                return
            self._waiting += 1
            spawn = self._waiting + self._busy > self._threads and self._threads < self.size
            if spawn:
                self._threads += 1
            number = self._threads
        self._jobs.put((job, args))
        if spawn:
            threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()

    def close(self) -> None:
        """Let every worker finish its job and end; later submits are dropped."""
        with self._lock:
            self._closed, threads = True, self._threads
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, args = item
            with self._lock:
                self._waiting -= 1
                self._busy += 1
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - one job's failure must not take the worker with it
                threads_log.exception("internal error in %s", self.name)
            finally:
                with self._lock:
                    self._busy -= 1


def backoff_delay(attempt: int, base: float, ceiling: float) -> float:
    """The one backoff rule: ``base`` doubled per earlier attempt (``attempt`` 0 waits ``base``), never more than
    ``ceiling``.  Restarts, reopened listen streams, embedding retries and retried multi-round-trip requests all
    wait this way, each with its own base and ceiling."""
    return min(ceiling, base * 2 ** min(attempt, 64))


class Backoff:
    """Consecutive failures of one thing and the wait before its next try (see ``backoff_delay``).  Owned by one
    thread, or guarded by its owner's lock."""

    def __init__(self, base: float, ceiling: float):
        self.base, self.ceiling = base, ceiling
        self.failures = 0

    def next_delay(self) -> float:
        """Count a failure; the wait before the next try."""
        self.failures += 1
        return backoff_delay(self.failures - 1, self.base, self.ceiling)

    def reset(self) -> None:
        """It worked: the next failure waits ``base`` again."""
        self.failures = 0
