"""Checkpoints that cannot destroy themselves: state.json hashed, LATEST's target never deleted, a crashed
replacement recovered, LATEST falling back to the newest complete checkpoint, one writer per run folder."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from condmem.cli import main
from condmem.train.checkpoint import CorruptCheckpointError, load_checkpoint, resolve_checkpoint
from condmem.utils.run_lock import RunLock, RunLockedError
from tests.train.test_train import make_trainer


@pytest.fixture(scope="module")
def six_step_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("safety") / "run"
    make_trainer(tiny_data, steps=6, run_dir=run, checkpoint_every=3, keep_checkpoints=2).fit()
    return run


@pytest.fixture
def run(six_step_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(six_step_run, dst)
    return dst


def _edit_state(folder, edit):
    path = folder / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state) + "\n")


def test_state_json_step_edit_is_refused(run):
    folder = resolve_checkpoint(run)
    text = (folder / "state.json").read_text()
    assert '"step": 6' in text
    (folder / "state.json").write_text(text.replace('"step": 6', '"step": 2'))
    with pytest.raises(CorruptCheckpointError, match="state.json"):
        load_checkpoint(run)


def test_deleting_a_files_entry_is_refused(run):
    folder = resolve_checkpoint(run)
    _edit_state(folder, lambda s: s["files"].pop("tables.safetensors"))
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(folder)


def test_a_shorter_rerun_keeps_its_own_checkpoint(run, tiny_data):
    # A run into a folder that holds later steps of another run: its final checkpoint must survive.
    trainer = make_trainer(tiny_data, steps=2, run_dir=run, keep_checkpoints=2)
    trainer.fit()
    folder = resolve_checkpoint(run)
    assert folder.name == "step-0000002" and folder.is_dir()
    assert load_checkpoint(run).state["step"] == 2


def test_latest_falls_back_to_the_newest_complete_checkpoint(run, caplog):
    root = run / "checkpoints"
    shutil.rmtree(root / "step-0000006")  # LATEST dangles
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint(run).name == "step-0000003"
    assert "LATEST" in caplog.text
    (root / "LATEST").unlink()
    assert resolve_checkpoint(run).name == "step-0000003"
    _edit_state(root / "step-0000003", lambda s: s.update(step=1))  # not complete any more
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(run)


def test_crash_while_replacing_a_same_step_checkpoint_is_recovered(run, tiny_data):
    # The state a kill leaves between moving the old folder aside and renaming the new one in.
    root = run / "checkpoints"
    (root / "step-0000006").rename(root / ".step-0000006.replaced")
    shutil.copytree(root / ".step-0000006.replaced", root / ".step-0000006.999999999.abc")
    folder = resolve_checkpoint(run)
    assert folder.name == ".step-0000006.replaced" and load_checkpoint(run).state["step"] == 6
    make_trainer(tiny_data, steps=1, run_dir=run, keep_checkpoints=3).fit()  # the next save repairs the folder
    names = sorted(p.name for p in root.iterdir())
    assert names == ["LATEST", "step-0000001", "step-0000003", "step-0000006"], names


def test_one_writer_per_run_folder(tmp_path):
    with RunLock(tmp_path / "r"):
        with pytest.raises(RunLockedError, match="another"):
            RunLock(tmp_path / "r").acquire()
    with RunLock(tmp_path / "r"):
        pass


def test_cli_refuses_a_used_out_without_resume_or_overwrite(run, tiny_corpus, capsys):
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rc = main(
        ["train", "--out", str(run), "--preset", "tiny", "--corpus", str(tiny_corpus), "--steps", "1", "--no-progress"]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" in err and "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_cli_refuses_an_unwritable_out_before_training(tmp_path, tiny_corpus, capsys):
    (tmp_path / "file").write_text("x")
    rc = main(
        [
            "train",
            "--out",
            str(tmp_path / "file" / "run"),
            "--preset",
            "tiny",
            "--corpus",
            str(tiny_corpus),
            "--steps",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err
    assert "parameters" not in capsys.readouterr().out, "nothing was built or trained"
