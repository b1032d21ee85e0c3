"""The bootstrap's edge cases (ptq.evaluation.stats): too few units for an interval, and statistics that overflow.
Its ordinary intervals are checked against the binomial in test_tasks.py."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import numpy as np
import pytest
from conftest import TEXT

from ptq.evaluation import stats


def exact_bootstrap_interval(units: np.ndarray) -> tuple[float, float]:
    """The 2.5% and 97.5% quantiles of the mean over every one of the n**n equally likely resamples of n units: the
    distribution the Monte Carlo bootstrap samples, enumerated instead (numpy only, no ptq)."""
    n = len(units)
    means = [units[list(idx)].mean() for idx in itertools.product(range(n), repeat=n)]
    lo, hi = np.percentile(
        means, [2.5, 97.5], method="inverted_cdf"
    )  # the distribution's own quantiles
    return float(lo), float(hi)


def test_fewer_than_min_units_give_no_interval_and_never_a_distinguishable_delta():
    # Every window 0.1 nats worse: the old interval was [d, d] at one window and the units' range at two or three,
    # so "distinguishable from 0" read yes on one window.
    for n in (1, 2, 3):  # below stats.MIN_UNITS
        base = 3.0 + 0.5 * np.arange(n)
        d = stats.paired_delta(base, base + 0.1, stats.ratio_pct_of_exp)
        assert d["delta"] == pytest.approx(100 * math.expm1(0.1)) and d["n"] == n
        assert (
            math.isnan(d["stderr"])
            and all(math.isnan(x) for x in d["ci"])
            and d["significant"] is False
        )
        e = stats.estimate(base, np.exp)
        assert e["value"] == pytest.approx(math.exp(base.mean())) and e["n"] == n
        assert math.isnan(e["stderr"]) and all(math.isnan(x) for x in e["ci"])
        # results.json's convention for a number that is not there: NaN, which its reader reads back
        assert all(math.isnan(x) for x in json.loads(json.dumps(d))["ci"])
    with pytest.raises(ValueError, match="zero units"):
        stats.estimate([])


def test_min_units_is_where_the_percentile_interval_stops_being_the_units_range():
    # Why the rule: enumerating the exact bootstrap distribution, at 3 units the 2.5% and 97.5% points are the
    # smallest and largest unit (the smallest unit drawn 3 times has probability 1/27 = 3.7%, above the 2.5% of a tail);
    # at 4 (1/256) they lie inside the range.
    three = np.array([0.2, 0.5, 1.3])
    assert exact_bootstrap_interval(three) == pytest.approx((three.min(), three.max()))
    four = np.array([0.2, 0.5, 1.3, 0.9])
    lo, hi = exact_bootstrap_interval(four)
    assert four.min() < lo < hi < four.max()
    assert stats.MIN_UNITS == 4
    # ptq's Monte Carlo bootstrap (2000 resamples) at 4 units: an interval, close to the exact one
    e = stats.estimate(four)
    assert e["ci"][0] == pytest.approx(lo, abs=0.05) and e["ci"][1] == pytest.approx(hi, abs=0.05)
    d = stats.paired_delta(four, four + 1.0, stats.difference)
    assert d["ci"] == pytest.approx([1.0, 1.0]) and d["significant"] is True


def test_an_overflowing_perplexity_is_inf_with_an_inf_interval_and_no_warning():
    base = np.array([3.0, 3.2, 2.9, 3.1, 3.05])
    collapsed = np.array(
        [720.0, 760.0, 715.0, 800.0, 740.0]
    )  # mean NLL past log(float max) = 709.78 nats
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warning on stderr
        e = stats.estimate(collapsed, np.exp)
        d = stats.paired_delta(base, collapsed, stats.ratio_pct_of_exp)
        partly = stats.estimate(np.array([3.0, 3.1, 2.9, 3000.0, 3.2]), np.exp)
    with np.errstate(over="ignore"):
        assert np.exp(np.float64(collapsed.mean())) == math.inf  # numpy's answer, which ptq gives
    assert e["value"] == math.inf and e["ci"] == [math.inf, math.inf]
    assert d["delta"] == math.inf and d["ci"] == [math.inf, math.inf] and d["significant"] is True
    # one collapsed window among five: resamples with it at most once stay finite (the lower end), the rest do not
    assert math.isfinite(partly["ci"][0]) and partly["ci"][1] == math.inf
    # the interval of the finite means, mapped through exp: its lower end is the (lower) 2.5% point
    rng = np.random.default_rng(stats.SEED)
    units = np.array([3.0, 3.1, 2.9, 3000.0, 3.2])
    means = np.concatenate([units[rng.integers(0, 5, size=(200, 5))].mean(-1) for _ in range(10)])
    assert partly["ci"][0] == pytest.approx(math.exp(np.percentile(means, 2.5, method="lower")))
    # the same with units whose resampled means seldom tie, so that the sample at or below the 2.5% point (the wider
    # interval) and the one at or above it differ
    units = np.append(3 + 0.3 * np.random.default_rng(1).standard_normal(11), 3000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wider = stats.estimate(units, np.exp)
    rng = np.random.default_rng(stats.SEED)
    means = np.concatenate([units[rng.integers(0, 12, size=(200, 12))].mean(-1) for _ in range(10)])
    lower, higher = (math.exp(np.percentile(means, 2.5, method=m)) for m in ("lower", "higher"))
    assert (
        lower < higher
        and wider["ci"][0] == pytest.approx(lower, rel=1e-12)
        and wider["ci"][1] == math.inf
    )


def test_compare_on_too_few_windows_writes_and_reports_no_interval(
    ptq_cli, tiny_model, text_file, tmp_path
):
    other = tmp_path / "other.txt"  # evaluation text apart from the calibration text
    other.write_text(" ".join(reversed(TEXT.split())) * 3)
    out = tmp_path / "out"
    code, _, err = ptq_cli(
        "compare", tiny_model, "--recipes", "fp8-e4m3", "--calib-data", text_file, "--calib-samples", "4",
        "--eval-data", other, "--seq-len", "32", "--max-windows", "2", "--out", out, "-q",
    )  # fmt: skip
    assert code == 0, err
    text = (out / "results.json").read_text()
    r = json.loads(text)  # NaN, as results.json writes a number that is not there (docs/reports.md)
    assert r["eval"]["windows"] == 2 and '"perplexity_ci": [\n      NaN,\n      NaN\n    ]' in text
    for entry in (r["baseline"], *r["variants"]):
        assert all(math.isnan(x) for key in ("perplexity_ci", "accuracy_ci") for x in entry[key])
        assert math.isnan(entry["perplexity_stderr"]) and math.isfinite(entry["perplexity"])
    v = r["variants"][0]
    assert all(
        math.isnan(x) for x in v["ppl_delta_pct_ci"] + v["accuracy_delta_ci"] + v["kl_div_ci"]
    )
    assert v["ppl_delta_significant"] is False and v["accuracy_delta_significant"] is False
    assert v["ppl_delta_pct"] != 0  # a delta that one or two windows used to call distinguishable
    # the report prints the missing interval as such, and `ptq report` reads the file back
    report = (out / "report.md").read_text()
    row = next(
        line for line in report.splitlines() if line.startswith("| fp8-e4m3 |") and "n/a" in line
    )
    assert row.count("n/a") == 4 and "yes" not in row and "nan" not in row
    assert "Fewer than 4 windows give no interval (n/a)" in report
    code, md, err = ptq_cli("report", out / "results.json")
    assert code == 0 and "n/a" in md and "[nan" not in md, err


def test_the_trend_never_calls_a_change_without_an_interval_beyond_the_intervals():
    import dataclasses

    import sample_results as S

    from ptq.reporting.trend import trend

    nan = math.nan
    before = S.compare_results()  # baseline perplexity 10 in [9.8, 10.2]
    moved = S.baseline(perplexity=20.0)  # [19.8, 20.2]: beyond
    assert [
        m.beyond_intervals
        for m in trend(S.compare_results(moved), before)["moves"]
        if m.entry == "bf16"
    ][0]
    unknown = dataclasses.replace(
        moved, perplexity_ci=(nan, nan)
    )  # fewer than 4 windows: no interval
    moves = [m for m in trend(S.compare_results(unknown), before)["moves"] if m.entry == "bf16"]
    assert moves[0].metric == "perplexity" and moves[0].beyond_intervals is False
