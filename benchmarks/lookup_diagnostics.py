"""Engineering diagnostics of table lookups (host tier, GPU): where a host lookup's time goes.

Not part of the installed package: run from the repository,
``PYTHONPATH=src python3 benchmarks/lookup_diagnostics.py --help``. The user-facing
measurement is ``condmem bench lookup``; this script takes it apart:

* `cpu_gather_rows`: the CPU gather alone (torch vs the native gather, random vs sorted ids);
* `phase_rows`: each step of a lookup timed alone (dedup, ids to host, CPU gather, H2D,
  zero-copy gather and its locality, expand);
* `gather_under_load`: the native gather alone and beside GPU traffic, threading variants,
  and the host's own memcpy bandwidth;
* `pipeline_trace`: a torch profiler trace (chrome://tracing) of consecutive pipelined
  lookups at given CPU shares: what overlaps with what, on every stream and thread;
* `plan_costs`: a lookup's plan and its cache admission timed alone on the device, graphs
  or kernel by kernel, Triton or torch cache ops, on the text stream at steady state. Reads
  no table, so it needs none: it isolates the cache path's own cost;
* `lookup_kernel_row`: the device time per kernel of a pipelined lookup.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from condmem.bench.lookup_setup import N_COLS, ROW_BYTES
from condmem.bench.lookup_timing import time_pipelined
from condmem.tables.lookup import LookupConfig, LookupEngine, run_pipelined
from condmem.tables.lookup_plan import LookupPlan, fill_plan_ids, plan_bucket
from condmem.tables.row_cache import RowCache
from condmem.tables.storage import LayerStore

log = logging.getLogger("condmem.bench")


def cpu_gather_rows(store: LayerStore, info: dict, ceiling: dict, n_ids: int = 16384 * N_COLS) -> list[dict]:
    """CPU gather rate alone (no GPU), torch.index_select vs the native prefetching gather, random and sorted ids."""
    from unittest import mock

    from condmem import native as native_gather

    gen = torch.Generator().manual_seed(1)
    # Fresh ids for every timed call: repeating one set would time rows left in the caches and TLBs.
    id_sets = [torch.randint(0, store.num_rows, (n_ids,), generator=gen) for _ in range(6)]
    out = torch.empty((n_ids, store.row_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    rows = []
    impls = [("torch", False)] + ([("native", True)] if native_gather.available() else [])
    for impl, native in impls:
        with mock.patch.object(native_gather, "available", lambda: native):  # torch: index_select
            for order, sets in (("random", id_sets), ("sorted", [i.sort().values for i in id_sets])):
                store.gather_raw(sets[0], out=out)
                times = []
                for batch in sets[1:]:
                    t0 = time.perf_counter()
                    store.gather_raw(batch, out=out)
                    times.append(time.perf_counter() - t0)
                sec = sorted(times)[2]
                rows.append(
                    {
                        "bench": "cpu_gather",
                        "tier": store.tier,
                        "stream": f"cpu-{impl}-{order}",
                        "tokens": n_ids // N_COLS,
                        "ids": n_ids,
                        "ms": sec * 1e3,
                        "rows_per_s": n_ids / sec,
                        "effective_gbps": n_ids * store.row_bytes / sec / 1e9,
                        "threads": torch.get_num_threads(),
                        "table_gib": round(store.nbytes / 2**30, 2),
                        **ceiling,
                        "machine": info,
                    }
                )
                log.info(
                    "CPU gather %s %s: %.2f ms, %.0fM rows/s, %.1f GB/s",
                    impl,
                    order,
                    sec * 1e3,
                    n_ids / sec / 1e6,
                    rows[-1]["effective_gbps"],
                )
    return rows


def phase_rows(store: LayerStore, info: dict, ceiling: dict, tokens: int = 16384) -> list[dict]:
    """Each step of a host lookup timed alone on the same uniform batch (GPU), to show where the time goes.

    unique (dedup + sort), ids to host, CPU gather of all misses, H2D of all rows, zero-copy
    gather of all misses, expand (inverse gather + dequant from HBM).
    """
    from condmem.bench.harness import gpu_time_ms
    from condmem.ops.gather import engram_gather
    from condmem.tables.lookup_plan import as_words

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).cuda()
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    n = uniq.numel()
    staging = torch.empty((n, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
    compact = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
    host_ids = torch.empty(n, dtype=torch.int64, pin_memory=True)
    words = as_words(store.raw)

    # The CPU gather gets fresh sorted ids per call (a repeated set would be timed from warm caches).
    from condmem.bench.harness import Rotator

    fresh = [(torch.randint(0, store.num_rows, (n,), generator=gen).sort().values,) for _ in range(7)]
    cpu_gather = Rotator(lambda batch: store.gather_raw(batch, out=staging), fresh)

    def cpu_timed(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[reps // 2]

    # Zero-copy cost vs locality: the same number of rows in groups of 4 that share 1 KiB
    # (adjacent rows) or ~48 KiB (rows 60 apart). Equal times: per-row cost; the spread
    # group cheaper than uniform but dearer than adjacent: a translation granule in between.
    groups = torch.randint(0, store.num_rows // 256 - 1, (n // 4,), generator=gen).cuda() * 256
    adjacent = (groups[:, None] + torch.arange(4, device="cuda")).flatten().sort().values
    spread = (groups[:, None] + torch.arange(4, device="cuda") * 60).flatten().sort().values
    # Rows ~1300 apart: a group spans ~1 MiB: as cheap as adjacent rows only with 2 MiB GPU pages.
    groups_m = torch.randint(0, store.num_rows // 4096 - 1, (n // 4,), generator=gen).cuda() * 4096
    spread_m = (groups_m[:, None] + torch.arange(4, device="cuda") * 1300).flatten().sort().values
    phases = {
        "unique": gpu_time_ms(lambda: torch.unique(ids, sorted=True, return_inverse=True))["ms"],
        "ids_to_host": cpu_timed(lambda: host_ids.copy_(uniq, non_blocking=True)),
        "cpu_gather_all": cpu_timed(cpu_gather),
        "h2d_all": gpu_time_ms(lambda: compact.copy_(staging, non_blocking=True))["ms"],
        "zero_copy_all": gpu_time_ms(lambda: engram_gather(uniq, words))["ms"],
        "zero_copy_groups_of_4_in_1KiB": gpu_time_ms(lambda: engram_gather(adjacent, words))["ms"],
        "zero_copy_groups_of_4_in_48KiB": gpu_time_ms(lambda: engram_gather(spread, words))["ms"],
        "zero_copy_groups_of_4_in_1MiB": gpu_time_ms(lambda: engram_gather(spread_m, words))["ms"],
        "expand": gpu_time_ms(lambda: engram_gather(inverse, compact))["ms"],
    }
    rows = []
    for name, ms in phases.items():
        rows.append(
            {
                "bench": "lookup_phase",
                "tier": store.tier,
                "stream": f"phase-{name}",
                "tokens": tokens,
                "ids": ids.numel(),
                "unique": n,
                "ms": ms,
                "table_gib": round(store.nbytes / 2**30, 2),
                **ceiling,
                "machine": info,
            }
        )
        log.info("phase %-15s %.3f ms", name, ms)
    return rows


def gather_under_load(
    store: LayerStore, info: dict, ceiling: dict, n_ids: int = 16384 * N_COLS, repeats: int = 5
) -> list[dict]:
    """The native CPU gather of fresh sorted ids, alone and under the conditions the engine runs it in.

    Separates the causes of a slow in-engine gather: the calling thread (main vs a worker),
    chunking, the threading (one OpenMP team vs one OS thread per slice), and traffic on
    the GPU side while it runs (an H2D copy loop; a zero-copy gather loop on the same
    table). Each variant's median over `repeats` fresh id sets; ``overlapped`` says the GPU
    load was still running when the gather ended.
    """
    import concurrent.futures

    from condmem.ops.gather import engram_gather
    from condmem import native as native_gather
    from condmem.native import gather_rows as native_gather_rows
    from condmem.tables.lookup_plan import as_words

    if not native_gather.available():
        return []
    gen = torch.Generator().manual_seed(11)
    staging = torch.empty((n_ids, store.row_bytes), dtype=torch.uint8, pin_memory=True)
    threads = torch.get_num_threads()
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    worker = concurrent.futures.ThreadPoolExecutor(1)
    load_src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    load_dst = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    zc_ids = torch.randint(0, store.num_rows, (n_ids,), generator=gen).sort().values.cuda()
    words = as_words(store.raw)
    side = torch.cuda.Stream()

    def omp(ids, nthreads=threads):
        native_gather_rows(store.raw, ids, staging[: ids.numel()], nthreads)

    def chunked(ids, pieces=4):
        step = -(-ids.numel() // pieces)
        for s in range(0, ids.numel(), step):
            native_gather_rows(store.raw, ids[s : s + step], staging[s : s + step], threads)

    def os_threads(ids):
        step = -(-ids.numel() // threads)
        jobs = [
            pool.submit(native_gather_rows, store.raw, ids[s : s + step], staging[s : s + step], 1)
            for s in range(0, ids.numel(), step)
        ]
        for j in jobs:
            j.result()

    def h2d_load():
        with torch.cuda.stream(side):
            for _ in range(60):  # ~70 ms of copies at 55 GB/s
                load_dst.copy_(load_src, non_blocking=True)

    def zero_copy_load():
        with torch.cuda.stream(side):
            for _ in range(8):  # ~100 ms of zero-copy reads
                engram_gather(zc_ids, words)

    variants = {
        "omp, main thread": (omp, None),
        "omp, worker thread": (lambda ids: worker.submit(omp, ids).result(), None),
        "omp, 4 chunks": (chunked, None),
        "OS thread per slice": (os_threads, None),
        "omp, half the threads": (lambda ids: omp(ids, max(1, threads // 2)), None),
        "omp, during H2D copies": (omp, h2d_load),
        "omp, during zero-copy gather": (omp, zero_copy_load),
        "OS thread per slice, during H2D copies": (os_threads, h2d_load),
    }
    rows = []
    for name, (fn, load) in variants.items():
        times, overlapped = [], True
        for r in range(repeats + 1):
            ids = torch.randint(0, store.num_rows, (n_ids,), generator=gen).sort().values
            torch.cuda.synchronize()
            if load is not None:
                load()
                done = torch.cuda.Event()
                done.record(side)
                time.sleep(0.002)  # the load is under way before the gather starts
            t0 = time.perf_counter()
            fn(ids)
            sec = time.perf_counter() - t0
            if load is not None:
                overlapped &= not done.query()
            torch.cuda.synchronize()
            if r:
                times.append(sec)
        sec = sorted(times)[len(times) // 2]
        rows.append(
            {
                "bench": "gather_under_load",
                "tier": store.tier,
                "stream": name,
                "ids": n_ids,
                "tokens": n_ids // N_COLS,
                "ms": sec * 1e3,
                "rows_per_s": n_ids / sec,
                "overlapped": overlapped if load is not None else None,
                "threads": threads,
                "table_gib": round(store.nbytes / 2**30, 2),
                **ceiling,
                "machine": info,
            }
        )
        log.info(
            "gather under load: %-40s %6.2f ms  %5.0fM rows/s%s",
            name,
            sec * 1e3,
            n_ids / sec / 1e6,
            "" if load is None else f"  (load still running at the end: {overlapped})",
        )
    pool.shutdown()
    worker.shutdown()
    # The host's own copy bandwidth (read + write), the budget the gather, its staging writes
    # and the DMA reads of staging share.
    a = torch.empty(1 << 31, dtype=torch.uint8)
    b = torch.empty_like(a)
    a.fill_(1)
    b.copy_(a)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    gbps = 2 * a.numel() / sorted(times)[1] / 1e9
    rows.append(
        {
            "bench": "host_memcpy",
            "tier": "host",
            "stream": "host memcpy (read + write)",
            "gbps": gbps,
            "threads": threads,
            **ceiling,
            "machine": info,
        }
    )
    log.info("host memcpy, %d threads: %.1f GB/s (read + write counted)", threads, gbps)
    del a, b
    return rows


def pipeline_trace(
    store: LayerStore,
    batches: list[torch.Tensor],
    cpu_fraction: float,
    trace: Path,
    cache: RowCache | None = None,
    warm: list[torch.Tensor] | None = None,
) -> dict:
    """A torch profiler trace of `batches` looked up back to back at this CPU share (the plans
    warmed up first; `warm`: batches run before, e.g. to bring a cache to its steady state).
    Returns a result row with the pipeline's ms per lookup."""
    with LookupEngine(store, "cuda", cache=cache, config=LookupConfig(cpu_fraction=cpu_fraction)) as engine:
        engine.warm_up({ids.numel() for ids in batches})
        time_pipelined(engine, warm or batches[:3])
        engine.flush()
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as profiler:
            t0 = time.perf_counter()
            run_pipelined(engine, batches)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3 / len(batches)
        profiler.export_chrome_trace(str(trace))
    log.info(
        "pipeline cpu_fraction %.2f: %.3f ms per lookup; profiler trace (chrome://tracing) in %s",
        cpu_fraction,
        ms,
        trace,
    )
    return {
        "bench": "pipeline_trace",
        "cpu_fraction": cpu_fraction,
        "ms": ms,
        "trace": str(trace),
        "tokens": batches[0].shape[0],
        "cache": cache is not None,
    }


