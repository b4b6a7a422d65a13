"""A saved Engram model through transformers' own entry points: AutoModelForCausalLM with
trust_remote_code, the tokenizer saved beside the weights, a plain Trainer's optimizer, the
model's repr, and the rules for Engram layers and the pad id (tiny models from configs, CPU).

Logits of a reloaded model are compared with torch.equal: the same weights, the same maths.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402

from condmem import ConfigError, EngramConfig  # noqa: E402
from condmem.integrations.transformers import (  # noqa: E402
    EngramModelError,
    EngramTrainer,
    add_engram,
    engram_summary,
    get_engram,
    load_pretrained,
    offload_tables,
    remove_engram,
)
from condmem.integrations.transformers import optim as engram_optim  # noqa: E402
from condmem.integrations.transformers import pretrained, saving  # noqa: E402
from condmem.tokenizer import CompressedTokenizer, TokenizerMismatchError  # noqa: E402
from condmem.train.bpe import train_bpe  # noqa: E402
from hf_fixtures import PAD, engram_config, tiny_model  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. def add(x, y):\n    return x + y\n") * 6


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe([TEXT], vocab_size=300)


@pytest.fixture(scope="module")
def hf_tok(bpe):
    """A transformers tokenizer with a pad token ("<|pad|>" = PAD)."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token="<|pad|>", eos_token="<|endoftext|>"
    )


