"""A/B: `condmem bench e2e` with its host-to-device index copies queued from pinned memory
(`condmem.utils.host_copy.to_device`, the default) against the same copies from pageable
memory (``--pageable``: ``Tensor.pin_memory`` made a no-op, so each copy makes the host wait
for the GPU's queued work, and the GPU idles while the host prepares the next prompt batch:
its hashing and lookup launches, and the next batch's layout).

Prediction before the run: with two host-table layers the prefill's gap to the HBM table
(2.5% in three runs on one machine) closes to within 1%; every variant's prefill gains a
little (~0.5%: the gap before each batch's first kernel), decode unchanged.

    PYTHONPATH=src python3 benchmarks/probes/prefill_host_wait_ab.py [--pageable] --out DIR <bench e2e arguments>
"""

from __future__ import annotations

import runpy
import sys

import torch

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--pageable" in args:
        args.remove("--pageable")
        torch.Tensor.pin_memory = lambda self, *a, **k: self      # noqa: ARG005 - the pre-fix copies
    sys.argv = ["condmem", "bench", "e2e", *args]
    runpy.run_module("condmem", run_name="__main__", alter_sys=True)
