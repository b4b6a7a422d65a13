"""Atomic file writes: write a temp file beside the target, fsync, then rename.

A reader (or a crash) never sees a half-written table, checkpoint or cache file:
either the old file or the complete new one is there. Temp names carry the writer's
pid (``.<name>.<pid>.<random>.tmp``), so the next write to the same place removes the
leftovers of writers that were killed (`sweep_stale`) and leaves live writers' alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host's pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def sweep_stale(directory: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove entries ``<prefix><pid>.<random>[.tmp]`` of `directory` whose pid is not running; returns them."""
    directory = Path(directory)
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.[A-Za-z0-9_]+(\.tmp)?$")
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        removed.append(entry)
    return removed


def temp_prefix(path: Path) -> str:
    """The prefix of this process's temp names for `path` (``.<name>.<pid>.``)."""
    return f".{path.name}.{os.getpid()}."


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` on success.

    On an exception (KeyboardInterrupt and SystemExit included) the temporary file is
    removed and the target is left untouched. Temps of killed writers to `path` are swept first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent, f".{path.name}.")
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
