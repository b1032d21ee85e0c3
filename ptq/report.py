"""The one writer of reports: results.json (machine-readable, the source of truth), report.md rendered
from it alone (plus, for a trend, a previous results file), and the plots next to report.md, also drawn
from it alone, so a results file can be re-rendered later by `ptq report`.

report.md reads top-down for a pull request: a one-line verdict, the table (cells that fail a gate
marked), the trend against a previous run, then the plots and details folded in <details>.
"""

from __future__ import annotations

import json
from pathlib import Path

from ptq.errors import PtqError
from ptq.files import check_writable, write_text_atomic, write_texts_atomic
from ptq.gates import Check, stored_checks
from ptq.trend import LABELS, Move, trend

FAIL, PASS, MOVED = "❌", "✅", "⚠️"


def write_report(out_dir: Path, results: dict, force: bool, plots: bool = True) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    report, results_file = out_dir / "report.md", out_dir / "results.json"
    for path in report_outputs(report, results, plots) + [results_file]:
        check_writable(path, force)
    links = _write_plots(results, report) if plots else {}
    # results.json and report.md are renamed into place together, once both are complete.
    write_texts_atomic({results_file: json.dumps(results, indent=2, sort_keys=False) + "\n",
                        report: render_markdown(results, None, links)})
    return report, results_file


def report_outputs(report: Path, results: dict, plots: bool) -> list[Path]:
    """Every file writing `report` creates: the markdown and, with plots, the PNGs next to it."""
    from ptq.plots import available, plot_paths

    if not plots:
        return [Path(report)]
    paths = plot_paths(Path(report))
    return [Path(report)] + [paths[name] for name in available(results)]


def write_markdown(report: Path, results: dict, previous: dict | None = None, plots: bool = True,
                   force: bool = False) -> Path:
    """report.md (and its plots, unless plots=False) at `report`, linked by relative path."""
    report = Path(report)
    for path in report_outputs(report, results, plots):
        check_writable(path, force)
    links = _write_plots(results, report) if plots else {}
    write_text_atomic(report, render_markdown(results, previous, links))
    return report


def _write_plots(results: dict, report: Path) -> dict[str, str]:
    """Draw the plots next to `report`; returns their relative links."""
    from ptq.plots import write_plots

    return {name: path.name for name, path in write_plots(results, report).items()}


def load_results(path: Path, what: str = "results file") -> dict:
    """A results.json written by `ptq compare`, checked enough that rendering cannot fail half-way."""
    path = Path(path)
    if not path.is_file():
        raise PtqError(f"{what} {path} does not exist")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PtqError(f"{path} is not a readable JSON {what}: {str(e).splitlines()[0]}") from None
    keys = ("model", "eval", "baseline", "variants", "protocol", "versions", "created")
    if not isinstance(results, dict) or any(k not in results for k in keys):
        raise PtqError(f"{path} is not a ptq results file (expected the keys {', '.join(keys)} of `ptq compare`'s results.json)")
    return results


def render_markdown(r: dict, previous: dict | None = None, plots: dict[str, str] | None = None) -> str:
    checks = stored_checks(r)
    moves = trend(r, previous) if previous is not None else None
    lines = [f"# ptq compare: {r['model']['name']}", "", verdict(r, checks, moves), ""]
    failed = [c for c in checks if not c.passed]
    if failed:
        lines += [f"- {FAIL} {c.describe()}" for c in failed] + [""]
    lines += results_table(r, checks) + [""]
    if r.get("gates"):
        lines += [gates_note(r), ""]
    if moves is not None:
        lines += trend_section(moves, previous) + [""]
    if plots:
        from ptq.plots import TITLES

        lines += ["<details open><summary><b>Plots</b></summary>", ""]
        lines += [f"![{TITLES[name]}]({file})" + "\n" for name, file in plots.items()]
        lines += ["</details>", ""]
    lines += details_sections(r)
    return "\n".join(lines)


def verdict(r: dict, checks: list[Check] | None = None, moves: dict | None = None) -> str:
    base = r["baseline"]["name"]
    parts = [f"{v['name']} {v['ppl_delta_pct']:+.2f}%" for v in r["variants"]]
    ppl = f"perplexity vs {base}: " + ", ".join(parts) + "." if parts else "baseline only."
    checks = stored_checks(r) if checks is None else checks
    failed = [c for c in checks if not c.passed]
    if not checks:
        line = f"**Perplexity vs {base}:** " + ", ".join(parts) + "." if parts else "**Baseline only.**"
    elif failed:
        line = f"{FAIL} **{len(failed)} of {len(checks)} gate checks fail** ({', '.join(sorted({c.variant for c in failed}))}); {ppl}"
    else:
        line = f"{PASS} **All {len(checks)} gate checks pass**; {ppl}"
    if moves is not None:
        beyond = [m for m in moves["moves"] if m.beyond_intervals]
        if beyond:
            line += f" {MOVED} {len(beyond)} change{'s' if len(beyond) > 1 else ''} beyond the intervals since the previous run."
    return line


