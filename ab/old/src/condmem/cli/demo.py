"""``condmem demo``: train a baseline and an Engram LM on the same tokens, compare, plot, generate."""

from __future__ import annotations

import argparse

from condmem.train.demo import DEFAULT_PROMPT


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train baseline vs Engram on the same tokens and show the gain (the main job)",
        description="Build a BPE tokenizer on the corpus (default: this interpreter's standard library source; no "
        "download), train an iso-FLOP baseline and the same backbone with an Engram layer on exactly the same "
        "batches, print a side-by-side table (params, FLOPs/token, tokens, val loss, bits/byte, tok/s), write "
        "summary.json, loss_curves.png, gates.png (per-token Engram gate over validation code), sample.txt and both "
        "checkpoints to --out, and sample a completion from the Engram model. Defaults: <= 10 minutes on a 2-core CPU; "
        "with CUDA the 'gpu' preset.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem demo\n  condmem demo --minutes 30 --out runs/demo30\n"
        "  condmem demo --device cuda --corpus /path/to/texts --steps 5000",
    )
    p.add_argument("--out", default="condmem-demo", help="output directory (default ./condmem-demo)")
    p.add_argument("--corpus", nargs="+", metavar="PATH",
                   help="directories, text files or .jsonl files (default: the Python standard library source)")
    p.add_argument("--preset", choices=["cpu", "gpu", "tiny"], help="model/training size (default: gpu with CUDA, else cpu)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--steps", type=int, help="training steps of each model (default: the preset's)")
    p.add_argument("--minutes", type=float,
                   help="wall-clock budget of the whole demo: the baseline's step count is sized to it, "
                   "and the Engram model trains the same steps")
    p.add_argument("--batch-size", type=int, help="sequences per step")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default: the preset's, 4096 on CPU)")
    p.add_argument("--tokenizer", help="use this tokenizer (tokenizer.json, its directory, or 'deepseek-v4') "
                   "instead of training a BPE")
    p.add_argument("--table-size", type=int, help="Engram bucket range per (order, head): rows per layer ~ this x columns")
    p.add_argument("--max-train-bytes", type=int, help="encode at most this much of the training split")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the generated completion")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, help="a progress line every N steps (default 1 on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the tokenizer/token caches")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoints (large tables on a GPU run)")
    p.add_argument("--max-corpus-bytes", type=int, help="read at most this much corpus text")
    p.set_defaults(func=run)


def run(args) -> int:
    from condmem.train.demo import run_demo

    summary = run_demo(
        args.out, corpus=args.corpus, preset=args.preset, device=args.device, steps=args.steps, minutes=args.minutes,
        vocab_size=args.vocab_size, tokenizer=args.tokenizer, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
        seed=args.seed, batch_size=args.batch_size, max_train_bytes=args.max_train_bytes, table_size=args.table_size,
        log_every=args.log_every, progress=not args.no_progress, use_cache=not args.no_cache,
        checkpoint=not args.no_checkpoint, max_corpus_bytes=args.max_corpus_bytes,
    )
    return 0 if summary["comparison"]["val_loss_gap_pct"] is not None else 1
