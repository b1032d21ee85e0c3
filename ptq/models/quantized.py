"""The one check of an already quantized checkpoint's tensors, run by every reader before its
weights are used: in memory (ptq.models.loading.load_model, before transformers' loader) and
layer by layer (ptq.execution.streaming.SafetensorsCheckpoint, when it opens the checkpoint).

Every code tensor (float8 / int8 `weight`, a packed `weight_packed`) must have its scales, of the
shape its scheme needs and with values a scale can have (finite, > 0; E8M0 exponents not 255,
E8M0's NaN), and the codes must be of the dtype the quantization_config names; a static input
scheme needs each layer's `input_scale`. A damaged checkpoint would otherwise load with a scale
of 1 (transformers' initial value for a missing scale), with negated or NaN weights, or fail with
a traceback deep in a dequantizer. Read from the safetensors headers and the scales' values (a
small fraction of the checkpoint), never the codes.

Scale layouts for a weight [..., out, in] (compressed-tensors'; ptq.export.format writes them):
per-tensor one value ([1], [] or [1, 1]), per-channel [out, 1], per-group [out, ceil(in/G)],
per-block [ceil(out/R), ceil(in/C)]; stacked experts [E, out, in] carry E before each.
"""

from __future__ import annotations

import math
from pathlib import Path

import safetensors

from ptq.errors import PtqError, unreadable_weights

# safetensors dtype names of 8-bit codes
FLOAT_CODES = ("F8_E4M3", "F8_E5M2")
INT_CODES = ("I8",)
FLOAT_SCALES = ("F32", "F16", "BF16", "F64", "F8_E4M3")
# compressed-tensors formats whose weights ptq reads (in memory; the 8-bit ones layer by layer too)
CODE_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "mxfp8-quantized")
# weights stored as values, their scales beside them (a "frozen" checkpoint)
DENSE_FORMATS = ("dense",)
PACKED_FORMATS = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")

# name -> (file, safetensors dtype name, shape)
Table = dict[str, tuple[Path, str, tuple[int, ...]]]


def tensor_table(files: list[Path]) -> Table:
    """The safetensors headers of `files`: each tensor's file, dtype and shape (no data read)."""
    table: Table = {}
    for path in files:
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    table.setdefault(key, (path, piece.get_dtype(), tuple(piece.get_shape())))
        except Exception as e:
            raise unreadable_weights(path, e) from None
    return table


def check_quantized_files(qc: dict, files: list[Path], spec: str) -> None:
    """check_quantized_tensors over the headers of `files` (the weight files that load)."""
    check_quantized_tensors(qc, tensor_table(files), spec)


def check_quantized_tensors(qc: object, table: Table, spec: str) -> None:
    """Refuse, in one line naming the tensor and its file, a quantized checkpoint whose tensors do
    not hold what its quantization_config `qc` says (see the module's docstring). `table`: its
    tensors (tensor_table). Methods other than compressed-tensors and fp8 are left to the caller
    (ptq.models.loading.dequantized_loading refuses them)."""
    if not isinstance(qc, dict):
        return
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        wanted = _compressed_tensors(qc, table, spec)
    elif method == "fp8":
        wanted = _fp8(qc, table, spec)
    else:
        return
    _check_values(wanted, table)


def _where(table: Table, name: str) -> str:
    return f"tensor '{name}' in {table[name][0]}"


def check_quantization_config(qc: object, spec: str) -> None:
    """Refuse, in one line, a compressed-tensors quantization_config that does not say what the
    tensors hold (no config_groups) or names a scheme ptq does not read; before any reader (or
    compressed-tensors' own converter, whose words are vaguer) is built from it."""
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        _schemes(qc, spec)


