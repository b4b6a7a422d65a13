"""Shared host tables (``host_alloc="shared"``) across processes: one writer fills and checks a copy before
any other process maps it, and a process that attaches never writes it.

* A second process whose table file has a damaged block (same fingerprint) is refused with an error
  naming its file and block, and the first process's rows stay exact (20 damaged offsets); the old
  order (write into the shared copy, then check), put back by a monkeypatch, serves wrong rows.
* A creator SIGKILLed mid-fill leaves a copy no one trusts: the next process fills it again; trusting
  it (the ready mark ignored, the attach-time comparison off) serves wrong rows.
* A published copy that differs from an attaching process's own (sound) rows is refused, not written;
  attached unchecked (the comparison taken out), it serves wrong rows.
* Two processes racing to create, one with a damaged file: the good one's rows are exact, the other
  is refused; exactly one of two good racers fills each layer. The last user removes the file.

Other processes come from multiprocessing's ``forkserver``: a fresh interpreter started for them (as
``spawn`` starts one), which imports torch once and forks each of them, so they share none of this
process's mappings, locks or descriptors, and do not each pay torch's import (5 s on a 2-core CPU).
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.serving.memory import EngramMemory
from condmem.tables import host_memory, storage
from condmem.tables.host_memory import SHARED_HEADER_BYTES, SHM_DIR
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")

TRIES = 20


# ---------------------------------------------------------------------------- tables and damage
def _write_table(path: Path, seed: int) -> Path:
    """A small two-layer bf16 table (a few dozen 4 KiB blocks) whose rows depend on `seed`.

    SEEDS: each test writes a table no other test writes. Shared copies are named by the table's
    content, so two tests with one table, run at once (pytest-xdist), would share one copy, and
    the one that expects to fill it would find it filled."""
    cfg = EngramConfig(
        layer_ids=[1, 3], max_ngram_size=3, n_heads=2, head_dim=32, table_size=211, compressed_vocab_size=50
    )
    layout = EngramLayout(cfg)
    gen = torch.Generator().manual_seed(seed)
    rows = {
        lid: [LayerRows("bf16", torch.randn(n, 32, generator=gen).to(torch.bfloat16))]
        for lid, n in zip(layout.layer_ids, layout.num_embeddings)
    }
    return write_table_file(path, layout, "bf16", rows)


def _row_bytes_in_file(path: Path) -> list[int]:
    """Absolute offsets of every row byte of every layer (the weight tensors' data)."""
    table = EngramTableFile(path)
    spans = []
    for lid in table.layer_ids:
        src = table.source(lid)
        _, start, row_bytes = src.spans["weight"]
        spans.append((start, start + src.num_rows * row_bytes))
    return spans


def _damaged_offsets(path: Path, n: int, seed: int) -> list[int]:
    """`n` offsets in row data: the first and last row byte of each layer, the rest spread at random."""
    spans = _row_bytes_in_file(path)
    fixed = [o for a, b in spans for o in (a, b - 1)]
    rng = random.Random(seed)
    rest = []
    while len(fixed) + len(rest) < n:
        a, b = spans[len(rest) % len(spans)]
        rest.append(rng.randrange(a, b))
    return sorted(set(fixed + rest))[:n]


def _damaged_copy(good: Path, out: Path, offset: int, mask: int) -> Path:
    """A copy of `good` with one bit flipped at `offset`: same header, same recorded checksums (same fingerprint)."""
    shutil.copyfile(good, out)
    with open(out, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([b ^ mask]))
    return out


def _expected_raw(path: Path) -> dict[int, torch.Tensor]:
    table = EngramTableFile(path)
    return {lid: table.layer(lid).weight.view(torch.uint8).clone() for lid in table.layer_ids}


def _open_shared(path: Path) -> EngramMemory:
    table = EngramTableFile(path)
    return EngramMemory.from_table_file(
        path, NgramHasher(table.layout()), "host", "cpu", host_alloc="shared", progress=False
    )


def _rows_exact(memory: EngramMemory, expected: dict[int, torch.Tensor], seed: int) -> bool:
    """Every stored row equal to the table's (torch.equal), and a served lookup's rows too."""
    ok = all(torch.equal(memory.stores[lid].raw, expected[lid]) for lid in expected)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(seed))
    prepared = memory.prepare(ids)
    for lid in expected:
        want = expected[lid].view(torch.bfloat16)[prepared.row_ids(lid)]
        ok = ok and torch.equal(prepared.rows(lid), want)
    return ok


