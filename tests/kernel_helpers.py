"""Helpers of the kernel tests: where Triton runs, bit-exact float comparison, relative error."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def kernel_devices() -> list:
    """Parameters for a kernel test's ``device``: CPU through the Triton interpreter (skipped
    unless TRITON_INTERPRET=1, which tests/conftest.py sets on machines without a GPU), and
    CUDA with compiled kernels, marked `gpu`."""
    return [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not INTERPRET,
                reason="CPU kernels run in the Triton interpreter (TRITON_INTERPRET=1, set where there is no GPU)",
            ),
        ),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]


def kernel_devices_here() -> list[str]:
    """The devices kernels run on in this process, for a test that loops over them itself."""
    if not HAS_TRITON:
        return []
    return ["cpu"] if INTERPRET else (["cuda"] if HAS_CUDA else [])


needs_kernels = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def compiled_graph_backends() -> list:
    """Parameters ``(device, backend)`` for a test of an op registered opaque to `torch.compile`: eager
    and aot_eager on CPU (through the interpreter), and on CUDA eager, aot_eager and inductor, marked `gpu`."""
    interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU kernels run in the Triton interpreter")
    cpu = [pytest.param("cpu", b, marks=interpreted, id=f"cpu-{b}") for b in ("eager", "aot_eager")]
    return cpu + [
        pytest.param("cuda", b, marks=pytest.mark.gpu, id=f"cuda-{b}") for b in ("eager", "aot_eager", "inductor")
    ]


def assert_bits_equal(name: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    """Bit-for-bit equality of float tensors; NaN matches NaN whatever its payload."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert ref.dtype == got.dtype, f"{name}: dtype {got.dtype} != reference {ref.dtype}"
    ref, got = ref.cpu(), got.cpu()
    rn, gn = ref.isnan(), got.isnan()
    if not torch.equal(rn, gn):
        i = int((rn != gn).nonzero()[0][0]) if rn.dim() == 1 else tuple((rn != gn).nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: NaN pattern differs ({int((rn != gn).sum())} elements), first at {i}: ref {ref[i]} got {got[i]}"
        )
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    rb, gb = ref.view(ints)[~rn], got.view(ints)[~gn]
    if not torch.equal(rb, gb):
        bad = (rb != gb).nonzero().flatten()
        raise AssertionError(
            f"{name}: {bad.numel()} of {rb.numel()} values differ in their bits; first: "
            f"ref {ref[~rn][bad[0]].item()!r} got {got[~gn][bad[0]].item()!r}"
        )


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref64, got64 = ref.detach().double().cpu(), got.detach().double().cpu()
    denom = ref64.norm().item()
    return (ref64 - got64).norm().item() / (denom if denom > 0 else 1.0)


def assert_rel(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """||got - ref|| / ||ref|| <= tol, printing max/mean error on failure; NaN never passes."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    got64 = got.detach().double().cpu()
    assert torch.isfinite(got64).all(), f"{name}: non-finite values in the result"
    err = rel_err(ref, got)
    if not err <= tol:
        d = (ref.detach().double().cpu() - got64).abs()
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e} (max abs {d.max().item():.3e}, "
            f"mean abs {d.mean().item():.3e})"
        )
