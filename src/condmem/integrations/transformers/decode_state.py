"""Per-cache decode state of a Hugging Face model with Engram: n-gram look-back and ShortConv inputs.

A cached forward sees only the new tokens. Their hashes need the N-1 tokens before them,
and the ShortConv needs the Engram outputs of the last (kernel-1)*dilation positions.
Both are kept here, one entry per cache object, and advance with that cache: written
after every forward under the cache the forward returns, and reordered with it when
beam search reorders the cache. The look-back is an `NgramHistory` (one slot per batch
row), the one look-back state of condmem. Entries hold only weak references to caches,
so a finished generation leaves nothing behind.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from condmem.hashing import NgramHasher, NgramHistory


class DecodeState:
    """What the next cached forward of a batch needs from the forwards before it.

    The look-back (`history`) is made only when first read: inside generate() the next forward
    reads generate's own sequences instead, so most states are never read and a decode step
    queues no op for them. Make one with `of_window` or `after`.

    Args:
        batch: rows of the batch.
        length: positions the cache held after the forward that wrote this state.
        make: builds the look-back when first read.
    """

    def __init__(self, batch: int, length: int, make: Callable[[], NgramHistory]):
        self.batch, self.length = batch, length
        self._make: Callable[[], NgramHistory] | None = make
        self._history: NgramHistory | None = None
        self.conv: dict[int, torch.Tensor] = {}
        """Per Engram layer with ShortConv: its last (kernel-1)*dilation gated outputs [B, pad, 1, D]."""

    @classmethod
    def of_window(cls, hasher: NgramHasher, ids: torch.Tensor, valid: torch.Tensor | None, length: int) -> DecodeState:
        """The state after token ids [B, L] (a forward's look-back and tokens, or its tokens alone);
        `valid` [B, L] False (0) at padding: bool, or an attention mask's 0/1 columns; None: every
        position is a token."""

        return cls(ids.shape[0], length, lambda: last_columns(hasher, ids, valid))

    @classmethod
    def after(
        cls, hasher: NgramHasher, before: NgramHistory, ids: torch.Tensor, valid: torch.Tensor | None, length: int
    ) -> DecodeState:
        """The state after new token ids [B, T] that followed look-back `before` (`valid`: bool [B, T],
        False at padding; None: all tokens)."""

        def make() -> NgramHistory:
            batch, new = ids.shape
            history = hasher.new_history(batch, ids.device)
            history.ids.copy_(before.ids)
            slots = torch.arange(batch, device=ids.device)
            cu = torch.arange(batch + 1, device=ids.device) * new
            blocked = None if valid is None else ~valid.reshape(-1)
            hasher.commit(history, slots, ids.reshape(-1), cu, torch.full_like(slots, new), blocked=blocked)
            return history

        return cls(ids.shape[0], length, make)

    @property
    def history(self) -> NgramHistory:
        """The look-back of each row (slot b is row b)."""
        if self._history is None:
            self._history, self._make = self._make(), None
        return self._history

    def select(self, index: torch.Tensor) -> DecodeState:
        """The state of batch rows `index` (beam search's reorder)."""
        history = self.history
        index = index.to(history.device)
        picked = NgramHistory(index.numel(), history.max_ngram_size, history.pad_id, history.device)
        picked.ids.copy_(history.ids.index_select(0, index))
        state = DecodeState(index.numel(), self.length, lambda: picked)
        state.conv = {lid: c.index_select(0, index.to(c.device)) for lid, c in self.conv.items()}
        return state


def last_columns(hasher: NgramHasher, ids: torch.Tensor, valid: torch.Tensor | None) -> NgramHistory:
    """The look-back after token ids [B, L]: their last N-1 columns (the pad before a row's start and
    behind its padding) as an `NgramHistory`, slot b holding row b."""
    blocked = None if valid is None else (~valid if valid.dtype == torch.bool else valid == 0)
    history = hasher.new_history(ids.shape[0], ids.device)
    slots = torch.arange(ids.shape[0], device=ids.device)
    hasher.prefill_history(history, slots, ids, blocked=blocked, check=False)
    return history


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
