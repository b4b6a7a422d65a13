"""Tensor-parallel Engram on N ranks: each sharding mode exact against one process, and its
collective time per step against the time the traffic formulas predict.

One V4.1-like layer (24 columns of 256-wide bf16 rows; ``--table-size`` buckets per column),
the same random table built on every rank (the oracle), each rank serving its `ShardPlan`
slice. For ``head`` and ``row``, with and without sequence parallelism: rows `torch.equal`
to the unsharded gather on every rank, then the step (local lookup + collective) timed,
median of ``--repeats``, next to the local lookup alone. The column-parallel `wkv`: outputs
against the unsharded layer within bf16 tolerance. The bus bandwidth of an all-gather of the
same size is measured first; the prediction is `traffic_per_token` bytes at that rate. Rank 0
writes ``multi_gpu_tp.json`` under ``--out`` and prints a table.

    torchrun --nproc-per-node N benchmarks/multi_gpu_tp.py --out DIR            # NCCL, one GPU a rank
    torchrun --nproc-per-node 2 benchmarks/multi_gpu_tp.py --device cpu --tiny  # gloo smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from condmem import Engram, EngramConfig, EngramLayout, NgramHasher
from condmem.distributed import ShardedRows, ShardPlan, column_parallel_engram, traffic_per_token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn()` across ranks' barrier-aligned calls (one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bus_bandwidth_gbps(nbytes_per_rank: int, device: torch.device, repeats: int) -> float:
    """All-gather bus bandwidth: (w-1)/w * total bytes / time (what ring formulas assume)."""
    world = dist.get_world_size()
    src = torch.empty(max(1, nbytes_per_rank // 2), dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty(world * src.numel(), dtype=torch.bfloat16, device=device)
    ms = timed_ms(lambda: dist.all_gather_into_tensor(dst, src), device, repeats)
    return (world - 1) / world * dst.numel() * 2 / (ms * 1e-3) / 1e9


def run(args, rank: int, world: int, device: torch.device) -> dict | None:
    """The measurements on one rank (called on every rank; rank 0 returns the result)."""
    cfg = EngramConfig.deepseek_v41_flash().replace(
        layer_ids=[1],
        table_size=args.table_size,
        num_embeddings=None,
        compressed_vocab_size=1000,
        hidden_size=args.hidden,
        hc_mult=1,
        rms_norm_eps=1e-6,
    )
    layout = EngramLayout(cfg)
    layer = layout.layer(1)
    dim, n_cols = cfg.head_dim, layout.n_cols
    gen = torch.Generator(device=device).manual_seed(0)  # the same table on every rank
    table = torch.randn((layer.num_embeddings, dim), generator=gen, device=device).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (args.batch, args.tokens), generator=gen, device=device)
    row_ids = NgramHasher(layout)(ids)[:, :, 0]
    want = table[row_ids]
    plan = ShardPlan.for_layer(layer, world)
    r0, r1 = plan.row_range(rank)
    shard = table[r0:r1]
    tokens = row_ids.numel() // n_cols
    bw = bus_bandwidth_gbps(tokens * n_cols * dim * 2 // world, device, args.repeats)
    predicted = traffic_per_token(n_cols, dim, world, hidden=args.hidden)
    rows_out = []
    for mode in ("head", "row"):
        for sp in (False, True):
            sharded = ShardedRows(plan, lambda local: shard[local], dim, mode=mode, sequence_parallel=sp)
            got = sharded(row_ids)
            t0, t1 = sharded.token_chunk(row_ids.shape[1]) if sp else (0, row_ids.shape[1])
            exact = torch.tensor(int(torch.equal(got, want[:, t0:t1])), device=device)
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            step_ms = timed_ms(lambda s=sharded: s(row_ids), device, args.repeats)
            local_ms = timed_ms(lambda s=sharded: s._local(row_ids), device, args.repeats)
            key = mode + ("_sp" if sp else "")
            rows_out.append(
                {
                    "mode": key,
                    "exact_on_every_rank": bool(exact.item()),
                    "step_ms": step_ms,
                    "local_lookup_ms": local_ms,
                    "collective_ms": step_ms - local_ms,
                    "bytes_per_token": predicted[key],
                    "predicted_ms": predicted[key] * tokens / (bw * 1e9) * 1e3,
                }
            )
    torch.manual_seed(1)
    engram = Engram(cfg, layer.num_embeddings, layer_id=1, device=device, table_device="meta").to(torch.bfloat16)
    hidden = torch.randn((args.batch, args.tokens, args.hidden), generator=gen, device=device).to(torch.bfloat16)
    with torch.no_grad():
        ref = engram(hidden, row_ids, row_vectors=want).float()
        local = ShardedRows(plan, lambda local: shard[local], dim)._local(row_ids)
        out = column_parallel_engram(engram, hidden, local, plan).float()
        err = torch.tensor(float((out - ref).norm() / ref.norm()), device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        step_ms = timed_ms(lambda: column_parallel_engram(engram, hidden, local, plan), device, args.repeats)
    rows_out.append(
        {
            "mode": "column_wkv",
            "rel_err_max_over_ranks": float(err.item()),
            "step_ms": step_ms,
            "bytes_per_token": predicted["column_wkv"],
            "predicted_ms": predicted["column_wkv"] * tokens / (bw * 1e9) * 1e3,
        }
    )
    if rank != 0:
        return None
    return {
        "world": world,
        "backend": dist.get_backend(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "tokens_per_step": tokens,
        "columns": n_cols,
        "head_dim": dim,
        "rows_per_layer": layer.num_embeddings,
        "rows_on_rank0": r1 - r0,
        "allgather_bus_gbps": bw,
        "modes": rows_out,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "command": "torchrun benchmarks/multi_gpu_tp.py " + " ".join(args.argv),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--table-size", type=int, default=200_000, help="buckets per column (before the primes)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per sequence (batch x tokens a step)")
    p.add_argument("--hidden", type=int, default=4096, help="backbone width (the column-parallel wkv)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="a small table and step (a smoke run)")
    args = p.parse_args(argv)
    if args.tiny:
        args.table_size, args.batch, args.tokens, args.hidden, args.repeats = 500, 2, 64, 64, 2
    args.argv = argv
    return args


def report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu_tp.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"world {result['world']} ({result['backend']}), {result['tokens_per_step']} tokens a step, all-gather bus "
        f"bandwidth {result['allgather_bus_gbps']:.1f} GB/s"
    )
    print(f"{'mode':<11} {'exact':>6} {'step ms':>9} {'local ms':>9} {'coll. ms':>9} {'B/token':>8} {'pred. ms':>9}")
    for r in result["modes"]:
        exact = r.get("exact_on_every_rank", f"{r.get('rel_err_max_over_ranks', 0):.1e}")
        print(
            f"{r['mode']:<11} {str(exact):>6} {r['step_ms']:>9.3f} {r.get('local_lookup_ms', float('nan')):>9.3f} "
            f"{r.get('collective_ms', float('nan')):>9.3f} {r['bytes_per_token']:>8.0f} {r['predicted_ms']:>9.3f}"
        )


def main() -> None:
    import sys

    args = parse(sys.argv[1:])
    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = run(args, dist.get_rank(), dist.get_world_size(), device)
        if result is not None:
            report(result, Path(args.out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
