"""Table-file integrity: per-chunk hashes written with the rows, checked at open (sampled) and in full
(`verify`, `condmem inspect --verify`, `convert`); a reader maps the file it validated; leftovers of
interrupted writes are refused and swept."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from condmem import EngramConfig, EngramLayout
from condmem.cli import main
from condmem.tables.safetensors_io import StreamingWriter, TableFileError, read_header
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file


def _layout(**kw):
    cfg = dict(layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64, table_size=37, compressed_vocab_size=50)
    cfg.update(kw)
    return EngramLayout(EngramConfig(**cfg))


def _tables(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {l.layer_id: LayerRows("fp8_interleaved", torch.randint(0, 256, (l.num_embeddings, 66), dtype=torch.uint8,
                                                                   generator=gen)) for l in layout.layers}


def _write(path, layout, tables, fingerprint="tok-a", chunk_bytes=None):
    kw = {} if chunk_bytes is None else {"integrity_chunk_bytes": chunk_bytes}
    return write_table_file(path, layout, "fp8_interleaved", {k: [v] for k, v in tables.items()},
                            tokenizer_fingerprint=fingerprint, **kw)


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def table(tmp_path):
    layout = _layout()
    tables = _tables(layout)
    path = _write(tmp_path / "t.safetensors", layout, tables)
    return path, layout, tables


def test_flipped_row_byte_is_refused_at_open(table):
    path, layout, tables = table
    entry = read_header(path).tensors["layers.4.rows"]
    _flip(path, entry.start + entry.nbytes // 2)
    with pytest.raises(TableFileError, match="layers.4.rows.*chunk"):
        EngramTableFile(path)


def test_full_verify_finds_what_the_sample_skips(tmp_path):
    layout = _layout(table_size=400)
    tables = _tables(layout)
    path = _write(tmp_path / "t.safetensors", layout, tables, chunk_bytes=4096)
    entry = read_header(path).tensors["layers.1.rows"]
    assert entry.nbytes > 20 * 4096
    damaged = []
    for k in range(entry.nbytes // 4096):  # one flip per chunk, each in its own copy
        _flip(path, entry.start + k * 4096 + 7)
        try:
            EngramTableFile(path)
        except TableFileError:
            pass
        else:
            damaged.append(k)
            with pytest.raises(TableFileError, match=f"chunk {k}"):
                EngramTableFile(path).verify()
        _flip(path, entry.start + k * 4096 + 7)
    assert damaged, "the sampled check at open reads only a few chunks"
    EngramTableFile(path).verify()


def test_header_metadata_edit_is_refused(table):
    path, _, _ = table
    raw = path.read_bytes()
    assert raw.count(b"tok-a") == 1
    path.write_bytes(raw.replace(b"tok-a", b"tok-b"))
    with pytest.raises(TableFileError, match="header"):
        EngramTableFile(path)


def test_missing_hashes_are_refused_unless_asked(table, caplog):
    path, _, tables = table
    n, = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    header["__metadata__"].pop("integrity")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    data = path.read_bytes()
    path.write_bytes(data[:8] + raw + data[8 + n:])
    with pytest.raises(TableFileError, match="no chunk hashes"):
        EngramTableFile(path)
    f = EngramTableFile(path, verify="none")
    assert "UNVERIFIED" in caplog.text
    assert torch.equal(f.layer(1).weight, tables[1].weight)


def test_reader_reads_the_file_it_validated(tmp_path):
    layout = _layout()
    a, b = _tables(layout, 0), _tables(layout, 1)
    path = _write(tmp_path / "t.safetensors", layout, a, "tok-a")
    opened = EngramTableFile(path, layout=layout, tokenizer_fingerprint="tok-a")
    other = _write(tmp_path / "other.safetensors", _layout(table_size=41), _tables(_layout(table_size=41), 2), "tok-b")
    os.replace(other, path)  # an atomic replacement after the checks passed
    assert torch.equal(opened.layer(1).weight, a[1].weight)
    assert torch.equal(opened.layer(4).weight, a[4].weight)
    del b


def test_half_written_temp_is_not_a_table(tmp_path):
    layout = _layout()
    tables = _tables(layout)
    dst = tmp_path / "t.safetensors"
    specs = {"layers.1.rows": (torch.uint8, (layout.num_embeddings[0], 66)),
             "layers.4.rows": (torch.uint8, (layout.num_embeddings[1], 66))}
    from condmem.tables.table_file import table_metadata

    writer = StreamingWriter(dst, specs, table_metadata(layout, "fp8_interleaved", None))
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


def test_inspect_verify_checks_every_chunk(table, capsys):
    path, _, _ = table
    assert main(["inspect", str(path), "--verify", "--no-progress"]) == 0
    assert "verified" in capsys.readouterr().out
    entry = read_header(path).tensors["layers.1.rows"]
    _flip(path, entry.start + 3)
    assert main(["inspect", str(path), "--verify", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "layers.1.rows" in err and "Traceback" not in err


def test_convert_refuses_a_corrupted_source(tmp_path, capsys):
    layout = _layout(table_size=400)
    path = _write(tmp_path / "t.safetensors", layout, _tables(layout), chunk_bytes=4096)
    entry = read_header(path).tensors["layers.1.rows"]
    _flip(path, entry.start + 5 * 4096 + 1)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(dst), "--to", "fp8", "--no-progress"]) == 1
    assert "layers.1.rows" in capsys.readouterr().err
    assert not dst.exists()
    # The streaming check alone (the sampled check at open skipped) catches it too.
    from condmem.tables.convert import convert_tables

    source = EngramTableFile(path, verify="none")
    with pytest.raises(TableFileError, match="layers.1.rows.*chunk 5"):
        convert_tables(source.tables(), layout, dst, "fp8", chunk_rows=7, progress=False, source=source)
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
