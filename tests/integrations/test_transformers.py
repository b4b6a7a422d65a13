"""Engram in Hugging Face causal LMs: tiny models built from configs (no downloads), CPU.

Integer paths (row ids, generated tokens) are compared exactly; logits against the same
computation in fp32, with the tolerance stated at each check.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from condmem import ConfigError  # noqa: E402
from condmem.integrations.transformers import (  # noqa: E402
    EngramModelError,
    EngramOptimizer,
    EngramTrainer,
    UnsupportedModelError,
    add_engram,
    engram_optimizer,
    get_engram,
    load_pretrained,
    offload_tables,
)
from condmem.tokenizer import CompressedTokenizer, TokenizerMismatchError  # noqa: E402
from condmem.train.bpe import train_bpe  # noqa: E402
from helpers import assert_close  # noqa: E402
from hf_fixtures import PAD, engram_config, tiny_model  # noqa: E402

FILL = 0  # what padded batches hold at masked positions: another id, so that hashing it would show
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
TEXT = (
    "The quick brown fox jumps over the lazy dog. the Quick BROWN fox! "
    "def add(x, y):\n    return x + y\n\nclass Point:\n    pass\n"
) * 4


@pytest.fixture(scope="module")
def tokenizer():
    return CompressedTokenizer.from_any(train_bpe([TEXT], vocab_size=300), use_cache=False)


def randomize_engram(model, seed: int = 1) -> None:
    """Stand-in for trained Engram weights: a nonzero value projection and ShortConv."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for e in get_engram(model).engrams.values():
            e.wkv.weight.copy_(torch.randn(e.wkv.weight.shape, generator=gen) * 0.5)
            if e.short_conv is not None:
                e.short_conv.weight.copy_(torch.randn(e.short_conv.weight.shape, generator=gen) * 0.5)


