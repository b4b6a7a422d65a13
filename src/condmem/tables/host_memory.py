"""Host memory for tables: page-locked buffers the GPU can read, sized honestly, huge pages checked.

Strategies (`HostAlloc`):

* ``mmap_register`` (default): an anonymous mmap advised ``MADV_HUGEPAGE``, filled, then
  page-locked in place with ``cudaHostRegister``. Exact size (no allocator rounding),
  and the kernel may back it with 2 MiB pages (checked in ``/proc/self/smaps``).
* ``cuda_host_alloc``: ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc through
  PyTorch's caching host allocator, which may round the request up).
* ``shared``: a file in ``/dev/shm`` mapped ``MAP_SHARED``, so several processes on one
  host map one copy, then registered. Its size is checked against the free space of
  ``/dev/shm`` and reserved with ``posix_fallocate`` before it is mapped (a tmpfs that runs
  out later kills the process with SIGBUS, without a message). A table's file is named by
  its content (`shared_table_name`: the table's fingerprint and layer), so two tables never
  share a file, and its users are known by an ``flock`` each holds while attached:

  - one process creates the file and fills it under an exclusive lock: the record (the
    fingerprint, layer and size, in the file's first 2 MiB, kept apart so the rows stay 2 MiB-aligned
    for huge pages), then the rows, written and checked by the ``fill`` its caller gives
    (`place_layer` checks every block of its table file as it lands), then its own mapping made
    read-only, then a ready mark; only then does it let go of the exclusive lock (holding a
    shared one), so no other process maps rows before they are complete and checked;
  - the others wait for that, check the record and the ready mark, and map the rows read-only:
    they never write them (``attached``; `place_layer` compares them with their own checked
    rows, so a damaged table file of theirs, or a copy that differs from it, is refused without
    touching what the others serve);
  - a fill that fails removes the file before anyone maps it; a creator that dies mid-fill
    (SIGKILL) leaves a file without the ready mark, which no one maps: the next process takes it
    over and fills it again;
  - `close()` removes the file when no other process holds a lock on it (the last user);
  - a process that dies (SIGKILL included) drops its lock with its descriptors, so a
    file no one holds a lock on is stale: the next user of the name takes it over (a complete
    one is attached as it is, never rewritten), and every new shared table first removes the
    stale files of other names (`sweep_stale_shared`).

  An explicitly named file (``shared_name`` not from `shared_table_name`, as the node
  tables of `condmem.distributed` use) has no locks: its creator removes it on `close()`
  unless asked to persist it.
* ``pageable``: plain memory, not page-locked (CPU-only use, the disk tier's DRAM cache).

`collapse_huge_pages` asks the kernel (``MADV_COLLAPSE``, Linux >= 6.1) to back a filled
anonymous buffer with 2 MiB pages right away, where the page-fault path left 4 KiB ones.

Pinning a large table takes tens of seconds (docs/benchmarks.md), so the fill reports progress,
and a request larger than ``MemAvailable`` fails at once with a message naming both numbers
instead of dying in the OOM killer half-way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

log = logging.getLogger("condmem.tables")

HostAlloc = Literal["mmap_register", "cuda_host_alloc", "shared", "pageable"]
HOST_ALLOCS: tuple[str, ...] = ("mmap_register", "cuda_host_alloc", "shared", "pageable")
_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
_REGISTER_READ_ONLY = 0x08
"""cudaHostRegisterReadOnly: what registering a read-only mapping needs."""
MADV_COLLAPSE = 25
"""Linux's madvise advice number (Python's mmap module does not name it)."""


class HostMemoryError(RuntimeError):
    """Host memory cannot be allocated or page-locked as asked."""


def meminfo_bytes(field: str) -> int | None:
    """One field of /proc/meminfo (``MemAvailable``, ``Cached``, ...) in bytes (None where unknown)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(field)}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def mem_available() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where unknown)."""
    return meminfo_bytes("MemAvailable")


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
    _remove_on_close: bool = False
    _lock_fd: int | None = None
    """A shared table's descriptor holding this user's flock (closing it detaches)."""
    read_only: bool = False
    """The mapping is read-only (a published shared table): registered with cudaHostRegisterReadOnly."""
    attached: bool = False
    """A shared table another process filled and published: this process mapped it read-only and did not
    run its ``fill`` (the caller checks it against its own rows)."""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def pin(self) -> None:
        """Page-lock (cudaHostRegister) a buffer that is not yet pinned."""
        if self.pinned or self.strategy == "pageable":
            return
        if not torch.cuda.is_available():
            raise HostMemoryError("page-locking needs CUDA; use host_alloc='pageable' on a CPU-only machine")
        flags = _REGISTER_PORTABLE_MAPPED | (_REGISTER_READ_ONLY if self.read_only else 0)
        err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, flags))
        if err != 0:
            raise HostMemoryError(
                f"cudaHostRegister of {self.nbytes / 2**30:.1f} GiB"
                f"{' (a read-only shared table: cudaHostRegisterReadOnly)' if self.read_only else ''} failed "
                f"(CUDA error {err}): the memlock limit (ulimit -l) or free memory may be too small"
            )
        self._registered = True
        self.pinned = True

    def coverage(self) -> float | None:
        """Huge-page coverage of the buffer (None where smaps is unreadable or nothing is resident)."""
        return huge_page_coverage(self.tensor.data_ptr(), self.nbytes)

    def __del__(self) -> None:
        # A registered range must be unregistered before its pages go back to the OS, or a later
        # mapping at the same address cannot be registered ("already mapped"). A destructor cannot
        # raise, so a failure is logged loudly; `close()` raises it.
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            log.warning(
                "host buffer of %.2f GiB released by the garbage collector failed to close: %s",
                self.nbytes / 2**30,
                exc,
            )

    def close(self) -> None:
        """Unregister, unmap, and remove a shared file this process created (unless persisted).

        Raises:
            HostMemoryError: cudaHostUnregister failed (the range stays registered).
        """
        if self._registered:
            err = int(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self._registered = False
            if err != 0:
                raise HostMemoryError(
                    f"cudaHostUnregister of a {self.nbytes / 2**30:.2f} GiB host table failed (CUDA error {err})"
                )
        if self._remove_on_close and self._path is not None:
            self._path.unlink(missing_ok=True)
            self._remove_on_close = False
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            _detach_shared(fd, self._path)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view still exists; the OS frees it at exit
                pass
            self._mmap = None


def allocate_host(
    nbytes: int,
    strategy: HostAlloc = "mmap_register",
    shared_name: str | None = None,
    persist: bool = False,
    fill: Callable[[torch.Tensor], None] | None = None,
) -> HostBuffer:
    """A host buffer of exactly `nbytes`, filled by `fill` (not yet page-locked for mmap strategies: call `pin()`).

    Args:
        shared_name: the file name in /dev/shm (``shared``, required): `shared_table_name` of the
            table's content (attached while the fingerprint matches, removed by its last user,
            reclaimed when stale), or a name of the caller's (no locks; removed by its creator).
        persist: keep an explicitly named shared file this call creates after `close()`.
        fill: writes (and checks) every byte of the uint8 tensor it is given; an error it raises is
            raised here, the buffer released. Required for a table-named shared file, where only the
            process that creates the file runs it (under the file's exclusive lock, before anyone
            else maps it); a process that finds the file published maps it read-only and skips
            `fill` (``attached``).

    Raises:
        HostMemoryError: more than ``MemAvailable`` (or, shared, /dev/shm's free space) asked, an
            unknown strategy, a shared buffer without a name, a table-named one without `fill`, or a
            shared file that holds another table (or another size) than its name says.
    """
    if strategy not in HOST_ALLOCS:
        raise HostMemoryError(f"unknown host allocation {strategy!r}; choose one of {HOST_ALLOCS}")
    available = mem_available()
    if available is not None and nbytes > available and strategy != "shared":
        raise HostMemoryError(
            f"not enough host memory for a {nbytes / 2**30:.2f} GiB table: {available / 2**30:.2f} GiB available "
            "(MemAvailable); use the disk tier, a smaller table, or free memory"
        )
    if strategy == "shared":
        if not shared_name:
            raise HostMemoryError(
                "host_alloc='shared' needs the file's name: shared_table_name(fingerprint, layer_id) of the table's "
                "content (EngramMemory.from_table_file passes it), so that two tables never share a file"
            )
        if parse_shared_table_name(shared_name) is not None:
            if persist:
                raise HostMemoryError(
                    f"{shared_name}: a table-named shared file is removed by its last user; "
                    "persist applies to explicitly named files"
                )
            if fill is None:
                raise HostMemoryError(
                    f"{shared_name}: a table-named shared file is filled once, by the process that creates it: "
                    "pass fill (place_layer does)"
                )
            return _attach_shared_table(nbytes, shared_name, fill)
    return _filled(_allocate(nbytes, strategy, shared_name, persist), fill)


def _allocate(nbytes: int, strategy: HostAlloc, shared_name: str | None, persist: bool) -> HostBuffer:
    """The buffer of `allocate_host`, not yet filled (every strategy but a table-named shared file)."""
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
        return _allocate_shared(nbytes, shared_name, persist)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP disabled: still works, with 4 KiB pages
            log.warning("MADV_HUGEPAGE refused (%s): the table will use 4 KiB pages", exc)
    return HostBuffer(torch.frombuffer(mm, dtype=torch.uint8), strategy, pinned=False, _mmap=mm)


def _filled(buffer: HostBuffer, fill: Callable[[torch.Tensor], None] | None) -> HostBuffer:
    """`buffer` after `fill` ran on its tensor; released (and the error raised) when `fill` fails."""
    if fill is not None:
        try:
            fill(buffer.tensor)
        except BaseException:
            buffer.close()
            raise
    return buffer


def _allocate_shared(nbytes: int, name: str, persist: bool) -> HostBuffer:
    """Create (space checked and reserved first) or attach to ``/dev/shm/<name>``."""
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    created = os.fstat(fd).st_size == 0
    try:
        size = os.fstat(fd).st_size
        if size not in (0, nbytes):
            raise HostMemoryError(f"{path} exists with {size} bytes, not {nbytes}: another table?")
        if created:
            vfs = os.statvfs(path.parent)
            free = vfs.f_bavail * vfs.f_frsize
            if nbytes > free:
                raise HostMemoryError(
                    f"a {nbytes / 2**30:.2f} GiB shared table does not fit /dev/shm: "
                    f"{free / 2**30:.2f} GiB free (raise its size, or use host_alloc='mmap_register')"
                )
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs later is a SIGBUS
            except OSError as exc:
                raise HostMemoryError(f"cannot reserve {nbytes / 2**30:.2f} GiB in /dev/shm ({exc.strerror})") from None
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        if created:
            path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return HostBuffer(
        torch.frombuffer(mm, dtype=torch.uint8),
        "shared",
        pinned=False,
        _mmap=mm,
        _path=path,
        _remove_on_close=created and not persist,
    )


SHM_DIR = Path("/dev/shm")
SHARED_TABLE_PREFIX = "condmem-shared-"
_SHARED_TABLE_NAME = re.compile(r"^condmem-shared-([0-9a-f]{64})-l(\d+)$")
SHARED_HEADER_BYTES = 2 * 2**20
"""A table-named shared file's record (first page) and the gap that keeps its rows 2 MiB-aligned."""
_SHARED_MAGIC = b"condmem-shared-table/2\n"


def shared_table_name(fingerprint: str, layer_id: int) -> str:
    """The /dev/shm file name of one layer of a table, from the table's content fingerprint.

    Args:
        fingerprint: 64 hex digits that change whenever any row would (e.g. the sha256 of the
            table file's recorded checksums, format and this process's row range).
        layer_id: the Engram layer.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", fingerprint or ""):
        raise HostMemoryError(f"a shared table's fingerprint must be 64 hex digits (a sha256), got {fingerprint!r}")
    if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
        raise HostMemoryError(f"layer_id must be a non-negative int, got {layer_id!r}")
    return f"{SHARED_TABLE_PREFIX}{fingerprint}-l{layer_id}"


def content_fingerprint(*parts: object) -> str:
    """sha256 (hex) of JSON-encodable `parts`: what `shared_table_name` takes."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def parse_shared_table_name(name: str) -> tuple[str, int] | None:
    """(fingerprint, layer_id) of a `shared_table_name`, else None."""
    m = _SHARED_TABLE_NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _same_file(fd: int, path: Path) -> bool:
    """Is `fd` still the file at `path` (not removed, nor replaced, since it was opened)?"""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _shared_record(name: str, nbytes: int) -> bytes:
    fingerprint, layer_id = parse_shared_table_name(name)
    meta = {"fingerprint": fingerprint, "layer_id": layer_id, "nbytes": nbytes}
    return _SHARED_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n"


def _attach_shared_table(nbytes: int, name: str, fill: Callable[[torch.Tensor], None]) -> HostBuffer:
    """Create and fill, take over (stale and incomplete), or attach to the table-named file ``/dev/shm/<name>``;
    see the module docstring.

    Each pass opens the path and locks it: exclusively without waiting when no one else holds
    it, else shared after waiting for a creator to finish. A published copy (record and ready
    mark) is mapped read-only whatever the lock; anything else is filled again by an exclusive
    holder only. A file removed or replaced between the open and the lock is a new pass.
    """
    path = SHM_DIR / name
    record = _shared_record(name, nbytes)
    total = SHARED_HEADER_BYTES + nbytes
    sweep_stale_shared(keep=name)
    deadline = time.monotonic() + 60.0
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            owner = _try_lock(fd, fcntl.LOCK_EX)
            if not owner and not _try_lock(fd, fcntl.LOCK_SH):
                log.info("%s: waiting for the process that fills it", path)
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a creator (which holds it exclusively) fills it
            if _same_file(fd, path):
                state = _shared_state(fd, record, total)
                if state == "ready":
                    if owner:
                        # flock converts by release-then-lock: the file is checked again under the shared lock.
                        fcntl.flock(fd, fcntl.LOCK_SH)
                    if _same_file(fd, path):
                        return _map_published(fd, path, nbytes)
                elif owner:
                    return _create_shared_table(fd, path, record, total, nbytes, fill)
                elif state == "other":
                    theirs = os.pread(fd, 4096, 0)[len(_SHARED_MAGIC) :].split(b"\n")[0]
                    raise HostMemoryError(
                        f"{path} holds {theirs.decode(errors='replace')}, not {nbytes:,} bytes: the same "
                        "fingerprint and layer with another size (two tables given one fingerprint?)"
                    )
                # Incomplete (its creator died mid-fill) and held by other waiters: never mapped; the next
                # pass takes it over once no one holds it.
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if time.monotonic() > deadline:
            raise HostMemoryError(
                f"{path} could not be attached or taken over within 60 s: other processes keep it "
                "locked while it is incomplete"
            )
        time.sleep(random.uniform(0.002, 0.02))  # apart from other waiters, so that one of them gets it alone


_READY_OFFSET = 4096
_SHARED_READY = b"condmem-shared-table: rows complete and checked\n"
"""The ready mark, written after the rows (and their check), before any other process may map them."""


def _shared_state(fd: int, record: bytes, total: int) -> str:
    """What the file holds: "ready" (this table's record and the ready mark), "other" (another table's
    published record) or "incomplete"."""
    ready = os.pread(fd, len(_SHARED_READY), _READY_OFFSET) == _SHARED_READY
    head = os.pread(fd, len(record), 0)
    if head == record and os.fstat(fd).st_size == total:
        return "ready" if ready else "incomplete"
    return "other" if ready and head.startswith(_SHARED_MAGIC) else "incomplete"


def _create_shared_table(
    fd: int, path: Path, record: bytes, total: int, nbytes: int, fill: Callable[[torch.Tensor], None]
) -> HostBuffer:
    """Under the exclusive lock: size (space checked and reserved), record, rows (`fill`), the mapping made
    read-only, the ready mark; then the shared lock (the waiting processes map it now). A failure removes
    the file: no one else has mapped it."""
    mm = tensor = None
    try:
        os.ftruncate(fd, 0)  # whatever a creator that died left is discarded
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        if total > free:
            raise HostMemoryError(
                f"a {total / 2**30:.2f} GiB shared table does not fit /dev/shm: "
                f"{free / 2**30:.2f} GiB free (raise its size, or use host_alloc='mmap_register')"
            )
        try:
            os.posix_fallocate(fd, SHARED_HEADER_BYTES, total - SHARED_HEADER_BYTES)  # a full tmpfs later: SIGBUS
        except OSError as exc:
            raise HostMemoryError(f"cannot reserve {total / 2**30:.2f} GiB in /dev/shm ({exc.strerror})") from None
        os.ftruncate(fd, total)
        os.pwrite(fd, record, 0)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, offset=SHARED_HEADER_BYTES)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        fill(tensor)
        _protect_read_only(tensor, path)
        os.pwrite(fd, _SHARED_READY, _READY_OFFSET)
    except BaseException:
        if _same_file(fd, path):
            path.unlink(missing_ok=True)
        tensor = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # the failed fill's traceback still views it; unmapped when that goes
                pass
        raise
    fcntl.flock(fd, fcntl.LOCK_SH)  # published
    return HostBuffer(tensor, "shared", pinned=False, _mmap=mm, _path=path, _lock_fd=fd, read_only=True)


