"""The n-gram hash as DeepSeek's official demo computes it: numpy, one layer / order / head at a time.

The demo pads each sequence on the left with the pad id, builds the k-shifted copies,
and for every order n recomputes ``mix = c[t]*m[0] ^ c[t-1]*m[1] ^ ... ^ c[t-n+1]*m[n-1]``,
then takes ``mix % prime`` per head. It is the CPU baseline of ``condmem bench hash``
(written here from that description; no blocked positions, as in the demo).
"""

from __future__ import annotations

import numpy as np


def numpy_demo_hash(
    compressed: np.ndarray, multipliers: np.ndarray, primes: np.ndarray, n_heads: int, pad_id: int
) -> np.ndarray:
    """[B, T] compressed ids -> [B, T, L, (N-1)*H] bucket ids (no offsets)."""
    batch, length = compressed.shape
    n_layers, max_n = multipliers.shape
    x = compressed.astype(np.int64)
    out = np.empty((batch, length, n_layers, (max_n - 1) * n_heads), dtype=np.int64)
    shifts = [x]
    for k in range(1, max_n):
        padded = np.pad(x, ((0, 0), (k, 0)), constant_values=pad_id)
        shifts.append(padded[:, :length])
    for layer in range(n_layers):
        m = multipliers[layer]
        col = 0
        for n in range(2, max_n + 1):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
            for _ in range(n_heads):
                out[:, :, layer, col] = mix % primes[layer, col]
                col += 1
    return out
