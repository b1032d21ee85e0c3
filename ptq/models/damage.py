"""Damaged parameters: NaN or inf in a tensor of the model itself (not in an activation).

A matmul's weight is checked where it is read for quantization or calibration (its amax:
ptq.calibration.calibrate.check_weight, ptq.quantization.quantize.quantize_weight). Every other
parameter (embeddings, norms, biases, routers, ...) is checked here, once the model (in memory) or
each part of it (layer by layer from disk) is read, before any forward pass: otherwise an inf norm
weight is first seen as a non-finite input of the next layer, and blamed on the activations. Always
an error: `--on-nonfinite skip` is about activations, never about the model's own tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import quantizable


def nonfinite(tensor: torch.Tensor) -> tuple[str, list[int]] | None:
    """("NaN" or "inf", the index of the first such element) of a floating-point tensor that holds
    one; None for a finite one (or one that is not floating-point)."""
    t = tensor.detach()
    if not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
        return None
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    bad = (~finite).nonzero()
    return ("NaN" if bool(torch.isnan(t).any()) else "inf"), bad[0].tolist()


def check_parameter(name: str, tensor: torch.Tensor) -> None:
    """Refuse a parameter (by its name in the model) that holds NaN or inf, naming the first bad
    element."""
    found = nonfinite(tensor)
    if found is not None:
        what, index = found
        raise PtqError(
            f"parameter '{name}' contains {what} (first at index {index}): the model's weights are "
            "damaged; --on-nonfinite skip applies to activations only"
        )


def check_parameters(model: nn.Module) -> None:
    """Every parameter of `model` (or of a part of it, named as in the model) that is not only a
    matmul's weight, checked for NaN/inf (check_parameter): a tied embedding, the lm_head's weight
    too, is an embedding's; those on the meta device (not read) are skipped."""
    others = {
        id(p)
        for m in model.modules()
        for key, p in m._parameters.items()
        if p is not None and not (key == "weight" and quantizable(m))
    }
    for name, p in model.named_parameters():
        if id(p) in others and p.device.type != "meta":
            check_parameter(name, p)
