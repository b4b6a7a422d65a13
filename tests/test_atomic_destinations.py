"""Where the atomic writer may write: regular files only, symbolic links followed by one rule, a run's
outputs kept inside its folder.

A destination that is a character device, a FIFO, a socket or a directory, or a link to one, is
refused with an error naming the path and its kind, and the node is left as it was (same mode,
device number and inode); a link planted inside ``--out`` that leads out of it is refused; a new
file takes the umask, never an old node's mode. Checked at the writer (`atomic_path`) and through
``condmem convert``, ``condmem train`` (its claim of ``--out``, its checkpoints and run lock) and
``condmem study``. Device nodes are private copies (``mknod`` in the test's folder); the one link to
the real ``/dev/null`` runs under a guard that fails the test before any rename could reach ``/dev``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import sysconfig
from pathlib import Path

import pytest

from condmem.cli import main
from condmem.utils import atomic, preflight
from condmem.utils.atomic import DestinationError, atomic_path, atomic_write_text
from condmem.utils.run_lock import RunLock

KINDS = {
    "chardev": "a character device",
    "fifo": "a FIFO",
    "socket": "a socket",
    "directory": "a directory",
    "link-to-fifo": "a FIFO",
    "link-to-chardev": "a character device",
    "link-to-dev-null": "a character device",
}


def _ident(path: Path) -> tuple:
    st = os.lstat(path)
    return (st.st_mode, st.st_rdev, st.st_ino, st.st_dev)


def _private_null(folder: Path) -> Path:
    """A character device 1:3 (what /dev/null is) in `folder`: a write that replaced it harms nothing."""
    node = folder / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod of a character device is not permitted here")
    os.chmod(node, 0o666)
    return node


def _make(kind: str, folder: Path) -> Path:
    """The node a test writes onto, as `folder/node` (a link to it for the ``link-to-*`` kinds)."""
    path = folder / "node"
    if kind == "chardev":
        return _private_null(folder).rename(path)
    if kind in ("fifo", "link-to-fifo"):
        fifo = folder / ("fifo" if kind == "link-to-fifo" else "node")
        os.mkfifo(fifo)
        os.chmod(fifo, 0o666)  # world-writable: the mode a replaced table used to inherit
        if kind == "fifo":
            return path
        path.symlink_to(fifo)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("kept")
    elif kind == "link-to-chardev":
        path.symlink_to(_private_null(folder))
    elif kind == "link-to-dev-null":
        path.symlink_to("/dev/null")
    return path


def _fingerprint(folder: Path) -> dict:
    """Every entry of `folder` (and what its links point at) by identity: a replaced node changes it."""
    seen = {p.name: _ident(p) for p in folder.iterdir()}
    for p in folder.iterdir():
        if p.is_symlink():
            seen[f"{p.name} ->"] = _ident(Path(os.path.realpath(p)))
    return seen


@pytest.fixture
def dev_guard(monkeypatch):
    """Fail the test, before it happens, if a rename would land in /dev (a writer that lost its check)."""
    real_replace = os.replace

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        where = (
            os.readlink(f"/proc/self/fd/{dst_dir_fd}")
            if dst_dir_fd is not None
            else os.path.dirname(os.path.realpath(dst))
        )
        if where == "/dev" or where.startswith("/dev/"):
            raise AssertionError(f"a rename onto {dst} in {where}: the writer would replace a device")
        return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "replace", replace)
    before = _ident(Path("/dev/null"))
    yield
    assert _ident(Path("/dev/null")) == before and stat.S_ISCHR(before[0])


@pytest.fixture
def old_writer(monkeypatch):
    """The writer as it was: no kind or folder check, the mode of whatever the path names copied."""

    def old_new_file_mode(path, default=0o666):
        try:
            return stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            return default & ~atomic.current_umask()

    monkeypatch.setattr(atomic, "_refuse_non_regular", lambda *a, **k: None)
    monkeypatch.setattr(atomic, "_refuse_outside", lambda *a, **k: None)
    monkeypatch.setattr(atomic, "new_file_mode", old_new_file_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _small_table(folder: Path) -> Path:
    import torch

    from condmem import EngramConfig, EngramLayout
    from condmem.tables.table_file import LayerRows, write_table_file

    layout = EngramLayout(
        EngramConfig(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, table_size=500, compressed_vocab_size=50)
    )
    rows = torch.randn(layout.num_embeddings[0], 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return write_table_file(folder / "src.safetensors", layout, "bf16", {1: [LayerRows("bf16", rows)]})


# ----------------------------------------------------------------------------- the writer


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_writer_refuses_anything_but_a_regular_file(tmp_path, kind, request):
    if kind == "link-to-dev-null":
        request.getfixturevalue("dev_guard")
    node = _make(kind, tmp_path)
    before = _fingerprint(tmp_path)
    ran = []
    with pytest.raises(DestinationError, match=rf"^{re.escape(str(node))}.*: is {KINDS[kind]}.*not a regular file"):
        with atomic_path(node) as tmp:
            ran.append(tmp)
    assert not ran, "refused before anything is written"
    assert _fingerprint(tmp_path) == before, "the node untouched; no temp or lock file left"
    with pytest.raises(DestinationError, match=f"{KINDS[kind]}|outside"):  # /dev/null: outside the folder too
        atomic_write_text(node, "x", within=tmp_path)
    assert _fingerprint(tmp_path) == before


@pytest.mark.parametrize("kind", ["chardev", "fifo", "link-to-chardev"])
def test_negative_control_the_old_writer_replaced_the_node(tmp_path, kind, old_writer, umask):
    node = _make(kind, tmp_path)
    target = Path(os.path.realpath(node))
    before = _ident(target)
    atomic_write_text(node, "a table")
    assert _ident(target) != before and stat.S_ISREG(os.lstat(target).st_mode), "the node was replaced"
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o666, "and its world-writable mode copied"


def test_a_node_made_during_the_write_is_refused_at_the_rename(tmp_path):
    dst = tmp_path / "t.safetensors"
    with pytest.raises(DestinationError, match="became something else during the write: it is a FIFO"):
        with atomic_path(dst) as tmp:
            tmp.write_bytes(b"rows")
            os.mkfifo(dst)
    assert stat.S_ISFIFO(os.lstat(dst).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"], "the temp removed"


def test_links_to_regular_files_are_followed_and_new_files_take_the_umask(tmp_path, umask):
    real = tmp_path / "real"
    real.mkdir()
    kept = real / "kept.bin"
    kept.write_text("old")
    os.chmod(kept, 0o640)
    (tmp_path / "kept").symlink_to(kept)
    atomic_write_text(tmp_path / "kept", "new")
    assert (tmp_path / "kept").is_symlink() and kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o640
    (tmp_path / "dangling").symlink_to(real / "made.bin")
    atomic_write_text(tmp_path / "dangling", "made")
    assert stat.S_IMODE((real / "made.bin").stat().st_mode) == 0o644
    setuid = tmp_path / "tool"
    setuid.write_text("old")
    os.chmod(setuid, 0o4755)
    atomic_write_text(setuid, "new")
    assert stat.S_IMODE(setuid.stat().st_mode) == 0o755, "permission bits kept, the set-id bit not"


def test_a_new_file_never_takes_a_nodes_mode(tmp_path, umask, monkeypatch):
    fifo = _make("fifo", tmp_path)
    assert atomic.new_file_mode(fifo) == 0o644, "0666 less the umask, not the FIFO's 0666"
    monkeypatch.setattr(
        atomic, "new_file_mode", lambda path, default=0o666: stat.S_IMODE(os.stat(path).st_mode)
    )  # negative control: the old rule
    assert atomic.new_file_mode(fifo) == 0o666


# ----------------------------------------------------------------------------- a run's folder


def _run_folder(tmp_path: Path) -> tuple[Path, Path]:
    out, outside = tmp_path / "run", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (outside / "victim.json").write_text("precious")
    return out, outside


@pytest.mark.parametrize("plant", ["file-link", "dangling-link", "folder-link"])
def test_links_planted_in_the_run_folder_do_not_lead_writes_out(tmp_path, plant):
    out, outside = _run_folder(tmp_path)
    if plant == "file-link":
        (out / "summary.json").symlink_to(outside / "victim.json")
        dst = out / "summary.json"
    elif plant == "dangling-link":
        (out / "summary.json").symlink_to(outside / "new.json")
        dst = out / "summary.json"
    else:
        (out / "checkpoints").symlink_to(outside)
        dst = out / "checkpoints" / "LATEST"
    before = _fingerprint(outside)
    with pytest.raises(
        DestinationError,
        match=rf"^{re.escape(str(dst))}: resolves to {re.escape(str(outside))}.*outside {re.escape(str(out))}",
    ):
        atomic_write_text(dst, "x", within=out)
    assert _fingerprint(outside) == before and (outside / "victim.json").read_text() == "precious"


def test_negative_control_without_the_folder_check_the_write_lands_outside(tmp_path, old_writer):
    out, outside = _run_folder(tmp_path)
    (out / "summary.json").symlink_to(outside / "victim.json")
    atomic_write_text(out / "summary.json", "x", within=out)
    assert (outside / "victim.json").read_text() == "x"


def test_links_that_stay_inside_the_folder_and_a_linked_folder_are_written(tmp_path):
    big = tmp_path / "big" / "run"
    big.mkdir(parents=True)
    out = tmp_path / "run"
    out.symlink_to(big)  # --out itself a link (to a bigger disk): the user's choice
    (big / "real.json").write_text("old")
    (out / "alias.json").symlink_to(big / "real.json")
    atomic_write_text(out / "alias.json", "new", within=out)
    atomic_write_text(out / "summary.json", "made", within=out)
    assert (big / "real.json").read_text() == "new" and (big / "summary.json").read_text() == "made"


# ----------------------------------------------------------------------------- the commands


@pytest.mark.parametrize("kind", list(KINDS))
def test_convert_refuses_a_destination_that_is_not_a_regular_file(tmp_path, kind, capsys, request):
    if kind == "link-to-dev-null":
        request.getfixturevalue("dev_guard")
    src = _small_table(tmp_path)
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    node = _make(kind, nodes)
    before = _fingerprint(nodes)
    assert main(["convert", str(src), str(node), "--to", "fp8", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"dst {node}" in err and KINDS[kind] in err and "Traceback" not in err, err
    assert _fingerprint(nodes) == before


def test_negative_control_the_old_convert_replaced_a_fifo_with_a_world_writable_table(tmp_path, old_writer, umask):
    src = _small_table(tmp_path)
    node = _make("fifo", tmp_path)
    assert main(["convert", str(src), str(node), "--to", "fp8", "--no-progress"]) == 0
    assert stat.S_ISREG(os.lstat(node).st_mode) and stat.S_IMODE(os.lstat(node).st_mode) == 0o666


@pytest.mark.parametrize(
    ("plant", "match"),
    [("summary-fifo", "summary.json: is a FIFO"), ("summary-chardev", "is a character device")],
)
def test_train_refuses_a_summary_that_is_not_a_regular_file_before_training(tmp_path, plant, match, capsys):
    out = tmp_path / "run"
    out.mkdir()
    if plant == "summary-fifo":
        os.mkfifo(out / "summary.json")
    else:
        (out / "summary.json").symlink_to(_private_null(out))
    before = _fingerprint(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and "no checkpoint" not in err, err
    assert _fingerprint(out) == before | {".lock": _ident(out / ".lock")}, "only the run lock added"


def test_train_refuses_a_checkpoints_link_leading_out_of_the_run(tmp_path, capsys):
    out, outside = _run_folder(tmp_path)
    (out / "checkpoints").symlink_to(outside)
    (out / "summary.json").write_text("{}")
    assert main(["train", "--out", str(out), "--overwrite", "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"{out / 'checkpoints'}: resolves to {outside}" in err and "outside" in err, err
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"]


def test_the_run_lock_is_never_followed_out_of_the_run(tmp_path, capsys, monkeypatch):
    out, outside = _run_folder(tmp_path)
    (out / ".lock").symlink_to(outside / "victim.json")
    assert main(["train", "--out", str(out), "--no-progress", "--device", "cpu"]) == 1
    assert ".lock is a symbolic link" in capsys.readouterr().err
    assert (outside / "victim.json").read_text() == "precious"
    monkeypatch.setattr(os, "O_NOFOLLOW", 0)  # negative control: the lock as it was opened
    RunLock(out).acquire().release()
    assert (outside / "victim.json").read_text() == f"{os.getpid()}\n", "the lock truncated the file outside"


def test_the_output_probe_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    out, outside = _run_folder(tmp_path)
    probe = out / f"{atomic.temp_prefix(out / 'probe')}probe.tmp"
    probe.symlink_to(outside / "victim.json")
    with pytest.raises(preflight.OutputPathError, match="cannot write there"):
        preflight.check_output_dir(out, "--out")
    assert (outside / "victim.json").read_text() == "precious" and not probe.is_symlink()
    probe.symlink_to(outside / "victim.json")
    monkeypatch.setattr(os, "O_EXCL", 0)  # negative control: a probe opened as before
    monkeypatch.setattr(os, "O_NOFOLLOW", 0)
    preflight.check_output_dir(out, "--out")
    assert (outside / "victim.json").read_bytes() == b"\0" * 4096


def test_study_refuses_its_outputs_before_the_runs(tmp_path, capsys):
    out, outside = _run_folder(tmp_path)
    os.mkfifo(out / "study.json")
    (out / "allocation.png").symlink_to(outside / "figure.png")
    args = ["study", "allocation", "--preset", "tiny", "--out", str(out), "--no-progress", "--device", "cpu"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{out / 'study.json'}: is a FIFO" in err and "Traceback" not in err, err
    (out / "study.json").unlink()
    assert main(args) == 1
    assert f"{out / 'allocation.png'}: resolves to {outside / 'figure.png'}" in capsys.readouterr().err
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"]


# ----------------------------------------------------------------------------- checkpoints of a real run


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from condmem.train.pipeline import prepare_data

    corpus = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "heapq.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, corpus / name)
    return prepare_data(
        str(corpus), vocab_size=320, val_fraction=0.2, seed=0, cache_dir=tmp_path_factory.mktemp("cache")
    )


@pytest.mark.parametrize("plant", ["checkpoints", "LATEST"])
def test_a_checkpoint_save_refuses_links_leading_out_of_the_run(tiny_data, tmp_path, plant, monkeypatch):
    from tests.train.test_train import make_trainer

    out, outside = _run_folder(tmp_path)
    if plant == "checkpoints":
        (out / "checkpoints").symlink_to(outside)
    else:
        (out / "checkpoints").mkdir()
        (out / "checkpoints" / "LATEST").symlink_to(outside / "victim.json")
    trainer = make_trainer(tiny_data, steps=1, run_dir=out)  # saved at step 0: the save is what is tested
    with pytest.raises(DestinationError, match="outside"):
        trainer.save()
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"]
    assert (outside / "victim.json").read_text() == "precious"
    monkeypatch.setattr(atomic, "_refuse_outside", lambda *a, **k: None)  # negative control
    trainer.save()
    if plant == "checkpoints":
        assert (outside / "step-0000000").is_dir(), "without the check the checkpoint lands outside the run"
    else:
        assert (outside / "victim.json").read_text() == "step-0000000\n", "without the check LATEST is written outside"
