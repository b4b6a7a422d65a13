"""Host memory from the CUDA VMM API: one address for CPU writes, GPU zero-copy reads and DMA."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import cuda_only

from condmem.tables.host_memory import HostMemoryError, allocate_host


def test_vmm_needs_cuda_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(HostMemoryError, match="CUDA"):
        allocate_host(1 << 20, "vmm")


@cuda_only
def test_gpu_vmm_rows_written_by_the_cpu_are_read_exactly_zero_copy_and_by_dma():
    from condmem.ops.gather import engram_gather
    from condmem.tables.vmm_host import host_granularity

    rows, width = 50_003, 72  # not a multiple of the granularity: the size is rounded up inside
    buf = allocate_host(rows * width, "vmm")
    assert buf.pinned and buf.nbytes == rows * width
    table = buf.tensor.view(rows, width)
    src = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    table.copy_(src)  # the CPU writes through the same address the GPU reads
    ids = torch.randint(0, rows, (4096,), generator=torch.Generator().manual_seed(2))
    out = torch.full((4096, width), 0xAB, dtype=torch.uint8, device="cuda")  # poisoned
    engram_gather(ids.cuda(), table, out=out)
    assert torch.equal(out.cpu(), src[ids])
    dma = torch.empty((rows, width), dtype=torch.uint8, device="cuda")
    dma.copy_(table, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dma.cpu(), src)
    # GPU writes are seen by the CPU too (the staging direction is not used, but the mapping is RW).
    table[:8].copy_(torch.zeros((8, width), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    assert int(table[:8].sum()) == 0
    assert host_granularity() >= 2 << 20


@cuda_only
def test_gpu_vmm_memory_lives_as_long_as_any_view():
    buf = allocate_host(8 << 20, "vmm")
    view = buf.tensor[1024:2048]
    view.fill_(7)
    buf.close()
    del buf
    gc.collect()
    assert int(view.sum()) == 7 * 1024  # still mapped: the last view owns it
