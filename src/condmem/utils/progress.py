"""Progress bars (tqdm on stderr, when installed and on a terminal) with lines written above them.

One class for every long job: training steps, table writes and conversions, pinning.
tqdm is optional (the GPU machine, minimal installs): without it only the lines are
printed, and a one-time notice says why there is no bar.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("condmem")

try:  # optional dependency
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # pragma: no cover - exercised where tqdm is absent
    _tqdm = None

_warned = False


class Progress:
    """A progress bar (tqdm, on stderr) plus lines written above it (stdout)."""

    def __init__(
        self,
        total: int,
        desc: str,
        initial: int = 0,
        enabled: bool = True,
        unit: str = "step",
        unit_scale: bool = False,
    ):
        global _warned
        self.bar = None
        if enabled and _tqdm is not None and sys.stderr.isatty():
            self.bar = _tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                unit_scale=unit_scale,
                unit_divisor=1024 if unit == "B" else 1000,
                dynamic_ncols=True,
                leave=False,
            )
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
