"""The model card (README.md) of a `ptq quantize` checkpoint, rendered from its export record
(ptq.export.record) alone: what was quantized and how, how the files were verified, how to load
them.
"""

from __future__ import annotations

from ptq.export.record import ExportRecord
from ptq.reporting.coverage import describe_coverage
from ptq.reporting.markdown import cell, code, inline, visible
from ptq.runtime.resources import size_text


def render_model_card(e: ExportRecord) -> str:
    """README.md of a `ptq quantize` checkpoint, rendered from its export record alone."""
    rec, fmt, cal, size, ver = e.recipe, e.format, e.calibration, e.size, e.verification
    lines = [
        "---",
        "library_name: transformers",
        "tags: [ptq, compressed-tensors, "
        + ("int8" if fmt.format == "int-quantized" else "fp8")
        + "]",
        # a model from the Hub: the Hub lists this checkpoint among the source's quantizations
        *(
            [f"base_model: {e.model.hub_id}", "base_model_relation: quantized"]
            if e.model.hub_id
            else []
        ),
        "---",
        "",
        f"# {inline(e.model.name)} — {rec['name']} (ptq {e.versions['ptq']})",
        "",
        f"Post-training quantized with ptq, recipe `{rec['name']}`: {rec['description']}.",
        "",
        "| | |",
        "|---|---|",
        f"| source model | {cell(e.model.source)} ({e.model.architecture}) |",
        f"| weights | {rec['weights']}, stored 1 byte per parameter |",
        f"| inputs (activations) | {rec['inputs']}, "
        + (
            "scales computed on the fly by the engine (no `input_scale`) |"
            if "dynamic" in rec["inputs"]
            else "static scale from calibration (`input_scale`) |"
        ),
        f"| layers | {fmt.quantized_layers} Linear layers quantized; left as in the source: "
        f"{', '.join(f'`{n}`' for n in fmt.ignored_layers) or 'none'} |",
        *([f"| coverage | {describe_coverage(e.coverage)} |"] if e.coverage else []),
        f"| format | compressed-tensors `{fmt.format}` (compressed-tensors "
        f"{fmt.compressed_tensors}) |",
        *([f"| scales for | {e.target_rules} |"] if e.target_rules else []),
        f"| size | {size_text(size.bytes, si=True)} of tensors in {size.shards} safetensors "
        f"shard(s); the 16-bit checkpoint is {size_text(size.bytes_16bit, si=True)}: "
        f"{size_text(size.bytes_saved, si=True)} saved "
        f"({100 * size.bytes_saved / size.bytes_16bit:.1f}%) |",
        f"| other tensors | unchanged from the source ({', '.join(size.other_dtypes)}, "
        f"{size_text(size.other_bytes, si=True)}) |",
        (
            f"| calibration | {cell(cal.data)} (sha256 `{str(cal.data_sha256)[:16]}`), "
            f"{cal.windows} windows x {cal.seq_len} tokens = {cal.tokens:,} tokens; "
            f"{cell(cal.source)} |"
            if cal.tokens is not None
            else f"| calibration | {cell(cal.source)} |"
        ),
        "",
    ]
    lines += [f"Note: {c}" for c in e.model.caveats]
    lines += ["", "## Verification", ""]
    # ptq's own reader stands in where transformers cannot run the checkpoint as quantized (Conv1D,
    # some schemes)
    reader = ver is not None and str(ver.loader or "").startswith("ptq's")
    if ver is None:
        skipped = e.verification_skipped
        lines += [
            f"Not verified ({skipped if skipped is not None else 'exported with `--no-verify`'})."
        ]
    else:
        tol = ver.tolerance
        lines += [
            f"**{'Passed' if ver.passed else 'FAILED'}.** After writing, this directory was loaded "
            f"with {ver.loader or 'transformers AutoModelForCausalLM.from_pretrained'} (float32, "
            "CPU, default options) and scored against ptq's simulation of the same recipe and "
            f"calibration on {ver.description} of {ver.data}:",
            "",
            f"| | simulated (ptq) | reloaded ({'ptq reader' if reader else 'transformers'}) | "
            "limit |",
            "|---|---:|---:|---:|",
            f"| perplexity | {ver.simulated_perplexity:.4f} | {ver.reloaded_perplexity:.4f} | |",
        ]
        if ver.ptq_rounding:
            lines += [
                f"| perplexity, {ver.ptq_rounding} | {ver.ptq_perplexity:.4f} | "
                f"{ver.reloaded_perplexity:.4f} | reported: {ver.ppl_delta_pct:+.4f}% |"
            ]
        noise = ver.noise_floor
        if noise:
            lines += [
                f"| float-order noise floor: {noise.what} | {noise.ppl_delta_pct:+.4f}% "
                f"perplexity, KL {noise.kl_div:.3g}, same top-1 {100 * noise.top1_agreement:.2f}% "
                "| | measured, not a limit |"
            ]
        elif ver.no_noise_floor:
            lines += [f"| float-order noise floor: not measured, {ver.no_noise_floor} | | | |"]
        lines += [
            "| quantized tensors in the files (codes, weight_scale, input_scale) | "
            f"{ver.tensors_checked_in_file} | "
            f"{ver.tensors_checked_in_file - len(ver.tensors_differing)} equal | bit for bit |",
            f"| KL(simulated ‖ reloaded), nats/token | | {ver.kl_div:.3g} | ≤ {tol.max_kl_div:g} |",
            f"| same top-1 token | | {100 * ver.top1_agreement:.2f}% | ≥ "
            f"{100 * tol.min_top1_agreement:g}% |",
            "| layers the loader runs with input quantization (static or dynamic) | "
            f"{fmt.quantized_layers - ver.input_scales_checked_in_file} | "
            f"{ver.load['input_quantized_layers']} | all |",
            *(
                [
                    "| input scales the loader does not apply (fused experts in transformers, or "
                    "ptq's reader), compared with ptq's in the files | "
                    f"{ver.input_scales_checked_in_file} | equal | bit for bit |"
                ]
                if ver.input_scales_checked_in_file
                else []
            ),
            *(
                [
                    "| KV-cache scales (`k_scale`, `v_scale`: vLLM applies them, this loader does "
                    f"not), compared with ptq's in the files | {ver.kv_scales_checked_in_file} | "
                    "equal | bit for bit |"
                ]
                if ver.kv_scales_checked_in_file
                else []
            ),
            "",
            "ptq's reader stands in for transformers here (why: above). It dequantizes every "
            "weight from the files alone (codes x `weight_scale`, each scale over its group or "
            "tile as config.json says) and rounds dynamic inputs on the fly with torch's own "
            "float8 cast, so that the check is of the files, not of ptq's simulation."
            if reader
            else "transformers (with compressed-tensors installed) decompresses the 8-bit weights "
            "to the load dtype on the first forward pass and rounds every quantized layer's input "
            "with its stored `input_scale` (clamp, then round to the 8-bit grid) before the "
            "matmul, so on a CPU it "
            "computes what the ptq simulation computes. Loading with "
            "`CompressedTensorsConfig(dequantize=True)` instead drops the input scales: only the "
            "weight rounding remains.",
        ]
        if ver.criterion:
            lines += [
                "",
                f"Criterion: {ver.criterion}. Why not a perplexity tolerance: a tolerance wide "
                "enough for float-order noise (the row above; 1.1% and KL 0.28 for int8 on "
                "SmolLM2) would let a wrong scale through (one layer's weight_scale x2 there "
                "gives KL 0.20), while the files and the same arithmetic in the same order catch "
                "it.",
            ]
        if ver.input_scales_checked_in_file:
            lines += [
                "",
                "Except where the loader has no place for an input scale: transformers merges "
                "fused experts' per-expert weights and weight scales but not their input scales, "
                "and does not quantize Conv1D layers at all (ptq's own reader then dequantizes the "
                "files' weights). For those layers the simulation takes inputs as they are, and "
                "their `input_scale` tensors, which vLLM applies, are compared with ptq's in the "
                "files.",
            ]
        lines += [f"- Problem: {p}" for p in ver.problems]
    lines += [
        "",
        "The simulation keeps the left-out layers in the source dtype, as this checkpoint does; "
        "`ptq compare` rounds them to bf16 like its 16-bit baseline, so its perplexity for this "
        "recipe can differ slightly.",
    ]
    if fmt.format == "int-quantized":
        lines += [
            "",
            "int8 convention: ptq uses symmetric codes in [-127, 127] (scale = amax / 127). "
            "transformers (compressed-tensors) and vLLM clamp inputs to [-128, 127], so an input "
            "below -127.5 x input_scale (beyond the calibrated range) becomes -128 there but -127 "
            "in ptq; the weights never use -128. The logits check above therefore simulates the "
            "loaders' input rounding, and the perplexity row with ptq's own rounding shows what "
            "that difference costs.",
        ]
    c = e.compare
    if c:
        b, v = c["baseline"], c["variant"]
        lines += [
            "",
            "## Accuracy (ptq compare)",
            "",
            f"From {code(c['file'])} (model {code(c['model'])}; evaluation: {visible(c['eval'])}, "
            f"sha256 "
            f"`{str(c['eval_sha256'])[:16]}`); simulated, on the source model:",
            "",
            f"| variant | perplexity | Δ ppl vs {b['name']} | next-token acc | KL vs {b['name']} | "
            "top-1 agreement |",
            "|---|---:|---:|---:|---:|---:|",
            f"| {b['name']} (baseline) | {b['perplexity']:.4f} | | {100 * b['accuracy']:.2f}% | | "
            "|",
            f"| {v['name']} | {v['perplexity']:.4f} | {v['ppl_delta_pct']:+.2f}% | "
            f"{100 * v['accuracy']:.2f}% | {v['kl_div']:.5f} | {100 * v['top1_agreement']:.2f}% |",
        ]
    lines += ["", "## Use", ""]
    bf16 = (ver.transformers_bfloat16 if ver is not None else None) or {}
    bf16_runs = (
        bool(bf16.get("runs"))
        and bf16.get("layers", 0) > 0
        and bf16.get("equal") == bf16.get("layers")
    )
    if bf16_runs:
        lines += [
            "transformers runs this checkpoint in bfloat16 only (in float32 it fails; see "
            f"Verification): loaded so in the check, its {bf16['layers']} quantized layers' "
            "decompressed weights equal the files' codes x scales, bit for bit.",
            "",
        ]
    if not reader or bf16_runs:
        lines += [
            "```python",
            *(["import torch"] if bf16_runs else []),
            "from transformers import AutoModelForCausalLM, AutoTokenizer  # needs: pip install "
            "compressed-tensors",
            'model = AutoModelForCausalLM.from_pretrained("PATH"'
            f"{', dtype=torch.bfloat16' if bf16_runs else ''})",
            'tokenizer = AutoTokenizer.from_pretrained("PATH")',
            "```",
            "",
        ]
    elif bf16.get("runs"):
        lines += [
            "transformers cannot run this checkpoint as quantized in float32 (see Verification); "
            f"in bfloat16 it loads, but only {bf16['equal']} of its {bf16['layers']} quantized "
            "layers' decompressed weights equal the files' codes x scales.",
            "",
        ]
    else:
        lines += ["transformers cannot run this checkpoint as quantized (see Verification).", ""]
    lines += [
        "vLLM reads the same `quantization_config` (`vllm serve PATH`). With ptq, `ptq compare "
        "PATH` evaluates the dequantized 8-bit weights as its model (its bf16 baseline is then "
        "this checkpoint's weights with 16-bit inputs).",
        "",
        "## Versions",
        "",
        ", ".join(f"{k} {v}" for k, v in e.versions.items()) + f"; created {e.created}.",
        "",
    ]
    return "\n".join(lines)
