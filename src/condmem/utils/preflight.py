"""Output paths checked before long work starts: a folder that exists and takes a write, room on its disk.

A conversion or a training run that discovers at its end that the output is a
directory, on a read-only file system or on a full disk has wasted all its work. These
checks create the folder, write and remove a probe file in it, and compare free space
with what the output will take, raising `OutputPathError` (a ValueError) that names the
flag, the path and the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from condmem.utils.atomic import temp_prefix


class OutputPathError(ValueError):
    """An output path cannot be written (named with the flag that gave it)."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output_dir(path: str | os.PathLike, flag: str, need_bytes: int = 0) -> Path:
    """Create folder `path` if needed and prove it takes a write (and `need_bytes` more)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{flag} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f"{temp_prefix(path / 'probe')}probe.tmp"
        try:
            with open(probe, "wb") as fh:
                fh.write(b"\0" * 4096)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(path).free
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write there ({_reason(exc)})") from None
    if need_bytes and free < need_bytes:
        raise OutputPathError(f"{flag} {path}: {need_bytes / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free")
    return path


def check_output_file(path: str | os.PathLike, flag: str, need_bytes: int = 0) -> Path:
    """Check that file `path` can be written atomically: not a directory, its folder writable, room for it."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{flag} {path}: is a directory, not a file")
    check_output_dir(path.parent, flag, need_bytes)
    return path
