"""`condmem study`: the Engram paper's sparsity-allocation and memory-slot sweeps, at small scale.

* ``allocation``: a mixture-of-experts backbone whose routed experts hold the whole sparse
  budget (rho = 1, pure MoE) is the reference. For each rho of the grid, the number of
  routed experts drops to ``top_k + round(rho * (E - top_k))`` and an Engram table in block
  1 takes the parameters they held, so every model has the same total parameters (up to
  the table's rounding to the layout's primes, recorded) and the same parameters and
  FLOPs per token: top_k experts, the same attention and shared expert; the Engram's
  projection and gate cost FLOPs that the pure-MoE model spends on a wider shared expert
  in the same block (`iso_flop_baseline`). Paper (arXiv 2601.07372): loss is U-shaped in
  rho, lowest at rho ~ 0.75-0.8.
* ``slots``: the backbone fixed (rho = 1's experts, with an Engram), the table's rows
  swept over two decades or more, plus the backbone without Engram (iso-FLOP) as a
  level. Paper: loss falls about linearly in log(rows).

Every run of a sweep trains on the same batches in the same order (one data seed; the
seeds vary the initialization only), for the same number of steps (at most one pass over
the training split, recorded), and is validated on every token of the deduplicated
held-out split, as in `condmem demo`. The report states the scale against the paper's and
claims a minimum only where the seed spread allows it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from condmem.config import EngramConfig
from condmem.layout import draw_primes
from condmem.models import iso_flop_baseline
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.flops import (
    forward_flops_per_token,
    parameter_counts,
    train_flops_per_token,
)
from condmem.train.build import (
    banner,
    build_model,
    build_model_config,
    build_trainer,
    cap_steps,
    machine_info,
    prepare,
    resolve_device,
)
from condmem.train.demo import bucket_losses, mean_std
from condmem.train.heldout import seen_in_training
from condmem.train.loop import TrainConfig
from condmem.train.pipeline import PreparedData
from condmem.train.presets import DataPreset, EngramPreset, ModelPreset, Preset
from condmem.utils.atomic import atomic_write_text, check_destination
from condmem.utils.plotting import pyplot, save_figure

KINDS = ("allocation", "slots")

PAPER = {
    "source": "arXiv 2601.07372 (figures as gathered in two public notes)",
    "allocation": {
        "compute_flops": [2e20, 6e20],
        "optimum_rho": [0.75, 0.8],
        "loss_pure_moe_6e20": 1.7248,
        "loss_optimum_6e20": 1.7109,
        "gain_pct_6e20": 0.81,
        "rho_matching_pure_moe": 0.4,
        "total_over_active": 10,
    },
    "slots": {
        "backbone": "3B total, 568M active MoE",
        "train_tokens": 100e9,
        "rows": [2.58e5, 1e7],
        "shape": "loss roughly linear in log(rows)",
    },
}


@dataclass
class StudyPreset:
    """One size of `condmem study`."""

    base: Preset
    """The pure-MoE backbone (model.moe at rho = 1), the Engram's geometry (its table size is
    derived per point), training and data settings."""
    rhos: list[float]
    """Allocation grid: share of the sparse parameters left to routed experts (1.0 = pure MoE)."""
    table_sizes: list[int]
    """Slot sweep: bucket range per (order, head); rows are about n_cols times this."""
    allocation_steps: int
    """Training steps of every allocation run (capped at one pass over the training split)."""
    slots_steps: int
    """Training steps of every slot run."""
    minutes: float | None = None
    """Wall-clock budget of one sweep, data preparation included: the first run's step count
    is cut to fit it (never raised), and every run takes that count. None: no budget."""


STUDY_PRESETS: dict[str, StudyPreset] = {
    "tiny": StudyPreset(
        Preset(
            "tiny",
            ModelPreset(
                dim=32,
                n_layers=2,
                n_heads=2,
                n_kv_heads=1,
                ffn_hidden=32,
                max_seq_len=64,
                moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=32),
            ),
            EngramPreset(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=500),
            TrainConfig(
                steps=16, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_tokens=512, eval_every=0, log_every=8
            ),
            DataPreset(corpus="stdlib", vocab_size=320, max_train_bytes=2_000_000, tokenizer_train_bytes=1_000_000),
        ),
        rhos=[1.0, 0.75, 0.5],
        table_sizes=[20, 300, 3000],
        allocation_steps=16,
        slots_steps=16,
    ),
    "gpu": StudyPreset(
        Preset(
            "gpu",
            ModelPreset(
                dim=512,
                n_layers=6,
                n_heads=8,
                n_kv_heads=4,
                ffn_hidden=512,
                max_seq_len=512,
                moe=MoEConfig(n_experts=62, top_k=2, expert_hidden=256),
            ),
            EngramPreset(layer_ids=[1], max_ngram_size=3, n_heads=8, head_dim=32, table_size=2_000_000),
            TrainConfig(
                steps=400,
                batch_size=64,
                seq_len=512,
                lr=2e-3,
                warmup_steps=40,
                eval_tokens=65_536,
                eval_every=0,
                eval_batch_size=32,
                log_every=100,
            ),
            DataPreset(
                corpus="python",
                vocab_size=8192,
                max_train_bytes=150_000_000,
                max_corpus_bytes=1_500_000_000,
                tokenizer_train_bytes=20_000_000,
            ),
        ),
        rhos=[1.0, 0.9, 0.8, 0.7, 0.6, 0.4, 0.2],
        table_sizes=[2_500, 25_000, 250_000, 2_500_000],
        allocation_steps=400,
        slots_steps=1000,
        minutes=9.0,
    ),
}


@dataclass
class Point:
    """One model of a sweep."""

    label: str
    cfg: ModelConfig
    rho: float | None = None
    """Allocation: the grid's rho (None in the slot sweep)."""
    accounting: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the sweeps' models


