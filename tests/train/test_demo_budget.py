"""A time budget cannot make the demo's comparison mislead.

A run cut below what its learning-rate schedule needs (`min_comparable_steps`: twice the
warm-up, at least `MIN_COMPARABLE_STEPS`) is reported as "too short to compare" in
summary.json and the final line, never as a gap; a run long enough reports its gap. The
ETA of a budgeted run reflects the budget from its first step.

The budget cut is forced cheaply: every training step costs 10 s more on the training
loop's clock (a fake clock, the real one plus an offset that each step advances), so an
8-minute budget leaves the baseline ~20 steps, as on a slow machine.
"""

from __future__ import annotations

import json
import re
import time
import types

import pytest

from condmem.cli import main
from condmem.train import loop
from condmem.apps.demo import DemoConfig, run_demo
from condmem.train.loop import MIN_COMPARABLE_STEPS, min_comparable_steps

STEP_SECONDS = 10.0


@pytest.fixture
def slow_steps(monkeypatch):
    """Each training step takes STEP_SECONDS more on the training loop's clock."""
    offset = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    step = loop.Trainer.train_step

    def slow(self, i):
        offset[0] += STEP_SECONDS
        return step(self, i)

    monkeypatch.setattr(loop.Trainer, "train_step", slow)


def _budgeted_demo(tmp_path, tiny_corpus, minutes=None, steps=None):
    # The cpu preset's warm-up (24 steps) on the tiny model: the cut lands inside it.
    config = DemoConfig(
        tmp_path / "demo",
        preset="tiny",
        overrides={"train": {"warmup_steps": 24, "steps": steps}, "data": {"corpus": str(tiny_corpus)}},
        device="cpu",
        minutes=minutes,
        max_new_tokens=2,
        progress=False,
        checkpoint=False,
    )
    return run_demo(config)


def test_min_comparable_steps_is_twice_the_warmup_with_a_floor():
    assert min_comparable_steps(24) == 48
    assert min_comparable_steps(100) == 200
    assert min_comparable_steps(0) == min_comparable_steps(2) == MIN_COMPARABLE_STEPS


def test_a_budget_cut_inside_the_warmup_is_too_short_to_compare(slow_steps, tiny_corpus, tmp_path, capsys):
    summary = _budgeted_demo(tmp_path, tiny_corpus, minutes=8)
    printed = capsys.readouterr().out
    steps = summary["baseline"]["steps"]
    assert 12 <= steps < 48, steps  # the probe's 12 steps at least; inside twice the 24-step warm-up
    assert summary["engram"]["steps"] == steps
    comp = summary["comparison"]
    assert comp["verdict"] == "too short to compare" and comp["comparable"] is False
    assert comp["min_steps"] == 48 and comp["steps"] == steps
    assert comp["val_loss_gap_pct"] is None and comp["bits_per_byte_gap_pct"] is None
    assert all(r["val_loss_gap_pct"] is None for r in summary["seeds"])
    on_disk = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert on_disk["comparison"]["verdict"] == "too short to compare"
    # Said when the budget is resolved (before the Engram model trains) and on the final line; no verdict.
    assert printed.index("too short to compare") < printed.index("[engram]")
    final = [line for line in printed.splitlines() if line.startswith("Engram validation loss")]
    assert len(final) == 1 and "too short to compare" in final[0], final
    assert not re.search(r"% (NOT )?lower|% HIGHER", printed), "a gap verdict was printed for a too-short run"
    assert printed.strip().splitlines()[-1].startswith("result: too short to compare; wrote ")


def test_the_eta_reflects_the_budget_from_the_first_step(slow_steps, tiny_corpus, tmp_path, capsys):
    summary = _budgeted_demo(tmp_path, tiny_corpus, minutes=8)
    printed = capsys.readouterr().out
    etas = re.findall(r"\[baseline\] step\s+(\d+)/~?(\d+) .*\| eta (\S+)", printed)
    assert etas, printed[-2000:]
    step, total, eta = etas[0]
    assert step == "1"
    # The baseline's budget is 44% of the 8 minutes (~211 s): the first ETA is within it, never the
    # hours that the one-pass step cap would take at 10 s a step.
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", eta)
    seconds = int(parts[1] or 0) * 3600 + int(parts[2] or 0) * 60 + int(parts[3] or 0)
    assert seconds <= 0.44 * 8 * 60, eta
    # The step total shown before the cut is the budget's estimate, close to where it ends.
    assert int(total) <= 2 * summary["baseline"]["steps"], (total, summary["baseline"]["steps"])


def test_a_run_with_its_whole_schedule_reports_its_gap(tiny_corpus, tmp_path, capsys):
    """The negative control: the same demo, long enough for its schedule, states a gap and a verdict."""
    summary = _budgeted_demo(tmp_path, tiny_corpus, steps=48)
    printed = capsys.readouterr().out
    comp = summary["comparison"]
    assert summary["baseline"]["steps"] == 48 and comp["comparable"] is True
    assert comp["verdict"] in ("lower", "not lower")
    assert isinstance(comp["val_loss_gap_pct"], float)
    final = [line for line in printed.splitlines() if line.startswith("Engram validation loss")]
    assert len(final) == 1 and re.search(r"\d\.\d\d% (NOT )?lower", final[0]), final
    assert printed.strip().splitlines()[-1].startswith(f"result: {comp['verdict']}; wrote ")


def test_the_cli_says_too_short_and_exits_0(tiny_corpus, tmp_path, capsys):
    """--steps below the schedule's need: the run completes, and says it cannot compare."""
    out = tmp_path / "short"
    argv = ["demo", "--preset", "tiny", "--corpus", str(tiny_corpus), "--vocab-size", "320", "--steps", "6"]
    argv += ["--out", str(out), "--device", "cpu", "--max-new-tokens", "2", "--no-progress", "--no-checkpoint"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "too short to compare" in printed and "WARNING" in printed
    assert json.loads((out / "summary.json").read_text())["comparison"]["verdict"] == "too short to compare"
