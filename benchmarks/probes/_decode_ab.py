"""Set-up shared by the decode-step A/B probes (`decode_*_ab.py`): a backbone with random bf16
weights, a serving cache of ``--batch`` slots holding random keys and values at lengths
100..1100, a graph captured per variant (a module attribute patched while it is captured),
alternating timed rounds of graph-captured steps over it, and the JSON + table they report."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, event_times_ms, machine_info
from condmem.serving.graphs import GraphedDecoder
from condmem.models.config import ModelConfig
from condmem.serving import ServingCache
from condmem.models.transformer import DecoderLM

LENGTHS = (100, 1100)


def ab_arguments(description: str, rounds: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=".")
    p.add_argument("--backbone", default="4b", choices=sorted(BACKBONES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=rounds)
    return p.parse_args()


@dataclass
class DecodeBench:
    model: DecoderLM
    cache: ServingCache
    lengths: torch.Tensor
    ids: torch.Tensor
    d2d_gbps: float

    @property
    def slots(self) -> list[int]:
        return list(range(self.cache.n_slots))

    def reset(self) -> None:
        """Every slot back at its starting length (a step writes at the position it reads up to)."""
        self.cache.lengths.copy_(self.lengths.to(self.cache.lengths.device))
        self.cache.host_lengths = self.lengths.tolist()

    def step(self, graph) -> torch.Tensor:
        return graph.step(self.slots, self.ids)

    def alternate(self, graphs: dict, steps: int, rounds: int) -> dict[str, list[float]]:
        """Per variant, the median step time (ms) of each round; rounds alternate the variants."""
        times = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                self.reset()
                ts = event_times_ms(lambda g=graph: self.step(g), steps)
                times[name].append(statistics.median(ts[3:]))
        return times

    def capture_variants(self, module, attr: str, values: dict) -> tuple[dict, dict]:
        """Per variant: a `GraphedDecoder` captured with ``module.attr`` set to the variant's
        value (restored after), and the fp32 logits of one step from the starting lengths."""
        graphs, logits = {}, {}
        default = getattr(module, attr)
        for name, value in values.items():
            setattr(module, attr, value)
            try:
                self.reset()
                graphs[name] = GraphedDecoder(self.model, self.cache)
            finally:
                setattr(module, attr, default)
            self.reset()
            logits[name] = self.step(graphs[name]).float().clone()
        return graphs, logits

    def bound_ms(self, steps: int) -> float:
        """Bytes a step reads (weights, live keys and values at mid-run lengths) at the copy bandwidth."""
        mid = [int(n) + steps // 2 for n in self.lengths]
        return (step_weight_bytes(self.model) + self.cache.live_kv_bytes(mid)) / (self.d2d_gbps * 1e9) * 1e3


def decode_bench(backbone: str, batch: int, steps: int) -> DecodeBench:
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    max_len = LENGTHS[1] + steps + 8
    cfg = ModelConfig(vocab_size=129_280, max_seq_len=max_len, **BACKBONES[backbone])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=batch, max_len=max_len)
    lengths = torch.randint(LENGTHS[0], LENGTHS[1] + 1, (batch,))
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    index = torch.arange(batch, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    n_kv, head_dim = model.blocks[0].attn.n_kv_heads, model.blocks[0].attn.head_dim
    for layer in range(cfg.n_layers):
        k, v = (
            torch.randn(batch, n_kv, max_len, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(2)
        )
        cache.store_prefix(layer, index, k, v)
    return DecodeBench(model, cache, lengths, ids, bw)


def report(
    out: str, filename: str, result: dict, times: dict[str, list[float]], bound_ms: float, prefix: str = ""
) -> dict[str, float]:
    """Write `result` with each variant's median step (``step_ms``), rounds and bound to
    ``out/filename``; print a table of them. Returns the median steps."""
    step = {name: statistics.median(t) for name, t in times.items()}
    result = {**result, "step_ms": step, "rounds": times, "bound_ms": bound_ms, "machine": machine_info()}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / filename).write_text(json.dumps(result, indent=1) + "\n")
    width = max(9, *(len(name) for name in step))
    print(f"{prefix}{'variant':{width}s} {'step ms':>8s} {'vs bound':>8s}  rounds")
    for name, ms in step.items():
        print(f"{prefix}{name:{width}s} {ms:8.4f} {bound_ms / ms:8.3f}  " + " ".join(f"{t:.4f}" for t in times[name]))
    return step
