"""The main job: train a baseline and an Engram LM on the same tokens and compare them.

`run_demo` runs one `DemoConfig`: it builds the tokenizer, trains the iso-FLOP baseline and then the Engram model
on exactly the same batches (for each of ``seeds`` seeds: initialization and batch
order), validates both on the whole held-out split (near-duplicates of training text
removed), splits the validation loss by whether each token's trailing 3-gram occurs in
the training data, prints a side-by-side table (mean +- std over seeds), writes
``summary.json``, the loss curves and the gate heat map as PNGs, and a completion
sampled from the Engram model. Training never repeats data silently: the steps are
capped at ``max_passes`` passes over the training split, loudly. A run shorter than its
learning-rate schedule needs (`min_comparable_steps`: twice the warm-up, at least 20
steps), whether cut by ``--minutes``, ``--steps`` or the pass cap, is reported as "too
short to compare", never as a gap. Everything lands in one output directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from condmem.models import (
    DecoderLM,
    ModelConfig,
    forward_flops_per_token,
    generate,
    iso_flop_baseline,
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
from condmem.train.heldout import DEDUP_THRESHOLD, seen_in_training
from condmem.train.determinism import determinism_record, deterministic_mode, set_cublas_workspace
from condmem.train.loop import MIN_COMPARABLE_STEPS, min_comparable_steps
from condmem.train.pipeline import PreparedData
from condmem.apps.plots import plot_gate_heatmap, plot_loss_curves
from condmem.train.presets import Preset, default_preset_name, get_preset
from condmem.utils.atomic import atomic_write_text

logger = logging.getLogger("condmem.demo")

TOO_SHORT = "too short to compare"
"""The verdict of a run shorter than its schedule needs (`min_comparable_steps`)."""

DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'


def _fmt_m(n: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) > 1 else None)


def _pm(values: list[float], fmt: str) -> str:
    mean, std = mean_std(values)
    return f"{mean:{fmt}}" if std is None else f"{mean:{fmt}} +- {std:{fmt}}"


def _gap(base: float, eng: float) -> float:
    """How much lower Engram's value is, in percent of the baseline's."""
    return 100 * (1 - eng / base)


def format_table(per_seed: list[dict], comparable: bool = True) -> str:
    """The side-by-side table; with several seeds each value is mean +- std over seeds. Not
    `comparable` (a run too short for its schedule): the gap column says so instead of a gap."""
    base0, eng0 = per_seed[0]["baseline"], per_seed[0]["engram"]
    col = {
        label: {k: [r[label][k] for r in per_seed] for k in ("val_loss", "bits_per_byte", "tokens_per_s")}
        for label in ("baseline", "engram")
    }
    gaps = [_gap(r["baseline"]["val_loss"], r["engram"]["val_loss"]) for r in per_seed]
    bpb_gaps = [_gap(r["baseline"]["bits_per_byte"], r["engram"]["bits_per_byte"]) for r in per_seed]
    n = len(per_seed)
    ratio = eng0["flops_per_token"] / base0["flops_per_token"]

    def gap_text(values: list[float]) -> str:
        if not comparable:
            return TOO_SHORT
        mean, std = mean_std(values)
        spread = "" if std is None else f" +- {std:.2f}"
        return f"{abs(mean):.2f}{spread}% {'lower' if mean >= 0 else 'HIGHER'}"

    rows = [
        ("", "baseline", "engram", ""),
        ("parameters (all)", _fmt_m(base0["params"]), _fmt_m(eng0["params"]), ""),
        (
            "  of which Engram tables",
            _fmt_m(base0["table_params"]),
            _fmt_m(eng0["table_params"]),
            f"{eng0['table_rows']:,} rows",
        ),
        (
            "FLOPs / token (train)",
            _fmt_m(base0["flops_per_token"]),
            _fmt_m(eng0["flops_per_token"]),
            f"ratio {ratio:.4f}",
        ),
        (
            "training tokens",
            _fmt_m(base0["train_tokens"]),
            _fmt_m(eng0["train_tokens"]),
            f"{base0['passes']:.2f} passes over the training split",
        ),
        (
            f"val loss (nats/token){'' if n == 1 else f', {n} seeds'}",
            _pm(col["baseline"]["val_loss"], ".4f"),
            _pm(col["engram"]["val_loss"], ".4f"),
            gap_text(gaps),
        ),
        (
            "bits per byte",
            _pm(col["baseline"]["bits_per_byte"], ".4f"),
            _pm(col["engram"]["bits_per_byte"], ".4f"),
            gap_text(bpb_gaps),
        ),
    ]
    for bucket in ("seen", "unseen"):
        b = [r["baseline"]["buckets"][bucket] for r in per_seed]
        e = [r["engram"]["buckets"][bucket] for r in per_seed]
        rows.append(
            (
                f"  val loss, 3-gram {bucket} ({100 * b[0]['fraction']:.0f}% of tokens)",
                _pm([x["loss"] for x in b], ".4f"),
                _pm([x["loss"] for x in e], ".4f"),
                gap_text([_gap(x["loss"], y["loss"]) for x, y in zip(b, e)]),
            )
        )
    tok_s = {label: float(np.mean(col[label]["tokens_per_s"])) for label in ("baseline", "engram")}
    rows.append(
        (
            "tokens / s (train)",
            f"{tok_s['baseline']:,.0f}",
            f"{tok_s['engram']:,.0f}",
            f"ratio {tok_s['engram'] / max(tok_s['baseline'], 1e-9):.3f} (*)",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())
        if i == 0:
            lines.append("-" * len(lines[0].ljust(sum(widths) + 8)))
    lines.append(f"(*) tokens / s: {THROUGHPUT_CAVEAT}")
    return "\n".join(lines)


THROUGHPUT_CAVEAT = "each model timed once, one after the other, on this machine as loaded: not a benchmark"
"""What the demo's tokens/s ratio is: each model's training speed, measured once, in turn."""


def bucket_losses(token_losses: np.ndarray, seen: np.ndarray) -> dict:
    """Mean validation loss over targets whose trailing 3-gram was / was not in training."""
    out = {}
    for name, mask in (("seen", seen), ("unseen", ~seen)):
        values = token_losses[mask]
        out[name] = {
            "tokens": int(mask.sum()),
            "fraction": float(mask.mean()) if len(mask) else 0.0,
            "loss": float(values.astype(np.float64).mean()) if len(values) else float("nan"),
        }
    return out


def plot_summary(summary: dict, path: str | Path, within: str | Path | None = None) -> Path | None:
    """loss_curves.png from a demo summary (every seed's curves, seen/unseen losses), written inside `within`
    when given; None without matplotlib."""
    base, eng, comp = summary["baseline"], summary["engram"], summary["comparison"]
    gap, std = comp["val_loss_gap_pct"], comp.get("val_loss_gap_pct_std")
    n = len(summary["seeds"])
    if comp.get("comparable", True):
        verdict = f"Engram validation loss {-gap:+.2f}%" + (
            f" +- {std:.2f} (mean +- std of {n} seeds)" if std is not None else ""
        )
    else:
        verdict = f"{TOO_SHORT.capitalize()}: {comp['steps']} steps < {comp['min_steps']} ({comp['rule']})"
    title = (
        f"baseline vs Engram on {summary['corpus_description']}: {_fmt_m(eng['train_tokens'])} training tokens "
        f"each ({base['passes']:.2f} passes), FLOPs/token ratio {comp['flops_per_token_ratio']:.3f}\n"
        f"{verdict} over all {eng['val_tokens']:,} deduplicated validation tokens"
    )
    buckets = {label: [r[label]["buckets"] for r in summary["seeds"]] for label in ("baseline", "engram")}
    return plot_loss_curves(summary["curves"], path, title=title, buckets=buckets, within=within)


def gate_sample(model: DecoderLM, data: PreparedData, device: torch.device, n_tokens: int = 160) -> dict:
    """Gate values of every Engram layer over a piece of validation code (from its first def/class)."""
    text = None
    for doc in data.val_docs:
        for marker in ("\ndef ", "\nclass ", "\n    def "):
            at = doc.text.find(marker)
            if at >= 0:
                text = doc.text[at + 1 :]
                break
        if text:
            break
    text = text or data.val_docs[0].text
    ids = data.tokenizer.encode(text, add_special_tokens=False).ids[: min(n_tokens, model.cfg.max_seq_len)]
    x = torch.tensor([ids], device=device)
    gates = model.gate_values(x)
    pieces = [data.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {
        "tokens": ids,
        "pieces": pieces,
        "gates": {str(lid): g[0].float().cpu().tolist() for lid, g in gates.items()},
    }


@dataclass
class StepPlan:
    """How many steps each model trains, decided once before the first model."""

    max_steps: int
    """The step cap: the requested steps, or the --minutes probe's upper bound, capped at max_passes."""
    passes: dict
    """`cap_steps`'s record (requested, capped, passes)."""
    budget_s: float | None
    """Seconds left for training with --minutes, else None."""
    min_steps: int
    """The fewest steps whose comparison is reported (`min_comparable_steps` of the preset's warm-up)."""
    warmup_steps: int
    """The preset's warm-up steps (before any cap to a short run)."""

    @property
    def rule(self) -> str:
        """The minimum in words, for the summary and the messages."""
        return schedule_rule(self.warmup_steps)


@dataclass
class DemoConfig:
    """One `condmem demo` run: the preset and the values replaced in it, the seeds, the output."""

    out: str | Path = "condmem-demo"
    """Output directory: summary.json, figures, samples, checkpoints."""
    preset: Literal["cpu", "gpu", "tiny"] | None = None
    """Sizes of both models and their training (None: ``gpu`` with CUDA, else ``cpu``)."""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Preset values replaced, by section (``{"train": {"steps": 6}, "data": {"corpus": "stdlib"}}``;
    `Preset.override`). ``train.steps`` given: the steps asked for (still capped at ``max_passes``)."""
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda, cuda:N."""
    seeds: int = 1
    """Train each model with seeds ``seed .. seed+seeds-1`` (initialization and batch order; the data,
    split and tokenizer come from `seed`)."""
    seed: int = 0
    """First seed; also seeds the data preparation."""
    minutes: float | None = None
    """Wall-clock budget of the whole demo: the baseline's step count is sized to it."""
    max_passes: float = 1.0
    """Cap the steps at this many passes over the training split."""
    dedup_threshold: float | None = DEDUP_THRESHOLD
    """Drop validation documents sharing more than this fraction of their 13-token n-grams with the
    training split (None: keep all)."""
    tokenizer: str | None = None
    """A tokenizer.json, its directory or ``deepseek-v4`` instead of training a BPE."""
    prompt: str = DEFAULT_PROMPT
    """Prompt of the sampled completions."""
    max_new_tokens: int = 96
    """Tokens of each sampled completion."""
    deterministic: bool = False
    """Deterministic kernels while training (`condmem.train.determinism`): the same config gives
    bit-identical losses on one machine type."""
    progress: bool = True
    """A progress bar per model."""
    use_cache: bool = True
    """Read and write the tokenizer and token caches."""
    checkpoint: bool = True
    """Write both models' checkpoints to ``out``."""

    def __post_init__(self) -> None:
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"--seeds must be a positive integer, got {self.seeds!r}")
        if not self.max_passes > 0:
            raise ValueError(f"--max-passes must be positive, got {self.max_passes!r}")

    @property
    def steps(self) -> int | None:
        """The training steps asked for (``train.steps`` of `overrides`), None: the preset's."""
        return (self.overrides.get("train") or {}).get("steps")


