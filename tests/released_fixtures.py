"""Synthetic DeepSeek-V4.1 checkpoints at small geometry, laid out as released, and independent decoders.

`write_checkpoint` writes the Engram tensors of every layer (names, dtypes and shapes as
released, in either naming dialect), a few unrelated model tensors, one file or three
shards with ``model.safetensors.index.json``, and a ``config.json`` flat, nested under
``text_config`` or under another key. It returns the raw tensors it wrote.

`e4m3_to_f64` and `block_dequant_f64` decode fp8 bytes from the format's definition
(sign, 4 exponent bits with bias 7, 3 mantissa bits; subnormals at exponent 0; S.1111.111
is NaN), without torch's float8 conversion, so the tests check the loader against an
independent reading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from condmem import EngramConfig

GEOMETRY = dict(
    layer_ids=[2, 5], max_ngram_size=3, n_heads=2, head_dim=64, table_size=37, pad_id=2, compressed_vocab_size=50
)
HIDDEN, HC, EPS = 48, 2, 1e-5
WKV_BLOCK = (16, 32)
E8M0 = getattr(torch, "float8_e8m0fnu", None)


def engram_config(**changes) -> EngramConfig:
    """The geometry with the backbone dims the fixture checkpoints carry."""
    return EngramConfig(
        **{**GEOMETRY, "hidden_size": HIDDEN, "hc_mult": HC, "rms_norm_eps": EPS, "short_conv": False, **changes}
    )


def config_json(style: str = "flat", drop: tuple[str, ...] = (), **changes) -> dict:
    """A released-style config.json: Engram keys flat, under text_config ('nested') or under 'language' ('key')."""
    cfg = engram_config().to_dict("v4")
    cfg.update(changes)
    for k in drop:
        cfg.pop(k, None)
    cfg.update({"vocab_size": 129280, "num_hidden_layers": 6})
    if style == "flat":
        return {"architectures": ["DeepseekV4ForCausalLM"], **cfg}
    key = "text_config" if style == "nested" else "language"
    return {"architectures": ["DeepseekV4ForConditionalGeneration"], "vision_config": {"hidden_size": 32}, key: cfg}


def random_fp8(shape, gen) -> torch.Tensor:
    """Random fp8 e4m3 bytes, NaN encodings (x.1111.111) avoided."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b ^ 1, b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def _scales(e: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "e8m0":
        return e.view(E8M0)
    if dtype == "uint8":
        return e
    return torch.pow(2.0, e.double() - 127).float()  # exact powers of two


def tensor_names(layer_id: int, dialect: str) -> dict[str, str]:
    p = "" if dialect == "original" else "model."
    s = "scale" if dialect == "original" else "weight_scale_inv"
    base = f"{p}layers.{layer_id}.engram."
    return {
        "embed": base + "embed.weight",
        "embed_scale": base + f"embed.{s}",
        "wkv": base + "wkv.weight",
        "wkv_scale": base + f"wkv.{s}",
        "q_weight": base + "q_weight",
        "k_weight": base + "k_weight",
    }


def make_tensors(
    dialect: str = "original",
    scale_dtype: str = "e8m0",
    wkv_scale_dtype: str = "e8m0",
    seed: int = 0,
    table_size: int = GEOMETRY["table_size"],
) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors of a checkpoint, and {layer_id: {role: tensor}} for the tests."""
    from condmem import EngramLayout

    layout = EngramLayout(engram_config(table_size=table_size))
    gen = torch.Generator().manual_seed(seed)
    d = GEOMETRY["head_dim"]
    out, truth = {}, {}
    prefix = "" if dialect == "original" else "model."
    out[f"{prefix}embed.weight" if dialect == "original" else "model.embed_tokens.weight"] = torch.randn(
        10, HIDDEN, generator=gen
    ).bfloat16()
    for layer in layout.layers:
        lid, rows = layer.layer_id, layer.num_embeddings
        names = tensor_names(lid, dialect)
        e = torch.randint(118, 134, (rows, d // 32), generator=gen).to(torch.uint8)
        wkv_shape = ((HC + 1) * HIDDEN, layout.config.engram_dim)
        grid = (wkv_shape[0] // WKV_BLOCK[0], wkv_shape[1] // WKV_BLOCK[1])
        if wkv_scale_dtype == "float32":  # arbitrary positive floats, as block-FP8 checkpoints often store them
            wkv_s = (torch.rand(grid, generator=gen) * 3e-3 + 1e-4).float()
        else:
            wkv_s = _scales(torch.randint(112, 122, grid, generator=gen).to(torch.uint8), wkv_scale_dtype)
        t = {
            "embed": random_fp8((rows, d), gen),
            "embed_scale": _scales(e, scale_dtype),
            "wkv": random_fp8(wkv_shape, gen),
            "wkv_scale": wkv_s,
            "q_weight": (1 + 0.1 * torch.randn(HC, HIDDEN, generator=gen)).bfloat16(),
            "k_weight": (1 + 0.1 * torch.randn(HC, HIDDEN, generator=gen)).bfloat16(),
        }
        truth[lid] = dict(t, embed_exponents=e)
        out.update({names[k]: v for k, v in t.items()})
        out[f"{prefix}layers.{lid}.attn.wq.weight"] = torch.randn(8, HIDDEN, generator=gen).bfloat16()
    return out, truth


def write_checkpoint(
    root: Path,
    dialect: str = "original",
    shards: int = 1,
    config: str | dict | None = "flat",
    tensors: dict[str, torch.Tensor] | None = None,
    **make,
) -> dict:
    """Write a checkpoint into folder `root`; returns the truth of `make_tensors` (or {} when `tensors` given)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    truth = {}
    if tensors is None:
        tensors, truth = make_tensors(dialect, **make)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(root / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k].contiguous() for k in names[i::shards]}
            save_file(part, str(root / file))
            weight_map.update({k: file for k in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        data = config_json(config) if isinstance(config, str) else config
        (root / "config.json").write_text(json.dumps(data))
    return truth


def _e4m3_table() -> torch.Tensor:
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, mant = (b >> 3) & 0xF, b & 0x7
        if exp == 15 and mant == 7:
            vals.append(float("nan"))
        elif exp == 0:
            vals.append(sign * mant / 8 * 2.0**-6)
        else:
            vals.append(sign * (1 + mant / 8) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3 = _e4m3_table()


def e4m3_to_f64(q: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 tensor -> float64 decoded from its bytes."""
    return E4M3[q.view(torch.uint8).long()]


def rows_f64(q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """Table rows [R, D] in float64: fp8 value x 2**(e-127) per block of 32."""
    scale = torch.pow(2.0, exponents.double() - 127).repeat_interleave(32, dim=-1)
    return e4m3_to_f64(q) * scale


def block_dequant_f64(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Block-FP8 [O, I] in float64, one scale per block, by explicit loops over the blocks."""
    s = scales.view(torch.uint8) if E8M0 is not None and scales.dtype == E8M0 else scales
    s = torch.pow(2.0, s.double() - 127) if s.dtype == torch.uint8 else s.double()
    w = e4m3_to_f64(q)
    bo, bi = q.shape[0] // s.shape[0], q.shape[1] // s.shape[1]
    out = torch.empty_like(w)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (
                w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] * s[i, j]
            )
    return out
