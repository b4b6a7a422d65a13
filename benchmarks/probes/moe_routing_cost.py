"""What renormalised routing, the balancing bias and the router statistics cost one MoE layer.

One layer at the gpu study preset's size (32,768 tokens, dim 512, 62 experts of width 256,
top-2), forward and backward under bf16 autocast on CUDA: the median of 30 timed steps for
raw-probability weights without bias (``legacy``, twice: an A/A), the default routing
(renormalised, bias, statistics) and the default without the statistics, in three rounds.

    PYTHONPATH=src python benchmarks/probes/moe_routing_cost.py
"""

from __future__ import annotations

import time

import torch

from condmem.models.moe import MoE, RouterStats


def median_ms(layer: MoE, x: torch.Tensor, reps: int = 30) -> float:
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()

    for _ in range(5):
        step()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    tokens, dim, experts, hidden = 32768, 512, 62, 256
    x = torch.randn(tokens, dim, device="cuda")
    update = RouterStats.update
    results: dict[str, list[float]] = {}
    for _ in range(3):
        for name in ("legacy", "default", "default_nostats", "legacy_again"):
            raw = name.startswith("legacy")
            layer = MoE(dim, experts, 2, hidden, renormalize=not raw, bias_rate=0.0 if raw else 1e-3).cuda()
            RouterStats.update = (lambda *a, **k: None) if name == "default_nostats" else update
            results.setdefault(name, []).append(median_ms(layer, x))
    RouterStats.update = update
    for name, values in results.items():
        print(f"{name:16s} median ms per forward+backward: " + " ".join(f"{v:.3f}" for v in values))
    print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
