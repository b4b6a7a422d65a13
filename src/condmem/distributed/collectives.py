"""The two collectives that not every backend offers, with one fallback each.

NCCL has all of `torch.distributed`'s collectives. gloo's list form of all-to-all
(``dist.all_to_all``) exists only in newer PyTorch releases (2.11 refuses it, with CPU
and CUDA tensors alike: "Backend gloo does not support alltoall"), and its
reduce-scatter is as recent. Users meet both: gloo on CPU, gloo with CUDA tensors in tests
and debugging. So condmem never calls those two directly:

* `all_to_all_equal` sends equal-size messages through ``all_to_all_single`` (one flat
  tensor, gloo's oldest all-to-all, on CPU and CUDA); a backend without it falls back to
  an all-gather of every rank's whole send buffer, of which each rank keeps its share
  (``world`` times the bytes: correct, never fast).
* `reduce_scatter_equal` uses ``reduce_scatter`` where the backend has it, else an
  all-reduce of the whole buffer and this rank's chunk of it (the same operands, summed
  in the backend's order; twice the bytes).

A backend's refusal is seen once (the call raises before any byte moves, on every rank
alike) and remembered per backend and device type, so the fallback costs nothing later.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

Method = Literal["direct", "fallback"]

_refused: set[tuple[str, str, str]] = set()  # (collective, backend, device type) that raised "not supported"


def _key(name: str, group, tensor: torch.Tensor) -> tuple[str, str, str]:
    return name, str(dist.get_backend(group)), tensor.device.type


def _unsupported(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return "not support" in text or "unsupported" in text or "not implemented" in text


def all_to_all_equal(inputs: list[torch.Tensor], group=None, *, method: Method | None = None) -> list[torch.Tensor]:
    """What every rank p sent this rank as its ``inputs[rank]``, in rank order (views of one
    received buffer); every message has one shape and dtype. `method` forces a path (tests); by
    default the direct one unless the backend refused it before."""
    send = torch.stack(inputs)
    key = _key("all_to_all", group, send)
    if method is None:
        method = "fallback" if key in _refused else "direct"
    if method == "direct":
        recv = torch.empty_like(send)
        try:
            dist.all_to_all_single(recv, send, group=group)
        except RuntimeError as exc:
            if not _unsupported(exc):
                raise
            _refused.add(key)
            recv = _all_to_all_by_all_gather(send, group)
    else:
        recv = _all_to_all_by_all_gather(send, group)
    return list(recv.unbind(0))


def _all_to_all_by_all_gather(send: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(gathered, send, group=group)
    return torch.stack([g[rank] for g in gathered])


def reduce_scatter_equal(
    output: torch.Tensor, inputs: list[torch.Tensor], group=None, *, method: Method | None = None
) -> None:
    """``output`` <- the sum over ranks of their ``inputs[rank]``; every input has ``output``'s
    shape. `method` as in `all_to_all_equal`."""
    key = _key("reduce_scatter", group, output)
    if method is None:
        method = "fallback" if key in _refused else "direct"
    if method == "direct":
        try:
            dist.reduce_scatter(output, [t.contiguous() for t in inputs], group=group)
            return
        except RuntimeError as exc:
            if not _unsupported(exc):
                raise
            _refused.add(key)
    whole = torch.stack([t.contiguous() for t in inputs])
    dist.all_reduce(whole, group=group)
    output.copy_(whole[dist.get_rank(group)])
