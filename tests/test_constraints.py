"""constraints.txt pins every dependency exactly, and the install scripts use it: a fresh clone
installs the versions the suite was last run with, whatever has been released since."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def pinned() -> dict[str, str]:
    """constraints.txt as {normalised name: exact version}; fails on any line that is not `name==version`."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.!]*)", line.strip())
        assert match, f"constraints.txt: {line!r} is not an exact pin (name==version, no local label)"
        pins[_name(match.group(1))] = match.group(2)
    return pins


def test_every_dependency_and_extra_is_pinned_exactly():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = list(pyproject["project"]["dependencies"]) + list(pyproject["build-system"]["requires"])
    for requirements in pyproject["project"]["optional-dependencies"].values():
        wanted += [r for r in requirements if not r.startswith("condmem[")]
    pins = pinned()
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert not missing, f"constraints.txt lacks {missing}"


def test_the_install_script_installs_torch_and_condmem_under_the_pins():
    env = (ROOT / "scripts" / "_env.sh").read_text()
    assert 'CONSTRAINTS="${CONDMEM_CONSTRAINTS:-constraints.txt}"' in env
    assert 'export PIP_CONSTRAINT="$pins"' in env  # reaches the isolated build too
    assert "torch==$pinned_torch" in env  # the first torch comes from the pins, not the newest release
    assert "scripts/_env.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_says_how_to_install_with_and_without_the_pins():
    readme = (ROOT / "README.md").read_text()
    for words in ("constraints.txt", "CONDMEM_CONSTRAINTS=none", "scripts/test --latest", "scripts/lock"):
        assert words in readme, words
