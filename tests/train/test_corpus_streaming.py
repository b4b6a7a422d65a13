"""Streamed corpus preparation: the same tokens as the in-memory path, records, formats, caps."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest
import torch

from condmem.train import data as data_mod
from condmem.train import pipeline
from condmem.train.data import (
    CorpusError,
    encode_documents,
    iter_corpus,
    load_corpus,
    split_corpus,
    split_text,
)
from condmem.train.heldout import DEDUP_NGRAM, near_duplicate_fractions, ngram_keys, stream_ngram_keys
from condmem.train.pipeline import _sample_order, prepare_data

VOCAB = 300


def _equal(a, b) -> bool:
    return torch.equal(torch.from_numpy(np.asarray(a, dtype=np.int64)), torch.from_numpy(np.asarray(b, dtype=np.int64)))


def _score(name: str, seed: int) -> float:
    """`validation_flags`' hash of a document name."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") / 2**64


def _lines(rng, n: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    return "".join(" ".join(rng.choice(words, size=rng.integers(1, 12))) + "\n" for _ in range(n))


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    """A folder of files, a long text file cut into pieces, a JSONL file, and one validation
    candidate copied from training text (so near-duplicate removal has work)."""
    monkeypatch.setattr(data_mod, "PIECE_CHARS", 400)
    rng = np.random.default_rng(0)
    folder = tmp_path / "docs"
    folder.mkdir()
    for k in range(24):
        (folder / f"f{k:02d}.txt").write_text(_lines(rng, int(rng.integers(3, 30))))
    # A validation document (by its name's hash) that copies a training one.
    copy = next(f"copy{i}.txt" for i in range(100) if _score(f"docs/copy{i}.txt", 3) < 0.25)
    source = next(f"f{k:02d}.txt" for k in range(24) if _score(f"docs/f{k:02d}.txt", 3) >= 0.25)
    (folder / copy).write_text((folder / source).read_text() * 2)
    (tmp_path / "book.txt").write_text(_lines(rng, 300))
    (tmp_path / "recs.jsonl").write_text("".join(json.dumps({"text": _lines(rng, 5)}) + "\n" for _ in range(30)))
    return [str(folder), str(tmp_path / "book.txt"), str(tmp_path / "recs.jsonl")]


def _sample_docs(docs, max_bytes, seed):
    """`_sample_order` of documents held in memory."""
    sizes = [len(d.text.encode("utf-8")) for d in docs]
    return [docs[i] for i in _sample_order([d.name for d in docs], sizes, range(len(docs)), max_bytes, seed)]


def _in_memory(corpus, tok, eos_id, max_train_bytes, seed, threshold, val_fraction):
    """The in-memory composition: every document loaded, split, sampled, encoded whole."""
    train, val = split_corpus(load_corpus(corpus), val_fraction, seed)
    train = _sample_docs(train, max_train_bytes, seed)
    train_tokens = encode_documents(tok, train, eos_id)
    dtype = train_tokens.dtype
    enc = [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch([d.text for d in val], add_special_tokens=False)]
    frac = near_duplicate_fractions(train_tokens, enc, DEDUP_NGRAM)
    kept = [e for e, f in zip(enc, frac) if f <= threshold]
    eos = np.asarray([eos_id], dtype=dtype)
    return train_tokens, np.concatenate([p for e in kept for p in (e, eos)]), int((frac > threshold).sum())


@pytest.mark.parametrize("max_train_bytes", [None, 6_000], ids=["all", "sampled"])
def test_streamed_tokens_equal_the_in_memory_path(small_corpus, tmp_path, max_train_bytes):
    kw = {"vocab_size": VOCAB, "val_fraction": 0.25, "seed": 3, "max_train_bytes": max_train_bytes}
    data = prepare_data(small_corpus, **kw, cache_dir=tmp_path / "c")
    cached = prepare_data(small_corpus, **kw, cache_dir=tmp_path / "c")
    uncached = prepare_data(small_corpus, **kw, use_cache=False)
    train, val, removed = _in_memory(small_corpus, data.tokenizer, data.eos_id, max_train_bytes, 3, 0.5, 0.25)
    assert removed >= 1 or max_train_bytes is not None  # the copied file is near-duplicate validation
    for got in (data, cached, uncached):
        assert isinstance(got.train.tokens, np.memmap) and got.train.tokens.dtype == train.dtype
        assert _equal(got.train.tokens, train) and _equal(got.val.tokens, val)
    assert cached.info["prepared_cache"]["hit"] and not data.info["prepared_cache"]["hit"]
    assert (tmp_path / "c" / "prepared" / f"prepared-{data.info['prepared_cache']['key']}.train.npy").is_file()
    sample = data.info["train_sample"]
    assert sample["max_train_bytes"] == max_train_bytes and sample["documents"] == data.info["train_documents"]
    if max_train_bytes is not None:
        assert sample["bytes"] <= max_train_bytes < sample["split_bytes"]


def test_training_order_follows_the_sample_not_the_file(small_corpus, tmp_path, monkeypatch):
    """Negative control: the token file written in corpus order (its reordering skipped) is not the in-memory stream."""
    kw = {"vocab_size": VOCAB, "val_fraction": 0.25, "seed": 3, "max_train_bytes": 6_000, "use_cache": False}
    data = prepare_data(small_corpus, **kw)
    train, _, _ = _in_memory(small_corpus, data.tokenizer, data.eos_id, 6_000, 3, 0.5, 0.25)
    runs = pipeline._runs
    monkeypatch.setattr(pipeline, "_runs", lambda off, n: runs(*(a[np.argsort(off)] for a in (off, n))))
    unordered = prepare_data(small_corpus, **kw)
    assert len(unordered.train) == len(train) and not _equal(unordered.train.tokens, train)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_text_file_streams_into_the_pieces_of_split_text(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(data_mod, "PIECE_CHARS", 50)
    rng = np.random.default_rng(seed)
    # Lines whose ends fall at, before and after the piece size; a last line without its newline.
    text = "".join("é" * int(n) + "\n" for n in rng.integers(0, 120, size=60)) + "tail"
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("the file was read whole"))
    docs = list(iter_corpus(path))
    pieces = split_text(text, 50)
    assert [d.text for d in docs if d.text] == [p for p in pieces if p]
    assert docs[0].name == "book.txt#000000" and "".join(d.text for d in docs) == text


def test_single_piece_file_keeps_its_name(tmp_path):
    (tmp_path / "short.txt").write_text("one line\n")
    assert [d.name for d in iter_corpus(tmp_path / "short.txt")] == ["short.txt"]


def test_not_utf8_text_file_is_refused_naming_it(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(CorpusError, match="bad.txt is not UTF-8"):
        list(iter_corpus(tmp_path / "bad.txt"))


def test_jsonl_file_and_folder_with_jsonl(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (folder / "b.txt").write_text("plain\n")
    assert [(d.name, d.text) for d in iter_corpus(folder)] == [
        ("d/a.jsonl:1", "one"),
        ("d/a.jsonl:3", "two"),
        ("d/b.txt", "plain\n"),
    ]
    assert [d.name for d in iter_corpus(folder / "a.jsonl")] == ["a.jsonl:1", "a.jsonl:3"]
    rng = np.random.default_rng(0)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": _lines(rng, 4)}) + "\n" for _ in range(40)))
    data = prepare_data(str(tmp_path / "r.jsonl"), vocab_size=VOCAB, val_fraction=0.2, use_cache=False)
    assert data.info["corpus"]["n_documents"] == 40 and len(data.train) > 0 and len(data.val) > 0


def test_validation_cap_is_respected_and_recorded(small_corpus, tmp_path):
    kw = {"vocab_size": VOCAB, "val_fraction": 0.25, "seed": 3, "cache_dir": tmp_path / "c"}
    whole = prepare_data(small_corpus, **kw)
    assert whole.info["validation"]["max_tokens"] is None and len(whole.val) > 300  # control: the cap bites
    capped = prepare_data(small_corpus, **kw, max_val_tokens=300)
    again = prepare_data(small_corpus, **kw, max_val_tokens=300)
    v = capped.info["validation"]
    assert len(capped.val) <= 300 and v["max_tokens"] == 300 and v["capped"] and v["tokens_before_cap"] > 300
    assert v["tokens"] == len(capped.val) and capped.info["args"]["max_val_tokens"] == 300
    assert (
        again.info["prepared_cache"]["hit"]
        and again.info["validation"] == v
        and _equal(again.val.tokens, capped.val.tokens)
    )
    assert capped.info["prepared_cache"]["key"] != whole.info["prepared_cache"]["key"]
    assert _equal(capped.train.tokens, whole.train.tokens)
    # Whole documents, in corpus order, each ending with EOS; a subset of the uncapped ones.
    names = [d.name for d in whole.val_docs]
    kept = [d.name for d in capped.val_docs]
    assert kept == [n for n in names if n in kept] and capped.val.tokens[-1] == capped.eos_id
    assert int((capped.val.tokens == capped.eos_id).sum()) == len(kept)


def test_validation_cap_below_every_document_cuts_the_first(small_corpus):
    data = prepare_data(small_corpus, vocab_size=VOCAB, val_fraction=0.25, use_cache=False, max_val_tokens=5)
    assert len(data.val) == 5 and data.val.tokens[-1] == data.eos_id and len(data.val_docs) == 1


@pytest.mark.parametrize("bad", [1, 0, True])
def test_bad_validation_cap_is_refused(small_corpus, bad):
    with pytest.raises(ValueError, match="max_val_tokens"):
        prepare_data(small_corpus, vocab_size=VOCAB, use_cache=False, max_val_tokens=bad)


def test_validation_candidates_stay_bounded(tmp_path, monkeypatch):
    """With a cap, at most the best-ranked candidates reaching VAL_RESERVE x cap are kept while encoding."""
    monkeypatch.setattr(pipeline, "VAL_RESERVE", 1)
    rng = np.random.default_rng(1)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"text": _lines(rng, 3)}) + "\n" for _ in range(200)))
    data = prepare_data(str(path), vocab_size=VOCAB, val_fraction=0.5, use_cache=False, max_val_tokens=200)
    v = data.info["validation"]
    assert v["split_documents"] > v["documents_before"] and v["tokens_before"] < 200 + 200  # reserve + one document
    assert len(data.val) <= 200


