"""The one writer of reports: results.json (machine-readable, the source of truth), report.md
rendered from it alone (plus, for a trend, a previous results file), and the plots next to
report.md, also drawn from it alone, so a results file can be re-rendered later by `ptq report`.
Every function here reads the typed document of ptq.reporting.results.

report.md reads top-down for a pull request: a one-line verdict, the table (cells that fail a gate
marked), the trend against a previous run, then the plots and details folded in <details>.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ptq.errors import PtqError
from ptq.evaluation.recovery import accuracy_recovery_pct
from ptq.evaluation.stats import MIN_UNITS
from ptq.files import check_writable, text_writer, write_set_atomic
from ptq.reporting.coverage import NAMES_SHOWN, describe_coverage, left_out_groups, quantized_share
from ptq.reporting.gates import (
    rejudged,
    stored_checks,
    task_higher_is_better,
    task_metric_is_share,
)
from ptq.reporting.markdown import code, inline, visible
from ptq.reporting.results import (
    CalibrationFaults,
    Check,
    CompareResults,
    Entry,
    EvalResults,
    Results,
    Variant,
    dumps,
    fmt_against,
    to_json,
)
from ptq.reporting.trend import LABELS, Move, trend

FAIL, PASS, MOVED = "❌", "✅", "⚠️"


def write_report(
    out_dir: Path, results: Results, force: bool, plots: bool = True
) -> tuple[Path, Path]:
    """results.json and report.md (compare's with the plots, or eval's)."""
    out_dir = Path(out_dir)
    report, results_file = out_dir / "report.md", out_dir / "results.json"
    compare = isinstance(results, CompareResults)
    plots = plots and compare
    for path in report_outputs(report, results, plots) + [_not_a_directory(results_file)]:
        check_writable(path, force)
    links = _plot_links(results, report) if plots else {}
    markdown = render_markdown(results, None, links) if compare else render_eval_markdown(results)
    # results.json, report.md and the plots are renamed into place together, once all are complete.
    _write_set(report, {results_file: dumps(results), report: markdown}, results if plots else None)
    return report, results_file


def report_outputs(report: Path, results: Results, plots: bool) -> list[Path]:
    """Every file writing `report` creates or replaces: the markdown, with plots the PNGs next to
    it, and the plots of `report` an earlier run left that this one does not draw (removed: they
    would show another run's numbers beside this report). An output that is an existing directory is
    refused here, before any work: --force cannot overwrite a directory."""
    report = _not_a_directory(Path(report))
    drawn = _drawn_plots(report, results, plots)
    return [report] + [_not_a_directory(p) for p in drawn] + _stale_plots(report, drawn)


def _drawn_plots(report: Path, results: Results, plots: bool) -> list[Path]:
    from ptq.reporting.plots import available, plot_paths

    paths = plot_paths(report)
    return (
        [paths[name] for name in available(results)]
        if plots and isinstance(results, CompareResults)
        else []
    )


def _stale_plots(report: Path, drawn: list[Path]) -> list[Path]:
    from ptq.reporting.plots import plot_paths

    return [p for p in plot_paths(report).values() if p not in drawn and p.is_file()]


def _not_a_directory(path: Path) -> Path:
    if Path(path).is_dir():
        raise PtqError(
            f"cannot write {path}: it is a directory; give a file name such as "
            f"{Path(path) / 'report.md'}"
        )
    return Path(path)


def _plot_links(results: CompareResults, report: Path) -> dict[str, str]:
    """The relative links report.md gives its plots."""
    from ptq.reporting.plots import available, plot_paths

    paths = plot_paths(Path(report))
    return {name: paths[name].name for name in available(results)}


def _write_set(report: Path, texts: dict[Path, str], plotted: CompareResults | None) -> None:
    """The texts and (for `plotted` results) the plots of `report`, as one set
    (ptq.files.write_set_atomic)."""
    from ptq.reporting.plots import plot_writers

    plots = plot_writers(plotted, report) if plotted is not None else {}
    write_set_atomic(plots | {path: text_writer(text) for path, text in texts.items()})
    for stale in _stale_plots(report, list(plots)):  # allowed by report_outputs' checks (--force)
        stale.unlink(missing_ok=True)


def write_markdown(
    report: Path,
    results: CompareResults,
    previous: CompareResults | None = None,
    plots: bool = True,
    force: bool = False,
) -> Path:
    """report.md (and its plots, unless plots=False) at `report`, linked by relative path."""
    report = Path(report)
    for path in report_outputs(report, results, plots):
        check_writable(path, force)
    links = _plot_links(results, report) if plots else {}
    _write_set(
        report, {report: render_markdown(results, previous, links)}, results if plots else None
    )
    return report


def render_markdown(
    r: CompareResults, previous: CompareResults | None = None, plots: dict[str, str] | None = None
) -> str:
    checks = stored_checks(r)
    moves = trend(r, previous) if previous is not None else None
    lines = [f"# ptq compare: {inline(r.model.name)}", "", verdict(r, checks, moves), ""]
    failed = [c for c in checks if not c.passed]
    if failed:
        lines += [f"- {FAIL} {c.describe()}" for c in failed] + [""]
    lines += results_table(r, checks) + [""]
    lines += coverage_lines([r.baseline, *r.variants])
    lines += intervals_section(r) + tasks_section(r) + [""]
    if r.gates:
        lines += [gates_note(r), ""]
    if moves is not None:
        lines += trend_section(moves, previous) + [""]
    if plots:
        from ptq.reporting.plots import TITLES

        lines += ["<details open><summary><b>Plots</b></summary>", ""]
        lines += [f"![{TITLES[name]}]({file})" + "\n" for name, file in plots.items()]
        lines += ["</details>", ""]
    lines += details_sections(r)
    return "\n".join(lines)


def ppl_delta_text(v: Variant, checks: list[Check]) -> str:
    """A variant's Δ ppl, with the digits that tell it from its gate's limit (+2.004% against 2%,
    not +2.00%)."""
    limit = _limit([c for c in checks if c.variant == v.name and c.metric == "ppl_delta_pct"])
    return f"{fmt_against(v.ppl_delta_pct, limit, '+.2f', 0)}%"


def quantized_share_pct(e: Entry) -> float:
    """The share of the model's matmul weight parameters an entry quantizes, in percent."""
    return 100 * quantized_share(
        e.coverage.quantized_weight_params, e.coverage.matmul_weight_params
    )


def share_text(e: Entry) -> str:
    """quantized_share_pct as text, with the digits that keep a share that is not all from reading
    100.00%."""
    return f"{fmt_against(quantized_share_pct(e), None, '.2f', 0, 100)}%"


def partial_variants(r: CompareResults) -> set[str]:
    """The variants that quantize fewer matmul weights than the most complete one (layers a format
    cannot take, left in 16 bits): their deltas are not an answer about 8 bits, and the verdict and
    table say so."""
    most = max((quantized_share_pct(v) for v in r.variants), default=0.0)
    return {v.name for v in r.variants if quantized_share_pct(v) < most}


def verdict(r: CompareResults, checks: list[Check] | None = None, moves: dict | None = None) -> str:
    base = r.baseline.name
    checks = stored_checks(r) if checks is None else checks
    partial = partial_variants(r)
    parts = [
        f"{v.name} {ppl_delta_text(v, checks)}"
        + (f" (only {share_text(v)} of matmul weights quantized)" if v.name in partial else "")
        for v in r.variants
    ]
    ppl = f"perplexity vs {base}: " + ", ".join(parts) + "." if parts else "baseline only."
    failed = [c for c in checks if not c.passed]
    if not checks:
        line = (
            f"**Perplexity vs {base}:** " + ", ".join(parts) + "."
            if parts
            else "**Baseline only.**"
        )
    elif failed:
        line = (
            f"{FAIL} **{len(failed)} of {len(checks)} gate checks fail** "
            f"({', '.join(sorted({c.variant for c in failed}))}); {ppl}"
        )
    else:
        line = f"{PASS} **All {len(checks)} gate checks pass**; {ppl}"
    if moves is not None:
        beyond = [m for m in moves["moves"] if m.beyond_intervals]
        if beyond:
            line += (
                f" {MOVED} {len(beyond)} change{'s' if len(beyond) > 1 else ''} beyond the "
                "intervals since the previous run."
            )
    return line


def kl_text(value: float, limit: float | None = None, sign: str = "") -> str:
    """A KL (nats/token) with 5 decimals, or with as many as two significant digits take below 1e-4:
    a KL of 3.4e-06 is not 0.00000, which reads as a variant identical to the baseline; and with the
    digits that tell it from `limit`."""
    digits = 5
    if math.isfinite(value) and 0 < abs(value) < 1e-4:
        digits = min(17, 1 - math.floor(math.log10(abs(value))))
    return fmt_against(value, limit, f"{sign}.{digits}f")


def kl_div_text(v: Variant, checks: list[Check]) -> str:
    """A variant's KL, with the digits that tell it from its gate's limit."""
    return kl_text(
        v.kl_div, _limit([c for c in checks if c.variant == v.name and c.metric == "kl_div"])
    )


def _kl_ci(ci: tuple[float, float]) -> str:
    return "n/a" if any(c != c for c in ci) else f"[{kl_text(ci[0])}, {kl_text(ci[1])}]"


def _cell(text: str, failed: list[Check]) -> str:
    return f"**{text}** {FAIL}" if failed else text


def _limit(checks: list[Check]) -> float | None:
    """The limit of a cell's check (the first, where several share the cell)."""
    return checks[0].limit if checks else None


def results_table(r: CompareResults, checks: list[Check]) -> list[str]:
    base = r.baseline
    by_cell: dict[tuple[str, str], list[Check]] = {}
    for c in checks:
        by_cell.setdefault(
            (c.variant, c.metric if c.task in (None, "next-token") else "tasks"), []
        ).append(c)
    lines = [
        f"| variant | weights | inputs | perplexity | Δ ppl vs {base.name} | next-token acc | acc "
        f"recovery | KL vs {base.name} (nats/token) | top-1 agreement | matmul weights quantized |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| **{base.name}** (baseline) | {base.recipe.weights} | {base.recipe.inputs} | "
        f"{base.perplexity:.4f} | | {100 * base.accuracy:.2f}% | | | | |",
    ]
    partial = partial_variants(r)
    for v in r.variants:
        fails = [c for c in checks if c.variant == v.name and not c.passed]
        mark = (
            f" {FAIL}"
            if fails
            else (f" {PASS}" if any(c.variant == v.name for c in checks) else "")
        )
        recovery = accuracy_recovery_pct(v.accuracy, base.accuracy)
        gated = {
            m: by_cell.get((v.name, m), [])
            for m in ("ppl_delta_pct", "accuracy_recovery_pct", "kl_div", "finite_outputs")
        }
        cell = {m: [c for c in checks if not c.passed] for m, checks in gated.items()}
        # a value next to its limit gets the digits that tell it from the limit (+2.004% against 2%,
        # not +2.00%)
        ppl_delta = _cell(ppl_delta_text(v, checks), cell["ppl_delta_pct"])
        recovery = _cell(
            f"{fmt_against(recovery, _limit(gated['accuracy_recovery_pct']), '.2f')}%",
            cell["accuracy_recovery_pct"],
        )
        kl = _cell(kl_text(v.kl_div, _limit(gated["kl_div"])), cell["kl_div"])
        share = share_text(v)
        lines.append(
            f"| {v.name}{mark} | {v.recipe.weights} | {v.recipe.inputs} | "
            f"{_cell(f'{v.perplexity:.4f}', cell['finite_outputs'])} | {ppl_delta} | "
            f"{100 * v.accuracy:.2f}% | {recovery} | {kl} | {100 * v.top1_agreement:.2f}% | "
            f"{share if v.name not in partial else f'**{share}**'} |"
        )
    return lines


def gates_note(r: CompareResults) -> str:
    return (
        "<sub>Gates: "
        + "; ".join(r.gates.limits.describe())
        + ". Δ ppl = 100 * (ppl_variant / ppl_baseline - 1) %; "
        "accuracy recovery = 100 * accuracy_variant / accuracy_baseline % (next-token accuracy "
        "and each task); KL = mean KL(baseline || variant) per token. A gate judges the measured "
        "value, not its interval.</sub>"
    )


def _fmt(metric: str, value: float, share: bool | None = None) -> str:
    if metric == "perplexity":
        return f"{value:.4f}"
    if metric == "ppl_delta_pct":
        return f"{value:+.2f}%"
    if metric == "kl_div":
        return kl_text(value)
    if share is False:
        return f"{value:.4f}"  # a task metric in its own units (likelihood_diff, nats)
    return f"{100 * value:.2f}%"  # accuracy, agreement, a task metric that is a share: fractions


def _fmt_change(m: Move) -> str:
    if math.isnan(
        m.change
    ):  # from inf to inf (a run that collapsed both times): no change to state
        return "n/a"
    if m.metric == "perplexity":
        finite = math.isfinite(m.previous) and math.isfinite(m.current)
        rel = f" ({100 * m.change / m.previous:+.2f}%)" if m.previous and finite else ""
        return f"{m.change:+.4f}{rel}"
    if m.metric == "ppl_delta_pct":
        return f"{m.change:+.2f} points"
    if m.metric == "kl_div":
        return kl_text(m.change, sign="+")
    if m.share is False:
        return f"{m.change:+.4f}"
    return f"{100 * m.change:+.2f} points"


def _ci_text(ci: tuple[float, float], metric: str, share: bool | None = None) -> str:
    if any(c != c for c in ci):  # no interval (fewer units than one needs)
        return " [n/a]"
    return f" [{_fmt(metric, ci[0], share).lstrip('+')}, {_fmt(metric, ci[1], share).lstrip('+')}]"


def trend_section(t: dict, previous: CompareResults) -> list[str]:
    moves: list[Move] = t["moves"]
    beyond = [m for m in moves if m.beyond_intervals]
    lines = [f"## Trend vs the previous run ({previous.created})", ""]
    lines.append(
        f"{len(beyond)} of {len(moves)} changes are beyond their 95% intervals (the two runs' "
        "intervals do not overlap)."
    )
    if t["setup_changes"]:
        lines.append(
            f"{MOVED} The runs differ in setup ({'; '.join(t['setup_changes'])}): changes mix the "
            "code change with that."
        )
    if t["only_now"] or t["only_before"]:
        lines.append(
            f"New: {', '.join(t['only_now']) or 'none'}; gone: "
            f"{', '.join(t['only_before']) or 'none'}."
        )
    lines += [
        "",
        "| recipe | metric | previous | now | change | beyond intervals |",
        "|---|---|---:|---:|---:|:---:|",
    ]
    for m in moves:
        label = (m.task if " " in m.task else f"{m.task} accuracy") if m.task else LABELS[m.metric]
        if m.task and m.better == "lower":
            label += " (lower is better)"
        flag = f"{MOVED} {'worse' if m.worse else 'better'}" if m.beyond_intervals else "no"
        lines.append(
            f"| {m.entry} | {label} | "
            f"{_fmt(m.metric, m.previous, m.share)}{_ci_text(m.previous_ci, m.metric, m.share)} | "
            f"{_fmt(m.metric, m.current, m.share)}{_ci_text(m.current_ci, m.metric, m.share)} | "
            f"{_fmt_change(m)} | {flag} |"
        )
    return lines


def _details(title: str, body: list[str]) -> list[str]:
    return [f"<details><summary><b>{title}</b></summary>", "", *body, "", "</details>", ""]


def _versions_line(r: Results) -> str:
    return ", ".join(f"{k} {v}" for k, v in r.versions.items()) + f"; created {r.created}."


def details_sections(r: CompareResults) -> list[str]:
    ev, cal = r.eval, r.calibration
    out = _details("Protocol", [f"- {line}" for line in r.protocol])
    model = [f"- Model: {code(r.model.name)}, {visible(r.model.source)}."]
    model += [f"- Note: {c}" for c in r.model.caveats]
    model += [
        f"- Evaluation text: {visible(ev.data)} (sha256 `{ev.data_sha256[:16]}`).",
        f"- Device: {r.device}.",
    ]
    out += _details("Model and data", model)
    if cal:
        s = cal.summary
        tokens = f"{cal.tokens:,}" if cal.tokens is not None else "?"
        body = [
            f"- {visible(cal.source)}",
            f"- Text: {visible(cal.data)} (sha256 `{str(cal.data_sha256)[:16]}`), "
            f"{cal.windows} windows x {cal.seq_len} tokens = {tokens} tokens.",
            f"- {s.layers} layers; input amax across layers: min {s.input_amax_min:.4g}, "
            f"median {s.input_amax_median:.4g}, max {s.input_amax_max:.4g}.",
            "",
            "Largest input amax:",
            "",
            "| layer | input amax | weight amax |",
            "|---|---:|---:|",
        ]
        body += [
            f"| `{row.layer}` | {row.input_amax:.4g} | {row.weight_amax:.4g} |" for row in s.largest
        ]
        body += faults_lines(cal.faults)
        out += _details("Calibration", body)
    snr = [v for v in r.variants if v.snr_db]
    if snr:
        body = [
            "Median and worst quantization SNR over the quantized layers (dB; see the SNR plot for "
            "every layer):",
            "",
            "| variant | weights median | weights worst (layer) | inputs median | inputs worst "
            "(layer) |",
            "|---|---:|---:|---:|---:|",
        ]
        for v in snr:
            body.append(
                f"| {v.name} | {_snr_summary(v.snr_db.weights)} | {_snr_summary(v.snr_db.inputs)} |"
            )
        out += _details("Per-layer SNR", body)
    coverage, diagnostics = render_coverage(r), render_diagnostics(r)
    if coverage:
        out += _details("Coverage beyond Linear layers", coverage)
    if diagnostics:
        out += _details("Per-tensor diagnostics (calibration data)", diagnostics)
    out += _details("Versions", [_versions_line(r)])
    return out


def _snr_summary(values: dict[str, float | None]) -> str:
    known = sorted((db, layer) for layer, db in values.items() if db is not None)
    if not known:
        return "— | —"
    median = statistics.median(db for db, _ in known)
    worst_db, worst_layer = known[0]
    return f"{median:.1f} | {worst_db:.1f} (`{worst_layer}`)"


def faults_lines(faults: CalibrationFaults) -> list[str]:
    """What calibration worked around (ptq.calibration.calibrate's fault rules), so no fallback goes
    unnoticed."""
    if not (faults.unseen_layers or faults.nonfinite_batches or faults.warnings):
        return []
    lines = ["", "### Calibration faults", ""]
    lines += [
        f"- Layer `{u.layer}` received no calibration data: input amax {u.input_amax:.4g} "
        f"({u.rule})."
        for u in faults.unseen_layers
    ]
    lines += [
        f"- Layer `{layer}`: {n} calibration batch(es) with NaN/inf inputs left out "
        "(--on-nonfinite skip)."
        for layer, n in faults.nonfinite_batches.items()
    ]
    lines += [f"- Warning: {w}." for w in faults.warnings]
    return lines


def render_diagnostics(r: CompareResults, top: int = 10) -> list[str]:
    """Per-tensor SQNR under E4M3 and int8 (the results' diagnostics): the worst tensors of each,
    then all."""
    d = r.diagnostics
    if not d:
        return []
    rows = {row.tensor: row for row in d.tensors}

    def fmt_db(v):
        return "exact" if v is None else f"{v:.1f}"

    def row_line(t: str) -> str:
        return (
            f"| `{t}` | {rows[t].amax:.4g} | {fmt_db(rows[t].sqnr_e4m3_db)} "
            f"| {fmt_db(rows[t].sqnr_int8_db)} |"
        )

    head = [
        "| layer (its input) | input amax | SQNR E4M3 (dB) | SQNR int8 (dB) |",
        "|---|---:|---:|---:|",
    ]
    lines = [f"- {d.method}.", ""]
    for name, worst in (("e4m3", d.worst_e4m3), ("int8", d.worst_int8)):
        lines += [f"Worst {top} under {name}:", "", *head]
        lines += [row_line(t) for t in worst[:top]]
        lines.append("")
    lines += ["<details><summary>All tensors</summary>", "", *head]
    lines += [row_line(t) for t in rows]
    lines += ["", "</details>"]
    return lines


def coverage_lines(entries: list[Entry]) -> list[str]:
    """What share of the model's matmul weights each variant quantizes, and what stayed in the
    compute dtype and why: shown under the results table, since a variant that left most weights
    alone is not an answer about 8 bits."""
    from ptq.numerics.formats import get_format

    def line(e: Entry) -> str:
        text = describe_coverage(to_json(e.coverage))
        weights = e.recipe.weights.split()[0]
        if not get_format(
            weights
        ).scaled:  # the 16-bit baseline rounds its weights to bf16 and quantizes nothing
            text = text.replace(" quantized (", f" rounded to {weights} (", 1)
        return f"- {e.name}: {text}."

    return [
        "**Coverage** (matmul weights: Linear, Conv1D, experts, lm_head, routers):",
        "",
        *[line(e) for e in entries],
        "",
        *every_left_out(entries),
    ]


def every_left_out(entries: list[Entry]) -> list[str]:
    """Every matmul weight and attention input each entry left unquantized, by reason, where the
    coverage line names only the first few of a reason's: collapsed, since a recipe may leave
    hundreds."""
    lines = []
    for e in entries:
        for kind, groups in zip(
            ("matmul weights", "attention inputs"), left_out_groups(to_json(e.coverage))
        ):
            for reason, items in groups.items():
                if len(items) > NAMES_SHOWN:
                    names = ", ".join(f"`{i['name']}`" for i in items)
                    lines.append(f"- {e.name}, {len(items)} {kind}: {reason}: {names}")
    if not lines:
        return []
    return [
        "<details><summary>Every layer left unquantized</summary>",
        "",
        *lines,
        "",
        "</details>",
        "",
    ]


def render_coverage(r: CompareResults) -> list[str]:
    """What each variant quantizes beyond Linear weights and inputs (attention, KV cache,
    SmoothQuant)."""
    rows = [
        v
        for v in r.variants
        if v.recipe.attention
        or v.recipe.kv_cache
        or v.recipe.residual
        or v.recipe.smoothquant_alpha is not None
    ]
    if not rows:
        return []
    lines = [
        "| variant | attention matmul inputs | KV cache | residual-add inputs | SmoothQuant alpha "
        "|",
        "|---|---|---|---|---:|",
    ]
    for v in rows:
        rec = v.recipe
        alpha = "" if rec.smoothquant_alpha is None else f"{rec.smoothquant_alpha:g}"
        lines.append(
            f"| {v.name} | {rec.attention or 'fp32'} | {rec.kv_cache or 'fp32'} | "
            f"{rec.residual or 'fp32'} | {alpha} |"
        )
    return lines


def interval_text(
    ci: tuple[float, float], scale: float = 1, fmt: str = ".2f", unit: str = ""
) -> str:
    """An interval as [lo, hi]; "n/a" where there is none (NaN ends: fewer units than an interval
    needs)."""
    if any(c != c for c in ci):
        return "n/a"
    # an end that is not 0 never reads as 0 (+0.0034 is not +0.00, beside "distinguishable from 0:
    # yes")
    return (
        f"[{fmt_against(scale * ci[0], None, fmt, 0)}, "
        f"{fmt_against(scale * ci[1], None, fmt, 0)}]{unit}"
    )


def _distinguishable(significant: bool) -> str:
    return "**yes**" if significant else "no"


def intervals_section(r: CompareResults) -> list[str]:
    """Perplexity and next-token accuracy with 95% intervals, and the paired deltas vs the
    baseline."""
    base = r.baseline
    checks = stored_checks(r)
    lines = [
        "",
        "## Intervals (95%)",
        "",
        f"Bootstrap over the {r.eval.windows} evaluation windows; a delta is paired (same windows "
        f"for {base.name} and the variant) and is distinguishable from zero when its interval "
        "excludes 0. The intervals cover the choice of windows, not the rounding: scales that "
        "differ in their last digits can move a perplexity delta by tenths of a point while the "
        'KL barely moves (ptq\'s docs/paper.md, "Noise beyond the intervals"); compare close '
        f"recipes by their KL. Fewer than {MIN_UNITS} windows give no interval (n/a): "
        "with so few, a percentile interval is only the range of the windows.",
        "",
        f"| variant | perplexity | 95% CI | Δ ppl vs {base.name} | 95% CI | distinguishable from 0 "
        "| next-token acc | 95% CI | Δ acc (points) | 95% CI | distinguishable from 0 |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        f"| **{base.name}** (baseline) | {base.perplexity:.4f} | "
        f"{interval_text(base.perplexity_ci, fmt='.4f')} | | | | {100 * base.accuracy:.2f}% | "
        f"{interval_text(base.accuracy_ci, 100)} | | | |",
    ]
    for v in r.variants:
        lines.append(
            f"| {v.name} | {v.perplexity:.4f} | {interval_text(v.perplexity_ci, fmt='.4f')} | "
            f"{ppl_delta_text(v, checks)} | "
            f"{interval_text(v.ppl_delta_pct_ci, fmt='+.2f', unit='%')} | "
            f"{_distinguishable(v.ppl_delta_significant)} | {100 * v.accuracy:.2f}% | "
            f"{interval_text(v.accuracy_ci, 100)} | "
            f"{fmt_against(100 * v.accuracy_delta, None, '+.2f', 0)} | "
            f"{interval_text(v.accuracy_delta_ci, 100, '+.2f')} | "
            f"{_distinguishable(v.accuracy_delta_significant)} |"
        )
    # the agreement with the baseline, by which close recipes are told apart, with its intervals
    lines += [
        "",
        f"| variant | KL vs {base.name} (nats/token) | 95% CI | top-1 agreement | 95% CI |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in r.variants:
        lines.append(
            f"| {v.name} | {kl_div_text(v, checks)} | {_kl_ci(v.kl_div_ci)} "
            f"| {100 * v.top1_agreement:.2f}% | {interval_text(v.top1_agreement_ci, 100)} |"
        )
    return lines


def tasks_section(r: Results) -> list[str]:
    """Per task and metric (lm-evaluation-harness's): each variant's value with its interval, its
    paired delta vs the baseline and its recovery (variant / baseline)."""
    if not r.tasks:
        return []
    compare = isinstance(r, CompareResults)
    entries: list[Entry] = [r.baseline, *r.variants] if compare else [r.config]
    base_name = r.baseline.name if compare else None
    lines = ["", "## Task accuracy (lm-evaluation-harness)", ""]
    head = "| task | metric | n | shots | variant | value | 95% CI |"
    rule = "|---|---|---:|---:|---|---:|---:|"
    if base_name:
        head += f" Δ vs {base_name} (points) | 95% CI | distinguishable from 0 | recovery |"
        rule += "---:|---:|---|---:|"
    lines += [head, rule]
    # the recovery gates' limits, so that a recovery next to its limit is printed with the digits
    # that tell them apart
    checks = stored_checks(r) if compare else []
    in_units, lower = (
        [],
        [],
    )  # metrics that are not shares in [0, 1] (not printed as percentages); lower is better
    for task in r.tasks:
        for metric in task.metrics:
            share = task_metric_is_share(r, task.name, metric)
            scale, unit, places = (100, "%", 2) if share else (1, "", 4)
            if not share:
                in_units.append(f"{task.name} {metric}")
            label = metric
            if not task_higher_is_better(r, task.name, metric):
                label += " (lower is better)"
                lower.append(f"{task.name} {metric}")
            for e in entries:
                t = e.tasks[task.name]
                m = t.metrics[metric]
                shots = "" if task.num_fewshot is None else task.num_fewshot
                row = (
                    f"| {task.name} | {label} | {t.n} | {shots} | "
                    f"{'**' + e.name + '**' if e.name == base_name else e.name} | "
                    f"{scale * m.value:.{places}f}{unit} | "
                    f"{interval_text(m.ci, scale, f'.{places}f')} |"
                )
                if base_name:
                    d = task_delta(e, task.name, metric)
                    gated = task_checks(checks, e.name, task.name, metric)
                    recovery = f"{fmt_against(d.recovery_pct, _limit(gated), '.2f')}%" if d else ""
                    row += (
                        f" {fmt_against(scale * d.delta, None, f'+.{places}f', 0)} | "
                        f"{interval_text(d.ci, scale, f'+.{places}f')} | "
                        f"{_distinguishable(d.significant)} | "
                        f"{_cell(recovery, [c for c in gated if not c.passed])} |"
                        if d
                        else " | | | |"
                    )
                lines.append(row)
    if any(t.n < MIN_UNITS for t in r.tasks):
        lines += [
            "",
            f"Fewer than {MIN_UNITS} documents give no interval (n/a): with so few, it is only "
            "their range.",
        ]
    if in_units:
        lines += [
            "",
            "In their own units, not percentages (values, intervals and deltas): "
            f"{', '.join(in_units)}.",
        ]
    if lower:
        lines += [
            "",
            f"Lower is better (as lm-eval records it): {', '.join(lower)}; recovery is variant / "
            "baseline, so above 100% is a loss there, and the accuracy-recovery gate does not "
            "apply.",
        ]
    lines += ["", "Tasks:", ""]
    for task in r.tasks:
        chance = (
            f" Chance {100 * task.chance:.1f}% (uniform guess among the choices)."
            if task.chance is not None
            else ""
        )
        lines.append(
            f"- **{task.name}** ({task.kind}): {visible(task.source)}; {task.n} documents; "
            f"documents sha256 `{task.documents_sha256[:16]}`.{chance}"
        )
        lines += [f"  - {note}" for note in task.notes]
    scoring = r.task_scoring
    if scoring:
        limit = (
            f", --limit {scoring.limit:g} (the first documents of each task)"
            if scoring.limit is not None
            else ""
        )
        shots = f", --num-fewshot {scoring.num_fewshot}" if scoring.num_fewshot is not None else ""
        lines += ["", f"Scoring: {scoring.harness}, batch size {scoring.batch_size}{shots}{limit}."]
    return lines


def task_checks(checks: list[Check], variant: str, task: str, metric: str) -> list[Check]:
    """The recovery gate's checks of one task metric of one variant (none, or one)."""
    return [c for c in checks if (c.variant, c.task, c.task_metric) == (variant, task, metric)]


def task_delta(e: Entry, task: str, metric: str):
    """A variant's paired delta on one task metric (None for the baseline and eval's
    configuration)."""
    return ((e.task_deltas or {}).get(task) or {}).get(metric) if isinstance(e, Variant) else None


def render_eval_markdown(r: EvalResults) -> str:
    """The report of `ptq eval`: one configuration, no baseline."""
    c, ev, cal = r.config, r.eval, r.calibration
    lines = [
        f"# ptq eval: {inline(r.model.name)} with {c.name}",
        "",
        "| configuration | weights | inputs | perplexity | 95% CI | next-token acc | 95% CI |",
        "|---|---|---|---:|---:|---:|---:|",
        f"| {c.name} | {c.recipe.weights} | {c.recipe.inputs} | {c.perplexity:.4f} | "
        f"{interval_text(c.perplexity_ci, fmt='.4f')} | {100 * c.accuracy:.2f}% | "
        f"{interval_text(c.accuracy_ci, 100)} |",
    ]
    lines += tasks_section(r)
    lines += [""] + coverage_lines([c])
    lines += ["## Protocol", ""] + [f"- {line}" for line in r.protocol]
    lines += [
        "",
        "## Model and data",
        "",
        f"- Model: {code(r.model.name)}, {visible(r.model.source)}.",
    ]
    lines += [f"- Note: {note}" for note in r.model.caveats]
    lines += [
        f"- Evaluation text: {visible(ev.data)} (sha256 `{ev.data_sha256[:16]}`), "
        f"{ev.description}.",
        f"- Device: {r.device}.",
    ]
    if cal:
        lines += [
            f"- Calibration: {visible(cal.source)} {visible(cal.data)}, {cal.windows} windows x "
            f"{cal.seq_len} tokens."
        ]
        lines += faults_lines(cal.faults)
    lines += ["", "## Versions", "", _versions_line(r), ""]
    return "\n".join(lines)


def report_summary(
    results: CompareResults, previous: CompareResults | None, output: Path | None
) -> dict:
    """What `ptq report --json` prints: the verdict, whether every gate passed, the gates, and the
    trend."""
    results = rejudged(results)  # one set of checks for the verdict, `passed` and `gates`
    moves = trend(results, previous) if previous is not None else None
    return {
        "verdict": verdict(results, None, moves),
        "passed": results.gates.passed if results.gates else True,
        "gates": to_json(results.gates),
        "output": str(output) if output else None,
        "trend": None
        if moves is None
        else moves | {"moves": [m.to_json() for m in moves["moves"]]},
    }