def _cell(text: str, failed: list[Check]) -> str:
    return f"**{text}** {FAIL}" if failed else text


def results_table(r: dict, checks: list[Check]) -> list[str]:
    base = r["baseline"]
    by_cell: dict[tuple[str, str], list[Check]] = {}
    for c in checks:
        by_cell.setdefault((c.variant, c.metric if c.task in (None, "next-token") else "tasks"), []).append(c)
    lines = [
        f"| variant | weights | inputs | perplexity | Δ ppl vs {base['name']} | next-token acc | acc recovery | KL vs {base['name']} (nats/token) | top-1 agreement |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        f"| **{base['name']}** (baseline) | {base['recipe']['weights']} | {base['recipe']['inputs']} | {base['perplexity']:.4f} | | {100 * base['accuracy']:.2f}% | | | |",
    ]
    for v in r["variants"]:
        name = v["name"]
        fails = [c for c in checks if c.variant == name and not c.passed]
        mark = f" {FAIL}" if fails else (f" {PASS}" if any(c.variant == name for c in checks) else "")
        recovery = 100 * v["accuracy"] / base["accuracy"] if base["accuracy"] > 0 else 100.0
        cell = {m: [c for c in by_cell.get((name, m), []) if not c.passed] for m in ("ppl_delta_pct", "accuracy_recovery_pct", "kl_div")}
        ppl_delta = _cell(f"{v['ppl_delta_pct']:+.2f}%", cell["ppl_delta_pct"])
        recovery = _cell(f"{recovery:.2f}%", cell["accuracy_recovery_pct"])
        kl = _cell(f"{v['kl_div']:.5f}", cell["kl_div"])
        lines.append(
            f"| {name}{mark} | {v['recipe']['weights']} | {v['recipe']['inputs']} | {v['perplexity']:.4f} "
            f"| {ppl_delta} | {100 * v['accuracy']:.2f}% | {recovery} | {kl} | {100 * v['top1_agreement']:.2f}% |")
    return lines


def gates_note(r: dict) -> str:
    from ptq.gates import Limits

    limits = Limits.from_json(r["gates"]["limits"])
    return ("<sub>Gates: " + "; ".join(limits.describe()) + ". Δ ppl = ppl_variant / ppl_baseline - 1; "
            "accuracy recovery = accuracy_variant / accuracy_baseline (next-token accuracy and each task); "
            "KL = mean KL(baseline || variant) per token. A gate judges the measured value, not its interval.</sub>")


def _fmt(metric: str, value: float) -> str:
    if metric == "perplexity":
        return f"{value:.4f}"
    if metric == "ppl_delta_pct":
        return f"{value:+.2f}%"
    if metric == "kl_div":
        return f"{value:.5f}"
    return f"{100 * value:.2f}%"  # accuracy, agreement: fractions


def _fmt_change(m: Move) -> str:
    if m.metric == "perplexity":
        rel = f" ({100 * m.change / m.previous:+.2f}%)" if m.previous else ""
        return f"{m.change:+.4f}{rel}"
    if m.metric == "ppl_delta_pct":
        return f"{m.change:+.2f} points"
    if m.metric == "kl_div":
        return f"{m.change:+.5f}"
    return f"{100 * m.change:+.2f} points"


def _ci_text(ci: tuple[float, float] | None, metric: str) -> str:
    return f" [{_fmt(metric, ci[0]).lstrip('+')}, {_fmt(metric, ci[1]).lstrip('+')}]" if ci else ""


