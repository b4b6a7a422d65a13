"""Launch-configuration sweep of two bandwidth-bound kernels on a GPU: the Engram gate with the
residual add fused in (at `condmem bench gate`'s sizes, beside the peer figures of its `PEER_FILE`) and
the paged decode attention at the 4B backbone's decode step (block, warps, stages, splits; two pool
layouts), beside two controls: a kernel that reads the same keys and values through the same
addressing with no attention arithmetic, and a contiguous read of as many bytes. Every
variant's output is checked against the reference first; each is timed as a CUDA graph of 8
launches cycling over 4 input sets (no launch overhead; inputs not repeated within L2 reach),
median of 20 replays, against the device copy bandwidth measured in the same run. Writes JSON
lines to --out, prints a table.

    PYTHONPATH=src python3 benchmarks/kernel_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from condmem.bench.e2e import BACKBONES
from condmem.bench.gate import peer_figures
from condmem.bench.harness import copy_bandwidth_gbps, graph_replay_ms, machine_info
from condmem.ops.attention import reference as attn_ref
from condmem.ops.attention import triton as attn_triton
from condmem.ops.gate import engram_gate_reference
from condmem.ops.gate.triton import default_launch, gate_forward_triton


@triton.jit
def _gate_traffic_control(
    h_ptr, kv_ptr, out_ptr, D, h_stride, kv_stride, HC: tl.constexpr, CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr
):
    """The gate's memory traffic with no dependency between reads and writes: out = h + k + v."""
    pid = tl.program_id(0)
    t = (pid // HC).to(tl.int64)
    m = pid % HC
    for i in tl.static_range(N_CHUNKS):
        d = i * CHUNK + tl.arange(0, CHUNK)
        dm = d < D
        h = tl.load(h_ptr + t * h_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        k = tl.load(kv_ptr + t * kv_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        v = tl.load(kv_ptr + t * kv_stride + HC * D + d, mask=dm, other=0).to(tl.float32)
        tl.store(out_ptr + t * h_stride + m * D + d, (h + k + v).to(out_ptr.dtype.element_ty), mask=dm)


def gate_rows(bw: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = {
        f"c{c} w{w}": dict(chunk=c, num_warps=w)
        for c, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (2048, 8))
    }
    peers = peer_figures(torch.cuda.get_device_name())
    for n, hc, dim in ((8192, 4, 4096), (512, 4, 4096), (8192, 4, 7168), (16384, 1, 2560)):
        sets = [
            (
                torch.randn((n, hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn((n, (hc + 1) * dim), device="cuda", dtype=torch.bfloat16, generator=gen),
            )
            for _ in range(4)
        ]
        qw = 1 + 0.1 * torch.randn((hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        kw = 1 + 0.1 * torch.randn((hc, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        want = engram_gate_reference(*sets[0], qw, kw, residual=True).float()
        nbytes = n * (3 * hc + 1) * dim * 2
        for name, kw_ in variants.items():

            def fn(h, kv, kw_=kw_):
                return gate_forward_triton(h, kv, qw, kw, 1e-6, 1e-6, None, residual=True, **kw_)

            err = float((fn(*sets[0]).float() - want).norm() / want.norm())
            assert err < 1e-2, (name, err)
            ms = graph_replay_ms(fn, sets)
            rows.append(
                {
                    "kernel": "gate+residual",
                    "shape": [n, hc, dim],
                    "variant": name,
                    "ms": ms,
                    "rel_err": err,
                    "default": (kw_["chunk"], kw_["num_warps"]) == default_launch(dim),
                    "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
                    "peer_ms": peers.get((n, hc, dim)),
                    "x_peer": peers[(n, hc, dim)] / ms if (n, hc, dim) in peers else None,
                }
            )
        ms = graph_replay_ms(lambda h, kv: h + gate_forward_triton(h, kv, qw, kw, 1e-6, 1e-6, None), sets)
        rows.append(
            {
                "kernel": "gate+residual",
                "shape": [n, hc, dim],
                "variant": "gate, then add",
                "ms": ms,
                "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
            }
        )
        # Controls: the gate's traffic (hidden, key, value read per branch; output written) with
        # no reduction between the reads and the write, and a device copy of as many bytes.
        for chunk, warps in ((1024, 4), (2048, 4), (4096, 8)):
            out = torch.empty_like(sets[0][0])

            def ctl(h, kv, c=chunk, w=warps, out=out):
                _gate_traffic_control[(n * hc,)](
                    h,
                    kv,
                    out,
                    dim,
                    h.stride(0),
                    kv.stride(0),
                    HC=hc,
                    CHUNK=c,
                    N_CHUNKS=triton.cdiv(dim, c),
                    num_warps=w,
                )
                return out

            ms = graph_replay_ms(ctl, sets)
            rows.append(
                {
                    "kernel": "gate+residual",
                    "shape": [n, hc, dim],
                    "ms": ms,
                    "variant": f"control: same traffic, no sums c{chunk} w{warps}",
                    "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
                }
            )
        half = [
            (
                torch.empty(nbytes // 4, device="cuda", dtype=torch.bfloat16),
                torch.randn(nbytes // 4, device="cuda", dtype=torch.bfloat16, generator=gen),
            )
            for _ in range(4)
        ]
        ms = graph_replay_ms(lambda dst, src: dst.copy_(src), half)
        rows.append(
            {
                "kernel": "gate+residual",
                "shape": [n, hc, dim],
                "variant": "control: device copy, same bytes",
                "ms": ms,
                "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
            }
        )
        del half
        del sets
    return rows


@triton.jit
def _paged_read_control(
    K,
    V,
    BT,
    LENS,
    OUT,
    sk_blk,
    sk_pos,
    sk_h,
    sbt_b,
    split_len,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Reads exactly the keys and values the decode kernel reads, through the same block-table
    addressing, with no attention arithmetic: elementwise sums, one reduction at the end."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(LENS + b)
    start = s * split_len
    end = tl.minimum(start + split_len, length)
    d = tl.arange(0, DP)
    dm = d < D
    acc = tl.zeros([BLOCK_N, DP], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < end
        blk = tl.load(BT + b * sbt_b + pos // BS, mask=pm, other=0)
        off = blk * sk_blk + (pos % BS) * sk_pos + kvh * sk_h
        k = tl.load(K + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
        v = tl.load(V + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + s, tl.sum(tl.sum(acc, 1), 0))


def attention_rows(bw: float, backbone: str = "4b", batch: int = 128, block_size: int = 16) -> list[dict]:
    rows = []
    shape = BACKBONES[backbone]
    heads, n_kv = shape["n_heads"], shape["n_kv_heads"]
    head_dim = shape["dim"] // heads
    gen = torch.Generator(device="cuda").manual_seed(1)
    max_len = 2048  # the serving cache of `bench e2e`
    blocks_per_seq = max_len // block_size
    lengths = torch.randint(100, 1101, (batch,), device="cuda", generator=gen).to(torch.int32)
    n_blocks = batch * blocks_per_seq
    # Two pool layouts of the same values: "nhd" [blocks, block_size, kv, hd] and "hnd" [blocks, kv,
    # block_size, hd] (the serving pool's) seen through a permuted view; the kernel reads through
    # strides. The block table scatters each sequence's blocks over the pool.
    sets = {"nhd": [], "hnd": []}
    for _ in range(4):
        k = torch.randn((n_blocks, block_size, n_kv, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        table = torch.randperm(n_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
        q = torch.randn((batch, heads, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        sets["nhd"].append((q, k, v, table))
        sets["hnd"].append((q, *[t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)], table))
    want = attn_ref.paged_decode_attention_ref(*sets["nhd"][0], lengths, None).float()
    nbytes = int(lengths.sum()) * n_kv * head_dim * 2 * 2 + 2 * batch * heads * head_dim * 2
    auto = attn_triton.decode_splits(batch, n_kv, max_len, 64, torch.device("cuda"))
    configs = [
        (layout, bn, w, st, sp)
        for layout in ("hnd", "nhd")
        for bn in (32, 64, 128)
        for w in (1, 4)
        for st in (2, 3)
        for sp in (auto, 2 * auto)
    ]
    # Controls: the same keys and values read through the same addressing with no attention
    # arithmetic (what the access pattern allows), and the same bytes read contiguously.
    for layout in ("nhd", "hnd"):
        for block_n, warps, stages in ((64, 4, 2),):
            split_len = -(-max_len // auto)
            out = torch.empty(batch * n_kv * auto, device="cuda", dtype=torch.float32)

            def ctl(q, k, v, t, bn=block_n, w=warps, st=stages, out=out, sl=split_len):
                _paged_read_control[(batch, n_kv, auto)](
                    k,
                    v,
                    t,
                    lengths,
                    out,
                    k.stride(0),
                    k.stride(1),
                    k.stride(2),
                    t.stride(0),
                    sl,
                    D=head_dim,
                    DP=128,
                    BS=block_size,
                    BLOCK_N=bn,
                    num_warps=w,
                    num_stages=st,
                )
                return out

            ms = graph_replay_ms(ctl, sets[layout])
            rows.append(
                {
                    "kernel": "decode attention",
                    "shape": [batch, heads, n_kv, head_dim],
                    "variant": f"{layout} read-only control bn{block_n} w{warps} s{stages}",
                    "ms": ms,
                    "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
                }
            )
    flat = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ms = graph_replay_ms(lambda x: x.sum(dtype=torch.float32), [(x,) for x in flat])
    rows.append(
        {
            "kernel": "decode attention",
            "shape": [nbytes],
            "variant": "contiguous read (torch sum)",
            "ms": ms,
            "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
        }
    )
    for layout, block_n, warps, stages, splits in configs:
        variant = f"{layout} bn{block_n} w{warps} s{stages} sp{splits}"

        def fn(q, k, v, t, bn=block_n, w=warps, st=stages, sp=splits):
            return attn_triton.paged_decode_attention(
                q, k, v, t, lengths, None, sp, block_n=bn, num_warps=w, num_stages=st
            )

        try:
            err = float((fn(*sets[layout][0]).float() - want).norm() / want.norm())
            assert err < 2e-2, err
            ms = graph_replay_ms(fn, sets[layout])
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses
            rows.append({"kernel": "decode attention", "variant": variant, "error": str(exc)[:200]})
            continue
        rows.append(
            {
                "kernel": "decode attention",
                "shape": [batch, heads, n_kv, head_dim],
                "variant": variant,
                "ms": ms,
                "rel_err": err,
                "x_bound": nbytes / (bw * 1e9) * 1e3 / ms,
                "default": (layout, block_n, warps, stages, splits) == ("hnd", 64, 4, 2, auto),
            }
        )
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
        print(
            f"{r['kernel']:18s} {str(r.get('shape')):22s} {r['variant']:28s} {r['ms']:.4f} ms  "
            f"x bound {r['x_bound']:.2f}"
            + (f"  x peer {r['x_peer']:.2f}" if r.get("x_peer") else "")
            + ("  (default)" if r.get("default") else "")
        )


if __name__ == "__main__":
    main()
