"""Static checks of the tree: `ruff format` applied, `ruff check` with the project's rules
(pyproject.toml: pyflakes' undefined names, unused imports and variables, pycodestyle's errors,
lines up to 120 characters), no function in `src/` over 100 lines, every `from condmem...
import name` resolving (also those inside functions that run only on a GPU), no package of
condmem importing a package that imports it back, no module importing one that imports it
back, however far round and wherever the import stands (inside a function too), and every
script with a ``#!`` line executable (scripts call each other directly)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "condmem"


def test_ruff_check_is_clean():
    pytest.importorskip("ruff")
    paths = [p for p in ("src", "tests", "benchmarks", "scripts", "examples") if (ROOT / p).exists()]
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_applied():
    pytest.importorskip("ruff")
    paths = [p for p in ("src", "tests", "benchmarks", "scripts", "examples") if (ROOT / p).exists()]
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, "run `ruff format src tests benchmarks scripts examples`\n" + done.stdout


MAX_FUNCTION_LINES = 100


def test_no_function_in_src_is_longer_than_a_screenful_or_two():
    # Long functions hide their steps; above ~80 lines a function says why at its top.
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _condmem_imports():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("condmem")
                and not node.level
            ):
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


def _module_name(path: Path, src: Path) -> str:
    parts = (src.name, *path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(src: Path) -> dict[str, set[str]]:
    """{module: the modules of the package at `src` it imports}, from every ``import`` and
    ``from ... import`` of each file, at its top or inside a function or class; relative imports
    resolved; a package stands for its ``__init__``, ``from package import submodule`` for the
    submodule."""
    paths = {_module_name(path, src): path for path in sorted(src.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for me, path in paths.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for name in names:
                target = known(name) if name.split(".")[0] == src.name else None
                if target and target != me:
                    edges[me].add(target)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of
    modules every one of which imports, however far round, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_module_imports_one_that_imports_it_back():
    """Modules stay layered: no import circle, lazy imports inside functions included (a lazy
    import hides a circle from Python, not from the design)."""
    edges = module_imports(SRC)
    cycles = import_cycles(edges)
    described = [
        " <-> ".join(c) + "\n  " + "\n  ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a] & set(c)))
        for c in cycles
    ]
    assert not cycles, "import cycles between modules:\n" + "\n".join(described)


def test_the_module_cycle_finder_finds_circles_through_lazy_and_relative_imports(tmp_path):
    """Negative control: a package whose modules close a circle only through a lazy import
    inside a function, a relative import and an import of a package's ``__init__``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import c\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("from .sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import os\n\n\ndef g():\n    import pkg.a\n")
    (pkg / "lone.py").write_text("import pkg\nfrom . import a\n")
    edges = module_imports(pkg)
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.sub.c"} and edges["pkg.sub.c"] == {"pkg.a"}
    assert edges["pkg.lone"] == {"pkg", "pkg.a"} and edges["pkg"] == {"pkg.sub.c"}
    assert import_cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    edges["pkg.sub.c"].clear()
    assert import_cycles(edges) == []
    assert import_cycles({"x": {"y"}, "y": {"x", "z"}, "z": {"w"}, "w": {"z"}}) == [["w", "z"], ["x", "y"]]


def test_only_triton_modules_need_triton():
    """The optional-Triton policy (`condmem.ops`): with Triton absent, every module imports but
    the kernel files (``triton.py``, ``*_triton.py``) and the benchmarks of those kernels
    (``bench/hash.py``, ``bench/gate.py``: `condmem bench` imports them only to run them)."""
    script = (
        "import importlib, pathlib, sys\n"
        "sys.modules['triton'] = None\n"
        f"src = pathlib.Path({str(SRC)!r})\n"
        "bad = []\n"
        "for p in sorted(src.rglob('*.py')):\n"
        "    kernel_bench = p.parent.name == 'bench' and p.stem in ('hash', 'gate')\n"
        "    kernel_file = p.stem in ('triton', '__main__') or p.stem.endswith('_triton')\n"
        "    if kernel_file or 'integrations' in p.parts or kernel_bench:\n"
        "        continue\n"
        "    name = '.'.join(('condmem',) + p.relative_to(src).with_suffix('').parts).removesuffix('.__init__')\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        if 'triton' in str(exc): bad.append(f'{name}: {exc}')\n"
        "print('\\n'.join(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip(), "modules that need Triton but are not kernel files:\n" + done.stdout


def test_every_script_with_a_shebang_is_executable():
    scripts = [
        path
        for folder in ("scripts", "benchmarks", ".ci")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in ("", ".sh", ".py") and path.read_bytes()[:2] == b"#!"
    ]
    assert scripts
    assert [str(p.relative_to(ROOT)) for p in scripts if not os.access(p, os.X_OK)] == []
