"""Tensor-parallel Engram on gloo (ranks spawned by the test, CPU): both sharding modes, with
and without sequence parallelism, and the column-parallel wkv, against one process: row ids
and rows torch.equal, layer outputs within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from condmem import Engram, EngramConfig, EngramLayout, NgramHasher
from condmem.distributed import ShardedRows, ShardingError, ShardPlan, column_parallel_engram, traffic_per_token
from ranks import spawn_ranks

CFG = dict(
    layer_ids=[1],
    max_ngram_size=3,
    n_heads=4,
    head_dim=8,
    table_size=[101, 53],
    hidden_size=32,
    hc_mult=1,
    compressed_vocab_size=60,
)


def _setup():
    cfg = EngramConfig(**CFG)
    layout = EngramLayout(cfg)
    torch.manual_seed(0)  # the same module on every rank
    engram = Engram(cfg, layout.layer(1).num_embeddings, layer_id=1)
    with torch.no_grad():
        engram.q_weight.normal_()
        engram.k_weight.normal_()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60, (2, 13), generator=gen)
    hidden = torch.randn(2, 13, 32, generator=gen)
    row_ids = NgramHasher(layout)(ids)[:, :, 0]
    return cfg, layout, engram, row_ids, hidden


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg, layout, engram, row_ids, hidden = _setup()
        with torch.no_grad():
            want_rows = engram.table.weight[row_ids]
            want_out = engram(hidden, row_ids)
            plan = ShardPlan.for_layer(layout.layer(1), world)
            r0, r1 = plan.rows(rank)
            shard = engram.table.weight[r0:r1].clone()  # this rank holds its slice only
            for mode in ("head", "row"):
                for sp in (False, True):
                    sharded = ShardedRows(
                        plan, lambda local: shard[local], cfg.head_dim, mode=mode, sequence_parallel=sp
                    )
                    rows = sharded(row_ids)
                    t0, t1 = sharded.token_chunk(row_ids.shape[1]) if sp else (0, row_ids.shape[1])
                    assert torch.equal(rows, want_rows[:, t0:t1]), (mode, sp, rank)
                    out = engram(hidden[:, t0:t1], row_ids[:, t0:t1], rows=rows)
                    torch.testing.assert_close(out, want_out[:, t0:t1], rtol=1e-5, atol=1e-6)
            local = ShardedRows(plan, lambda local: shard[local], cfg.head_dim)._local(row_ids)
            out = column_parallel_engram(engram, hidden, local, plan)
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_engram_equals_one_process(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path / "init")


def test_shard_plan_owns_whole_columns_and_balances_rows():
    cfg = EngramConfig(**dict(CFG, n_heads=8, table_size=[1009, 211]))
    layer = EngramLayout(cfg).layer(1)
    for world in (1, 2, 3, 4, 16):
        plan = ShardPlan.for_layer(layer, world)
        assert plan.col_bounds[0] == 0 and plan.col_bounds[-1] == 16 and len(plan.col_bounds) == world + 1
        assert all(a < b for a, b in zip(plan.col_bounds[:-1], plan.col_bounds[1:])), "every rank owns a column"
        for r in range(world):
            c0, c1 = plan.columns(r)
            assert plan.rows(r) == (layer.offsets[c0], layer.offsets[c1 - 1] + layer.primes[c1 - 1])
    for world in (2, 4, 8):
        bounds = ShardPlan.for_layer(layer, world).row_bounds
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        # Whole columns only: the shares differ by at most about one column's rows.
        assert max(sizes) - min(sizes) <= max(layer.primes) + 1, (world, sizes)
    with pytest.raises(ShardingError, match="at most 16 ranks"):
        ShardPlan.for_layer(layer, 17)


def test_traffic_formulas():
    t = traffic_per_token(24, 256, 2, hidden=4096, hc_mult=4)
    assert t["head"] == 24 * 256 * 2 / 2 and t["row"] == 2 * t["head"] and t["head_sp"] == t["head"] / 2
    assert t["row_sp"] == t["head"] and t["column_wkv"] == 2 * 0.5 * 5 * 4096 * 4
    assert traffic_per_token(24, 256, 1)["row"] == 0


def _memory_worker(rank: int, world: int, init_file: str, table_path: str) -> None:
    from condmem.serving import EngramMemory

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = EngramConfig(**dict(CFG, layer_ids=[1, 3]))
        layout = EngramLayout(cfg)
        hasher = NgramHasher(layout)
        torch.manual_seed(0)
        weights = {lid: torch.randn(layout.layer(lid).num_embeddings, cfg.head_dim).bfloat16() for lid in cfg.layer_ids}
        ids = torch.randint(0, 60, (2, 11), generator=torch.Generator().manual_seed(3))
        want = hasher(ids)
        for mode in ("head", "row"):
            for sp in (False, True):
                for source in ("weights", "file"):
                    kw = dict(process_group=dist.group.WORLD, tp_mode=mode, sequence_parallel=sp)
                    if source == "weights":
                        memory = EngramMemory.from_weights(hasher, weights, "host", "cpu", host_alloc="pageable", **kw)
                    else:
                        memory = EngramMemory.from_table_file(
                            table_path, hasher, "host", "cpu", host_alloc="pageable", progress=False, **kw
                        )
                    for lid in cfg.layer_ids:  # each rank holds its shard only
                        plan = memory.sharded[lid].plan
                        r0, r1 = plan.rows(rank)
                        assert memory.stores[lid].num_rows == r1 - r0
                    prepared = memory.prepare(ids)
                    t = slice(*memory.sharded[1].token_chunk(11)) if sp else slice(None)
                    for i, lid in enumerate(cfg.layer_ids):
                        assert torch.equal(prepared.row_ids(lid), want[:, t, i])
                        assert torch.equal(prepared.rows(lid), weights[lid][want[:, t, i]]), (mode, sp, source, lid)
                    memory.close()
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


def test_engram_memory_serves_a_shard_per_rank(tmp_path):
    """EngramMemory(process_group=...): each rank loads only its rows (from weights or a table
    file) and `Prepared.rows` completes them with the collective; rows equal the full table's."""
    from condmem.tables.table_file import LayerRows, write_table_file

    cfg = EngramConfig(**dict(CFG, layer_ids=[1, 3]))
    layout = EngramLayout(cfg)
    torch.manual_seed(0)
    weights = {lid: torch.randn(layout.layer(lid).num_embeddings, cfg.head_dim).bfloat16() for lid in cfg.layer_ids}
    path = tmp_path / "tables.safetensors"
    write_table_file(path, layout, "bf16", {lid: [LayerRows("bf16", w)] for lid, w in weights.items()})
    spawn_ranks(_memory_worker, 2, tmp_path / "init", str(path))
