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


_COMMON_EPILOG = "each op: condmem bench OP --help (its options and examples)"


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the GPU kernels (hash, gather, gate), the table lookup engine and serving",
        description="GPU benchmarks, one op each: time the code with do_bench medians (warm-up excluded, "
        "rotating inputs), measure its ceiling in the same run, append JSON rows with machine info to "
        "<out>/<name>.json and print a table. --smoke runs an op at tiny sizes (on the CPU without a GPU): "
        "it checks the code runs and times nothing meaningful.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_COMMON_EPILOG,
    )
    p.set_defaults(func=run)
    ops = p.add_subparsers(dest="op", metavar="OP", required=True)
    kernels = {
        "hash": ("the n-gram hash (prefill and decode) against torch on the GPU and numpy on the CPU", _hash_args),
        "gather": ("the table row gather (HBM, pinned host; fp8 and bf16) against the D2D copy", _gather_args),
        "gate": ("the fused gate (forward, backward, residual add) at fixed shapes against eager torch", None),
    }
    examples = {
        "hash": ["condmem bench hash", "condmem bench hash --hash-tokens 65536 --decode-batch 64 --variants"],
        "gather": ["condmem bench gather --table-mib 16384 --gather-ids 1048576"],
        "gate": ["condmem bench gate --variants"],
        "all": ["condmem bench all --out benchmarks/results --variants"],
    }
    for op, (what, add) in kernels.items():
        q = _op_parser(ops, op, what, examples[op])
        if add is not None:
            add(q)
        q.add_argument("--variants", action="store_true", help="also time tuning variants (block sizes, plain %%)")
    q = _op_parser(ops, "all", "hash, gather and gate in turn (each op's options apply)", examples["all"])
    _hash_args(q)
    _gather_args(q)
    q.add_argument("--variants", action="store_true", help="also time tuning variants (block sizes, plain %%)")
    lookup = _op_parser(
        ops,
        "lookup",
        "the table lookup engine per tier (HBM, pinned host, disk) against PCIe (H2D memcpy, D2D copy)",
        [
            "condmem bench lookup --table-gib 64 --tiers hbm host --streams uniform text",
            "condmem bench lookup --tiers host --streams text uniform --batch-tokens 16384 --rounds 3",
        ],
        out="folder of the lookup result files",
    )
    e2e = _op_parser(
        ops,
        "e2e",
        "serving throughput of 4B/8B decoders with the Engram table in HBM vs host memory (vs no Engram)",
        ["condmem bench e2e --backbones 4b 8b --table-gib 64 --sequences 512"],
        out="folder of e2e.json",
    )
    # Their modules import torch: added when the op is used, not for 'condmem --help'.
    for q, add in ((lookup, _lookup_args), (e2e, _e2e_args)):
        if hasattr(q, "defer"):
            q.defer(add)
        else:
            add(q)


def _op_parser(ops, op: str, what: str, examples: list[str], out: str = ""):
    """The parser of one op, with the options every op has (--out, --smoke) and its own examples."""
    q = ops.add_parser(
        op,
        help=what,
        description=f"condmem bench {op}: {what}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
    )
    q.add_argument(
        "--out", default="benchmarks/results", help=f"{out or f'folder of kernels_{op}.json'} (default %(default)s)"
    )
    q.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, on the GPU where there is one, else on the CPU"
        + (" through the Triton interpreter (sets TRITON_INTERPRET=1 itself)" if op in (*OPS, "all") else "")
        + ": checks the benchmark code runs, times nothing meaningful",
    )
    return q


def _hash_args(p) -> None:
    g = p.add_argument_group("hash")
    g.add_argument(
        "--hash-tokens", type=int, nargs="+", default=[16384, 262144, 1048576], help="prefill sizes (tokens)"
    )
    g.add_argument("--cpu-tokens", type=int, default=65536, help="tokens for the CPU baselines of the hash")
    g.add_argument("--decode-batch", type=int, nargs="+", default=[64, 512], help="sequences per decode step")


