"""Checkpoints: safetensors weights and tables, resolved configs, tokenizer, fingerprints.

A run directory holds ``checkpoints/step-XXXXXXX/`` folders and a ``checkpoints/LATEST``
pointer. One checkpoint folder::

    model.safetensors       backbone weights (everything but the Engram tables)
    tables.safetensors      one tensor per Engram layer, ``layer<id>.table``; metadata: layout
                            and tokenizer fingerprints, V', rows per layer
    optimizer.safetensors   AdamW moments and SparseAdam slots/moments
    config.json             resolved model + train configs (+ the Engram config in V4.1 keys)
    tokenizer.json          the tokenizer the model was trained with
    state.json              step, loss history, fingerprints, the sha256 of every file above,
                            and its own sha256 (``state_sha256``, over the rest of it)

Every file is written atomically into a temporary folder (``.step-XXXXXXX.<pid>.*``),
which is renamed into place when complete; ``state.json`` is written last and ``LATEST``
moves only after the rename, so a crash leaves the previous checkpoint current. A
same-step folder is moved aside (``.step-XXXXXXX.replaced``) before the new one takes its
name and removed only after ``LATEST`` moved; the target of ``LATEST`` is never deleted.
The next save sweeps what a killed save left (temp folders of dead pids; an aside folder
is renamed back when its step has no folder). ``LATEST`` that points at nothing (or is missing)
falls back, with a warning, to the newest complete checkpoint; a damaged target is an error.

A save needs room for a whole new checkpoint beside the kept ones: `checkpoint_bytes` bounds
its size (the sparse optimizer's state by the rows the tokens until the save can touch) and
`ensure_room` checks the run's file system before training and before each save. A save that
fails anyway (a full disk, an I/O error) removes its partial folder and raises
`CheckpointSaveError`: one line naming the folder, the reason, the checkpoint kept and the
steps lost.

Loading verifies state.json's own hash and every file's hash (`CorruptCheckpointError`
names the damaged one) and refuses a tokenizer that does not match the tables
(`CheckpointMismatchError`): with another compression map every row id would differ,
silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from condmem.layout import EngramLayout, LayoutError
from condmem.models import DecoderLM, ModelConfig
from condmem.utils.atomic import (
    atomic_path,
    atomic_write_text,
    check_inside,
    fsync_dir,
    make_temp_dir,
    sweep_stale,
)
from condmem.utils.digest import sha256_file
from condmem.utils.preflight import OutputPathError, check_free_space

logger = logging.getLogger("condmem.train.checkpoint")

FORMAT = "condmem-checkpoint"
FORMAT_VERSION = 2
ASIDE = ".replaced"
TABLES_FORMAT = "condmem-engram-tables-v1"
FILES = ("model.safetensors", "tables.safetensors", "optimizer.safetensors", "config.json", "tokenizer.json")


class CheckpointError(ValueError):
    """A checkpoint cannot be used."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or altered."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's parts (tables, tokenizer, config) do not belong together."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (no room, an I/O error); the previous one is kept."""


def _state_digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_state(folder: Path) -> dict:
    """A checkpoint's state.json, checked against its own hash; `CorruptCheckpointError` otherwise."""
    path = folder / "state.json"
    try:
        text = path.read_text()
        state = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path} is unreadable ({exc}): the checkpoint is damaged") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("files"), dict):
        raise CorruptCheckpointError(f"{path} is not a condmem checkpoint state")
    # The hash covers the parsed values; the bytes must also be the ones `_write_state` writes, since a
    # changed digit past a float's precision parses to the same value (0.30000000000000004 and ...05).
    if text.removesuffix("\n") != _state_text(state).removesuffix("\n"):
        raise CorruptCheckpointError(f"{path} is not byte for byte as written: it was altered or corrupted")
    if state.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path}: checkpoint format version {state.get('version')!r}, this condmem reads "
            f"{FORMAT_VERSION} (whose state.json carries its own hash)"
        )
    if state.get("state_sha256") != _state_digest(state):
        raise CorruptCheckpointError(f"{path} does not match its recorded sha256: it was altered or corrupted")
    missing = sorted(set(FILES) - set(state["files"]))
    if missing:
        raise CorruptCheckpointError(f"{path} lists no hash for {missing}: the checkpoint is damaged")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CorruptCheckpointError(f"{path}: step must be a non-negative integer, got {step!r}")
    for name in ("history", "evals"):
        if not isinstance(state.get(name, []), list):
            raise CorruptCheckpointError(f"{path}: {name} must be a list, got {type(state[name]).__name__}")
    return state


