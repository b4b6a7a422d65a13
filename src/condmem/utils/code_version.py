"""The commit of the code that is running, for results that say what produced them.

A git checkout answers with ``git rev-parse HEAD`` (``+dirty`` when tracked files differ from it);
a ``git archive`` of the tree carries its commit in ``_ARCHIVE_COMMIT`` (``.gitattributes``
marks this file ``export-subst``), which is how a copy without ``.git`` (a device machine's
snapshot) still knows it. An installed wheel knows neither: ``None``.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

_ARCHIVE_COMMIT = "$Format:%H$"


@functools.lru_cache(maxsize=1)
def code_commit() -> str | None:
    """The full commit hash, ``<hash>+dirty`` for a checkout with changed tracked files, or ``None``."""
    if not _ARCHIVE_COMMIT.startswith("$"):
        return _ARCHIVE_COMMIT
    root = Path(__file__).resolve().parents[3]  # <root>/src/condmem/utils/code_version.py

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # Only this tree's own repository: a copy inside another checkout must not take that one's HEAD.
    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    head = git("rev-parse", "HEAD")
    if head is None:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if changed else "")


def short_commit() -> str | None:
    """`code_commit` as results print it: the first 7 hex digits (``+dirty`` kept), or ``None``."""
    full = code_commit()
    return None if full is None else full[:7] + full[40:]
