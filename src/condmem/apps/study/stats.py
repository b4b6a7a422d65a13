"""Statistics of `condmem study`: intervals over seeds, the fitted optimum of a curve, and claims
made only where an interval allows them.

* `t_interval`, `paired_difference`: a mean (of values, or of per-seed differences between
  two models trained with the same seeds) with its Student-t confidence interval.
* `compare`: says "A lower than B" only when the interval of A - B lies below zero (and
  "higher" only above); otherwise that the runs do not tell them apart.
* `p_value`, `holm`: the two-sided t-test p of an interval's mean, and Holm's step-down
  correction over a family of such tests (a claim in the family holds only where its adjusted
  p stays within the family-wise error).
* `linear_slope`: least-squares slope with its t-interval (e.g. loss per decade of rows).
* `quadratic_optimum`: a quadratic fitted to loss against a grid (rho), its argmin with a
  bootstrap interval (seeds resampled within each point), and whether a minimum may be
  claimed: curvature significantly positive, the argmin's interval inside the grid, AND the
  two-lines test (`two_lines`) finding the loss falling into the minimum and rising out of it.

Pure Python and numpy: the t quantile inverts the t distribution's CDF (a regularised
incomplete beta function, by its continued fraction) by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# ----------------------------------------------------------------------------- the t distribution


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if not (a > 0 and b > 0):
        raise ValueError(f"incomplete beta needs a, b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete beta needs x in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t distribution: df must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` > 0 degrees of freedom (|error| < 1e-10).

    Example: ``t_quantile(0.975, 4)`` is 2.776445 (a 95% two-sided interval from 5 values)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t quantile: p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"t quantile: df must be > 0, got {df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- intervals


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided Student-t confidence interval."""

    mean: float
    half_width: float | None
    """t * std / sqrt(n); None with fewer than two values (no spread measured)."""
    n: int
    """Values (or seed pairs) behind the mean."""
    std: float | None
    """Sample standard deviation (n - 1); None with one value."""
    t: float | None
    """The t quantile used (df = n - 1)."""
    confidence: float = 0.95

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of zero (False without an interval)."""
        return self.half_width is not None and (self.low > 0 or self.high < 0)

    def to_dict(self) -> dict:
        return {
            "mean": self.mean,
            "half_width": self.half_width,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "std": self.std,
            "t": self.t,
            "confidence": self.confidence,
            "excludes_zero": self.excludes_zero,
        }


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of `values` with its t-interval (df = n - 1); one value: no interval.

    Raises ValueError for no values or a value that is not finite."""
    _check_confidence(confidence)
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("t_interval: no values")
    bad = [v for v in xs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"t_interval: values must be finite, got {bad}")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, None, n, None, None, confidence)
    std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (n - 1))
    t = t_quantile(0.5 + confidence / 2.0, n - 1)
    return Interval(mean, t * std / math.sqrt(n), n, std, t, confidence)


def paired_difference(a: Mapping[Hashable, float], b: Mapping[Hashable, float], confidence: float = 0.95) -> Interval:
    """Mean of ``a[seed] - b[seed]`` over seeds with its t-interval.

    Args:
        a, b: seed -> value (e.g. validation loss) of two models trained with the same seeds
            (initialisation and data order), so each difference cancels what the seed shares.

    Raises ValueError when the two models' seeds differ (a run missing on one side): pair
    the runs you have explicitly rather than let a missing run drop silently.
    """
    if set(a) != set(b):
        raise ValueError(
            f"paired_difference: the seeds differ: only in a {sorted(set(a) - set(b), key=str)}, "
            f"only in b {sorted(set(b) - set(a), key=str)}"
        )
    seeds = sorted(a, key=str)
    return t_interval([a[s] - b[s] for s in seeds], confidence)


def p_value(diff: Interval) -> float | None:
    """Two-sided p of the t-test that the mean behind `diff` is 0 (df = n - 1): the chance of a
    mean at least this far from 0 if there were no effect. None with one value (no spread)."""
    if diff.std is None:
        return None
    if diff.std == 0.0:
        return 1.0 if diff.mean == 0.0 else 0.0
    t = abs(diff.mean) / (diff.std / math.sqrt(diff.n))
    return 2.0 * t_cdf(-t, diff.n - 1)


