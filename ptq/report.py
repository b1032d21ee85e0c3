"""The one writer of reports: results.json (machine-readable, the source of truth) and report.md,
rendered from it alone, so a results file can be re-rendered later."""

from __future__ import annotations

import json
from pathlib import Path

from ptq.files import check_writable, write_text_atomic


def write_report(out_dir: Path, results: dict, force: bool, render=None) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    report, results_file = out_dir / "report.md", out_dir / "results.json"
    for path in (report, results_file):
        check_writable(path, force)
    write_text_atomic(results_file, json.dumps(results, indent=2, sort_keys=False) + "\n")
    write_text_atomic(report, (render or render_markdown)(results))
    return report, results_file


def render_markdown(r: dict) -> str:
    base, ev, cal = r["baseline"], r["eval"], r.get("calibration")
    lines = [f"# ptq compare: {r['model']['name']}", "", verdict(r), ""]
    lines += [
        f"| variant | weights | inputs | perplexity | Δ ppl vs {base['name']} | next-token acc | Δ acc (points) | KL vs {base['name']} (nats/token) | top-1 agreement |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        f"| **{base['name']}** (baseline) | {base['recipe']['weights']} | {base['recipe']['inputs']} | {base['perplexity']:.4f} | | {100 * base['accuracy']:.2f}% | | | |",
    ]
    for v in r["variants"]:
        lines.append(
            f"| {v['name']} | {v['recipe']['weights']} | {v['recipe']['inputs']} | {v['perplexity']:.4f} | {v['ppl_delta_pct']:+.2f}% "
            f"| {100 * v['accuracy']:.2f}% | {100 * v['accuracy_delta']:+.2f} | {v['kl_div']:.5f} | {100 * v['top1_agreement']:.2f}% |")
    lines += intervals_section(r)
    lines += tasks_section(r)
    lines += ["", "## Protocol", ""]
    lines += [f"- {line}" for line in r["protocol"]]
    lines += ["", "## Model and data", "",
              f"- Model: `{r['model']['name']}`, {r['model']['source']}."]
    lines += [f"- Note: {c}" for c in r["model"]["caveats"]]
    lines += [f"- Evaluation text: {ev['data']} (sha256 `{ev['data_sha256'][:16]}`).",
              f"- Device: {r['device']}."]
    if cal:
        lines += ["", "## Calibration", "",
                  f"- {cal['source']}",
                  f"- Text: {cal['data']} (sha256 `{str(cal['data_sha256'])[:16]}`), {cal['windows']} windows x {cal['seq_len']} tokens = {cal['tokens']:,} tokens.",
                  f"- {cal['summary']['layers']} layers; input amax across layers: min {cal['summary']['input_amax_min']:.4g}, "
                  f"median {cal['summary']['input_amax_median']:.4g}, max {cal['summary']['input_amax_max']:.4g}.",
                  "", "<details><summary>Largest input amax</summary>", "",
                  "| layer | input amax | weight amax |", "|---|---:|---:|"]
        lines += [f"| `{row['layer']}` | {row['input_amax']:.4g} | {row['weight_amax']:.4g} |" for row in cal["summary"]["largest"]]
        lines += ["", "</details>"]
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}.", ""]
    return "\n".join(lines)


def verdict(r: dict) -> str:
    base = r["baseline"]["name"]
    parts = [f"{v['name']} {v['ppl_delta_pct']:+.2f}%" for v in r["variants"]]
    return f"**Perplexity vs {base}:** " + ", ".join(parts) + "." if parts else "**Baseline only.**"


# ----------------------------------------------------------------------------------------------
# Uncertainty and task accuracy (sections of report.md; results.json has every number they show)


def _ci(ci: list[float], scale: float = 1, fmt: str = ".2f") -> str:
    return f"[{scale * ci[0]:{fmt}}, {scale * ci[1]:{fmt}}]"


def _distinguishable(significant: bool) -> str:
    return "**yes**" if significant else "no"


