"""The one writer of reports: results.json (machine-readable, the source of truth) and report.md,
rendered from it alone, so a results file can be re-rendered later."""

from __future__ import annotations

import json
from pathlib import Path

from ptq.files import check_writable, write_text_atomic


def write_report(out_dir: Path, results: dict, force: bool) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    report, results_file = out_dir / "report.md", out_dir / "results.json"
    for path in (report, results_file):
        check_writable(path, force)
    write_text_atomic(results_file, json.dumps(results, indent=2, sort_keys=False) + "\n")
    write_text_atomic(report, render_markdown(results))
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
    lines += render_coverage(r)
    lines += render_diagnostics(r)
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}.", ""]
    return "\n".join(lines)


def verdict(r: dict) -> str:
    base = r["baseline"]["name"]
    parts = [f"{v['name']} {v['ppl_delta_pct']:+.2f}%" for v in r["variants"]]
    return f"**Perplexity vs {base}:** " + ", ".join(parts) + "." if parts else "**Baseline only.**"


def render_diagnostics(r: dict, top: int = 10) -> list[str]:
    """Per-tensor SQNR under E4M3 and int8 (results["diagnostics"]): the worst tensors of each, then all."""
    d = r.get("diagnostics")
    if not d:
        return []
    rows = {row["tensor"]: row for row in d["tensors"]}

    def fmt_db(v):
        return "exact" if v is None else f"{v:.1f}"

    lines = ["", "## Per-tensor diagnostics (calibration data)", "", f"- {d['method']}.", ""]
    for name in ("e4m3", "int8"):
        lines += [f"Worst {top} under {name}:", "", "| tensor | amax | SQNR E4M3 (dB) | SQNR int8 (dB) |", "|---|---:|---:|---:|"]
        lines += [f"| `{t}` | {rows[t]['amax']:.4g} | {fmt_db(rows[t]['sqnr_e4m3_db'])} | {fmt_db(rows[t]['sqnr_int8_db'])} |"
                  for t in d[f"worst_{name}"][:top]]
        lines.append("")
    lines += ["<details><summary>All tensors</summary>", "", "| tensor | amax | SQNR E4M3 (dB) | SQNR int8 (dB) |", "|---|---:|---:|---:|"]
    lines += [f"| `{t}` | {row['amax']:.4g} | {fmt_db(row['sqnr_e4m3_db'])} | {fmt_db(row['sqnr_int8_db'])} |" for t, row in rows.items()]
    lines += ["", "</details>"]
    return lines


def render_coverage(r: dict) -> list[str]:
    """What each variant quantizes beyond Linear weights and inputs (attention, KV cache, SmoothQuant)."""
    rows = [v for v in r["variants"] if v["recipe"].get("attention") or v["recipe"].get("kv_cache")
            or v["recipe"].get("residual") or v["recipe"].get("smoothquant_alpha") is not None]
    if not rows:
        return []
    lines = ["", "## Coverage beyond Linear layers", "", "| variant | attention matmul inputs | KV cache | residual-add inputs | SmoothQuant alpha |",
             "|---|---|---|---|---:|"]
    for v in rows:
        rec = v["recipe"]
        alpha = rec.get("smoothquant_alpha")
        lines.append(f"| {v['name']} | {rec.get('attention') or 'fp32'} | {rec.get('kv_cache') or 'fp32'} | {rec.get('residual') or 'fp32'} | "
                     f"{'' if alpha is None else f'{alpha:g}'} |")
    return lines
