"""Hypothesis-fuzzed configs (three dialects), table-file headers and CLI arguments: every malformed
input is an error of the documented type (or a usage exit), never another exception or a hang."""

from __future__ import annotations

import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from condmem.cli import main
from condmem.config import DEMO_KEYS, V4_KEYS, ConfigError, EngramConfig
from condmem.tables.safetensors_io import TableFileError
from condmem.tables.table_file import EngramTableFile

FAST = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NATIVE_KEYS = [
    "layer_ids",
    "max_ngram_size",
    "n_heads",
    "head_dim",
    "table_size",
    "pad_id",
    "seed",
    "hidden_size",
    "hc_mult",
    "kernel_size",
    "short_conv",
    "compressed_vocab_size",
    "num_embeddings",
    "rms_norm_eps",
]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
BASES = {
    "native": {"layer_ids": [1], "max_ngram_size": 3, "n_heads": 2, "head_dim": 32, "table_size": 1000},
    "v4": {
        "engram_layer_ids": [1],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 1000,
    },
    "demo": {
        "engram_vocab_size": [1000, 1000],
        "max_ngram_size": 3,
        "n_embed_per_ngram": 64,
        "n_head_per_ngram": 2,
        "layer_ids": [1],
    },
}
KEYS = {"native": NATIVE_KEYS, "v4": sorted(V4_KEYS), "demo": sorted(DEMO_KEYS)}


@FAST
@given(dialect=st.sampled_from(sorted(BASES)), data=st.data())
def test_fuzzed_configs_are_accepted_or_a_config_error(dialect, data):
    keys = st.sampled_from(KEYS[dialect]) | st.text(max_size=12)
    changes = data.draw(st.dictionaries(keys, values, max_size=4))
    try:
        cfg = EngramConfig.from_dict({**BASES[dialect], **changes})
    except ConfigError:
        return
    json.dumps(cfg.to_dict())  # what was accepted is a plain, finite config
    assert all(isinstance(x, int) and 0 <= x <= 100_000 for x in cfg.layer_ids)


@FAST
@given(raw=st.binary(max_size=200))
def test_fuzzed_config_files_are_a_config_error(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_bytes(raw)
    try:
        EngramConfig.load(path)
    except ConfigError:
        pass


@FAST
@given(
    header=st.dictionaries(st.text(max_size=6), values, max_size=4), tail=st.binary(max_size=64), lie=st.integers(-3, 3)
)
def test_fuzzed_table_headers_are_a_table_file_error(tmp_path_factory, header, tail, lie):
    raw = json.dumps(header).encode()
    path = tmp_path_factory.mktemp("hdr") / "t.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(raw) + lie)) + raw + tail)
    try:
        EngramTableFile(path)
    except TableFileError:
        pass


@FAST
@given(
    cmd=st.sampled_from(["hash", "layout", "convert", "inspect", "generate"]),
    args=st.lists(
        st.sampled_from(
            [
                "--config",
                "--ids",
                "--to",
                "--out",
                "--chunk-rows",
                "--sample",
                "--steps",
                "/dev/zero",
                "/nonexistent",
                "1e20",
                "-1",
                "fp8",
                "x,y",
                "--verify",
            ]
        )
        | st.text(max_size=6),
        max_size=6,
    ),
)
def test_fuzzed_cli_arguments_exit_cleanly(cmd, args, capsys):
    try:
        rc = main([cmd, *args, "--no-progress"] if cmd in ("convert", "inspect") else [cmd, *args])
    except SystemExit as exc:  # argparse's usage error
        rc = exc.code
    assert rc in (0, 1, 2)
    assert "Traceback" not in capsys.readouterr().err
