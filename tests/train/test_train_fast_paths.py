"""Training's fast CUDA paths against the plain ones they replace, over 50 steps of the tiny
preset on the GPU: every parameter and every loss bit-equal.

* the tables' lookup (`condmem.ops.row_grad.table_lookup`: the sparse gradient reduced per
  row by one kernel) against ``F.embedding(..., sparse=True)`` coalesced after the backward;
* the tables' fused Adam step (`SparseAdam`'s Triton kernel, no host sync) against its torch path.

A second plain run first shows the GPU run is itself deterministic (otherwise a difference
would say nothing about the fast path).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import condmem.module as engram_module
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
