"""Uncertainty of every reported number: percentile bootstrap over the evaluation units (windows for
perplexity, items for task accuracy), with a fixed seed so the same results give the same intervals.
A task metric that is 0 or 1 per item (a proportion) has Wilson's score interval instead
(estimate_share).

A variant and the baseline are scored on the same units, so their difference is estimated *paired*:
each resample draws one set of units and computes both metrics on it. Unit-to-unit difficulty then
cancels, and the interval of the difference is far narrower than the two intervals side by side
would suggest. A difference is "distinguishable from zero" when its 95% interval excludes 0.

Fewer than MIN_UNITS units give no interval: the standard error and both ends are NaN
(results.json's value for a number that is not available) and no difference is distinguishable from
zero. With n <= 3 units the resample that draws the smallest unit n times has probability n ** -n >=
1/27 = 3.7%, above the 2.5% of a tail (and so for the largest), so the percentile "interval" is the
smallest and largest unit: the range of the data, not an estimate (two windows of one sign made any
difference "distinguishable"). From MIN_UNITS up the interval exists but is still narrower than a
95% one for few units (docs/reports.md gives its measured coverage).

A statistic that overflows (the perplexity of a collapsed variant, exp of a mean NLL past 709 nats)
is inf, and so are the interval's ends that it reaches; they are not interpolated into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95
_CHUNK = 200  # resamples drawn at a time, so memory stays at _CHUNK x units
MIN_UNITS = (
    4  # fewer units: no standard error, no interval, never distinguishable from zero (see above)
)
NOT_AVAILABLE = float("nan")

Statistic = Callable[[np.ndarray], np.ndarray]  # unit means along the last axis -> the metric


def identity(means: np.ndarray) -> np.ndarray:
    return means


def describe() -> dict:
    """How the intervals are made, for results.json and the report."""
    return {
        "method": "percentile bootstrap",
        "resamples": RESAMPLES,
        "seed": SEED,
        "confidence": CONFIDENCE,
    }


def _resampled_means(units: np.ndarray) -> np.ndarray:
    """Means of `units` [k, n] (k metrics on the same n units) over RESAMPLES resamples of the n
    units: [k, RESAMPLES]. Every metric sees the same resampled units (that is what makes deltas
    paired)."""
    units = np.atleast_2d(np.asarray(units, dtype=np.float64))
    n = units.shape[1]
    if n == 0:
        raise ValueError("cannot bootstrap zero units")
    rng = np.random.default_rng(SEED)
    out = np.empty((units.shape[0], RESAMPLES))
    for start in range(0, RESAMPLES, _CHUNK):
        stop = min(start + _CHUNK, RESAMPLES)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[:, start:stop] = units[:, idx].mean(-1)
    return out


def _interval(samples: np.ndarray) -> list[float]:
    tail = 100 * (1 - CONFIDENCE) / 2
    if np.isfinite(samples).all():
        lo, hi = np.percentile(samples, [tail, 100 - tail])
    else:  # inf - inf would interpolate to NaN: take the samples at or beyond each end instead
        lo = np.percentile(samples, tail, method="lower")
        hi = np.percentile(samples, 100 - tail, method="higher")
    return [float(lo), float(hi)]


def _spread(samples: np.ndarray) -> tuple[float, list[float]]:
    """The standard error and 95% interval of bootstrap `samples` of a statistic."""
    with np.errstate(invalid="ignore"):  # inf samples: the standard error is NaN, not a warning
        stderr = float(samples.std(ddof=1))
    return stderr, _interval(samples)


def _check_units(n: int) -> None:
    if n == 0:
        raise ValueError("cannot bootstrap zero units")


def estimate(units, statistic: Statistic = identity) -> dict:
    """`statistic(mean of units)` with its bootstrap standard error and 95% interval (NaN with fewer
    than MIN_UNITS units)."""
    units = np.asarray(units, dtype=np.float64)
    _check_units(len(units))
    with np.errstate(over="ignore"):  # exp of a huge mean NLL: an infinite perplexity, as it is
        value = float(statistic(units.mean()))
        if len(units) < MIN_UNITS:
            stderr, ci = NOT_AVAILABLE, [NOT_AVAILABLE, NOT_AVAILABLE]
        else:
            stderr, ci = _spread(statistic(_resampled_means(units)[0]))
    return {"value": value, "stderr": stderr, "ci": ci, "n": int(len(units))}


def estimate_share(units) -> dict:
    """estimate() of per-document scores (task metrics). Where every unit is 0 or 1 (acc,
    exact_match: a count of successes) the 95% interval is Wilson's score interval for a binomial
    proportion: the percentile bootstrap's collapses at the edge (6 of 6 right gave [1, 1]; at 20
    documents and p = 0.97 it held p 45% of the time), Wilson's about 95% of the time on average
    over p at any n (98% there; it dips to 84-85% for some p near 0 or 1: 0.978 at n = 8, 0.004 at n
    = 40). Other scores keep the bootstrap's."""
    e = estimate(units)
    units = np.asarray(units, dtype=np.float64)
    if len(units) >= MIN_UNITS and np.isin(units, (0.0, 1.0)).all():
        e["ci"] = wilson(int(units.sum()), len(units))
    return e


def wilson(successes: int, n: int) -> list[float]:
    """Wilson's score interval (no continuity correction) for `successes` of `n`, at CONFIDENCE."""
    z = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
    p, z2 = successes / n, z * z / n
    center = (p + z2 / 2) / (1 + z2)
    half = z / (1 + z2) * math.sqrt(p * (1 - p) / n + z2 / (4 * n))
    # the ends are exact at the edges (0 of n: low 0; n of n: high 1), not a rounding away from them
    return [0.0 if successes == 0 else center - half, 1.0 if successes == n else center + half]


def paired_delta(
    base_units, variant_units, delta: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> dict:
    """`delta(variant mean, base mean)` on the same units, with a paired bootstrap interval and
    whether that interval excludes zero (never with fewer than MIN_UNITS units: then no interval,
    NaN)."""
    base_units = np.asarray(base_units, dtype=np.float64)
    variant_units = np.asarray(variant_units, dtype=np.float64)
    if base_units.shape != variant_units.shape:
        raise ValueError(
            f"paired units differ in shape: {base_units.shape} vs {variant_units.shape}"
        )
    _check_units(len(base_units))
    with np.errstate(over="ignore"):  # a collapsed variant's perplexity ratio: inf, as it is
        value = float(delta(variant_units.mean(), base_units.mean()))
        if len(base_units) < MIN_UNITS:
            stderr, ci = NOT_AVAILABLE, [NOT_AVAILABLE, NOT_AVAILABLE]
        else:
            base_samples, variant_samples = _resampled_means(np.stack([base_units, variant_units]))
            stderr, ci = _spread(delta(variant_samples, base_samples))
    return {
        "delta": value,
        "stderr": stderr,
        "ci": ci,
        # False for NaN ends: no interval, nothing distinguished
        "significant": bool(ci[0] > 0 or ci[1] < 0),
        "n": int(len(base_units)),
    }


def difference(variant: np.ndarray, base: np.ndarray) -> np.ndarray:
    return variant - base


def loss_pct(variant: np.ndarray, base: np.ndarray) -> np.ndarray:
    """How much of the baseline's mean (an accuracy) the variant's falls short of, in percent: 100
    less the recovery."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100 * (1 - variant / base)


def ratio_pct_of_exp(variant: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Relative change of exp(mean NLL), i.e. of perplexity, in percent."""
    return 100 * np.expm1(variant - base)
