"""The plan: what one recipe does to one model, resolved once.

For every matmul (Linear, Conv1D, each expert's projections: ptq.models.matmuls), every attention
input and KV-cache tensor, and every residual-add input, the plan says whether it is quantized, how
(a TensorQuant for its weight and one for its input), and if not, why. Calibration (which tensors
need a static scale), quantize_, coverage, `ptq inspect`, layer statistics and export read the plan;
none of them decides again.

Reasons a matmul is left in the compute dtype (16-bit in every variant, as in the baseline):
    - its kind is not among the recipe's targets (e.g. Experts for SmoothQuant);
    - its name matches the recipe's `ignore` patterns, or no `include` pattern;
    - its shape: the reduction dimension is not a multiple of the recipe's group size (per-group
      scales along the input: MX's 32, the block scheme's 1 x 128 input groups). vLLM's
      per-token-group quantization and compressed-tensors' group quantization both require whole
      groups, so such a layer could not run as simulated; partial 128 x 128 weight *tiles* (rows or
      columns) are fine: their scales are laid out by ceil division, as compressed-tensors and vLLM
      do.
Weights that multiply activations but are not matmuls ptq quantizes (routers, unknown layouts) are
listed by ptq.models.matmuls.unsupported and appear in the coverage with their own reason. So do the
attention inputs and KV-cache tensors an attention or KV-cache recipe asks for and leaves out: by
its ignore patterns, or because the layer computes attention in its own code
(attention.other_attention), where ptq cannot reach them.

The plan is resolved for a target engine (ptq.quantization.engines): under vllm it says which layers
share one weight scale or one input scale (vLLM's fused q/k/v and gate/up, its fused experts) and
that int8 inputs round over [-128, 127]; quantize_ and export compute those shared scales from the
amaxes, and decide nothing again.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import LeftOut, LinearExperts, kind, natural_key, quantizable, unsupported
from ptq.numerics.granularity import PerBlock, PerGroup, PerHead
from ptq.quantization import attention, engines, residual
from ptq.quantization.recipes import BASELINE_LINEAR, Recipe, TensorQuant


@dataclass(frozen=True)
class MatmulPlan:
    """One matmul: its (weights, inputs) quantization, or BASELINE_LINEAR for both and the reason it
    is left out."""

    name: str
    kind: str  # Linear, Conv1D, Experts (ptq.models.matmuls.kind)
    params: int
    weights: TensorQuant
    inputs: TensorQuant
    reason: str | None = None  # None: quantized as the recipe says
    smooth: bool = False  # SmoothQuant rescales its input channels (needs per-channel input maxima)
    # the layers the target engine makes share one per-tensor weight scale / one static input scale
    # with it (itself included; empty: its own scales)
    weight_group: tuple[str, ...] = ()
    input_group: tuple[str, ...] = ()
    # which of the recipe's schemes it gets (Recipe.schemes: 0, the recipe's own, or an override's)
    scheme: int = 0

    @property
    def quantized(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    matmuls: dict[str, MatmulPlan]
    # layer -> {tensor: how}; KV cache as "kv_cache.key" / ".value"
    attention: dict[str, dict[str, TensorQuant]]
    residual: dict[str, dict[str, TensorQuant]]  # decoder block -> {tensor: how}
    # weights no recipe can quantize (routers, ...)
    unsupported: list[LeftOut] = field(default_factory=list)
    # every attention layer and decoder block, quantized or not (rows)
    attention_layers: tuple[str, ...] = ()
    residual_blocks: tuple[str, ...] = ()
    # the engine whose load-time rules the plan applies (ptq.quantization.engines)
    target: str = "transformers"
    # with an attention or KV-cache recipe: attention layers ptq cannot quantize
    # (attention.other_attention)
    other_attention: dict[str, str] = field(default_factory=dict)

    @property
    def quantized(self) -> list[str]:
        return [name for name, m in self.matmuls.items() if m.quantized]

    def within(self, part: nn.Module) -> Plan:
        """The plan of the entries that are in `part`: one part of the model (its trunk, or one
        decoder layer) with its modules under their names in the whole model, as the layer-by-layer
        executor runs it (ptq.execution.streaming). A fused group is whole within one decoder
        layer."""
        names = {name for name, _ in part.named_modules()}
        return dataclasses.replace(
            self,
            matmuls={n: m for n, m in self.matmuls.items() if n in names},
            attention={n: t for n, t in self.attention.items() if n in names},
            residual={n: t for n, t in self.residual.items() if n in names},
        )

    @property
    def left_out(self) -> list[str]:
        return [name for name, m in self.matmuls.items() if not m.quantized]

    def quantizes_nothing(self) -> str | None:
        """Why a recipe that quantizes (8-bit weights or inputs, attention, KV cache, residual adds)
        rounds nothing of this model to 8 bits ("12 layers left out by the recipe (...)"), or None
        where it rounds something (or is the 16-bit baseline). Such a variant measures the 16-bit
        model under the recipe's name: a typo in `include` would pass every gate."""
        r = self.recipe
        quantizing = (
            any(s.weights.format.scaled or s.inputs.format.scaled for s in r.schemes)
            or r.attention
            or r.kv_cache
            or r.residual
        )
        eight_bit = any(
            m.quantized and (m.weights.format.scaled or m.inputs.format.scaled)
            for m in self.matmuls.values()
        )
        if not quantizing or eight_bit or self.attention or self.residual:
            return None
        return self.left_out_reasons()

    def left_out_reasons(self) -> str:
        """What the plan leaves out, counted by reason: "12 layers left out by the recipe (...); 1
        layer ..."."""
        reasons = collections.Counter(x["reason"] for x in self.coverage()["left_out"])
        return "; ".join(
            f"{n} {'layer' if n == 1 else 'layers'} {reason}" for reason, n in reasons.items()
        ) or ("no matmul")

    @property
    def smoothed(self) -> list[str]:
        """Matmuls whose input SmoothQuant rescales (they need per-channel input amax from
        calibration)."""
        return [name for name, m in self.matmuls.items() if m.smooth]

    @property
    def per_head(self) -> list[str]:
        """KV-cache tensors with per-head scales: their calibration records the amax of each
        head."""
        return sorted(
            {
                calibration_key(layer, t)
                for layer, tensors in self.attention.items()
                for t, spec in tensors.items()
                if isinstance(spec.granularity, PerHead)
            }
        )

    @property
    def calibrated(self) -> list[str]:
        """Tensors whose static scale must come from calibration: matmul names, "<attention
        layer>.<tensor>" (K and V shared by attention and the KV cache) and
        "<block>.residual.<tensor>"."""
        names = [name for name, m in self.matmuls.items() if m.quantized and m.inputs.static]
        names += sorted(
            {
                calibration_key(layer, t)
                for layer, tensors in self.attention.items()
                for t, spec in tensors.items()
                if spec.static
            }
        )
        names += [
            f"{block}.residual.{t}"
            for block, tensors in self.residual.items()
            for t, spec in tensors.items()
            if spec.static
        ]
        return names

    def attention_left_out(self) -> list[dict]:
        """The attention inputs and KV-cache tensors the recipe asks for that stay in the compute
        dtype, and why: [{"name", "reason"}], a layer's tensors by name ("<layer>.kv_cache.key"), an
        unsupported layer whole."""
        asked = (
            [f"kv_cache.{t}" for t in ("key", "value")] if self.recipe.kv_cache is not None else []
        )
        asked += list(self.recipe.attention_tensors) if self.recipe.attention is not None else []
        left = [
            {
                "name": f"{layer}.{t}",
                "reason": _why_not_selected(f"{layer}.{t.removeprefix('kv_cache.')}", self.recipe),
            }
            for layer in self.attention_layers
            for t in asked
            if t not in self.attention.get(layer, {})
        ]
        return left + [
            {
                "name": layer,
                "reason": f"not supported: {cls} computes attention in its own code, not "
                "through transformers' attention interface, where ptq quantizes attention inputs "
                "and the KV cache",
            }
            for layer, cls in self.other_attention.items()
        ]

    def coverage(self) -> dict:
        """How much of the model's matmul weights the recipe quantizes: {"quantized_weight_params",
        "matmul_weight_params", "left_out": [{"name", "params", "reason"}], "attention_left_out"},
        where matmul weights are every weight that multiplies activations (Linear, Conv1D, experts,
        lm_head, routers; not embedding look-ups), `left_out` names what stays in the compute dtype
        and why, largest first (then in block order), and `attention_left_out` the attention inputs
        and KV-cache tensors the recipe asks for that stay there."""
        left = [
            LeftOut(m.name, m.params, m.reason) for m in self.matmuls.values() if not m.quantized
        ]
        left = sorted([*left, *self.unsupported], key=lambda x: (-x.params, natural_key(x.name)))
        return {
            "quantized_weight_params": sum(m.params for m in self.matmuls.values() if m.quantized),
            "matmul_weight_params": sum(m.params for m in self.matmuls.values())
            + sum(x.params for x in self.unsupported),
            "left_out": [{"name": x.name, "params": x.params, "reason": x.reason} for x in left],
            "attention_left_out": self.attention_left_out(),
        }

    def scheme_name(self, m: MatmulPlan) -> str:
        """The name of the scheme a matmul gets: the recipe's, an override's scheme (its recipe's
        name, or "<recipe> override N"), or "bf16" where it is left out."""
        return self.recipe.schemes[m.scheme].name if m.quantized else "bf16"

    def rows(self) -> list[dict]:
        """One row per quantizable tensor: what the recipe does to it (for `ptq inspect` and
        reports)."""
        rows = [
            {
                "name": m.name,
                "kind": "linear",
                "quantized": m.quantized,
                "weights": m.weights.describe(),
                "inputs": m.inputs.describe(),
                "reason": m.reason,
                "smoothquant": self.recipe.smoothquant if m.smooth else None,
                **({"scheme": self.scheme_name(m)} if self.recipe.overrides else {}),
            }
            for m in self.matmuls.values()
        ]
        left = {x["name"]: x["reason"] for x in self.attention_left_out()}
        for layer in (*self.attention_layers, *self.other_attention):
            for tensor in ("kv_cache.key", "kv_cache.value", *attention.TENSORS):
                spec = self.attention.get(layer, {}).get(tensor)
                rows.append(
                    {
                        "name": f"{layer}.{tensor}",
                        "kind": "attention",
                        "quantized": spec is not None,
                        "weights": None,
                        "inputs": spec.describe() if spec else "fp32",
                        "reason": left.get(f"{layer}.{tensor}", left.get(layer)),
                        "smoothquant": None,
                    }
                )
        for block in self.residual_blocks:
            for tensor in residual.TENSORS:
                spec = self.residual.get(block, {}).get(tensor)
                rows.append(
                    {
                        "name": f"{block}.residual.{tensor}",
                        "kind": "residual",
                        "quantized": spec is not None,
                        "weights": None,
                        "inputs": spec.describe() if spec else "fp32",
                        "reason": None,
                        "smoothquant": None,
                    }
                )
        return rows


