"""Engram geometry for a model of a given width and a parameter or memory budget.

`size_engram(hidden_size, memory="10GB")` (or ``params="2B"``) chooses what an
`EngramConfig` needs besides the tokenizer's ids:

* **orders and heads**: the paper's defaults, n-gram orders 2..3 (``max_ngram_size=3``) and
  8 hash heads per order, so each token reads ``n_cols = 2 x 8 = 16`` rows a layer;
* **head width**: ``hidden_size / n_cols`` rounded to a multiple of 8 (bf16, fp32) or 32
  (fp8: one e8m0 scale per 32 values), so the row a token reads (``n_cols x head_dim``) is
  about as wide as the model, as in the official demo (16 x 64 = its hidden size 1024);
* **table size**: the largest per-head range whose layout (each head's range is the next
  unused prime above it, `condmem.layout`) fits the budget, counted with the layout's own
  rows and bytes.

It returns a `Sizing`: ``config`` is a dict for ``EngramConfig(**sizing.config, pad_id=...)``
(the pad id and V' come from the tokenizer), with the rows, parameters and bytes that layout
really has. ``condmem size`` prints the same. Bad input is a `SizingError` naming the
argument.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from condmem.config import LIMITS, ConfigError, EngramConfig, require_int
from condmem.utils.renamed import renamed_attribute

Tier = Literal["hbm", "host", "disk"]
TableDtype = Literal["bf16", "fp8", "fp32"]

TIERS: dict[str, str] = {
    "hbm": "GPU memory, beside the model's weights and KV cache",
    "host": "page-locked host memory (the GPU reads the rows it needs each step over PCIe)",
    "disk": "a table file on local disk (rows read with O_DIRECT, a DRAM cache in front)",
}
DTYPES: dict[str, str] = {
    "bf16": "2 B a value",
    "fp8": "1 B a value + one e8m0 scale byte per 32 values",
    "fp32": "4 B a value (a trained module's own table; Adam state is extra)",
}
PAPER_MAX_NGRAM_SIZE = 3
"""The paper's n-gram orders: 2 and 3."""
PAPER_N_HEADS = 8
"""The paper's hash heads per order."""
MIN_TABLE_SIZE = 1024
"""Fewest buckets per head range the helper proposes: below it nearly every n-gram collides."""

_BYTE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_BYTE_UNITS["TIB"] = 2**40
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)"


class SizingError(ConfigError):
    """A sizing request that cannot be met: the message names the argument and what would work."""


