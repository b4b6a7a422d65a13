"""Every `from condmem... import name` in the package, including those inside functions (which
run only on some paths, e.g. GPU-only diagnostics), names something that exists. A rename
that misses one fails here on the CPU rather than on the GPU machine."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "condmem"


def _imports():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("condmem") and node.level == 0:
                for alias in node.names:
                    yield pytest.param(node.module, alias.name, id=f"{path.relative_to(SRC)}:{node.lineno}:{alias.name}")


@pytest.mark.parametrize("module, name", list(_imports()))
def test_imported_name_exists(module, name):
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        importlib.import_module(f"{module}.{name}")   # a submodule
