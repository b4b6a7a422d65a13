"""A native CPU row gather with software prefetch, compiled on first use (gcc + OpenMP, via ctypes).

Random reads of 264 B rows from a table of tens of GiB are bound by memory latency: a
plain copy loop (torch's `index_select`) stalls on every row, since the next address is
unknown to the hardware prefetcher. Here each thread prefetches the row a few
iterations ahead while it copies the current one, so many misses are in flight at once.

The C source below is compiled once per machine into ``$CONDMEM_CACHE_DIR/native``
(keyed by its hash) and loaded with ctypes, which releases the GIL during the call. If
no C compiler is present (or ``CONDMEM_NATIVE=0``), `native_gather_rows` returns None
and callers fall back to `torch.index_select` with a logged notice.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("condmem.tables")

PREFETCH_DISTANCE = 12

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Copy rows ids[0..n) of `row_bytes` each from src to dst (dst row i <- src row ids[i]).
   Dynamic chunks of rows: a thread that shares its core (with a thread spinning on a GPU
   sync, say) must not hold back the whole team, as a static split would. */
void condmem_gather_rows(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t n,
                         uint8_t *dst, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 256)
    for (int64_t i = 0; i < n; i++) {
        if (i + PF < n) {
            const uint8_t *ahead = src + ids[i + PF] * row_bytes;
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 0);
        }
        memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, (size_t)row_bytes);
    }
}
""".replace("PF", str(PREFETCH_DISTANCE))

_lock = threading.Lock()
_lib = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("CONDMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "condmem")
    return Path(root) / "native"


def _load():
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("CONDMEM_NATIVE", "1") == "0":
            log.info("native CPU gather disabled (CONDMEM_NATIVE=0): using torch.index_select")
            return None
        cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        if cc is None:
            log.warning("no C compiler found: the CPU gather falls back to torch.index_select (slower on big tables)")
            return None
        digest = hashlib.sha256((_SOURCE + cc).encode()).hexdigest()[:16]
        target = _cache_dir() / f"gather-{digest}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "gather.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / "gather.so"
                cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    log.warning("compiling the native CPU gather failed (%s): falling back to torch.index_select",
                                proc.stderr.strip()[:300])
                    return None
                os.replace(out, target)  # atomic: concurrent processes see a whole file or none
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:
            log.warning("loading the native CPU gather failed (%s): falling back to torch.index_select", exc)
            return None
        lib.condmem_gather_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_int]
        lib.condmem_gather_rows.restype = None
        _lib = lib
        return lib


def available() -> bool:
    """True when the native gather compiled and loaded."""
    return _load() is not None


def native_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                       threads: int | None = None) -> torch.Tensor | None:
    """Rows ``table[ids]`` into `out` (uint8 [n, row_bytes]); None when the native code is unavailable.

    `table` is uint8 [rows, row_bytes] on the CPU (any memory: pinned, mmap'd, plain);
    `ids` int64 on the CPU, all in range (callers check); `out` contiguous.
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
        lib.condmem_gather_rows(table.data_ptr(), table.shape[1], ids.data_ptr(), n, out.data_ptr(),
                                int(threads or torch.get_num_threads()))
    return out