def _names(memory: EngramMemory) -> list[str]:
    return sorted(store._buffer._path.name for store in memory.stores.values())


def _ctx():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "condmem.serving.memory"])
    return ctx


# ---------------------------------------------------------------------------- the old order, for the controls
def _old_order_check(rows, raw, buffer, bar, threads, drop_cache, chunk_rows, name) -> None:
    """What an attaching process did before: read its file straight into the shared copy (a writable mapping
    of it), checking each block after it landed."""
    fd = os.open(buffer._path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, raw.numel(), flags=mmap.MAP_SHARED, offset=SHARED_HEADER_BYTES)
    finally:
        os.close(fd)
    writable = torch.frombuffer(mm, dtype=torch.uint8).view(raw.shape)
    storage._read_source(rows.source, writable, bar, threads, drop_cache, chunk_rows)


# ---------------------------------------------------------------------------- second process with a damaged file
def _second_process(paths: list[str], results, acks, old_order: bool) -> None:
    """Open each (damaged) table file with host_alloc="shared", one at a time, reporting how it went."""
    if old_order:
        storage._check_published = _old_order_check
    for p in paths:
        try:
            memory = _open_shared(Path(p))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((type(exc).__name__, str(exc)))
        else:
            memory.close()
            results.put(("served", ""))
        acks.get(timeout=60)


def _refusals_while_the_first_serves(tmp_path: Path, tries: int, old_order: bool, seed: int):
    """The test process serves a table (shared); a spawned process opens `tries` damaged copies of its file,
    one at a time. Returns [(error type, message, first's rows exact, damaged path)], the first's shm names."""
    good = _write_table(tmp_path / "good.safetensors", seed=10 + seed)  # a table of its own per test: see SEEDS
    expected = _expected_raw(good)
    offsets = _damaged_offsets(good, tries, seed)
    assert len(offsets) == tries
    damaged = [
        str(_damaged_copy(good, tmp_path / f"damaged{i}.safetensors", off, 1 << (i % 8)))
        for i, off in enumerate(offsets)
    ]
    first = _open_shared(good)
    names = _names(first)
    assert not any(store._buffer.attached for store in first.stores.values()), "the first process fills"
    assert _rows_exact(first, expected, 0)
    ctx = _ctx()
    results, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_second_process, args=(damaged, results, acks, old_order))
    proc.start()
    outcomes = []
    try:
        for i, path in enumerate(damaged):
            kind, message = results.get(timeout=120)
            outcomes.append((kind, message, _rows_exact(first, expected, i), path))
            acks.put(None)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert all((SHM_DIR / n).exists() for n in names), "the first process's copies must stay"
    first.close()
    assert not any((SHM_DIR / n).exists() for n in names), "the last user (the first process) must remove them"
    return outcomes


def test_second_process_with_a_damaged_file_is_refused_and_the_first_rows_stay_exact(tmp_path):
    outcomes = _refusals_while_the_first_serves(tmp_path, TRIES, old_order=False, seed=0)
    exact = sum(ok for _, _, ok, _ in outcomes)
    assert exact == TRIES, f"the first process's rows were wrong after {TRIES - exact} of {TRIES} refusals"
    for kind, message, _, path in outcomes:
        assert kind == "TableFileError", (kind, message)
        assert path in message and re.search(r"block \d+", message), message
        assert "refused" in message and "untouched" in message, message


def test_negative_control_the_old_order_serves_wrong_rows(tmp_path):
    # Write into the shared copy, then check (the attaching process's old order): refused all the same,
    # but the damaged bytes stay in the copy the first process serves, without an error.
    outcomes = _refusals_while_the_first_serves(tmp_path, 3, old_order=True, seed=1)
    assert [kind for kind, *_ in outcomes] == ["TableFileError"] * 3
    assert not any(ok for _, _, ok, _ in outcomes), "the test must see the wrong rows the old order serves"


