"""Simulated quantization: `quantize_(model, recipe, calibration)` swaps every Linear for a QuantLinear.

A QuantLinear holds its weight already quantized and dequantized (done once, not per forward), rounds
its input to the recipe's format with the static per-tensor scale from calibration on every forward,
and multiplies in float32. A product of two 8- or 16-bit values is exact in float32, so this simulates
fp32-accumulating FP8/int8/bf16 hardware faithfully up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptq.calibrate import Calibration
from ptq.errors import PtqError
from ptq.formats import amax, compute_scale, dequantize, fake_quantize, quantize
from ptq.recipes import BASELINE_LINEAR, Recipe, TensorQuant


class QuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weights: TensorQuant, inputs: TensorQuant, input_amax: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weights, self.inputs = weights, inputs
        w = linear.weight.detach().float()
        codes, weight_scale = quantize_weight(w, weights)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight", dequantize(codes, weight_scale))
        del codes
        self.bias = linear.bias
        if inputs.format.scaled and input_amax is None:
            raise ValueError("a scaled input format needs a calibrated input amax")
        scale = compute_scale(input_amax.to(w.device), inputs.format) if inputs.format.scaled else torch.ones((), device=w.device)
        self.register_buffer("input_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q = fake_quantize(x, self.input_scale, self.inputs.format, self.inputs.saturate)
        return F.linear(x_q.to(x.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, weights={self.weights.describe()}, inputs={self.inputs.describe()}"


def quantize_weight(w: torch.Tensor, weights: TensorQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight's codes (float32 values on the format's grid) and its scale ([] or [out, 1]).
    The one code path for weights: the simulation dequantizes these codes, `ptq quantize` stores them."""
    w = w.detach().float()
    weight_amax = amax(w, dim=1) if weights.granularity == "channel" else amax(w)
    scale = compute_scale(weight_amax, weights.format)
    return quantize(w, scale, weights.format, weights.saturate), scale


def plan(model: nn.Module, recipe: Recipe) -> dict[str, tuple[TensorQuant, TensorQuant]]:
    """What the recipe does to each Linear: its (weights, inputs) quantization. Layers the recipe leaves
    out run as in the 16-bit baseline."""
    return {
        name: (recipe.weights, recipe.inputs) if recipe.targets_module(name, m) else (BASELINE_LINEAR, BASELINE_LINEAR)
        for name, m in model.named_modules() if isinstance(m, nn.Linear)
    }


def calibrated_layers(model: nn.Module, recipe: Recipe) -> list[str]:
    """Layers whose static input scale must come from calibration."""
    return [name for name, (_, inputs) in plan(model, recipe).items() if inputs.format.scaled]


def quantize_(model: nn.Module, recipe: Recipe, calibration: Calibration | None) -> nn.Module:
    """Replace, in place, each Linear of `model` by the QuantLinear the recipe asks for."""
    layers = plan(model, recipe)
    needed = [name for name, (_, inputs) in layers.items() if inputs.format.scaled]
    if needed:
        if calibration is None:
            raise PtqError(f"recipe '{recipe.name}' needs calibration (static input scales)")
        calibration.check_model(model, needed)
    for name, (weights, inputs) in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        input_amax = calibration.input_amax[name] if inputs.format.scaled else None
        setattr(parent, child, QuantLinear(getattr(parent, child), weights, inputs, input_amax))
    return model
