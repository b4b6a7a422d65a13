"""``condmem generate``: sample a completion from a trained checkpoint."""

from __future__ import annotations

import argparse
import math
import sys

from condmem.cli import CliError


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample a completion from a trained checkpoint",
        description="Load a checkpoint written by 'condmem train' or 'condmem demo' (a checkpoint folder, or a run "
        "directory: its latest checkpoint), verify its files and that its tokenizer matches its Engram tables, and "
        "continue the prompt with a KV cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  condmem generate --checkpoint condmem-demo/engram --prompt 'def fibonacci(n):'",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or run directory")
    p.add_argument("--prompt", required=True, help="text to continue ('-' reads stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--tokenizer", help="tokenizer to use instead of the checkpoint's own (must be the same one)")
    p.add_argument(
        "--tier",
        default="module",
        choices=["module", "hbm", "host"],
        help="where the Engram tables are read from: the model's own parameters (default), or an "
        "EngramMemory in HBM / host memory with rows prefetched before layer 0",
    )
    p.set_defaults(func=run)


def check_args(args) -> None:
    """Refuse sampling settings that would crash mid-way or be silently misread."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise CliError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0 (0: sample from every token), got {args.top_k}")


def run(args) -> int:
    import torch

    from condmem.models import generate
    from condmem.train.checkpoint import load_checkpoint
    from condmem.train.demo import resolve_device
    from condmem.train.pipeline import EOS_CANDIDATES, find_special

    check_args(args)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, tokenizer=args.tokenizer, load_optimizer=False)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = ckpt.tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    eos = find_special(ckpt.tokenizer, EOS_CANDIDATES, "end-of-document", fallback=-1)
    memory = None
    if args.tier != "module" and ckpt.model.hasher is not None:
        from condmem.serving import EngramMemory

        tables = {b.layer_id: b.engram.table.weight for b in ckpt.model.blocks if b.engram is not None}
        memory = EngramMemory.from_weights(
            ckpt.model.hasher,
            tables,
            args.tier,
            device,
            host_alloc="mmap_register" if torch.cuda.is_available() else "pageable",
        )
    new = generate(
        ckpt.model,
        torch.tensor(ids),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        stop_ids=(eos,) if eos >= 0 else (),
        memory=memory,
    )
    if memory is not None:
        memory.close()
    sys.stdout.write(prompt + ckpt.tokenizer.decode(new.tolist(), skip_special_tokens=True) + "\n")
    return 0
