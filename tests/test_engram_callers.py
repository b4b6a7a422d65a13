"""Every caller of the Engram layer runs `Engram.forward`, and what it composes equals one call.

The decoder (whole sequences and cached decoding), the serving steps, the Hugging Face
adapter (padding mask, ShortConv state, prefetched rows) and tensor parallelism (a rank's
projected columns, all-reduced) each hand the module what they have. Each caller runs
here with a hook recording what entered and left the module; one `Engram.forward` over
the same hidden states, whole sequence at once, must give the same bits (torch.equal).
Each runs with the module's ``wkv`` in fp32 and kept in fp8 (`BlockFp8Linear`, as
`Engram.from_released(keep_fp8=True)` keeps it), the fp8 one also against a dense module
holding the dequantized weight.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.models.config import ModelConfig
from condmem.serving.cache import ServingCache
from condmem.serving.steps import decode_step, prefill
from condmem.models.transformer import DecoderLM
from condmem.module import Engram
from condmem.ops.block_fp8 import BlockFp8Linear

WKV = ("fp32", "fp8")


def keep_fp8(engram: Engram, exact: bool = False) -> None:
    """Replace ``wkv`` by a block-FP8 copy (blocks of 8 x 8, e8m0-like power-of-two scales), as
    `from_released(keep_fp8=True)` loads it. `exact`: scales of 1 (for weights fp8 holds exactly)."""
    w = engram.wkv.weight.detach().float()
    o, i = w.shape
    blocks = w.view(o // 8, 8, i // 8, 8)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scales = torch.ones_like(amax) if exact else torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scales[:, None, :, None]).view(o, i).to(torch.float8_e4m3fn)
    engram.wkv = BlockFp8Linear(q, scales)


def exact_projection(engram: Engram, gen: torch.Generator) -> None:
    """Table rows in multiples of 1/4 and ``wkv`` in multiples of 1/8, both in [-1, 1]: every partial
    sum of the projection is exact in fp32 (and the weights in fp8), so kv has the same bits however
    the GEMM splits its sums (over tokens: one call or many; over columns: tensor-parallel ranks).
    The rest of the layer works per token and so must agree bit for bit on its own."""
    engram.table.weight.copy_(torch.randint(-4, 5, engram.table.weight.shape, generator=gen) / 4)
    engram.wkv.weight.copy_(torch.randint(-4, 5, engram.wkv.weight.shape, generator=gen) / 8)


class Recorder:
    """What entered (hidden, row ids, token mask, rows) and left each call of one Engram module."""

    def __init__(self, engram: Engram):
        self.engram, self.calls = engram, []
        self.signature = inspect.signature(engram.forward)
        self.handle = engram.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in bound.arguments.items()}
        call["out"] = out.detach().clone()
        self.calls.append(call)

    def one_pass(self, calls: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the recorded outputs, one `Engram.forward` over the recorded inputs), both joined along T."""
        calls = list(self.calls if calls is None else calls)
        assert calls, "the caller never ran the Engram module"
        assert all(c["residual"] for c in calls), "every caller adds the update to its residual stream"

        def cat(key):
            parts = [c[key] for c in calls]
            if all(p is None for p in parts):
                return None
            if key == "token_mask":
                parts = [
                    torch.ones(c["hidden"].shape[:2], dtype=torch.bool) if p is None else p
                    for c, p in zip(calls, parts)
                ]
            return torch.cat(parts, dim=1)

        self.handle.remove()  # the reference call is not recorded
        try:
            with torch.no_grad():
                want = self.engram(
                    cat("hidden"), cat("row_ids"), cat("token_mask"), row_vectors=cat("row_vectors"), residual=True
                )
        finally:
            self.handle = self.engram.register_forward_hook(self._hook, with_kwargs=True)
        return cat("out"), want


