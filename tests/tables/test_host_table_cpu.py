"""A host-tier table on a machine without a GPU: nothing warns about GPU reads it will never see."""

from __future__ import annotations

import torch

from condmem.tables.storage import place_layer
from condmem.tables.table_file import LayerRows


def test_a_host_table_without_a_gpu_does_not_warn_about_gpu_page_walks(monkeypatch, caplog):
    # Huge-page coverage matters to the GPU's zero-copy reads of page-locked rows; here nothing is
    # page-locked and only the CPU reads the rows, so a low coverage is logged as information.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rows = LayerRows("bf16", torch.randn(3000, 64).bfloat16())
    with caplog.at_level("INFO", logger="condmem.tables"):
        store = place_layer(rows, "host", host_alloc="mmap_register", progress=False)
    try:
        assert torch.equal(store.raw.view(torch.bfloat16), rows.weight)
    finally:
        store.close()
    assert "huge pages" in caplog.text  # the coverage is still reported
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
