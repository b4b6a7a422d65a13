"""Host-to-device copies that do not make the host wait.

A copy from pageable host memory into a GPU waits for the work already queued on the
stream (CUDA stages it through a driver buffer after a stream sync), so a small index
tensor built on the host mid-pipeline drains the GPU's queue: the GPU then idles while the
host prepares the next batch. Copied from pinned memory (PyTorch's caching host allocator,
which keeps the block until the copy is done), the copy is queued like a kernel.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`, queued on the current stream; a pageable CPU tensor bound for a GPU goes
    through pinned memory first. Anything else is a plain ``.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
