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

Every tensor's bytes carry a CRC32C per 4 KiB block (`condmem.tables.integrity`). Opening
checks the header digest and the CRCs' own sha256; the rows are checked where they are read:
a layer's `LayerRows.source` (`RowSource`) reads them with ``pread`` and checks every block
it returns, which is how every tier loads or reads them (`condmem.tables.storage`),
``convert`` streams them and `EngramTableFile.verify` (``condmem inspect --verify``) checks
them all. Files written before the block CRCs (a sha256 per 16 MiB chunk) open with a loud
note and are checked chunk by chunk; a file without any checksums is refused unless opened
with ``verify="none"`` (loudly).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import numpy as np
import torch

from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.tables import integrity
from condmem.tables.safetensors_io import (
    Header,
    OpenFile,
    StreamingWriter,
    TableFileError,
    mmap_tensor,
    read_header,
)
from condmem.utils.progress import Progress

TableFormat = Literal["bf16", "fp8", "fp8_interleaved"]
FORMATS: tuple[str, ...] = ("bf16", "fp8", "fp8_interleaved")
FORMAT_TAG = "condmem.engram_table/1"
Verify = Literal["read", "full", "none"]

log = logging.getLogger("condmem.tables")


class TableMismatchError(TableFileError):
    """A table file was made for another layout, tokenizer or geometry than the one reading it."""


def check_read_range(out: torch.Tensor, start: int, num_rows: int, row_bytes: int) -> None:
    """A row source's `read_into` arguments: `out` contiguous uint8 [n, row_bytes], rows inside the table."""
    n = out.shape[0]
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.shape[1:] != (row_bytes,):
        raise ValueError(f"out must be contiguous uint8 [n, {row_bytes}]")
    if start < 0 or start + n > num_rows:
        raise ValueError(f"rows {start}..{start + n} outside 0..{num_rows}")