def run_demo(config: DemoConfig) -> dict:
    """Train baseline and Engram on the same tokens for ``config.seeds`` seeds, compare, plot, generate.

    Returns the summary written to ``summary.json``.
    """
    c = config
    wall = time.perf_counter()
    set_cublas_workspace(c.deterministic)  # before anything starts cuBLAS
    dev = resolve_device(c.device)
    p = get_preset(c.preset or default_preset_name(dev.type), c.overrides)
    out = _open_output(c.out, p, dev, c.seeds, c.seed)
    data, src, seen = _prepare_data(p, out, c.tokenizer, c.seed, c.use_cache, c.dedup_threshold)
    eng_cfg = build_model_config(p, data)
    cfgs = {"baseline": iso_flop_baseline(eng_cfg), "engram": eng_cfg}
    plan = plan_steps(p, data, steps=c.steps, minutes=c.minutes, max_passes=c.max_passes, wall=wall)
    with deterministic_mode(c.deterministic):
        summary, engram_model = _train_and_compare(
            p,
            data,
            dev,
            cfgs,
            plan,
            out,
            seeds=c.seeds,
            seed=c.seed,
            seen=seen,
            src=src,
            max_passes=c.max_passes,
            prompt=c.prompt,
            max_new_tokens=c.max_new_tokens,
            checkpoint=c.checkpoint,
            progress=c.progress,
        )
    summary["determinism"] = determinism_record(c.deterministic)
    _write_outputs(summary, engram_model, data, dev, out, wall, c.checkpoint)
    return summary


