"""``condmem demo``: train a baseline and an Engram LM on the same tokens, compare, plot, generate."""

from __future__ import annotations

import argparse

# The demo's flags that replace preset values, each with its key (`DemoConfig.overrides`).
PRESET_FLAGS = {
    "steps": "train.steps",
    "batch_size": "train.batch_size",
    "log_every": "train.log_every",
    "table_size": "engram.table_size",
    "corpus": "data.corpus",
    "vocab_size": "data.vocab_size",
    "max_train_bytes": "data.max_train_bytes",
    "max_corpus_bytes": "data.max_corpus_bytes",
    "experts": "model.moe.n_experts",
    "top_k": "model.moe.top_k",
    "expert_ffn": "model.moe.expert_hidden",
    "moe_layers": "model.moe.layer_ids",
}


def register(sub) -> None:
    """The ``condmem demo`` command and its options."""
    p = sub.add_parser(
        "demo",
        help="train baseline vs Engram on the same tokens and show the gain (the main job)",
        description="Build a BPE tokenizer on the corpus, train an iso-FLOP baseline and the same backbone with an "
        "Engram layer on exactly the same batches, validate both on every token of the held-out split, and print a "
        "side-by-side table (params, FLOPs/token, tokens, passes over the data, val loss, bits/byte, loss on "
        "validation tokens whose 3-gram was / was not in training, tok/s). Writes summary.json, loss_curves.png, "
        "gates.png (per-token Engram gate over validation code), sample.txt and both checkpoints to --out.\n\n"
        "Honest by construction: the corpus is split by file; validation files that near-duplicate a training "
        "file (more than half of their 13-token n-grams seen in training) are removed and listed; training stops "
        "at one pass over its data unless --max-passes says otherwise (a warning says so); --seeds K repeats both "
        "models with K seeds and reports mean +- std.\n\n"
        "Defaults: the 'cpu' preset on this interpreter's standard library source, <= 10 minutes on 2 cores; with "
        "CUDA the 'gpu' preset on the standard library plus every installed package's Python source (no download).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem demo\n  condmem demo --seeds 3 --out runs/demo-3seeds\n"
        "  condmem demo --minutes 30 --out runs/demo30\n"
        "  condmem demo --device cuda --corpus /path/to/texts --steps 5000\n"
        "  condmem demo --experts 8 --top-k 2 --expert-ffn 64   # an MoE backbone for both models",
    )
    _add_training_arguments(p)
    _add_output_arguments(p)
    add_moe_arguments(p.add_argument_group("routed experts (both models: an MoE backbone)"))
    p.set_defaults(func=run)


def _add_training_arguments(p) -> None:
    """What the two models train on, on which device, how big and for how long."""
    p.add_argument("--out", default="condmem-demo", help="output directory (default ./condmem-demo)")
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="directories, text files or .jsonl files, 'stdlib' (the Python standard library source) or "
        "'python' (plus every installed package's source); default: stdlib on CPU, python on GPU",
    )
    p.add_argument(
        "--preset", choices=["cpu", "gpu", "tiny"], help="model/training size (default: gpu with CUDA, else cpu)"
    )
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--steps",
        type=int,
        help="training steps of each model (default: the preset's, capped at "
        "--max-passes passes over the training split)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="train each model with this many seeds (initialization and batch order) and report the "
        "mean +- std of the gap (default 1; the run takes this many times longer)",
    )
    p.add_argument(
        "--max-passes",
        type=float,
        default=1.0,
        help="never train past this many passes over the training split (default 1: no token seen twice)",
    )
    p.add_argument(
        "--no-dedup",
        action="store_true",
        help="keep validation files that near-duplicate training files (default: remove and list them)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        help="wall-clock budget of the whole demo: the baseline's step count is sized to it, "
        "and the Engram model trains the same steps",
    )
    p.add_argument("--batch-size", type=int, help="sequences per step")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default: the preset's, 4096 on CPU)")
    p.add_argument(
        "--tokenizer",
        help="use this tokenizer (tokenizer.json, its directory, or 'deepseek-v4') instead of training a BPE",
    )
    p.add_argument(
        "--table-size", type=int, help="Engram bucket range per (order, head): rows per layer ~ this x columns"
    )
    p.add_argument("--max-train-bytes", type=int, help="encode at most this much of the training split")


def _add_output_arguments(p) -> None:
    """The generated completion, the seed, progress, caches, checkpoints and the corpus read cap."""
    p.add_argument("--prompt", help="prompt of the generated completion (default: the start of a Python function)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens of each sampled completion (default 96)")
    p.add_argument("--seed", type=int, default=0, help="first seed; also seeds the data preparation (default 0)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels: the same options give bit-identical losses on one machine type (costs GPU speed)",
    )
    p.add_argument("--log-every", type=int, help="a progress line every N steps (default 1 on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the tokenizer/token caches")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoints (large tables on a GPU run)")
    p.add_argument("--max-corpus-bytes", type=int, help="read at most this much corpus text")


def add_moe_arguments(group) -> None:
    """--experts, --top-k, --expert-ffn, --moe-layers: routed experts in both models."""
    group.add_argument(
        "--experts",
        type=int,
        help="routed experts per block: an MoE backbone (the preset's SwiGLU width is then the shared expert's)",
    )
    group.add_argument("--top-k", type=int, help="with --experts: routed experts per token (default 2)")
    group.add_argument("--expert-ffn", type=int, help="with --experts: SwiGLU width of one routed expert (default 128)")
    group.add_argument(
        "--moe-layers", type=int, nargs="+", help="with --experts: blocks with routed experts (default: all)"
    )


def demo_config(args):
    """The `DemoConfig` the flags describe (the preset values they replace in its `overrides`)."""
    from condmem.apps.demo import DEFAULT_PROMPT, DemoConfig
    from condmem.train.heldout import DEDUP_THRESHOLD
    from condmem.train.presets import nested

    return DemoConfig(
        out=args.out,
        preset=args.preset,
        overrides=nested({key: getattr(args, flag) for flag, key in PRESET_FLAGS.items()}),
        device=args.device,
        seeds=args.seeds,
        seed=args.seed,
        minutes=args.minutes,
        max_passes=args.max_passes,
        dedup_threshold=None if args.no_dedup else DEDUP_THRESHOLD,
        tokenizer=args.tokenizer,
        prompt=DEFAULT_PROMPT if args.prompt is None else args.prompt,
        max_new_tokens=args.max_new_tokens,
        deterministic=args.deterministic,
        progress=not args.no_progress,
        use_cache=not args.no_cache,
        checkpoint=not args.no_checkpoint,
    )


def run(args) -> int:
    from condmem.apps.demo import run_demo

    summary = run_demo(demo_config(args))
    return 0 if summary["comparison"]["verdict"] else 1  # "too short to compare" is a completed run too
