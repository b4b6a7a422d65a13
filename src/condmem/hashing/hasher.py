"""`NgramHasher`: token ids [B, T] -> row ids [B, T, n_layers, n_cols] for every Engram layer.

Row ids depend only on token ids, so one call before the first transformer layer
gives every Engram layer its addresses (what lets tables live off the GPU and be
prefetched). The hasher owns the compression map and the layout's constants, keeps
one copy of them per device, validates its inputs once, and calls the hash
implementation: the Triton kernels (`condmem.ops.hash.triton`) for CUDA tensors, the torch
references (`condmem.ops.hash.reference`, `ragged_reference`) elsewhere; ``backend="triton"|"torch"``
forces either. Both give identical numbers.

Decoding hashes one new token per sequence against an `NgramHistory` (`new_history`,
`prefill_history`, `decode`). Serving engines hash flat (ragged) batches that mix prefill
chunks, prefix-cache continuations, decode tokens and speculative drafts (`hash_ragged`,
`commit`; see `docs/engines.md`).

On CUDA the default id-range check never waits for the GPU: it is folded into the hash
kernel and raised later (`raise_pending`, `condmem.hashing.id_checks`).
"""

from __future__ import annotations

import numpy as np
import torch

from condmem.config import EngramConfig
from condmem.hashing.history import NgramHistory
from condmem.hashing.id_checks import PendingIdChecks
from condmem.layout import EngramLayout
from condmem.ops.hash.ragged_reference import (
    advance_reference,
    hash_ragged_reference,
    lookback_from_ids,
)
from condmem.ops.hash.reference import hash_decode_reference, hash_reference
from condmem.ops.triton_util import BACKENDS, resolve_backend

