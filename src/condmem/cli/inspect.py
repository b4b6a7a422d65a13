"""``condmem inspect``: what a checkpoint or table file holds, before committing memory to it.

Also the validator: exit status 1 when the loaders would refuse the checkpoint (every error
listed, each naming the tensor, the shape found and the shape expected), or when a row it read
was damaged (a block against its CRC32C; a NaN / inf scale), 0 otherwise (warnings included).
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="layout, tensors, bytes per tier and row statistics of a checkpoint or table file",
        description="Report on a released DeepSeek-V4.1 checkpoint (folder or safetensors file) or a condmem table "
        "file: layout and fingerprint, the Engram tensors found (naming dialect, names, dtypes, shapes), bytes per "
        "tier, each table's row count against its primes, and a histogram of the scale exponents with all-zero / NaN "
        "/ inf rows counted (over a sample of rows, or every row with --full). It checks what the loaders check "
        "(every tensor's presence, dtype and shape, rows against primes, wkv's block divisibility, the config against "
        "the tensors, every table scale of a released checkpoint: NaN / inf refused) and every row it reads (a table "
        "file's block CRCs), and exits 1 when there is an error, 0 otherwise (warnings included).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem inspect ./DeepSeek-V4.1-Flash\n"
        "  condmem inspect tables.safetensors --full --json\n"
        "  condmem inspect tables.safetensors --verify",
    )
    p.add_argument("path", help="checkpoint folder, safetensors file, or condmem table file")
    p.add_argument("--config", help="Engram config for a checkpoint (default: its folder's config.json)")
    p.add_argument("--config-key", help="JSON section holding the Engram keys (default: top level or text_config)")
    p.add_argument(
        "--full", action="store_true", help="statistics over every row, each checked (streams the whole table)"
    )
    p.add_argument(
        "--sample", type=int, default=65536, help="rows sampled per layer without --full (>= 1; default 65536)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="condmem table file: read every block of every tensor and compare it with its recorded "
        "checksum (exit status 1 naming the first damaged block)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_report(r: dict) -> str:
    """The report as text lines."""
    lines = [f"{r['kind']}: {r['path']}"]
    if r["kind"] == "condmem table file":
        lines.append(
            f"  format {r['format']}, {_gib(r['file_bytes'])} on disk, tokenizer fingerprint "
            f"{(r['tokenizer_fingerprint'] or 'none')[:16]}"
        )
    else:
        lines.append(
            f"  {r['files']} file(s), {_gib(r['file_bytes'])}; tensor names: {r['tensor_names']}"
            f"{' (prefix ' + repr(r['prefix']) + ')' if r['prefix'] else ''}; Engram layers in tensors: "
            f"{r['engram_layers_in_tensors']}"
        )
        lines.append(
            f"  config: {r['config'] or 'none found (pass --config)'}"
            + (f"; backbone {r['backbone']}" if r.get("backbone") else "")
        )
    if r.get("layout"):
        lay = r["layout"]
        lines.append(
            f"  layout: layers {lay['layer_ids']}, rows {', '.join(f'{n:,}' for n in lay['num_embeddings'])}, "
            f"V' {lay['compressed_vocab_size']:,}, fingerprint {lay['fingerprint'][:16]}"
        )
    for layer in r["layers"]:
        lines.append(f"  layer {layer['layer_id']}:")
        for role, t in layer.get("tensors", {}).items():
            if t.get("missing"):
                lines.append(f"    {role:<12} MISSING  {t['name']}")
            else:
                bad = "" if t.get("ok", True) else "  <- ERROR"
                lines.append(f"    {role:<12} {t['dtype']:<16} {t['shape']!s:<16} {t['name']}  ({t['file']}){bad}")
        if "wkv_block" in layer:
            lines.append(f"    wkv block shape {layer['wkv_block']}")
        if "rows_match_primes" in layer:
            ok = "ok" if layer["rows_match_primes"] else "MISMATCH"
            lines.append(
                f"    rows {layer.get('rows', '?'):,} vs sum of primes {layer['rows_expected']:,}: {ok}"
                if isinstance(layer.get("rows"), int)
                else f"    rows: ?, expected {layer['rows_expected']:,}"
            )
        if "bytes" in layer:
            lines.append("    bytes: " + ", ".join(f"{k} {_gib(v)}" for k, v in layer["bytes"].items()))
        st = layer.get("row_stats")
        if st:
            what = f"{st['rows_checked']:,} sampled of {st['of_rows']:,}" if st["sampled"] else f"all {st['of_rows']:,}"
            lines.append(
                f"    rows checked: {what}; all-zero {st['zero_rows']:,}, with NaN {st['nan_rows']:,}, "
                f"with inf {st['inf_rows']:,}"
            )
            if "scale_exponents" in st:
                hist = st["scale_exponents"]
                total = sum(hist.values()) or 1
                lines.append(
                    "    scale exponents (e: share): "
                    + ", ".join(f"{e}: {100 * c / total:.1f}%" for e, c in sorted(hist.items()))
                )
    for kind in ("warnings", "errors"):
        if r.get(kind):
            lines.append(f"{kind} ({len(r[kind])}):")
            lines += [f"  {kind[:-1]}: {p['message']}" for p in r[kind]]
    if r.get("ok", True):
        lines.append("ok: the loaders accept it")
    return "\n".join(lines)


def run(args) -> int:
    from pathlib import Path

    from condmem.cli.common import check_int
    from condmem.tables.inspect import inspect_tables
    from condmem.utils.atomic import sweep_stale

    check_int(args.sample, "--sample", why=" (rows sampled per layer; --full reads every row)")

    folder = Path(args.path) if Path(args.path).is_dir() else Path(args.path).parent
    for temp in sweep_stale(folder):  # what writers killed mid-write left beside it
        print(f"removed {temp}: the temp file of a killed writer", file=sys.stderr)

    if args.verify:
        import time

        from condmem.tables.table_file import EngramTableFile

        start = time.perf_counter()
        table = EngramTableFile(args.path, verify="none")
        checked = table.verify(progress=not args.no_progress)
        what = "4 KiB block matches its recorded CRC32C" if table.block_crcs else "chunk matches its recorded sha256"
        print(
            f"verified {table.path}: {checked / 2**30:,.2f} GiB of {len(table.data_tensors())} tensors, every "
            f"{what} ({time.perf_counter() - start:.1f} s)"
        )
        return 0

    report = inspect_tables(
        args.path, args.config, args.config_key, full=args.full, sample=args.sample, progress=not args.no_progress
    )
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if not report["ok"]:
        print(f"condmem inspect: {len(report['errors'])} error(s): the loaders refuse {args.path}", file=sys.stderr)
        return 1
    return 0
