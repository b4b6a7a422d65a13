"""Sampling from a `DecoderLM` with a KV cache (and the Engram's ShortConv/hash history).

The prompt is prefilled in one forward, then one token per step. Engram layers hash
each new token from the cached token history, so decoding reads the same rows as a
full forward over the whole sequence would.
"""

from __future__ import annotations

import torch

from condmem.models.transformer import DecoderLM, eval_mode


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None):
    """Next token ids [B] from last-position logits [B, V]: greedy at temperature 0, else top-k sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int | None = 0,
    stop_ids: tuple[int, ...] = (),
    memory=None,
) -> torch.Tensor:
    """Continue `prompt_ids` [B, T] (or [T]) by up to `max_new_tokens` tokens.

    With `memory` (a `condmem.serving.EngramMemory` holding the model's tables in some
    tier), rows are prefetched from it: the prompt seeds per-sequence decode histories and
    each step hashes only the new token.

    Returns:
        The new token ids [B, n] (n <= max_new_tokens; stops early when every row hit a stop id).
    """
    squeeze = prompt_ids.dim() == 1
    ids = prompt_ids[None] if squeeze else prompt_ids
    device = model.embed.weight.device
    ids = ids.to(device)
    batch, length = ids.shape
    if length == 0:
        raise ValueError("generate needs a prompt of at least one token")
    room = model.cfg.max_seq_len
    if length + max_new_tokens > room:  # keep the prompt's tail; the model sees max_seq_len tokens at most
        ids = ids[:, -max(1, room - max_new_tokens) :]
        length = ids.shape[1]
    n_new = min(max_new_tokens, room - length)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    out = []
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    slots = None
    with eval_mode(model):
        cache = model.new_cache(batch, length + n_new)
        prepared = None
        if memory is not None:
            slots = torch.tensor([memory.allocate() for _ in range(batch)])
            prepared = memory.prepare(ids, slots=slots)
        logits = model(ids, cache=cache, prepared=prepared)[:, -1]
        try:
            for i in range(n_new):
                nxt = sample_next(logits, temperature, top_k, generator)
                out.append(nxt)
                if stop_ids:
                    done |= torch.isin(nxt, stop)
                    if bool(done.all()):
                        break
                if i + 1 < n_new:
                    prepared = memory.prepare_decode(slots, nxt) if memory is not None else None
                    logits = model(nxt[:, None], cache=cache, prepared=prepared)[:, -1]
        finally:
            if slots is not None:
                for slot in slots.tolist():
                    memory.free(slot)
    new = torch.stack(out, dim=1) if out else ids.new_zeros(batch, 0)
    return new[0] if squeeze else new
