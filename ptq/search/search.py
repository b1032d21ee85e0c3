"""The search: units, their sensitivity, the selection under a budget, the held-out verdict.

A configuration gives each unit a level: one of the candidate recipes (the user's order, cheapest
first) or KEEP, 16-bit. Every configuration is a recipe (config_recipe): the first recipe, with the
units kept in 16-bit added to its `ignore` list and an override per later recipe naming its units,
scored by the one evaluation loop against the bf16 baseline on the same windows. It is not
quantized anew: the model is quantized once with every unit in 16-bit and once whole per recipe,
and a configuration swaps in the quantized layers of its units' levels (Scorer), the very modules
quantize_variants makes of its recipe. What the search measures is therefore exactly what
searched.yaml gives `ptq compare` or `ptq quantize` (tests/test_search.py checks it number for
number). A model larger than memory (`--low-memory`) is read layer by layer from disk for each
chunk of configurations and scored so, to the same numbers (Scorer).

Sensitivity (SENSITIVITY): one unit at a time, exactly: the KL from the baseline of the model with
only that unit quantized, by each recipe, on the search windows. It is the damage the unit does on
its own, never negative, and the quantity the budget is stated in; how units interact is left to
the selection, which checks every candidate end to end. Its cost: one forward per unit, recipe and
search window, plus one baseline forward per chunk of configurations.

Selection: the steps from every unit at the first recipe to every unit in 16-bit (ladder), ordered
by damage avoided per weight byte added (a step to a finer scheme of the same width adds none and
comes first); taking the first k steps is evaluated end to end for a few k at once, and the interval
between the largest k that misses the budget and the smallest that meets it is narrowed until they
are neighbours (a bisection, a few points per pass). A configuration meets the budget on the search
windows only where the upper bound of its 95% interval does, as the held-out verdict asks. The
configurations evaluated are the curve of damage against the fraction of matmul weights quantized.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
from ptq.execution.streaming import LayerByLayer, LayerSlot, decoder_layers, is_streamed
from ptq.files import read_json, text_writer, write_set_atomic
from ptq.quantization import engines
from ptq.quantization.plan import Plan, resolve_plans
from ptq.quantization.recipes import Override, Recipe

SENSITIVITY = (
    "exact, one unit at a time: the mean KL (nats per token, vs the bf16 baseline) of the model "
    "with only that unit quantized, by each recipe, on the search windows; the steps from the "
    "first recipe to 16-bit ranked by that KL avoided per weight byte added"
)
CHUNK = 8  # configurations quantized and evaluated together (one baseline forward per chunk)
RANDOM_DRAWS = 3  # seeded draws of the random baseline
POINTS_PER_PASS = 3  # configurations evaluated per pass of the bisection
METRICS = {
    "kl": "mean KL (nats per token)",
    "ppl": "perplexity increase (%)",
    "acc": "next-token accuracy lost (% of the baseline's)",
}
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


@dataclass(frozen=True)
class Unit:
    """What the engine serves as one layer: kept in 16-bit or quantized as a whole."""

    name: str
    members: tuple[str, ...]  # the matmuls (names in the linearized model)
    params: int  # matmul weights
    patterns: tuple[str, ...]  # what a recipe's `ignore` list gets to keep the unit in 16-bit


def units_of(model: nn.Module, plan: Plan, served: bool | None = None) -> list[Unit]:
    """The units of the matmuls `plan` quantizes, in the model's order. Served as vLLM does (the
    default under --target vllm; always for a search of several recipes, whose overrides may not
    split what vLLM serves as one layer): a mixture-of-experts layer's experts are one unit, q/k/v
    one, gate/up one (engines.fused_groups); otherwise each matmul is its own unit."""
    served = plan.target == "vllm" if served is None else served
    quantized = [n for n, m in plan.matmuls.items() if m.quantized]
    owner: dict[str, str] = {}
    patterns: dict[str, tuple[str, ...]] = {}
    if served:
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
    if served:
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


KEEP = None  # a unit's level when it stays in 16-bit; otherwise the index of its recipe
Config = dict[str, int | None]  # unit name -> level; a unit not named takes the first recipe


def base_level(units: list[Unit], config: Config) -> int:
    """The recipe a configuration's recipe is built on: the cheapest one a unit takes (the first
    where every unit is kept in 16-bit), so that its own scheme is one the model uses."""
    return min((x for u in units if (x := config.get(u.name, 0)) is not KEEP), default=0)


def config_recipe(recipes: list[Recipe], units: list[Unit], config: Config, name: str) -> Recipe:
    """The configuration as a recipe: the recipe of base_level with the units `config` keeps in
    16-bit added to its ignore list, and one override per finer recipe giving that recipe's scheme
    to the units at its level (searched.yaml holds the same)."""
    first = base_level(units, config)
    base = recipes[first]
    kept = [p for u in units if u.name in config and config[u.name] is KEEP for p in u.patterns]
    overrides: list[Override] = []
    for level, r in enumerate(recipes[first + 1 :], first + 1):
        match = tuple(p for u in units if config.get(u.name, 0) == level for p in u.patterns)
        if match:
            overrides.append(
                Override(len(overrides) + 1, match, r.weights, r.inputs, scheme=r.name)
            )
    return dataclasses.replace(
        base, name=name, ignore=(*base.ignore, *kept), overrides=tuple(overrides)
    )


def damage(metric: str, s: Scores, base: Scores) -> float:
    """The budget's measure of one configuration's scores against the baseline's, same windows."""
    if metric == "kl":
        return s.kl_div
    if metric == "acc":
        return float(stats.loss_pct(s.correct, base.correct)) if base.correct else 0.0
    with np.errstate(over="ignore"):
        return float(100 * np.expm1((s.nll_sum - base.nll_sum) / s.tokens))


