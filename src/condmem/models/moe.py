"""Routed experts: a top-k mixture of SwiGLU experts, its balancing and its router statistics.

    scores:  s = softmax(x W_r) or sigmoid(x W_r)       [N, E], fp32
    choose:  the top_k experts of s + b                 b: per-expert bias, selection only
    weights: g_j = s_j / sum_{chosen} s  (renormalize)  or g_j = s_j; times routed_scale
    experts: y = sum_j g_j * SwiGLU_{e_j}(x)            (+ the block's shared expert, outside)

Balancing (DeepSeek-V3's auxiliary-loss-free method): after each training forward the
bias moves by ``bias_rate * sign(mean load - load_i)``, so an expert that got fewer tokens
than the mean is chosen more often next time; it never enters the weights or a gradient.
The Switch/DeepSeekMoE loss ``aux = E * sum_i f_i * P_i`` (f_i: share of the N*top_k
choices on expert i, P_i: mean normalised score) is computed in every training forward,
for the statistics and for `DecoderLM.aux_loss` (added to the training loss when its
coefficient is above 0).

`RouterStats` (``MoE.stats``) sums each expert's load, the chosen experts' score mass and
the balancing loss over the training forwards since its last `reset`, without a
device-to-host copy; `router_statistics` reads every layer of a model.

The experts run as grouped GEMMs: the N*top_k (token, expert) pairs are sorted by expert
into one buffer in which expert i owns a contiguous slice, padded to a multiple of 8 rows
(at least 8, so no group is empty; the last group runs to the end of the buffer). The
buffer's size, N*top_k rounded up to 8 plus 8*E, does not depend on the routing, so the
layer needs no device-to-host copy. Each GEMM over the slices is either one
`torch._grouped_mm` (CUDA, bf16 under autocast, compute capability 9.0+) or one matmul per
expert over its slice (everywhere else). Padding rows are zeros, are never read back, and
add nothing to any gradient. The combine gathers each pair's row back and sums a token's
top_k rows in a fixed order. The layout (each pair's row, and each row's pair) is a counting sort
by expert (`condmem.ops.moe_layout`: Triton on CUDA, inside a compiled graph too). Pairs move into the
buffer and back by gathers in both directions, never by a scatter-add, which deterministic mode
would sort.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from condmem.ops.grouped_weight_grad import grouped_weight_grad
from condmem.ops.moe_layout import expert_layout

GROUP_ALIGN = 8
"""Rows of a group are padded to a multiple of this: grouped GEMM kernels need 16-byte
aligned groups in bf16, the weight gradient's contraction runs over them."""

