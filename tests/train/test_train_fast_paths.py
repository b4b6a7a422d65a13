"""Training's fast CUDA paths against the plain ones they replace, over 50 steps of the tiny
preset on the GPU: every parameter and every loss bit-equal.

* the tables' lookup (`condmem.ops.row_grad.table_lookup`: the sparse gradient reduced per
  row by one kernel) against ``F.embedding(..., sparse=True)`` coalesced after the backward;
* the tables' fused Adam step (`SparseAdam`'s Triton kernel, no host sync) against its torch path;
* host-resident tables with Adam on the device: the patch of the rows the previous step updated
  (`condmem.ops.row_patch`) and the Adam step (`adam_rows_step`) as Triton kernels against
  their torch ops.

A second plain run first shows the GPU run is itself deterministic (otherwise a difference
would say nothing about the fast path).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import condmem.module as engram_module
import condmem.train.host_table_optim as host_optim
from condmem.ops.row_patch import patched_rows
from condmem.train.host_table import HostTables
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.train.presets import get_preset

STEPS = 50


def _train(data, monkeypatch, *, plain: bool):
    with monkeypatch.context() as m:
        if plain:
            m.setattr(engram_module, "table_lookup", lambda weight, ids: F.embedding(ids, weight, sparse=True))
        preset = get_preset("tiny", {"train": {"batch_size": 8, "seq_len": 64}})
        model = build_model(build_model_config(preset, data), data, seed=0, device="cuda")
        tc = dataclasses.replace(preset.train, steps=STEPS)
        trainer = build_trainer(model, tc, data, "cuda", progress=False)
        if plain:
            trainer.sparse.fused = False
        losses = [trainer.train_step(step)[0] for step in range(STEPS)]
        torch.cuda.synchronize()
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b, what):
    if a[0] != b[0]:
        first = next(i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y)
        raise AssertionError(f"{what}: losses differ from step {first}: {a[0][first]} vs {b[0][first]}")
    for name, t in a[1].items():
        worst = (t.float() - b[1][name].float()).abs().max()
        assert torch.equal(t, b[1][name]), f"{what}: {name} differs (max {worst})"


@pytest.mark.gpu
def test_fast_table_paths_train_like_the_plain_ones(tiny_data, monkeypatch):
    plain = _train(tiny_data, monkeypatch, plain=True)
    _assert_same(plain, _train(tiny_data, monkeypatch, plain=True), "two plain runs (the GPU run is not deterministic)")
    _assert_same(plain, _train(tiny_data, monkeypatch, plain=False), "fast vs plain")


def _train_host(data, monkeypatch, *, plain: bool):
    with monkeypatch.context() as m:
        if plain:
            m.setattr(host_optim, "patched_rows", lambda *a: patched_rows(*a, backend="torch"))
            m.setattr(host_optim, "_adam_rows", lambda *a: _torch_adam_rows(*a))
        preset = get_preset("tiny", {"train": {"batch_size": 8, "seq_len": 64}})
        model = build_model(build_model_config(preset, data), data, seed=0, device="cuda")
        tc = dataclasses.replace(preset.train, steps=STEPS)
        host = HostTables(model, "cuda", adam="device")
        with host:
            trainer = build_trainer(model, tc, data, "cuda", progress=False, host_tables=host)
            losses = [trainer.train_step(step)[0] for step in range(STEPS)]
            torch.cuda.synchronize()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            state.update({f"host.{lid}": t.clone() for lid, t in host.table_tensors().items()})
            state.update({f"host.{k}": v.clone() for k, v in host.export_state().items()})
        return losses, state


_ADAM_ROWS = host_optim._adam_rows


def _torch_adam_rows(*args):
    _ADAM_ROWS(*args, fused=False)


@pytest.mark.gpu
def test_host_tables_device_adam_kernels_train_like_their_torch_ops(tiny_data, monkeypatch):
    plain = _train_host(tiny_data, monkeypatch, plain=True)
    _assert_same(plain, _train_host(tiny_data, monkeypatch, plain=True), "two plain runs (not deterministic)")
    _assert_same(plain, _train_host(tiny_data, monkeypatch, plain=False), "kernels vs torch ops")
