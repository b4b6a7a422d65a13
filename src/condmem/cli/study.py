"""``condmem study allocation|slots``: the Engram paper's parameter-allocation and memory-slot sweeps, small."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "study",
        help="the paper's sweeps at small scale: MoE vs Engram allocation (rho), and table rows",
        description="allocation: at fixed total and active parameters, move the sparse parameters of routed "
        "experts into an Engram table (rho = share left to experts; rho = 1 is pure MoE) and train one model "
        "per rho. slots: a fixed MoE backbone with Engram tables over two decades of rows, and without Engram. "
        "Every run trains on the same batches in the same order for the same number of steps (at most one "
        "pass over the data) and is validated on every token of the deduplicated held-out split. Writes "
        "study.json (per run: rho, parameters, FLOPs per token, tokens, passes, val loss, bits per byte, "
        "seen/unseen 3-gram losses, tokens/s) and a PNG to --out; the report states the scale gap to the "
        "paper's and claims a minimum only beyond the seed spread. Method: docs/study.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem study allocation --preset tiny --out runs/allocation\n"
        "  condmem study allocation --preset gpu --seeds 2      # one GPU, minutes (timings: docs/benchmarks.md)\n"
        "  condmem study slots --preset gpu\n"
        "  condmem study allocation --preset tiny --corpus /path/to/texts --rhos 1 0.8 0.6\n"
        "  condmem study allocation --out runs/allocation --replot   # the PNG again from study.json",
    )
    p.add_argument("kind", choices=["allocation", "slots"], help="which sweep")
    p.add_argument(
        "--preset",
        choices=["tiny", "gpu"],
        default="tiny",
        help="tiny: CPU, seconds (CI); gpu: one GPU, minutes a sweep (default tiny)",
    )
    p.add_argument("--out", help="output directory (default ./condmem-study/KIND)")
    p.add_argument(
        "--seeds", type=int, default=1, help="initialization seeds per point (the data order is the same for every run)"
    )
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="directories, text or .jsonl files, 'stdlib' or 'python' (default: the preset's)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, help="training steps of every run (default: the preset's)")
    p.add_argument(
        "--minutes",
        type=float,
        help="wall-clock budget of the sweep: the first run's steps are cut to fit, never raised "
        "(default: the preset's; gpu 9)",
    )
    p.add_argument("--rhos", type=float, nargs="+", help="allocation grid (1.0 is always run)")
    p.add_argument("--table-sizes", type=int, nargs="+", help="slot sweep: bucket range per (order, head)")
    p.add_argument("--seed", type=int, default=0, help="data seed and first initialization seed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--replot",
        action="store_true",
        help="only draw the PNG again from --out's study.json (after a run on a machine without matplotlib)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from condmem.train.study import replot, run_study

    if args.replot:
        return 0 if replot(args.kind, args.out) is not None else 1
    run_study(
        args.kind,
        args.out,
        preset=args.preset,
        seeds=args.seeds,
        corpus=args.corpus,
        device=args.device,
        steps=args.steps,
        minutes=args.minutes,
        seed=args.seed,
        rhos=args.rhos,
        table_sizes=args.table_sizes,
        progress=not args.no_progress,
    )
    return 0
