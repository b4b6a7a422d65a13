"""The CUDA libraries torch loaded: the runtime's ``cudaMemcpyAsync``, ``cudaEventRecord`` and
``cudaEventQuery`` (the staged send), and the driver's stream memory operations (the decode
row server's handshake, `stream_memops`).

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


@functools.cache  # once per process: a send asks on every call
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
        log.warning(
            "CUDA runtime %s is not among the libraries torch loaded: staged sends take the Python loop "
            "(about twice as slow: docs/lookup-engine.md#native-code)",
            soname or f"of CUDA {torch.version.cuda}",
        )
        return None
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]

    def error_string(code: int) -> str:
        return lib.cudaGetErrorString(code).decode(errors="replace")

    calls = [
        ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        for name in ("cudaMemcpyAsync", "cudaEventRecord", "cudaEventQuery")
    ]
    return CudaRuntime(*calls, error_string)


class StreamMemops(NamedTuple):
    """The driver's stream memory operations on 32-bit words (``cuStreamWriteValue32``,
    ``cuStreamWaitValue32``): a stream writes a word, or waits until a word equals a value,
    without a kernel (the wait holds no SM). Both are captured into CUDA graphs. The address
    may be page-locked host memory (its host pointer, under unified addressing)."""

    write: object
    """Callable[[torch.cuda.Stream, int, int], None]: once the stream's earlier work is done
    (and visible system-wide), write the value at the address."""
    wait: object
    """Callable[[torch.cuda.Stream, int, int], None]: later work on the stream waits until the
    word at the address equals the value."""


_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


@functools.cache
def stream_memops() -> StreamMemops | None:
    """`StreamMemops` of the CUDA driver torch uses (``libcuda.so.1``, already loaded), or None
    without a CUDA device or where the driver lacks them."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError:
        return None
    calls = {}
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        calls[name] = fn
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(what: str, code: int) -> None:
        if code:
            msg = ctypes.c_char_p()
            lib.cuGetErrorString(code, ctypes.byref(msg))
            raise RuntimeError(
                f"{what} failed: CUDA driver error {code} ({(msg.value or b'?').decode(errors='replace')})"
            )

    def write(stream, address: int, value: int) -> None:
        check("cuStreamWriteValue32", calls["cuStreamWriteValue32"](stream.cuda_stream, address, value, 0))

    def wait(stream, address: int, value: int) -> None:
        check("cuStreamWaitValue32", calls["cuStreamWaitValue32"](stream.cuda_stream, address, value, _WAIT_EQ))

    return StreamMemops(write, wait)
