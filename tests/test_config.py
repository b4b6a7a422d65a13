"""EngramConfig: validation messages, the three dialects, files; layout consistency checks."""

from __future__ import annotations

import json

import pytest

from condmem import ConfigError, EngramConfig, EngramLayout, LayoutError


def test_dialect_round_trips(tmp_path):
    cfg = EngramConfig(
        layer_ids=[2, 9],
        max_ngram_size=4,
        n_heads=3,
        head_dim=16,
        table_size=[101, 203, 307],
        pad_id=5,
        seed=1,
        hidden_size=80,
        hc_mult=2,
        kernel_size=3,
        short_conv=True,
        compressed_vocab_size=321,
        rms_norm_eps=1e-5,
    )
    for dialect in ("native", "v4", "demo"):
        path = tmp_path / f"{dialect}.json"
        cfg.save(path, dialect=dialect)
        assert EngramConfig.load(path) == cfg, dialect


def test_reads_a_v41_hf_config_with_unrelated_keys(tmp_path):
    hf = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "hidden_size": 4096,
        "hc_mult": 4,
        "vocab_size": 129280,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
        "rms_norm_eps": 1e-6,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = EngramConfig.load(tmp_path)  # a directory holding config.json
    assert cfg.layer_ids == [1, 14] and cfg.n_cols == 24 and cfg.short_conv is False
    assert EngramLayout(cfg).num_embeddings == [384006168, 384016682]


def test_reads_the_official_demo_keys():
    demo = {
        "tokenizer_name_or_path": "deepseek-ai/DeepSeek-V3",
        "engram_vocab_size": [129280 * 5, 129280 * 5],
        "max_ngram_size": 3,
        "n_embed_per_ngram": 512,
        "n_head_per_ngram": 8,
        "layer_ids": [1, 15],
        "pad_id": 2,
        "seed": 0,
        "kernel_size": 4,
    }
    cfg = EngramConfig.from_dict(demo)
    assert cfg.head_dim == 64 and cfg.table_sizes == [646400, 646400] and cfg.short_conv


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"layer_ids": []}, "layer_ids"),
        ({"layer_ids": [1, 1]}, "duplicates"),
        ({"max_ngram_size": 1}, "max_ngram_size"),
        ({"n_heads": 0}, "n_heads"),
        ({"table_size": [10, 20, 30]}, "table_size has 3 entries"),
        ({"table_size": 1}, "table_size"),
        ({"hc_mult": 0}, "hc_mult"),
        ({"head_dim": 2.5}, "head_dim must be an int"),
        ({"short_conv": "yes"}, "short_conv"),
        ({"num_embeddings": [5, 6]}, "num_embeddings has 2 entries"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ],
)
def test_validation_names_the_field(changes, field):
    base = dict(layer_ids=[1], max_ngram_size=3, table_size=[10, 20])
    base.update(changes)
    with pytest.raises(ConfigError, match=field):
        EngramConfig(**base)


def test_unknown_keys_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="unknown EngramConfig field"):
        EngramConfig.from_dict({"layer_ids": [1], "n_head": 4})
    with pytest.raises(ConfigError, match="cannot tell the config dialect"):
        EngramConfig.from_dict({"hidden_size": 8})
    with pytest.raises(ConfigError, match="V4.1 config lacks 'engram_n_heads'"):
        EngramConfig.from_dict({"engram_layer_ids": [1], "engram_max_ngram_size": 3})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngramConfig.load(bad)
    with pytest.raises(ConfigError, match="not found"):
        EngramConfig.load(tmp_path / "missing.json")


def test_inconsistent_geometry_is_refused():
    cfg = EngramConfig.deepseek_v41_flash().replace(num_embeddings=[384006168, 384016681])
    with pytest.raises(LayoutError, match="primes"):
        EngramLayout(cfg)


def test_compressed_vocab_mismatch_and_missing():
    cfg = EngramConfig(layer_ids=[1], table_size=50, compressed_vocab_size=100)
    with pytest.raises(LayoutError, match="silently rehashed"):
        EngramLayout(cfg, compressed_vocab_size=99)
    with pytest.raises(LayoutError, match="compressed_vocab_size is unknown"):
        EngramLayout(cfg.replace(compressed_vocab_size=None))


def test_fingerprint_tracks_everything_that_moves_a_row():
    base = EngramConfig(layer_ids=[1, 3], table_size=50, compressed_vocab_size=100)
    fp = EngramLayout(base).fingerprint
    assert EngramLayout(base.replace(hidden_size=64)).fingerprint == fp  # not part of addressing
    for change in (
        {"seed": 1},
        {"pad_id": 3},
        {"table_size": 51},
        {"layer_ids": [1, 4]},
        {"n_heads": 4},
        {"compressed_vocab_size": 101},
        {"max_ngram_size": 4},
    ):
        assert EngramLayout(base.replace(**change)).fingerprint != fp, change


def _v41_keys():
    return {
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16000000,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "engram_num_embeddings": [384006168, 384016682],
    }


def test_reads_engram_keys_nested_under_text_config_or_a_named_key(tmp_path):
    flat = EngramConfig.from_dict({**_v41_keys(), "hidden_size": 96, "hc_mult": 2, "rms_norm_eps": 1e-5})
    nested = {
        "architectures": ["X"],
        "vision_config": {"hidden_size": 3},
        "text_config": {**_v41_keys(), "hidden_size": 96, "hc_mult": 2, "rms_norm_eps": 1e-5},
    }
    assert EngramConfig.from_dict(nested) == flat
    # Backbone dims stated at the top level apply to a nested section that lacks them.
    top = {"hidden_size": 96, "hc_mult": 2, "rms_norm_eps": 1e-5, "language": _v41_keys()}
    (tmp_path / "config.json").write_text(json.dumps(top))
    assert EngramConfig.load(tmp_path, key="language") == flat
    with pytest.raises(
        ConfigError, match=r"config.json: no Engram keys found, at the top level or under 'text_config'"
    ):
        EngramConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="no section 'lang'"):
        EngramConfig.load(tmp_path, key="lang")
    with pytest.raises(ConfigError, match="section 'hidden_size'|no section 'hidden_size'"):
        EngramConfig.from_dict(top, key="hidden_size")


def test_v41_preset_states_only_what_oracles_verify(tmp_path):
    preset = EngramConfig.deepseek_v41_flash()
    assert (preset.hidden_size, preset.hc_mult, preset.rms_norm_eps) == (None, None, None)
    assert EngramLayout(preset).num_embeddings == [384006168, 384016682]
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v41_flash.json"
    assert EngramConfig.load(shipped) == preset
    assert not {"hidden_size", "hc_mult", "rms_norm_eps"} & set(json.loads(shipped.read_text()))
    preset.save(tmp_path / "p.json", dialect="v4")  # unknown dims are left out, not written as null
    assert "hidden_size" not in json.loads((tmp_path / "p.json").read_text())
    # A V4.1 config without backbone dims leaves them unknown instead of guessing.
    assert EngramConfig.from_dict(_v41_keys()).hidden_size is None