def allocation_points(base: ModelConfig, rhos: list[float]) -> list[Point]:
    """The pure-MoE reference and one model per rho < 1 at its total parameters.

    `base`: the backbone at rho = 1 with the Engram geometry (its table size is replaced).
    """
    moe, engram = base.moe, base.engram
    if moe is None or engram is None:
        raise ValueError("the allocation study needs a backbone with routed experts (model.moe) and an Engram")
    spare = moe.n_experts - moe.top_k
    if spare < 1:
        raise ValueError(f"model.moe has {moe.n_experts} experts for top_k {moe.top_k}: no sparse experts to trade")
    bad = [r for r in rhos if not 0 <= r <= 1]
    if bad:
        raise ValueError(f"rho must be in [0, 1], got {bad}")
    reference = iso_flop_baseline(base)
    budget = parameter_counts(reference)["total"]
    points = [Point("rho=1.00 (pure MoE)", reference, 1.0)]
    layers = len(engram.layer_ids)
    for rho in sorted({r for r in rhos if r < 1}, reverse=True):
        experts = moe.top_k + round(rho * spare)
        cfg = base.replace(moe=dataclasses.replace(moe, n_experts=experts))
        counts = parameter_counts(cfg)
        rows = (budget - (counts["total"] - counts["tables"])) // (engram.head_dim * layers)
        table_size = table_size_for(engram, rows)
        points.append(Point(f"rho={rho:.2f}", cfg.replace(engram=engram.replace(table_size=table_size)), rho))
    for point in points:
        point.accounting = accounting(point.cfg, base.max_seq_len, budget)
    return points


