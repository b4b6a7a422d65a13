"""The Engram module against a plain fp64 re-computation of the reference maths.

The reference here is written from the note (section 4), with an explicit loop over
time for the causal conv, sharing no code with condmem.ops.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, devices

from condmem import ConfigError, EngramConfig, EngramLayout, NgramHasher
from condmem.module import Engram, EngramInputError


def _config(hc=2, hidden=96, short_conv=True, n=3, heads=2, head_dim=8):
    return EngramConfig(
        layer_ids=[1],
        max_ngram_size=n,
        n_heads=heads,
        head_dim=head_dim,
        table_size=53,
        hidden_size=hidden,
        hc_mult=hc,
        short_conv=short_conv,
        compressed_vocab_size=40,
    )


def _randomize(module: Engram, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.5 if p.dim() > 1 else 1.0)
                + (1.0 if p.dim() == 2 and p.shape[0] == module.hc_mult else 0.0)
            )


def reference_forward(module: Engram, hidden: torch.Tensor, rows: torch.Tensor, token_mask=None) -> torch.Tensor:
    """fp64, written from the note: e -> wkv -> gate per branch -> value (+ ShortConv)."""
    cfg = module.config
    hc, dim = cfg.hc_mult, cfg.hidden_size
    table = module.table.weight.double()
    e = table[rows].flatten(-2)  # [B, T, cols*hd]
    kv = e @ module.wkv.weight.double().T  # [B, T, (hc+1)*D]
    h = hidden.double()
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    value = kv[..., hc * dim :]
    out = torch.empty(*h.shape, dtype=torch.float64)
    for m in range(hc):
        k = kv[..., m * dim : (m + 1) * dim]
        g = (rms(h[:, :, m], module.q_weight[m].double()) * rms(k, module.k_weight[m].double())).sum(-1) / math.sqrt(
            dim
        )
        g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
        alpha = 1 / (1 + torch.exp(-g))
        if token_mask is not None:
            alpha = alpha * token_mask.double()
        out[:, :, m] = alpha[..., None] * value
    if module.short_conv is None:
        return out
    sc = module.short_conv
    w = sc.weight.double().view(hc, dim, -1)  # [hc, D, K]
    ksz, dil = sc.kernel_size, sc.dilation
    normed = torch.stack([rms(out[:, :, m], sc.norm_weight[m].double()) for m in range(hc)], dim=2)
    conv = torch.zeros_like(out)
    for t in range(out.shape[1]):
        for j in range(ksz):
            src = t - (ksz - 1 - j) * dil  # tap j looks (K-1-j)*dil back
            if src >= 0:
                conv[:, t] += w[:, :, j] * normed[:, src]
    return out + conv * torch.sigmoid(conv)


@pytest.mark.parametrize(
    "hc,hidden,short_conv",
    [(1, 96, True), (2, 96, True), (4, 257, False), (3, 64, True)],
    ids=["hc1-conv", "hc2-conv", "hc4-D257-noconv", "hc3-conv"],
)
@pytest.mark.parametrize("device", devices())
def test_forward_matches_fp64_reference(hc, hidden, short_conv, device):
    gen = torch.Generator().manual_seed(hc * 1000 + hidden)
    cfg = _config(hc, hidden, short_conv)
    layout = EngramLayout(cfg)
    module = Engram(cfg, layout.layer(1).num_embeddings, layer_id=1)
    _randomize(module, gen)
    hasher = NgramHasher(layout)
    ids = torch.randint(0, 40, (2, 9), generator=gen)
    rows = hasher(ids)[:, :, 0]
    hidden_states = torch.randn(2, 9, hc, hidden, generator=gen)
    mask = torch.rand(2, 9, generator=gen) > 0.3
    expect = reference_forward(module, hidden_states, rows, mask)
    module = module.to(device)
    got = module(hidden_states.to(device), rows.to(device), mask.to(device))
    # fp32 compute vs fp64 reference: errors ~1e-6 relative; the signed sqrt amplifies near 0.
    assert_close(f"engram fwd hc={hc} D={hidden}", expect, got, atol=2e-4, rtol=2e-4)
    # With the residual add (fused into the gate kernel where there is no ShortConv).
    got = module(hidden_states.to(device), rows.to(device), mask.to(device), residual=True)
    assert_close(
        f"engram fwd + residual hc={hc} D={hidden}", hidden_states.double() + expect, got, atol=2e-4, rtol=2e-4
    )


def test_fresh_short_conv_is_identity_and_mask_closes_gate():
    gen = torch.Generator().manual_seed(0)
    cfg = _config(hc=2, hidden=32, short_conv=True)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    torch.manual_seed(0)
    with_conv = Engram(cfg, n_rows, layer_id=1)
    torch.manual_seed(0)
    without = Engram(cfg.replace(short_conv=False), n_rows, layer_id=1)
    h = torch.randn(1, 5, 2, 32, generator=gen)
    rows = torch.randint(0, n_rows, (1, 5, cfg.n_cols), generator=gen)
    assert torch.equal(with_conv(h, rows), without(h, rows))  # conv weights start at zero
    mask = torch.tensor([[True, False, True, False, True]])
    out = without(h, rows, mask)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and torch.equal(out[0, 3], torch.zeros_like(out[0, 3]))
    assert out[0, 0].abs().sum() > 0


def _random_layer(seed: int, sparse: bool) -> tuple[Engram, torch.Tensor, torch.Tensor]:
    """A randomized layer (hc 2, width 48, ShortConv) with row ids [2, 6, n_cols] and hidden
    states [2, 6, 2, 48] drawn after it from one generator."""
    gen = torch.Generator().manual_seed(seed)
    cfg = _config(hc=2, hidden=48, short_conv=True)
    module = Engram(cfg, EngramLayout(cfg).layer(1).num_embeddings, layer_id=1, sparse=sparse)
    _randomize(module, gen)
    rows = torch.randint(0, module.table.num_embeddings, (2, 6, cfg.n_cols), generator=gen)
    return module, rows, torch.randn(2, 6, 2, 48, generator=gen)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_gradients_reach_only_rows_read(sparse):
    module, rows, h = _random_layer(3, sparse)
    n_rows = module.table.num_embeddings
    h.requires_grad_(True)
    module(h, rows).square().sum().backward()
    grad = module.table.weight.grad
    if sparse:
        assert grad.is_sparse
        grad = grad.coalesce().to_dense()
    read = torch.zeros(n_rows, dtype=torch.bool)
    read[rows.flatten()] = True
    assert grad[~read].abs().sum() == 0, "rows never read received gradient"
    assert (grad[read].abs().sum(-1) > 0).all(), "a row that was read got no gradient"
    # Every other parameter and the input get gradients too.
    for name, p in module.named_parameters():
        assert p.grad is not None, name
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_sparse_and_dense_gradients_agree():
    gen = torch.Generator().manual_seed(5)
    cfg = _config(hc=1, hidden=32)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    dense = Engram(cfg, n_rows, layer_id=1)
    _randomize(dense, gen)
    sparse = Engram(cfg, n_rows, layer_id=1, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    rows = torch.randint(0, n_rows, (3, 4, cfg.n_cols), generator=gen)
    h = torch.randn(3, 4, 32, generator=gen)
    dense(h, rows).sum().backward()
    sparse(h, rows).sum().backward()
    assert_close("table grad", dense.table.weight.grad, sparse.table.weight.grad.to_dense(), atol=1e-6)


def test_compiled_engram_traces_all_but_its_table_read():
    """Under torch.compile the projection, gate and ShortConv are traced (Inductor fuses them with
    the block around them); the table's read runs as it is, so its gradient stays sparse."""
    module, rows, h = _random_layer(7, sparse=True)
    traced_ops = []

    def backend(gm, example_inputs):  # records the ops, runs them as they are
        traced_ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(module, backend=backend)(h, rows)
    out.square().sum().backward()
    compiled_grads = {name: p.grad for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    module(h, rows).square().sum().backward()
    torch._dynamo.reset()
    assert any("linear" in op for op in traced_ops) and any("silu" in op for op in traced_ops), traced_ops
    assert any("sigmoid" in op for op in traced_ops) and not any("embedding" in op for op in traced_ops)
    # the same maths (ShortConv's taps as shifted products when traced: tests/test_short_conv.py), fp32
    eager = module(h, rows)
    assert (out - eager).abs().max() <= 1e-5 * eager.abs().max()
    assert compiled_grads["table.weight"].is_sparse
    for name, p in module.named_parameters():
        a, b = compiled_grads[name].to_dense(), p.grad.to_dense()
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_meta_device_describes_huge_table_without_memory():
    # The preset states no backbone dims (a checkpoint supplies them): these are arbitrary.
    cfg = EngramConfig.deepseek_v41_flash().replace(hidden_size=512, hc_mult=2, rms_norm_eps=1e-6)
    layout = EngramLayout(cfg)
    module = Engram(cfg, layout.layer(1).num_embeddings, layer_id=1, device="meta")
    assert module.table.weight.shape == (384006168, 256)
    assert module.table.weight.device.type == "meta"
    with pytest.raises(ConfigError, match="needs EngramConfig.hidden_size, hc_mult, rms_norm_eps"):
        Engram(EngramConfig.deepseek_v41_flash(), 10, layer_id=1, device="meta")


def test_bad_inputs_are_named():
    cfg = _config(hc=2, hidden=16, short_conv=False)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    module = Engram(cfg, n_rows, layer_id=1)
    h = torch.randn(1, 3, 2, 16)
    rows = torch.zeros(1, 3, cfg.n_cols, dtype=torch.long)
    with pytest.raises(EngramInputError, match=r"\[B, T, hc=2, D=16\]"):
        module(torch.randn(1, 3, 16), rows)
    with pytest.raises(EngramInputError, match="float tensor"):
        module(h.long(), rows)
    with pytest.raises(EngramInputError, match="int64/int32"):
        module(h, rows.float())
    with pytest.raises(EngramInputError, match=r"n_cols=4"):
        module(h, rows[..., :3])
    with pytest.raises(EngramInputError, match=f"row id {n_rows} outside"):
        module(h, rows + n_rows)
    with pytest.raises(EngramInputError, match="token_mask"):
        module(h, rows, torch.ones(1, 3))


def test_what_callers_hand_in_instead_of_row_ids():
    """Prefetched rows, a projected kv (a tensor-parallel rank's all-reduced one) and project()
    over column slices give the bits of the plain call; the gate values land in `gates`."""
    gen = torch.Generator().manual_seed(7)
    cfg = _config(hc=2, hidden=32, short_conv=True)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    module = Engram(cfg, n_rows, layer_id=1)
    _randomize(module, gen)
    h = torch.randn(2, 5, 2, 32, generator=gen)
    row_ids = torch.randint(0, n_rows, (2, 5, cfg.n_cols), generator=gen)
    mask = torch.rand(2, 5, generator=gen) > 0.3
    with torch.no_grad():
        want = module(h, row_ids, mask, residual=True)
        rows = module.table(row_ids)
        assert torch.equal(module(h, None, mask, rows=rows, residual=True), want)
        kv = module.project(rows)
        assert torch.equal(module(h, token_mask=mask, kv=kv, residual=True), want)
        halves = module.project(rows[:, :, :2], columns=(0, 2)) + module.project(rows[:, :, 2:], columns=(2, 4))
        assert_close("project by column halves", kv, halves, atol=1e-5)
        gates = {}
        module(h, row_ids, gates=gates)
        assert gates[1].shape == (2, 5, 2) and gates[1].dtype == torch.float32
        assert bool(((gates[1] > 0) & (gates[1] < 1)).all())


def test_the_old_rows_keyword_works_for_one_release_with_a_deprecation_warning():
    """``rows=`` is the deprecated name of ``row_vectors=``: same result, a `DeprecationWarning`
    pointing at the caller's line, and an error when both are given."""
    cfg = _config(hc=1, hidden=16)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    module = Engram(cfg, n_rows, layer_id=1)
    h = torch.randn(1, 3, 16)
    with torch.no_grad():
        row_vectors = module.table(torch.randint(0, n_rows, (1, 3, cfg.n_cols)))
        want = module(h, row_vectors=row_vectors)
        with pytest.warns(DeprecationWarning, match=r"rows= is deprecated.*use row_vectors=") as caught:
            got = module(h, rows=row_vectors)
    assert torch.equal(got, want) and caught[0].filename == __file__
    with pytest.raises(TypeError, match="pass row_vectors= only"):
        module(h, row_vectors=row_vectors, rows=row_vectors)


def test_bad_rows_kv_and_conv_state_are_named():
    cfg = _config(hc=1, hidden=16, short_conv=True)
    n_rows = EngramLayout(cfg).layer(1).num_embeddings
    module = Engram(cfg, n_rows, layer_id=1)
    h = torch.randn(1, 3, 16)
    rows = torch.zeros(1, 3, cfg.n_cols, dtype=torch.long)
    with pytest.raises(EngramInputError, match="pass row ids"):
        module(h)
    with pytest.raises(EngramInputError, match=r"row_vectors must be \[B, T, n_cols, head_dim\]"):
        module(h, row_vectors=torch.zeros(1, 3, cfg.n_cols, 5))
    with pytest.raises(EngramInputError, match=r"kv must be \[B, T, \(hc\+1\)\*D\]"):
        module(h, kv=torch.zeros(1, 3, 16))
    with pytest.raises(EngramInputError, match="conv_state must be"):
        module(h, rows, conv_state=torch.zeros(1, 2, 1, 16))
