"""`EngramLayout`: primes, offsets, multipliers and table sizes of every Engram layer.

Everything that decides a row id besides the token ids lives here, computed exactly
as the reference does (see ``engram-algorithm.md`` section 2):

* primes are drawn from one ascending search shared by the whole model: for each
  layer, each order n = 2..N, each head, the smallest prime above the previous
  one (starting at ``table_size[n] - 1``) that no earlier head took;
* a layer's table is the concatenation of its heads' prime-sized bucket ranges,
  so a column's offset is the sum of the primes before it;
* multipliers are odd int64s from ``numpy.random.default_rng(seed + 10007*layer_id)``,
  bounded so that ``compressed_id * multiplier`` never overflows int64.

The `fingerprint` hashes all of it; tables store it so that a table is never read
with a layout (or compressed vocabulary) it was not trained with.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from condmem.config import ConfigError, EngramConfig

# Seed stride between layers' multiplier generators, as in the reference.
LAYER_SEED_STRIDE = 10007
INT64_MAX = 2**63 - 1
# e8m0 scales: one per this many fp8 elements.
FP8_SCALE_BLOCK = 32


class LayoutError(ConfigError):
    """The layout cannot be built, or disagrees with what a config or checkpoint states."""


# Integers per sieve window (at 2**40 one window holds ~38,000 primes).
_SIEVE_SPAN = 1 << 20
# Primes from here up have at most 2**20 / 4096 = 256 multiples in a window.
_SIEVE_FEW_MULTIPLES = 4096


class PrimeSieve:
    """``next_prime(y)``: the smallest prime > y, from windows of integers sieved (exactly) on first use.

    A window ``[k * 2**20, (k + 1) * 2**20)`` is sieved with every prime up to the square root
    of its end, so its primes are exact, with no primality test per candidate; windows stay
    cached for the life of the object (one layout's search).
    """

    def __init__(self) -> None:
        self._windows: dict[int, list[int]] = {}
        self._base = np.zeros(0, dtype=np.int64)
        self._base_limit = 1

    def _base_primes(self, limit: int) -> np.ndarray:
        """All primes <= `limit` (a plain sieve, grown by doubling)."""
        if limit > self._base_limit:
            size = max(limit, 2 * self._base_limit) + 1
            flags = np.ones(size, dtype=bool)
            flags[:2] = False
            for i in range(2, math.isqrt(size - 1) + 1):
                if flags[i]:
                    flags[i * i :: i] = False
            self._base = np.flatnonzero(flags).astype(np.int64)
            self._base_limit = size - 1
        return self._base[: np.searchsorted(self._base, limit, side="right")]

    def _window(self, k: int) -> list[int]:
        primes = self._windows.get(k)
        if primes is None:
            lo, hi = k * _SIEVE_SPAN, (k + 1) * _SIEVE_SPAN
            flags = np.ones(_SIEVE_SPAN, dtype=bool)
            if lo == 0:
                flags[:2] = False
            base = self._base_primes(math.isqrt(hi - 1))
            # Each prime's first multiple in the window; below p*p a multiple has a smaller factor.
            first = np.maximum(base * base, -(-lo // base) * base) - lo
            few = np.searchsorted(base, _SIEVE_FEW_MULTIPLES)
            for p, f in zip(base[:few].tolist(), first[:few].tolist()):
                flags[f::p] = False
            # Primes with few multiples in the window: strike them all at once, one multiple a round.
            p, f = base[few:], first[few:]
            while p.size:
                keep = f < _SIEVE_SPAN
                p, f = p[keep], f[keep]
                flags[f] = False
                f = f + p
            primes = (np.flatnonzero(flags) + lo).tolist()
            self._windows[k] = primes
        return primes

    def next_prime(self, y: int) -> int:
        """The smallest prime > `y` (y >= -1)."""
        k = (y + 1) // _SIEVE_SPAN
        while True:
            primes = self._window(k)
            i = bisect.bisect_right(primes, y)
            if i < len(primes):
                return primes[i]
            k += 1


class PrimeSearch:
    """Hands out the smallest prime above a start that no earlier call took, in time linear in the primes.

    ``take(start)`` answers what a walk up from ``start + 1`` would (the first prime not taken),
    but never re-walks a stretch it walked before. It remembers, for points it passed, a skip
    ``skip[y] = z``: every prime in ``(y, z]`` is taken. Taken primes only grow, so a skip stays
    true forever, and a search that reaches ``y`` continues from ``z``. After each search every
    point it passed skips straight to the prime it found (path compression), so the orders that
    restart at one table size (all of them, in most configs) pass each earlier order's primes
    about once, instead of walking every prime and gap that the earlier layers took.
    """

    def __init__(self) -> None:
        self.taken: set[int] = set()
        self._skip: dict[int, int] = {}
        self._sieve = PrimeSieve()

    def take(self, start: int) -> int:
        """The smallest prime > `start` not taken yet; it is taken by this call."""
        skip, taken = self._skip, self.taken
        # The points a later search may start from or reach: this start and the taken primes passed.
        passed = [start]
        y = start
        while True:
            z = skip.get(y)
            if z is None:
                z = self._sieve.next_prime(y)
                if z not in taken:
                    break
            y = z
            passed.append(y)
        # Every prime in (point, z) was taken, and z is taken now.
        for point in passed:
            skip[point] = z
        taken.add(z)
        return z


def draw_primes(layer_ids: list[int], table_sizes: list[int], n_heads: int) -> list[list[int]]:
    """Primes per layer, flattened per layer in (order, head) column order.

    For each layer, each order, each head: the smallest prime above the previous head's (the
    first head: above ``table_size - 1``) that no earlier column of the model took.
    """
    search = PrimeSearch()
    per_layer = []
    for _ in layer_ids:
        columns = []
        for size in table_sizes:
            start = size - 1
            for _ in range(n_heads):
                start = search.take(start)
                columns.append(start)
        per_layer.append(columns)
    return per_layer


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int, seed: int = 0) -> np.ndarray:
    """The N odd multipliers of one layer (int64), exactly as the reference draws them."""
    bound = max(1, INT64_MAX // compressed_vocab_size // 2)
    rng = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer_id)
    r = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
    return r * 2 + 1


@dataclass(frozen=True)
class LayerLayout:
    """One Engram layer's share of the layout."""

    layer_id: int
    primes: tuple[int, ...]
    """Bucket-range size per column, columns in (order, head) order."""
    offsets: tuple[int, ...]
    """First row of each column's range in the layer's table."""
    multipliers: tuple[int, ...]
    """One odd multiplier per look-back distance 0..N-1."""

    @property
    def num_embeddings(self) -> int:
        """Rows in this layer's table: the sum of its primes."""
        return sum(self.primes)


