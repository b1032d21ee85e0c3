"""ptq report: results.json (+ a previous one) -> markdown with verdict, gates, trend and plots.

The gates are judged anew on the numbers (with the limits given here, else those compare stored),
so that a report never shows a verdict its numbers do not give.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ptq.errors import PtqError
from ptq.files import check_outputs, writes_outputs
from ptq.progress import stderr
from ptq.reporting.gates import Limits, gate_results, refuse_unmeasured_gates, rejudged, task_scores
from ptq.reporting.report import render_markdown, report_outputs, write_markdown
from ptq.reporting.results import CompareResults, load_compare


@writes_outputs
def run_report(
    results_file: Path,
    previous_file: Path | None = None,
    output: Path | None = None,
    limits: Limits | None = None,
    plots: bool = True,
    force: bool = False,
) -> tuple[CompareResults, CompareResults | None, str]:
    """Render a compare results file (gates from `limits` if any are given, else the limits stored
    by compare, judged anew on the numbers) as markdown, with a trend against `previous_file`; write
    it (and its plots) to `output` if given. Returns the results as judged (their `gates` are what
    the markdown shows and the exit code follows), the previous results and the markdown."""
    # they apply to written files: without --output, none is written
    if output is None and (force or not plots):
        raise PtqError(
            f"{'--force' if force else '--no-plots'} applies with --output (the report is printed, "
            "not written)"
        )
    results = load_compare(results_file)
    previous = load_compare(previous_file, "previous results file") if previous_file else None
    results = _judged(results, results_file, limits)
    if output is None:
        return results, previous, render_markdown(results, previous)
    inputs = {"the results file": results_file, "the previous results file": previous_file}
    check_outputs(report_outputs(Path(output), results, plots), inputs, force)
    write_markdown(Path(output), results, previous, plots, force=True)
    return results, previous, Path(output).read_text(encoding="utf-8")


def _judged(results: CompareResults, results_file: Path, limits: Limits | None) -> CompareResults:
    """The results with their gates judged on their numbers: against `limits` where any is given,
    else against the limits they store (a warning where the stored verdict differs)."""
    if limits is not None and limits.any():
        refuse_unmeasured_gates(limits, set(task_scores(results.baseline)), str(results_file))
        return dataclasses.replace(results, gates=gate_results(results, limits))
    if results.gates is not None:
        stored = results.gates.passed
        results = rejudged(results)
        if stored != results.gates.passed:
            stderr.print(
                f"warning: {results_file} stores gates.passed {str(stored).lower()}, but its "
                f"numbers {'pass' if results.gates.passed else 'fail'} its limits: judged on the "
                "numbers",
                highlight=False,
                soft_wrap=True,
            )
    return results