def _open_output(out: str | Path, p: Preset, dev: torch.device, seeds: int, seed: int) -> Path:
    """Create the output directory, seed torch and say what the demo runs; returns the directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    print(
        f"condmem demo: preset {p.name!r} on {dev}, {seeds} seed{'s' if seeds > 1 else ''}; output in {out}/",
        flush=True,
    )
    return out


def _prepare_data(
    p: Preset, out: Path, tokenizer: str | None, seed: int, use_cache: bool, dedup_threshold: float | None
) -> tuple[PreparedData, str, np.ndarray]:
    """The tokenized corpus (its tokenizer saved to `out`), its description, and which validation
    tokens' trailing 3-gram occurs in the training split."""
    data = prepare(p, tokenizer=tokenizer, seed=seed, use_cache=use_cache, dedup_threshold=dedup_threshold)
    src = describe_data(data)
    data.tokenizer.save(str(out / "tokenizer.json"))
    seen = seen_in_training(
        data.train.tokens, data.val.tokens, data.info["tokenizer"]["vocab_size"], pad_id=data.eos_id
    )
    print(f"validation tokens whose trailing 3-gram occurs in the training split: {100 * seen.mean():.1f}%", flush=True)
    return data, src, seen


def _train_and_compare(
    p: Preset,
    data: PreparedData,
    dev: torch.device,
    cfgs: dict[str, ModelConfig],
    plan: StepPlan,
    out: Path,
    *,
    seeds: int,
    seed: int,
    seen: np.ndarray,
    src: str,
    max_passes: float,
    prompt: str,
    max_new_tokens: int,
    checkpoint: bool,
    progress: bool,
) -> tuple[dict, DecoderLM]:
    """Train both models for every seed, print the comparison, sample both; returns the summary
    (without figures and wall time) and the first seed's Engram model."""
    per_seed, curves, configs, models = train_pairs(
        p,
        data,
        dev,
        cfgs,
        plan,
        seeds=seeds,
        seed=seed,
        seen=seen,
        run_root=out if checkpoint else None,
        progress=progress,
    )
    table = report_comparison(per_seed, max_passes, plan)
    samples = write_samples(models, data, out, prompt=prompt, max_new_tokens=max_new_tokens, seed=seed)
    summary = demo_summary(
        per_seed,
        plan,
        p,
        data,
        dev,
        seed=seed,
        seen=seen,
        src=src,
        curves=curves,
        configs=configs,
        table=table,
        samples=samples,
        prompt=prompt,
    )
    return summary, models["engram"]