def intervals_section(r: dict) -> list[str]:
    """Perplexity and next-token accuracy with 95% intervals, and the paired deltas vs the baseline."""
    base = r["baseline"]
    if "perplexity_ci" not in base:
        return []
    lines = ["", "## Intervals (95%)", "",
             f"Bootstrap over the {r['eval']['windows']} evaluation windows; a delta is paired (same windows for "
             f"{base['name']} and the variant) and is distinguishable from zero when its interval excludes 0.", "",
             f"| variant | perplexity | 95% CI | Δ ppl vs {base['name']} | 95% CI | distinguishable from 0 "
             "| next-token acc | 95% CI | Δ acc (points) | 95% CI | distinguishable from 0 |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
             f"| **{base['name']}** (baseline) | {base['perplexity']:.4f} | {_ci(base['perplexity_ci'], fmt='.4f')} | | | "
             f"| {100 * base['accuracy']:.2f}% | {_ci(base['accuracy_ci'], 100)} | | | |"]
    for v in r["variants"]:
        lines.append(
            f"| {v['name']} | {v['perplexity']:.4f} | {_ci(v['perplexity_ci'], fmt='.4f')} | {v['ppl_delta_pct']:+.2f}% "
            f"| {_ci(v['ppl_delta_pct_ci'], fmt='+.2f')}% | {_distinguishable(v['ppl_delta_significant'])} "
            f"| {100 * v['accuracy']:.2f}% | {_ci(v['accuracy_ci'], 100)} | {100 * v['accuracy_delta']:+.2f} "
            f"| {_ci(v['accuracy_delta_ci'], 100, '+.2f')} | {_distinguishable(v['accuracy_delta_significant'])} |")
    return lines


def tasks_section(r: dict) -> list[str]:
    """Per task and metric: each variant's accuracy with its interval and its paired delta vs the baseline."""
    if not r.get("tasks"):
        return []
    entries = [r["baseline"], *r["variants"]] if "baseline" in r else [r["config"]]
    base_name = r["baseline"]["name"] if "baseline" in r else None
    lines = ["", "## Task accuracy", ""]
    head = "| task | metric | n | chance | variant | accuracy | 95% CI |"
    rule = "|---|---|---:|---:|---|---:|---:|"
    if base_name:
        head += f" Δ vs {base_name} (points) | 95% CI | distinguishable from 0 |"
        rule += "---:|---:|---|"
    lines += [head, rule]
    for task in r["tasks"]:
        for metric in task["metrics"]:
            for e in entries:
                t = e["tasks"][task["name"]]
                row = (f"| {task['name']} | {metric} | {t['n']} | {100 * task['chance']:.1f}% | "
                       f"{'**' + e['name'] + '**' if e['name'] == base_name else e['name']} | "
                       f"{100 * t[metric]:.2f}% | {_ci(t[metric + '_ci'], 100)} |")
                if base_name:
                    d = e.get("task_deltas", {}).get(task["name"], {}).get(metric)
                    row += (f" {100 * d['delta']:+.2f} | {_ci(d['ci'], 100, '+.2f')} | {_distinguishable(d['significant'])} |"
                            if d else " | | |")
                lines.append(row)
    lines += ["", "Tasks:", ""]
    for task in r["tasks"]:
        subset = f"{task['n']} of {task['available']} items (evenly spaced)" if task["n"] < task["available"] else f"all {task['n']} items"
        lines.append(f"- **{task['name']}** ({task['kind']}): {task['source']}; {subset}; sha256 `{task['sha256'][:16]}`. "
                     f"Chance {100 * task['chance']:.1f}%: {task['chance_note']}.")
        lines += [f"  - {note}" for note in task["notes"]]
    scoring = r.get("task_scoring")
    if scoring:
        passes = ", ".join(f"{name} {n}" for name, n in scoring["forward_passes"].items())
        lines += ["", f"Scoring: {scoring['items']} items in batches of {scoring['batch_size']}: forward passes per "
                      f"variant: {passes} (ceil(items / batch) = {scoring['expected_forward_passes']}), plus "
                      f"{scoring['packing_check_passes']} once for the packing check."]
    return lines


def render_eval_markdown(r: dict) -> str:
    """The report of `ptq eval`: one configuration, no baseline."""
    c, ev, cal = r["config"], r["eval"], r.get("calibration")
    lines = [f"# ptq eval: {r['model']['name']} with {c['name']}", "",
             "| configuration | weights | inputs | perplexity | 95% CI | next-token acc | 95% CI |",
             "|---|---|---|---:|---:|---:|---:|",
             f"| {c['name']} | {c['recipe']['weights']} | {c['recipe']['inputs']} | {c['perplexity']:.4f} "
             f"| {_ci(c['perplexity_ci'], fmt='.4f')} | {100 * c['accuracy']:.2f}% | {_ci(c['accuracy_ci'], 100)} |"]
    lines += tasks_section(r)
    lines += ["", "## Protocol", ""] + [f"- {line}" for line in r["protocol"]]
    lines += ["", "## Model and data", "", f"- Model: `{r['model']['name']}`, {r['model']['source']}."]
    lines += [f"- Note: {note}" for note in r["model"]["caveats"]]
    lines += [f"- Evaluation text: {ev['data']} (sha256 `{ev['data_sha256'][:16]}`), {ev['description']}.",
              f"- Device: {r['device']}."]
    if cal:
        lines += [f"- Calibration: {cal['source']} {cal['data']}, {cal['windows']} windows x {cal['seq_len']} tokens."]
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}.", ""]
    return "\n".join(lines)
