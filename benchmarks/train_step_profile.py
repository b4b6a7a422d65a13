"""Where an Engram training step's time goes, phase by phase, against the FLOPs-matched baseline's step.

Builds the demo's models (the ``gpu`` preset, or ``tiny`` with ``--tiny``): the iso-FLOP
baseline and the Engram model, trains each on the same batches (stdlib source, a 4096-id
BPE: the step's cost is measured here, not the loss), leaves ``--warmup`` steps out, then
times ``--rounds`` rounds of ``--steps`` steps, the two models alternating (tokens/s best
round against best and median against median), with every phase bracketed by CUDA events on
the training stream (``time.perf_counter`` on a CPU):

* forward: ``hash`` (`DecoderLM.row_ids`), ``gather`` (the table's lookup), ``wkv``
  (`Engram.project`), ``gate`` (`engram_gate`), ``short conv``; the rest is the backbone;
* backward: ``table grad`` (from the rows' gradient to the table's accumulated sparse
  gradient, by autograd hooks); the rest is the backbone and Engram's dense parts;
* ``clip`` (gradient norm), ``optimizer`` per optimizer (AdamW, the tables' sparse Adam, or
  the host tier's step), the host tier's ``prefetch`` / ``gradients`` (with ``--tier host``);
* ``step``: the whole step from its first event to its last (the step ends on the loss's
  host read), and the host's wall time per step.

A span is the GPU time between two points of the stream: where the host is slower than the
GPU the span includes the GPU waiting for the host's launches, so the spans add up to the
step. With ``--trace`` three more steps of the Engram model run under `torch.profiler` and the top
kernels by GPU time are written to ``train_step_profile_kernels.txt``. Writes
``train_step_profile.json`` under ``--out`` and prints a table last.

    PYTHONPATH=src python3 benchmarks/train_step_profile.py --out $OUT --trace
    PYTHONPATH=src python3 benchmarks/train_step_profile.py --device cpu --tiny --steps 3 --out /tmp/x  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import condmem.module as engram_module
import condmem.train.loop as loop_module
from condmem.bench.harness import machine_info
from condmem.models import DecoderLM
from condmem.models.flops import iso_flop_baseline
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.train.host_table import HostTables
from condmem.train.loop import Trainer
from condmem.train.pipeline import prepare_data
from condmem.train.presets import get_preset

FORWARD_PARTS = ("hash", "gather", "wkv", "gate", "short conv")
TRACE_STEPS = 3


class PhaseClock:
    """Spans of named phases on the device's stream, summed per step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.active = False
        self.pending: list[tuple[str, object, object]] = []
        self.open: dict[str, object] = {}
        self.totals: dict[str, float] = defaultdict(float)
        self.replaced: list[tuple[object, str, object]] = []
        self.hooks: list = []  # removable hook handles

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def span(self, label: str):
        if not self.active:
            yield
            return
        start = self.mark()
        try:
            yield
        finally:
            self.pending.append((label, start, self.mark()))

    def begin(self, label: str) -> None:
        """Open a span that a later `end` closes (autograd hooks)."""
        if self.active:
            self.open[label] = self.mark()

    def end(self, label: str) -> None:
        if self.active and label in self.open:
            self.pending.append((label, self.open.pop(label), self.mark()))

    def collect(self) -> None:
        """Wait for the recorded events; add their spans (ms) to the totals."""
        if self.cuda:
            torch.cuda.synchronize()
        for label, start, end in self.pending:
            self.totals[label] += start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        self.pending.clear()

    def wrap(self, owner, name: str, label: str) -> None:
        """Replace ``owner.name`` by a version that runs in a span called `label` (until `restore`)."""
        original = getattr(owner, name)
        self.replaced.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            with self.span(label):
                return original(*args, **kwargs)

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Undo every `wrap`, last first, and remove the hooks."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        for owner, name, before in reversed(self.replaced):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.replaced.clear()


def instrument(clock: PhaseClock, model: DecoderLM, trainer: Trainer, host: HostTables | None) -> None:
    """Bracket the phases of `trainer.train_step` (instance and module attributes of this process)."""
    clock.wrap(model, "loss", "forward")
    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(loop_module, "clip_grad_norm_", "clip")
    clock.wrap(loop_module, "clip_gradients_", "clip")
    for opt in trainer.optimizers:
        clock.wrap(opt, "step", f"optimizer: {type(opt).__name__}")
    if model.cfg.engram is None:
        return
    clock.wrap(model, "row_ids", "hash")
    clock.wrap(engram_module, "engram_gate", "gate")
    for engram in model.engram_layers:
        clock.wrap(engram, "project", "wkv")
        clock.wrap(engram, "_short_conv", "short conv")
        _time_table(clock, engram.table)
    if host is not None:
        for name in ("begin", "prefetch", "gradients"):
            clock.wrap(host, name, f"host tier: {name}")


