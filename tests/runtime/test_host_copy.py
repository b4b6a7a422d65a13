"""`condmem.utils.host_copy.to_device`: the values arrive, and on a GPU the host is not held
until the stream's queued work is done (a pageable copy is; the negative control)."""

from __future__ import annotations

import time

import pytest
import torch

from condmem.utils.host_copy import to_device


def test_values_arrive_on_any_device():
    t = torch.arange(10, dtype=torch.int64)
    assert torch.equal(to_device(t, "cpu"), t)
    if torch.cuda.is_available():
        got = to_device(t, "cuda")
        assert got.device.type == "cuda" and torch.equal(got.cpu(), t)
        assert torch.equal(to_device(got, "cuda"), got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pageable_tensor_is_queued_without_holding_the_host():
    """Behind ~200 ms of queued GPU work, `to_device` returns at once and the copy lands after
    the work; a plain non-blocking copy of the same pageable tensor holds the host until then."""
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2)     # ~200 ms at the SM clock
    t = torch.arange(1 << 16, dtype=torch.int64)

    def host_seconds(copy):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        out = copy()
        took = time.perf_counter() - start
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), t)
        return took

    queued = host_seconds(lambda: to_device(t, "cuda"))
    held = host_seconds(lambda: t.to("cuda", non_blocking=True))
    assert queued < 0.05, f"to_device held the host {queued * 1e3:.0f} ms"
    assert held > 0.1, f"the control did not wait ({held * 1e3:.0f} ms): the premise of to_device is gone"
