"""Where an HF `generate()` decode step with Engram spends host work beyond the plain model's.

The same Llama as `benchmarks/hf_generate_host.py` (small tables: the per-step work does not
depend on their size), greedy decode. Per decode step it reports:

* (``hbm`` and ``host`` replay Engram's decode work from CUDA graphs, ``hbm_eager`` runs it eager)
* the host time spent inside Engram's hooks (the base model's pre- and post-hook, each Engram
  layer's pre-hook, the generate() input wrapper), timed with ``perf_counter`` inside them,
  against the whole step: the share of a step Engram costs the host;
* every torch op and CUDA runtime/driver call whose count per step differs from the plain
  model's, each with the condmem / transformers call stacks that make it (torch.profiler with
  Python stacks).

    PYTHONPATH=src python3 benchmarks/probes/hf_decode_ops.py --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_generate_host import StepClock, greedy, prompts  # noqa: E402

from condmem import EngramConfig  # noqa: E402
from condmem.integrations.transformers import adapter as adapter_module  # noqa: E402
from condmem.integrations.transformers import add_engram, get_engram, offload_tables  # noqa: E402
from condmem.serving.memory import EngramMemory  # noqa: E402
from condmem.tokenizer import CompressedTokenizer  # noqa: E402

HOOK_SECONDS = collections.Counter()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOOK_SECONDS[name] += time.perf_counter() - t0

    return wrapper


def instrument() -> None:
    """Time every Engram hook (patched on the class before `add_engram` binds them)."""
    cls = adapter_module.EngramAdapter
    cls._before_base = timed("before_base", cls._before_base)
    cls._after_base = timed("after_base", cls._after_base)
    layer_hook = cls._layer_hook

    def timed_layer_hook(self, layer_id):
        return timed("layer_hooks", layer_hook(self, layer_id))

    cls._layer_hook = timed_layer_hook
    wrap = cls._wrap_generation

    def timed_wrap(self, model):
        wrap(self, model)
        inner = model.prepare_inputs_for_generation
        original = inner.__wrapped__

        @functools.wraps(original)
        def prepare(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            total = time.perf_counter() - t0
            t1 = time.perf_counter()
            original(*args, **kwargs)  # the original alone, to take its share out
            HOOK_SECONDS["prepare_inputs"] += max(0.0, total - (time.perf_counter() - t1))
            return out

        model.prepare_inputs_for_generation = prepare

    cls._wrap_generation = timed_wrap


def stacks_of(prof, steps: int, top: int = 4) -> dict:
    """{event name: (count per step, {stack: count per step})}, stacks cut to condmem/transformers frames."""
    counts: collections.Counter = collections.Counter()
    where: dict = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if not e.name.startswith(("aten::", "cuda", "cu")):
            continue
        counts[e.name] += 1
        frames, parent = [], e.cpu_parent
        while parent is not None:  # the Python frames above the op (with_stack records them as events)
            name = parent.name
            if ("condmem/" in name or "transformers/" in name) and "probes/" not in name:
                frames.append(name.split("site-packages/")[-1].split("src/")[-1])
            parent = parent.cpu_parent
        where[e.name][" <- ".join(frames[:top])] += 1
    return {n: (c / steps, {s: k / steps for s, k in where[n].most_common(6)}) for n, c in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--engram-layers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    instrument()
    ctok = CompressedTokenizer.from_any("deepseek-v4")
    dev = args.device
    ids = prompts(ctok, args.batch, args.prompt_tokens).to(dev)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ctok.original_vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=int(args.hidden * 2.75),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=2,
    )
    with torch.device(dev):
        plain = LlamaForCausalLM(config).to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    plain.generation_config.pad_token_id = 2
    model = copy.deepcopy(plain)
    ecfg = EngramConfig.deepseek_v41_flash().replace(
        layer_ids=args.engram_layers, table_size=16_384, num_embeddings=None, compressed_vocab_size=None
    )
    add_engram(model, ecfg, ctok, zero_init=False)
    adapter = get_engram(model)
    weights = {lid: e.table.weight.detach().clone() for lid, e in adapter.engrams.items()}
    hbm = offload_tables(model, tier="hbm" if dev == "cuda" else "host", device=dev)
    alloc = "mmap_register" if dev == "cuda" else "pageable"
    host = EngramMemory.from_weights(adapter.hasher, weights, tier="host", device=dev, host_alloc=alloc)
    variants = {"none": (plain, None), "hbm": (model, hbm), "host": (model, host), "hbm_eager": (model, hbm)}
    kw = greedy(ids, args.new_tokens)
    result: dict = {"args": vars(args), "variants": {}}
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for name, (target, memory) in variants.items():
            if memory is not None:
                adapter.memory = memory
            adapter.decode_graphs = not name.endswith("_eager")
            target.generate(ids, **kw)
            steps, hooks = [], collections.Counter()
            for _ in range(args.repeats):
                HOOK_SECONDS.clear()
                clock = StepClock()
                from transformers import StoppingCriteriaList

                target.generate(ids, **kw, stopping_criteria=StoppingCriteriaList([clock]))
                sync()
                steps.append(clock.median_step_ms())
                hooks.update({k: v * 1e3 / args.new_tokens for k, v in HOOK_SECONDS.items()})
            with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
                target.generate(ids, **kw)
                sync()
            result["variants"][name] = {
                "median_step_ms": statistics.median(steps),
                "steps_ms": steps,
                "hook_ms_per_step": {k: v / args.repeats for k, v in hooks.items()},
                "events": stacks_of(prof, args.new_tokens),
            }
            v = result["variants"][name]
            print(
                name, f"step {v['median_step_ms']:.2f} ms", {k: round(x, 3) for k, x in v["hook_ms_per_step"].items()}
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_decode_ops.json").write_text(json.dumps(result, indent=1) + "\n")
    base = result["variants"]["none"]["events"]
    for name in ("hbm", "host", "hbm_eager"):
        ev = result["variants"][name]["events"]
        print(f"\n== {name} - none, per step:")
        for op in sorted(set(ev) | set(base), key=lambda o: -(ev.get(o, (0,))[0] - base.get(o, (0,))[0])):
            d = ev.get(op, (0, {}))[0] - base.get(op, (0, {}))[0]
            if abs(d) < 0.5:
                continue
            print(f"{op:40s} {d:+7.2f}")
            for s, c in ev.get(op, (0, {}))[1].items():
                if "condmem/" in s:
                    print(f"      {c:6.2f}  {s[:200]}")


if __name__ == "__main__":
    main()