def _write_outputs(
    summary: dict,
    engram_model: DecoderLM,
    data: PreparedData,
    dev: torch.device,
    out: Path,
    wall: float,
    checkpoint: bool,
) -> None:
    """The figures and summary.json (with the wall time since `wall`), and the closing line."""
    write_figures(summary, engram_model, data, dev, out)
    summary["wall_seconds"] = time.perf_counter() - wall
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n", within=out)
    figures = summary["figures"]
    print(
        f"\nresult: {summary['comparison']['verdict']}; wrote {out}/summary.json, "
        f"{', '.join(figures.values()) or 'no figures (matplotlib missing)'}, "
        f"sample.txt, gates.json{f'; checkpoints in {out}/engram and {out}/baseline' if checkpoint else ''} "
        f"({summary['wall_seconds']:.0f} s in all)",
        flush=True,
    )


def describe_data(data: PreparedData) -> str:
    """Print what was read, the tokenizer and the validation split; returns a short corpus description."""
    c = data.info["corpus"]
    if "python_version" in c:
        src = f"Python {c['python_version']} standard library" + (" and installed packages" if "site_dirs" in c else "")
    else:
        src = ", ".join(Path(x).name or x for x in c["sources"])
    print(
        f"corpus: {src}: {c['n_documents']:,} documents, {c['n_bytes']:,} bytes, sha256 {c['sha256'][:16]}...",
        flush=True,
    )
    t = data.info["tokenizer"]
    v = data.info["validation"]
    print(
        f"tokenizer: {t['source']}: {t['vocab_size']:,} ids -> compressed V'={t['compressed_vocab_size']:,}; "
        f"train split {data.info['train_tokens_available']:,} tokens",
        flush=True,
    )
    print(
        f"validation: {v['documents']:,} document{'s' if v['documents'] != 1 else ''}, {v['tokens']:,} tokens, all "
        f"of them evaluated; {v['removed_documents']} near-duplicate document"
        f"{'s' if v['removed_documents'] != 1 else ''} ({v['removed_tokens']:,} tokens) removed "
        f"(> {v['dedup_threshold']} of their {v['dedup_ngram']}-token n-grams in the training split)"
        + (
            f": {', '.join(r['name'] for r in v['removed'][:5])}{' ...' if len(v['removed']) > 5 else ''}"
            if v["removed"]
            else ""
        ),
        flush=True,
    )
    return src


