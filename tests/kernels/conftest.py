"""Kernel-test fixtures: every `torch.empty` / `empty_like` is poisoned, so unwritten outputs fail."""

from __future__ import annotations

import pytest
import torch

_INT_POISON = -0x2A2A2A2A  # not a row id, not a compressed id


@torch.no_grad()  # an empty made to require grad (Inductor's pattern set-up makes some) is filled like any other
def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta" or t.numel() == 0:
        return t
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.uint8:
        t.fill_(0xAB)
    elif t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # NaN
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int64, torch.int32):
        t.fill_(_INT_POISON)
    else:
        t.fill_(-1)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return _poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison(empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)
    yield
