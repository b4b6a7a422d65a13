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

from condmem.config import ConfigError, EngramConfig
from condmem.layout import EngramLayout, LayoutError
from condmem.hashing import NgramHasher, HashInputError
from condmem.module import Engram, EngramTable

__version__ = "0.1.0"


def __getattr__(name: str):
    # The tokenizer pulls in `tokenizers`; load it on first use only.
    if name in {"CompressedTokenizer", "TokenizerMismatchError", "TokenIdError"}:
        from condmem import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'condmem' has no attribute {name!r}")


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
