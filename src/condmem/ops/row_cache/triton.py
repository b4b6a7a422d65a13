"""Triton kernels of the `RowCache`: its probe and its admission, each fused into one or two launches.

Written as torch ops, one 16K-token text lookup's probe and admission cost milliseconds of
device time (docs/tables-and-tiers.md): ~35 kernels, most of them moving [n, ways]
or [n, ways, ways] intermediates through HBM (a 100 MB boolean tensor to rank the ways, an
int16 reduction over it, gathers of every newcomer's set, byte rows copied twice before
their scatter) and ~10^5 stores of padding entries to one trash slot. Here each newcomer
or probed id is one row of a block: its set's keys and counters are read once into
registers, the way order is found there, and only real entries store anything
(masked stores: no trash slot, no padding write).

* `probe_kernel`: slot of each id (-1: miss or padding), the hit's counter bumped.
* `choose_slots_kernel` then `write_kernel`: the admission in two launches, so that every
  read of the old set state (the ranks of the ways) happens before any write to it; the
  second writes keys, counters and rows, each row read straight from the caller's buffer.

The torch code of `condmem.tables.row_cache.RowCache` is the reference: tests hold these kernels to it (keys,
counters, rows, returned slots) through the interpreter on the CPU and compiled on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import next_pow2

BLOCK_IDS = 64
SLOT_CHOICE_BLOCK = 32
"""Entries per program of `choose_slots_kernel`: its [BLOCK, WAYS, WAYS] eviction-order compare
lives in registers, BLOCK x WAYS x WAYS values over a program's 128 threads; at 16 ways, 32
entries are 64 values a thread, within the 255 registers a thread holds beside the rest of the
kernel, and 64 entries double that and spill to local memory. Its entries are independent, so
the block size changes no slot."""


@triton.jit
def probe_kernel(
    ids_ptr,
    valid_ptr,
    keys_ptr,
    freq_ptr,
    slot_ptr,
    n,
    n_sets,
    WAYS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Slot of each id (-1: miss, padding or invalid), hit counters bumped."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1)
    ok = inb & (ids >= 0)
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + offs, mask=inb, other=0) != 0)
    sets = tl.where(ok, ids % n_sets, 0)
    ways = tl.arange(0, WAYS)
    slots = sets[:, None] * WAYS + ways[None, :]
    keys = tl.load(keys_ptr + slots, mask=ok[:, None], other=-1)
    match = (keys == ids[:, None]) & ok[:, None]
    hit = tl.max(match.to(tl.int32), axis=1) > 0
    way = tl.sum(tl.where(match, ways[None, :], 0), axis=1)  # at most one way matches
    slot = tl.where(hit, sets * WAYS + way, -1)
    tl.store(slot_ptr + offs, slot, mask=inb)
    if COUNT:
        # Unique ids hit distinct slots: a plain read-add-write is exact.
        freq = tl.load(freq_ptr + slot, mask=hit, other=0)
        tl.store(freq_ptr + slot, freq + 1, mask=hit)


@triton.jit
def choose_slots_kernel(
    sorted_sets_ptr,
    rank_ptr,
    order_ptr,
    ids_ptr,
    keys_ptr,
    freq_ptr,
    slot_ptr,
    n,
    n_sets,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Entry i of the newcomers sorted by set: the slot it takes (-1: not admitted). Reads only."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    sets = tl.load(sorted_sets_ptr + offs, mask=inb, other=n_sets)
    rank = tl.load(rank_ptr + offs, mask=inb, other=WAYS)
    real = inb & (sets < n_sets)  # padding sorts into set n_sets
    order = tl.load(order_ptr + offs, mask=real, other=0)
    ids = tl.load(ids_ptr + order, mask=real, other=-1)
    ways = tl.arange(0, WAYS)
    base = tl.where(real, sets, 0) * WAYS
    keys = tl.load(keys_ptr + base[:, None] + ways[None, :], mask=real[:, None], other=-1)
    freq = tl.load(freq_ptr + base[:, None] + ways[None, :], mask=real[:, None], other=0)
    present = tl.max((keys == ids[:, None]).to(tl.int32), axis=1) > 0
    keep = real & (rank < WAYS) & (present == 0)
    # Eviction order: empty ways first, then live ways by counter, ties by way index; the
    # newcomer of rank r takes the way whose place in that order is r.
    prio = tl.where(keys != -1, freq.to(tl.int64) + 1, 0) * WAYS + ways[None, :]
    place = tl.sum((prio[:, None, :] < prio[:, :, None]).to(tl.int32), axis=2)
    chosen = tl.sum(tl.where(place == rank[:, None], ways[None, :], 0), axis=1)
    tl.store(slot_ptr + offs, tl.where(keep, sets * WAYS + chosen, -1), mask=inb)


@triton.jit
def write_kernel(
    slot_ptr,
    order_ptr,
    ids_ptr,
    src_index_ptr,
    src_ptr,
    keys_ptr,
    freq_ptr,
    data_ptr,
    n,
    row_words,
    WORDS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Keys, counters and rows of the admitted newcomers (slot >= 0) into their slots."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    slot = tl.load(slot_ptr + offs, mask=inb, other=-1)
    ok = inb & (slot >= 0)
    order = tl.load(order_ptr + offs, mask=ok, other=0)
    tl.store(keys_ptr + slot, tl.load(ids_ptr + order, mask=ok), mask=ok)
    tl.store(freq_ptr + slot, tl.full([BLOCK], 1, tl.int32), mask=ok)
    src = order
    if HAS_INDEX:
        src = tl.load(src_index_ptr + order, mask=ok, other=0)
    words = tl.arange(0, WORDS)
    m = ok[:, None] & (words[None, :] < row_words)
    row = tl.load(src_ptr + src[:, None].to(tl.int64) * row_words + words[None, :], mask=m)
    tl.store(data_ptr + slot[:, None] * row_words + words[None, :], row, mask=m)


def _grid(n: int, block: int = BLOCK_IDS) -> tuple[int]:
    return (triton.cdiv(n, block),)


def probe(
    ids: torch.Tensor, valid: torch.Tensor | None, keys: torch.Tensor, freq: torch.Tensor, count: bool
) -> torch.Tensor:
    """Slots of `ids` [n] (int64, -1 on a miss) in the cache of `keys` [n_sets, ways]; see `RowCache.probe`."""
    n = ids.numel()
    slot = torch.empty_like(ids)
    n_sets, ways = keys.shape
    probe_kernel[_grid(n)](
        ids,
        valid if valid is not None else ids,
        keys,
        freq,
        slot,
        n,
        n_sets,
        WAYS=ways,
        HAS_VALID=valid is not None,
        COUNT=count,
        BLOCK=BLOCK_IDS,
    )
    return slot


def admit(
    sorted_sets: torch.Tensor,
    rank: torch.Tensor,
    order: torch.Tensor,
    ids: torch.Tensor,
    keys: torch.Tensor,
    freq: torch.Tensor,
    data_words: torch.Tensor,
    src_words: torch.Tensor,
    src_index: torch.Tensor | None,
) -> torch.Tensor:
    """The admission's slot choice and writes; returns the slot of each sorted newcomer (-1: dropped)."""
    n = ids.numel()
    n_sets, ways = keys.shape
    slot = torch.empty_like(ids)
    choose_slots_kernel[_grid(n, SLOT_CHOICE_BLOCK)](
        sorted_sets, rank, order, ids, keys, freq, slot, n, n_sets, WAYS=ways, BLOCK=SLOT_CHOICE_BLOCK
    )
    row_words = data_words.shape[1]
    write_kernel[_grid(n)](
        slot,
        order,
        ids,
        src_index if src_index is not None else order,
        src_words,
        keys,
        freq,
        data_words,
        n,
        row_words,
        WORDS=next_pow2(row_words),
        HAS_INDEX=src_index is not None,
        BLOCK=BLOCK_IDS,
    )
    return slot
