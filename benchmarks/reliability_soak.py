"""Soak: many lookups of random sizes from 4 caller threads against a host and an HBM table, bad ids mixed in.

Each caller thread owns a `LookupEngine` (two read the page-locked host table, two the
same table copied to HBM). A lookup has 1..65536 tokens (log-uniform) of 24 row ids;
about 5% of lookups hold one id outside the table. Checked: every bad lookup raises
(and only it: the next good lookup of that engine is always compared), sampled good
lookups equal a plain gather of the table (`gather_reference`, NaN-aware `same_rows`),
and RSS, page-locked memory, GPU memory, threads and open files, sampled every 0.5 s,
do not grow. Writes ``reliability_soak_h200.json`` and ``.png`` into --out.

    python benchmarks/reliability_soak.py --out results/ --lookups 10000 --gib 4 --budget-s 200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from condmem.bench.harness import same_rows  # noqa: E402
from condmem.bench.lookup_setup import HEAD_DIM, ROW_BYTES, host_store  # noqa: E402
from condmem.ops.gather import gather_reference  # noqa: E402
from condmem.tables.lookup import LookupEngine  # noqa: E402
from condmem.tables.storage import HbmStore, LayerStore  # noqa: E402
from condmem.utils.code_version import code_commit  # noqa: E402

COLS = 24  # row ids per token: (N-1) x heads of DeepSeek-V4.1 (orders 2..4, 8 heads)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 if "kB" in line else int(line.split()[1])
    return 0


def sample(t0: float, done: int) -> dict:
    free, total = torch.cuda.mem_get_info()
    row = {
        "t": round(time.perf_counter() - t0, 3),
        "lookups": done,
        "rss": _status("VmRSS"),
        "locked": _status("VmLck") + _status("VmPin"),
        "threads": _status("Threads"),
        "open_files": len(os.listdir("/proc/self/fd")),
        "gpu_allocated": torch.cuda.memory_allocated(),
        "gpu_reserved": torch.cuda.memory_reserved(),
        "gpu_used": total - free,
    }
    try:
        row["pinned_host_allocated"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    except (AttributeError, RuntimeError):
        pass
    return row


def caller(
    k: int,
    engine: LookupEngine,
    store: LayerStore,
    n: int,
    seed: int,
    deadline: float,
    stats: dict,
    lock: threading.Lock,
    progress: list,
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = store.num_rows
    check_next = False
    for i in range(n):
        if time.perf_counter() > deadline:
            break
        tokens = int(math.exp(rng.uniform(0, math.log(65536))))
        bad = rng.random() < 0.05
        ids = torch.randint(0, rows, (tokens, COLS), device="cuda", generator=gen)
        if bad:
            ids.view(-1)[rng.randrange(ids.numel())] = rng.choice([-1, rows, rows + 12345, 2**40])
        torch.cuda.current_stream().synchronize()
        path = "direct" if ids.numel() <= engine.direct_max_ids else "full"
        t0 = time.perf_counter()
        outcome = None
        try:
            got = engine.lookup(ids).wait()
            torch.cuda.current_stream().synchronize()
        except Exception as exc:  # noqa: BLE001 - tallied by type
            outcome = f"raised {type(exc).__name__}"
        ms = (time.perf_counter() - t0) * 1e3
        key = f"{store.tier}/{path}/{'bad' if bad else 'good'}"
        checked = None
        if not bad and outcome is None and (check_next or i % 20 == 0):
            want = gather_reference(ids if store.tier == "hbm" else ids.cpu(), store.raw, head_dim=HEAD_DIM)
            checked = same_rows(got, want.to(got.device))
        with lock:
            stats["outcomes"][key][outcome or "returned"] += 1
            stats["ms"][f"{store.tier}/{path}"].append(ms)
            if checked is not None:
                stats["checked"][key]["exact" if checked else "WRONG"] += 1
            progress[0] += 1
        check_next = bad  # the lookup after a bad one is always compared: a failure stays with its lookup


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--lookups", type=int, default=10_000, help="total over the 4 threads")
    p.add_argument("--gib", type=float, default=4.0, help="table size")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting lookups after this long")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    rows = int(args.gib * 2**30) // ROW_BYTES
    t_build = time.perf_counter()
    host = host_store(rows, "mmap_register", progress=False)
    hbm = HbmStore("fp8_interleaved", HEAD_DIM, host.raw.to("cuda"))
    build_s = time.perf_counter() - t_build
    engines = [
        LookupEngine(host, "cuda"),
        LookupEngine(host, "cuda"),
        LookupEngine(hbm, "cuda"),
        LookupEngine(hbm, "cuda"),
    ]
    stores = [host, host, hbm, hbm]
    stats = {
        "outcomes": {
            f"{t}/{p}/{g}": Counter() for t in ("host", "hbm") for p in ("direct", "full") for g in ("good", "bad")
        },
        "checked": {f"{t}/{p}/good": Counter() for t in ("host", "hbm") for p in ("direct", "full")},
        "ms": {f"{t}/{p}": [] for t in ("host", "hbm") for p in ("direct", "full")},
    }
    lock = threading.Lock()
    progress = [0]
    t0 = time.perf_counter()
    samples = [sample(t0, 0)]
    stop = threading.Event()

    def sampler():
        while not stop.wait(0.5):
            samples.append(sample(t0, progress[0]))

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    deadline = t0 + args.budget_s
    threads = [
        threading.Thread(
            target=caller, args=(k, engines[k], stores[k], args.lookups // 4, 1000 + k, deadline, stats, lock, progress)
        )
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run_s = time.perf_counter() - t0
    samples.append(sample(t0, progress[0]))
    for e in engines:
        e.close()
    torch.cuda.synchronize()
    stop.set()
    watcher.join()
    after_close = sample(t0, progress[0])

    def growth(key: str) -> dict:
        steady = [s[key] for s in samples if s["lookups"] >= progress[0] * 0.2]
        half = len(steady) // 2
        a, b = steady[: max(1, half)], steady[half:] or steady
        return {
            "first_half_max": max(a),
            "second_half_max": max(b),
            "end": samples[-1][key],
            "after_close": after_close[key],
        }

    def pct(xs, q):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    commit = code_commit()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join(["python", "benchmarks/reliability_soak.py"] + sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "table_gib": round(rows * ROW_BYTES / 2**30, 2),
        "rows": rows,
        "build_s": round(build_s, 1),
        "lookups_done": progress[0],
        "lookups_asked": args.lookups,
        "run_s": round(run_s, 1),
        "outcomes": {k: dict(v) for k, v in stats["outcomes"].items()},
        "checked": {k: dict(v) for k, v in stats["checked"].items()},
        "latency_ms": {
            k: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": pct(v, 1.0)}
            for k, v in stats["ms"].items()
        },
        "growth": {
            k: growth(k)
            for k in ("rss", "locked", "threads", "open_files", "gpu_allocated", "gpu_reserved", "gpu_used")
        },
        "samples": samples,
    }
    (out / "reliability_soak_h200.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    try:
        plot(samples, out / "reliability_soak_h200.png", result)
    except ImportError as exc:
        print(f"no plot: {exc}")
    return 0


def plot(samples: list[dict], path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    panels = [
        ("RSS (GiB)", "rss", 2**30),
        ("locked host memory (GiB)", "locked", 2**30),
        ("GPU memory (GiB)", ("gpu_allocated", "gpu_reserved", "gpu_used"), 2**30),
        ("threads", "threads", 1),
        ("open files", "open_files", 1),
        ("lookups done", "lookups", 1),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for ax, (title, keys, scale) in zip(axes.flat, panels):
        for key in keys if isinstance(keys, tuple) else (keys,):
            ax.plot(t, [s[key] / scale for s in samples], label=key)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        if isinstance(keys, tuple):
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    fig.suptitle(
        f"condmem lookup soak, {result['gpu']}: {result['lookups_done']:,} lookups from 4 threads, "
        f"{result['table_gib']} GiB host + HBM tables ({result['date'][:10]}, {str(result['commit'])[:10]})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
