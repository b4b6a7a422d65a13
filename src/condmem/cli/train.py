"""``condmem train``: train one reference LM (with or without Engram) with checkpoints and --resume."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from condmem.cli import CliError, UsageError
from condmem.cli.common import note

logger = logging.getLogger("condmem.train")

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


def _corpus_name(corpus) -> str:
    if not corpus:
        return "stdlib"
    return corpus if isinstance(corpus, str) else ", ".join(map(str, corpus))


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
    import os

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
        raise CliError("--table-tier host is for one process; under torchrun the tables are sharded over the ranks")
    if rc.no_engram:
        raise CliError("under torchrun condmem train shards Engram tables; drop --no-engram")
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


@dataclass
class _Run:
    """What `_train` trains: a new model, or one resumed from its checkpoint."""

    model: object
    train_cfg: object
    data: object
    label: str
    checkpoint: object = None
    """The checkpoint resumed from (None: a new run)."""


def _train(args, rc, given: list[str], rank: int | None = None, world: int = 1) -> int:
    """Train one model; `rank` is set when this process is one of `world` data-parallel ranks."""
    from condmem.train.build import build_trainer
    from condmem.train.determinism import determinism_record, deterministic_mode, set_cublas_workspace

    set_cublas_workspace(rc.deterministic)  # before anything starts cuBLAS
    device = _device(args, rank)
    lead = rank in (None, 0)
    fresh = not args.resume
    if args.resume and _nothing_to_resume(Path(args.out)):
        if lead:
            note(
                "train",
                f"--resume: {args.out} holds no checkpoint yet (a run stopped before its first save completed): "
                "starting the run afresh there with this command's options",
            )
        fresh = True
    if not fresh:
        _check_resumable(given)
    run = _start(args, rc, device, rank, lead) if fresh else _resume(args, rc, device, rank, lead)
    if run is None:
        return 0
    tables = _host_tables(rc, run, device) if rc.table_tier == "host" else None
    dp = _data_parallel(args, run, rank, world, lead) if rank is not None else None
    params = run.model.param_counts()
    if tables is not None:
        params.update(tables=tables.table_params, total=params["total"] + tables.table_params)
    try:
        trainer = build_trainer(
            run.model,
            run.train_cfg,
            run.data,
            device,
            run_dir=args.out,
            label=run.label,
            progress=not args.no_progress and lead,
            host_tables=tables,
            data_parallel=dp,
        )
        if run.checkpoint is not None:
            trainer.restore(run.checkpoint)
        quiet = contextlib.redirect_stdout(io.StringIO()) if not lead else contextlib.nullcontext()
        with quiet, deterministic_mode(rc.deterministic):
            summary = trainer.fit()
    finally:
        if tables is not None:
            tables.close()
    if lead:
        summary = dict(summary, params=params, determinism=determinism_record(rc.deterministic))
        _write_summary(args, rc, run, trainer, summary, rank, world)
    return 0


def _say(lead: bool, text: str) -> None:
    if lead:
        print(text, flush=True)


def _device(args, rank: int | None):
    """--device; under torchrun on CUDA, this rank's GPU (LOCAL_RANK)."""
    import torch

    from condmem.train.build import resolve_device

    device = resolve_device(args.device)
    if rank is not None and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def _start(args, rc, device, rank: int | None, lead: bool) -> _Run:
    """A new model from the preset and the options (the build step `condmem demo` shares)."""
    import dataclasses

    from condmem.models import iso_flop_baseline, train_flops_per_token
    from condmem.train.build import build_model, build_model_config, prepare

    preset = rc.resolve(device.type)
    tc = preset.train
    _say(
        lead,
        f"preset {preset.name}: batches of {tc.batch_size} x {tc.seq_len:,} tokens, {tc.steps:,} "
        f"step{'' if tc.steps == 1 else 's'}, on {device}; preparing the data ({rc.tokenizer or 'a BPE'} over "
        f"{_corpus_name(preset.data.corpus)}: read once, then cached)",
    )
    data = prepare(preset, tokenizer=rc.tokenizer, seed=rc.seed, rank=rank)
    cfg = build_model_config(preset, data)
    label = "engram"
    if rc.no_engram:
        cfg = iso_flop_baseline(cfg) if rc.iso_flop else cfg.replace(engram=None)
        label = "baseline"
    tc = dataclasses.replace(preset.train, seed=rc.seed)
    # Huge host tables are drawn on the host by HostTables; on the CPU the model's own draw is
    # kept, so both tiers start from the same rows.
    table_device = "meta" if rc.table_tier == "host" and device.type == "cuda" else None
    model = build_model(cfg, data, seed=rc.seed, device=device, table_device=table_device)
    _say(
        lead,
        f"[{label}] {model.param_counts()['total']:,} parameters, "
        f"{train_flops_per_token(cfg, tc.seq_len) / 1e6:,.2f} MFLOPs/token (train)",
    )
    return _Run(model, tc, data, label)


