"""The staged send (CPU gather into a ring of pinned chunks, each sent to the device): every
row lands exactly where it belongs, the ring is walked in order, a failed runtime call stops
the send and is reported. On the CPU, the native routine runs with host stand-ins for the
CUDA runtime calls (tests/native_stand_ins.c); on a GPU, `StagedSender` is checked against a
plain gather, both paths, with the CUDA runtime torch loaded."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from condmem import native
from condmem.tables.storage import HostStore
from native_stand_ins import stand_ins

needs_native = pytest.mark.skipif(
    not native.available() or stand_ins() is None,
    reason=f"no native build ({native.build().reason}) or no C compiler for the stand-ins",
)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("n", [1, 1000, 70001])
def test_gpu_staged_send_equals_a_plain_gather(path, n, monkeypatch):
    from condmem.tables.staged_transfer import StagedSender

    gen = torch.Generator().manual_seed(n)
    table = torch.randint(0, 256, (100_000, 264), dtype=torch.uint8, generator=gen).pin_memory()
    store = HostStore("fp8_interleaved", 256, table)
    if path == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    sender = StagedSender(264, "cuda", chunk_rows=4096, ring=3)
    assert sender.uses_native(store) == (path == "native" and sender.native)
    if path == "native" and not sender.native:
        pytest.skip(f"native staged send unavailable here: {native.build().reason or 'no CUDA runtime found'}")
    stream = torch.cuda.Stream()
    for round_ in range(3):  # the ring carries over between sends
        ids = torch.randint(0, 100_000, (n,), generator=gen)
        dst = torch.full((n, 264), 0xAB, dtype=torch.uint8, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        sender.send(store, ids, dst, stream, threads=4)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(dst.cpu(), table.index_select(0, ids)), f"round {round_}"


@pytest.mark.gpu
def test_sender_checks_its_destination():
    from condmem.tables.staged_transfer import StagedSender

    sender = StagedSender(264, "cuda", chunk_rows=16, ring=2)
    store = HostStore("fp8_interleaved", 256, torch.zeros((10, 264), dtype=torch.uint8))
    with pytest.raises(ValueError, match="dst must be contiguous"):
        sender.send(
            store,
            torch.tensor([1, 2]),
            torch.empty((3, 264), dtype=torch.uint8, device="cuda"),
            torch.cuda.current_stream(),
            threads=1,
        )


def test_the_cuda_runtime_is_named_by_torchs_cuda_version():
    assert native.cudart_soname("12.8") == "libcudart.so.12"
    assert native.cudart_soname("13.0") == "libcudart.so.13"
    assert native.cudart_soname(None) is None  # a CPU-only torch
    if not torch.cuda.is_available():
        assert native.cuda_runtime() is None


@pytest.mark.gpu
def test_the_cuda_runtime_found_is_the_one_torch_uses():
    """Its cudaEventQuery answers for torch's events: the same runtime and context."""
    runtime = native.cuda_runtime()
    assert runtime is not None, f"CUDA runtime {native.cudart_soname(torch.version.cuda)} not found"
    query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(runtime.event_query)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    assert query(event.cuda_event) == 0
    assert runtime.error_string(600) == "device not ready"


@needs_native
def test_native_send_plumbing_on_the_cpu(monkeypatch):
    """`StagedSender._send_native` end to end with the host stand-ins in place of the CUDA
    runtime (the ring, the timeline, the error message), so CI covers its argument list."""
    from types import SimpleNamespace

    from condmem.tables.staged_transfer import StagedSender

    _, fn = stand_ins()
    runtime = native.CudaRuntime(fn["memcpy"], fn["record"], fn["query"], lambda code: f"stand-in error {code}")
    monkeypatch.setattr(native, "cuda_runtime", lambda: runtime)
    sender = object.__new__(StagedSender)  # no CUDA here: the fields __init__ would set
    sender.row_bytes, sender.chunk_rows, sender.record_timeline, sender.last_timeline = 264, 5, True, None
    sender.buffers = [torch.zeros((5, 264), dtype=torch.uint8) for _ in range(3)]
    events = [torch.zeros(7, dtype=torch.int64) for _ in range(3)]
    sender._ring_ptrs = (ctypes.c_void_p * 3)(*(b.data_ptr() for b in sender.buffers))
    sender._event_ptrs = (ctypes.c_void_p * 3)(*(e.data_ptr() for e in events))
    gen = torch.Generator().manual_seed(5)
    table = torch.randint(0, 256, (300, 264), dtype=torch.uint8, generator=gen)
    store = HostStore("fp8_interleaved", 256, table)
    ids = torch.randint(0, 300, (23,), generator=gen)
    counters = torch.zeros(2, dtype=torch.int64)
    dst = torch.full((23, 264), 0xAB, dtype=torch.uint8)
    bounds = [0, 5, 10, 15, 20, 23]
    sender._send_native(store, ids, dst, SimpleNamespace(cuda_stream=counters.data_ptr()), 2, start=1, bounds=bounds)
    assert torch.equal(dst, table.index_select(0, ids))
    assert len(sender.last_timeline["launch"]) == 5
    counters[:] = torch.tensor([0, 2])  # the second send fails
    with pytest.raises(RuntimeError, match=r"staged send of 23 rows failed: CUDA error 7 \(stand-in error 7\)"):
        sender._send_native(
            store, ids, dst, SimpleNamespace(cuda_stream=counters.data_ptr()), 2, start=0, bounds=bounds
        )


