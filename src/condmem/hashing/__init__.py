"""N-gram hashing: compressed token ids -> table row ids for every Engram layer."""

from condmem.hashing.hasher import HashInputError, NgramHasher
from condmem.hashing.reference import hash_reference

__all__ = ["NgramHasher", "HashInputError", "hash_reference"]
