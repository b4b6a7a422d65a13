"""Where does serving a wave make the host wait for the GPU? Counts the synchronizing CUDA
calls (``torch.cuda.set_sync_debug_mode``) made while `condmem bench e2e`'s servers serve
their waves, grouped by the condmem call stack and thread that made them.

A host sync in the prefill loop keeps the launching thread from running ahead of the GPU:
after it, the GPU idles while the next kernels are launched, and any host work of the
lookups (started for the next batch) lands on the critical path.

    PYTHONPATH=src python3 benchmarks/probes/prefill_syncs.py --out $OUT -- --backbones 4b \\
        --engram-layers 1 14 --table-gib 2 --sequences 128 --gen 4 --e2e-repeats 1 --e2e-variants hbm host_staged
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import traceback
import warnings
from pathlib import Path

import torch

from condmem.cli import main as cli_main
from condmem.serving.server import WaveServer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: arguments of condmem bench e2e")
    args = p.parse_args()
    counts: collections.Counter = collections.Counter()
    variant = {"name": "?"}

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [
            f"{f.filename.split('condmem/')[-1]}:{f.lineno}:{f.name}"
            for f in traceback.extract_stack()[:-1]
            if "/condmem/" in f.filename and "prefill_syncs" not in f.filename
        ]
        counts[(variant["name"], threading.current_thread().name, " <- ".join(reversed(frames[-5:])))] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    wave = WaveServer.wave

    def watched_wave(self, *a, **k):
        variant["name"] = (
            "none"
            if self.memory is None
            else (
                "hbm"
                if all(s.in_device_memory for s in self.memory.stores.values())
                else f"host/{self.graph.fetch.__class__.__name__}"
                if self.graph is not None and self.graph.fetch is not None
                else "host"
            )
        )
        if not torch.cuda.is_available():
            return wave(self, *a, **k)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return wave(self, *a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    WaveServer.wave = watched_wave
    bench = [a for a in args.bench_args if a != "--"]
    cli_main(["bench", "e2e", "--out", args.out, *bench])
    rows = [{"variant": v, "thread": t, "stack": s, "syncs": n} for (v, t, s), n in counts.most_common()]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefill_syncs.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows[:40]:
        print(f"{r['syncs']:5d} {r['variant']:12s} {r['thread'][:14]:14s} {r['stack'][:260]}")


if __name__ == "__main__":
    main()
