"""The training loop: `TrainConfig`, `Trainer` (fit, evaluate, checkpoint, resume).

One step: batch ``step`` of the stream (a pure function of seed and step), forward and
loss (bf16 autocast on GPU; plus the routed experts' load-balancing loss), backward,
global-norm clipping over dense and sparse
gradients, AdamW on the backbone and `SparseAdam` on the tables (or, for tables in host
memory, `HostTables`, which also prefetches the next step's rows), both on the same
warm-up + cosine curve (the tables at ``table_lr_mult`` times the rate). A run is
deterministic given its seed, and a resumed run repeats an uninterrupted one exactly:
the data order, the schedule and every optimizer state are restored from the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import resource
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from condmem.config import ConfigError
from condmem.train.data import TokenStream
from condmem.train.optim import (
    build_optimizers,
    clip_grad_norm_,
    clip_gradients_,
    lr_factor,
    set_lr,
)
from condmem.train.progress import format_duration
from condmem.utils.progress import Progress

logger = logging.getLogger("condmem.train")

LN2 = math.log(2.0)

MIN_COMPARABLE_STEPS = 20
"""The fewest steps of a run whose result is compared with another's (`min_comparable_steps`)."""


def min_comparable_steps(warmup_steps: int) -> int:
    """The fewest steps at which a run's result means something: twice the warm-up (at least
    half of the run on the decaying part of the schedule), and never fewer than
    `MIN_COMPARABLE_STEPS`. Below it the models are compared mid-warm-up, at whatever
    learning rate the cut left them: a difference there says nothing about either model."""
    return max(2 * warmup_steps, MIN_COMPARABLE_STEPS)


