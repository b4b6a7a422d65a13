"""`add_engram`: put Engram modules into a Hugging Face causal LM, wired with forward hooks.

The modules are new children of the chosen decoder layers; the hooks are an `EngramAdapter`
(`condmem.integrations.transformers.adapter`). `add_engram` also guards the sparse tables against
dense optimizers (`optim`) and wraps ``save_pretrained`` (`saving`). The Engram layers are
``EngramConfig.layer_ids`` (a differing ``layers=`` is refused); an unstated ``pad_id`` is the
tokenizer's pad token. ``print(model)`` opens with `engram_summary`.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch
from torch import nn

from condmem.config import ConfigError, EngramConfig
from condmem.hashing import NgramHasher
from condmem.integrations.transformers.adapter import (
    _PATCHED,
    _UNSET,
    CONFIG_KEY,
    EngramAdapter,
    EngramModelError,
    engram_summary,
)
from condmem.integrations.transformers.families import locate
from condmem.integrations.transformers.optim import guard_sparse_tables
from condmem.integrations.transformers.saving import wrap_save_pretrained
from condmem.layout import EngramLayout
from condmem.module import Engram

logger = logging.getLogger("condmem.integrations.transformers")


def _pad_token_id(tokenizer) -> int | None:
    """The pad token id a tokenizer states (transformers: ``pad_token_id``; tokenizers: its padding), else None."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int):
        return pad
    from tokenizers import Tokenizer

    inner = getattr(tokenizer, "tokenizer", None)  # a CompressedTokenizer's tokenizers.Tokenizer
    if isinstance(inner, Tokenizer):
        tokenizer = inner
    padding = getattr(tokenizer, "padding", None)
    return padding.get("pad_id") if isinstance(padding, dict) else None


def add_engram(
    model: nn.Module,
    engram_config: EngramConfig,
    tokenizer,
    layers: list[int] | None = None,
    *,
    zero_init: bool = True,
    sparse_tables: bool = True,
    memory=None,
) -> nn.Module:
    """Insert Engram modules into a Hugging Face causal LM, in place; returns the model.

    Args:
        model: a ``*ForCausalLM`` / ``GPT2LMHeadModel`` of a supported family (llama, mistral,
            qwen2, qwen3, gpt2), loaded or built from a config.
        engram_config: the Engram geometry. ``hidden_size`` comes from the model; ``hc_mult``
            must be 1 (one residual stream); ``compressed_vocab_size`` is set from the
            tokenizer, or checked against it when the config states it; ``pad_id``, when the
            config does not state it, is the tokenizer's pad token (refused without one).
        tokenizer: the model's tokenizer: a transformers tokenizer, a `tokenizers.Tokenizer`,
            a tokenizer.json path, or a `CompressedTokenizer`.
        layers: optional, and then equal to ``engram_config.layer_ids`` (the one place the Engram
            layers are stated; another list is refused).
        zero_init: start each Engram's value projection at zero, so that the model computes
            exactly what it computed before until training moves it.
        sparse_tables: tables produce sparse gradients (train them with `engram_optimizer`).
        memory: an `EngramMemory` holding the tables (any tier, lookups prefetched before
            layer 0); the modules then keep no table of their own. See also `offload_tables`.

    Raises:
        UnsupportedModelError: the model is not a causal LM of a supported family.
        EngramModelError / ConfigError: bad layers (or `layers` disagreeing with the config),
            hc_mult != 1, no pad id stated or derivable, Engram already added.
        TokenizerMismatchError: the tokenizer's compressed size disagrees with the config.
    """
    from condmem.tokenizer import CompressedTokenizer

    family, base, decoder_layers = locate(model)
    if getattr(model, "_condmem_engram", None) is not None:
        raise EngramModelError(
            f"{type(model).__name__} already has Engram layers {model._condmem_engram.config.layer_ids}"
        )
    ctok = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer.from_any(tokenizer)
    config = _model_engram_config(model, engram_config, layers, len(decoder_layers), ctok, tokenizer)
    layout = EngramLayout(config)
    lookup = _model_token_lookup(model, ctok, config.pad_id)
    hasher = NgramHasher(layout, token_lookup=lookup, pad_id=config.pad_id)
    if memory is not None:
        _check_memory(memory, layout)
    engrams = _insert_engrams(model, decoder_layers, config, layout, zero_init, sparse_tables, memory)
    patched = {name: vars(model).get(name, _UNSET) for name in _PATCHED}  # what remove_engram puts back
    adapter = EngramAdapter(model, family, base, decoder_layers, config, ctok, hasher, engrams)
    adapter.memory = memory
    adapter.source_tokenizer = tokenizer
    adapter._patched = patched
    model._condmem_engram = adapter
    if sparse_tables and memory is None:
        guard_sparse_tables(model)  # a dense optimizer is refused with condmem's message, not torch's
    model.extra_repr = _summary_repr(model)  # print(model) opens with what Engram added
    wrap_save_pretrained(model)  # offloaded tables saved from their tier; the folder written atomically
    # Saved with the model's config.json: what a reload needs to rebuild and verify the same layout.
    setattr(
        model.config,
        CONFIG_KEY,
        {
            "config": config.to_dict(),
            "layout_fingerprint": layout.fingerprint,
            "tokenizer_fingerprint": ctok.fingerprint,
            "backbone_model_type": family.model_type,
        },
    )
    return model


