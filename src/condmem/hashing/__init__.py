"""N-gram hashing: compressed token ids -> table row ids for every Engram layer."""

from condmem.hashing.hasher import HashInputError, NgramHasher
from condmem.hashing.history import NgramHistory
from condmem.ops.hash.reference import hash_reference

__all__ = ["NgramHasher", "NgramHistory", "HashInputError", "hash_reference"]
