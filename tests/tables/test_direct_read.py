"""Disk rows read with O_DIRECT: equal to the mapped rows, the page cache left empty, the file
checked to be the validated one, bad ids named; through EngramMemory equal to the host tier, and
read through the checked reader (never the mapping) with or without O_DIRECT."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.fp8 import pack_rows, quantize_fp8_e8m0
from condmem.serving import EngramMemory
from condmem.tables.direct_read import DirectRowReader
from condmem.tables.staged_transfer import StagedSender
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows, tensor_names, write_table_file
from page_cache import cached_fraction


def _drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def table(tmp_path):
    cfg = EngramConfig(
        layer_ids=[1, 2],
        max_ngram_size=3,
        n_heads=4,
        head_dim=256,
        table_size=[3001, 2003],
        compressed_vocab_size=50,
        hidden_size=64,
    )
    layout = EngramLayout(cfg)
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for lid in cfg.layer_ids:
        q, s = quantize_fp8_e8m0(torch.randn(layout.layer(lid).num_embeddings, 256, generator=gen))
        rows[lid] = pack_rows(q, s)
    path = tmp_path / "tables.safetensors"
    write_table_file(
        path, layout, "fp8_interleaved", {lid: [LayerRows("fp8_interleaved", r)] for lid, r in rows.items()}
    )
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * 8192)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    return layout, rows, path


def test_direct_rows_equal_the_mapped_rows_and_leave_the_page_cache_empty(table):
    layout, rows, path = table
    tf = EngramTableFile(path, layout=layout)
    entry = tf.header.tensors[tensor_names(2, "fp8_interleaved")["weight"]]
    identity = tf.header.identity
    n = rows[2].shape[0]
    del tf  # its mapping (pages it touched checking hashes) must go, or they cannot be dropped
    gc.collect()
    _drop_cache(path)
    assert cached_fraction(path, entry.start, n * 264) < 0.02, "could not empty the page cache for the test"
    reader = DirectRowReader(path, entry.start, 264, n, identity=identity)
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, n, (3000,), generator=gen), torch.tensor([0, n - 1, n - 1, 5, 5])])
    got = reader.read(ids)
    assert torch.equal(got, rows[2][ids]), "rows differ from the file's"
    assert cached_fraction(path, entry.start, n * 264) < 0.02, "direct reads filled the page cache"
    mapped = EngramTableFile(path, layout=layout).layer(2).weight
    assert torch.equal(mapped[ids], got)  # the mapping pulls pages in: the negative control
    assert cached_fraction(path, entry.start, n * 264) > 0.2
    with pytest.raises(StorageError, match=f"row id {n} outside"):
        reader.read(torch.tensor([1, n]))
    reader.close()


def test_a_replaced_file_is_refused(table, tmp_path):
    layout, rows, path = table
    tf = EngramTableFile(path, layout=layout)
    entry = tf.header.tensors[tensor_names(1, "fp8_interleaved")["weight"]]
    other = tmp_path / "other.safetensors"
    other.write_bytes(path.read_bytes())
    os.replace(other, path)  # same bytes, another file
    with pytest.raises(StorageError, match="no longer the file that was validated"):
        DirectRowReader(path, entry.start, 264, rows[1].shape[0], identity=tf.header.identity)
    with pytest.raises(StorageError, match="run past"):
        DirectRowReader(path, entry.start, 264, rows[1].shape[0] * 10)


def test_engram_memory_on_direct_disk_reads_equals_the_host_tier(table):
    layout, rows, path = table
    hasher = NgramHasher(layout)
    ids = torch.randint(0, 50, (3, 17), generator=torch.Generator().manual_seed(2))
    host = EngramMemory.from_table_file(path, hasher, "host", "cpu", host_alloc="pageable", progress=False)
    disk = EngramMemory.from_table_file(
        path, hasher, "disk", "cpu", direct_io=True, dram_cache_bytes=64 * 264, progress=False
    )
    for _ in range(2):  # the second pass hits the DRAM cache for some rows
        a, b = host.prepare(ids), disk.prepare(ids)
        for lid in layout.layer_ids:
            assert torch.equal(a.rows(lid), b.rows(lid)), lid
    assert disk.stores[1].inner.direct_reader is not None and disk.stores[1].cache.stats.hits > 0
    # The engine's staged send must read through the checked reader (O_DIRECT or buffered), never the
    # mapping's native gather (unchecked, and SIGBUS on a truncated file); rows given as a mapped tensor
    # keep the native send (control).
    sender = SimpleNamespace(native=True)
    assert not StagedSender.uses_native(sender, disk.stores[2].inner)  # the direct reader alone
    buffered = EngramMemory.from_table_file(path, hasher, "disk", "cpu", progress=False)
    assert not StagedSender.uses_native(sender, buffered.stores[2])
    mapped = place_layer(LayerRows("fp8_interleaved", EngramTableFile(path).layer(2).weight), "disk", progress=False)
    assert StagedSender.uses_native(sender, mapped)
    buffered.close()
    with pytest.raises(StorageError, match="serves the disk tier"):
        host.stores[1].direct_reader = disk.stores[1].direct_reader
    with pytest.raises(ValueError, match="direct_io reads the disk tier"):
        EngramMemory.from_table_file(path, hasher, "host", "cpu", direct_io=True)
    host.close()
    disk.close()