def test_missing_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    (tmp_path / "t.parquet").write_bytes(b"PAR1\x00\x00PAR1")
    ds = tmp_path / "saved"
    ds.mkdir()
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    (ds / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff")
    for source in (tmp_path / "t.parquet", ds):
        with pytest.raises(CorpusError, match=rf"{source.name}.*optional package 'pyarrow'"):
            prepare_data(str(source), use_cache=False)
    # Control: read as text, the same file is only "not UTF-8", a message that names no package.
    with pytest.raises(CorpusError, match="not UTF-8"):
        list(data_mod._text_pieces(ds / "data-00000-of-00001.arrow", 10))


def test_parquet_and_saved_dataset_read_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i}\n" * (i + 1) for i in range(7)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=3)
    ds = tmp_path / "saved"
    ds.mkdir()
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
            writer.write_table(pa.table({"text": texts}), max_chunksize=2)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    assert [(d.name, d.text) for d in iter_corpus(tmp_path / "t.parquet")] == [
        (f"t.parquet:{i}", t) for i, t in enumerate(texts)
    ]
    assert [d.text for d in iter_corpus(ds)] == texts
    with pytest.raises(CorpusError, match="no column 'body'"):
        list(iter_corpus(tmp_path / "t.parquet", jsonl_key="body"))


