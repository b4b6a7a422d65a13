"""``condmem bench hash``: prefill tokens/s and decode latency of the Triton hash, against the torch
reference on the GPU and the official demo's numpy method on the CPU, at V4.1-Flash geometry."""

from __future__ import annotations

import numpy as np
import torch

from condmem.bench.harness import Rotator, cpu_time_ms, time_ms
from condmem.bench.numpy_demo import numpy_demo_hash
from condmem.config import EngramConfig
from condmem.hashing.hasher import NgramHasher
from condmem.ops.hash.triton import hash_prefill_triton
from condmem.layout import EngramLayout

TOKENIZER_VOCAB = 129_280


def v41_hasher(seed: int = 0) -> NgramHasher:
    cfg = EngramConfig.deepseek_v41_flash()
    gen = np.random.default_rng(seed)
    vocab = cfg.compressed_vocab_size
    lookup = np.concatenate([np.arange(vocab), gen.integers(0, vocab, TOKENIZER_VOCAB - vocab)])
    gen.shuffle(lookup)
    return NgramHasher(EngramLayout(cfg), token_lookup=lookup)


def run(args, ceiling: dict) -> list[dict]:
    """The hash's rows: prefill on the device (Triton variants and the torch reference), prefill
    on the CPU (the official demo's numpy method and the torch reference), then decode."""
    hasher = v41_hasher()
    layout = hasher.layout
    dev = args.device
    c = hasher.constants(dev)
    kernel_args = dict(
        multipliers=c["multipliers"],
        primes=c["primes"],
        magic=hasher._magic(torch.device(dev)),
        offsets=c["offsets"],
        n_heads=layout.n_heads,
        pad_id=hasher.pad_compressed_id,
        lookup=c["lookup"],
    )
    rows = []
    gen = torch.Generator().manual_seed(0)
    base = {"op": "hash", "config": "deepseek_v41_flash", "n_layers": layout.n_layers, "n_cols": layout.n_cols}
    for total in args.hash_tokens:
        rows += _prefill_rows(args, hasher, kernel_args, total, gen, base, ceiling)
    rows += _cpu_rows(args, hasher, gen, base, rows)
    rows += _decode_rows(args, hasher, gen, base)
    return rows


def _prefill_variants(args) -> list[tuple[str, dict]]:
    """(name, tuning) of the Triton prefill variants timed: the default and plain `%`, with
    `--variants` also other block sizes and warp counts."""
    variants = [
        ("triton", dict(fast_mod=True, block_t=128)),
        ("triton-plain-mod", dict(fast_mod=False, block_t=128)),
    ]
    if args.variants:
        variants += [
            ("triton-bt64", dict(fast_mod=True, block_t=64)),
            ("triton-bt256", dict(fast_mod=True, block_t=256)),
            ("triton-bt128-w8", dict(fast_mod=True, block_t=128, num_warps=8)),
            ("triton-bt256-w8", dict(fast_mod=True, block_t=256, num_warps=8)),
        ]
    return variants


