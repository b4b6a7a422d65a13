"""Renormalised routing, the auxiliary-loss-free balancing bias and the router statistics of
`condmem.models.moe`.

* Routing against a plain per-token Python loop: the experts each token chose compared with
  `torch.equal`; outputs and every gradient in fp32 at 1e-5 relative to the largest value.
* The bias keeps >= 90% of the experts in use on a skewed stream on which the same router
  without it leaves half of them dead.
* `RouterStats` against hand-computed values; configs saved before the routing knobs load
  with the routing they were trained with.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from condmem.config import ConfigError
from condmem.models import DecoderLM, forward_flops_per_token
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.moe import MoE, RouterStats, reset_router_statistics, router_statistics
from ranks import spawn_ranks

BACKENDS = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")),
]
TOL = 1e-5


def reference(moe: MoE, bias: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Renormalised top-k routing written plainly, one token and one expert at a time."""
    logits = x @ moe.router.weight.T
    scores = torch.softmax(logits, dim=-1) if moe.score == "softmax" else torch.sigmoid(logits)
    out = torch.zeros_like(x)
    chosen = []
    for t in range(x.shape[0]):
        select = [
            float(scores[t, e].detach()) + (0.0 if bias is None else float(bias[e])) for e in range(moe.n_experts)
        ]
        experts = sorted(range(moe.n_experts), key=lambda e: -select[e])[: moe.top_k]
        chosen.append(experts)
        mass = sum(scores[t, e] for e in experts)
        for e in experts:
            weight = scores[t, e] / mass if moe.renormalize else scores[t, e]
            gate, up = (x[t] @ moe.w13[e].T).chunk(2)
            out[t] = out[t] + moe.routed_scale * weight * ((F.silu(gate) * up) @ moe.w2[e].T)
    return out, chosen


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float = TOL) -> None:
    err = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * max(1.0, scale), f"{name}: max error {err:.3g} (max |ref| {scale:.3g})"


def _pair(n_experts: int, top_k: int, **knobs) -> tuple[MoE, MoE]:
    torch.manual_seed(0)
    a = MoE(16, n_experts, top_k, 8, **knobs)
    with torch.no_grad():
        a.router.weight.normal_(0, 1.0)
        if a.expert_bias is not None:  # a bias that changes some choices
            a.expert_bias.copy_(torch.randn(n_experts) * 0.1)
    b = MoE(16, n_experts, top_k, 8, **knobs)
    b.load_state_dict(a.state_dict())
    return a, b


CASES = [
    ((13, 5, 2), {}),
    ((1, 4, 1), {}),
    ((3, 8, 2), {}),
    ((40, 6, 3), {"routed_scale": 2.5}),
    ((17, 7, 2), {"score": "sigmoid"}),
    ((17, 7, 2), {"score": "sigmoid", "routed_scale": 2.5, "bias_rate": 0.0}),
    ((9, 6, 2), {"renormalize": False}),
]
CASE_IDS = ["odd", "one-token", "idle-experts", "top3-scaled", "sigmoid", "sigmoid-scaled-nobias", "raw-weights"]


