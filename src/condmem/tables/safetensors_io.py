"""Streaming writes and zero-copy memory maps of safetensors files, for tables larger than DRAM.

The `safetensors` library writes a file from tensors that are all in memory at once
and reads through its own handles; a 190 GiB Engram table needs neither. The format
is simple and fixed (8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes), so this module:

* `StreamingWriter` writes the header first and then each tensor's bytes in chunks
  through an atomic temp file: memory stays bounded by one chunk;
* `read_header` maps the whole file read-only once and parses and validates its header
  from that mapping (truncated or foreign files get a clear `TableFileError`, never a
  garbage tensor); tensors of dtypes torch cannot hold (a model shard may carry some
  beside the Engram tensors) are listed, not refused. It keeps the descriptor open
  (`OpenFile`): the tiers read rows through it with ``pread`` (`condmem.tables.integrity`),
  from the inode that was validated even after a rename over its path, and a size or
  mtime change under them is an error;
* `mmap_tensor` views one tensor's bytes in that same mapping as a torch tensor (no
  copy), for tools that read a tensor once (inspection); serving never reads the mapping,
  whose pages past a truncation would kill the process with SIGBUS;
  `release_pages` lets a streaming reader give mapped pages back.

The writer also records the checksums of every tensor (`condmem.tables.integrity`).

Files written here are ordinary safetensors files: `safetensors.safe_open` reads them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from condmem.utils.atomic import atomic_path

# safetensors dtype names <-> torch dtypes (the subset Engram tables use, plus common ones).
DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
for _name, _attr in (
    ("F8_E8M0", "float8_e8m0fnu"),  # how some checkpoints type their ue8m0 scales
    ("F8_E5M2", "float8_e5m2"),
    ("F64", "float64"),
    ("I16", "int16"),
    ("BOOL", "bool"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own bound


class TableFileError(ValueError):
    """A table file is missing, truncated, not safetensors, or not of the expected layout."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the first element in the file."""
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header."""

    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    file_size: int
    other: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tensors of a dtype torch cannot map (name -> safetensors dtype name): listed, never read."""
    mapping: Any = dataclasses.field(default=None, compare=False, repr=False)
    """A read-only mmap of the whole file, made from the descriptor the header was read through."""
    raw_tensors: dict[str, tuple[str, list[int], int, int]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    """Each tensor's header entry as written: (dtype name, shape, begin, end)."""
    identity: tuple[int, int] | None = dataclasses.field(default=None, compare=False)
    """(st_dev, st_ino) of the file that was validated: a reader that opens it again checks it."""
    file: OpenFile | None = dataclasses.field(default=None, compare=False, repr=False)
    """The descriptor the header was read through, kept open: readers reopen this very file (`OpenFile.reopen`)."""


class OpenFile:
    """The descriptor a file was validated through, kept open until this object goes.

    Readers reopen this very file (`reopen`: its inode, even after another file was renamed
    over the path) and compare its size and modification time with the ones recorded here
    (`changed`): a file rewritten in place (``cp`` over it, ``rsync --inplace``, ``truncate``)
    is then an error, never new rows.
    """

    def __init__(self, fd: int, path: Path, st: os.stat_result):
        self.fd, self.path = fd, path
        self.identity = (st.st_dev, st.st_ino)
        self.stamp = (st.st_size, st.st_mtime_ns)

    def reopen(self, direct: bool = False) -> int:
        """A new read-only descriptor of the same file (``O_DIRECT`` when `direct`); raises OSError."""
        if self.fd < 0:
            raise OSError(f"{self.path} was closed")
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(f"/proc/self/fd/{self.fd}", flags)  # the inode itself, whatever the path holds now
        except FileNotFoundError:
            fd = os.open(self.path, flags)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise OSError(f"{self.path} is no longer the file that was validated (replaced since it was opened)")
        return fd

    def changed(self, fd: int) -> str | None:
        """How the file under `fd` differs from when it was validated (size, mtime), or None."""
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) == self.stamp:
            return None
        if st.st_size != self.stamp[0]:
            return f"its size went from {self.stamp[0]:,} to {st.st_size:,} bytes"
        return "it was modified (its mtime moved)"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _map_file(path: Path) -> tuple[mmap.mmap, OpenFile]:
    """A read-only mapping of the whole regular file at `path`, and its descriptor (kept open for checked reads)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise TableFileError(f"table file not found: {path}") from None
    except OSError as exc:
        raise TableFileError(f"{path}: cannot be opened ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TableFileError(f"{path} is not a regular file")
        if st.st_size < 8:
            raise TableFileError(f"{path}: {st.st_size} bytes is too short to be a safetensors file")
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    except OSError as exc:
        os.close(fd)
        raise TableFileError(f"{path}: cannot be mapped ({exc.strerror or exc})") from None
    except BaseException:
        os.close(fd)
        raise
    return mm, OpenFile(fd, path, st)


def read_header(path: str | os.PathLike) -> Header:
    """Map a safetensors file and parse and validate its header (no tensor bytes are read)."""
    path = Path(path)
    mm, file = _map_file(path)
    size = len(mm)
    (n,) = struct.unpack("<Q", mm[:8])
    if n > _MAX_HEADER or 8 + n > size:
        raise TableFileError(
            f"{path}: header length {n} does not fit a {size}-byte file: not safetensors, or truncated"
        )
    raw = mm[8 : 8 + n]
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, TableFileError) as exc:
        raise TableFileError(f"{path}: header is not JSON ({exc}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise TableFileError(f"{path}: header is not a JSON object: not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TableFileError(f"{path}: header metadata is not a str -> str map")
    data_start = 8 + n
    tensors = {}
    raw_tensors = {}
    other = {}
    for name, info in header.items():
        if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in DTYPES:
            other[name] = info["dtype"]
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if begin < 0 or any(s < 0 for s in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TableFileError(f"{path}: tensor {name!r} has an unsupported or malformed entry {info}") from None
        expect = math.prod(shape) * _itemsize(dtype)
        if end - begin != expect:
            raise TableFileError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but {shape} x {dtype} needs {expect}"
            )
        if data_start + end > size:
            raise TableFileError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes: truncated, "
                "incomplete (an interrupted write, copy or download?)"
            )
        tensors[name] = TensorEntry(name, dtype, shape, data_start + begin, expect)
        raw_tensors[name] = (info["dtype"], list(shape), begin, end)
    return Header(
        path,
        dict(metadata),
        tensors,
        size,
        other,
        mapping=mm,
        raw_tensors=raw_tensors,
        identity=file.identity,
        file=file,
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two entries under one name: which one a reader takes is up to the reader.
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise TableFileError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def mmap_tensor(header: Header, name: str) -> torch.Tensor:
    """View one tensor of a safetensors file as a torch tensor without reading it.

    The view lies in the header's own mapping of the file (never a re-open by path).
    Pages are read from disk on first touch (and kept in the page cache by the OS).
    """
    if name in header.other:
        raise TableFileError(f"{header.path}: tensor {name!r} is {header.other[name]}, a dtype torch cannot map")
    if name not in header.tensors:
        raise TableFileError(f"{header.path}: no tensor {name!r}; it holds {sorted(header.tensors)[:20]}")
    entry = header.tensors[name]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    import warnings

    with warnings.catch_warnings():
        # A read-only map: torch warns that it cannot protect it; we never write through it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(header.mapping, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)
    return flat.view(entry.dtype).view(entry.shape)


def release_pages(t: torch.Tensor, drop_cache: bool = False) -> None:
    """Unmap the resident pages under `t`, a view of a read-only file mapping (`mmap_tensor`).

    A streaming reader calls this after each chunk so that its resident set stays bounded
    by one chunk: pages of a file mapping count towards RSS until unmapped. The data stays
    in the file; touching `t` again reads it back. With `drop_cache`, the file's cached
    pages for those bytes are dropped too (a loader that copied them elsewhere: the kernel
    keeps pages in the cache while they are mapped, so unmapping comes first). Only whole
    pages inside `t` are released, and only when they lie in a shared file mapping (on
    anonymous memory MADV_DONTNEED would zero the data, so anything else is left alone).
    A no-op where madvise is unavailable.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or t.device.type != "cpu" or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    begin = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    where = _shared_file_mapping(begin, end) if end > begin else None
    if where is None:
        return
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), ctypes.c_int(advice))
    except (OSError, AttributeError):
        return
    if drop_cache:
        path, file_offset = where
        drop_page_cache(path, file_offset, end - begin)


