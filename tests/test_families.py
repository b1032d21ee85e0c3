"""Every architecture family on a tiny random model: linearized (Conv1D and fused experts as Linear layers) and
quantized with a pass-through format the logits are the unquantized model's; a counting quantizer sees every
matmul weight, every expert's gate, up and down included; calibration reaches every expert."""

from __future__ import annotations

import json

import families
import pytest
import torch

from ptq.calibration.calibrate import calibrate
from ptq.calibration.clips import quantize_, quantize_variants
from ptq.models.matmuls import LinearExperts, kind, linearize
from ptq.numerics.formats import NumberFormat
from ptq.quantization import quantize as quantize_module
from ptq.quantization.plan import calibration_targets, resolve_plan, resolve_plans
from ptq.quantization.quantize import QuantLinear
from ptq.quantization.recipes import Recipe, TensorQuant, load_recipe

# float32 "rounding": 23 mantissa bits and float32's own exponent range, so rounding is the identity; unscaled
FP32 = NumberFormat(
    "fp32",
    "float",
    8,
    23,
    127,
    torch.finfo(torch.float32).max,
    2.0**-126,
    True,
    torch.float32,
    False,
    32,
)
PASS_THROUGH = Recipe(
    "pass-through",
    "identity",
    TensorQuant(FP32, saturate=False),
    TensorQuant(FP32, saturate=False),
    ignore=(),
)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_pass_through_quantizer_gives_the_unquantized_logits(family):
    model = families.build(family)
    ids = _ids()
    with torch.inference_mode():
        expected = model(ids).logits
        linearize(model)
        quantize_(model, PASS_THROUGH, None)
        got = model(ids).logits
    special = [m for m in model.modules() if kind(m) in ("Conv1D", "Experts")]
    assert (len(special) > 0) == (family == "gpt2" or family in families.MOE_FAMILIES)
    assert all(isinstance(m, QuantLinear) for m in special)
    experts = [m for m in model.modules() if isinstance(m, LinearExperts)]
    assert (len(experts) > 0) == (family in families.MOE_FAMILIES)
    assert all(
        m._grouped[1] is not None for m in experts
    )  # quantized experts run grouped, not one by one
    # Same arithmetic, up to the order of summation where a loop over experts replaces grouped_mm (none on CPU)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_counting_quantizer_sees_every_matmul_weight(family, monkeypatch):
    model = linearize(families.build(family))
    seen = []
    original = quantize_module.quantize_weight

    def counting(w, weights, layer="?", *shared_amax):
        seen.append(layer)
        return original(w, weights, layer, *shared_amax)

    monkeypatch.setattr(quantize_module, "quantize_weight", counting)
    recipe = load_recipe("fp8-e4m3")
    layers, _ = calibration_targets(resolve_plans(model, [recipe]).values())
    calibration = calibrate(model, _ids(2), layers, batch_size=1)
    quantize_(model, recipe, calibration)
    cov = resolve_plan(linearize(families.build(family)), recipe).coverage()
    expected = [
        n
        for n, m in linearize(families.build(family)).named_modules()
        if kind(m) in ("Linear", "Conv1D", "Experts") and isinstance(m, torch.nn.Linear)
    ]
    assert sorted(seen) == sorted(
        expected
    )  # lm_head too: left out by the recipe, it is rounded as the bf16 baseline
    assert not calibration.metadata.get(
        "unseen_layers"
    )  # every expert got tokens (all experts calibrated)
    if family in families.MOE_FAMILIES:
        config = model.config
        n = next(
            getattr(config, k)
            for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
            if isinstance(getattr(config, k, None), int)
        )
        for e in range(n):
            assert any(f".experts.{e}.down_proj" in name for name in seen)
            assert any(f".experts.{e}.up_proj" in name for name in seen)
    # Coverage: everything but lm_head (and the routers, left in the compute dtype by design) is quantized
    left = {x["name"] for x in cov["left_out"]}
    assert "lm_head" in left
    assert all(
        x["name"] == "lm_head" or x["reason"].startswith("router") for x in cov["left_out"]
    ), cov["left_out"]
    assert cov["quantized_weight_params"] == sum(
        m.weight.numel()
        for n, m in linearize(families.build(family)).named_modules()
        if n in set(expected) - {"lm_head"}
    )


