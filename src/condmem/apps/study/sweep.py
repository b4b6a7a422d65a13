"""`condmem study`: the Engram paper's sparsity-allocation and memory-slot sweeps, at small scale.

* ``allocation``: a mixture-of-experts backbone whose routed experts hold the whole sparse
  budget (rho = 1, pure MoE) is the reference. For each rho of the grid, the number of
  routed experts drops to ``top_k + round(rho * (E - top_k))`` and an Engram table in block
  1 takes the parameters they held, so every model has the same total parameters (up to
  the table's rounding to the layout's primes, recorded) and the same parameters and
  FLOPs per token: top_k experts, the same attention and shared expert; the Engram's
  projection and gate cost FLOPs that the pure-MoE model spends on a wider shared expert
  in the same block (`iso_flop_baseline`). A point is labelled by the rho its integer
  expert count realises, the rho asked beside it. Controls (`CONTROLS`) run beside each
  rho < 1. Paper (arXiv 2601.07372): loss is U-shaped in rho, lowest at rho ~ 0.75-0.8.
* ``slots``: the backbone fixed (rho = 1's experts, with an Engram), the table's rows
  swept over two decades or more, plus the backbone without Engram (iso-FLOP) as a
  level, table sizes capped at the distinct n-grams a run reads. Paper: loss falls about
  linearly in log(rows).
* ``tokens``: pure MoE, each rho and its ``no_table`` control at each budget of ``tokens_grid``
  (each budget's runs ordinary runs with their own steps): the gaps against training tokens, and
  each gap's slope in log10(tokens), per seed then over seeds.

A sweep is a set of runs (`condmem.apps.study.runs`): each writes ``OUT/runs/<run-id>.json``
when it ends, a re-run skips finished runs, ``--only`` splits a sweep over machines, and
`merge` builds ``study.json`` and the figures once every run exists. Every run of a seed index
trains on the same batches in the same order for the same number of steps (stated up front,
at most ``max_passes`` over the training split), and is validated on the same held-out
tokens (at most ``val_tokens``, said so). The report states the scale against the paper's
and claims a difference, a slope or a minimum only where its 95% interval allows it.
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
from condmem.models.config import ModelConfig
from condmem.models.flops import (
    dense_control,
    forward_flops_per_token,
    parameter_counts,
    random_address_control,
    tiny_table_control,
    train_flops_per_token,
)
from condmem.train.pipeline import PreparedData
from condmem.train.build import (
    banner,
    build_model,
    build_model_config,
    build_trainer,
    cap_steps,
    prepare,
    resolve_device,
)
from condmem.apps.demo import mean_std
from condmem.train.heldout import seen_in_training
from condmem.apps.study.config import CONTROLS, KINDS, PRESET_NAMES, StudyConfig, load_study_config, study_preset
from condmem.apps.study.stats import (
    compare,
    holm,
    linear_slope,
    p_value,
    paired_difference,
    quadratic_optimum,
    slope_over_seeds,
    t_interval,
)
from condmem.train.determinism import determinism_record, deterministic_mode, set_cublas_workspace
from condmem.apps.study.provenance import provenance, provenance_text, say_other_commits, throughput, throughput_text
from condmem.apps.study.runs import (
    ReusableRuns,
    RunStore,
    SweepProgress,
    claim_run,
    is_claimed,
    data_identity,
    differences,
    distinct_ngrams,
    parse_only,
    plan_runs,
    release_run,
    run_config,
    run_seeds,
    run_train_config,
    select_runs,
    train_run,
)
from condmem.utils.atomic import atomic_write_text, check_destination
from condmem.apps.plots import plot_router_load, plot_sweep_curves, plot_token_gaps
from condmem.utils.plotting import pyplot, save_figure

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

STUDY_PRESETS: dict[str, StudyConfig] = {name: study_preset(name) for name in PRESET_NAMES}
"""The shipped presets (``condmem/configs/study/*.toml``)."""


@dataclass
class Point:
    """One model of a sweep."""

    label: str
    cfg: ModelConfig
    rho: float | None = None
    """Allocation: the rho the point's integer expert count realises (None in the slot sweep)."""
    accounting: dict = field(default_factory=dict)
    rho_asked: list[float] = field(default_factory=list)
    """Allocation: the grid's rhos that gave this point's expert count."""
    control: str | None = None
    """The control this point is (`CONTROLS`), None for a point of the sweep itself."""
    key: str = ""
    """The point's part of its runs' ids (file names)."""
    steps: int | None = None
    """Token sweep: the steps of this point's runs (None: the sweep's)."""
    train_tokens: int | None = None
    """Token sweep: the training tokens of this point's runs (None: the sweep's)."""

    def record_fields(self) -> dict:
        """What each run's record says about its point."""
        a = self.accounting
        return {
            "rho": self.rho,
            "rho_asked": self.rho_asked,
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
        }

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "key": self.key,
            "rho": self.rho,
            "rho_asked": self.rho_asked,
            "control": self.control,
            "steps": self.steps,
            "train_tokens": self.train_tokens,
            "accounting": self.accounting,
            "model": self.cfg.to_dict(),
        }


# ----------------------------------------------------------------------------- the sweeps' models


CONTROL_MODELS = {
    "no_table": iso_flop_baseline,
    "tiny_table": tiny_table_control,
    "random_address": random_address_control,
}
"""The model of each per-rho control from its point's model (the same experts); ``dense`` is
`dense_control` of the pure-MoE model, once."""


def allocation_points(base: ModelConfig, rhos: list[float], controls: list[str] | tuple = ()) -> list[Point]:
    """The pure-MoE reference and one model per realised rho < 1 at its total parameters, then the
    controls of each rho < 1.

    `base`: the backbone at rho = 1 with the Engram geometry (its table size is replaced). Rhos
    that round to the same expert count are one point (its ``rho_asked`` lists them).
    """
    moe, engram = base.moe, base.engram
    if moe is None or engram is None:
        raise ValueError("the allocation study needs a backbone with routed experts (model.moe) and an Engram")
    spare = moe.n_experts - moe.top_k
    if spare < 1:
        raise ValueError(f"model.moe has {moe.n_experts} experts for top_k {moe.top_k}: no sparse experts to trade")
    bad = [r for r in rhos if not 0 < r <= 1]
    if bad:
        raise ValueError(f"rho must be in (0, 1], got {bad}")
    unknown = [c for c in controls if c not in CONTROLS]
    if unknown:
        raise ValueError(f"unknown control(s) {unknown}; choose from {list(CONTROLS)}")
    reference = iso_flop_baseline(base)
    budget = parameter_counts(reference)["total"]
    by_experts: dict[int, list[float]] = {}
    for rho in sorted(set(rhos), reverse=True):
        by_experts.setdefault(moe.top_k + round(rho * spare), []).append(rho)
    asked_ref = by_experts.pop(moe.n_experts, [])
    points = [
        Point("rho=1.00 (pure MoE)", reference, 1.0, rho_asked=sorted({1.0, *asked_ref}, reverse=True), key="rho1")
    ]
    layers = len(engram.layer_ids)
    mains = []
    for experts, asked in sorted(by_experts.items(), reverse=True):
        realised = (experts - moe.top_k) / spare
        cfg = base.replace(moe=dataclasses.replace(moe, n_experts=experts))
        counts = parameter_counts(cfg)
        rows = (budget - (counts["total"] - counts["tables"])) // (engram.head_dim * layers)
        cfg = cfg.replace(engram=engram.replace(table_size=table_size_for(engram, rows)))
        shown = ", ".join(f"{r:.2f}" for r in asked)
        label = f"rho={realised:.2f}" + ("" if asked == [round(realised, 10)] else f" (asked {shown})")
        mains.append(Point(label, cfg, realised, rho_asked=asked, key=f"rho{realised:.4f}_experts{experts}"))
    points += mains
    if "dense" in controls:
        points.append(Point("dense (same active)", dense_control(reference), 1.0, control="dense", key="dense"))
    for control in (c for c in controls if c != "dense"):
        for p in mains:
            cfg = CONTROL_MODELS[control](p.cfg)
            if cfg == p.cfg:  # a table already within the tiny table's bound: the control would repeat the point
                print(f"  {control} control of {p.label}: the same model as the point (not run)", flush=True)
                continue
            points.append(
                Point(
                    f"rho={p.rho:.2f} {control}",
                    cfg,
                    p.rho,
                    rho_asked=p.rho_asked,
                    control=control,
                    key=f"{p.key}_{control}",
                )
            )
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
    points = [Point("no Engram", iso_flop_baseline(base), key="no_engram")]
    for size in sorted(set(table_sizes)):
        cfg = base.replace(engram=base.engram.replace(table_size=size))
        points.append(Point(f"table_size={size:,}", cfg, key=f"table_size{size}"))
    for point in points:
        point.accounting = accounting(point.cfg, base.max_seq_len)
    return points


def token_points(base: ModelConfig, rhos: list[float], steps: list[int], tokens_per_step: int) -> list[Point]:
    """The allocation points of `rhos` (pure MoE, each rho < 1 and its ``no_table`` control) once per
    budget of `steps`; a point's key and label name its training tokens (``tok2048_rho1``)."""
    points = []
    for n in sorted(steps):
        tokens = n * tokens_per_step
        for p in allocation_points(base, rhos, ["no_table"]):
            p.label, p.key = f"{tokens:,} tok {p.label}", f"tok{tokens}_{p.key}"
            p.steps, p.train_tokens = n, tokens
            points.append(p)
    return points


def table_size_cap(engram: EngramConfig, distinct: int) -> int:
    """The largest table size whose every (order, head) column has at most `distinct` rows (its prime)."""

    def widest(size: int) -> int:
        return max(max(p) for p in draw_primes(engram.layer_ids, [size] * (engram.max_ngram_size - 1), engram.n_heads))

    lo, hi = 2, max(2, distinct)
    while lo < hi:  # the widest column grows with the size: the last size that fits
        mid = (lo + hi + 1) // 2
        if widest(mid) <= distinct:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cap_table_sizes(engram: EngramConfig, sizes: list[int], distinct: int) -> tuple[list[int], dict]:
    """`sizes` with each above the n-gram cap replaced by the cap (a column never has more rows than
    the `distinct` n-grams a run reads), and the record of the decision (``note``: None when none
    was capped); `ValueError` when fewer than two sizes are left."""
    cap = table_size_cap(engram, distinct)
    capped = sorted({min(size, cap) for size in sizes})
    over = sorted(size for size in set(sizes) if size > cap)
    note = None
    if over:
        note = (
            f"table sizes {', '.join(f'{s:,}' for s in over)} exceed the {distinct:,} distinct "
            f"{engram.max_ngram_size}-grams a run reads: capped at table size {cap:,} (every (order, head) "
            f"column at most {distinct:,} rows)"
        )
    if len(capped) < 2:
        raise ValueError(
            f"the slot sweep needs two table sizes or more at most {cap:,} (the {distinct:,} distinct "
            f"{engram.max_ngram_size}-grams a run reads), got {sorted(set(sizes))}"
        )
    record = {"distinct_ngrams": distinct, "order": engram.max_ngram_size, "cap": cap, "capped": over, "note": note}
    return capped, record


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


# ----------------------------------------------------------------------------- configuration


def resolve_config(
    *,
    preset: str = "tiny",
    config: str | Path | StudyConfig | None = None,
    seeds: int | None = None,
    corpus=None,
    steps: int | None = None,
    tokens: int | None = None,
    kind: str = "allocation",
    minutes: float | None = None,
    seed: int | None = None,
    rhos: list[float] | None = None,
    table_sizes: list[int] | None = None,
    max_passes: float | None = None,
    val_tokens: int | None = None,
    controls: list[str] | None = None,
    deterministic: bool | None = None,
    tokens_grid: list[int] | None = None,
) -> StudyConfig:
    """The sweep's config: the preset or `config` file, with the given values (None: kept) in place."""
    if kind not in KINDS:
        raise ValueError(f"unknown study {kind!r}; choose one of {list(KINDS)}")
    if kind == "tokens":
        for flag, value in (("--steps", steps), ("--tokens", tokens), ("--minutes", minutes)):
            if value is not None:
                raise ValueError(f"{flag}: the token sweep's budgets are its tokens_grid (use --tokens-grid)")
    elif tokens_grid:
        raise ValueError(f"--tokens-grid is the token sweep's (condmem study tokens), not the {kind} sweep's")
    if isinstance(config, StudyConfig):
        sc = config
    elif config is not None:
        sc = load_study_config(config)
    else:
        sc = study_preset(preset)
    if kind == "slots" and seeds is None and sc.slots_seeds is not None:
        seeds = sc.slots_seeds
    step_key, token_key = (
        ("allocation_steps", "allocation_tokens") if kind == "tokens" else (f"{kind}_steps", f"{kind}_tokens")
    )
    if kind == "tokens" and rhos:
        rhos, tokens_rhos = None, list(rhos)
    else:
        tokens_rhos = None
    sc = sc.override(
        "command line",
        seeds=seeds,
        seed=seed,
        minutes=minutes,
        rhos=list(rhos) if rhos else None,
        table_sizes=list(table_sizes) if table_sizes else None,
        max_passes=max_passes,
        val_tokens=val_tokens,
        controls=list(controls) if controls is not None else None,
        deterministic=deterministic,
        tokens_grid=list(tokens_grid) if tokens_grid else None,
        tokens_rhos=tokens_rhos,
        **{step_key: steps, token_key: tokens},
    )
    if steps is not None:  # --steps replaces a tokens budget of the file
        sc = dataclasses.replace(sc, **{token_key: None})
    if corpus is not None:
        sc = sc.with_base(data={"corpus": corpus})
    if kind == "slots" and len(set(sc.table_sizes)) < 2:
        raise ValueError(f"the slot sweep needs two table sizes or more, got {sc.table_sizes}")
    if kind == "tokens":
        sc.token_steps()  # a missing or degenerate grid is refused before any work
    return sc


# ----------------------------------------------------------------------------- running


def run_study(
    kind: str,
    out: str | Path | None = None,
    *,
    device: str | None = None,
    only: list[str] | None = None,
    overwrite: bool = False,
    stop_after: float | None = None,
    progress: bool = True,
    stage: str = "all",
    reuse: list[str | Path] | None = None,
    claims: str | Path | None = None,
    **options,
) -> dict:
    """Run (or continue) one sweep in `out`; returns study.json's dict when every run exists, else a
    status (``{"complete": False, "runs_left": [...]}``).

    Args:
        kind: ``allocation``, ``slots`` or ``tokens`` (the allocation's gaps at each budget of the
            config's ``tokens_grid``).
        options: `resolve_config`'s: ``preset`` / ``config`` (a shipped preset ``tiny``, ``cpu``,
            ``gpu``, or a study config file) and the values that replace the config's (seeds,
            corpus, steps or tokens, minutes, seed, rhos, table_sizes, max_passes, val_tokens,
            controls, deterministic, tokens_grid; ``rhos`` the token sweep's ``tokens_rhos``).
        only: ``--only`` filters: train only the runs they select.
        overwrite: replace a sweep in `out` made with another config (and its runs that differ).
        stop_after: minutes: start no run that would not finish within them (re-run to continue).
        reuse: other sweeps' output folders: their finished runs equal to a selected run here are
            copied in rather than trained (`ReusableRuns`).
        stage: ``all`` (plan, train, and merge once every run exists), ``plan`` (prepare the data, write
            the plan and return the selected runs not yet trained as ``selected_left`` and every run id
            of the plan as ``planned``; train nothing) or
            ``train`` (train the selected runs, never merge: one of several processes sharing `out`).
        claims: with ``stage="train"``, a folder shared with the other processes training the same
            runs: each run is trained by the first process to claim it (`claim_run`), so the runs
            form one queue and a process that fails loses only the run it was training.
    """
    if stage not in ("all", "plan", "train"):
        raise ValueError(f"run_study: stage must be 'all', 'plan' or 'train', got {stage!r}")
    wall = time.perf_counter()
    sc = resolve_config(kind=kind, **options)
    parse_only(only)  # a malformed --only is refused before any work
    cublas = set_cublas_workspace(sc.deterministic)  # before anything starts cuBLAS
    dev = resolve_device(device)
    out = Path(out or f"condmem-study/{kind}")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("study.json", f"{kind}.png", f"{kind}_router.png", "config.json", "sweep.json"):  # before the runs
        check_destination(out / name, within=out)
    previous = _previous_sweep(out, kind, sc, overwrite)
    print(
        f"condmem study {kind}: {sc.name!r} on {dev}, {sc.seeds} seed{'s' if sc.seeds > 1 else ''}, deterministic "
        f"mode {'on' if sc.deterministic else 'OFF'}; output in {out}/",
        flush=True,
    )
    threads = torch.get_num_threads()
    if dev.type == "cpu" and sc.cpu_threads is not None:
        torch.set_num_threads(sc.cpu_threads)
    try:
        with deterministic_mode(sc.deterministic):
            call = _Call(kind, sc, out, dev, only, overwrite, stop_after, wall, progress, reuse, claims)
            return _sweep(call, previous, cublas, stage)
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Call:
    """One `run_study` call, its config, device and output folder settled (its arguments' meanings)."""

    kind: str
    sc: StudyConfig
    out: Path
    dev: torch.device
    only: list[str] | None
    overwrite: bool
    stop_after: float | None
    wall: float
    progress: bool
    reuse: list | None
    claims: str | Path | None = None


@dataclass
class _Planned:
    """What a sweep's plan settled for its runs: the data, its identity, the step count, the runs."""

    data: PreparedData
    seen: np.ndarray
    n_steps: int
    data_id: str
    specs: list
    chosen: list

    def settings(self, call: _Call, spec) -> tuple:
        """One run's training settings and its config (`run_config`: what its result depends on)."""
        sc = call.sc
        run_tc = run_train_config(sc.base.train, spec.point.steps or self.n_steps, spec.data_seed)
        wanted = run_config(
            call.kind, spec, run_tc, data_id=self.data_id, val_tokens=sc.val_tokens, deterministic=sc.deterministic
        )
        return run_tc, wanted


def _sweep(call: _Call, previous: dict | None, cublas, stage: str) -> dict:
    """`run_study` once its config, device and output folder are settled."""
    kind, sc, out, dev = call.kind, call.sc, call.out, call.dev
    data = prepare(sc.base, seed=sc.split_seed)
    seen = seen_in_training(
        data.train.tokens, data.val.tokens, data.info["tokenizer"]["vocab_size"], pad_id=data.eos_id
    )
    base = build_model_config(sc.base, data)
    tc = sc.base.train
    n_steps, passes = _capped_steps(sc.steps_for(kind), data.train, tc, sc.max_passes)
    ngram_cap = None
    if kind == "allocation":
        points = allocation_points(base, sc.rhos, sc.controls)
    elif kind == "tokens":
        budgets = sorted({min(s, n_steps) for s in sc.token_steps()})
        if len(budgets) < 2:
            raise ValueError(f"tokens_grid {sc.tokens_grid}: capped at {n_steps:,} steps, fewer than two budgets left")
        points = token_points(base, sc.tokens_rhos or sc.rhos, budgets, tc.batch_size * tc.seq_len)
    else:
        if previous is not None:  # the steps (and so the n-grams read) of the sweep already in `out`
            n_steps = previous["steps"]
        points, ngram_cap = _slot_plan(sc, base, data, n_steps, previous)
    specs = plan_runs(points, sc.seeds, sc.seed)
    if previous is not None:
        n_steps, budget = previous["steps"], previous["budget"]
    elif kind == "tokens":  # each budget's steps are the grid's
        budget = None
    else:
        n_steps, budget = _budgeted_steps(sc, kind, n_steps, points, data, dev, len(specs), call.wall)
        if kind == "slots" and budget is not None and budget["cut"]:  # fewer steps read fewer n-grams
            points, ngram_cap = _slot_plan(sc, base, data, n_steps, None)
            specs = plan_runs(points, sc.seeds, sc.seed)
    passes.update(steps=n_steps, passes=data.train.passes(n_steps, tc.batch_size, tc.seq_len))
    data_id = data_identity(data)
    sweep = {
        "study": kind,
        "config": sc.to_dict(),
        "steps": n_steps,
        "budget": budget,
        "passes": passes,
        "data_id": data_id,
        "data": data.info,
        "determinism": {**determinism_record(sc.deterministic), "cublas_workspace_config": cublas},
        "points": [p.to_dict() for p in points],
        "runs": [s.run_id for s in specs],
        "ngram_cap": ngram_cap,
    }
    atomic_write_text(out / "sweep.json", json.dumps(sweep, indent=1) + "\n", within=out)
    sc.save(out / "config.json", within=out)
    print_plan(kind, points, n_steps, tc, sc)
    planned = _Planned(data, seen, n_steps, data_id, specs, select_runs(specs, call.only))
    chosen = planned.chosen
    store = RunStore(out)
    if call.reuse and stage != "train":  # a worker's share was planned (and copied in) by the plan stage
        _copy_reused(call, planned, store, ReusableRuns(call.reuse))
    if stage != "train":
        say_other_commits(store, chosen)
    if stage == "plan":
        selected_left = [s.run_id for s in chosen if not store.path(s.run_id).exists()]
        return {
            "complete": False,
            "selected_left": selected_left,
            "planned": [s.run_id for s in specs],
            "out": str(out),
        }
    _train_selected(call, planned)
    if stage == "train":
        return {"complete": False, "out": str(out)}
    return finish(out, [s.run_id for s in specs], wall=call.wall)


def finish(out: Path, planned: list[str], wall: float | None = None) -> dict:
    """study.json and the PNGs (`merge`) once every planned run exists; else say how many are left and
    return ``{"complete": False, "runs_left": [...]}``."""
    store = RunStore(out)
    left = [r for r in planned if not store.path(r).exists()]
    if not left:
        return merge(out, wall=wall)
    print(
        f"\n{len(planned) - len(left)} of {len(planned)} runs of the sweep are done, {len(left)} left: re-run the same "
        f"command to continue (or `condmem study merge {out}` once every run exists)",
        flush=True,
    )
    return {"complete": False, "runs_left": left, "out": str(out)}


def _slot_plan(sc: StudyConfig, base: ModelConfig, data, n_steps: int, previous: dict | None):
    """The slot sweep's points with table sizes capped at the distinct n-grams a run of `n_steps` reads
    (the fewest over seed indices; reused from `previous` when it counted them), and the cap's record."""
    tc = sc.base.train
    old = (previous or {}).get("ngram_cap")
    if old is not None:
        distinct = old["distinct_ngrams"]
    else:
        order = base.engram.max_ngram_size
        seeds = [run_seeds(sc.seed, k)[1] for k in range(sc.seeds)]
        distinct = min(distinct_ngrams(data.train, n_steps, tc.batch_size, tc.seq_len, s, order) for s in seeds)
    sizes, record = cap_table_sizes(base.engram, sc.table_sizes, distinct)
    record["steps"] = n_steps
    if record["note"]:
        print(banner(record["note"]), flush=True)
    return slot_points(base, sizes), record


def _previous_sweep(out: Path, kind: str, sc: StudyConfig, overwrite: bool) -> dict | None:
    """The sweep already in `out` when it has this kind and config (its step count is reused); None when
    there is none or `overwrite`; `ValueError` naming the keys when it differs."""
    path = out / "sweep.json"
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a sweep record ({exc}); remove it or use another --out") from None
    if overwrite:
        return None
    if old.get("study") != kind:
        raise ValueError(
            f"{out} holds a {old.get('study')!r} sweep, not {kind!r}: use another --out (or --overwrite to replace it)"
        )
    diff = differences(old.get("config", {}), sc.to_dict())
    if diff:
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise ValueError(
            f"{out} holds a sweep made with another configuration ({shown}): re-run it with the same options, "
            "use another --out, or --overwrite to replace the sweep (runs with the same configuration are kept)"
        )
    return old


def _copy_reused(call: _Call, planned: _Planned, store: RunStore, reusable: ReusableRuns) -> None:
    """Copy in each chosen run without a result here that another sweep finished with the same config."""
    copied = 0
    chosen = planned.chosen
    for spec in chosen:
        if store.path(spec.run_id).exists():
            continue
        record = reusable.copy(spec, planned.settings(call, spec)[1])
        if record is not None:
            store.write(record)
            copied += 1
            print(f"[sweep] {spec.run_id}: reused from {record['reused_from']['path']}", flush=True)
    print(f"[sweep] --reuse: {copied} of the {len(chosen)} selected runs copied in from other sweeps", flush=True)


def _train_selected(call: _Call, planned: _Planned) -> None:
    """Train the chosen runs that have no result yet (a stored one is checked against its config)."""
    store = RunStore(call.out)
    specs, stop_after, dev = planned.specs, call.stop_after, call.dev
    todo, finished = [], []
    for spec in planned.chosen:
        run_tc, wanted = planned.settings(call, spec)
        stored = store.finished(spec.run_id, wanted, call.overwrite)
        if stored is not None:
            print(f"[sweep] {spec.run_id}: finished earlier ({store.path(spec.run_id)}), skipped", flush=True)
            finished.append(stored)
            continue
        todo.append((spec, run_tc, wanted))
    done = sum(1 for s in specs if store.path(s.run_id).exists()) - sum(
        1 for spec, _, _ in todo if store.path(spec.run_id).exists()
    )
    bar = SweepProgress(len(specs), done, call.progress)
    trained_steps = 0
    prior = None
    if stop_after is not None:  # the other workers' runs too: this command's share may have none yet
        chosen = {spec.run_id for spec in planned.chosen}
        others = (store.load(spec.run_id) for spec in specs if spec.run_id not in chosen)
        prior = _seconds_per_step(finished + [r for r in others if r is not None])
        if prior is None and todo:
            print(
                f"[sweep] --stop-after {stop_after:g}: no finished run here to time yet, so the first run "
                "starts whatever it takes; the limit applies from the next one",
                flush=True,
            )
    claims = None if call.claims is None else Path(call.claims)
    try:
        for spec, run_tc, wanted in _queue(todo, claims, store):
            mean = bar.mean_run_seconds()
            if mean is not None:
                # a run of more steps than the mean so far (the token sweep's larger budgets) takes longer
                mean *= max(1.0, run_tc.steps * bar.trained / trained_steps)
            elif prior is not None:  # no run finished in this command yet: the folder's finished ones
                mean = prior * run_tc.steps * STORED_RUN_MARGIN
            if stop_after is not None and mean is not None:
                if time.perf_counter() - call.wall + mean > stop_after * 60:
                    print(
                        banner(
                            f"--stop-after {stop_after:g}: the next run would end after the limit; "
                            f"{len(_free_runs(todo, claims, store))} selected runs not started here "
                            "(re-run to continue)"
                        ),
                        flush=True,
                    )
                    break
            if claims is not None and not claim_run(claims, spec.run_id):
                continue
            t0 = time.perf_counter()
            try:
                record = train_run(
                    spec, planned.data, dev, run_tc, seen=planned.seen, val_tokens=call.sc.val_tokens,
                    progress=call.progress,
                )  # fmt: skip
            except torch.cuda.OutOfMemoryError:
                if claims is not None:  # give it back: a worker with one process fewer beside it takes it
                    release_run(claims, spec.run_id)
                    print(f"[sweep] {spec.run_id}: out of memory; given back to the other workers", flush=True)
                raise
            record["run_config"] = wanted
            store.write(record)
            bar.finished(time.perf_counter() - t0)
            trained_steps += run_tc.steps
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        bar.close()


def _free_runs(todo: list, claims: Path | None, store: RunStore) -> list:
    """The runs of `todo` (``(spec, ...)`` tuples) that no process has finished, nor claimed (with `claims`)."""

    def free(run_id: str) -> bool:
        return not store.path(run_id).exists() and not (claims is not None and is_claimed(claims, run_id))

    return [t for t in todo if free(t[0].run_id)]


def _queue(todo: list, claims: Path | None, store: RunStore):
    """The runs of `todo` in order; with `claims` (one worker of `run_parallel`), the first of the
    `_free_runs`, looked up again after each run until none is left, so a run another worker gave
    back is taken here."""
    if claims is None:
        yield from todo
        return
    while free := _free_runs(todo, claims, store):
        yield free[0]


STORED_RUN_MARGIN = 1.25
"""A stored run's training time leaves out its model's build and its final validation: the estimate
of a run from stored ones is this much longer."""


def _seconds_per_step(records: list[dict]) -> float | None:
    """The median training seconds a step of these finished runs took (None without one): what
    `--stop-after` expects of a run before this command has finished one of its own."""
    rates = [r["train_seconds"] / r["steps"] for r in records if r.get("train_seconds") and r.get("steps")]
    return float(np.median(rates)) if rates else None


def _capped_steps(requested: int, train, tc, max_passes: float) -> tuple[int, dict]:
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


PROBE_STEPS = 6
"""Steps of the budget probe (the first two are left out of its timing)."""


def _budgeted_steps(sc: StudyConfig, kind, steps: int, points, data, dev, n_runs: int, wall: float):
    """Steps of every run under ``sc.minutes``, decided before any run from a probe of the costliest
    point (a few steps of a throwaway model): (steps, the record of the decision; None without a budget)."""
    if sc.minutes is None:
        return steps, None
    tc = sc.base.train
    costly = max(points, key=lambda p: (p.accounting["flops_per_token"], p.accounting["params"]["total"]))
    step_s = _probe_step_seconds(costly, sc, data, dev)
    available = sc.minutes * 60 - _since(wall)
    # Validation reads its tokens ~3x cheaper than training (forward only); 10% is kept for the rest.
    val = min(sc.val_tokens or len(data.val), len(data.val))
    val_steps = val / (tc.batch_size * tc.seq_len) / 3
    fit = int(0.9 * available / n_runs / step_s - val_steps)
    if fit < 1:
        raise ValueError(
            f"--minutes {sc.minutes:g}: {n_runs} runs at {step_s:.3f} s a step (measured) do not fit one step each"
        )
    chosen = min(steps, fit)
    record = {
        "minutes": sc.minutes,
        "probe_point": costly.label,
        "probe_step_seconds": step_s,
        "seconds_available": available,
        "runs": n_runs,
        "requested_steps": steps,
        "steps": chosen,
        "cut": chosen < steps,
    }
    if chosen < steps:
        print(
            banner(
                f"--minutes {sc.minutes:g}: {n_runs} runs at {step_s:.3f} s a step (probe of {costly.label}) fit "
                f"{chosen:,} of {steps:,} steps each: every run trains {chosen:,} steps, its learning-rate "
                "schedule over those steps"
            ),
            flush=True,
        )
    return chosen, record


def _since(wall: float) -> float:
    return time.perf_counter() - wall


def _probe_step_seconds(point: Point, sc: StudyConfig, data, dev) -> float:
    """Median seconds of a training step of `point` (steps 3.. of `PROBE_STEPS`, a throwaway model)."""
    probe_tc = run_train_config(sc.base.train, PROBE_STEPS, sc.seed)
    model = build_model(point.cfg, data, seed=sc.seed, device=dev)
    trainer = build_trainer(model, probe_tc, data, dev, label="budget probe", progress=False)
    model.train()
    times = []
    for step in range(PROBE_STEPS):
        t0 = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


def merge(out: str | Path, wall: float | None = None) -> dict:
    """``study.json`` and the figures of the sweep in `out` from its run files; `ValueError` naming the
    runs that are missing."""
    out = Path(out)
    path = out / "sweep.json"
    if not path.exists():
        raise ValueError(f"{out}: no sweep.json: not the output folder of a `condmem study` sweep")
    sweep = json.loads(path.read_text())
    store = RunStore(out)
    missing = [r for r in sweep["runs"] if not store.path(r).exists()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{out}: {len(missing)} of {len(sweep['runs'])} runs have no result yet ({shown})")
    runs = [store.load(r) for r in sweep["runs"]]
    point_steps = {p["key"]: p.get("steps") or sweep["steps"] for p in sweep["points"]}
    for run in runs:  # runs copied in from another machine's folder must belong to this plan
        rc = run.get("run_config", {})
        steps, data_id = rc.get("train", {}).get("steps"), rc.get("data")
        wanted = point_steps.get(rc.get("point"), sweep["steps"])
        if steps != wanted or data_id != sweep["data_id"]:
            raise ValueError(
                f"{store.path(run['run_id'])} does not belong to this sweep (its steps {steps} and data "
                f"{data_id}; the sweep's {wanted} and {sweep['data_id']}): train it again here"
            )
    summary = summarize(sweep, runs)
    print("\n" + summary["table"] + "\n\n" + summary["report"], flush=True)
    _write_study(summary, out, sweep["study"], wall)
    return summary


def _write_study(summary: dict, out: Path, kind: str, wall: float | None) -> None:
    """The figures (``<kind>.png``, ``<kind>_curves.png``, when matplotlib is there) and ``study.json``."""
    figure = plot_study(summary, out / f"{kind}.png", within=out)
    curves = plot_sweep_curves(summary, out / f"{kind}_curves.png", within=out)
    router = plot_router_load(summary, out / f"{kind}_router.png", within=out)
    summary["figure"] = figure.name if figure else None
    summary["curves_figure"] = curves.name if curves else None
    summary["router_figure"] = router.name if router else None
    summary["wall_seconds"] = None if wall is None else time.perf_counter() - wall
    atomic_write_text(out / "study.json", json.dumps(summary, indent=1) + "\n", within=out)
    took = "" if wall is None else f" ({summary['wall_seconds']:.0f} s in all)"
    figs = "".join(f", {f.name}" for f in (figure, curves, router) if f)
    print(f"\nwrote {out}/study.json{figs}{took}", flush=True)


def replot(kind: str, out: str | Path | None = None) -> Path | None:
    """Draw ``<kind>.png`` again from ``out/study.json`` (a GPU run on a machine without matplotlib),
    and derive the finding and the report again from the runs it records."""
    out = Path(out or f"condmem-study/{kind}")
    path = out / "study.json"
    if not path.exists():
        raise ValueError(f"{path}: no study.json (run the sweep, or `condmem study merge {out}` once its runs exist)")
    summary = json.loads(path.read_text())
    if summary.get("study") != kind:
        raise ValueError(f"{path} holds a {summary.get('study')!r} study, not {kind!r}")
    if not summary.get("runs") or not summary.get("points"):
        raise ValueError(f"{path} holds no runs: nothing to plot (run the sweep, or `condmem study merge {out}`)")
    summary["finding"] = find(kind, summary["points"], summary["runs"])
    summary["provenance"] = provenance(summary["runs"])
    summary["throughput"] = throughput(summary["runs"])
    summary["report"] = report_text(kind, summary)
    figure = plot_study(summary, out / f"{kind}.png", within=out)
    summary["figure"] = figure.name if figure is not None else summary.get("figure")
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n", within=out)
    print(summary["report"], flush=True)
    if figure is not None:
        print(f"wrote {figure}", flush=True)
    return figure


def print_plan(kind: str, points: list[Point], steps: int, tc, sc: StudyConfig) -> None:
    """One line per point: experts, table rows, parameters, FLOPs."""
    val = "every held-out token" if sc.val_tokens is None else f"at most {sc.val_tokens:,} held-out tokens"
    budgets = sorted({p.steps for p in points if p.steps is not None})
    if budgets:
        steps_text = "/".join(f"{n:,}" for n in budgets)
        print(f"token budgets: {steps_text} steps (each point's runs train its budget's steps)", flush=True)
    print(
        f"{len(points)} models x {sc.seeds} seed{'s' if sc.seeds > 1 else ''}, each "
        f"{steps_text if budgets else f'{steps:,}'} steps x "
        f"{tc.batch_size * tc.seq_len:,} tokens (the batches of each seed the same for every model), "
        f"validated on {val}:",
        flush=True,
    )
    for p in points:
        a = p.accounting
        print(
            f"  {p.label:<26} {a['n_experts']:>3} experts, {a['table_rows']:>12,} table rows, "
            f"{a['params']['total']:>13,} params ({a['params']['active']:,} active), "
            f"{a['flops_per_token'] / 1e6:,.2f} MFLOPs/token",
            flush=True,
        )


# ----------------------------------------------------------------------------- the report


def summarize(sweep: dict, runs: list[dict]) -> dict:
    """study.json from the sweep record and its runs: per-point means, the finding, the scale gap."""
    kind = sweep["study"]
    per_point = []
    for p in sweep["points"]:
        mine = [r for r in runs if r["run_id"].startswith(p["key"] + "_seed")]
        row = {
            "label": p["label"],
            "key": p["key"],
            "rho": p["rho"],
            "rho_asked": p["rho_asked"],
            "control": p["control"],
            "train_tokens": p.get("train_tokens") or (mine[0]["train_tokens"] if mine else None),
            **{k: v for k, v in p["accounting"].items() if k != "forward_flops"},
        }
        touched = [r["rows_touched"] for r in mine if r.get("rows_touched")]
        if touched:  # distinct rows read in training, per table, over seeds
            row["rows_touched"] = {
                name: {"rows": touched[0][name]["rows"], "touched": [t[name]["touched"] for t in touched]}
                for name in touched[0]
            }
        for key in ("val_loss", "bits_per_byte", "tokens_per_s"):
            mean, std = mean_std([r[key] for r in mine])
            row[key] = {"mean": mean, "std": std, "values": [r[key] for r in mine], "seeds": [r["seed"] for r in mine]}
        for bucket in ("seen", "unseen"):
            row[f"val_loss_{bucket}"] = mean_std([r["buckets"][bucket]["loss"] for r in mine])[0]
        per_point.append(row)
    config = sweep["config"]
    seeds = sorted({r["init_seed"] for r in runs})
    summary = {
        "study": kind,
        "preset": config["name"],
        "seeds": seeds,
        "data_seeds": sorted({r["data_seed"] for r in runs}),
        "same_tokens": len({r["train_tokens"] for r in runs}) == 1,
        "steps": sweep["steps"],
        "budget": sweep["budget"],
        "passes": sweep["passes"],
        "validation": {
            "tokens_cap": config["val_tokens"],
            "tokens": runs[0]["val_tokens"],
            "tokens_available": runs[0]["val_tokens_available"],
            "capped": runs[0]["val_capped"],
        },
        "determinism": sweep["determinism"],
        "ngram_cap": sweep.get("ngram_cap"),
        "points": per_point,
        "runs": runs,
        "finding": find(kind, per_point, runs),
        "statistics": statistics(kind, per_point, runs),
        "scale": scale_gap(kind, max(runs, key=lambda r: r["train_tokens"])),
        "paper": PAPER,
        "config": config,
        "models": {p["label"]: p["model"] for p in sweep["points"]},
        "data": sweep["data"],
        "machine": runs[0]["machine"],
        "provenance": provenance(runs),
        "throughput": throughput(runs),
    }
    together = summary["throughput"] is None or summary["throughput"]["runs_at_once"] > SHARED_AT_ONCE
    summary["table"] = format_study_table(kind, per_point, shared=together)
    summary["report"] = report_text(kind, summary)
    return summary


CONTROL_EFFECTS = {
    "no_table": "the table's own effect (same experts, no table)",
    "tiny_table": "memory against the extra pathway (a table of ~1K rows per head)",
    "random_address": "content addressing (rows drawn at random)",
}


PRIMARY_POOLED = ("table_vs_no_table", "table_vs_tiny_table", "table_vs_random_address")
"""The allocation's primary comparisons, corrected together (Holm): is the gain the table's own,
memory beyond the extra pathway, and content. They are tested only once the gate holds, pure MoE
below the dense control at 95% (a fair MoE backbone); otherwise nothing about rho or the table is
claimed. Testing the gate first, then the family, keeps the chance of any false claim within 5%.
Every other interval is secondary: each at 95%, not corrected for multiplicity."""

UNFAIR = "not claimed: pure MoE is not below the dense control, so the backbone is not shown to be a fair MoE"

ONE_LINE = "one line through every run"
"""The slot slope's method with one seed (and in a study.json that predates ``statistics.method``)."""


def losses_by_seed(points: list[dict], runs: list[dict], bucket: str | None = None) -> dict:
    """Each point's validation loss per initialisation seed: ``{point key: {seed: loss}}``; with
    `bucket` (``seen`` / ``unseen``), the loss over that bucket's targets (`bucket_losses`)."""

    def loss(r: dict) -> float:
        return r["val_loss"] if bucket is None else r["buckets"][bucket]["loss"]

    return {
        p["key"]: {r["init_seed"]: loss(r) for r in runs if r["run_id"].startswith(p["key"] + "_seed")} for p in points
    }


def statistics(kind: str, points: list[dict], runs: list[dict], *, primary: bool = True) -> dict:
    """Paired differences by seed with 95% t-intervals (`study_stats`), and the fitted optimum.

    allocation: each rho < 1 against pure MoE; each rho against each of its controls; pure MoE
    against the dense control; a quadratic in rho over the sweep's own points with its
    bootstrap argmin; with `primary`, the gate (pure MoE below dense) and Holm's correction over
    the primary comparisons (`PRIMARY_POOLED`), recorded in ``multiplicity``. slots:
    `slots_statistics`; tokens: `token_statistics`."""
    if kind == "slots":
        return slots_statistics(points, runs)
    if kind == "tokens":
        return token_statistics(points, runs)
    by_key = losses_by_seed(points, runs)
    mains = [p for p in points if p["control"] is None]
    ref = next(p for p in mains if p["rho"] == 1.0)
    out = {"vs_pure_moe": {}, "controls": {}, "dense": None, "optimum": None}
    for p in mains:
        if p is not ref:
            diff = paired_difference(by_key[p["key"]], by_key[ref["key"]])
            out["vs_pure_moe"][p["label"]] = compare(p["label"], "pure MoE", diff)
    for c in (p for p in points if p["control"] in CONTROL_EFFECTS):
        main = next(p for p in mains if c["key"].startswith(p["key"] + "_"))
        diff = paired_difference(by_key[main["key"]], by_key[c["key"]])
        entry = compare(main["label"], c["label"], diff)
        entry["what"] = CONTROL_EFFECTS[c["control"]]
        out["controls"].setdefault(c["control"], {})[main["label"]] = entry
    out["pooled"] = pooled_controls([p for p in mains if p is not ref], points, by_key)
    out["by_bucket"] = table_effect_by_bucket([p for p in mains if p is not ref], points, runs)
    dense = next((p for p in points if p["control"] == "dense"), None)
    if dense is not None:
        out["dense"] = compare("pure MoE", "dense", paired_difference(by_key[ref["key"]], by_key[dense["key"]]))
    if len(mains) >= 3:
        out["optimum"] = quadratic_optimum({p["rho"]: by_key[p["key"]] for p in mains})
    if primary:
        family = {k: out["pooled"][k] for k in PRIMARY_POOLED if k in out["pooled"]}
        record = correct_family(family, f"the {len(family)} primary comparisons")
        fair = out["dense"] is None or out["dense"]["verdict"] == "lower"
        record["gate"] = None if out["dense"] is None else {"test": "pure MoE below dense", "holds": fair}
        record["secondary"] = sum(k not in family and k != "dense" for k, _, _ in comparisons(out))
        out["multiplicity"] = record
        if not fair:  # the gate fails: withdraw every claim about rho and the table
            for key, _, e in comparisons(out):
                if key != "dense" and e["claim"]:
                    e["claim"], e["text"] = False, f"{e['text']}; {UNFAIR}"
            if out["optimum"] and out["optimum"]["claims_minimum"]:
                out["optimum"].update(claims_minimum=False, reason=UNFAIR)
    return out


SLOT_FAMILIES = {
    "vs_no_table": "tables against no table",
    "vs_smaller": "tables against the next smaller",
}
"""The slot sweep's secondary comparisons, each family under Holm's correction: what a table of each
size gains over the backbone alone, and where along the rows the curve stops falling."""


def slots_statistics(points: list[dict], runs: list[dict]) -> dict:
    """The slot sweep's primary test, the slope of loss in log10(rows): with two seeds or more, each
    seed's slope, then over seeds (a seed's runs share initialisation and data order at every size),
    else one line through every run. Secondary (`SLOT_FAMILIES`, from `points`): each table against
    no table and against the next smaller table, paired by seed; Holm's correction within each family
    is recorded in ``multiplicity``."""
    with_table = [r for r in runs if r["table_rows"] > 0]
    fit = linear_slope([math.log10(r["table_rows"]) for r in with_table], [r["val_loss"] for r in with_table])
    curves = {}
    for r in with_table:
        xs, ys = curves.setdefault(r["init_seed"], ([], []))
        xs.append(math.log10(r["table_rows"]))
        ys.append(r["val_loss"])
    per_seed = len(curves) > 1 and all(len(set(xs)) > 1 for xs, _ in curves.values())
    slope = slope_over_seeds(curves) if per_seed else fit["slope"]
    claims = slope.half_width is not None and slope.excludes_zero
    out = {
        "slope_per_decade": slope.to_dict(),
        "method": "each seed's slope, then over seeds" if per_seed else ONE_LINE,
        "intercept": fit["intercept"],
        "n": fit["n"],
        "claims_slope": claims,
        "text": _slope_text(slope, claims),
    }
    by_key = losses_by_seed(points, runs)
    tables = sorted((p for p in points if p["table_rows"] > 0), key=lambda p: p["table_rows"])
    none = next((p for p in points if p["table_rows"] == 0), None)

    def pair(a: dict, b: dict) -> dict:
        return compare(a["label"], b["label"], paired_difference(by_key[a["key"]], by_key[b["key"]]))

    out["vs_no_table"] = {p["label"]: pair(p, none) for p in tables} if none else {}
    out["vs_smaller"] = {p["label"]: pair(p, q) for q, p in zip(tables, tables[1:])}
    out["multiplicity"] = {
        key: correct_family(out[key], f"the {len(out[key])} {name}") for key, name in SLOT_FAMILIES.items() if out[key]
    }
    return out


def correct_family(entries: dict[str, dict], family: str, alpha: float = 0.05) -> dict:
    """Holm's correction over `entries` (each with ``p``, ``claim`` and ``text``), in place: each
    gains ``holm``; a claim stands only where Holm holds, and its text says so. Returns the family's
    record: ``{"method", "alpha", "family", "members"}``."""
    verdicts = holm({k: e["p"] for k, e in entries.items()}, alpha)
    for key, e in entries.items():
        h = verdicts.get(key)
        if h is None:
            continue
        e["holm"] = h
        if e["claim"] and not h["holds"]:
            e["claim"] = False
            e["text"] += f"; after Holm's correction over {family} (adjusted p {h['p_adjusted']:.3f}): not claimed"
        else:
            e["text"] += f"; Holm over {family}: adjusted p {h['p_adjusted']:.3f}" + (", holds" if h["holds"] else "")
    return {"method": "Holm", "alpha": alpha, "family": family, "members": list(verdicts)}


def comparisons(st: dict) -> list[tuple[str, str, dict]]:
    """Every paired comparison of an allocation's statistics as (key, "A - B", entry), in reading
    order: pure MoE against dense, each rho against pure MoE, each control at each rho, the
    rho-pooled ones (keyed as in ``multiplicity.members``), the table's own effect by bucket."""
    out = [("dense", "pure MoE - dense", st["dense"])] if st.get("dense") else []
    out += [(f"vs_pure_moe {label}", f"{label} - pure MoE", c) for label, c in st["vs_pure_moe"].items()]
    for control, entries in st["controls"].items():
        out += [(f"{control} {label}", f"{label} - {control}", c) for label, c in entries.items()]
    for key, c in st.get("pooled", {}).items():
        out.append((key, f"mean over rho: {c['a'].removeprefix('the ')} - {c['b'].removeprefix('the ')}", c))
    for key, c in st.get("by_bucket", {}).items():
        label = (
            "mean over rho: table effect, seen - unseen"
            if key == "seen_minus_unseen"
            else f"mean over rho, {key} 3-grams: full table - no_table control"
        )
        out.append((f"by_bucket {key}", label, c))
    return out


# (A, B, what A - B measures): None is a rho point itself, a name its control of that kind.
POOLED_CONTRASTS = (
    (None, "no_table", "the table's own effect"),
    (None, "tiny_table", "memory beyond the extra pathway"),
    (None, "random_address", "content addressing"),
    ("tiny_table", "no_table", "the extra pathway alone (a ~1K-row table against none)"),
    ("random_address", "no_table", "rows drawn at random against no table (vanishes if the gain is memory)"),
)


def pooled_over_rho(pairs: list[tuple[str, str]], by_key: dict) -> dict | None:
    """Per seed, the mean over `pairs` (one (A, B) pair of point keys per rho) of A - B; None where a
    run is missing on one side (an unfinished run: the per-rho comparisons name it)."""
    seeds = set(by_key[pairs[0][0]])
    if any(set(by_key[k]) != seeds for pair in pairs for k in pair):
        return None
    return {s: sum(by_key[a][s] - by_key[b][s] for a, b in pairs) / len(pairs) for s in sorted(seeds, key=str)}


def pooled_controls(rho_points: list[dict], points: list[dict], by_key: dict) -> dict:
    """Each control contrast averaged over the rho points that have both sides, paired by seed.

    One value per seed (the mean over rho of A - B, `pooled_over_rho`), then a t-interval over
    seeds: a seed's runs share initialisation and data order at every rho, so the seeds, not the
    (rho, seed) pairs, are the independent units. One rho point's interval from 3 seeds is wide
    (t = 4.30 at 2 degrees of freedom); averaging the points first narrows the spread each seed
    brings without pretending the pairs are independent."""
    keys = {p["key"] for p in points}
    out = {}
    for a, b, what in POOLED_CONTRASTS:
        pairs = [
            (p["key"] if a is None else f"{p['key']}_{a}", f"{p['key']}_{b}")
            for p in rho_points
            if (a is None or f"{p['key']}_{a}" in keys) and f"{p['key']}_{b}" in keys
        ]
        per_seed = pooled_over_rho(pairs, by_key) if pairs else None
        if per_seed is None:
            continue
        name_a = "the full table" if a is None else f"the {a} control"
        entry = compare(name_a, f"the {b} control", t_interval(list(per_seed.values())))
        entry.update(what=what, a_control=a, b_control=b, rho_points=len(pairs))
        out[f"{a or 'table'}_vs_{b}"] = entry
    return out


def table_effect_by_bucket(rho_points: list[dict], points: list[dict], runs: list[dict]) -> dict:
    """Where the table's own effect falls: each rho against its ``no_table`` control, averaged over
    rho per seed (`pooled_over_rho`), on the validation targets whose 3-gram ending at the target
    occurs in the training split (``seen``: a row could have learned it) and on the rest
    (``unseen``), and ``seen_minus_unseen``, their paired difference. A gain that is memory should
    fall mostly on seen targets. Empty without no-table controls, or where a run has no buckets."""
    keys = {p["key"] for p in points}
    pairs = [(p["key"], f"{p['key']}_no_table") for p in rho_points if f"{p['key']}_no_table" in keys]
    if not pairs or any("buckets" not in r for r in runs):
        return {}
    effect = {b: pooled_over_rho(pairs, losses_by_seed(points, runs, bucket=b)) for b in ("seen", "unseen")}
    if None in effect.values():
        return {}
    out = {
        b: compare(f"the full table on {b} 3-grams", "the no_table control", t_interval(list(e.values())))
        for b, e in effect.items()
    }
    gap = t_interval([effect["seen"][s] - effect["unseen"][s] for s in effect["seen"]])
    out["seen_minus_unseen"] = compare("the table's own effect on seen 3-grams", "its effect on unseen ones", gap)
    for b, entry in out.items():
        what = (
            "where the table's own effect falls" if b == "seen_minus_unseen" else f"the table's own effect, {b} 3-grams"
        )
        entry.update(what=what, rho_points=len(pairs))
    return out


def _slope_label(finding: dict, st: dict) -> str:
    """The slot figure's fit line: its slope, and the statistics' slope with its 95% interval."""
    label = f"fit: {finding['slope_per_decade']:+.4f} nats / decade"
    sl = st.get("slope_per_decade")
    if sl and sl.get("half_width") is not None:
        label += f"; 95% CI [{sl['low']:+.4f}, {sl['high']:+.4f}] ({st.get('method', ONE_LINE)})"
    return label


def _slope_text(slope, claims: bool) -> str:
    if slope.half_width is None:
        return f"slope {slope.mean:+.4f} nats per decade of rows from two runs: no interval, no claim"
    span = f"{slope.mean:+.4f} [{slope.low:+.4f}, {slope.high:+.4f}] nats per decade of rows"
    if claims:
        return f"loss {'falls' if slope.mean < 0 else 'rises'} with log10(rows): {span} (the interval excludes zero)"
    return f"no slope claimed: {span} (the interval includes zero)"


def _budgets(points: list[dict]):
    """A token sweep's budgets, ascending: ``(tokens, its points, pure MoE, {rho: (point, no_table
    control or None)})`` for each rho < 1 of the budget."""
    for tokens in sorted({p["train_tokens"] for p in points}):
        mine = [p for p in points if p["train_tokens"] == tokens]
        ref = next(p for p in mine if p["control"] is None and p["rho"] == 1.0)
        rhos = {}
        for p in mine:
            if p["control"] is None and p is not ref:
                own = (c for c in mine if c["control"] == "no_table" and c["key"].startswith(p["key"] + "_"))
                rhos[f"{p['rho']:.2f}"] = (p, next(own, None))
        yield tokens, mine, ref, rhos


def token_statistics(points: list[dict], runs: list[dict]) -> dict:
    """Per training budget (ascending): each rho < 1 against pure MoE and against its ``no_table``
    control (the table's own effect), paired by seed with 95% t-intervals, and where that effect
    falls (`table_effect_by_bucket`, seen minus unseen 3-grams); tokens per active parameter."""
    budgets = []
    for tokens, mine, ref, rhos in _budgets(points):
        keys = tuple(p["key"] + "_seed" for p in mine)
        stats = statistics("allocation", mine, [r for r in runs if r["run_id"].startswith(keys)], primary=False)
        entry = {
            "train_tokens": tokens,
            "steps": next((r["steps"] for r in runs if r["run_id"].startswith(ref["key"] + "_seed")), None),
            "tokens_per_active_param": tokens / ref["params"]["active"],
            "pure_moe_val_loss": ref["val_loss"]["mean"],
            "vs_pure_moe": {},
            "table_effect": {},
            "where_gain_falls": stats["by_bucket"].get("seen_minus_unseen"),
        }
        for rho, (p, _) in rhos.items():
            entry["vs_pure_moe"][rho] = stats["vs_pure_moe"][p["label"]]
            effect = stats["controls"].get("no_table", {}).get(p["label"])
            if effect is not None:
                entry["table_effect"][rho] = effect
        budgets.append(entry)
    trend = token_trend(points, runs)
    return {"budgets": budgets, "trend": trend, "multiplicity": correct_trends(trend)}


def correct_trends(trend: dict) -> dict:
    """Holm's correction over a token sweep's trends (`token_trend`), in place: they are the sweep's
    question (does a gap change with tokens?), so they form its primary family."""
    family = {f"{contrast} rho {rho}": e for contrast, by_rho in trend.items() for rho, e in by_rho.items()}
    return correct_family(family, f"the {len(family)} trends")


def token_trend(points: list[dict], runs: list[dict]) -> dict:
    """Whether each gap changes with tokens: per seed, the least-squares slope of its paired
    difference in log10(tokens per run) over every budget; then a t-interval over seeds.

    A seed's runs share initialisation and data order at every budget, so the seeds are the
    independent units (as in `pooled_controls`). ``{"vs_pure_moe" | "table_effect": {rho: entry}}``,
    an entry with the slope's interval (nats per decade of tokens), the budgets and seeds used, and
    ``claim``: True only where the interval excludes zero."""
    loss = losses_by_seed(points, runs)
    by_budget = {}
    for tokens, _, ref, rhos in _budgets(points):
        for rho, (p, ctl) in rhos.items():
            by_budget.setdefault(("vs_pure_moe", rho), {})[tokens] = (loss[p["key"]], loss[ref["key"]])
            if ctl is not None:
                by_budget.setdefault(("table_effect", rho), {})[tokens] = (loss[p["key"]], loss[ctl["key"]])
    out = {"vs_pure_moe": {}, "table_effect": {}}
    for (contrast, rho), pairs in by_budget.items():
        if len(pairs) < 2:
            continue
        seeds = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs.values())))
        if not seeds:
            continue
        x = [math.log10(t) for t in sorted(pairs)]
        interval = slope_over_seeds({s: (x, [pairs[t][0][s] - pairs[t][1][s] for t in sorted(pairs)]) for s in seeds})
        out[contrast][rho] = {
            "slope_per_decade": interval.to_dict(),
            "budgets": sorted(pairs),
            "seeds": seeds,
            "p": p_value(interval),
            "claim": interval.excludes_zero,
            "text": _trend_text(interval),
        }
    return out


def _trend_text(slope) -> str:
    if slope.half_width is None:
        return f"{slope.mean:+.4f} nats per decade of tokens from one seed: no interval, no claim"
    span = f"{slope.mean:+.4f} nats per decade of tokens, 95% CI [{slope.low:+.4f}, {slope.high:+.4f}], {slope.n} seeds"
    if not slope.excludes_zero:
        return f"no change with tokens claimed: {span} (the interval includes zero)"
    return f"the difference {'falls' if slope.mean < 0 else 'rises'} with log10(tokens): {span}"


def _beyond(a: dict, b: dict) -> bool | None:
    """Whether mean a is below mean b by more than the two seed spreads together (None: one seed)."""
    if a["std"] is None or b["std"] is None:
        return None
    return b["mean"] - a["mean"] > a["std"] + b["std"]


def find(kind: str, points: list[dict], runs: list[dict]) -> dict:
    """The sweep's finding from its per-point means (`points`) and its runs."""
    if kind == "tokens":
        return token_finding(points, runs)
    return allocation_finding(points) if kind == "allocation" else slots_finding(points, runs)


def token_finding(points: list[dict], runs: list[dict]) -> dict:
    """Per budget: the best rho < 1 (lowest mean) and its gap to pure MoE, in percent."""
    out = []
    for tokens in sorted({p["train_tokens"] for p in points}):
        mains = [p for p in points if p["train_tokens"] == tokens and p["control"] is None]
        ref = next(p for p in mains if p["rho"] == 1.0)
        others = [p for p in mains if p is not ref]
        best = min(others, key=lambda p: p["val_loss"]["mean"]) if others else ref
        out.append(
            {
                "train_tokens": tokens,
                "best_rho": best["rho"],
                "pure_moe_val_loss": ref["val_loss"]["mean"],
                "best_val_loss": best["val_loss"]["mean"],
                "gap_pct": 100 * (best["val_loss"]["mean"] / ref["val_loss"]["mean"] - 1),
            }
        )
    return {"budgets": out}


def allocation_finding(points: list[dict]) -> dict:
    """The lowest-loss rho, its gap to pure MoE, and whether either is beyond the seed spread (the
    sweep's own points: controls left out)."""
    points = [p for p in points if p.get("control") is None]
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
    if kind in ("allocation", "tokens"):
        out["paper_flops"] = PAPER["allocation"]["compute_flops"]
        out["orders_of_magnitude_below_paper"] = math.log10(PAPER["allocation"]["compute_flops"][1] / flops)
    else:
        out["paper_tokens"] = PAPER["slots"]["train_tokens"]
        out["orders_of_magnitude_below_paper"] = math.log10(PAPER["slots"]["train_tokens"] / run["train_tokens"])
    return out


SHARED_AT_ONCE = 1.05
"""Runs at once on average (`throughput`) above which a sweep's runs are taken to have shared the device."""


def format_study_table(kind: str, points: list[dict], *, shared: bool = False) -> str:
    """The points as a text table; `shared` (runs trained at once, or a sweep that cannot tell) adds
    a line on what tok/s then means."""
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
    if shared:
        lines.append(
            "tok/s: each run's training rate while other runs may have shared its device (--parallel): "
            "it says how many ran beside it as much as what the point costs"
        )
    return "\n".join(lines)


def report_text(kind: str, s: dict) -> str:
    """What the sweep shows, and what it cannot, in a few sentences."""
    return _report_body(kind, s) + throughput_text(s) + provenance_text(s)


def _report_body(kind: str, s: dict) -> str:
    f, sc, n = s["finding"], s["scale"], len(s["seeds"])
    if kind == "tokens":
        return token_report(s)
    tokens = f"{sc['train_tokens_per_run']:,} training tokens per run ({s['passes']['passes']:.2f} passes)"
    if kind == "allocation":
        flops = (
            f"{sc['train_flops_per_run']:.2e} training FLOPs per run, {sc['orders_of_magnitude_below_paper']:.1f} "
            "orders of magnitude below the paper's 6e20"
        )
        if f["optimum_rho"] == 1.0:
            means = "the lowest mean loss at pure MoE (rho = 1)"
        else:
            gain = f["gain_vs_pure_moe_pct"]
            means = f"the lowest mean loss at rho = {f['optimum_rho']:.2f}, {gain:.2f}% below pure MoE"
        at_04 = f["loss_vs_pure_moe_pct"].get("0.40")
        if at_04 is not None:
            means += f"; at rho = 0.40 {at_04:+.2f}% (paper: about equal)"
        claim = f"Means (not claims): {means}; {_noise_floor(s)}"
        return (
            f"Allocation at {flops}; {tokens}{_validation_text(s)}. {claim}. Paper: a U-shape with its "
            "minimum at rho 0.75-0.80, 0.8% below pure MoE at 6e20 FLOPs. This sweep tests the same trade (expert "
            "parameters for table parameters at equal total and active parameters) at a far smaller scale: it "
            "can agree or disagree with the paper's shape, not reproduce its numbers." + _statistics_text(s)
        )
    st = s.get("statistics") or {}
    if "claims_slope" in st:
        cap = (s.get("ngram_cap") or {}).get("note")
        return (
            f"Slots over {f['decades']:.1f} decades of table rows; {tokens}, "
            f"{sc['orders_of_magnitude_below_paper']:.1f} orders of magnitude fewer tokens than the paper's 100B, "
            f"{n} seed{'s' if n > 1 else ''}. Measured (95% t-interval; "
            f"{st.get('method', ONE_LINE)}): {st['text']}; {_noise_floor(s)}; without "
            f"Engram {f['no_engram_val_loss']:.4f}. Paper: roughly linear in log(rows) from 2.58e5 to 1e7 rows."
            + (f" Note: {cap}." if cap else "")
            + _touched_text(s)
            + "".join(
                f"\n{name.capitalize()}:" + "".join(f"\n  * {e['text']}" for e in st[key].values())
                for key, name in SLOT_FAMILIES.items()
                if st.get(key)
            )
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


def _touched_text(s: dict) -> str:
    """Rows read in training against the table's rows, per point (mean over seeds, all tables)."""
    parts = []
    for p in s["points"]:
        t = p.get("rows_touched")
        if t:
            rows = sum(v["rows"] for v in t.values())
            touched = sum(float(np.mean(v["touched"])) for v in t.values())
            parts.append(f"{p['label']}: {touched:,.0f} of {rows:,} ({100 * touched / rows:.1f}%)")
    return ("\nRows touched in training (mean over seeds): " + "; ".join(parts)) if parts else ""


def token_report(s: dict) -> str:
    """The token sweep's report: per budget, each rho's gap to pure MoE and the table's own effect."""
    lines = []
    for b in s["statistics"]["budgets"]:
        lines.append(
            f"{b['train_tokens']:,} tokens per run ({b['tokens_per_active_param']:.3g} tokens per active "
            f"parameter), pure MoE {b['pure_moe_val_loss']:.4f}:"
        )
        for rho, c in b["vs_pure_moe"].items():
            lines.append(f"  * rho {rho} vs pure MoE: {c['text']}")
            effect = b["table_effect"].get(rho)
            if effect is not None:
                lines.append(f"  * rho {rho}, the table's own effect (vs no table): {effect['text']}")
        falls = b.get("where_gain_falls")
        if falls:
            lines.append(f"  * {_pooled_text(falls)}")
    trend = s["statistics"].get("trend") or {}
    names = {"vs_pure_moe": "vs pure MoE", "table_effect": "the table's own effect"}
    said = [f"  * rho {rho} {names[c]}: {e['text']}" for c in names for rho, e in trend.get(c, {}).items()]
    if said:
        lines += ["Against tokens, the sweep's primary question (per seed, the slope of the paired difference in "
                  "log10(tokens), then over seeds; a difference below zero that falls is a gain that grows; Holm's "
                  f"correction over the {len(said)} trends at family-wise 5%):", *said]  # fmt: skip
    return (
        f"Token axis: the allocation's gaps at {len(s['statistics']['budgets'])} budgets from "
        f"{s['statistics']['budgets'][0]['train_tokens']:,} to {s['statistics']['budgets'][-1]['train_tokens']:,} "
        f"tokens per run{_validation_text(s)}, {len(s['seeds'])} seeds, paired by seed, 95% t-intervals (at each "
        f"budget a difference is claimed only where its interval excludes zero, each interval on its own; "
        f"{_noise_floor(s)}):\n" + "\n".join(lines)
    )


def _validation_text(s: dict) -> str:
    v = s.get("validation")
    if not v:
        return ""
    if v["capped"]:
        return f"; validated on {v['tokens']:,} of {v['tokens_available']:,} held-out tokens (capped)"
    return f"; validated on all {v['tokens']:,} held-out tokens"


def _pooled_text(c: dict) -> str:
    """A rho-pooled comparison in words: what it measures, over how many rho points, its verdict."""
    n = c["rho_points"]
    return f"{c['what']}, mean over {n} rho point{'s' if n != 1 else ''}: {c['text']}"


def _statistics_text(s: dict) -> str:
    """The intervals' verdicts (95%, paired by seed) in sentences; empty for a study.json without them."""
    st = s.get("statistics")
    if not st:
        return ""

    def said(c: dict) -> str:
        if "rho_points" in c:
            return _pooled_text(c)
        return f"{c['what']}: {c['text']}" if "what" in c else c["text"]

    family = st.get("multiplicity") or {"members": []}  # none: merged before the correction
    gate = family.get("gate")
    rows = comparisons(st)
    primary = [c for k, _, c in rows if k in family["members"]]
    secondary = [c for k, _, c in rows if k not in family["members"] and not (gate and k == "dense")]
    text = ""
    if gate:
        text += (
            "\nThe gate, pure MoE against dense at 95% (only if pure MoE is lower is anything about rho or the "
            f"table claimed): {st['dense']['text']}" + ("" if gate["holds"] else f"; {UNFAIR}")
        )
    if primary:
        text += (
            f"\nPrimary comparisons, paired by seed, 95% t-intervals, Holm's correction over the {len(primary)} "
            f"at family-wise {round(100 * family['alpha'])}%:\n" + "\n".join(f"  * {said(c)}" for c in primary)
        )
    n = len(secondary)
    head = (
        f"Secondary, paired by seed, each a 95% t-interval not corrected for multiplicity (of {n} such "
        f"intervals, about {n / 20:.1f} would exclude 0 by chance were there no effect):"
        if primary
        else "Paired by seed, 95% t-intervals:"
    )
    text += f"\n{head}\n" + "\n".join(f"  * {said(c)}" for c in secondary)
    opt = st.get("optimum")
    if opt:
        span = f"[{opt['argmin_low']:.2f}, {opt['argmin_high']:.2f}]"
        verdict = (
            "a minimum inside the grid is claimed" if opt["claims_minimum"] else f"no minimum claimed ({opt['reason']})"
        )
        text += f"\nThe optimum, a quadratic fit in rho: argmin {opt['argmin']:.2f}, 95% bootstrap {span}; {verdict}"
    return text


def _noise_floor(s: dict) -> str:
    """The seed-to-seed standard deviation of a point's validation loss, lowest and highest over the
    points, and where the claims come from."""
    stds = [p["val_loss"]["std"] for p in s["points"] if p["val_loss"].get("std") is not None]
    if len(s["seeds"]) < 2 or not stds:
        return "one seed: no noise floor measured, no interval, no claim"
    return (
        f"noise floor: a point's seed standard deviation is {min(stds):.3f}-{max(stds):.3f} nats; "
        "claims rest only on the 95% intervals and the corrections stated, never on the means"
    )


def _significance(beyond: bool | None) -> str:
    if beyond is None:
        return " (two sizes: no standard error)"
    return " (beyond two standard errors)" if beyond else " (NOT beyond two standard errors)"


def _paired_rows(st: dict | None) -> list[tuple[str, dict, bool]]:
    """The allocation's paired differences as (label, difference, claimed), in reading order
    (`comparisons`), the gate and the primary family marked."""
    if not st:
        return []
    family = st.get("multiplicity") or {"members": [], "gate": None}
    marks = {"dense": " (gate)" if family["gate"] else "", **{k: " (primary)" for k in family["members"]}}
    return [(label + marks.get(key, ""), c["difference"], c["claim"]) for key, label, c in comparisons(st)]


def _plot_paired(ax, rows: list[tuple[str, dict, bool]]) -> None:
    """A forest plot: each paired difference (A - B, nats) with its 95% interval; filled where the
    interval excludes 0 (a claim), hollow where it does not."""
    ys = np.arange(len(rows))[::-1]
    for y, (label, d, claimed) in zip(ys, rows):
        err = None if d.get("low") is None else [[d["mean"] - d["low"]], [d["high"] - d["mean"]]]
        color = "tab:blue" if claimed else "tab:gray"
        ax.errorbar(d["mean"], y, xerr=err, fmt="o", color=color, mfc=color if claimed else "white", capsize=2)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([label for label, _, _ in rows], fontsize=7)
    ax.set_xlabel("paired difference A - B (nats; below 0: A lower), 95% t-interval")
    ax.set_title("paired by seed; filled: claimed (primary: after Holm's correction)", fontsize=9)
    ax.grid(alpha=0.3, axis="x")


def plot_study(summary: dict, path: Path, within: Path | None = None) -> Path | None:
    """allocation: val loss vs rho (every seed, the mean line, pure MoE marked) and, where the study
    has statistics, a forest plot of its paired differences; slots: val loss vs rows (log axis),
    each seed's curve (the slope's interval pairs by seed), each size's mean, the fitted line with
    its interval, and the no-Engram level. Written inside `within` when given."""
    plt = pyplot()
    if plt is None:
        return None
    if summary["study"] == "tokens":
        return plot_token_gaps(summary, path, within=within)
    paired = _paired_rows(summary.get("statistics")) if summary["study"] == "allocation" else []
    if paired:
        fig, (ax, px) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.25, 1]})
        _plot_paired(px, paired)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5 if summary["study"] == "allocation" else 5.2))
    runs, points, f = summary["runs"], summary["points"], summary["finding"]
    if summary["study"] == "allocation":
        mains = [r for r in runs if r.get("control") is None]
        ax.scatter([r["rho"] for r in mains], [r["val_loss"] for r in mains], s=18, alpha=0.6, label="each seed")
        for i, control in enumerate(sorted({p["control"] for p in points if p.get("control")})):
            mine = sorted((p for p in points if p.get("control") == control), key=lambda p: p["rho"])
            marker = "sDv^"[i % 4]
            ax.plot([p["rho"] for p in mine], [p["val_loss"]["mean"] for p in mine], marker + ":", label=control)
        order = sorted((p for p in points if p.get("control") is None), key=lambda p: p["rho"])
        halves = [t_interval(p["val_loss"]["values"]).half_width for p in order]
        ax.errorbar(
            [p["rho"] for p in order],
            [p["val_loss"]["mean"] for p in order],
            yerr=None if None in halves else halves,
            fmt="o-",
            capsize=3,
            label="mean" + ("" if None in halves else ", 95% t-interval"),
        )
        ax.axhline(f["pure_moe_val_loss"], color="gray", ls="--", label="pure MoE (rho = 1)")
        ax.axvspan(0.75, 0.80, color="orange", alpha=0.15, label="paper's optimum")
        ax.set_xlabel("rho: share of the sparse parameters in routed experts (rest: Engram table)")
    else:
        with_table = [r for r in runs if r["table_rows"] > 0]
        for i, seed in enumerate(sorted({r["init_seed"] for r in with_table})):  # the seeds pair along the curve
            mine = sorted((r for r in with_table if r["init_seed"] == seed), key=lambda r: r["table_rows"])
            ax.plot([r["table_rows"] for r in mine], [r["val_loss"] for r in mine], ".-", lw=0.8, alpha=0.5,
                    color="tab:blue", label="each seed" if i == 0 else None)  # fmt: skip
        sizes = sorted((p for p in points if p["table_rows"] > 0), key=lambda p: p["table_rows"])
        ax.plot([p["table_rows"] for p in sizes], [p["val_loss"]["mean"] for p in sizes], "s", color="black",
                label="mean over seeds")  # fmt: skip
        xs = np.logspace(
            math.log10(min(r["table_rows"] for r in with_table)),
            math.log10(max(r["table_rows"] for r in with_table)),
            50,
        )
        ax.plot(
            xs,
            f["intercept"] + f["slope_per_decade"] * np.log10(xs),
            label=_slope_label(f, summary.get("statistics") or {}),
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
    if summary["study"] == "allocation":
        ax.legend(fontsize=8, loc="best")
    else:  # below the axes: the no-Engram level runs across the top
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    return save_figure(fig, path, within=within)
