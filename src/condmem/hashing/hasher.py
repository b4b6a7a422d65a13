"""`NgramHasher`: token ids [B, T] -> row ids [B, T, n_layers, n_cols] for every Engram layer.

Row ids depend only on token ids, so one call before the first transformer layer
gives every Engram layer its addresses (what lets tables live off the GPU and be
prefetched). The hasher owns the compression map and the layout's constants, keeps
one copy of them per device, validates its inputs once, and calls the hash
implementation (the torch reference here; Triton kernels plug in behind `backend`).
"""

from __future__ import annotations

import numpy as np
import torch

from condmem.config import EngramConfig
from condmem.hashing.reference import hash_reference
from condmem.layout import EngramLayout


class HashInputError(ValueError):
    """Token ids or masks given to the hasher are of the wrong shape, dtype or range."""


class NgramHasher:
    """Hashes token ids into table row ids for all Engram layers of one model.

    Args:
        layout: the model's `EngramLayout` (its V' must match the compression map).
        token_lookup: compressed id per token id (int array of the tokenizer's size), or
            None when the inputs are compressed ids already.
        pad_id: token id of the pad (a compressed id when `token_lookup` is None);
            defaults to ``layout.config.pad_id``.

    Example:
        >>> hasher = NgramHasher.from_tokenizer(config, CompressedTokenizer.from_any("deepseek-v4"))
        >>> rows = hasher(input_ids)            # [B, T, n_layers, n_cols] int64
        >>> rows_l1 = rows[:, :, hasher.layer_index(1)]
    """

    def __init__(self, layout: EngramLayout, token_lookup=None, pad_id: int | None = None):
        self.layout = layout
        pad_id = layout.config.pad_id if pad_id is None else pad_id
        if token_lookup is not None:
            lookup = torch.from_numpy(np.array(token_lookup, dtype=np.int64)).flatten()
            if lookup.numel() == 0:
                raise HashInputError("token_lookup is empty")
            compressed_size = int(lookup.max()) + 1
            if int(lookup.min()) < 0 or compressed_size != layout.compressed_vocab_size:
                raise HashInputError(
                    f"token_lookup maps onto {compressed_size} compressed ids but the layout was built for "
                    f"V'={layout.compressed_vocab_size}: the tables would be silently rehashed"
                )
            if not 0 <= pad_id < lookup.numel():
                raise HashInputError(f"pad_id {pad_id} is outside the tokenizer's ids 0..{lookup.numel() - 1}")
            self.vocab_size = lookup.numel()
            self.pad_compressed_id = int(lookup[pad_id])
        else:
            lookup = None
            self.vocab_size = layout.compressed_vocab_size
            if not 0 <= pad_id < self.vocab_size:
                raise HashInputError(f"pad_id {pad_id} is outside the compressed ids 0..{self.vocab_size - 1}")
            self.pad_compressed_id = pad_id
        self._host = {
            "lookup": lookup,
            "multipliers": torch.from_numpy(layout.multipliers_array()),
            "primes": torch.from_numpy(layout.primes_array()),
            "offsets": torch.from_numpy(layout.offsets_array()),
        }
        self._per_device: dict[torch.device, dict[str, torch.Tensor | None]] = {}

    @classmethod
    def from_tokenizer(cls, config: EngramConfig, tokenizer) -> "NgramHasher":
        """Build the layout and hasher for a `CompressedTokenizer`, checking V' against the config."""
        layout = EngramLayout(config, compressed_vocab_size=tokenizer.vocab_size)
        return cls(layout, token_lookup=tokenizer.lookup, pad_id=config.pad_id)

    # ------------------------------------------------------------------ helpers
    @property
    def layer_ids(self) -> list[int]:
        return self.layout.layer_ids

    @property
    def n_cols(self) -> int:
        return self.layout.n_cols

    def layer_index(self, layer_id: int) -> int:
        """Index of `layer_id` along the hasher's layer axis."""
        return self.layout.layer_index(layer_id)

    def constants(self, device: torch.device | str) -> dict[str, torch.Tensor | None]:
        """The lookup, multipliers, primes and offsets on `device` (copied once, then cached)."""
        device = torch.device(device)
        if device not in self._per_device:
            self._per_device[device] = {
                k: (None if v is None else v.to(device)) for k, v in self._host.items()
            }
        return self._per_device[device]

    def _check_ids(self, input_ids: torch.Tensor, name: str = "input_ids") -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise HashInputError(f"{name} must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise HashInputError(f"{name} must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            hint = " (add a batch axis: ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
            raise HashInputError(f"{name} must be [B, T], got shape {tuple(input_ids.shape)}{hint}")

    def _check_mask(self, mask: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise HashInputError(f"{name} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
        if mask.shape != like.shape:
            raise HashInputError(f"{name} has shape {tuple(mask.shape)}, input_ids {tuple(like.shape)}")
        return mask.to(like.device)

    def compress(self, input_ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Token ids [B, T] -> int64 compressed ids; `check` validates the id range (one host sync)."""
        self._check_ids(input_ids)
        ids = input_ids.long()
        if check and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                what = "tokenizer" if self._host["lookup"] is not None else "compressed vocabulary"
                raise HashInputError(
                    f"token id {bad} is outside the {what}'s ids 0..{self.vocab_size - 1}: "
                    "were these ids made by another tokenizer?"
                )
        lookup = self.constants(ids.device)["lookup"]
        return ids if lookup is None else lookup[ids]

    @staticmethod
    def blocked_from_doc_starts(doc_starts: torch.Tensor) -> torch.Tensor:
        """Packed batches: a position before a document start is blocked for the documents after it."""
        blocked = torch.zeros_like(doc_starts)
        blocked[:, :-1] = doc_starts[:, 1:]
        return blocked

    # ------------------------------------------------------------------ hashing
    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
        doc_starts: torch.Tensor | None = None,
        with_offsets: bool = True,
        check: bool = True,
    ) -> torch.Tensor:
        """Row ids for every Engram layer.

        Args:
            input_ids: [B, T] integer token ids (any device).
            blocked: optional bool [B, T]: positions no later look-back may read (image
                spans); the block cascades to every older position.
            doc_starts: optional bool [B, T]: first token of each document in a packed
                row; look-backs stop there (same as blocking the position before).
            with_offsets: True -> row ids into each layer's table; False -> bucket ids
                within each column's prime range.
            check: validate the id range (costs one device->host sync on GPU).

        Returns:
            int64 [B, T, n_layers, n_cols] on the device of `input_ids`.
        """
        compressed = self.compress(input_ids, check=check)
        blocked = self._check_mask(blocked, input_ids, "blocked")
        doc_starts = self._check_mask(doc_starts, input_ids, "doc_starts")
        if doc_starts is not None:
            from_docs = self.blocked_from_doc_starts(doc_starts)
            blocked = from_docs if blocked is None else blocked | from_docs
        return self.hash_compressed(compressed, blocked=blocked, with_offsets=with_offsets)

    def hash_compressed(
        self, compressed: torch.Tensor, *, blocked: torch.Tensor | None = None, with_offsets: bool = True
    ) -> torch.Tensor:
        """Like `__call__` but for compressed ids already (no range check)."""
        c = self.constants(compressed.device)
        return hash_reference(
            compressed,
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=c["offsets"] if with_offsets else None,
            n_heads=self.layout.n_heads,
            pad_id=self.pad_compressed_id,
            blocked=blocked,
        )

    def __repr__(self) -> str:
        return f"NgramHasher({self.layout!r}, vocab={self.vocab_size}, pad->{self.pad_compressed_id})"
