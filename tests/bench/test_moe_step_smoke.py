"""``benchmarks/moe_step.py`` on the CPU at the tiny preset's sizes (times mean nothing): the layer
check passes and every variant trains and is reported."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_step.py"


def test_moe_step_tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--tiny", "--device", "cpu", "--steps", "2", "--out", str(tmp_path)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "moe_step.json").read_text())
    assert result["layer_check"]["ok"]
    assert set(result["variants"]) == {"dense", "moe", "moe_loop", "moe_engram_rho0.5", "moe_engram_big"}
    assert all(v["tokens_per_s"] > 0 for v in result["variants"].values())
    dense, moe = result["variants"]["dense"]["params"], result["variants"]["moe"]["params"]
    assert abs(dense["active"] - moe["active"]) < 0.01 * moe["active"] and moe["total"] > dense["total"]
    assert result["sweep_estimates"]["allocation_2_seeds_min"] > 0