def table_size_for(engram: EngramConfig, rows: int) -> int:
    """The largest table size whose layout gives each layer at most `rows` rows (sums of primes;
    2 when even that is too many)."""

    def layer_rows(size: int) -> int:
        return max(sum(p) for p in draw_primes(engram.layer_ids, [size] * (engram.max_ngram_size - 1), engram.n_heads))

    lo, hi = 2, max(2, rows // engram.n_cols + 1)
    while lo < hi:  # layer_rows grows with the size: the last size that fits
        mid = (lo + hi + 1) // 2
        if layer_rows(mid) <= rows:
            lo = mid
        else:
            hi = mid - 1
    return lo


def slot_points(base: ModelConfig, table_sizes: list[int]) -> list[Point]:
    """The backbone with tables of each size, and without Engram (its FLOPs on the shared expert)."""
    if base.engram is None:
        raise ValueError("the slot study needs an Engram geometry")
    points = [Point("no Engram", iso_flop_baseline(base))]
    for size in sorted(set(table_sizes)):
        points.append(Point(f"table_size={size:,}", base.replace(engram=base.engram.replace(table_size=size))))
    for point in points:
        point.accounting = accounting(point.cfg, base.max_seq_len)
    return points


def accounting(cfg: ModelConfig, seq_len: int, budget: int | None = None) -> dict:
    """Exact parameters and FLOPs of one point (what study.json records, before training)."""
    counts = parameter_counts(cfg)
    moe = cfg.moe
    expert = 3 * cfg.dim * moe.expert_hidden if moe is not None else 0
    idle_experts = len(cfg.moe_layer_ids) * (moe.n_experts - moe.top_k) * expert if moe is not None else 0
    sparse = idle_experts + counts["tables"]
    out = {
        "n_experts": moe.n_experts if moe is not None else 0,
        "table_size": cfg.engram.table_size if cfg.engram is not None else 0,
        "table_rows": counts["tables"] // cfg.engram.head_dim if cfg.engram is not None else 0,
        "params": counts,
        "idle_expert_params": idle_experts,
        "sparse_params": sparse,
        "rho_realized": idle_experts / sparse if sparse else None,
        "forward_flops": forward_flops_per_token(cfg, seq_len),
        "flops_per_token": train_flops_per_token(cfg, seq_len),
    }
    if budget is not None:
        out["total_vs_budget"] = counts["total"] / budget - 1
    return out


# ----------------------------------------------------------------------------- running


def run_study(
    kind: str,
    out: str | Path | None = None,
    *,
    preset: str = "tiny",
    seeds: int = 1,
    corpus=None,
    device: str | None = None,
    steps: int | None = None,
    minutes: float | None = None,
    seed: int = 0,
    rhos: list[float] | None = None,
    table_sizes: list[int] | None = None,
    max_passes: float = 1.0,
    progress: bool = True,
) -> dict:
    """Run one sweep; writes ``study.json`` and ``<kind>.png`` into `out`, returns the summary.

    Args:
        kind: ``allocation`` or ``slots``.
        seeds: initialization seeds ``seed .. seed+seeds-1`` per point (one data order for all).
        corpus: see `load_corpus`; None: the preset's.
        steps, minutes, rhos, table_sizes: replace the preset's.
    """
    wall = time.perf_counter()
    sp = _study_preset(kind, preset, seeds, corpus, rhos, table_sizes, minutes)
    dev = resolve_device(device)
    out = Path(out or f"condmem-study/{kind}")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("study.json", f"{kind}.png"):  # checked before the runs, not after them; written with the same check
        check_destination(out / name, within=out)
    print(
        f"condmem study {kind}: preset {preset!r} on {dev}, {seeds} seed{'s' if seeds > 1 else ''}; output in {out}/",
        flush=True,
    )
    data = prepare(sp.base, seed=seed)
    seen = seen_in_training(
        data.train.tokens, data.val.tokens, data.info["tokenizer"]["vocab_size"], pad_id=data.eos_id
    )
    base = build_model_config(sp.base, data)
    points = allocation_points(base, sp.rhos) if kind == "allocation" else slot_points(base, sp.table_sizes)
    requested = steps or (sp.allocation_steps if kind == "allocation" else sp.slots_steps)
    tc = sp.base.train
    n_steps, passes = _capped_steps(requested, data.train, tc, max_passes)
    budget_s = None if sp.minutes is None else sp.minutes * 60 - (time.perf_counter() - wall)
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"--minutes {sp.minutes}: data preparation alone took longer")
    print_plan(kind, points, n_steps, tc, seeds)
    runs = train_points(
        points, data, dev, tc, steps=n_steps, seeds=seeds, seed=seed, seen=seen, budget_s=budget_s, progress=progress
    )
    passes.update(steps=runs[0]["steps"], passes=runs[0]["passes"])
    summary = summarize(kind, sp, points, runs, seeds=seeds, seed=seed, passes=passes, data=data, dev=dev)
    print("\n" + summary["table"] + "\n\n" + summary["report"], flush=True)
    _write_study(summary, out, kind, wall)
    return summary