@pytest.mark.parametrize("grouped", BACKENDS, ids=["loop", "grouped_mm"])
@pytest.mark.parametrize(("shape", "knobs"), CASES, ids=CASE_IDS)
def test_routing_matches_a_plain_loop(grouped, shape, knobs):
    tokens, n_experts, top_k = shape
    moe, ref_moe = _pair(n_experts, top_k, **knobs)
    moe.use_grouped_mm = grouped
    bias = None if moe.expert_bias is None else moe.expert_bias.clone()
    x = torch.randn(tokens, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    _, experts, weights = moe.route(x)
    want, chosen = reference(ref_moe, bias, x_ref)
    assert torch.equal(experts, torch.tensor(chosen, dtype=torch.int64))
    if moe.renormalize:
        assert_close("weights sum", torch.full((tokens,), moe.routed_scale), weights.sum(-1))
    got = moe(x)  # training mode: the bias moves after this forward's choice, not before
    assert_close("output", want, got)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close("grad x", x_ref.grad, x.grad)
    for name in ("router.weight", "w13", "w2"):
        assert_close(f"grad {name}", ref_moe.get_parameter(name).grad, moe.get_parameter(name).grad)


@pytest.mark.parametrize(("shape", "knobs"), CASES, ids=CASE_IDS)
def test_routing_picks_the_chosen_experts_as_a_gather_would_bit_for_bit(shape, knobs):
    """`MoE.route` picks each chosen expert's log-score (or score) by a mask over the experts
    where gradients flow: the weights and the router's gradient equal a gather's, and the
    route without gradients (a gather) gives the same bits (`torch.equal`)."""
    tokens, n_experts, top_k = shape
    moe, _ = _pair(n_experts, top_k, **knobs)
    x = torch.randn(tokens, 16)
    _, experts, weights = moe.route(x)
    with torch.no_grad():
        assert torch.equal(moe.route(x)[2], weights)
    (weights * torch.linspace(-1, 2, weights.numel()).view_as(weights)).sum().backward()
    got = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    logits = moe.logits(x)  # the gather, written out
    if moe.renormalize:
        log_scores = logits if moe.score == "softmax" else F.logsigmoid(logits)
        want = torch.softmax(log_scores.gather(-1, experts), dim=-1)
    else:
        want = (torch.softmax(logits, -1) if moe.score == "softmax" else torch.sigmoid(logits)).gather(-1, experts)
    want = want * moe.routed_scale if moe.routed_scale != 1.0 else want
    (want * torch.linspace(-1, 2, want.numel()).view_as(want)).sum().backward()
    assert torch.equal(weights, want)
    assert torch.equal(got, moe.router.weight.grad)


def test_the_loop_comparison_tells_renormalised_from_raw_weights():
    """Negative control: raw-probability weights (the old routing) miss the renormalised loop."""
    moe, ref_moe = _pair(6, 2, bias_rate=0.0)
    raw = MoE(16, 6, 2, 8, renormalize=False, bias_rate=0.0)
    raw.load_state_dict(moe.state_dict())
    x = torch.randn(20, 16)
    want, _ = reference(ref_moe, None, x)
    assert_close("renormalised", want, moe(x))
    with pytest.raises(AssertionError, match="output"):
        assert_close("output", want, raw(x))
    # A bias the loop did not see picks other experts: the exact comparison catches it.
    with torch.no_grad():
        biased = MoE(16, 6, 2, 8)
        biased.load_state_dict({**moe.state_dict(), "expert_bias": torch.tensor([0, 0, 0, 0, 5.0, 5.0])})
    assert not torch.equal(biased.route(x)[1], moe.route(x)[1])


def test_renormalised_weights_survive_scores_that_underflow():
    """A saturated softmax whose chosen (bias-selected) experts have probability 0 in fp32: the
    weights are still the renormalised ones (a softmax over the chosen logits), not 0/0."""
    moe = MoE(2, 4, 2, 4)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[200.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        moe.expert_bias.copy_(torch.tensor([-10.0, 1.0, 1.0, 0.0]))
    x = torch.tensor([[1.0, 0.0]])
    scores, experts, weights = moe.route(x)
    assert torch.equal(experts, torch.tensor([[1, 2]]))
    assert scores[0, 1] == 0 and scores[0, 2] == 0  # exp(-200) underflows
    assert torch.allclose(weights, torch.tensor([[0.5, 0.5]]))
    chosen = scores.gather(-1, experts)  # negative control: dividing the scores themselves
    assert torch.isnan(chosen / chosen.sum(-1, keepdim=True)).all()
    y = moe(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(moe.router.weight.grad).all()


def test_bias_update_rule_hand_case():
    moe = MoE(4, 4, 1, 4, bias_rate=0.25)
    moe.update_bias(torch.tensor([5, 1, 0, 2]))  # mean 2: too busy, idle, idle, balanced
    assert torch.equal(moe.expert_bias, torch.tensor([-0.25, 0.25, 0.25, 0.0]))
    assert "expert_bias" not in dict(moe.named_parameters())  # selection only: no gradient, no optimizer
    assert MoE(4, 4, 1, 4, bias_rate=0.0).expert_bias is None


def test_bias_moves_in_training_forwards_only():
    moe, _ = _pair(6, 2)
    before = moe.expert_bias.clone()
    x = torch.randn(30, 16)
    moe.eval()
    moe(x)
    assert torch.equal(moe.expert_bias, before) and moe.stats.forwards == 0
    moe.train()
    counts = torch.bincount(moe.route(x)[1].flatten(), minlength=6).float()
    moe(x)
    assert torch.equal(moe.expert_bias, before + 1e-3 * torch.sign(counts.mean() - counts))


def _skewed_stream(bias_rate: float, aux_coef: float = 0.0, steps: int = 120) -> dict:
    """A router trained (with its experts) on a stream whose tokens all lean one way; the
    statistics of the last 20 steps."""
    torch.manual_seed(0)
    moe = MoE(8, 16, 2, 4, bias_rate=bias_rate)
    moe.use_grouped_mm = False
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)
    gen = torch.Generator().manual_seed(1)
    skew = torch.randn(8, generator=gen) * 4
    target = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(moe.parameters(), lr=0.05)
    for step in range(steps):
        if step == steps - 20:
            moe.stats.reset()
        x = skew + torch.randn(64, 8, generator=gen)
        loss = (moe(x) - target(x).detach()).square().mean() + aux_coef * moe.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return moe.stats.summary()


def test_the_bias_keeps_experts_in_use_where_the_plain_router_collapses():
    balanced = _skewed_stream(bias_rate=1e-2)
    collapsed = _skewed_stream(bias_rate=0.0)  # negative control: the same stream, no balancing
    assert balanced["used_share"] >= 0.9, balanced
    assert balanced["max_over_mean"] < 2.0, balanced
    assert collapsed["used_share"] <= 0.6, collapsed
    assert collapsed["max_over_mean"] > 5.0, collapsed
    # The Switch loss alone (weight 1.0) does not revive them: a saturated softmax gives it no gradient.
    switch = _skewed_stream(bias_rate=0.0, aux_coef=1.0)
    assert switch["used_share"] <= 0.6 and switch["balance_loss"] > 5.0, switch


def test_router_stats_hand_computed():
    stats = RouterStats(4, 2)
    stats.update(torch.tensor([3, 1, 0, 0]), torch.tensor([0.5, 0.7]), torch.tensor(1.5))
    stats.update(torch.tensor([1, 1, 0, 2]), torch.tensor([0.9, 0.3]), torch.tensor(2.5))
    s = stats.summary()
    # load [4, 2, 0, 2] over 4 tokens (8 choices): mean 2, max 4, var (4+0+4+0)/4 = 2
    assert s["load"] == [4, 2, 0, 2] and s["tokens"] == 4 and s["forwards"] == 2
    assert s["load_mean"] == 2.0 and s["load_max"] == 4 and s["max_over_mean"] == 2.0
    assert s["load_cv"] == pytest.approx(2**0.5 / 2)
    assert s["busiest_share"] == 1.0  # every token chose expert 0
    assert s["dead"] == 1 and s["dead_experts"] == [2] and s["used_share"] == 0.75
    assert s["gate_mass"] == pytest.approx((0.5 + 0.7 + 0.9 + 0.3) / 4)
    assert s["balance_loss"] == pytest.approx(2.0)
    stats.reset()
    empty = stats.summary()
    assert empty["tokens"] == 0 and empty["load"] is None and empty["dead"] is None
    with pytest.raises(ValueError, match="counts has shape"):
        stats.update(torch.tensor([1, 2]), torch.tensor([0.5]), None)


def test_router_stats_keep_their_dtypes_when_the_model_is_cast():
    moe = MoE(4, 4, 1, 4, bias_rate=0.25).to(torch.bfloat16)
    assert moe.expert_bias.dtype == torch.bfloat16  # the cast reached the layer's own buffers
    assert moe.stats.sums.dtype == torch.float64 and moe.stats.load.dtype == moe.stats.counts.dtype == torch.int64
    moe.train()
    moe(torch.randn(6, 4, dtype=torch.bfloat16))
    assert moe.stats.summary()["tokens"] == 6


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_stats_of_a_forward(score):
    moe, _ = _pair(6, 2, score=score)
    x = torch.randn(25, 16)
    with torch.no_grad():
        scores, experts, _ = moe.route(x)
    moe(x)
    s = moe.stats.summary()
    assert s["load"] == torch.bincount(experts.flatten(), minlength=6).tolist()
    mass = scores.gather(-1, experts).sum(-1) / scores.sum(-1)  # before renormalisation
    assert s["gate_mass"] == pytest.approx(float(mass.mean()), rel=1e-6)
    assert s["balance_loss"] == pytest.approx(float(moe.aux_loss.detach()), rel=1e-6)


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden=24,
        max_seq_len=16,
        moe=MoEConfig(**{"n_experts": 6, "top_k": 2, "expert_hidden": 16, **moe}),
    )


def test_model_statistics_bias_checkpoint_and_flops():
    cfg = _cfg()
    assert cfg.moe.renormalize and cfg.moe.bias_rate == 1e-3 and cfg.moe.aux_loss_coef == 0.0
    model = DecoderLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    model.loss(ids, ids)
    stats = router_statistics(model)
    assert set(stats["layers"]) == {"blocks.0.moe", "blocks.1.moe"}
    assert all(s["tokens"] == 32 and sum(s["load"]) == 64 for s in stats["layers"].values())
    assert stats["dead"] == sum(s["dead"] for s in stats["layers"].values())
    assert stats["max_over_mean"] == max(s["max_over_mean"] for s in stats["layers"].values())
    assert model.aux_loss() is None  # computed and recorded, not added (aux_loss_coef 0)
    reset_router_statistics(model)
    assert router_statistics(model)["max_over_mean"] is None
    # the bias is saved with the weights and restored
    state = model.state_dict()
    assert state["blocks.1.moe.expert_bias"].abs().sum() > 0
    again = DecoderLM(cfg, seed=1)
    again.load_state_dict(state)
    assert torch.equal(again.blocks[1].moe.expert_bias, model.blocks[1].moe.expert_bias)
    # routing knobs are elementwise work: not counted, the same FLOPs and parameters
    for knobs in ({"renormalize": False}, {"score": "sigmoid", "routed_scale": 2.0}, {"bias_rate": 0.0}):
        other = _cfg(**knobs)
        assert forward_flops_per_token(other) == forward_flops_per_token(cfg)
        assert DecoderLM(other).param_counts() == model.param_counts()


def test_a_config_saved_before_the_routing_knobs_loads_its_old_routing():
    old = _cfg().to_dict()
    old["moe"] = {k: old["moe"][k] for k in ("n_experts", "top_k", "expert_hidden", "layer_ids", "aux_loss_coef")}
    cfg = ModelConfig.from_dict(old)
    assert not cfg.moe.renormalize and cfg.moe.bias_rate == 0.0 and cfg.moe.score == "softmax"
    model = DecoderLM(cfg)
    assert model.blocks[0].moe.expert_bias is None  # an old checkpoint's weights load strictly
    # a config written now keeps its knobs; one written by hand gets the defaults
    assert ModelConfig.from_dict(_cfg().to_dict()) == _cfg()
    hand = {**old, "moe": {"n_experts": 6}}
    assert ModelConfig.from_dict(hand).moe.renormalize


@pytest.mark.parametrize(
    ("knob", "value", "match"),
    [
        ("score", "relu", "score"),
        ("renormalize", "yes", "renormalize"),
        ("routed_scale", 0.0, "routed_scale"),
        ("routed_scale", float("inf"), "routed_scale"),
        ("bias_rate", -1e-3, "bias_rate"),
        ("aux_loss_coef", float("nan"), "aux_loss_coef"),
    ],
)
def test_bad_routing_knobs_are_refused_by_name(knob, value, match):
    with pytest.raises(ConfigError, match=f"MoEConfig.{match}"):
        MoEConfig(n_experts=4, **{knob: value})


def _rank_bias(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        moe, _ = _pair(6, 2, bias_rate=0.5)
        start = moe.expert_bias.clone()
        x = torch.randn(10 + 7 * rank, 16, generator=torch.Generator().manual_seed(rank))  # each rank its own slice
        with torch.no_grad():
            local = torch.bincount(moe.route(x)[1].flatten(), minlength=6)
        moe(x)
        torch.save({"start": start, "bias": moe.expert_bias, "counts": local}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_move_the_bias_by_the_summed_load(tmp_path):
    spawn_ranks(_rank_bias, 2, tmp_path / "init", str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    total = (r0["counts"] + r1["counts"]).float()
    want = r0["start"] + 0.5 * torch.sign(total.mean() - total)
    assert torch.equal(r0["bias"], want) and torch.equal(r1["bias"], want)
    # negative control: each rank's own load would have moved the biases apart
    own = [r["start"] + 0.5 * torch.sign(r["counts"].float().mean() - r["counts"].float()) for r in (r0, r1)]
    assert not torch.equal(own[0], own[1])
