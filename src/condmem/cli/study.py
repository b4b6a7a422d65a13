"""``condmem study allocation|slots|tokens|merge``: the Engram paper's parameter-allocation and memory-slot
sweeps, small, and the allocation's gaps against training tokens."""

from __future__ import annotations

import argparse
import functools


def register(sub) -> None:
    p = sub.add_parser(
        "study",
        help="the paper's sweeps at small scale: MoE vs Engram allocation (rho), and table rows",
        description="allocation: at fixed total and active parameters, move the sparse parameters of routed "
        "experts into an Engram table (rho = share left to experts; rho = 1 is pure MoE) and train one model "
        "per rho (labelled by the rho its integer expert count realises), with controls beside each rho < 1. "
        "slots: a fixed MoE backbone with Engram tables over two decades of rows (at most the distinct n-grams a "
        "run reads), and without Engram. tokens: pure MoE, each rho and its no-table control at each budget of "
        "the config's tokens_grid (or --tokens-grid): the gaps against training tokens, and whether each changes "
        "with them (each seed's slope in log10(tokens), with its 95% interval over seeds). "
        "Each run trains for the steps the sweep states (at most --max-passes over the data), seeds k share "
        "their batches across points, and is validated on at most the config's val_tokens held-out tokens. "
        "Each run writes OUT/runs/RUN.json when it ends; the same command again skips finished runs and "
        "trains the rest (a run cut off starts again: deterministic mode gives it the same losses); --only "
        "splits a sweep over machines or calls; once every run exists, study.json and the PNGs are built "
        "(or `condmem study merge OUT`). Method: docs/study-guide.md; results: docs/study.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem study allocation --preset tiny --out runs/allocation\n"
        "  condmem study allocation --preset cpu --out runs/cpu      # a small real answer on a laptop\n"
        "  condmem study allocation --preset gpu --out runs/gpu --stop-after 9   # again until done\n"
        "  condmem study allocation --preset gpu --out runs/gpu --only seed=0    # one machine's share\n"
        "  condmem study allocation --preset gpu --out runs/gpu --parallel 3     # 3 runs at once on one GPU\n"
        "  condmem study merge runs/allocation                  # study.json once every run exists\n"
        "  condmem study tokens --preset gpu --out runs/tokens --stop-after 8   # the gap against tokens\n"
        "  condmem study slots --preset tiny --corpus /path/to/texts --table-sizes 20 300 3000\n"
        "  condmem study allocation --out runs/allocation --replot   # the PNG again from study.json",
    )
    p.add_argument(
        "kind", choices=["allocation", "slots", "tokens", "merge"], help="which sweep (merge: build study.json)"
    )
    p.add_argument("path", nargs="?", metavar="OUT", help="merge: the sweep's output folder (or --out)")
    p.add_argument(
        "--preset",
        choices=["tiny", "cpu", "gpu"],
        help="tiny: CPU, seconds (CI); cpu: a laptop, minutes; gpu: one GPU (default tiny)",
    )
    p.add_argument(
        "--config", metavar="FILE", help="a study config (TOML or JSON; docs/study-guide.md) instead of --preset"
    )
    p.add_argument("--out", help="output directory (default ./condmem-study/KIND)")
    p.add_argument("--seeds", type=int, help="seeds per point: initialization and data order (default: the config's)")
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="directories, text or .jsonl files, 'stdlib' or 'python' (default: the config's)",
    )
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--steps", type=int, help="training steps of every run (default: the config's)")
    p.add_argument("--tokens", type=int, help="training tokens of every run, instead of --steps")
    _add_schedule_flags(p)
    p.add_argument("--rhos", type=float, nargs="+", help="allocation grid, each in (0, 1] (1.0 is always run)")
    p.add_argument("--table-sizes", type=int, nargs="+", help="slot sweep: bucket range per (order, head)")
    p.add_argument(
        "--tokens-grid",
        type=int,
        nargs="+",
        metavar="TOKENS",
        help="token sweep: training tokens per run at each budget (two or more; --rhos gives its rhos)",
    )
    p.add_argument("--controls", nargs="*", metavar="CONTROL", help="allocation controls (none: no controls)")
    p.add_argument("--val-tokens", type=int, help="validate each run on at most this many held-out tokens")
    p.add_argument("--max-passes", type=float, help="at most this many passes over the training split")
    p.add_argument("--seed", type=int, help="first seed of the runs (default: the config's)")
    p.add_argument(
        "--no-deterministic",
        action="store_true",
        help="allow nondeterministic kernels (faster on some GPUs; the same run may then differ)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a sweep in --out made with another config")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--replot",
        action="store_true",
        help="only draw the PNG again from --out's study.json (after a run on a machine without matplotlib)",
    )
    p.set_defaults(func=run)