def _step_of(folder: Path) -> int | None:
    name = folder.name.removeprefix(".").removesuffix(ASIDE)
    try:
        return int(name.removeprefix("step-")) if name.startswith("step-") else None
    except ValueError:
        return None


def _complete(folder: Path) -> bool:
    try:
        read_state(folder)
    except CorruptCheckpointError:
        return False
    return True


def newest_complete(root: Path) -> Path | None:
    """The complete checkpoint (state.json intact) of the highest step under `root`, aside folders included."""
    candidates = []
    for p in root.iterdir() if root.is_dir() else ():
        step = _step_of(p)
        if step is not None and p.is_dir() and (p.name.startswith("step-") or p.name.endswith(ASIDE)):
            candidates.append((step, not p.name.startswith("."), p))
    for _, _, p in sorted(candidates, reverse=True):
        if _complete(p):
            return p
    return None


def _repair(root: Path) -> None:
    """Undo what a killed save left: temp folders of dead pids go; an aside folder whose step lost
    its folder returns."""
    for aside in [p for p in root.iterdir() if p.name.startswith(".step-") and p.name.endswith(ASIDE)]:
        final = root / aside.name[1 : -len(ASIDE)]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
            logger.warning("checkpoint %s restored from %s (a save was interrupted)", final, aside.name)
    prefixes = {"." + p.name.split(".")[1] + "." for p in root.iterdir() if p.name.startswith(".step-") and p.is_dir()}
    for prefix in prefixes:
        sweep_stale(root, prefix)


def _table_names(model: DecoderLM) -> dict[str, str]:
    """Parameter name -> tensor name in tables.safetensors."""
    out = {}
    for name, _ in model.table_parameters():
        layer_id = int(name.split(".")[1])  # blocks.<id>.engram.table.weight
        out[name] = f"layer{layer_id}.table"
    return out


def _fingerprints(model: DecoderLM, tokenizer: Tokenizer, ctok) -> dict[str, Any]:
    fp = {"tokenizer_json_sha256": hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()}
    if model.layout is not None:
        fp.update(
            layout=model.layout.fingerprint, tokenizer_map=ctok.fingerprint, compressed_vocab_size=ctok.vocab_size
        )
    return fp


