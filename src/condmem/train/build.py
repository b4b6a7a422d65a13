"""The one build step of `condmem demo`, `condmem train` and `condmem study`.

    preset + the command's options (`Preset.override`)
      -> `prepare`: corpus, tokenizer, train/validation token streams (cached on disk)
      -> `build_model_config`: the model's config (V' from the compressed tokenizer)
      -> `build_model`: weights drawn from (seed, parameter name)
      -> `build_trainer`: batches from (the training seed, step)

The three commands go through these steps in this order, so one preset and seed give the
same tokenizer, batches, initial weights and losses whichever command trains. The device
and step-cap helpers they share live here too.
"""

from __future__ import annotations

import dataclasses
import os
import platform

import torch

from condmem.config import EngramConfig
from condmem.models import DecoderLM, ModelConfig
from condmem.train.heldout import DEDUP_THRESHOLD
from condmem.train.loop import TrainConfig, Trainer
from condmem.train.pipeline import PreparedData, prepare_data
from condmem.train.presets import Preset
from condmem.utils.code_version import code_commit


def resolve_device(device: str | None) -> torch.device:
    """``auto`` / None: CUDA when available, else the CPU; a name torch does not know, or a CUDA
    device torch cannot see, is a ValueError naming ``--device``."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: not a device (auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: condmem runs on auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


def machine_info(device: torch.device) -> dict:
    """Versions, the code's commit, threads and the device, for a summary."""
    info = {
        "commit": code_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def prepare(
    preset: Preset,
    *,
    tokenizer=None,
    seed: int = 0,
    use_cache: bool = True,
    dedup_threshold: float | None = DEDUP_THRESHOLD,
    rank: int | None = None,
) -> PreparedData:
    """The preset's data (`prepare_data` with its data section).

    `rank`: this process is one of several data-parallel ranks: rank 0 prepares first and
    writes the caches, the others then read them (no two ranks train the same tokenizer).
    """
    d = preset.data
    return _ranked(
        rank,
        lambda: prepare_data(
            d.corpus,
            tokenizer=tokenizer,
            vocab_size=d.vocab_size,
            max_corpus_bytes=d.max_corpus_bytes,
            max_train_bytes=d.max_train_bytes,
            tokenizer_train_bytes=d.tokenizer_train_bytes,
            seed=seed,
            use_cache=use_cache,
            dedup_threshold=dedup_threshold,
            max_val_tokens=d.max_val_tokens,
        ),
    )


def prepare_recorded(args: dict, *, tokenizer, rank: int | None = None) -> PreparedData:
    """The data of a run again, from the arguments its `PreparedData.info` recorded (``info["args"]``)."""
    data = _ranked(
        rank,
        lambda: prepare_data(
            args.get("corpus"),
            tokenizer=tokenizer,
            vocab_size=args.get("vocab_size", 4096),
            max_corpus_bytes=args.get("max_corpus_bytes"),
            max_train_bytes=args.get("max_train_bytes"),
            tokenizer_train_bytes=args.get("tokenizer_train_bytes"),
            val_fraction=args.get("val_fraction", 0.02),
            seed=args.get("seed", 0),
            dedup_threshold=args.get("dedup_threshold"),
            max_val_tokens=args.get("max_val_tokens"),
        ),
    )
    data.info["args"] = args
    return data


def _ranked(rank: int | None, prepare_fn):
    if rank is None:
        return prepare_fn()
    import torch.distributed as dist

    if rank != 0:
        dist.barrier()  # rank 0 has written the tokenizer and token caches
    try:
        return prepare_fn()
    finally:
        if rank == 0:
            dist.barrier()


def build_model_config(preset: Preset, data: PreparedData, *, engram: bool = True) -> ModelConfig:
    """The model's config from a preset and the prepared data (V' from its compressed tokenizer)."""
    m, e = preset.model, preset.engram
    vocab = data.tokenizer.get_vocab_size(with_added_tokens=True)
    ecfg = None
    if engram:
        ecfg = EngramConfig(
            layer_ids=list(e.layer_ids),
            max_ngram_size=e.max_ngram_size,
            n_heads=e.n_heads,
            head_dim=e.head_dim,
            table_size=e.table_size,
            pad_id=data.pad_id,
            hidden_size=m.dim,
            hc_mult=1,
            short_conv=e.short_conv,
            compressed_vocab_size=data.ctok.vocab_size,
        )
    return ModelConfig(vocab_size=vocab, engram=ecfg, engram_table_init_std=e.table_init_std, **dataclasses.asdict(m))


def build_model(
    cfg: ModelConfig, data: PreparedData, *, seed: int, device: torch.device | str, table_device=None
) -> DecoderLM:
    """A `DecoderLM` of `cfg` whose initial weights depend on `seed` only (and the Engram hasher on `data`)."""
    return DecoderLM(cfg, token_lookup=data.ctok.lookup, seed=seed, device=device, table_device=table_device)


def build_trainer(
    model: DecoderLM,
    train_cfg: TrainConfig,
    data: PreparedData,
    device: torch.device | str,
    *,
    run_dir=None,
    label: str = "model",
    progress: bool = True,
    host_tables=None,
    data_parallel=None,
) -> Trainer:
    """The `Trainer` of `model` on `data`; checkpoints (with `run_dir`) carry the tokenizer and data record."""
    return Trainer(
        model,
        train_cfg,
        data.train,
        data.val,
        data.token_bytes,
        device,
        run_dir=run_dir,
        label=label,
        checkpoint_extra={"tokenizer": data.tokenizer, "ctok": data.ctok, "data": data.info},
        progress=progress,
        host_tables=host_tables,
        data_parallel=data_parallel,
    )


def cap_steps(requested: int, stream, batch_size: int, seq_len: int, max_passes: float) -> tuple[int, dict]:
    """Steps after capping at `max_passes` passes over `stream`, and a record of the decision."""
    per_pass = stream.windows_per_pass(seq_len)
    limit = max(1, int(max_passes * per_pass // batch_size))
    steps = min(requested, limit)
    record = {
        "requested_steps": requested,
        "steps": steps,
        "max_passes": max_passes,
        "capped": steps < requested,
        "steps_per_pass": per_pass / batch_size,
        "train_tokens_available": len(stream),
        "passes": stream.passes(steps, batch_size, seq_len),
        "requested_passes": stream.passes(requested, batch_size, seq_len),
    }
    return steps, record


def banner(text: str) -> str:
    """A warning that does not scroll by unnoticed."""
    bar = "!" * 78
    return f"\n{bar}\n{text}\n{bar}\n"