def calibration_key(layer: str, tensor: str) -> str:
    """KV-cache quantizers share the statistics of the K and V they quantize."""
    return f"{layer}.{tensor.removeprefix('kv_cache.')}"


def _why_not_selected(name: str, recipe: Recipe) -> str:
    ignored = [p for p in recipe.ignore if fnmatch.fnmatchcase(name, p)]
    return (
        f"left out by the recipe (ignore: {', '.join(ignored)})"
        if ignored
        else "left out by the recipe (not matched by its include patterns)"
    )


def _why_not_targeted(name: str, module: nn.Module, recipe: Recipe) -> str | None:
    k = kind(module)
    if k not in recipe.targets:
        article = "an" if k[0] in "AEIOU" else "a"
        return (
            f"left out by the recipe ({article} {k} layer; it targets {', '.join(recipe.targets)})"
        )
    if not recipe.selects(name):
        return _why_not_selected(name, recipe)
    return None


def _why_left_out(name: str, module: nn.Module, recipe: Recipe) -> str | None:
    """Why the matmul `name` stays in the compute dtype under `recipe` (one of its schemes: the
    override's bf16 is decided by resolve_plan), or None."""
    if reason := _why_not_targeted(name, module, recipe):
        return reason
    for role, spec in (("weight", recipe.weights), ("input", recipe.inputs)):
        g = spec.granularity
        if isinstance(g, PerGroup) and module.in_features % g.size:
            return (
                f"shape: in_features {module.in_features} is not a multiple of the {role} group of "
                f"{g.size} (vLLM and compressed-tensors quantize whole groups)"
            )
        if isinstance(g, PerBlock) and module.in_features % g.cols:
            return (
                f"shape: in_features {module.in_features} is not a multiple of the weight block's "
                f"{g.cols} columns (vLLM's block kernels and compressed-tensors need whole blocks "
                "along the input; partial rows are fine)"
            )
    return None


