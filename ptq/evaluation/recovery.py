"""How a variant's metric measures against the baseline's: an accuracy's recovery, a lower-is-better
metric's plain ratio, and which direction of a task metric is better."""

from __future__ import annotations

import math
from fractions import Fraction

# lm-eval's lower-is-better metrics, for a metric whose direction the results do not record
# (results.json records lm-eval's own per task, TaskInfo.higher_is_better, and that decides wherever
# it is known)
LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter")


def higher_is_better(metric: str, recorded: dict[str, bool] | None = None) -> bool:
    """Whether a higher value of a task metric is better: as `recorded` (a TaskInfo's
    higher_is_better, keyed by lm-eval's metric name, without the filter) says, else by the names of
    LOWER_IS_BETTER."""
    name = metric.partition(",")[0]
    for key in (metric, name):
        if recorded and key in recorded:
            return bool(recorded[key])
    return name not in LOWER_IS_BETTER


def accuracy_recovery_pct(variant_acc: float, baseline_acc: float) -> float:
    """100 * variant / baseline; a zero baseline cannot be fallen short of (100%); NaN when
    either is NaN (a NaN fails every gate). An accuracy is a count over a count held as the
    nearest float: each is read back as that fraction (denominators up to 10^7: two such
    fractions lie 10^-14 apart or more, a float's rounding 10^-16) and the ratio rounded once, so
    that a variant exactly at a limit is at it: 99 of 104 against 100 of 104 is 99%, not the
    98.99999999999999% of the float quotient, which would fail a 99% gate that the documentation
    calls inclusive."""
    if math.isnan(variant_acc) or math.isnan(baseline_acc):
        return math.nan
    if not baseline_acc > 0:
        return 100.0
    if not math.isfinite(variant_acc) or not math.isfinite(baseline_acc):
        return 100.0 * (variant_acc / baseline_acc)
    exact = _count_ratio(variant_acc) / _count_ratio(baseline_acc)
    return float(100 * exact)  # equal accuracies: exactly 100


def _count_ratio(share: float) -> Fraction:
    """The fraction of denominator up to 10^7 whose nearest float `share` is; `share` exactly where
    none is (a share not from counts: 4e-08 would read as 0)."""
    fraction = Fraction(share).limit_denominator(10**7)
    return fraction if float(fraction) == share else Fraction(share)


def ratio_pct(variant: float, baseline: float) -> float:
    """100 * variant / baseline for a lower-is-better metric (above 100: worse); 100 when both are
    0, NaN when only the baseline is 0 or either is NaN."""
    if baseline == 0:
        return 100.0 if variant == 0 else math.nan
    return 100.0 * variant / baseline
