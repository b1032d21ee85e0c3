"""The vLLM check's two verdicts (benchmarks/vllm_check.py) without vLLM: the layer-by-layer comparison of ptq's
layers on an engine's recorded inputs and outputs (here made by numpy, the independent reference), and the noise
floor's statistic (against a printed t table); the mixed-scheme checkpoint's recipe and the check's --recipes."""

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from benchmarks.vllm_check import (
    LAYER_TOLERANCE,
    MIXED,
    MOE,
    OFFLINE,
    kernel_lines,
    label,
    layer_by_layer,
    noise_floor_pct,
    parse_names,
    select,
)
from ptq.quantization.quantize import QuantLinear
from ptq.quantization.recipes import load_recipe

SCALE = np.float32(0.0123)  # the static input scale: input amax 127 * SCALE


def int8_reference(x: np.ndarray, w: np.ndarray, reciprocal: bool = False) -> np.ndarray:
    """vLLM's int8 W8A8 in numpy: per-channel weight codes round(w / (amax / 127)), input codes x / scale (or x times
    the float32 reciprocal, vLLM-CPU's oneDNN rule) rounded half to even and saturated to [-128, 127], the integer
    product times both scales, in float64."""
    w_scale = (np.abs(w).max(1, keepdims=True) / np.float32(127)).astype(np.float32)
    w_codes = np.round(w / w_scale)
    scaled = x * (np.float32(1) / SCALE) if reciprocal else x / SCALE
    x_codes = np.clip(np.round(scaled.astype(np.float32)), -128, 127)
    return (
        (x_codes.astype(np.float64) @ w_codes.T.astype(np.float64))
        * float(SCALE)
        * w_scale.T.astype(np.float64)
    )


def a_tie(k: int = -99) -> np.float32:
    """An input near (k + 0.5) * SCALE whose code differs between x / scale and x * (1 / scale) in float32."""
    x = np.float32((k + 0.5) * float(SCALE))
    for _ in range(8):
        if np.round(np.float32(x / SCALE)) != np.round(np.float32(x * (np.float32(1) / SCALE))):
            return x
        x = np.nextafter(x, np.float32(np.inf))
    raise AssertionError("no tie found")


@pytest.fixture
def recorded(tmp_path):
    """A two-layer 'model' as ptq simulates it under --target vllm (q/k/v int8 with static input scales, o_proj a
    plain Linear), and an engine's record of it (fused qkv_proj, o_proj) made by numpy."""
    g = torch.Generator().manual_seed(0)
    spec = load_recipe("int8")
    inputs = dataclasses.replace(spec.inputs, int_range="full")  # vLLM's [-128, 127]
    model = nn.Module()
    model.attn = nn.Module()
    weights = {}
    for name, out in (("q_proj", 6), ("k_proj", 4), ("v_proj", 4)):
        linear = nn.Linear(8, out, bias=False)
        linear.weight.data = torch.randn(out, 8, generator=g)
        weights[name] = linear.weight.detach().numpy().copy()
        setattr(
            model.attn,
            name,
            QuantLinear(linear, spec.weights, inputs, torch.tensor(127 * float(SCALE))),
        )
    model.attn.o_proj = nn.Linear(8, 5, bias=False)
    x = (
        (torch.rand(16, 8, generator=g) * 2 - 1).numpy().astype(np.float32)
    )  # |x| / SCALE < 82: no tie by chance
    qkv = np.concatenate([int8_reference(x, weights[n]) for n in ("q_proj", "k_proj", "v_proj")], 1)
    o = x.astype(np.float64) @ model.attn.o_proj.weight.detach().numpy().T.astype(np.float64)
    tensors = {"attn.qkv_proj.x": x, "attn.qkv_proj.y": qkv, "attn.o_proj.x": x, "attn.o_proj.y": o}
    return model, weights, tensors, tmp_path / "layers.safetensors"


