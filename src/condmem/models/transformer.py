"""`DecoderLM`: the reference Llama-style decoder, with Engram modules at chosen layers.

Dense, or with routed experts (`condmem.models.moe`) beside a shared SwiGLU where the config says.

    token ids ──> NgramHasher ──> row ids for every Engram layer (once, before block 0)
    embed ──> block 0 ──> block 1 [h += Engram(h, row_ids[1])] ──> ... ──> norm ──> logits

Each block is ``h += Engram(h, row_ids)`` (Engram layers only), ``h += Attn(norm(h))``,
``h += SwiGLU(norm(h))``. Without an Engram config the same code is a plain baseline.

`Block.forward(x, ctx)` is the only block forward and `DecoderLM.forward` the only loop over
the blocks: what differs between ways of running (attention over a dense or paged KV layout,
each Engram layer's row ids or looked-up row vectors, the tensor-parallel reduction, fused
inference kernels) comes from a `condmem.models.context.ForwardContext`. `dense_context` builds
the one of training, evaluation and `generate`; the serving steps build their own.

The Engram module is `condmem.module.Engram`, called as a whole everywhere: incremental
decoding hands it the ShortConv's recent inputs (``conv_state``), gate capture a dict
that receives the per-token gate (the paper's case study).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from condmem.hashing import NgramHasher, NgramHistory
from condmem.layout import EngramLayout
from condmem.models.addresses import RandomAddresses
from condmem.models.attention import Attention, DenseAttention, KVCache
from condmem.models.config import ModelConfig
from condmem.models.context import ConvStates, HashedRowIds, ForwardContext, run_engram
from condmem.models.layers import RMSNorm, Rotary, SwiGLU
from condmem.models.moe import MoE
from condmem.module import Engram


@dataclass
class InferenceCache:
    """Everything incremental decoding keeps between steps for `batch` sequences.

    * ``kv``: one `KVCache` per block;
    * ``conv``: per Engram layer, the last (kernel-1)*dilation ShortConv inputs [B, pad, 1, D];
    * ``history``: the sequences' look-back (an `NgramHistory` by position: row b is sequence b;
      the hash of a new token looks back N-1 ids).
    """

    kv: list[KVCache]
    conv: dict[int, torch.Tensor]
    history: NgramHistory
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.kv[0].max_len


@dataclass
class GateCapture:
    """Gate values recorded during a forward: layer id -> fp32 [B, T]."""

    gates: dict[int, torch.Tensor] = field(default_factory=dict)


class Block(nn.Module):
    """One decoder block: optional Engram, attention, SwiGLU and/or routed experts (all pre-norm residual)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        engram_inputs: int | None,
        sparse_tables: bool,
        device=None,
        table_device=None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.engram = (
            Engram(
                cfg.engram,
                engram_inputs,
                layer_id=layer_id,
                sparse=sparse_tables,
                table_init_std=cfg.engram_table_init_std,
                device=device,
                table_device=table_device,
            )
            if engram_inputs is not None
            else None
        )
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, device=device)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        width = cfg.ffn_width(layer_id)
        # With routed experts the SwiGLU is the shared expert (width 0: none).
        self.mlp = SwiGLU(cfg.dim, width, device=device) if width > 0 else None
        self.moe = MoE.from_config(cfg.dim, cfg.moe, device=device) if cfg.has_experts(layer_id) else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The block over hidden states x [B, T, D], with what differs between ways of running from
        `ctx` (attention backend, Engram inputs, ShortConv states, tensor-parallel reduction, kernels)."""
        fused = ctx.fused
        if self.engram is not None:
            x = run_engram(self.engram, x, ctx)
        q, k, v = self.attn.qkv(self.attn_norm(x, fused=fused), joined=fused)
        y = self.attn.wo(ctx.attend(self.layer_id, q, k, v))
        x, h = self.mlp_norm.add_norm(x, ctx.reduce(y), fused=fused)
        if self.moe is None:
            return self.mlp.add_to(x, h, fused=fused, reduce=None if ctx.tp_group is None else ctx.reduce)
        routed = self.moe(h)
        return x + (routed if self.mlp is None else self.mlp(h) + routed)


class DecoderLM(nn.Module):
    """The reference decoder LM.

    Args:
        cfg: geometry; ``cfg.engram`` adds Engram layers (its compressed_vocab_size must be set).
        token_lookup: the compressed tokenizer's map (``CompressedTokenizer.lookup``), needed
            to hash when the model has Engram layers; its V' must match the config's.
        sparse_tables: Engram tables produce sparse gradients (train them with `SparseAdam`).
        seed: initialization seed. Each backbone parameter draws from a generator seeded by
            (seed, its name), so a baseline and an Engram model start from the same backbone.
        device: where to build the parameters.
        table_device: where to build the Engram tables, if not `device`; ``"meta"`` for tables
            that live in an `EngramMemory` (host memory, disk): the model then needs
            ``forward(..., prepared=memory.prepare(ids))``.

    Example:
        >>> model = DecoderLM(cfg, token_lookup=ctok.lookup)
        >>> logits = model(input_ids)                        # [B, T, vocab]
        >>> loss = model.loss(input_ids, targets)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        token_lookup=None,
        *,
        sparse_tables: bool = True,
        seed: int = 0,
        device=None,
        table_device=None,
    ):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.layout: EngramLayout | None = None
        self.hasher: NgramHasher | None = None
        self.random_addresses: RandomAddresses | None = None
        num_rows_of: dict[int, int] = {}
        if cfg.engram is not None:
            self.layout = EngramLayout(cfg.engram)
            num_rows_of = dict(zip(self.layout.layer_ids, self.layout.num_embeddings))
            if cfg.engram_addresses == "random":
                self.random_addresses = RandomAddresses(self.layout, seed, device=device)
            if token_lookup is not None:
                self.hasher = NgramHasher(self.layout, token_lookup=token_lookup, pad_id=cfg.engram.pad_id)
                if self.hasher.vocab_size != cfg.vocab_size:
                    raise ValueError(
                        f"the tokenizer's map covers {self.hasher.vocab_size} token ids but the model's "
                        f"vocab_size is {cfg.vocab_size}"
                    )
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
        self.blocks = nn.ModuleList(
            Block(cfg, i, num_rows_of.get(i), sparse_tables, device=device, table_device=table_device)
            for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters(seed)
        # Set by `condmem.distributed.shard_backbone`: the group the blocks are split over.
        self.tp_group = None

    # ------------------------------------------------------------------ parameters
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialize every parameter from a generator seeded by (seed, parameter name)."""
        cfg = self.cfg
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            gen = torch.Generator(device=p.device)
            gen.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little"))
            with torch.no_grad():
                if name.endswith("table.weight"):
                    p.normal_(0.0, cfg.engram_table_init_std, generator=gen)
                elif name.endswith("engram.wkv.weight"):
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
                elif name.endswith(("attn.wo.weight", "mlp.w2.weight", "moe.w2")):
                    p.normal_(0.0, resid_std, generator=gen)
                elif p.dim() >= 2:
                    p.normal_(0.0, cfg.init_std, generator=gen)
                elif name.endswith("short_conv.weight"):
                    p.zero_()
                else:  # norm weights, gate norm weights
                    p.fill_(1.0)

    def table_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every Engram table (trained by the sparse optimizer)."""
        return [(n, p) for n, p in self.named_parameters() if n.endswith("table.weight")]

    def backbone_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of everything else (Engram projections and gates included)."""
        return [(n, p) for n, p in self.named_parameters() if not n.endswith("table.weight")]

    def param_counts(self) -> dict[str, int]:
        """Parameters: ``total``, Engram ``tables``, ``backbone`` (the rest), ``embeddings`` (input and
        output), ``non_embedding`` (backbone minus embeddings) and ``active``: the backbone
        parameters one token uses (the routed experts it is not sent to left out; table rows
        are read, not multiplied, and are not counted)."""
        tables = sum(p.numel() for _, p in self.table_parameters())
        total = sum(p.numel() for p in self.parameters())
        embed = self.embed.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        idle = sum(
            (b.moe.n_experts - b.moe.top_k) * (b.moe.w13[0].numel() + b.moe.w2[0].numel())
            for b in self.blocks
            if b.moe is not None
        )
        return {
            "total": total,
            "tables": tables,
            "backbone": total - tables,
            "embeddings": embed,
            "non_embedding": total - tables - embed,
            "active": total - tables - idle,
        }

    def aux_loss(self) -> torch.Tensor | None:
        """The routed experts' load-balancing loss of the last training forward, weighted by
        ``cfg.moe.aux_loss_coef`` and summed over blocks (None: no routed experts, or eval mode)."""
        losses = [b.moe.aux_loss for b in self.blocks if b.moe is not None and b.moe.aux_loss is not None]
        if not losses or not self.cfg.moe.aux_loss_coef:
            return None
        return self.cfg.moe.aux_loss_coef * torch.stack(losses).sum()

    @property
    def engram_layers(self) -> list[Engram]:
        return [b.engram for b in self.blocks if b.engram is not None]

    # ------------------------------------------------------------------ hashing
    def row_ids(self, input_ids: torch.Tensor, doc_starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, T, n_engram_layers, n_cols] row ids, or None for a model without Engram.

        With ``cfg.engram_addresses == "random"``: random rows, new at each call
        (`condmem.models.addresses`); `doc_starts` is then not read."""
        if self.cfg.engram is None:
            return None
        if self.random_addresses is not None:  # the random-address control: no row follows content
            return self.random_addresses(tuple(input_ids.shape), input_ids.device, self.training)
        if self.hasher is None:
            raise RuntimeError("this model has Engram layers but no tokenizer map: pass token_lookup= when building it")
        return self.hasher(input_ids, doc_starts=doc_starts, check=input_ids.device.type == "cpu")

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        doc_starts: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
        capture: GateCapture | None = None,
        prepared=None,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
        row_ids: torch.Tensor | None = None,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]: the one loop over the blocks.

        Args:
            doc_starts: optional bool [B, T], True at the first token of each document of a
                packed row: n-gram look-backs stop there.
            cache: incremental decoding state (see `new_cache`); the ids are appended at
                ``cache.length`` and the cache advances.
            capture: records the Engram gate values.
            prepared: a `condmem.serving.Prepared` from `EngramMemory.prepare` /
                `prepare_decode` for these ids: row ids and row vectors come from it (tables in
                host memory, fetched while the earlier blocks run), each Engram layer
                waiting only for its own rows.
            last_only: logits of the last position only ([B, 1, vocab]): what a prefill
                that samples the next token needs (the output projection over a whole
                prompt is a large, wasted matmul).
            logits_at: optional [B] positions: logits of one position per row ([B, 1, vocab]),
                e.g. the last real token of right-padded prompts.
            row_ids: `row_ids` of these ids (and `doc_starts`) computed already, e.g. for a
                prefetch of host-resident tables; without a cache only.
            context: a `ForwardContext` built by the caller (the paged serving steps), instead of
                the arguments above but `last_only` and `logits_at`. Default: `dense_context` of
                those arguments.
        """
        if context is None:
            context = self.dense_context(
                input_ids, doc_starts=doc_starts, cache=cache, capture=capture, prepared=prepared, row_ids=row_ids
            )
        elif any(a is not None for a in (doc_starts, cache, capture, prepared, row_ids)):
            raise ValueError(
                "DecoderLM.forward takes a context or the arguments a dense context is made of "
                "(doc_starts, cache, capture, prepared, row_ids), not both"
            )
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, context)
        if cache is not None:
            cache.length += input_ids.shape[1]
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at.to(x.device)][:, None]
        elif context.keep is not None:
            x = x.flatten(0, 1)[context.keep][None]
        return self.head(x, fused=context.fused)

    def head(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """Logits of the last block's hidden states x [..., dim]: the final norm, then the output
        projection. Its own method, so that training compiles it apart from the blocks."""
        return self.lm_head(self.norm(x, fused=fused))

    def dense_context(
        self,
        input_ids: torch.Tensor,
        *,
        doc_starts: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
        capture: GateCapture | None = None,
        prepared=None,
        row_ids: torch.Tensor | None = None,
    ) -> ForwardContext:
        """The `ForwardContext` of a dense forward of token ids [B, T] (`forward`'s arguments):
        `DenseAttention` over the whole sequence or after `cache`'s positions, and each Engram
        layer's rows hashed here, given (`row_ids`) or prefetched (`prepared`)."""
        if self.tp_group is not None:
            raise RuntimeError(
                "this model's blocks are sharded for tensor-parallel serving (shard_backbone): "
                "run it through condmem.serving (ragged_step, prefill_packed, decode_step, "
                "GraphedDecoder), whose forward completes each block's partial sums"
            )
        batch, length = input_ids.shape
        start = 0
        row_ids_all = None
        if cache is not None:
            start = cache.length
            if start + length > cache.max_len:
                raise ValueError(f"the cache holds {cache.max_len} positions; {start + length} asked")
            cache.history.write(batch, start, input_ids)
            if self.cfg.engram is not None and prepared is None:
                # A position's rows depend on it and the N-1 ids before: hash that window only.
                back = min(start, self.cfg.engram.max_ngram_size - 1)
                row_ids_all = self.row_ids(cache.history.span(batch, start - back, start + length))[:, back:]
        elif prepared is None:
            row_ids_all = row_ids if row_ids is not None else self.row_ids(input_ids, doc_starts)
        engram_inputs = prepared
        if row_ids_all is not None:
            engram_inputs = HashedRowIds(row_ids_all, self.layout.layer_ids)
        cos, sin = self.rotary(start, length)
        return ForwardContext(
            attend=DenseAttention(cos, sin, None if cache is None else cache.kv, start),
            engram_inputs=engram_inputs,
            conv=None if cache is None else ConvStates(cache.conv, batch),
            gates=None if capture is None else capture.gates,
        )

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
        reduction: str = "mean",
        row_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cross-entropy (nats) of `targets` [B, T] given `input_ids` [B, T]; -100 targets are ignored.
        ``row_ids``: as `forward`'s."""
        logits = self(input_ids, doc_starts=doc_starts, row_ids=row_ids)
        loss = self.cross_entropy(logits, targets, reduction)
        return loss if reduction != "none" else loss.view_as(targets)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy (nats) of `targets` [B, T] under `logits` [B, T, V], in fp32; -100 targets are
        ignored. Its own method, so that it can be compiled apart from the blocks (its output is the
        step's loss, which a CUDA graph's next replay would overwrite)."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)

    # ------------------------------------------------------------------ inference helpers
    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> InferenceCache:
        """An empty decoding state for `batch` sequences of up to `max_len` tokens."""
        cfg = self.cfg
        max_len = max_len or cfg.max_seq_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        device = self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        kv = [KVCache(batch, cfg.n_kv_heads, max_len, cfg.head_dim, device=device, dtype=dtype) for _ in self.blocks]
        conv = {}
        for block in self.blocks:
            if block.engram is not None and block.engram.short_conv is not None:
                sc = block.engram.short_conv
                conv[block.layer_id] = torch.zeros(
                    batch, (sc.kernel_size - 1) * sc.dilation, 1, cfg.dim, device=device, dtype=dtype
                )
            elif block.engram is not None:
                conv[block.layer_id] = None
        return InferenceCache(kv=kv, conv=conv, history=self.new_history(batch, max_len))

    def new_history(self, n_slots: int, max_len: int) -> NgramHistory:
        """The look-back of `n_slots` sequences of up to `max_len` tokens, by position (what a cache
        keeps: `InferenceCache`, `condmem.serving.ServingCache`), on the model's device. A model
        without Engram hashes nothing but keeps the token ids all the same (a cache's prefix copies
        carry them)."""
        engram = self.cfg.engram
        n, pad = (engram.max_ngram_size, engram.pad_id) if engram is not None else (2, 0)
        return NgramHistory(n_slots, n, pad, self.embed.weight.device, max_len=max_len)

    @torch.no_grad()
    def gate_values(self, input_ids: torch.Tensor, doc_starts: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Per-token Engram gate values {layer id: fp32 [B, T]} (sigmoid outputs in (0, 1))."""
        capture = GateCapture()
        self(input_ids, doc_starts=doc_starts, capture=capture)
        return capture.gates


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Switch to eval for the block, then restore the previous mode."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)
