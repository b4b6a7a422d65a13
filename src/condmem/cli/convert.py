"""``condmem convert``: the Engram tables of any artefact condmem reads into a table file, streaming."""

from __future__ import annotations

import argparse
import logging
import time

from condmem.cli import CliError, UsageError

log = logging.getLogger("condmem.convert")


EPILOG = """examples:
  condmem train --preset tiny --out tiny-run --steps 20      a tiny Engram model (a minute on a CPU)
  condmem convert tiny-run tiny-tables.safetensors --to bf16      its latest checkpoint's tables
  condmem convert --released ./DeepSeek-V4.1-Flash tables.safetensors --to fp8_interleaved \\
      --tokenizer deepseek-v4        (config.json read from the checkpoint folder)
  condmem convert tables.safetensors tables-fp8.safetensors --to fp8"""


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="write Engram tables (of a trained model, a table file or a released checkpoint) to a table file",
        description="Write the Engram tables of SRC into a new condmem table file in a row format, chunk by chunk: "
        "memory stays bounded whatever the table size; the output appears atomically when complete. SRC is a "
        "training run (its latest checkpoint) or checkpoint folder, a Hugging Face model saved with Engram, a "
        "condmem table file, or a released DeepSeek-V4.1 checkpoint (detected; --released says so). A trained "
        "model's float rows are written exactly as torch rounds them: bf16 rows equal weight.to(torch.bfloat16), "
        "fp8 rows the e8m0 quantization of the float32 values (fp8 needs head_dim a multiple of 32). bf16 -> fp8 "
        "quantizes (fp8 e4m3 + e8m0 scale per 32); fp8 <-> fp8_interleaved only moves bytes (exact). What is read "
        "is checked: a checkpoint as its loader checks it (every file's sha256, the tokenizer and layout "
        "fingerprints); a Hugging Face folder's layout and tensor shapes; a table file's blocks against their "
        "CRCs; a released checkpoint's scales (NaN / inf refused, naming tensor and row) and its shards, which "
        "must lie inside its folder. Refused, with the reason: a model without Engram, tables sharded over "
        "data-parallel ranks, a model trained with random table addresses.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "src",
        help="training run or checkpoint folder, Hugging Face folder, condmem table file, or released checkpoint",
    )
    p.add_argument("dst", help="output table file (.safetensors)")
    p.add_argument("--to", required=True, choices=["bf16", "fp8", "fp8_interleaved"], help="row format to write")
    p.add_argument(
        "--released",
        action="store_true",
        help="SRC is a released DeepSeek-V4.1 checkpoint (folder or file; tensor names of either dialect "
        "detected: layers.L.engram.embed.weight + .scale, or model.… + .weight_scale_inv)",
    )
    p.add_argument(
        "--config",
        help="Engram config (any dialect, a HF config.json too) of a released checkpoint (default: its folder's "
        "config.json) or a table file (checked against it)",
    )
    p.add_argument(
        "--config-key", help="JSON section holding the Engram keys when neither the top level nor text_config"
    )
    p.add_argument(
        "--dialect", choices=["original", "hf"], help="tensor naming of a released checkpoint (detected when not given)"
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer whose compressed-map fingerprint is recorded (and checked: a trained model's must be the "
        "one it was trained with)",
    )
    p.add_argument("--weight-name", help="tensor name template for rows, e.g. 'layers.{layer_id}.engram.embed.weight'")
    p.add_argument("--scale-name", help="tensor name template for scales")
    p.add_argument("--chunk-rows", type=int, default=1 << 18, help="rows converted at a time (default 262144)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="convert a condmem table file that has no chunk hashes (an older file; the output gets them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _released_tables(args, vocab):
    from condmem.tables.released import ReleasedCheckpoint, load_released_tables

    ckpt = ReleasedCheckpoint(args.src, args.config, config_key=args.config_key, dialect=args.dialect)
    if ckpt.config is None:
        raise CliError(
            f"no config.json in the checkpoint folder of {args.src}: pass --config (released tensors "
            "do not record the hash layout)"
        )
    layout = ckpt.layout(compressed_vocab_size=vocab)
    log.info(
        "%s: %s tensor names%s, config %s",
        args.src,
        ckpt.names.dialect,
        f" (prefix {ckpt.names.prefix!r})" if ckpt.names.prefix else "",
        ckpt.config_path or "given",
    )
    return load_released_tables(ckpt, layout, args.weight_name, args.scale_name), layout


def _trained_tables(args, artefact):
    """(tables, layout, tokenizer fingerprint) of a training checkpoint or a Hugging Face folder."""
    from pathlib import Path

    from condmem.artefacts import trained_tables

    for flag, value in (
        ("--config", args.config),
        ("--config-key", args.config_key),
        ("--dialect", args.dialect),
        ("--weight-name", args.weight_name),
        ("--scale-name", args.scale_name),
        ("--no-verify", args.no_verify or None),
    ):
        if value is not None:
            raise UsageError(
                f"{flag} does not apply to {args.src}, a {artefact.label}: its own config, tensor names "
                "and checksums are used"
            )
    folder = artefact.path.resolve()
    if folder in Path(args.dst).resolve().parents:
        raise CliError(f"dst {args.dst} lies inside {artefact.path}: write the table file outside the model's folder")
    found = trained_tables(artefact, tokenizer=args.tokenizer)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in found.tensors.values()})
    log.info(
        "%s: %s%s, layers %s, %s rows (%s)%s",
        args.src,
        artefact.label,
        f" {artefact.path}" if artefact.via else "",
        found.layout.layer_ids,
        f"{sum(found.layout.num_embeddings):,}",
        ", ".join(dtypes),
        "; rounded to bf16 (nearest even)" if args.to == "bf16" and dtypes != ["bfloat16"] else "",
    )
    return found.tensors, found.layout, found.tokenizer_fingerprint


def run(args) -> int:
    from condmem.cli.common import load_config
    from condmem.layout import EngramLayout
    from condmem.artefacts import find_artefact
    from condmem.tables.convert import convert_tables
    from condmem.tables.table_file import EngramTableFile

    from condmem.utils.preflight import check_output_file

    check_output_file(args.dst, "dst")
    fingerprint = None
    vocab = None
    kind = "released" if args.released else None
    if kind is None:
        artefact = find_artefact(args.src)
        kind = artefact.kind
    if kind in ("checkpoint", "hf"):
        tables, layout, fingerprint = _trained_tables(args, artefact)
    else:
        if args.tokenizer:
            from condmem.tokenizer import CompressedTokenizer

            ctok = CompressedTokenizer.from_any(args.tokenizer)
            fingerprint, vocab = ctok.fingerprint, ctok.vocab_size
        if kind == "released":
            tables, layout = _released_tables(args, vocab)
        else:
            source = EngramTableFile(
                args.src, tokenizer_fingerprint=fingerprint, verify="none" if args.no_verify else "read"
            )
            layout = source.layout()
            if args.config:
                source.check_layout(
                    EngramLayout(load_config(args.config, key=args.config_key), compressed_vocab_size=vocab)
                )
            fingerprint = fingerprint or source.tokenizer_fingerprint
            tables = source.tables()
    from condmem.tables.table_file import file_bytes

    check_output_file(args.dst, "dst", need_bytes=file_bytes(layout, args.to))
    start = time.perf_counter()
    try:
        out = convert_tables(
            tables, layout, args.dst, args.to, fingerprint, args.chunk_rows, progress=not args.no_progress
        )
    except OSError as exc:
        if exc.filename is None:  # a write to the output (a full disk): name it, not just "[Errno 28]"
            exc.filename = str(args.dst)
        raise
    seconds = time.perf_counter() - start
    size = out.stat().st_size
    log.info(
        "wrote %s: %s rows of layers %s, %.2f GiB in %.1f s (%.2f GiB/s)",
        out,
        f"{sum(layout.num_embeddings):,}",
        layout.layer_ids,
        size / 2**30,
        seconds,
        size / 2**30 / max(seconds, 1e-9),
    )
    return 0
