"""What docs/huggingface.md and the extras say agrees with constraints.txt, the versions the suite
is installed and run with (never with whatever release is newest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_constraints import pinned

ROOT = Path(__file__).resolve().parents[2]


def test_the_hf_page_names_the_pinned_torch_transformers_and_accelerate():
    page = (ROOT / "docs" / "huggingface.md").read_text()
    tested = page[page.index("Tested with") : page.index("## Example")]
    pins = pinned()
    for name in ("torch", "transformers", "accelerate"):
        assert f"{name} {pins[name]}" in tested, (name, pins[name], tested)


def test_dev_extra_holds_every_feature_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    included = {e for req in extras["dev"] if req.startswith("condmem[") for e in req[8:-1].split(",")}
    assert included == set(extras) - {"dev"}