def holm(p_values: Mapping[Hashable, float | None], alpha: float = 0.05) -> dict[Hashable, dict]:
    """Holm's step-down correction over one family of tests, at family-wise error `alpha`.

    Ranked by p (smallest first), the test of rank k (from 1) among m has the adjusted p
    ``max over ranks j <= k of min(1, (m - j + 1) p_j)``, and holds where that is <= alpha: the
    chance that any test of the family holds where no effect exists stays within alpha, whatever
    their dependence. Tests without a p (one seed) are left out of the family. Returns
    ``{key: {"p", "p_adjusted", "holds", "family"}}`` for the keys with a p."""
    _check_confidence(1.0 - alpha)
    ranked = sorted(((p, k) for k, p in p_values.items() if p is not None), key=lambda pk: pk[0])
    m, running, out = len(ranked), 0.0, {}
    for j, (p, key) in enumerate(ranked):
        running = max(running, min(1.0, (m - j) * p))
        out[key] = {"p": p, "p_adjusted": running, "holds": running <= alpha, "family": m}
    return out


def compare(a_name: str, b_name: str, diff: Interval, *, unit: str = "nats") -> dict:
    """A claim about ``diff`` = A - B (e.g. `paired_difference` of losses), in words and fields.

    Returns ``{"a", "b", "difference": diff.to_dict(), "p", "verdict", "claim", "text"}`` (``p``:
    `p_value`); verdict
    ``lower`` (A below B: the interval lies below 0), ``higher`` (above 0), ``unresolved``
    (the interval contains 0) or ``no interval`` (one seed); ``claim`` is True only for
    ``lower`` / ``higher``.
    """
    pct = f"{round(100 * diff.confidence)}%"
    if diff.half_width is None:
        verdict = "no interval"
        text = f"{a_name} - {b_name} = {diff.mean:+.4f} {unit} from one seed: no interval, no claim"
    else:
        span = f"{diff.mean:+.4f} {unit}, {pct} CI [{diff.low:+.4f}, {diff.high:+.4f}], {diff.n} seeds"
        if diff.high < 0:
            verdict, text = "lower", f"{a_name} is lower than {b_name}: {span}"
        elif diff.low > 0:
            verdict, text = "higher", f"{a_name} is higher than {b_name}: {span}"
        else:
            verdict, text = "unresolved", f"{a_name} and {b_name} are not told apart (the interval holds 0): {span}"
    return {
        "a": a_name,
        "b": b_name,
        "difference": diff.to_dict(),
        "p": p_value(diff),
        "verdict": verdict,
        "claim": verdict in ("lower", "higher"),
        "text": text,
    }


def linear_slope(xs: Sequence[float], ys: Sequence[float], confidence: float = 0.95) -> dict:
    """Least-squares line ``y = intercept + slope * x`` over every (x, y) (one per run).

    Returns ``{"slope": Interval (df = n - 2), "intercept", "n"}``; the slope's interval is
    None with two points. Raises ValueError with fewer than two points, unequal lengths, or
    a single distinct x."""
    _check_confidence(confidence)
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"linear_slope: xs and ys must be two equal-length lists, got {x.shape} and {y.shape}")
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("linear_slope: needs two or more points at two or more distinct x")
    xc = x - x.mean()
    sxx = float(xc @ xc)
    slope = float(xc @ (y - y.mean())) / sxx
    intercept = float(y.mean() - slope * x.mean())
    n = len(x)
    if n < 3:
        return {"slope": Interval(slope, None, n, None, None, confidence), "intercept": intercept, "n": n}
    resid = y - (intercept + slope * x)
    se = math.sqrt(float(resid @ resid) / (n - 2) / sxx)
    t = t_quantile(0.5 + confidence / 2.0, n - 2)
    return {"slope": Interval(slope, t * se, n, None, t, confidence), "intercept": intercept, "n": n}


