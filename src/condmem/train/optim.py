"""Optimizers and schedule: AdamW for the backbone, sparse (lazy) Adam for Engram tables.

`SparseAdam` keeps Adam moments only for rows that have received a gradient: a row ->
slot map (int32, one entry per table row) and moment buffers that grow with the
number of distinct rows touched. A step costs time in the rows touched by the batch,
never the table size, and a row no batch has read holds no state and never moves.
Each row counts its own steps for the bias correction, so a row read at every step
follows dense Adam exactly.

On CUDA `SparseAdam.step` runs the Triton kernels of `condmem.ops.sparse_adam_triton`: a
few launches per table and no host sync (``n_slots`` is then a device tensor and a bound on
it, kept on the host, decides when the moment buffers must grow; only then is it read), with
rows, moments and steps bit-equal to the torch path's there (the kernel module says why, and
where on the CPU they part). Elsewhere the torch path runs.

`lr_factor` is linear warm-up then cosine decay to ``min_ratio``; each parameter group
keeps its own base learning rate (``base_lr``), so the tables' higher rate follows the
same curve. `clip_grad_norm_` clips by the global norm over dense and sparse gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from condmem.ops.triton_util import resolve_backend, triton_available


_POWERS: dict[tuple[float, str], torch.Tensor] = {}
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Table dtypes the fused (Triton) step updates."""


def beta_powers(beta: float, n: int, device: torch.device | str) -> torch.Tensor:
    """fp32 [> n]: ``beta ** k`` for k = 0, 1, ..., each computed in double precision and
    rounded once. A table look-up gives every row the same bias correction wherever it sits
    in a tensor of rows (a vectorized fp32 ``pow`` may round its scalar tail differently)."""
    key = (float(beta), str(torch.device(device)))
    table = _POWERS.get(key)
    if table is None or table.numel() <= n:
        size = max(1024, 1 << (n + 1).bit_length())
        table = torch.tensor([beta**k for k in range(size)], dtype=torch.float32).to(device)
        _POWERS[key] = table
    return table


def adam_rows_delta(
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    max_step: int,
) -> torch.Tensor:
    """One Adam step of k rows: updates the moments `m`, `v` (fp32 [k, dim]) in place and
    returns the change of the rows, ``-lr * update`` (fp32 [k, dim]).

    `t` is fp32 [k], each row's step count including this step, none above `max_step`.
    Every operation acts on each row alone, so a row's result does not depend on the other
    rows computed with it. `SparseAdam`'s torch path and the host-resident tables
    (`condmem.train.host_table`) both call this: the same rows with the same gradients get
    bit-identical updates on the same device. `SparseAdam`'s fused CUDA step
    (`condmem.ops.sparse_adam_triton`) does these ops in this order with torch's roundings,
    so it gives the same bits there (tests/train/test_sparse_adam_fused.py); change both together.
    """
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    shape = (-1,) + (1,) * (grad.dim() - 1)
    ti = t.long()
    bias1 = (1 - beta_powers(beta1, max_step, t.device)[ti]).view(shape)
    bias2_sqrt = (1 - beta_powers(beta2, max_step, t.device)[ti]).sqrt().view(shape)
    # torch.optim.Adam's formula: p -= lr/bias1 * m / (sqrt(v)/sqrt(bias2) + eps)
    update = (m / bias1) / (v.sqrt() / bias2_sqrt + eps)
    return update.mul_(-lr)


HEADROOM_STEPS = 4
"""When the fused path reads ``n_slots`` (its bound passed the capacity), the buffers grow
unless they hold this many more steps of all-new rows: so the next read is at least this many
steps away, not at every step while the count creeps below the capacity."""


