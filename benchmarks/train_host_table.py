"""Training with Engram tables in host memory (`HostTables`) against tables in HBM, one GPU.

Runs of the same model on the same batches, in one process, the process's HBM capped
(`torch.cuda.set_per_process_memory_fraction`) so that the big table cannot live in HBM:

* ``hbm``: the table a model parameter in HBM, `SparseAdam` on the GPU (a size both fit);
* ``host``: the same table (same initial rows) in page-locked host memory, Adam on the host;
* ``host_device_adam``: as ``host`` with ``adam="device"`` (Adam on the GPU, the host stores);
* ``host_big`` / ``host_big_device_adam``: a table whose weights + Adam state (>= 60 GiB by
  default) exceed the HBM the backbone leaves free under the cap, in host memory, with Adam
  on the host / on the GPU (``--big-adam``).

Every run goes in alternating rounds (``--rounds``); each reports its best round and lists
them all, and the ratios to ``hbm`` are given best against best and median against median. The
trainer leaves each run's first 3 steps out of its tokens/s.

Before the big allocation a small page-locked probe measures the fill and page-lock rates,
and the big table is shrunk to what ``--max-setup-s`` allows. Writes ``train_host_table.json``
and ``train_host_table.png`` (loss curves) under ``--out`` and prints a table last.

    PYTHONPATH=src python benchmarks/train_host_table.py --out $OUT
    PYTHONPATH=src python benchmarks/train_host_table.py --device cpu --tiny --out /tmp/x   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from condmem.models import DecoderLM
from condmem.train.build import build_model_config
from condmem.train.host_table import HostTables
from condmem.train.loop import TrainConfig, Trainer
from condmem.train.pipeline import prepare_data
from condmem.train.presets import Preset, get_preset
from condmem.utils.code_version import short_commit

GiB = 2**30


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def commit() -> str:
    return short_commit() or "unknown"


def preset_for(args, table_size: int) -> Preset:
    engram = {"table_size": table_size} if args.tiny else {"table_size": table_size, "n_heads": 8, "head_dim": 32}
    return get_preset("tiny" if args.tiny else "gpu", {"engram": engram})


def train_config(args, preset: Preset) -> TrainConfig:
    return dataclasses.replace(
        preset.train,
        steps=args.steps,
        warmup_steps=max(1, args.steps // 10),
        eval_every=0,
        eval_tokens=4096 if args.tiny else 65_536,
        log_every=max(1, args.steps // 5),
        seed=0,
    )


def _slowest(out: dict) -> str:
    """', slowest step N: S s (host wait W s), median M s' for a run's line ('' without steps)."""
    times = out["step_seconds"]
    if not times:
        return ""
    i = out["slowest_steps"][0]
    waits = out["step_host_wait_seconds"]
    wait = f" (host wait {waits[i - 1]:.3f} s)" if waits else ""
    return f", slowest step {i}: {times[i - 1]:.3f} s{wait}, median {statistics.median(times):.3f} s"


def _time_steps(trainer: Trainer, tables) -> tuple[list[float], list[float]]:
    """Record each training step's wall seconds, and the host tier's wait in it, into the two lists returned."""
    times, waits = [], []
    step = trainer.train_step

    def timed(i: int):
        t0, w0 = time.perf_counter(), tables.wait_s if tables is not None else 0.0
        out = step(i)  # ends on the loss's host read: the step's work is done
        times.append(time.perf_counter() - t0)
        waits.append((tables.wait_s if tables is not None else 0.0) - w0)
        return out

    trainer.train_step = timed
    return times, waits


