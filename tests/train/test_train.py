"""End-to-end training on a tiny real corpus: loss goes down, runs are deterministic, resume is exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from condmem.cli import main
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.train.checkpoint import load_checkpoint
from condmem.train.loop import Trainer
from condmem.train.presets import get_preset


def make_trainer(data, *, engram=True, steps=8, run_dir=None, seed=0, model=None, **train):
    preset = get_preset("tiny")
    if model is None:
        model = build_model(build_model_config(preset, data, engram=engram), data, seed=seed, device="cpu")
    tc = dataclasses.replace(preset.train, steps=steps, seed=seed, **train)
    return build_trainer(model, tc, data, "cpu", run_dir=run_dir, label="engram" if engram else "baseline",
                         progress=False)


def losses(trainer):
    return [h["loss"] for h in trainer.history]


@pytest.mark.parametrize("engram", [True, False], ids=["engram", "baseline"])
def test_tiny_training_decreases_loss(tiny_data, engram):
    trainer = make_trainer(tiny_data, engram=engram, steps=30, lr=1e-2, warmup_steps=3)
    before = trainer.evaluate()["val_loss"]
    summary = trainer.fit()
    run = losses(trainer)
    assert sum(run[-5:]) / 5 < sum(run[:5]) / 5 - 0.5, run
    assert summary["val_loss"] < before - 0.5
    assert 0 < summary["bits_per_byte"] < 20 and summary["train_tokens"] == 30 * 4 * 32
    if engram:
        assert 0 < summary["sparse_state_rows"] < sum(trainer.model.layout.num_embeddings)


def test_training_is_deterministic(tiny_data):
    a, b = make_trainer(tiny_data, steps=5), make_trainer(tiny_data, steps=5)
    a.fit()
    b.fit()
    assert losses(a) == losses(b)
    c = make_trainer(tiny_data, steps=5, seed=1)
    c.fit()
    assert losses(c) != losses(a)


def test_resume_equals_uninterrupted_run(tiny_data, tmp_path, monkeypatch):
    straight = make_trainer(tiny_data, steps=8)
    straight.fit()

    interrupted = make_trainer(tiny_data, steps=8, run_dir=tmp_path / "run", checkpoint_every=4)
    real_step = Trainer.train_step

    def crash_at_5(self, step):
        if step == 5:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)

    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.state["step"] == 4
    resumed = make_trainer(tiny_data, steps=8, run_dir=tmp_path / "run", checkpoint_every=4, model=ckpt.model)
    resumed.restore(ckpt)
    summary = resumed.fit()
    assert losses(resumed) == losses(straight), "the loss after resuming must equal the uninterrupted run's"
    assert summary["val_loss"] == straight.summary()["val_loss"]
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_cli_train_resume_and_generate(tiny_corpus, tmp_path, monkeypatch, capsys):
    args = ["train", "--preset", "tiny", "--corpus", str(tiny_corpus), "--vocab-size", "320", "--steps", "6",
            "--checkpoint-every", "3", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "straight")]) == 0
    real_step = Trainer.train_step

    def crash_at_4(self, step):
        if step == 4:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", crash_at_4)
    assert main(args + ["--out", str(tmp_path / "crashed")]) == 130  # interrupted: no traceback
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert main(["train", "--out", str(tmp_path / "crashed"), "--resume", "--no-progress"]) == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "crashed" / "summary.json").read_text())
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "crashed"), "--prompt", "def f(x):",
                 "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")


def test_time_budget_resolves_the_step_count(tiny_data):
    trainer = make_trainer(tiny_data, steps=10**6, max_minutes=0.03, warmup_steps=20)
    summary = trainer.fit()
    assert trainer.budget_resolved and 12 <= trainer.cfg.steps < 10**6
    assert summary["steps"] == trainer.cfg.steps
    assert trainer.state()["train_config"]["steps"] == trainer.cfg.steps, "the resolved count is what a checkpoint keeps"
