"""Tiny Hugging Face causal LMs built from configs (no downloads) and an Engram config to go with them."""

from __future__ import annotations

import torch

from condmem import EngramConfig

PAD = 1  # "<|pad|>" of train_bpe's special tokens: Engram's pad id


def tiny_model(family: str, vocab: int, layers: int = 3, attn_implementation: str | None = None):
    """A tiny causal LM of `family` built from a config (seeded), in eval mode."""
    import transformers as t

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    config = {
        "llama": lambda: t.LlamaConfig(**common),
        "mistral": lambda: t.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: t.Qwen2Config(**common),
        "qwen3": lambda: t.Qwen3Config(**common, head_dim=8),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            pad_token_id=PAD,
            bos_token_id=None,
            eos_token_id=None,
            **extra,
        ),
    }[family]()
    cls = t.GPT2LMHeadModel if family == "gpt2" else t.AutoModelForCausalLM
    torch.manual_seed(0)
    model = t.GPT2LMHeadModel(config) if family == "gpt2" else cls.from_config(config)
    return model.eval()


def engram_config(short_conv: bool = True) -> EngramConfig:
    """Engram at decoder layers 0 and 2 of `tiny_model`, small tables."""
    return EngramConfig(
        layer_ids=[0, 2], max_ngram_size=3, n_heads=2, head_dim=8, table_size=61, pad_id=PAD, short_conv=short_conv
    )
