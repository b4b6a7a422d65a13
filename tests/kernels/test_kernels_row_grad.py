"""The sparse table lookup's backward (`condmem.ops.row_grad`): per distinct row, the sum of its
lookups' gradient rows in lookup order, as a coalesced sparse gradient.

Held to: the sequential torch reference (bit-equal, any device); on CUDA the coalesced
``F.embedding(..., sparse=True)`` gradient (bit-equal: torch coalesces with a stable sort and one
sequential fp32 sum per row there; its CPU coalesce adds in another order, so on CPU the
comparison is to fp32 rounding); an fp64 sum (rounding only). Skewed ids give runs far longer
than the kernel's unroll (a frequent n-gram), unique ids runs of one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import assert_bits_equal, kernel_devices, needs_kernels

from condmem.module import EngramTable
from condmem.ops.row_grad import row_sums, sorted_runs, table_lookup

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _ids(kind: str, shape, rows: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, rows, shape, generator=gen)
    if kind == "unique":
        return torch.randperm(rows, generator=gen)[: torch.Size(shape).numel()].reshape(shape)
    # skewed: a third of the lookups hit one row, the rest a few dozen (runs of 1 to hundreds)
    ids = torch.randint(0, 40, shape, generator=gen) ** 2 % rows
    ids[torch.rand(shape, generator=gen) < 0.33] = rows - 1
    return ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["uniform", "unique", "skewed"])
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 32), (torch.float32, 20), (torch.bfloat16, 64)])
def test_gradient_is_the_coalesced_sparse_gradient(device, kind, dtype, dim):
    gen = torch.Generator().manual_seed(3)
    rows = 1500
    ids = _ids(kind, (3, 64, 4), rows, gen).to(device)
    weight = torch.randn(rows, dim, generator=gen).to(device, dtype).requires_grad_()
    plain = weight.detach().clone().requires_grad_()
    out = table_lookup(weight, ids)
    assert torch.equal(out, F.embedding(ids, plain))
    g = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(g)
    F.embedding(ids, plain, sparse=True).backward(g)
    got, ref = weight.grad, plain.grad.coalesce()
    assert got.is_sparse and got.is_coalesced(), "the gradient must arrive coalesced (no sort after the backward)"
    assert torch.equal(got.indices(), ref.indices())
    order, _, ends = sorted_runs(ids)
    flat = g.reshape(-1, dim)
    assert_bits_equal("reference", row_sums(flat, order, ends, backend="torch"), got.values())
    if device == "cuda":
        assert_bits_equal("coalesced F.embedding", ref.values(), got.values())
    exact = torch.zeros(rows, dim, dtype=torch.float64, device=device).index_add_(0, ids.reshape(-1), flat.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.values().double(), exact[got.indices()[0]], rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_backward_accumulates(device):
    gen = torch.Generator().manual_seed(5)
    ids = _ids("skewed", (2, 40, 3), 300, gen).to(device)
    weight = torch.randn(300, 16, generator=gen).to(device).requires_grad_()
    g1, g2 = (torch.randn(2, 40, 3, 16, generator=gen).to(device) for _ in range(2))
    table_lookup(weight, ids).backward(g1)
    table_lookup(weight, ids.flip(0)).backward(g2)
    dense = torch.zeros(300, 16, dtype=torch.float64, device=device)
    dense.index_add_(0, ids.reshape(-1), g1.reshape(-1, 16).double())
    dense.index_add_(0, ids.flip(0).reshape(-1), g2.reshape(-1, 16).double())
    torch.testing.assert_close(weight.grad.coalesce().to_dense().double(), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_no_lookups_and_no_grad(device):
    weight = torch.randn(10, 8, device=device, requires_grad=True)
    table_lookup(weight, torch.zeros(0, 3, dtype=torch.long, device=device)).sum().backward()
    assert weight.grad.is_sparse and weight.grad._nnz() == 0
    with torch.no_grad():
        ids = torch.tensor([[1, 2]], device=device)
        assert torch.equal(table_lookup(weight, ids), weight[ids])


@pytest.mark.gpu
def test_the_sparse_table_takes_this_path_on_cuda_only_when_training():
    table = EngramTable(100, 8, sparse=True, device="cuda")
    ids = torch.tensor([[3, 3, 7]], device="cuda")
    table(ids).sum().backward()
    assert table.weight.grad.is_coalesced()
    with torch.no_grad():
        assert torch.equal(table(ids), table.weight[ids])


@pytest.mark.parametrize("device", DEVICES)
def test_runs_from_known_rows_equal_the_found_ones(device):
    ids = _ids("skewed", (4, 50, 3), 700, torch.Generator().manual_seed(9)).to(device)
    found = sorted_runs(ids)
    given = sorted_runs(ids, torch.unique(ids))
    for a, b in zip(found, given):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_retained_graph_backward_twice_and_no_second_order(device):
    weight = torch.randn(30, 4, device=device, requires_grad=True)
    ids = torch.tensor([[1, 5, 1, 29]], device=device, dtype=torch.int32)
    loss = (table_lookup(weight, ids) ** 2).sum()
    loss.backward(retain_graph=True)
    first = weight.grad.coalesce().to_dense().clone()
    loss.backward()
    torch.testing.assert_close(weight.grad.coalesce().to_dense(), 2 * first)
    out = table_lookup(weight, ids).sum()
    (g,) = torch.autograd.grad(out, weight, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.coalesce().values().sum(), weight)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_ids_and_a_pickled_table_still_get_a_coalesced_gradient(device):
    import io

    table = EngramTable(40, 8, sparse=True, device=device)
    ids = torch.tensor([[3, 3, 9]], device=device, dtype=torch.int32)
    table_lookup(table.weight, ids).sum().backward()
    assert table.weight.grad.is_coalesced()
    buf = io.BytesIO()
    torch.save(table, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    table_lookup(copy.weight, ids).sum().backward()
    assert copy.weight.grad.is_coalesced(), "a pickled table's parameter gets its hook again"
