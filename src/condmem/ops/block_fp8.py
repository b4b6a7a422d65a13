"""Block-FP8 matrices, as released checkpoints store linear weights: fp8 e4m3 plus one scale per block.

A weight [O, I] comes with a scale tensor [O/bo, I/bi]; element (o, i) is
``fp8[o, i] * scale[o // bo, i // bi]``. The block shape (bo, bi) is written nowhere:
it is the weight's shape divided by the scale's (`block_shape`), and a shape that does
not divide is an error. Scales are e8m0 exponents (``float8_e8m0fnu`` or ``uint8``,
value ``2**(e-127)``, 255 = NaN) or plain floats (``float32``, ``bfloat16``).

* `dequantize_block_fp8`: the reference, in float32 (exact: an fp8 value times a
  power-of-two scale is a float32 unless it underflows), then rounded to `dtype`;
* `BlockFp8Linear`: a bias-free linear layer that keeps the weight in fp8 (one byte per
  element) with its block scales, and dequantizes it block-exactly on each call before
  a GEMM in the input's dtype. It saves memory, not time: there is no fp8 GEMM here,
  which the first call says once in the log.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from condmem.fp8 import FP8_DTYPE, e8m0_to_float

log = logging.getLogger("condmem.ops")

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


class BlockFp8Error(ValueError):
    """A block-FP8 weight and its scales do not fit together."""


def block_shape(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], what: str = "weight") -> tuple[int, int]:
    """(bo, bi) such that weight [O, I] = scale [O/bo, I/bi] blocks; `BlockFp8Error` if it does not divide."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise BlockFp8Error(
            f"{what}: a block-FP8 weight and its scales must both be 2-D, got {tuple(weight_shape)} "
            f"and {tuple(scale_shape)}"
        )
    if min(scale_shape) < 1 or any(w % s for w, s in zip(weight_shape, scale_shape)):
        raise BlockFp8Error(
            f"{what}: weight {tuple(weight_shape)} does not divide into the scale grid "
            f"{tuple(scale_shape)}: no whole block shape fits"
        )
    return weight_shape[0] // scale_shape[0], weight_shape[1] // scale_shape[1]


def scales_to_float(scales: torch.Tensor, what: str = "scales") -> torch.Tensor:
    """Block scales as float32: e8m0 exponents (uint8 / float8_e8m0fnu) decoded, floats widened."""
    if _E8M0 is not None and scales.dtype == _E8M0:
        scales = scales.view(torch.uint8)
    if scales.dtype == torch.uint8:
        return e8m0_to_float(scales.contiguous())
    if scales.dtype in _FLOAT_SCALES:
        return scales.float()
    raise BlockFp8Error(f"{what}: scales are {scales.dtype}; expected float8_e8m0fnu, uint8 (e8m0) or float32")


def dequantize_block_fp8(
    weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, what: str = "weight"
) -> torch.Tensor:
    """fp8 e4m3 [O, I] and block scales [O/bo, I/bi] -> [O, I] in `dtype` (float32 products, then rounded)."""
    if weight.dtype != FP8_DTYPE:
        raise BlockFp8Error(f"{what}: a block-FP8 weight must be {FP8_DTYPE}, got {weight.dtype}")
    bo, bi = block_shape(tuple(weight.shape), tuple(scales.shape), what)
    s = scales_to_float(scales, what).to(weight.device)
    o, i = weight.shape
    blocks = weight.float().view(o // bo, bo, i // bi, bi) * s[:, None, :, None]
    return blocks.view(o, i).to(dtype)


class BlockFp8Linear(nn.Module):
    """``y = x @ W.T`` with W stored block-FP8 (fp8 e4m3 + float32 block scales), no bias.

    Args:
        weight: fp8 e4m3 [out, in].
        scales: [out/bo, in/bi] block scales in any dtype `scales_to_float` takes.

    The weight is dequantized (exactly, block by block) to the input's dtype on every call.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.block = block_shape(tuple(weight.shape), tuple(scales.shape))
        if weight.dtype != FP8_DTYPE:
            raise BlockFp8Error(f"a block-FP8 weight must be {FP8_DTYPE}, got {weight.dtype}")
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales_to_float(scales))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._told = False

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._told:
            self._told = True
            log.info(
                "BlockFp8Linear %s: weight kept in fp8 (block %s); each call dequantizes it to %s for the GEMM "
                "(no fp8 GEMM path)",
                tuple(self.weight.shape),
                self.block,
                x.dtype,
            )
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, fp8"