def randomize(model, seed: int = 1) -> None:
    """Stand-in for trained Engram weights: a nonzero value projection and ShortConv."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for e in get_engram(model).engrams.values():
            e.wkv.weight.copy_(torch.randn(e.wkv.weight.shape, generator=gen) * 0.5)
            if e.short_conv is not None:
                e.short_conv.weight.copy_(torch.randn(e.short_conv.weight.shape, generator=gen) * 0.5)


def batch(vocab: int):
    ids = torch.randint(2, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    return ids, mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def saved_engram_model(family: str, tokenizer, folder):
    model = tiny_model(family, len(tokenizer))
    add_engram(model, engram_config(), tokenizer)
    randomize(model)
    model.save_pretrained(folder)
    return model


# ---------------------------------------------------------------------- standard loading
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_auto_model_with_trust_remote_code_reloads_engram_with_equal_logits(family, hf_tok, tmp_path):
    model = saved_engram_model(family, hf_tok, tmp_path / "ckpt")
    ids, mask = batch(len(hf_tok))
    ref = logits(model, ids, mask)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert {"modeling_condmem.py", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names), names

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True).eval()
    assert type(loaded) is type(model)
    assert torch.equal(logits(loaded, ids, mask), ref)
    assert get_engram(loaded).layout.fingerprint == get_engram(model).layout.fingerprint
    assert not hasattr(loaded.config, "auto_map")  # the class loaded is transformers' own

    # Negative control: the backbone class alone reads the same folder as a plain model, other logits.
    plain = type(model).from_pretrained(tmp_path / "ckpt").eval()
    assert getattr(plain, "_condmem_engram", None) is None
    assert not torch.equal(logits(plain, ids, mask), ref)


def test_a_reloaded_model_saves_and_reloads_again(hf_tok, tmp_path):
    model = saved_engram_model("llama", hf_tok, tmp_path / "a")
    ids, mask = batch(len(hf_tok))
    once = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", trust_remote_code=True)
    once.save_pretrained(tmp_path / "b")
    twice = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", trust_remote_code=True).eval()
    assert torch.equal(logits(twice, ids, mask), logits(model, ids, mask))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "b", trust_remote_code=True)
    assert tokenizer.pad_token_id == PAD and tokenizer("def add").input_ids == hf_tok("def add").input_ids


def test_auto_model_without_trust_remote_code_refuses_instead_of_a_plain_model(hf_tok, tmp_path, monkeypatch):
    saved_engram_model("llama", hf_tok, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "condmem_engram" and config["condmem_engram"]["backbone_model_type"] == "llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_condmem.EngramAutoModelForCausalLM"
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")

    # Negative control: a folder written without the model type and auto_map (how it was saved
    # before) loads through the same call as a plain model, silently, with other logits.
    monkeypatch.setattr(saving, "_write_engram_files", lambda model, folder, target: None)
    model = saved_engram_model("llama", hf_tok, tmp_path / "old")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "old").eval()
    ids, mask = batch(len(hf_tok))
    assert getattr(plain, "_condmem_engram", None) is None
    assert not torch.equal(logits(plain, ids, mask), logits(model, ids, mask))
    assert torch.equal(logits(load_pretrained(tmp_path / "old", hf_tok), ids, mask), logits(model, ids, mask))


def test_the_remote_code_file_names_condmem_when_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "condmem.integrations.transformers.pretrained", None)  # import fails
    with pytest.raises(ImportError, match=r"needs the condmem package.*pip install \"condmem\[hf\]\""):
        exec(compile(saving._REMOTE_CODE, "modeling_condmem.py", "exec"), {})
    monkeypatch.undo()
    namespace: dict = {}
    exec(compile(saving._REMOTE_CODE, "modeling_condmem.py", "exec"), namespace)
    assert namespace["EngramAutoModelForCausalLM"] is pretrained.EngramAutoModelForCausalLM


def test_load_pretrained_takes_the_saved_tokenizer(bpe, hf_tok, tmp_path):
    # A bare tokenizers.Tokenizer (through a CompressedTokenizer) is saved as tokenizer.json + tokenizer_config.json.
    ctok = CompressedTokenizer.from_any(Tokenizer.from_str(bpe.to_str()), use_cache=False)
    model = tiny_model("qwen2", ctok.original_vocab_size)
    add_engram(model, engram_config(), ctok)
    randomize(model)
    model.save_pretrained(tmp_path / "ckpt")
    ids, mask = batch(ctok.original_vocab_size)
    ref = logits(model, ids, mask)
    assert torch.equal(logits(load_pretrained(tmp_path / "ckpt"), ids, mask), ref)
    assert torch.equal(logits(load_pretrained(tmp_path / "ckpt", ctok), ids, mask), ref)  # still accepted

    # A folder without a tokenizer needs one passed; another tokenizer in it is refused.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ckpt" / name).unlink()
    with pytest.raises(EngramModelError, match=r"holds no tokenizer.*load_pretrained\("):
        load_pretrained(tmp_path / "ckpt")
    other = train_bpe([TEXT.upper() + " 0123456789"], vocab_size=290)
    (tmp_path / "ckpt" / "tokenizer.json").write_text(other.to_str())
    with pytest.raises(TokenizerMismatchError, match="does not give the compressed map"):
        load_pretrained(tmp_path / "ckpt")
    assert torch.equal(logits(load_pretrained(tmp_path / "ckpt", hf_tok), ids, mask), ref)


def test_push_to_hub_uploads_the_complete_folder(hf_tok, tmp_path, monkeypatch):
    import huggingface_hub

    uploaded = {}

    def create_repo(self, repo_id, **kwargs):
        return huggingface_hub.RepoUrl(f"https://huggingface.co/user/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploaded[repo_id] = sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    model = tiny_model("llama", len(hf_tok))
    add_engram(model, engram_config(), hf_tok)
    model.save_pretrained(tmp_path / "my-model", push_to_hub=True)
    assert {"modeling_condmem.py", "tokenizer.json", "config.json", "model.safetensors"} <= set(
        uploaded["user/my-model"]
    )


def test_load_pretrained_downloads_a_hub_repository(hf_tok, tmp_path, monkeypatch):
    import huggingface_hub

    model = saved_engram_model("llama", hf_tok, tmp_path / "ckpt")
    asked, real = [], huggingface_hub.snapshot_download

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs["revision"]))
        return str(tmp_path / "ckpt") if repo_id == "user/model" else real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    ids, mask = batch(len(hf_tok))
    loaded = load_pretrained("user/model", revision="v1")
    assert asked == [("user/model", "v1")] and torch.equal(logits(loaded, ids, mask), logits(model, ids, mask))
    with pytest.raises(EngramModelError, match="user/nothing is neither a folder nor a Hub repository"):
        load_pretrained("user/nothing", local_files_only=True)  # (no network: not in the local cache)


# ---------------------------------------------------------------------- a plain Trainer
def _training_data(vocab: int):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, vocab, (8, 12), generator=gen)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def _args(tmp_path):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=1e-2,
    )


def test_plain_trainer_fails_at_its_first_step_naming_engram_trainer(hf_tok, tmp_path, monkeypatch):
    model = tiny_model("llama", len(hf_tok)).train()
    add_engram(model, engram_config(), hf_tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=_training_data(len(hf_tok)))
    refusal = r"AdamW cannot step .*engram\.table\.weight.*EngramTrainer.*engram_optimizer"
    with pytest.raises(EngramModelError, match=refusal):
        trainer.train()
    for name, p in model.named_parameters():  # refused before any weight moved
        assert torch.equal(p.detach(), before[name]), name

    # A plain loop's AdamW is refused the same way.
    ids = torch.randint(2, len(hf_tok), (2, 6))
    model(ids, labels=ids).loss.backward()
    with pytest.raises(EngramModelError, match="engram_optimizer"):
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()

    # Negative control: without condmem's check, torch's own message points at the wrong fix.
    monkeypatch.setattr(engram_optim, "_accepts_sparse", lambda optimizer: True)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()


def test_engram_trainer_and_dense_tables_still_train(hf_tok, tmp_path):
    model = tiny_model("llama", len(hf_tok)).train()
    add_engram(model, engram_config(), hf_tok)
    table = get_engram(model).engrams[0].table.weight
    start = table.detach().clone()
    EngramTrainer(model=model, args=_args(tmp_path), train_dataset=_training_data(len(hf_tok))).train()
    assert not torch.equal(table.detach(), start)

    dense = tiny_model("llama", len(hf_tok)).train()
    add_engram(dense, engram_config(), hf_tok, sparse_tables=False)
    table = get_engram(dense).engrams[0].table.weight
    start = table.detach().clone()
    transformers.Trainer(model=dense, args=_args(tmp_path), train_dataset=_training_data(len(hf_tok))).train()
    assert not torch.equal(table.detach(), start)


# ---------------------------------------------------------------------- repr
def test_print_model_says_what_engram_added(hf_tok):
    model = tiny_model("llama", len(hf_tok))
    assert "Engram" not in repr(model)  # control: a plain model
    add_engram(model, engram_config(), hf_tok)
    adapter = get_engram(model)
    rows = {lid: adapter.layout.layer(lid).num_embeddings for lid in (0, 2)}
    tables = sum(rows.values()) * 8
    engram = sum(p.numel() for e in adapter.engrams.values() for p in e.parameters())
    total = sum(p.numel() for p in model.parameters())
    text = repr(model)
    head = text.splitlines()[1]
    assert head.strip() == "Engram at decoder layers [0, 2] of LlamaForCausalLM: 2- to 3-grams, 2 heads, rows of 8"
    assert f"tables: {sum(rows.values()):,} rows (layer 0: {rows[0]:,}, layer 2: {rows[2]:,}) = {tables:,} " in text
    assert "in the modules (sparse gradients)" in text
    assert f"projections, norms and ShortConv: {engram - tables:,} parameters" in text
    assert f"Engram: {engram:,} of {total:,} parameters" in text
    summary = [line.strip() for line in engram_summary(model).splitlines()]
    assert [line.strip() for line in text.splitlines()[1:5]] == summary  # print(model) opens with the summary

    memory = offload_tables(model, tier="host")
    try:
        assert "in an EngramMemory: host (bf16)" in repr(model) and "not trained" in repr(model)
    finally:
        memory.close()
    remove_engram(model)
    assert "Engram" not in repr(model)
    with pytest.raises(EngramModelError, match="has no Engram"):
        engram_summary(model)


# ---------------------------------------------------------------------- one source of truth
def test_layers_disagreeing_with_the_config_are_refused(hf_tok):
    model = tiny_model("llama", len(hf_tok))
    config = engram_config().replace(layer_ids=[1])
    with pytest.raises(ConfigError, match=r"layers=\[2\]\) disagrees with EngramConfig\.layer_ids \[1\]"):
        add_engram(model, config, hf_tok, layers=[2])
    assert getattr(model, "_condmem_engram", None) is None and not hasattr(model.model.layers[2], "engram")
    with pytest.raises(ConfigError, match="disagrees"):  # the order lays out the tables: another order differs
        add_engram(model, engram_config(), hf_tok, layers=[2, 0])
    add_engram(model, config, hf_tok, layers=[1])  # the same list: accepted
    assert sorted(get_engram(model).engrams) == [1]


def test_an_unstated_pad_id_comes_from_the_tokenizer_or_is_refused(bpe, hf_tok):
    geometry = dict(layer_ids=[0], max_ngram_size=3, n_heads=2, head_dim=8, table_size=61)
    unstated = EngramConfig(**geometry)
    assert not unstated.pad_id_stated and unstated.pad_id == 2
    assert EngramConfig(**geometry, pad_id=2).pad_id_stated

    model = add_engram(tiny_model("llama", len(hf_tok)), unstated, hf_tok)
    adapter = get_engram(model)
    assert adapter.config.pad_id == PAD and adapter.config.pad_id_stated
    # Negative control: the old default (2) hashes the look-back before a sequence's start differently.
    ids = torch.randint(3, len(hf_tok), (1, 5))
    old = add_engram(tiny_model("llama", len(hf_tok)), EngramConfig(**geometry, pad_id=2), hf_tok)
    assert not torch.equal(adapter.row_ids(ids)[:, :2], get_engram(old).row_ids(ids)[:, :2])

    no_pad = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()), eos_token="<|endoftext|>"
    )
    assert no_pad.pad_token_id is None
    for tokenizer in (no_pad, CompressedTokenizer.from_any(bpe, use_cache=False)):
        with pytest.raises(ConfigError, match=r"states no pad_id .*no pad token.*pad_id=tokenizer\.eos_token_id"):
            add_engram(tiny_model("llama", len(hf_tok)), unstated, tokenizer)
    add_engram(tiny_model("llama", len(hf_tok)), unstated.replace(pad_id=no_pad.eos_token_id), no_pad)  # stated


def test_released_configs_keep_their_own_pad_id():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shipped = [p for p in (root / "src/condmem/configs", root / "configs") if (p / "deepseek_v41_flash.json").is_file()]
    released = EngramConfig.load(shipped[0] / "deepseek_v41_flash.json")  # the released config.json's keys
    assert released.pad_id == 2 and released.pad_id_stated
    assert EngramConfig.deepseek_v41_flash().pad_id_stated
    data = released.to_dict("v4")
    del data["engram_pad_token_id"]
    assert not EngramConfig.from_dict(data).pad_id_stated  # a source that states none: taken from the tokenizer
