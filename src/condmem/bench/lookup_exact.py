"""Exactness at full size for `condmem bench lookup`: the engine's rows against a plain gather.

The unit tests check every lookup path at small sizes; this checks the benchmark's own tables
(tens of GiB of pinned host memory, 16K-token batches), after the timed lookups, so no
timing is reported for wrong rows. The reference is `gather_reference`: plain torch indexing
of the table where it lives (host memory, the memory-mapped file, or HBM) and a plain
dequantization, with no cache, no split and no kernel of ours.

The bench's tables hold random bytes, so some fp8 values are NaN codes and some e8m0 scales
are 0xFF (NaN): rows are equal when their NaNs sit at the same places and every other value
is identical.
"""

from __future__ import annotations

import logging

import torch

from condmem.bench.harness import same_rows
from condmem.ops.gather import gather_reference
from condmem.tables.lookup import LookupEngine
from condmem.tables.storage import LayerStore

log = logging.getLogger("condmem.bench")

SPLIT_FRACTIONS = (0.0, 0.5, 1.0)
"""CPU shares checked on a host store: every miss on the GPU's zero-copy gather, half and half,
every miss on the CPU send."""


class LookupMismatchError(AssertionError):
    """The engine returned rows that differ from the plain gather."""


def check_lookup(engine: LookupEngine, store: LayerStore, ids: torch.Tensor, what: str) -> None:
    """One lookup of `ids` through `engine`, compared with the plain gather; raises
    `LookupMismatchError` naming `what` and how many rows differ."""
    if store.raw is None:
        log.warning("%s: not checked (a store without raw rows has no plain reference here)", what)
        return
    got = engine.lookup(ids).wait().cpu()
    want = gather_reference(ids, store.raw, head_dim=store.head_dim).cpu()
    if not same_rows(got, want):
        if got.shape != want.shape or got.dtype != want.dtype:
            detail = f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        else:
            bad = ~((got == want) | (got.isnan() & want.isnan()))
            detail = f"{int(bad.any(dim=-1).sum())} of {ids.numel()} rows differ"
        raise LookupMismatchError(f"{what}: the engine's rows differ from a plain gather of the table ({detail})")


def check_splits(
    engine: LookupEngine,
    store: LayerStore,
    ids: torch.Tensor,
    what: str,
    fractions: tuple[float, ...] = SPLIT_FRACTIONS,
) -> list[float]:
    """`check_lookup` at each CPU share in `fractions` (a host store read by a GPU; otherwise the
    engine's own split only); the engine's share is restored. Returns the shares checked."""
    if store.cpu_share is not None or not engine.on_gpu:
        check_lookup(engine, store, ids, what)
        return [engine.cpu_fraction]
    saved = engine.cpu_fraction
    try:
        for fraction in fractions:
            engine.cpu_fraction = fraction
            check_lookup(engine, store, ids, f"{what}, cpu_fraction {fraction:.2f}")
    finally:
        engine.cpu_fraction = saved
    return list(fractions)