def _prefill_rows(
    args, hasher: NgramHasher, kernel_args: dict, total: int, gen, base: dict, ceiling: dict
) -> list[dict]:
    """Prefill rows at `total` tokens (sequences of up to 4096): each Triton variant, checked equal to
    the torch reference first, and the torch reference on the device."""
    dev = args.device
    batch = max(1, total // 4096)
    length = total // batch
    tokens = batch * length
    sets = [(torch.randint(0, TOKENIZER_VOCAB, (batch, length), generator=gen).to(dev),) for _ in range(4)]
    ref = hasher(sets[0][0], backend="torch", check=False)
    got = hasher(sets[0][0], check=False, backend="triton")
    assert torch.equal(ref, got), "Triton hash differs from the reference"
    out = torch.empty_like(got)
    out_bytes_per_token = hasher.layout.n_layers * hasher.layout.n_cols * 8
    bytes_moved = tokens * (8 + out_bytes_per_token)  # ids read + row ids written
    results = {}
    for name, kw in _prefill_variants(args):
        fn = Rotator(lambda ids, kw=kw, out=out: hash_prefill_triton(ids, **kernel_args, out=out, **kw), sets)
        results[name] = time_ms(fn, dev)
    results["torch-gpu"] = time_ms(
        Rotator(lambda ids: hasher(ids, backend="torch", check=False), sets), dev, rep_ms=300
    )
    rows = []
    for name, t in results.items():
        tps = tokens / (t["ms"] * 1e-3)
        row = {
            **base,
            "impl": name,
            "phase": "prefill",
            "tokens": tokens,
            "batch": batch,
            "seq_len": length,
            **t,
            "tokens_per_s": tps,
        }
        if name.startswith("triton"):
            gbps = bytes_moved / (t["ms"] * 1e-3) / 1e9
            row.update(
                bytes=bytes_moved,
                gbps=gbps,
                hbm_fraction=gbps / ceiling["d2d_gbps"],
                speedup_vs_torch_gpu=results["torch-gpu"]["ms"] / t["ms"],
            )
        rows.append(row)
    del sets, ref, got, out
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def _cpu_rows(args, hasher: NgramHasher, gen, base: dict, device_rows: list[dict]) -> list[dict]:
    """CPU prefill rows: the official demo's numpy method (checked equal to the torch reference)
    and the torch reference, same geometry. The fastest Triton row of `device_rows` gains its
    speedup over each."""
    layout = hasher.layout
    cpu_tokens = args.cpu_tokens
    ids_cpu = torch.randint(0, TOKENIZER_VOCAB, (max(1, cpu_tokens // 4096), min(4096, cpu_tokens)), generator=gen)
    compressed = hasher.compress(ids_cpu).numpy()
    mult, primes = layout.multipliers_array(), layout.primes_array()
    demo = numpy_demo_hash(compressed, mult, primes, layout.n_heads, hasher.pad_compressed_id)
    assert np.array_equal(demo, hasher(ids_cpu, with_offsets=False, backend="torch").numpy()), "numpy demo differs"
    t_np = cpu_time_ms(
        lambda: numpy_demo_hash(compressed, mult, primes, layout.n_heads, hasher.pad_compressed_id), repeats=3
    )
    t_cpu = cpu_time_ms(lambda: hasher(ids_cpu, backend="torch"), repeats=3)
    n_cpu = ids_cpu.numel()
    best = min((r for r in device_rows if r["impl"] == "triton"), key=lambda r: r["ms"] / r["tokens"])
    rows = []
    for name, t in (("numpy-demo-cpu", t_np), ("torch-cpu", t_cpu)):
        tps = n_cpu / (t["ms"] * 1e-3)
        rows.append(
            {
                **base,
                "impl": name,
                "phase": "prefill",
                "tokens": n_cpu,
                "threads": torch.get_num_threads() if name == "torch-cpu" else 1,
                **t,
                "tokens_per_s": tps,
            }
        )
        best[f"speedup_vs_{name}"] = best["tokens_per_s"] / tps
    return rows


def _decode_rows(args, hasher: NgramHasher, gen, base: dict) -> list[dict]:
    """Decode rows: one token per sequence against NgramHistory, padding rows included, Triton and torch."""
    dev = args.device
    rows = []
    for n_seq in args.decode_batch:
        hist = hasher.new_history(n_seq, device=dev)
        slots = torch.tensor([hist.allocate() for _ in range(n_seq)], device=dev)
        valid = torch.ones(n_seq, dtype=torch.bool, device=dev)
        valid[-max(1, n_seq // 8) :] = False
        sets = [(torch.randint(0, TOKENIZER_VOCAB, (n_seq,), generator=gen).to(dev),) for _ in range(4)]
        for name, backend in (("triton", "triton"), ("torch-gpu", "torch")):
            t = time_ms(
                Rotator(lambda ids, b=backend: hasher.decode(hist, slots, ids, valid=valid, backend=b), sets),
                dev,
                warmup_ms=20,
                rep_ms=100,
            )
            rows.append(
                {
                    **base,
                    "impl": name,
                    "phase": "decode",
                    "tokens": n_seq,
                    **t,
                    "us": t["ms"] * 1e3,
                    "tokens_per_s": n_seq / (t["ms"] * 1e-3),
                }
            )
    return rows