def _model_engram_config(
    model: nn.Module, engram_config: EngramConfig, layers: list[int] | None, n_layers: int, ctok, tokenizer
) -> EngramConfig:
    """`engram_config` for this model: its `layers` (if given) checked against the model's `n_layers`,
    hc_mult 1, the compressed tokenizer's size and pad checked, hidden size and norm eps filled in."""
    config = engram_config
    if layers is not None and list(layers) != config.layer_ids:
        raise ConfigError(
            f"add_engram(layers={list(layers)}) disagrees with EngramConfig.layer_ids {config.layer_ids}: state the "
            "Engram layers once, in EngramConfig.layer_ids (their order lays out the tables), and leave layers= out"
        )
    bad = [i for i in config.layer_ids if i >= n_layers]
    if bad:
        raise EngramModelError(
            f"Engram layers {bad} do not exist: {type(model).__name__} has {n_layers} decoder "
            f"layers (0..{n_layers - 1})"
        )
    if config.hc_mult not in (None, 1):
        raise ConfigError(
            f"EngramConfig.hc_mult is {config.hc_mult}, but a Hugging Face decoder has one residual "
            "stream: use hc_mult=1"
        )
    if config.compressed_vocab_size is not None:
        ctok.check_config(config.compressed_vocab_size)
    pad_token_id = _pad_token_id(tokenizer)
    if not config.pad_id_stated:
        if pad_token_id is None:
            raise ConfigError(
                f"EngramConfig states no pad_id and the tokenizer ({type(tokenizer).__name__}) has no pad token to "
                "take it from: pass EngramConfig(pad_id=...), e.g. pad_id=tokenizer.eos_token_id for a GPT-2-style "
                "tokenizer, or set tokenizer.pad_token. Engram hashes the pad id in place of the tokens before a "
                "sequence's start, so a saved model must keep the one it was trained with"
            )
        config = config.replace(pad_id=pad_token_id)
    config.check_pad_id(ctok.original_vocab_size, pad_token_id)
    return config.replace(
        hidden_size=int(model.config.hidden_size),
        hc_mult=1,
        compressed_vocab_size=ctok.vocab_size,
        rms_norm_eps=config.rms_norm_eps if config.rms_norm_eps is not None else 1e-6,
    )


def _model_token_lookup(model: nn.Module, ctok, pad_id: int) -> np.ndarray:
    """The compression map over every id the model embeds: the tokenizer's, extended with the pad's
    compressed id for the ids of a padded embedding that no tokenizer entry has."""
    vocab = int(getattr(model.config, "vocab_size", ctok.original_vocab_size))
    if vocab < ctok.original_vocab_size:
        raise EngramModelError(
            f"the tokenizer has {ctok.original_vocab_size} ids but {type(model).__name__} embeds "
            f"only {vocab}: is this the model's tokenizer?"
        )
    lookup = ctok.lookup
    if vocab > ctok.original_vocab_size:
        # A padded embedding (e.g. to a multiple of 64): ids no tokenizer entry has read as the pad.
        logger.warning(
            "%s embeds %d ids, its tokenizer has %d: ids %d..%d hash as the pad id %d",
            type(model).__name__,
            vocab,
            ctok.original_vocab_size,
            ctok.original_vocab_size,
            vocab - 1,
            pad_id,
        )
        extra = np.full(vocab - ctok.original_vocab_size, lookup[pad_id], dtype=np.int64)
        lookup = np.concatenate([lookup, extra])
    return lookup


def _insert_engrams(
    model: nn.Module,
    decoder_layers,
    config: EngramConfig,
    layout: EngramLayout,
    zero_init: bool,
    sparse_tables: bool,
    memory,
) -> dict[int, Engram]:
    """An `Engram` added as child ``engram`` of each chosen decoder layer, on the layer's device and
    dtype (tables on "meta" when `memory` holds them; value projection zeroed with `zero_init`)."""
    engrams: dict[int, Engram] = {}
    for lid in config.layer_ids:
        layer = decoder_layers[lid]
        if hasattr(layer, "engram"):
            raise EngramModelError(f"decoder layer {lid} of {type(model).__name__} already has an 'engram' attribute")
        p = next(layer.parameters())
        engram = Engram(
            config,
            layout.layer(lid).num_embeddings,
            layer_id=lid,
            sparse=sparse_tables,
            device=p.device,
            dtype=p.dtype,
            table_device="meta" if memory is not None else None,
        )
        if zero_init:
            with torch.no_grad():
                engram.wkv.weight[config.hc_mult * config.hidden_size :].zero_()  # the value rows
        layer.add_module("engram", engram)
        engrams[lid] = engram
    return engrams


def _summary_repr(model: nn.Module):
    """An ``extra_repr`` for the model instance: `engram_summary` (through a weak reference: no cycle)."""
    ref = weakref.ref(model)

    def extra_repr() -> str:
        target = ref()
        return "" if target is None or getattr(target, "_condmem_engram", None) is None else engram_summary(target)

    return extra_repr


def _check_memory(memory, layout: EngramLayout) -> None:
    if memory.hasher.layout.fingerprint != layout.fingerprint:
        raise EngramModelError(
            "the EngramMemory was built for another layout (its hasher's fingerprint differs): "
            "rows would be read at the wrong addresses"
        )