def trend_section(t: dict, previous: dict) -> list[str]:
    moves: list[Move] = t["moves"]
    judged = [m for m in moves if m.beyond_intervals is not None]
    beyond = [m for m in judged if m.beyond_intervals]
    lines = [f"## Trend vs the previous run ({previous.get('created', '?')})", ""]
    if judged:
        lines.append(f"{len(beyond)} of {len(judged)} changes with intervals on both runs are beyond them (the intervals "
                     "do not overlap); changes without intervals are shown unjudged.")
    else:
        lines.append("These results carry no intervals: plain changes, not judged against noise.")
    if t["setup_changes"]:
        lines.append(f"{MOVED} The runs differ in setup ({'; '.join(t['setup_changes'])}): changes mix the code change with that.")
    if t["only_now"] or t["only_before"]:
        lines.append(f"New: {', '.join(t['only_now']) or 'none'}; gone: {', '.join(t['only_before']) or 'none'}.")
    lines += ["", "| recipe | metric | previous | now | change | beyond intervals |", "|---|---|---:|---:|---:|:---:|"]
    for m in moves:
        label = f"{m.task} accuracy" if m.task else LABELS[m.metric]
        flag = "—" if m.beyond_intervals is None else (f"{MOVED} {'worse' if m.worse else 'better'}" if m.beyond_intervals else "no")
        lines.append(f"| {m.entry} | {label} | {_fmt(m.metric, m.previous)}{_ci_text(m.previous_ci, m.metric)} "
                     f"| {_fmt(m.metric, m.current)}{_ci_text(m.current_ci, m.metric)} | {_fmt_change(m)} | {flag} |")
    return lines


def _details(title: str, body: list[str]) -> list[str]:
    return [f"<details><summary><b>{title}</b></summary>", "", *body, "", "</details>", ""]


def details_sections(r: dict) -> list[str]:
    ev, cal = r["eval"], r.get("calibration")
    out = _details("Protocol", [f"- {line}" for line in r["protocol"]])
    model = [f"- Model: `{r['model']['name']}`, {r['model']['source']}."]
    model += [f"- Note: {c}" for c in r["model"]["caveats"]]
    model += [f"- Evaluation text: {ev['data']} (sha256 `{ev['data_sha256'][:16]}`).", f"- Device: {r['device']}."]
    out += _details("Model and data", model)
    if cal:
        body = [f"- {cal['source']}",
                f"- Text: {cal['data']} (sha256 `{str(cal['data_sha256'])[:16]}`), {cal['windows']} windows x {cal['seq_len']} tokens = {cal['tokens']:,} tokens.",
                f"- {cal['summary']['layers']} layers; input amax across layers: min {cal['summary']['input_amax_min']:.4g}, "
                f"median {cal['summary']['input_amax_median']:.4g}, max {cal['summary']['input_amax_max']:.4g}.",
                "", "Largest input amax:", "", "| layer | input amax | weight amax |", "|---|---:|---:|"]
        body += [f"| `{row['layer']}` | {row['input_amax']:.4g} | {row['weight_amax']:.4g} |" for row in cal["summary"]["largest"]]
        body += faults_lines(cal.get("faults") or {})
        out += _details("Calibration", body)
    snr = [v for v in r["variants"] if v.get("snr_db")]
    if snr:
        body = ["Median and worst quantization SNR over the quantized layers (dB; see the SNR plot for every layer):", "",
                "| variant | weights median | weights worst (layer) | inputs median | inputs worst (layer) |", "|---|---:|---:|---:|---:|"]
        for v in snr:
            body.append(f"| {v['name']} | " + " | ".join(_snr_summary(v["snr_db"].get(part, {})) for part in ("weights", "inputs")) + " |")
        out += _details("Per-layer SNR", body)
    out += _details("Versions", [", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}."])
    return out


def _snr_summary(values: dict[str, float | None]) -> str:
    known = sorted((db, layer) for layer, db in values.items() if db is not None)
    if not known:
        return "— | —"
    median = known[len(known) // 2][0]
    worst_db, worst_layer = known[0]
    return f"{median:.1f} | {worst_db:.1f} (`{worst_layer}`)"


def faults_lines(faults: dict) -> list[str]:
    """What calibration worked around (ptq.calibrate's fault rules), so no fallback goes unnoticed."""
    unseen, skipped, warnings = faults.get("unseen_layers", []), faults.get("nonfinite_batches", {}), faults.get("warnings", [])
    if not (unseen or skipped or warnings):
        return []
    lines = ["", "### Calibration faults", ""]
    lines += [f"- Layer `{u['layer']}` received no calibration data: input amax {u['input_amax']:.4g} "
              f"({u['rule']})." for u in unseen]
    lines += [f"- Layer `{layer}`: {n} calibration batch(es) with NaN/inf inputs left out (--on-nonfinite skip)."
              for layer, n in skipped.items()]
    lines += [f"- Warning: {w}." for w in warnings]
    return lines