class EngramLayout:
    """Primes, offsets, multipliers and sizes for every Engram layer of a model.

    Args:
        config: the model's `EngramConfig`.
        compressed_vocab_size: V' of the compressed tokenizer; defaults to the config's.
            It must be known: it enters every multiplier.
        pad_compressed_id: compressed id of ``config.pad_id``; needed for hashing
            (the hasher takes it from the tokenizer when built from one).

    Raises:
        LayoutError: V' unknown, or ``config.num_embeddings`` not equal to the primes' sums.

    Example:
        >>> layout = EngramLayout(EngramConfig.deepseek_v41_flash())
        >>> layout.num_embeddings
        [384006168, 384016682]
    """

    def __init__(self, config: EngramConfig, compressed_vocab_size: int | None = None):
        config.validate()
        if compressed_vocab_size is None:
            compressed_vocab_size = config.compressed_vocab_size
        elif config.compressed_vocab_size is not None and config.compressed_vocab_size != compressed_vocab_size:
            raise LayoutError(
                f"compressed_vocab_size {compressed_vocab_size} (tokenizer) disagrees with the config's "
                f"{config.compressed_vocab_size}: every hash multiplier depends on it, so the tables "
                "would be silently rehashed"
            )
        if compressed_vocab_size is None:
            raise LayoutError(
                "compressed_vocab_size is unknown: set EngramConfig.compressed_vocab_size or build the "
                "layout from a CompressedTokenizer (it enters every hash multiplier)"
            )
        if (
            isinstance(compressed_vocab_size, bool)
            or not isinstance(compressed_vocab_size, int)
            or compressed_vocab_size < 1
        ):
            raise LayoutError(f"compressed_vocab_size must be a positive int, got {compressed_vocab_size!r}")
        self.config = config
        self.compressed_vocab_size = compressed_vocab_size
        primes = _cached_primes(tuple(config.layer_ids), tuple(config.table_sizes), config.n_heads)
        self.layers: list[LayerLayout] = []
        for layer_id, cols in zip(config.layer_ids, primes):
            offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(cols[:-1])]))
            mult = hash_multipliers(layer_id, config.max_ngram_size, compressed_vocab_size, config.seed)
            self.layers.append(LayerLayout(layer_id, tuple(cols), offsets, tuple(int(m) for m in mult)))
        if config.num_embeddings is not None and list(config.num_embeddings) != self.num_embeddings:
            raise LayoutError(
                f"config num_embeddings {list(config.num_embeddings)} != sums of the layers' primes "
                f"{self.num_embeddings}: the geometry (layer_ids, max_ngram_size, n_heads, table_size) "
                "does not describe these tables"
            )

    # ------------------------------------------------------------------ accessors
    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_cols(self) -> int:
        return self.config.n_cols

    @property
    def max_ngram_size(self) -> int:
        return self.config.max_ngram_size

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @property
    def num_embeddings(self) -> list[int]:
        """Rows per layer's table."""
        return [layer.num_embeddings for layer in self.layers]

    def layer(self, layer_id: int) -> LayerLayout:
        """The layout of the Engram at transformer layer `layer_id`."""
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise LayoutError(f"layer {layer_id} has no Engram; Engram layers are {self.layer_ids}")

    def layer_index(self, layer_id: int) -> int:
        """Position of `layer_id` among the Engram layers (the hasher's layer axis)."""
        return self.layer_ids.index(self.layer(layer_id).layer_id)

    def primes_array(self) -> np.ndarray:
        """[n_layers, n_cols] int64 primes."""
        return np.array([layer.primes for layer in self.layers], dtype=np.int64)

    def offsets_array(self) -> np.ndarray:
        """[n_layers, n_cols] int64 offsets."""
        return np.array([layer.offsets for layer in self.layers], dtype=np.int64)

    def multipliers_array(self) -> np.ndarray:
        """[n_layers, N] int64 multipliers."""
        return np.array([layer.multipliers for layer in self.layers], dtype=np.int64)

    # ------------------------------------------------------------------ sizes
    def bytes_per_layer(self, dtype: str = "bf16") -> list[int]:
        """Table bytes per layer: ``bf16`` (2 B/element), ``fp32``, or ``fp8`` (1 B + one e8m0 byte per 32)."""
        d = self.config.head_dim
        if dtype == "bf16":
            per_row = 2 * d
        elif dtype == "fp32":
            per_row = 4 * d
        elif dtype in ("fp8", "fp8_e8m0"):
            per_row = d + -(-d // FP8_SCALE_BLOCK)
        else:
            raise LayoutError(f"unknown table dtype {dtype!r}; choose bf16, fp32 or fp8")
        return [n * per_row for n in self.num_embeddings]

    @property
    def n_params(self) -> int:
        """Table parameters over all layers."""
        return sum(self.num_embeddings) * self.config.head_dim

    # ------------------------------------------------------------------ identity
    def describe(self) -> dict:
        """Everything that decides a row id, as a JSON-ready dict."""
        return {
            "layer_ids": self.layer_ids,
            "max_ngram_size": self.max_ngram_size,
            "n_heads": self.n_heads,
            "table_sizes": self.config.table_sizes,
            "pad_id": self.config.pad_id,
            "seed": self.config.seed,
            "compressed_vocab_size": self.compressed_vocab_size,
            "primes": [list(layer.primes) for layer in self.layers],
            "multipliers": [list(layer.multipliers) for layer in self.layers],
        }

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 (hex) of `describe()`: equal fingerprints mean identical row ids for identical tokens."""
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def summary(self) -> dict:
        """Primes summary, rows and bytes per layer (what ``condmem layout`` prints)."""
        bf16, fp8 = self.bytes_per_layer("bf16"), self.bytes_per_layer("fp8")
        layers = []
        for layer, b16, b8 in zip(self.layers, bf16, fp8):
            layers.append(
                {
                    "layer_id": layer.layer_id,
                    "num_embeddings": layer.num_embeddings,
                    "min_prime": min(layer.primes),
                    "max_prime": max(layer.primes),
                    "primes": list(layer.primes),
                    "multipliers": list(layer.multipliers),
                    "bytes_bf16": b16,
                    "bytes_fp8_e8m0": b8,
                }
            )
        return {
            "compressed_vocab_size": self.compressed_vocab_size,
            "n_cols": self.n_cols,
            "head_dim": self.config.head_dim,
            "num_embeddings": self.num_embeddings,
            "params": self.n_params,
            "bytes_bf16": sum(bf16),
            "bytes_fp8_e8m0": sum(fp8),
            "fingerprint": self.fingerprint,
            "layers": layers,
        }

    def __repr__(self) -> str:
        return (
            f"EngramLayout(layers={self.layer_ids}, N={self.max_ngram_size}, heads={self.n_heads}, "
            f"V'={self.compressed_vocab_size}, rows={self.num_embeddings})"
        )


@functools.lru_cache(maxsize=64)
def _cached_primes(
    layer_ids: tuple[int, ...], table_sizes: tuple[int, ...], n_heads: int
) -> tuple[tuple[int, ...], ...]:
    # The prime search (primality tests near each table size) is the slow part of a layout; configs repeat.
    return tuple(tuple(cols) for cols in draw_primes(list(layer_ids), list(table_sizes), n_heads))
