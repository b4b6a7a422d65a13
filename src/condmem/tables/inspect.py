"""What a user needs to know about Engram tables before loading them: one report format.

`inspect_tables` reports on a condmem table file or a released DeepSeek-V4.1 checkpoint;
`condmem.artefacts.inspect_artefact` gives the same report for every other artefact condmem
writes (a training run or checkpoint, a Hugging Face model saved with Engram) with the helpers
here. The report is JSON-ready: what it is (``kind``, ``path``, and ``resolved_from`` when the path
given led to another, a run to its latest checkpoint), the tables' ``format`` (row format or
dtype), ``file_bytes``, the ``layout``, per layer its rows against the sum of its primes, bytes
and row statistics, the ``checks`` made, then ``errors``, ``warnings`` and ``ok``. In detail:

* the layout (layer ids, rows per layer, fingerprint) and whether every table's row
  count equals the sum of its layer's primes;
* the tensors found: naming dialect, and per layer each tensor's name, file, dtype and
  shape (the block shape of ``wkv``);
* bytes per tier: what host or HBM memory holds (interleaved fp8 rows), the bf16
  equivalent, and the bytes on disk;
* row statistics: a histogram of the e8m0 scale exponents, and the rows that are all
  zero, hold a NaN, or dequantize to an inf. A sample of rows by default (spread over
  the table, sorted so the reads stay sequential); every row with ``full=True``,
  streamed chunk by chunk with a progress bar. Rows are read as the tiers read them and
  checked as they are (`row_stats`): a table file's blocks against their CRC32C, a released
  checkpoint's scales (NaN / inf refused, naming the row); a released checkpoint's scales
  are all read and checked even without ``full`` (1/33 of the table's bytes).

It is also a validator: a released checkpoint is checked by the loaders' own routine
(`ReleasedCheckpoint.validate`: every tensor's presence, dtype and shape, the rows
against the primes, the wkv block divisibility, the config against the tensors), a table
file's rows against its layout's primes; a damaged block or a bad scale met while reading
is an error too. ``report["errors"]`` lists what the loaders would refuse (``condmem inspect``
then exits 1), ``report["warnings"]`` the rest, and ``report["ok"]`` is true when there is no
error.

No tensor is read beyond what the statistics and the scale checks need.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.fp8 import dequantize_fp8_e8m0, unpack_rows
from condmem.tables import integrity
from condmem.tables.released import CheckpointProblem
from condmem.tables.safetensors_io import TableFileError, read_header, release_pages
from condmem.tables.table_file import FORMAT_TAG, EngramTableFile, LayerRows
from condmem.utils.progress import Progress
from condmem.utils.renamed import renamed_keywords


def row_stats(
    rows: LayerRows | torch.Tensor,
    sample: int | None = 65536,
    chunk_rows: int = 1 << 16,
    progress: bool = False,
    name: str = "rows",
    seed: int = 0,
) -> dict[str, Any]:
    """Scale-exponent histogram and zero / NaN / inf row counts of one layer's rows.

    Rows with a `source` (a table file's, a released checkpoint's) are read as the tiers read
    them, and checked as they are: every row streamed through ``source.read`` (``sample=None``),
    or the sampled rows through the disk tier's reader. A damaged block (table file) or a NaN /
    inf scale (released checkpoint) raises a ``ValueError`` naming the file, like the loaders.
    Rows given as tensors alone are looked at as they are.

    Args:
        rows: the layer's rows (any format), or a float tensor [rows, head_dim] (a trained model's table).
        sample: rows to look at, spread uniformly at random (None: every row).
        chunk_rows: rows dequantized at a time.
    """
    if isinstance(rows, torch.Tensor):
        rows = LayerRows(str(rows.dtype).removeprefix("torch."), rows)
    scaled = rows.format in ("fp8", "fp8_interleaved")
    n = rows.num_rows
    if sample is not None and sample < n:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randperm(n, generator=gen)[:sample].sort().values
    else:
        ids = None
    total = n if ids is None else ids.numel()
    hist = torch.zeros(256, dtype=torch.int64)
    zero = nan = inf = 0
    source = rows.source
    store = None
    if source is not None and ids is not None:
        from condmem.tables.storage import place_layer

        store = place_layer(rows, "disk", progress=False, name=name)
    bar = Progress(total, f"inspect {name}", enabled=progress, unit="row", unit_scale=True)
    try:
        for start in range(0, total, chunk_rows):
            stop = min(total, start + chunk_rows)
            fmt = rows.format
            if source is not None:
                if ids is None:
                    raw = torch.empty((stop - start, source.row_bytes), dtype=torch.uint8)
                    try:
                        source.read(raw, start=start)
                    except integrity.IntegrityMismatch as exc:
                        raise TableFileError(f"{source.path}: {exc}") from None
                else:
                    raw = store.gather_raw(ids[start:stop])
                fmt = "bf16" if rows.format == "bf16" else "fp8_interleaved"
                w, s = (raw.view(torch.bfloat16) if fmt == "bf16" else raw), None
            elif ids is None:
                w = rows.weight[start:stop]
                s = None if rows.scales is None else rows.scales[start:stop]
            else:
                sel = ids[start:stop]
                w = rows.weight.index_select(0, sel)
                s = None if rows.scales is None else rows.scales.index_select(0, sel)
            if fmt == "bf16" or not scaled:
                values = w.float()
            else:
                q, e = unpack_rows(w.contiguous()) if fmt == "fp8_interleaved" else (w.contiguous(), s.contiguous())
                hist += torch.bincount(e.flatten().long(), minlength=256)
                values = dequantize_fp8_e8m0(q, e, torch.float32)
            zero += int((values == 0).all(dim=1).sum())
            nan += int(torch.isnan(values).any(dim=1).sum())
            inf += int(torch.isinf(values).any(dim=1).sum())
            if source is None and ids is None:
                for t in (w, s):
                    if t is not None:
                        release_pages(t)
            bar.update(stop - start)
    finally:
        bar.close()
        if store is not None:
            store.close()
    out: dict[str, Any] = {
        "rows_checked": total,
        "of_rows": n,
        "sampled": ids is not None,
        "zero_rows": zero,
        "nan_rows": nan,
        "inf_rows": inf,
    }
    if scaled:
        out["scale_exponents"] = {int(e): int(c) for e, c in enumerate(hist.tolist()) if c}
    return out


@renamed_keywords(rows="num_rows")
def tier_bytes(num_rows: int, head_dim: int) -> dict[str, int]:
    """What host or HBM memory holds per row format for a table of `num_rows` rows (fp8 only where
    head_dim is a multiple of its scale block)."""
    out = {}
    if head_dim % FP8_SCALE_BLOCK == 0:
        out["host_or_hbm_fp8_interleaved"] = num_rows * (head_dim + head_dim // FP8_SCALE_BLOCK)
    out["bf16"] = num_rows * 2 * head_dim
    return out


def _tensor_info(ckpt, name: str) -> dict[str, Any]:
    header = ckpt.headers.get(name)
    if header is None:
        return {"name": name, "missing": True}
    if name in header.other:
        return {"name": name, "file": header.path.name, "dtype": header.other[name], "shape": None}
    e = header.tensors[name]
    return {"name": name, "file": header.path.name, "dtype": str(e.dtype).replace("torch.", ""), "shape": list(e.shape)}


def layout_summary(layout: EngramLayout) -> dict[str, Any]:
    """What a report shows of a layout."""
    return {
        "layer_ids": layout.layer_ids,
        "num_embeddings": layout.num_embeddings,
        "compressed_vocab_size": layout.compressed_vocab_size,
        "fingerprint": layout.fingerprint,
    }


def finish_report(report: dict[str, Any], problems) -> dict[str, Any]:
    """`report` with its ``errors``, ``warnings`` (from `problems`, `CheckpointProblem`s) and ``ok``."""
    report["errors"] = [p.to_dict() for p in problems if p.severity == "error"]
    report["warnings"] = [p.to_dict() for p in problems if p.severity == "warning"]
    report["ok"] = not report["errors"]
    return report


def inspect_checkpoint(
    path, config=None, config_key: str | None = None, full: bool = False, sample: int = 65536, progress: bool = True
) -> dict[str, Any]:
    """The report (see the module docstring) for a released checkpoint."""
    from condmem.tables.released import ReleasedCheckpoint

    ckpt = ReleasedCheckpoint(path, config, config_key=config_key)
    report: dict[str, Any] = {
        "kind": "released checkpoint",
        "path": str(ckpt.path),
        "files": len(ckpt.files),
        "file_bytes": sum(f.stat().st_size for f in ckpt.files),
        "tensor_names": ckpt.names.dialect,
        "prefix": ckpt.names.prefix,
        "engram_layers_in_tensors": ckpt.layer_ids,
        "config": str(ckpt.config_path) if ckpt.config_path else None,
        "format": "fp8",
        "checks": [
            "every Engram tensor's presence, dtype and shape (the loaders' routine)",
            "the config against the tensors; each table's rows against the sum of its primes; wkv's block shape",
            "every table scale (NaN / inf refused)",
            "rows read: all-zero / NaN / inf counted",
        ],
    }
    problems = ckpt.validate()
    bad_tensors = {p.tensor for p in problems if p.severity == "error" and p.tensor}
    layout = None
    if ckpt.config is not None:
        cfg = ckpt.config
        report["backbone"] = {k: getattr(cfg, k) for k in ("hidden_size", "hc_mult", "rms_norm_eps")}
        try:
            layout = ckpt.layout()
            report["layout"] = layout_summary(layout)
        except ValueError:
            pass  # among the problems
    layers = []
    for lid in ckpt.config.layer_ids if ckpt.config is not None else ckpt.layer_ids:
        names = ckpt.tensor_names(lid)
        info: dict[str, Any] = {"layer_id": lid, "tensors": {role: _tensor_info(ckpt, n) for role, n in names.items()}}
        for t in info["tensors"].values():
            t["ok"] = t["name"] not in bad_tensors
        wkv, wkv_s = info["tensors"]["wkv"], info["tensors"]["wkv_scale"]
        if wkv.get("shape") and wkv_s.get("shape") and all(a % b == 0 for a, b in zip(wkv["shape"], wkv_s["shape"])):
            info["wkv_block"] = [a // b for a, b in zip(wkv["shape"], wkv_s["shape"])]
        embed = info["tensors"]["embed"]
        if embed.get("shape") and len(embed["shape"]) == 2:
            num_rows, d = embed["shape"]
            info["rows"] = num_rows
            info["bytes"] = tier_bytes(num_rows, d)
            info["bytes"]["disk_as_stored"] = sum(
                ckpt.entry(names[k]).nbytes for k in ("embed", "embed_scale") if not info["tensors"][k].get("missing")
            )
        if layout is not None:
            want = layout.layer(lid).num_embeddings
            info["rows_match_primes"] = info.get("rows") == want
            info["rows_expected"] = want
            if not bad_tensors & {names["embed"], names["embed_scale"]}:
                try:  # every scale read and checked as the loaders check it, then the rows' statistics
                    table = ckpt.table(lid, layout)
                    if not full:  # --full reads (and checks) them with the rows
                        table.source.check_scales()
                        info["scales_checked"] = table.num_rows
                    info["row_stats"] = row_stats(
                        table, None if full else sample, progress=progress, name=f"layer {lid}"
                    )
                except ValueError as exc:
                    problems.append(CheckpointProblem("error", str(exc), names["embed_scale"], lid))
        layers.append(info)
    report["layers"] = layers
    return finish_report(report, problems)


def inspect_table_file(path, full: bool = False, sample: int = 65536, progress: bool = True) -> dict[str, Any]:
    """The report for a condmem table file."""
    table = EngramTableFile(path)
    layout = table.layout()
    report: dict[str, Any] = {
        "kind": "condmem table file",
        "path": str(table.path),
        "format": table.format,
        "file_bytes": Path(path).stat().st_size,
        "tokenizer_fingerprint": table.tokenizer_fingerprint,
        "layout": layout_summary(layout),
        "layers": [],
        "checks": [
            "the header's digest and the block checksums' sha256 (at open)",
            "each table's rows against the sum of its primes",
            "every row read against its blocks' CRC32C (all blocks: --verify); all-zero / NaN / inf counted",
        ],
    }
    problems = []
    for lid, num_rows in zip(table.layer_ids, table.num_embeddings):
        want = layout.layer(lid).num_embeddings
        if num_rows != want:
            problems.append(
                CheckpointProblem(
                    "error",
                    f"layer {lid} of {table.path} has {num_rows:,} rows but its layout has {want:,} "
                    "(sum of its primes)",
                    None,
                    lid,
                )
            )
        info = {
            "layer_id": lid,
            "rows": num_rows,
            "rows_expected": want,
            "rows_match_primes": num_rows == want,
            "bytes": tier_bytes(num_rows, table.head_dim),
        }
        info["bytes"]["disk_as_stored"] = num_rows * table.layer(lid).row_bytes
        try:  # every row read is checked against its blocks' CRCs
            info["row_stats"] = row_stats(
                table.layer(lid), None if full else sample, progress=progress, name=f"layer {lid}"
            )
        except ValueError as exc:
            problems.append(CheckpointProblem("error", str(exc), None, lid))
        report["layers"].append(info)
    return finish_report(report, problems)


def inspect_tables(
    path: str | os.PathLike,
    config=None,
    config_key: str | None = None,
    full: bool = False,
    sample: int = 65536,
    progress: bool = True,
) -> dict[str, Any]:
    """Report on `path`: a condmem table file, or a released checkpoint (folder or file).

    Every other artefact condmem writes (a training run or checkpoint, a Hugging Face folder):
    `condmem.artefacts.inspect_artefact`, which calls this for these two.
    """
    path = Path(path)
    if path.is_file() and read_header(path).metadata.get("format") == FORMAT_TAG:
        return inspect_table_file(path, full, sample, progress)
    return inspect_checkpoint(path, config, config_key, full, sample, progress)