# ---------------------------------------------------------------------------- a creator killed mid-fill
def _creator_killed_mid_fill(path: str, filling) -> None:
    """Fill the shared copy half (with bytes unlike the table's), say so, and wait to be SIGKILLed."""

    def half_fill(source, raw, bar, threads, drop_cache, chunk_rows) -> None:
        raw[: raw.shape[0] // 2] = 0xA5
        filling.set()
        signal.pause()

    storage._read_source = half_fill
    _open_shared(Path(path))


def _kill_a_creator_mid_fill(path: Path) -> list[Path]:
    """A spawned process creates the shared copy of `path`, is SIGKILLed mid-fill; returns the files it left."""
    ctx = _ctx()
    filling = ctx.Event()
    proc = ctx.Process(target=_creator_killed_mid_fill, args=(str(path), filling))
    proc.start()
    try:
        assert filling.wait(60), "the creator did not start filling"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    table = EngramTableFile(path)
    from condmem.serving.memory import _shared_name

    hasher = NgramHasher(table.layout())
    left = [SHM_DIR / _shared_name(table, table.layer_ids[0], hasher, None)]
    assert left[0].exists(), "the killed creator's half copy should be left behind"
    return left


def test_creator_killed_mid_fill_is_not_trusted(tmp_path):
    good = _write_table(tmp_path / "good.safetensors", seed=2)
    expected = _expected_raw(good)
    (half,) = _kill_a_creator_mid_fill(good)
    inode = half.stat().st_ino
    memory = _open_shared(good)
    try:
        buf = memory.stores[1]._buffer
        assert not buf.attached, "the half copy must be filled again, not attached"
        assert os.stat(buf._path).st_ino == inode  # taken over: the same file, filled by this process
        assert _rows_exact(memory, expected, 0)
    finally:
        memory.close()
    assert not half.exists()


def test_negative_control_a_trusted_half_copy(tmp_path, monkeypatch):
    good = _write_table(tmp_path / "good.safetensors", seed=3)
    expected = _expected_raw(good)
    # The ready mark ignored (a whole-sized file with the record trusted): the half copy is attached. The
    # attach-time comparison refuses it ...
    real_state = host_memory._shared_state

    def record_only(fd: int, record: bytes, total: int) -> str:
        whole = os.fstat(fd).st_size == total and os.pread(fd, len(record), 0) == record
        return "ready" if whole else real_state(fd, record, total)

    monkeypatch.setattr(host_memory, "_shared_state", record_only)
    _kill_a_creator_mid_fill(good)
    with pytest.raises(storage.StorageError, match=r"shared copy .* differs from .* at row 0:"):
        _open_shared(good)
    # ... and without it too (trusting the copy as it is), the test sees the wrong rows served.
    _kill_a_creator_mid_fill(good)
    monkeypatch.setattr(storage, "_check_published", lambda *a: None)
    memory = _open_shared(good)
    try:
        assert memory.stores[1]._buffer.attached
        assert not _rows_exact(memory, expected, 0)
    finally:
        memory.close()


# ---------------------------------------------------------------------------- racing creators
def _racer(good: str, path_per_round: list[str], start, results) -> None:
    """Each round: wait for the other racer, open the shared table, report (outcome, filled here, rows exact)."""
    expected = _expected_raw(Path(good))
    for r, p in enumerate(path_per_round):
        start.wait(60)
        try:
            memory = _open_shared(Path(p))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((r, p, type(exc).__name__, str(exc), None, None))
            start.wait(60)
            continue
        filled = {lid: not store._buffer.attached for lid, store in memory.stores.items()}
        exact = _rows_exact(memory, expected, r)
        start.wait(60)  # both have opened (or been refused) before either closes
        results.put((r, p, "served", _names(memory), filled, exact))
        memory.close()


def _race(tmp_path: Path, rounds: int, damaged_second: bool) -> list[tuple]:
    good = _write_table(tmp_path / "good.safetensors", seed=4)
    offsets = _damaged_offsets(good, rounds, seed=5)
    seconds = [
        str(_damaged_copy(good, tmp_path / f"damaged{r}.safetensors", off, 0x10)) if damaged_second else str(good)
        for r, off in enumerate(offsets)
    ]
    ctx = _ctx()
    start = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(str(good), [str(good)] * rounds, start, results)),
        ctx.Process(target=_racer, args=(str(good), seconds, start, results)),
    ]
    for proc in procs:
        proc.start()
    try:
        out = [results.get(timeout=120) for _ in range(2 * rounds)]
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    return sorted(out, key=lambda o: (o[0], o[1] != str(good)))


def test_racing_creators_one_with_a_damaged_file(tmp_path):
    rounds = 4
    out = _race(tmp_path, rounds, damaged_second=True)
    names = set()
    for r in range(rounds):
        good_one, bad_one = out[2 * r], out[2 * r + 1]
        # The good process's rows are exact whoever filled each layer (the other one fills a layer whose
        # blocks are all sound before reaching its damaged one).
        assert good_one[2] == "served" and good_one[5] is True, good_one
        assert bad_one[2] == "TableFileError" and bad_one[1] in bad_one[3], bad_one
        names |= set(good_one[3])
    assert not any((SHM_DIR / n).exists() for n in names), "the last user must remove each file"


