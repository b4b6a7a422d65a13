"""Page-cache residency of a file range (mincore on a fresh mapping), for tests of reads that
must or must not leave pages cached."""

from __future__ import annotations

import ctypes
import mmap
import os


def cached_fraction(path, start: int, nbytes: int) -> float:
    """Share of the pages of path[start:start+nbytes] in the page cache."""
    page = mmap.PAGESIZE
    lo = start // page * page
    length = start + nbytes - lo
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages
