"""`condmem train` under torchrun (spawned gloo ranks, CPU): each rank trains its slice of every
batch with the Engram table sharded over the ranks. The losses equal one process training the
whole batch up to fp32 rounding (the ranks sum gradients in another order; 1e-4 relative). A
run killed after its step-3 checkpoint on 2 ranks and resumed on 1 rank (its shards read
under the new plan) equals the uninterrupted one-process run the same way."""

from __future__ import annotations

import json
import os
import socket

import pytest

from condmem.cli import main
from condmem.train.loop import Trainer
from ranks import spawn_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, init_file, argv, crash_at, want_rc):
    import torch

    torch.set_num_threads(1)
    port = int(open(f"{init_file}.port").read()) if os.path.exists(f"{init_file}.port") else None
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if crash_at is not None:
        real = Trainer.train_step

        def crash(self, step):
            if step == crash_at:
                raise KeyboardInterrupt("simulated kill")
            return real(self, step)

        Trainer.train_step = crash
    assert main(argv) == want_rc


def _spawn(world, tmp_path, name, argv, crash_at=None, want_rc=0):
    init = tmp_path / name
    for attempt in range(3):  # spawn_ranks suffixes the attempt; each attempt gets its own port
        (tmp_path / f"{name}.{attempt}.port").write_text(str(_free_port()))
    spawn_ranks(_rank_main, world, init, argv, crash_at, want_rc)


def _losses(run) -> list[float]:
    return [h["loss"] for h in json.loads((run / "summary.json").read_text())["history"]]


def test_torchrun_ranks_train_like_one_process_and_resume_on_fewer_ranks(tiny_corpus, tmp_path):
    common = [
        "--preset",
        "tiny",
        "--corpus",
        str(tiny_corpus),
        "--set",
        "data.vocab_size=320",
        "--steps",
        "6",
        "--set",
        "train.checkpoint_every=3",
        "--no-progress",
        "--device",
        "cpu",
        "--set",
        "train.precision=fp32",
    ]
    assert main(["train", "--out", str(tmp_path / "one")] + common) == 0
    one = _losses(tmp_path / "one")

    # --overwrite: an attempt retried after a gloo abort at teardown starts afresh (tests/ranks.py)
    _spawn(2, tmp_path, "two", ["train", "--out", str(tmp_path / "two"), "--overwrite"] + common)
    assert _losses(tmp_path / "two") == pytest.approx(one, rel=1e-4)
    shards = tmp_path / "two" / "sharded_tables" / "layer1" / "step-0000006"
    assert sorted(p.name for p in shards.iterdir()) == [
        "manifest.json",
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]

    run = tmp_path / "killed"
    _spawn(2, tmp_path, "killed", ["train", "--out", str(run), "--overwrite"] + common, crash_at=4, want_rc=130)
    assert not (run / "summary.json").exists()
    _spawn(1, tmp_path, "resumed", ["train", "--out", str(run), "--resume", "--no-progress", "--device", "cpu"])
    assert _losses(run) == pytest.approx(one, rel=1e-4)
    summary = json.loads((run / "summary.json").read_text())["summary"]
    assert summary["table_tier"] == "sharded over 1 ranks"
