"""`EngramConfig`: the geometry of a model's Engram layers, validated, in three dialects.

One typed dataclass says everything that decides row ids (layer ids, n-gram orders,
heads, table sizes, pad id, seed, compressed vocab size) and everything the module
needs (hidden size, branches, head width, short conv). It reads and writes:

* ``native``: this dataclass's own field names;
* ``v4``: the DeepSeek-V4.1 Hugging Face config keys (``engram_layer_ids``,
  ``engram_num_embeddings``, ...), so a released ``config.json`` loads as is, whether
  its keys sit at the top level or under ``text_config`` (or a key the caller names);
* ``demo``: the keys of DeepSeek's official ``engram_demo_v1.py`` (per-order
  ``engram_vocab_size`` list, ``n_embed_per_ngram``, ``n_head_per_ngram``, ...).

Backbone dimensions (``hidden_size``, ``hc_mult``, ``rms_norm_eps``) are None where a
source does not state them (the V4.1 preset, a V4.1 config without them): they come
from the checkpoint, and building a module without them is an error.

Validation errors are `ConfigError` and name the offending field. Every size has a
bound (`LIMITS`) that keeps row ids far below 2**63 and the prime search and hashing
finite; booleans must be JSON booleans; an unknown key of the Engram section is an
error naming it. Files are read as UTF-8 JSON without duplicate keys or NaN/Infinity,
and every way a file can be unreadable is a `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("condmem")

Dialect = Literal["native", "v4", "demo"]
NESTED_KEYS: tuple[str, ...] = ("text_config",)
"""Where multimodal-style configs nest the language model's keys (searched when the top level has none)."""


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or inconsistent with another."""


class _UnstatedPadId(int):
    """The pad id a config gets when its source states none: 2 (the official demo's default), marked
    as not stated so that a caller holding the tokenizer (`add_engram`) takes the tokenizer's own."""

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self):
        return (_UnstatedPadId, (int(self),))


DEFAULT_PAD_ID = _UnstatedPadId(2)
"""`EngramConfig.pad_id` when not stated: id 2, with `EngramConfig.pad_id_stated` False."""


LIMITS: dict[str, int] = {
    "layer_ids": 1024,  # Engram layers per model
    "layer_id": 100_000,
    "max_ngram_size": 32,  # V4.1 uses 4; hashing is linear in N
    "n_heads": 256,  # V4.1 uses 8; the prime search draws (N-1) x heads primes per layer
    "head_dim": 65_536,
    "table_size": 2**40,  # rows per head range: 2^40 x 264 B is 290 TB, past any host
    "hidden_size": 2**20,
    "hc_mult": 64,
    "kernel_size": 64,
    "pad_id": 2**31 - 1,
    "seed": 2**32 - 1,
    "compressed_vocab_size": 2**31 - 1,
    "num_embeddings": 2**56,
    "columns": 2**20,  # layers x (N-1) x heads: row ids per token; the layout searches one prime each
}
"""Upper bounds of each size. Rows per layer are at most (N-1) x heads x table_size plus the
prime gaps: < 31 x 256 x 2^40 x 1.001 < 2^54, so row ids stay below 2^63 with a margin of 2^9."""
MAX_CONFIG_BYTES = 16 * 2**20


