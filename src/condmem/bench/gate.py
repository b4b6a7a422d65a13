"""``condmem bench gate``: the fused gate (forward; forward + backward) against the eager torch composition,
and the forward with the residual add fused in (``hidden + gate * v``, what the models run) against the
gate followed by a separate add and against a peer's figures measured on the same card, where a
results file holds them (`PEER_FILE`).

Bytes counted: hidden (hc*D) + kv ((hc+1)*D) read and the output (hc*D) written per token for the
forward (the same with the residual fused in); the backward additionally reads dout and writes
d hidden and d kv (and re-reads hidden and the keys for the weight gradient).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from condmem.bench.harness import Rotator, time_ms
from condmem.ops.gate import engram_gate, engram_gate_reference
from condmem.ops.gate.triton import gate_backward_triton, gate_forward_triton

SHAPES = [(8192, 4, 4096), (512, 4, 4096), (8192, 4, 7168), (16384, 1, 2560), (256, 4, 4096)]
PEER_FILE = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "gate_peer.json"
"""A peer's forward times of the gate with the residual add fused in, on one card (``gpu``), as
``rows`` of tokens, hc, hidden and ms; in a source checkout. Without it, or on another card, the
residual forward is compared with nothing but condmem's own forms."""
SMOKE_SHAPES = [(16, 2, 96), (4, 1, 64)]


def run(args, ceiling: dict) -> list[dict]:
    """The gate's rows, shape by shape: the forward variants, and on the larger shapes forward + backward."""
    rows = []
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    peers = peer_figures(torch.cuda.get_device_name(dev) if dev == "cuda" else None)
    print(f"gate: peer figures of {PEER_FILE.name} ({len(peers)} shapes)" if peers else _no_peer(dev), flush=True)
    for n, hc, dim in SMOKE_SHAPES if args.smoke else SHAPES:
        esz = 2  # bf16
        sets, weights = _inputs(n, hc, dim, dev, gen)
        fwd_bytes = n * (hc * dim + (hc + 1) * dim + hc * dim) * esz
        base = {"op": "gate", "tokens": n, "hc": hc, "hidden": dim, "dtype": "bf16"}
        rows += _forward_rows(args, sets, weights, base, fwd_bytes, ceiling, peers.get((n, hc, dim)))
        # forward + backward (training)
        if n >= 1024 or (args.smoke and n >= 16):
            # backward reads h, kv, dout, writes dh, dkv; the weight pass re-reads h and the keys.
            bwd_bytes = fwd_bytes + n * (5 * hc * dim + 2 * (hc + 1) * dim) * esz
            bres = _time_backward(args, sets, weights)
            rows += _backward_rows(bres, base, fwd_bytes, bwd_bytes, ceiling)
        del sets
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def peer_figures(gpu: str | None, path: Path = PEER_FILE) -> dict[tuple[int, int, int], float]:
    """{(tokens, hc, hidden): ms} of the peer's figures in `path` measured on `gpu` (a CUDA device
    name); {} without the file, or for another card, or without a card (None)."""
    if gpu is None or not path.is_file():
        return {}
    figures = json.loads(path.read_text())
    if figures["gpu"] != gpu:
        return {}
    return {(r["tokens"], r["hc"], r["hidden"]): float(r["ms"]) for r in figures["rows"]}


def _no_peer(dev: str) -> str:
    if dev != "cuda":
        return "gate: no peer figures on the CPU"
    if not PEER_FILE.is_file():
        return f"gate: no peer figures ({PEER_FILE} not found)"
    return f"gate: no peer figures for {torch.cuda.get_device_name(dev)} in {PEER_FILE.name}"


def _inputs(n: int, hc: int, dim: int, dev: str, gen) -> tuple[list[tuple], tuple]:
    """Two random (hidden, kv) input sets in bf16, and the (query weight, key weight, token mask) they share."""
    dtype = torch.bfloat16
    sets = []
    for _ in range(2):
        h = torch.randn((n, hc, dim), device=dev, dtype=dtype, generator=gen)
        kv = torch.randn((n, (hc + 1) * dim), device=dev, dtype=dtype, generator=gen)
        sets.append((h, kv))
    qw = torch.ones(hc, dim, device=dev, dtype=dtype)
    kw = torch.ones(hc, dim, device=dev, dtype=dtype)
    mask = torch.ones(n, dtype=torch.bool, device=dev)
    return sets, (qw, kw, mask)


