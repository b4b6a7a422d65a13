"""Checkpoints under faults: SIGKILL at random points of saves (a new step and a same-step replacement)
always leaves a loadable checkpoint of the old or the new step, and the next save leaves nothing
behind; flipped or cut bytes in any checkpoint file are refused with `CorruptCheckpointError`."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from condmem.train.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from fault_harness import flip_byte, kill_during, kill_points, report, spread_offsets, timed
from tests.train.test_train import make_trainer

KILLS = 30
CMD = "scripts/test tests/train/test_checkpoint_faults.py -q"


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("faults") / "run"
    trainer = make_trainer(tiny_data, steps=3, run_dir=run)
    trainer.fit()
    return trainer, run


def _visible(root):
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("same_step", [False, True], ids=["new_step", "same_step"])
def test_sigkill_during_checkpoint_saves(trained, tmp_path, same_step):
    trainer, src = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    trainer.run_dir = run
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = list(trainer.history)

    def save():  # the new checkpoint differs from the old one in its step or its history
        trainer.step = 3 if same_step else 4
        trainer.history = history + [{"step": trainer.step, "marker": "new"}]
        trainer.save()

    duration = timed(save)
    seen = Counter()
    for delay in kill_points(KILLS, duration, seed=11 + same_step):
        kill_during(save, delay)
        ckpt = load_checkpoint(run)  # a fallback, when taken, is logged
        step = ckpt.state["step"]
        assert step in (3, 4)
        assert all(torch.equal(weights[k], v) for k, v in ckpt.model.state_dict().items())
        new = ckpt.state["history"][-1].get("marker") == "new"
        assert new == (step == 4) or same_step
        seen["new" if new else "old"] += 1
        if new and not same_step:
            shutil.rmtree(run / "checkpoints" / "step-0000004")
            (run / "checkpoints" / "LATEST").write_text("step-0000003\n")
        elif new:  # back to the old version for the next kill
            trainer.step, trainer.history = 3, history
            trainer.save()
    trainer.step, trainer.history = 3, history
    trainer.save()
    assert _visible(run / "checkpoints") == ["LATEST", "step-0000003"] or \
        _visible(run / "checkpoints") == ["LATEST", "step-0000003", "step-0000004"]
    assert resolve_checkpoint(run).name == "step-0000003"
    what = "a same-step replacement" if same_step else "a new step"
    report(f"SIGKILL during a checkpoint save ({what})", KILLS, seen, CMD + f" -k {'same_step' if same_step else 'new_step'}")


FILES = ["state.json", "config.json", "tokenizer.json", "model.safetensors", "tables.safetensors",
         "optimizer.safetensors"]


def test_byte_flips_and_truncations_in_every_file_are_refused(trained, tmp_path):
    _, src = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    folder = resolve_checkpoint(run)
    seen = Counter()
    for name in FILES:
        path = folder / name
        size = path.stat().st_size
        for off in spread_offsets(size, 25, seed=len(name), head=5):
            flip_byte(path, off)
            with pytest.raises(CheckpointError):
                load_checkpoint(run)
            seen["refused (CorruptCheckpointError)"] += 1
            flip_byte(path, off)
        data = path.read_bytes()
        for cut in spread_offsets(size, 5, seed=1 + len(name)):
            path.write_bytes(data[:cut])
            with pytest.raises(CheckpointError):
                load_checkpoint(run)
            seen["refused (CorruptCheckpointError)"] += 1
        path.write_bytes(data)
    assert load_checkpoint(run).state["step"] == 3
    report("one flipped bit or a truncation in each checkpoint file (6 files x 30)", sum(seen.values()), seen,
           CMD + " -k flips")