def slope_over_seeds(
    curves: Mapping[Hashable, tuple[Sequence[float], Sequence[float]]], confidence: float = 0.95
) -> Interval:
    """Each seed's least-squares slope of y on x, then their mean with its t-interval over seeds.

    A seed's runs share initialisation and data order all along a curve (every table size, every
    token budget), so the seeds, not the runs, are the independent units: a line through every run
    would count each seed's shared part as many times as it has points. Raises ValueError for a
    seed with fewer than two distinct x."""
    slopes = []
    for seed, (xs, ys) in sorted(curves.items(), key=lambda kv: str(kv[0])):
        x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        if x.shape != y.shape or x.ndim != 1 or len(x) < 2 or np.ptp(x) == 0:
            raise ValueError(f"slope_over_seeds: seed {seed!r} needs two or more points at distinct x")
        xc = x - x.mean()
        slopes.append(float(xc @ (y - y.mean())) / float(xc @ xc))
    if not slopes:
        raise ValueError("slope_over_seeds: no seeds")
    return t_interval(slopes, confidence)


# ----------------------------------------------------------------------------- the optimum of a curve


def _normal_quantile(p: float) -> float:
    """The standard normal's `p` quantile (bisection on erf)."""
    lo, hi = -40.0, 40.0
    while hi - lo > 1e-13:
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _constrained_argmin(coef: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Argmin over [lo, hi] of ``c0 + c1 u + c2 u^2`` for each column of coef [3, B] (u: centred x)."""
    c1, c2 = coef[1], coef[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = np.where(c2 > 0, -c1 / (2 * c2), np.nan)
    ends = np.where(c1 * (hi - lo) + c2 * (hi * hi - lo * lo) < 0, hi, lo)  # the lower end of the two
    return np.where(c2 > 0, np.clip(vertex, lo, hi), ends)


def _bootstrap_argmin_interval(
    runs: dict[float, list[float]],
    grid: list[float],
    centre: float,
    argmin: float,
    confidence: float,
    n_boot: int,
    seed: int,
) -> tuple[float, float]:
    """`quadratic_optimum`'s argmin interval (in u = x - centre): each point's runs resampled, the
    means fitted (the same x for every resample), small-sample corrected as its docstring says."""
    lo, hi = grid[0] - centre, grid[-1] - centre
    rng = np.random.default_rng(seed)
    means = np.empty((n_boot, len(grid)))
    for j, x in enumerate(grid):
        vals = np.array(runs[x])
        n = len(vals)
        if n > 1:  # resampled means then vary as much as a mean of n runs does (s^2/n, not (n-1)/n of it)
            vals = vals.mean() + (vals - vals.mean()) * math.sqrt(n / (n - 1))
        means[:, j] = vals[rng.integers(0, n, size=(n_boot, n))].mean(1)
    u = np.array(grid) - centre
    fit = np.linalg.pinv(np.stack([np.ones_like(u), u, u * u], axis=1))  # [3, P]
    boot = _constrained_argmin(fit @ means.T, lo, hi)
    alpha = 1.0 - confidence
    b_lo, b_hi = (float(q) for q in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
    within_df = sum(len(v) - 1 for v in runs.values())
    if within_df >= 1:  # a few runs per point: widen by t / z, as a t-interval is wider than a normal one
        widen = t_quantile(1 - alpha / 2, within_df) / _normal_quantile(1 - alpha / 2)
        b_lo = max(lo, argmin - (argmin - b_lo) * widen)
        b_hi = min(hi, argmin + (b_hi - argmin) * widen)
    return b_lo, b_hi


def two_lines(curves: Mapping[Hashable, Mapping[float, float]], break_x: float, confidence: float = 0.95) -> dict:
    """The two-lines test of a U (Simonsohn, 2018): one line through the points at or below
    `break_x`, one through those at or above it; a U only where the first falls and the second
    rises, each slope's interval excluding zero (both must hold, so no correction is due).

    A quadratic reads any convex curve as a U: one flat over most of the grid and higher at one
    end (a table of any size beating none) gives a positive curvature and a vertex mid-grid, while
    nothing rises toward the other end. The two lines ask for the rise on both sides.

    Args:
        curves: seed -> {x: loss}. Each line's slope is taken per seed (seeds with two or more x
            on that side), then averaged over seeds with its t-interval (`slope_over_seeds`),
            since a seed's runs share initialisation and data order along the grid.
        break_x: where the lines meet (a grid point, counted on both sides).

    Returns ``{"break", "left", "right"}`` (slopes as Interval dicts, per unit of x) and
    ``u_shape``. Raises ValueError when a side has no seed with two points."""
    sides = {}
    for side, keep in (("left", lambda x: x <= break_x), ("right", lambda x: x >= break_x)):
        segs = {}
        for seed, curve in curves.items():
            xs = sorted(float(x) for x in curve if keep(float(x)))
            if len(xs) >= 2:
                segs[seed] = (xs, [float(curve[x]) for x in xs])
        if not segs:
            raise ValueError(f"two_lines: no seed has two points {side} of the break at {break_x}")
        sides[side] = slope_over_seeds(segs, confidence)
    left, right = sides["left"], sides["right"]
    falls = left.half_width is not None and left.high < 0
    rises = right.half_width is not None and right.low > 0
    return {"break": break_x, "left": left.to_dict(), "right": right.to_dict(), "u_shape": falls and rises}


def _two_lines_at_argmin(by_seed: dict[float, dict], grid: list[float], argmin: float) -> dict:
    """`two_lines` over `quadratic_optimum`'s runs ({x: {seed: loss}}), the lines meeting at the
    interior grid point nearest the fitted minimum."""
    curves: dict[Hashable, dict[float, float]] = {}
    for x, vs in by_seed.items():
        for seed, v in vs.items():
            curves.setdefault(seed, {})[x] = float(v)
    return two_lines(curves, min(grid[1:-1], key=lambda x: abs(x - argmin)))


def _two_lines_text(test: dict) -> str:
    def said(iv: dict) -> str:
        span = "" if iv["half_width"] is None else f" [{iv['low']:+.3f}, {iv['high']:+.3f}]"
        return f"{iv['mean']:+.3f}{span}"

    return f"slopes {said(test['left'])} below and {said(test['right'])} above {test['break']:g}"


def _minimum_verdict(
    few: list[float], positive: bool, vertex_inside: bool, interval_inside: bool, lines: dict | None
) -> tuple[str, bool]:
    """(reason, whether a minimum is claimed): the first of `quadratic_optimum`'s tests that fails."""
    if few:
        return f"fewer than two runs at x = {few}: no spread to test against", False
    if not positive:
        return "the curvature's interval does not lie above 0: no U-shape shown", False
    if not vertex_inside:
        return "the fitted minimum lies at or beyond the grid's edge", False
    if not interval_inside:
        return "the argmin's interval reaches the grid's edge", False
    if lines is None or not lines["u_shape"]:
        how = "" if lines is None else f": {_two_lines_text(lines)}"
        return f"the two lines do not both resolve a fall into the minimum and a rise out of it{how}", False
    return f"curvature above 0, the argmin's interval inside the grid, and two lines ({_two_lines_text(lines)})", True


