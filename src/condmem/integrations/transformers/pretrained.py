"""Save and reload a Hugging Face model with Engram: ``model.save_pretrained`` and `load_pretrained`.

`add_engram` writes the Engram section into the model's config (``config.json`` →
``condmem_engram``: the `EngramConfig`, the layout fingerprint and the compressed
tokenizer's fingerprint), and the Engram modules are children of the decoder layers, so
their tensors (tables included) go into the model's safetensors files, sharded by
``save_pretrained`` like every other weight (``max_shard_size``).

`add_engram` also wraps the model's ``save_pretrained`` (`wrap_save_pretrained`):

* tables offloaded to an `EngramMemory` (`offload_tables`, ``add_engram(memory=...)``) are
  read back from their tier, chunk by chunk, into CPU tensors of the module's dtype: the
  folder is the one an unoffloaded model writes (the rows as the memory holds them: bf16,
  or fp8 dequantized). The whole table is in CPU memory while it is written, as it is for
  an unoffloaded model.
* the folder is written atomically: into a temp folder beside it, then renamed onto it. A
  failed save leaves the target as it was (and no new folder); files already in the target
  that the save does not write (a tokenizer saved there first) are kept.

`load_pretrained` reads the backbone with transformers, rebuilds the Engram modules from
the section, refuses a tokenizer or layout whose fingerprint differs from the saved one
(the tables would be read at the wrong rows), then reads the Engram tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from condmem.config import EngramConfig
from condmem.integrations.transformers.adapter import (
    CONFIG_KEY,
    EngramModelError,
    add_engram,
    get_engram,
    offload_tables,
)
from condmem.layout import LayoutError
from condmem.utils.atomic import fsync_dir, sweep_stale, temp_prefix

# What save_pretrained writes for the weights: an older save's such files are not carried over.
_WEIGHT_FILE = re.compile(r"model(\.[\w-]+)?(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _engram_tensor_files(path: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} for the Engram tensors of a saved model folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items() if ".engram." in name}
    single = path / "model.safetensors"
    if not single.is_file():
        raise EngramModelError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys() if ".engram." in name}


def load_pretrained(
    path: str | os.PathLike,
    tokenizer,
    *,
    model_class=None,
    sparse_tables: bool = True,
    tier: str | None = None,
    device=None,
    **from_pretrained_kwargs,
):
    """Reload a model saved with Engram.

    Args:
        path: the folder ``model.save_pretrained`` wrote.
        tokenizer: the model's tokenizer (any source `add_engram` takes); its compressed
            map must be the one the model was saved with.
        model_class: the transformers class to load with (default `AutoModelForCausalLM`).
        sparse_tables: as in `add_engram`.
        tier, device: also move the tables into an `EngramMemory` in this tier (see
            `offload_tables`); the memory is `get_engram(model).memory`.
        from_pretrained_kwargs: passed to ``from_pretrained`` (``torch_dtype``, ...).

    Raises:
        EngramModelError: no Engram section in config.json, or Engram tensors missing.
        TokenizerMismatchError: the tokenizer's compressed map differs from the saved one.
        LayoutError: the rebuilt layout's fingerprint differs from the saved one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from condmem.tokenizer import CompressedTokenizer

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    section = getattr(config, CONFIG_KEY, None)
    if not isinstance(section, dict):
        raise EngramModelError(f"{path / 'config.json'} has no '{CONFIG_KEY}' section: was it saved with Engram?")
    ctok = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer.from_any(tokenizer)
    _check_saved_tokenizer(ctok, section, path)
    engram_config = EngramConfig.from_dict(section["config"], dialect="native")
    model = _load_backbone(model_class or AutoModelForCausalLM, path, config, from_pretrained_kwargs)
    add_engram(model, engram_config, ctok, zero_init=False, sparse_tables=sparse_tables)
    adapter = get_engram(model)
    if adapter.layout.fingerprint != section["layout_fingerprint"]:
        raise LayoutError(
            f"the Engram layout rebuilt from {path / 'config.json'} has fingerprint "
            f"{adapter.layout.fingerprint[:12]}, the saved one {section['layout_fingerprint'][:12]}"
        )
    _read_engram_tensors(model, path)
    if tier is not None:
        offload_tables(model, tier=tier, device=device)
    return model


def _check_saved_tokenizer(ctok, section: dict, path: Path) -> None:
    """Refuse a tokenizer whose compressed map is not the one the model was saved with."""
    from condmem.tokenizer import TokenizerMismatchError

    if ctok.fingerprint != section["tokenizer_fingerprint"]:
        raise TokenizerMismatchError(
            f"the tokenizer's compressed map (fingerprint {ctok.fingerprint[:12]}, V'={ctok.vocab_size}) is not the "
            f"one {path} was saved with ({section['tokenizer_fingerprint'][:12]}): every row id would differ. Use "
            "the model's own tokenizer."
        )


def _load_backbone(cls, path: Path, config, from_pretrained_kwargs: dict):
    """``cls.from_pretrained`` of the saved backbone, its logs at error level while it loads."""
    from transformers.utils import logging as hf_logging

    # The backbone class does not know the Engram tensors: they are read afterwards, so its
    # "unexpected keys" report is expected; keep it out of the log.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, config=config, **from_pretrained_kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)


