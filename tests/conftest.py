"""Shared test fixtures: a private cache dir for every test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's ~/.cache.
    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "condmem-cache"))
