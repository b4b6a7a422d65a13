"""Reload a Hugging Face model with Engram: `load_pretrained` and the remote-code classes.

`add_engram` writes the Engram section into the model's config (``config.json`` →
``condmem_engram``: the `EngramConfig`, the layout fingerprint and the compressed
tokenizer's fingerprint), and the Engram modules are children of the decoder layers, so
their tensors (tables included) go into the model's safetensors files, sharded by
``save_pretrained`` like every other weight (``max_shard_size``).

`add_engram` also wraps the model's ``save_pretrained`` (`condmem.integrations.transformers.saving`:
offloaded tables read back, the folder written atomically, the tokenizer and
``modeling_condmem.py`` beside the weights, ``config.json`` with an ``auto_map``). So
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the model with
Engram (the file imports condmem, which must be installed), and without ``trust_remote_code``
transformers refuses the folder instead of loading a plain backbone.

`load_pretrained` reads the backbone with transformers, rebuilds the Engram modules from
the section, refuses a tokenizer or layout whose fingerprint differs from the saved one
(the tables would be read at the wrong rows), then reads the Engram tensors. Without a
tokenizer it takes the one saved in the folder (checked against the saved fingerprint).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from condmem.config import EngramConfig, read_json_file
from condmem.integrations.transformers.adapter import CONFIG_KEY, EngramModelError, get_engram, offload_tables
from condmem.integrations.transformers.attach import add_engram
from condmem.integrations.transformers.saving import ENGRAM_MODEL_TYPE
from condmem.layout import LayoutError

logger = logging.getLogger("condmem.integrations.transformers")


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
    tokenizer=None,
    *,
    model_class=None,
    sparse_tables: bool = True,
    tier: str | None = None,
    device=None,
    config=None,
    **from_pretrained_kwargs,
):
    """Reload a model saved with Engram (what ``AutoModelForCausalLM.from_pretrained(path,
    trust_remote_code=True)`` calls through the folder's ``modeling_condmem.py``).

    Args:
        path: the folder ``model.save_pretrained`` wrote, or a Hub repository holding one
            (downloaded with ``huggingface_hub.snapshot_download``).
        tokenizer: the model's tokenizer (any source `add_engram` takes); its compressed map must
            be the one the model was saved with. None: the tokenizer saved in the folder.
        model_class: the transformers class to load with (default: the causal-LM class of the
            backbone's config, e.g. `LlamaForCausalLM`).
        sparse_tables: as in `add_engram`.
        tier, device: also move the tables into an `EngramMemory` in this tier (see
            `offload_tables`); the memory is `get_engram(model).memory`.
        config: the backbone config, already read (default: read from ``path/config.json``).
        from_pretrained_kwargs: passed to ``from_pretrained`` (``dtype``, ...).

    Raises:
        EngramModelError: neither a folder nor a repository to download, no Engram section in config.json, no tokenizer
            given or saved, or Engram tensors missing.
        TokenizerMismatchError: the tokenizer's compressed map differs from the saved one.
        LayoutError: the rebuilt layout's fingerprint differs from the saved one.
    """
    from condmem.tokenizer import CompressedTokenizer

    path = _local_folder(path, from_pretrained_kwargs)
    config = read_backbone_config(path) if config is None else config
    section = getattr(config, CONFIG_KEY, None)
    if not isinstance(section, dict):
        raise EngramModelError(f"{path / 'config.json'} has no '{CONFIG_KEY}' section: was it saved with Engram?")
    if hasattr(config, "auto_map"):  # the backbone class loads it; a re-save writes the folder's own again
        delattr(config, "auto_map")
    if tokenizer is None:
        tokenizer, ctok = _saved_tokenizer(path, section)
    else:
        ctok = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer.from_any(tokenizer)
    _check_saved_tokenizer(ctok, section, path)
    engram_config = EngramConfig.from_dict(section["config"], dialect="native")
    from_pretrained_kwargs.pop("trust_remote_code", None)  # the backbone is a transformers class
    model = _load_backbone(model_class or _causal_lm_class(config), path, config, from_pretrained_kwargs)
    add_engram(model, engram_config, ctok, zero_init=False, sparse_tables=sparse_tables)
    adapter = get_engram(model)
    adapter.source_tokenizer = tokenizer  # what a later save writes beside the weights
    if adapter.layout.fingerprint != section["layout_fingerprint"]:
        raise LayoutError(
            f"the Engram layout rebuilt from {path / 'config.json'} has fingerprint "
            f"{adapter.layout.fingerprint[:12]}, the saved one {section['layout_fingerprint'][:12]}"
        )
    _read_engram_tensors(model, path)
    if tier is not None:
        offload_tables(model, tier=tier, device=device)
    return model


def _local_folder(path, kwargs: dict) -> Path:
    """`path` when it is a folder, else the local copy of the Hub repository it names (``revision``,
    ``cache_dir``, ``token`` and ``local_files_only`` read from `kwargs`)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(path),
                revision=kwargs.get("revision"),
                cache_dir=kwargs.get("cache_dir"),
                token=kwargs.get("token"),
                local_files_only=bool(kwargs.get("local_files_only", False)),
            )
        )
    except (OSError, ValueError) as exc:
        raise EngramModelError(
            f"{path} is neither a folder nor a Hub repository that could be downloaded ({type(exc).__name__}: {exc})"
        ) from None


