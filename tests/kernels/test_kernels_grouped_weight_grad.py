"""The grouped weight gradient (`condmem.ops.grouped_weight_grad`): the kernel against the fp32 reference,
the reference against a float64 definition, the same bits on every run, and the op inside compiled graphs.

Groups of 0 rows, of fewer rows than a program's step, of many steps; widths that are not a
multiple of a tile; bf16 and fp32 outputs."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_bits_equal, compiled_graph_backends, kernel_devices, needs_kernels

from condmem.ops.grouped_weight_grad import grouped_weight_grad, grouped_weight_grad_reference

pytestmark = needs_kernels
DEVICES = kernel_devices()
CASES = [  # rows of each group, N, K
    ([8, 16, 0, 24, 72], 48, 40),
    ([0, 0, 8], 16, 16),
    ([200, 8, 0, 392], 136, 256),
]


def _case(sizes: list[int], n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    grad_out = torch.randn(rows, n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ends = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return grad_out, x, ends


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    scale = want.abs().max().clamp_min(1.0)
    err = (got.float().cpu() - want.float().cpu()).abs().max() / scale
    assert err <= rel, f"max error {err:.2e} of the largest entry, allowed {rel:.0e}"


@pytest.mark.parametrize("sizes, n, k", CASES)
def test_reference_is_the_definition(sizes, n, k):
    grad_out, x, ends = _case(sizes, n, k)
    got = grouped_weight_grad_reference(grad_out, x, ends)
    start = 0
    for g, size in enumerate(sizes):
        want = grad_out[start : start + size].double().T @ x[start : start + size].double()
        _close(got[g], want, 1e-6)
        start += size


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes, n, k", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(device, sizes, n, k, out_dtype):
    grad_out, x, ends = _case(sizes, n, k, seed=n)
    want = grouped_weight_grad_reference(grad_out, x, ends, out_dtype)
    got = grouped_weight_grad(grad_out.to(device), x.to(device), ends.to(device), out_dtype, backend="triton")
    assert got.dtype == out_dtype and got.shape == (len(sizes), n, k)
    # fp32 sums of the same exact products in another order; a bf16 output may round the other way
    _close(got, want, 1e-5 if out_dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_no_groups_give_an_empty_gradient(device):
    grad_out, x = torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(0, 8, dtype=torch.bfloat16)
    ends = torch.zeros(0, dtype=torch.int32)
    want = grouped_weight_grad_reference(grad_out, x, ends)
    got = grouped_weight_grad(grad_out.to(device), x.to(device), ends.to(device), torch.float32, backend="triton")
    assert want.shape == got.shape == (0, 16, 8) and got.dtype == torch.float32


def test_bad_input_is_refused_by_name():
    grad_out, x, ends = _case(*CASES[0])
    with pytest.raises(ValueError, match="same rows"):
        grouped_weight_grad(grad_out[:-1], x, ends, torch.float32)
    with pytest.raises(ValueError, match="ends must be 1-D"):
        grouped_weight_grad(grad_out, x, ends.float(), torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        grouped_weight_grad(grad_out, x.t().contiguous().t(), ends, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        grouped_weight_grad(grad_out, x, ends, torch.int32)


@pytest.mark.gpu
def test_study_size_is_the_same_bits_every_run():
    # the gpu preset's layer: ~66K rows over 62 groups, 512 x 512; each tile is one program's: no atomics
    sizes = [1056 + 8 * (g % 5) for g in range(62)]
    grad_out, x, ends = (t.cuda() for t in _case(sizes, 512, 512))
    first = grouped_weight_grad(grad_out, x, ends, torch.float32, backend="triton")
    _close(first, grouped_weight_grad_reference(grad_out, x, ends), 1e-5)
    for _ in range(3):
        assert_bits_equal(
            "weight gradient", first, grouped_weight_grad(grad_out, x, ends, torch.float32, backend="triton")
        )


@pytest.mark.parametrize("device, backend", compiled_graph_backends())
def test_kernel_inside_a_compiled_graph(device, backend):
    grad_out, x, ends = (t.to(device) for t in _case(*CASES[0]))
    torch._dynamo.reset()
    op = torch.compile(
        lambda a, b, e: grouped_weight_grad(a, b, e, torch.float32, backend="triton"), backend=backend, fullgraph=True
    )
    got = op(grad_out, x, ends)
    torch._dynamo.reset()
    _close(got, grouped_weight_grad_reference(grad_out.cpu(), x.cpu(), ends.cpu()), 1e-5)
