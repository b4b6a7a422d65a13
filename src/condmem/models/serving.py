"""Continuous-batching decode for `DecoderLM`: cache rows are sequence slots, each at its own position.

`ServingCache` preallocates, per block, keys and values for ``n_slots`` sequences of up to
``max_len`` tokens, each slot's length, its token history and each Engram layer's
ShortConv state. Sequences join (`prefill` one prompt into a free slot) and leave
(`release`) between steps; `decode_step` advances any set of live slots by one token,
each at its own position (per-row RoPE angles, per-row attention masks). With
``slots=None`` and a ``valid`` mask, a step covers every slot in order and leaves the
rows marked invalid exactly as they were (what a CUDA graph of fixed shape needs: no
index copies of the KV cache, and no host values).

`ragged_step` runs one forward over a flat batch that mixes prefill chunks, decode tokens
and speculative drafts of many slots (what an engine's scheduler packs under a token
budget); each sequence appends its chunk at its own length, and with ``n_commit`` keeps
only the accepted part (the rest of its KV entries are overwritten later, never read).

Engram rows for a step come either from the model's own tables (hashing the last N-1
tokens of each slot's history) or, with ``prepared=``, from an `EngramMemory` lookup
started earlier (`EngramMemory.prepare_decode`, whose history slots should be the same
numbers as these cache slots).
"""

from __future__ import annotations

import torch

from condmem.models.attention import _SDPA_GQA, KVCache, decode_attention
from condmem.models.layers import apply_rotary
from condmem.models.transformer import DecoderLM, InferenceCache, engram_update


