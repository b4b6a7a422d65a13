"""The bench's full-size exactness check (`bench/lookup_exact.py`): it passes on a correct engine,
treats the random tables' NaNs as equal, and stops on rows that differ (negative control)."""

from __future__ import annotations

import pytest
import torch

from condmem.bench.harness import same_rows
from condmem.bench.lookup_exact import LookupMismatchError, check_lookup, check_splits
from condmem.tables.lookup import LookupConfig, LookupEngine
from condmem.tables.storage import HostStore, LayerStore

HEAD_DIM = 64


def _store(rows: int = 500, seed: int = 0) -> LayerStore:
    """Random bytes as fp8 rows + e8m0 scales: NaN codes and 0xFF scales included, as in the bench."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, HEAD_DIM + HEAD_DIM // 32), dtype=torch.uint8, generator=gen)
    return HostStore("fp8_interleaved", HEAD_DIM, raw)


def _ids(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, rows, (40, 6), generator=torch.Generator().manual_seed(seed))


def test_same_rows_counts_nan_as_equal_and_nothing_else():
    a = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert same_rows(a, a.clone())
    assert not same_rows(a, torch.tensor([1.0, 2.0, -0.0], dtype=torch.bfloat16))
    assert not same_rows(a, a.float())
    assert not same_rows(a, a[:2])


def test_a_correct_engine_passes_every_split():
    store = _store()
    engine = LookupEngine(store, "cpu", config=LookupConfig(cpu_fraction=0.5))
    ids = _ids(store.num_rows, 1)
    assert check_splits(engine, store, ids, "cpu") == [0.5]  # no GPU: the engine's own split only
    check_lookup(engine, store, ids, "cpu")
    engine.close()


class _Poisoned:
    """An engine whose rows are wrong in one place (what a broken kernel would return)."""

    def __init__(self, engine: LookupEngine):
        self.engine, self.cpu_fraction, self.on_gpu = engine, engine.cpu_fraction, False

    def lookup(self, ids):
        rows = self.engine.lookup(ids).wait().clone()
        rows[3, 2, 7] = 12345.0
        return type("Done", (), {"wait": lambda _self: rows})()


def test_wrong_rows_stop_the_bench_with_a_count():
    store = _store(seed=2)
    engine = LookupEngine(store, "cpu", config=LookupConfig(cpu_fraction=1.0))
    with pytest.raises(LookupMismatchError, match=r"host uniform: .*1 of 240 rows differ"):
        check_lookup(_Poisoned(engine), store, _ids(store.num_rows, 3), "host uniform")
    engine.close()
