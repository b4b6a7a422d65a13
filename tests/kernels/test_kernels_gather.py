"""Gather kernel against the torch reference, bit for bit: fp8 (+scales), packed 264 B-style rows, plain
tables; HBM and pinned / registered host tables; TP-shard row ranges; exponent 0 / 254 / 255 rows.

CPU runs the interpreter at small sizes; a GPU runs the same tests compiled, plus tables of the full
DeepSeek-V4.1-Flash geometry (row ids from the real layout, head_dim 256, 384M-row layer).
"""

from __future__ import annotations


import pytest
import torch

from condmem.ops.gather import GatherError, engram_gather, gather_reference
from condmem.tables.host_memory import host_register, host_unregister
from condmem.fp8 import FP8_DTYPE, pack_rows
from kernel_helpers import assert_bits_equal, kernel_devices, needs_kernels

pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore:overflow encountered")]
DEVICES = kernel_devices()


def _fp8_table(rows: int, head_dim: int, seed: int, device="cpu", edge_rows=True):
    """Random fp8 rows (every byte pattern, NaN included) with realistic scales, plus edge-exponent rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, head_dim), generator=gen, dtype=torch.int32).to(torch.uint8)
    e = torch.randint(100, 140, (rows, head_dim // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    if edge_rows and rows >= 6:
        e[0] = 0  # subnormal scale 2**-127
        e[1] = 254  # 2**127: large values overflow to inf
        e[2, 0] = 255  # NaN block
        e[3] = 1
        e[4] = 253
        q[5] = torch.arange(head_dim, dtype=torch.int32).to(torch.uint8)  # every byte in one row
        e[5] = 0
    return q.view(FP8_DTYPE).to(device), e.to(device)


def _ids(shape, rows, seed, device, lo=0, spill=5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo - spill, lo + rows + spill, shape, generator=gen)
    flat = ids.view(-1)
    if flat.numel() > 8:
        flat[:6] = torch.arange(6) + lo  # the edge rows, always read
        flat[6] = flat[7]  # a repeated id
    return ids.to(device)


FORMATS = ["fp8", "packed", "bf16", "fp32", "int32-words"]
CASES = [
    # (rows, head_dim, ids shape, row_range offset or None)
    (40, 64, (7, 5), None),
    (40, 96, (3, 4, 2), 1000),  # head_dim / 32 = 3 scale blocks (not a power of two)
    (1, 32, (1,), None),  # one row, one id
    (33, 64, (0, 24), None),  # empty batch
    (300, 256, (9, 24), 10**9),  # V4.1 head_dim; a shard far into the id space
]


def _tables(fmt, rows, head_dim, seed, device):
    q, e = _fp8_table(rows, head_dim, seed, device)
    if fmt == "fp8":
        return (q, e), {}
    if fmt == "packed":
        return (pack_rows(q, e),), {"head_dim": head_dim} if head_dim == 96 else {}
    w = torch.randn(rows, head_dim, generator=torch.Generator().manual_seed(seed)).to(device)
    if fmt == "bf16":
        return (w.to(torch.bfloat16),), {}
    if fmt == "fp32":
        return (w,), {}
    if fmt == "int64-words":  # plain 8-byte words of raw rows
        packed = pack_rows(q, e)
        return (packed.view(torch.int64) if packed.shape[1] % 8 == 0 else w.view(torch.int64),), {}
    return (pack_rows(q, e).view(torch.int32) if (head_dim + head_dim // 32) % 4 == 0 else w.view(torch.int32),), {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"R{c[0]}-D{c[1]}-ids{'x'.join(map(str, c[2]))}-{'shard' if c[3] else 'full'}"
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_equals_reference(fmt, case, device):
    rows, head_dim, shape, lo = case
    tables, kw = _tables(fmt, rows, head_dim, seed=rows + head_dim, device=device)
    row_range = None if lo is None else (lo, lo + rows)
    ids = _ids(shape, rows, seed=rows * 3, device=device, lo=lo or 0)
    ref = gather_reference(ids, *tables, row_range=row_range, **kw)
    got = engram_gather(ids, *tables, row_range=row_range, backend="triton", **kw)
    assert got.shape == (*shape, ref.shape[-1]) and got.device == ids.device
    assert_bits_equal(f"{fmt} gather", ref, got)
    if ids.numel():
        outside = ((ids < (lo or 0)) | (ids >= (lo or 0) + rows)).cpu()
        assert torch.all(got.cpu()[outside] == 0), "ids outside the table's range must give zero rows"


@pytest.mark.parametrize("device", DEVICES)
def test_exponent_edge_rows_bit_exact(device):
    """e = 0 rows keep their subnormals; e = 254 overflows to inf; e = 255 blocks are NaN."""
    q, e = _fp8_table(8, 64, seed=7, device=device)
    ids = torch.arange(6, device=device)
    got = engram_gather(ids, q, e, backend="triton").cpu()
    ref = gather_reference(ids, q, e).cpu()
    assert_bits_equal("edge rows", ref, got)
    assert (got[0] != 0).any() and got[0].float().nan_to_num(0.0).abs().max() < 2.0**-118  # subnormal bf16 kept
    assert got[1].isinf().any()
    assert got[2, :32].isnan().all()
    assert (got[5] != 0).sum() > 50  # bytes 0..63 times 2**-127: most survive as bf16 subnormals


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_out_and_persistent_loop(device):
    """Many more blocks than programs: every program loops; a given `out` is filled in place."""
    q, e = _fp8_table(64, 64, seed=3, device=device)
    ids = _ids((50, 3), 64, seed=5, device=device)
    out = torch.empty((50, 3, 64), dtype=torch.bfloat16, device=device)
    res = engram_gather(ids, q, e, out=out, backend="triton", block_rows=4, programs_per_sm=1)
    assert res is out
    assert_bits_equal("out=", gather_reference(ids, q, e), out)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_capped_grid_still_covers_every_row(device):
    """`max_programs=1`: one program loops over every block (a fetch beside other work)."""
    q, e = _fp8_table(64, 64, seed=4, device=device)
    ids = _ids((37, 3), 64, seed=6, device=device)
    out = torch.full((37, 3, 64), float("nan"), dtype=torch.bfloat16, device=device)  # poisoned
    engram_gather(ids, q, e, out=out, backend="triton", block_rows=4, max_programs=1)
    assert_bits_equal("max_programs=1", gather_reference(ids, q, e), out)
    with pytest.raises(GatherError, match="max_programs"):
        engram_gather(ids, q, e, backend="triton", max_programs=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["packed", "int32-words", "int64-words"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gather_scatters_to_out_index(fmt, backend, device):
    """`out_index`: row i lands in out[out_index[i]]; padding entries (index out of range, id -1)
    read and store nothing, and every other out row keeps its bytes."""
    tables, kw = _tables(fmt, 64, 64, seed=8, device=device)
    gen = torch.Generator().manual_seed(9)
    m, n = 90, 70
    dst = torch.randperm(m, generator=gen)[:n]
    dst[50:] = torch.tensor([m, m + 3, -1] * 7)[:20]  # padding: outside out
    ids = torch.randint(0, 64, (n,), generator=gen)
    ids[50:] = -1
    ids, dst = ids.to(device), dst.to(device)
    ref_rows = gather_reference(ids, *tables, **kw)
    out = torch.empty((m, ref_rows.shape[-1]), dtype=ref_rows.dtype, device=device)
    out.view(torch.uint8).fill_(0x7F)  # poisoned: NaN / a marker
    before = out.clone()
    res = engram_gather(ids, *tables, out=out, out_index=dst, backend=backend, block_rows=4, **kw)
    assert res is out
    real = (dst >= 0) & (dst < m)
    assert_bits_equal("scattered rows", ref_rows[real], out[dst[real]])
    untouched = torch.ones(m, dtype=torch.bool, device=device)
    untouched[dst[real]] = False
    assert torch.equal(out.view(torch.uint8)[untouched], before.view(torch.uint8)[untouched])
    with pytest.raises(GatherError, match="out_index must be"):
        engram_gather(ids, *tables, out=out, out_index=dst[:5], backend=backend, **kw)
    with pytest.raises(GatherError, match="out_index needs out"):
        engram_gather(ids, *tables, out_index=dst, backend=backend, **kw)


def test_gather_errors():
    q, e = _fp8_table(8, 64, seed=1)
    with pytest.raises(GatherError, match="scales"):
        engram_gather(torch.tensor([0]), q)
    with pytest.raises(GatherError, match="row_range"):
        engram_gather(torch.tensor([0]), q, e, row_range=(0, 3))
    with pytest.raises(GatherError, match="packed"):
        engram_gather(torch.tensor([0]), torch.zeros(4, 100, dtype=torch.uint8))
    with pytest.raises(GatherError, match="unsupported"):
        engram_gather(torch.tensor([0]), torch.zeros(4, 8, dtype=torch.bool))


def test_cpu_auto_backend_is_reference():
    q, e = _fp8_table(8, 64, seed=2)
    ids = torch.tensor([[0, 3], [7, 9]])
    assert_bits_equal("auto on cpu", gather_reference(ids, q, e), engram_gather(ids, q, e))


# ---------------------------------------------------------------------------- host tables (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["packed", "fp8", "bf16"])
def test_pinned_host_table_zero_copy(fmt):
    tables, kw = _tables(fmt, 5000, 256, seed=11, device="cpu")
    pinned = tuple(t.pin_memory() for t in tables)
    ids = _ids((333, 24), 5000, seed=12, device="cuda")
    ref = gather_reference(ids, *tables, **kw)
    got = engram_gather(ids, *pinned, **kw)  # auto: Triton reads host memory over UVA
    assert got.is_cuda
    assert_bits_equal(f"pinned {fmt}", ref, got)


@pytest.mark.gpu
def test_registered_host_region_and_pageable_refusal():
    q, e = _fp8_table(4096, 256, seed=13)
    packed = pack_rows(q, e)
    ids = _ids((100, 24), 4096, seed=14, device="cuda")
    with pytest.raises(GatherError, match="pageable"):
        engram_gather(ids, packed)
    host_register(packed)
    try:
        assert_bits_equal("registered", gather_reference(ids, packed), engram_gather(ids, packed))
    finally:
        host_unregister(packed)


# ---------------------------------------------------------------------------- full V4.1-Flash geometry (GPU)


@pytest.fixture(scope="module")
def v41_row_ids():
    from condmem import EngramConfig, EngramLayout, NgramHasher

    layout = EngramLayout(EngramConfig.deepseek_v41_flash())
    hasher = NgramHasher(layout)
    ids = torch.randint(0, 99_092, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    return layout, hasher(ids)  # [2, 2048, 2, 24]


def _random_packed_rows(n: int, device, chunk=1 << 24) -> torch.Tensor:
    """n x 264 B rows of random bytes with scale bytes in a realistic range (fast on the GPU)."""
    t = torch.empty((n, 264), dtype=torch.uint8, device=device)
    for s in range(0, n, chunk):
        block = t[s : s + chunk]
        block.random_(0, 256)
        block[:, 256:].random_(110, 140)
    return t


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_v41_full_layer_hbm_fp8_packed(v41_row_ids):
    """One whole V4.1 layer table in HBM (384,006,168 rows x 264 B = 101 GB)."""
    layout, rows = v41_row_ids
    n = layout.num_embeddings[0]
    free, _ = torch.cuda.mem_get_info()
    if free < n * 264 + (8 << 30):
        pytest.skip(f"needs {n * 264 / 1e9:.0f} GB of free GPU memory, {free / 1e9:.0f} GB free")
    table = _random_packed_rows(n, "cuda")
    try:
        ids = rows[:, :, 0]  # [2, 2048, 24]
        got = engram_gather(ids, table)
        ref = gather_reference(ids, table)
        assert_bits_equal("v41 packed HBM", ref, got)
        assert int(ids.max()) > n - 20_000_000  # ids reach the table's far end
    finally:
        del table
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_v41_column_shard_hbm_bf16_and_pinned_fp8(v41_row_ids):
    """TP-style shards of whole heads at V4.1 size: one column's ~16M rows, bf16 in HBM and packed fp8 pinned."""
    layout, rows = v41_row_ids
    layer = layout.layers[1]
    col = 9
    lo, hi = layer.offsets[col], layer.offsets[col] + layer.primes[col]
    ids = rows[:, :, 1]
    # bf16 shard in HBM (16M x 512 B = 8 GB)
    shard = torch.empty((hi - lo, 256), dtype=torch.bfloat16, device="cuda").normal_()
    got = engram_gather(ids, shard, row_range=(lo, hi))
    assert_bits_equal("v41 bf16 shard", gather_reference(ids, shard, row_range=(lo, hi)), got)
    assert (got[:, :, col] != 0).any() and torch.all(got[:, :, col + 1] == 0)
    del shard
    torch.cuda.empty_cache()
    # packed fp8 shard in pinned host memory (16M x 264 B = 4.2 GB)
    host = _random_packed_rows(hi - lo, "cuda").cpu().pin_memory()
    got = engram_gather(ids, host, row_range=(lo, hi))
    sel = ids[:, :, col : col + 1]
    assert_bits_equal("v41 pinned fp8 shard", gather_reference(sel, host, row_range=(lo, hi)), got[:, :, col : col + 1])
    assert torch.all(got[:, :, :col] == 0)
