"""From a corpus to trainable token streams: split, tokenizer, compression map, encoding.

`prepare_data` is what `condmem train`, `condmem demo` and `condmem study` share: read
the corpus, split it by document, train (or load) the tokenizer, build the compressed
tokenizer whose V' goes into the Engram config, encode both splits, and drop validation
documents that near-duplicate training text (`condmem.train.heldout`).

The corpus is streamed, never held whole: one pass reads document names and sizes (the
split and the training sample are decided from them), one gathers the tokenizer's sample,
one encodes the training documents in bounded batches into a token file that training
reads as a memory map. Validation keeps its documents' tokens (at most a reserve above
``max_val_tokens`` when capped). The result is cached on disk (a small ``.npz`` and the
training ``.npy``), keyed by the corpus files, the tokenizer and the settings, so a
resumed run or a second command on the same data reads it back in a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from condmem.train.bpe import (
    EOS,
    PAD,
    cached_train_bpe,
    load_tokenizer,
    token_byte_lengths,
    tokenizer_sha256,
)
from condmem.train.data import (
    Document,
    TokenStream,
    cache_root,
    corpus_fingerprint,
    docs_key,
    iter_corpus,
    validation_flags,
)
from condmem.train.heldout import DEDUP_NGRAM, DEDUP_THRESHOLD, near_duplicate_fractions
from condmem.utils.atomic import atomic_path, atomic_write_text

logger = logging.getLogger("condmem.train")

EOS_CANDIDATES = (EOS, "<｜end▁of▁sentence｜>", "</s>", "<eos>", "<|end_of_text|>")
PAD_CANDIDATES = (PAD, "<｜▁pad▁｜>", "<pad>", "<|finetune_right_pad_id|>")


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    ctok: object
    """CompressedTokenizer of `tokenizer`."""
    train: TokenStream
    val: TokenStream
    token_bytes: np.ndarray
    eos_id: int
    pad_id: int
    info: dict = field(default_factory=dict)
    val_docs: list[Document] = field(default_factory=list)
    """Validation documents kept (near-duplicates of training text removed)."""


VAL_RESERVE = 4
"""With ``max_val_tokens``, validation candidates are kept (best-ranked first) until they hold
this many times the cap, so that removing near-duplicates rarely leaves fewer than the cap."""

ENCODE_BATCH_BYTES = 1 << 20
"""Training text tokenized per batch (at most 256 documents, or one larger document): the
tokenizer's per-token bookkeeping (offsets, strings) of a batch is what encoding holds."""


def _rank(tag: str, seed: int, name: str) -> bytes:
    return hashlib.sha256(f"{tag}:{seed}:{name}".encode()).digest()


def _sample_order(names: Sequence[str], sizes: Sequence[int], candidates: Sequence[int], max_bytes, seed: int) -> list:
    """A deterministic, order-independent sample of the documents `candidates` (indices into
    `names` / `sizes`, bytes) up to `max_bytes`: documents in the order of the hash of
    (seed, name), each taken when it still fits. None: all of them, in the given order."""
    if max_bytes is None:
        return list(candidates)
    out, total = [], 0
    for i in sorted(candidates, key=lambda i: _rank("sample", seed, names[i])):
        if out and total + int(sizes[i]) > max_bytes:
            continue
        out.append(int(i))
        total += int(sizes[i])
    return out


def _token_dtype(tok: Tokenizer):
    return np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32


