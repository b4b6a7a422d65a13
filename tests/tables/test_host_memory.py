"""Host buffers: shared tables checked against /dev/shm's free space up front and removed on close
(unless asked to persist); a failed unregister is an error, never swallowed."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from condmem.tables.host_memory import HostBuffer, HostMemoryError, allocate_host

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


def _name(tag: str) -> str:
    return f"condmem-test-{os.getpid()}-{tag}"


def test_shared_table_is_removed_on_close():
    buf = allocate_host(1 << 16, "shared", _name("close"))
    path = Path("/dev/shm") / _name("close")
    assert path.stat().st_size == 1 << 16
    buf.tensor[:10] = 7
    buf.close()
    assert not path.exists()


def test_shared_table_persists_when_asked():
    path = Path("/dev/shm") / _name("keep")
    try:
        buf = allocate_host(1 << 16, "shared", _name("keep"), persist=True)
        buf.tensor[:3] = 5
        buf.close()
        assert path.exists()
        again = allocate_host(1 << 16, "shared", _name("keep"))  # attaches to the same bytes
        assert again.tensor[:3].tolist() == [5, 5, 5]
        again.close()
    finally:
        path.unlink(missing_ok=True)


def test_shared_table_larger_than_dev_shm_fails_up_front():
    free = shutil.disk_usage("/dev/shm").free
    with pytest.raises(HostMemoryError, match="/dev/shm"):
        allocate_host(free + 2**30, "shared", _name("huge"))
    assert not (Path("/dev/shm") / _name("huge")).exists()


class _FailingCudart:
    def cudaHostUnregister(self, ptr):
        return 1  # cudaErrorInvalidValue


def test_failed_unregister_is_an_error_not_swallowed(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FailingCudart())
    buf = HostBuffer(torch.zeros(8, dtype=torch.uint8), "mmap_register", pinned=True, _registered=True)
    with pytest.raises(HostMemoryError, match="cudaHostUnregister"):
        buf.close()
    other = HostBuffer(torch.zeros(8, dtype=torch.uint8), "mmap_register", pinned=True, _registered=True)
    with caplog.at_level(logging.WARNING, logger="condmem.tables"):
        other.__del__()
    assert "cudaHostUnregister" in caplog.text
