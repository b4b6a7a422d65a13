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
* **Regular files only**: a destination that exists and is not a regular file (a character or
  block device, a FIFO, a socket, a directory) is refused with `DestinationError`, naming the
  path and its kind, before anything is written; checked again just before the rename.
* **Symbolic links** (one rule): a link at the destination, or among its folders, is followed; the
  write replaces the regular file it resolves to (the link stays) or, for a dangling link, creates
  it. What a link resolves to is held to the rule above, so a link to a device or FIFO is refused.
* **Confinement**: with ``within=FOLDER`` (a run's ``--out``) the resolved destination must lie
  inside the resolved folder: a link planted inside it that leads out is refused
  (`DestinationError`). The rename happens in the folder that was checked (through its descriptor).
* **Modes**: a new file gets what the process's umask leaves of 0666 (not ``mkstemp``'s 0600); a
  regular file replaced keeps its permission bits (``0o777``: set-id and sticky bits are not copied).
  The mode of anything but a regular file is never copied.
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


class DestinationError(ValueError):
    """A destination the writer refuses: not a regular file, or (with ``within``) outside the folder."""


_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),  # after resolving: a loop, or one made during the write
)


def file_kind(mode: int) -> str:
    """``a character device``, ``a FIFO (named pipe)``, ... for an ``st_mode``."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "a regular file" if stat.S_ISREG(mode) else f"a file of type {stat.S_IFMT(mode):o}"


def _refuse_non_regular(st: os.stat_result | None, shown: Path, real: Path, when: str = "") -> None:
    """Raise `DestinationError` unless `st` (``lstat`` of the resolved destination) is None or a regular file."""
    if st is None or stat.S_ISREG(st.st_mode):
        return
    via = f" (a symbolic link to {real})" if os.path.abspath(shown) != str(real) else ""
    raise DestinationError(
        f"{shown}{via}: {when}is {file_kind(st.st_mode)}, not a regular file; condmem writes regular "
        "files only (a temp file renamed onto the name): choose a file path"
    )


def _refuse_outside(shown: Path, real: Path, within: str | os.PathLike | None) -> None:
    """Raise `DestinationError` unless `real` (resolved) lies inside `within` (resolved)."""
    if within is None:
        return
    root = Path(os.path.realpath(within))
    if real == root or not real.is_relative_to(root):
        raise DestinationError(
            f"{shown}: resolves to {real}, outside {within} (a symbolic link inside it leads out); "
            f"nothing is written outside {within}: remove the link"
        )


def check_destination(path: str | os.PathLike, *, within: str | os.PathLike | None = None) -> Path:
    """The file a write to `path` replaces or creates (every symbolic link resolved), checked.

    Raises:
        DestinationError: it exists and is not a regular file (a device, FIFO, socket, directory, a
            link loop), or, with `within`, it lies outside that folder (resolved).
    """
    shown = Path(path)
    real = Path(os.path.realpath(shown))
    _refuse_outside(shown, real, within)
    _refuse_non_regular(_stat_or_none(real), shown, real)
    return real


def check_inside(path: str | os.PathLike, within: str | os.PathLike) -> Path:
    """`path` resolved (a folder a writer fills, e.g. ``checkpoints/``); `DestinationError` if outside `within`."""
    real = Path(os.path.realpath(path))
    _refuse_outside(Path(path), real, within)
    return real


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
    """The mode a file written to `path` (resolved) gets: the permission bits of the regular file there,
    else `default` less the umask (never the mode of a device, FIFO or other node)."""
    st = _stat_or_none(path)
    if st is not None and stat.S_ISREG(st.st_mode):
        return stat.S_IMODE(st.st_mode) & 0o777
    return default & ~current_umask()


@contextlib.contextmanager
def destination_lock(path: Path, wait: bool = False) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside `path` exclusively while a write to `path` runs.

    Raises:
        DestinationBusyError: another process holds it (and `wait` is False).
    """
    lock = path.parent / f".{path.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            _refuse_non_regular(os.fstat(fd), lock, lock)
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


def _stat_or_none(path: str | os.PathLike, dir_fd: int | None = None) -> os.stat_result | None:
    """``lstat`` of `path` (relative to `dir_fd` when given), or None where nothing is there."""
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _same_file(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_folder(path: Path, within: str | os.PathLike | None, shown: Path) -> int:
    """A descriptor of the folder of `path` (resolved); with `within`, checked to be inside it as opened."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if within is not None:
            try:
                opened = Path(os.readlink(f"/proc/self/fd/{fd}"))  # what was opened, whatever the path holds now
            except OSError:
                opened = Path(os.path.realpath(path.parent))
            _refuse_outside(shown, opened / path.name, within)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, *, wait: bool = False, within: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` on success.

    On an exception (KeyboardInterrupt and SystemExit included) the temporary file is
    removed and the target is left untouched. Temps of killed writers in the folder are swept
    first. Symbolic links are followed (`check_destination`): the regular file they resolve to
    is replaced, the links stay.

    Args:
        wait: when another process is writing `path`, wait for it instead of raising
            `DestinationBusyError` (for caches, which any process may write).
        within: a folder the destination must resolve inside (a run's output folder).

    Raises:
        DestinationError: `path` is (or resolves to) anything but a regular file, before anything
            is written, or became one during the write; or it resolves outside `within`.
    """
    shown = Path(path)
    path = check_destination(shown, within=within)
    path.parent.mkdir(parents=True, exist_ok=True)
    dir_fd = _open_folder(path, within, shown)
    try:
        with destination_lock(path, wait=wait):
            sweep_stale(path.parent)
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
            tmp_path = Path(tmp)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held while the temp exists: a sweeper sees a live writer
                yield tmp_path
                # The name may have been replaced meanwhile (a FIFO made there): checked again.
                _refuse_non_regular(
                    _stat_or_none(path.name, dir_fd), shown, path, "became something else during the write: it "
                )
                os.chmod(tmp_path, new_file_mode(path))  # after the writes: a read-only mode would refuse them
                with open(tmp_path, "rb+") as fh:
                    os.fsync(fh.fileno())
                if not _same_file(_stat_or_none(tmp_path), _stat_or_none(tmp_path.name, dir_fd)):
                    raise DestinationError(f"{shown}: its folder {path.parent} was replaced during the write")
                os.replace(tmp_path.name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                with contextlib.suppress(OSError):
                    os.fsync(dir_fd)
            except BaseException as exc:
                with contextlib.suppress(FileNotFoundError):
                    tmp_path.unlink()
                if isinstance(exc, OSError) and exc.filename is None:
                    exc.filename = str(shown)  # a full disk while writing names the file, not just "[Errno 28]"
                raise
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


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


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, *, wait: bool = False, within: str | os.PathLike | None = None
) -> None:
    """Write `data` to `path` atomically (`atomic_path`)."""
    with atomic_path(path, wait=wait, within=within) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(
    path: str | os.PathLike, text: str, *, wait: bool = False, within: str | os.PathLike | None = None
) -> None:
    """Write `text` (UTF-8) to `path` atomically (`atomic_path`)."""
    atomic_write_bytes(path, text.encode("utf-8"), wait=wait, within=within)
