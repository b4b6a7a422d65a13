"""Released DeepSeek-V4.1 checkpoints, both naming dialects, one file or shards: tables, wkv, forward, errors.

Every check compares with an independent reading of the bytes written (`released_fixtures`):
table rows and wkv exactly (`torch.equal`), the module's forward against an fp64
recomputation from the raw tensors within a stated tolerance.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from condmem import ConfigError, Engram, EngramLayout, NgramHasher
from condmem.cli import main
from condmem.serving import EngramMemory
from condmem.tables.released import ReleasedCheckpoint, ReleasedCheckpointError, load_released_tables
from condmem.tables.table_file import TableMismatchError
from helpers import assert_close
from released_fixtures import (
    EPS,
    HC,
    HIDDEN,
    WKV_BLOCK,
    block_dequant_f64,
    config_json,
    engram_config,
    make_tensors,
    rows_f64,
    tensor_names,
    write_checkpoint,
)

LAYOUTS = [("original", 1, "flat"), ("original", 3, "nested"), ("hf", 1, "nested"), ("hf", 3, "flat"), ("hf", 3, "key")]


def _hasher():
    return NgramHasher(EngramLayout(engram_config()))


def _open(path, style):
    return ReleasedCheckpoint(path, config_key="language" if style == "key" else None)


@pytest.mark.parametrize("dialect,shards,style", LAYOUTS, ids=[f"{d}-{s}shard-{c}" for d, s, c in LAYOUTS])
def test_layout_detected_and_tables_served_exactly(tmp_path, dialect, shards, style):
    truth = write_checkpoint(tmp_path, dialect, shards, style, scale_dtype="e8m0" if shards == 1 else "uint8")
    ckpt = _open(tmp_path, style)
    assert ckpt.names.dialect == dialect and ckpt.names.prefix == ("" if dialect == "original" else "model.")
    assert ckpt.layer_ids == [2, 5] and len(ckpt.files) == shards
    assert ckpt.module_config().hidden_size == HIDDEN and ckpt.module_config().rms_norm_eps == EPS
    hasher = _hasher()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 13), generator=gen)
    for tier in ("host", "disk"):
        memory = EngramMemory.from_released(ckpt, hasher, tier, host_alloc="pageable", progress=False)
        prepared = memory.prepare(ids)
        for lid in (2, 5):
            t = truth[lid]
            expect = rows_f64(t["embed"], t["embed_exponents"])[prepared.row_ids(lid)].to(torch.bfloat16)
            assert torch.equal(prepared.rows(lid), expect), (tier, lid)
        memory.close()


@pytest.mark.parametrize("scale_dtype", ["e8m0", "uint8", "float32"])
def test_table_scales_in_every_dtype_give_the_same_bytes(tmp_path, scale_dtype):
    truth = write_checkpoint(tmp_path, "hf", 1, "flat", scale_dtype=scale_dtype)
    tables = ReleasedCheckpoint(tmp_path).tables()
    for lid, t in truth.items():
        assert torch.equal(tables[lid].weight.view(torch.uint8), t["embed"].view(torch.uint8))
        assert torch.equal(tables[lid].scales, t["embed_exponents"])


@pytest.mark.parametrize("wkv_scale_dtype", ["e8m0", "uint8", "float32"])
def test_wkv_equals_an_independent_block_dequantization(tmp_path, wkv_scale_dtype):
    truth = write_checkpoint(tmp_path, "original", 3, "flat", wkv_scale_dtype=wkv_scale_dtype)
    ckpt = ReleasedCheckpoint(tmp_path)
    for lid, t in truth.items():
        _, _, block = ckpt.wkv_fp8(lid)
        assert block == WKV_BLOCK
        ref = block_dequant_f64(t["wkv"], t["wkv_scale"])
        # fp8 (4 significant bits) x a float32 scale is exact in float64; rounding once to float32 is
        # what a float32 multiply does, so the two agree bit for bit.
        assert torch.equal(ckpt.wkv(lid, torch.float32), ref.float())
        assert torch.equal(ckpt.wkv(lid, torch.bfloat16), ref.float().bfloat16())
        module = Engram.from_released(ckpt, lid, dtype=torch.float32)
        assert torch.equal(module.wkv.weight, ref.float())
        assert torch.equal(module.q_weight, t["q_weight"].float()) and torch.equal(
            module.k_weight, t["k_weight"].float()
        )


def _forward_f64(t: dict, rows_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The Engram layer recomputed in float64 from the raw tensors."""
    e = rows_f64(t["embed"], t["embed_exponents"])[rows_ids].flatten(-2)  # [B, T, n_cols*d]
    kv = e @ block_dequant_f64(t["wkv"], t["wkv_scale"]).T  # [B, T, (hc+1)*D]
    h = hidden.double()
    keys, value = kv[..., : HC * HIDDEN].unflatten(-1, (HC, HIDDEN)), kv[..., HC * HIDDEN :]

    def norm(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()

    g = (norm(h, t["q_weight"]) * norm(keys, t["k_weight"])).sum(-1) / math.sqrt(HIDDEN)
    g = torch.sign(g) * torch.sqrt(g.abs().clamp_min(1e-6))
    return torch.sigmoid(g)[..., None] * value[..., None, :]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dialect", ["original", "hf"])
def test_forward_equals_an_fp64_recomputation(tmp_path, dtype, rtol, dialect):
    # Tolerance: max |got - ref| <= rtol * max |ref| (fp32: accumulation order of a 256-long dot
    # product; bf16: bf16 rows, wkv output and result, each rounded to 8 significant bits).
    truth = write_checkpoint(tmp_path, dialect, 3, "nested")
    hasher = _hasher()
    memory = EngramMemory.from_released(tmp_path, hasher, "host", host_alloc="pageable", progress=False)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (2, 9), generator=gen)
    hidden = torch.randn(2, 9, HC, HIDDEN, generator=gen)
    prepared = memory.prepare(ids)
    for lid in (2, 5):
        module = Engram.from_released(tmp_path, lid, dtype=dtype)
        assert module.table.weight.device.type == "meta"
        got = module(hidden.to(dtype), prepared.row_ids(lid), rows=prepared.rows(lid))
        ref = _forward_f64(truth[lid], prepared.row_ids(lid), hidden.to(dtype))
        assert_close(f"forward {dialect} {dtype} layer {lid}", ref, got, atol=rtol * ref.abs().max().item())
        if dtype == torch.float32:
            fp8 = Engram.from_released(tmp_path, lid, dtype=dtype, keep_fp8=True)
            assert fp8.wkv.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(fp8(hidden, prepared.row_ids(lid), rows=prepared.rows(lid)), got)
            loaded = Engram.from_released(tmp_path, lid, dtype=dtype, load_table=True)
            assert torch.equal(loaded(hidden, prepared.row_ids(lid)), got)
    memory.close()


