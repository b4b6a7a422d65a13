"""Table-file integrity: a CRC32C per 4 KiB block written with the rows and checked wherever rows are read
(the host tier as it loads, the disk tier at each read, `verify` / `condmem inspect --verify`, `convert`); older
files with sha256 chunks open with a note and are checked chunk by chunk; a reader reads the file it validated;
leftovers of interrupted writes are refused and swept."""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from condmem import EngramConfig, EngramLayout, native
from condmem.cli import main
from condmem.tables import integrity
from condmem.tables.safetensors_io import StreamingWriter, TableFileError, read_header
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import (
    EngramTableFile,
    LayerRows,
    table_metadata,
    tensor_names,
    write_table_file,
)


def _layout(**kw):
    cfg = dict(layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64, table_size=37, compressed_vocab_size=50)
    cfg.update(kw)
    return EngramLayout(EngramConfig(**cfg))


def _tables(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        l.layer_id: LayerRows(
            "fp8_interleaved", torch.randint(0, 256, (l.num_embeddings, 66), dtype=torch.uint8, generator=gen)
        )
        for l in layout.layers
    }


def _write(path, layout, tables, fingerprint="tok-a"):
    return write_table_file(
        path, layout, "fp8_interleaved", {k: [v] for k, v in tables.items()}, tokenizer_fingerprint=fingerprint
    )


def write_legacy(path, layout, tables, chunk_bytes=4096):
    """A table file as written before the block CRCs: a sha256 per chunk of every tensor."""
    specs = {
        tensor_names(lid, "fp8_interleaved")["weight"]: (torch.uint8, tuple(t.weight.shape))
        for lid, t in tables.items()
    }
    with StreamingWriter(
        path, specs, table_metadata(layout, "fp8_interleaved", "tok-a"), integrity_chunk_bytes=chunk_bytes
    ) as w:
        for lid, t in tables.items():
            w.write(tensor_names(lid, "fp8_interleaved")["weight"], t.weight)
    return path


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def table(tmp_path):
    layout = _layout(table_size=400)
    tables = _tables(layout)
    path = _write(tmp_path / "t.safetensors", layout, tables)
    return path, layout, tables


def test_writer_records_a_crc32c_per_block_of_the_file_grid(table):
    path, _, _ = table
    google_crc32c = pytest.importorskip("google_crc32c")
    h = read_header(path)
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 4096 == 0, "the data starts on a block edge"
    data = path.read_bytes()
    for lid in (1, 4):
        e = h.tensors[f"layers.{lid}.rows"]
        sums = h.tensors[f"layers.{lid}.rows.crc32c"]
        crcs = np.frombuffer(data[sums.start : sums.start + sums.nbytes], "<u4")
        edges = [e.start, *range((e.start // 4096 + 1) * 4096, e.start + e.nbytes, 4096), e.start + e.nbytes]
        want = [google_crc32c.value(data[lo:hi]) for lo, hi in itertools.pairwise(edges)]
        assert crcs.tolist() == want
    assert EngramTableFile(path).block_crcs


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "google_crc32c"])
def test_crc32c_native_and_fallback_agree(monkeypatch, fallback):
    pytest.importorskip("google_crc32c")
    if fallback:
        for name in ("crc32c", "crc32c_blocks"):
            monkeypatch.setattr(native, name, lambda *a, **k: None)
    elif not native.available():
        pytest.skip("no native library")
    assert integrity.crc32c(b"123456789") == 0xE3069283
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 50_000, dtype=np.uint8)
    import google_crc32c

    assert integrity.crc32c(data[700:], integrity.crc32c(data[:700])) == google_crc32c.value(data.tobytes())
    sums = integrity.block_crcs(data, 100, 4096)
    edges = [0, *range(100, data.size, 4096), data.size]
    assert sums.tolist() == [google_crc32c.value(data[a:b].tobytes()) for a, b in itertools.pairwise(edges)]
    bad = sums.copy()
    bad[5] ^= 1
    assert integrity.block_crcs(data, 100, 4096, sums) == -1 and integrity.block_crcs(data, 100, 4096, bad) == 5
    summer = integrity.BlockSummer(4096 - 100, data.size, 4096)
    for lo in range(0, data.size, 777):  # writes of any size, across block edges
        summer.update(data[lo : lo + 777])
    assert summer.finish().tolist() == sums.tolist()