def test_routed_only_calibration_leaves_unreached_experts_to_the_fallback():
    model = linearize(families.build("mixtral"))
    for m in model.modules():  # route every token to experts 0 and 1
        if isinstance(m, LinearExperts):
            m.register_forward_pre_hook(
                lambda mod, args: (args[0], torch.zeros_like(args[1]) + torch.arange(2), args[2])
            )
    recipe = load_recipe("fp8-e4m3")
    layers, _ = calibration_targets(resolve_plans(model, [recipe]).values())
    routed = calibrate(model, _ids(), layers, batch_size=1, all_experts=False)
    unseen = {u["layer"] for u in routed.metadata["unseen_layers"]}
    assert {
        f"model.layers.{i}.mlp.experts.{e}.{p}"
        for i in (0, 1)
        for e in (2, 3)
        for p in ("gate_proj", "up_proj", "down_proj")
    } == unseen
    every = calibrate(model, _ids(), layers, batch_size=1, all_experts=True)
    assert not every.metadata.get("unseen_layers")
    assert all(not m.all_experts for m in model.modules() if isinstance(m, LinearExperts))


def test_grouped_experts_match_the_expert_by_expert_loop():
    # experts of whole 128 x 128 blocks (two block rows for gate and up), so that fp8-block quantizes them too
    model = linearize(families.build("qwen3_moe", hidden_size=128, moe_intermediate_size=256))
    names = ("fp8-e4m3", "int8", "fp8-dynamic", "mxfp8", "fp8-block")
    recipes = [load_recipe(n) for n in names]
    layers, _ = calibration_targets(resolve_plans(model, recipes).values())
    calibration = calibrate(model, _ids(), layers, batch_size=1)
    ids = _ids(3)
    for name, variant in quantize_variants(model, recipes, calibration).items():
        experts = [m for m in variant.modules() if isinstance(m, LinearExperts)]
        # every granularity runs grouped (a block's scales repeated over its rows, GroupedExperts)
        expected = {
            "fp8-e4m3": "e4m3 per-tensor",
            "int8": "int8 per-channel",
            "fp8-dynamic": "e4m3 per-channel",
            "mxfp8": "e4m3 per-group-32 e8m0 scales",
            "fp8-block": "e4m3 per-block-128x128",
        }
        assert {m[0].down_proj.weights.describe() for m in experts} == {expected[name]}
        assert all(m._grouped_weights() is not None for m in experts), name
        with torch.inference_mode():
            grouped = variant(ids).logits
            for m in experts:
                m._grouped_weights = lambda: None  # the loop over experts, module by module
            looped = variant(ids).logits
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)


def test_a_large_experts_layer_is_dequantized_a_few_experts_at_a_time_with_the_same_output(
    monkeypatch,
):
    # All experts' weights at once would pass WEIGHT_BLOCK_BYTES (set here to two experts' gate/up in float32): they
    # are dequantized two experts at a time (down: four), each group's rows computed into the output, the same
    # logits bit for bit; experts that no token is routed to (2 and 3 here) are not dequantized at all.
    model = linearize(families.build("qwen3_moe", hidden_size=128, moe_intermediate_size=256))
    recipes = [load_recipe(n) for n in ("fp8-dynamic", "fp8-block")]
    ids = _ids(3)
    made = []
    dequantize_weight = quantize_module.dequantize_weight

    def recording(codes, *args):
        if codes.dim() == 3:  # a stack of experts' weights
            made.append(len(codes))
        return dequantize_weight(codes, *args)

    monkeypatch.setattr(quantize_module, "dequantize_weight", recording)
    for variant in quantize_variants(model, recipes, None).values():
        with torch.inference_mode():
            whole = variant(ids).logits
            assert made == [4, 4] * 2  # gate/up and down of both MoE layers, all experts at once
            monkeypatch.setattr(quantize_module, "WEIGHT_BLOCK_BYTES", 2 * 512 * 128 * 4)
            made.clear()
            chunked = variant(ids).logits
            assert made == [2, 2, 4] * 2  # gate/up two experts at a time, down (half the size) four
            assert torch.equal(chunked, whole)
            for m in variant.modules():  # route every token to experts 0 and 1
                if isinstance(m, LinearExperts):
                    m.register_forward_pre_hook(
                        lambda mod, args: (
                            args[0],
                            torch.zeros_like(args[1]) + torch.arange(2),
                            args[2],
                        )
                    )
            made.clear()
            variant(ids)
            assert made == [2, 4] * 2  # gate/up: experts 0-1 only; down: 0-3 in one group
            monkeypatch.setattr(quantize_module, "WEIGHT_BLOCK_BYTES", 64 * 2**20)
            made.clear()


