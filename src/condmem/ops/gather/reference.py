"""The plain-torch row gather every gather kernel is held to, and the table formats it reads.

* **fp8** tables: ``table`` float8_e4m3fn [R, D] and ``scales`` uint8 [R, D/32];
* **packed** fp8 tables: ``table`` uint8 [R, D + D/32], each row's scale bytes right
  after its fp8 bytes (`condmem.fp8.pack_rows`; 264 B at D = 256), so a row
  costs one random access;
* **plain** tables (bf16, fp16, fp32, or int16/int32/int64 words of raw rows): rows
  copied bit for bit.

fp8 rows come out as bf16: ``fp8 * 2**(e-127)`` in float32, rounded to nearest even
(e = 0 gives subnormal results, e = 255 NaN; see `condmem.fp8`). ``row_range=(lo, hi)``
makes the table a shard holding rows lo..hi-1: ids outside it, and negative ids, give
zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from condmem.fp8 import (
    FP8_DTYPE,
    SCALE_BLOCK,
    check_fp8_pair,
    dequantize_fp8_e8m0,
    head_dim_of_packed,
)
from condmem.utils.renamed import renamed_attribute

PLAIN, FP8, PACKED = 0, 1, 2
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int16, torch.int32, torch.int64)
_FORMAT_NAMES = {PLAIN: "plain", FP8: "fp8", PACKED: "packed"}


class GatherError(ValueError):
    """The table, scales or ids cannot be gathered as given."""


@dataclass(frozen=True)
class TableFormat:
    """What a table tensor holds: format code, head_dim, its number of rows, output dtype."""

    mode: int
    head_dim: int
    num_rows: int
    out_dtype: torch.dtype

    rows = renamed_attribute("TableFormat", "rows", "num_rows")

    @property
    def name(self) -> str:
        return _FORMAT_NAMES[self.mode]


def table_format(table: torch.Tensor, scales: torch.Tensor | None = None, head_dim: int | None = None) -> TableFormat:
    """Classify a table (and its scales) or raise `GatherError` saying what is wrong."""
    if table.dim() != 2:
        raise GatherError(f"a table must be [rows, width], got shape {tuple(table.shape)}")
    if table.stride(1) != 1:
        raise GatherError("table rows must be contiguous (stride 1 along the row)")
    num_rows, width = table.shape
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
        return TableFormat(FP8, width, num_rows, torch.bfloat16)
    if table.dtype == torch.uint8:
        if scales is not None:
            raise GatherError("a packed (uint8) table carries its scales in each row; pass scales=None")
        try:
            d = head_dim_of_packed(width) if head_dim is None else head_dim
        except ValueError as exc:
            raise GatherError(f"packed fp8 table: {exc}") from None
        if d % SCALE_BLOCK or width != d + d // SCALE_BLOCK:
            raise GatherError(
                f"packed rows of {width} bytes do not hold head_dim {d} plus {d // SCALE_BLOCK} scale bytes"
            )
        return TableFormat(PACKED, d, num_rows, torch.bfloat16)
    if table.dtype in _PLAIN_DTYPES:
        if scales is not None:
            raise GatherError(f"a {table.dtype} table takes no scales")
        return TableFormat(PLAIN, width, num_rows, table.dtype)
    raise GatherError(
        f"unsupported table dtype {table.dtype}: use float8_e4m3fn (+scales), packed uint8, "
        "bf16/fp16/fp32, or int16/int32/int64 words of raw rows"
    )


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _scale_bytes(scales: torch.Tensor | None) -> torch.Tensor | None:
    """float8_e8m0fnu scales (how checkpoints may store them) as their uint8 exponent bytes."""
    if scales is not None and _E8M0 is not None and scales.dtype == _E8M0:
        return scales.view(torch.uint8)
    return scales


def _check_out_index(
    out_index: torch.Tensor, row_ids: torch.Tensor, out: torch.Tensor | None, fmt: TableFormat
) -> None:
    if out is None:
        raise GatherError("out_index needs out: the [M, D] rows it scatters into")
    if out.dim() != 2 or out.shape[1] != fmt.head_dim or out.dtype != fmt.out_dtype or not out.is_contiguous():
        raise GatherError(
            f"with out_index, out must be a contiguous {fmt.out_dtype} [M, {fmt.head_dim}] tensor, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out_index.dtype != torch.int64 or out_index.numel() != row_ids.numel() or not out_index.is_contiguous():
        raise GatherError(
            f"out_index must be contiguous int64 with one entry per row id ({row_ids.numel()}), got "
            f"{out_index.dtype} {tuple(out_index.shape)}"
        )
    if out_index.device != row_ids.device or out.device != row_ids.device:
        raise GatherError("out_index and out must be on the row ids' device")


def _local_ids(row_ids: torch.Tensor, row_range: tuple[int, int] | None, num_rows: int) -> tuple[int, int]:
    lo, hi = (0, num_rows) if row_range is None else (int(row_range[0]), int(row_range[1]))
    if hi - lo != num_rows:
        raise GatherError(f"row_range {lo}..{hi} spans {hi - lo} rows but the table has {num_rows}")
    return lo, hi


def gather_reference(
    row_ids: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    head_dim: int | None = None,
    row_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The plain-torch gather every kernel is compared with: [...] ids -> [..., head_dim] row vectors.

    Indexing runs on the table's device; the result lands on the ids' device.
    """
    fmt = table_format(table, scales, head_dim)
    scales = _scale_bytes(scales)
    lo, hi = _local_ids(row_ids, row_range, fmt.num_rows)
    ids = row_ids.to(table.device).long()
    inside = (ids >= lo) & (ids < hi)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids)).reshape(-1)
    if fmt.num_rows == 0:
        row_vectors = torch.zeros((local.numel(), fmt.head_dim), dtype=fmt.out_dtype, device=table.device)
    elif fmt.mode == PLAIN:
        row_vectors = table[local]
    elif fmt.mode == FP8:
        row_vectors = dequantize_fp8_e8m0(table[local], scales[local])
    else:
        packed = table[local]
        d = fmt.head_dim
        row_vectors = dequantize_fp8_e8m0(packed[:, :d].contiguous().view(FP8_DTYPE), packed[:, d:].contiguous())
    row_vectors = torch.where(inside.reshape(-1, 1), row_vectors, torch.zeros_like(row_vectors))
    return row_vectors.reshape(*row_ids.shape, fmt.head_dim).to(row_ids.device)
