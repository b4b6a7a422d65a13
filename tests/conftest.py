"""Shared test fixtures: a private cache dir for every test; engines and host buffers closed
at teardown, also when the test fails."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's ~/.cache.
    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "condmem-cache"))


@pytest.fixture(autouse=True)
def _close_what_a_test_opened(monkeypatch):
    """Lookup engines (worker threads, plan slots) and host buffers (page-locked memory, shared
    files) a test opens are closed when it ends, passed or failed: a failing test must not leak
    into the next. Closing twice is harmless, so tests that close their own are unaffected."""
    from condmem.tables.host_memory import HostBuffer
    from condmem.tables.lookup import LookupEngine

    opened: list = []
    for cls in (LookupEngine, HostBuffer):
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            opened.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    yield
    errors = []
    for obj in reversed(opened):  # engines before the buffers they read
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001 - collected and raised below
            errors.append(exc)
    if errors:
        raise errors[0]