def test_a_single_file_path_and_backbone_taken_from_tensors(tmp_path):
    write_checkpoint(tmp_path, "original", 1, config_json("flat", drop=("hidden_size", "hc_mult")))
    ckpt = ReleasedCheckpoint(tmp_path / "model.safetensors")  # config.json found beside the file
    cfg = ckpt.module_config()
    assert (cfg.hidden_size, cfg.hc_mult) == (HIDDEN, HC)


def test_load_released_tables_keeps_name_overrides(tmp_path):
    truth = write_checkpoint(tmp_path, "hf", 3, "flat")
    layout = EngramLayout(engram_config())
    t = load_released_tables(
        tmp_path,
        layout,
        "model.layers.{layer_id}.engram.embed.weight",
        "model.layers.{layer_id}.engram.embed.weight_scale_inv",
    )
    assert torch.equal(t[5].scales, truth[5]["embed_exponents"])
    with pytest.raises(ReleasedCheckpointError, match=r"tensor nope\.2 not found"):
        load_released_tables(tmp_path, layout, "nope.{layer_id}")


# ---------------------------------------------------------------------------------------------- malformed
def _mutate(tmp_path, change, shards=3, config="flat", dialect="original"):
    tensors, _ = make_tensors(dialect)
    change(tensors, tensor_names(2, dialect))
    write_checkpoint(tmp_path, dialect, shards, config, tensors=tensors)


def _file_of(tmp_path, name):
    index = tmp_path / "model.safetensors.index.json"
    return json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"


def _drop(role):
    return lambda t, n: t.pop(n[role])


def _set(role, fn):
    def change(t, n):
        t[n[role]] = fn(t[n[role]])

    return change


