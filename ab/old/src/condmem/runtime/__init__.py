"""Inference runtime: `EngramMemory` (hash all layers before layer 0, prefetch rows, decode history)."""

from condmem.runtime.memory import EngramMemory, EngramMemoryError, Prepared

__all__ = ["EngramMemory", "EngramMemoryError", "Prepared"]
