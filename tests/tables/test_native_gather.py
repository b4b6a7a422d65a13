"""The native CPU gather equals torch.index_select exactly; bad ids are refused before any copy."""

from __future__ import annotations

import pytest
import torch

from condmem.tables import native_gather
from condmem.tables.storage import LayerStore, StorageError


@pytest.mark.parametrize("row_bytes", [66, 264, 512, 7])
def test_native_gather_equals_index_select(row_bytes):
    if not native_gather.available():
        pytest.skip("no C compiler: the torch fallback is what runs")
    gen = torch.Generator().manual_seed(row_bytes)
    table = torch.randint(0, 256, (5000, row_bytes), dtype=torch.uint8, generator=gen)
    for n in (0, 1, 13, 4097):
        ids = torch.randint(0, 5000, (n,), generator=gen)
        out = torch.full((n, row_bytes), 0xAB, dtype=torch.uint8)  # poisoned
        assert native_gather.native_gather_rows(table, ids, out, threads=2) is out
        assert torch.equal(out, table.index_select(0, ids))


def test_store_gather_checks_ids_and_both_paths_agree():
    table = torch.randint(0, 256, (100, 66), dtype=torch.uint8)
    store = LayerStore("host", "fp8_interleaved", 64, table)
    ids = torch.tensor([5, 99, 0, 5])
    native = store.gather_raw(ids)
    store.native = False
    assert torch.equal(native, store.gather_raw(ids))
    with pytest.raises(StorageError, match="row id 100 outside"):
        store.gather_raw(torch.tensor([1, 100]))


def test_disk_tier_reads_about_a_page_per_cold_row(tmp_path):
    """The disk tier's mapping is advised MADV_RANDOM: a cold row costs about a page of disk
    reads, not the kernel's ~100 KiB read-around (skipped where block reads are not counted)."""
    import os
    import warnings

    import numpy as np
    import pytest
    import torch

    from condmem.tables.storage import place_layer
    from condmem.tables.table_file import LayerRows

    def read_bytes():
        try:
            with open("/proc/self/io") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
        except (OSError, StopIteration):
            return None

    rows, rb = 250_000, 264                       # 63 MiB
    path = tmp_path / "table.bin"
    data = np.random.default_rng(0).integers(0, 256, (rows, rb), dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    arr = np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, rb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # read-only map: never written through
        mapped = torch.from_numpy(arr)
    store = place_layer(LayerRows("fp8_interleaved", mapped), "disk", progress=False)
    ids = torch.from_numpy(np.sort(np.random.default_rng(1).choice(rows, 300, replace=False)))
    before = read_bytes()
    out = store.gather_raw(ids)
    after = read_bytes()
    assert torch.equal(out, torch.from_numpy(data)[ids])
    if before is None or after - before < 300 * 1024:
        pytest.skip("block reads not counted here (page cache kept or /proc/self/io missing)")
    assert (after - before) / 300 < 32 * 1024, f"{(after - before) / 300 / 1024:.0f} KiB read per row"
