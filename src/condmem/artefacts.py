"""The artefacts condmem reads, told apart (`find_artefact`), and the Engram tables of a trained model.

Five kinds of path hold Engram tables:

* a **table file** (`condmem.tables.table_file`): one safetensors file whose header says so;
* a **training run** (``condmem train --out RUN``): read as its latest checkpoint (``checkpoints/LATEST``);
* a **training checkpoint** (``RUN/checkpoints/step-N/``, or one of its files): ``state.json`` beside
  ``tables.safetensors`` (`condmem.train.checkpoint`);
* a **Hugging Face model with Engram** (``model.save_pretrained(folder)`` after `add_engram`, or one of
  its weight files): ``config.json`` with a ``condmem_engram`` section beside the weights; other files
  in the folder (a tokenizer, remote code) are left alone;
* a **released checkpoint**: any other safetensors file or folder of them (`condmem.tables.released`).

`inspect_artefact` reports on any of them in the one format of `condmem.tables.inspect`.
`open_trained_tables` maps the tables of a training checkpoint or a Hugging Face folder (nothing is
read) after the checks their loaders make (`load_checkpoint`, `load_pretrained`), and lists what is
wrong as `CheckpointProblem`s; `trained_tables` is the same for a caller that needs the tables
(``condmem convert``): it raises on the first error and refuses tables no hash layout serves (a
baseline without Engram, tables sharded over data-parallel ranks, a model trained with random
addresses).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from condmem.config import EngramConfig
from condmem.layout import EngramLayout
from condmem.tables.inspect import finish_report, inspect_tables, layout_summary, row_stats, tier_bytes
from condmem.tables.released import INDEX_FILE, CheckpointProblem, checkpoint_files
from condmem.tables.safetensors_io import Header, TableFileError, mmap_tensor, read_header
from condmem.tables.table_file import FORMAT_TAG

KINDS = {
    "table": "condmem table file",
    "checkpoint": "condmem training checkpoint",
    "hf": "Hugging Face model with Engram",
    "released": "released checkpoint",
}

LOOKED_FOR = (
    "checkpoints/LATEST (a training run), state.json (a training checkpoint), config.json with a "
    "'condmem_engram' section (a Hugging Face model with Engram), .safetensors files (a released "
    "checkpoint; a table file is a file)"
)

# An Engram tensor of a Hugging Face model: '<prefix>.<layer index>.engram.<parameter>'.
_HF_ENGRAM = re.compile(r"^(?P<prefix>.*\.)?(?P<layer>\d+)\.engram\.(?P<param>.+)$")


class ArtefactError(ValueError):
    """A path is none of the artefacts condmem reads, or holds tables that cannot be used as asked."""


@dataclass(frozen=True)
class Artefact:
    """What a path is: `kind` (a key of `KINDS`) and the `path` to read (a run's latest checkpoint, a
    weight file's folder), with the path `given` and how one led to the other (`via`)."""

    kind: str
    path: Path
    given: Path
    via: str | None = None

    @property
    def label(self) -> str:
        return KINDS[self.kind]


def hf_engram_section(folder: Path) -> dict | None:
    """The ``condmem_engram`` section of ``folder/config.json`` (what `add_engram` saves), or None."""
    from condmem.integrations.transformers.adapter import CONFIG_KEY

    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    section = data.get(CONFIG_KEY) if isinstance(data, dict) else None
    return section if isinstance(section, dict) else None


def find_artefact(path) -> Artefact:
    """What `path` is (see the module docstring); `ArtefactError` naming what was looked for when it is none."""
    from condmem.train.checkpoint import resolve_checkpoint

    given = Path(path).expanduser()
    if not given.exists():
        raise ArtefactError(f"{given} does not exist")
    if given.is_file():
        return _file_artefact(given)
    if (given / "state.json").is_file():
        return Artefact("checkpoint", given, given)
    if (given / "checkpoints").is_dir() or (given / "LATEST").is_file():
        return Artefact("checkpoint", resolve_checkpoint(given), given, "the run's latest checkpoint")
    if hf_engram_section(given) is not None:
        return Artefact("hf", given, given)
    if (given / INDEX_FILE).is_file() or any(given.glob("*.safetensors")):
        return Artefact("released", given, given)
    if not given.is_dir():
        raise ArtefactError(f"{given} is neither a file nor a folder")
    runs = sorted(p.name for p in given.iterdir() if p.is_dir() and (p / "checkpoints").is_dir())
    hint = f"; it holds the training runs {', '.join(runs)}: name one" if runs else ""
    raise ArtefactError(f"{given} is none of what condmem reads: no {LOOKED_FOR}{hint}")


def _file_artefact(path: Path) -> Artefact:
    from condmem.train.checkpoint import FORMAT, TABLES_FORMAT

    try:
        kind = read_header(path).metadata.get("format")
    except TableFileError as exc:
        raise ArtefactError(
            f"{exc}; the files condmem reads are safetensors files (a table file, a checkpoint's or a Hugging "
            "Face model's weights, a released checkpoint)"
        ) from None
    if kind == FORMAT_TAG:
        return Artefact("table", path, path)
    folder = path.parent
    if kind in (FORMAT, TABLES_FORMAT):
        if not (folder / "state.json").is_file():
            raise ArtefactError(
                f"{path} is a file of a condmem training checkpoint, but {folder} holds no state.json: "
                "name the whole checkpoint folder"
            )
        return Artefact("checkpoint", folder, path, "the checkpoint it belongs to")
    if hf_engram_section(folder) is not None:
        return Artefact("hf", folder, path, "the Hugging Face model it belongs to")
    return Artefact("released", path, path)


# ------------------------------------------------------------------------------ trained tables
@dataclass
class TrainedTables:
    """The Engram tables of a training checkpoint or a Hugging Face folder, memory-mapped."""

    artefact: Artefact
    layout: EngramLayout | None
    """None for a model without Engram."""
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    """{layer id: [rows, head_dim] float rows, mapped} of the layers found whole."""
    names: dict[int, str] = field(default_factory=dict)
    """{layer id: tensor name}."""
    files: dict[int, Path] = field(default_factory=dict)
    tokenizer_fingerprint: str | None = None
    """The compressed tokenizer map the tables were trained with."""
    problems: list[CheckpointProblem] = field(default_factory=list)
    refusal: str | None = None
    """Why the tables cannot be served through a table file (a warning for inspect, an error for convert)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What else a report shows (step, model, tokenizer)."""
    file_bytes: int = 0

    @property
    def errors(self) -> list[CheckpointProblem]:
        return [p for p in self.problems if p.severity == "error"]


def _check_layer_tensor(
    found: TrainedTables, lid: int, name: str, header: Header | None, shape: tuple[int, ...]
) -> None:
    """Map one layer's table when its tensor is there, 2-D float, in the layout's shape; a problem otherwise."""
    entry = None if header is None else header.tensors.get(name)
    if entry is None:
        problem = CheckpointProblem("error", f"{found.artefact.path} lacks Engram tensor {name}", name, lid)
        found.problems.append(problem)
    elif not entry.dtype.is_floating_point or entry.dtype.itemsize < 2:
        found.problems.append(
            CheckpointProblem("error", f"{name} in {header.path} is {entry.dtype}, not float rows", name, lid)
        )
    elif tuple(entry.shape) != tuple(shape):
        found.problems.append(
            CheckpointProblem(
                "error", f"{name}: saved shape {tuple(entry.shape)}, the layout needs {tuple(shape)}", name, lid
            )
        )
    else:
        found.tensors[lid] = mmap_tensor(header, name)
        found.names[lid] = name
        found.files[lid] = header.path


def open_trained_tables(artefact: Artefact, tokenizer=None, verify: bool = True) -> TrainedTables:
    """The tables of a training checkpoint or a Hugging Face folder, with what is wrong in ``problems``.

    A checkpoint is checked as `load_checkpoint` checks it (`check_checkpoint`: every file's hash with
    `verify`, the tokenizer and the layout against their fingerprints; the first failure is the one
    error), then its weights against the config; a Hugging Face folder as `load_pretrained` does (the
    layout rebuilt from its section against the saved fingerprint, every Engram tensor there in its
    shape) and its ``tokenizer.json``, when saved beside it, against the saved fingerprint.
    `tokenizer` (a path), when given, must be the one the tables were trained with.
    """
    if artefact.kind == "checkpoint":
        return _checkpoint_tables(artefact, tokenizer, verify)
    if artefact.kind == "hf":
        return _hf_tables(artefact, tokenizer)
    raise ArtefactError(f"{artefact.given} is a {artefact.label}, not a trained model")


def trained_tables(artefact: Artefact, tokenizer=None) -> TrainedTables:
    """`open_trained_tables`, raising (`ArtefactError`) on a refusal or else on the first error."""
    found = open_trained_tables(artefact, tokenizer)
    if found.refusal is not None:  # whatever else is wrong, these tables cannot be served
        raise ArtefactError(found.refusal)
    if found.errors:
        raise ArtefactError(found.errors[0].message)
    return found


def _checkpoint_tables(artefact: Artefact, tokenizer, verify: bool) -> TrainedTables:
    from condmem.models import DecoderLM
    from condmem.train.checkpoint import CheckpointError, check_checkpoint

    folder = artefact.path
    found = TrainedTables(artefact, None)
    try:
        parts = check_checkpoint(folder, tokenizer=tokenizer, verify=verify)
    except (CheckpointError, OSError) as exc:
        found.problems.append(CheckpointProblem("error", str(exc)))
        return found
    state, cfg = parts.state, parts.model_cfg
    found.file_bytes = sum(f["bytes"] for f in state["files"].values()) + (folder / "state.json").stat().st_size
    found.info = {
        "step": state["step"],
        "files": len(state["files"]) + 1,
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "dim", "n_layers", "n_heads")},
        "tokenizer": f"tokenizer.json, {parts.tokenizer.get_vocab_size()} ids"
        + ("" if parts.ctok is None else f", V' {parts.ctok.vocab_size}"),
    }
    model = DecoderLM(cfg, device="meta", table_device="meta")
    tables = {name: f"layer{name.split('.')[1]}.table" for name, _ in model.table_parameters()}
    _check_backbone(found, folder, model, set(tables))
    if cfg.engram is None:
        found.refusal = f"checkpoint {folder} is a model without Engram (a baseline): it has no tables"
        return found
    found.layout = EngramLayout(cfg.engram)
    found.tokenizer_fingerprint = parts.ctok.fingerprint
    if parts.table_meta.get("sharded") == "true":
        found.refusal = (
            f"checkpoint {folder} holds no tables: they are shards of the data-parallel ranks in "
            f"{folder.parent.parent / 'sharded_tables'} (load the run with the ranks that wrote them)"
        )
        return found
    if cfg.engram_addresses == "random":
        found.refusal = (
            f"checkpoint {folder} was trained with random table addresses (a control): its rows are not at "
            "the hashed n-gram addresses a table file is served by"
        )
    header = read_header(folder / "tables.safetensors")
    for layer in found.layout.layers:
        shape = (layer.num_embeddings, cfg.engram.head_dim)
        _check_layer_tensor(found, layer.layer_id, f"layer{layer.layer_id}.table", header, shape)
    return found


