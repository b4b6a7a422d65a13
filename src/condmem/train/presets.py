"""Named sizes for `condmem demo`, `condmem train` and `condmem study`: typed presets.

* ``cpu``: the default on a machine without a GPU; baseline + Engram in <= 10 minutes on
  2 cores (measured numbers in the README).
* ``gpu``: the default with CUDA; a ~40M-parameter backbone with tens of millions of table
  rows, trained on the standard library plus every installed package's Python source
  (hundreds of MB where PyTorch is installed): one pass or less at the default steps.
* ``tiny``: seconds; for tests and smoke runs.

The Engram layer sits in the second block (index 1), reads 2- and 3-grams with a
ShortConv, hc_mult 1. Its ``wkv`` GEMM and conv cost FLOPs that the baseline spends
on a wider MLP in the same block (`iso_flop_baseline`).

A `Preset` is four typed sections (model, engram, train, data). `Preset.override` is the
one place where a command's options replace preset values: `condmem demo`, `condmem
train` and `condmem study` all pass their options through it. Config files (TOML or JSON)
hold the same sections: `read_config_file` parses one, `section_fields` checks a section's
keys and `validate_preset` every value, each error naming the key (``model.dim``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from condmem.config import ConfigError
from condmem.models.config import MoEConfig
from condmem.train.loop import TrainConfig


@dataclass
class ModelPreset:
    """The backbone's geometry (the vocabulary size comes from the tokenizer)."""

    dim: int
    """Width D of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Query heads (head width dim / n_heads)."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    ffn_hidden: int
    """SwiGLU hidden width of each block; in a block with routed experts, the shared expert's (0: none)."""
    max_seq_len: int
    """Longest sequence (RoPE table)."""
    moe: MoEConfig | None = None
    """Routed experts in some or every block (None: a dense backbone)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)


@dataclass
class EngramPreset:
    """The Engram layers of the Engram model (the baseline has none)."""

    layer_ids: list[int]
    """Blocks holding an Engram."""
    max_ngram_size: int
    """N: orders 2..N are hashed."""
    n_heads: int
    """Hash heads per order."""
    head_dim: int
    """Width of one table row."""
    table_size: int
    """Bucket range per (order, head); each head's range is the next unused prime above it."""
    short_conv: bool = True
    """The ShortConv branch."""
    table_init_std: float = 0.02
    """Standard deviation of the initial table rows."""


@dataclass
class DataPreset:
    """What `prepare_data` reads and how it tokenizes."""

    corpus: str | list[str] | None
    """'stdlib', 'python', or paths (see `load_corpus`)."""
    vocab_size: int
    """Ids of the byte-level BPE trained on the training split."""
    max_train_bytes: int | None = None
    """Encode at most this much of the training split (None: all)."""
    tokenizer_train_bytes: int | None = None
    """Train the BPE on a sample of this size."""
    max_corpus_bytes: int | None = None
    """Read at most this much corpus text (None: all)."""
    max_val_tokens: int | None = None
    """Keep at most this many deduplicated validation tokens (None: the whole split)."""


def _merged(current, values: dict[str, Any], where: str):
    """`current` (a config dataclass, or None) with `values` replaced; None: built from `values`."""
    if current is not None:
        return dataclasses.replace(current, **values)
    if where == "model.moe":
        if "n_experts" not in values:
            raise ConfigError("model.moe.n_experts (--experts) is needed to give a dense preset routed experts")
        return MoEConfig(**values)
    raise ConfigError(f"{where} is not a section of fields")


SECTIONS = {"model": ModelPreset, "engram": EngramPreset, "train": TrainConfig, "data": DataPreset}
"""A preset's sections, as a config file holds them (``model.moe`` a table inside ``model``)."""


