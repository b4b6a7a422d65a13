"""Output paths checked before long work starts: a folder that exists and takes a write, room on its disk.

A conversion or a training run that discovers at its end that the output is a
directory, on a read-only file system or on a full disk has wasted all its work. These
checks create the folder, write and remove a probe file in it, and compare free space
with what the output will take, raising `OutputPathError` (a ValueError) that names the
flag, the path and the reason. `check_free_space` alone is what a long run calls again
before each save (the disk may have filled meanwhile).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from condmem.utils.atomic import DestinationError, check_destination, temp_prefix


class OutputPathError(ValueError):
    """An output path cannot be written (named with the flag that gave it)."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def format_bytes(n: int) -> str:
    """``12,345,678 bytes (11.8 MiB)``: exact, and readable."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} bytes ({n / size:.1f} {unit})"
    return f"{n:,} bytes"


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for an unprivileged writer) on the file system of `path`, or of its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Raise `OutputPathError` (``<what>: <path> needs N bytes, M free``) unless `path`'s file system has room."""
    try:
        free = free_bytes(path)
    except OSError as exc:
        raise OutputPathError(f"{what}: {path}: cannot read its free space ({_reason(exc)})") from None
    if free < need_bytes:
        raise OutputPathError(f"{what}: {path} needs {format_bytes(need_bytes)}, {format_bytes(free)} free")


def check_output_dir(path: str | os.PathLike, flag: str, need_bytes: int = 0) -> Path:
    """Create folder `path` if needed and prove it takes a write (and `need_bytes` more)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{flag} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f"{temp_prefix(path / 'probe')}probe.tmp"
        # O_EXCL: a new file, never written through a link (or onto a node) planted at the probe's name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(probe, flags, 0o600), "wb") as fh:
                fh.write(b"\0" * 4096)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(path).free
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write there ({_reason(exc)})") from None
    if need_bytes and free < need_bytes:
        raise OutputPathError(f"{flag} {path}: {format_bytes(need_bytes)} needed, {format_bytes(free)} free")
    return path


def check_output_file(path: str | os.PathLike, flag: str, need_bytes: int = 0) -> Path:
    """Check that file `path` can be written atomically: a regular file or nothing yet (`check_destination`),
    its folder writable, room for it."""
    path = Path(path)
    try:
        real = check_destination(path)
    except DestinationError as exc:
        raise OutputPathError(f"{flag} {exc}") from None
    check_output_dir(real.parent, flag, need_bytes)
    return path
