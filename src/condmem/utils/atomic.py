"""Atomic file writes: write a temp file beside the target, fsync, then rename.

A reader (or a crash) never sees a half-written table, checkpoint or cache file:
either the old file or the complete new one is there. Around that rename:

* **One writer per destination**: a writer holds an ``flock`` on ``.<name>.lock`` beside the
  target while it writes; a second writer is refused (`DestinationBusyError`, naming the
  pid) or, with ``wait=True``, waits its turn. The lock file is removed when the write ends.
* **Temps of killed writers are swept**: temp names carry the writer's pid
  (``.<name>.<pid>.<random>.tmp``) and the writer holds an ``flock`` on its temp, so any
  later write into the same folder (or `sweep_stale`, which ``condmem inspect`` calls)
  removes every temp whose writer is gone (its pid dead, or, where the pid was reused, its
  lock free) and leaves live writers' alone.
* **Modes**: the new file gets the mode of the file it replaces, or, for a new file, what
  the process's umask leaves of 0666 (not ``mkstemp``'s 0600).
* **Symlinks**: a destination that is a symbolic link is written through: its target is
  replaced, the link stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class DestinationBusyError(ValueError):
    """Another process is writing the same destination."""


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


# A temp of `atomic_path` (``.<name>.<pid>.<random>.tmp``) or a temp folder of `make_temp_dir` (checkpoints):
# hidden, the writer's pid, tempfile's 8 random characters. A caller that names its own prefix accepts any random part.
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.(?P<random>[A-Za-z0-9_]+)(?P<tmp>\.tmp)?")
_TEMPFILE_RANDOM = re.compile(r"[a-z0-9_]{8}")
STALE_UNLOCKED_S = 10.0
"""A temp no one holds a lock on is a killed writer's once it is this old (a writer locks it at once)."""


_LOCK = re.compile(r"\..+\.lock")
_LOCK_TAG = b"condmem-writer "


def _remove_unheld_lock(path: Path) -> bool:
    """Remove a destination lock file no writer holds (its writer was killed); `destination_lock` re-checks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st, mine = _stat_or_none(path), os.fstat(fd)
        if st is None or (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino) or not stat.S_ISREG(mine.st_mode):
            return False
        if os.pread(fd, len(_LOCK_TAG), 0) != _LOCK_TAG:
            return False  # another program's lock file: not ours to remove
        path.unlink()
        return True
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(fd)


def _unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _writer_gone(entry: Path, pid: int, is_file: bool) -> bool:
    if not pid_alive(pid):
        return True
    # The pid is running, but maybe as another process: a temp file's writer holds a lock on it.
    if not is_file:
        return False
    try:
        age = time.time() - entry.lstat().st_mtime
    except OSError:
        return False
    return age > STALE_UNLOCKED_S and _unlocked(entry)


def sweep_stale(directory: str | os.PathLike, prefix: str = ".") -> list[Path]:
    """Remove the temps in `directory` (names starting with `prefix`) whose writers were killed; returns them.

    With the default prefix (any temp of the folder) only tempfile's names count (8 random characters).

    Temp files (``.<name>.<pid>.<random>.tmp``) and temp folders (``.<name>.<pid>.<random>``) go when
    their pid is not running; a temp file also when no one has held its lock for a while (its pid was reused).
    Destination locks (``.<name>.lock``) go when no writer holds them.
    """
    directory = Path(directory)
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        if _LOCK.fullmatch(entry.name):
            if _remove_unheld_lock(entry):
                removed.append(entry)
            continue
        m = _TEMP.fullmatch(entry.name)
        if m is None or (prefix == "." and not _TEMPFILE_RANDOM.fullmatch(m.group("random"))):
            continue
        is_dir = entry.is_dir() and not entry.is_symlink()
        is_file = entry.is_file() and not entry.is_symlink()
        if not (is_file and m.group("tmp")) and not (is_dir and not m.group("tmp")):
            continue
        if not _writer_gone(entry, int(m.group("pid")), is_file):
            continue
        if is_dir:
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        removed.append(entry)
    return removed


def temp_prefix(path: Path) -> str:
    """The prefix of this process's temp names for `path` (``.<name>.<pid>.``)."""
    return f".{path.name}.{os.getpid()}."


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode(path: Path, default: int = 0o666) -> int:
    """The mode a file written to `path` should get: the existing file's, else `default` less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return default & ~current_umask()


def resolve_destination(path: str | os.PathLike) -> Path:
    """The file a write to `path` replaces: `path` itself, or, for a symbolic link, its target (written through)."""
    path = Path(path)
    if path.is_symlink():
        return Path(os.path.realpath(path))
    return path


@contextlib.contextmanager
def destination_lock(path: Path, wait: bool = False) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside `path` exclusively while a write to `path` runs.

    Raises:
        DestinationBusyError: another process holds it (and `wait` is False).
    """
    lock = path.parent / f".{path.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            if not _lock_now(fd, wait):
                holder = os.pread(fd, 64, 0).removeprefix(_LOCK_TAG).decode(errors="replace").strip() or "?"
                raise DestinationBusyError(
                    f"{path} is being written by another process (pid {holder}): wait for it "
                    "to finish, or write elsewhere"
                )
            st, mine = _stat_or_none(lock), os.fstat(fd)
            if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                break  # else the previous holder removed it between our open and our lock: take a fresh one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _LOCK_TAG + f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()  # still held: a waiter that opened it sees it is gone and takes a fresh one
        os.close(fd)


def _lock_now(fd: int, wait: bool) -> bool:
    """Lock `fd` exclusively: waiting, or else trying for 0.1 s (a sweeper holds a lock file for microseconds)."""
    if wait:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    for _ in range(20):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.005)
    return False


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, wait: bool = False) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` on success.

    On an exception (KeyboardInterrupt and SystemExit included) the temporary file is
    removed and the target is left untouched. Temps of killed writers in the folder are swept
    first. A symbolic link at `path` is written through (its target is replaced).

    Args:
        wait: when another process is writing `path`, wait for it instead of raising
            `DestinationBusyError` (for caches, which any process may write).
    """
    path = resolve_destination(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(path, wait=wait):
        sweep_stale(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
        tmp_path = Path(tmp)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while the temp exists: a sweeper sees a live writer
            yield tmp_path
            os.chmod(tmp_path, new_file_mode(path))  # after the writes: a read-only mode would refuse them
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp_path, path)
            fsync_dir(path.parent)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = str(path)  # a full disk while writing names the file, not just "[Errno 28]"
            raise
        finally:
            os.close(fd)


def make_temp_dir(parent: Path, name: str) -> Path:
    """A temp folder ``.<name>.<pid>.<random>`` in `parent` (swept when its writer dies), with the mode the
    umask gives a new folder (not ``mkdtemp``'s 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(parent / name), dir=parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, wait: bool = False) -> None:
    """Write `data` to `path` atomically."""
    with atomic_path(path, wait=wait) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, wait: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"), wait=wait)
