"""What an eager call of an Engram op costs beyond its kernel: eager against CUDA-graph replay.

For the hasher (`NgramHasher.__call__`, `hash_ragged` with history slots), the gate
(`engram_gate(..., residual=True)`) and the gather (`engram_gather`, packed fp8 rows) at
128 and 16K tokens (DeepSeek-V4.1 geometry: 2 Engram layers x 24 columns, 256-wide rows,
hc 4 x 4096 hidden), this measures per call:

* ``eager``: the public call as a user makes it (ids checked: the hasher's default
  ``check=True``; kernels launched through `condmem.ops.launch`'s shortcut), on fresh inputs
  (several sets in turn), ``--calls`` calls between two synchronizations, median over
  ``--batches`` batches: what the GPU sees when the host queues one call after another
  (host-bound when the host's work exceeds the kernel's);
* ``eager_triton_launch``: the same with the shortcut off (every launch Triton's own
  ``kernel[grid](...)``);
* ``*_nocheck`` (hash ops): the same with ``check=False``;
* ``graph``: the same calls captured in one CUDA graph and replayed (the kernels alone);
* ``ratio`` = eager / graph (target <= 1.5);
* ``torch_add``: one ATen kernel (``row_ids + 1``), eager and replayed: the floor of an eager call
  on the machine, the ratio no eager op with a kernel of that size can beat.

Every op's eager result is compared (``torch.equal``) with its graph-replayed result on the
same inputs, the hashes with the torch reference, and a bad token id must still raise
`HashInputError` (deferred on the GPU: raised by `raise_pending`).

    PYTHONPATH=src python3 benchmarks/eager_overhead.py --out $OUT        # GPU, < 1 minute

``--host-only`` runs on the CPU with every launch stubbed below Triton's Python (a stand-in
driver and compiled kernel; the C launcher is a builtin): per call, the Python function calls
(cProfile) and microseconds of the host work, once through Triton's own launch and once
through the shortcut (plus an HF decode step's Python calls, with transformers installed).
The GPU branches (pinned buffers, events) and the C launcher do not run there.

    PYTHONPATH=src python3 benchmarks/eager_overhead.py --host-only --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

if "--host-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # lets the Triton code paths run on CPU tensors (launches stubbed)

import numpy as np
import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.bench.harness import graph_replay_ms, machine_info
from condmem.hashing.hasher import HashInputError
from condmem.hashing.id_checks import PendingIdChecks
from condmem.ops.gate import engram_gate
from condmem.ops.gather import engram_gather

VOCAB = 129_280  # DeepSeek-V4's token ids
HC, HIDDEN = 4, 4096  # V4.1 Flash residual branches and width
TABLE_ROWS = 1 << 22  # packed fp8 rows of 264 B: 1.1 GB, far larger than L2


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


@functools.lru_cache(maxsize=1)
def v41_layout() -> EngramLayout:
    return EngramLayout(EngramConfig.deepseek_v41_flash().replace(num_embeddings=None))


def make_hasher(device, backend: str = "auto") -> NgramHasher:
    layout = v41_layout()
    lookup = np.arange(VOCAB) % layout.compressed_vocab_size  # a valid map onto V' ids
    hasher = NgramHasher(layout, token_lookup=lookup, pad_id=layout.config.pad_id, backend=backend)
    hasher.constants(device)
    return hasher


def cases(tokens: int, device, sets: int, backend: str | None = None) -> tuple[dict, NgramHasher]:
    """({op name: (call(*args), graph_call(*args) or None, [args per input set])}, the hasher); `backend` forces one
    (the host-only run takes the Triton paths on CPU tensors)."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    hasher = make_hasher(device, backend or "auto")
    n_cols = hasher.layout.n_cols
    out = {}

    ids = [torch.randint(0, VOCAB, (1, tokens), device=device, generator=gen) for _ in range(sets)]
    out["hasher"] = (lambda x: hasher(x), lambda x: hasher(x, check=False), [(x,) for x in ids])
    out["hasher_nocheck"] = (lambda x: hasher(x, check=False), None, [(x,) for x in ids])

    # Ragged: decode-like at 128 tokens (128 sequences of one token), prefill-like at 16K (16 of 1024).
    n_seqs = 128 if tokens <= 128 else 16
    history = hasher.new_history(n_seqs, device)
    slots = torch.arange(n_seqs, device=device)
    cu = torch.arange(0, tokens + 1, tokens // n_seqs, device=device, dtype=torch.int32)
    flat = [x.reshape(-1) for x in ids]
    out["hash_ragged"] = (
        lambda x: hasher.hash_ragged(x, cu, history=history, slots=slots),
        lambda x: hasher.hash_ragged(x, cu, history=history, slots=slots, check=False),
        [(x,) for x in flat],
    )
    out["hash_ragged_nocheck"] = (
        lambda x: hasher.hash_ragged(x, cu, history=history, slots=slots, check=False),
        None,
        [(x,) for x in flat],
    )

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dim = HIDDEN if device.type == "cuda" else 64
    qw = torch.ones(HC, dim, device=device, dtype=dtype)
    kw = torch.ones(HC, dim, device=device, dtype=dtype)
    gate_sets = [
        (
            torch.randn(tokens, HC, dim, device=device, dtype=dtype, generator=gen),
            torch.randn(tokens, (HC + 1) * dim, device=device, dtype=dtype, generator=gen),
        )
        for _ in range(sets)
    ]

    def gate(h, kv):
        return engram_gate(h, kv, qw, kw, residual=True, backend=backend)

    out["gate"] = (gate, gate, gate_sets)

    rows = TABLE_ROWS if device.type == "cuda" else 4096
    table = torch.randint(0, 256, (rows, 264), device=device, dtype=torch.uint8, generator=gen)
    table[:, 256:] = torch.randint(120, 135, (rows, 8), device=device, dtype=torch.uint8, generator=gen)
    row_ids = [torch.randint(0, rows, (tokens, n_cols), device=device, generator=gen) for _ in range(sets)]

    def gather(r):
        return engram_gather(r, table, head_dim=256, backend=backend)

    out["gather"] = (gather, gather, [(r,) for r in row_ids])
    # The floor of any eager call: one ATen kernel (an add on the row ids), eager against its graph replay.
    out["torch_add"] = (torch.Tensor.__add__, torch.Tensor.__add__, [(r, 1) for r in row_ids])

    if device.type == "cuda":
        # The launch functions alone (output allocated, arguments prepared here): the floor an
        # eager call cannot go below without bypassing Triton's own launcher.
        from condmem.ops.gate.triton import gate_forward_triton
        from condmem.ops.gather.reference import table_format
        from condmem.ops.gather.triton import gather_triton
        from condmem.ops.hash.triton import hash_prefill_triton

        c = hasher.constants(device)
        magic = hasher._magic(device)
        out["hasher_launcher"] = (
            lambda x: hash_prefill_triton(
                x,
                multipliers=c["multipliers"],
                primes=c["primes"],
                magic=magic,
                offsets=c["offsets"],
                n_heads=hasher.layout.n_heads,
                pad_id=hasher.pad_compressed_id,
                lookup=c["lookup"],
            ),
            None,
            [(x,) for x in ids],
        )
        out["gate_launcher"] = (
            lambda h, kv: gate_forward_triton(h, kv, qw, kw, 1e-6, 1e-6, None, residual=True),
            None,
            gate_sets,
        )
        fmt = table_format(table, None, 256)

        def gather_launch(r):
            dst = torch.empty((r.numel(), 256), dtype=torch.bfloat16, device=device)
            return gather_triton(r.reshape(-1), table, None, fmt, 0, dst, None, None, 4, None, None)

        out["gather_launcher"] = (gather_launch, None, [(r,) for r in row_ids])
    return out, hasher


def eager_ms(fn, arg_sets: list[tuple], calls: int, batches: int) -> float:
    """Milliseconds per call: `calls` calls on the input sets in turn, synchronized per batch; median."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def same_as_graph(fn, graph_fn, args: tuple, hasher: NgramHasher) -> bool:
    """The eager result equals the graph-replayed one on the same inputs."""
    want = fn(*args)
    hasher.raise_pending()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    graph_fn(*args)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        got = graph_fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(want.float().nan_to_num(), got.float().nan_to_num())


def checks(device) -> dict:
    """Exactness and the deferred id check, on the GPU."""
    hasher = make_hasher(device)
    ids = torch.randint(0, VOCAB, (2, 300), device=device)
    got = {"hasher_equals_reference": torch.equal(hasher(ids), hasher(ids, backend="torch"))}
    cu = torch.tensor([0, 100, 600], device=device, dtype=torch.int32)
    got["hash_ragged_equals_whole"] = torch.equal(
        hasher.hash_ragged(ids.reshape(-1), cu)[100:600], hasher(ids.reshape(1, -1)[:, 100:600])[0]
    )
    bad = ids.clone()
    bad[1, 7] = VOCAB + 5
    try:
        hasher(bad)
        hasher.raise_pending()
        got["bad_id_raises"] = False
    except HashInputError as exc:
        got["bad_id_raises"] = str(VOCAB + 5) in str(exc)
    hasher(ids)
    hasher.raise_pending()  # the error is not raised twice
    checks = PendingIdChecks(HashInputError, 1000, "table", noun="row id")
    got["submit_ids_names_min_and_max"] = True
    for bad_ids, name in (([3, -4, 5], "-4"), ([3, 1000, 5], "1000")):
        checks.submit_ids(torch.tensor(bad_ids, device=device), "a lookup")
        try:
            checks.raise_pending(block=True)
            got["submit_ids_names_min_and_max"] = False
        except HashInputError as exc:
            got["submit_ids_names_min_and_max"] &= f"row id {name} " in str(exc)
    return got


def triton_launch_ms(fn, arg_sets: list[tuple], calls: int, batches: int) -> float:
    """`eager_ms` with `condmem.ops.launch`'s shortcut off: every launch is Triton's own ``kernel[grid](...)``."""
    import condmem.ops.launch as launch

    saved, launch.RUNTIME = launch.RUNTIME, None
    try:
        return eager_ms(fn, arg_sets, calls, batches)
    finally:
        launch.RUNTIME = saved


def launch_counts() -> dict:
    """[Triton's launches, shortcut launches] per launcher so far."""
    import condmem.ops.gate.triton as gate_t
    import condmem.ops.gather.triton as gather_t
    import condmem.ops.hash.triton as hash_t

    names = ("_PREFILL", "_RAGGED", "_ADVANCE", "_DECODE")
    counts = {n.strip("_").lower(): list(getattr(hash_t, n).launches) for n in names}
    counts.update(gate=list(gate_t._GATE_FWD.launches), gather=list(gather_t._GATHER.launches))
    return counts


def run_gpu(args) -> dict:
    import condmem.ops.launch as launch

    device = torch.device("cuda")
    result = {"machine": machine_info(), "args": vars(args), "checks": checks(device), "rows": []}
    result["shortcut"] = launch.runtime() is not None
    log("checks", result["checks"], "shortcut launch:", result["shortcut"])
    for tokens in (128, 16384):
        ops, hasher = cases(tokens, device, args.sets)
        for name, (fn, graph_fn, arg_sets) in ops.items():
            row = {"op": name, "tokens": tokens, "eager_ms": eager_ms(fn, arg_sets, args.calls, args.batches)}
            row["eager_triton_launch_ms"] = triton_launch_ms(fn, arg_sets, args.calls, args.batches)
            if graph_fn is not None:
                hasher.raise_pending()  # checks still in flight are read before a capture (no event query in it)
                if not name.startswith("hash_ragged"):  # (advances its history: compared in `checks`)
                    row["equal"] = same_as_graph(fn, graph_fn, arg_sets[0], hasher)
                row["graph_ms"] = graph_replay_ms(graph_fn, arg_sets, launches=args.sets * 4, replays=args.batches)
                row["ratio"] = row["eager_ms"] / row["graph_ms"]
            result["rows"].append(row)
            log(row)
        del ops, hasher
        torch.cuda.empty_cache()
    graph_of = {(r["op"], r["tokens"]): r.get("graph_ms") for r in result["rows"]}
    for r in result["rows"]:  # the no-check variants and the bare launchers against the same graph
        base = r["op"].replace("_nocheck", "").replace("_launcher", "")
        if r.get("graph_ms") is None and graph_of.get((base, r["tokens"])):
            r["ratio"] = r["eager_ms"] / graph_of[(base, r["tokens"])]
    result["launches"] = launch_counts()
    log("launches [triton, shortcut]:", result["launches"])
    return result


# ---------------------------------------------------------------------- host only (CPU, launches stubbed)
class _CpuDriver:
    """Stands in for Triton's CUDA driver on the CPU: device 0, stream 0, an H100/H200 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _stub_compiled():
    """A CompiledKernel whose C launcher is a builtin (``"".format`` takes and ignores any arguments):
    Triton's own Python around it (launch metadata, the ``run`` property) runs as on a GPU."""
    from triton.compiler.compiler import CompiledKernel

    compiled = object.__new__(CompiledKernel)
    compiled.module, compiled.function, compiled.name, compiled.src = 1, 0, "stub", None
    compiled.packed_metadata, compiled._run = (4, 1, 0), "".format
    compiled._module_pid = None  # (Triton 3.9 unloads a module of its own process when the object goes)
    return compiled


def _jit_without_gpu(kernel):
    """The kernel as a real JITFunction (the host-only run imports Triton as an interpreter) whose compile
    step returns `_stub_compiled`: Triton's normal launch then runs its binder, cache key and checks."""
    from triton.runtime.jit import JITFunction

    jit = JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))

    def compile_stub(key, signature, device, constexprs, options, attrs, warmup):
        compiled = jit.device_caches[device][0][key] = _stub_compiled()
        return compiled

    jit._do_compile = compile_stub
    return jit