def _study_preset(
    kind: str,
    preset: str,
    seeds: int,
    corpus,
    rhos: list[float] | None,
    table_sizes: list[int] | None,
    minutes: float | None,
) -> StudyPreset:
    """The study preset with the caller's corpus, rhos, table sizes and minutes in place of its own;
    `ValueError` for an unknown kind or preset, a seed count that is not positive, or a slot sweep
    of fewer than two table sizes."""
    if kind not in KINDS:
        raise ValueError(f"unknown study {kind!r}; choose one of {list(KINDS)}")
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be a positive integer, got {seeds!r}")
    if preset not in STUDY_PRESETS:
        raise ValueError(f"unknown study preset {preset!r}; choose one of {sorted(STUDY_PRESETS)}")
    sp = dataclasses.replace(
        STUDY_PRESETS[preset],
        rhos=rhos or STUDY_PRESETS[preset].rhos,
        table_sizes=table_sizes or STUDY_PRESETS[preset].table_sizes,
        minutes=minutes if minutes is not None else STUDY_PRESETS[preset].minutes,
    )
    sp.base = sp.base.override(data={"corpus": corpus})
    if kind == "slots" and len(set(sp.table_sizes)) < 2:
        raise ValueError(f"the slot sweep needs two table sizes or more, got {sp.table_sizes}")
    return sp


def _capped_steps(requested: int, train, tc: TrainConfig, max_passes: float) -> tuple[int, dict]:
    """`cap_steps` of the requested steps over the training split, with a banner when it capped them."""
    n_steps, passes = cap_steps(requested, train, tc.batch_size, tc.seq_len, max_passes)
    if passes["capped"]:
        print(
            banner(
                f"{requested:,} steps would make {passes['requested_passes']:.2f} passes over the "
                f"{len(train):,}-token training split: capped at {n_steps:,} steps "
                f"({passes['passes']:.2f} passes)"
            ),
            flush=True,
        )
    return n_steps, passes


def _write_study(summary: dict, out: Path, kind: str, wall: float) -> None:
    """The figure (``<kind>.png``, when matplotlib is there) and ``study.json``, then where they went;
    the summary gains the figure's name and the wall time since `wall`."""
    figure = plot_study(summary, out / f"{kind}.png", within=out)
    summary["figure"] = figure.name if figure else None
    summary["wall_seconds"] = time.perf_counter() - wall
    atomic_write_text(out / "study.json", json.dumps(summary, indent=1) + "\n", within=out)
    print(
        f"\nwrote {out}/study.json{f', {figure.name}' if figure else ''} ({summary['wall_seconds']:.0f} s in all)",
        flush=True,
    )


def replot(kind: str, out: str | Path | None = None) -> Path | None:
    """Draw ``<kind>.png`` again from ``out/study.json`` (a GPU run on a machine without matplotlib),
    and derive the finding and the report again from the runs it records."""
    out = Path(out or f"condmem-study/{kind}")
    summary = json.loads((out / "study.json").read_text())
    if summary.get("study") != kind:
        raise ValueError(f"{out / 'study.json'} holds a {summary.get('study')!r} study, not {kind!r}")
    summary["finding"] = find(kind, summary["points"], summary["runs"])
    summary["report"] = report_text(kind, summary)
    figure = plot_study(summary, out / f"{kind}.png", within=out)
    summary["figure"] = figure.name if figure is not None else summary.get("figure")
    atomic_write_text(out / "study.json", json.dumps(summary, indent=1) + "\n", within=out)
    print(summary["report"], flush=True)
    if figure is not None:
        print(f"wrote {figure}", flush=True)
    return figure


