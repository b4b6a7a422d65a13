"""Token-id range checks that never stall the host.

Reading a GPU result on the host waits for the GPU, which would break the overlap an
engine relies on (hashing the next batch while the current one runs). So on CUDA the
hash kernels fold the live ids' range into device-side rows ``[max(id), max(-id), broken]``,
which are copied into page-locked memory without waiting and checked once their event
has completed: at the hasher's next call (if done by then) or at `raise_pending`, which
`EngramMemory` calls where the caller waits for rows anyway. On the CPU the check is
immediate.

A check sits on every eager call, so its host work is kept small: the page-locked buffers
and their events are reused (allocating page-locked memory and creating events per call
cost more than the hash kernel itself), a hash kernel writes its rows straight into a
reserved page-locked buffer (`reserve` / `submit_written`: no device buffer to allocate,
no copy to queue), the ranges are read through numpy, and a call's message is only
formatted when it reports a bad id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from condmem.ops.launch import HostPointer

_MAX_PENDING = 256
"""Checks in flight at most; one more waits for the oldest (only a host far ahead of its GPU gets there)."""

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _Slot:
    """A reusable page-locked buffer of range rows, its numpy view, its address for a kernel launch, and the
    event recorded after the work that fills it."""

    __slots__ = ("array", "event", "host", "key", "pointer")

    def __init__(self, key: tuple, rows: int):
        dtype, cols, _device = self.key = key
        self.host = torch.empty((rows, cols), dtype=dtype, pin_memory=True)
        self.array = self.host.numpy()
        self.pointer = HostPointer(self.host)
        self.event = torch.cuda.Event()  # made on the key's device at its first record

    def __del__(self):
        # A hash kernel may still be writing this memory (it writes it directly, no copy that torch's
        # pinned pool would wait for): wait for it before the memory can go to another tensor.
        try:
            self.event.synchronize()  # (an event never recorded returns at once)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone: nothing left to protect
            pass


class PendingIdChecks:
    """Range rows of earlier hash calls (or lookups), checked when their GPU work is done.

    Args:
        error: the exception type raised (the hasher's input error).
        bound: ids must lie in ``[0, bound)``.
        what: the id space's name for messages ("tokenizer", "compressed vocabulary").
        noun: what an id is called in messages ("token id", "row id").
        hint: appended to the message.

    Not thread-safe: one per hasher or lookup engine, used from the thread that calls it.
    """

    def __init__(
        self,
        error: type[Exception],
        bound: int,
        what: str,
        noun: str = "token id",
        hint: str = "were these ids made by another tokenizer?",
    ):
        self.error = error
        self.bound = int(bound)
        self.what = what
        self.noun = noun
        self.hint = hint
        self._pending: deque = deque()  # (slot, rows, negated, call)
        self._spare: dict[tuple, list[_Slot]] = {}
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def submit(self, id_range: torch.Tensor, call: str | Callable[[], str], negated: bool = True) -> None:
        """Hand over a call's ranges, integer [k, 3] rows of ``[max id, max -id, broken
        boundaries]`` (or [k, 2] without the last), filled by work queued on the current stream.

        `call` names the call in a message (a string, or a function making it: only called for
        a message). ``negated=False``: the rows are ``[max id, min id]`` instead.
        """
        if not id_range.is_cuda:
            self._raise_if_bad(id_range.numpy(), negated, call)
            return
        rows, cols = id_range.shape
        device = id_range.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        slot = self._slot((id_range.dtype, cols, index), rows)
        slot.host[:rows].copy_(id_range, non_blocking=True)
        slot.event.record(self._stream(index))
        self._pending.append((slot, rows, negated, call))
        if len(self._pending) > _MAX_PENDING:
            self._check_oldest(block=True)

    def reserve(self, rows: int, device: torch.device) -> _Slot:
        """A page-locked slot of at least `rows` int32 rows ``[max id, max -id, broken]`` that a kernel on CUDA
        `device` writes itself: launch it with ``slot.pointer``, then hand the slot over with `submit_written`
        (a slot not handed over is simply dropped)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self._slot((torch.int32, 3, index), rows)

    def submit_written(self, slot: _Slot, rows: int, call: str | Callable[[], str]) -> None:
        """Hand over a `reserve`d slot whose first `rows` rows work queued on the current stream writes."""
        slot.event.record(self._stream(slot.key[2]))
        self._pending.append((slot, rows, True, call))
        if len(self._pending) > _MAX_PENDING:
            self._check_oldest(block=True)

    def submit_ids(self, ids: torch.Tensor, call: str | Callable[[], str]) -> None:
        """Check `ids` themselves: their range is reduced on their device (one small launch)
        and handed over like a kernel's (checked now on the CPU, later on a GPU)."""
        if ids.numel() == 0:
            return
        pair = torch.empty((1, 2), dtype=ids.dtype, device=ids.device)
        torch.aminmax(ids.reshape(-1), out=(pair[0, 1], pair[0, 0]))
        self.submit(pair, call, negated=False)

    def raise_pending(self, block: bool = False) -> None:
        """Raise for the first earlier call whose ids were out of range.

        Args:
            block: wait for every pending call's GPU work (a host sync); otherwise only
                calls already finished are checked, the rest stay pending.
        """
        while self._pending:
            if not self._check_oldest(block):
                return

    # ------------------------------------------------------------------ internals
    def _check_oldest(self, block: bool) -> bool:
        """Check the oldest pending call if its copy is done (or `block`); False if it is not."""
        slot, rows, negated, call = self._pending[0]
        if not slot.event.query():
            if not block:
                return False
            slot.event.synchronize()
        self._pending.popleft()
        self._spare.setdefault(slot.key, []).append(slot)
        self._raise_if_bad(slot.array[:rows], negated, call)
        return True

    def _slot(self, key: tuple, rows: int) -> _Slot:
        """A spare slot of this (dtype, columns, device) holding `rows` rows, or a new one."""
        spare = self._spare.get(key)
        while spare:
            slot = spare.pop()
            if slot.host.shape[0] >= rows:
                return slot
        return _Slot(key, max(64, 1 << (rows - 1).bit_length()))  # grown: the short one is dropped

    def _stream(self, index: int) -> torch.cuda.Stream:
        """Device `index`'s current stream, as an object made once per stream (making one per call
        costs several Python calls)."""
        if _raw_stream is None:
            return torch.cuda.current_stream(index)
        key = (index, _raw_stream(index))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.current_stream(index)
        return stream

    def _raise_if_bad(self, rows: np.ndarray, negated: bool, call: str | Callable[[], str]) -> None:
        if rows.shape[0] == 0:
            return
        worst = rows.max(axis=0).tolist()  # Python ints in one call
        if negated:
            hi, neg_lo = worst[0], worst[1]
            broken = worst[2] if rows.shape[1] > 2 else 0
        else:
            hi, neg_lo, broken = int(worst[0]), -int(rows[:, 1].min()), 0
        if not broken and hi < self.bound and neg_lo <= 0:
            return
        self._pending.clear()
        call = call() if callable(call) else call
        if broken:
            raise self.error(f"cu_seqlens must start at 0, never decrease and end within the batch ({call})")
        bad = hi if hi >= self.bound else -neg_lo
        raise self.error(
            f"{self.noun} {bad} is outside the {self.what}'s ids 0..{self.bound - 1} ({call}): {self.hint}"
        )
