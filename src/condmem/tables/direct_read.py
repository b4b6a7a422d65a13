"""Rows read from a table file with ``O_DIRECT``: the page cache is never filled.

The mapped disk tier leaves every row it reads in the kernel's page cache, so a table
larger than DRAM thrashes the cache against everything else (the host tables included),
and its cold reads pull ~100 KiB of read-around per row. Here each row costs the aligned
4 KiB blocks that hold it (two when it straddles a block edge: ~1 time in 16 for 264 B rows),
read by `threads` native threads at once (the disk's queue depth), into buffers of their own;
repeated ids in a batch are read once. What to keep in DRAM is the caller's choice (a
`RowCache` in front, `LayerStore.with_dram_cache`), bounded and predictable.

The file is opened again by path, so the reader checks that it is the file that was
validated (device and inode recorded by the header), and refuses another one.
"""

from __future__ import annotations

import os

import torch

from condmem.native import pread_rows as native_pread_rows
from condmem.tables.storage import StorageError

BLOCK = 4096


class DirectRowReader:
    """Random rows of one tensor of a file, read with ``O_DIRECT``.

    Args:
        path: the file.
        offset: byte offset of row 0 in the file.
        row_bytes: bytes per row.
        num_rows: rows in the tensor.
        threads: reads in flight (native threads).
        identity: (st_dev, st_ino) the file must have (e.g. ``Header.identity``).
    """

    def __init__(self, path: str | os.PathLike, offset: int, row_bytes: int, num_rows: int, *, threads: int = 32,
                 identity: tuple[int, int] | None = None):
        self.path, self.offset, self.row_bytes, self.num_rows, self.threads = path, offset, row_bytes, num_rows, threads
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StorageError(f"{path}: cannot be opened with O_DIRECT ({exc.strerror or exc}); this file system may "
                               "not support direct reads: use the mapped disk tier (direct_io=False)") from None
        st = os.fstat(self.fd)
        if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
            os.close(self.fd)
            self.fd = -1
            raise StorageError(f"{path} is no longer the file that was validated (replaced since it was opened)")
        if offset + row_bytes * num_rows > st.st_size:
            os.close(self.fd)
            self.fd = -1
            raise StorageError(f"{path}: {num_rows:,} rows of {row_bytes} B at offset {offset:,} run past its "
                               f"{st.st_size:,} bytes")

    def read(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [n, row_bytes] rows of int64 `ids` [n] (CPU), each distinct id read once."""
        if self.fd < 0:
            raise StorageError(f"{self.path}: the direct reader is closed")
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise StorageError(f"row id {bad} outside the table's 0..{self.num_rows - 1}")
        if out is None:
            out = torch.empty(ids.numel(), self.row_bytes, dtype=torch.uint8)
        if ids.numel() == 0:
            return out
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.empty(unique.numel(), self.row_bytes, dtype=torch.uint8)
        rc = native_pread_rows(self.fd, self.offset, self.row_bytes, unique.contiguous(), rows, self.threads)
        if rc is None:
            self._read_python(unique, rows)
        elif rc != 0:
            raise StorageError(f"{self.path}: a direct read failed ({os.strerror(-rc)})")
        torch.index_select(rows, 0, inverse, out=out)
        return out

    def _read_python(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Without the native library: one aligned read at a time (slow; the library is the fast path)."""
        import mmap

        buf = mmap.mmap(-1, ((self.row_bytes + 2 * BLOCK - 1) // BLOCK) * BLOCK)
        view = torch.frombuffer(buf, dtype=torch.uint8)
        for i, rid in enumerate(ids.tolist()):
            pos = self.offset + rid * self.row_bytes
            start = pos - pos % BLOCK
            length = -(-(pos + self.row_bytes - start) // BLOCK) * BLOCK
            got = os.preadv(self.fd, [memoryview(buf)[:length]], start)
            if got < pos - start + self.row_bytes:
                raise StorageError(f"{self.path}: short direct read at byte {start:,}")
            rows[i] = view[pos - start : pos - start + self.row_bytes]
        del view
        buf.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()
