"""The worker pool: at most ``size`` threads, and a job never waits behind a busy worker while the pool could
start another."""

import threading

from coffer_src.threads import WorkerPool

from conftest import wait_until


def test_worker_pool_runs_a_second_job_while_the_first_is_busy():
    """WorkerPool.submit counts an idle worker as free even after an earlier submit already claimed it, so two
    jobs submitted back to back share one thread: the second waits behind the first although `size` allows more."""
    pool = WorkerPool("review-pool", 4)
    warmed = threading.Event()
    pool.submit(warmed.set)  # one worker now exists and goes idle
    assert warmed.wait(5)
    wait_until(lambda: pool._busy == 0, what="the first worker to be idle again")
    released, finished, seen = threading.Event(), threading.Event(), {}

    def first():
        seen["released"] = released.wait(5)
        finished.set()

    pool.submit(first)
    pool.submit(released.set)
    assert finished.wait(10)
    assert seen["released"] is True, "the second job only ran after the first one gave up waiting for it"
