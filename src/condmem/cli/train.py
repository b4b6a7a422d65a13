"""``condmem train``: train one reference LM (with or without Engram) with checkpoints and --resume."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from condmem.cli import CliError, UsageError
from condmem.cli.common import note

# The flags of `condmem train`, each the run config's key it replaces (`RunConfig.with_values`).
FLAG_KEYS = {
    "preset": "preset",
    "seed": "seed",
    "deterministic": "deterministic",
    "steps": "train.steps",
    "minutes": "train.max_minutes",
    "corpus": "data.corpus",
    "no_engram": "no_engram",
    "table_tier": "table_tier",
}


def register(sub) -> None:
    """The ``condmem train`` command and its options."""
    p = sub.add_parser(
        "train",
        help="train one reference LM (Engram by default) with checkpoints; --resume continues exactly",
        description="Train the reference decoder LM on a corpus (default: the Python standard library source). "
        "AdamW for the backbone, sparse Adam for the Engram tables (their own learning rate, no weight decay), "
        "warm-up + cosine, gradient clipping, bf16 autocast on GPU. Checkpoints (safetensors, resolved config, "
        "tokenizer, fingerprints) go to OUT/checkpoints; --resume continues the latest one step for step.\n\n"
        "Sizes and settings come from a preset and a run config (--config FILE, TOML or JSON: the preset's "
        "sections [model], [engram], [train], [data] and a few top-level keys; every key in the shipped "
        "'example', docs/training.md#config-files); --set KEY=VALUE and the flags below replace keys of it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem train --out runs/engram --steps 1000\n"
        "  condmem train --out runs/base --no-engram --set iso_flop=true\n  condmem train --out runs/engram --resume\n"
        "  condmem train --out runs/cfg --config example --set train.lr=1e-3   # a config file, one key changed\n"
        "  condmem train --out runs/big --set engram.table_size=10000000 --table-tier host   # tables in host RAM\n"
        "  condmem train --out runs/moe --set model.moe.n_experts=8 --set model.ffn_hidden=256   # routed experts\n"
        "  condmem train --out runs/engram --resume --steps 2000   # continue a finished run to step 2000\n"
        "  torchrun --nproc-per-node 8 -m condmem train --out runs/dp   # tables sharded over 8 data-parallel ranks",
    )
    p.add_argument("--config", metavar="FILE", help="a run config (TOML or JSON), or a shipped one by name: example")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="replace one key of the config (train.lr=1e-3, model.moe.n_experts=8, tokenizer=deepseek-v4); "
        "VALUE in TOML syntax, else text; repeatable",
    )
    p.add_argument("--out", required=True, help="run directory (checkpoints, summary.json)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a used --out: its checkpoints and summary.json are deleted first",
    )
    p.add_argument("--preset", choices=["cpu", "gpu", "tiny"], help="base settings (default: gpu with CUDA, else cpu)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, help="seed of the data, initialization and batch order (default 0)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels: the same seed and options give bit-identical losses on one machine type "
        "(costs GPU speed; docs/training.md)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps; with --resume: the new end)")
    p.add_argument("--minutes", type=float, help="wall-clock budget; the step count is fitted to it")
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="directories, text, .jsonl, .parquet/.arrow files or a save_to_disk folder, streamed (default: stdlib)",
    )
    p.add_argument("--no-engram", action="store_true", help="train the plain baseline")
    p.add_argument(
        "--table-tier",
        choices=["module", "host"],
        help="module (default): the tables are model parameters on --device; host: tables and their Adam state "
        "live in (page-locked) host memory, rows fetched each step with the next step's prefetched "
        "(exact; docs/training.md). Checkpoints are the same either way.",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run_config(args):
    """The run's `RunConfig`: --config (or the defaults), then --set, then the flags; and the dotted keys
    they gave (what a resumed run must not change)."""
    from condmem.config import ConfigError
    from condmem.train.run_config import RunConfig, load_run_config, parse_assignment

    try:
        config, given = load_run_config(args.config) if args.config else (RunConfig(), [])
        values = dict(parse_assignment(text) for text in args.set or [])
        values.update(
            {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) not in (None, False)}
        )
        if values:
            where = f"--config {args.config} with --set and flags" if args.config else "--set and flags"
            config = config.with_values(values, where=where)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return config, sorted(set(given) | set(values))


def check_args(args, config) -> None:
    """Refuse values that would crash or hang later, before the corpus is read (exit status 2);
    say up front when train.seq_len raises the preset's max_seq_len."""
    from condmem.cli.common import check_vocab_size, device_flag
    from condmem.train.presets import PRESETS, default_preset_name

    device = device_flag(args.device)
    sections = config.sections
    check_vocab_size(sections.get("data", {}).get("vocab_size"), "data.vocab_size")
    seq_len = sections.get("train", {}).get("seq_len")
    max_seq_len = sections.get("model", {}).get("max_seq_len")
    if seq_len is not None and max_seq_len is not None and seq_len > max_seq_len:
        raise UsageError(
            f"train.seq_len {seq_len:,} is longer than model.max_seq_len {max_seq_len:,}: a training window "
            "must fit the model's positions"
        )
    preset = config.preset or default_preset_name(device.type)
    limit = PRESETS[preset].model.max_seq_len
    if not args.resume and seq_len is not None and max_seq_len is None and seq_len > limit:
        note(
            "train",
            f"train.seq_len {seq_len:,} is above the {preset} preset's max_seq_len {limit:,}: the model's "
            f"max_seq_len is raised to {seq_len:,} (set model.max_seq_len to choose it); a step attends over "
            f"{seq_len:,} tokens a sequence, its cost growing with their square",
        )


