"""Serving a decoder with Engram memory: the path of a request, and the pieces that carry it.

::

    prompt ids ──► slot = memory.allocate()            a history slot, numbered like the KV cache's slot
        │
        ▼
    hash         memory.prepare_ragged(ids, cu_seqlens, slots)        (memory.py)
        │        every Engram layer's row ids in one launch, before layer 0
        ├──────► lookups, one `LookupEngine` per layer on the memory's own stream:
        │        dedup ─► HBM row cache ─► misses: CPU threads + DMA, or the GPU in place
        ▼
    prefill      prefill_packed / ragged_step (steps.py) into the paged `ServingCache` (cache.py);
        │        blocks 0..k-1 run while rows arrive, Engram layer k waits for its own rows only
        ▼
    decode       GraphedDecoder.step (graphs.py): one CUDA graph per step over every slot,
    steps        the Engram fetch on a side branch inside it (or decode_step + memory.prepare_decode):
        │          ZeroCopyRows  (decode_fetch.py): the GPU reads HBM / page-locked tables in place
        │          StagedRows    (staged_fetch.py): host threads gather the rows, one DMA per layer
        ▼
    release      cache.release(slot); memory.free(slot)

Two drivers run this path:

* `WaveServer` (server.py): waves of up to ``n_slots`` prompts, packed prefill batches fetched one
  batch ahead, then CUDA-graph decode of the whole wave; the fixed batch is what a graph replays.
  ``condmem bench e2e`` measures it.
* `Scheduler` (scheduler.py): continuous batching, chunked prefill and decode tokens in one
  `ragged_step` under a token budget, slots reused as sequences finish; the reference loop for an
  engine's own scheduler (eager, no graphs).
"""

from condmem.serving.cache import ServingCache
from condmem.serving.graphs import GraphedDecoder
from condmem.serving.memory import EngramMemory, EngramMemoryError, FetchTiming, Prepared, join_prepared
from condmem.serving.scheduler import Request, RequestFailed, Scheduler
from condmem.serving.server import WaveObserver, WaveServer
from condmem.serving.steps import (
    decode_step,
    packed_ids,
    padded_ids,
    prefill,
    prefill_batch,
    prefill_packed,
    ragged_step,
)

__all__ = [
    "GraphedDecoder",
    "EngramMemory",
    "EngramMemoryError",
    "FetchTiming",
    "Prepared",
    "join_prepared",
    "Request",
    "RequestFailed",
    "Scheduler",
    "WaveObserver",
    "WaveServer",
    "ServingCache",
    "decode_step",
    "packed_ids",
    "padded_ids",
    "prefill",
    "prefill_batch",
    "prefill_packed",
    "ragged_step",
]
