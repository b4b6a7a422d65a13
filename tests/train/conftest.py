"""A tiny real corpus (a few standard-library modules) and its prepared data, shared by the train tests."""

from __future__ import annotations

import shutil

import pytest
import torch

from condmem.train.data import stdlib_dir

MODULES = [
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "colorsys.py",
    "keyword.py",
    "fnmatch.py",
    "glob.py",
    "shlex.py",
    "this.py",
    "getopt.py",
    "copy.py",
]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one intra-op thread is faster and immune to a busy machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in MODULES:
        src = stdlib_dir() / name
        if src.is_file():
            shutil.copy(src, root / name)
    (root / "notes.txt").write_text("Engram: hashed n-gram memory. Héllo wörld, 你好.\n" * 20, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_data(tiny_corpus, tmp_path_factory):
    from condmem.train.pipeline import prepare_data

    return prepare_data(
        str(tiny_corpus), vocab_size=320, val_fraction=0.2, seed=0, cache_dir=tmp_path_factory.mktemp("cache")
    )