CHECKPOINT_SLACK_BYTES = 256 << 10
"""Added to a checkpoint's tensor bytes: config.json, safetensors headers, file-system blocks."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # meta tensors too: shape and dtype are known


def checkpoint_bytes(
    model: DecoderLM,
    *,
    adamw,
    sparse=None,
    host_tables=None,
    tables_sharded: bool = False,
    tokenizer: Tokenizer | None = None,
    trainer_state: dict | None = None,
    tokens: int = 0,
) -> int:
    """An upper bound of the bytes `save_checkpoint` writes for this model (one checkpoint folder).

    Args:
        adamw, sparse, host_tables, tables_sharded: as given to `save_checkpoint`.
        tokenizer, trainer_state: counted when given (the history in state.json grows with the steps).
        tokens: tokens trained before the save: AdamW state not created yet counts at its full
            size, and each token can add ``n_cols`` rows of sparse-Adam state per table.
    """
    tables = _table_names(model)
    state = model.state_dict()
    total = sum(
        _nbytes(v)
        for k, v in state.items()
        if k not in tables and not (k == "lm_head.weight" and model.cfg.tie_embeddings)
    )
    if not tables_sharded:
        if host_tables is not None:
            total += sum(_nbytes(t) for t in host_tables.table_tensors().values())
        total += sum(_nbytes(state[k]) for k in tables if k in state and state[k].device.type != "meta")
    for group in adamw.param_groups:
        for p in group["params"]:
            have = adamw.state.get(p)
            total += sum(_nbytes(v) for v in have.values() if torch.is_tensor(v)) if have else 2 * _nbytes(p) + 4
    if sparse is not None and not tables_sharded and model.layout is not None:
        # SparseAdam or HostTables: slot_of_row (int32) per row; exp_avg, exp_avg_sq, row_step (fp32)
        # per row with state.
        layout = model.layout
        num_rows = sum(layout.num_embeddings)
        slots = min(num_rows, sparse.state_rows() + tokens * layout.n_cols * layout.n_layers)
        total += num_rows * 4 + slots * (2 * layout.config.head_dim + 1) * 4
    if tokenizer is not None:
        total += len(tokenizer.to_str().encode("utf-8"))
    if trainer_state is not None:
        total += 2 * len(json.dumps(trainer_state))
    return total + 256 * len(state) + CHECKPOINT_SLACK_BYTES


def _kept(run_dir: Path, step: int) -> str:
    """What a failed save of `step` leaves: the checkpoint kept and the steps lost."""
    try:
        prev = resolve_checkpoint(run_dir)
        prev_step = int(read_state(prev)["step"])
    except (OSError, CheckpointError, KeyError, TypeError, ValueError):
        return f"no earlier checkpoint is there: steps 1..{step} are lost"
    if prev_step >= step:
        return f"the checkpoint of step {prev_step}, {prev}, is kept: no step is lost"
    return (
        f"the previous checkpoint, {prev} (step {prev_step}), is kept: steps {prev_step + 1}..{step} are lost "
        "(resume from it with --resume)"
    )


def ensure_room(run_dir: str | os.PathLike, need_bytes: int, step: int | None = None) -> None:
    """Check that ``run_dir/checkpoints`` has `need_bytes` free for the next checkpoint.

    Raises:
        OutputPathError: before training (`step` None): one line naming the folder and the bytes.
        CheckpointSaveError: before the save of `step`: the same line, with the checkpoint kept and the steps lost.
    """
    root = Path(run_dir) / "checkpoints"
    what = "the next checkpoint" if step is None else f"the checkpoint of step {step}"
    try:
        check_free_space(root, need_bytes, what)
    except OutputPathError as exc:
        if step is None:
            raise
        raise CheckpointSaveError(f"{exc}; {_kept(Path(run_dir), step)}") from None


def save_checkpoint(
    run_dir: str | os.PathLike,
    *,
    model: DecoderLM,
    adamw,
    sparse,
    train_cfg,
    trainer_state: dict,
    tokenizer: Tokenizer,
    ctok=None,
    data: dict | None = None,
    keep: int = 2,
    host_tables=None,
    tables_sharded: bool = False,
) -> Path:
    """Write a checkpoint of the current step under ``run_dir/checkpoints`` and point LATEST at it.

    `host_tables` (a `condmem.train.host_table.HostTables`) supplies the tables that live in
    host memory; they are written as the model's own would be, so either kind resumes from it.
    `tables_sharded`: the tables are shards written by every rank
    (`condmem.train.data_parallel`); ``tables.safetensors`` then holds none and says so."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    check_inside(root, run_dir)  # a link planted at checkpoints/ must not take the checkpoints out of the run
    root.mkdir(parents=True, exist_ok=True)
    _repair(root)
    step = int(trainer_state["step"])
    name = f"step-{step:07d}"
    final = root / name
    aside = root / f".{name}{ASIDE}"
    tmp = make_temp_dir(root, name)
    try:
        fingerprints = _fingerprints(model, tokenizer, ctok)
        _write_tensor_files(tmp, model, adamw, sparse, fingerprints, host_tables, tables_sharded)
        _write_text_files(tmp, model, train_cfg, tokenizer, data)
        _write_state(tmp, fingerprints, trainer_state)
        if final.exists():
            os.replace(final, aside)  # moved aside, not deleted: a kill from here on loses nothing
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not final.exists():
            os.replace(aside, final)
        if isinstance(exc, (OSError, SafetensorError)):
            raise CheckpointSaveError(
                f"the checkpoint of step {step} could not be written in {root} ({_reason(exc)}); {_kept(run_dir, step)}"
            ) from exc
        raise
    _point_latest(root, final, step, run_dir)
    shutil.rmtree(aside, ignore_errors=True)
    _remove_old(root, final, keep)
    logger.info("checkpoint written: %s", final)
    return final