def test_a_flipped_row_byte_is_refused_where_it_is_read(table):
    path, _, tables = table
    entry = read_header(path).tensors["layers.4.rows"]
    bad = entry.start + entry.nbytes // 2
    _flip(path, bad)
    f = EngramTableFile(path)  # opening reads no rows
    assert torch.equal(place_layer(f.layer(1), "host", host_alloc="pageable", progress=False).raw, tables[1].weight)
    with pytest.raises(TableFileError, match=r"t.safetensors: tensor 'layers.4.rows', block \d+ .*CRC32C"):
        place_layer(f.layer(4), "host", host_alloc="pageable", progress=False)
    disk = place_layer(f.layer(4), "disk", progress=False)
    row = (bad - entry.start) // 66
    far = torch.tensor([0, 1, tables[4].num_rows - 1])
    assert torch.equal(disk.gather_raw(far), tables[4].weight[far]), "rows of undamaged blocks are served"
    with pytest.raises(StorageError, match=f"layers.4.rows', block .*row {row} was not served"):
        disk.gather_raw(torch.tensor([0, row]))
    with pytest.raises(TableFileError, match="layers.4.rows', block"):
        f.verify()
    with pytest.raises(TableFileError, match="layers.4.rows', block"):
        EngramTableFile(path, verify="full")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_interleaved", "fp8", "bf16"])
def test_the_hbm_tier_checks_what_it_loads(tmp_path, fmt):
    from condmem.fp8 import pack_rows, quantize_fp8_e8m0

    layout = _layout(table_size=400)
    gen = torch.Generator().manual_seed(0)
    tables = {}
    for l in layout.layers:
        q = torch.randn(l.num_embeddings, 64, generator=gen)
        if fmt == "bf16":
            tables[l.layer_id] = LayerRows("bf16", q.bfloat16())
        else:
            w, s = quantize_fp8_e8m0(q)
            tables[l.layer_id] = LayerRows("fp8", w, s) if fmt == "fp8" else LayerRows(fmt, pack_rows(w, s))
    path = write_table_file(tmp_path / "t.safetensors", layout, fmt, {k: [v] for k, v in tables.items()})
    f = EngramTableFile(path)
    for lid, rows in tables.items():
        store = place_layer(f.layer(lid), "hbm", progress=False, chunk_rows=100)  # several staging rounds
        want = {
            "bf16": lambda: rows.weight.view(torch.uint8),
            "fp8": lambda: pack_rows(rows.weight, rows.scales),
            "fp8_interleaved": lambda: rows.weight,
        }[fmt]()
        assert torch.equal(store.raw.cpu(), want)
    entry = f.header.tensors[tensor_names(4, fmt)["weight"]]
    _flip(path, entry.start + entry.nbytes - 2)
    with pytest.raises(TableFileError, match="block"):
        place_layer(EngramTableFile(path).layer(4), "hbm", progress=False)


def test_damaged_block_crcs_are_refused_at_open(table):
    path, _, _ = table
    sums = read_header(path).tensors["layers.1.rows.crc32c"]
    _flip(path, sums.start + 3)
    with pytest.raises(TableFileError, match="layers.1.rows.crc32c.*sha256"):
        EngramTableFile(path)


