"""The capture guard: syncing holders run side by side, a capture runs alone and is not
starved by a stream of syncing holders."""

from __future__ import annotations

import threading
import time

from condmem.utils.capture_guard import CaptureGuard


def test_syncing_holders_share_and_a_capture_waits_for_them():
    guard = CaptureGuard()
    inside = []
    both_in = threading.Barrier(2, timeout=5)

    def reader():
        with guard.syncing():
            inside.append("r")
            both_in.wait()            # both readers inside at once, or this times out
            time.sleep(0.05)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    while len(inside) < 2:
        time.sleep(0.001)
    t0 = time.perf_counter()
    with guard.capturing():
        waited = time.perf_counter() - t0
        assert len(inside) == 2
    for t in readers:
        t.join()
    assert waited > 0.02              # the capture started only after the readers left


def test_a_capture_excludes_syncing_and_is_preferred_over_new_holders():
    guard = CaptureGuard()
    log = []
    first_in = threading.Event()

    def first_reader():
        with guard.syncing():
            first_in.set()
            time.sleep(0.05)
            log.append("first reader out")

    def capture():
        with guard.capturing():
            log.append("capture in")
            time.sleep(0.03)
            log.append("capture out")

    def late_reader():
        with guard.syncing():
            log.append("late reader in")

    a = threading.Thread(target=first_reader)
    a.start()
    first_in.wait(5)
    b = threading.Thread(target=capture)
    b.start()
    time.sleep(0.01)                  # the capture is now waiting
    c = threading.Thread(target=late_reader)
    c.start()
    for t in (a, b, c):
        t.join(5)
    assert log == ["first reader out", "capture in", "capture out", "late reader in"]


def test_the_guard_is_released_on_errors():
    guard = CaptureGuard()
    for holder in (guard.syncing, guard.capturing):
        try:
            with holder():
                raise RuntimeError("boom")
        except RuntimeError:
            pass
    with guard.capturing():          # would block forever if either had leaked
        pass
    with guard.syncing():
        pass


def test_no_garbage_collection_during_a_capture():
    """The collector is off inside `capturing` and back as it was after (on, or off if it was)."""
    import gc

    guard = CaptureGuard()
    assert gc.isenabled()
    with guard.capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with guard.capturing():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
