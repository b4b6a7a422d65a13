"""``condmem inspect``: what an artefact holding Engram tables holds, before committing memory to it.

Any artefact condmem writes or reads (`condmem.artefacts`), one summary format. Also the
validator: exit status 1 when the loaders would refuse it (every error listed, each naming the
tensor or file, what was found and what was expected), or when a row it read was damaged (a block
against its CRC32C; a NaN / inf scale), 0 otherwise (warnings included).
"""

from __future__ import annotations

import argparse
import json
import sys

from condmem.cli import CliError


EPILOG = """examples:
  condmem train --preset tiny --out tiny-run --steps 20      a tiny Engram model (a minute on a CPU)
  condmem inspect tiny-run                                   its latest checkpoint
  condmem convert tiny-run tiny-tables.safetensors --to bf16
  condmem inspect tiny-tables.safetensors --full --json
  condmem inspect tiny-tables.safetensors --verify
  condmem inspect ./DeepSeek-V4.1-Flash                      a released checkpoint (its config.json beside it)"""


def register(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="what an artefact holding Engram tables is, its layers, rows, bytes and checks",
        description="Report on anything that holds Engram tables: a training run (its latest checkpoint), a "
        "training checkpoint folder or one of its files, a condmem table file, a Hugging Face model saved with "
        "Engram (its folder or a weight file), or a released DeepSeek-V4.1 checkpoint (folder or safetensors file). "
        "One summary for all: what it is, the tables' format, the layout and fingerprint, per layer its rows "
        "against the sum of its primes, bytes per tier and row statistics (all-zero / NaN / inf rows and, for fp8, "
        "a histogram of the scale exponents, over a sample of rows or every row with --full), and the checks made. "
        "It checks what the loaders check (a checkpoint: every file's sha256, the tokenizer and layout "
        "fingerprints, the weights against the config; a Hugging Face folder: the layout against the saved "
        "fingerprint, every Engram tensor's shape, a tokenizer.json saved beside it; a released checkpoint: every "
        "tensor's presence, dtype and shape, wkv's block divisibility, the config against the tensors, every table "
        "scale) and every row it reads (a table file's block CRCs), and exits 1 when there is an error, 0 otherwise "
        "(warnings included).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "path",
        help="training run or checkpoint folder, table file, Hugging Face folder, released checkpoint (folder or file)",
    )
    p.add_argument("--config", help="a released checkpoint's Engram config (default: its folder's config.json)")
    p.add_argument(
        "--config-key",
        help="a released checkpoint's JSON section holding the Engram keys (default: top level or text_config)",
    )
    p.add_argument(
        "--full", action="store_true", help="statistics over every row, each checked (streams the whole table)"
    )
    p.add_argument(
        "--sample", type=int, default=65536, help="rows sampled per layer without --full (>= 1; default 65536)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every checksummed byte: a table file's blocks against their CRC32C, a training checkpoint's "
        "files against their sha256 (exit status 1 naming the first damaged one)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def _kind_lines(r: dict) -> list[str]:
    """What only one kind of artefact reports."""
    if r["kind"] == "condmem table file":
        return [f"  tokenizer fingerprint {(r['tokenizer_fingerprint'] or 'none')[:16]}"]
    if r["kind"] == "released checkpoint":
        return [
            f"  tensor names: {r['tensor_names']}{' (prefix ' + repr(r['prefix']) + ')' if r['prefix'] else ''}; "
            f"Engram layers in tensors: {r['engram_layers_in_tensors']}",
            f"  config: {r['config'] or 'none found (pass --config)'}"
            + (f"; backbone {r['backbone']}" if r.get("backbone") else ""),
        ]
    lines = []
    if "step" in r:
        lines.append(f"  step {r['step']}; model {r['model']}")
    if r.get("tokenizer"):
        lines.append(f"  tokenizer: {r['tokenizer']}")
    return lines


def _layer_lines(layer: dict) -> list[str]:
    lines = [f"  layer {layer['layer_id']}:"]
    for role, t in layer.get("tensors", {}).items():
        if t.get("missing"):
            lines.append(f"    {role:<12} MISSING  {t['name']}")
        else:
            bad = "" if t.get("ok", True) else "  <- ERROR"
            lines.append(f"    {role:<12} {t['dtype']:<16} {t['shape']!s:<16} {t['name']}  ({t['file']}){bad}")
    if "tensor" in layer:
        lines.append(
            f"    table        {layer['dtype']:<16} {layer['shape']!s:<16} {layer['tensor']}  ({layer['file']})"
        )
    if "wkv_block" in layer:
        lines.append(f"    wkv block shape {layer['wkv_block']}")
    if "rows_expected" in layer:
        ok = "ok" if layer.get("rows_match_primes") else "MISMATCH"
        lines.append(
            f"    rows {layer['rows']:,} vs sum of primes {layer['rows_expected']:,}: {ok}"
            if isinstance(layer.get("rows"), int)
            else f"    rows: ?, expected {layer['rows_expected']:,}"
        )
    if "bytes" in layer:
        lines.append("    bytes: " + ", ".join(f"{k} {_size(v)}" for k, v in layer["bytes"].items()))
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
    return lines


def format_report(r: dict) -> str:
    """The report as text lines: the same summary for every kind of artefact, then what is its own."""
    lines = [f"{r['kind']}: {r['path']}"]
    if r.get("resolved_from"):
        lines.append(f"  from {r['resolved_from']}")
    rows = [layer["rows"] for layer in r["layers"] if isinstance(layer.get("rows"), int)]
    files = f"{r['files']} file(s), " if r.get("files") else ""
    lines.append(
        f"  tables: {r.get('format') or 'none'}, {len(r['layers'])} Engram layer(s), {sum(rows):,} rows; "
        f"{files}{_size(r['file_bytes'])} on disk"
    )
    lines += _kind_lines(r)
    if r.get("layout"):
        lay = r["layout"]
        lines.append(
            f"  layout: layers {lay['layer_ids']}, rows {', '.join(f'{n:,}' for n in lay['num_embeddings'])}, "
            f"V' {lay['compressed_vocab_size']:,}, fingerprint {lay['fingerprint'][:16]}"
        )
    for layer in r["layers"]:
        lines += _layer_lines(layer)
    if r.get("checks"):
        lines.append("  checks: " + "; ".join(r["checks"]))
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
    from condmem.artefacts import inspect_artefact
    from condmem.utils.atomic import sweep_stale

    check_int(args.sample, "--sample", why=" (rows sampled per layer; --full reads every row)")

    folder = Path(args.path) if Path(args.path).is_dir() else Path(args.path).parent
    for temp in sweep_stale(folder):  # what writers killed mid-write left beside it
        print(f"removed {temp}: the temp file of a killed writer", file=sys.stderr)

    if args.verify:
        return _verify(args)

    report = inspect_artefact(
        args.path, args.config, args.config_key, full=args.full, sample=args.sample, progress=not args.no_progress
    )
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if not report["ok"]:
        print(f"condmem inspect: {len(report['errors'])} error(s): the loaders refuse {args.path}", file=sys.stderr)
        return 1
    return 0


def _verify(args) -> int:
    """``--verify``: every checksummed byte of a table file or a training checkpoint read and compared."""
    import time

    from condmem.artefacts import find_artefact
    from condmem.tables.table_file import EngramTableFile

    start = time.perf_counter()
    artefact = find_artefact(args.path)
    if artefact.kind == "checkpoint":
        from condmem.train.checkpoint import check_checkpoint

        parts = check_checkpoint(artefact.path, verify=True)
        size = sum(f["bytes"] for f in parts.state["files"].values())
        print(
            f"verified {artefact.path}: {_size(size)} in {len(parts.state['files'])} files, every file matches the "
            f"sha256 state.json records ({time.perf_counter() - start:.1f} s)"
        )
        return 0
    if artefact.kind != "table":
        raise CliError(
            f"--verify reads recorded checksums: {args.path} is a {artefact.label}, which records none "
            "(without --verify, inspect checks what its loaders check; --full reads every row)"
        )
    table = EngramTableFile(artefact.path, verify="none")
    checked = table.verify(progress=not args.no_progress)
    what = "4 KiB block matches its recorded CRC32C" if table.block_crcs else "chunk matches its recorded sha256"
    print(
        f"verified {table.path}: {checked / 2**30:,.2f} GiB of {len(table.data_tensors())} tensors, every "
        f"{what} ({time.perf_counter() - start:.1f} s)"
    )
    return 0
