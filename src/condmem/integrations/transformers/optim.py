"""Optimizers for a Hugging Face model with Engram: AdamW for the backbone, condmem's SparseAdam for tables.

`engram_param_groups` splits the parameters; `engram_optimizer` returns one
`torch.optim.Optimizer` that steps both, for a plain loop or for `Trainer`
(``optimizers=(engram_optimizer(model, lr), None)``: Trainer's scheduler then scales every
group, the tables' higher rate included, along the same curve). Its ``param_groups`` are
the inner optimizers' own group dicts, so a scheduler writing ``group["lr"]`` writes theirs.

Tables follow the paper: Adam at a higher rate (5x by default), no weight decay, state
only for rows a batch has read. Gradient clipping: in a plain loop pass ``max_grad_norm``
here, which clips dense and sparse gradients by one global norm before each step; with
`Trainer` or `EngramTrainer` use their ``max_grad_norm``.

An optimizer that cannot step sparse gradients (AdamW, what a plain `Trainer` builds) is
refused at its first step, before any weight moves, with a message naming `EngramTrainer`
and `engram_optimizer` (`guard_sparse_tables`), instead of torch's "Adam does not support
sparse gradients".

`Trainer` measures and clips with ``torch.nn.utils.clip_grad_norm_``, which before torch
2.14 has no norm for a sparse gradient (``aten::linalg_vector_norm`` has no ``SparseCPU`` /
``SparseCUDA`` kernel). `enable_sparse_grad_norm` (called by `EngramOptimizer`) registers
one where torch lacks it: the norm of the coalesced gradient, each row counted once, equal
to the dense gradient's norm. It adds a kernel where there was none; nothing else changes.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from condmem.integrations.transformers.adapter import EngramModelError, get_engram
from condmem.train.optim import SparseAdam, clip_grad_norm_


log = logging.getLogger("condmem.integrations.transformers")
_SPARSE_NORM_LIB = None  # the torch.library registration, kept alive for the process
_STEP_GUARD = None  # the global optimizer step pre-hook of `guard_sparse_tables`
_TABLE_NAME = "_condmem_table_name"  # attribute naming a sparse Engram table parameter
_GUARDED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list]]" = weakref.WeakKeyDictionary()


def _sparse_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    # A positive-order norm over every element counts only stored values, once each after coalescing.
    if dim is None and not keepdim and float(ord) > 0:
        values = self.coalesce().values()
        if values.numel() == 0:
            return torch.zeros((), dtype=dtype or self.dtype, device=self.device)
        return torch.linalg.vector_norm(values, ord, dtype=dtype)
    return torch.linalg.vector_norm(self.to_dense(), ord, dim, keepdim, dtype=dtype)


def _has_sparse_norm(device: str) -> bool:
    probe = torch.sparse_coo_tensor(
        torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 2), (2, 2), device=device, check_invariants=True
    )
    try:
        torch.linalg.vector_norm(probe)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def enable_sparse_grad_norm() -> bool:
    """Give ``torch.linalg.vector_norm`` (so ``torch.nn.utils.clip_grad_norm_``) a sparse kernel where torch has none.

    Idempotent; returns True when a kernel was registered (now or before). The norm is the
    coalesced tensor's (equal to the dense tensor's); clipping then scales the sparse
    gradient in place, which torch already supports.
    """
    global _SPARSE_NORM_LIB
    if _SPARSE_NORM_LIB is not None:
        return True
    keys = [
        key
        for key, device in (("SparseCPU", "cpu"), ("SparseCUDA", "cuda"))
        if (device == "cpu" or torch.cuda.is_available()) and not _has_sparse_norm(device)
    ]
    if not keys:
        return False
    lib = torch.library.Library("aten", "IMPL")
    for key in keys:
        lib.impl("linalg_vector_norm", _sparse_vector_norm, key)
    _SPARSE_NORM_LIB = lib
    log.info(
        "torch %s has no norm for sparse gradients (%s): condmem registered one (the coalesced gradient's "
        "norm), so clip_grad_norm_ (e.g. Trainer's) takes the Engram tables' gradients",
        torch.__version__,
        ", ".join(keys),
    )
    return True


def _accepts_sparse(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(
        optimizer, (EngramOptimizer, SparseAdam, torch.optim.SparseAdam, torch.optim.SGD, torch.optim.Adagrad)
    )


def _tables_of(optimizer: torch.optim.Optimizer) -> list:
    """The sparse Engram tables among `optimizer`'s parameters (found once per optimizer and group count)."""
    groups = len(optimizer.param_groups)
    known = _GUARDED.get(optimizer)
    if known is None or known[0] != groups:
        tables = [p for g in optimizer.param_groups for p in g["params"] if hasattr(p, _TABLE_NAME)]
        known = (groups, tables)
        _GUARDED[optimizer] = known
    return known[1]


