"""CUDA-graph decode: one captured step over every slot of a `ServingCache`, Engram lookups inside.

Python and kernel-launch overhead dominate a decode step of a small batch, which would
hide what Engram costs; a CUDA graph replays the whole step in one launch. The graph
has one row per cache slot (row j is slot j, so the KV cache is read in place); a step
marks the slots it advances as valid, and the other rows compute but change nothing.

Engram rows, with an `EngramMemory` whose tables the GPU can read in place (HBM, or
page-locked host memory), are fetched *inside* the graph::

    main stream:  hash + history ──► embed ─► block 0 ─► [wait] ─► Engram ─► block 1 ...
    side stream:              └──► gather rows (host: zero-copy over PCIe) ──┘

The hash updates the decode history on the main stream; a side branch gathers every
Engram layer's rows into static buffers; the Engram layer waits for that branch only
(``wait="at_layer"``), so the fetch overlaps the blocks before it, the paper's prefetch.
``wait="before_step"`` puts the same wait before block 0 instead: the synchronous
baseline that shows what prefetching saves. Without a memory the graph hashes each
slot's history window and reads the model's own tables.

``fetch="staged"`` has host threads gather the rows instead (`condmem.serving.staged_fetch`):
the side branch copies the row ids to the host, waits on a host flag (a stream wait, no
kernel) and copies the staged rows in by DMA, so the GPU makes no random reads of a large
host table, whose translation misses slow the blocks beside them. It also serves stores the
GPU cannot read but the CPU can (a memory-mapped file). Other stores (disk read with
``O_DIRECT``) are not supported here: serve those with eager `decode_step` and
`EngramMemory.prepare_decode` (the lookup needs the host).

Tensor-parallel (a backbone from `condmem.distributed.shard_backbone`, a memory built with
``process_group=``): the side branch gathers this rank's columns only, and each Engram layer
completes its rows with the memory's collective; the blocks' all-reduces are captured with
the rest (NCCL).
"""

from __future__ import annotations

import contextlib

import torch

from condmem.models.transformer import DecoderLM
from condmem.serving.cache import ServingCache
from condmem.serving.decode_fetch import ZeroCopyRows
from condmem.serving.staged_fetch import StagedRows, staged_fetch_fits
from condmem.serving.steps import decode_step
from condmem.utils.graph_capture import warm_and_capture

# The step's GEMMs are captured from cuBLASLt, whose kernels for a decode batch's skinny
# GEMMs made the step faster than cuBLAS's (`benchmarks/probes/decode_blas_ab.py`; docs/benchmarks.md).
DECODE_BLAS = "cublaslt"

WAIT_MODES = ("at_layer", "before_step")
FETCH_MODES = ("auto", "zero_copy", "staged")


