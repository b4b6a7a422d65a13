"""A CUDA graph capture with Python's garbage collector paused.

A synchronizing CUDA call made during a capture spoils it (``cudaErrorStreamCaptureInvalidated``),
also one made on the capturing thread by a finalizer: a collection that frees an earlier
engine's pinned staging buffers (``cudaFreeHost``) or a tensor whose stream use the allocator
must query. A loop of tests that each build and close a lookup engine, with no other thread of
condmem working, saw such spoiled warm-up captures, and none with the collector paused
(docs/benchmarks.md; the finalizer is the likely cause, not a proven one). `torch.cuda.graph`
collects once before it begins; no collection runs until the capture ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None, pool=None) -> Iterator[None]:
    """``with capture(graph):`` records the work queued inside into `graph` (on `stream`; its allocations
    from the memory `pool` of `torch.cuda.graph_pool_handle()`, shared with other graphs, when given)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        if collecting:
            gc.enable()


def warm_and_capture(work: Callable[[], T], *, warmup: int = 1, device=None, pool=None, before_capture=None):
    """`work()` run `warmup` times on a side stream (kernels compiled, constants cached: outside the
    capture), then captured: (the graph, what the captured call returned). The graph has not run yet.
    `before_capture()`, when given, runs between the two (e.g. a memory's flush: no other thread of
    condmem may sync during the capture); `pool` as in `capture`."""
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(main.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            work()
    main.wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, pool=pool):
        out = work()
    return graph, out
