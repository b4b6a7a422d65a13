"""Host buffers: shared tables checked against /dev/shm's free space up front; table-named shared files
attached only by users of the same content, removed by their last user, taken over or swept when their
users died (SIGKILL); two processes serving two tables each serve their own rows; a failed unregister
is an error, never swallowed."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from condmem.tables.host_memory import (
    SHM_DIR,
    HostBuffer,
    HostMemoryError,
    allocate_host,
    content_fingerprint,
    shared_table_name,
    sweep_stale_shared,
)

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


def _name(tag: str) -> str:
    return f"condmem-test-{os.getpid()}-{tag}"


def test_shared_table_is_removed_on_close():
    buf = allocate_host(1 << 16, "shared", _name("close"))
    path = Path("/dev/shm") / _name("close")
    assert path.stat().st_size == 1 << 16
    buf.tensor[:10] = 7
    buf.close()
    assert not path.exists()


def test_shared_table_persists_when_asked():
    path = Path("/dev/shm") / _name("keep")
    try:
        buf = allocate_host(1 << 16, "shared", _name("keep"), persist=True)
        buf.tensor[:3] = 5
        buf.close()
        assert path.exists()
        again = allocate_host(1 << 16, "shared", _name("keep"))  # attaches to the same bytes
        assert again.tensor[:3].tolist() == [5, 5, 5]
        again.close()
    finally:
        path.unlink(missing_ok=True)


def test_shared_table_larger_than_dev_shm_fails_up_front():
    free = shutil.disk_usage("/dev/shm").free
    with pytest.raises(HostMemoryError, match="/dev/shm"):
        allocate_host(free + 2**30, "shared", _name("huge"))
    assert not (Path("/dev/shm") / _name("huge")).exists()


class _FailingCudart:
    def cudaHostUnregister(self, ptr):
        return 1  # cudaErrorInvalidValue


def test_failed_unregister_is_an_error_not_swallowed(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FailingCudart())
    buf = HostBuffer(torch.zeros(8, dtype=torch.uint8), "mmap_register", pinned=True, _registered=True)
    with pytest.raises(HostMemoryError, match="cudaHostUnregister"):
        buf.close()
    other = HostBuffer(torch.zeros(8, dtype=torch.uint8), "mmap_register", pinned=True, _registered=True)
    with caplog.at_level(logging.WARNING, logger="condmem.tables"):
        other.__del__()
    assert "cudaHostUnregister" in caplog.text


# ---------------------------------------------------------------------------- table-named shared files
def _table_name(tag: str, layer_id: int = 1) -> str:
    return shared_table_name(content_fingerprint("test", os.getpid(), tag), layer_id)


def _fill_with(*values: int):
    """A `fill` that writes `values` at the start of the buffer (a table-named file is filled by its creator only)."""

    def fill(t: torch.Tensor) -> None:
        t[: len(values)] = torch.tensor(values, dtype=torch.uint8)

    return fill


def _never_filled(t: torch.Tensor) -> None:
    raise AssertionError("a process attaching to a published copy must not fill it")


def test_shared_buffer_needs_a_name():
    with pytest.raises(HostMemoryError, match="shared_table_name"):
        allocate_host(1 << 12, "shared")


def test_same_content_attaches_and_the_last_user_removes_the_file():
    name = _table_name("last")
    path = SHM_DIR / name
    a = allocate_host(1 << 16, "shared", name, fill=_fill_with(1, 2, 3, 4))
    b = allocate_host(1 << 16, "shared", name, fill=_never_filled)  # a second user (its own open file and lock)
    assert not a.attached and b.attached
    assert b.tensor[:4].tolist() == [1, 2, 3, 4]
    a.close()
    assert path.exists(), "removed while another user still maps it"
    assert b.tensor[:4].tolist() == [1, 2, 3, 4]
    b.close()
    assert not path.exists()


def test_other_content_or_layer_never_shares_a_file():
    a = allocate_host(1 << 16, "shared", _table_name("one"), fill=lambda t: t.fill_(1))
    b = allocate_host(1 << 16, "shared", _table_name("two"), fill=lambda t: t.fill_(2))
    c = allocate_host(3 << 14, "shared", _table_name("one", layer_id=2), fill=lambda t: t.fill_(3))  # another size
    try:
        assert a.tensor.eq(1).all() and b.tensor.eq(2).all() and c.tensor.eq(3).all()
        assert len({a._path, b._path, c._path}) == 3
        with pytest.raises(HostMemoryError, match="another size"):
            allocate_host(1 << 15, "shared", _table_name("one"), fill=_never_filled)
    finally:
        for buf in (a, b, c):
            buf.close()


def _hold_and_wait(name: str, nbytes: int, ready, value: int) -> None:
    buf = allocate_host(nbytes, "shared", name, fill=_fill_with(*[value] * 8))
    ready.set()
    signal.pause()  # SIGKILLed here: no handler, no close()
    buf.close()


def _context():
    # Not fork: a child forked from a process whose OpenMP pool has run hangs in its first parallel gather.
    # One forkserver imports torch once for every child.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "condmem.serving.memory"])
    return ctx


def _killed_user(name: str, nbytes: int, value: int) -> None:
    ctx = _context()
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_and_wait, args=(name, nbytes, ready, value))
    proc.start()
    try:
        assert ready.wait(30), "the holder did not start"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def test_file_of_a_sigkilled_user_is_taken_over_by_the_next_user():
    name = _table_name("killed")
    _killed_user(name, 1 << 16, 9)
    path = SHM_DIR / name
    assert path.exists()  # left behind, holding memory
    buf = allocate_host(1 << 16, "shared", name, fill=_never_filled)  # no one holds it: complete, attached as it is
    assert buf.attached and buf.tensor[:8].tolist() == [9] * 8
    buf.close()
    assert not path.exists(), "the next (and last) user must remove it"


def test_stale_files_of_other_tables_are_swept():
    stale = _table_name("stale-other")
    _killed_user(stale, 1 << 16, 5)
    live = allocate_host(1 << 12, "shared", _table_name("live"), fill=_fill_with(1))
    try:
        assert (SHM_DIR / _table_name("live")).exists()
        assert not (SHM_DIR / stale).exists(), "a new shared table must remove stale files of dead users"
        assert sweep_stale_shared() == []  # the live one is locked by its user
    finally:
        live.close()


def _serve(path: str, ready, go, results, tag: str) -> None:
    from condmem import NgramHasher
    from condmem.serving.memory import EngramMemory
    from condmem.tables.table_file import EngramTableFile

    table = EngramTableFile(path)
    hasher = NgramHasher(table.layout())
    expected = {lid: table.layer(lid).weight.clone() for lid in table.layer_ids}
    memory = EngramMemory.from_table_file(path, hasher, "host", "cpu", host_alloc="shared", progress=False)
    ready.set()
    go.wait(60)  # the other process has filled its own table meanwhile
    gen = torch.Generator().manual_seed(0)
    wrong = 0
    for _ in range(5):
        ids = torch.randint(0, 50, (2, 9), generator=gen)
        prepared = memory.prepare(ids)
        for lid in table.layer_ids:
            wrong += int(not torch.equal(prepared.rows(lid), expected[lid][prepared.row_ids(lid)]))
    names = sorted(store._buffer._path.name for store in memory.stores.values())
    assert all((SHM_DIR / n).exists() for n in names)
    memory.close()
    results.put((tag, wrong, names))


def test_two_processes_serving_two_tables_each_serve_their_own_rows(tmp_path):
    from condmem import EngramConfig, EngramLayout
    from condmem.tables.table_file import LayerRows, write_table_file

    # Two layers of different sizes; two tables of the same geometry with different rows.
    cfg = EngramConfig(
        layer_ids=[1, 3], max_ngram_size=3, n_heads=2, head_dim=16, table_size=101, compressed_vocab_size=50
    )
    layout = EngramLayout(cfg)
    assert len(set(layout.num_embeddings)) == 2
    paths = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        rows = {
            lid: [LayerRows("bf16", torch.randn(n, 16, generator=gen).to(torch.bfloat16))]
            for lid, n in zip(layout.layer_ids, layout.num_embeddings)
        }
        paths.append(str(write_table_file(tmp_path / f"t{seed}.safetensors", layout, "bf16", rows)))
    ctx = _context()
    results = ctx.Queue()
    ready = [ctx.Event(), ctx.Event()]
    go = [ctx.Event(), ctx.Event()]
    procs = [
        ctx.Process(target=_serve, args=(p, r, g, results, tag)) for p, r, g, tag in zip(paths, ready, go, ("a", "b"))
    ]
    procs[0].start()
    assert ready[0].wait(60)
    procs[1].start()  # fills its table while the first one holds its own
    assert ready[1].wait(60)
    for g in go:
        g.set()
    out = {tag: (wrong, names) for tag, wrong, names in (results.get(timeout=60) for _ in procs)}
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert out["a"][0] == 0 and out["b"][0] == 0, out
    names = set(out["a"][1]) | set(out["b"][1])
    assert len(names) == 4, names  # two tables x two layers, each its own file
    assert not any((SHM_DIR / n).exists() for n in names), "the last user of each file must remove it"
