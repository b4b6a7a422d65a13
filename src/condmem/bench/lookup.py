"""``condmem bench lookup``: effective bandwidth of table lookups per tier, against PCIe measured in the same run.

For each tier (HBM, pinned host, disk), id stream and batch size, one Engram layer's
lookup (V4.1 geometry: 24 columns per token, head_dim 256, fp8 rows interleaved with
their scales, 264 B) is timed end to end through `LookupEngine`:

* ``uniform``: uniform random row ids (the worst case: no locality, no repeats);
* ``text``: row ids of real text (the interpreter's standard library source, through
  the DeepSeek-V4 tokenizer if installed, else a byte-level stand-in) hashed with a
  V4.1-style layout whose tables are sized to the benchmark table, served with dedup
  and an HBM cache of ``--cache-fraction`` of the table, steady state over
  ``--text-batches`` consecutive batches.

Effective bandwidth = requested row bytes (tokens x 24 x 264 B, repeats included) /
time. It is reported next to the pinned H2D memcpy and D2D copy bandwidth measured in
the same process, with the cache hit rate and unique fraction. Rows are appended as
JSON lines to ``<out>/lookup.json``; a PNG plot goes beside them. After each variant's
timings its rows are compared with a plain gather of the table (`lookup_exact`; on a host
table read by a GPU, also with every miss on the GPU, half and half, and every miss on the
CPU), and a mismatch stops the run. Inputs (tables, the text stream) are built in
`lookup_setup`; the host-tier diagnostics live in `lookup_diagnostics`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from condmem.bench.harness import (
    append_rows,
    copy_bandwidth_gbps,
    machine_info,
    rows_table,
)
from condmem.bench.lookup_diagnostics import (
    cpu_gather_rows,
    engine_timeline,
    gather_under_load,
    lookup_kernel_row,
    phase_rows,
    pipeline_timeline,
    plan_costs,
    plot_pipeline,
)
from condmem.bench.lookup_exact import check_lookup, check_splits
from condmem.bench.lookup_setup import (
    HEAD_DIM,
    N_COLS,
    ROW_BYTES,
    disk_store,
    fill_table,
    h2d_bandwidth_gbps,
    host_store,
    text_batches,
    text_row_ids,
)
from condmem.tables.lookup import LookupEngine
from condmem.tables.row_cache import RowCache
from condmem.tables.staged_transfer import STAGING_CHUNK_ROWS
from condmem.tables.storage import LayerStore
from condmem.utils.plotting import pyplot

log = logging.getLogger("condmem.bench")

PIPELINE_MIN_TOKENS = 1024
"""Batches from this size up are also timed as a pipeline (decode-sized ones are one kernel each)."""


def measure_stream(engine: LookupEngine, stream: str, tokens: int, store: LayerStore, args, gen, text_sets_for,
                   device: str) -> list[tuple[str, float, float, float | None]]:
    """(mode, seconds per lookup, hit rate, unique fraction) for one stream and batch size.

    ``latency``: each lookup waited for before the next starts (what one prefetch must hide).
    ``pipelined``: lookups issued back to back, each waited for `max_in_flight` later (the
    steady state of a caller that prefetches ahead). The text stream runs ``--text-warmup``
    batches first (cache warm-up), then ``--text-batches`` timed ones; the cache restarts
    empty for each mode.
    """
    pipelined = device == "cuda" and tokens >= PIPELINE_MIN_TOKENS
    out = []
    if stream == "uniform":
        sets = [torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to(device) for _ in range(4)]
        out.append(("latency", engine.time_lookup(sets, repeats=args.repeats), 0.0, None))
        if pipelined:
            engine.time_pipelined(sets)
            out.append(("pipelined", engine.time_pipelined(sets * args.repeats), 0.0, None))
        return out
    sets = text_sets_for(store.num_rows, tokens)
    warm, timed = sets[: args.text_warmup], sets[args.text_warmup:]
    unique = sum(torch.unique(ids).numel() / ids.numel() for ids in timed) / len(timed)
    for mode in ("latency", "pipelined") if pipelined else ("latency",):
        if engine.cache is not None:
            engine.flush()
            engine.cache.clear()
        if mode == "latency":
            for ids in warm:
                engine.lookup(ids).wait()
        else:
            engine.time_pipelined(warm)
        engine.flush()
        if engine.cache is not None:
            engine.cache.reset_stats()
        if mode == "latency":
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for ids in timed:
                engine.lookup(ids).wait()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / len(timed)
        else:
            seconds = engine.time_pipelined(timed)
        engine.flush()
        hit_rate = engine.cache.stats.hit_rate if engine.cache is not None else 0.0
        out.append((mode, seconds, hit_rate, unique))
    return out


VARIANT_GRAMMAR = "graphs|eager[@in_flight][+pysend][+gatherexp][+yield][+w8][+cROWS][+rCHUNKS][+zPROGRAMS|+zfull][+tTHREADS][/torch|/triton]"
VARIANT_FLAGS = (
    "graphs or eager: plans replayed as CUDA graphs or launched kernel by kernel; @D: D lookups in flight "
    "(default: the engine's); +pysend: LookupEngine(native_send=False), the CPU share sent by a Python loop; +gatherexp: "
    "expand_on_caller=False, the gather thread queues each expansion; +yield: zero_copy_yields=True, "
    "short zero-copy programs on a low-priority stream; +w8: zero_copy_word_bytes=8; +cN: N rows per staging "
    "chunk; +rN: N chunks in the staging ring; +zN: the zero-copy grid capped at N programs (default: the engine's, 64); +zfull: not capped; +tN: N CPU gather threads (default: "
    "--cpu-threads' first value, else one fewer than torch's threads); /torch or "
    "/triton: the cache's probe and admission (default Triton on CUDA)")
NAMED_FLAGS = ("pysend", "gatherexp", "yield", "w8", "zfull")
ENGINE_KEYS = ("graphs", "max_in_flight", "native_send", "expand_on_caller", "zero_copy_yields",
               "zero_copy_word_bytes")
"""A variant's entries that are `LookupEngine` arguments as they are (`engine_options` adds the staging
ones and the zero-copy grid's cap)."""