def require_int(owner: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """Raise `ConfigError` naming ``owner.name`` unless `value` is an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{owner}.{name} must be <= {maximum:,}, got {value:,}")


def require_bool(owner: str, name: str, value: Any) -> bool:
    """`value` when it is a real boolean (JSON true/false), else `ConfigError` naming ``owner.name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be true or false, got {value!r}")
    return value


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
    pad_id: int = DEFAULT_PAD_ID
    """Token id whose compressed id stands in for look-backs before a sequence start. Not stated:
    2, and `add_engram` takes the tokenizer's pad token instead (refusing a tokenizer without one)."""
    seed: int = 0
    """Seed of the per-layer hash multipliers (0 in all released models)."""
    hidden_size: int | None = 1024
    """Width D of the residual stream the module reads and writes (None: not known yet; a
    checkpoint supplies it)."""
    hc_mult: int | None = 1
    """Residual branches (hyper-connection copies); 1 is an ordinary residual stream (None:
    not known yet)."""
    kernel_size: int = 4
    """ShortConv kernel width (dilation is max_ngram_size)."""
    short_conv: bool = True
    """Add the causal depthwise ShortConv branch (paper, demo); V4.1 has none."""
    compressed_vocab_size: int | None = None
    """V', the compressed tokenizer's size; enters every hash multiplier. None until known."""
    num_embeddings: list[int] | None = None
    """Rows per layer as a checkpoint states them; checked against the primes when given."""
    rms_norm_eps: float | None = 1e-6
    """Epsilon of the module's RMSNorms (None: not known yet)."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the field when a value is out of its domain."""
        self._validate_layer_ids()
        self._need_int("max_ngram_size", self.max_ngram_size, 2)
        self._need_int("n_heads", self.n_heads, 1)
        self._need_int("head_dim", self.head_dim, 1)
        if self.pad_id is None:
            raise ConfigError(
                "EngramConfig.pad_id is None: pass a token id of the model's tokenizer, its pad token "
                "(tokenizer.pad_token_id), or for a tokenizer without one (GPT-2's) its EOS (tokenizer.eos_token_id). "
                "Engram hashes it in place of the tokens before a sequence's start"
            )
        self._need_int("pad_id", self.pad_id, 0)
        self._need_int("seed", self.seed, 0)
        if self.hidden_size is not None:
            self._need_int("hidden_size", self.hidden_size, 1)
        if self.hc_mult is not None:
            self._need_int("hc_mult", self.hc_mult, 1)
        self._need_int("kernel_size", self.kernel_size, 1)
        columns = len(self.layer_ids) * (self.max_ngram_size - 1) * self.n_heads
        if columns > LIMITS["columns"]:
            raise ConfigError(
                f"EngramConfig: {len(self.layer_ids)} layer_ids x {self.max_ngram_size - 1} orders x {self.n_heads} "
                f"n_heads = {columns:,} hash columns, at most {LIMITS['columns']:,}: each is one row read per token "
                "and one prime the layout draws"
            )
        if not isinstance(self.short_conv, bool):
            raise ConfigError(f"EngramConfig.short_conv must be a bool, got {self.short_conv!r}")
        self._validate_table_size()
        if self.compressed_vocab_size is not None:
            self._need_int("compressed_vocab_size", self.compressed_vocab_size, 1)
        if self.num_embeddings is not None:
            self._validate_num_embeddings()
        if self.rms_norm_eps is not None and not (
            isinstance(self.rms_norm_eps, (int, float))
            and not isinstance(self.rms_norm_eps, bool)
            and math.isfinite(self.rms_norm_eps)
            and 0 < self.rms_norm_eps < 1
        ):
            raise ConfigError(f"EngramConfig.rms_norm_eps must be a finite float in (0, 1), got {self.rms_norm_eps!r}")

    @staticmethod
    def _need_int(name: str, value: Any, minimum: int) -> None:
        """`require_int` for a field of this class, bounded by its `LIMITS` entry (``name[]``: each item's)."""
        require_int("EngramConfig", name, value, minimum, LIMITS.get(name.rstrip("[]")))

    def _validate_layer_ids(self) -> None:
        """`layer_ids`: a non-empty list (made one here) of distinct layer numbers, within `LIMITS`."""
        if isinstance(self.layer_ids, (str, bytes)) or not hasattr(self.layer_ids, "__iter__"):
            raise ConfigError(f"EngramConfig.layer_ids must be a list of ints, got {self.layer_ids!r}")
        self.layer_ids = list(self.layer_ids)
        if not self.layer_ids:
            raise ConfigError("EngramConfig.layer_ids is empty: at least one Engram layer is needed")
        if len(self.layer_ids) > LIMITS["layer_ids"]:
            raise ConfigError(
                f"EngramConfig.layer_ids has {len(self.layer_ids)} entries, at most {LIMITS['layer_ids']}"
            )
        for lid in self.layer_ids:
            require_int("EngramConfig", "layer_ids[]", lid, 0, LIMITS["layer_id"])
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"EngramConfig.layer_ids has duplicates: {self.layer_ids}")

    def _validate_table_size(self) -> None:
        """`table_size`: one int for every order, or a list (made one here) of one per order 2..N."""
        if isinstance(self.table_size, (list, tuple)):
            self.table_size = list(self.table_size)
            if len(self.table_size) > LIMITS["max_ngram_size"]:
                raise ConfigError(
                    f"EngramConfig.table_size has {len(self.table_size)} entries, at most "
                    f"{LIMITS['max_ngram_size'] - 1}"
                )
            if len(self.table_size) != self.max_ngram_size - 1:
                raise ConfigError(
                    f"EngramConfig.table_size has {len(self.table_size)} entries but max_ngram_size="
                    f"{self.max_ngram_size} needs one per order 2..{self.max_ngram_size} "
                    f"({self.max_ngram_size - 1} entries)"
                )
            for size in self.table_size:
                self._need_int("table_size[]", size, 2)
        else:
            self._need_int("table_size", self.table_size, 2)

    def _validate_num_embeddings(self) -> None:
        """`num_embeddings` (when given): a list (made one here) of one row count per layer id."""
        if isinstance(self.num_embeddings, (str, bytes, dict)) or not hasattr(self.num_embeddings, "__iter__"):
            raise ConfigError(f"EngramConfig.num_embeddings must be a list of ints, got {self.num_embeddings!r}")
        self.num_embeddings = list(self.num_embeddings)
        if len(self.num_embeddings) != len(self.layer_ids):
            raise ConfigError(
                f"EngramConfig.num_embeddings has {len(self.num_embeddings)} entries for "
                f"{len(self.layer_ids)} layer_ids {self.layer_ids}"
            )
        for n in self.num_embeddings:
            self._need_int("num_embeddings[]", n, 1)

    def check_pad_id(self, vocab_size: int, pad_token_id: int | None = None, tokenizer: str = "the tokenizer") -> None:
        """Check `pad_id` against a tokenizer of `vocab_size` ids whose pad token is `pad_token_id` (None: none).

        An id the tokenizer does not have is a `ConfigError`. One that is not the tokenizer's
        pad token is logged as a warning: it hashes (any id can fill the look-back before a
        sequence's start), but it is likely the default (2) left by mistake, and a released
        or saved model must be served with the pad id it was trained with.
        """
        hint = (
            f"pass pad_id={pad_token_id} (its pad token)"
            if pad_token_id is not None
            else "pass pad_id=<its pad token id> (or its EOS id when it has no pad token)"
        )
        if not 0 <= self.pad_id < vocab_size:
            raise ConfigError(
                f"EngramConfig.pad_id {self.pad_id} is not a token id of {tokenizer} (0..{vocab_size - 1}): {hint}"
            )
        if pad_token_id is not None and pad_token_id != self.pad_id:
            log.warning(
                "EngramConfig.pad_id is %d but %s's pad token is id %d: Engram reads the pad id in place of "
                "the tokens before a sequence's start; %s, unless %d is meant",
                self.pad_id,
                tokenizer,
                pad_token_id,
                hint,
                self.pad_id,
            )

    @property
    def pad_id_stated(self) -> bool:
        """Whether `pad_id` was given (by the caller or the config's source), not left at its default."""
        return not isinstance(self.pad_id, _UnstatedPadId)

    def require_backbone(self, what: str = "an Engram module") -> None:
        """Raise `ConfigError` naming every backbone field that is still None (unknown)."""
        missing = [n for n in ("hidden_size", "hc_mult", "rms_norm_eps") if getattr(self, n) is None]
        if missing:
            raise ConfigError(
                f"{what} needs EngramConfig.{', '.join(missing)}, which this config does not state: take them "
                "from the checkpoint (Engram.from_released reads its config.json) or set them with config.replace()"
            )

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
    def from_dict(cls, data: dict[str, Any], dialect: Dialect | None = None, key: str | None = None) -> "EngramConfig":
        """Build from a dict in any dialect (detected from its keys when not given).

        A full Hugging Face ``config.json`` is accepted as is: unrelated keys are ignored, and
        the Engram keys are found at the top level or under ``text_config`` (or under `key`,
        when given; see `engram_section`).
        """
        data = engram_section(data, key)
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
        unknown = sorted(k for k in d if isinstance(k, str) and k.startswith("engram_") and k not in V4_KEYS)
        if unknown:
            raise ConfigError(f"unknown V4.1 Engram key(s) {unknown}; known: {sorted(V4_KEYS)}")

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
            pad_id=get("engram_pad_token_id", DEFAULT_PAD_ID),
            seed=get("engram_seed", 0),
            # Backbone dims: what the file states, else unknown (a checkpoint's tensors supply them).
            hidden_size=get("hidden_size", None),
            hc_mult=get("hc_mult", None),
            kernel_size=get("engram_kernel_size", 4),
            short_conv=require_bool("config", "engram_short_conv", get("engram_short_conv", False)),
            compressed_vocab_size=get("engram_compressed_vocab_size", None),
            num_embeddings=get("engram_num_embeddings", None),
            rms_norm_eps=get("rms_norm_eps", None),
        )

    @classmethod
    def _from_demo(cls, d: dict[str, Any]) -> "EngramConfig":
        for key in ("engram_vocab_size", "max_ngram_size", "n_embed_per_ngram", "n_head_per_ngram", "layer_ids"):
            if key not in d:
                raise ConfigError(f"demo-dialect config lacks '{key}'")
        unknown = sorted(str(k) for k in d if k not in DEMO_KEYS)
        if unknown:
            raise ConfigError(f"unknown demo-dialect key(s) {unknown}; known: {sorted(DEMO_KEYS)}")
        n_embed, n_head = d["n_embed_per_ngram"], d["n_head_per_ngram"]
        if isinstance(n_embed, bool) or not isinstance(n_embed, int):
            raise ConfigError(f"n_embed_per_ngram must be an int, got {n_embed!r}")
        if not isinstance(n_head, int) or isinstance(n_head, bool) or n_head < 1 or n_embed % n_head:
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
            pad_id=d.get("pad_id", DEFAULT_PAD_ID),
            seed=d.get("seed", 0),
            hidden_size=d.get("hidden_size", 1024),
            hc_mult=d.get("hc_mult", 1),
            kernel_size=d.get("kernel_size", 4),
            short_conv=require_bool("config", "short_conv", d.get("short_conv", True)),
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
            }
            for name in ("hidden_size", "hc_mult", "rms_norm_eps"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
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
    def load(cls, path: str | os.PathLike, dialect: Dialect | None = None, key: str | None = None) -> "EngramConfig":
        """Read a JSON file in any dialect (a Hugging Face ``config.json`` included, flat or
        nested under ``text_config`` or `key`); a directory means its ``config.json``."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        data = read_json_file(path, "config")
        try:
            return cls.from_dict(data, dialect, key)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def save(self, path: str | os.PathLike, dialect: Dialect = "native") -> None:
        """Write the config as JSON, atomically (temp file + rename)."""
        from condmem.utils.atomic import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(dialect), indent=2) + "\n")

    # ------------------------------------------------------------------ presets
    @classmethod
    def deepseek_v41_flash(cls) -> "EngramConfig":
        """The Engram geometry of the released DeepSeek-V4.1-Flash checkpoint.

        Only what published oracles verify: layer ids, orders, heads, head width, table
        size, pad id, seed, no ShortConv, V' = 99,092 and the row counts (the sums of each
        layer's primes). The backbone dims (`hidden_size`, `hc_mult`, `rms_norm_eps`) are
        None: read them from the checkpoint (`Engram.from_released`).
        """
        return cls(
            layer_ids=[1, 14],
            max_ngram_size=4,
            n_heads=8,
            head_dim=256,
            table_size=16_000_000,
            pad_id=2,
            seed=0,
            hidden_size=None,
            hc_mult=None,
            rms_norm_eps=None,
            short_conv=False,
            compressed_vocab_size=99_092,
            num_embeddings=[384_006_168, 384_016_682],
        )


def read_json_file(path: Path, what: str = "config") -> Any:
    """Parse a JSON file strictly: a regular file of at most 16 MiB, UTF-8, no duplicate keys, no NaN /
    Infinity, not nested past Python's recursion limit. Any failure is a `ConfigError` naming the file."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} file {path} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{what} file {path} has {st.st_size / 2**20:.1f} MiB, more than a config's "
                f"{MAX_CONFIG_BYTES // 2**20} MiB"
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{what} file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} file {path} is not UTF-8 text ({exc})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} file {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} file {path} is nested too deeply to be a config") from None
    except ConfigError as exc:
        raise ConfigError(f"{what} file {path}: {exc}") from None
    except ValueError as exc:  # e.g. an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"{what} file {path} holds a number too long to read ({exc})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise ConfigError(f"duplicate key {k!r}: which value was meant is unclear")
        seen[k] = v
    return seen


