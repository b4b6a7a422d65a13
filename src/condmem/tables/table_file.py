"""Engram table files: one safetensors file per model, every Engram layer's table, with identity.

Three row formats (``TableFormat``):

* ``bf16``: ``layers.<id>.weight`` bf16 [rows, head_dim];
* ``fp8``: ``layers.<id>.weight`` fp8 e4m3 [rows, head_dim] and
  ``layers.<id>.weight_scale_inv`` uint8 e8m0 [rows, head_dim/32] (the released layout);
* ``fp8_interleaved``: ``layers.<id>.rows`` uint8 [rows, head_dim + head_dim/32]: each
  row's fp8 bytes followed by its scale bytes (264 B at head_dim 256), so one random
  access fetches a whole row: half the address translations, at no cost (docs/benchmarks.md).

The header metadata records what decides the row ids (layout fingerprint and its
description) and the compressed tokenizer's fingerprint. `EngramTableFile.open` refuses a
file made for another layout or tokenizer with `TableMismatchError`, and a truncated or
foreign file with `TableFileError`. Tensors are memory-mapped, never read eagerly.

Every tensor's bytes carry a sha256 per chunk (`condmem.tables.integrity`): the header
digest and a few random chunks per tensor are checked at open, every chunk by
`EngramTableFile.verify` (``condmem inspect --verify``) or as ``convert`` streams them.
A file without hashes is refused unless opened with ``verify="none"`` (loudly).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping

import torch

from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.tables import integrity
from condmem.tables.safetensors_io import Header, StreamingWriter, TableFileError, mmap_tensor, read_header
from condmem.utils.progress import Progress

TableFormat = Literal["bf16", "fp8", "fp8_interleaved"]
FORMATS: tuple[str, ...] = ("bf16", "fp8", "fp8_interleaved")
FORMAT_TAG = "condmem.engram_table/1"
Verify = Literal["sample", "full", "none"]
SAMPLE_CHUNKS = 2
"""Chunks per tensor hashed at open (chosen at random each time)."""

log = logging.getLogger("condmem.tables")


class TableMismatchError(TableFileError):
    """A table file was made for another layout, tokenizer or geometry than the one reading it."""


@dataclass
class LayerRows:
    """One layer's table in one of the row formats (tensors may be memory maps).

    ``weight`` is bf16 [rows, d] (bf16), fp8 e4m3 [rows, d] (fp8) or uint8 [rows, d + d/32]
    (fp8_interleaved); ``scales`` is uint8 [rows, d/32] for fp8, else None.
    """

    format: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def head_dim(self) -> int:
        if self.format == "fp8_interleaved":
            width = self.weight.shape[1]
            return width * FP8_SCALE_BLOCK // (FP8_SCALE_BLOCK + 1)
        return self.weight.shape[1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (scales included) as stored."""
        if self.format == "bf16":
            return 2 * self.head_dim
        return self.head_dim + self.head_dim // FP8_SCALE_BLOCK

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise TableFileError(f"unknown table format {self.format!r}; choose one of {FORMATS}")
        w, s = self.weight, self.scales
        if w.dim() != 2:
            raise TableFileError(f"{self.format} table must be 2-D [rows, width], got {tuple(w.shape)}")
        want = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_interleaved": torch.uint8}[self.format]
        if w.dtype != want:
            raise TableFileError(f"{self.format} table rows must be {want}, got {w.dtype}")
        if self.format == "fp8":
            if s is None or s.dtype != torch.uint8 or s.shape != (w.shape[0], -(-w.shape[1] // FP8_SCALE_BLOCK)):
                raise TableFileError(f"fp8 table needs uint8 scales [rows, {-(-w.shape[1] // FP8_SCALE_BLOCK)}], got "
                                     f"{None if s is None else (s.dtype, tuple(s.shape))}")
        elif s is not None:
            raise TableFileError(f"{self.format} table carries no separate scales")
        if self.format == "fp8_interleaved" and w.shape[1] % (FP8_SCALE_BLOCK + 1):
            raise TableFileError(f"interleaved rows of {w.shape[1]} B are not head_dim + head_dim/32")


def tensor_names(layer_id: int, fmt: str) -> dict[str, str]:
    """Names of a layer's tensors in a condmem table file."""
    if fmt == "fp8_interleaved":
        return {"weight": f"layers.{layer_id}.rows"}
    names = {"weight": f"layers.{layer_id}.weight"}
    if fmt == "fp8":
        names["scales"] = f"layers.{layer_id}.weight_scale_inv"
    return names


def _specs(layout: EngramLayout, fmt: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    d = layout.config.head_dim
    specs = {}
    for layer in layout.layers:
        names = tensor_names(layer.layer_id, fmt)
        rows = layer.num_embeddings
        if fmt == "bf16":
            specs[names["weight"]] = (torch.bfloat16, (rows, d))
        elif fmt == "fp8":
            specs[names["weight"]] = (torch.float8_e4m3fn, (rows, d))
            specs[names["scales"]] = (torch.uint8, (rows, d // FP8_SCALE_BLOCK))
        else:
            specs[names["weight"]] = (torch.uint8, (rows, d + d // FP8_SCALE_BLOCK))
    return specs


def table_metadata(layout: EngramLayout, fmt: str, tokenizer_fingerprint: str | None) -> dict[str, str]:
    """The header metadata of a table file for `layout`."""
    return {
        "format": FORMAT_TAG,
        "dtype": fmt,
        "layout_fingerprint": layout.fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint or "",
        "head_dim": str(layout.config.head_dim),
        "layer_ids": json.dumps(layout.layer_ids),
        "num_embeddings": json.dumps(layout.num_embeddings),
        "layout": json.dumps(layout.describe(), separators=(",", ":")),
    }


def file_bytes(layout: EngramLayout, fmt: str) -> int:
    """Bytes of a table file for `layout` in `fmt`: the rows plus a generous bound on the header."""
    rows = sum(layout.num_embeddings)
    d = layout.config.head_dim
    return rows * (2 * d if fmt == "bf16" else d + d // FP8_SCALE_BLOCK) + (1 << 20) + rows * d // 2**19


def write_table_file(
    path: str | os.PathLike,
    layout: EngramLayout,
    fmt: TableFormat,
    chunks_per_layer: Mapping[int, Iterable[LayerRows]],
    tokenizer_fingerprint: str | None = None,
    progress: bool = False,
    integrity_chunk_bytes: int | None = None,
) -> Path:
    """Stream every layer's rows into a new table file, atomically, with per-chunk hashes.

    Args:
        chunks_per_layer: {layer_id: iterable of LayerRows chunks in `fmt`, in row order}.
        progress: show a progress bar over rows.
        integrity_chunk_bytes: bytes per recorded sha256 (default 16 MiB).
    """
    if fmt not in FORMATS:
        raise TableFileError(f"unknown table format {fmt!r}; choose one of {FORMATS}")
    if layout.config.head_dim % FP8_SCALE_BLOCK and fmt != "bf16":
        raise TableFileError(f"fp8 tables need head_dim divisible by {FP8_SCALE_BLOCK}, got {layout.config.head_dim}")
    missing = set(layout.layer_ids) - set(chunks_per_layer)
    if missing:
        raise TableFileError(f"no rows given for Engram layer(s) {sorted(missing)}")
    specs = _specs(layout, fmt)
    bar = Progress(sum(layout.num_embeddings), f"write {Path(path).name}", enabled=progress, unit="row", unit_scale=True)
    with StreamingWriter(path, specs, table_metadata(layout, fmt, tokenizer_fingerprint),
                         integrity_chunk_bytes) as writer:
        for layer in layout.layers:
            names = tensor_names(layer.layer_id, fmt)
            written = 0
            for chunk in chunks_per_layer[layer.layer_id]:
                if chunk.format != fmt:
                    raise TableFileError(f"layer {layer.layer_id}: got a {chunk.format} chunk for a {fmt} file")
                chunk.validate()
                writer.write(names["weight"], chunk.weight)
                if fmt == "fp8":
                    writer.write(names["scales"], chunk.scales)
                written += chunk.num_rows
                bar.update(chunk.num_rows)
            if written != layer.num_embeddings:
                raise TableFileError(f"layer {layer.layer_id}: {written} rows given, the layout has {layer.num_embeddings}")
    bar.close()
    return Path(path)



class EngramTableFile:
    """A table file opened for reading: metadata checked, tensors memory-mapped.

    Args:
        path: the safetensors file.
        layout: when given, the file must have been made for exactly this layout.
        tokenizer_fingerprint: when given (and recorded in the file), they must agree.
        verify: ``sample`` (default) checks the header digest and a few random chunks of
            every tensor; ``full`` every chunk; ``none`` nothing (a file without hashes opens,
            with a warning).

    Raises:
        TableFileError: missing, truncated, corrupted, not safetensors, not a condmem table,
            an incomplete write, or without hashes (unless ``verify="none"``).
        TableMismatchError: made for another layout / tokenizer.
    """

    def __init__(self, path: str | os.PathLike, layout: EngramLayout | None = None,
                 tokenizer_fingerprint: str | None = None, verify: Verify = "sample"):
        if verify not in ("sample", "full", "none"):
            raise TableFileError(f"verify must be sample, full or none, got {verify!r}")
        self.header: Header = read_header(path)
        self.path = self.header.path
        meta = self.header.metadata
        if meta.get("format") != FORMAT_TAG:
            raise TableFileError(
                f"{self.path} is a safetensors file but not a condmem Engram table (format tag {meta.get('format')!r}); "
                "released checkpoints load with condmem.tables.released.ReleasedCheckpoint (or condmem convert --released)"
            )
        try:
            self.integrity = integrity.parse(meta)
            if self.integrity is not None:
                integrity.check_header(self.integrity, meta, self.header.raw_tensors)
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None
        if self.integrity is None:
            if verify != "none":
                raise TableFileError(f"{self.path} has no chunk hashes, so its rows cannot be checked: rewrite it with "
                                     "`condmem convert --no-verify` (which records them), or open it with verify='none'")
            log.warning("%s: UNVERIFIED table file (no chunk hashes): corrupted rows would be served as rows", self.path)
        try:
            self.format: str = meta["dtype"]
            self.layout_fingerprint = meta["layout_fingerprint"]
            self.tokenizer_fingerprint = meta.get("tokenizer_fingerprint") or None
            self.head_dim = int(meta["head_dim"])
            self.layer_ids: list[int] = json.loads(meta["layer_ids"])
            self.num_embeddings: list[int] = json.loads(meta["num_embeddings"])
            self.layout_description = json.loads(meta["layout"])
            pairs = list(zip(self.layer_ids, self.num_embeddings, strict=True))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableFileError(f"{self.path}: table metadata is missing or malformed ({exc})") from None
        if self.format not in FORMATS:
            raise TableFileError(f"{self.path}: unknown row format {self.format!r}")
        for lid, rows in pairs:
            for name in tensor_names(lid, self.format).values():
                entry = self.header.tensors.get(name)
                if entry is None:
                    raise TableFileError(f"{self.path}: tensor {name!r} is missing")
                if entry.shape[0] != rows:
                    raise TableFileError(f"{self.path}: {name!r} has {entry.shape[0]} rows, metadata says {rows}")
        if layout is not None:
            self.check_layout(layout)
        if tokenizer_fingerprint is not None:
            self.check_tokenizer(tokenizer_fingerprint)
        if verify != "none" and self.integrity is not None:
            self.verify(sample=SAMPLE_CHUNKS if verify == "sample" else None)

    def _spans(self) -> dict[str, tuple[int, int]]:
        return {name: (e.start, e.nbytes) for name, e in self.header.tensors.items()}

    def verify(self, sample: int | None = None, progress: bool = False) -> int:
        """Hash every chunk of every tensor (or `sample` random ones per tensor) and compare with the
        recorded digests; returns the bytes checked. Raises `TableFileError` naming the first bad chunk."""
        if self.integrity is None:
            raise TableFileError(f"{self.path} has no chunk hashes to verify")
        try:
            return integrity.verify_chunks(self.header.mapping, self._spans(), self.integrity, sample, progress,
                                           f"verify {self.path.name}")
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None

    def chunk_verifiers(self, layer_id: int) -> dict[str, integrity.ChunkVerifier]:
        """{role: verifier} for a reader that streams this layer's tensors in order (empty without hashes)."""
        if self.integrity is None:
            return {}
        size = self.integrity["chunk_bytes"]
        return {role: integrity.ChunkVerifier(name, self.integrity["tensors"][name], size)
                for role, name in tensor_names(layer_id, self.format).items()}

    def check_layout(self, layout: EngramLayout) -> None:
        """Refuse a layout other than the one the table was made with, naming what differs."""
        if layout.fingerprint == self.layout_fingerprint:
            if layout.config.head_dim != self.head_dim:
                raise TableMismatchError(f"{self.path}: rows are {self.head_dim} wide, the config says head_dim "
                                         f"{layout.config.head_dim}")
            return
        mine, theirs = layout.describe(), self.layout_description
        diffs = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        detail = ", ".join(f"{k}: file {_short(theirs.get(k))} vs yours {_short(mine.get(k))}" for k in diffs[:4])
        raise TableMismatchError(
            f"{self.path} was made for another Engram layout ({detail or 'fingerprint differs'}): its rows would be "
            "read at the wrong addresses"
        )

    def check_tokenizer(self, tokenizer_fingerprint: str) -> None:
        """Refuse a compressed tokenizer other than the table's."""
        if self.tokenizer_fingerprint and tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise TableMismatchError(
                f"{self.path} was trained with another tokenizer (compressed-map fingerprint "
                f"{self.tokenizer_fingerprint[:12]}…, yours {tokenizer_fingerprint[:12]}…): hashes would address "
                "unrelated rows"
            )

    def layer(self, layer_id: int) -> LayerRows:
        """Memory-mapped rows of one layer (no bytes are read until used)."""
        if layer_id not in self.layer_ids:
            raise TableFileError(f"{self.path} holds Engram layers {self.layer_ids}, not {layer_id}")
        names = tensor_names(layer_id, self.format)
        weight = mmap_tensor(self.header, names["weight"])
        scales = mmap_tensor(self.header, names["scales"]) if "scales" in names else None
        return LayerRows(self.format, weight, scales)

    def tables(self) -> dict[int, LayerRows]:
        """Every layer's memory-mapped rows."""
        return {lid: self.layer(lid) for lid in self.layer_ids}

    def layout(self) -> EngramLayout:
        """Rebuild the layout the file was made with (from its recorded description)."""
        from condmem.config import EngramConfig

        d = self.layout_description
        config = EngramConfig(layer_ids=d["layer_ids"], max_ngram_size=d["max_ngram_size"], n_heads=d["n_heads"],
                              head_dim=self.head_dim, table_size=d["table_sizes"], pad_id=d["pad_id"], seed=d["seed"],
                              compressed_vocab_size=d["compressed_vocab_size"])
        layout = EngramLayout(config)
        if layout.fingerprint != self.layout_fingerprint:
            raise TableFileError(f"{self.path}: recorded layout does not reproduce its fingerprint (damaged metadata?)")
        return layout

    def __repr__(self) -> str:
        return f"EngramTableFile({str(self.path)!r}, {self.format}, layers={self.layer_ids}, rows={self.num_embeddings})"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
