"""The allocation study's control contrasts averaged over rho: one mean per seed, then a t-interval
over seeds (checked against a hand computation), only over the rho points that have both sides."""

from __future__ import annotations

import math

import pytest

from condmem.apps.study.sweep import statistics

SEEDS = (0, 1, 2)
# key -> validation loss per seed; r5 and r25 have no_table controls, only r5 a random-address one
LOSSES = {
    "rho1": [3.30, 3.20, 3.25],
    "r5": [3.00, 2.90, 3.10],
    "r25": [2.90, 3.00, 2.95],
    "r5_no_table": [3.20, 3.20, 3.20],
    "r25_no_table": [3.30, 3.10, 3.25],
    "r5_random_address": [3.21, 3.22, 3.18],
}


def _point(key: str, rho: float, control: str | None) -> dict:
    return {"key": key, "label": key, "rho": rho, "control": control, "val_loss": {"values": LOSSES[key]}}


def _study() -> dict:
    points = [_point("rho1", 1.0, None), _point("r5", 0.5, None), _point("r25", 0.25, None)]
    points += [_point("r5_no_table", 0.5, "no_table"), _point("r25_no_table", 0.25, "no_table")]
    points += [_point("r5_random_address", 0.5, "random_address")]
    runs = [
        {"run_id": f"{key}_seed{s}", "init_seed": s, "val_loss": losses[s]}
        for key, losses in LOSSES.items()
        for s in SEEDS
    ]
    return statistics("allocation", points, runs)


def test_pooled_table_effect_is_the_seed_means_t_interval():
    pooled = _study()["pooled"]
    table = pooled["table_vs_no_table"]
    # per seed, the mean over r5 and r25 of (rho point - its no_table): (-0.2 - 0.4)/2, (-0.3 - 0.1)/2, (-0.1 - 0.3)/2
    per_seed = [-0.3, -0.2, -0.2]
    mean = sum(per_seed) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / 2)
    half = 4.302652729911275 * std / math.sqrt(3)  # t(0.975, df 2)
    d = table["difference"]
    assert d["mean"] == pytest.approx(mean, abs=1e-12) and d["n"] == 3
    assert d["low"] == pytest.approx(mean - half, abs=1e-9) and d["high"] == pytest.approx(mean + half, abs=1e-9)
    assert table["verdict"] == "lower" and table["rho_points"] == 2 and table["what"] == "the table's own effect"


def test_pooled_contrasts_use_only_rho_points_with_both_sides():
    pooled = _study()["pooled"]
    assert pooled["table_vs_random_address"]["rho_points"] == 1  # r25 has no random-address run
    assert pooled["random_address_vs_no_table"]["rho_points"] == 1
    # random rows against no table at r5: +0.01, +0.02, -0.02: no claim
    assert pooled["random_address_vs_no_table"]["verdict"] == "unresolved"
    assert not any("tiny_table" in k for k in pooled)  # no tiny-table runs: no such contrast
