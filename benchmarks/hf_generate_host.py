"""Batched greedy `generate()` of a Hugging Face Llama (~1B parameters, built from a config) with
Engram tables in page-locked host memory, against the same tables in HBM and the same model
without Engram.

Variants (two models with the same backbone weights: the plain Llama, and a copy with Engram):

* ``none``: the plain Llama;
* ``hbm``: the copy with `add_engram` at ``--engram-layers`` (V4.1 geometry: 2-4-grams, 8 heads,
  256-wide rows, no ShortConv; value projection random, not zero, so Engram changes the
  tokens), its tables in an `EngramMemory` in HBM;
* ``host``: the same tables in an `EngramMemory` in page-locked host memory. Every forward's
  lookups start before decoder layer 0 (prefill: staged CPU gather + DMA and zero-copy;
  decode steps: one zero-copy gather kernel);
* ``none_again``: the plain Llama once more, an A/A control: its distance from ``none`` is the
  run's noise (a machine whose host speed drifts moves every eager ``generate()``);
* ``hbm_eager``: ``hbm`` with the adapter's decode graphs off (``decode_graphs = False``): every
  decode step's Engram work eager, what the graphs are measured against.

``hbm`` and ``host`` replay Engram's share of each decode step from CUDA graphs (the adapter's
default, `condmem.integrations.transformers.decode_graph`); prefill is eager in all variants.

Every variant is built and warmed up at full length first; then ``--repeats`` rounds each time
every variant once, in an order shuffled each round (seeded), so a drift within the run falls on
all alike and no variant always follows the same one. tokens/s counts new tokens (best run);
ratios are also given per round (paired), from each run's total and from its median decode step.

Prompts: ``--batch`` windows of ``--prompt-tokens`` tokens of the standard library's source
through the DeepSeek-V4 tokenizer (no padding). The host and HBM variants' greedy tokens are
compared, and one forward over prompt + generated tokens gives each memory's rows and logits
(``torch.equal``). ``--profile-steps N`` also profiles a generate of N tokens per memory: host
time by torch op, and by Python function (cProfile), with the functions whose time differs most
between no Engram and HBM tables, and between HBM and host tables.

    PYTHONPATH=src python3 benchmarks/hf_generate_host.py --out DIR
    PYTHONPATH=src python3 benchmarks/hf_generate_host.py --tiny --device cpu      # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import os
import platform
import pstats
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts

import torch

from condmem import EngramConfig  # noqa: E402
from condmem.bench.lookup_setup import stdlib_sources  # noqa: E402
from condmem.integrations.transformers import add_engram, get_engram, offload_tables  # noqa: E402
from condmem.serving.memory import EngramMemory  # noqa: E402
from condmem.tokenizer import CompressedTokenizer  # noqa: E402
from condmem.utils.code_version import short_commit  # noqa: E402


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def prompts(ctok: CompressedTokenizer, batch: int, tokens: int) -> torch.Tensor:
    """[batch, tokens] ids: one window from each of `batch` standard-library files long enough."""
    out = []
    for text in stdlib_sources(batch * 200_000):
        ids = ctok.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= tokens + 64:
            out.append(ids[64 : 64 + tokens])  # past the license headers
        if len(out) == batch:
            return torch.tensor(out, dtype=torch.int64)
    raise SystemExit(f"found only {len(out)} files of {tokens + 64}+ tokens")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def greedy(ids: torch.Tensor, new: int) -> dict:
    """`generate()` arguments of every run: greedy, exactly `new` tokens, no padding."""
    return {"attention_mask": torch.ones_like(ids), "do_sample": False, "min_new_tokens": new, "max_new_tokens": new}


class StepClock:
    """A stopping criterion that never stops: the wall clock at each of a generate()'s steps. The
    median step of a run leaves out what lands in a few steps only (a stall of the machine, the
    prompt's forward), which a run's total keeps."""

    def __init__(self):
        self.times: list[float] = []
        self._never: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        if self._never is None or self._never.shape[0] != input_ids.shape[0]:
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._never

    def median_step_ms(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:])) * 1e3


class RecordedMemory:
    """An `EngramMemory` that keeps, for every forward, the row ids it was asked for and the rows
    each layer read (to find where two memories' generate runs part)."""

    def __init__(self, memory: EngramMemory, layers: list[int]):
        self.memory, self.layers, self.calls = memory, layers, []

    def __getattr__(self, name):
        return getattr(self.memory, name)

    def lookup(self, row_ids, **kwargs):
        prepared = self.memory.lookup(row_ids, **kwargs)
        self.calls.append((row_ids.clone(), {lid: prepared.row_vectors(lid).clone() for lid in self.layers}))
        return prepared


def traced_generate(model, adapter, memory: EngramMemory, ids: torch.Tensor, new: int, layers: list[int]):
    """Greedy generate with `memory`, recording each step's row ids, rows and logits."""
    recorded = RecordedMemory(memory, layers)
    adapter.memory, adapter.decode_graphs = recorded, False  # every step's lookup through `recorded`
    try:
        out = model.generate(ids, **greedy(ids, new), output_logits=True, return_dict_in_generate=True)
    finally:
        adapter.memory, adapter.decode_graphs = memory, True
    return out.sequences[:, ids.shape[1] :], out.logits, recorded.calls


def _device_events(averages):
    """The kernels and copies of a profile (the ops that launched them carry their time too)."""
    from torch.autograd import DeviceType

    return [e for e in averages if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]


def profile_generate(model, name: str, ids: torch.Tensor, new: int, top: int = 15) -> dict:
    """Host time of one greedy generate of `new` tokens: by torch op (torch.profiler, self CPU
    time) and by Python function (cProfile: own and cumulative time). Returns both."""
    from torch.profiler import ProfilerActivity, profile

    kw = greedy(ids, new)
    with torch.no_grad():
        model.generate(ids, **kw)
        sync(ids.device.type)
        t0 = time.perf_counter()
        on_gpu = ids.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
            model.generate(ids, **kw)
            sync(ids.device.type)
        seconds = time.perf_counter() - t0
        prefill_gpu_ms = None
        if on_gpu:  # the prompt's forward alone (one new token): what the decode steps' GPU time is net of
            with profile(activities=[ProfilerActivity.CUDA]) as first:
                model.generate(ids, **greedy(ids, 1))
                sync("cuda")
            prefill_gpu_ms = sum(e.self_device_time_total for e in _device_events(first.key_averages())) / 1e3
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        model.generate(ids, **kw)
        sync(ids.device.type)
        profiler.disable()
        py_seconds = time.perf_counter() - t0
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]
    ops = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events]
    # Every host-side op and CUDA runtime/driver call by count (launches, event records, stream waits,
    # copies): what a variant adds a step, free of the host's speed.
    op_counts = {e.key: e.count for e in averages if e.self_cpu_time_total > 0 or e.cpu_time_total > 0}
    # GPU work (kernels and copies) does not move with the host's speed, which sets an eager
    # generate's wall clock: the stable measure of what a variant adds.
    gpu = sorted(_device_events(averages), key=lambda e: -e.self_device_time_total)
    gpu_ms = sum(e.self_device_time_total for e in gpu) / 1e3
    gpu_ops = [{"op": e.key, "calls": e.count, "gpu_ms": e.self_device_time_total / 1e3} for e in gpu[:top]]
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}
    functions = {
        f"{Path(f).name}:{line}:{name}": {"calls": c[1], "own_ms": c[2] * 1e3, "cum_ms": c[3] * 1e3}
        for (f, line, name), c in stats.items()
    }
    log(
        f"profile, {name}: {seconds:.2f} s for {new} "
        f"new tokens (torch.profiler), {py_seconds:.2f} s (cProfile); GPU busy {gpu_ms:.1f} ms"
    )
    for op in ops:
        log(f"  {op['op'][:60]:60s} {op['calls']:7d} {op['self_cpu_ms']:9.1f} ms")
    log("  GPU time by kernel or copy:")
    for op in gpu_ops[:8]:
        log(f"  {op['op'][:60]:60s} {op['calls']:7d} {op['gpu_ms']:9.2f} ms")
    return {
        "seconds": seconds,
        "cprofile_seconds": py_seconds,
        "new_tokens": new,
        "ops": ops,
        "op_counts": op_counts,
        "functions": functions,
        "gpu_ms": gpu_ms,
        "gpu_ops": gpu_ops,
        "prefill_gpu_ms": prefill_gpu_ms,
        "decode_gpu_ms_per_step": None if prefill_gpu_ms is None else (gpu_ms - prefill_gpu_ms) / max(1, new - 1),
        "host_calls": sum(f["calls"] for f in functions.values()),
    }


