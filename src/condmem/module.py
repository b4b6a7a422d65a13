"""The Engram layer: a hashed n-gram table read, projected, gated into the residual stream.

`EngramTable` is the layer's table (an embedding of ``num_embeddings`` rows of
``head_dim``; sparse gradients on request so optimizer work scales with rows read).
`Engram` turns one layer's row ids into a residual update::

    e   = concat of the n_cols row vectors at each position    [B, T, n_cols*head_dim]
    kv  = wkv(e)                     hc keys, then one value     [B, T, (hc+1)*D]
    u_m = sigmoid(signed_sqrt(<RMSNorm(h_m), RMSNorm(k_m)>/sqrt D)) * v
    Y   = u + ShortConv(u)           (optional)

The caller adds ``Y`` to the residual stream. Row ids come from `NgramHasher`,
computed once for all layers before the first transformer layer.

`Engram.from_released` builds one layer of a released DeepSeek-V4.1 checkpoint (its
``wkv``, ``q_weight``, ``k_weight``; the table stays with `EngramMemory.from_released`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from condmem.config import ConfigError, EngramConfig
from condmem.ops.gate import GATE_CLAMP, engram_gate, gate_values
from condmem.ops.short_conv import ShortConv
from condmem.ops.row_grad import table_lookup
from condmem.utils.renamed import UNSET, renamed_keyword


@torch.compiler.disable
def _read_table(table: nn.Module, row_ids: torch.Tensor) -> torch.Tensor:
    """The table's rows of `row_ids`, run as it is under `torch.compile` (whose graphs then hold
    the projection, gate and ShortConv around it): the lookup's sparse gradient is nothing
    Inductor makes, and a host-memory or sharded table's read is host work and collectives."""
    return table(row_ids)


class EngramInputError(ValueError):
    """Hidden states or row ids handed to an Engram layer have the wrong shape, dtype or range."""


