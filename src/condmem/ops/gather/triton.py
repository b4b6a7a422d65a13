"""Row gather from an Engram table, dequantizing fp8 + e8m0 rows to bf16 on the way.

``engram_gather(row_ids, table, scales)`` turns row ids [...] into rows [..., head_dim]:

* **fp8** tables: ``table`` float8_e4m3fn [R, D] and ``scales`` uint8 [R, D/32];
* **packed** fp8 tables: ``table`` uint8 [R, D + D/32], each row's scale bytes right
  after its fp8 bytes (`condmem.fp8.pack_rows`; 264 B at D = 256), so a row
  costs one random access;
* **plain** tables (bf16, fp16, fp32, or int16/int32/int64 words of raw rows): rows
  copied bit for bit.

fp8 rows come out as bf16: ``fp8 * 2**(e-127)`` in float32, rounded to nearest even
(e = 0 gives subnormal results, e = 255 NaN; see `condmem.fp8`).

The table may live in HBM, or in pinned / registered host memory read zero-copy
over PCIe (UVA): Triton's launcher asks the driver for the device address of every
pointer argument (``cuPointerGetAttribute(..., DEVICE_POINTER)``), which is defined
for page-locked host memory, so a pinned CPU tensor is passed as it is. Pageable
memory is refused with a message (`host_register` page-locks an existing tensor).

``row_range=(lo, hi)`` makes the table a shard holding rows lo..hi-1 (a tensor-parallel
rank's heads): ids outside it, and negative ids, give zero rows.

The kernel runs a persistent grid (a few programs per SM, each looping over blocks
of ``BLOCK_R`` rows). `gather_reference` is the torch version it is held to, bit for
bit (NaN payloads aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from condmem.ops.triton_util import interpreting, next_pow2, persistent_programs, resolve_backend
from condmem.fp8 import (
    FP8_DTYPE,
    SCALE_BLOCK,
    check_fp8_pair,
    dequantize_fp8_e8m0,
    head_dim_of_packed,
)

PLAIN, FP8, PACKED = 0, 1, 2
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int16, torch.int32, torch.int64)
_FORMAT_NAMES = {PLAIN: "plain", FP8: "fp8", PACKED: "packed"}


class GatherError(ValueError):
    """The table, scales or ids cannot be gathered as given."""


@dataclass(frozen=True)
class TableFormat:
    """What a table tensor holds: format code, head_dim, rows, output dtype."""

    mode: int
    head_dim: int
    rows: int
    out_dtype: torch.dtype

    @property
    def name(self) -> str:
        return _FORMAT_NAMES[self.mode]


def table_format(table: torch.Tensor, scales: torch.Tensor | None = None, head_dim: int | None = None) -> TableFormat:
    """Classify a table (and its scales) or raise `GatherError` saying what is wrong."""
    if table.dim() != 2:
        raise GatherError(f"a table must be [rows, width], got shape {tuple(table.shape)}")
    if table.stride(1) != 1:
        raise GatherError("table rows must be contiguous (stride 1 along the row)")
    rows, width = table.shape
    scales = _scale_bytes(scales)
    if table.dtype == FP8_DTYPE:
        if scales is None:
            raise GatherError("an fp8 table needs its uint8 e8m0 scales [rows, head_dim/32]")
        try:
            check_fp8_pair(table, scales)
        except ValueError as exc:
            raise GatherError(str(exc)) from None
        if scales.stride(1) != 1 or scales.device != table.device:
            raise GatherError("scales must be row-contiguous and on the table's device")
        return TableFormat(FP8, width, rows, torch.bfloat16)
    if table.dtype == torch.uint8:
        if scales is not None:
            raise GatherError("a packed (uint8) table carries its scales in each row; pass scales=None")
        try:
            d = head_dim_of_packed(width) if head_dim is None else head_dim
        except ValueError as exc:
            raise GatherError(f"packed fp8 table: {exc}") from None
        if d % SCALE_BLOCK or width != d + d // SCALE_BLOCK:
            raise GatherError(f"packed rows of {width} bytes do not hold head_dim {d} plus {d // SCALE_BLOCK} scale bytes")
        return TableFormat(PACKED, d, rows, torch.bfloat16)
    if table.dtype in _PLAIN_DTYPES:
        if scales is not None:
            raise GatherError(f"a {table.dtype} table takes no scales")
        return TableFormat(PLAIN, width, rows, table.dtype)
    raise GatherError(f"unsupported table dtype {table.dtype}: use float8_e4m3fn (+scales), packed uint8, "
                      "bf16/fp16/fp32, or int16/int32/int64 words of raw rows")


def _scale_bytes(scales: torch.Tensor | None) -> torch.Tensor | None:
    """float8_e8m0fnu scales (how checkpoints may store them) as their uint8 exponent bytes."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if scales is not None and e8m0 is not None and scales.dtype == e8m0:
        return scales.view(torch.uint8)
    return scales


