"""`ServingCache`: the decoding state of up to ``n_slots`` concurrent sequences, keys and values in a paged pool.

Slot s owns the blocks listed in row s of the block table; the attention kernels
(`condmem.ops.attention`) read through it, each slot only up to its own length. Besides the
keys and values a slot holds its look-back (an `NgramHistory` by position: what the model's own
tables hash) and each Engram layer's ShortConv state. The step functions that fill and advance it are `steps.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from condmem.hashing import NgramHistory
from condmem.models.transformer import DecoderLM
from condmem.utils.device_copy import to_device


class ServingCache:
    """Per-slot decoding state for up to `n_slots` concurrent sequences of `max_len` tokens.

    Keys and values of each block live in a paged pool, ``k_pool[i]`` / ``v_pool[i]``
    [n_blocks, block_size, n_kv_heads, head_dim], and slot s owns the blocks of row s of
    ``block_table`` (int32 [n_slots, blocks_per_slot]); the attention kernels read through
    the table (`condmem.ops.attention`) and each slot's own length, never past it. A block
    is stored heads-outer ([n_kv_heads, block_size, head_dim] in memory, the pool a strided
    view of it): one head's keys of a block are contiguous, which the decode kernel reads
    ~7% faster than a position's heads together (`benchmarks/kernel_sweep.py`).
    `store_prefix`, `prefix` and `copy_prefix` write, read and share a slot's first
    positions through the table; `adopt` takes over a prompt's state from a model forward.

    ``host_lengths`` mirrors each slot's length on the host (kept by `prefill`,
    `release` and the decoders), so schedulers can check capacity without a device sync.
    """

    def __init__(
        self,
        model: DecoderLM,
        n_slots: int,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        block_size: int = 16,
    ):
        cfg = model.cfg
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        device = model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        self.block_size = block_size
        per_slot = -(-self.max_len // block_size)
        # The attention modules' own head counts: a tensor-parallel rank holds its heads only.
        n_kv, head_dim = model.blocks[0].attn.n_kv_heads, model.blocks[0].attn.head_dim
        shape = (n_slots * per_slot, n_kv, block_size, head_dim)
        self.k_pool = [torch.zeros(shape, device=device, dtype=dtype).transpose(1, 2) for _ in model.blocks]
        self.v_pool = [torch.zeros(shape, device=device, dtype=dtype).transpose(1, 2) for _ in model.blocks]
        self.block_table = torch.arange(n_slots * per_slot, dtype=torch.int32, device=device).view(n_slots, per_slot)
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * n_slots
        self.device = device
        self.history: NgramHistory = model.new_history(n_slots, self.max_len)
        """The slots' look-back, by position."""
        self.conv: dict[int, torch.Tensor | None] = {}
        for block in model.blocks:
            if block.engram is not None:
                sc = block.engram.short_conv
                self.conv[block.layer_id] = (
                    None
                    if sc is None
                    else torch.zeros(
                        n_slots, (sc.kernel_size - 1) * sc.dilation, 1, cfg.dim, device=device, dtype=dtype
                    )
                )
        self.n_slots = n_slots

    @property
    def tokens(self) -> torch.Tensor:
        """int64 [n_slots, max_len]: each slot's token ids by position (held by its look-back, `history`)."""
        return self.history.tokens

    def live_kv_bytes(self, lengths) -> int:
        """Bytes of keys and values that attention reads for sequences of `lengths` tokens (all layers)."""
        per_token = sum(2 * p[0, 0].numel() * p.element_size() for p in self.k_pool)
        return per_token * int(sum(int(n) for n in lengths))

    def _blocks(self, slots, n: int) -> torch.Tensor:
        """Pool indices (long) of the blocks that hold positions 0..n-1 of `slots` (through the table)."""
        if not 0 <= n <= self.max_len:
            raise ValueError(f"{n} positions: the cache holds 0..{self.max_len}")
        host = not (isinstance(slots, torch.Tensor) and slots.is_cuda)  # device slots: checked by the caller, no sync
        bad = [s for s in torch.as_tensor(slots).reshape(-1).tolist() if not 0 <= s < self.n_slots] if host else []
        if bad:
            raise ValueError(f"slot(s) {bad} outside the cache's 0..{self.n_slots - 1}")
        return self.block_table[slots, : -(-n // self.block_size)].long()

    def store_prefix(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write dense keys and values k, v [B, n_kv_heads, W, head_dim] of layer `layer` into
        positions 0..W-1 of `slots` (long [B]); the rest of the last block written is zeros."""
        batch, n_kv, width, head_dim = k.shape
        n_kv_pool, head_dim_pool = self.k_pool[layer].shape[2:]
        if v.shape != k.shape or (n_kv, head_dim) != (n_kv_pool, head_dim_pool) or slots.numel() != batch:
            raise ValueError(
                f"k, v must both be [{slots.numel()}, {n_kv_pool}, W, {head_dim_pool}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        ids = self._blocks(slots, width)
        pad = ids.shape[1] * self.block_size - width
        for pool, dense in ((self.k_pool[layer], k), (self.v_pool[layer], v)):
            dense = F.pad(dense.to(pool.dtype), (0, 0, 0, pad))
            pool[ids] = dense.view(batch, n_kv, ids.shape[1], self.block_size, head_dim).permute(0, 2, 3, 1, 4)

    def prefix(self, layer: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values [n_kv_heads, n, head_dim] of `slot`'s first `n` positions."""
        ids = self._blocks(slot, n)
        return tuple(
            pool[ids].reshape(-1, *pool.shape[2:])[:n].transpose(0, 1)
            for pool in (self.k_pool[layer], self.v_pool[layer])
        )

    def adopt(self, slots: list[int], temp, lengths: list[int]) -> None:
        """Take over what a model forward left in `temp` (an `InferenceCache` whose row j holds
        slot ``slots[j]``'s prompt from position 0): every layer's keys and values, the token
        ids and the ShortConv state; slot ``slots[j]`` then holds ``lengths[j]`` tokens."""
        index = to_device(slots, self.device, torch.long)
        for i, kv in enumerate(temp.kv):
            self.store_prefix(i, index, kv.k, kv.v)
        self.history.copy_rows(index, temp.history, temp.max_len)
        for lid, c in self.conv.items():
            if c is not None:
                c[index] = temp.conv[lid]
        self.lengths[index] = to_device(lengths, self.lengths.device, self.lengths.dtype)
        for slot, n in zip(slots, lengths):
            self.host_lengths[slot] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give slot `dst` the keys, values and token ids of slot `src`'s first `n` positions
        (a shared prompt prefix); lengths are left to the caller."""
        src_ids, dst_ids = self._blocks(src, n), self._blocks(dst, n)
        for pool in (*self.k_pool, *self.v_pool):
            pool[dst_ids] = pool[src_ids]
        self.history.copy_prefix(src, dst, n)

    def release(self, slot: int) -> None:
        """Forget a finished sequence (its slot is reset; the next prefill overwrites it)."""
        self.lengths[slot].zero_()  # a fill kernel: assigning a Python 0 would copy it from the host, a sync
        self.host_lengths[slot] = 0
        for c in self.conv.values():
            if c is not None:
                c[slot].zero_()

    def check_free(self, slot: int) -> None:
        """Raise unless `slot` (a host int) is one of the cache's and holds no live sequence."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} outside the cache's 0..{self.n_slots - 1}")
        if self.host_lengths[slot] != 0:
            raise ValueError(f"slot {slot} holds a live sequence; release it first")

    def check_room(self, slots) -> None:
        """Raise if a slot in `slots` (host ints) has no position left for one more token."""
        full = [s for s in slots if self.host_lengths[s] >= self.max_len]
        if full:
            raise ValueError(f"slot(s) {full} reached the cache's {self.max_len} positions")

    def advance(self, slots) -> None:
        """Host mirror of a decode step over `slots` (host ints)."""
        for s in slots:
            self.host_lengths[s] += 1
