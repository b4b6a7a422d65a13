"""Host-to-device copies that do not hold the host.

A blocking copy (``torch.as_tensor(x, device=...)``, ``.to(device)``) waits until the GPU has
finished everything queued before it, so the kernels queued next start on an idle GPU. Serving
loops copy small host lists (slots, lengths, row indices) every batch; this one does not wait.
"""

from __future__ import annotations

import torch


def to_device(x, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (a tensor, list or number) on `device`, copied without waiting for the GPU.

    A pageable source is staged by the driver before the call returns; a pinned one must stay
    unchanged until the stream has copied it.
    """
    return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)
