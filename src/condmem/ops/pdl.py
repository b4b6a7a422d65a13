"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A kernel launched with PDL on an sm90+ GPU may be scheduled while the kernel before it in
the stream drains; it waits (`dependent_launch_wait`, its first statement) until that
kernel has finished and its writes are visible, so correctness is unchanged and the launch
gap between a chain of small kernels (norms, attention, activations) is hidden. It also
lets the kernel after it launch early. Off in the interpreter and on older GPUs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _SUPPORTED = True
except ImportError:                                          # a Triton without grid dependency control
    _SUPPORTED = False

ENABLED = True          # a switch for A/B runs (benchmarks/probes/decode_pdl_ab.py)


@functools.lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass as the kernel's PDL constexpr and
    as ``launch_pdl``)."""
    if not (ENABLED and _SUPPORTED) or device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def dependent_launch_wait(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream (a no-op without PDL), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
