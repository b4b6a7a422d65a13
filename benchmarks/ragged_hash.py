"""Ragged hashing on a GPU: the default (validating) call against the kernel alone, ragged
against padded prefill at equal tokens, and a mixed batch (prefill chunks + decode tokens)
hashed and fetched from a host table against the same rows fetched as two batches.

Geometry: DeepSeek-V4.1-Flash (V' = 99,092; token ids through a random 129,280-id map).
Every timed variant's rows are first checked (torch.equal) against the padded prefill
kernel on the same tokens. Writes ``$OUT/ragged_hash.json`` and prints a table last.

    PYTHONPATH=src python3 benchmarks/ragged_hash.py --out $OUT --table-gib 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.bench.harness import gpu_time_ms, machine_info
from condmem.bench.lookup_exact import check_lookup
from condmem.bench.lookup_setup import ROW_BYTES, host_store
from condmem.tables.lookup import LookupEngine


def v41_hasher() -> NgramHasher:
    gen = np.random.default_rng(0)
    v = 99_092
    lookup = np.concatenate([np.arange(v), gen.integers(0, v, 129_280 - v)])
    gen.shuffle(lookup)
    return NgramHasher(EngramLayout(EngramConfig.deepseek_v41_flash(), compressed_vocab_size=v), token_lookup=lookup)


def graph_ms(fn, calls: int = 20) -> float:
    """GPU time of one call without host gaps: `calls` calls captured in a CUDA graph, replayed."""
    from triton.testing import do_bench

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=25, rep=200) / calls


def busy_us(fn, calls: int = 50) -> float:
    """GPU busy time of one call (kernels, copies, memsets; host gaps excluded), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / calls