def profile_difference(a: dict, b: dict, top: int = 20) -> list[dict]:
    """Python functions whose own host time differs most between two profiled generates (b - a)."""
    fa, fb = a["functions"], b["functions"]
    rows = []
    for key in set(fa) | set(fb):
        x, y = fa.get(key, {}), fb.get(key, {})
        rows.append(
            {
                "function": key,
                "own_ms": [x.get("own_ms", 0.0), y.get("own_ms", 0.0)],
                "cum_ms": [x.get("cum_ms", 0.0), y.get("cum_ms", 0.0)],
                "calls": [x.get("calls", 0), y.get("calls", 0)],
            }
        )
    rows.sort(key=lambda r: -abs(r["own_ms"][1] - r["own_ms"][0]))
    return rows[:top]


def op_count_difference(a: dict, b: dict, top: int = 30) -> list[dict]:
    """Host ops and CUDA API calls whose count per generated token differs between two profiles (b - a)."""
    ca, cb = a["op_counts"], b["op_counts"]
    steps = a["new_tokens"]
    rows = [
        {"op": op, "per_step": [ca.get(op, 0) / steps, cb.get(op, 0) / steps]}
        for op in set(ca) | set(cb)
        if ca.get(op, 0) != cb.get(op, 0)
    ]
    rows.sort(key=lambda r: -abs(r["per_step"][1] - r["per_step"][0]))
    return rows[:top]


