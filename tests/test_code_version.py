"""`code_commit`: the commit a result was produced by, in a checkout, in a `git archive` copy (the
device machines' snapshots), and never another repository's HEAD."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from condmem.utils import code_version

ROOT = Path(__file__).resolve().parents[1]
FILE = "src/condmem/utils/code_version.py"


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


needs_checkout = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and this tree's checkout"
)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"code_version_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_checkout
def test_a_checkout_names_its_head():
    code_version.code_commit.cache_clear()
    commit = code_version.code_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    assert commit.removesuffix("+dirty") == _git("rev-parse", "HEAD")


@needs_checkout
def test_a_git_archive_carries_its_commit(tmp_path):
    archive = subprocess.run(["git", "archive", "HEAD", FILE], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    copied = _load(tmp_path / FILE)
    assert copied.code_commit() == _git("rev-parse", "HEAD")


@needs_checkout
def test_a_copy_inside_another_repository_does_not_take_its_head(tmp_path):
    # negative control: the outer repository's HEAD is not this code's commit
    _git("init", "-q", cwd=tmp_path)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "outer", cwd=tmp_path)
    inner = tmp_path / "copy" / FILE
    inner.parent.mkdir(parents=True)
    shutil.copy(ROOT / FILE, inner)
    assert _load(inner).code_commit() is None


def test_the_short_form_keeps_seven_digits_and_the_dirty_mark(monkeypatch):
    monkeypatch.setattr(code_version, "code_commit", lambda: "a" * 40 + "+dirty")
    assert code_version.short_commit() == "aaaaaaa+dirty"
    monkeypatch.setattr(code_version, "code_commit", lambda: "b" * 40)
    assert code_version.short_commit() == "bbbbbbb"
    monkeypatch.setattr(code_version, "code_commit", lambda: None)
    assert code_version.short_commit() is None
