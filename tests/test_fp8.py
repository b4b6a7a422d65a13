"""fp8 e4m3 + e8m0 quantization: round-trip bounds, exponent choice, edge exponents 0 / 254 / 255, packing."""

from __future__ import annotations

import math

import pytest
import torch

from condmem.fp8 import (
    FP8_DTYPE,
    QuantError,
    dequantize_fp8_e8m0,
    e8m0_exponent,
    e8m0_to_float,
    head_dim_of_packed,
    pack_rows,
    packed_row_bytes,
    quantize_fp8_e8m0,
    quantize_table,
    unpack_rows,
)


def _scales_per_element(e: torch.Tensor) -> torch.Tensor:
    return e8m0_to_float(e).repeat_interleave(32, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_error_bound(dtype):
    gen = torch.Generator().manual_seed(0)
    mags = torch.logspace(-40, 35, 97, dtype=torch.float64).float()
    x = (torch.randn(97, 256, generator=gen) * mags[:, None]).to(dtype)
    x[5, :32] = 0  # an all-zero block
    x[6, 7] = 3e38 if dtype == torch.float32 else 3e38  # near the float32 maximum
    q, e = quantize_fp8_e8m0(x)
    assert q.dtype == FP8_DTYPE and e.dtype == torch.uint8 and e.shape == (97, 8)
    y = dequantize_fp8_e8m0(q, e, torch.float32)
    err = (x.float() - y).abs()
    bound = torch.maximum(x.float().abs() * 2**-4, _scales_per_element(e) * 2**-10)
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3e}"
    assert torch.all(e[5, 0] == 0) and torch.all(y[5, :32] == 0)


def test_exponent_is_the_smallest_that_fits():
    gen = torch.Generator().manual_seed(1)
    amax = torch.cat(
        [
            torch.rand(4000, generator=gen) * 10.0 ** torch.randint(-38, 38, (4000,), generator=gen).float(),
            torch.tensor([448.0, 448.0 * 2**-127, 449.0, 447.99, 1.0, 2.0**-149, 3.4e38]),
        ]
    )
    e = e8m0_exponent(amax).to(torch.int64)
    for a, ei in zip(amax.double().tolist(), e.tolist()):
        if a == 0:
            continue
        assert a * 2.0 ** (127 - ei) <= 448.0 or ei == 254
        if 0 < ei:
            assert a * 2.0 ** (128 - ei) > 448.0, (a, ei)  # one less would saturate


def test_e8m0_edge_exponents_decode():
    s = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert s.view(torch.int32)[0].item() == 0x00400000  # 2**-127, subnormal, kept
    assert s[0].item() == 2.0**-127
    assert s[1].item() == 2.0**-126 and s[2].item() == 0.5 and s[3].item() == 1.0 and s[4].item() == 2.0
    assert s[5].item() == 2.0**127
    assert math.isnan(s[6].item())  # OCP MX: 0xFF is NaN


def test_exponent_zero_rows_dequantize_to_subnormals():
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).reshape(8, 32)
    e = torch.zeros(8, 1, dtype=torch.uint8)
    got32 = dequantize_fp8_e8m0(q, e, torch.float32)
    exact = torch.tensor([v * 2.0**-127 for v in q.double().flatten().tolist()], dtype=torch.float64).reshape(8, 32)
    finite = ~exact.isnan()
    assert torch.equal(got32[finite].double(), exact[finite])  # exact in float32 (>= 2**-136)
    got16 = dequantize_fp8_e8m0(q, e, torch.bfloat16)
    assert torch.equal(got16[finite], exact[finite].float().to(torch.bfloat16))
    assert (got16[finite] != 0).sum() > 0 and got16[finite].abs().max() < 2.0**-118


def test_exponent_254_overflows_to_inf_and_255_is_nan():
    q = torch.tensor([[1.0, 1.875, 2.0, -448.0, 0.0] + [0.0] * 27], dtype=torch.float32).to(FP8_DTYPE)
    y = dequantize_fp8_e8m0(q, torch.tensor([[254]], dtype=torch.uint8), torch.bfloat16).float()
    assert y[0, 0].item() == 2.0**127 and y[0, 1].item() == 1.875 * 2.0**127
    assert y[0, 2].item() == math.inf and y[0, 3].item() == -math.inf and y[0, 4].item() == 0
    z = dequantize_fp8_e8m0(q, torch.tensor([[255]], dtype=torch.uint8))
    assert torch.all(z.isnan())


def test_non_finite_blocks_quantize_to_nan_scale():
    x = torch.ones(3, 64)
    x[0, 3] = math.inf
    x[1, 40] = math.nan
    q, e = quantize_fp8_e8m0(x)
    assert e.tolist() == [[255, 127 - 8], [127 - 8, 255], [127 - 8, 127 - 8]]  # amax 1: 1 * 2**8 = 256 <= 448 < 512
    y = dequantize_fp8_e8m0(q, e, torch.float32)
    assert torch.all(y[0, :32].isnan()) and torch.all(y[1, 32:].isnan()) and torch.all(y[2] == 1)


def test_pack_unpack_round_trip_and_sizes():
    assert packed_row_bytes(256) == 264 and head_dim_of_packed(264) == 256
    with pytest.raises(QuantError):
        packed_row_bytes(100)
    x = torch.randn(17, 96)
    q, e = quantize_fp8_e8m0(x)
    packed = pack_rows(q, e)
    assert packed.shape == (17, 99) and packed.dtype == torch.uint8
    q2, e2 = unpack_rows(packed)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(e2, e)


def test_quantize_table_chunked_equals_direct():
    x = torch.randn(1000, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q, e = quantize_fp8_e8m0(x)
    q2, e2 = quantize_table(x, rows_per_chunk=97)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(e2, e)
    packed, none = quantize_table(x, interleaved=True, rows_per_chunk=333)
    assert none is None and torch.equal(packed, pack_rows(q, e))


def test_shape_errors():
    with pytest.raises(QuantError, match="divisible by 32"):
        quantize_fp8_e8m0(torch.ones(2, 40))
    q, e = quantize_fp8_e8m0(torch.ones(2, 64))
    with pytest.raises(QuantError, match="do not fit"):
        dequantize_fp8_e8m0(q, e[:, :1])
