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
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + f"; created {r['created']}.", ""]
    return "\n".join(lines)


def verdict(r: dict) -> str:
    base = r["baseline"]["name"]
    parts = [f"{v['name']} {v['ppl_delta_pct']:+.2f}%" for v in r["variants"]]
    return f"**Perplexity vs {base}:** " + ", ".join(parts) + "." if parts else "**Baseline only.**"


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def render_model_card(e: dict) -> str:
    """README.md of a `ptq quantize` checkpoint, rendered from its ptq-export.json alone."""
    rec, fmt, cal, size, ver = e["recipe"], e["format"], e["calibration"], e["size"], e["verification"]
    lines = [
        "---", "library_name: transformers", "tags: [ptq, compressed-tensors, "
        + ("fp8" if fmt["format"] == "float-quantized" else "int8") + "]", "---", "",
        f"# {e['model']['name']} — {rec['name']} (ptq {e['versions']['ptq']})", "",
        f"Post-training quantized with ptq, recipe `{rec['name']}`: {rec['description']}.", "",
        "| | |", "|---|---|",
        f"| source model | {e['model']['source']} ({e['model']['architecture']}) |",
        f"| weights | {rec['weights']}, stored 1 byte per parameter |",
        f"| inputs (activations) | {rec['inputs']}, static scale from calibration (`input_scale`) |",
        f"| layers | {fmt['quantized_layers']} Linear layers quantized; left as in the source: {', '.join(f'`{n}`' for n in fmt['ignored_layers']) or 'none'} |",
        f"| format | compressed-tensors `{fmt['format']}` (compressed-tensors {fmt['compressed_tensors']}) |",
        f"| size | {human_bytes(size['bytes'])} of tensors in {size['shards']} safetensors shard(s); the 16-bit checkpoint is "
        f"{human_bytes(size['bytes_16bit'])}: {human_bytes(size['bytes_saved'])} saved ({100 * size['bytes_saved'] / size['bytes_16bit']:.1f}%) |",
        f"| other tensors | unchanged from the source ({', '.join(size['other_dtypes'])}, {human_bytes(size['other_bytes'])}) |",
        f"| calibration | {cal['data']} (sha256 `{str(cal['data_sha256'])[:16]}`), {cal['windows']} windows x {cal['seq_len']} tokens "
        f"= {cal['tokens']:,} tokens; {cal['source']} |",
        "",
    ]
    lines += [f"Note: {c}" for c in e["model"]["caveats"]]
    lines += ["", "## Verification", ""]
    if ver is None:
        lines += ["Not verified (exported with `--no-verify`)."]
    else:
        tol = ver["tolerance"]
        lines += [
            f"**{'Passed' if ver['passed'] else 'FAILED'}.** After writing, this directory was loaded with transformers' "
            "`AutoModelForCausalLM.from_pretrained` (float32, CPU, default options) and scored against ptq's simulation "
            f"of the same recipe and calibration on {ver['description']} of {ver['data']}:", "",
            "| | simulated (ptq) | reloaded (transformers) | limit |", "|---|---:|---:|---:|",
            f"| perplexity | {ver['simulated_perplexity']:.4f} | {ver['reloaded_perplexity']:.4f} | |",
        ]
        if ver.get("loader_int8_rounding"):
            lines += [f"| perplexity, ptq's own int8 rounding ([-127, 127] inputs) | {ver['ptq_perplexity']:.4f} | "
                      f"{ver['reloaded_perplexity']:.4f} | ±{tol['max_ppl_delta_pct']:g}% (here {ver['ppl_delta_pct']:+.4f}%) |"]
        else:
            lines[-1] = lines[-1][:-2] + f"| ±{tol['max_ppl_delta_pct']:g}% (here {ver['ppl_delta_pct']:+.4f}%) |"
        lines += [
            f"| KL(simulated ‖ reloaded), nats/token | | {ver['kl_div']:.3g} | ≤ {tol['max_kl_div']:g} |",
            f"| same top-1 token | | {100 * ver['top1_agreement']:.2f}% | ≥ {100 * tol['min_top1_agreement']:g}% |",
            f"| layers transformers runs with static input quantization | {fmt['quantized_layers']} | "
            f"{ver['load']['input_quantized_layers']} | all |",
            "",
            "transformers (with compressed-tensors installed) decompresses the 8-bit weights to the load dtype on the first "
            "forward pass and rounds every quantized layer's input with its stored `input_scale` (clamp, then round to the "
            "8-bit grid) before the matmul, so on a CPU it computes what the ptq simulation computes. Loading with "
            "`CompressedTensorsConfig(dequantize=True)` instead drops the input scales: only the weight rounding remains.",
        ]
        lines += [f"- Problem: {p}" for p in ver["problems"]]
    lines += ["", "The simulation keeps the left-out layers in the source dtype, as this checkpoint does; `ptq compare` "
              "rounds them to bf16 like its 16-bit baseline, so its perplexity for this recipe can differ slightly."]
    if fmt["format"] == "int-quantized":
        lines += ["", "int8 convention: ptq uses symmetric codes in [-127, 127] (scale = amax / 127). transformers "
                  "(compressed-tensors) and vLLM clamp inputs to [-128, 127], so an input below -127.5 x input_scale "
                  "(beyond the calibrated range) becomes -128 there but -127 in ptq; the weights never use -128. The "
                  "logits check above therefore simulates the loaders' input rounding, and the perplexity row with "
                  "ptq's own rounding shows what that difference costs."]
    c = e.get("compare")
    if c:
        b, v = c["baseline"], c["variant"]
        lines += ["", "## Accuracy (ptq compare)", "",
                  f"From `{c['file']}` (model `{c['model']}`; evaluation: {c['eval']}, sha256 `{str(c['eval_sha256'])[:16]}`); "
                  "simulated, on the source model:", "",
                  f"| variant | perplexity | Δ ppl vs {b['name']} | next-token acc | KL vs {b['name']} | top-1 agreement |",
                  "|---|---:|---:|---:|---:|---:|",
                  f"| {b['name']} (baseline) | {b['perplexity']:.4f} | | {100 * b['accuracy']:.2f}% | | |",
                  f"| {v['name']} | {v['perplexity']:.4f} | {v['ppl_delta_pct']:+.2f}% | {100 * v['accuracy']:.2f}% "
                  f"| {v['kl_div']:.5f} | {100 * v['top1_agreement']:.2f}% |"]
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer  # needs: pip install compressed-tensors",
              "model = AutoModelForCausalLM.from_pretrained(\"PATH\")",
              "tokenizer = AutoTokenizer.from_pretrained(\"PATH\")", "```", "",
              "vLLM reads the same `quantization_config` (`vllm serve PATH`). With ptq, `ptq compare PATH` evaluates the "
              "dequantized 8-bit weights as its model (its bf16 baseline is then this checkpoint's weights with 16-bit inputs).",
              "", "## Versions", "", ", ".join(f"{k} {v}" for k, v in e["versions"].items()) + f"; created {e['created']}.", ""]
    return "\n".join(lines)
