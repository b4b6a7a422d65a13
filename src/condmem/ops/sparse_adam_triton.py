"""The tables' lazy Adam step in two Triton launches and a scan, with no host sync.

`condmem.train.optim.SparseAdam` keeps Adam state for the rows a gradient has touched:
``slot_of_row`` int32 [num_rows] (-1: none yet), moments ``exp_avg``/``exp_avg_sq`` fp32
[capacity, dim], ``row_step`` fp32 [capacity] and ``n_slots`` (here an int64 [1] device
tensor). For k unique rows and their summed gradient rows `sparse_adam_step` runs:

1. `_fresh_kernel`: 1 for each row without a slot; ``cumsum_`` numbers those rows in the
   order given, so fresh rows take slots ``n_slots, n_slots + 1, ...`` in row order (the
   torch path's layout);
2. `_adam_kernel`: each row's slot (a fresh row's new one, recorded in ``slot_of_row``),
   its moments and step count, one Adam step with the row's own bias correction, moments,
   step and row written back (rows are unique: no atomics);
3. ``n_slots += number of fresh rows``, on the device.

The caller guarantees the capacity (`SparseAdam` keeps an upper bound of ``n_slots`` on the
host); nothing here reads a device value on the host.

The torch path's arithmetic (`condmem.train.optim.adam_rows_delta`, then ``index_add_``) op
for op, each rounding as torch rounds it on the same device. Each torch op there is its own
kernel that rounds to fp32 once, except for two fused multiply-adds:

* ``m.lerp_(g, w)`` (w = 1 - beta1): ``fma(w, g - m, m)`` for w < 0.5, else
  ``fma(w - 1, g - m, g)`` (``w - 1`` is exact), on the CPU (the vectorized lerp calls
  ``fmadd``) and on CUDA (nvcc contracts ``self + weight * (end - self)``);
* ``v.mul_(beta2).addcmul_(g, g, value=a)`` (a = 1 - beta2): CUDA's ``pointwise_op_impl``
  computes ``fma(a, g * g, v * beta2)`` (``fma(g, g, v * beta2)`` when a == 1); the CPU's
  ``self + value * t1 * t2``, contracted by the compiler of torch's AVX2/AVX512 kernels,
  ``fma(a * g, g, v * beta2)``. ``V_CUDA`` picks the device's order.

The rest is correctly rounded: ``tl.div_rn`` and ``tl.sqrt_rn`` (Triton's ``/`` and
``tl.sqrt`` are approximate on NVIDIA GPUs), and the launch passes ``enable_fp_fusion=False``
so that the compiler does not contract ``p + update * -lr`` (torch rounds the product first).
A bf16/fp16 row gets ``p + delta.to(p.dtype)`` as ``index_add_`` computes it: the change
rounded to the row's dtype, added in fp32, rounded again; the interpreter's fp32 -> bf16 cast
truncates, so there the rounding is done by integer arithmetic. Scalars (lr, betas, eps) are
rounded to fp32 on the host as torch rounds them.

So on CUDA the rows, moments and steps equal the torch path's bit for bit (tests hold them
``torch.equal``). On the CPU, where the kernel runs only in the interpreter (tests), one op
parts: torch's CPU ``sqrt`` of fp32 is not correctly rounded on every CPU (its vectorized path
can be 1 ulp off the IEEE square root, the same wherever the element sits), while the
interpreter's ``np.sqrt`` is. Moments, steps and slots do not
depend on a sqrt and stay equal; a row may differ by the rounding of its update (tests: equal
with an IEEE sqrt in the torch path, within a bound from that rounding with torch's own).

Rows outside ``[0, num_rows)`` (no valid sparse gradient has them) are skipped, not written.

`adam_rows_step` is the same step for k rows already side by side (rows, moments and step
counts gathered from wherever they live, as the host tier's device Adam holds them): one
launch, in place.
Imported only when the fused step runs (it imports triton).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from condmem.ops.gather.triton import _bf16_rne
from condmem.ops.triton_util import cdiv, interpreting, next_pow2
from condmem.utils.renamed import renamed_keywords

_INTERPRET = interpreting()  # as triton decided when it was imported

FRESH_BLOCK = 1024
TILE = 2048
"""Elements of a program's [rows, dim] tile: 32 rows of 64 columns (16 fp32 a thread per
tensor at 4 warps; the step is memory-bound)."""
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Table dtypes the kernel updates (code of each: the kernel's ``P_KIND``)."""
COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""Launch/compile options the exactness needs (module docstring)."""


@triton.jit(do_not_specialize=["k", "n_rows"])
def _fresh_kernel(rows_ptr, slot_ptr, fresh_ptr, k, n_rows, BLOCK: tl.constexpr):
    """fresh[i] = 1 where row i has no slot yet (0 for rows outside the table)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < k
    row = tl.load(rows_ptr + i, mask=live, other=0)
    ok = live & (row >= 0) & (row < n_rows)
    slot = tl.load(slot_ptr + row, mask=ok, other=0)
    tl.store(fresh_ptr + i, (ok & (slot < 0)).to(tl.int32), mask=live)