@pytest.mark.parametrize("n", [3, 13])
def test_stream_ngram_keys_over_pieces_equal_the_whole(n):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 50, size=1000).astype(np.uint16)
    cuts = np.sort(rng.choice(np.arange(1, 1000), size=40, replace=False))
    pieces = np.split(tokens, cuts)
    whole = ngram_keys(tokens, n, 50)
    assert _equal_keys(np.concatenate(list(stream_ngram_keys(iter(pieces), n, 50))), whole)
    assert _equal_keys(np.concatenate(list(stream_ngram_keys(tokens, n, 50))), whole)
    # Control: pieces keyed on their own lose the n-grams across the cuts.
    alone = np.concatenate([ngram_keys(p, n, 50) for p in pieces])
    assert len(alone) < len(whole)


def _equal_keys(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_damaged_training_token_file_is_prepared_again(small_corpus, tmp_path):
    kw = {"vocab_size": VOCAB, "val_fraction": 0.25, "cache_dir": tmp_path / "c"}
    first = prepare_data(small_corpus, **kw)
    path = tmp_path / "c" / "prepared" / f"prepared-{first.info['prepared_cache']['key']}.train.npy"
    expected = np.array(first.train.tokens)
    del first
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 10)
    again = prepare_data(small_corpus, **kw)
    assert not again.info["prepared_cache"]["hit"] and _equal(again.train.tokens, expected)


def test_preset_cap_reaches_the_data_and_a_resumed_run_gets_it_back(small_corpus):
    from condmem.train.build import prepare, prepare_recorded
    from condmem.train.presets import get_preset

    preset = get_preset("tiny", {"data": {"corpus": small_corpus, "vocab_size": VOCAB, "max_val_tokens": 300}})
    data = prepare(preset, use_cache=False)
    assert data.info["validation"]["max_tokens"] == 300 and len(data.val) <= 300
    again = prepare_recorded(data.info["args"], tokenizer=data.tokenizer)
    assert again.info["validation"]["max_tokens"] == 300 and _equal(again.val.tokens, data.val.tokens)


@pytest.mark.parametrize("bad, message", [(1, "must be >= 2, got 1"), (True, "must be an integer")])
def test_study_config_refuses_a_bad_validation_cap_naming_it(bad, message):
    from condmem.config import ConfigError
    from condmem.apps.study.config import StudyConfig, study_preset

    d = study_preset("tiny").to_dict()
    d["data"]["max_val_tokens"] = bad
    with pytest.raises(ConfigError, match=f"data.max_val_tokens {message}"):
        StudyConfig.from_dict(d)
    d["data"]["max_val_tokens"] = 4096  # control: a valid cap loads and round-trips
    assert StudyConfig.from_dict(d).to_dict()["data"]["max_val_tokens"] == 4096


def test_unwritable_cache_still_prepares_the_data(small_corpus, tmp_path, monkeypatch):
    """A cache that cannot be written costs the cache, not the data (a warning; the same tokens)."""
    kw = {"vocab_size": VOCAB, "val_fraction": 0.25}
    expected = prepare_data(small_corpus, **kw, use_cache=False)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "atomic_path", full)
    data = prepare_data(small_corpus, **kw, cache_dir=tmp_path / "c")
    assert _equal(data.train.tokens, expected.train.tokens) and _equal(data.val.tokens, expected.val.tokens)
    assert not list((tmp_path / "c" / "prepared").glob("*.train.npy"))