def first_parting(a, b) -> dict:
    """Steps of two traced generate runs compared one by one: the first step whose row ids, rows
    or logits differ (bitwise), the largest logit difference there, and the top-1/top-2 margin
    where the first token differs."""
    tokens_a, logits_a, calls_a = a
    tokens_b, logits_b, calls_b = b
    first = {"row_ids": None, "rows": None, "logits": None, "tokens": None}
    for step, ((ids_a, rows_a), (ids_b, rows_b)) in enumerate(zip(calls_a, calls_b)):
        if first["row_ids"] is None and not torch.equal(ids_a, ids_b):
            first["row_ids"] = step
        if first["rows"] is None and not all(torch.equal(rows_a[k], rows_b[k]) for k in rows_a):
            first["rows"] = step
    out: dict = {"steps": len(logits_a)}
    for step, (la, lb) in enumerate(zip(logits_a, logits_b)):
        if first["logits"] is None and not torch.equal(la, lb):
            first["logits"] = step
            out["max_abs_logit_diff_there"] = float((la.float() - lb.float()).abs().max())
        if first["tokens"] is None and not torch.equal(tokens_a[:, step], tokens_b[:, step]):
            first["tokens"] = step
            top2 = la.float().topk(2, dim=-1).values
            seqs = (tokens_a[:, step] != tokens_b[:, step]).nonzero().flatten()
            out["top2_margin_there"] = [float(top2[i, 0] - top2[i, 1]) for i in seqs[:8]]
    out["first_differing_step"] = first
    return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How far two [B, new] token tensors agree: equal, share of equal tokens, first differing step."""
    diff = (a != b).any(dim=0).nonzero()
    return {
        "equal": torch.equal(a, b),
        "equal_fraction": float((a == b).float().mean()),
        "first_differing_step": int(diff[0]) if diff.numel() else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--engram-layers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--table-size", type=int, default=262_144, help="rows per head (before the primes)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile a generate of this many new tokens per memory (host time by op, printed)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and table, few tokens (a smoke run)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 3, 4, 2, 128
        args.engram_layers, args.table_size, args.batch, args.prompt_tokens, args.new_tokens = [1], 1000, 2, 16, 8
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteriaList

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    # Greedy tokens of a random model sit on near-ties (bf16 logits): any run-to-run difference
    # of a kernel changes them, so kernels are asked to be deterministic.
    torch.use_deterministic_algorithms(True, warn_only=True)
    ctok = CompressedTokenizer.from_any("deepseek-v4")
    vocab = ctok.original_vocab_size
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
    }
    result["commit"] = short_commit()
    from condmem.ops import launch

    # Whether the Engram kernels launch through condmem's shortcut here (docs/kernels.md): rows
    # measured before it are compared with rows measured with it.
    result["fast_launch"] = launch.runtime() is not None
    ids = prompts(ctok, args.batch, args.prompt_tokens).to(device)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=2,
    )
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 2
    result["backbone_params"] = sum(p.numel() for p in model.parameters())
    log(
        f"Llama {result['backbone_params'] / 1e9:.3f} B parameters, vocab {vocab}, built in "
        f"{time.perf_counter() - t0:.1f} s"
    )

    plain = model
    ecfg = EngramConfig.deepseek_v41_flash().replace(
        layer_ids=args.engram_layers, table_size=args.table_size, num_embeddings=None, compressed_vocab_size=None
    )
    t0 = time.perf_counter()
    model = copy.deepcopy(plain)  # the same backbone weights, with Engram
    add_engram(model, ecfg, ctok, zero_init=False)
    adapter = get_engram(model)
    weights = {lid: e.table.weight.detach() for lid, e in adapter.engrams.items()}
    table_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    result["engram"] = {
        "layers": args.engram_layers,
        "columns_per_token": adapter.layout.n_cols,
        "rows": {lid: int(w.shape[0]) for lid, w in weights.items()},
        "table_gib": table_bytes / 2**30,
        "engram_params_without_tables": sum(
            p.numel() for e in adapter.engrams.values() for n, p in e.named_parameters() if "table" not in n
        ),
    }
    log("engram", result["engram"], f"added in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    hbm = offload_tables(model, tier="hbm" if device == "cuda" else "host", device=device)  # CPU: a smoke run
    result["hbm_place_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    host = EngramMemory.from_weights(
        adapter.hasher,
        weights,
        tier="host",
        device=device,
        host_alloc="mmap_register" if device == "cuda" else "pageable",
    )
    result["host_place_s"] = time.perf_counter() - t0
    del weights
    log(f"host tables placed in {result['host_place_s']:.1f} s")

    # Every variant warmed up at full length, then timed in interleaved rounds, each in its own
    # shuffled order (seeded): a machine that drifts within the run moves all variants alike, and
    # no variant always follows the same one (a fixed order gave identical variants 7-13% apart).
    variants = {
        "none": (plain, None),
        "hbm": (model, hbm),
        "host": (model, host),
        "none_again": (plain, None),
        "hbm_eager": (model, hbm),
    }
    kw = greedy(ids, args.new_tokens)
    seconds: dict = {name: [] for name in variants}
    step_ms: dict = {name: [] for name in variants}  # each run's median decode step
    tokens: dict = {}
    same: dict = {}
    order = random.Random(0)

    def select(name: str):
        target, memory = variants[name]
        if memory is not None:
            adapter.memory = memory
        adapter.decode_graphs = not name.endswith("_eager")
        return target

    with torch.no_grad():
        for name in variants:
            tokens[name] = select(name).generate(ids, **kw)[:, ids.shape[1] :].cpu()
        for _ in range(args.repeats):
            names = list(variants)
            order.shuffle(names)
            for name in names:
                target = select(name)
                clock = StepClock()
                # Every run starts with the collector's counts at zero: a collection the previous
                # variant's garbage would trigger does not land in this one.
                gc.collect()
                sync(device)
                t0 = time.perf_counter()
                got = target.generate(ids, **kw, stopping_criteria=StoppingCriteriaList([clock]))
                sync(device)
                seconds[name].append(time.perf_counter() - t0)
                step_ms[name].append(clock.median_step_ms())
                same[name] = same.get(name, True) and torch.equal(tokens[name], got[:, ids.shape[1] :].cpu())
    runs: dict = {}
    for name in variants:
        runs[name] = {
            "seconds": seconds[name],
            "median_step_ms": step_ms[name],
            "tokens_per_s": args.batch * args.new_tokens / min(seconds[name]),
            "new_tokens": args.batch * args.new_tokens,
            "repeats_equal": same[name],
        }
        log(name, runs[name])
    adapter.memory = host

    def ratio(a: str, b: str) -> dict:
        """a's speed over b's: best run against best run, the median of the rounds' paired ratios, and
        the same of the runs' median steps."""
        paired = [y / x for x, y in zip(seconds[a], seconds[b])]
        paired_steps = [y / x for x, y in zip(step_ms[a], step_ms[b])]
        return {
            "best": runs[a]["tokens_per_s"] / runs[b]["tokens_per_s"],
            "rounds_median": statistics.median(paired),
            "rounds": paired,
            "steps_rounds_median": statistics.median(paired_steps),
        }

    result["runs"] = runs
    result["ratios"] = {
        "host_vs_hbm": ratio("host", "hbm"),
        "hbm_vs_none": ratio("hbm", "none"),
        "host_vs_none": ratio("host", "none"),
        "aa_none_again_vs_none": ratio("none_again", "none"),
        "hbm_eager_vs_none": ratio("hbm_eager", "none"),
        "hbm_vs_hbm_eager": ratio("hbm", "hbm_eager"),
    }
    result["tokens"] = {
        "host_vs_hbm": agreement(tokens["host"], tokens["hbm"]),
        "host_vs_none": agreement(tokens["host"], tokens["none"]),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def write_result() -> None:
        """The JSON as it stands: written once the timed rounds are done (a run stopped during the
        trace or the profile keeps its speeds), and again at the end."""
        (out_dir / "hf_generate_host.json").write_text(json.dumps(result, indent=1) + "\n")

    write_result()

    # Where generate runs part: step by step, HBM against host and HBM against itself (the noise).
    with torch.no_grad():
        traces = {"hbm": traced_generate(model, adapter, hbm, ids, args.new_tokens, args.engram_layers)}
        traces["hbm_again"] = traced_generate(model, adapter, hbm, ids, args.new_tokens, args.engram_layers)
        traces["host"] = traced_generate(model, adapter, host, ids, args.new_tokens, args.engram_layers)
    result["trace"] = {
        "host_vs_hbm": first_parting(traces["host"], traces["hbm"]),
        "hbm_vs_hbm": first_parting(traces["hbm_again"], traces["hbm"]),
    }
    log("trace", result["trace"])
    del traces
    adapter.memory = host

    if args.profile_steps:
        result["profile"] = {
            name: profile_generate(select(name), name, ids, args.profile_steps) for name in ("none", "hbm", "host")
        }
        result["profile_difference"], result["op_count_difference"] = {}, {}
        for a, b in (("none", "hbm"), ("hbm", "host")):
            counts = result["op_count_difference"][f"{a}_to_{b}"] = op_count_difference(
                result["profile"][a], result["profile"][b]
            )
            log(f"ops and CUDA calls per generated token, {a} -> {b}:")
            for row in counts:
                log(f"  {row['op'][:70]:70s} {row['per_step'][0]:8.2f} -> {row['per_step'][1]:8.2f}")
            rows = result["profile_difference"][f"{a}_to_{b}"] = profile_difference(
                result["profile"][a], result["profile"][b]
            )
            log(f"Python functions whose own time differs most, {a} -> {b} (ms own, ms cumulative, calls):")
            for row in rows:
                log(
                    f"  {row['function'][:70]:70s} {row['own_ms'][0]:8.1f} -> {row['own_ms'][1]:8.1f}  "
                    f"{row['cum_ms'][0]:8.1f} -> {row['cum_ms'][1]:8.1f}  {row['calls'][0]} -> {row['calls'][1]}"
                )
        adapter.memory = host

    # One forward over prompt + generated tokens with each memory: the rows and the logits.
    seq = torch.cat([ids, tokens["host"].to(device)], dim=1)
    forward = {}
    with torch.no_grad():
        row_ids = adapter.row_ids(seq)
        for name, memory in (("host", host), ("hbm", hbm)):
            adapter.memory = memory
            prepared = memory.lookup(row_ids)
            forward[name] = (
                {lid: prepared.row_vectors(lid) for lid in args.engram_layers},
                model(seq, attention_mask=torch.ones_like(seq)).logits,
            )
    result["forward_equal"] = {
        "rows": all(torch.equal(forward["host"][0][lid], forward["hbm"][0][lid]) for lid in args.engram_layers),
        "logits": torch.equal(forward["host"][1], forward["hbm"][1]),
        "tokens": int(seq.numel()),
    }
    hbm.close()
    host.close()

    log({k: result[k] for k in ("ratios", "tokens", "forward_equal")})
    write_result()
    print(f"\n{'variant':>11} {'new tok/s':>10}  seconds per round")
    for name, run in runs.items():
        print(f"{name:>11} {run['tokens_per_s']:10,.0f}  " + " ".join(f"{x:.2f}" for x in run["seconds"]))
    targets = {"hbm_vs_none": 0.95, "host_vs_hbm": 0.97}  # HBM Engram against the plain model; host against HBM
    for name, r in result["ratios"].items():
        goal = (
            f"  (target >= {targets[name]}: {'met' if r['rounds_median'] >= targets[name] else 'not met'})"
            if name in targets
            else ""
        )
        print(
            f"{name:>22}: best {r['best']:.3f}, rounds median {r['rounds_median']:.3f} "
            f"(median steps {r['steps_rounds_median']:.3f}){goal}"
        )
    for name, prof in result.get("profile", {}).items():
        split = (
            ""
            if prof["prefill_gpu_ms"] is None
            else f" (prompt {prof['prefill_gpu_ms']:.2f} ms, a decode step {prof['decode_gpu_ms_per_step']:.3f} ms)"
        )
        print(
            f"{name:>11} profiled, {prof['new_tokens']} new tokens: GPU busy {prof['gpu_ms']:.1f} ms{split}, "
            f"Python calls {prof['host_calls']}, host {prof['cprofile_seconds']:.2f} s (cProfile)"
        )
    if not result["forward_equal"]["rows"]:
        raise SystemExit("host-table rows differ from HBM-table rows")


if __name__ == "__main__":
    main()
