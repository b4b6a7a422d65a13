"""Figures of the demo (both models' loss curves, the Engram gate over validation text) and of
`condmem study` (every run's loss curve, every run's router load per expert, and the token sweep's
gaps against training tokens: one figure each per sweep).

matplotlib is optional: without it the functions log a warning and return None (the
numbers are in summary.json and gates.json either way).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from condmem.utils.plotting import pyplot as _pyplot
from condmem.utils.plotting import save_figure

logger = logging.getLogger("condmem.apps.plots")


def _ema(values: Sequence[float], alpha: float) -> np.ndarray:
    out = np.empty(len(values))
    acc = values[0] if len(values) else 0.0
    for i, v in enumerate(values):
        acc = alpha * acc + (1 - alpha) * v if i else v
        out[i] = acc
    return out


def _runs_of(value) -> list[dict]:
    return value if isinstance(value, list) else [value]


def plot_loss_curves(
    runs: dict[str, list[dict] | dict],
    path: str | Path,
    title: str = "",
    buckets: dict[str, list[dict]] | None = None,
    within: str | Path | None = None,
) -> Path | None:
    """Every seed's training loss (smoothed) and validation loss against training tokens;
    with `buckets`, a second panel of validation loss on seen / unseen 3-grams.

    Args:
        runs: label -> one run or a list of runs (one per seed), each
            {"history": [{"tokens", "loss"}...], "evals": [{"train_tokens", "val_loss", "full"}...]}.
            Evaluations on the fixed subset draw the curve; the whole-split one is a star.
        buckets: label -> per seed {"seen": {"loss", "fraction"}, "unseen": {...}}.
        within: the folder the figure must be written inside (a run's output folder).
    """
    plt = _pyplot()
    if plt is None:
        return None
    if buckets:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120, gridspec_kw={"width_ratios": [2.2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colors = {"baseline": "#4c72b0", "engram": "#dd8452"}
    lows, highs = [], []
    for label, value in runs.items():
        runs_of_label = _runs_of(value)
        for i, run in enumerate(runs_of_label):
            _plot_run(ax, run, label, colors.get(label), first=i == 0, seeds=len(runs_of_label), lows=lows, highs=highs)
    _frame_losses(ax, lows, highs)
    if buckets:
        _plot_buckets(bx, buckets, colors)
    fig.suptitle(title or "baseline vs Engram (same tokens, matched FLOPs/token)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, within=within)


def _plot_run(ax, run: dict, label: str, color, *, first: bool, seeds: int, lows: list, highs: list) -> None:
    """One run's smoothed training loss, validation curve and whole-split star on `ax` (labelled
    in the legend for the `first` run of `label`); adds the losses that frame the plot to `lows`
    and `highs`."""
    seed_note = f" (seed {run['seed']})" if "seed" in run and seeds > 1 else ""
    hist = run.get("history", [])
    if hist:
        tokens = np.array([h["tokens"] for h in hist], dtype=float)
        loss = np.array([h["loss"] for h in hist], dtype=float)
        smooth = _ema(loss, 0.9 if len(loss) < 2000 else 0.98)
        ax.plot(
            tokens / 1e6,
            smooth,
            color=color,
            linewidth=1.2,
            alpha=0.85,
            label=f"{label} train (EMA)" if first else None,
        )
        lows.append(smooth.min())
        highs.append(smooth[min(len(smooth) - 1, len(smooth) // 6)])
    evals = run.get("evals", [])
    curve = [e for e in evals if not e.get("full")]
    if curve:
        ax.plot(
            [e["train_tokens"] / 1e6 for e in curve],
            [e["val_loss"] for e in curve],
            "o--",
            color=color,
            markersize=3.5,
            linewidth=0.9,
            alpha=0.85,
            label=f"{label} validation (fixed subset)" if first else None,
        )
    final = [e for e in evals if e.get("full")]
    if final:
        ax.plot(
            [e["train_tokens"] / 1e6 for e in final],
            [e["val_loss"] for e in final],
            "*",
            color=color,
            markersize=10,
            markeredgecolor="black",
            markeredgewidth=0.5,
            label=f"{label} validation (whole split){seed_note and ', every seed'}" if first else None,
        )
    lows.extend(e["val_loss"] for e in evals)


def _frame_losses(ax, lows: list, highs: list) -> None:
    """Axis labels, grid and legend; the y range frames the second half of training, where the gap
    shows (the early drop is off the top)."""
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats / token)")
    if lows and highs:
        lo, hi = min(lows), max(max(highs), max(lows))
        if hi > lo:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.02 * (hi - lo))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_buckets(bx, buckets: dict[str, list[dict]], colors: dict[str, str]) -> None:
    """Bars of validation loss on seen / unseen 3-grams per label (mean, std over seeds)."""
    names = ["seen", "unseen"]
    x = np.arange(len(names))
    width = 0.38
    for j, (label, per_seed) in enumerate(buckets.items()):
        values = np.array([[b[n]["loss"] for n in names] for b in per_seed])
        mean = values.mean(axis=0)
        err = values.std(axis=0, ddof=1) if len(values) > 1 else None
        bx.bar(x + (j - 0.5) * width, mean, width, yerr=err, capsize=3, color=colors.get(label), label=label)
        for k in range(len(names)):
            bx.text(x[k] + (j - 0.5) * width, mean[k], f"{mean[k]:.2f}", ha="center", va="bottom", fontsize=7)
    first = next(iter(buckets.values()))[0]
    bx.set_xticks(
        x, [f"3-gram {n} in training\n({100 * first[n]['fraction']:.0f}% of tokens)" for n in names], fontsize=8
    )
    bx.set_ylabel("validation loss (nats / token)")
    bx.set_title("where the difference comes from", fontsize=9)
    bx.grid(alpha=0.3, axis="y")
    bx.legend(fontsize=8)


def _display(piece: str) -> str:
    return piece.replace("\t", "→").replace("\r", "")


def plot_gate_heatmap(
    pieces: Sequence[str],
    gates: np.ndarray,
    path: str | Path,
    title: str = "",
    max_cols: int = 80,
    within: str | Path | None = None,
) -> Path | None:
    """Validation text with each token's background coloured by its Engram gate value.

    Args:
        pieces: the text of each token (decoded), in order.
        gates: [n_layers, n_tokens] gate values in (0, 1), one row per Engram layer (the
            first row colours the text; every row is summarised in the colour bar title).
            The colour scale is the gate's whole range, 0 to 1 (an untrained gate near 0.5
            looks uniform, as it is); the colour bar's label states the values' own range.
        within: the folder the figure must be written inside (a run's output folder).
    """
    plt = _pyplot()
    if plt is None:
        return None
    from matplotlib import cm, colors as mcolors

    gates = np.atleast_2d(np.asarray(gates, dtype=float))
    values = gates[0]
    # Lay the tokens out like the text: a newline token ends its line.
    placed = []  # (line, col, width, text, value)
    line, col = 0, 0
    for piece, value in zip(pieces, values):
        # A newline shows as a marker at the end of its line, then the text breaks.
        parts = piece.replace("\n", "⏎\n").split("\n")
        for k, part in enumerate(parts):
            text = _display(part)
            if k > 0:
                line, col = line + 1, 0
            width = len(text)
            if col + width > max_cols and col > 0:
                line, col = line + 1, 0
            if width:
                placed.append((line, col, width, text, value))
                col += width
    n_lines = line + 1
    lo, hi = float(values.min()), float(values.max())
    norm = mcolors.Normalize(vmin=0.0, vmax=1.0)
    cmap = plt.get_cmap("Reds")
    # Cells are sized to the monospace font so that the text fills its coloured box.
    fontsize = 8.0
    char_w, line_h = 0.6 * fontsize / 72 * 1.02, 1.45 * fontsize / 72  # inches
    text_w, text_h = max_cols * char_w, n_lines * line_h
    margin_l, margin_r, margin_t, margin_b = 0.2, 1.1, 0.45, 0.15
    fig = plt.figure(figsize=(text_w + margin_l + margin_r, text_h + margin_t + margin_b), dpi=150)
    fw, fh = fig.get_size_inches()
    ax = fig.add_axes([margin_l / fw, margin_b / fh, text_w / fw, text_h / fh])
    ax.set_xlim(0, max_cols)
    ax.set_ylim(n_lines, 0)
    ax.axis("off")
    for ln, c, w, text, value in placed:
        ax.add_patch(
            plt.Rectangle((c, ln + 0.04), w, 0.92, facecolor=cmap(norm(value)), edgecolor="white", linewidth=0.4)
        )
        ax.text(
            c,
            ln + 0.5,
            text,
            fontsize=fontsize,
            family="monospace",
            va="center",
            ha="left",
            color="white" if norm(value) > 0.65 else "black",
        )
    cax = fig.add_axes([(margin_l + text_w + 0.25) / fw, margin_b / fh, 0.15 / fw, text_h / fh])
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    cbar = fig.colorbar(sm, cax=cax)
    cbar.set_label(f"gate (this text: {lo:.3f} to {hi:.3f})", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    fig.suptitle(
        title or "Engram gate per token over validation text (darker = more memory used)",
        fontsize=9,
        x=margin_l / fw,
        ha="left",
        y=1 - 0.12 / fh,
        va="top",
    )
    return save_figure(fig, path, within=within)


def plot_sweep_curves(summary: dict, path: str | Path, within: str | Path | None = None) -> Path | None:
    """Every run of a `condmem study` sweep on one figure: its training loss (smoothed) against training
    tokens, its final validation loss a marker at the end; one colour per point, one line per seed."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(dict.fromkeys(r["label"] for r in summary["runs"]))
    colors = {label: plt.cm.viridis(i / max(1, len(labels) - 1)) for i, label in enumerate(labels)}
    shown: set[str] = set()
    lows, highs = [], []
    for run in summary["runs"]:
        losses = run.get("train_losses") or []
        if not losses:
            continue
        per_step = run["train_tokens"] / max(1, run["steps"])
        tokens = per_step * np.arange(1, len(losses) + 1)
        smooth = _ema(losses, 0.9)
        color, label = colors[run["label"]], run["label"]
        dashed = run.get("control") is not None
        ax.plot(tokens, smooth, color=color, lw=1, ls="--" if dashed else "-", label=None if label in shown else label)
        ax.scatter([tokens[-1]], [run["val_loss"]], color=color, marker="*", s=40, zorder=3)
        shown.add(label)
        tail = smooth[len(smooth) // 5 :]
        lows.append(min(float(np.min(tail)), run["val_loss"]))
        highs.append(max(float(np.max(tail)), run["val_loss"]))
    if lows:
        pad = 0.1 * (max(highs) - min(lows) or 1.0)
        ax.set_ylim(min(lows) - pad, max(highs) + pad)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats / token): training, smoothed; star: final validation")
    ax.set_title(f"condmem study {summary['study']} ({summary['preset']}): every run", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path, within=within)


def plot_router_load(summary: dict, path: str | Path, within: str | Path | None = None) -> Path | None:
    """Every run's router load per expert (from its stored router statistics): one line per (run, MoE
    layer), each expert's load over the mean load, experts sorted from busiest, against the expert's
    rank as a share of the layer's experts (so layers of different expert counts share an axis); 1 is
    uniform routing. None when no run has router statistics (or without matplotlib)."""
    lines = []
    for run in summary["runs"]:
        for layer in ((run.get("router") or {}).get("layers") or {}).values():
            load = layer.get("load")
            if load and layer.get("load_mean"):
                lines.append((run, sorted((v / layer["load_mean"] for v in load), reverse=True)))
    if not lines:
        return None
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(dict.fromkeys(run["label"] for run, _ in lines))
    colors = {label: plt.cm.viridis(i / max(1, len(labels) - 1)) for i, label in enumerate(labels)}
    shown: set[str] = set()
    for run, rel in lines:
        x = (np.arange(len(rel)) + 0.5) / len(rel)
        label = run["label"]
        ax.plot(x, rel, color=colors[label], lw=0.8, alpha=0.7, label=None if label in shown else label)
        shown.add(label)
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="uniform")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("expert rank (busiest first), as a share of the layer's experts")
    ax.set_ylabel("load / mean load (last quarter of training)")
    ax.set_title(
        f"condmem study {summary['study']} ({summary['preset']}): router load per expert, every run and MoE layer",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path, within=within)