def _write_tensor_files(
    tmp: Path, model: DecoderLM, adamw, sparse, fingerprints: dict, host_tables, tables_sharded: bool
) -> None:
    """model.safetensors (the backbone), tables.safetensors and optimizer.safetensors into `tmp`."""
    from condmem.train.optim import export_adamw_state

    tables = _table_names(model)
    names = {p: n for n, p in model.named_parameters()}
    state = model.state_dict()
    backbone = {k: v.detach().contiguous() for k, v in state.items() if k not in tables}
    if tables_sharded:
        sparse = None  # each rank writes its shards' Adam state with its shards
    if model.cfg.tie_embeddings:
        backbone.pop("lm_head.weight", None)  # the same tensor as embed.weight
    with atomic_path(tmp / "model.safetensors") as p:
        save_file(backbone, str(p), metadata={"format": FORMAT})
    table_meta = {"format": TABLES_FORMAT, **{k: str(v) for k, v in fingerprints.items()}}
    if model.layout is not None:
        table_meta.update(
            layer_ids=json.dumps(model.layout.layer_ids), num_embeddings=json.dumps(model.layout.num_embeddings)
        )
    with atomic_path(tmp / "tables.safetensors") as p:
        table_tensors = {} if tables_sharded else {tables[k]: state[k].detach().contiguous() for k in tables}
        if tables_sharded:
            table_meta["sharded"] = "true"
        if host_tables is not None:
            table_tensors.update({f"layer{lid}.table": t for lid, t in host_tables.table_tensors().items()})
        save_file(table_tensors, str(p), metadata=table_meta)
    opt = {f"adamw.{k}": v.detach().contiguous() for k, v in export_adamw_state(adamw, names).items()}
    if sparse is not None:
        opt.update({f"sparse_adam.{k}": v.detach().contiguous() for k, v in sparse.export_state(names).items()})
    with atomic_path(tmp / "optimizer.safetensors") as p:
        save_file(opt, str(p), metadata={"format": FORMAT})


def _write_text_files(tmp: Path, model: DecoderLM, train_cfg, tokenizer: Tokenizer, data: dict | None) -> None:
    """config.json (the resolved configs) and tokenizer.json into `tmp`."""
    config = {"model": model.cfg.to_dict(), "train": train_cfg.to_dict(), "data": data or {}}
    if model.cfg.engram is not None:
        config["engram_v4"] = model.cfg.engram.to_dict("v4")
    atomic_write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(tmp / "tokenizer.json", tokenizer.to_str())


def _write_state(tmp: Path, fingerprints: dict, trainer_state: dict) -> None:
    """state.json into `tmp`, last: the hash of every file beside it, and its own."""
    files = {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in FILES}
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprints": fingerprints,
        "files": files,
        **trainer_state,
    }
    meta["state_sha256"] = _state_digest(json.loads(json.dumps(meta)))
    atomic_write_text(tmp / "state.json", _state_text(meta))