@dataclass(frozen=True)
class RowSource:
    """Where rows [r0, r1) of one layer lie in a table file, and how every byte of them is checked.

    `read` copies rows into memory (the host and HBM tiers, ``convert``), `reader` makes the disk
    tier's row reader; both read the validated file with ``pread`` and check each block (or
    chunk) they return against its recorded checksum, and refuse a file whose size or mtime
    changed since it was opened.

    Attributes:
        file: the validated file's open descriptor.
        format: the table format (``fp8`` reads two tensors, packed into interleaved rows).
        spans: {"weight"/"scales": (tensor name, absolute start, bytes per row)} of the whole tensor.
        checks: {role: `TensorChecks`}, or None for a file without checksums (opened with ``verify="none"``).
        r0, r1: the rows (a shard of the layer, or all of it).
    """

    file: OpenFile
    format: str
    spans: dict[str, tuple[str, int, int]]
    checks: dict[str, integrity.TensorChecks] | None
    r0: int
    r1: int

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def num_rows(self) -> int:
        return self.r1 - self.r0

    @property
    def row_bytes(self) -> int:
        """Bytes of one raw row (fp8 rows interleaved with their scales)."""
        return sum(rb for _, _, rb in self.spans.values())

    def slice(self, start: int, stop: int) -> RowSource:
        """Rows [start, stop) of these rows."""
        start, stop, _ = slice(start, stop).indices(self.num_rows)
        return dataclasses.replace(self, r0=self.r0 + start, r1=self.r0 + max(start, stop))

    def open(self, direct: bool = False) -> int:
        """A new descriptor of the validated file (O_DIRECT when `direct`); `FileChanged` when it changed since."""
        fd = self.file.reopen(direct)
        change = self.file.changed(fd)
        if change is not None:
            os.close(fd)
            raise integrity.FileChanged(f"{change} since it was opened")
        return fd

    def read(
        self,
        out: torch.Tensor,
        start: int = 0,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        checked: bool = True,
        drop_cache: bool = False,
    ) -> None:
        """Rows [start, start + len(out)) of these rows into `out` (CPU uint8 [n, row_bytes], raw rows), every
        block checked, on `threads` threads. Raises `IntegrityMismatch` / `FileChanged` (callers name the file).

        `checked=False` only reads (what a benchmark compares against); `drop_cache` drops the read
        bytes from the page cache (a loader that keeps its own copy).
        """
        n = out.shape[0]
        check_read_range(out, start, self.num_rows, self.row_bytes)
        if n == 0:
            return
        threads = threads or integrity.default_threads()
        fd = self.open()
        try:
            jobs = self._jobs(fd, out, self.r0 + start, checked, drop_cache)
            integrity.parallel(jobs, threads, progress)
            change = self.file.changed(fd)
            if change is not None:
                raise integrity.FileChanged(f"{change} while it was read")
        finally:
            os.close(fd)

    def _jobs(self, fd: int, out: torch.Tensor, row0: int, checked: bool, drop_cache: bool):
        n = out.shape[0]
        flat = out.numpy().reshape(-1)
        roles = list(self.spans)
        checks = self.checks if checked and self.checks is not None else {}

        def job_raw(a: int, b: int, base: int):
            def run() -> int:
                integrity.read_checked(fd, checks.get("weight"), a, b, memoryview(flat[a - base : b - base]))
                if drop_cache:
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
                return b - a

            return run

        if len(roles) == 1:
            _, start, rb = self.spans["weight"]
            a, b = start + row0 * rb, start + (row0 + n) * rb
            return [job_raw(lo, hi, a) for lo, hi in integrity.pieces(checks.get("weight"), a, b)]

        # fp8 with separate scales: read both tensors' bytes of a piece of rows, then interleave them.
        w_rb, s_rb = self.spans["weight"][2], self.spans["scales"][2]
        step = max(1, integrity.PIECE_BYTES // w_rb)
        table = out.numpy()

        def job_split(r_lo: int, r_hi: int):
            def run() -> int:
                parts = []
                for role, (_, t_start, rb) in self.spans.items():
                    buf = np.empty((r_hi - r_lo) * rb, np.uint8)
                    a = t_start + (row0 + r_lo) * rb
                    integrity.read_checked(fd, checks.get(role), a, a + buf.size, memoryview(buf))
                    parts.append(buf.reshape(r_hi - r_lo, rb))
                table[r_lo:r_hi, :w_rb] = parts[0]
                table[r_lo:r_hi, w_rb:] = parts[1]
                return (r_hi - r_lo) * (w_rb + s_rb)

            return run

        return [job_split(r, min(n, r + step)) for r in range(0, n, step)]

    def reader(self, direct: bool = False, threads: int = 32):
        """The disk tier's row reader(s) of these rows: {"weight": reader[, "scales": reader]}."""
        from condmem.tables.direct_read import DirectRowReader

        return {
            role: DirectRowReader(
                self.file.path,
                start + self.r0 * rb,
                rb,
                self.num_rows,
                threads=threads,
                direct=direct,
                source=self,
                checks=None if self.checks is None else self.checks[role],
            )
            for role, (_, start, rb) in self.spans.items()
        }


@dataclass
class LayerRows:
    """One layer's table in one of the row formats (tensors may be memory maps).

    ``weight`` is bf16 [rows, d] (bf16), fp8 e4m3 [rows, d] (fp8) or uint8 [rows, d + d/32]
    (fp8_interleaved); ``scales`` is uint8 [rows, d/32] for fp8, else None.
    """

    format: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    source: RowSource | None = None
    """Where the rows lie in a table file: the tiers read and check them from there (never through `weight`)."""

    def slice_rows(self, start: int, stop: int) -> LayerRows:
        """Rows [start, stop) (views; the source follows)."""
        return LayerRows(
            self.format,
            self.weight[start:stop],
            None if self.scales is None else self.scales[start:stop],
            None if self.source is None else self.source.slice(start, stop),
        )

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
                raise TableFileError(
                    f"fp8 table needs uint8 scales [rows, {-(-w.shape[1] // FP8_SCALE_BLOCK)}], got "
                    f"{None if s is None else (s.dtype, tuple(s.shape))}"
                )
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
        num_rows = layer.num_embeddings
        if fmt == "bf16":
            specs[names["weight"]] = (torch.bfloat16, (num_rows, d))
        elif fmt == "fp8":
            specs[names["weight"]] = (torch.float8_e4m3fn, (num_rows, d))
            specs[names["scales"]] = (torch.uint8, (num_rows, d // FP8_SCALE_BLOCK))
        else:
            specs[names["weight"]] = (torch.uint8, (num_rows, d + d // FP8_SCALE_BLOCK))
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
    """Bytes of a table file for `layout` in `fmt`: the rows, their block CRCs and a generous bound on the header."""
    num_rows = sum(layout.num_embeddings)
    d = layout.config.head_dim
    data = num_rows * (2 * d if fmt == "bf16" else d + d // FP8_SCALE_BLOCK)
    return data + 4 * (data // integrity.BLOCK_BYTES + 4 * len(layout.layers)) + (1 << 20) + num_rows * d // 2**19


def write_table_file(
    path: str | os.PathLike,
    layout: EngramLayout,
    fmt: TableFormat,
    chunks_per_layer: Mapping[int, Iterable[LayerRows]],
    tokenizer_fingerprint: str | None = None,
    progress: bool = False,
    block_bytes: int = integrity.BLOCK_BYTES,
) -> Path:
    """Stream every layer's rows into a new table file, atomically, with a CRC32C per block.

    Args:
        chunks_per_layer: {layer_id: iterable of LayerRows chunks in `fmt`, in row order}.
        progress: show a progress bar over rows.
        block_bytes: bytes per recorded CRC32C (a multiple of 4096; default 4096).
    """
    if fmt not in FORMATS:
        raise TableFileError(f"unknown table format {fmt!r}; choose one of {FORMATS}")
    if layout.config.head_dim % FP8_SCALE_BLOCK and fmt != "bf16":
        raise TableFileError(f"fp8 tables need head_dim divisible by {FP8_SCALE_BLOCK}, got {layout.config.head_dim}")
    missing = set(layout.layer_ids) - set(chunks_per_layer)
    if missing:
        raise TableFileError(f"no rows given for Engram layer(s) {sorted(missing)}")
    specs = _specs(layout, fmt)
    bar = Progress(
        sum(layout.num_embeddings), f"write {Path(path).name}", enabled=progress, unit="row", unit_scale=True
    )
    with StreamingWriter(
        path, specs, table_metadata(layout, fmt, tokenizer_fingerprint), block_bytes=block_bytes
    ) as writer:
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
                raise TableFileError(
                    f"layer {layer.layer_id}: {written} rows given, the layout has {layer.num_embeddings}"
                )
    bar.close()
    return Path(path)


class EngramTableFile:
    """A table file opened for reading: metadata and checksums' records checked; rows checked where they are read.

    Args:
        path: the safetensors file.
        layout: when given, the file must have been made for exactly this layout.
        tokenizer_fingerprint: when given (and recorded in the file), they must agree.
        verify: ``read`` (default) checks the header digest and the block CRCs' own sha256 at open,
            and every row where it is read (`LayerRows.source`); ``full`` also every block of every
            tensor now; ``none`` nothing at open (a file without checksums opens, with a warning).

    Raises:
        TableFileError: missing, truncated, corrupted, not safetensors, not a condmem table,
            an incomplete write, or without checksums (unless ``verify="none"``).
        TableMismatchError: made for another layout / tokenizer.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layout: EngramLayout | None = None,
        tokenizer_fingerprint: str | None = None,
        verify: Verify = "read",
    ):
        if verify not in ("read", "full", "none"):
            raise TableFileError(f"verify must be read, full or none, got {verify!r}")
        self.header: Header = read_header(path)
        self.path = self.header.path
        meta = self.header.metadata
        if meta.get("format") != FORMAT_TAG:
            raise TableFileError(
                f"{self.path} is a safetensors file but not a condmem Engram table "
                f"(format tag {meta.get('format')!r}); released checkpoints load with "
                "condmem.tables.released.ReleasedCheckpoint (or condmem convert --released)"
            )
        try:
            self.integrity = integrity.parse(meta)
            if self.integrity is not None:
                integrity.check_header(self.integrity, meta, self.header.raw_tensors)
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None
        if self.integrity is None:
            if verify != "none":
                raise TableFileError(
                    f"{self.path} has no chunk hashes, so its rows cannot be checked: rewrite it with "
                    "`condmem convert --no-verify` (which records them), or open it with verify='none'"
                )
            log.warning(
                "%s: UNVERIFIED table file (no chunk hashes): corrupted rows would be served as rows", self.path
            )
        elif not integrity.has_block_crcs(self.integrity):
            log.warning(
                "%s: written before per-block checksums: its rows are checked chunk by chunk (sha256 pieces "
                "of %.3g MiB: all of them while a tier loads it, each at its first read on the disk tier); "
                "`condmem convert` rewrites it with a CRC32C per 4 KiB block",
                self.path,
                self.integrity["chunk_bytes"] / 2**20,
            )
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
        self._checks: dict[str, integrity.TensorChecks] = {}
        if verify != "none" and self.integrity is not None:
            self._load_checks()
            if verify == "full":
                self.verify()

    @property
    def block_crcs(self) -> bool:
        """True when every block of the rows has its own CRC32C (else: chunk digests, or nothing)."""
        return integrity.has_block_crcs(self.integrity)

    def data_tensors(self) -> list[str]:
        """The tensors of rows (not the companions holding their block CRCs)."""
        sums = set(self.integrity["sums"].values()) if self.block_crcs else set()
        return [n for n in self.header.tensors if n not in sums]

    def _load_checks(self) -> None:
        """Every tensor's `TensorChecks`; block CRCs are read (with pread) and checked against their sha256."""
        if self._checks or self.integrity is None:
            return
        record = self.integrity
        checks = {}
        fd = self.header.file.reopen()
        try:
            for name in self.data_tensors():
                e = self.header.tensors[name]
                if not self.block_crcs:
                    checks[name] = integrity.TensorChecks(
                        name, e.start, e.nbytes, record["chunk_bytes"], e.start, digests=record["tensors"][name]
                    )
                    continue
                companion = self.header.tensors[record["sums"][name]]
                raw = np.empty(companion.nbytes, np.uint8)
                integrity.pread_into(fd, memoryview(raw), companion.start)
                integrity.check_digest(companion.name, raw, record["sums_sha256"][companion.name])
                crcs = raw.view("<u4").astype(np.uint32)
                if len(crcs) != integrity.n_blocks(e.start, e.nbytes, record["block_bytes"]):
                    raise integrity.IntegrityMismatch(
                        f"tensor {name!r} has {len(crcs)} block CRCs for "
                        f"{integrity.n_blocks(e.start, e.nbytes, record['block_bytes'])} "
                        "blocks"
                    )
                checks[name] = integrity.TensorChecks(name, e.start, e.nbytes, record["block_bytes"], 0, crcs=crcs)
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None
        finally:
            os.close(fd)
        self._checks = checks

    def verify(self, progress: bool = False, threads: int | None = None) -> int:
        """Read every byte of every tensor (with pread, in parallel) and check it against its recorded
        checksum; returns the bytes checked. Raises `TableFileError` naming the first bad block or chunk."""
        if self.integrity is None:
            raise TableFileError(f"{self.path} has no chunk hashes to verify")
        self._load_checks()
        total = sum(c.nbytes for c in self._checks.values())
        bar = Progress(total, f"verify {self.path.name}", enabled=progress, unit="B", unit_scale=True)
        fd = self.header.file.reopen()
        try:
            jobs = []
            for c in self._checks.values():
                for a, b in integrity.pieces(c, c.start, c.start + c.nbytes):

                    def job(c=c, a=a, b=b) -> int:
                        integrity.read_checked(fd, c, a, b, memoryview(bytearray(b - a)))
                        return b - a

                    jobs.append(job)
            integrity.parallel(jobs, threads or integrity.default_threads(), bar.update)
            change = self.header.file.changed(fd)
            if change is not None:
                raise integrity.FileChanged(f"{change} while it was verified")
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None
        finally:
            os.close(fd)
            bar.close()
        return total

    def source(self, layer_id: int) -> RowSource:
        """Where a layer's rows lie in the file and how they are checked (see `RowSource`)."""
        if layer_id not in self.layer_ids:
            raise TableFileError(f"{self.path} holds Engram layers {self.layer_ids}, not {layer_id}")
        self._load_checks()
        spans = {}
        for role, name in tensor_names(layer_id, self.format).items():
            e = self.header.tensors[name]
            spans[role] = (name, e.start, e.nbytes // e.shape[0] if e.shape[0] else 0)
        checks = {role: self._checks[name] for role, (name, _, _) in spans.items()} if self._checks else None
        num_rows = self.num_embeddings[self.layer_ids.index(layer_id)]
        return RowSource(self.header.file, self.format, spans, checks, 0, num_rows)

    def read_rows(self, layer_id: int, start: int, stop: int, threads: int | None = None) -> LayerRows:
        """Rows [start, stop) of one layer in memory, every block checked (raw rows: fp8 interleaved)."""
        src = self.source(layer_id).slice(start, stop)
        out = torch.empty((src.num_rows, src.row_bytes), dtype=torch.uint8)
        try:
            src.read(out, threads=threads)
        except integrity.IntegrityMismatch as exc:
            raise TableFileError(f"{self.path}: {exc}") from None
        if self.format == "bf16":
            return LayerRows("bf16", out.view(torch.bfloat16))
        return LayerRows("fp8_interleaved", out)

    def check_layout(self, layout: EngramLayout) -> None:
        """Refuse a layout other than the one the table was made with, naming what differs."""
        if layout.fingerprint == self.layout_fingerprint:
            if layout.config.head_dim != self.head_dim:
                raise TableMismatchError(
                    f"{self.path}: rows are {self.head_dim} wide, the config says head_dim {layout.config.head_dim}"
                )
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
        """One layer's rows: memory-mapped tensors (no bytes are read until used) and their checked `source`,
        which the tiers read from."""
        source = self.source(layer_id)
        names = tensor_names(layer_id, self.format)
        weight = mmap_tensor(self.header, names["weight"])
        scales = mmap_tensor(self.header, names["scales"]) if "scales" in names else None
        return LayerRows(self.format, weight, scales, source)

    def tables(self) -> dict[int, LayerRows]:
        """Every layer's memory-mapped rows."""
        return {lid: self.layer(lid) for lid in self.layer_ids}

    def layout(self) -> EngramLayout:
        """Rebuild the layout the file was made with (from its recorded description)."""
        from condmem.config import EngramConfig

        d = self.layout_description
        config = EngramConfig(
            layer_ids=d["layer_ids"],
            max_ngram_size=d["max_ngram_size"],
            n_heads=d["n_heads"],
            head_dim=self.head_dim,
            table_size=d["table_sizes"],
            pad_id=d["pad_id"],
            seed=d["seed"],
            compressed_vocab_size=d["compressed_vocab_size"],
        )
        layout = EngramLayout(config)
        if layout.fingerprint != self.layout_fingerprint:
            raise TableFileError(f"{self.path}: recorded layout does not reproduce its fingerprint (damaged metadata?)")
        return layout

    def __repr__(self) -> str:
        return (
            f"EngramTableFile({str(self.path)!r}, {self.format}, layers={self.layer_ids}, rows={self.num_embeddings})"
        )


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
