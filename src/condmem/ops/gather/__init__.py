"""Row gather from an Engram table: row ids [...] -> rows [..., head_dim], fp8 dequantized to bf16.

`engram_gather` runs the Triton kernel (`triton.py`) on CUDA, or under the interpreter,
and the plain-torch `gather_reference` (`reference.py`, the formats it reads) elsewhere;
both give the same rows bit for bit. Tables may sit in HBM or in page-locked host memory,
read zero-copy.
"""

from __future__ import annotations

import torch

from condmem.ops.gather.reference import (
    GatherError,
    TableFormat,
    _check_out_index,
    _local_ids,
    _scale_bytes,
    gather_reference,
    table_format,
)
from condmem.ops.triton_util import resolve_backend, triton_available

__all__ = ["GatherError", "TableFormat", "engram_gather", "gather_reference", "table_format"]


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
        block_rows, programs_per_sm, num_warps: kernel tuning (defaults: the best of the launch sweep on a
            Hopper GPU, docs/kernels.md).
        max_programs: cap on the persistent grid, for a gather that runs beside other work
            (a zero-copy gather's programs wait on PCIe while holding SMs).

    Returns:
        [..., D] row vectors; zero rows for ids outside the table's range.

    Example:
        >>> packed = pack_rows(*quantize_fp8_e8m0(weights)).pin_memory()   # host table
        >>> row_vectors = engram_gather(row_ids.cuda(), packed)              # [T, n_cols, D] bf16
    """
    fmt = _format(table, scales, head_dim)
    scales = _scale_bytes(scales)
    lo, _ = _local_ids(row_ids, row_range, fmt.num_rows)
    if row_ids.is_floating_point() or row_ids.dtype == torch.bool:
        raise GatherError(f"row_ids must be integers, got {row_ids.dtype}")
    if not (
        (backend is None and row_ids.is_cuda and triton_available())
        or resolve_backend(backend, row_ids.device, "engram_gather") == "triton"
    ):
        return _gather_torch(row_ids, table, scales, fmt, head_dim, row_range, out, out_index)
    device = row_ids.device
    if table.is_cuda and row_ids.is_cuda and table.get_device() != row_ids.get_device():
        raise GatherError(f"table on {table.device} but row ids on {device}")
    if out_index is not None:
        _check_out_index(out_index, row_ids, out, fmt)
    elif out is None:
        out = torch.empty((*row_ids.shape, fmt.head_dim), dtype=fmt.out_dtype, device=device)
    elif (
        out.shape[:-1] != row_ids.shape
        or out.shape[-1] != fmt.head_dim
        or out.dtype != fmt.out_dtype
        or not out.is_contiguous()
    ):
        raise GatherError(f"out must be a contiguous {fmt.out_dtype} tensor of shape {(*row_ids.shape, fmt.head_dim)}")
    # The kernel reads the ids as flat: contiguous ones are passed as they are (no view to make).
    ids = row_ids if row_ids.is_contiguous() else row_ids.reshape(-1).contiguous()
    return _triton().gather_triton(
        ids, table, scales, fmt, lo, out, out_index, block_rows, programs_per_sm, num_warps, max_programs
    )


def _gather_torch(row_ids, table, scales, fmt: TableFormat, head_dim, row_range, out, out_index) -> torch.Tensor:
    """`engram_gather` by `gather_reference`, the rows then put into `out` (at `out_index`) when given."""
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


_TRITON = None
_FORMATS: dict[tuple, TableFormat] = {}


def _triton():
    """`condmem.ops.gather.triton`, imported at the first Triton call (importing it imports triton)."""
    global _TRITON
    if _TRITON is None:
        from condmem.ops.gather import triton as kernels

        _TRITON = kernels
    return _TRITON


def _format(table: torch.Tensor, scales: torch.Tensor | None, head_dim: int | None) -> TableFormat:
    """`table_format`, remembered per (shapes, strides, dtypes, devices): a format depends on
    nothing else, and the same tables are read on every call."""
    key = (
        table.shape,
        table.stride(),
        table.dtype,
        table.device,
        head_dim,
        None if scales is None else (scales.shape, scales.stride(), scales.dtype, scales.device),
    )
    fmt = _FORMATS.get(key)
    if fmt is None:
        fmt = table_format(table, scales, head_dim)  # raises for a bad table: never remembered
        if len(_FORMATS) >= 1024:
            _FORMATS.clear()
        _FORMATS[key] = fmt
    return fmt
