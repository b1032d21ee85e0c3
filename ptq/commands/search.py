"""ptq search: model + one recipe + a budget -> the fewest units kept in 16-bit that meet the budget
on search windows, verified on held-out windows -> DIR/searched.yaml, search.json, search.md,
search.png.

The model is loaded, its windows cut and the recipe calibrated as compare does (prepare); the
evaluation windows alternate between the search (even) and the held-out (odd) windows; the search
itself is ptq.search.search's."""

from __future__ import annotations

import time
from pathlib import Path

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
from ptq.files import atomic_dir, check_writable, read_yaml, text_writer
from ptq.quantization.recipes import load_recipe
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
    out = Path(output.path)
    check_writable(out, output.force, directory=True)
    compute_info = checked_compute_path(model, compute, data, False)
    baseline, recipe = load_recipe(BASELINE_RECIPE), load_recipe(recipes[0])
    if recipe.beyond_linear:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes {', '.join(recipe.beyond_linear)}: ptq search keeps "
            "matmul units in 16-bit and does not search these yet; give a recipe of matmuls only"
        )
    source = read_yaml(Path(recipe.source), "recipe")
    needed = [recipe] if recipe.needs_calibration else []
    refuse_unused_calibration(
        calibration, bool(needed), f"recipe {recipe.name} needs no calibration", "--calib-data"
    )
    texts = read_texts(calibration, data, needed)
    prepared = prepare(
        model,
        data,
        calibration,
        compute,
        [baseline, recipe],
        needed,
        texts,
        streamed=False,
        dtype=getattr(torch, compute_info["dtype"]),
        copies=2.5,
    )
    ids = prepared.windows.input_ids
    if len(ids) < 2:
        raise PtqError(
            f"{len(ids)} evaluation window(s): the search needs at least 2 (search and held-out); "
            "give more text or a larger --max-windows"
        )
    search_ids, held_ids = ids[0::2], ids[1::2]
    plan = prepared.plans[recipe.name]
    units = s.units_of(prepared.loaded.model, plan)
    if not units:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes no matmul of this model: nothing to search"
        )
    total = sum(m.params for m in plan.matmuls.values())
    quantized = sum(u.params for u in units)

    def fraction(kept: list[s.Unit]) -> float:
        return (quantized - sum(u.params for u in kept)) / total

    scorer = s.Scorer(
        prepared.loaded.model,
        baseline,
        prepared.calibration if needed else None,
        compute_info["matmul"],
        compute.target,
        compute.batch_size,
    )
    began = time.perf_counter()
    sens = s.sensitivity(scorer, recipe, units, search_ids)
    sensitivity_seconds = scorer.seconds
    order = s.ranked(units, sens)
    k, curve = s.select(
        scorer, recipe, order, search_ids, budget["metric"], budget["value"], fraction
    )
    amax = s.unit_amax(units, prepared.calibration if needed else None)
    verdict, baselines = s.held_out(
        scorer,
        recipe,
        units,
        order,
        k,
        amax,
        held_ids,
        budget["metric"],
        budget["value"],
        SEED,
    )
    if amax is None or len(amax) < len(units):
        baselines.append({"name": "amax", "skipped": "no calibrated input amax for every unit"})
    chosen = [u.name for u in order[:k]]
    record = {
        "model": prepared.loaded.name,
        "recipe": recipe.name,
        "target": compute.target,
        "budget": budget | {"measure": s.METRICS[budget["metric"]]},
        "windows": {
            "total": len(ids),
            "search": len(search_ids),
            "held_out": len(held_ids),
            "seq_len": int(ids.shape[1]),
            "description": f"{len(ids)} evaluation windows of {ids.shape[1]} tokens: the even ones "
            f"({len(search_ids)}) search, the odd ones ({len(held_ids)}) are held out and "
            "only verify the result",
        },
        "units_description": (
            "what vLLM serves as one layer (q/k/v together, gate/up together, a layer's experts "
            "together), kept in 16-bit or quantized whole"
            if compute.target == "vllm"
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
                "sensitivity": sens[u.name],
                "rank": order.index(u),
                "input_amax": (amax or {}).get(u.name),
            }
            for u in units
        ],
        "curve": curve,
        "chosen": chosen,
        "fraction_quantized": fraction(order[:k]),
        "verdict": verdict,
        "baselines": baselines,
        "seed": SEED,
        "cost": {
            "forwards": scorer.forwards,
            "evaluations": scorer.forwards / (2 * len(ids)),
            "seconds": time.perf_counter() - began,
            "sensitivity_seconds": sensitivity_seconds,
        },
        "calibration_source": prepared.calibration_source,
        "versions": versions(),
        "created": now(),
    }
    _write(out, record, source)
    return record


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