def print_plan(kind: str, points: list[Point], steps: int, tc: TrainConfig, seeds: int) -> None:
    """One line per point: experts, table rows, parameters, FLOPs."""
    print(
        f"{len(points)} models x {seeds} seed{'s' if seeds > 1 else ''}, each {steps:,} steps x "
        f"{tc.batch_size * tc.seq_len:,} tokens, same batches in the same order:",
        flush=True,
    )
    for p in points:
        a = p.accounting
        print(
            f"  {p.label:<22} {a['n_experts']:>3} experts, {a['table_rows']:>12,} table rows, "
            f"{a['params']['total']:>13,} params ({a['params']['active']:,} active), "
            f"{a['flops_per_token'] / 1e6:,.2f} MFLOPs/token",
            flush=True,
        )


def train_points(
    points: list[Point],
    data: PreparedData,
    dev: torch.device,
    tc: TrainConfig,
    *,
    steps: int,
    seeds: int,
    seed: int,
    seen: np.ndarray,
    budget_s: float | None,
    progress: bool,
) -> list[dict]:
    """Every point for every seed on the same batches; the first run sizes the steps to `budget_s`."""
    runs: list[dict] = []
    warmup = min(tc.warmup_steps, max(0, steps - 1))
    for k in range(seeds):
        for point in points:
            first = not runs
            # Only the first run may cut the step count (to fit the budget); the others take its count.
            budget = budget_s * 0.8 / (len(points) * seeds) / 60 if first and budget_s is not None else None
            run_cfg = dataclasses.replace(tc, seed=seed, steps=steps, warmup_steps=warmup, max_minutes=budget)
            model = build_model(point.cfg, data, seed=seed + k, device=dev)
            trainer = build_trainer(
                model, run_cfg, data, dev, label=f"{point.label} seed {seed + k}", progress=progress
            )
            result = trainer.fit(token_losses=True)
            if first and trainer.step < steps:
                print(
                    banner(
                        f"the sweep's budget ({budget_s:.0f} s after data preparation) fits {trainer.step:,} of "
                        f"{steps:,} steps per run: every run of this sweep trains that many"
                    ),
                    flush=True,
                )
                steps, warmup = trainer.step, trainer.cfg.warmup_steps
            runs.append(_record(point, trainer, result, data, seen, seed + k))
            del model, trainer
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return runs


def _record(point: Point, trainer, result: dict, data: PreparedData, seen: np.ndarray, run_seed: int) -> dict:
    tc = trainer.cfg
    a = point.accounting
    return {
        "label": point.label,
        "seed": run_seed,
        "rho": point.rho,
        "rho_realized": a["rho_realized"],
        "n_experts": a["n_experts"],
        "table_size": a["table_size"],
        "table_rows": a["table_rows"],
        "total_params": a["params"]["total"],
        "active_params": a["params"]["active"],
        "table_params": a["params"]["tables"],
        "params": a["params"],
        "flops_per_token": a["flops_per_token"],
        "forward_flops": a["forward_flops"],
        "steps": trainer.step,
        "train_tokens": result["train_tokens"],
        "passes": data.train.passes(trainer.step, tc.batch_size, tc.seq_len),
        "val_loss": result["val_loss"],
        "bits_per_byte": result["bits_per_byte"],
        "val_tokens": result["val_tokens"],
        "buckets": bucket_losses(trainer.token_losses, seen),
        "tokens_per_s": result["tokens_per_s"],
        "train_seconds": result["train_seconds"],
        "final_train_loss": result["final_train_loss"],
    }


# ----------------------------------------------------------------------------- the report