def _nothing_to_resume(out: Path) -> bool:
    """Whether --out holds no checkpoint at all: no LATEST and no complete one (a run killed before
    its first save completed leaves at most a temp folder, which the next save sweeps)."""
    from condmem.train.checkpoint import newest_complete

    root = out / "checkpoints"
    return not (out / "state.json").exists() and not (root / "LATEST").exists() and newest_complete(root) is None


def _claim(args, out) -> None:
    """Refuse a used --out unless resuming; with --overwrite, clear it."""
    used = sorted(p.name for p in out.iterdir() if p.name != ".lock")
    if used and not args.resume:
        if not args.overwrite and _nothing_to_resume(out):
            raise CliError(
                f"--out {out} holds {', '.join(used[:5])} but no finished checkpoint (a run stopped before its first "
                "save completed): --resume starts the run afresh there, --overwrite deletes what is there first"
            )
        if not args.overwrite:
            raise CliError(
                f"--out {out} already holds {', '.join(used[:5])}: continue that run with --resume, or "
                "start afresh there with --overwrite (which deletes its checkpoints)"
            )
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.rmtree(out / "sharded_tables", ignore_errors=True)
        (out / "summary.json").unlink(missing_ok=True)
    # What the run will write, checked now rather than after training: a regular summary.json (or none), and
    # no link planted in --out that leads out of it (the writers check again when they write).
    from condmem.utils.atomic import check_destination, check_inside

    check_destination(out / "summary.json", within=out)
    for folder in ("checkpoints", "sharded_tables"):
        check_inside(out / folder, out)


def run(args) -> int:
    """Check --out (writable, not another run's unless --resume / --overwrite), hold its lock, train.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) every rank trains its slice of each batch
    with the Engram tables sharded over the ranks (`condmem.train.data_parallel`); rank 0
    checks and locks --out."""
    from condmem.utils.preflight import check_output_dir
    from condmem.utils.run_lock import RunLock

    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out, --overwrite replaces it: choose one")
    rc, given = run_config(args)
    check_args(args, rc)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_ranks(args, rc, given)
    out = check_output_dir(args.out, "--out")
    with RunLock(out):
        _claim(args, out)
        return _train(args, rc, given)


def _check_resumable(given: list[str]) -> None:
    """A resumed run keeps its checkpoint's settings: refuse the keys it cannot change."""
    from condmem.train.run_config import FIXED_ON_RESUME, RESUMABLE
    from condmem.train.presets import SECTIONS

    fixed = [k for k in given if k in FIXED_ON_RESUME or (k.split(".")[0] in SECTIONS and k not in RESUMABLE)]
    if fixed:
        raise CliError(
            f"{', '.join(fixed)}: a resumed run keeps the settings of its checkpoint (config.json); drop "
            f"{'it' if len(fixed) == 1 else 'them'} (with --resume only {', '.join(RESUMABLE)} may change), or "
            "start afresh with --overwrite"
        )


def _run_ranks(args, rc, given: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from condmem.utils.preflight import check_output_dir
    from condmem.utils.run_lock import RunLock

    if rc.table_tier == "host":
        raise CliError(
            "table_tier host (--table-tier) is for one process; under torchrun the tables are sharded over the ranks"
        )
    if rc.no_engram:
        raise CliError("under torchrun condmem train shards Engram tables; drop no_engram (--no-engram)")
    cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    lock = None
    try:
        error = None
        if rank == 0:
            try:
                out = check_output_dir(args.out, "--out")
                lock = RunLock(out)
                lock.__enter__()
                _claim(args, out)
            except (CliError, ValueError, OSError) as exc:
                error = str(exc)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise CliError(box[0])
        code = _train(args, rc, given, rank=rank, world=dist.get_world_size())
        dist.barrier()  # no rank tears the group down while another still talks to it
        return code
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
        dist.destroy_process_group()


def _train(args, rc, given: list[str], rank: int | None = None, world: int = 1) -> int:
    """Train one model (`condmem.train.run.train_run`): a new run, or with --resume the latest
    checkpoint continued (a folder with none starts afresh, with a note)."""
    from condmem.train.run import train_run

    resume = args.resume
    if resume and _nothing_to_resume(Path(args.out)):
        if rank in (None, 0):
            note(
                "train",
                f"--resume: {args.out} holds no checkpoint yet (a run stopped before its first save completed): "
                "starting the run afresh there with this command's options",
            )
        resume = False
    if resume:
        _check_resumable(given)
    progress = not args.no_progress
    train_run(rc, args.out, args.device, resume=resume, progress=progress, rank=rank, world=world)
    return 0