def parse_variant(text: str) -> dict:
    """An engine variant for A/B runs, written `VARIANT_GRAMMAR` (`VARIANT_FLAGS` says what each
    part does), e.g. ``graphs@3+c16384+r8+z64/torch``."""
    head, _, backend = text.partition("/")
    head, *flags = head.split("+")
    name, _, depth = head.partition("@")
    numbers: dict[str, int] = {}      # +cN, +rN, +zN, +tN, each at most once
    ok = name in ("graphs", "eager") and (not depth or depth.isdigit()) and backend in ("", "torch", "triton")
    for f in flags:
        if f in NAMED_FLAGS:
            continue
        key, value = f[:1], f[1:]
        ok = ok and key in "crzt" and key not in numbers and value.isdigit() and int(value) > 0
        numbers[key] = int(value) if value.isdigit() else 0
    if not ok or numbers.get("r", 2) < 2 or ("zfull" in flags and "z" in numbers):
        raise SystemExit(f"--engines: {text!r} is not {VARIANT_GRAMMAR}")
    return {"label": text, "graphs": name == "graphs", "cache_backend": backend or "auto",
            "max_in_flight": int(depth) if depth else None, "native_send": "pysend" not in flags,
            "expand_on_caller": "gatherexp" not in flags, "zero_copy_yields": "yield" in flags,
            "zero_copy_word_bytes": 8 if "w8" in flags else 4, "staging_chunk_rows": numbers.get("c"),
            "staging_ring": numbers.get("r"), "zero_copy_programs": "full" if "zfull" in flags else numbers.get("z"),
            "cpu_threads": numbers.get("t")}


def engine_options(variant: dict, args) -> dict:
    """`LookupEngine` keyword arguments of a variant: its `ENGINE_KEYS`, `staging_chunk_rows` from
    its ``+cN``, else ``--staging-chunk-rows``' first value, else the engine's default,
    `staging_ring` from its ``+rN``, `zero_copy_programs` from its ``+zN`` (``+zfull``: None) and
    `cpu_threads` from its ``+tN``."""
    options = {key: variant[key] for key in ENGINE_KEYS if key != "max_in_flight" or variant[key] is not None}
    rows = variant["staging_chunk_rows"] or (args.staging_chunk_rows or [None])[0]
    if rows is not None:
        options["staging_chunk_rows"] = rows
    if variant["staging_ring"]:
        options["staging_ring"] = variant["staging_ring"]
    if variant["cpu_threads"]:
        options["cpu_threads"] = variant["cpu_threads"]
    if variant["zero_copy_programs"] is not None:
        options["zero_copy_programs"] = None if variant["zero_copy_programs"] == "full" else variant["zero_copy_programs"]
    return options


