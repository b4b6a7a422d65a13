"""One writer per run folder: an exclusive ``flock`` on ``<folder>/.lock``, held while a run writes there.

Two ``condmem train`` runs into one ``--out`` would interleave checkpoints and clean up
each other's. The lock is advisory and held by the open file, so the kernel releases it
when the holder exits, even by SIGKILL: a stale lock never blocks the next run.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class RunLockedError(ValueError):
    """Another process holds the run folder."""


class RunLock:
    """Context manager: hold ``<folder>/.lock`` exclusively (non-blocking; `RunLockedError` when taken)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / ".lock"
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted at .lock must not make the lock truncate a file outside the folder.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise RunLockedError(f"{self.path} is a symbolic link, not a lock file: remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunLockedError(
                f"{self.folder} is in use by another condmem process (pid {holder}); wait for it, or use another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