def _protect_read_only(t: torch.Tensor, path: Path) -> None:
    """Make the filled rows read-only in this process too (``mprotect``): after publication no one writes them."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = ctypes.c_size_t(t.numel())
    if libc.mprotect(ctypes.c_void_p(t.data_ptr()), size, ctypes.c_int(mmap.PROT_READ)) != 0:
        raise HostMemoryError(
            f"{path}: mprotect(PROT_READ) of the filled rows failed ({os.strerror(ctypes.get_errno())})"
        )


def _map_published(fd: int, path: Path, nbytes: int) -> HostBuffer:
    """A published copy's rows mapped read-only; `fd` (holding this user's shared lock) is kept."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=SHARED_HEADER_BYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch notes the buffer is read-only: that is the point
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    return HostBuffer(tensor, "shared", pinned=False, _mmap=mm, _path=path, _lock_fd=fd, read_only=True, attached=True)


def _detach_shared(fd: int, path: Path | None) -> None:
    """Drop this user's lock on a table-named file; the last user (no other lock) removes it."""
    try:
        if path is not None and _try_lock(fd, fcntl.LOCK_EX) and _same_file(fd, path):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def sweep_stale_shared(directory: Path = SHM_DIR, keep: str | None = None) -> list[Path]:
    """Remove the table-named shared files no process holds a lock on (their users died); returns them.

    `keep`: a name the caller is about to take over itself.
    """
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SHARED_TABLE_PREFIX) and n != keep]
    except OSError:
        return removed
    for n in names:
        if parse_shared_table_name(n) is None:
            continue
        path = directory / n
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _try_lock(fd, fcntl.LOCK_EX) and _same_file(fd, path):
                path.unlink(missing_ok=True)
                removed.append(path)
                log.warning(
                    "removed %s (%.2f GiB): a shared table whose users all died", path, os.fstat(fd).st_size / 2**30
                )
        finally:
            os.close(fd)
    return removed


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
        rc = libc.madvise(
            ctypes.c_void_p(buffer.tensor.data_ptr()), ctypes.c_size_t(buffer.nbytes), ctypes.c_int(MADV_COLLAPSE)
        )
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    log.info(
        "MADV_COLLAPSE refused (%s): huge pages only where the page faults placed them",
        os.strerror(err) if err else "unknown",
    )
    return False


