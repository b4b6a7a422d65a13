"""A lookup's plan on fixed-size (padded) buffers, with no host synchronization: one CUDA graph.

Planning a batch of N row ids (dedup, cache probe, misses, their split between the GPU's
zero-copy gather and the CPU threads) takes ~80 small kernels. Launched one by one from
Python, with the syncs that size each step's output (`torch.unique`, `torch.nonzero`),
that cost milliseconds of host time per 16K-token lookup (docs/benchmarks.md): more than
the GPU work itself, and on the thread that also launches the model.

Here every intermediate keeps the batch's full size N: the unique ids, the misses and each
share are the first n_unique / n_miss / n_gpu / n_cpu entries of their buffers, followed by
padding (row id `PAD_ID`, position N, which names a spare row at the end of `compact`).
The counts stay on the device; one copy sends them, with the CPU share's ids, to pinned
host memory for the gather thread. Fixed shapes and no syncs make the plan capturable as
a CUDA graph, so replaying it costs one launch.

Row ids must be >= 0 (`PAD_ID` marks padding); ids outside the table are reported through
the ``bad`` count (the engine raises on the gather thread) and never read.

Padding writes of the dedup and the compaction land in one spare entry past N. (Cycling
them over many spares changed no plan time; the costly same-address stores are row writes,
and the cache's and the GPU share's row writes store nothing for padding: docs/lookup-engine.md.)

The functions run eagerly on any device; tests hold them to `torch.unique`,
`torch.nonzero` and `split_by_density` on the CPU.
"""

from __future__ import annotations

import torch

from condmem.ops.gather import engram_gather
from condmem.tables.row_cache import FLOAT_WORDS, RowCache, row_words
from condmem.utils.graph_capture import capture

PAD_ID = -1
N_COUNTS = 8
"""Counts sent to the host before the CPU share's ids: n_cpu, n_gpu, n_miss, n_unique, bad, min id, max id, spare."""
COUNT_NAMES = ("n_cpu", "n_gpu", "n_miss", "n_unique", "bad", "min_id", "max_id")


def as_words(raw: torch.Tensor) -> torch.Tensor | None:
    """Raw uint8 rows viewed as 4- or 2-byte float words, which the gather kernel moves bit for
    bit (a plain load and store, no arithmetic); None when the row size is odd."""
    words = row_words(raw, FLOAT_WORDS)
    return None if words.dtype == torch.uint8 else words


