"""The FP8 schemes engines serve (fp8-dynamic, fp8-block, mxfp8): granularities and E8M0 scales against
independent references (numpy, ml_dtypes, hand-computed cases), the plan as the one place that decides, and
checkpoints that match compressed-tensors' own preset definitions."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import make_tokenizer

from ptq.errors import PtqError
from ptq.numerics import granularity as gr
from ptq.numerics.formats import FORMATS
from ptq.quantization.quantize import quantize_activation, quantize_weight
from ptq.quantization.recipes import TensorQuant, load_recipe, parse_recipe

E4M3 = FORMATS["e4m3"]


def _e4m3_codes(v: np.ndarray) -> np.ndarray:
    """ml_dtypes' E4M3 (round to nearest even), saturating as every FP8 loader does."""
    return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)


# -- E8M0 scales ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group_amax, exponent",
    [
        (448.0, 0),  # exactly the format's max: 2^0, nothing clips
        (
            449.0,
            1,
        ),  # just above: the next power (the OCP v1.0 floor rule would give 2^0 and clip it to 448)
        (1.0, -8),  # 1 / 2^-8 = 256 <= 448, while 2^-9 would put it at 512
        (14.0, -5),  # 1.75 * 2^3: exactly 448 * 2^-5
        (14.000001, -4),
        (0.0, 0),  # an all-zero group: any scale; 2^0
        (1e-45, -127),  # below E8M0's range: its smallest scale
    ],
)
def test_e8m0_scale_is_the_smallest_power_of_two_that_does_not_clip(group_amax, exponent):
    scale = gr.e8m0_scale(torch.tensor([group_amax], dtype=torch.float32), 448.0)
    assert scale.item() == 2.0**exponent
    code = gr.e8m0_codes(scale)
    assert code.dtype == torch.uint8 and code.item() == exponent + 127
    # the byte is ml_dtypes' float8_e8m0fnu encoding of the same power of two
    assert (
        np.array([2.0**exponent], dtype=np.float32)
        .astype(ml_dtypes.float8_e8m0fnu)
        .view(np.uint8)[0]
        == code.item()
    )


def test_e8m0_scale_against_numpy_on_random_amax():
    a = np.abs(np.random.default_rng(0).standard_normal(4096).astype(np.float32)) * np.float32(
        2.0
    ) ** np.random.default_rng(1).integers(-20, 20, 4096).astype(np.float32)
    expected = np.exp2(np.ceil(np.log2(a.astype(np.float64) / 448.0)))
    got = gr.e8m0_scale(torch.from_numpy(a), 448.0).numpy()
    assert np.array_equal(got, expected.astype(np.float32))


# -- Granularities against numpy + ml_dtypes ----------------------------------------------------------------


def test_block_weights_match_an_independent_reference_with_partial_tiles():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.05
    spec = TensorQuant(E4M3, gr.PerBlock(128, 128))
    codes, scale = quantize_weight(w, spec)
    assert (
        scale.shape == (2, 3) and codes.shape == (200, 300) and codes.dtype == torch.float8_e4m3fn
    )
    wn = w.numpy()
    for i in range(2):
        for j in range(3):
            tile = wn[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            s = np.float32(np.abs(tile).max()) / np.float32(448.0)
            assert scale[i, j].item() == s
            ref = _e4m3_codes(tile / s)
            got = codes[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].view(torch.uint8).numpy()
            assert np.array_equal(got, ref.view(np.uint8))


def test_mx_weights_match_an_independent_reference():
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(1)) * 3
    spec = TensorQuant(E4M3, gr.PerGroup(32), scale_format="e8m0")
    codes, scale = quantize_weight(w, spec)
    assert scale.shape == (8, 3)
    groups = w.numpy().reshape(8, 3, 32)
    s = np.exp2(np.ceil(np.log2(np.abs(groups).max(-1).astype(np.float64) / 448.0))).astype(
        np.float32
    )
    assert np.array_equal(scale.numpy(), s)
    ref = _e4m3_codes(groups / s[..., None]).reshape(8, 96)
    assert np.array_equal(codes.view(torch.uint8).numpy(), ref.view(np.uint8))


