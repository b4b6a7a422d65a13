"""Fused gate kernel: forward and every gradient against an fp64 reference, on fresh random inputs.

Hidden sizes include non-powers of two (96, 257 everywhere; 2560, 7168 on a GPU). The fp64
reference is the plain composition (`engram_gate_reference`) on upcast inputs, differentiated
by autograd.
"""

from __future__ import annotations

import pytest
import torch

from condmem.ops.gate import engram_gate, engram_gate_reference
from kernel_helpers import INTERPRET, assert_rel, kernel_devices, needs_kernels, rel_err

pytestmark = needs_kernels
DEVICES = kernel_devices()
SIZES = [(1, 96, 5), (4, 257, 3), (2, 64, 1)] + ([] if INTERPRET else [(4, 2560, 300), (4, 7168, 129), (1, 4096, 64)])


def _inputs(n, hc, dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hc, dim, generator=gen) * 2.0
    kv = torch.randn(n, (hc + 1) * dim, generator=gen)
    # Keys correlated with the hidden state for some tokens: gates far from 0.5 as well as near it.
    kv[: n // 2, : hc * dim] += 0.5 * hidden[: n // 2].reshape(n // 2, hc * dim)
    qw = 1.0 + 0.3 * torch.randn(hc, dim, generator=gen)
    kw = 1.0 + 0.3 * torch.randn(hc, dim, generator=gen)
    mask = torch.rand(n, generator=gen) < 0.75
    return [t.to(device=device, dtype=dtype) for t in (hidden, kv, qw, kw)], mask.to(device)


def _fp64_reference(inputs, mask, grad_out, residual=False):
    ins = [t.detach().double().cpu().requires_grad_() for t in inputs]
    out = engram_gate_reference(*ins, token_mask=None if mask is None else mask.cpu(), residual=residual)
    grads = torch.autograd.grad(out, ins, grad_out.double().cpu())
    return out, grads


def _torch_same_precision(inputs, mask, grad_out, residual=False):
    """The eager composition in the inputs' own precision: how far any implementation at that precision lands."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = engram_gate_reference(*ins, token_mask=mask, residual=residual)
    return out, torch.autograd.grad(out, ins, grad_out)


# Tolerances on ||got - fp64|| / ||fp64||: (forward, gradients), or RATIO x the error of the eager torch
# composition at the same precision, whichever is larger. The gate's slope 1/(2 sqrt|s|) makes gradients
# of tokens with |s| near 0 ill-conditioned (an fp32 rounding of s moves them a lot) whatever computes them.
# The fp32 floors hold over fresh seeds (2e-5 on the gradients failed about 1 run in 10 on CPU: 2.1e-5 seen).
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (8e-3, 2e-2)}
RATIO = 4.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", [False, True], ids=["gate", "residual"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hc,dim,n", SIZES, ids=lambda v: str(v))
def test_gate_forward_and_grads_vs_fp64(hc, dim, n, dtype, masked, residual, device):
    """The gate alone, or with the residual add fused in (``hidden + gate * v``)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run (printed on failure)
    inputs, mask = _inputs(n, hc, dim, dtype, device, seed)
    mask = mask if masked else None
    inputs = [t.requires_grad_() for t in inputs]
    out = engram_gate(*inputs, token_mask=mask, residual=residual, backend="triton")
    assert out.dtype == dtype and out.shape == (n, hc, dim)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_out, ref_grads = _fp64_reference(inputs, mask, grad_out, residual)
    base_out, base_grads = _torch_same_precision(inputs, mask, grad_out, residual)
    fwd_tol, grad_tol = TOL[dtype]
    assert_rel(f"forward (seed {seed})", ref_out, out, max(fwd_tol, RATIO * rel_err(ref_out, base_out)))
    for name, r, g, b in zip(("d hidden", "d kv", "d q_weight", "d k_weight"), ref_grads, grads, base_grads):
        assert g.dtype == dtype
        assert_rel(f"{name} (seed {seed})", r, g, max(grad_tol, RATIO * rel_err(r, b)))
    if mask is not None and (~mask).any():
        want = inputs[0][~mask] if residual else torch.zeros_like(out[~mask])
        assert torch.equal(out[~mask], want.detach())
    # Other launch configurations (chunks of the two passes, warps) give the same numbers up to rounding
    # (chunks too narrow for a wide row are widened to at most MAX_CHUNKS by the launcher).
    from condmem.ops.gate.triton import gate_forward_triton

    plain = [t.detach() for t in inputs]
    for chunk, warps in ((32, 4), (64, 2), (1024, 8)):
        other = gate_forward_triton(*plain, 1e-6, 1e-6, mask, residual=residual, chunk=chunk, num_warps=warps)
        assert_rel(
            f"forward, chunk {chunk} warps {warps} (seed {seed})",
            ref_out,
            other,
            max(fwd_tol, RATIO * rel_err(ref_out, base_out)),
        )


@pytest.mark.parametrize("device", DEVICES)
def test_gate_batched_shape_and_zero_key(device):
    """[B, T, hc, D] inputs; a zero key puts the gate in the clamp region (g = 0 slope there)."""
    inputs, mask = _inputs(6, 2, 96, torch.float32, device, seed=5)
    hidden, kv, qw, kw = inputs
    kv = kv.clone()
    kv[0, :96] = 0  # branch 0 of token 0: s = 0 -> sigmoid(0)
    hidden4, kv4 = hidden.reshape(2, 3, 2, 96), kv.reshape(2, 3, 3 * 96)
    args = [t.clone().requires_grad_() for t in (hidden4, kv4, qw, kw)]
    out = engram_gate(*args, token_mask=mask.reshape(2, 3), backend="triton")
    ref_out, ref_grads = _fp64_reference(args, mask.reshape(2, 3), torch.ones_like(out))
    assert_rel("forward", ref_out, out, 2e-6)
    grads = torch.autograd.grad(out, args, torch.ones_like(out))
    for name, r, g in zip(("dh", "dkv", "dqw", "dkw"), ref_grads, grads):
        assert_rel(name, r, g, 2e-5)
    if mask[0]:
        assert torch.allclose(out[0, 0, 0], 0.5 * kv[0, 2 * 96 :], atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gate_empty_batch(device):
    inputs, _ = _inputs(0, 2, 96, torch.float32, device, seed=1)
    assert engram_gate(*inputs, backend="triton").shape == (0, 2, 96)


def test_gate_auto_backend_on_cpu_is_reference():
    inputs, mask = _inputs(4, 2, 64, torch.float32, "cpu", seed=2)
    assert torch.equal(engram_gate(*inputs, token_mask=mask), engram_gate_reference(*inputs, token_mask=mask))
    with pytest.raises(ValueError, match="backend"):
        engram_gate(*inputs, backend="cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_a_traced_gate_is_the_reference(device):
    # under torch.compile the auto backend traces the reference's plain ops (no Triton call in the
    # graph: its float scalars would be traced as fp64 tensors); "eager" runs the traced ops as they are
    inputs, mask = _inputs(4, 2, 64, torch.float32, device, seed=3)
    traced = torch.compile(engram_gate, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    out = traced(*inputs, token_mask=mask, residual=True)
    assert torch.equal(out, engram_gate_reference(*inputs, token_mask=mask, residual=True))


@pytest.mark.gpu
def test_engram_module_uses_kernel_on_gpu():
    """The Engram module's forward and backward on CUDA (auto -> Triton) match the torch backend."""
    from condmem import EngramConfig, EngramLayout, NgramHasher
    from condmem.module import Engram

    cfg = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=2,
        head_dim=32,
        table_size=101,
        hidden_size=257,
        hc_mult=4,
        short_conv=True,
        compressed_vocab_size=50,
    )
    layout = EngramLayout(cfg)
    torch.manual_seed(0)
    module = Engram(cfg, layout.layer(1).num_embeddings, layer_id=1).cuda()
    rows = NgramHasher(layout)(torch.randint(0, 50, (2, 11)).cuda())[:, :, 0]
    hidden = torch.randn(2, 11, 4, 257, device="cuda", requires_grad=True)
    out = module(hidden, rows)
    out.square().sum().backward()
    g_kernel = [p.grad.clone() for p in (hidden, module.q_weight, module.k_weight, module.wkv.weight)]
    for p in (hidden, module.q_weight, module.k_weight, module.wkv.weight):
        p.grad = None
    import condmem.ops.gate as gate_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate_mod, "engram_gate", lambda *a, **k: gate_mod.engram_gate_reference(*a, **k))
        import condmem.module as module_mod

        mp.setattr(module_mod, "engram_gate", lambda *a, **k: gate_mod.engram_gate_reference(*a, **k))
        ref = module(hidden, rows)
        ref.square().sum().backward()
    assert_rel("module forward", ref, out, 1e-5)
    for name, g, p in zip(
        ("hidden", "q_weight", "k_weight", "wkv"),
        g_kernel,
        (hidden, module.q_weight, module.k_weight, module.wkv.weight),
    ):
        assert_rel(f"module grad {name}", p.grad, g, 1e-4)
