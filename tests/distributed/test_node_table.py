"""One host copy per node (gloo ranks spawned by the test): written once by local rank 0,
mapped read-only by the others; bad setups are clear errors; dead ranks change nothing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from condmem.distributed import NodeTableError, map_shared_table, node_shared_table, remove_node_table
from ranks import spawn_ranks

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
NBYTES = 3 << 20


def _pattern(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


def _worker(rank, world, init_file, name, fingerprints, nbytes, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = Path(out_dir)
    try:
        try:
            buf = node_shared_table(
                name, nbytes, lambda t: t.copy_(_pattern(nbytes)), fingerprint=fingerprints[rank], local_rank=rank
            )
        except NodeTableError as exc:
            (out / f"error{rank}").write_text(str(exc))
            return
        assert torch.equal(buf.tensor, _pattern(nbytes))
        writable = True
        try:
            buf._mmap[0:1] = buf._mmap[0:1]  # a write that changes nothing
        except TypeError:  # "mmap can't modify a readonly memory map"
            writable = False
        (out / f"ok{rank}").write_text(f"{writable}")
        dist.barrier()
        buf.close()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, world, fingerprints, nbytes=NBYTES):
    name = f"condmem-test-{uuid.uuid4().hex[:12]}"
    try:
        spawn_ranks(_worker, world, tmp_path / "init", name, fingerprints, nbytes, str(tmp_path))
        return name, {p.name: p.read_text() for p in tmp_path.iterdir() if p.name[:2] in ("ok", "er")}
    finally:
        remove_node_table(name)


def test_written_once_and_mapped_read_only_by_every_other_rank(tmp_path):
    name = f"condmem-test-{uuid.uuid4().hex[:12]}"
    results: dict = {}
    try:
        spawn_ranks(_worker, 3, tmp_path / "init", name, ["fp"] * 3, NBYTES, str(tmp_path))
        results = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.startswith("ok")}
        shm = Path("/dev/shm") / name
        assert shm.stat().st_blocks * 512 < 2 * NBYTES, "one copy on the node, not one per rank"
        assert torch.equal(torch.frombuffer(bytearray(shm.read_bytes()), dtype=torch.uint8), _pattern(NBYTES))
    finally:
        remove_node_table(name)
    assert results == {"ok0": "True", "ok1": "False", "ok2": "False"}, "only the writer may write"


def test_ranks_that_disagree_on_the_table_are_refused(tmp_path):
    _, results = _run(tmp_path, 2, ["layout-a", "layout-b"])
    assert set(results) == {"error0", "error1"}
    assert all("disagree" in v and "rank 1: layout-b" in v for v in results.values())


def test_a_table_larger_than_dev_shm_is_a_clear_error(tmp_path):
    _, results = _run(tmp_path, 2, ["fp", "fp"], nbytes=1 << 55)
    assert set(results) == {"error0", "error1"}
    assert all("/dev/shm" in v and "--shm-size" in v for v in results.values()), results


def test_incomplete_table_is_refused_and_a_killed_reader_changes_nothing(tmp_path):
    name = f"condmem-test-{uuid.uuid4().hex[:12]}"
    shm = Path("/dev/shm") / name
    try:
        shm.write_bytes(bytes(NBYTES))  # a writer killed before finishing: no .ready
        with pytest.raises(NodeTableError, match="not complete"):
            map_shared_table(name, NBYTES, "fp")
        remove_node_table(name)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
        try:
            node_shared_table(name, NBYTES, lambda t: t.copy_(_pattern(NBYTES)), fingerprint="fp", local_rank=0).close()
        finally:
            dist.destroy_process_group()
        ctx = multiprocessing.get_context("spawn")
        reader = ctx.Process(target=_read_forever, args=(name,))
        reader.start()
        time.sleep(2.0)
        os.kill(reader.pid, signal.SIGKILL)
        reader.join()
        again = map_shared_table(name, NBYTES, "fp")  # a restarted rank maps it again
        assert torch.equal(again.tensor, _pattern(NBYTES))
        again.close()
        with pytest.raises(NodeTableError, match="another table"):
            map_shared_table(name, NBYTES, "other-fp")
    finally:
        remove_node_table(name)


def _read_forever(name):
    buf = map_shared_table(name, NBYTES, "fp")
    while True:
        int(buf.tensor.sum())