@pytest.mark.parametrize(
    "spec",
    [
        TensorQuant(E4M3, gr.PerGroup(128), dynamic=True),
        TensorQuant(E4M3, gr.PerGroup(32), dynamic=True, scale_format="e8m0"),
        TensorQuant(E4M3, gr.PerToken(), dynamic=True),
        TensorQuant(E4M3, gr.PerTensor(), dynamic=True),
    ],
    ids=lambda s: s.describe(),
)
def test_dynamic_inputs_match_an_independent_reference(spec):
    x = torch.randn(3, 5, 320, generator=torch.Generator().manual_seed(2)) * 4
    x[0, 0, :7] = 0.0
    got = quantize_activation(x, spec)[0].numpy()
    xn = x.numpy().astype(np.float32)
    g = spec.granularity
    size = g.size if isinstance(g, gr.PerGroup) else (320 if isinstance(g, gr.PerToken) else None)
    if size is None:
        view = xn.reshape(1, -1)
    else:
        view = np.pad(xn, [(0, 0), (0, 0), (0, -320 % size)]).reshape(3, 5, -1, size)
    amax_ = np.abs(view).max(-1, keepdims=True)
    s = amax_ / np.float32(448.0)
    if spec.scale_format == "e8m0":
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1.0))
    ref = _e4m3_codes(view / s).astype(np.float32) * s
    ref = ref.reshape(3, 5, -1)[..., :320] if size else ref.reshape(3, 5, 320)
    assert np.array_equal(got, ref)


def test_a_group_that_does_not_divide_the_row_is_partial_and_padding_changes_no_amax():
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(3))
    spec = TensorQuant(E4M3, gr.PerGroup(128), dynamic=True)
    full = quantize_activation(x, spec)[0]
    # the last 72 elements form their own group: quantizing them alone gives the same values
    tail = quantize_activation(
        x[:, 128:].contiguous(), TensorQuant(E4M3, gr.PerToken(), dynamic=True)
    )[0]
    assert torch.equal(full[:, 128:], tail)


# -- Recipes: the vocabulary, and what is refused ------------------------------------------------------------


def test_builtin_scheme_recipes():
    dynamic, block, mx, static = (
        load_recipe(n) for n in ("fp8-dynamic", "fp8-block", "mxfp8", "fp8-e4m3")
    )
    assert (
        dynamic.weights.granularity == gr.PerChannel()
        and dynamic.inputs.granularity == gr.PerToken()
    )
    assert dynamic.inputs.dynamic and not dynamic.needs_calibration
    assert block.weights.granularity == gr.PerBlock(
        128, 128
    ) and block.inputs.granularity == gr.PerGroup(128)
    assert (
        mx.weights.scale_format == mx.inputs.scale_format == "e8m0"
        and mx.inputs.granularity == gr.PerGroup(32)
    )
    assert static.needs_calibration and static.inputs.granularity == gr.PerTensor()
    # the earlier name keeps its meaning
    assert load_recipe("fp8-e4m3-dynamic").weights == dynamic.weights
    assert load_recipe("fp8-e4m3-dynamic").inputs == dynamic.inputs


@pytest.mark.parametrize(
    "weights, inputs, message",
    [
        (
            {"format": "e4m3", "granularity": "token"},
            {"format": "e4m3"},
            "per-token scales apply to activations",
        ),
        (
            {"format": "e4m3"},
            {"format": "e4m3", "granularity": "group", "group_size": 32},
            "computed on the fly",
        ),
        ({"format": "e4m3"}, {"format": "e4m3", "granularity": "channel"}, "apply to weights only"),
        ({"format": "e4m3", "granularity": "group"}, {"format": "e4m3"}, "needs 'group_size'"),
        (
            {"format": "e4m3", "granularity": "group", "group_size": 0},
            {"format": "e4m3"},
            "needs 'group_size'",
        ),
        (
            {"format": "e4m3", "granularity": "block", "block_size": [128]},
            {"format": "e4m3"},
            "needs 'block_size'",
        ),
        (
            {"format": "e4m3", "group_size": 32},
            {"format": "e4m3"},
            "'group_size' applies to granularity 'group'",
        ),
        ({"format": "int8", "scale_format": "e8m0"}, {"format": "int8"}, "scale_format 'e8m0'"),
        (
            {"format": "e4m3"},
            {"format": "e4m3", "dynamic": True, "observer": "mse"},
            "observer calibrates a static scale",
        ),
    ],
)
def test_combinations_that_make_no_sense_are_refused_in_one_line(weights, inputs, message):
    with pytest.raises(PtqError, match=message) as e:
        parse_recipe({"name": "x", "weights": weights, "inputs": inputs})
    assert "\n" not in str(e.value)


