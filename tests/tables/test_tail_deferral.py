"""TailDeferral: every lookup's tail runs exactly once, in order, on the gather thread; deferred
only when a later lookup is queued, so a caller waiting on a lookup never deadlocks; a failed
turn still runs the previous tail. Simulated with the engine's threading (one gather thread,
a caller thread that submits and waits), no GPU."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from condmem.tables.tail_deferral import TailDeferral, once


def _run_lookups(enabled: bool, n: int, seed: int, fail: set[int] = frozenset(), depth: int = 2):
    rng = random.Random(seed)
    tails = TailDeferral(enabled)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    helper = concurrent.futures.ThreadPoolExecutor(1)
    ran: list[int] = []
    ran_during_gather: list[int] = []
    gather_thread = []

    def turn(i: int, future: concurrent.futures.Future) -> None:     # the engine's _finish, simplified
        pending, has_pending = tails.begin()
        finished = False
        try:
            gather_thread.append(threading.get_ident())
            if i in fail:
                pending()
                raise ValueError(f"lookup {i} failed")
            if has_pending:                 # the previous tail, while this lookup's gather runs
                gathering = helper.submit(time.sleep, rng.random() * 2e-3)
                pending()
                ran_during_gather.append(i - 1)
                gathering.result()
            else:
                time.sleep(rng.random() * 2e-3)
            pending()

            def tail() -> None:
                assert threading.get_ident() == gather_thread[0]
                ran.append(i)
                future.set_result(i)

            finished = True
            tails.finish(tail)
        except BaseException as exc:
            pending()
            if not finished:
                tails.abandon()
            future.set_exception(exc)

    futures, waiting = [], []
    for i in range(n):
        while len([f for f in futures if not f.done()]) >= depth:     # back-pressure, as `lookup`
            concurrent.futures.wait([next(f for f in futures if not f.done())])
        future = concurrent.futures.Future()
        tails.submitted()
        pool.submit(turn, i, future)
        futures.append(future)
        waiting.append(future)
        if rng.random() < 0.3:                                        # a caller that waits at once
            try:
                waiting.pop(0).result(timeout=5)
            except ValueError:
                pass
    for future in futures:
        try:
            future.result(timeout=5)
        except ValueError:
            pass
    pool.shutdown()
    helper.shutdown()
    return ran, ran_during_gather, futures


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_every_tail_runs_once_in_order_and_no_wait_deadlocks(enabled, seed):
    ran, during, futures = _run_lookups(enabled, n=40, seed=seed, depth=2 + seed % 2)
    assert ran == list(range(40))
    assert all(f.done() for f in futures)
    if not enabled:
        assert during == []


def test_deferral_hides_tails_behind_the_next_gather_when_lookups_queue_up():
    ran, during, _ = _run_lookups(True, n=30, seed=11, depth=3)
    assert ran == list(range(30))
    assert len(during) > 0


def test_a_failed_lookup_still_runs_the_previous_tail_and_later_ones_go_on():
    ran, _, futures = _run_lookups(True, n=20, seed=3, fail={5, 6, 13}, depth=3)
    assert ran == [i for i in range(20) if i not in {5, 6, 13}]
    for i in (5, 6, 13):
        with pytest.raises(ValueError, match=f"lookup {i} failed"):
            futures[i].result()


def test_once_runs_at_most_once_and_accepts_none():
    calls = []
    run = once(lambda: calls.append(1))
    run()
    run()
    once(None)()
    assert calls == [1]
