"""From a corpus to trainable token streams: split, tokenizer, compression map, encoding.

`prepare_data` is what `condmem train`, `condmem demo` and `condmem study` share: read
the corpus, split it by document, train (or load) the tokenizer, build the compressed
tokenizer whose V' goes into the Engram config, encode both splits, and drop validation
documents that near-duplicate training text (`condmem.train.heldout`). The result is
cached on disk as one file, keyed by the corpus files, the tokenizer and the settings, so
a resumed run or a second command on the same data reads it back in a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
    Corpus,
    Document,
    TokenStream,
    cache_root,
    cached_encode,
    corpus_fingerprint,
    docs_key,
    load_corpus,
    split_corpus,
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


def _sample_docs(docs: Sequence[Document], max_bytes: int | None, seed: int) -> list[Document]:
    """A deterministic, order-independent sample of documents up to `max_bytes` (all when None)."""
    if max_bytes is None:
        return list(docs)
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"sample:{seed}:{d.name}".encode()).digest())
    out, total = [], 0
    for d in ranked:
        size = len(d.text.encode("utf-8"))
        if out and total + size > max_bytes:
            continue
        out.append(d)
        total += size
    return out


def _deduplicated_validation(
    tok: Tokenizer, docs: Sequence[Document], train_tokens: np.ndarray, eos_id: int, threshold: float | None
) -> tuple[list[Document], np.ndarray, dict]:
    """Encode each validation document, drop near-duplicates of the training tokens, and
    describe what was dropped. Returns (kept documents, their token stream, description)."""
    dtype = np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    encoded = [
        np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    ]
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
    eos = np.asarray([eos_id], dtype=dtype)
    stream = np.concatenate([part for e, k in zip(encoded, keep) if k for part in (e, eos)])
    description = {
        "dedup_ngram": DEDUP_NGRAM,
        "dedup_threshold": threshold,
        "documents_before": len(docs),
        "tokens_before": int(sum(len(e) + 1 for e in encoded)),
        "removed_documents": len(removed),
        "removed_tokens": int(sum(r["tokens"] for r in removed)),
        "documents": int(sum(keep)),
        "tokens": len(stream),
        "shared_fraction_quantiles": {str(q): round(float(np.quantile(fractions, q)), 4) for q in (0.5, 0.9, 0.99)}
        if len(fractions)
        else {},
        "removed": removed,
    }
    return [d for d, k in zip(docs, keep) if k], stream, description


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
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> PreparedData:
    """Corpus -> tokenizer, compressed tokenizer and train/val token streams.

    Args:
        corpus: see `load_corpus` (None: the interpreter's standard library source).
        tokenizer: an existing tokenizer (Tokenizer, tokenizer.json path or 'deepseek-v4');
            None trains a byte-level BPE of `vocab_size` ids on the training split.
        max_corpus_bytes: read at most this much text.
        max_train_bytes: encode at most this much of the training split (a deterministic sample
            of its documents): a short run needs a few million tokens, not the whole corpus.
        tokenizer_train_bytes: train the BPE on a sample of this size.
        dedup_threshold: drop a validation document when more than this fraction of its
            13-token n-grams occur in the training tokens (None: keep every document).
        use_cache: read and write the prepared data under ``cache_dir/prepared`` (default
            `cache_root`), keyed by the corpus files (path, size, modification time), the
            tokenizer and every argument above: a second call (a resumed run, the next run of a
            study) reads nothing but that file. ``info["prepared_cache"]`` says which.
    """
    source = None if tokenizer is None else ("given" if isinstance(tokenizer, Tokenizer) else str(tokenizer))
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    settings = {
        "max_corpus_bytes": max_corpus_bytes,
        "max_train_bytes": max_train_bytes,
        "val_fraction": val_fraction,
        "seed": seed,
        "dedup_threshold": dedup_threshold,
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
    }
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    if not use_cache:
        return _prepare(corpus, tokenizer, source, vocab_size, tokenizer_train_bytes, settings, record, cache, False)
    t0 = time.perf_counter()
    fingerprint = corpus_fingerprint(corpus, max_bytes=max_corpus_bytes)
    spec = (
        {"bpe": [vocab_size, tokenizer_train_bytes]}
        if tokenizer is None
        else {"tokenizer": tokenizer_sha256(tokenizer)}
    )
    key = _prepared_key(fingerprint, spec, settings)
    data = _load_prepared(cache / "prepared", key)
    if data is None:
        data = _prepare(corpus, tokenizer, source, vocab_size, tokenizer_train_bytes, settings, record, cache, True)
        # Also findable by the tokenizer it ended with: a resumed run passes its checkpoint's tokenizer.
        alias = _prepared_key(fingerprint, {"tokenizer": data.info["tokenizer"]["json_sha256"]}, settings)
        _save_prepared(cache / "prepared", key, alias if alias != key else None, data)
        data.info["prepared_cache"] = {"key": key, "hit": False}
    else:
        # The record describes this call (a resumed run may name the tokenizer another way).
        data.info["args"] = record
        if source is not None:
            data.info["tokenizer"]["source"] = source
        data.info["prepared_cache"] = {"key": key, "hit": True, "seconds": round(time.perf_counter() - t0, 2)}
        logger.info("data: prepared data read from the cache (%s) in %.1f s", key, time.perf_counter() - t0)
    return data


def _prepare(
    corpus,
    tokenizer: Tokenizer | None,
    source: str | None,
    vocab_size: int,
    tokenizer_train_bytes: int | None,
    settings: dict,
    record: dict,
    cache: Path,
    use_cache: bool,
) -> PreparedData:
    """`prepare_data` without its own cache: read, split, tokenize, encode, deduplicate."""
    t0 = time.perf_counter()
    data, train_docs, val_docs = _read_and_split(corpus, settings)
    t_read = time.perf_counter() - t0

    t1 = time.perf_counter()
    if tokenizer is None:
        tok, source = _train_tokenizer(
            train_docs, vocab_size, tokenizer_train_bytes, settings["seed"], cache, use_cache
        )
    else:
        tok = tokenizer
    ctok, eos_id, pad_id = _compressed_and_specials(tok)
    t_tok = time.perf_counter() - t1

    t2 = time.perf_counter()
    tok_sha = tokenizer_sha256(tok)
    train_tokens = cached_encode(tok, train_docs, eos_id, docs_key(train_docs, tok_sha), cache / "tokens", use_cache)
    t_enc = time.perf_counter() - t2
    t3 = time.perf_counter()
    val_docs, val_tokens, validation = _deduplicated_validation(
        tok, val_docs, train_tokens, eos_id, settings["dedup_threshold"]
    )
    t_dedup = time.perf_counter() - t3
    info = {
        "args": record,
        "corpus": data.info,
        "train_documents": len(train_docs),
        "train_bytes": sum(len(d.text.encode("utf-8")) for d in train_docs),
        "train_tokens_available": len(train_tokens),
        "val_documents": len(val_docs),
        "val_bytes": sum(len(d.text.encode("utf-8")) for d in val_docs),
        "val_tokens_available": len(val_tokens),
        "validation": validation,
        "tokenizer": {
            "source": source,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "compressed_vocab_size": ctok.vocab_size,
            "map_fingerprint": ctok.fingerprint,
            "json_sha256": tok_sha,
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


def _read_and_split(corpus, settings: dict) -> tuple[Corpus, list[Document], list[Document]]:
    """The corpus read (up to ``max_corpus_bytes``), split by document, its training split sampled
    down to ``max_train_bytes``: (corpus, training documents, validation documents)."""
    seed = settings["seed"]
    data: Corpus = load_corpus(corpus, max_bytes=settings["max_corpus_bytes"])
    train_docs, val_docs = split_corpus(data, settings["val_fraction"], seed)
    train_docs = _sample_docs(train_docs, settings["max_train_bytes"], seed)
    return data, train_docs, val_docs


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


def _train_tokenizer(
    train_docs: list[Document], vocab_size: int, train_bytes: int | None, seed: int, cache: Path, use_cache: bool
) -> tuple[Tokenizer, str]:
    """A byte-level BPE trained on a sample of the training split (cached by the sample's hash)."""
    sample = _sample_docs(train_docs, train_bytes, seed)
    tok = cached_train_bpe([d.text for d in sample], vocab_size, docs_key(sample), cache / "bpe") if use_cache else None
    if tok is None:
        from condmem.train.bpe import train_bpe

        tok = train_bpe([d.text for d in sample], vocab_size)
    return tok, f"byte-level BPE trained on {sum(len(d.text.encode()) for d in sample):,} bytes of the training split"


# Bump when what the prepared-data cache holds, or how it is computed, changes.
_PREPARED_FORMAT = 1


def _prepared_key(fingerprint: str, tokenizer_spec: dict, settings: dict) -> str:
    text = json.dumps([_PREPARED_FORMAT, fingerprint, tokenizer_spec, settings, DEDUP_NGRAM], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _save_prepared(folder: Path, key: str, alias: str | None, data: PreparedData) -> None:
    """One .npz per key (written atomically); `alias` names a small file that points at it."""
    meta = {
        "info": data.info,
        "eos_id": data.eos_id,
        "pad_id": data.pad_id,
        "val_docs": [[d.name, d.text] for d in data.val_docs],
    }
    arrays = {
        "train": data.train.tokens,
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
    """The prepared data cached under `key` (or the key an alias file names); None when absent or unreadable."""
    from condmem.tokenizer import CompressedTokenizer

    alias = folder / f"prepared-{key}.key"
    if alias.is_file():
        try:
            key = alias.read_text().strip()
        except OSError:
            return None
    path = folder / f"prepared-{key}.npz"
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        meta = json.loads(arrays["meta"].tobytes().decode("utf-8"))
        tok = Tokenizer.from_str(arrays["tokenizer"].tobytes().decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - a damaged cache file costs a fresh preparation, nothing more
        logger.warning("ignoring unreadable prepared-data cache %s (%s)", path, exc)
        return None
    eos_id = meta["eos_id"]
    return PreparedData(
        tok,
        CompressedTokenizer.from_any(tok),
        TokenStream(arrays["train"], eos_id),
        TokenStream(arrays["val"], eos_id),
        arrays["token_bytes"],
        eos_id,
        meta["pad_id"],
        meta["info"],
        [Document(name, text) for name, text in meta["val_docs"]],
    )
