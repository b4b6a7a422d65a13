"""The gather's Triton kernel and launcher: row ids -> rows, dequantizing fp8 on the way.

The table may live in HBM, or in pinned / registered host memory read zero-copy over PCIe
(UVA): Triton's launcher asks the driver for the device address of every pointer argument
(``cuPointerGetAttribute(..., DEVICE_POINTER)``), which is defined for page-locked host
memory, so a pinned CPU tensor is passed as it is. Pageable memory is refused with a
message (`condmem.tables.host_memory.host_register` page-locks an existing tensor).

The kernel runs a persistent grid (a few programs per SM, each looping over blocks of
``BLOCK_R`` rows); `condmem.ops.gather.reference.gather_reference` is what it is held to,
bit for bit (NaN payloads aside). Imported only when the Triton backend runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from condmem.fp8 import FP8_DTYPE, SCALE_BLOCK
from condmem.ops.gather.reference import FP8, PLAIN, GatherError, TableFormat
from condmem.ops.launch import FastLaunch, HostPointer
from condmem.ops.triton_util import cdiv, interpreting, next_pow2, persistent_programs

_INTERPRET = interpreting()  # as triton decided when it was imported (read once: launches read it)

if triton is not None:

    @triton.jit
    def _bf16_rne(y):
        """float32 -> bf16, round to nearest even, by integer arithmetic (the interpreter's own cast truncates)."""
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)  # noqa: PLR0124 (NaN is the value unequal to itself)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    # Row counts change with every batch (unique ids, cache misses): specializing on them
    # (divisible by 16 or not) would compile new variants at random moments mid-run.
    @triton.jit(do_not_specialize=["n_rows", "lo", "n_local", "n_out"])
    def _gather_kernel(
        ids_ptr,
        tab_ptr,
        scale_ptr,
        out_ptr,
        dst_ptr,
        n_rows,
        lo,
        n_local,
        n_out,
        ROW_STRIDE: tl.constexpr,
        SCALE_STRIDE: tl.constexpr,
        SCALE_OFF: tl.constexpr,
        D: tl.constexpr,
        NB: tl.constexpr,
        BLOCK_NB: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        MODE: tl.constexpr,
        EXACT: tl.constexpr,
        SCATTER: tl.constexpr,
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
                e = tl.load(
                    scale_ptr + loc[:, None] * SCALE_STRIDE + SCALE_OFF + b[None, :],
                    mask=ok[:, None] & bm[None, :],
                    other=127,
                ).to(tl.int32)
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

    _GATHER = FastLaunch(_gather_kernel)


def _launch_table(t: torch.Tensor):
    """What a kernel launch receives for a table: a uint8 view of fp8 data; host tables wrapped."""
    t = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    if not t.is_cuda and not _INTERPRET:
        return HostPointer(t)
    return t


@functools.lru_cache(maxsize=64)
def _blocks(head_dim: int, fp8: bool) -> tuple[int, int, int]:
    """(scale blocks a row, their power-of-two tile, the row's power-of-two tile)."""
    nb = head_dim // SCALE_BLOCK if fp8 else 1
    return nb, next_pow2(nb), next_pow2(head_dim)


def gather_triton(
    ids: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: TableFormat,
    lo: int,
    out: torch.Tensor,
    out_index: torch.Tensor | None,
    block_rows: int | None,
    programs_per_sm: int,
    num_warps: int | None,
    max_programs: int | None,
) -> torch.Tensor:
    """Launch the kernel on checked arguments (`engram_gather` checks them): contiguous `ids` (read
    as flat, any shape), `out` shaped for them (or the scatter target with `out_index`)."""
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
        # 32 rows x 4 warps x 4 programs/SM: the best of the launch sweep (docs/kernels.md); 16 rows leave
        # bandwidth unused.
        block_rows = 8 if _INTERPRET else 32
    if num_warps is None:
        num_warps = 4
    nb, block_nb, block_d = _blocks(d, fmt.mode != PLAIN)
    n_blocks = cdiv(n_rows, block_rows)
    programs = persistent_programs(n_blocks, ids.device, per_sm=programs_per_sm)
    if max_programs is not None:
        if max_programs < 1:
            raise GatherError(f"max_programs must be >= 1, got {max_programs}")
        programs = min(programs, max_programs)
    try:
        _GATHER(
            (programs,),
            (ids, _launch_table(table), _launch_table(scale_t), out, out_index if out_index is not None else ids),
            (n_rows, lo, fmt.num_rows, out.shape[0] if out_index is not None else 0),
            (),
            num_warps,
            ROW_STRIDE=row_stride,
            SCALE_STRIDE=scale_stride,
            SCALE_OFF=scale_off,
            D=d,
            NB=nb,
            BLOCK_NB=block_nb,
            BLOCK_D=block_d,
            BLOCK_R=block_rows,
            MODE=fmt.mode,
            EXACT=_INTERPRET,
            SCATTER=out_index is not None,
        )
    except ValueError as exc:
        if "cannot be accessed" in str(exc):
            raise GatherError(
                "the table is in pageable host memory, which the GPU cannot read: use "
                "table.pin_memory(), or host_register(table) to page-lock it in place"
            ) from exc
        raise
    return out