def _leave_out_unblockable_fused(model: nn.Module, matmuls: dict[str, MatmulPlan]) -> None:
    """In place: vLLM loads q/k/v and gate/up into one merged layer (engines.fused_groups) and
    refuses block weights there unless every part but the last is whole blocks of `rows` rows
    (fp8_utils.validate_fp8_block_shape: "Weight output_partition_size = ... is not divisible by
    weight quantization block_n"); such a group is left out whole (a part alone would be refused
    too). Experts are left to FusedMoE's rule (down_proj's in_features, the same size)."""
    modules = dict(model.named_modules())
    experts = {path for path, m in modules.items() if isinstance(m, LinearExperts)}
    for group in engines.fused_groups(model):
        if group[0].rpartition(".")[0].rpartition(".")[0] in experts:
            continue
        blocks = [
            matmuls[n].weights.granularity
            for n in group
            if matmuls[n].quantized and isinstance(matmuls[n].weights.granularity, PerBlock)
        ]
        if not blocks:
            continue
        rows = blocks[0].rows
        bad = [n for n in group[:-1] if modules[n].out_features % rows]
        if not bad or not any(matmuls[n].quantized for n in group):
            continue
        short = [n.rpartition(".")[2] for n in group]
        reason = (
            f"shape: vLLM runs {'/'.join(short)} as one layer, whose parts but the last must be "
            f"whole {rows}-row weight blocks ({short[group.index(bad[0])]} has "
            f"{modules[bad[0]].out_features} output rows); it refuses the checkpoint otherwise"
        )
        for n in group:
            if matmuls[n].quantized:
                matmuls[n] = dataclasses.replace(
                    matmuls[n],
                    weights=BASELINE_LINEAR,
                    inputs=BASELINE_LINEAR,
                    reason=reason,
                    smooth=False,
                )


