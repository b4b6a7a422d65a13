"""docs/quickstart.md runs as written: its python blocks, in order, in one session, on a CPU.

A block whose first line is ``# needs a GPU`` is skipped here (and run by the GPU suite).
Each block stays within the page's promise of at most 20 lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
GPU_MARK = "# needs a GPU"


def python_blocks(text: str) -> list[str]:
    """The bodies of the page's ```python fences, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_the_page_has_its_four_steps_each_within_twenty_lines():
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 4
    for block in blocks:
        assert len(block.strip().splitlines()) <= 20, block


def test_python_blocks_are_found_and_a_broken_one_fails():
    # Negative control: the extraction finds a block, and running a wrong one raises.
    blocks = python_blocks("text\n```python\nraise ValueError('x')\n```\nmore\n")
    assert blocks == ["raise ValueError('x')\n"]
    with pytest.raises(ValueError):
        exec(compile(blocks[0], "block", "exec"), {})


@pytest.mark.slow  # ~35 s on 2 shared cores: a tokenizer, 10 training steps, save, reload, generate
def test_every_python_block_of_the_quickstart_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import torch

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "quickstart"}
    for i, block in enumerate(python_blocks(PAGE.read_text())):
        if block.startswith(GPU_MARK) and not torch.cuda.is_available():
            continue
        exec(compile(block, f"{PAGE.name} block {i + 1}", "exec"), namespace)
    assert "out_host" in namespace  # the last step ran
