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

# Each option that changes a preset value: option name -> (preset section, field).
_PRESET_OPTIONS = {
    "dim": ("model", "dim"),
    "layers": ("model", "n_layers"),
    "heads": ("model", "n_heads"),
    "kv_heads": ("model", "n_kv_heads"),
    "ffn": ("model", "ffn_hidden"),
    "max_seq_len": ("model", "max_seq_len"),
    "engram_layers": ("engram", "layer_ids"),
    "ngram": ("engram", "max_ngram_size"),
    "engram_heads": ("engram", "n_heads"),
    "engram_head_dim": ("engram", "head_dim"),
    "table_size": ("engram", "table_size"),
    "table_init_std": ("engram", "table_init_std"),
    "steps": ("train", "steps"),
    "batch_size": ("train", "batch_size"),
    "seq_len": ("train", "seq_len"),
    "lr": ("train", "lr"),
    "table_lr_mult": ("train", "table_lr_mult"),
    "warmup": ("train", "warmup_steps"),
    "weight_decay": ("train", "weight_decay"),
    "grad_clip": ("train", "grad_clip"),
    "eval_every": ("train", "eval_every"),
    "eval_tokens": ("train", "eval_tokens"),
    "checkpoint_every": ("train", "checkpoint_every"),
    "minutes": ("train", "max_minutes"),
    "log_every": ("train", "log_every"),
    "precision": ("train", "precision"),
    "corpus": ("data", "corpus"),
    "vocab_size": ("data", "vocab_size"),
    "max_train_bytes": ("data", "max_train_bytes"),
    "max_val_tokens": ("data", "max_val_tokens"),
    "experts": ("model", "moe.n_experts"),
    "top_k": ("model", "moe.top_k"),
    "expert_ffn": ("model", "moe.expert_hidden"),
    "moe_layers": ("model", "moe.layer_ids"),
}


def add_moe_arguments(group) -> None:
    """--experts, --top-k, --expert-ffn, --moe-layers (shared with `condmem demo`)."""
    group.add_argument(
        "--experts",
        type=int,
        help="routed experts per block: an MoE backbone (--ffn is then the shared expert's width, 0: none)",
    )
    group.add_argument("--top-k", type=int, help="with --experts: routed experts per token (default 2)")
    group.add_argument("--expert-ffn", type=int, help="with --experts: SwiGLU width of one routed expert (default 128)")
    group.add_argument(
        "--moe-layers", type=int, nargs="+", help="with --experts: blocks with routed experts (default: all)"
    )


def register(sub) -> None:
    """The ``condmem train`` command and its options."""
    p = sub.add_parser(
        "train",
        help="train one reference LM (Engram by default) with checkpoints; --resume continues exactly",
        description="Train the reference decoder LM on a corpus (default: the Python standard library source). "
        "AdamW for the backbone, sparse Adam for the Engram tables (their own learning rate, no weight decay), "
        "warm-up + cosine, gradient clipping, bf16 autocast on GPU. Checkpoints (safetensors, resolved config, "
        "tokenizer, fingerprints) go to OUT/checkpoints; --resume continues the latest one step for step.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem train --out runs/engram --steps 1000\n"
        "  condmem train --out runs/base --no-engram --iso-flop\n  condmem train --out runs/engram --resume\n"
        "  condmem train --out runs/big --table-size 10000000 --table-tier host   # tables + Adam state in host RAM\n"
        "  condmem train --out runs/moe --experts 8 --top-k 2 --expert-ffn 128 --ffn 256   # routed experts\n"
        "  condmem train --out runs/engram --resume --steps 2000   # continue a finished run to step 2000\n"
        "  torchrun --nproc-per-node 8 -m condmem train --out runs/dp   # tables sharded over 8 data-parallel ranks",
    )
    _add_run_arguments(p)
    _add_data_arguments(p.add_argument_group("data"))
    _add_model_arguments(p.add_argument_group("model"))
    _add_engram_arguments(p.add_argument_group("engram"))
    _add_training_arguments(p.add_argument_group("training"))
    p.set_defaults(func=run)