@dataclass
class Preset:
    """One named size: model, Engram, training and data settings."""

    name: str
    """The preset's name (``cpu``, ``gpu``, ``tiny``)."""
    model: ModelPreset
    engram: EngramPreset
    train: TrainConfig
    """Training settings (``seed`` is set per run)."""
    data: DataPreset

    def override(self, values: dict[str, dict[str, Any]] | None = None, **sections: dict[str, Any] | None) -> Preset:
        """A copy with some values replaced: ``override(train={"steps": 6}, data={"vocab_size": 320})``.

        Values that are None are skipped (an option the user did not give). An unknown
        section or field is a `ConfigError` naming it. A ``train.seq_len`` longer than
        ``model.max_seq_len`` raises the latter to it (the RoPE table must cover a sequence),
        unless ``model.max_seq_len`` is given too.
        """
        merged: dict[str, dict[str, Any]] = {}
        for source in (values or {}, sections):
            for section, fields in source.items():
                if fields:
                    merged.setdefault(section, {}).update(fields)
        parts = {name: copy.deepcopy(getattr(self, name)) for name in SECTIONS}
        for section, fields in merged.items():
            if section not in SECTIONS:
                raise ConfigError(f"unknown preset section {section!r}; choose one of {sorted(SECTIONS)}")
            known = {f.name for f in dataclasses.fields(SECTIONS[section])}
            given = {k: v for k, v in fields.items() if v is not None}
            unknown = sorted(set(given) - known)
            if unknown:
                raise ConfigError(f"unknown preset field(s) {', '.join(f'{section}.{k}' for k in unknown)}")
            for key, value in given.items():
                if isinstance(value, dict):  # a nested section (model.moe): merged field by field
                    given[key] = _merged(getattr(parts[section], key), value, f"{section}.{key}")
            parts[section] = dataclasses.replace(parts[section], **given)
        seq_len, max_seq_len = parts["train"].seq_len, parts["model"].max_seq_len
        explicit = merged.get("model", {}).get("max_seq_len") is not None
        if isinstance(max_seq_len, int) and seq_len > max_seq_len and not explicit:  # a bad type: validate_preset
            parts["model"] = dataclasses.replace(parts["model"], max_seq_len=seq_len)
        return Preset(self.name, **parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        "cpu",
        ModelPreset(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=256),
        EngramPreset(layer_ids=[1], max_ngram_size=3, n_heads=4, head_dim=16, table_size=20_000),
        TrainConfig(
            steps=240,
            batch_size=16,
            seq_len=256,
            lr=3e-3,
            warmup_steps=24,
            eval_tokens=32_768,
            eval_every=60,
            log_every=1,
        ),
        DataPreset(corpus="stdlib", vocab_size=4096, max_train_bytes=12_000_000, tokenizer_train_bytes=6_000_000),
    ),
    "gpu": Preset(
        "gpu",
        ModelPreset(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1408, max_seq_len=512),
        EngramPreset(layer_ids=[1], max_ngram_size=3, n_heads=8, head_dim=32, table_size=2_000_000),
        TrainConfig(
            steps=1000,
            batch_size=64,
            seq_len=512,
            lr=2e-3,
            warmup_steps=100,
            eval_tokens=262_144,
            eval_every=200,
            eval_batch_size=32,
            log_every=50,
        ),
        DataPreset(
            corpus="python",
            vocab_size=8192,
            max_train_bytes=250_000_000,
            max_corpus_bytes=1_500_000_000,
            tokenizer_train_bytes=20_000_000,
        ),
    ),
    "tiny": Preset(
        "tiny",
        ModelPreset(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=64),
        EngramPreset(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=500),
        TrainConfig(
            steps=8, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_tokens=512, eval_every=0, log_every=1
        ),
        DataPreset(corpus="stdlib", vocab_size=320, max_train_bytes=None, tokenizer_train_bytes=2_000_000),
    ),
}


def get_preset(name: str, overrides: dict[str, dict[str, Any]] | None = None) -> Preset:
    """The preset `name` with `overrides` applied (`Preset.override`); presets are never modified."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].override(overrides)


def default_preset_name(device_type: str) -> str:
    """``gpu`` on CUDA, else ``cpu``."""
    return "gpu" if device_type == "cuda" else "cpu"


def nested(values: dict[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Dotted keys as nested tables: ``{"train.lr": 1e-3, "seed": 1}`` -> ``{"train": {"lr": 1e-3}, "seed": 1}``
    (merged into a copy of `into`); None values are left out (an option not given)."""
    out = copy.deepcopy(into) if into is not None else {}
    for key, value in values.items():
        if value is None:
            continue
        *parents, leaf = key.split(".")
        if not leaf or not all(parents):
            raise ConfigError(f"{key!r} is not a key (section.key, or a top-level key)")
        target = out
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        target[leaf] = value
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The keys of a TOML (``.toml``) or JSON (``.json``) file; `ConfigError` naming the file when it does not parse."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ConfigError(f"{path}: not valid {kind}: {exc}") from None