class Journal:
    """The scores of the configurations evaluated so far, kept in a file (`path`; None: none kept)
    so that an interrupted search resumes where it stopped. Each configuration's Scores (and each
    window set's baseline) by key (key_of), under a fingerprint of everything else the scores
    depend on (the model, the recipes, the calibration, the target and arithmetic); rewritten whole
    (atomically) after every chunk."""

    KIND = "ptq-search-state"

    def __init__(self, path: Path | None, fingerprint: str, resume: bool):
        self.path, self.fingerprint = path, fingerprint
        self.scores: dict[str, dict] = {}
        self.reused = 0  # configurations scored before (by this run, or the one resumed)
        if resume and path is not None:
            self.scores = self._read(path)

    def _read(self, path: Path) -> dict[str, dict]:
        data = read_json(path, "search state")
        if not isinstance(data, dict) or data.get("kind") != self.KIND:
            raise PtqError(f"{path} is not a ptq search state; use --force to start over")
        if data.get("fingerprint") != self.fingerprint:
            raise PtqError(
                f"{path} was left by a different search (model, recipes, calibration, data or "
                "compute options differ); rerun with the same options, or use --force to start "
                "over"
            )
        scores = data.get("scores", {})
        if not isinstance(scores, dict):
            raise PtqError(f"{path} is damaged; use --force to start over")
        return scores

    def get(self, key: str, count: bool = True) -> Scores | None:
        if key not in self.scores:
            return None
        try:
            scores = Scores(**self.scores[key])
        except TypeError:
            raise PtqError(f"{self.path} is damaged; use --force to start over") from None
        self.reused += count
        return scores

    def put(self, scores: dict[str, Scores]) -> None:
        self.scores |= {key: dataclasses.asdict(s) for key, s in scores.items()}
        if self.path is not None:
            body = {"kind": self.KIND, "fingerprint": self.fingerprint, "scores": self.scores}
            write_set_atomic({self.path: text_writer(json.dumps(body))})