class ServingCache:
    """Per-slot decoding state for up to `n_slots` concurrent sequences of `max_len` tokens.

    ``host_lengths`` mirrors each slot's length on the host (kept by `prefill`,
    `release` and the decoders), so schedulers can check capacity without a device sync.
    """

    def __init__(self, model: DecoderLM, n_slots: int, max_len: int | None = None, dtype: torch.dtype | None = None):
        cfg = model.cfg
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        device = model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        shape = (n_slots, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * n_slots
        self.tokens = torch.zeros(n_slots, self.max_len, dtype=torch.long, device=device)
        self.conv: dict[int, torch.Tensor | None] = {}
        for block in model.blocks:
            if block.engram is not None:
                sc = block.engram.short_conv
                self.conv[block.layer_id] = (None if sc is None else torch.zeros(
                    n_slots, (sc.kernel_size - 1) * sc.dilation, 1, cfg.dim, device=device, dtype=dtype))
        self.n_slots = n_slots

    def _row_cache(self, slot: int) -> InferenceCache:
        """An `InferenceCache` whose buffers are views of one slot (prefill writes land in place)."""
        kv = []
        for k, v in zip(self.k, self.v):
            view = KVCache.__new__(KVCache)
            torch.nn.Module.__init__(view)
            view.register_buffer("k", k[slot:slot + 1], persistent=False)
            view.register_buffer("v", v[slot:slot + 1], persistent=False)
            kv.append(view)
        conv = {lid: None if c is None else c[slot:slot + 1] for lid, c in self.conv.items()}
        return InferenceCache(kv=kv, conv=conv, tokens=self.tokens[slot:slot + 1], length=0)

    def release(self, slot: int) -> None:
        """Forget a finished sequence (its slot is reset; the next prefill overwrites it)."""
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0
        for c in self.conv.values():
            if c is not None:
                c[slot].zero_()

    def check_room(self, slots) -> None:
        """Raise if a slot in `slots` (host ints) has no position left for one more token."""
        full = [s for s in slots if self.host_lengths[s] >= self.max_len]
        if full:
            raise ValueError(f"slot(s) {full} reached the cache's {self.max_len} positions")

    def advance(self, slots) -> None:
        """Host mirror of a decode step over `slots` (host ints)."""
        for s in slots:
            self.host_lengths[s] += 1


@torch.no_grad()
def prefill(model: DecoderLM, cache: ServingCache, slot: int, ids: torch.Tensor, prepared=None,
            last_only: bool = False) -> torch.Tensor:
    """Run prompt `ids` [T] into `slot` (which must be empty); returns logits [T, vocab] ([1, vocab] with `last_only`)."""
    if cache.host_lengths[slot] != 0:
        raise ValueError(f"slot {slot} holds a live sequence; release it first")
    if ids.numel() > cache.max_len:
        raise ValueError(f"a prompt of {ids.numel()} tokens does not fit the cache's {cache.max_len} positions")
    cache.release(slot)
    logits = model(ids[None].to(cache.tokens.device), cache=cache._row_cache(slot), prepared=prepared,
                   last_only=last_only)[0]
    cache.lengths[slot] = ids.numel()
    cache.host_lengths[slot] = ids.numel()
    return logits


@torch.no_grad()
def prefill_batch(model: DecoderLM, cache: ServingCache, slots: list[int], prompts: list[torch.Tensor],
                  prepared=None, pad_to: int = 1) -> torch.Tensor:
    """Run several prompts in one forward (right-padded to the longest); returns last-token logits [B, vocab].

    One forward over B prompts launches the kernels of one, so a GPU that a single short
    prompt leaves idle between launches stays busy. Right padding is invisible to the real
    tokens (causal attention); the padded positions' keys land past each slot's length,
    where decode overwrites them before reading. `prepared` must come from
    ``memory.prepare(padded_ids(prompts), slots=..., lengths=...)``. Models with a
    ShortConv are prefilled one prompt at a time (its state must end at each row's own
    length). `pad_to` rounds the padded width up to a multiple (fewer distinct shapes for
    the GEMM heuristics and the allocator; pass the same value to `padded_ids` for the
    memory), capped at the cache length.
    """
    if len(slots) != len(prompts) or not prompts:
        raise ValueError(f"{len(slots)} slots for {len(prompts)} prompts")
    for slot, ids in zip(slots, prompts):
        if cache.host_lengths[slot] != 0:
            raise ValueError(f"slot {slot} holds a live sequence; release it first")
        if ids.numel() > cache.max_len or ids.numel() == 0:
            raise ValueError(f"a prompt of {ids.numel()} tokens does not fit the cache's {cache.max_len} positions")
    if any(c is not None for c in cache.conv.values()):
        if prepared is not None and len(prompts) > 1:
            raise ValueError("a model with a ShortConv prefills one prompt at a time")
        return torch.cat([prefill(model, cache, s, p, prepared=prepared, last_only=True) for s, p in zip(slots, prompts)])
    device = cache.tokens.device
    ids, lengths = padded_ids(prompts, pad_to, cache.max_len)
    batch, width = ids.shape
    temp = model.new_cache(batch, width)
    lengths_dev = lengths.to(device)
    logits = model(ids.to(device), cache=temp, prepared=prepared, logits_at=lengths_dev - 1)[:, 0]
    index = torch.tensor(slots, dtype=torch.long).to(device)
    for i in range(len(cache.k)):
        cache.k[i][index, :, :width] = temp.kv[i].k
        cache.v[i][index, :, :width] = temp.kv[i].v
    cache.tokens[index, :width] = temp.tokens
    cache.lengths[index] = lengths_dev
    for slot, ids_row in zip(slots, prompts):
        cache.host_lengths[slot] = ids_row.numel()
    return logits


def padded_ids(prompts: list[torch.Tensor], pad_to: int = 1, max_width: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [T_i] -> (right-padded ids [B, W] on the prompts' device, lengths [B] on the CPU).

    W is the longest prompt rounded up to a multiple of `pad_to` (at most `max_width`).
    """
    lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
    width = -(-int(lengths.max()) // pad_to) * pad_to
    if max_width is not None:
        width = max(int(lengths.max()), min(width, max_width))
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=prompts[0].device)
    for i, p in enumerate(prompts):
        ids[i, : p.numel()] = p
    return ids, lengths


def _masked_put(dest: torch.Tensor, index: tuple, new: torch.Tensor, valid: torch.Tensor | None) -> None:
    """dest[index] = new, except rows where `valid` is False keep their old value."""
    new = new.to(dest.dtype)
    if valid is not None:
        old = dest[index]
        new = torch.where(valid.view(-1, *([1] * (new.dim() - 1))), new, old)
    dest[index] = new


@torch.no_grad()
def decode_step(model: DecoderLM, cache: ServingCache, slots: torch.Tensor | None, ids: torch.Tensor,
                prepared=None, check: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per live slot; returns logits [B, vocab].

    Args:
        slots: [B] distinct slots to advance, or None for every slot in order (B = n_slots;
            the KV cache is then read in place, without index copies).
        ids: [B] new token ids.
        valid: optional bool [B]; False rows compute but change nothing (graph padding).
        check: test that no advanced slot is full (a host sync; off inside CUDA graphs).
    """
    cfg = model.cfg
    device = cache.tokens.device
    ids = ids.to(device)
    batch = ids.numel()
    rows = torch.arange(batch, device=device) if slots is None else slots.to(device)
    if slots is None and batch != cache.n_slots:
        raise ValueError(f"slots=None covers all {cache.n_slots} slots; got {batch} ids")
    pos = cache.lengths[rows]                                      # [B] position of the new token
    if check:
        over = pos >= cache.max_len if valid is None else (pos >= cache.max_len) & valid
        if bool(over.any()):
            raise ValueError(f"a sequence reached the cache's {cache.max_len} positions")
    at = pos.clamp(max=cache.max_len - 1)                          # invalid rows may sit at a full slot
    _masked_put(cache.tokens, (rows, at), ids, valid)
    x = model.embed(ids)[:, None]                                  # [B, 1, D]
    cos = model.rotary.cos[at][:, None, None, :]                   # [B, 1, 1, hd/2]
    sin = model.rotary.sin[at][:, None, None, :]
    rows_all = None
    if cfg.engram is not None and prepared is None:
        # Each slot's last N tokens; look-backs before its start are blocked (read as pad).
        n = cfg.engram.max_ngram_size
        back = at[:, None] - torch.arange(n - 1, -1, -1, device=device)[None, :]        # [B, N]
        window = cache.tokens[rows[:, None], back.clamp(min=0)]
        rows_all = model.hasher(window, blocked=back < 0, check=False)[:, -1:]          # [B, 1, L, C]
    keys_seen = torch.arange(cache.max_len, device=device)[None, :] <= at[:, None]     # [B, max_len]
    layer_slot = 0
    for i, block in enumerate(model.blocks):
        if block.engram is not None:
            lid = block.layer_id
            if prepared is not None:
                row_ids, looked_up = prepared.row_ids(lid), prepared.rows(lid)   # waits for this layer's rows
            else:
                row_ids, looked_up = rows_all[:, :, layer_slot], None
            layer_slot += 1
            conv = cache.conv[lid]
            state = None if conv is None else conv[rows]
            x = x + engram_update(block.engram, x, row_ids, state, looked_up=looked_up)
            if conv is not None:
                _masked_put(conv, (rows,), state, valid)
        attn = block.attn
        h = block.attn_norm(x)
        q = attn.wq(h).view(batch, 1, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.wk(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.wv(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        _masked_put(cache.k[i], (rows, slice(None), at), k[:, :, 0], valid)
        _masked_put(cache.v[i], (rows, slice(None), at), v[:, :, 0], valid)
        keys = cache.k[i] if slots is None else cache.k[i][rows]
        values = cache.v[i] if slots is None else cache.v[i][rows]
        y = decode_attention(q, keys.to(q.dtype), values.to(q.dtype), keys_seen)
        x = x + attn.wo(y.transpose(1, 2).reshape(batch, 1, -1))
        x = x + block.mlp(block.mlp_norm(x))
    _masked_put(cache.lengths, (rows,), pos + 1, valid)
    if slots is not None:   # host mirror (a sync for device slots; graphs pass slots=None)
        cache.advance((slots if valid is None else slots[valid.to(slots.device)]).tolist())
    return model.lm_head(model.norm(x))[:, 0]


@torch.no_grad()
def ragged_step(model: DecoderLM, cache: ServingCache, slots: list[int], chunks: list[torch.Tensor],
                prepared=None, n_commit: list[int] | None = None) -> torch.Tensor:
    """One forward over a flat batch of chunks; returns logits of every token [n, vocab].

    Args:
        slots: host slot of each sequence (distinct; a new sequence's slot is empty).
        chunks: [L_b] token ids appended at each slot's length: a prefill chunk, one decode
            token, or the last sampled token followed by draft tokens.
        prepared: optional `Prepared` from ``EngramMemory.prepare_ragged`` of the same batch
            (history slots numbered like these cache slots); else the model's own tables.
        n_commit: tokens of each chunk the sequence keeps (speculative verification: 1 +
            accepted drafts); default all. The memory's histories advance separately
            (``EngramMemory.commit``).
    """
    import torch.nn.functional as F

    cfg = model.cfg
    if any(c is not None for c in cache.conv.values()):
        raise ValueError("ragged_step serves models without a ShortConv (its state would need per-chunk handling); "
                         "use prefill / decode_step")
    if len(slots) != len(chunks) or not chunks or len(set(slots)) != len(slots):
        raise ValueError(f"{len(slots)} slots for {len(chunks)} chunks; slots must be distinct and non-empty")
    lengths = [int(c.numel()) for c in chunks]
    starts = [cache.host_lengths[s] for s in slots]
    for s, st, n in zip(slots, starts, lengths):
        if n == 0 or st + n > cache.max_len:
            raise ValueError(f"slot {s}: a chunk of {n} tokens at position {st} does not fit {cache.max_len} positions")
    keep = lengths if n_commit is None else [max(0, min(int(k), n)) for k, n in zip(n_commit, lengths)]
    device = cache.tokens.device
    ids = torch.cat([c.reshape(-1) for c in chunks]).to(device)
    n = ids.numel()
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    pos = torch.cat([torch.arange(st, st + length) for st, length in zip(starts, lengths)]).to(device)
    slot_of = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths)).to(device)
    cache.tokens[slot_of, pos] = ids
    rows_all = None
    if cfg.engram is not None and prepared is None:
        # Each chunk looks back at the N-1 tokens its slot holds before it.
        depth = cfg.engram.max_ngram_size - 1
        back = torch.tensor(starts)[:, None] - torch.arange(depth, 0, -1)[None, :]          # [B, N-1], oldest first
        lookback = cache.tokens[torch.tensor(slots)[:, None].to(device), back.clamp(min=0).to(device)]
        lookback = torch.where(back.to(device) >= 0, lookback, torch.full_like(lookback, -1))
        rows_all = model.hasher.hash_ragged(ids, torch.tensor(cu, device=device), lookback_ids=lookback,
                                            check=False)
    x = model.embed(ids)[None]                                                           # [1, n, D]
    cos, sin = model.rotary.cos[pos], model.rotary.sin[pos]                              # [n, hd/2]
    layer_slot = 0
    for i, block in enumerate(model.blocks):
        if block.engram is not None:
            lid = block.layer_id
            if prepared is not None:
                x = x + block.engram(x, prepared.row_ids(lid), rows=prepared.rows(lid))
            else:
                x = x + block.engram(x, rows_all[None, :, layer_slot])
            layer_slot += 1
        attn = block.attn
        h = block.attn_norm(x)
        q = attn.wq(h).view(1, n, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.wk(h).view(1, n, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.wv(h).view(1, n, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.k[i][slot_of, :, pos] = k[0].transpose(0, 1).to(cache.k[i].dtype)
        cache.v[i][slot_of, :, pos] = v[0].transpose(0, 1).to(cache.v[i].dtype)
        ys = []
        for b, (s, st, length) in enumerate(zip(slots, starts, lengths)):
            keys = cache.k[i][s : s + 1, :, : st + length].to(q.dtype)
            values = cache.v[i][s : s + 1, :, : st + length].to(q.dtype)
            qb = q[:, :, cu[b] : cu[b + 1]]
            # Query j of the chunk sits at position st + j and sees keys 0..st + j.
            mask = torch.arange(st + length, device=device)[None, :] <= (st + torch.arange(length, device=device))[:, None]
            if attn.n_kv_heads != attn.n_heads and not _SDPA_GQA:
                rep = attn.n_heads // attn.n_kv_heads
                keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
            kwargs = {"enable_gqa": True} if attn.n_kv_heads != attn.n_heads and _SDPA_GQA else {}
            ys.append(F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, **kwargs))
        y = torch.cat(ys, dim=2)
        x = x + attn.wo(y.transpose(1, 2).reshape(1, n, -1))
        x = x + block.mlp(block.mlp_norm(x))
    for s, st, k in zip(slots, starts, keep):
        cache.host_lengths[s] = st + k
    cache.lengths[torch.tensor(slots, device=device)] = torch.tensor([st + k for st, k in zip(starts, keep)],
                                                                      device=device)
    return model.lm_head(model.norm(x))[0]