def report_coverage(buffer: HostBuffer, what: str) -> float | None:
    """Log the huge-page coverage of a filled buffer; warn, naming the cost, when it is low and a GPU reads it.

    The cost is the GPU's: its zero-copy reads of page-locked rows walk the page tables. A
    buffer that is not page-locked (no GPU, or not registered) is read by the CPU only, so
    its coverage is information, not a warning.
    """
    cov = buffer.coverage()
    if cov is None:
        log.info("%s: huge-page coverage unknown (smaps unreadable or nothing resident)", what)
    elif cov < 0.5 and not buffer.pinned:
        log.info(
            "%s: %.0f%% of %.1f GiB on huge pages (read by the CPU only: not page-locked)",
            what,
            100 * cov,
            buffer.nbytes / 2**30,
        )
    elif cov < 0.5:
        log.warning(
            "%s: only %.0f%% of %.1f GiB is on huge pages: random row reads from the GPU may each cost a page-table "
            "walk (zero-copy gathers are translation-bound); prefer the CPU-gather path for this table",
            what,
            100 * cov,
            buffer.nbytes / 2**30,
        )
    else:
        log.info("%s: %.0f%% of %.1f GiB on huge pages", what, 100 * cov, buffer.nbytes / 2**30)
    return cov


_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


def host_register(t: torch.Tensor) -> torch.Tensor:
    """Page-lock an existing CPU tensor in place (cudaHostRegister), so kernels read it zero-copy.

    Returns the same tensor. Pair with `host_unregister` before the memory is freed.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise HostMemoryError("host_register needs a contiguous CPU tensor")
    err = torch.cuda.cudart().cudaHostRegister(
        t.data_ptr(), t.numel() * t.element_size(), _CUDA_HOST_REGISTER_PORTABLE_MAPPED
    )
    if int(err) != 0:
        raise HostMemoryError(f"cudaHostRegister failed with error {int(err)}")
    return t


def host_unregister(t: torch.Tensor) -> None:
    """Undo `host_register`."""
    err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    if int(err) != 0:
        raise HostMemoryError(f"cudaHostUnregister failed with error {int(err)}")
