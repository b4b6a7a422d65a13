"""matplotlib, optional: `pyplot()` returns the headless pyplot module, or None (with a warning) when missing.

Every figure in condmem (demo curves, benchmark charts) goes through it, so a machine
without matplotlib still produces all numbers (JSON), only no PNGs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("condmem")


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (no display needed), or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG figures (pip install matplotlib)")
        return None


def save_figure(fig, path: str | os.PathLike, *, within: str | os.PathLike | None = None) -> Path:
    """Write `fig` to `path` through the atomic writer (a regular file, inside `within` when given; format
    from the suffix) and close it."""
    from condmem.utils.atomic import atomic_path

    path = Path(path)
    try:
        with atomic_path(path, within=within) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path
