"""Corpus reading, the split, token streams and bytes-per-token accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from condmem.train.bpe import token_byte_lengths, train_bpe
from condmem.train.data import CorpusError, Corpus, Document, TokenStream, load_corpus, split_corpus


def test_load_directory_jsonl_and_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.py").write_text("print(1)\n")
    (tmp_path / "d" / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "c.md").write_text("# title\n")
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "y.txt").write_text("plain")
    corpus = load_corpus([tmp_path / "d", tmp_path / "x.jsonl", tmp_path / "y.txt"])
    assert [d.name for d in corpus.documents] == ["d/a.py", "d/sub/c.md", "x.jsonl:1", "x.jsonl:3", "y.txt"]
    assert corpus.info["n_documents"] == 5 and len(corpus.sha256) == 64
    assert load_corpus([tmp_path / "d"]).sha256 == load_corpus([tmp_path / "d"]).sha256
    with pytest.raises(CorpusError, match="neither"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(CorpusError, match="bad.jsonl:1"):
        load_corpus(tmp_path / "bad.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no text"):
        load_corpus(tmp_path / "empty")


def test_stdlib_corpus_records_python_version_and_hash():
    corpus = load_corpus(max_bytes=200_000)
    info = corpus.info
    assert info["python_version"].count(".") == 2 and len(info["sha256"]) == 64
    assert all(d.name.startswith("stdlib/") and d.name.endswith(".py") for d in corpus.documents)
    assert info["n_bytes"] <= 200_000 and info["truncated"]


def test_split_is_deterministic_disjoint_and_non_empty():
    docs = [Document(f"f{i}.py", f"x = {i}\n") for i in range(50)]
    corpus = Corpus(docs, {"sha256": "0"})
    train, val = split_corpus(corpus, 0.1, seed=0)
    train2, val2 = split_corpus(Corpus(list(reversed(docs)), {}), 0.1, seed=0)
    assert {d.name for d in val} == {d.name for d in val2}, "the split depends on names, not order"
    assert val and train and not ({d.name for d in train} & {d.name for d in val})
    assert len(train) + len(val) == 50
    two = Corpus(docs[:2], {})
    t, v = split_corpus(two, 0.01)
    assert len(t) == 1 and len(v) == 1


def test_token_stream_batches():
    eos = 0
    tokens = np.array([5, 6, 7, eos, 8, 9, eos, 10, 11, 12, 13, eos] * 5, dtype=np.uint16)
    stream = TokenStream(tokens, eos)
    a, b = stream.batch(3, 4, 6, seed=1), stream.batch(3, 4, 6, seed=1)
    assert torch.equal(a.inputs, b.inputs)
    assert not torch.equal(a.inputs, stream.batch(4, 4, 6, seed=1).inputs)
    assert a.inputs.dtype == torch.int64 and a.inputs.shape == (4, 6)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])
    assert torch.equal(a.doc_starts[:, 1:], a.inputs[:, :-1] == eos) and not a.doc_starts[:, 0].any()


@pytest.mark.parametrize("batch_size, seq_len", [(4, 6), (3, 5), (1, 59)], ids=["b4t6", "b3t5-straddles", "one-window"])
def test_one_pass_sees_every_window_once_before_any_twice(batch_size, seq_len):
    tokens = np.arange(3, 3 + 61, dtype=np.uint16)  # distinct ids: a window is known by its first token
    stream = TokenStream(tokens, eos_id=0)
    per_pass = stream.windows_per_pass(seq_len)
    assert per_pass == 60 // seq_len
    steps = -(-2 * per_pass // batch_size)  # two passes, rounded up
    firsts = np.concatenate([stream.batch(s, batch_size, seq_len, seed=7).inputs[:, 0].numpy() for s in range(steps)])
    first_pass, second_pass = firsts[:per_pass], firsts[per_pass : 2 * per_pass]
    grid = 3 + np.arange(per_pass) * seq_len
    assert sorted(first_pass) == list(grid) and sorted(second_pass) == list(grid)
    if per_pass > 2:
        assert not np.array_equal(first_pass, second_pass), "each pass has its own order"
    assert stream.passes(steps, batch_size, seq_len) == steps * batch_size / per_pass
    other_seed = np.concatenate(
        [stream.batch(s, batch_size, seq_len, seed=8).inputs[:, 0].numpy() for s in range(steps)]
    )
    if per_pass > 2:
        assert not np.array_equal(firsts, other_seed)


@pytest.mark.parametrize(
    "n_tokens, seq_len, batch_size",
    [(61, 6, 4), (60, 6, 4), (13, 6, 1), (4, 6, 2), (2, 6, 3)],
    ids=["tail", "exact", "tail-b1", "shorter-than-window", "two-tokens"],
)
def test_validation_scores_every_target_exactly_once(n_tokens, seq_len, batch_size):
    tokens = np.arange(1, n_tokens + 1, dtype=np.uint16)
    stream = TokenStream(tokens, eos_id=0)
    positions, targets = [], []
    for batch in stream.eval_batches(seq_len, None, batch_size):
        assert torch.equal(batch.targets, batch.positions + 1)  # token at position p has id p + 1
        positions.append(batch.positions[batch.scored])
        targets.append(batch.targets[batch.scored])
    positions = torch.cat(positions)
    assert torch.equal(positions.sort().values, torch.arange(1, n_tokens)), "each target once"
    assert sum(b.n_tokens for b in stream.eval_batches(seq_len, None, batch_size)) == n_tokens - 1


def test_validation_subset_is_spread_over_the_split():
    stream = TokenStream(np.arange(1, 1002, dtype=np.uint16), eos_id=0)
    starts = torch.cat([b.inputs[:, 0] for b in stream.eval_batches(10, 40, 8)])
    assert len(starts) == 4 and starts[0] == 1 and starts[-1] == 1 + 990


def test_bytes_per_token_are_exact_for_byte_level_bpe():
    text = "def f(x):\n    return x  # héllo wörld 你好 🙂\n" * 30
    tok = train_bpe([text], vocab_size=300)
    lengths = token_byte_lengths(tok)
    ids = tok.encode(text).ids
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.token_to_id("<|endoftext|>")] == 0


def test_prepared_data(tiny_data):
    info = tiny_data.info
    assert info["tokenizer"]["vocab_size"] == 320
    assert 0 < info["tokenizer"]["compressed_vocab_size"] < 320
    assert tiny_data.ctok.vocab_size == info["tokenizer"]["compressed_vocab_size"]
    assert len(tiny_data.train) > 1000 and len(tiny_data.val) > 100
    assert tiny_data.tokenizer.id_to_token(tiny_data.pad_id) == "<|pad|>"


def test_one_long_text_file_is_cut_into_documents_that_split(tmp_path):
    """A single book-sized file must not fail the train/validation split: it is cut at line ends."""
    from condmem.train.data import PIECE_CHARS, split_text

    lines = [f"line {i}: " + "word " * (i % 17) for i in range(40_000)]
    text = "\n".join(lines) + "\n"
    path = tmp_path / "book.txt"
    path.write_text(text)
    corpus = load_corpus(path)
    assert corpus.info["n_documents"] == len(split_text(text, PIECE_CHARS)) > 5
    assert "".join(d.text for d in corpus.documents) == text
    assert all(d.text.endswith("\n") for d in corpus.documents)
    train, val = split_corpus(corpus, 0.05)
    assert train and val
    assert split_text("short", 100) == ["short"] and split_text("a" * 300, 100) == ["a" * 300]
    small = tmp_path / "small.txt"
    small.write_text("one document\n")
    assert [d.name for d in load_corpus(small).documents] == ["small.txt"]
