"""The optimizer modes of `HostTables`, both exact: `HostAdam` (Adam on the host) and `DeviceAdam`
(Adam on the device). Each holds the methods of its mode; `condmem.train.host_table` joins each
with the part every mode shares into `HostAdamTables` and `DeviceAdamTables`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from condmem.ops.row_patch import patched_rows
from condmem.ops.triton_util import triton_available
from condmem.train.host_table_state import HostLayer, HostTableError, StepPrefetch
from condmem.train.optim import adam_rows_delta, beta_powers


@dataclass
class _PatchedTicket(StepPrefetch):
    """A prefetch with the patch the host Adam of the step before sends (its new values of the rows
    this step reads)."""

    adam_after: bool = False
    """An Adam job was queued after this gather: it sends the patch of this step's rows."""
    patch: dict = field(default_factory=dict)
    patch_ready: dict = field(default_factory=dict)


class HostAdam:
    """The methods of `HostTables` with Adam on the host (`HostAdamTables`): rows fetched to the
    device each step, updated on the host.

    One worker thread does the host work in order::

        main thread (device)                          worker thread (host, torch intra-op threads)
        step t:  forward (rows of t: gather + patch)
                 hash batch t+1, copy its ids ──────► gather(t+1): index_select into pinned
                                                                   staging, copy to the device
                 backward; coalesce each table's
                 gradient per unique row; clip
                 (global norm); copy it to the host ─► Adam(t): rows also read at t+1 first,
                 AdamW on the backbone                            their new values sent as the
        step t+1: rows of t+1, patched ◄──────────────            patch of t+1; then the rest

    Exact: gather(t+1) runs after Adam(t-1) and before Adam(t), so the only rows of step t+1
    that it reads stale are those step t updates; Adam(t) updates those first and sends their
    new values, which replace them on the device before the Engram layer reads them. Step t+1
    thus reads every row with every earlier update, as the HBM-resident table does, and the
    same Adam arithmetic (`adam_rows_delta`) gives rows equal to `SparseAdam`'s on the same
    device (the tests hold them ``torch.equal`` on the CPU). What the pipeline hides is the
    gather, both copies and the Adam of rows step t+1 does not read; what it cannot hide is
    the Adam of rows it does read (the device waits for their patch).
    """

    def _ticket(self, step: int, ids_host: torch.Tensor, ids_dev: torch.Tensor, copied) -> _PatchedTicket:
        ticket = _PatchedTicket(step, ids_host, ids_dev, copied)
        for lid in self.layers:
            ticket.patch_ready[lid] = threading.Event()
        return ticket

    def _gather(self, ticket: _PatchedTicket, slot: int) -> None:
        """Worker: this step's rows into pinned staging, then to the device; mark them for Adam."""
        if ticket.copied is not None:
            ticket.copied.synchronize()
        for index, (lid, layer) in enumerate(self.layers.items()):
            ids = ticket.ids_host[:, :, index].reshape(-1)
            n, d = ids.numel(), layer.weight.shape[1]
            staging = self._named(layer, "rows", slot, (n, d), torch.float32, pinned=True)
            torch.index_select(layer.weight, 0, ids, out=staging)
            self._mark_for_patch(layer, ids)
            if self.cuda:
                self._wait_consumed(layer, slot)  # first: a buffer grown here frees the one the device read
                dev = self._named(layer, "rows", slot, (n, d), torch.float32, pinned=False)
                with torch.cuda.stream(self._h2d):
                    dev.copy_(staging, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._h2d)
                done.synchronize()  # the staging is free again when this job ends (the worker has time)
                ticket.fetched[lid] = (dev, done, slot)
            else:
                ticket.fetched[lid] = (staging, None, slot)

    @staticmethod
    def _mark_for_patch(layer: HostLayer, ids: torch.Tensor) -> None:
        """Worker: mark the gathered rows, which the Adam queued next updates first, for the patch."""
        layer.marker[ids] = True
        layer.marked = ids

    def _patched_ticket(self) -> _PatchedTicket | None:
        """The prefetch of the next step, whose rows this step's Adam patches (None: no prefetch)."""
        return next((t for t in self._queue if t.step == self._step + 1), None)

    def _gathered_rows(
        self, ticket: _PatchedTicket, layer: HostLayer, row_ids: torch.Tensor, t0: float
    ) -> torch.Tensor:
        """Main thread: the gathered rows, with the patch of the Adam queued after the gather."""
        lid = layer.layer_id
        rows, done, slot = ticket.fetched[lid]
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
            (out,) = patched_rows(row_ids.reshape(-1).to(p_ids.dtype), p_ids, [(p_vals, flat)])
        else:
            out = flat.clone()
        self._mark_consumed(layer, slot)
        return out.view(*row_ids.shape, -1)

    def _adam_step(self, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """Send each table's (clipped) gradient to the host and queue its Adam update."""
        nxt = self._patched_ticket()
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

    def _adam(self, jobs: dict, nxt: _PatchedTicket | None, lr: float, beta1: float, beta2: float, eps: float) -> None:
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
        layer: HostLayer,
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

    def _send_patch(self, ids: torch.Tensor, new: torch.Tensor):
        """Worker: the patch (updated rows `ids`, their new values) on its way to the device:
        (ids, rows, event when the copy is done or None)."""
        if not self.cuda:
            return ids, new, None
        h_ids, h_new = ids.pin_memory() if self.pin else ids, new.pin_memory() if self.pin else new
        with torch.cuda.stream(self._h2d):
            d_ids = h_ids.to(self.device, non_blocking=True)
            d_new = h_new.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._h2d)
        return d_ids, d_new, done


