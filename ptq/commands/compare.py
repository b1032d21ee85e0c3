"""ptq compare: model + recipes (+ calibration) -> bf16 baseline and variants on held-out text ->
report (+ gates).

Every variant runs on the same windows as the baseline; the report holds each one's perplexity,
accuracy, KL and top-1 agreement against it, with intervals, and its layers' weight and input SNR.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ptq.calibration.clips import quantize_variants
from ptq.commands.common import (
    now,
    refuse_resume,
    refuse_unused_calibration,
    runs_layer_by_layer,
    versions,
)
from ptq.commands.measure import (
    BASELINE_RECIPE,
    Prepared,
    check_report_outputs,
    check_task_options,
    checked_compute_path,
    prepare,
    read_texts,
    score_layer_by_layer,
    score_whole,
    task_suite,
)
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
)
from ptq.commands.results import build_results
from ptq.errors import PtqError
from ptq.evaluation import harness
from ptq.evaluation.layerstats import layer_snr, weight_snr_db
from ptq.execution import streaming
from ptq.execution.placement import Placement
from ptq.files import writes_outputs
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.gates import refuse_unmeasured_gates
from ptq.reporting.report import write_report
from ptq.reporting.results import CompareResults
from ptq.runtime import devices, distributed
from ptq.runtime.devices import compute_dtype, default_device

DEFAULT_RECIPES = ("fp8-e4m3", "int8")


@writes_outputs
def run_compare(
    recipes: list[str],
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> CompareResults:
    """The bf16 baseline and each recipe on the same windows, report written to output.path.
    compute.low_memory: layer by layer from disk (ptq.execution.streaming); None: when the model and
    its variants' weight codes do not fit in memory. model.placement (--device-map): the model
    loaded and quantized on the CPU, each variant then placed over the GPUs and offloaded
    (ptq.execution.placement)."""
    refuse_resume("compare", calibration)
    check_task_options(data)
    distributed.setup()
    copies = _peak_copies(model, len(recipes))
    streamed = _streamed(model, compute, copies, len(recipes))
    compute_info = checked_compute_path(model, compute, data, streamed)
    baseline, variants = _compared_recipes(recipes)
    check_report_outputs(output, model, data, calibration, variants)
    if streamed:
        streaming.check_compare_recipes(variants)
    needed = [r for r in variants if r.needs_calibration]
    refuse_unused_calibration(
        calibration,
        bool(needed),
        f"recipe(s) {', '.join(r.name for r in variants)} need no calibration",
        "--calib-data",
    )
    texts = read_texts(calibration, data, needed)
    task_work, suite = task_suite(data, texts.evaluation)  # fail before the model
    refuse_unmeasured_gates(output.limits, suite.scored if suite else set())
    prepared = prepare(
        model,
        data,
        calibration,
        compute,
        [baseline, *variants],
        needed,
        texts,
        streamed=streamed,
        dtype=getattr(torch, compute_info["dtype"]),
        copies=copies,
    )
    scores, snr, task_run = _score(
        prepared, baseline, variants, suite, streamed, compute, model.placement, compute_info
    )
    results = build_results(
        loaded=prepared.loaded,
        compute=compute_info,
        corpus=texts.evaluation,
        windows=prepared.windows,
        scores=scores,
        recipes=variants,
        coverages=prepared.coverages,
        target=compute.target,
        versions=versions(),
        created=now(),
        baseline=baseline,
        snr=snr,
        tasks=(task_run, suite) if task_run is not None else None,
        calibration=prepared.calibration if needed else None,
        calibration_source=prepared.calibration_source,
        layer_order=prepared.layer_order,
        limits=output.limits,
    )
    if distributed.is_main():
        write_report(Path(output.path), results, output.force, output.plots)
    return results


def _peak_copies(model: ModelOptions, variants: int) -> float:
    """Peak memory, in float32 copies of the model: the original in the compute dtype plus, per
    variant and for the baseline, weight codes of 2 bytes at most."""
    return torch.finfo(compute_dtype(model.dtype, default_device())).bits / 32 + 0.5 * (
        variants + 1
    )


def _streamed(model: ModelOptions, compute: ComputeOptions, copies: float, variants: int) -> bool:
    """Whether the comparison runs layer by layer from disk: asked for, or (automatic) where the
    model and its variants, `copies` float32 copies of it, do not fit in memory, said in a note."""
    return runs_layer_by_layer(
        model,
        compute.low_memory,
        copies,
        note=(
            f"note: model '{model.model}' and {variants + 1} variants of it do not fit in "
            f"memory: comparing layer by layer from disk ({streaming.LOW_MEMORY_FLAG})"
        ),
    )


def _compared_recipes(recipes: list[str]) -> tuple[Recipe, list[Recipe]]:
    """The baseline and the variants, refused when no variant is given or two share a name (a
    report row and a gate are named by it)."""
    baseline = load_recipe(BASELINE_RECIPE)
    variants = [load_recipe(r) for r in recipes]
    # `--recipes "$EMPTY"`: a baseline alone, whose gates would pass with nothing to judge
    if not variants:
        raise PtqError(
            "no recipe given: --recipes names the recipe(s) to compare with the bf16 baseline, "
            "comma-separated"
        )
    names = [baseline.name] + [r.name for r in variants]
    if clash := next((n for i, n in enumerate(names) if n in names[:i]), None):
        where = ", ".join(r.source or r.name for r in variants if r.name == clash)
        if clash == baseline.name:
            raise PtqError(
                f"recipe name '{clash}' is the baseline's ({where}): every compare has the "
                "baseline; a variant needs a name of its own"
            )
        raise PtqError(
            f"recipe name '{clash}' is given twice ({where}): each recipe may appear once (a "
            "report row and a gate are named by it)"
        )
    return baseline, variants


def _build_variants(
    prepared: Prepared, baseline: Recipe, variants: list[Recipe], matmul: str, target: str
) -> tuple[dict, dict, dict[str, dict]]:
    """The baseline and each variant, a quantized copy of the model sharing with the others what it
    does not quantize, the variants apart (`quantized`), and their weight SNR; the original model
    is then released, before the evaluation's batches."""
    loaded = prepared.loaded
    with devices.gpu_memory(
        f"building {len(variants) + 1} variants of the model (the baseline and each recipe)"
    ):
        models = quantize_variants(
            loaded.model,
            [baseline, *variants],
            prepared.calibration,
            matmul,
            target,
            prepared.plans,
        )
        quantized = {r.name: models[r.name] for r in variants}
        weight_snr = {name: weight_snr_db(loaded.model, m) for name, m in quantized.items()}
    del loaded.model
    devices.release()  # the original's memory, before the evaluation's batches
    return models, quantized, weight_snr


def _score(
    prepared: Prepared,
    baseline: Recipe,
    variants: list[Recipe],
    suite: harness.Suite | None,
    streamed: bool,
    compute: ComputeOptions,
    placement: Placement | None,
    compute_info: dict,
) -> tuple[dict, dict, harness.HarnessRun | None]:
    """The scores of the baseline and each variant, the variants' layer SNR, and lm-eval's run of
    the tasks (None: no tasks, or layer by layer)."""
    matmul, task_run = compute_info["matmul"], None
    if streamed:
        scores, weight_snr, input_snr = score_layer_by_layer(
            prepared, baseline, variants, matmul, compute.target, compute.batch_size
        )
    else:
        models, quantized, weight_snr = _build_variants(
            prepared, baseline, variants, matmul, compute.target
        )
        scores, input_snr, task_run = score_whole(
            models, quantized, prepared, suite, compute.batch_size, placement, compute_info
        )
    return scores, layer_snr(weight_snr, input_snr), task_run
