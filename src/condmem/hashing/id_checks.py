"""Token-id range checks that never stall the host.

Reading a GPU result on the host waits for the GPU, which would break the overlap an
engine relies on (hashing the next batch while the current one runs). So on CUDA the
hash kernels fold the live ids' range into a device-side pair ``[max(id), max(-id)]``,
which is copied into page-locked memory without waiting and checked once its event
has completed: at the hasher's next call (if done by then) or at `raise_pending`, which
`EngramMemory` calls where the caller waits for rows anyway. On the CPU the check is
immediate.
"""

from __future__ import annotations

from collections import deque

import torch


class PendingIdChecks:
    """Range pairs of earlier hash calls, checked when their GPU work is done.

    Args:
        error: the exception type raised (the hasher's input error).
        bound: ids must lie in ``[0, bound)``.
        what: the id space's name for messages ("tokenizer", "compressed vocabulary").
        noun: what an id is called in messages ("token id", "row id").
        hint: appended to the message.
    """

    def __init__(self, error: type[Exception], bound: int, what: str, noun: str = "token id",
                 hint: str = "were these ids made by another tokenizer?"):
        self.error = error
        self.bound = int(bound)
        self.what = what
        self.noun = noun
        self.hint = hint
        self._pending: deque = deque()

    def submit(self, id_range: torch.Tensor, call: str) -> None:
        """Hand over a call's ranges, integer [k, 3] rows of ``[max id, max -id, broken
        boundaries]`` (or [k, 2] without the last), filled by work queued on the current stream."""
        if id_range.device.type != "cuda":
            self._raise_if_bad(id_range, call)
            return
        host = torch.empty(id_range.shape, dtype=id_range.dtype, pin_memory=True)
        host.copy_(id_range, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, call))

    def submit_ids(self, ids: torch.Tensor, call: str) -> None:
        """Check `ids` themselves: their range is reduced on their device (two small launches)
        and handed over like a kernel's (checked now on the CPU, later on a GPU)."""
        if ids.numel() == 0:
            return
        lo, hi = torch.aminmax(ids.reshape(-1))
        self.submit(torch.stack([hi, -lo])[None], call)

    def raise_pending(self, block: bool = False) -> None:
        """Raise for the first earlier call whose ids were out of range.

        Args:
            block: wait for every pending call's GPU work (a host sync); otherwise only
                calls already finished are checked, the rest stay pending.
        """
        while self._pending:
            event, host, call = self._pending[0]
            if not block and not event.query():
                return
            event.synchronize()
            self._pending.popleft()
            self._raise_if_bad(host, call)

    def _raise_if_bad(self, id_range: torch.Tensor, call: str) -> None:
        worst = [int(v) for v in id_range.reshape(-1, id_range.shape[-1]).amax(dim=0).tolist()]
        hi, neg_lo, broken = (worst + [0])[:3]
        if broken:
            self._pending.clear()
            raise self.error(f"cu_seqlens must start at 0, never decrease and end within the batch ({call})")
        if hi >= self.bound or neg_lo > 0:
            bad = hi if hi >= self.bound else -neg_lo
            self._pending.clear()
            raise self.error(f"{self.noun} {bad} is outside the {self.what}'s ids 0..{self.bound - 1} ({call}): "
                             f"{self.hint}")
