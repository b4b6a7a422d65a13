"""One `condmem train` run: a `RunConfig`, a run folder and a device in; checkpoints and
``summary.json`` out.

`train_run` builds a new model from the config's preset (the build step `condmem demo` and
`condmem study` share: `condmem.train.build`) or continues the latest checkpoint of the run
folder step for step (only ``train.steps``, ``eval_every``, ``checkpoint_every`` and
``log_every`` may change on resume), moves the tables into host memory (``table_tier =
"host"``) or shards them over data-parallel ranks (under torchrun), trains, and writes the
summary. The command line (`condmem.cli.train`) claims and locks the folder and calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from condmem.models import iso_flop_baseline, train_flops_per_token
from condmem.train import build
from condmem.train.checkpoint import load_checkpoint
from condmem.train.determinism import determinism_record, deterministic_mode, set_cublas_workspace
from condmem.train.loop import TrainConfig
from condmem.train.run_config import RESUMABLE, RunConfig
from condmem.utils.atomic import atomic_write_text


class TrainRunError(ValueError):
    """A run folder that cannot do what was asked (a resume that would go back, another world size)."""


def _corpus_name(corpus) -> str:
    if not corpus:
        return "stdlib"
    return corpus if isinstance(corpus, str) else ", ".join(map(str, corpus))


@dataclass
class TrainRun:
    """What `train_run` trains: a new model, or one resumed from its checkpoint."""

    model: object
    train_cfg: object
    data: object
    label: str
    checkpoint: object = None
    """The checkpoint resumed from (None: a new run)."""


def train_run(
    config: RunConfig,
    out: str | Path,
    device_name: str = "auto",
    *,
    resume: bool = False,
    progress: bool = True,
    rank: int | None = None,
    world: int = 1,
) -> dict | None:
    """Train one model into the run folder `out` (a new run, or with `resume` the latest checkpoint
    continued); returns the summary written to ``out/summary.json`` (None on ranks other than 0, and
    when a resumed run is already at its end). `rank` is set when this process is one of `world`
    data-parallel ranks."""
    set_cublas_workspace(config.deterministic)  # before anything starts cuBLAS
    device = run_device(device_name, rank)
    lead = rank in (None, 0)
    run = resume_run(config, out, device, rank, lead) if resume else start_run(config, device, rank, lead)
    if run is None:
        return None
    tables = _host_tables(config, run, device) if config.table_tier == "host" else None
    dp = _data_parallel(out, run, rank, world, lead) if rank is not None else None
    params = run.model.param_counts()
    if tables is not None:
        params.update(tables=tables.table_params, total=params["total"] + tables.table_params)
    try:
        trainer = build.build_trainer(
            run.model,
            run.train_cfg,
            run.data,
            device,
            run_dir=out,
            label=run.label,
            progress=progress and lead,
            host_tables=tables,
            data_parallel=dp,
        )
        if run.checkpoint is not None:
            trainer.restore(run.checkpoint)
        quiet = contextlib.redirect_stdout(io.StringIO()) if not lead else contextlib.nullcontext()
        with quiet, deterministic_mode(config.deterministic):
            summary = trainer.fit()
    finally:
        if tables is not None:
            tables.close()
    if not lead:
        return None
    summary = dict(summary, params=params, determinism=determinism_record(config.deterministic))
    return _write_summary(out, config, run, trainer, summary, rank, world)


def _say(lead: bool, text: str) -> None:
    if lead:
        print(text, flush=True)


def run_device(name: str, rank: int | None) -> torch.device:
    """The device `name` says (`resolve_device`); under torchrun on CUDA, this rank's GPU (LOCAL_RANK)."""
    device = build.resolve_device(name)
    if rank is not None and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def start_run(rc: RunConfig, device: torch.device, rank: int | None, lead: bool) -> TrainRun:
    """A new model from the preset and the config (the build step `condmem demo` shares)."""
    preset = rc.resolve(device.type)
    tc = preset.train
    _say(
        lead,
        f"preset {preset.name}: batches of {tc.batch_size} x {tc.seq_len:,} tokens, {tc.steps:,} "
        f"step{'' if tc.steps == 1 else 's'}, on {device}; preparing the data ({rc.tokenizer or 'a BPE'} over "
        f"{_corpus_name(preset.data.corpus)}: read once, then cached)",
    )
    data = build.prepare(preset, tokenizer=rc.tokenizer, seed=rc.seed, rank=rank)
    cfg = build.build_model_config(preset, data)
    label = "engram"
    if rc.no_engram:
        cfg = iso_flop_baseline(cfg) if rc.iso_flop else cfg.replace(engram=None)
        label = "baseline"
    tc = dataclasses.replace(preset.train, seed=rc.seed)
    # Huge host tables are drawn on the host by HostTables; on the CPU the model's own draw is
    # kept, so both tiers start from the same rows.
    table_device = "meta" if rc.table_tier == "host" and device.type == "cuda" else None
    model = build.build_model(cfg, data, seed=rc.seed, device=device, table_device=table_device)
    _say(
        lead,
        f"[{label}] {model.param_counts()['total']:,} parameters, "
        f"{train_flops_per_token(cfg, tc.seq_len) / 1e6:,.2f} MFLOPs/token (train)",
    )
    return TrainRun(model, tc, data, label)


