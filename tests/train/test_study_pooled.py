"""The allocation study's control contrasts averaged over rho: one mean per seed, then a t-interval
over seeds (checked against a hand computation), only over the rho points that have both sides; the
primary ones corrected together (Holm), a claim that fails the correction withdrawn."""

from __future__ import annotations

import math

import pytest

from condmem.apps.study.stats import compare, t_interval
from condmem.apps.study.sweep import UNFAIR, comparisons, correct_family, statistics

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


def _study(dense: list[float] | None = None) -> dict:
    """The fixture's statistics; with `dense`, a dense control of those losses per seed."""
    losses = LOSSES if dense is None else {**LOSSES, "dense": dense}
    points = [_point("rho1", 1.0, None), _point("r5", 0.5, None), _point("r25", 0.25, None)]
    points += [_point("r5_no_table", 0.5, "no_table"), _point("r25_no_table", 0.25, "no_table")]
    points += [_point("r5_random_address", 0.5, "random_address")]
    if dense is not None:
        points.append({"key": "dense", "label": "dense", "rho": 1.0, "control": "dense", "val_loss": {"values": dense}})
    runs = [
        {"run_id": f"{key}_seed{s}", "init_seed": s, "val_loss": values[s]}
        for key, values in losses.items()
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


def test_the_primary_comparisons_are_corrected_together():
    st = _study()
    family = st["multiplicity"]
    assert family["method"] == "Holm" and sorted(family["members"]) == ["table_vs_no_table", "table_vs_random_address"]
    table = st["pooled"]["table_vs_no_table"]  # p 0.0198 (t = 7 at df 2) and 0.099: 2 x 0.0198 holds
    assert table["holm"]["p_adjusted"] == pytest.approx(2 * table["p"]) and table["holm"]["holds"] and table["claim"]
    assert table["p"] == pytest.approx(1 - 7 / math.sqrt(51), rel=1e-6)
    # the secondary intervals stay as they are: 2 rho against pure MoE, 3 per-rho controls, random against none
    assert family["secondary"] == 6 and all("holm" not in c for c in st["vs_pure_moe"].values())


def test_a_claim_that_fails_the_correction_is_withdrawn_and_says_so():
    # two intervals below zero, each at p = 0.04 (t = 2.8 sqrt 3 at df 2): Holm adjusts both to 0.08
    entries = {k: compare(k, "B", t_interval([-1.8, -2.8, -3.8])) for k in ("x", "y")}
    assert all(e["claim"] and 0.03 < e["p"] < 0.05 for e in entries.values())
    record = correct_family(entries, "the 2 primary comparisons")
    assert record["members"] == ["x", "y"]
    for e in entries.values():
        assert not e["claim"] and e["verdict"] == "lower" and e["holm"]["p_adjusted"] == pytest.approx(2 * e["p"])
        assert e["text"].endswith(
            "after Holm's correction over the 2 primary comparisons (adjusted p 0.080): not claimed"
        )


def test_nothing_about_rho_or_the_table_is_claimed_unless_pure_moe_beats_dense():
    assert _study()["multiplicity"]["gate"] is None  # no dense control: no gate
    fair = _study(dense=[3.60, 3.50, 3.55])  # pure MoE 0.30-0.35 below dense: the gate holds
    assert fair["multiplicity"]["gate"] == {"test": "pure MoE below dense", "holds": True}
    assert fair["pooled"]["table_vs_no_table"]["claim"] and fair["multiplicity"]["secondary"] == 6
    unfair = _study(dense=[3.00, 2.95, 3.05])  # dense 0.20-0.30 below pure MoE: the gate fails
    assert unfair["dense"]["verdict"] == "higher" and unfair["multiplicity"]["gate"]["holds"] is False
    withdrawn = [e for key, _, e in comparisons(unfair) if key != "dense"]
    assert not any(e["claim"] for e in withdrawn) and not unfair["optimum"]["claims_minimum"]
    # the same intervals, withdrawn where the fair backbone claimed them, and saying why
    claimed = [e["text"] for key, _, e in comparisons(fair) if key != "dense" and e["claim"]]
    assert claimed and sum(e["text"].endswith(UNFAIR) for e in withdrawn) == len(claimed)


def _bucketed_study(seen_effect: list[float], unseen_effect: list[float]) -> dict:
    """Two rho points and their no_table controls whose table effect (rho - no_table, per seed) is
    `seen_effect` on seen 3-grams and `unseen_effect` on unseen ones, at both rho points."""
    points = [{"key": k, "label": k, "rho": rho, "control": c, "val_loss": {"values": [3.0] * 3}}
              for k, rho, c in (("rho1", 1.0, None), ("r5", 0.5, None), ("r25", 0.25, None),
                                ("r5_no_table", 0.5, "no_table"), ("r25_no_table", 0.25, "no_table"))]  # fmt: skip
    runs = []
    for p in points:
        for s in SEEDS:
            table = p["key"] in ("r5", "r25")
            seen = 3.0 + (seen_effect[s] if table else 0.0)
            unseen = 6.0 + (unseen_effect[s] if table else 0.0)
            buckets = {"seen": {"loss": seen}, "unseen": {"loss": unseen}}
            runs.append({"run_id": f"{p['key']}_seed{s}", "init_seed": s, "val_loss": 3.0, "buckets": buckets})
    return statistics("allocation", points, runs)


def test_the_table_effect_by_bucket_is_the_seed_means_t_interval():
    st = _bucketed_study(seen_effect=[-0.30, -0.25, -0.35], unseen_effect=[-0.10, -0.05, -0.09])
    by = st["by_bucket"]
    assert by["seen"]["difference"]["mean"] == pytest.approx(-0.30) and by["seen"]["verdict"] == "lower"
    assert by["unseen"]["difference"]["mean"] == pytest.approx(-0.08) and by["seen"]["rho_points"] == 2
    gaps = [-0.20, -0.20, -0.26]  # seen minus unseen, per seed
    mean = sum(gaps) / 3
    half = 4.302652729911275 * math.sqrt(sum((g - mean) ** 2 for g in gaps) / 2) / math.sqrt(3)
    gap = by["seen_minus_unseen"]["difference"]
    assert gap["mean"] == pytest.approx(mean) and gap["half_width"] == pytest.approx(half)
    assert by["seen_minus_unseen"]["verdict"] == "lower"  # the gain falls mostly on seen 3-grams
    assert st["multiplicity"]["secondary"] == 2 + 2 + 3  # 2 rho vs pure MoE, 2 no_table controls, 3 by bucket
    # negative control: the same effect on both buckets tells them apart nowhere
    flat = _bucketed_study(seen_effect=[-0.30, -0.25, -0.35], unseen_effect=[-0.31, -0.24, -0.33])
    assert flat["by_bucket"]["seen_minus_unseen"]["verdict"] == "unresolved"
    assert _study()["by_bucket"] == {}  # runs without buckets: nothing by bucket
