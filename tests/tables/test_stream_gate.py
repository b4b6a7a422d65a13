"""The stream gate (GPU): work queued behind `wait(n)` runs only once another stream has
reached `open(n)`, whichever was queued first; values wrap around at 2**32."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gate():
    from condmem.tables.stream_gate import StreamGate

    gate = StreamGate.create("cuda")
    if gate is None:
        pytest.skip("stream memory operations unavailable on this driver")
    return gate


def test_work_behind_a_closed_gate_waits_until_another_stream_opens_it():
    gate = _gate()
    waiter, opener = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(4, device="cuda")
    x.add_(1)                              # loads the kernel now: see the module's note on lazy loading
    x.zero_()
    torch.cuda.synchronize()
    n = gate.next()
    gate.wait(waiter, n)                   # the wait is queued before the open
    with torch.cuda.stream(waiter):
        x.add_(1)
        done = torch.cuda.Event()
        done.record(waiter)
    time.sleep(0.05)
    assert not done.query()                # still closed
    with torch.cuda.stream(opener):
        torch.cuda._sleep(10_000_000)      # the open comes after this stream's earlier work
    gate.open(opener, n)
    done.synchronize()
    assert torch.equal(x.cpu(), torch.ones(4))


def test_an_earlier_open_lets_later_waits_through_and_values_wrap():
    gate = _gate()
    s = torch.cuda.Stream()
    gate._seq = 0xFFFFFFFE
    values = [gate.next() for _ in range(3)]
    assert values == [0xFFFFFFFF, 0, 1]
    for v in values:
        gate.open(torch.cuda.current_stream(), v)
        gate.wait(s, v)                     # cyclic >=: passes once v (or later) is written
    s.synchronize()
    assert int(gate.word.item()) == 1
