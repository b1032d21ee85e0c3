"""Per-layer statistics for reports: where each variant loses precision.

SNR (signal-to-quantization-noise ratio) of a tensor x and its quantized-and-dequantized x_q, in dB:
    10 * log10(sum(x^2) / sum((x - x_q)^2))
- weights: every weight of every quantized Linear, against the weight the variant actually uses;
- inputs: the unquantized model's inputs to each Linear on a few evaluation windows, quantized with the
  variant's calibrated static scale, so each layer's own rounding and saturation is measured without the
  error of the layers before it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptq.formats import fake_quantize
from ptq.quantize import QuantLinear

INPUT_SNR_WINDOWS = 4  # windows of the evaluation text that input SNR is measured on


def snr_db(signal_power: float, noise_power: float) -> float | None:
    """None where there is no noise (infinite SNR, which JSON cannot hold) or no signal."""
    if noise_power <= 0 or signal_power <= 0:  # exact, or an all-zero tensor: no ratio to report
        return None
    return 10.0 * math.log10(signal_power / noise_power)


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """QuantLinear layers whose weights or inputs an 8-bit (scaled) format quantizes."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and (m.weights.format.scaled or m.inputs.format.scaled)}


def weight_snr_db(original: nn.Module, quantized: nn.Module) -> dict[str, float | None]:
    """SNR of each quantized layer's weight: `original` is the float model `quantized` was made from."""
    modules = dict(original.named_modules())
    out = {}
    for name, q in quantized_layers(quantized).items():
        w = modules[name].weight.detach().double()
        out[name] = snr_db(w.square().sum().item(), (w - q.weight.double()).square().sum().item())
    return out


def input_snr_db(original: nn.Module, quantized: dict[str, nn.Module], input_ids: torch.Tensor,
                 batch_size: int = 4) -> dict[str, dict[str, float | None]]:
    """SNR of each scaled-input layer's input, per variant: {variant: {layer: dB}}."""
    targets = {v: {n: q for n, q in quantized_layers(m).items() if q.inputs.format.scaled} for v, m in quantized.items()}
    sums = {v: {n: [0.0, 0.0] for n in layers} for v, layers in targets.items()}
    modules = dict(original.named_modules())

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float()
            signal = x.double().square().sum().item()
            for v, layers in targets.items():
                if name in layers:
                    q = layers[name]
                    x_q = fake_quantize(x, q.input_scale, q.inputs.format, q.inputs.saturate)
                    sums[v][name][0] += signal
                    sums[v][name][1] += (x - x_q).double().square().sum().item()
        return hook

    names = sorted({n for layers in targets.values() for n in layers})
    hooks = [modules[n].register_forward_pre_hook(hook_for(n)) for n in names]
    device = next(original.parameters()).device
    try:
        with torch.inference_mode():
            for batch in input_ids.split(batch_size):
                original(input_ids=batch.to(device))
    finally:
        for h in hooks:
            h.remove()
    return {v: {n: snr_db(s, e) for n, (s, e) in layers.items()} for v, layers in sums.items()}


def layer_snr(original: nn.Module, quantized: dict[str, nn.Module], input_ids: torch.Tensor) -> dict[str, dict]:
    """{variant: {"weights": {layer: dB}, "inputs": {layer: dB}, "input_windows": n}} in model order;
    None for a variant that quantizes nothing to 8 bits."""
    windows = input_ids[:INPUT_SNR_WINDOWS]
    inputs = input_snr_db(original, quantized, windows)
    return {v: {"weights": weight_snr_db(original, m), "inputs": inputs[v], "input_windows": len(windows)}
            if quantized_layers(m) else None for v, m in quantized.items()}
