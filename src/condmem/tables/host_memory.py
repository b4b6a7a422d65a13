"""Host memory for tables: page-locked buffers the GPU can read, sized honestly, huge pages checked.

Strategies (`HostAlloc`):

* ``mmap_register`` (default): an anonymous mmap advised ``MADV_HUGEPAGE``, filled, then
  page-locked in place with ``cudaHostRegister``. Exact size (no allocator rounding),
  and the kernel may back it with 2 MiB pages (checked in ``/proc/self/smaps``).
* ``cuda_host_alloc``: ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc through
  PyTorch's caching host allocator, which may round the request up).
* ``shared``: a file in ``/dev/shm`` mapped ``MAP_SHARED``, so several processes on one
  host map one copy (the first one fills it; the others attach), then registered.
* ``pageable``: plain memory, not page-locked (CPU-only use, the disk tier's DRAM cache).

`collapse_huge_pages` asks the kernel (``MADV_COLLAPSE``, Linux >= 6.1) to back a filled
anonymous buffer with 2 MiB pages right away, where the page-fault path left 4 KiB ones.

Pinning a large table takes tens of seconds (64 GiB: ~46 s measured on the H200 host),
so the fill reports progress, and a request larger than ``MemAvailable`` fails at once
with a message naming both numbers instead of dying in the OOM killer half-way.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger("condmem.tables")

HostAlloc = Literal["mmap_register", "cuda_host_alloc", "shared", "pageable"]
HOST_ALLOCS: tuple[str, ...] = ("mmap_register", "cuda_host_alloc", "shared", "pageable")
_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
MADV_COLLAPSE = 25
"""Linux's madvise advice number (Python's mmap module does not name it)."""


class HostMemoryError(RuntimeError):
    """Host memory cannot be allocated or page-locked as asked."""


def mem_available() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where unknown)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def huge_page_coverage(address: int, nbytes: int) -> float | None:
    """Fraction of the resident bytes of [address, address+nbytes) backed by huge pages (smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    rss = huge = 0
    inside = False
    end = address + nbytes
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            inside = lo < end and hi > address
            continue
        if not inside:
            continue
        key, _, value = line.partition(":")
        if key == "Rss":
            rss += int(value.split()[0]) * 1024
        elif key in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"):
            huge += int(value.split()[0]) * 1024
    return huge / rss if rss else None


@dataclass
class HostBuffer:
    """A uint8 host tensor and what must be undone when it is released."""

    tensor: torch.Tensor
    strategy: str
    pinned: bool
    _mmap: mmap.mmap | None = None
    _registered: bool = False
    _path: Path | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def pin(self) -> None:
        """Page-lock (cudaHostRegister) a buffer that is not yet pinned."""
        if self.pinned or self.strategy == "pageable":
            return
        if not torch.cuda.is_available():
            raise HostMemoryError("page-locking needs CUDA; use host_alloc='pageable' on a CPU-only machine")
        err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, _REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise HostMemoryError(
                f"cudaHostRegister of {self.nbytes / 2**30:.1f} GiB failed (CUDA error {err}): the memlock limit "
                "(ulimit -l) or free memory may be too small"
            )
        self._registered = True
        self.pinned = True

    def coverage(self) -> float | None:
        """Huge-page coverage of the buffer (None where smaps is unreadable or nothing is resident)."""
        return huge_page_coverage(self.tensor.data_ptr(), self.nbytes)

    def __del__(self) -> None:
        # A registered range must be unregistered before its pages go back to the OS, or a later
        # mapping at the same address cannot be registered ("already mapped").
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view still exists; the OS frees it at exit
                pass
            self._mmap = None


def allocate_host(nbytes: int, strategy: HostAlloc = "mmap_register", shared_name: str | None = None) -> HostBuffer:
    """A host buffer of exactly `nbytes` (not yet page-locked for mmap strategies: call `pin()` after filling).

    Raises:
        HostMemoryError: more than ``MemAvailable`` asked, or an unknown strategy.
    """
    if strategy not in HOST_ALLOCS:
        raise HostMemoryError(f"unknown host allocation {strategy!r}; choose one of {HOST_ALLOCS}")
    available = mem_available()
    if available is not None and nbytes > available and strategy != "shared":
        raise HostMemoryError(
            f"not enough host memory for a {nbytes / 2**30:.2f} GiB table: {available / 2**30:.2f} GiB available "
            "(MemAvailable); use the disk tier, a smaller table, or free memory"
        )
    if strategy == "pageable":
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), strategy, pinned=False)
    if strategy == "cuda_host_alloc":
        if not torch.cuda.is_available():
            raise HostMemoryError("cuda_host_alloc needs CUDA; use host_alloc='pageable' on a CPU-only machine")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise HostMemoryError(f"cudaHostAlloc of {nbytes / 2**30:.2f} GiB failed: {exc}") from None
        return HostBuffer(t, strategy, pinned=True)
    if strategy == "shared":
        name = shared_name or "condmem-table"
        path = Path("/dev/shm") / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size not in (0, nbytes):
                raise HostMemoryError(f"{path} exists with {os.fstat(fd).st_size} bytes, not {nbytes}: another table?")
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return HostBuffer(torch.frombuffer(mm, dtype=torch.uint8), strategy, pinned=False, _mmap=mm, _path=path)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP disabled: still works, with 4 KiB pages
            log.warning("MADV_HUGEPAGE refused (%s): the table will use 4 KiB pages", exc)
    return HostBuffer(torch.frombuffer(mm, dtype=torch.uint8), strategy, pinned=False, _mmap=mm)


def collapse_huge_pages(buffer: HostBuffer, attempts: int = 3) -> bool:
    """Ask the kernel to back `buffer` with huge pages now (``MADV_COLLAPSE``); True if it did.

    Only for filled, not yet page-locked anonymous buffers (``mmap_register``): locked
    pages cannot be migrated, and shared memory is refused when shmem THP is off. EAGAIN
    (pages briefly busy) is retried. Any refusal is logged and leaves the buffer as it was.
    """
    if buffer.strategy != "mmap_register" or buffer.pinned or buffer.nbytes == 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    for _ in range(attempts):
        rc = libc.madvise(ctypes.c_void_p(buffer.tensor.data_ptr()), ctypes.c_size_t(buffer.nbytes),
                          ctypes.c_int(MADV_COLLAPSE))
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    log.info("MADV_COLLAPSE refused (%s): huge pages only where the page faults placed them",
             os.strerror(err) if err else "unknown")
    return False


def report_coverage(buffer: HostBuffer, what: str) -> float | None:
    """Log the huge-page coverage of a filled buffer; warn, naming the cost, when it is low."""
    cov = buffer.coverage()
    if cov is None:
        log.info("%s: huge-page coverage unknown (smaps unreadable or nothing resident)", what)
    elif cov < 0.5:
        log.warning(
            "%s: only %.0f%% of %.1f GiB is on huge pages: random row reads from the GPU may each cost a page-table "
            "walk (zero-copy gathers are translation-bound); prefer the CPU-gather path for this table",
            what, 100 * cov, buffer.nbytes / 2**30,
        )
    else:
        log.info("%s: %.0f%% of %.1f GiB on huge pages", what, 100 * cov, buffer.nbytes / 2**30)
    return cov
