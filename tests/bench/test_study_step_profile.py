"""The study-step probe's kernel attribution (`kernel_sources`): each kernel's launching ops, on events
shaped as torch.profiler's, and on a real CPU profile (whose events have the attributes it reads)."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import torch

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "study_step_profile.py"


def _event(name, parent=None, kernels=(), device="CPU"):
    return SimpleNamespace(
        name=name, cpu_parent=parent, device_type=SimpleNamespace(name=device), kernels=list(kernels)
    )


def test_kernels_are_placed_under_the_ops_that_launched_them():
    kernel_sources = runpy.run_path(str(PROBE))["kernel_sources"]
    kernel = lambda name, us: SimpleNamespace(name=name, duration=us)  # noqa: E731
    backward = _event("autograd::engine::evaluate_function: SumBackward1")
    sums = _event("aten::sum", backward, [kernel("reduce_kernel", 300.0), kernel("reduce_kernel", 300.0)])
    fill = _event("aten::fill_", _event("aten::zeros"), [kernel("FillFunctor", 900.0)])
    events = [backward, sums, fill, _event("cudaLaunchKernel"), _event("gpu", device="CUDA", kernels=[kernel("x", 1)])]
    out = kernel_sources(events, steps=3)
    assert list(out) == ["FillFunctor", "reduce_kernel"]  # the longest first
    assert out["reduce_kernel"] == {"aten::sum < autograd::engine::evaluate_function: SumBackward1": 600 / 1e3 / 3}
    assert out["FillFunctor"] == {"aten::fill_ < aten::zeros": 900 / 1e3 / 3}
    # torch.profiler's own events carry what it reads (no GPU here: no kernels, nothing placed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8).sum()
    assert kernel_sources(prof.events(), steps=1) == {}


def test_idle_gaps_count_only_time_no_activity_covers():
    idle_gaps = runpy.run_path(str(PROBE))["idle_gaps"]
    spans = [
        (0.0, 10.0, "a"),
        (5.0, 20.0, "b"),  # overlaps a (another stream): no gap
        (21.0, 30.0, "c"),  # 1 us after b
        (22.0, 25.0, "d"),  # inside c
        (60.0, 70.0, "e"),  # 30 us after c, not after d
        (70.0, 80.0, "f"),  # back to back
        (380.0, 400.0, "g"),  # 300 us after f
    ]
    out = idle_gaps(spans[::-1], steps=2)  # any order
    assert out["ms_per_step"] == (1 + 30 + 300) / 1e3 / 2
    assert [g["us"] for g in out["largest"]] == [300.0, 30.0, 1.0]
    assert out["largest"][1] == {"us": 30.0, "after": "c", "before": "e"}
    sizes = {k: v["per_step"] for k, v in out["by_size"].items()}
    assert sizes == {"0-2 us": 0.5, "2-5 us": 0.0, "5-20 us": 0.0, "20-100 us": 0.5, "100-inf us": 0.5}
    assert out["by_size"]["100-inf us"]["ms_per_step"] == 0.15
    assert idle_gaps([], steps=1)["ms_per_step"] == 0.0


def test_kernel_families_count_our_grouped_gemm_kernel_as_gemm():
    kernel_kind = runpy.run_path(str(PROBE))["kernel_kind"]
    assert kernel_kind("_weight_grad") == "gemm"
    assert kernel_kind("triton_poi_fused_index_select_0") == "index / gather / scatter"


def test_host_phases_split_the_hosts_time_and_unwrap_after():
    import numpy as np

    from condmem.models import DecoderLM
    from condmem.models.config import ModelConfig
    from condmem.train.data import TokenStream
    from condmem.train.loop import TrainConfig, Trainer

    host_phases = runpy.run_path(str(PROBE))["host_phases"]
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=16)
    tokens = TokenStream(np.arange(4 * 16 * 8 + 1, dtype=np.int32) % 64, 0)
    tc = TrainConfig(steps=6, batch_size=4, seq_len=16, warmup_steps=1, eval_tokens=16, log_every=100)
    trainer = Trainer(DecoderLM(cfg, seed=0), tc, tokens, tokens, np.ones(64), "cpu", progress=False)
    out = host_phases(trainer, 0, 3)["host_ms_per_step_by_phase"]
    assert {"forward", "backward", "clip", "optimizer step", "zero_grad", "rest", "total"} <= set(out)
    assert abs(sum(v for k, v in out.items() if k != "total") - out["total"]) < 1e-9
    assert all(v > 0 for k, v in out.items() if k != "rest")
    # the wrappers are gone: the class's methods and the module's function again
    assert "step" not in vars(trainer.adamw) and "loss" not in vars(trainer.model)
    assert torch.Tensor.backward.__name__ == "backward"
    trainer.queue_step(3)
