"""Routed experts (`condmem.models.moe`) against a plain per-token, per-expert loop.

Routing is compared exactly (the experts each token chose); outputs and every gradient at
fp32 tolerance, for both GEMM backends (one matmul per expert, and `torch._grouped_mm`
where this torch has it), including experts that get no token. The load-balancing loss is
checked on hand-computed cases, and the FLOPs / parameter accounting of an MoE decoder.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from condmem.config import ConfigError
from condmem.models import DecoderLM, forward_flops_per_token, iso_flop_baseline
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.moe import GROUP_ALIGN, MoE, dispatch_layout, load_balancing_loss, top_experts

BACKENDS = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")),
]


def reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """The routed experts written plainly: each token, each of its top-k experts, one at a time."""
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    out = torch.zeros_like(x)
    chosen = []
    for t in range(x.shape[0]):
        experts = sorted(range(moe.n_experts), key=lambda e: -float(probs[t, e].detach()))[: moe.top_k]
        chosen.append(experts)
        for e in experts:
            gate, up = (x[t] @ moe.w13[e].T).chunk(2)
            out[t] = out[t] + probs[t, e] * ((F.silu(gate) * up) @ moe.w2[e].T)
    return out, chosen


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float = 1e-5) -> None:
    err = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * max(1.0, scale), f"{name}: max error {err:.3g} (max |ref| {scale:.3g})"


def _pair(n_experts: int, top_k: int, seed: int = 0) -> tuple[MoE, MoE]:
    """Two equal layers with raw-probability weights and no selection bias (what `reference` writes;
    renormalised routing and the bias: tests/models/test_moe_routing.py)."""
    torch.manual_seed(seed)
    a = MoE(16, n_experts, top_k, 8, renormalize=False, bias_rate=0.0)
    with torch.no_grad():
        a.router.weight.normal_(0, 1.0)
    b = MoE(16, n_experts, top_k, 8, renormalize=False, bias_rate=0.0)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("grouped", BACKENDS, ids=["loop", "grouped_mm"])
@pytest.mark.parametrize(
    ("tokens", "n_experts", "top_k"),
    [(13, 5, 2), (1, 4, 1), (3, 8, 2), (40, 6, 3)],
    ids=["odd", "one-token", "idle-experts", "top3"],
)
def test_moe_matches_a_plain_loop(grouped, tokens, n_experts, top_k):
    moe, ref_moe = _pair(n_experts, top_k)
    moe.use_grouped_mm = grouped
    x = torch.randn(tokens, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    _, experts, _ = moe.route(x)
    want, chosen = reference(ref_moe, x_ref)
    assert experts.tolist() == chosen
    got = moe(x)
    assert_close("output", want, got)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close("grad x", x_ref.grad, x.grad)
    for name in ("router.weight", "w13", "w2"):
        assert_close(f"grad {name}", ref_moe.get_parameter(name).grad, moe.get_parameter(name).grad)


def test_router_stays_fp32_under_autocast():
    moe, _ = _pair(16, 2)
    x = torch.randn(256, 16)
    _, experts, weights = moe.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, experts_amp, weights_amp = moe.route(x)
        y = moe(x)
    assert probs.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert torch.equal(experts, experts_amp) and torch.equal(weights, weights_amp)


def test_moe_keeps_the_input_shape_and_is_batch_independent():
    moe, _ = _pair(4, 2)
    x = torch.randn(2, 5, 16)
    y = moe(x)
    assert y.shape == x.shape
    assert_close("row alone", y[1], moe(x[1:])[0])


@pytest.mark.parametrize(
    "device, backend",
    [
        pytest.param("cpu", "eager", id="traced"),
        pytest.param("cuda", "inductor", id="inductor-cuda", marks=pytest.mark.gpu),
    ],
)
def test_traced_top_experts_are_topk(device, backend):
    # under torch.compile, k argmax passes: topk's experts, largest first, where no scores tie
    select = torch.randn(97, 62, generator=torch.Generator().manual_seed(1)).to(device)
    torch._dynamo.reset()
    traced = torch.compile(top_experts, backend=backend, fullgraph=True)
    for k in (1, 2, 6):
        assert torch.equal(traced(select, k), torch.topk(select, k, dim=-1).indices)
    torch._dynamo.reset()


def _scatter_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same MoE forward with the pairs moved by index_copy / index_select (autograd's scatter-add
    backward): the formulation the gathers replace."""
    from condmem.models.moe import expert_counts, grouped_linear

    scores, experts, weights = moe.route(x)
    dest, ends, num_rows = dispatch_layout(experts, moe.n_experts, expert_counts(experts, moe.n_experts))
    pairs = x.unsqueeze(1).expand(-1, moe.top_k, -1).reshape(-1, moe.dim)
    buffer = x.new_zeros(num_rows, moe.dim).index_copy(0, dest, pairs)
    gate, up = grouped_linear(buffer, moe.w13, ends, use_grouped_mm=False).chunk(2, dim=-1)
    out = grouped_linear(torch.nn.functional.silu(gate) * up, moe.w2, ends, use_grouped_mm=False)
    routed = out.index_select(0, dest).view(-1, moe.top_k, moe.dim)
    return (routed * weights.unsqueeze(-1)).sum(1)


