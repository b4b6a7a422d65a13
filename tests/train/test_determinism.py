"""`condmem train --deterministic`: deterministic kernels while training (and only then), recorded in
summary.json, and the same options twice give the same losses."""

from __future__ import annotations

import json

import torch

from condmem.cli import main
from condmem.train.determinism import deterministic_mode
from condmem.train.loop import Trainer


def _train(tiny_corpus, out, *extra):
    args = ["train", "--preset", "tiny", "--corpus", str(tiny_corpus), "--set", "data.vocab_size=320", "--steps", "4"]
    assert main([*args, "--no-progress", "--out", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def test_train_deterministic_is_on_while_fitting_recorded_and_restored(tiny_corpus, tmp_path, monkeypatch):
    seen = []
    real_fit = Trainer.fit

    def fit(self, *a, **k):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_fit(self, *a, **k)

    monkeypatch.setattr(Trainer, "fit", fit)
    torch.use_deterministic_algorithms(False)  # whatever the process had; the conftest puts it back
    first = _train(tiny_corpus, tmp_path / "a", "--deterministic")
    second = _train(tiny_corpus, tmp_path / "b", "--deterministic")
    plain = _train(tiny_corpus, tmp_path / "c")
    assert seen == [True, True, False]  # negative control: without the flag the mode is off
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    assert first["summary"]["determinism"]["enabled"] and not plain["summary"]["determinism"]["enabled"]
    assert [h["loss"] for h in first["history"]] == [h["loss"] for h in second["history"]]


def test_deterministic_mode_restores_the_settings_before_it_even_after_an_error():
    torch.use_deterministic_algorithms(False)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        with deterministic_mode(True):
            assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
            assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of new tensors
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert torch.utils.deterministic.fill_uninitialized_memory == fill


def test_demo_deterministic_trains_in_the_mode(tiny_corpus, tmp_path, monkeypatch):
    from condmem.apps import demo

    seen = []

    class Stop(Exception):
        pass

    def record(*a, **k):
        seen.append(torch.are_deterministic_algorithms_enabled())
        raise Stop

    monkeypatch.setattr(demo, "_train_and_compare", record)
    torch.use_deterministic_algorithms(False)
    for flag in (True, False):  # negative control: off without the flag
        try:
            overrides = {"train": {"steps": 2}, "data": {"corpus": str(tiny_corpus)}}
            demo.run_demo(demo.DemoConfig(tmp_path / str(flag), "tiny", overrides, deterministic=flag))
        except Stop:
            pass
    assert seen == [True, False] and not torch.are_deterministic_algorithms_enabled()
