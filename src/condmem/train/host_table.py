"""Engram tables trained in host memory: rows fetched to the GPU each step, Adam applied on the host.

A table with its Adam state costs 12 B per parameter in fp32; tables of tens of billions of
parameters do not fit in HBM beside a backbone. `HostTables` keeps every Engram layer's rows
and Adam state (two moments and a per-row step count, allocated for every row) in
page-locked host memory and stands in for the tables of a `DecoderLM`: each layer's
``engram.table`` becomes a view that returns the rows of the step's ids as a leaf tensor,
and `HostTables` is the tables' optimizer (`set_lr`, ``step``, ``zero_grad``, checkpoints in
`SparseAdam`'s format). One worker thread does the host work in order::

    main thread (device)                          worker thread (host, torch intra-op threads)
    step t:  hash batch t+1, copy its ids ──────► gather(t+1): index_select into pinned
             forward (rows of t: gather + patch)                staging, copy to the device
             backward; coalesce each table's
             gradient per unique row; clip
             (global norm); copy it to the host ─► Adam(t): rows also read at t+1 first,
             AdamW on the backbone                            their new values sent as the
    step t+1: rows of t+1, patched ◄──────────────            patch of t+1; then the rest

Exact by default: gather(t+1) runs after Adam(t-1) and before Adam(t), so the only rows of
step t+1 that it reads stale are those step t updates; Adam(t) updates those first and
sends their new values, which replace them on the device before the Engram layer reads
them. Step t+1 thus reads every row with every earlier update, as the HBM-resident table
does, and the same Adam arithmetic (`adam_rows_delta`) gives rows equal to `SparseAdam`'s
on the same device (the tests hold them ``torch.equal`` on the CPU). What the pipeline
hides is the gather, both copies and the Adam of rows step t+1 does not read; what it
cannot hide is the Adam of rows it does read (the device waits for their patch).

With ``adam="device"`` the device computes Adam and the host only stores: gather(t+1)
sends the unique rows of step t+1 with their moments and step counts; the rows step t
updates are patched from the device's own results of step t (rows and state), so no host
work is on the device's path between two steps; the results go back to the host
(``writeback``) while the next step computes. The same `adam_rows_delta` on the device
gives rows equal to `SparseAdam`'s there.

With ``staleness=1`` (bounded staleness, Hogwild-like) there is no patch: step t+1 reads
its rows as gathered, without step t's update to the rows both steps read (every earlier
update is in), and the device never waits for Adam. Not exact; the losses drift from the
exact run's by what one step of lag costs.

With ``prefetch=False`` every step fetches its rows after all earlier updates are applied
(the reference the pipelined path is tested against). Outside training (no autograd, or
no prefetched step) rows are fetched synchronously after all pending updates.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from condmem.train.optim import adam_rows_delta

logger = logging.getLogger("condmem.train")

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _patched(ids: torch.Tensor, patch_ids: torch.Tensor, pairs) -> list[torch.Tensor]:
    """For each (patch values, values) of `pairs` (rows aligned with the sorted, non-empty
    `patch_ids` and with `ids`): the values, with the patch's row wherever an id is patched."""
    pos = torch.searchsorted(patch_ids, ids).clamp_(max=patch_ids.numel() - 1)
    hit = patch_ids[pos] == ids
    return [torch.where(hit.view(-1, *([1] * (v.dim() - 1))), p[pos], v) for p, v in pairs]


class HostTableError(RuntimeError):
    """Host-resident tables used against their contract (ids of another step, a closed tier)."""


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
        return self.tier._rows(self.layer_id, row_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.head_dim}, host"


@dataclass
class _Layer:
    """One table on the host, its Adam state and its transfer buffers."""

    layer_id: int
    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    row_step: torch.Tensor
    marker: torch.Tensor
    """bool [rows]: True for the rows of the prefetched next step (which Adam updates first)."""
    keep: list = field(default_factory=list)
    marked: torch.Tensor | None = None
    steps: int = 0
    """Adam steps taken (no row has taken more)."""
    leaves: list = field(default_factory=list)
    grad: torch.Tensor | None = None
    consumed: list = field(default_factory=list)
    grad_jobs: list = field(default_factory=lambda: [None, None])
    buffers: dict = field(default_factory=dict)
    """Named pairs of pinned / device transfer buffers (`HostTables._named`)."""
    current: tuple | None = None
    """adam="device": (unique ids, rows, moments, steps) on the device, as the running step read them."""
    last: tuple | None = None
    """adam="device": (ids, new rows, moments, steps) of the latest device Adam: the next gather's patch."""


