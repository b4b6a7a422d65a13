"""Deterministic training: the same seed and configuration give bit-identical losses on one machine type.

`deterministic_mode` turns on ``torch.use_deterministic_algorithms`` and deterministic cuDNN for
a block (restoring the settings after); `set_cublas_workspace` sets ``CUBLAS_WORKSPACE_CONFIG``,
which cuBLAS reads once, when it starts, so it must run before anything touches the GPU.
Used by `condmem study` (on by default) and `condmem train --deterministic`; without it, two
identical GPU runs part within a few steps (atomic adds in the backward). Its cost in tokens/s
is measured in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (NVIDIA's documented value)."""


@contextlib.contextmanager
def deterministic_mode(enabled: bool):
    """Deterministic algorithms (and cuDNN) inside the block when `enabled`; the previous settings after.

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts: `set_cublas_workspace` does it
    (the study calls it before it touches the device).

    Deterministic algorithms would also fill every new tensor's memory before use (NaN for floats:
    ``torch.utils.deterministic.fill_uninitialized_memory``), a debugging aid that makes a read of
    memory nothing wrote give the same bits each run. Such a read is a bug in any mode, and where
    every read follows a write the same bits come without it, so the fill is off in the block: it
    cost one kernel per new tensor, over 200 a training step of the gpu preset."""
    fill = torch.utils.deterministic
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        fill.fill_uninitialized_memory,
    )
    if enabled:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        fill.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        fill.fill_uninitialized_memory = before[4]


def set_cublas_workspace(enabled: bool) -> str | None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` (unless the user did) when `enabled`; the value in force."""
    if enabled and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def determinism_record(enabled: bool) -> dict:
    """What a run's summary (study.json, summary.json) says about the mode."""
    return {
        "enabled": enabled,
        "torch_deterministic_algorithms": enabled,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cudnn_deterministic": enabled,
    }
