"""The serving forward of `DecoderLM`: prefill and decode steps over the paged `ServingCache`, each slot
at its own position.

Why a second forward beside `DecoderLM.forward`: serving runs flat batches of many sequences,
each at its own length, with keys and values in a paged pool read through a block table, which
the training forward's dense [B, T] shapes and contiguous `KVCache` cannot express. The blocks'
modules (and their weights) are the model's own; only the way a step walks them differs.

Sequences join (`prefill_packed`: several prompts in one forward over their packed tokens;
`prefill`: one prompt) and leave (`ServingCache.release`) between steps; `decode_step`
advances any set of live slots by one token, each at its own position, attention reading each
slot's own keys (`condmem.ops.attention`). With ``slots=None`` and a ``valid`` mask, a step
covers every slot in order and leaves the rows marked invalid exactly as they were (what a
CUDA graph of fixed shape needs: no index copies of the KV cache, and no host values).

`ragged_step` runs one forward over a flat batch that mixes prefill chunks, decode tokens
and speculative drafts of many slots (what an engine's scheduler packs under a token
budget); each sequence appends its chunk at its own length, and with ``n_commit`` keeps
only the accepted part (the rest of its KV entries are overwritten later, never read).

Engram rows for a step come either from the model's own tables (hashing the last N-1
tokens of each slot's history) or, with ``prepared=``, from an `EngramMemory` lookup
started earlier (`EngramMemory.prepare_decode` / `prepare_ragged`, whose history slots
should be the same numbers as these cache slots).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from condmem.models.transformer import DecoderLM
from condmem.ops.attention import decode_attention_rope_store, paged_prefill_attention, rope_store
from condmem.ops.norm_act import rms_norm, silu_mul
from condmem.serving.cache import ServingCache


@torch.no_grad()
def prefill(
    model: DecoderLM, cache: ServingCache, slot: int, ids: torch.Tensor, prepared=None, last_only: bool = False
) -> torch.Tensor:
    """Run prompt `ids` [T] into `slot` (which must be empty); returns logits [T, vocab] ([1, vocab] with
    `last_only`)."""
    cache.check_free(slot)
    if ids.numel() > cache.max_len:
        raise ValueError(f"a prompt of {ids.numel()} tokens does not fit the cache's {cache.max_len} positions")
    temp = model.new_cache(1, ids.numel())
    logits = model(ids[None].to(cache.tokens.device), cache=temp, prepared=prepared, last_only=last_only)[0]
    cache.adopt([slot], temp, [ids.numel()])
    return logits


@torch.no_grad()
def prefill_batch(
    model: DecoderLM, cache: ServingCache, slots: list[int], prompts: list[torch.Tensor], prepared=None, pad_to: int = 1
) -> torch.Tensor:
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
        cache.check_free(slot)
        if ids.numel() > cache.max_len or ids.numel() == 0:
            raise ValueError(f"a prompt of {ids.numel()} tokens does not fit the cache's {cache.max_len} positions")
    if any(c is not None for c in cache.conv.values()):
        if prepared is not None and len(prompts) > 1:
            raise ValueError("a model with a ShortConv prefills one prompt at a time")
        return torch.cat(
            [prefill(model, cache, s, p, prepared=prepared, last_only=True) for s, p in zip(slots, prompts)]
        )
    device = cache.tokens.device
    ids, lengths = padded_ids(prompts, pad_to, cache.max_len)
    temp = model.new_cache(*ids.shape)
    logits = model(ids.to(device), cache=temp, prepared=prepared, logits_at=lengths.to(device) - 1)[:, 0]
    cache.adopt(slots, temp, lengths.tolist())
    return logits


def padded_ids(
    prompts: list[torch.Tensor], pad_to: int = 1, max_width: int | None = None
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


def _joined(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One weight for several projections of the same input: the modules' weights become row
    views of it (no copy kept), so serving runs one GEMM where the modules run several. Joined
    again if a module's weight has moved (e.g. ``model.to(...)`` after the first join)."""
    first = linears[0]
    joined = getattr(first, "_serving_joined", None)
    rows = sum(m.weight.shape[0] for m in linears)
    start = 0
    if joined is not None and joined.shape[0] == rows:
        for m in linears:
            if m.weight.data_ptr() != joined[start:].data_ptr() or m.weight.dtype != joined.dtype:
                break
            start += m.weight.shape[0]
        else:
            return joined
    with torch.no_grad():
        joined = torch.cat([m.weight.detach() for m in linears])
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = joined[start : start + n]
            start += n
    first._serving_joined = joined
    return joined


