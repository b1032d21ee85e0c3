"""ptq search: model + one recipe + a budget -> the fewest units kept in 16-bit that meet the budget
on search windows, verified on held-out windows -> DIR/searched.yaml, search.json, search.md,
search.png.

The model is loaded, its windows cut and the recipe calibrated as compare does (prepare); the
evaluation windows alternate between the search (even) and the held-out (odd) windows; the search
itself is ptq.search.search's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import torch

from ptq.commands.common import (
    now,
    refuse_resume,
    refuse_torchrun,
    refuse_unused_calibration,
    versions,
)
from ptq.commands.measure import BASELINE_RECIPE, checked_compute_path, prepare, read_texts
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
)
from ptq.errors import PtqError
from ptq.evaluation.data import spec_source
from ptq.files import atomic_dir, check_outputs, read_yaml, text_writer, writes_outputs
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.results import to_json
from ptq.reporting.search import curve_writer, search_markdown, searched_yaml
from ptq.search import search as s

SEED = 0
FILES = ("searched.yaml", "search.json", "search.md", "search.png")


def parse_budget(max_kl: str | None, max_ppl_increase: str | None) -> dict:
    """--max-kl NATS or --max-ppl-increase PCT, exactly one."""
    from ptq.reporting.gates import parse_limits

    if (max_kl is None) == (max_ppl_increase is None):
        raise PtqError("give one budget: --max-kl NATS or --max-ppl-increase PCT")
    limits = parse_limits(max_ppl_increase=max_ppl_increase, max_kl=max_kl)
    if max_kl is not None:
        return {"metric": "kl", "flag": "--max-kl", "given": max_kl, "value": limits.max_kl}
    return {
        "metric": "ppl",
        "flag": "--max-ppl-increase",
        "given": max_ppl_increase,
        "value": limits.max_ppl_increase_pct,
    }


@writes_outputs
def run_search(
    recipes: list[str],
    budget: dict,
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> dict:
    """The search's record (search.json), its files written to output.path."""
    _refuse(recipes, model, compute, calibration)
    recipe, source = _searched_recipe(recipes[0])
    out = _check_output(output, model, data, calibration, recipe)
    compute_info = checked_compute_path(model, compute, data, False)
    needed = [recipe] if recipe.needs_calibration else []
    refuse_unused_calibration(
        calibration, bool(needed), f"recipe {recipe.name} needs no calibration", "--calib-data"
    )
    texts = read_texts(calibration, data, needed)
    baseline = load_recipe(BASELINE_RECIPE)
    dtype = getattr(torch, compute_info["dtype"])
    prepared = prepare(
        model, data, calibration, compute, [baseline, recipe], needed, texts,
        streamed=False, dtype=dtype, copies=2.5,
    )  # fmt: skip
    ids = _windows(prepared.windows.input_ids)
    plan = prepared.plans[recipe.name]
    units = s.units_of(prepared.loaded.model, plan)
    if not units:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes no matmul of this model: nothing to search"
        )
    calibrated = prepared.calibration if needed else None
    scorer = s.Scorer(
        prepared.loaded.model, baseline, recipe, units, calibrated, compute_info["matmul"],
        compute.target, compute.batch_size,
    )  # fmt: skip
    began = time.perf_counter()
    found = _search(scorer, recipe, plan, units, ids, budget, calibrated)
    record = _record(prepared, recipe, compute.target, budget, ids, units, found)
    record["cost"] |= {"seconds": time.perf_counter() - began}
    _write(out, record, source)
    return record


def _searched_recipe(name: str) -> tuple[Recipe, dict]:
    """The recipe searched, and its YAML (searched.yaml is written from it): matmuls only."""
    recipe = load_recipe(name)
    if recipe.beyond_linear:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes {', '.join(recipe.beyond_linear)}: ptq search keeps "
            "matmul units in 16-bit and does not search these yet; give a recipe of matmuls only"
        )
    return recipe, read_yaml(Path(recipe.source), "recipe")


def _check_output(
    output: OutputOptions,
    model: ModelOptions,
    data: DataOptions,
    calibration: CalibrationOptions,
    recipe: Recipe,
) -> Path:
    """The output folder, written whole (ptq.files.check_outputs, before any work): none of the
    run's inputs nor within one, replaced only with --force, claimed for this run."""
    out = Path(output.path)
    inputs = {
        "the model": model.model,
        "the evaluation text": spec_source(data.data),
        "the calibration text": spec_source(calibration.data),
        "the calibration file": calibration.file,
        "the recipe": recipe.source,
    }
    check_outputs([out], inputs, output.force, folder=True)
    return out


def _windows(ids: torch.Tensor) -> torch.Tensor:
    if len(ids) < 2:
        raise PtqError(
            f"{len(ids)} evaluation window(s): the search needs at least 2 (search and held-out); "
            "give more text or a larger --max-windows"
        )
    return ids