class GraphedDecoder:
    """`decode_step` over all slots of `cache`, captured in a CUDA graph.

    Args:
        model: the decoder (on CUDA, eval mode).
        cache: its `ServingCache`; the graph has one row per slot.
        memory: optional `EngramMemory` holding the Engram tables (HBM or page-locked host
            stores); its history slots must be the cache's slot numbers (allocate both
            from the memory, or keep them equal).
        wait: where the main stream waits for the fetched rows: ``"at_layer"`` (each
            Engram layer: the fetch overlaps the blocks before it) or ``"before_step"``
            (synchronous fetch, for comparison).
        fetch_programs: cap on the fetch kernel's grid (None: as many as it can use); a
            small grid leaves SMs to the blocks that run beside the fetch.
        fetch: how a memory's rows reach the graph: ``"zero_copy"`` (the GPU reads the tables
            in place), ``"staged"`` (host threads gather them, one DMA per layer; call
            `close()` when done, which stops the threads) or ``"auto"``: staged when every
            table is in host memory (the GPU's zero-copy reads of a large host table slow the
            blocks beside them, staged rows do not: docs/serving.md), else zero-copy.
        fetch_threads: host threads of a staged fetch (None: `staged_fetch.default_threads`).

    Example:
        >>> graph = GraphedDecoder(model, cache, memory=memory)
        >>> logits = graph.step([0, 3], next_ids)          # advances slots 0 and 3
    """

    def __init__(
        self,
        model: DecoderLM,
        cache: ServingCache,
        *,
        memory=None,
        wait: str = "at_layer",
        fetch_programs: int | None = None,
        fetch: str = "auto",
        fetch_threads: int | None = None,
        warmup: int = 3,
    ):
        if not torch.cuda.is_available() or cache.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model and cache on a CUDA device")
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {WAIT_MODES}, got {wait!r}")
        if memory is not None and model.cfg.engram is None:
            raise ValueError("a memory was given but the model has no Engram layers")
        if fetch not in FETCH_MODES:
            raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
        if fetch == "auto":
            fetch = "staged" if memory is not None and staged_fetch_fits(memory) else "zero_copy"
        if memory is not None:
            unreadable = [lid for lid, s in memory.stores.items() if not s.gpu_readable]
            if unreadable and fetch == "zero_copy":
                raise ValueError(
                    f"Engram layer(s) {unreadable} live in a tier the GPU cannot read in place "
                    "(disk?): serve them with fetch='staged' where the CPU can read their rows "
                    "(a memory-mapped file), else with eager decode_step + memory.prepare_decode"
                )
            if any(sr.sequence_parallel for sr in (memory.sharded or {}).values()):
                raise ValueError(
                    "a sequence-parallel memory splits a step's tokens over the ranks; the decode graph "
                    "runs every slot on every rank: build the memory with sequence_parallel=False"
                )
            if memory.history.n_slots < cache.n_slots:
                raise ValueError(
                    f"the memory's history has {memory.history.n_slots} slots, the cache "
                    f"{cache.n_slots}: they must share slot numbers"
                )
        if memory is None and model.cfg.engram is not None and model.engram_layers[0].table.weight.is_meta:
            raise ValueError("the model's Engram tables live outside it (meta): pass memory=")
        self.model, self.cache, self.memory = model, cache, memory
        device = cache.device
        n = cache.n_slots
        self.slots = torch.arange(n, device=device)
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.valid = torch.zeros(n, dtype=torch.bool, device=device)
        self._slots: list[int] | None = None
        self._index: torch.Tensor | None = None
        self.fetch = None
        if memory is not None:
            self.fetch = (
                StagedRows(memory, n, device, wait, fetch_threads)
                if fetch == "staged"
                else ZeroCopyRows(memory, n, device, wait, fetch_programs)
            )
        try:
            self._capture(device, warmup)
        except BaseException:
            self.close()  # a staged fetch's threads must not outlive a decoder that failed
            raise

    def _capture(self, device, warmup: int) -> None:
        with _preferred_blas(DECODE_BLAS):
            self._warm_and_capture(device, warmup)

    def _warm_and_capture(self, device, warmup: int) -> None:
        # A lookup thread's sync would spoil the capture: the memory's lookups are flushed before it.
        flush = self.memory.flush if self.memory is not None else None
        self.graph, self.logits = warm_and_capture(self._body, warmup=warmup, device=device, before_capture=flush)

    def _body(self) -> torch.Tensor:
        if self.fetch is not None:
            self.fetch.launch(self.slots, self.ids, self.valid)
        return decode_step(self.model, self.cache, None, self.ids, prepared=self.fetch, check=False, valid=self.valid)

    @torch.no_grad()
    def step(self, slots, ids: torch.Tensor) -> torch.Tensor:
        """Advance `slots` (host ints: a list or CPU tensor) by `ids` [B]; returns logits [B, vocab]."""
        slots = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} repeat a slot")
        bad = [s for s in slots if not 0 <= s < self.cache.n_slots]
        if bad:
            raise ValueError(f"slots {bad} are not slots of the cache (0..{self.cache.n_slots - 1})")
        self.cache.check_room(slots)
        if slots != self._slots:  # a new set of live slots: one host->device copy (a sync), then reused
            self._slots = slots
            self._index = torch.tensor(slots, dtype=torch.long).to(self.ids.device)
            self.valid.zero_()
            self.valid[self._index] = True
        if self.fetch is not None:
            self.fetch.check()  # a staged fetch: its threads run, no step asked for ids outside a table
        index = self._index
        self.ids[index] = ids.to(self.ids.device)
        self.graph.replay()
        if self.fetch is not None:
            self.fetch.replayed()
        self.cache.advance(slots)
        return self.logits[index]

    def fetch_stats(self) -> dict | None:
        """A staged fetch's host side: steps served, ids outside a table, host time per step
        (``mean_us``, ``max_us``: request seen -> last layer staged); None for other fetches."""
        return self.fetch.stats() if self.fetch is not None else None

    def close(self) -> None:
        """Stop a staged fetch's host threads (after the GPU took every step's rows); the
        decoder cannot step after it. Nothing to do for other fetches."""
        if self.fetch is not None:
            self.fetch.close()

    def __enter__(self) -> GraphedDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _preferred_blas(library: str):
    """PyTorch's BLAS library for GEMMs on CUDA set to `library` inside the block (a process-wide
    setting: GEMMs other threads launch meanwhile use it too), restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)