def _attention_mlp(block, i: int, x: torch.Tensor, attend, tp_group=None) -> torch.Tensor:
    """A block's attention and SwiGLU over flat tokens x [n, D] (the serving form of `Block.forward`).

    ``attend(i, q, k, v)`` rotates q [n, H, hd] and k [n, KV, hd], stores k and v in layer i's
    paged cache and returns the attention outputs [n, H, hd] (decode: one launch for all of
    it). q/k/v and w1/w3 run as one GEMM each (`_joined`), w2 with the residual add; norm and
    silu(a) * b as one kernel each on CUDA (`condmem.ops`). With `tp_group` (a
    backbone sharded by `condmem.distributed.shard_backbone`) the output and down projections
    give partial sums, completed by one all-reduce each before the residual add.
    """
    attn, mlp, n = block.attn, block.mlp, x.shape[0]
    h = rms_norm(x, block.attn_norm.weight, block.attn_norm.eps)
    qkv = F.linear(h, _joined([attn.wq, attn.wk, attn.wv]))
    nq, nkv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    q = qkv[:, :nq].view(n, attn.n_heads, attn.head_dim)
    k = qkv[:, nq : nq + nkv].view(n, attn.n_kv_heads, attn.head_dim)
    v = qkv[:, nq + nkv :].view(n, attn.n_kv_heads, attn.head_dim)
    y = attn.wo(attend(i, q, k, v).reshape(n, -1))
    if tp_group is not None:
        dist.all_reduce(y, group=tp_group)
    x, h = rms_norm(y, block.mlp_norm.weight, block.mlp_norm.eps, residual=x)
    gate_up = F.linear(h, _joined([mlp.w1, mlp.w3]))
    hidden = mlp.w1.weight.shape[0]
    act = silu_mul(gate_up[:, :hidden], gate_up[:, hidden:])
    if tp_group is not None:
        down = F.linear(act, mlp.w2.weight)
        dist.all_reduce(down, group=tp_group)
        return x.add_(down)
    # The residual add rides in the down projection's GEMM (beta = 1), in place: x is this
    # block's own sum from `rms_norm`, so no copy of it is made for the GEMM to accumulate into.
    return x.addmm_(act, mlp.w2.weight.t())


