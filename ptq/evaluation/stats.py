"""Uncertainty of every reported number: percentile bootstrap over the evaluation units (windows for
perplexity, items for task accuracy), with a fixed seed so the same results give the same intervals.

A variant and the baseline are scored on the same units, so their difference is estimated *paired*:
each resample draws one set of units and computes both metrics on it. Unit-to-unit difficulty then
cancels, and the interval of the difference is far narrower than the two intervals side by side would
suggest. A difference is "distinguishable from zero" when its 95% interval excludes 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95
_CHUNK = 200  # resamples drawn at a time, so memory stays at _CHUNK x units

Statistic = Callable[[np.ndarray], np.ndarray]  # unit means along the last axis -> the metric


def identity(means: np.ndarray) -> np.ndarray:
    return means


def describe() -> dict:
    """How the intervals are made, for results.json and the report."""
    return {"method": "percentile bootstrap", "resamples": RESAMPLES, "seed": SEED, "confidence": CONFIDENCE}


def _resampled_means(units: np.ndarray) -> np.ndarray:
    """Means of `units` [k, n] (k metrics on the same n units) over RESAMPLES resamples of the n units:
    [k, RESAMPLES]. Every metric sees the same resampled units (that is what makes deltas paired)."""
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
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return [float(lo), float(hi)]


def estimate(units, statistic: Statistic = identity) -> dict:
    """`statistic(mean of units)` with its bootstrap standard error and 95% interval."""
    units = np.asarray(units, dtype=np.float64)
    samples = statistic(_resampled_means(units)[0])
    return {
        "value": float(statistic(units.mean())),
        "stderr": float(samples.std(ddof=1)) if len(units) > 1 else 0.0,
        "ci": _interval(samples),
        "n": int(len(units)),
    }


def paired_delta(base_units, variant_units, delta: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> dict:
    """`delta(variant mean, base mean)` on the same units, with a paired bootstrap interval and whether
    that interval excludes zero."""
    base_units = np.asarray(base_units, dtype=np.float64)
    variant_units = np.asarray(variant_units, dtype=np.float64)
    if base_units.shape != variant_units.shape:
        raise ValueError(f"paired units differ in shape: {base_units.shape} vs {variant_units.shape}")
    base_samples, variant_samples = _resampled_means(np.stack([base_units, variant_units]))
    samples = delta(variant_samples, base_samples)
    ci = _interval(samples)
    return {
        "delta": float(delta(variant_units.mean(), base_units.mean())),
        "stderr": float(samples.std(ddof=1)) if len(base_units) > 1 else 0.0,
        "ci": ci,
        "significant": bool(ci[0] > 0 or ci[1] < 0),
        "n": int(len(base_units)),
    }


def difference(variant: np.ndarray, base: np.ndarray) -> np.ndarray:
    return variant - base


def ratio_pct_of_exp(variant: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Relative change of exp(mean NLL), i.e. of perplexity, in percent."""
    return 100 * np.expm1(variant - base)