def _forward_impls(args, qw: torch.Tensor, kw: torch.Tensor, mask: torch.Tensor) -> dict:
    """The forward implementations timed, by name (with `--variants` also the residual kernel's tunings)."""
    impls = {
        "triton": lambda h, kv: engram_gate(h, kv, qw, kw, token_mask=mask, backend="triton"),
        "torch-eager": lambda h, kv: engram_gate_reference(h, kv, qw, kw, token_mask=mask),
        "triton-residual": lambda h, kv: engram_gate(h, kv, qw, kw, token_mask=mask, residual=True, backend="triton"),
        "triton+add": lambda h, kv: h + engram_gate(h, kv, qw, kw, token_mask=mask, backend="triton"),
    }
    if args.variants:
        for chunk, nw in ((1024, 4), (2048, 4), (4096, 4), (2048, 8)):
            impls[f"triton-residual-c{chunk}-w{nw}"] = lambda h, kv, c=chunk, nw=nw: gate_forward_triton(
                h, kv, qw, kw, 1e-6, 1e-6, mask, residual=True, chunk=c, num_warps=nw
            )
    return impls


def _forward_rows(
    args, sets: list, weights: tuple, base: dict, fwd_bytes: int, ceiling: dict, peer_ms: float | None
) -> list[dict]:
    """Forward rows of one shape: every implementation checked against the eager composition, then
    timed, with its speedups over the eager and unfused forms and over the peer's figure (`peer_ms`)."""
    qw, kw, mask = weights
    impls = _forward_impls(args, qw, kw, mask)
    ref = impls["torch-eager"](*sets[0]).float()
    ref_residual = engram_gate_reference(*sets[0], qw, kw, token_mask=mask, residual=True).float()
    for name, fn in impls.items():  # every variant computes the same thing before it is timed
        want = ref_residual if ("residual" in name or "+add" in name) else ref
        err = ((fn(*sets[0]).float() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"gate variant {name}: relative error {err:.2e} against the eager composition"
    res = {}
    for name, fn in impls.items():
        res[name] = time_ms(Rotator(fn, sets), args.device)
    rows = []
    for name, t in res.items():
        gbps = fwd_bytes / (t["ms"] * 1e-3) / 1e9
        row = {
            **base,
            "pass": "forward",
            "impl": name,
            **t,
            "bytes": fwd_bytes,
            "gbps": gbps,
            "hbm_fraction": gbps / ceiling["d2d_gbps"],
        }
        if name.startswith("triton"):
            row["speedup_vs_eager"] = res["torch-eager"]["ms"] / t["ms"]
        if name.startswith("triton-residual"):
            row["x_unfused"] = res["triton+add"]["ms"] / t["ms"]
            if peer_ms is not None:
                row["peer_ms"] = peer_ms
                row["x_peer"] = peer_ms / t["ms"]
        rows.append(row)
    return rows


def _time_backward(args, sets: list, weights: tuple) -> dict[str, dict]:
    """Times of forward + backward as the models train it (Triton and eager), and with `--variants`
    the backward kernels alone at several warp counts."""
    dev = args.device
    qw, kw, mask = weights
    gsets = []
    for h, kv in sets:
        gsets.append((h.detach().requires_grad_(), kv.detach().requires_grad_(), torch.randn_like(h)))
    qg, kg = qw.clone().requires_grad_(), kw.clone().requires_grad_()

    def step(h, kv, go, backend):  # as the models train it: the residual add fused in
        out = engram_gate(h, kv, qg, kg, token_mask=mask, residual=True, backend=backend)
        torch.autograd.grad(out, (h, kv, qg, kg), go)

    bres = {
        name: time_ms(Rotator(lambda h, kv, go, b=b: step(h, kv, go, b), gsets), dev)
        for name, b in (("triton", "triton"), ("torch-eager", "torch"))
    }
    if args.variants:
        # The backward kernels alone (no forward), at three warp counts.
        for nw in (4, 8, 16):
            bres[f"triton-bwd-only-w{nw}"] = time_ms(
                Rotator(
                    lambda h, kv, go, nw=nw: gate_backward_triton(
                        go, h.detach(), kv.detach(), qw, kw, 1e-6, 1e-6, mask, residual=True, num_warps=nw
                    ),
                    gsets,
                ),
                dev,
            )
    return bres


def _backward_rows(bres: dict[str, dict], base: dict, fwd_bytes: int, bwd_bytes: int, ceiling: dict) -> list[dict]:
    """Rows of the backward timings: bytes moved, bandwidth, and the Triton speedup over eager."""
    rows = []
    for name, t in bres.items():
        nbytes = bwd_bytes - fwd_bytes if "bwd-only" in name else bwd_bytes
        gbps = nbytes / (t["ms"] * 1e-3) / 1e9
        row = {
            **base,
            "pass": "backward" if "bwd-only" in name else "forward+backward",
            "impl": name,
            **t,
            "bytes": nbytes,
            "gbps": gbps,
            "hbm_fraction": gbps / ceiling["d2d_gbps"],
        }
        if name == "triton":
            row["speedup_vs_eager"] = bres["torch-eager"]["ms"] / t["ms"]
        rows.append(row)
    return rows
