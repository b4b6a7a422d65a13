"""A table's gradient reduced to one row per distinct row read: the sparse lookup's backward.

`table_lookup(weight, row_ids)` reads rows like ``F.embedding(row_ids, weight)`` and gives
``weight`` a *coalesced* sparse gradient: the distinct row ids in ascending order and, for
each, the sum of the gradients of every lookup that read it, added in the order of the
lookups. That is the order in which ``torch.sparse`` coalesces an embedding's gradient on
CUDA (a stable sort, then one sequential fp32 sum per row), so the values are bit-equal to
``F.embedding(..., sparse=True)`` followed by ``.coalesce()``, without the uncoalesced
[lookups, dim] gradient and the sort of it after the backward:

* the forward sorts the row ids (stable) and finds where each distinct row's run ends,
  while the backbone's forward queues behind it (one host sync: the number of distinct
  rows, which the sparse gradient's shape needs);
* the backward is one kernel (`triton.py`): a program per distinct row sums its run's
  gradient rows, several loads in flight at once, in the run's order.

`row_sums_reference` is the plain torch sum the kernel is held to.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from condmem.ops.row_grad.reference import row_sums_reference
from condmem.ops.triton_util import resolve_backend
from condmem.utils.renamed import renamed_keywords


@renamed_keywords(rows="distinct_ids")
def sorted_runs(row_ids: torch.Tensor, distinct_ids: torch.Tensor | None = None):
    """(order, distinct ids, run ends) of the flattened row ids: ``order`` int64 [n] sorts the
    ids stably (equal ids keep their lookup order), the distinct ids int64 [k] ascending,
    ``ends`` int64 [k] the exclusive end of each distinct id's run in ``order``.

    `distinct_ids`, when the caller knows them already (every distinct id, ascending, on the
    ids' device), spare the host sync of finding them."""
    flat = row_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    if distinct_ids is not None:
        ends = torch.searchsorted(sorted_ids, distinct_ids.to(sorted_ids.dtype), right=True)
        return order, distinct_ids.long(), ends
    distinct_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    return order, distinct_ids.long(), counts.cumsum(0)  # int64: the sparse gradient's indices as they are


def coalesced_gradient(grad_rows: torch.Tensor, runs, shape, backend: str | None = None) -> torch.Tensor:
    """The sparse COO gradient [shape] of a lookup whose `sorted_runs` are `runs`, from the
    gradient of its rows (``grad_rows`` [..., dim], lookup order), flagged coalesced."""
    order, distinct_ids, ends = runs
    values = row_sums(grad_rows.reshape(-1, shape[1]), order, ends, backend)
    with warnings.catch_warnings():  # distinct, ascending ids of this table by construction
        warnings.filterwarnings("ignore", "Sparse invariant checks")
        return torch.sparse_coo_tensor(
            distinct_ids.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False
        )


def row_sums(grad_rows: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, backend: str | None = None):
    """[k, dim] in ``grad_rows``' dtype: row u sums ``grad_rows[order[ends[u-1]:ends[u]]]`` in
    fp32, first to last (`row_sums_reference` is the plain version)."""
    if resolve_backend(backend, grad_rows.device, "row_sums") == "torch":
        return row_sums_reference(grad_rows, order, ends)
    from condmem.ops.row_grad.triton import row_sums_triton

    return row_sums_triton(grad_rows, order, ends)


# Autograd stores a sparse gradient it can take over as a new tensor over the same indices
# and values, without the coalesced flag; a hook after accumulation sets the flag again
# when the parameter's gradient is exactly the one this lookup made (its indices are ours),
# so clipping and the optimizer do not sort it again. A sum with another gradient has new
# indices and stays uncoalesced. The distinct row ids a backward made are an attribute of the parameter
# (tensors compare elementwise, so they cannot key a weak dictionary), dropped by the hook
# and by the next forward.
_DISTINCT_IDS = "_condmem_lookup_ids"


def _flag_coalesced(weight: torch.Tensor) -> None:
    distinct_ids = weight.__dict__.pop(_DISTINCT_IDS, None)
    grad = weight.grad
    if distinct_ids is None or grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    indices = grad._indices()
    if indices.data_ptr() == distinct_ids.data_ptr() and indices.shape[1] == distinct_ids.numel():
        grad._coalesced_(True)


def _hook_once(weight: torch.Tensor) -> None:
    """Register `_flag_coalesced` on `weight` unless it is there (looked up among the hooks
    themselves: a pickled copy keeps the parameter's attributes but not its hooks)."""
    hooks = getattr(weight, "_post_accumulate_grad_hooks", None) or {}
    if _flag_coalesced not in hooks.values():
        weight.register_post_accumulate_grad_hook(_flag_coalesced)


class _TableLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, row_ids: torch.Tensor, backend: str | None):
        out = F.embedding(row_ids, weight)
        ctx.save_for_backward(*sorted_runs(row_ids))
        ctx.weight_shape = weight.shape
        ctx.backend = backend
        ctx.weight = None
        if weight.is_leaf and weight.requires_grad:
            weight.__dict__.pop(_DISTINCT_IDS, None)  # a backward that never reached accumulation left it
            ctx.weight = weight
            _hook_once(weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's sums are not differentiated again
    def backward(ctx, grad_out: torch.Tensor):
        runs = ctx.saved_tensors
        grad = coalesced_gradient(grad_out, runs, ctx.weight_shape, ctx.backend)
        if ctx.weight is not None:
            setattr(ctx.weight, _DISTINCT_IDS, runs[1])
        return grad, None, None


def table_lookup(weight: torch.Tensor, row_ids: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``F.embedding(row_ids, weight)`` whose gradient for ``weight`` is sparse and already
    coalesced (see the module docstring); ``backend`` picks the backward's kernel
    (`triton_util.resolve_backend`: Triton on CUDA, torch elsewhere)."""
    return _TableLookup.apply(weight, row_ids, backend)


__all__ = ["coalesced_gradient", "row_sums", "row_sums_reference", "sorted_runs", "table_lookup"]
