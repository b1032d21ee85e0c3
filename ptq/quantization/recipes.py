"""Recipes: one declarative description of what is quantized and how (YAML in recipes/), validated.

A recipe names the modules it targets (by type), the ones it leaves out (by name pattern), and one
`TensorQuant` for the weights and one for the inputs of every targeted layer: the vocabulary of
compressed-tensors' QuantizationArgs (format, granularity, static or dynamic, the scale's own
format, the observer of static scales), validated here so that a combination that makes no sense is
refused when the recipe is read. Linear layers a recipe leaves out run as in the 16-bit baseline
(bf16 weights and inputs), so that a variant differs from the baseline only where the recipe says.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import reprlib
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ptq.errors import PtqError, name_problem
from ptq.files import read_yaml
from ptq.models.matmuls import KINDS, kind
from ptq.numerics.formats import NumberFormat, get_format
from ptq.numerics.granularity import (
    Granularity,
    PerBlock,
    PerChannel,
    PerGroup,
    PerHead,
    PerTensor,
    PerToken,
)

# YAML names of ptq.numerics.granularity
GRANULARITIES = (
    "tensor",
    "channel",
    "token",
    "group",
    "block",
    "head",
)
# `--recipes NAME+kv` / `NAME+kv-head`: any FP8 recipe with an E4M3 KV cache, static per-tensor or
# per-head K/V scales (vLLM's kv_cache_dtype=fp8 with compressed-tensors' kv_cache_scheme, strategy
# tensor or attn_head)
KV_CACHE_OPTIONS = {"kv": "tensor", "kv-head": "head"}
# a scale's own format: float32, or an MX power of two (one byte on disk)
SCALE_FORMATS = (
    "fp32",
    "e8m0",
)
# the kinds of matmul (ptq.models.matmuls): Linear, Conv1D (GPT-2), Experts (fused MoE experts)
TARGET_TYPES = KINDS
# The largest group or block side a recipe may give, whatever the model (2^20: no matmul of any
# model has a dimension that large, the largest vocabularies are about 2^18). Against the model's
# own tensors, when the plan is resolved: ptq.quantization.plan.check_granules.
MAX_GRANULE = 2**20
OBSERVERS = ("max", "percentile", "mse", "entropy", "best")  # see ptq/calibration/observers.py
# amax / format max; rounded up to a power of two; 1 (plain cast)
SCALE_MODES = (
    "amax",
    "pow2",
    "unscaled",
)
# inputs of attention's batched matmuls Q.K^T and P.V
ATTENTION_TENSORS = (
    "query",
    "key",
    "value",
    "probs",
)


@dataclass(frozen=True)
class TensorQuant:
    """How one tensor is quantized (the idea of compressed-tensors' QuantizationArgs)."""

    format: NumberFormat
    # which elements share a scale (ptq.numerics.granularity)
    granularity: Granularity = PerTensor()
    saturate: bool = True  # out-of-range values clamp to the format's max (False: NaN / inf)
    observer: str = "max"  # how a static activation scale is calibrated (OBSERVERS)
    percentile: float = 99.99  # for observer: percentile
    dynamic: bool = (
        False  # activations: scales computed on the fly from each token / group (no calibration)
    )
    scale: str = (
        "amax"  # SCALE_MODES: "pow2" is a per-tensor exponent bias, "unscaled" casts with scale 1
    )
    scale_format: str = (
        "fp32"  # SCALE_FORMATS: "e8m0" is the MX power-of-two scale (granularity.e8m0_scale)
    )
    # int8 activations: "symmetric" codes in [-127, 127] (ptq's, ModelOpt's), or "full" [-128, 127],
    # as vLLM's and compressed-tensors' kernels saturate them; set by the plan for the target
    # engine, never by a recipe
    int_range: str = "symmetric"
    # dynamic scales: at least this (vLLM's 1 / (448 * 512) for FP8 inputs); set by the plan for the
    # target
    min_scale: float = 0.0
    # applied as x * (1 / scale), not x / scale: set by the plan for static FP8 inputs under the
    # vllm target (vLLM's FP8 input kernels); dynamic scales honour it too (vLLM-CPU's native path
    # multiplies for those as well), and dynamic int8 inputs as vLLM's kernel does, x * (127 / amax)
    # (ptq.quantization.engines, rule 3)
    reciprocal: bool = False

    @property
    def lowest(self) -> float | None:
        """The lowest code when it is not -max (formats.round_to_format's `lowest`): -128 for
        full-range int8."""
        return -128.0 if self.int_range == "full" and self.format.kind == "int" else None

    @property
    def static(self) -> bool:
        """Whether this tensor needs a calibrated scale (activations only)."""
        return self.format.scaled and not self.dynamic and self.scale != "unscaled"

    def describe(self) -> str:
        if not self.format.scaled:
            return self.format.name
        if self.scale == "unscaled":
            return f"{self.format.name} unscaled" + ("" if self.saturate else " non-saturating")
        how = self.granularity.describe() + (" dynamic" if self.dynamic else "")
        if not self.dynamic and self.observer != "max":
            how += f" {self.observer}" + (
                f" {self.percentile:g}" if self.observer == "percentile" else ""
            )
        if self.scale == "pow2":
            how += " pow2"
        if self.scale_format != "fp32":
            how += f" {self.scale_format} scales"
        if self.lowest is not None:
            how += f" [{self.lowest:g}, {self.format.max:g}]"
        return f"{self.format.name} {how}" + ("" if self.saturate else " non-saturating")


@dataclass(frozen=True)
class Override:
    """One entry of a recipe's `overrides`: the layers whose names match one of `match` (the first
    override that matches a layer wins) take this scheme instead of the recipe's own, or stay in
    bf16 (`weights` None: `keep: bf16`)."""

    number: int  # its position in the recipe's list, from 1
    match: tuple[str, ...]
    weights: TensorQuant | None = None
    inputs: TensorQuant | None = None
    scheme: str = ""  # the recipe it takes its scheme from (`scheme:`), or "" (written inline)

    @property
    def keep(self) -> bool:
        return self.weights is None

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.match)

    def describe(self) -> str:
        return f"override {self.number} (match: {', '.join(self.match)})"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    weights: TensorQuant
    inputs: TensorQuant
    targets: tuple[str, ...] = KINDS
    ignore: tuple[str, ...] = ("lm_head",)
    source: str = ""
    # name patterns a quantized tensor must match (then `ignore` removes)
    include: tuple[str, ...] = ("*",)
    attention: TensorQuant | None = None  # attention's batched-matmul inputs (None: left in fp32)
    attention_tensors: tuple[str, ...] = ATTENTION_TENSORS
    kv_cache: TensorQuant | None = None  # K and V as stored in the KV cache (after RoPE)
    smoothquant: float | None = None  # SmoothQuant's alpha (None: no smoothing)
    residual: TensorQuant | None = (
        None  # residual-add inputs of each decoder block (ptq/quantization/residual.py)
    )
    # per-layer schemes (or bf16) for the matmuls the recipe selects; the first match wins
    overrides: tuple[Override, ...] = ()

    def override_for(self, name: str) -> Override | None:
        """The first override whose patterns match the matmul `name`, or None."""
        return next((o for o in self.overrides if o.matches(name)), None)

    @property
    def schemes(self) -> list[Recipe]:
        """The distinct schemes the recipe gives matmuls: itself first, then one per distinct
        (weights, inputs) of its overrides (bf16 ones aside), each as a plain recipe with the
        override's weights and inputs: what is checked, simulated and exported per scheme (a
        config group each)."""
        out = [self]
        for o in self.overrides:
            if o.keep or any((o.weights, o.inputs) == (s.weights, s.inputs) for s in out):
                continue
            out.append(
                dataclasses.replace(
                    self,
                    name=o.scheme or f"{self.name} override {o.number}",
                    description=o.describe(),
                    weights=o.weights,
                    inputs=o.inputs,
                    overrides=(),
                )
            )
        return out

    def scheme_index(self, override: Override | None) -> int:
        """The index in `schemes` of the scheme `override` gives (0: the recipe's own; None or a
        bf16 override: 0)."""
        if override is None or override.keep:
            return 0
        return next(
            i
            for i, s in enumerate(self.schemes)
            if (s.weights, s.inputs) == (override.weights, override.inputs)
        )

    @property
    def needs_calibration(self) -> bool:
        """Static scales come from calibration; 16-bit formats, dynamic and unscaled ones need
        none."""
        return (
            any(
                q is not None and q.static
                for q in (self.inputs, self.attention, self.kv_cache, self.residual)
            )
            or self.smoothquant is not None
            or any(o.inputs is not None and o.inputs.static for o in self.overrides)
        )

    @property
    def beyond_linear(self) -> list[str]:
        """The recipe keys that quantize tensors other than Linear layers' weights and inputs (they
        patch the whole model's attention or decoder blocks)."""
        return [
            key for key in ("attention", "kv_cache", "residual") if getattr(self, key) is not None
        ]

    def selects(self, name: str) -> bool:
        """Layer selection by name: matches an `include` pattern and no `ignore` pattern."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.ignore
        )

    def targets_module(self, name: str, module: nn.Module) -> bool:
        """Whether the recipe quantizes this Linear layer of a linearized model
        (ptq.models.matmuls): its kind is among the recipe's targets and its name is selected."""
        return kind(module) in self.targets and self.selects(name)


