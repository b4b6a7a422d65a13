"""fp8 e4m3 rows with one e8m0 scale per 32 elements: the storage format of released V4.1 tables.

A row of ``head_dim`` values is stored as ``head_dim`` fp8 e4m3 (``float8_e4m3fn``)
bytes and ``head_dim / 32`` scale bytes. A scale byte ``e`` is an OCP MX E8M0
exponent: the block's values are ``fp8 * 2**(e - 127)``.

Exponent edge cases, as decoded here (`e8m0_to_float`) and by the gather kernel:

* ``e = 0``: scale ``2**-127``, a subnormal float32. It is kept (not flushed): rows
  quantized with ``e = 0`` dequantize to subnormal bf16 values, and to zero only where
  the product falls below bf16's smallest subnormal (``2**-133``) after rounding.
* ``e = 254``: scale ``2**127``; products beyond bf16's range overflow to ``+-inf``
  (IEEE float32 multiplication then round-to-nearest-even to bf16).
* ``e = 255``: NaN, as the OCP MX v1.0 spec defines it: every element of the block
  dequantizes to NaN, whatever its fp8 byte.

Quantization (`quantize_fp8_e8m0`) picks, per block of 32, the smallest ``e`` with
``amax * 2**(127 - e) <= 448`` (e4m3's largest finite value), so no element saturates;
it clamps ``e`` to [0, 254] (``e = 0`` for an all-zero block, and for blocks so small
that their largest value is at most ``448 * 2**-127``). A block holding an inf or NaN
gets ``e = 255`` and fp8 NaN bytes. Round trip (fp32 out): every element within
``2**-4 * |x|`` (e4m3 normals: 3 mantissa bits, round to nearest) or ``2**-10 * 2**(e-127)``
(e4m3 subnormals' half-spacing), whichever is larger.

Interleaved rows (`pack_rows`): ``head_dim`` fp8 bytes then the ``head_dim / 32``
scale bytes, one uint8 row of ``head_dim * 33 / 32`` bytes (264 B at head_dim 256), so
a row and its scales arrive in one random access.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
SCALE_BLOCK = 32
"""Elements per e8m0 scale."""
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_NAN_BYTE = 0x7F
FP8_DTYPE = torch.float8_e4m3fn


class QuantError(ValueError):
    """A table cannot be quantized, or its fp8/scale tensors do not fit together."""


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> float32 scales ``2**(e-127)`` exactly (e=0 subnormal, e=255 NaN)."""
    if e.dtype != torch.uint8:
        raise QuantError(f"e8m0 scales must be uint8, got {e.dtype}")
    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, torch.full_like(ei, 0x00400000), ei << 23)
    bits = torch.where(ei == E8M0_NAN, torch.full_like(ei, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e in [0, 254] with ``amax * 2**(127-e) <= 448``; 255 where amax is inf/NaN. uint8."""
    a = amax.float()
    mant, exp = torch.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    # 448 = 0.875 * 2**9: a <= 448 * 2**k  <=>  k >= exp - 9 (mant <= 0.875) or exp - 8.
    k = exp.to(torch.int32) - 9 + (mant > 0.875).to(torch.int32)
    e = (k + E8M0_BIAS).clamp(0, 254)
    e = torch.where(a == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isfinite(a), e, torch.full_like(e, E8M0_NAN))
    return e.to(torch.uint8)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if d % SCALE_BLOCK:
        raise QuantError(f"fp8/e8m0 rows need a width divisible by {SCALE_BLOCK}, got {d}")
    return x.reshape(*x.shape[:-1], d // SCALE_BLOCK, SCALE_BLOCK)


def quantize_fp8_e8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] (any float dtype) -> (fp8 e4m3 [..., D], uint8 e8m0 scales [..., D/32]).

    Computed in float32 on the input's device; see the module docstring for the rules.
    """
    if not x.is_floating_point():
        raise QuantError(f"quantize needs a float tensor, got {x.dtype}")
    xb = _blocks(x.float())
    amax = xb.abs().amax(dim=-1)
    # An inf or NaN anywhere in a block makes amax non-finite (NaN propagates through amax).
    amax = torch.where(torch.isnan(xb).any(dim=-1), torch.full_like(amax, float("nan")), amax)
    e = e8m0_exponent(amax)
    ei = e.to(torch.int32)
    # 2**(127 - e): exact in float32 for e in [0, 254] (2**-127 is subnormal, still exact).
    inv_bits = torch.where(ei == 254, torch.full_like(ei, 0x00400000), (254 - ei).clamp(min=1) << 23)
    inv = inv_bits.view(torch.float32)
    scaled = (xb * inv[..., None]).clamp(-FP8_MAX, FP8_MAX)
    q = scaled.to(FP8_DTYPE)
    nan_block = (e == E8M0_NAN)[..., None].expand_as(q)
    q = torch.where(nan_block, torch.full_like(q.view(torch.uint8), FP8_NAN_BYTE).view(FP8_DTYPE), q)
    return q.reshape(x.shape), e


def dequantize_fp8_e8m0(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(fp8 [..., D], uint8 [..., D/32]) -> [..., D] in `dtype`: ``fp8 * 2**(e-127)`` in float32, then rounded."""
    check_fp8_pair(q, scales)
    qb = _blocks(q.float())
    out = qb * e8m0_to_float(scales)[..., None]
    return out.reshape(q.shape).to(dtype)


def check_fp8_pair(q: torch.Tensor, scales: torch.Tensor) -> None:
    if q.dtype != FP8_DTYPE:
        raise QuantError(f"fp8 rows must be {FP8_DTYPE}, got {q.dtype}")
    if scales.dtype != torch.uint8:
        raise QuantError(f"e8m0 scales must be uint8, got {scales.dtype}")
    d = q.shape[-1]
    if d % SCALE_BLOCK or scales.shape != (*q.shape[:-1], d // SCALE_BLOCK):
        raise QuantError(
            f"scales {tuple(scales.shape)} do not fit fp8 rows {tuple(q.shape)} (one scale per {SCALE_BLOCK} elements)"
        )


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of one interleaved row: head_dim fp8 bytes + head_dim/32 scale bytes."""
    if head_dim % SCALE_BLOCK:
        raise QuantError(f"head_dim must be divisible by {SCALE_BLOCK}, got {head_dim}")
    return head_dim + head_dim // SCALE_BLOCK


def head_dim_of_packed(row_bytes: int) -> int:
    """Inverse of `packed_row_bytes`."""
    if row_bytes % (SCALE_BLOCK + 1):
        raise QuantError(f"an interleaved fp8 row has head_dim*33/32 bytes; {row_bytes} is not a multiple of 33")
    return row_bytes // (SCALE_BLOCK + 1) * SCALE_BLOCK


def pack_rows(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(fp8 [R, D], uint8 [R, D/32]) -> uint8 [R, D + D/32] interleaved rows (`out` may be pinned host memory)."""
    check_fp8_pair(q, scales)
    d = q.shape[-1]
    if out is None:
        out = torch.empty((*q.shape[:-1], packed_row_bytes(d)), dtype=torch.uint8, device=q.device)
    out[..., :d].copy_(q.view(torch.uint8))
    out[..., d:].copy_(scales)
    return out


def unpack_rows(packed: torch.Tensor, head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [R, D + D/32] -> (fp8 [R, D], uint8 [R, D/32]) copies."""
    if packed.dtype != torch.uint8:
        raise QuantError(f"interleaved rows must be uint8, got {packed.dtype}")
    d = head_dim_of_packed(packed.shape[-1]) if head_dim is None else head_dim
    if packed.shape[-1] != packed_row_bytes(d):
        raise QuantError(f"rows of {packed.shape[-1]} bytes do not hold head_dim {d} (+ scales)")
    q = packed[..., :d].contiguous().view(FP8_DTYPE)
    return q, packed[..., d:].contiguous()


def quantize_table(
    table: torch.Tensor,
    *,
    interleaved: bool = False,
    rows_per_chunk: int = 1 << 20,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize a [R, D] table chunk by chunk (tables of V4.1 size do not fit a float32 copy).

    Args:
        table: [R, D] float table (any device; a CPU/meta-free tensor).
        interleaved: return one uint8 [R, D + D/32] tensor (and None) instead of (fp8, scales).
        rows_per_chunk: rows converted at a time.
        device: where the arithmetic runs (default: the table's device); results land on
            the table's device, in pinned memory when `pin_memory`.

    Returns:
        (fp8 [R, D], uint8 [R, D/32]) or (uint8 [R, D*33/32], None).
    """
    num_rows, d = table.shape
    work = torch.device(device) if device is not None else table.device
    home = table.device
    if interleaved:
        out = torch.empty((num_rows, packed_row_bytes(d)), dtype=torch.uint8, device=home, pin_memory=pin_memory)
        q_out = s_out = None
    else:
        packed_row_bytes(d)
        q_out = torch.empty((num_rows, d), dtype=torch.uint8, device=home, pin_memory=pin_memory)
        s_out = torch.empty((num_rows, d // SCALE_BLOCK), dtype=torch.uint8, device=home, pin_memory=pin_memory)
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        q, s = quantize_fp8_e8m0(table[start:stop].to(work))
        if interleaved:
            out[start:stop, :d].copy_(q.view(torch.uint8))
            out[start:stop, d:].copy_(s)
        else:
            q_out[start:stop].copy_(q.view(torch.uint8))
            s_out[start:stop].copy_(s)
    if interleaved:
        return out, None
    return q_out.view(FP8_DTYPE), s_out
