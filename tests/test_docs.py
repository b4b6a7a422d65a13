"""The documentation reads as guides and its links resolve.

* The user guides named in `GUIDES` stay under `GUIDE_MAX_BYTES` and hold no dated
  measurement: no date (YYYY-MM-DD) and no commit id; measurements live in
  docs/benchmarks.md with their date, commit and command.
* Every relative link of README.md and docs/*.md names a file of the repository and, with
  ``#anchor``, a heading of that file (GitHub's slugs).
* Every ``condmem.<module>[.<name>]`` the pages name in code spans is a module of the package,
  or a name its source defines or imports.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = ["docs/training.md", "docs/huggingface.md"]
GUIDE_MAX_BYTES = 12_000
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A commit id: 7 to 40 hex digits with at least one digit and one letter (not a word, not a number).
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def dated_measurements(text: str) -> list[str]:
    """The dates and commit ids in `text`, outside code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return DATE.findall(prose) + COMMIT.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def names_resolve(name: str) -> bool:
    """`name` (``condmem.a.b``) is a module, the native extension (named in `native/toolchain.py`, and
    absent from a tree that was never built), or its longest module prefix's source names what follows."""
    toolchain = (ROOT / "src/condmem/native/toolchain.py").read_text()
    if re.search(rf"^MODULE = [\"']{re.escape(name)}[\"']", toolchain, re.M):
        return True
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:k]))
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            if k == len(parts):
                return True
            origin = spec.origin or ""
            return origin.endswith(".py") and re.search(rf"\b{parts[k]}\b", Path(origin).read_text()) is not None
    return False


def unknown_modules(page: Path) -> list[str]:
    return sorted(
        n for n in set(re.findall(r"`(condmem(?:\.[A-Za-z_]\w*)+)", page.read_text())) if not names_resolve(n)
    )


@pytest.mark.parametrize("name", GUIDES)
def test_user_guides_are_short_and_hold_no_dated_measurement(name):
    text = (ROOT / name).read_text()
    assert len(text.encode()) < GUIDE_MAX_BYTES, (
        f"{name}: {len(text.encode()):,} bytes; move measurements to benchmarks.md"
    )
    assert not dated_measurements(text), f"{name} holds dates or commits {dated_measurements(text)}: benchmarks.md's"


def test_the_rules_catch_a_dated_measurement_and_a_broken_link(tmp_path):
    # Negative controls: a measurement sentence as the guides held them, and links that lead nowhere.
    old = "Cost, on an H100 on 2026-12-06 at f38cbf2: 3.57 ms."
    assert dated_measurements(old) == ["2026-12-06", "f38cbf2"]
    assert not dated_measurements("sha256 per file, 0.98x of HBM, deadbeefs and 1234567 tokens")
    (tmp_path / "a.md").write_text(
        "# A title\n\n[ok](#a-title) [gone](b.md) [bad](a.md#nowhere) [web](https://x.y/z)\n"
    )
    assert broken_links(tmp_path / "a.md") == ["b.md (no such file)", "a.md#nowhere (no such heading)"]
    (tmp_path / "b.md").write_text("`condmem.models.serving` and `condmem.serving.EngramMemory`, `condmem.sizing`\n")
    assert unknown_modules(tmp_path / "b.md") == ["condmem.models.serving"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_condmem_module_a_page_names_exists(page):
    assert not unknown_modules(page), unknown_modules(page)
