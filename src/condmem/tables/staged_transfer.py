"""Rows of a host (or disk) store sent to the GPU through pinned staging: the CPU share of a lookup.

CPU threads gather the rows into a small ring of page-locked chunks; each chunk is copied to
the device on a copy stream as soon as it is whole, while the threads gather the next one.

Two ways to run it, same result (the rows land in order at the destination):

* **native** (where `condmem.native` is available and the CUDA runtime torch loaded is
  found): one call into ``condmem_gather_stream`` (``native/gather.c``): OpenMP threads
  stream 64-row pieces into the ring with no barriers, and the calling thread queues each
  chunk's ``cudaMemcpyAsync`` as soon as the chunk is whole (a C call, without the Python and
  dispatcher work of a ``Tensor.copy_``) and frees ring buffers by polling their events. Chunks ramp
  up from `TAIL_CHUNK_ROWS` to the chunk size and back (`chunk_bounds`). It takes about half
  the time of the loop below (``docs/lookup-engine.md``), bound by the host's memory
  bandwidth, most of which the DMA itself takes.
* **torch** (the fallback; also the disk tier with a DRAM row cache in front): a loop of
  `LayerStore.gather_raw` and ``Tensor.copy_(non_blocking=True)`` per chunk.
"""

from __future__ import annotations

import ctypes

import torch

from condmem import native
from condmem.tables.storage import LayerStore

STAGING_CHUNK_ROWS = 65536
"""Default rows per staging chunk, the largest of a send's ramped chunks: the fastest of the
sizes tried (docs/benchmarks.md)."""

TAIL_CHUNK_ROWS = 4096
"""Rows of a native send's first and last chunks (`chunk_bounds`): a 16th of a full chunk, so the
first DMA starts after a 16th of a full chunk's gather, and the last row gathered is followed by
the DMA of 4096 rows, not of a full chunk (docs/lookup-engine.md)."""


def chunk_times(timeline: torch.Tensor) -> dict[str, list[float]]:
    """Per-chunk host times in microseconds from a native send's timeline: `interval` (since
    the previous chunk was whole: the send's period), `launch` (queueing the chunk's send),
    `late` (how long after the previous chunk was whole this chunk's buffer came free: > 0
    when the ring, i.e. the DMA, held the threads back)."""
    t = (timeline - timeline[0]).double() / 1e3
    writable, whole, queued = t[1::3], t[2::3], t[3::3]
    before = torch.cat([t[:1], whole[:-1]])
    return {
        "interval": (whole - before).tolist(),
        "launch": (queued - whole).tolist(),
        "late": (writable - before).clamp(min=0).tolist(),
    }