def padded_batch(lengths: list[int], total: int, vocab: int, side: str, seed: int = 0):
    """(ids, mask, position_ids, sequences) with each row padded to `total` on `side`."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]
    ids = torch.full((len(seqs), total), FILL, dtype=torch.long)
    mask = torch.zeros(len(seqs), total, dtype=torch.long)
    for b, s in enumerate(seqs):
        span = slice(total - len(s), total) if side == "left" else slice(0, len(s))
        ids[b, span], mask[b, span] = s, 1
    return ids, mask, positions(mask), seqs


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def real_slice(mask_row: torch.Tensor) -> torch.Tensor:
    return mask_row.bool().nonzero().flatten()


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out):
    return getattr(out, "cache", None) if getattr(out, "cache", None) is not None else out.past_key_values


# ---------------------------------------------------------------------- insertion
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_init_engram_leaves_logits_unchanged(family, tokenizer):
    model = tiny_model(family, tokenizer.original_vocab_size)
    ids, mask, pos, _ = padded_batch([7, 4], 7, tokenizer.original_vocab_size, "left")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = model(ids, attention_mask=mask, position_ids=pos).logits
    add_engram(model, engram_config(), tokenizer)
    got = model(ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(ref, got), f"{family}: zero-initialized Engram changed the logits"
    after = dict(model.named_parameters())
    for name, value in before.items():  # existing weights: same tensors, same values
        assert torch.equal(after[name], value), name
    assert {n for n in after if n not in before} and all(".engram." in n for n in after if n not in before)


@pytest.mark.parametrize("side", ["left", "right"])
def test_row_ids_equal_each_unpadded_sequence_alone(side, tokenizer):
    model = tiny_model("llama", tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    adapter = get_engram(model)
    ids, mask, pos, seqs = padded_batch([9, 2, 5], 9, tokenizer.original_vocab_size, side)
    model(ids, attention_mask=mask, position_ids=pos)
    rows = adapter.last_row_ids
    assert rows.shape == (3, 9, 2, adapter.config.n_cols)
    for b, s in enumerate(seqs):
        alone = adapter.hasher(s[None])[0]
        assert torch.equal(rows[b, real_slice(mask[b])], alone), f"row {b} ({side} padding)"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_left_and_right_padding_give_the_same_logits(family, tokenizer):
    model = tiny_model(family, tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    randomize_engram(model)
    out = {}
    for side in ("left", "right"):
        ids, mask, pos, _ = padded_batch([8, 3, 6], 8, tokenizer.original_vocab_size, side)
        logits = model(ids, attention_mask=mask, position_ids=pos).logits
        out[side] = [logits[b, real_slice(mask[b])] for b in range(3)]
    for b in range(3):  # fp32, same maths on differently laid-out batches
        assert_close(f"{family} row {b}", out["left"][b], out["right"][b], atol=1e-5)


# ---------------------------------------------------------------------- generation
def greedy_full_forward(model, ids, mask, n: int) -> torch.Tensor:
    for _ in range(n):
        logits = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_left_padded_equals_step_by_step_full_forward(family, tokenizer):
    model = tiny_model(family, tokenizer.original_vocab_size)
    add_engram(model, engram_config(short_conv=family in ("llama", "gpt2")), tokenizer)
    randomize_engram(model)
    ids, mask, _, _ = padded_batch([6, 2, 4], 6, tokenizer.original_vocab_size, "left")
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        ref = greedy_full_forward(model, ids, mask, 6)
        # A static cache makes generate() hand the layers a 4-D mask: padding must still be seen.
        static = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static"
        )
    assert torch.equal(got, ref)
    assert torch.equal(static, ref)


def test_beam_search_and_sampling_with_cache_equal_without(tokenizer):
    model = tiny_model("llama", tokenizer.original_vocab_size)
    add_engram(model, engram_config(short_conv=True), tokenizer)
    randomize_engram(model)
    ids, mask, _, _ = padded_batch([5, 3], 5, tokenizer.original_vocab_size, "left")
    runs = {
        "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
        "sample": dict(do_sample=True, top_k=8, num_return_sequences=2),
    }
    for name, kw in runs.items():
        out = {}
        for use_cache in (True, False):
            torch.manual_seed(3)
            with torch.no_grad():
                out[use_cache] = model.generate(ids, attention_mask=mask, max_new_tokens=5, use_cache=use_cache, **kw)
        assert torch.equal(out[True], out[False]), name


def test_cache_crops_and_chunked_prefill(tokenizer):
    """Prompt-lookup decoding crops the cache after rejected guesses; chunked prefill fills it in pieces."""
    vocab = tokenizer.original_vocab_size
    prompt = torch.randint(2, vocab, (1, 8), generator=torch.Generator().manual_seed(4)).repeat(1, 3)
    for short_conv in (False, True):
        model = tiny_model("llama", vocab)
        add_engram(model, engram_config(short_conv=short_conv), tokenizer)
        randomize_engram(model)
        with torch.no_grad():
            ref = model.generate(prompt, max_new_tokens=8, do_sample=False)
            chunked = model.generate(prompt, max_new_tokens=8, do_sample=False, prefill_chunk_size=5)
            assert torch.equal(ref, chunked)
            if short_conv:  # the ShortConv's per-sequence inputs cannot be cropped: refused, never guessed
                with pytest.raises(EngramModelError, match="short_conv=False"):
                    model.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
            else:
                lookup = model.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
                assert torch.equal(ref, lookup)


def test_manual_cached_steps_equal_full_forward(tokenizer):
    model = tiny_model("qwen3", tokenizer.original_vocab_size)
    add_engram(model, engram_config(short_conv=True), tokenizer)
    randomize_engram(model)
    ids, mask, pos, _ = padded_batch([5, 3], 5, tokenizer.original_vocab_size, "left")
    key = cache_kwarg(model)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, full_ids, full_mask = returned_cache(out), ids, mask
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            full_ids = torch.cat([full_ids, nxt], 1)
            full_mask = torch.cat([full_mask, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=full_mask, position_ids=positions(full_mask)[:, -1:], **{key: cache})
            cache = returned_cache(out)
            ref = model(full_ids, attention_mask=full_mask, position_ids=positions(full_mask), use_cache=False)
            assert_close("cached step", ref.logits[:, -1], out.logits[:, -1], atol=1e-5)
        # A cache this model did not fill (here: a copy) has no n-gram history: refused, not guessed.
        with pytest.raises(EngramModelError, match="cache"):
            model(nxt, attention_mask=torch.cat([full_mask, torch.ones_like(nxt)], 1), **{key: copy.deepcopy(cache)})


# ---------------------------------------------------------------------- memory tiers
def test_tables_in_host_memory_give_the_same_logits_and_tokens(tokenizer):
    model = tiny_model("llama", tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    randomize_engram(model)
    with torch.no_grad():  # the memory stores bf16 rows: start from bf16-exact tables
        for e in get_engram(model).engrams.values():
            e.table.weight.copy_(e.table.weight.bfloat16().float())
    ids, mask, pos, _ = padded_batch([6, 3], 6, tokenizer.original_vocab_size, "left")
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask, position_ids=pos).logits
        ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    memory = offload_tables(model, tier="host")
    try:
        assert all(e.table.weight.device.type == "meta" for e in get_engram(model).engrams.values())
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=pos).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert_close("host-tier logits", ref_logits, logits, atol=1e-6)
        assert torch.equal(ref_tokens, tokens)
    finally:
        memory.close()


# ---------------------------------------------------------------------- training
def training_batch(vocab: int):
    ids, mask, pos, seqs = padded_batch([12, 7, 10, 12], 12, vocab, "right", seed=5)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels, seqs


def rows_read(model, seqs) -> set[int]:
    adapter = get_engram(model)
    return {int(r) for s in seqs for r in adapter.hasher(s[None])[0, :, 0].unique()}


def test_plain_loop_lowers_loss_and_moves_only_rows_it_read(tokenizer):
    model = tiny_model("llama", tokenizer.original_vocab_size).train()
    add_engram(model, engram_config().replace(layer_ids=[1]), tokenizer)
    table = get_engram(model).engrams[1].table.weight
    start = table.detach().clone()
    ids, mask, labels, seqs = training_batch(tokenizer.original_vocab_size)
    opt = engram_optimizer(model, lr=3e-3, max_grad_norm=1.0)
    losses = []
    for _ in range(8):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        assert table.grad.is_sparse
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    moved = set((table.detach() != start).any(1).nonzero().flatten().tolist())
    assert moved and moved <= rows_read(model, seqs)


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer):
    vocab = tokenizer.original_vocab_size
    ids, mask, labels, _ = training_batch(vocab)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("llama", vocab).train()
        add_engram(model, engram_config(), tokenizer)
        randomize_engram(model)
        if checkpointing:  # the method's newer name where there is one
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(
            {
                n: p.grad.to_dense() if p.grad.is_sparse else p.grad
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:  # the same maths, recomputed: fp32 rounding at most
        assert_close(name, grads[0][name], grads[1][name], atol=1e-6)


def test_trainer_lowers_loss_and_moves_only_rows_it_read(tokenizer, tmp_path):
    model = tiny_model("qwen2", tokenizer.original_vocab_size).train()
    add_engram(model, engram_config().replace(layer_ids=[1]), tokenizer)
    table = get_engram(model).engrams[1].table.weight
    start = table.detach().clone()
    backbone = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    ids, mask, labels, seqs = training_batch(tokenizer.original_vocab_size)
    data = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)] * 4
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
    )
    trainer = EngramTrainer(
        model=model, args=args, train_dataset=data, optimizers=(engram_optimizer(model, lr=3e-3), None)
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    moved = set((table.detach() != start).any(1).nonzero().flatten().tolist())
    assert moved and moved <= rows_read(model, seqs)
    assert not torch.equal(model.model.layers[1].mlp.up_proj.weight, backbone)


# ---------------------------------------------------------------------- save / load
def test_save_pretrained_and_load_round_trip(tokenizer, tmp_path):
    model = tiny_model("mistral", tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    randomize_engram(model)
    ids, mask, pos, _ = padded_batch([6, 4], 6, tokenizer.original_vocab_size, "left")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # small shards: the index path is the one read
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_pretrained(tmp_path, tokenizer).eval()
    with torch.no_grad():
        got = loaded(ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(ref, got)
    assert get_engram(loaded).layout.fingerprint == get_engram(model).layout.fingerprint

    other = CompressedTokenizer.from_any(train_bpe([TEXT.upper() + " 0123456789"], vocab_size=290), use_cache=False)
    with pytest.raises(TokenizerMismatchError, match="fingerprint"):
        load_pretrained(tmp_path, other)


# ---------------------------------------------------------------------- refusals
def test_refusals_name_the_problem(tokenizer):
    vocab = tokenizer.original_vocab_size
    with pytest.raises(UnsupportedModelError, match="OPTForCausalLM"):
        add_engram(
            transformers.OPTForCausalLM(
                transformers.OPTConfig(
                    vocab_size=vocab,
                    hidden_size=16,
                    num_hidden_layers=1,
                    ffn_dim=32,
                    num_attention_heads=2,
                    word_embed_proj_dim=16,
                )
            ),
            engram_config(),
            tokenizer,
        )
    with pytest.raises(UnsupportedModelError, match="LlamaModel"):
        add_engram(tiny_model("llama", vocab).model, engram_config(), tokenizer)
    with pytest.raises(EngramModelError, match=r"\[5\] do not exist"):
        add_engram(tiny_model("llama", vocab), engram_config().replace(layer_ids=[1, 5]), tokenizer)
    with pytest.raises(TokenizerMismatchError, match="silently rehashed"):
        add_engram(
            tiny_model("llama", vocab),
            engram_config().replace(compressed_vocab_size=tokenizer.vocab_size + 1),
            tokenizer,
        )
    model = add_engram(tiny_model("gpt2", vocab), engram_config(), tokenizer)
    with pytest.raises(EngramModelError, match="already has Engram"):
        add_engram(model, engram_config(), tokenizer)
    with pytest.raises(EngramModelError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 3, 32))


def test_save_pretrained_after_offload_writes_the_tables_and_reloads_equal(tokenizer, tmp_path):
    model = tiny_model("llama", tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    randomize_engram(model)
    ids, mask, pos, _ = padded_batch([6, 3], 6, tokenizer.original_vocab_size, "left")
    model.save_pretrained(tmp_path / "plain")
    memory = offload_tables(model, tier="host")  # the memory holds bf16 rows
    try:
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, position_ids=pos).logits
        model.save_pretrained(tmp_path / "offloaded", max_shard_size="40KB")
    finally:
        memory.close()
    from safetensors.torch import load_file

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    plain, offloaded = tensors(tmp_path / "plain"), tensors(tmp_path / "offloaded")
    assert plain.keys() == offloaded.keys()  # the same tensors, names, dtypes and shapes
    for name, t in plain.items():
        assert offloaded[name].dtype == t.dtype and offloaded[name].shape == t.shape, name
        expect = t.bfloat16().float() if name.endswith("engram.table.weight") else t  # rows as the memory held them
        assert torch.equal(offloaded[name], expect), name
    loaded = load_pretrained(tmp_path / "offloaded", tokenizer).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask, position_ids=pos).logits, ref)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_a_failing_save_leaves_no_half_written_folder(tokenizer, tmp_path, monkeypatch):
    model = tiny_model("llama", tokenizer.original_vocab_size)
    add_engram(model, engram_config(), tokenizer)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "notes.txt").write_text("{}")  # saved beside the model earlier, not by the save: kept
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", broken)  # fails after config.json
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(tmp_path / "new")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    monkeypatch.undo()
    randomize_engram(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "{}"
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() != before["model.safetensors"]


def _trainer_args(tmp_path, **changes):
    return transformers.TrainingArguments(
        **{
            **dict(
                output_dir=str(tmp_path),
                per_device_train_batch_size=4,
                max_steps=6,
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                lr_scheduler_type="constant",
                max_grad_norm=1.0,
                learning_rate=3e-3,
            ),
            **changes,
        }
    )


def test_plain_trainer_with_engram_optimizer_trains_and_clips_sparse_gradients(tokenizer, tmp_path):
    # transformers.Trainer measures and clips with torch.nn.utils.clip_grad_norm_, which before torch 2.14 has no norm
    # for sparse gradients: engram_optimizer gives torch one (each row counted once), so a plain Trainer trains.
    model = tiny_model("llama", tokenizer.original_vocab_size).train()
    add_engram(model, engram_config().replace(layer_ids=[1]), tokenizer)
    table = get_engram(model).engrams[1].table.weight
    start = table.detach().clone()
    ids, mask, labels, seqs = training_batch(tokenizer.original_vocab_size)
    data = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)] * 4
    trainer = transformers.Trainer(
        model=model,
        args=_trainer_args(tmp_path),
        train_dataset=data,
        optimizers=(engram_optimizer(model, lr=3e-3), None),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6 and logs[-1]["loss"] < logs[0]["loss"] - 0.1, logs
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in logs)
    moved = set((table.detach() != start).any(1).nonzero().flatten().tolist())
    assert moved and moved <= rows_read(model, seqs)


def test_sparse_gradient_norm_counts_each_row_once():
    from condmem.integrations.transformers.optim import enable_sparse_grad_norm

    enable_sparse_grad_norm()
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    lin(emb(torch.tensor([1, 1, 3, 1]))).sum().backward()  # repeated rows: an uncoalesced gradient
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    dense = [emb.weight.grad.to_dense(), lin.weight.grad.clone(), lin.bias.grad.clone()]
    ref = torch.cat([g.flatten() for g in dense]).double().norm()
    got = torch.nn.utils.clip_grad_norm_([emb.weight, lin.weight, lin.bias], 0.1)
    assert_close("total norm", ref.float(), got, atol=1e-6)
    scale = 0.1 / (ref.item() + 1e-6)
    assert_close("clipped sparse gradient", dense[0] * scale, emb.weight.grad.to_dense(), atol=1e-7)


def test_engram_trainer_builds_its_optimizer(tokenizer, tmp_path):
    model = tiny_model("llama", tokenizer.original_vocab_size).train()
    add_engram(model, engram_config().replace(layer_ids=[1]), tokenizer)
    ids, mask, labels, _ = training_batch(tokenizer.original_vocab_size)
    data = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)] * 4
    trainer = EngramTrainer(model=model, args=_trainer_args(tmp_path, weight_decay=0.01), train_dataset=data)
    trainer.train()
    logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6 and logs[-1] < logs[0] - 0.1, logs
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, EngramOptimizer)
    assert opt.tables.param_groups[0]["lr"] == 5 * opt.backbone.param_groups[0]["lr"] == 5 * 3e-3
    assert opt.backbone.param_groups[0]["weight_decay"] == 0.01


# ---------------------------------------------------------------------- pad id
def test_pad_id_none_says_what_to_pass():
    with pytest.raises(ConfigError, match=r"pad_id is None.*pad_token_id.*eos_token_id"):
        engram_config().replace(pad_id=None)


def test_pad_id_is_checked_against_the_tokenizer(tokenizer, caplog):
    from tokenizers import Tokenizer

    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.tokenizer.to_str()), pad_token="<|pad|>"
    )
    assert hf_tok.pad_token_id == PAD
    vocab = tokenizer.original_vocab_size
    with pytest.raises(ConfigError, match=rf"pad_id {vocab + 5} is not a token id of .*0\.\.{vocab - 1}.*pad_id={PAD}"):
        add_engram(tiny_model("llama", vocab), engram_config().replace(pad_id=vocab + 5), hf_tok)
    with caplog.at_level("WARNING", logger="condmem"):
        add_engram(tiny_model("llama", vocab), engram_config().replace(pad_id=2), hf_tok)
    assert f"pad_id is 2 but the tokenizer's pad token is id {PAD}" in caplog.text and f"pad_id={PAD}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="condmem"):
        add_engram(tiny_model("llama", vocab), engram_config(), hf_tok)  # pad_id=PAD: nothing to say
    assert "pad" not in caplog.text


# ---------------------------------------------------------------------- removal
def test_remove_engram_restores_the_model_and_add_engram_works_again(tokenizer, tmp_path):
    from condmem.integrations.transformers import remove_engram

    model = tiny_model("qwen2", tokenizer.original_vocab_size)
    ids, mask, pos, _ = padded_batch([6, 4], 6, tokenizer.original_vocab_size, "left")
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, position_ids=pos).logits
        plain_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    names = [n for n, _ in model.named_parameters()]
    add_engram(model, engram_config(), tokenizer)
    randomize_engram(model)
    assert remove_engram(model) is model
    assert [n for n, _ in model.named_parameters()] == names and not hasattr(model.config, "condmem_engram")
    assert not {"prepare_inputs_for_generation", "_reorder_cache", "save_pretrained"} & set(vars(model))
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, plain)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), plain_tokens)
    with pytest.raises(EngramModelError, match="has no Engram"):
        get_engram(model)
    add_engram(
        model, engram_config(short_conv=False).replace(layer_ids=[1]), tokenizer
    )  # works again, another geometry
    assert sorted(get_engram(model).engrams) == [1]
    model.save_pretrained(tmp_path)
    assert load_pretrained(tmp_path, tokenizer) is not None