class _Found(NamedTuple):
    """What the search found: each unit's sensitivity, the ranking, the number kept in 16-bit,
    the curve, the held-out verdict and its baselines, and what the sensitivity cost."""

    sensitivity: dict[str, float]
    order: list[s.Unit]
    kept: int
    curve: list[dict]
    amax: dict[str, float] | None
    verdict: dict
    baselines: list[dict]
    fraction: float
    forwards: int
    sensitivity_seconds: float


def _search(scorer, recipe, plan, units, ids, budget, calibrated) -> _Found:
    """Sensitivity, ranking and selection on the search windows (the even ones), then the verdict
    and the baselines on the held-out windows (the odd ones)."""
    search_ids, held_ids = ids[0::2], ids[1::2]
    total = sum(m.params for m in plan.matmuls.values())
    quantized = sum(u.params for u in units)

    def fraction(kept: list[s.Unit]) -> float:
        return (quantized - sum(u.params for u in kept)) / total

    sensitivity = s.sensitivity(scorer, units, search_ids)
    sensitivity_seconds = scorer.seconds
    order = s.ranked(units, sensitivity)
    metric, value = budget["metric"], budget["value"]
    kept, curve = s.select(scorer, order, search_ids, metric, value, fraction)
    amax = s.unit_amax(units, calibrated)
    verdict, baselines = s.held_out(scorer, units, order, kept, amax, held_ids, metric, value, SEED)
    if amax is None or len(amax) < len(units):
        baselines.append({"name": "amax", "skipped": "no calibrated input amax for every unit"})
    return _Found(
        sensitivity, order, kept, curve, amax, verdict, baselines, fraction(order[:kept]),
        scorer.forwards, sensitivity_seconds,
    )  # fmt: skip


def _record(prepared, recipe, target, budget, ids, units, found: _Found) -> dict:
    """search.json: what was searched, how, and what was found."""
    search, held = len(ids[0::2]), len(ids[1::2])
    return {
        "model": prepared.loaded.name,
        "recipe": recipe.name,
        "target": target,
        "budget": budget | {"measure": s.METRICS[budget["metric"]]},
        "windows": {
            "total": len(ids),
            "search": search,
            "held_out": held,
            "seq_len": int(ids.shape[1]),
            "description": f"{len(ids)} evaluation windows of {ids.shape[1]} tokens: the even ones "
            f"({search}) search, the odd ones ({held}) are held out and only verify the result",
        },
        "units_description": (
            "what vLLM serves as one layer (q/k/v together, gate/up together, a layer's experts "
            "together), kept in 16-bit or quantized whole"
            if target == "vllm"
            else "each matmul (--target transformers fuses nothing)"
        ),
        "method": s.SENSITIVITY,
        "selection": (
            "keep the first k ranked units in 16-bit; the smallest k meeting the budget on the "
            "search windows, found by bisection over k with each candidate evaluated end to end"
        ),
        "units": [
            {
                "name": u.name,
                "members": list(u.members),
                "patterns": list(u.patterns),
                "params": u.params,
                "sensitivity": found.sensitivity[u.name],
                "rank": found.order.index(u),
                "input_amax": (found.amax or {}).get(u.name),
            }
            for u in units
        ],
        "curve": found.curve,
        "chosen": [u.name for u in found.order[: found.kept]],
        "fraction_quantized": found.fraction,
        "verdict": found.verdict,
        "baselines": found.baselines,
        "closest": s.closest(found.verdict, found.baselines),
        "seed": SEED,
        "cost": {
            "forwards": found.forwards,
            "evaluations": found.forwards / (2 * len(ids)),
            "sensitivity_seconds": found.sensitivity_seconds,
        },
        "calibration_source": prepared.calibration_source,
        "versions": versions(),
        "created": now(),
    }


def _refuse(
    recipes: list[str],
    model: ModelOptions,
    compute: ComputeOptions,
    calibration: CalibrationOptions,
) -> None:
    """What this first version does not do, refused in one line before any work."""
    refuse_torchrun("search")
    refuse_resume("search", calibration)
    if len(recipes) != 1:
        raise PtqError(
            "ptq search takes one recipe for now (--recipes fp8-e4m3): mixed schemes, several "
            "recipes per unit, are not searched yet"
        )
    if model.placement is not None:
        raise PtqError("--device-map does not apply to ptq search yet: the model runs whole")
    if compute.low_memory:
        raise PtqError("--low-memory does not apply to ptq search yet: the model runs whole")


def _write(out: Path, record: dict, source: dict) -> None:
    """The folder's files, all or none (built under a temporary name, then renamed)."""
    import json

    with atomic_dir(out) as tmp:
        (tmp / "searched.yaml").write_text(searched_yaml(record, source), encoding="utf-8")
        text_writer(json.dumps(to_json(record), indent=2) + "\n")(tmp / "search.json")
        (tmp / "search.md").write_text(search_markdown(record), encoding="utf-8")
        curve_writer(record)(tmp / "search.png")
