"""Gates: limits each quantized variant must stay within, checked against a results file.

    --max-ppl-increase 2%         perplexity may rise at most 2% over the baseline's:
                                  100 * (ppl_variant / ppl_baseline - 1) <= 2
    --min-accuracy-recovery 99%   accuracy recovery = accuracy_variant / accuracy_baseline
                                  >= 99%, for next-token accuracy and for every task in the
                                  results, each of its higher-is-better metrics (acc and
                                  acc_norm; exact_match per filter; the direction is the one
                                  results.json records per task, lm-eval's); `TASK=98%` sets
                                  one task's limit (`next-token` names next-token accuracy);
                                  a task with a limit but no score in the results fails its
                                  gate
    --max-kl 0.01                 mean KL(p_baseline || p_variant) <= 0.01 nats per predicted
                                  token

A gate is a budget on the point estimate: it fails when the measured value is beyond the limit or
not a number (a NaN never passes). A variant whose perplexity is not finite (NaN or inf logits)
fails whatever gates are given. Intervals, where results carry them, are reported next to the values
but do not decide a gate. Percent limits need the '%' sign, so that "0.99" can never be mistaken for
99%.
"""

from __future__ import annotations

import dataclasses
import math

from ptq.errors import PtqError
from ptq.evaluation.recovery import accuracy_recovery_pct, higher_is_better
from ptq.reporting.results import (
    Check,
    CompareResults,
    Entry,
    Gates,
    Limits,
    Results,
    TaskInfo,
    TaskMetric,
)

NEXT_TOKEN = (
    "next-token"  # the name of next-token accuracy among the tasks of --min-accuracy-recovery
)


def parse_percent(value: str, option: str) -> float:
    text = value.strip()
    if not text.endswith("%"):
        raise PtqError(f"{option} takes a percentage such as 2%, not '{value}'")
    try:
        number = float(text[:-1])
    except ValueError:
        raise PtqError(f"{option}: '{value}' is not a percentage such as 2%") from None
    if not number >= 0 or number == float("inf"):
        raise PtqError(f"{option}: '{value}' must be a finite, non-negative percentage")
    return number


def parse_limits(
    max_ppl_increase: str | None = None,
    min_accuracy_recovery: list[str] | None = None,
    max_kl: str | None = None,
) -> Limits:
    """The CLI's gate options -> Limits. min_accuracy_recovery entries are 'P%' or 'TASK=P%'."""
    default, per_task = None, {}
    for entry in min_accuracy_recovery or []:
        task, sep, value = entry.rpartition("=")
        if sep and not task.strip():
            raise PtqError(
                f"--min-accuracy-recovery: '{entry}' names no task (use TASK=99% or 99%)"
            )
        pct = parse_percent(value, "--min-accuracy-recovery")
        # the later one would loosen (or tighten) a gate unseen
        if sep and task.strip() in per_task:
            raise PtqError(
                f"--min-accuracy-recovery sets {task.strip()} twice "
                f"({per_task[task.strip()]:g}%, {pct:g}%): give one"
            )
        if sep:
            per_task[task.strip()] = pct
        elif default is not None:
            raise PtqError(
                "--min-accuracy-recovery: give one limit for all tasks (99%) and per-task limits "
                "as TASK=99%"
            )
        else:
            default = pct
    kl = None
    if max_kl is not None:
        try:
            kl = float(max_kl)
        except ValueError:
            raise PtqError(f"--max-kl takes nats per token such as 0.01, not '{max_kl}'") from None
        if not kl >= 0 or kl == float("inf"):
            raise PtqError(f"--max-kl: '{max_kl}' must be a finite, non-negative number")
    ppl = (
        parse_percent(max_ppl_increase, "--max-ppl-increase")
        if max_ppl_increase is not None
        else None
    )
    return Limits(ppl, default, per_task, kl)


def refuse_unmeasured_gates(
    limits: Limits | None, scored: set[str], source: str = "this run"
) -> None:
    """Stop when a per-task gate names a task that `source` does not score: that gate could only
    fail, and in compare only after the whole run. `scored`: the tasks with results (compare:
    harness.Suite.scored, before the model)."""
    unknown = [
        t
        for t in (limits.task_accuracy_recovery_pct if limits else {})
        if t != NEXT_TOKEN and t not in scored
    ]
    if unknown:
        raise PtqError(
            f"--min-accuracy-recovery names task '{unknown[0]}', which {source} has no accuracy "
            f"for (it has {', '.join([NEXT_TOKEN, *sorted(scored)])}): correct the name, or add "
            "the task to compare's --tasks"
        )


def task_scores(entry: Entry) -> dict[str, dict[str, TaskMetric]]:
    """Per task, per metric, the scores of a baseline or variant entry (none without --tasks)."""
    return {name: scores.metrics for name, scores in (entry.tasks or {}).items()}