MALFORMED = [
    # id, tensor role, change, what to load, error type, text that must appear besides the tensor and file
    ("missing q_weight", "q_weight", _drop("q_weight"), "module", ReleasedCheckpointError, "not found"),
    ("missing table scales", "embed_scale", _drop("embed_scale"), "tables", ReleasedCheckpointError, "not found"),
    ("missing wkv", "wkv", _drop("wkv"), "module", ReleasedCheckpointError, "not found"),
    (
        "k_weight wrong shape",
        "k_weight",
        _set("k_weight", lambda x: x[:, :-1]),
        "module",
        ReleasedCheckpointError,
        r"\[2, 47\]; k_weight",
    ),
    (
        "table scales wrong shape",
        "embed_scale",
        _set("embed_scale", lambda x: x[:, :1]),
        "tables",
        ReleasedCheckpointError,
        r"must be \[\d+, 2\]",
    ),
    (
        "table rows wrong width",
        "embed",
        _set("embed", lambda x: x[:, :32]),
        "tables",
        ReleasedCheckpointError,
        "head_dim=64",
    ),
    ("wkv wrong shape", "wkv", _set("wkv", lambda x: x[:-16]), "module", ReleasedCheckpointError, r"\(hc_mult\+1\)"),
    (
        "indivisible block",
        "wkv_scale",
        _set("wkv_scale", lambda x: x[:5]),
        "module",
        ReleasedCheckpointError,
        "does not divide into the scale grid",
    ),
    (
        "table rows bf16",
        "embed",
        _set("embed", lambda x: x.float().bfloat16()),
        "tables",
        ReleasedCheckpointError,
        "must be float8_e4m3fn",
    ),
    (
        "table scales fp16",
        "embed_scale",
        _set("embed_scale", lambda x: x.view(torch.uint8).half()),
        "tables",
        ReleasedCheckpointError,
        "float8_e8m0fnu or uint8 or float32",
    ),
    (
        "wkv bf16",
        "wkv",
        _set("wkv", lambda x: x.float().bfloat16()),
        "module",
        ReleasedCheckpointError,
        "must be float8_e4m3fn",
    ),
    (
        "table scale not a power of two",
        "embed_scale",
        _set("embed_scale", lambda x: torch.full(x.shape, 0.3)),
        "tables",
        ReleasedCheckpointError,
        "not a power of two",
    ),
    ("rows != primes", "embed", _set("embed", lambda x: x[:-1]), "tables", TableMismatchError, "sum of its primes"),
]


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("case,role,change,call,error,text", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_checkpoints_name_the_tensor_and_file(
    tmp_path, capsys, shards, case, role, change, call, error, text
):
    _mutate(tmp_path, change, shards)
    name = tensor_names(2, "original")[role]
    with pytest.raises(error) as info:
        if call == "module":
            Engram.from_released(tmp_path, 2)
        else:
            ReleasedCheckpoint(tmp_path).tables()
    msg = str(info.value)
    # A missing tensor has no file of its own: the message names the checkpoint instead.
    where = str(tmp_path) if text == "not found" else _file_of(tmp_path, name)
    assert name in msg and where in msg and re.search(text, msg), msg
    # condmem inspect goes through the same check: the same message, and exit status 1.
    assert main(["inspect", str(tmp_path), "--no-progress"]) == 1
    assert msg in capsys.readouterr().out


def test_config_disagreeing_with_tensors_names_both(tmp_path):
    write_checkpoint(tmp_path, "hf", 3, config_json("nested", hidden_size=64))
    with pytest.raises(ConfigError) as info:
        Engram.from_released(tmp_path, 5)
    msg = str(info.value)
    assert "hidden_size = 64" in msg and "hidden_size = 48" in msg and "model.layers.2.engram.q_weight" in msg
    assert "config.json" in msg and ".safetensors" in msg


def test_config_problems_are_named(tmp_path):
    write_checkpoint(tmp_path / "a", "original", 1, config_json("flat", drop=("rms_norm_eps",)))
    with pytest.raises(ConfigError, match="states no rms_norm_eps"):
        Engram.from_released(tmp_path / "a", 2)
    write_checkpoint(tmp_path / "b", "original", 1, config=None)
    with pytest.raises(ConfigError, match="no config.json in"):
        Engram.from_released(tmp_path / "b", 2)
    write_checkpoint(tmp_path / "c", "original", 1, config="key")  # keys under 'language', not found unasked
    with pytest.raises(ConfigError, match=r"config.json: no Engram keys found.*text_config"):
        ReleasedCheckpoint(tmp_path / "c")
    with pytest.raises(ConfigError, match="layer 3 has no Engram"):
        Engram.from_released(tmp_path / "c", 3, config_key="language")
    write_checkpoint(tmp_path / "d", "original", 1, config_json("flat", engram_vocab_size=41))
    with pytest.raises(TableMismatchError, match=r"layers\.2\.engram\.embed\.weight in .*model\.safetensors"):
        EngramMemory.from_released(
            tmp_path / "d",
            NgramHasher(EngramLayout(engram_config(table_size=41))),
            host_alloc="pageable",
            progress=False,
        )


def test_index_and_shard_problems_are_named(tmp_path):
    write_checkpoint(tmp_path, "original", 3, "flat")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "layers.2.engram.q_weight"
    right = data["weight_map"][name]
    wrong = next(f for f in set(data["weight_map"].values()) if f != right)
    data["weight_map"][name] = wrong
    index.write_text(json.dumps(data))
    with pytest.raises(ReleasedCheckpointError, match=rf"{name} is listed in .* under {wrong} but lies in {right}"):
        ReleasedCheckpoint(tmp_path)
    data["weight_map"][name] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ReleasedCheckpointError, match="missing: .*model-00009-of-00009"):
        ReleasedCheckpoint(tmp_path)


def test_mixed_or_absent_names_are_refused(tmp_path):
    tensors, _ = make_tensors("original")
    tensors["layers.2.engram.wkv.weight_scale_inv"] = tensors.pop("layers.2.engram.wkv.scale")
    write_checkpoint(tmp_path / "mixed", tensors=tensors)
    with pytest.raises(ReleasedCheckpointError, match="both '.scale' and '.weight_scale_inv'"):
        ReleasedCheckpoint(tmp_path / "mixed")
    write_checkpoint(tmp_path / "none", tensors={"model.embed_tokens.weight": torch.zeros(2, 2)})
    with pytest.raises(ReleasedCheckpointError, match="no Engram tensors"):
        ReleasedCheckpoint(tmp_path / "none")
