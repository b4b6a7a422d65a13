"""DeepSeek-V4.1 checkpoints as released: Engram tensors found, checked, and mapped where they lie.

A checkpoint is one safetensors file, or a folder of shards (listed by
``model.safetensors.index.json`` when there is one), with its ``config.json`` beside
them. Each Engram layer ``L`` holds six tensors, named in one of two dialects, told
apart from the names themselves (`detect_names`; ``dialect=`` overrides):

==================  =====================================  =============================================
tensor              ``original`` (DeepSeek's format)       ``hf`` (Hugging Face style)
==================  =====================================  =============================================
table rows          ``layers.L.engram.embed.weight``       ``model.layers.L.engram.embed.weight``
their scales        ``layers.L.engram.embed.scale``        ``model.layers.L.engram.embed.weight_scale_inv``
wkv (block-FP8)     ``layers.L.engram.wkv.weight``         ``model.layers.L.engram.wkv.weight``
its block scales    ``layers.L.engram.wkv.scale``          ``model.layers.L.engram.wkv.weight_scale_inv``
gate weights        ``layers.L.engram.q_weight``, ``k_weight`` (same names after the prefix)
==================  =====================================  =============================================

Shapes and dtypes: rows fp8 e4m3 [rows, head_dim] with one e8m0 scale per 32 values
[rows, head_dim/32]; wkv fp8 e4m3 [(hc+1)*D, n_cols*head_dim] with block scales whose
shape gives the block (`condmem.ops.block_fp8`); q/k weights [hc, D]. Scales may be
``float8_e8m0fnu``, ``uint8`` or ``float32`` (table scales in float32 must be exact
powers of two; they are converted to exponent bytes once, in memory).

Nothing in the tensors records the hash layout, so the geometry is checked instead:
each table's row count must equal the sum of its layer's primes, and the config's
``hidden_size`` / ``hc_mult`` must agree with the gate weights' and wkv's shapes (or
are taken from them when the config does not say). Every problem is a
`ReleasedCheckpointError` (a ``ValueError``) naming the tensor and the file.

One routine decides what is valid: `ReleasedCheckpoint.check_tensor` checks one tensor's
presence, dtype and shape (row count against the primes, block divisibility of ``wkv``'s
scales); the loaders (`ReleasedCheckpoint.table`, `wkv_fp8`, `gate_weights`, so
`Engram.from_released` and `EngramMemory.from_released`) call it before mapping a tensor,
and `ReleasedCheckpoint.validate` calls it for every tensor of every layer and collects
the errors instead of raising the first (``condmem inspect`` prints them and exits 1).

Rows are read with ``pread``, never through a mapping (`ReleasedRows`, the table's
`LayerRows.source`, read by every tier, ``convert`` and ``inspect``): the shards listed must
lie inside the checkpoint folder (`checkpoint_files`), every scale read is checked (NaN /
inf refused, `check_scale_bytes`), and each shard's `FileStamp` (inode, size, mtime, ctime)
is compared before and after each read, so a shard truncated or rewritten under a reader is
an error naming it: released shards carry no checksums, the stamp is what can be checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from condmem.config import ConfigError, EngramConfig
from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.ops.block_fp8 import BlockFp8Error, block_shape, dequantize_block_fp8
from condmem.tables import integrity
from condmem.tables.errors import StorageError
from condmem.tables.safetensors_io import Header, TableFileError, TensorEntry, mmap_tensor, read_header
from condmem.tables.table_file import LayerRows, TableMismatchError, check_read_range

log = logging.getLogger("condmem.tables")

NAME_DIALECTS: tuple[str, ...] = ("original", "hf")
INDEX_FILE = "model.safetensors.index.json"
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_SCALE_DTYPES = tuple(t for t in (_E8M0, torch.uint8, torch.float32) if t is not None)
_GATE_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
ROLES = ("embed", "embed_scale", "wkv", "wkv_scale", "q_weight", "k_weight")
# role -> (dtypes allowed, what the tensor is, for messages)
_ROLE_DTYPES: dict[str, tuple[tuple[torch.dtype, ...], str]] = {
    "embed": ((torch.float8_e4m3fn,), "table rows"),
    "embed_scale": (_SCALE_DTYPES, f"the table's scales (one per {FP8_SCALE_BLOCK} values)"),
    "wkv": ((torch.float8_e4m3fn,), "wkv"),
    "wkv_scale": (_SCALE_DTYPES + (torch.bfloat16,), "wkv's block scales"),
    "q_weight": (_GATE_DTYPES, "q_weight ([hc_mult, hidden_size])"),
    "k_weight": (_GATE_DTYPES, "k_weight ([hc_mult, hidden_size])"),
}
_ENGRAM_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.engram\.(?P<rest>.+)$")


class ReleasedCheckpointError(TableFileError):
    """A released checkpoint lacks an Engram tensor, or holds one of the wrong name, dtype or shape."""


@dataclass(frozen=True)
class CheckpointProblem:
    """One finding of `ReleasedCheckpoint.validate`: an error (the loaders refuse the checkpoint) or a warning."""

    severity: Literal["error", "warning"]
    message: str
    tensor: str | None = None
    """The tensor it concerns, when one."""
    layer_id: int | None = None

    def to_dict(self) -> dict:
        return {"severity": self.severity, "message": self.message, "tensor": self.tensor, "layer_id": self.layer_id}


@dataclass(frozen=True)
class TensorNames:
    """How a checkpoint names one Engram layer's tensors."""

    dialect: str
    """``original`` (scales named ``.scale``) or ``hf`` (``.weight_scale_inv``)."""
    prefix: str
    """What precedes ``layers.`` (``""``, ``"model."``, ...)."""

    def layer(self, layer_id: int) -> dict[str, str]:
        base = f"{self.prefix}layers.{layer_id}.engram."
        scale = "scale" if self.dialect == "original" else "weight_scale_inv"
        return {
            "embed": base + "embed.weight",
            "embed_scale": base + f"embed.{scale}",
            "wkv": base + "wkv.weight",
            "wkv_scale": base + f"wkv.{scale}",
            "q_weight": base + "q_weight",
            "k_weight": base + "k_weight",
        }


