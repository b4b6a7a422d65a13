"""`NgramHistory`: the last N-1 compressed ids of every decoding sequence, one slot each.

During decode a sequence grows by one token per step; its hash needs only the N-1
tokens before the new one. The history keeps them on the device in a
[n_slots, N-1] table (column j holds the id j+1 positions back, the pad where the
sequence is shorter or a block hides it), so one kernel launch hashes one new token
per sequence and writes the updated history with no host round trip.

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
    """Per-sequence look-back state for decoding.

    Args:
        n_slots: most sequences decoded at once.
        max_ngram_size: N (the history keeps N-1 ids per slot).
        pad_id: compressed id of the pad (what a fresh or reset slot holds).
        device: where the table lives (the device of the decode batch).

    Attributes:
        ids: int64 [n_slots, N-1]; ``ids[s, j]`` is the compressed id j+1 positions
            before the next token of the sequence in slot s.

    Example:
        >>> hist = hasher.new_history(n_slots=64, device="cuda")
        >>> s = hist.allocate()
        >>> hist.prefill(torch.tensor([s]), prompt_compressed_ids)       # [1, T]
        >>> rows = hasher.decode(hist, torch.tensor([s], device="cuda"), next_token_ids)
    """

    def __init__(self, n_slots: int, max_ngram_size: int, pad_id: int, device: torch.device | str = "cpu"):
        if n_slots < 1:
            raise HistoryError(f"n_slots must be >= 1, got {n_slots}")
        if max_ngram_size < 2:
            raise HistoryError(f"max_ngram_size must be >= 2, got {max_ngram_size}")
        self.n_slots = int(n_slots)
        self.max_ngram_size = int(max_ngram_size)
        self.pad_id = int(pad_id)
        self.ids = torch.full(
            (self.n_slots, self.max_ngram_size - 1), self.pad_id, dtype=torch.int64, device=torch.device(device)
        )
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._live: set[int] = set()

    @property
    def device(self) -> torch.device:
        return self.ids.device

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
        return (
            f"NgramHistory(slots={self.n_slots}, N={self.max_ngram_size}, live={len(self._live)}, device={self.device})"
        )
