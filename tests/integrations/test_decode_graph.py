"""HF `generate()` decode steps replayed from CUDA graphs (`decode_graph`) against the eager path.

Tokens, logits and row ids must be bit-equal (`torch.equal`): the graphs replay the eager
path's own kernels on the same inputs. Controls: a weight changed in place changes the
graph's output as it changes the eager one's; a replaced parameter, another memory or
another batch shape is captured anew; where a graph would not be exact (ShortConv, a
vocabulary past the hasher's ids) nothing is captured.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from condmem.integrations.transformers import add_engram, get_engram, offload_tables  # noqa: E402
from condmem.tokenizer import CompressedTokenizer  # noqa: E402
from condmem.train.bpe import train_bpe  # noqa: E402
from hf_fixtures import engram_config, tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

TEXT = ("The quick brown fox jumps over the lazy dog. def add(x, y):\n    return x + y\n") * 8
LAYERS = (0, 2)  # engram_config's


@pytest.fixture(scope="module")
def tokenizer():
    return CompressedTokenizer.from_any(train_bpe([TEXT], vocab_size=300), use_cache=False)


def build(tokenizer, *, short_conv: bool = False, tier: str | None = None):
    # Eager attention (matmuls and a softmax): the same logits on every run.
    model = tiny_model("llama", tokenizer.original_vocab_size, attn_implementation="eager").cuda()
    add_engram(model, engram_config(short_conv), tokenizer, zero_init=False)
    memory = offload_tables(model, tier=tier) if tier is not None else None
    return model, get_engram(model), memory


def batch(vocab: int, rows: int = 3, length: int = 9, seed: int = 0):
    """Left-padded prompts (row b has b pads): masks with zeros inside the decode steps' look-back."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    for b in range(rows):
        ids[b, :b], mask[b, :b] = 0, 0
    return ids.cuda(), mask.cuda()


def generate(model, ids, mask, graphs: bool, new: int = 8):
    get_engram(model).decode_graphs = graphs
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        min_new_tokens=new,
        max_new_tokens=new,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


def assert_same(a, b, what: str) -> None:
    assert torch.equal(a[0], b[0]), f"{what}: tokens differ"
    assert torch.equal(a[1], b[1]), f"{what}: logits differ"


@pytest.mark.parametrize("tier", [None, "hbm", "host"])
def test_graphed_decode_equals_eager(tier, tokenizer):
    model, adapter, memory = build(tokenizer, tier=tier)
    ids, mask = batch(tokenizer.original_vocab_size)
    with torch.no_grad():
        eager = generate(model, ids, mask, graphs=False)
        assert_same(generate(model, ids, mask, graphs=False), eager, "eager twice (the model's own run-to-run)")
        assert adapter._graphs.captures == 0
        graphed = generate(model, ids, mask, graphs=True)
    assert_same(graphed, eager, f"tables {tier or 'in the modules'}")
    assert adapter._graphs.captures == 1 + len(LAYERS)  # the front, then each Engram layer
    # The last step's row ids, read from the graph's buffer, are the eager step's.
    graph_rows = adapter.last_row_ids.clone()
    generate(model, ids, mask, graphs=False)
    assert torch.equal(graph_rows, adapter.last_row_ids)
    if memory is not None:
        memory.close()


def test_graphs_replayed_across_generates_and_recaptured_per_shape(tokenizer):
    model, adapter, _ = build(tokenizer)
    ids, mask = batch(tokenizer.original_vocab_size)
    generate(model, ids, mask, graphs=True)
    generate(model, ids, mask, graphs=True)
    assert adapter._graphs.captures == 3  # the second generate replays the first one's graphs
    ids2, mask2 = batch(tokenizer.original_vocab_size, rows=5, seed=1)
    assert_same(generate(model, ids2, mask2, graphs=True), generate(model, ids2, mask2, graphs=False), "5 rows")
    assert adapter._graphs.captures == 6
    # The first shape's graphs are still there, and still right.
    assert_same(generate(model, ids, mask, graphs=True), generate(model, ids, mask, graphs=False), "3 rows again")
    assert adapter._graphs.captures == 6


def test_graphs_read_weights_in_place_and_recapture_replaced_ones(tokenizer):
    model, adapter, _ = build(tokenizer)
    ids, mask = batch(tokenizer.original_vocab_size)
    before = generate(model, ids, mask, graphs=True)
    engram = adapter.engrams[LAYERS[0]]
    with torch.no_grad():
        engram.wkv.weight.mul_(3.0)  # in place: the captured graph reads the new values
    changed = generate(model, ids, mask, graphs=True)
    assert adapter._graphs.captures == 3
    assert not torch.equal(changed[1], before[1]), "negative control: the weight change must show in the logits"
    assert_same(changed, generate(model, ids, mask, graphs=False), "weights changed in place")
    engram.wkv.weight = torch.nn.Parameter(engram.wkv.weight.detach() * 0.5)  # a new tensor: captured anew
    replaced = generate(model, ids, mask, graphs=True)
    assert adapter._graphs.captures == 4
    assert_same(replaced, generate(model, ids, mask, graphs=False), "a replaced parameter")


def test_switching_memory_captures_anew(tokenizer):
    from condmem.serving.memory import EngramMemory

    model, adapter, _ = build(tokenizer)
    weights = {lid: adapter.engrams[lid].table.weight.detach().clone() for lid in LAYERS}
    hbm = offload_tables(model, tier="hbm")
    ids, mask = batch(tokenizer.original_vocab_size)
    with torch.no_grad():
        on_hbm = generate(model, ids, mask, graphs=True)
        assert adapter._graphs.captures == 3
        # Another memory of other rows: its graphs read its tables, not the first memory's.
        other = EngramMemory.from_weights(
            adapter.hasher, {lid: w * 2 for lid, w in weights.items()}, tier="hbm", device="cuda"
        )
        adapter.memory = other
        graphed = generate(model, ids, mask, graphs=True)
        assert adapter._graphs.captures == 6
        assert_same(graphed, generate(model, ids, mask, graphs=False), "the second memory")
        assert not torch.equal(graphed[1], on_hbm[1]), "negative control: the other rows must change the logits"
        adapter.memory = hbm
        assert_same(generate(model, ids, mask, graphs=True), on_hbm, "back to the first memory")
    other.close()
    hbm.close()


@pytest.mark.parametrize("case", ["short_conv", "switched_off"])
def test_no_graph_where_it_would_not_be_exact(case, tokenizer):
    model, adapter, _ = build(tokenizer, short_conv=case == "short_conv")
    ids, mask = batch(tokenizer.original_vocab_size)
    eager = generate(model, ids, mask, graphs=False)
    got = generate(model, ids, mask, graphs=case != "switched_off")
    assert adapter._graphs.captures == 0
    assert_same(got, eager, case)


def test_no_graph_once_the_model_can_sample_ids_past_the_hasher(tokenizer):
    """Graphs hash sampled tokens unchecked: a model whose output grew past the hasher's ids runs eager."""
    model, adapter, _ = build(tokenizer)
    step = torch.ones(2, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        assert adapter._graphs.usable(step)
        model.resize_token_embeddings(adapter.hasher.vocab_size + 8)
        assert not adapter._graphs.usable(step)