def stub_kernels(shortcut: bool) -> None:
    """Every launch of the ops stubbed below Triton's Python: `shortcut` switches on `condmem.ops.launch`'s
    shortcut (what a user gets on a GPU) with a stand-in runtime; else every launch is Triton's normal one."""
    import triton
    from triton.runtime import driver

    import condmem.ops.gate.triton as gate_t
    import condmem.ops.gather.triton as gather_t
    import condmem.ops.hash.triton as hash_t
    import condmem.ops.launch as launch

    driver.set_active(_CpuDriver())
    for fast in (hash_t._PREFILL, hash_t._RAGGED, hash_t._ADVANCE, hash_t._DECODE, gate_t._GATE_FWD, gather_t._GATHER):
        if not hasattr(fast, "interpreted"):
            fast.interpreted = fast.kernel
        fast.kernel = _jit_without_gpu(fast.interpreted)
    # The current device and stream by builtins, as torch's own are (int() is 0, abs(0) is 0).
    launch.RUNTIME = launch.Runtime(triton.knobs, int, abs) if shortcut else None
    # The stubs write no id ranges: the slots start at zero (in range), which the CPU reads at once.
    hash_t.id_range_slots = lambda n_tokens, device, block_t=128: torch.zeros(
        (max(1, -(-n_tokens // block_t)), 3), dtype=torch.int32, device=device
    )


def python_calls(fn, n: int) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    return sum(c[1] for c in pstats.Stats(prof).stats.values()) / n


def host_us(fn, n: int = 200, batches: int = 15) -> float:
    """Microseconds per call, the fastest of `batches` batches (the host is shared: the least disturbed)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / n)
    return min(times)


def hf_decode_step() -> dict | None:
    """Python calls and host microseconds of one decode step of HF generate() on the CPU: a tiny Llama,
    plain and with Engram (module tables; tables in an EngramMemory), each step's from generates of 1 and
    17 tokens. (On the CPU the Engram ops are the torch references: the adapter's own work is what
    compares with a GPU step.)"""
    try:
        import transformers
    except ImportError:
        return None
    from condmem.integrations.transformers import add_engram, offload_tables
    from condmem.tokenizer import CompressedTokenizer
    from condmem.train.bpe import train_bpe

    text = "The quick brown fox jumps over the lazy dog. def add(x, y): return x + y\n" * 20
    tok = CompressedTokenizer.from_any(train_bpe([text], vocab_size=300), use_cache=False)

    def model():
        cfg = transformers.LlamaConfig(
            vocab_size=tok.original_vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=1,
        )
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()

    ids = torch.randint(2, tok.original_vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    ecfg = EngramConfig(
        layer_ids=[1, 2], max_ngram_size=3, n_heads=2, head_dim=16, table_size=61, pad_id=1, short_conv=False
    )

    def per_step(m) -> dict:
        def gen(n):
            kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "min_new_tokens": n, "max_new_tokens": n}
            return lambda: m.generate(ids, **kw)

        def seconds(fn) -> float:  # the fastest of several: the host is shared
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        with torch.no_grad():
            gen(17)()
            calls = (python_calls(gen(17), 3) - python_calls(gen(1), 3)) / 16
            us = (seconds(gen(17)) - seconds(gen(1))) / 16 * 1e6
        return {"python_calls": calls, "host_us": us}

    plain = model()
    out = {"none": per_step(plain)}
    engram = model()
    add_engram(engram, ecfg, tok)
    out["engram_module_tables"] = per_step(engram)
    memory = offload_tables(engram, tier="host")
    try:
        out["engram_memory_host"] = per_step(engram)
    finally:
        memory.close()
    return out


def run_host(args) -> dict:
    device = torch.device("cpu")
    result = {"machine": machine_info(), "args": vars(args), "rows": []}
    for tokens in (128, 16384):
        for launch_path in ("triton", "shortcut"):
            stub_kernels(shortcut=launch_path == "shortcut")
            ops, _ = cases(tokens, device, args.sets, backend="triton")
            for name, (fn, _, arg_sets) in ops.items():
                call = functools.partial(fn, *arg_sets[0])
                call()  # a specialization's first call compiles (here: the stub)
                row = {"op": name, "tokens": tokens, "launch": launch_path}
                row.update(python_calls=python_calls(call, 50), host_us=host_us(call))
                result["rows"].append(row)
                log(row)
    result["hf_decode_step"] = hf_decode_step()
    log("HF decode step:", result["hf_decode_step"])
    return result


def print_host(result: dict) -> None:
    rows = {(r["op"], r["tokens"], r["launch"]): r for r in result["rows"]}
    print("per call, launches stubbed below Triton's Python: Triton's own launch, then condmem's shortcut")
    print(f"{'op':>20} {'tokens':>7} {'calls triton':>13} {'calls shortcut':>15} {'us triton':>10} {'us shortcut':>12}")
    for (op, tokens, path), r in rows.items():
        if path == "triton":
            f = rows[(op, tokens, "shortcut")]
            print(
                f"{op:>20} {tokens:7d} {r['python_calls']:13.1f} {f['python_calls']:15.1f} "
                f"{r['host_us']:10.1f} {f['host_us']:12.1f}"
            )
    hf = result["hf_decode_step"]
    if hf:
        steps = ", ".join(f"{k} {v['python_calls']:.0f} calls {v['host_us']:.0f} us" for k, v in hf.items())
        print("HF decode step (CPU, tiny Llama, torch ops), per step: " + steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=64, help="eager calls between two synchronizations")
    ap.add_argument("--batches", type=int, default=15, help="batches (eager) and replays (graph); median")
    ap.add_argument("--sets", type=int, default=4, help="input sets used in turn")
    ap.add_argument("--host-only", action="store_true", help="CPU, launches stubbed: Python calls and host us")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    result = run_host(args) if args.host_only else run_gpu(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "eager_overhead_host.json" if args.host_only else "eager_overhead.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten {out / name}")
    if args.host_only:
        print_host(result)
        return
    print(
        "eager: public call, fresh inputs, synchronized per batch of calls (median), launched as a user gets "
        f"it (condmem's shortcut {'on' if result['shortcut'] else 'OFF'}); triton: the same through Triton's own "
        "launch; graph: the same calls replayed from a CUDA graph; *_launcher: the launch function alone; "
        "target ratio (eager / graph) <= 1.5"
    )
    print(f"{'op':>20} {'tokens':>7} {'eager ms':>9} {'triton ms':>10} {'graph ms':>9} {'ratio':>6}  equal")
    for r in result["rows"]:
        graph = f"{r['graph_ms']:9.4f}" if r.get("graph_ms") is not None else f"{'':>9}"
        ratio = f"{r['ratio']:6.2f}" if r.get("ratio") is not None else f"{'':>6}"
        print(
            f"{r['op']:>20} {r['tokens']:7d} {r['eager_ms']:9.4f} {r['eager_triton_launch_ms']:10.4f} {graph} "
            f"{ratio}  {r.get('equal', '')}"
        )
    print("checks:", result["checks"])
    failed = [k for k, v in result["checks"].items() if not v] + [
        f"{r['op']}@{r['tokens']}" for r in result["rows"] if r.get("equal") is False
    ]
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
