"""The worker pool: at most ``size`` threads, and a job never waits behind a busy worker while the pool could
start another; and the one backoff rule every retry loop uses."""

import threading

from coffer_src.threads import WorkerPool, backoff_delay

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


def test_the_backoff_doubles_from_its_base_up_to_its_ceiling():
    assert [backoff_delay(attempt, 0.5, 30.0) for attempt in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(10_000, 0.01, 5.0) == 5.0  # a long run of failures never overflows


def test_one_owners_pile_of_jobs_delays_anothers_job_by_one_turn_at_most():
    """The hub's pool serves every client session: a client that queues many slow asks must not hold another
    client's search until all of them are done.  Owners take turns; each owner's jobs keep their order."""
    pool = WorkerPool("fair-pool", 2)
    started, gates = [], {}

    def job(label):
        started.append(label)
        gates[label].wait(10)

    for n in range(6):
        gates[f"a{n}"] = threading.Event()
        pool.submit(job, f"a{n}", owner="client-a")
    gates["b0"] = threading.Event()
    pool.submit(job, "b0", owner="client-b")
    wait_until(lambda: len(started) == 2, what="both workers busy with client a's first jobs")
    gates["a0"].set()
    wait_until(lambda: len(started) == 3, what="a worker to take the next job")
    assert started[2] == "b0", started
    for gate in gates.values():
        gate.set()
    wait_until(lambda: len(started) == 7, what="every job to run")
    assert [label for label in started if label.startswith("a")] == [f"a{n}" for n in range(6)]
    pool.close()