def plan_steps(
    p: Preset, data: PreparedData, *, steps: int | None, minutes: float | None, max_passes: float, wall: float
) -> StepPlan:
    """The step cap of every run: the preset's (or --steps), or what --minutes leaves; at most max_passes passes."""
    tc = p.train
    budget_s = None
    if minutes is not None:
        # The demo's whole budget: what data preparation used is gone; the first baseline
        # sizes the step count, every other run takes the same steps at a similar cost.
        budget_s = minutes * 60 - (time.perf_counter() - wall)
        if budget_s <= 0:
            raise ValueError(f"--minutes {minutes}: data preparation alone took longer")
    requested = tc.steps if budget_s is None or steps is not None else 10**9
    min_steps = min_comparable_steps(tc.warmup_steps)
    max_steps, passes = cap_steps(requested, data.train, tc.batch_size, tc.seq_len, max_passes)
    if budget_s is not None:
        print(
            f"steps: sized to the --minutes budget, at most {max_steps:,} ({max_passes:g} passes over the "
            f"{len(data.train):,}-token training split); a comparison needs at least {min_steps:,} "
            f"({schedule_rule(tc.warmup_steps)})",
            flush=True,
        )
    elif passes["capped"]:
        print(
            banner(
                f"WARNING: {requested:,} steps x {tc.batch_size * tc.seq_len:,} tokens would make "
                f"{passes['requested_passes']:.1f} passes over the {len(data.train):,}-token training split.\n"
                f"Capped at {max_steps:,} steps ({passes['passes']:.2f} passes, --max-passes {max_passes:g}): "
                "a model that sees its data again memorizes it,\nand Engram's tables memorize fastest. "
                "Pass a larger --corpus, or --max-passes to allow repeats."
            ),
            flush=True,
        )
    if budget_s is None and max_steps < min_steps:
        print(
            banner(
                f"WARNING: {max_steps:,} steps are fewer than a comparison needs: "
                f"{min_steps:,} ({schedule_rule(tc.warmup_steps)}).\n"
                f"The models train and are validated, and the result is reported as {TOO_SHORT!r}, not as a gap."
            ),
            flush=True,
        )
    return StepPlan(max_steps, passes, budget_s, min_steps, tc.warmup_steps)


