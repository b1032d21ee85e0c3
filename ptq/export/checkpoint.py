"""Export: a quantized model as a Hugging Face checkpoint in the compressed-tensors format, which
transformers and vLLM load (FP8 E4M3 `float-quantized`, int8 `int-quantized`), for every scheme
llm-compressor writes: FP8 (static per-tensor inputs), FP8_DYNAMIC (per-channel weights, per-token
dynamic inputs), FP8_BLOCK (128 x 128 weight blocks, dynamic 1 x 128 input groups), MXFP8 (groups of 32,
E8M0 scales), and int8 W8A8.

For every Linear the recipe quantizes, the checkpoint holds
    <layer>.weight        float8_e4m3fn / int8 codes, 1 byte per parameter
    <layer>.weight_scale  float32: [1] (per-tensor), [out, 1] (per-channel), [ceil(out/R), ceil(in/C)] (block);
                          or uint8 E8M0 exponents [out, in/32] (MX)
    <layer>.input_scale   float32, [1], the static input scale from calibration (none for dynamic inputs)
and every other tensor unchanged, in its dtype in the source checkpoint. The codes come from
ptq.quantization.quantize.quantize_weight, the same function the simulation dequantizes, so the file holds
exactly what `ptq compare` simulated. Shards are written one at a time: peak memory stays near the
model plus one shard.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.calibration.calibrate import Calibration
from ptq.calibration.clips import input_clip, quantize_
from ptq.errors import PtqError
from ptq.models.matmuls import ROUTER, LinearExperts, kind, quantizable
from ptq.numerics.formats import NumberFormat, amax, compute_scale
from ptq.numerics.granularity import (
    PerBlock,
    PerChannel,
    PerGroup,
    PerHead,
    PerTensor,
    PerToken,
    e8m0_codes,
)
from ptq.quantization import engines
from ptq.quantization.plan import Plan, calibration_key
from ptq.quantization.plan import resolve_plan as plan_of
from ptq.quantization.quantize import QuantLinear, quantize_weight, scale_for
from ptq.quantization.recipes import Recipe, TensorQuant

EXPORT_INFO = "ptq-export.json"  # what was exported and how it was verified; the model card is rendered from it
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 1 << 30
_CT_TYPE = {
    "float": "float",
    "int": "int",
}  # ptq NumberFormat.kind -> compressed-tensors QuantizationType
_CT_FORMAT = {"float": "float-quantized", "int": "int-quantized"}
_DTYPE_NAMES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def check_exportable(recipe: Recipe) -> None:
    """The recipes the compressed-tensors formats can express; anything else is refused up front."""
    w, x = recipe.weights, recipe.inputs
    if w.format.name not in ("e4m3", "int8"):
        raise PtqError(
            f"recipe '{recipe.name}' stores weights as {w.format.name}: ptq quantize exports FP8 E4M3 and "
            "int8 only (the formats transformers and vLLM load as compressed-tensors)"
        )
    if x.format != w.format:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes weights to {w.format.name} but inputs to {x.format.name}: "
            "compressed-tensors W8A8 checkpoints use one format for both"
        )
    if not (w.saturate and x.saturate):
        raise PtqError(
            f"recipe '{recipe.name}' is non-saturating: transformers and vLLM always saturate (clamp) "
            "when they quantize, so the checkpoint would not run as simulated"
        )
    if "unscaled" in (w.scale, x.scale) or "pow2" in (w.scale, x.scale):
        raise PtqError(
            f"recipe '{recipe.name}' uses '{w.scale if w.scale != 'amax' else x.scale}' scales: the "
            "checkpoint format takes amax-derived scales (or MX's E8M0), so it would not run as simulated"
        )
    if x.dynamic and isinstance(x.granularity, PerTensor):
        raise PtqError(
            f"recipe '{recipe.name}' takes one dynamic scale per input tensor: vLLM serves a compressed-tensors "
            "checkpoint's dynamic inputs per token whatever strategy it names (CompressedTensorsW8A8Fp8 / Int8), so "
            "it would not run as simulated; use dynamic per-token inputs (fp8-dynamic)"
        )
    mx = [s.scale_format == "e8m0" for s in (w, x)]
    if any(mx) and not (all(mx) and w.granularity == x.granularity == PerGroup(32)):
        raise PtqError(
            f"recipe '{recipe.name}': E8M0 scales are exported as MXFP8 only (weights and inputs in groups "
            "of 32, both with E8M0 scales), the layout compressed-tensors and vLLM read"
        )
    if isinstance(w.granularity, PerGroup) and not any(mx):
        raise PtqError(
            f"recipe '{recipe.name}' has per-group FP32 weight scales: ptq quantize exports groups as "
            "MXFP8 (E8M0, 32) only; use per-block weights (fp8-block) for FP32 scales over tiles"
        )
    kv = recipe.kv_cache
    if kv is not None and not (
        kv.format.name == "e4m3"
        and kv.static
        and kv.scale == "amax"
        and kv.observer == "max"
        and isinstance(kv.granularity, (PerTensor, PerHead))
        and kv.saturate
    ):
        raise PtqError(
            f"recipe '{recipe.name}' quantizes the KV cache as {kv.describe()}: the checkpoint's "
            "kv_cache_scheme takes E4M3 with static per-tensor or per-head scales from max calibration"
        )
    beyond = [key for key in recipe.beyond_linear if key != "kv_cache"]
    if beyond:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes {' and '.join(recipe.beyond_linear)} inputs: the checkpoint "
            "format quantizes Linear layers and the KV cache only, so it would not run as simulated"
        )
    if recipe.smoothquant is not None:
        raise PtqError(
            f"recipe '{recipe.name}' uses SmoothQuant: the checkpoint format has no per-channel "
            "division of a layer's input, so it would not run as simulated"
        )
    if not any(mx):
        _check_vllm_pairing(recipe)


def _check_vllm_pairing(recipe: Recipe) -> None:
    """The weight x input pairs vLLM's compressed-tensors schemes serve as written (vllm 0.32
    compressed_tensors.py, `_is_fp8_w8a8`, `_is_static_tensor_w8a8`, `_is_dynamic_token_w8a8`, and
    CompressedTensorsW8A8Fp8): block weights take dynamic input groups of block_structure[0] (whatever group
    the config names) and no static input scale (an assert at load); per-tensor and per-channel weights take a
    static per-tensor input scale (recipes allow no other static one) or a dynamic per-token one (other dynamic
    inputs are served per token); int8 weights are per-tensor or per-channel ("No compressed-tensors compatible
    scheme" otherwise)."""
    w, x = recipe.weights, recipe.inputs
    wg, xg = w.granularity, x.granularity
    pair = f"recipe '{recipe.name}' pairs {wg.describe()} weights with {x.describe()} inputs"
    if isinstance(wg, PerBlock):
        if w.format.kind == "int":
            raise PtqError(
                f"recipe '{recipe.name}' has int8 block weights: vLLM loads int8 weights per tensor or per channel "
                "only; use fp8-block, or per-channel int8 weights"
            )
        if not x.dynamic:
            raise PtqError(
                f"{pair}: vLLM refuses block weights with a static input scale; use fp8-block"
            )
        if not (wg.rows == wg.cols and xg == PerGroup(wg.cols)):
            raise PtqError(
                f"{pair}: vLLM serves block weights' inputs in dynamic groups of 1 x {wg.rows} (the block's rows) "
                "whatever the checkpoint names, so it would not run as simulated; use square blocks and input "
                "groups of their size (fp8-block: 128 x 128, groups of 128)"
            )
    elif x.dynamic and not isinstance(xg, PerToken):
        raise PtqError(
            f"{pair}: vLLM serves the dynamic inputs of per-tensor and per-channel weights per token whatever the "
            "checkpoint names, so it would not run as simulated; use dynamic per-token inputs"
            + (" (fp8-dynamic), or fp8-block for groups" if w.format.kind == "float" else "")
        )


def quantization_args(spec: TensorQuant):
    """compressed-tensors' QuantizationArgs for one of ptq's TensorQuant (the same vocabulary)."""
    from compressed_tensors.quantization import QuantizationArgs

    g = spec.granularity
    strategy = {
        PerTensor: "tensor",
        PerChannel: "channel",
        PerToken: "token",
        PerGroup: "group",
        PerBlock: "block",
    }[type(g)]
    extra = {}
    if isinstance(g, PerGroup):
        extra["group_size"] = g.size
    if isinstance(g, PerBlock):
        extra["block_structure"] = [g.rows, g.cols]
    if spec.scale_format == "e8m0":
        extra["scale_dtype"] = torch.uint8
        extra["zp_dtype"] = torch.uint8
    return QuantizationArgs(
        num_bits=8,
        type=_CT_TYPE[spec.format.kind],
        strategy=strategy,
        symmetric=True,
        dynamic=spec.dynamic,
        **extra,
    )


def quantization_config(recipe: Recipe, ignore: list[str]):
    """The compressed-tensors QuantizationConfig for `recipe`: one config group for every Linear except the
    `ignore`d layers (their exact names), symmetric scales, weights already compressed on disk."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=quantization_args(recipe.weights),
        input_activations=quantization_args(recipe.inputs),
    )
    kv_cache_scheme = None
    if recipe.kv_cache is not None:  # K and V in E4M3, static scales: self_attn.k_scale / v_scale
        from compressed_tensors.quantization import QuantizationArgs

        strategy = "attn_head" if isinstance(recipe.kv_cache.granularity, PerHead) else "tensor"
        kv_cache_scheme = QuantizationArgs(
            num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False
        )
    fmt = (
        "mxfp8-quantized"
        if recipe.weights.scale_format == "e8m0"
        else _CT_FORMAT[recipe.weights.format.kind]
    )
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=ignore,
        format=fmt,
        kv_cache_scheme=kv_cache_scheme,
        quantization_status="compressed",
    )


def weight_scale_shape(shape: tuple[int, ...], weights: TensorQuant) -> tuple[int, ...]:
    """The shape of a weight [out, in]'s weight_scale on disk (partial groups and blocks counted: ceil)."""
    g, (rows, cols) = weights.granularity, shape
    if isinstance(g, PerChannel):
        return (rows, 1)
    if isinstance(g, PerGroup):
        return (rows, -(-cols // g.size))
    if isinstance(g, PerBlock):
        return (-(-rows // g.rows), -(-cols // g.cols))
    return (1,)


# ----------------------------------------------------------------------------------------------
# Writing


@dataclass
class _Entry:
    """One tensor of the checkpoint: its name, shape and dtype, and how to produce it when its shard is written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class SourceDtypes(dict):
    """Tensor name -> its dtype in the source checkpoint, and (`elements`) the number of values each floating-point
    dtype holds there."""

    def __init__(self, dtypes: dict[str, torch.dtype], elements: dict[torch.dtype, int]):
        super().__init__(dtypes)
        self.elements = elements


def source_dtypes(location: str) -> SourceDtypes:
    """The dtype of every tensor in the source checkpoint (a local directory's safetensors headers; for a checkpoint
    with pickle weights only, loaded with --allow-pickle, its pytorch_model*.bin files, memory-mapped by
    torch.load(weights_only=True)), so that tensors ptq does not quantize are written back as they were, not in the
    float32 ptq computes in. Tensors of other dtypes (an FP8 checkpoint's codes, dequantized on load) are left out."""
    directory = Path(location)
    if not directory.is_dir():  # a Hub id: its files are in the local cache, if anywhere
        try:
            from huggingface_hub import snapshot_download

            directory = Path(
                snapshot_download(
                    location, local_files_only=True, allow_patterns=["*.safetensors", "*.bin"]
                )
            )
        except Exception:
            return SourceDtypes({}, {})
    dtypes: dict[str, torch.dtype] = {}
    elements: collections.Counter = collections.Counter()
    for path in sorted(directory.glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = _DTYPE_NAMES.get(piece.get_dtype())
                if dtype is not None:
                    dtypes[key] = dtype
                    elements[dtype] += math.prod(piece.get_shape())
    if not dtypes:  # pickle weights only (ptq.models.loading refuses them without --allow-pickle)
        for path in sorted(directory.glob("pytorch_model*.bin")):
            try:  # memory-mapped: the dtypes are read, not the tensors
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except (
                Exception
            ):  # an old (non-zip) pickle cannot be memory-mapped: read as loading read it
                state = torch.load(str(path), map_location="cpu", weights_only=True)
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dtype in _DTYPE_NAMES.values():
                    dtypes[k] = v.dtype
                    elements[v.dtype] += v.numel()
            del state
    return SourceDtypes(dtypes, dict(elements))


def _saved_names(model: nn.Module) -> list[str]:
    """State-dict names that go into the checkpoint: tied copies dropped as save_pretrained does."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return list(remove_tied_weights_from_state_dict(model.state_dict(), model))


def checkpoint_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """State-dict name of the linearized model (ptq.models.matmuls) -> the name `save_pretrained` gives that tensor on
    disk. transformers merges per-expert 2-D checkpoint tensors into 3-D ones on load and splits them back on
    save (its weight conversions, e.g. Mixtral's experts.{e}.w1/w3 -> gate_up_proj), renaming some modules too.
    The same reversal is run on stand-ins: a one-element tensor holding each plain tensor's index, and for each
    experts module its fused 3-D tensors holding (projection, expert, row) codes, read back after the split.
    Experts a checkpoint keeps fused (3-D tensors on disk) cannot be written per expert: refused."""
    from transformers.core_model_loading import revert_weight_conversion

    experts = {path: m for path, m in model.named_modules() if isinstance(m, LinearExperts)}
    in_experts = lambda n: any(n.startswith(p + ".") for p in experts)  # noqa: E731
    plain = [n for n in names if not in_experts(n)]
    stand_ins = {n: torch.tensor([float(i)], dtype=torch.float64) for i, n in enumerate(plain)}
    projections: dict[str, list[str]] = {}
    check_experts_per_expert(model)
    for path, m in experts.items():
        groups = {
            ("gate_up_proj" if m.has_gate else "up_proj"): (
                ["gate_proj", "up_proj"] if m.has_gate else ["up_proj"]
            ),
            "down_proj": ["down_proj"],
        }
        for fused_name, parts in groups.items():
            rows = sum(getattr(m[0], p).out_features for p in parts)
            code = len(projections)
            projections[str(code)] = [path, *parts]
            e = torch.arange(len(m), dtype=torch.float64)[:, None, None]
            r = torch.arange(rows, dtype=torch.float64)[None, :, None]
            # two columns, not one: transformers 5.17's split squeezes a size-1 dimension away (a 1-D tensor back)
            stand_ins[f"{path}.{fused_name}"] = ((code * 4096 + e) * 2.0**24 + r).expand(-1, -1, 2)
    try:
        reverted = revert_weight_conversion(model, stand_ins)
    except Exception as e:
        raise PtqError(
            f"cannot work out the checkpoint names of {type(model).__name__} ({type(e).__name__}: {e})"
        ) from None
    mapping = {}
    for disk, t in reverted.items():
        if t.numel() == 1:
            mapping[plain[int(t.item())]] = disk
            continue
        if t.dim() != 2:
            raise PtqError(
                f"{type(model).__name__} stores its experts fused ('{disk}', {t.dim()}-D) in its checkpoint: "
                "ptq quantize writes per-expert 2-D weights only; `ptq compare` covers this model"
            )
        value = int(t[0, 0].item())
        code, e, row = value // 2**24 // 4096, value // 2**24 % 4096, value % 2**24
        path, *parts = projections[str(code)]
        rows = getattr(experts[path][e], parts[0]).out_features
        mapping[f"{path}.{e}.{parts[row // rows]}.weight"] = disk
    missing = [n for n in names if n not in mapping]
    if missing:
        raise PtqError(
            f"cannot work out the checkpoint name of '{missing[0]}' in {type(model).__name__}"
        )
    # the stand-ins cover every projection of every experts module; only the names asked for are answered (a recipe
    # may quantize some of an expert's projections and not others)
    return {n: mapping[n] for n in names}


def check_experts_per_expert(model: nn.Module) -> None:
    """Experts whose checkpoints keep them fused (3-D, with biases: GPT-OSS) cannot be written per expert: refused."""
    for path, m in model.named_modules():
        if isinstance(m, LinearExperts) and m[0].down_proj.bias is not None:
            raise PtqError(
                f"the experts of {m.fused_type} ('{path}') have biases and are stored fused (3-D) in their "
                "checkpoints: ptq quantize writes per-expert 2-D weights only; `ptq compare` covers this model"
            )


def export_layers(
    model: nn.Module, recipe: Recipe, plan: Plan | None = None
) -> tuple[list[str], list[str], list[str]]:
    """The Linear layers the recipe's plan quantizes and those it leaves out, and the state-dict names to save;
    refuses, before any calibration, a model where that is nothing, where a quantized weight is tied to another
    tensor, or whose checkpoint could not hold what the plan simulates (check_kv_cache, Conv1D with group scales)."""
    plan = plan or plan_of(model, recipe)
    # and the routers that are Linear layers (ptq.models.matmuls: MoE routers, Qwen2-MoE's shared_expert_gate), which
    # the checkpoint's "Linear" target would otherwise cover: the loaders must keep them as stored
    routers = [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and kind(m) == ROUTER
    ]
    # and the routers that are modules of their own (transformers 5's Qwen3MoeTopKRouter, MixtralTopKRouter...):
    # vLLM builds them as ReplicatedLinear, which the "Linear" target matches (its qwen3_moe.py hands the gate its
    # quant_config), so they are listed too, as compressed-tensors does (quant_config.get_vllm_module_type)
    routers += [
        x.name.rpartition(".")[0] for x in plan.unsupported if x.reason.startswith("router")
    ]
    quantized, ignored = plan.quantized, sorted({*plan.left_out, *routers})
    if not quantized:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes no layer of this {type(model).__name__} ({plan.left_out_reasons()})"
        )
    check_loadable(model, recipe, quantized)
    conv1d = [name for name in quantized if kind(model.get_submodule(name)) == "Conv1D"]
    if conv1d and isinstance(recipe.weights.granularity, (PerGroup, PerBlock)):
        raise PtqError(
            f"recipe '{recipe.name}' has {recipe.weights.granularity.describe()} weight scales and this "
            f"{type(model).__name__} has Conv1D layers: ptq quantize writes group and block scales for "
            "Linear weights only; `ptq compare` covers this model"
        )
    if plan.target == "vllm":
        check_fused_precision(model, quantized)
    names = _saved_names(model)
    check_kv_cache(model, plan, names)
    tied = [name for name in quantized if f"{name}.weight" not in names]
    if tied:
        raise PtqError(
            f"layer '{tied[0]}' shares its weight with another tensor (tied embeddings): leave it out "
            f"of recipe '{recipe.name}' (ignore: [{tied[0]}])"
        )
    return quantized, ignored, names


def check_kv_cache(model: nn.Module, plan: Plan, names: list[str]) -> None:
    """Refuse a KV-cache recipe whose plan leaves some attention layer's K or V in the compute dtype: the
    checkpoint's kv_cache_scheme has no per-layer list (compressed-tensors applies it to every attention layer,
    and vLLM stores a layer without k_scale / v_scale in FP8 at scale 1), so it would not run as simulated. And one
    whose attention has no k_proj to name the scales after."""
    if plan.recipe.kv_cache is None:
        return
    left = [
        x
        for x in plan.attention_left_out()
        if ".kv_cache." in x["name"] or x["name"] in plan.other_attention
    ]
    if not plan.attention and not left:
        left = [{"name": type(model).__name__, "reason": "no attention layer ptq can quantize"}]
    if left:
        raise PtqError(
            f"recipe '{plan.recipe.name}' leaves the KV cache of '{left[0]['name']}' in the compute dtype "
            f"({left[0]['reason']}): a checkpoint's kv_cache_scheme covers every attention layer, so the engine "
            "would serve it otherwise than simulated; quantize every layer's KV cache or none"
        )
    for layer in plan.attention:
        if f"{layer}.k_proj.weight" not in names:
            raise PtqError(
                f"attention layer '{layer}' of {type(model).__name__} has no k_proj: ptq quantize writes "
                "KV-cache scales for q/k/v-projection attention only"
            )


def check_fused_precision(model: nn.Module, quantized: list[str]) -> None:
    """Refuse, for --target vllm, a checkpoint where one of vLLM's fused layers is partly quantized: q/k/v, gate/up
    (engines.fused_groups) or an experts module (one FusedMoE: vLLM skips it whole if any expert layer is ignored).
    vLLM refuses the first ("Detected some but not all shards of ... are quantized. All shards of fused layers to have
    the same precision") and would load the second unquantized. transformers loads both (--target transformers)."""
    done = set(quantized)
    groups = [tuple(g) for g in engines.fused_groups(model)]
    for path, m in model.named_modules():
        if isinstance(m, LinearExperts):
            groups.append(
                tuple(
                    n for n, sub in m.named_modules(prefix=path) if quantizable(sub) and n != path
                )
            )
    for group in groups:
        partly = [n for n in group if n not in done]
        if partly and len(partly) < len(group):
            kept = next(n for n in group if n in done)
            raise PtqError(
                f"'{partly[0]}' would stay in 16 bits while '{kept}' is quantized, and vLLM runs them as one fused "
                "layer of one precision (it refuses such a checkpoint): quantize both or neither, or export for "
                "transformers (--target transformers)"
            )


def check_loadable(model: nn.Module, recipe: Recipe, quantized: list[str]) -> None:
    """Refuse, before any calibration, a recipe x architecture pair whose checkpoint no loader takes, or that the
    reload check cannot load. int8 experts with static input scales: vLLM has no fused-MoE method for them (its
    compressed_tensors_moe `get_moe_method` takes int8 W8A8 experts with dynamic per-token inputs only: "Unsupported
    FusedMoe scheme"). And transformers loads no int-quantized checkpoint of a model with fused experts, quantized or
    left out ("Concatenate on tensors destined for ...experts.gate_up_proj. Ckpt contains: 0"). And experts that
    checkpoints keep fused (check_experts_per_expert)."""
    experts = [path for path, m in model.named_modules() if isinstance(m, LinearExperts)]
    if experts and recipe.weights.format.kind == "int":
        quantized_experts = any(kind(model.get_submodule(name)) == "Experts" for name in quantized)
        why = (
            'vLLM answers "Unsupported FusedMoe scheme" for int8 experts with static input scales, and transformers '
            if quantized_experts and recipe.inputs.static
            else "transformers "
        )
        raise PtqError(
            f"recipe '{recipe.name}' writes an int8 checkpoint of {type(model).__name__}, a mixture-of-experts "
            f"model: no loader takes it ({why}cannot load int-quantized checkpoints with fused experts); "
            "use fp8-e4m3"
        )
    w, x = recipe.weights, recipe.inputs
    fp8_experts = w.scale_format != "e8m0" and any(
        kind(model.get_submodule(n)) == "Experts" for n in quantized
    )
    if fp8_experts and (w.granularity, x.granularity, x.dynamic) not in _VLLM_FP8_EXPERTS:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes the experts of {type(model).__name__} with {w.granularity.describe()} "
            f"weights and {x.describe()} inputs: vLLM's fused-MoE FP8 method takes per-tensor weights with a static "
            "per-tensor input scale (fp8-e4m3), per-channel weights with dynamic per-token inputs (fp8-dynamic), or "
            "128 x 128 blocks with dynamic 1 x 128 input groups (fp8-block), and refuses or reshapes the others; "
            "use one of those, or leave the experts out (targets without Experts)"
        )
    check_experts_per_expert(model)


# (weights, inputs, dynamic inputs) of FP8 experts as vLLM 0.32 serves them (compressed_tensors_moe_w8a8_fp8.py:
# per_tensor, per_channel, and block scales keyed as kFp8Static128BlockSym with kFp8Dynamic128Sym inputs)
_VLLM_FP8_EXPERTS = {
    (PerTensor(), PerTensor(), False),
    (PerChannel(), PerToken(), True),
    (PerBlock(128, 128), PerGroup(128), True),
}


def plan_checkpoint(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration | None,
    dtypes: dict[str, torch.dtype],
    target: str = "transformers",
    read: Callable[[str], torch.Tensor] | None = None,
    plan: Plan | None = None,
) -> tuple[list[_Entry], list[str], list[str]]:
    """Every tensor to write, in state-dict order; and the quantized and the left-out Linear layers. `target`:
    whose scales to write (ptq.quantization.engines: vllm, the shared scales vLLM serves).
    read: the tensor of that name in the source checkpoint, for a model whose weights are not in memory (on the
    meta device: ptq.execution.streaming); each tensor is then read when its shard is written, and each quantized
    weight checked against the calibration as it is read (the first one before anything is written). `plan`: the
    recipe's plan for `model` and `target`, when the command has resolved it."""
    plan = plan or plan_of(model, recipe, target)
    quantized, ignored, names = export_layers(model, recipe, plan)
    if recipe.needs_calibration:
        if calibration is None:
            raise PtqError(f"recipe '{recipe.name}' needs calibration (static scales)")
        calibrated = plan.calibrated
        if read is None:
            calibration.check_model(model, calibrated)
        else:  # the weights are checked as they are read
            missing = [name for name in calibrated if name not in calibration.input_amax]
            if missing:
                raise PtqError(
                    f"calibration file has no amax for layer '{missing[0]}' (made for model "
                    f"'{calibration.metadata.get('model', '?')}'; recalibrate for this model and recipe)"
                )
    params = dict(model.state_dict())
    by_weight = {f"{name}.weight": name for name in quantized}
    fallback = _dominant_dtype(dtypes)
    modules = dict(model.named_modules())
    disk = checkpoint_names(model, names)
    conv1d = {
        f"{name}.weight" for name, m in modules.items() if quantizable(m) and kind(m) == "Conv1D"
    }

    def weight_amax(
        n: str,
    ) -> torch.Tensor:  # in memory; else the calibration's, or read (no calibration is needed)
        if read is None:
            return amax(modules[n].weight)
        if calibration is not None and n in calibration.weight_amax:
            return calibration.weight_amax[n]
        return amax(read(disk[f"{n}.weight"]).float())

    # the scales the target engine serves, for the groups the plan says share one (ptq.quantization.engines)
    shared_weight_amax = engines.shared_amax(
        {n: plan.matmuls[n].weight_group for n in quantized if plan.matmuls[n].weight_group},
        weight_amax,
    )
    # each static input's clip under the recipe's observer (max: the amax), as the simulation takes it
    clip = lambda n: input_clip(calibration, n, plan.matmuls[n].inputs)  # noqa: E731
    shared_input_amax = engines.shared_amax(
        {n: plan.matmuls[n].input_group for n in quantized if plan.matmuls[n].input_group}, clip
    )
    entries: list[_Entry] = []
    for name in names:
        tensor = params[name]
        layer = by_weight.get(name)
        if layer is None:
            if name in conv1d:  # Conv1D keeps its weight [in, out] on disk
                tensor = tensor.t()
            dtype = dtypes.get(disk[name], fallback) if tensor.is_floating_point() else tensor.dtype
            make = (
                (
                    lambda n=disk[name], d=dtype, m=name: (
                        _checked_tensor(m, read(n), calibration).to(d).contiguous()
                    )
                )
                if read is not None
                else (lambda t=tensor, d=dtype: t.detach().cpu().to(d).contiguous())
            )
            entries.append(_Entry(disk[name], tuple(tensor.shape), dtype, make))
            continue
        if read is None:
            weight = lambda m=modules[layer]: m.weight  # noqa: E731
        else:
            weight = lambda n=disk[name], layer=layer, t=name in conv1d: _checked_weight(  # noqa: E731
                layer, read(n).t() if t else read(n), calibration
            )
        entries += quantized_entries(
            disk[name].removesuffix(".weight"),
            tuple(tensor.shape),
            weight,
            recipe,
            shared_input_amax.get(layer, clip(layer)) if recipe.inputs.static else None,
            transposed=name in conv1d,
            weight_amax=shared_weight_amax.get(layer),
        )
    entries += kv_cache_entries(model, plan, calibration, disk)
    if read is not None:  # a calibration of another model is refused before anything is written
        _checked_weight(quantized[0], read(disk[f"{quantized[0]}.weight"]), calibration)
        for name in (
            names
        ):  # and the vectors it recorded (norms, biases: small), each checked again as written
            if (
                calibration is not None
                and name in calibration.tensor_amax
                and params[name].dim() == 1
            ):
                _checked_tensor(name, read(disk[name]), calibration)
    # each left-out layer under its name in the files, which vLLM matches, and under its module's name where
    # transformers names it otherwise (GPT-NeoX's lm_head is embed_out on disk, PhiMoE's mlp.router is
    # block_sparse_moe.gate): compressed-tensors matches the ignore list against transformers' module names
    ignored = sorted(
        {
            n
            for name in ignored
            for n in (name, disk.get(f"{name}.weight", name).removesuffix(".weight"))
        }
    )
    return entries, quantized, ignored


def kv_cache_entries(
    model: nn.Module, plan, calibration: Calibration | None, disk: dict[str, str]
) -> list[_Entry]:
    """`<attention>.k_scale` and `.v_scale` of every attention layer whose KV cache the plan quantizes: float32,
    [1] per tensor or [kv heads, 1, 1] per head (compressed-tensors' attn_head layout), the simulation's scales."""
    entries = []
    for layer, tensors in plan.attention.items():  # each with a k_proj (check_kv_cache)
        prefix = disk[f"{layer}.k_proj.weight"].removesuffix(".k_proj.weight")
        for tensor, short in (("kv_cache.key", "k"), ("kv_cache.value", "v")):
            spec = tensors.get(tensor)
            if spec is None:
                continue
            scale = (
                scale_for(input_clip(calibration, calibration_key(layer, tensor), spec), spec)
                .float()
                .cpu()
            )
            shape = (scale.numel(), 1, 1) if isinstance(spec.granularity, PerHead) else (1,)
            entries.append(
                _Entry(
                    f"{prefix}.{short}_scale",
                    shape,
                    torch.float32,
                    lambda s=scale, shape=shape: s.reshape(shape).contiguous(),
                )
            )
    return entries


def quantized_entries(
    layer: str,
    shape: tuple[int, ...],
    weight: Callable[[], torch.Tensor],
    recipe: Recipe,
    input_amax: torch.Tensor | None,
    transposed: bool = False,
    weight_amax: torch.Tensor | None = None,
) -> list[_Entry]:
    """The tensors of a quantized Linear: its codes, weight scale and (static inputs) input scale. `weight()` gives the
    weight [out, in] when its shard is written (from the model in memory, or from disk: ptq.execution.streaming);
    `transposed`: the codes are written [in, out], as Conv1D stores its weight. `weight_amax`: a fused group's shared
    amax for the weight scale (ptq.quantization.engines), instead of the weight's own."""
    weights, inputs = recipe.weights, recipe.inputs
    scale_shape = weight_scale_shape(shape, weights)
    mx = weights.scale_format == "e8m0"
    scales: dict[str, torch.Tensor] = {}  # the weight's scale, from the call that made its codes
    codes = lambda w=weight, f=weights, s=scales: _weight_codes(w(), f, s, layer, weight_amax)  # noqa: E731
    stored_scale = lambda s=scales, shape=scale_shape: s.pop("scale").reshape(shape)  # noqa: E731
    entries = [
        _Entry(
            f"{layer}.weight",
            shape[::-1] if transposed else shape,
            weights.format.torch_dtype,
            (lambda: codes().t().contiguous()) if transposed else codes,
        ),
        _Entry(
            f"{layer}.weight_scale",
            scale_shape,
            torch.uint8 if mx else torch.float32,
            (lambda: e8m0_codes(stored_scale())) if mx else stored_scale,
        ),
    ]
    if inputs.static:
        entries.append(
            _Entry(
                f"{layer}.input_scale",
                (1,),
                torch.float32,
                lambda a=input_amax, f=inputs.format: _input_scale(a, f),
            )
        )
    return entries


def _checked_weight(
    layer: str, weight: torch.Tensor, calibration: Calibration | None
) -> torch.Tensor:
    """A weight read from disk, in float32, refused when its amax is not the calibration's (another model)."""
    w = weight.float()
    if calibration is not None:
        calibration.check_weight(layer, w)
    return w


def _checked_tensor(
    name: str, tensor: torch.Tensor, calibration: Calibration | None
) -> torch.Tensor:
    """A tensor read from disk that is not quantized (a norm, an embedding), refused when the calibration recorded
    another amax for it (Calibration.tensor_amax: another model whose Linear weights are this one's)."""
    if calibration is not None:
        calibration.check_tensor(name, tensor.float() if tensor.is_floating_point() else tensor)
    return tensor


def _weight_codes(
    weight: torch.Tensor,
    weights: TensorQuant,
    scales: dict,
    layer: str,
    weight_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    codes, scales["scale"] = quantize_weight(weight, weights, layer, weight_amax)
    scales["scale"] = scales["scale"].cpu()
    return codes.cpu()


def _input_scale(input_amax: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    return compute_scale(input_amax, fmt).reshape(1).cpu()  # exactly QuantLinear's input_scale


def _dominant_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The source checkpoint's own dtype: the floating-point dtype that holds most of its values (SourceDtypes), not
    most of its tensors (an FP8 checkpoint has a float32 weight_scale_inv next to each weight, its values in bf16)."""
    elements = getattr(dtypes, "elements", None)
    if elements is None:
        elements = collections.Counter(d for d in dtypes.values() if d.is_floating_point)
    return max(elements, key=elements.get) if elements else torch.float32


def shard(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Consecutive groups of at most max_bytes (a tensor larger than that gets a shard of its own)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_weights(
    entries: list[_Entry],
    directory: Path,
    max_shard_bytes: int,
    advance: Callable[[int], None] = lambda n: None,
) -> dict:
    """Write the safetensors shards (and the index when there is more than one), one shard in memory at a time; refused
    at once when the disk has not the room for them (a streamed model's weights are read and quantized as its shards
    are written: a full disk is found out before that work, not at the last shard)."""
    from ptq.runtime.resources import check_disk

    total = sum(e.nbytes for e in entries)
    way_out = "free some space or write it elsewhere (-o); nothing was written"
    check_disk(directory.parent, total, "writing the checkpoint's tensors", way_out)
    groups = shard(entries, max_shard_bytes)
    n = len(groups)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        filename = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for e in group:
            t = e.make()
            assert t.dtype == e.dtype and tuple(t.shape) == e.shape, (e.name, t.dtype, t.shape)
            tensors[e.name] = t
            weight_map[e.name] = filename
        _save_shard(tensors, directory / filename)
        del tensors
        advance(len(group))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"shards": n, "tensor_bytes": total}


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors.torch.save_file, whose I/O errors (a full disk, a quota) come as SafetensorError ("... (os error
    28)"), not OSError: raised as the OSError they are, which ptq.files.atomic_dir turns into one line."""
    try:
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    except safetensors.SafetensorError as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_config(
    model: nn.Module,
    recipe: Recipe,
    ignored: list[str],
    dtypes: dict[str, torch.dtype],
    directory: Path,
) -> dict:
    """config.json with the compressed-tensors quantization_config (written by compressed-tensors itself),
    and generation_config.json; returns the quantization_config as written."""
    from compressed_tensors.compressors import ModelCompressor

    config = copy.deepcopy(model.config)
    config.dtype = _dominant_dtype(
        dtypes
    )  # the checkpoint's own dtype, not the float32 ptq computed in
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    copy_remote_code(
        getattr(model.config, "_name_or_path", ""),
        getattr(model.config, "auto_map", None),
        directory,
    )
    ModelCompressor(quantization_config=quantization_config(recipe, ignored)).update_config(
        str(directory)
    )
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())["quantization_config"]


def remote_code_files(auto_map: dict | None) -> list[str]:
    """The Python files of the model's own directory that config.json's auto_map names ("modeling_x.XForCausalLM" ->
    modeling_x.py; a reference into another repository, "owner/repo--modeling_x.X", is fetched from there)."""
    names = []
    for value in (auto_map or {}).values():
        for reference in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(reference, str) and "--" not in reference and "." in reference:
                names.append(reference.split(".")[0] + ".py")
    return sorted(set(names))


def copy_remote_code(source: str, auto_map: dict | None, directory: Path) -> list[str]:
    """Copy into `directory` the source checkpoint's Python files that auto_map names, with the files they import
    relatively (transformers' get_relative_import_files, as its save_pretrained does): the exported config.json keeps
    the source's auto_map, so its code must travel with it (loading it needs trust_remote_code, as the source did).
    `source`: the source's local directory, or a Hub id whose files are in the local cache. Returns the names copied."""
    import shutil

    from transformers.dynamic_module_utils import get_relative_import_files

    wanted = remote_code_files(auto_map)
    if not wanted or not source:
        return []
    root = Path(source)
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(source, local_files_only=True, allow_patterns=["*.py"]))
        except Exception:
            return []
    files = {root / name for name in wanted if (root / name).is_file()}
    for f in list(files):
        files |= {Path(p) for p in get_relative_import_files(str(f)) if Path(p).is_file()}
    for f in sorted(files):
        if not (
            directory / f.name
        ).exists():  # config.save_pretrained already copies the configuration's own file
            shutil.copyfile(f, directory / f.name)
    return sorted(f.name for f in files)


def checkpoint_bytes(entries: list[_Entry], quantized_layers: list[str]) -> dict:
    """Bytes of the tensors written, and of the same model as a 16-bit checkpoint: every parameter of a
    floating-point or quantized tensor at 2 bytes (the scales are not part of a 16-bit checkpoint)."""
    codes = {f"{layer}.weight" for layer in quantized_layers}
    scales = {
        f"{layer}.{kind}" for layer in quantized_layers for kind in ("weight_scale", "input_scale")
    }
    scales |= {
        e.name for e in entries if e.name.endswith((".k_scale", ".v_scale"))
    }  # the FP8 KV cache's: new too
    model = [e for e in entries if e.name not in scales]
    bytes_16bit = sum(
        e.nbytes
        // e.dtype.itemsize
        * (2 if e.dtype.is_floating_point or e.name in codes else e.dtype.itemsize)
        for e in model
    )
    written = sum(e.nbytes for e in entries)
    return {
        "bytes": written,
        "bytes_16bit": bytes_16bit,
        "bytes_saved": bytes_16bit - written,
        "quantized_params": sum(e.nbytes for e in entries if e.name in codes),  # 1 byte each
        "scale_bytes": sum(e.nbytes for e in entries if e.name in scales),
        "other_bytes": sum(e.nbytes for e in model if e.name not in codes),
        "other_dtypes": sorted(
            {str(e.dtype).removeprefix("torch.") for e in model if e.name not in codes}
        ),
    }


# ----------------------------------------------------------------------------------------------
# Verification


# What verification checks, and why these limits. The gate is what separates a wrong checkpoint from float-order
# noise on any model: (1) every quantized tensor in the files (codes, weight_scale, input_scale) is ptq's, bit for
# bit; (2) the reloaded model computes what ptq's simulation of the loader's arithmetic computes: the same codes,
# scales, input rounding and float32 ops in the same order, so the KL is 0 on SmolLM2 and the test models and
# summation-order differences would stay near 1e-10; input scales 3x off already give 1e-5 on a tiny random model.
# A tolerance from the float-order noise floor cannot be the gate: on SmolLM2 with int8, the same simulation with
# eager instead of sdpa attention moves perplexity by 1.1% (KL 0.28, same top-1 73%), while one layer's weight_scale
# x2 (model.layers.29.self_attn.o_proj) gives KL 0.20: inside that noise, yet caught by (1) and (2). The noise floor
# is measured in every verification (that attention swap, on the simulation) and reported next to the perplexity
# difference from ptq's own simulation (what `ptq compare` reports), which differs from the loader's by its int8
# input range only.
VERIFY_MAX_KL = 1e-6  # mean KL(simulated || reloaded), nats per predicted token
VERIFY_MIN_TOP1 = 0.99  # share of positions where both predict the same next token
VERIFY_CRITERION = (
    "the files hold ptq's quantized tensors bit for bit, and the reloaded model reproduces ptq's simulation "
    f"of the loader's arithmetic (KL <= {VERIFY_MAX_KL:g} nats/token, same top-1 >= {100 * VERIFY_MIN_TOP1:g}%); "
    "the perplexity difference from ptq's own simulation is reported next to the float-order noise floor "
    "(the simulation with another attention implementation), which can exceed a wrong scale's effect"
)


class VerificationFailed(Exception):
    """The reloaded checkpoint does not match the simulation; carries the export info with its verification."""

    def __init__(self, info: dict):
        super().__init__("; ".join(info["verification"]["problems"]))
        self.info = info


def simulate_export(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration,
    loader_inputs: bool = True,
    unrounded_inputs: list[str] = (),
    target: str = "transformers",
    token_rule_inputs: list[str] = (),
    kv_cache: bool = False,
) -> nn.Module:
    """ptq's simulation of the exported checkpoint, in place: quantize_ with the recipe and calibration, except
    that the layers the recipe leaves out keep their plain Linear (the checkpoint stores them unquantized and
    transformers runs them as is, where `ptq compare` rounds them to bf16 as in its 16-bit baseline), and, with
    loader_inputs, inputs round as the reload check's loader rounds them: int8 over the loaders' [-128, 127] range
    (ptq's own is [-127, 127]), static FP8 inputs divided by their scale as compressed-tensors does in transformers
    (vLLM multiplies by the reciprocal: engines rule 5). loader_inputs=False: as `ptq compare` simulates the target.
    The `unrounded_inputs` layers keep their quantized weights but take their inputs as they are (what the loader of
    the reload check computes for them: see unapplied_input_layers). `target`: whose scales the checkpoint holds
    (ptq.quantization.engines; vllm: the fused groups' shared scales). The `token_rule_inputs` layers take their
    dynamic input scales as compressed-tensors does in transformers (see token_rule_layers).
    kv_cache: whether the loader quantizes the KV cache (reload's kv_cache_quantized)"""
    # transformers (but 5.17) does not quantize the KV cache (vLLM does, from k_scale / v_scale): simulated without
    # it then; its scales are checked in the files either way (unapplied_scales)
    if not kv_cache:
        recipe = dataclasses.replace(recipe, kv_cache=None)
    plan = plan_of(model, recipe, target, **(engines.RELOAD_LOADER_INPUTS if loader_inputs else {}))
    kept = {name: model.get_submodule(name) for name in plan.left_out}
    quantize_(model, recipe, calibration, target=target, plan=plan)
    for name, m in kept.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, m)
    for name in unrounded_inputs:
        model.get_submodule(name).round_inputs = False
    for name in token_rule_inputs:
        model.get_submodule(name).__class__ = _TokenScalesOfTheLoader
    return model


# compressed-tensors' dynamic "token" strategy (compute_dynamic_scales_and_zp, 0.20) keeps dimensions 0 and 1 of the
# input and reduces the rest: per token for [batch, tokens, features], but ONE scale for a 2-D [tokens, features]
# input (torch reduces every dimension over an empty list), which some modules feed their Linear layers (Qwen2-MoE's
# shared expert: hidden_states.view(-1, H)), and one per window for DeepSeek-V3's kv_b_proj, fed [batch, 1, tokens,
# rank]. vLLM flattens every input to 2-D and scales each token (as ptq simulates), so this is the reload check's
# loader's arithmetic, not the served one: the check simulates it for those layers, and reports ptq's own next to it.


class _TokenScalesOfTheLoader(QuantLinear):
    """A QuantLinear with dynamic per-token inputs scaled as compressed-tensors scales them in transformers: one scale
    per index of the input's first two dimensions, over the others (per token for a 3-D input)."""

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 3 or not self.round_inputs:
            return super().quantize_input(x)
        if x.dim() == 2:
            return x, self.input_quantizer(
                x, dataclasses.replace(self.inputs, granularity=PerTensor()), None
            )[0]
        rows = x.reshape(
            x.shape[0] * x.shape[1], -1
        )  # a row per index of the first two dimensions: a scale each
        return x, self.input_quantizer(rows, self.inputs, None)[0].reshape(x.shape)


def token_rule_layers(
    model: nn.Module, recipe: Recipe, layers: list[str], input_ids: torch.Tensor
) -> list[str]:
    """The `layers` (quantized, with their inputs rounded by the reload check's loader) whose dynamic per-token inputs
    reach them other than 3-D, where compressed-tensors' scales are not per token (_TokenScalesOfTheLoader): found by
    one forward of the unquantized `model` over the first window. None of them for other recipes."""
    if (
        not (recipe.inputs.dynamic and isinstance(recipe.inputs.granularity, PerToken))
        or not layers
    ):
        return []
    seen: set[str] = set()
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.add(name) if args[0].dim() != 3 else None
        )
        for name in layers
    ]
    try:
        with torch.inference_mode():
            model(input_ids=input_ids[:1].to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return [name for name in layers if name in seen]


def describe_token_rule(layers: list[str]) -> str | None:
    """ptq's rounding of the layers token_rule_layers found, in words for the report (None: there are none)."""
    if not layers:
        return None
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"vLLM's per-token dynamic input scales in the {len(layers)} layer(s) fed inputs other than 3-D ({shown}), "
        "where transformers' compressed-tensors takes one scale per index of their first two dimensions (one per "
        "2-D input)"
    )


def unapplied_input_layers(
    model: nn.Module, quantized: list[str], conv1d: bool, dynamic: bool = False
) -> list[str]:
    """The quantized layers whose input quantization the reload check's loader does not apply: the experts'
    (transformers has no place for their input scales and runs them weights-only; vLLM quantizes their inputs),
    or, for static inputs, every layer when ptq's own reader stands in (Conv1D models: it applies dynamic input
    quantization, not static scales)."""
    if conv1d and not dynamic:
        return list(quantized)
    in_experts = {
        f"{path}.{name}"
        for path, e in model.named_modules()
        if isinstance(e, LinearExperts)
        for name, m in e.named_modules()
        if quantizable(m)
    }
    return [name for name in quantized if name in in_experts]


def unapplied_scales(
    model: nn.Module, layers: list[str], calibration: Calibration, plan: Plan
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> each scale the reload check's loader does not apply, which the checkpoint must hold for
    vLLM: the input scales of `layers` (unapplied_input_layers) and the KV cache's k_scale / v_scale, as the
    command's plan has them."""
    recipe, scales = plan.recipe, {}
    if recipe.kv_cache is not None:
        disk = checkpoint_names(model, _saved_names(model))
        scales = {e.name: e.make() for e in kv_cache_entries(model, plan, calibration, disk)}
    if not recipe.inputs.static:
        return scales
    disk = checkpoint_names(model, [f"{name}.weight" for name in layers]) if layers else {}
    return scales | {
        disk[f"{name}.weight"].removesuffix(".weight") + ".input_scale": _input_scale(
            input_clip(calibration, name, plan.matmuls[name].inputs), recipe.inputs.format
        )
        for name in layers
    }


def simulated_tensors(
    simulated: nn.Module, disk: dict[str, str], conv1d: list[str]
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> what the files must hold for each quantized layer of the simulation, as the simulation holds
    it: the weight codes (Conv1D's [in, out]), the weight scale and the static input scale. `disk`: checkpoint_names
    of the layers' weights, taken before the model was quantized."""
    expected = {}
    for weight, on_disk in disk.items():
        m = simulated.get_submodule(weight.removesuffix(".weight"))
        layer = on_disk.removesuffix(".weight")
        codes = m.weight_codes.t() if weight.removesuffix(".weight") in conv1d else m.weight_codes
        expected[f"{layer}.weight"] = codes
        # the scale as the preset lays it out on disk: [1], [out, 1], [out, groups] (MX: E8M0 codes), [row, column
        # blocks], of the weight [out, in] (Conv1D's too)
        scale = m.weight_scale.reshape(weight_scale_shape(tuple(m.weight_codes.shape), m.weights))
        expected[f"{layer}.weight_scale"] = (
            e8m0_codes(scale) if m.weights.scale_format == "e8m0" else scale
        )
        if m.inputs.static:
            expected[f"{layer}.input_scale"] = m.input_scale.reshape(1)
    return expected


def differing_tensors(expected: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """The names of `expected` that the checkpoint's files lack or hold with another shape, dtype or bits."""
    written = _read_tensors(directory, list(expected))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(
                a.detach().cpu().contiguous().flatten().view(torch.uint8),
                b.contiguous().flatten().view(torch.uint8),
            )
        )

    return [k for k, v in expected.items() if k not in written or not same(v, written[k])]


class OtherAttention(nn.Module):
    """A model run with another attention implementation (eager for sdpa, and the reverse), its weights shared: the
    same arithmetic in another float order, for the noise floor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config
        self.implementation = "sdpa" if model.config._attn_implementation == "eager" else "eager"

    def forward(self, **kwargs):
        previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.implementation
        try:
            return self.model(**kwargs)
        finally:
            self.model.config._attn_implementation = previous

    def cannot_run(self, input_ids: torch.Tensor) -> str | None:
        """Why the other implementation cannot run this model (transformers refuses it: Gemma 2's soft-capped
        attention has no sdpa form), tried on a few tokens of the first window; None when it runs."""
        from ptq.models.loading import one_line

        device = self.model.get_input_embeddings().weight.device
        try:
            with torch.inference_mode():
                self(input_ids=input_ids[:1, :8].to(device))
        except (ValueError, NotImplementedError) as e:
            return f"{self.implementation} attention cannot run this model ({one_line(e, 160)})"
        return None


def reload(
    directory: Path, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict]:
    """Load the checkpoint as a user would (AutoModelForCausalLM.from_pretrained, float32, default options; the
    model's own code, copied with it, runs only with `trust_remote_code`, as the user asked for the source),
    and describe what transformers made of it. `dtype`: bfloat16 for bfloat16_check only."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:  # compressed-tensors draws its own tqdm bars on stderr; ptq shows its own progress
        with contextlib.redirect_stderr(io.StringIO()):
            model, info = AutoModelForCausalLM.from_pretrained(
                str(directory),
                dtype=dtype,
                output_loading_info=True,
                trust_remote_code=trust_remote_code,
            )
            with (
                torch.inference_mode()
            ):  # compressed-tensors decompresses the weights on the first forward
                model(input_ids=torch.zeros((1, 1), dtype=torch.long))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtqError(f"transformers cannot load the exported checkpoint: {reason}") from None
    # asked for float32, some transformers versions still hold weights in 16 bits (5.17 dequantizes fused experts
    # into bfloat16): the loader then computes another model than the checkpoint's, and the check would measure that
    state = model.state_dict()
    narrowed = [n for n, t in state.items() if t.dtype in (torch.bfloat16, torch.float16)]
    if narrowed and dtype == torch.float32:
        raise PtqError(
            f"transformers cannot load the exported checkpoint: it holds {len(narrowed)} tensor(s) in 16 bits though "
            f"float32 was asked for ('{narrowed[0]}', {state[narrowed[0]].dtype})"
        )
    model.eval()
    model.requires_grad_(False)
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    return model, {
        # some versions (5.17) quantize the KV cache themselves, by compressed-tensors' attention hook, from the
        # checkpoint's k_scale / v_scale; others leave them unused (unexpected keys)
        "kv_cache_quantized": any(n.endswith((".k_scale", ".v_scale")) for n in state),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": sorted(str(k) for k in info.get("mismatched_keys", [])),
        "quantized_layers": len(quantized),
        "input_quantized_layers": sum(
            1
            for m in quantized
            if m.quantization_scheme.input_activations is not None
            and (m.quantization_scheme.input_activations.dynamic or hasattr(m, "input_scale"))
        ),
    }


def reload_or_read(
    directory: Path, conv1d: bool, trust_remote_code: bool = False
) -> tuple[nn.Module, dict]:
    """The checkpoint reloaded by transformers; where transformers cannot run it (Conv1D layers, or its error on
    load: block or MX scales on some shapes), by ptq's own reader, with transformers' reason recorded.
    `trust_remote_code`: as the user gave it for the source (the checkpoint carries the source's own code)."""
    if conv1d:
        return reload_dequantized(directory, trust_remote_code=trust_remote_code)
    try:
        return reload(directory, trust_remote_code)
    except PtqError as e:
        model, info = reload_dequantized(
            directory,
            f"transformers cannot run this checkpoint: {str(e).removeprefix('transformers cannot load the exported checkpoint: ')}",
            trust_remote_code,
        )
    info["bfloat16"] = bfloat16_check(directory, model, trust_remote_code)
    return model, info


def bfloat16_check(directory: Path, read: nn.Module, trust_remote_code: bool = False) -> dict:
    """Where transformers cannot run the checkpoint in float32, does it in bfloat16, the dtype users load 16-bit
    models in? (compressed-tensors' MX decompression returns bfloat16 scales: "expected m1 and m2 to have the same
    dtype" in float32.) And are the weights it decompresses the files' codes x scales, those of ptq's reader (`read`,
    float32) in bfloat16? An E4M3 code times a power of two is exact in bfloat16, so MX weights must be equal bit for
    bit. {"runs", "error" where it does not, "layers": quantized layers compared, "equal": how many were}. The
    bfloat16 model (half the float32 reload's memory) is freed before the check scores anything."""
    try:
        model, _ = reload(directory, trust_remote_code, dtype=torch.bfloat16)
    except PtqError as e:
        return {
            "runs": False,
            "error": str(e).removeprefix("transformers cannot load the exported checkpoint: "),
        }
    modules = dict(read.named_modules())
    compared = [
        (m.weight, modules[name].weight)
        for name, m in model.named_modules()
        if getattr(m, "quantization_scheme", None) is not None
        and name in modules
        and hasattr(m, "weight")
    ]
    equal = sum(torch.equal(w, r.to(torch.bfloat16)) for w, r in compared if w.shape == r.shape)
    del model
    return {"runs": True, "layers": len(compared), "equal": int(equal)}


def verify(
    simulated: nn.Module,
    reloaded: nn.Module,
    load_info: dict,
    expected_layers: int,
    input_ids: torch.Tensor,
    batch_size: int = 4,
    ptq_own: tuple[str, nn.Module] | None = None,
    unapplied_input_scales: dict[str, torch.Tensor] | None = None,
    directory: Path | None = None,
    expected_tensors: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Score the reloaded checkpoint against the simulation that computes what the loader computes (the gate on
    logits: KL and top-1), check the files against `expected_tensors` (simulated_tensors) bit for bit, and report
    the measured noise floor (the simulation with another attention implementation), all on the same windows,
    through the one evaluation loop.
    ptq_own: (how the loader's input rounding differs from ptq's, ptq's own simulation), where they differ (int8
    inputs over [-127, 127], vLLM's scaling of static FP8 inputs): the reloaded perplexity is also given against it.
    unapplied_input_scales: the scales the loader does not apply (unapplied_scales: fused experts' input scales in
    transformers, KV-cache scales), checked in the files only."""
    from ptq.evaluation.evaluate import evaluate

    noise = OtherAttention(simulated)
    no_noise_floor = noise.cannot_run(input_ids)
    models = (
        {"simulated": simulated, "reloaded": reloaded}
        | ({"ptq": ptq_own[1]} if ptq_own is not None else {})
        | ({"noise": noise} if no_noise_floor is None else {})
    )
    scores = evaluate(models, input_ids, batch_size)
    sim, rel, floor = scores["simulated"], scores["reloaded"], scores.get("noise")
    own = scores.get("ptq", sim)
    ppl_delta = rel.perplexity / own.perplexity - 1
    problems = []
    # transformers merges the per-expert weights and scales into its fused experts, but has no place for their input
    # scales (vLLM reads them): those keys are expected to be left over (the file check covers them).
    expert_input_scales = unapplied_input_scales or {}
    # (transformers reports them under its own module names, e.g. Mixtral's block_sparse_moe as mlp)
    left = [
        k
        for k in load_info["unexpected_keys"]
        if not (k.endswith(".input_scale") and ".experts." in k)
        and not k.endswith((".k_scale", ".v_scale"))
    ]
    if len(load_info["unexpected_keys"]) - len(left) == len(expert_input_scales):
        load_info = load_info | {"unexpected_keys": left}
    for kind_ in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if load_info[kind_]:
            problems.append(
                f"{kind_.replace('_', ' ')} on reload: {', '.join(load_info[kind_][:3])}"
            )
    if expert_input_scales:
        written = _read_tensors(directory, list(expert_input_scales))
        wrong = [
            k
            for k, v in expert_input_scales.items()
            if k not in written or not torch.equal(written[k], v)
        ]
        if wrong:
            problems.append(
                f"expert input or KV-cache scales in the checkpoint differ from ptq's: {', '.join(wrong[:3])}"
            )
    expected_tensors = expected_tensors or {}
    differing = differing_tensors(expected_tensors, directory) if expected_tensors else []
    if differing:
        problems.append(
            f"{len(differing)} quantized tensor(s) in the checkpoint differ from ptq's: {', '.join(differing[:3])}"
        )
    if load_info["input_quantized_layers"] != expected_layers:
        problems.append(
            f"the loader applies input quantization in {load_info['input_quantized_layers']} "
            f"of {expected_layers} quantized layers"
        )
    if not rel.kl_div <= VERIFY_MAX_KL:
        problems.append(
            f"KL(simulated || reloaded) {rel.kl_div:.3g} nats/token > {VERIFY_MAX_KL:g}"
        )
    if not rel.top1_agreement >= VERIFY_MIN_TOP1:
        problems.append(
            f"same top-1 token at {100 * rel.top1_agreement:.2f}% of positions (limit {100 * VERIFY_MIN_TOP1:g}%)"
        )
    return {
        "passed": not problems,
        "problems": problems,
        "criterion": VERIFY_CRITERION,
        "windows": len(input_ids),
        "seq_len": int(input_ids.shape[1]),
        "tokens": sim.tokens,
        "simulated_perplexity": sim.perplexity,
        "reloaded_perplexity": rel.perplexity,
        "ptq_perplexity": own.perplexity,
        "ppl_delta_pct": 100 * ppl_delta,
        "kl_div": rel.kl_div,
        "top1_agreement": rel.top1_agreement,
        # measured, not a limit: None where no other float order runs the model, and why
        "noise_floor": {
            "what": f"ptq's simulation with {noise.implementation} instead of "
            f"{simulated.config._attn_implementation} attention",
            "ppl_delta_pct": 100 * (floor.perplexity / sim.perplexity - 1),
            "kl_div": floor.kl_div,
            "top1_agreement": floor.top1_agreement,
        }
        if floor is not None
        else None,
        "no_noise_floor": no_noise_floor,
        "ptq_rounding": ptq_own[0] if ptq_own is not None else None,
        "tensors_checked_in_file": len(expected_tensors),
        "tensors_differing": differing,
        # the scales the loader has no place for, checked in the files: input scales, and the KV cache's k/v scales
        "input_scales_checked_in_file": sum(
            1 for k in expert_input_scales if k.endswith(".input_scale")
        ),
        "kv_scales_checked_in_file": sum(
            1 for k in expert_input_scales if k.endswith((".k_scale", ".v_scale"))
        ),
        "tolerance": {
            "max_kl_div": VERIFY_MAX_KL,
            "min_top1_agreement": VERIFY_MIN_TOP1,
            "files": "bit for bit",
        },
        "load": load_info,
    }


def reload_dequantized(
    directory: Path,
    why: str = "transformers does not load compressed-tensors Conv1D layers",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, dict]:
    """ptq's own reader, for checkpoints transformers cannot run as quantized (Conv1D layers; block and MX scales
    where transformers' compressed-tensors integration fails): every quantized weight dequantized from the files
    (codes x weight_scale, each scale repeated over its group or tile as config.json's weights say: block_structure
    rows x columns, or group_size columns, cropped at the edges; E8M0 bytes read as 2^(u - 127); in the
    file's orientation: [in, out] for Conv1D), every other tensor as stored, written as a plain float32
    checkpoint that transformers then loads with its own weight conversions (experts merged as usual);
    dynamic inputs (per tensor, token or group, as config.json's input_activations say) of the plain layers
    quantized on the fly with torch's own float8 cast. Static input scales and experts' inputs are not applied
    (verify checks static scales in the files). Deliberately simple arithmetic, read from the files and
    config.json alone, so that it checks the files rather than ptq's simulation. A model with its own code (auto_map)
    runs it with `trust_remote_code` only."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((Path(directory) / "config.json").read_text())
    scheme = next(iter(config.pop("quantization_config")["config_groups"].values()))
    weight_args = scheme.get("weights") or {}
    tile = (
        tuple(weight_args["block_structure"])
        if weight_args.get("strategy") == "block"
        else (1, weight_args["group_size"])
        if weight_args.get("strategy") == "group"
        else None
    )
    with tempfile.TemporaryDirectory(prefix="ptq-reader-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        if remote_code_files(
            config.get("auto_map")
        ):  # the model's own code, copied with the checkpoint, goes along
            for f in Path(directory).glob("*.py"):
                shutil.copyfile(f, Path(tmp) / f.name)
        try:
            with torch.device("meta"):  # which layers are Conv1D ([in, out] on disk)
                skeleton = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code),
                    trust_remote_code=trust_remote_code,
                )
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PtqError(
                f"ptq's reader cannot build the exported checkpoint's model: {reason}"
            ) from None
        model, info, stored, dynamic_layers = _read_dequantized(
            directory, tmp, scheme, tile, skeleton, trust_remote_code
        )
    input_args = scheme.get("input_activations")
    modules = dict(model.named_modules())
    hooked = [
        name for name in dynamic_layers if name in modules
    ]  # experts are merged on load: weights only
    for name in hooked:
        modules[name].register_forward_pre_hook(
            lambda m, args, a=input_args: (_dynamic_fp8(args[0], a),)
        )
    model.eval().requires_grad_(False)
    return model, {
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [],
        "quantized_layers": sum(1 for k in stored if k.endswith(".weight_scale")),
        "input_quantized_layers": len(hooked),
        "loader": f"ptq's dequantizing reader ({why})",
    }


def _read_dequantized(
    directory: Path,
    tmp: str,
    scheme: dict,
    tile: tuple[int, int] | None,
    skeleton: nn.Module,
    trust_remote_code: bool,
) -> tuple[nn.Module, dict, dict, list[str]]:
    """reload_dequantized's reading: the files' weights dequantized into `tmp` (holding the plain config.json), loaded
    by transformers; (the model, its loading info, the stored tensors, the layers with dynamic inputs)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    conv1d = {name for name, m in skeleton.named_modules() if isinstance(m, Conv1D)}
    input_args = scheme.get("input_activations")
    stored = _read_tensors(directory, None)
    dense, dynamic_layers = {}, []
    for key, t in stored.items():
        if key.endswith((".weight_scale", ".input_scale", ".k_scale", ".v_scale")):
            continue
        scale = stored.get(f"{key}_scale")
        if scale is not None:
            if scale.dtype == torch.uint8:  # E8M0
                scale = torch.exp2(scale.float() - 127)
            rows, cols = t.shape
            if (
                tile is not None
            ):  # tiles, or groups along the input: each scale over its tile, the last ones partial
                scale = scale.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[
                    :, :cols
                ]
            elif scale.numel() > 1 and key.removesuffix(".weight") in conv1d:  # [in, out] on disk
                scale = scale.reshape(1, -1)
            t = t.float() * scale
            if input_args is not None and input_args.get("dynamic"):
                dynamic_layers.append(key.removesuffix(".weight"))
        dense[key] = t.float() if t.is_floating_point() else t
    try:
        safetensors.torch.save_file(dense, str(Path(tmp) / "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # a tensor of the wrong shape (e.g. a Conv1D weight not in [in, out])
        raise PtqError(
            f"the exported checkpoint does not fit its architecture: {str(e).strip().splitlines()[-1]}"
        ) from None
    return model, info, stored, dynamic_layers


def _dynamic_fp8(x: torch.Tensor, args: dict) -> torch.Tensor:
    """Dynamic E4M3 input quantization as config.json describes it (per tensor, token or group; fp32 or E8M0
    scales: the smallest power of two >= amax / 448), by torch's float8 cast: the reader's own arithmetic."""
    shape, size = x.shape, (args.get("group_size") if args.get("strategy") == "group" else None)
    v = x.float()
    if size:
        v = torch.nn.functional.pad(v, (0, -v.shape[-1] % size))
        v = v.reshape(*v.shape[:-1], -1, size)
    amax_ = v.abs().amax() if args.get("strategy") == "tensor" else v.abs().amax(-1, keepdim=True)
    scale = amax_ / 448.0
    if args.get("scale_dtype") is not None:  # E8M0: round the scale up to a power of two
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(scale > 0, scale, 1.0)
    q = (v / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    if size:
        q = q.reshape(*q.shape[:-2], -1)[..., : shape[-1]]
    return q.to(x.dtype)


def _read_tensors(directory: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint directory's safetensors files (all of them for None)."""
    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as f:
            found |= {k: f.get_tensor(k) for k in f.keys() if names is None or k in names}
    return found


def is_exported(directory: Path) -> dict | None:
    """The compressed-tensors quantization_config of a checkpoint directory, or None."""
    config = Path(directory) / "config.json"
    try:
        qc = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors" else None
