"""``condmem convert``: re-format Engram tables (bf16 / fp8 / interleaved fp8), streaming."""

from __future__ import annotations

import argparse
import logging
import time

from condmem.cli import CliError

log = logging.getLogger("condmem.convert")


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert table files between bf16, fp8 and interleaved fp8 rows",
        description="Stream an Engram table file (or a released DeepSeek-V4.1 checkpoint's Engram tensors) into a new "
        "condmem table file in another row format, chunk by chunk: memory stays bounded whatever the table size; the "
        "output appears atomically when complete. bf16 -> fp8 quantizes (fp8 e4m3 + e8m0 scale per 32); fp8 <-> "
        "fp8_interleaved only moves bytes (exact). What is read is checked: a table file's blocks against their CRCs; "
        "a released checkpoint's scales (NaN / inf refused, naming tensor and row) and its shards, which must lie "
        "inside its folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  condmem convert tables.safetensors tables-i.safetensors --to fp8_interleaved\n"
        "  condmem convert --released ./DeepSeek-V4.1-Flash tables.safetensors --to fp8_interleaved \\\n"
        "      --tokenizer deepseek-v4        (config.json read from the checkpoint folder)",
    )
    p.add_argument("src", help="condmem table file, or (with --released) a checkpoint directory / safetensors file")
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
        help="Engram config (any dialect, a HF config.json too); with --released, by default "
        "the checkpoint folder's config.json",
    )
    p.add_argument(
        "--config-key", help="JSON section holding the Engram keys when neither the top level nor text_config"
    )
    p.add_argument(
        "--dialect", choices=["original", "hf"], help="tensor naming of a released checkpoint (detected when not given)"
    )
    p.add_argument("--tokenizer", help="tokenizer whose compressed-map fingerprint is recorded (and checked)")
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


def run(args) -> int:
    from condmem.cli.common import load_config
    from condmem.layout import EngramLayout
    from condmem.tables.convert import convert_tables
    from condmem.tables.released import ReleasedCheckpoint, load_released_tables
    from condmem.tables.table_file import EngramTableFile

    from condmem.utils.preflight import check_output_file

    check_output_file(args.dst, "dst")
    fingerprint = None
    vocab = None
    if args.tokenizer:
        from condmem.tokenizer import CompressedTokenizer

        ctok = CompressedTokenizer.from_any(args.tokenizer)
        fingerprint, vocab = ctok.fingerprint, ctok.vocab_size
    if args.released:
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
        tables = load_released_tables(ckpt, layout, args.weight_name, args.scale_name)
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
