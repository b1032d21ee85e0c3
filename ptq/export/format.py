"""What a compressed-tensors checkpoint holds and what its loaders (transformers, vLLM) accept: the
recipes the format can express, the quantization_config written into config.json, the scale
layouts, and the recipe x architecture pairs refused before any work because no loader would run
them as simulated.

For every Linear the recipe quantizes, the checkpoint holds
    <layer>.weight        float8_e4m3fn / int8 codes, 1 byte per parameter
    <layer>.weight_scale  float32: [1] (per-tensor), [out, 1] (per-channel),
                          [ceil(out/R), ceil(in/C)] (block); or uint8 E8M0 exponents [out, in/32]
                          (MX)
    <layer>.input_scale   float32, [1], the static input scale from calibration (none for dynamic
                          inputs)
and every other tensor unchanged, in its dtype in the source checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import LinearExperts, kind
from ptq.models.names import check_experts_per_expert
from ptq.numerics.granularity import (
    PerBlock,
    PerChannel,
    PerGroup,
    PerHead,
    PerTensor,
    PerToken,
)
from ptq.quantization import engines
from ptq.quantization.plan import Plan
from ptq.quantization.recipes import Recipe, TensorQuant

# ptq NumberFormat.kind -> compressed-tensors QuantizationType
_CT_TYPE = {
    "float": "float",
    "int": "int",
}
_CT_FORMAT = {"float": "float-quantized", "int": "int-quantized"}
_DTYPE_NAMES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def check_exportable(recipe: Recipe) -> None:
    """The recipes the compressed-tensors formats can express; anything else is refused up front.
    A recipe with overrides: each of its schemes (a config group each), in one checkpoint format."""
    schemes = recipe.schemes
    for scheme in schemes[1:]:
        _check_exportable(scheme)
    _check_exportable(dataclasses.replace(recipe, overrides=()))
    formats = {checkpoint_format(s): s.name for s in schemes}
    if len(formats) > 1:
        (a, first), (b, second) = list(formats.items())[:2]
        raise PtqError(
            f"recipe '{recipe.name}' mixes {a} ('{first}') and {b} ('{second}') layers: ptq "
            "quantize writes one compressed-tensors format per checkpoint"
        )


def checkpoint_format(recipe: Recipe) -> str:
    """The compressed-tensors format of a recipe's checkpoint (of one of its schemes)."""
    if recipe.weights.scale_format == "e8m0":
        return "mxfp8-quantized"
    return _CT_FORMAT[recipe.weights.format.kind]


