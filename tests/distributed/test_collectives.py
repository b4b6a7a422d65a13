"""The all-to-all and reduce-scatter every backend can run (`condmem.distributed.collectives`):
the direct path and the fallback give the same bytes as a plain reference, on CPU tensors and
(on a GPU machine) CUDA tensors over gloo; a backend that refuses the direct call falls back
and remembers it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from condmem.distributed import collectives
from ranks import spawn_ranks


def _message(src: int, dst: int, device: str) -> torch.Tensor:
    # Distinct per (sender, receiver) and not a sum of others: any mix-up shows.
    return torch.arange(6, dtype=torch.float64, device=device).view(2, 3) + 1000 * src + 17 * dst


def _worker(rank: int, world: int, init_file: str, device: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for method in ("direct", "fallback"):
            sent = [_message(rank, q, device) for q in range(world)]
            got = collectives.all_to_all_equal(sent, method=method)
            for p in range(world):
                assert torch.equal(got[p], _message(p, rank, device)), (method, rank, p)

            out = torch.full((2, 3), float("nan"), dtype=torch.float64, device=device)
            collectives.reduce_scatter_equal(out, [_message(rank, q, device) for q in range(world)], method=method)
            want = sum(_message(p, rank, device) for p in range(world))
            assert torch.equal(out, want), (method, rank)

        # A backend that refuses the direct call: the fallback answers, and the refusal is remembered.
        real = dist.all_to_all_single
        calls = []

        def refuse(*args, **kwargs):
            calls.append(1)
            raise RuntimeError("Backend gloo does not support alltoall_base")

        dist.all_to_all_single = refuse
        try:
            for _ in range(2):
                sent = [_message(rank, q, device) for q in range(world)]
                got = collectives.all_to_all_equal(sent)
                assert all(torch.equal(got[p], _message(p, rank, device)) for p in range(world))
        finally:
            dist.all_to_all_single = real
        assert len(calls) == 1, "the refusal is remembered: the second call goes straight to the fallback"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_and_reduce_scatter_on_gloo_cpu(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path / "init", "cpu")


@pytest.mark.gpu
def test_all_to_all_and_reduce_scatter_on_gloo_with_cuda_tensors(tmp_path):
    spawn_ranks(_worker, 2, tmp_path / "init", "cuda")


def test_a_real_error_is_not_taken_for_a_missing_collective():
    assert collectives._unsupported(RuntimeError("Backend gloo does not support alltoall"))
    assert not collectives._unsupported(RuntimeError("Connection closed by peer"))
