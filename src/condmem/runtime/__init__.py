"""Kept so that ``from condmem.runtime import EngramMemory`` goes on working: the memory lives in `condmem.serving`."""

from condmem.serving.memory import EngramMemory, EngramMemoryError, Prepared

__all__ = ["EngramMemory", "EngramMemoryError", "Prepared"]