def _time_table(clock: PhaseClock, table: torch.nn.Module) -> None:
    """The lookup as ``gather``; its backward, rows' gradient to the table's, as ``table grad``."""
    clock.wrap(table, "forward", "gather")

    def on_rows(module, args, rows):
        if clock.active and rows.requires_grad:
            rows.register_hook(lambda grad: clock.begin("table grad"))

    clock.hooks.append(table.register_forward_hook(on_rows))
    weight = getattr(table, "weight", None)
    if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
        clock.hooks.append(weight.register_post_accumulate_grad_hook(lambda p: clock.end("table grad")))


class ModelRun:
    """One model's trainer, warmed up, timed a round at a time (rounds of the models alternate)."""

    def __init__(self, name: str, model: DecoderLM, data, tc, device, args, host: HostTables | None = None):
        self.name, self.model, self.device, self.args, self.host = name, model, device, args, host
        self.trainer = build_trainer(model, tc, data, device, label=name, progress=False, host_tables=host)
        self.clock = PhaseClock(device)
        self.tokens = tc.batch_size * tc.seq_len
        self.step = 0
        self.walls: list[float] = []
        self.round_tokens_per_s: list[float] = []
        self.waited = 0.0
        model.train()
        for _ in range(args.warmup):
            self._train_step()

    def _train_step(self) -> None:
        self.trainer.train_step(self.step)
        self.step += 1

    def round(self, steps: int) -> None:
        """`steps` timed steps, every phase in its span (instrumented for the round only)."""
        instrument(self.clock, self.model, self.trainer, self.host)
        waited = self.host.wait_s if self.host is not None else 0.0
        walls = []
        try:
            for _ in range(steps):
                self.clock.active = True
                t0 = time.perf_counter()
                with self.clock.span("step"):
                    self._train_step()
                walls.append((time.perf_counter() - t0) * 1e3)
                self.clock.active = False
                self.clock.collect()
        finally:
            self.clock.restore()
        if self.host is not None:
            self.waited += self.host.wait_s - waited
        self.walls += walls
        self.round_tokens_per_s.append(self.tokens / (statistics.median(walls) / 1e3))

    def result(self) -> dict:
        """Per-phase mean ms per timed step, tokens/s (all timed steps' median step, and per round)."""
        timed = len(self.walls)
        trace = None
        if self.args.trace and self.name == "engram":
            # Extra steps under the profiler, after the timed ones: its overhead stays out of the spans.
            with torch.profiler.profile(activities=_activities(self.device)) as profiler:
                for _ in range(TRACE_STEPS):
                    self._train_step()
            trace = _top_kernels(profiler, self.device)
        step_ms = statistics.median(self.walls)
        out = {
            "name": self.name,
            "phases_ms": {k: v / timed for k, v in self.clock.totals.items()},
            "step_wall_ms_median": step_ms,
            "step_wall_ms": self.walls,
            "tokens_per_s": self.tokens / (step_ms / 1e3),
            "rounds_tokens_per_s": self.round_tokens_per_s,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.host is not None:
            # The main thread's wait for the host tier's worker (rows not yet gathered, a flush).
            out["host_wait_ms_per_step"] = self.waited / timed * 1e3
        if trace is not None:
            out["top_kernels"] = trace
        return out


def _activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _top_kernels(profiler, device: torch.device, rows: int = 30) -> str:
    """The top ops by GPU time, then by the host's own time (where the main thread's time goes)."""
    averages = profiler.key_averages()
    tables = []
    keys = [("self_device_time_total", "self_cuda_time_total")] if device.type == "cuda" else []
    for names in [*keys, ("self_cpu_time_total",)]:
        for key in names:
            try:
                tables.append(averages.table(sort_by=key, row_limit=rows))
                break
            except (AttributeError, KeyError, ValueError):
                continue
    return "\n\n".join(tables) or averages.table(row_limit=rows)


def breakdown(run: dict) -> dict[str, float]:
    """Exclusive phases of one run: forward and backward minus the parts inside them."""
    p = dict(run["phases_ms"])
    parts = {k: p.pop(k, 0.0) for k in FORWARD_PARTS}
    table_grad = p.pop("table grad", 0.0)
    out = {"forward: backbone": p.pop("forward", 0.0) - sum(parts.values())}
    out.update({f"forward: {k}": v for k, v in parts.items() if v})
    out["backward: backbone + Engram dense"] = p.pop("backward", 0.0) - table_grad
    if table_grad:
        out["backward: table grad"] = table_grad
    step = p.pop("step", 0.0)
    out.update(p)
    out["other (data, loss read, gaps)"] = step - sum(out.values())
    out["step"] = step
    return out


def report(runs: dict[str, dict]) -> str:
    base, eng = breakdown(runs["baseline"]), breakdown(runs["engram"])
    names = list(dict.fromkeys([*eng, *base]))
    names.remove("step")
    lines = [f"{'phase':40s} {'baseline ms':>12s} {'engram ms':>10s} {'engram - base':>14s}"]
    for n in [*names, "step"]:
        b, e = base.get(n, 0.0), eng.get(n, 0.0)
        lines.append(f"{n:40s} {b:12.3f} {e:10.3f} {e - b:+14.3f}")
    rb, re_ = runs["baseline"], runs["engram"]
    lines.append(
        f"{'host wall per step (median)':40s} {rb['step_wall_ms_median']:12.3f} {re_['step_wall_ms_median']:10.3f} "
        f"{re_['step_wall_ms_median'] - rb['step_wall_ms_median']:+14.3f}"
    )
    if "host_wait_ms_per_step" in re_:
        lines.append(f"{'host tier: main thread waited':40s} {'':12s} {re_['host_wait_ms_per_step']:10.3f}")
    ratio = re_["tokens_per_s"] / rb["tokens_per_s"]
    lines.append(f"tokens/s: baseline {rb['tokens_per_s']:,.0f}, engram {re_['tokens_per_s']:,.0f} ({ratio:.3f}x)")
    r = ratios(runs)
    per_round = " ".join(f"{x:.3f}" for x in r["rounds"])
    lines.append(f"engram / baseline tokens/s: best {r['best']:.3f}, median {r['median']:.3f} (rounds {per_round})")
    return "\n".join(lines)


def ratios(runs: dict[str, dict]) -> dict:
    """Engram over baseline tokens/s: best round against best, median against median, each round's."""
    b, e = runs["baseline"]["rounds_tokens_per_s"], runs["engram"]["rounds_tokens_per_s"]
    return {
        "best": max(e) / max(b),
        "median": statistics.median(e) / statistics.median(b),
        "rounds": [x / y for x, y in zip(e, b)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (a CPU smoke run)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model and round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, the two models alternating")
    ap.add_argument("--warmup", type=int, default=5, help="steps before the timed ones (compiles, caches)")
    ap.add_argument("--table-size", type=int, default=None, help="Engram table_size (default: the preset's)")
    ap.add_argument("--tier", choices=["hbm", "host"], default="hbm", help="where the Engram tables live")
    ap.add_argument("--adam", choices=["host", "device"], default="device", help="host tier: where Adam runs")
    ap.add_argument("--threads", type=int, default=None, help="host tier: the worker's torch threads")
    ap.add_argument("--trace", action="store_true", help="also the Engram steps' top kernels (torch.profiler)")
    args = ap.parse_args()
    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = get_preset(
        "tiny" if args.tiny else "gpu", {"engram": {"table_size": args.table_size}} if args.table_size else None
    )
    data = prepare_data(
        "stdlib",
        vocab_size=320 if args.tiny else 4096,
        max_train_bytes=2_000_000 if args.tiny else 8_000_000,
        tokenizer_train_bytes=1_000_000 if args.tiny else 2_000_000,
        seed=0,
    )
    total = args.warmup + args.rounds * args.steps + TRACE_STEPS
    tc = dataclasses.replace(preset.train, steps=total, eval_every=0, seed=0)
    eng_cfg = build_model_config(preset, data)
    models = {}
    try:
        for name, cfg in (("baseline", iso_flop_baseline(eng_cfg)), ("engram", eng_cfg)):
            table_device = "meta" if name == "engram" and args.tier == "host" else None
            model = build_model(cfg, data, seed=0, device=device, table_device=table_device)
            host = None
            if table_device == "meta":
                host = HostTables(model, device, seed=0, adam=args.adam, threads=args.threads)
            models[name] = ModelRun(name, model, data, tc, device, args, host)
        for _ in range(args.rounds):
            for run in models.values():
                run.round(args.steps)
        runs = {name: run.result() for name, run in models.items()}
    finally:
        for run in models.values():
            if run.host is not None:
                run.host.close()
    del models
    gc.collect()
    text = report(runs)
    trace = runs["engram"].pop("top_kernels", None)
    if trace is not None:
        (out_dir / "train_step_profile_kernels.txt").write_text(trace)
    result = {
        "bench": "train_step_profile",
        "preset": "tiny" if args.tiny else "gpu",
        "tier": args.tier,
        "adam": args.adam if args.tier == "host" else "sparse (HBM)",
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "tokens_per_step": tc.batch_size * tc.seq_len,
        "runs": runs,
        "breakdown": {k: breakdown(v) for k, v in runs.items()},
        "ratios": ratios(runs),
        "machine": machine_info(),
    }
    (out_dir / "train_step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
