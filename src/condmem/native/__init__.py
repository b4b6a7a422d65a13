"""condmem's native CPU code (``gather.c``, ``hash.c``, ``row_server.c``, ``checksum.c``): the
prefetching row gather, the staged send, checked row reads of table files (O_DIRECT or not), the
CRC32C of table blocks, the decode-step n-gram hash and the decode row server's threads
(`condmem.native.row_server`), called through ctypes (which releases the GIL during each call).

`available()` says whether it is loaded; `gather_path()` names the CPU gather that runs.
Without it CPU gathers fall back to ``torch.index_select`` and staged sends to a Python
loop, announced once by a warning that says what that costs (`FALLBACK_COST`).

The library is the extension built at install time (``setup.py``: `toolchain.MODULE`). Where
there is none (a source tree on ``PYTHONPATH``, or an install whose build failed) or it was
built from another ``gather.c``, a development build is compiled from ``gather.c`` with the
same flags into ``$CONDMEM_CACHE_DIR/native`` (`toolchain.development_build`). ``CONDMEM_NATIVE=0``
turns the native code off, to compare against the fallback.

Thread-safety: the first call loads the library under a lock; every function may then be
called from any thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from condmem.native import toolchain
from condmem.native.cudart import CudaRuntime, cuda_runtime, cudart_soname

__all__ = [
    "Build",
    "CudaRuntime",
    "FALLBACK_COST",
    "available",
    "build",
    "cuda_runtime",
    "cudart_soname",
    "crc32c",
    "crc32c_blocks",
    "crc32c_hardware",
    "gather_path",
    "gather_rows",
    "hash_decode",
    "library",
    "pread_rows",
]

log = logging.getLogger("condmem.native")

FALLBACK_COST = (
    "gathers without the native code's prefetching threads and a send with a Python call per chunk are "
    "slower; measured: docs/lookup-engine.md#native-code"
)
"""What the fallback costs and where it is measured, said by the warning when the native code is unavailable."""


@dataclass(frozen=True)
class Build:
    """Which native library the loader uses.

    Attributes:
        kind: ``installed`` (the extension built at install time), ``development`` (compiled
            from ``gather.c`` by the loader) or ``none`` (unavailable: the torch fallback runs).
        path: the loaded shared library, or None.
        reason: why the installed build is not the one used ("" when it is).
    """

    kind: Literal["installed", "development", "none"]
    path: str | None
    reason: str


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_build: Build | None = None


def _cache_dir() -> Path:
    root = os.environ.get("CONDMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "condmem"
    )
    return Path(root) / "native"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument and result types of gather.c's entry points."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.condmem_source_digest.argtypes, lib.condmem_source_digest.restype = [], ctypes.c_char_p
    lib.condmem_gather_rows.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int]
    lib.condmem_gather_rows.restype = None
    lib.condmem_gather_stream.argtypes = [
        ptr,
        i64,
        ptr,  # src, row_bytes, ids
        ptr,
        ptr,
        ctypes.c_int,
        ctypes.c_int,  # ring, events, ring_len, ring_start
        ptr,
        i64,
        ptr,
        ptr,  # bounds, n_chunks, dst, stream
        ptr,
        ptr,
        ptr,
        ctypes.c_int,  # memcpy_async, record, query, threads
        ptr,
    ]  # timeline (or None)
    lib.condmem_gather_stream.restype = ctypes.c_int
    lib.condmem_pread_rows.argtypes = [ctypes.c_int, i64, i64, ptr, i64, ptr, ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.condmem_pread_rows.restype = i64
    lib.condmem_crc32c.argtypes, lib.condmem_crc32c.restype = [ctypes.c_uint32, ptr, i64], ctypes.c_uint32
    lib.condmem_crc32c_blocks.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
    lib.condmem_crc32c_blocks.restype = i64
    lib.condmem_crc32c_hardware.argtypes, lib.condmem_crc32c_hardware.restype = [], ctypes.c_int
    lib.condmem_hash_decode.argtypes = [
        ptr,
        i64,
        i64,
        ptr,  # history, n_slots, n_back, slots
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,  # ids, lookup, vocab, valid, blocked, batch
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        ptr,
    ]  # multipliers, primes, offsets, n_layers, n_heads, pad_id, out
    lib.condmem_hash_decode.restype = None
    lib.condmem_row_server_size.argtypes, lib.condmem_row_server_size.restype = [], i64
    lib.condmem_row_server_start.argtypes, lib.condmem_row_server_start.restype = [ptr], ctypes.c_int
    lib.condmem_row_server_stop.argtypes, lib.condmem_row_server_stop.restype = [ptr], None
    return lib


def _open(path: str) -> ctypes.CDLL:
    """Load and declare the library at `path`; OSError (or AttributeError: an entry point is
    missing) when it cannot serve, ValueError when it was built from other C sources."""
    lib = _declare(ctypes.CDLL(path))
    if all(s.exists() for s in toolchain.SOURCES):  # the sources ship with the package; compare
        got, want = lib.condmem_source_digest().decode(), toolchain.source_digest()
        if got != want:
            raise ValueError(
                f"built from other C sources (digest {got}, sources {want}): rebuild with `pip install -e .`"
            )
    return lib


def _installed() -> tuple[ctypes.CDLL | None, str | None, str]:
    """The installed extension: (library, path, "") or (None, path or None, why not)."""
    try:
        spec = importlib.util.find_spec(toolchain.MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return (
            None,
            None,
            (
                f"no installed build ({toolchain.MODULE} not found: running from a source tree, "
                "or the compile failed at install)"
            ),
        )
    try:
        return _open(spec.origin), spec.origin, ""
    except (OSError, AttributeError, ValueError) as exc:
        return None, spec.origin, f"installed build {spec.origin} unusable: {exc}"


def _load() -> ctypes.CDLL | None:
    """The loaded library, or None (found or built on the first call; later calls take no
    lock: every native gather and send calls this)."""
    global _lib, _build
    if _build is not None:
        return _lib
    with _lock:
        if _build is None:
            _lib, found = _find()
            _build = found  # set after _lib: a caller that sees it sees the library too
    return _lib


def _find() -> tuple[ctypes.CDLL | None, Build]:
    if os.environ.get("CONDMEM_NATIVE", "1") == "0":
        reason = "turned off by CONDMEM_NATIVE=0"
        log.warning(
            "native CPU code %s: CPU gathers use torch.index_select and staged sends a Python loop (%s)",
            reason,
            FALLBACK_COST,
        )
        return None, Build("none", None, reason)
    lib, path, reason = _installed()
    if lib is not None:
        log.debug("native CPU code: the installed build %s", path)
        return lib, Build("installed", path, "")
    try:
        path = str(toolchain.development_build(_cache_dir()))
        lib = _open(path)
    except (toolchain.BuildError, OSError, AttributeError, ValueError) as exc:
        log.warning(
            "NATIVE CPU CODE UNAVAILABLE: %s; a development build failed too (%s). CPU gathers use "
            "torch.index_select and staged sends a Python loop, slower: %s. Install a C compiler with "
            "OpenMP (gcc) and reinstall condmem (`pip install -e .`).",
            reason,
            exc,
            FALLBACK_COST,
        )
        return None, Build("none", None, f"{reason}; development build: {exc}")
    log.info("native CPU code: %s; using a development build of gather.c at %s", reason, path)
    return lib, Build("development", path, reason)


def available() -> bool:
    """True when the native library is loaded (installed or development build)."""
    return _load() is not None


def build() -> Build:
    """Which library the loader uses, and why not the installed one (loads it first)."""
    _load()
    return _build


def gather_path() -> Literal["native", "torch"]:
    """The CPU gather that runs: ``native`` (gather.c) or ``torch`` (``index_select``, the fallback)."""
    return "native" if available() else "torch"


def library() -> ctypes.CDLL | None:
    """The loaded ctypes library (its entry points declared), or None: for `StagedSender`."""
    return _load()


def gather_rows(
    table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int | None = None
) -> torch.Tensor | None:
    """Rows ``table[ids]`` into `out`; None when the native code is unavailable (nothing written).

    Args:
        table: uint8 [rows, row_bytes], contiguous, on the CPU (any memory: pinned, mmap'd, plain).
        ids: int64 on the CPU, every one in range: they are not checked here (callers check).
        out: contiguous uint8 [ids.numel(), row_bytes].
        threads: OpenMP threads (default: torch's intra-op thread count).

    Raises:
        ValueError: `table` or `out` has the wrong dtype, shape or layout.
    """
    lib = _load()
    if lib is None:
        return None
    if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
        raise ValueError("native gather needs a contiguous uint8 [rows, row_bytes] table")
    if out.shape != (ids.numel(), table.shape[1]) or not out.is_contiguous() or out.dtype != torch.uint8:
        raise ValueError(f"out must be contiguous uint8 [{ids.numel()}, {table.shape[1]}]")
    ids = ids.contiguous().to(torch.int64)
    n = ids.numel()
    if n:
        lib.condmem_gather_rows(
            table.data_ptr(), table.shape[1], ids.data_ptr(), n, out.data_ptr(), int(threads or torch.get_num_threads())
        )
    return out


def pread_rows(
    fd: int,
    offset: int,
    row_bytes: int,
    ids: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    sums: torch.Tensor | None = None,
    span: tuple[int, int] = (0, 0),
    block: int = 4096,
    bad: torch.Tensor | None = None,
) -> int | None:
    """Rows ``ids`` of `row_bytes` at file offset ``offset + id * row_bytes`` of `fd` (with or
    without O_DIRECT) into `out` (contiguous uint8 [n, row_bytes]), `threads` reads in flight.

    With `sums` (uint32 CRC32C per `block` bytes of the tensor occupying file bytes `span`, on
    the file's absolute grid), every block a row touches is read whole and checked first.
    Returns 0; 1 when a block did not match (``bad``, int64 [2]: the id's index, the block);
    -errno of the first failed read (-EIO: it ended before the bytes it needs); or None when
    the native code is unavailable. `ids`: contiguous int64 on the CPU."""
    lib = _load()
    if lib is None:
        return None
    if sums is not None and (bad is None or block % 4096):
        raise ValueError("checked reads need `bad` (int64 [2]) and a block that is a multiple of 4096")
    return int(
        lib.condmem_pread_rows(
            fd,
            offset,
            row_bytes,
            ids.data_ptr(),
            ids.numel(),
            out.data_ptr(),
            threads,
            None if sums is None else sums.data_ptr(),
            span[0],
            span[1],
            block,
            None if bad is None else bad.data_ptr(),
        )
    )


def crc32c(data, crc: int = 0) -> int | None:
    """CRC32C of the bytes of `data` (anything exposing a contiguous buffer), continuing from
    `crc` (the CRC of the bytes before them); None when the native code is unavailable."""
    lib = _load()
    if lib is None:
        return None
    view = memoryview(data).cast("B")
    if not view.nbytes:
        return crc
    return int(lib.condmem_crc32c(crc, _address(view), view.nbytes))


def crc32c_blocks(data, first: int, block: int, expected=None, threads: int = 1):
    """CRC32C of consecutive blocks of `data`: the first `first` bytes, then `block` each (the
    last one what is left). Without `expected`: a numpy uint32 array of them; with it (uint32,
    one per block): the index of the first block that differs, or -1. None when the native
    code is unavailable."""
    import numpy as np

    lib = _load()
    if lib is None:
        return None
    view = memoryview(data).cast("B")
    n = view.nbytes
    count = 0 if n == 0 else (1 if n <= first else 1 + -(-(n - first) // block))
    if expected is not None:
        expected = np.ascontiguousarray(expected, dtype=np.uint32)
        if expected.size < count:
            raise ValueError(f"{count} blocks but {expected.size} expected CRCs")
        if not count:
            return -1
        return int(lib.condmem_crc32c_blocks(_address(view), n, first, block, None, expected.ctypes.data, threads))
    out = np.empty(count, np.uint32)
    if count:
        lib.condmem_crc32c_blocks(_address(view), n, first, block, out.ctypes.data, None, threads)
    return out


def crc32c_hardware() -> bool | None:
    """True when the CPU's CRC32C instruction runs (SSE4.2), False for the table; None without the library."""
    lib = _load()
    return None if lib is None else bool(lib.condmem_crc32c_hardware())


def _address(view: memoryview) -> int:
    """Address of a contiguous buffer's first byte (read-only buffers included: the C side never writes)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def hash_decode(
    history: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    *,
    lookup: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    valid: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One decode step of the n-gram hash on the CPU (``hash.c``): the row ids int64
    [B, L, (N-1)*H] of `ids` [B] (token ids, mapped through `lookup` when given), with
    `history` (int64 [n_slots, N-1], contiguous) updated in place; the numbers of
    `condmem.ops.hash.reference.hash_decode_reference`. None when the native code is
    unavailable (nothing changed). Every tensor on the CPU."""
    lib = _load()
    if lib is None:
        return None
    if history.dtype != torch.int64 or history.dim() != 2 or not history.is_contiguous() or history.is_cuda:
        raise ValueError("native hash needs a contiguous int64 [n_slots, N-1] history on the CPU")
    n_layers, n = multipliers.shape
    if n - 1 != history.shape[1] or n > 64:
        raise ValueError(f"multipliers [L, N={n}] do not match a history of {history.shape[1]} look-backs (N <= 64)")
    n_cols = (n - 1) * n_heads
    if primes.shape != (n_layers, n_cols) or (offsets is not None and offsets.shape != primes.shape):
        raise ValueError(f"primes and offsets must be [{n_layers}, {n_cols}], got {tuple(primes.shape)}")
    batch = ids.numel()

    def flat(t, dtype):  # no copy (and no torch op) when t already fits: a decode step's C work is short
        if t is None:
            return None
        if t.dtype == torch.bool and dtype == torch.uint8 and t.is_contiguous():
            return t.view(torch.uint8)
        return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()

    per_row = [flat(slots, torch.int64), flat(ids, torch.int64), flat(valid, torch.uint8), flat(blocked, torch.uint8)]
    if any(t is not None and t.numel() != batch for t in per_row):
        raise ValueError(f"slots, valid and blocked must have the {batch} rows of ids")
    args = [
        *per_row[:2],
        flat(lookup, torch.int64),
        *per_row[2:],
        flat(multipliers, torch.int64),
        flat(primes, torch.int64),
        flat(offsets, torch.int64),
    ]
    out = torch.empty((batch, n_layers, n_cols), dtype=torch.int64)
    if batch:
        ptr = [None if a is None else a.data_ptr() for a in args]
        lib.condmem_hash_decode(
            history.data_ptr(),
            history.shape[0],
            history.shape[1],
            ptr[0],
            ptr[1],
            ptr[2],
            0 if lookup is None else lookup.numel(),
            ptr[3],
            ptr[4],
            batch,
            ptr[5],
            ptr[6],
            ptr[7],
            n_layers,
            n_heads,
            pad_id,
            out.data_ptr(),
        )
    return out