def quadratic_optimum(
    points: Mapping[float, Sequence[float]],
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """Fit ``loss = c0 + c1 x + c2 x^2`` over a grid and locate its minimum, with intervals.

    Args:
        points: grid value x (e.g. rho) -> the losses of its runs, as {seed: loss} (a list is
            read as seeds 0, 1, ...). Three or more distinct x; a minimum is claimed only where
            every point has two runs or more.
        n_boot: bootstrap resamples; `seed`: their generator's seed (the result is a function
            of the inputs and `seed`).

    The fit is least squares over every run. ``curvature`` is c2 with its t-interval
    (df = runs - 3). ``argmin`` is the fit's minimum over the grid's range [min x, max x]
    (the vertex where c2 > 0 and it lies inside, else the lower end); its interval is the
    bootstrap percentile interval of that argmin with each point's runs resampled with
    replacement (fixed generator), two small-sample corrections applied: each point's
    deviations from its mean scaled by sqrt(n / (n - 1)), and the interval's two arms
    widened by t / z (df: runs - points), clipped to the grid. Measured coverage of the true
    argmin on synthetic U's (7 points, noise 0.05): 92-95% with 3-5 runs a point, 87-91%
    with 2 (the uncorrected percentile interval: 84-90% and 71%). A minimum is claimed
    (``claims_minimum``) only when the curvature's interval lies above 0, the vertex lies
    inside the grid and so does the whole argmin interval, strictly, and `two_lines`, broken
    at the interior grid point nearest the argmin, finds a U; ``reason`` says which test failed.
    Measured on synthetic curves over 7 points (noise 0.05 a run, 400 curves each, 2 / 3 / 5
    runs a point): minima claimed on flat curves 0 / 0 / 0.25% (the quadratic's tests alone:
    1.0 / 2.3 / 1.0%); on a step (flat, 0.3 higher at the last point) 0.8 / 2.8 / 4.3% (alone:
    71 / 94 / 99.5%, the failure the two lines exist for); on a U of depth 0.32 nats 19 / 91 / 100%.

    Returns a dict: ``coefficients`` [c0, c1, c2] (in x), ``curvature`` (Interval dict),
    ``curvature_positive``, ``vertex`` (None where c2 <= 0), ``argmin``, ``argmin_low``,
    ``argmin_high``, ``minimum_inside``, ``two_lines`` (None where the vertex is not inside),
    ``claims_minimum``, ``reason``, ``grid``, ``n_runs``, ``n_boot``, ``seed``, ``confidence``.
    """
    _check_confidence(confidence)
    if not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"quadratic_optimum: n_boot must be an int >= 100, got {n_boot!r}")
    grid = sorted(float(x) for x in points)
    if len(grid) < 3:
        raise ValueError(f"quadratic_optimum: a quadratic needs three or more grid points, got {grid}")
    by_seed = {float(x): dict(vs) if isinstance(vs, Mapping) else dict(enumerate(vs)) for x, vs in points.items()}
    runs = {x: [float(v) for v in vs.values()] for x, vs in by_seed.items()}
    empty = [x for x, vs in runs.items() if not vs]
    if empty:
        raise ValueError(f"quadratic_optimum: no runs at x = {empty}")
    bad = [(x, v) for x, vs in runs.items() for v in vs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"quadratic_optimum: losses must be finite, got {bad}")
    centre = float(np.mean(grid))  # fit in u = x - centre (better conditioned); report in x
    lo, hi = grid[0] - centre, grid[-1] - centre
    xs = np.array([x - centre for x in grid for _ in runs[x]])
    ys = np.array([v for x in grid for v in runs[x]])
    design = np.stack([np.ones_like(xs), xs, xs * xs], axis=1)
    coef, *_ = np.linalg.lstsq(design, ys, rcond=None)
    n_runs = len(ys)
    df = n_runs - 3
    if df >= 1:
        resid = ys - design @ coef
        cov = float(resid @ resid) / df * np.linalg.inv(design.T @ design)
        t = t_quantile(0.5 + confidence / 2.0, df)
        curvature = Interval(float(coef[2]), t * math.sqrt(cov[2, 2]), n_runs, None, t, confidence)
    else:
        curvature = Interval(float(coef[2]), None, n_runs, None, None, confidence)
    vertex = float(-coef[1] / (2 * coef[2])) if coef[2] > 0 else None
    argmin = float(_constrained_argmin(coef[:, None], lo, hi)[0])

    b_lo, b_hi = _bootstrap_argmin_interval(runs, grid, centre, argmin, confidence, n_boot, seed)

    positive = curvature.half_width is not None and curvature.low > 0
    vertex_inside = vertex is not None and lo < vertex < hi
    interval_inside = lo < b_lo and b_hi < hi
    lines = _two_lines_at_argmin(by_seed, grid, argmin + centre) if vertex_inside else None
    few = [x for x in grid if len(runs[x]) < 2]
    reason, claims = _minimum_verdict(few, positive, vertex_inside, interval_inside, lines)
    # Back to x: c0 + c1 (x - m) + c2 (x - m)^2.
    c0, c1, c2 = (float(c) for c in coef)
    in_x = [c0 - c1 * centre + c2 * centre * centre, c1 - 2 * c2 * centre, c2]
    return {
        "coefficients": in_x,
        "curvature": curvature.to_dict(),
        "curvature_positive": positive,
        "vertex": None if vertex is None else vertex + centre,
        "argmin": argmin + centre,
        "argmin_low": b_lo + centre,
        "argmin_high": b_hi + centre,
        "minimum_inside": vertex_inside and interval_inside,
        "two_lines": lines,
        "claims_minimum": claims,
        "reason": reason,
        "grid": grid,
        "n_runs": n_runs,
        "n_boot": n_boot,
        "seed": seed,
        "confidence": confidence,
    }