def detect_names(names, where: str, dialect: str | None = None) -> TensorNames:
    """The naming of the Engram tensors among `names` (`where` names the checkpoint in errors)."""
    if dialect is not None and dialect not in NAME_DIALECTS:
        raise ReleasedCheckpointError(f"unknown tensor-name dialect {dialect!r}; choose one of {NAME_DIALECTS}")
    hits = [m for m in map(_ENGRAM_NAME.match, names) if m]
    if not hits:
        raise ReleasedCheckpointError(f"no Engram tensors ('...layers.<L>.engram.*') in {where}")
    prefixes = sorted({m["prefix"] for m in hits})
    if len(prefixes) > 1:
        raise ReleasedCheckpointError(
            f"Engram tensors under several prefixes {prefixes} in {where}: which is the model?"
        )
    rests = {m["rest"] for m in hits}
    original = any(r.endswith(".scale") for r in rests)
    hf = any(r.endswith(".weight_scale_inv") for r in rests)
    if original and hf and dialect is None:
        raise ReleasedCheckpointError(f"{where} names scales both '.scale' and '.weight_scale_inv': pass dialect=")
    found = "original" if original else "hf" if hf else ("hf" if prefixes[0] == "model." else "original")
    return TensorNames(dialect or found, prefixes[0])


def _shard_path(folder: Path, name, listed_by: str) -> Path:
    """`folder / name` when that file lies inside the checkpoint folder; `ReleasedCheckpointError` otherwise.

    Decided from the name and the links alone, before anything outside is opened: an
    absolute path, a ``..`` part, or a symbolic link resolving outside the folder is
    refused. The one exception is the Hugging Face hub cache, whose snapshot folders
    (``<repo>/snapshots/<revision>/``) hold links into the repository's ``<repo>/blobs/``.
    """
    if not isinstance(name, str) or not name:
        raise ReleasedCheckpointError(f"{listed_by} names shard {name!r}, which is not a file name")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise ReleasedCheckpointError(
            f"{listed_by} names shard {name!r}, an absolute path: shards must lie in the checkpoint folder {folder}"
        )
    if ".." in re.split(r"[/\\]", name):
        raise ReleasedCheckpointError(
            f"{listed_by} names shard {name!r}, which leaves the checkpoint folder {folder} ('..'): refused"
        )
    path = folder / name
    root, real = folder.resolve(), path.resolve()
    if root in real.parents:
        return path
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if hub_blobs is not None and real.parent == hub_blobs:
        return path
    raise ReleasedCheckpointError(
        f"{listed_by} names shard {name!r}, a link to {real}, outside the checkpoint folder {root}: refused "
        "(copy the shard into the folder)"
    )