def _check_exportable(recipe: Recipe) -> None:
    w, x = recipe.weights, recipe.inputs
    if w.format.name not in ("e4m3", "int8"):
        raise PtqError(
            f"recipe '{recipe.name}' stores weights as {w.format.name}: ptq quantize exports FP8 "
            "E4M3 and int8 only (the formats transformers and vLLM load as compressed-tensors)"
        )
    if x.format != w.format:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes weights to {w.format.name} but inputs to "
            f"{x.format.name}: compressed-tensors W8A8 checkpoints use one format for both"
        )
    if not (w.saturate and x.saturate):
        raise PtqError(
            f"recipe '{recipe.name}' is non-saturating: transformers and vLLM always saturate "
            "(clamp) when they quantize, so the checkpoint would not run as simulated"
        )
    if "unscaled" in (w.scale, x.scale) or "pow2" in (w.scale, x.scale):
        raise PtqError(
            f"recipe '{recipe.name}' uses '{w.scale if w.scale != 'amax' else x.scale}' scales: "
            "the checkpoint format takes amax-derived scales (or MX's E8M0), so it would not run "
            "as simulated"
        )
    if x.dynamic and isinstance(x.granularity, PerTensor):
        raise PtqError(
            f"recipe '{recipe.name}' takes one dynamic scale per input tensor: vLLM serves a "
            "compressed-tensors checkpoint's dynamic inputs per token whatever strategy it names "
            "(CompressedTensorsW8A8Fp8 / Int8), so it would not run as simulated; use dynamic "
            "per-token inputs (fp8-dynamic)"
        )
    mx = [s.scale_format == "e8m0" for s in (w, x)]
    if any(mx) and not (all(mx) and w.granularity == x.granularity == PerGroup(32)):
        raise PtqError(
            f"recipe '{recipe.name}': E8M0 scales are exported as MXFP8 only (weights and inputs "
            "in groups of 32, both with E8M0 scales), the layout compressed-tensors and vLLM read"
        )
    if isinstance(w.granularity, PerGroup) and not any(mx):
        raise PtqError(
            f"recipe '{recipe.name}' has per-group FP32 weight scales: ptq quantize exports groups "
            "as MXFP8 (E8M0, 32) only; use per-block weights (fp8-block) for FP32 scales over "
            "tiles"
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
            "kv_cache_scheme takes E4M3 with static per-tensor or per-head scales from max "
            "calibration"
        )
    beyond = [key for key in recipe.beyond_linear if key != "kv_cache"]
    if beyond:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes {' and '.join(recipe.beyond_linear)} inputs: the "
            "checkpoint format quantizes Linear layers and the KV cache only, so it would not run "
            "as simulated"
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
    CompressedTensorsW8A8Fp8): block weights take dynamic input groups of block_structure[0]
    (whatever group the config names) and no static input scale (an assert at load); per-tensor and
    per-channel weights take a static per-tensor input scale (recipes allow no other static one) or
    a dynamic per-token one (other dynamic inputs are served per token); int8 weights are per-tensor
    or per-channel ("No compressed-tensors compatible scheme" otherwise)."""
    w, x = recipe.weights, recipe.inputs
    wg, xg = w.granularity, x.granularity
    pair = f"recipe '{recipe.name}' pairs {wg.describe()} weights with {x.describe()} inputs"
    if isinstance(wg, PerBlock):
        if w.format.kind == "int":
            raise PtqError(
                f"recipe '{recipe.name}' has int8 block weights: vLLM loads int8 weights per "
                "tensor or per channel only; use fp8-block, or per-channel int8 weights"
            )
        if not x.dynamic:
            raise PtqError(
                f"{pair}: vLLM refuses block weights with a static input scale; use fp8-block"
            )
        if not (wg.rows == wg.cols and xg == PerGroup(wg.cols)):
            raise PtqError(
                f"{pair}: vLLM serves block weights' inputs in dynamic groups of 1 x {wg.rows} "
                "(the block's rows) whatever the checkpoint names, so it would not run as "
                "simulated; use square blocks and input groups of their size (fp8-block: 128 x "
                "128, groups of 128)"
            )
    elif x.dynamic and not isinstance(xg, PerToken):
        raise PtqError(
            f"{pair}: vLLM serves the dynamic inputs of per-tensor and per-channel weights per "
            "token whatever the checkpoint names, so it would not run as simulated; use dynamic "
            "per-token inputs"
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


def quantization_config(
    recipe: Recipe, ignore: list[str], layers: dict[int, list[str]] | None = None
):
    """The compressed-tensors QuantizationConfig for `recipe`: one config group for every Linear
    except the `ignore`d layers (their exact names), symmetric scales, weights already compressed
    on disk. A recipe with overrides: `layers`, the layers of each of its other schemes
    (Recipe.schemes index -> names), a config group each that targets them by name (compressed-
    tensors and vLLM take a layer's exact name over the class "Linear"), as llm-compressor writes
    mixed schemes."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    groups = {}
    for i, s in enumerate(recipe.schemes):
        targets = ["Linear"] if i == 0 else sorted((layers or {}).get(i, []))
        if targets:
            groups[f"group_{i}"] = QuantizationScheme(
                targets=targets,
                weights=quantization_args(s.weights),
                input_activations=quantization_args(s.inputs),
            )
    kv_cache_scheme = None
    if recipe.kv_cache is not None:  # K and V in E4M3, static scales: self_attn.k_scale / v_scale
        from compressed_tensors.quantization import QuantizationArgs

        strategy = "attn_head" if isinstance(recipe.kv_cache.granularity, PerHead) else "tensor"
        kv_cache_scheme = QuantizationArgs(
            num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False
        )
    return QuantizationConfig(
        config_groups=groups,
        ignore=ignore,
        format=checkpoint_format(recipe),
        kv_cache_scheme=kv_cache_scheme,
        quantization_status="compressed",
    )


def weight_scale_shape(shape: tuple[int, ...], weights: TensorQuant) -> tuple[int, ...]:
    """The shape of a weight [out, in]'s weight_scale on disk (partial groups and blocks counted:
    ceil)."""
    g, (rows, cols) = weights.granularity, shape
    if isinstance(g, PerChannel):
        return (rows, 1)
    if isinstance(g, PerGroup):
        return (rows, -(-cols // g.size))
    if isinstance(g, PerBlock):
        return (-(-rows // g.rows), -(-cols // g.cols))
    return (1,)


def check_kv_cache(model: nn.Module, plan: Plan, names: list[str]) -> None:
    """Refuse a KV-cache recipe whose plan leaves some attention layer's K or V in the compute
    dtype: the checkpoint's kv_cache_scheme has no per-layer list (compressed-tensors applies it
    to every attention layer, and vLLM stores a layer without k_scale / v_scale in FP8 at scale
    1), so it would not run as simulated. And one whose attention has no k_proj to name the
    scales after."""
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
            f"recipe '{plan.recipe.name}' leaves the KV cache of '{left[0]['name']}' in the "
            f"compute dtype ({left[0]['reason']}): a checkpoint's kv_cache_scheme covers every "
            "attention layer, so the engine would serve it otherwise than simulated; quantize "
            "every layer's KV cache or none"
        )
    for layer in plan.attention:
        if f"{layer}.k_proj.weight" not in names:
            raise PtqError(
                f"attention layer '{layer}' of {type(model).__name__} has no k_proj: ptq quantize "
                "writes KV-cache scales for q/k/v-projection attention only"
            )


def check_fused_precision(model: nn.Module, quantized: list[str]) -> None:
    """Refuse, for --target vllm, a checkpoint where one of vLLM's fused layers is partly quantized:
    q/k/v, gate/up (engines.fused_groups) or an experts module (one FusedMoE: vLLM skips it whole if
    any expert layer is ignored). vLLM refuses the first ("Detected some but not all shards of ...
    are quantized. All shards of fused layers to have the same precision") and would load the second
    unquantized. transformers loads both (--target transformers)."""
    done = set(quantized)
    groups = engines.served_together(model)
    for group in groups:
        partly = [n for n in group if n not in done]
        if partly and len(partly) < len(group):
            kept = next(n for n in group if n in done)
            raise PtqError(
                f"'{partly[0]}' would stay in 16 bits while '{kept}' is quantized, and vLLM runs "
                "them as one fused layer of one precision (it refuses such a checkpoint): "
                "quantize both or neither, or export for transformers (--target transformers)"
            )


def check_loadable(
    model: nn.Module, recipe: Recipe, quantized: list[str], plan: Plan | None = None
) -> None:
    """Refuse, before any calibration, a recipe x architecture pair whose checkpoint no loader
    takes, or that the reload check cannot load. int8 experts with static input scales: vLLM has
    no fused-MoE method for them (its compressed_tensors_moe `get_moe_method` takes int8 W8A8
    experts with dynamic per-token inputs only: "Unsupported FusedMoe scheme"). And transformers
    loads no int-quantized checkpoint of a model with fused experts, quantized or left out
    ("Concatenate on tensors destined for ...experts.gate_up_proj. Ckpt contains: 0"). And
    experts that checkpoints keep fused (check_experts_per_expert). A recipe with overrides: each
    of its schemes with the layers `plan` gives it."""
    if recipe.overrides and plan is not None:
        for i, scheme in enumerate(recipe.schemes):
            layers = [n for n in quantized if plan.matmuls[n].scheme == i]
            if layers:
                check_loadable(model, dataclasses.replace(scheme, overrides=()), layers)
        return
    experts = [path for path, m in model.named_modules() if isinstance(m, LinearExperts)]
    if experts and recipe.weights.format.kind == "int":
        quantized_experts = any(kind(model.get_submodule(name)) == "Experts" for name in quantized)
        why = (
            'vLLM answers "Unsupported FusedMoe scheme" for int8 experts with static input scales, '
            "and transformers "
            if quantized_experts and recipe.inputs.static
            else "transformers "
        )
        raise PtqError(
            f"recipe '{recipe.name}' writes an int8 checkpoint of {type(model).__name__}, a "
            f"mixture-of-experts model: no loader takes it ({why}cannot load int-quantized "
            "checkpoints with fused experts); use fp8-e4m3"
        )
    w, x = recipe.weights, recipe.inputs
    fp8_experts = w.scale_format != "e8m0" and any(
        kind(model.get_submodule(n)) == "Experts" for n in quantized
    )
    if fp8_experts and (w.granularity, x.granularity, x.dynamic) not in _VLLM_FP8_EXPERTS:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes the experts of {type(model).__name__} with "
            f"{w.granularity.describe()} weights and {x.describe()} inputs: vLLM's fused-MoE FP8 "
            "method takes per-tensor weights with a static per-tensor input scale (fp8-e4m3), "
            "per-channel weights with dynamic per-token inputs (fp8-dynamic), or 128 x 128 blocks "
            "with dynamic 1 x 128 input groups (fp8-block), and refuses or reshapes the others; "
            "use one of those, or leave the experts out (targets without Experts)"
        )
    check_experts_per_expert(model)


# (weights, inputs, dynamic inputs) of FP8 experts as vLLM 0.32 serves them
# (compressed_tensors_moe_w8a8_fp8.py: per_tensor, per_channel, and block scales keyed as
# kFp8Static128BlockSym with kFp8Dynamic128Sym inputs)
_VLLM_FP8_EXPERTS = {
    (PerTensor(), PerTensor(), False),
    (PerChannel(), PerToken(), True),
    (PerBlock(128, 128), PerGroup(128), True),
}