def _matmul_plans(
    model: nn.Module,
    recipe: Recipe,
    target: str,
    int8_range: str | None,
    reciprocal: bool | None,
) -> dict[str, MatmulPlan]:
    """Each matmul's plan under `recipe`: the scheme of the first override that matches it, or the
    recipe's own; bf16 where an override keeps it so, or where the recipe leaves it out (and why).
    Refuses an override pattern that matches no matmul the recipe selects, and an override that
    splits one of the groups the engine serves as one layer (check_served_together)."""
    matmuls, schemes = {}, recipe.schemes
    used: set[int] = set()
    for name, module in model.named_modules():
        if not quantizable(module):
            continue
        override = recipe.override_for(name) if recipe.overrides else None
        if override is not None and _why_not_targeted(name, module, recipe) is None:
            used.add(override.number)
        index = recipe.scheme_index(override)
        scheme = schemes[index]
        reason = _why_left_out(name, module, scheme)
        if reason is None and override is not None and override.keep:
            reason = f"kept in bf16 by the recipe's {override.describe()}"
        weights, inputs = (scheme.weights, scheme.inputs)
        if reason is not None:
            weights, inputs = BASELINE_LINEAR, BASELINE_LINEAR
        smooth = reason is None and recipe.smoothquant is not None
        if reason is None:
            inputs = engines.served_inputs(inputs, target, int8_range, reciprocal)
        matmuls[name] = MatmulPlan(
            name,
            getattr(module, "ptq_kind", kind(module)),
            module.weight.numel(),
            weights,
            inputs,
            reason,
            smooth,
            scheme=index,
        )
    for i, scheme in enumerate(schemes):
        check_granules(
            model, scheme, [n for n, m in matmuls.items() if m.quantized and m.scheme == i]
        )
    if recipe.overrides:
        _check_overrides(model, recipe, matmuls, used)
    return matmuls


