"""What docs/huggingface.md and the extras say agrees with what is installed and tested."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_hf_page_states_the_torch_ci_installs_and_the_installed_transformers():
    transformers = pytest.importorskip("transformers")
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "_env.sh").read_text()).group(1)
    page = (ROOT / "docs" / "huggingface.md").read_text()
    tested = page[page.index("Tested with") : page.index("## Example")]
    assert f"torch {pinned}" in tested, tested
    import torch

    if torch.__version__.split("+")[0] == pinned:  # CI's environment: the transformers it installs is named
        assert f"transformers {transformers.__version__}" in tested, tested


def test_dev_extra_holds_every_feature_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    included = {e for req in extras["dev"] if req.startswith("condmem[") for e in req[8:-1].split(",")}
    assert included == set(extras) - {"dev"}