def test_compare_and_quantize_a_moe_model_cover_every_expert(tmp_path, ptq_cli, ptq_run, text_file):
    from conftest import make_tokenizer

    model_dir = tmp_path / "mixtral"
    families.build("mixtral").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    common = ["--seq-len", "16", "--calib-data", str(text_file), "--eval-data", str(text_file)]
    code, out, err = ptq_cli(
        "compare",
        model_dir,
        "--recipes",
        "fp8-e4m3,int8",
        "--max-windows",
        "2",
        "--calib-samples",
        "2",
        "--out",
        tmp_path / "r",
        "--no-plots",
        *common,
    )
    assert code == 0, err
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    for v in results["variants"]:
        cov = v["coverage"]
        expert = [x for x in cov["left_out"] if ".experts." in x["name"]]
        assert not expert
        assert {x["name"] for x in cov["left_out"]} == {
            "lm_head",
            "model.layers.0.mlp.gate.weight",
            "model.layers.1.mlp.gate.weight",
        }
    report = (tmp_path / "r" / "report.md").read_text()
    assert (
        "of matmul weight parameters quantized" in report and "router (MixtralTopKRouter)" in report
    )
    code, out, err = ptq_run(
        "quantize",
        model_dir,
        quiet=None,
        seq_len=16,
        samples=2,
        verify_windows=2,
        o=tmp_path / "ckpt",
    )
    assert code == 0, err
    info = json.loads((tmp_path / "ckpt" / "ptq-export.json").read_text())
    assert info["verification"]["passed"] and info["verification"]["kl_div"] <= 1e-6
    # 2 layers x 4 experts x 3 projections, whose input scales transformers has no place for; where ptq's reader
    # stands in (transformers 5.17 holds the experts in bf16), all 32 quantized layers' (it applies no static scale)
    reader = info["verification"]["loader"].startswith("ptq's dequantizing reader")
    assert info["verification"]["input_scales_checked_in_file"] == (32 if reader else 2 * 4 * 3)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert (
            f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight").dtype
            == torch.float8_e4m3fn
        )
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            for t in ("weight", "weight_scale", "input_scale"):
                assert f"model.layers.0.block_sparse_moe.experts.{e}.{w}.{t}" in keys


def test_gpt2_conv1d_layers_are_quantized_and_exported_in_conv1d_orientation(
    tmp_path, ptq_cli, ptq_run, text_file
):
    import ml_dtypes
    import numpy as np
    from conftest import make_tokenizer
    from safetensors import safe_open

    model_dir = tmp_path / "gpt2"
    original = families.build("gpt2")
    original.save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    common = ["--seq-len", "16", "--calib-data", str(text_file), "--eval-data", str(text_file)]
    code, _, err = ptq_cli(
        "compare",
        model_dir,
        "--recipes",
        "fp8-e4m3",
        "--max-windows",
        "2",
        "--calib-samples",
        "2",
        "--out",
        tmp_path / "r",
        "--no-plots",
        *common,
    )
    assert code == 0, err
    cov = json.loads((tmp_path / "r" / "results.json").read_text())["variants"][0]["coverage"]
    assert [x["name"] for x in cov["left_out"]] == ["lm_head"]
    code, _, err = ptq_run(
        "quantize", model_dir, quiet=None, seq_len=16, samples=2, o=tmp_path / "ckpt"
    )
    assert code == 0, err
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        codes = f.get_tensor("transformer.h.0.attn.c_attn.weight")
        scale = f.get_tensor("transformer.h.0.attn.c_attn.weight_scale")
    info = json.loads((tmp_path / "ckpt" / "ptq-export.json").read_text())["verification"]
    assert (
        info["passed"]
        and info["kl_div"] <= 1e-6
        and info["loader"].startswith("ptq's dequantizing reader")
    )
    assert (
        info["input_scales_checked_in_file"] == 2 * 4
    )  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks
    w = original.transformer.h[0].attn.c_attn.weight.detach()  # Conv1D: [in, out]
    assert codes.shape == w.shape and codes.dtype == torch.float8_e4m3fn
    # independent reference: ml_dtypes' E4M3 rounding of w / (amax / 448), bit for bit
    expected_scale = np.float32(w.abs().max().item()) / np.float32(448.0)
    assert scale.item() == expected_scale
    reference = (w.numpy() / expected_scale).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(codes.view(torch.uint8).numpy(), reference.view(np.uint8))