def move_rows(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    max_programs: int | None = None,
) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` (raw uint8 rows) for every i whose destination is
    inside `dst`; the others (padding) store nothing, and read nothing when their source index
    is -1. One kernel on CUDA, no host sync; `max_programs` caps its grid."""
    if src.shape[-1] != dst.shape[-1]:
        raise ValueError(f"move_rows: source rows of {src.shape[-1]} B, destination rows of {dst.shape[-1]} B")
    src_words, dst_words = as_words(src), as_words(dst)  # same row size: same dtype
    if src_words is not None:
        engram_gather(src_index, src_words, out=dst_words, out_index=dst_index, max_programs=max_programs)
        return
    # Odd row sizes (no table format has them): boolean indexing, which syncs on CUDA.
    inside = (dst_index >= 0) & (dst_index < dst.shape[0])
    dst[dst_index[inside]] = src[src_index[inside]]


def plan_bucket(n: int) -> int:
    """The plan size that serves batches of `n` ids: `n` rounded up to 16 steps per power of two
    (at most 12.5% more), so batches of varied sizes share a few plans and graphs.
    16K tokens x 24 columns (393,216 ids) is a bucket of its own."""
    step = 1 << max(0, (max(n, 1) - 1).bit_length() - 4)
    return -(-n // step) * step


def fill_plan_ids(plan_ids: torch.Tensor, ids: torch.Tensor) -> None:
    """`ids` [n] into a plan's bucket [N >= n]; the tail repeats the first id, which adds no
    unique id, so the plan's counts and shares are those of `ids` alone."""
    n = ids.numel()
    plan_ids[:n].copy_(ids)
    if plan_ids.numel() > n:
        plan_ids[n:].copy_(ids[:1].expand(plan_ids.numel() - n))


def dedup_padded(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted unique ids of `ids` [N] without a host sync.

    Returns (uniq [N + 1]: the n_unique unique ids in ascending order, then `PAD_ID`;
    inverse [N]: position of each id in `uniq`; n_unique [1]).
    """
    n = ids.numel()
    sorted_ids, perm = torch.sort(ids)
    first = torch.ones(n, dtype=torch.bool, device=ids.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    rank = torch.cumsum(first, 0) - 1  # unique index of each sorted id
    inverse = torch.empty_like(rank)
    inverse.scatter_(0, perm, rank)
    uniq = torch.full((n + 1,), PAD_ID, dtype=ids.dtype, device=ids.device)
    # Repeats write their id to the spare entry n, reset to padding after.
    uniq.scatter_(0, torch.where(first, rank, n), sorted_ids)
    uniq[n:].fill_(PAD_ID)  # (fill_, not item assignment: no host tensor copied in a graph)
    return uniq, inverse, rank[-1:] + 1


def compact_padded(mask: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the True entries of `mask` [N] in order, without a host sync.

    Returns (positions [N + 1]: the count positions, then `fill`; count [1]).
    """
    n = mask.numel()
    running = torch.cumsum(mask, 0)
    target = torch.where(mask, running - 1, n)
    pos = torch.full((n + 1,), fill, dtype=torch.int64, device=mask.device)
    pos.scatter_(0, target, torch.arange(n, device=mask.device))
    pos[n:].fill_(fill)
    return pos, running[-1:]


def split_by_density(
    miss_ids: torch.Tensor, row_bytes: int, region_bytes: int, n_cpu: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (into the sorted `miss_ids`) of the zero-copy share and of the CPU share.

    The plain version of the split: the engine runs `lookup_plan.split_padded`, its padded,
    sync-free twin, which tests hold to this one.

    A zero-copy read from host memory costs about one GPU address translation per
    ``region_bytes`` region touched, almost independent of how many rows of it are read
    (docs/kernels.md), while a CPU thread pays per row.
    So the GPU takes the rows that share a region with a neighbour first, and the CPU the
    lone rows: the CPU share is the `n_cpu` rows that are loneliest. Both shares come
    back in id order (locality for both readers).
    """
    n = miss_ids.numel()
    if n_cpu <= 0:
        return torch.arange(n, device=miss_ids.device), miss_ids.new_empty(0)
    if n_cpu >= n:
        return miss_ids.new_empty(0), torch.arange(n, device=miss_ids.device)
    region = torch.div(miss_ids * row_bytes, region_bytes, rounding_mode="floor")
    shared = torch.zeros(n, dtype=torch.bool, device=miss_ids.device)
    same = region[1:] == region[:-1]
    shared[1:] |= same
    shared[:-1] |= same
    # Stable: shared rows first, then lone ones, each group still in id order.
    order = torch.argsort((~shared).to(torch.int8), stable=True)
    n_gpu = n - n_cpu
    return order[:n_gpu].sort().values, order[n_gpu:].sort().values


def split_padded(
    miss_ids: torch.Tensor, n_miss: torch.Tensor, row_bytes: int, region_bytes: int, fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The density split of `split_by_density` on padded misses, without a host sync.

    `miss_ids` [N + 1]: sorted missed ids then `PAD_ID`. The CPU takes round(n_miss *
    fraction) of them, the loneliest (fewest other misses in their ``region_bytes``
    region); the GPU the rest, rows that share a region first.

    Returns (gpu_sel [N + 1], cpu_sel [N + 1]: indices into `miss_ids`, each share in id
    order then the padding index N; n_gpu [1]; n_cpu [1]).
    """
    n = miss_ids.numel() - 1
    dev = miss_ids.device
    n_cpu = torch.round(n_miss.double() * fraction).long()
    n_gpu = n_miss - n_cpu
    idx = torch.arange(n + 1, device=dev)
    if fraction >= 1.0 or fraction <= 0.0:
        every = torch.where(idx < n_miss, idx, n)
        padding = torch.full_like(idx, n)
        return (padding, every, n_gpu, n_cpu) if fraction >= 1.0 else (every, padding, n_gpu, n_cpu)
    ids = miss_ids[:n]
    valid = ids >= 0
    region = torch.div(ids * row_bytes, region_bytes, rounding_mode="floor")
    same = (region[1:] == region[:-1]) & valid[1:] & valid[:-1]
    shared = torch.zeros(n, dtype=torch.bool, device=dev)
    shared[1:] |= same
    shared[:-1] |= same
    # Shared rows first, then lone ones, then padding; each group in id order (stable).
    order = torch.argsort(torch.where(valid, (~shared).to(torch.int64), 2), stable=True)
    r = idx[:n]
    group = torch.where(r < n_gpu, 0, torch.where(r < n_miss, 1, 2))
    # Each share back in id order: one sort by (share, position).
    sel = torch.sort(group * (n + 1) + order).values % (n + 1)
    gpu_sel = torch.full((n + 1,), n, dtype=torch.int64, device=dev)
    gpu_sel[:n] = torch.where(r < n_gpu, sel, n)
    shifted = sel.gather(0, (r + n_gpu).clamp(max=n - 1))  # the CPU share starts at n_gpu
    cpu_sel = torch.full((n + 1,), n, dtype=torch.int64, device=dev)
    cpu_sel[:n] = torch.where(r < n_cpu, shifted, n)
    return gpu_sel, cpu_sel, n_gpu, n_cpu


class LookupPlan:
    """Static buffers of the plan for batches of N ids, and (on CUDA) its captured graphs.

    Fill `ids` (`fill_plan_ids` for a batch smaller than N), call `run()` (a graph replay once
    captured); then on the device:

    * ``inverse`` [N]: position of each id among the sorted unique ids;
    * ``row_of`` [N + 1]: the row of `compact` that holds unique id u's row. The CPU share
      comes first, in its order (rows 0..n_cpu-1, so its DMAs land in place and need no
      scatter), then every other unique id in order; ``row_of[N] = N`` (padding);
    * ``rows_index`` [N] = row_of[inverse]: the compact row of each id, what the expansion reads;
    * ``compact`` [N + 1, row_bytes]: the cache hits already in place; the misses' rows
      are the caller's to fill (the GPU share at ``gpu_dst``, the CPU share at 0..n_cpu-1);
    * ``miss_ids`` / ``miss_pos`` (padded), the GPU share's ids ``gpu_ids`` and rows ``gpu_dst``;

    and on the host, once the copy is done, ``host[:N_COUNTS]`` the counts and
    ``host[N_COUNTS:]`` the CPU share's ids (absent when `fraction` is 0: no CPU share, so
    only the counts cross). `admit()` queues the misses' admission to the cache (also a graph).
    """

    def __init__(
        self,
        n: int,
        row_bytes: int,
        num_rows: int,
        device: torch.device,
        cache: RowCache | None,
        fraction: float,
        region_bytes: int,
        pin: bool,
    ):
        self.n, self.row_bytes, self.num_rows = n, row_bytes, num_rows
        self.cache, self.fraction, self.region_bytes = cache, fraction, region_bytes
        self.gpu_share = fraction < 1.0  # else no GPU share (and for fraction 0, no CPU share)
        self.cpu_share = fraction > 0.0
        self.ids = torch.empty(n, dtype=torch.int64, device=device)
        self.compact = torch.empty((n + 1, row_bytes), dtype=torch.uint8, device=device)
        # Counts, then (only when there can be a CPU share) that share's ids.
        host_len = N_COUNTS + (n if self.cpu_share else 0)
        self._to_host = torch.empty(host_len, dtype=torch.int64, device=device)
        self.host = torch.empty(host_len, dtype=torch.int64, pin_memory=pin)
        self._graphs: dict[str, object] = {}

    # ------------------------------------------------------------------ the steps
    def _plan(self) -> None:
        n = self.n
        dev = self.ids.device
        uniq, self.inverse, n_unique = dedup_padded(self.ids)
        valid = uniq[:n] >= 0
        if self.cache is not None:
            slot = self.cache.probe(uniq[:n], valid=valid)
            miss = valid & (slot < 0)
        else:
            miss = valid
        self.miss_pos, n_miss = compact_padded(miss, fill=n)
        self.miss_ids = uniq.index_select(0, self.miss_pos)
        gpu_sel, cpu_sel, n_gpu, n_cpu = split_padded(
            self.miss_ids, n_miss, self.row_bytes, self.region_bytes, self.fraction
        )
        self.gpu_ids = self.miss_ids.index_select(0, gpu_sel)
        gpu_pos = self.miss_pos.index_select(0, gpu_sel)
        cpu_pos = self.miss_pos.index_select(0, cpu_sel)
        # Rows of compact: the CPU share first (0..n_cpu-1, in its order, which is unique-id
        # order), then the other unique ids in order. A permutation of 0..n-1, found by one
        # prefix sum: no sort, no sync.
        is_cpu = torch.zeros(n + 1, dtype=torch.bool, device=dev)
        is_cpu.index_fill_(0, cpu_pos[:n], True)  # (padding marks entry n)
        is_cpu = is_cpu[:n]
        cpu_before = torch.cumsum(is_cpu, 0) - is_cpu.long()
        u = torch.arange(n, device=dev)
        self.row_of = torch.cat([torch.where(is_cpu, cpu_before, n_cpu + u - cpu_before), u[-1:] + 1])
        self.rows_index = self.row_of.index_select(0, self.inverse)
        self.gpu_dst = self.row_of.index_select(0, gpu_pos)
        if self.cache is not None:
            # The hits' rows from the cache into their compact rows (misses and padding: nothing).
            move_rows(self.cache.data, slot, self.compact[:n], torch.where(slot >= 0, self.row_of[:n], n))
        lo = uniq[:1]
        hi = uniq.gather(0, (n_unique - 1).clamp(min=0))
        bad = ((lo < 0) | (hi >= self.num_rows)).long()
        counts = torch.cat([n_cpu, n_gpu, n_miss, n_unique, bad, lo, hi, torch.zeros_like(lo)])
        self._to_host[:N_COUNTS] = counts
        if self.cpu_share:
            self._to_host[N_COUNTS:] = self.miss_ids.index_select(0, cpu_sel[:n])
        self.host.copy_(self._to_host, non_blocking=True)

    def _admit(self) -> None:
        ids = self.miss_ids[: self.n]
        row_index = self.row_of.index_select(0, self.miss_pos[: self.n])  # padding: row N, the spare
        self.cache.admit_rows(ids, self.compact, valid=ids >= 0, row_index=row_index, return_slots=False)

    # ------------------------------------------------------------------ running
    @property
    def captured(self) -> bool:
        return "plan" in self._graphs

    def capture(self) -> None:
        """Capture the plan (and the admission, with a cache) as CUDA graphs on the current stream.

        Each step runs once eagerly first (allocations, kernel loading) on a batch of padding
        only, which probes, reads and admits nothing. A capture is spoiled by a synchronizing
        CUDA call on any thread of the process (an event query, a pinned allocation), whatever
        the capture mode, so the caller runs this only while no lookup thread works
        (`LookupEngine.warm_up`); Python's collector is paused meanwhile (`utils.graph_capture`)."""
        self.ids.fill_(PAD_ID)
        self._plan()
        self._graphs["plan"] = graph = torch.cuda.CUDAGraph()
        with capture(graph, torch.cuda.current_stream(self.ids.device)):
            self._plan()
        graph.replay()  # the captured buffers now hold the padding's plan
        if self.cache is not None:
            self._admit()
            self._graphs["admit"] = graph = torch.cuda.CUDAGraph()
            with capture(graph, torch.cuda.current_stream(self.ids.device)):
                self._admit()

    def run(self) -> None:
        """The plan of the batch in `ids`, on the current stream (its graph when captured)."""
        graph = self._graphs.get("plan")
        graph.replay() if graph is not None else self._plan()

    def admit(self) -> None:
        """The batch's misses into the cache, on the current stream (after its rows landed)."""
        if self.cache is not None:
            graph = self._graphs.get("admit")
            graph.replay() if graph is not None else self._admit()
            self.cache.note_admission()