BASELINE_LINEAR = TensorQuant(get_format("bf16"), saturate=False)  # bf16 rounds like an IEEE cast


def recipes_dir() -> Path:
    """Built-in recipes: ptq/recipes in an installed wheel, <repo>/recipes in a source checkout."""
    package = Path(__file__).parents[1]  # ptq/
    packaged = package / "recipes"
    return packaged if packaged.is_dir() else package.parent / "recipes"


def builtin_recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe name (`fp8-e4m3`) or a path to a YAML file; `+kv` or `+kv-head` after
    either adds an E4M3 KV cache with static per-tensor or per-head scales (KV_CACHE_OPTIONS)."""
    base, plus, option = str(name_or_path).rpartition("+")
    if plus and option in KV_CACHE_OPTIONS:
        return with_kv_cache(load_recipe(base), option)
    text = str(name_or_path)
    if not text.strip():  # Path("") is the current directory
        raise PtqError(
            f"no recipe given (built-in: {', '.join(builtin_recipe_names())}; or a path to a .yaml "
            "file)"
        )
    path = Path(text)
    # A built-in name is the built-in recipe, even where a file or folder of that name is in the
    # current directory (`ptq quantize --recipe int8 -o int8` makes one); a path is written as one:
    # with a folder or a .yaml suffix.
    written_as_path = path.suffix in (".yaml", ".yml") or "/" in text or os.sep in text
    builtin = recipes_dir() / f"{text}.yaml"
    if not written_as_path and (builtin.is_file() or not path.exists()):
        path = builtin
        # `ptq eval --recipe fp8-e4m3,int8`: a list where one is taken
        if not path.is_file() and "," in text:
            raise PtqError(
                f"'{name_or_path}' names several recipes: this command takes one (`ptq compare "
                "--recipes` takes a list)"
            )
        if not path.is_file():
            raise PtqError(
                f"unknown recipe '{name_or_path}' (built-in: {', '.join(builtin_recipe_names())}; "
                "or a path to a .yaml file)"
            )
    if path.is_dir():
        raise PtqError(
            f"{path} is a folder, not a recipe file (a .yaml file, or a built-in recipe's name)"
        )
    if not path.is_file():
        raise PtqError(f"recipe file {path} does not exist")
    return parse_recipe(read_yaml(path, "recipe"), source=str(path))


def with_kv_cache(recipe: Recipe, option: str) -> Recipe:
    """`recipe` with an E4M3 KV cache (K and V after RoPE, static scales per tensor or per KV
    head)."""
    if recipe.weights.format.kind != "float" or not recipe.weights.format.scaled:
        raise PtqError(
            f"+{option} adds an FP8 KV cache to an FP8 recipe; '{recipe.name}' stores weights as "
            f"{recipe.weights.format.name}"
        )
    if recipe.kv_cache is not None:
        raise PtqError(
            f"recipe '{recipe.name}' already quantizes the KV cache ({recipe.kv_cache.describe()})"
        )
    kv = TensorQuant(
        get_format("e4m3"), PerHead() if KV_CACHE_OPTIONS[option] == "head" else PerTensor()
    )
    return dataclasses.replace(
        recipe,
        name=f"{recipe.name}+{option}",
        kv_cache=kv,
        description=f"{recipe.description}; E4M3 KV cache, {kv.granularity.describe()} scales",
    )


def parse_recipe(data: object, source: str = "<recipe>") -> Recipe:
    where = f"recipe {source}"
    fields = _mapping(
        data,
        where,
        required={"name", "weights", "inputs"},
        optional={
            "description",
            "targets",
            "ignore",
            "include",
            "attention",
            "kv_cache",
            "smoothquant",
            "residual",
            "overrides",
        },
    )
    name = _string(fields["name"], f"{where}: 'name'")
    if problem := name_problem(name):
        raise PtqError(f"{where}: 'name' {problem}")
    # SmoothQuant folds one factor per input channel into a layer: experts (routed inputs) are not
    # targeted by default
    default_targets = (
        [k for k in KINDS if k != "Experts"] if "smoothquant" in fields else list(KINDS)
    )
    targets = tuple(
        _string_list(fields.get("targets", default_targets), f"{where}: 'targets'", empty=False)
    )
    for t in targets:
        if t not in TARGET_TYPES:
            raise PtqError(f"{where}: unknown target type '{t}' (known: {', '.join(TARGET_TYPES)})")
    weights = _tensor_quant(fields["weights"], f"{where}: 'weights'", role="weights")
    inputs = _tensor_quant(fields["inputs"], f"{where}: 'inputs'", role="inputs")
    attention, attention_tensors = None, ATTENTION_TENSORS
    if "attention" in fields:
        spec = fields["attention"]
        if isinstance(spec, dict) and "tensors" in spec:
            spec = dict(spec)
            attention_tensors = tuple(
                _string_list(spec.pop("tensors"), f"{where}: 'attention.tensors'", empty=False)
            )
            for t in attention_tensors:
                if t not in ATTENTION_TENSORS:
                    raise PtqError(
                        f"{where}: unknown attention tensor '{t}' (known: "
                        f"{', '.join(ATTENTION_TENSORS)})"
                    )
        attention = _tensor_quant(spec, f"{where}: 'attention'", role="activations")
    kv_cache = (
        _tensor_quant(fields["kv_cache"], f"{where}: 'kv_cache'", role="kv")
        if "kv_cache" in fields
        else None
    )
    residual = (
        _tensor_quant(fields["residual"], f"{where}: 'residual'", role="activations")
        if "residual" in fields
        else None
    )
    smoothquant = None
    if "smoothquant" in fields:
        sq = _mapping(
            fields["smoothquant"], f"{where}: 'smoothquant'", required={"alpha"}, optional=set()
        )
        smoothquant = sq["alpha"]
        if (
            isinstance(smoothquant, bool)
            or not isinstance(smoothquant, (int, float))
            or not 0 <= smoothquant <= 1
        ):
            raise PtqError(
                f"{where}: smoothquant.alpha must be a number in [0, 1], not "
                f"{reprlib.repr(smoothquant)}" + _text_number(smoothquant)
            )
        if not inputs.static or inputs.observer != "max":
            raise PtqError(
                f"{where}: smoothquant needs static inputs calibrated with observer 'max' "
                "(the smoothed amax is derived from per-channel maxima)"
            )
        if "Experts" in targets:
            raise PtqError(
                f"{where}: smoothquant applies to Linear and Conv1D targets (experts' inputs are "
                "routed per expert, so one smoothing factor per channel does not fold into the "
                "layer before them)"
            )
        smoothquant = float(smoothquant)
    overrides = _overrides(fields.get("overrides", []), where, source)
    if overrides and smoothquant is not None:
        raise PtqError(
            f"{where}: 'overrides' and 'smoothquant' do not combine (SmoothQuant's factors are "
            "calibrated for the recipe's one input scheme)"
        )
    return Recipe(
        name=name,
        description=_string(fields.get("description", name), f"{where}: 'description'"),
        weights=weights,
        inputs=inputs,
        targets=targets,
        ignore=tuple(_string_list(fields.get("ignore", ["lm_head"]), f"{where}: 'ignore'")),
        source=source,
        include=tuple(
            _string_list(fields.get("include", ["*"]), f"{where}: 'include'", empty=False)
        ),
        attention=attention,
        attention_tensors=attention_tensors,
        kv_cache=kv_cache,
        smoothquant=smoothquant,
        residual=residual,
        overrides=overrides,
    )


# what `keep` may say: the layers stay in the compute dtype, as in the 16-bit baseline
KEEP = ("bf16",)


def _overrides(data: object, where: str, source: str) -> tuple[Override, ...]:
    """`overrides`: a list of {match, and one of: weights + inputs, scheme (a recipe's name or
    path, whose weights and inputs it takes), keep: bf16}."""
    if not isinstance(data, list):
        raise PtqError(f"{where}: 'overrides' must be a list, not {reprlib.repr(data)}")
    out = []
    for number, item in enumerate(data, 1):
        at = f"{where}: 'overrides' entry {number}"
        fields = _mapping(
            item, at, required={"match"}, optional={"weights", "inputs", "scheme", "keep"}
        )
        match = tuple(_string_list(fields["match"], f"{at}: 'match'", empty=False))
        given = [k for k in ("weights", "inputs", "scheme", "keep") if k in fields]
        if given not in (["weights", "inputs"], ["scheme"], ["keep"]):
            raise PtqError(
                f"{at}: give 'weights' and 'inputs', or 'scheme' (a recipe's name), or "
                f"'keep: bf16', not {' + '.join(given) or 'none of them'}"
            )
        if "keep" in fields:
            if fields["keep"] not in KEEP:
                raise PtqError(
                    f"{at}: 'keep' must be {' or '.join(KEEP)} (the 16-bit baseline's dtype), not "
                    f"{reprlib.repr(fields['keep'])}"
                )
            out.append(Override(number, match))
        elif "scheme" in fields:
            out.append(_scheme_override(number, match, fields["scheme"], at, source))
        else:
            weights = _tensor_quant(fields["weights"], f"{at}: 'weights'", role="weights")
            inputs = _tensor_quant(fields["inputs"], f"{at}: 'inputs'", role="inputs")
            out.append(Override(number, match, weights, inputs))
    return tuple(out)


def _scheme_override(number: int, match: tuple, name: object, at: str, source: str) -> Override:
    """An override that takes the weights and inputs of a recipe (a built-in name, or a path,
    relative to the recipe file's folder where it is not absolute)."""
    text = _string(name, f"{at}: 'scheme'")
    path = Path(text)
    if (path.suffix in (".yaml", ".yml") or "/" in text) and not path.is_absolute():
        path = Path(source).parent / path
        text = str(path)
    try:
        scheme = load_recipe(text)
    except PtqError as e:
        raise PtqError(f"{at}: 'scheme': {e}") from None
    extra = [*scheme.beyond_linear, *(["smoothquant"] if scheme.smoothquant else [])]
    if scheme.overrides:
        extra.append("overrides")
    if not (scheme.weights.format.scaled or scheme.inputs.format.scaled):
        raise PtqError(
            f"{at}: scheme '{scheme.name}' quantizes nothing: write 'keep: bf16' to leave layers "
            "in 16 bits (recorded as left out by the override)"
        )
    if extra:
        raise PtqError(
            f"{at}: scheme '{scheme.name}' also sets {', '.join(extra)}: an override takes a "
            "recipe's weights and inputs only"
        )
    return Override(number, match, scheme.weights, scheme.inputs, scheme.name)


def _granularity(fields: dict, where: str, role: str, dynamic: bool) -> Granularity:
    """The YAML granularity (+ group_size / block_size) as a ptq.numerics.granularity dataclass,
    refusing what cannot work: per-token weights, per-channel or block inputs, static per-group or
    per-token inputs."""
    name = fields.get("granularity", "token" if dynamic and role != "weights" else "tensor")
    if name not in GRANULARITIES:
        raise PtqError(
            f"{where}: unknown granularity {reprlib.repr(name)} (known: {', '.join(GRANULARITIES)})"
        )
    if "group_size" in fields and name != "group":
        raise PtqError(f"{where}: 'group_size' applies to granularity 'group', not '{name}'")
    if "block_size" in fields and name != "block":
        raise PtqError(f"{where}: 'block_size' applies to granularity 'block', not '{name}'")
    if name == "head" and (role != "kv" or dynamic):
        raise PtqError(
            f"{where}: per-head scales apply to the KV cache's K and V, static (from calibration)"
        )
    if role == "weights":
        if name == "token":
            raise PtqError(
                f"{where}: per-token scales apply to activations; weights use tensor, channel, "
                "group or block"
            )
    elif name in ("channel", "block"):
        raise PtqError(
            f"{where}: per-{name} scales apply to weights only (an input's scale must factor out "
            "of the matmul: per tensor, per token or per group along the reduction dimension)"
        )
    elif name in ("token", "group") and not dynamic:
        raise PtqError(
            f"{where}: per-{name} input scales are computed on the fly: set 'dynamic: true' "
            "(calibration gives one static scale per tensor)"
        )
    if role in ("activations", "kv") and name == "group":
        raise PtqError(f"{where}: per-group scales apply to matmul weights and inputs")
    if name == "group":
        size = fields.get("group_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PtqError(
                f"{where}: granularity 'group' needs 'group_size', a positive integer, not "
                f"{reprlib.repr(size)}"
            )
        if size > MAX_GRANULE:
            raise PtqError(
                f"{where}: group_size {reprlib.repr(size)} is larger than any tensor's dimension "
                f"(at most {MAX_GRANULE})"
            )
        return PerGroup(size)
    if name == "block":
        size = fields.get("block_size")
        if (
            not isinstance(size, list)
            or len(size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in size)
        ):
            raise PtqError(
                f"{where}: granularity 'block' needs 'block_size', two positive integers "
                f"[rows, columns], not {reprlib.repr(size)}"
            )
        if max(size) > MAX_GRANULE:
            raise PtqError(
                f"{where}: block_size {reprlib.repr(size)} is larger than any tensor's dimension "
                f"(each at most {MAX_GRANULE})"
            )
        return PerBlock(*size)
    return {"tensor": PerTensor(), "channel": PerChannel(), "token": PerToken(), "head": PerHead()}[
        name
    ]


def _tensor_quant(data: object, where: str, role: str) -> TensorQuant:
    """role: "weights", "inputs" (matmul inputs) or "activations" (attention, KV cache, residual
    inputs)."""
    fields = _mapping(
        data,
        where,
        required={"format"},
        optional={
            "granularity",
            "group_size",
            "block_size",
            "saturate",
            "observer",
            "percentile",
            "dynamic",
            "scale",
            "scale_format",
        },
    )
    name = _string(fields["format"], f"{where}.format")  # its message names where already
    try:
        fmt = get_format(name)
    except PtqError as e:
        raise PtqError(f"{where}: {e}") from None
    dynamic = fields.get("dynamic", False)
    if not isinstance(dynamic, bool):
        raise PtqError(f"{where}.dynamic must be true or false, not {reprlib.repr(dynamic)}")
    if dynamic and role == "weights":
        raise PtqError(
            f"{where}: dynamic (per-token) scales apply to activations; weights are known ahead"
        )
    if dynamic and not fmt.scaled:
        raise PtqError(
            f"{where}: {fmt.name} is not scaled, so 'dynamic' (a scale per token) does not apply"
        )
    granularity = _granularity(fields, where, role, dynamic)
    # 16-bit formats overflow to inf like an IEEE cast
    saturate = fields.get("saturate", fmt.scaled)
    if not isinstance(saturate, bool):
        raise PtqError(f"{where}.saturate must be true or false, not {reprlib.repr(saturate)}")
    if "saturate" in fields and fmt.kind == "int":
        raise PtqError(
            f"{where}: {fmt.name} always clamps to its range; 'saturate' applies to float formats"
        )
    observer = fields.get("observer", "max")
    if observer not in OBSERVERS:
        raise PtqError(f"{where}: unknown observer '{observer}' (known: {', '.join(OBSERVERS)})")
    if observer != "max" and role == "weights":
        raise PtqError(
            f"{where}: weights use max calibration (observer 'max'); observers apply to activations"
        )
    if observer != "max" and granularity == PerHead():
        raise PtqError(
            f"{where}: per-head scales are calibrated with observer 'max' (per-head maxima)"
        )
    if observer != "max" and dynamic:
        raise PtqError(
            f"{where}: an observer calibrates a static scale; dynamic scales take each token's amax"
        )
    percentile = fields.get("percentile", 99.99)
    if (
        isinstance(percentile, bool)
        or not isinstance(percentile, (int, float))
        or not 0 < percentile <= 100
    ):
        raise PtqError(
            f"{where}.percentile must be a number in (0, 100], not {reprlib.repr(percentile)}"
            + _text_number(percentile)
        )
    if "percentile" in fields and observer not in ("percentile", "best"):
        raise PtqError(
            f"{where}: 'percentile' applies to observer 'percentile' or 'best', not '{observer}'"
        )
    scale = fields.get("scale", "amax")
    if scale not in SCALE_MODES:
        raise PtqError(f"{where}: unknown scale '{scale}' (known: {', '.join(SCALE_MODES)})")
    if (dynamic or observer != "max") and scale == "unscaled":
        raise PtqError(
            f"{where}: scale 'unscaled' uses no scale, so neither 'dynamic' nor an observer applies"
        )
    if scale != "amax" and not fmt.scaled:
        raise PtqError(
            f"{where}: {fmt.name} is not scaled; 'scale: {scale}' applies to 8-bit formats"
        )
    scale_format = fields.get("scale_format", "fp32")
    if scale_format not in SCALE_FORMATS:
        raise PtqError(
            f"{where}: unknown scale_format {reprlib.repr(scale_format)} (known: "
            f"{', '.join(SCALE_FORMATS)})"
        )
    if scale_format == "e8m0" and (scale != "amax" or fmt.kind != "float" or not fmt.scaled):
        raise PtqError(
            f"{where}: scale_format 'e8m0' is the MX power-of-two scale of an 8-bit float format "
            "(its rule is fixed: leave 'scale' at amax)"
        )
    return TensorQuant(
        format=fmt,
        granularity=granularity,
        saturate=saturate,
        observer=observer,
        percentile=float(percentile),
        dynamic=dynamic,
        scale=scale,
        scale_format=scale_format,
    )


def _mapping(data: object, where: str, required: set[str], optional: set[str]) -> dict:
    if not isinstance(data, dict):
        raise PtqError(f"{where} must be a mapping, not {type(data).__name__}")
    unknown = sorted(reprlib.repr(k) for k in set(data) - required - optional)
    if unknown:
        raise PtqError(
            f"{where}: unknown key {unknown[0]} (known: {', '.join(sorted(required | optional))})"
        )
    missing = sorted(required - set(data))
    if missing:
        raise PtqError(f"{where}: missing key '{missing[0]}'")
    return data


def _text_number(value: object) -> str:
    """Why a number came as text, where YAML read it so: YAML 1.1 (PyYAML) takes 1e-3 for a string,
    1.0e-3 for a number."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    mantissa, e, exponent = repr(number).partition("e")  # '1e-300', '0.001', '99.0'
    written = (
        mantissa
        + (".0" if "." not in mantissa else "")
        + (f"e{'+' if exponent[0].isdigit() else ''}{exponent}" if e else "")
    )
    return f" (YAML reads {value} as text: write it as {written})"


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise PtqError(f"{where} must be a non-empty string, not {reprlib.repr(value)}")
    return value


def _string_list(value: object, where: str, empty: bool = True) -> list[str]:
    """empty=False: a list that selects what is quantized, where [] would quantize nothing (a
    variant that is the baseline, reported as a recipe)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PtqError(f"{where} must be a list of strings, not {reprlib.repr(value)}")
    if not value and not empty:
        raise PtqError(f"{where} is empty: it would select nothing to quantize")
    return value