def resume_run(rc: RunConfig, out: str | Path, device: torch.device, rank: int | None, lead: bool) -> TrainRun | None:
    """The latest checkpoint in --out, with its data prepared again as it was (read from the
    prepared-data cache when the corpus is unchanged). train.steps (--steps) moves the end of the
    run; a run already at its end returns None (nothing to train, nothing rewritten)."""
    ckpt = load_checkpoint(out, device=device, tables_on_host=rc.table_tier == "host")
    if ckpt.tables_sharded != (rank is not None):
        how = (
            "data-parallel ranks: resume it under torchrun"
            if ckpt.tables_sharded
            else "one process: resume it without torchrun"
        )
        raise TrainRunError(f"{ckpt.path} was saved by {how}")
    tc = TrainConfig.from_dict(ckpt.config["train"])
    step = int(ckpt.state["step"])
    resumable = {key.split(".")[1] for key in RESUMABLE}
    changes = {k: v for k, v in rc.sections.get("train", {}).items() if k in resumable}
    if changes.get("steps", step + 1) < step:
        raise TrainRunError(
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
    data = build.prepare_recorded(ckpt.config["data"].get("args", {}), tokenizer=ckpt.tokenizer, rank=rank)
    _say(lead, f"resuming {ckpt.path} at step {step}/{tc.steps}")
    return TrainRun(ckpt.model, tc, data, ckpt.state.get("label", "model"), ckpt)


def _host_tables(rc: RunConfig, run: TrainRun, device: torch.device):
    """The model's Engram tables moved into host memory (``table_tier = "host"``)."""
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


def _data_parallel(out: str | Path, run: TrainRun, rank: int, world: int, lead: bool):
    """The Engram tables sharded over the ranks (a new sharding, or the checkpoint's shards)."""
    from condmem.train.data_parallel import DataParallelTables

    dp = (
        DataParallelTables.load(out, run.model, int(run.checkpoint.state["step"]))
        if run.checkpoint is not None
        else DataParallelTables(run.model)
    )
    _say(lead, f"[{run.label}] tables sharded over {world} ranks, each holding its columns' rows and their Adam state")
    return dp


def _write_summary(
    out: str | Path, rc: RunConfig, run: TrainRun, trainer, summary: dict, rank: int | None, world: int
) -> dict:
    """``out/summary.json``: the run's numbers, its run config (as given: `RunConfig.from_dict` reads it
    back), the resolved model and training configs, data record and curves; returns the summary."""
    cfg, tc = run.model.cfg, run.train_cfg
    summary.update(
        flops_per_token=train_flops_per_token(cfg, tc.seq_len),
        checkpoint=str(trainer.last_checkpoint),
        table_tier=rc.table_tier if rank is None else f"sharded over {world} ranks",
    )
    if rc.table_tier == "host":
        summary.update(host_adam=rc.host_adam)
    atomic_write_text(
        Path(out) / "summary.json",
        json.dumps(
            {
                "summary": summary,
                "run_config": rc.to_dict(),
                "model": cfg.to_dict(),
                "train": tc.to_dict(),
                "data": run.data.info,
                "history": trainer.history,
                "evals": trainer.evals,
            },
            indent=1,
        )
        + "\n",
        within=out,
    )
    return summary
