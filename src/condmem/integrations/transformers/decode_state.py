"""Per-cache decode state of a Hugging Face model with Engram: n-gram look-back and ShortConv inputs.

A cached forward sees only the new tokens. Their hashes need the N-1 tokens before them,
and the ShortConv needs the Engram outputs of the last (kernel-1)*dilation positions.
Both are kept here, one entry per cache object, and advance with that cache: written
after every forward under the cache the forward returns, and reordered with it when
beam search reorders the cache. Entries hold only weak references to caches, so a
finished generation leaves nothing behind.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeState:
    """What the next cached forward of a batch needs from the forwards before it."""

    tokens: torch.Tensor
    """int64 [B, N-1]: the last N-1 token ids, oldest first (any id where `valid` is False)."""
    valid: torch.Tensor
    """bool [B, N-1]: False where there was no token yet, or it was padding (blocked)."""
    length: int
    """Positions the cache held after the forward that wrote this state."""
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per Engram layer with ShortConv: its last (kernel-1)*dilation gated outputs [B, pad, 1, D]."""

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: torch.Tensor) -> "DecodeState":
        """The state of batch rows `index` (beam search's reorder)."""
        index = index.to(self.tokens.device)
        conv = {lid: c.index_select(0, index.to(c.device)) for lid, c in self.conv.items()}
        return DecodeState(self.tokens.index_select(0, index), self.valid.index_select(0, index), self.length, conv)


class DecodeStates:
    """DecodeState per live cache object (weakly keyed)."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, cache) -> DecodeState | None:
        try:
            return self._states.get(cache)
        except TypeError:  # a cache that cannot be weakly referenced (a legacy tuple) has no state
            return None

    def put(self, cache, state: DecodeState) -> None:
        try:
            self._states[cache] = state
        except TypeError:
            pass

    def reorder(self, cache, beam_idx: torch.Tensor) -> None:
        """Follow the cache's `reorder_cache(beam_idx)`."""
        state = self.get(cache)
        if state is not None:
            self.put(cache, state.select(beam_idx))
