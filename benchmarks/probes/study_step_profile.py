"""Where the study's training step spends its time, and what compiling the blocks buys.

The `condmem study` gpu preset's backbones (dense at the MoE's active size, pure MoE, rho 0.8
with its Engram), trained by the library's `Trainer` on random tokens. For each: tokens/s and
model FLOPs utilisation (training FLOPs per token x tokens/s over a bf16 matmul ceiling measured
in the same run), eager and with every block compiled (`torch.compile`), and with `--profile` each
step's top CUDA kernels by time (torch.profiler), with the GPU's busy share of the wall time and its
idle gaps by size (a step bound by its kernels' hand-overs shows many short ones; one waiting on the host,
a few long ones).
`--deterministic` runs every variant in deterministic mode, as `condmem study` does by default.

    PYTHONPATH=src python3 benchmarks/probes/study_step_profile.py --out $OUT
    PYTHONPATH=src python3 benchmarks/probes/study_step_profile.py --deterministic --profile \
        --models moe --options eager compiled      # what the study's own step spends its time on
    PYTHONPATH=src python3 benchmarks/probes/study_step_profile.py --deterministic --profile --sources \
        --models moe --options compiled            # which op launched each kernel (graphs hide it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_step import VOCAB, commit, variants  # noqa: E402

from condmem.models import DecoderLM  # noqa: E402
from condmem.models.flops import train_flops_per_token  # noqa: E402
from condmem.train.data import TokenStream  # noqa: E402
from condmem.train.determinism import deterministic_mode, set_cublas_workspace  # noqa: E402
from condmem.train.loop import Trainer  # noqa: E402
from condmem.apps.study.sweep import STUDY_PRESETS, allocation_points  # noqa: E402
from condmem.utils.atomic import atomic_write_text  # noqa: E402


def matmul_ceiling(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0)


OPTIONS = {
    "eager": {},
    "compiled": {"compile": True},
    "compiled_queued": {"compile": True, "queued": True},
    "compiled_graphs": {"compile": True, "queued": True, "cuda_graphs": True},
}
"""eager / compiled: `TrainConfig.compile` (the blocks and the cross-entropy); queued: the steps queued
by `Trainer.queue_step` and their losses read once at the end (the study's loop reads them at its log
lines), instead of `train_step`'s read after every step; cuda_graphs: `TrainConfig.cuda_graphs`, the
compiled blocks also replayed as CUDA graphs (the gpu preset's step)."""


KERNEL_KINDS = (
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("attention", ("flash", "flex_attention")),  # SDPA's kernels; FlexAttention's as Inductor names them
    # "_weight_grad": condmem.ops.grouped_weight_grad
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "grouped", "_weight_grad")),
    ("softmax / cross-entropy", ("softmax", "nll_loss", "cross_entropy")),
    ("sort / top-k / search", ("sort", "topk", "searchsorted", "cub::")),
    ("index / gather / scatter", ("index", "gather", "scatter")),
    ("fused by Inductor (triton)", ("triton_",)),
    ("fill / copy", ("fill", "copy")),
    ("reduction (aten)", ("reduce_kernel",)),
    ("elementwise (aten)", ("elementwise",)),
)
"""Kernel families by name (the first that matches; a Triton kernel is named after the ops it fuses,
so one that fuses an index_select counts as index), for the profile's time per family."""


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def build(name, cfg, device, tc, steps, opts):
    rng = np.random.default_rng(0)
    train = TokenStream(rng.integers(2, VOCAB, size=tc.batch_size * tc.seq_len * (steps + 8) + 1).astype(np.int32), 0)
    val = TokenStream(rng.integers(2, VOCAB, size=4 * tc.seq_len + 1).astype(np.int32), 0)
    model = DecoderLM(cfg, token_lookup=np.arange(VOCAB, dtype=np.int64), seed=0, device=device)
    run = dataclasses.replace(
        tc,
        steps=steps,
        warmup_steps=2,
        log_every=10**6,
        eval_tokens=tc.seq_len,
        compile=bool(opts.get("compile")),
        cuda_graphs=bool(opts.get("cuda_graphs")),
    )
    trainer = Trainer(model, run, train, val, np.ones(VOCAB, dtype=np.int64), device, label=name, progress=False)
    return model, trainer


