"""The decode row server (native/row_server.c) on the CPU: this test plays the GPU's part of the
handshake (ids in, request raised, done flags waited for and lowered) and compares every staged
row with a plain gather (torch.equal)."""

from __future__ import annotations

import time

import pytest
import torch

from condmem import native
from condmem.native.row_server import RowServer, RowServerError

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native library")


def _tables(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (1000, 264), dtype=torch.uint8, generator=gen),  # fp8 rows + scales
        torch.randint(0, 256, (333, 32), dtype=torch.uint8, generator=gen),  # bf16 rows, head_dim 16
        torch.randint(0, 256, (77, 520), dtype=torch.uint8, generator=gen),
    ]


def _serve(server: RowServer, ids: list[torch.Tensor], timeout_s: float = 10.0) -> list[torch.Tensor]:
    """One step as the GPU runs it: ids in, request = 1, wait for every done flag, take the rows, lower the flags."""
    for layer, layer_ids in enumerate(ids):
        server.ids[layer].copy_(layer_ids)
    server.request[0] = 1
    t0 = time.monotonic()
    while not bool((server.done == 1).all()):
        assert time.monotonic() - t0 < timeout_s, f"no rows after {timeout_s} s: done {server.done.tolist()}"
        time.sleep(0)
    assert server.request[0] == 0, "the server takes the request (lowers it) before it raises done"
    rows = [s.clone() for s in server.staging]
    server.done.zero_()
    return rows


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n_ids", [1, 64, 200])
def test_staged_rows_equal_a_plain_gather_step_after_step(threads, n_ids):
    tables = _tables()
    gen = torch.Generator().manual_seed(1)
    with RowServer(tables, n_ids, threads=threads) as server:
        for step in range(20):
            ids = [torch.randint(0, t.shape[0], (n_ids,), generator=gen) for t in tables]
            if step % 5 == 4:
                ids = [torch.full((n_ids,), t.shape[0] - 1) for t in tables]  # one row, repeated
            rows = _serve(server, ids)
            for layer, (t, i, r) in enumerate(zip(tables, ids, rows)):
                assert torch.equal(r, t[i]), f"step {step}, layer {layer}"
        stats = server.stats()
    assert stats["steps"] == 20 and stats["bad_ids"] == 0 and stats["threads"] == threads
    assert stats["mean_us"] > 0 and stats["max_us"] >= stats["mean_us"]


def test_ids_outside_a_table_are_served_as_zeros_counted_and_raised():
    tables = _tables()
    with RowServer(tables, 8, threads=2) as server:
        ids = [torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]) for _ in tables]
        ids[1] = torch.tensor([0, -1, 333, 5, 2**40, 1, 2, 3])
        rows = _serve(server, ids)
        assert torch.equal(rows[0], tables[0][ids[0]])
        bad = torch.tensor([False, True, True, False, True, False, False, False])
        assert torch.equal(rows[1][~bad], tables[1][ids[1][~bad]])
        assert int(rows[1][bad].abs().sum()) == 0
        with pytest.raises(RowServerError, match="3 row id"):
            server.check()
        server.check()  # each bad id is raised once
        good = [torch.zeros(8, dtype=torch.long) for _ in tables]
        rows = _serve(server, good)  # and the server goes on
        assert all(torch.equal(r, t[g]) for r, t, g in zip(rows, tables, good))


def test_stop_is_idempotent_and_a_stopped_server_serves_nothing():
    tables = _tables()
    server = RowServer(tables, 4, threads=2).start()
    assert server.running
    _serve(server, [torch.zeros(4, dtype=torch.long)] * len(tables))
    server.stop()
    server.stop()
    assert not server.running
    server.request[0] = 1
    time.sleep(0.05)
    assert int(server.done.sum()) == 0 and server.request[0] == 1
    server.start()  # started again, it takes the pending request
    t0 = time.monotonic()
    while not bool((server.done == 1).all()):
        assert time.monotonic() - t0 < 10
    server.close()


def test_bad_arguments_are_refused_by_name():
    tables = _tables()
    with pytest.raises(ValueError, match="1 to 16 tables"):
        RowServer([], 4)
    with pytest.raises(ValueError, match="threads"):
        RowServer(tables, 4, threads=0)
    with pytest.raises(ValueError, match="n_ids"):
        RowServer(tables, 0)
    with pytest.raises(ValueError, match="table 1 must be a contiguous uint8"):
        RowServer([tables[0], tables[1].t()], 4)
    with pytest.raises(ValueError, match="table 0 must be"):
        RowServer([torch.zeros(4, 8, dtype=torch.float32)], 4)


def test_a_napping_server_still_serves_every_request_exactly():
    """spin_ms=0: the team naps from the start (20 us naps, then 1 ms naps after a second idle)."""
    tables = _tables()
    gen = torch.Generator().manual_seed(2)
    with RowServer(tables, 100, threads=2, spin_ms=0.0) as server:
        for step in range(6):
            if step == 3:
                time.sleep(1.1)  # past a second idle: the long naps
            ids = [torch.randint(0, t.shape[0], (100,), generator=gen) for t in tables]
            rows = _serve(server, ids)
            assert all(torch.equal(r, t[i]) for r, t, i in zip(rows, tables, ids)), f"step {step}"
