"""``condmem layout``: primes, rows and bytes per Engram layer of a config."""

from __future__ import annotations

import argparse

from condmem.cli import CliError
from condmem.cli.common import add_config_argument, load_config, print_json


def register(sub) -> None:
    p = sub.add_parser(
        "layout",
        help="primes summary, rows and bytes per Engram layer",
        description="Compute the Engram layout of a config: the prime bucket ranges of every (layer, order, head), "
        "rows per layer's table, and its size in bf16 and fp8+e8m0. Needs the compressed vocab size, from the config "
        "(engram_compressed_vocab_size) or --compressed-vocab-size or --tokenizer.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples (deepseek_v41_flash, official_demo: configs shipped with condmem):\n"
        "  condmem layout --config deepseek_v41_flash\n"
        "  condmem layout --config official_demo --tokenizer deepseek-v4   # V' from the tokenizer",
    )
    add_config_argument(p)
    p.add_argument("--compressed-vocab-size", type=int, help="V' when the config does not state it")
    p.add_argument("--tokenizer", help="tokenizer (tokenizer.json, its directory, or 'deepseek-v4') to take V' from")
    p.add_argument("--json", action="store_true", help="print the full layout as one JSON object")
    p.set_defaults(func=run)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def run(args) -> int:
    from condmem.layout import EngramLayout

    config = load_config(args.config)
    vocab = args.compressed_vocab_size
    if args.tokenizer:
        from condmem.tokenizer import CompressedTokenizer

        vocab = CompressedTokenizer.from_any(args.tokenizer).vocab_size
    if vocab is None and config.compressed_vocab_size is None:
        raise CliError(
            f"--config {args.config} states no compressed vocabulary size V' (it enters every hash "
            "multiplier): pass --tokenizer (tokenizer.json, its directory, or 'deepseek-v4') to take it "
            "from the tokenizer, or --compressed-vocab-size N"
        )
    layout = EngramLayout(config, compressed_vocab_size=vocab)
    summary = layout.summary()
    if args.json:
        print_json(summary)
        return 0
    c = config
    print(
        f"Engram layout: layers {layout.layer_ids}, orders 2..{c.max_ngram_size}, {c.n_heads} heads/order, "
        f"{layout.n_cols} columns/layer, head_dim {c.head_dim}, V'={layout.compressed_vocab_size}"
    )
    print(f"fingerprint {layout.fingerprint}")
    print(f"{'layer':>5} {'rows':>14} {'primes (min..max)':>27} {'bf16':>13} {'fp8+e8m0':>13}")
    for layer in summary["layers"]:
        print(
            f"{layer['layer_id']:>5} {layer['num_embeddings']:>14,} "
            f"{layer['min_prime']:>13,}..{layer['max_prime']:<13,}"
            f"{_gib(layer['bytes_bf16']):>13} {_gib(layer['bytes_fp8_e8m0']):>13}"
        )
    print(
        f"{'all':>5} {sum(layout.num_embeddings):>14,} {'':>27}{_gib(summary['bytes_bf16']):>13} "
        f"{_gib(summary['bytes_fp8_e8m0']):>13}"
    )
    print(f"table parameters: {layout.n_params:,} ({layout.n_params / 1e9:.1f}B)")
    return 0
