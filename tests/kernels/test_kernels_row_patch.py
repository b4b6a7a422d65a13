"""Rows with a patch (`condmem.ops.row_patch`) and Adam over rows side by side
(`condmem.ops.sparse_adam_triton.adam_rows_step`), the two kernels of the host tier's device Adam.

The patch is a copy: the kernel equals the torch reference bit for bit, for rows (2-D) and
step counts (1-D), with patch ids inside, around and beyond the rows' ids. The Adam step is
held ``torch.equal`` to ``adam_rows_delta`` on CUDA; on the CPU (interpreter) with the torch
path given an IEEE sqrt (as tests/train/test_sparse_adam_fused.py explains).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_helpers import assert_bits_equal, kernel_devices, needs_kernels

from condmem.ops.row_patch import patched_rows
from condmem.train.optim import adam_rows_delta, beta_powers

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _sorted_unique(n: int, high: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(high, generator=gen)[:n].sort().values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_patch", [1, 37, 300])
def test_patched_rows_equal_the_reference(device, n_patch):
    gen = torch.Generator().manual_seed(n_patch)
    ids = _sorted_unique(500, 2000, gen)
    # Half the patch from the rows' own ids, half elsewhere (below, between, above them).
    patch_ids = torch.cat([ids[torch.randperm(500, generator=gen)[: max(1, n_patch // 2)]], torch.tensor([2500, 2501])])
    patch_ids = torch.cat([patch_ids, torch.randint(0, 2600, (n_patch - n_patch // 2,), generator=gen)]).unique()
    pairs = []
    for shape, dtype in (((500, 20), torch.float32), ((500,), torch.float32), ((500, 32), torch.bfloat16)):
        values = torch.randn(shape, generator=gen).to(dtype)
        patch = torch.randn((patch_ids.numel(), *shape[1:]), generator=gen).to(dtype)
        pairs.append((patch.to(device), values.to(device)))
    ids, patch_ids = ids.to(device), patch_ids.to(device)
    got = patched_rows(ids, patch_ids, pairs, backend="triton")
    want = patched_rows(ids, patch_ids, pairs, backend="torch")
    hit = torch.isin(ids, patch_ids)
    assert 0 < int(hit.sum()) < ids.numel()
    for g, w, (patch, values) in zip(got, want, pairs):
        assert_bits_equal("patched rows", w, g)
        assert torch.equal(g[~hit], values[~hit])


@pytest.mark.parametrize("device", DEVICES)
def test_adam_rows_step_equals_adam_rows_delta(device, monkeypatch):
    from condmem.ops.sparse_adam_triton import adam_rows_step

    if device == "cpu":  # the interpreter's sqrt is IEEE; torch's CPU sqrt is not always
        torch_sqrt = torch.Tensor.sqrt
        monkeypatch.setattr(
            torch.Tensor,
            "sqrt",
            lambda t: torch.from_numpy(np.sqrt(t.numpy())) if t.device.type == "cpu" else torch_sqrt(t),
        )
    gen = torch.Generator().manual_seed(0)
    k, dim, lr, b1, b2, eps = 700, 20, 0.03, 0.9, 0.95, 1e-8
    rows = torch.randn(k, dim, generator=gen).to(device)
    m = (torch.randn(k, dim, generator=gen) * 1e-3).to(device)
    v = (torch.rand(k, dim, generator=gen) * 1e-5).to(device)
    st = torch.randint(0, 9, (k,), generator=gen).float().to(device)
    m[:50], v[:50], st[:50] = 0, 0, 0  # rows never updated before
    grad = (torch.randn(k, dim, generator=gen) * 10.0 ** torch.randint(-6, 2, (k, 1), generator=gen)).to(device)
    want_m, want_v, want_st = m.clone(), v.clone(), st + 1
    want = rows + adam_rows_delta(grad, want_m, want_v, want_st, lr, b1, b2, eps, 10)
    pow1, pow2 = beta_powers(b1, 10, device), beta_powers(b2, 10, device)
    adam_rows_step(grad, rows, m, v, st, pow1, pow2, lr, b1, b2, eps)
    for name, w, g in (("rows", want, rows), ("m", want_m, m), ("v", want_v, v), ("steps", want_st, st)):
        assert_bits_equal(name, w, g)


def test_adam_rows_step_refuses_other_shapes_or_dtypes():
    from condmem.ops.sparse_adam_triton import adam_rows_step

    t = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="row_step must be contiguous fp32"):
        adam_rows_step(t, t.clone(), t.clone(), t.clone(), torch.zeros(5), t, t, 0.1, 0.9, 0.9, 1e-8)
    with pytest.raises(ValueError, match="row_vectors must be contiguous fp32"):
        adam_rows_step(t, t.double(), t.clone(), t.clone(), torch.zeros(4), t, t, 0.1, 0.9, 0.9, 1e-8)


def test_patched_rows_check_their_inputs_on_every_backend():
    ids, patch_ids = torch.tensor([1, 4, 7]), torch.tensor([4, 9])
    values = torch.zeros(3, 2)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="does not match"):
            patched_rows(ids, patch_ids, [(torch.ones(2, 2, dtype=torch.float64), values)], backend=backend)
        with pytest.raises(ValueError, match="does not match"):
            patched_rows(ids, patch_ids, [(torch.ones(3, 2), values)], backend=backend)
    (out,) = patched_rows(ids, patch_ids[:0], [(torch.ones(0, 2), values)])
    assert torch.equal(out, values) and out.data_ptr() != values.data_ptr()
