"""How long would the CPU take to stage one decode step's Engram rows?

The alternative to the GPU's zero-copy decode fetch (`docs/serving.md`, "Why decode loses
~1.5% a layer"): the host learns the step's new tokens, hashes them against each sequence's
history, gathers the rows from the host table into one buffer and sends it by DMA, while the
GPU runs the blocks before the Engram layer (~0.17 ms for the 4B at 128 sequences on the H200).
This probe times the host's part on the CPU it runs on, per step, for ``--batch`` sequences of
the V4.1 geometry (24 columns, 264-byte fp8 rows) and a ``--table-gib`` table of random rows:

* ``hash``: `NgramHasher.decode` on CPU tensors (the history updated in place);
* ``gather``: the native gather of the step's rows (``--threads``) into a staging buffer;
* ``total``: both, as one step would run them (new ids each step, not repeated).

With a GPU it also times the whole round trip of one step, as a staged fetch would run it:
the new tokens copied from the device and waited for, hashed and gathered on the host, and
the staged rows sent back by DMA and waited for (``d2h``, ``host``, ``h2d``, ``round_trip``).
Without one it is a lower bound (no copies, no wake-up). Neither times the graph launches
around it.

    PYTHONPATH=src python3 benchmarks/probes/cpu_staged_decode_probe.py --table-gib 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from condmem import native
from condmem.bench.e2e import engram_config, token_map
from condmem.bench.harness import machine_info
from condmem.hashing.hasher import NgramHasher
from condmem.layout import EngramLayout

ROW_BYTES = 264


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    vocab, lookup, v_prime, pad, source = token_map()
    layout = EngramLayout(engram_config(2560, args.table_gib, v_prime, pad))
    hasher = NgramHasher(layout, token_lookup=lookup, pad_id=pad) if lookup is not None else NgramHasher(layout)
    n_rows = layout.layer(1).num_embeddings
    table = torch.empty(n_rows, ROW_BYTES, dtype=torch.uint8)
    table.view(-1)[:: 4096].fill_(1)                      # touch every page once (first-touch outside timing)
    gen = torch.Generator().manual_seed(0)
    history = hasher.new_history(args.batch, "cpu")
    slots = torch.arange(args.batch)
    prompts = torch.randint(0, vocab, (args.batch, 64), generator=gen)
    hasher.prefill_history(history, slots, prompts)
    steps = [torch.randint(0, vocab, (args.batch,), generator=gen) for _ in range(args.steps)]
    n_ids = args.batch * layout.n_cols
    staging = torch.empty(n_ids, ROW_BYTES, dtype=torch.uint8)
    rows = []
    for threads in args.threads:
        t_hash, t_gather, t_total = [], [], []
        for ids in steps:
            t0 = time.perf_counter()
            row_ids = hasher.decode(history, slots, ids)[:, 0]              # [B, n_cols] of layer 1
            t1 = time.perf_counter()
            if native.gather_rows(table, row_ids.reshape(-1), staging, threads=threads) is None:
                torch.index_select(table, 0, row_ids.reshape(-1), out=staging)
            t2 = time.perf_counter()
            t_hash.append(t1 - t0)
            t_gather.append(t2 - t1)
            t_total.append(t2 - t0)
        if torch.cuda.is_available():
            row_trip = _round_trip(hasher, history, slots, steps, table, staging, threads)
        else:
            row_trip = {}
        row = {"probe": "cpu_staged_decode", "table_gib": n_rows * ROW_BYTES / 2**30, "batch": args.batch,
               "rows_per_step": n_ids, "threads": threads, "gather_path": native.gather_path(),
               "hash_ms": 1e3 * statistics.median(t_hash[10:]), "gather_ms": 1e3 * statistics.median(t_gather[10:]),
               "total_ms": 1e3 * statistics.median(t_total[10:]),
               "total_p90_ms": 1e3 * sorted(t_total[10:])[int(0.9 * len(t_total[10:]))],
               "tokenizer": source, "machine": machine_info(), **row_trip}
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_staged_decode_probe.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'threads':>7s} {'hash ms':>8s} {'gather ms':>9s} {'total ms':>8s} {'p90 ms':>7s}  "
          f"({rows[0]['rows_per_step']} rows a step from {rows[0]['table_gib']:.1f} GiB, {rows[0]['gather_path']} gather)")
    for r in rows:
        print(f"{r['threads']:7d} {r['hash_ms']:8.3f} {r['gather_ms']:9.3f} {r['total_ms']:8.3f} {r['total_p90_ms']:7.3f}"
              + (f"   with the GPU: d2h {r['d2h_ms']:.3f} + host {r['host_ms']:.3f} + h2d {r['h2d_ms']:.3f} = "
                 f"{r['round_trip_ms']:.3f} ms (p90 {r['round_trip_p90_ms']:.3f})" if "round_trip_ms" in r else ""))


def _round_trip(hasher, history, slots, steps, table, staging, threads: int) -> dict:
    """Median ms of each part of one staged step with a GPU: the step's tokens from the device
    (copied and waited for), hash and gather on the host, the rows to the device (waited for)."""
    device = torch.device("cuda")
    dev_ids = [ids.to(device) for ids in steps]
    host_ids = torch.empty(len(slots), dtype=torch.int64).pin_memory()
    pinned = staging.pin_memory()
    rows = torch.empty(pinned.shape, dtype=pinned.dtype, device=device)
    stream = torch.cuda.current_stream(device)
    parts = {"d2h": [], "host": [], "h2d": [], "round_trip": []}
    for ids in dev_ids:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        host_ids.copy_(ids, non_blocking=True)
        stream.synchronize()
        t1 = time.perf_counter()
        row_ids = hasher.decode(history, slots, host_ids)[:, 0]
        if native.gather_rows(table, row_ids.reshape(-1), pinned, threads=threads) is None:
            torch.index_select(table, 0, row_ids.reshape(-1), out=pinned)
        t2 = time.perf_counter()
        rows.copy_(pinned, non_blocking=True)
        stream.synchronize()
        t3 = time.perf_counter()
        for name, dt in (("d2h", t1 - t0), ("host", t2 - t1), ("h2d", t3 - t2), ("round_trip", t3 - t0)):
            parts[name].append(dt)
    out = {f"{name}_ms": 1e3 * statistics.median(v[10:]) for name, v in parts.items()}
    trip = sorted(parts["round_trip"][10:])
    out["round_trip_p90_ms"] = 1e3 * trip[int(0.9 * len(trip))]
    return out


if __name__ == "__main__":
    main()
