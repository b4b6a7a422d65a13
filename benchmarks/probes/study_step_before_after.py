"""The gpu preset's training step before and after a change, on one machine, in repetitions.

`study_step_profile.py` runs in a `git archive` of the ``--before`` commit (its eager step, say)
and in this tree (each ``--after`` argument string is one run of it), alternating, ``--reps``
times. Per model and ``--target`` option of the after runs: each repetition's ms a step, the
ratio before / after, MFU and the losses' largest difference from before. Writes
``study_step_before_after.json`` under ``--out`` and prints a table last.

    python3 benchmarks/probes/study_step_before_after.py --before e870a3f --reps 3 \\
        --before-args "--models moe moe_engram_rho0.8 dense --options eager" \\
        --after "--models moe moe_engram_rho0.8 dense --options compiled_graphs" --target compiled_graphs

Needs a CUDA device, and the repository's history (``git archive``) or the before commit's tree
(``--before-tree``: on a machine that has the files but not the history).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
from condmem.utils.atomic import atomic_write_text  # noqa: E402

PROBE = "benchmarks/probes/study_step_profile.py"
STEPS = 20


def probe(tree: Path, args: str, out: Path) -> dict:
    """One run of the step probe in `tree`: its JSON (rows keyed model/option); no rows where the
    probe wrote none (every variant failed, or the process did: its output says why)."""
    cmd = [sys.executable, PROBE, "--deterministic", "--steps", str(STEPS), *shlex.split(args), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    print(done.stdout[-1500:], done.stderr[-1500:] if done.returncode else "", flush=True)
    saved = out / "study_step_profile.json"
    if not saved.exists():
        print(f"{tree.name}: the probe wrote no result (exit {done.returncode})", flush=True)
        return {"rows": {}, "gpu": None, "peak": None, "commit": None}
    return json.loads(saved.read_text())


def summarise(reps: list[dict], targets: list[str]) -> dict:
    """Per model and target option: before / after ms per repetition, their ratios, MFU after,
    the losses' largest difference."""
    summary = {}
    for key in sorted({key for rep in reps for key in rep["after"] if key.split("/")[1] in targets}):
        name = key.split("/")[0]
        before = [next((r for k, r in rep["before"].items() if k.startswith(f"{name}/")), None) for rep in reps]
        after = [rep["after"].get(key) for rep in reps]
        if any(r is None or "error" in r for r in before + after):
            continue
        ratios = [b["ms_per_step"] / a["ms_per_step"] for b, a in zip(before, after)]
        summary[key] = {
            "before_ms": [r["ms_per_step"] for r in before],
            "after_ms": [r["ms_per_step"] for r in after],
            "ratios": ratios,
            "mean_ratio": sum(ratios) / len(ratios),
            "after_mfu": sum(r["mfu"] for r in after) / len(after),
            "loss_drift": max(abs(x - y) for b, a in zip(before, after) for x, y in zip(b["losses"], a["losses"])),
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose step is the baseline")
    ap.add_argument("--before-args", required=True, help="the probe's arguments in the before tree")
    ap.add_argument("--after", action="append", required=True, help="the probe's arguments in this tree (repeatable)")
    ap.add_argument("--target", nargs="+", required=True, help="the after options compared with before")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before-tree", help="a folder with the before commit's src/ and benchmarks/ (else git archive)")
    ap.add_argument("--after-commit", help="this tree's commit, where its repository cannot tell (a copied tree)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(args.before_tree).resolve() if args.before_tree else Path(tmp) / "before"
        if not args.before_tree:
            before_tree.mkdir()
            paths = ["src", "benchmarks/probes", "benchmarks/moe_step.py"]
            archive = subprocess.run(["git", "archive", args.before, *paths], cwd=ROOT, capture_output=True)
            if archive.returncode:
                sys.exit(f"git archive {args.before} failed: {archive.stderr.decode()[-500:]}")
            subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive.stdout, check=True)
        for rep in range(args.reps):
            row = {"before": probe(before_tree, args.before_args, Path(tmp) / f"before{rep}")["rows"], "after": {}}
            for i, after_args in enumerate(args.after):
                result = probe(ROOT, after_args, Path(tmp) / f"after{rep}_{i}")
                row["after"].update(result["rows"])
                row["gpu"], row["peak"] = result["gpu"] or row.get("gpu"), result["peak"] or row.get("peak")
            reps.append(row)
            summary = summarise(reps, args.target)
            record = {
                "date": datetime.date.today().isoformat(),
                "command": " ".join(shlex.quote(a) for a in sys.argv),
                "before_commit": args.before,
                "after_commit": args.after_commit or result["commit"],
                "gpu": row["gpu"],
                "repetitions": reps,
                "summary": summary,
            }
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "study_step_before_after.json", json.dumps(record, indent=1))
    print(f"\n{row['gpu']}; before {args.before} ({args.before_args}); after {record['after_commit']}")
    print(f"{'model / after':<42} {'before ms':>20} {'after ms':>20} {'ratio':>6} {'MFU':>6} {'loss drift':>10}")
    for name, s in summary.items():
        b = " / ".join(f"{x:.1f}" for x in s["before_ms"])
        a = " / ".join(f"{x:.1f}" for x in s["after_ms"])
        print(f"{name:<42} {b:>20} {a:>20} {s['mean_ratio']:>6.2f} {s['after_mfu']:>6.1%} {s['loss_drift']:>10.1e}")
    for name in sorted({k for rep in reps for k in rep["after"]}):
        ms = [rep["after"][name].get("ms_per_step") for rep in reps if name in rep["after"]]
        print(f"  after {name:<40} " + " / ".join(f"{x:.1f}" if x else "FAILED" for x in ms))


if __name__ == "__main__":
    main()
