"""The library stands apart from its applications: no module of condmem outside `condmem.apps`
and `condmem.cli` imports `condmem.apps` (lazy imports inside functions included), and the
applications never import the command line."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "condmem"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folders_excluded: tuple[str, ...], forbidden: str, within: Path = SRC) -> list[str]:
    found = []
    for path in sorted(within.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in folders_excluded:
            continue
        hits = sorted(m for m in _imported_modules(path) if m == forbidden or m.startswith(forbidden + "."))
        if hits:
            found.append(f"{rel}: {', '.join(hits)}")
    return found


def test_the_library_never_imports_the_applications():
    offenders = _offenders(("apps", "cli"), "condmem.apps")
    assert not offenders, "library modules importing condmem.apps:\n" + "\n".join(offenders)


def test_the_applications_never_import_the_command_line():
    offenders = _offenders((), "condmem.cli", within=SRC / "apps")
    assert not offenders, "application modules importing condmem.cli:\n" + "\n".join(offenders)


def test_the_applications_are_where_the_cli_finds_them():
    for module in ("demo.py", "plots.py", "study/sweep.py", "study/config.py", "study/runs.py", "study/stats.py"):
        assert (SRC / "apps" / module).is_file(), module
    for gone in ("demo.py", "plots.py", "study.py", "study_config.py", "study_runs.py", "study_stats.py"):
        assert not (SRC / "train" / gone).exists(), f"train/{gone} belongs to condmem.apps"
