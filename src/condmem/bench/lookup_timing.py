"""How ``condmem bench lookup`` times a `LookupEngine`: one lookup alone, or a pipeline of them
(`condmem.tables.lookup.run_pipelined`, what the engine's calibration times too)."""

from __future__ import annotations

import time

import torch

from condmem.tables.lookup import LookupEngine, run_pipelined


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


def time_pipelined(engine: LookupEngine, batches: list[torch.Tensor], depth: int | None = None) -> float:
    """Mean seconds per lookup of `run_pipelined`: the steady-state cost a prefetching caller
    sees, with consecutive lookups overlapping."""
    _sync(engine)
    t0 = time.perf_counter()
    run_pipelined(engine, batches, depth)
    _sync(engine)
    return (time.perf_counter() - t0) / max(1, len(batches))
