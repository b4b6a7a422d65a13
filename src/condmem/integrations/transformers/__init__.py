"""Engram for Hugging Face causal LMs (``pip install condmem[hf]``).

    from condmem.integrations.transformers import add_engram, engram_optimizer
    model = add_engram(model, EngramConfig(layer_ids=[1], ...), tokenizer)
    model.generate(...)                                   # n-gram history follows the cache
    trainer = EngramTrainer(model, args, ...)             # builds engram_optimizer from args
    trainer = Trainer(model, args, optimizers=(engram_optimizer(model, lr=1e-4), None), ...)  # or a plain one
    print(model); engram_summary(model)                   # what Engram added: layers, rows, parameters, tier
    model.save_pretrained(path)                           # weights, tokenizer and modeling_condmem.py
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)  # or load_pretrained(path)
    remove_engram(model)                                  # the plain model again (add_engram works again)

Supported families: llama, mistral, qwen2, qwen3, gpt2 (`families.FAMILIES`).
"""

from condmem.integrations.transformers.adapter import (
    CONFIG_KEY,
    EngramAdapter,
    EngramModelError,
    engram_summary,
    get_engram,
    offload_tables,
    remove_engram,
)
from condmem.integrations.transformers.attach import add_engram
from condmem.integrations.transformers.families import FAMILIES, UnsupportedModelError
from condmem.integrations.transformers.optim import (
    EngramOptimizer,
    enable_sparse_grad_norm,
    engram_optimizer,
    engram_param_groups,
)
from condmem.integrations.transformers.pretrained import load_pretrained


def __getattr__(name: str):
    # EngramTrainer subclasses transformers.Trainer: imported on first use, so that the rest of
    # the package (optimizers, saving) imports without transformers' Trainer.
    if name == "EngramTrainer":
        from condmem.integrations.transformers.trainer import EngramTrainer

        return EngramTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONFIG_KEY",
    "EngramAdapter",
    "EngramModelError",
    "EngramOptimizer",
    "EngramTrainer",
    "FAMILIES",
    "UnsupportedModelError",
    "add_engram",
    "enable_sparse_grad_norm",
    "engram_optimizer",
    "engram_param_groups",
    "engram_summary",
    "get_engram",
    "load_pretrained",
    "offload_tables",
    "remove_engram",
]
