"""``condmem generate``: sample a completion from a trained checkpoint."""

from __future__ import annotations

import argparse
import math
import sys

from condmem.cli import UsageError
from condmem.cli.common import check_int, device_flag, note


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
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="at most this many tokens (default 128); the model holds max_seq_len tokens, prompt included: a prompt "
        "longer than max(max_seq_len - N, max_seq_len / 2) keeps its tail, N is capped to what is left (with a note)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help=f"0 is greedy; else at least {MIN_TEMPERATURE:g} (default 0.8)"
    )
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--tokenizer", help="tokenizer to use instead of the checkpoint's own (must be the same one)")
    p.add_argument(
        "--tier",
        default="module",
        choices=["module", "hbm", "host"],
        help="where the Engram tables are read from: the model's own parameters (default), or an "
        "EngramMemory in HBM / host memory with rows prefetched before layer 0",
    )
    p.set_defaults(func=run)


# Below this, dividing the logits by the temperature overflows them (NaN probabilities); 0 is greedy.
MIN_TEMPERATURE = 1e-6


def check_args(args) -> None:
    """Refuse sampling settings that would crash mid-way or be silently misread (exit status 2)."""
    t = args.temperature
    if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
        raise UsageError(
            f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (smaller ones overflow "
            f"the logits), got {t}"
        )
    check_int(args.max_new_tokens, "--max-new-tokens")
    check_int(args.top_k, "--top-k", 0, why=" (0: sample from every token)")


def fit_to_model(n_prompt: int, max_new: int, max_seq_len: int) -> tuple[int, int]:
    """(prompt tokens kept, new tokens) within the model's `max_seq_len` positions: all of both when
    they fit; else the prompt keeps its last max(max_seq_len - max_new, max_seq_len // 2) tokens
    and the new tokens take what is left."""
    if n_prompt + max_new <= max_seq_len:
        return n_prompt, max_new
    keep = max(1, min(n_prompt, max(max_seq_len - max_new, max_seq_len // 2)))
    return keep, min(max_new, max_seq_len - keep)


def run(args) -> int:
    import torch

    from condmem.models import generate
    from condmem.train.checkpoint import load_checkpoint
    from condmem.train.pipeline import EOS_CANDIDATES, find_special

    check_args(args)
    device = device_flag(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, tokenizer=args.tokenizer, load_optimizer=False)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = ckpt.tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    room = ckpt.model.cfg.max_seq_len
    keep, max_new = fit_to_model(len(ids), args.max_new_tokens, room)
    if keep < len(ids):
        note(
            "generate",
            f"the prompt's {len(ids):,} tokens were cut to its last {keep:,}: the model holds {room:,} tokens "
            f"(max_seq_len), {max_new:,} of them for new tokens",
        )
        ids = ids[-keep:]
    if max_new < args.max_new_tokens:
        note(
            "generate",
            f"--max-new-tokens {args.max_new_tokens:,} capped to {max_new:,}: the model holds {room:,} tokens "
            f"(max_seq_len), the prompt {keep:,} of them",
        )
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
        max_new,
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
