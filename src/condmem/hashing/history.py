"""`NgramHistory`: the look-back of every sequence, one slot each: what hashing its next tokens reads.

A token's row ids depend on it and the N-1 tokens before it. Every owner of sequences keeps
that look-back here, in one of two forms:

* rolling (default): the last N-1 compressed ids of each slot on the device, in a
  [n_slots, N-1] table (column j holds the id j+1 positions back, the pad where the
  sequence is shorter or a block hides it), so one kernel launch hashes one new token
  per sequence and writes the updated history with no host round trip (`EngramMemory`,
  the Hugging Face decode state);
* by position (``max_len``): each slot's token ids by position (`InferenceCache`,
  `ServingCache`), whose look-back before any position is cut by `window`, so a cache
  whose length is set back (speculative tokens rejected) or whose prefix is copied to
  another slot (a prefix-cache hit) carries its look-back with it.

Slots are handed out and taken back on the host (`allocate`, `free`); the device
table is only touched by `reset`, `prefill` and the decode step. Padding rows of a
decode batch (slot -1, or ``valid`` False, e.g. CUDA-graph padding) neither read nor
write any slot, also when they name a live one.

`condmem.ops.hash.reference.hash_decode_reference` is the plain-torch decode step the Triton
kernel is held to.
"""

from __future__ import annotations

import torch


class HistoryError(ValueError):
    """A slot is unknown, exhausted, freed twice, or a batch does not fit the history."""


