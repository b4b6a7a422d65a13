"""A set-associative cache of table rows, probed and filled with tensor ops on its own device.

In front of a host or disk table, an HBM `RowCache` serves the rows of frequent n-grams
(n-gram frequencies are Zipfian: a small fraction of rows takes most reads), so those
never cross PCIe. The same class, on the CPU, is the DRAM cache in front of a disk tier.

Design (all steps are vectorized torch; no Python loop over rows):

* ``n_sets x ways`` slots; a row id lives only in set ``id % n_sets`` (row ids are hash
  outputs, so sets fill evenly);
* `probe` compares the id with its set's ``ways`` keys: hit -> slot, miss -> -1; hits
  bump a per-slot frequency counter;
* `admit` places missed rows into their sets, evicting the least-frequent ways (a
  frequency-based policy keeps the hot head of a Zipfian stream; counters are halved
  every `decay_every` admissions so yesterday's heavy hitters can leave);
* the cache never changes a value: a hit returns exactly the bytes that were admitted
  for that id, so cached and uncached lookups are bit-identical.

Rows are stored as raw bytes (uint8 [slots, row_bytes]) in the table's own format
(bf16, fp8 or interleaved fp8+scales), so the cache is format-agnostic.

On CUDA, probe and admission run as Triton kernels (`condmem.ops.row_cache`: one launch for
the probe, two for the admission; ~10x less device time than the torch ops, which remain
the reference and the CPU path). Both give the same keys, counters, rows and slots.

Threads: every method runs under the cache's reentrant `RowCache.lock`, so concurrent
callers never tear its keys, counters or rows apart. A slot from `probe` names its row only
until the next admission, so a caller that shares the cache with other threads holds
``cache.lock`` from `probe` through `read` (`DramCachedStore` and `LookupEngine` do).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from condmem.ops.triton_util import resolve_backend
from condmem.utils.renamed import renamed_keywords

EMPTY = -1


INT_WORDS = (torch.int64, torch.int32, torch.int16)
FLOAT_WORDS = (torch.float32, torch.float16)


def row_words(rows: torch.Tensor, dtypes: tuple[torch.dtype, ...] = INT_WORDS) -> torch.Tensor:
    """Raw uint8 rows [n, row_bytes] viewed as the widest of `dtypes` whose size divides a row
    (the rows themselves when none does): a row scatter then moves 33 words of 8 B per 264 B
    row instead of 264 single bytes."""
    for dtype in dtypes:
        if rows.shape[-1] % dtype.itemsize == 0:
            return rows.view(dtype)
    return rows


@dataclass
class CacheStats:
    """Counters since the last `reset_stats`."""

    lookups: int = 0
    hits: int = 0
    admitted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class RowCache:
    """Fixed-capacity set-associative row cache.

    Thread-safe: each method runs under `lock` (reentrant). A slot returned by `probe` stays
    valid only until the next admission; callers sharing the cache across threads hold
    ``with cache.lock:`` from `probe` through `read`. On CUDA the lock orders the host calls;
    the kernels run in their streams' order, so a CUDA cache serves one `LookupEngine`.

    Args:
        capacity_rows: slots in total (rounded down to a multiple of `ways`, at least one set).
        row_bytes: bytes per row as stored.
        ways: associativity (slots per set).
        device: where keys, counters and rows live (``cuda`` for the HBM cache).
        decay_every: halve all frequency counters after this many `admit` calls (0: never).
        backend: "auto" (the Triton kernels on CUDA when `ways` is a power of two, else the
            torch ops), "triton" or "torch".

    Example:
        >>> cache = RowCache.from_bytes(8 * 2**30, row_bytes=264, device="cuda")
        >>> slot = cache.probe(unique_ids)                  # -1 where missed
        >>> cache.admit(unique_ids[slot < 0], fetched_row_vectors)
        >>> row_vectors = cache.read(slot[slot >= 0])
    """

    def __init__(
        self,
        capacity_rows: int,
        row_bytes: int,
        ways: int = 8,
        device: str | torch.device = "cpu",
        decay_every: int = 64,
        backend: str = "auto",
    ):
        if capacity_rows < 1 or row_bytes < 1 or ways < 1:
            raise ValueError(
                f"RowCache needs positive capacity_rows, row_bytes and ways, got {capacity_rows}, {row_bytes}, {ways}"
            )
        self.ways = min(ways, capacity_rows)
        self.n_sets = max(1, capacity_rows // self.ways)
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.decay_every = decay_every
        self.backend = resolve_backend(backend, self.device, "RowCache")
        if self.backend == "triton" and self.ways & (self.ways - 1):
            if backend == "triton":
                raise ValueError(f"RowCache: the Triton kernels need a power-of-two number of ways, got {self.ways}")
            self.backend = "torch"
        slots = self.n_sets * self.ways
        # A trash slot past the end, outside the views below: the torch path's `admit` sends
        # the rows it drops there, so it never has to compact its inputs (a compaction is a
        # host sync). (The Triton kernels store nothing for them.)
        self._trash = slots
        total = slots + 1
        self._keys_all = torch.full((total,), EMPTY, dtype=torch.int64, device=self.device)
        self._freq_all = torch.zeros((total,), dtype=torch.int32, device=self.device)
        self._data_all = torch.empty((total, row_bytes), dtype=torch.uint8, device=self.device)
        self.keys = self._keys_all[:slots].view(self.n_sets, self.ways)
        self.freq = self._freq_all[:slots].view(self.n_sets, self.ways)
        self.data = self._data_all[:slots]
        # Counters stay on the device so probing never waits for the host.
        self._counters = torch.zeros(3, dtype=torch.int64, device=self.device)  # lookups, hits, admitted
        self._admissions = 0
        self.lock = threading.RLock()
        """Held by every method; hold it yourself across `probe` -> `read` when other threads admit."""

    @classmethod
    def from_bytes(cls, capacity_bytes: int, row_bytes: int, **kwargs) -> RowCache:
        """A cache holding as many rows as fit in `capacity_bytes` (keys and counters extra, 12 B/slot)."""
        return cls(max(1, int(capacity_bytes) // row_bytes), row_bytes, **kwargs)

    @property
    def capacity_rows(self) -> int:
        return self.n_sets * self.ways

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.keys.numel() * 8 + self.freq.numel() * 4

    @property
    def stats(self) -> CacheStats:
        """Lookups, hits and admissions since the last `reset_stats` (reads device counters: a sync)."""
        with self.lock:
            lookups, hits, admitted = (int(x) for x in self._counters.tolist())
        return CacheStats(lookups, hits, admitted)

    def reset_stats(self) -> None:
        with self.lock:
            self._counters.zero_()

    def clear(self) -> None:
        with self.lock:
            self._keys_all.fill_(EMPTY)
            self._freq_all.zero_()

    # ------------------------------------------------------------------ operations
    def probe(self, ids: torch.Tensor, count: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Slot of each id (int64, -1 on a miss); ids must be unique, int64, on the cache's device.

        `valid`: optional bool mask; ids where it is False (padding) always miss and are not counted.
        """
        if ids.numel() == 0:
            return ids.new_empty(0)
        with self.lock:
            return self._probe(ids, count, valid)

    def _probe(self, ids: torch.Tensor, count: bool, valid: torch.Tensor | None) -> torch.Tensor:
        if self.backend == "triton":
            from condmem.ops.row_cache import triton as cache_kernels

            slot = cache_kernels.probe(ids, valid, self.keys, self._freq_all, count)
            hit = slot >= 0
        else:
            sets = torch.remainder(ids, self.n_sets)
            match = self.keys.index_select(0, sets) == ids[:, None]  # [n, ways]
            hit = match.any(dim=1)
            if valid is not None:
                hit &= valid
            way = match.to(torch.int8).argmax(dim=1)
            slot = torch.where(hit, sets * self.ways + way, torch.full_like(ids, -1))
            if count:
                # Unique ids -> distinct hit slots, so a plain read-add-write is exact; misses bump
                # trash slots (a gather and a scatter: cheaper than an atomic index_add).
                bump = torch.where(hit, slot, self._trash)
                self._freq_all[bump] = self._freq_all.index_select(0, bump) + 1
        if count:
            self._counters[0] += ids.numel() if valid is None else valid.sum()
            self._counters[1] += hit.sum()
        return slot

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Raw rows [n, row_bytes] at `slots` (slots of a `probe` made under the same hold of `lock`
        when other threads admit)."""
        with self.lock:
            return row_words(self.data).index_select(0, slots).view(torch.uint8)

    @renamed_keywords(rows="row_vectors")
    def admit(self, ids: torch.Tensor, row_vectors: torch.Tensor) -> torch.Tensor:
        """Insert missed `ids` (unique, not cached) with their raw `row_vectors`; returns the slot of each
        (-1: not admitted).

        Within a set, newcomers take the least-frequent ways; when more ids than ways map
        to one set in a batch, the surplus is not admitted (a one-batch burst must not
        flush the set's hot rows). No host synchronization (fixed-size tensor ops only), so
        a lookup engine can queue it between other work.
        """
        if ids.numel() == 0:
            return ids.new_empty(0)
        with self.lock:
            out = self.admit_rows(ids, row_vectors)
            self.note_admission()
        return out

    def note_admission(self) -> None:
        """Count one admission and decay the counters when due (host-side bookkeeping of `admit`,
        kept apart from `admit_rows` so that one can be captured in a CUDA graph)."""
        with self.lock:
            self._admissions += 1
            if self.decay_every and self._admissions % self.decay_every == 0:
                self.freq.bitwise_right_shift_(1)

    @renamed_keywords(rows="row_vectors")
    def admit_rows(
        self,
        ids: torch.Tensor,
        row_vectors: torch.Tensor,
        valid: torch.Tensor | None = None,
        row_index: torch.Tensor | None = None,
        return_slots: bool = True,
    ) -> torch.Tensor | None:
        """The device work of `admit` (fixed shapes, no host sync: capturable in a CUDA graph).

        `valid`: optional bool mask; ids where it is False (padding) are ignored: never
        admitted, and they take no way from a real newcomer.
        `row_index`: optional; newcomer i's row is ``row_vectors[row_index[i]]`` (read in place, not
        gathered into a copy first).
        `return_slots`: False returns None (one scatter less).
        """
        with self.lock:
            return self._admit_rows(ids, row_vectors, valid, row_index, return_slots)

    def _admit_rows(self, ids, row_vectors, valid, row_index, return_slots):
        n_rows = ids.numel() if row_index is None else row_vectors.shape[0]
        if row_vectors.dim() != 2 or row_vectors.shape != (n_rows, self.row_bytes) or row_vectors.dtype != torch.uint8:
            raise ValueError(
                f"admit: row_vectors must be uint8 [{n_rows}, {self.row_bytes}], "
                f"got {row_vectors.dtype} {tuple(row_vectors.shape)}"
            )
        if row_index is not None and row_index.shape != ids.shape:
            raise ValueError(
                f"admit: row_index must be shaped like ids {tuple(ids.shape)}, got {tuple(row_index.shape)}"
            )
        sets = torch.remainder(ids, self.n_sets)
        if valid is not None:
            # Padding sorts into a set of its own past the last one, out of every real set's ranks.
            sets = torch.where(valid, sets, self.n_sets)
        sorted_sets, order = torch.sort(sets, stable=True)
        # Rank of each newcomer among the newcomers of its set: 0, 1, 2, ... (its distance from
        # the first newcomer of the same set in the sorted order).
        idx = torch.arange(sorted_sets.numel(), device=ids.device)
        rank = idx - torch.searchsorted(sorted_sets, sorted_sets)
        if self.backend == "triton" and row_vectors.device == self.device:
            from condmem.ops.row_cache import triton as cache_kernels

            slot = cache_kernels.admit(
                sorted_sets,
                rank,
                order,
                ids,
                self.keys,
                self._freq_all,
                row_words(self.data),
                row_words(row_vectors),
                row_index,
            )
            kept = slot >= 0
        else:
            slot, kept = self._admit_sorted(ids, row_vectors, row_index, sorted_sets, order, rank)
        self._counters[2] += kept.sum()
        if not return_slots:
            return None
        out = torch.empty_like(ids)
        out[order] = slot
        return out

    def _admit_sorted(self, ids, row_vectors, row_index, sorted_sets, order, rank):
        """The torch admission (reference and CPU path): (slot of each sorted newcomer or -1, kept mask).
        Padding sorts into set ``n_sets`` (see `admit_rows`)."""
        ids_sorted = ids.index_select(0, order)
        real_sets = sorted_sets.clamp(max=self.n_sets - 1)
        set_keys = self.keys.index_select(0, real_sets)  # [n, ways]
        # An id already cached (admitted since the caller's probe) is not admitted twice: one
        # key, one slot; padding is never admitted.
        present = (set_keys == ids_sorted[:, None]).any(dim=1) | (sorted_sets == self.n_sets)
        keep = (rank < self.ways) & ~present
        # The newcomer of rank r takes its set's r-th way in eviction order: empty ways first,
        # then live ways from least to most frequent, ties by way index. (Empty ways must rank
        # below every live one: a live row whose counter decayed to 0 is still worth keeping.)
        # Only the newcomers' sets are looked at, never the whole table of counters; the
        # order is found by counting, per way, the ways that precede it (no segmented sort).
        ways = torch.arange(self.ways, device=ids.device)
        live = set_keys != EMPTY
        prio = torch.where(live, self.freq.index_select(0, real_sets).to(torch.int64) + 1, 0)
        key = prio * self.ways + ways  # [n, ways], distinct per row
        position = (key[:, None, :] < key[:, :, None]).sum(dim=2, dtype=torch.int16)  # [n, ways]: place in the order
        chosen_way = (position == rank.clamp(max=self.ways - 1)[:, None]).to(torch.int8).argmax(dim=1)
        # Kept newcomers get distinct slots; dropped ones write trash slots (never probed).
        slot = torch.where(keep, sorted_sets * self.ways + chosen_way, self._trash)
        self._keys_all[slot] = ids_sorted
        self._freq_all.index_fill_(0, slot, 1)
        # Each kept newcomer's row, read once (through `row_index` when given).
        src = order if row_index is None else row_index.index_select(0, order)
        row_words(self._data_all)[slot] = (
            row_words(row_vectors).index_select(0, src.to(row_vectors.device)).to(self.device)
        )
        return torch.where(keep, slot, torch.full_like(slot, -1)), keep

    def __repr__(self) -> str:
        return (
            f"RowCache({self.capacity_rows:,} rows x {self.row_bytes} B = {self.data.numel() / 2**30:.2f} GiB, "
            f"{self.ways}-way, {self.device})"
        )
