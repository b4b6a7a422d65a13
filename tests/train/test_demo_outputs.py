"""What the demo and training runs show cannot mislead: the gate figure's colour scale, the final
validation's progress, the throughput ratio's caveat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from condmem.apps import plots
from condmem.train import loop
from condmem.train.build import build_model, build_model_config, build_trainer
from condmem.apps.demo import THROUGHPUT_CAVEAT, format_table
from condmem.train.presets import get_preset


def _colour_bar_range(monkeypatch, tmp_path, gates: np.ndarray) -> tuple[tuple[float, float], str]:
    """The colour bar's value range and label of `plot_gate_heatmap` over `gates`."""
    pytest.importorskip("matplotlib")
    seen = {}

    def capture(fig, path, within=None):
        cbar_ax = fig.axes[1]
        seen["range"] = tuple(float(v) for v in sorted(cbar_ax.get_ylim()))
        seen["label"] = cbar_ax.get_ylabel()
        return path

    monkeypatch.setattr(plots, "save_figure", capture)
    pieces = [f"t{i} " for i in range(gates.shape[1])]
    plots.plot_gate_heatmap(pieces, gates, tmp_path / "gates.png")
    return seen["range"], seen["label"]


def test_the_gate_colour_bar_spans_0_to_1_and_states_the_values_range(monkeypatch, tmp_path):
    # An untrained gate: every value near 0.5. Auto-scaled, 0.49..0.515 would fill the whole colour range.
    gates = np.linspace(0.49, 0.515, 40)[None, :]
    span, label = _colour_bar_range(monkeypatch, tmp_path, gates)
    assert span == pytest.approx((0.0, 1.0)), "the colour bar auto-scaled to the values"
    assert "0.490 to 0.515" in label


def test_the_gate_colour_bar_check_sees_an_auto_scaled_bar(monkeypatch, tmp_path):
    """The negative control: the check above reads the bar's real range (auto-scaling shows in it)."""
    from matplotlib import colors as mcolors

    real = mcolors.Normalize

    def auto_scaled(vmin=None, vmax=None, **kw):  # the figure's 0..1 norm replaced by the values' range
        return real(0.49, 0.515) if (vmin, vmax) == (0.0, 1.0) else real(vmin, vmax, **kw)

    monkeypatch.setattr(mcolors, "Normalize", auto_scaled)
    span, _ = _colour_bar_range(monkeypatch, tmp_path, np.linspace(0.49, 0.515, 40)[None, :])
    assert span == pytest.approx((0.49, 0.515))


class _RecordingBar:
    """A stand-in for `Progress` that records its total and every update."""

    made: list[_RecordingBar] = []

    def __init__(self, total, desc, initial=0, enabled=True, unit="step", unit_scale=False):
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        _RecordingBar.made.append(self)

    def update(self, n=1, **postfix):
        self.done += n

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def _fit_with_recorded_bars(tiny_data, monkeypatch) -> list[_RecordingBar]:
    _RecordingBar.made = []
    monkeypatch.setattr(loop, "Progress", _RecordingBar)
    preset = get_preset("tiny")
    model = build_model(build_model_config(preset, tiny_data, engram=False), tiny_data, seed=0, device="cpu")
    tc = dataclasses.replace(preset.train, steps=2, warmup_steps=1)
    build_trainer(model, tc, tiny_data, "cpu", label="baseline", progress=True).fit()
    return [bar for bar in _RecordingBar.made if bar.desc == "baseline: validation"]


def test_the_final_validation_shows_progress_over_every_token(tiny_data, monkeypatch, capsys):
    bars = _fit_with_recorded_bars(tiny_data, monkeypatch)
    assert len(bars) == 1, "one progress bar for the whole-split validation"
    assert bars[0].unit == "tok" and bars[0].total == len(tiny_data.val) - 1
    assert bars[0].done == bars[0].total, "the bar did not advance through the split"
    assert f"[baseline] validating on all {len(tiny_data.val) - 1:,} held-out tokens" in capsys.readouterr().out


def test_the_progress_check_sees_a_bar_that_does_not_advance(tiny_data, monkeypatch):
    """The negative control: `evaluate` without its progress callback leaves the bar at 0."""
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *a, on_batch=None, **kw: real(*a, **kw))
    bars = _fit_with_recorded_bars(tiny_data, monkeypatch)
    assert bars and bars[0].done == 0 < bars[0].total


def test_the_throughput_ratio_carries_its_caveat():
    def side(tok_s):
        buckets = {b: {"loss": 1.0, "fraction": 0.5, "tokens": 1} for b in ("seen", "unseen")}
        return dict(params=10, table_params=0, table_rows=0, flops_per_token=1.0, train_tokens=100, passes=0.1) | {
            "val_loss": 1.0,
            "bits_per_byte": 1.0,
            "tokens_per_s": tok_s,
            "buckets": buckets,
        }

    table = format_table([{"baseline": side(100.0), "engram": side(90.0)}])
    ratio_row = next(line for line in table.splitlines() if line.startswith("tokens / s"))
    assert ratio_row.endswith("ratio 0.900 (*)")
    assert table.splitlines()[-1] == f"(*) tokens / s: {THROUGHPUT_CAVEAT}"
    assert "timed once" in THROUGHPUT_CAVEAT and "not a benchmark" in THROUGHPUT_CAVEAT