def run(name: str, args, data, table_size: int, device: torch.device, tier: str, adam: str = "host") -> dict:
    """Train one model; returns its numbers (history, tok/s, memory)."""
    preset = preset_for(args, table_size)
    cfg = build_model_config(preset, data)
    tc = train_config(args, preset)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    table_device = "meta" if tier == "host_init" else None
    model = DecoderLM(cfg, token_lookup=data.ctok.lookup, seed=0, device=device, table_device=table_device)
    tables = None
    if tier != "hbm":
        tables = HostTables(model, device, threads=args.threads, seed=0, adam=adam)
    setup_s = time.perf_counter() - t0
    table_params = tables.table_params if tables is not None else sum(p.numel() for _, p in model.table_parameters())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    rss1 = rss_bytes()
    trainer = Trainer(
        model, tc, data.train, data.val, data.token_bytes, device, label=name, progress=False, host_tables=tables
    )
    step_times, step_waits = _time_steps(trainer, tables)
    try:
        summary = trainer.fit()
        out = {
            "name": name,
            "tier": "hbm" if tier == "hbm" else "host",
            "table_size": table_size,
            "table_params": table_params,
            "table_gib_fp32": table_params * 4 / GiB,
            "tokens_per_s": trainer.tokens_per_s,
            "steps": trainer.step,
            "tokens_per_step": tc.batch_size * tc.seq_len,
            "val_loss": summary["val_loss"],
            "state_rows": summary["sparse_state_rows"],
            "setup_s": setup_s,
            "huge_page_coverage": tables.huge_page_coverage() if tables is not None else None,
            "history": [{"step": h["step"], "loss": h["loss"]} for h in trainer.history],
            # Per step: its wall seconds and the main thread's wait for the host tier, so that a
            # slow round shows where (which steps, and whether the host tier was waited for).
            "step_seconds": step_times,
            "step_host_wait_seconds": step_waits if tables is not None else None,
            "slowest_steps": sorted(range(1, len(step_times) + 1), key=lambda i: -step_times[i - 1])[:5],
            "rss_before_gib": rss0 / GiB,
            "rss_after_setup_gib": rss1 / GiB,
            "rss_peak_run_gib": rss_bytes() / GiB,
        }
        if device.type == "cuda":
            out["hbm_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
            out["hbm_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB
        if tables is not None:
            out.update(
                host_bytes=tables.host_bytes,
                host_gib=tables.host_bytes / GiB,
                host_bytes_per_param=tables.host_bytes / table_params,
                setup_seconds=tables.setup_seconds,
                host_wait_s=tables.wait_s,
                host_state_dtype="fp32",
                threads=args.threads,
                adam=adam,
                rss_bytes_per_param=(rss1 - rss0) / table_params,
            )
        else:
            opt = trainer.sparse
            state_bytes = sum(
                t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
            )
            out.update(
                table_bytes=table_params * 4,
                adam_state_bytes=state_bytes,
                hbm_bytes_per_param=(table_params * 4 + state_bytes) / table_params,
            )
        print(
            f"[{name}] {out['tokens_per_s']:,.0f} tok/s, val loss {out['val_loss']:.4f}, "
            f"table {out['table_gib_fp32']:.2f} GiB fp32, setup {setup_s:.1f} s"
            + (f", huge pages {out['huge_page_coverage']:.0%}" if out.get("huge_page_coverage") is not None else "")
            + _slowest(out),
            flush=True,
        )
        return out
    finally:
        if tables is not None:
            tables.close()
        del trainer, model, tables
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def probe_pin(device: torch.device, threads: int, gib: float) -> dict:
    """Fill and page-lock `gib` GiB the way HostTables does; GiB/s of each."""
    from condmem.train.host_table import _fill_zero, _host_tensor

    seconds: dict = {}
    n = int(gib * GiB) // 4
    t, buf = _host_tensor((n,), torch.float32, device.type == "cuda", _fill_zero(threads), seconds)
    del t  # before close(): a live view keeps the mapping
    if buf is not None:
        buf.close()
    return {
        "gib": gib,
        "fill_gib_s": gib / max(seconds["fill"], 1e-9),
        "pin_gib_s": gib / max(seconds.get("pin", 0.0), 1e-9) if seconds.get("pin") else None,
    }


def plot_losses(runs: dict, machine: str, path: Path) -> None:
    """The runs' training-loss curves, labelled with table size and tokens/s, to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(
            [h["step"] for h in r["history"]],
            [h["loss"] for h in r["history"]],
            label=f"{name}: {r['table_gib_fp32']:.1f} GiB table, {r['tokens_per_s']:,.0f} tok/s",
            lw=1,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Engram table in HBM vs host memory ({machine})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--small-table-size", type=int, default=1_000_000, help="buckets per column, hbm and host")
    ap.add_argument("--big-gib", type=float, default=61.0, help="host_big: table weights + Adam state, GiB")
    ap.add_argument("--hbm-cap-gib", type=float, default=32.0, help="the process's HBM cap")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-setup-s", type=float, default=150.0, help="shrink host_big to fit this setup time")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument(
        "--big-adam",
        choices=["host", "device"],
        nargs="+",
        default=["host", "device"],
        help="where the big runs put Adam: one big run for each",
    )
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of every run")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["hbm", "host", "host_device_adam"],
        choices=["hbm", "host", "host_device_adam"],
        help="the runs at the table size both tiers fit (hbm is the reference: always run)",
    )
    args = ap.parse_args()
    if "hbm" not in args.modes:
        args.modes.append("hbm")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(args.threads)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "command": "python benchmarks/train_host_table.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": args.threads,
        "runs": {},
    }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.hbm_cap_gib * GiB / total), device)
        result.update(gpu=torch.cuda.get_device_name(device), hbm_total_gib=total / GiB, hbm_cap_gib=args.hbm_cap_gib)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    result["host_mem_total_gib"] = int(meminfo[0].split()[1]) / 2**20

    t0 = time.perf_counter()
    data = prepare_data(
        "stdlib",
        vocab_size=320 if args.tiny else 4096,
        max_train_bytes=2_000_000 if args.tiny else 8_000_000,
        tokenizer_train_bytes=1_000_000 if args.tiny else 2_000_000,
        seed=0,
    )
    result["data_seconds"] = time.perf_counter() - t0
    print(f"data ready in {result['data_seconds']:.1f} s", flush=True)

    warm = argparse.Namespace(**dict(vars(args), steps=6))
    run("warm-up", warm, data, args.small_table_size, device, "hbm")  # compiles kernels; not reported
    json_path = out_dir / "train_host_table.json"
    big_size = None
    if not args.skip_big:
        probe = probe_pin(device, args.threads, 0.5 if args.tiny else 4.0)
        result["pin_probe"] = probe
        rate = 1 / (1 / probe["fill_gib_s"] + (1 / probe["pin_gib_s"] if probe["pin_gib_s"] else 0))
        state_b = 12 + 4 / 32 + 1 / 32  # per parameter: weight, two moments; per row: step, marker (head_dim 32)
        big_gib = min(args.big_gib, rate * args.max_setup_s)
        if args.tiny:
            big_gib = min(big_gib, 0.25)
        head_dim = get_preset("tiny").engram.head_dim if args.tiny else 32
        n_cols = 2 * (get_preset("tiny").engram.n_heads if args.tiny else 8)
        big_size = int(big_gib * GiB / state_b / head_dim / n_cols)
        result["big_plan"] = {
            "asked_gib": args.big_gib,
            "probe_rate_gib_s": rate,
            "planned_gib": big_gib,
            "table_size": big_size,
        }
        print(
            f"pin probe: fill {probe['fill_gib_s']:.1f} GiB/s, pin {probe['pin_gib_s'] or 0:.1f} GiB/s -> "
            f"host_big {big_gib:.1f} GiB (table_size {big_size:,})",
            flush=True,
        )

    # Every mode once a round, rounds alternating (a machine's drift shows as the spread of one
    # mode's rounds); each mode reports its best round and lists them all.
    small = {
        "hbm": {"tier": "hbm"},
        "host": {"tier": "host"},
        "host_device_adam": {"tier": "host", "adam": "device"},
    }
    plan = [(name, args.small_table_size, kw) for name, kw in small.items() if name in args.modes]
    if big_size is not None:
        plan += [
            ("host_big" if adam == "host" else f"host_big_{adam}_adam", big_size, {"tier": "host_init", "adam": adam})
            for adam in args.big_adam
        ]
    for rnd in range(args.rounds):
        for name, size, kw in plan:
            try:
                out = run(name, args, data, size, device, **kw)
            except Exception as exc:  # noqa: BLE001 - a big allocation may fail: recorded, the rest stand
                result[f"{name}_error"] = repr(exc)
                print(f"{name} failed: {exc!r}", flush=True)
                continue
            best = result["runs"].get(name)
            rounds = (best["rounds_tokens_per_s"] if best else []) + [out["tokens_per_s"]]
            if best is None or out["tokens_per_s"] > best["tokens_per_s"]:
                best = out
            result["runs"][name] = dict(best, rounds_tokens_per_s=rounds)
            json_path.write_text(json.dumps(result, indent=1) + "\n")

    runs = result["runs"]
    hbm = runs["hbm"]
    for name, r in runs.items():
        if name != "hbm":  # best round against best round, and median against median
            result[f"ratio_{name}_vs_hbm"] = r["tokens_per_s"] / hbm["tokens_per_s"]
            result[f"ratio_{name}_vs_hbm_median"] = statistics.median(r["rounds_tokens_per_s"]) / statistics.median(
                hbm["rounds_tokens_per_s"]
            )
    bigs = [name for name in runs if name.startswith("host_big")]
    if bigs:
        big = runs[bigs[0]]
        if device.type == "cuda":
            backbone_peak = big["hbm_peak_allocated_gib"]
            result["hbm_left_by_backbone_gib"] = args.hbm_cap_gib - backbone_peak
            result["host_big_exceeds_free_hbm"] = big["host_gib"] > args.hbm_cap_gib - backbone_peak
        # per-parameter GPU bytes of the HBM tier: its peak above the host tier's (same model, same batches)
        host = runs.get("host")
        if "hbm_peak_allocated_gib" in hbm and host is not None:
            result["hbm_tier_gpu_bytes_per_param_measured"] = (
                (hbm["hbm_peak_allocated_gib"] - host["hbm_peak_allocated_gib"]) * GiB / hbm["table_params"]
            )
            # per-parameter GPU bytes of the host tier: a big run's peak above the small run with
            # Adam in the same place (what grows with the table, not with the batch)
            for name in bigs:
                small_run = runs.get("host" if runs[name].get("adam") == "host" else "host_device_adam")
                if small_run is None:
                    continue
                result[f"{name}_gpu_bytes_per_param_measured"] = (
                    (runs[name]["hbm_peak_allocated_gib"] - small_run["hbm_peak_allocated_gib"])
                    * GiB
                    / (runs[name]["table_params"] - small_run["table_params"])
                )
    json_path.write_text(json.dumps(result, indent=1) + "\n")

    plot_losses(runs, result.get("gpu", args.device), out_dir / "train_host_table.png")

    print(
        f"\n{'run':<22} {'table GiB':>9} {'host GiB':>9} {'HBM peak GiB':>12} {'RSS GiB':>8} {'setup s':>8} "
        f"{'tok/s':>10} {'vs hbm':>7} {'val loss':>9}  rounds (tok/s)"
    )
    for name, r in runs.items():
        print(
            f"{name:<22} {r['table_gib_fp32']:>9.2f} {r.get('host_gib', 0):>9.2f} "
            f"{r.get('hbm_peak_allocated_gib', float('nan')):>12.2f} {r['rss_peak_run_gib']:>8.2f} "
            f"{r['setup_s']:>8.1f} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / hbm['tokens_per_s']:>7.3f} "
            f"{r['val_loss']:>9.4f}  " + " ".join(f"{t:,.0f}" for t in r.get("rounds_tokens_per_s", []))
        )


if __name__ == "__main__":
    main()