def test_strict_coverage_refuses_weights_ptq_cannot_quantize(
    tmp_path, ptq_cli, text_file, tiny_model
):

    class Unknown(
        torch.nn.Module
    ):  # a matmul weight that is neither Linear, Conv1D nor known experts
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.weight = torch.nn.Parameter(torch.eye(inner.in_features))

        def forward(self, x):
            return self.inner(x @ self.weight)

    from ptq.models import loading as models_module

    load = models_module.load_model

    def load_with_unknown(*args, **kwargs):
        loaded = load(*args, **kwargs)
        mlp = loaded.model.model.layers[0].mlp
        mlp.down_proj = Unknown(mlp.down_proj)
        return loaded

    import ptq.commands.common as common

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "load_model", load_with_unknown)
        args = [
            "compare",
            tiny_model,
            "--recipes",
            "fp8-e4m3",
            "--max-windows",
            "2",
            "--calib-samples",
            "2",
            "--seq-len",
            "16",
            "--calib-data",
            str(text_file),
            "--eval-data",
            str(text_file),
            "--no-plots",
        ]
        code, _, err = ptq_cli(*args, "--out", tmp_path / "a")
        assert code == 0 and "warning: 1 matmul weight(s) ptq cannot quantize" in err
        assert "model.layers.0.mlp.down_proj.weight" in err
        code, _, err = ptq_cli(*args, "--out", tmp_path / "b", "--strict-coverage")
        assert (
            code == 2
            and "--strict-coverage" in err
            and not (tmp_path / "b" / "results.json").exists()
        )


def test_convolutions_are_left_out_as_convolutions_not_fused_experts():
    from ptq.models.matmuls import unsupported, unsupported_weights

    class Block(torch.nn.Module):  # Mamba's depthwise conv1d has a 3-D weight, like fused experts
        def __init__(self):
            super().__init__()
            self.in_proj = torch.nn.Linear(8, 8)
            self.conv1d = torch.nn.Conv1d(8, 8, kernel_size=4, groups=8)
            self.conv2d = torch.nn.Conv2d(3, 4, kernel_size=3)

    left = {x.name: x.reason for x in unsupported(Block())}
    assert set(left) == {"conv1d.weight", "conv2d.weight"}
    assert (
        left["conv1d.weight"]
        == "not supported (Conv1d is a convolution, which ptq does not quantize)"
    )
    assert (
        left["conv2d.weight"]
        == "not supported (Conv2d is a convolution, which ptq does not quantize)"
    )
    assert not any("fused experts" in reason for reason in left.values())
    cov = {"left_out": [{"name": n, "params": 1, "reason": r} for n, r in left.items()]}
    assert len(unsupported_weights(cov)) == 2


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_the_structure_built_from_the_config_is_the_loaded_models(family, tmp_path):
    """`ptq inspect` builds the model from its config on the meta device (no weights read or downloaded): its
    matmuls, their shapes and every shipped recipe's plan (for each target) are those of the model loaded whole."""
    from pathlib import Path

    from ptq.models.loading import linear_layers, load_model, load_structure

    folder = tmp_path / family
    families.build(family).save_pretrained(folder)
    families.make_tokenizer().save_pretrained(folder)
    loaded, built = (
        load_model(str(folder), memory_check=False).model,
        load_structure(str(folder)).model,
    )
    assert all(p.device.type == "meta" for p in built.parameters())

    def layers(model):
        return [(n, kind(m), tuple(m.weight.shape)) for n, m in linear_layers(model).items()]

    assert layers(built) == layers(loaded)
    recipes = [
        load_recipe(p.stem) for p in sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
    ]
    for target in ("vllm", "transformers"):
        plans, expected = (
            resolve_plans(built, recipes, target),
            resolve_plans(loaded, recipes, target),
        )
        for name, plan in plans.items():
            assert plan.matmuls == expected[name].matmuls, (target, name)
            assert (plan.attention, plan.residual) == (
                expected[name].attention,
                expected[name].residual,
            )
            assert (plan.unsupported, plan.other_attention) == (
                expected[name].unsupported,
                expected[name].other_attention,
            )