@triton.jit
def _bias_corrections(pow1_ptr, pow2_ptr, step, live):
    """Each row's (1 - beta1^t, sqrt(1 - beta2^t)) for its step count `step`, from the power tables."""
    t = step.to(tl.int32)
    bias1 = 1.0 - tl.load(pow1_ptr + t, mask=live, other=0.0)
    bias2_sqrt = tl.sqrt_rn(1.0 - tl.load(pow2_ptr + t, mask=live, other=0.0))
    return bias1, bias2_sqrt


@triton.jit
def _fma(a, b, c, EXACT: tl.constexpr):
    """``a * b + c`` (fp32) rounded once, as ``tl.fma`` compiles on a GPU. With `EXACT` (the
    interpreter, whose ``tl.fma`` rounds twice on some Triton releases, 3.8): the fp32 product is
    exact in fp64 and the sum is rounded there, then to fp32; rounding twice differs from once only
    where the fp64 sum is a fp32 midpoint (about 2^-28 of sums)."""
    if EXACT:
        return (b.to(tl.float64) * a + c.to(tl.float64)).to(tl.float32)  # `a` may be a scalar argument
    else:
        return tl.fma(a, b, c)


@triton.jit
def _adam_math(
    g,
    m,
    v,
    bias1,
    bias2_sqrt,
    w,
    beta2,
    one_minus_beta2,
    eps,
    neg_lr,
    LERP_SMALL: tl.constexpr,
    V_CUDA: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One Adam step of fp32 tiles: (new m, new v, the row's change) with torch's roundings (module docstring)."""
    if LERP_SMALL:
        m = _fma(w, g - m, m, EXACT)
    else:
        m = _fma(w - 1.0, g - m, g, EXACT)
    if V_CUDA:
        v = _fma(one_minus_beta2, g * g, v * beta2, EXACT)
    else:
        v = _fma(one_minus_beta2 * g, g, v * beta2, EXACT)
    update = tl.div_rn(tl.div_rn(m, bias1), tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps)
    return m, v, update * neg_lr


@triton.jit(do_not_specialize=["k", "n_rows", "capacity"])  # k changes every step; a table's stride never
def _adam_kernel(
    rows_ptr,
    grad_ptr,
    p_ptr,
    slot_ptr,
    rank_ptr,
    n_slots_ptr,
    m_ptr,
    v_ptr,
    step_ptr,
    pow1_ptr,
    pow2_ptr,
    k,
    n_rows,
    capacity,
    p_stride,
    w,
    beta2,
    one_minus_beta2,
    eps,
    neg_lr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    V_CUDA: tl.constexpr,
    P_KIND: tl.constexpr,
    EXACT: tl.constexpr,
):
    # Per-row values are loaded as [BLOCK_R, 1] columns, the rank of the tiles they address.
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    live = r < k
    row = tl.load(rows_ptr + r, mask=live, other=0)
    live = live & (row >= 0) & (row < n_rows)
    old = tl.load(slot_ptr + row, mask=live, other=0)
    fresh = old < 0
    rank = tl.load(rank_ptr + r, mask=live, other=1)  # inclusive count of fresh rows up to this one
    slot = tl.where(fresh, tl.load(n_slots_ptr) + rank - 1, old.to(tl.int64))
    live = live & (slot < capacity)  # memory safety only: the caller provides the room
    tl.store(slot_ptr + row, slot.to(tl.int32), mask=live & fresh)
    kept = live & (old >= 0)  # a fresh row's state is zero: nothing to read
    step = tl.load(step_ptr + slot, mask=kept, other=0.0) + 1.0
    bias1, bias2_sqrt = _bias_corrections(pow1_ptr, pow2_ptr, step, live)

    cm = live & (c < D)
    at = slot * D + c
    g = tl.load(grad_ptr + r * D + c, mask=cm, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + at, mask=cm & kept, other=0.0)
    v = tl.load(v_ptr + at, mask=cm & kept, other=0.0)
    m, v, delta = _adam_math(
        g, m, v, bias1, bias2_sqrt, w, beta2, one_minus_beta2, eps, neg_lr, LERP_SMALL, V_CUDA, EXACT
    )

    pa = p_ptr + row * p_stride + c
    p = tl.load(pa, mask=cm, other=0.0)
    if P_KIND == 0:
        p = p + delta
    elif P_KIND == 1:
        if EXACT:
            p = _bf16_rne(p.to(tl.float32) + _bf16_rne(delta).to(tl.float32))
        else:
            p = (p.to(tl.float32) + delta.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    else:
        p = (p.to(tl.float32) + delta.to(tl.float16).to(tl.float32)).to(tl.float16)
    tl.store(pa, p, mask=cm)
    tl.store(m_ptr + at, m, mask=cm)
    tl.store(v_ptr + at, v, mask=cm)
    tl.store(step_ptr + slot, step, mask=live)


def _f32(x: float) -> float:
    """`x` rounded to fp32 (to nearest), as torch rounds a Python scalar for an fp32 op."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _adam_launch(dim: int, lr: float, beta1: float, beta2: float, eps: float, cuda: bool):
    """What both Adam kernels' launches share: (rows a program, the scalars ``w, beta2, 1 - beta2,
    eps, -lr`` rounded to fp32 as torch rounds them, the tile and exactness keywords)."""
    block_d = next_pow2(dim)
    block_r = max(1, TILE // block_d)
    w, a = _f32(1 - beta1), _f32(1 - beta2)
    meta = dict(
        D=dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        LERP_SMALL=abs(w) < 0.5,
        V_CUDA=cuda and a != 1.0,  # with a == 1 both orders are fma(g, g, v * beta2)
        EXACT=_INTERPRET,
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    return block_r, (w, _f32(beta2), a, _f32(eps), _f32(-lr)), meta


def _check(row_ids, grad, param, slot_of_row, n_slots, exp_avg, exp_avg_sq, row_step) -> None:
    """Shapes, dtypes and devices, from metadata only (no sync)."""
    if param.dim() != 2 or param.dtype not in DTYPES or param.stride(1) != 1:
        raise ValueError(
            f"sparse_adam_step updates 2-D fp32/bf16/fp16 tables with contiguous rows, got "
            f"{param.dtype} {tuple(param.shape)} strides {param.stride()}"
        )
    k, dim = row_ids.numel(), param.shape[1]
    if row_ids.dim() != 1 or row_ids.dtype != torch.int64:
        raise ValueError(f"row_ids must be int64 [k], got {row_ids.dtype} {tuple(row_ids.shape)}")
    if grad.shape != (k, dim) or grad.dtype not in DTYPES:
        raise ValueError(
            f"grad must be fp32/bf16/fp16 [{k}, {dim}] (one row per id), got {grad.dtype} {tuple(grad.shape)}"
        )
    if slot_of_row.shape != (param.shape[0],) or slot_of_row.dtype != torch.int32:
        raise ValueError(
            f"slot_of_row must be int32 [{param.shape[0]}], got {slot_of_row.dtype} {tuple(slot_of_row.shape)}"
        )
    if n_slots.shape != (1,) or n_slots.dtype != torch.int64:
        raise ValueError(f"n_slots must be an int64 [1] tensor, got {n_slots.dtype} {tuple(n_slots.shape)}")
    cap = exp_avg.shape[0]
    for name, t, shape in (
        ("exp_avg", exp_avg, (cap, dim)),
        ("exp_avg_sq", exp_avg_sq, (cap, dim)),
        ("row_step", row_step, (cap,)),
    ):
        if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    tensors = (row_ids, grad, param, slot_of_row, n_slots, exp_avg, exp_avg_sq, row_step)
    if any(t.device != param.device for t in tensors):
        raise ValueError(f"sparse_adam_step: every tensor must be on the table's device {param.device}")


@renamed_keywords(rows="row_ids")
def sparse_adam_step(
    row_ids: torch.Tensor,
    grad: torch.Tensor,
    param: torch.Tensor,
    slot_of_row: torch.Tensor,
    n_slots: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    pow1: torch.Tensor,
    pow2: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One lazy Adam step of `param`'s rows `row_ids` (unique, int64 [k]) with their summed
    gradient rows `grad` [k, dim], in place: the rows, their state and `n_slots` (int64 [1]).

    The state buffers must hold the fresh rows' slots (they take the next ones after
    ``n_slots``; a row whose slot would fall outside is skipped, its slot not recorded);
    `pow1`, `pow2` are `condmem.train.optim.beta_powers` tables of beta1, beta2 longer than
    any row's step count after this step.
    """
    _check(row_ids, grad, param, slot_of_row, n_slots, exp_avg, exp_avg_sq, row_step)
    k, dim = row_ids.numel(), param.shape[1]
    if k == 0:
        return
    row_ids, grad = row_ids.contiguous(), grad.contiguous()  # (as they come from a coalesced gradient)
    fresh = torch.empty(k, dtype=torch.int32, device=row_ids.device)
    _fresh_kernel[(cdiv(k, FRESH_BLOCK),)](row_ids, slot_of_row, fresh, k, param.shape[0], BLOCK=FRESH_BLOCK)
    rank = fresh.cumsum_(0)
    block_r, scalars, meta = _adam_launch(dim, lr, beta1, beta2, eps, param.is_cuda)
    _adam_kernel[(cdiv(k, block_r),)](
        row_ids,
        grad,
        param,
        slot_of_row,
        rank,
        n_slots,
        exp_avg,
        exp_avg_sq,
        row_step,
        pow1,
        pow2,
        k,
        param.shape[0],
        exp_avg.shape[0],
        param.stride(0),
        *scalars,
        P_KIND=DTYPES[param.dtype],
        **meta,
    )
    n_slots.add_(rank[-1])


@triton.jit(do_not_specialize=["k"])
def _rows_adam_kernel(
    grad_ptr,
    p_ptr,
    m_ptr,
    v_ptr,
    step_ptr,
    pow1_ptr,
    pow2_ptr,
    k,
    w,
    beta2,
    one_minus_beta2,
    eps,
    neg_lr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    V_CUDA: tl.constexpr,
    EXACT: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    live = r < k
    step = tl.load(step_ptr + r, mask=live, other=0.0) + 1.0
    bias1, bias2_sqrt = _bias_corrections(pow1_ptr, pow2_ptr, step, live)
    cm = live & (c < D)
    at = r * D + c
    g = tl.load(grad_ptr + at, mask=cm, other=0.0)
    m = tl.load(m_ptr + at, mask=cm, other=0.0)
    v = tl.load(v_ptr + at, mask=cm, other=0.0)
    m, v, delta = _adam_math(
        g, m, v, bias1, bias2_sqrt, w, beta2, one_minus_beta2, eps, neg_lr, LERP_SMALL, V_CUDA, EXACT
    )
    p = tl.load(p_ptr + at, mask=cm, other=0.0)
    tl.store(p_ptr + at, p + delta, mask=cm)
    tl.store(m_ptr + at, m, mask=cm)
    tl.store(v_ptr + at, v, mask=cm)
    tl.store(step_ptr + r, step, mask=live)


@renamed_keywords(rows="row_vectors")
def adam_rows_step(
    grad: torch.Tensor,
    row_vectors: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    pow1: torch.Tensor,
    pow2: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One Adam step of k rows held side by side, in place: `row_vectors` [k, dim], their moments and
    step counts ``row_step`` [k] (each + 1), with gradient rows `grad` [k, dim]; all fp32 and
    contiguous. The same arithmetic as `sparse_adam_step`, hence bit-equal on CUDA to
    ``row_step += 1; row_vectors += adam_rows_delta(grad, exp_avg, exp_avg_sq, row_step, ...)``.
    `pow1`, `pow2`: `beta_powers` tables longer than any step count after this step."""
    k, dim = grad.shape
    for name, t, shape in (
        ("grad", grad, (k, dim)),
        ("row_vectors", row_vectors, (k, dim)),
        ("exp_avg", exp_avg, (k, dim)),
        ("exp_avg_sq", exp_avg_sq, (k, dim)),
        ("row_step", row_step, (k,)),
    ):
        if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != grad.device:
            raise ValueError(
                f"adam_rows_step: {name} must be contiguous fp32 {shape} on {grad.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if k == 0:
        return
    block_r, scalars, meta = _adam_launch(dim, lr, beta1, beta2, eps, grad.is_cuda)
    _rows_adam_kernel[(cdiv(k, block_r),)](
        grad, row_vectors, exp_avg, exp_avg_sq, row_step, pow1, pow2, k, *scalars, **meta
    )