def _check_backbone(found: TrainedTables, folder: Path, model, tables: set[str]) -> None:
    """model.safetensors against the model the config builds (names and shapes): the loader's strict load."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tables}
    if model.cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    have = {k: tuple(e.shape) for k, e in read_header(folder / "model.safetensors").tensors.items()}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k} {have[k]} (config: {want[k]})" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong)):
        if names:
            found.problems.append(
                CheckpointProblem(
                    "error",
                    f"checkpoint {folder}: weights do not fit the config: {what} {names[:4]}"
                    f"{' ...' if len(names) > 4 else ''}",
                )
            )


def _hf_tables(artefact: Artefact, tokenizer) -> TrainedTables:
    from condmem.module import Engram

    folder = artefact.path
    found = TrainedTables(artefact, None)
    section = hf_engram_section(folder) or {}
    try:
        config = EngramConfig.from_dict(section["config"], dialect="native")
        layout = EngramLayout(config)
        saved_layout, saved_tokenizer = str(section["layout_fingerprint"]), str(section["tokenizer_fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        found.problems.append(
            CheckpointProblem("error", f"{folder / 'config.json'}: its 'condmem_engram' section is unusable ({exc})")
        )
        return found
    if layout.fingerprint != saved_layout:
        found.problems.append(
            CheckpointProblem(
                "error",
                f"the Engram layout rebuilt from {folder / 'config.json'} has fingerprint {layout.fingerprint[:12]}, "
                f"the saved one {saved_layout[:12]}",
            )
        )
        return found
    found.layout, found.tokenizer_fingerprint = layout, saved_tokenizer
    found.info["tokenizer"] = _hf_tokenizer_check(found, folder, tokenizer, saved_tokenizer)
    try:
        files, _ = checkpoint_files(folder)
        headers = [read_header(f) for f in files]
    except ValueError as exc:
        found.problems.append(CheckpointProblem("error", str(exc)))
        return found
    found.file_bytes = sum(f.stat().st_size for f in files)
    found.info["files"] = len(files)
    by_name = {name: h for h in headers for name in h.tensors}
    prefixes: dict[int, str] = {}
    for name in by_name:
        m = _HF_ENGRAM.match(name)
        if m:
            prefixes.setdefault(int(m["layer"]), m["prefix"] or "")
    extra = sorted(set(prefixes) - set(layout.layer_ids))
    if extra:
        found.problems.append(
            CheckpointProblem("warning", f"Engram tensors of layers {extra}, not in the config's layers, are unused")
        )
    for layer in layout.layers:
        lid = layer.layer_id
        base = f"{prefixes.get(lid, '')}{lid}.engram."
        module = Engram(config, layer.num_embeddings, layer_id=lid, device="meta")
        for param, p in module.named_parameters():
            name = base + param
            if param == "table.weight":
                _check_layer_tensor(found, lid, name, by_name.get(name), tuple(p.shape))
            elif name not in by_name:
                found.problems.append(CheckpointProblem("error", f"{folder} lacks Engram tensor {name}", name, lid))
            elif tuple(by_name[name].tensors[name].shape) != tuple(p.shape):
                got, need = tuple(by_name[name].tensors[name].shape), tuple(p.shape)
                message = f"{name}: saved shape {got}, the layout needs {need}"
                found.problems.append(CheckpointProblem("error", message, name, lid))
    return found


def _hf_tokenizer_check(found: TrainedTables, folder: Path, tokenizer, saved: str) -> str:
    """The tokenizer given (or ``tokenizer.json`` beside the weights) against the saved map; what it checked."""
    from condmem.tokenizer import CompressedTokenizer

    source = tokenizer if tokenizer is not None else folder / "tokenizer.json"
    if tokenizer is None and not source.is_file():
        found.problems.append(
            CheckpointProblem(
                "warning",
                f"no tokenizer.json in {folder}: the model's tokenizer must map to the saved compressed map "
                f"{saved[:16]}",
            )
        )
        return "none saved"
    ctok = CompressedTokenizer.from_any(str(source))
    if ctok.fingerprint != saved:
        found.problems.append(
            CheckpointProblem(
                "error",
                f"the tokenizer {source} maps to the compressed map {ctok.fingerprint[:12]} (V'={ctok.vocab_size}), "
                f"but {folder} was saved with {saved[:12]}: every row id would differ",
            )
        )
    return f"{source}, V' {ctok.vocab_size}"


# ------------------------------------------------------------------------------ inspection
def inspect_trained(
    artefact, full: bool = False, sample: int = 65536, progress: bool = True, tokenizer=None
) -> dict[str, Any]:
    """The report for a training checkpoint or a Hugging Face model saved with Engram (`find_artefact`)."""
    found = open_trained_tables(artefact, tokenizer)
    report: dict[str, Any] = {"kind": artefact.label, "path": str(artefact.path), **found.info}
    report["file_bytes"] = found.file_bytes
    if artefact.kind == "checkpoint":
        report["checks"] = [
            "state.json's own sha256; every file's size and sha256 against state.json",
            "tokenizer.json's compressed map and the config's layout against the tables' fingerprints",
            "the weights' names and shapes against the config",
        ]
    else:
        report["checks"] = [
            "the layout rebuilt from config.json's 'condmem_engram' section against its saved fingerprint",
            "every Engram tensor present, in the shape the layout gives",
            "tokenizer.json (when saved beside the weights) against the saved compressed map",
        ]
    report["checks"].append("each table's rows against the sum of its primes; rows read: all-zero / NaN / inf counted")
    problems = list(found.problems)
    if found.refusal is not None:
        problems.append(CheckpointProblem("warning", f"{found.refusal}; condmem convert refuses it"))
    layout = found.layout
    report["layers"] = []
    if layout is None:
        return finish_report(report, problems)
    report["layout"] = layout_summary(layout)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in found.tensors.values()})
    report["format"] = ", ".join(dtypes) or None
    for layer in layout.layers:
        lid = layer.layer_id
        info: dict[str, Any] = {"layer_id": lid, "rows_expected": layer.num_embeddings}
        table = found.tensors.get(lid)
        if table is not None:
            info.update(
                tensor=found.names[lid],
                file=found.files[lid].name,
                dtype=str(table.dtype).removeprefix("torch."),
                shape=list(table.shape),
                rows=table.shape[0],
                rows_match_primes=table.shape[0] == layer.num_embeddings,
                bytes=tier_bytes(table.shape[0], table.shape[1]),
            )
            info["bytes"]["disk_as_stored"] = table.numel() * table.element_size()
            info["row_stats"] = row_stats(table, None if full else sample, progress=progress, name=f"layer {lid}")
        report["layers"].append(info)
    return finish_report(report, problems)


def inspect_artefact(
    path: str | os.PathLike,
    config=None,
    config_key: str | None = None,
    full: bool = False,
    sample: int = 65536,
    progress: bool = True,
) -> dict[str, Any]:
    """The report of `condmem.tables.inspect` on any artefact `find_artefact` tells apart.

    `config` / `config_key` name the Engram config of a released checkpoint (the other kinds record
    theirs: refused for them with `ArtefactError`). ``resolved_from`` says how the path given led to
    the one read (a run to its latest checkpoint, a weight file to its folder).
    """
    artefact = find_artefact(path)
    if artefact.kind != "released" and (config is not None or config_key is not None):
        raise ArtefactError(
            f"--config / --config-key name a released checkpoint's config; {artefact.given} is a {artefact.label}, "
            "which records its own"
        )
    if artefact.kind in ("table", "released"):
        report = inspect_tables(artefact.path, config, config_key, full, sample, progress)
    else:
        report = inspect_trained(artefact, full, sample, progress)
    if artefact.via is not None:
        report["resolved_from"] = f"{artefact.given} ({artefact.via})"
    return report