def _add_schedule_flags(p) -> None:
    """The flags that say which runs this command trains, how many at once, and for how long."""
    p.add_argument(
        "--minutes",
        type=float,
        help="wall-clock budget of the whole sweep: the step count is cut up front to fit (a probe measures "
        "the step time), stated and recorded; never raised",
    )
    p.add_argument(
        "--stop-after",
        type=float,
        metavar="MINUTES",
        help="start no run that would end after this many minutes of this command (re-run to continue)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="KEY=VALUE[,...]",
        help="train only these runs: keys rho, experts, table_size, control (none for the sweep's own points), "
        "seed, tokens (the token sweep's budget), run (a run id); a key repeated is an OR, repeated --only "
        "flags add runs (e.g. --only rho=0.8,seed=1)",
    )
    p.add_argument(
        "--reuse",
        nargs="+",
        metavar="DIR",
        help="copy in the finished runs of other sweeps (their --out folders) whose configuration equals a "
        "planned run's instead of training them (a token sweep's budget an allocation sweep trained); each "
        "copy names its source (reused_from)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        metavar="K",
        help="train K runs at once, one process each, on the same device: a small model leaves a large GPU "
        "idle between kernels, and K processes fill the gaps (logs in OUT/logs/; docs/study-guide.md)",
    )


def run(args) -> int:
    from condmem.apps.study.parallel import run_parallel
    from condmem.apps.study.runs import require_positive
    from condmem.apps.study.sweep import merge, replot, run_study

    if args.kind == "merge":
        out = args.path or args.out
        if out is None:
            raise ValueError("condmem study merge needs the sweep's output folder: condmem study merge OUT")
        merge(out)
        return 0
    if args.preset is not None and args.config is not None:
        raise ValueError("--preset and --config both given: choose one")
    if args.path is not None:
        raise ValueError(f"unexpected argument {args.path!r}: the output folder is --out (a folder is merge's only)")
    if args.replot:
        return 0 if replot(args.kind, args.out) is not None else 1
    for flag, value in (("--steps", args.steps), ("--tokens", args.tokens), ("--seeds", args.seeds)):
        require_positive(flag, value)
    for flag, value in (("--val-tokens", args.val_tokens),):
        require_positive(flag, value)
    for value in args.tokens_grid or []:
        require_positive("--tokens-grid", value)
    for flag, value in (
        ("--minutes", args.minutes),
        ("--stop-after", args.stop_after),
        ("--max-passes", args.max_passes),
    ):
        require_positive(flag, value, integer=False)
    if args.steps is not None and args.tokens is not None:
        raise ValueError("--steps and --tokens both given: choose one")
    if args.parallel is not None and (args.parallel < 1):
        raise ValueError(f"--parallel must be 1 or more, got {args.parallel}")
    sweep = run_study if (args.parallel or 1) == 1 else functools.partial(run_parallel, workers=args.parallel)
    sweep(
        args.kind,
        args.out,
        preset=args.preset or "tiny",
        config=args.config,
        seeds=args.seeds,
        corpus=args.corpus,
        device=args.device,
        steps=args.steps,
        tokens=args.tokens,
        minutes=args.minutes,
        seed=args.seed,
        rhos=args.rhos,
        table_sizes=args.table_sizes,
        max_passes=args.max_passes,
        val_tokens=args.val_tokens,
        controls=args.controls,
        deterministic=False if args.no_deterministic else None,
        tokens_grid=args.tokens_grid,
        only=args.only,
        reuse=args.reuse,
        overwrite=args.overwrite,
        stop_after=args.stop_after,
        progress=not args.no_progress,
    )
    return 0