def chunk_bounds(n: int, max_rows: int, min_rows: int = TAIL_CHUNK_ROWS) -> list[int]:
    """Row bounds of a native send's chunks: sizes ramp up from `min_rows` by doubling to
    `max_rows`, stay there, and ramp back down to `min_rows` at the end (as far as `n`
    allows), so the first DMA starts early and the last one is short; every chunk has at
    most `max_rows` rows. E.g. 105000 rows, 65536 / 4096: 4096, 8192, 16384, 23828, 23828,
    16384, 8192, 4096."""
    if n <= 0:
        return [0]
    ramp = [min_rows]
    while ramp[-1] * 2 <= max_rows:
        ramp.append(ramp[-1] * 2)
    if ramp[-1] < max_rows:
        ramp.append(max_rows)
    ramp = [r for r in ramp if r <= max_rows] or [max_rows]
    j = 0  # head/tail chunks taken from the ramp: as many as fit twice, below its top
    while j < len(ramp) - 1 and 2 * sum(ramp[: j + 1]) <= n:
        j += 1
    head = ramp[:j]
    middle = n - 2 * sum(head)
    cap = ramp[j]
    q = max(1, -(-middle // cap))
    sizes = head + [middle // q + (1 if i < middle % q else 0) for i in range(q)] + head[::-1]
    bounds = [0]
    for size in sizes:
        if size:
            bounds.append(bounds[-1] + size)
    return bounds


class StagedSender:
    """Sends rows ``store[ids]`` to a device buffer through a ring of pinned staging chunks.

    Args:
        row_bytes: bytes per row.
        device: the CUDA device the rows go to.
        chunk_rows: rows per staging chunk (a chunk is sent while the next is gathered).
        ring: chunks in the ring (each reused once its last send has finished).
        tail_rows: a native send's first and last chunk sizes, ramped up to `chunk_rows` and
            back (`chunk_bounds`; `chunk_rows`: no ramp).

    Example:
        >>> sender = StagedSender(264, "cuda")
        >>> sender.send(store, ids_on_host, rows_on_gpu, copy_stream, threads=15)
        >>> done = torch.cuda.Event(); done.record(copy_stream)   # rows are there after it
    """

    def __init__(
        self,
        row_bytes: int,
        device: str | torch.device,
        chunk_rows: int = STAGING_CHUNK_ROWS,
        ring: int = 4,
        tail_rows: int = TAIL_CHUNK_ROWS,
    ):
        if chunk_rows < 1 or ring < 2:
            raise ValueError(f"StagedSender needs chunk_rows >= 1 and ring >= 2, got {chunk_rows}, {ring}")
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk_rows = chunk_rows
        self.tail_rows = tail_rows
        self.buffers = [torch.empty((chunk_rows, row_bytes), dtype=torch.uint8, pin_memory=True) for _ in range(ring)]
        self.events = []
        with torch.cuda.device(self.device):
            for _ in range(ring):  # recorded once, so each has its runtime handle from the start
                event = torch.cuda.Event()
                event.record()
                self.events.append(event)
        self._next = 0
        self.record_timeline = False
        """Native path: keep each send's per-chunk host timeline in `last_timeline` (diagnostics)."""
        self.last_timeline: dict | None = None
        self.native = native.available() and native.cuda_runtime() is not None
        """True where the native send can run: `condmem.native` is loaded and the CUDA runtime
        torch uses was found (see `uses_native` for the store's part)."""
        self._ring_ptrs = (ctypes.c_void_p * ring)(*(b.data_ptr() for b in self.buffers))
        self._event_ptrs = (ctypes.c_void_p * ring)(*(e.cuda_event for e in self.events))

    def uses_native(self, store: LayerStore) -> bool:
        """True when `send` runs natively for this store: its rows are one contiguous CPU tensor
        read in place (no DRAM row cache or O_DIRECT reader in front of them)."""
        return self.native and store.raw_in_place

    def send(
        self, store: LayerStore, ids: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream, threads: int
    ) -> None:
        """Queue ``dst[i] = store rows[ids[i]]`` on `stream`; returns once every chunk is queued.

        `ids`: int64 on the CPU, in range (the caller has checked them); `dst`: contiguous
        uint8 [n, row_bytes] on the device. Work queued on `stream` after this call sees the rows.
        Call from one thread at a time.
        """
        n = ids.numel()
        if dst.shape != (n, self.row_bytes) or not dst.is_contiguous() or dst.device != self.device:
            raise ValueError(
                f"send: dst must be contiguous [{n}, {self.row_bytes}] on {self.device}, got "
                f"{tuple(dst.shape)} on {dst.device}"
            )
        if n == 0:
            return
        ids = ids.contiguous()
        use_native = self.uses_native(store)
        # Native: chunks of `chunk_bounds` sizes; the torch loop: fixed chunks of `chunk_rows`.
        bounds = chunk_bounds(n, self.chunk_rows, self.tail_rows) if use_native else None
        n_chunks = len(bounds) - 1 if use_native else -(-n // self.chunk_rows)
        start, self._next = self._next, (self._next + n_chunks) % len(self.buffers)
        with torch.cuda.device(self.device):  # the runtime calls act on the current device
            if use_native:
                self._send_native(store, ids, dst, stream, threads, start, bounds)
            else:
                self._send_torch(store, ids, dst, stream, threads, start)

    def _send_native(self, store, ids, dst, stream, threads, start, bounds: list[int]) -> None:
        runtime, lib = native.cuda_runtime(), native.library()
        bounds_t = torch.tensor(bounds, dtype=torch.int64)
        timeline = torch.zeros(3 * len(bounds) - 2, dtype=torch.int64) if self.record_timeline else None
        err = lib.condmem_gather_stream(
            store.raw.data_ptr(),
            self.row_bytes,
            ids.data_ptr(),
            self._ring_ptrs,
            self._event_ptrs,
            len(self.buffers),
            start,
            bounds_t.data_ptr(),
            len(bounds) - 1,
            dst.data_ptr(),
            stream.cuda_stream,
            runtime.memcpy_async,
            runtime.event_record,
            runtime.event_query,
            int(threads),
            None if timeline is None else timeline.data_ptr(),
        )
        if timeline is not None:
            self.last_timeline = chunk_times(timeline)
        if err:
            raise RuntimeError(
                f"staged send of {ids.numel()} rows failed: CUDA error {err} ({runtime.error_string(err)})"
            )

    def _send_torch(self, store, ids, dst, stream, threads, start) -> None:
        for c, s in enumerate(range(0, ids.numel(), self.chunk_rows)):
            e = min(ids.numel(), s + self.chunk_rows)
            k = (start + c) % len(self.buffers)
            buf, event = self.buffers[k][: e - s], self.events[k]
            event.synchronize()  # the last send out of this chunk is done
            store.gather_raw(ids[s:e], out=buf, threads=threads)
            with torch.cuda.stream(stream):
                dst[s:e].copy_(buf, non_blocking=True)
                event.record(stream)
