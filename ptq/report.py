"""The one writer of reports: results.json (machine-readable, the source of truth) and report.md,
rendered from it alone, so a results file can be re-rendered later."""

from __future__ import annotations

import json
from pathlib import Path

from ptq.files import check_writable, write_texts_atomic


def write_report(out_dir: Path, results: dict, force: bool) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    report, results_file = out_dir / "report.md", out_dir / "results.json"
    for path in (report, results_file):
        check_writable(path, force)
    write_texts_atomic({results_file: json.dumps(results, indent=2, sort_keys=False) + "\n", report: render_markdown(results)})
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
        lines += faults_lines(cal.get("faults") or {})
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}.", ""]
    return "\n".join(lines)


def verdict(r: dict) -> str:
    base = r["baseline"]["name"]
    parts = [f"{v['name']} {v['ppl_delta_pct']:+.2f}%" for v in r["variants"]]
    return f"**Perplexity vs {base}:** " + ", ".join(parts) + "." if parts else "**Baseline only.**"


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
