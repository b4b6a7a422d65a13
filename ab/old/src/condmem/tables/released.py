"""Tables as DeepSeek-V4.1 checkpoints store them: fp8 e4m3 rows + ue8m0 per-32 scales.

A released checkpoint is a set of safetensors shards (usually with a
``model.safetensors.index.json``) in which each Engram layer's table is two tensors,
named by default ``<prefix>layers.<id>.engram.embed.weight`` (fp8 [rows, head_dim]) and
``<prefix>layers.<id>.engram.embed.weight_scale_inv`` (uint8 or float8_e8m0fnu
[rows, head_dim/32]). Nothing in them records the hash layout, so the loader checks the
geometry instead: each layer's row count must equal the sum of its primes, which pins
layer ids, orders, heads and table sizes.

`load_released_tables` memory-maps the tensors where they lie (no copy); use
`condmem convert` to turn them into a condmem table file (e.g. interleaved rows).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from condmem.layout import FP8_SCALE_BLOCK, EngramLayout
from condmem.tables.safetensors_io import Header, TableFileError, mmap_tensor, read_header
from condmem.tables.table_file import LayerRows, TableMismatchError

DEFAULT_WEIGHT_SUFFIX = "engram.embed.weight"
DEFAULT_SCALE_SUFFIX = "engram.embed.weight_scale_inv"


def _shards(source: str | os.PathLike) -> list[Path]:
    source = Path(source)
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise TableFileError(f"checkpoint not found: {source}")
    index = source / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise TableFileError(f"{index} is not a safetensors index ({exc})") from None
        files = sorted({source / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise TableFileError(f"{index} names shards that are missing: {missing[:5]}")
        return files
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise TableFileError(f"no .safetensors files in {source}")
    return files


def load_released_tables(
    source: str | os.PathLike,
    layout: EngramLayout,
    weight_name: str | None = None,
    scale_name: str | None = None,
) -> dict[int, LayerRows]:
    """Memory-map every Engram layer's fp8 rows and scales from a released checkpoint.

    Args:
        source: a checkpoint directory (index file or shards) or one safetensors file.
        layout: the layout the tables must match (row count per layer).
        weight_name, scale_name: name templates with ``{layer_id}``; by default any tensor
            named ``...layers.<id>.engram.embed.weight`` / ``..._scale_inv``.

    Returns:
        {layer_id: LayerRows("fp8", weight, scales)}, tensors mapped from the shards.

    Raises:
        TableFileError: a table or its scales missing, or of the wrong dtype/shape.
        TableMismatchError: row counts that disagree with the layout.
    """
    headers: dict[str, Header] = {}
    for shard in _shards(source):
        header = read_header(shard)
        for name in header.tensors:
            headers[name] = header

    def find(template: str | None, suffix: str, layer_id: int) -> str:
        if template is not None:
            name = template.format(layer_id=layer_id)
            if name not in headers:
                raise TableFileError(f"tensor {name!r} not found in {source}")
            return name
        pattern = re.compile(rf"(?:^|\.)layers\.{layer_id}\.{re.escape(suffix)}$")
        hits = [n for n in headers if pattern.search(n)]
        if len(hits) != 1:
            raise TableFileError(
                f"{'no' if not hits else 'several'} tensor(s) named '...layers.{layer_id}.{suffix}' in {source}"
                f"{': ' + ', '.join(hits) if hits else ''}; pass the name template explicitly"
            )
        return hits[0]

    d = layout.config.head_dim
    tables = {}
    for layer in layout.layers:
        w_name = find(weight_name, DEFAULT_WEIGHT_SUFFIX, layer.layer_id)
        s_name = find(scale_name, DEFAULT_SCALE_SUFFIX, layer.layer_id)
        w_entry, s_entry = headers[w_name].tensors[w_name], headers[s_name].tensors[s_name]
        if w_entry.shape[0] != layer.num_embeddings:
            raise TableMismatchError(
                f"{w_name} has {w_entry.shape[0]:,} rows but layer {layer.layer_id} of this layout has "
                f"{layer.num_embeddings:,} (sum of its primes): the config's geometry does not match the checkpoint"
            )
        if w_entry.shape != (layer.num_embeddings, d):
            raise TableMismatchError(f"{w_name} is {w_entry.shape}, expected rows x head_dim {d}")
        if s_entry.shape != (layer.num_embeddings, d // FP8_SCALE_BLOCK):
            raise TableFileError(f"{s_name} is {s_entry.shape}, expected [rows, {d // FP8_SCALE_BLOCK}] (one scale per 32)")
        weight = mmap_tensor(headers[w_name], w_name)
        scales = mmap_tensor(headers[s_name], s_name)
        if weight.dtype != torch.float8_e4m3fn:
            raise TableFileError(f"{w_name} is {weight.dtype}, expected float8_e4m3fn rows")
        if scales.dtype != torch.uint8:
            if scales.element_size() != 1:
                raise TableFileError(f"{s_name} is {scales.dtype}, expected uint8 / float8_e8m0fnu exponents")
            scales = scales.view(torch.uint8)  # float8_e8m0fnu: the same bytes
        tables[layer.layer_id] = LayerRows("fp8", weight, scales)
    return tables
