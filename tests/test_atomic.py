"""Atomic writes: modes kept (or the umask's), symbolic links written through, one writer per destination,
temps and locks of killed writers swept by the next write in the folder (and only those)."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from condmem.utils import atomic
from condmem.utils.atomic import (
    DestinationBusyError,
    atomic_path,
    atomic_write_text,
    sweep_stale,
)

ATOMIC_PY = Path(atomic.__file__)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_new_files_take_the_umask_and_replaced_files_keep_their_mode(tmp_path, umask):
    umask(0o022)
    atomic_write_text(tmp_path / "a.txt", "x")
    assert _mode(tmp_path / "a.txt") == 0o644
    umask(0o077)
    atomic_write_text(tmp_path / "b.txt", "x")
    assert _mode(tmp_path / "b.txt") == 0o600
    os.chmod(tmp_path / "a.txt", 0o640)
    atomic_write_text(tmp_path / "a.txt", "y")
    assert _mode(tmp_path / "a.txt") == 0o640 and (tmp_path / "a.txt").read_text() == "y"
    os.chmod(tmp_path / "a.txt", 0o444)  # read-only: still replaced (the folder is writable), still read-only
    atomic_write_text(tmp_path / "a.txt", "z")
    assert _mode(tmp_path / "a.txt") == 0o444 and (tmp_path / "a.txt").read_text() == "z"


def test_temp_folders_take_the_umask(tmp_path, umask):
    umask(0o027)
    assert _mode(atomic.make_temp_dir(tmp_path, "step-1")) == 0o750


def test_a_symlink_is_written_through(tmp_path):
    target = tmp_path / "real" / "t.txt"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "real" / "later.txt")
    atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "real" / "later.txt").read_text() == "made"


def test_a_second_writer_of_one_destination_is_refused(tmp_path):
    dst = tmp_path / "out.bin"
    with atomic_path(dst) as tmp:
        tmp.write_bytes(b"first")
        with pytest.raises(DestinationBusyError, match=rf"{dst}.*pid {os.getpid()}"), atomic_path(dst):
            pass
        atomic_write_text(tmp_path / "other.txt", "another destination is free")
    assert dst.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "out.bin"], "no lock file left"


def test_a_waiting_writer_goes_after_the_first(tmp_path):
    dst = tmp_path / "cache.bin"
    order = []

    def second():
        atomic_write_text(dst, "second", wait=True)
        order.append("second")

    with atomic_path(dst) as tmp:
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive(), "the second writer must wait"
        tmp.write_bytes(b"first")
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"] and dst.read_text() == "second"


def _killed_writer(tmp_path: Path, name: str) -> None:
    """A writer SIGKILLed inside atomic_path (the module alone: no torch to import)."""
    script = (
        f"import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('atomic', {str(ATOMIC_PY)!r})\n"
        f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"with m.atomic_path({str(tmp_path / name)!r}) as tmp:\n"
        f"    tmp.write_bytes(b'x' * 4096)\n"
        f"    print('ready', flush=True)\n"
        f"    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_temps_of_a_killed_writer_are_swept_by_a_write_to_another_name(tmp_path):
    _killed_writer(tmp_path, "big.safetensors")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith(".tmp") for n in left) and ".big.safetensors.lock" in left, left
    atomic_write_text(tmp_path / "other.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]


def test_only_temps_of_gone_writers_are_swept(tmp_path):
    dead = tmp_path / f".a.bin.{_dead_pid()}.abcdefgh.tmp"
    live = tmp_path / f".b.bin.{os.getpid()}.abcdefgh.tmp"  # this process: alive, but it holds no lock
    reused_old = tmp_path / ".c.bin.1.abcdefgh.tmp"  # pid 1 runs, the temp is unlocked and old: pid reused
    locked_old = tmp_path / f".d.bin.{os.getpid()}.ijklmnop.tmp"
    dead_dir = tmp_path / f".step-0000003.{_dead_pid()}.qrstuvwx"
    unrelated = [
        tmp_path / ".hidden.1.2",
        tmp_path / "plain.123.abcdefgh.tmp",
        tmp_path / ".other-tool.lock",
        tmp_path / f".short.{_dead_pid()}.abc.tmp",
    ]
    for p in (dead, live, reused_old, locked_old, *unrelated):
        p.write_bytes(b"x")
    dead_dir.mkdir()
    user_folder = tmp_path / f".user-folder.{_dead_pid()}.abc"  # not tempfile's random part: never removed
    user_folder.mkdir()
    unrelated.append(user_folder)
    past = time.time() - 3600
    for p in (reused_old, locked_old):
        os.utime(p, (past, past))
    fd = os.open(locked_old, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        removed = sorted(p.name for p in sweep_stale(tmp_path))
    finally:
        os.close(fd)
    assert removed == sorted([dead.name, reused_old.name, dead_dir.name])
    assert live.exists() and locked_old.exists() and all(p.exists() for p in unrelated)