class SparseAdam(torch.optim.Optimizer):
    """Lazy Adam for embedding tables trained with sparse gradients.

    Args:
        params: table parameters (2-D); their gradients may be sparse COO (``sparse=True``
            embeddings, sparse in the rows only) or dense (then every row with a nonzero
            gradient counts as touched).
        lr, betas, eps: as `torch.optim.Adam`. No weight decay: a row not read is not pulled
            anywhere.
        fused: None (default): the Triton step (`condmem.ops.sparse_adam_triton`) for fp32,
            bf16 and fp16 tables on CUDA, the torch path otherwise. True: the Triton step
            always (on CPU tensors only under ``TRITON_INTERPRET=1``: how the tests compare
            it with the torch path); False: the torch path always.

    State per parameter: ``slot_of_row`` int32 [num_rows] (-1: no state yet), ``exp_avg`` and
    ``exp_avg_sq`` [capacity, dim], ``row_step`` fp32 [capacity], ``n_slots`` (an int on the
    torch path; an int64 [1] device tensor on the fused path, with ``n_slots_bound``, a host
    int no smaller than it), ``steps`` (steps this table took, at least any row's).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
    ):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid SparseAdam hyper-parameters lr={lr} betas={betas} eps={eps}")
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))
        self.fused = fused

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["slot_of_row"] = torch.full((p.shape[0],), -1, dtype=torch.int32, device=p.device)
            state["exp_avg"] = torch.zeros(0, *p.shape[1:], dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(0, *p.shape[1:], dtype=torch.float32, device=p.device)
            state["row_step"] = torch.zeros(0, dtype=torch.float32, device=p.device)
            state["n_slots"] = 0
            state["steps"] = 0
        return state

    @staticmethod
    def slot_count(state: dict) -> int:
        """Slots in use (``n_slots``) as an int: a host sync when the fused path keeps it on the device."""
        n = state.get("n_slots", 0)
        return int(n) if torch.is_tensor(n) else n

    @staticmethod
    def _grow(state: dict, needed: int, num_rows: int) -> None:
        capacity = state["exp_avg"].shape[0]
        if needed <= capacity:
            return
        new_cap = min(num_rows, max(needed, 2 * capacity, 1024))
        for key in ("exp_avg", "exp_avg_sq", "row_step"):
            old = state[key]
            grown = old.new_zeros((new_cap, *old.shape[1:]))
            grown[: old.shape[0]] = old
            state[key] = grown

    @staticmethod
    def touched(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique row ids [k], their summed gradient rows [k, dim]) of a sparse or dense gradient."""
        if grad.is_sparse:
            grad = grad.coalesce()
            return grad.indices()[0], grad.values()
        row_ids = grad.flatten(1).ne(0).any(dim=1).nonzero().squeeze(1)
        return row_ids, grad[row_ids]

    @staticmethod
    def _check_grad(p: torch.Tensor) -> None:
        grad = p.grad
        if grad.layout not in (torch.strided, torch.sparse_coo):
            raise ValueError(f"SparseAdam takes dense or sparse COO gradients, got {grad.layout}")
        if grad.is_sparse and grad.sparse_dim() != 1:
            raise ValueError(
                f"SparseAdam needs gradients sparse in the rows only (sparse_dim 1, as nn.Embedding(sparse=True) "
                f"gives), got sparse_dim {grad.sparse_dim()} for a table of shape {tuple(p.shape)}"
            )

    def _use_fused(self, p: torch.Tensor) -> bool:
        """Whether `p` takes the Triton step (the `fused` argument's rule)."""
        if self.fused is False:
            return False
        fits = p.dim() == 2 and p.dtype in FUSED_DTYPES and p.stride(1) == 1
        if self.fused is None:
            return fits and p.is_cuda and triton_available()
        resolve_backend("triton", p.device, "SparseAdam(fused=True)")  # raises where it cannot run
        if not fits:
            raise ValueError(
                f"SparseAdam(fused=True) updates 2-D fp32/bf16/fp16 tables with contiguous rows, got "
                f"{p.dtype} {tuple(p.shape)}: use fused=None or False"
            )
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_grad(p)
                fused = self._use_fused(p)
                row_ids, grad = self.touched(p.grad)
                if row_ids.numel() == 0:
                    continue
                state = self._state(p)
                state["steps"] = state.get("steps", 0) + 1  # no row has taken more steps than this
                if fused:
                    self._fused_step(p, state, row_ids, grad, lr, beta1, beta2, eps)
                else:
                    self._torch_step(p, state, row_ids, grad, lr, beta1, beta2, eps)
        return loss

    @staticmethod
    def _torch_step(p, state: dict, row_ids, grad, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """The step in torch ops (any device): one host sync for the count of new rows."""
        grad = grad.float()
        state["n_slots"] = SparseAdam.slot_count(state)  # after fused steps: the device count, read once
        slot_of_row = state["slot_of_row"]
        slots = slot_of_row[row_ids].long()
        fresh = slots < 0
        n_fresh = int(fresh.sum())  # one host sync (the fused path keeps the count on the device)
        if n_fresh:
            first = state["n_slots"]
            SparseAdam._grow(state, first + n_fresh, p.shape[0])
            new_slots = torch.arange(first, first + n_fresh, device=p.device)
            slots[fresh] = new_slots
            slot_of_row[row_ids[fresh]] = new_slots.to(torch.int32)
            state["n_slots"] = first + n_fresh
        m = state["exp_avg"][slots]
        v = state["exp_avg_sq"][slots]
        t = state["row_step"][slots] + 1
        delta = adam_rows_delta(grad, m, v, t, lr, beta1, beta2, eps, state["steps"])
        p.index_add_(0, row_ids, delta.to(p.dtype))
        state["exp_avg"][slots] = m
        state["exp_avg_sq"][slots] = v
        state["row_step"][slots] = t

    @staticmethod
    def _reserve(state: dict, k: int, num_rows: int, device: torch.device) -> None:
        """Room for `k` more slots on the fused path: the host bound of ``n_slots`` grows by
        `k`; only when it could pass the capacity is the true count read (a host sync) and,
        when short of `HEADROOM_STEPS` steps' room, the buffers grown."""
        n = state["n_slots"]
        if not torch.is_tensor(n):  # a fresh state, the torch path's or a checkpoint's count
            state["n_slots"] = torch.full((1,), n, dtype=torch.int64, device=device)
            state["n_slots_bound"] = n
        bound = min(num_rows, state["n_slots_bound"] + k)
        if bound > state["exp_avg"].shape[0]:
            n = SparseAdam.slot_count(state)
            SparseAdam._grow(state, min(num_rows, n + HEADROOM_STEPS * k), num_rows)
            bound = min(num_rows, n + k)
        state["n_slots_bound"] = bound

    @staticmethod
    def _fused_step(p, state: dict, row_ids, grad, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """The step in Triton kernels: no host sync unless the buffers may have to grow."""
        from condmem.ops.sparse_adam_triton import sparse_adam_step

        SparseAdam._reserve(state, row_ids.numel(), p.shape[0], p.device)
        steps = state["steps"]
        sparse_adam_step(
            row_ids,
            grad,
            p,
            state["slot_of_row"],
            state["n_slots"],
            state["exp_avg"],
            state["exp_avg_sq"],
            state["row_step"],
            beta_powers(beta1, steps, p.device),
            beta_powers(beta2, steps, p.device),
            lr,
            beta1,
            beta2,
            eps,
        )

    # ------------------------------------------------------------------ checkpoints
    def export_state(self, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
        """Flat {name: tensor} of every table's state (buffers trimmed to the slots in use)."""
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                n = self.slot_count(state)
                base = names[p]
                out[f"{base}.slot_of_row"] = state["slot_of_row"]
                for key in ("exp_avg", "exp_avg_sq", "row_step"):
                    out[f"{base}.{key}"] = state[key][:n]
        return out

    def import_state(self, tensors: dict[str, torch.Tensor], names: dict[nn.Parameter, str]) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                base = names[p]
                if f"{base}.slot_of_row" not in tensors:
                    continue
                slot_of_row = tensors[f"{base}.slot_of_row"].to(p.device, torch.int32)
                if slot_of_row.shape != (p.shape[0],):
                    raise ValueError(
                        f"optimizer state for {base} has {slot_of_row.shape[0]} rows, the table {p.shape[0]}"
                    )
                self.state[p] = {
                    "slot_of_row": slot_of_row.clone(),
                    "exp_avg": tensors[f"{base}.exp_avg"].to(p.device, torch.float32).clone(),
                    "exp_avg_sq": tensors[f"{base}.exp_avg_sq"].to(p.device, torch.float32).clone(),
                    "row_step": tensors[f"{base}.row_step"].to(p.device, torch.float32).clone(),
                    "n_slots": int(tensors[f"{base}.exp_avg"].shape[0]),
                    "steps": int(tensors[f"{base}.row_step"].max()) if tensors[f"{base}.row_step"].numel() else 0,
                }

    def state_rows(self) -> int:
        """Rows holding optimizer state, over all tables (a host sync per table on the fused path)."""
        return sum(self.slot_count(s) for s in self.state.values())


def export_adamw_state(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """Flat {name.key: tensor} of a torch Adam/AdamW state (step counts as 0-d fp32 tensors)."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                out[f"{names[p]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(float(value))
    return out


def import_adamw_state(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], names: dict[nn.Parameter, str]
) -> None:
    for group in opt.param_groups:
        # Adam keeps `step` on the CPU, unless fused or capturable: then fp32 beside its weight,
        # where the step kernels read it (a CPU step there fails the first step after a resume).
        step_device = None if group.get("fused") or group.get("capturable") else torch.device("cpu")
        for p in group["params"]:
            base = names[p]
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if f"{base}.{key}" in tensors:
                    value = tensors[f"{base}.{key}"]
                    if key == "step":
                        state[key] = value.to(step_device or p.device, torch.float32).clone()
                    else:
                        state[key] = value.to(p.device, p.dtype).clone()
            if state:
                opt.state[p] = state


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier at `step` (0-based): linear warm-up, then cosine to `min_ratio`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizers, factor: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, adamw: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most `max_norm`; returns the norm before.

    Sparse gradients are coalesced (in place of the parameter's ``.grad``) so that each row
    counts once. No host sync: the scale is a tensor. `adamw`: see `scale_gradients_`.
    """
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
        grads.append(p.grad)
    return clip_gradients_(grads, max_norm, adamw)


@torch.no_grad()
def clip_gradients_(
    grads: list[torch.Tensor], max_norm: float, adamw: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """`clip_grad_norm_` on gradient tensors themselves (sparse ones already coalesced); the
    order given decides the last bits of the norm (`squared_norm`)."""
    if not grads:
        return torch.zeros(())
    total = squared_norm(grads).sqrt()
    if max_norm is None or max_norm <= 0:
        return total
    scale_gradients_(grads, clip_scale(total, max_norm), adamw)
    return total


def clip_scale(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings a global norm `total` (0-d) down to `max_norm`, at most 1."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The summed squares of `grads` (fp32, 0-d, on the first one's device; sparse ones coalesced).

    Dense gradients' norms come from one multi-tensor kernel a device (~4 launches a tensor
    otherwise: hundreds a step, which bound a step replayed as CUDA graphs); sparse ones from
    their values. The sum runs over the dense ones first, then the sparse ones, each in the
    order given."""
    device = grads[0].device
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if not g.is_sparse:
            by_device.setdefault(g.device, []).append(g)
    parts = [
        torch.stack(torch._foreach_norm(dense, 2, dtype=torch.float32)).square().sum().to(device)
        for dense in by_device.values()
    ]
    parts += [g.values().float().pow(2).sum().to(device) for g in grads if g.is_sparse]
    return torch.stack(parts).sum()


@torch.no_grad()
def scale_gradients_(
    grads: list[torch.Tensor], scale: torch.Tensor, adamw: torch.optim.Optimizer | None = None
) -> None:
    """Multiply `grads` in place by `scale` (0-d): dense ones by one multi-tensor kernel per
    device and dtype, sparse (coalesced) ones through their value storage.

    `adamw`: a fused `torch.optim.AdamW` whose step comes next. The dense gradients of its
    parameters are not multiplied here: it divides them by ``1 / scale`` as it reads them (its
    ``grad_scale``, the hook torch's gradient scaler uses, with which it also writes them back
    divided), so nearly every gradient is read once less. Where no clipping happens (scale 1) that
    gives the same bits; where it does, a gradient may differ from the multiplied one in its last
    bit. The caller clears ``grad_scale`` after the step.
    """
    deferred: set[int] = set()
    if adamw is not None and adamw.defaults.get("fused"):
        deferred = {id(p.grad) for group in adamw.param_groups for p in group["params"] if p.grad is not None}
        adamw.grad_scale = scale.reciprocal()
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:
            g._values().mul_(scale.to(g.device, g.dtype))
        elif id(g) not in deferred:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), dense in groups.items():
        torch._foreach_mul_(dense, scale.to(device, dtype))


def build_optimizers(
    model,
    lr: float,
    table_lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    table_betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
):
    """(AdamW over the backbone, SparseAdam over the tables or None).

    Matrices (dim >= 2: linear weights, token embedding) get weight decay; norms, gate
    weights and the ShortConv kernel do not.
    """
    decay, no_decay = [], []
    for name, p in model.backbone_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and not name.endswith("short_conv.weight") else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "base_lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "base_lr": lr},
    ]
    kwargs = {}
    if fused is not None:
        kwargs["fused"] = fused
    adamw = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kwargs)
    tables = [p for _, p in model.table_parameters()]
    sparse = None
    if tables:
        sparse = SparseAdam([{"params": tables, "base_lr": table_lr}], lr=table_lr, betas=table_betas, eps=eps)
    return adamw, sparse