def save(tensors: dict, path, widths=None) -> None:
    widths = widths or {"attn.qkv_proj": [6, 4, 4], "attn.o_proj": [5]}
    safetensors.torch.save_file(
        {
            k: torch.tensor(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()
        },  # each its own copy
        str(path),
        metadata={"widths": json.dumps(widths)},
    )


def test_layers_agree_with_the_engines_arithmetic(recorded):
    model, _, tensors, path = recorded
    save(tensors, path)
    out = layer_by_layer(model, path)
    assert out["agrees"] and out["layers"] == 2 and out["rows"] == 32
    assert out["largest"] < 1e-6 and out["other_rounding"] == 0 and out["unexplained"] == []


def test_a_row_one_code_apart_by_the_other_rounding_rule_is_named_as_such(recorded):
    """The engine multiplied by 1 / scale where ptq (vLLM's CUDA kernel) divides: one input code apart, in one row."""
    model, weights, tensors, path = recorded
    x = tensors["attn.qkv_proj.x"].copy()
    x[3, 2] = a_tie()
    by_reciprocal = np.concatenate(
        [int8_reference(x, weights[n], True) for n in ("q_proj", "k_proj", "v_proj")], 1
    )
    by_division = np.concatenate(
        [int8_reference(x, weights[n]) for n in ("q_proj", "k_proj", "v_proj")], 1
    )
    row = np.abs(by_reciprocal[3] - by_division[3]).max() / np.abs(by_reciprocal[3]).max()
    assert row > LAYER_TOLERANCE  # the rule shows
    save(tensors | {"attn.qkv_proj.x": x, "attn.qkv_proj.y": by_reciprocal}, path)
    out = layer_by_layer(model, path)
    assert out["agrees"] and out["other_rounding"] == 1 and out["largest"] < 1e-6
    assert not any(
        m.inputs.reciprocal for m in model.modules() if isinstance(m, QuantLinear)
    )  # restored


def test_a_dynamic_fp8_row_one_code_apart_is_named_as_such(tmp_path):
    """vLLM-CPU's QuantFP8.forward_native multiplies per-token scales' reciprocal too, where ptq (vLLM's CUDA kernel)
    divides: the hand-computed tie 0x4063ffff (3.5624998) in a row whose scale is 1344 / 448 = 3 (ml_dtypes rounds)."""
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(8, 6, bias=False)
    linear.weight.data = torch.randn(6, 8, generator=g)
    spec = load_recipe("fp8-dynamic")
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.down_proj = QuantLinear(linear, spec.weights, spec.inputs, None)
    x = (torch.rand(4, 8, generator=g) * 2 - 1).numpy().astype(np.float32)
    x[2, :2] = torch.tensor([0x4063FFFF, 0x44A80000], dtype=torch.int32).view(torch.float32).numpy()
    e4m3 = ml_dtypes.float8_e4m3fn
    w = linear.weight.detach().numpy()
    w_scale = (np.abs(w).max(1, keepdims=True) / np.float32(448)).astype(np.float32)
    w_values = (w / w_scale).astype(e4m3).astype(np.float64) * w_scale
    x_scale = (np.abs(x).max(1, keepdims=True) / np.float32(448)).astype(np.float32)
    x_values = (x * (np.float32(1) / x_scale)).astype(e4m3).astype(np.float64) * x_scale
    save(
        {"mlp.down_proj.x": x, "mlp.down_proj.y": x_values @ w_values.T},
        tmp_path / "l.safetensors",
        {"mlp.down_proj": [6]},
    )
    out = layer_by_layer(model, tmp_path / "l.safetensors")
    assert out["agrees"] and out["other_rounding"] == 1 and out["largest"] < 1e-6


def test_a_row_the_engine_computed_otherwise_differs(recorded):
    model, _, tensors, path = recorded
    y = tensors["attn.qkv_proj.y"].copy()
    y[5, 7] += 1e-3 * np.abs(y[5]).max()  # one output of one row off by 0.1% of the row's largest
    save(tensors | {"attn.qkv_proj.y": y}, path)
    out = layer_by_layer(model, path)
    assert not out["agrees"] and out["other_rounding"] == 0
    assert out["unexplained"] == ["attn.qkv_proj: 1 of 16 rows, up to 0.001"]


def test_a_layer_ptq_does_not_have_differs(recorded):
    model, _, tensors, path = recorded
    save(
        tensors
        | {
            "attn.gate_up_proj.x": tensors["attn.o_proj.x"],
            "attn.gate_up_proj.y": tensors["attn.o_proj.y"],
        },
        path,
        {"attn.qkv_proj": [6, 4, 4], "attn.o_proj": [5], "attn.gate_up_proj": [5]},
    )
    out = layer_by_layer(model, path)
    assert not out["agrees"] and out["unexplained"] == [
        "attn.gate_up_proj: no layer attn.gate_proj, attn.up_proj in ptq"
    ]


def test_a_router_under_vllms_mixtral_name_is_compared_by_its_weight(tmp_path):
    """vLLM's `block_sparse_moe.gate` (a ReplicatedLinear) is transformers' `mlp.gate`, a router module that is no
    Linear: its matmul is x @ weight.T."""

    class Router(
        nn.Module
    ):  # as transformers' MixtralTopKRouter: a weight, and a forward that is more than a matmul
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(
                torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
            )

        def forward(self, x):
            raise AssertionError("the check runs the router's matmul, not its routing")

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate = Router()
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y = x.astype(np.float64) @ model.mlp.gate.weight.detach().numpy().T.astype(np.float64)
    save(
        {"block_sparse_moe.gate.x": x, "block_sparse_moe.gate.y": y},
        tmp_path / "l.safetensors",
        {"block_sparse_moe.gate": [4]},
    )
    out = layer_by_layer(model, tmp_path / "l.safetensors")
    assert out["agrees"] and out["layers"] == 1 and out["largest"] < 1e-6


@pytest.mark.parametrize(
    "logs, t_995",  # t quantiles from a printed table (two-sided 99%: 0.995)
    [([0.0, 0.01, -0.01], 9.925), ([0.0, 0.02, -0.02, 0.01, -0.01, 0.0], 4.032)],
)
def test_noise_floor_is_the_99_percent_bound_of_a_difference_of_two_runs(logs, t_995):
    sd = np.std(logs, ddof=1)
    expected = 100 * (math.exp(t_995 * sd * math.sqrt(2)) - 1)
    got = noise_floor_pct(
        [math.exp(v) * 37.5 for v in logs]
    )  # the scale of the perplexity does not matter
    assert got == pytest.approx(expected, rel=1e-3)


def test_noise_floor_of_identical_runs_is_zero():
    assert noise_floor_pct([41.25, 41.25, 41.25]) == 0.0


def test_the_mixed_checkpoint_is_fp8_e4m3_with_fp8_dynamic_and_bf16_units():
    """The mixed row's recipe is what its label says: fp8-e4m3's scheme, with whole units (q/k/v, gate/up and
    down, one o_proj) in fp8-dynamic or kept in bf16, on a 4-layer Llama (SmolLM2's architecture and names)."""
    import families

    from ptq.quantization.plan import resolve_plan

    recipe, fp8 = load_recipe(MIXED), load_recipe("fp8-e4m3")
    assert (recipe.weights, recipe.inputs, recipe.targets, recipe.ignore) == (
        fp8.weights,
        fp8.inputs,
        fp8.targets,
        fp8.ignore,
    )
    assert recipe.needs_calibration
    dynamic = load_recipe("fp8-dynamic")
    assert [(s.weights, s.inputs) for s in recipe.schemes[1:]] == [
        (dynamic.weights, dynamic.inputs)
    ]
    assert label(MIXED) == "mixed (fp8-e4m3 + fp8-dynamic + bf16)"
    plan = resolve_plan(families.build("llama", num_hidden_layers=4), recipe, "vllm")
    scheme = {
        name: recipe.schemes[m.scheme].name if m.quantized else "bf16"
        for name, m in plan.matmuls.items()
        if name != "lm_head"
    }
    other = {name: s for name, s in scheme.items() if s != recipe.name}
    qkv = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    mlp = [f"model.layers.{{}}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert other == {
        **{n.format(0): "bf16" for n in mlp},
        **dict.fromkeys(qkv, "fp8-dynamic"),
        **{n.format(2): "fp8-dynamic" for n in mlp},
        "model.layers.3.self_attn.o_proj": "bf16",
    }
    # every other layer (4 x 7, less those 10) has fp8-e4m3's static per-tensor scheme
    assert len(scheme) - len(other) == 4 * 7 - 10


def test_recipes_option_selects_checkpoints_by_short_name():
    names = parse_names("unquantized, mixed")
    assert select(OFFLINE, names) == [None, MIXED]
    assert select(MOE, names) == [None]  # the MoE control too
    assert select(MOE, parse_names("mixed")) == []  # the tiny Mixtral is then not built
    assert select(OFFLINE, None) == OFFLINE
    with pytest.raises(
        SystemExit, match="no checkpoint fp8-e5m2 in the check; its checkpoints are"
    ):
        parse_names("fp8-e5m2,int8")
    with pytest.raises(SystemExit):
        parse_names(" , ")


def test_kernel_lines_name_the_layers_of_a_mixed_checkpoints_fewer_kernels():
    per_tensor = "CompressedTensorsLinearMethod / CompressedTensorsW8A8Fp8 / PerTensorTorchFP8ScaledMMLinearKernel"
    kernels = {
        "model.embed_tokens": "UnquantizedEmbeddingMethod",
        "model.layers.0.mlp.down_proj": per_tensor,
    }
    kernels |= {f"model.layers.{i}.self_attn.qkv_proj": per_tensor for i in range(9)}
    one = {
        "vllm": {
            "layer_kernels": kernels,
            "layers": {"UnquantizedEmbeddingMethod": 1, per_tensor: 10},
        }
    }
    assert kernel_lines(one) == [
        "1 x UnquantizedEmbeddingMethod",
        f"10 x {per_tensor}",
    ]  # one linear kernel
    kernels = kernels | {"model.layers.0.mlp.down_proj": "UnquantizedLinearMethod"}
    mixed = {
        "vllm": {
            "layer_kernels": kernels,
            "layers": {
                "UnquantizedEmbeddingMethod": 1,
                per_tensor: 9,
                "UnquantizedLinearMethod": 1,
            },
        }
    }
    assert kernel_lines(mixed) == [
        "1 x UnquantizedEmbeddingMethod",
        f"9 x {per_tensor}",  # more than NAMED_LAYERS: counted only
        "1 x UnquantizedLinearMethod: model.layers.0.mlp.down_proj",
    ]
    assert kernel_lines({"vllm": {"error": "ValueError: no kernel"}}) == []
