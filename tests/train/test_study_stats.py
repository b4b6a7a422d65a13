"""`condmem.apps.study.stats`: t quantiles against published values, intervals against
hand-computed cases, claims only where an interval excludes zero, p-values and Holm's correction
against hand computations, and the quadratic optimum:
rarely a minimum on flat noisy curves (measured rate under the test's 2.5% one-sided level),
always one on a clear U, none where the lowest loss lies beyond the grid or on a slope, and none on
a step (flat, higher at one end) that the quadratic alone reads as a U: the two-lines test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from condmem.apps.study.stats import (
    compare,
    holm,
    linear_slope,
    p_value,
    paired_difference,
    quadratic_optimum,
    regularized_incomplete_beta,
    t_cdf,
    t_interval,
    t_quantile,
    two_lines,
)

GRID = [0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0]


@pytest.mark.parametrize(
    ("p", "df", "want"),
    [
        (0.975, 1, 12.706205),
        (0.975, 2, 4.302653),
        (0.975, 3, 3.182446),
        (0.975, 4, 2.776445),
        (0.975, 9, 2.262157),
        (0.975, 30, 2.042272),
        (0.995, 3, 5.840909),
        (0.95, 10, 1.812461),
        (0.975, 1e7, 1.959964),  # the normal's
        (0.025, 4, -2.776445),
        (0.5, 5, 0.0),
    ],
)
def test_t_quantile_matches_published_values(p, df, want):
    assert t_quantile(p, df) == pytest.approx(want, abs=2e-6)


def test_t_cdf_and_incomplete_beta_hand_cases():
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert t_cdf(2.0, 2) == pytest.approx(0.5 + 2 / (2 * math.sqrt(6)))  # df 2: 1/2 + t / (2 sqrt(2 + t^2))
    assert regularized_incomplete_beta(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert regularized_incomplete_beta(2, 3, 0.4) == pytest.approx(0.5248)  # 1 - sum_{k<2} C(4,k) .4^k .6^(4-k)
    for bad in (lambda: t_quantile(1.0, 3), lambda: t_quantile(0.9, 0), lambda: regularized_incomplete_beta(1, 1, 2)):
        with pytest.raises(ValueError):
            bad()


def test_t_interval_hand_case():
    iv = t_interval([1.0, 2.0, 3.0, 4.0])
    se = math.sqrt(5 / 3) / 2  # sample std sqrt(5/3), n 4
    assert iv.mean == 2.5 and iv.n == 4 and iv.std == pytest.approx(math.sqrt(5 / 3))
    assert iv.half_width == pytest.approx(3.182446 * se, rel=1e-6)
    assert iv.low == pytest.approx(2.5 - 3.182446 * se, rel=1e-6) and iv.excludes_zero
    one = t_interval([3.2])
    assert one.half_width is None and one.low is None and not one.excludes_zero
    with pytest.raises(ValueError, match="no values"):
        t_interval([])
    with pytest.raises(ValueError, match="finite"):
        t_interval([1.0, float("nan")])


def test_paired_difference_hand_case_and_why_pairing():
    # Each seed moves both models alike (seed 1 worse): the pairs cancel it.
    a = {0: 3.00, 1: 3.20, 2: 3.10}
    b = {0: 3.10, 1: 3.35, 2: 3.30}
    iv = paired_difference(a, b)  # differences -0.10, -0.15, -0.20: mean -0.15, std 0.05
    assert iv.mean == pytest.approx(-0.15) and iv.std == pytest.approx(0.05) and iv.n == 3
    assert iv.half_width == pytest.approx(4.302653 * 0.05 / math.sqrt(3), rel=1e-6)
    verdict = compare("rho=0.8", "pure MoE", iv)
    assert verdict["verdict"] == "lower" and verdict["claim"] and verdict["text"].startswith("rho=0.8 is lower than")
    # Negative control: ignoring the pairing (two separate intervals) cannot tell them apart.
    ia, ib = t_interval(list(a.values())), t_interval(list(b.values()))
    assert ia.high > ib.low
    with pytest.raises(ValueError, match=r"only in a \[3\]"):
        paired_difference({**a, 3: 3.0}, b)


def test_compare_claims_only_outside_zero():
    higher = compare("A", "B", t_interval([0.2, 0.3, 0.25]))
    assert higher["verdict"] == "higher" and higher["claim"]
    unresolved = compare("A", "B", t_interval([0.2, -0.1, 0.05]))
    assert unresolved["verdict"] == "unresolved" and not unresolved["claim"] and "not told apart" in unresolved["text"]
    single = compare("A", "B", t_interval([-0.3]))
    assert single["verdict"] == "no interval" and not single["claim"]


def test_linear_slope_hand_case():
    fit = linear_slope([0, 1, 2, 3], [1.0, 0.9, 0.85, 0.7])
    # slope = sum(xc*y)/sxx = (-1.5*1 - .5*.9 + .5*.85 + 1.5*.7)/5 = -0.095
    assert fit["slope"].mean == pytest.approx(-0.095)
    assert fit["intercept"] == pytest.approx(0.8625 + 0.095 * 1.5)  # mean y 0.8625 at mean x 1.5
    resid = np.array([1.0, 0.9, 0.85, 0.7]) - (fit["intercept"] - 0.095 * np.arange(4))
    se = math.sqrt(float(resid @ resid) / 2 / 5)
    assert fit["slope"].half_width == pytest.approx(4.302653 * se, rel=1e-6) and fit["slope"].excludes_zero
    assert linear_slope([1, 2], [3, 4])["slope"].half_width is None
    with pytest.raises(ValueError, match="distinct x"):
        linear_slope([1, 1, 1], [1, 2, 3])


def _curves(shape, n: int, seeds: int = 3, noise: float = 0.05, rng_seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(rng_seed)
    return [{x: list(shape(x) + rng.normal(0, noise, seeds)) for x in GRID} for _ in range(n)]


def test_no_minimum_claimed_on_flat_noisy_curves():
    flat = _curves(lambda x: 3.0, 200)
    results = [quadratic_optimum(pts, seed=k, n_boot=500) for k, pts in enumerate(flat)]
    claimed = sum(r["claims_minimum"] for r in results)
    assert claimed <= 5, claimed  # 200 curves at a 2.5% one-sided level: expect <= 5 (measured 4)
    assert not any(r["claims_minimum"] for r in results[:20])
    # Negative control: "the lowest mean lies inside the grid" would claim one most of the time.
    naive = sum(GRID[0] < min(pts, key=lambda x: np.mean(pts[x])) < GRID[-1] for pts in flat)
    assert naive > 100


def test_a_minimum_claimed_on_a_clear_u():
    for k, pts in enumerate(_curves(lambda x: 3.0 + 2.0 * (x - 0.6) ** 2, 50, noise=0.02, rng_seed=1)):
        r = quadratic_optimum(pts, seed=k, n_boot=500)
        assert r["claims_minimum"], r["reason"]
        assert r["two_lines"]["break"] == 0.6 and r["two_lines"]["u_shape"]
        assert r["argmin_low"] < 0.6 < r["argmin_high"] and GRID[0] < r["argmin_low"]
        assert r["curvature_positive"] and r["vertex"] == pytest.approx(0.6, abs=0.05)


def test_no_minimum_beyond_the_grid_edge_or_on_a_slope():
    edge = _curves(lambda x: 3.0 + 2.0 * (x - 0.1) ** 2, 20, noise=0.02, rng_seed=2)  # lowest below the grid
    slope = _curves(lambda x: 3.0 - 0.5 * x, 20, noise=0.02, rng_seed=3)
    for pts in edge + slope:
        r = quadratic_optimum(pts, n_boot=500)
        assert not r["claims_minimum"], r
    r = quadratic_optimum(slope[0], n_boot=500)
    assert r["argmin"] == pytest.approx(1.0)  # the lower end when the fit does not curve up


def test_two_lines_hand_case():
    # three seeds; left of 0.6 each seed's slope is its own (hand) OLS slope, then their mean
    curves = {
        0: {0.2: 3.4, 0.4: 3.2, 0.6: 3.0, 0.8: 3.1, 1.0: 3.3},  # left -1.0, right +0.75
        1: {0.2: 3.5, 0.4: 3.2, 0.6: 3.1, 0.8: 3.2, 1.0: 3.4},  # left -1.0, right +0.75
        2: {0.2: 3.3, 0.4: 3.2, 0.6: 3.0, 0.8: 3.0, 1.0: 3.2},  # left -0.75, right +0.5
    }
    r = two_lines(curves, 0.6)
    assert r["left"]["mean"] == pytest.approx(-11 / 12) and r["right"]["mean"] == pytest.approx(2 / 3)
    sd = float(np.std([-1.0, -1.0, -0.75], ddof=1))
    assert r["left"]["half_width"] == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    assert r["u_shape"] and r["break"] == 0.6
    # a seed with one point on a side is left out of that side's line
    r = two_lines({0: {0.2: 3.0, 0.6: 2.0, 1.0: 3.0}, 1: {0.6: 2.0, 1.0: 3.0}}, 0.6)
    assert r["left"]["n"] == 1 and r["right"]["n"] == 2 and not r["u_shape"]
    with pytest.raises(ValueError, match="no seed has two points left"):
        two_lines({0: {0.6: 2.0, 1.0: 3.0}}, 0.6)


def test_no_minimum_claimed_on_a_step_that_a_quadratic_reads_as_a_u():
    # Every table size beats none by the same amount: flat below x = 1, higher at 1 (the shape of
    # an allocation sweep where any table helps). Negative control: the quadratic's own tests pass.
    steps = _curves(lambda x: 3.0 + 0.3 * (x == 1.0), 50, noise=0.02, rng_seed=4)
    results = [quadratic_optimum(pts, seed=k, n_boot=500) for k, pts in enumerate(steps)]
    assert sum(r["curvature_positive"] and r["minimum_inside"] for r in results) >= 45
    assert sum(r["claims_minimum"] for r in results) <= 2, [r["reason"] for r in results if r["claims_minimum"]]
    assert all(r["two_lines"]["right"]["low"] > 0 for r in results if r["two_lines"])  # the rise at 1 is seen


def test_quadratic_optimum_fit_reproducibility_and_refusals():
    exact = {x: [1.0 + 0.5 * x + 2.0 * x * x] * 2 for x in (0.0, 0.5, 1.0, 2.0)}
    r = quadratic_optimum(exact, n_boot=200)
    assert r["coefficients"] == pytest.approx([1.0, 0.5, 2.0], abs=1e-9)
    pts = _curves(lambda x: 3.0 + (x - 0.6) ** 2, 1)[0]
    assert quadratic_optimum(pts, seed=7) == quadratic_optimum(pts, seed=7)
    one_seed = {x: v[:1] for x, v in pts.items()}
    r = quadratic_optimum(one_seed, n_boot=200)
    assert not r["claims_minimum"] and "fewer than two runs" in r["reason"]
    with pytest.raises(ValueError, match="three or more grid points"):
        quadratic_optimum({0.5: [1.0, 2.0], 1.0: [1.0, 1.1]})
    with pytest.raises(ValueError, match="no runs at"):
        quadratic_optimum({0.2: [1.0], 0.5: [], 1.0: [1.0]})
    with pytest.raises(ValueError, match="n_boot"):
        quadratic_optimum(pts, n_boot=10)


def test_p_value_is_the_two_sided_t_test_of_the_mean():
    iv = t_interval([-0.10, -0.12, -0.15])
    t = abs(iv.mean) / (iv.std / math.sqrt(3))
    assert p_value(iv) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)  # closed form at df 2
    assert p_value(t_interval([0.3])) is None  # one value: no spread, no test
    assert compare("A", "B", iv)["p"] == p_value(iv)
    rng = np.random.default_rng(0)
    for _ in range(200):  # the test and the interval agree: p < 5% exactly where the 95% interval excludes 0
        draw = t_interval(rng.normal(rng.normal(0.0, 1.0), 1.0, size=int(rng.integers(2, 8))))
        assert (p_value(draw) < 0.05) == draw.excludes_zero


def test_holm_against_a_hand_computation():
    out = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    # ranked d, a, c, b: 4 x 0.005 = 0.02; 3 x 0.01 = 0.03; 2 x 0.03 = 0.06; max(0.06, 1 x 0.04) = 0.06
    assert {k: v["p_adjusted"] for k, v in out.items()} == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06})
    assert sorted(k for k, v in out.items() if v["holds"]) == ["a", "d"]
    # negative control: every raw p under 0.05, yet two of the four do not hold together
    assert all(v["p"] < 0.05 and v["family"] == 4 for v in out.values())
    only = holm({"a": 0.01, "one seed": None})  # a test without a p is not in the family
    assert list(only) == ["a"] and only["a"]["family"] == 1 and only["a"]["p_adjusted"] == 0.01
