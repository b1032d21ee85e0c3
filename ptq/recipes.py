"""Recipes: one declarative description of what is quantized and how (YAML in recipes/), validated.

A recipe names the modules it targets (by type), the ones it leaves out (by name pattern), and one
`TensorQuant` for the weights and one for the inputs of every targeted layer. Linear layers a recipe
leaves out run as in the 16-bit baseline (bf16 weights and inputs), so that a variant differs from the
baseline only where the recipe says.
"""

from __future__ import annotations

import fnmatch
import reprlib
from dataclasses import dataclass
from pathlib import Path

import yaml
from torch import nn

from ptq.errors import PtqError
from ptq.formats import NumberFormat, get_format

GRANULARITIES = ("tensor", "channel")
TARGET_TYPES = {"Linear": nn.Linear}


@dataclass(frozen=True)
class TensorQuant:
    """How one tensor is quantized (the idea of compressed-tensors' QuantizationArgs)."""

    format: NumberFormat
    granularity: str = "tensor"  # "tensor": one scale; "channel": one scale per output row (weights only)
    saturate: bool = True  # out-of-range values clamp to the format's max (False: NaN / inf)

    def describe(self) -> str:
        if not self.format.scaled:
            return self.format.name
        return f"{self.format.name} per-{self.granularity}" + ("" if self.saturate else " non-saturating")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    weights: TensorQuant
    inputs: TensorQuant
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    source: str = ""

    @property
    def needs_calibration(self) -> bool:
        """Static input scales come from calibration; 16-bit formats need none."""
        return self.inputs.format.scaled

    def targets_module(self, name: str, module: nn.Module) -> bool:
        if not any(isinstance(module, TARGET_TYPES[t]) for t in self.targets):
            return False
        return not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.ignore)


BASELINE_LINEAR = TensorQuant(get_format("bf16"), saturate=False)  # bf16 rounds like an IEEE cast


def recipes_dir() -> Path:
    """Built-in recipes: ptq/recipes in an installed wheel, <repo>/recipes in a source checkout."""
    packaged = Path(__file__).parent / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "recipes"


def builtin_recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe name (`fp8-e4m3`) or a path to a YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = recipes_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise PtqError(f"unknown recipe '{name_or_path}' (built-in: {', '.join(builtin_recipe_names())}; or a path to a .yaml file)")
    if not path.is_file():
        raise PtqError(f"recipe file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise PtqError(f"cannot read recipe {path}: {e}") from None
    except yaml.YAMLError as e:
        raise PtqError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise PtqError(f"recipe {path} is nested too deeply to be a recipe") from None
    return parse_recipe(data, source=str(path))


def parse_recipe(data: object, source: str = "<recipe>") -> Recipe:
    where = f"recipe {source}"
    fields = _mapping(data, where, required={"name", "weights", "inputs"},
                      optional={"description", "targets", "ignore"})
    name = _string(fields["name"], f"{where}: 'name'")
    targets = tuple(_string_list(fields.get("targets", ["Linear"]), f"{where}: 'targets'"))
    for t in targets:
        if t not in TARGET_TYPES:
            raise PtqError(f"{where}: unknown target type '{t}' (known: {', '.join(TARGET_TYPES)})")
    weights = _tensor_quant(fields["weights"], f"{where}: 'weights'", allow_channel=True)
    inputs = _tensor_quant(fields["inputs"], f"{where}: 'inputs'", allow_channel=False)
    return Recipe(
        name=name,
        description=_string(fields.get("description", name), f"{where}: 'description'"),
        weights=weights,
        inputs=inputs,
        targets=targets,
        ignore=tuple(_string_list(fields.get("ignore", ["lm_head"]), f"{where}: 'ignore'")),
        source=source,
    )


def _tensor_quant(data: object, where: str, allow_channel: bool) -> TensorQuant:
    fields = _mapping(data, where, required={"format"}, optional={"granularity", "saturate"})
    try:
        fmt = get_format(_string(fields["format"], f"{where}.format"))
    except PtqError as e:
        raise PtqError(f"{where}: {e}") from None
    granularity = fields.get("granularity", "tensor")
    if granularity not in GRANULARITIES:
        raise PtqError(f"{where}: unknown granularity {reprlib.repr(granularity)} (known: {', '.join(GRANULARITIES)})")
    if granularity == "channel" and not allow_channel:
        raise PtqError(f"{where}: per-channel scales apply to weights only; inputs use one static per-tensor scale")
    saturate = fields.get("saturate", fmt.scaled)  # 16-bit formats overflow to inf like an IEEE cast
    if not isinstance(saturate, bool):
        raise PtqError(f"{where}.saturate must be true or false, not {reprlib.repr(saturate)}")
    return TensorQuant(format=fmt, granularity=granularity, saturate=saturate)


def _mapping(data: object, where: str, required: set[str], optional: set[str]) -> dict:
    if not isinstance(data, dict):
        raise PtqError(f"{where} must be a mapping, not {type(data).__name__}")
    unknown = sorted(reprlib.repr(k) for k in set(data) - required - optional)
    if unknown:
        raise PtqError(f"{where}: unknown key {unknown[0]} (known: {', '.join(sorted(required | optional))})")
    missing = sorted(required - set(data))
    if missing:
        raise PtqError(f"{where}: missing key '{missing[0]}'")
    return data


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise PtqError(f"{where} must be a non-empty string, not {reprlib.repr(value)}")
    return value


def _string_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PtqError(f"{where} must be a list of strings, not {reprlib.repr(value)}")
    return value
