"""The CUDA runtime library torch loaded: the staged send's ``cudaMemcpyAsync``,
``cudaEventRecord`` and ``cudaEventQuery``.

``gather.c`` takes those calls as function pointers, so it builds without CUDA headers and a
CPU-only install works. They must come from the very copy of the runtime torch uses (its
context, streams and events): the library is opened by its soname with ``RTLD_NOLOAD``, so
``dlopen`` returns the one already loaded under that name (torch's) and never loads another.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import NamedTuple

import torch

log = logging.getLogger("condmem.native")


class CudaRuntime(NamedTuple):
    """Addresses of the runtime calls the staged send makes, and a way to name an error code."""

    memcpy_async: int
    event_record: int
    event_query: int
    error_string: object
    """Callable[[int], str]: ``cudaGetErrorString``."""


def cudart_soname(cuda_version: str | None) -> str | None:
    """The CUDA runtime's soname for torch's CUDA version (``"12.8"`` -> ``libcudart.so.12``);
    None for a CPU-only torch."""
    major = (cuda_version or "").split(".")[0]
    return f"libcudart.so.{major}" if major.isdigit() else None


@functools.cache   # once per process: a send asks on every call
def cuda_runtime() -> CudaRuntime | None:
    """The runtime calls of the CUDA runtime torch loaded, or None where there is none to use
    (no CUDA device; a torch that links the runtime statically: logged as a warning, since
    staged sends then take the slower Python loop)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    soname = cudart_soname(torch.version.cuda)
    try:
        lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL) if soname else None
    except OSError:
        lib = None
    if lib is None:
        log.warning("CUDA runtime %s is not among the libraries torch loaded: staged sends take the Python loop "
                    "(a text batch's 105K rows 2.0 ms instead of 1.0 ms on the H200's host, docs/lookup-engine.md)",
                    soname or f"of CUDA {torch.version.cuda}")
        return None
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]

    def error_string(code: int) -> str:
        return lib.cudaGetErrorString(code).decode(errors="replace")

    calls = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
             for name in ("cudaMemcpyAsync", "cudaEventRecord", "cudaEventQuery")]
    return CudaRuntime(*calls, error_string)