@torch.no_grad()
def decode_step(
    model: DecoderLM,
    cache: ServingCache,
    slots: torch.Tensor | None,
    ids: torch.Tensor,
    prepared=None,
    check: bool = True,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per live slot; returns logits [B, vocab].

    Args:
        slots: [B] distinct slots to advance, or None for every slot in order (B = n_slots;
            the KV cache is then read in place, without index copies).
        ids: [B] new token ids.
        valid: optional bool [B]; False rows compute but change nothing (graph padding), and
            their attention reads no key.
        check: test that no advanced slot is full (a host sync; off inside CUDA graphs).

    Attention reads each slot's own keys through the paged cache's block table
    (`decode_attention_rope_store`, which also rotates and stores the new token's key and
    value): a step's cost follows the live lengths, not ``max_len``.
    """
    cfg = model.cfg
    device = cache.tokens.device
    ids = ids.to(device)
    batch = ids.numel()
    rows = torch.arange(batch, device=device) if slots is None else slots.to(device)
    if slots is None and batch != cache.n_slots:
        raise ValueError(f"slots=None covers all {cache.n_slots} slots; got {batch} ids")
    pos = cache.lengths[rows]  # [B] position of the new token
    if check:
        over = pos >= cache.max_len if valid is None else (pos >= cache.max_len) & valid
        if bool(over.any()):
            raise ValueError(f"a sequence reached the cache's {cache.max_len} positions")
    at = pos.clamp(max=cache.max_len - 1)  # invalid rows may sit at a full slot
    _masked_put(cache.tokens, (rows, at), ids, valid)
    x = model.embed(ids)  # [B, D]
    rows_all = None
    if cfg.engram is not None and prepared is None:
        # Each slot's last N tokens; look-backs before its start are blocked (read as pad).
        n = cfg.engram.max_ngram_size
        back = at[:, None] - torch.arange(n - 1, -1, -1, device=device)[None, :]  # [B, N]
        window = cache.tokens[rows[:, None], back.clamp(min=0)]
        rows_all = model.hasher(window, blocked=back < 0, check=False)[:, -1:]  # [B, 1, L, C]
    n_keys = at + 1 if valid is None else torch.where(valid, at + 1, 0)  # invalid rows read nothing
    table = cache.block_table[rows] if slots is not None else cache.block_table

    def attend(i, q, k, v):
        # Row b's new token at position n_keys[b] - 1 = at[b]: rotated, stored, attended in one launch.
        return decode_attention_rope_store(
            q, k, v, model.rotary.cos, model.rotary.sin, cache.k_pool[i], cache.v_pool[i], table, n_keys
        )

    layer_slot = 0
    for i, block in enumerate(model.blocks):
        if block.engram is not None:
            lid = block.layer_id
            if prepared is not None:
                row_ids, looked_up = prepared.row_ids(lid), prepared.rows(lid)  # waits for this layer's rows
            else:
                row_ids, looked_up = rows_all[:, :, layer_slot], None
            layer_slot += 1
            conv = cache.conv[lid]
            state = None if conv is None else conv[rows]
            x = block.engram(x[:, None], row_ids, rows=looked_up, residual=True, conv_state=state)[:, 0]
            if conv is not None:
                _masked_put(conv, (rows,), state, valid)
        x = _attention_mlp(block, i, x, attend, model.tp_group)
    _masked_put(cache.lengths, (rows,), pos + 1, valid)
    if slots is not None:  # host mirror (a sync for device slots; graphs pass slots=None)
        cache.advance((slots if valid is None else slots[valid.to(slots.device)]).tolist())
    return model.lm_head(rms_norm(x, model.norm.weight, model.norm.eps))


@torch.no_grad()
def ragged_step(
    model: DecoderLM,
    cache: ServingCache,
    slots: list[int],
    chunks: list[torch.Tensor],
    prepared=None,
    n_commit: list[int] | None = None,
    last_only: bool = False,
) -> torch.Tensor:
    """One forward over a flat batch of chunks (no padding tokens); returns logits of every token [n, vocab].

    Args:
        slots: host slot of each sequence (distinct; a new sequence's slot is empty).
        chunks: [L_b] token ids appended at each slot's length: a prefill chunk, one decode
            token, or the last sampled token followed by draft tokens.
        prepared: optional `Prepared` from ``EngramMemory.prepare_ragged`` of the same batch
            (history slots numbered like these cache slots); else the model's own tables.
        n_commit: tokens of each chunk the sequence keeps (speculative verification: 1 +
            accepted drafts); default all. The memory's histories advance separately
            (``EngramMemory.commit``).
        last_only: logits of each chunk's last token only ([B, vocab]): what a prefill that
            samples the next token needs (the output projection over every prompt token
            would be a large, wasted matmul).

    Attention is one varlen launch per layer over the packed chunks, each reading its own
    slot's cached prefix and its chunk from the paged cache (`paged_prefill_attention`).
    """
    cfg = model.cfg
    lengths, starts, keep = _check_ragged_chunks(cache, slots, chunks, n_commit)
    device = cache.tokens.device
    ids = torch.cat([c.reshape(-1) for c in chunks]).to(device)
    slot_of, pos, cu_dev, starts_dev, slots_dev = _packed_layout(slots, starts, lengths, len(ids), device)
    cache.tokens[slot_of, pos] = ids
    rows_all = None
    if cfg.engram is not None and prepared is None:
        rows_all = _own_engram_rows(model, cache, ids, cu_dev, slots, starts)
    table = cache.block_table[slots_dev]
    attend = _packed_attention(model, cache, pos, slot_of, table, cu_dev, starts_dev, max(lengths))
    x = _run_packed_blocks(model, model.embed(ids), attend, prepared, rows_all)  # [n, D]
    _commit_lengths(cache, slots, slots_dev, starts, keep)
    if last_only:
        x = x[cu_dev[1:].long() - 1]
    return model.lm_head(rms_norm(x, model.norm.weight, model.norm.eps))


def _check_ragged_chunks(
    cache: ServingCache, slots: list[int], chunks: list[torch.Tensor], n_commit: list[int] | None
) -> tuple[list[int], list[int], list[int]]:
    """`ragged_step`'s checks; returns each chunk's length, its slot's start and the tokens it keeps."""
    if any(c is not None for c in cache.conv.values()):
        raise ValueError(
            "ragged_step serves models without a ShortConv (its state would need per-chunk handling); "
            "use prefill / decode_step"
        )
    if len(slots) != len(chunks) or not chunks or len(set(slots)) != len(slots):
        raise ValueError(f"{len(slots)} slots for {len(chunks)} chunks; slots must be distinct and non-empty")
    lengths = [int(c.numel()) for c in chunks]
    starts = [cache.host_lengths[s] for s in slots]
    for s, st, n in zip(slots, starts, lengths):
        if n == 0 or st + n > cache.max_len:
            raise ValueError(f"slot {s}: a chunk of {n} tokens at position {st} does not fit {cache.max_len} positions")
    keep = lengths if n_commit is None else [max(0, min(int(k), n)) for k, n in zip(n_commit, lengths)]
    return lengths, starts, keep


def _packed_layout(
    slots: list[int], starts: list[int], lengths: list[int], n_tokens: int, device: torch.device
) -> tuple:
    """Host-side layout of the packed batch of `n_tokens` tokens, sent in one copy: per token its slot and
    position, per chunk its boundaries (int32), start (int32) and slot."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    host = torch.cat(
        [
            torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths)),
            torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lengths)]),
            torch.tensor(cu),
            torch.tensor(starts),
            torch.tensor(slots),
        ]
    )
    n, batch = n_tokens, len(lengths)
    meta = host.to(device, non_blocking=True)
    slot_of, pos = meta[:n], meta[n : 2 * n]
    cu_dev = meta[2 * n : 2 * n + batch + 1].to(torch.int32)
    starts_dev = meta[2 * n + batch + 1 : 2 * n + 2 * batch + 1].to(torch.int32)
    slots_dev = meta[2 * n + 2 * batch + 1 :]
    return slot_of, pos, cu_dev, starts_dev, slots_dev


def _own_engram_rows(
    model: DecoderLM, cache: ServingCache, ids: torch.Tensor, cu_dev: torch.Tensor, slots: list[int], starts: list[int]
) -> torch.Tensor:
    """Row ids of the packed tokens from the model's own hasher: each chunk looks back at the N-1
    tokens its slot holds before it."""
    device = cache.tokens.device
    depth = model.cfg.engram.max_ngram_size - 1
    back = torch.tensor(starts)[:, None] - torch.arange(depth, 0, -1)[None, :]  # [B, N-1], oldest first
    lookback = cache.tokens[torch.tensor(slots)[:, None].to(device), back.clamp(min=0).to(device)]
    lookback = torch.where(back.to(device) >= 0, lookback, torch.full_like(lookback, -1))
    return model.hasher.hash_ragged(ids, cu_dev, lookback_ids=lookback, check=False)


def _packed_attention(model: DecoderLM, cache: ServingCache, pos, slot_of, table, cu_dev, starts_dev, max_q: int):
    """Layer i's attention over the packed chunks: RoPE and store of the chunks' keys and values, then
    one varlen launch reading each slot's cached prefix and its chunk."""

    def attend(i, q, k, v):
        q = rope_store(
            q,
            k,
            v,
            model.rotary.cos,
            model.rotary.sin,
            pos,
            slot_of,
            cache.block_table,
            cache.k_pool[i],
            cache.v_pool[i],
        )
        return paged_prefill_attention(q, cache.k_pool[i], cache.v_pool[i], table, cu_dev, starts_dev, max_q)

    return attend


def _run_packed_blocks(model: DecoderLM, x: torch.Tensor, attend, prepared, rows_all) -> torch.Tensor:
    """The model's blocks over the packed tokens `x` [n, D]: each Engram (rows from `prepared`, else
    the step's `rows_all`), then attention and MLP."""
    layer_slot = 0
    for i, block in enumerate(model.blocks):
        if block.engram is not None:
            lid = block.layer_id
            if prepared is not None:
                x = block.engram(x[None], prepared.row_ids(lid), rows=prepared.rows(lid), residual=True)[0]
            else:
                x = block.engram(x[None], rows_all[None, :, layer_slot], residual=True)[0]
            layer_slot += 1
        x = _attention_mlp(block, i, x, attend, model.tp_group)
    return x


def _commit_lengths(
    cache: ServingCache, slots: list[int], slots_dev: torch.Tensor, starts: list[int], keep: list[int]
) -> None:
    """Each slot's length (host and device) advanced by the tokens its chunk keeps."""
    for s, st, k in zip(slots, starts, keep):
        cache.host_lengths[s] = st + k
    ends = torch.tensor([st + k for st, k in zip(starts, keep)])
    cache.lengths[slots_dev] = ends.to(cache.tokens.device, non_blocking=True)


@torch.no_grad()
def prefill_packed(
    model: DecoderLM, cache: ServingCache, slots: list[int], prompts: list[torch.Tensor], prepared=None
) -> torch.Tensor:
    """Run several prompts into empty slots as one packed batch (no padding); last-token logits [B, vocab].

    `prepared` must come from ``memory.prepare_ragged(torch.cat(prompts), cu_seqlens, slots=...)``
    (`packed_ids` gives both).
    """
    for slot, ids in zip(slots, prompts):
        cache.check_free(slot)
    return ragged_step(model, cache, slots, prompts, prepared=prepared, last_only=True)


def packed_ids(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [T_i] -> (flat ids [sum T_i] on the prompts' device, cu_seqlens [B+1] on the CPU)."""
    lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
    cu = torch.zeros(len(prompts) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    return torch.cat([p.reshape(-1) for p in prompts]), cu
