"""ptq calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.

Everything that can be refused is refused before the (slow) model load: the options, the output
and its checkpoint, the recipes, the text. The calibration itself (common.calibrate_on_text) is
the one compare, eval and quantize run when they are given no calibration file.
"""

from __future__ import annotations

from pathlib import Path

from ptq.calibration.calibrate import Calibration, checkpoint_path
from ptq.commands.common import (
    calibrate_on_text,
    check_coverage,
    check_placement,
    check_seq_len,
    load_model_for,
    refuse_torchrun,
    runs_layer_by_layer,
)
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    ModelOptions,
    OutputOptions,
    refuse_unused,
)
from ptq.errors import PtqError
from ptq.evaluation.data import load_corpus, spec_source
from ptq.files import check_outputs, writes_outputs
from ptq.quantization.plan import resolve_plans
from ptq.quantization.recipes import Recipe, load_recipe


@writes_outputs
def run_calibrate(
    recipes: list[str],
    *,
    model: ModelOptions = ModelOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> Calibration:
    """Calibrate for `recipes` and save to output.path; a checkpoint (OUTPUT.checkpoint) is kept
    while running and removed at the end. compute.low_memory: layer by layer from disk
    (ptq.execution.streaming); None: when the model does not fit in memory. model.placement: the
    model placed over the GPUs and offloaded (ptq.execution.placement)."""
    refuse_torchrun("calibrate")
    refuse_unused("calibrate", model, dtype="--dtype")
    refuse_unused("calibrate", calibration, file="--calib")
    refuse_unused("calibrate", compute, matmul="--matmul")
    refuse_unused("calibrate", output, limits="a gate")
    check_placement(model.placement, compute.low_memory)
    _refuse_checkpointing_layer_by_layer(calibration, compute)
    loaded_recipes = _recipes_to_calibrate(recipes)
    checkpoint = _check_output(model, calibration, compute, output, loaded_recipes)
    # bad data fails before the (slow) model load
    corpus = load_corpus(calibration.data, role="calibration")
    streamed = not calibration.resume and runs_layer_by_layer(
        model,
        compute.low_memory,
        note=(
            f"note: model '{model.model}' does not fit in memory in float32: working layer by "
            "layer from disk (--low-memory)"
        ),
    )
    loaded = load_model_for(model, streamed)
    check_seq_len(loaded, calibration.seq_len)
    plans = resolve_plans(loaded.model, loaded_recipes)
    check_coverage(plans, model.strict_coverage)
    result = calibrate_on_text(
        loaded,
        corpus,
        plans,
        calibration,
        batch_size=compute.batch_size,
        placement=model.placement,
        output=output.path,
        force=output.force,
        checkpoint=checkpoint,
    )
    checkpoint.unlink(missing_ok=True)
    return result


def _refuse_checkpointing_layer_by_layer(
    calibration: CalibrationOptions, compute: ComputeOptions
) -> None:
    """Layer by layer, every batch is in flight until the last layer: there is no point between
    batches to save at, so --resume and --checkpoint-every are refused with --low-memory."""
    for flag, given in (
        ("--resume", calibration.resume),
        ("--checkpoint-every", calibration.checkpoint_every != CalibrationOptions.checkpoint_every),
    ):
        if compute.low_memory and given:
            raise PtqError(
                f"{flag} is not available with --low-memory (layer-by-layer calibration keeps no "
                "checkpoint)"
            )


def _check_output(
    model: ModelOptions,
    calibration: CalibrationOptions,
    compute: ComputeOptions,
    output: OutputOptions,
    recipes: list[Recipe],
) -> Path:
    """The calibration file: none of the inputs, claimed for this run, replaced only with --force
    (ptq.files.check_outputs), and no checkpoint of an interrupted run in the way unless it is
    resumed (or --force starts over). Returns the checkpoint's path."""
    inputs = {
        "the model": model.model,
        "the calibration text": spec_source(calibration.data),
        "the recipe": [r.source for r in recipes],
    }
    check_outputs([output.path], inputs, output.force)
    checkpoint = checkpoint_path(output.path)
    if checkpoint.exists() and not (calibration.resume or output.force):
        resume = (
            "run without --low-memory and with --resume" if compute.low_memory else "pass --resume"
        )
        raise PtqError(
            f"{checkpoint} is left from an interrupted run: {resume} to continue it, or --force to "
            "start over"
        )
    return checkpoint


def _recipes_to_calibrate(recipes: list[str]) -> list[Recipe]:
    """The recipes, refused when none is given or none needs a calibration (known from the recipes:
    before the slow model load)."""
    loaded_recipes = [load_recipe(r) for r in recipes]
    if not loaded_recipes:
        raise PtqError(
            "no recipe given: --recipe names the recipe(s) to calibrate for, comma-separated"
        )
    if not any(r.needs_calibration for r in loaded_recipes):
        raise PtqError(
            f"recipe(s) {', '.join(r.name for r in loaded_recipes)} need no calibration (no static "
            "input scale, no SmoothQuant): nothing to calibrate"
        )
    return loaded_recipes
