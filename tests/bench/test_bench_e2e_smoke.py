"""`condmem bench e2e --smoke`: the serving benchmark's code path on a tiny model on CPU (times mean nothing)."""

from __future__ import annotations

import json

import pytest
import torch

from condmem.bench.e2e import backbone_twin, batch_summary, build_models
from condmem.cli import main


def test_bench_e2e_smoke(tmp_path):
    rc = main(["bench", "e2e", "--smoke", "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["none", "host_sync", "host_prefetch", "none_again"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    prefetch = rows[2]
    assert prefetch["same_tokens_as"] == "host_sync" and prefetch["tokens_equal"] is True
    again = rows[-1]  # the drift control: the backbone alone once more, its ratio to the first run
    assert again["table_gib"] == 0.0 and again["x_none"] == again["tokens_per_s"] / rows[0]["tokens_per_s"]
    assert "tokens_equal" not in again
    assert (tmp_path / "e2e.png").exists()


def test_backbone_twin_shares_weights_and_matches_a_model_without_engram():
    model, twin, _ = build_models("tiny", 0.001, 32, "cpu")
    assert twin.cfg.engram is None and twin.blocks[0].mlp is model.blocks[0].mlp
    assert twin.embed.weight.data_ptr() == model.embed.weight.data_ptr()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 9))
    again = backbone_twin(model)
    assert torch.equal(twin(ids), again(ids))


def test_bench_e2e_smoke_with_two_engram_layers(tmp_path):
    """The V4.1-like placement: an early and a late Engram layer, each with its own host table."""
    rc = main(
        [
            "bench",
            "e2e",
            "--smoke",
            "--engram-layers",
            "1",
            "3",
            "--e2e-variants",
            "host_sync",
            "host_prefetch",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert all(r["engram_layers"] == [1, 3] for r in rows)
    assert rows[-1]["tokens_equal"] is True


def test_the_decode_byte_count():
    from condmem.bench.e2e import decode_bytes, step_weight_bytes

    model, twin, _ = build_models("tiny", 0.001, 32, "cpu")
    weights = step_weight_bytes(twin)
    assert weights == sum(p.numel() * p.element_size() for p in twin.parameters()) - twin.embed.weight.numel() * 4
    # Two sequences of prompts 3 and 5, 4 tokens each (3 steps): keys read 4+5+6 and 6+7+8.
    assert decode_bytes(twin, 10, [3, 5], batch=2, gen=4) == 3 * weights + 10 * (15 + 21)
    assert decode_bytes(twin, 10, [3, 5], batch=1, gen=4) == 6 * weights + 10 * (15 + 21)


def test_bench_e2e_smoke_from_a_disk_table(tmp_path):
    """The disk-tier variant (the table copied to a file, read with O_DIRECT behind a DRAM row
    cache) against the host table with the same kernel-by-kernel decode: the same tokens."""
    rc = main(
        [
            "bench",
            "e2e",
            "--smoke",
            "--e2e-variants",
            "host_eager",
            "disk_prefetch",
            "--disk-dir",
            str(tmp_path),
            "--dram-cache-gib",
            "0.0001",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["host_eager", "disk_prefetch"]
    disk = rows[-1]
    assert disk["table_tier"] == "disk" and disk["tokens_equal"] is True and disk["x_host_eager"] > 0
    assert not list(tmp_path.glob("condmem-bench-*"))  # the table file is gone


def test_bench_e2e_smoke_measures_how_much_fetch_was_hidden(tmp_path):
    """--measure-fetch: each Engram variant's row says what share of the prompt batches' fetch ran
    behind compute (on the CPU the lookups run inside `prepare`: none) and the layers' stall."""
    rc = main(
        [
            "bench",
            "e2e",
            "--smoke",
            "--e2e-variants",
            "none",
            "host_prefetch",
            "--measure-fetch",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["none", "host_prefetch", "none_again"]
    assert "prefill_fetch_hidden" not in rows[0] and "prefill_fetch_hidden" not in rows[2]
    assert rows[1]["prefill_fetch_hidden"] == 0.0 and rows[1]["prefill_fetches"] > 0


def _tp_worker(rank: int, world: int, init_file: str, out: str, port: int) -> None:
    import os

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    assert main(["bench", "e2e", "--smoke", "--out", out]) == 0


def test_bench_e2e_smoke_tensor_parallel_on_two_gloo_ranks(tmp_path):
    """Under torchrun-like ranks: the backbone and the tables sharded, rank 0 reports, the Engram
    variants generate the same tokens."""
    import socket

    from ranks import spawn_ranks

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spawn_ranks(_tp_worker, 2, str(tmp_path / "init"), str(tmp_path), port)
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["none", "host_sync", "host_prefetch", "none_again"]
    assert all(r["tp_world"] == 2 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[2]["tokens_equal"] is True


def test_batch_summary_splits_prefill_time_into_batches_gaps_and_host_queueing():
    class Event:  # elapsed_time as a CUDA event gives it, from GPU timestamps
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    # Two waves: batches [0, 10] and [12, 20] ms, then one batch [30, 35] ms.
    waves = [[(0.004, Event(0), Event(10)), (0.003, Event(12), Event(20))], [(0.001, Event(30), Event(35))], []]
    got = batch_summary(waves)
    assert got == pytest.approx(
        {"prefill_batches_gpu_ms": 23, "prefill_between_batches_ms": 2, "prefill_queue_host_ms": 8.0}
    )
    assert batch_summary([]) == {}
