"""Threads: named daemon threads that never die silently, and a small worker pool."""

from __future__ import annotations

import collections
import logging
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
    """At most ``size`` daemon threads running submitted jobs; idle threads wait for more.

    Used where work would otherwise cost a thread each (HTTP requests to one upstream, requests that wait for a
    starting server): a burst of 5,000 is 5,000 queued jobs, not 5,000 threads.  Jobs may name an ``owner`` (the
    hub's pool: the client session): one owner's jobs run in the order submitted, and a free worker takes the
    next job of the owner with the fewest jobs running (the longest waiting among equals), so a client that
    queues a hundred slow asks does not hold another client's search until they are done.  Jobs of no owner
    share one queue, in arrival order.  A job's exception is logged with its traceback and costs that job only.
    ``_cond`` guards the queues and counts; it is a leaf.
    """

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[object, collections.deque] = {}  # owner -> its jobs not taken yet, oldest first
        self._turns: collections.deque = collections.deque()  # owners with jobs waiting, longest waiting first
        self._running: dict[object, int] = {}                # owner -> its jobs running now
        self._threads = 0
        self._waiting = 0   # jobs submitted and not yet taken by a worker
        self._busy = 0      # workers running a job
        self._closed = False

    def submit(self, job, *args, owner: object = None) -> None:
        """Queue ``job(*args)``; a new worker starts when every worker is taken and the pool is below its size."""
        with self._cond:
            if self._closed:
                return
            jobs = self._queues.get(owner)
            if jobs is None:
                jobs = self._queues[owner] = collections.deque()
                self._turns.append(owner)
            jobs.append((job, args))
            self._waiting += 1
            spawn = self._waiting + self._busy > self._threads and self._threads < self.size
            if spawn:
                self._threads += 1
            number = self._threads
            self._cond.notify()
        if spawn:
            threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()

    def close(self) -> None:
        """Let the workers finish the jobs already queued and end; later submits are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next_job(self):
        """The next owner's oldest job (None once the pool is closed and drained); the caller holds _cond."""
        while not self._turns:
            if self._closed:
                return None
            self._cond.wait()
        owner = min(self._turns, key=lambda candidate: self._running.get(candidate, 0))
        self._turns.remove(owner)
        jobs = self._queues[owner]
        job, args = jobs.popleft()
        if jobs:
            self._turns.append(owner)  # behind every owner already waiting
        else:
            del self._queues[owner]
        self._running[owner] = self._running.get(owner, 0) + 1
        self._waiting -= 1
        self._busy += 1
        return owner, job, args

    def _work(self) -> None:
        while True:
            with self._cond:
                item = self._next_job()
            if item is None:
                return
            owner, job, args = item
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - one job's failure must not take the worker with it
                threads_log.exception("internal error in %s", self.name)
            finally:
                with self._cond:
                    self._busy -= 1
                    if self._running[owner] == 1:
                        del self._running[owner]
                    else:
                        self._running[owner] -= 1


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