def _gather_args(p) -> None:
    g = p.add_argument_group("gather")
    g.add_argument("--gather-ids", type=int, default=1 << 20, help="row ids per gather (1M = the 0.6 target size)")
    g.add_argument("--table-mib", type=int, default=16384, help="HBM table size (MiB) for the gather")
    g.add_argument("--host-mib", type=int, default=4096, help="pinned host table size (MiB) for the zero-copy gather")
    g.add_argument("--host-ids", type=int, default=1 << 18, help="row ids per pinned-host gather")


def _lookup_args(p) -> None:
    from condmem.bench.lookup import add_arguments

    add_arguments(p)


def _e2e_args(p) -> None:
    from condmem.bench.e2e import add_arguments
    from condmem.bench.lookup import add_table_arguments

    add_arguments(p)
    add_table_arguments(p)


_CEILING_FRACTIONS = ("hbm_fraction", "d2d_fraction")


def _cpu_row(row: dict) -> dict:
    """A row measured on the CPU (--smoke without a GPU): labelled as the CPU's, without fractions of a
    ceiling that was not measured."""
    row = {k: v for k, v in row.items() if k not in _CEILING_FRACTIONS}
    if row.get("impl", "").endswith("-gpu"):  # torch on the device: here, the CPU
        row["impl"] = row["impl"][: -len("-gpu")] + " (cpu)"
    if row.get("tier") == "hbm":  # the device's memory: here, the CPU's
        row["tier"] = "cpu"
    if "speedup_vs_torch_gpu" in row:
        row["speedup_vs_torch_cpu"] = row.pop("speedup_vs_torch_gpu")
    return row


def _summary(op: str, rows: list[dict], device: str = "cuda") -> str:
    from condmem.bench.harness import rows_table

    cpu = device == "cpu"

    if op == "hash":
        cols = [
            ("impl", "impl", ""),
            ("phase", "phase", ""),
            ("tokens", "tokens", "d"),
            ("ms", "ms", ".4f"),
            ("tokens_per_s", "tok/s", ".3g"),
            ("hbm_fraction", "HBM frac", ".2f"),
            ("speedup_vs_torch_cpu", "x torch (cpu)", ".1f") if cpu else ("speedup_vs_torch_gpu", "x torch-gpu", ".1f"),
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
    if cpu:  # no ceiling was measured
        cols = [c for c in cols if c[0] not in _CEILING_FRACTIONS]
    return rows_table(rows, cols)


def _interpret_kernels() -> None:
    """Run the Triton kernels in the interpreter (``TRITON_INTERPRET=1``), for --smoke on the CPU.

    Triton reads the variable when a kernel is defined, i.e. when its module is imported: so
    it is set here, before any kernel module is, and refused once one already is.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    # Modules defining Triton kernels (or @triton.jit helpers: condmem.ops.launch) imported before the switch.
    compiled = sorted(
        m for m in sys.modules if m.startswith("condmem.ops.") and (m.endswith(".triton") or m == "condmem.ops.launch")
    )
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
    versions = f"torch {info['torch']}, triton {info['triton']}"
    if args.device == "cpu":
        # No GPU: no memory ceiling to measure, and nothing here is a GPU's number.
        ceiling = {"d2d_gbps": float("nan")}
        print(
            f"no GPU: --smoke on the CPU, the kernels in the Triton interpreter; no ceiling, times mean nothing; "
            f"{versions}",
            flush=True,
        )
    else:
        ceiling = copy_bandwidth_gbps(device=args.device) if not args.smoke else copy_bandwidth_gbps(1 << 20, "cuda")
        print(f"{info['gpu']}: D2D copy {ceiling['d2d_gbps']:.0f} GB/s (read + write), {versions}", flush=True)
    tables = []
    for op in ops:
        rows = modules[op].run(args, ceiling)
        if args.device == "cpu":
            rows = [_cpu_row(r) for r in rows]
        stamped = [{**r, **(ceiling if args.device != "cpu" else {}), "machine": info} for r in rows]
        path = append_rows(Path(args.out) / f"kernels_{op}.json", stamped)
        table = _summary(op, rows, args.device)
        tables.append((op, table))
        print(f"\n== {op} ({len(rows)} rows -> {path})\n{table}", flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":  # python -m condmem.cli.bench ... (without the other subcommands' imports)
    _parser = argparse.ArgumentParser(prog="condmem")
    _sub = _parser.add_subparsers(dest="command")
    register(_sub)
    _args = _parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(_args.func(_args))
