"""Where a Hugging Face causal LM keeps its decoder: the model families Engram can be added to.

Each family is one row: the attribute of the base model under the causal-LM head and the
attribute of the decoder-layer list under the base model. Every decoder layer of these
families takes the hidden states as its first argument, which is what the Engram hook
reads and rewrites. A model of another family is refused with an error naming its class.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class UnsupportedModelError(ValueError):
    """The model is not a causal LM of a family `add_engram` knows how to wire."""


@dataclass(frozen=True)
class Family:
    """How to reach one family's decoder layers."""

    model_type: str
    """``config.model_type`` of the family."""
    base: str
    """Attribute of the base model (embeddings + decoder layers) under the LM head."""
    layers: str
    """Attribute of the decoder-layer `nn.ModuleList` under the base model."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "model", "layers"),
        Family("mistral", "model", "layers"),
        Family("qwen2", "model", "layers"),
        Family("qwen3", "model", "layers"),
        Family("gpt2", "transformer", "h"),
    )
}


def locate(model: nn.Module) -> tuple[Family, nn.Module, nn.ModuleList]:
    """(family, base model, decoder layers) of a supported causal LM; `UnsupportedModelError` otherwise."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    supported = ", ".join(sorted(FAMILIES))
    if family is None:
        raise UnsupportedModelError(
            f"add_engram does not know {name} (model_type {model_type!r}); supported families: {supported}"
        )
    base = getattr(model, family.base, None)
    layers = getattr(base, family.layers, None) if base is not None else None
    if not callable(getattr(model, "generate", None)) or not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{name} is a {model_type} model but not its causal LM (expected .{family.base}.{family.layers} "
            f"decoder layers under a model with generate(), e.g. the *ForCausalLM / *LMHeadModel class)"
        )
    return family, base, layers
