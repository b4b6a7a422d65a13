"""The n-gram hash of Engram's addressing: plain-torch references and their Triton kernels.

* `reference.py`: `hash_reference` (whole padded sequences), `hash_decode_reference` (one token
  per sequence against its history) and the per-order mixes;
* `ragged_reference.py`: flat varlen batches with look-back, and the history advance;
* `triton.py`: prefill, decode, ragged and advance kernels, held to those references with
  `torch.equal` (imported only when the Triton backend runs).

`condmem.hashing.NgramHasher` is the user-facing object that picks between them.
"""

from condmem.ops.hash.reference import hash_reference, ngram_mixes

__all__ = ["hash_reference", "ngram_mixes"]