def _check_out_index(out_index: torch.Tensor, row_ids: torch.Tensor, out: torch.Tensor | None,
                     fmt: TableFormat) -> None:
    if out is None:
        raise GatherError("out_index needs out: the [M, D] rows it scatters into")
    if out.dim() != 2 or out.shape[1] != fmt.head_dim or out.dtype != fmt.out_dtype or not out.is_contiguous():
        raise GatherError(f"with out_index, out must be a contiguous {fmt.out_dtype} [M, {fmt.head_dim}] tensor, "
                          f"got {out.dtype} {tuple(out.shape)}")
    if out_index.dtype != torch.int64 or out_index.numel() != row_ids.numel() or not out_index.is_contiguous():
        raise GatherError(f"out_index must be contiguous int64 with one entry per row id ({row_ids.numel()}), got "
                          f"{out_index.dtype} {tuple(out_index.shape)}")
    if out_index.device != row_ids.device or out.device != row_ids.device:
        raise GatherError("out_index and out must be on the row ids' device")


def _local_ids(row_ids: torch.Tensor, row_range: tuple[int, int] | None, rows: int) -> tuple[int, int]:
    lo, hi = (0, rows) if row_range is None else (int(row_range[0]), int(row_range[1]))
    if hi - lo != rows:
        raise GatherError(f"row_range {lo}..{hi} spans {hi - lo} rows but the table has {rows}")
    return lo, hi


