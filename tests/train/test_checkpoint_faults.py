"""Checkpoints under faults: SIGKILL at random points of saves (a new step and a same-step replacement)
always leaves a loadable checkpoint of the old or the new step, and the next save leaves nothing
behind; flipped or cut bytes in any checkpoint file are refused with `CorruptCheckpointError`; a file
system too small for the next checkpoint is a one-line error before training (or before the save),
and a save that runs out of space keeps the previous checkpoint and says which steps are lost."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_harness import (
    flip_byte,
    kill_during,
    kill_points,
    report,
    spread_offsets,
    timed,
)

from condmem.cli import main
from condmem.train import checkpoint as checkpoint_module
from condmem.train.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    load_checkpoint,
    resolve_checkpoint,
)
from condmem.utils.preflight import OutputPathError
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
    assert _visible(run / "checkpoints") == ["LATEST", "step-0000003"] or _visible(run / "checkpoints") == [
        "LATEST",
        "step-0000003",
        "step-0000004",
    ]
    assert resolve_checkpoint(run).name == "step-0000003"
    what = "a same-step replacement" if same_step else "a new step"
    report(
        f"SIGKILL during a checkpoint save ({what})",
        KILLS,
        seen,
        CMD + f" -k {'same_step' if same_step else 'new_step'}",
    )


FILES = [
    "state.json",
    "config.json",
    "tokenizer.json",
    "model.safetensors",
    "tables.safetensors",
    "optimizer.safetensors",
]


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
    report(
        "one flipped bit or a truncation in each checkpoint file (6 files x 30)",
        sum(seen.values()),
        seen,
        CMD + " -k flips",
    )


# ---------------------------------------------------------------------------- free space
@pytest.fixture
def small_fs(tmp_path):
    """mount(nbytes) -> a tmpfs of that size (skips where mounting is not allowed; the simulated tests stand in)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mounted = []

    def mount(nbytes: int) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(mnt)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        mounted.append(mnt)
        return mnt

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


def _no_temps(root: Path) -> bool:
    return not [p for p in root.iterdir() if p.name.startswith(".")]


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_small_filesystem_refuses_to_train_up_front(small_fs, tiny_corpus, capsys):
    fs = small_fs(256 << 10)  # less than one tiny checkpoint
    rc = main(
        [
            "train",
            "--out",
            str(fs / "run"),
            "--preset",
            "tiny",
            "--corpus",
            str(tiny_corpus),
            "--steps",
            "3",
            "--no-progress",
        ]
    )
    assert rc == 1
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert str(fs / "run" / "checkpoints") in line and re.search(r"needs [\d,]+ bytes", line), line
    assert "step 1/" not in out, "training must not start"


