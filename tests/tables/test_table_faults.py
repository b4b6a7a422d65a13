"""Table files under faults: SIGKILL at random points of writes, conversions and cache writes leaves the
whole old or the whole new file (and nothing after the next write); flipped or cut bytes anywhere are
refused with `TableFileError`, never served."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
import torch

from condmem import EngramConfig, EngramLayout
from condmem.tables.convert import convert_tables
from condmem.tables.safetensors_io import TableFileError
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file
from condmem.utils.atomic import atomic_write_bytes
from fault_harness import flip_byte, kill_during, kill_points, report, spread_offsets, timed

KILLS = 40
CMD = "scripts/test tests/tables/test_table_faults.py -q"


def _layout(table_size=20_000):
    return EngramLayout(EngramConfig(layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64,
                                     table_size=table_size, compressed_vocab_size=50))


def _tables(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    return {l.layer_id: LayerRows("fp8_interleaved", torch.randint(0, 256, (l.num_embeddings, 66), dtype=torch.uint8,
                                                                   generator=gen)) for l in layout.layers}


def _chunked(rows, size=2048):
    return [LayerRows(rows.format, rows.weight[s:s + size]) for s in range(0, rows.num_rows, size)]


def _write(path, layout, tables, chunk_bytes=1 << 16):
    write_table_file(path, layout, "fp8_interleaved", {k: _chunked(v) for k, v in tables.items()},
                     integrity_chunk_bytes=chunk_bytes)


def _which(path, versions) -> str:
    """'old' / 'new' when `path` verifies in full and holds exactly one of the versions' rows."""
    f = EngramTableFile(path, verify="full")
    for label, tables in versions.items():
        rows = {lid: f.layer(lid) for lid in tables}
        if all(torch.equal(rows[lid].weight.view(torch.uint8), t.weight.view(torch.uint8)) for lid, t in tables.items()):
            return label
    raise AssertionError(f"{path} verifies but holds neither version: silent wrong data")


def _leftovers(folder, keep):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def _check_temps(folder, keep):
    # A killed writer's temp is either refused (incomplete) or a complete, verified copy of the new file.
    for name in _leftovers(folder, keep):
        try:
            EngramTableFile(folder / name, verify="full")
        except TableFileError as exc:
            assert "incomplete" in str(exc) or "too short" in str(exc) or "header" in str(exc), exc


def test_sigkill_during_table_writes(tmp_path):
    layout = _layout()
    old, new = _tables(layout, 0), _tables(layout, 1)
    dst = tmp_path / "t.safetensors"
    _write(dst, layout, old)
    duration = timed(lambda: _write(tmp_path / "probe.safetensors", layout, new))
    (tmp_path / "probe.safetensors").unlink()
    seen = Counter()
    for i, delay in enumerate(kill_points(KILLS, duration, seed=1)):
        finished = kill_during(lambda: _write(dst, layout, new), delay)
        state = _which(dst, {"old": old, "new": new})
        assert not (finished and state == "old")
        seen[state] += 1
        _check_temps(tmp_path, {"t.safetensors"})
        if state == "new":
            _write(dst, layout, old)  # back to the old version for the next kill
    _write(dst, layout, new)
    assert _leftovers(tmp_path, {"t.safetensors"}) == [], "the next write sweeps what killed writers left"
    assert seen["old"] and seen["new"], seen
    report("SIGKILL during a table-file write (over an existing file)", KILLS, seen, CMD + " -k table_writes")


def test_sigkill_during_convert(tmp_path):
    layout = _layout()
    src_rows = _tables(layout, 2)
    src = tmp_path / "src.safetensors"
    _write(src, layout, src_rows)
    dst = tmp_path / "dst.safetensors"
    old = _tables(layout, 3)
    _write(dst, layout, old)

    def convert():
        f = EngramTableFile(src, verify="none")
        convert_tables(f.tables(), layout, dst, "fp8_interleaved", chunk_rows=4096, progress=False, source=f)

    duration = timed(convert)
    _write(dst, layout, old)
    seen = Counter()
    for delay in kill_points(KILLS, duration, seed=2):
        kill_during(convert, delay)
        state = _which(dst, {"old": old, "new": src_rows})
        seen[state] += 1
        _check_temps(tmp_path, {"src.safetensors", "dst.safetensors"})
        if state == "new":
            _write(dst, layout, old)
    convert()
    assert _leftovers(tmp_path, {"src.safetensors", "dst.safetensors"}) == []
    assert seen["old"] and seen["new"], seen
    report("SIGKILL during `convert` (over an existing output)", KILLS, seen, CMD + " -k convert")


def test_sigkill_during_cache_writes(tmp_path):
    dst = tmp_path / "cache.bin"
    old, new = os.urandom(4 << 20), os.urandom(4 << 20)
    atomic_write_bytes(dst, old)
    duration = timed(lambda: atomic_write_bytes(tmp_path / "probe.bin", new))
    (tmp_path / "probe.bin").unlink()
    seen = Counter()
    for delay in kill_points(KILLS, duration, seed=3):
        kill_during(lambda: atomic_write_bytes(dst, new), delay)
        data = dst.read_bytes()
        assert data in (old, new), "a cache file is the whole old or the whole new one"
        seen["old" if data == old else "new"] += 1
        if data == new:
            atomic_write_bytes(dst, old)
    atomic_write_bytes(dst, new)
    assert _leftovers(tmp_path, {"cache.bin"}) == []
    report("SIGKILL during a cache-file write (atomic_write_bytes)", KILLS, seen, CMD + " -k cache_writes")


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    layout = _layout(table_size=400)
    tables = _tables(layout, 4)
    path = tmp_path_factory.mktemp("flip") / "t.safetensors"
    _write(path, layout, tables, chunk_bytes=4096)
    return path, layout, tables


def test_byte_flips_anywhere_are_refused(small_table, tmp_path):
    src, layout, tables = small_table
    path = tmp_path / "t.safetensors"
    shutil.copy(src, path)
    size = path.stat().st_size
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    offsets = spread_offsets(header_end, 150, seed=5, head=16) + spread_offsets(size, 150, seed=6)
    seen = Counter()
    for off in sorted(set(offsets)):
        flip_byte(path, off)
        try:
            EngramTableFile(path, verify="full")
        except TableFileError:
            seen["refused (TableFileError)"] += 1
        else:
            raise AssertionError(f"a flipped byte at offset {off} of {size} was not detected")
        flip_byte(path, off)
    assert _which(path, {"original": tables}) == "original"
    report("one flipped bit in a table file (header and rows, 300 offsets)", sum(seen.values()), seen,
           CMD + " -k byte_flips")


def test_truncations_are_refused(small_table, tmp_path):
    src, _, _ = small_table
    data = src.read_bytes()
    path = tmp_path / "t.safetensors"
    seen = Counter()
    for cut in spread_offsets(len(data), 60, seed=7, head=10):
        path.write_bytes(data[:cut])
        with pytest.raises(TableFileError):
            EngramTableFile(path, verify="none")
        seen["refused (TableFileError)"] += 1
    report("table file truncated (60 lengths)", sum(seen.values()), seen, CMD + " -k truncations")
