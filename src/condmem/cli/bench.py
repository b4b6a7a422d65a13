"""``condmem bench hash|gather|gate|all|lookup|e2e``: GPU benchmarks, JSON rows + a ratio table.

``lookup`` (the table lookup engine per tier, against PCIe) lives in `condmem.bench.lookup`
and measures its own ceilings (H2D memcpy, D2D copy); ``e2e`` (serving throughput with the
table in HBM vs host memory) in `condmem.bench.e2e`.

Every run measures its own ceiling first (device-to-device copy bandwidth) and reports
each kernel against it and against the plain-torch composition, in the same process.
Rows are appended as JSON lines (machine info in each) to ``<out>/kernels_<op>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

from condmem.cli import CliError

OPS = ("hash", "gather", "gate")


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the GPU kernels (hash, gather, gate) against torch and the memory ceiling",
        description="Time the Triton kernels with do_bench medians (warm-up excluded, rotating inputs), "
        "measure the device-to-device copy bandwidth in the same run as the ceiling, append JSON rows with "
        "machine info to <out>/kernels_<op>.json and print a table of ratios.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  condmem bench hash\n  condmem bench all --out benchmarks/results --variants\n"
        "  condmem bench gather --table-mib 16384 --gather-ids 1048576\n"
        "  condmem bench lookup --table-gib 64 --tiers hbm host --streams uniform text\n"
        "  condmem bench lookup --tiers host --streams text uniform --batch-tokens 16384 --rounds 3\n"
        "  condmem bench e2e --backbones 4b 8b --table-gib 64 --sequences 512",
    )
    p.add_argument(
        "op",
        choices=(*OPS, "all", "lookup", "e2e"),
        help="which kernel to benchmark (all = hash, gather, gate); lookup: the table lookup engine; "
        "e2e: serving throughput of 4B/8B decoders with the Engram table in HBM vs host memory",
    )
    p.add_argument("--out", default="benchmarks/results", help="folder of the kernels_<op>.json result files")
    p.add_argument("--variants", action="store_true", help="also time tuning variants (block sizes, plain %%)")
    p.add_argument(
        "--hash-tokens",
        type=int,
        nargs="+",
        default=[16384, 262144, 1048576],
        help="prefill sizes (tokens) for the hash",
    )
    p.add_argument("--cpu-tokens", type=int, default=65536, help="tokens for the CPU baselines of the hash")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[64, 512], help="sequences per decode step")
    p.add_argument("--gather-ids", type=int, default=1 << 20, help="row ids per gather (1M = the 0.6 target size)")
    p.add_argument("--table-mib", type=int, default=16384, help="HBM table size (MiB) for the gather")
    p.add_argument("--host-mib", type=int, default=4096, help="pinned host table size (MiB) for the zero-copy gather")
    p.add_argument("--host-ids", type=int, default=1 << 18, help="row ids per pinned-host gather")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, on the GPU where there is one, else on the CPU through the Triton interpreter "
        "(sets TRITON_INTERPRET=1 itself): checks the benchmark code runs, times nothing meaningful",
    )
    # Their modules import torch: added when 'condmem bench' is used, not for 'condmem --help'.
    if hasattr(p, "defer"):
        p.defer(_add_lookup_and_e2e_arguments)
    else:
        _add_lookup_and_e2e_arguments(p)
    p.set_defaults(func=run)


def _add_lookup_and_e2e_arguments(p) -> None:
    from condmem.bench.e2e import add_arguments as add_e2e_arguments
    from condmem.bench.lookup import add_arguments as add_lookup_arguments

    add_lookup_arguments(p.add_argument_group("lookup (condmem bench lookup)"))
    add_e2e_arguments(p.add_argument_group("e2e (condmem bench e2e)"))


def _summary(op: str, rows: list[dict]) -> str:
    from condmem.bench.harness import rows_table

    if op == "hash":
        cols = [
            ("impl", "impl", ""),
            ("phase", "phase", ""),
            ("tokens", "tokens", "d"),
            ("ms", "ms", ".4f"),
            ("tokens_per_s", "tok/s", ".3g"),
            ("hbm_fraction", "HBM frac", ".2f"),
            ("speedup_vs_torch_gpu", "x torch-gpu", ".1f"),
            ("speedup_vs_numpy-demo-cpu", "x numpy", ".0f"),
        ]
    elif op == "gather":
        cols = [
            ("tier", "tier", ""),
            ("format", "format", ""),
            ("impl", "impl", ""),
            ("block_rows", "BR", "d"),
            ("num_warps", "warps", "d"),
            ("programs_per_sm", "prog/SM", "d"),
            ("ids", "ids", "d"),
            ("ms", "ms", ".4f"),
            ("gbps", "GB/s", ".0f"),
            ("row_gbps", "row GB/s", ".1f"),
            ("d2d_fraction", "x D2D", ".2f"),
        ]
    else:
        cols = [
            ("pass", "pass", ""),
            ("impl", "impl", ""),
            ("tokens", "tokens", "d"),
            ("hc", "hc", "d"),
            ("hidden", "D", "d"),
            ("ms", "ms", ".4f"),
            ("gbps", "GB/s", ".0f"),
            ("hbm_fraction", "HBM frac", ".2f"),
            ("speedup_vs_eager", "x eager", ".1f"),
            ("x_unfused", "x gate+add", ".2f"),
            ("x_peer", "x peer", ".2f"),
        ]
    return rows_table(rows, cols)


def _interpret_kernels() -> None:
    """Run the Triton kernels in the interpreter (``TRITON_INTERPRET=1``), for --smoke on the CPU.

    Triton reads the variable when a kernel is defined, i.e. when its module is imported: so
    it is set here, before any kernel module is, and refused once one already is.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    compiled = sorted(m for m in sys.modules if m.startswith("condmem.ops.") and m.endswith(".triton"))
    if compiled:
        raise CliError(
            f"--smoke runs the kernels in the Triton interpreter, but {compiled[0]} was imported before "
            "it was switched on: set TRITON_INTERPRET=1 before starting Python"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    print("--smoke: TRITON_INTERPRET=1 (the kernels run in the Triton interpreter, on the CPU)", file=sys.stderr)


def run(args) -> int:
    import torch  # imports no kernel module: the interpreter can still be switched on below

    if args.smoke and args.op in (*OPS, "all") and not torch.cuda.is_available():
        _interpret_kernels()  # before anything below imports a kernel

    if args.op == "lookup":
        from condmem.bench.lookup import main as bench_lookup

        bench_lookup(args)
        return 0
    if args.op == "e2e":
        from condmem.bench.e2e import main as bench_e2e

        if not args.smoke and not torch.cuda.is_available():
            raise CliError("condmem bench e2e needs a CUDA device; --smoke runs a tiny model on the CPU")
        bench_e2e(args)
        return 0
    if args.smoke:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        args.hash_tokens, args.cpu_tokens, args.decode_batch = [64], 64, [8]
        args.gather_ids, args.table_mib, args.host_mib, args.host_ids = 512, 1, 1, 256
    elif not torch.cuda.is_available():
        raise CliError(
            "condmem bench needs a CUDA device (the kernels are timed on the GPU); --smoke checks the code on CPU"
        )
    else:
        args.device = "cuda"
    from pathlib import Path

    from condmem.bench import gate as bench_gate
    from condmem.bench import gather as bench_gather
    from condmem.bench import hash as bench_hash
    from condmem.bench.harness import append_rows, copy_bandwidth_gbps, machine_info

    modules = {"hash": bench_hash, "gather": bench_gather, "gate": bench_gate}
    ops = OPS if args.op == "all" else (args.op,)
    info = machine_info()
    ceiling = copy_bandwidth_gbps(device=args.device) if not args.smoke else copy_bandwidth_gbps(1 << 20, args.device)
    print(
        f"{info.get('gpu')}: D2D copy {ceiling['d2d_gbps']:.0f} GB/s (read + write), torch {info['torch']}, "
        f"triton {info['triton']}",
        flush=True,
    )
    tables = []
    for op in ops:
        rows = modules[op].run(args, ceiling)
        stamped = [{**r, **ceiling, "machine": info} for r in rows]
        path = append_rows(Path(args.out) / f"kernels_{op}.json", stamped)
        table = _summary(op, rows)
        tables.append((op, table))
        print(f"\n== {op} ({len(rows)} rows -> {path})\n{table}", flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":  # python -m condmem.cli.bench ... (without the other subcommands' imports)
    _parser = argparse.ArgumentParser(prog="condmem bench")
    _sub = _parser.add_subparsers(dest="command")
    register(_sub)
    _args = _parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(_args.func(_args))
