"""Is the gpu preset's training step bound by the host? Pure MoE, compiled_graphs, deterministic.

Queues 20 steps (`Trainer.queue_step`) after a warm-up and reports the host's time per call against
the whole wall time per step: a host that waits in every call (median near the step) is held back by
the device, one that never waits sets the pace. Then 3 queued steps under torch's sync debug mode
(warnings for the synchronisations torch itself makes) and 10 under cProfile from an empty queue: the
host's own time per step, by function. Prints what it finds; needs a CUDA device.

    PYTHONPATH=src python3 benchmarks/probes/study_step_host.py
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import study_step_profile as P  # noqa: E402

from condmem.train.determinism import deterministic_mode, set_cublas_workspace  # noqa: E402


def main() -> None:
    tc = P.STUDY_PRESETS["gpu"].base.train
    model, trainer = P.build(
        "moe", P.variants(False)["moe"], torch.device("cuda"), tc, 80, P.OPTIONS["compiled_graphs"]
    )
    for s in range(4):
        trainer.train_step(s)
    torch.cuda.synchronize()
    host, queued = [], []
    t0 = time.perf_counter()
    for s in range(4, 24):
        a = time.perf_counter()
        queued.append((s, trainer.queue_step(s)[0]))
        host.append(time.perf_counter() - a)
    t1 = time.perf_counter()
    trainer.read_losses(queued)
    t2 = time.perf_counter()
    ms = sorted(1e3 * h for h in host)
    print(
        f"queued 20 steps: host {1e3 * (t1 - t0) / 20:.2f} ms/step (calls: min {ms[0]:.2f} med {ms[10]:.2f} "
        f"max {ms[-1]:.2f}), total {1e3 * (t2 - t0) / 20:.2f} ms/step"
    )
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        queued = [(s, trainer.queue_step(s)[0]) for s in range(24, 27)]
        torch.cuda.set_sync_debug_mode(0)
        trainer.read_losses(queued)
    print("sync warnings in 3 queued steps:", len(caught))
    for w in caught[:8]:
        print("  ", str(w.message)[:200], w.filename, w.lineno)
    profiler = cProfile.Profile()
    profiler.enable()
    queued = [(s, trainer.queue_step(s)[0]) for s in range(27, 37)]
    profiler.disable()
    trainer.read_losses(queued)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-6000:])


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    set_cublas_workspace(True)  # before cuBLAS starts
    with deterministic_mode(True):
        main()
