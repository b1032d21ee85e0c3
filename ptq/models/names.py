"""Checkpoint naming: which state-dict tensors `save_pretrained` writes, and the names it gives them
on disk (transformers renames and re-fuses some tensors on save). Used by export and by
layer-by-layer execution, which reads a checkpoint's tensors by those names.
"""

from __future__ import annotations

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import LinearExperts


def saved_names(model: nn.Module) -> list[str]:
    """State-dict names that go into the checkpoint: tied copies dropped as save_pretrained does."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return list(remove_tied_weights_from_state_dict(model.state_dict(), model))


def checkpoint_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """State-dict name of the linearized model (ptq.models.matmuls) -> the name `save_pretrained`
    gives that tensor on disk. transformers merges per-expert 2-D checkpoint tensors into 3-D
    ones on load and splits them back on save (its weight conversions, e.g. Mixtral's
    experts.{e}.w1/w3 -> gate_up_proj), renaming some modules too. The same reversal is run on
    stand-ins: a one-element tensor holding each plain tensor's index, and for each experts
    module its fused 3-D tensors holding (projection, expert, row) codes, read back after the
    split. Experts a checkpoint keeps fused (3-D tensors on disk) cannot be written per expert:
    refused."""
    from transformers.core_model_loading import revert_weight_conversion

    experts = {path: m for path, m in model.named_modules() if isinstance(m, LinearExperts)}
    in_experts = lambda n: any(n.startswith(p + ".") for p in experts)  # noqa: E731
    plain = [n for n in names if not in_experts(n)]
    stand_ins = {n: torch.tensor([float(i)], dtype=torch.float64) for i, n in enumerate(plain)}
    projections: dict[str, list[str]] = {}
    check_experts_per_expert(model)
    for path, m in experts.items():
        groups = {
            ("gate_up_proj" if m.has_gate else "up_proj"): (
                ["gate_proj", "up_proj"] if m.has_gate else ["up_proj"]
            ),
            "down_proj": ["down_proj"],
        }
        for fused_name, parts in groups.items():
            rows = sum(getattr(m[0], p).out_features for p in parts)
            code = len(projections)
            projections[str(code)] = [path, *parts]
            e = torch.arange(len(m), dtype=torch.float64)[:, None, None]
            r = torch.arange(rows, dtype=torch.float64)[None, :, None]
            # two columns, not one: transformers 5.17's split squeezes a size-1 dimension away (a
            # 1-D tensor back)
            stand_ins[f"{path}.{fused_name}"] = ((code * 4096 + e) * 2.0**24 + r).expand(-1, -1, 2)
    try:
        reverted = revert_weight_conversion(model, stand_ins)
    except Exception as e:
        raise PtqError(
            f"cannot work out the checkpoint names of {type(model).__name__} ({type(e).__name__}: "
            f"{e})"
        ) from None
    mapping = {}
    for disk, t in reverted.items():
        if t.numel() == 1:
            mapping[plain[int(t.item())]] = disk
            continue
        if t.dim() != 2:
            raise PtqError(
                f"{type(model).__name__} stores its experts fused ('{disk}', {t.dim()}-D) in its "
                "checkpoint: ptq quantize writes per-expert 2-D weights only; `ptq compare` "
                "covers this model"
            )
        value = int(t[0, 0].item())
        code, e, row = value // 2**24 // 4096, value // 2**24 % 4096, value % 2**24
        path, *parts = projections[str(code)]
        rows = getattr(experts[path][e], parts[0]).out_features
        mapping[f"{path}.{e}.{parts[row // rows]}.weight"] = disk
    missing = [n for n in names if n not in mapping]
    if missing:
        raise PtqError(
            f"cannot work out the checkpoint name of '{missing[0]}' in {type(model).__name__}"
        )
    # the stand-ins cover every projection of every experts module; only the names asked for are
    # answered (a recipe may quantize some of an expert's projections and not others)
    return {n: mapping[n] for n in names}


def check_experts_per_expert(model: nn.Module) -> None:
    """Experts whose checkpoints keep them fused (3-D, with biases: GPT-OSS) cannot be written per
    expert: refused."""
    for path, m in model.named_modules():
        if isinstance(m, LinearExperts) and m[0].down_proj.bias is not None:
            raise PtqError(
                f"the experts of {m.fused_type} ('{path}') have biases and are stored fused (3-D) "
                "in their checkpoints: ptq quantize writes per-expert 2-D weights only; `ptq "
                "compare` covers this model"
            )
