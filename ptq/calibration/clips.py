"""The clips a calibration gives a recipe's static inputs, and quantization with them: quantize_ and
quantize_variants as ptq.quantization.quantize has them, given a Calibration instead of its clips.

Quantization takes plain tensors (ptq.quantization.quantize.Clips); reading them out of a
calibration (its amax, or the clip its histogram gives under the recipe's observer) is calibration's
work."""

from __future__ import annotations

import torch
from torch import nn

from ptq.calibration.calibrate import Calibration
from ptq.calibration.observers import choose_clip
from ptq.errors import PtqError
from ptq.numerics import granularity as gr
from ptq.quantization import quantize
from ptq.quantization.plan import Plan, calibration_key, resolve_plan
from ptq.quantization.quantize import Clips, resolve_matmul
from ptq.quantization.recipes import Recipe, TensorQuant


def input_clip(calibration: Calibration, name: str, spec: TensorQuant) -> torch.Tensor:
    """The calibrated clip of one activation under the spec's observer (per head: each head's
    amax)."""
    if isinstance(spec.granularity, gr.PerHead):
        if name not in calibration.input_channel_amax:
            raise PtqError(
                f"calibration file has no per-head amax for '{name}' (per-head KV-cache scales "
                "need one: recalibrate with this recipe)"
            )
        return calibration.input_channel_amax[name]
    amax_ = calibration.input_amax[name]
    if spec.observer == "max":
        return amax_
    hist = calibration.input_hist.get(name)
    if hist is None:
        raise PtqError(
            f"calibration file has no histogram for '{name}' (observer '{spec.observer}' needs "
            "one; recalibrate)"
        )
    _, clip = choose_clip(spec.observer, hist, float(amax_), spec.format, spec.percentile)
    return torch.tensor(clip, dtype=torch.float32)


def static_clips(calibration: Calibration | None, model: nn.Module, plan: Plan) -> Clips | None:
    """The clips `plan` needs of `calibration` for `model`, once the calibration is checked against
    the model; None without a calibration, or for a plan without static inputs or SmoothQuant."""
    needed = plan.calibrated
    smoothed = set(plan.smoothed)
    if calibration is None or not (needed or smoothed):
        return None  # quantize_ refuses a plan that needs a calibration it was not given
    calibration.check_model(model, needed)
    missing = sorted(smoothed - set(calibration.input_channel_amax))
    if missing:
        raise PtqError(
            f"calibration file has no per-channel input amax for '{missing[0]}' "
            f"(SmoothQuant needs one: calibrate with --recipe {plan.recipe.name})"
        )
    matmuls = {
        name: input_clip(calibration, name, e.inputs)
        for name, e in plan.matmuls.items()
        if e.quantized and e.inputs.static and name not in smoothed
    }
    attention = {
        layer: {
            t: input_clip(calibration, calibration_key(layer, t), spec)
            for t, spec in tensors.items()
            if spec.static
        }
        for layer, tensors in plan.attention.items()
    }
    residual = {
        block: {
            t: input_clip(calibration, f"{block}.residual.{t}", spec)
            for t, spec in tensors.items()
            if spec.static
        }
        for block, tensors in plan.residual.items()
    }
    channel_amax = {name: calibration.input_channel_amax[name] for name in smoothed}
    return Clips(matmuls, attention, residual, channel_amax)


def quantize_(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration | None,
    weight_cache: dict | None = None,
    matmul: str = "simulated",
    target: str = "transformers",
    plan: Plan | None = None,
) -> nn.Module:
    """ptq.quantization.quantize.quantize_ with the clips of `calibration` (static_clips); the same
    arguments otherwise."""
    matmul = resolve_matmul(matmul, next(model.parameters()).device)
    plan = plan or resolve_plan(model, recipe, target)
    clips = static_clips(calibration, model, plan)
    return quantize.quantize_(model, recipe, clips, weight_cache, matmul, target, plan)


def quantize_variants(
    model: nn.Module,
    recipes: list[Recipe],
    calibration: Calibration | None,
    matmul: str = "simulated",
    target: str = "transformers",
    plans: dict[str, Plan] | None = None,
) -> dict[str, nn.Module]:
    """ptq.quantization.quantize.quantize_variants with the clips of `calibration` for each recipe
    (static_clips); the same arguments otherwise."""
    if recipes:
        matmul = resolve_matmul(matmul, next(model.parameters()).device)
    plans = dict(plans or {})
    clips = {}
    for r in recipes:
        plans[r.name] = plans.get(r.name) or resolve_plan(model, r, target)
        clips[r.name] = static_clips(calibration, model, plans[r.name])
    return quantize.quantize_variants(model, recipes, clips, matmul, target, plans)
