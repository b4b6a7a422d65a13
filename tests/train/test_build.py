"""The build step (`condmem.train.build`) and the typed presets.

One preset and seed give the same initial weights and batches on every build, and
`condmem demo` and `condmem train` build the same model: their Engram runs lose the same
losses step for step.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from condmem.cli import main
from condmem.config import ConfigError
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.apps.demo import DemoConfig, run_demo
from condmem.train.presets import PRESETS, get_preset


def _build(data, seed: int):
    preset = get_preset("tiny")
    model = build_model(build_model_config(preset, data), data, seed=seed, device="cpu")
    return build_trainer(model, dataclasses.replace(preset.train, seed=seed), data, "cpu", progress=False)


def test_build_gives_identical_models_and_batches_for_a_seed(tiny_data):
    a, b, other = _build(tiny_data, 0), _build(tiny_data, 0), _build(tiny_data, 1)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not torch.equal(sa["blocks.0.attn.wq.weight"], other.model.state_dict()["blocks.0.attn.wq.weight"])
    for step in (0, 1, 7):
        x, y = a._batch(step), b._batch(step)
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert torch.equal(x.doc_starts, y.doc_starts)
    assert not torch.equal(a._batch(0).inputs, other._batch(0).inputs)


def test_demo_and_train_share_the_build(tiny_corpus, tmp_path):
    config = DemoConfig(
        tmp_path / "demo",
        preset="tiny",
        overrides={"train": {"steps": 3}, "data": {"corpus": str(tiny_corpus)}},
        device="cpu",
        max_new_tokens=1,
        progress=False,
        checkpoint=False,
    )
    summary = run_demo(config)
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
                "3",
                "--no-progress",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "train"),
            ]
        )
        == 0
    )
    trained = json.loads((tmp_path / "train" / "summary.json").read_text())
    demo_losses = [h["loss"] for h in summary["curves"]["engram"][0]["history"]]
    assert demo_losses == [h["loss"] for h in trained["history"]]
    assert summary["engram"]["val_loss"] == trained["summary"]["val_loss"]


def test_presets_are_typed_and_overrides_are_checked():
    preset = get_preset("tiny", {"train": {"steps": 5, "batch_size": None}, "engram": {"table_size": 700}})
    assert preset.train.steps == 5 and preset.train.batch_size == PRESETS["tiny"].train.batch_size
    assert preset.engram.table_size == 700 and PRESETS["tiny"].engram.table_size == 500
    preset.engram.layer_ids.append(0)  # a copy: the named preset is unchanged
    assert PRESETS["tiny"].engram.layer_ids == [1]
    longer = get_preset("tiny").override(train={"seq_len": 128})
    assert longer.model.max_seq_len == 128
    with pytest.raises(ConfigError, match="train.stepz"):
        get_preset("tiny", {"train": {"stepz": 5}})
    with pytest.raises(ConfigError, match="section 'trian'"):
        get_preset("tiny", {"trian": {"steps": 5}})
    with pytest.raises(ConfigError, match="steps"):
        get_preset("tiny", {"train": {"steps": 0}})
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")
