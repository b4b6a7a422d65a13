"""CUDA-graph decode: one captured `decode_step` for a fixed number of batch rows.

Python and kernel-launch overhead dominate a decode step of a small batch, which would
hide what Engram costs; a CUDA graph replays the whole step in one launch. The graph
holds a fixed batch of `rows` entries: live sequences fill the first ones, the rest are
padding rows pointed at a scratch slot of the `ServingCache` (reset inside the graph, so
padding never grows, never touches a live sequence, and costs no lookups).

Engram rows come into the graph through static buffers: with an `EngramMemory`, the
lookup for the step runs *outside* the graph (its dedup and host gather need the host),
and `step` copies the finished rows into the buffers before the replay; the copy waits on
the lookup's event only. Without a memory, the graph hashes each slot's history itself.
"""

from __future__ import annotations

import torch

from condmem.models.serving import ServingCache, decode_step
from condmem.models.transformer import DecoderLM


class _StaticPrepared:
    """Row ids and rows of every Engram layer, in fixed buffers the graph reads."""

    def __init__(self, model: DecoderLM, rows: int, device):
        cfg = model.cfg.engram
        self.row_ids_buf = {}
        self.rows_buf = {}
        for block in model.blocks:
            if block.engram is not None:
                lid = block.layer_id
                self.row_ids_buf[lid] = torch.zeros(rows, 1, cfg.n_cols, dtype=torch.long, device=device)
                self.rows_buf[lid] = torch.zeros(rows, 1, cfg.n_cols, cfg.head_dim, dtype=torch.bfloat16, device=device)

    def row_ids(self, layer_id: int) -> torch.Tensor:
        return self.row_ids_buf[layer_id]

    def rows(self, layer_id: int) -> torch.Tensor:
        return self.rows_buf[layer_id]


class GraphedDecoder:
    """`decode_step` captured in a CUDA graph for up to `rows` sequences per step.

    Args:
        model: the decoder (on CUDA, eval mode).
        cache: its `ServingCache`; its last slot is used as the padding rows' scratch slot,
            so give it one slot more than the sequences it serves.
        rows: batch rows of the graph (live sequences per step at most).
        with_memory: rows come from an `EngramMemory` (pass `prepared=` to `step`).
    """

    def __init__(self, model: DecoderLM, cache: ServingCache, rows: int, *, with_memory: bool = False,
                 warmup: int = 3):
        if not torch.cuda.is_available() or cache.tokens.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model and cache on a CUDA device")
        self.model, self.cache, self.rows = model, cache, rows
        self.scratch = cache.n_slots - 1
        device = cache.tokens.device
        self.slots = torch.full((rows,), self.scratch, dtype=torch.long, device=device)
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.static = _StaticPrepared(model, rows, device) if with_memory and model.cfg.engram is not None else None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):  # compiles kernels and caches constants outside the capture
                self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._body()
        cache.lengths.narrow(0, self.scratch, 1).zero_()

    def _body(self) -> torch.Tensor:
        # Padding rows restart at position 0 every step (a device op: no host value in the graph).
        self.cache.lengths.narrow(0, self.scratch, 1).zero_()
        return decode_step(self.model, self.cache, self.slots, self.ids, prepared=self.static, check=False)

    @torch.no_grad()
    def step(self, slots: torch.Tensor, ids: torch.Tensor, prepared=None) -> torch.Tensor:
        """Advance live `slots` [B <= rows] by `ids` [B]; returns logits [B, vocab] (a view, valid until the next step)."""
        n = slots.numel()
        if n > self.rows:
            raise ValueError(f"{n} sequences in a step; the graph holds {self.rows}")
        if bool((self.cache.lengths[slots] >= self.cache.max_len).any()):
            raise ValueError(f"a sequence reached the cache's {self.cache.max_len} positions")
        self.slots.fill_(self.scratch)
        self.slots[:n].copy_(slots)
        self.ids.zero_()
        self.ids[:n].copy_(ids)
        if self.static is not None:
            if prepared is None:
                raise ValueError("this graph reads Engram rows from memory: pass prepared=memory.prepare_decode(...)")
            for lid in self.static.rows_buf:
                self.static.row_ids_buf[lid][:n].copy_(prepared.row_ids(lid))
                self.static.rows_buf[lid][:n].copy_(prepared.rows(lid))   # waits for this layer's lookup
        self.graph.replay()
        return self.logits[:n]