def _tiny_lm(short_conv: bool, wkv: str) -> DecoderLM:
    ecfg = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=2,
        head_dim=8,
        table_size=53,
        hidden_size=32,
        compressed_vocab_size=40,
        short_conv=short_conv,
    )
    cfg = ModelConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, engram=ecfg, max_seq_len=32
    )
    model = DecoderLM(cfg, token_lookup=np.arange(50) % 40, sparse_tables=False).eval()
    gen = torch.Generator().manual_seed(3)
    engram = model.blocks[1].engram
    with torch.no_grad():
        exact_projection(engram, gen)
        engram.q_weight.copy_(1 + 0.5 * torch.randn(engram.q_weight.shape, generator=gen))
        if engram.short_conv is not None:
            engram.short_conv.weight.copy_(torch.randn(engram.short_conv.weight.shape, generator=gen))
    if wkv == "fp8":
        keep_fp8(engram)
    return model


@pytest.mark.parametrize("wkv", WKV)
@pytest.mark.parametrize("short_conv", [True, False], ids=["conv", "noconv"])
def test_decoder_whole_and_cached_decoding(short_conv, wkv):
    model = _tiny_lm(short_conv, wkv)
    engram = model.blocks[1].engram
    rec = Recorder(engram)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        got, want = rec.one_pass()
        assert torch.equal(got, want), "DecoderLM.forward"
        rec.calls.clear()
        cache = model.new_cache(2, 9)
        for t0, t1 in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9)):  # prefill, then steps of 1 and 2 tokens
            model(ids[:, t0:t1], cache=cache)
        assert len(rec.calls) == 5
        got, want = rec.one_pass()
        assert torch.equal(got, want), "cached decoding (ShortConv state carried between steps)"
        rec.calls.clear()
        gates = model.gate_values(ids)[1]
        assert gates.shape == (2, 9) and len(rec.calls) == 1


@pytest.mark.parametrize("wkv", WKV)
def test_serving_prefill_and_decode_steps(wkv):
    model = _tiny_lm(True, wkv)
    rec = Recorder(model.blocks[1].engram)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=gen) for n in (5, 3)]
    cache = ServingCache(model, n_slots=2, max_len=12)
    with torch.no_grad():
        last = torch.stack([prefill(model, cache, s, p)[-1] for s, p in enumerate(prompts)])
        for _ in range(3):
            last = decode_step(model, cache, None, last.argmax(-1))
    prefills, steps = rec.calls[:2], rec.calls[2:]
    assert len(steps) == 3 and all(c["hidden"].shape[:2] == (2, 1) for c in steps)
    for slot in range(2):  # one pass per slot: its prompt, then its row of every decode step
        rows = [{k: (v[slot : slot + 1] if isinstance(v, torch.Tensor) else v) for k, v in c.items()} for c in steps]
        got, want = rec.one_pass([prefills[slot], *rows])
        assert torch.equal(got, want), f"serving slot {slot} (prefill, then decode steps with ShortConv state)"


@pytest.mark.parametrize("wkv", WKV)
def test_fp8_kept_module_equals_its_dequantized_weight(wkv):
    # The fp8 module computes in its gate weights' dtype (the weight dequantized to it), as a dense
    # module holding the dequantized weight does; fp32 is the control.
    model = _tiny_lm(True, wkv)
    engram = model.blocks[1].engram
    dense = _tiny_lm(True, "fp32").blocks[1].engram
    dense.load_state_dict({k: v for k, v in engram.state_dict().items() if not k.startswith("wkv.")}, strict=False)
    with torch.no_grad():
        w = engram.wkv.dequantized(torch.float32) if wkv == "fp8" else engram.wkv.weight
        dense.wkv.weight.copy_(w)
    assert engram.compute_dtype == torch.float32
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 6, 32, generator=gen)
    rows = torch.randint(0, engram.table.num_embeddings, (2, 6, engram.n_cols), generator=gen)
    mask = torch.rand(2, 6, generator=gen) > 0.3
    with torch.no_grad():
        assert torch.equal(engram(h, rows, mask, residual=True), dense(h, rows, mask, residual=True))


