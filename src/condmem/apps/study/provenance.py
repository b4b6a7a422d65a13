"""Which code and which device trained a sweep's runs, and at what rate: counted in study.json, said
in its report (the code and devices when they are several), and said before training when runs left
to train will join runs of other code."""

from __future__ import annotations

from collections import Counter

from condmem.apps.study.runs import RunSpec, RunStore
from condmem.utils.code_version import code_commit


def provenance(runs: list[dict]) -> dict:
    """How many runs each commit and each device trained (``unrecorded`` for runs that predate the
    record): a sweep whose runs come from several (copied in, resumed after a pull) says so."""

    def count(names) -> dict:
        return dict(Counter(name or "unrecorded" for name in names).most_common())

    machines = [r["machine"] for r in runs]
    return {
        "commits": count(m.get("commit") for m in machines),
        "devices": count(m.get("gpu") or m.get("device") for m in machines),
    }


def throughput(runs: list[dict]) -> dict | None:
    """A sweep's training tokens over the wall time during which one of its runs was in progress
    (model build, compiling, training, validation): the runs' clock intervals merged, so runs
    trained at once count once, and the gaps between device calls and each process's start-up
    (data loading) are left out. Runs copied in from another sweep (``reused_from``), and runs
    that predate the record, are not counted; None when no run is left."""
    spans = sorted(
        (r["wall_clock"]["started"], r["wall_clock"]["ended"], r["train_tokens"])
        for r in runs
        if r.get("wall_clock") and not r.get("reused_from")
    )
    if not spans:
        return None
    busy, run_seconds, end = 0.0, 0.0, float("-inf")
    for started, ended, _ in spans:  # by start: each run adds what it reaches past the work before it
        run_seconds += ended - started
        busy += max(0.0, ended - max(started, end))
        end = max(end, ended)
    tokens = sum(t for _, _, t in spans)
    return {
        "runs": len(spans),
        "train_tokens": tokens,
        "busy_seconds": busy,
        "tokens_per_s": tokens / busy if busy > 0 else None,
        "runs_at_once": run_seconds / busy if busy > 0 else None,
    }


def throughput_text(s: dict) -> str:
    """The report's sentence on `throughput` (study.json's), or "" without one."""
    t = s.get("throughput")
    if not t or not t["tokens_per_s"]:
        return ""
    return (
        f" Throughput: {t['runs']} runs trained here, {t['train_tokens']:,} tokens over {t['busy_seconds']:,.0f} s "
        f"of wall time with a run in progress ({t['runs_at_once']:.1f} at once on average; building, compiling "
        f"and validation included, each process's start-up left out): {t['tokens_per_s']:,.0f} tokens/s."
    )


def _short(commit: str) -> str:
    """A commit as the report names it: 12 hex digits, keeping a ``+dirty`` mark."""
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def provenance_text(s: dict) -> str:
    """The report's sentence on a study.json whose runs come from several commits or devices; else ""."""
    parts = []
    for what, counts in (s.get("provenance") or {}).items():
        if len(counts) > 1:
            each = "; ".join(f"{_short(name) if what == 'commits' else name}: {n}" for name, n in counts.items())
            parts.append(f"{len(counts)} {what} ({each} runs)")
    if not parts:
        return ""
    return (
        f" The runs come from {' and from '.join(parts)}: other code or another card can move a run's last "
        "bits, so a difference between such runs holds that change too."
    )


def say_other_commits(store: RunStore, chosen: list[RunSpec]) -> None:
    """Say so when runs left to train will join runs of other code (a sweep resumed after a pull, or
    runs copied in): study.json's provenance will count them, and this tells it before the hours."""
    stored = [store.load(s.run_id) for s in chosen]
    if all(r is not None for r in stored):
        return
    here = code_commit()
    other = Counter(r["machine"].get("commit") or "unrecorded" for r in stored if r is not None)
    other.pop(here, None)
    if here is not None and other:
        each = "; ".join(f"{_short(c)}: {n}" for c, n in other.most_common())
        print(
            f"[sweep] {sum(other.values())} finished runs here come from other code ({each}); this code is "
            f"{_short(here)}: the sweep will mix commits, and study.json's provenance counts them",
            flush=True,
        )
