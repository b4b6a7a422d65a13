"""When a pipelined lookup's tail runs: right after its gather, or during the next lookup's gather.

The lookup engine's gather thread serves lookups one after another: wait for a lookup's
plan, gather its CPU share, then its *tail* (queue the last DMA and the expansion, and
complete the lookup's future). The tail is Python work (0.5-0.9 ms per 16K-token lookup on
the H200 host, session 5) that the gather thread would otherwise do between two gathers.
With deferral on, a lookup's tail is handed to the next lookup's turn, which runs it while
its own first chunk is gathered on a helper thread.

The rule that keeps a waiting caller from deadlocking: a tail is deferred only when a later
lookup has already been handed to the gather thread (counted by `submitted` before the
hand-off), so some later turn is certain to run it. Tails run exactly once and in order.

Single-threaded use on the gather thread, except `submitted` (the caller's thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def once(fn: Callable[[], None] | None) -> Callable[[], None]:
    """`fn` (or nothing, if None) behind a call that runs it at most once."""
    state = {"fn": fn}

    def run() -> None:
        f, state["fn"] = state["fn"], None
        if f is not None:
            f()
    return run


class TailDeferral:
    """The gather thread's deferred tail and the count of lookups handed to it.

    Per lookup, on the gather thread: ``pending, has_pending = d.begin()`` at the start of its
    turn (the previous lookup's deferred tail, to run exactly once: during this lookup's
    gather, or at once); then ``d.finish(tail)`` after its gather (runs `tail` now, or keeps it
    for the next turn), or ``d.abandon()`` if the turn failed before that.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._queued = 0           # lookups handed to the gather thread whose turn has not finished
        self._lock = threading.Lock()
        self._deferred: Callable[[], None] | None = None

    def submitted(self) -> None:
        """The caller's thread, before handing a lookup to the gather thread."""
        with self._lock:
            self._queued += 1

    def begin(self) -> tuple[Callable[[], None], bool]:
        """(the previous lookup's tail as a run-once call, whether there is one)."""
        tail, self._deferred = self._deferred, None
        return once(tail), tail is not None

    def finish(self, tail: Callable[[], None]) -> None:
        """This lookup's turn is over: run its tail now, or defer it to the next turn if one is queued."""
        with self._lock:
            self._queued -= 1
            defer = self.enabled and self._queued > 0
        if defer:
            self._deferred = tail
        else:
            tail()

    def abandon(self) -> None:
        """This lookup's turn failed before `finish`: it leaves the count (its tail never runs)."""
        with self._lock:
            self._queued -= 1