def _encode(tok: Tokenizer, texts: Sequence[str], dtype) -> list[np.ndarray]:
    return [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def _deduplicated_validation(
    docs: Sequence[Document],
    encoded: Sequence[np.ndarray],
    train_tokens,
    eos_id: int,
    threshold: float | None,
    max_tokens: int | None = None,
    seed: int = 0,
    split_documents: int | None = None,
) -> tuple[list[Document], np.ndarray, dict]:
    """Drop validation documents (with their tokens `encoded`) that near-duplicate the training
    tokens (an array or its consecutive pieces), cap what is left at `max_tokens`, and describe
    both. Returns (kept documents, their token stream with EOS after each, description).

    The cap takes whole documents in the order of the hash of (seed, name), each when it still
    fits (the first one cut to the cap when none fits); the stream keeps the corpus order."""
    dtype = encoded[0].dtype if encoded else np.uint16
    fractions = (
        near_duplicate_fractions(train_tokens, encoded, DEDUP_NGRAM) if threshold is not None else np.zeros(len(docs))
    )
    keep = [threshold is None or f <= threshold for f in fractions]
    if not any(keep):
        raise ValueError(
            f"every validation document near-duplicates the training split (threshold {threshold}); "
            "use a larger corpus or a higher threshold"
        )
    removed = sorted(
        (
            {"name": d.name, "tokens": int(len(e) + 1), "shared_fraction": round(float(f), 4)}
            for d, e, f, k in zip(docs, encoded, fractions, keep)
            if not k
        ),
        key=lambda r: -r["tokens"],
    )
    kept = [i for i, k in enumerate(keep) if k]
    tokens_kept = sum(len(encoded[i]) + 1 for i in kept)
    cut = None
    if max_tokens is not None and tokens_kept > max_tokens:
        chosen, total = [], 0
        for i in sorted(kept, key=lambda i: _rank("val", seed, docs[i].name)):
            if total + len(encoded[i]) + 1 <= max_tokens:
                chosen.append(i)
                total += len(encoded[i]) + 1
        if not chosen:  # every document is longer than the cap: the best-ranked one, cut
            first = min(kept, key=lambda i: _rank("val", seed, docs[i].name))
            chosen, cut = [first], first
        kept = sorted(chosen)
    eos = np.asarray([eos_id], dtype=dtype)
    parts = [part for i in kept for part in ((encoded[i][: max_tokens - 1], eos) if i == cut else (encoded[i], eos))]
    stream = np.concatenate(parts)
    description = {
        "dedup_ngram": DEDUP_NGRAM,
        "dedup_threshold": threshold,
        "split_documents": len(docs) if split_documents is None else split_documents,
        "documents_before": len(docs),
        "tokens_before": int(sum(len(e) + 1 for e in encoded)),
        "removed_documents": len(removed),
        "removed_tokens": int(sum(r["tokens"] for r in removed)),
        "max_tokens": max_tokens,
        "tokens_before_cap": int(tokens_kept),
        "capped": bool(max_tokens is not None and tokens_kept > max_tokens),
        "documents": len(kept),
        "tokens": len(stream),
        "shared_fraction_quantiles": {str(q): round(float(np.quantile(fractions, q)), 4) for q in (0.5, 0.9, 0.99)}
        if len(fractions)
        else {},
        "removed": removed,
    }
    return [docs[i] for i in kept], stream, description


def find_special(tokenizer: Tokenizer, candidates: Sequence[str], what: str, fallback: int | None = None) -> int:
    for name in candidates:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return tid
    if fallback is not None:
        return fallback
    raise ValueError(f"the tokenizer has none of the {what} tokens {list(candidates)}")


def prepare_data(
    corpus: str | Sequence[str] | None = None,
    *,
    tokenizer: str | Tokenizer | None = None,
    vocab_size: int = 4096,
    max_corpus_bytes: int | None = None,
    max_train_bytes: int | None = None,
    tokenizer_train_bytes: int | None = 8_000_000,
    val_fraction: float = 0.02,
    seed: int = 0,
    dedup_threshold: float | None = DEDUP_THRESHOLD,
    max_val_tokens: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> PreparedData:
    """Corpus -> tokenizer, compressed tokenizer and train/val token streams, streamed.

    Args:
        corpus: see `load_corpus` (None: the interpreter's standard library source); any size:
            it is read as a stream, a document at a time, three times at most.
        tokenizer: an existing tokenizer (Tokenizer, tokenizer.json path or 'deepseek-v4');
            None trains a byte-level BPE of `vocab_size` ids on the training split.
        max_corpus_bytes: read at most this much text.
        max_train_bytes: encode at most this much of the training split: a deterministic sample
            of its documents (by the hash of seed and name, whatever the corpus order),
            described in ``info["train_sample"]``. A corpus larger than the training budget is
            sampled here; passes over what is sampled are the trainer's setting.
        tokenizer_train_bytes: train the BPE on a sample of this size.
        dedup_threshold: drop a validation document when more than this fraction of its
            13-token n-grams occur in the training tokens (None: keep every document).
        max_val_tokens: keep at most this many validation tokens (whole documents chosen by the
            hash of seed and name; None: the whole split); recorded in
            ``info["validation"]["max_tokens"]``.
        use_cache: read and write the prepared data under ``cache_dir/prepared`` (default
            `cache_root`), keyed by the corpus files (path, size, modification time), the
            tokenizer and every argument above: a second call (a resumed run, the next run of a
            study) reads nothing but those files. ``info["prepared_cache"]`` says which. The
            training tokens are a memory-mapped ``.npy`` there (without the cache: a temporary
            file, removed once mapped).
    """
    if max_val_tokens is not None and (isinstance(max_val_tokens, bool) or int(max_val_tokens) < 2):
        raise ValueError(f"max_val_tokens must be an integer >= 2 or None, got {max_val_tokens!r}")
    source = None if tokenizer is None else ("given" if isinstance(tokenizer, Tokenizer) else str(tokenizer))
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    settings = {
        "max_corpus_bytes": max_corpus_bytes,
        "max_train_bytes": max_train_bytes,
        "val_fraction": val_fraction,
        "seed": seed,
        "dedup_threshold": dedup_threshold,
        "max_val_tokens": max_val_tokens,
    }
    record = {
        "corpus": None
        if corpus is None
        else ([str(c) for c in corpus] if isinstance(corpus, (list, tuple)) else str(corpus)),
        "max_corpus_bytes": max_corpus_bytes,
        "max_train_bytes": max_train_bytes,
        "tokenizer_train_bytes": tokenizer_train_bytes,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "seed": seed,
        "dedup_threshold": dedup_threshold,
        "max_val_tokens": max_val_tokens,
    }
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    if not use_cache:
        return _prepare(corpus, tokenizer, source, vocab_size, tokenizer_train_bytes, settings, record, cache, None)
    t0 = time.perf_counter()
    fingerprint = corpus_fingerprint(corpus, max_bytes=max_corpus_bytes)
    spec = (
        {"bpe": [vocab_size, tokenizer_train_bytes]}
        if tokenizer is None
        else {"tokenizer": tokenizer_sha256(tokenizer)}
    )
    key = _prepared_key(fingerprint, spec, settings)
    folder = cache / "prepared"
    data = _load_prepared(folder, key)
    if data is None:
        data = _prepare(corpus, tokenizer, source, vocab_size, tokenizer_train_bytes, settings, record, cache, key)
        # Also findable by the tokenizer it ended with: a resumed run passes its checkpoint's tokenizer.
        alias = _prepared_key(fingerprint, {"tokenizer": data.info["tokenizer"]["json_sha256"]}, settings)
        _save_prepared(folder, key, alias if alias != key else None, data)
        data.info["prepared_cache"] = {"key": key, "hit": False}
    else:
        # The record describes this call (a resumed run may name the tokenizer another way).
        data.info["args"] = record
        if source is not None:
            data.info["tokenizer"]["source"] = source
        data.info["prepared_cache"] = {"key": key, "hit": True, "seconds": round(time.perf_counter() - t0, 2)}
        logger.info("data: prepared data read from the cache (%s) in %.1f s", key, time.perf_counter() - t0)
    return data


def _scan(corpus, settings: dict) -> tuple[dict, list[str], np.ndarray]:
    """The streaming first pass: the corpus description, every document's name and UTF-8 size."""
    info: dict = {}
    names, sizes = [], []
    for d in iter_corpus(corpus, max_bytes=settings["max_corpus_bytes"], info=info):
        names.append(d.name)
        sizes.append(len(d.text.encode("utf-8")))
    return info, names, np.asarray(sizes, dtype=np.int64)


def _gather(corpus, settings: dict, order: Sequence[int]) -> list[Document]:
    """The documents at corpus indices `order`, in that order (a pass that keeps only them)."""
    where = {i: k for k, i in enumerate(order)}
    out: list = [None] * len(order)
    for i, d in enumerate(iter_corpus(corpus, max_bytes=settings["max_corpus_bytes"])):
        if i in where:
            out[where[i]] = d
    return out


def _prepare(
    corpus,
    tokenizer: Tokenizer | None,
    source: str | None,
    vocab_size: int,
    tokenizer_train_bytes: int | None,
    settings: dict,
    record: dict,
    cache: Path,
    key: str | None,
) -> PreparedData:
    """`prepare_data` without its own cache lookup: scan, split, tokenize, encode, deduplicate.
    `key`: write the training tokens as the cache's ``prepared-<key>.train.npy`` (None: a temporary file)."""
    t0 = time.perf_counter()
    seed = settings["seed"]
    corpus_info, names, sizes = _scan(corpus, settings)
    is_val = validation_flags(names, settings["val_fraction"], seed)
    train_all = np.flatnonzero(~is_val)
    train_order = _sample_order(names, sizes, train_all, settings["max_train_bytes"], seed)
    t_read = time.perf_counter() - t0

    t1 = time.perf_counter()
    if tokenizer is None:
        tok_order = _sample_order(names, sizes, train_order, tokenizer_train_bytes, seed)
        tok, source = _train_tokenizer(_gather(corpus, settings, tok_order), vocab_size, cache, key is not None)
    else:
        tok = tokenizer
    ctok, eos_id, pad_id = _compressed_and_specials(tok)
    t_tok = time.perf_counter() - t1

    t2 = time.perf_counter()
    folder = cache / "prepared"
    train_path = None if key is None else folder / f"prepared-{key}.train.npy"
    train_tokens, val_docs, val_encoded = _encode_splits(
        tok, eos_id, corpus, settings, is_val, train_order, train_path, folder
    )
    t_enc = time.perf_counter() - t2
    t3 = time.perf_counter()
    val_docs, val_tokens, validation = _deduplicated_validation(
        val_docs,
        val_encoded,
        _file_pieces(train_tokens),
        eos_id,
        settings["dedup_threshold"],
        settings["max_val_tokens"],
        seed,
        split_documents=int(is_val.sum()),
    )
    t_dedup = time.perf_counter() - t3
    train_bytes = int(sizes[train_order].sum()) if len(train_order) else 0
    info = {
        "args": record,
        "corpus": corpus_info,
        "train_documents": len(train_order),
        "train_bytes": train_bytes,
        "train_tokens_available": len(train_tokens),
        "train_sample": {
            "max_train_bytes": settings["max_train_bytes"],
            "split_documents": len(train_all),
            "split_bytes": int(sizes[train_all].sum()),
            "documents": len(train_order),
            "bytes": train_bytes,
            "rule": "all, in corpus order"
            if settings["max_train_bytes"] is None
            else "documents in the order of sha256('sample:<seed>:<name>'), each taken when it still fits",
        },
        "val_documents": len(val_docs),
        "val_bytes": sum(len(d.text.encode("utf-8")) for d in val_docs),
        "val_tokens_available": len(val_tokens),
        "validation": validation,
        "tokenizer": {
            "source": source,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "compressed_vocab_size": ctok.vocab_size,
            "map_fingerprint": ctok.fingerprint,
            "json_sha256": tokenizer_sha256(tok),
            "eos_id": eos_id,
            "pad_id": pad_id,
        },
        "seconds": {
            "read": round(t_read, 2),
            "tokenizer": round(t_tok, 2),
            "encode": round(t_enc, 2),
            "deduplicate": round(t_dedup, 2),
        },
    }
    _log_prepared(info, time.perf_counter() - t0)
    return PreparedData(
        tok,
        ctok,
        TokenStream(train_tokens, eos_id),
        TokenStream(val_tokens, eos_id),
        token_byte_lengths(tok),
        eos_id,
        pad_id,
        info,
        val_docs,
    )


def _encode_splits(
    tok: Tokenizer,
    eos_id: int,
    corpus,
    settings: dict,
    is_val: np.ndarray,
    train_order: Sequence[int],
    train_path: Path | None,
    folder: Path,
) -> tuple[np.ndarray, list[Document], list[np.ndarray]]:
    """The encoding pass: training documents tokenized in batches of at most
    ``ENCODE_BATCH_BYTES`` and appended to a file, then laid out in `train_order` (EOS after
    each) as a ``.npy`` returned memory-mapped; validation documents encoded and kept (with a
    cap, only the best-ranked up to ``VAL_RESERVE`` times it). Returns (training tokens,
    validation candidates in corpus order, their tokens)."""
    dtype = _token_dtype(tok)
    itemsize = np.dtype(dtype).itemsize
    slot = np.full(len(is_val), -1, dtype=np.int64)
    slot[np.asarray(train_order, dtype=np.int64)] = np.arange(len(train_order))
    offsets = np.zeros(len(train_order), dtype=np.int64)
    lengths = np.zeros(len(train_order), dtype=np.int64)
    cap = settings["max_val_tokens"]
    reserve = None if cap is None else VAL_RESERVE * cap
    val: dict[int, tuple[Document, np.ndarray]] = {}
    val_tokens = 0
    eos = np.asarray([eos_id], dtype=dtype).tobytes()
    scratch = None
    if train_path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            scratch = folder if os.access(folder, os.W_OK) else None
        except OSError:
            pass
    with tempfile.TemporaryFile(dir=scratch) as raw:
        batch: list[tuple[int, str]] = []
        batch_bytes = 0
        cursor = 0

        def flush():
            nonlocal cursor
            for (k, _), ids in zip(batch, _encode(tok, [t for _, t in batch], dtype)):
                raw.write(ids.tobytes())
                raw.write(eos)
                offsets[k], lengths[k] = cursor, len(ids) + 1
                cursor += len(ids) + 1
            batch.clear()

        seed = settings["seed"]
        for i, d in enumerate(iter_corpus(corpus, max_bytes=settings["max_corpus_bytes"])):
            if is_val[i]:
                (ids,) = _encode(tok, [d.text], dtype)
                val[i] = (d, ids)
                val_tokens += len(ids) + 1
                if reserve is not None and val_tokens > 2 * reserve:
                    val_tokens = _trim_candidates(val, reserve, seed)
            elif slot[i] >= 0:
                batch.append((int(slot[i]), d.text))
                batch_bytes += len(d.text)
                if len(batch) >= 256 or batch_bytes >= ENCODE_BATCH_BYTES:
                    flush()
                    batch_bytes = 0
        flush()
        if reserve is not None:
            _trim_candidates(val, reserve, seed)
        raw.flush()
        train = _write_ordered(raw, offsets, lengths, dtype, itemsize, train_path, folder)
    order = sorted(val)
    return train, [val[i][0] for i in order], [val[i][1] for i in order]


def _trim_candidates(val: dict, reserve: int, seed: int) -> int:
    """Drop the worst-ranked validation candidates beyond those whose tokens reach `reserve`; their tokens left."""
    total = 0
    for i in sorted(val, key=lambda i: _rank("val", seed, val[i][0].name)):
        if total >= reserve:
            del val[i]
        else:
            total += len(val[i][1]) + 1
    return total


def _write_ordered(raw, offsets, lengths, dtype, itemsize: int, train_path: Path | None, folder: Path) -> np.ndarray:
    """The documents of `raw` (at `offsets`, `lengths` tokens, in slot order) copied into one
    ``.npy`` in slot order with plain reads and writes (adjacent documents in one copy, at most
    64 MiB at a time); returned memory-mapped."""
    total = int(lengths.sum())
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (total,)}

    def write(fh):
        np.lib.format.write_array_header_1_0(fh, header)
        runs = _runs(offsets, lengths)
        for start, count in runs:
            done = 0
            while done < count:
                n = min(count - done, (64 << 20) // itemsize)
                fh.write(os.pread(raw.fileno(), n * itemsize, (start + done) * itemsize))
                done += n

    if train_path is None:
        fd, tmp = tempfile.mkstemp(suffix=".npy")
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
            return np.load(tmp, mmap_mode="r")
        finally:
            os.unlink(tmp)  # the map keeps the data until it is dropped
    try:
        with atomic_path(train_path, wait=True) as tmp, open(tmp, "wb") as fh:
            write(fh)
    except OSError as exc:
        logger.warning("could not write the prepared-data cache %s (%s); using a temporary file", train_path, exc)
        return _write_ordered(raw, offsets, lengths, dtype, itemsize, None, folder)
    return np.load(train_path, mmap_mode="r")


def _runs(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """(start, count) of the raw file's ranges to copy, adjacent ranges merged."""
    runs: list[tuple[int, int]] = []
    for off, n in zip(offsets.tolist(), lengths.tolist()):
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((off, n))
    return runs


def _file_pieces(tokens: np.ndarray, chunk: int = 1 << 22):
    """Consecutive pieces of a token array, each read into memory (a memory map's pages are not kept)."""
    for i in range(0, len(tokens), chunk):
        yield np.array(tokens[i : i + chunk])


def _compressed_and_specials(tok: Tokenizer) -> tuple[object, int, int]:
    """The compressed tokenizer of `tok`, its end-of-document id, and its pad id (the EOS without one)."""
    from condmem.tokenizer import CompressedTokenizer

    eos_id = find_special(tok, EOS_CANDIDATES, "end-of-document")
    pad_id = find_special(tok, PAD_CANDIDATES, "pad", fallback=eos_id)
    ctok = CompressedTokenizer.from_any(tok)
    return ctok, eos_id, pad_id


def _log_prepared(info: dict, seconds: float) -> None:
    """One line on the prepared data: documents and tokens per split, near-duplicates removed, V -> V'."""
    logger.info(
        "data: %d train docs (%d tokens), %d val docs (%d tokens, %d near-duplicates removed); "
        "vocab %d -> V'=%d; %.1f s",
        info["train_documents"],
        info["train_tokens_available"],
        info["val_documents"],
        info["val_tokens_available"],
        info["validation"]["removed_documents"],
        info["tokenizer"]["vocab_size"],
        info["tokenizer"]["compressed_vocab_size"],
        seconds,
    )


def _train_tokenizer(sample: list[Document], vocab_size: int, cache: Path, use_cache: bool) -> tuple[Tokenizer, str]:
    """A byte-level BPE trained on `sample`, the training split's sample (cached by its hash)."""
    tok = cached_train_bpe([d.text for d in sample], vocab_size, docs_key(sample), cache / "bpe") if use_cache else None
    if tok is None:
        from condmem.train.bpe import train_bpe

        tok = train_bpe([d.text for d in sample], vocab_size)
    return tok, f"byte-level BPE trained on {sum(len(d.text.encode()) for d in sample):,} bytes of the training split"


# Bump when what the prepared-data cache holds, or how it is computed, changes.
_PREPARED_FORMAT = 2


def _prepared_key(fingerprint: str, tokenizer_spec: dict, settings: dict) -> str:
    text = json.dumps([_PREPARED_FORMAT, fingerprint, tokenizer_spec, settings, DEDUP_NGRAM], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _save_prepared(folder: Path, key: str, alias: str | None, data: PreparedData) -> None:
    """One .npz per key (written atomically) beside the training tokens' ``.train.npy`` (already
    written by the encoding pass); `alias` names a small file that points at the key."""
    meta = {
        "info": data.info,
        "eos_id": data.eos_id,
        "pad_id": data.pad_id,
        "val_docs": [[d.name, d.text] for d in data.val_docs],
    }
    arrays = {
        "val": data.val.tokens,
        "token_bytes": np.asarray(data.token_bytes),
        "meta": np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8),
        "tokenizer": np.frombuffer(data.tokenizer.to_str().encode("utf-8"), dtype=np.uint8),
    }
    try:
        with atomic_path(folder / f"prepared-{key}.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        if alias is not None:
            atomic_write_text(folder / f"prepared-{alias}.key", key + "\n")
    except OSError as exc:
        logger.warning("could not write the prepared-data cache in %s (%s)", folder, exc)


def _load_prepared(folder: Path, key: str) -> PreparedData | None:
    """The prepared data cached under `key` (or the key an alias file names), its training tokens
    memory-mapped; None when absent or unreadable."""
    from condmem.tokenizer import CompressedTokenizer

    alias = folder / f"prepared-{key}.key"
    if alias.is_file():
        try:
            key = alias.read_text().strip()
        except OSError:
            return None
    path = folder / f"prepared-{key}.npz"
    train_path = folder / f"prepared-{key}.train.npy"
    if not path.is_file() or not train_path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        train = np.load(train_path, mmap_mode="r", allow_pickle=False)
        meta = json.loads(arrays["meta"].tobytes().decode("utf-8"))
        tok = Tokenizer.from_str(arrays["tokenizer"].tobytes().decode("utf-8"))
        if train.ndim != 1 or len(train) != meta["info"]["train_tokens_available"]:
            raise ValueError(f"{train_path.name} holds {train.shape} tokens, the record says otherwise")
    except Exception as exc:  # noqa: BLE001 - a damaged cache file costs a fresh preparation, nothing more
        logger.warning("ignoring unreadable prepared-data cache %s (%s)", path, exc)
        return None
    eos_id = meta["eos_id"]
    return PreparedData(
        tok,
        CompressedTokenizer.from_any(tok),
        TokenStream(train, eos_id),
        TokenStream(arrays["val"], eos_id),
        arrays["token_bytes"],
        eos_id,
        meta["pad_id"],
        meta["info"],
        [Document(name, text) for name, text in meta["val_docs"]],
    )