def section_fields(section: str, values: Any, refused: dict[str, str] | None = None) -> dict[str, Any]:
    """`values` of a config file's `section` (``model``, ``engram``, ``train``, ``data``), keys checked:
    a key the section's dataclass lacks (``model.moe``'s included) or one of `refused` (key -> where it
    is set instead) is a `ConfigError` naming ``section.key``. Returns a copy (``model.moe`` a dict)."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}]; choose from {', '.join(SECTIONS)}")
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
    for key in refused or {}:
        if key in values:
            raise ConfigError(f"{section}.{key} is set by {refused[key]}")
    known = {f.name for f in dataclasses.fields(SECTIONS[section])} - set(refused or {})
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}")
    values = dict(values)
    if section == "model" and values.get("moe") is not None:
        moe = values["moe"]
        if not isinstance(moe, dict):
            raise ConfigError("model.moe must be a table of keys")
        bad = sorted(set(moe) - {f.name for f in dataclasses.fields(MoEConfig)})
        if bad:
            raise ConfigError(f"unknown key(s) {', '.join(f'model.moe.{k}' for k in bad)}")
        values["moe"] = dict(moe)
    return values


KEY_NAMES = {"TrainConfig.": "train.", "MoEConfig.": "model.moe."}
"""The classes' names in their `ConfigError` messages, and the config file's keys for them."""


def renamed_errors(build):
    """`build()`, its `ConfigError` messages naming the file's keys (``model.moe.top_k``), not the classes."""
    try:
        return build()
    except ConfigError as exc:
        message = str(exc)
        for cls, key in KEY_NAMES.items():
            message = message.replace(cls, key)
        raise ConfigError(message) from None


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """`ConfigError` naming the key unless `value` is an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be {bound}, got {value}")


def check_number(name: str, value: Any, *, positive: bool = True) -> None:
    """`ConfigError` naming the key unless `value` is a finite number (positive, with `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")


def validate_preset(p: Preset) -> None:
    """Every value of `p`'s model, engram and data sections (its train section validates itself):
    `ConfigError` naming the key (``model.dim``, ``engram.layer_ids[]``) of the first bad one."""
    m, e, d = p.model, p.engram, p.data
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
        check_int(f"model.{key}", getattr(m, key), 1)
    widths = m.ffn_hidden if isinstance(m.ffn_hidden, list) else [m.ffn_hidden]
    for width in widths:
        check_int("model.ffn_hidden", width, 0)
    if not isinstance(e.layer_ids, list) or not e.layer_ids:
        raise ConfigError(f"engram.layer_ids must be a non-empty list of block indices, got {e.layer_ids!r}")
    for lid in e.layer_ids:
        check_int("engram.layer_ids[]", lid, 0, m.n_layers - 1)
    check_int("engram.max_ngram_size", e.max_ngram_size, 2)
    check_int("engram.n_heads", e.n_heads, 1)
    check_int("engram.head_dim", e.head_dim, 1)
    check_int("engram.table_size", e.table_size, 2)
    check_number("engram.table_init_std", e.table_init_std)
    if not isinstance(e.short_conv, bool):
        raise ConfigError(f"engram.short_conv must be true or false, got {e.short_conv!r}")
    corpus = d.corpus
    if not (corpus is None or isinstance(corpus, str) or (isinstance(corpus, list) and corpus)):
        raise ConfigError(f"data.corpus must be a string or a non-empty list of paths, got {corpus!r}")
    if isinstance(corpus, list) and not all(isinstance(c, str) and c for c in corpus):
        raise ConfigError(f"data.corpus must list paths as strings, got {corpus!r}")
    check_int("data.vocab_size", d.vocab_size, 257)
    for key in ("max_train_bytes", "tokenizer_train_bytes", "max_corpus_bytes"):
        if getattr(d, key) is not None:
            check_int(f"data.{key}", getattr(d, key), 1)
    if d.max_val_tokens is not None:
        check_int("data.max_val_tokens", d.max_val_tokens, 2)
