"""FLOPs and parameters per token of the reference decoder, and the iso-FLOP baseline of an Engram model.

Counted: every matrix product (2 FLOPs per multiply-add), attention scores and values
over the average causal context, the Engram's ``wkv`` GEMM, its depthwise ShortConv
and its gate dot product, and in a block with routed experts the router (every expert's
logit) and the ``top_k`` experts a token goes through. Not counted: embedding and table lookups (gathers, no
arithmetic), norms, activations, softmax and other elementwise work (the router's
renormalisation, routed scale and selection bias among them: a few operations per expert
a token), which is the same order for both models and small beside the GEMMs. Training
costs 3x the forward (backward = 2x forward), the usual convention.

The study's controls keep these counts: `iso_flop_baseline` (no table, its FLOPs on the
MLP), `tiny_table_control` (the same Engram with a table of a few rows per head),
`random_address_control` (the same table read at random rows) and `dense_control` (no
routed experts: their active width and the router's FLOPs on the MLP).
"""

from __future__ import annotations

from condmem.models.config import ModelConfig

TINY_TABLE_ROWS = 1024
"""`tiny_table_control`'s default bound on the rows of one (order, head) column."""


def engram_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of ONE Engram module of `cfg` (0 without Engram)."""
    e = cfg.engram
    if e is None:
        return 0
    wkv = 2 * e.engram_dim * (e.hc_mult + 1) * e.hidden_size
    conv = 2 * e.hidden_size * e.hc_mult * e.kernel_size if e.short_conv else 0
    gate = 2 * e.hidden_size * e.hc_mult
    return wkv + conv + gate


def moe_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of ONE block's routed experts: the router and top_k SwiGLU experts (0 without)."""
    m = cfg.moe
    if m is None:
        return 0
    return 2 * cfg.dim * m.n_experts + m.top_k * 2 * 3 * cfg.dim * m.expert_hidden


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token by component, for sequences of `seq_len` tokens (default max_seq_len).

    Returns:
        dict with ``attention_proj``, ``attention_scores``, ``mlp`` (dense SwiGLUs and shared
        experts), ``moe`` (routers and routed experts), ``lm_head``, ``engram`` and ``total``.
    """
    seq_len = seq_len or cfg.max_seq_len
    d, hd = cfg.dim, cfg.head_dim
    kv_dim = cfg.n_kv_heads * hd
    # Causal attention: the token at position t attends to t+1 keys; average (T+1)/2.
    context = (seq_len + 1) / 2
    out = {
        "attention_proj": cfg.n_layers * 2 * (d * d + 2 * d * kv_dim + d * d),
        "attention_scores": int(cfg.n_layers * 2 * 2 * cfg.n_heads * hd * context),
        "mlp": sum(2 * 3 * d * cfg.ffn_width(i) for i in range(cfg.n_layers)),
        "moe": len(cfg.moe_layer_ids) * moe_flops_per_token(cfg),
        "lm_head": 2 * d * cfg.vocab_size,
        "engram": len(cfg.engram_layer_ids) * engram_flops_per_token(cfg),
    }
    out["total"] = sum(out.values())
    return out


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 3x the forward."""
    return 3 * forward_flops_per_token(cfg, seq_len)["total"]


def iso_flop_baseline(cfg: ModelConfig) -> ModelConfig:
    """The same backbone without Engram, its MLP widened in each Engram block by the Engram's FLOPs.

    A SwiGLU hidden unit costs 2*3*dim forward FLOPs per token, so each Engram block's MLP
    gains round(engram FLOPs / (6*dim)) units: the two models then differ by less than
    one hidden unit's FLOPs per Engram layer.
    """
    if cfg.engram is None:
        return cfg
    extra = round(engram_flops_per_token(cfg) / (2 * 3 * cfg.dim))
    widths = [cfg.ffn_width(i) + (extra if i in cfg.engram_layer_ids else 0) for i in range(cfg.n_layers)]
    return cfg.replace(engram=None, ffn_hidden=widths)