class NgramHistory:
    """Per-sequence look-back state (see the module docstring for its two forms).

    Args:
        n_slots: most sequences decoded at once.
        max_ngram_size: N (the look-back is N-1 tokens).
        pad_id: compressed id of the pad (what a fresh or reset slot holds).
        device: where the table lives (the device of the decode batch).
        max_len: keep each slot's token ids by position, up to `max_len` of them, instead
            of the rolling last N-1 compressed ids.

    Attributes:
        ids: rolling form: int64 [n_slots, N-1]; ``ids[s, j]`` is the compressed id j+1
            positions before the next token of the sequence in slot s. None by position.
        tokens: by position: int64 [n_slots, max_len] token ids; None when rolling.

    Example:
        >>> hist = hasher.new_history(n_slots=64, device="cuda")
        >>> s = hist.allocate()
        >>> hist.prefill(torch.tensor([s]), prompt_compressed_ids)       # [1, T]
        >>> row_ids = hasher.decode(hist, torch.tensor([s], device="cuda"), next_token_ids)
    """

    def __init__(
        self,
        n_slots: int,
        max_ngram_size: int,
        pad_id: int,
        device: torch.device | str = "cpu",
        *,
        max_len: int | None = None,
    ):
        if n_slots < 1:
            raise HistoryError(f"n_slots must be >= 1, got {n_slots}")
        if max_ngram_size < 2:
            raise HistoryError(f"max_ngram_size must be >= 2, got {max_ngram_size}")
        self.n_slots = int(n_slots)
        self.max_ngram_size = int(max_ngram_size)
        self.pad_id = int(pad_id)
        device = torch.device(device)
        self.ids: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        if max_len is None:
            self.ids = torch.full(
                (self.n_slots, self.max_ngram_size - 1), self.pad_id, dtype=torch.int64, device=device
            )
        else:
            self.tokens = torch.zeros(self.n_slots, int(max_len), dtype=torch.int64, device=device)
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._live: set[int] = set()

    @property
    def device(self) -> torch.device:
        return (self.ids if self.ids is not None else self.tokens).device

    @property
    def max_len(self) -> int | None:
        """Positions a slot holds in the by-position form (None when rolling)."""
        return None if self.tokens is None else self.tokens.shape[1]

    # ------------------------------------------------------------------ by position
    def _positions(self) -> torch.Tensor:
        if self.tokens is None:
            raise HistoryError("this history keeps the rolling last N-1 ids, not token ids by position (max_len)")
        return self.tokens

    def record(
        self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """By position: ``tokens[slots[b], positions[b]] = ids[b]``, except rows where `valid` is False."""
        tokens = self._positions()
        ids = ids.to(tokens.dtype)
        if valid is not None:
            ids = torch.where(valid, ids, tokens[slots, positions])
        tokens[slots, positions] = ids

    def write(self, batch: int, start: int, ids: torch.Tensor) -> None:
        """By position: rows 0..batch-1 hold `ids` [batch, T] at positions start..start+T-1."""
        self._positions()[:batch, start : start + ids.shape[1]] = ids

    def span(self, batch: int, start: int, stop: int) -> torch.Tensor:
        """By position: the token ids of rows 0..batch-1 at positions start..stop-1 (a view; 0 <= start)."""
        return self._positions()[:batch, start:stop]

    def window(self, slots: torch.Tensor, ends: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """By position: the token ids of slot ``slots[b]`` at positions ``ends[b]-width .. ends[b]-1``.

        Returns:
            (ids [B, width], before bool [B, width]: True where the position precedes the
            sequence's start; its id there is position 0's, to be read as blocked).
        """
        tokens = self._positions()
        back = ends.reshape(-1, 1) - torch.arange(width, 0, -1, device=ends.device)[None, :]  # oldest first
        return tokens[slots.reshape(-1, 1), back.clamp(min=0)], back < 0

    def copy_rows(self, slots: torch.Tensor, source: NgramHistory, width: int) -> None:
        """By position: slots ``slots[j]`` take the first `width` positions of `source`'s row j."""
        self._positions()[slots, :width] = source._positions()[: slots.numel(), :width]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """By position: slot `dst` takes the token ids of slot `src`'s first `n` positions."""
        tokens = self._positions()
        tokens[dst, :n] = tokens[src, :n]

    @property
    def depth(self) -> int:
        """N-1: ids kept per slot."""
        return self.max_ngram_size - 1

    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    def allocate(self) -> int:
        """A free slot, reset to the pad (a new sequence starts with nothing before it)."""
        if not self._free:
            raise HistoryError(f"all {self.n_slots} history slots are in use; free one or make a larger history")
        slot = self._free.pop()
        self._live.add(slot)
        if self.ids is not None:
            self.ids[slot].fill_(self.pad_id)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; its contents are reset when it is handed out again."""
        slot = int(slot)
        if slot not in self._live:
            raise HistoryError(f"slot {slot} is not allocated (freed twice, or never handed out?)")
        self._live.remove(slot)
        self._free.append(slot)

    def reset(self, slots: torch.Tensor | list[int]) -> None:
        """Fill the given slots with the pad (no host sync)."""
        if self.ids is None:
            return  # by position: a slot's look-back follows the length its owner keeps
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        self.ids.index_fill_(0, index, self.pad_id)

    @staticmethod
    def tail_history(
        compressed: torch.Tensor,
        depth: int,
        pad_id: int,
        *,
        blocked: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T] compressed ids -> [B, depth]: what the token after position ``lengths-1`` looks back at.

        Column j is the id j+1 positions back from position ``lengths`` (default T): the
        pad before the start, and behind any blocked position (the block cascades).
        """
        batch, length = compressed.shape
        device = compressed.device
        if lengths is None:
            lengths = torch.full((batch,), length, dtype=torch.int64, device=device)
        lengths = lengths.to(device=device, dtype=torch.int64)
        k = torch.arange(1, depth + 1, device=device)
        pos = lengths[:, None] - k[None, :]  # [B, depth]
        inside = pos >= 0
        idx = pos.clamp(0, max(length - 1, 0))
        if length == 0:
            return torch.full((batch, depth), pad_id, dtype=torch.int64, device=device)
        vals = torch.gather(compressed.long(), 1, idx)
        hidden = ~inside
        if blocked is not None:
            b = torch.gather(blocked, 1, idx) & inside
            hidden = hidden | (torch.cumsum(b.to(torch.int32), dim=1) > 0)
        return torch.where(hidden, torch.full_like(vals, pad_id), vals)

    def prefill(
        self,
        slots: torch.Tensor | list[int],
        compressed: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Set each slot's history from its prompt: [B] slots, [B, T] compressed ids.

        Args:
            slots: [B] slot of each prompt row.
            compressed: [B, T] compressed ids of the prompts (right-padded when `lengths` is given).
            blocked: optional bool [B, T] blocked positions (see `NgramHasher.__call__`).
            lengths: optional [B] true prompt lengths.
        """
        if self.ids is None:
            raise HistoryError("prefill seeds the rolling form; a history by position records token ids (write)")
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        if compressed.dim() != 2 or compressed.shape[0] != index.numel():
            raise HistoryError(f"prefill needs [B={index.numel()}, T] compressed ids, got {tuple(compressed.shape)}")
        tail = self.tail_history(
            compressed.to(self.device),
            self.depth,
            self.pad_id,
            blocked=None if blocked is None else blocked.to(self.device),
            lengths=lengths,
        )
        self.ids.index_copy_(0, index, tail)

    def __repr__(self) -> str:
        form = "rolling" if self.ids is not None else f"by position, max_len={self.max_len}"
        return (
            f"NgramHistory(slots={self.n_slots}, N={self.max_ngram_size}, {form}, live={len(self._live)}, "
            f"device={self.device})"
        )
