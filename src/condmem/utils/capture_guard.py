"""Keeps CUDA graph captures apart from synchronizing CUDA calls made on other threads.

On NVIDIA GPUs a synchronizing call (an event query or synchronize, a pinned allocation)
made on one thread invalidates a stream capture running on another thread of the same
device, whatever the capture mode (``thread_local`` only stops the runtime from *refusing*
such calls). The lookup engine's gather thread makes such calls all the time (the plan's
counts, the staged send's ring events), while the caller's thread captures plans as CUDA
graphs on their second use; measured on the H200 without this guard:
`test_gpu_bad_ids_amid_a_burst_fail_alone` failed 2 times in 5 with
``cudaErrorStreamCaptureInvalidated`` once the send polled its events.

`CAPTURE_GUARD` is a readers-writer lock for the process: threads that synchronize hold it
shared (`syncing`), so they run side by side; a capture holds it alone (`capturing`). Captures
are rare (once per plan slot and step), so the writer waits at most one gather (~1-3 ms) and
is preferred over new readers. A thread must not capture while it holds `syncing`. Python's
garbage collector is paused during a capture too: a finalizer freeing a CUDA or pinned tensor
on the capturing thread would make such a call (a guess at the rare capture still spoiled
with the guard in place; not shown to be the cause).

Nothing queued on the GPU may wait for a host thread to act later (a stream gate, a stream
waiting on a word that the gather thread would write after its DMAs, deadlocked): a
capture's device-wide synchronize, and CUDA's loading of a kernel's module on its first
launch, wait for every stream, so a gather thread held back (by this guard, or by the GIL
the waiting thread holds) would never release them.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class CaptureGuard:
    """Shared holders (`syncing`) exclude one exclusive holder (`capturing`), and vice versa."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._syncing = 0
        self._capturing = False
        self._captures_waiting = 0

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """Around synchronizing CUDA calls made off the capturing thread."""
        with self._cond:
            while self._capturing or self._captures_waiting:
                self._cond.wait()
            self._syncing += 1
        try:
            yield
        finally:
            with self._cond:
                self._syncing -= 1
                if self._syncing == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a CUDA graph capture: waits until no thread is inside `syncing`; no garbage
        collection meanwhile."""
        with self._cond:
            self._captures_waiting += 1
            try:
                while self._capturing or self._syncing:
                    self._cond.wait()
            finally:
                self._captures_waiting -= 1
            self._capturing = True
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if collecting:
                gc.enable()
            with self._cond:
                self._capturing = False
                self._cond.notify_all()


CAPTURE_GUARD = CaptureGuard()
"""The process's guard: every capture and every gather thread of condmem use this one."""