def _refuse_dense_step(optimizer, args, kwargs) -> None:
    """Global step pre-hook: an optimizer that cannot take sparse gradients meets an Engram table's."""
    if _accepts_sparse(optimizer):
        return
    sparse = [getattr(p, _TABLE_NAME) for p in _tables_of(optimizer) if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise EngramModelError(
            f"{type(optimizer).__name__} cannot step the sparse gradients of the Engram tables ({', '.join(sparse)}): "
            "train with condmem's optimizer: transformers' EngramTrainer(model=..., args=...) (it builds one), "
            "Trainer(..., optimizers=(engram_optimizer(model, lr=...), None)), or opt = engram_optimizer(model, "
            "lr=...) in a plain loop; add_engram(..., sparse_tables=False) gives dense table gradients instead"
        )


def guard_sparse_tables(model: nn.Module) -> None:
    """Mark `model`'s sparse Engram tables so that a dense optimizer stepping them raises condmem's message.

    A global ``torch.optim`` step pre-hook (registered once) checks an optimizer's marked tables
    before each step: with a sparse gradient and an optimizer that cannot take it (not
    `engram_optimizer`'s, SparseAdam, SGD or Adagrad), it raises `EngramModelError` naming
    `EngramTrainer` and `engram_optimizer`, before any weight moves. Also gives torch a sparse
    gradient norm (`enable_sparse_grad_norm`): `Trainer` clips before it steps.
    """
    global _STEP_GUARD
    adapter = get_engram(model)
    names = {id(p): name for name, p in model.named_parameters()}
    for engram in adapter.engrams.values():
        weight = engram.table.weight
        if engram.table.sparse and weight.device.type != "meta":
            setattr(weight, _TABLE_NAME, names.get(id(weight), f"layer {engram.layer_id} table"))
    enable_sparse_grad_norm()
    if _STEP_GUARD is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_GUARD = register_optimizer_step_pre_hook(_refuse_dense_step)


def engram_param_groups(model: nn.Module, *, weight_decay: float = 0.0) -> dict[str, list[dict]]:
    """``{"backbone": [AdamW groups], "tables": [SparseAdam group]}``; frozen parameters are left out.

    Backbone matrices (dim >= 2) get `weight_decay`; biases, norms, gate weights and the
    ShortConv kernel do not.
    """
    tables = {id(e.table.weight) for e in get_engram(model).engrams.values()}
    decay, no_decay, table_params = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in tables:
            table_params.append(p)
        elif p.dim() >= 2 and not name.endswith("short_conv.weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    backbone = [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    return {"backbone": backbone, "tables": [{"params": table_params}] if table_params else []}


class EngramOptimizer(torch.optim.Optimizer):
    """AdamW (backbone) and SparseAdam (tables) stepped as one optimizer.

    Args:
        backbone: the AdamW (or any dense optimizer), or None.
        tables: the SparseAdam over the tables, or None.
        max_grad_norm: clip all gradients (dense and sparse) to this global norm before each
            step; 0 or None: no clipping.
    """

    def __init__(
        self, backbone: torch.optim.Optimizer | None, tables: SparseAdam | None, max_grad_norm: float | None = None
    ):
        self.optimizers = [o for o in (backbone, tables) if o is not None]
        if not self.optimizers:
            raise ValueError("EngramOptimizer needs at least one of backbone / tables")
        self.backbone, self.tables, self.max_grad_norm = backbone, tables, max_grad_norm
        if tables is not None:
            enable_sparse_grad_norm()  # a Trainer driving this optimizer clips with torch's clip_grad_norm_
        # The inner optimizers' own group dicts: a scheduler setting group["lr"] here sets it there.
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm:
            clip_grad_norm_(self._params(), self.max_grad_norm)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict) -> None:
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)

    @property
    def state(self):
        merged = {}
        for opt in getattr(self, "optimizers", []):
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty state; ours lives in the inner ones
        pass


def engram_optimizer(
    model: nn.Module,
    lr: float,
    *,
    table_lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    table_betas: tuple[float, float] | None = None,
    eps: float = 1e-8,
    max_grad_norm: float | None = None,
) -> EngramOptimizer:
    """One optimizer for a model with Engram: AdamW at `lr`, tables with SparseAdam at `table_lr` (default 5 x lr).

    Example (Trainer)::

        opt = engram_optimizer(model, lr=3e-4)
        Trainer(model, TrainingArguments(...), optimizers=(opt, None), ...)
    """
    groups = engram_param_groups(model, weight_decay=weight_decay)
    backbone = torch.optim.AdamW(groups["backbone"], lr=lr, betas=betas, eps=eps) if groups["backbone"] else None
    tables = None
    if groups["tables"]:
        tables = SparseAdam(
            groups["tables"], lr=5 * lr if table_lr is None else table_lr, betas=table_betas or betas, eps=eps
        )
    return EngramOptimizer(backbone, tables, max_grad_norm=max_grad_norm)