def summarize(
    kind: str,
    sp: StudyPreset,
    points: list[Point],
    runs: list[dict],
    *,
    seeds: int,
    seed: int,
    passes: dict,
    data: PreparedData,
    dev: torch.device,
) -> dict:
    """study.json: the runs, per-point means, the finding and how far the scale is from the paper's."""
    per_point = []
    for p in points:
        mine = [r for r in runs if r["label"] == p.label]
        row = {"label": p.label, "rho": p.rho, **{k: v for k, v in p.accounting.items() if k != "forward_flops"}}
        for key in ("val_loss", "bits_per_byte", "tokens_per_s"):
            mean, std = mean_std([r[key] for r in mine])
            row[key] = {"mean": mean, "std": std, "values": [r[key] for r in mine]}
        for bucket in ("seen", "unseen"):
            row[f"val_loss_{bucket}"] = mean_std([r["buckets"][bucket]["loss"] for r in mine])[0]
        per_point.append(row)
    finding = find(kind, per_point, runs)
    scale = scale_gap(kind, runs[0])
    summary = {
        "study": kind,
        "preset": sp.base.name,
        "seeds": [seed + k for k in range(seeds)],
        "data_seed": seed,
        "same_tokens": len({r["train_tokens"] for r in runs}) == 1,
        "passes": passes,
        "points": per_point,
        "runs": runs,
        "finding": finding,
        "scale": scale,
        "paper": PAPER,
        "config": {
            "study": {k: v for k, v in dataclasses.asdict(sp).items() if k != "base"},
            "preset": sp.base.to_dict(),
            "models": {p.label: p.cfg.to_dict() for p in points},
        },
        "data": data.info,
        "machine": machine_info(dev),
    }
    summary["table"] = format_study_table(kind, per_point)
    summary["report"] = report_text(kind, summary)
    return summary


def _beyond(a: dict, b: dict) -> bool | None:
    """Whether mean a is below mean b by more than the two seed spreads together (None: one seed)."""
    if a["std"] is None or b["std"] is None:
        return None
    return b["mean"] - a["mean"] > a["std"] + b["std"]


def find(kind: str, points: list[dict], runs: list[dict]) -> dict:
    """The sweep's finding from its per-point means (`points`) and its runs."""
    return allocation_finding(points) if kind == "allocation" else slots_finding(points, runs)


def allocation_finding(points: list[dict]) -> dict:
    """The lowest-loss rho, its gap to pure MoE, and whether either is beyond the seed spread."""
    ref = next(p for p in points if p["rho"] == 1.0)
    best = min(points, key=lambda p: p["val_loss"]["mean"])
    lowest_rho = min(points, key=lambda p: p["rho"])
    gap = 100 * (1 - best["val_loss"]["mean"] / ref["val_loss"]["mean"])
    beats_moe = _beyond(best["val_loss"], ref["val_loss"]) if best is not ref else False
    interior = best is not ref and best is not lowest_rho
    u_shape = interior and bool(beats_moe) and bool(_beyond(best["val_loss"], lowest_rho["val_loss"]))
    deltas = {f"{p['rho']:.2f}": 100 * (p["val_loss"]["mean"] / ref["val_loss"]["mean"] - 1) for p in points}
    # Table-holding points the optimum does not beat beyond the seed spread: the grid cannot tell them apart.
    ties = [p["rho"] for p in points if p is not best and p is not ref and not _beyond(best["val_loss"], p["val_loss"])]
    return {
        "optimum_rho": best["rho"],
        "optimum_val_loss": best["val_loss"]["mean"],
        "pure_moe_val_loss": ref["val_loss"]["mean"],
        "gain_vs_pure_moe_pct": gap,
        "beyond_seed_spread": beats_moe,
        "u_shape": u_shape,
        "lowest_rho": lowest_rho["rho"],
        "within_spread_of_optimum": ties,
        "loss_vs_pure_moe_pct": deltas,
    }


def slots_finding(points: list[dict], runs: list[dict]) -> dict:
    """Least-squares line of val loss against log10(rows) over every run with a table."""
    xs = np.array([math.log10(r["table_rows"]) for r in runs if r["table_rows"] > 0])
    ys = np.array([r["val_loss"] for r in runs if r["table_rows"] > 0])
    slope, intercept = np.polyfit(xs, ys, 1)
    se = None
    if len(xs) > 2:
        residual = ys - (slope * xs + intercept)
        se = float(math.sqrt((residual @ residual) / (len(xs) - 2) / ((xs - xs.mean()) @ (xs - xs.mean()))))
    none = next(p for p in points if p["table_rows"] == 0)
    return {
        "slope_per_decade": float(slope),
        "slope_stderr": se,
        "intercept": float(intercept),
        "decades": float(xs.max() - xs.min()),
        "no_engram_val_loss": none["val_loss"]["mean"],
        "slope_beyond_2se": None if se is None else bool(abs(slope) > 2 * se),
    }


