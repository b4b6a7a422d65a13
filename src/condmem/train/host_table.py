"""Engram tables trained in host memory: `HostTables`, the part every optimizer mode shares, and
its two modes, `HostAdamTables` and `DeviceAdamTables`.

Each layer's rows and Adam state live in (page-locked) host memory; the model's tables become
views that return the step's rows on the device as a leaf tensor, prefetched by a worker thread
while the step before computes. The methods of each mode are in `condmem.train.host_table_optim`;
the state both share is in `condmem.train.host_table_state`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import time
import warnings
from collections import deque

import torch
from torch import nn

from condmem.ops.row_grad import coalesced_gradient, sorted_runs
from condmem.train.host_table_optim import DeviceAdam, HostAdam
from condmem.train.host_table_state import HostLayer, HostTableError, StepPrefetch

logger = logging.getLogger("condmem.train")

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _host_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool, fill=None, seconds: dict | None = None
) -> tuple[torch.Tensor, object]:
    """A host tensor of exactly `shape` (page-locked when `pin`), zeros unless `fill` (a function
    of the tensor) writes it first; returns (tensor, what keeps its memory: None or a HostBuffer).
    `seconds` accumulates the time spent filling (``fill``) and page-locking (``pin``)."""
    seconds = {} if seconds is None else seconds
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not pin:
        t = torch.zeros(shape, dtype=dtype)
        t0 = time.perf_counter()
        if fill is not None:
            fill(t)
        seconds["fill"] = seconds.get("fill", 0.0) + time.perf_counter() - t0
        return t, None
    from condmem.tables.host_memory import allocate_host

    buf = allocate_host(nbytes, "mmap_register")  # exact size, anonymous memory: zeros until written
    t = buf.tensor.view(dtype).view(shape)
    t0 = time.perf_counter()
    if fill is not None:
        fill(t)
    t1 = time.perf_counter()
    buf.pin()
    seconds["fill"] = seconds.get("fill", 0.0) + t1 - t0
    seconds["pin"] = seconds.get("pin", 0.0) + time.perf_counter() - t1
    return t, buf


def _fill_normal(std: float, seed: int, threads: int):
    """Fill a 2-D tensor with N(0, std) from per-chunk generators, chunks on `threads` threads
    (deterministic for a given seed and chunk size, whatever the thread count)."""

    def fill(t: torch.Tensor) -> None:
        chunk = max(1, (1 << 24) // max(1, t.shape[1]))
        starts = list(range(0, t.shape[0], chunk))

        def one(i: int) -> None:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            t[starts[i] : starts[i] + chunk].normal_(0.0, std, generator=gen)

        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(one, range(len(starts))))

    return fill


def _fill_zero(threads: int):
    """Write zeros over a tensor in chunks on `threads` threads: the pages of fresh anonymous
    memory are then faulted in in parallel, not one by one while they are page-locked."""

    def fill(t: torch.Tensor) -> None:
        flat = t.view(-1)
        chunk = 1 << 26
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda i: flat[i : i + chunk].zero_(), range(0, flat.numel(), chunk)))

    return fill


class HostTableView(nn.Module):
    """Stands in for one layer's `EngramTable`: row ids [..., n_cols] on the device -> rows
    [..., n_cols, head_dim] fp32 on the device, served by the `HostTables` that owns it.

    ``weight`` is the host tensor itself, not a parameter: the model's optimizers, its
    ``state_dict`` and ``.to()`` leave it alone.
    """

    def __init__(self, tier: "HostTables", layer_id: int, weight: torch.Tensor):
        super().__init__()
        self.tier, self.layer_id = tier, layer_id
        self.num_embeddings, self.head_dim = weight.shape
        self.sparse = True
        self.weight = weight

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        return self.tier._row_vectors(self.layer_id, row_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.head_dim}, host"


class HostTables(abc.ABC):
    """Every Engram table of a `DecoderLM` in host memory, with its Adam state; the tables' optimizer.

    ``HostTables(model, device, adam=...)`` builds the optimizer mode's class
    (`optimizer_mode`): `HostAdamTables` (``adam="host"``, the
    default) or `DeviceAdamTables` (``adam="device"``); each can be built directly too. Both
    are exact: every step reads every earlier update. Every mode has the same interface: the views' rows,
    `prefetch` / `begin`, `gradients`, ``step``, ``zero_grad``, `set_lr` through
    ``param_groups``, checkpoints in `SparseAdam`'s format (`export_state`, `import_state`).

    Args:
        model: the model; each Engram layer's ``table`` is replaced by a `HostTableView`. A
            table already holding rows (CPU or device) is copied to the host; a table on the
            meta device is allocated on the host and drawn from N(0, ``init_std``).
        device: where the model computes (CPU works: transfers become copies).
        lr, betas, eps: Adam's; ``lr`` is the base rate `set_lr` scales (``param_groups``).
        state_dtype: ``"fp32"`` (exact: rows equal `SparseAdam`'s) or ``"bf16"`` (moments
            stored in bf16, computed in fp32: 8 instead of 12 B per parameter on the host).
        prefetch: fetch step t+1's rows while step t computes. Without it every step fetches
            its rows after all earlier updates are applied (the reference the pipelined path
            is tested against). Outside training (no autograd, or no prefetched step) rows are
            fetched synchronously after all pending updates.
        adam: ``"host"`` (Adam on the host's threads; the device waits for the rows the next
            step shares with this one) or ``"device"`` (Adam on the device, the host stores:
            more bytes sent each way, no host work between two steps; exact).
        pin: page-lock the host tensors (needs CUDA); default: when `device` is CUDA.
        threads: torch intra-op threads of the worker (None: the process's setting).
        tables: {layer id: [rows, head_dim]} initial rows (e.g. `load_checkpoint(...,
            tables_on_host=True).tables`), instead of the model's own.
        init_std, seed: the normal initialization of tables built on the host.

    A context manager: `close()` stops the worker and unpins the memory.
    """

    adam: str
    """Where Adam runs: ``"host"`` or ``"device"`` (a class attribute of each mode)."""

    def __new__(cls, *args, adam: str | None = None, **kwargs):
        mode = cls
        if cls is HostTables:
            mode = optimizer_mode("host" if adam is None else adam)
        return super().__new__(mode)

    def __init__(
        self,
        model,
        device: torch.device | str,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        state_dtype: str = "fp32",
        prefetch: bool = True,
        pin: bool | None = None,
        threads: int | None = None,
        tables: dict[int, torch.Tensor] | None = None,
        init_std: float | None = None,
        seed: int = 0,
        adam: str | None = None,
    ):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
        self._check_mode(adam)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = self.cuda if pin is None else pin
        self.prefetch_enabled = prefetch
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.threads = threads
        self.param_groups = [{"lr": lr, "base_lr": lr, "betas": tuple(betas), "eps": eps}]
        self.layers: dict[int, HostLayer] = {}
        self._views: list[HostTableView] = []
        self._queue: deque[StepPrefetch] = deque()
        self._jobs: deque[concurrent.futures.Future] = deque()
        self._closed = False
        self._step = 0
        self._gathers = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="condmem-host-adam", initializer=self._init_worker
        )
        if self.cuda:
            self._h2d = torch.cuda.Stream(self.device)
            self._d2h = torch.cuda.Stream(self.device)
            self._ids_d2h = torch.cuda.Stream(self.device)
        self.wait_s = 0.0
        """Seconds the main thread waited for the host (gathers and patches), summed."""
        std = init_std if init_std is not None else getattr(getattr(model, "cfg", None), "engram_table_init_std", 0.02)
        self.setup_seconds: dict[str, float] = {}
        """Seconds spent filling (``fill``) and page-locking (``pin``) the host tensors."""
        t0 = time.perf_counter()
        for engram in model.engram_layers:
            self._take_table(engram, tables, std, seed)
        self.setup_s = time.perf_counter() - t0
        """Seconds spent allocating, filling and page-locking the host tensors."""

    def _check_mode(self, adam: str | None) -> None:
        """`adam` as the constructor got it: None or this mode's own."""
        if adam is None or adam == self.adam:
            return
        raise ValueError(
            f"{type(self).__name__} trains with adam={self.adam!r}, not adam={adam!r}: "
            "build HostTables(..., adam=...) to pick the mode"
        )

    def _take_table(self, engram, tables: dict[int, torch.Tensor] | None, std: float, seed: int) -> None:
        """Move one Engram layer's table into host memory (rows, moments, steps) and put a view in its place."""
        table = engram.table
        num_rows, dim = table.num_embeddings, table.head_dim
        src = tables[engram.layer_id] if tables is not None else table.weight
        fill = (
            _fill_normal(std, seed + engram.layer_id, self.threads or torch.get_num_threads())
            if src.device.type == "meta"
            else (lambda t, s=src: t.copy_(s.detach()))
        )
        keep = []
        weight, k = _host_tensor((num_rows, dim), torch.float32, self.pin, fill, self.setup_seconds)
        keep.append(k)
        moments = []
        zero = _fill_zero(self.threads or torch.get_num_threads()) if self.pin else None
        for _ in range(2):
            m, k = _host_tensor((num_rows, dim), self.state_dtype, self.pin, zero, self.setup_seconds)
            moments.append(m)
            keep.append(k)
        row_step, k = _host_tensor((num_rows,), torch.float32, self.pin, zero, self.setup_seconds)
        keep.append(k)
        layer = HostLayer(
            engram.layer_id,
            weight,
            moments[0],
            moments[1],
            row_step,
            torch.zeros(num_rows, dtype=torch.bool),
            keep=keep,
        )
        self.layers[engram.layer_id] = layer
        engram.table = HostTableView(self, engram.layer_id, weight)
        self._views.append(engram.table)
        del src, fill  # the model's own table is freed here (the fill held it)

    # ------------------------------------------------------------------ sizes
    @property
    def table_params(self) -> int:
        return sum(layer.weight.numel() for layer in self.layers.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of the tables and their state on the host (weights, moments, steps, markers)."""
        return sum(
            sum(t.numel() * t.element_size() for t in (L.weight, L.exp_avg, L.exp_avg_sq, L.row_step, L.marker))
            for L in self.layers.values()
        )

    def huge_page_coverage(self) -> float | None:
        """Fraction of the host tensors' resident bytes on huge pages (None: unknown, or not
        page-locked buffers). Random row reads on 4 KiB pages miss the TLB at almost every row."""
        covered = total = 0.0
        for layer in self.layers.values():
            for buf in layer.keep:
                cov = buf.coverage() if buf is not None else None
                if cov is not None:
                    covered += cov * buf.nbytes
                    total += buf.nbytes
        return covered / total if total else None

    # ------------------------------------------------------------------ worker
    def _init_worker(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.cuda:
            torch.cuda.set_device(self.device)

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._closed:
            raise HostTableError("the host tables are closed")
        fut = self._pool.submit(fn, *args)
        self._jobs.append(fut)
        while self._jobs and self._jobs[0].done():
            self._jobs.popleft().result()  # raises a worker's error in the main thread
        return fut

    def flush(self) -> None:
        """Wait for every queued host job (updates applied, prefetches gathered)."""
        while self._jobs:
            self._jobs.popleft().result()

    @staticmethod
    def _buffer(
        buffers: list, i: int, shape: tuple[int, ...], dtype: torch.dtype, make, capacity: int = 0
    ) -> torch.Tensor:
        """Buffer `i` of a pair, grown to hold `shape` (reused across steps); a new buffer holds at
        least `capacity` elements."""
        while len(buffers) <= i:
            buffers.append(None)
        need = 1
        for s in shape:
            need *= s
        b = buffers[i]
        if b is None or b.numel() < need or b.dtype != dtype:
            b = buffers[i] = make(max(need, capacity), dtype)
        return b[:need].view(shape)

    def _pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin)

    def _on_device(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.cuda:
            return torch.empty(n, dtype=dtype, device=self.device)
        # Made on the transfer stream, whose copies fill device buffers: where torch's deterministic
        # algorithms fill new memory with NaN (their default; `deterministic_mode` turns the fill off),
        # the fill runs on the stream current at the making, and so before the copies.
        with torch.cuda.stream(self._h2d):
            return torch.empty(n, dtype=dtype, device=self.device)

    def _named(
        self, layer: HostLayer, name: str, slot: int, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool
    ) -> torch.Tensor:
        """Buffer `slot` of the layer's pair `name` (pinned host or device), grown as needed.

        A step's unique rows vary in number, so a buffer sized to the rows of the step that
        made it would grow again at every new maximum (each growth of a pinned buffer
        page-locks fresh memory: milliseconds, on the worker and the device's path). Buffers
        of rows are made for the step's lookups at once, the most rows a step can have."""
        key = (name, pinned)
        per_row = 1
        for s in shape[1:]:
            per_row *= s
        return self._buffer(
            layer.buffers.setdefault(key, []),
            slot,
            shape,
            dtype,
            self._pinned if pinned else self._on_device,
            capacity=layer.lookups * per_row if shape else 0,
        )

    @staticmethod
    def _wait_consumed(layer: HostLayer, slot: int) -> None:
        """Worker: wait until the device has run past every read of device buffer `slot`."""
        if len(layer.consumed) > slot and layer.consumed[slot] is not None:
            layer.consumed[slot].synchronize()

    def _mark_consumed(self, layer: HostLayer, slot: int | None) -> None:
        """Record on the current stream that the work queued so far has read device buffer `slot`
        (a gather may overwrite it once the event has passed)."""
        if not self.cuda or slot is None:
            return
        while len(layer.consumed) <= slot:
            layer.consumed.append(None)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        layer.consumed[slot] = ev

    # ------------------------------------------------------------------ prefetch (main thread)
    def begin(self, step: int) -> None:
        """Mark the start of training step `step`: its forward takes the rows prefetched for it."""
        self._step = step
        while self._queue and self._queue[0].step < step:
            self._queue.popleft()

    def prefetch(self, row_ids: torch.Tensor, step: int) -> None:
        """Start fetching the rows of training step `step` (the next one): `row_ids`
        [B, T, n_layers, n_cols] on the device (`DecoderLM.row_ids` of that step's batch).
        A no-op without prefetch."""
        if not self.prefetch_enabled:
            return
        if self.cuda:
            # On a side stream: the copy waits for the hash, the step's own kernels do not wait for it.
            ids_host = torch.empty(row_ids.shape, dtype=row_ids.dtype, pin_memory=self.pin)
            self._ids_d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._ids_d2h):
                ids_host.copy_(row_ids, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._ids_d2h)
            row_ids.record_stream(self._ids_d2h)
        else:
            ids_host, copied = row_ids, None
        per_layer = row_ids.numel() // max(1, row_ids.shape[2] if row_ids.dim() > 2 else 1)
        for layer in self.layers.values():
            layer.lookups = max(layer.lookups, per_layer)
        ticket = self._ticket(step, ids_host, row_ids, copied)
        ticket.gathered = self._submit(self._gather, ticket, self._gathers % 2)
        self._gathers += 1
        self._queue.append(ticket)

    def _ticket(self, step: int, ids_host: torch.Tensor, ids_dev: torch.Tensor, copied) -> StepPrefetch:
        """The record of one step's prefetch, before its gather is queued."""
        return StepPrefetch(step, ids_host, ids_dev, copied)

    @abc.abstractmethod
    def _gather(self, ticket: StepPrefetch, slot: int) -> None:
        """Worker: what the step of `ticket` reads of each layer, to the device (buffers of `slot`)
        into ``ticket.fetched``."""

    # ------------------------------------------------------------------ rows (main thread)
    def _row_vectors(self, layer_id: int, row_ids: torch.Tensor) -> torch.Tensor:
        layer = self.layers[layer_id]
        training = torch.is_grad_enabled()
        ticket = self._queue[0] if (training and self._queue and self._queue[0].step == self._step) else None
        if ticket is not None and layer_id not in ticket.used:
            rows = self._prefetched(ticket, layer, row_ids)
            ticket.used.add(layer_id)
            if len(ticket.used) == len(self.layers):
                self._queue.popleft()
        else:
            t0 = time.perf_counter()
            self.flush()
            ids = row_ids.reshape(-1).cpu()
            if training:  # (an evaluation's rows use no transfer buffer)
                layer.lookups = max(layer.lookups, ids.numel())
            rows = self._fetched_now(layer, ids, row_ids, training)
            self.wait_s += time.perf_counter() - t0
        if not training:
            return rows
        leaf = rows.detach().requires_grad_(True)
        # On the device the lookup's runs are found now, so `gradients` reduces per row with one
        # kernel and no sort (or host sync) between the backward and the optimizers.
        runs = sorted_runs(row_ids, self._distinct_ids(layer)) if self.cuda else None
        layer.leaves.append((row_ids, leaf, runs))
        return leaf

    def _distinct_ids(self, layer: HostLayer) -> torch.Tensor | None:
        """The running step's distinct row ids of `layer` on the device (ascending) where the
        mode has them already, else None."""
        return None

    def _fetched_now(self, layer: HostLayer, ids: torch.Tensor, row_ids: torch.Tensor, training: bool) -> torch.Tensor:
        """The rows of `row_ids` (`ids` flat on the host), read now: every update is applied."""
        return layer.weight.index_select(0, ids).to(self.device).view(*row_ids.shape, -1)

    def _prefetched(self, ticket: StepPrefetch, layer: HostLayer, row_ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        ticket.gathered.result()
        lid = layer.layer_id
        index = list(self.layers).index(lid)
        if tuple(ticket.ids_dev.shape[:2]) + tuple(ticket.ids_dev.shape[3:]) != tuple(row_ids.shape):
            raise HostTableError(
                f"layer {lid}: the prefetched step has ids {tuple(ticket.ids_dev.shape)}, the forward "
                f"{tuple(row_ids.shape)}: prefetch the ids of the step that runs next"
            )
        if row_ids.device.type == "cpu" and not torch.equal(ticket.ids_dev[:, :, index], row_ids):
            raise HostTableError(f"layer {lid}: the forward's row ids are not the prefetched step's")
        return self._gathered_rows(ticket, layer, row_ids, t0)

    @abc.abstractmethod
    def _gathered_rows(self, ticket: StepPrefetch, layer: HostLayer, row_ids: torch.Tensor, t0: float) -> torch.Tensor:
        """Main thread: the rows of `row_ids` from the gather of `ticket` (done), up to date as the
        mode promises; adds the seconds waited since `t0` to ``wait_s``."""

    # ------------------------------------------------------------------ gradients and update
    def gradients(self) -> dict[int, torch.Tensor]:
        """Each table's gradient of the last backward, coalesced per unique row on the device:
        {layer id: sparse COO [rows, head_dim]} (as a sparse ``nn.Embedding`` gives and
        `clip_grad_norm_` coalesces). Cached until `zero_grad`; clipping scales it in place."""
        out = {}
        for lid, layer in self.layers.items():
            if layer.grad is None:
                parts = [(ids, leaf.grad, runs) for ids, leaf, runs in layer.leaves if leaf.grad is not None]
                if not parts:
                    continue
                if len(parts) == 1 and parts[0][2] is not None:
                    layer.grad = coalesced_gradient(parts[0][1], parts[0][2], layer.weight.shape)
                else:
                    ids = torch.cat([i.reshape(-1) for i, _, _ in parts])
                    values = torch.cat([g.reshape(-1, g.shape[-1]) for _, g, _ in parts])
                    with warnings.catch_warnings():  # ids are row ids of this table by construction
                        warnings.filterwarnings("ignore", "Sparse invariant checks")
                        layer.grad = torch.sparse_coo_tensor(
                            ids[None].long(), values, layer.weight.shape, check_invariants=False
                        ).coalesce()
            out[lid] = layer.grad
        return out

    @torch.no_grad()
    def step(self) -> None:
        """Apply Adam to each table's rows of this step with its (clipped) gradient."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        self._adam_step(lr, beta1, beta2, eps)

    @abc.abstractmethod
    def _adam_step(self, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """Main thread: start this step's Adam update of every table that has a gradient."""

    @staticmethod
    def _write(
        layer: HostLayer, ids: torch.Tensor, new: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: torch.Tensor
    ) -> None:
        """Store Adam's results for unique rows `ids`: rows, moments (in the state dtype), steps."""
        layer.weight.index_copy_(0, ids, new)
        layer.exp_avg.index_copy_(0, ids, m.to(layer.exp_avg.dtype))
        layer.exp_avg_sq.index_copy_(0, ids, v.to(layer.exp_avg_sq.dtype))
        layer.row_step.index_copy_(0, ids, t)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for layer in self.layers.values():
            layer.leaves.clear()
            layer.grad = None

    # ------------------------------------------------------------------ state
    def state_rows(self) -> int:
        """Rows that have been updated at least once, over all tables."""
        self.flush()
        return sum(int((layer.row_step > 0).sum()) for layer in self.layers.values())

    @staticmethod
    def table_name(layer_id: int) -> str:
        """The parameter name the table has in a `DecoderLM` (its key in `SparseAdam`'s checkpoints)."""
        return f"blocks.{layer_id}.engram.table.weight"

    def table_tensors(self) -> dict[int, torch.Tensor]:
        """{layer id: the host table} after every pending update."""
        self.flush()
        return {lid: layer.weight for lid, layer in self.layers.items()}

    def export_state(self, names=None) -> dict[str, torch.Tensor]:
        """Adam state in `SparseAdam.export_state`'s format (slots in row order), so either kind
        of table resumes from either kind's checkpoint."""
        self.flush()
        out = {}
        for lid, layer in self.layers.items():
            touched = (layer.row_step > 0).nonzero().squeeze(1)
            if touched.numel() == 0:
                continue
            slot_of_row = torch.full((layer.weight.shape[0],), -1, dtype=torch.int32)
            slot_of_row[touched] = torch.arange(touched.numel(), dtype=torch.int32)
            base = self.table_name(lid)
            out[f"{base}.slot_of_row"] = slot_of_row
            out[f"{base}.exp_avg"] = layer.exp_avg.index_select(0, touched).float()
            out[f"{base}.exp_avg_sq"] = layer.exp_avg_sq.index_select(0, touched).float()
            out[f"{base}.row_step"] = layer.row_step.index_select(0, touched)
        return out

    def import_state(self, tensors: dict[str, torch.Tensor], names=None) -> None:
        """Load `export_state`'s (or `SparseAdam`'s) tensors; rows without state restart at zero."""
        self.flush()
        for lid, layer in self.layers.items():
            base = self.table_name(lid)
            layer.steps = 0
            layer.exp_avg.zero_()
            layer.exp_avg_sq.zero_()
            layer.row_step.zero_()
            if f"{base}.slot_of_row" not in tensors:
                continue
            slot_of_row = tensors[f"{base}.slot_of_row"].to(torch.int64)
            if slot_of_row.shape != (layer.weight.shape[0],):
                raise ValueError(
                    f"optimizer state for {base} has {slot_of_row.shape[0]} rows, the table {layer.weight.shape[0]}"
                )
            row_ids = (slot_of_row >= 0).nonzero().squeeze(1)
            slots = slot_of_row[row_ids]
            layer.exp_avg.index_copy_(0, row_ids, tensors[f"{base}.exp_avg"][slots].to(layer.exp_avg.dtype))
            layer.exp_avg_sq.index_copy_(0, row_ids, tensors[f"{base}.exp_avg_sq"][slots].to(layer.exp_avg_sq.dtype))
            layer.row_step.index_copy_(0, row_ids, tensors[f"{base}.row_step"][slots].float())
            layer.steps = int(layer.row_step.max()) if layer.row_step.numel() else 0

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finish pending updates, stop the worker, unpin and free the host memory."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._queue.clear()
            for view in self._views:  # no tensor may view the memory when it is unmapped
                view.weight = torch.empty(0, view.head_dim)
            for layer in self.layers.values():
                layer.weight = layer.exp_avg = layer.exp_avg_sq = layer.row_step = layer.marked = None
                layer.leaves.clear()
                layer.buffers.clear()
                layer.current = layer.last = None
                for buf in layer.keep:
                    if buf is not None:
                        buf.close()
                layer.keep.clear()

    def __enter__(self) -> "HostTables":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def optimizer_mode(adam: str) -> type[HostTables]:
    """The `HostTables` class of an optimizer mode: ``adam`` ``"host"`` or ``"device"``."""
    if adam not in ("host", "device"):
        raise ValueError(f"adam must be 'host' or 'device', got {adam!r}")
    return DeviceAdamTables if adam == "device" else HostAdamTables


class HostAdamTables(HostAdam, HostTables):
    """`HostTables` with Adam on the host (``adam="host"``): the methods of `HostAdam`."""

    adam = "host"


class DeviceAdamTables(DeviceAdam, HostTables):
    """`HostTables` with Adam on the device (``adam="device"``): the methods of `DeviceAdam`."""

    adam = "device"
