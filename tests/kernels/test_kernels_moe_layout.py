"""The MoE buffer layout (`condmem.ops.moe_layout`): the counting-sort kernel against the sorting
reference, and both against the plain definition, exactly.

dest: each pair's row, the pairs of one expert filling its group from the group's start in pair
order; src: the pair at each row, the pair count at rows no pair fills. Expert counts from 1 to
more than one program's one-hot is wide (256), pair counts from 0 to many blocks, skewed routings
(one expert takes most pairs, experts left idle)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import compiled_graph_backends, kernel_devices, needs_kernels

from condmem.ops.moe_layout import expert_layout, expert_layout_reference

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _case(pairs: int, n_experts: int, kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        experts = torch.randint(0, n_experts, (pairs,), generator=gen)
    else:  # skewed: most pairs on the last expert, the rest on the lower third (the middle idle)
        experts = torch.randint(0, max(1, n_experts // 3), (pairs,), generator=gen)
        experts[torch.rand(pairs, generator=gen) < 0.7] = n_experts - 1
    counts = torch.bincount(experts, minlength=n_experts)
    padded = ((counts + 7) // 8 * 8).clamp_min(8)
    num_rows = -(-pairs // 8) * 8 + 8 * n_experts
    return experts, torch.cumsum(padded, 0) - padded, num_rows


def _plain(experts: torch.Tensor, starts: torch.Tensor, num_rows: int):
    dest = torch.empty_like(experts)
    filled = starts.clone()
    for p, e in enumerate(experts.tolist()):
        dest[p] = filled[e]
        filled[e] += 1
    src = torch.full((num_rows,), experts.numel(), dtype=torch.int64)
    src[dest] = torch.arange(experts.numel())
    return dest, src


@pytest.mark.parametrize("pairs, n_experts", [(0, 4), (1, 1), (7, 3), (602, 7), (4096, 62), (3000, 256)])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_reference_is_the_plain_layout(pairs, n_experts, kind):
    experts, starts, num_rows = _case(pairs, n_experts, kind)
    want = _plain(experts, starts, num_rows)
    got = expert_layout_reference(experts, starts, num_rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pairs, n_experts", [(0, 4), (1, 1), (127, 62), (129, 62), (602, 7), (4096, 62), (3000, 256)])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_kernel_equals_reference(device, pairs, n_experts, kind):
    experts, starts, num_rows = _case(pairs, n_experts, kind, seed=pairs)
    want = expert_layout_reference(experts, starts, num_rows)
    got = expert_layout(experts.to(device), starts.to(device), num_rows, backend="triton")
    assert [t.dtype for t in got] == [torch.int64, torch.int64]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


@pytest.mark.parametrize("device, backend", compiled_graph_backends())
@pytest.mark.parametrize("choice", ["auto", "triton"])
def test_kernel_inside_a_compiled_graph(device, backend, choice):
    # one opaque op in the traced graph, no break (fullgraph), under every backend
    if device == "cpu" and choice == "auto":
        pytest.skip("auto picks the reference on CPU")
    experts, starts, num_rows = _case(65_536, 62, "uniform")
    torch._dynamo.reset()
    layout = torch.compile(lambda e, s: expert_layout(e, s, num_rows, backend=choice), backend=backend, fullgraph=True)
    want = expert_layout_reference(experts, starts, num_rows)
    got = layout(experts.to(device), starts.to(device))
    torch._dynamo.reset()
    for name, a, b in zip(("dest", "src"), got, want):
        wrong = (a.cpu() != b).nonzero().flatten()
        assert wrong.numel() == 0, f"{name}: {wrong.numel()} of {b.numel()} differ, first at {wrong[:4].tolist()}"