def exactness_rows(engine: LookupEngine, store: LayerStore, tier: str, stream: str, batches: list[int], variant: dict,
                   args, gen, text_sets_for, device: str, splits: bool) -> list[dict]:
    """After a variant's timings: one lookup per batch size compared with a plain gather of the
    table (`lookup_exact`; a mismatch stops the bench); with `splits`, the largest batch also at
    each of `SPLIT_FRACTIONS` (host tier on a GPU). One row per check."""
    rows = []
    for tokens in batches:
        if stream == "text":
            ids = text_sets_for(store.num_rows, tokens)[-1]      # the cache holds the stream's rows by now
        else:
            ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to(device)
        what = f"{tier} {stream} {tokens} tokens [{variant['label']}]"
        t0 = time.perf_counter()
        if splits and tokens == max(batches):
            fractions = check_splits(engine, store, ids, what)
        else:
            check_lookup(engine, store, ids, what)
            fractions = [engine.cpu_fraction]
        log.info("%s: rows equal to a plain gather of the table (cpu_fraction %s, cache %s; checked in %.1f s)", what,
                 "/".join(f"{f:.2f}" for f in fractions), "on" if engine.cache is not None else "off",
                 time.perf_counter() - t0)
        rows.append({"bench": "lookup_exact", "tier": tier, "stream": stream, "tokens": tokens,
                     "variant": variant["label"], "cpu_fractions": fractions, "cache": engine.cache is not None,
                     "table_gib": round(store.nbytes / 2**30, 2), "exact": True})
    return rows


