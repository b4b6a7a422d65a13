"""Progress output: one fixed-field line per step, and a progress bar when tqdm is installed.

tqdm is optional (the GPU machine, minimal installs): without it the lines alone are
printed, and a one-time notice says why there is no bar.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("condmem.train")

try:  # optional dependency
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # pragma: no cover - exercised where tqdm is absent
    _tqdm = None

_warned = False


class Progress:
    """A progress bar (tqdm, on stderr) plus lines written above it (stdout)."""

    def __init__(self, total: int, desc: str, initial: int = 0, enabled: bool = True):
        global _warned
        self.bar = None
        if enabled and _tqdm is not None and sys.stderr.isatty():
            self.bar = _tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=False)
        elif enabled and _tqdm is None and not _warned:
            _warned = True
            logger.warning("tqdm is not installed: progress lines only, no progress bar (pip install tqdm)")

    def update(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