def _state_text(state: dict) -> str:
    """state.json's bytes for `state` (its values round-trip through JSON unchanged)."""
    return json.dumps(state) + "\n"


def _point_latest(root: Path, final: Path, step: int, run_dir: Path) -> None:
    """Point ``root/LATEST`` at the checkpoint folder `final`, just written (inside `run_dir`)."""
    try:
        atomic_write_text(root / "LATEST", final.name + "\n", within=run_dir)
    except OSError as exc:
        raise CheckpointSaveError(
            f"the checkpoint of step {step} was written to {final}, but {root / 'LATEST'} could "
            f"not be updated ({_reason(exc)}): resume from the folder itself"
        ) from exc


def _remove_old(root: Path, final: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints by step, never the one just written (LATEST's target)."""
    done = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p != final),
        key=lambda p: _step_of(p) or -1,
    )
    for old in done[: max(0, len(done) - max(0, keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}"
    return str(exc)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a run directory, or its ``checkpoints`` folder."""
    path = Path(path).expanduser()
    if (path / "state.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "LATEST"
        if latest.is_file() or (root.is_dir() and root.name == "checkpoints"):
            try:
                target = root / latest.read_text().strip()
            except (OSError, UnicodeDecodeError):
                target = None
            if target is not None and target.parent == root and (target / "state.json").is_file():
                return target  # loading checks it: a damaged target is an error, not a reason to go back
            fallback = newest_complete(root)
            if fallback is None:
                if target is None:
                    continue
                raise FileNotFoundError(
                    f"{latest} points at {target}, which is not a complete checkpoint, and no "
                    f"other complete checkpoint is in {root}"
                )
            logger.warning(
                "%s points at %s, which is not a complete checkpoint: using the newest complete one, %s",
                latest,
                target.name if target is not None else "nothing",
                fallback.name,
            )
            return fallback
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist")
    raise FileNotFoundError(f"no checkpoint at {path}: expected a state.json, or checkpoints/LATEST in a run directory")


@dataclass
class Checkpoint:
    path: Path
    model: DecoderLM
    config: dict
    """The resolved configs (model, train, data)."""
    state: dict
    """state.json: step, history, evals, fingerprints."""
    tokenizer: Tokenizer
    ctok: Any
    """CompressedTokenizer (Engram models) or None."""
    optimizer_tensors: dict[str, torch.Tensor]
    tables: dict[int, torch.Tensor] = None
    """With ``tables_on_host``: {layer id: table on the CPU}; the model's tables are then on meta."""
    tables_sharded: bool = False
    """The tables are shards of data-parallel ranks (`condmem.train.data_parallel`), not in
    this folder; the model's tables are on meta."""


def load_checkpoint(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    tokenizer: Tokenizer | str | None = None,
    verify: bool = True,
    load_optimizer: bool = True,
    tables_on_host: bool = False,
) -> Checkpoint:
    """Load a checkpoint (a folder, or a run directory's latest).

    Args:
        tokenizer: use this tokenizer instead of the checkpoint's own (a Tokenizer or a path);
            refused unless it is the one the model was trained with.
        verify: check every file against the sha256 recorded in state.json.
        tables_on_host: load the Engram tables into CPU memory (``Checkpoint.tables``) and
            build the model's tables on the meta device, for `HostTables` to hold.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or altered.
        CheckpointMismatchError: the tokenizer does not match the tables / embeddings.
    """
    parts = check_checkpoint(path, tokenizer=tokenizer, verify=verify)
    folder, state, config, model_cfg = parts.path, parts.state, parts.config, parts.model_cfg
    tok, ctok = parts.tokenizer, parts.ctok
    device = torch.device(device)
    table_meta, weights, table_tensors = _read_weights(folder, device, tables_on_host)
    sharded = table_meta.get("sharded") == "true"
    model = DecoderLM(
        model_cfg,
        token_lookup=None if ctok is None else ctok.lookup,
        device=device,
        table_device="meta" if (tables_on_host or sharded) else None,
    )
    host_tables = _load_weights(folder, model, weights, table_tensors, sharded, tables_on_host)
    optimizer_tensors = {}
    if load_optimizer:
        optimizer_tensors = load_file(str(folder / "optimizer.safetensors"), device="cpu")
    return Checkpoint(
        folder,
        model,
        config,
        state,
        tok,
        ctok,
        optimizer_tensors,
        host_tables if (tables_on_host and not sharded) else None,
        sharded,
    )


@dataclass
class CheckpointParts:
    """A checkpoint's files as `check_checkpoint` checked them (no tensor loaded)."""

    path: Path
    state: dict
    config: dict
    """The resolved configs (model, train, data)."""
    model_cfg: ModelConfig
    tokenizer: Tokenizer
    ctok: Any
    """CompressedTokenizer (Engram models) or None."""
    table_meta: dict
    """tables.safetensors' header metadata (fingerprints, layer ids, ``sharded``)."""


def check_checkpoint(
    path: str | os.PathLike, *, tokenizer: Tokenizer | str | None = None, verify: bool = True
) -> CheckpointParts:
    """Check a checkpoint (a folder, or a run directory's latest) as `load_checkpoint` does, loading no tensor.

    state.json's own hash; every file's size (and, with `verify`, its sha256); config.json; the
    tokenizer against the fingerprints the tables were trained with; tables.safetensors' layout
    against state.json's. Raises as `load_checkpoint`.
    """
    folder = resolve_checkpoint(path)
    state = read_state(folder)
    _verify_files(folder, state, verify)
    try:
        config = json.loads((folder / "config.json").read_text())
        model_cfg = ModelConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{folder / 'config.json'} is not a valid checkpoint config ({exc})") from None
    fp = state.get("fingerprints", {})
    tok, ctok = _matching_tokenizer(folder, model_cfg, fp, tokenizer)
    try:
        from safetensors import safe_open

        with safe_open(str(folder / "tables.safetensors"), framework="pt") as fh:
            table_meta = fh.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for damaged headers
        raise CorruptCheckpointError(f"checkpoint {folder}: cannot read tables.safetensors ({exc})") from None
    if model_cfg.engram is not None and table_meta.get("layout") != fp.get("layout"):
        raise CheckpointMismatchError(
            f"checkpoint {folder}: tables.safetensors was written for layout {table_meta.get('layout', '?')[:16]}..., "
            f"state.json says {str(fp.get('layout'))[:16]}..."
        )
    return CheckpointParts(folder, state, config, model_cfg, tok, ctok, table_meta)


def _verify_files(folder: Path, state: dict, verify: bool) -> None:
    """Every file state.json lists is there with its size (and, when `verify`, its sha256)."""
    for name, want in state["files"].items():
        if not isinstance(want, dict) or "/" in name or name.startswith("."):
            raise CorruptCheckpointError(f"{folder / 'state.json'}: malformed entry for {name!r}")
        file = folder / name
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise CorruptCheckpointError(
                f"checkpoint file {file} has {size} bytes, {want.get('bytes')} were written: it is truncated or altered"
            )
        if verify and sha256_file(file) != want.get("sha256"):
            raise CorruptCheckpointError(f"checkpoint file {file} does not match its recorded sha256: it is corrupted")


def _matching_tokenizer(folder: Path, model_cfg: ModelConfig, fp: dict, tokenizer: Tokenizer | str | None):
    """(tokenizer, compressed tokenizer or None): the checkpoint's own or `tokenizer`, refused
    (`CheckpointMismatchError`) unless it is the one the model was trained with."""
    from condmem.tokenizer import CompressedTokenizer

    if tokenizer is None:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        from condmem.train.bpe import load_tokenizer

        tok = load_tokenizer(tokenizer)
    ctok = None
    if model_cfg.engram is not None:
        ctok = CompressedTokenizer.from_any(tok)
        if ctok.fingerprint != fp.get("tokenizer_map"):
            raise CheckpointMismatchError(
                f"checkpoint {folder}: its Engram tables were trained with the compressed tokenizer map "
                f"{str(fp.get('tokenizer_map'))[:16]}... (V'={fp.get('compressed_vocab_size')}), "
                f"but this tokenizer maps to {ctok.fingerprint[:16]}... (V'={ctok.vocab_size}): every row id "
                "would differ. Use the tokenizer.json saved with the checkpoint."
            )
        try:
            layout = EngramLayout(model_cfg.engram, compressed_vocab_size=ctok.vocab_size)
        except LayoutError as exc:
            raise CheckpointMismatchError(f"checkpoint {folder}: {exc}") from None
        if layout.fingerprint != fp.get("layout"):
            raise CheckpointMismatchError(
                f"checkpoint {folder}: the Engram layout of its config ({layout.fingerprint[:16]}...) is not the "
                f"layout its tables were trained with ({str(fp.get('layout'))[:16]}...)"
            )
    tok_sha = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
    if tok_sha != fp.get("tokenizer_json_sha256"):
        raise CheckpointMismatchError(
            f"checkpoint {folder}: the tokenizer given differs from the one the model was trained with "
            f"(tokenizer.json sha256 {tok_sha[:16]}... vs {str(fp.get('tokenizer_json_sha256'))[:16]}...): token ids "
            "would mean other strings"
        )
    return tok, ctok


def _read_weights(folder: Path, device: torch.device, tables_on_host: bool) -> tuple[dict, dict, dict]:
    """(tables.safetensors' metadata, backbone weights on `device`, table tensors on `device`
    or, with `tables_on_host`, on the CPU)."""
    try:
        from safetensors import safe_open

        tables_file = folder / "tables.safetensors"
        with safe_open(str(tables_file), framework="pt") as fh:
            table_meta = fh.metadata() or {}
        weights = load_file(str(folder / "model.safetensors"), device=str(device))
        table_tensors = load_file(str(tables_file), device="cpu" if tables_on_host else str(device))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for damaged headers
        raise CorruptCheckpointError(f"checkpoint {folder}: cannot read weights ({exc})") from None
    return table_meta, weights, table_tensors


def _load_weights(
    folder: Path, model: DecoderLM, weights: dict, table_tensors: dict, sharded: bool, tables_on_host: bool
) -> dict[int, torch.Tensor]:
    """Load the weights (and the tables, unless on the host or sharded) into `model`; returns
    {layer id: table} of the tables kept on the host."""
    names = _table_names(model)
    host_tables = {}
    for param_name, tensor_name in ({} if sharded else names).items():
        if tensor_name not in table_tensors:
            raise CheckpointMismatchError(f"checkpoint {folder}: tables.safetensors lacks {tensor_name}")
        if tables_on_host:
            host_tables[int(param_name.split(".")[1])] = table_tensors[tensor_name]
        else:
            weights[param_name] = table_tensors[tensor_name]
    if model.cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    try:
        missing, unexpected = model.load_state_dict(weights, strict=not (tables_on_host or sharded))
    except RuntimeError as exc:
        raise CheckpointMismatchError(f"checkpoint {folder}: weights do not fit the config: {exc}") from None
    if (tables_on_host or sharded) and sorted(missing) != sorted(names):
        raise CheckpointMismatchError(
            f"checkpoint {folder}: weights do not fit the config: missing "
            f"{sorted(set(missing) - set(names))}, unexpected {sorted(unexpected)}"
        )
    if unexpected:
        raise CheckpointMismatchError(f"checkpoint {folder}: weights do not fit the config: unexpected {unexpected}")
    return host_tables
