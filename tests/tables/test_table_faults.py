"""Table files under faults: SIGKILL at random points of writes, conversions and cache writes leaves the
whole old or the whole new file (and nothing after the next write); flipped or cut bytes anywhere are
refused with `TableFileError`, never served: not by the host tier as it loads, not by the disk tier at the read
that touches them; a file rewritten or truncated under a live disk-tier reader is a `StorageError` naming it,
never new rows and never a SIGBUS."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from condmem import EngramConfig, EngramLayout
from condmem.tables.convert import convert_tables
from condmem.tables.safetensors_io import TableFileError, read_header
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file
from condmem.utils.atomic import atomic_write_bytes
from fault_harness import flip_byte, kill_during, kill_points, report, spread_offsets, timed

KILLS = 40
CMD = "scripts/test tests/tables/test_table_faults.py -q"


def _layout(table_size=20_000):
    return EngramLayout(
        EngramConfig(
            layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64, table_size=table_size, compressed_vocab_size=50
        )
    )


def _tables(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        l.layer_id: LayerRows(
            "fp8_interleaved", torch.randint(0, 256, (l.num_embeddings, 66), dtype=torch.uint8, generator=gen)
        )
        for l in layout.layers
    }


def _chunked(rows, size=2048):
    return [LayerRows(rows.format, rows.weight[s : s + size]) for s in range(0, rows.num_rows, size)]


def _write(path, layout, tables):
    write_table_file(path, layout, "fp8_interleaved", {k: _chunked(v) for k, v in tables.items()})


def _which(path, versions) -> str:
    """'old' / 'new' when `path` verifies in full and holds exactly one of the versions' rows."""
    f = EngramTableFile(path, verify="full")
    for label, tables in versions.items():
        rows = {lid: f.layer(lid) for lid in tables}
        if all(
            torch.equal(rows[lid].weight.view(torch.uint8), t.weight.view(torch.uint8)) for lid, t in tables.items()
        ):
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
        convert_tables(f.tables(), layout, dst, "fp8_interleaved", chunk_rows=4096, progress=False)

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
    _write(path, layout, tables)
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
    report(
        "one flipped bit in a table file (header and rows, 300 offsets)",
        sum(seen.values()),
        seen,
        CMD + " -k byte_flips",
    )


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


def _row_offsets(path, n, seed):
    """`n` random offsets in the row data of a table file (every layer's tensor, first and last bytes included)."""
    h = read_header(path)
    spans = [(e.start, e.nbytes) for name, e in h.tensors.items() if not name.endswith(".crc32c")]
    rng = random.Random(seed)
    ends = [s + k for s, nb in spans for k in (0, nb - 1)]
    return ends + [s + rng.randrange(nb) for s, nb in (rng.choice(spans) for _ in range(n - len(ends)))]


def _damaged_layer(path, offset):
    h = read_header(path)
    for name, e in h.tensors.items():
        if e.start <= offset < e.start + e.nbytes:
            return int(name.split(".")[1]), (offset - e.start) // e.shape[1]
    raise AssertionError(offset)