def gather_reference(
    row_ids: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    head_dim: int | None = None,
    row_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The plain-torch gather every kernel is compared with: [...] ids -> [..., head_dim] rows.

    Indexing runs on the table's device; the result lands on the ids' device.
    """
    fmt = table_format(table, scales, head_dim)
    scales = _scale_bytes(scales)
    lo, hi = _local_ids(row_ids, row_range, fmt.rows)
    ids = row_ids.to(table.device).long()
    inside = (ids >= lo) & (ids < hi)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids)).reshape(-1)
    if fmt.rows == 0:
        rows = torch.zeros((local.numel(), fmt.head_dim), dtype=fmt.out_dtype, device=table.device)
    elif fmt.mode == PLAIN:
        rows = table[local]
    elif fmt.mode == FP8:
        rows = dequantize_fp8_e8m0(table[local], scales[local])
    else:
        packed = table[local]
        d = fmt.head_dim
        rows = dequantize_fp8_e8m0(packed[:, :d].contiguous().view(FP8_DTYPE), packed[:, d:].contiguous())
    rows = torch.where(inside.reshape(-1, 1), rows, torch.zeros_like(rows))
    return rows.reshape(*row_ids.shape, fmt.head_dim).to(row_ids.device)


# ---------------------------------------------------------------------------- Triton kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None

if triton is not None:

    @triton.jit
    def _bf16_rne(y):
        """float32 -> bf16, round to nearest even, by integer arithmetic (the interpreter's own cast truncates)."""
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    # Row counts change with every batch (unique ids, cache misses): specializing on them
    # (divisible by 16 or not) would compile new variants at random moments mid-run.
    @triton.jit(do_not_specialize=["n_rows", "lo", "n_local", "n_out"])
    def _gather_kernel(
        ids_ptr, tab_ptr, scale_ptr, out_ptr, dst_ptr,
        n_rows, lo, n_local, n_out,
        ROW_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr, SCALE_OFF: tl.constexpr,
        D: tl.constexpr, NB: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr, MODE: tl.constexpr, EXACT: tl.constexpr, SCATTER: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_blocks = tl.cdiv(n_rows, BLOCK_R)
        rr = tl.arange(0, BLOCK_R)
        for blk in tl.range(pid, n_blocks, tl.num_programs(0)):
            r = rr.to(tl.int64) + blk * BLOCK_R  # (blk is a plain int in the interpreter)
            rmask = r < n_rows
            gid = tl.load(ids_ptr + r, mask=rmask, other=-1).to(tl.int64)
            loc = gid - lo
            ok = rmask & (loc >= 0) & (loc < n_local)
            loc = tl.where(ok, loc, 0)
            if MODE == 0:
                c = tl.arange(0, BLOCK_D)
                cm = c < D
                x = tl.load(tab_ptr + loc[:, None] * ROW_STRIDE + c[None, :], mask=ok[:, None] & cm[None, :], other=0)
                om = rmask[:, None] & cm[None, :]
                if SCATTER:
                    # Row r goes to out row dst[r]; a destination outside out (padding) stores
                    # nothing. (Loaded at the store's own rank: Triton 3.6's layout pass fails
                    # when one 1-D mask feeds both the row reads and a scattered store.)
                    dst = tl.load(dst_ptr + r[:, None], mask=rmask[:, None], other=-1)
                    om = om & (dst >= 0) & (dst < n_out)
                    tl.store(out_ptr + dst * D + c[None, :], x, mask=om)
                else:
                    tl.store(out_ptr + r[:, None] * D + c[None, :], x, mask=om)
            else:
                b = tl.arange(0, BLOCK_NB)
                j = tl.arange(0, 32)
                bm = b < NB
                col = b[None, :, None] * 32 + j[None, None, :]  # [1, NB, 32]
                m3 = ok[:, None, None] & bm[None, :, None]
                xb = tl.load(tab_ptr + loc[:, None, None] * ROW_STRIDE + col, mask=m3, other=0)
                xf = xb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if EXACT:
                    xf = tl.where((xb & 0x7F) == 0x7F, float("nan"), xf)  # e4m3fn NaN (the interpreter decodes 480)
                e = tl.load(scale_ptr + loc[:, None] * SCALE_STRIDE + SCALE_OFF + b[None, :],
                            mask=ok[:, None] & bm[None, :], other=127).to(tl.int32)
                bits = tl.where(e == 0, 0x00400000, e << 23)  # 2**(e-127); e = 0 is the subnormal 2**-127
                bits = tl.where(e == 255, 0x7FC00000, bits)  # OCP MX: 0xFF is NaN
                y = xf * bits.to(tl.float32, bitcast=True)[:, :, None]
                if EXACT:
                    yb = _bf16_rne(y)
                else:
                    yb = y.to(tl.bfloat16)
                om = rmask[:, None, None] & bm[None, :, None]
                if SCATTER:
                    dst = tl.load(dst_ptr + r[:, None, None], mask=rmask[:, None, None], other=-1)
                    om = om & (dst >= 0) & (dst < n_out)
                    tl.store(out_ptr + dst * D + col, yb, mask=om)
                else:
                    tl.store(out_ptr + r[:, None, None] * D + col, yb, mask=om)


class _HostPointer:
    """A host table at a kernel launch: Triton reads ``data_ptr()`` and ``dtype`` only, and its
    launcher turns the address into the device address of the page-locked memory."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def _launch_table(t: torch.Tensor):
    """What a kernel launch receives for a table: a uint8 view of fp8 data; host tables wrapped."""
    t = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    if t.device.type == "cpu" and not interpreting():
        return _HostPointer(t)
    return t


def engram_gather(
    row_ids: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    head_dim: int | None = None,
    row_range: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    backend: str | None = None,
    block_rows: int | None = None,
    programs_per_sm: int = 4,
    num_warps: int | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Gather (and dequantize) table rows.

    Args:
        row_ids: integer ids [...] (int64 or int32), on the device that receives the rows.
        table: fp8 [R, D] (+ `scales`), packed uint8 [R, D + D/32], or bf16/fp16/fp32 [R, D];
            on the GPU, or in pinned/registered host memory (read zero-copy).
        scales: uint8 [R, D/32] e8m0 exponents of an fp8 table.
        head_dim: D of a packed table (inferred from its width by default).
        row_range: (lo, hi): the table holds global rows lo..hi-1; other ids give zero rows.
        out: optional output [..., D] (bf16 for fp8 tables, the table's dtype otherwise).
        out_index: optional int64 [n] (n = row_ids.numel()): row i goes to ``out[out_index[i]]``
            (out then any [M, D]); entries outside 0..M-1 (padding) store nothing (with id -1
            they read nothing either), and out's other rows are left as they are. Scattering
            in the gather saves a separate scatter and its temporary.
        backend: "auto" (Triton when `row_ids` are on CUDA), "triton" or "torch".
        block_rows, programs_per_sm, num_warps: kernel tuning (defaults suit an H200).
        max_programs: cap on the persistent grid, for a gather that runs beside other work
            (a zero-copy gather's programs wait on PCIe while holding SMs).

    Returns:
        [..., D] rows; zero rows for ids outside the table's range.

    Example:
        >>> packed = pack_rows(*quantize_fp8_e8m0(weights)).pin_memory()   # host table
        >>> rows = engram_gather(row_ids.cuda(), packed)                     # [T, n_cols, D] bf16
    """
    fmt = table_format(table, scales, head_dim)
    scales = _scale_bytes(scales)
    lo, hi = _local_ids(row_ids, row_range, fmt.rows)
    if row_ids.is_floating_point() or row_ids.dtype == torch.bool:
        raise GatherError(f"row_ids must be integers, got {row_ids.dtype}")
    if resolve_backend(backend, row_ids.device, "engram_gather") == "torch":
        rows = gather_reference(row_ids, table, scales, head_dim=head_dim, row_range=row_range)
        if out_index is not None:
            _check_out_index(out_index, row_ids, out, fmt)
            dst = out_index.reshape(-1)
            inside = (dst >= 0) & (dst < out.shape[0])
            out[dst[inside]] = rows.reshape(-1, fmt.head_dim)[inside]
            return out
        if out is not None:
            out.copy_(rows)
            return out
        return rows
    if row_ids.device.type == "cuda" and table.device.type == "cuda" and table.device != row_ids.device:
        raise GatherError(f"table on {table.device} but row ids on {row_ids.device}")
    shape = (*row_ids.shape, fmt.head_dim)
    if out_index is not None:
        _check_out_index(out_index, row_ids, out, fmt)
    elif out is None:
        out = torch.empty(shape, dtype=fmt.out_dtype, device=row_ids.device)
    elif out.shape != shape or out.dtype != fmt.out_dtype or not out.is_contiguous():
        raise GatherError(f"out must be a contiguous {fmt.out_dtype} tensor of shape {shape}")
    ids = row_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n_rows = ids.numel()
    if n_rows == 0:
        return out
    d = fmt.head_dim
    if fmt.mode == PLAIN:
        row_stride, scale_t, scale_stride, scale_off = table.stride(0), table, 0, 0
    elif fmt.mode == FP8:
        row_stride, scale_t, scale_stride, scale_off = table.stride(0), scales, scales.stride(0), 0
    else:
        row_stride, scale_t, scale_stride, scale_off = table.stride(0), table, table.stride(0), d
    if block_rows is None:
        # 32 rows x 4 warps x 4 programs/SM: 0.79 of the D2D copy at 1M fp8 rows on the H200 (16 rows: 0.65).
        block_rows = 8 if interpreting() else 32
    if num_warps is None:
        num_warps = 4
    nb = d // SCALE_BLOCK if fmt.mode != PLAIN else 1
    n_blocks = triton.cdiv(n_rows, block_rows)
    programs = persistent_programs(n_blocks, row_ids.device, per_sm=programs_per_sm)
    if max_programs is not None:
        if max_programs < 1:
            raise GatherError(f"max_programs must be >= 1, got {max_programs}")
        programs = min(programs, max_programs)
    grid = (programs,)
    tab = _launch_table(table)
    try:
        _gather_kernel[grid](
            ids, tab, _launch_table(scale_t), out, out_index if out_index is not None else ids,
            n_rows, lo, fmt.rows, out.shape[0] if out_index is not None else 0,
            ROW_STRIDE=row_stride, SCALE_STRIDE=scale_stride, SCALE_OFF=scale_off,
            D=d, NB=nb, BLOCK_NB=next_pow2(nb), BLOCK_D=next_pow2(d),
            BLOCK_R=block_rows, MODE=fmt.mode, EXACT=interpreting(), SCATTER=out_index is not None,
            num_warps=num_warps,
        )
    except ValueError as exc:
        if "cannot be accessed" in str(exc):
            raise GatherError(
                "the table is in pageable host memory, which the GPU cannot read: use "
                "table.pin_memory(), or host_register(table) to page-lock it in place"
            ) from exc
        raise
    return out


# ---------------------------------------------------------------------------- host memory

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


def host_register(t: torch.Tensor) -> torch.Tensor:
    """Page-lock an existing CPU tensor in place (cudaHostRegister), so kernels read it zero-copy.

    Returns the same tensor. Pair with `host_unregister` before the memory is freed.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise GatherError("host_register needs a contiguous CPU tensor")
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                               _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise GatherError(f"cudaHostRegister failed with error {int(err)}")
    return t


def host_unregister(t: torch.Tensor) -> None:
    """Undo `host_register`."""
    err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    if int(err) != 0:
        raise GatherError(f"cudaHostUnregister failed with error {int(err)}")
