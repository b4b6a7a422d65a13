"""A/B of `condmem.ops.launch.FastLaunch.__call__` against another version of it, in one process.

The other version is read from a file (e.g. ``git show 1d577a0:src/condmem/ops/launch.py > before.py``:
CUDA tensors handed to Triton's launcher as tensors, which then calls ``data_ptr()`` and asks the
driver for each pointer's device address). Both share the compiled-kernel cache (same key), and
alternate batch by batch (``--rounds`` times, order flipped each round) on the eager calls of
`benchmarks/eager_overhead.py` (hash, gate, gather at 128 and 16K tokens, fresh inputs), with one
ATen kernel (``torch_add``) as the machine's floor. Prints the median microseconds per call of each.

    PYTHONPATH=src python3 benchmarks/probes/launch_ab.py --before before.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eager_overhead as eo  # noqa: E402

import condmem.ops.launch as launch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the other launch.py")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("launch_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    versions = {"before": before.FastLaunch.__call__, "after": launch.FastLaunch.__call__}
    device = torch.device("cuda")
    times: dict = {}
    for tokens in (128, 16384):
        ops, _ = eo.cases(tokens, device, 4)
        for name in ("hasher", "gate", "gather", "torch_add"):
            fn, _, sets = ops[name]
            for r in range(args.rounds):
                for version in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    launch.FastLaunch.__call__ = versions[version]
                    ms = eo.eager_ms(fn, sets, args.calls, 3)
                    times.setdefault(f"{name}@{tokens}", {}).setdefault(version, []).append(ms * 1e3)
        del ops
    launch.FastLaunch.__call__ = versions["after"]
    rows = {
        k: {v: statistics.median(t) for v, t in vs.items()} | {"after_over_before": None} for k, vs in times.items()
    }
    for row in rows.values():
        row["after_over_before"] = row["after"] / row["before"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_ab.json").write_text(json.dumps({"machine": eo.machine_info(), "rows": rows, "us": times}, indent=1))
    print(f"{'op':>16} {'before us':>10} {'after us':>9} {'after/before':>13}")
    for k, row in rows.items():
        print(f"{k:>16} {row['before']:10.2f} {row['after']:9.2f} {row['after_over_before']:13.3f}")


if __name__ == "__main__":
    main()
