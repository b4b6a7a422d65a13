"""Where a graph-captured decode step with host-resident Engram tables loses time against HBM tables.

The `condmem bench e2e` 4B backbone (one Engram layer at block 1, V4.1 row geometry, a
``--table-gib`` table) decodes ``--batch`` slots at lengths uniform in 100..1100. Each variant
is one `GraphedDecoder` over the same cache; the variants run in alternating rounds, each
timed over ``--steps`` replays (CUDA events, median):

* ``none``: the backbone without Engram;
* ``hbm``: rows gathered from an HBM copy of the table, waited for at the Engram layer;
* ``host``: rows gathered zero-copy from page-locked host memory (``fetch="zero_copy"``),
  waited for at the layer;
* ``host_programs_N``: the same with the fetch kernel's grid capped at N programs;
* ``host_before_step``: the same fetch waited for before block 0 (nothing overlaps it);
* ``host_no_wait``: the fetch launched but never waited for (rows read unfinished: wrong
  numbers, right timing). The negative control that separates the two costs: if it is as
  slow as ``host``, the fetch slows the blocks running beside it; if it is as fast as
  ``hbm``, the step waits for the fetch;
* ``staged_T`` (``--staged-threads``): rows gathered by T host threads and sent by DMA
  (`GraphedDecoder(fetch="staged")`), the handshake by stream memory operations;
  ``staged_no_wait``: the staged fetch never waited for (its negative control).
  Each prints the host threads' time per step (request seen -> rows staged).

Also the fetch alone (one layer's rows for the whole batch, graph-replayed over fresh ids)
from HBM and from host memory, and the time of the blocks before the Engram layer.

    PYTHONPATH=src python3 benchmarks/decode_fetch_overlap.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch

from condmem.bench.e2e import build_models, hbm_copy
from condmem.bench.harness import event_times_ms, graph_replay_ms, machine_info
from condmem.bench.lookup_setup import host_store
from condmem.serving import EngramMemory, ServingCache
from condmem.serving.decode_fetch import SideBranchRows
from condmem.serving.graphs import GraphedDecoder


@contextlib.contextmanager
def rows_without_wait():
    """While a `GraphedDecoder` is built (its step captured): the Engram layers read the fetch's row
    buffers without waiting for the side branch, which the step joins at its end instead (a captured
    graph must end joined). The rows are then unfinished: wrong numbers, the timing without the wait."""
    rows, body = SideBranchRows.rows, GraphedDecoder._body

    def joined_at_end(self):
        logits = body(self)
        torch.cuda.current_stream().wait_event(self.fetch.events[self.fetch.layer_ids[-1]])
        return logits

    SideBranchRows.rows = lambda self, layer_id: self.rows_buf[layer_id]
    GraphedDecoder._body = joined_at_end
    try:
        yield
    finally:
        SideBranchRows.rows, GraphedDecoder._body = rows, body


def step_times(graph: GraphedDecoder, cache: ServingCache, lengths: torch.Tensor, ids_sets, steps: int) -> list[float]:
    cache.lengths.copy_(lengths.to(cache.lengths.device))
    cache.host_lengths = lengths.tolist()
    slots = list(range(cache.n_slots))
    turn = iter(range(steps))
    return event_times_ms(lambda: graph.step(slots, ids_sets[next(turn) % len(ids_sets)]), steps)[2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--backbone", default="4b")
    p.add_argument("--table-gib", type=float, default=16.0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--programs", type=int, nargs="*", default=[16, 64])
    p.add_argument("--staged-threads", type=int, nargs="*", default=[2, 4, 8])
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    len_max = 1100
    max_len = len_max + args.steps + 8
    model, twin, _ = build_models(args.backbone, args.table_gib, max_len, device)
    lid = model.layout.layer_ids[0]
    host = {lid: host_store(model.layout.layer(lid).num_embeddings, "mmap_register", progress=False)}
    hbm = {lid: hbm_copy(host[lid], device)}
    cache = ServingCache(model, n_slots=args.batch, max_len=max_len)
    lengths = torch.randint(100, len_max + 1, (args.batch,))
    vocab = model.cfg.vocab_size
    ids_sets = [torch.randint(0, vocab, (args.batch,), device=device) for _ in range(8)]

    def memory_of(stores):
        memory = EngramMemory(model.hasher, stores, device, cpu_fraction=1.0, max_sequences=args.batch)
        for _ in range(args.batch):
            memory.allocate()
        return memory

    memories = {"hbm": memory_of(hbm), "host": memory_of(host)}
    graphs = {"none": GraphedDecoder(twin, cache)}
    graphs["hbm"] = GraphedDecoder(model, cache, memory=memories["hbm"])
    zero_copy = dict(memory=memories["host"], fetch="zero_copy")
    graphs["host"] = GraphedDecoder(model, cache, **zero_copy)
    for n in args.programs:
        graphs[f"host_programs_{n}"] = GraphedDecoder(model, cache, fetch_programs=n, **zero_copy)
    graphs["host_before_step"] = GraphedDecoder(model, cache, wait="before_step", **zero_copy)
    with rows_without_wait():
        graphs["host_no_wait"] = GraphedDecoder(model, cache, **zero_copy)
    for t in args.staged_threads:
        graphs[f"staged_{t}"] = GraphedDecoder(model, cache, memory=memories["host"], fetch="staged", fetch_threads=t)
    if args.staged_threads:
        t = args.staged_threads[len(args.staged_threads) // 2]
        with rows_without_wait():
            graphs["staged_no_wait"] = GraphedDecoder(
                model, cache, memory=memories["host"], fetch="staged", fetch_threads=t
            )

    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times[name].append(statistics.median(step_times(graph, cache, lengths, ids_sets, args.steps)))

    # The fetch alone: one layer's rows of the whole batch, fresh hashed ids each launch.
    row_sets = []
    memory = memories["host"]
    slots = torch.arange(args.batch, device=device)
    for i in range(8):
        row_sets.append(memory.hasher.decode(memory.history, slots, ids_sets[i])[:, None, 0].clone())
    out = torch.empty(args.batch, 1, *graphs["host"].fetch.rows_buf[lid].shape[2:], dtype=torch.bfloat16, device=device)
    fetch = {
        name: graph_replay_ms(
            lambda ids, m=memories[name]: m.gather_into(lid, ids, out=out), [(ids,) for ids in row_sets]
        )
        for name in ("hbm", "host")
    }

    # The blocks before the Engram layer: the share of a step the fetch can hide behind.
    per_block_ms = statistics.median(times["none"]) / model.cfg.n_layers
    staged_host = {name: g.fetch_stats() for name, g in graphs.items() if g.fetch_stats() is not None}
    for graph in graphs.values():
        graph.close()
    result = {
        "bench": "decode_fetch_overlap",
        "backbone": args.backbone,
        "batch": args.batch,
        "staged_host": staged_host,
        "table_gib": args.table_gib,
        "engram_layer": lid,
        "mean_len": float(lengths.float().mean()),
        "step_ms": {k: statistics.median(v) for k, v in times.items()},
        "step_ms_rounds": times,
        "fetch_alone_ms": fetch,
        "rows_per_step": args.batch * out.shape[2],
        "blocks_before_layer_ms": per_block_ms * lid,
        "machine": machine_info(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_fetch_overlap.json").write_text(json.dumps(result, indent=1) + "\n")
    base = result["step_ms"]["hbm"]
    print(
        f"fetch alone: hbm {fetch['hbm']:.4f} ms, host {fetch['host']:.4f} ms ({result['rows_per_step']} rows); "
        f"blocks before the Engram layer ~{result['blocks_before_layer_ms']:.3f} ms"
    )
    print(f"{'variant':20s} {'step ms':>8s} {'x hbm':>7s} {'host us':>8s}  rounds")
    for name, ms in result["step_ms"].items():
        host_us = f"{staged_host[name]['mean_us']:8.1f}" if name in staged_host else f"{'':8s}"
        print(f"{name:20s} {ms:8.4f} {base / ms:7.4f} {host_us}  " + " ".join(f"{t:.4f}" for t in times[name]))


if __name__ == "__main__":
    main()
