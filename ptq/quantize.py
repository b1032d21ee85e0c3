"""Simulated quantization: `quantize_(model, recipe, calibration)` swaps every Linear for a QuantLinear.

A QuantLinear holds its weight already quantized and dequantized (done once, not per forward), rounds
its input to the recipe's format with the static per-tensor scale from calibration on every forward,
and multiplies in float32. A product of two 8- or 16-bit values is exact in float32, so this simulates
fp32-accumulating FP8/int8/bf16 hardware faithfully up to summation order.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ptq.calibrate import Calibration
from ptq.errors import PtqError
from ptq.formats import NumberFormat, amax, compute_scale, dequantize, fake_quantize, quantize
from ptq.recipes import BASELINE_LINEAR, Recipe, TensorQuant


class InputQuantizer:
    """Quantizes Linear inputs for every QuantLinear of one model.

    The arithmetic rounding is a chain of elementwise ops; torch.compile fuses it into one loop
    (bit-identical: every op is exact; tests check it), unless PTQ_COMPILE=0 or compilation fails.
    An input shared by several Linears (q/k/v, gate/up) with the same scale is quantized once:
    the last input is held (so its memory cannot be reused) and matched by identity and version.
    """

    def __init__(self, compile: bool | None = None):
        self.compile = os.environ.get("PTQ_COMPILE", "1") != "0" if compile is None else compile
        self._kernel = torch.compile(fake_quantize, dynamic=True) if self.compile else fake_quantize
        self._last: tuple | None = None

    def __call__(self, x: torch.Tensor, scale: torch.Tensor, fmt: NumberFormat, saturate: bool) -> torch.Tensor:
        # Inference tensors keep no version counter; between the Linears that share an input no
        # module writes to it in place (they would corrupt the unquantized model's math too).
        version = None if x.is_inference() else x._version
        last = self._last
        if last is not None and last[0] is x and last[1] == version and last[2] is scale and last[3] == (fmt, saturate):
            return last[4]
        try:
            x_q = self._kernel(x, scale, fmt, saturate)
        except Exception as e:  # no C++ compiler, unsupported device, ...: the eager ops give the same bits
            if self._kernel is fake_quantize:
                raise
            warnings.warn(f"torch.compile failed ({type(e).__name__}); quantizing with eager ops", stacklevel=2)
            self._kernel = fake_quantize
            x_q = fake_quantize(x, scale, fmt, saturate)
        self._last = (x, version, scale, (fmt, saturate), x_q)
        return x_q


class QuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weights: TensorQuant, inputs: TensorQuant, input_amax: torch.Tensor | None,
                 input_quantizer: InputQuantizer | None = None):
        super().__init__()
        self.input_quantizer = input_quantizer or InputQuantizer(compile=False)
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
        x_q = self.input_quantizer(x, self.input_scale, self.inputs.format, self.inputs.saturate)
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
    input_quantizer = InputQuantizer()
    scales: dict[tuple, torch.Tensor] = {}  # Linears that share an input (same amax) share one scale tensor
    for name, (weights, inputs) in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        input_amax = calibration.input_amax[name] if inputs.format.scaled else None
        q = QuantLinear(getattr(parent, child), weights, inputs, input_amax, input_quantizer)
        key = (inputs, float(q.input_scale), q.input_scale.device)
        q.input_scale = scales.setdefault(key, q.input_scale)
        setattr(parent, child, q)
    return model