def _check_overrides(
    model: nn.Module, recipe: Recipe, matmuls: dict[str, MatmulPlan], used: set[int]
) -> None:
    """Refuse an override pattern that matches no matmul the recipe selects, an override every
    layer of which an earlier one takes (first match wins), and a group the engine serves as one
    layer (q/k/v, gate/up, an experts module) whose parts would get different schemes."""
    modules = dict(model.named_modules())
    selected = [n for n in matmuls if _why_not_targeted(n, modules[n], recipe) is None]
    for o in recipe.overrides:
        for pattern in o.match:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in selected):
                raise PtqError(
                    f"recipe '{recipe.name}': {o.describe()}: '{pattern}' matches no layer of "
                    f"this {type(model).__name__} that the recipe quantizes (its targets, include "
                    "and ignore select them)"
                )
        if o.number not in used:
            raise PtqError(
                f"recipe '{recipe.name}': {o.describe()} takes no layer: earlier overrides match "
                "all of its layers first (the first override that matches a layer wins)"
            )
    for group in engines.served_together(model):
        if not any(recipe.override_for(n) for n in group):
            continue
        how = {
            n: (matmuls[n].weights, matmuls[n].inputs) if matmuls[n].quantized else None
            for n in group
        }
        if len(set(how.values())) > 1:
            a, b = group[0], next(n for n in group if how[n] != how[group[0]])
            short = "/".join(dict.fromkeys(n.rpartition(".")[2] for n in group))
            raise PtqError(
                f"recipe '{recipe.name}': its overrides give '{a}' "
                f"{_scheme_words(matmuls[a])} but '{b}' {_scheme_words(matmuls[b])}, and vLLM "
                f"serves {short} as one layer: match all of them or none"
            )


def _scheme_words(m: MatmulPlan) -> str:
    if not m.quantized:
        return "bf16"
    return f"{m.weights.describe()} weights, {m.inputs.describe()} inputs"


def resolve_plan(
    model: nn.Module,
    recipe: Recipe,
    target: str = "transformers",
    int8_range: str | None = None,
    reciprocal: bool | None = None,
) -> Plan:
    """The plan of `recipe` for a linearized `model` (ptq.models.matmuls.linearize), before
    quantization, as `target` serves it: its inputs as the engine rounds them
    (engines.served_inputs; `int8_range`, "symmetric" [-127, 127] or "full" [-128, 127], and
    `reciprocal`: how int8 inputs round and static FP8 inputs are scaled when not as the target
    does, for the loader of the export's reload check)."""
    matmuls = _matmul_plans(model, recipe, target, int8_range, reciprocal)
    if engines.check_target(target) == "vllm":
        _leave_out_unblockable_fused(model, matmuls)
    targeted = {name for name, m in matmuls.items() if m.quantized}
    static_inputs = {
        name for name in targeted if matmuls[name].inputs.static and not matmuls[name].smooth
    }
    schemes = {n: (m.weights, m.inputs) for n, m in matmuls.items()}
    groups = engines.engine_groups(model, schemes, target, static_inputs, targeted)
    for name in groups.weight.keys() | groups.input.keys():
        matmuls[name] = dataclasses.replace(
            matmuls[name],
            weight_group=groups.weight.get(name, ()),
            input_group=groups.input.get(name, ()),
        )
    layers = attention.attention_modules(model)
    attention_plan = {}
    for name in layers:
        tensors = {}
        if recipe.kv_cache is not None:
            tensors |= {
                f"kv_cache.{t}": recipe.kv_cache
                for t in ("key", "value")
                if recipe.selects(f"{name}.{t}")
            }
        if recipe.attention is not None:
            tensors |= {
                t: recipe.attention
                for t in recipe.attention_tensors
                if recipe.selects(f"{name}.{t}")
            }
        if tensors:
            attention_plan[name] = tensors
    blocks = residual.residual_blocks(model)
    residual_plan = {}
    if recipe.residual is not None:
        for name in blocks:
            tensors = {
                t: recipe.residual
                for t in residual.TENSORS
                if recipe.selects(f"{name}.residual.{t}")
            }
            if tensors:
                residual_plan[name] = tensors
    beyond = recipe.kv_cache is not None or recipe.attention is not None
    return Plan(
        recipe,
        matmuls,
        attention_plan,
        residual_plan,
        unsupported(model),
        tuple(layers),
        tuple(blocks),
        target,
        attention.other_attention(model) if beyond else {},
    )