_KERNELS = None
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _kernels():
    """`condmem.ops.hash.triton`, imported at the first Triton call (importing it imports triton)."""
    global _KERNELS
    if _KERNELS is None:
        from condmem.ops.hash import triton as kernels

        _KERNELS = kernels
    return _KERNELS


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
        backend: ``"auto"`` (Triton on CUDA tensors, the torch reference elsewhere),
            ``"triton"`` or ``"torch"``; a call's own ``backend=`` overrides it.

    Example:
        >>> hasher = NgramHasher.from_tokenizer(config, CompressedTokenizer.from_any("deepseek-v4"))
        >>> row_ids = hasher(input_ids)         # [B, T, n_layers, n_cols] int64
        >>> row_ids_l1 = row_ids[:, :, hasher.layer_index(1)]
    """

    def __init__(self, layout: EngramLayout, token_lookup=None, pad_id: int | None = None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise HashInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.layout = layout
        self.backend = backend
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
            # A plain int for the kernels: a config's unstated pad id is an int subclass.
            self.pad_compressed_id = int(pad_id)
        self._host = {
            "lookup": lookup,
            "multipliers": torch.from_numpy(layout.multipliers_array()),
            "primes": torch.from_numpy(layout.primes_array()),
            "offsets": torch.from_numpy(layout.offsets_array()),
        }
        self._magic_host: torch.Tensor | None = None
        self._per_device: dict[torch.device, dict[str, torch.Tensor | None]] = {}
        self._triton_consts: dict[torch.device, tuple] = {}
        self._backends: dict[tuple[str, str], str] = {}
        self._depth = layout.max_ngram_size - 1
        self._n_heads = layout.n_heads
        what = "tokenizer" if lookup is not None else "compressed vocabulary"
        self._checks = PendingIdChecks(HashInputError, self.vocab_size, what)

    @classmethod
    def from_tokenizer(cls, config: EngramConfig, tokenizer, backend: str = "auto") -> NgramHasher:
        """Build the layout and hasher for a `CompressedTokenizer`, checking V' against the config."""
        layout = EngramLayout(config, compressed_vocab_size=tokenizer.vocab_size)
        return cls(layout, token_lookup=tokenizer.lookup, pad_id=config.pad_id, backend=backend)

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
        c = self._per_device.get(device)  # a tensor's device: found at once (on every call)
        if c is not None:
            return c
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._per_device:
            self._per_device[device] = {k: (None if v is None else v.to(device)) for k, v in self._host.items()}
        return self._per_device[device]

    def _magic(self, device: torch.device) -> torch.Tensor:
        """Barrett constants of the primes (Triton backend only), cached per device."""
        c = self.constants(device)
        magic = c.get("magic")
        if magic is not None:
            return magic
        if "magic" not in c:
            if self._magic_host is None:
                self._magic_host = _kernels().barrett_magic(self._host["primes"])
            c["magic"] = self._magic_host.to(device)
        return c["magic"]

    def _backend(self, backend: str | None, device: torch.device) -> str:
        key = (backend or self.backend, device.type)
        got = self._backends.get(key)
        if got is None:  # resolved once per (backend, device type): the choice depends on nothing else
            got = self._backends[key] = resolve_backend(key[0], device, "NgramHasher")
        return got

    def _check_ids(self, input_ids: torch.Tensor, name: str = "input_ids") -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise HashInputError(f"{name} must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in _ID_DTYPES:
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
        return mask if mask.device == like.device else mask.to(like.device)

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
        backend: str | None = None,
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
            check: validate the id range. On CUDA this never waits for the GPU: a bad id
                is raised by a later call or by `raise_pending` (see `raise_pending`).
            backend: override the hasher's backend for this call.

        Returns:
            int64 [B, T, n_layers, n_cols] on the device of `input_ids`.
        """
        self._check_ids(input_ids)
        if blocked is not None:
            blocked = self._check_mask(blocked, input_ids, "blocked")
        if doc_starts is not None:
            from_docs = self.blocked_from_doc_starts(self._check_mask(doc_starts, input_ids, "doc_starts"))
            blocked = from_docs if blocked is None else blocked | from_docs
        self._checks.raise_pending()
        device = input_ids.device
        shape = input_ids.shape

        def call() -> str:  # formatted only for an error message
            return f"hasher call on {tuple(shape)} ids"

        if self._backend(backend, device) == "triton":
            # The kernel applies the compression map itself: one launch from token ids to row ids,
            # with the id range folded in on the device.
            n_tokens = input_ids.numel()
            id_range, slot = self._range_target(n_tokens, device) if check else (None, None)
            row_ids = self._hash_triton(input_ids, True, blocked, with_offsets, id_range=id_range)
            if id_range is not None:
                self._submit_range(id_range, slot, n_tokens, call)
            return row_ids
        if check:
            self._checks.submit_ids(input_ids, call)
        compressed = self.compress(input_ids, check=False)
        return self.hash_compressed(compressed, blocked=blocked, with_offsets=with_offsets, backend="torch")

    def _range_target(self, n_tokens: int, device: torch.device) -> tuple:
        """Where a hash kernel writes its per-program id ranges: (its launch argument, the reserved slot or
        None). On CUDA a page-locked slot the kernel writes itself (no device buffer, no copy to queue);
        elsewhere a tensor, checked at once. (None, None) for an empty batch."""
        if not n_tokens:
            return None, None
        kernels = _kernels()
        if device.type == "cuda":
            slot = self._checks.reserve(kernels.id_range_rows(n_tokens), device)
            return slot.pointer, slot
        return kernels.id_range_slots(n_tokens, device), None

    def _submit_range(self, id_range, slot, n_tokens: int, call) -> None:
        """Hand the ranges a launch writes (`_range_target`) to the pending checks."""
        if slot is not None:
            self._checks.submit_written(slot, _kernels().id_range_rows(n_tokens), call)
        else:
            self._checks.submit(id_range, call)

    def raise_pending(self, block: bool = True) -> None:
        """Raise `HashInputError` if an earlier call's token ids were out of range.

        On CUDA the range check of `__call__` / `hash_ragged` runs inside the hash kernel
        and is read back without waiting; the hasher's next call raises it if that work
        has finished, and this raises it now (``block=True`` waits for the GPU: call it
        where you wait anyway; `EngramMemory` does so when row vectors are waited for).
        """
        self._checks.raise_pending(block=block)

    def _triton_constants(self, device: torch.device) -> tuple:
        """(multipliers, primes, Barrett magic, offsets, lookup) on `device`, looked up once per device."""
        got = self._triton_consts.get(device)
        if got is None:
            c = self.constants(device)
            got = (c["multipliers"], c["primes"], self._magic(device), c["offsets"], c["lookup"])
            self._triton_consts[device] = got
        return got

    def _hash_triton(
        self, ids: torch.Tensor, with_lookup: bool, blocked, with_offsets: bool, id_range=None
    ) -> torch.Tensor:
        multipliers, primes, magic, offsets, lookup = self._triton_constants(ids.device)
        return _kernels().hash_prefill_triton(
            ids,
            multipliers=multipliers,
            primes=primes,
            magic=magic,
            offsets=offsets if with_offsets else None,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            lookup=lookup if with_lookup else None,
            blocked=blocked,
            id_range=id_range,
        )

    def hash_compressed(
        self,
        compressed: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
        with_offsets: bool = True,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Like `__call__` but for compressed ids already (no range check)."""
        if self._backend(backend, compressed.device) == "triton":
            return self._hash_triton(compressed, False, blocked, with_offsets)
        c = self.constants(compressed.device)
        return hash_reference(
            compressed,
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=c["offsets"] if with_offsets else None,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            blocked=blocked,
        )

    # ------------------------------------------------------------------ ragged batches
    def _check_ragged(self, input_ids, cu_seqlens, history, slots, lookback_ids, blocked, n_commit=None):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise HashInputError(
                f"ragged input_ids must be a flat [n] tensor, got "
                f"{tuple(getattr(input_ids, 'shape', ())) or type(input_ids).__name__}"
            )
        if input_ids.dtype not in _ID_DTYPES:
            raise HashInputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        device = input_ids.device
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise HashInputError(
                f"cu_seqlens must be a [B+1] integer tensor (B >= 1), got "
                f"{tuple(getattr(cu_seqlens, 'shape', ())) or type(cu_seqlens).__name__}"
            )
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.device != device:
            raise HashInputError(
                f"cu_seqlens must be int32/int64 on {device}, got {cu_seqlens.dtype} on {cu_seqlens.device}"
            )
        n_seqs = cu_seqlens.numel() - 1
        depth = self._depth
        if (history is None) != (slots is None):
            raise HashInputError("history and slots go together: pass both or neither")
        if history is not None:
            if history.max_ngram_size != self._depth + 1 or history.pad_id != self.pad_compressed_id:
                raise HashInputError(f"{history!r} was not made for this hasher: use hasher.new_history")
            if history.ids is None:
                raise HashInputError(f"{history!r} keeps token ids by position; the hash kernels read the rolling form")
            if history.ids.device != device:
                raise HashInputError(f"history lives on {history.device} but input_ids on {device}")
            if not isinstance(slots, torch.Tensor) or slots.shape != (n_seqs,) or slots.device != device:
                raise HashInputError(
                    f"slots must be a [B={n_seqs}] tensor on {device}, got {tuple(getattr(slots, 'shape', ()))}"
                )
        if lookback_ids is not None and (
            not isinstance(lookback_ids, torch.Tensor)
            or lookback_ids.shape != (n_seqs, depth)
            or lookback_ids.device != device
        ):
            raise HashInputError(
                f"lookback_ids must be [B={n_seqs}, N-1={depth}] token ids on {device} (oldest "
                f"first, -1 where there is none), got {tuple(getattr(lookback_ids, 'shape', ()))}"
            )
        if blocked is not None and (
            not isinstance(blocked, torch.Tensor)
            or blocked.dtype != torch.bool
            or blocked.shape != input_ids.shape
            or blocked.device != device
        ):
            raise HashInputError(f"blocked must be a bool [{input_ids.numel()}] tensor on {device}")
        if n_commit is not None and (
            not isinstance(n_commit, torch.Tensor) or n_commit.shape != (n_seqs,) or n_commit.device != device
        ):
            raise HashInputError(f"n_commit must be a [B={n_seqs}] integer tensor on {device}")

    def hash_ragged(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        history: NgramHistory | None = None,
        slots: torch.Tensor | None = None,
        lookback_ids: torch.Tensor | None = None,
        blocked: torch.Tensor | None = None,
        commit: bool = True,
        with_offsets: bool = True,
        check: bool = True,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Row ids of a flat batch of sequence chunks (prefill chunks, decode tokens, drafts).

        Sequence b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]`` of `input_ids`; tokens past
        ``cu_seqlens[-1]`` are padding (a fixed token budget): bucket 0 (+ offset), and they
        read and write no history. Each chunk's first tokens look back at the sequence's
        `history` slot when ``slots[b]`` names one (``-1``: none), else at its explicit
        ``lookback_ids[b]``, else at nothing (a sequence's first chunk).

        Args:
            input_ids: [n] token ids.
            cu_seqlens: [B+1] int32/int64 boundaries, ``cu_seqlens[0] == 0``, non-decreasing.
            history, slots: an `NgramHistory` and [B] slot per sequence (slots distinct).
            lookback_ids: optional [B, N-1] token ids before each chunk, oldest first, -1
                where the sequence has none (prefix-cache hits, sequences from elsewhere).
            blocked: optional bool [n] positions no later look-back may read.
            commit: advance each slot's history by its whole chunk (one more small
                launch). False for speculative drafts: call `commit` after verification.
            check: validate ids and boundaries; on CUDA without waiting (`raise_pending`).

        Returns:
            int64 [n, n_layers, n_cols], each token's row ids equal to hashing its whole
            sequence at once.
        """
        self._check_ragged(input_ids, cu_seqlens, history, slots, lookback_ids, blocked)
        self._checks.raise_pending()
        device = input_ids.device
        c = self.constants(device)
        lookback = None
        if lookback_ids is not None:
            lookback = lookback_from_ids(lookback_ids, c["lookup"], self.pad_compressed_id)

        n_tokens, n_seqs = input_ids.numel(), cu_seqlens.numel() - 1

        def label() -> str:  # formatted only for an error message
            return f"hash_ragged on {n_tokens} tokens, {n_seqs} sequences"

        offsets = c["offsets"] if with_offsets else None
        if self._backend(backend, device) == "triton":
            row_ids = self._hash_ragged_triton(
                input_ids, cu_seqlens, c, offsets, history, slots, lookback, blocked, check, label
            )
        else:
            row_ids = self._hash_ragged_torch(
                input_ids, cu_seqlens, c, offsets, history, slots, lookback, blocked, check, label
            )
        if commit and history is not None:
            self._advance(history, slots, input_ids, cu_seqlens, None, blocked, backend)
        return row_ids

    def _hash_ragged_triton(
        self, input_ids, cu_seqlens, c, offsets, history, slots, lookback, blocked, check: bool, label
    ) -> torch.Tensor:
        """`hash_ragged`'s row ids from the Triton kernel; ids and boundaries checked on the device, read later."""
        device = input_ids.device
        n_tokens = input_ids.numel()
        id_range, slot = self._range_target(n_tokens, device) if check else (None, None)
        row_ids = _kernels().hash_ragged_triton(
            input_ids,
            cu_seqlens,
            multipliers=c["multipliers"],
            primes=c["primes"],
            magic=self._magic(device),
            offsets=offsets,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            lookup=c["lookup"],
            blocked=blocked,
            history=None if history is None else history.ids,
            slots=slots,
            lookback=lookback,
            id_range=id_range,
        )
        if id_range is not None:
            self._submit_range(id_range, slot, n_tokens, label)
        if check and id_range is None:  # an empty batch: its boundaries still count
            self._check_boundaries(cu_seqlens, 0)
        return row_ids

    def _hash_ragged_torch(
        self, input_ids, cu_seqlens, c, offsets, history, slots, lookback, blocked, check: bool, label
    ) -> torch.Tensor:
        """`hash_ragged`'s row ids from the torch reference, each chunk's look-back gathered first."""
        device = input_ids.device
        if check:
            self._check_boundaries(cu_seqlens, input_ids.numel())
            live = torch.arange(input_ids.numel(), device=device) < cu_seqlens[-1]
            self._checks.submit_ids(torch.where(live, input_ids.long(), 0), label)
        compressed = self._compress_safe(input_ids)
        lb = torch.full(
            (cu_seqlens.numel() - 1, self.layout.max_ngram_size - 1),
            self.pad_compressed_id,
            dtype=torch.int64,
            device=device,
        )
        if lookback is not None:
            lb = lookback
        if history is not None:
            own = (slots >= 0) & (slots < history.n_slots)
            lb = torch.where(own[:, None], history.ids[slots.long().clamp(0, history.n_slots - 1)], lb)
        return hash_ragged_reference(
            compressed,
            cu_seqlens,
            lb,
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=offsets,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            blocked=blocked,
        )

    def seed_history(self, history: NgramHistory, slots: torch.Tensor, lookback_ids: torch.Tensor) -> None:
        """Set slots' histories from the token ids just before their next chunk: a prompt
        whose first tokens a prefix cache already holds (`lookback_ids` [B, N-1], oldest
        first, -1 where the sequence has nothing or a block hides it). No host sync."""
        depth = self.layout.max_ngram_size - 1
        if not isinstance(lookback_ids, torch.Tensor) or lookback_ids.dim() != 2 or lookback_ids.shape[1] != depth:
            raise HashInputError(
                f"lookback_ids must be [B, N-1={depth}] token ids, got {tuple(getattr(lookback_ids, 'shape', ()))}"
            )
        index = torch.as_tensor(slots, dtype=torch.int64, device=history.device).reshape(-1)
        if index.numel() != lookback_ids.shape[0]:
            raise HashInputError(f"{index.numel()} slots for {lookback_ids.shape[0]} look-back rows")
        lookup = self.constants(history.device)["lookup"]
        history.ids.index_copy_(
            0, index, lookback_from_ids(lookback_ids.to(history.device), lookup, self.pad_compressed_id)
        )

    def commit(
        self,
        history: NgramHistory,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        n_commit: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> None:
        """After speculative verification: advance each slot by the first ``n_commit[b]``
        tokens of its chunk in the batch `hash_ragged(..., commit=False)` hashed (1 + the
        accepted drafts, when the chunk is [last sampled token, drafts...]). Tokens not
        committed leave no trace. No host sync; capturable in a CUDA graph."""
        self._check_ragged(input_ids, cu_seqlens, history, slots, None, blocked, n_commit)
        self._advance(history, slots, input_ids, cu_seqlens, n_commit, blocked, backend)

    def _advance(self, history, slots, input_ids, cu_seqlens, n_commit, blocked, backend) -> None:
        device = input_ids.device
        c = self.constants(device)
        if self._backend(backend, device) == "triton":
            _kernels().advance_triton(
                history.ids,
                slots,
                input_ids,
                cu_seqlens,
                pad_id=self.pad_compressed_id,
                lookup=c["lookup"],
                blocked=blocked,
                n_commit=n_commit,
            )
        else:
            advance_reference(
                history.ids,
                slots,
                self._compress_safe(input_ids),
                cu_seqlens,
                n_commit,
                self.pad_compressed_id,
                blocked,
            )

    def _compress_safe(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Compressed ids; out-of-range ids read the pad, as in the kernels (the check reports them)."""
        lookup = self.constants(input_ids.device)["lookup"]
        ids = input_ids.long()
        if lookup is None:
            inside = (ids >= 0) & (ids < self.vocab_size)
            return torch.where(inside, ids, torch.full_like(ids, self.pad_compressed_id))
        inside = (ids >= 0) & (ids < lookup.numel())
        return torch.where(
            inside, lookup[ids.clamp(0, lookup.numel() - 1)], torch.full_like(ids, self.pad_compressed_id)
        )

    def _check_boundaries(self, cu_seqlens: torch.Tensor, n_tokens: int) -> None:
        """cu_seqlens must start at 0, never decrease and end within the batch; checked
        like the ids (deferred on a GPU). A violation reads as an id far out of range."""
        cu = cu_seqlens.long()
        broken = (cu[0] != 0) | (cu[1:] < cu[:-1]).any() | (cu[-1] > n_tokens)
        if cu.device.type != "cuda":
            if bool(broken):
                raise HashInputError(
                    f"cu_seqlens {cu.tolist()[:8]}... must start at 0, never decrease and end "
                    f"at most at the {n_tokens} tokens of the batch"
                )
            return
        row = torch.zeros(1, 3, dtype=torch.int32, device=cu.device)
        row[0, 2] = broken.to(torch.int32)
        self._checks.submit(row, "the batch's cu_seqlens")

    # ------------------------------------------------------------------ decoding
    def new_history(self, n_slots: int, device: torch.device | str = "cpu") -> NgramHistory:
        """An empty `NgramHistory` of `n_slots` sequences for this hasher's N and pad."""
        return NgramHistory(n_slots, self.layout.max_ngram_size, self.pad_compressed_id, device)

    def prefill_history(
        self,
        history: NgramHistory,
        slots,
        input_ids: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
        doc_starts: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        check: bool = True,
    ) -> None:
        """Seed the slots' histories from prompts [B, T] (token ids), as `__call__` would see them."""
        compressed = self.compress(input_ids, check=check)
        blocked = self._check_mask(blocked, input_ids, "blocked")
        doc_starts = self._check_mask(doc_starts, input_ids, "doc_starts")
        if doc_starts is not None:
            from_docs = self.blocked_from_doc_starts(doc_starts)
            blocked = from_docs if blocked is None else blocked | from_docs
        history.prefill(slots, compressed, blocked=blocked, lengths=lengths)

    def decode(
        self,
        history: NgramHistory,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        valid: torch.Tensor | None = None,
        blocked: torch.Tensor | None = None,
        with_offsets: bool = True,
        check: bool = False,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Row ids of one new token per sequence; updates `history` in the same step.

        Args:
            history: the sequences' `NgramHistory` (on the device of `input_ids`).
            slots: [B] int slot of each row; -1 (or any id outside the history) marks padding.
            input_ids: [B] new token ids.
            valid: optional bool [B]; False marks a padding row (CUDA-graph padding), which
                neither hashes meaningfully nor writes history, even if it names a live slot.
            blocked: optional bool [B]; the new token is hidden from later look-backs.
            check: validate the id range (one host sync; off by default for decode).

        Returns:
            int64 [B, n_layers, n_cols]; padding rows hold bucket 0 (+ offset) of every column.
            Live rows must name distinct slots.
        """
        self._check_decode(history, slots, input_ids, valid, blocked)
        if check:
            self.compress(input_ids[None], check=True)
        device = input_ids.device
        c = self.constants(device)
        offsets = c["offsets"] if with_offsets else None
        if self._backend(backend, device) == "triton":
            return _kernels().hash_decode_triton(
                history.ids,
                slots.to(device),
                input_ids,
                multipliers=c["multipliers"],
                primes=c["primes"],
                magic=self._magic(device),
                offsets=offsets,
                n_heads=self._n_heads,
                pad_id=self.pad_compressed_id,
                lookup=c["lookup"],
                valid=valid,
                blocked=blocked,
            )
        if backend in (None, "auto") and device.type == "cpu" and history.ids.is_contiguous():
            row_ids = self._decode_native(history, slots, input_ids, c, offsets, valid, blocked)
            if row_ids is not None:  # the same numbers, without the reference's dozens of small ops
                return row_ids
        return self._decode_reference(history, slots, input_ids, c, offsets, valid, blocked)

    def _check_decode(self, history: NgramHistory, slots, input_ids, valid, blocked) -> None:
        """`decode`'s argument checks: ids [B], a history of this hasher on their device, slots and masks [B]."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise HashInputError(f"decode input_ids must be a [B] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        if history.max_ngram_size != self.layout.max_ngram_size or history.pad_id != self.pad_compressed_id:
            raise HashInputError(
                f"{history!r} was not made for this hasher (N={self.layout.max_ngram_size}, "
                f"pad={self.pad_compressed_id}): use hasher.new_history"
            )
        if history.ids is None:
            raise HashInputError(f"{history!r} keeps token ids by position; the hash kernels read the rolling form")
        device = input_ids.device
        if history.device != device:
            raise HashInputError(f"history lives on {history.device} but input_ids on {device}")
        if slots.shape != input_ids.shape:
            raise HashInputError(f"slots {tuple(slots.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        for name, m in (("valid", valid), ("blocked", blocked)):
            if m is not None and (m.dtype != torch.bool or m.shape != input_ids.shape):
                raise HashInputError(f"{name} must be bool {tuple(input_ids.shape)}, got {m.dtype} {tuple(m.shape)}")

    def _decode_native(self, history: NgramHistory, slots, input_ids, c, offsets, valid, blocked):
        """`decode`'s row ids from the native CPU hash, or None where it does not run (then the reference does)."""
        from condmem import native

        return native.hash_decode(
            history.ids,
            slots,
            input_ids,
            lookup=c["lookup"],
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=offsets,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            valid=valid,
            blocked=blocked,
        )

    def _decode_reference(self, history: NgramHistory, slots, input_ids, c, offsets, valid, blocked) -> torch.Tensor:
        """`decode`'s row ids from the torch reference (ids compressed here)."""
        device = input_ids.device
        lookup = c["lookup"]
        ids = input_ids.long()
        if lookup is not None:
            # Out-of-range ids read the pad, as in the kernel (memory-safe; `check` reports them).
            inside = (ids >= 0) & (ids < lookup.numel())
            ids = torch.where(
                inside, lookup[ids.clamp(0, lookup.numel() - 1)], torch.full_like(ids, self.pad_compressed_id)
            )
        return hash_decode_reference(
            history.ids,
            slots.to(device),
            ids,
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=offsets,
            n_heads=self._n_heads,
            pad_id=self.pad_compressed_id,
            valid=valid,
            blocked=blocked,
        )

    def __repr__(self) -> str:
        return f"NgramHasher({self.layout!r}, vocab={self.vocab_size}, pad->{self.pad_compressed_id})"
