"""Configs that must be refused: sizes that overflow row ids or hang, strings for booleans, misspelled
keys, non-finite floats, duplicate keys, and files that are not JSON text; always a `ConfigError`."""

from __future__ import annotations

import json
import os

import pytest

from condmem.config import ConfigError, EngramConfig

V4 = {
    "engram_layer_ids": [1],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 1000,
    "engram_compressed_vocab_size": 50,
}
DEMO = {
    "engram_vocab_size": [1000, 1000],
    "max_ngram_size": 3,
    "n_embed_per_ngram": 64,
    "n_head_per_ngram": 2,
    "layer_ids": [1],
    "pad_id": 2,
    "seed": 0,
}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"table_size": 2**62}, "table_size"),
        ({"table_size": [2**41, 10]}, "table_size"),
        ({"n_heads": 10**7}, "n_heads.*<="),
        ({"max_ngram_size": 10**6}, "max_ngram_size.*<="),
        ({"head_dim": 10**15}, "head_dim.*<="),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"short_conv": "false"}, "short_conv"),
        ({"layer_ids": list(range(5000))}, "layer_ids"),
        ({"compressed_vocab_size": 2**40}, "compressed_vocab_size"),
        ({"layer_ids": list(range(1024)), "max_ngram_size": 32, "n_heads": 256}, "hash columns, at most"),
    ],
    ids=[
        "table_2^62",
        "table_list",
        "heads",
        "order",
        "head_dim",
        "eps_inf",
        "eps_nan",
        "str_bool",
        "layers",
        "vocab",
        "columns",
    ],
)
def test_out_of_range_native_values_are_refused(change, match):
    cfg = dict(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=32, table_size=1000)
    cfg.update(change)
    with pytest.raises(ConfigError, match=match):
        EngramConfig(**cfg)


def test_row_ids_stay_far_below_2_63():
    from condmem.layout import EngramLayout

    cfg = EngramConfig(
        layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, table_size=2**40, compressed_vocab_size=50
    )
    layout = EngramLayout(cfg)
    assert sum(layout.num_embeddings) < 2**62


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_v4_short_conv_must_be_a_real_boolean(value):
    with pytest.raises(ConfigError, match="engram_short_conv"):
        EngramConfig.from_dict(dict(V4, engram_short_conv=value))
    with pytest.raises(ConfigError, match="short_conv"):
        EngramConfig.from_dict(dict(DEMO, short_conv=value))


def test_misspelled_keys_are_named():
    with pytest.raises(ConfigError, match="n_head_per_ngarm"):
        EngramConfig.from_dict(dict(DEMO, n_head_per_ngarm=4))
    with pytest.raises(ConfigError, match="engram_n_head\\b"):
        EngramConfig.from_dict(dict(V4, engram_n_head=4))
    # A full HF config keeps its unrelated keys.
    EngramConfig.from_dict(dict(V4, vocab_size=129280, num_hidden_layers=43, hidden_size=4096))


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"layer_ids": [1], "layer_ids": [2]}', "duplicate key 'layer_ids'"),
        ('{"layer_ids": [1], "rms_norm_eps": Infinity}', "Infinity"),
        ('{"layer_ids": [1], "rms_norm_eps": NaN}', "NaN"),
        ("[" * 100000 + "]" * 100000, "nested"),
    ],
    ids=["duplicate", "infinity", "nan", "deep"],
)
def test_bad_json_is_a_config_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        EngramConfig.load(path)
    assert str(path) in str(err.value)


def test_files_that_are_not_json_text(tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"layer_ids": [1], "x": "\xe9"}')
    with pytest.raises(ConfigError, match="UTF-8"):
        EngramConfig.load(bad)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        EngramConfig.load(tmp_path / "dir")
    with pytest.raises(ConfigError, match="not a regular file"):
        EngramConfig.load("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # and no hang
        EngramConfig.load(fifo)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"layer_ids": [1], "pad": "x" * (17 * 2**20)}))
    with pytest.raises(ConfigError, match="MiB"):
        EngramConfig.load(big)


def test_n_embed_per_ngram_must_be_an_int_not_a_bool():
    with pytest.raises(ConfigError, match="n_embed_per_ngram must be an int"):
        EngramConfig.from_dict(dict(DEMO, n_embed_per_ngram=True, n_head_per_ngram=1))


def test_an_integer_of_5000_digits_names_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"layer_ids": [' + "9" * 5000 + "]}")
    with pytest.raises(ConfigError, match="too long to read") as err:
        EngramConfig.load(path)
    assert str(path) in str(err.value)
