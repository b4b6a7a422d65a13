"""The multi-GPU run's results in one JSON and one PNG (what `scripts/gpu_multi.sh` leaves in its folder).

Reads, under ``OUT``: each world size's tensor-parallel Engram check
(``tp_w{W}/multi_gpu_tp.json``: every mode exact, its collective time against the predicted
one), the training runs (``train_{name}/summary.json``: one global batch at 1 and N GPUs, one
per-GPU batch at 1..N GPUs, a run killed after its step-10 checkpoint and resumed against an
uninterrupted one) and the tensor-parallel serving runs (``e2e_tp1``, ``e2e_tp{N}_{head,row}``:
`condmem bench e2e` rows). Writes ``multi_gpu.json`` and ``multi_gpu.png`` (collective time
measured vs predicted per mode and world size; training tokens/s against linear scaling;
serving tokens/s per variant at TP 1 and N) and prints a short table. Missing inputs are
left out, not guessed.

    python3 benchmarks/multi_gpu_report.py OUT N
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORLDS = (1, 2, 4, 8)


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def collect(out: Path, n: int) -> dict:
    """Everything the run measured, as one dict (see the module docstring)."""
    result: dict = {"world": n, "tp_engram": {}, "training": {}, "serving": {}}
    for w in WORLDS[1:]:
        tp = _load(out / f"tp_w{w}" / "multi_gpu_tp.json")
        if tp is not None:
            result["tp_engram"][str(w)] = {
                "allgather_bus_gbps": tp["allgather_bus_gbps"],
                "tokens_per_step": tp["tokens_per_step"],
                "modes": {
                    m["mode"]: {
                        k: m.get(k)
                        for k in (
                            "exact_on_every_rank",
                            "rel_err_max_over_ranks",
                            "step_ms",
                            "collective_ms",
                            "predicted_ms",
                            "bytes_per_token",
                        )
                    }
                    for m in tp["modes"]
                },
            }
    train = result["training"]
    runs = {
        name: _load(out / f"train_{name}" / "summary.json")
        for name in ("same_batch_w1", f"same_batch_w{n}", "whole", "killed", *(f"per_gpu_w{w}" for w in WORLDS))
    }
    a, b = runs["same_batch_w1"], runs[f"same_batch_w{n}"]
    if a and b:
        la, lb = [h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]]
        train["same_batch_steps"] = min(len(la), len(lb))
        train["same_batch_max_rel_loss_diff"] = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    base = runs["per_gpu_w1"]
    scaling = {}
    for w in WORLDS:
        s = runs[f"per_gpu_w{w}"]
        if s and base:
            tps = s["summary"]["tokens_per_s"]
            scaling[str(w)] = {"tokens_per_s": tps, "x_linear": tps / (w * base["summary"]["tokens_per_s"])}
    if scaling:
        train["per_gpu_batch_scaling"] = scaling
    a, b = runs["whole"], runs["killed"]
    if a and b:
        la, lb = [h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]]
        train["kill_resume_steps_compared"] = len(lb)
        train["kill_resume_losses_equal"] = bool(lb) and la[-len(lb) :] == lb
    for name in ("tp1", f"tp{n}_head", f"tp{n}_row"):
        rows = _rows(out / f"e2e_{name}" / "e2e.json")
        if rows:
            result["serving"][name] = {
                r["variant"]: {
                    k: r.get(k)
                    for k in (
                        "tokens_per_s",
                        "prefill_tokens_per_s",
                        "decode_tokens_per_s",
                        "x_none",
                        "x_hbm",
                        "tokens_equal",
                    )
                }
                for r in rows
            }
    return result


def plot(result: dict, path: Path) -> Path | None:
    """Three panels: collective ms (measured vs predicted), training scaling, serving tokens/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    labels, measured, predicted = [], [], []
    for w, tp in result["tp_engram"].items():
        for mode, m in tp["modes"].items():
            labels.append(f"{mode}\nW={w}")
            measured.append(m.get("collective_ms") if m.get("collective_ms") is not None else m["step_ms"])
            predicted.append(m["predicted_ms"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured (wkv: the whole step)")
    ax.bar([i + 0.2 for i in x], predicted, 0.4, label="predicted (bytes / all-gather bus bandwidth)")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("ms per step")
    ax.set_title("tensor-parallel Engram: collective time")
    ax.legend(fontsize=7)
    ax = axes[1]
    scaling = result["training"].get("per_gpu_batch_scaling", {})
    if scaling:
        ws = [int(w) for w in scaling]
        tps = [scaling[w]["tokens_per_s"] for w in scaling]
        ax.plot(ws, tps, "o-", label="measured")
        ax.plot(ws, [tps[0] * w / ws[0] for w in ws], "k:", label="linear")
        for w, t, s in zip(ws, tps, scaling.values()):
            ax.annotate(f"{s['x_linear']:.2f}", (w, t), fontsize=7, ha="left", va="bottom")
        ax.set_xticks(ws)
        ax.legend(fontsize=7)
    ax.set_xlabel("GPUs (the same batch per GPU)")
    ax.set_ylabel("training tokens/s")
    ax.set_title("training with sharded tables")
    ax = axes[2]
    serving = result["serving"]
    variants = list(dict.fromkeys(v for runs in serving.values() for v in runs if v != "none_again"))
    width = 0.8 / max(1, len(serving))
    for i, (name, runs) in enumerate(serving.items()):
        ax.bar(
            [j + i * width for j in range(len(variants))],
            [runs.get(v, {}).get("tokens_per_s") or 0 for v in variants],
            width,
            label=name,
        )
    ax.set_xticks([j + width * (len(serving) - 1) / 2 for j in range(len(variants))], variants, fontsize=7)
    ax.set_ylabel("tokens/s (prompt + generated)")
    ax.set_title("serving, bench e2e")
    if serving:
        ax.legend(fontsize=7)
    fig.suptitle(f"condmem on {result['world']} GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the folder scripts/gpu_multi.sh wrote")
    p.add_argument("world", type=int, help="GPUs of the run (N)")
    args = p.parse_args()
    result = collect(args.out, args.world)
    (args.out / "multi_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "multi_gpu.png")
    for w, tp in result["tp_engram"].items():
        for mode, m in tp["modes"].items():
            exact = (
                m["exact_on_every_rank"]
                if m.get("exact_on_every_rank") is not None
                else f"rel err {m.get('rel_err_max_over_ranks'):.1e}"
            )
            coll = m.get("collective_ms")
            print(
                f"TP Engram W={w} {mode:<11} exact {exact!s:<16} collective "
                f"{'-' if coll is None else f'{coll:.3f}'} ms, predicted {m['predicted_ms']:.3f} ms"
            )
    train = result["training"]
    if "same_batch_max_rel_loss_diff" in train:
        print(
            f"training, one global batch at 1 and {args.world} GPUs: max relative loss difference "
            f"{train['same_batch_max_rel_loss_diff']:.2e} over {train['same_batch_steps']} steps"
        )
    for w, s in train.get("per_gpu_batch_scaling", {}).items():
        print(f"training, {w} GPU(s): {s['tokens_per_s']:,.0f} tokens/s, {s['x_linear']:.3f} of linear")
    if "kill_resume_losses_equal" in train:
        print(
            f"training killed at step 10 and resumed: losses equal over {train['kill_resume_steps_compared']} steps: "
            f"{train['kill_resume_losses_equal']}"
        )
    for name, runs in result["serving"].items():
        print(f"serving {name}: " + ", ".join(f"{v} {r['tokens_per_s']:,.0f} tok/s" for v, r in runs.items()))


if __name__ == "__main__":
    main()
