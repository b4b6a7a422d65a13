"""`condmem.sizing` and ``condmem size``: a geometry within its budget, counted by the layout itself."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from condmem import EngramConfig
from condmem.cli import main
from condmem.fp8 import QuantError, packed_row_bytes
from condmem.layout import EngramLayout
from condmem.sizing import SizingError, parse_bytes, parse_count, size_engram

CASES = [
    pytest.param(dict(hidden_size=1024, params="100M"), id="params-100M"),
    pytest.param(dict(hidden_size=4096, memory="10GB"), id="bf16-10GB"),
    pytest.param(dict(hidden_size=4096, memory="3GiB", dtype="fp8", tier="host", layer_ids=[1, 14]), id="fp8-2layers"),
    pytest.param(dict(hidden_size=2048, memory="1GiB", dtype="fp32", max_ngram_size=4, n_heads=4), id="fp32-N4"),
    pytest.param(dict(hidden_size=128, memory="5MB"), id="tiny"),
]


def real_layout(config: dict, table_size: int | None = None) -> EngramLayout:
    """The layout a user gets from the returned config (any pad id and V': rows do not depend on them)."""
    cfg = EngramConfig(**{**config, **({} if table_size is None else {"table_size": table_size})}, pad_id=7)
    return EngramLayout(cfg, compressed_vocab_size=50_000)


def spent(layout: EngramLayout, sizing) -> int:
    """What the budget counts: bytes in the chosen dtype, or parameters."""
    return sum(layout.bytes_per_layer(sizing.dtype)) if "memory_bytes" in sizing.budget else layout.n_params


@pytest.mark.parametrize("kwargs", CASES)
def test_the_geometry_fits_its_budget_as_the_layout_counts_it(kwargs):
    s = size_engram(**kwargs)
    layout = real_layout(s.config)
    budget = next(iter(s.budget.values()))
    assert layout.num_embeddings == s.num_rows
    assert layout.n_params == s.params
    assert sum(layout.bytes_per_layer(s.dtype)) == s.bytes
    assert spent(layout, s) <= budget
    # The largest such size: one bucket more per head range no longer fits.
    assert spent(real_layout(s.config, s.config["table_size"] + 1), s) > budget
    assert s.read_bytes_per_token == len(s.config["layer_ids"]) * layout.n_cols * s.bytes // sum(s.num_rows)


def test_the_prime_rounding_is_what_keeps_it_within_budget():
    # Negative control: the table size a budget gives without the primes (budget / row / head
    # ranges) builds a layout over the budget; the helper's is under it.
    s = size_engram(4096, memory="10GB")
    naive = s.budget["memory_bytes"] // (2 * 256) // 16
    assert naive > s.config["table_size"]
    assert sum(real_layout(s.config, naive).bytes_per_layer("bf16")) > s.budget["memory_bytes"]


def test_defaults_are_the_papers_orders_and_heads_and_a_model_wide_read():
    s = size_engram(1024, params="100M")
    c = s.config
    assert (c["max_ngram_size"], c["n_heads"], c["head_dim"], c["hidden_size"]) == (3, 8, 64, 1024)  # the demo's
    assert size_engram(4096, memory="1GB", dtype="fp8").config["head_dim"] == 256
    assert size_engram(4096, memory="1GB", dtype="fp8", max_ngram_size=4).config["head_dim"] % 32 == 0
    assert size_engram(64, memory="1MB").config["head_dim"] == 8  # at least one step of 8


def test_the_config_dict_builds_an_engram_config():
    s = size_engram(512, memory="64MiB", layer_ids=[2, 5])
    cfg = EngramConfig(**s.config, pad_id=0)
    assert cfg.layer_ids == [2, 5] and cfg.hidden_size == 512


@pytest.mark.parametrize(
    ("text", "n"),
    [("10GB", 10**10), ("8GiB", 8 * 2**30), ("1.5 MiB", 3 * 2**19), ("2tb", 2 * 10**12), (4096, 4096)],
)
def test_memory_sizes_parse_with_their_units(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize(("text", "n"), [("2e9", 2 * 10**9), ("2B", 2 * 10**9), ("500M", 5 * 10**8), (7, 7)])
def test_parameter_counts_parse(text, n):
    assert parse_count(text) == n


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(hidden_size=1024), "exactly one budget"),
        (dict(hidden_size=1024, memory="1GB", params="1B"), "exactly one budget"),
        (dict(hidden_size=1024, memory="10"), "write a number and a unit"),
        (dict(hidden_size=1024, memory="-1GB"), "is not a size"),
        (dict(hidden_size=1024, memory="1e400GB"), "not a finite number"),
        (dict(hidden_size=1024, memory=True), "memory must be"),
        (dict(hidden_size=1024, params="2 bytes"), "is not a count"),
        (dict(hidden_size=1024, params=0), "params must be at least 1"),
        (dict(hidden_size=0, memory="1GB"), "hidden_size must be >= 1"),
        (dict(hidden_size=1024.0, memory="1GB"), "hidden_size must be an int"),
        (dict(hidden_size=1024, memory="1GB", tier="ssd"), "tier 'ssd' is not a tier"),
        (dict(hidden_size=1024, memory="1GB", dtype="fp16"), "dtype 'fp16' is not a table dtype"),
        (dict(hidden_size=1024, memory="1GB", n_heads=0), "n_heads must be >= 1"),
        (dict(hidden_size=1024, memory="1GB", layer_ids=[]), "layer_ids is empty"),
        (dict(hidden_size=1024, memory="1GB", dtype="fp8", head_dim=48), "multiple of 32"),
        (dict(hidden_size=1024, memory="1MB"), "too small"),
    ],
)
def test_bad_requests_are_refused_naming_the_argument(kwargs, words):
    with pytest.raises(SizingError, match=words):
        size_engram(**kwargs)


def test_an_fp8_head_dim_off_the_scale_block_is_refused_up_front():
    # Negative control: the config alone takes head_dim 48, and the failure would come later,
    # from the fp8 packing, far from the sizing request.
    EngramConfig(layer_ids=[1], head_dim=48, pad_id=0)
    with pytest.raises(QuantError):
        packed_row_bytes(48)
    with pytest.raises(SizingError, match="head_dim 48 must be a multiple of 32"):
        size_engram(1024, memory="1GB", dtype="fp8", head_dim=48)


def test_the_command_prints_the_config_and_json(capsys):
    assert main(["size", "--hidden", "4096", "--memory", "10GB"]) == 0
    out = capsys.readouterr().out
    assert "head_dim 256" in out and "EngramConfig(layer_ids=[1]" in out
    assert main(["size", "--hidden", "1024", "--params", "500M", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == size_engram(1024, params="500M").to_dict()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--hidden", "0", "--memory", "1GB"], "--hidden must be >= 1"),
        (["--hidden", "64", "--memory", "10"], "--memory '10' is not a size"),
        (["--hidden", "64", "--memory", "1GB", "--heads", "0"], "--heads must be >= 1"),
        (["--hidden", "64", "--memory", "1GB", "--dtype", "fp8", "--head-dim", "48"], "--head-dim 48"),
        (["--hidden", "64", "--memory", "1GB", "--layers", "1", "1"], "--layers has duplicates"),
    ],
)
def test_the_command_refuses_bad_flags_in_one_line_naming_the_flag(argv, flag, capsys):
    assert main(["size", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1, err


def test_the_sizing_page_shows_what_the_command_prints(capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text()
    command, shown = re.search(r"```bash\n(condmem size [^\n]*)\n```\n\n```\n(.*?)```", page, flags=re.DOTALL).groups()
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == shown
