"""Names renamed in the serving and tensor-parallel API keep working for one release: the old
name gives the same result with a `DeprecationWarning` naming the new one."""

from __future__ import annotations

import pytest
import torch

from condmem.serving import EngramMemory, join_prepared
from tests.model_fixtures import tiny_engram_lm


@pytest.fixture
def memory_and_ids():
    model, tables = tiny_engram_lm("cpu", short_conv=False)
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cpu", host_alloc="pageable", max_sequences=2)
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    yield memory, ids
    memory.close()


def test_prepared_rows_is_row_vectors_with_a_warning(memory_and_ids):
    memory, ids = memory_and_ids
    lid = memory.layer_ids[0]
    prepared = memory.prepare(ids)
    want = prepared.row_vectors(lid)
    with pytest.warns(DeprecationWarning, match=r"Prepared\.rows is deprecated.*row_vectors"):
        got = prepared.rows(lid)
    assert torch.equal(got, want)


def test_joined_prepared_rows_is_row_vectors_with_a_warning(memory_and_ids):
    memory, ids = memory_and_ids
    lid = memory.layer_ids[0]
    cu = torch.tensor([0, 3])
    joined = join_prepared([memory.prepare_ragged(ids[0, :3], cu), memory.prepare_ragged(ids[0, :3], cu)])
    want = joined.row_vectors(lid)
    with pytest.warns(DeprecationWarning, match=r"JoinedPrepared\.rows is deprecated.*row_vectors"):
        got = joined.rows(lid)
    assert torch.equal(got, want) and got.shape[1] == 6


def test_column_parallel_engram_takes_local_rows_with_a_warning(tmp_path):
    import torch.distributed as dist

    from condmem.distributed import ShardPlan, column_parallel_engram

    model, tables = tiny_engram_lm("cpu", short_conv=False)
    engram = model.engram_layers[0]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        plan = ShardPlan.for_layer(model.layout.layer(engram.layer_id), 1)
        hidden = torch.randn(1, 4, model.cfg.dim, generator=torch.Generator().manual_seed(1))
        row_ids = model.row_ids(torch.randint(0, 50, (1, 4)))[:, :, 0]
        vectors = engram.table(row_ids)
        with torch.no_grad():
            want = column_parallel_engram(engram, hidden, vectors, plan)
            with pytest.warns(DeprecationWarning, match=r"local_rows= is deprecated.*local_row_vectors="):
                got = column_parallel_engram(engram, hidden, local_rows=vectors, plan=plan)
        assert torch.equal(got, want)
    finally:
        dist.destroy_process_group()


def test_shard_plan_rows_is_row_range_with_a_warning():
    from condmem.distributed import ShardPlan

    model, _ = tiny_engram_lm("cpu", short_conv=False)
    plan = ShardPlan.for_layer(model.layout.layer(1), 2)
    with pytest.warns(DeprecationWarning, match=r"ShardPlan\.rows is deprecated.*row_range"):
        got = plan.rows(1)
    assert got == plan.row_range(1) == (plan.row_bounds[1], plan.row_bounds[2])