def key_of(units: list[Unit], config: Config, windows: str) -> str:
    """A configuration's key in the journal: the windows' digest and every unit's level."""
    levels = (config.get(u.name, 0) for u in units)
    return windows + ":" + ",".join("16" if x is KEEP else str(x) for x in levels)


def windows_digest(input_ids: torch.Tensor) -> str:
    return hashlib.sha256(input_ids.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class Scorer:
    """Scores configurations of one model (each unit's level, by configuration name) with the
    baseline on given windows, CHUNK at a time; counts the forward passes (of one window), the
    evaluations (`chunks`: each one read of the checkpoint layer by layer) and the time spent.

    The model is quantized once per recipe and once more (quantize_variants): the baseline, every
    unit kept in 16-bit (config_recipe) and each recipe whole. A configuration is the second with
    the quantized layers of each unit's level swapped in from the recipe's whole copy (module
    references, no copy): the same QuantLinears, built the same way, that quantize_variants makes of
    the configuration's own recipe (config_recipe), so the same numbers (tests/test_search.py) at
    the cost of the forwards only. Of the whole copies only the swapped layers are held.

    A model loaded by ptq.execution.streaming.load_streamed (`--low-memory`) is scored layer by
    layer from disk instead (LayerByLayer with _ConfigurationParts), one chunk of configurations
    at a time: as each part of the model (the trunk, then each decoder layer) is read, it is
    quantized as above, restricted to that part (the plans' `within`, as compare does), and each
    configuration gets its own copy of the part with the same modules swapped in; nothing is kept
    between chunks, so each chunk reads the checkpoint and quantizes it anew. The same float32 ops
    run on the same batches in the same order as in memory: the scores are equal, number for number
    (tests/test_search_streaming.py)."""

    def __init__(
        self,
        model: nn.Module,
        baseline: Recipe,
        recipes: list[Recipe],
        units: list[Unit],
        calibration: Calibration | None,
        matmul: str,
        target: str,
        batch_size: int | None,
        journal: Journal | None = None,
    ):
        self.model, self.baseline, self.recipes, self.units = model, baseline, recipes, units
        self.calibration, self.matmul, self.target = calibration, matmul, target
        self.batch_size = batch_size
        self.journal = journal or Journal(None, "", resume=False)
        self.forwards, self.seconds, self.chunks = 0, 0.0, 0
        self._built: tuple[nn.Module, nn.Module, dict, list[dict]] | None = None
        self.streamed = is_streamed(model)
        self._plans: dict[str, Plan] | None = None

    def _variants(self) -> tuple[Recipe, list[Recipe]]:
        """The recipe of every unit in 16-bit (the working model's) and each recipe whole, under
        names of their own."""
        everything = dict.fromkeys((u.name for u in self.units), KEEP)
        kept = config_recipe(self.recipes, self.units, everything, "ptq-search:kept")
        wholes = [
            dataclasses.replace(r, name=f"ptq-search:{level}")
            for level, r in enumerate(self.recipes)
        ]
        return kept, wholes

    def _build(self) -> tuple[nn.Module, nn.Module, dict, list[dict]]:
        """The baseline, the working model (every unit in 16-bit), each unit's members in 16-bit by
        member name, and the same quantized by each recipe."""
        if self._built is None:
            kept, wholes = self._variants()
            models = quantize_variants(
                self.model, [self.baseline, kept, *wholes], self.calibration, self.matmul,
                self.target,
            )  # fmt: skip
            working = models[kept.name]
            members = [n for u in self.units for n in u.members]
            off = {n: working.get_submodule(n) for n in members}
            on = []
            for w in wholes:  # the rest of each whole copy is dropped
                quantized = models.pop(w.name)
                on.append({n: quantized.get_submodule(n) for n in members})
            self._built = (models[self.baseline.name], working, off, on)
        return self._built

    def score(
        self, configs: dict[str, Config], input_ids: torch.Tensor, what: str
    ) -> tuple[dict[str, Scores], Scores]:
        """Each configuration's scores by name, and the baseline's; those the journal holds are
        taken from it, the others evaluated and added to it chunk by chunk."""
        windows = windows_digest(input_ids)
        keys = {name: key_of(self.units, config, windows) for name, config in configs.items()}
        out = {name: s for name in configs if (s := self.journal.get(keys[name])) is not None}
        base = self.journal.get(f"{windows}:baseline", count=False)
        names = [name for name in configs if name not in out]
        if not names and base is not None:
            return out, base
        if not self.streamed:
            self._build()
        chunks = range(0, len(names), CHUNK)
        began_all = time.perf_counter()
        for i, start in enumerate(chunks):
            part = names[start : start + CHUNK]
            _progress(what, i, len(chunks), time.perf_counter() - began_all)
            began = time.perf_counter()
            run = self._executor({name: configs[name] for name in part})
            scores = evaluate(run, input_ids, self.batch_size)
            self.chunks += 1
            self.seconds += time.perf_counter() - began
            self.forwards += (len(part) + 1) * len(input_ids)
            base = scores[self.baseline.name]
            out |= {name: scores[name] for name in part}
            self.journal.put(
                {keys[name]: scores[name] for name in part} | {f"{windows}:baseline": base}
            )
        if base is None:  # no configuration: the baseline alone
            base = evaluate(self._executor({}), input_ids, self.batch_size)[self.baseline.name]
            self.forwards += len(input_ids)
            self.chunks += 1
        return out, base

    def _executor(self, configs: dict[str, Config]):
        """What evaluates the baseline and then `configs` (none: the baseline alone): in memory,
        Configurations over the model quantized once (_build); a streamed model layer by layer,
        from each configuration's first quantized decoder layer on (_ConfigurationParts)."""
        if self.streamed:
            if self._plans is None:
                kept, wholes = self._variants()
                recipes = [self.baseline, kept, *wholes]
                self._plans = resolve_plans(self.model, recipes, self.target)
            path = self.model.ptq_streamed.layers
            starts = {name: _first_layer(self.units, c, path) for name, c in configs.items()}
            parts = _ConfigurationParts(self, configs, starts, self._plans)
            return LayerByLayer(self.model, parts, [self.baseline.name, *configs], starts=starts)
        base_model, working, off, on = self._build()
        if not configs:
            return {self.baseline.name: base_model}
        swaps = {name: self._swaps(config, off, on) for name, config in configs.items()}
        try:
            path = decoder_layers(working)
        except PtqError:
            path = None
        starts = (
            {}
            if path is None
            else {name: _first_layer(self.units, c, path) for name, c in configs.items()}
        )
        return Configurations(self.baseline.name, base_model, working, swaps, path, starts)

    def _swaps(self, config: Config, off: dict, on: list[dict]) -> dict[str, nn.Module]:
        """Member name -> the module it runs as in `config`."""
        swaps = {}
        for u in self.units:
            level = config.get(u.name, 0)
            for n in u.members:
                swaps[n] = off[n] if level is KEEP else on[level][n]
        return swaps


def _first_layer(units: list[Unit], config: Config, layers: str) -> int:
    """The decoder layer of a configuration's first quantized unit (0 where one is outside the
    decoder layers, or none is quantized), as Configurations finds it."""
    quantized = [n for u in units if config.get(u.name, 0) is not KEEP for n in u.members]
    return min((_layer_index(n, layers) for n in quantized), default=0)


class _ConfigurationParts:
    """LayerByLayer's `parts` for one chunk of configurations of a streamed model (Scorer): each
    part, as it is read, quantized by quantize_variants as the whole model is in memory (the
    baseline, every unit in 16-bit, each recipe whole; the plans restricted to the part), but only
    by the recipes that some configuration running the part gives one of its units there. The
    baseline runs the baseline's part; a configuration (from its first quantized layer on: `starts`)
    the 16-bit copy itself where it keeps every unit of the part in 16-bit, else a copy of it (its
    modules, not their tensors) with the quantized modules of its units' levels swapped in."""

    def __init__(
        self, scorer: Scorer, configs: dict[str, Config], starts: dict[str, int], plans: dict
    ):
        self.scorer, self.configs, self.starts, self.plans = scorer, configs, starts, plans
        self.kept, self.wholes = scorer._variants()
        self.layers = scorer.model.ptq_streamed.layers

    def __call__(self, part: nn.Module) -> contextlib.AbstractContextManager[dict]:
        scorer, index = self.scorer, _part_layer(part, self.layers)
        running = [n for n in self.configs if index is None or self.starts[n] <= index]
        inside = {name for name, _ in part.named_modules()}
        here = [u for u in scorer.units if any(n in inside for n in u.members)]
        levels = {self.configs[n].get(u.name, 0) for n in running for u in here} - {KEEP}
        recipes = [scorer.baseline, *([self.kept] if running else [])]
        recipes += [self.wholes[level] for level in sorted(levels)]
        models = quantize_variants(
            part, recipes, scorer.calibration, scorer.matmul, scorer.target,
            {r.name: self.plans[r.name].within(part) for r in recipes},
        )  # fmt: skip
        out = {scorer.baseline.name: models[scorer.baseline.name]}
        for name in running:
            swaps = {
                n: models[self.wholes[level].name].get_submodule(n)
                for u in here
                if (level := self.configs[name].get(u.name, 0)) is not KEEP
                for n in u.members
            }
            out[name] = _swapped(models[self.kept.name], swaps) if swaps else models[self.kept.name]
        return contextlib.nullcontext(out)


def _part_layer(part: nn.Module, layers: str) -> int | None:
    """The decoder layer a part of a streamed model is (mounted at its path); None for the trunk,
    whose decoder layers are LayerSlots."""
    prefix = f"{layers}."
    for name, module in part.named_modules():
        head = name.removeprefix(prefix)
        if name.startswith(prefix) and head.isdigit():
            return None if isinstance(module, LayerSlot) else int(head)
    return None


def _swapped(model: nn.Module, swaps: dict[str, nn.Module]) -> nn.Module:
    """A copy of `model`'s modules over the same tensors (nothing copied), with the modules of
    `swaps` (name -> module) in place of its own."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    out = copy.deepcopy(model, memo=tensors)
    for name, module in swaps.items():
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, module)
    return out


def _progress(what: str, done: int, total: int, seconds: float) -> None:
    """`what: chunk i of n`, with the time left estimated from the chunks done."""
    if progress.QUIET:
        return
    left = "" if not done else f", about {_duration(seconds / done * (total - done))} left"
    progress.stderr.print(f"{what}: {done + 1} of {total}{left}", highlight=False)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
        path: str | None,
        starts: dict[str, int],
    ):
        """`path`: the decoder layers' (None: none found, nothing reused); `starts`: each
        configuration's first quantized decoder layer (_first_layer)."""
        super().__init__({baseline: base_model} | dict.fromkeys(swaps, working))
        self.swaps = swaps
        self.slots = {
            n: (working.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
            for layers in swaps.values()
            for n in layers
        }
        self.layers = self.base_layers = None
        self.first = {name: j for name, j in starts.items() if j > 0}
        if path is not None:
            self.layers = working.get_submodule(path)
            self.base_layers = base_model.get_submodule(path)

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


def sensitivity(
    scorer: Scorer, units: list[Unit], input_ids: torch.Tensor
) -> dict[str, list[float]]:
    """Each unit's KL with only it quantized (SENSITIVITY): unit name -> one KL per recipe."""
    levels = range(len(scorer.recipes))
    everything = dict.fromkeys((u.name for u in units), KEEP)
    configs = {f"only:{j}:{u.name}": everything | {u.name: j} for u in units for j in levels}
    scores, _ = scorer.score(configs, input_ids, "sensitivity (one unit at a time)")
    return {u.name: [scores[f"only:{j}:{u.name}"].kl_div for j in levels] for u in units}


Step = tuple[str, int | None]  # a unit (by name) and the level it moves to


def ladder(units: list[Unit], recipes: list[Recipe], sens: dict[str, list[float]]) -> list[Step]:
    """The steps from every unit at the first recipe to every unit in 16-bit, in the order the
    selection takes them: most damage avoided (a unit's sensitivity at its level, less that at the
    next) per weight byte added first; a step that adds no byte (a finer scheme of the same width)
    before any that does, most damage avoided first. From each level a unit takes the best such step
    (a finer scheme that does no better is skipped), and a unit's steps keep their order. With one
    recipe: the units by sensitivity per matmul weight, most first (ties: model order)."""
    widths = [r.weights.format.bits for r in recipes] + [16]
    levels: list[int | None] = [*range(len(recipes)), KEEP]
    keyed = []
    for index, u in enumerate(units):
        dmg = [*sens[u.name], 0.0]
        at, last = 0, None
        while at < len(levels) - 1:
            options = []
            for nxt in range(at + 1, len(levels)):
                avoided = dmg[at] - dmg[nxt]
                if avoided <= 0 and nxt < len(levels) - 1:
                    continue
                added = (widths[nxt] - widths[at]) * u.params / 8
                options.append(((added > 0, -avoided / added if added > 0 else -avoided), nxt))
            key, at = min(options)
            last = key if last is None else max(key, last)
            keyed.append((last, index, len(keyed), (u.name, levels[at])))
    return [step for *_, step in sorted(keyed)]


def configuration(steps: list[Step], k: int) -> Config:
    """The configuration after the first k steps."""
    return dict(steps[:k])


def select(
    scorer: Scorer,
    steps: list[Step],
    input_ids: torch.Tensor,
    metric: str,
    budget: float,
    fraction: Callable[[Config], float],
    what: str = "selection",
) -> tuple[int, list[dict]]:
    """The smallest k such that the first k steps meet `budget` on the search windows (the upper
    bound of the 95% interval within it; the estimate itself where there are too few windows for an
    interval), by bisection over k with each candidate evaluated end to end; and the curve of the
    configurations evaluated."""
    n = len(steps)
    end = configuration(steps, n)
    points: dict[int, dict] = {
        n: {"steps": n, "damage": 0.0, "ci": [0.0, 0.0], "kl": 0.0, "ppl_increase": 0.0}
        | {"meets": True, "evaluated": False}
    }

    def run(ks: list[int]) -> None:
        ks = sorted(set(ks) - set(points))
        configs = {f"steps:{k}": configuration(steps, k) for k in ks}
        scores, base = scorer.score(configs, input_ids, f"{what}: {len(ks)} configuration(s)")
        for k in ks:
            v = verdict(metric, budget, scores[f"steps:{k}"], base)
            upper = v["value"] if math.isnan(v["ci"][1]) else v["ci"][1]
            points[k] = {"steps": k, "damage": v["value"], "ci": v["ci"], "kl": v["kl"]} | {
                "ppl_increase": v["ppl_increase"],
                "meets": bool(upper <= budget),
                "evaluated": True,
            }

    run([0, n // 8, n // 4, n // 2])
    while True:
        hi = min(k for k, p in points.items() if p["meets"])
        below = [k for k in points if k < hi]
        if not below or hi - max(below) <= 1:
            break
        lo = max(below)
        step = (hi - lo) / (POINTS_PER_PASS + 1)
        run([lo + max(1, round(step * (i + 1))) for i in range(POINTS_PER_PASS) if lo + 1 < hi])
    curve = []
    for k, p in sorted(points.items()):
        config = configuration(steps, k)
        kept = sum(1 for u in end if config.get(u, 0) is KEEP)
        curve.append(p | {"kept": kept, "fraction_quantized": fraction(config)})
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
    elif metric == "acc":
        d = stats.paired_delta(base.window_correct, s.window_correct, stats.loss_pct)
        value, ci = d["delta"], d["ci"]
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


def labels(recipes: list[Recipe], units: list[Unit], config: Config) -> dict[str, str]:
    """The units `config` does not leave at the first recipe: unit name -> "16-bit" or the name of
    the recipe it takes."""
    out = {}
    for u in units:
        level = config.get(u.name, 0)
        if level != 0:
            out[u.name] = "16-bit" if level is KEEP else recipes[level].name
    return out


def alike(order: list[Unit], config: Config, levels: int) -> Config:
    """A configuration with as many units at each level as `config`, given to the units of `order`
    in turn: 16-bit first, then the finer recipes, the last first."""
    given = sorted(
        (config.get(u.name, 0) for u in order), key=lambda x: -levels if x is KEEP else -x
    )
    return {u.name: level for u, level in zip(order, given)}


def held_out(
    scorer: Scorer,
    units: list[Unit],
    chosen: Config,
    others: dict[str, Config],
    amax: dict[str, float] | None,
    input_ids: torch.Tensor,
    metric: str,
    budget: float,
    seed: int,
) -> tuple[dict, list[dict]]:
    """The chosen configuration's verdict on the held-out windows, and the baselines' (each recipe
    whole; as many units at each level chosen by largest input amax, and at random in
    RANDOM_DRAWS seeded draws; `others`), all evaluated together on those windows."""
    recipes = scorer.recipes
    configs = {"searched": chosen}
    configs |= {f"recipe:{r.name}": dict.fromkeys((u.name for u in units), j)
                for j, r in enumerate(recipes)}  # fmt: skip
    if len({chosen.get(u.name, 0) for u in units}) > 1:
        if amax is not None and len(amax) == len(units):
            by_amax = sorted(units, key=lambda u: -amax[u.name])
            configs["amax"] = alike(by_amax, chosen, len(recipes))
        for draw in range(RANDOM_DRAWS):
            drawn = random.Random(seed + draw).sample(units, len(units))
            configs[f"random:{draw}"] = alike(drawn, chosen, len(recipes))
    configs |= others
    scores, base = scorer.score(configs, input_ids, "held-out verification")
    results = {}
    for name, config in configs.items():
        changed = labels(recipes, units, config)
        kept = sorted(u for u, label in changed.items() if label == "16-bit")
        results[name] = verdict(metric, budget, scores[name], base) | {
            "kept": kept,
            "count": len(kept),
            "config": changed,
        }
    baselines = [{"name": name} | r for name, r in results.items() if name != "searched"]
    return results["searched"], baselines


def closest(verdict: dict, baselines: list[dict]) -> dict | None:
    """When the searched configuration misses the budget on the held-out windows: of the
    configurations evaluated there, the one whose interval's upper bound came nearest to the budget
    (the searched one itself included; baselines that give every unit the searched one's level are
    the same configuration and not counted again), with `only` true where the searched
    configuration was the only one verified. None when it meets the budget."""
    if verdict["meets"]:
        return None
    searched = {"name": "searched"} | verdict
    others = [b for b in baselines if "ci" in b and b["config"] != verdict["config"]]
    verified = [x for x in [searched, *others] if not math.isnan(x["ci"][1])]
    if not verified:
        return {"name": None, "only": not others, "verified": 0}
    best = min(verified, key=lambda x: x["ci"][1])
    return {
        "name": best["name"],
        "count": best["count"],
        "kept": best["kept"],
        "config": best["config"],
        "value": best["value"],
        "ci": best["ci"],
        "meets": best["meets"],
        "miss": best["miss"],
        "only": not others,
        "verified": len(verified),
    }