def _no_constants(name: str) -> Any:
    raise ConfigError(f"{name} is not a number a config may hold")


V4_KEYS = frozenset(
    {
        "engram_layer_ids",
        "engram_max_ngram_size",
        "engram_n_heads",
        "engram_head_dim",
        "engram_vocab_size",
        "engram_pad_token_id",
        "engram_seed",
        "engram_kernel_size",
        "engram_short_conv",
        "engram_compressed_vocab_size",
        "engram_num_embeddings",
    }
)
"""The V4.1 Engram keys this reader knows; another ``engram_*`` key is a misspelling or a newer format."""
DEMO_KEYS = frozenset(
    {
        "engram_vocab_size",
        "max_ngram_size",
        "n_embed_per_ngram",
        "n_head_per_ngram",
        "layer_ids",
        "pad_id",
        "seed",
        "kernel_size",
        "hidden_size",
        "hc_mult",
        "short_conv",
        "rms_norm_eps",
        "compressed_vocab_size",
        "num_embeddings",
        "tokenizer_name_or_path",
        "vocab_size",
        "num_layers",
    }
)
"""Keys of the official demo's EngramConfig and BackBoneConfig, plus the ones condmem writes."""


class _Missing:
    pass


_MISSING = _Missing()


def _has_engram_keys(data: Any) -> bool:
    return isinstance(data, dict) and any(
        k in data for k in ("engram_layer_ids", "n_head_per_ngram", "n_embed_per_ngram", "layer_ids")
    )


