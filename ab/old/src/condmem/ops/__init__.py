"""Engram's dense maths: the gate after the `wkv` projection and the ShortConv branch."""

from condmem.ops.gate import engram_gate, engram_gate_reference
from condmem.ops.short_conv import ShortConv

__all__ = ["engram_gate", "engram_gate_reference", "ShortConv"]
