"""The one builder of results documents (ptq.reporting.results): what `ptq compare` and `ptq eval`
measured, as the typed document that results.json, report.md, the gates, the trend and the plots are
made of. run_compare and run_eval (ptq.commands.compare, ptq.commands.evaluate) measure;
build_results assembles, here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ptq.calibration.calibrate import Calibration, summary_rows
from ptq.calibration.diagnostics import sqnr_table
from ptq.evaluation import harness, stats
from ptq.evaluation.data import Corpus, Windows
from ptq.evaluation.evaluate import Scores
from ptq.execution.placement import describe as describe_placement
from ptq.models.loading import LoadedModel
from ptq.numerics.formats import get_format
from ptq.quantization import engines
from ptq.quantization.recipes import Recipe
from ptq.reporting.gates import gate_results
from ptq.reporting.results import (
    CalibrationEntry,
    CalibrationFaults,
    CalibrationSummary,
    CompareResults,
    Compute,
    Coverage,
    Diagnostics,
    Entry,
    EvalResults,
    EvalSetup,
    LayerAmax,
    LayerSnr,
    Limits,
    ModelInfo,
    RecipeSummary,
    Results,
    Statistics,
    TaskDelta,
    TaskInfo,
    TaskScores,
    TaskScoring,
    Variant,
    parse,
)


def build_results(
    *,
    loaded: LoadedModel,
    compute: dict,
    corpus: Corpus,
    windows: Windows,
    scores: dict[str, Scores],
    recipes: list[Recipe],
    coverages: dict[str, dict],
    target: str,
    versions: dict[str, str],
    created: str,
    baseline: Recipe | None = None,
    snr: dict[str, dict | None] | None = None,
    tasks: tuple[harness.HarnessRun, harness.Suite] | None = None,
    calibration: Calibration | None = None,
    calibration_source: str = "",
    layer_order: list[str] = (),
    limits: Limits | None = None,
) -> Results:
    """compare's document when given a `baseline` (the variants are `recipes`, each measured against
    it, with their layer SNR `snr` and the gates of `limits`), else eval's (`recipes` is its one
    configuration). `scores` and `coverages` are keyed by recipe name; `tasks` is lm-eval's run
    (--tasks); `calibration` the one the recipes used, from `calibration_source`, its layers listed
    in `layer_order` (the model's)."""
    described = harness.describe_tasks(*tasks) if tasks else []
    names = [r.name for r in ([baseline] if baseline else []) + recipes]
    task_entries = _task_entries(tasks[0], described, names, baseline) if tasks else {}
    run = dict(
        model=ModelInfo(name=loaded.name, source=loaded.source, caveats=list(loaded.caveats)),
        device=describe_compute(compute),
        compute=parse(Compute, compute),
        eval=_eval_setup(corpus, windows, scores[baseline.name if baseline else recipes[0].name]),
        protocol=protocol(windows, compute, baseline)
        + [engines.describe(target)]
        + harness.protocol(described),
        target=target,
        statistics=parse(Statistics, stats.describe()),
        calibration=calibration_entry(calibration, calibration_source, layer_order)
        if calibration
        else None,
        tasks=[parse(TaskInfo, t) for t in described] if tasks else None,
        task_scoring=parse(TaskScoring, harness.scoring(*tasks)) if tasks else None,
        versions=versions | ({"lm_eval": harness.lm_eval_version()} if tasks else {}),
        created=created,
    )
    if baseline is None:
        (config,) = recipes
        return EvalResults(
            **run,
            config=_entry(
                Entry, config, scores[config.name], coverages, task_entries.get(config.name)
            ),
        )
    base = scores[baseline.name]
    results = CompareResults(
        **run,
        baseline=_entry(Entry, baseline, base, coverages, task_entries.get(baseline.name)),
        variants=[
            _entry(
                Variant,
                r,
                scores[r.name],
                coverages,
                task_entries.get(r.name),
                base=base,
                snr_db=parse(LayerSnr | None, (snr or {}).get(r.name)),
            )
            for r in recipes
        ],
        diagnostics=parse(Diagnostics | None, sqnr_table(calibration)) if calibration else None,
    )
    return dataclasses.replace(results, gates=gate_results(results, limits or Limits()))


def _entry(
    kind: type, recipe: Recipe, s: Scores, coverages: dict, tasks: dict | None, base=None, **fields
) -> Entry:
    """The baseline's, a variant's (kind Variant, measured against `base`) or eval's configuration's
    entry."""
    if kind is Variant:
        fields |= {
            "ppl_delta_pct": 100 * (s.perplexity / base.perplexity - 1),
            "accuracy_delta": s.accuracy - base.accuracy,
            "kl_div": s.kl_div,
            "top1_agreement": s.top1_agreement,
        }
    return kind(
        name=recipe.name,
        recipe=recipe_summary(recipe),
        perplexity=s.perplexity,
        accuracy=s.accuracy,
        window_nll=list(s.window_nll),
        coverage=parse(Coverage, coverages[recipe.name]),
        **window_statistics(s, base),
        **(tasks or {}),
        **fields,
    )


def window_statistics(s: Scores, base: Scores | None = None) -> dict:
    """Standard errors and 95% intervals over windows; against a baseline also the paired deltas."""
    ppl = stats.estimate(s.window_nll, np.exp)
    acc = stats.estimate(s.window_correct)
    out = {
        "perplexity_stderr": ppl["stderr"],
        "perplexity_ci": tuple(ppl["ci"]),
        "accuracy_stderr": acc["stderr"],
        "accuracy_ci": tuple(acc["ci"]),
    }
    if base is not None:
        kl, agree = stats.estimate(s.window_kl), stats.estimate(s.window_agree)
        ppl_delta = stats.paired_delta(base.window_nll, s.window_nll, stats.ratio_pct_of_exp)
        acc_delta = stats.paired_delta(base.window_correct, s.window_correct, stats.difference)
        out.update(
            {
                "kl_div_stderr": kl["stderr"],
                "kl_div_ci": tuple(kl["ci"]),
                "top1_agreement_stderr": agree["stderr"],
                "top1_agreement_ci": tuple(agree["ci"]),
                "ppl_delta_pct_stderr": ppl_delta["stderr"],
                "ppl_delta_pct_ci": tuple(ppl_delta["ci"]),
                "ppl_delta_significant": ppl_delta["significant"],
                "accuracy_delta_stderr": acc_delta["stderr"],
                "accuracy_delta_ci": tuple(acc_delta["ci"]),
                "accuracy_delta_significant": acc_delta["significant"],
            }
        )
    return out


def _task_entries(
    run: harness.HarnessRun, described: list[dict], names: list[str], baseline: Recipe | None
) -> dict[str, dict]:
    """Per entry: lm-eval's numbers per task (tasks, task_samples) and, for a variant, its paired
    deltas against the baseline (task_deltas)."""
    out = {}
    for name in names:
        against = baseline.name if baseline and name != baseline.name else None
        scored = {"name": name}
        harness.add_task_metrics(scored, run, described, against)
        out[name] = {
            "tasks": parse(dict[str, TaskScores], scored["tasks"]),
            "task_samples": parse(dict[str, dict[str, list[float]]], scored["task_samples"]),
        }
        if against:
            out[name]["task_deltas"] = parse(dict[str, dict[str, TaskDelta]], scored["task_deltas"])
    return out


def calibration_entry(
    calibration: Calibration, source: str, layer_order: list[str]
) -> CalibrationEntry:
    """Where the calibration came from, its text, summary, faults (what calibration worked around,
    and the range warnings) and every layer's amax, in the model's order."""
    m = calibration.metadata
    return CalibrationEntry(
        source=source,
        data=m.get("data"),
        data_sha256=m.get("data_sha256"),
        windows=m.get("windows"),
        seq_len=m.get("seq_len"),
        tokens=m.get("tokens"),
        batch_size=m.get("batch_size"),
        summary=parse(CalibrationSummary, summary_rows(calibration)),
        faults=calibration_faults(m),
        layers=[
            LayerAmax(
                layer=name,
                input_amax=float(calibration.input_amax[name]),
                weight_amax=float(calibration.weight_amax[name]),
            )
            for name in layer_order
            if name in calibration.input_amax
        ],
    )


def calibration_faults(metadata: dict) -> CalibrationFaults:
    """What calibration had to work around, from a calibration's metadata, for reports: unseen
    layers and their fallback, skipped non-finite batches, and range warnings."""
    return parse(
        CalibrationFaults,
        {
            "on_nonfinite": metadata.get("on_nonfinite", "fail"),
            "unseen_layers": metadata.get("unseen_layers", []),
            "nonfinite_batches": metadata.get("nonfinite_batches", {}),
            "warnings": metadata.get("warnings", []),
        },
    )


def describe_compute(compute: dict) -> str:
    """One line for reports."""
    if compute["matmul"] == "fp8":
        why, partial = (
            compute.get("blockwise_simulated"),
            compute.get("blockwise_partial_simulated"),
        )
        blocks = (
            "128 x 128 weight blocks with 1 x 128 input groups too "
            "(torch.nn.functional.scaled_mm block-wise)"
            + (f", but layers with partial blocks simulated ({partial})" if partial else "")
            if why is None
            else f"128 x 128 blocks simulated ({why})"
        )
        matmul = (
            "FP8 layers with per-tensor or per-row scales as real FP8 matmuls (torch._scaled_mm); "
            f"{blocks}; MX groups, and the others, simulated"
        )
    else:
        matmul = (
            "quantized layers simulated (rounded operands, dequantized, multiplied in the compute "
            "dtype)"
        )
    blocks = "; layer by layer from disk (--low-memory)" if compute.get("low_memory") else ""
    placed_text = (
        f"; {describe_placement(compute['placement'])}" if compute.get("placement") else ""
    )
    cpu = [compute.get("cpu"), compute.get("cpu_kernels") and f"{compute['cpu_kernels']} kernels"]
    kernels = f" ({', '.join(x for x in cpu if x)})" if any(cpu) else ""
    return (
        f"{compute['device']}{kernels}, {compute['dtype']} compute; {matmul}{blocks}{placed_text}"
    )


def text_stride(windows: Windows) -> int:
    """Text tokens from one window of the grid to the next: a window's tokens, less the BOS that
    starts each."""
    return windows.seq_len - (1 if windows.bos else 0)


def _eval_setup(corpus: Corpus, windows: Windows, scores: Scores) -> EvalSetup:
    """The evaluation text and its windows."""
    return EvalSetup(
        data=corpus.source,
        data_sha256=corpus.sha256,
        seq_len=windows.seq_len,
        stride=text_stride(windows),
        windows=len(windows.input_ids),
        tokens=scores.tokens,
        bos=windows.bos,
        description=windows.description,
    )


def _with_overrides(r: Recipe, role: str) -> str:
    """The recipe's weights or inputs, and its overrides' ("e4m3 per-tensor; overrides: bf16,
    e4m3 ch")."""
    own = getattr(r, role).describe()
    if not r.overrides:
        return own
    theirs = dict.fromkeys("bf16" if o.keep else getattr(o, role).describe() for o in r.overrides)
    return f"{own}; overrides: {', '.join(theirs)}"


def recipe_summary(r: Recipe) -> RecipeSummary:
    return RecipeSummary(
        name=r.name,
        description=r.description,
        weights=_with_overrides(r, "weights"),
        inputs=_with_overrides(r, "inputs"),
        ignore=list(r.ignore),
        source=Path(r.source).name,
        attention=r.attention.describe() + f" ({', '.join(r.attention_tensors)})"
        if r.attention
        else None,
        kv_cache=r.kv_cache.describe() if r.kv_cache else None,
        smoothquant_alpha=r.smoothquant,
        residual=r.residual.describe() if r.residual else None,
    )


def protocol(windows, compute: dict, baseline: Recipe | None = None) -> list[str]:
    """How the numbers of a results file were measured, one sentence each; with a `baseline`
    (compare), also how the variants are measured against it."""
    int8 = get_format("int8")
    dtype = "fp32" if compute["dtype"] == "float32" else compute["dtype"]
    product = (
        "product in fp32"
        if dtype == "fp32"
        else f"operands dequantized to {dtype} (one {dtype} rounding of each), product accumulated "
        "in fp32"
    )
    if compute["matmul"] == "fp8":
        product += (
            "; layers with FP8 weights and inputs multiply their float8 codes for real "
            "(torch._scaled_mm: fp32 accumulation, both scales applied in fp32)"
        )
    against_baseline = (
        []
        if baseline is None
        else [
            "Next-token accuracy: top-1 prediction equals the next token. KL: mean over predicted "
            f"positions of KL(p_{baseline.name} || p_variant) in nats. Top-1 agreement: the "
            "variant's top-1 token equals the baseline's.",
            f"Baseline `{baseline.name}`: {baseline.description}; matmuls accumulate in fp32. "
            f"Embeddings, norms, attention and activations run in {dtype} in every variant, so "
            "variants differ only in the Linear layers' weights and inputs, except where a recipe "
            "also quantizes attention's batched-matmul inputs (Q, K, V, softmax output) or the KV "
            "cache (its `attention` / `kv_cache` entries): such variants compute attention the "
            "eager way with those inputs rounded.",
        ]
    )
    bos = (
        "a BOS token starts every window"
        if windows.bos
        else "no BOS token (the tokenizer adds none)"
    )
    return [
        f"Perplexity: {windows.description}. Each window is scored on its own tokens "
        f"2..{windows.seq_len} ({windows.seq_len - 1} predictions per window, stride "
        f"{text_stride(windows)} text tokens, no overlap); {bos}.",
        *against_baseline,
        "Quantized Linear: weights quantized once (one scale per tensor, output channel, 128 x 128 "
        "tile or group of the input dimension, as the recipe says); inputs quantized on every "
        "forward with the static per-tensor scale from calibration, or dynamic scales per token or "
        "per input group computed from the input itself; scale = amax / format max (MX: the "
        "smallest power of two with which the amax does not clip, E8M0); round to nearest even, "
        "then saturate to the format's max; "
        f"{product}. Linear layers a recipe leaves out (lm_head by default) run as in the "
        "baseline.",
        f"int8 is symmetric: scale = amax / {int8.max:g}, codes in [-{int8.max:g}, "
        f"{int8.max:g}] (ModelOpt's convention).",
    ]
