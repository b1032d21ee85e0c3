"""ptq inspect: model + recipes -> what each recipe does to each Linear layer.

Only the model's structure is read (no weights): the plans are the ones compare and quantize
resolve, as the target engine serves them.
"""

from __future__ import annotations

import torch

from ptq.commands.common import check_coverage
from ptq.errors import PtqError
from ptq.models.loading import linear_layers, load_structure
from ptq.models.matmuls import kind
from ptq.quantization import engines
from ptq.quantization.plan import Plan, resolve_plans
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.coverage import describe_coverage


def run_inspect(
    model: str | None, recipes: list[str], trust_remote_code: bool = False, target: str = "vllm"
) -> dict:
    """Every Linear layer of the model with its shape, and what each recipe does to its weights and
    inputs, as `target` serves them (the plans compare and quantize resolve: vLLM's int8 range, its
    shared scales)."""
    loaded_recipes = [load_recipe(r) for r in recipes]
    if not loaded_recipes:
        raise PtqError("no recipe given: --recipe names the recipe(s) to show, comma-separated")
    target = engines.check_target(target)
    # shapes only: no weights read, nor downloaded
    loaded = load_structure(model, trust_remote_code)
    layers = linear_layers(loaded.model)
    plans = resolve_plans(loaded.model, loaded_recipes, target)
    rows = [_layer_row(name, m, loaded_recipes, plans) for name, m in layers.items()]
    total = sum(row["parameters"] for row in rows)
    coverages = check_coverage(plans, refuse_empty=False)
    summary = {
        r.name: {
            "layers": sum(row["recipes"][r.name]["quantized"] for row in rows),
            "parameters": sum(
                row["parameters"] for row in rows if row["recipes"][r.name]["quantized"]
            ),
            "description": r.description,
            "coverage": coverages[r.name],
            "coverage_line": describe_coverage(coverages[r.name]),
        }
        for r in loaded_recipes
    }
    return {
        "model": {"name": loaded.name, "source": loaded.source},
        "target": target,
        "linear_layers": len(rows),
        "linear_parameters": total,
        "recipes": summary,
        "layers": rows,
    }


def _layer_row(
    name: str, m: torch.nn.Module, recipes: list[Recipe], plans: dict[str, Plan]
) -> dict:
    """One Linear layer: its kind, shape and size, and each recipe's plan for it."""
    row = {
        "layer": name,
        "kind": kind(m),
        "shape": [m.out_features, m.in_features],
        "parameters": m.weight.numel(),
        "recipes": {},
    }
    for r in recipes:
        entry = plans[r.name].matmuls[name]
        row["recipes"][r.name] = {
            "quantized": entry.quantized,
            "weights": entry.weights.describe(),
            "inputs": entry.inputs.describe(),
            "calibrated": entry.quantized and entry.inputs.static,
            "reason": entry.reason,
            "shares_scale_with": sorted({*entry.weight_group, *entry.input_group} - {name}) or None,
        }
        if r.overrides:  # which of the recipe's schemes (its own, an override's, bf16)
            row["recipes"][r.name]["scheme"] = plans[r.name].scheme_name(entry)
    return row
