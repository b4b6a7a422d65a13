"""The forward context: what differs between ways of running a `DecoderLM` forward.

`Block.forward(x, ctx)` is the only block forward and `DecoderLM.forward` the only loop over
the blocks; each way of running the model builds a `ForwardContext` and hands it to them:

* training, evaluation and `generate` (`DecoderLM.dense_context` builds it): dense attention
  over [B, T] (`condmem.models.attention.DenseAttention`, with a contiguous `KVCache` when
  decoding), the module kernels that autograd differentiates;
* the paged serving steps (`condmem.serving.steps`): attention over the paged KV pool for one
  token per slot or for packed ragged chunks, the fused inference kernels
  (``fused=True``), and under tensor parallelism the all-reduce that completes each block's
  partial sums (``tp_group``);
* the Hugging Face hooks (`condmem.integrations.transformers`): only the Engram part
  (`run_engram`), since the model's own layers run its attention.

Every context supplies the Engram layers' inputs (``engram_inputs``): each layer's row ids and,
when a lookup already fetched them from some tier, its row vectors (`HashedRowIds` for ids hashed
for the forward, or a lookup's `condmem.serving.Prepared`), the padding mask, the ShortConv
states (`ConvStates`) and an optional dict that receives the gate values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(block_index, q, k, v)``: q [B, T, H, hd], k and v [B, T, KV, hd] (not yet rotated)
-> attention outputs [B, T, H * hd] (before the output projection)."""


class HashedRowIds:
    """Each Engram layer's inputs for one forward: ``row_ids(layer_id)`` [B, T, n_cols] and
    ``row_vectors(layer_id)`` [B, T, n_cols, head_dim] (None: the module reads its own table).

    This one holds row ids hashed for the forward (int64 [B, T, n_layers, n_cols], the layers in
    `layer_ids` order); a lookup that fetched the row vectors already (`condmem.serving.Prepared`,
    a decode graph's fetch) offers the same two methods."""

    def __init__(self, row_ids: torch.Tensor, layer_ids: list[int]):
        self.all = row_ids
        self.index = {lid: i for i, lid in enumerate(layer_ids)}
        self._layers = row_ids.unbind(2)  # every layer's view made at once (one op, not one per layer)

    def row_ids(self, layer_id: int) -> torch.Tensor:
        return self._layers[self.index[layer_id]]

    def row_vectors(self, layer_id: int) -> torch.Tensor | None:
        return None


class ConvStates:
    """The ShortConv inputs each Engram layer continues from (None: a whole sequence, no state).

    `get` hands the layer a tensor it advances in place; `put` stores it back afterwards (needed
    where `get` gathered a copy). This one holds views: ``states`` {layer_id: [B, pad, hc, D] or
    None} cut to the first `batch` rows."""

    def __init__(self, states: Mapping[int, torch.Tensor | None], batch: int):
        self.states, self.batch = states, batch

    def get(self, layer_id: int) -> torch.Tensor | None:
        state = self.states.get(layer_id)
        return None if state is None else state[: self.batch]

    def put(self, layer_id: int, state: torch.Tensor | None) -> None:
        """Nothing to store: `get` handed out a view."""


@dataclass
class ForwardContext:
    """What one forward of the blocks reads besides the hidden states.

    Attributes:
        attend: the attention backend (`Attend`); None for a context that runs only Engram
            layers (the Hugging Face hooks).
        engram_inputs: the Engram layers' row ids / row vectors (`HashedRowIds` or a lookup with
            the same two methods); None for a model without Engram.
        token_mask: optional bool [B, T]; False closes the Engram gate (padding).
        conv: the ShortConv states (`ConvStates`); None: every forward starts a sequence.
        gates: optional dict receiving each Engram layer's gate values.
        tp_group: the process group a tensor-parallel backbone is split over: each block's
            attention output and down projection are partial sums, all-reduced here.
        fused: the fused inference kernels (norms, joined projections, no autograd) instead
            of the modules' own composition.
        keep: optional flat token indices [k]: only these tokens' logits are computed.
    """

    attend: Attend | None = None
    engram_inputs: object | None = None
    token_mask: torch.Tensor | None = None
    conv: ConvStates | None = None
    gates: dict | None = None
    tp_group: object | None = None
    fused: bool = False
    keep: torch.Tensor | None = None

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel block's partial sum completed (all-reduced in place); else `y`."""
        if self.tp_group is not None:
            dist.all_reduce(y, group=self.tp_group)
        return y


def run_engram(engram, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """``x + Engram(x)`` of one layer with what `ctx` supplies for it: the one place an Engram
    layer runs inside a model (the decoder's blocks and the Hugging Face hooks)."""
    lid = engram.layer_id
    inputs = ctx.engram_inputs
    row_ids = inputs.row_ids(lid)
    row_vectors = inputs.row_vectors(lid)  # a prefetched lookup: waits for this layer's rows only
    state = None if ctx.conv is None else ctx.conv.get(lid)
    x = engram(x, row_ids, ctx.token_mask, row_vectors=row_vectors, residual=True, conv_state=state, gates=ctx.gates)
    if state is not None:
        ctx.conv.put(lid, state)
    return x
