"""``model.save_pretrained`` of a Hugging Face model with Engram (`wrap_save_pretrained`, which `add_engram` applies).

* tables offloaded to an `EngramMemory` (`offload_tables`, ``add_engram(memory=...)``) are
  read back from their tier, chunk by chunk, into CPU tensors of the module's dtype: the
  folder is the one an unoffloaded model writes (the rows as the memory holds them: bf16,
  or fp8 dequantized). The whole table is in CPU memory while it is written, as it is for
  an unoffloaded model.
* the folder is written atomically: into a temp folder beside it, then renamed onto it. A
  failed save leaves the target as it was (and no new folder); files already in the target
  that the save does not write (a tokenizer saved there first) are kept.
* beside the weights it writes the tokenizer Engram hashes with and ``modeling_condmem.py``,
  and gives ``config.json`` the model type ``condmem_engram`` (the backbone's own type kept in
  the section's ``backbone_model_type``) with an ``auto_map`` naming that file's classes, the way
  custom architectures ship their code (`condmem.integrations.transformers.pretrained` loads it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from condmem.integrations.transformers.adapter import EngramModelError, get_engram
from condmem.utils.atomic import fsync_dir, sweep_stale, temp_prefix

logger = logging.getLogger("condmem.integrations.transformers")

# What save_pretrained writes for the weights: an older save's such files are not carried over.
_WEIGHT_FILE = re.compile(r"model(\.[\w-]+)?(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")

ENGRAM_MODEL_TYPE = "condmem_engram"
"""``model_type`` of a saved Engram folder's config.json (the backbone's: the section's ``backbone_model_type``)."""
REMOTE_MODULE = "modeling_condmem.py"
"""The remote-code file a save writes beside config.json; its ``auto_map`` names the classes below."""
AUTO_MAP = {
    "AutoConfig": "modeling_condmem.EngramAutoConfig",
    "AutoModelForCausalLM": "modeling_condmem.EngramAutoModelForCausalLM",
}
_REMOTE_CODE = '''"""Engram (condmem) in this checkpoint: loaded by transformers with trust_remote_code=True.

AutoConfig gives the backbone's own config; AutoModelForCausalLM loads the backbone and re-attaches
its Engram layers through condmem.integrations.transformers.load_pretrained. Needs the condmem
package (pip install "condmem[hf]").
"""

try:
    from condmem.integrations.transformers.pretrained import EngramAutoConfig, EngramAutoModelForCausalLM
except ImportError as exc:
    raise ImportError(
        "this checkpoint holds Engram layers (condmem): loading it needs the condmem package, "
        'pip install "condmem[hf]"; without it the model would lose its Engram layers'
    ) from exc

__all__ = ["EngramAutoConfig", "EngramAutoModelForCausalLM"]
'''


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
    """Make ``model.save_pretrained`` write offloaded tables, the tokenizer and the remote-code file, atomically
    (see the module docstring)."""
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
        push = bool(arguments.get("push_to_hub"))
        arguments["push_to_hub"] = False  # uploaded below, once the folder is complete
        with _atomic_folder(target) as tmp:
            arguments["save_directory"] = tmp
            result = original(*bound.args, **bound.kwargs)
            _write_engram_files(model, tmp, target)
        if push:
            _push_folder(target, arguments.get("token"), dict(arguments.get("kwargs", {})))
        return result

    model.save_pretrained = save_pretrained


def _write_engram_files(model, folder: Path, target: Path) -> None:
    """Beside what transformers wrote into `folder`: the tokenizer, ``modeling_condmem.py``, and config.json's
    model type and ``auto_map`` (what loading through ``trust_remote_code`` needs)."""
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text(encoding="utf-8"))
    data["model_type"] = ENGRAM_MODEL_TYPE
    data["auto_map"] = dict(AUTO_MAP)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / REMOTE_MODULE).write_text(_REMOTE_CODE, encoding="utf-8")
    _save_tokenizer(get_engram(model), folder, target)


def _save_tokenizer(adapter, folder: Path, target: Path) -> None:
    """The tokenizer `add_engram` was given, saved into `folder`: a transformers tokenizer through its own
    ``save_pretrained``; a bare one as ``tokenizer.json`` (with a ``tokenizer_config.json`` for
    ``AutoTokenizer`` unless `target` holds one already, which is then kept)."""
    source = adapter.source_tokenizer
    if callable(getattr(source, "save_pretrained", None)):
        source.save_pretrained(folder)
        return
    bare = source if isinstance(source, (str, os.PathLike)) else None
    backend = adapter.tokenizer.tokenizer  # the CompressedTokenizer's tokenizers.Tokenizer, where it has one
    if backend is None and bare is None:
        logger.warning(
            "the tokenizer (%s) has no tokenizer.json form, so none is saved beside the weights: pass it to "
            "load_pretrained(path, tokenizer)",
            type(source).__name__,
        )
        return
    from transformers import PreTrainedTokenizerFast

    from condmem.tokenizer import read_tokenizer_file

    if backend is None:
        backend = read_tokenizer_file(Path(bare) if Path(bare).is_file() else Path(bare) / "tokenizer.json")
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(folder)
    if (target / "tokenizer_config.json").is_file():  # a tokenizer the user saved there: its settings kept
        (folder / "tokenizer_config.json").unlink()


def _push_folder(target: Path, token, extra: dict) -> None:
    """Upload the saved folder to the Hub (``save_pretrained(push_to_hub=True)``), once it holds every file."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = extra.pop("repo_id", target.name)
    commit_message = extra.pop("commit_message", None) or "Upload model with Engram"
    create_pr = extra.pop("create_pr", False)
    repo_id = api.create_repo(repo_id, exist_ok=True, private=extra.pop("private", None)).repo_id
    api.upload_folder(repo_id=repo_id, folder_path=str(target), commit_message=commit_message, create_pr=create_pr)
