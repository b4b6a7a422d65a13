"""The reference decoder: shapes, incremental decoding, the composed Engram path, FLOPs, init."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from condmem.config import ConfigError, EngramConfig
from condmem.models import (
    DecoderLM,
    ModelConfig,
    engram_flops_per_token,
    forward_flops_per_token,
    generate,
    iso_flop_baseline,
    train_flops_per_token,
)
from condmem.models.layers import SwiGLU
from tests.helpers import assert_close

VOCAB = 97
V_COMPRESSED = 60
LOOKUP = np.arange(VOCAB) % V_COMPRESSED  # a valid first-appearance map onto 60 ids


def make_cfg(engram: bool = True, short_conv: bool = True, layers=(1,), n_layers: int = 3) -> ModelConfig:
    e = (
        EngramConfig(
            layer_ids=list(layers),
            max_ngram_size=3,
            n_heads=2,
            head_dim=8,
            table_size=53,
            pad_id=1,
            hidden_size=32,
            short_conv=short_conv,
            compressed_vocab_size=V_COMPRESSED,
        )
        if engram
        else None
    )
    return ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=40, engram=e
    )


def randomize_conv(model: DecoderLM) -> None:
    # ShortConv starts at zero; give it weights so decoding must carry its history.
    gen = torch.Generator().manual_seed(3)
    for block in model.blocks:
        if block.engram is not None and block.engram.short_conv is not None:
            with torch.no_grad():
                block.engram.short_conv.weight.copy_(torch.randn(block.engram.short_conv.weight.shape, generator=gen))


@pytest.mark.parametrize("engram", [False, True], ids=["baseline", "engram"])
def test_forward_shapes_and_loss(engram):
    model = DecoderLM(make_cfg(engram), token_lookup=LOOKUP)
    ids = torch.randint(0, VOCAB, (3, 17))
    logits = model(ids)
    assert logits.shape == (3, 17, VOCAB)
    loss = model.loss(ids, torch.roll(ids, -1, 1))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - np.log(VOCAB)) < 1.0  # near uniform at init


@pytest.mark.parametrize(
    "engram,short_conv", [(False, False), (True, False), (True, True)], ids=["baseline", "engram-noconv", "engram-conv"]
)
@pytest.mark.parametrize("prefill", [1, 6, 19], ids=lambda n: f"prefill{n}")
def test_incremental_decoding_matches_full_forward(engram, short_conv, prefill):
    model = DecoderLM(make_cfg(engram, short_conv, layers=(0, 2)), token_lookup=LOOKUP).eval()
    randomize_conv(model)
    ids = torch.randint(0, VOCAB, (2, 19))
    full = model(ids)
    cache = model.new_cache(2, 19)
    parts = [model(ids[:, :prefill], cache=cache)]
    t = prefill
    while t < 19:  # decode in chunks of 1 and 2 tokens
        step = 1 if t % 2 else 2
        parts.append(model(ids[:, t : t + step], cache=cache))
        t += step
    assert_close("incremental logits", full, torch.cat(parts, 1), atol=2e-5)


def test_zero_conv_state_equals_a_sequence_start():
    model = DecoderLM(make_cfg(), token_lookup=LOOKUP)
    randomize_conv(model)
    block = model.blocks[1]
    ids = torch.randint(0, VOCAB, (2, 11))
    rows = model.row_ids(ids)[:, :, 0]
    h = torch.randn(2, 11, 32)
    want = block.engram(h, rows)
    state = torch.zeros(2, (4 - 1) * 3, 1, 32)
    assert_close("engram (zero state)", want, block.engram(h, rows, conv_state=state), atol=1e-6)
    assert state.abs().sum() > 0, "the state advanced to this call's last conv inputs"


def test_gate_values_shape_and_range():
    model = DecoderLM(make_cfg(layers=(0, 2)), token_lookup=LOOKUP)
    gates = model.gate_values(torch.randint(0, VOCAB, (2, 9)))
    assert sorted(gates) == [0, 2]
    for g in gates.values():
        assert g.shape == (2, 9) and g.dtype == torch.float32
        assert bool(((g > 0) & (g < 1)).all())


def test_doc_starts_stop_lookbacks():
    model = DecoderLM(make_cfg(), token_lookup=LOOKUP)
    ids = torch.randint(0, VOCAB, (1, 8))
    starts = torch.zeros(1, 8, dtype=torch.bool)
    starts[0, 4] = True
    rows = model.row_ids(ids, starts)
    alone = model.row_ids(ids[:, 4:])
    assert torch.equal(rows[:, 4:], alone), "a document's rows must not depend on the previous document"


def test_same_backbone_initialization():
    eng = DecoderLM(make_cfg(), token_lookup=LOOKUP, seed=5)
    base = DecoderLM(make_cfg(engram=False), seed=5)
    eng_params = dict(eng.named_parameters())
    for name, p in base.named_parameters():
        assert torch.equal(p, eng_params[name]), name
    other = DecoderLM(make_cfg(engram=False), seed=6)
    assert not torch.equal(other.embed.weight, base.embed.weight)


def test_flops_count_the_engram_and_iso_flop_baseline_matches():
    cfg = make_cfg()
    e = cfg.engram
    assert engram_flops_per_token(cfg) == 2 * e.engram_dim * 2 * 32 + 2 * 32 * 4 + 2 * 32
    base = iso_flop_baseline(cfg)
    assert base.engram is None and base.ffn_hidden[1] > 48 and base.ffn_hidden[0] == 48
    ratio = train_flops_per_token(cfg) / train_flops_per_token(base)
    assert abs(ratio - 1) < 0.01, ratio
    parts = forward_flops_per_token(cfg, 40)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_sparse_table_gradient():
    model = DecoderLM(make_cfg(), token_lookup=LOOKUP, sparse_tables=True)
    ids = torch.randint(0, VOCAB, (2, 10))
    model.loss(ids, ids).backward()
    ((_name, table),) = model.table_parameters()
    assert table.grad.is_sparse
    assert all(
        p.grad is not None and not p.grad.is_sparse for n, p in model.backbone_parameters() if "short_conv" not in n
    ), "every backbone parameter gets a dense gradient"


def test_generate_is_deterministic_and_respects_length():
    model = DecoderLM(make_cfg(), token_lookup=LOOKUP)
    prompt = torch.randint(0, VOCAB, (5,))
    a = generate(model, prompt, 12, seed=1)
    b = generate(model, prompt, 12, seed=1)
    assert a.shape == (12,) and torch.equal(a, b)
    greedy = generate(model, prompt, 6, temperature=0)
    logits = model(prompt[None])[0, -1]
    assert greedy[0] == logits.argmax()
    # The model's context is 40: a long prompt keeps its tail and still generates.
    assert generate(model, torch.randint(0, VOCAB, (60,)), 10, seed=0).shape == (10,)


@pytest.mark.parametrize("hidden", [13, 16])
def test_swiglu_of_an_unaligned_width_trains_padded_to_the_same_function(hidden):
    """In training, a hidden width that is not a multiple of 8 runs padded with zero units: in
    fp64 the output and every gradient equal the unpadded forward's to 1e-12 (eval mode runs
    unpadded); an aligned width runs as it is, bit for bit."""
    torch.manual_seed(0)
    mlp = SwiGLU(12, hidden, dtype=torch.float64)
    x = torch.randn(5, 7, 12, dtype=torch.float64, requires_grad=True)
    got = mlp.train()(x)
    got.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    want = mlp.eval()(x)
    want.square().sum().backward()
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for g, w in zip(grads, [x.grad] + [p.grad for p in mlp.parameters()]):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=0, atol=1e-12)
    if hidden % 8 == 0:
        assert torch.equal(got, want)


def test_config_validation_names_the_field():
    e = EngramConfig(layer_ids=[5], hidden_size=32, compressed_vocab_size=10)
    with pytest.raises(ConfigError, match="layer_ids"):
        ModelConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, engram=e)
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, engram=e.replace(layer_ids=[1]))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelConfig(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=3)
    cfg = make_cfg()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_engram_model_needs_the_tokenizer_map():
    model = DecoderLM(make_cfg())
    with pytest.raises(RuntimeError, match="token_lookup"):
        model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(Exception, match="V'"):
        DecoderLM(make_cfg(), token_lookup=np.arange(VOCAB) % 50)