def test_small_filesystem_keeps_the_last_checkpoint(small_fs, tiny_data):
    probe = make_trainer(tiny_data, steps=4)
    fs = small_fs(probe.checkpoint_bytes() * 3 // 2)  # room for one checkpoint, not for two side by side
    trainer = make_trainer(tiny_data, steps=4, checkpoint_every=2, run_dir=fs / "run")
    with pytest.raises(CheckpointSaveError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "step 4" in msg and "step-0000002" in msg and "steps 3..4 are lost" in msg, msg
    assert load_checkpoint(fs / "run").state["step"] == 2
    assert _no_temps(fs / "run" / "checkpoints")


def test_save_that_runs_out_of_space_keeps_the_previous_checkpoint(small_fs, tiny_data, monkeypatch):
    probe = make_trainer(tiny_data, steps=4)
    fs = small_fs(probe.checkpoint_bytes() * 3 // 2)
    trainer = make_trainer(tiny_data, steps=4, checkpoint_every=2, run_dir=fs / "run")
    monkeypatch.setattr(checkpoint_module, "ensure_room", lambda *a, **k: None)  # no up-front check: a real ENOSPC
    with pytest.raises(CheckpointSaveError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "No space left on device" in msg and str(fs / "run" / "checkpoints") in msg, msg
    assert "steps 3..4 are lost" in msg, msg
    assert load_checkpoint(fs / "run").state["step"] == 2
    assert _no_temps(fs / "run" / "checkpoints")


def test_simulated_full_disk_is_refused_before_training(tiny_data, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    trainer = make_trainer(tiny_data, steps=3, run_dir=tmp_path / "run")
    with pytest.raises(OutputPathError, match=r"checkpoints needs [\d,]+ bytes .*, 100,000 bytes \(97.7 KiB\) free"):
        trainer.fit()
    assert trainer.step == 0 and not trainer.history


def test_simulated_enospc_in_a_save_keeps_the_previous_checkpoint(tiny_data, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_data, steps=6, checkpoint_every=3, run_dir=tmp_path / "run")
    real = checkpoint_module.save_file
    calls = []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if trainer.step == 6 and len(calls) > 3:  # the second save's second file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint_module, "save_file", save_file)
    with pytest.raises(
        CheckpointSaveError,
        match=r"step 6 .*No space left on device.*step-0000003 \(step 3\), "
        r"is kept: steps 4\.\.6 are lost",
    ):
        trainer.fit()
    root = tmp_path / "run" / "checkpoints"
    assert (root / "LATEST").read_text().strip() == "step-0000003"
    assert load_checkpoint(tmp_path / "run").state["step"] == 3
    assert _no_temps(root)


def test_checkpoint_bytes_bounds_the_checkpoint_written(tiny_data, tmp_path):
    trainer = make_trainer(tiny_data, steps=3, run_dir=tmp_path / "run")
    before = trainer.checkpoint_bytes(3 * trainer.cfg.batch_size * trainer.cfg.seq_len)
    trainer.fit()
    written = sum(f.stat().st_size for f in resolve_checkpoint(tmp_path / "run").iterdir())
    assert written <= trainer.checkpoint_bytes() and written <= before


def test_a_digit_flip_that_parses_to_the_same_float_is_refused(trained, tmp_path):
    """The hash of state.json covers its parsed values, and 0.30000000000000004 and ...05 (one flipped
    bit) parse to the same float: the bytes themselves must be as written."""
    import json

    from condmem.train.checkpoint import _state_digest

    _, src = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    path = resolve_checkpoint(run) / "state.json"
    state = json.loads(path.read_text())
    state["history"][0]["loss"] = 0.1 + 0.2
    state["state_sha256"] = _state_digest(state)
    path.write_text(json.dumps(state) + "\n")
    assert load_checkpoint(run).state["step"] == 3  # the edit with its hash recomputed loads
    text = path.read_text()
    assert text.count("0.30000000000000004") == 1 and 0.30000000000000004 == 0.30000000000000005
    path.write_text(text.replace("0.30000000000000004", "0.30000000000000005"))
    assert json.loads(path.read_text()) == state  # negative control: the values (and so the hash) match
    with pytest.raises(CheckpointError, match="byte for byte"):
        load_checkpoint(run)


# ---------------------------------------------------------------------------- values that were misread
@pytest.mark.parametrize("step", ["3", 2.5, True, -1, None], ids=["str", "float", "bool", "negative", "null"])
def test_state_json_with_a_step_that_is_not_an_integer_is_refused(trained, tmp_path, step):
    import json

    from condmem.train.checkpoint import _state_digest

    _, src = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    path = resolve_checkpoint(run) / "state.json"
    state = json.loads(path.read_text())
    state["step"] = step
    state["state_sha256"] = _state_digest(state)  # an edit that also recomputed the hash
    path.write_text(json.dumps(state) + "\n")
    with pytest.raises(CheckpointError, match="step must be a non-negative integer"):
        load_checkpoint(run)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_grad_clip_that_is_not_a_finite_non_negative_number_is_refused(value):
    from condmem.config import ConfigError
    from condmem.train.loop import TrainConfig

    with pytest.raises(ConfigError, match="grad_clip"):
        TrainConfig(grad_clip=value)


def test_generate_with_a_malformed_tokenizer_names_the_file(trained, tmp_path, capsys):
    _, run = trained
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0"}')  # valid JSON, no model: tokenizers says only "Model missing"
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def", "--tokenizer", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err, err