def scale_gap(kind: str, run: dict) -> dict:
    """This sweep's scale beside the paper's: training FLOPs and tokens of one run."""
    flops = run["flops_per_token"] * run["train_tokens"]
    out = {
        "train_flops_per_run": flops,
        "train_tokens_per_run": run["train_tokens"],
        "active_params": run["active_params"],
        "total_params_reference": run["total_params"],
    }
    if kind == "allocation":
        out["paper_flops"] = PAPER["allocation"]["compute_flops"]
        out["orders_of_magnitude_below_paper"] = math.log10(PAPER["allocation"]["compute_flops"][1] / flops)
    else:
        out["paper_tokens"] = PAPER["slots"]["train_tokens"]
        out["orders_of_magnitude_below_paper"] = math.log10(PAPER["slots"]["train_tokens"] / run["train_tokens"])
    return out


def format_study_table(kind: str, points: list[dict]) -> str:
    head = [
        "point",
        "experts",
        "table rows",
        "params (total)",
        "active",
        "MFLOPs/tok",
        "val loss",
        "bits/byte",
        "seen 3-gram",
        "unseen",
        "tok/s",
    ]
    rows = [head]
    for p in points:
        v = p["val_loss"]
        rows.append(
            [
                p["label"],
                str(p["n_experts"]),
                f"{p['table_rows']:,}",
                f"{p['params']['total']:,}",
                f"{p['params']['active']:,}",
                f"{p['flops_per_token'] / 1e6:,.3f}",
                f"{v['mean']:.4f}" + ("" if v["std"] is None else f" +- {v['std']:.4f}"),
                f"{p['bits_per_byte']['mean']:.4f}",
                f"{p['val_loss_seen']:.4f}",
                f"{p['val_loss_unseen']:.4f}",
                f"{p['tokens_per_s']['mean']:,.0f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def report_text(kind: str, s: dict) -> str:
    """What the sweep shows, and what it cannot, in a few sentences."""
    f, sc, n = s["finding"], s["scale"], len(s["seeds"])
    tokens = f"{sc['train_tokens_per_run']:,} training tokens per run ({s['passes']['passes']:.2f} passes)"
    if kind == "allocation":
        flops = (
            f"{sc['train_flops_per_run']:.2e} training FLOPs per run, {sc['orders_of_magnitude_below_paper']:.1f} "
            "orders of magnitude below the paper's 6e20"
        )
        if f["optimum_rho"] == 1.0:
            claim = "pure MoE (rho = 1) has the lowest mean loss: no rho of the grid gains from Engram tables"
        elif f["beyond_seed_spread"] is None:
            claim = (
                f"lowest mean loss at rho = {f['optimum_rho']:.2f} ({f['gain_vs_pure_moe_pct']:.2f}% below pure "
                "MoE), from one seed: no spread measured, so no minimum is claimed"
            )
        elif not f["beyond_seed_spread"]:
            claim = (
                f"no minimum beyond the seed spread (lowest mean at rho = {f['optimum_rho']:.2f}, "
                f"{f['gain_vs_pure_moe_pct']:.2f}% below pure MoE, within the spread of {n} seeds)"
            )
        else:
            claim = (
                f"lowest mean loss at rho = {f['optimum_rho']:.2f}, {f['gain_vs_pure_moe_pct']:.2f}% below pure MoE, "
                f"beyond the spread of {n} seeds; {_shape(f)}"
            )
        at_04 = f["loss_vs_pure_moe_pct"].get("0.40")
        if at_04 is not None:
            claim += f"; at rho = 0.40 the loss is {at_04:+.2f}% against pure MoE's (paper: about equal)"
        return (
            f"Allocation at {flops}; {tokens}. Measured: {claim}. Paper: a U-shape with its minimum at rho "
            "0.75-0.80, 0.8% below pure MoE at 6e20 FLOPs. This sweep tests the same trade (expert parameters "
            "for table parameters at equal total and active parameters) at a far smaller scale: it can agree "
            "or disagree with the paper's shape, not reproduce its numbers."
        )
    se = "" if f["slope_stderr"] is None else f" +- {f['slope_stderr']:.4f}"
    sign = "falls" if f["slope_per_decade"] < 0 else "does not fall"
    return (
        f"Slots over {f['decades']:.1f} decades of table rows; {tokens}, "
        f"{sc['orders_of_magnitude_below_paper']:.1f} orders of magnitude fewer tokens than the paper's 100B. "
        f"Measured: validation loss {sign} with log10(rows), slope {f['slope_per_decade']:+.4f}{se} nats per "
        f"decade{_significance(f['slope_beyond_2se'])}; without Engram "
        f"{f['no_engram_val_loss']:.4f}. Paper: roughly linear in log(rows) from 2.58e5 to 1e7 rows."
    )


def _shape(f: dict) -> str:
    """Whether the allocation grid locates its optimum, in words."""
    lowest = f["lowest_rho"]
    if f["u_shape"]:
        shape = "a U-shape: below both ends of the grid beyond the spread"
    elif f["optimum_rho"] == lowest:
        shape = f"at the grid's low end (rho = {lowest:.2f}): no U-shape"
    else:
        shape = f"no U-shape beyond the spread: the grid's low end (rho = {lowest:.2f}) is within it"
    ties = f["within_spread_of_optimum"]
    if ties:
        shape += "; rho = " + ", ".join(f"{r:.2f}" for r in ties) + " within the spread of the lowest mean"
    return shape


def _significance(beyond: bool | None) -> str:
    if beyond is None:
        return " (two sizes: no standard error)"
    return " (beyond two standard errors)" if beyond else " (NOT beyond two standard errors)"


def plot_study(summary: dict, path: Path, within: Path | None = None) -> Path | None:
    """allocation: val loss vs rho (every seed, the mean line, pure MoE marked); slots: val loss vs rows
    (log axis) with the fitted line and the no-Engram level. Written inside `within` when given."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs, points, f = summary["runs"], summary["points"], summary["finding"]
    if summary["study"] == "allocation":
        ax.scatter([r["rho"] for r in runs], [r["val_loss"] for r in runs], s=18, alpha=0.6, label="each seed")
        order = sorted(points, key=lambda p: p["rho"])
        ax.plot([p["rho"] for p in order], [p["val_loss"]["mean"] for p in order], "o-", label="mean")
        ax.axhline(f["pure_moe_val_loss"], color="gray", ls="--", label="pure MoE (rho = 1)")
        ax.axvspan(0.75, 0.80, color="orange", alpha=0.15, label="paper's optimum")
        ax.set_xlabel("rho: share of the sparse parameters in routed experts (rest: Engram table)")
    else:
        with_table = [r for r in runs if r["table_rows"] > 0]
        ax.scatter([r["table_rows"] for r in with_table], [r["val_loss"] for r in with_table], s=18, label="each run")
        xs = np.logspace(
            math.log10(min(r["table_rows"] for r in with_table)),
            math.log10(max(r["table_rows"] for r in with_table)),
            50,
        )
        ax.plot(
            xs,
            f["intercept"] + f["slope_per_decade"] * np.log10(xs),
            label=f"fit: {f['slope_per_decade']:+.4f} nats / decade",
        )
        ax.axhline(f["no_engram_val_loss"], color="gray", ls="--", label="no Engram (same FLOPs)")
        ax.set_xscale("log")
        ax.set_xlabel("Engram table rows")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title(
        f"condmem study {summary['study']} ({summary['preset']}): "
        f"{summary['scale']['train_tokens_per_run']:,} tokens per run",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, within=within)