@dataclass(frozen=True)
class Sizing:
    """What `size_engram` chose, and what that layout really holds."""

    config: dict[str, Any]
    """Keyword arguments for `EngramConfig` (add ``pad_id`` and, when known, ``compressed_vocab_size``)."""
    tier: str
    dtype: str
    budget: dict[str, Any]
    """The budget asked for: ``{"memory_bytes": n}`` or ``{"params": n}``."""
    num_rows: list[int] = field(default_factory=list)
    """Rows of each Engram layer's table (the sums of its primes)."""
    params: int = 0
    """Table parameters over all layers (rows x head_dim)."""
    bytes: int = 0
    """Table bytes over all layers in `dtype`, as `EngramLayout.bytes_per_layer` counts them."""
    read_bytes_per_token: int = 0
    """Table bytes one token reads over all Engram layers (what the host tier moves per token)."""

    rows = renamed_attribute("Sizing", "rows", "num_rows")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (what ``condmem size --json`` prints; ``num_rows`` under
        ``rows``, the key under which `condmem inspect` reports a table's rows too)."""
        return {
            "config": dict(self.config),
            "tier": self.tier,
            "dtype": self.dtype,
            "budget": dict(self.budget),
            "rows": list(self.num_rows),
            "params": self.params,
            "bytes": self.bytes,
            "read_bytes_per_token": self.read_bytes_per_token,
        }


def parse_bytes(value: int | str, name: str = "memory") -> int:
    """Bytes from an int or a string with a unit: ``10GB`` (10**9), ``8GiB`` (2**30), ``512MiB``."""
    return _parse_quantity(
        value, name, r"([KMGT]i?B)", _BYTE_UNITS, "a size", "a number and a unit, e.g. 10GB (10^9 bytes) or "
        "8GiB (2^30 bytes)", "a number of bytes or a size like 10GB / 8GiB", "1 byte"
    )  # fmt: skip


def parse_count(value: int | str, name: str = "params") -> int:
    """A count from an int or a string: ``2000000000``, ``2e9``, ``2B`` / ``2G`` (billion), ``500M``, ``1.5T``."""
    return _parse_quantity(
        value, name, r"([KMGBT]?)", _COUNT_UNITS, "a count", "e.g. 2e9, 2B (billion) or 500M",
        "a count like 2e9, 2B or 500M", "1"
    )  # fmt: skip


def _parse_quantity(value, name: str, unit: str, units: dict, kind: str, how: str, like: str, least: str) -> int:
    """`parse_bytes` / `parse_count`: an int, or a number followed by one of `units` (regex `unit`)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SizingError(f"{name} must be {like}, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(_NUMBER + r"\s*" + unit, value.strip(), flags=re.IGNORECASE)
        if not m:
            raise SizingError(f"{name} {value!r} is not {kind}: write {how}")
        n = _floor(float(m.group(1)) * units[m.group(2).upper()], name, value)
    if n < 1:
        raise SizingError(f"{name} must be at least {least}, got {value!r}")
    return n


def _floor(x: float, name: str, value: str) -> int:
    if not math.isfinite(x):
        raise SizingError(f"{name} {value!r} is not a finite number")
    return math.floor(x)


def default_head_dim(hidden_size: int, n_cols: int, dtype: str) -> int:
    """``hidden_size / n_cols`` rounded to the nearest multiple of 8 (fp8: 32), at least one multiple."""
    step = 32 if dtype == "fp8" else 8
    return max(step, step * round(hidden_size / n_cols / step))


def _check_choices(tier: str, dtype: str) -> None:
    if tier not in TIERS:
        raise SizingError(f"tier {tier!r} is not a tier: choose {', '.join(TIERS)}")
    if dtype not in DTYPES:
        raise SizingError(f"dtype {dtype!r} is not a table dtype: choose {', '.join(DTYPES)}")


def _layout(config: dict[str, Any]):
    """The layout of `config`; rows and bytes depend on neither the pad id nor V', so placeholders stand in."""
    from condmem.layout import EngramLayout

    return EngramLayout(EngramConfig(**config, pad_id=0), compressed_vocab_size=2)


def size_engram(
    hidden_size: int,
    *,
    memory: int | str | None = None,
    params: int | str | None = None,
    tier: Tier = "hbm",
    dtype: TableDtype = "bf16",
    layer_ids: Sequence[int] = (1,),
    max_ngram_size: int = PAPER_MAX_NGRAM_SIZE,
    n_heads: int = PAPER_N_HEADS,
    head_dim: int | None = None,
) -> Sizing:
    """The Engram geometry with the largest tables that fit a budget.

    Args:
        hidden_size: the model's width D (``config.hidden_size``).
        memory: table bytes allowed over all layers (an int, or ``"10GB"``, ``"8GiB"``); or
        params: table parameters allowed (an int, or ``"2e9"``, ``"2B"``, ``"500M"``). Exactly one.
        tier: where the tables will live (``hbm``, ``host``, ``disk``); recorded, bytes are the same.
        dtype: how the rows are stored: ``bf16``, ``fp8`` (e4m3 + e8m0 scales), ``fp32``.
        layer_ids: the transformer layers that get an Engram (the budget is shared by all).
        max_ngram_size, n_heads: orders 2..N and hash heads per order (paper: 3 and 8).
        head_dim: row width; default ``hidden_size / ((N - 1) x n_heads)`` rounded (`default_head_dim`).

    Returns:
        A `Sizing` whose ``bytes`` (or ``params``) are at most the budget, counted by `EngramLayout`.

    Raises:
        SizingError: a value out of range, both or neither budget, or a budget too small for
            `MIN_TABLE_SIZE` buckets per head range (the message says what would fit).

    Example:
        >>> s = size_engram(1024, params="100M")
        >>> s.config["head_dim"], s.params <= 100_000_000
        (64, True)
    """
    _check_choices(tier, dtype)
    try:
        require_int("size_engram", "hidden_size", hidden_size, 1, LIMITS["hidden_size"])
        require_int("size_engram", "max_ngram_size", max_ngram_size, 2, LIMITS["max_ngram_size"])
        require_int("size_engram", "n_heads", n_heads, 1, LIMITS["n_heads"])
    except ConfigError as exc:
        raise SizingError(str(exc)) from None
    if (memory is None) == (params is None):
        raise SizingError("size_engram: give exactly one budget, memory (bytes, e.g. '10GB') or params (e.g. '2B')")
    n_cols = (max_ngram_size - 1) * n_heads
    config: dict[str, Any] = {
        "layer_ids": list(layer_ids),
        "max_ngram_size": max_ngram_size,
        "n_heads": n_heads,
        "head_dim": default_head_dim(hidden_size, n_cols, dtype) if head_dim is None else head_dim,
        "table_size": MIN_TABLE_SIZE,
        "hidden_size": hidden_size,
    }
    try:
        probe = _layout(config)  # validates every field, naming it
    except ConfigError as exc:
        raise SizingError(f"size_engram: {exc}") from None
    if dtype == "fp8" and config["head_dim"] % 32:
        raise SizingError(f"head_dim {config['head_dim']} must be a multiple of 32 for fp8 rows (one scale per 32)")
    row_bytes = probe.bytes_per_layer(dtype)[0] // probe.num_embeddings[0]
    if memory is not None:
        budget, unit, what = parse_bytes(memory, "memory"), row_bytes, "memory_bytes"
    else:
        budget, unit, what = parse_count(params, "params"), config["head_dim"], "params"
    config["table_size"] = _largest_table_size(config, budget, unit, what)
    layout = _layout(config)
    return Sizing(
        config=config,
        tier=tier,
        dtype=dtype,
        budget={what: budget},
        num_rows=layout.num_embeddings,
        params=layout.n_params,
        bytes=sum(layout.bytes_per_layer(dtype)),
        read_bytes_per_token=layout.n_layers * layout.n_cols * row_bytes,
    )


def _largest_table_size(config: dict[str, Any], budget: int, unit: int, what: str) -> int:
    """A table size whose layout's rows x `unit` (bytes or values a row) fit `budget` and the next size's do not.

    Each head's range is a prime just above the table size, so a layout of table size T holds
    at least ``cols x T`` rows: T = budget / (unit x cols) bounds the search from above. Below
    it, a jump down by the excess finds a size that fits; a bisection closes the gap.
    """
    cols = len(config["layer_ids"]) * (config["max_ngram_size"] - 1) * config["n_heads"]

    def excess(size: int) -> int:
        return sum(_layout({**config, "table_size": size}).num_embeddings) * unit - budget

    hi = min(budget // unit // cols, LIMITS["table_size"])
    lo = hi
    while lo >= MIN_TABLE_SIZE and (over := excess(lo)) > 0:
        hi, lo = lo, lo - -(-over // (unit * cols))
    if lo < MIN_TABLE_SIZE:
        raise SizingError(
            f"{what} {budget:,} is too small: {cols} head ranges ({len(config['layer_ids'])} layer(s) x "
            f"{config['max_ngram_size'] - 1} orders x {config['n_heads']} heads) of at least {MIN_TABLE_SIZE:,} "
            f"buckets need more than {cols * MIN_TABLE_SIZE * unit:,}; raise the budget, or use fewer heads or "
            "layers or a narrower head_dim"
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if excess(mid) <= 0 else (lo, mid)
    return lo
