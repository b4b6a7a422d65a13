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

import torch


class DecodeState:
    """What the next cached forward of a batch needs from the forwards before it.

    The look-back is cut from the forward's ids only when first read (`tokens`, `valid`):
    inside generate() the next forward reads generate's own sequences instead, so most states
    are never read and a decode step queues no op for them.

    Args:
        ids: int64 [B, L]: the forward's look-back and tokens (or a look-back alone).
        valid: [B, L], False (0) at padding: bool, or an attention mask's 0/1 columns; None: every
            position is a token.
        depth: N-1, the look-back kept.
        pad_id: the id left of a sequence shorter than `depth` (marked not valid).
        length: positions the cache held after the forward that wrote this state.
    """

    def __init__(self, ids: torch.Tensor, valid: torch.Tensor | None, depth: int, pad_id: int, length: int):
        self._window = (ids, valid, depth, pad_id)
        self._tail: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = length
        self.conv: dict[int, torch.Tensor] = {}
        """Per Engram layer with ShortConv: its last (kernel-1)*dilation gated outputs [B, pad, 1, D]."""

    @property
    def tokens(self) -> torch.Tensor:
        """int64 [B, N-1]: the last N-1 token ids, oldest first (any id where `valid` is False)."""
        return self._look_back()[0]

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, N-1]: False where there was no token yet, or it was padding (blocked)."""
        return self._look_back()[1]

    @property
    def batch(self) -> int:
        return self._window[0].shape[0]

    def _look_back(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tail is None:
            ids, valid, depth, pad_id = self._window
            if valid is None:
                valid = torch.ones_like(ids, dtype=torch.bool)
            elif valid.dtype != torch.bool:
                valid = valid != 0  # a 2-D attention mask's columns as given (0/1)
            self._tail = last_columns(ids, valid, depth, pad_id)
        return self._tail

    def select(self, index: torch.Tensor) -> DecodeState:
        """The state of batch rows `index` (beam search's reorder)."""
        tokens, valid = self._look_back()
        index = index.to(tokens.device)
        _, _, depth, pad_id = self._window
        state = DecodeState(tokens.index_select(0, index), valid.index_select(0, index), depth, pad_id, self.length)
        state.conv = {lid: c.index_select(0, index.to(c.device)) for lid, c in self.conv.items()}
        return state


def last_columns(
    tokens: torch.Tensor, valid: torch.Tensor, depth: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `depth` columns of [B, L] tokens / valid, left-filled with an invalid pad when L < depth."""
    tokens, valid = tokens[:, max(0, tokens.shape[1] - depth) :], valid[:, max(0, valid.shape[1] - depth) :]
    short = depth - tokens.shape[1]
    if short > 0:
        tokens = torch.cat([tokens.new_full((tokens.shape[0], short), pad_id), tokens], dim=1)
        valid = torch.cat([valid.new_zeros((valid.shape[0], short)), valid], dim=1)
    return tokens, valid


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