def engram_section(data: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """The dict that holds the Engram keys: `data` itself, or a nested section of it.

    With `key`, ``data[key]`` must be that section. Without, the top level is used when it
    holds Engram keys, else the first of `NESTED_KEYS` that does. A nested section
    inherits the top level's ``hidden_size`` / ``hc_mult`` / ``rms_norm_eps`` where it lacks
    its own. Raises `ConfigError` when no section holds Engram keys.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"an Engram config must be a JSON object, got {type(data).__name__}")
    if key is not None:
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"no section {key!r} in the config (top-level keys: {sorted(data)[:12]})")
        section = data[key]
        if not _has_engram_keys(section):
            raise ConfigError(f"section {key!r} holds no Engram keys (engram_layer_ids, n_head_per_ngram or layer_ids)")
    elif _has_engram_keys(data) or not any(_has_engram_keys(data.get(k)) for k in NESTED_KEYS):
        return data
    else:
        section = next(data[k] for k in NESTED_KEYS if _has_engram_keys(data.get(k)))
    merged = dict(section)
    for name in ("hidden_size", "hc_mult", "rms_norm_eps"):
        if name not in merged and name in data:
            merged[name] = data[name]
    return merged


def detect_dialect(data: dict[str, Any]) -> Dialect:
    """Which dialect a config dict is written in, judged by its keys."""
    if "engram_layer_ids" in data:
        return "v4"
    if "n_head_per_ngram" in data or "n_embed_per_ngram" in data:
        return "demo"
    if "layer_ids" in data:
        return "native"
    raise ConfigError(
        "no Engram keys found, at the top level or under "
        f"{', '.join(repr(k) for k in NESTED_KEYS)}: cannot tell the config dialect: expected 'engram_layer_ids' "
        "(DeepSeek-V4.1), 'n_head_per_ngram' (official demo) or 'layer_ids' (condmem); name the section holding "
        "them with key= (--config-key)"
    )