SCORES = ("softmax", "sigmoid")
"""Router score functions (`MoEConfig.score`)."""


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (Switch Transformer, DeepSeekMoE's expert-level balance loss).

    Args:
        probs: fp32 [N, E] router probabilities of N tokens (rows summing to 1).
        experts: int64 [N, top_k] the experts each token chose.
        n_experts: E.

    Returns a scalar: 1.0 when the choices and the probabilities are uniform, up to E when
    every token goes to one expert with probability 1. Gradients flow through `probs`.
    """
    counts = expert_counts(experts, n_experts).to(probs.dtype)
    share = counts / max(1, experts.numel())
    return n_experts * (share * probs.mean(0)).sum()


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int64 [E]: how many of the (token, expert) pairs in `experts` (int [N, k], every id < E) went to each expert.

    Under `torch.compile` a comparison with every expert id summed over the pairs (a fused
    reduction of a fixed shape), since `bincount`'s output size depends on the data and would
    break the graph; eager, `bincount`. Both count exactly."""
    flat = experts.flatten()
    if torch.compiler.is_compiling():
        return (flat[:, None] == torch.arange(n_experts, device=flat.device)).sum(0)
    return torch.bincount(flat, minlength=n_experts)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs the fast kernel for `x`: CUDA, bf16, compute capability >= 9.0."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, *, use_grouped_mm: bool) -> torch.Tensor:
    """Rows ``ends[i-1]:ends[i]`` of `x` [M, K] times ``weight[i].T`` ([E, N, K], Linear layout) -> [M, N],
    in x's dtype (the weight is cast to it, as autocast casts a Linear's).

    `ends` (int32 [E]) must end at M. `use_grouped_mm`: one `torch._grouped_mm` launch (`_GroupedGemm`);
    else one matmul per group (which reads `ends` on the host).
    """
    if use_grouped_mm:
        return _GroupedGemm.apply(x, weight, ends)
    return _per_group_linear(x, weight.to(x.dtype), ends)


class _GroupedGemm(torch.autograd.Function):
    """`grouped_linear` by `torch._grouped_mm`, with the weight's gradient by `grouped_weight_grad`.

    torch's own backward computes the weight gradient in bf16 (a GEMM grouped along its
    contraction), and autograd then widens it to the fp32 weight's dtype: a rounding and a pass
    over every expert weight's gradient. Here one kernel accumulates in fp32 and writes the
    weight's dtype directly. The input's gradient is torch's grouped GEMM, as in its own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        w = weight.to(x.dtype)
        ctx.save_for_backward(x, w, ends)
        ctx.weight_dtype = weight.dtype
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, w, offs=ends) if ctx.needs_input_grad[0] else None
        dw = grouped_weight_grad(grad, x, ends, ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


@torch.compiler.disable  # the group bounds are read on the host: traced, every new routing would recompile
def _per_group_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    bounds = [0, *ends.tolist()]
    return torch.cat([x[bounds[i] : bounds[i + 1]] @ weight[i].T for i in range(weight.shape[0])])


def dispatch_layout(
    experts: torch.Tensor, n_experts: int, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each (token, expert) pair goes in the padded expert-sorted buffer.

    Args:
        experts: int64 [N, k] chosen experts.
        counts: ``bincount(experts.flatten(), minlength=n_experts)`` if the caller has it.

    Returns (dest int64 [N*k]: each pair's row, pairs in token-major order; ends int32 [E]:
    the end of each expert's rows; num_rows: the buffer's size, N*k rounded up to GROUP_ALIGN plus
    GROUP_ALIGN*E). Pairs of one expert keep their token order.
    """
    dest, _, ends, num_rows = _layout(experts, n_experts, counts)
    return dest, ends, num_rows


def _layout(experts: torch.Tensor, n_experts: int, counts: torch.Tensor | None):
    """`dispatch_layout`'s (dest, ends, num_rows) and, after dest, the pair each buffer row holds
    (int64 [num_rows], N*k for a padding row): `expert_layout`'s inverse of dest."""
    flat = experts.flatten()
    pairs = flat.numel()
    if counts is None:
        counts = expert_counts(flat, n_experts)
    padded = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).clamp_min(GROUP_ALIGN)
    num_rows = -(-pairs // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * n_experts  # every group end aligned
    ends = torch.cumsum(padded, 0)
    ends[-1] = num_rows  # the last group takes the unused rows: the groups cover the buffer
    dest, src = expert_layout(flat, ends - padded, num_rows)
    return dest, src, ends.to(torch.int32), num_rows


@torch.compiler.disable  # a collective: run as it is between compiled parts
def _summed_over_ranks(load: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(load)
    return load


class _MoveRows(torch.autograd.Function):
    """``y = x[take]``; the gradient goes back the same way, ``dx = dy[back]``. `take` and `back` are
    each other's inverse on the rows they move, each row moved at most once: both directions are
    gathers, where autograd's backward of a gather is a scatter-add, which deterministic mode sorts
    on CUDA. With `take_pads`, `take` may hold ``len(x)``, which reads a row of zeros (a padding row
    of the expert buffer), and `back` holds no such index; without it, the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, take: torch.Tensor, back: torch.Tensor, take_pads: bool) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.back_pads = not take_pads
        return _rows(x, take, take_pads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _rows(grad, back, ctx.back_pads), None, None, None


def _rows(x: torch.Tensor, index: torch.Tensor, pads: bool) -> torch.Tensor:
    # Only the side that may read padding pays for the zero row: appending it copies x whole
    # wherever x comes from a kernel a compiled graph cannot fuse into the gather (a GEMM's output).
    return (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) if pads else x).index_select(0, index)


class RouterStats(nn.Module):
    """Router statistics of one MoE layer, summed over the training forwards since `reset`.

    The sums are device buffers updated in place (not saved with the weights): `update` makes
    no host copy and traces into a compiled block without a graph break; `summary` reads the
    sums once. Not thread-safe; one per layer (``MoE.stats``).
    """

    def __init__(self, n_experts: int, top_k: int, device=None):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        i64, f64 = dict(dtype=torch.int64, device=device), dict(dtype=torch.float64, device=device)
        self.register_buffer("load", torch.zeros(n_experts, **i64), persistent=False)
        # forwards, tokens, forwards with a balancing loss; summed gate mass and balancing loss
        self.register_buffer("counts", torch.zeros(3, **i64), persistent=False)
        self.register_buffer("sums", torch.zeros(2, **f64), persistent=False)

    def _apply(self, fn, recurse=True):
        # Moves with the model but keeps its dtypes: a model cast to bf16 still counts in int64 / fp64.
        dtypes = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
        return self

    @property
    def forwards(self) -> int:
        return int(self.counts[0])

    @property
    def tokens(self) -> int:
        return int(self.counts[1])

    def reset(self) -> None:
        """Start a new window."""
        for t in (self.load, self.counts, self.sums):
            t.zero_()

    @torch.no_grad()
    def update(self, counts: torch.Tensor, chosen_mass: torch.Tensor, balance_loss: torch.Tensor | None) -> None:
        """Add one forward.

        Args:
            counts: int64 [E] tokens each expert received (a token counts once per expert it chose).
            chosen_mass: fp32 [N] each token's chosen experts' share of its total score (before
                renormalisation; softmax: their summed probability).
            balance_loss: the forward's `load_balancing_loss` (None: not computed).
        """
        if counts.shape != (self.n_experts,):
            raise ValueError(f"RouterStats.update: counts has shape {tuple(counts.shape)}, want ({self.n_experts},)")
        self.load.add_(counts.to(torch.int64))
        self.counts[0] += 1
        self.counts[1] += chosen_mass.shape[0]
        self.sums[0] += chosen_mass.detach().double().sum()
        if balance_loss is not None:
            self.counts[2] += 1
            self.sums[1] += balance_loss.detach().double()

    def summary(self) -> dict:
        """The window's statistics (one host copy).

        Returns a dict: ``forwards``, ``tokens``; ``load`` (tokens per expert), ``load_mean``,
        ``load_max``, ``max_over_mean``, ``load_cv`` (population standard deviation / mean);
        ``busiest_share``: share of the tokens that went to the busiest expert (uniform routing:
        top_k / E); ``dead``: experts with load 0 and ``dead_experts`` their indices;
        ``used_share``: experts with load > 0 over E; ``gate_mass``: mean share of a token's
        score on its chosen experts, before renormalisation; ``balance_loss``: mean
        `load_balancing_loss` per forward (None when none was computed). An empty window gives
        ``tokens`` 0 and None for the rest.
        """
        forwards, tokens, balanced = self.counts.tolist()
        out = {"forwards": forwards, "tokens": tokens, "experts": self.n_experts, "top_k": self.top_k}
        if tokens == 0:
            keys = ("load", "load_mean", "load_max", "max_over_mean", "load_cv", "busiest_share", "dead")
            return {**out, **dict.fromkeys(keys), "dead_experts": None, "used_share": None, "gate_mass": None,
                    "balance_loss": None}  # fmt: skip
        load = self.load.cpu().tolist()
        mean = sum(load) / self.n_experts
        var = sum((v - mean) ** 2 for v in load) / self.n_experts
        dead = [i for i, v in enumerate(load) if v == 0]
        out.update(
            load=load,
            load_mean=mean,
            load_max=max(load),
            max_over_mean=max(load) / mean,
            load_cv=math.sqrt(var) / mean,
            busiest_share=max(load) / tokens,
            dead=len(dead),
            dead_experts=dead,
            used_share=(self.n_experts - len(dead)) / self.n_experts,
            gate_mass=float(self.sums[0]) / tokens,
            balance_loss=float(self.sums[1]) / balanced if balanced else None,
        )
        return out


def top_experts(select: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [N, k]: each row's k largest entries of `select` [N, E], largest first, as
    ``torch.topk(select, k).indices``.

    Under `torch.compile`, k passes of an argmax, each masking the pick before: reductions that
    fuse with the scores', where topk is a library kernel and a sort of its own. The same
    experts wherever no two of a row's values tie exactly (a tie goes to the lower id)."""
    if not torch.compiler.is_compiling():
        return torch.topk(select, k, dim=-1).indices
    ids = torch.arange(select.shape[-1], device=select.device)
    picks = []
    for _ in range(k):
        pick = select.argmax(-1)
        picks.append(pick)
        select = torch.where(ids == pick[:, None], float("-inf"), select)
    return torch.stack(picks, -1)


def _chosen(values: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """`values` [N, E] at the chosen `experts` [N, k]: [N, k].

    Where gradients flow, picked by a mask over the experts instead of a gather: one term plus
    exact zeros, so the same bits forward and backward, and a backward with no scatter-add
    (which deterministic mode sorts on CUDA). Without gradients (inference), the gather: the
    same bits with no [N, k, E] temporary."""
    if not torch.is_grad_enabled():
        return values.gather(-1, experts)
    mask = experts.unsqueeze(-1) == torch.arange(values.shape[-1], device=values.device)
    return torch.where(mask, values.unsqueeze(1), 0.0).sum(-1)


class MoE(nn.Module):
    """The routed experts of one block.

    Args:
        dim: width of the residual stream.
        n_experts, top_k, expert_hidden, score, renormalize, routed_scale, bias_rate: see
            `MoEConfig` (`from_config` takes one).

    Parameters: ``router.weight`` [E, dim], ``w13`` [E, 2*hidden, dim] (gate and up
    projections of each expert, in nn.Linear layout), ``w2`` [E, dim, hidden]. Buffer (with
    ``bias_rate`` > 0 only): ``expert_bias`` fp32 [E], the selection bias, saved with the weights.

    Shapes: x [..., dim] -> [..., dim]. In training mode the forward keeps its
    load-balancing loss in ``aux_loss`` (read by `DecoderLM.aux_loss`), moves the selection
    bias, and adds to ``stats``. With ``top_k`` 1 and ``renormalize``, every weight is 1:
    the router then learns from the balancing loss only.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        expert_hidden: int,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        routed_scale: float = 1.0,
        bias_rate: float = 1e-3,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"MoE score must be one of {list(SCORES)}, got {score!r}")
        self.dim, self.n_experts, self.top_k, self.hidden = dim, n_experts, top_k, expert_hidden
        self.score, self.renormalize, self.routed_scale, self.bias_rate = score, renormalize, routed_scale, bias_rate
        self.router = nn.Linear(dim, n_experts, bias=False, device=device, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * expert_hidden, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, expert_hidden, device=device, dtype=dtype))
        if self.w13.device.type != "meta":
            nn.init.normal_(self.w13, std=1 / math.sqrt(dim))
            nn.init.normal_(self.w2, std=1 / math.sqrt(expert_hidden))
        bias = torch.zeros(n_experts, device=device, dtype=torch.float32) if bias_rate > 0 else None
        self.register_buffer("expert_bias", bias)
        self.aux_loss: torch.Tensor | None = None
        self.stats = RouterStats(n_experts, top_k, device=device)
        self.use_grouped_mm: bool | None = None
        """None: `torch._grouped_mm` where `grouped_mm_available`; True / False forces a backend."""

    @classmethod
    def from_config(cls, dim: int, cfg, device=None, dtype=None) -> MoE:
        """The layer of a `MoEConfig` `cfg` at residual width `dim`."""
        return cls(
            dim,
            cfg.n_experts,
            cfg.top_k,
            cfg.expert_hidden,
            score=cfg.score,
            renormalize=cfg.renormalize,
            routed_scale=cfg.routed_scale,
            bias_rate=cfg.bias_rate,
            device=device,
            dtype=dtype,
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits fp32 [N, E] of tokens x [N, dim].

        The router runs in fp32 even under autocast: a bf16 logit would flip near-tied choices."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.router.weight.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router scores fp32 [N, E], chosen experts int64 [N, k] and their weights fp32 [N, k].

        Scores are the softmax or the sigmoid of the logits. Experts are the top_k of scores +
        ``expert_bias`` (descending); weights are the chosen experts' scores, divided by their
        sum when ``renormalize``, times ``routed_scale``. The renormalised weights are computed
        as a softmax over the chosen experts' log-scores (the same function): a chosen score
        that underflows to 0 (a saturated softmax, an expert the bias chose) gives no 0/0.

        The chosen experts' values are picked by `_chosen` (a mask where gradients flow)."""
        logits = self.logits(x)
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        select = scores if self.expert_bias is None else scores + self.expert_bias
        experts = top_experts(select, self.top_k)
        if self.renormalize:
            log_scores = logits if self.score == "softmax" else F.logsigmoid(logits)
            weights = torch.softmax(_chosen(log_scores, experts), dim=-1)
        else:
            weights = _chosen(scores, experts)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return scores, experts, weights

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """``expert_bias += bias_rate * sign(mean load - load)`` from one forward's `counts` (int [E]).

        Across data-parallel ranks (torch.distributed initialised, world > 1) the counts are
        summed first, so every rank moves its bias the same way. In one process this traces
        into a compiled block; the collective is left out of it."""
        if self.expert_bias is None:
            return
        load = counts.to(torch.float32)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                load = _summed_over_ranks(load)
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.bias_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        scores, experts, weights = self.route(x)
        counts = expert_counts(experts, self.n_experts)
        if self.training:
            total = scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            normed = scores if self.score == "softmax" else scores / total
            self.aux_loss = load_balancing_loss(normed, experts, self.n_experts)
            chosen = scores.detach().gather(-1, experts).sum(-1) / total.detach().squeeze(-1)
            self.stats.update(counts, chosen, self.aux_loss)
            self.update_bias(counts)  # after the choice: this forward used the bias as it was
        else:
            self.aux_loss = None
        dest, src, ends, num_rows = _layout(experts, self.n_experts, counts)
        if torch.is_autocast_enabled(x.device.type):
            # Autocast does not cover the grouped GEMM: cast as it would for a Linear (the weights: grouped_linear).
            x = x.to(torch.get_autocast_dtype(x.device.type))
        fast = grouped_mm_available(x) if self.use_grouped_mm is None else self.use_grouped_mm
        pairs = x.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, self.dim)
        buffer = _MoveRows.apply(pairs, src, dest, True)  # padding rows are zeros
        gate, up = grouped_linear(buffer, self.w13, ends, use_grouped_mm=fast).chunk(2, dim=-1)
        out = grouped_linear(F.silu(gate) * up, self.w2, ends, use_grouped_mm=fast)
        routed = _MoveRows.apply(out, dest, src, False).view(-1, self.top_k, self.dim)
        y = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, "
            f"score={self.score}, renormalize={self.renormalize}, routed_scale={self.routed_scale}, "
            f"bias_rate={self.bias_rate}"
        )


def router_statistics(model: nn.Module) -> dict:
    """Every MoE layer's `RouterStats.summary` in `model`, and the worst over layers.

    Returns ``{"layers": {module name: summary}, "max_over_mean": max, "load_cv": max,
    "busiest_share": max, "dead": sum, "min_used_share": min, "gate_mass": mean,
    "balance_loss": mean}`` (aggregates None when no layer saw a token; ``layers`` empty
    without MoE layers). `reset_router_statistics` starts a new window.
    """
    layers = {name: m.stats.summary() for name, m in model.named_modules() if isinstance(m, MoE)}
    seen = [s for s in layers.values() if s["tokens"]]

    def agg(key, fn):
        values = [s[key] for s in seen if s[key] is not None]
        return fn(values) if values else None

    out = {
        "layers": layers,
        "max_over_mean": agg("max_over_mean", max),
        "load_cv": agg("load_cv", max),
        "busiest_share": agg("busiest_share", max),
        "dead": agg("dead", sum),
        "min_used_share": agg("used_share", min),
        "gate_mass": agg("gate_mass", lambda v: sum(v) / len(v)),
        "balance_loss": agg("balance_loss", lambda v: sum(v) / len(v)),
    }
    return out


def reset_router_statistics(model: nn.Module) -> None:
    """Start a new statistics window in every MoE layer of `model` (on the device: no host copy)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.stats.reset()