def test_gathered_pairs_equal_scattered_pairs_forward_and_backward():
    """Moving the pairs by gathers both ways gives bit-identical outputs and gradients."""
    torch.manual_seed(0)
    moe = MoE(16, 6, 2, 8).eval()  # eval: the bias stays put between the two runs (CPU: a matmul per expert)
    x = torch.randn(53, 16, requires_grad=True)
    ours = moe(x)
    (ours * torch.linspace(-1, 1, 16)).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]
    x.grad = None
    moe.zero_grad(set_to_none=True)
    theirs = _scatter_moe(moe, x)
    (theirs * torch.linspace(-1, 1, 16)).sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]
    assert torch.equal(ours, theirs)
    assert len(got) == len(want) >= 3 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_dispatch_layout_groups_pairs_by_expert():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 0]])  # expert 1 idle, expert 2 three times
    dest, ends, rows = dispatch_layout(experts, 4)
    assert rows == 8 + GROUP_ALIGN * 4 and ends.dtype == torch.int32 and ends[-1] == rows
    assert dispatch_layout(torch.tensor([[1, 0], [2, 1], [0, 3]]), 4)[2] == 8 + GROUP_ALIGN * 4  # 6 pairs -> 8
    assert ends.tolist() == [8, 16, 24, rows]
    starts = [0, 8, 16, 24]
    flat = experts.flatten().tolist()
    assert len(set(dest.tolist())) == len(flat)
    for pair, e in enumerate(flat):
        assert starts[e] <= dest[pair] < ends[e]
    # within an expert, pairs keep token order and fill the group from its start
    assert [int(dest[p]) for p, e in enumerate(flat) if e == 2] == [16, 17, 18, 19]


def test_load_balancing_loss_hand_cases():
    # uniform: f = P = 1/E, loss 1
    probs = torch.full((4, 4), 0.25)
    assert load_balancing_loss(probs, torch.tensor([[0], [1], [2], [3]]), 4).item() == pytest.approx(1.0)
    # two tokens, both to expert 0: f = [1, 0], P = [0.7, 0.3] -> 2 * 0.7
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    assert load_balancing_loss(probs, torch.tensor([[0], [0]]), 2).item() == pytest.approx(1.4)
    # top-2 of 3: counts [2, 1, 1] of 4 choices, P = [0.5, 0.3, 0.2] -> 3 * (0.25 + 0.075 + 0.05)
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.3, 0.3]])
    loss = load_balancing_loss(probs, torch.tensor([[0, 1], [0, 2]]), 3)
    assert loss.item() == pytest.approx(3 * (0.5 * 0.5 + 0.25 * 0.3 + 0.25 * 0.2))
    # the gradient reaches the probabilities, not the choices
    p = probs.clone().requires_grad_(True)
    load_balancing_loss(p, torch.tensor([[0, 1], [0, 2]]), 3).backward()
    assert torch.allclose(p.grad, torch.tensor([[0.5, 0.25, 0.25]] * 2) * 3 / 2)


def _moe_cfg(**moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden=24,
        max_seq_len=16,
        moe=MoEConfig(**{"n_experts": 6, "top_k": 2, "expert_hidden": 16, **moe}),
    )


