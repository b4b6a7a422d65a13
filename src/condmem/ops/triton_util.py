"""Small helpers shared by the Triton kernels: backend choice, interpreter mode, grid sizes.

Kernels run on a CUDA device, or on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, how CI runs them). The interpreter must be switched on
before ``triton`` is imported; `interpreting()` reads the same variable.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_IMPORTS: bool | None = None


def triton_available() -> bool:
    """Whether ``import triton`` works (tried once). Cached in a module global, not a
    ``functools.lru_cache``: torch.compile traces a global's read plainly, and warns of a cache."""
    global _TRITON_IMPORTS
    if _TRITON_IMPORTS is None:
        try:
            import triton  # noqa: F401

            _TRITON_IMPORTS = True
        except ImportError:
            _TRITON_IMPORTS = False
    return _TRITON_IMPORTS


def resolve_backend(backend: str | None, device: torch.device, what: str) -> str:
    """'triton' or 'torch' for work on `device`.

    ``auto`` (or None) picks Triton on CUDA and the torch reference elsewhere; ``triton``
    forces the kernel (on CPU only under ``TRITON_INTERPRET=1``); ``torch`` forces the
    reference.
    """
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{what}: backend='triton' but triton is not installed")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{what}: backend='triton' on a {device.type} tensor needs a CUDA device, or TRITON_INTERPRET=1 "
            "set before triton is imported (the interpreter runs kernels on CPU tensors)"
        )
    return "triton"


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(n_blocks: int, device: torch.device, per_sm: int = 4, interp_programs: int = 3) -> int:
    """Grid size of a persistent kernel: at most `per_sm` programs per multiprocessor.

    In the interpreter a small fixed count still makes programs loop over several blocks.
    """
    if n_blocks <= 0:
        return 0
    if device.type != "cuda":
        return min(n_blocks, interp_programs)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(n_blocks, _sm_count(index) * per_sm)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints: `triton.cdiv` without its constexpr wrapper (a launcher calls it on every launch)."""
    return -(-a // b)