def _read_engram_tensors(model, path: Path) -> None:
    """Copy the saved Engram tensors of the folder `path` into the model's Engram parameters
    (every one must be there, in the shape the layout gives it)."""
    files = _engram_tensor_files(path)
    wanted = {name: p for name, p in model.named_parameters() if ".engram." in name}
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise EngramModelError(f"{path} lacks Engram tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    from safetensors import safe_open

    for file in sorted(set(files[name] for name in wanted)):
        with safe_open(str(file), framework="pt") as f:
            for name, p in wanted.items():
                if files[name] != file:
                    continue
                tensor = f.get_tensor(name)
                if tensor.shape != p.shape:
                    raise EngramModelError(
                        f"{name}: saved shape {tuple(tensor.shape)}, the layout needs {tuple(p.shape)}"
                    )
                with torch.no_grad():
                    p.copy_(tensor.to(p.dtype))


# ---------------------------------------------------------------------- saving
def memory_table(memory, layer_id: int, dtype: torch.dtype = torch.float32, chunk_rows: int = 1 << 16) -> torch.Tensor:
    """Layer `layer_id`'s whole table read back from an `EngramMemory` (any tier) as a CPU tensor [rows, head_dim].

    bf16 rows come as they are, fp8 rows dequantized (exactly, in float32), both then cast
    to `dtype`. Read `chunk_rows` rows at a time from wherever the rows live.
    """
    from condmem.fp8 import dequantize_fp8_e8m0, unpack_rows

    layer = memory.hasher.layout.layer(layer_id)
    store = memory.stores[layer_id]
    if memory.sharded is not None or store.num_rows != layer.num_embeddings:
        raise EngramModelError(
            f"layer {layer_id}'s memory holds {store.num_rows:,} of its {layer.num_embeddings:,} "
            "rows (a tensor-parallel shard): save from a memory that holds whole tables"
        )
    out = torch.empty(layer.num_embeddings, store.head_dim, dtype=dtype)
    for start in range(0, layer.num_embeddings, chunk_rows):
        stop = min(layer.num_embeddings, start + chunk_rows)
        raw = store.gather_raw(torch.arange(start, stop, device=store.device)).cpu()
        if store.format == "bf16":
            out[start:stop] = raw.view(torch.bfloat16).to(dtype)
        else:
            q, e = unpack_rows(raw.contiguous())
            out[start:stop] = dequantize_fp8_e8m0(q, e, torch.float32).to(dtype)
    return out


def engram_state_dict(model, state_dict: dict | None = None) -> dict:
    """`model.state_dict()` (or `state_dict`) with every offloaded table read back from the model's memory.

    The modules of an offloaded model hold meta tensors for their tables; this puts the
    rows the `EngramMemory` holds in their place (`memory_table`), in the module's dtype.
    """
    adapter = get_engram(model)
    state = model.state_dict() if state_dict is None else dict(state_dict)
    if adapter.memory is None:
        return state
    names = {module: name for name, module in model.named_modules()}
    for lid, engram in adapter.engrams.items():
        key = f"{names[engram]}.table.weight"
        tensor = state.get(key)
        if tensor is not None and tensor.device.type == "meta":
            state[key] = memory_table(adapter.memory, lid, engram.table.weight.dtype)
    return state


@contextlib.contextmanager
def _atomic_folder(target: Path):
    """Yield a temp folder beside `target`; on success it replaces `target` (files only the old one had are kept)."""
    target = Path(target)
    if target.is_file():
        raise EngramModelError(f"{target} is a file: save_pretrained writes a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(target.parent, f".{target.name}.")
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target), dir=target.parent))
    aside = target.parent / f".{target.name}.aside-{os.getpid()}"
    try:
        yield tmp
        if target.exists():
            os.replace(target, aside)  # moved aside, not deleted: a crash from here on loses nothing
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not target.exists():
            os.replace(aside, target)
        raise
    if aside.exists():
        for entry in aside.iterdir():  # e.g. a tokenizer saved there earlier; never an older save's weights
            if not (target / entry.name).exists() and not _WEIGHT_FILE.fullmatch(entry.name):
                os.replace(entry, target / entry.name)
        shutil.rmtree(aside, ignore_errors=True)


def wrap_save_pretrained(model) -> None:
    """Make ``model.save_pretrained`` write offloaded tables and write atomically (see the module docstring)."""
    original = model.save_pretrained
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, **kwargs):
        bound = signature.bind(save_directory, *args, **kwargs)
        arguments = bound.arguments
        if not arguments.get("is_main_process", True):
            return original(*bound.args, **bound.kwargs)  # this rank writes nothing
        arguments["state_dict"] = engram_state_dict(model, arguments.get("state_dict"))
        target = Path(save_directory)
        if arguments.get("push_to_hub"):  # the repository is named after the folder, not the temp one
            extra = arguments.setdefault("kwargs", {})
            extra.setdefault("repo_id", target.name)
        with _atomic_folder(target) as tmp:
            arguments["save_directory"] = tmp
            return original(*bound.args, **bound.kwargs)

    model.save_pretrained = save_pretrained