class EngramTable(nn.Module):
    """One layer's hashed table: row ids [...] -> row vectors [..., head_dim].

    Args:
        num_embeddings: rows (the sum of the layer's primes).
        head_dim: row width.
        sparse: produce sparse gradients (``torch.sparse``): only rows read get a gradient.
        init_std: standard deviation of the normal initialization.
        device: use ``"meta"`` to describe a huge table without allocating it.
    """

    def __init__(
        self,
        num_embeddings: int,
        head_dim: int,
        *,
        sparse: bool = False,
        init_std: float = 1.0,
        device=None,
        dtype=None,
    ):
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
        if self.sparse and self.weight.is_cuda and self.weight.requires_grad and torch.is_grad_enabled():
            # The same rows, and the sparse gradient's values bit-equal to the coalesced
            # F.embedding one's, reduced per distinct row by one kernel (`ops.row_grad`).
            return table_lookup(self.weight, row_ids)
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
            `forward(..., row_vectors=...)`.

    Shapes:
        hidden: [B, T, hc, D] (or [B, T, D] when hc_mult == 1); row_ids: [B, T, n_cols]
        int64; token_mask: optional bool [B, T], False closes the gate. Output: like hidden.

    Example:
        >>> layout = EngramLayout(config)
        >>> engram = Engram(config, layout.layer(1).num_embeddings, layer_id=1)
        >>> row_ids = hasher(input_ids)[:, :, layout.layer_index(1)]
        >>> h = h + engram(h, row_ids)
    """

    def __init__(
        self,
        config: EngramConfig,
        num_embeddings: int,
        layer_id: int = -1,
        *,
        sparse: bool = False,
        table_init_std: float = 1.0,
        device=None,
        dtype=None,
        table_device=None,
    ):
        super().__init__()
        config.validate()
        config.require_backbone(f"Engram(layer {layer_id})")
        self.config = config
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.n_cols = config.n_cols
        self.eps = config.rms_norm_eps
        self.table = EngramTable(
            num_embeddings,
            config.head_dim,
            sparse=sparse,
            init_std=table_init_std,
            device=table_device if table_device is not None else device,
            dtype=dtype,
        )
        # One GEMM makes hc keys and the shared value (production fuses them the same way).
        self.wkv = nn.Linear(
            config.engram_dim, (config.hc_mult + 1) * config.hidden_size, bias=False, device=device, dtype=dtype
        )
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, device=device, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, device=device, dtype=dtype))
        self.short_conv = (
            ShortConv(
                config.hidden_size,
                config.hc_mult,
                config.kernel_size,
                dilation=config.max_ngram_size,
                eps=config.rms_norm_eps,
                device=device,
                dtype=dtype,
            )
            if config.short_conv
            else None
        )
        if self.wkv.weight.device.type != "meta":
            nn.init.normal_(self.wkv.weight, std=1.0 / math.sqrt(config.engram_dim))

    @classmethod
    def from_released(
        cls,
        checkpoint,
        layer_id: int,
        *,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
        keep_fp8: bool = False,
        load_table: bool = False,
        config=None,
        config_key: str | None = None,
    ) -> Engram:
        """One Engram layer of a released checkpoint, ready to run (no conversion step).

        Args:
            checkpoint: a checkpoint folder or safetensors file, or a `ReleasedCheckpoint`.
            layer_id: the transformer layer (one of the config's ``engram_layer_ids``).
            device, dtype: where and in what the module computes; ``wkv`` is dequantized
                block by block to `dtype`, q/k weights are cast to it.
            keep_fp8: keep ``wkv`` in fp8 with its block scales (`BlockFp8Linear`: a byte per
                weight; dequantized on each call, no fp8 GEMM).
            load_table: also read the table into the module, dequantized to `dtype` (small
                tables only: a V4.1 layer is 94 GiB of fp8). By default the table is left on
                the meta device and rows come from `EngramMemory.from_released`.
            config, config_key: the config (by default the checkpoint folder's config.json,
                keys flat or nested) and the JSON section holding it.

        Backbone dims come from the checkpoint's config, checked against the tensors' shapes.
        Raises `ConfigError` / `ReleasedCheckpointError` (both ValueErrors) naming what is wrong.
        """
        from condmem.fp8 import dequantize_fp8_e8m0
        from condmem.layout import EngramLayout
        from condmem.ops.block_fp8 import BlockFp8Linear
        from condmem.tables.released import open_checkpoint

        ckpt = open_checkpoint(checkpoint, config=config, config_key=config_key)
        cfg = ckpt.module_config()
        if layer_id not in cfg.layer_ids:
            raise ConfigError(f"layer {layer_id} has no Engram; the config's Engram layers are {cfg.layer_ids}")
        layout = EngramLayout(cfg)
        module = cls(cfg, layout.layer(layer_id).num_embeddings, layer_id, device="meta", dtype=dtype)
        q, k = ckpt.gate_weights(layer_id)
        module.q_weight = nn.Parameter(q.to(device=device, dtype=dtype), requires_grad=False)
        module.k_weight = nn.Parameter(k.to(device=device, dtype=dtype), requires_grad=False)
        if keep_fp8:
            weight, scales, _ = ckpt.wkv_fp8(layer_id)
            module.wkv = BlockFp8Linear(weight.to(device), scales.to(device))
        else:
            module.wkv = nn.Linear(cfg.engram_dim, (cfg.hc_mult + 1) * cfg.hidden_size, bias=False, device="meta")
            module.wkv.weight = nn.Parameter(
                ckpt.wkv(layer_id, torch.float32).to(device=device, dtype=dtype), requires_grad=False
            )
        if load_table:
            table = ckpt.table(layer_id, layout)
            module.table.weight = nn.Parameter(
                dequantize_fp8_e8m0(table.weight.contiguous(), table.scales.contiguous(), torch.float32).to(
                    device=device, dtype=dtype
                ),
                requires_grad=False,
            )
        module.released_from = str(ckpt.path)
        return module

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the projection and gate compute in: the weights', or for a block-FP8 ``wkv``
        (`from_released(keep_fp8=True)`) that of the gate weights (the fp8 weight is dequantized to it)."""
        w = self.wkv.weight
        return self.q_weight.dtype if w.dtype == torch.float8_e4m3fn else w.dtype

    def _check(
        self,
        hidden: torch.Tensor,
        row_ids: torch.Tensor | None,
        token_mask: torch.Tensor | None,
        row_vectors: torch.Tensor | None,
        kv: torch.Tensor | None,
    ) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): hidden states must be a float tensor, got "
                f"{getattr(hidden, 'dtype', type(hidden))}"
            )
        if hidden.dim() == 3 and self.hc_mult == 1:
            hidden = hidden.unsqueeze(2)
        if hidden.dim() != 4 or hidden.shape[2:] != (self.hc_mult, self.hidden_size):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): hidden states must be [B, T, hc={self.hc_mult}, D={self.hidden_size}]"
                f"{' or [B, T, D]' if self.hc_mult == 1 else ''}, got {tuple(hidden.shape)}"
            )
        lead = tuple(hidden.shape[:2])
        if row_ids is None and row_vectors is None and kv is None:
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): pass row ids (or looked-up row vectors, or projected kv)"
            )
        if row_ids is not None:
            self._check_row_ids(row_ids, lead)
        shape = (*lead, self.n_cols, self.config.head_dim)
        if row_vectors is not None and kv is None and row_vectors.shape != shape:
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): row_vectors must be [B, T, n_cols, head_dim]="
                f"{shape}, got {tuple(row_vectors.shape)}"
            )
        if kv is not None and kv.shape != (*lead, (self.hc_mult + 1) * self.hidden_size):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): kv must be [B, T, (hc+1)*D]="
                f"{(*lead, (self.hc_mult + 1) * self.hidden_size)}, got {tuple(kv.shape)}"
            )
        if token_mask is not None and (token_mask.dtype != torch.bool or tuple(token_mask.shape) != lead):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): token_mask must be bool [B, T]={lead}, "
                f"got {token_mask.dtype} {tuple(token_mask.shape)}"
            )
        return hidden

    def _check_row_ids(self, row_ids: torch.Tensor, lead: tuple[int, int]) -> None:
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in (torch.int64, torch.int32):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): row ids must be an int64/int32 tensor, got "
                f"{getattr(row_ids, 'dtype', type(row_ids))}"
            )
        if row_ids.shape != (*lead, self.n_cols):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): row ids must be [B, T, n_cols={self.n_cols}] matching hidden "
                f"{lead}, got {tuple(row_ids.shape)} (slice one layer from the hasher's output)"
            )
        if row_ids.device.type == "cpu" and row_ids.numel():
            # On CPU the check is free; on GPU it would cost a sync per step, and the hasher's
            # ids are in range by construction.
            lo, hi = torch.aminmax(row_ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.table.num_embeddings:
                raise EngramInputError(
                    f"Engram(layer {self.layer_id}): row id {lo if lo < 0 else hi} outside the table's "
                    f"0..{self.table.num_embeddings - 1}: ids from another layer or layout?"
                )

    def embed(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Row ids [B, T, n_cols] -> concatenated row vectors [B, T, n_cols * head_dim]."""
        return self.table(row_ids).flatten(-2)

    def project(self, row_vectors: torch.Tensor, columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Row vectors [..., n_cols, head_dim] -> keys and value [..., (hc+1)*D] (``wkv``, in `compute_dtype`).

        `columns` ``(c0, c1)``: `row_vectors` hold only table columns c0..c1-1 ([..., c1-c0, head_dim]),
        multiplied by the matching input columns of ``wkv``: a tensor-parallel rank's partial sum
        (`condmem.distributed.column_parallel_engram` all-reduces it into the full projection).
        """
        wkv = self.wkv
        weight = wkv.weight
        fp8 = weight.dtype == torch.float8_e4m3fn
        dtype = self.q_weight.dtype if fp8 else weight.dtype  # `compute_dtype`, with fewer attribute reads
        x = row_vectors.flatten(-2)
        if x.dtype != dtype:
            x = x.to(dtype)
        if columns is None:
            return wkv(x)
        d = self.config.head_dim
        if fp8:
            weight = wkv.dequantized(dtype)
        return F.linear(x, weight[:, columns[0] * d : columns[1] * d].to(dtype))

    def forward(
        self,
        hidden: torch.Tensor,
        row_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        row_vectors: torch.Tensor | None = None,
        *,
        residual: bool = False,
        conv_state: torch.Tensor | None = None,
        kv: torch.Tensor | None = None,
        gates: dict | None = None,
        rows=UNSET,
    ) -> torch.Tensor:
        """Residual update for `hidden` from this layer's `row_ids`: embed -> wkv -> gate (+ ShortConv).

        This is the one place the layer runs: the decoder, the serving steps, the Hugging Face
        adapter and tensor parallelism all call it, each passing what it has.

        Args:
            hidden: [B, T, hc, D] (or [B, T, D] when hc_mult == 1).
            row_ids: [B, T, n_cols] int64/int32 (checked against the table on CPU); may be None
                when `row_vectors` or `kv` is given.
            token_mask: optional bool [B, T]; False closes the gate (e.g. padding).
            row_vectors: the rows of `row_ids` already looked up elsewhere ([B, T, n_cols, head_dim],
                e.g. by a host-memory lookup); then the table is not read.
            residual: return ``hidden + update`` (without a ShortConv, the add is fused into the gate
                kernel: one pass less over the hidden state, and one rounding instead of two).
            conv_state: optional [B, (kernel-1)*dilation, hc, D]: the ShortConv's inputs at the
                positions just before these (zeros at a sequence start, equal to the conv's own
                padding), for incremental decoding; updated in place (detached) to the inputs
                the next positions need.
            kv: keys and value [B, T, (hc+1)*D] already projected (`project`, e.g. summed over
                tensor-parallel ranks); then neither the table nor ``wkv`` is read.
            gates: optional dict; receives the gate values under ``layer_id`` (fp32 [B, T, hc],
                [B, T] for [B, T, D] hidden; before the token mask), e.g. to inspect them.
            rows: the deprecated name of `row_vectors` (a `DeprecationWarning`; removed in the next release).

        Returns:
            like `hidden`, in its dtype.
        """
        if rows is not UNSET:  # called through nn.Module.__call__: the caller is 5 frames up
            row_vectors = renamed_keyword("Engram.forward", "rows", "row_vectors", rows, row_vectors, stacklevel=5)
        squeeze = hidden.dim() == 3
        hidden4 = self._check(hidden, row_ids, token_mask, row_vectors, kv)
        if kv is None:
            if row_vectors is None:
                table = self.table
                if table.weight.is_meta:
                    raise EngramInputError(
                        f"Engram(layer {self.layer_id}): the table lives outside this module "
                        "(meta); pass the looked-up row vectors (e.g. "
                        "row_vectors=EngramMemory.prepare(...).row_vectors(layer_id))"
                    )
                row_vectors = _read_table(table, row_ids)
            kv = self.project(row_vectors)
        q_weight, k_weight, short_conv = self.q_weight, self.k_weight, self.short_conv
        if gates is not None:
            keys = kv[..., : self.hc_mult * self.hidden_size].unflatten(-1, (self.hc_mult, self.hidden_size))
            values = gate_values(hidden4, keys, q_weight, k_weight, self.eps, GATE_CLAMP).detach()
            gates[self.layer_id] = values[..., 0] if squeeze else values
        fused = residual and short_conv is None
        out = engram_gate(hidden4, kv, q_weight, k_weight, self.eps, GATE_CLAMP, token_mask, residual=fused)
        if short_conv is not None:
            out = out + self._short_conv(short_conv, out, conv_state)
        if residual and not fused:
            out = hidden4 + out
        return out.squeeze(2) if squeeze else out

    def _short_conv(self, short_conv: ShortConv, u: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """ShortConv of gated values `u` [B, T, hc, D], continuing from `state` (see `forward`)."""
        if state is None:
            return short_conv(u)
        pad = (short_conv.kernel_size - 1) * short_conv.dilation
        if state.shape != (u.shape[0], pad, *u.shape[2:]):
            raise EngramInputError(
                f"Engram(layer {self.layer_id}): conv_state must be [B, (kernel-1)*dilation, hc, D]"
                f"={(u.shape[0], pad, *u.shape[2:])}, got {tuple(state.shape)}"
            )
        full = torch.cat([state.to(u.dtype), u], dim=1)
        # Outputs at positions >= pad see only real inputs; the module's own zero padding never
        # reaches them, and a zero state equals the zero padding of a prefill.
        y = short_conv(full)[:, pad:]
        state.copy_(full[:, full.shape[1] - pad :].detach())
        return y

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, hc_mult={self.hc_mult}, hidden={self.hidden_size}, n_cols={self.n_cols}"
