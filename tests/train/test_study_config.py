"""Study config files: the shipped presets load from any directory, a config round-trips through
its file, and every bad value is refused naming its key (and the file)."""

from __future__ import annotations

import json

import pytest

from condmem.cli import main
from condmem.config import ConfigError
from condmem.train.presets import ModelPreset
from condmem.apps.study.config import PRESET_NAMES, StudyConfig, load_study_config, preset_path, study_preset

TOML = """\
name = "mine"
rhos = [1.0, 0.5]
table_sizes = [20, 300]
allocation_steps = 4
slots_steps = 4
seeds = 2
controls = ["no_table"]
val_tokens = 2048

[model]
dim = 32
n_layers = 2
n_heads = 2
n_kv_heads = 1
ffn_hidden = 32
max_seq_len = 64

[model.moe]
n_experts = 6
top_k = 2
expert_hidden = 32

[engram]
layer_ids = [1]
max_ngram_size = 3
n_heads = 2
head_dim = 8
table_size = 500

[train]
batch_size = 4
seq_len = 32
lr = 3e-3
warmup_steps = 2

[data]
corpus = "stdlib"
vocab_size = 320
"""


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_round_trip_through_their_files(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # package data: found from any directory
    sc = study_preset(name)
    assert preset_path(name).is_file() and sc.name == name
    assert StudyConfig.from_dict(sc.to_dict()) == sc
    assert load_study_config(sc.save(tmp_path / f"{name}.json")) == sc


def test_a_toml_config_loads_and_round_trips(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(TOML)
    sc = load_study_config(path)
    assert sc.name == "mine" and sc.base.model.moe.n_experts == 6 and sc.controls == ["no_table"]
    assert sc.steps_for("allocation") == 4 and sc.base.train.lr == 3e-3
    assert load_study_config(sc.save(tmp_path / "again.json")) == sc


def _bad(tmp_path, old: str, new: str) -> str:
    assert old in TOML, old
    path = tmp_path / "bad.toml"
    path.write_text(TOML.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    assert str(path) in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('name = "mine"', 'name = "mine"\nrhoz = [0.5]', "unknown key(s) rhoz"),
        ("dim = 32", "dim = 32\nwidht = 3", "unknown key(s) model.widht"),
        ("top_k = 2", "topk = 2", "unknown key(s) model.moe.topk"),
        ("head_dim = 8", "head_dim = 8\nrows = 3", "unknown key(s) engram.rows"),
        ("dim = 32", "dim = -32", "model.dim must be >= 1, got -32"),
        ("ffn_hidden = 32", "ffn_hidden = -1", "model.ffn_hidden must be >= 0, got -1"),
        ("expert_hidden = 32", "expert_hidden = -8", "model.moe.expert_hidden must be >= 1"),
        ("head_dim = 8", "head_dim = 0", "engram.head_dim must be >= 1, got 0"),
        ("rhos = [1.0, 0.5]", "rhos = [1.0, 0.0]", "rhos[1]: rho must be in (0, 1], got 0.0"),
        ("rhos = [1.0, 0.5]", "rhos = [1.5, 0.5]", "rhos[0]: rho must be in (0, 1], got 1.5"),
        ("rhos = [1.0, 0.5]", "rhos = [1.0, -0.5]", "rhos[1]: rho must be in (0, 1], got -0.5"),
        ("seeds = 2", "seeds = 0", "seeds must be >= 1, got 0"),
        ("lr = 3e-3", "lr = -3e-3", "train.lr must be positive"),
        ("warmup_steps = 2", "warmup_steps = 2\nsteps = 9", "train.steps is set by the sweep"),
        ('controls = ["no_table"]', 'controls = ["no_tabel"]', "controls[0]: unknown control 'no_tabel'"),
        ("vocab_size = 320", "vocab_size = 3", "data.vocab_size must be >= 257"),
        ("table_sizes = [20, 300]", "table_sizes = [20, -3]", "table_sizes[1] must be >= 2, got -3"),
        ("val_tokens = 2048", "val_tokens = 0", "val_tokens must be >= 1, got 0"),
        ("allocation_steps = 4", "allocation_steps = 4.5", "allocation_steps must be an integer, got 4.5"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(tmp_path, old, new, message):
    assert message in _bad(tmp_path, old, new)


def test_the_checks_are_the_configs_own(tmp_path):
    # negative control: the preset dataclasses alone take a negative width silently
    assert ModelPreset(dim=-32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=64).dim == -32
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_study_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_study_config(tmp_path / "missing.toml")


def test_the_cli_takes_a_config_file_saves_it_beside_the_results_and_names_bad_keys(tiny_corpus, tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(TOML)
    out = tmp_path / "out"
    args = ["study", "allocation", "--config", str(path), "--corpus", str(tiny_corpus), "--out", str(out)]
    assert main([*args, "--no-progress", "--device", "cpu", "--seeds", "1"]) == 0
    saved = load_study_config(out / "config.json")
    assert saved == load_study_config(path).override(seeds=1).with_base(data={"corpus": [str(tiny_corpus)]})
    assert json.loads((out / "study.json").read_text())["config"] == saved.to_dict()
    path.write_text(TOML.replace("dim = 32", "dim = -32", 1))
    assert main([*args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "model.dim must be >= 1, got -32" in err and str(path) in err and "Traceback" not in err
    assert main([*args, "--preset", "gpu"]) == 1
    assert "--preset and --config both given" in capsys.readouterr().err


def test_the_guides_config_example_is_a_valid_study_config():
    import tomllib
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "study-guide.md").read_text()
    example = guide[guide.index("### Config files") :].split("```toml", 1)[1].split("```", 1)[0]
    sc = StudyConfig.from_dict(tomllib.loads(example), where="docs/study-guide.md")
    assert sc.base.train.compile and sc.base.train.cuda_graphs and sc.base.model.moe.n_experts == 62
