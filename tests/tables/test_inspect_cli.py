"""``condmem inspect`` and ``condmem convert --released`` on synthetic released checkpoints of both dialects."""

from __future__ import annotations

import json
import re

import pytest
import torch

from condmem import Engram
from condmem.cli import main
from condmem.tables.inspect import inspect_tables, row_stats
from condmem.tables.table_file import EngramTableFile, LayerRows
from released_fixtures import config_json, make_tensors, tensor_names, write_checkpoint


@pytest.mark.parametrize("dialect,shards,style", [("original", 3, "nested"), ("hf", 1, "flat")])
def test_convert_released_reads_the_config_from_the_folder(tmp_path, dialect, shards, style):
    truth = write_checkpoint(tmp_path / "ckpt", dialect, shards, style)
    out = tmp_path / "t.safetensors"
    assert (
        main(
            [
                "convert",
                "--released",
                str(tmp_path / "ckpt"),
                str(out),
                "--to",
                "fp8_interleaved",
                "--no-progress",
                "--chunk-rows",
                "50",
            ]
        )
        == 0
    )
    table = EngramTableFile(out)
    for lid, t in truth.items():
        rows = table.layer(lid).weight
        assert torch.equal(rows[:, :64], t["embed"].view(torch.uint8))
        assert torch.equal(rows[:, 64:], t["embed_exponents"])


def test_inspect_checkpoint_reports_layout_tensors_bytes_and_rows(tmp_path, capsys):
    tensors_truth = write_checkpoint(tmp_path, "original", 3, "nested")
    report = inspect_tables(tmp_path, full=True, progress=False)
    assert report["tensor_names"] == "original" and report["files"] == 3
    assert report["layout"]["layer_ids"] == [2, 5] and len(report["layout"]["fingerprint"]) == 64
    layer = report["layers"][0]
    assert layer["rows_match_primes"] and layer["wkv_block"] == [16, 32]
    assert layer["tensors"]["embed_scale"]["name"] == tensor_names(2, "original")["embed_scale"]
    assert layer["tensors"]["embed_scale"]["dtype"] == "float8_e8m0fnu"
    assert layer["bytes"]["host_or_hbm_fp8_interleaved"] == layer["rows"] * 66
    stats = layer["row_stats"]
    assert not stats["sampled"] and stats["rows_checked"] == layer["rows"]
    expect = torch.bincount(tensors_truth[2]["embed_exponents"].flatten().long(), minlength=256)
    assert stats["scale_exponents"] == {e: int(c) for e, c in enumerate(expect.tolist()) if c}
    assert (stats["zero_rows"], stats["nan_rows"], stats["inf_rows"]) == (0, 0, 0)
    assert main(["inspect", str(tmp_path), "--no-progress", "--sample", "100"]) == 0
    text = capsys.readouterr().out
    assert "tensor names: original" in text and "sum of primes" in text and ": ok" in text
    assert "100 sampled of" in text and "layers.5.engram.wkv.scale" in text


def test_inspect_counts_zero_nan_inf_rows_and_reads_table_files(tmp_path, capsys):
    q = torch.zeros(4, 64, dtype=torch.uint8)
    q[1, 3] = 0x7F  # an fp8 NaN
    q[2, 0] = 0x7E  # 448, times 2**127 overflows float32
    q[3, 5] = 0x38  # 1.0
    e = torch.full((4, 2), 127, dtype=torch.uint8)
    e[2, 0] = 254
    stats = row_stats(LayerRows("fp8", q.view(torch.float8_e4m3fn), e), sample=None)
    assert (stats["zero_rows"], stats["nan_rows"], stats["inf_rows"]) == (1, 1, 1)
    assert stats["scale_exponents"] == {127: 7, 254: 1}
    write_checkpoint(tmp_path / "ckpt", "hf", 1, "flat")
    table = tmp_path / "t.safetensors"
    assert main(["convert", "--released", str(tmp_path / "ckpt"), str(table), "--to", "fp8", "--no-progress"]) == 0
    assert main(["inspect", str(table), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "condmem table file" and report["format"] == "fp8"
    assert all(layer["rows_match_primes"] for layer in report["layers"])


def test_inspect_names_what_is_missing(tmp_path, capsys):
    # Both are errors: the loaders need the config (the tensors do not record the layout) and refuse a row count
    # that is not the sum of the primes.
    write_checkpoint(tmp_path, "hf", 1, config=None)
    assert main(["inspect", str(tmp_path), "--no-progress"]) == 1
    assert "none found (pass --config)" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps(config_json("flat", engram_vocab_size=41)))
    assert main(["inspect", str(tmp_path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "sum of its primes" in out and "<- ERROR" in out


# ------------------------------------------------------------------------------------- inspect validates
def _broken(tmp_path, change):
    tensors, _ = make_tensors("original")
    change(tensors, tensor_names(2, "original"), tensor_names(5, "original"))
    write_checkpoint(tmp_path, "original", 3, "flat", tensors=tensors)


def _wkv_narrow(t, a, b):
    t[a["wkv"]] = t[a["wkv"]][:, :200]  # [144, 200] instead of [144, 256]; still divides into its scales


def _no_wkv_scale(t, a, b):
    del t[b["wkv_scale"]]


def _q_wrong(t, a, b):
    t[b["q_weight"]] = t[b["q_weight"]][:, :40]  # [2, 40] instead of [2, 48]


def _q_first_wrong(t, a, b):
    t[a["q_weight"]] = t[a["q_weight"]][:1]  # [1, 48]: the first layer's q_weight gives the backbone dims


BROKEN = [
    # id, change, tensor, text that must appear (expected and got)
    ("wkv [144, 200]", _wkv_narrow, "layers.2.engram.wkv.weight", r"is \[144, 200\].*must be \[144, 256\]"),
    ("missing wkv scale", _no_wkv_scale, "layers.5.engram.wkv.scale", "not found"),
    ("q_weight [2, 40]", _q_wrong, "layers.5.engram.q_weight", r"is \[2, 40\].*must be \[2, 48\]"),
    (
        "first q_weight [1, 48]",
        _q_first_wrong,
        "layers.2.engram.q_weight",
        r"says hc_mult = 2 .*is \[1, 48\].*hc_mult = 1",
    ),
]


@pytest.mark.parametrize("case,change,tensor,text", BROKEN, ids=[b[0] for b in BROKEN])
def test_inspect_exits_nonzero_naming_the_tensor_like_the_loader(tmp_path, capsys, case, change, tensor, text):
    _broken(tmp_path, change)
    assert main(["inspect", str(tmp_path), "--no-progress"]) == 1
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert any(tensor in line and re.search(text, line) for line in out.splitlines() if "error:" in line), out
    # The loader refuses the same checkpoint with the same message.
    layer = int(tensor.split(".")[1])
    with pytest.raises(ValueError) as info:
        Engram.from_released(tmp_path, layer)
    assert str(info.value) in out
    assert main(["inspect", str(tmp_path), "--no-progress", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and any(p["tensor"] == tensor for p in report["errors"])