def _add_run_arguments(p) -> None:
    """Where the run lives (--out, --resume, --overwrite), its preset, device and seed."""
    p.add_argument("--out", required=True, help="run directory (checkpoints, summary.json)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a used --out: its checkpoints and summary.json are deleted first",
    )
    p.add_argument("--preset", choices=["cpu", "gpu", "tiny"], help="base settings (default: gpu with CUDA, else cpu)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels: the same seed and options give bit-identical losses on one machine type "
        "(costs GPU speed; docs/training.md)",
    )


def _add_data_arguments(d) -> None:
    """The corpus and the tokenizer."""
    d.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="directories, text, .jsonl, .parquet/.arrow files or a save_to_disk folder, streamed (default: stdlib)",
    )
    d.add_argument("--tokenizer", help="tokenizer.json / directory / 'deepseek-v4' instead of training a BPE")
    d.add_argument("--vocab-size", type=int, help="BPE vocabulary size")
    d.add_argument("--max-train-bytes", type=int, help="encode at most this much of the training split")
    d.add_argument("--max-val-tokens", type=int, help="keep at most this many deduplicated validation tokens")


def _add_model_arguments(m) -> None:
    """The backbone's shape (dense, or with routed experts)."""
    m.add_argument("--dim", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--ffn", type=int, help="SwiGLU hidden width")
    m.add_argument("--max-seq-len", type=int)
    add_moe_arguments(m)


def _add_engram_arguments(e) -> None:
    """The Engram layers (or the baseline without them) and the tier their tables train in."""
    e.add_argument("--no-engram", action="store_true", help="train the plain baseline")
    e.add_argument(
        "--iso-flop",
        action="store_true",
        help="with --no-engram: widen the MLP of the would-be Engram blocks by the Engram's FLOPs",
    )
    e.add_argument("--engram-layers", type=int, nargs="+", help="blocks holding an Engram (default: 1)")
    e.add_argument("--ngram", type=int, help="max n-gram order N (orders 2..N)")
    e.add_argument("--engram-heads", type=int, help="hash heads per order")
    e.add_argument("--engram-head-dim", type=int, help="width of one table row")
    e.add_argument("--table-size", type=int, help="bucket range per (order, head)")
    e.add_argument("--table-init-std", type=float)
    e.add_argument(
        "--table-tier",
        choices=["module", "host"],
        default="module",
        help="module: the tables are model parameters on --device; host: tables and their Adam state "
        "live in (page-locked) host memory, rows fetched each step with the next step's prefetched "
        "(exact; docs/training.md). Checkpoints are the same either way.",
    )
    e.add_argument(
        "--host-state",
        choices=["fp32", "bf16"],
        default="fp32",
        help="with --table-tier host: Adam moments in fp32 (exact) or bf16 (8 instead of 12 B/parameter)",
    )
    e.add_argument("--host-threads", type=int, help="with --table-tier host: threads of the host Adam and gathers")
    e.add_argument(
        "--host-adam",
        choices=["host", "device"],
        default="host",
        help="with --table-tier host: where Adam runs: on the host's threads, or on the device with the "
        "host only storing rows and state (exact either way; docs/training.md)",
    )


def _add_training_arguments(t) -> None:
    """The optimizer, schedule, budget, evaluation, checkpoints and logging."""
    t.add_argument("--steps", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--seq-len", type=int)
    t.add_argument("--lr", type=float, help="backbone peak learning rate")
    t.add_argument("--table-lr-mult", type=float, help="table learning rate / backbone learning rate (default 5)")
    t.add_argument("--warmup", type=int, help="warm-up steps")
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--grad-clip", type=float)
    t.add_argument("--eval-every", type=int)
    t.add_argument("--eval-tokens", type=int)
    t.add_argument("--checkpoint-every", type=int)
    t.add_argument("--minutes", type=float, help="wall-clock budget; the step count is fitted to it")
    t.add_argument("--log-every", type=int)
    t.add_argument("--precision", choices=["auto", "fp32", "bf16"])
    t.add_argument("--no-progress", action="store_true")


def preset_overrides(args) -> dict[str, dict]:
    """The options the user gave, by preset section (for `Preset.override`)."""
    out: dict[str, dict] = {}
    for option, (section, key) in _PRESET_OPTIONS.items():
        value = getattr(args, option, None)
        if value is not None:
            *parents, leaf = key.split(".")
            target = out.setdefault(section, {})
            for parent in parents:
                target = target.setdefault(parent, {})
            target[leaf] = value
    return out


def check_args(args) -> None:
    """Refuse flag values that would crash or hang later, before the corpus is read (exit status 2);
    say up front when --seq-len raises the preset's max_seq_len."""
    from condmem.cli.common import check_float, check_vocab_size, device_flag
    from condmem.train.presets import PRESETS, default_preset_name

    device = device_flag(args.device)
    check_vocab_size(args.vocab_size)
    check_float(args.table_init_std, "--table-init-std", strict=True)
    if args.seq_len is not None and args.max_seq_len is not None and args.seq_len > args.max_seq_len:
        raise UsageError(
            f"--seq-len {args.seq_len:,} is longer than --max-seq-len {args.max_seq_len:,}: a training window "
            "must fit the model's positions"
        )
    preset = args.preset or default_preset_name(device.type)
    limit = PRESETS[preset].model.max_seq_len
    if not args.resume and args.seq_len is not None and args.max_seq_len is None and args.seq_len > limit:
        note(
            "train",
            f"--seq-len {args.seq_len:,} is above the {preset} preset's max_seq_len {limit:,}: the model's "
            f"max_seq_len is raised to {args.seq_len:,} (pass --max-seq-len to set it); a step attends over "
            f"{args.seq_len:,} tokens a sequence, its cost growing with their square",
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
    check_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_ranks(args)
    out = check_output_dir(args.out, "--out")
    with RunLock(out):
        _claim(args, out)
        return _train(args)


def _run_ranks(args) -> int:
    import torch
    import torch.distributed as dist

    from condmem.utils.preflight import check_output_dir
    from condmem.utils.run_lock import RunLock

    if args.table_tier == "host":
        raise CliError("--table-tier host is for one process; under torchrun the tables are sharded over the ranks")
    if args.no_engram:
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
        code = _train(args, rank=rank, world=dist.get_world_size())
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


def _train(args, rank: int | None = None, world: int = 1) -> int:
    """Train one model; `rank` is set when this process is one of `world` data-parallel ranks."""
    from condmem.train.build import build_trainer
    from condmem.train.determinism import determinism_record, deterministic_mode, set_cublas_workspace

    set_cublas_workspace(args.deterministic)  # before anything starts cuBLAS
    device = _device(args, rank)
    lead = rank in (None, 0)
    if args.no_engram and args.table_tier == "host":
        raise CliError("--table-tier host needs Engram tables; drop --no-engram")
    fresh = not args.resume
    if args.resume and _nothing_to_resume(Path(args.out)):
        if lead:
            note(
                "train",
                f"--resume: {args.out} holds no checkpoint yet (a run stopped before its first save completed): "
                "starting the run afresh there with this command's options",
            )
        fresh = True
    run = _start(args, device, rank, lead) if fresh else _resume(args, device, rank, lead)
    if run is None:
        return 0
    tables = _host_tables(args, run, device) if args.table_tier == "host" else None
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
        with quiet, deterministic_mode(args.deterministic):
            summary = trainer.fit()
    finally:
        if tables is not None:
            tables.close()
    if lead:
        summary = dict(summary, params=params, determinism=determinism_record(args.deterministic))
        _write_summary(args, run, trainer, summary, rank, world)
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


def _start(args, device, rank: int | None, lead: bool) -> _Run:
    """A new model from the preset and the options (the build step `condmem demo` shares)."""
    import dataclasses

    from condmem.models import iso_flop_baseline, train_flops_per_token
    from condmem.train.build import build_model, build_model_config, prepare
    from condmem.train.presets import default_preset_name, get_preset

    preset = get_preset(args.preset or default_preset_name(device.type), preset_overrides(args))
    tc = preset.train
    _say(
        lead,
        f"preset {preset.name}: batches of {tc.batch_size} x {tc.seq_len:,} tokens, {tc.steps:,} "
        f"step{'' if tc.steps == 1 else 's'}, on {device}; preparing the data ({args.tokenizer or 'a BPE'} over "
        f"{_corpus_name(preset.data.corpus)}: read once, then cached)",
    )
    data = prepare(preset, tokenizer=args.tokenizer, seed=args.seed, rank=rank)
    cfg = build_model_config(preset, data)
    label = "engram"
    if args.no_engram:
        cfg = iso_flop_baseline(cfg) if args.iso_flop else cfg.replace(engram=None)
        label = "baseline"
    tc = dataclasses.replace(preset.train, seed=args.seed)
    # Huge host tables are drawn on the host by HostTables; on the CPU the model's own draw is
    # kept, so both tiers start from the same rows.
    table_device = "meta" if args.table_tier == "host" and device.type == "cuda" else None
    model = build_model(cfg, data, seed=args.seed, device=device, table_device=table_device)
    _say(
        lead,
        f"[{label}] {model.param_counts()['total']:,} parameters, "
        f"{train_flops_per_token(cfg, tc.seq_len) / 1e6:,.2f} MFLOPs/token (train)",
    )
    return _Run(model, tc, data, label)


# What a resumed run may change: when it stops, how often it evaluates, logs and checkpoints.
_RESUME_OPTIONS = ("steps", "eval_every", "checkpoint_every", "log_every")


def _resume(args, device, rank: int | None, lead: bool) -> _Run | None:
    """The latest checkpoint in --out, with its data prepared again as it was (read from the
    prepared-data cache when the corpus is unchanged). --steps N moves the end of the run to
    step N; a run already at its end returns None (nothing to train, nothing rewritten)."""
    import dataclasses

    from condmem.train.build import prepare_recorded
    from condmem.train.checkpoint import load_checkpoint
    from condmem.train.loop import TrainConfig

    fixed = [
        f"--{o.replace('_', '-')}"
        for o in [*_PRESET_OPTIONS, "preset", "tokenizer"]
        if o not in _RESUME_OPTIONS and getattr(args, o, None) is not None
    ]
    fixed += [f"--{o.replace('_', '-')}" for o in ("no_engram", "iso_flop") if getattr(args, o)]
    if fixed:
        free = ", ".join("--" + o.replace("_", "-") for o in _RESUME_OPTIONS)
        raise CliError(
            f"{', '.join(fixed)}: a resumed run keeps the settings of its checkpoint (config.json); drop "
            f"{'it' if len(fixed) == 1 else 'them'} (with --resume only {free} may change), or start "
            "afresh with --overwrite"
        )
    ckpt = load_checkpoint(args.out, device=device, tables_on_host=args.table_tier == "host")
    if ckpt.tables_sharded != (rank is not None):
        how = (
            "data-parallel ranks: resume it under torchrun"
            if ckpt.tables_sharded
            else "one process: resume it without torchrun"
        )
        raise CliError(f"{ckpt.path} was saved by {how}")
    tc = TrainConfig.from_dict(ckpt.config["train"])
    step = int(ckpt.state["step"])
    changes = {o: getattr(args, o) for o in _RESUME_OPTIONS if getattr(args, o) is not None}
    if changes.get("steps", step + 1) < step:
        raise CliError(
            f"--steps {args.steps}: {ckpt.path} is at step {step} already, and a run does not go back; "
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


def _host_tables(args, run: _Run, device):
    """The model's Engram tables moved into host memory (--table-tier host)."""
    from condmem.train.host_table import HostTables

    tables = HostTables(
        run.model,
        device,
        state_dtype=args.host_state,
        threads=args.host_threads,
        tables=run.checkpoint.tables if run.checkpoint is not None else None,
        seed=args.seed,
        adam=args.host_adam,
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


def _write_summary(args, run: _Run, trainer, summary: dict, rank: int | None, world: int) -> None:
    """--out/summary.json: the run's numbers, configs, data record and curves."""
    from condmem.models import train_flops_per_token
    from condmem.utils.atomic import atomic_write_text

    cfg, tc = run.model.cfg, run.train_cfg
    summary.update(
        flops_per_token=train_flops_per_token(cfg, tc.seq_len),
        checkpoint=str(trainer.last_checkpoint),
        table_tier=args.table_tier if rank is None else f"sharded over {world} ranks",
    )
    if args.table_tier == "host":
        summary.update(host_adam=args.host_adam)
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