def test_racing_good_creators_fill_once(tmp_path):
    rounds = 3
    out = _race(tmp_path, rounds, damaged_second=False)
    for r in range(rounds):
        a, b = out[2 * r], out[2 * r + 1]
        assert a[2] == b[2] == "served" and a[5] and b[5], (a, b)
        assert a[3] == b[3], "both must map the same files"
        for lid in a[4]:
            assert a[4][lid] != b[4][lid], (
                f"exactly one of the two racers fills layer {lid} (round {r}: {a[4]}, {b[4]})"
            )
        assert not any((SHM_DIR / n).exists() for n in a[3])


# ---------------------------------------------------------------------------- a published copy damaged later
def _damage_published_copy(memory: EngramMemory, lid: int, row: int) -> None:
    """One bit of a published copy flipped from outside (as a stray writer of /dev/shm would)."""
    buf = memory.stores[lid]._buffer
    offset = SHARED_HEADER_BYTES + row * memory.stores[lid].row_bytes
    fd = os.open(buf._path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x04]), offset)
    finally:
        os.close(fd)


def test_a_published_copy_that_differs_from_the_readers_rows_is_refused_untouched(tmp_path):
    good = _write_table(tmp_path / "good.safetensors", seed=8)
    expected = _expected_raw(good)
    first = _open_shared(good)
    try:
        _damage_published_copy(first, 3, row=17)
        damaged = first.stores[3].raw.clone()
        assert not torch.equal(damaged, expected[3])
        with pytest.raises(
            storage.StorageError, match=r"layer 3: the shared copy /dev/shm/\S+ differs from .* at row 17:"
        ):
            _open_shared(good)  # a second user whose own file is sound
        assert torch.equal(first.stores[3].raw, damaged), "the refused process must not write the copy"
    finally:
        first.close()


def test_negative_control_a_damaged_copy_attached_unchecked_serves_wrong_rows(tmp_path, monkeypatch):
    good = _write_table(tmp_path / "good.safetensors", seed=9)
    expected = _expected_raw(good)
    first = _open_shared(good)
    try:
        _damage_published_copy(first, 3, row=17)
        monkeypatch.setattr(storage, "_check_published", lambda *a: None)
        second = _open_shared(good)
        assert second.stores[3]._buffer.attached and not _rows_exact(second, expected, 0)
        second.close()
    finally:
        first.close()


# ---------------------------------------------------------------------------- mappings
def _mapping_perms(t: torch.Tensor) -> str:
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return line.split()[1]
    raise AssertionError("mapping not found")


def test_published_copy_is_read_only_for_its_creator_and_its_readers(tmp_path):
    good = _write_table(tmp_path / "good.safetensors", seed=6)
    creator = _open_shared(good)
    reader = _open_shared(good)  # a second user in this process: its own descriptor, lock and mapping
    try:
        for lid in creator.stores:
            c, r = creator.stores[lid]._buffer, reader.stores[lid]._buffer
            assert not c.attached and r.attached
            assert c.read_only and r.read_only
            assert _mapping_perms(c.tensor) == "r--s" and _mapping_perms(r.tensor) == "r--s"
            with pytest.raises(TypeError):
                r._mmap[:1] = b"\0"
    finally:
        reader.close()
        creator.close()


@pytest.mark.gpu
def test_shared_copy_pinned_read_only_serves_exact_rows_to_the_gpu(tmp_path):
    good = _write_table(tmp_path / "good.safetensors", seed=7)
    expected = _expected_raw(good)
    table = EngramTableFile(good)
    hasher = NgramHasher(table.layout())
    memories = [
        EngramMemory.from_table_file(good, hasher, "host", "cuda", host_alloc="shared", progress=False)
        for _ in range(2)
    ]
    try:
        ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
        for memory in memories:
            prepared = memory.prepare(ids)
            for lid in expected:
                buf = memory.stores[lid]._buffer
                assert buf.pinned and buf.read_only
                want = expected[lid].view(torch.bfloat16)[prepared.row_ids(lid).cpu()]
                assert torch.equal(prepared.rows(lid).cpu(), want)
    finally:
        for memory in reversed(memories):
            memory.close()