def _resume(args, rc, device, rank: int | None, lead: bool) -> _Run | None:
    """The latest checkpoint in --out, with its data prepared again as it was (read from the
    prepared-data cache when the corpus is unchanged). train.steps (--steps) moves the end of the
    run; a run already at its end returns None (nothing to train, nothing rewritten)."""
    import dataclasses

    from condmem.train.build import prepare_recorded
    from condmem.train.checkpoint import load_checkpoint
    from condmem.train.loop import TrainConfig
    from condmem.train.run_config import RESUMABLE

    ckpt = load_checkpoint(args.out, device=device, tables_on_host=rc.table_tier == "host")
    if ckpt.tables_sharded != (rank is not None):
        how = (
            "data-parallel ranks: resume it under torchrun"
            if ckpt.tables_sharded
            else "one process: resume it without torchrun"
        )
        raise CliError(f"{ckpt.path} was saved by {how}")
    tc = TrainConfig.from_dict(ckpt.config["train"])
    step = int(ckpt.state["step"])
    resumable = {key.split(".")[1] for key in RESUMABLE}
    changes = {k: v for k, v in rc.sections.get("train", {}).items() if k in resumable}
    if changes.get("steps", step + 1) < step:
        raise CliError(
            f"--steps {changes['steps']}: {ckpt.path} is at step {step} already, and a run does not go back; "
            "start afresh with --overwrite"
        )
    tc = dataclasses.replace(tc, **changes)
    if step >= tc.steps:
        _say(
            lead,
            f"{ckpt.path} is at step {step}, the end of the run: nothing to train "
            f"(pass --steps N with N > {step} to continue it)",
        )
        return None
    if "steps" in changes and changes["steps"] != TrainConfig.from_dict(ckpt.config["train"]).steps:
        _say(
            lead,
            f"continuing to step {tc.steps}: the learning-rate schedule now ends there (steps "
            f"{step + 1}-{tc.steps} follow a {tc.steps}-step warm-up + cosine; the steps before followed the "
            "old end), so the run is not the same as one planned for that many steps from the start",
        )
    data = prepare_recorded(ckpt.config["data"].get("args", {}), tokenizer=ckpt.tokenizer, rank=rank)
    _say(lead, f"resuming {ckpt.path} at step {step}/{tc.steps}")
    return _Run(ckpt.model, tc, data, ckpt.state.get("label", "model"), ckpt)


def _host_tables(rc, run: _Run, device):
    """The model's Engram tables moved into host memory (--table-tier host)."""
    from condmem.train.host_table import HostTables

    tables = HostTables(
        run.model,
        device,
        state_dtype=rc.host_state,
        threads=rc.host_threads,
        tables=run.checkpoint.tables if run.checkpoint is not None else None,
        seed=rc.seed,
        adam=rc.host_adam,
    )
    print(
        f"[{run.label}] tables in host memory: {tables.table_params:,} parameters, "
        f"{tables.host_bytes / 2**30:.2f} GiB with Adam state ({tables.setup_s:.1f} s to allocate)",
        flush=True,
    )
    return tables


def _data_parallel(args, run: _Run, rank: int, world: int, lead: bool):
    """The Engram tables sharded over the ranks (a new sharding, or the checkpoint's shards)."""
    from condmem.train.data_parallel import DataParallelTables

    dp = (
        DataParallelTables.load(args.out, run.model, int(run.checkpoint.state["step"]))
        if run.checkpoint is not None
        else DataParallelTables(run.model)
    )
    _say(lead, f"[{run.label}] tables sharded over {world} ranks, each holding its columns' rows and their Adam state")
    return dp


def _write_summary(args, rc, run: _Run, trainer, summary: dict, rank: int | None, world: int) -> None:
    """--out/summary.json: the run's numbers, configs, data record and curves."""
    from condmem.models import train_flops_per_token
    from condmem.utils.atomic import atomic_write_text

    cfg, tc = run.model.cfg, run.train_cfg
    summary.update(
        flops_per_token=train_flops_per_token(cfg, tc.seq_len),
        checkpoint=str(trainer.last_checkpoint),
        table_tier=rc.table_tier if rank is None else f"sharded over {world} ranks",
    )
    if rc.table_tier == "host":
        summary.update(host_adam=rc.host_adam)
    atomic_write_text(
        Path(args.out) / "summary.json",
        json.dumps(
            {
                "summary": summary,
                "model": cfg.to_dict(),
                "train": tc.to_dict(),
                "data": run.data.info,
                "history": trainer.history,
                "evals": trainer.evals,
            },
            indent=1,
        )
        + "\n",
        within=args.out,
    )
