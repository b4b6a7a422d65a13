"""The native CPU gather equals torch.index_select exactly; bad ids are refused before any copy;
the loader uses the installed build (or says why not), refuses a build of another source,
keys its development build by compiler, and warns when it falls back to torch."""

from __future__ import annotations

import ctypes
import importlib.util
import logging

import pytest
import torch

from condmem import native
from condmem.native import toolchain
from condmem.tables.errors import StorageError
from condmem.tables.storage import HostStore

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native build: {native.build().reason}")


@needs_native
@pytest.mark.parametrize(
    "rows, row_bytes",
    [(5000, 66), (5000, 264), (5000, 512), (5000, 7), (200_000, 264)],
    ids=["66B", "264B", "512B", "7B", "264B-53MB-table"],
)
def test_native_gather_equals_index_select(rows, row_bytes):
    gen = torch.Generator().manual_seed(row_bytes + rows)
    table = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    for n in (0, 1, 13, 4097):
        ids = torch.randint(0, rows, (n,), generator=gen)
        ids[: n // 2] = ids[n // 2 : 2 * (n // 2)]  # repeated ids
        out = torch.full((n, row_bytes), 0xAB, dtype=torch.uint8)  # poisoned
        assert native.gather_rows(table, ids, out, threads=2) is out
        assert torch.equal(out, table.index_select(0, ids))


def test_store_gather_checks_ids_and_both_paths_agree(monkeypatch):
    table = torch.randint(0, 256, (100, 66), dtype=torch.uint8)
    store = HostStore("fp8_interleaved", 64, table)
    ids = torch.tensor([5, 99, 0, 5])
    first = store.gather_raw(ids)  # native where available
    monkeypatch.setattr(native, "available", lambda: False)
    assert torch.equal(first, store.gather_raw(ids))  # torch.index_select
    assert torch.equal(first, table.index_select(0, ids))
    with pytest.raises(StorageError, match="row id 100 outside"):
        store.gather_raw(torch.tensor([1, 100]))


def test_the_loader_uses_the_installed_build():
    """`pip install -e .` (scripts/test, .ci/run) builds the extension; the loader must use it,
    not a development build. Skipped with the loader's reason where it does not (a source
    tree on PYTHONPATH, or a failed compile at install)."""
    found = native.build()
    if found.kind != "installed":
        pytest.skip(f"the loader uses the {found.kind} build: {found.reason}")
    assert found.path == importlib.util.find_spec(toolchain.MODULE).origin
    lib = ctypes.CDLL(found.path)
    lib.condmem_source_digest.restype = ctypes.c_char_p
    assert lib.condmem_source_digest().decode() == toolchain.source_digest()


@needs_native
def test_a_build_of_another_source_is_refused(monkeypatch):
    monkeypatch.setattr(toolchain, "source_digest", lambda sources=toolchain.SOURCES: "0" * 16)
    with pytest.raises(ValueError, match="built from other C sources"):
        native._open(native.build().path)


@pytest.mark.skipif(toolchain.find_compiler() is None, reason="no C compiler")
def test_the_development_build_is_keyed_by_compiler_and_target(tmp_path, monkeypatch):
    first = toolchain.development_build(tmp_path)
    assert toolchain.development_build(tmp_path) == first  # cached
    lib = native._open(str(first))  # same source, same entry points
    table = torch.randint(0, 256, (50, 264), dtype=torch.uint8)
    ids, out = torch.tensor([3, 49, 3, 0]), torch.empty((4, 264), dtype=torch.uint8)
    lib.condmem_gather_rows(table.data_ptr(), 264, ids.data_ptr(), 4, out.data_ptr(), 1)
    assert torch.equal(out, table.index_select(0, ids))
    real = toolchain.compiler_identity
    monkeypatch.setattr(toolchain, "compiler_identity", lambda cc: real(cc) + "|another target")
    assert toolchain.development_build(tmp_path) != first  # another compiler or CPU: another file


def test_the_fallback_is_a_loud_warning_with_its_cost(monkeypatch, caplog):
    monkeypatch.setattr(native, "_installed", lambda: (None, None, "no installed build"))
    monkeypatch.setattr(toolchain, "find_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="condmem.native"):
        lib, found = native._find()
    assert lib is None and found.kind == "none" and "no C compiler" in found.reason
    assert "NATIVE CPU CODE UNAVAILABLE" in caplog.text and "docs/lookup-engine.md#native-code" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CONDMEM_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="condmem.native"):
        lib, found = native._find()
    assert lib is None and found.reason == "turned off by CONDMEM_NATIVE=0" and "slower" in caplog.text


def test_gather_path_names_the_gather_that_runs(monkeypatch):
    assert native.gather_path() == ("native" if native.available() else "torch")
    monkeypatch.setattr(native, "available", lambda: False)
    assert native.gather_path() == "torch"


def test_disk_tier_reads_about_a_page_per_cold_row(tmp_path):
    """The disk tier's mapping is advised MADV_RANDOM: a cold row costs about a page of disk
    reads, not the kernel's ~100 KiB read-around (skipped where block reads are not counted)."""
    import os
    import warnings

    import numpy as np

    from condmem.tables.storage import place_layer
    from condmem.tables.table_file import LayerRows

    def read_bytes():
        try:
            with open("/proc/self/io") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
        except (OSError, StopIteration):
            return None

    rows, rb = 250_000, 264  # 63 MiB
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
        warnings.simplefilter("ignore", UserWarning)  # read-only map: never written through
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
