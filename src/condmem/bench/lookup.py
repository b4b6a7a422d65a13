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
JSON lines to ``<out>/lookup.json``; a PNG plot goes beside them. After each round's
timings its rows are compared with a plain gather of the table (`lookup_exact`; on a host
table read by a GPU, also with every miss on the GPU, half and half, and every miss on the
CPU), and a mismatch stops the run. Inputs (tables, the text stream) are built in
`lookup_setup`. Engineering diagnostics of the host tier (each phase alone, the CPU gather
under load, profiler traces of a pipeline) are a separate script:
``benchmarks/lookup_diagnostics.py`` in the repository.
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
from condmem.bench.lookup_exact import check_lookup, check_splits
from condmem.bench.lookup_setup import (
    HEAD_DIM,
    N_COLS,
    ROW_BYTES,
    disk_store,
    fill_table,
    h2d_bandwidth_gbps,
    host_store,
    page_cache_gib,
    text_batches,
    text_row_ids,
)
from condmem.bench.lookup_timing import time_lookup, time_pipelined
from condmem.tables.lookup import LookupConfig, LookupEngine
from condmem.tables.row_cache import RowCache
from condmem.tables.staged_transfer import STAGING_CHUNK_ROWS
from condmem.tables.storage import HbmStore, LayerStore
from condmem.utils.plotting import pyplot

log = logging.getLogger("condmem.bench")

PIPELINE_MIN_TOKENS = 1024
"""Batches from this size up are also timed as a pipeline (decode-sized ones are one kernel each)."""


def measure_stream(
    engine: LookupEngine, stream: str, tokens: int, store: LayerStore, args, gen, text_sets_for, device: str
) -> list[tuple[str, float, float, float | None, dict]]:
    """(mode, seconds per lookup, hit rate, unique fraction, extra row fields) for one stream and
    batch size.

    ``latency``: each lookup waited for before the next starts (what one prefetch must hide).
    ``pipelined``: lookups issued back to back, each waited for `max_in_flight` later (the
    steady state of a caller that prefetches ahead). The text stream runs ``--text-warmup``
    batches first (cache warm-up), then ``--text-batches`` timed ones; the caches (the HBM row
    cache and a disk tier's DRAM row cache) restart empty for each mode, so no mode reads rows
    another mode left behind. A DRAM row cache's hit rate over the timed batches is in the extra
    fields.
    """
    dram = getattr(store, "cache", None)
    pipelined = device == "cuda" and tokens >= PIPELINE_MIN_TOKENS
    out = []
    if stream == "uniform" and store.tier == "disk":
        return [measure_cold(engine, store, tokens, args, gen, device)]
    if stream == "uniform":
        sets = [torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to(device) for _ in range(4)]
        out.append(("latency", time_lookup(engine, sets, repeats=args.repeats), 0.0, None, {}))
        if pipelined:
            time_pipelined(engine, sets)
            out.append(("pipelined", time_pipelined(engine, sets * args.repeats), 0.0, None, {}))
        return out
    sets = text_sets_for(store.num_rows, tokens)
    warm, timed = sets[: args.text_warmup], sets[args.text_warmup :]
    unique = sum(torch.unique(ids).numel() / ids.numel() for ids in timed) / len(timed)
    for mode in ("latency", "pipelined") if pipelined else ("latency",):
        engine.flush()
        if engine.cache is not None:
            engine.cache.clear()
        if dram is not None:
            dram.clear()
        if mode == "latency":
            for ids in warm:
                engine.lookup(ids).wait()
        else:
            time_pipelined(engine, warm)
        engine.flush()
        if engine.cache is not None:
            engine.cache.reset_stats()
        if dram is not None:  # a DRAM row cache: its steady-state hits
            dram.reset_stats()
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
            seconds = time_pipelined(engine, timed)
        engine.flush()
        hit_rate = engine.cache.stats.hit_rate if engine.cache is not None else 0.0
        out.append(
            (mode, seconds, hit_rate, unique, {"dram_hit_rate": dram.stats.hit_rate} if dram is not None else {})
        )
    return out