def drop_page_cache(path: str | os.PathLike, offset: int = 0, length: int = 0) -> None:
    """Drop the cached pages of `path`'s bytes [offset, offset+length) (``POSIX_FADV_DONTNEED``;
    length 0: to the end). Clean pages that no process maps are dropped; a no-op where
    posix_fadvise is unavailable."""
    advice = getattr(os, "POSIX_FADV_DONTNEED", None)
    if advice is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:
        pass
    finally:
        os.close(fd)


def _shared_file_mapping(begin: int, end: int) -> tuple[str, int] | None:
    """(file path, file offset of `begin`) when [begin, end) lies inside one shared file mapping, else None."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= begin and end <= hi:
                    # perms like "r--s": shared; inode (field 5) non-zero and a path: a file.
                    if parts[1][3] != "s" or parts[4] == "0" or len(parts) < 6:
                        return None
                    return parts[5].strip(), int(parts[2], 16) + (begin - lo)
    except (OSError, ValueError, IndexError):
        return None
    return None


class StreamingWriter:
    """Write a safetensors file chunk by chunk, atomically; memory stays bounded by one chunk.

    Each tensor has its own cursor, so chunks of different tensors may interleave (an fp8
    table's rows and scales are written from the same pass over the source). Every tensor's
    bytes are checksummed as they pass (`condmem.tables.integrity`), and the record goes into
    the header (metadata key ``integrity``) when the last byte is in:

    * with `block_bytes` (table files): a CRC32C per block of the file's grid, stored in a
      companion tensor ``<name>.crc32c`` after the data; the header is padded so the data
      starts on a block edge;
    * without: a sha256 per `integrity_chunk_bytes` of each tensor (chunk digests).

    Args:
        path: destination; written through a temp file renamed into place on `close()`.
        specs: {name: (dtype, shape)}.
        metadata: str -> str, stored in the header.
        integrity_chunk_bytes: bytes covered by one recorded sha256 (chunk digests).
        block_bytes: bytes covered by one recorded CRC32C (a multiple of 4096), or None.

    Example:
        >>> with StreamingWriter(path, {"t": (torch.uint8, (rows, 264))}, {"k": "v"}, block_bytes=4096) as w:
        ...     for chunk in chunks: w.write("t", chunk)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        integrity_chunk_bytes: int | None = None,
        block_bytes: int | None = None,
    ):
        from condmem.tables import integrity  # it reads headers parsed here

        self.path = Path(path)
        if block_bytes is not None and (block_bytes <= 0 or block_bytes % integrity.BLOCK_BYTES):
            raise TableFileError(
                f"block_bytes must be a positive multiple of {integrity.BLOCK_BYTES}, got {block_bytes}"
            )
        chunk_bytes = integrity_chunk_bytes or integrity.DEFAULT_CHUNK_BYTES
        metadata = dict(metadata or {})
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TableFileError(f"safetensors metadata must be str -> str; bad keys {bad}")
        offset = 0
        self._span: dict[str, tuple[int, int]] = {}
        self._sums_span: dict[str, tuple[str, int, int]] = {}  # data tensor -> (companion, begin, nbytes)
        entries: dict[str, Any] = {}
        for name, (dtype, shape) in specs.items():
            if dtype not in DTYPE_NAMES:
                raise TableFileError(f"tensor {name!r}: dtype {dtype} cannot be stored")
            if block_bytes is not None and name.endswith(integrity.SUMS_SUFFIX):
                raise TableFileError(f"tensor {name!r}: names ending in {integrity.SUMS_SUFFIX} hold block CRCs")
            nbytes = math.prod(shape) * _itemsize(dtype)
            entries[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._span[name] = (offset, nbytes)
            offset += nbytes
        if block_bytes is not None:
            # The data starts on a block edge (the header is padded to one), so a tensor's blocks follow from
            # its offset in the data alone.
            for name, (begin, nbytes) in list(self._span.items()):
                companion = integrity.sums_name(name)
                count = integrity.n_blocks(begin, nbytes, block_bytes)
                entries[companion] = {"dtype": "I32", "shape": [count], "data_offsets": [offset, offset + 4 * count]}
                self._sums_span[name] = (companion, offset, 4 * count)
                offset += 4 * count
        digest = integrity.header_digest(
            metadata, {n: (e["dtype"], e["shape"], *e["data_offsets"]) for n, e in entries.items()}
        )
        if block_bytes is None:
            self._record = integrity.placeholder_digests(
                {n: b for n, (_, b) in self._span.items()}, chunk_bytes, digest
            )
        else:
            self._record = integrity.placeholder_crcs(self._span, block_bytes, digest)
        self._align = block_bytes or 8  # the library pads the header to 8-byte alignment
        self._metadata = metadata
        self._entries = entries
        raw = self._header_bytes()
        self._header_len = len(raw)
        self._data_start = 8 + len(raw)
        if block_bytes is None:
            self._hashers = {name: integrity.ChunkHasher(chunk_bytes) for name in self._span}
        else:
            self._hashers = {
                name: integrity.BlockSummer(self._data_start + begin, nbytes, block_bytes)
                for name, (begin, nbytes) in self._span.items()
            }
        self._ctx = atomic_path(self.path)
        self._tmp = self._ctx.__enter__()
        try:
            self._fh = open(self._tmp, "wb")
            self._fh.write(struct.pack("<Q", len(raw)))
            self._fh.write(raw)
            self._fh.truncate(self._data_start + offset)  # sparse until written
        except BaseException as exc:
            self._ctx.__exit__(type(exc), exc, None)
            raise
        self._cursor = {name: 0 for name in self._span}
        self._closed = False

    def _header_bytes(self) -> bytes:
        from condmem.tables import integrity

        header: dict[str, Any] = {"__metadata__": {**self._metadata, integrity.KEY: integrity.encode(self._record)}}
        header.update(self._entries)
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-(8 + len(raw)) % self._align)

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next bytes (rows, in order) of tensor `name`."""
        if name not in self._span:
            raise TableFileError(f"write({name!r}): not a declared tensor ({sorted(self._span)})")
        begin, nbytes = self._span[name]
        data = chunk.detach().contiguous().cpu().view(torch.uint8).numpy() if chunk.numel() else np.empty(0, np.uint8)
        done = self._cursor[name]
        if done + data.nbytes > nbytes:
            raise TableFileError(f"tensor {name!r}: {done + data.nbytes} bytes written, only {nbytes} declared")
        self._fh.seek(self._data_start + begin + done)
        self._fh.write(data)  # numpy exposes its buffer: no copy
        self._hashers[name].update(data)
        self._cursor[name] = done + data.nbytes

    def close(self) -> None:
        """Check that every byte of every tensor was written, record the checksums, then move the file into place."""
        if self._closed:
            return
        self._closed = True
        short = [(n, self._cursor[n], size) for n, (_, size) in self._span.items() if self._cursor[n] != size]
        if short:
            self._fh.close()
            name, done, size = short[0]
            exc = TableFileError(
                f"tensor {name!r} incomplete: {done} of {size} bytes written; nothing was written to {self.path}"
            )
            self._ctx.__exit__(type(exc), exc, None)
            raise exc
        try:
            if self._sums_span:
                for name, (companion, begin, nbytes) in self._sums_span.items():
                    sums = self._hashers[name].finish().astype("<u4")
                    assert sums.nbytes == nbytes, "one CRC per block"
                    self._fh.seek(self._data_start + begin)
                    self._fh.write(sums.tobytes())
                    self._record["sums_sha256"][companion] = hashlib.sha256(sums.tobytes()).hexdigest()
            else:
                self._record["tensors"] = {n: h.finish() for n, h in self._hashers.items()}
            raw = self._header_bytes()
            assert len(raw) == self._header_len, "digests have a fixed length"
            self._fh.seek(8)
            self._fh.write(raw)
            self._fh.close()
        except BaseException as exc:
            self._fh.close()
            self._ctx.__exit__(type(exc), exc, None)
            raise
        self._ctx.__exit__(None, None, None)

    def abort(self) -> None:
        """Drop the temp file; the destination is left untouched."""
        if not self._closed:
            self._closed = True
            self._fh.close()
            exc = RuntimeError("aborted")
            self._ctx.__exit__(type(exc), exc, None)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