# -- The plan is the one place that decides ------------------------------------------------------------------


def _odd_llama(path):
    """hidden 48 (not a multiple of MX's 32), attention 4 x 16 = 64 and MLP 64 wide: q/k/v/gate/up cannot take
    groups of 32 along their input, o_proj and down_proj can."""
    from conftest import save_tiny_llama

    return save_tiny_llama(
        path,
        hidden_size=48,
        intermediate_size=64,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def test_coverage_inspect_and_export_agree_on_layers_left_out_for_three_reasons(tmp_path, ptq_run):
    from ptq.commands.inspect import run_inspect

    model = _odd_llama(tmp_path / "odd")
    recipe = tmp_path / "mx-layer0.yaml"
    recipe.write_text(
        "name: mx-layer0\ninclude: ['model.layers.0.*', 'lm_head']\nignore: [lm_head]\n"
        "weights: {format: e4m3, granularity: group, group_size: 32, scale_format: e8m0}\n"
        "inputs: {format: e4m3, granularity: group, group_size: 32, dynamic: true, scale_format: e8m0}\n"
    )
    inspected = run_inspect(str(model), [str(recipe)])
    rows = {row["layer"]: row["recipes"]["mx-layer0"] for row in inspected["layers"]}
    quantized = {n for n, r in rows.items() if r["quantized"]}
    assert quantized == {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"}
    reasons = {n: r["reason"] for n, r in rows.items() if not r["quantized"]}
    assert reasons["lm_head"].startswith("left out by the recipe (ignore: lm_head")
    assert "include patterns" in reasons["model.layers.1.mlp.down_proj"]
    assert reasons["model.layers.0.self_attn.q_proj"].startswith("shape: in_features 48")
    assert (
        len({r.split(" (")[0].split(":")[0] for r in reasons.values()}) >= 2
        and len(set(reasons.values())) >= 3
    )

    coverage = inspected["recipes"]["mx-layer0"]["coverage"]
    assert {x["name"]: x["reason"] for x in coverage["left_out"]} == reasons

    code, _, err = ptq_run(
        "quantize", model, samples=None, recipe=recipe, verify_windows=2, o=tmp_path / "out"
    )
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted(reasons)
    info = json.loads((tmp_path / "out" / "ptq-export.json").read_text())
    assert (
        info["format"]["quantized_layers"] == 2
        and info["coverage"]["left_out"] == coverage["left_out"]
    )
    assert info["verification"]["passed"]


def test_kv_cache_and_attention_inputs_left_out_are_named_with_their_reason(
    tmp_path, ptq_cli, text_file
):
    """The attention inputs and KV cache a recipe asks for but the plan leaves in the compute dtype are in the
    coverage, `ptq inspect` and the report: those the recipe's ignore patterns leave out, and whole attention layers
    that compute attention in their own code (Bloom's), which --strict-coverage refuses."""
    import families

    from ptq.commands.inspect import run_inspect

    llama = tmp_path / "llama"
    families.build("llama").save_pretrained(llama)
    make_tokenizer().save_pretrained(llama)
    recipe = tmp_path / "partial-kv.yaml"
    recipe.write_text(
        "name: partial-kv\nweights: {format: e4m3}\ninputs: {format: e4m3}\nkv_cache: {format: e4m3}\n"
        "ignore: [lm_head, 'model.layers.1.self_attn.value']\n"
    )
    inspected = run_inspect(str(llama), [str(recipe)])
    left = inspected["recipes"]["partial-kv"]["coverage"]["attention_left_out"]
    assert left == [
        {
            "name": "model.layers.1.self_attn.kv_cache.value",
            "reason": "left out by the recipe (ignore: model.layers.1.self_attn.value)",
        }
    ]
    assert (
        "`model.layers.1.self_attn.kv_cache.value`: left out by the recipe"
        in (inspected["recipes"]["partial-kv"]["coverage_line"])
    )

    bloom = tmp_path / "bloom"
    families.build("bloom").save_pretrained(bloom)
    make_tokenizer().save_pretrained(bloom)
    run = (
        "compare",
        bloom,
        "--recipes",
        "fp8-e4m3+kv",
        "--calib-data",
        text_file,
        "--eval-data",
        text_file,
    )
    small = (
        "--calib-samples",
        "2",
        "--max-windows",
        "4",
        "--seq-len",
        "16",
        "--tasks",
        "",
        "--no-plots",
    )
    code, _, err = ptq_cli(*run, *small, "--out", tmp_path / "report")
    assert code == 0, err
    assert "2 attention layer(s) whose inputs and KV cache ptq cannot quantize" in err
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    (variant,) = results["variants"]
    left = variant["coverage"]["attention_left_out"]
    assert [x["name"] for x in left] == [
        "transformer.h.0.self_attention",
        "transformer.h.1.self_attention",
    ]
    assert all(
        x["reason"].startswith("not supported: BloomAttention computes attention in its own code")
        for x in left
    )
    assert (
        "BloomAttention computes attention in its own code"
        in (tmp_path / "report" / "report.md").read_text()
    )
    code, _, err = ptq_cli(*run, *small, "--out", tmp_path / "strict", "--strict-coverage")
    assert (
        code == 2
        and "--strict-coverage refuses a partial answer" in err
        and not (tmp_path / "strict").exists()
    )


# -- Checkpoints match compressed-tensors' presets -----------------------------------------------------------

PRESETS = {
    "fp8-e4m3": "FP8",
    "fp8-dynamic": "FP8_DYNAMIC",
    "fp8-block": "FP8_BLOCK",
    "mxfp8": "MXFP8",
}
ARG_FIELDS = (
    "num_bits",
    "type",
    "strategy",
    "group_size",
    "block_structure",
    "dynamic",
    "symmetric",
    "scale_dtype",
)


@pytest.mark.parametrize("recipe", list(PRESETS))
def test_quantization_args_are_compressed_tensors_presets(recipe):
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from ptq.export.format import quantization_config

    preset = PRESET_SCHEMES[PRESETS[recipe]]
    scheme = quantization_config(load_recipe(recipe), []).config_groups["group_0"]
    for ours, theirs in (
        (scheme.weights, preset["weights"]),
        (scheme.input_activations, preset["input_activations"]),
    ):
        assert {f: getattr(ours, f) for f in ARG_FIELDS} == {
            f: getattr(theirs, f) for f in ARG_FIELDS
        }


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Dimensions multiples of 128 where a scheme needs them: 256 hidden, 384 MLP (the block scheme's tiles)."""
    from conftest import save_tiny_llama

    return save_tiny_llama(
        tmp_path_factory.mktemp("wide-llama"),
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        max_position_embeddings=128,
    )


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8-block", "mxfp8"])
def test_checkpoint_names_shapes_dtypes_and_codes(recipe, wide_llama, ptq_run, tmp_path):
    out = tmp_path / recipe
    code, _, err = ptq_run(
        "quantize", wide_llama, samples=None, recipe=recipe, verify_windows=2, o=out
    )
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == ("mxfp8-quantized" if recipe == "mxfp8" else "float-quantized")
    tensors = safetensors.torch.load_file(str(out / "model.safetensors"))
    source = safetensors.torch.load_file(str(wide_llama / "model.safetensors"))
    assert not any(
        k.endswith(".input_scale") for k in tensors
    )  # dynamic inputs: the engine computes them
    layer = "model.layers.0.mlp.down_proj"  # [256, 384]
    codes, scale = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (256, 384)
    w = source[f"{layer}.weight"].float().numpy()
    if recipe == "fp8-dynamic":
        assert scale.dtype == torch.float32 and scale.shape == (256, 1)
        s = np.abs(w).max(1, keepdims=True) / np.float32(448.0)
    elif recipe == "fp8-block":
        assert scale.dtype == torch.float32 and scale.shape == (2, 3)
        s = np.abs(w.reshape(2, 128, 3, 128)).max((1, 3)) / np.float32(448.0)
        s = np.repeat(np.repeat(s, 128, 0), 128, 1)
    else:
        assert scale.dtype == torch.uint8 and scale.shape == (256, 12)
        s = np.exp2(
            np.ceil(np.log2(np.abs(w.reshape(256, 12, 32)).max(-1).astype(np.float64) / 448.0))
        ).astype(np.float32)
        assert np.array_equal(scale.numpy(), (np.log2(s) + 127).astype(np.uint8))
        s = np.repeat(s, 32, 1)
    assert np.array_equal(codes.view(torch.uint8).numpy(), _e4m3_codes(w / s).view(np.uint8))
    info = json.loads((out / "ptq-export.json").read_text())
    assert info["verification"]["passed"] and info["verification"]["kl_div"] <= 1e-6
    assert math.isclose(
        info["verification"]["reloaded_perplexity"],
        info["verification"]["simulated_perplexity"],
        rel_tol=1e-4,
    )
    # the file check covers every quantized layer's codes and weight_scale (block and MX scales too), bit for bit
    layers = info["format"]["quantized_layers"]
    assert (
        info["verification"]["tensors_checked_in_file"] == 2 * layers
        and not info["verification"]["tensors_differing"]
    )
    # the card says what loaded it, offers transformers' snippet only where transformers runs it, and tags it fp8
    card = (out / "README.md").read_text()
    reader = info["verification"]["loader"].startswith("ptq's")
    assert reader == (
        recipe == "mxfp8"
    )  # transformers' compressed-tensors fails on MX scales (a dtype mismatch)
    assert ("| reloaded (ptq reader) |" in card) == reader
    # ...and where only bfloat16 runs (MX: compressed-tensors decompresses MX scales in bfloat16), with that dtype,
    # once transformers' bfloat16 weights were seen equal to the files' codes x scales
    bf16 = info["verification"].get("transformers_bfloat16")
    assert (bf16 is not None) == reader
    if reader:
        assert bf16 == {"runs": True, "layers": layers, "equal": layers}
        assert "transformers runs this checkpoint in bfloat16 only" in card
        assert 'from_pretrained("PATH", dtype=torch.bfloat16)' in card and "import torch" in card
    else:
        assert 'from_pretrained("PATH")' in card
    assert "tags: [ptq, compressed-tensors, fp8]" in card


# -- FP8 KV cache, per tensor and per head, with any FP8 recipe ----------------------------------------------


def test_kv_cache_option_combines_with_fp8_recipes_only():
    r = load_recipe("fp8-dynamic+kv-head")
    assert (
        r.name == "fp8-dynamic+kv-head"
        and r.kv_cache.granularity == gr.PerHead()
        and r.needs_calibration
    )
    assert r.weights == load_recipe("fp8-dynamic").weights
    assert load_recipe("mxfp8+kv").kv_cache.granularity == gr.PerTensor()
    with pytest.raises(PtqError, match="FP8 KV cache to an FP8 recipe"):
        load_recipe("int8+kv")
    with pytest.raises(PtqError, match="already quantizes the KV cache"):
        load_recipe("paper-e4m3-kv+kv")
    with pytest.raises(PtqError, match="per-head scales apply to the KV cache"):
        parse_recipe(
            {
                "name": "x",
                "weights": {"format": "e4m3"},
                "inputs": {"format": "e4m3", "granularity": "head"},
            }
        )


def test_per_head_kv_amax_is_each_heads_max_of_k_and_v_after_rope(tiny_model):
    """The reference: K and V as transformers' own eager attention receives them (after RoPE), captured."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ptq.calibration.calibrate import calibrate
    from ptq.quantization.plan import calibration_targets, resolve_plans

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0)
    )
    seen: dict[int, list] = {}

    def capture(module, query, key, value, *args, **kwargs):
        seen.setdefault(module.layer_idx, []).append((key.detach().clone(), value.detach().clone()))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("capture-kv", capture)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "capture-kv"
    with torch.inference_mode():
        model(input_ids=ids)
    model.config._attn_implementation = previous

    layers, channels = calibration_targets(
        resolve_plans(model, [load_recipe("fp8-e4m3+kv-head")]).values()
    )
    assert (
        "model.layers.0.self_attn.key" in channels and "model.layers.1.self_attn.value" in channels
    )
    calibration = calibrate(model, ids, layers, channels=channels, batch_size=3)
    for idx, ((k, v),) in seen.items():
        for name, x in (("key", k), ("value", v)):
            per_head = np.abs(x.numpy()).max(
                axis=(0, 2, 3)
            )  # [batch, kv heads, tokens, dim] -> per head
            got = calibration.input_channel_amax[f"model.layers.{idx}.self_attn.{name}"].numpy()
            assert np.array_equal(got, per_head)
            assert (
                calibration.input_amax[f"model.layers.{idx}.self_attn.{name}"].item()
                == per_head.max()
            )


@pytest.mark.parametrize("option", ["kv", "kv-head"])
def test_kv_cache_checkpoint_has_compressed_tensors_kv_scales(
    option, tiny_model, ptq_run, tmp_path
):
    from ptq.calibration.calibrate import load_calibration

    out, calib = tmp_path / option, tmp_path / "calib.safetensors"
    code, _, err = ptq_run("calibrate", tiny_model, recipe=f"fp8-e4m3+{option}", o=calib)
    assert code == 0, err
    code, _, err = ptq_run(
        "quantize",
        tiny_model,
        data=None,
        samples=None,
        recipe=f"fp8-e4m3+{option}",
        calib=calib,
        verify_windows=2,
        o=out,
    )
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == (
        "attn_head" if option == "kv-head" else "tensor"
    )
    assert (
        config["kv_cache_scheme"]["type"] == "float" and config["kv_cache_scheme"]["num_bits"] == 8
    )
    tensors = safetensors.torch.load_file(str(out / "model.safetensors"))
    calibration = load_calibration(calib)
    for short, name in (("k", "key"), ("v", "value")):
        scale = tensors[f"model.layers.1.self_attn.{short}_scale"]
        amax_ = (calibration.input_channel_amax if option == "kv-head" else calibration.input_amax)[
            f"model.layers.1.self_attn.{name}"
        ]
        assert scale.dtype == torch.float32
        assert scale.shape == ((2, 1, 1) if option == "kv-head" else (1,))  # 2 KV heads
        assert np.array_equal(
            scale.flatten().numpy(), (amax_.float().numpy() / np.float32(448.0)).flatten()
        )
    info = json.loads((out / "ptq-export.json").read_text())
    ver = info["verification"]
    assert (
        ver["passed"]
        and ver["kv_scales_checked_in_file"] == 4
        and ver["input_scales_checked_in_file"] == 0
    )
    # k_scale / v_scale are scales the export adds, not source tensors: the 16-bit size and "other tensors" leave
    # them out, as every other scale
    size = info["size"]
    quantized = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
    scales = [t for name, t in tensors.items() if name.endswith("_scale")]
    assert size["scale_bytes"] == sum(t.numel() * 4 for t in scales)
    others = [
        t
        for name, t in tensors.items()
        if not name.endswith("_scale") and name[: -len(".weight")] not in quantized
    ]
    assert size["other_bytes"] == sum(t.numel() * t.element_size() for t in others)
    card = (out / "README.md").read_text()
    layers = info["format"]["quantized_layers"]
    assert (
        f"| layers the loader runs with input quantization (static or dynamic) | {layers} | {layers} | all |"
        in card
    )
    assert (
        "| KV-cache scales (`k_scale`, `v_scale`" in card
        and "input scales the loader does not apply" not in card
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_every_scheme_exports_a_moe_model_per_expert_and_verifies(family, tmp_path, ptq_run):
    """Dimensions of 128 (the block scheme's tiles); each expert's projections written 2-D under the checkpoint's
    own names, with the scheme's scales; reloaded (by transformers, or ptq's reader where transformers cannot
    run the scheme) and equal to the simulation."""
    import families

    wide = dict(
        hidden_size=128, intermediate_size=128, head_dim=32
    )  # Mixtral's experts are intermediate_size wide
    wide |= {} if family == "mixtral" else dict(moe_intermediate_size=128)
    model_dir = tmp_path / family
    families.build(family, **wide).save_pretrained(model_dir)
    families.make_tokenizer().save_pretrained(model_dir)
    down = {
        "mixtral": "model.layers.1.block_sparse_moe.experts.3.w2",
        "qwen3_moe": "model.layers.1.mlp.experts.3.down_proj",
    }[family]
    for recipe, scale_shape, scale_dtype in (
        ("fp8-dynamic", (128, 1), torch.float32),
        ("fp8-block", (1, 1), torch.float32),
        ("mxfp8", (128, 4), torch.uint8),
    ):
        out = tmp_path / f"{family}-{recipe}"
        code, _, err = ptq_run(
            "quantize", model_dir, samples=None, recipe=recipe, seq_len=16, verify_windows=2, o=out
        )
        assert code == 0, err
        tensors = safetensors.torch.load_file(str(out / "model.safetensors"))
        assert tensors[f"{down}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{down}.weight_scale"].shape == scale_shape
        assert (
            tensors[f"{down}.weight_scale"].dtype == scale_dtype
            and f"{down}.input_scale" not in tensors
        )
        info = json.loads((out / "ptq-export.json").read_text())
        assert info["verification"]["passed"] and info["verification"]["kl_div"] <= 1e-6, (
            recipe,
            info["verification"],
        )


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8"])
def test_group_and_block_scales_stay_simulated_under_matmul_fp8_where_torch_has_no_kernel(
    recipe, wide_llama
):
    """MX groups run simulated with --matmul fp8 everywhere; 128 x 128 blocks where torch has no block-wise kernel
    for the device (every CPU: torch's own refusal is the reason the report gives), with exactly the simulation's
    logits."""
    import copy
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from ptq.calibration.clips import quantize_
    from ptq.quantization.quantize import QuantLinear, blockwise_unavailable

    why = blockwise_unavailable(torch.device("cpu"), torch.float32)
    # torch's own refusal, in its own words (2.13: "ValueError: Invalid scaling configuration"; 2.11:
    # "NotImplementedError: Could not run 'aten::_scaled_mm_v2' ... CPU")
    assert why.startswith("torch.nn.functional.scaled_mm on cpu: ") and why.split(": ")[1] in (
        "ValueError",
        "NotImplementedError",
    )

    model = AutoModelForCausalLM.from_pretrained(wide_llama)
    r = load_recipe(recipe)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5)
    )
    simulated = quantize_(copy.deepcopy(model), r, None)
    real = quantize_(copy.deepcopy(model), r, None, matmul="fp8")
    quantized = [
        m for m in real.modules() if isinstance(m, QuantLinear) and m.weights.format.name == "e4m3"
    ]
    assert quantized and all(not m.fp8_matmul for m in quantized)
    calls = []
    with (
        torch.no_grad(),
        mock.patch.object(torch, "_scaled_mm", lambda *a, **k: calls.append(1)),
        mock.patch.object(torch.nn.functional, "scaled_mm", lambda *a, **k: calls.append(1)),
    ):
        assert torch.equal(simulated(input_ids=ids).logits, real(input_ids=ids).logits)
    assert not calls


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="no Hopper-class CUDA device (block-wise FP8 matmuls: compute capability 9.0+)",
)
def test_cuda_block_fp8_matmul_matches_the_simulation_or_says_why_not(wide_llama):
    """On a GPU, fp8-block with --matmul fp8: where torch's block-wise scaled_mm runs (checked once against the
    simulation), every 128 x 128 layer uses it and the logits match the simulation's to bf16 precision; where it
    does not, the layers stay simulated and blockwise_unavailable names torch's refusal."""
    import copy

    from transformers import AutoModelForCausalLM

    from ptq.calibration.clips import quantize_
    from ptq.quantization.quantize import QuantLinear, blockwise_unavailable

    model = AutoModelForCausalLM.from_pretrained(wide_llama).to("cuda", torch.bfloat16)
    r = load_recipe("fp8-block")
    ids = torch.randint(
        0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(5)
    ).cuda()
    simulated = quantize_(copy.deepcopy(model), r, None)
    real = quantize_(copy.deepcopy(model), r, None, matmul="fp8")
    blocks = [
        m for m in real.modules() if isinstance(m, QuantLinear) and m.weights.format.name == "e4m3"
    ]
    why = blockwise_unavailable(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if torch.cuda.get_device_capability() == (9, 0) and cuda >= (
        12,
        9,
    ):  # cuBLAS's block-wise FP8: Hopper, CUDA 12.9+
        assert why is None, why
    assert blocks and all(m.fp8_matmul == (why is None) for m in blocks), why
    with torch.no_grad():
        want, got = simulated(input_ids=ids).logits.float(), real(input_ids=ids).logits.float()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2
