"""A ``touch`` on a table the disk tier serves moves its mtime, not its rows: reads go on, every row still
checked against the validated file (block CRCs at every read, chunk digests again after the touch); a
rewrite of the rows or a new size is still refused. Negative control: the old rule (any mtime change
refused) fails the touch test."""

from __future__ import annotations

import os

import pytest
import torch

from condmem import EngramConfig, EngramLayout
from condmem.tables.direct_read import DirectRowReader
from condmem.tables.safetensors_io import StreamingWriter
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows, table_metadata, tensor_names, write_table_file

FORMAT = "fp8_interleaved"


def _layout():
    return EngramLayout(
        EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=64, table_size=200, compressed_vocab_size=50)
    )


def _rows(layout, seed):
    n = layout.layer(1).num_embeddings
    return torch.randint(0, 256, (n, 66), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _write(path, layout, rows, legacy=False):
    if not legacy:
        return write_table_file(path, layout, FORMAT, {1: [LayerRows(FORMAT, rows)]}, tokenizer_fingerprint="tok")
    name = tensor_names(1, FORMAT)["weight"]  # the chunk digests of files written before the block CRCs
    with StreamingWriter(path, {name: (torch.uint8, tuple(rows.shape))}, table_metadata(layout, FORMAT, "tok"),
                         integrity_chunk_bytes=4096) as w:  # fmt: skip
        w.write(name, rows)
    return path


def _touch(path):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.mark.parametrize("legacy", [False, True], ids=["block_crcs", "chunk_digests"])
def test_a_touch_does_not_stop_the_disk_tier(tmp_path, legacy):
    layout = _layout()
    rows = _rows(layout, 0)
    path = _write(tmp_path / "t.safetensors", layout, rows, legacy)
    disk = place_layer(EngramTableFile(path).layer(1), "disk", progress=False)
    ids = torch.arange(rows.shape[0])
    assert torch.equal(disk.gather_raw(ids), rows)
    _touch(path)
    assert torch.equal(disk.gather_raw(ids), rows)
    assert torch.equal(disk.gather_raw(ids.flip(0)), rows.flip(0))


def test_negative_control_the_old_rule_refuses_a_touch(tmp_path, monkeypatch):
    def old(self):
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            self._fail("")

    monkeypatch.setattr(DirectRowReader, "_check_unchanged", old)
    layout = _layout()
    rows = _rows(layout, 0)
    path = _write(tmp_path / "t.safetensors", layout, rows)
    disk = place_layer(EngramTableFile(path).layer(1), "disk", progress=False)
    disk.gather_raw(torch.arange(4))
    _touch(path)
    with pytest.raises(StorageError, match="changed under this reader: it was modified"):
        disk.gather_raw(torch.arange(4))


@pytest.mark.parametrize("legacy", [False, True], ids=["block_crcs", "chunk_digests"])
def test_new_rows_with_the_same_size_after_a_touch_are_still_refused(tmp_path, legacy):
    """The rows rewritten in place, the size kept (the chunks were all checked before: the chunk
    digests must be checked again, not remembered)."""
    layout = _layout()
    rows = _rows(layout, 0)
    path = _write(tmp_path / "t.safetensors", layout, rows, legacy)
    f = EngramTableFile(path)
    disk = place_layer(f.layer(1), "disk", progress=False)
    ids = torch.arange(rows.shape[0])
    assert torch.equal(disk.gather_raw(ids), rows)  # every block / chunk checked once
    start = f.header.tensors[tensor_names(1, FORMAT)["weight"]].start
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(_rows(layout, 1).numpy().tobytes())
    _touch(path)
    with pytest.raises(StorageError, match="changed under this reader: it was modified .*(CRC32C|chunk)"):
        disk.gather_raw(ids)


def test_a_new_size_is_still_refused(tmp_path):
    layout = _layout()
    rows = _rows(layout, 0)
    path = _write(tmp_path / "t.safetensors", layout, rows)
    disk = place_layer(EngramTableFile(path).layer(1), "disk", progress=False)
    disk.gather_raw(torch.arange(4))
    with open(path, "ab") as fh:
        fh.write(b"\0" * 4096)
    with pytest.raises(StorageError, match="changed under this reader: its size went from"):
        disk.gather_raw(torch.arange(4))


def test_negative_control_remembered_chunk_digests_would_serve_the_new_rows(tmp_path, monkeypatch):
    """Taking the touch without checking the chunks again: rows rewritten under it are served unchecked."""

    def without_recheck(self):
        st = os.fstat(self.fd)
        self._stamp = (st.st_size, st.st_mtime_ns)

    monkeypatch.setattr(DirectRowReader, "_check_unchanged", without_recheck)
    layout = _layout()
    rows, new = _rows(layout, 0), _rows(layout, 1)
    path = _write(tmp_path / "t.safetensors", layout, rows, legacy=True)
    f = EngramTableFile(path)
    disk = place_layer(f.layer(1), "disk", progress=False)
    ids = torch.arange(rows.shape[0])
    disk.gather_raw(ids)
    with open(path, "r+b") as fh:
        fh.seek(f.header.tensors[tensor_names(1, FORMAT)["weight"]].start)
        fh.write(new.numpy().tobytes())
    _touch(path)
    assert torch.equal(disk.gather_raw(ids), new), "the new rows, never checked"
