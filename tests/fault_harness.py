"""Fault injection for the reliability tests: SIGKILL a forked writer at a random moment, flip or cut
bytes of a file, and tally outcomes (optionally into a JSON-lines report for docs/reliability.md).

A forked child (no interpreter start-up, so dozens of kills stay cheap) runs the write; the parent
sleeps a random fraction of the write's measured duration and kills it with SIGKILL, which no
handler can intercept: whatever is on disk afterwards is what a power cut or OOM kill leaves.
Set ``CONDMEM_FAULT_REPORT=path`` to append one JSON line per fault class.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch


def timed(fn: Callable[[], object], repeat: int = 2) -> float:
    """Seconds one call of `fn` takes in a forked child, from fork to exit (the longest of `repeat`)."""
    worst = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert kill_during(fn, None), "the write fails even without a fault"
        worst = max(worst, time.perf_counter() - t0)
    return worst


def kill_during(fn: Callable[[], object], delay_s: float | None) -> bool:
    """Run `fn` in a forked child, SIGKILL it after `delay_s` (None: let it finish); True when it had finished first."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            fn()
            code = 0
        finally:
            os._exit(code)
    if delay_s is not None:
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)  # a finished child is a zombie until waited: the kill is harmless
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def kill_points(n: int, duration_s: float, seed: int) -> list[float]:
    """`n` kill delays spread over the whole write (a little past its end, so some writes complete)."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, 1.15 * duration_s) for _ in range(n)]


def flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([b ^ mask]))


def spread_offsets(size: int, n: int, seed: int, head: int = 0) -> list[int]:
    """`n` distinct offsets in [0, size): the first `head` bytes all included, the rest at random."""
    rng = random.Random(seed)
    fixed = list(range(min(head, size)))
    rest = rng.sample(range(min(head, size), size), max(0, min(n - len(fixed), size - len(fixed))))
    return sorted(fixed + rest)


def report(fault: str, tried: int, outcomes: Counter, command: str) -> None:
    """Append one row (fault, tries, outcome counts, reproducing command) to $CONDMEM_FAULT_REPORT."""
    path = os.environ.get("CONDMEM_FAULT_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(
                json.dumps({"fault": fault, "tried": tried, "outcomes": dict(outcomes), "command": command}) + "\n"
            )