def task_info(results: Results, task: str) -> TaskInfo | None:
    return next((t for t in results.tasks or [] if t.name == task), None)


def task_higher_is_better(results: Results, task: str, metric: str) -> bool:
    """A task metric's direction, as the results record it for that task (lm-eval's), else by its
    name."""
    info = task_info(results, task)
    return higher_is_better(metric, info.higher_is_better if info else None)


def entries(results: Results) -> list[Entry]:
    return (
        [results.baseline, *results.variants]
        if isinstance(results, CompareResults)
        else [results.config]
    )


def task_metric_is_share(results: Results, task: str, metric: str) -> bool:
    """Whether a task metric is a share in [0, 1] (acc, exact_match: printed as a percentage) rather
    than a quantity in its own units (likelihood_diff, in nats): every per-document value the
    results hold lies in [0, 1] (a mean of them then does too); without per-document values, every
    value and interval end does."""
    samples = [
        value
        for e in entries(results)
        for value in ((e.task_samples or {}).get(task) or {}).get(metric) or []
    ]
    if not samples:
        for e in entries(results):
            m = task_scores(e).get(task, {}).get(metric)
            if m is not None:
                samples += [m.value, *m.ci]
    # a NaN (no interval) says nothing
    return all(0.0 <= value <= 1.0 for value in samples if not math.isnan(value))


def check(results: CompareResults, limits: Limits) -> list[Check]:
    """Every gate against every variant, in the order of the results' variants."""
    base = results.baseline
    base_tasks = task_scores(base)
    checks: list[Check] = []
    for v in results.variants:
        if limits.max_ppl_increase_pct is not None:
            passed = v.ppl_delta_pct <= limits.max_ppl_increase_pct
            checks.append(
                Check(
                    v.name,
                    "ppl_delta_pct",
                    None,
                    v.ppl_delta_pct,
                    limits.max_ppl_increase_pct,
                    passed,
                )
            )
        accuracies = {(NEXT_TOKEN, None): (v.accuracy, base.accuracy)}
        variant_tasks = task_scores(v)
        accuracies |= {
            (t, m): (variant_tasks[t][m].value, s.value)
            for t, metrics in base_tasks.items()
            for m, s in metrics.items()
            if m in variant_tasks.get(t, {}) and task_higher_is_better(results, t, m)
        }
        for (task, metric), (acc, base_acc) in accuracies.items():
            limit = limits.task_accuracy_recovery_pct.get(task, limits.min_accuracy_recovery_pct)
            if limit is not None:
                recovery = accuracy_recovery_pct(acc, base_acc)
                checks.append(
                    Check(
                        v.name,
                        "accuracy_recovery_pct",
                        task,
                        recovery,
                        limit,
                        recovery >= limit,
                        metric,
                    )
                )
        measured = {task for task, _ in accuracies}
        for task, limit in limits.task_accuracy_recovery_pct.items():
            # a gate on a task that was not measured must not pass silently
            if task not in measured:
                checks.append(Check(v.name, "accuracy_recovery_pct", task, None, limit, False))
        if limits.max_kl is not None:
            checks.append(
                Check(v.name, "kl_div", None, v.kl_div, limits.max_kl, v.kl_div <= limits.max_kl)
            )
        if not math.isfinite(v.perplexity) and limits.max_ppl_increase_pct is None:
            # NaN or inf logits (a non-saturating format's overflow): whatever gates were asked for,
            # a model whose outputs are not numbers does not pass (its accuracy counts those
            # positions wrong, and may still pass)
            checks.append(Check(v.name, "finite_outputs", None, v.perplexity, math.inf, False))
    return checks


def gate_results(results: CompareResults, limits: Limits) -> Gates | None:
    """The `gates` entry of results.json: the limits, each check, and whether all passed."""
    if not limits.any():
        return None
    checks = check(results, limits)
    return Gates(limits=limits, passed=all(c.passed for c in checks), checks=checks)


def stored_checks(results: CompareResults) -> list[Check]:
    """The checks of a results file, recomputed from its stored limits (so they always match the
    numbers)."""
    return check(results, results.gates.limits) if results.gates else []


def rejudged(results: CompareResults) -> CompareResults:
    """The results with their stored gates judged anew from the stored limits: the checks and
    `passed` of the numbers as they are, whatever flag the file stored (an older ptq's, or one
    edited by hand). What `ptq report` renders, prints with --json and exits by."""
    if results.gates is None:
        return results
    checks = stored_checks(results)
    gates = Gates(limits=results.gates.limits, passed=all(c.passed for c in checks), checks=checks)
    return dataclasses.replace(results, gates=gates)
