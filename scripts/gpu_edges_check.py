"""On a CUDA machine: the parts of issue 41's fixes a CPU cannot show. JSON to $OUT, a table printed last.

1. Sparse gradient norm on CUDA (what a plain HF ``Trainer`` with ``engram_optimizer`` clips
   with): after `enable_sparse_grad_norm`, ``torch.nn.utils.clip_grad_norm_`` (foreach and
   per-tensor) over an ``Embedding(sparse=True)`` + ``Linear`` on the GPU gives the dense
   reference's norm and clips the sparse gradient in place, as condmem's `clip_grad_norm_`
   does; both timed.
2. `memory_table` (what ``save_pretrained`` writes for tables offloaded with ``offload_tables``)
   read back from an HBM and a page-locked host `EngramMemory`: equal to the bf16 rows placed
   (``torch.equal``), and its time for a 512 MiB table.

Usage: ``PYTHONPATH=src python3 scripts/gpu_edges_check.py`` (torch, numpy only; < 1 minute).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.integrations.transformers.optim import enable_sparse_grad_norm
from condmem.integrations.transformers.saving import memory_table
from condmem.serving.memory import EngramMemory
from condmem.train.optim import clip_grad_norm_


def _timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def sparse_norm(device: str) -> list[dict]:
    registered = enable_sparse_grad_norm()
    rows = []
    for foreach in (None, False):
        gen = torch.Generator(device="cpu").manual_seed(0)
        emb = torch.nn.Embedding(1 << 20, 64, sparse=True).to(device)
        lin = torch.nn.Linear(64, 1).to(device)
        ids = torch.randint(0, 1 << 20, (4096,), generator=gen).to(device)
        ids[::7] = ids[0]  # repeated rows: an uncoalesced gradient
        lin(emb(ids)).sum().backward()
        params = [emb.weight, lin.weight, lin.bias]
        dense = [emb.weight.grad.to_dense(), lin.weight.grad.clone(), lin.bias.grad.clone()]
        ref = torch.cat([g.flatten().double() for g in dense]).norm()
        saved = [p.grad.clone() for p in params]
        ours = float(clip_grad_norm_(params, 0.0))  # condmem's: measure only
        got = float(torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=foreach))
        scale = 1e-3 / (float(ref) + 1e-6)
        clipped_err = float((emb.weight.grad.to_dense().double() - dense[0].double() * scale).abs().max())
        for p, g in zip(params, saved):
            p.grad = g

        def torch_clip():
            torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=foreach)

        def ours_clip():
            clip_grad_norm_(params, 0.0)

        rows.append(
            {
                "check": "sparse grad norm",
                "foreach": str(foreach),
                "registered": registered,
                "reference": float(ref),
                "torch_clip_grad_norm": got,
                "condmem_clip_grad_norm": ours,
                "rel_err": abs(got - float(ref)) / float(ref),
                "clipped_max_err": clipped_err,
                "ms_torch": _timed(torch_clip),
                "ms_condmem": _timed(ours_clip),
            }
        )
    return rows


def offloaded_tables(device: str) -> list[dict]:
    config = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=4,
        head_dim=128,
        table_size=262_139,
        pad_id=2,
        compressed_vocab_size=1000,
    )
    hasher = NgramHasher(EngramLayout(config))
    rows_n = hasher.layout.layer(1).num_embeddings
    weight = torch.randn(rows_n, config.head_dim, generator=torch.Generator().manual_seed(1))
    out = []
    for tier in ("hbm", "host"):
        memory = EngramMemory.from_weights(hasher, {1: weight}, tier=tier, device=device, progress=False)
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            table = memory_table(memory, 1, torch.float32)
            seconds = time.perf_counter() - start
            out.append(
                {
                    "check": "memory_table",
                    "tier": tier,
                    "rows": rows_n,
                    "gib_bf16": rows_n * config.head_dim * 2 / 2**30,
                    "equal": bool(torch.equal(table, weight.bfloat16().float())),
                    "seconds": seconds,
                }
            )
        finally:
            memory.close()
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "."))
    results = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "rows": sparse_norm("cuda") + offloaded_tables("cuda"),
    }
    (out / "edges_check.json").write_text(json.dumps(results, indent=1) + "\n")
    ok = True
    print(f"torch {results['torch']} on {results['gpu']}")
    for r in results["rows"]:
        if r["check"] == "sparse grad norm":
            good = (
                r["rel_err"] < 1e-5
                and abs(r["condmem_clip_grad_norm"] - r["reference"]) / r["reference"] < 1e-5
                and r["clipped_max_err"] < 1e-6
            )
            print(
                f"sparse norm foreach={r['foreach']:<5} registered={r['registered']!s:<5} rel err "
                f"{r['rel_err']:.1e}, clipped err {r['clipped_max_err']:.1e}; torch {r['ms_torch']:.3f} ms, "
                f"condmem {r['ms_condmem']:.3f} ms  {'ok' if good else 'FAIL'}"
            )
        else:
            good = r["equal"]
            print(
                f"memory_table {r['tier']:<4} {r['rows']:,} rows ({r['gib_bf16']:.2f} GiB bf16): equal "
                f"{r['equal']}, {r['seconds']:.2f} s  {'ok' if good else 'FAIL'}"
            )
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