def wall_per_call_ms(fn, calls: int = 200) -> float:
    """Back-to-back calls with no sync between them: what a host thread issuing them sees."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--table-gib", type=float, default=64.0, help="host table for the mixed-batch fetch (0: skip)")
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    dev = "cuda"
    hasher = v41_hasher()
    n = args.tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, hasher.vocab_size, (8, n // 8), device=dev, generator=gen)
    flat = ids.reshape(-1)
    cu8 = torch.arange(0, n + 1, n // 8, device=dev)
    rows = {}
    result: dict = {"machine": machine_info(), "tokens": n, "geometry": "DeepSeek-V4.1-Flash"}

    # Exactness first: every variant against the padded kernel.
    want = hasher(ids, check=False).reshape(n, *hasher(ids, check=False).shape[2:])
    assert torch.equal(hasher(ids).reshape(want.shape), want)
    assert torch.equal(hasher.hash_ragged(flat, cu8, check=False), want)
    assert torch.equal(hasher.hash_ragged(flat, cu8), want)
    hasher.raise_pending()

    # 1. The default (validating) call against the kernel alone. GPU times without host gaps:
    # graph replays (check=False paths can be captured) and profiler busy time (all paths).
    graphs = {
        "padded 8x2048": graph_ms(lambda: hasher(ids, check=False)),
        "ragged 8 seqs": graph_ms(lambda: hasher.hash_ragged(flat, cu8, check=False)),
        "padded 1x8448": None,
        "mixed 8192+256 hash": None,
        "mixed 8192+256 hash + advance": None,
    }
    busy = {
        "padded check=False": busy_us(lambda: hasher(ids, check=False)),
        "padded default": busy_us(lambda: hasher(ids)),
        "ragged check=False": busy_us(lambda: hasher.hash_ragged(flat, cu8, check=False)),
        "ragged default": busy_us(lambda: hasher.hash_ragged(flat, cu8)),
    }
    hasher.raise_pending()
    rows["padded, check=False (kernel alone)"] = gpu_time_ms(lambda: hasher(ids, check=False))
    rows["padded, default (check on the device)"] = gpu_time_ms(lambda: hasher(ids))
    rows["ragged 8 seqs, check=False"] = gpu_time_ms(lambda: hasher.hash_ragged(flat, cu8, check=False))
    rows["ragged 8 seqs, default"] = gpu_time_ms(lambda: hasher.hash_ragged(flat, cu8))
    wall = {
        "padded check=False": wall_per_call_ms(lambda: hasher(ids, check=False)),
        "padded default": wall_per_call_ms(lambda: hasher(ids)),
        "ragged check=False": wall_per_call_ms(lambda: hasher.hash_ragged(flat, cu8, check=False)),
        "ragged default": wall_per_call_ms(lambda: hasher.hash_ragged(flat, cu8)),
    }
    hasher.raise_pending()

    # No host sync: calls issued behind a 200 ms GPU sleep return at once.
    torch.cuda.synchronize()
    torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2))
    t0 = time.perf_counter()
    hasher(ids)
    hasher.hash_ragged(flat, cu8)
    behind_sleep_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    hasher.raise_pending()

    # 2. Mixed batch: 4 prefill chunks of 2048 continuing from history + 256 decode tokens.
    n_pre, n_dec = 4, 256
    history = hasher.new_history(n_pre + n_dec, dev)
    slots = torch.tensor([history.allocate() for _ in range(n_pre + n_dec)], device=dev)
    lengths = [2048] * n_pre + [1] * n_dec
    cu_mixed = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev)
    mixed = torch.randint(0, hasher.vocab_size, (int(cu_mixed[-1]),), device=dev, generator=gen)
    hist0 = history.ids.clone()
    rows["mixed 8192+256, hash (commit=False)"] = gpu_time_ms(
        lambda: hasher.hash_ragged(mixed, cu_mixed, history=history, slots=slots, commit=False)
    )
    rows["mixed 8192+256, hash + advance"] = gpu_time_ms(
        lambda: (history.ids.copy_(hist0), hasher.hash_ragged(mixed, cu_mixed, history=history, slots=slots))
    )
    # Equal-token padded reference for the mixed batch: [1, 8448].
    rows["padded [1, 8448], check=False"] = gpu_time_ms(lambda: hasher(mixed[None], check=False))
    graphs["padded 1x8448"] = graph_ms(lambda: hasher(mixed[None], check=False))
    graphs["mixed 8192+256 hash"] = graph_ms(
        lambda: hasher.hash_ragged(mixed, cu_mixed, history=history, slots=slots, commit=False, check=False)
    )
    graphs["mixed 8192+256 hash + advance"] = graph_ms(
        lambda: hasher.hash_ragged(mixed, cu_mixed, history=history, slots=slots, check=False)
    )

    fetch = {}
    if args.table_gib > 0:
        table_rows = int(args.table_gib * 2**30 // ROW_BYTES)
        store = host_store(table_rows, "mmap_register", progress=False)
        engine = LookupEngine(store, dev)
        engine.calibrate()
        layer = 0
        one, two = [], []
        for rep in range(args.reps):
            g = torch.Generator(device=dev).manual_seed(1000 + rep)  # fresh ids every repeat: nothing cached
            batch = torch.randint(0, hasher.vocab_size, mixed.shape, device=dev, generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = hasher.hash_ragged(batch, cu_mixed, history=history, slots=slots, commit=False)[:, layer] % table_rows
            engine.lookup(r[None]).wait()
            torch.cuda.synchronize()
            one.append((time.perf_counter() - t0) * 1e3)
            if rep == 0:  # exact rows: the whole batch against a plain gather of the host table
                check_lookup(engine, store, r[None], "mixed batch 8192+256")
            pre, dec = r[: 4 * 2048], r[4 * 2048 :]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.lookup(pre[None]).wait()
            engine.lookup(dec[None]).wait()
            torch.cuda.synchronize()
            two.append((time.perf_counter() - t0) * 1e3)
        fetch = {
            "table_gib": args.table_gib,
            "rows": table_rows,
            "reps": args.reps,
            "one_mixed_batch_ms": statistics.median(one),
            "two_batches_ms": statistics.median(two),
            "one_all_ms": one,
            "two_all_ms": two,
        }
        engine.close()
        store.close()

    result.update(
        graph_ms_per_call=graphs,
        busy_us_per_call=busy,
        do_bench_ms=rows,
        wall_ms_per_call=wall,
        calls_behind_200ms_sleep_ms=behind_sleep_ms,
        fetch=fetch,
        ratios={
            "default_vs_kernel_busy": busy["padded default"] / max(busy["padded check=False"], 1e-9),
            "ragged_default_vs_kernel_busy": busy["ragged default"] / max(busy["padded check=False"], 1e-9),
            "ragged_vs_padded_graph": graphs["ragged 8 seqs"] / graphs["padded 8x2048"],
            "mixed_vs_padded_equal_tokens_graph": graphs["mixed 8192+256 hash"] / graphs["padded 1x8448"],
            "default_vs_kernel_wall": wall["padded default"] / wall["padded check=False"],
        },
        date=time.strftime("%Y-%m-%d"),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ragged_hash.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'GPU time per call, CUDA-graph replay':<44} {'us':>8}")
    for name, ms in graphs.items():
        print(f"{name:<44} {ms * 1e3:8.2f}")
    print(f"{'GPU busy per call (profiler)':<44} {'us':>8}")
    for name, us in busy.items():
        print(f"{name:<44} {us:8.2f}")
    print("wall ms per back-to-back call:", {k: round(v, 4) for k, v in wall.items()})
    print(f"two default calls issued behind a 200 ms GPU sleep returned in {behind_sleep_ms:.2f} ms")
    print("ratios:", {k: round(v, 3) for k, v in result["ratios"].items()})
    if fetch:
        print(
            f"mixed batch from a {args.table_gib:g} GiB host table: one batch {fetch['one_mixed_batch_ms']:.3f} ms "
            f"(hash + fetch), as two batches {fetch['two_batches_ms']:.3f} ms (fetch only)"
        )


if __name__ == "__main__":
    main()
