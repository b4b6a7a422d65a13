"""Steps queued without a host wait (`Trainer.queue_step`, losses read in batches by
`read_losses`) train exactly as steps read one at a time (`train_step`); a non-finite loss in a
batch is named by its step; batches moved with ``non_blocking`` arrive equal (pinned on CUDA)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.train.data import Batch
from condmem.train.presets import get_preset

STEPS = 6


def _trainer(data, device):
    preset = get_preset("tiny", {"train": {"batch_size": 4, "seq_len": 32}})
    model = build_model(build_model_config(preset, data), data, seed=0, device=device)
    tc = dataclasses.replace(preset.train, steps=STEPS)
    return model, build_trainer(model, tc, data, device, progress=False)


def _queued_equals_read(data, device):
    model_a, read = _trainer(data, device)
    one_by_one = [read.train_step(step)[0] for step in range(STEPS)]
    model_b, queue = _trainer(data, device)
    queued = [(step, queue.queue_step(step)[0]) for step in range(STEPS)]
    assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 for _, loss in queued)
    assert queue.read_losses(queued) == one_by_one  # the same floats, bit for bit
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), name


def test_queued_steps_train_like_steps_read_one_at_a_time(tiny_data):
    _queued_equals_read(tiny_data, "cpu")


@pytest.mark.gpu
def test_queued_steps_train_like_steps_read_one_at_a_time_on_cuda(tiny_data):
    _queued_equals_read(tiny_data, "cuda")


def test_read_losses_names_the_first_step_that_is_not_finite(tiny_data):
    _, trainer = _trainer(tiny_data, "cpu")
    assert trainer.read_losses([]) == []
    finite = [(0, torch.tensor(2.5)), (1, torch.tensor(2.25, dtype=torch.bfloat16))]
    assert trainer.read_losses(finite) == [2.5, 2.25]  # the negative control: nothing raised
    bad = [*finite, (2, torch.tensor(math.nan)), (3, torch.tensor(math.inf))]
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3$"):
        trainer.read_losses(bad)


def _batch() -> Batch:
    ids = torch.arange(64, dtype=torch.int64).view(2, 32)
    return Batch(ids, ids + 1, ids % 7 == 0)


def test_a_batch_moved_without_blocking_on_the_cpu_is_not_pinned():
    moved = _batch().to("cpu", non_blocking=True)  # no CUDA needed: nothing is pinned
    assert torch.equal(moved.inputs, _batch().inputs) and moved.scored is None


@pytest.mark.gpu
def test_a_batch_moved_without_blocking_to_cuda_arrives_equal():
    host = _batch()
    moved = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    for a, b in zip((host.inputs, host.targets, host.doc_starts), (moved.inputs, moved.targets, moved.doc_starts)):
        assert b.is_cuda and torch.equal(a, b.cpu())
