"""Calibration: run text through the model and record the amax (max |x|) of every tensor that a recipe
quantizes: each targeted Linear's weight and its input, and attention's batched-matmul inputs
("<attention layer>.query|key|value|probs"). Observers stream (a running max, a fixed-bin histogram of
|x| for the percentile/MSE/entropy observers and the diagnostics, per-channel maxima for SmoothQuant;
ptq/observers.py), they never keep activations. The result is saved as safetensors (the amax tensors)
plus JSON metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.errors import PtqError
from ptq.files import atomic_path, check_writable
from ptq.formats import amax
from ptq.observers import NUM_BINS, TensorObserver
from ptq.progress import progress

FILE_KIND = "ptq-calibration/1"


@dataclass
class Calibration:
    input_amax: dict[str, torch.Tensor]  # layer name -> scalar float32
    weight_amax: dict[str, torch.Tensor]  # layer name -> scalar float32; also identifies the model
    metadata: dict = field(default_factory=dict)
    input_hist: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> int64 [NUM_BINS] counts of |x|
    input_channel_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float32 [in_features]

    def check_model(self, model: nn.Module, layers: list[str]) -> None:
        """Refuse a calibration made for another model: same layers, same weights (by their amax)."""
        modules = dict(model.named_modules())
        for name in layers:
            if name not in self.input_amax:
                raise PtqError(f"calibration file has no amax for layer '{name}' "
                               f"(made for model '{self.metadata.get('model', '?')}'; recalibrate for this model and recipe)")
            module = modules.get(name)
            if module is None and name not in self.weight_amax and name.split(".residual.")[0].rpartition(".")[0] in modules:
                continue  # an attention matmul input ("<layer>.query") or a residual-add input: no weight of its own
            if (not isinstance(module, nn.Linear) or name not in self.weight_amax
                    or not torch.equal(amax(module.weight).cpu(), self.weight_amax[name])):
                raise PtqError(f"calibration file was made for another model ('{self.metadata.get('model', '?')}'): "
                               f"the weights of layer '{name}' differ")


def calibrate(model: nn.Module, input_ids: torch.Tensor, layers: list[str], batch_size: int = 4,
              channels: list[str] = ()) -> Calibration:
    """Record input and weight amax of the named Linear layers (and attention matmul inputs, named
    "<attention layer>.<tensor>") over the calibration windows, with histograms of every input, and
    per-channel input amax of the Linear layers in `channels`."""
    from ptq import attention, residual

    modules = dict(model.named_modules())
    linears = [name for name in layers if isinstance(modules.get(name), nn.Linear)]
    observers = {name: TensorObserver(channels=name in set(channels)) for name in layers}
    hooks = [modules[name].register_forward_pre_hook(observers[name]) for name in linears]
    attention_layers, residual_blocks = {}, {}
    for name in layers:
        if name not in linears:
            layer, _, tensor = name.rpartition(".")
            if layer.endswith(".residual"):  # "<block>.residual.<tensor>": ptq/residual.py
                residual_blocks.setdefault(layer.removesuffix(".residual"), {})[tensor] = observers[name].observe
            else:
                attention_layers.setdefault(layer, {})[tensor] = observers[name].observe
    previous = model.config._attn_implementation
    attention.install(model, {k: attention.AttentionQuant(v) for k, v in attention_layers.items()})
    hooks += residual.install(model, residual_blocks)
    # Layers outside the base model (lm_head) are not quantized by default: skip computing them.
    base = getattr(model, "base_model", model)
    base_names = {f"{model.base_model_prefix}.{n}" if n else model.base_model_prefix for n, _ in base.named_modules()}
    runner = base if base is not model and set(layers) <= base_names else model
    device = next(model.parameters()).device
    try:
        with torch.inference_mode(), progress("calibrating", len(input_ids), input_ids.shape[1]) as advance:
            for batch in input_ids.split(batch_size):
                runner(input_ids=batch.to(device))
                advance(len(batch))
    finally:
        for h in hooks:
            h.remove()
        attention.uninstall(model, previous)
    input_amax = {name: obs.amax.float().cpu() for name, obs in observers.items()}
    weight_amax = {name: amax(modules[name].weight).cpu() for name in linears}
    for kind, values in (("input", input_amax), ("weight", weight_amax)):
        bad = [name for name, a in values.items() if not torch.isfinite(a)]
        if bad:
            raise PtqError(f"non-finite {kind} values (NaN or inf) in layer '{bad[0]}' during calibration"
                           + (f" and {len(bad) - 1} more layers" if len(bad) > 1 else ""))
    return Calibration(input_amax, weight_amax,
                       input_hist={name: obs.hist for name, obs in observers.items()},
                       input_channel_amax={name: obs.channel_amax.cpu() for name, obs in observers.items() if obs.channels})


def save_calibration(calibration: Calibration, path: Path, force: bool = False) -> None:
    check_writable(path, force)
    tensors = {f"input_amax/{k}": v.contiguous() for k, v in calibration.input_amax.items()}
    tensors |= {f"weight_amax/{k}": v.contiguous() for k, v in calibration.weight_amax.items()}
    tensors |= {f"input_hist/{k}": v.contiguous() for k, v in calibration.input_hist.items()}
    tensors |= {f"input_channel_amax/{k}": v.float().contiguous() for k, v in calibration.input_channel_amax.items()}
    header = {"kind": FILE_KIND, "metadata": json.dumps(calibration.metadata, sort_keys=True)}
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata=header)


def load_calibration(path: Path) -> Calibration:
    path = Path(path)
    if not path.is_file():
        raise PtqError(f"calibration file {path} does not exist")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise PtqError(f"{path} is not a readable calibration file: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if header.get("kind") != FILE_KIND:
        raise PtqError(f"{path} is not a ptq calibration file (kind {header.get('kind')!r}, expected {FILE_KIND!r})")
    try:
        metadata = json.loads(header.get("metadata", "{}"))
    except json.JSONDecodeError:
        raise PtqError(f"{path}: calibration metadata is not valid JSON") from None
    calibration = Calibration({}, {}, metadata)
    for key, tensor in tensors.items():
        kind, _, name = key.partition("/")
        if kind in ("input_hist", "input_channel_amax"):
            _load_statistics(calibration, path, key, tensor)
            continue
        target = {"input_amax": calibration.input_amax, "weight_amax": calibration.weight_amax}.get(kind)
        if target is None or tensor.dtype != torch.float32 or tensor.numel() != 1 or not torch.isfinite(tensor).all() or tensor.item() < 0:
            raise PtqError(f"{path}: invalid entry '{key}' (expected a finite, non-negative float32 amax)")
        target[name] = tensor.reshape(())
    if not set(calibration.weight_amax) <= set(calibration.input_amax):
        raise PtqError(f"{path}: input and weight amax name different layers")
    if not set(calibration.input_hist) | set(calibration.input_channel_amax) <= set(calibration.input_amax):
        raise PtqError(f"{path}: histograms or per-channel amax name tensors without an input amax")
    return calibration


def _load_statistics(calibration: Calibration, path: Path, key: str, tensor: torch.Tensor) -> None:
    """Histograms (int64 counts, NUM_BINS) and per-channel amax (finite, non-negative float32 vectors)."""
    kind, _, name = key.partition("/")
    if kind == "input_hist":
        if tensor.dtype != torch.int64 or tensor.shape != (NUM_BINS,) or bool((tensor < 0).any()):
            raise PtqError(f"{path}: invalid entry '{key}' (expected {NUM_BINS} non-negative int64 counts)")
        calibration.input_hist[name] = tensor
    else:
        if tensor.dtype != torch.float32 or tensor.dim() != 1 or not torch.isfinite(tensor).all() or bool((tensor < 0).any()):
            raise PtqError(f"{path}: invalid entry '{key}' (expected a finite, non-negative float32 vector)")
        calibration.input_channel_amax[name] = tensor


def summary_rows(calibration: Calibration, top: int = 10) -> dict:
    """The tensors with the largest input amax, and the spread across layers, for reports."""
    # Linear layers only (they have weights); attention matmul inputs are in the per-tensor diagnostics.
    items = sorted(((k, float(v)) for k, v in calibration.input_amax.items() if k in calibration.weight_amax),
                   key=lambda kv: -kv[1])
    values = torch.tensor([v for _, v in items]) if items else torch.zeros(1)
    weights = calibration.weight_amax
    return {
        "layers": len(items),
        "input_amax_min": float(values.min()),
        "input_amax_median": float(values.median()),
        "input_amax_max": float(values.max()),
        "largest": [{"layer": k, "input_amax": v, "weight_amax": float(weights[k])} for k, v in items[:top]],
    }
