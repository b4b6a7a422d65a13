"""A failing test's host buffers and engines are closed at its teardown (no leak into the next test)."""

from __future__ import annotations

from pathlib import Path


def test_what_a_failing_test_opened_is_closed(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        """
        import torch
        from condmem.tables.host_memory import allocate_host
        from condmem.tables.lookup import LookupEngine
        from condmem.tables.storage import HostStore, LayerStore

        OPENED = []

        def test_fails_midway():
            buf = allocate_host(264 * 256, "pageable")
            raw = buf.tensor.view(-1, 264)
            engine = LookupEngine(HostStore("fp8_interleaved", 256, raw, buffer=buf), "cpu")
            OPENED.extend([buf, engine])
            assert False, "a test that fails before closing what it opened"

        def test_next_sees_them_closed():
            buf, engine = OPENED
            assert buf.tensor.numel() == 0
            assert engine._pool is None and not engine._plans
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
