"""Named sizes for `condmem demo` / `condmem train`: model, Engram, training and data settings.

* ``cpu``: the default on a machine without a GPU; baseline + Engram in <= 10 minutes on
  2 cores (measured numbers in the README).
* ``gpu``: the default with CUDA; a ~40M-parameter backbone with tens of millions of table
  rows, trained on the standard library plus every installed package's Python source
  (hundreds of MB where PyTorch is installed): one pass or less at the default steps.
* ``tiny``: seconds; for tests and smoke runs.

The Engram layer sits in the second block (index 1), reads 2- and 3-grams with a
ShortConv, hc_mult 1. Its ``wkv`` GEMM and conv cost FLOPs that the baseline spends
on a wider MLP in the same block (`iso_flop_baseline`).
"""

from __future__ import annotations

import copy

PRESETS: dict[str, dict] = {
    "cpu": {
        "model": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 352, "max_seq_len": 256},
        "engram": {"layer_ids": [1], "max_ngram_size": 3, "n_heads": 4, "head_dim": 16, "table_size": 20_000,
                   "short_conv": True, "table_init_std": 0.02},
        "train": {"steps": 240, "batch_size": 16, "seq_len": 256, "lr": 3e-3, "warmup_steps": 24,
                  "eval_tokens": 32_768, "eval_every": 60, "log_every": 1},
        "data": {"corpus": "stdlib", "vocab_size": 4096, "max_train_bytes": 12_000_000,
                 "tokenizer_train_bytes": 6_000_000},
    },
    "gpu": {
        "model": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1408, "max_seq_len": 512},
        "engram": {"layer_ids": [1], "max_ngram_size": 3, "n_heads": 8, "head_dim": 32, "table_size": 2_000_000,
                   "short_conv": True, "table_init_std": 0.02},
        "train": {"steps": 1000, "batch_size": 64, "seq_len": 512, "lr": 2e-3, "warmup_steps": 100,
                  "eval_tokens": 262_144, "eval_every": 200, "eval_batch_size": 32, "log_every": 50},
        "data": {"corpus": "python", "vocab_size": 8192, "max_train_bytes": 250_000_000,
                 "max_corpus_bytes": 1_500_000_000,
                 "tokenizer_train_bytes": 20_000_000},
    },
    "tiny": {
        "model": {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64, "max_seq_len": 64},
        "engram": {"layer_ids": [1], "max_ngram_size": 3, "n_heads": 2, "head_dim": 8, "table_size": 500,
                   "short_conv": True, "table_init_std": 0.02},
        "train": {"steps": 8, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                  "eval_tokens": 512, "eval_every": 0, "log_every": 1},
        "data": {"corpus": "stdlib", "vocab_size": 320, "max_train_bytes": None, "tokenizer_train_bytes": 2_000_000},
    },
}


def get_preset(name: str) -> dict:
    """A deep copy of a preset (callers may edit it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