@dataclass
class _Ticket:
    """The prefetch of one step: its ids on the host and, per layer, the gathered rows on the
    device and the patch Adam of the step before sends."""

    step: int
    ids_host: torch.Tensor
    ids_dev: torch.Tensor
    copied: object
    adam_after: bool = False
    """An Adam job was queued after this gather: it sends the patch of this step's rows."""
    gathered: concurrent.futures.Future | None = None
    rows: dict = field(default_factory=dict)
    patch: dict = field(default_factory=dict)
    patch_ready: dict = field(default_factory=dict)
    used: set = field(default_factory=set)


class HostTables:
    """Every Engram table of a `DecoderLM` in host memory, trained with a lazy Adam on the host.

    Args:
        model: the model; each Engram layer's ``table`` is replaced by a `HostTableView`. A
            table already holding rows (CPU or device) is copied to the host; a table on the
            meta device is allocated on the host and drawn from N(0, ``init_std``).
        device: where the model computes (CPU works: transfers become copies).
        lr, betas, eps: Adam's; ``lr`` is the base rate `set_lr` scales (``param_groups``).
        state_dtype: ``"fp32"`` (exact: rows equal `SparseAdam`'s) or ``"bf16"`` (moments
            stored in bf16, computed in fp32: 8 instead of 12 B per parameter on the host).
        prefetch: fetch step t+1's rows while step t computes (see the module docstring).
        staleness: 0 (exact: rows step t updates are patched before step t+1 reads them) or 1
            (no patch: a step may read rows without the previous step's update, and the
            device never waits for the host's Adam).
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
        staleness: int = 0,
        adam: str = "host",
    ):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
        if staleness not in (0, 1):
            raise ValueError(
                f"staleness must be 0 (exact) or 1 (rows may lack the previous step's update), got {staleness!r}"
            )
        if adam not in ("host", "device"):
            raise ValueError(f"adam must be 'host' or 'device', got {adam!r}")
        if adam == "device" and staleness:
            raise ValueError(
                "adam='device' is exact only: the device's Adam needs each row's latest state (staleness=0)"
            )
        self.staleness = staleness
        self.device_adam = adam == "device"
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = self.cuda if pin is None else pin
        self.prefetch_enabled = prefetch
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.threads = threads
        self.param_groups = [{"lr": lr, "base_lr": lr, "betas": tuple(betas), "eps": eps}]
        self.layers: dict[int, _Layer] = {}
        self._views: list[HostTableView] = []
        self._queue: deque[_Ticket] = deque()
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
        self.wait_s = 0.0
        """Seconds the main thread waited for the host (gathers and patches), summed."""
        std = init_std if init_std is not None else getattr(getattr(model, "cfg", None), "engram_table_init_std", 0.02)
        self.setup_seconds: dict[str, float] = {}
        """Seconds spent filling (``fill``) and page-locking (``pin``) the host tensors."""
        t0 = time.perf_counter()
        for engram in model.engram_layers:
            table = engram.table
            rows, dim = table.num_embeddings, table.head_dim
            src = tables[engram.layer_id] if tables is not None else table.weight
            fill = (
                _fill_normal(std, seed + engram.layer_id, threads or torch.get_num_threads())
                if src.device.type == "meta"
                else (lambda t, s=src: t.copy_(s.detach()))
            )
            keep = []
            weight, k = _host_tensor((rows, dim), torch.float32, self.pin, fill, self.setup_seconds)
            keep.append(k)
            moments = []
            zero = _fill_zero(threads or torch.get_num_threads()) if self.pin else None
            for _ in range(2):
                m, k = _host_tensor((rows, dim), self.state_dtype, self.pin, zero, self.setup_seconds)
                moments.append(m)
                keep.append(k)
            row_step, k = _host_tensor((rows,), torch.float32, self.pin, zero, self.setup_seconds)
            keep.append(k)
            layer = _Layer(
                engram.layer_id,
                weight,
                moments[0],
                moments[1],
                row_step,
                torch.zeros(rows, dtype=torch.bool),
                keep=keep,
            )
            self.layers[engram.layer_id] = layer
            engram.table = HostTableView(self, engram.layer_id, weight)
            self._views.append(engram.table)
            del src, fill  # the model's own table is freed here (the fill held it)
        self.setup_s = time.perf_counter() - t0
        """Seconds spent allocating, filling and page-locking the host tensors."""

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
    def _buffer(buffers: list, i: int, shape: tuple[int, ...], dtype: torch.dtype, make) -> torch.Tensor:
        """Buffer `i` of a pair, grown to hold `shape` (reused across steps)."""
        while len(buffers) <= i:
            buffers.append(None)
        need = 1
        for s in shape:
            need *= s
        b = buffers[i]
        if b is None or b.numel() < need or b.dtype != dtype:
            b = buffers[i] = make(need, dtype)
        return b[:need].view(shape)

    def _pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin)

    def _on_device(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)

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
            ids_host = torch.empty(row_ids.shape, dtype=row_ids.dtype, pin_memory=self.pin)
            ids_host.copy_(row_ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            ids_host, copied = row_ids, None
        ticket = _Ticket(step, ids_host, row_ids, copied)
        for lid in self.layers:
            ticket.patch_ready[lid] = threading.Event()
        gather = self._gather_unique if self.device_adam else self._gather
        ticket.gathered = self._submit(gather, ticket, self._gathers % 2)
        self._gathers += 1
        self._queue.append(ticket)

    def _gather(self, ticket: _Ticket, slot: int) -> None:
        """Worker: this step's rows into pinned staging, then to the device; mark them for Adam."""
        if ticket.copied is not None:
            ticket.copied.synchronize()
        for index, (lid, layer) in enumerate(self.layers.items()):
            ids = ticket.ids_host[:, :, index].reshape(-1)
            n, d = ids.numel(), layer.weight.shape[1]
            staging = self._named(layer, "rows", slot, (n, d), torch.float32, pinned=True)
            torch.index_select(layer.weight, 0, ids, out=staging)
            if self.staleness == 0:  # the rows the Adam queued next updates first, for the patch
                layer.marker[ids] = True
                layer.marked = ids
            if self.cuda:
                dev = self._named(layer, "rows", slot, (n, d), torch.float32, pinned=False)
                self._wait_consumed(layer, slot)
                with torch.cuda.stream(self._h2d):
                    dev.copy_(staging, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._h2d)
                done.synchronize()  # the staging is free again when this job ends (the worker has time)
                ticket.rows[lid] = (dev, done, slot)
            else:
                ticket.rows[lid] = (staging, None, slot)

    def _named(
        self, layer: _Layer, name: str, slot: int, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool
    ) -> torch.Tensor:
        """Buffer `slot` of the layer's pair `name` (pinned host or device), grown as needed."""
        key = (name, pinned)
        return self._buffer(
            layer.buffers.setdefault(key, []), slot, shape, dtype, self._pinned if pinned else self._on_device
        )

    def _unique_state(self, layer: _Layer, ids: torch.Tensor, slot: int | None):
        """Host: the unique rows of `ids` (sorted) with their moments and step counts, on the
        device, in the buffers of `slot` (None: fresh tensors, for a step that fetches its
        own rows while a prefetch may hold the slots). Returns (unique ids, inverse, rows, m,
        v, steps, event when on the device)."""

        def buf(name: str, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
            if slot is not None:
                return self._named(layer, name, slot, shape, dtype, pinned)
            if pinned:
                return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            return torch.empty(shape, dtype=dtype, device=self.device)

        uniq, inv = torch.unique(ids, return_inverse=True)
        k, d = uniq.numel(), layer.weight.shape[1]
        host = {"ids": uniq, "inv": inv}
        for name, src, shape in (
            ("rows", layer.weight, (k, d)),
            ("m", layer.exp_avg, (k, d)),
            ("v", layer.exp_avg_sq, (k, d)),
            ("step", layer.row_step, (k,)),
        ):
            host[name] = torch.index_select(src, 0, uniq, out=buf(name, shape, src.dtype, self.pin))
        if not self.cuda:
            return (uniq, inv, host["rows"], host["m"].float(), host["v"].float(), host["step"], None)
        if slot is not None:
            self._wait_consumed(layer, slot)
        dev = {}
        with torch.cuda.stream(self._h2d):
            for name, t in host.items():
                if name in ("ids", "inv") and self.pin:
                    t = buf(name, tuple(t.shape), t.dtype, True).copy_(t)
                dev[name] = buf(name, tuple(t.shape), t.dtype, False)
                dev[name].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._h2d)
        done.synchronize()  # the pinned buffers are free again when this call ends
        return (dev["ids"], dev["inv"], dev["rows"], dev["m"], dev["v"], dev["step"], done)

    def _gather_unique(self, ticket: _Ticket, slot: int) -> None:
        """Worker (adam="device"): each layer's unique rows of this step and their Adam state to the device."""
        if ticket.copied is not None:
            ticket.copied.synchronize()
        for index, (lid, layer) in enumerate(self.layers.items()):
            ticket.rows[lid] = (*self._unique_state(layer, ticket.ids_host[:, :, index].reshape(-1), slot), slot)

    def _device_rows(self, layer: _Layer, fetched, row_ids: torch.Tensor) -> torch.Tensor:
        """Main thread (adam="device"): the step's unique rows and state, patched with the latest
        device Adam's results (rows the host has not received yet), kept for `step`; returns
        the rows of `row_ids`."""
        uniq, inv, rows, m, v, st, done = fetched[:7]
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        if done is not None:
            cur.wait_event(done)
        m, v = m.float(), v.float()
        if layer.last is not None and layer.last[0].numel():
            ids0, new0, m0, v0, st0 = layer.last
            rows, m, v, st = _patched(uniq, ids0, [(new0, rows), (m0, m), (v0, v), (st0, st)])
        layer.current = (uniq, rows, m, v, st, fetched[7])
        out = rows[inv]
        self._mark_consumed(layer, fetched[7])
        return out.view(*row_ids.shape, -1)

    @staticmethod
    def _wait_consumed(layer: _Layer, slot: int) -> None:
        """Worker: wait until the device has run past every read of device buffer `slot`."""
        if len(layer.consumed) > slot and layer.consumed[slot] is not None:
            layer.consumed[slot].synchronize()

    def _mark_consumed(self, layer: _Layer, slot: int | None) -> None:
        """Record on the current stream that the work queued so far has read device buffer `slot`
        (a gather may overwrite it once the event has passed)."""
        if not self.cuda or slot is None:
            return
        while len(layer.consumed) <= slot:
            layer.consumed.append(None)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        layer.consumed[slot] = ev

    # ------------------------------------------------------------------ rows (main thread)
    def _rows(self, layer_id: int, row_ids: torch.Tensor) -> torch.Tensor:
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
            if self.device_adam and training:
                layer.last = None  # flushed: the host holds every update
                rows = self._device_rows(layer, (*self._unique_state(layer, ids, None), None), row_ids)
            else:
                rows = layer.weight.index_select(0, ids).to(self.device).view(*row_ids.shape, -1)
            self.wait_s += time.perf_counter() - t0
        if not training:
            return rows
        leaf = rows.detach().requires_grad_(True)
        layer.leaves.append((row_ids, leaf))
        return leaf

    def _prefetched(self, ticket: _Ticket, layer: _Layer, row_ids: torch.Tensor) -> torch.Tensor:
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
        if self.device_adam:
            self.wait_s += time.perf_counter() - t0
            return self._device_rows(layer, ticket.rows[lid], row_ids)
        rows, done, slot = ticket.rows[lid]
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        if done is not None:
            cur.wait_event(done)
        patch = None
        if ticket.adam_after:
            ticket.patch_ready[lid].wait()
            patch = ticket.patch.get(lid)
        self.wait_s += time.perf_counter() - t0
        flat = rows.reshape(-1, rows.shape[-1])
        if patch is not None:
            p_ids, p_vals, p_done = patch
            if p_done is not None:
                cur.wait_event(p_done)
                p_ids.record_stream(cur)
                p_vals.record_stream(cur)
            (out,) = _patched(row_ids.reshape(-1).to(p_ids.dtype), p_ids, [(p_vals, flat)])
        else:
            out = flat.clone()
        self._mark_consumed(layer, slot)
        return out.view(*row_ids.shape, -1)

    # ------------------------------------------------------------------ gradients and update
    def gradients(self) -> dict[int, torch.Tensor]:
        """Each table's gradient of the last backward, coalesced per unique row on the device:
        {layer id: sparse COO [rows, head_dim]} (as a sparse ``nn.Embedding`` gives and
        `clip_grad_norm_` coalesces). Cached until `zero_grad`; clipping scales it in place."""
        out = {}
        for lid, layer in self.layers.items():
            if layer.grad is None:
                parts = [(ids, leaf.grad) for ids, leaf in layer.leaves if leaf.grad is not None]
                if not parts:
                    continue
                ids = torch.cat([i.reshape(-1) for i, _ in parts])
                values = torch.cat([g.reshape(-1, g.shape[-1]) for _, g in parts])
                with warnings.catch_warnings():  # ids are row ids of this table by construction
                    warnings.filterwarnings("ignore", "Sparse invariant checks")
                    layer.grad = torch.sparse_coo_tensor(
                        ids[None].long(), values, layer.weight.shape, check_invariants=False
                    ).coalesce()
            out[lid] = layer.grad
        return out

    @torch.no_grad()
    def step(self) -> None:
        """Send each table's (clipped) gradient to the host and queue its Adam update."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        if self.device_adam:
            self._device_step(lr, beta1, beta2, eps)
            return
        nxt = next((t for t in self._queue if t.step == self._step + 1), None) if self.staleness == 0 else None
        grads = self.gradients()
        jobs = {}
        for lid, grad in grads.items():
            layer = self.layers[lid]
            ids, values = grad.indices()[0], grad.values()
            slot = self._step % 2
            if layer.grad_jobs[slot] is not None:
                layer.grad_jobs[slot].result()  # the Adam job that last read this pinned buffer is done
            if self.cuda:
                k, d = values.shape
                h_ids = self._named(layer, "grad_ids", slot, (k,), torch.int64, pinned=True)
                h_vals = self._named(layer, "grad_vals", slot, (k, d), torch.float32, pinned=True)
                self._d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h):
                    h_ids.copy_(ids, non_blocking=True)
                    h_vals.copy_(values, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(self._d2h)
                ids.record_stream(self._d2h)
                values.record_stream(self._d2h)
            else:
                h_ids, h_vals, copied = ids, values.float(), None
            jobs[lid] = (h_ids, h_vals, copied, slot)
        if nxt is not None:
            nxt.adam_after = True
        fut = self._submit(self._adam, jobs, nxt, lr, beta1, beta2, eps)
        for lid, (_, _, _, slot) in jobs.items():
            self.layers[lid].grad_jobs[slot] = fut

    def _device_step(self, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """adam="device": Adam on the device for each table's rows of this step, kept as the
        next gather's patch and sent to the host, where the worker stores them."""
        for lid, grad in self.gradients().items():
            layer = self.layers[lid]
            uniq, rows, m, v, st, read_slot = layer.current
            ids, values = grad.indices()[0], grad.values()
            pos = torch.searchsorted(uniq, ids)  # the gradient's rows are rows this step read
            m, v, st, old = m[pos], v[pos], st[pos] + 1, rows[pos]
            self._mark_consumed(layer, read_slot)  # the step's buffers are read up to here
            layer.steps += 1
            new = old + adam_rows_delta(values.float(), m, v, st, lr, beta1, beta2, eps, layer.steps)
            if layer.exp_avg.dtype != torch.float32:  # as the host stores them, so a patch equals a re-read
                m, v = m.to(layer.exp_avg.dtype).float(), v.to(layer.exp_avg_sq.dtype).float()
            layer.last = (ids, new, m, v, st)
            layer.current = None
            slot = self._step % 2
            if layer.grad_jobs[slot] is not None:
                layer.grad_jobs[slot].result()  # the writeback that last read these pinned buffers is done
            job = (ids, new, m, v, st)
            copied = None
            if self.cuda:
                self._d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h):
                    job = tuple(
                        self._named(layer, f"writeback{i}", slot, tuple(t.shape), t.dtype, pinned=True).copy_(
                            t, non_blocking=True
                        )
                        for i, t in enumerate(job)
                    )
                    for t in (ids, new, m, v, st):
                        t.record_stream(self._d2h)
                    copied = torch.cuda.Event()
                    copied.record(self._d2h)
            job = (*job, copied)
            layer.grad_jobs[slot] = self._submit(self._writeback, layer, *job)

    def _writeback(self, layer: _Layer, ids, new, m, v, st, copied) -> None:
        """Worker (adam="device"): the device's Adam results into the host's rows and state."""
        if copied is not None:
            copied.synchronize()
        self._write(layer, ids, new, m, v, st)

    def _adam(self, jobs: dict, nxt: _Ticket | None, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """Worker: Adam on the host, the rows the next step reads first (their new values become its patch)."""
        for lid, layer in self.layers.items():
            job = jobs.get(lid)
            try:
                if job is None:
                    continue
                ids, values, copied, _ = job
                if copied is not None:
                    copied.synchronize()
                layer.steps += 1
                args = (lr, beta1, beta2, eps, layer.steps)
                if nxt is None:
                    self._write(layer, ids, *self._update(layer, ids, values, *args))
                    continue
                # Rows the next step reads first: their new values are its patch. Adam treats each
                # row alone (`adam_rows_delta`), so splitting the rows changes no bit.
                first = layer.marker[ids]
                if layer.marked is not None:
                    layer.marker[layer.marked] = False
                    layer.marked = None
                hot = first.nonzero().squeeze(1)
                hot_ids = ids[hot]
                hot_update = self._update(layer, hot_ids, values[hot], *args)
                nxt.patch[lid] = self._send_patch(hot_ids, hot_update[0]) if hot.numel() else None
                nxt.patch_ready[lid].set()  # the next step's wait ends here
                rest = (~first).nonzero().squeeze(1)
                rest_ids = ids[rest]
                rest_update = self._update(layer, rest_ids, values[rest], *args)
                self._write(layer, hot_ids, *hot_update)
                self._write(layer, rest_ids, *rest_update)
            finally:
                if nxt is not None and lid in nxt.patch_ready:
                    nxt.patch_ready[lid].set()  # never leave the main thread waiting, even on an error

    @staticmethod
    def _update(
        layer: _Layer,
        ids: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        max_step: int,
    ) -> tuple[torch.Tensor, ...]:
        """Adam for unique rows `ids`: (new rows, moments, steps), not yet written."""
        m = layer.exp_avg.index_select(0, ids).float()
        v = layer.exp_avg_sq.index_select(0, ids).float()
        t = layer.row_step.index_select(0, ids) + 1
        new = layer.weight.index_select(0, ids) + adam_rows_delta(
            grad.float(), m, v, t, lr, beta1, beta2, eps, max_step
        )
        return new, m, v, t

    @staticmethod
    def _write(
        layer: _Layer, ids: torch.Tensor, new: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: torch.Tensor
    ) -> None:
        layer.weight.index_copy_(0, ids, new)
        layer.exp_avg.index_copy_(0, ids, m.to(layer.exp_avg.dtype))
        layer.exp_avg_sq.index_copy_(0, ids, v.to(layer.exp_avg_sq.dtype))
        layer.row_step.index_copy_(0, ids, t)

    def _send_patch(self, ids: torch.Tensor, new: torch.Tensor):
        if not self.cuda:
            return ids, new, None
        h_ids, h_new = ids.pin_memory() if self.pin else ids, new.pin_memory() if self.pin else new
        with torch.cuda.stream(self._h2d):
            d_ids = h_ids.to(self.device, non_blocking=True)
            d_new = h_new.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._h2d)
        return d_ids, d_new, done

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
            rows = (slot_of_row >= 0).nonzero().squeeze(1)
            slots = slot_of_row[rows]
            layer.exp_avg.index_copy_(0, rows, tensors[f"{base}.exp_avg"][slots].to(layer.exp_avg.dtype))
            layer.exp_avg_sq.index_copy_(0, rows, tensors[f"{base}.exp_avg_sq"][slots].to(layer.exp_avg_sq.dtype))
            layer.row_step.index_copy_(0, rows, tensors[f"{base}.row_step"][slots].float())
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
