"""End-to-end training on a tiny real corpus: loss goes down, runs are deterministic, resume is exact."""

from __future__ import annotations

import dataclasses
import json
import shutil

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
    return build_trainer(
        model, tc, data, "cpu", run_dir=run_dir, label="engram" if engram else "baseline", progress=False
    )


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
    args = [
        "train",
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
    ]
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
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path / "crashed"),
                "--prompt",
                "def f(x):",
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("def f(x):")


def test_time_budget_resolves_the_step_count(tiny_data):
    trainer = make_trainer(tiny_data, steps=10**6, max_minutes=0.03, warmup_steps=20)
    summary = trainer.fit()
    assert trainer.budget_resolved and 12 <= trainer.cfg.steps < 10**6
    assert summary["steps"] == trainer.cfg.steps
    assert trainer.state()["train_config"]["steps"] == trainer.cfg.steps, "a checkpoint keeps the resolved count"


def test_resume_with_more_steps_continues_without_preparing_the_data_again(tiny_corpus, tmp_path, monkeypatch, capsys):
    from condmem.train import pipeline

    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "r"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--corpus",
                str(tiny_corpus),
                "--set",
                "data.vocab_size=320",
                "--steps",
                "30",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    first = json.loads((out / "summary.json").read_text())
    step30 = out / "checkpoints" / "step-0000030"
    files = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in step30.iterdir()}

    def read_again(*args, **kwargs):
        raise AssertionError("the resumed run read and prepared the corpus again")

    monkeypatch.setattr(pipeline, "iter_corpus", read_again)
    resume = ["train", "--out", str(out), "--resume", "--no-progress"]
    capsys.readouterr()
    assert main(resume + ["--steps", "40"]) == 0
    assert "continuing to step 40" in capsys.readouterr().out
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["summary"]["steps"] == 40 and [h["step"] for h in resumed["history"]] == list(range(1, 41))
    assert resumed["history"][:30] == first["history"]
    assert resumed["data"]["prepared_cache"]["hit"] and resumed["train"]["steps"] == 40
    assert (out / "checkpoints" / "step-0000040").is_dir()
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in step30.iterdir()} == files, "step 30 rewritten"

    # At its end a run has nothing to train and rewrites nothing; it does not go back, and keeps its settings.
    step40 = {f.name: f.stat().st_mtime_ns for f in (out / "checkpoints" / "step-0000040").iterdir()}
    assert main(resume) == 0 and "nothing to train" in capsys.readouterr().out
    assert main(resume + ["--steps", "40"]) == 0
    assert {f.name: f.stat().st_mtime_ns for f in (out / "checkpoints" / "step-0000040").iterdir()} == step40
    assert main(resume + ["--steps", "20"]) == 1
    assert "does not go back" in capsys.readouterr().err
    assert main(resume + ["--steps", "50", "--set", "train.lr=0.1", "--set", "train.batch_size=8"]) == 1
    err = capsys.readouterr().err
    assert "train.batch_size, train.lr: a resumed run keeps the settings of its checkpoint" in err


def test_prepared_data_cache_gives_the_same_data(tiny_corpus, tmp_path):
    from condmem.train.pipeline import prepare_data

    corpus = shutil.copytree(tiny_corpus, tmp_path / "corpus")
    kwargs = {"vocab_size": 320, "val_fraction": 0.2, "seed": 0, "cache_dir": tmp_path / "cache"}
    fresh = prepare_data(str(corpus), **kwargs)
    again = prepare_data(str(corpus), **kwargs)
    by_tokenizer = prepare_data(str(corpus), **dict(kwargs, tokenizer=fresh.tokenizer, vocab_size=999))
    uncached = prepare_data(str(corpus), **dict(kwargs, use_cache=False))
    assert not fresh.info["prepared_cache"]["hit"] and again.info["prepared_cache"]["hit"]
    assert by_tokenizer.info["prepared_cache"]["hit"] and by_tokenizer.info["tokenizer"]["source"] == "given"
    for data in (again, by_tokenizer, uncached):
        assert (data.train.tokens == fresh.train.tokens).all() and data.train.tokens.dtype == fresh.train.tokens.dtype
        assert (data.val.tokens == fresh.val.tokens).all() and (data.token_bytes == fresh.token_bytes).all()
        assert data.tokenizer.to_str() == fresh.tokenizer.to_str() and data.ctok.fingerprint == fresh.ctok.fingerprint
        assert [d.name for d in data.val_docs] == [d.name for d in fresh.val_docs]
        assert (data.eos_id, data.pad_id, data.info["validation"]) == (
            fresh.eos_id,
            fresh.pad_id,
            fresh.info["validation"],
        )
    # An edited corpus file makes another corpus.
    with open(corpus / "notes.txt", "a", encoding="utf-8") as fh:
        fh.write("one more line\n")
    assert not prepare_data(str(corpus), **kwargs).info["prepared_cache"]["hit"]


def test_moe_backbone_trains_and_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    """Routed experts in both blocks (no shared expert): the loss falls, the balance loss is
    part of what is minimized, and a resumed run repeats an uninterrupted one."""
    moe = {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "aux_loss_coef": 0.01}  # the balance loss minimized
    preset = get_preset("tiny", {"model": {"ffn_hidden": 0, "moe": moe}})

    def trainer(steps, run_dir=None, model=None):
        if model is None:
            model = build_model(build_model_config(preset, tiny_data), tiny_data, seed=0, device="cpu")
        tc = dataclasses.replace(preset.train, steps=steps, lr=1e-2, checkpoint_every=4)
        return build_trainer(model, tc, tiny_data, "cpu", run_dir=run_dir, progress=False)

    straight = trainer(8)
    straight.fit()
    run = losses(straight)
    assert sum(run[-3:]) < sum(run[:3])
    straight.model.train()
    batch = straight._batch(0)
    straight.model.loss(batch.inputs, batch.targets, batch.doc_starts)
    assert 0.01 <= straight.model.aux_loss().item() < 0.01 * 2 * 4  # two blocks, each between 1 and E
    real_step = Trainer.train_step

    def crash_at_5(self, step):
        if step == 5:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        trainer(8, tmp_path / "run").fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.state["step"] == 4
    assert ckpt.model.cfg.moe == preset.model.moe
    resumed = trainer(8, tmp_path / "run", model=ckpt.model)
    resumed.restore(ckpt)
    resumed.fit()
    assert losses(resumed) == run
