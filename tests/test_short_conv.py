"""ShortConv traced by torch.compile (its taps as shifted products) against the eager conv1d, values and
gradients, and both against an fp64 loop over the taps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from condmem.ops.short_conv import ShortConv

CASES = [
    pytest.param("cpu", "eager", torch.float32, 1e-5, id="traced-fp32"),
    pytest.param("cpu", "eager", torch.bfloat16, 2e-2, id="traced-bf16"),
    pytest.param("cuda", "inductor", torch.bfloat16, 2e-2, id="inductor-cuda-bf16", marks=pytest.mark.gpu),
]


def _loop(module: ShortConv, u: torch.Tensor) -> torch.Tensor:
    """fp64: RMSNorm per branch, then y[t] = sum_k w[k] x[t - (K-1-k) d] (zeros before the start), SiLU."""
    x = u.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * module.norm_weight.double()
    batch, length, hc, dim = u.shape
    x = x.reshape(batch, length, hc * dim)
    w = module.weight.double()[:, 0]
    y = torch.zeros_like(x)
    span = module.kernel_size - 1
    for k in range(module.kernel_size):
        shift = (span - k) * module.dilation
        y[:, shift:] += x[:, : length - shift] * w[:, k]
    return F.silu(y).reshape(u.shape)


@pytest.mark.parametrize("device, backend, dtype, tol", CASES)
def test_traced_taps_equal_the_conv_and_the_loop(device, backend, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    module = ShortConv(48, 2, kernel_size=4, dilation=3).to(device)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
        module.norm_weight.copy_(1 + 0.1 * torch.randn(module.norm_weight.shape, generator=gen))
    u = torch.randn(3, 20, 2, 48, generator=gen).to(device, dtype)
    torch._dynamo.reset()
    traced = torch.compile(module.forward, backend=backend, fullgraph=True)
    outputs, grads = {}, {}
    for name, forward in (("eager", module.forward), ("traced", traced)):
        x = u.clone().requires_grad_()
        y = forward(x)
        y.float().square().sum().backward()
        outputs[name] = y.float()
        grads[name] = [x.grad.float(), module.weight.grad.float(), module.norm_weight.grad.float()]
        module.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    reference = _loop(module, u)
    scale = reference.abs().max().item()
    for name in ("eager", "traced"):
        assert (outputs[name].double() - reference).abs().max().item() <= tol * scale, name
    assert (outputs["traced"] - outputs["eager"]).abs().max().item() <= tol * scale
    for a, b in zip(grads["traced"], grads["eager"]):
        assert (a - b).abs().max().item() <= 4 * tol * a.abs().max().item()