PLAN_VARIANTS = ("graphs", "eager", "graphs/torch", "eager/torch")
"""`plan_costs` variants: the plan replayed as CUDA graphs or launched kernel by kernel, and the
cache's probe and admission as Triton kernels (default on CUDA) or torch ops (``/torch``)."""


def plan_costs(
    num_rows: int,
    cache_rows: int,
    batches: list[torch.Tensor],
    warm: int,
    variants: list[str],
    info: dict,
    ceiling: dict,
    kernels: bool = False,
) -> list[dict]:
    """Median device ms of a plan (dedup, probe, hits, misses, split, counts to the host) and of
    its cache admission, each alone, per variant (`PLAN_VARIANTS`); the cache warmed on the
    first `warm` batches.

    The misses' rows are not fetched (their bytes are whatever `compact` holds): only the
    time of the plan's own kernels is measured. On the CPU (smoke runs) times are host times.
    `kernels`: also profile a few batches per variant and report each step's kernels by device time.
    """
    device = batches[0].device
    on_gpu = device.type == "cuda"
    rows = []
    for variant in variants:
        mode, _, backend = variant.partition("/")
        cache = RowCache(cache_rows, ROW_BYTES, ways=16, device=device, backend=backend or "auto")
        n = plan_bucket(batches[0].numel())
        plan = LookupPlan(n, ROW_BYTES, num_rows, device, cache, 1.0, 64 << 10, pin=on_gpu)
        capture = mode == "graphs" and on_gpu
        stream = torch.cuda.Stream() if on_gpu else None  # graphs are captured off the default stream
        times: dict[str, list[float]] = {"plan": [], "admit": []}
        with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
            if capture:
                plan.capture()
            for i, ids in enumerate(batches):
                fill_plan_ids(plan.ids, ids.reshape(-1))
                for name, step in (("plan", plan.run), ("admit", plan.admit)):
                    if on_gpu:
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        step()
                        end.record()
                        torch.cuda.synchronize()
                        ms = start.elapsed_time(end)
                    else:
                        t0 = time.perf_counter()
                        step()
                        ms = (time.perf_counter() - t0) * 1e3
                    if i >= warm:
                        times[name].append(ms)
        hit = cache.stats.hit_rate
        if kernels and on_gpu:
            rows.extend(plan_kernel_rows(plan, batches[warm : warm + 4], variant, stream, info))
        for name, ts in times.items():
            ts.sort()
            ms = ts[len(ts) // 2] if ts else float("nan")
            rows.append(
                {
                    "bench": "plan_cost",
                    "tier": "-",
                    "stream": f"text {name}",
                    "variant": variant,
                    "tokens": batches[0].shape[0],
                    "ids": n,
                    "ms": ms,
                    "hit_rate": hit,
                    **ceiling,
                    "machine": info,
                }
            )
            log.info(
                "plan cost [%s] %-5s %.3f ms (median of %d text batches, hit %.2f)", variant, name, ms, len(ts), hit
            )
        del plan, cache
    return rows


def kernel_times(run, per: int) -> dict[str, list]:
    """Device ms and launches per call of each kernel (and copy) that `run()` launches, over `per` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time / 1e3 / per
            entry[1] += 1
    return per_kernel


def kernel_row(per_kernel: dict[str, list], per: int, label: str, **fields) -> dict:
    """A result row of `kernel_times`, logged as a table of the costliest kernels."""
    top = sorted(((ms, count, k) for k, (ms, count) in per_kernel.items() if ms > 1e-3), reverse=True)
    total = sum(ms for ms, _, _ in top)
    log.info("kernels %s: %.3f ms of device time per call", label, total)
    for ms, count, kernel in top[:12]:
        log.info("    %7.3f ms  x%-4d %s", ms, count // max(1, per), kernel)
    return {
        "bench": "kernels",
        "label": label,
        "ms_total": total,
        **fields,
        "kernels": [{"name": k, "ms": ms, "launches": c // max(1, per)} for ms, c, k in top],
    }


def plan_kernel_rows(plan: LookupPlan, batches: list[torch.Tensor], variant: str, stream, info: dict) -> list[dict]:
    """Device time per kernel of the plan and the admission over `batches` (torch profiler), one
    row per step with its kernels sorted by total time: where the cache path's milliseconds go."""

    def run(admit: bool):
        with torch.cuda.stream(stream):
            for ids in batches:
                fill_plan_ids(plan.ids, ids.reshape(-1))
                plan.run()
                if admit:
                    torch.cuda.synchronize()
                    plan.admit()
                torch.cuda.synchronize()

    plan_only = kernel_times(lambda: run(False), len(batches))
    with_admit = kernel_times(lambda: run(True), len(batches))
    for kernel, (ms, count) in plan_only.items():  # the admission's own kernels: the difference
        if kernel in with_admit:
            with_admit[kernel][0] -= ms
            with_admit[kernel][1] -= count
    return [
        kernel_row(k, len(batches), f"[{variant}] {name}", variant=variant, step=name, machine=info)
        for name, k in (("plan", plan_only), ("admit", with_admit))
    ]


def lookup_kernel_row(engine: LookupEngine, sets: list[torch.Tensor], label: str, info: dict) -> dict:
    """Device time per kernel of one pipelined lookup (averaged over `sets`): what the GPU spends
    on a lookup besides waiting (plan, cache, gathers, copies, expand)."""
    per_kernel = kernel_times(lambda: time_pipelined(engine, sets), len(sets))
    return kernel_row(per_kernel, len(sets), label, step="lookup", machine=info)


def main(argv: list[str] | None = None) -> list[dict]:
    import argparse

    from condmem.bench.harness import append_rows, copy_bandwidth_gbps, machine_info, rows_table
    from condmem.bench.lookup_setup import h2d_bandwidth_gbps, host_store, text_batches, text_row_ids

    p = argparse.ArgumentParser(
        description="Where a host-tier lookup's time goes (see the module docstring). "
        "Appends JSON rows to <out>/lookup_diagnostics.json."
    )
    p.add_argument(
        "what",
        nargs="+",
        choices=["gather", "phases", "pipeline", "plan", "kernels"],
        help="gather: CPU gather alone and under GPU load; phases: each step alone; pipeline: profiler "
        "traces of pipelined lookups; plan: plan and admission alone per variant (no table); "
        "kernels: device time per kernel of a pipelined lookup",
    )
    p.add_argument("--table-gib", type=float, default=16.0, help="pinned host table size")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per lookup (x24 row ids)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.7, 1.0], help="CPU shares of the pipeline traces")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="HBM cache of the text stream, share of the table")
    p.add_argument("--text-warmup", type=int, default=100, help="text batches that warm the cache first")
    p.add_argument("--plan-variants", nargs="+", default=list(PLAN_VARIANTS), choices=PLAN_VARIANTS)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the code path only (plan)")
    p.add_argument("--out", default="/tmp/condmem-diagnostics")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info, ceiling = machine_info(), {}
    if device == "cuda":
        ceiling = {"h2d_gbps": h2d_bandwidth_gbps(), **copy_bandwidth_gbps(device="cuda")}
    n_rows = int(args.table_gib * 2**30) // ROW_BYTES
    need = args.tokens * (args.text_warmup + 12)
    text_ids, _ = text_row_ids(n_rows, need)
    text = text_batches(text_ids, args.tokens, min(args.text_warmup + 12, text_ids.shape[0] // args.tokens), device)
    warm = min(args.text_warmup, len(text) - 2)
    rows: list[dict] = []
    if "plan" in args.what:
        rows += plan_costs(
            n_rows,
            max(1, int(n_rows * args.cache_fraction)),
            text,
            warm,
            args.plan_variants,
            info,
            ceiling,
            kernels="kernels" in args.what,
        )
    host_work = {"gather", "phases", "pipeline", "kernels"} & set(args.what)
    if host_work and device == "cuda":
        store = host_store(n_rows, "mmap_register")
        gen = torch.Generator().manual_seed(0)
        uniform = [torch.randint(0, n_rows, (args.tokens, N_COLS), generator=gen).cuda() for _ in range(8)]
        if "gather" in args.what:
            rows += cpu_gather_rows(store, info, ceiling) + gather_under_load(store, info, ceiling)
        if "phases" in args.what:
            rows += phase_rows(store, info, ceiling, args.tokens)
        for fraction in args.fractions if "pipeline" in args.what else ():
            rows.append(pipeline_trace(store, uniform, fraction, out / f"lookup_trace_uniform_{fraction:.2f}.json"))
            cache = RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16, device="cuda")
            rows.append(
                pipeline_trace(
                    store,
                    text[warm:],
                    fraction,
                    out / f"lookup_trace_text_{fraction:.2f}.json",
                    cache=cache,
                    warm=text[:warm],
                )
            )
        if "kernels" in args.what:
            with LookupEngine(store, "cuda", config=LookupConfig(cpu_fraction=args.fractions[0])) as engine:
                engine.warm_up([args.tokens * N_COLS])
                rows.append(lookup_kernel_row(engine, uniform, f"host uniform {args.tokens} tokens", info))
        store.close()
    elif host_work:
        log.warning("%s: need a GPU; skipped", ", ".join(sorted(host_work)))
    append_rows(out / "lookup_diagnostics.json", rows)
    print(
        rows_table(
            [r for r in rows if "ms" in r],
            [
                ("bench", "bench", ""),
                ("stream", "what", ""),
                ("variant", "variant", ""),
                ("cpu_fraction", "cpu frac", ".2f"),
                ("ms", "ms", ".3f"),
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()
