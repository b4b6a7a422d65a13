"""Write a synthetic DeepSeek-V4.1 checkpoint of any size, laid out as released, streaming.

For measurements that need a checkpoint of many GiB (bounded-memory conversion, loading a
full-geometry layer into page-locked memory): V4.1 Engram geometry (4-gram, 8 heads,
head_dim 256, fp8 rows + e8m0 scales per 32, block-FP8 ``wkv`` with 128 x 128 blocks,
bf16 ``q_weight`` / ``k_weight``), per-head table size chosen so the tables hold the
requested bytes. Tensor names in either dialect, one file or shards + index, and a
``config.json``. Random bytes (NaN encodings avoided), written chunk by chunk through
`StreamingWriter`: memory stays one chunk. On a GPU the bytes are drawn there (fast);
on a CPU one random pool is varied per chunk.

The backbone dims (hidden 4096, hc_mult 4, eps 1e-6) are synthetic: nothing here claims
they are V4.1's.

    python benchmarks/released_synth.py DIR --table-gib 8 --layers 1 14 --shards 3
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from condmem import EngramConfig, EngramLayout
from condmem.tables.released import TensorNames
from condmem.tables.safetensors_io import StreamingWriter

ROW_BYTES = 256 + 8
HIDDEN, HC, EPS, BLOCK = 4096, 4, 1e-6, 128


def synthetic_config(table_gib: float, layer_ids: list[int]) -> EngramConfig:
    """V4.1 Engram geometry whose layers hold about `table_gib` GiB of fp8 rows in all."""
    per_head = max(2, math.ceil(table_gib * 2**30 / ROW_BYTES / 24 / len(layer_ids)))
    return EngramConfig.deepseek_v41_flash().replace(
        layer_ids=layer_ids, table_size=per_head, num_embeddings=None, hidden_size=HIDDEN, hc_mult=HC, rms_norm_eps=EPS
    )


class RandomBytes:
    """Chunks of random fp8-safe bytes (no e4m3 NaN encodings), drawn on `device`."""

    def __init__(self, device: str, seed: int = 0):
        self.device = torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)
        self.count = 0
        if self.device.type == "cpu":
            self.pool = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=self.gen)

    def fp8(self, n: int) -> torch.Tensor:
        if self.device.type == "cpu":
            self.count += 1
            reps = -(-n // self.pool.numel())
            b = (self.pool.repeat(reps)[:n] ^ ((self.count * 37) & 0xFF)).to(torch.uint8)
        else:
            b = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device, generator=self.gen)
        b = torch.where((b & 0x7F) == 0x7F, b ^ 1, b)
        return b.cpu()

    def exponents(self, n: int, lo: int = 118, hi: int = 134) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), dtype=torch.uint8, device=self.device, generator=self.gen).cpu()


def names(layer_id: int, dialect: str) -> dict[str, str]:
    """The released checkpoint's tensor names of one layer (the reader's own naming, `TensorNames`)."""
    return TensorNames(dialect, "" if dialect == "original" else "model.").layer(layer_id)


def write_synthetic_checkpoint(
    root: str | Path,
    table_gib: float,
    layer_ids: list[int],
    shards: int = 1,
    dialect: str = "original",
    device: str = "cpu",
    chunk_rows: int = 1 << 20,
) -> dict:
    """Write the checkpoint into folder `root`; returns {config, files, bytes}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_config(table_gib, layer_ids)
    layout = EngramLayout(cfg)
    d = cfg.head_dim
    wkv_shape = ((HC + 1) * HIDDEN, cfg.engram_dim)
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for layer in layout.layers:
        n = names(layer.layer_id, dialect)
        specs[n["embed"]] = (torch.float8_e4m3fn, (layer.num_embeddings, d))
        specs[n["embed_scale"]] = (e8m0, (layer.num_embeddings, d // 32))
        specs[n["wkv"]] = (torch.float8_e4m3fn, wkv_shape)
        specs[n["wkv_scale"]] = (e8m0, (wkv_shape[0] // BLOCK, wkv_shape[1] // BLOCK))
        specs[n["q_weight"]] = (torch.bfloat16, (HC, HIDDEN))
        specs[n["k_weight"]] = (torch.bfloat16, (HC, HIDDEN))
    # Shards: the tables spread over the files (largest first), the small tensors with them.
    files = [
        f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors" for i in range(shards)
    ]
    order = sorted(specs, key=lambda k: -math.prod(specs[k][1]))
    load = [0] * shards
    placement = {}
    for name in order:
        i = load.index(min(load))
        placement[name] = i
        load[i] += math.prod(specs[name][1])
    rng = RandomBytes(device)
    for i, file in enumerate(files):
        mine = {k: v for k, v in specs.items() if placement[k] == i}
        with StreamingWriter(root / file, mine, {"format": "pt"}) as w:
            for name, (dtype, shape) in mine.items():
                rows = shape[0]
                width = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
                step = max(1, chunk_rows * 264 // max(width, 1))
                for s in range(0, rows, step):
                    k = min(rows, s + step) - s
                    if dtype == torch.bfloat16:
                        chunk = (1 + 0.1 * torch.randn(k * width // 2)).bfloat16()
                    elif "scale" in name:
                        chunk = rng.exponents(k * width, *((112, 122) if "wkv" in name else (118, 134)))
                    else:
                        chunk = rng.fp8(k * width)
                    w.write(name, chunk)
    if shards > 1:
        index = {"metadata": {}, "weight_map": {k: files[i] for k, i in placement.items()}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"architectures": ["DeepseekV4ForCausalLM"], **cfg.to_dict("v4")}
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return {"config": config, "files": files, "bytes": sum((root / f).stat().st_size for f in files)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root")
    p.add_argument("--table-gib", type=float, required=True)
    p.add_argument("--layers", type=int, nargs="+", default=[1])
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dialect", choices=["original", "hf"], default="original")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    info = write_synthetic_checkpoint(args.root, args.table_gib, args.layers, args.shards, args.dialect, args.device)
    print(json.dumps({"files": info["files"], "gib": info["bytes"] / 2**30}))


if __name__ == "__main__":
    main()
