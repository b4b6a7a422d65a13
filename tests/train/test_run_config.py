"""`RunConfig` (`condmem train --config FILE`): the shipped example names every key and trains what
its preset trains; unknown keys, wrong types and bad values are refused naming the key and the
file; --set and the flags replace keys of the file, in that order."""

from __future__ import annotations

import dataclasses
import json

import pytest

from condmem.cli import main
from condmem.config import ConfigError
from condmem.train.loop import TrainConfig
from condmem.train.presets import PRESETS, SECTIONS
from condmem.train.run_config import RunConfig, given_keys, load_run_config, parse_assignment


def test_the_shipped_example_names_every_key_and_is_the_cpu_preset():
    config, given = load_run_config("example")
    assert config.resolve("cpu") == PRESETS["cpu"]
    keys = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)} - {"train.seed"}
    keys |= {f.name for f in dataclasses.fields(RunConfig)} - {"sections"}
    commented = {"model.moe", "train.max_minutes", "data.max_corpus_bytes", "data.max_val_tokens"}
    commented |= {"tokenizer", "host_threads"}  # optional keys the example shows as comments
    assert keys - commented == set(given), sorted(keys - commented ^ set(given))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"lr": "fast"}}, "train.lr must be a finite number"),
        ({"model": {"width": 64}}, "unknown key(s) model.width"),
        ({"model": {"dim": -4}}, "model.dim must be >= 1"),
        ({"model": {"moe": {"n_experts": 2, "top_k": 3}}}, "model.moe.top_k (3) must be <= n_experts (2)"),
        ({"model": {"moe": {"experts": 2}}}, "unknown key(s) model.moe.experts"),
        ({"engram": {"layer_ids": [9]}}, "engram.layer_ids[] must be in [0, 3]"),
        ({"data": {"corpus": 7}}, "data.corpus must be a string or a non-empty list"),
        ({"train": {"seed": 1}}, "train.seed is set by the top-level key seed"),
        ({"optimizer": {}}, "unknown key(s) optimizer"),
        ({"preset": "huge"}, "preset must be one of cpu, gpu, tiny"),
        ({"table_tier": "disk"}, "table_tier must be one of module, host"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"iso_flop": True}, "iso_flop widens the baseline: it needs no_engram"),
        ({"no_engram": "yes"}, "no_engram must be true or false"),
        ({"host_threads": 0}, "host_threads must be >= 1"),
        ({"train": {"cuda_graphs": True}}, "cuda_graphs replays compiled blocks: it needs compile = true"),
    ],
)
def test_a_bad_key_is_refused_naming_it_and_the_file(tmp_path, data, message):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert message in str(err.value) and str(path) in str(err.value), err.value


def test_toml_errors_name_the_file_and_set_values_parse_as_toml(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_run_config(tmp_path / "missing.toml")
    assert parse_assignment("train.lr=3e-4") == ("train.lr", 3e-4)
    assert parse_assignment("engram.layer_ids=[1, 2]") == ("engram.layer_ids", [1, 2])
    assert parse_assignment("data.corpus=/some/texts") == ("data.corpus", "/some/texts")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_assignment("train.lr")
    assert given_keys({"seed": 1, "model": {"dim": 8, "moe": {"top_k": 1}}}) == ["seed", "model.dim", "model.moe.top_k"]


def test_train_reads_a_config_file_then_set_then_flags(tiny_corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'preset = "tiny"\nseed = 3\n[model]\ndim = 48\n[train]\nsteps = 5\nlr = 2e-3\nwarmup_steps = 1\n'
        f'[data]\ncorpus = "{tiny_corpus}"\nvocab_size = 320\n'
    )
    out = tmp_path / "run"
    argv = ["train", "--config", str(config), "--out", str(out), "--device", "cpu", "--no-progress"]
    assert main([*argv, "--set", "train.lr=1e-3", "--set", "train.steps=3", "--steps", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["dim"] == 48 and summary["train"]["lr"] == 1e-3 and summary["train"]["seed"] == 3
    assert summary["train"]["steps"] == 2  # --steps beats --set train.steps, which beats the file
    again = RunConfig.from_dict(summary["run_config"])  # the run's config, saved beside its results
    assert again.resolve("cpu").train == dataclasses.replace(TrainConfig.from_dict(summary["train"]), seed=0)


def test_a_bad_set_or_config_is_a_usage_error_before_any_work(tmp_path, capsys):
    argv = ["train", "--out", str(tmp_path / "run"), "--device", "cpu"]
    assert main([*argv, "--set", "train.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "train.lr must be positive" in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--config", str(tmp_path / "nowhere.toml")]) == 2
    assert "nowhere.toml: cannot read the config file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
