"""Static checks of the tree: ruff's pyflakes rules (undefined names, unused imports and
variables), every `from condmem... import name` resolving (also those inside functions that
run only on a GPU), and no package of condmem importing a package that imports it back."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "condmem"


def test_ruff_finds_no_undefined_or_unused_names():
    pytest.importorskip("ruff")
    paths = [p for p in ("src", "tests", "benchmarks", "scripts", "examples") if (ROOT / p).exists()]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", *paths],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _condmem_imports():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("condmem") and not node.level:
                yield path, node


def test_every_condmem_import_names_something_that_exists():
    missing = []
    for path, node in _condmem_imports():
        try:
            module = importlib.import_module(node.module)
        except ImportError as exc:
            if "triton" in str(exc) or "transformers" in str(exc):
                continue  # an optional dependency of that module
            missing.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.module} ({exc})")
            continue
        for alias in node.names:
            if not hasattr(module, alias.name):
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
                except ImportError:
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_package_imports_one_that_imports_it_back():
    """Layers stay layers: e.g. `ops` (kernels) never imports `tables` (storage), which uses `ops`."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path, node in _condmem_imports():
        me = path.relative_to(SRC).with_suffix("").parts[0]
        targets = [f"{node.module}.{a.name}" for a in node.names] if node.module == "condmem" else [node.module]
        for target in targets:
            unit = _unit(target)
            if unit and unit != me and ((SRC / unit).is_dir() or (SRC / f"{unit}.py").exists()):
                edges[me].add(unit)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v == goal:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(edges.get(v, ()))
        return False

    cycles = sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if reaches(b, a))
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)
