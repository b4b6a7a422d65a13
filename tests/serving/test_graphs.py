"""CUDA-graph decode: replays match eager steps; rows from prefetched host tables are exact (GPU only)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from condmem.serving import EngramMemory, ServingCache, decode_step, prefill
from condmem.serving.decode_fetch import SideBranchRows, ZeroCopyRows
from condmem.serving.graphs import GraphedDecoder
from condmem.serving.staged_fetch import StagedRows
from helpers import assert_close
from model_fixtures import tiny_engram_lm

pytestmark = pytest.mark.gpu


def _run(model, memory=None, graphed=True, steps=12, host_prompts=False, **graph_kw):
    """Two sequences, a third joins at step 4 and the first leaves at step 8; per-step logits.

    `host_prompts`: prompts stay on the CPU (EngramMemory hashes them on its own stream)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 50, (n,), generator=gen) for n in (6, 3, 8)]
    if not host_prompts:
        prompts = [p.cuda() for p in prompts]
    cache = ServingCache(model, n_slots=3, max_len=16 + steps)
    graph = GraphedDecoder(model, cache, memory=memory, **graph_kw) if graphed else None
    live, last, out = [], {}, []
    free = [0, 1, 2]

    def join(i):
        slot = memory.allocate() if memory is not None else free.pop(0)
        prep = memory.prepare(prompts[i][None], slots=torch.tensor([slot])) if memory is not None else None
        last[slot] = prefill(model, cache, slot, prompts[i].cuda(), prepared=prep)[-1]
        live.append(slot)

    join(0), join(1)
    for step in range(steps):
        if step == 4:
            join(2)
        if step == 8:
            slot = live.pop(0)
            cache.release(slot)
            memory.free(slot) if memory is not None else free.append(slot)
        nxt = torch.stack([last[s].argmax() for s in live])
        if graphed:
            logits = graph.step(live, nxt)
        else:
            prep = memory.prepare_decode(torch.tensor(live, device="cuda"), nxt) if memory is not None else None
            logits = decode_step(model, cache, torch.tensor(live, device="cuda"), nxt, prepared=prep)
        logits = logits.clone()
        for i, s in enumerate(live):
            last[s] = logits[i]
        out.append(logits)
    return out


@contextlib.contextmanager
def _slow_side_branch(delay_cycles: int, skip_wait: bool = False):
    """While a `GraphedDecoder` is built (its step captured): the side branch sleeps `delay_cycles`
    before it fetches, so that rows read early are wrong; with `skip_wait` the Engram layers read
    the row buffers without waiting for it (the step then joins the side branch at its end, as a
    captured graph must): the negative control of the wait."""
    with pytest.MonkeyPatch.context() as mp:
        for cls in (ZeroCopyRows, StagedRows):

            def slowed(self, ids_by_layer, fetch=cls._fetch):
                torch.cuda._sleep(delay_cycles)
                fetch(self, ids_by_layer)

            mp.setattr(cls, "_fetch", slowed)
        if skip_wait:
            body = GraphedDecoder._body

            def joined_at_end(self):
                logits = body(self)
                torch.cuda.current_stream().wait_event(self.fetch.events[self.fetch.layer_ids[-1]])
                return logits

            mp.setattr(SideBranchRows, "rows", lambda self, layer_id: self.rows_buf[layer_id])
            mp.setattr(GraphedDecoder, "_body", joined_at_end)
        yield


def test_graph_replay_matches_eager_steps():
    model, _ = tiny_engram_lm("cuda")
    with torch.no_grad():
        eager, graphed = _run(model, graphed=False), _run(model, graphed=True)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert_close(f"step {i}", a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tier", ["host", "hbm"])
@pytest.mark.parametrize("wait", ["at_layer", "before_step"])
@pytest.mark.parametrize("host_prompts", [False, True])
def test_graph_fetching_rows_inside_is_exact(tier, wait, host_prompts):
    """Rows gathered inside the graph (side branch) give logits equal to the model's own tables."""
    model, tables = tiny_engram_lm("cuda")
    memory = EngramMemory.from_weights(model.hasher, tables, tier, "cuda", max_sequences=3)
    with torch.no_grad():
        plain = _run(model, graphed=True, steps=64)
        served = _run(
            model, memory=memory, graphed=True, wait=wait, host_prompts=host_prompts, steps=64, fetch="zero_copy"
        )
    assert len(served) == 64
    for i, (a, b) in enumerate(zip(plain, served)):
        assert torch.equal(a, b), f"step {i}"
    memory.close()


def test_graph_with_a_capped_fetch_grid_is_exact():
    """`fetch_programs=1`: the in-graph fetch loops in one program and still gives exact logits."""
    model, tables = tiny_engram_lm("cuda")
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
    with torch.no_grad():
        plain = _run(model, graphed=True, steps=16)
        served = _run(model, memory=memory, graphed=True, steps=16, fetch_programs=1, fetch="zero_copy")
    assert all(torch.equal(a, b) for a, b in zip(plain, served))
    memory.close()


def test_graph_negative_control_rows_read_without_waiting_are_wrong():
    """A slowed fetch still gives exact logits with the wait, and wrong ones when the Engram layer skips it."""
    model, tables = tiny_engram_lm("cuda")
    delay = 50_000_000  # ~25 ms of GPU sleep before the side branch gathers
    with torch.no_grad():
        plain = _run(model, graphed=True, steps=6)
        memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
        with _slow_side_branch(delay):
            waited = _run(model, memory=memory, graphed=True, steps=6, fetch="zero_copy")
        memory.close()
        memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
        with _slow_side_branch(delay, skip_wait=True):
            raced = _run(model, memory=memory, graphed=True, steps=6, fetch="zero_copy")
        memory.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, waited))
    assert not all(torch.equal(a, b) for a, b in zip(plain, raced)), "rows read without the wait were still right"