def _schemes(qc: dict, spec: str) -> list[tuple[str, dict, object, object]]:
    """The config's weight schemes: (group, weights, format, input_activations), each checked."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise PtqError(
            f"model '{spec}': its compressed-tensors quantization_config has no config_groups, "
            "so what its tensors hold is not said; the checkpoint is damaged or not "
            "compressed-tensors"
        )
    schemes = []
    for label, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(group, dict) or not isinstance(weights, dict):
            continue  # no weights quantized (an activation-only group)
        fmt = group.get("format") or qc.get("format")
        _supported(spec, label, weights, fmt)
        schemes.append((label, weights, fmt, group.get("input_activations")))
    return schemes


def _compressed_tensors(qc: dict, table: Table, spec: str) -> list[tuple[str, str, str]]:
    """The scales to read, as (scale, code tensor, kind); shapes and dtypes checked."""
    schemes = _schemes(qc, spec)
    wanted = []
    for name, (_, dtype, shape) in table.items():
        if name.endswith(".weight_packed"):
            layer = name.removesuffix(".weight_packed")
            if not any(fmt in PACKED_FORMATS for _, _, fmt, _ in schemes):
                raise PtqError(
                    f"{_where(table, name)} holds packed codes but the quantization_config "
                    f"of '{spec}' names no packed format"
                )
            scale = f"{layer}.weight_scale"
            if scale not in table:
                raise _missing(table, name, scale)
            wanted.append((scale, name, "E8M0" if table[scale][1] == "U8" else "float"))
            continue
        if not name.endswith(".weight") or dtype not in FLOAT_CODES + INT_CODES:
            dense = any(s[2] in DENSE_FORMATS for s in schemes)
            if name.endswith(".weight") and f"{name}_scale" in table and schemes and not dense:
                raise PtqError(
                    f"{_where(table, name)} holds {dtype} values, not 8-bit codes, yet has a "
                    f"weight_scale: the config of '{spec}' and its tensors disagree"
                )
            continue
        kind = "float" if dtype in FLOAT_CODES else "int"
        fitting = [s for s in schemes if s[1].get("type") == kind and s[1].get("num_bits") == 8]
        if not fitting:
            named = ", ".join(
                f"{s[0]}: {s[1].get('num_bits')}-bit {s[1].get('type')}" for s in schemes
            )
            raise PtqError(
                f"{_where(table, name)} holds {dtype} codes but the quantization_config "
                f"of '{spec}' stores no 8-bit {kind} weights ({named or 'no weights'}): "
                "the config and the tensors disagree"
            )
        scale = f"{name}_scale"
        if scale not in table:
            raise _missing(table, name, scale)
        # several groups of the same type (other tools'): the shape must fit one of them
        needs = [_scale_shape(shape, s[1]) for s in fitting]
        # Conv1D weights (GPT-2's) are stored [in, out], their scales per output still
        if len(shape) == 2:
            needs += [_scale_shape(shape[::-1], s[1]) for s in fitting]
        got = table[scale][2]
        if not any(_fits(got, need) for need in needs):
            strategy = fitting[0][1].get("strategy")
            raise PtqError(
                f"{_where(table, scale)} has shape {list(got)}, but '{name}' {list(shape)} with "
                f"{strategy} scales needs {_shown(needs[0])}: a damaged quantized checkpoint"
            )
        e8m0 = any(str(s[1].get("scale_dtype")) in ("torch.uint8", "uint8") for s in fitting)
        scale_dtype = table[scale][1]
        if e8m0 != (scale_dtype == "U8") or scale_dtype not in FLOAT_SCALES + ("U8",):
            raise PtqError(
                f"{_where(table, scale)} is {scale_dtype}, but the quantization_config of '{spec}' "
                f"stores {'E8M0 (uint8)' if e8m0 else 'floating-point'} "
                "weight scales: the config and the tensors disagree"
            )
        wanted.append((scale, name, "E8M0" if e8m0 else "float"))
        static = [
            s[3]
            for s in fitting
            if isinstance(s[3], dict) and s[3].get("dynamic") is False and not s[3].get("actorder")
        ]
        if static and len(static) == len(fitting):
            layer = name.removesuffix(".weight")
            inputs = f"{layer}.input_scale"
            if inputs not in table:
                raise PtqError(
                    f"{_where(table, name)} has no '{inputs}', which the quantization_config "
                    f"of '{spec}' names (static inputs): a damaged quantized checkpoint"
                )
            if static[0].get("strategy") == "tensor" and math.prod(table[inputs][2]) != 1:
                raise PtqError(
                    f"{_where(table, inputs)} has shape {list(table[inputs][2])}, but a "
                    "per-tensor input scale is one value: a damaged quantized checkpoint"
                )
            wanted.append((inputs, name, "float"))
    return wanted


def _supported(spec: str, label: str, weights: dict, fmt: object) -> None:
    """Refuse, in one line, a weight scheme ptq does not read (rather than misread it)."""
    what = f"the quantization_config of '{spec}' ({label})"
    if fmt is not None and fmt not in CODE_FORMATS + PACKED_FORMATS + DENSE_FORMATS:
        raise PtqError(
            f"{what} stores its weights as '{fmt}', which ptq does not read: it reads "
            f"{', '.join(CODE_FORMATS + PACKED_FORMATS)} checkpoints"
        )
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES + ("tensor_group",):
        raise PtqError(
            f"{what} has weight strategy '{strategy}', which ptq does not read: it reads "
            f"{', '.join(WEIGHT_STRATEGIES)} weight scales"
        )
    if weights.get("dynamic") not in (False, None):
        raise PtqError(f"{what} has dynamic weights (no stored scales), which ptq does not read")
    bits = weights.get("num_bits")
    if fmt in CODE_FORMATS and bits != 8:
        raise PtqError(
            f"{what} stores {bits}-bit weights in the 8-bit format '{fmt}': the config and the "
            "format disagree"
        )
    if weights.get("type") not in ("float", "int"):
        raise PtqError(f"{what} has weight type '{weights.get('type')}', which ptq does not read")
    if strategy == "group" and not (
        isinstance(weights.get("group_size"), int) and weights["group_size"] > 0
    ):
        raise PtqError(f"{what} has group weights without a group_size: a damaged config")
    block = weights.get("block_structure")
    if strategy == "block" and not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise PtqError(f"{what} has block weights without a block_structure [rows, columns]")


def _scale_shape(shape: tuple[int, ...], weights: dict) -> tuple[int, ...] | None:
    """The weight_scale shape a weight of `shape` ([..., out, in]) needs; None: one value."""
    strategy = weights.get("strategy")
    if len(shape) < 2 or strategy in ("tensor", "tensor_group"):
        return None
    *lead, rows, cols = shape
    if strategy == "channel":
        return (*lead, rows, 1)
    if strategy == "group":
        return (*lead, rows, -(-cols // weights["group_size"]))
    r, c = weights["block_structure"]
    return (*lead, -(-rows // r), -(-cols // c))


def _fits(got: tuple[int, ...], need: tuple[int, ...] | None) -> bool:
    if need is None:
        return math.prod(got) == 1
    # per-channel scales also stored as [out]
    return got == need or (need[-1] == 1 and got == need[:-1])


def _shown(need: tuple[int, ...] | None) -> str:
    return "one value ([1])" if need is None else str(list(need))


def _fp8(qc: dict, table: Table, spec: str) -> list[tuple[str, str, str]]:
    """transformers' fp8 (DeepSeek-V3, Qwen3 FP8): each float8 weight with a weight_scale_inv per
    weight_block_size tile (one value without blocks)."""
    block = qc.get("weight_block_size")
    wanted = []
    for name, (_, dtype, shape) in table.items():
        if not name.endswith(".weight") or dtype not in FLOAT_CODES:
            continue
        scale = f"{name}_scale_inv"
        if scale not in table:
            raise _missing(table, name, scale)
        need = (
            _scale_shape(shape, {"strategy": "block", "block_structure": block})
            if isinstance(block, list) and len(block) == 2
            else None
        )
        got = table[scale][2]
        if not _fits(got, need):
            raise PtqError(
                f"{_where(table, scale)} has shape {list(got)}, but '{name}' {list(shape)} with "
                f"weight_block_size {block} needs {_shown(need)}: a damaged quantized "
                "checkpoint"
            )
        wanted.append((scale, name, "float"))
    return wanted


def _missing(table: Table, codes: str, scale: str) -> PtqError:
    return PtqError(
        f"{_where(table, codes)} holds {table[codes][1]} codes but the checkpoint has no "
        f"'{scale}': a damaged quantized checkpoint (its weights cannot be dequantized)"
    )


def _check_values(wanted: list[tuple[str, str, str]], table: Table) -> None:
    """Each scale's values: finite and > 0 (E8M0: an exponent byte other than 255, its NaN)."""
    import torch

    by_file: dict[Path, list[tuple[str, str, str]]] = {}
    for item in wanted:
        by_file.setdefault(table[item[0]][0], []).append(item)
    for path, items in by_file.items():
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                for scale, codes, kind in items:
                    values = f.get_tensor(scale)
                    if kind == "E8M0":
                        bad = values == 255
                    elif not values.dtype.is_floating_point:
                        raise PtqError(
                            f"{_where(table, scale)} is {table[scale][1]}: a scale is a "
                            "floating-point value (or an E8M0 exponent byte)"
                        )
                    else:
                        v = values.float()
                        bad = ~(torch.isfinite(v) & (v > 0))
                    if bool(bad.any()):
                        first = values.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]]
                        shown = "255 (E8M0 NaN)" if kind == "E8M0" else f"{float(first):g}"
                        raise PtqError(
                            f"{_where(table, scale)} holds {shown}, a scale of '{codes}' must be "
                            "finite and > 0: a damaged quantized checkpoint"
                        )
        except PtqError:
            raise
        except Exception as e:
            raise unreadable_weights(path, e) from None