def test_the_python_reader_checks_like_the_native_one(table, monkeypatch):
    path, _, tables = table
    monkeypatch.setattr("condmem.tables.direct_read.native_pread_rows", lambda *a, **k: None)
    entry = read_header(path).tensors["layers.1.rows"]
    f = EngramTableFile(path)
    ids = torch.tensor([0, 5, 5, tables[1].num_rows - 1, 800])
    assert torch.equal(place_layer(f.layer(1), "disk", progress=False).gather_raw(ids), tables[1].weight[ids])
    _flip(path, entry.start + 800 * 66 + 10)
    with pytest.raises(StorageError, match="modified"):  # the file it opened changed under it
        place_layer(f.layer(1), "disk", progress=False).gather_raw(ids)
    with pytest.raises(StorageError, match="row 800 was not served"):
        place_layer(EngramTableFile(path).layer(1), "disk", progress=False).gather_raw(ids)


def test_header_metadata_edit_is_refused(table):
    path, _, _ = table
    raw = path.read_bytes()
    assert raw.count(b"tok-a") == 1
    path.write_bytes(raw.replace(b"tok-a", b"tok-b"))
    with pytest.raises(TableFileError, match="header"):
        EngramTableFile(path)


def test_missing_hashes_are_refused_unless_asked(table, caplog):
    path, _, tables = table
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    header["__metadata__"].pop("integrity")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    data = path.read_bytes()
    path.write_bytes(data[:8] + raw + data[8 + n :])
    with pytest.raises(TableFileError, match="no chunk hashes"):
        EngramTableFile(path)
    f = EngramTableFile(path, verify="none")
    assert "UNVERIFIED" in caplog.text
    assert torch.equal(f.layer(1).weight, tables[1].weight)
    assert torch.equal(
        place_layer(f.layer(1), "disk", progress=False).gather_raw(torch.tensor([3])), tables[1].weight[3:4]
    )


