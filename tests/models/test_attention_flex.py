"""Causal attention inside a compiled block (FlexAttention, CUDA) against SDPA outside one.

Held to: the eager forward and gradients within bf16 rounding of a 512-position softmax; a
second backward in deterministic mode equal bit for bit (the reason it replaces SDPA there)."""

from __future__ import annotations

import pytest
import torch

from condmem.models.attention import DenseAttention
from condmem.models.layers import Rotary
from condmem.train.determinism import deterministic_mode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n_kv", [4, 8])
def test_compiled_attention_matches_sdpa_and_repeats(n_kv):
    batch, length, heads, hd = 4, 512, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, length, h, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (heads, n_kv, n_kv))  # fmt: skip
    dy = torch.randn(batch, length, heads * hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    cos, sin = Rotary(hd, length, device="cuda")(0, length)
    attend = DenseAttention(cos, sin)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        y = fn(0, *leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(attend.__call__, fullgraph=True)
    with deterministic_mode(True):
        got, again = grads(compiled), grads(compiled)
    want = grads(lambda i, *t: attend(i, *[x.float() for x in t]))
    torch._dynamo.reset()
    for name, a, b, w in zip(("y", "dq", "dk", "dv"), got, again, want):
        assert torch.equal(a, b), f"{name}: two deterministic backwards differ"
        scale = float(w.abs().max())
        err = float((a.float() - w.float()).abs().max())
        assert err <= 2e-2 * scale, f"{name}: {err:.3g} off the fp32 SDPA (max |ref| {scale:.3g})"