def test_moe_decoder_accounting_and_aux_loss():
    cfg = _moe_cfg(layer_ids=[1, 2], aux_loss_coef=0.01)
    model = DecoderLM(cfg)
    assert model.blocks[0].moe is None and model.blocks[1].moe is not None
    counts = model.param_counts()
    expert = 3 * 32 * 16
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == 2 * (6 - 2) * expert
    flops = forward_flops_per_token(cfg, 16)
    assert flops["moe"] == 2 * (2 * 32 * 6 + 2 * 6 * 32 * 16)
    assert flops["mlp"] == 3 * 6 * 32 * 24
    ids = torch.randint(0, 64, (2, 16))
    loss = model.loss(ids, ids)
    aux = model.aux_loss()
    assert aux is not None and aux.item() == pytest.approx(
        0.01 * sum(float(b.moe.aux_loss.detach()) for b in model.blocks[1:])
    )
    (loss + aux).backward()
    assert model.blocks[1].moe.router.weight.grad.abs().sum() > 0
    model.eval()
    model.loss(ids, ids)
    assert model.aux_loss() is None
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_moe_block_without_shared_expert_and_iso_flop_baseline():
    from condmem.config import EngramConfig

    engram = EngramConfig(
        layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=50, hidden_size=32, compressed_vocab_size=60
    )
    cfg = _moe_cfg().replace(ffn_hidden=0, engram=engram)
    assert DecoderLM(cfg, seed=0).blocks[0].mlp is None
    base = iso_flop_baseline(cfg)
    assert base.ffn_hidden[1] > 0 and base.ffn_hidden[0] == base.ffn_hidden[2] == 0
    assert abs(forward_flops_per_token(base)["total"] - forward_flops_per_token(cfg)["total"]) < 6 * 32
    with pytest.raises(ConfigError, match="ffn_hidden"):
        ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=0)
    with pytest.raises(ConfigError, match="top_k"):
        MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="layer_ids"):
        _moe_cfg(layer_ids=[5])


@pytest.mark.gpu
def test_grouped_mm_matches_the_loop_on_the_gpu():
    torch.manual_seed(0)
    moe = MoE(256, 16, 2, 128).cuda()
    loop = MoE(256, 16, 2, 128).cuda()
    loop.load_state_dict(moe.state_dict())
    moe.use_grouped_mm, loop.use_grouped_mm = None, False
    x = torch.randn(4096, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y_loop = moe(x), loop(x)
    assert y.dtype == y_loop.dtype  # both backends hand back the same dtype (the fp32 routing weights combine)
    assert_close("output", y_loop.float(), y.float(), tol=2e-2)
    y.float().square().sum().backward()
    y_loop.float().square().sum().backward()
    for name in ("router.weight", "w13", "w2"):
        assert_close(f"grad {name}", loop.get_parameter(name).grad, moe.get_parameter(name).grad, tol=3e-2)


def _cpu_grouped_mm() -> bool:
    one, offs = torch.ones(8, 8, dtype=torch.bfloat16), torch.tensor([8], dtype=torch.int32)
    try:
        torch._grouped_mm(one, one.unsqueeze(0).transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_gemm_backward_is_torchs_but_for_the_weight_gradient(device):
    """`grouped_linear`'s grouped form: output and input gradient are torch._grouped_mm's own bits; the
    fp32 weight's gradient is summed in fp32 and written as fp32, so it is nearer the exact sum than
    autograd's (rounded to bf16, then widened)."""
    from condmem.models.moe import grouped_linear

    if device == "cpu" and not _cpu_grouped_mm():
        pytest.skip("this torch has no CPU _grouped_mm")
    torch.manual_seed(0)
    ends = torch.tensor([8, 16, 16, 64, 96], dtype=torch.int32, device=device)  # one group empty
    x = torch.randn(96, 32, device=device).bfloat16().requires_grad_()
    w = torch.randn(5, 24, 32, device=device, requires_grad=True)
    dy = torch.randn(96, 24, device=device).bfloat16()
    y = grouped_linear(x, w, ends, use_grouped_mm=True)
    y.backward(dy)
    x_t, w_t = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_t = torch._grouped_mm(x_t, w_t.bfloat16().transpose(-2, -1), offs=ends)
    y_t.backward(dy)
    assert torch.equal(y, y_t) and torch.equal(x.grad, x_t.grad)
    assert w.grad.dtype == torch.float32
    bounds = [0, *ends.tolist()]
    exact = torch.stack([dy[a:b].double().T @ x[a:b].double() for a, b in zip(bounds, bounds[1:])]).float()
    assert (w.grad - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert (w.grad - exact).abs().max() < (w_t.grad - exact).abs().max()