def schedule_rule(warmup_steps: int) -> str:
    """`min_comparable_steps` in words."""
    return f"steps >= max(2 x the {warmup_steps}-step warm-up, {MIN_COMPARABLE_STEPS})"


def train_pairs(
    p: Preset,
    data: PreparedData,
    dev: torch.device,
    cfgs: dict[str, ModelConfig],
    plan: StepPlan,
    *,
    seeds: int,
    seed: int,
    seen: np.ndarray,
    run_root: Path | None,
    progress: bool,
):
    """Both models for every seed, on the same steps.

    Returns (per-seed results, curves, configs, the first seed's models)."""
    per_seed: list[dict] = []
    curves: dict[str, list[dict]] = {label: [] for label in cfgs}
    configs: dict[str, dict] = {}
    models: dict[str, DecoderLM] = {}
    for k in range(seeds):
        run_seed = seed + k
        results: dict[str, dict] = {}
        for label, cfg in cfgs.items():
            # Every run after the first takes the first baseline's steps (fixed by --minutes, if given).
            first = per_seed[0]["baseline"] if per_seed else results.get("baseline")
            steps = first["steps"] if first is not None else plan.max_steps
            budget = plan.budget_s * 0.44 / seeds / 60 if first is None and plan.budget_s is not None else None
            tc = dataclasses.replace(
                p.train,
                seed=run_seed,
                steps=steps,
                max_minutes=budget,
                warmup_steps=min(p.train.warmup_steps, max(0, steps - 1)),
            )
            model = build_model(cfg, data, seed=run_seed, device=dev)
            trainer = build_trainer(
                model,
                tc,
                data,
                dev,
                run_dir=run_root / label if run_root and k == 0 else None,
                label=label if seeds == 1 else f"{label} seed {run_seed}",
                progress=progress,
            )
            results[label] = _fit(trainer, model, cfg, data, seen, run_seed)
            if first is None and budget is not None:
                _warn_if_budget_too_short(results[label], plan, seeds)
            curves[label].append({"seed": run_seed, "history": trainer.history, "evals": trainer.evals})
            configs[label] = {"model": cfg.to_dict(), "train": tc.to_dict()}
            if k == 0:
                models[label] = model
            else:
                del model, trainer
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        # A run too short for its schedule has no gap: its losses are measured, never compared.
        comparable = results["baseline"]["steps"] >= plan.min_steps
        results["val_loss_gap_pct"] = (
            _gap(results["baseline"]["val_loss"], results["engram"]["val_loss"]) if comparable else None
        )
        results["bits_per_byte_gap_pct"] = (
            _gap(results["baseline"]["bits_per_byte"], results["engram"]["bits_per_byte"]) if comparable else None
        )
        per_seed.append(results)
        if seeds > 1:
            gap = f"{results['val_loss_gap_pct']:+.2f}% lower" if comparable else TOO_SHORT
            print(
                f"seed {run_seed}: Engram val loss {gap} "
                f"({results['baseline']['val_loss']:.4f} -> {results['engram']['val_loss']:.4f})",
                flush=True,
            )
    return per_seed, curves, configs, models


def _warn_if_budget_too_short(first: dict, plan: StepPlan, seeds: int) -> None:
    """Once the --minutes budget has fixed the step count (the first baseline): if it is below what a
    comparison needs, say so before the other runs, with about the budget that would do."""
    if first["steps"] >= plan.min_steps:
        return
    step_s = first["train_tokens"] / max(1, first["steps"]) / max(first["tokens_per_s"], 1e-9)
    # The first baseline gets 44% of the budget, split over the seeds, and keeps 5% for validation.
    needed_min = plan.min_steps * step_s * seeds / 0.44 / 0.95 / 60
    print(
        banner(
            f"WARNING: the --minutes budget allows {first['steps']:,} steps at {step_s:.2f} s a step; a comparison "
            f"needs {plan.min_steps:,} ({plan.rule}).\nBoth models still train and are validated; the result "
            f"will be reported as {TOO_SHORT!r}. On this machine, about --minutes {max(1, math.ceil(needed_min))} "
            "or more would compare them."
        ),
        flush=True,
    )