def timed(trainer, first, last, queued=False):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if queued:
        losses = trainer.read_losses([(s, trainer.queue_step(s)[0]) for s in range(first, last)])
    else:
        losses = [trainer.train_step(s)[0] for s in range(first, last)]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, losses


def host_phases(trainer, first: int, last: int) -> dict:
    """The host's ms a step in each phase of steps first..last-1 (the forward's call, the backward's,
    clipping, the optimizers' steps, zero_grad, the rest; "total" their sum), by wrapping each. Each
    step is queued onto an idle device and its loss read before the next: queued back to back, the
    host would soon wait for room in the launch queue, and that wait would count as its own time.
    A total well below the wall's ms a step: the device bounds the step."""
    import condmem.train.loop as loop

    spent: dict[str, float] = {}

    def timing(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return wrapped

    saved = (torch.Tensor.backward, loop.clip_grad_norm_)
    trainer.model.loss = timing("forward", trainer.model.loss)
    torch.Tensor.backward = timing("backward", torch.Tensor.backward)
    loop.clip_grad_norm_ = timing("clip", loop.clip_grad_norm_)
    for opt in trainer.optimizers:
        opt.step, opt.zero_grad = timing("optimizer step", opt.step), timing("zero_grad", opt.zero_grad)
    host = 0.0
    try:
        for s in range(first, last):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = trainer.queue_step(s)[0]
            host += time.perf_counter() - t0
            trainer.read_losses([(s, loss)])
    finally:
        torch.Tensor.backward, loop.clip_grad_norm_ = saved
        del trainer.model.loss  # the instance's wrappers: the class's methods again
        for opt in trainer.optimizers:
            del opt.step, opt.zero_grad
    n = last - first
    out = {name: 1e3 * t / n for name, t in spent.items()}
    out["rest"] = 1e3 * host / n - sum(out.values())
    out["total"] = 1e3 * host / n
    return {"host_ms_per_step_by_phase": out}


def kernel_profile(key: str, trainer, first: int, queued: bool, sources: bool) -> dict:
    """Three steps under torch.profiler: the GPU's busy share of the wall time, kernels a step, each kernel's
    ms a step, per family (`KERNEL_KINDS`), the idle gaps between its activities (`idle_gaps`); with
    `sources`, the CPU ops that launched each kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed(trainer, first, first + 3, queued)
    kernels = [
        e for e in prof.key_averages() if e.device_type.name == "CUDA" and not e.is_user_annotation
    ]  # a range named on the host (the optimizer's step) spans kernels: not one of them
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    # Summed by the name's first 160 characters: templated kernels (CUTLASS's) that differ only
    # past them count together instead of the last one standing for all.
    ms, counts = {}, {}
    for e in kernels:
        ms[e.key[:160]] = ms.get(e.key[:160], 0.0) + e.self_device_time_total / 3e3
        counts[e.key[:160]] = counts.get(e.key[:160], 0.0) + e.count / 3
    top = sorted(ms, key=lambda k: -ms[k])  # every kernel, the longest first
    out = {
        "gpu_busy_share": busy / wall,
        "kernels_per_step": sum(e.count for e in kernels) / 3,
        "kernels_ms_per_step": {k: ms[k] for k in top},
        "kernel_counts_per_step": {k: counts[k] for k in top},
    }
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.is_user_annotation
    ]
    out["idle"] = idle_gaps(spans, steps=3)
    kinds = {}
    for e in kernels:
        kind = kinds.setdefault(kernel_kind(e.key), {"ms_per_step": 0.0, "kernels_per_step": 0.0})
        kind["ms_per_step"] += e.self_device_time_total / 3e3
        kind["kernels_per_step"] += e.count / 3
    out["kernel_kinds"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms_per_step"]))
    print(
        f"\n{key}: wall {wall / 3 * 1e3:.1f} ms/step, GPU busy {busy / wall:.0%}, "
        f"{out['kernels_per_step']:.0f} kernels/step",
        flush=True,
    )
    for k, v in list(out["kernels_ms_per_step"].items())[:25]:
        print(f"   {v:7.2f} ms  {k[:90]}", flush=True)
    for k, v in out["kernel_kinds"].items():
        print(f"   {v['ms_per_step']:7.2f} ms {v['kernels_per_step']:6.0f} kernels  {k}", flush=True)
    idle = out["idle"]
    print(f"   idle {idle['ms_per_step']:.2f} ms a step between GPU activities:", flush=True)
    for size, g in idle["by_size"].items():
        print(f"      gaps {size:>12}: {g['per_step']:7.1f} a step, {g['ms_per_step']:6.2f} ms", flush=True)
    for g in idle["largest"][:8]:
        print(f"      {g['us']:8.1f} us after {g['after'][:60]} | before {g['before'][:60]}", flush=True)
    if sources:
        out["kernel_sources"] = kernel_sources(prof.events(), steps=3)
        for name, chains in list(out["kernel_sources"].items())[:30]:
            print(f"   {name[:90]}", flush=True)
            for chain, ms in list(chains.items())[:3]:
                print(f"       {ms:7.3f} ms  {chain[:150]}", flush=True)
    return out


GAP_SIZES = ((0.0, 2.0), (2.0, 5.0), (5.0, 20.0), (20.0, 100.0), (100.0, float("inf")))
"""Idle gaps by size, in microseconds: under ~2 us is one kernel's hand-over to the next; longer ones are
where the device waited for work."""


def idle_gaps(spans, steps: int, largest: int = 10) -> dict:
    """Where the GPU had nothing to run: the gaps between its activities (kernels, copies, fills), given as
    ``(start_us, end_us, name)`` spans on any streams (overlapping spans count as busy together), from the
    first one's start to the last one's end. Returns the idle ms a step, the gaps by size (`GAP_SIZES`: how
    many a step and their ms a step) and the `largest` gaps with the activity before and after each."""
    spans = sorted(spans)
    by_size = {f"{lo:g}-{hi:g} us": {"per_step": 0.0, "ms_per_step": 0.0} for lo, hi in GAP_SIZES}
    gaps = []
    if spans:
        end, last = spans[0][1], spans[0][2]
        for start, stop, name in spans[1:]:
            if start > end:
                gaps.append((start - end, last, name))
            if stop > end:
                end, last = stop, name
    for us, _, _ in gaps:
        lo, hi = next(size for size in GAP_SIZES if size[0] <= us < size[1])
        bucket = by_size[f"{lo:g}-{hi:g} us"]
        bucket["per_step"] += 1 / steps
        bucket["ms_per_step"] += us / 1e3 / steps
    return {
        "ms_per_step": sum(us for us, _, _ in gaps) / 1e3 / steps,
        "by_size": by_size,
        "largest": [{"us": us, "after": a, "before": b} for us, a, b in sorted(gaps, key=lambda g: -g[0])[:largest]],
    }


def kernel_sources(events, steps: int, depth: int = 4) -> dict:
    """Per CUDA kernel name, longest first: the CPU ops that launched it, each as its chain of enclosing
    ops (innermost first, `depth` deep, e.g. ``aten::sum < aten::sum < autograd::engine::evaluate_function:
    SumBackward1``), with the ms a step it launched. Kernels replayed by a CUDA graph have no launching op:
    profile a variant without graphs (``compiled``) to place them."""
    by_kernel: dict[str, dict[str, float]] = {}
    for evt in events:
        if evt.device_type.name != "CPU" or not evt.kernels:
            continue
        chain, parent = [], evt
        while parent is not None and len(chain) < depth:
            chain.append(parent.name)
            parent = parent.cpu_parent
        for kernel in evt.kernels:
            chains = by_kernel.setdefault(kernel.name[:160], {})
            chains[" < ".join(chain)] = chains.get(" < ".join(chain), 0.0) + kernel.duration / 1e3 / steps
    ordered = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1].values()))
    return {name: dict(sorted(chains.items(), key=lambda kv: -kv[1])) for name, chains in ordered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["dense", "moe", "moe_engram_rho0.8"])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--profile", action="store_true", help="profile each variant's kernels")
    ap.add_argument(
        "--sources", action="store_true", help="with --profile: the CPU ops that launched each kernel (no graphs)"
    )
    ap.add_argument("--deterministic", action="store_true", help="deterministic mode, as the study runs")
    ap.add_argument(
        "--host-phases",
        action="store_true",
        help="queued options: the host's ms to queue a step onto an idle device, by phase",
    )
    args = ap.parse_args()
    set_cublas_workspace(args.deterministic)  # before cuBLAS starts
    with deterministic_mode(args.deterministic):
        run(args)


def run(args) -> None:
    device = torch.device("cuda")
    tc = STUDY_PRESETS["gpu"].base.train
    tokens = tc.batch_size * tc.seq_len
    peak = matmul_ceiling(device)
    result = {
        "commit": commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak": peak,
        "deterministic": args.deterministic,
    }
    rows = {}
    all_variants = variants(False)
    rho08 = allocation_points(all_variants["moe_engram_big"], [1.0, 0.8])
    all_variants["moe_engram_rho0.8"] = next(p.cfg for p in rho08 if p.rho == 0.8)
    for name in args.models:
        cfg = all_variants[name]
        flops = train_flops_per_token(cfg, tc.seq_len)
        for option in args.options:
            opts = OPTIONS[option]
            key = f"{name}/{option}"
            t0 = time.perf_counter()
            try:
                model, trainer = build(key, cfg, device, tc, 3 + 3 * args.steps + 3, opts)
                for s in range(3):
                    trainer.train_step(s)
            except Exception as e:  # a variant that does not run is reported, the others go on
                print(f"{key}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            warm_s = time.perf_counter() - t0
            secs, losses = timed(trainer, 3, 3 + args.steps, opts.get("queued", False))
            row = {
                "tokens_per_s": tokens * args.steps / secs,
                "ms_per_step": 1e3 * secs / args.steps,
                "train_flops_per_token": flops,
                "losses": losses,
                "warm_s": warm_s,
            }
            row["mfu"] = flops * row["tokens_per_s"] / peak
            first = 3 + args.steps
            if args.host_phases and opts.get("queued"):
                row.update(host_phases(trainer, first, first + args.steps))
                first += args.steps
                print(
                    f"{key}: host ms a step by phase "
                    + ", ".join(f"{k} {v:.2f}" for k, v in row["host_ms_per_step_by_phase"].items()),
                    flush=True,
                )
            if args.profile:
                row.update(kernel_profile(key, trainer, first, opts.get("queued", False), args.sources))
            rows[key] = row
            print(
                f"{key}: {row['ms_per_step']:.1f} ms/step {row['tokens_per_s']:,.0f} tok/s MFU {row['mfu']:.1%} "
                f"(warm-up {warm_s:.0f} s)",
                flush=True,
            )
            del trainer, model
            torch.cuda.empty_cache()
            # after each variant: a call's timeout keeps those done
            Path(args.out).mkdir(parents=True, exist_ok=True)
            saved = json.dumps({**result, "rows": rows}, indent=1)
            atomic_write_text(Path(args.out) / "study_step_profile.json", saved)
    print(f"\n{result['gpu']}, bf16 matmul ceiling {peak / 1e12:.0f} TFLOP/s")
    print(f"{'variant':<40} {'ms/step':>8} {'tok/s':>11} {'MFU':>6}")
    for k, r in rows.items():
        if "error" in r:
            print(f"{k:<40} FAILED")
            continue
        speed = f"{r['ms_per_step']:>8.1f} {r['tokens_per_s']:>11,.0f} {r['mfu']:>6.1%}"
        drifts = []
        for ref in ("eager", "compiled_graphs"):  # the losses' largest difference from each reference run
            base = rows.get(f"{k.split('/')[0]}/{ref}", {}).get("losses")
            if base and not k.endswith(f"/{ref}"):
                drifts.append(f"vs {ref} {max(abs(a - b) for a, b in zip(r['losses'], base)):.2e}")
        print(f"{k:<40} {speed}  loss drift {', '.join(drifts) or '-'}")


if __name__ == "__main__":
    main()