def measure_cold(engine: LookupEngine, store: LayerStore, tokens: int, args, gen, device: str) -> tuple:
    """The disk tier cold: fresh uniform ids for every lookup (none repeated), the DRAM row cache
    emptied before each; median seconds per lookup and the rows per second read from the file."""
    times, rows_per_s = [], []
    for _ in range(max(2, args.repeats)):
        ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen)
        unique = int(ids.unique().numel())
        ids = ids.to(device)
        if getattr(store, "cache", None) is not None:
            store.cache.clear()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.lookup(ids).wait()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        rows_per_s.append(unique / times[-1])
    order = sorted(range(len(times)), key=times.__getitem__)
    mid = order[len(order) // 2]
    return ("cold", times[mid], 0.0, None, {"disk_rows_per_s": rows_per_s[mid]})


def exactness_rows(
    engine: LookupEngine,
    store: LayerStore,
    tier: str,
    stream: str,
    batches: list[int],
    round_no: int,
    label: str,
    gen,
    text_sets_for,
    device: str,
    splits: bool,
) -> list[dict]:
    """After a round's timings: one lookup per batch size compared with a plain gather of the
    table (`lookup_exact`; a mismatch stops the bench); with `splits`, the largest batch also at
    each of `SPLIT_FRACTIONS` (host tier on a GPU). One row per check."""
    rows = []
    for tokens in batches:
        if stream == "text":
            ids = text_sets_for(store.num_rows, tokens)[-1]  # the cache holds the stream's rows by now
        else:
            ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to(device)
        what = f"{tier} {stream} {tokens} tokens{label}"
        t0 = time.perf_counter()
        if splits and tokens == max(batches):
            fractions = check_splits(engine, store, ids, what)
        else:
            check_lookup(engine, store, ids, what)
            fractions = [engine.cpu_fraction]
        log.info(
            "%s: rows equal to a plain gather of the table (cpu_fraction %s, cache %s; checked in %.1f s)",
            what,
            "/".join(f"{f:.2f}" for f in fractions),
            "on" if engine.cache is not None else "off",
            time.perf_counter() - t0,
        )
        rows.append(
            {
                "bench": "lookup_exact",
                "tier": tier,
                "stream": stream,
                "tokens": tokens,
                "round": round_no,
                "cpu_fractions": fractions,
                "cache": engine.cache is not None,
                "table_gib": round(store.nbytes / 2**30, 2),
                "exact": True,
            }
        )
    return rows


class _TextStream:
    """The text stream's row ids: hashed once per table size (tiers differ in size), each batch
    size's batches moved to the device once."""

    def __init__(self, args, batches: list[int], device: str):
        self.args = args
        self.batches = batches
        self.device = device
        self.source: str | None = None  # where the text came from, known once it is first read
        self._by_rows: dict[int, torch.Tensor] = {}
        self._on_device: dict[tuple[int, int], list[torch.Tensor]] = {}

    def ids_for(self, rows: int) -> torch.Tensor:
        """The text stream hashed with a layout sized to a table of `rows` rows; a stream too short
        for the warm-up and timed batches cuts the warm-up (`args.text_warmup`), or stops the run."""
        args, batches = self.args, self.batches
        if rows not in self._by_rows:
            need = max(batches) * (args.text_batches + args.text_warmup)
            self._by_rows[rows], self.source = text_row_ids(rows, need)
            log.info(
                "text stream: %d tokens from %s, for a table of %d rows",
                self._by_rows[rows].shape[0],
                self.source,
                rows,
            )
            have = self._by_rows[rows].shape[0] // max(batches)
            if have < args.text_batches + args.text_warmup:
                if have <= args.text_batches:
                    raise SystemExit(
                        f"the text stream has only {have} batches of {max(batches)} tokens; "
                        f"ask for fewer than --text-batches {args.text_batches}"
                    )
                log.warning(
                    "text stream: %d batches of %d tokens, fewer than %d warm-up + %d timed: warm-up cut to %d",
                    have,
                    max(batches),
                    args.text_warmup,
                    args.text_batches,
                    have - args.text_batches,
                )
                args.text_warmup = have - args.text_batches
        return self._by_rows[rows]

    def sets_for(self, rows: int, tokens: int) -> list[torch.Tensor]:
        """Every batch (warm-up, then timed) of the text stream on the device, moved there once."""
        if (rows, tokens) not in self._on_device:
            ids = self.ids_for(rows)
            count = self.args.text_warmup + self.args.text_batches
            self._on_device[(rows, tokens)] = text_batches(ids, tokens, count, self.device)
        return self._on_device[(rows, tokens)]


def _copy_ceilings(device: str) -> dict:
    """On a GPU, the pinned H2D memcpy and D2D copy bandwidth the lookups are compared with."""
    ceiling = {}
    if device == "cuda":
        ceiling["h2d_gbps"] = h2d_bandwidth_gbps()
        ceiling.update(copy_bandwidth_gbps(device="cuda"))
        log.info("ceilings: H2D %.1f GB/s, D2D %.0f GB/s", ceiling["h2d_gbps"], ceiling["d2d_gbps"])
    return ceiling


def _tier_store(tier: str, args, n_rows: int, device: str) -> tuple[LayerStore, dict | None]:
    """The table of a tier, filled with random rows, and for the disk tier what its setup measured."""
    if tier == "hbm":
        hbm_rows = min(n_rows, int(args.hbm_gib * 2**30) // ROW_BYTES)
        raw = torch.empty((hbm_rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
        fill_table(raw)
        return HbmStore("fp8_interleaved", HEAD_DIM, raw), None
    if tier == "host":
        return host_store(n_rows, "pageable" if device == "cpu" else args.host_alloc), None
    return disk_store(int(args.disk_gib * 2**30) // ROW_BYTES, args.disk_dir, args.dram_cache_gib)


def run_lookup(args) -> list[dict]:
    """Every tier's rows: each stream measured `--rounds` times per batch size, each round with a
    fresh engine and followed by its exactness checks."""
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    info = machine_info()
    rows_out: list[dict] = []
    ceiling = _copy_ceilings(device)
    table_bytes = int(args.table_gib * 2**30)
    n_rows = table_bytes // ROW_BYTES
    batches = sorted(set(args.batch_tokens))
    gen = torch.Generator().manual_seed(0)
    text = _TextStream(args, batches, device)
    for tier in args.tiers:
        if tier == "hbm" and device != "cuda":
            continue
        store, disk_info = _tier_store(tier, args, n_rows, device)
        if tier == "disk":
            ceiling = {**ceiling, **disk_info, "page_cache_gib_before": page_cache_gib()}
        config = LookupConfig(
            cpu_fraction=min(1.0, max(0.0, args.cpu_fraction)),
            cpu_threads=args.cpu_threads,
            staging_chunk_rows=args.staging_chunk_rows,
            graphs=not args.eager_plans,
        )
        for stream in args.streams:
            for i in range(args.rounds):
                rows_out += _measure_round(
                    args,
                    store,
                    config,
                    tier,
                    stream,
                    i + 1,
                    batches=batches,
                    gen=gen,
                    text=text,
                    device=device,
                    ceiling=ceiling,
                    info=info,
                )
        if tier == "disk" and ceiling["page_cache_gib_before"] is not None:
            log.info(
                "page cache (Cached in /proc/meminfo): %.2f GiB before the disk tier's lookups, %.2f GiB after "
                "(the table file: %.1f GiB)",
                ceiling["page_cache_gib_before"],
                page_cache_gib(),
                store.nbytes / 2**30,
            )
        store.close()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def _measure_round(
    args,
    store: LayerStore,
    config: LookupConfig,
    tier: str,
    stream: str,
    round_no: int,
    *,
    batches: list[int],
    gen,
    text: _TextStream,
    device: str,
    ceiling: dict,
    info: dict,
) -> list[dict]:
    """One round of a tier and stream with a fresh engine (and, for the text stream, a fresh HBM
    row cache): a row per batch size and timing mode, then the round's exactness rows."""
    label = f" [round {round_no}]" if args.rounds > 1 else ""
    cached = stream == "text" and args.cache_fraction > 0
    cache = (
        RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16, device=device)
        if cached
        else None
    )
    rows = []
    with LookupEngine(store, device, cache=cache, config=config) as engine:
        engine.warm_up([tokens * N_COLS for tokens in batches])
        if tier == "host" and device == "cuda" and args.cpu_fraction < 0:
            if stream == "text":
                # Calibrated on the stream's own warm-up batches, with the cache (see `calibrate`).
                engine.calibrate(sample=text.sets_for(store.num_rows, max(batches))[: args.text_warmup])
            else:
                engine.calibrate(n_ids=16384 * N_COLS)
        for tokens in batches:
            for mode, seconds, hit_rate, unique, extra in measure_stream(
                engine, stream, tokens, store, args, gen, text.sets_for, device
            ):
                requested = tokens * N_COLS * ROW_BYTES
                gbps = requested / seconds / 1e9
                row = {
                    "bench": "lookup",
                    "tier": tier,
                    "stream": stream,
                    "mode": mode,
                    "tokens": tokens,
                    "table_gib": round(store.nbytes / 2**30, 2),
                    "row_bytes": ROW_BYTES,
                    "ms": seconds * 1e3,
                    "effective_gbps": gbps,
                    "cpu_fraction": engine.cpu_fraction if tier == "host" else None,
                    "cache_gib": round(cache.data.numel() / 2**30, 2) if cache is not None else 0.0,
                    "hit_rate": hit_rate,
                    "unique_fraction": unique,
                    "device": device,
                    "text_source": text.source if stream == "text" else None,
                    "round": round_no,
                    "graphs": engine.graphs,
                    **ceiling,
                    "machine": info,
                }
                _add_ratios(row, extra, ceiling)
                rows.append(row)
                _log_lookup(row, label)
        rows.extend(
            exactness_rows(
                engine, store, tier, stream, batches, round_no, label, gen, text.sets_for, device, splits=round_no == 1
            )
        )
    return rows


def _add_ratios(row: dict, extra: dict, ceiling: dict) -> None:
    """A lookup row's effective bandwidth over H2D, the stream's extra fields, the disk reads over
    the probed rate, and the page cache around a disk tier."""
    if "h2d_gbps" in ceiling:
        row["x_h2d"] = row["effective_gbps"] / ceiling["h2d_gbps"]
    row.update(extra)
    if "disk_rows_per_s" in extra and "probe_reads_per_s" in ceiling:
        row["x_probe"] = extra["disk_rows_per_s"] / ceiling["probe_reads_per_s"]
    if row["tier"] == "disk":  # the tier must not grow the kernel's page cache
        row["page_cache_gib_before"] = ceiling["page_cache_gib_before"]
        row["page_cache_gib"] = page_cache_gib()


def _log_lookup(row: dict, label: str) -> None:
    """One line per lookup row: its time, bandwidth, and for the text stream hit rate and unique fraction."""
    unique = row["unique_fraction"]
    log.info(
        "%s %s %s %6d tokens%s: %.3f ms, %.1f GB/s%s%s",
        row["tier"],
        row["stream"],
        row["mode"],
        row["tokens"],
        label,
        row["ms"],
        row["effective_gbps"],
        f" ({row['x_h2d']:.2f}x H2D)" if "x_h2d" in row else "",
        f", hit {row['hit_rate']:.2f}, unique {unique:.2f}" if unique is not None else "",
    )


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
        pts = sorted(
            (r["tokens"], r["effective_gbps"])
            for r in rows
            if (r["tier"], r["stream"], r.get("mode", "latency")) == key
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o" if key[2] == "latency" else "s",
            linestyle="-" if key[2] == "latency" else ":",
            label=" / ".join(key),
        )
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
    print(
        rows_table(
            [r for r in rows if r.get("bench") == "lookup"],
            [
                ("tier", "tier", ""),
                ("stream", "stream", ""),
                ("mode", "mode", ""),
                ("round", "round", "d"),
                ("tokens", "tokens", "d"),
                ("table_gib", "GiB", ".1f"),
                ("ms", "ms", ".3f"),
                ("effective_gbps", "GB/s", ".1f"),
                ("x_h2d", "x H2D", ".2f"),
                ("x_probe", "x probe", ".2f"),
                ("cpu_fraction", "cpu frac", ".2f"),
                ("hit_rate", "hit", ".2f"),
                ("unique_fraction", "uniq", ".2f"),
                ("dram_hit_rate", "DRAM hit", ".2f"),
                ("page_cache_gib", "Cached GiB", ".2f"),
            ],
        )
    )
    return rows


def add_arguments(p) -> None:
    """The options of ``condmem bench lookup``."""
    _add_table_arguments(p)
    _add_stream_arguments(p)
    _add_engine_arguments(p)


def add_table_arguments(p) -> None:
    """The host table size and where a disk tier's file and cache go (``bench lookup`` and ``bench e2e``)."""
    p.add_argument(
        "--table-gib",
        type=float,
        default=None,
        help="host table size in GiB (default: 64, or half the available memory if less)",
    )
    p.add_argument("--disk-dir", default=None, help="folder for the disk-tier file (default: the temp folder)")
    p.add_argument("--dram-cache-gib", type=float, default=1.0, help="DRAM row cache in front of the disk tier")


def _add_table_arguments(p) -> None:
    """The tables measured: their sizes per tier, and where the disk tier's file and cache go."""
    add_table_arguments(p)
    p.add_argument("--hbm-gib", type=float, default=16.0, help="HBM table size for the HBM tier (default 16)")
    p.add_argument(
        "--tiers",
        nargs="*",
        default=["hbm", "host"],
        choices=["hbm", "host", "disk"],
        help="tiers to measure (disk: a file of --disk-gib read with O_DIRECT, the device's random-read "
        "rate probed first; uniform ids are measured cold: fresh ids per lookup, DRAM cache "
        "emptied; the text stream in steady state through the DRAM cache)",
    )
    p.add_argument("--disk-gib", type=float, default=8.0, help="disk-tier table size in GiB (default 8)")


def _add_stream_arguments(p) -> None:
    """The id streams looked up: which, at which batch sizes, and how the text stream is warmed and timed."""
    p.add_argument(
        "--streams",
        nargs="+",
        default=["uniform", "text"],
        choices=["uniform", "text"],
        help="id streams: uniform random, or real text hashed with a V4.1-style layout",
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        nargs="+",
        default=[1, 64, 1024, 16384],
        help="tokens per lookup (decode batch .. prefill); each token reads 24 rows",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.1,
        help="HBM cache size as a fraction of the table (text stream; 0 disables)",
    )
    p.add_argument("--text-batches", type=int, default=50, help="consecutive text batches timed (steady state)")
    p.add_argument(
        "--text-warmup",
        type=int,
        default=300,
        help="text batches run before timing, bringing the cache to its steady state (default 300: "
        "~5M tokens, about 30M distinct rows at 16K tokens per batch, more than a 10%% cache holds)",
    )


def _add_engine_arguments(p) -> None:
    """How the engine runs and is timed: host memory, rounds, plans, the CPU share and its threads, repeats."""
    p.add_argument(
        "--host-alloc",
        default="mmap_register",
        choices=["mmap_register", "cuda_host_alloc"],
        help="host memory strategy",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each tier and stream this many times, each with a fresh engine (machines drift "
        "within a run: the spread says how much)",
    )
    p.add_argument(
        "--eager-plans",
        action="store_true",
        help="launch each lookup's plan kernel by kernel instead of replaying it as a CUDA graph "
        "(to compare; the rows are identical)",
    )
    p.add_argument(
        "--cpu-fraction",
        type=float,
        default=-1.0,
        help="share of host misses gathered by CPU threads; negative: calibrate at start (default)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per uniform batch set")
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="threads of the CPU gather (default: one fewer than the cores torch uses)",
    )
    p.add_argument(
        "--staging-chunk-rows",
        type=int,
        default=STAGING_CHUNK_ROWS,
        help=f"rows per pinned staging chunk of the CPU share (default {STAGING_CHUNK_ROWS})",
    )


def resolve_defaults(args) -> None:
    """Fill `--table-gib` from the machine when not given."""
    if args.table_gib is None:
        from condmem.tables.host_memory import mem_available

        avail = mem_available() or 0
        args.table_gib = min(64.0, max(0.01, avail / 2**30 / 2))
