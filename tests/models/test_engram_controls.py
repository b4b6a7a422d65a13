"""The study's controls (`condmem.models.flops`, `condmem.models.addresses`).

* Random addresses: every training step draws new row ids (in each column's range, the
  hash's shape and dtype), reproducibly from the model's seed, and resumes its sequence
  from a saved state; evaluation reads random rows too; tables, parameters and FLOPs are
  the hashed model's.
* Tiny table: every (order, head) column at most the bound, the largest size that fits,
  the same Engram module and FLOPs.
* Dense control: the MoE model's FLOPs and active parameters without routed experts
  (exact when the expert count is a multiple of 3, else within one hidden unit a block).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from condmem.config import ConfigError, EngramConfig
from condmem.layout import EngramLayout
from condmem.models import DecoderLM, forward_flops_per_token, train_flops_per_token
from condmem.models.addresses import random_row_ids
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.flops import dense_control, parameter_counts, random_address_control, tiny_table_control

V = 64
LOOKUP = np.arange(V, dtype=np.int64) % 60


def _cfg(table_size: int = 500, n_heads: int = 2, dim: int = 32) -> ModelConfig:
    engram = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=n_heads,
        head_dim=8,
        table_size=table_size,
        hidden_size=dim,
        compressed_vocab_size=60,
    )
    return ModelConfig(
        vocab_size=V,
        dim=dim,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden=24,
        max_seq_len=16,
        engram=engram,
        moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=16),
    )


def _in_ranges(rows: torch.Tensor, layout: EngramLayout) -> bool:
    lo = torch.tensor(layout.offsets_array())
    hi = lo + torch.tensor(layout.primes_array())
    return bool(((rows >= lo) & (rows < hi)).all())


def test_random_addresses_draw_new_rows_each_step_in_range():
    cfg = _cfg()
    hashed = DecoderLM(cfg, token_lookup=LOOKUP)
    model = DecoderLM(random_address_control(cfg), token_lookup=LOOKUP)
    ids = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(0))
    want = hashed.row_ids(ids)
    steps = [model.row_ids(ids) for _ in range(3)]
    for rows in steps:
        assert rows.shape == want.shape and rows.dtype == want.dtype == torch.int64
        assert _in_ranges(rows, model.layout)
        assert not torch.equal(rows, want)
    assert not torch.equal(steps[0], steps[1]) and not torch.equal(steps[1], steps[2])
    # negative control: the hash reads the same rows for the same ids at every step
    assert torch.equal(hashed.row_ids(ids), want)
    # the same seed draws the same sequence; another seed another one
    again = DecoderLM(random_address_control(cfg), token_lookup=LOOKUP)
    assert all(torch.equal(again.row_ids(ids), rows) for rows in steps)
    other = DecoderLM(random_address_control(cfg), token_lookup=LOOKUP, seed=1)
    assert not torch.equal(other.row_ids(ids), steps[0])


def test_random_rows_cover_each_range_uniformly():
    layout = EngramLayout(_cfg(table_size=20).engram)
    rows = random_row_ids(layout, (4000,), torch.Generator().manual_seed(0), "cpu")
    primes, offsets = layout.primes_array()[0], layout.offsets_array()[0]
    for c, (p, off) in enumerate(zip(primes, offsets)):
        counts = torch.bincount(rows[:, 0, c] - int(off), minlength=int(p))
        assert counts.numel() == p and counts.min() > 0  # every row of the range reachable, none outside
        expected = 4000 / p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < p + 5 * (2 * p) ** 0.5, (c, chi2)  # within ~5 sigma of uniform


def test_random_addresses_train_evaluate_and_resume():
    cfg = random_address_control(_cfg())
    model = DecoderLM(cfg, token_lookup=LOOKUP)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two training steps through the loss, as the trainer calls it
        model.loss(ids, ids).backward()
    table = model.blocks[1].engram.table
    assert table.weight.grad is not None
    assert model.random_addresses.train_draws.item() == 2
    state = {k: v.clone() for k, v in model.state_dict().items()}  # as a checkpoint saves it
    third = model.row_ids(ids)
    resumed = DecoderLM(cfg, token_lookup=LOOKUP, seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.row_ids(ids), third)  # the sequence continues where it stopped
    fresh = DecoderLM(cfg, token_lookup=LOOKUP)
    assert not torch.equal(fresh.row_ids(ids), third)  # negative control: a fresh count starts over
    # evaluation reads random rows too, from its own sequence (training draws are not consumed)
    model.eval()
    with torch.no_grad():
        a, b = model.row_ids(ids), model.row_ids(ids)
    assert _in_ranges(a, model.layout) and not torch.equal(a, b)
    assert model.random_addresses.train_draws.item() == 3
    with torch.no_grad():
        assert torch.isfinite(model.loss(ids, ids))


def test_random_addresses_keep_tables_parameters_and_flops():
    cfg = _cfg()
    control = random_address_control(cfg)
    assert control.engram == cfg.engram
    assert forward_flops_per_token(control) == forward_flops_per_token(cfg)
    assert train_flops_per_token(control, 16) == train_flops_per_token(cfg, 16)
    assert parameter_counts(control) == parameter_counts(cfg)
    assert DecoderLM(control, token_lookup=LOOKUP).param_counts() == DecoderLM(cfg, token_lookup=LOOKUP).param_counts()
    assert ModelConfig.from_dict(control.to_dict()) == control
    assert "engram_addresses" not in cfg.to_dict()  # hashed configs keep the keys they had
    with pytest.raises(ValueError, match="no Engram"):
        random_address_control(cfg.replace(engram=None))
    with pytest.raises(ConfigError, match="engram_addresses"):
        cfg.replace(engram_addresses="content")
    with pytest.raises(ConfigError, match="engram_addresses"):
        cfg.replace(engram=None, engram_addresses="random")


@pytest.mark.parametrize(
    ("table_size", "n_heads", "dim", "bound"),
    [(500, 2, 32, 1024), (2_000_000, 8, 512, 1024), (100_000, 8, 512, 300), (300, 2, 32, 1024)],
    ids=["tiny-preset", "gpu-preset", "small-bound", "already-small"],
)
def test_tiny_table_keeps_the_module_and_flops(table_size, n_heads, dim, bound):
    cfg = _cfg(table_size, n_heads, dim)
    tiny = tiny_table_control(cfg, bound)
    primes = EngramLayout(tiny.engram).primes_array()
    assert primes.max() <= bound
    size = tiny.engram.table_size
    assert size <= table_size
    if size < table_size:  # the largest that fits: one more and some column is past the bound
        bigger = EngramLayout(cfg.engram.replace(table_size=size + 1)).primes_array()
        assert bigger.max() > bound
    assert forward_flops_per_token(tiny) == forward_flops_per_token(cfg)
    a, b = parameter_counts(tiny), parameter_counts(cfg)
    assert a["backbone"] == b["backbone"] and a["tables"] <= b["tables"]
    assert tiny.engram.replace(table_size=table_size) == cfg.engram


def test_tiny_table_refuses_a_bound_below_its_columns():
    with pytest.raises(ValueError, match="max_rows_per_head=3"):
        tiny_table_control(_cfg(), 3)
    with pytest.raises(ValueError, match="no Engram"):
        tiny_table_control(_cfg().replace(engram=None))


@pytest.mark.parametrize(("n_experts", "top_k", "layer_ids"), [(6, 2, None), (62, 2, None), (7, 3, [1])])
def test_dense_control_matches_active_parameters_and_flops(n_experts, top_k, layer_ids):
    cfg = _cfg().replace(moe=MoEConfig(n_experts=n_experts, top_k=top_k, expert_hidden=16, layer_ids=layer_ids))
    dense = dense_control(cfg)
    assert dense.moe is None and dense.engram == cfg.engram
    blocks = len(cfg.moe_layer_ids)
    exact = n_experts % 3 == 0
    flops_gap = abs(forward_flops_per_token(dense)["total"] - forward_flops_per_token(cfg)["total"])
    active_gap = abs(parameter_counts(dense)["active"] - parameter_counts(cfg)["active"])
    assert flops_gap == 0 if exact else 0 < flops_gap < blocks * 2 * 3 * cfg.dim
    assert active_gap == 0 if exact else 0 < active_gap < blocks * 3 * cfg.dim
    d = parameter_counts(dense)
    assert d["active"] == d["total"] - d["tables"]  # every parameter of a dense model is active
    with pytest.raises(ValueError, match="no routed experts"):
        dense_control(cfg.replace(moe=None))