def test_flipped_row_bytes_are_never_served_by_the_host_tier(small_table, tmp_path):
    src, layout, tables = small_table
    path = tmp_path / "t.safetensors"
    shutil.copy(src, path)
    seen = Counter()
    for off in _row_offsets(path, 120, seed=11):
        flip_byte(path, off, mask=1 << (off % 8))
        damaged, _ = _damaged_layer(path, off)
        f = EngramTableFile(path, layout=layout)
        for lid, want in tables.items():
            try:
                store = place_layer(f.layer(lid), "host", host_alloc="pageable", progress=False)
            except TableFileError as exc:
                assert lid == damaged and "block" in str(exc) and str(path) in str(exc), exc
                seen["refused at load (TableFileError)"] += 1
                continue
            assert lid != damaged, f"a flipped byte at offset {off} was loaded into the host tier"
            assert torch.equal(store.raw, want.weight)
        flip_byte(path, off, mask=1 << (off % 8))
    assert seen["refused at load (TableFileError)"] == 120
    report("one flipped bit in row data, host tier (120 opens)", 120, seen, CMD + " -k never_served_by_the_host")


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "o_direct"])
def test_flipped_row_bytes_are_never_served_by_the_disk_tier(small_table, tmp_path, direct_io):
    src, layout, tables = small_table
    path = tmp_path / "t.safetensors"
    shutil.copy(src, path)
    if direct_io:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip("this file system refuses O_DIRECT")
    seen = Counter()
    gen = torch.Generator().manual_seed(3)
    # O_DIRECT reads first write back the page the flip dirtied (slow on a virtual disk): fewer opens there,
    # the tier's >= 100 are the buffered ones.
    opens = 30 if direct_io else 110
    for off in _row_offsets(path, opens, seed=12 + direct_io):
        flip_byte(path, off, mask=1 << (off % 8))
        damaged, bad_row = _damaged_layer(path, off)
        f = EngramTableFile(path, layout=layout)
        stores = {
            lid: place_layer(f.layer(lid), "disk", progress=False, direct_io=direct_io, threads=1) for lid in tables
        }
        # Rows outside the damaged 4 KiB block are served exactly; a read that touches it is refused.
        start = f.header.tensors[f"layers.{damaged}.rows"].start
        rows = torch.randint(0, tables[damaged].num_rows, (64,), generator=gen).tolist()
        far = torch.tensor(
            [r for r in rows if not (start + r * 66) // 4096 <= off // 4096 <= (start + r * 66 + 65) // 4096]
        )
        assert torch.equal(stores[damaged].gather_raw(far), tables[damaged].weight[far])
        for lid, want in tables.items():
            ids = torch.randint(0, want.num_rows, (64,), generator=gen)
            if lid == damaged:
                ids[int(ids[0]) % 64] = bad_row
            try:
                got = stores[lid].gather_raw(ids)
            except StorageError as exc:
                assert lid == damaged and "does not match its recorded CRC32C" in str(exc) and str(path) in str(exc)
                assert "was not served" in str(exc)
                seen["refused at the read (StorageError)"] += 1
                continue
            assert lid != damaged, f"a flipped byte at offset {off} was served by the disk tier"
            assert torch.equal(got, want.weight[ids])
        for store in stores.values():
            store.close()
        flip_byte(path, off, mask=1 << (off % 8))
    assert seen["refused at the read (StorageError)"] == opens
    report(
        f"one flipped bit in row data, disk tier ({'O_DIRECT' if direct_io else 'buffered'}, {opens} opens)",
        opens,
        seen,
        CMD + " -k never_served_by_the_disk",
    )


_LIVE_READER = r"""
import sys, time, torch
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile
args = [a.split("=") for a in sys.argv[1:]]   # path=0 (buffered) or path=1 (O_DIRECT)
stores = [
    place_layer(EngramTableFile(p).layer(1), "disk", progress=False, direct_io=d == "1", threads=1)
    for p, d in args
]
n = stores[0].num_rows
want = [s.gather_raw(torch.arange(n)) for s in stores]          # checked: the rows as opened
print("ready", flush=True)
outcome = [None] * len(stores)
gen = torch.Generator().manual_seed(0)
deadline = time.time() + 20
while None in outcome and time.time() < deadline:
    for i, s in enumerate(stores):
        if outcome[i] is not None:
            continue
        ids = torch.randint(0, n, (512,), generator=gen)
        try:
            got = s.gather_raw(ids)
        except StorageError as exc:
            outcome[i] = "ERROR " + str(exc).replace(chr(10), " ")
            continue
        if not torch.equal(got, want[i][ids]):
            outcome[i] = "WRONG ROWS"
    time.sleep(0.01)
for o in outcome:
    print(o or "NO ERROR", flush=True)
sys.exit(0 if all(o and o.startswith("ERROR") for o in outcome) else 2)
"""


def test_cp_and_truncate_under_a_live_disk_reader_are_clear_errors(tmp_path):
    layout = _layout(table_size=400)
    a, b = _tables(layout, 5), _tables(layout, 6)
    files = [tmp_path / f"t{i}.safetensors" for i in range(8)]  # 0-3 read buffered, 4-7 with O_DIRECT
    for f in files:
        _write(f, layout, a)
    try:
        os.close(os.open(files[0], os.O_RDONLY | os.O_DIRECT))
        modes = ["0"] * 4 + ["1"] * 4
    except OSError:  # this file system refuses O_DIRECT: buffered readers only
        modes = ["0"] * 8
    same_size, bigger = tmp_path / "same.safetensors", tmp_path / "bigger.safetensors"
    _write(same_size, layout, b)
    _write(bigger, _layout(table_size=600), _tables(_layout(table_size=600), 8))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _LIVE_READER, *(f"{f}={m}" for f, m in zip(files, modes))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        for k in (0, 4):
            subprocess.run(["cp", str(same_size), str(files[k])], check=True)  # same size, new bytes, in place
            subprocess.run(["cp", str(bigger), str(files[k + 1])], check=True)  # another size, in place
            os.truncate(files[k + 2], files[k + 2].stat().st_size // 2)  # cut under the reader
            os.truncate(files[k + 3], 0)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode != -7, "killed by SIGBUS"
    lines = out.strip().splitlines()
    assert child.returncode == 0, (child.returncode, out, err[-2000:])
    assert len(lines) == 8 and all(line.startswith("ERROR ") for line in lines), out
    for f, line in zip(files, lines):
        assert str(f) in line and "changed under this reader" in line, line
    for k in (0, 4):
        assert "size went from" in lines[k + 1] and "size went from" in lines[k + 2] and "to 0 bytes" in lines[k + 3]
    seen = Counter(line.split(":")[1].split(" since")[0].strip() for line in lines)
    report("cp / truncate over a live disk-tier reader (4 buffered, 4 O_DIRECT)", 8, seen, CMD + " -k live_disk_reader")


def test_a_mapping_of_a_truncated_file_dies_with_sigbus(tmp_path):
    # The negative control: what the disk tier did before it read with pread (Bus error, exit 135 in a shell).
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    code = (
        "import mmap, os, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
        "os.truncate(sys.argv[1], 0); print(m[60000])"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=30, check=False)
    assert done.returncode == -7, done
