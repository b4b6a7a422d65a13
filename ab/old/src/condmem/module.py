"""The Engram layer: a hashed n-gram table read, projected, gated into the residual stream.

`EngramTable` is the layer's table (an embedding of ``num_embeddings`` rows of
``head_dim``; sparse gradients on request so optimizer work scales with rows read).
`Engram` turns one layer's row ids into a residual update::

    e   = concat of the n_cols rows at each position           [B, T, n_cols*head_dim]
    kv  = wkv(e)                     hc keys, then one value     [B, T, (hc+1)*D]
    u_m = sigmoid(signed_sqrt(<RMSNorm(h_m), RMSNorm(k_m)>/sqrt D)) * v
    Y   = u + ShortConv(u)           (optional)

The caller adds ``Y`` to the residual stream. Row ids come from `NgramHasher`,
computed once for all layers before the first transformer layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from condmem.config import EngramConfig
from condmem.ops.gate import GATE_CLAMP, engram_gate
from condmem.ops.short_conv import ShortConv


class EngramInputError(ValueError):
    """Hidden states or row ids handed to an Engram layer have the wrong shape, dtype or range."""


class EngramTable(nn.Module):
    """One layer's hashed table: row ids [...] -> rows [..., head_dim].

    Args:
        num_embeddings: rows (the sum of the layer's primes).
        head_dim: row width.
        sparse: produce sparse gradients (``torch.sparse``): only rows read get a gradient.
        init_std: standard deviation of the normal initialization.
        device: use ``"meta"`` to describe a huge table without allocating it.
    """

    def __init__(self, num_embeddings: int, head_dim: int, *, sparse: bool = False, init_std: float = 1.0,
                 device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.head_dim = head_dim
        self.sparse = sparse
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(row_ids, self.weight, sparse=self.sparse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.head_dim}, sparse={self.sparse}"


class Engram(nn.Module):
    """The Engram module of one transformer layer.

    Args:
        config: model geometry (hidden size, branches, heads, orders, head width).
        num_embeddings: rows of this layer's table (``EngramLayout.layer(id).num_embeddings``).
        layer_id: the transformer layer this module sits in (for messages and checkpoints).
        sparse: sparse table gradients (train the table with a sparse optimizer).
        device, dtype: where and in what the parameters are made.
        table_device: where the table is made, if not `device`; ``"meta"`` describes it without
            memory, for tables that live elsewhere (host memory, disk) and are read through
            `forward(..., rows=...)`.

    Shapes:
        hidden: [B, T, hc, D] (or [B, T, D] when hc_mult == 1); row_ids: [B, T, n_cols]
        int64; token_mask: optional bool [B, T], False closes the gate. Output: like hidden.

    Example:
        >>> layout = EngramLayout(config)
        >>> engram = Engram(config, layout.layer(1).num_embeddings, layer_id=1)
        >>> rows = hasher(input_ids)[:, :, layout.layer_index(1)]
        >>> h = h + engram(h, rows)
    """

    def __init__(self, config: EngramConfig, num_embeddings: int, layer_id: int = -1, *, sparse: bool = False,
                 table_init_std: float = 1.0, device=None, dtype=None, table_device=None):
        super().__init__()
        config.validate()
        self.config = config
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.n_cols = config.n_cols
        self.eps = config.rms_norm_eps
        self.table = EngramTable(num_embeddings, config.head_dim, sparse=sparse, init_std=table_init_std,
                                 device=table_device if table_device is not None else device, dtype=dtype)
        # One GEMM makes hc keys and the shared value (production fuses them the same way).
        self.wkv = nn.Linear(config.engram_dim, (config.hc_mult + 1) * config.hidden_size, bias=False,
                             device=device, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, device=device, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, device=device, dtype=dtype))
        self.short_conv = (
            ShortConv(config.hidden_size, config.hc_mult, config.kernel_size, dilation=config.max_ngram_size,
                      eps=config.rms_norm_eps, device=device, dtype=dtype)
            if config.short_conv
            else None
        )
        if self.wkv.weight.device.type != "meta":
            nn.init.normal_(self.wkv.weight, std=1.0 / math.sqrt(config.engram_dim))

    def _check(self, hidden: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            raise EngramInputError(f"Engram(layer {self.layer_id}): hidden states must be a float tensor, got "
                                   f"{getattr(hidden, 'dtype', type(hidden))}")
        if hidden.dim() == 3 and self.hc_mult == 1:
            hidden = hidden.unsqueeze(2)
        if hidden.dim() != 4 or hidden.shape[2:] != (self.hc_mult, self.hidden_size):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): hidden states must be [B, T, hc={self.hc_mult}, D={self.hidden_size}]"
                f"{' or [B, T, D]' if self.hc_mult == 1 else ''}, got {tuple(hidden.shape)}"
            )
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in (torch.int64, torch.int32):
            raise EngramInputError(f"Engram(layer {self.layer_id}): row ids must be an int64/int32 tensor, got "
                                   f"{getattr(row_ids, 'dtype', type(row_ids))}")
        if row_ids.shape != (*hidden.shape[:2], self.n_cols):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): row ids must be [B, T, n_cols={self.n_cols}] matching hidden "
                f"{tuple(hidden.shape[:2])}, got {tuple(row_ids.shape)} (slice one layer from the hasher's output)"
            )
        if row_ids.device.type == "cpu" and row_ids.numel():
            # On CPU the check is free; on GPU it would cost a sync per step, and the hasher's
            # ids are in range by construction.
            lo, hi = int(row_ids.min()), int(row_ids.max())
            if lo < 0 or hi >= self.table.num_embeddings:
                raise EngramInputError(
                    f"Engram(layer {self.layer_id}): row id {lo if lo < 0 else hi} outside the table's "
                    f"0..{self.table.num_embeddings - 1}: ids from another layer or layout?"
                )
        if token_mask is not None and (token_mask.dtype != torch.bool or token_mask.shape != hidden.shape[:2]):
            raise EngramInputError(f"Engram(layer {self.layer_id}): token_mask must be bool [B, T]={tuple(hidden.shape[:2])}, "
                                   f"got {token_mask.dtype} {tuple(token_mask.shape)}")
        return hidden

    def embed(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Row ids [B, T, n_cols] -> concatenated rows [B, T, n_cols * head_dim]."""
        return self.table(row_ids).flatten(-2)

    def forward(self, hidden: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Residual update for `hidden` from this layer's `row_ids`.

        `rows` may carry rows already gathered elsewhere ([B, T, n_cols, head_dim], e.g. by a
        host-memory lookup); then the table is not read.
        """
        squeeze = hidden.dim() == 3
        hidden4 = self._check(hidden, row_ids, token_mask)
        if rows is None and self.table.weight.device.type == "meta":
            raise EngramInputError(f"Engram(layer {self.layer_id}): the table lives outside this module (meta); "
                                   "pass the looked-up rows (e.g. EngramMemory.prepare(...).rows(layer_id))")
        embedded = self.embed(row_ids) if rows is None else rows.flatten(-2)
        kv = self.wkv(embedded.to(self.wkv.weight.dtype))
        out = engram_gate(hidden4, kv, self.q_weight, self.k_weight, self.eps, GATE_CLAMP, token_mask)
        if self.short_conv is not None:
            out = out + self.short_conv(out)
        return out.squeeze(2) if squeeze else out

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, hc_mult={self.hc_mult}, hidden={self.hidden_size}, n_cols={self.n_cols}"
