"""One `SparseAdam.step` of a table: the torch path against the fused Triton path, and both against
the memory-bandwidth bound.

For each k (unique rows a step) and each pattern, ``fresh`` (every row new to the optimizer:
all k get slots) and ``repeated`` (the same k rows every step, all with state), both paths
start from the same table and take the same gradients (sparse, coalesced, made beforehand);
the state buffers are allocated for the whole table first, so no step grows them. A case's
time is a loop of ``--steps`` steps, synchronized before and after, per step (the torch path
syncs inside every step; the fused one never). The bound is the bytes the fused step must move
(per row: gradient read, row read and written, both moments and the step count read and
written, id, slot and its update) over the device's copy bandwidth measured in the same run
(``dst.copy_(src)`` of 1 GiB: read + written bytes per second). After the timed steps, rows and
exported state of the two paths are compared with ``torch.equal``. Writes
``sparse_adam_step.json`` under ``--out`` and prints a table last.

    PYTHONPATH=src python3 benchmarks/sparse_adam_step.py --out $OUT
    PYTHONPATH=src python3 benchmarks/sparse_adam_step.py --smoke --out /tmp/x  # CPU, interpreter

On the CPU (``--smoke``) the fused path runs in Triton's interpreter (times mean nothing) and
the rows may part from the torch path's by its CPU sqrt's rounding (`condmem.ops.sparse_adam_triton`);
moments, steps and slots are equal there too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels on CPU tensors

import torch

from condmem.bench.harness import machine_info
from condmem.train.optim import SparseAdam

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes read plus written per second by ``dst.copy_(src)`` of `nbytes`."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def step_bytes(k: int, dim: int, dtype: torch.dtype, fresh: bool) -> int:
    """Bytes the fused step moves at least: per row the gradient, the row (read, written), both
    moments and the step count (read unless fresh, written), its id, its slot (read; written if
    fresh) and its fresh flag and rank (written, read)."""
    size = torch.finfo(dtype).bits // 8
    state = (1 if fresh else 2) * (2 * dim * 4 + 4)
    return k * (dim * size + 2 * dim * size + state + 8 + (8 if fresh else 4) + 4 * 4)


def case_rows(pattern: str, k: int, rows: int, n_steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Sorted unique row ids of every step: new ones each step, or the same ones."""
    if pattern == "repeated":
        ids = torch.randperm(rows, generator=gen)[:k].sort().values
        return [ids] * n_steps
    perm = torch.randperm(rows, generator=gen)[: k * n_steps]
    return [perm[i * k : (i + 1) * k].sort().values for i in range(n_steps)]


def make_pair(init: torch.Tensor, fused: bool) -> tuple[torch.nn.Parameter, SparseAdam]:
    p = torch.nn.Parameter(init.clone())
    opt = SparseAdam([p], lr=1e-3, betas=(0.9, 0.95), fused=fused)
    SparseAdam._grow(opt._state(p), p.shape[0], p.shape[0])  # no growth inside the timed steps
    return p, opt


def run_case(args, device, init, pattern: str, k: int, gen: torch.Generator) -> dict:
    n_steps = args.warmup + args.steps
    ids = case_rows(pattern, k, init.shape[0], n_steps, gen)
    grads = []
    for rows in ids:
        values = torch.randn(k, init.shape[1], generator=gen).to(device, init.dtype)
        # Sorted unique ids, flagged coalesced: the step's coalesce() returns the gradient as it is.
        grads.append(
            torch.sparse_coo_tensor(
                rows[None].to(device), values, tuple(init.shape), is_coalesced=True, check_invariants=False
            )
        )
    out = {"k": k, "pattern": pattern}
    tables = {}
    for name, fused in (("torch", False), ("fused", True)):
        p, opt = make_pair(init, fused)
        for i, g in enumerate(grads):
            if i == args.warmup:
                sync(device)
                t0 = time.perf_counter()
            p.grad = g
            opt.step()
        sync(device)
        out[f"{name}_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
        tables[name] = (p, opt)
    (ref_p, ref_opt), (p, opt) = tables["torch"], tables["fused"]
    want, got = ref_opt.export_state({ref_p: "t"}), opt.export_state({p: "t"})
    out["equal"] = {"rows": torch.equal(ref_p, p), "state": all(torch.equal(want[n], got[n]) for n in want)}
    if not out["equal"]["rows"]:
        diff = (ref_p.detach().double() - p.detach().double()).abs()
        out["rows_max_abs_diff"] = float(diff.max())
    del tables, grads
    return out


def report(result: dict) -> str:
    lines = [
        f"sparse_adam_step: {result['rows']:,} x {result['dim']} {result['dtype']} table on {result['device']}, "
        f"copy bandwidth {result['copy_gbps']:.0f} GB/s",
        f"{'k':>8} {'pattern':>9} {'torch ms':>9} {'fused ms':>9} {'speedup':>8} {'bound ms':>9} "
        f"{'torch/bound':>11} {'fused/bound':>11} {'equal rows/state':>17}",
    ]
    for c in result["cases"]:
        eq = f"{c['equal']['rows']}/{c['equal']['state']}"
        lines.append(
            f"{c['k']:>8,} {c['pattern']:>9} {c['torch_ms']:9.3f} {c['fused_ms']:9.3f} {c['speedup']:8.2f} "
            f"{c['bound_ms']:9.3f} {c['torch_vs_bound']:11.2f} {c['fused_vs_bound']:11.2f} {eq:>17}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="a tiny CPU run through the interpreter")
    ap.add_argument("--rows", type=int, default=1 << 24, help="table rows (16M)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--k", type=int, nargs="+", default=[100_000, 400_000], help="unique rows a step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a case")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (compiles)")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.dim, args.k, args.steps, args.warmup = 4096, 8, [100, 400], 2, 1
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if max(args.k) * (args.warmup + args.steps) > args.rows:
        ap.error(f"fresh rows: k * (warmup + steps) = {max(args.k) * (args.warmup + args.steps):,} > rows")
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(args.rows, args.dim, generator=gen).to(dtype).to(device)
    bandwidth = copy_bandwidth(device, (16 << 20) if args.smoke else (1 << 30))
    cases = []
    for k in args.k:
        for pattern in ("fresh", "repeated"):
            case = run_case(args, device, init, pattern, k, gen)
            case["bytes"] = step_bytes(k, args.dim, dtype, pattern == "fresh")
            case["bound_ms"] = case["bytes"] / bandwidth * 1e3
            case["speedup"] = case["torch_ms"] / case["fused_ms"]
            case["fused_vs_bound"] = case["fused_ms"] / case["bound_ms"]
            case["torch_vs_bound"] = case["torch_ms"] / case["bound_ms"]
            cases.append(case)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {
        "bench": "sparse_adam_step",
        "device": str(device),
        "rows": args.rows,
        "dim": args.dim,
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "copy_gbps": bandwidth / 1e9,
        "cases": cases,
        "machine": machine_info(),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sparse_adam_step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(report(result), flush=True)


if __name__ == "__main__":
    main()
