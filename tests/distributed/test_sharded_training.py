"""Sharded table training on gloo (2 and 4 spawned ranks, CPU): each rank trains on its part of
the batch with its shard of the table; after 10 SparseAdam steps the shards equal one process
training the whole table on the whole batch (fp32 tolerance: only the order of the gradient
sums differs), and the forward rows are torch.equal."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.distributed import ShardedTable, ShardPlan
from condmem.train.optim import SparseAdam
from ranks import spawn_ranks

CFG = dict(layer_ids=[1], max_ngram_size=3, n_heads=4, head_dim=8, table_size=[53, 31], compressed_vocab_size=20)
STEPS, BATCH, T = 10, 4, 9


def _problem():
    cfg = EngramConfig(**CFG)
    layout = EngramLayout(cfg)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(layout.layer(1).num_embeddings, cfg.head_dim, generator=gen)
    target = torch.randn(cfg.n_cols, cfg.head_dim, generator=gen)
    # few ids: rows repeat within and across ranks' batches
    batches = [NgramHasher(layout)(torch.randint(0, 20, (BATCH, T), generator=gen))[:, :, 0] for _ in range(STEPS)]
    return layout, table, target, batches


def _loss(rows, target):
    return ((rows - target).pow(2).sum(-1)).mean()


def _single_process():
    layout, table, target, batches = _problem()
    weight = torch.nn.Parameter(table.clone())
    opt = SparseAdam([weight], lr=0.05)
    for ids in batches:
        rows = torch.nn.functional.embedding(ids, weight, sparse=True)
        _loss(rows, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return weight.detach()


def _rank_shard(rank, world, layout, table):
    """This rank's shard of the initial table and its optimizer."""
    plan = ShardPlan.for_layer(layout.layer(1), world)
    r0, r1 = plan.rows(rank)
    sharded = ShardedTable(plan, table[r0:r1])
    return sharded, SparseAdam([sharded.weight], lr=0.05)


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        layout, table, target, batches = _problem()
        sharded, opt = _rank_shard(rank, world, layout, table)
        per = BATCH // world
        for step, ids in enumerate(batches):
            mine = ids[rank * per : (rank + 1) * per]
            rows = sharded(mine)
            if step == 0:
                assert torch.equal(rows, table[mine]), "forward rows"
            _loss(rows, target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        full = sharded.full_table()
        if rank == 0:
            want = _single_process()
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6)
            assert not torch.equal(full, table), "training moved rows"
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_training_equals_one_process(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path / "init")


def _train(sharded, opt, batches, target, rank, world):
    per = BATCH // world
    for ids in batches:
        _loss(sharded(ids[rank * per : (rank + 1) * per]), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _save_worker(rank, world, init_file, run_dir):
    from condmem.distributed.checkpoint import save_sharded

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        layout, table, target, batches = _problem()
        sharded, opt = _rank_shard(rank, world, layout, table)
        _train(sharded, opt, batches[:5], target, rank, world)
        save_sharded(run_dir, sharded, opt, 5, layout.fingerprint)
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


def _resume_worker(rank, world, init_file, run_dir):
    from condmem.distributed.checkpoint import ShardedCheckpointError, load_sharded

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        layout, table, target, batches = _problem()
        plan = ShardPlan.for_layer(layout.layer(1), world)
        with pytest.raises(ShardedCheckpointError, match="another address"):
            load_sharded(run_dir, plan, rank, "another-layout")
        weight, state, step = load_sharded(run_dir, plan, rank, layout.fingerprint)
        assert step == 5
        sharded = ShardedTable(plan, weight)
        opt = SparseAdam([sharded.weight], lr=0.05)
        opt.state[sharded.weight] = state
        _train(sharded, opt, batches[5:], target, rank, world)
        full = sharded.full_table()
        if rank == 0:
            torch.testing.assert_close(full, _single_process(), rtol=1e-5, atol=1e-6)
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("saved, resumed", [(4, 2), (2, 2)], ids=["reshard-4-to-2", "same-2"])
def test_resume_at_any_world_size_equals_an_uninterrupted_run(saved, resumed, tmp_path):
    """Saved after 5 steps on `saved` ranks, resumed for 5 more on `resumed` ranks: equal to 10
    steps in one process (rows and per-row Adam state move between shards)."""
    run = str(tmp_path / "run")
    spawn_ranks(_save_worker, saved, tmp_path / "init1", run)
    assert (tmp_path / "run" / "LATEST").read_text().strip() == "step-0000005"
    spawn_ranks(_resume_worker, resumed, tmp_path / "init2", run)


def test_a_damaged_or_missing_shard_is_refused(tmp_path):
    from condmem.distributed.checkpoint import ShardedCheckpointError, load_sharded

    run = tmp_path / "run"
    spawn_ranks(_save_worker, 2, tmp_path / "init", str(run))
    layout, *_ = _problem()
    plan = ShardPlan.for_layer(layout.layer(1), 2)
    shard = run / "step-0000005" / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardedCheckpointError, match="sha256"):
        load_sharded(run, plan, 1, layout.fingerprint)
    shard.unlink()
    with pytest.raises(ShardedCheckpointError, match="lacks shard-00001"):
        load_sharded(run, plan, 1, layout.fingerprint)
