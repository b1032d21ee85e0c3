"""ptq search: model + recipes (cheapest first) + a budget -> the fewest units kept in 16-bit, or
at a finer recipe, that meet the budget on search windows, verified on held-out windows ->
DIR/searched.yaml, search.json, search.md, search.png.

The model is loaded, its windows cut and the recipe calibrated as compare does (prepare); the
evaluation windows alternate between the search (even) and the held-out (odd) windows; the search
itself is ptq.search.search's. With --low-memory (or automatically, as compare decides, when the
model and its quantized copies do not fit in memory) the model is read layer by layer from disk,
calibrated and searched so (ptq.search.search.Scorer), to the same numbers."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ptq.commands.common import (
    now,
    refuse_torchrun,
    refuse_unused_calibration,
    runs_layer_by_layer,
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
from ptq.execution import streaming
from ptq.files import atomic_dir, check_outputs, read_yaml, text_writer, writes_outputs
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.results import to_json
from ptq.reporting.search import curve_writer, search_markdown, searched_yaml
from ptq.search import search as s

SEED = 0
FILES = ("searched.yaml", "search.json", "search.md", "search.png")


def parse_budget(
    max_kl: str | None, max_ppl_increase: str | None, min_accuracy_recovery: str | None = None
) -> dict:
    """--max-kl NATS, --max-ppl-increase PCT or --min-accuracy-recovery [next-token=]PCT, exactly
    one. An accuracy budget is held as the accuracy it may lose: 100 less the recovery."""
    from ptq.reporting.gates import parse_limits

    given = [x for x in (max_kl, max_ppl_increase, min_accuracy_recovery) if x is not None]
    if len(given) != 1:
        raise PtqError(
            "give one budget: --max-kl NATS, --max-ppl-increase PCT or --min-accuracy-recovery PCT"
        )
    accuracy = [min_accuracy_recovery] if min_accuracy_recovery is not None else None
    limits = parse_limits(max_ppl_increase, accuracy, max_kl)
    if max_kl is not None:
        return {"metric": "kl", "flag": "--max-kl", "given": max_kl, "value": limits.max_kl}
    if max_ppl_increase is not None:
        return {
            "metric": "ppl",
            "flag": "--max-ppl-increase",
            "given": max_ppl_increase,
            "value": limits.max_ppl_increase_pct,
        }
    tasks = set(limits.task_accuracy_recovery_pct) - {"next-token"}
    if tasks:
        raise PtqError(
            f"--min-accuracy-recovery {min_accuracy_recovery}: ptq search budgets next-token "
            f"accuracy (99% or next-token=99%), not the accuracy of a task ({', '.join(tasks)})"
        )
    pct = limits.task_accuracy_recovery_pct.get("next-token", limits.min_accuracy_recovery_pct)
    return {
        "metric": "acc",
        "flag": "--min-accuracy-recovery",
        "given": min_accuracy_recovery,
        "value": 100 - pct,
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
    _refuse(model)
    searched, sources = _searched_recipes(recipes)
    out = _check_output(output, model, data, calibration, searched)
    state = _check_state(out, calibration.resume, output.force)
    copies = 1.5 + len(searched)
    streamed = runs_layer_by_layer(
        model, compute.low_memory, copies,
        note=f"note: model '{model.model}' and its {len(searched) + 1} quantized copies do not fit "
        f"in memory: searching layer by layer from disk ({streaming.LOW_MEMORY_FLAG})",
    )  # fmt: skip
    compute_info = checked_compute_path(model, compute, data, streamed)
    needed = [r for r in searched if r.needs_calibration]
    refuse_unused_calibration(
        calibration, bool(needed), f"recipe(s) {', '.join(recipes)} need no calibration",
        "--calib-data",
    )  # fmt: skip
    texts = read_texts(calibration, data, needed)
    # --resume resumes the search (its state file), not a calibration: that one is made again
    resume, calibration = calibration.resume, dataclasses.replace(calibration, resume=False)
    baseline = load_recipe(BASELINE_RECIPE)
    dtype = getattr(torch, compute_info["dtype"])
    prepared = prepare(
        model, data, calibration, compute, [baseline, *searched], needed, texts,
        streamed=streamed, dtype=dtype, copies=copies,
    )  # fmt: skip
    ids = _windows(prepared.windows.input_ids)
    plan = prepared.plans[searched[0].name]
    _refuse_other_matmuls(searched, prepared.plans)
    units = s.units_of(prepared.loaded.model, plan, compute.target == "vllm" or len(searched) > 1)
    if not units:
        raise PtqError(
            f"recipe '{searched[0].name}' quantizes no matmul of this model: nothing to search"
        )
    calibrated = prepared.calibration if needed else None
    fingerprint = _fingerprint(prepared.loaded.model, searched, calibrated, compute_info, compute)
    journal = s.Journal(state, fingerprint, resume)
    scorer = s.Scorer(
        prepared.loaded.model, baseline, searched, units, calibrated, compute_info["matmul"],
        compute.target, compute.batch_size, journal,
    )  # fmt: skip
    began = time.perf_counter()
    found = _search(scorer, plan, units, ids, budget, calibrated)
    record = _record(prepared, searched, compute.target, budget, ids, units, found)
    record["cost"] |= {"seconds": time.perf_counter() - began, "reused": journal.reused}
    record["cost"] |= {"chunks": scorer.chunks, "low_memory": streamed}
    _write(out, record, sources, _scheme_names(recipes, searched))
    state.unlink(missing_ok=True)
    return record


def state_path(out: Path) -> Path:
    """Where an interrupted search of OUT left the configurations it scored: OUT.search-state.json
    (beside OUT, which is written only once the search is done)."""
    return out.with_name(out.name + ".search-state.json")


def _check_state(out: Path, resume: bool, force: bool) -> Path:
    """The state file: resumed with --resume, started over with --force, otherwise in the way."""
    state = state_path(out)
    if resume and not state.is_file():
        raise PtqError(f"no search to resume ({state} does not exist); run without --resume")
    if state.exists() and not resume:
        if not force:
            raise PtqError(
                f"{state} is left from an interrupted search: pass --resume to continue it, or "
                "--force to start over"
            )
        state.unlink()
    return state


def _fingerprint(model, recipes, calibration, compute_info: dict, compute) -> str:
    """What a search's scores depend on besides its windows and each configuration (the journal's
    keys): the model (model_digest; read layer by layer, its checkpoint's contents too), the
    recipes, the calibrated scales, the target, the arithmetic and the batches."""
    import hashlib

    from ptq.calibration.calibrate import model_digest

    h = hashlib.sha256(model_digest(model))
    if streaming.is_streamed(model):
        h.update(model.ptq_checkpoint.digest())
    for r in recipes:
        h.update(repr(dataclasses.replace(r, source="")).encode())
    if calibration is not None:
        for stats in (
            calibration.input_amax,
            calibration.input_hist,
            calibration.input_channel_amax,
        ):
            for name in sorted(stats):
                h.update(name.encode())
                h.update(stats[name].double().cpu().numpy().tobytes())
    what = [compute.target, compute_info["matmul"], compute_info["dtype"], compute.batch_size]
    h.update(repr([*what, sorted(versions().items())]).encode())
    return h.hexdigest()


def _searched_recipes(given: list[str]) -> tuple[list[Recipe], list[dict]]:
    """The recipes searched, cheapest first, and their YAML (searched.yaml is written from one):
    matmuls only; several only where they can be one recipe's overrides."""
    recipes = [load_recipe(name) for name in given]
    for recipe in recipes:
        if recipe.beyond_linear:
            raise PtqError(
                f"recipe '{recipe.name}' quantizes {', '.join(recipe.beyond_linear)}: ptq search "
                "keeps matmul units in 16-bit and does not search these yet; give a recipe of "
                "matmuls only"
            )
        if recipe.overrides:
            raise PtqError(
                f"recipe '{recipe.name}' has overrides: ptq search writes its own; give the "
                "recipe without them"
            )
    names = [r.name for r in recipes]
    if len(set(names)) < len(names):
        raise PtqError(f"--recipes names a recipe twice: {', '.join(names)}")
    if len(recipes) > 1 and any(r.smoothquant is not None for r in recipes):
        raise PtqError(
            "a SmoothQuant recipe is searched alone: its smoothing and per-unit overrides do not "
            "combine"
        )
    return recipes, [read_yaml(Path(r.source), "recipe") for r in recipes]


def _scheme_names(given: list[str], recipes: list[Recipe]) -> list[str]:
    """How searched.yaml names each recipe in an override's `scheme`: a built-in by its name, a
    file by its absolute path."""
    return [
        str(Path(g).resolve()) if Path(g).suffix in (".yaml", ".yml") or "/" in g else r.name
        for g, r in zip(given, recipes)
    ]


def _refuse_other_matmuls(recipes: list[Recipe], plans: dict) -> None:
    """Every recipe searched quantizes the same matmuls (a unit's level is which recipe quantizes
    it)."""
    first = set(plans[recipes[0].name].quantized)
    for r in recipes[1:]:
        other = set(plans[r.name].quantized)
        if other != first:
            odd = sorted(other ^ first)
            raise PtqError(
                f"recipes '{recipes[0].name}' and '{r.name}' quantize different matmuls of this "
                f"model ({len(odd)} differ, e.g. {odd[0]}): the searched recipes must select the "
                "same layers"
            )


def _check_output(
    output: OutputOptions,
    model: ModelOptions,
    data: DataOptions,
    calibration: CalibrationOptions,
    recipes: list[Recipe],
) -> Path:
    """The output folder, written whole (ptq.files.check_outputs, before any work): none of the
    run's inputs nor within one, replaced only with --force, claimed for this run."""
    out = Path(output.path)
    inputs = {
        "the model": model.model,
        "the evaluation text": spec_source(data.data),
        "the calibration text": spec_source(calibration.data),
        "the calibration file": calibration.file,
    } | {f"the recipe {r.name}": r.source for r in recipes}
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
    """What the search found: each unit's sensitivity (one KL per recipe), the steps in the order
    taken, how many were taken, the curve, the amax ranking's own selection, the held-out verdict
    and its baselines, and what the sensitivity cost."""

    sensitivity: dict[str, list[float]]
    steps: list[s.Step]
    taken: int
    curve: list[dict]
    amax: dict[str, float] | None
    amax_curve: list[dict] | None
    verdict: dict
    baselines: list[dict]
    fraction: float
    forwards: int
    sensitivity_seconds: float


def _search(scorer: s.Scorer, plan, units, ids, budget, calibrated) -> _Found:
    """Sensitivity, ranking and selection on the search windows (the even ones), the same selection
    over the units ranked by input amax, then the verdict and the baselines on the held-out windows
    (the odd ones)."""
    search_ids, held_ids = ids[0::2], ids[1::2]
    total = sum(m.params for m in plan.matmuls.values())
    quantized = sum(u.params for u in units)

    def fraction(config: s.Config) -> float:
        return (quantized - sum(u.params for u in units if config.get(u.name, 0) is s.KEEP)) / total

    sensitivity = s.sensitivity(scorer, units, search_ids)
    sensitivity_seconds = scorer.seconds
    steps = s.ladder(units, scorer.recipes, sensitivity)
    metric, value = budget["metric"], budget["value"]
    taken, curve = s.select(scorer, steps, search_ids, metric, value, fraction)
    chosen = s.configuration(steps, taken)
    amax = s.unit_amax(units, calibrated)
    others, amax_curve = {}, None
    if amax is not None and len(amax) == len(units):
        by_amax = [(u.name, s.KEEP) for u in sorted(units, key=lambda u: -amax[u.name])]
        k, amax_curve = s.select(
            scorer, by_amax, search_ids, metric, value, fraction, "amax ranking"
        )
        others["amax:budget"] = s.configuration(by_amax, k)
    verdict, baselines = s.held_out(
        scorer, units, chosen, others, amax, held_ids, metric, value, SEED
    )
    if amax_curve is None:
        baselines.append({"name": "amax", "skipped": "no calibrated input amax for every unit"})
    return _Found(
        sensitivity, steps, taken, curve, amax, amax_curve, verdict, baselines, fraction(chosen),
        scorer.forwards, sensitivity_seconds,
    )  # fmt: skip


def _record(prepared, recipes, target, budget, ids, units, found: _Found) -> dict:
    """search.json: what was searched, how, and what was found."""
    search, held = len(ids[0::2]), len(ids[1::2])
    chosen = s.configuration(found.steps, found.taken)
    levels = s.labels(recipes, units, chosen)
    base = s.base_level(units, chosen)
    return {
        "model": prepared.loaded.name,
        "recipe": recipes[0].name,
        "recipes": [r.name for r in recipes],
        "base": recipes[base].name,
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
            "each matmul (--target transformers fuses nothing)"
            if all(len(u.members) == 1 for u in units) and target != "vllm"
            else "what vLLM serves as one layer (q/k/v together, gate/up together, a layer's "
            "experts together), given one scheme or kept in 16-bit whole"
        ),
        "method": s.SENSITIVITY,
        "selection": (
            "take the first k ranked steps; the smallest k whose configuration meets the budget on "
            "the search windows (the upper bound of its 95% interval within it), found by "
            "bisection over k with each candidate evaluated end to end"
        ),
        "units": [
            {
                "name": u.name,
                "members": list(u.members),
                "patterns": list(u.patterns),
                "params": u.params,
                "sensitivity": dict(zip((r.name for r in recipes), found.sensitivity[u.name])),
                "level": levels.get(u.name, recipes[0].name),
                "input_amax": (found.amax or {}).get(u.name),
            }
            for u in units
        ],
        "steps": [
            {"unit": name, "to": "16-bit" if level is s.KEEP else recipes[level].name}
            for name, level in found.steps
        ],
        "curve": found.curve,
        "chosen": sorted(u for u, label in levels.items() if label == "16-bit"),
        "finer": {u: label for u, label in levels.items() if label != "16-bit"},
        "fraction_quantized": found.fraction,
        "amax_curve": found.amax_curve,
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


def _refuse(model: ModelOptions) -> None:
    """What the search does not do yet, refused in one line before any work. --device-map: a
    configuration swaps quantized layers into one 16-bit copy of the model, which accelerate's
    hooks (placed and offloaded modules) do not follow."""
    refuse_torchrun("search")
    if model.placement is not None:
        raise PtqError(
            "--device-map does not apply to ptq search yet: its configurations swap layers into "
            f"one copy of the model; for a model larger than memory use {streaming.LOW_MEMORY_FLAG}"
        )


def _write(out: Path, record: dict, sources: list[dict], schemes: list[str]) -> None:
    """The folder's files, all or none (built under a temporary name, then renamed)."""
    import json

    with atomic_dir(out) as tmp:
        (tmp / "searched.yaml").write_text(
            searched_yaml(record, sources, schemes), encoding="utf-8"
        )
        text_writer(json.dumps(to_json(record), indent=2) + "\n")(tmp / "search.json")
        (tmp / "search.md").write_text(search_markdown(record), encoding="utf-8")
        curve_writer(record)(tmp / "search.png")