def run_lookup(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    info = machine_info()
    rows_out: list[dict] = []
    ceiling = {}
    if device == "cuda":
        ceiling["h2d_gbps"] = h2d_bandwidth_gbps()
        ceiling.update(copy_bandwidth_gbps(device="cuda"))
        log.info("ceilings: H2D %.1f GB/s, D2D %.0f GB/s", ceiling["h2d_gbps"], ceiling["d2d_gbps"])
    table_bytes = int(args.table_gib * 2**30)
    n_rows = table_bytes // ROW_BYTES
    batches = sorted(set(args.batch_tokens))
    gen = torch.Generator().manual_seed(0)
    text_source = None
    text_by_rows: dict[int, torch.Tensor] = {}

    def text_ids_for(rows: int) -> torch.Tensor:
        """The text stream hashed with a layout sized to a table of `rows` rows (tiers differ in size)."""
        nonlocal text_source
        if rows not in text_by_rows:
            need = max(batches) * (args.text_batches + args.text_warmup)
            text_by_rows[rows], text_source = text_row_ids(rows, need)
            log.info("text stream: %d tokens from %s, for a table of %d rows", text_by_rows[rows].shape[0],
                     text_source, rows)
            have = text_by_rows[rows].shape[0] // max(batches)
            if have < args.text_batches + args.text_warmup:
                if have <= args.text_batches:
                    raise SystemExit(f"the text stream has only {have} batches of {max(batches)} tokens; "
                                     f"ask for fewer than --text-batches {args.text_batches}")
                log.warning("text stream: %d batches of %d tokens, fewer than %d warm-up + %d timed: warm-up cut "
                            "to %d", have, max(batches), args.text_warmup, args.text_batches,
                            have - args.text_batches)
                args.text_warmup = have - args.text_batches
        return text_by_rows[rows]

    text_on_device: dict[tuple[int, int], list[torch.Tensor]] = {}

    def text_sets_for(rows: int, tokens: int) -> list[torch.Tensor]:
        """Every batch (warm-up, then timed) of the text stream on the device, moved there once."""
        if (rows, tokens) not in text_on_device:
            ids = text_ids_for(rows)
            text_on_device[(rows, tokens)] = text_batches(ids, tokens, args.text_warmup + args.text_batches, device)
        return text_on_device[(rows, tokens)]

    variants = [parse_variant(v)
                for v in (args.engines or ["eager" if args.eager_plans else "graphs"])] * args.engine_rounds
    if "plan" in args.diagnostics:
        # The cache path alone: no table is read, so none is built.
        tokens = max(batches)
        text = text_sets_for(n_rows, tokens)
        rows_out.extend(plan_costs(n_rows, max(1, int(n_rows * args.cache_fraction)), text, args.text_warmup,
                                   variants, info, ceiling, kernels=args.trace))
    for tier in args.tiers:
        if tier == "hbm":
            if device != "cuda":
                continue
            hbm_rows = min(n_rows, int(args.hbm_gib * 2**30) // ROW_BYTES)
            raw = torch.empty((hbm_rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
            fill_table(raw)
            store = LayerStore("hbm", "fp8_interleaved", HEAD_DIM, raw)
        elif tier == "host":
            store = host_store(n_rows, "pageable" if device == "cpu" else args.host_alloc)
        else:
            store = disk_store(int(args.disk_gib * 2**30) // ROW_BYTES, args.disk_dir, args.dram_cache_gib)
        if tier == "host":
            diag = set(args.diagnostics)
            if "gather" in diag:
                rows_out.extend(cpu_gather_rows(store, info, ceiling))
            if device == "cuda":
                if "phases" in diag:
                    rows_out.extend(phase_rows(store, info, ceiling))
                if "gather" in diag:
                    rows_out.extend(gather_under_load(store, info, ceiling))
                if "timeline" in diag:
                    # All-CPU with one DMA after the gather vs chunked DMAs overlapping it, and the usual split.
                    for fraction, chunks in ((1.0, STAGING_CHUNK_ROWS), (1.0, 16384), (0.6, STAGING_CHUNK_ROWS)):
                        rows_out.extend(engine_timeline(store, info, ceiling, cpu_fraction=fraction,
                                                        chunk_rows=chunks))
                if "pipeline" in diag:
                    # The first --engines variant's options (zero_copy_yields, say), so its timeline can be read.
                    options = engine_options(variants[0], args)
                    options.pop("staging_chunk_rows", None)     # the loop below sets it
                    named = f" [{variants[0]['label']}]" if args.engines else ""
                    tokens = max(batches)
                    uniform = [torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).cuda()
                               for _ in range(8)]
                    for fraction in args.pipeline_fractions:
                        for threads in args.cpu_threads or [None]:
                            for chunk in args.staging_chunk_rows or [STAGING_CHUNK_ROWS]:
                                trace = (Path(args.out) / f"lookup_trace_uniform_{fraction:.1f}_{threads}_{chunk}.json"
                                         if args.trace else None)
                                rows_out.extend(pipeline_timeline(store, info, ceiling, uniform, f"uniform{named}", fraction,
                                                                  cpu_threads=threads, trace=trace, chunk_rows=chunk,
                                                                  options=options))
                    text = text_sets_for(store.num_rows, tokens)[: args.text_warmup + 11]
                    cache = RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16,
                                                device="cuda")
                    for fraction in args.pipeline_fractions:
                        cache.clear()   # then warmed to the steady state on the warm-up batches
                        trace = Path(args.out) / f"lookup_trace_text_{fraction:.1f}.json" if args.trace else None
                        rows_out.extend(pipeline_timeline(store, info, ceiling, text[args.text_warmup:], f"text{named}",
                                                          fraction, cache=cache, trace=trace,
                                                          warm=text[:args.text_warmup], options=options))
                    del cache
        for stream in args.streams:
            for i, variant in enumerate(variants):
                label = variant["label"] if len(variants) > 1 else ""
                cached = stream == "text" and args.cache_fraction > 0
                cache = (RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16, device=device,
                                             backend=variant["cache_backend"])
                         if cached else None)
                options = {"cpu_threads": (args.cpu_threads or [None])[0], **engine_options(variant, args)}
                engine = LookupEngine(store, device, cache=cache, cpu_fraction=min(1.0, max(0.0, args.cpu_fraction)),
                                      **options)
                if tier == "host" and device == "cuda" and args.cpu_fraction < 0:
                    if stream == "text":
                        # Calibrated on the stream's own warm-up batches, with the cache (see `calibrate`).
                        tokens = max(batches)
                        engine.calibrate(sample=text_sets_for(store.num_rows, tokens)[: args.text_warmup])
                    else:
                        engine.calibrate(n_ids=16384 * N_COLS)
                for tokens in batches:
                    for mode, seconds, hit_rate, unique in measure_stream(engine, stream, tokens, store, args, gen,
                                                                          text_sets_for, device):
                        requested = tokens * N_COLS * ROW_BYTES
                        gbps = requested / seconds / 1e9
                        row = {
                            "bench": "lookup", "tier": tier, "stream": stream, "mode": mode, "tokens": tokens,
                            "table_gib": round(store.nbytes / 2**30, 2), "row_bytes": ROW_BYTES, "ms": seconds * 1e3,
                            "effective_gbps": gbps, "cpu_fraction": engine.cpu_fraction if tier == "host" else None,
                            "cache_gib": round(cache.data.numel() / 2**30, 2) if cache is not None else 0.0,
                            "hit_rate": hit_rate, "unique_fraction": unique, "device": device,
                            "text_source": text_source if stream == "text" else None, "variant": variant["label"],
                            **ceiling, "machine": info,
                        }
                        if "h2d_gbps" in ceiling:
                            row["x_h2d"] = gbps / ceiling["h2d_gbps"]
                        rows_out.append(row)
                        log.info("%s %s %s %6d tokens%s: %.3f ms, %.1f GB/s%s%s", tier, stream, mode, tokens,
                                 f" [{label}]" if label else "", seconds * 1e3, gbps,
                                 f" ({row['x_h2d']:.2f}x H2D)" if "x_h2d" in row else "",
                                 f", hit {hit_rate:.2f}, unique {unique:.2f}" if unique is not None else "")
                rows_out.extend(exactness_rows(engine, store, tier, stream, batches, variant, args, gen,
                                               text_sets_for, device, splits=i == 0))
                if "kernels" in args.diagnostics and device == "cuda":
                    tokens = max(batches)
                    sets = (text_sets_for(store.num_rows, tokens)[args.text_warmup:][:8] if stream == "text" else
                            [torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to(device)
                             for _ in range(8)])
                    rows_out.append(lookup_kernel_row(engine, sets, f"{tier} {stream} {tokens} tokens"
                                                      f"{f' [{label}]' if label else ''}", info))
                engine.close()
                del cache
        store.close()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def plot(rows: list[dict], path: Path) -> Path | None:
    """Effective GB/s vs batch tokens per tier and stream, with the H2D line."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in rows if r.get("bench") == "lookup"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["tier"], r["stream"], r.get("mode", "latency")) for r in rows}):
        pts = sorted((r["tokens"], r["effective_gbps"]) for r in rows
                     if (r["tier"], r["stream"], r.get("mode", "latency")) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if key[2] == "latency" else "s",
                linestyle="-" if key[2] == "latency" else ":", label=" / ".join(key))
    h2d = [r["h2d_gbps"] for r in rows if "h2d_gbps" in r]
    if h2d:
        ax.axhline(h2d[0], color="gray", linestyle="--", label=f"H2D memcpy {h2d[0]:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per lookup (x24 rows of 264 B)")
    ax.set_ylabel("effective GB/s (requested row bytes / time)")
    ax.set_title("Engram lookups by tier")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> list[dict]:
    resolve_defaults(args)
    rows = run_lookup(args)
    out = Path(args.out)
    append_rows(out / "lookup.json", rows)
    plot(rows, out / "lookup.png")
    plot_pipeline(rows, out / "lookup_pipeline.png")
    table_rows = [r for r in rows if r.get("bench") != "kernels"]    # kernel tables are logged instead
    print(rows_table(table_rows, [("tier", "tier", ""), ("stream", "stream", ""), ("mode", "mode", ""),
                                  ("variant", "engine", ""), ("tokens", "tokens", "d"),
                                  ("table_gib", "GiB", ".1f"), ("ms", "ms", ".3f"), ("effective_gbps", "GB/s", ".1f"),
                                  ("x_h2d", "x H2D", ".2f"), ("cpu_fraction", "cpu frac", ".2f"),
                                  ("hit_rate", "hit", ".2f"), ("unique_fraction", "uniq", ".2f")]))
    return rows


def add_arguments(p) -> None:
    """The options of ``condmem bench lookup``."""
    p.add_argument("--table-gib", type=float, default=None,
                   help="host table size in GiB (default: 64, or half the available memory if less)")
    p.add_argument("--hbm-gib", type=float, default=16.0, help="HBM table size for the HBM tier (default 16)")
    p.add_argument("--tiers", nargs="*", default=["hbm", "host"], choices=["hbm", "host", "disk"],
                   help="tiers to measure (disk: a file of --disk-gib, page cache dropped, memory-mapped); "
                        "the flag alone: none (with --diagnostics plan: the cache path only, no table built)")
    p.add_argument("--disk-gib", type=float, default=8.0, help="disk-tier table size in GiB (default 8)")
    p.add_argument("--disk-dir", default=None, help="folder for the disk-tier file (default: the temp folder)")
    p.add_argument("--dram-cache-gib", type=float, default=1.0, help="DRAM row cache in front of the disk tier")
    p.add_argument("--streams", nargs="+", default=["uniform", "text"], choices=["uniform", "text"],
                   help="id streams: uniform random, or real text hashed with a V4.1-style layout")
    p.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 64, 1024, 16384],
                   help="tokens per lookup (decode batch .. prefill); each token reads 24 rows")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="HBM cache size as a fraction of the table "
                   "(text stream; 0 disables)")
    p.add_argument("--text-batches", type=int, default=50, help="consecutive text batches timed (steady state)")
    p.add_argument("--text-warmup", type=int, default=300,
                   help="text batches run before timing, bringing the cache to its steady state (default 300: "
                        "~5M tokens, about 30M distinct rows at 16K tokens per batch, more than a 10%% cache holds)")
    p.add_argument("--host-alloc", default="mmap_register", choices=["mmap_register", "cuda_host_alloc"],
                   help="host memory strategy")
    p.add_argument("--engines", nargs="+", default=None,
                   help=f"engine variants measured one after another on the same table, for A/B runs, each "
                        f"{VARIANT_GRAMMAR} ({VARIANT_FLAGS}), e.g. 'graphs graphs@2 graphs+gatherexp graphs+yield+w8 "
                        f"graphs+c32768 graphs/torch eager'")
    p.add_argument("--engine-rounds", type=int, default=1,
                   help="repeat the engine list this many times (ABAB...: machines drift within a run)")
    p.add_argument("--eager-plans", action="store_true",
                   help="launch each lookup's plan kernel by kernel instead of replaying it as a CUDA graph "
                        "(to compare; the rows are identical)")
    p.add_argument("--cpu-fraction", type=float, default=-1.0,
                   help="share of host misses gathered by CPU threads; negative: calibrate at start (default)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per uniform batch set")
    p.add_argument("--cpu-threads", type=int, nargs="*", default=None,
                   help="threads of the CPU gather (default: one fewer than the cores torch uses); several "
                        "values: the pipeline diagnostic compares them, lookups use the first")
    p.add_argument("--staging-chunk-rows", type=int, nargs="+", default=None,
                   help=f"rows per pinned staging chunk of the CPU share (default: the engine's, "
                        f"{STAGING_CHUNK_ROWS}); several values: the pipeline diagnostic compares them, lookups "
                        "use the first")
    p.add_argument("--pipeline-fractions", type=float, nargs="+", default=[0.7, 1.0],
                   help="with --diagnostics pipeline: the CPU fractions whose pipelines are timed (each stream), "
                        "with the first --engines variant's options")
    p.add_argument("--trace", action="store_true",
                   help="with --diagnostics pipeline: also write a torch profiler trace of each uniform pipeline; "
                        "with --diagnostics plan: log each step's kernels by device time")
    p.add_argument("--diagnostics", nargs="*", default=["gather", "phases", "timeline"],
                   choices=["gather", "phases", "timeline", "pipeline", "plan", "kernels"],
                   help="diagnostics run before the lookups: CPU gather rates (alone and under GPU load), each "
                        "phase alone, one lookup's timeline, a pipeline of lookups' timeline (host tier); the "
                        "plan and the cache admission timed alone per --engines variant on the text stream "
                        "(plan: needs no table); the device time of a pipelined lookup per kernel, per tier and "
                        "stream (kernels, GPU). Default: gather phases timeline; none: give the flag alone")


def resolve_defaults(args) -> None:
    """Fill `--table-gib` from the machine when not given."""
    if args.table_gib is None:
        from condmem.tables.host_memory import mem_available

        avail = mem_available() or 0
        args.table_gib = min(64.0, max(0.01, avail / 2**30 / 2))
