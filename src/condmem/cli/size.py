"""``condmem size``: Engram heads, head width and table size for a model width and a budget."""

from __future__ import annotations

import argparse
import re

from condmem.cli import UsageError
from condmem.cli.common import print_json

DESCRIPTION = """\
Choose an Engram geometry for a model of width --hidden and a budget of table memory
(--memory) or table parameters (--params), shared by every Engram layer:

  orders and heads   the paper's defaults: n-grams of 2 and 3 tokens, 8 hash heads each,
                     so a token reads 2 x 8 = 16 rows a layer (--max-ngram, --heads)
  head width         hidden / 16 rounded to a multiple of 8 (fp8: 32), so the 16 rows a
                     token reads together are about as wide as the model (--head-dim)
  table size         the largest buckets-per-head whose layout fits the budget; each head's
                     range is the next unused prime above it, and the bytes printed are the
                     layout's own (what `condmem layout` would print for this config)

The same bytes fit any tier; --tier says where they will live (hbm: GPU memory beside the
weights; host: page-locked host memory; disk: a table file) and --dtype how rows are stored
(bf16 2 B a value; fp8 1 B + a scale byte per 32; fp32 4 B, a trained module's own table).
Why these choices: docs/sizing.md.
"""

EPILOG = """\
examples:
  condmem size --hidden 4096 --memory 10GB                        # a 10 GB bf16 table in HBM
  condmem size --hidden 4096 --memory 64GiB --tier host --dtype fp8 --layers 1 14
  condmem size --hidden 1024 --params 500M --json                # EngramConfig keys as JSON
"""


def register(sub) -> None:
    p = sub.add_parser(
        "size",
        help="Engram heads, head width and table size for a model width and a memory or parameter budget",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hidden", type=int, required=True, help="the model's hidden size (width of the residual stream)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", help="table bytes for all Engram layers together: 10GB (10^9 B), 64GiB (2^30 B)")
    budget.add_argument("--params", help="table parameters for all Engram layers together: 2e9, 2B, 500M")
    p.add_argument("--tier", default="hbm", choices=["hbm", "host", "disk"], help="where the tables live (hbm)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "fp32"], help="how rows are stored (bf16)")
    p.add_argument("--layers", type=int, nargs="+", default=[1], metavar="ID", help="Engram layer ids (1)")
    p.add_argument("--max-ngram", type=int, default=3, metavar="N", help="n-gram orders 2..N (paper: 3)")
    p.add_argument("--heads", type=int, default=8, help="hash heads per order (paper: 8)")
    p.add_argument("--head-dim", type=int, help="row width (default: hidden / ((N-1) x heads), rounded)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from condmem.sizing import SizingError, size_engram

    try:
        s = size_engram(
            args.hidden,
            memory=args.memory,
            params=args.params,
            tier=args.tier,
            dtype=args.dtype,
            layer_ids=args.layers,
            max_ngram_size=args.max_ngram,
            n_heads=args.heads,
            head_dim=args.head_dim,
        )
    except SizingError as exc:
        raise UsageError(_flag_named(str(exc))) from None
    if args.json:
        print_json(s.to_dict())
        return 0
    c = s.config
    n_cols = (c["max_ngram_size"] - 1) * c["n_heads"]
    budget = next(iter(s.budget.items()))
    print(
        f"Engram for hidden {c['hidden_size']}: layers {c['layer_ids']}, orders 2..{c['max_ngram_size']}, "
        f"{c['n_heads']} heads, head_dim {c['head_dim']} ({n_cols} x {c['head_dim']} = {n_cols * c['head_dim']} "
        f"wide a token), table_size {c['table_size']:,}"
    )
    print(f"rows per layer {', '.join(f'{r:,}' for r in s.num_rows)}; {s.params:,} parameters ({s.params:.3g})")
    print(
        f"{s.dtype} in {s.tier}: {s.bytes:,} bytes ({s.bytes / 2**30:.3g} GiB) of a budget of {budget[1]:,} "
        f"{'bytes' if budget[0] == 'memory_bytes' else 'parameters'}; a token reads {s.read_bytes_per_token:,} bytes"
    )
    keys = ", ".join(f"{k}={v!r}" for k, v in c.items())
    print(f"EngramConfig({keys}, pad_id=tokenizer.pad_token_id)")
    return 0


_FLAGS = {
    "hidden_size": "--hidden",
    "max_ngram_size": "--max-ngram",
    "n_heads": "--heads",
    "head_dim": "--head-dim",
    "layer_ids": "--layers",
    "memory_bytes": "--memory",
    "memory": "--memory",
    "params": "--params",
}


def _flag_named(message: str) -> str:
    """`message` with the library's argument names (``size_engram.n_heads``, ``EngramConfig.head_dim``) as flags."""
    message = re.sub(r"^size_engram: ", "", message)
    return re.sub(
        r"(?:size_engram\.|EngramConfig\.)?\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m.group(1)], message
    )
