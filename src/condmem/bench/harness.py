"""Shared benchmark harness: timing, ceilings measured in the same run, machine info, JSON rows."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from condmem.utils.code_version import short_commit


def machine_info() -> dict:
    """GPU, versions, host and commit: stored in every result row."""
    info = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            gpu=p.name,
            sm_count=p.multi_processor_count,
            gpu_mem_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=f"{p.major}.{p.minor}",
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    # The source itself, for runs from a copy of the tree without .git.
    pkg = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        digest.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    info["source_sha256"] = digest.hexdigest()[:16]
    # A tree that differs from its commit (e.g. a copy whose .git is older than its files) says
    # so (+dirty): then only source_sha256 identifies the code.
    info["commit"] = short_commit()
    return info


class Rotator:
    """Calls ``fn(*inputs[i])`` with i cycling over several input sets (so no set stays cached)."""

    def __init__(self, fn: Callable, input_sets: Sequence[tuple]):
        self.fn, self.sets, self.i = fn, list(input_sets), 0

    def __call__(self):
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.fn(*args)


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN exactly where `want` has NaN (the benches' tables hold random
    bytes, so some fp8 codes and e8m0 scales decode to NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def graph_replay_ms(fn: Callable[..., object], arg_sets: list[tuple], launches: int = 8, replays: int = 20) -> float:
    """Milliseconds per launch of `fn(*args)`: `launches` launches cycling over `arg_sets` (fresh
    inputs, not one set re-read from L2) captured in one CUDA graph, median of `replays`."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(*arg_sets[i % len(arg_sets)])
    return statistics.median(t / launches for t in event_times_ms(graph.replay, replays)[2:])


def event_times_ms(fn: Callable[[], object], calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls of `fn` between two CUDA events, each waited for
    before the next (no call overlaps another: a decode step as one step sees it)."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def gpu_time_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 200) -> dict:
    """Median and 20/80% quantiles (ms) of `fn` on the GPU, via triton.testing.do_bench."""
    from triton.testing import do_bench

    fn()  # compile / first-touch outside the warm-up budget
    torch.cuda.synchronize()
    med, q20, q80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "ms_p20": q20, "ms_p80": q80}


def cpu_time_ms(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """Median and min/max (ms) of a CPU function over `repeats` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "ms_p20": min(times), "ms_p80": max(times)}


def time_ms(fn: Callable[[], object], device: str = "cuda", **kw) -> dict:
    """`gpu_time_ms` on CUDA; on CPU (the ``--smoke`` run through the interpreter) two plain calls."""
    if device == "cuda":
        return gpu_time_ms(fn, **kw)
    return cpu_time_ms(fn, repeats=2)


def copy_bandwidth_gbps(nbytes: int = 4 << 30, device: str = "cuda") -> dict:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), the memory ceiling."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    t = time_ms(lambda dst=dst, src=src: dst.copy_(src), device)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"d2d_gbps": 2 * n / (t["ms"] * 1e-3) / 1e9, "d2d_bytes": 2 * n, **{f"d2d_{k}": v for k, v in t.items()}}


def append_rows(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Append rows as JSON lines (one object per line) to `path`, creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def rows_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table: columns are (key, header, format)."""
    header = " ".join(f"{h:>{max(len(h), 9)}}" for _, h, _ in columns)
    lines = [header]
    for r in rows:
        cells = []
        for key, h, fmt in columns:
            v = r.get(key)
            width = max(len(h), 9)
            cells.append(f"{'-' if v is None else format(v, fmt):>{width}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)
