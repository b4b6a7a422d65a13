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

It does not time the device-to-host copy of the new tokens, the wake-up of the host thread, the
DMA or the graph launches around it, so it is a lower bound on the staged path's latency.

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
        row = {"probe": "cpu_staged_decode", "table_gib": n_rows * ROW_BYTES / 2**30, "batch": args.batch,
               "rows_per_step": n_ids, "threads": threads, "gather_path": native.gather_path(),
               "hash_ms": 1e3 * statistics.median(t_hash[10:]), "gather_ms": 1e3 * statistics.median(t_gather[10:]),
               "total_ms": 1e3 * statistics.median(t_total[10:]),
               "total_p90_ms": 1e3 * sorted(t_total[10:])[int(0.9 * len(t_total[10:]))],
               "tokenizer": source, "machine": machine_info()}
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_staged_decode_probe.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'threads':>7s} {'hash ms':>8s} {'gather ms':>9s} {'total ms':>8s} {'p90 ms':>7s}  "
          f"({rows[0]['rows_per_step']} rows a step from {rows[0]['table_gib']:.1f} GiB, {rows[0]['gather_path']} gather)")
    for r in rows:
        print(f"{r['threads']:7d} {r['hash_ms']:8.3f} {r['gather_ms']:9.3f} {r['total_ms']:8.3f} {r['total_p90_ms']:7.3f}")


if __name__ == "__main__":
    main()
