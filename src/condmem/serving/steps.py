"""Serving steps of `DecoderLM`: prefill and decode over the paged `ServingCache`, each slot at its own
position.

Serving runs flat batches of many sequences, each at its own length, with keys and values in a
paged pool read through a block table. Each step builds a `ForwardContext` (its paged attention
backend, the step's Engram inputs, the ShortConv states of its slots, the tensor-parallel
reduction, the fused inference kernels) and runs `DecoderLM.forward` with it: the blocks and
their weights are the model's own, and so is the walk over them.

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

Engram row vectors for a step come either from the model's own tables (hashing the last N-1
tokens of each slot's history) or, with ``prepared=``, from an `EngramMemory` lookup
started earlier (`EngramMemory.prepare_decode` / `prepare_ragged`, whose history slots
should be the same numbers as these cache slots).
"""

from __future__ import annotations

import torch

from condmem.models.context import ConvStates, HashedRowIds, ForwardContext
from condmem.models.transformer import DecoderLM
from condmem.ops.attention import decode_attention_rope_store, paged_prefill_attention, rope_store
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
    logits = model(ids[None].to(cache.device), cache=temp, prepared=prepared, last_only=last_only)[0]
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
    device = cache.device
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
    device = cache.device
    ids = ids.to(device)
    batch = ids.numel()
    live = torch.arange(batch, device=device) if slots is None else slots.to(device)  # the slot of each row
    if slots is None and batch != cache.n_slots:
        raise ValueError(f"slots=None covers all {cache.n_slots} slots; got {batch} ids")
    pos = cache.lengths[live]  # [B] position of the new token
    if check:
        over = pos >= cache.max_len if valid is None else (pos >= cache.max_len) & valid
        if bool(over.any()):
            raise ValueError(f"a sequence reached the cache's {cache.max_len} positions")
    at = pos.clamp(max=cache.max_len - 1)  # invalid rows may sit at a full slot
    cache.history.record(live, at, ids, valid)
    row_ids_all = None
    if cfg.engram is not None and prepared is None:
        # Each slot's last N tokens; look-backs before its start are blocked (read as pad).
        window, before = cache.history.window(live, at + 1, cfg.engram.max_ngram_size)
        row_ids_all = model.hasher(window, blocked=before, check=False)[:, -1:]  # [B, 1, L, C]
    n_keys = at + 1 if valid is None else torch.where(valid, at + 1, 0)  # invalid rows read nothing
    table = cache.block_table[live] if slots is not None else cache.block_table

    def attend(i, q, k, v):
        # Row b's new token at position n_keys[b] - 1 = at[b]: rotated, stored, attended in one launch.
        y = decode_attention_rope_store(
            q.flatten(0, 1),
            k.flatten(0, 1),
            v.flatten(0, 1),
            model.rotary.cos,
            model.rotary.sin,
            cache.k_pool[i],
            cache.v_pool[i],
            table,
            n_keys,
        )
        return y.reshape(batch, 1, -1)

    context = ForwardContext(
        attend=attend,
        engram_inputs=_engram_inputs(model, prepared, row_ids_all),
        conv=_SlotConvStates(cache.conv, live, valid),
        tp_group=model.tp_group,
        fused=True,
    )
    logits = model(ids[:, None], context=context)[:, 0]
    _masked_put(cache.lengths, (live,), pos + 1, valid)
    if slots is not None:  # host mirror (a sync for device slots; graphs pass slots=None)
        cache.advance((slots if valid is None else slots[valid.to(slots.device)]).tolist())
    return logits


def _engram_inputs(model: DecoderLM, prepared, row_ids_all: torch.Tensor | None):
    """A step's Engram inputs: row vectors prefetched (`prepared`), or row ids hashed for the model's own tables."""
    if prepared is not None or row_ids_all is None:
        return prepared
    return HashedRowIds(row_ids_all, model.layout.layer_ids)


class _SlotConvStates(ConvStates):
    """ShortConv states of the slots a decode step advances: gathered per row, stored back except
    at invalid rows."""

    def __init__(self, states: dict, slots: torch.Tensor, valid: torch.Tensor | None):
        super().__init__(states, 0)
        self.slots, self.valid = slots, valid

    def get(self, layer_id: int) -> torch.Tensor | None:
        conv = self.states.get(layer_id)
        return None if conv is None else conv[self.slots]

    def put(self, layer_id: int, state: torch.Tensor | None) -> None:
        _masked_put(self.states[layer_id], (self.slots,), state, self.valid)


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
    device = cache.device
    ids = torch.cat([c.reshape(-1) for c in chunks]).to(device)
    slot_of, pos, cu_dev, starts_dev, slots_dev = _packed_layout(slots, starts, lengths, len(ids), device)
    cache.history.record(slot_of, pos, ids)
    row_ids_all = None
    if cfg.engram is not None and prepared is None:
        row_ids_all = _own_row_ids(model, cache, ids, cu_dev, slots, starts)
    table = cache.block_table[slots_dev]
    context = ForwardContext(
        attend=_packed_attention(model, cache, pos, slot_of, table, cu_dev, starts_dev, max(lengths)),
        engram_inputs=_engram_inputs(model, prepared, None if row_ids_all is None else row_ids_all[None]),
        tp_group=model.tp_group,
        fused=True,
        keep=cu_dev[1:].long() - 1 if last_only else None,
    )
    logits = model(ids[None], context=context)[0]
    _commit_lengths(cache, slots, slots_dev, starts, keep)
    return logits


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


def _own_row_ids(
    model: DecoderLM, cache: ServingCache, ids: torch.Tensor, cu_dev: torch.Tensor, slots: list[int], starts: list[int]
) -> torch.Tensor:
    """Row ids of the packed tokens from the model's own hasher: each chunk looks back at the N-1
    tokens its slot holds before it."""
    device = cache.device
    ends = torch.tensor(starts).to(device)
    lookback, before = cache.history.window(torch.tensor(slots).to(device), ends, model.cfg.engram.max_ngram_size - 1)
    lookback = torch.where(before, torch.full_like(lookback, -1), lookback)
    return model.hasher.hash_ragged(ids, cu_dev, lookback_ids=lookback, check=False)


def _packed_attention(model: DecoderLM, cache: ServingCache, pos, slot_of, table, cu_dev, starts_dev, max_q: int):
    """Layer i's attention over the packed chunks: RoPE and store of the chunks' keys and values, then
    one varlen launch reading each slot's cached prefix and its chunk."""

    def attend(i, q, k, v):
        n = q.shape[1]
        q = rope_store(
            q[0],
            k[0],
            v[0],
            model.rotary.cos,
            model.rotary.sin,
            pos,
            slot_of,
            cache.block_table,
            cache.k_pool[i],
            cache.v_pool[i],
        )
        y = paged_prefill_attention(q, cache.k_pool[i], cache.v_pool[i], table, cu_dev, starts_dev, max_q)
        return y.reshape(1, n, -1)

    return attend


def _commit_lengths(
    cache: ServingCache, slots: list[int], slots_dev: torch.Tensor, starts: list[int], keep: list[int]
) -> None:
    """Each slot's length (host and device) advanced by the tokens its chunk keeps."""
    for s, st, k in zip(slots, starts, keep):
        cache.host_lengths[s] = st + k
    ends = torch.tensor([st + k for st, k in zip(starts, keep)])
    cache.lengths[slots_dev] = ends.to(cache.device, non_blocking=True)


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