def test_a_table_written_before_the_block_crcs_opens_with_a_note_and_is_checked_chunk_by_chunk(tmp_path, caplog):
    layout = _layout(table_size=400)
    tables = _tables(layout)
    path = write_legacy(tmp_path / "old.safetensors", layout, tables)
    with caplog.at_level(logging.WARNING, "condmem.tables"):
        f = EngramTableFile(path, layout=layout, tokenizer_fingerprint="tok-a")
    notes = [r.getMessage() for r in caplog.records if "before per-block checksums" in r.getMessage()]
    assert len(notes) == 1 and "\n" not in notes[0] and "chunk by chunk" in notes[0] and "convert" in notes[0]
    assert not f.block_crcs
    host = place_layer(f.layer(4), "host", host_alloc="pageable", progress=False)
    assert torch.equal(host.raw, tables[4].weight)
    disk = place_layer(f.layer(4), "disk", progress=False)
    ids = torch.randint(0, tables[4].num_rows, (200,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(disk.gather_raw(ids), tables[4].weight[ids])
    entry = f.header.tensors["layers.4.rows"]
    row = tables[4].num_rows - 3  # in a chunk the reads above may not have touched
    _flip(path, entry.start + row * 66)
    fresh = EngramTableFile(path)
    with pytest.raises(TableFileError, match="layers.4.rows', chunk"):
        place_layer(fresh.layer(4), "host", host_alloc="pageable", progress=False)
    with pytest.raises(StorageError, match="layers.4.rows', chunk"):
        place_layer(fresh.layer(4), "disk", progress=False).gather_raw(torch.tensor([row]))
    assert main(["inspect", str(path), "--verify", "--no-progress"]) == 1


def test_a_content_change_with_the_same_size_and_mtime_is_still_refused(table):
    path, layout, tables = table
    f = EngramTableFile(path)
    disk = place_layer(f.layer(1), "disk", progress=False)
    entry = f.header.tensors["layers.1.rows"]
    st = os.stat(path)
    other = _tables(layout, seed=9)[1].weight
    with open(path, "r+b") as fh:  # what `rsync --inplace --times` does: new bytes, the old size and mtime
        fh.seek(entry.start)
        fh.write(other.numpy().tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    ids = torch.arange(tables[1].num_rows)
    with pytest.raises(StorageError, match="does not match its recorded CRC32C"):
        disk.gather_raw(ids)


def test_reader_reads_the_file_it_validated(tmp_path):
    layout = _layout()
    a = _tables(layout, 0)
    path = _write(tmp_path / "t.safetensors", layout, a, "tok-a")
    opened = EngramTableFile(path, layout=layout, tokenizer_fingerprint="tok-a")
    other = _write(tmp_path / "other.safetensors", _layout(table_size=41), _tables(_layout(table_size=41), 2), "tok-b")
    os.replace(other, path)  # an atomic replacement after the checks passed
    assert torch.equal(opened.layer(1).weight, a[1].weight)
    for tier in ("host", "disk"):  # the tiers read the validated inode, not the path
        store = place_layer(opened.layer(4), tier, host_alloc="pageable", progress=False)
        assert torch.equal(store.gather_raw(torch.arange(a[4].num_rows)), a[4].weight), tier


def test_half_written_temp_is_not_a_table(tmp_path):
    layout = _layout()
    tables = _tables(layout)
    dst = tmp_path / "t.safetensors"
    specs = {
        "layers.1.rows": (torch.uint8, (layout.num_embeddings[0], 66)),
        "layers.4.rows": (torch.uint8, (layout.num_embeddings[1], 66)),
    }
    writer = StreamingWriter(dst, specs, table_metadata(layout, "fp8_interleaved", None), block_bytes=4096)
    writer.write("layers.1.rows", tables[1].weight)
    writer._fh.flush()
    with pytest.raises(TableFileError, match="incomplete"):
        EngramTableFile(writer._tmp)
    writer.abort()
    assert not list(tmp_path.iterdir())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_of_dead_writers_are_swept(table):
    path, layout, tables = table
    stale = path.parent / f".{path.name}.{_dead_pid()}.abcd1234.tmp"
    live = path.parent / f".{path.name}.{os.getpid()}.zz.tmp"
    stale.write_bytes(b"x" * 100)
    live.write_bytes(b"y")
    _write(path, layout, tables)
    assert not stale.exists(), "a dead writer's temp file is swept by the next write"
    assert live.exists(), "a live writer's temp file is left alone"


def test_inspect_verify_checks_every_block(table, capsys):
    path, _, _ = table
    assert main(["inspect", str(path), "--verify", "--no-progress"]) == 0
    assert "every 4 KiB block matches its recorded CRC32C" in capsys.readouterr().out
    entry = read_header(path).tensors["layers.1.rows"]
    _flip(path, entry.start + entry.nbytes - 1)
    assert main(["inspect", str(path), "--verify", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "layers.1.rows" in err and "block" in err and "Traceback" not in err


def test_convert_refuses_a_corrupted_source(table, tmp_path, capsys):
    path, layout, _ = table
    entry = read_header(path).tensors["layers.1.rows"]
    _flip(path, entry.start + 5 * 4096 + 1)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(dst), "--to", "fp8", "--no-progress"]) == 1
    assert "layers.1.rows" in capsys.readouterr().err
    assert not dst.exists()
    from condmem.tables.convert import convert_tables

    source = EngramTableFile(path)
    with pytest.raises(TableFileError, match=r"layers.1.rows', block \d+"):
        convert_tables(source.tables(), layout, dst, "fp8", chunk_rows=7, progress=False)
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_convert_rewrites_an_old_table_with_block_crcs(tmp_path):
    layout = _layout(table_size=400)
    tables = _tables(layout)
    old = write_legacy(tmp_path / "old.safetensors", layout, tables)
    new = tmp_path / "new.safetensors"
    assert main(["convert", str(old), str(new), "--to", "fp8_interleaved", "--no-progress"]) == 0
    f = EngramTableFile(new, verify="full")
    assert f.block_crcs and torch.equal(f.read_rows(4, 0, tables[4].num_rows).weight, tables[4].weight)