def _fit(trainer, model: DecoderLM, cfg: ModelConfig, data: PreparedData, seen: np.ndarray, run_seed: int) -> dict:
    """Train one model; its summary with parameters, FLOPs, passes and the seen/unseen 3-gram losses."""
    tc = trainer.cfg
    counts = model.param_counts()
    print(
        f"[{trainer.label}] {counts['total']:,} parameters ({counts['tables']:,} in Engram tables), "
        f"{train_flops_per_token(cfg, tc.seq_len) / 1e6:,.2f} MFLOPs/token; "
        f"{tc.steps if tc.max_minutes is None else 'budgeted'} steps x {tc.batch_size * tc.seq_len:,} "
        "tokens",
        flush=True,
    )
    summary = trainer.fit(token_losses=True)
    summary.update(
        seed=run_seed,
        params=counts["total"],
        backbone_params=counts["backbone"],
        table_params=counts["tables"],
        table_rows=sum(model.layout.num_embeddings) if model.layout is not None else 0,
        flops_per_token=train_flops_per_token(cfg, tc.seq_len),
        forward_flops=forward_flops_per_token(cfg, tc.seq_len),
        passes=data.train.passes(trainer.step, tc.batch_size, tc.seq_len),
        buckets=bucket_losses(trainer.token_losses, seen),
        checkpoint=str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
    )
    return summary


def report_comparison(per_seed: list[dict], max_passes: float, plan: StepPlan) -> str:
    """Print the side-by-side table and the verdict (or that the run is too short to compare); returns the table."""
    base, eng = per_seed[0]["baseline"], per_seed[0]["engram"]
    comparable = base["steps"] >= plan.min_steps
    table = format_table(per_seed, comparable=comparable)
    print("\n" + table + "\n", flush=True)
    if comparable:
        gap_mean, gap_std = mean_std([r["val_loss_gap_pct"] for r in per_seed])
        verdict = "lower" if gap_mean > 0 else "NOT lower"
        spread = f" (mean of {len(per_seed)} seeds, std {gap_std:.2f} points)" if gap_std is not None else ""
        head = f"Engram validation loss is {abs(gap_mean):.2f}% {verdict} than the baseline's{spread} at the same"
    else:
        head = (
            f"Engram validation loss: {TOO_SHORT}: {base['steps']:,} steps, fewer than the {plan.min_steps:,} "
            f"its schedule needs ({plan.rule}), at the same"
        )
    print(
        f"{head} {eng['train_tokens']:,} training tokens ({base['passes']:.2f} passes over the training split; "
        f"FLOPs/token ratio {eng['flops_per_token'] / base['flops_per_token']:.4f}), over all "
        f"{eng['val_tokens']:,} deduplicated validation tokens.",
        flush=True,
    )
    if base["passes"] > 1:
        print(
            banner(
                f"NOTE: each model saw its training data {base['passes']:.2f} times "
                f"(--max-passes {max_passes:g}); the comparison measures memorization as much as modelling."
            ),
            flush=True,
        )
    return table


def write_samples(
    models: dict[str, DecoderLM], data: PreparedData, out: Path, *, prompt: str, max_new_tokens: int, seed: int
) -> dict[str, str]:
    """A completion of `prompt` from each model (printed for Engram, all in sample.txt)."""
    prompt_ids = data.tokenizer.encode(prompt, add_special_tokens=False).ids
    samples = {}
    for label in ("engram", "baseline"):
        new = generate(
            models[label],
            torch.tensor(prompt_ids),
            max_new_tokens,
            temperature=0.8,
            top_k=40,
            seed=seed,
            stop_ids=(data.eos_id,),
        )
        samples[label] = data.tokenizer.decode(new.tolist(), skip_special_tokens=True)
    rule = "-" * 60
    print(f"\nprompt + Engram completion:\n{rule}\n{prompt}{samples['engram']}\n{rule}", flush=True)
    atomic_write_text(
        out / "sample.txt",
        f"# prompt\n{prompt}\n# engram completion\n{samples['engram']}\n# baseline completion\n{samples['baseline']}\n",
        within=out,
    )
    return samples