def _stream_on_host(
    table, ids, chunk_rows, ring_len, start, threads, delay=0, fail_at=0, timeline=None, bounds=None, wait="query"
):
    """Run the native send with stand-ins that model asynchronous copies (each chunk's copy is
    carried out only when a query first reports its event done, after `delay` "not ready"
    answers), then finish the copies still queued; (dst, return code, sends, event counters).
    Chunks of `bounds` (default: `chunk_rows` each); `wait`: the stand-in for cudaEventQuery."""
    lib = native.library()
    stand_in_lib, fn = stand_ins()
    row_bytes, n = table.shape[1], ids.numel()
    ring = [torch.full((chunk_rows, row_bytes), 0xCD, dtype=torch.uint8) for _ in range(ring_len)]
    events = [torch.tensor([0, 0, 0, 0, 0, 0, delay], dtype=torch.int64) for _ in range(ring_len)]
    stream = torch.tensor([0, fail_at, 0, 0, 0], dtype=torch.int64)
    dst = torch.full((n, row_bytes), 0xAB, dtype=torch.uint8)  # poisoned
    bounds = torch.tensor(bounds or [*range(0, n, chunk_rows), n], dtype=torch.int64)
    err = lib.condmem_gather_stream(
        table.data_ptr(),
        row_bytes,
        ids.data_ptr(),
        (ctypes.c_void_p * ring_len)(*(b.data_ptr() for b in ring)),
        (ctypes.c_void_p * ring_len)(*(e.data_ptr() for e in events)),
        ring_len,
        start,
        bounds.data_ptr(),
        bounds.numel() - 1,
        dst.data_ptr(),
        stream.data_ptr(),
        fn["deferred_memcpy"],
        fn["deferred_record"],
        fn[wait],
        threads,
        None if timeline is None else timeline.data_ptr(),
    )
    for e in events:  # the copies still in flight when the call returned
        e[2] = 0
        stand_in_lib.condmem_test_query(ctypes.c_void_p(e.data_ptr()))
    return dst, err, int(stream[0]), torch.stack(events)


@needs_native
@pytest.mark.parametrize("n, max_rows", [(9000, 100), (5000, 64), (333, 7)])
def test_streaming_send_with_ramped_chunks_lands_every_row(n, max_rows):
    from condmem.tables.staged_transfer import chunk_bounds

    gen = torch.Generator().manual_seed(n)
    table = torch.randint(0, 256, (997, 264), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 997, (n,), generator=gen)
    bounds = chunk_bounds(n, max_rows, min_rows=8)
    dst, err, sends, _ = _stream_on_host(table, ids, max_rows, 3, 1, 5, delay=2, bounds=bounds)
    assert err == 0 and sends == len(bounds) - 1
    assert torch.equal(dst, table.index_select(0, ids))


