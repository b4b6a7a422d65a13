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