def test_graph_refuses_a_meta_model_without_memory():
    model, _ = tiny_engram_lm("cuda")
    for block in model.blocks:
        if block.engram is not None:
            block.engram.table.weight = torch.nn.Parameter(torch.empty_like(block.engram.table.weight, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        GraphedDecoder(model, ServingCache(model, n_slots=2, max_len=16))


@pytest.mark.parametrize("wait", ["at_layer", "before_step"])
@pytest.mark.parametrize("threads", [1, 4])
def test_graph_staged_fetch_is_exact(wait, threads):
    """Rows gathered by host threads and sent by DMA (fetch="staged") give logits equal to the
    model's own tables, step after step, with slots joining and leaving."""
    model, tables = tiny_engram_lm("cuda")
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
    with torch.no_grad():
        plain = _run(model, graphed=True, steps=64)
        graph_kw = dict(fetch="staged", fetch_threads=threads, wait=wait)
        served = _run(model, memory=memory, graphed=True, steps=64, **graph_kw)
    for i, (a, b) in enumerate(zip(plain, served)):
        assert torch.equal(a, b), f"step {i}"
    memory.close()


def test_graph_staged_fetch_negative_control_rows_read_without_waiting_are_wrong():
    """A slowed staged fetch is exact with the wait, and wrong when the Engram layer skips it."""
    model, tables = tiny_engram_lm("cuda")
    delay = 50_000_000
    with torch.no_grad():
        plain = _run(model, graphed=True, steps=6)
        memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
        with _slow_side_branch(delay):
            waited = _run(model, memory=memory, graphed=True, steps=6, fetch="staged")
        memory.close()
        memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=3)
        with _slow_side_branch(delay, skip_wait=True):
            raced = _run(model, memory=memory, graphed=True, steps=6, fetch="staged")
        memory.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, waited))
    assert not all(torch.equal(a, b) for a, b in zip(plain, raced)), "rows read without the wait were still right"


def test_graph_staged_fetch_stats_close_and_refusals():
    model, tables = tiny_engram_lm("cuda")
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=2)
    cache = ServingCache(model, n_slots=2, max_len=32)
    with pytest.raises(ValueError, match="fetch must be one of"):
        GraphedDecoder(model, cache, memory=memory, fetch="dma")
    with torch.no_grad():
        slot = memory.allocate()
        prefill(
            model,
            cache,
            slot,
            torch.arange(5, device="cuda"),
            prepared=memory.prepare(torch.arange(5)[None], slots=torch.tensor([slot])),
        )
        with GraphedDecoder(model, cache, memory=memory, fetch="staged", fetch_threads=2) as graph:
            for _ in range(5):
                graph.step([slot], torch.tensor([3], device="cuda"))
            torch.cuda.synchronize()
            stats = graph.fetch_stats()
        assert stats["steps"] >= 5 and stats["bad_ids"] == 0 and stats["threads"] == 2
        with pytest.raises(RuntimeError, match="stopped"):
            graph.step([slot], torch.tensor([3], device="cuda"))
    hbm = EngramMemory.from_weights(model.hasher, tables, "hbm", "cuda", max_sequences=2)
    with pytest.raises(ValueError, match="cannot be staged by the CPU"):
        GraphedDecoder(model, ServingCache(model, n_slots=2, max_len=32), memory=hbm, fetch="staged")
    # The default picks the staged fetch for host tables, the in-place gather for HBM tables.
    with GraphedDecoder(model, ServingCache(model, n_slots=2, max_len=32), memory=memory) as graph:
        assert isinstance(graph.fetch, StagedRows) and graph.fetch_stats() is not None
    with GraphedDecoder(model, ServingCache(model, n_slots=2, max_len=32), memory=hbm) as graph:
        assert not isinstance(graph.fetch, StagedRows) and graph.fetch_stats() is None
    memory.close(), hbm.close()


@pytest.mark.parametrize("mode", ["head", "row"])
def test_graph_staged_fetch_of_a_tensor_parallel_memory_is_exact(tmp_path, mode):
    """A memory built with process_group= (here one NCCL rank): the staged fetch serves the
    rank's columns from its shard and the Engram layer completes them."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        model, tables = tiny_engram_lm("cuda")
        memory = EngramMemory.from_weights(
            model.hasher, tables, "host", "cuda", max_sequences=3, process_group=dist.group.WORLD, tp_mode=mode
        )
        assert memory.sharded
        with torch.no_grad():
            plain = _run(model, graphed=True, steps=16)
            served = _run(model, memory=memory, graphed=True, steps=16, fetch="staged")
        assert all(torch.equal(a, b) for a, b in zip(plain, served))
        memory.close()
    finally:
        dist.destroy_process_group()