def test_chunk_bounds_ramp_up_and_down_and_cover_every_row():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from condmem.tables.staged_transfer import chunk_bounds

    assert chunk_bounds(105000, 65536, 4096) == [0, 4096, 12288, 28672, 52500, 76328, 92712, 100904, 105000]
    assert chunk_bounds(0, 65536) == [0]

    @settings(max_examples=300, deadline=None)
    @given(n=st.integers(1, 600_000), max_rows=st.integers(1, 70_000), min_rows=st.integers(1, 5000))
    def check(n, max_rows, min_rows):
        bounds = chunk_bounds(n, max_rows, min_rows)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert bounds[0] == 0 and bounds[-1] == n
        assert all(0 < size <= max_rows for size in sizes)
        if n >= 2 * min_rows and min_rows <= max_rows:
            assert sizes[0] <= min_rows and sizes[-1] <= min_rows  # short first and last DMAs
        if n >= 64 * max_rows:
            assert sum(size for size in sizes if 2 * size >= max_rows) >= 0.9 * n  # mostly big chunks

    check()


@needs_native
@pytest.mark.parametrize(
    "n, chunk_rows, ring_len, start, threads, delay",
    [
        (23, 5, 3, 2, 4, 0),
        (40, 8, 2, 0, 1, 3),
        (7, 64, 4, 3, 3, 1),
        (1, 1, 2, 1, 2, 2),
        (4096, 100, 4, 1, 4, 5),
        (5000, 64, 2, 1, 6, 50),
        (3001, 1000, 3, 0, 8, 0),
    ],
)
def test_streaming_send_lands_every_row_and_reuses_a_buffer_only_once_its_copy_is_done(
    n, chunk_rows, ring_len, start, threads, delay
):
    gen = torch.Generator().manual_seed(n + delay)
    table = torch.randint(0, 256, (997, 264), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 997, (n,), generator=gen)
    dst, err, sends, events = _stream_on_host(table, ids, chunk_rows, ring_len, start, threads, delay)
    assert err == 0
    assert torch.equal(dst, table.index_select(0, ids))
    n_chunks = -(-n // chunk_rows)
    assert sends == n_chunks
    expected = torch.zeros(ring_len, dtype=torch.int64)
    for c in range(n_chunks):
        expected[(start + c) % ring_len] += 1
    assert torch.equal(events[:, 0], expected)  # one record per chunk, on its buffer


@needs_native
def test_the_deferred_stand_ins_catch_a_buffer_rewritten_too_early():
    """Negative control for the test above: a query that says "done" at once, before the copy
    has run (so a buffer is rewritten while its copy is pending), fails it."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randint(0, 256, (997, 264), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 997, (400,), generator=gen)
    dst, err, _, _ = _stream_on_host(table, ids, 16, 2, 0, 4, wait="done_query")
    assert err == 0
    assert not torch.equal(dst, table.index_select(0, ids))


@needs_native
def test_a_failed_streaming_send_stops_the_rest_and_returns_its_code():
    gen = torch.Generator().manual_seed(2)
    table = torch.randint(0, 256, (500, 264), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 500, (50,), generator=gen)
    dst, err, sends, events = _stream_on_host(
        table, ids, chunk_rows=10, ring_len=3, start=0, threads=4, delay=2, fail_at=3
    )
    assert err == 7
    assert sends == 3  # nothing sent after the failure
    assert torch.equal(dst[:20], table.index_select(0, ids[:20]))  # chunks 0-1 landed
    assert (dst[20:] == 0xAB).all()  # the failed chunk and later: untouched
    assert int(events[:, 0].sum()) == 2  # no record after the failed send


@needs_native
def test_the_streaming_timeline_has_every_chunk_in_order():
    from condmem.tables.staged_transfer import chunk_times

    gen = torch.Generator().manual_seed(4)
    table = torch.randint(0, 256, (2000, 264), dtype=torch.uint8, generator=gen)
    ids = torch.randint(0, 2000, (1000,), generator=gen)
    n_chunks = 1000 // 64 + 1
    timeline = torch.full((1 + 3 * n_chunks,), -1, dtype=torch.int64)
    dst, err, sends, _ = _stream_on_host(
        table, ids, chunk_rows=64, ring_len=3, start=0, threads=3, delay=1, timeline=timeline
    )
    assert err == 0 and sends == n_chunks
    assert torch.equal(dst, table.index_select(0, ids))
    writable, whole, queued = timeline[1::3], timeline[2::3], timeline[3::3]
    assert bool((writable >= timeline[0]).all()) and bool((writable <= whole).all()) and bool((whole <= queued).all())
    assert bool((whole[1:] >= queued[:-1]).all())  # chunks are queued in order
    times = chunk_times(timeline)
    assert {k: len(v) for k, v in times.items()} == {"interval": n_chunks, "launch": n_chunks, "late": n_chunks}
    assert min(min(v) for v in times.values()) >= 0