class DeviceAdam:
    """The methods of `HostTables` with Adam on the device (`DeviceAdamTables`, ``adam="device"``):
    the host only stores.

    gather(t+1) sends the unique rows of step t+1 with their moments and step counts; the rows
    step t updates are patched from the device's own results of step t (rows and state), so no
    host work is on the device's path between two steps; the results go back to the host
    (``writeback``) while the next step computes. On CUDA the patch and the Adam step are
    Triton kernels (`condmem.ops.row_patch`, `adam_rows_step`), elsewhere torch ops
    (`adam_rows_delta`); both give rows equal to `SparseAdam`'s on the same device (its fused
    CUDA step is held ``torch.equal`` to that arithmetic: tests/train/test_sparse_adam_fused.py,
    and the kernels here to their torch ops: tests/train/test_train_fast_paths.py).
    """

    def _unique_state(self, layer: HostLayer, ids: torch.Tensor, slot: int | None):
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
            host[name] = torch.index_select(src, 0, uniq, out=buf(name, shape, src.dtype, True))
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

    def _gather(self, ticket: StepPrefetch, slot: int) -> None:
        """Worker: each layer's unique rows of this step and their Adam state to the device."""
        if ticket.copied is not None:
            ticket.copied.synchronize()
        for index, (lid, layer) in enumerate(self.layers.items()):
            ticket.fetched[lid] = (*self._unique_state(layer, ticket.ids_host[:, :, index].reshape(-1), slot), slot)

    def begin(self, step: int) -> None:
        super().begin(step)
        for layer in self.layers.values():
            layer.current = None  # a forward of an earlier step that took no optimizer step

    def _gathered_rows(self, ticket: StepPrefetch, layer: HostLayer, row_ids: torch.Tensor, t0: float) -> torch.Tensor:
        self.wait_s += time.perf_counter() - t0
        return self._device_rows(layer, ticket.fetched[layer.layer_id], row_ids)

    def _distinct_ids(self, layer: HostLayer) -> torch.Tensor | None:
        return layer.current[0] if layer.current is not None else None

    def _fetched_now(self, layer: HostLayer, ids: torch.Tensor, row_ids: torch.Tensor, training: bool) -> torch.Tensor:
        """Training: the unique rows and their state, kept for `step`; otherwise the rows alone."""
        if not training:
            return super()._fetched_now(layer, ids, row_ids, training)
        layer.last = None  # flushed: the host holds every update
        return self._device_rows(layer, (*self._unique_state(layer, ids, None), None), row_ids)

    def _device_rows(self, layer: HostLayer, fetched, row_ids: torch.Tensor) -> torch.Tensor:
        """Main thread: the step's unique rows and state, patched with the latest device Adam's
        results (rows the host has not received yet), kept for `step`; returns the rows of `row_ids`."""
        if layer.current is not None:
            # Adam here updates the rows of one forward: a second forward's rows would replace
            # the first's, and the step would apply the summed gradient to the wrong rows.
            raise HostTableError(
                f"layer {layer.layer_id}: a second training forward in one step; Adam on the device "
                "takes one forward per step (adam='host' accumulates gradients over several)"
            )
        uniq, inv, rows, m, v, st, done = fetched[:7]
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        if done is not None:
            cur.wait_event(done)
        m, v = m.float(), v.float()
        owned = False  # the step's own tensors, not the transfer buffers a later gather refills
        if layer.last is not None and layer.last[0].numel():
            ids0, new0, m0, v0, st0 = layer.last
            rows, m, v, st = patched_rows(uniq, ids0, [(new0, rows), (m0, m), (v0, v), (st0, st)])
            owned = True
        # The ids copied before the buffers are marked read: the gradient's indices are these ids,
        # and they become the next gather's patch ids (``layer.last``), which must outlive the
        # transfer buffer a later gather refills.
        layer.current = (uniq.clone(), rows, m, v, st, fetched[7], owned)
        out = rows[inv]
        self._mark_consumed(layer, fetched[7])
        return out.view(*row_ids.shape, -1)

    def _adam_step(self, lr: float, beta1: float, beta2: float, eps: float) -> None:
        """Adam on the device for each table's rows of this step, kept as the next gather's patch
        and sent to the host, where the worker stores them."""
        for lid, grad in self.gradients().items():
            layer = self.layers[lid]
            uniq, rows, m, v, st, read_slot, owned = layer.current
            ids, values = grad.indices()[0], grad.values()
            if ids.numel() == uniq.numel():
                # The gradient's rows are rows this step read (sorted, unique), so all of them, in
                # order. Adam updates the step's own tensors in place (copies of the buffers first).
                if not owned:
                    rows, m, v, st = rows.clone(), m.clone(), v.clone(), st.clone()
            else:
                pos = torch.searchsorted(uniq, ids)
                rows, m, v, st = rows[pos], m[pos], v[pos], st[pos]
            self._mark_consumed(layer, read_slot)  # the step's buffers are read up to here
            layer.steps += 1
            _adam_rows(values.float().contiguous(), rows, m, v, st, lr, beta1, beta2, eps, layer.steps)
            new = rows
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

    def _writeback(self, layer: HostLayer, ids, new, m, v, st, copied) -> None:
        """Worker: the device's Adam results into the host's rows and state."""
        if copied is not None:
            copied.synchronize()
        self._write(layer, ids, new, m, v, st)


def _adam_rows(
    grad, rows, m, v, st, lr: float, beta1: float, beta2: float, eps: float, max_step: int, fused: bool | None = None
) -> None:
    """Adam for k rows side by side, in place (rows, moments, step counts + 1): one Triton
    launch on CUDA (`adam_rows_step`, bit-equal there), `adam_rows_delta` elsewhere or with
    ``fused=False``."""
    if (rows.is_cuda and triton_available()) if fused is None else fused:
        from condmem.ops.sparse_adam_triton import adam_rows_step

        pow1, pow2 = beta_powers(beta1, max_step, rows.device), beta_powers(beta2, max_step, rows.device)
        adam_rows_step(grad, rows, m, v, st, pow1, pow2, lr, beta1, beta2, eps)
        return
    st.add_(1)
    rows.add_(adam_rows_delta(grad, m, v, st, lr, beta1, beta2, eps, max_step))
