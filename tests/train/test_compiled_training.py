"""Compiled training (`TrainConfig.compile`): the MoE traces without data-dependent shapes or
host counters, counts exactly, and a compiled run's losses follow the eager run's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from condmem.config import EngramConfig
from condmem.models import DecoderLM
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.moe import MoE, RouterStats, expert_counts
from condmem.train.data import TokenStream
from condmem.train.determinism import deterministic_mode
from condmem.train.loop import TrainConfig, Trainer
from tests.helpers import devices


def test_expert_counts_traced_equal_bincount_with_no_graph_break():
    experts = torch.randint(0, 7, (513, 2))
    traced = torch.compile(expert_counts, backend="eager", fullgraph=True)  # fullgraph: a break fails
    torch._dynamo.reset()
    assert torch.equal(traced(experts, 7), torch.bincount(experts.flatten(), minlength=7))
    assert torch.equal(expert_counts(experts, 7), torch.bincount(experts.flatten(), minlength=7))


def test_a_traced_moe_forward_equals_eager_and_keeps_its_statistics():
    torch.manual_seed(0)
    eager, traced = MoE(16, 6, 2, 8), MoE(16, 6, 2, 8)
    traced.load_state_dict(eager.state_dict())
    compiled = torch.compile(traced, backend="aot_eager")
    torch._dynamo.reset()
    for step in range(3):  # after the first (compiling) step, new counter values must not retrace the forward
        x = torch.randn(40, 16)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            y, y_traced = eager(x), compiled(x)
        torch.testing.assert_close(y_traced, y, rtol=1e-5, atol=1e-6)
        assert torch.equal(traced.expert_bias, eager.expert_bias)  # the bias moved the same way
    ours, theirs = traced.stats.summary(), eager.stats.summary()
    assert ours["tokens"] == theirs["tokens"] == 120 and ours["load"] == theirs["load"]


def _whole_graph_moe_run():
    torch.manual_seed(0)
    eager, traced = (MoE(16, 6, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    traced.load_state_dict(eager.state_dict())
    for m in (eager, traced):
        m.use_grouped_mm = True  # the per-expert loop splits by host offsets: a break of its own
    compiled = torch.compile(traced, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    for step in range(3):
        x = torch.randn(40, 16, dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            y, y_traced = eager(x), compiled(x)
        assert torch.equal(y_traced, y)  # aot_eager runs the same kernels
        assert torch.equal(traced.expert_bias, eager.expert_bias)
    assert traced.stats.summary() == eager.stats.summary()


def test_a_moe_training_forward_traces_as_one_graph_statistics_and_bias_included():
    """With grouped GEMMs, a training forward (routing, statistics, the balancing bias's update,
    dispatch, experts, combine) is one graph: `fullgraph` fails on any break."""
    _whole_graph_moe_run()


def test_the_whole_graph_check_fails_on_a_break(monkeypatch):
    # negative control: the statistics' update left out of the graph, as a host-side step
    monkeypatch.setattr(RouterStats, "update", torch.compiler.disable(RouterStats.update))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _whole_graph_moe_run()
    torch._dynamo.reset()


def _small_moe(engram: bool = False) -> tuple[ModelConfig, TokenStream, TokenStream]:
    """A two-block MoE (8 experts, top-2; an Engram in block 1 with `engram`) and its training and
    validation streams. The training stream repeats a 65-token sequence, so a loss can fall: uniform
    random tokens start at their entropy, ln 512."""
    layer = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=2,
        head_dim=16,
        table_size=997,
        hidden_size=64,
        compressed_vocab_size=512,
    )
    cfg = ModelConfig(
        engram=layer if engram else None,
        vocab_size=512,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        max_seq_len=64,
        moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=32),
    )
    rng = np.random.default_rng(0)
    period = rng.integers(0, 512, size=65)
    train = TokenStream(np.tile(period, 8 * 12 + 1)[: 8 * 64 * 12 + 1].astype(np.int32), 0)
    val = TokenStream(rng.integers(0, 512, size=4 * 64 + 1).astype(np.int32), 0)
    return cfg, train, val


@pytest.mark.parametrize(
    "engram, device",
    [
        pytest.param(False, "cuda", id="moe-cuda", marks=pytest.mark.gpu),
        pytest.param(True, "cuda", id="moe+engram-cuda", marks=pytest.mark.gpu),
        pytest.param(True, "cpu", id="moe+engram-cpu"),
    ],
)
def test_compiled_training_follows_eager_losses(engram, device):
    # with an Engram layer, compiled with its block but for the table read (`module._read_table`);
    # on the CPU too (Inductor's C++ kernels): CI compiles the layer's projection, gate and ShortConv
    cfg, train, val = _small_moe(engram)
    losses = {}
    for compile in (False, True):
        torch._dynamo.reset()
        model = DecoderLM(cfg, token_lookup=np.arange(512) if engram else None, seed=0, device=device)
        tc = TrainConfig(steps=10, batch_size=8, seq_len=64, warmup_steps=2, eval_tokens=64, log_every=100)
        trainer = Trainer(
            model, dataclasses.replace(tc, compile=compile), train, val, np.ones(512), device, progress=False
        )
        losses[compile] = [trainer.train_step(s)[0] for s in range(10)]
    # bf16 autocast either way; fused kernels round differently: the first loss (same weights) agrees to
    # bf16 noise, and the rounding then compounds over steps, so later losses follow the same curve only
    assert abs(losses[True][0] - losses[False][0]) < 5e-3, losses
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) < 0.15, losses
    assert losses[True][-1] < losses[True][0] - 0.1 and losses[False][-1] < losses[False][0] - 0.1, losses


def _train_compiled(n_experts: int, device: str, cuda_graphs: bool = False) -> tuple[list[float], int]:
    """Six compiled steps of a small MoE with `n_experts`: its losses, and the graphs compiled meanwhile."""
    cfg = ModelConfig(
        vocab_size=256,
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden=32,
        max_seq_len=32,
        moe=MoEConfig(n_experts=n_experts, top_k=2, expert_hidden=16),
    )
    rng = np.random.default_rng(0)
    train = TokenStream(np.tile(rng.integers(0, 256, size=33), 50)[: 4 * 32 * 8 + 1].astype(np.int32), 0)
    val = TokenStream(rng.integers(0, 256, size=4 * 32 + 1).astype(np.int32), 0)
    tc = TrainConfig(
        steps=6, batch_size=4, seq_len=32, warmup_steps=2, eval_tokens=32, log_every=100, compile=True,
        cuda_graphs=cuda_graphs,
    )  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    trainer = Trainer(DecoderLM(cfg, seed=0, device=device), tc, train, val, np.ones(256), device, progress=False)
    losses = [trainer.train_step(s)[0] for s in range(6)]
    return losses, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


@pytest.mark.parametrize("device", devices())
def test_a_compiled_run_is_the_same_whatever_its_process_compiled_before(device, monkeypatch):
    # a sweep's worker trains model after model: each must compile as in a fresh process
    # the limit is reached by the first model's graphs (a config patch: monkeypatch's undo of a config
    # attribute deletes it, and every later compile in the process then fails)
    with torch._dynamo.config.patch(recompile_limit=2):
        fresh, fresh_graphs = _train_compiled(6, device)
        _train_compiled(4, device)
        after, after_graphs = _train_compiled(6, device)
        assert fresh_graphs > 0 and after_graphs == fresh_graphs
        assert after == fresh  # bit for bit (on the GPU too: bf16 autocast, the same kernels)
        # negative control: without the reset, the third model finds the limit reached and its blocks
        # run eager (no graph compiled for it)
        monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
        _train_compiled(4, device)
        assert _train_compiled(5, device)[1] == 0


@pytest.mark.gpu
def test_cuda_graphs_replay_the_compiled_blocks_with_the_same_losses_bit_for_bit():
    # queued steps (the study's loop), a validation between them (the graphs of a no-grad forward) and
    # the router's statistics and bias (buffers the graphs update in place). In deterministic mode, as the
    # study trains: without it Inductor picks each reduction's launch configuration by timing it when it
    # compiles, so two compiles (on a GPU shared with other tests) can add in different orders.
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    cfg, train, val = _small_moe()
    tc = TrainConfig(steps=8, batch_size=8, seq_len=64, warmup_steps=2, eval_tokens=128, log_every=100, compile=True)
    runs = {}
    for graphs in (False, True):
        counters.clear()
        model = DecoderLM(cfg, seed=0, device="cuda")
        trainer = Trainer(
            model, dataclasses.replace(tc, cuda_graphs=graphs), train, val, np.ones(512), "cuda", progress=False
        )
        with deterministic_mode(True):
            queued = [(s, trainer.queue_step(s)[0]) for s in range(4)]
            val_loss = trainer.evaluate()["val_loss"]
            queued += [(s, trainer.queue_step(s)[0]) for s in range(4, 8)]
        stats = [block.moe.stats.summary() for block in model.blocks if getattr(block, "moe", None) is not None]
        bias = [block.moe.expert_bias.clone() for block in model.blocks if getattr(block, "moe", None) is not None]
        runs[graphs] = (trainer.read_losses(queued), val_loss, stats, bias)
        assert counters["inductor"]["cudagraph_skips"] == 0
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        assert (manager is not None and any(manager.roots.values())) == graphs  # graphs recorded only when asked
    assert runs[True][:3] == runs[False][:3] and len(runs[True][2]) == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[True][3], runs[False][3]))


def test_cuda_graphs_off_cuda_compile_the_blocks_as_compile_alone():
    # on the CPU there is no graph to replay: the same compiled blocks, the same losses bit for bit
    torch._dynamo.reset()
    assert _train_compiled(6, "cpu", cuda_graphs=True) == _train_compiled(6, "cpu")


def test_a_run_without_cuda_graphs_never_starts_a_graph_step():
    # the graph step's first call imports Inductor's CUDA graph trees (seconds): an eager step and a
    # validation, in a fresh process, must not load them
    code = """
import sys, numpy as np
from condmem.models import DecoderLM
from condmem.models.config import ModelConfig
from condmem.train.data import TokenStream
from condmem.train.loop import TrainConfig, Trainer
cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=16)
tokens = TokenStream(np.arange(4 * 16 * 4 + 1, dtype=np.int32) % 64, 0)
tc = TrainConfig(steps=2, batch_size=4, seq_len=16, warmup_steps=1, eval_tokens=16, log_every=100)
trainer = Trainer(DecoderLM(cfg, seed=0), tc, tokens, tokens, np.ones(64), "cpu", progress=False)
trainer.train_step(0)
trainer.evaluate()
print("torch._inductor.cudagraph_trees" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "False", done.stderr[-2000:]