def demo_summary(
    per_seed: list[dict],
    plan: StepPlan,
    p: Preset,
    data: PreparedData,
    dev: torch.device,
    *,
    seed: int,
    seen: np.ndarray,
    src: str,
    curves: dict,
    configs: dict,
    table: str,
    samples: dict,
    prompt: str,
) -> dict:
    """What summary.json holds (figures and wall time are added after)."""
    base, eng = per_seed[0]["baseline"], per_seed[0]["engram"]
    plan.passes.update(steps=base["steps"], passes=base["passes"])
    comparable = base["steps"] >= plan.min_steps
    gap_mean, gap_std = mean_std([r["val_loss_gap_pct"] for r in per_seed]) if comparable else (None, None)
    bpb_mean, bpb_std = mean_std([r["bits_per_byte_gap_pct"] for r in per_seed]) if comparable else (None, None)
    verdict = TOO_SHORT if not comparable else ("lower" if gap_mean > 0 else "not lower")

    def spread_of(label: str, key: str) -> dict:
        values = [r[label][key] for r in per_seed]
        mean, std = mean_std(values)
        return {"mean": mean, "std": std, "values": values}

    return {
        "corpus_description": src,
        "baseline": base,
        "engram": eng,
        "seeds": per_seed,
        "comparison": {
            "verdict": verdict,
            "comparable": comparable,
            "steps": base["steps"],
            "min_steps": plan.min_steps,
            "rule": plan.rule,
            "seeds": [seed + k for k in range(len(per_seed))],
            "val_loss_gap_pct": gap_mean,
            "val_loss_gap_pct_std": gap_std,
            "bits_per_byte_gap_pct": bpb_mean,
            "bits_per_byte_gap_pct_std": bpb_std,
            "val_loss": {label: spread_of(label, "val_loss") for label in ("baseline", "engram")},
            "bits_per_byte": {label: spread_of(label, "bits_per_byte") for label in ("baseline", "engram")},
            "flops_per_token_ratio": eng["flops_per_token"] / base["flops_per_token"],
            "tokens_per_s_ratio": eng["tokens_per_s"] / max(base["tokens_per_s"], 1e-9),
            "tokens_per_s_ratio_note": THROUGHPUT_CAVEAT,
            "same_tokens": eng["train_tokens"] == base["train_tokens"],
            "val_tokens": eng["val_tokens"],
            "seen_3gram_fraction": float(seen.mean()),
        },
        "passes": plan.passes,
        "preset": p.name,
        "config": {
            "baseline": configs["baseline"]["model"],
            "engram": configs["engram"]["model"],
            "train": configs["engram"]["train"],
            "preset": p.to_dict(),
        },
        "data": data.info,
        "machine": machine_info(dev),
        "figures": {},
        "sample": {"prompt": prompt, "engram": samples["engram"], "baseline": samples["baseline"]},
        "curves": curves,
        "table": table,
    }


def write_figures(summary: dict, engram_model: DecoderLM, data: PreparedData, dev: torch.device, out: Path) -> None:
    """loss_curves.png, gates.json and gates.png; their names go into ``summary["figures"]``."""
    figures = summary["figures"]
    fig = plot_summary(summary, out / "loss_curves.png", within=out)
    if fig:
        figures["loss_curves"] = fig.name
    gates = gate_sample(engram_model, data, dev)
    atomic_write_text(out / "gates.json", json.dumps(gates) + "\n", within=out)
    first = next(iter(gates["gates"]))
    fig = plot_gate_heatmap(
        gates["pieces"],
        np.array([gates["gates"][k] for k in gates["gates"]]),
        out / "gates.png",
        title=f"Engram gate (layer {first}) per token over validation code; darker = more memory",
        within=out,
    )
    if fig:
        figures["gates"] = fig.name