def checkpoint_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, str] | None]:
    """(the safetensors files of a checkpoint, the index's {tensor: file name} or None).

    Every shard must lie inside the folder (`_shard_path`): an index naming ``../x``,
    ``/etc/passwd`` or a link leading out is refused before any shard is opened.
    """
    path = Path(path)
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise ReleasedCheckpointError(f"checkpoint not found: {path}")
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ReleasedCheckpointError(f"{index} is not a safetensors index ({exc})") from None
        files = sorted({_shard_path(path, f, str(index)) for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ReleasedCheckpointError(f"{index} names shard(s) that are missing: {missing[:5]}")
        return files, weight_map
    files = sorted(_shard_path(path, f.name, f"the folder {path}") for f in path.glob("*.safetensors"))
    if not files:
        raise ReleasedCheckpointError(f"no .safetensors files in {path}")
    return files, None


def _row_of(row_ids: int | torch.Tensor, i: int) -> int:
    """The tensor row of row `i` of a batch: `row_ids` is the first row's (a run) or every row's."""
    return row_ids + i if isinstance(row_ids, int) else int(row_ids.reshape(-1)[i])


def check_scale_bytes(exponents: torch.Tensor, what: str, row_ids: int | torch.Tensor = 0) -> torch.Tensor:
    """`exponents` (uint8 e8m0 bytes [n, d/32]) when none is 0xFF, e8m0's NaN; else `ReleasedCheckpointError`
    naming `what` and the row (`row_ids`: the tensor row of ``exponents[0]``, or of each row). A NaN scale
    turns its row's values into NaN, so no loader, converter or reader passes one on."""
    if exponents.numel() == 0:
        return exponents
    bad = (exponents == 255).reshape(exponents.shape[0], -1).any(dim=1)
    if bool(bad.any()):
        raise ReleasedCheckpointError(
            f"{what}: row {_row_of(row_ids, int(bad.nonzero()[0])):,} has scale byte 0xFF, e8m0's NaN "
            f"({int(bad.sum()):,} such row(s) among the {exponents.shape[0]:,} read): its values would be NaN; refused"
        )
    return exponents


def e8m0_bytes(scales: torch.Tensor, what: str, row_ids: int | torch.Tensor = 0) -> torch.Tensor:
    """Per-32 row scales as uint8 exponents: e8m0 bytes as they are, float32 powers of two converted.

    float32 scales must be finite exact powers of two: NaN, inf or anything else (no e8m0
    byte represents it, or it would make its row NaN) is an error naming `what` and the row
    (`row_ids`: the tensor row of ``scales[0]``, or of each row). e8m0 / uint8 bytes are returned as they are, unread:
    readers check them as they read them (`check_scale_bytes`).
    """
    if _E8M0 is not None and scales.dtype == _E8M0:
        return scales.view(torch.uint8)
    if scales.dtype == torch.uint8:
        return scales
    if scales.dtype != torch.float32:
        raise ReleasedCheckpointError(f"{what} is {scales.dtype}; expected float8_e8m0fnu, uint8 or float32")
    bits = scales.contiguous().view(torch.int32)
    normal = (bits & 0x807FFFFF) == 0  # sign and mantissa clear
    subnormal = bits == 0x00400000  # 2**-127, e8m0's e = 0
    exponent = (bits >> 23) & 0xFF
    ok = (normal & (exponent > 0) & (exponent < 255)) | subnormal
    if not bool(ok.all()):
        flat = int((~ok).flatten().nonzero()[0])
        bad = float(scales.flatten()[flat])
        cols = scales.shape[-1] if scales.dim() > 1 else 1
        why = (
            "not finite: its row's values would be NaN"
            if bad != bad or bad in (float("inf"), float("-inf"))
            else "not a power of two: no e8m0 exponent represents it"
        )
        raise ReleasedCheckpointError(
            f"{what}: row {_row_of(row_ids, flat // cols):,} holds scale {bad!r}, {why}; refused"
        )
    return torch.where(subnormal, torch.zeros_like(exponent), exponent).to(torch.uint8)


@dataclass(frozen=True)
class FileStamp:
    """What a shard was when its header was read: (device, inode), size, mtime and ctime (ns).

    Released shards carry no checksums, so their readers compare this stamp before and after
    every batch (one ``fstat``): a truncation, a ``cp`` over the file (same size or not), an
    ``rsync --inplace`` that restores the mtime (``cp -p``, ``touch -r``) all move the size,
    mtime or ctime, and the kernel sets ctime to the current time on every such change (no
    call sets it back). Limits: a timestamp moves in the file system's clock ticks (a few
    ms), so a rewrite in the same tick as the file's previous change is not seen; a change
    of the inode's status alone (chmod, a hard link added, the file renamed over or unlinked)
    also moves ctime and stops the reader with the same error.
    """

    path: Path
    identity: tuple[int, int]
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path, st: os.stat_result) -> FileStamp:
        return cls(path, (st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change(self, fd: int) -> str | None:
        """How the file under `fd` differs from this stamp, or None."""
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            return "it is no longer the file that was opened"
        if st.st_size != self.size:
            return f"its size went from {self.size:,} to {st.st_size:,} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was modified (its mtime moved)"
        if st.st_ctime_ns != self.ctime_ns:
            return (
                "its inode changed (its ctime moved: rewritten with the mtime restored, or chmod, "
                "linked, renamed over or unlinked)"
            )
        return None

    def error(self, change: str, when: str = "since it was opened", detail: str = "") -> str:
        """The one-line message for a shard that changed under a reader."""
        return (
            f"{self.path} changed under this reader: {change} {when}{'; ' + detail if detail else ''}. A released "
            "checkpoint carries no checksums, so a served shard must not be rewritten or touched: put a new "
            "checkpoint in another folder and reopen"
        )


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a shard as rows: the header it was validated through, its entry, the shard's stamp."""

    header: Header
    entry: TensorEntry
    stamp: FileStamp

    @property
    def row_bytes(self) -> int:
        return self.entry.nbytes // self.entry.shape[0] if self.entry.shape and self.entry.shape[0] else 0

    @property
    def file(self):
        """The shard's `OpenFile` (the descriptor its header was read through)."""
        return self.header.file

    def open(self, direct: bool = False) -> int:
        """A new descriptor of the validated shard (its inode, through the descriptor kept open);
        `integrity.FileChanged` when it changed since its header was read."""
        try:
            fd = self.header.file.reopen(direct)
        except OSError as exc:
            raise integrity.FileChanged(f"cannot be reopened ({exc})") from None
        change = self.stamp.change(fd)
        if change is not None:
            os.close(fd)
            raise integrity.FileChanged(f"changed under this reader: {change} since it was opened")
        return fd


@dataclass(frozen=True)
class ReleasedRows:
    """Where rows [r0, r1) of one layer lie in a released checkpoint, read with ``pread`` and checked.

    The released counterpart of a table file's `RowSource`, with the same interface (`read`,
    `reader`, `slice`), so the tiers, ``convert`` and ``inspect`` read released rows as they
    read a table file's: never through a mapping (a truncated shard is an error, not a
    SIGBUS), the shards' stamps (`FileStamp`) compared before and after each read, and every
    scale checked as it is read (`check_scale_bytes`; float32 scales converted by
    `e8m0_bytes`). Rows and scales may lie in different shards. Rows are served raw:
    interleaved fp8 rows (fp8 bytes, then the row's e8m0 bytes).
    """

    weight: TensorSpan
    scales: TensorSpan
    r0: int
    r1: int
    format: str = "fp8"

    @property
    def path(self) -> Path:
        return self.weight.header.path

    @property
    def num_rows(self) -> int:
        return self.r1 - self.r0

    @property
    def head_dim(self) -> int:
        return self.weight.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.head_dim + self.head_dim // FP8_SCALE_BLOCK

    def slice(self, start: int, stop: int) -> ReleasedRows:
        """Rows [start, stop) of these rows."""
        start, stop, _ = slice(start, stop).indices(self.num_rows)
        return dataclasses.replace(self, r0=self.r0 + start, r1=self.r0 + max(start, stop))

    def scale_bytes(self, raw: torch.Tensor, row_ids: int | torch.Tensor, checked: bool = True) -> torch.Tensor:
        """Scale rows as read (uint8 [n, scale row bytes]) -> uint8 e8m0 bytes [n, d/32], checked; `row_ids`:
        the tensor row of ``raw[0]`` or of each row, for messages."""
        what = f"tensor {self.scales.entry.name} in {self.scales.header.path}"
        if self.scales.entry.dtype == torch.float32:
            return e8m0_bytes(raw.contiguous().view(torch.float32), what, row_ids)
        return check_scale_bytes(raw, what, row_ids) if checked else raw

    def read(
        self,
        out: torch.Tensor,
        start: int = 0,
        threads: int | None = None,
        progress=None,
        checked: bool = True,
        drop_cache: bool = False,
    ) -> None:
        """Rows [start, start + len(out)) into `out` (CPU uint8 [n, row_bytes], interleaved), on `threads` threads.

        Raises `ReleasedCheckpointError` naming the shard: a NaN / inf scale (with its row), a
        shard that changed (size, mtime, ctime, inode) before or while it was read. `checked=False`
        skips the scale checks (float32 scales are still converted); `drop_cache` drops the read
        bytes from the page cache.
        """

        n = out.shape[0]
        check_read_range(out, start, self.num_rows, self.row_bytes)
        if n == 0:
            return
        spans = (self.weight, self.scales)
        fds: dict[Path, int] = {}
        try:
            for span in spans:
                if span.header.path not in fds:
                    try:
                        fds[span.header.path] = span.open()
                    except integrity.FileChanged as exc:
                        raise ReleasedCheckpointError(f"{span.header.path}: {exc}") from None
            d = self.head_dim
            row0 = self.r0 + start

            def job(lo: int, hi: int):
                def run() -> int:
                    parts = []
                    for span in spans:
                        rb, fd = span.row_bytes, fds[span.header.path]
                        buf = np.empty((hi - lo) * rb, np.uint8)
                        a = span.entry.start + (row0 + lo) * rb
                        integrity.pread_into(fd, memoryview(buf), a)
                        if drop_cache:
                            os.posix_fadvise(fd, a, buf.size, os.POSIX_FADV_DONTNEED)
                        parts.append(torch.from_numpy(buf).view(hi - lo, rb))
                    out[lo:hi, :d] = parts[0]
                    out[lo:hi, d:] = self.scale_bytes(parts[1], row0 + lo, checked)
                    return (hi - lo) * self.row_bytes

                return run

            step = max(1, integrity.PIECE_BYTES // max(1, d))
            jobs = [job(r, min(n, r + step)) for r in range(0, n, step)]
            try:
                integrity.parallel(jobs, threads or integrity.default_threads(), progress)
                short = None
            except integrity.FileChanged as exc:  # a shard ended early: its stamp says how it changed
                short = str(exc)
            for span in spans:
                change = span.stamp.change(fds[span.header.path])
                if change is not None:
                    raise ReleasedCheckpointError(span.stamp.error(change, "while it was read"))
            if short is not None:
                shards = sorted({str(span.header.path) for span in spans})
                raise ReleasedCheckpointError(f"{' / '.join(shards)}: {short}")
        finally:
            for fd in fds.values():
                os.close(fd)

    def check_scales(self, into: torch.Tensor | None = None, progress=None) -> int:
        """Read every scale of these rows (``pread``, 1/33 of the table's bytes) and check it, without the rows.

        `into`: uint8 [rows, d/32] that receives the e8m0 bytes (float32 scales converted).
        Returns the scale bytes read; raises `ReleasedCheckpointError` as `read` does.
        """

        span = self.scales
        rb, n = span.row_bytes, self.num_rows
        try:
            fd = span.open()
        except integrity.FileChanged as exc:
            raise ReleasedCheckpointError(f"{span.header.path}: {exc}") from None
        try:
            step, short = max(1, integrity.PIECE_BYTES // max(1, rb)), None
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                buf = np.empty((hi - lo) * rb, np.uint8)
                try:
                    integrity.pread_into(fd, memoryview(buf), span.entry.start + (self.r0 + lo) * rb)
                except integrity.FileChanged as exc:
                    short = str(exc)
                    break
                e = self.scale_bytes(torch.from_numpy(buf).view(hi - lo, rb), self.r0 + lo)
                if into is not None:
                    into[lo:hi] = e
                if progress is not None:
                    progress(hi - lo)
            change = span.stamp.change(fd)
            if change is not None:
                raise ReleasedCheckpointError(span.stamp.error(change, "while it was read"))
            if short is not None:
                raise ReleasedCheckpointError(f"{span.header.path}: {short}")
        finally:
            os.close(fd)
        return n * rb

    def reader(self, direct: bool = False, threads: int = 32) -> dict:
        """The disk tier's row readers: {"weight": ..., "scales": ...}, each a `ReleasedRowReader`."""
        return {
            "weight": ReleasedRowReader(self, "weight", direct, threads),
            "scales": ReleasedRowReader(self, "scales", direct, threads),
        }


class ReleasedRowReader:
    """The disk tier's reads of one released tensor's rows: a `DirectRowReader` (``pread``, nothing
    mapped) with the shard's `FileStamp` compared before and after every batch, and, for the
    scales, every scale of a served row checked (`ReleasedRows.scale_bytes`).

    `read(ids)` returns uint8 [n, head_dim] (rows) or [n, head_dim/32] (e8m0 bytes); a change or a
    bad scale is a `StorageError` naming the shard, and no row of that batch is returned.
    """

    def __init__(self, rows: ReleasedRows, role: str, direct: bool, threads: int):
        from condmem.tables.direct_read import DirectRowReader

        self.rows, self.role = rows, role
        self.span = rows.weight if role == "weight" else rows.scales
        span = self.span
        self.inner = DirectRowReader(
            span.header.path,
            span.entry.start + rows.r0 * span.row_bytes,
            span.row_bytes,
            rows.num_rows,
            threads=threads,
            direct=direct,
            source=span,
        )

    @property
    def num_rows(self) -> int:
        return self.inner.num_rows

    @property
    def threads(self) -> int:
        return self.inner.threads

    def _check(self, when: str) -> None:
        if self.inner.fd < 0:
            raise StorageError(f"{self.span.header.path}: the reader is closed")
        change = self.span.stamp.change(self.inner.fd)
        if change is not None:
            raise StorageError(self.span.stamp.error(change, when))

    def read(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check("since it was opened")
        got = self.inner.read(ids, None if self.role == "scales" else out)
        self._check("while it was read")
        if self.role == "weight":
            return got
        try:
            scales = self.rows.scale_bytes(got, self.rows.r0 + ids.reshape(-1).to(torch.int64), True)
        except ReleasedCheckpointError as exc:
            raise StorageError(f"{exc} (not served)") from None
        if out is None:
            return scales
        out.copy_(scales)
        return out

    def close(self) -> None:
        self.inner.close()


class ReleasedCheckpoint:
    """A released checkpoint opened for its Engram layers: headers parsed, tensors mapped on demand.

    Args:
        path: a checkpoint folder (shards + index, or shards alone) or one safetensors file.
        config: the Engram config, an `EngramConfig` or a JSON path; by default the
            ``config.json`` in the folder (or beside the file).
        config_key: the section of that JSON holding the Engram keys, when it is neither the
            top level nor ``text_config``.
        dialect: tensor naming (``original`` / ``hf``); detected when None.

    Attributes:
        names: the detected `TensorNames`; ``layer_ids``: Engram layers found in the tensors.
        config: the config as read, or None when none was found (`require_config` then
            explains); `module_config()` adds the backbone dims checked against the tensors.

    Raises:
        ReleasedCheckpointError: files missing or inconsistent with the index, no Engram tensors.
        ConfigError: the config cannot be read, or disagrees with the tensors.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: EngramConfig | str | os.PathLike | None = None,
        *,
        config_key: str | None = None,
        dialect: str | None = None,
    ):
        self.path = Path(path)
        self.files, weight_map = checkpoint_files(self.path)
        self.headers: dict[str, Header] = {}
        self.stamps: dict[Path, FileStamp] = {}
        """Each shard as its header was read: its readers compare it before and after every read."""
        for file in self.files:
            header = read_header(file)
            st = os.fstat(header.file.fd)
            if (st.st_size, st.st_mtime_ns) != header.file.stamp:
                raise ReleasedCheckpointError(f"{file} changed while its header was read: open it again")
            self.stamps[file] = FileStamp.of(file, st)
            for name in list(header.tensors) + list(header.other):
                if name in self.headers:
                    raise ReleasedCheckpointError(
                        f"tensor {name} is in two shards: {self.headers[name].path.name} and {file.name}"
                    )
                self.headers[name] = header
        self.names = detect_names(self.headers, str(self.path), dialect)
        if weight_map is not None:
            self._check_index(weight_map)
        self.layer_ids = sorted({int(m["layer"]) for m in map(_ENGRAM_NAME.match, self.headers) if m})
        self.config_path: Path | None = None
        self.config: EngramConfig | None = self._read_config(config, config_key)
        self._backbone: EngramConfig | None = None

    # ------------------------------------------------------------------ structure
    def _check_index(self, weight_map: dict[str, str]) -> None:
        index = self.path / INDEX_FILE
        for name, file in weight_map.items():
            if not _ENGRAM_NAME.match(name):
                continue  # the rest of the model is not ours to vet
            header = self.headers.get(name)
            if header is None:
                raise ReleasedCheckpointError(
                    f"tensor {name} is listed in {index.name} under {file} but {file} does not hold it"
                )
            if header.path.name != Path(file).name:
                raise ReleasedCheckpointError(
                    f"tensor {name} is listed in {index.name} under {file} but lies in {header.path.name}"
                )
        unlisted = [n for n in self.headers if _ENGRAM_NAME.match(n) and n not in weight_map]
        if unlisted:
            raise ReleasedCheckpointError(
                f"tensor {unlisted[0]} lies in {self.headers[unlisted[0]].path.name} but {index.name} does not list it"
            )

    def _read_config(self, config, key: str | None) -> EngramConfig | None:
        if isinstance(config, EngramConfig):
            return config
        if config is not None:
            path = Path(config)
        else:
            path = (self.path if self.path.is_dir() else self.path.parent) / "config.json"
            if not path.exists():
                return None
        self.config_path = path / "config.json" if path.is_dir() else path
        return EngramConfig.load(path, key=key)

    def require_config(self) -> EngramConfig:
        """The config; `ConfigError` when there is none (released checkpoints need one for the layout)."""
        if self.config is None:
            where = self.path if self.path.is_dir() else self.path.parent
            raise ConfigError(
                f"no config.json in {where}: the checkpoint's tensors do not record the hash layout; "
                "pass config= (a config.json or an EngramConfig)"
            )
        return self.config

    def module_config(self) -> EngramConfig:
        """The config with hidden_size / hc_mult checked against the tensors (see `resolve_backbone`)
        and rms_norm_eps required: what an `Engram` module is built from."""
        if self._backbone is None:
            config = self.resolve_backbone(self.require_config())
            if config.rms_norm_eps is None:
                raise ConfigError(
                    f"{self.config_path or 'the config'} states no rms_norm_eps, and no tensor records "
                    "it: pass a config that states it"
                )
            if config.short_conv:
                raise ConfigError(
                    f"{self.config_path or 'the config'}: engram_short_conv is set, but released "
                    "checkpoints carry no ShortConv weights to load"
                )
            self._backbone = config
        return self._backbone

    def layout(self, compressed_vocab_size: int | None = None) -> EngramLayout:
        """The hash layout the config describes (its table row counts checked against the primes)."""
        return EngramLayout(self.require_config(), compressed_vocab_size=compressed_vocab_size)

    def tensor_names(self, layer_id: int) -> dict[str, str]:
        """{role: tensor name} of one layer (roles: embed, embed_scale, wkv, wkv_scale, q_weight, k_weight)."""
        return self.names.layer(layer_id)

    def where(self, name: str) -> str:
        """The file holding tensor `name` (for messages)."""
        header = self.headers.get(name)
        return str(header.path) if header is not None else str(self.path)

    def entry(self, name: str) -> TensorEntry:
        """The header entry of tensor `name`; errors name it and the checkpoint."""
        header = self.headers.get(name)
        if header is None:
            layer = _ENGRAM_NAME.match(name)
            ours = self.tensor_names(int(layer["layer"])) if layer else {}
            hint = (
                f" (this checkpoint names its Engram tensors like {ours['embed']})"
                if layer and name not in ours.values()
                else ""
            )
            raise ReleasedCheckpointError(f"tensor {name} not found in {self.path}{hint}")
        if name in header.other:
            raise ReleasedCheckpointError(
                f"tensor {name} in {header.path} is {header.other[name]}, a dtype torch cannot read"
            )
        return header.tensors[name]

    def _check_entry(
        self, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None, what: str
    ) -> TensorEntry:
        entry = self.entry(name)
        if entry.dtype not in dtypes:
            raise ReleasedCheckpointError(
                f"tensor {name} in {self.where(name)} is {entry.dtype}; {what} must be "
                f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}"
            )
        if shape is not None and entry.shape != tuple(shape):
            raise ReleasedCheckpointError(
                f"tensor {name} in {self.where(name)} is {list(entry.shape)}; {what} must be {list(shape)}"
            )
        return entry

    # ------------------------------------------------------------------ validation
    def check_tensor(
        self, layer_id: int, role: str, layout: EngramLayout | None = None, backbone: EngramConfig | None = None
    ) -> TensorEntry:
        """One Engram tensor's header entry, after checking its presence, dtype and shape.

        This is the one place that decides whether a tensor is loadable: the loaders call it
        before mapping, `validate` calls it for every tensor. Shapes are checked as far as
        the arguments allow: `layout` gives the table's rows (the sum of the layer's primes)
        and head_dim (else the checkpoint's config, when it has one); `backbone` (a config
        with hidden_size / hc_mult, see `module_config`) gives wkv's and q/k's shapes and
        wkv's block divisibility. Raises `ReleasedCheckpointError` / `TableMismatchError`
        naming the tensor, its file, the shape found and the shape expected.
        """
        name = self.tensor_names(layer_id)[role]
        dtypes, what = _ROLE_DTYPES[role]
        where = self.where(name)
        geometry = layout.config if layout is not None else self.config
        if role in ("embed", "embed_scale"):
            entry = self._check_entry(name, dtypes, None, what)
            if geometry is None:
                return entry
            d = geometry.head_dim
            if role == "embed":
                if len(entry.shape) != 2 or entry.shape[1] != d:
                    raise ReleasedCheckpointError(
                        f"tensor {name} in {where} is {list(entry.shape)}; table rows must be [rows, head_dim={d}]"
                    )
                num_rows = layout.layer(layer_id).num_embeddings if layout is not None else None
                if num_rows is not None and entry.shape[0] != num_rows:
                    raise TableMismatchError(
                        f"tensor {name} in {where} has {entry.shape[0]:,} rows but layer {layer_id} of this layout "
                        f"has {num_rows:,} (sum of its primes): the config's geometry does not match the checkpoint"
                    )
                return entry
            if layout is not None:
                return self._check_entry(
                    name, dtypes, (layout.layer(layer_id).num_embeddings, d // FP8_SCALE_BLOCK), what
                )
            if len(entry.shape) != 2 or entry.shape[1] != d // FP8_SCALE_BLOCK:
                raise ReleasedCheckpointError(
                    f"tensor {name} in {where} is {list(entry.shape)}; {what} must be [rows, {d // FP8_SCALE_BLOCK}]"
                )
            return entry
        if backbone is None:
            return self._check_entry(name, dtypes, None, what)
        c = backbone
        wkv_shape = ((c.hc_mult + 1) * c.hidden_size, c.engram_dim)
        if role == "wkv":
            return self._check_entry(
                name,
                dtypes,
                wkv_shape,
                f"wkv ([(hc_mult+1)*hidden_size, n_cols*head_dim] = "
                f"[({c.hc_mult}+1)*{c.hidden_size}, {c.n_cols}*{c.head_dim}])",
            )
        if role == "wkv_scale":
            entry = self._check_entry(name, dtypes, None, what)
            try:
                block_shape(wkv_shape, tuple(entry.shape), what=f"tensor {self.tensor_names(layer_id)['wkv']}")
            except BlockFp8Error as exc:
                raise ReleasedCheckpointError(f"{exc} (scales: tensor {name}) in {where}") from None
            return entry
        return self._check_entry(name, dtypes, (c.hc_mult, c.hidden_size), what)

    def validate(self, layer_ids: list[int] | None = None) -> list[CheckpointProblem]:
        """Every problem the loaders would raise for this checkpoint, collected instead of raised.

        Checks the config (present, readable, its layout valid, hidden_size / hc_mult against
        the first layer's q_weight, rms_norm_eps stated, no ShortConv), then every tensor of
        each layer (`check_tensor`, from the headers: nothing is read). `layer_ids`: the
        layers to check (default: the config's, else those found in the tensors). Warnings:
        Engram tensors of layers the config does not list, float32 table scales (converted
        in memory on load). An empty list of errors means `Engram.from_released` and
        `EngramMemory.from_released` accept every checked layer as far as headers tell (a
        float32 table scale that is not a power of two shows only when its values are read).
        """
        problems: list[CheckpointProblem] = []
        seen: set[str] = set()

        def attempt(fn, tensor: str | None = None, layer_id: int | None = None):
            try:
                return fn()
            except ValueError as exc:
                if str(exc) not in seen:  # a backbone error on the first q_weight is also that tensor's error
                    seen.add(str(exc))
                    problems.append(CheckpointProblem("error", str(exc), tensor, layer_id))
                return None

        layout = backbone = None
        if self.config is None:
            attempt(self.require_config)
        else:
            layout = attempt(self.layout)
            first_q = self.tensor_names(self.config.layer_ids[0])["q_weight"]
            first_q = first_q if first_q in self.headers else None
            # Shapes need only hidden_size / hc_mult; module_config adds what the module needs besides.
            backbone = attempt(lambda: self.resolve_backbone(self.config), first_q)
            attempt(self.module_config, first_q)
        if layer_ids is None:
            layer_ids = self.config.layer_ids if self.config is not None else self.layer_ids
        for lid in layer_ids:
            names = self.tensor_names(lid)
            for role in ROLES:
                entry = attempt(
                    lambda lid=lid, role=role: self.check_tensor(lid, role, layout, backbone), names[role], lid
                )
                if role == "embed_scale" and entry is not None and entry.dtype == torch.float32:
                    problems.append(
                        CheckpointProblem(
                            "warning",
                            f"tensor {names[role]} in {self.where(names[role])}: float32 scales, converted to "
                            "e8m0 bytes in memory on load (each must be a power of two)",
                            names[role],
                            lid,
                        )
                    )
        if self.config is not None:
            for lid in sorted(set(self.layer_ids) - set(self.config.layer_ids)):
                problems.append(
                    CheckpointProblem(
                        "warning",
                        f"the tensors hold Engram layer {lid}, which {self.config_path or 'the config'} does "
                        f"not list (its Engram layers: {self.config.layer_ids}): it is not loaded",
                        None,
                        lid,
                    )
                )
        return problems

    # ------------------------------------------------------------------ backbone dims
    def resolve_backbone(self, config: EngramConfig) -> EngramConfig:
        """`config` with hidden_size / hc_mult checked against (or, where None, taken from) the tensors.

        The first Engram layer's ``q_weight`` [hc, D] gives them. A disagreement is a
        `ConfigError` naming the config file, the tensor and both values.
        """
        lid = config.layer_ids[0]
        name = self.tensor_names(lid)["q_weight"]
        entry = self.entry(name)
        if len(entry.shape) != 2:
            raise ReleasedCheckpointError(
                f"tensor {name} in {self.where(name)} is {list(entry.shape)}; q_weight must "
                "be 2-D [hc_mult, hidden_size]"
            )
        hc, dim = entry.shape
        source = self.config_path or "the config"
        changes = {}
        for field, stated, found in (("hc_mult", config.hc_mult, hc), ("hidden_size", config.hidden_size, dim)):
            if stated is None:
                log.info("%s states no %s: taking %d from %s", source, field, found, name)
                changes[field] = found
            elif stated != found:
                raise ConfigError(
                    f"{source} says {field} = {stated} but tensor {name} in {self.where(name)} is "
                    f"{list(entry.shape)} ([hc_mult, hidden_size]), i.e. {field} = {found}"
                )
        return dataclasses.replace(config, **changes) if changes else config

    # ------------------------------------------------------------------ tensors
    def table(self, layer_id: int, layout: EngramLayout | None = None) -> LayerRows:
        """One layer's table as fp8 rows + uint8 e8m0 scales, memory-mapped where they lie.

        Row count checked against the layout (the sum of the layer's primes). float32
        scales are converted to exponent bytes in memory (1/33 of the table's bytes).
        """
        layout = layout or self.layout()
        names = self.tensor_names(layer_id)
        w_name, s_name = names["embed"], names["embed_scale"]
        self.check_tensor(layer_id, "embed", layout)
        self.check_tensor(layer_id, "embed_scale", layout)
        return self._layer_rows(w_name, s_name)

    def _layer_rows(self, w_name: str, s_name: str) -> LayerRows:
        """Rows `w_name` and scales `s_name` (checked) as `LayerRows` whose `source` the tiers read them through.

        ``weight`` and ``scales`` are views of the shards' mappings (for tools that look at a few
        rows); the tiers, ``convert`` and ``inspect`` read `source` (`ReleasedRows`): ``pread``,
        stamps compared, scales checked. float32 scales are converted to e8m0 bytes here, all of
        them (1/33 of the table's bytes), read with ``pread`` too.
        """
        weight = mmap_tensor(self.headers[w_name], w_name)
        s_header = self.headers[s_name]
        source = ReleasedRows(
            TensorSpan(
                self.headers[w_name], self.headers[w_name].tensors[w_name], self.stamps[self.headers[w_name].path]
            ),
            TensorSpan(s_header, s_header.tensors[s_name], self.stamps[s_header.path]),
            0,
            weight.shape[0],
        )
        if s_header.tensors[s_name].dtype == torch.float32:
            log.warning(
                "%s in %s: float32 scales, converted to e8m0 bytes in memory (%.2f GiB)",
                s_name,
                self.where(s_name),
                s_header.tensors[s_name].nbytes / 4 / 2**30,
            )
            scales = torch.empty((source.num_rows, source.head_dim // FP8_SCALE_BLOCK), dtype=torch.uint8)
            source.check_scales(into=scales)
        else:
            scales = e8m0_bytes(mmap_tensor(s_header, s_name), f"tensor {s_name} in {self.where(s_name)}")
        return LayerRows("fp8", weight, scales, source)

    def tables(self, layout: EngramLayout | None = None) -> dict[int, LayerRows]:
        """Every layout layer's table (see `table`)."""
        layout = layout or self.layout()
        return {lid: self.table(lid, layout) for lid in layout.layer_ids}

    def wkv_fp8(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """(fp8 weight [(hc+1)*D, n_cols*head_dim], its block scales as mapped, block shape).

        The block scales (a few KiB) are read and checked: a NaN or inf one (e8m0 byte 0xFF) would
        turn its whole block of ``wkv`` into NaN, and is a `ReleasedCheckpointError` naming it."""
        config = self.resolve_backbone(self.require_config())
        names = self.tensor_names(layer_id)
        w_name, s_name = names["wkv"], names["wkv_scale"]
        self.check_tensor(layer_id, "wkv", backbone=config)
        self.check_tensor(layer_id, "wkv_scale", backbone=config)
        weight, scales = mmap_tensor(self.headers[w_name], w_name), mmap_tensor(self.headers[s_name], s_name)
        floats = scales.dtype in (torch.float32, torch.bfloat16)
        bad = ~torch.isfinite(scales) if floats else scales.view(torch.uint8) == 255
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ReleasedCheckpointError(
                f"tensor {s_name} in {self.where(s_name)}: block scale [{i}, {j}] is "
                f"{float(scales[i, j]) if floats else 'byte 0xFF, e8m0' + chr(39) + 's NaN'}: its block of wkv "
                "would be NaN; refused"
            )
        return weight, scales, block_shape(tuple(weight.shape), tuple(scales.shape))

    def wkv(self, layer_id: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """wkv dequantized block by block to `dtype` ([(hc+1)*D, n_cols*head_dim])."""
        weight, scales, _ = self.wkv_fp8(layer_id)
        return dequantize_block_fp8(weight, scales, dtype)

    def gate_weights(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_weight, k_weight), each [hc, D] as stored (mapped)."""
        config = self.resolve_backbone(self.require_config())
        names = self.tensor_names(layer_id)
        for role in ("q_weight", "k_weight"):
            self.check_tensor(layer_id, role, backbone=config)
        return tuple(
            mmap_tensor(self.headers[names[k]], names[k])  # type: ignore[return-value]
            for k in ("q_weight", "k_weight")
        )

    def __repr__(self) -> str:
        return (
            f"ReleasedCheckpoint({str(self.path)!r}, {len(self.files)} file(s), names={self.names.dialect}"
            f"{' prefix ' + repr(self.names.prefix) if self.names.prefix else ''}, engram layers={self.layer_ids})"
        )


def open_checkpoint(checkpoint, **kwargs) -> ReleasedCheckpoint:
    """`checkpoint` itself when it is already a `ReleasedCheckpoint`, else a new one opened from a path."""
    return checkpoint if isinstance(checkpoint, ReleasedCheckpoint) else ReleasedCheckpoint(checkpoint, **kwargs)


def load_released_tables(
    source,
    layout: EngramLayout,
    weight_name: str | None = None,
    scale_name: str | None = None,
    dialect: str | None = None,
) -> dict[int, LayerRows]:
    """Memory-map every layout layer's fp8 rows and e8m0 scales from a released checkpoint.

    Args:
        source: a checkpoint folder or file (or an open `ReleasedCheckpoint`).
        layout: the layout the tables must match (row count per layer).
        weight_name, scale_name: name templates with ``{layer_id}`` overriding the detected
            names (e.g. ``"layers.{layer_id}.engram.embed.weight"``).
        dialect: ``original`` / ``hf``, overriding detection.

    Returns:
        {layer_id: LayerRows("fp8", weight, uint8 scales)}.
    """
    ckpt = open_checkpoint(source, config=layout.config, dialect=dialect)
    if weight_name is None and scale_name is None:
        return ckpt.tables(layout)
    tables = {}
    for layer in layout.layers:
        names = ckpt.tensor_names(layer.layer_id)
        w = weight_name.format(layer_id=layer.layer_id) if weight_name else names["embed"]
        s = scale_name.format(layer_id=layer.layer_id) if scale_name else names["embed_scale"]
        d = layout.config.head_dim
        ckpt._check_entry(w, (torch.float8_e4m3fn,), (layer.num_embeddings, d), "table rows [rows, head_dim]")
        ckpt._check_entry(s, _SCALE_DTYPES, (layer.num_embeddings, d // FP8_SCALE_BLOCK), "the table's scales")
        tables[layer.layer_id] = ckpt._layer_rows(w, s)
    return tables
