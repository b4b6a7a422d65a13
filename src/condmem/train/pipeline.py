"""From a corpus to trainable token streams: split, tokenizer, compression map, encoding.

`prepare_data` is what `condmem train` and `condmem demo` share: read the corpus,
split it by document, train (or load) the tokenizer, build the compressed tokenizer
whose V' goes into the Engram config, encode both splits (cached on disk), and drop
validation documents that near-duplicate training text (`condmem.train.heldout`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from condmem.train.bpe import EOS, PAD, cached_train_bpe, load_tokenizer, token_byte_lengths, tokenizer_sha256
from condmem.train.data import (
    Corpus,
    Document,
    TokenStream,
    cache_root,
    cached_encode,
    docs_key,
    load_corpus,
    split_corpus,
)
from condmem.train.heldout import DEDUP_NGRAM, DEDUP_THRESHOLD, near_duplicate_fractions

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


def _deduplicated_validation(tok: Tokenizer, docs: Sequence[Document], train_tokens: np.ndarray, eos_id: int,
                             threshold: float | None) -> tuple[list[Document], np.ndarray, dict]:
    """Encode each validation document, drop near-duplicates of the training tokens, and
    describe what was dropped. Returns (kept documents, their token stream, description)."""
    dtype = np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    encoded = [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch([d.text for d in docs], add_special_tokens=False)]
    fractions = (near_duplicate_fractions(train_tokens, encoded, DEDUP_NGRAM) if threshold is not None
                 else np.zeros(len(docs)))
    keep = [threshold is None or f <= threshold for f in fractions]
    if not any(keep):
        raise ValueError(f"every validation document near-duplicates the training split (threshold {threshold}); "
                         "use a larger corpus or a higher threshold")
    removed = sorted(({"name": d.name, "tokens": int(len(e) + 1), "shared_fraction": round(float(f), 4)}
                      for d, e, f, k in zip(docs, encoded, fractions, keep) if not k),
                     key=lambda r: -r["tokens"])
    eos = np.asarray([eos_id], dtype=dtype)
    stream = np.concatenate([part for e, k in zip(encoded, keep) if k for part in (e, eos)])
    description = {
        "dedup_ngram": DEDUP_NGRAM, "dedup_threshold": threshold,
        "documents_before": len(docs), "tokens_before": int(sum(len(e) + 1 for e in encoded)),
        "removed_documents": len(removed), "removed_tokens": int(sum(r["tokens"] for r in removed)),
        "documents": int(sum(keep)), "tokens": int(len(stream)),
        "shared_fraction_quantiles": {q: round(float(np.quantile(fractions, q)), 4) for q in (0.5, 0.9, 0.99)}
        if len(fractions) else {},
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


def prepare_data(corpus: str | Sequence[str] | None = None, *, tokenizer: str | Tokenizer | None = None,
                 vocab_size: int = 4096, max_corpus_bytes: int | None = None, max_train_bytes: int | None = None,
                 tokenizer_train_bytes: int | None = 8_000_000, val_fraction: float = 0.02, seed: int = 0,
                 dedup_threshold: float | None = DEDUP_THRESHOLD,
                 cache_dir: str | Path | None = None, use_cache: bool = True) -> PreparedData:
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
    """
    from condmem.tokenizer import CompressedTokenizer

    t0 = time.perf_counter()
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    data: Corpus = load_corpus(corpus, max_bytes=max_corpus_bytes)
    train_docs, val_docs = split_corpus(data, val_fraction, seed)
    train_docs = _sample_docs(train_docs, max_train_bytes, seed)
    t_read = time.perf_counter() - t0

    t1 = time.perf_counter()
    if tokenizer is None:
        sample = _sample_docs(train_docs, tokenizer_train_bytes, seed)
        key = docs_key(sample)
        tok = cached_train_bpe([d.text for d in sample], vocab_size, key, cache / "bpe") if use_cache else None
        if tok is None:
            from condmem.train.bpe import train_bpe

            tok = train_bpe([d.text for d in sample], vocab_size)
        tok_source = f"byte-level BPE trained on {sum(len(d.text.encode()) for d in sample):,} bytes of the training split"
    elif isinstance(tokenizer, Tokenizer):
        tok, tok_source = tokenizer, "given"
    else:
        tok, tok_source = load_tokenizer(tokenizer), str(tokenizer)
    eos_id = find_special(tok, EOS_CANDIDATES, "end-of-document")
    pad_id = find_special(tok, PAD_CANDIDATES, "pad", fallback=eos_id)
    ctok = CompressedTokenizer.from_any(tok)
    t_tok = time.perf_counter() - t1

    t2 = time.perf_counter()
    tok_sha = tokenizer_sha256(tok)
    train_tokens = cached_encode(tok, train_docs, eos_id, docs_key(train_docs, tok_sha), cache / "tokens", use_cache)
    t_enc = time.perf_counter() - t2
    t3 = time.perf_counter()
    val_docs, val_tokens, validation = _deduplicated_validation(tok, val_docs, train_tokens, eos_id, dedup_threshold)
    t_dedup = time.perf_counter() - t3
    token_bytes = token_byte_lengths(tok)
    info = {
        "args": {"corpus": None if corpus is None else ([str(c) for c in corpus] if isinstance(corpus, (list, tuple)) else str(corpus)),
                 "max_corpus_bytes": max_corpus_bytes, "max_train_bytes": max_train_bytes,
                 "tokenizer_train_bytes": tokenizer_train_bytes, "vocab_size": vocab_size,
                 "val_fraction": val_fraction, "seed": seed, "dedup_threshold": dedup_threshold},
        "corpus": data.info,
        "train_documents": len(train_docs),
        "train_bytes": sum(len(d.text.encode("utf-8")) for d in train_docs),
        "train_tokens_available": int(len(train_tokens)),
        "val_documents": len(val_docs),
        "val_bytes": sum(len(d.text.encode("utf-8")) for d in val_docs),
        "val_tokens_available": int(len(val_tokens)),
        "validation": validation,
        "tokenizer": {
            "source": tok_source,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "compressed_vocab_size": ctok.vocab_size,
            "map_fingerprint": ctok.fingerprint,
            "json_sha256": tok_sha,
            "eos_id": eos_id,
            "pad_id": pad_id,
        },
        "seconds": {"read": round(t_read, 2), "tokenizer": round(t_tok, 2), "encode": round(t_enc, 2),
                    "deduplicate": round(t_dedup, 2)},
    }
    logger.info("data: %d train docs (%d tokens), %d val docs (%d tokens, %d near-duplicates removed); "
                "vocab %d -> V'=%d; %.1f s",
                len(train_docs), len(train_tokens), len(val_docs), len(val_tokens), validation["removed_documents"],
                info["tokenizer"]["vocab_size"], ctok.vocab_size, time.perf_counter() - t0)
    return PreparedData(tok, ctok, TokenStream(train_tokens, eos_id), TokenStream(val_tokens, eos_id), token_bytes,
                        eos_id, pad_id, info, val_docs)
