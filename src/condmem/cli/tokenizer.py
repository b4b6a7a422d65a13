"""``condmem tokenizer train``: a byte-level BPE ``tokenizer.json`` from local text, no hub needed.

A thin command over `condmem.train.bpe.train_bpe` (the tokenizer ``condmem demo`` and
``condmem train`` make for themselves) and `condmem.train.data.load_corpus` (the same
corpus sources). The file is an ordinary ``tokenizer.json``: transformers, ``tokenizers``
and every condmem ``--tokenizer`` flag read it. It prints the ids an `EngramConfig` needs:
the pad id (``<|pad|>``) and the compressed vocabulary size V'.
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer.json from local text (no hub needed)",
        description="Tokenizer tools. 'condmem tokenizer train' trains a byte-level BPE tokenizer.json.",
    )
    actions = p.add_subparsers(dest="action", metavar="<action>", required=True, parser_class=type(p))
    t = actions.add_parser(
        "train",
        help="train a byte-level BPE tokenizer.json on a corpus",
        description="Train a byte-level BPE (HF tokenizers) on a corpus and write it as a tokenizer.json, atomically. "
        "Special tokens come first: <|endoftext|> (id 0) separates documents, <|pad|> (id 1) is the pad, so an "
        "Engram config for it takes pad_id=1. Prints the vocabulary size, the compressed size V' Engram hashes "
        "with, and the bytes read.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  condmem tokenizer train --corpus stdlib --out tokenizer.json   # this Python's standard library source\n"
        "  condmem tokenizer train --corpus ./texts notes.jsonl --out tok.json --vocab-size 8192",
    )
    t.add_argument(
        "--corpus",
        nargs="+",
        required=True,
        metavar="PATH",
        help="directories (their *.py, *.txt, *.md, ... files), text files, .jsonl files (a 'text' field "
        "per line), 'stdlib' (the Python standard library source) or 'python' (plus installed packages)",
    )
    t.add_argument("--out", required=True, help="the tokenizer.json to write")
    t.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="ids in the tokenizer, special and byte tokens included: 259..1,048,576 (default 4096)",
    )
    t.add_argument(
        "--max-bytes",
        type=int,
        default=100_000_000,
        help="read at most this much text (default 100 MB; BPE training takes about a minute per 100 MB)",
    )
    t.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen at least this often (>= 0; default 2)"
    )
    t.set_defaults(func=run)


def run(args) -> int:
    import time

    from condmem.cli.common import check_int, check_vocab_size
    from condmem.train.bpe import PAD, train_bpe
    from condmem.train.data import load_corpus
    from condmem.utils.atomic import atomic_write_text
    from condmem.utils.preflight import check_output_file

    check_int(args.max_bytes, "--max-bytes")
    check_vocab_size(args.vocab_size)
    check_int(args.min_frequency, "--min-frequency", 0)
    out = check_output_file(args.out, "--out")
    start = time.perf_counter()
    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    tok = train_bpe((d.text for d in corpus.documents), args.vocab_size, min_frequency=args.min_frequency)
    atomic_write_text(out, tok.to_str())
    from condmem.tokenizer import CompressedTokenizer

    ctok = CompressedTokenizer.from_any(tok, use_cache=False)
    info = corpus.info
    print(
        f"wrote {out}: byte-level BPE of {tok.get_vocab_size():,} ids, trained on {info['n_bytes'] / 1e6:,.1f} MB "
        f"({info['n_documents']:,} documents{', truncated at --max-bytes' if info['truncated'] else ''}) in "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(
        f"for an EngramConfig: pad_id={tok.token_to_id(PAD)} ({PAD}), compressed_vocab_size={ctok.vocab_size} "
        f"(V'; or pass --tokenizer {out})"
    )
    return 0
