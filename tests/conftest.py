"""Shared test set-up: the `gpu` marker, the Triton interpreter where there is no GPU, a private
cache dir for every test, and engines and host buffers closed at teardown (also on failure).

`@pytest.mark.gpu` is the one way a test says it needs a CUDA device (parametrized CUDA cases
carry it through ``helpers.devices()`` / ``kernel_helpers.kernel_devices()``). Without a GPU,
or with TRITON_INTERPRET=1 (kernels interpreted on the CPU), those tests are skipped here, so
``pytest -m gpu --collect-only`` lists the same GPU tests on every machine."""

from __future__ import annotations

import os

import pytest
import torch

from condmem.train.determinism import set_cublas_workspace

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Before any test imports triton: its kernels run on the CPU through the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Deterministic cuBLAS, as the study sets it, for tests that train in deterministic mode: cuBLAS
# reads it once, when it starts, so here, before any test touches the GPU.
set_cublas_workspace(True)

pytest_plugins = ["pytester"]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA and not INTERPRET:
        return
    reason = "needs a CUDA device" if not HAS_CUDA else "TRITON_INTERPRET=1: GPU tests run compiled kernels"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's ~/.cache.
    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "condmem-cache"))


@pytest.fixture(autouse=True)
def _deterministic_settings_restored():
    """torch's deterministic-algorithm and cuDNN settings are put back after every test, so a test that
    left deterministic mode on (or off) does not decide what the next one sees."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@pytest.fixture(autouse=True)
def _close_what_a_test_opened(monkeypatch):
    """Lookup engines (worker threads, plan slots) and host buffers (page-locked memory, shared
    files) a test opens are closed when it ends, passed or failed: a failing test must not leak
    into the next. Closing twice is harmless, so tests that close their own are unaffected."""
    from condmem.tables.host_memory import HostBuffer
    from condmem.tables.lookup import LookupEngine

    opened: list = []
    for cls in (LookupEngine, HostBuffer):
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            opened.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    yield
    errors = []
    for obj in reversed(opened):  # engines before the buffers they read
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001 - collected and raised below
            errors.append(exc)
    if errors:
        raise errors[0]
