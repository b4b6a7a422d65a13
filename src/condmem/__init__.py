"""condmem: Engram conditional memory for PyTorch.

Hashed n-gram embedding tables read with O(1) lookups whose addresses depend only on
the input tokens (DeepSeek, arXiv 2601.07372), bit-exact with released checkpoints.

Main entry points:

* `EngramConfig`: geometry (reads DeepSeek-V4.1 and official-demo config keys);
* `CompressedTokenizer`: token id -> compressed id map;
* `EngramLayout`: primes, offsets, multipliers, table sizes, fingerprint;
* `NgramHasher`: token ids -> row ids for every Engram layer at once;
* `Engram`: the gated memory module for one layer.
"""

from __future__ import annotations

import importlib

from condmem.config import ConfigError, EngramConfig

__version__ = "0.1.0"

# Loaded on first use: numpy, torch and tokenizers take seconds to import, and the command
# line (`condmem --help`, argument errors) needs none of them.
_LAZY = {
    "EngramLayout": "condmem.layout",
    "LayoutError": "condmem.layout",
    "NgramHasher": "condmem.hashing",
    "HashInputError": "condmem.hashing",
    "Engram": "condmem.module",
    "EngramTable": "condmem.module",
    "CompressedTokenizer": "condmem.tokenizer",
    "TokenizerMismatchError": "condmem.tokenizer",
    "TokenIdError": "condmem.tokenizer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'condmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ConfigError",
    "EngramConfig",
    "EngramLayout",
    "LayoutError",
    "NgramHasher",
    "HashInputError",
    "Engram",
    "EngramTable",
    "CompressedTokenizer",
    "TokenizerMismatchError",
    "TokenIdError",
    "__version__",
]
