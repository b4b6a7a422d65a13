"""The Engram gate: `engram_gate` runs the fused Triton kernel (`triton.py`, forward and
backward) on CUDA tensors and the fp32 reference (`reference.py`) elsewhere and under
`torch.compile` (Inductor fuses its plain ops with the ones around them); ``backend=``
forces either."""

from __future__ import annotations

import torch

from condmem.ops.gate.reference import GATE_CLAMP, engram_gate_reference, gate_values
from condmem.ops.triton_util import resolve_backend, triton_available

__all__ = ["GATE_CLAMP", "engram_gate", "engram_gate_reference", "gate_values"]


def engram_gate(
    hidden, kv, q_weight, k_weight, eps=1e-6, clamp=GATE_CLAMP, token_mask=None, *, residual=False, backend=None
):
    """The gate, dispatched: the fused Triton kernel on CUDA, the reference elsewhere.

    Arguments and result as in `engram_gate_reference` (`residual`: return ``hidden + gate * v``,
    the residual add fused in); ``backend`` is ``"auto"`` (default),
    ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``) or ``"torch"``. Both are
    differentiable.
    """
    if backend in (None, "auto") and torch.compiler.is_compiling():
        # Traced, the Triton kernel's float scalars would reach it as fp64 tensors; the
        # reference's ops compile into fused kernels of their own.
        return engram_gate_reference(hidden, kv, q_weight, k_weight, eps, clamp, token_mask, residual)
    if (backend is None and hidden.is_cuda and triton_available()) or resolve_backend(
        backend, hidden.device, "engram_gate"
    ) == "triton":
        return _triton().engram_gate_triton(hidden, kv, q_weight, k_weight, eps, clamp, token_mask, residual)
    return engram_gate_reference(hidden, kv, q_weight, k_weight, eps, clamp, token_mask, residual)


_TRITON = None


def _triton():
    """`condmem.ops.gate.triton`, imported at the first Triton call (importing it imports triton)."""
    global _TRITON
    if _TRITON is None:
        from condmem.ops.gate import triton as kernels

        _TRITON = kernels
    return _TRITON
