"""Checkpoints: round trip, atomic layout, corrupted files and mismatched tokenizers are refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from condmem.cli import main
from condmem.train.bpe import train_bpe
from condmem.train.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    _state_digest,
    load_checkpoint,
    resolve_checkpoint,
)
from tests.train.test_train import make_trainer


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt") / "run"
    trainer = make_trainer(tiny_data, steps=3, run_dir=run)
    trainer.fit()
    return trainer, run


@pytest.fixture
def ckpt_copy(trained, tmp_path):
    import shutil

    _, run = trained
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return resolve_checkpoint(dst)


def test_roundtrip_and_contents(trained):
    trainer, run = trained
    folder = resolve_checkpoint(run)
    assert folder.name == "step-0000003" and (run / "checkpoints" / "LATEST").read_text().strip() == folder.name
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")], "no temporary leftovers"
    ckpt = load_checkpoint(run)
    for (name, p), q in zip(trainer.model.state_dict().items(), ckpt.model.state_dict().values()):
        assert torch.equal(p, q), name
    assert ckpt.state["fingerprints"]["layout"] == trainer.model.layout.fingerprint
    assert ckpt.config["engram_v4"]["engram_compressed_vocab_size"] == ckpt.ctok.vocab_size
    with safe_open(str(folder / "tables.safetensors"), framework="pt") as fh:
        assert list(fh.keys()) == ["layer1.table"]
        assert fh.metadata()["tokenizer_map"] == ckpt.ctok.fingerprint
    ids = torch.randint(0, 320, (1, 10))
    assert torch.equal(trainer.model.eval()(ids), ckpt.model.eval()(ids))


def test_checkpoint_keeps_only_the_newest(tiny_data, tmp_path):
    trainer = make_trainer(tiny_data, steps=6, run_dir=tmp_path / "r", checkpoint_every=1, keep_checkpoints=2)
    trainer.fit()
    kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-0000005", "step-0000006"]


@pytest.mark.parametrize("damage", ["flip-byte", "truncate", "missing", "state-json"])
def test_corrupted_checkpoint_is_refused(ckpt_copy, damage):
    target = ckpt_copy / "model.safetensors"
    if damage == "flip-byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        match = "sha256"
    elif damage == "truncate":
        target = ckpt_copy / "tables.safetensors"
        target.write_bytes(target.read_bytes()[:-100])
        match = "truncated"
    elif damage == "missing":
        (ckpt_copy / "optimizer.safetensors").unlink()
        match = "missing"
    else:
        (ckpt_copy / "state.json").write_text('{"format": "condmem-checkpoint", "files"')
        match = "unreadable"
    with pytest.raises(CorruptCheckpointError, match=match):
        load_checkpoint(ckpt_copy)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    rc = main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"])
    assert rc == 1


def test_other_tokenizer_is_refused(ckpt_copy, tiny_data):
    other = train_bpe([d.text for d in tiny_data.val_docs], vocab_size=300)
    with pytest.raises(CheckpointMismatchError, match="tokenizer"):
        load_checkpoint(ckpt_copy, tokenizer=other)
    # A checkpoint assembled with the wrong tokenizer.json (hashes made consistent) is refused too.
    (ckpt_copy / "tokenizer.json").write_text(other.to_str())
    state = json.loads((ckpt_copy / "state.json").read_text())
    data = (ckpt_copy / "tokenizer.json").read_bytes()
    state["files"]["tokenizer.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    state["state_sha256"] = _state_digest(state)
    (ckpt_copy / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointMismatchError, match="row id would differ"):
        load_checkpoint(ckpt_copy)


def test_cli_reports_mismatch_without_traceback(ckpt_copy, tiny_data, tmp_path, capsys):
    other = train_bpe([d.text for d in tiny_data.val_docs], vocab_size=300)
    other.save(str(tmp_path / "other.json"))
    rc = main(
        ["generate", "--checkpoint", str(ckpt_copy), "--prompt", "x", "--tokenizer", str(tmp_path / "other.json")]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "error:" in err and "tokenizer" in err and "Traceback" not in err
