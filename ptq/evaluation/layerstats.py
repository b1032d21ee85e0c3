"""Per-layer statistics for reports: where each variant loses precision.

SNR (signal-to-quantization-noise ratio) of a tensor x and its quantized-and-dequantized x_q, in dB:
    10 * log10(sum(x^2) / sum((x - x_q)^2))
- weights: every weight of every quantized Linear (times SmoothQuant's s where smoothed), against
  the weight the variant actually uses;
- inputs: each variant's own input to each Linear over the first few evaluation windows, against its
  rounding in that layer (static scale, or per token). The noise is that layer's own rounding and
  saturation only; measured while the evaluation runs, so it costs no extra forward pass. A
  mixture-of-experts expert sees only the tokens routed to it: its input is measured over the first
  windows' worth of tokens it is given (4 x the window length), wherever in the text they come from.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ptq.calibration.observers import snr_db
from ptq.execution.placement import onloaded
from ptq.quantization.quantize import QuantLinear, fused

INPUT_SNR_WINDOWS = 4  # windows of the evaluation text that input SNR is measured on


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """QuantLinear layers whose weights or inputs an 8-bit (scaled) format quantizes."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear) and (m.weights.format.scaled or m.inputs.format.scaled)
    }


def weight_snr_db(original: nn.Module, quantized: nn.Module) -> dict[str, float | None]:
    """SNR of each quantized layer's weight: `original` is the float model `quantized` was made
    from. A SmoothQuant layer rounds W * s (columns scaled): its noise is measured against that."""
    modules = dict(original.named_modules())
    return {
        name: snr_db(
            *_fused_powers(
                _rounded_weight_source(modules[name].weight.detach(), q), q.weight
            ).tolist()
        )
        for name, q in quantized_layers(quantized).items()
    }


def _rounded_weight_source(weight: torch.Tensor, q: QuantLinear) -> torch.Tensor:
    return weight if q.smooth is None else weight.float() * q.smooth


def _powers(x: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """[sum x^2, sum (x - x_q)^2] in float64: signal and noise power of one rounding."""
    x, x_q = x.double(), x_q.double()
    return torch.stack((x.square().sum(), (x - x_q).square().sum()))


_fused_powers = fused(_powers)  # one pass, no temporaries


@contextlib.contextmanager
def input_snr_db(
    quantized: dict[str, nn.Module], window_tokens: int, windows: int = INPUT_SNR_WINDOWS
):
    """While the variants run (the evaluation), measure the SNR of each scaled-input layer's input
    over the first `windows` windows it sees (windows of `window_tokens` tokens; an expert's input,
    a row per token routed to it, over the first windows x window_tokens rows). Yields {variant:
    {layer: dB}}, filled in when the block ends; a layer given no input is not in it. A layer's hook
    removes itself once it has measured its share, so the rest of the evaluation runs without."""
    budget = windows * window_tokens  # tokens per layer
    sums: dict[str, dict[str, list]] = {}
    hooks = []

    def hook_for(sums_of_layer: list, last: dict, handle: list):
        def hook(module: QuantLinear, args: tuple) -> None:
            x = args[0]
            room = budget - sums_of_layer[1]
            # tokens in one window [S, in], or 1 for an expert's row [in]
            per_row = x[:1].numel() // x.shape[-1]
            if len(x) * per_row > room:
                x = x[: room // per_row]
            if len(x):
                # offloaded by --device-map: its scale is on the device during its forward only
                with onloaded(module):
                    # the call the forward makes next (an input is rounded once)
                    x_in, x_q = module.quantize_input(x)
                    # q/k/v (gate/up) share one input and its rounding: sum it once
                    if last.get("x_q") is not x_q:
                        last["x_q"] = x_q  # held, so that its identity cannot be reused meanwhile
                        # left on the device: no sync per layer
                        last["sums"] = _fused_powers(x_in.detach(), x_q)
                sums_of_layer[0] = (
                    last["sums"] if sums_of_layer[0] is None else sums_of_layer[0] + last["sums"]
                )
                sums_of_layer[1] += len(x) * per_row
            if sums_of_layer[1] >= budget:
                handle[0].remove()

        return hook

    for variant, model in quantized.items():
        sums[variant], last = {}, {}
        for name, q in quantized_layers(model).items():
            if q.inputs.format.scaled:
                sums[variant][name] = [None, 0]  # [signal, noise] powers (a tensor), tokens seen
                handle: list = []
                handle.append(
                    q.register_forward_pre_hook(hook_for(sums[variant][name], last, handle))
                )
                hooks.append(handle[0])
    result: dict[str, dict[str, float | None]] = {}
    try:
        yield result
    finally:
        for h in hooks:
            h.remove()
    # a layer given no input (an expert no token was routed to) was not measured: left out, not null
    # (exact)
    result.update(
        {
            v: {
                n: snr_db(*powers.tolist())
                for n, (powers, _) in layers.items()
                if powers is not None
            }
            for v, layers in sums.items()
        }
    )


def layer_snr(
    weights: dict[str, dict], inputs: dict[str, dict], windows: int = INPUT_SNR_WINDOWS
) -> dict[str, dict | None]:
    """{variant: {"weights": {layer: dB}, "inputs": {layer: dB}, "input_windows": n}} for the
    report, from weight_snr_db and input_snr_db per variant; None for a variant that quantizes
    nothing to 8 bits (no layer in its weight SNR)."""
    return {
        v: {"weights": w, "inputs": inputs.get(v, {}), "input_windows": windows} if w else None
        for v, w in weights.items()
    }
