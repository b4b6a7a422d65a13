"""Save and reload a Hugging Face model with Engram: ``model.save_pretrained`` and `load_pretrained`.

Saving needs nothing special: `add_engram` writes the Engram section into the model's
config (``config.json`` → ``condmem_engram``: the `EngramConfig`, the layout fingerprint
and the compressed tokenizer's fingerprint), and the Engram modules are children of the
decoder layers, so their tensors (tables included) go into the model's safetensors files,
sharded by ``save_pretrained`` like every other weight (``max_shard_size``).

`load_pretrained` reads the backbone with transformers, rebuilds the Engram modules from
the section, refuses a tokenizer or layout whose fingerprint differs from the saved one
(the tables would be read at the wrong rows), then reads the Engram tensors.
"""

from __future__ import annotations

import json
import os
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


def load_pretrained(path: str | os.PathLike, tokenizer, *, model_class=None, sparse_tables: bool = True,
                    tier: str | None = None, device=None, **from_pretrained_kwargs):
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
    from transformers.utils import logging as hf_logging

    from condmem.tokenizer import CompressedTokenizer, TokenizerMismatchError

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    section = getattr(config, CONFIG_KEY, None)
    if not isinstance(section, dict):
        raise EngramModelError(f"{path / 'config.json'} has no '{CONFIG_KEY}' section: was it saved with Engram?")
    ctok = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer.from_any(tokenizer)
    if ctok.fingerprint != section["tokenizer_fingerprint"]:
        raise TokenizerMismatchError(
            f"the tokenizer's compressed map (fingerprint {ctok.fingerprint[:12]}, V'={ctok.vocab_size}) is not the "
            f"one {path} was saved with ({section['tokenizer_fingerprint'][:12]}): every row id would differ. Use "
            "the model's own tokenizer.")
    engram_config = EngramConfig.from_dict(section["config"], dialect="native")
    cls = model_class or AutoModelForCausalLM
    # The backbone class does not know the Engram tensors: they are read below, so its
    # "unexpected keys" report is expected; keep it out of the log.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(path, config=config, **from_pretrained_kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    add_engram(model, engram_config, ctok, zero_init=False, sparse_tables=sparse_tables)
    adapter = get_engram(model)
    if adapter.layout.fingerprint != section["layout_fingerprint"]:
        raise LayoutError(f"the Engram layout rebuilt from {path / 'config.json'} has fingerprint "
                          f"{adapter.layout.fingerprint[:12]}, the saved one {section['layout_fingerprint'][:12]}")

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
                    raise EngramModelError(f"{name}: saved shape {tuple(tensor.shape)}, the layout needs "
                                           f"{tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(tensor.to(p.dtype))
    if tier is not None:
        offload_tables(model, tier=tier, device=device)
    return model
