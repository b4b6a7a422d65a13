"""Streaming conversion between row formats, the released-checkpoint loader, `condmem convert`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from condmem import EngramConfig, EngramLayout
from condmem.cli import main
from condmem.tables.convert import convert_tables
from condmem.fp8 import dequantize_fp8_e8m0, quantize_fp8_e8m0
from condmem.tables.released import load_released_tables
from condmem.tables.table_file import EngramTableFile, LayerRows, TableFileError, TableMismatchError


def _layout():
    return EngramLayout(
        EngramConfig(
            layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64, table_size=41, compressed_vocab_size=60
        )
    )


def _bf16_tables(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        l.layer_id: LayerRows("bf16", (torch.randn(l.num_embeddings, 64, generator=gen) * 3).bfloat16())
        for l in layout.layers
    }


def test_bf16_to_fp8_to_interleaved_and_back_is_exact(tmp_path):
    layout = _layout()
    bf16 = _bf16_tables(layout)
    fp8_path = convert_tables(bf16, layout, tmp_path / "fp8.safetensors", "fp8", "tok", chunk_rows=7, progress=False)
    fp8 = EngramTableFile(fp8_path, layout=layout, tokenizer_fingerprint="tok")
    for lid, t in bf16.items():
        q, s = quantize_fp8_e8m0(t.weight.float())  # chunking must not change a byte
        assert torch.equal(fp8.layer(lid).weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(fp8.layer(lid).scales, s)
    inter = EngramTableFile(
        convert_tables(
            fp8.tables(), layout, tmp_path / "i.safetensors", "fp8_interleaved", "tok", chunk_rows=5, progress=False
        )
    )
    row = inter.layer(4).weight
    assert row.shape[1] == 66
    assert torch.equal(row[:, :64], fp8.layer(4).weight.view(torch.uint8)) and torch.equal(
        row[:, 64:], fp8.layer(4).scales
    )
    back = EngramTableFile(convert_tables(inter.tables(), layout, tmp_path / "f.safetensors", "fp8", progress=False))
    assert torch.equal(back.layer(1).weight.view(torch.uint8), fp8.layer(1).weight.view(torch.uint8))
    deq = EngramTableFile(convert_tables(inter.tables(), layout, tmp_path / "b.safetensors", "bf16", progress=False))
    expect = dequantize_fp8_e8m0(fp8.layer(1).weight.contiguous(), fp8.layer(1).scales.contiguous())
    assert torch.equal(deq.layer(1).weight, expect)
    assert inter.layout().fingerprint == layout.fingerprint


def _released_checkpoint(tmp_path, layout, prefix="model."):
    """A fake two-shard V4.1-style checkpoint with an index file."""
    gen = torch.Generator().manual_seed(7)
    shards, weight_map, truth = [{}, {}], {}, {}
    for i, layer in enumerate(layout.layers):
        q, s = quantize_fp8_e8m0(torch.randn(layer.num_embeddings, 64, generator=gen))
        w = f"{prefix}layers.{layer.layer_id}.engram.embed.weight"
        shards[i][w] = q
        shards[i][w + "_scale_inv"] = s
        shards[i][f"{prefix}layers.{layer.layer_id}.attn.wq.weight"] = torch.zeros(2, 2)
        truth[layer.layer_id] = (q, s)
    for i, shard in enumerate(shards):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(shard, str(tmp_path / name))
        weight_map.update({k: name for k in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return truth


def test_released_loader_maps_fp8_tables(tmp_path):
    layout = _layout()
    truth = _released_checkpoint(tmp_path, layout)
    tables = load_released_tables(tmp_path, layout)
    for lid, (q, s) in truth.items():
        assert torch.equal(tables[lid].weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(tables[lid].scales, s)
    # Explicit templates work too.
    t = load_released_tables(
        tmp_path,
        layout,
        "model.layers.{layer_id}.engram.embed.weight",
        "model.layers.{layer_id}.engram.embed.weight_scale_inv",
    )
    assert torch.equal(t[4].scales, truth[4][1])


def test_released_loader_refuses_other_geometry(tmp_path):
    layout = _layout()
    _released_checkpoint(tmp_path, layout)
    other = EngramLayout(layout.config.replace(table_size=43))
    with pytest.raises(TableMismatchError, match="sum of its primes"):
        load_released_tables(tmp_path, other)
    with pytest.raises(TableFileError, match=r"tensor model\.layers\.5\.engram\.embed\.weight not found"):
        load_released_tables(tmp_path, EngramLayout(layout.config.replace(layer_ids=[1, 5])))
    with pytest.raises(TableFileError, match="not found"):
        load_released_tables(tmp_path, layout, "nope.{layer_id}", "nope")


def test_convert_cli_released_and_table(tmp_path, capsys):
    layout = _layout()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    truth = _released_checkpoint(ckpt, layout)
    cfg = tmp_path / "config.json"
    layout.config.save(cfg, dialect="v4")
    out = tmp_path / "t.safetensors"
    assert (
        main(
            [
                "convert",
                str(ckpt),
                str(out),
                "--released",
                "--config",
                str(cfg),
                "--to",
                "fp8_interleaved",
                "--no-progress",
                "--chunk-rows",
                "10",
            ]
        )
        == 0
    )
    f = EngramTableFile(out, layout=layout)
    assert torch.equal(f.layer(1).weight[:, :64], truth[1][0].view(torch.uint8))
    assert main(["convert", str(out), str(tmp_path / "b.safetensors"), "--to", "bf16", "--no-progress"]) == 0
    assert EngramTableFile(tmp_path / "b.safetensors").format == "bf16"
    assert main(["convert", str(ckpt), str(tmp_path / "x"), "--released", "--to", "fp8"]) == 1
    assert "no config.json in the checkpoint folder" in capsys.readouterr().err
    layout.config.save(ckpt / "config.json", dialect="v4")  # read from the folder when --config is not given
    assert (
        main(["convert", "--released", str(ckpt), str(tmp_path / "z.safetensors"), "--to", "fp8", "--no-progress"]) == 0
    )
    assert torch.equal(EngramTableFile(tmp_path / "z.safetensors", layout=layout).layer(4).scales, truth[4][1])
    other = tmp_path / "other.json"
    layout.config.replace(seed=5).save(other)
    assert main(["convert", str(out), str(tmp_path / "y"), "--to", "fp8", "--config", str(other)]) == 1
    assert "another Engram layout" in capsys.readouterr().err
