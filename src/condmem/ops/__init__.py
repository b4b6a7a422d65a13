"""Engram's kernels, one folder per op: a plain-torch reference beside its Triton version.

`hash/`, `gather/`, `row_cache/`, `row_grad/`, `row_patch/`, `gate/`, `attention/`, `norm_act/`: each op's
public function picks the Triton kernel for CUDA tensors (or under ``TRITON_INTERPRET=1``) and the reference
elsewhere (`triton_util.resolve_backend`, ``backend=`` forces either).
`sparse_adam_triton.py`: the tables' lazy Adam step in two launches and a scan
(`condmem.train.optim.SparseAdam` runs it on CUDA; its torch path is the reference). One
policy for an optional Triton: only modules named ``triton.py`` (and ``*_triton.py``) import it, at their
top, and they are imported inside the dispatching function, so a CPU-only install without
Triton imports every other module. Nothing here imports `condmem.tables`.
"""

from condmem.ops.gate import engram_gate, engram_gate_reference
from condmem.ops.short_conv import ShortConv

__all__ = ["engram_gate", "engram_gate_reference", "ShortConv"]
