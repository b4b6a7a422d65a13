"""Test helpers: a named closeness check that prints max/mean error, capability marks."""

from __future__ import annotations

import pytest
import torch


def devices() -> list:
    """Parameters for a ``device`` argument: CPU, and CUDA marked `gpu` (skipped without a GPU,
    listed by ``pytest -m gpu`` everywhere)."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def available_devices() -> list[str]:
    """The devices present, for a test that loops over them itself (a property test that checks
    each example on every device)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Compare a float result with its reference; on failure print max/mean error and where."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    ref64, got64 = ref.detach().double().cpu(), got.detach().double().cpu()
    assert torch.isfinite(got64).all(), f"{name}: non-finite values in the result"
    err = (ref64 - got64).abs()
    excess = err - (atol + rtol * ref64.abs())
    if bool((excess > 0).any()):
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), err.shape))
        raise AssertionError(
            f"{name}: max err {err.max().item():.3e}, mean err {err.mean().item():.3e} "
            f"(atol {atol:g}, rtol {rtol:g}); worst at {worst}: "
            f"ref {ref64[worst].item():.6g} got {got64[worst].item():.6g}"
        )
