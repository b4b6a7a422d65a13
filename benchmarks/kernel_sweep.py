"""Launch-configuration sweep of two bandwidth-bound kernels on a GPU: the Engram gate with the
residual add fused in (at the sizes of the peer figures in `condmem.bench.gate.PEER_MS`) and
the paged decode attention at the 4B backbone's decode step (two KV-pool layouts). Every variant's output is checked
against the reference first; each is timed as a CUDA graph of 8 launches cycling over 4 input
sets (no launch overhead; inputs not repeated within L2 reach), median of 20 replays, against
the device copy bandwidth measured in the same run. Writes JSON lines to --out, prints a table.

    PYTHONPATH=src python3 benchmarks/kernel_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from condmem.bench.e2e import BACKBONES
from condmem.bench.gate import PEER_MS
from condmem.bench.harness import copy_bandwidth_gbps, graph_replay_ms, machine_info
from condmem.ops.attention import reference as attn_ref
from condmem.ops.attention import triton as attn_triton
from condmem.ops.gate import engram_gate_reference
from condmem.ops.gate.triton import gate_forward_triton


def gate_rows(bw: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = {f"c{c} w{w}": dict(chunk=c, num_warps=w)
                for c, w in ((1024, 4), (2048, 4), (4096, 4), (1024, 2), (2048, 2), (512, 2), (2048, 8))}
    for n, hc, dim in [*PEER_MS, (16384, 1, 2560)]:
        sets = [(torch.randn((n, hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen),
                 torch.randn((n, (hc + 1) * dim), device="cuda", dtype=torch.bfloat16, generator=gen)) for _ in range(4)]
        qw = 1 + 0.1 * torch.randn((hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        kw = 1 + 0.1 * torch.randn((hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        want = engram_gate_reference(*sets[0], qw, kw, residual=True).float()
        nbytes = n * (3 * hc + 1) * dim * 2
        for name, kw_ in variants.items():
            fn = (lambda h, kv, kw_=kw_: gate_forward_triton(h, kv, qw, kw, 1e-6, 1e-6, None, residual=True, **kw_))
            err = float((fn(*sets[0]).float() - want).norm() / want.norm())
            assert err < 1e-2, (name, err)
            ms = graph_replay_ms(fn, sets)
            rows.append({"kernel": "gate+residual", "shape": [n, hc, dim], "variant": name, "ms": ms, "rel_err": err,
                         "x_bound": nbytes / (bw * 1e9) * 1e3 / ms, "peer_ms": PEER_MS.get((n, hc, dim)),
                         "x_peer": PEER_MS[(n, hc, dim)] / ms if (n, hc, dim) in PEER_MS else None})
        ms = graph_replay_ms(lambda h, kv: h + gate_forward_triton(h, kv, qw, kw, 1e-6, 1e-6, None), sets)
        rows.append({"kernel": "gate+residual", "shape": [n, hc, dim], "variant": "gate, then add", "ms": ms,
                     "x_bound": nbytes / (bw * 1e9) * 1e3 / ms})
        del sets
    return rows


def attention_rows(bw: float, backbone: str = "4b", batch: int = 128, block_size: int = 16) -> list[dict]:
    rows = []
    shape = BACKBONES[backbone]
    heads, n_kv = shape["n_heads"], shape["n_kv_heads"]
    head_dim = shape["dim"] // heads
    gen = torch.Generator(device="cuda").manual_seed(1)
    max_len = 1152
    blocks_per_seq = max_len // block_size
    lengths = torch.randint(100, 1101, (batch,), device="cuda", generator=gen).to(torch.int32)
    n_blocks = batch * blocks_per_seq
    # Two pool layouts of the same values: "nhd" [blocks, block_size, kv, hd] (positions outer:
    # one head's key is 2*hd contiguous bytes) and "hnd" [blocks, kv, block_size, hd] seen through
    # a permuted view (one head's block of keys is block_size*hd contiguous elements). The kernel
    # reads through strides, so both run the same code.
    sets = {"nhd": [], "hnd": []}
    for _ in range(4):
        k = torch.randn((n_blocks, block_size, n_kv, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        table = torch.randperm(n_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
        q = torch.randn((batch, heads, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        sets["nhd"].append((q, k, v, table))
        hnd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
        sets["hnd"].append((q, *hnd, table))
    want = attn_ref.paged_decode_attention_ref(*sets["nhd"][0], lengths, None).float()
    nbytes = int(lengths.sum()) * n_kv * head_dim * 2 * 2 + 2 * batch * heads * head_dim * 2
    auto = attn_triton.decode_splits(batch, n_kv, max_len, 64, torch.device("cuda"))
    for layout in ("nhd", "hnd"):
        for block_n in (16, 32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    for splits in (auto,):
                        variant = f"{layout} bn{block_n} w{warps} s{stages} splits{splits}"
                        def fn(q, k, v, t, bn=block_n, w=warps, st=stages, sp=splits):
                            return attn_triton.paged_decode_attention(q, k, v, t, lengths, None, sp, block_n=bn,
                                                                      num_warps=w, num_stages=st)
                        try:
                            err = float((fn(*sets[layout][0]).float() - want).norm() / want.norm())
                            assert err < 2e-2, err
                            ms = graph_replay_ms(fn, sets[layout])
                        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses
                            rows.append({"kernel": "decode attention", "variant": variant, "error": str(exc)[:200]})
                            continue
                        rows.append({"kernel": "decode attention", "shape": [batch, heads, n_kv, head_dim],
                                     "variant": variant, "ms": ms, "rel_err": err,
                                     "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
                                     "default": (layout, block_n, warps, stages, splits) == ("nhd", 64, 4, 2, auto)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--only", choices=["gate", "attention"], default=None)
    args = p.parse_args()
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    info = machine_info()
    rows = []
    if args.only in (None, "gate"):
        rows += gate_rows(bw)
    if args.only in (None, "attention"):
        rows += attention_rows(bw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernel_sweep.json", "w") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "d2d_gbps": bw, "machine": info}) + "\n")
    print(f"copy bandwidth {bw:.0f} GB/s")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:18s} {r['variant']:28s} error")
            continue
        print(f"{r['kernel']:18s} {str(r.get('shape')):22s} {r['variant']:28s} {r['ms']:.4f} ms  "
              f"x bound {r['x_bound']:.2f}" + (f"  x peer {r['x_peer']:.2f}" if r.get("x_peer") else "")
              + ("  (default)" if r.get("default") else ""))


if __name__ == "__main__":
    main()
