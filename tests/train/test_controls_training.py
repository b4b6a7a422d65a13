"""An MoE model with the random-address control through the trainer: a run stopped after a
checkpoint and resumed equals the uninterrupted run loss for loss (the selection bias and the
count of random draws travel in the checkpoint); the router statistics cover its steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from condmem.models.config import MoEConfig
from condmem.models.flops import random_address_control
from condmem.models.moe import router_statistics
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.train.checkpoint import load_checkpoint
from condmem.train.loop import Trainer
from condmem.train.presets import get_preset

STEPS = 6


def _trainer(data, run_dir=None, model=None, **train):
    preset = get_preset("tiny")
    if model is None:
        cfg = build_model_config(preset, data).replace(moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16))
        model = build_model(random_address_control(cfg), data, seed=0, device="cpu")
    tc = dataclasses.replace(preset.train, steps=STEPS, seed=0, **train)
    return build_trainer(model, tc, data, "cpu", run_dir=run_dir, label="control", progress=False)


def _losses(trainer):
    return [h["loss"] for h in trainer.history]


def test_random_address_moe_run_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    straight = _trainer(tiny_data)
    straight.fit()
    stats = router_statistics(straight.model)
    assert all(s["forwards"] == STEPS for s in stats["layers"].values())
    assert straight.model.random_addresses.train_draws.item() == STEPS

    run = tmp_path / "run"
    interrupted = _trainer(tiny_data, run_dir=run, checkpoint_every=3)
    real_step = Trainer.train_step

    def crash_at_4(self, step):
        if step == 4:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", crash_at_4)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)

    ckpt, again = load_checkpoint(run), load_checkpoint(run)  # the step-3 checkpoint, twice
    assert ckpt.state["step"] == 3 and ckpt.model.random_addresses.train_draws.item() == 3
    resumed = _trainer(tiny_data, run_dir=run, checkpoint_every=3, model=ckpt.model)
    resumed.restore(ckpt)
    resumed.fit()
    assert _losses(resumed) == _losses(straight)
    for a, b in zip(straight.model.blocks, resumed.model.blocks):
        assert torch.equal(a.moe.expert_bias, b.moe.expert_bias)

    # Negative control: resumed with the draws and the bias started afresh, the losses differ.
    again.model.random_addresses.load_state_dict({"train_draws": torch.tensor(0)})
    for block in again.model.blocks:
        block.moe.expert_bias.zero_()
    afresh = _trainer(tiny_data, model=again.model)
    afresh.restore(again)
    afresh.fit()
    assert _losses(afresh)[3:] != _losses(straight)[3:]
