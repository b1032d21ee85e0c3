"""The search: units, their sensitivity, the selection under a budget, the held-out verdict.

Every configuration is a recipe: the chosen recipe with the units kept in 16-bit added to its
`ignore` list (config_recipe), scored by the one evaluation loop against the bf16 baseline on the
same windows. It is not quantized anew: the model is quantized once with every unit in 16-bit and
once whole, and a configuration swaps in the quantized layers of the units it does not keep
(Scorer), the very modules quantize_variants makes of its recipe. What the search measures is
therefore exactly what searched.yaml gives `ptq compare` or `ptq quantize` (tests/test_search.py
checks it number for number).

Sensitivity (SENSITIVITY): one unit at a time, exactly: the KL from the baseline of the model with
only that unit quantized, on the search windows. It is the damage the unit does on its own, never
negative, and the quantity the budget is stated in; how units interact is left to the selection,
which checks every candidate end to end. Its cost: one forward per unit and search window, plus
one baseline forward per chunk of units.

Selection: units ranked by damage per matmul weight (what keeping the unit in 16-bit avoids, per
byte it keeps in 16-bit); keeping the first k of that list is evaluated end to end for a few k at
once, and the interval between the largest k that misses the budget and the smallest that meets
it is narrowed until they are neighbours (a bisection, a few points per pass). The configurations
evaluated are the curve of damage against the fraction of matmul weights quantized.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ptq import progress
from ptq.calibration.calibrate import Calibration
from ptq.calibration.clips import quantize_variants
from ptq.errors import PtqError
from ptq.evaluation import stats
from ptq.evaluation.evaluate import Scores, evaluate
from ptq.execution.executors import WholeModels
from ptq.execution.streaming import decoder_layers
from ptq.quantization import engines
from ptq.quantization.plan import Plan
from ptq.quantization.recipes import Recipe

SENSITIVITY = (
    "exact, one unit at a time: the mean KL (nats per token, vs the bf16 baseline) of the model "
    "with only that unit quantized, on the search windows; units ranked by that KL per matmul "
    "weight the unit holds"
)
CHUNK = 8  # configurations quantized and evaluated together (one baseline forward per chunk)
RANDOM_DRAWS = 3  # seeded draws of the random baseline
POINTS_PER_PASS = 3  # configurations evaluated per pass of the bisection
METRICS = {"kl": "mean KL (nats per token)", "ppl": "perplexity increase (%)"}
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


@dataclass(frozen=True)
class Unit:
    """What the engine serves as one layer: kept in 16-bit or quantized as a whole."""

    name: str
    members: tuple[str, ...]  # the matmuls (names in the linearized model)
    params: int  # matmul weights
    patterns: tuple[str, ...]  # what a recipe's `ignore` list gets to keep the unit in 16-bit


def units_of(model: nn.Module, plan: Plan) -> list[Unit]:
    """The units of the matmuls `plan` quantizes, in the model's order. Under --target vllm: a
    mixture-of-experts layer's experts are one unit, q/k/v one, gate/up one
    (engines.fused_groups); otherwise each matmul is its own unit."""
    quantized = [n for n, m in plan.matmuls.items() if m.quantized]
    owner: dict[str, str] = {}
    patterns: dict[str, tuple[str, ...]] = {}
    if plan.target == "vllm":
        for name in quantized:
            if match := _EXPERTS.match(name):
                owner[name] = match.group(1)
                patterns[match.group(1)] = (f"{match.group(1)}.*",)
        inside = set(quantized)
        for group in engines.fused_groups(model):
            present = [n for n in group if n in inside and n not in owner]
            if len(present) < 2:
                continue
            parent = present[0].rpartition(".")[0]
            short = ",".join(n.rpartition(".")[2] for n in present)
            key = f"{parent}.{{{short}}}"
            owner |= dict.fromkeys(present, key)
            patterns[key] = tuple(present)
    members: dict[str, list[str]] = {}
    for name in quantized:
        key = owner.get(name, name)
        members.setdefault(key, []).append(name)
        patterns.setdefault(key, (name,))
    units = [
        Unit(key, tuple(names), sum(plan.matmuls[n].params for n in names), patterns[key])
        for key, names in members.items()
    ]
    if plan.target == "vllm":
        _refuse_split(model, units)
    return units


def _refuse_split(model: nn.Module, units: list[Unit]) -> None:
    """A group vLLM serves together (fused layers, an experts module's shared input scales) whose
    quantized members fall in several units cannot be kept in 16-bit as a whole: refused."""
    owner = {m: u.name for u in units for m in u.members}
    for group in engines.fused_groups(model) + engines.expert_input_groups(model):
        owners = sorted({owner[n] for n in group if n in owner})
        if len(owners) > 1:
            raise PtqError(
                f"cannot form search units of this model: {', '.join(group[:3])}"
                f"{', ...' if len(group) > 3 else ''} are served together under --target vllm "
                f"but fall in {len(owners)} units ({', '.join(owners[:3])}); search it with "
                "--target transformers"
            )


def config_recipe(recipe: Recipe, kept: list[Unit], name: str) -> Recipe:
    """`recipe` with the `kept` units in 16-bit (their patterns added to its ignore list)."""
    extra = [p for u in kept for p in u.patterns]
    return dataclasses.replace(recipe, name=name, ignore=(*recipe.ignore, *extra))


def damage(metric: str, s: Scores, base: Scores) -> float:
    """The budget's measure of one configuration's scores against the baseline's, same windows."""
    if metric == "kl":
        return s.kl_div
    with np.errstate(over="ignore"):
        return float(100 * np.expm1((s.nll_sum - base.nll_sum) / s.tokens))


class Scorer:
    """Scores configurations of one model (the units kept in 16-bit, by configuration name) with
    the baseline on given windows, CHUNK at a time; counts the forward passes (of one window) and
    the time spent.

    The model is quantized once, three ways (quantize_variants): the baseline, the recipe with
    every unit kept in 16-bit (config_recipe) and the recipe whole. A configuration is the second
    with the quantized layers of the units it does not keep swapped in from the third (module
    references, no copy): the same QuantLinears, built the same way, that quantize_variants makes of
    the configuration's own recipe (config_recipe), so the same numbers (tests/test_search.py) at
    the cost of the forwards only."""

    def __init__(
        self,
        model: nn.Module,
        baseline: Recipe,
        recipe: Recipe,
        units: list[Unit],
        calibration: Calibration | None,
        matmul: str,
        target: str,
        batch_size: int | None,
    ):
        self.model, self.baseline, self.recipe, self.units = model, baseline, recipe, units
        self.calibration, self.matmul, self.target = calibration, matmul, target
        self.batch_size = batch_size
        self.forwards, self.seconds = 0, 0.0
        self._built: tuple[nn.Module, nn.Module, dict, dict] | None = None

    def _build(self) -> tuple[nn.Module, nn.Module, dict, dict]:
        """The baseline, the working model (every unit in 16-bit), and each unit's members in 16-bit
        and quantized, by member name."""
        if self._built is None:
            kept = config_recipe(self.recipe, self.units, "ptq-search:kept")
            whole = dataclasses.replace(self.recipe, name="ptq-search:quantized")
            models = quantize_variants(
                self.model, [self.baseline, kept, whole], self.calibration, self.matmul,
                self.target,
            )  # fmt: skip
            working, quantized = models[kept.name], models[whole.name]
            members = [n for u in self.units for n in u.members]
            off = {n: working.get_submodule(n) for n in members}
            on = {n: quantized.get_submodule(n) for n in members}
            self._built = (models[self.baseline.name], working, off, on)
        return self._built

    def score(
        self, configs: dict[str, list[Unit]], input_ids: torch.Tensor, what: str
    ) -> tuple[dict[str, Scores], Scores]:
        """Each configuration's scores by name, and the baseline's."""
        base_model, working, off, on = self._build()
        out: dict[str, Scores] = {}
        base = None
        names = list(configs)
        chunks = range(0, len(names), CHUNK)
        for i, start in enumerate(chunks):
            part = names[start : start + CHUNK]
            if not progress.QUIET:
                progress.stderr.print(f"{what}: {i + 1} of {len(chunks)}", highlight=False)
            began = time.perf_counter()
            swaps = {}
            for name in part:
                keep = {n for u in configs[name] for n in u.members}
                swaps[name] = {n: off[n] if n in keep else on[n] for n in off}
            run = Configurations(self.baseline.name, base_model, working, swaps, off)
            scores = evaluate(run, input_ids, self.batch_size)
            self.seconds += time.perf_counter() - began
            self.forwards += (len(part) + 1) * len(input_ids)
            base = scores[self.baseline.name]
            out |= {name: scores[name] for name in part}
        if base is None:  # no configuration: the baseline alone
            base = evaluate({self.baseline.name: base_model}, input_ids, self.batch_size)[
                self.baseline.name
            ]
            self.forwards += len(input_ids)
        return out, base


PREFIX_BYTES = 1 << 30  # at most this much of the baseline's decoder-layer outputs kept per batch


class Configurations(WholeModels):
    """The baseline, then each configuration: the working model with its layers swapped in
    (`swaps`: configuration -> layer name -> module) before it runs on each batch.

    A configuration's decoder layers before its first quantized one are the baseline's layers (the
    same 16-bit layers: the search's recipes quantize matmuls only), and their outputs on the batch
    are the baseline's: they are not run again but replaced by stand-ins that give the baseline's
    outputs, kept as it ran (when they take at most PREFIX_BYTES). The numbers are the same; the
    forward of a configuration whose first quantized unit is in layer j costs the layers from j."""

    def __init__(
        self,
        baseline: str,
        base_model: nn.Module,
        working: nn.Module,
        swaps: dict[str, dict],
        off: dict[str, nn.Module],
    ):
        super().__init__({baseline: base_model} | dict.fromkeys(swaps, working))
        self.swaps = swaps
        self.slots = {
            n: (working.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
            for layers in swaps.values()
            for n in layers
        }
        self.layers = self.base_layers = None
        self.first: dict[str, int] = {}
        try:
            path = decoder_layers(working)
        except PtqError:
            return
        self.layers, self.base_layers = working.get_submodule(path), base_model.get_submodule(path)
        for name, layers in swaps.items():
            quantized = [n for n, m in layers.items() if m is not off[n]]
            self.first[name] = min((_layer_index(n, path) for n in quantized), default=0)
        self.first = {k: v for k, v in self.first.items() if v > 0}

    def _outputs(self, batch, logits, i, after_batch):
        kept: list = []
        for name in self.names:
            for n, module in self.swaps.get(name, {}).items():
                parent, child = self.slots[n]
                if getattr(parent, child) is not module:
                    setattr(parent, child, module)
            first = self.first.get(name, 0) if self.layers and len(kept) == len(self.layers) else 0
            hooks = [] if name in self.swaps or not self.first else self._keep(kept, batch)
            originals = [self.layers[j] for j in range(first)]
            for j in range(first):
                self.layers[j] = _Given(kept[j])
            try:
                out = self.models[name](
                    input_ids=batch.to(self.devices[name]), **self.options[name]
                )
            finally:
                for j, layer in enumerate(originals):
                    self.layers[j] = layer
                for h in hooks:
                    h.remove()
            yield name, out.logits.to(self.device) if logits else None
            del out
        if after_batch is not None:
            after_batch(i)

    def _keep(self, kept: list, batch: torch.Tensor) -> list:
        """Hooks that keep the baseline's decoder-layer outputs on `batch` in `kept` (none when they
        would take more than PREFIX_BYTES)."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        size = getattr(config, "hidden_size", 0) * batch.numel() * len(self.base_layers)
        if not size or size * self.dtype.itemsize > PREFIX_BYTES:
            return []
        return [
            layer.register_forward_hook(lambda m, args, out: kept.append(out))
            for layer in self.base_layers
        ]


class _Given(nn.Module):
    """A decoder layer's stand-in: gives the output the baseline's layer gave on this batch."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


def _layer_index(name: str, layers: str) -> int:
    """The decoder layer `name` is in (0 outside the decoder layers: nothing before it reused)."""
    prefix = f"{layers}." if layers else ""
    if not name.startswith(prefix):
        return 0
    head = name[len(prefix) :].partition(".")[0]
    return int(head) if head.isdigit() else 0


def sensitivity(scorer: Scorer, units: list[Unit], input_ids: torch.Tensor) -> dict[str, float]:
    """Each unit's KL with only it quantized (SENSITIVITY), by unit name."""
    configs = {f"only:{u.name}": [v for v in units if v is not u] for u in units}
    scores, _ = scorer.score(configs, input_ids, "sensitivity (one unit at a time)")
    return {u.name: scores[f"only:{u.name}"].kl_div for u in units}


def ranked(units: list[Unit], sens: dict[str, float]) -> list[Unit]:
    """The units by damage avoided per matmul weight kept in 16-bit, most first (ties: model
    order)."""
    return sorted(units, key=lambda u: -sens[u.name] / max(u.params, 1))


def select(
    scorer: Scorer,
    order: list[Unit],
    input_ids: torch.Tensor,
    metric: str,
    budget: float,
    fraction: Callable[[list[Unit]], float],
) -> tuple[int, list[dict]]:
    """The smallest k such that keeping order[:k] in 16-bit meets `budget` on the search windows
    (by bisection over k, checked end to end), and the curve of the configurations evaluated."""
    n = len(order)
    points: dict[int, dict] = {
        n: {"kept": n, "damage": 0.0, "kl": 0.0, "ppl_increase": 0.0, "evaluated": False}
    }

    def run(ks: list[int]) -> None:
        ks = sorted(set(ks) - set(points))
        configs = {f"keep:{k}": order[:k] for k in ks}
        scores, base = scorer.score(configs, input_ids, f"selection: {len(ks)} configuration(s)")
        for k in ks:
            s = scores[f"keep:{k}"]
            points[k] = {
                "kept": k,
                "damage": damage(metric, s, base),
                "kl": s.kl_div,
                "ppl_increase": damage("ppl", s, base),
                "evaluated": True,
            }

    run([0, n // 8, n // 4, n // 2])
    while True:
        hi = min(k for k, p in points.items() if p["damage"] <= budget)
        below = [k for k in points if k < hi]
        if not below or hi - max(below) <= 1:
            break
        lo = max(below)
        step = (hi - lo) / (POINTS_PER_PASS + 1)
        run([lo + max(1, round(step * (i + 1))) for i in range(POINTS_PER_PASS) if lo + 1 < hi])
    curve = [
        p | {"fraction_quantized": fraction(order[: p["kept"]]), "meets": p["damage"] <= budget}
        for _, p in sorted(points.items())
    ]
    return hi, curve


def unit_amax(units: list[Unit], calibration: Calibration | None) -> dict[str, float] | None:
    """Each unit's largest calibrated input amax over its members (None: no calibration)."""
    if calibration is None:
        return None
    return {
        u.name: max(float(calibration.input_amax[n]) for n in u.members) if u.members else 0.0
        for u in units
        if all(n in calibration.input_amax for n in u.members)
    }


def verdict(metric: str, budget: float, s: Scores, base: Scores) -> dict:
    """The held-out measure of one configuration with its 95% paired bootstrap interval, and whether
    the interval's upper bound meets the budget (and by how much it misses)."""
    if metric == "kl":
        e = stats.estimate(s.window_kl)
        value, ci = e["value"], e["ci"]
    else:
        d = stats.paired_delta(base.window_nll, s.window_nll, stats.ratio_pct_of_exp)
        value, ci = d["delta"], d["ci"]
    upper = ci[1]
    meets = bool(upper <= budget) if not math.isnan(upper) else False
    return {
        "value": value,
        "ci": ci,
        "n": len(s.window_nll),
        "meets": meets,
        "miss": None if meets or math.isnan(upper) else upper - budget,
        "kl": s.kl_div,
        "ppl_increase": damage("ppl", s, base),
    }


def held_out(
    scorer: Scorer,
    units: list[Unit],
    order: list[Unit],
    k: int,
    amax: dict[str, float] | None,
    input_ids: torch.Tensor,
    metric: str,
    budget: float,
    seed: int,
) -> tuple[dict, list[dict]]:
    """The chosen configuration's verdict on the held-out windows, and the baselines' (the recipe
    whole; the same number of units by largest input amax; at random, RANDOM_DRAWS seeded draws),
    all evaluated together on those windows."""
    configs = {"searched": order[:k], "recipe": []}
    if 0 < k < len(units):
        if amax is not None and len(amax) == len(units):
            configs["amax"] = sorted(units, key=lambda u: -amax[u.name])[:k]
        for draw in range(RANDOM_DRAWS):
            configs[f"random:{draw}"] = random.Random(seed + draw).sample(units, k)
    scores, base = scorer.score(configs, input_ids, "held-out verification")
    results = {
        name: verdict(metric, budget, scores[name], base)
        | {"kept": sorted(u.name for u in kept), "count": len(kept)}
        for name, kept in configs.items()
    }
    baselines = [{"name": name} | r for name, r in results.items() if name != "searched"]
    return results["searched"], baselines


def closest(verdict: dict, baselines: list[dict]) -> dict | None:
    """When the searched configuration misses the budget on the held-out windows: of the
    configurations evaluated there, the one whose interval's upper bound came nearest to the budget
    (the searched one itself included; baselines that keep the same units as the searched one are
    the same configuration and not counted again), with `only` true where the searched
    configuration was the only one verified. None when it meets the budget."""
    if verdict["meets"]:
        return None
    searched = {"name": "searched"} | verdict
    others = [b for b in baselines if "ci" in b and sorted(b["kept"]) != sorted(verdict["kept"])]
    verified = [x for x in [searched, *others] if not math.isnan(x["ci"][1])]
    if not verified:
        return {"name": None, "only": not others, "verified": 0}
    best = min(verified, key=lambda x: x["ci"][1])
    return {
        "name": best["name"],
        "count": best["count"],
        "kept": best["kept"],
        "value": best["value"],
        "ci": best["ci"],
        "meets": best["meets"],
        "miss": best["miss"],
        "only": not others,
        "verified": len(verified),
    }
