"""A stream-ordered gate: one stream waits, on the GPU, for a counter that another stream
advances; the host queues both sides whenever it likes, in any order.

The lookup engine needs this to queue a lookup's whole GPU side (plan, zero-copy share,
expansion) from the caller's thread at once, although the CPU share's DMAs, which the
expansion must follow, are queued later by the gather thread. A CUDA event cannot express
that (a wait binds to the event's latest record at the time of the wait), so the expansion
waits on a 32-bit word in device memory (``cuStreamWaitValue32``: until word >= n, a cyclic
comparison) and the gather thread, after queueing the DMAs of lookup n, queues the write of n
(``cuStreamWriteValue32``) behind them on the copy stream. The gather thread then has no
Python step left after the send (measured on the H200, session 7: queueing the expansion cost
it ~0.3 ms per lookup, mostly waiting for the GIL the caller's thread held).

Hazard (H200, session 7, run 7): with CUDA's lazy module loading, the first launch of a
kernel waits for the device while any stream is blocked on a gate, so a thread that launches
a never-used kernel before opening a gate itself deadlocks (the first GPU test did, until it
loaded its kernel beforehand). The engine's gates are opened by the gather thread, which
launches no kernels; a caller's first-time kernel may still stall until the open (~1 ms).
This is why `LookupEngine(stream_gate=...)` is off by default until its GPU tests pass.

The driver's stream memory operations are reached through ctypes in the ``libcuda`` torch
loaded. `StreamGate.create` returns None where they are missing or fail a round trip; the
engine then queues the expansion from the gather thread, as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger("condmem.tables")

WAIT_GEQ = 0x0          # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0


@functools.cache   # (two threads racing here both find the same functions: harmless)
def _driver_calls() -> tuple | None:
    """(cuStreamWaitValue32, cuStreamWriteValue32) of the loaded CUDA driver, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    found = []
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        found.append(fn)
    return tuple(found)


class StreamGate:
    """A device word streams wait on (`wait`) and other streams advance (`open`), in order.

    Example:
        >>> gate = StreamGate.create("cuda")
        >>> n = gate.next()
        >>> gate.wait(finish_stream, n)     # work queued on finish_stream after this waits ...
        >>> gate.open(copy_stream, n)       # ... until copy_stream reaches this point
    """

    def __init__(self, device: torch.device, calls: tuple):
        self._wait_value, self._write_value = calls
        self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self._seq = 0

    @classmethod
    def create(cls, device: str | torch.device) -> StreamGate | None:
        """A gate on `device`, or None where the driver's stream memory operations are unusable."""
        calls = _driver_calls()
        if calls is None:
            log.info("CUDA stream memory operations not found: lookups queue their expansion from the gather thread")
            return None
        device = torch.device(device)
        with torch.cuda.device(device):
            gate = cls(device, calls)
            try:
                # Round trip: 1 written on one stream, waited for on another. The write is queued
                # first, so a failure leaves no stream waiting forever.
                gate.open(torch.cuda.current_stream(device), 1)
                side = torch.cuda.Stream(device)
                gate.wait(side, 1)
                side.synchronize()
                ok = int(gate.word.item()) == 1
            except RuntimeError as exc:
                log.info("CUDA stream memory operations unusable (%s): lookups queue their expansion from "
                         "the gather thread", exc)
                return None
        if not ok:
            return None
        gate._seq = 1
        return gate

    def next(self) -> int:
        """The next value to wait for and then open (32-bit, wrapping: the comparison is cyclic)."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def wait(self, stream: torch.cuda.Stream, value: int) -> None:
        """Work queued on `stream` after this runs once the gate has reached `value`."""
        rc = self._wait_value(stream.cuda_stream, self.word.data_ptr(), value, WAIT_GEQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {rc}")

    def open(self, stream: torch.cuda.Stream, value: int) -> None:
        """Set the gate to `value` once `stream` reaches this point (in stream order)."""
        rc = self._write_value(stream.cuda_stream, self.word.data_ptr(), value, 0)
        if rc:
            raise RuntimeError(f"cuStreamWriteValue32 failed: CUresult {rc}")