def read_backbone_config(path: str | os.PathLike):
    """The backbone's transformers config from a saved Engram folder's config.json (no remote code run).

    The file's ``model_type`` is ``condmem_engram``; the backbone's (``llama``, ...) is the Engram
    section's ``backbone_model_type``. A folder saved without it carries the backbone's type itself.
    """
    data = read_json_file(Path(path) / "config.json", "model config")
    return _backbone_config_from_dict(data, Path(path))


def _backbone_config_from_dict(data: dict, path: Path, **kwargs):
    """``CONFIG_MAPPING[backbone type].from_dict`` of a saved config dict (`kwargs` as ``from_dict`` takes)."""
    from transformers import CONFIG_MAPPING

    section = data.get(CONFIG_KEY) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise EngramModelError(f"{path / 'config.json'} has no '{CONFIG_KEY}' section: was it saved with Engram?")
    model_type = section.get("backbone_model_type", data.get("model_type"))
    if model_type in (None, ENGRAM_MODEL_TYPE) or model_type not in CONFIG_MAPPING:
        raise EngramModelError(
            f"{path / 'config.json'}: the Engram section names backbone model type {model_type!r}, which this "
            "transformers does not know"
        )
    return CONFIG_MAPPING[model_type].from_dict({**data, "model_type": model_type}, **kwargs)


def _causal_lm_class(config):
    """The transformers causal-LM class of a backbone config (`LlamaForCausalLM`, `GPT2LMHeadModel`, ...)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _saved_tokenizer(path: Path, section: dict):
    """(tokenizer, CompressedTokenizer) saved in `path` whose compressed map is the saved one.

    Tried in turn: the folder through ``AutoTokenizer`` (what the save wrote for a transformers
    tokenizer; its decode can differ from the bare file's), then ``tokenizer.json`` itself.
    """
    from condmem.tokenizer import CompressedTokenizer, TokenizerMismatchError

    candidates = []
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        # The backbone's config given: AutoTokenizer would otherwise read config.json's custom model type.
        candidates.append(lambda: AutoTokenizer.from_pretrained(path, config=read_backbone_config(path)))
    if (path / "tokenizer.json").is_file():
        candidates.append(lambda: str(path / "tokenizer.json"))
    if not candidates:
        raise EngramModelError(
            f"{path} holds no tokenizer (tokenizer.json): pass the model's tokenizer, load_pretrained({str(path)!r}, "
            "tokenizer); a save by this condmem writes it beside the weights"
        )
    for make in candidates:
        source = make()
        ctok = CompressedTokenizer.from_any(source)
        if ctok.fingerprint == section["tokenizer_fingerprint"]:
            return source, ctok
    raise TokenizerMismatchError(
        f"the tokenizer saved in {path} does not give the compressed map the model was saved with "
        f"({section['tokenizer_fingerprint'][:12]}): pass the model's own tokenizer, load_pretrained(path, tokenizer)"
    )


class EngramAutoConfig:
    """What a saved Engram folder's ``auto_map`` names for ``AutoConfig``: the backbone's own config.

    ``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` returns e.g. a `LlamaConfig`
    holding the Engram section and the folder's ``auto_map`` (so that ``AutoModelForCausalLM``
    goes on to `EngramAutoModelForCausalLM`).
    """

    model_type = ENGRAM_MODEL_TYPE

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """Nothing to register: the config returned is a transformers class."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        from transformers import PretrainedConfig

        data, kwargs = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return _backbone_config_from_dict(data, Path(str(pretrained_model_name_or_path)), **kwargs)


class EngramAutoModelForCausalLM:
    """What a saved Engram folder's ``auto_map`` names for ``AutoModelForCausalLM``: `load_pretrained`.

    ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)`` returns
    the backbone class (e.g. `LlamaForCausalLM`) with its Engram layers and tables, and the
    tokenizer saved in the folder hashing its inputs; `load_pretrained`'s own keywords
    (``tokenizer``, ``tier``, ``device``, ``sparse_tables``) may be passed too.
    """

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM") -> None:
        """Nothing to register: the model returned is a transformers class."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes keyword arguments only, got {len(model_args)} more")
        for hub_only in ("_from_auto", "adapter_kwargs"):
            kwargs.pop(hub_only, None)
        return load_pretrained(pretrained_model_name_or_path, **kwargs)


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