# A block pads a weight up to a multiple of its rows (ptq.numerics.granularity.grouped; a group
# or a block's columns must divide the width, or the layer is left out: _why_left_out): more than
# PAD_FACTOR times the weight's own elements, and more than PAD_FLOOR elements (a 128x128 block on a
# tiny model's 32-row projection pads 4x, 16k elements: fine), is refused.
PAD_FACTOR = 16
PAD_FLOOR = 2**24


def check_granules(model: nn.Module, recipe: Recipe, quantized: list[str]) -> None:
    """Refuse the recipe's group or block size where it meets the tensors of `model`: larger than
    every dimension of the model's tensors (no tensor can have it), or padding a weight it quantizes
    (`quantized`, the matmuls' names) to many times its size. One line before anything is
    allocated, for every command (inspect too)."""
    roles = [
        (role, spec.granularity)
        for role, spec in (("weights", recipe.weights), ("inputs", recipe.inputs))
        if isinstance(spec.granularity, (PerGroup, PerBlock))
    ]
    if not roles:
        return
    largest = max((d for p in model.parameters() for d in p.shape), default=0)
    modules = dict(model.named_modules())
    for role, g in roles:
        sides = (g.size,) if isinstance(g, PerGroup) else (g.rows, g.cols)
        where = f"recipe '{recipe.name}': {role} {g.describe()}"
        if max(sides) > largest:
            raise PtqError(
                f"{where} is larger than every dimension of the model's tensors (the largest: "
                f"{largest}): no tensor of this model can have it"
            )
        if role != "weights":
            continue
        for name in quantized:
            out, inp = modules[name].weight.shape
            cols = -(-inp // sides[-1]) * sides[-1]
            rows = -(-out // g.rows) * g.rows if isinstance(g, PerBlock) else out
            if rows * cols > PAD_FACTOR * out * inp and rows * cols > PAD_FLOOR:
                raise PtqError(
                    f"{where} pads the weight of layer '{name}' ([{out}, {inp}]) to "
                    f"[{rows}, {cols}], {rows * cols / (out * inp):,.0f} times its size: use a "
                    "block size closer to the model's dimensions"
                )


def resolve_plans(
    model: nn.Module, recipes: list[Recipe], target: str = "transformers"
) -> dict[str, Plan]:
    """Each recipe's plan (resolve_plan), by recipe name: what a command resolves once and hands to
    every step."""
    return {r.name: resolve_plan(model, r, target) for r in recipes}


def calibration_targets(plans: Iterable[Plan]) -> tuple[list[str], list[str]]:
    """What calibrating for the recipes of `plans` observes: (every tensor that needs a static scale
    or per-channel maxima, the tensors that need per-channel maxima: SmoothQuant's matmul inputs,
    per-head KV-cache K and V)."""
    plans = list(plans)
    channels = sorted({name for p in plans for name in (*p.smoothed, *p.per_head)})
    layers = sorted({name for p in plans for name in p.calibrated} | set(channels))
    return layers, channels


def calibrated_layers(model: nn.Module, recipe: Recipe) -> list[str]:
    """The tensors calibration must observe for one recipe (its plan's `calibrated`)."""
    return resolve_plan(model, recipe).calibrated
