"""matplotlib, optional: `pyplot()` returns the headless pyplot module, or None (with a warning) when missing.

Every figure in condmem (demo curves, benchmark charts) goes through it, so a machine
without matplotlib still produces all numbers (JSON), only no PNGs.
"""

from __future__ import annotations

import logging

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