@dataclass
class TrainConfig:
    """How one model is trained."""

    steps: int = 1000
    """Optimizer steps (with ``max_minutes``: an upper bound, resolved after a short probe)."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate of the backbone (AdamW)."""
    table_lr_mult: float = 5.0
    """Engram tables' peak learning rate as a multiple of ``lr`` (paper: 5x)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to this fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay on backbone matrices (none on tables, norms, gates)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm (0: no clipping)."""
    eval_every: int = 0
    """Validate every this many steps (0: only at the end)."""
    eval_tokens: int = 65_536
    """Validation tokens of each evaluation during training (windows spread evenly over the
    split, the same ones every time); the final evaluation reads the whole split."""
    eval_batch_size: int = 16
    seed: int = 0
    """Seeds the initialization and the batch order."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on CUDA, fp32 on CPU."""
    log_every: int = 1
    """A progress line every this many steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in a run directory (older ones are deleted)."""
    max_minutes: float | None = None
    """Wall-clock budget: the step count is resolved from the measured step time during warm-up."""
    compile: bool = False
    """Compile each decoder block, the head and the cross-entropy with `torch.compile` (fused norms,
    rotary, SwiGLU, routing; on CUDA, causal attention by FlexAttention, deterministic in either
    mode; about 2x the eager step at the study's sizes, after seconds of compilation per shape).
    Same arithmetic up to rounding: losses match eager to bf16 noise, not bit for bit.
    Compiling starts from empty compiler caches (`torch._dynamo.reset`), so a model's graphs are
    those of a fresh process, whatever the process trained before."""
    cuda_graphs: bool = False
    """Replay each compiled block's kernels as CUDA graphs (Inductor's CUDA graph trees, what
    ``mode="reduce-overhead"`` sets): one launch a block instead of hundreds, for steps bound by
    the host's launches (the study's MoE). The same kernels, so the same losses bit for bit as
    `compile` alone; more device memory (the graphs' pools). Needs `compile`; on a device other
    than CUDA the blocks compile without graphs."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_tokens", "eval_batch_size", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed", "keep_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"TrainConfig.{name} must be a non-negative int, got {value!r}")
        for name in ("lr", "table_lr_mult", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"TrainConfig.{name} must be a finite number, got {value!r}")
        for name in ("lr", "table_lr_mult", "eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"TrainConfig.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"TrainConfig.{name} must be >= 0 (0: none), got {getattr(self, name)!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"TrainConfig.beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"TrainConfig.precision must be auto, fp32 or bf16, got {self.precision!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"TrainConfig.max_minutes must be positive, got {self.max_minutes!r}")
        if self.cuda_graphs and not self.compile:
            raise ConfigError("TrainConfig.cuda_graphs replays compiled blocks: it needs compile = true")

    def graphs_on(self, device: torch.device | str) -> bool:
        """Whether the compiled blocks are replayed as CUDA graphs on `device` (`cuda_graphs`, CUDA only)."""
        return self.cuda_graphs and torch.device(device).type == "cuda"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s) {unknown}")
        return cls(**data)


def autocast_for(device: torch.device, precision: str):
    """The autocast context of a precision setting on a device."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def memory_gib(device: torch.device) -> float:
    """Peak accelerator memory (CUDA) or peak resident memory of the process (CPU), GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


@torch.no_grad()
def evaluate(
    model,
    stream: TokenStream,
    token_bytes: torch.Tensor,
    *,
    seq_len: int,
    max_tokens: int | None,
    batch_size: int,
    device: torch.device,
    precision: str = "auto",
    token_losses: bool = False,
    on_batch=None,
    cuda_graphs: bool = False,
) -> dict:
    """Validation loss (nats per token) and bits per byte.

    Args:
        max_tokens: None: every target of `stream` once; else a fixed subset of about this
            many targets in windows spread over the stream.
        token_losses: also return ``token_losses``, float32 [len(stream) - 1], the loss of
            each target (index = target position - 1; NaN where not evaluated).
        on_batch: called with each batch's scored targets once it is evaluated (a progress bar).
        cuda_graphs: the model's blocks are replayed as CUDA graphs (`TrainConfig.graphs_on`): each
            batch starts a new graph step, so one batch's graphs never overwrite outputs still in use.

    Bits per byte = total NLL / (ln 2 x the UTF-8 bytes of the predicted tokens), so models
    with different tokenizers are comparable.
    """
    was = model.training
    model.eval()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    token_bytes = token_bytes.to(device)
    per_token = np.full(max(0, len(stream) - 1), np.nan, dtype=np.float32) if token_losses else None
    try:
        for batch in stream.eval_batches(seq_len, max_tokens, batch_size):
            positions = batch.positions
            batch = batch.to(device)
            if cuda_graphs:  # only then: its first call imports Inductor's graph trees (seconds)
                torch.compiler.cudagraph_mark_step_begin()
            with autocast_for(device, precision):
                losses = model.loss(batch.inputs, batch.targets, batch.doc_starts, reduction="none")
            losses = losses.float().masked_fill(~batch.scored, 0.0)
            nll += losses.double().sum()
            n_tokens += batch.n_tokens
            n_bytes += (token_bytes[batch.targets] * batch.scored).sum()
            if on_batch is not None:
                on_batch(batch.n_tokens)
            if per_token is not None:
                keep = batch.scored.cpu()
                per_token[(positions[keep] - 1).numpy()] = losses.cpu()[keep].numpy()
    finally:
        model.train(was)
    total = float(nll)
    out = {"val_loss": total / n_tokens, "bits_per_byte": total / (LN2 * max(1, int(n_bytes))), "val_tokens": n_tokens}
    if per_token is not None:
        out["token_losses"] = per_token
    return out


def compile_model(model: nn.Module, cuda_graphs: bool) -> None:
    """Compile `model`'s decoder blocks (replayed as CUDA graphs with `cuda_graphs`), its head
    (final norm and output projection) and its cross-entropy, in place, from empty compiler caches.

    A process that trains several models (a sweep's worker) would otherwise compile each against
    the graphs of the ones before: past torch's recompile limit a block silently runs eager, and a
    block recompiled for new shapes gets dynamic-shape kernels. Either changes a run's speed and
    its last bits by what ran earlier in its process."""
    torch._dynamo.reset()
    for block in model.blocks:
        # An Engram layer compiles with its block, all but its table's read (`module._read_table`).
        block.compile(mode="reduce-overhead" if cuda_graphs else None)
    # The head's fp32 norm and casts as one kernel each way around the projection's GEMM; the fp32
    # logits' upcast, softmax and their backward as a few fused kernels. Never as graphs: the loss is
    # read by the host steps later (queued steps), and a graph's next replay would overwrite it. The
    # class's functions, so a model compiled again is wrapped once.
    for name in ("head", "cross_entropy"):
        setattr(model, name, types.MethodType(torch.compile(getattr(type(model), name)), model))


def _grad_sources(model) -> list:
    """The model's trainable parameters in ``model.parameters()`` order, with the layer id of
    each host-resident table where its parameter would be (the clipping norm's last bits follow
    this order: `squared_norm`)."""
    from condmem.train.host_table import HostTableView

    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, HostTableView):
            out.append(module.layer_id)
            continue
        for p in module._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                out.append(p)
    return out


class Trainer:
    """Trains one `DecoderLM`.

    Args:
        model: the model (on `device`).
        cfg: training settings.
        train_stream, val_stream: token streams.
        token_bytes: int64 [vocab] UTF-8 bytes per token id (for bits per byte).
        device: where to train.
        run_dir: where checkpoints go (None: no checkpoints).
        label: name in progress lines ("baseline", "engram").
        checkpoint_extra: what a checkpoint needs besides tensors: ``tokenizer`` (a
            tokenizers.Tokenizer), ``ctok`` (CompressedTokenizer or None), ``data`` (dict).
        host_tables: a `condmem.train.host_table.HostTables` holding the model's Engram tables
            in host memory; it is then the tables' optimizer (its Adam settings are set from
            `cfg`), and each step prefetches the next step's rows.
        data_parallel: a `condmem.train.data_parallel.DataParallelTables` when this process
            is one of several data-parallel ranks: it trains on its slice of each batch, with
            the model's tables sharded over the ranks.
    """

    def __init__(
        self,
        model,
        cfg: TrainConfig,
        train_stream: TokenStream,
        val_stream: TokenStream,
        token_bytes: np.ndarray | torch.Tensor,
        device: torch.device | str,
        *,
        run_dir: str | Path | None = None,
        label: str = "model",
        checkpoint_extra: dict | None = None,
        progress: bool = True,
        host_tables=None,
        data_parallel=None,
    ):
        self.model = model
        self.cfg = cfg
        self.train_stream = train_stream
        self.val_stream = val_stream
        self.token_bytes = torch.as_tensor(np.asarray(token_bytes), dtype=torch.int64)
        self.device = torch.device(device)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.label = label
        self.checkpoint_extra = checkpoint_extra or {}
        self.show_progress = progress
        self.adamw, self.sparse = build_optimizers(
            model,
            cfg.lr,
            cfg.lr * cfg.table_lr_mult,
            cfg.weight_decay,
            (cfg.beta1, cfg.beta2),
            (cfg.beta1, cfg.beta2),
            cfg.eps,
            # One pass over weights, gradients and moments instead of a dozen foreach ops: it
            # matters where the GPU bounds the step (compiled, replayed as graphs; docs/benchmarks.md).
            fused=self.device.type == "cuda",
        )
        if cfg.compile:
            compile_model(model, cfg.graphs_on(self.device))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.host = host_tables
        self.dp = data_parallel
        self._next_batch = None  # (step, batch, its row ids): the host tier's prefetch of the next step
        if data_parallel is not None:
            if host_tables is not None:
                raise ValueError("tables in host memory and tables sharded over ranks are two different tiers")
            data_parallel.attach_optimizer(self.sparse)
            self._replicated = [p for _, p in model.backbone_parameters() if p.requires_grad]
            self._sharded = [p for _, p in model.table_parameters()]
        if host_tables is not None:
            if self.sparse is not None:
                raise ValueError("the model still has Engram tables of its own: build HostTables from it first")
            host_tables.param_groups[0].update(
                lr=cfg.lr * cfg.table_lr_mult,
                base_lr=cfg.lr * cfg.table_lr_mult,
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
            )
            self.sparse = host_tables
            self._grad_sources = _grad_sources(model)
        self.step = 0
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.timed_tokens = 0
        self.timed_seconds = 0.0
        self.budget_resolved = cfg.max_minutes is None
        self.last_checkpoint: Path | None = None
        self.token_losses: np.ndarray | None = None
        """Per-target validation losses of the last evaluation that asked for them."""

    @property
    def optimizers(self):
        return [o for o in (self.adamw, self.sparse) if o is not None]

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """Everything besides tensors that a resumed run needs."""
        return {
            "step": self.step,
            "history": self.history,
            "evals": self.evals,
            "timed_tokens": self.timed_tokens,
            "timed_seconds": self.timed_seconds,
            "budget_resolved": self.budget_resolved,
            "train_config": self.cfg.to_dict(),
            "label": self.label,
        }

    def restore(self, checkpoint) -> None:
        """Continue from a `condmem.train.checkpoint.Checkpoint` of this model."""
        from condmem.train.optim import import_adamw_state

        names = {p: n for n, p in self.model.named_parameters()}
        tensors = checkpoint.optimizer_tensors
        adamw = {k[len("adamw.") :]: v for k, v in tensors.items() if k.startswith("adamw.")}
        import_adamw_state(self.adamw, adamw, names)
        if self.sparse is not None:
            self.sparse.import_state(
                {k[len("sparse_adam.") :]: v for k, v in tensors.items() if k.startswith("sparse_adam.")}, names
            )
        st = checkpoint.state
        self.step = int(st["step"])
        self.history = list(st.get("history", []))
        self.evals = list(st.get("evals", []))
        self.timed_tokens = int(st.get("timed_tokens", 0))
        self.timed_seconds = float(st.get("timed_seconds", 0.0))
        self.budget_resolved = bool(st.get("budget_resolved", True))

    def checkpoint_bytes(self, tokens: int = 0) -> int:
        """An upper bound of this process's next checkpoint, `tokens` trained from now (see `checkpoint_bytes`)."""
        from condmem.train.checkpoint import checkpoint_bytes

        return checkpoint_bytes(
            self.model,
            adamw=self.adamw,
            sparse=self.sparse,
            host_tables=self.host,
            tables_sharded=self.dp is not None,
            tokenizer=self.checkpoint_extra.get("tokenizer"),
            trainer_state=self.state(),
            tokens=tokens,
        )

    def save(self) -> Path | None:
        if self.run_dir is None:
            return None
        from condmem.train.checkpoint import ensure_room, save_checkpoint

        # The disk may have filled since training started: a clear error (what is kept, what is lost), not a
        # save that dies half-way.
        ensure_room(self.run_dir, self.checkpoint_bytes(), self.step)

        if self.dp is not None:
            # The shards first: the backbone checkpoint (and its LATEST) names a step whose tables exist.
            self.dp.save(self.run_dir, self.sparse, self.step, self.model.layout.fingerprint, self.cfg.keep_checkpoints)
            path = None
            if self.dp.rank == 0:
                path = save_checkpoint(
                    self.run_dir,
                    model=self.model,
                    adamw=self.adamw,
                    sparse=None,
                    train_cfg=self.cfg,
                    trainer_state=self.state(),
                    keep=self.cfg.keep_checkpoints,
                    tables_sharded=True,
                    **self.checkpoint_extra,
                )
            self.last_checkpoint = self.dp.broadcast(path)
            return self.last_checkpoint
        self.last_checkpoint = save_checkpoint(
            self.run_dir,
            model=self.model,
            adamw=self.adamw,
            sparse=self.sparse,
            train_cfg=self.cfg,
            trainer_state=self.state(),
            keep=self.cfg.keep_checkpoints,
            host_tables=self.host,
            **self.checkpoint_extra,
        )
        return self.last_checkpoint

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, full: bool = False, token_losses: bool = False) -> dict:
        """Validate on the fixed subset (``eval_tokens``), or on the whole split (`full`: with a
        progress bar over its tokens, the longest evaluation)."""
        bar = None
        if full:
            n = max(0, len(self.val_stream) - 1)
            bar = Progress(n, f"{self.label}: validation", enabled=self.show_progress, unit="tok", unit_scale=True)
        try:
            result = evaluate(
                self.model,
                self.val_stream,
                self.token_bytes,
                seq_len=self.cfg.seq_len,
                max_tokens=None if full else self.cfg.eval_tokens,
                batch_size=self.cfg.eval_batch_size,
                device=self.device,
                precision=self.cfg.precision,
                token_losses=token_losses,
                on_batch=None if bar is None else bar.update,
                cuda_graphs=self.cfg.graphs_on(self.device),
            )
        finally:
            if bar is not None:
                bar.close()
        losses = result.pop("token_losses", None)
        if losses is not None:
            self.token_losses = losses
        result.update(step=self.step, train_tokens=self.step * self.cfg.batch_size * self.cfg.seq_len, full=full)
        if not any(e["step"] == self.step and e.get("full", False) == full for e in self.evals):
            self.evals.append(result)
        return result

    # ------------------------------------------------------------------ training
    def _budget_steps(self, step_seconds: float, elapsed: float) -> int:
        """The step count that ``max_minutes`` allows at `step_seconds` a step, `elapsed` seconds in."""
        cfg = self.cfg
        remaining = cfg.max_minutes * 60 - elapsed
        # Keep ~5% for evaluation and checkpoints.
        fit = self.step + int(max(0.0, 0.95 * remaining) / max(step_seconds, 1e-9))
        return max(self.step + 1, min(cfg.steps, fit))

    def _resolve_budget(self, step_seconds: float, elapsed: float) -> None:
        cfg = self.cfg
        steps = self._budget_steps(step_seconds, elapsed)
        if steps != cfg.steps:
            logger.info(
                "%s: %.1f min budget at %.3f s/step -> %d steps", self.label, cfg.max_minutes, step_seconds, steps
            )
        cfg.steps = steps
        cfg.warmup_steps = min(cfg.warmup_steps, max(0, steps - 1))
        self.budget_resolved = True

    def _batch(self, step: int):
        cfg = self.cfg
        return self.train_stream.batch(step, cfg.batch_size, cfg.seq_len, cfg.seed).to(self.device, non_blocking=True)

    def _gradients(self) -> list[torch.Tensor]:
        """Every gradient in the order of the model's parameters, host tables in their tables' place."""
        host = self.host.gradients()
        out = []
        for src in self._grad_sources:
            if isinstance(src, int):
                g = host.get(src)
            else:
                g = src.grad
                if g is not None and g.is_sparse:
                    src.grad = g = g.coalesce()
            if g is not None:
                out.append(g)
        return out

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step; its loss read from the device (data-parallel: the ranks' mean) and
        its learning rate."""
        loss, lr = self.queue_step(step)
        value = float(loss)
        if self.dp is not None:
            value = self.dp.mean(value, self.device)  # every rank's slice has as many tokens
        return value, lr

    def queue_step(self, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step queued on the device, and its learning rate: the loss (this rank's)
        comes back as a 0-d tensor, unread, so the host can queue step + 1 while the device still
        runs step; a caller reads the losses in batches (`read_losses`) instead of waiting once a
        step. What still waits: tables in host memory (their rows), data-parallel reductions, and
        the tables' fused Adam on the rare step its row buffers must grow."""
        cfg = self.cfg
        ahead, self._next_batch = self._next_batch, None
        if ahead is not None and ahead[0] == step:
            _, batch, row_ids = ahead  # batch and row ids made for the prefetch: the forward does not hash again
        else:
            batch, row_ids = self._batch(step), None
        if self.dp is not None:
            batch = self.dp.local(batch)
        if self.host is not None:
            self.host.begin(step)
        lr_mult = lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        set_lr(self.optimizers, lr_mult)
        if cfg.graphs_on(self.device):  # a new graph step: it may overwrite the step before's outputs, none kept
            torch.compiler.cudagraph_mark_step_begin()
        with autocast_for(self.device, cfg.precision):
            loss = self.model.loss(batch.inputs, batch.targets, batch.doc_starts, row_ids=row_ids)
        if self.host is not None and step + 1 < cfg.steps and self.host.prefetch_enabled:
            # Once the forward is queued: the host's work here (the next batch, its hash, the
            # prefetch) overlaps the device's forward, so the device does not idle through it after
            # the last step's loss read; the worker has the backward's time to gather.
            nxt = self._batch(step + 1)
            nxt_rows = self.model.row_ids(nxt.inputs, nxt.doc_starts)
            self.host.prefetch(nxt_rows, step + 1)
            self._next_batch = (step + 1, nxt, nxt_rows)
        # Routed experts add their load-balancing loss to what is minimized; the loss
        # reported stays the cross-entropy, comparable across models.
        aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
        (loss if aux is None else loss + aux).backward()
        # The backbone's fused AdamW applies the clipping scale as it reads its gradients (scale_gradients_).
        if self.host is not None:
            clip_gradients_(self._gradients(), cfg.grad_clip, self.adamw)
        elif self.dp is not None:
            self.dp.average_gradients(self._replicated)
            for p in self._sharded:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.coalesce()
            self.dp.clip_(
                [p.grad for p in self._replicated if p.grad is not None],
                [p.grad for p in self._sharded if p.grad is not None],
                cfg.grad_clip,
                self.adamw,
            )
        else:
            clip_grad_norm_(self.params, cfg.grad_clip, self.adamw)
        for opt in self.optimizers:
            opt.step()
        self.adamw.grad_scale = None  # this step's
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return loss.detach(), cfg.lr * lr_mult

    def read_losses(self, queued: list[tuple[int, torch.Tensor]]) -> list[float]:
        """The losses of queued steps ``(step, loss)``, read with one wait for the device.

        Raises FloatingPointError naming the first step whose loss is not finite."""
        if not queued:
            return []
        values = torch.stack([loss.float() for _, loss in queued]).tolist()
        for (step, _), value in zip(queued, values):
            self._require_finite(value, step)
        return values

    def _require_finite(self, loss: float, step: int) -> None:
        if not math.isfinite(loss):
            raise FloatingPointError(f"{self.label}: loss is {loss} at step {step + 1}")

    def fit(self, token_losses: bool = False) -> dict:
        """Train up to ``cfg.steps`` (from the current step), validate (the fixed subset, for
        the curve, and the whole split), checkpoint; returns the summary.

        Args:
            token_losses: keep the final evaluation's per-target losses in ``self.token_losses``.
        """
        cfg = self.cfg
        self.model.train()
        tokens_per_step = cfg.batch_size * cfg.seq_len
        if self.run_dir is not None and self.step < cfg.steps:
            from condmem.train.checkpoint import ensure_room

            every = cfg.checkpoint_every or cfg.steps
            first_save = min(cfg.steps, (self.step // every + 1) * every)
            ensure_room(self.run_dir, self.checkpoint_bytes((first_save - self.step) * tokens_per_step))
        warm = min(3, max(0, cfg.steps - self.step - 1))  # steps left out of tok/s (allocations, caches)
        probe_until = self.step + max(warm + 2, min(cfg.warmup_steps, 12))
        start = time.perf_counter()
        # Before a budget is resolved the step count is only an upper bound: no bar total yet.
        bar = Progress(
            cfg.steps if self.budget_resolved else None, self.label, initial=self.step, enabled=self.show_progress
        )
        first = self.step
        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                loss, lr = self.train_step(self.step)
                self._require_finite(loss, self.step)
                dt = time.perf_counter() - t0
                self.step += 1
                if self.step - first > warm:
                    self.timed_tokens += tokens_per_step
                    self.timed_seconds += dt
                self.history.append({"step": self.step, "loss": loss, "lr": lr, "tokens": self.step * tokens_per_step})
                if not self.budget_resolved and self.step >= probe_until and self.timed_seconds > 0:
                    step_s = self.timed_seconds / (self.timed_tokens / tokens_per_step)
                    self._resolve_budget(step_s, time.perf_counter() - start)
                    bar.close()
                    bar = Progress(cfg.steps, self.label, initial=self.step, enabled=self.show_progress)
                tok_s = self.timed_tokens / self.timed_seconds if self.timed_seconds else tokens_per_step / dt
                # Until the budget is resolved, the steps it allows at the speed so far: the ETA and the
                # total shown are the budget's from the first step, not the step cap's.
                total = cfg.steps
                if not self.budget_resolved:
                    total = self._budget_steps(tokens_per_step / max(tok_s, 1e-9), time.perf_counter() - start)
                eta = (total - self.step) * tokens_per_step / max(tok_s, 1e-9)
                shown = f"{total}" if self.budget_resolved else f"~{total}"
                bar.update(1, loss=f"{loss:.3f}")
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    bar.write(
                        f"[{self.label}] step {self.step:>{len(str(total))}}/{shown} | loss {loss:7.4f} | "
                        f"lr {lr:.2e} | {tok_s:>9,.0f} tok/s | mem {memory_gib(self.device):5.2f} GiB | "
                        f"eta {format_duration(eta)}"
                    )
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    ev = self.evaluate()
                    bar.write(
                        f"[{self.label}] step {self.step}: val loss {ev['val_loss']:.4f} | "
                        f"{ev['bits_per_byte']:.4f} bits/byte"
                    )
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                    self.save()
        finally:
            bar.close()
        self.evaluate()
        if self.show_progress:
            print(f"[{self.label}] validating on all {max(0, len(self.val_stream) - 1):,} held-out tokens", flush=True)
        ev = self.evaluate(full=True, token_losses=token_losses)
        print(
            f"[{self.label}] done: {self.step} steps, val loss {ev['val_loss']:.4f}, "
            f"{ev['bits_per_byte']:.4f} bits/byte over all {ev['val_tokens']:,} validation tokens, "
            f"{self.tokens_per_s:,.0f} tok/s",
            flush=True,
        )
        self.save()
        return self.summary()

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else 0.0

    def summary(self) -> dict:
        finals = [e for e in self.evals if e.get("full")]
        last = finals[-1] if finals else (self.evals[-1] if self.evals else {})
        tail = [h["loss"] for h in self.history[-max(1, min(50, len(self.history) // 10)) :]]
        return {
            "val_loss": last.get("val_loss"),
            "bits_per_byte": last.get("bits_per_byte"),
            "val_tokens": last.get("val_tokens"),
            "train_tokens": self.step * self.cfg.batch_size * self.cfg.seq_len,
            "steps": self.step,
            "tokens_per_s": self.tokens_per_s,
            "train_seconds": self.timed_seconds,
            "final_train_loss": float(np.mean(tail)) if tail else None,
            "sparse_state_rows": self.sparse.state_rows() if self.sparse is not None else 0,
        }
