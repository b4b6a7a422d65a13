"""`EngramConfig`: the geometry of a model's Engram layers, validated, in three dialects.

One typed dataclass says everything that decides row ids (layer ids, n-gram orders,
heads, table sizes, pad id, seed, compressed vocab size) and everything the module
needs (hidden size, branches, head width, short conv). It reads and writes:

* ``native``: this dataclass's own field names;
* ``v4``: the DeepSeek-V4.1 Hugging Face config keys (``engram_layer_ids``,
  ``engram_num_embeddings``, ...), so a released ``config.json`` loads as is;
* ``demo``: the keys of DeepSeek's official ``engram_demo_v1.py`` (per-order
  ``engram_vocab_size`` list, ``n_embed_per_ngram``, ``n_head_per_ngram``, ...).

Validation errors are `ConfigError` and name the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Dialect = Literal["native", "v4", "demo"]


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or inconsistent with another."""


def require_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """Raise `ConfigError` naming ``owner.name`` unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass
class EngramConfig:
    """Geometry of every Engram layer of one model."""

    layer_ids: list[int]
    """Transformer layers that hold an Engram module, in the order their tables are laid out."""
    max_ngram_size: int = 3
    """N: n-gram orders 2..N are hashed at every position."""
    n_heads: int = 8
    """Hash heads per n-gram order (each head owns a prime-sized bucket range)."""
    head_dim: int = 64
    """Width of one table row (one head's embedding); the module reads (N-1)*n_heads rows."""
    table_size: int | list[int] = 16_000
    """Bucket-range size per order (one int for all orders, or a list for orders 2..N).
    Each head's range is the next unused prime above it."""
    pad_id: int = 2
    """Token id whose compressed id stands in for look-backs before a sequence start."""
    seed: int = 0
    """Seed of the per-layer hash multipliers (0 in all released models)."""
    hidden_size: int = 1024
    """Width D of the residual stream the module reads and writes."""
    hc_mult: int = 1
    """Residual branches (hyper-connection copies); 1 is an ordinary residual stream."""
    kernel_size: int = 4
    """ShortConv kernel width (dilation is max_ngram_size)."""
    short_conv: bool = True
    """Add the causal depthwise ShortConv branch (paper, demo); V4.1 has none."""
    compressed_vocab_size: int | None = None
    """V', the compressed tokenizer's size; enters every hash multiplier. None until known."""
    num_embeddings: list[int] | None = None
    """Rows per layer as a checkpoint states them; checked against the primes when given."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the module's RMSNorms."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the field when a value is out of its domain."""

        def need_int(name: str, value: Any, minimum: int) -> None:
            require_int("EngramConfig", name, value, minimum)

        if isinstance(self.layer_ids, (str, bytes)) or not hasattr(self.layer_ids, "__iter__"):
            raise ConfigError(f"EngramConfig.layer_ids must be a list of ints, got {self.layer_ids!r}")
        self.layer_ids = list(self.layer_ids)
        if not self.layer_ids:
            raise ConfigError("EngramConfig.layer_ids is empty: at least one Engram layer is needed")
        for lid in self.layer_ids:
            need_int("layer_ids[]", lid, 0)
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"EngramConfig.layer_ids has duplicates: {self.layer_ids}")
        need_int("max_ngram_size", self.max_ngram_size, 2)
        need_int("n_heads", self.n_heads, 1)
        need_int("head_dim", self.head_dim, 1)
        need_int("pad_id", self.pad_id, 0)
        need_int("seed", self.seed, 0)
        need_int("hidden_size", self.hidden_size, 1)
        need_int("hc_mult", self.hc_mult, 1)
        need_int("kernel_size", self.kernel_size, 1)
        if not isinstance(self.short_conv, bool):
            raise ConfigError(f"EngramConfig.short_conv must be a bool, got {self.short_conv!r}")
        if isinstance(self.table_size, (list, tuple)):
            self.table_size = list(self.table_size)
            if len(self.table_size) != self.max_ngram_size - 1:
                raise ConfigError(
                    f"EngramConfig.table_size has {len(self.table_size)} entries but max_ngram_size="
                    f"{self.max_ngram_size} needs one per order 2..{self.max_ngram_size} "
                    f"({self.max_ngram_size - 1} entries)"
                )
            for size in self.table_size:
                need_int("table_size[]", size, 2)
        else:
            need_int("table_size", self.table_size, 2)
        if self.compressed_vocab_size is not None:
            need_int("compressed_vocab_size", self.compressed_vocab_size, 1)
        if self.num_embeddings is not None:
            self.num_embeddings = list(self.num_embeddings)
            if len(self.num_embeddings) != len(self.layer_ids):
                raise ConfigError(
                    f"EngramConfig.num_embeddings has {len(self.num_embeddings)} entries for "
                    f"{len(self.layer_ids)} layer_ids {self.layer_ids}"
                )
            for n in self.num_embeddings:
                need_int("num_embeddings[]", n, 1)
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ConfigError(f"EngramConfig.rms_norm_eps must be a positive float, got {self.rms_norm_eps!r}")

    # ------------------------------------------------------------------ derived
    @property
    def n_cols(self) -> int:
        """Rows read per position and layer: (N-1) orders x n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def table_sizes(self) -> list[int]:
        """Table size per order 2..N (the int form expanded)."""
        if isinstance(self.table_size, list):
            return list(self.table_size)
        return [self.table_size] * (self.max_ngram_size - 1)

    @property
    def engram_dim(self) -> int:
        """Width of one position's concatenated lookup: n_cols x head_dim."""
        return self.n_cols * self.head_dim

    def replace(self, **changes: Any) -> "EngramConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ dialects
    @classmethod
    def from_dict(cls, data: dict[str, Any], dialect: Dialect | None = None) -> "EngramConfig":
        """Build from a dict in any dialect (detected from its keys when not given).

        A full Hugging Face ``config.json`` is accepted as is: unrelated keys are ignored.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"an Engram config must be a JSON object, got {type(data).__name__}")
        dialect = dialect or detect_dialect(data)
        if dialect == "v4":
            return cls._from_v4(data)
        if dialect == "demo":
            return cls._from_demo(data)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown EngramConfig field(s) {unknown}; known: {sorted(names)}")
        if "layer_ids" not in data:
            raise ConfigError("EngramConfig.layer_ids is missing")
        return cls(**data)

    @classmethod
    def _from_v4(cls, d: dict[str, Any]) -> "EngramConfig":
        def get(key: str, default: Any = _MISSING) -> Any:
            if key in d:
                return d[key]
            if default is _MISSING:
                raise ConfigError(f"V4.1 config lacks '{key}'")
            return default

        return cls(
            layer_ids=get("engram_layer_ids"),
            max_ngram_size=get("engram_max_ngram_size"),
            n_heads=get("engram_n_heads"),
            head_dim=get("engram_head_dim"),
            table_size=get("engram_vocab_size"),
            pad_id=get("engram_pad_token_id", 2),
            seed=get("engram_seed", 0),
            hidden_size=get("hidden_size", 1024),
            hc_mult=get("hc_mult", 1),
            kernel_size=get("engram_kernel_size", 4),
            short_conv=bool(get("engram_short_conv", False)),
            compressed_vocab_size=get("engram_compressed_vocab_size", None),
            num_embeddings=get("engram_num_embeddings", None),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
        )

    @classmethod
    def _from_demo(cls, d: dict[str, Any]) -> "EngramConfig":
        for key in ("engram_vocab_size", "max_ngram_size", "n_embed_per_ngram", "n_head_per_ngram", "layer_ids"):
            if key not in d:
                raise ConfigError(f"demo-dialect config lacks '{key}'")
        n_embed, n_head = d["n_embed_per_ngram"], d["n_head_per_ngram"]
        if not isinstance(n_embed, int) or not isinstance(n_head, int) or n_head < 1 or n_embed % n_head:
            raise ConfigError(
                f"n_embed_per_ngram ({n_embed!r}) must be a multiple of n_head_per_ngram ({n_head!r}): "
                "each head's row is n_embed_per_ngram / n_head_per_ngram wide"
            )
        return cls(
            layer_ids=d["layer_ids"],
            max_ngram_size=d["max_ngram_size"],
            n_heads=n_head,
            head_dim=n_embed // n_head,
            table_size=d["engram_vocab_size"],
            pad_id=d.get("pad_id", 2),
            seed=d.get("seed", 0),
            hidden_size=d.get("hidden_size", 1024),
            hc_mult=d.get("hc_mult", 1),
            kernel_size=d.get("kernel_size", 4),
            short_conv=bool(d.get("short_conv", True)),
            compressed_vocab_size=d.get("compressed_vocab_size", None),
            num_embeddings=d.get("num_embeddings", None),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        )

    def to_dict(self, dialect: Dialect = "native") -> dict[str, Any]:
        """The config as a JSON-ready dict in the chosen dialect."""
        if dialect == "native":
            return dataclasses.asdict(self)
        if dialect == "v4":
            out: dict[str, Any] = {
                "engram_layer_ids": list(self.layer_ids),
                "engram_max_ngram_size": self.max_ngram_size,
                "engram_n_heads": self.n_heads,
                "engram_head_dim": self.head_dim,
                "engram_vocab_size": self.table_size,
                "engram_pad_token_id": self.pad_id,
                "hidden_size": self.hidden_size,
                "hc_mult": self.hc_mult,
                "rms_norm_eps": self.rms_norm_eps,
            }
            if self.seed:
                out["engram_seed"] = self.seed
            if self.short_conv:
                out["engram_short_conv"] = True
                out["engram_kernel_size"] = self.kernel_size
            if self.compressed_vocab_size is not None:
                out["engram_compressed_vocab_size"] = self.compressed_vocab_size
            if self.num_embeddings is not None:
                out["engram_num_embeddings"] = list(self.num_embeddings)
            return out
        if dialect == "demo":
            out = {
                "engram_vocab_size": self.table_sizes,
                "max_ngram_size": self.max_ngram_size,
                "n_embed_per_ngram": self.n_heads * self.head_dim,
                "n_head_per_ngram": self.n_heads,
                "layer_ids": list(self.layer_ids),
                "pad_id": self.pad_id,
                "seed": self.seed,
                "kernel_size": self.kernel_size,
                "hidden_size": self.hidden_size,
                "hc_mult": self.hc_mult,
                "short_conv": self.short_conv,
                "rms_norm_eps": self.rms_norm_eps,
            }
            if self.compressed_vocab_size is not None:
                out["compressed_vocab_size"] = self.compressed_vocab_size
            if self.num_embeddings is not None:
                out["num_embeddings"] = list(self.num_embeddings)
            return out
        raise ConfigError(f"unknown dialect {dialect!r}; choose native, v4 or demo")

    # ------------------------------------------------------------------ files
    @classmethod
    def load(cls, path: str | os.PathLike, dialect: Dialect | None = None) -> "EngramConfig":
        """Read a JSON file in any dialect (a Hugging Face ``config.json`` included)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, dialect)

    def save(self, path: str | os.PathLike, dialect: Dialect = "native") -> None:
        """Write the config as JSON, atomically (temp file + rename)."""
        from condmem.utils.atomic import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(dialect), indent=2) + "\n")

    # ------------------------------------------------------------------ presets
    @classmethod
    def deepseek_v41_flash(cls) -> "EngramConfig":
        """The Engram geometry of the released DeepSeek-V4.1-Flash checkpoint."""
        return cls(
            layer_ids=[1, 14],
            max_ngram_size=4,
            n_heads=8,
            head_dim=256,
            table_size=16_000_000,
            pad_id=2,
            seed=0,
            hidden_size=4096,
            hc_mult=4,
            short_conv=False,
            compressed_vocab_size=99_092,
            num_embeddings=[384_006_168, 384_016_682],
        )


class _Missing:
    pass


_MISSING = _Missing()


def detect_dialect(data: dict[str, Any]) -> Dialect:
    """Which dialect a config dict is written in, judged by its keys."""
    if "engram_layer_ids" in data:
        return "v4"
    if "n_head_per_ngram" in data or "n_embed_per_ngram" in data:
        return "demo"
    if "layer_ids" in data:
        return "native"
    raise ConfigError(
        "cannot tell the config dialect: expected 'engram_layer_ids' (DeepSeek-V4.1), "
        "'n_head_per_ngram' (official demo) or 'layer_ids' (condmem)"
    )
