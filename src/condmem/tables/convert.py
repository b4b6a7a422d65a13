"""Convert Engram tables between row formats, streaming, with bounded memory.

Any of bf16 / fp8 (+ separate scales) / fp8_interleaved to any other, from a condmem
table file, a released checkpoint or tensors, `chunk_rows` rows at a time (memory: a few
chunks, whatever the table size). bf16 -> fp8 quantizes
(`quantize_fp8_e8m0`); fp8 -> bf16 dequantizes; fp8 <-> interleaved only moves bytes,
so it is exact. A trained model's float tables (float32, bf16, fp16 tensors) are written the
same way: bf16 rows are exactly ``weight.to(torch.bfloat16)`` (a bf16 table copied, a float32
one rounded to nearest even), fp8 rows exactly `quantize_fp8_e8m0` of the float32 values. fp8
rows need head_dim to be a multiple of 32 (one e8m0 scale per 32 values): refused otherwise.

The output is written atomically: an interrupted conversion leaves no
partial file. Memory-mapped source pages are unmapped after each chunk (`release_pages`),
so the resident set stays a few chunks even though the source is read through a mapping.
Rows with a `LayerRows.source` are read with ``pread`` and checked as they stream past: a
condmem table file's blocks against their recorded checksums, a released checkpoint's scales
(a NaN or inf one, e8m0 byte 0xFF, is refused naming the tensor and row) and its shards'
stamps; a failed check stops the conversion, and nothing is written. The output records a
CRC32C per block.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping

import torch

from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.fp8 import dequantize_fp8_e8m0, pack_rows, quantize_fp8_e8m0, unpack_rows
from condmem.tables.integrity import IntegrityMismatch
from condmem.tables.safetensors_io import release_pages
from condmem.tables.table_file import FORMATS, LayerRows, TableFileError, write_table_file


def convert_rows(chunk: LayerRows, to_format: str) -> LayerRows:
    """One chunk of rows in another format (materialized in memory)."""
    if to_format not in FORMATS:
        raise TableFileError(f"unknown table format {to_format!r}; choose one of {FORMATS}")
    src = chunk.format
    if src == to_format:
        return LayerRows(src, chunk.weight.clone(), None if chunk.scales is None else chunk.scales.clone())
    if src == "bf16":
        q, s = quantize_fp8_e8m0(chunk.weight.float())
    elif src == "fp8":
        q, s = chunk.weight, chunk.scales
    else:
        q, s = unpack_rows(chunk.weight)
    if to_format == "bf16":
        return LayerRows("bf16", dequantize_fp8_e8m0(q.contiguous(), s.contiguous(), torch.bfloat16))
    if to_format == "fp8":
        return LayerRows("fp8", q.contiguous(), s.contiguous())
    return LayerRows("fp8_interleaved", pack_rows(q.contiguous(), s.contiguous()))


def float_chunks(weight: torch.Tensor, to_format: str, chunk_rows: int) -> Iterator[LayerRows]:
    """A float table [rows, head_dim] in `to_format`, chunk by chunk (see the module docstring); the
    pages of a mapped `weight` are given back once each chunk is consumed."""
    for start in range(0, weight.shape[0], chunk_rows):
        w = weight[start : start + chunk_rows]
        if to_format == "bf16":
            yield LayerRows("bf16", w.to(torch.bfloat16, copy=True))
        else:
            q, s = quantize_fp8_e8m0(w.float())
            yield convert_rows(LayerRows("fp8", q, s), to_format)
        release_pages(w)


def converted_chunks(rows: LayerRows, to_format: str, chunk_rows: int) -> Iterator[LayerRows]:
    """`rows` converted chunk by chunk.

    Rows of a table file are read from its `source` and checked block by block; mapped
    tensors' pages are given back once each chunk is consumed.
    """
    source = rows.source
    for start in range(0, rows.num_rows, chunk_rows):
        stop = min(rows.num_rows, start + chunk_rows)
        if source is not None:
            raw = torch.empty((stop - start, source.row_bytes), dtype=torch.uint8)
            try:
                source.read(raw, start=start)
            except IntegrityMismatch as exc:
                raise TableFileError(f"conversion source {source.path}: {exc}") from None
            chunk = (
                LayerRows("bf16", raw.view(torch.bfloat16))
                if rows.format == "bf16"
                else LayerRows("fp8_interleaved", raw)
            )
            yield convert_rows(chunk, to_format)
            continue
        chunk = LayerRows(
            rows.format, rows.weight[start:stop], None if rows.scales is None else rows.scales[start:stop]
        )
        yield convert_rows(chunk, to_format)
        for t in (chunk.weight, chunk.scales):
            if t is not None:
                release_pages(t)


def convert_tables(
    tables: Mapping[int, LayerRows | torch.Tensor],
    layout: EngramLayout,
    dst: str | os.PathLike,
    to_format: str,
    tokenizer_fingerprint: str | None = None,
    chunk_rows: int = 1 << 18,
    progress: bool = True,
) -> Path:
    """Write `tables` (any formats, e.g. memory maps) to a new table file in `to_format`.

    Args:
        tables: {layer_id: LayerRows, or a float tensor [rows, head_dim] (a trained table)} covering
            every layer of `layout`.
        layout: the layout the tables belong to (recorded in the file).
        dst: output path (written atomically).
        to_format: bf16, fp8 or fp8_interleaved.
        tokenizer_fingerprint: the compressed tokenizer's fingerprint, recorded for checks.
        chunk_rows: rows converted at a time (bounds memory).
        progress: show a progress bar.
    """
    if chunk_rows < 1:
        raise TableFileError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if to_format not in FORMATS:
        raise TableFileError(f"unknown table format {to_format!r}; choose one of {FORMATS}")
    head_dim = layout.config.head_dim
    if to_format != "bf16" and head_dim % FP8_SCALE_BLOCK:
        raise TableFileError(
            f"{to_format} rows need head_dim to be a multiple of {FP8_SCALE_BLOCK} (one e8m0 scale per "
            f"{FP8_SCALE_BLOCK} values); these rows are {head_dim} wide: write bf16"
        )
    for layer in layout.layers:
        rows = tables.get(layer.layer_id)
        if rows is None:
            raise TableFileError(f"no table for Engram layer {layer.layer_id}")
        if isinstance(rows, torch.Tensor):
            if not rows.is_floating_point() or rows.dim() != 2:
                raise TableFileError(
                    f"layer {layer.layer_id}: a table tensor must be 2-D float rows, got {rows.dtype} "
                    f"{tuple(rows.shape)}"
                )
            n, width = rows.shape
        else:
            rows.validate()
            n, width = rows.num_rows, rows.head_dim
        if n != layer.num_embeddings:
            raise TableFileError(f"layer {layer.layer_id}: {n} rows, the layout has {layer.num_embeddings}")
        if width != head_dim:
            raise TableFileError(f"layer {layer.layer_id}: rows are {width} wide, head_dim is {head_dim}")
    sources = {
        lid: float_chunks(rows, to_format, chunk_rows)
        if isinstance(rows, torch.Tensor)
        else converted_chunks(rows, to_format, chunk_rows)
        for lid, rows in tables.items()
        if lid in layout.layer_ids
    }
    return write_table_file(dst, layout, to_format, sources, tokenizer_fingerprint, progress=progress)
