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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY = -1


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

    Args:
        capacity_rows: slots in total (rounded down to a multiple of `ways`, at least one set).
        row_bytes: bytes per row as stored.
        ways: associativity (slots per set).
        device: where keys, counters and rows live (``cuda`` for the HBM cache).
        decay_every: halve all frequency counters after this many `admit` calls (0: never).

    Example:
        >>> cache = RowCache.from_bytes(8 * 2**30, row_bytes=264, device="cuda")
        >>> slot = cache.probe(unique_ids)                  # -1 where missed
        >>> cache.admit(unique_ids[slot < 0], fetched_rows)
        >>> rows = cache.read(slot[slot >= 0])
    """

    def __init__(self, capacity_rows: int, row_bytes: int, ways: int = 8, device: str | torch.device = "cpu",
                 decay_every: int = 64):
        if capacity_rows < 1 or row_bytes < 1 or ways < 1:
            raise ValueError(f"RowCache needs positive capacity_rows, row_bytes and ways, got "
                             f"{capacity_rows}, {row_bytes}, {ways}")
        self.ways = min(ways, capacity_rows)
        self.n_sets = max(1, capacity_rows // self.ways)
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.decay_every = decay_every
        slots = self.n_sets * self.ways
        # One extra slot past the end, outside the views below: `admit` sends the rows it
        # drops there, so it never has to compact its inputs (a compaction is a host sync).
        self._trash = slots
        self._keys_all = torch.full((slots + 1,), EMPTY, dtype=torch.int64, device=self.device)
        self._freq_all = torch.zeros((slots + 1,), dtype=torch.int32, device=self.device)
        self._data_all = torch.empty((slots + 1, row_bytes), dtype=torch.uint8, device=self.device)
        self.keys = self._keys_all[:slots].view(self.n_sets, self.ways)
        self.freq = self._freq_all[:slots].view(self.n_sets, self.ways)
        self.data = self._data_all[:slots]
        # Counters stay on the device so probing never waits for the host.
        self._counters = torch.zeros(3, dtype=torch.int64, device=self.device)  # lookups, hits, admitted
        self._admissions = 0

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
        lookups, hits, admitted = (int(x) for x in self._counters.tolist())
        return CacheStats(lookups, hits, admitted)

    def reset_stats(self) -> None:
        self._counters.zero_()

    def clear(self) -> None:
        self._keys_all.fill_(EMPTY)
        self._freq_all.zero_()

    # ------------------------------------------------------------------ operations
    def probe(self, ids: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Slot of each id (int64, -1 on a miss); ids must be unique, int64, on the cache's device."""
        if ids.numel() == 0:
            return ids.new_empty(0)
        sets = torch.remainder(ids, self.n_sets)
        match = self.keys[sets] == ids[:, None]                  # [n, ways]
        hit = match.any(dim=1)
        way = match.to(torch.int8).argmax(dim=1)
        slot = torch.where(hit, sets * self.ways + way, torch.full_like(ids, -1))
        if count:
            # Unique ids -> distinct slots, so an indexed add has no collisions.
            flat = self.freq.view(-1)
            flat.index_add_(0, slot.clamp(min=0), hit.to(torch.int32))
            self._counters[0] += ids.numel()
            self._counters[1] += hit.sum()
        return slot

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Raw rows [n, row_bytes] at `slots`."""
        return self.data.index_select(0, slots)

    def admit(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Insert missed `ids` (unique, not cached) with their raw `rows`; returns the slot of each (-1: not admitted).

        Within a set, newcomers take the least-frequent ways; when more ids than ways map
        to one set in a batch, the surplus is not admitted (a one-batch burst must not
        flush the set's hot rows). No host synchronization (fixed-size tensor ops only), so
        a lookup engine can queue it between other work.
        """
        if ids.numel() == 0:
            return ids.new_empty(0)
        if rows.shape != (ids.numel(), self.row_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"admit: rows must be uint8 [{ids.numel()}, {self.row_bytes}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        sets = torch.remainder(ids, self.n_sets)
        # An id already cached (admitted since the caller's probe) is not admitted twice: one
        # key, one slot. Its would-be rank is pushed past the ways so it is dropped below.
        present = (self.keys[sets] == ids[:, None]).any(dim=1)
        order = torch.argsort(sets, stable=True)
        sorted_sets = sets.index_select(0, order)
        # Rank of each newcomer among the newcomers of its set: 0, 1, 2, ...
        first = torch.ones_like(sorted_sets, dtype=torch.bool)
        first[1:] = sorted_sets[1:] != sorted_sets[:-1]
        idx = torch.arange(sorted_sets.numel(), device=ids.device)
        run_start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=0).values
        rank = idx - run_start
        keep = (rank < self.ways) & ~present.index_select(0, order)
        # Ways of each newcomer's set, empty ones first, then from least to most frequent; only
        # the newcomers' sets are sorted, never the whole table of counters. (Empty slots must
        # rank below every live one: a live row whose counter decayed to 0 is still worth keeping.)
        set_freq = self.freq.index_select(0, sorted_sets)
        set_freq = torch.where(self.keys.index_select(0, sorted_sets) == EMPTY, -1, set_freq)
        way_order = torch.argsort(set_freq, dim=1, stable=True)   # [n, ways]
        chosen_way = way_order.gather(1, rank.clamp(max=self.ways - 1)[:, None]).squeeze(1)
        # Kept newcomers get distinct slots; dropped ones all write the trash slot (never probed).
        slot = torch.where(keep, sorted_sets * self.ways + chosen_way, torch.full_like(sorted_sets, self._trash))
        self._keys_all[slot] = ids.index_select(0, order)
        self._freq_all[slot] = 1
        self._data_all[slot] = rows.index_select(0, order.to(rows.device)).to(self.device)
        out = torch.empty_like(ids)
        out[order] = torch.where(keep, slot, torch.full_like(slot, -1))
        self._counters[2] += keep.sum()
        self._admissions += 1
        if self.decay_every and self._admissions % self.decay_every == 0:
            self.freq.bitwise_right_shift_(1)
        return out

    def __repr__(self) -> str:
        return (f"RowCache({self.capacity_rows:,} rows x {self.row_bytes} B = {self.data.numel() / 2**30:.2f} GiB, "
                f"{self.ways}-way, {self.device})")