# ---------------------------------------------------------------------- Hugging Face adapter
@pytest.mark.parametrize("wkv", WKV)
@pytest.mark.parametrize("tables", ["module", "memory"])
def test_hf_adapter_generate(wkv, tables):
    transformers = pytest.importorskip("transformers")
    from condmem.integrations.transformers import add_engram, get_engram, offload_tables
    from condmem.tokenizer import CompressedTokenizer
    from condmem.train.bpe import train_bpe

    text = "The quick brown fox jumps over the lazy dog. def add(x, y): return x + y\n" * 6
    tok = CompressedTokenizer.from_any(train_bpe([text], vocab_size=280), use_cache=False)
    config = transformers.LlamaConfig(
        vocab_size=tok.original_vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    add_engram(
        model,
        EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=61, pad_id=1, short_conv=True),
        tok,
    )
    engram = get_engram(model).engrams[1]
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        exact_projection(engram, gen)  # also what a bf16 memory holds exactly
        engram.short_conv.weight.copy_(torch.randn(engram.short_conv.weight.shape, generator=gen) * 0.5)
    if wkv == "fp8":
        keep_fp8(engram)
    memory = offload_tables(model, tier="host") if tables == "memory" else None
    rec = Recorder(engram)
    ids = torch.randint(2, tok.original_vocab_size, (2, 6), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding: the gate closed there
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    finally:
        if memory is not None:
            memory.close()
    assert len(rec.calls) == 4 and rec.calls[0]["token_mask"] is not None
    assert (rec.calls[0]["row_vectors"] is not None) == (tables == "memory")
    got, want = rec.one_pass()
    assert torch.equal(got, want), "HF adapter: prefill and cached steps (mask, ShortConv state)"


# ---------------------------------------------------------------------- tensor parallelism
def _tp_worker(rank: int, world: int, init_file: str) -> None:
    from condmem.distributed import ShardedRows, ShardPlan, column_parallel_engram

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = EngramConfig(
            layer_ids=[1],
            max_ngram_size=3,
            n_heads=4,
            head_dim=8,
            table_size=[101, 53],
            hidden_size=32,
            hc_mult=1,
            compressed_vocab_size=60,
            short_conv=True,
        )
        layout = EngramLayout(cfg)
        gen = torch.Generator().manual_seed(0)  # the same module on every rank
        engram = Engram(cfg, layout.layer(1).num_embeddings, layer_id=1)
        with torch.no_grad():
            exact_projection(engram, gen)  # the all-reduced kv equals one process's bit for bit
            engram.q_weight.normal_(generator=gen)
            engram.short_conv.weight.normal_(generator=gen)
        row_ids = NgramHasher(layout)(torch.randint(0, 60, (2, 7), generator=gen))[:, :, 0]
        hidden = torch.randn(2, 7, 32, generator=gen)
        mask = torch.rand(2, 7, generator=gen) > 0.3
        plan = ShardPlan.for_layer(layout.layer(1), world)
        r0, r1 = plan.rows(rank)
        for wkv in WKV:
            if wkv == "fp8":
                keep_fp8(engram, exact=True)
            shard = engram.table.weight[r0:r1]
            local = ShardedRows(plan, lambda ids, shard=shard: shard[ids], cfg.head_dim)._local(row_ids)
            with torch.no_grad():
                want = engram(hidden, row_ids, mask, residual=True)
                got = column_parallel_engram(engram, hidden, local, plan, token_mask=mask, residual=True)
            assert torch.equal(got, want), (wkv, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_column_split(tmp_path):
    # ~8 s on a 2-core CPU, nearly all of it starting two gloo ranks: one spawn covers both wkv formats.
    from ranks import spawn_ranks

    spawn_ranks(_tp_worker, 2, tmp_path / "init")