def plot_token_gaps(summary: dict, path: str | Path, within: str | Path | None = None) -> Path | None:
    """The token sweep: each rho's paired difference to pure MoE (solid) and the table's own effect
    against its no-table control (dashed), mean over seeds with 95% t-interval bars, against training
    tokens on a log axis (the top axis: tokens per active parameter of pure MoE); the legend gives each
    line's slope per decade of tokens with its 95% interval over seeds (`token_trend`)."""
    plt = _pyplot()
    if plt is None:
        return None
    budgets = summary["statistics"]["budgets"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    rhos = sorted({rho for b in budgets for rho in b["vs_pure_moe"]}, reverse=True)
    for i, rho in enumerate(rhos):
        color = plt.cm.tab10(i % 10)
        for key, style, what in (("vs_pure_moe", "o-", "vs pure MoE"), ("table_effect", "s--", "vs no table")):
            xs, ys, lo, hi = [], [], [], []
            for b in budgets:
                entry = b[key].get(rho)
                if entry is None:
                    continue
                d = entry["difference"]
                xs.append(b["train_tokens"])
                ys.append(d["mean"])
                lo.append(0.0 if d["low"] is None else d["mean"] - d["low"])
                hi.append(0.0 if d["high"] is None else d["high"] - d["mean"])
            if xs:
                label = f"rho {rho} {what}"
                trend = (summary["statistics"].get("trend") or {}).get(key, {}).get(rho)
                if trend is not None and trend["slope_per_decade"]["half_width"] is not None:
                    sl = trend["slope_per_decade"]
                    label += f"; per decade {sl['mean']:+.3f} [{sl['low']:+.3f}, {sl['high']:+.3f}]"
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, color=color, capsize=3, label=label)
    ax.axhline(0.0, color="gray", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per run (log)")
    ax.set_ylabel("paired loss difference (nats), 95% t-interval")
    ratio = budgets[0]["tokens_per_active_param"] / budgets[0]["train_tokens"]
    top = ax.secondary_xaxis("top", functions=(lambda t: t * ratio, lambda r: r / ratio))
    top.set_xlabel("tokens per active parameter (pure MoE)", fontsize=8)
    ax.set_title(f"condmem study tokens ({summary['preset']}): the gap against tokens", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, within=within)
