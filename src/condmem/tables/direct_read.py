"""Rows read from a table file with ``pread`` (``O_DIRECT`` or through the page cache), every block checked.

The disk tier's reads. Each row costs the aligned blocks that hold it, read by `threads`
native threads at once (the disk's queue depth) into buffers of their own; repeated ids in
a batch are read once. With ``O_DIRECT`` (`direct`) the page cache is never filled: what to
keep in DRAM is the caller's choice (a `RowCache` in front, `LayerStore.with_dram_cache`),
bounded and predictable; without it the kernel caches what was read (``POSIX_FADV_RANDOM``:
no read-around, which would turn each cold row into ~100 KiB of reads).

What it serves has been checked (`condmem.tables.integrity`):

* with block CRCs, every 4 KiB block a row touches is read whole and its CRC32C compared
  before the row is copied out (a CRC per block: a small part of a cold read of it);
* with the chunk digests of older files, each chunk is read whole and hashed at its first
  read (a one-time cost per chunk), and the reader remembers it;
* before every batch the file's size and mtime are compared with the ones it had when it was
  validated (one ``fstat``): a file rewritten in place (``cp`` over it, ``rsync --inplace``,
  ``truncate``) is a `StorageError` naming the file, and so is a read that ends early or a
  block that no longer matches, never new rows; nothing is memory-mapped, so a truncated
  file cannot kill the process with SIGBUS. A new mtime alone (``touch``) is not a change of
  rows: with block CRCs every block read is still compared with the validated file's, and
  chunk digests are checked again from the next read on; only a file read unchecked is
  refused for it.

The file is the validated one: a `RowSource` reopens the very inode it validated; a path
given alone is checked against `identity` (device and inode).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from condmem.native import pread_rows as native_pread_rows
from condmem.tables import integrity
from condmem.tables.errors import StorageError

BLOCK = 4096


class DirectRowReader:
    """Random rows of one tensor of a file, read with ``pread`` and checked.

    Thread-safe: `read` may run on several threads at once (each call reads into buffers of its
    own; a chunk digest checked by two at once is only checked twice); `close()` only after them.

    Args:
        path: the file (reopened through `source` when given).
        offset: byte offset of row 0 in the file.
        row_bytes: bytes per row.
        num_rows: rows in the tensor (or in this shard of it).
        threads: reads in flight (native threads).
        identity: (st_dev, st_ino) the file must have (e.g. ``Header.identity``), when opened by path.
        direct: ``O_DIRECT`` reads (no page cache); else buffered reads advised ``POSIX_FADV_RANDOM``.
        source: the `RowSource` these rows come from: the validated file is reopened through it,
            and its size and mtime are watched.
        checks: the tensor's recorded checksums (`TensorChecks`); None reads unchecked.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        offset: int,
        row_bytes: int,
        num_rows: int,
        *,
        threads: int = 32,
        identity: tuple[int, int] | None = None,
        direct: bool = True,
        source=None,
        checks: integrity.TensorChecks | None = None,
    ):
        self.path, self.offset, self.row_bytes, self.num_rows, self.threads = path, offset, row_bytes, num_rows, threads
        self.direct, self.checks, self._file = direct, checks, None if source is None else source.file
        self.fd = -1
        try:
            if source is not None:
                self.fd = source.open(direct)
            else:
                self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0) | getattr(os, "O_CLOEXEC", 0))
        except integrity.FileChanged as exc:
            raise StorageError(f"{path}: {exc}") from None
        except OSError as exc:
            if direct:
                raise StorageError(
                    f"{path}: cannot be opened with O_DIRECT ({exc.strerror or exc}); this file system "
                    "may not support direct reads: use the buffered disk tier (direct_io=False)"
                ) from None
            raise StorageError(f"{path}: cannot be opened ({exc.strerror or exc})") from None
        st = os.fstat(self.fd)
        self._stamp = self._opened = (st.st_size, st.st_mtime_ns)
        if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
            self.close()
            raise StorageError(f"{path} is no longer the file that was validated (replaced since it was opened)")
        if offset + row_bytes * num_rows > st.st_size:
            self.close()
            raise StorageError(
                f"{path}: {num_rows:,} rows of {row_bytes} B at offset {offset:,} run past its {st.st_size:,} bytes"
            )
        if not direct and hasattr(os, "POSIX_FADV_RANDOM"):
            os.posix_fadvise(self.fd, offset, row_bytes * num_rows, os.POSIX_FADV_RANDOM)
        self._crcs = None
        self._verified = None
        if checks is not None and checks.crcs is not None:
            self._crcs = torch.from_numpy(np.ascontiguousarray(checks.crcs, np.uint32).view(np.int32))
        elif checks is not None:
            self._verified = np.zeros(checks.count, dtype=bool)

    def read(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [n, row_bytes] rows of int64 `ids` [n] (CPU), each distinct id read once, every block checked.

        Raises:
            StorageError: an id outside the table; the file changed since it was validated (size,
                mtime, a short read, a block that no longer matches its CRC); a failed read.
        """
        if self.fd < 0:
            raise StorageError(f"{self.path}: the reader is closed")
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise StorageError(f"row id {bad} outside the table's 0..{self.num_rows - 1}")
        if out is None:
            out = torch.empty(ids.numel(), self.row_bytes, dtype=torch.uint8)
        if ids.numel() == 0:
            return out
        self._check_unchanged()
        unique, inverse = torch.unique(ids, return_inverse=True)
        unique = unique.contiguous()
        rows = torch.empty(unique.numel(), self.row_bytes, dtype=torch.uint8)
        if self._verified is not None:
            self._verify_chunks(unique)
        c = self.checks
        bad = torch.zeros(2, dtype=torch.int64)  # per call: readers may be shared by threads
        threads = max(1, min(self.threads, -(-unique.numel() // 8)))  # the native loop hands out 8 ids at a time
        if self._crcs is not None:
            rc = native_pread_rows(
                self.fd,
                self.offset,
                self.row_bytes,
                unique,
                rows,
                threads,
                self._crcs,
                (c.start, c.start + c.nbytes),
                c.block,
                bad,
            )
        else:
            rc = native_pread_rows(self.fd, self.offset, self.row_bytes, unique, rows, threads)
        if rc is None:
            self._read_python(unique, rows)
        elif rc == 1:
            self._fail(f"{c.mismatch(int(bad[1]))}; row {int(unique[int(bad[0])])} was not served")
        elif rc != 0:
            what = os.strerror(-rc)
            if rc == -5:
                what = "it ended before the bytes of a row: truncated or rewritten since it was opened"
            self._fail(f"a read failed ({what})")
        torch.index_select(rows, 0, inverse, out=out)
        return out

    def _check_unchanged(self) -> None:
        """Refuse a file whose size changed; a new mtime alone is taken where the rows read are checked
        (block CRCs: every read; chunk digests: each chunk is checked again at its next read)."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) == self._stamp:
            return
        if st.st_size != self._stamp[0] or self.checks is None:
            self._fail("")
        if self._verified is not None:
            self._verified = np.zeros_like(self._verified)
        self._stamp = (st.st_size, st.st_mtime_ns)

    def _fail(self, what: str) -> None:
        """Raise a `StorageError` naming the file; a size or mtime change since it was opened comes first."""
        st = os.fstat(self.fd)
        if st.st_size != self._opened[0]:
            change = f"its size went from {self._opened[0]:,} to {st.st_size:,} bytes"
        elif st.st_mtime_ns != self._opened[1]:
            change = "it was modified (its mtime moved)"
        else:
            raise StorageError(f"{self.path}: {what}")
        raise StorageError(
            f"{self.path} changed under this reader: {change} since it was opened"
            f"{'; ' + what if what else ''}. A served table must not be rewritten in place: write "
            "the new one to another name and rename it over (readers keep the old one), then reopen"
        )

    def _verify_chunks(self, unique: torch.Tensor) -> None:
        """Chunk digests: hash each chunk the rows touch at its first read (once per chunk)."""
        c = self.checks
        pos = self.offset + unique.numpy() * self.row_bytes
        ks = np.unique(np.concatenate([(pos - c.phase) // c.block, (pos + self.row_bytes - 1 - c.phase) // c.block]))
        ks = ks - (c.start - c.phase) // c.block
        for k in ks[~self._verified[ks]].tolist():
            lo, hi = c.bounds(k)
            buf = bytearray(hi - lo)
            try:
                integrity.pread_into(self.fd, memoryview(buf), lo)
                c.check(k, buf)
            except integrity.IntegrityMismatch as exc:
                self._fail(str(exc))
            self._verified[k] = True

    def _read_python(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Without the native library: one aligned read at a time (slow; the library is the fast path)."""
        c = self.checks if self._crcs is not None else None
        step = BLOCK if c is None else c.block
        size = ((self.row_bytes + 2 * step - 1) // step + 1) * step
        raw = np.empty(size + 4096, np.uint8)
        buf = raw[(-raw.ctypes.data) % 4096 :][:size]  # O_DIRECT needs an aligned buffer
        for i, rid in enumerate(ids.tolist()):
            pos = self.offset + rid * self.row_bytes
            start = pos - pos % step
            length = -(-(pos + self.row_bytes - start) // step) * step
            got = os.preadv(self.fd, [memoryview(buf)[:length]], start)
            # The bytes that must be there: the row's, and with checks its blocks' as far as the tensor goes.
            end = pos + self.row_bytes if c is None else min(start + length, c.start + c.nbytes)
            if got < end - start:
                self._fail("it ended before the bytes of a row: truncated or rewritten since it was opened")
            if c is not None:
                lo = max(start, c.start)
                try:
                    c.check(c.index(lo), buf[lo - start : end - start])
                except integrity.IntegrityMismatch as exc:
                    self._fail(f"{exc}; row {rid} was not served")
            rows[i] = torch.from_numpy(buf[pos - start : pos - start + self.row_bytes].copy())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()