def dense_control(cfg: ModelConfig) -> ModelConfig:
    """The same model without routed experts: each MoE block's SwiGLU as wide as its shared
    expert plus the ``top_k`` experts a token goes through, plus round(E / 3) units for the
    router (its 2*dim*E FLOPs and dim*E parameters are what E/3 SwiGLU units cost), so
    FLOPs and active parameters per token match the MoE model's to within one hidden unit
    per block (exactly when E is a multiple of 3). The Engram, if any, is kept.

    Raises ValueError for a model without routed experts."""
    m = cfg.moe
    if m is None:
        raise ValueError("dense_control: the model has no routed experts (cfg.moe is None)")
    extra = m.top_k * m.expert_hidden + round(m.n_experts / 3)
    widths = [cfg.ffn_width(i) + (extra if cfg.has_experts(i) else 0) for i in range(cfg.n_layers)]
    return cfg.replace(moe=None, ffn_hidden=widths)


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """`DecoderLM.param_counts` from the config alone (no model is built): ``total``, ``tables``,
    ``backbone``, ``embeddings``, ``non_embedding`` and ``active`` (routed experts a token is
    not sent to left out). Table rows are the layout's (sums of primes)."""
    from condmem.layout import EngramLayout

    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    blocks = cfg.n_layers * (2 * d + 2 * d * d + 2 * d * kv)  # two norms, attention
    blocks += sum(3 * d * cfg.ffn_width(i) for i in range(cfg.n_layers))
    expert = 3 * d * cfg.moe.expert_hidden if cfg.moe is not None else 0
    idle = 0
    for _ in cfg.moe_layer_ids:
        blocks += cfg.moe.n_experts * (d + expert)  # router row + expert
        idle += (cfg.moe.n_experts - cfg.moe.top_k) * expert
    tables = 0
    e = cfg.engram
    if e is not None:
        per_layer = e.engram_dim * (e.hc_mult + 1) * d + 2 * e.hc_mult * d  # wkv, gate norms
        if e.short_conv:
            per_layer += e.hc_mult * d * (1 + e.kernel_size)  # its norm, depthwise taps
        blocks += len(e.layer_ids) * per_layer
        tables = sum(EngramLayout(e).num_embeddings) * e.head_dim
    total = embed + blocks + d + tables  # + the final norm
    return {
        "total": total,
        "tables": tables,
        "backbone": total - tables,
        "embeddings": embed,
        "non_embedding": total - tables - embed,
        "active": total - tables - idle,
    }


def tiny_table_control(cfg: ModelConfig, max_rows_per_head: int = TINY_TABLE_ROWS) -> ModelConfig:
    """The same model with the largest uniform ``table_size`` whose every (order, head) column of
    every Engram layer has at most `max_rows_per_head` rows, and never above the model's own
    smallest size: the same Engram module and FLOPs, a table too small to memorise (it tells
    memory from the extra pathway).

    Raises ValueError without Engram, or when even the smallest table size exceeds the bound
    (each column's prime is distinct, so many columns need a larger bound).
    """
    from condmem.layout import draw_primes

    e = cfg.engram
    if e is None:
        raise ValueError("tiny_table_control: the model has no Engram (cfg.engram is None)")

    def widest(size: int) -> int:
        return max(max(cols) for cols in draw_primes(e.layer_ids, [size] * (e.max_ngram_size - 1), e.n_heads))

    if widest(2) > max_rows_per_head:
        raise ValueError(
            f"tiny_table_control: {e.n_cols} columns per layer need rows up to {widest(2)} per column, "
            f"above max_rows_per_head={max_rows_per_head}"
        )
    lo, hi = 2, max(2, max_rows_per_head)
    while lo < hi:  # widest() grows with the size: the last size that fits
        mid = (lo + hi + 1) // 2
        if widest(mid) <= max_rows_per_head:
            lo = mid
        else:
            hi = mid - 1
    return cfg.replace(engram=e.replace(table_size=min(lo, *e.table_sizes), num_embeddings=None))


def random_address_control(cfg: ModelConfig) -> ModelConfig:
    """The same model (tables, parameters, FLOPs) reading random rows at every step instead of the
    n-gram hash's (``engram_addresses="random"``, `condmem.models.addresses`). ValueError without Engram."""
    if cfg.engram is None:
        raise ValueError("random_address_control: the model has no Engram (cfg.engram is None)")
    return cfg.replace(engram_addresses="random")
