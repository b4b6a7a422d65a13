"""How ``condmem bench lookup`` times a `LookupEngine`: one lookup alone, or a pipeline of them."""

from __future__ import annotations

import collections
import time

import torch

from condmem.tables.lookup import LookupEngine, LookupHandle


def _sync(engine: LookupEngine) -> None:
    if engine.on_gpu:
        torch.cuda.synchronize(engine.device)


def time_lookup(engine: LookupEngine, batches: list[torch.Tensor], repeats: int = 3) -> float:
    """Median seconds of one lookup over `batches` (rotated), end to end on the device, each
    waited for before the next starts (what one prefetch must hide); after a warm-up lookup
    per plan slot."""
    for i in range(engine.max_in_flight):
        engine.lookup(batches[i % len(batches)]).wait()
    times = []
    for _ in range(repeats):
        for ids in batches:
            _sync(engine)
            t0 = time.perf_counter()
            engine.lookup(ids).wait()
            _sync(engine)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run_pipelined(engine: LookupEngine, batches: list[torch.Tensor], depth: int | None = None) -> list[LookupHandle]:
    """Look up `batches` back to back, each waited for only `depth` lookups later (default the
    engine's `max_in_flight`), as a prefetching caller would; returns the handles, all waited for.

    The rows are consumed on a stream of their own: waits queued on the stream the ids come
    from would hold back the next lookup's plan (it waits for that stream)."""
    depth = depth or engine.max_in_flight
    consumer = torch.cuda.Stream(engine.device) if engine.on_gpu else None
    handles, waiting = [], collections.deque()

    def wait_oldest():
        if consumer is None:
            waiting.popleft().wait()
        else:
            with torch.cuda.stream(consumer):
                waiting.popleft().wait()

    for ids in batches:
        handles.append(engine.lookup(ids))
        waiting.append(handles[-1])
        if len(waiting) >= depth:
            wait_oldest()
    while waiting:
        wait_oldest()
    return handles


def time_pipelined(engine: LookupEngine, batches: list[torch.Tensor], depth: int | None = None) -> float:
    """Mean seconds per lookup of `run_pipelined`: the steady-state cost a prefetching caller
    sees, with consecutive lookups overlapping."""
    _sync(engine)
    t0 = time.perf_counter()
    run_pipelined(engine, batches, depth)
    _sync(engine)
    return (time.perf_counter() - t0) / max(1, len(batches))
