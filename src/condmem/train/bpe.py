"""Byte-level BPE tokenizer training (HF `tokenizers`) and bytes-per-token accounting.

The tokenizer trained here is an ordinary ``tokenizer.json``: Engram compresses it
like any other (`CompressedTokenizer`), and its compressed size V' goes into the
model's `EngramConfig`. Special tokens come first (ids 0, 1, ...): ``<|endoftext|>``
separates documents and ``<|pad|>`` is the Engram pad.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from condmem.utils.atomic import atomic_write_text

logger = logging.getLogger("condmem.train.bpe")

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOS, PAD)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
"""The 256 byte tokens, the special tokens and one merge."""
MAX_VOCAB_SIZE = 1 << 20
"""The largest vocabulary trained (about 8x the largest released LLM vocabularies): the BPE trainer
reserves ~70 bytes per id up front, so 10^9 ids would ask for ~70 GB and abort the process."""


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = 4096,
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer of `vocab_size` ids (special tokens and the 256 bytes included;
    at most `MAX_VOCAB_SIZE`); `min_frequency` >= 0."""
    if vocab_size < 256 + len(special_tokens) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE: it needs 256 byte tokens, "
            f"{len(special_tokens)} special tokens and at least one merge"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {vocab_size:,} is above the {MAX_VOCAB_SIZE:,} ids a byte-level BPE is trained to here "
            "(the trainer reserves ~70 bytes per id up front)"
        )
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be >= 0, got {min_frequency}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    logger.info("trained a byte-level BPE of %d ids in %.1f s", tok.get_vocab_size(), time.perf_counter() - start)
    return tok


def cached_train_bpe(texts: Sequence[str], vocab_size: int, key: str, cache_dir: Path) -> Tokenizer:
    """`train_bpe`, cached at ``cache_dir/bpe-<vocab>-<key>.json`` (key: the corpus hash)."""
    path = Path(cache_dir) / f"bpe-{vocab_size}-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # a damaged cache file costs a retrain, nothing more
            logger.warning("ignoring unreadable tokenizer cache %s (%s)", path, exc)
    tok = train_bpe(texts, vocab_size)
    try:
        atomic_write_text(path, tok.to_str(), wait=True)  # a cache: another process may be writing it too
    except OSError as exc:
        logger.warning("could not write tokenizer cache %s (%s)", path, exc)
    return tok


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), int64 [vocab].

    Byte-level tokens map one character to one byte, so a token's length is exact even
    for partial UTF-8 sequences; other tokenizers fall back to decoding each id.
    """
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    out = np.zeros(n, dtype=np.int64)
    for t in range(n):
        piece = tokenizer.id_to_token(t)
        if piece is None or piece in special:
            continue
        if byte_level and all(ch in alphabet for ch in piece):
            out[t] = len(piece)
        else:
            out[t] = len(tokenizer.decode([t], skip_special_tokens=False).encode("utf-8"))
    return out


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def load_tokenizer(source: str | os.PathLike) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json, its directory, or 'deepseek-v4'."""
    from condmem.tokenizer import deepseek_v4_tokenizer_path, read_tokenizer_file

    if str(source) == "deepseek-v4":
        return read_tokenizer_file(deepseek_v4_tokenizer_path())
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {source!r} (expected a tokenizer.json, its directory, or 'deepseek-v4')"
        )
    return read_tokenizer_file(path)
